//! One training step of one rank as the planner takes it ([`StepSpec`]) and
//! its predicted peak ([`Prediction`]).

use super::device::DeviceKind;
use crate::attention::CpPlan;
use crate::backend::Category;
use crate::model::{MemoryPolicy, ModelConfig};
use crate::train::config::TrainConfig;

/// One training step of one rank, as `train::trainer` runs it.
#[derive(Debug, Clone)]
pub struct StepSpec {
    pub model: ModelConfig,
    pub plan: CpPlan,
    /// Data-parallel degree (FSDP shards over `data × context` ranks).
    pub data: usize,
    pub policy: MemoryPolicy,
    /// Shard parameters, gradients and optimizer state over every rank (FSDP).
    pub fsdp: bool,
    /// HSDP: shard groups of `world / fsdp_replicas` ranks (1: the world).
    pub fsdp_replicas: usize,
    /// Sequences per optimizer step (`--grad-accum`).
    pub grad_accum: usize,
    pub device: DeviceKind,
    /// Include AdamW state (a training step) or not (`loss_and_grads_cpu`).
    pub optimizer: bool,
    /// How AdamW keeps its state (`--optim-state`, `--master-weights`).
    pub state: crate::optim::StateFormat,
    /// What the linear layers compute in (`--precision`): under `fp8`
    /// each linear GEMM's quantized operand copies.
    pub precision: crate::backend::fp8::Precision,
    /// The parameters not trained (`--freeze`): no gradients, no optimizer state.
    pub freeze: crate::model::Freeze,
    /// LoRA adapters trained beside the frozen base (`--lora-rank`; `freeze`
    /// is then the whole base): their weights, F32 gradients and optimizer
    /// state, and the transient buffers of each application.
    pub lora: Option<crate::model::lora::LoraConfig>,
}

impl StepSpec {
    /// The lowest block whose backward runs (`Freeze::backward_floor`): the
    /// blocks below it keep nothing for a backward, so neither kept
    /// attention nor an offloaded checkpoint means anything there.
    pub fn backward_floor(&self) -> usize {
        self.freeze
            .backward_floor(&self.model, self.lora.is_some())
            .min(self.model.layers)
    }

    /// The step of the training run `cfg` under `plan` on `device`.
    pub fn of_run(cfg: &TrainConfig, plan: &CpPlan, device: DeviceKind) -> Self {
        StepSpec {
            model: cfg.model.clone(),
            plan: plan.clone(),
            data: cfg.data_parallel,
            policy: cfg.policy,
            fsdp: cfg.fsdp,
            fsdp_replicas: cfg.fsdp_replicas,
            grad_accum: cfg.grad_accum,
            device,
            optimizer: true,
            state: cfg.optim.state,
            precision: cfg.precision,
            freeze: cfg.freeze.clone(),
            lora: cfg.lora.as_ref().map(|l| l.config.clone()),
        }
    }
}

/// A predicted peak.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Device bytes at the peak.
    pub peak: usize,
    /// Bytes of each category at the device peak.
    pub at_peak: Vec<(Category, usize)>,
    /// Highest host (offload) bytes.
    pub host_peak: usize,
    /// The part of the step where the device peak happens.
    pub peak_at: &'static str,
}

impl Prediction {
    /// Bytes of `cat` at the device peak (`offload_host`: the host peak).
    pub fn at(&self, cat: Category) -> usize {
        if cat == Category::Offload {
            return self.host_peak;
        }
        self.at_peak
            .iter()
            .find(|(c, _)| *c == cat)
            .map_or(0, |x| x.1)
    }
    /// The bytes a rank needs of its memory: the device peak, and on the
    /// CPU the offloaded (host) bytes too, which share that memory.
    pub fn rank_bytes(&self, device: DeviceKind) -> usize {
        if device.is_cuda() {
            self.peak
        } else {
            self.peak + self.host_peak
        }
    }
    /// The device category holding the most bytes at the peak.
    pub fn largest_category(&self) -> Category {
        self.at_peak
            .iter()
            .filter(|(c, _)| c.on_device())
            .max_by_key(|(_, b)| *b)
            .map_or(Category::Activations, |x| x.0)
    }
}

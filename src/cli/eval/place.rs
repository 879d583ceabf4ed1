//! Where an evaluation runs, shared by `upipe eval` and `upipe eval
//! --task`: the model of `--model-dir`, the flags' strategy, stages and
//! adapter on `upipe train`'s mesh and route, its weights, and the GPU
//! backends of thread ranks.

use super::args::EvalArgs;
use crate::attention::Strategy;
use crate::backend::cuda::cudnn::AttnKernel;
use crate::checkpoint::{ExtraTensors, HostTensor, load_hf_model_with};
use crate::cli::config::for_key;
use crate::cli::schedule::ChunkHeads;
use crate::cli::train::{
    Device, Launched, MeshChoice, Route, default_mesh, resolve_mesh, route_for,
};
use crate::comm::MeshShape;
use crate::comm::env::DistEnv;
use crate::data::PackMode;
use crate::error::Result;
use crate::model::ModelConfig;
use crate::train::eval::EvalConfig;
use std::collections::BTreeMap;
use std::path::Path;

/// The mesh: with no mesh flag and `ranks` available, `upipe train`'s
/// default mesh for them (else one rank); with some, `upipe train`'s mesh
/// of them ([`resolve_mesh`]: the rest fitted around them to `ranks`, or 1).
fn eval_mesh(
    a: &EvalArgs,
    strategy: Strategy,
    model: &ModelConfig,
    seq: usize,
    ranks: Option<usize>,
) -> MeshChoice {
    let chunk = ChunkHeads::start(a.mesh.chunk_heads);
    // a length every mesh of n ranks divides, since eval pads the window
    let padded = |n: usize| seq.next_multiple_of(2 * n);
    if a.mesh.any_given() {
        let seq = padded(ranks.unwrap_or(1));
        return resolve_mesh(a.mesh.flags(), strategy, model, seq, chunk, ranks);
    }
    let fitted = ranks.and_then(|n| default_mesh(strategy, model, padded(n), chunk, n));
    fitted.unwrap_or(MeshChoice {
        data: 1,
        ulysses: 1,
        ring: 1,
    })
}

/// The model on its mesh and where its ranks run: what `upipe eval` and
/// `upipe eval --task` place alike ([`place`]).
pub struct Placed {
    pub cfg: EvalConfig,
    pub device: Device,
    pub kernel: AttnKernel,
    pub env: Option<DistEnv>,
    pub gpus: usize,
    pub shape: MeshShape,
    pub route: Route,
}

impl Placed {
    /// Whether this process reports (rank 0, or the only process).
    pub fn lead(&self) -> bool {
        self.route != Route::ProcessRank || self.env.as_ref().is_none_or(|e| e.rank == 0)
    }
}

/// The model of `--model-dir` (not an adapter's directory).
pub(super) fn open_model(model_dir: &Path) -> Result<ModelConfig> {
    crate::checkpoint::refuse_adapter_dir(model_dir, "--model-dir")?;
    ModelConfig::resolve(&model_dir.to_string_lossy())
}

/// The evaluation of `model` placed for windows of up to `seq` inputs:
/// the flags' device, kernel, strategy, stages and adapter, the mesh
/// ([`eval_mesh`]) and where its ranks run.
pub(super) fn place(a: &EvalArgs, model: &ModelConfig, seq: usize) -> Result<Placed> {
    let k = EvalArgs::KEYS;
    let device: Device = for_key(k, "device", a.device.parse())?;
    let kernel: AttnKernel = for_key(k, "attn_kernel", a.attn_kernel.parse())?;
    let gpus = match device {
        Device::Cpu => 0,
        _ => crate::cli::train::visible_gpus(),
    };
    let env = DistEnv::from_env()?;
    let launched = Launched::from_env(env.as_ref());
    let strategy: Strategy = for_key(k, "attn", a.attn.parse())?;
    let mut cfg = EvalConfig {
        strategy,
        chunk_heads: ChunkHeads::fixed(a.mesh.chunk_heads, "eval")?,
        fwd_chunk_heads: a.fwd_chunk_heads,
        seq: a.seq,
        buckets: a.buckets,
        loss_chunk: a.loss_chunk,
        pack: a.pack.unwrap_or(PackMode::Stream),
        lora: match &a.lora_from {
            Some(dir) => Some(crate::checkpoint::peft::read_adapter(dir, model)?.weights),
            None => None,
        },
        ..EvalConfig::new(model.clone())
    };
    let ranks = match launched {
        Some(l) => Some(l.world_size),
        None if device != Device::Cpu && gpus >= 2 => Some(gpus),
        None => None,
    };
    let mesh = eval_mesh(a, strategy, model, seq, ranks);
    mesh.check_countable()?;
    (cfg.data_parallel, cfg.ulysses, cfg.ring) = (mesh.data, mesh.ulysses, mesh.ring);
    let shape = cfg.mesh_shape(&cfg.plan(seq)?);
    let nccl = || {
        crate::comm::nccl::library()
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let route = route_for("eval", device, launched, gpus, shape, &nccl)?;
    Ok(Placed {
        cfg,
        device,
        kernel,
        env,
        gpus,
        shape,
        route,
    })
}

/// The weights of `--model-dir` by HF name, with `--allow-extra-tensors`'
/// rule (tensors of adapters beside them ignored under `--lora-from`).
pub(super) fn load_weights(
    a: &EvalArgs,
    model_dir: &Path,
    model: &ModelConfig,
) -> Result<BTreeMap<String, HostTensor>> {
    let extra = match a.allow_extra_tensors {
        true => ExtraTensors::Ignore,
        false => ExtraTensors::Refuse,
    }
    .beside_adapters(a.lora_from.is_some());
    load_hf_model_with(model_dir, model, extra)
}

/// A maker of thread ranks' backends spread round-robin over `gpus`
/// devices, each opened once here first (a failure is an error here,
/// not inside a rank thread).
pub(super) fn gpu_backends(
    gpus: usize,
    kernel: AttnKernel,
) -> Result<impl Fn() -> crate::backend::cuda::CudaBackend + Sync> {
    use crate::backend::cuda::CudaBackend;
    use std::sync::atomic::{AtomicUsize, Ordering};
    for g in 0..gpus {
        CudaBackend::new(g)?;
    }
    let next = AtomicUsize::new(0);
    Ok(move || {
        let g = next.fetch_add(1, Ordering::Relaxed) % gpus;
        let mut b = CudaBackend::new(g).expect("the device opened a moment ago");
        b.set_attn_kernel(kernel);
        b
    })
}

//! One resolver for every decision a run makes for itself: the typed
//! choices of a run ([`RunRequest`]: model, mesh, strategy, stage widths,
//! FSDP mode, memory policy, each rank's budgets) turned into a
//! [`ResolvedRun`], every `auto` decided, always in one order:
//!
//! FSDP → `--checkpoint-every` → `--offload` → `--save-attention` →
//! `--chunk-heads` (wider backward stages) → `--offload-optimizer` →
//! `--fwd-chunk-heads` (wider forward stages),
//!
//! each choice judged by the planner's prediction beside the ones decided
//! before it. `upipe train` resolves its run here, and `upipe plan`
//! resolves each strategy at each length here, so a plan at a length is
//! what `train` runs at that length ([`Depth::Run`]); the search for the
//! longest context holds some choices fixed instead ([`Depth::Search`]).

use super::checkpoint_every::{CheckpointEvery, every_candidates, first_fitting};
use super::mesh::MeshChoice;
use super::stage_width::{ChunkHeads, FwdChunk};
use super::{
    DeviceKind, HostUpdateChoice, OffloadBlocks, OptimizerOffload, Prediction, SaveAttention,
    StepSpec, predict_step, trained_state_bytes, widest_fitting,
};
use crate::attention::{CpPlan, Settle, Strategy};
use crate::backend::Bytes;
use crate::backend::cuda::cudnn::sdpa_fp8::{self, FAST_GQA_BWD_HEADS};
use crate::error::Result;
use crate::model::decoder::attn_dims;
use crate::model::{HostUpdate, MemoryPolicy, ModelConfig};

/// `--fsdp`: whether parameters, gradients and AdamW state are sharded
/// over every rank of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FsdpMode {
    /// On when the mesh has more than one rank and the whole model's states
    /// take more than half of each rank's memory ([`FsdpMode::resolve`]).
    #[default]
    Auto,
    On,
    Off,
}

impl std::str::FromStr for FsdpMode {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(FsdpMode::Auto),
            "on" => Ok(FsdpMode::On),
            "off" => Ok(FsdpMode::Off),
            other => crate::config_err!("--fsdp {other}: use auto, on or off"),
        }
    }
}

impl std::fmt::Display for FsdpMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FsdpMode::Auto => "auto",
            FsdpMode::On => "on",
            FsdpMode::Off => "off",
        })
    }
}

impl FsdpMode {
    /// Whether a run of `world` ranks shards, given the bytes of the whole
    /// model's states per rank and the memory each rank has (`None`:
    /// unknown); with a note to log when the choice needs saying.
    pub fn resolve(
        self,
        world: usize,
        states: usize,
        budget: Option<usize>,
    ) -> (bool, Option<String>) {
        match (self, world) {
            (FsdpMode::Off, _) => (false, None),
            (FsdpMode::On, 1) => (
                false,
                Some(
                    "--fsdp on with one rank: there is nothing to shard, training unsharded".into(),
                ),
            ),
            (FsdpMode::On, _) => (true, None),
            (FsdpMode::Auto, 1) => (false, None),
            (FsdpMode::Auto, _) => match budget {
                Some(b) if states <= b / 2 => (false, None),
                _ => (
                    true,
                    Some(format!(
                        "--fsdp auto: sharding over {world} ranks (the whole model's states are {} per rank)",
                        Bytes(states)
                    )),
                ),
            },
        }
    }
}

/// The memory policy as a run chooses it (`--checkpoint`, `--offload`,
/// `--offload-optimizer`, `--tiled-mlp`, `--loss-chunk`,
/// `--save-attention`, `--checkpoint-every`), its `auto` choices not yet
/// decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryChoices {
    /// `--checkpoint`: full activation checkpointing per block.
    pub checkpoint: bool,
    /// `--offload`: blocks whose checkpointed input lives on the host.
    pub offload: OffloadBlocks,
    /// `--offload-optimizer`: units whose optimizer state lives on the host.
    pub offload_optimizer: OptimizerOffload,
    /// `--host-update`: where that state is updated.
    pub host_update: HostUpdateChoice,
    /// `--tiled-mlp`: the MLP in token tiles.
    pub tiled_mlp: bool,
    /// `--loss-chunk`: rows of logits per fused-loss chunk.
    pub loss_chunk: usize,
    /// `--save-attention`: blocks that keep their attention output.
    pub save_attention: SaveAttention,
    /// `--checkpoint-every`: blocks per segment of segment checkpointing.
    pub checkpoint_every: CheckpointEvery,
}

impl MemoryChoices {
    /// The policy of a model of `layers` blocks: `--offload all` is every
    /// block, `--offload auto` is `auto_blocks` until it is resolved against
    /// a budget; `--offload-optimizer auto` is every unit until it is
    /// resolved; `--save-attention` is resolved later too (none here);
    /// `--checkpoint-every auto` is 1 until it is resolved.
    pub fn policy(&self, layers: usize, auto_blocks: usize) -> MemoryPolicy {
        MemoryPolicy {
            checkpoint: self.checkpoint,
            offload: match self.offload {
                OffloadBlocks::Blocks(n) => n,
                OffloadBlocks::All => layers,
                OffloadBlocks::Auto => auto_blocks,
            },
            offload_optimizer: self.offload_optimizer.units(layers),
            // `auto` is decided with the training state ([`Resolution`])
            host_update: match self.host_update {
                HostUpdateChoice::Is(u) => u,
                HostUpdateChoice::Auto => HostUpdate::Cpu,
            },
            tiled_mlp: self.tiled_mlp,
            loss_chunk: self.loss_chunk,
            save_attention: 0,
            checkpoint_every: match self.checkpoint_every {
                CheckpointEvery::Blocks(k) => k,
                CheckpointEvery::Auto => 1,
            },
        }
    }
}

/// How UPipe's stages are chosen (`--chunk-heads`, `--fwd-chunk-heads`)
/// and how the staged engine orders its work (`--overlap`, `--settle-every`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StageChoices {
    /// Heads per backward stage (`None`: the default, `auto` where a
    /// budget is known, otherwise Pu).
    pub chunk_heads: Option<ChunkHeads>,
    /// Heads per forward stage (`--fwd-chunk-heads`).
    pub fwd: FwdChunk,
    /// `--overlap`: transfers beside attention (`plan`, `bench attn`).
    pub overlap: bool,
    /// `--settle-every`: when backward takes in query gradients.
    pub settle: Settle,
}

/// The memory one rank of a run has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankBudget {
    /// All of the device's memory per rank: what `--fsdp auto` weighs the
    /// model's states against (`None`: unknown).
    pub memory: Option<usize>,
    /// Device bytes the ledger may use (`memory` less what lies outside it):
    /// what every other `auto` fits in (`None`: unknown, and `auto` keeps
    /// its cautious default).
    pub ledger: Option<usize>,
    /// Host bytes for offloaded tensors per rank, as planned
    /// ([`crate::plan::preflight::planned_host`]; `None`: unchecked).
    pub host: Option<usize>,
}

impl RankBudget {
    /// Whether a step predicted as `p` fits: its device peak within the
    /// ledger's budget (on the CPU with the offloaded tensors, which share
    /// the host's memory there) and its host peak within the host's
    /// (unknown budgets fit).
    pub fn fits(&self, p: &Prediction, on_gpu: bool) -> bool {
        let device = if on_gpu { p.peak } else { p.peak + p.host_peak };
        self.ledger.is_none_or(|l| device <= l) && self.host.is_none_or(|h| p.host_peak <= h)
    }

    /// The budget of a rank with `memory` device bytes of which `reserve`
    /// stay outside the ledger, and `host` bytes for offloaded tensors.
    pub fn with_reserve(memory: usize, reserve: usize, host: Option<usize>) -> Self {
        RankBudget {
            memory: Some(memory),
            ledger: Some(memory.saturating_sub(reserve)),
            host,
        }
    }
}

/// Host bytes one rank plans to pin for offloaded tensors when
/// `node_bytes` of a node are shared by `ranks_on_node` ranks (the pinned
/// pool's slack left out, as `train` leaves it out).
pub fn host_share(node_bytes: usize, ranks_on_node: usize) -> usize {
    super::preflight::planned_host(node_bytes / ranks_on_node.max(1))
}

/// Everything a run decides from: its typed choices and its budgets.
#[derive(Debug, Clone)]
pub struct RunRequest {
    /// The model trained or planned.
    pub model: ModelConfig,
    /// The attention strategy (`--attn`).
    pub strategy: Strategy,
    /// The mesh, resolved ([`crate::plan::mesh::resolve_mesh`] or `plan`'s `--gpus`).
    pub mesh: MeshChoice,
    /// Tokens per sequence (global).
    pub seq: usize,
    /// Stage widths and the staged engine's order.
    pub stages: StageChoices,
    /// `--fsdp`.
    pub fsdp: FsdpMode,
    /// `--fsdp-replicate`: shard groups of `world / fsdp_replicas` ranks.
    pub fsdp_replicas: usize,
    /// The run resumes a sharded checkpoint (on one rank it is gathered by
    /// sharding over that rank, unless `--fsdp off`).
    pub sharded_resume: bool,
    /// Sequences per optimizer step (`--grad-accum`).
    pub grad_accum: usize,
    /// The memory policy chosen.
    pub memory: MemoryChoices,
    /// `--freeze`: parameters without gradients or optimizer state.
    pub freeze: crate::model::Freeze,
    /// `--lora-rank` and the other LoRA flags: adapters trained beside the
    /// frozen base (`freeze` is then the whole base; never sharded).
    pub lora: Option<crate::model::lora::LoraConfig>,
    /// The dtypes and attention kernels predicted for.
    pub device: DeviceKind,
    /// Each rank's memory.
    pub budget: RankBudget,
    /// How AdamW keeps its state (`--optim-state`, `--master-weights`).
    pub state: crate::optim::StateFormat,
    /// `--optim-state auto`: `state` is ignored and the run takes the
    /// first of [`StateFormat::AUTO_LADDER`](crate::optim::StateFormat)
    /// whose step fits its budget.
    pub state_auto: bool,
    /// What the linear layers compute in (`--precision`).
    pub precision: crate::backend::fp8::Precision,
}

/// How far [`resolve_run`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// Every choice, as `train` runs it.
    Run,
    /// What the search for the longest context holds fixed: stages of Pu
    /// heads for `--chunk-heads auto`, no kept attention for
    /// `--save-attention auto`, every unit's optimizer state on the host
    /// for `--offload-optimizer auto`; wherever that fits, the run resolved
    /// at [`Depth::Run`] fits too.
    Search,
}

/// What a run decided for itself, as the flags that repeat it say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decisions {
    /// Whether the run shards (FSDP).
    pub fsdp: bool,
    /// `--chunk-heads` decided (`None`: the default, Pu).
    pub chunk_heads: Option<usize>,
    /// `--fwd-chunk-heads` decided (`None`: the backward's).
    pub fwd_chunk_heads: Option<usize>,
    /// The memory policy, every count decided.
    pub policy: MemoryPolicy,
    /// Data replicas and the plan's Ulysses and ring degrees.
    pub mesh: MeshChoice,
    /// Heads per backward and forward stage of the plan.
    pub stages: (usize, usize),
}

/// A run with every choice decided, and the planner's prediction of its step.
#[derive(Debug, Clone)]
pub struct ResolvedRun {
    /// The step as it runs (plan, policy, sharding).
    pub spec: StepSpec,
    /// The planner's prediction of the step on the rank that needs the most.
    pub prediction: Prediction,
    /// What the run decided for itself.
    pub decisions: Decisions,
    /// What `--fsdp auto` (or a one-rank `--fsdp on`) decided, when that
    /// needs saying (a warning).
    pub fsdp_note: Option<String>,
    /// What each `auto` decided, one line each, in order.
    pub notes: Vec<String>,
}

impl RunRequest {
    /// The plan of this run with backward stages of `chunk` heads (`None`:
    /// Pu) and the given `--fwd-chunk-heads` (`auto`: the backward's, until
    /// [`resolve_run`] widens them); stage widths apply to UPipe only.
    pub fn stage_plan(&self, chunk: Option<usize>) -> Result<CpPlan> {
        let upipe = self.strategy.has_head_stages();
        let fwd = match self.stages.fwd {
            FwdChunk::Heads(n) if upipe => Some(n),
            _ => None,
        };
        let m = &self.mesh;
        let dims = attn_dims(&self.model);
        let chunk = chunk.filter(|_| upipe);
        let plan = CpPlan::new(self.strategy, &dims, self.seq, m.ulysses, m.ring, chunk)?
            .with_fwd_chunk(fwd)?;
        let staged = self.strategy.is_context_parallel();
        Ok(plan
            .with_overlap(self.stages.overlap && staged)
            .with_settle(self.stages.settle))
    }

    /// The step of `plan` under `policy`, sharded or not.
    fn spec(&self, plan: &CpPlan, policy: MemoryPolicy, fsdp: bool) -> StepSpec {
        StepSpec {
            model: self.model.clone(),
            plan: plan.clone(),
            data: self.mesh.data,
            policy,
            fsdp,
            fsdp_replicas: self.fsdp_replicas,
            grad_accum: self.grad_accum,
            device: self.device,
            optimizer: true,
            state: self.state,
            precision: self.precision,
            freeze: self.freeze.clone(),
            lora: self.lora.clone(),
        }
    }
}

/// Resolves every `auto` of `req` in the one order (the module's doc), as
/// far as `depth` says; the prediction is of the step so resolved. Under
/// `--optim-state auto` each training state of the ladder is resolved in
/// turn until one fits (the last is taken when none does, for the
/// preflight to refuse with its breakdown).
pub fn resolve_run(req: &RunRequest, depth: Depth) -> Result<ResolvedRun> {
    if !req.state_auto {
        return resolve_state(req, depth);
    }
    let ladder = crate::optim::StateFormat::AUTO_LADDER;
    let mut refused = Vec::new();
    for (i, state) in ladder.iter().enumerate() {
        let tried = RunRequest {
            state: *state,
            state_auto: false,
            ..req.clone()
        };
        let mut run = resolve_state(&tried, depth)?;
        let fits = req.budget.fits(&run.prediction, req.device.is_cuda());
        if fits || i + 1 == ladder.len() {
            let why = match (fits, refused.is_empty()) {
                (true, true) => "the exact state fits".to_string(),
                (true, false) => format!("{} did not fit", refused.join("; ")),
                (false, _) => "the most compact; the run does not fit with it either".into(),
            };
            run.notes
                .insert(0, format!("--optim-state auto: {state} ({why})"));
            return Ok(run);
        }
        refused.push(format!(
            "{state}: a peak of {} on the device and {} on the host",
            Bytes(run.prediction.peak),
            Bytes(run.prediction.host_peak)
        ));
    }
    unreachable!("the ladder is not empty")
}

/// [`resolve_run`] of one training state.
fn resolve_state(req: &RunRequest, depth: Depth) -> Result<ResolvedRun> {
    let mut r = Resolution::start(req)?;
    r.shard()?;
    r.checkpoint_every()?;
    r.offload()?;
    r.save_attention(depth)?;
    if depth == Depth::Run {
        r.widen_stages()?;
        r.offload_optimizer()?;
    }
    r.forward_stages()?;
    r.finish()
}

/// A run part way through [`resolve_run`].
struct Resolution<'a> {
    req: &'a RunRequest,
    plan: CpPlan,
    policy: MemoryPolicy,
    fsdp: bool,
    chunk_heads: Option<usize>,
    fwd_chunk_heads: Option<usize>,
    fsdp_note: Option<String>,
    notes: Vec<String>,
}

impl<'a> Resolution<'a> {
    fn start(req: &'a RunRequest) -> Result<Self> {
        let chunk_heads = ChunkHeads::start(req.stages.chunk_heads);
        let policy = MemoryPolicy {
            host_update: req
                .memory
                .host_update
                .resolve(req.state, req.device.is_cuda()),
            ..req.memory.policy(req.model.layers, 0)
        };
        Ok(Resolution {
            plan: req.stage_plan(chunk_heads)?,
            policy,
            fsdp: false,
            chunk_heads,
            fwd_chunk_heads: match req.stages.fwd {
                FwdChunk::Heads(n) => Some(n),
                FwdChunk::Auto => None,
            },
            fsdp_note: None,
            notes: Vec::new(),
            req,
        })
    }

    fn spec(&self) -> StepSpec {
        self.req.spec(&self.plan, self.policy, self.fsdp)
    }

    /// `--fsdp` (auto: from the model's states and each rank's memory) and
    /// `--fsdp-replicate`, which needs sharding.
    fn shard(&mut self) -> Result<()> {
        let req = self.req;
        let world = req.mesh.world_size();
        let gpu = req.device.is_cuda();
        let states = trained_state_bytes(&req.model, gpu, &req.freeze, req.state);
        let (mut fsdp, mut note) = req.fsdp.resolve(world, states, req.budget.memory);
        // FSDP freezes whole units: `auto` does not shard a set that splits one
        if fsdp && req.fsdp == FsdpMode::Auto && req.freeze.split_unit(&req.model).is_some() {
            fsdp = false;
            note = Some(format!(
                "--fsdp auto: not sharding, as --freeze {} freezes part of a unit (FSDP freezes \
                 whole units)",
                req.freeze
            ));
        }
        // `auto` keeps a LoRA run's frozen base replicated (`--fsdp on` shards it)
        if req.lora.is_some() && req.fsdp == FsdpMode::Auto && fsdp {
            fsdp = false;
            note = Some(
                "--fsdp auto: not sharding, as a LoRA run (--lora-rank) keeps the frozen base \
                 replicated (it has no gradient or optimizer state to shard; --fsdp on shards it)"
                    .into(),
            );
        }
        if world == 1 && req.sharded_resume && req.fsdp != FsdpMode::Off {
            fsdp = true;
            note = Some(
                "resuming a sharded checkpoint on one rank: its shards are gathered into one (FSDP over 1 rank)"
                    .into(),
            );
        }
        if req.fsdp_replicas != 1 && !fsdp {
            return crate::config_err!(
                "--fsdp-replicate {} needs sharding: add --fsdp on (this run resolved to unsharded)",
                req.fsdp_replicas
            );
        }
        (self.fsdp, self.fsdp_note) = (fsdp, note);
        Ok(())
    }

    /// `--checkpoint-every` (auto: the segments with the fewest recomputed
    /// blocks whose step fits, `--offload` resolved for each; the search
    /// for the longest context decides it at each length too).
    fn checkpoint_every(&mut self) -> Result<()> {
        let choice = self.req.memory.checkpoint_every;
        let budget = EveryBudget {
            ledger: self.req.budget.ledger,
            host: self.req.budget.host,
            offload: self.req.memory.offload,
        };
        self.policy.checkpoint_every = resolve_checkpoint_every(choice, &self.spec(), budget)?;
        if choice == CheckpointEvery::Auto {
            let spec = self.spec();
            let (layers, floor) = (self.req.model.layers, spec.backward_floor());
            let segments = self.policy.segments(layers, floor);
            self.notes.push(format!(
                "--checkpoint-every auto: {}, {} of {} blocks keep their checkpointed input and \
                 the backward recomputes {} block forwards more",
                self.policy.checkpoint_every,
                segments.kept_inputs(),
                layers - floor,
                segments.recomputed_blocks()
            ));
        }
        Ok(())
    }

    /// `--offload` (auto: the fewest blocks that make the step fit).
    fn offload(&mut self) -> Result<()> {
        let choice = self.req.memory.offload;
        let budget = self.req.budget;
        self.policy.offload = choice.resolve(&self.spec(), budget.ledger, budget.host)?;
        if choice == OffloadBlocks::Auto && self.policy.checkpoint {
            let (n, floor) = (self.policy.offload, self.spec().backward_floor());
            self.notes.push(if floor > 0 && n > floor {
                format!(
                    "--offload auto: the first {n} of {} blocks, of which blocks {floor}..{n} keep their checkpointed input in host memory (the {floor} below run no backward and keep none)",
                    self.req.model.layers
                )
            } else {
                format!(
                    "--offload auto: the first {n} of {} blocks keep their checkpointed input in host memory",
                    self.req.model.layers
                )
            });
        }
        Ok(())
    }

    /// `--save-attention` (auto: the most blocks that fit beside the rest;
    /// none while searching).
    fn save_attention(&mut self, depth: Depth) -> Result<()> {
        let save = match (depth, self.req.memory.save_attention) {
            (Depth::Search, SaveAttention::Auto) => SaveAttention::Blocks(0),
            (_, given) => given,
        };
        save.check(self.policy, self.req.model.layers)?;
        self.policy.save_attention = save.resolve(&self.spec(), self.req.budget.ledger)?;
        if self.policy.checkpoint && depth == Depth::Run {
            self.notes.push(format!(
                "--save-attention {save}: the last {} of {} blocks keep their attention output",
                self.policy.save_attention, self.req.model.layers
            ));
        }
        Ok(())
    }

    /// `--chunk-heads auto` (UPipe; also what no `--chunk-heads` means):
    /// the widest backward stages whose predicted peak fits beside what was
    /// decided before; stays at Pu when none wider fits or the memory is
    /// unknown. A width the heads or a fixed `--fwd-chunk-heads` do not
    /// allow is skipped.
    fn widen_stages(&mut self) -> Result<()> {
        let req = self.req;
        if !req.strategy.has_head_stages() {
            let (heads, pu) = (self.plan.schedule.chunk, self.plan.schedule.pu.max(1));
            if self.slow_fp8_backward(heads) {
                self.notes.push(format!(
                    "--attn {}: each rank's FP8 attention backward is one call of {} grouped \
                     query heads, which cuDNN runs at half BF16's speed; --attn upipe runs it \
                     in stages of {FAST_GQA_BWD_HEADS} query heads a call or fewer",
                    req.strategy.name(),
                    heads / pu
                ));
            }
            return Ok(());
        }
        if let Some(ChunkHeads::Heads(u)) = req.stages.chunk_heads {
            if self.slow_fp8_backward(u) {
                let most = FAST_GQA_BWD_HEADS * self.plan.schedule.pu;
                self.notes.push(format!(
                    "--chunk-heads {u}: cuDNN runs FP8 attention backwards of more than {} \
                     grouped query heads a call at half BF16's speed; --chunk-heads {most} or \
                     fewer avoids it",
                    FAST_GQA_BWD_HEADS
                ));
            }
            return Ok(());
        }
        let Some(room) = req.budget.ledger else {
            return Ok(());
        };
        let (policy, fsdp) = (self.policy, self.fsdp);
        let heads = req.model.heads;
        let pu = self.plan.schedule.pu;
        let slow = |u: usize| self.slow_fp8_backward(u);
        let capped = slow(heads);
        let widest = widest_fitting(heads, pu, |u| {
            if slow(u) {
                return Ok(None);
            }
            let Ok(plan) = req.stage_plan(Some(u)) else {
                return Ok(None);
            };
            let peak = predict_step(&req.spec(&plan, policy, fsdp))?.peak;
            Ok((peak <= room).then_some(plan))
        })?;
        if let Some((u, plan)) = widest {
            self.chunk_heads = Some(u);
            self.plan = plan;
        }
        let u = self.plan.schedule.chunk;
        let why = match capped {
            true => format!(
                " (at most {} a stage, {FAST_GQA_BWD_HEADS} query heads a call: cuDNN's FP8 \
                 backward runs more grouped heads at half BF16's speed)",
                FAST_GQA_BWD_HEADS * pu
            ),
            false => String::new(),
        };
        self.notes.push(format!(
            "--chunk-heads auto: stages of {u} of {heads} heads{why}"
        ));
        Ok(())
    }

    /// Whether backward stages of `u` heads would make each rank's FP8
    /// attention backward (`--precision fp8-attention`, `-bwd`) a call
    /// cuDNN runs slowly: `u / Pu` grouped query heads above
    /// [`FAST_GQA_BWD_HEADS`].
    fn slow_fp8_backward(&self, u: usize) -> bool {
        let m = &self.req.model;
        let hq = u / self.plan.schedule.pu.max(1);
        let hkv = (hq * m.kv_heads / m.heads.max(1)).max(1);
        self.req.precision.fp8_attention().backward && sdpa_fp8::slow_bwd(hq, hkv)
    }

    /// `--offload-optimizer` (auto: the fewest units whose state on the host
    /// makes the step fit beside what was decided before, which assumed
    /// every unit's there).
    fn offload_optimizer(&mut self) -> Result<()> {
        let choice = self.req.memory.offload_optimizer;
        let n = choice.resolve(&self.spec(), self.req.budget.ledger)?;
        self.policy.offload_optimizer = n;
        if choice == OptimizerOffload::Auto {
            let units = MemoryPolicy::optimizer_units(self.req.model.layers);
            // the host's update of compact state is compute, not a copy
            let cost = match self.policy.host_update {
                _ if n == 0 => String::new(),
                HostUpdate::Gpu => format!(
                    " ({}, updated on the GPU: --host-update gpu pages each unit's state in and out)",
                    self.req.state.saved()
                ),
                HostUpdate::Cpu if !self.req.state.optimizer_is_plain() => format!(
                    " ({} on the host's cores: slower than the GPU's update; --host-update gpu \
                     updates it on the GPU)",
                    self.req.state.saved()
                ),
                HostUpdate::Cpu => String::new(),
            };
            self.notes.push(format!(
                "--offload-optimizer auto: {n} of {units} units keep their optimizer state in host memory{cost}"
            ));
        }
        Ok(())
    }

    /// `--fwd-chunk-heads auto`: the widest forward stages at no extra
    /// predicted peak (UPipe; without a prediction, the backward's).
    fn forward_stages(&mut self) -> Result<()> {
        if self.req.stages.fwd != FwdChunk::Auto {
            return Ok(());
        }
        let (req, policy, fsdp) = (self.req, self.policy, self.fsdp);
        let peak = |p: &CpPlan| Ok(predict_step(&req.spec(p, policy, fsdp))?.peak);
        let wide = FwdChunk::Auto.apply(self.plan.clone(), peak)?;
        if wide.strategy.has_head_stages() {
            self.fwd_chunk_heads = Some(wide.fwd_schedule.chunk);
        }
        self.plan = wide;
        Ok(())
    }

    fn finish(self) -> Result<ResolvedRun> {
        let spec = self.spec();
        let decisions = Decisions {
            fsdp: self.fsdp,
            chunk_heads: self.chunk_heads,
            fwd_chunk_heads: self.fwd_chunk_heads,
            policy: self.policy,
            // as the plan runs it: ulysses and ring put every rank of the
            // context group on their one axis
            mesh: MeshChoice {
                data: self.req.mesh.data,
                ulysses: self.plan.layout.pu,
                ring: self.plan.layout.pr,
            },
            stages: (self.plan.schedule.chunk, self.plan.fwd_schedule.chunk),
        };
        Ok(ResolvedRun {
            prediction: predict_step(&spec)?,
            spec,
            decisions,
            fsdp_note: self.fsdp_note,
            notes: self.notes,
        })
    }
}

/// The memory a rank has for [`resolve_checkpoint_every`].
#[derive(Debug, Clone, Copy)]
pub struct EveryBudget {
    /// Bytes the ledger may use per rank (`None`: unknown; `auto` is then 1).
    pub ledger: Option<usize>,
    /// Host bytes for offloaded tensors per rank (`None`: unchecked).
    pub host: Option<usize>,
    /// `--offload` as given, resolved for each length tried (`auto`: the
    /// fewest blocks that fit that length's step).
    pub offload: OffloadBlocks,
}

/// `--checkpoint-every` of a step of `spec` (its `policy.checkpoint_every`
/// and `policy.offload` are ignored) within `budget`: a number as given,
/// `auto` by [`checkpoint_every_auto`] (1 when the memory is unknown).
/// Errors as [`CheckpointEvery::check`].
pub fn resolve_checkpoint_every(
    choice: CheckpointEvery,
    spec: &StepSpec,
    budget: EveryBudget,
) -> Result<usize> {
    choice.check(spec.policy)?;
    match (choice, budget.ledger) {
        (CheckpointEvery::Blocks(k), _) => Ok(k),
        (CheckpointEvery::Auto, None) => Ok(1),
        (CheckpointEvery::Auto, Some(ledger)) => {
            checkpoint_every_auto(spec, ledger, budget.host, budget.offload)
        }
    }
}

/// The fastest segment length whose step fits: of
/// [`every_candidates`] in order (the fewest recomputed blocks first), the
/// first whose predicted step, with `offload` resolved for it, fits
/// `ledger` device bytes ([`Prediction::rank_bytes`]) and `host` bytes of
/// host memory; when none fits, the closest ([`first_fitting`]). Without
/// checkpointing, 1.
///
/// [`Prediction::rank_bytes`]: super::Prediction::rank_bytes
pub fn checkpoint_every_auto(
    spec: &StepSpec,
    ledger: usize,
    host: Option<usize>,
    offload: OffloadBlocks,
) -> Result<usize> {
    if !spec.policy.checkpoint {
        return Ok(1);
    }
    let (layers, floor) = (spec.model.layers, spec.backward_floor());
    let candidates = every_candidates(spec.policy, layers, floor);
    first_fitting(&candidates, |k| {
        let mut s = spec.clone();
        s.policy.checkpoint_every = k;
        let device_over = |p: &Prediction| p.rank_bytes(s.device).saturating_sub(ledger);
        // a length whose device peak misses with every kept input on the
        // host misses with any `--offload auto` picks: one prediction
        if offload == OffloadBlocks::Auto {
            s.policy.offload = layers;
            let over = device_over(&predict_step(&s)?);
            if over > 0 {
                return Ok(over);
            }
        }
        s.policy.offload = offload.resolve(&s, Some(ledger), host)?;
        let p = predict_step(&s)?;
        Ok(device_over(&p) + host.map_or(0, |h| p.host_peak.saturating_sub(h)))
    })
}

/// A list of strategies as `plan --attn` and `bench attn --methods` take
/// it: `all`, or names separated by commas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Strategies {
    /// Every strategy that fits (`all`).
    All,
    /// The strategies listed, in order.
    Listed(Vec<Strategy>),
}

impl std::str::FromStr for Strategies {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim() == "all" {
            return Ok(Strategies::All);
        }
        let list: Vec<Strategy> = s
            .split(',')
            .map(|x| x.trim().parse())
            .collect::<Result<_>>()?;
        Ok(Strategies::Listed(list))
    }
}

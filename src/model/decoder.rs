//! Whole-decoder forward and explicit backward on one rank's token shard:
//! embedding (scaled where the family scales it) → blocks (RMSNorm →
//! attention strategy → [post-norm] → residual → RMSNorm → gated MLP →
//! [post-norm] → residual, as the family's `BlockSpec` says) → final norm →
//! LM head with a fused, chunked cross-entropy that never materialises the
//! full `[tokens, vocab]` logits.
//!
//! Memory policies (each leaves gradients unchanged):
//! - `checkpoint`: keep only each block's input; recompute the block in backward;
//! - `offload`: hold those block inputs in host memory (ledger category `Offload`);
//! - `tiled_mlp`: run post-attention RMSNorm + MLP in token tiles of a
//!   quarter of the rows, `hidden` to 4·`hidden` (`shapes::mlp_tile_rows`),
//!   recomputed per tile in backward, so no `[tokens, ffn]` intermediate
//!   ever exists for the whole shard;
//! - `save_attention`: under `checkpoint`, the last N blocks also keep their
//!   attention output O and LSEs, so their backward recomputes only
//!   `y = O·Woᵀ` instead of the whole attention forward;
//! - `checkpoint_every`: under `checkpoint`, segment checkpointing
//!   (`model::segments`): only every k-th block keeps its input, and the
//!   backward of each earlier segment first runs the segment's forward
//!   again from it, rebuilding its inner blocks' inputs.
//!
//! With `backward_floor` set (`Freeze::backward_floor`: nothing below that
//! block trains), the blocks below it run their forward only and keep
//! nothing, and the backward stops after that block.
//!
//! A checkpointed block's backward recomputes its forward only up to
//! `h1 = h + attn(RMSNorm(h))`: the block output is not needed, and a tiled
//! MLP runs each tile's forward once, inside the tiled backward.
//! Both reruns are tagged `Phase::Recompute` for the op profile.

use super::chunk_loop::for_each_chunk;
use super::config::ModelConfig;
use super::grads::BlockGrads;
use super::kept_inputs::KeptInputs;
use super::layer_attention::LayerAttentions;
pub use super::layer_attention::attn_dims;
use super::segments::Segments;
use super::store::{HeadView, ParamStore, Unit};
use super::weights::BlockWeights;
use crate::attention::lora_delta::{add_delta, add_delta_bwd};
use crate::attention::{AttnSaved, CpPlan, output_projection};
use crate::backend::PhaseGuard;
use crate::backend::fp8::{
    Fp8Format, Fp8Operand, LinearGemm, LinearRole, OutputGrad, Precision, Quantized,
    linear_gemm_quantized,
};
use crate::backend::profile::Phase;
use crate::backend::{
    Backend, Category, DType, Mat, MatLayout, RmsNorm, RmsNormBwd, RmsNormFwd, Tensor, cast,
};
use crate::comm::Mesh;
use crate::error::{Error, Result};

/// Where the optimizer state that `MemoryPolicy::offload_optimizer` puts in
/// host memory is updated (`--host-update`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostUpdate {
    /// On the host's threads, in place: the gradient (and, without a
    /// master, the parameter) comes to the host and the weights go back.
    #[default]
    Cpu,
    /// On the GPU: each unit's state is copied to the device ahead of its
    /// update, updated by the kernel that updates state kept there, and
    /// copied back (`optim::paged`).
    Gpu,
}

impl std::fmt::Display for HostUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostUpdate::Cpu => "cpu",
            HostUpdate::Gpu => "gpu",
        })
    }
}

/// Memory policies of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPolicy {
    pub checkpoint: bool,
    /// Under `checkpoint`: how many blocks, the first ones, keep their
    /// checkpointed input in host memory (`--offload`; the first because
    /// their inputs wait longest for backward).
    pub offload: usize,
    /// How many units (the embedding, each block, the head) keep their F32
    /// master weights and AdamW moments in host memory, updated on the host
    /// (`--offload-optimizer`): the last ones of the optimizer's update
    /// order (`optim::settling::update_order`: the head, the embedding,
    /// then the blocks), so the last blocks first. The units the next
    /// forward asks for first keep their state on the device, where their
    /// update runs at the step and nothing waits for the host.
    pub offload_optimizer: usize,
    /// Where that host state is updated.
    pub host_update: HostUpdate,
    pub tiled_mlp: bool,
    /// Rows of logits computed at once by the fused loss.
    pub loss_chunk: usize,
    /// Under `checkpoint`: how many blocks, the last ones, keep their
    /// attention output O and LSEs from forward (`--save-attention`), so
    /// their backward skips the attention forward. The last blocks because
    /// their kept tensors live shortest: backward frees them first, so at
    /// every point of the step at most as many are alive as for any other
    /// choice of the same number of blocks. A block of an earlier segment
    /// (`checkpoint_every`) keeps them from its segment's recompute instead
    /// of the forward, except the segment's last block, which that
    /// recompute does not run.
    pub save_attention: usize,
    /// Under `checkpoint`: segments of this many blocks, of which only the
    /// first keeps its input, except in the last segment, where every block
    /// does (`--checkpoint-every`; `model::segments`). 1: every block keeps
    /// its input. `offload` counts blocks as before: a block that keeps no
    /// input has none to move to the host.
    pub checkpoint_every: usize,
}

/// Rows of logits the fused loss computes at once unless `--loss-chunk`
/// says otherwise. Each chunk's head-gradient GEMM (`dhead += dlogitsᵀ·hn`,
/// inner dimension the chunk's rows) reads and writes all of `dhead`
/// (`[vocab, hidden]`): at 256 rows that traffic, not the arithmetic, bounds
/// it (a 32K step of Llama 3.2 1B ran 7 % slower on one H200). 2048 rows of
/// Llama 3's vocabulary are one 525 MB bf16 buffer (the logits and, in
/// place, their gradient).
pub const DEFAULT_LOSS_CHUNK: usize = 2048;

impl Default for MemoryPolicy {
    fn default() -> Self {
        MemoryPolicy {
            checkpoint: false,
            offload: 0,
            offload_optimizer: 0,
            host_update: HostUpdate::Cpu,
            tiled_mlp: false,
            loss_chunk: DEFAULT_LOSS_CHUNK,
            save_attention: 0,
            checkpoint_every: 1,
        }
    }
}

impl MemoryPolicy {
    /// Checks combinations once.
    pub fn validate(&self) -> Result<()> {
        if self.offload > 0 && !self.checkpoint {
            return crate::config_err!(
                "--offload moves checkpointed block inputs to the host: add --checkpoint"
            );
        }
        if self.loss_chunk == 0 {
            return crate::config_err!("--loss-chunk must be at least 1");
        }
        self.check_checkpoint_every(&self.checkpoint_every.to_string())?;
        self.check_save_attention(&self.save_attention.to_string(), None)
    }

    /// Whether block `l`'s checkpointed input goes to host memory.
    pub fn offloads(&self, l: usize) -> bool {
        l < self.offload
    }

    /// Checks the policy against a model of `layers` blocks.
    pub fn validate_for(&self, layers: usize) -> Result<()> {
        self.validate()?;
        if self.offload > layers {
            return crate::config_err!(
                "--offload {}: the model has {layers} blocks; use at most {layers}, all, or auto",
                self.offload
            );
        }
        if self.offload_optimizer > Self::optimizer_units(layers) {
            return crate::config_err!(
                "--offload-optimizer {}: the model has {} units (the embedding, {layers} blocks, \
                 the head); use at most {}, all, or auto",
                self.offload_optimizer,
                Self::optimizer_units(layers),
                Self::optimizer_units(layers)
            );
        }
        self.check_save_attention(&self.save_attention.to_string(), Some(layers))
    }

    /// The units whose optimizer state `--offload-optimizer` places: the
    /// embedding, `layers` blocks and the head.
    pub fn optimizer_units(layers: usize) -> usize {
        layers + 2
    }

    /// Checks `save_attention`, given as `--save-attention {given}`, against
    /// the policy and (when known) the model's `layers` blocks.
    pub fn check_save_attention(&self, given: &str, layers: Option<usize>) -> Result<()> {
        if self.save_attention > 0 && !self.checkpoint {
            return crate::config_err!(
                "--save-attention {given} keeps the attention outputs of checkpointed blocks so \
                 that their backward skips the attention recompute; without --checkpoint every \
                 block keeps them already: add --checkpoint, or use --save-attention none"
            );
        }
        match layers {
            Some(l) if self.save_attention > l => crate::config_err!(
                "--save-attention {given}: the model has {l} blocks; use at most {l} (or all)"
            ),
            _ => Ok(()),
        }
    }

    /// Checks `checkpoint_every`, given as `--checkpoint-every {given}`,
    /// against the policy.
    pub fn check_checkpoint_every(&self, given: &str) -> Result<()> {
        if self.checkpoint_every == 0 {
            return crate::config_err!(
                "--checkpoint-every {given}: segments hold at least one block; use 1 (every \
                 block keeps its input), a larger number of blocks, or auto"
            );
        }
        if self.checkpoint_every > 1 && !self.checkpoint {
            return crate::config_err!(
                "--checkpoint-every {given} keeps the checkpointed input of one block in every \
                 {given}: add --checkpoint, or use --checkpoint-every 1"
            );
        }
        Ok(())
    }

    /// The segments of a step over `layers` blocks whose backward stops
    /// after block `floor` (`checkpoint_every` blocks each).
    pub fn segments(&self, layers: usize, floor: usize) -> Segments {
        Segments::new(layers, floor, self.checkpoint_every)
    }

    /// Whether block `l` of `layers` keeps its attention output and LSEs
    /// under checkpointing: the last `save_attention` blocks.
    pub fn keeps_attention(&self, l: usize, layers: usize) -> bool {
        self.checkpoint && l + self.save_attention >= layers
    }
}

/// What one block keeps from forward for backward (when not recomputed).
struct BlockSaved<B: Backend> {
    /// Attention input `RMSNorm(h)`.
    a: Tensor<B>,
    attn: AttnSaved<B>,
    /// The attention's output `O·Woᵀ` before its post-norm (post-norm
    /// families only).
    y: Option<Tensor<B>>,
    /// Residual after attention.
    h1: Tensor<B>,
    /// MLP intermediates (untiled runs only).
    mlp: Option<MlpSaved<B>>,
}

/// What the forward keeps of a block besides its input.
enum Kept<B: Backend> {
    /// Everything (no checkpointing).
    Block(Box<BlockSaved<B>>),
    /// The attention output and LSEs (checkpointing, `--save-attention`).
    Attention(AttnSaved<B>),
    /// Nothing (checkpointing).
    Input,
}

/// The block inputs a step keeps, with what else each block keeps.
type Checkpoints<B> = KeptInputs<B, Kept<B>>;

pub(crate) struct MlpSaved<B: Backend> {
    m: Tensor<B>,
    gate: Tensor<B>,
    up: Tensor<B>,
    act: Tensor<B>,
    /// The MLP's output `act·Wdᵀ` before its post-norm (post-norm families
    /// only; without one the down projection adds into the residual).
    z: Option<Tensor<B>>,
}

/// A decoder bound to one rank's attention plan.
pub struct Decoder<B: Backend> {
    pub cfg: ModelConfig,
    pub policy: MemoryPolicy,
    /// Each layer's attention (one per distinct window and RoPE).
    pub(crate) attn: LayerAttentions<B>,
    /// Runs each norm backward and its residual add as two ops (a
    /// temporary and an `axpy`) instead of `Backend::rms_norm_bwd_add`:
    /// the same arithmetic, for tests that compare the two. False unless a
    /// test sets it.
    pub(crate) unfused_norms: bool,
    /// The lowest block whose backward runs (`Freeze::backward_floor`):
    /// nothing below it trains, so the blocks below keep nothing from the
    /// forward and the backward stops after it. 0 (every block) unless
    /// the trainer sets it.
    pub backward_floor: usize,
    /// What the linear layers' GEMMs (q/k/v/o, gate/up/down) compute in
    /// (`--precision`; [`set_precision`](Self::set_precision)). `Bf16`
    /// unless the trainer sets it.
    pub(crate) precision: Precision,
}

impl<B: Backend> Decoder<B> {
    pub fn new(
        b: &B,
        cfg: ModelConfig,
        plan: CpPlan,
        mesh: &Mesh<B>,
        policy: MemoryPolicy,
    ) -> Result<Self> {
        policy.validate_for(cfg.layers)?;
        let attn = LayerAttentions::new(b, &cfg, plan, mesh)?;
        Ok(Decoder {
            cfg,
            policy,
            attn,
            unfused_norms: false,
            backward_floor: 0,
            precision: Precision::Bf16,
        })
    }

    /// Runs the linear layers' GEMMs in `precision` from the next forward
    /// on: under `fp8`, the q/k/v/o projections and the MLP's three GEMMs,
    /// forward and backward (`backend::fp8::linear`); the embedding, the
    /// LM head, the norms and LoRA's adapter GEMMs stay in the compute
    /// dtype. An error naming the fix where the device has no FP8.
    pub fn set_precision(&mut self, b: &B, precision: Precision) -> Result<()> {
        if precision.fp8_linear() {
            b.supports_fp8()?;
        }
        self.precision = precision;
        self.attn.set_precision(precision);
        Ok(())
    }

    /// What the linear layers compute in.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Attends under the mask of the next window, whose documents start at
    /// `doc_starts` (positions restart at each; `[0]`: one document), from
    /// the next forward on; a layer's sliding window, if it has one,
    /// bounds every query within its document.
    pub fn set_window(&mut self, b: &B, doc_starts: &[u32]) -> Result<()> {
        self.attn.set_window(b, doc_starts)
    }

    /// The share of the `S²` scores the current window's masks compute,
    /// the mean over the layers.
    pub fn attn_flop_fraction(&self, seq: usize) -> f64 {
        self.attn.flop_fraction(seq)
    }

    /// Every RMSNorm of the model.
    pub(crate) fn norm(&self) -> RmsNorm {
        self.cfg.norm()
    }

    /// The final norm of the last block's output `x` `[s, hidden]` by
    /// `w`, into a new tensor of category `cat`.
    pub(crate) fn final_norm(
        &self,
        b: &B,
        w: &Tensor<B>,
        x: &Tensor<B>,
        cat: Category,
    ) -> Result<Tensor<B>> {
        let mut hn = b.empty(x.shape(), x.dtype(), cat)?;
        b.rms_norm_fwd(RmsNormFwd {
            x,
            w,
            norm: self.norm(),
            y: &mut hn,
        })?;
        Ok(hn)
    }

    /// The token embedding of `ids` into `x` `[ids.len(), hidden]`, scaled
    /// where the family scales it.
    pub(crate) fn embed(
        &self,
        b: &B,
        table: &Tensor<B>,
        ids: &[u32],
        x: &mut Tensor<B>,
    ) -> Result<()> {
        let scale = self.cfg.embed_scale(x.dtype()).unwrap_or(1.0);
        b.embedding_fwd(table, ids, scale, x)
    }

    /// Forward and backward over this rank's tokens `ids` (targets aligned, `IGNORE`
    /// for none), with parameters from `store` one unit at a time. Accumulates
    /// partial gradients into the store's buffers with the loss scaled by
    /// `grad_scale` (1 / global target count gives the mean) and returns this
    /// rank's summed (unscaled) loss.
    pub fn forward_backward<S: ParamStore<B> + ?Sized>(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        store: &mut S,
        ids: &[u32],
        targets: &[u32],
        grad_scale: f32,
    ) -> Result<f64> {
        if ids.len() != targets.len() {
            return Err(Error::Config("one target per input token".into()));
        }
        let act = b.compute_dtype();
        let (s, h) = (ids.len(), self.cfg.hidden);
        // the parts of the step as the planner names them (`MemoryLedger::enter`)
        b.ledger().enter("forward: embedding");
        let mut x = b.empty(&[s, h], act, Category::Activations)?;
        store.acquire(b, Unit::Embed)?;
        self.embed(b, store.embed()?, ids, &mut x)?;
        store.release(Unit::Embed)?;

        let (x, mut kept) = self.forward_blocks(b, mesh, store, x)?;
        // the last block's input comes back beside the loss
        kept.prefetch(b)?;
        let (loss, dx) = self.head_fwd_bwd(b, store, x, targets, grad_scale)?;
        let dx = self.backward_blocks(b, mesh, store, kept, dx)?;
        // the blocks below the floor are frozen whole: no gradient to hand over
        for l in (0..self.floor()).rev() {
            store.grads_done(b, Unit::Block(l))?;
        }
        // a frozen embedding takes no gradient: the backward ends at its output
        if let Some(d_embed) = store.embed_grads(b)? {
            let scale = self.cfg.embed_scale(dx.dtype()).unwrap_or(1.0);
            b.embedding_bwd(&dx, ids, scale, d_embed)?;
        }
        store.grads_done(b, Unit::Embed)?;
        store.finish(b)?;
        Ok(loss)
    }

    /// The lowest block whose backward runs: the backward stops after it.
    fn floor(&self) -> usize {
        self.backward_floor.min(self.cfg.layers)
    }

    /// The segments of this decoder's step (`MemoryPolicy::checkpoint_every`).
    fn segments(&self) -> Segments {
        self.policy.segments(self.cfg.layers, self.floor())
    }

    /// The blocks' forward from the embedding's output `x` `[s, hidden]`:
    /// the last block's output, and what each block keeps for its
    /// backward: its input and either everything or, under checkpointing,
    /// its attention state or nothing more; under segment checkpointing
    /// only a segment's first block (and every block of the last segment)
    /// keeps its input. An offloaded input is copied to host memory beside
    /// the next block's forward, its device copy released after that block.
    fn forward_blocks<S: ParamStore<B> + ?Sized>(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        store: &mut S,
        mut x: Tensor<B>,
    ) -> Result<(Tensor<B>, Checkpoints<B>)> {
        let segments = self.segments();
        let mut kept = KeptInputs::with_capacity(segments.kept_inputs());
        for l in 0..self.cfg.layers {
            store.acquire(b, Unit::Block(l))?;
            let (next, saved) = self.block_fwd(b, mesh, l, store.block(l)?, &x)?;
            store.release(Unit::Block(l))?;
            if !segments.keeps_input(l) {
                // below the floor no backward runs; inside an earlier
                // segment its recompute rebuilds the input: nothing kept
                drop(saved);
                x = next;
                continue;
            }
            let keep = if !self.policy.checkpoint {
                Kept::Block(Box::new(saved))
            } else if segments.recomputes(l) {
                // an earlier segment's first block: its recompute keeps the rest
                drop(saved);
                Kept::Input
            } else {
                self.keep_checkpointed(l, saved)
            };
            kept.keep(b, l, x, keep, self.policy.offloads(l))?;
            x = next;
        }
        kept.settle(b)?;
        Ok((x, kept))
    }

    /// The blocks' backward from the gradient `dx` of the last block's
    /// output, last block first; before each earlier segment's last block,
    /// its recompute rebuilds the inputs of the blocks after its first.
    /// Returns the gradient of the first block's input.
    fn backward_blocks<S: ParamStore<B> + ?Sized>(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        store: &mut S,
        mut kept: Checkpoints<B>,
        mut dx: Tensor<B>,
    ) -> Result<Tensor<B>> {
        for l in (self.floor()..self.cfg.layers).rev() {
            if kept.top_block() != Some(l) {
                self.rebuild_segment(b, mesh, store, &mut kept, l)?;
            }
            b.ledger().enter("backward: reload");
            let Some((entry, _host)) = kept.take(b)? else {
                return Err(Error::Backend(format!("block {l} kept no input")));
            };
            // prefetch the next block's offloaded input one block ahead
            kept.prefetch(b)?;
            let input = entry.input;
            store.acquire(b, Unit::Block(l))?;
            let saved = match entry.keep {
                Kept::Block(s) => *s,
                Kept::Attention(attn) => {
                    self.recompute(b, mesh, l, store.block(l)?, &input, Some(attn))?
                }
                Kept::Input => self.recompute(b, mesh, l, store.block(l)?, &input, None)?,
            };
            let params = store.block_grads(b, l)?;
            dx = self.block_bwd((b, mesh), l, params, (&input, saved), dx)?;
            store.release(Unit::Block(l))?;
            store.grads_done(b, Unit::Block(l))?;
        }
        Ok(dx)
    }

    /// Segment checkpointing, before the backward of block `last`, the last
    /// of an earlier segment: its forward again from the input its first
    /// block kept through block `last - 1`, keeping each block's input (and
    /// the attention state of blocks that keep it) until its backward.
    fn rebuild_segment<S: ParamStore<B> + ?Sized>(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        store: &mut S,
        kept: &mut Checkpoints<B>,
        last: usize,
    ) -> Result<()> {
        let first = self.segments().start_of(last);
        b.ledger().enter("backward: segment recompute");
        let _phase = PhaseGuard::enter(b, Phase::Recompute);
        let Some((entry, host)) = kept.take(b)? else {
            return Err(Error::Backend(format!("block {first} kept no input")));
        };
        if entry.block != first {
            return Err(Error::Backend(format!(
                "block {last}'s segment starts at block {first}, but block {} kept the input",
                entry.block
            )));
        }
        drop(host);
        // [s_local, hidden]: block l's input, then its output
        let mut x = entry.input;
        for l in first..last {
            store.acquire(b, Unit::Block(l))?;
            let (next, saved) = self.block_fwd(b, mesh, l, store.block(l)?, &x)?;
            store.release(Unit::Block(l))?;
            kept.push_rebuilt(l, x, self.keep_checkpointed(l, saved));
            x = next;
        }
        kept.push_rebuilt(last, x, Kept::Input);
        Ok(())
    }

    /// What a checkpointed block `l` keeps of its forward's `saved` besides
    /// its input: its attention state when it is one of the last
    /// `save_attention` blocks, else nothing.
    fn keep_checkpointed(&self, l: usize, saved: BlockSaved<B>) -> Kept<B> {
        let BlockSaved {
            a,
            attn,
            y,
            h1,
            mlp,
        } = saved;
        drop((a, y, h1, mlp));
        if self.policy.keeps_attention(l, self.cfg.layers) {
            Kept::Attention(attn)
        } else {
            Kept::Input
        }
    }

    /// Final norm + fused chunked loss on the last block's output `x` (dhn is
    /// ready when forward ends); returns the summed loss and dL/dx.
    fn head_fwd_bwd<S: ParamStore<B> + ?Sized>(
        &self,
        b: &B,
        store: &mut S,
        x: Tensor<B>,
        targets: &[u32],
        grad_scale: f32,
    ) -> Result<(f64, Tensor<B>)> {
        let tied = self.cfg.tie_embeddings;
        b.ledger().enter("loss");
        store.acquire(b, Unit::Head)?;
        if tied {
            store.acquire(b, Unit::Embed)?;
        }
        let hn = self.final_norm(b, store.final_norm()?, &x, Category::Workspace)?;
        let head = store.head_grads(b)?;
        let HeadView {
            norm,
            head,
            d_norm,
            d_head,
        } = head;
        let (loss, dhn) = self.fused_loss(b, head, d_head, &hn, targets, grad_scale)?;
        drop(hn);
        let mut dx = b.empty(x.shape(), x.dtype(), Category::Grads)?;
        b.rms_norm_bwd(RmsNormBwd {
            x: &x,
            w: norm,
            dy: &dhn,
            norm: self.norm(),
            dx: &mut dx,
            dw: d_norm,
        })?;
        drop((dhn, x));
        if tied {
            store.release(Unit::Embed)?;
        }
        store.release(Unit::Head)?;
        store.grads_done(b, Unit::Head)?;
        if tied {
            store.grads_done(b, Unit::Embed)?;
        }
        Ok((loss, dx))
    }

    /// Block `l`'s forward: returns its output and what backward needs.
    fn block_fwd(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        l: usize,
        w: &BlockWeights<B>,
        h: &Tensor<B>,
    ) -> Result<(Tensor<B>, BlockSaved<B>)> {
        let (a, attn, y, h1) = self.attn_fwd(b, mesh, l, w, h, None)?;
        let mut out = cast(b, &h1, h.dtype(), Category::Activations)?;
        let mut mlp = None;
        let tiles = self.tiles(h.rows());
        let w8 = MlpWeights8::forward(b, self.precision, w, tiles.len())?;
        for_each_chunk(b, tiles, |rows| {
            let copy = self.tile_copy(b, &h1, &rows)?;
            let x_t = copy.as_ref().unwrap_or(&h1);
            let saved = self.mlp_fwd(b, w, &w8, x_t)?;
            self.add_mlp_output(b, (w, &w8), &saved, &mut out, &rows)?;
            if !self.policy.tiled_mlp {
                mlp = Some(saved);
            }
            Ok(())
        })?;
        drop(w8);
        let saved = BlockSaved {
            a,
            attn,
            y,
            h1,
            mlp,
        };
        Ok((out, saved))
    }

    /// Adds a tile's MLP output into its rows of the residual `out`
    /// `[s, hidden]`: `act·Wdᵀ` by the down projection's GEMM (beta 1), or
    /// the post-norm of the saved `z` where the family has one.
    pub(crate) fn add_mlp_output(
        &self,
        b: &B,
        (w, w8): (&BlockWeights<B>, &MlpWeights8<B>),
        saved: &MlpSaved<B>,
        out: &mut Tensor<B>,
        rows: &std::ops::Range<usize>,
    ) -> Result<()> {
        let hid = self.cfg.hidden;
        let dst = MatLayout::block(rows.start * hid, rows.len(), hid, hid);
        match (&saved.z, &w.post_mlp_norm) {
            (Some(z), Some(norm)) => {
                let q = self.post_norm_fwd(b, z, norm)?;
                self.add_rows(b, out, rows, &q)
            }
            _ => {
                // out[rows] += act @ down^T (the residual add is the GEMM's beta = 1)
                let (c, a) = (out.view_mut(dst), saved.act.mat());
                let g = LinearGemm::new(LinearRole::Forward, c, a, w.down.mat().t());
                linear_gemm_quantized(b, self.precision, g.accumulate(), w8.down())?;
                let down = w.mlp_lora.down.as_ref();
                add_delta(b, down, saved.act.mat(), out.view_mut(dst))
            }
        }
    }

    /// A post-norm's output (Gemma 3's, after attention and after the MLP):
    /// `rms_norm(x) · norm`, `x`'s shape, in workspace.
    fn post_norm_fwd(&self, b: &B, x: &Tensor<B>, norm: &Tensor<B>) -> Result<Tensor<B>> {
        let mut y = b.empty(x.shape(), x.dtype(), Category::Workspace)?;
        b.rms_norm_fwd(RmsNormFwd {
            x,
            w: norm,
            norm: self.norm(),
            y: &mut y,
        })?;
        Ok(y)
    }

    /// The gradient through a post-norm of the saved input `x` from its
    /// output's gradient `dy`; the norm weight's gradient is added into
    /// `dw` where it is trained.
    fn post_norm_bwd(
        &self,
        b: &B,
        (x, norm): (&Tensor<B>, &Tensor<B>),
        dy: &Tensor<B>,
        dw: Option<&mut Tensor<B>>,
    ) -> Result<Tensor<B>> {
        let mut dx = b.empty(x.shape(), x.dtype(), Category::Workspace)?;
        b.rms_norm_bwd(RmsNormBwd {
            x,
            w: norm,
            dy,
            norm: self.norm(),
            dx: &mut dx,
            dw,
        })?;
        Ok(dx)
    }

    /// `t[rows] += y` for a `[rows, hidden]` tile `y` of the `[s, hidden]`
    /// `t` (through a copy of those rows when the tile is not all of them).
    fn add_rows(
        &self,
        b: &B,
        t: &mut Tensor<B>,
        rows: &std::ops::Range<usize>,
        y: &Tensor<B>,
    ) -> Result<()> {
        if rows.len() == t.rows() {
            return b.axpy(t, 1.0, y);
        }
        let hid = t.row_len();
        let blk = MatLayout::block(rows.start * hid, rows.len(), hid, hid);
        let mut tile = self.rows_of(b, t, rows)?;
        b.axpy(&mut tile, 1.0, y)?;
        b.copy(t.view_mut(blk), tile.mat())
    }

    /// The attention half of block `l`: `a = RMSNorm(h)`, the attention
    /// state (its forward run, or `kept` from an earlier one), its output
    /// `y = O·Woᵀ` (kept where a post-norm follows) and
    /// `h1 = h + y` (or `h + RMSNorm(y)` after a post-norm).
    #[allow(clippy::type_complexity)]
    fn attn_fwd(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        l: usize,
        w: &BlockWeights<B>,
        h: &Tensor<B>,
        kept: Option<AttnSaved<B>>,
    ) -> Result<(Tensor<B>, AttnSaved<B>, Option<Tensor<B>>, Tensor<B>)> {
        let (a, attn, y) = self.attn_branch(b, mesh, l, w, h, kept)?;
        let (y, h1) = self.attn_residual(b, w, h, y)?;
        Ok((a, attn, y, h1))
    }

    /// `a = RMSNorm(h)`, then layer `l`'s attention of it (or the output
    /// projection of `kept`): `(a, attention state, y = O·Woᵀ)`.
    pub(crate) fn attn_branch(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        l: usize,
        w: &BlockWeights<B>,
        h: &Tensor<B>,
        kept: Option<AttnSaved<B>>,
    ) -> Result<(Tensor<B>, AttnSaved<B>, Tensor<B>)> {
        b.ledger().enter("forward: attention");
        let mut a = b.empty(h.shape(), h.dtype(), Category::Activations)?;
        b.rms_norm_fwd(RmsNormFwd {
            x: h,
            w: &w.attn_norm,
            norm: self.norm(),
            y: &mut a,
        })?;
        let (y, attn) = match kept {
            Some(attn) => (
                output_projection(b, &attn.o, &w.attn, self.precision)?,
                attn,
            ),
            None => self.attn.layer(l).forward(b, mesh, &w.attn, &a)?,
        };
        Ok((a, attn, y))
    }

    /// The attention's residual add: `h1 = h + y`, or `h + RMSNorm(y)`
    /// where a post-norm follows (then `y` comes back for the backward).
    pub(crate) fn attn_residual(
        &self,
        b: &B,
        w: &BlockWeights<B>,
        h: &Tensor<B>,
        y: Tensor<B>,
    ) -> Result<(Option<Tensor<B>>, Tensor<B>)> {
        b.ledger().enter("forward: mlp");
        let mut h1 = cast(b, h, h.dtype(), Category::Activations)?;
        match &w.post_attn_norm {
            Some(norm) => {
                let p = self.post_norm_fwd(b, &y, norm)?;
                b.axpy(&mut h1, 1.0, &p)?;
                Ok((Some(y), h1))
            }
            None => {
                b.axpy(&mut h1, 1.0, &y)?;
                Ok((None, h1))
            }
        }
    }

    /// A checkpointed block's forward again, up to what its backward reads:
    /// the attention half (from `kept` when the block saved its attention
    /// state) and, untiled, the MLP intermediates. The block output is not
    /// recomputed, and a tiled MLP's tiles run their forward in the tiled
    /// backward only.
    fn recompute(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        l: usize,
        w: &BlockWeights<B>,
        h: &Tensor<B>,
        kept: Option<AttnSaved<B>>,
    ) -> Result<BlockSaved<B>> {
        let _phase = PhaseGuard::enter(b, Phase::Recompute);
        let (a, attn, y, h1) = self.attn_fwd(b, mesh, l, w, h, kept)?;
        let mlp = if self.policy.tiled_mlp {
            None
        } else {
            Some(self.mlp_fwd(b, w, &MlpWeights8::none(), &h1)?)
        };
        Ok(BlockSaved {
            a,
            attn,
            y,
            h1,
            mlp,
        })
    }

    /// Token tiles of the MLP: one tile, or `shapes::mlp_tile_rows` each.
    fn tiles(&self, rows: usize) -> super::shapes::RowChunks {
        super::shapes::mlp_tiles(rows, self.cfg.hidden, self.policy.tiled_mlp)
    }

    /// Rows `r` of a `[s, hidden]` tensor as a new tensor, or `None` when
    /// they are all of its rows (the tensor itself serves: no copy).
    fn tile_copy(
        &self,
        b: &B,
        t: &Tensor<B>,
        r: &std::ops::Range<usize>,
    ) -> Result<Option<Tensor<B>>> {
        if r.len() == t.rows() {
            return Ok(None);
        }
        self.rows_of(b, t, r).map(Some)
    }

    /// Rows `r` of a `[s, hidden]` tensor as a new tensor.
    pub(crate) fn rows_of(
        &self,
        b: &B,
        t: &Tensor<B>,
        r: &std::ops::Range<usize>,
    ) -> Result<Tensor<B>> {
        let hid = t.row_len();
        let mut out = b.empty(&[r.len(), hid], t.dtype(), Category::Workspace)?;
        b.copy(
            out.mat_mut(),
            t.view(MatLayout::block(r.start * hid, r.len(), hid, hid)),
        )?;
        Ok(out)
    }

    /// RMSNorm + gate/up projections + the gated activation of one tile,
    /// and its down projection `z` where a post-norm follows.
    pub(crate) fn mlp_fwd(
        &self,
        b: &B,
        w: &BlockWeights<B>,
        w8: &MlpWeights8<B>,
        x: &Tensor<B>,
    ) -> Result<MlpSaved<B>> {
        let (r, f) = (x.rows(), self.cfg.ffn);
        let dt = x.dtype();
        let mut m = b.empty(x.shape(), dt, Category::Activations)?;
        b.rms_norm_fwd(RmsNormFwd {
            x,
            w: &w.mlp_norm,
            norm: self.norm(),
            y: &mut m,
        })?;
        let fwd = LinearRole::Forward;
        // gate and up read m: under fp8 it is quantized once for both
        let m8 = Fp8Operand::of(b, self.precision, m.mat(), Fp8Format::E4M3)?;
        // [r, f] each
        let mut gate = b.empty(&[r, f], dt, Category::Activations)?;
        let wg = w.gate.mat().t();
        let g = LinearGemm::new(fwd, gate.mat_mut(), m.mat(), wg);
        let pre = Quantized {
            a: m8.as_ref().map(Fp8Operand::codes),
            b: w8.gate.as_ref().map(Fp8Operand::codes),
        };
        linear_gemm_quantized(b, self.precision, g, pre)?;
        add_delta(b, w.mlp_lora.gate.as_ref(), m.mat(), gate.mat_mut())?;
        let mut up = b.empty(&[r, f], dt, Category::Activations)?;
        let wu = w.up.mat().t();
        let g = LinearGemm::new(fwd, up.mat_mut(), m.mat(), wu);
        let pre = Quantized {
            a: m8.as_ref().map(Fp8Operand::codes),
            b: w8.up.as_ref().map(Fp8Operand::codes),
        };
        linear_gemm_quantized(b, self.precision, g, pre)?;
        drop(m8);
        add_delta(b, w.mlp_lora.up.as_ref(), m.mat(), up.mat_mut())?;
        let mut act = b.empty(&[r, f], dt, Category::Activations)?;
        b.gated_act_fwd(self.cfg.spec().activation, &gate, &up, &mut act)?;
        let z = match w.post_mlp_norm {
            Some(_) => Some(down_projection(b, (w, w8), &act, self.precision)?),
            None => None,
        };
        Ok(MlpSaved {
            m,
            gate,
            up,
            act,
            z,
        })
    }

    /// Block `l`'s backward from `d_out`, with its weights `w` and their
    /// gradients `g`, of the forward of `h` that kept `saved`; returns the
    /// gradient w.r.t. `h`.
    fn block_bwd(
        &self,
        (b, mesh): (&B, &Mesh<B>),
        l: usize,
        (w, g): (&BlockWeights<B>, &mut BlockGrads<B>),
        (h, saved): (&Tensor<B>, BlockSaved<B>),
        d_out: Tensor<B>,
    ) -> Result<Tensor<B>> {
        let BlockSaved {
            a,
            attn,
            y,
            h1,
            mut mlp,
        } = saved;
        // MLP branch: dh1 = d_out + d(mlp)/dh1
        b.ledger().enter("backward: mlp");
        let mut dh1 = cast(b, &d_out, d_out.dtype(), Category::Grads)?;
        let tiles = self.tiles(h.rows());
        let n = tiles.len();
        let (w8, w8t) = match mlp.is_some() {
            true => (MlpWeights8::none(), MlpWeights8::none()),
            false => (
                MlpWeights8::recompute(b, self.precision, w, n)?,
                MlpWeights8::input_grads(b, self.precision, w, n)?,
            ),
        };
        for_each_chunk(b, tiles, |rows| {
            let copy = self.tile_copy(b, &h1, &rows)?;
            let x_t = copy.as_ref().unwrap_or(&h1);
            let s = match mlp.take() {
                Some(s) => s,
                None => {
                    let _phase = PhaseGuard::enter(b, Phase::Recompute);
                    self.mlp_fwd(b, w, &w8, x_t)?
                }
            };
            let dm = self.mlp_bwd(b, (w, &w8t), g, s, &d_out, &rows)?;
            let d_norm = g.mlp_norm.as_mut();
            self.norm_bwd_add_rows(b, (x_t, &w.mlp_norm, &dm), (&mut dh1, &rows), d_norm)?;
            Ok(())
        })?;
        drop((h1, d_out, w8, w8t));
        // Attention branch: dh = dh1 + d(attn(norm(h)))/dh
        b.ledger().enter("backward: attention");
        let dy = match (&y, &w.post_attn_norm) {
            (Some(y), Some(norm)) => {
                let d_post = g.post_attn_norm.as_mut();
                Some(self.post_norm_bwd(b, (y, norm), &dh1, d_post)?)
            }
            _ => None,
        };
        drop(y);
        let upstream = (attn, dy.as_ref().unwrap_or(&dh1));
        let da = self
            .attn
            .layer(l)
            .backward((b, mesh), &w.attn, &a, upstream, &mut g.attn)?;
        drop((a, dy));
        // dh1 becomes dh: the norm's backward added into it in place
        let d_norm = g.attn_norm.as_mut();
        self.norm_bwd_add(b, h, &w.attn_norm, &da, &mut dh1, d_norm)?;
        Ok(dh1)
    }

    /// One MLP tile's backward from the block output's gradient `d_out`
    /// (its rows `rows`): the down projection (through the post-norm where
    /// there is one), the gated activation, gate and up; accumulates the
    /// weights' gradients and returns the gradient of the tile's normed
    /// input `m`. Each saved tensor is dropped after its last reader.
    fn mlp_bwd(
        &self,
        b: &B,
        (w, w8t): (&BlockWeights<B>, &MlpWeights8<B>),
        g: &mut BlockGrads<B>,
        s: MlpSaved<B>,
        d_out: &Tensor<B>,
        rows: &std::ops::Range<usize>,
    ) -> Result<Tensor<B>> {
        let MlpSaved {
            m,
            gate,
            up,
            act,
            z,
        } = s;
        let hid = self.cfg.hidden;
        let blk = MatLayout::block(rows.start * hid, rows.len(), hid, hid);
        // [rows, hidden]: the gradient of the down projection's output
        let dz = match (&z, &w.post_mlp_norm) {
            (Some(z), Some(norm)) => {
                let d_t = self.rows_of(b, d_out, rows)?;
                let d_post = g.post_mlp_norm.as_mut();
                Some(self.post_norm_bwd(b, (z, norm), &d_t, d_post)?)
            }
            _ => None,
        };
        drop(z);
        let d_t = match &dz {
            Some(dz) => dz.mat(),
            None => d_out.view(blk),
        };
        let dact = self.down_bwd(b, (w, w8t), g, act, d_t)?;
        drop(dz);
        let mut dgate = b.empty(gate.shape(), gate.dtype(), Category::Workspace)?;
        let mut dup = b.empty(up.shape(), up.dtype(), Category::Workspace)?;
        let kind = self.cfg.spec().activation;
        b.gated_act_bwd(kind, &gate, &up, &dact, &mut dgate, &mut dup)?;
        drop((dact, gate, up));
        self.gate_up_bwd(b, (w, w8t), g, m, [dgate, dup])
    }

    /// The down projection's backward from its output's gradient `d_t`
    /// (`[rows, hidden]`): its weight gradient from the saved activation
    /// `act` (dropped here), and the activation's gradient `[rows, ffn]`.
    fn down_bwd(
        &self,
        b: &B,
        (w, w8t): (&BlockWeights<B>, &MlpWeights8<B>),
        g: &mut BlockGrads<B>,
        act: Tensor<B>,
        d_t: Mat<'_, B>,
    ) -> Result<Tensor<B>> {
        // a frozen weight's gradient GEMM is skipped; dx's still runs
        let dy = OutputGrad::new(b, self.precision, d_t, g.down.is_some())?;
        if let Some(g_down) = g.down.as_mut() {
            dy.weight_grad(b, g_down.mat_mut(), (act.mat(), None))?;
        }
        // [rows, ffn]
        let mut dact = b.empty(act.shape(), act.dtype(), Category::Workspace)?;
        dy.input_grad(b, (dact.mat_mut(), 0.0), (w.down.mat(), w8t.down().b))?;
        drop(dy);
        let (down, g_lora) = (w.mlp_lora.down.as_ref(), &mut g.mlp_lora);
        add_delta_bwd(
            b,
            down,
            g_lora.down.as_mut(),
            act.mat(),
            d_t,
            dact.mat_mut(),
        )?;
        Ok(dact)
    }

    /// Gate's and up's backward from their outputs' gradients: their weight
    /// gradients from the saved normed input `m`, and `dm` (`[rows,
    /// hidden]`). A gradient no adapter reads is dropped after its GEMMs.
    fn gate_up_bwd(
        &self,
        b: &B,
        (w, w8t): (&BlockWeights<B>, &MlpWeights8<B>),
        g: &mut BlockGrads<B>,
        m: Tensor<B>,
        [dgate, dup]: [Tensor<B>; 2],
    ) -> Result<Tensor<B>> {
        let p = self.precision;
        // both weight gradients read mᵀ: under fp8 it is quantized once
        let mt8 = match g.gate.is_some() && g.up.is_some() {
            true => Fp8Operand::of(b, p, m.mat().t(), Fp8Format::E4M3)?,
            false => None,
        };
        // [rows, hidden]
        let mut dm = b.empty(m.shape(), m.dtype(), Category::Workspace)?;
        let l = &w.mlp_lora;
        let projections = [
            (
                dgate,
                g.gate.as_mut(),
                &w.gate,
                w8t.gate(),
                l.gate.is_some(),
            ),
            (dup, g.up.as_mut(), &w.up, w8t.up(), l.up.is_some()),
        ];
        let mut for_adapters = Vec::new();
        for (beta, (d, gw, wt, wt8, adapter)) in [0.0, 1.0].into_iter().zip(projections) {
            let dy = OutputGrad::new(b, p, d.mat(), gw.is_some())?;
            if let Some(gw) = gw {
                let mt8 = mt8.as_ref().map(Fp8Operand::codes);
                dy.weight_grad(b, gw.mat_mut(), (m.mat(), mt8))?;
            }
            dy.input_grad(b, (dm.mat_mut(), beta), (wt.mat(), wt8.b))?;
            drop(dy);
            for_adapters.push(adapter.then_some(d));
        }
        drop(mt8);
        let gl = &mut g.mlp_lora;
        let adapters = [(&l.gate, &mut gl.gate), (&l.up, &mut gl.up)];
        for ((pair, grads), d) in adapters.into_iter().zip(for_adapters) {
            if let Some(d) = d {
                let (pair, grads) = (pair.as_ref(), grads.as_mut());
                add_delta_bwd(b, pair, grads, m.mat(), d.mat(), dm.mat_mut())?;
            }
        }
        Ok(dm)
    }

    /// `dx += RMSNorm-backward(x, w, dy)` (`Backend::rms_norm_bwd_add`),
    /// accumulating `dw`; with `unfused_norms`, the same arithmetic as
    /// `rms_norm_bwd` into a temporary and an `axpy`.
    fn norm_bwd_add(
        &self,
        b: &B,
        x: &Tensor<B>,
        w: &Tensor<B>,
        dy: &Tensor<B>,
        dx: &mut Tensor<B>,
        dw: Option<&mut Tensor<B>>,
    ) -> Result<()> {
        if !self.unfused_norms {
            return b.rms_norm_bwd_add(RmsNormBwd {
                x,
                w,
                dy,
                norm: self.norm(),
                dx,
                dw,
            });
        }
        let mut t = b.empty(dx.shape(), dx.dtype(), Category::Workspace)?;
        b.rms_norm_bwd(RmsNormBwd {
            x,
            w,
            dy,
            norm: self.norm(),
            dx: &mut t,
            dw,
        })?;
        b.axpy(dx, 1.0, &t)
    }

    /// [`norm_bwd_add`](Self::norm_bwd_add) of a token tile `x` `[rows, hidden]`
    /// (the norm's weight `w`, its output's gradient `dy`) into its `rows` of
    /// the `[s, hidden]` gradient `t` (through a copy of those rows when the
    /// tile is not all of them).
    fn norm_bwd_add_rows(
        &self,
        b: &B,
        (x, w, dy): (&Tensor<B>, &Tensor<B>, &Tensor<B>),
        (t, rows): (&mut Tensor<B>, &std::ops::Range<usize>),
        dw: Option<&mut Tensor<B>>,
    ) -> Result<()> {
        if rows.len() == t.rows() {
            return self.norm_bwd_add(b, x, w, dy, t, dw);
        }
        let hid = t.row_len();
        let blk = MatLayout::block(rows.start * hid, rows.len(), hid, hid);
        let mut tile = self.rows_of(b, t, rows)?;
        self.norm_bwd_add(b, x, w, dy, &mut tile, dw)?;
        b.copy(t.view_mut(blk), tile.mat())
    }

    /// Fused chunked LM head + cross-entropy: returns the summed loss and dL/dhn,
    /// accumulating the head's gradient (none when `dhead` is `None`: frozen).
    /// Logits exist one chunk at a time.
    fn fused_loss(
        &self,
        b: &B,
        head: &Tensor<B>,
        mut dhead: Option<&mut Tensor<B>>,
        hn: &Tensor<B>,
        targets: &[u32],
        grad_scale: f32,
    ) -> Result<(f64, Tensor<B>)> {
        let (s, hid, v) = (hn.rows(), self.cfg.hidden, self.cfg.vocab);
        let mut dhn = b.zeros(hn.shape(), hn.dtype(), Category::Grads)?;
        let mut loss_sum = b.zeros(&[1], DType::F32, Category::Workspace)?;
        for_each_chunk(
            b,
            super::shapes::loss_chunks(s, self.policy.loss_chunk),
            |chunk| {
                let (r0, r) = (chunk.start, chunk.len());
                let rows = MatLayout::block(r0 * hid, r, hid, hid);
                // [r, vocab]: the logits, then (in place) their gradient; written
                // whole by the GEMM (beta 0) before it is read
                let mut dlogits = b.empty(&[r, v], hn.dtype(), Category::Workspace)?;
                b.gemm(dlogits.mat_mut(), hn.view(rows), head.mat().t(), 1.0, 0.0)?;
                b.cross_entropy(
                    &mut dlogits,
                    &targets[r0..r0 + r],
                    grad_scale,
                    &mut loss_sum,
                )?;
                b.gemm(dhn.view_mut(rows), dlogits.mat(), head.mat(), 1.0, 0.0)?;
                if let Some(dhead) = dhead.as_deref_mut() {
                    b.gemm(dhead.mat_mut(), dlogits.mat().t(), hn.view(rows), 1.0, 1.0)?;
                }
                Ok(())
            },
        )?;
        let loss = b.to_host(&loss_sum)?[0] as f64;
        Ok((loss, dhn))
    }
}

/// `act·Wdᵀ` (with the down adapter's delta) of one tile, `[rows, hidden]`.
fn down_projection<B: Backend>(
    b: &B,
    (w, w8): (&BlockWeights<B>, &MlpWeights8<B>),
    act: &Tensor<B>,
    precision: Precision,
) -> Result<Tensor<B>> {
    let hid = w.down.shape()[0];
    let mut z = b.empty(&[act.rows(), hid], act.dtype(), Category::Activations)?;
    let (c, a, role) = (z.mat_mut(), act.mat(), LinearRole::Forward);
    let g = LinearGemm::new(role, c, a, w.down.mat().t());
    linear_gemm_quantized(b, precision, g, w8.down())?;
    add_delta(b, w.mlp_lora.down.as_ref(), act.mat(), z.mat_mut())?;
    Ok(z)
}

/// A block's MLP weights quantized once for all of its token tiles (under
/// fp8, with more than one tile; otherwise none, and each GEMM quantizes
/// its weight itself): as the forward GEMMs read them (`W`) or as the input
/// gradients read them (`Wᵀ`). The codes are those each GEMM would make.
pub(crate) struct MlpWeights8<B: Backend> {
    gate: Option<Fp8Operand<B>>,
    up: Option<Fp8Operand<B>>,
    down: Option<Fp8Operand<B>>,
}

impl<B: Backend> MlpWeights8<B> {
    pub(crate) fn none() -> Self {
        MlpWeights8 {
            gate: None,
            up: None,
            down: None,
        }
    }

    /// The views given of gate, up and down, quantized (`tiles` ≥ 2).
    fn of(
        b: &B,
        (precision, tiles): (Precision, usize),
        [gate, up, down]: [Option<Mat<'_, B>>; 3],
    ) -> Result<Self> {
        if tiles < 2 {
            return Ok(Self::none());
        }
        let q = |m: Option<Mat<'_, B>>| match m {
            Some(m) => Fp8Operand::of(b, precision, m, Fp8Format::E4M3),
            None => Ok(None),
        };
        Ok(MlpWeights8 {
            gate: q(gate)?,
            up: q(up)?,
            down: q(down)?,
        })
    }

    /// The block forward's: gate, up and down as `W`.
    fn forward(b: &B, p: Precision, w: &BlockWeights<B>, tiles: usize) -> Result<Self> {
        let all = [Some(w.gate.mat()), Some(w.up.mat()), Some(w.down.mat())];
        Self::of(b, (p, tiles), all)
    }

    /// The tiles' forward again in the backward: gate and up as `W`.
    fn recompute(b: &B, p: Precision, w: &BlockWeights<B>, tiles: usize) -> Result<Self> {
        Self::of(b, (p, tiles), [Some(w.gate.mat()), Some(w.up.mat()), None])
    }

    /// The input gradients': gate, up and down as `Wᵀ`.
    fn input_grads(b: &B, p: Precision, w: &BlockWeights<B>, tiles: usize) -> Result<Self> {
        let (g, u, d) = (w.gate.mat().t(), w.up.mat().t(), w.down.mat().t());
        Self::of(b, (p, tiles), [Some(g), Some(u), Some(d)])
    }

    fn gate(&self) -> Quantized<'_, B> {
        Quantized {
            a: None,
            b: self.gate.as_ref().map(Fp8Operand::codes),
        }
    }
    fn up(&self) -> Quantized<'_, B> {
        Quantized {
            a: None,
            b: self.up.as_ref().map(Fp8Operand::codes),
        }
    }
    fn down(&self) -> Quantized<'_, B> {
        Quantized {
            a: None,
            b: self.down.as_ref().map(Fp8Operand::codes),
        }
    }
}

//! One rank's model state during training — parameters, gradients and
//! optimizer — replicated on every rank or sharded (FSDP). The trainer's
//! loop is written once against [`RankModel`].

use crate::backend::Backend;
use crate::comm::Mesh;
use crate::error::Result;
use crate::model::forward::LossRows;
use crate::model::progress::Progress;
use crate::model::{Decoder, ParamStore};
use crate::optim::Update;
use std::path::Path;

/// Where a sequence falls in an optimizer step of `--grad-accum` sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Micro {
    /// The step's first sequence: gradients start from zero.
    pub first: bool,
    /// The step's last sequence: gradients are reduced over the ranks.
    pub last: bool,
}

impl Micro {
    /// Sequence `i` of a step of `n`.
    pub fn of(i: usize, n: usize) -> Self {
        Micro {
            first: i == 0,
            last: i + 1 == n,
        }
    }
}

/// One sequence of a step as a rank sees it: its tokens `ids` with their
/// `targets`, the loss's scale (1 / the step's counted targets) and where
/// the sequence falls in the step.
#[derive(Debug, Clone, Copy)]
pub struct Sequence<'a> {
    pub ids: &'a [u32],
    pub targets: &'a [u32],
    pub grad_scale: f32,
    pub micro: Micro,
}

/// What the training loop needs from a rank's model state.
pub trait RankModel<B: Backend> {
    /// Forward and backward of one sequence shard, adding to the step's
    /// gradients (from zero for the step's first sequence); after the
    /// last sequence of a step they are complete (summed over the ranks,
    /// or reduce-scattered to their owners). Returns this rank's summed loss.
    fn forward_backward(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        seq: Sequence<'_>,
    ) -> Result<f64>;
    /// One optimizer step at 1-based `step`, applied only when `loss_finite`
    /// and the gradient norm is finite (`Update::applies`: otherwise no
    /// weight and no optimizer state changes). With the optimizer on the
    /// host its updates run in the next forward (`optim::settling`), or at
    /// [`settle`](RankModel::settle).
    fn optimizer_step(&mut self, b: &B, step: u32, loss_finite: bool) -> Result<Update>;
    /// Runs every optimizer update still pending: the parameters are then
    /// those of the last step (a checkpoint does this itself).
    fn settle(&mut self, b: &B) -> Result<()>;
    /// Forward only over this rank's rows (evaluation during training,
    /// `train::eval_during`): the summed loss of each of their groups
    /// ([`Decoder::forward_loss`]) with the parameters the rank holds;
    /// sharded ones are gathered unit by unit as the training forward
    /// gathers them ([`Decoder::forward_loss_units`]), so no rank ever holds
    /// a second copy of the model.
    fn forward_loss(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        rows: LossRows<'_>,
    ) -> Result<Vec<f64>>;
    /// Forward only over this rank's tokens `ids`, with the parameters the
    /// run holds: the host logits of `rows` (retrieval trials during
    /// training, `train::retrieval_during`; [`Decoder::forward_logit_rows`]).
    fn forward_logit_rows(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        ids: &[u32],
        rows: &[usize],
    ) -> Result<Vec<Vec<f32>>>;
    /// Writes a checkpoint of `step` into `dir` (collective: every rank
    /// calls it; `lead` is the rank that writes shared files).
    fn save(
        &mut self,
        b: &B,
        dir: &Path,
        step: u64,
        extra: &serde_json::Value,
        lead: bool,
    ) -> Result<()>;
}

/// One sequence's forward and backward with parameters from `store`,
/// logging progress through a long step on rank 0.
pub fn pass<B: Backend, S: ParamStore<B>>(
    b: &B,
    (decoder, mesh): (&Decoder<B>, &Mesh<B>),
    store: &mut S,
    seq: Sequence<'_>,
) -> Result<f64> {
    let Sequence {
        ids,
        targets,
        grad_scale,
        ..
    } = seq;
    let (layers, checkpoint) = (decoder.cfg.layers, decoder.policy.checkpoint);
    let mut store = Progress::new(store, layers, checkpoint, mesh.rank == 0)
        .with_backward_floor(decoder.backward_floor)
        .with_checkpoint_every(decoder.policy.checkpoint_every);
    decoder.forward_backward(b, mesh, &mut store, ids, targets, grad_scale)
}

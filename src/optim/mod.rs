//! Optimizers over a rank's parameters, whatever store holds them: the
//! [`Optimizer`] trait, its [`Slot`]s (a whole parameter, or a rank's FSDP
//! shard of a unit), AdamW with its clipping (`adamw.rs`) and its
//! learning-rate schedules (`schedule.rs`: cosine, linear, constant, WSD),
//! its state's formats (`state_format.rs`: F32, BF16 or 8-bit moments, F32
//! masters or none; a slot's moment in its format: `moments.rs`), its state
//! in pinned host memory with the update deferred into the next
//! forward (`host.rs`, `settling.rs`), and the guard that stops a diverged
//! run (`divergence.rs`).

pub mod adamw;
pub mod divergence;
pub mod host;
pub mod moments;
pub mod schedule;
pub mod settling;
pub mod slot;
pub mod state_format;

pub use adamw::*;
pub use slot::{Lent, Piece, Slot, slots_through};
pub use state_format::{GradDtype, MasterWeights, MomentFormat, StateFormat};

use crate::backend::Backend;
use crate::error::Result;

/// One kind of per-slot state an optimizer keeps, named as PyTorch's AdamW
/// names it in checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateKind {
    /// First moment.
    ExpAvg,
    /// Second moment.
    ExpAvgSq,
    /// F32 master copy of a lower-precision parameter.
    Master,
}

impl StateKind {
    /// The name checkpoints use (`exp_avg.<param>`, ...).
    pub fn name(self) -> &'static str {
        match self {
            StateKind::ExpAvg => "exp_avg",
            StateKind::ExpAvgSq => "exp_avg_sq",
            StateKind::Master => "master",
        }
    }
}

/// An optimizer of a rank's parameters: it updates the slots the parameter
/// store lends it ([`Lent`]), given the global gradient norm the store
/// computed (a store knows how its gradients are spread over ranks).
pub trait Optimizer<B: Backend> {
    /// One update at 1-based `step`; none when `loss_finite` is false or
    /// `grad_norm` is not finite ([`Update::applies`]).
    fn step(
        &mut self,
        b: &B,
        lent: &mut Lent<'_, B>,
        grad_norm: f64,
        step: u32,
        loss_finite: bool,
    ) -> Result<Update>;
    /// Whether updates of the last step are still to run.
    fn has_pending(&self) -> bool;
    /// Runs the deferred updates of the first `upto` slots of update order
    /// (`usize::MAX`: all).
    fn settle(&mut self, b: &B, lent: &mut Lent<'_, B>, upto: usize) -> Result<()>;
    /// The slots it updates.
    fn slots(&self) -> &[Slot];
    /// The kinds of state it keeps for slot `slot` (what a checkpoint saves).
    fn kinds(&self, slot: usize) -> Vec<StateKind>;
    /// Slot `slot`'s state of one kind as F32 values, decoded from the
    /// format it is kept in (None: not kept).
    fn state_values(&self, b: &B, slot: usize, kind: StateKind) -> Result<Option<Vec<f32>>>;
    /// Restores slot `slot`'s state of one kind from F32 values, encoded
    /// in the format it is kept in (false: not kept). Values this optimizer
    /// decoded come back bit for bit.
    fn restore(&mut self, b: &B, slot: usize, kind: StateKind, values: &[f32]) -> Result<bool>;

    /// Whether slot `slot` keeps state of `kind`.
    fn keeps(&self, slot: usize, kind: StateKind) -> bool {
        self.kinds(slot).contains(&kind)
    }
}

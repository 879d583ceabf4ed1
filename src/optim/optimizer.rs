//! The [`Optimizer`] trait every optimizer of a rank's parameters
//! implements, what one step did ([`Update`]), and the state it keeps per
//! slot ([`StateKind`], declared per element as [`StateSpec`]s).

use crate::backend::{Backend, DType};
use crate::error::Result;
use crate::optim::slot::{Lent, Slot};

/// One kind of per-slot state an optimizer keeps, by the name checkpoints
/// give it (`exp_avg.<param>`, ...): each optimizer declares its own
/// ([`StateSpec`]); AdamW's are named as PyTorch's AdamW names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StateKind(pub &'static str);

impl StateKind {
    /// AdamW's first moment.
    pub const EXP_AVG: StateKind = StateKind("exp_avg");
    /// AdamW's second moment.
    pub const EXP_AVG_SQ: StateKind = StateKind("exp_avg_sq");
    /// F32 master copy of a lower-precision parameter (any optimizer's).
    pub const MASTER: StateKind = StateKind("master");

    /// The name checkpoints use (`exp_avg.<param>`, ...).
    pub fn name(self) -> &'static str {
        self.0
    }
}

/// One state tensor an optimizer keeps per parameter element, as it
/// declares it: what the planner counts and a checkpoint names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateSpec {
    pub kind: StateKind,
    /// The dtype it is kept in on the device (8-bit codes keep an F32
    /// scale per block beside them, a fraction of a byte per element).
    pub dtype: DType,
}

impl StateSpec {
    /// Its bytes per parameter element (block scales aside).
    pub fn bytes(&self) -> usize {
        self.dtype.size()
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

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Update {
    /// The step's learning rate.
    pub lr: f32,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the update was applied: a step whose loss or gradient norm
    /// is not finite changes no weight and no optimizer state.
    pub applied: bool,
}

impl Update {
    /// Whether a step with this loss (finite or not) and gradient norm may
    /// change the model. Every rank decides alike: both are global.
    pub fn applies(loss_finite: bool, grad_norm: f64) -> bool {
        loss_finite && grad_norm.is_finite()
    }

    pub(crate) fn applied(lr: f32, grad_norm: f64) -> Self {
        Update {
            lr,
            grad_norm,
            applied: true,
        }
    }

    pub(crate) fn skipped(lr: f32, grad_norm: f64) -> Self {
        Update {
            lr,
            grad_norm,
            applied: false,
        }
    }
}

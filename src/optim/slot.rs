//! What an optimizer updates: slots. A slot is one tensor of a rank's
//! parameters — a whole parameter (the model replicated on every rank) or
//! the rank's shard of one unit (FSDP) — with the HF-named element ranges
//! it holds, so one optimizer serves every parameter store.

use crate::backend::{Backend, Tensor};
use crate::model::Unit;
use std::ops::Range;

/// Elements `elems` of parameter `name` lie in a slot at `at..`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's HF name (weight decay is chosen by it).
    pub name: String,
    /// Where the piece lies in the slot's tensor.
    pub at: Range<usize>,
}

/// One tensor the optimizer updates: its unit (which orders updates and
/// decides where its state lives) and the parameters' pieces in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub unit: Unit,
    pub pieces: Vec<Piece>,
}

impl Slot {
    /// A slot holding one whole parameter of `numel` elements.
    pub fn whole(unit: Unit, name: String, numel: usize) -> Self {
        Slot {
            unit,
            pieces: vec![Piece { name, at: 0..numel }],
        }
    }
}

/// A step's parameters and gradients as the store lends them, slot by slot
/// (`params[k]`, `grads[k]` are slot k's tensors: the parameter in the
/// compute dtype, its F32 gradient; `None` while it is in a collective,
/// an error only if the optimizer needs it then).
pub struct Lent<'a, B: Backend> {
    pub params: Vec<Option<&'a mut Tensor<B>>>,
    pub grads: Vec<Option<&'a mut Tensor<B>>>,
}

/// The slots, among `units` in update order, of every unit up to and
/// including `unit` ([`super::settling::update_order`]).
pub fn slots_through(slots: &[Slot], unit: Unit, layers: usize) -> usize {
    let last = super::settling::update_index(unit, layers);
    slots
        .iter()
        .filter(|s| super::settling::update_index(s.unit, layers) <= last)
        .count()
}

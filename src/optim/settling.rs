//! The last step's host updates (`--offload-optimizer`) run inside the next
//! step's forward: a [`ParamStore`] wrapper that, before the decoder asks
//! for a unit, updates the slots of every unit through the one after it.
//! The GPU meanwhile runs the unit the decoder asked for before, so the
//! host's AdamW runs behind the forward instead of between the steps. The
//! one after is settled too because a store may start gathering it (FSDP's
//! prefetch) when this one is acquired.
//!
//! A step's units are updated head first ([`update_order`]): the head's
//! gradient and its pinned upload buffer (the LM head's are the largest)
//! then lie beside none of the forward's offloaded activations, which are
//! all on the host by the time the forward reaches the head.
//!
//! The arithmetic is unchanged: each slot gets the same update from the
//! same gradient, only later; every slot is settled before the backward
//! writes gradients (the forward acquires every unit), before a checkpoint
//! is written and when training ends.

use crate::backend::Backend;
use crate::error::Result;
use crate::model::{ParamStore, Unit};

/// An optimizer whose step's host updates may still be pending for `S`.
pub trait Deferred<B: Backend, S> {
    /// Runs the pending updates of every unit up to and including `unit`.
    fn settle_through(&mut self, b: &B, store: &mut S, unit: Unit) -> Result<()>;
}

/// The order a deferred step updates its units in: the head, then the
/// forward's order (embedding, blocks).
pub fn update_order(layers: usize) -> Vec<Unit> {
    let mut v = vec![Unit::Head, Unit::Embed];
    v.extend((0..layers).map(Unit::Block));
    v
}

/// `unit`'s position in [`update_order`].
pub fn update_index(unit: Unit, layers: usize) -> usize {
    match unit {
        Unit::Head => 0,
        Unit::Embed => 1,
        Unit::Block(l) => {
            debug_assert!(l < layers);
            2 + l
        }
    }
}

/// Whether `unit`'s optimizer state lives on the host when the last
/// `host_units` units of [`update_order`] keep theirs there
/// (`MemoryPolicy::offload_optimizer`).
pub fn state_on_host(unit: Unit, layers: usize, host_units: usize) -> bool {
    update_index(unit, layers) + host_units >= layers + 2
}

/// The unit the forward asks for after `unit` (the head asks for none).
pub fn next_in_forward(unit: Unit, layers: usize) -> Unit {
    match unit {
        Unit::Embed if layers > 0 => Unit::Block(0),
        Unit::Block(l) if l + 1 < layers => Unit::Block(l + 1),
        _ => Unit::Head,
    }
}

/// `store`, with `optimizer`'s pending updates settled ahead of each unit.
pub struct Settling<'s, S, O> {
    store: &'s mut S,
    optimizer: &'s mut O,
    layers: usize,
}

impl<'s, S, O> Settling<'s, S, O> {
    pub fn new(store: &'s mut S, optimizer: &'s mut O, layers: usize) -> Self {
        Settling {
            store,
            optimizer,
            layers,
        }
    }
}

impl<B: Backend, S: ParamStore<B>, O: Deferred<B, S>> ParamStore<B> for Settling<'_, S, O> {
    fn acquire(&mut self, b: &B, unit: Unit) -> Result<()> {
        let through = next_in_forward(unit, self.layers);
        self.optimizer.settle_through(b, self.store, through)?;
        self.store.acquire(b, unit)
    }
    crate::model::store::delegate_param_store!(store);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_updated_head_first() {
        let order = update_order(3);
        assert_eq!(order[0], Unit::Head);
        assert_eq!(order[1..].to_vec(), Unit::all(3)[..4].to_vec());
        for (i, u) in order.into_iter().enumerate() {
            assert_eq!(update_index(u, 3), i);
        }
    }

    #[test]
    fn the_host_holds_the_last_units_of_update_order() {
        let on_host = |n| {
            update_order(3)
                .into_iter()
                .filter(|&u| state_on_host(u, 3, n))
                .collect::<Vec<_>>()
        };
        assert!(on_host(0).is_empty());
        assert_eq!(on_host(1), vec![Unit::Block(2)]);
        assert_eq!(
            on_host(4),
            vec![Unit::Embed, Unit::Block(0), Unit::Block(1), Unit::Block(2)]
        );
        assert_eq!(on_host(5), update_order(3));
    }

    #[test]
    fn the_next_unit_follows_the_forward() {
        assert_eq!(next_in_forward(Unit::Embed, 2), Unit::Block(0));
        assert_eq!(next_in_forward(Unit::Block(0), 2), Unit::Block(1));
        assert_eq!(next_in_forward(Unit::Block(1), 2), Unit::Head);
        assert_eq!(next_in_forward(Unit::Head, 2), Unit::Head);
        assert_eq!(next_in_forward(Unit::Embed, 0), Unit::Head);
    }
}

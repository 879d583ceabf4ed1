//! Where the decoder gets its parameters and sends its gradients, one unit
//! (the embedding, a block, the final norm + LM head) at a time.
//!
//! The decoder asks for a unit just before it uses it and gives it back
//! right after, so a store may hold the whole model ([`crate::train`]'s
//! replicated store) or only a shard of every unit, gathering each unit on
//! demand (FSDP): the decoder's arithmetic is the same either way.

use super::grads::BlockGrads;
pub use super::unit::Unit;
use super::weights::BlockWeights;
use crate::backend::{Backend, Tensor};
use crate::error::Result;

/// The head's parameters and gradients at the loss: `model.norm` and the LM
/// head matrix (the embedding when tied), with their F32 gradients (`None`:
/// frozen, no gradient computed).
pub struct HeadView<'a, B: Backend> {
    pub norm: &'a Tensor<B>,
    pub head: &'a Tensor<B>,
    pub d_norm: Option<&'a mut Tensor<B>>,
    pub d_head: Option<&'a mut Tensor<B>>,
}

/// Parameters and gradients of one training step, one unit at a time.
///
/// Call order within a step: [`acquire`](ParamStore::acquire) a unit, read
/// it, [`release`](ParamStore::release) it; in backward take its gradient
/// buffers, accumulate, then [`grads_done`](ParamStore::grads_done); at the
/// end [`finish`](ParamStore::finish). Units are acquired in
/// [`Unit::step_order`], so a store may prefetch the next one.
pub trait ParamStore<B: Backend> {
    /// Makes `unit`'s parameters readable until [`release`](ParamStore::release).
    fn acquire(&mut self, b: &B, unit: Unit) -> Result<()>;
    /// The decoder is done reading `unit` for now.
    fn release(&mut self, unit: Unit) -> Result<()>;
    /// The embedding table `[vocab, hidden]` (acquired as [`Unit::Embed`]).
    fn embed(&self) -> Result<&Tensor<B>>;
    /// Block `l`'s parameters (acquired as [`Unit::Block`]).
    fn block(&self, l: usize) -> Result<&BlockWeights<B>>;
    /// `model.norm` (acquired as [`Unit::Head`]).
    fn final_norm(&self) -> Result<&Tensor<B>>;
    /// The LM head matrix `[vocab, hidden]`, read only (acquired as
    /// [`Unit::Head`]; a tied head is the embedding: [`Unit::Embed`] too).
    fn head(&self) -> Result<&Tensor<B>>;
    /// Block `l`'s parameters with its F32 gradient buffers to add into
    /// (none for its frozen parameters).
    fn block_grads(&mut self, b: &B, l: usize) -> Result<(&BlockWeights<B>, &mut BlockGrads<B>)>;
    /// The head's parameters with their gradient buffers (a tied head's
    /// gradient is the embedding's: [`Unit::Embed`] must be acquired too).
    fn head_grads(&mut self, b: &B) -> Result<HeadView<'_, B>>;
    /// The embedding's F32 gradient buffer (its backward reads no
    /// parameters; `None`: frozen, the backward stops before it).
    fn embed_grads(&mut self, b: &B) -> Result<Option<&mut Tensor<B>>>;
    /// `unit`'s gradients of this use are complete (a tied embedding is
    /// used twice: by the head, then by the embedding's backward).
    fn grads_done(&mut self, b: &B, unit: Unit) -> Result<()>;
    /// Every gradient of the step has been handed over: wait for whatever
    /// is still being reduced.
    fn finish(&mut self, b: &B) -> Result<()>;
}

/// The [`ParamStore`] methods other than `acquire`, each passed on to the
/// wrapped store in field `$inner`: for wrappers that only add work before
/// a unit is acquired (`model::progress`, `optim::settling`).
macro_rules! delegate_param_store {
    ($inner:ident) => {
        fn release(&mut self, unit: $crate::model::Unit) -> $crate::error::Result<()> {
            self.$inner.release(unit)
        }
        fn embed(&self) -> $crate::error::Result<&$crate::backend::Tensor<B>> {
            self.$inner.embed()
        }
        fn block(&self, l: usize) -> $crate::error::Result<&$crate::model::BlockWeights<B>> {
            self.$inner.block(l)
        }
        fn final_norm(&self) -> $crate::error::Result<&$crate::backend::Tensor<B>> {
            self.$inner.final_norm()
        }
        fn head(&self) -> $crate::error::Result<&$crate::backend::Tensor<B>> {
            self.$inner.head()
        }
        fn block_grads(
            &mut self,
            b: &B,
            l: usize,
        ) -> $crate::error::Result<(
            &$crate::model::BlockWeights<B>,
            &mut $crate::model::BlockGrads<B>,
        )> {
            self.$inner.block_grads(b, l)
        }
        fn head_grads(&mut self, b: &B) -> $crate::error::Result<$crate::model::HeadView<'_, B>> {
            self.$inner.head_grads(b)
        }
        fn embed_grads(
            &mut self,
            b: &B,
        ) -> $crate::error::Result<Option<&mut $crate::backend::Tensor<B>>> {
            self.$inner.embed_grads(b)
        }
        fn grads_done(&mut self, b: &B, unit: $crate::model::Unit) -> $crate::error::Result<()> {
            self.$inner.grads_done(b, unit)
        }
        fn finish(&mut self, b: &B) -> $crate::error::Result<()> {
            self.$inner.finish(b)
        }
    };
}
pub(crate) use delegate_param_store;

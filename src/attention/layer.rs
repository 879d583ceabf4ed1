//! The attention layer of one rank under a context-parallel plan
//! ([`CpAttention`]): its RoPE tables and mask, forward and backward by
//! strategy.

use super::cp_plan::{CpPlan, Strategy};
use super::dims::AttnDims;
use super::rope::RopeTables;
use super::saved::AttnSaved;
use super::weights::{AttentionGrads, AttentionWeights};
use super::{local, staged};
use crate::backend::{AttnMask, Backend, Tensor};
use crate::comm::Mesh;
use crate::error::Result;

/// The attention layer of one rank under a context-parallel plan.
pub struct CpAttention<B: Backend> {
    pub dims: AttnDims,
    pub plan: CpPlan,
    /// RoPE tables for the positions this rank attends over (its ring
    /// shard): sequence positions, or positions within each document under
    /// a documents mask.
    rope: RopeTables<B>,
    /// Whether `rope` holds positions within documents (else sequence positions).
    rope_per_document: bool,
    /// This rank's place in its ring group.
    ring_rank: usize,
    /// The mask over the whole sequence (each strategy cuts it into its
    /// calls' masks).
    mask: AttnMask,
}

impl<B: Backend> CpAttention<B> {
    /// Prepares the layer for the rank `mesh.rank` of `plan.mesh_shape()`,
    /// attending under `mask` over the whole sequence.
    pub fn new(
        b: &B,
        dims: AttnDims,
        plan: CpPlan,
        mesh: &Mesh<B>,
        mask: AttnMask,
    ) -> Result<Self> {
        let ring = mesh.ring.rank();
        let n = plan.layout.seq / plan.layout.pr;
        let positions = || plan.layout.ring_shard_positions(ring);
        let rope = RopeTables::of(b, &dims.rope, dims.head_dim, n, positions)?;
        let mut layer = CpAttention {
            dims,
            plan,
            rope,
            rope_per_document: false,
            ring_rank: ring,
            mask: AttnMask::Causal,
        };
        layer.set_mask(b, mask)?;
        Ok(layer)
    }

    /// The mask over the whole sequence.
    pub fn mask(&self) -> &AttnMask {
        &self.mask
    }

    /// Attends under `mask` from the next call on (a window's documents
    /// change every window). A documents mask ([`AttnMask::Bounded`] of
    /// several documents, with or without a sliding window) over the
    /// plan's sequence also restarts RoPE's positions at each document:
    /// the tables are rewritten in place (no allocation; a rehearsal
    /// computes nothing).
    pub fn set_mask(&mut self, b: &B, mask: AttnMask) -> Result<()> {
        let seq = self.plan.layout.seq;
        let per_document = match &mask {
            AttnMask::Full | AttnMask::Causal => false,
            AttnMask::Bounded(m) if m.seq() == seq && m.rows().0.len() == seq => !m.one_document(),
            AttnMask::Bounded(m) => {
                return crate::config_err!(
                    "a documents mask over {} positions for a sequence of {seq}; build it from \
                     the window's document starts",
                    m.seq()
                );
            }
        };
        if (per_document || self.rope_per_document) && !b.rehearsing() {
            let shard = self.plan.layout.ring_shard_positions(self.ring_rank);
            let positions: Vec<usize> = match &mask {
                AttnMask::Bounded(m) => shard.iter().map(|&p| p - m.doc_start_at(p)).collect(),
                AttnMask::Full | AttnMask::Causal => shard,
            };
            self.rope
                .rewrite(b, &self.dims.rope, self.dims.head_dim, &positions)?;
        }
        self.rope_per_document = per_document;
        self.mask = mask;
        Ok(())
    }

    fn local<'a>(&'a self, b: &'a B) -> local::Local<'a, B> {
        local::Local {
            b,
            dims: &self.dims,
            rope: &self.rope,
            mask: &self.mask,
        }
    }

    fn staged<'a>(&'a self, b: &'a B, mesh: &'a Mesh<B>) -> staged::Staged<'a, B> {
        staged::Staged::new(b, mesh, &self.dims, &self.plan, &self.rope, &self.mask)
    }

    /// `x: [s_local, hidden]` → `y: [s_local, hidden]` and the saved state.
    pub fn forward(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
    ) -> Result<(Tensor<B>, AttnSaved<B>)> {
        match self.plan.strategy {
            Strategy::Local => self.local(b).forward(w, x),
            _ => self.staged(b, mesh).forward(w, x),
        }
    }

    /// Backward of the forward of `x` from what it `saved` and the
    /// output's gradient `dy`: returns `dx` and accumulates this rank's
    /// partial parameter gradients.
    pub fn backward(
        &self,
        (b, mesh): (&B, &Mesh<B>),
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
        (saved, dy): (AttnSaved<B>, &Tensor<B>),
        grads: &mut AttentionGrads<B>,
    ) -> Result<Tensor<B>> {
        match self.plan.strategy {
            Strategy::Local => self.local(b).backward(w, x, saved, dy, grads),
            _ => self.staged(b, mesh).backward(w, x, saved, dy, grads),
        }
    }
}

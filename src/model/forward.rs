//! The decoder's forward-only pass, for evaluation (the loss, or a few
//! rows of logits: [`Decoder::forward_logit_rows`]): no gradient buffers and
//! nothing kept for a backward. Each block's activations live only while the
//! block runs (the attention's saved O and LSE are dropped as soon as the
//! layer returns), the MLP always runs in token tiles (`shapes::mlp_tiles`)
//! (free without a backward, since nothing is recomputed), and logits exist
//! one chunk of rows at a time. The loss is summed per group of rows (the
//! caller's position buckets), each chunk lying inside one group.
//!
//! The summed-loss op also writes a chunk's `dlogits`; here that goes to a
//! chunk-sized scratch with a gradient scale of 0, so no new kernel is needed.

use super::chunk_loop::for_each_chunk;
use super::decoder::{Decoder, MlpWeights8};
use super::store::{ParamStore, Unit};
use super::weights::{BlockWeights, ModelWeights};
use crate::backend::{Backend, Category, DType, MatLayout, RmsNormFwd, Tensor};
use crate::comm::Mesh;
use crate::error::Result;
use std::ops::Range;

/// Splits `rows` rows whose groups are `group_of_row` into runs of one group
/// of at most `chunk` rows each, in row order: `(rows, group)`.
pub fn loss_runs(group_of_row: &[usize], chunk: usize) -> Vec<(Range<usize>, usize)> {
    let chunk = chunk.max(1);
    let mut runs = Vec::new();
    let mut start = 0;
    for r in 1..=group_of_row.len() {
        let end_of_group = r == group_of_row.len() || group_of_row[r] != group_of_row[start];
        if end_of_group || r - start == chunk {
            runs.push((start..r, group_of_row[start]));
            start = r;
        }
    }
    runs
}

/// The rows an evaluation forward sums its loss over: this rank's tokens
/// `ids` with their `targets` (aligned, `IGNORE` for none), row `i` in group
/// `group_of_row[i]` of `groups`.
#[derive(Debug, Clone, Copy)]
pub struct LossRows<'a> {
    pub ids: &'a [u32],
    pub targets: &'a [u32],
    pub group_of_row: &'a [usize],
    pub groups: usize,
}

impl LossRows<'_> {
    /// One target and one group below `groups` for every token.
    fn check(&self) -> Result<()> {
        let n = self.ids.len();
        if self.targets.len() != n || self.group_of_row.len() != n {
            return crate::config_err!("one target and one group per input token");
        }
        if let Some(g) = self.group_of_row.iter().find(|&&g| g >= self.groups) {
            return crate::config_err!("row group {g} is not below the {} groups", self.groups);
        }
        Ok(())
    }
}

impl<B: Backend> Decoder<B> {
    /// Forward only over `rows`: returns the summed next-token loss of each
    /// of its groups. Under context parallelism these are this rank's
    /// partial sums.
    pub fn forward_loss(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        w: &ModelWeights<B>,
        rows: LossRows<'_>,
    ) -> Result<Vec<f64>> {
        rows.check()?;
        let hn = self.forward_hidden(b, mesh, w, rows.ids)?;
        self.grouped_loss(b, w.head(), &hn, rows)
    }

    /// Forward only over this rank's tokens `ids`: the logits of the rows
    /// `rows` (indices into `ids`; a handful, such as an answer's), on the
    /// host, `[rows.len()][vocab]`. Each row is its own LM-head product, so
    /// only those rows of logits ever exist.
    pub fn forward_logit_rows(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        w: &ModelWeights<B>,
        ids: &[u32],
        rows: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let hn = self.forward_hidden(b, mesh, w, ids)?;
        self.logit_rows(b, w.head(), &hn, rows)
    }

    /// [`Decoder::forward_logit_rows`] with the parameters of `store`, each
    /// unit acquired just before it is used and released right after (as
    /// [`Decoder::forward_loss_units`]).
    pub fn forward_logit_rows_units<S: ParamStore<B> + ?Sized>(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        store: &mut S,
        ids: &[u32],
        rows: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let hn = self.forward_hidden_units(b, mesh, store, ids)?;
        self.with_head(b, store, |store| {
            self.logit_rows(b, store.head()?, &hn, rows)
        })
    }

    /// Runs `f` with the head unit of `store` acquired, and the embedding
    /// too when the head is the tied embedding, releasing both after.
    fn with_head<S: ParamStore<B> + ?Sized, T>(
        &self,
        b: &B,
        store: &mut S,
        f: impl FnOnce(&mut S) -> Result<T>,
    ) -> Result<T> {
        let tied = self.cfg.tie_embeddings;
        store.acquire(b, Unit::Head)?;
        if tied {
            store.acquire(b, Unit::Embed)?;
        }
        let out = f(store)?;
        if tied {
            store.release(Unit::Embed)?;
        }
        store.release(Unit::Head)?;
        Ok(out)
    }

    /// The final-norm hidden states `[ids.len(), hidden]` of this rank's
    /// tokens: embedding, every block forward only, the final RMSNorm.
    fn forward_hidden(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        w: &ModelWeights<B>,
        ids: &[u32],
    ) -> Result<Tensor<B>> {
        let act = b.compute_dtype();
        let mut x = b.empty(&[ids.len(), self.cfg.hidden], act, Category::Activations)?;
        self.embed(b, &w.embed, ids, &mut x)?;
        for (l, blk) in w.blocks.iter().enumerate() {
            x = self.block_forward_only(b, mesh, l, blk, &x)?;
        }
        let mut hn = b.empty(x.shape(), act, Category::Activations)?;
        b.rms_norm_fwd(RmsNormFwd {
            x: &x,
            w: &w.final_norm,
            norm: self.norm(),
            y: &mut hn,
        })?;
        Ok(hn)
    }

    /// [`Decoder::forward_hidden`] with the parameters of `store`, each
    /// unit acquired just before it is used and released right after (the
    /// final norm is the head unit's).
    fn forward_hidden_units<S: ParamStore<B> + ?Sized>(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        store: &mut S,
        ids: &[u32],
    ) -> Result<Tensor<B>> {
        let act = b.compute_dtype();
        let mut x = b.empty(&[ids.len(), self.cfg.hidden], act, Category::Activations)?;
        store.acquire(b, Unit::Embed)?;
        self.embed(b, store.embed()?, ids, &mut x)?;
        store.release(Unit::Embed)?;
        for l in 0..self.cfg.layers {
            store.acquire(b, Unit::Block(l))?;
            x = self.block_forward_only(b, mesh, l, store.block(l)?, &x)?;
            store.release(Unit::Block(l))?;
        }
        store.acquire(b, Unit::Head)?;
        let hn = self.final_norm(b, store.final_norm()?, &x, Category::Activations)?;
        store.release(Unit::Head)?;
        Ok(hn)
    }

    /// Rows `rows` of `hn` times the LM head, each alone, on the host.
    fn logit_rows(
        &self,
        b: &B,
        head: &Tensor<B>,
        hn: &Tensor<B>,
        rows: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let (hid, v) = (self.cfg.hidden, self.cfg.vocab);
        if let Some(&r) = rows.iter().find(|&&r| r >= hn.rows()) {
            return crate::config_err!("row {r} is not below the {} rows", hn.rows());
        }
        rows.iter()
            .map(|&r| {
                let mut logits = b.empty(&[1, v], hn.dtype(), Category::Workspace)?;
                let src = MatLayout::block(r * hid, 1, hid, hid);
                b.gemm(logits.mat_mut(), hn.view(src), head.mat().t(), 1.0, 0.0)?;
                b.to_host(&logits)
            })
            .collect()
    }

    /// [`Decoder::forward_loss`] with the parameters of `store`, each unit
    /// acquired just before it is used and released right after, as the
    /// training forward does (a sharded store gathers each unit, at most
    /// two alive): evaluation during an FSDP run, with no second copy of
    /// the model. The same arithmetic in the same order.
    pub fn forward_loss_units<S: ParamStore<B> + ?Sized>(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        store: &mut S,
        rows: LossRows<'_>,
    ) -> Result<Vec<f64>> {
        rows.check()?;
        let act = b.compute_dtype();
        let mut x = b.empty(
            &[rows.ids.len(), self.cfg.hidden],
            act,
            Category::Activations,
        )?;
        store.acquire(b, Unit::Embed)?;
        self.embed(b, store.embed()?, rows.ids, &mut x)?;
        store.release(Unit::Embed)?;
        for l in 0..self.cfg.layers {
            store.acquire(b, Unit::Block(l))?;
            x = self.block_forward_only(b, mesh, l, store.block(l)?, &x)?;
            store.release(Unit::Block(l))?;
        }
        self.with_head(b, store, move |store| {
            let hn = self.final_norm(b, store.final_norm()?, &x, Category::Activations)?;
            drop(x);
            self.grouped_loss(b, store.head()?, &hn, rows)
        })
    }

    /// Block `l`'s forward, keeping nothing: the training forward's own
    /// steps (`Decoder::attn_branch`, `attn_residual`, `mlp_fwd`,
    /// `add_mlp_output`), each intermediate dropped once used and the MLP
    /// always in token tiles.
    fn block_forward_only(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        l: usize,
        w: &BlockWeights<B>,
        h: &Tensor<B>,
    ) -> Result<Tensor<B>> {
        let (a, saved, y) = self.attn_branch(b, mesh, l, w, h, None)?;
        drop((saved, a));
        let (y, mut out) = self.attn_residual(b, w, h, y)?;
        drop(y);
        let hid = self.cfg.hidden;
        for_each_chunk(b, super::shapes::mlp_tiles(h.rows(), hid, true), |rows| {
            // the tile's input is copied out before its rows are overwritten
            let x_t = self.rows_of(b, &out, &rows)?;
            let saved = self.mlp_fwd(b, w, &MlpWeights8::none(), &x_t)?;
            drop(x_t);
            self.add_mlp_output(b, (w, &MlpWeights8::none()), &saved, &mut out, &rows)
        })?;
        Ok(out)
    }

    /// LM head + summed cross-entropy per group, one run of rows (one group,
    /// at most `loss_chunk` rows) at a time.
    fn grouped_loss(
        &self,
        b: &B,
        head: &Tensor<B>,
        hn: &Tensor<B>,
        loss_rows: LossRows<'_>,
    ) -> Result<Vec<f64>> {
        let (hid, v) = (self.cfg.hidden, self.cfg.vocab);
        let targets = loss_rows.targets;
        let mut sums = (0..loss_rows.groups)
            .map(|_| b.zeros(&[1], DType::F32, Category::Workspace))
            .collect::<Result<Vec<_>>>()?;
        for (rows, group) in loss_runs(loss_rows.group_of_row, self.policy.loss_chunk) {
            let (r0, r) = (rows.start, rows.len());
            let mut logits = b.empty(&[r, v], hn.dtype(), Category::Workspace)?;
            let src = MatLayout::block(r0 * hid, r, hid, hid);
            b.gemm(logits.mat_mut(), hn.view(src), head.mat().t(), 1.0, 0.0)?;
            // the gradient the op writes over the logits is not used
            b.cross_entropy(&mut logits, &targets[rows], 0.0, &mut sums[group])?;
        }
        sums.iter()
            .map(|t| Ok(f64::from(b.to_host(t)?[0])))
            .collect()
    }
}

/// One target and one group below `groups` per input token.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_runs_split_at_groups_and_chunks() {
        assert_eq!(
            loss_runs(&[0, 0, 0, 0, 0], 2),
            vec![(0..2, 0), (2..4, 0), (4..5, 0)]
        );
        assert_eq!(
            loss_runs(&[0, 0, 1, 1, 1, 2], 2),
            vec![(0..2, 0), (2..4, 1), (4..5, 1), (5..6, 2)]
        );
        // groups may come back (a zigzag shard holds two ranges of positions)
        assert_eq!(loss_runs(&[3, 3, 0, 0], 8), vec![(0..2, 3), (2..4, 0)]);
        assert!(loss_runs(&[], 4).is_empty());
        // one group: exactly the training loss's chunks
        let rows = vec![0; 1000];
        let want: Vec<_> = crate::model::shapes::loss_chunks(1000, 256)
            .into_iter()
            .map(|r| (r, 0))
            .collect();
        assert_eq!(loss_runs(&rows, 256), want);
    }
}

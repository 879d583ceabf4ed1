//! Zigzag ring attention inside one ring group (DESIGN.md §4).
//!
//! Each ring rank holds queries and keys of its ring shard: zigzag chunks
//! `i` and `2P-1-i`, each `half` tokens. K/V blocks travel around the ring;
//! step 0 is causal on the local pair, later steps are non-causal on half
//! blocks, and partial results are merged by log-sum-exp. In backward the
//! K/V gradients travel with their blocks and return home at the end.

use crate::backend::{Backend, Category, DType, Tensor};
use crate::comm::ProcessGroup;
use crate::error::Result;
use std::ops::Range;

/// Which part of the local queries attends to which part of a visiting block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingBlock {
    /// Ring rank that owns the visiting K/V block.
    pub src: usize,
    /// Query rows of the local shard taking part.
    pub q_rows: Range<usize>,
    /// Key rows of the visiting block taking part.
    pub k_rows: Range<usize>,
    pub causal: bool,
}

/// The block computed by ring rank `i` at step `step` of `p` (shard of `2*half` tokens).
pub fn ring_block(i: usize, step: usize, p: usize, half: usize) -> RingBlock {
    let src = (i + p - step % p) % p;
    let all = 0..2 * half;
    if step == 0 {
        RingBlock {
            src,
            q_rows: all.clone(),
            k_rows: all,
            causal: true,
        }
    } else if src < i {
        // the visitor's first chunk precedes both local chunks; its second follows both
        RingBlock {
            src,
            q_rows: all,
            k_rows: 0..half,
            causal: false,
        }
    } else {
        // only the local second chunk comes after the visitor's two chunks
        RingBlock {
            src,
            q_rows: half..2 * half,
            k_rows: all,
            causal: false,
        }
    }
}

/// Ring attention forward. `q: [n, hq, d]`, `k, v: [n, hkv, d]` (this rank's
/// shard); returns `o: [n, hq, d]` and `lse: [n, hq]` (F32).
pub fn forward<B: Backend>(
    b: &B,
    ring: &dyn ProcessGroup<B>,
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
) -> Result<(Tensor<B>, Tensor<B>)> {
    let (n, hq) = (q.rows(), q.shape()[1]);
    let (p, i) = (ring.size(), ring.rank());
    let mut o = b.zeros(q.shape(), q.dtype(), Category::Workspace)?;
    // the LSE is kept for backward
    let mut lse = b.zeros(&[n, hq], DType::F32, Category::Activations)?;
    b.attention_fwd(
        q.all_rows(),
        k.all_rows(),
        v.all_rows(),
        true,
        o.all_rows_mut(),
        lse.all_rows_mut(),
    )?;
    if p == 1 {
        return Ok((o, lse));
    }
    let mut visiting: Option<(Tensor<B>, Tensor<B>)> = None;
    let mut o_blk = b.zeros(q.shape(), q.dtype(), Category::Workspace)?;
    let mut lse_blk = b.zeros(&[n, hq], DType::F32, Category::Workspace)?;
    for step in 1..p {
        let (ks, vs) = match &visiting {
            Some((kk, vv)) => (kk, vv),
            None => (k, v),
        };
        let next = pass_on(b, ring, &[ks, vs])?;
        let mut it = next.into_iter();
        let (kn, vn) = (it.next().expect("k"), it.next().expect("v"));
        let blk = ring_block(i, step, p, n / 2);
        b.attention_fwd(
            q.rows_view(blk.q_rows.clone()),
            kn.rows_view(blk.k_rows.clone()),
            vn.rows_view(blk.k_rows.clone()),
            false,
            o_blk.rows_view_mut(blk.q_rows.clone()),
            lse_blk.rows_view_mut(blk.q_rows.clone()),
        )?;
        b.lse_merge(
            o.rows_view_mut(blk.q_rows.clone()),
            lse.rows_view_mut(blk.q_rows.clone()),
            o_blk.rows_view(blk.q_rows.clone()),
            lse_blk.rows_view(blk.q_rows.clone()),
        )?;
        visiting = Some((kn, vn));
    }
    Ok((o, lse))
}

/// Ring attention backward: accumulates `dq` for the local queries and `dk`,
/// `dv` for the local K/V (all `[n, heads, d]`, F32 or compute dtype).
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend>(
    b: &B,
    ring: &dyn ProcessGroup<B>,
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
    o: &Tensor<B>,
    d_o: &Tensor<B>,
    lse: &Tensor<B>,
    dq: &mut Tensor<B>,
    dk: &mut Tensor<B>,
    dv: &mut Tensor<B>,
) -> Result<()> {
    let (p, i, n) = (ring.size(), ring.rank(), q.rows());
    if p == 1 {
        return b.attention_bwd(
            q.all_rows(),
            k.all_rows(),
            v.all_rows(),
            o.all_rows(),
            d_o.all_rows(),
            lse.all_rows(),
            true,
            dq.all_rows_mut(),
            dk.all_rows_mut(),
            dv.all_rows_mut(),
        );
    }
    // K/V of the block being visited and the gradients travelling with it.
    let mut kv: Option<(Tensor<B>, Tensor<B>)> = None;
    let mut dk_t = b.zeros(dk.shape(), dk.dtype(), Category::Workspace)?;
    let mut dv_t = b.zeros(dv.shape(), dv.dtype(), Category::Workspace)?;
    for step in 0..p {
        let blk = ring_block(i, step, p, n / 2);
        {
            let (ks, vs) = match &kv {
                Some((kk, vv)) => (kk, vv),
                None => (k, v),
            };
            b.attention_bwd(
                q.rows_view(blk.q_rows.clone()),
                ks.rows_view(blk.k_rows.clone()),
                vs.rows_view(blk.k_rows.clone()),
                o.rows_view(blk.q_rows.clone()),
                d_o.rows_view(blk.q_rows.clone()),
                lse.rows_view(blk.q_rows.clone()),
                blk.causal,
                dq.rows_view_mut(blk.q_rows.clone()),
                dk_t.rows_view_mut(blk.k_rows.clone()),
                dv_t.rows_view_mut(blk.k_rows.clone()),
            )?;
        }
        // Pass the block on with its gradients; after the last step only the
        // gradients move, arriving back at the block's owner.
        if step + 1 < p {
            let (ks, vs) = match &kv {
                Some((kk, vv)) => (kk, vv),
                None => (k, v),
            };
            let mut moved = pass_on(b, ring, &[ks, vs, &dk_t, &dv_t])?.into_iter();
            let kn = moved.next().expect("k");
            let vn = moved.next().expect("v");
            dk_t = moved.next().expect("dk");
            dv_t = moved.next().expect("dv");
            kv = Some((kn, vn));
        } else {
            kv = None;
            let mut moved = pass_on(b, ring, &[&dk_t, &dv_t])?.into_iter();
            dk_t = moved.next().expect("dk");
            dv_t = moved.next().expect("dv");
        }
    }
    b.axpy(dk, 1.0, &dk_t)?;
    b.axpy(dv, 1.0, &dv_t)?;
    Ok(())
}

/// Sends tensors to the next ring rank and receives the previous rank's.
fn pass_on<B: Backend>(
    b: &B,
    ring: &dyn ProcessGroup<B>,
    ts: &[&Tensor<B>],
) -> Result<Vec<Tensor<B>>> {
    let (p, i) = (ring.size(), ring.rank());
    ts.iter()
        .map(|t| {
            let mut r = b.zeros(t.shape(), t.dtype(), Category::Comm)?;
            ring.send_recv(t, (i + 1) % p, &mut r, (i + p - 1) % p)?;
            Ok(r)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block masks equal the plain causal mask on global positions.
    #[test]
    fn ring_blocks_cover_exactly_the_causal_pairs() {
        for p in 1..6 {
            let half = 3;
            let l = crate::attention::layout::SeqLayout::new(2 * p * half, 1, p).unwrap();
            for i in 0..p {
                let qpos = l.ring_shard_positions(i);
                let mut seen = std::collections::HashSet::new();
                for step in 0..p {
                    let blk = ring_block(i, step, p, half);
                    let kpos = l.ring_shard_positions(blk.src);
                    for a in blk.q_rows.clone() {
                        for bb in blk.k_rows.clone() {
                            let visible = !blk.causal || bb <= a;
                            if visible {
                                assert!(kpos[bb] <= qpos[a], "future key attended");
                                assert!(seen.insert((qpos[a], kpos[bb])), "pair twice");
                            }
                        }
                    }
                }
                let want: usize = qpos.iter().map(|&x| x + 1).sum();
                assert_eq!(seen.len(), want, "every causal pair once (p={p}, i={i})");
            }
        }
    }
}

//! Zigzag ring attention inside one ring group (DESIGN.md §4).
//!
//! Each ring rank holds queries and keys of its ring shard: zigzag chunks
//! `i` and `2P-1-i`, each `half` tokens. K/V blocks travel around the ring;
//! step 0 is causal on the local pair, later steps are non-causal on half
//! blocks (under a full mask every step is whole blocks), and partial results
//! are merged by log-sum-exp. Each block's mask comes from the sequence's
//! ([`ring_block`]). This file is the relay, which causal and full masks
//! take: each block passes on from rank to rank, and in backward the K/V
//! gradients travel with their blocks and return home at the end; a block
//! no local query may see is not computed, but still passes on. Bounded
//! masks (documents, sliding windows) take direct shifts instead
//! ([`super::ring_shift`], the ring's entry), which send a block only to
//! the ranks that need it.

use crate::backend::{
    AttentionBwd, AttentionFwd, AttnGradWrites, AttnMask, Backend, Category, DType, GradWrite,
    LseMerge, RowPositions, Tensor,
};
use crate::comm::{Pending, ProcessGroup};
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
    /// The block's mask in its own rows (`q_rows` × `k_rows`).
    pub mask: AttnMask,
}

/// The block computed by ring rank `i` at step `step` of `p` (shard of
/// `2*half` tokens) when the whole sequence's mask is `seq_mask`.
pub fn ring_block(i: usize, step: usize, p: usize, half: usize, seq_mask: &AttnMask) -> RingBlock {
    let src = (i + p - step % p) % p;
    let all = 0..2 * half;
    match seq_mask {
        AttnMask::Full => RingBlock {
            src,
            q_rows: all.clone(),
            k_rows: all,
            mask: AttnMask::Full,
        },
        AttnMask::Causal => causal_ring_block(i, step, src, half),
        AttnMask::Bounded(m) => {
            // the causal block's rows, with the sequence's bound seen
            // through the positions the two shards hold
            let blk = causal_ring_block(i, step, src, half);
            let n = 2 * half;
            let rows = m.with_rows(shard_rows(i, p, n), shard_rows(src, p, n));
            RingBlock {
                mask: AttnMask::Bounded(rows.slice(blk.q_rows.clone(), blk.k_rows.clone())),
                ..blk
            }
        }
    }
}

/// The sequence positions ring rank `i` of `p` holds in its shard of `n`
/// tokens: zigzag chunks `i` and `2p-1-i` (the whole sequence when `p == 1`).
pub fn shard_rows(i: usize, p: usize, n: usize) -> RowPositions {
    if p == 1 {
        return RowPositions::contiguous(0, n);
    }
    let half = n / 2;
    let j = 2 * p - 1 - i;
    RowPositions::two_runs(i * half..(i + 1) * half, j * half..(j + 1) * half)
}

/// The mask of ring rank `i`'s local block (its queries against its own
/// keys, step 0) over a shard of `n` tokens, from the sequence's `mask`:
/// the shard's rows are in sequence order, so causal stays causal.
pub(crate) fn local_block_mask(mask: &AttnMask, i: usize, p: usize, n: usize) -> Result<AttnMask> {
    match mask {
        AttnMask::Full | AttnMask::Causal => Ok(mask.clone()),
        AttnMask::Bounded(m) if m.seq() == n * p => {
            let rows = shard_rows(i, p, n);
            Ok(AttnMask::Bounded(m.with_rows(rows, rows)))
        }
        AttnMask::Bounded(m) => Err(crate::Error::Backend(format!(
            "ring attention: a documents mask over {} positions for a sequence of {} ({p} shards \
             of {n})",
            m.seq(),
            n * p
        ))),
    }
}

/// [`ring_block`] of a causal sequence, visiting ring rank `src`'s block.
fn causal_ring_block(i: usize, step: usize, src: usize, half: usize) -> RingBlock {
    let all = 0..2 * half;
    if step == 0 {
        // the local pair's rows are in sequence order (chunk i, then
        // chunk 2P-1-i), so the causal mask holds on them as is
        RingBlock {
            src,
            q_rows: all.clone(),
            k_rows: all,
            mask: AttnMask::Causal,
        }
    } else if src < i {
        // the visitor's first chunk precedes both local chunks; its second follows both
        RingBlock {
            src,
            q_rows: all,
            k_rows: 0..half,
            mask: AttnMask::Full,
        }
    } else {
        // only the local second chunk comes after the visitor's two chunks
        RingBlock {
            src,
            q_rows: half..2 * half,
            k_rows: all,
            mask: AttnMask::Full,
        }
    }
}

/// Ring attention forward under the sequence's `mask`. `q: [n, hq, d]`,
/// `k, v: [n, hkv, d]` (this rank's shard); returns `o: [n, hq, d]` and
/// `lse: [n, hq]` (F32).
///
/// Each K/V block is passed on to the next rank as soon as it arrives, so
/// the transfer of the block for step `s + 1` runs beside step `s`'s
/// attention where the group overlaps transfers (NCCL).
pub fn forward<B: Backend>(
    b: &B,
    ring: &dyn ProcessGroup<B>,
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
    mask: &AttnMask,
    scale: f32,
) -> Result<(Tensor<B>, Tensor<B>)> {
    let (p, i) = (ring.size(), ring.rank());
    let mut out = RingOutput::new(b, q)?;
    // the local block starts travelling before the local attention
    let relay = (p > 1).then(|| KvRelay::start(b, ring, k, v)).transpose()?;
    out.local(b, [q, k, v], (mask, i, p), scale)?;
    if p == 1 {
        return Ok(out.finish());
    }
    let mut relay = relay.expect("started for p > 1");
    out.make_scratch(b, q)?;
    for step in 1..p {
        let kv = relay.advance(b, ring, step + 1 == p)?;
        let blk = ring_block(i, step, p, q.rows() / 2, mask);
        if blk.mask.hides_all(blk.q_rows.len(), blk.k_rows.len()) {
            continue;
        }
        out.add(b, q, kv, &blk, scale)?;
    }
    drop(relay);
    Ok(out.finish())
}

/// A ring forward's output `o: [n, hq, d]` and `lse: [n, hq]` (F32, kept
/// for backward), accumulated block by block: the local block's attention,
/// then each arrived block's attention merged in by its log-sum-exp.
pub(super) struct RingOutput<B: Backend> {
    o: Tensor<B>,
    lse: Tensor<B>,
    /// One block's output and LSE (made once the ring has other ranks).
    scratch: Option<(Tensor<B>, Tensor<B>)>,
}

impl<B: Backend> RingOutput<B> {
    pub(super) fn new(b: &B, q: &Tensor<B>) -> Result<Self> {
        let (n, hq) = (q.rows(), q.shape()[1]);
        let o = b.zeros(q.shape(), q.dtype(), Category::Workspace)?;
        let lse = b.zeros(&[n, hq], DType::F32, Category::Activations)?;
        Ok(RingOutput {
            o,
            lse,
            scratch: None,
        })
    }

    /// Step 0: every local row of rank `i` of `p` against the local block,
    /// under the sequence's mask (the local rows are in sequence order).
    pub(super) fn local(
        &mut self,
        b: &B,
        [q, k, v]: [&Tensor<B>; 3],
        (mask, i, p): (&AttnMask, usize, usize),
        scale: f32,
    ) -> Result<()> {
        b.attention_fwd(AttentionFwd {
            q: q.all_rows(),
            k: k.all_rows(),
            v: v.all_rows(),
            mask: &local_block_mask(mask, i, p, q.rows())?,
            scale,
            o: self.o.all_rows_mut(),
            lse: self.lse.all_rows_mut(),
        })
    }

    /// The scratch of one arrived block, before the first.
    pub(super) fn make_scratch(&mut self, b: &B, q: &Tensor<B>) -> Result<()> {
        let o_blk = b.zeros(q.shape(), q.dtype(), Category::Workspace)?;
        let lse_blk = b.zeros(self.lse.shape(), DType::F32, Category::Workspace)?;
        self.scratch = Some((o_blk, lse_blk));
        Ok(())
    }

    /// Block `blk` of the arrived K/V (`kv = [k, v]`) attended by its query
    /// rows and merged into theirs.
    pub(super) fn add(
        &mut self,
        b: &B,
        q: &Tensor<B>,
        kv: &[Tensor<B>],
        blk: &RingBlock,
        scale: f32,
    ) -> Result<()> {
        let (o_blk, lse_blk) = self.scratch.as_mut().ok_or_else(|| {
            crate::error::Error::Backend("a ring block arrived before its scratch".into())
        })?;
        let (qr, kr) = (blk.q_rows.clone(), blk.k_rows.clone());
        b.attention_fwd(AttentionFwd {
            q: q.rows_view(qr.clone()),
            k: kv[0].rows_view(kr.clone()),
            v: kv[1].rows_view(kr),
            mask: &blk.mask,
            scale,
            o: o_blk.rows_view_mut(qr.clone()),
            lse: lse_blk.rows_view_mut(qr.clone()),
        })?;
        b.lse_merge(LseMerge {
            o_acc: self.o.rows_view_mut(qr.clone()),
            lse_acc: self.lse.rows_view_mut(qr.clone()),
            o_blk: o_blk.rows_view(qr.clone()),
            lse_blk: lse_blk.rows_view(qr),
        })
    }

    /// `(o, lse)`.
    pub(super) fn finish(self) -> (Tensor<B>, Tensor<B>) {
        (self.o, self.lse)
    }
}

/// The operands of one ring attention backward ([`backward`]) on this
/// rank: its queries and K/V (`[n, heads, d]`), the forward's `o` and
/// `lse`, `d_o`, and the gradients it writes.
pub struct RingBwd<'a, B: Backend> {
    pub q: &'a Tensor<B>,
    pub k: &'a Tensor<B>,
    pub v: &'a Tensor<B>,
    pub o: &'a Tensor<B>,
    pub d_o: &'a Tensor<B>,
    pub lse: &'a Tensor<B>,
    pub dq: &'a mut Tensor<B>,
    pub dk: &'a mut Tensor<B>,
    pub dv: &'a mut Tensor<B>,
    /// Whether `dq` and `dk`, `dv` are added into or overwritten.
    pub writes: AttnGradWrites,
    /// The whole sequence's mask.
    pub mask: &'a AttnMask,
    /// The softmax scale.
    pub scale: f32,
}

/// A ring backward's local K/V side: the block, its gradients, how they
/// are written, and the sequence's mask.
pub(super) struct KvSide<'a, B: Backend> {
    pub k: &'a Tensor<B>,
    pub v: &'a Tensor<B>,
    pub dk: &'a mut Tensor<B>,
    pub dv: &'a mut Tensor<B>,
    pub dkv_write: GradWrite,
    pub mask: &'a AttnMask,
}

impl<'a, B: Backend> RingBwd<'a, B> {
    /// The call as its local queries' side (what every step's block reads
    /// of them, and `dq`) and its local K/V side.
    pub(super) fn split(self) -> (QuerySide<'a, B>, KvSide<'a, B>) {
        let RingBwd {
            q,
            k,
            v,
            o,
            d_o,
            lse,
            dq,
            dk,
            dv,
            writes,
            mask,
            scale,
        } = self;
        let side = QuerySide {
            q,
            o,
            d_o,
            lse,
            dq,
            dq_write: writes.dq,
            scale,
        };
        let kv = KvSide {
            k,
            v,
            dk,
            dv,
            dkv_write: writes.dkv,
            mask,
        };
        (side, kv)
    }
}

/// Ring attention backward under the sequence's `mask`: `dq` for the local queries and `dk`, `dv` for the
/// local K/V (all `[n, heads, d]`, F32 or compute dtype), added into or
/// overwritten as `writes` says (later ring steps add into what the first
/// wrote, so overwrite only tensors whose dtype can accumulate: F32 when
/// there is more than one step).
///
/// K/V blocks travel as in [`forward`] (passed on as they arrive, beside the
/// step's attention backward); each block's dK/dV follow it one step behind,
/// once the step that accumulates into them is done, and arrive home after
/// the last step.
pub fn backward<B: Backend>(b: &B, ring: &dyn ProcessGroup<B>, a: RingBwd<'_, B>) -> Result<()> {
    let (p, i, n) = (ring.size(), ring.rank(), a.q.rows());
    if p == 1 {
        return b.attention_bwd(AttentionBwd {
            q: a.q.all_rows(),
            k: a.k.all_rows(),
            v: a.v.all_rows(),
            o: a.o.all_rows(),
            d_o: a.d_o.all_rows(),
            lse: a.lse.all_rows(),
            mask: &local_block_mask(a.mask, i, p, n)?,
            scale: a.scale,
            dq: a.dq.all_rows_mut(),
            dk: a.dk.all_rows_mut(),
            dv: a.dv.all_rows_mut(),
            writes: a.writes,
        });
    }
    let (mut side, kv) = a.split();
    let KvSide {
        k,
        v,
        dk,
        dv,
        dkv_write,
        mask,
    } = kv;
    let mut relay = KvRelay::start(b, ring, k, v)?;
    // the gradients of the block being visited, travelling with it
    let mut dk_t = b.zeros(dk.shape(), dk.dtype(), Category::Workspace)?;
    let mut dv_t = b.zeros(dv.shape(), dv.dtype(), Category::Workspace)?;
    let mut step_bwd = |step: usize,
                        ks: &Tensor<B>,
                        vs: &Tensor<B>,
                        dk_t: &mut Tensor<B>,
                        dv_t: &mut Tensor<B>| {
        let blk = ring_block(i, step, p, n / 2, mask);
        if blk.mask.hides_all(blk.q_rows.len(), blk.k_rows.len()) {
            // other documents only: no gradient flows (never step 0, whose
            // diagonal every query sees)
            return Ok(());
        }
        // the first step's query block covers every local query row
        // (zigzag: a rank's own block), later steps add in
        block_bwd(b, &mut side, &blk, step, (ks, vs), [dk_t, dv_t])
    };
    step_bwd(0, k, v, &mut dk_t, &mut dv_t)?;
    for step in 1..p {
        // the finished block's gradients follow it; this step's block's arrive
        (dk_t, dv_t) = pass_grads(b, ring, dk_t, dv_t)?;
        let kv = relay.advance(b, ring, step + 1 == p)?;
        step_bwd(step, &kv[0], &kv[1], &mut dk_t, &mut dv_t)?;
    }
    drop(relay);
    // the last block's gradients go home
    let (dk_t, dv_t) = pass_grads(b, ring, dk_t, dv_t)?;
    for (dst, src) in [(dk, &dk_t), (dv, &dv_t)] {
        match dkv_write {
            GradWrite::Add => b.axpy(dst, 1.0, src)?,
            GradWrite::Overwrite => b.copy(dst.mat_mut(), src.mat())?,
        }
    }
    Ok(())
}

/// The local shard's side of a ring backward: what every step's block
/// reads of the local queries, and the query gradient the blocks write.
pub(super) struct QuerySide<'a, B: Backend> {
    pub q: &'a Tensor<B>,   // [n, hq, d]
    pub o: &'a Tensor<B>,   // [n, hq, d]
    pub d_o: &'a Tensor<B>, // [n, hq, d]
    pub lse: &'a Tensor<B>, // [n, hq] F32
    pub dq: &'a mut Tensor<B>,
    /// How step 0 writes `dq` (its block covers every local query row);
    /// later steps add.
    pub dq_write: GradWrite,
    pub scale: f32,
}

/// One step's block backward: `blk`'s query rows of the local shard
/// against its key rows of the visiting block `(ks, vs)`, adding into the
/// visiting block's gradients `[dk, dv]`.
pub(super) fn block_bwd<B: Backend>(
    b: &B,
    side: &mut QuerySide<'_, B>,
    blk: &RingBlock,
    step: usize,
    (ks, vs): (&Tensor<B>, &Tensor<B>),
    [dk, dv]: [&mut Tensor<B>; 2],
) -> Result<()> {
    let (qr, kr) = (&blk.q_rows, &blk.k_rows);
    b.attention_bwd(AttentionBwd {
        q: side.q.rows_view(qr.clone()),
        k: ks.rows_view(kr.clone()),
        v: vs.rows_view(kr.clone()),
        o: side.o.rows_view(qr.clone()),
        d_o: side.d_o.rows_view(qr.clone()),
        lse: side.lse.rows_view(qr.clone()),
        mask: &blk.mask,
        scale: side.scale,
        dq: side.dq.rows_view_mut(qr.clone()),
        dk: dk.rows_view_mut(kr.clone()),
        dv: dv.rows_view_mut(kr.clone()),
        writes: AttnGradWrites {
            dq: if step == 0 {
                side.dq_write
            } else {
                GradWrite::Add
            },
            dkv: GradWrite::Add,
        },
    })
}

/// K/V blocks travelling around the ring: each one is passed on to the next
/// rank as soon as it arrives (except at the last step) and read meanwhile.
struct KvRelay<B: Backend> {
    in_flight: Option<Pending<B>>,
    /// The last step's block, which goes no further.
    last: Option<Vec<Tensor<B>>>,
}

impl<B: Backend> KvRelay<B> {
    /// Starts passing a copy of the local block (the caller keeps K and V).
    fn start(b: &B, ring: &dyn ProcessGroup<B>, k: &Tensor<B>, v: &Tensor<B>) -> Result<Self> {
        let copy_of = |t: &Tensor<B>| {
            let mut c = b.zeros(t.shape(), t.dtype(), Category::Comm)?;
            b.copy(c.mat_mut(), t.mat())?;
            Ok::<_, crate::error::Error>(c)
        };
        Ok(KvRelay {
            in_flight: Some(pass_on(b, ring, vec![copy_of(k)?, copy_of(v)?])?),
            last: None,
        })
    }

    /// The next step's `[K, V]`: waits for it (releasing the block sent
    /// before) and, unless this is the `last` step, passes it on.
    fn advance(&mut self, b: &B, ring: &dyn ProcessGroup<B>, last: bool) -> Result<&[Tensor<B>]> {
        let arrived = self
            .in_flight
            .take()
            .expect("a block arrives every step")
            .wait_all()?
            .received;
        if last {
            return Ok(self.last.insert(arrived));
        }
        Ok(self.in_flight.insert(pass_on(b, ring, arrived)?).sending())
    }
}

/// Starts sending `ts` to the next ring rank while receiving the previous
/// rank's tensors of the same shapes.
fn pass_on<B: Backend>(
    b: &B,
    ring: &dyn ProcessGroup<B>,
    ts: Vec<Tensor<B>>,
) -> Result<Pending<B>> {
    let (p, i) = (ring.size(), ring.rank());
    let recv = ts
        .iter()
        .map(|t| b.zeros(t.shape(), t.dtype(), Category::Comm))
        .collect::<Result<Vec<_>>>()?;
    ring.start_send_recv(ts, (i + 1) % p, recv, (i + p - 1) % p)
}

/// Passes a block's dK, dV to the next ring rank and returns the previous
/// rank's (the sent ones are released).
fn pass_grads<B: Backend>(
    b: &B,
    ring: &dyn ProcessGroup<B>,
    dk_t: Tensor<B>,
    dv_t: Tensor<B>,
) -> Result<(Tensor<B>, Tensor<B>)> {
    let mut got = pass_on(b, ring, vec![dk_t, dv_t])?.wait_all()?.received;
    let dv = got.pop().expect("two received");
    let dk = got.pop().expect("two received");
    Ok((dk, dv))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block masks equal the sequence's mask on global positions: every
    /// pair it allows once, and no other.
    #[test]
    fn ring_blocks_cover_exactly_the_allowed_pairs() {
        for p in 1..6 {
            let half = 3;
            let seq = 2 * p * half;
            // documents that start mid-chunk, span chunks and ranks, of length 1
            let starts: Vec<u32> = [0u32, 2, 3, 7, 8, 16, 17]
                .into_iter()
                .filter(|&s| (s as usize) < seq)
                .collect();
            let docs =
                AttnMask::Bounded(crate::backend::BoundedMask::documents(&starts, seq).unwrap());
            for mask in [AttnMask::Causal, AttnMask::Full, docs] {
                let l = crate::attention::layout::SeqLayout::new(2 * p * half, 1, p).unwrap();
                for i in 0..p {
                    let qpos = l.ring_shard_positions(i);
                    let mut seen = std::collections::HashSet::new();
                    for step in 0..p {
                        let blk = ring_block(i, step, p, half, &mask);
                        let kpos = l.ring_shard_positions(blk.src);
                        for a in blk.q_rows.clone() {
                            for bb in blk.k_rows.clone() {
                                let (qa, kb) = (a - blk.q_rows.start, bb - blk.k_rows.start);
                                if blk.mask.allows(qa, kb) {
                                    assert!(mask.allows(qpos[a], kpos[bb]), "hidden key attended");
                                    assert!(seen.insert((qpos[a], kpos[bb])), "pair twice");
                                }
                            }
                        }
                    }
                    let n = 2 * p * half;
                    let want: usize = qpos.iter().map(|&x| mask.visible_keys(x, n).len()).sum();
                    assert_eq!(seen.len(), want, "every {mask} pair once (p={p}, i={i})");
                }
            }
        }
    }
}

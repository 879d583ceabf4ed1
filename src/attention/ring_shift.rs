//! Zigzag ring attention by direct shifts, for masks that hide whole blocks
//! (documents, sliding windows: `AttnMask::Bounded`).
//!
//! The relay of [`ring`] moves every K/V block through every rank. Here, at
//! step `t`, ring rank `i` sends its own K/V straight to rank `i+t` and
//! receives rank `i-t`'s (the block [`ring_block`] gives it at that step),
//! and in backward returns each visiting block's dK/dV straight to its
//! owner one step later. A (sender, receiver, step) whose block no query of
//! the receiver may see ([`block_needed`]) is skipped on both sides: no
//! send, no receive, no attention; a step no pair needs moves nothing. Both
//! sides decide from the sequence's mask, which every rank holds whole. A
//! window shorter than a zigzag chunk needs steps 1 and `P-1` only.
//!
//! The buffers are the relay's, allocated and released so that the ledger
//! holds the same bytes of the same categories at every peak whatever is
//! skipped (the planner runs it: `plan/engine.rs`): two
//! visiting blocks (the relay's two blocks in flight; this rank's own K/V
//! are sent from where they are, without a copy), and in backward a
//! visiting block's gradients and the ones returned. Each step's block
//! arrives beside the step before's attention, as in the relay.
//! Causal and full masks, which hide no whole block, keep the relay.

use super::ring::{self, KvSide, RingBwd, RingOutput, block_bwd, ring_block};
use crate::backend::{AttnMask, Backend, Category, GradWrite, Tensor};
use crate::comm::{Pending, ProcessGroup};
use crate::error::Result;

/// Whether ring rank `receiver` of `p` (shards of `2*half` tokens) needs the
/// block it visits at `step` under the sequence's mask: some local query
/// sees some of its keys (step 0, the local block, always).
pub fn block_needed(
    receiver: usize,
    step: usize,
    p: usize,
    half: usize,
    seq_mask: &AttnMask,
) -> bool {
    let blk = ring_block(receiver, step % p, p, half, seq_mask);
    !blk.mask.hides_all(blk.q_rows.len(), blk.k_rows.len())
}

/// Whether a ring of `p` attends under `mask` by direct shifts (a bounded
/// mask on more than one rank) rather than by the relay.
pub fn takes_shifts(mask: &AttnMask, p: usize) -> bool {
    p > 1 && matches!(mask, AttnMask::Bounded(_))
}

/// Ring attention forward ([`ring::forward`]'s contract): by direct shifts
/// under a bounded mask, by the relay otherwise.
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
    if !takes_shifts(mask, p) {
        return ring::forward(b, ring, q, k, v, mask, scale);
    }
    let mut out = RingOutput::new(b, q)?;
    let mut shift = KvShift::new(b, ring, k, v, mask)?;
    // the step-1 block arrives beside the local attention
    shift.start(ring, 1)?;
    out.local(b, [q, k, v], (mask, i, p), scale)?;
    out.make_scratch(b, q)?;
    for step in 1..p {
        if let Some(kv) = shift.arrive(ring, step)? {
            let blk = ring_block(i, step, p, q.rows() / 2, mask);
            out.add(b, q, kv, &blk, scale)?;
        }
    }
    drop(shift);
    Ok(out.finish())
}

/// Ring attention backward ([`ring::backward`]'s contract): by direct
/// shifts under a bounded mask, by the relay otherwise. The local block's
/// gradients go into `dk`, `dv` as `writes` says, and every other rank's
/// gradients of this rank's block are added in as they come back, in step
/// order.
pub fn backward<B: Backend>(b: &B, ring: &dyn ProcessGroup<B>, a: RingBwd<'_, B>) -> Result<()> {
    let p = ring.size();
    if !takes_shifts(a.mask, p) {
        return ring::backward(b, ring, a);
    }
    let (i, n) = (ring.rank(), a.q.rows());
    let (mut side, kv) = a.split();
    let KvSide {
        k,
        v,
        dk,
        dv,
        dkv_write,
        mask,
    } = kv;
    let mut shift = KvShift::new(b, ring, k, v, mask)?;
    shift.start(ring, 1)?;
    // the gradients of the block being visited (step 0: the local block's)
    let mut visiting = vec![
        b.zeros(dk.shape(), dk.dtype(), Category::Workspace)?,
        b.zeros(dv.shape(), dv.dtype(), Category::Workspace)?,
    ];
    let mut step_bwd = |step: usize, ks: &Tensor<B>, vs: &Tensor<B>, grads: &mut [Tensor<B>]| {
        let blk = ring_block(i, step, p, n / 2, mask);
        let [dk_t, dv_t] = grads else {
            unreachable!("two gradients")
        };
        // the local block's rows are every local query row
        block_bwd(b, &mut side, &blk, step, (ks, vs), [dk_t, dv_t])
    };
    step_bwd(0, k, v, &mut visiting)?;
    let mut home = HomeGrads {
        dk,
        dv,
        first: Some(dkv_write),
    };
    for step in 1..p {
        // the gradients of the block visited last go back to their owner
        // while this rank's block's come home from the rank that visited it
        visiting = home.exchange(b, ring, mask, step - 1, visiting)?;
        if let Some(kv) = shift.arrive(ring, step)? {
            step_bwd(step, &kv[0], &kv[1], &mut visiting)?;
        }
    }
    drop(shift);
    drop(home.exchange(b, ring, mask, p - 1, visiting)?);
    Ok(())
}

/// This rank's K/V sent straight to the rank of each step, and the
/// visiting blocks received from the rank each step's attention reads: each
/// step's block arrives in one buffer while the step before reads the other.
struct KvShift<'k, B: Backend> {
    /// This rank's K and V, sent from where they are at every step.
    k: &'k Tensor<B>,
    v: &'k Tensor<B>,
    /// The buffers of the block this step reads.
    current: Option<Vec<Tensor<B>>>,
    /// The buffers the next block arrives in (released at the last step).
    spare: Option<Vec<Tensor<B>>>,
    /// The next block's transfer, or its buffers when it moves nothing.
    in_flight: Option<Pending<B>>,
    idle: Option<Vec<Tensor<B>>>,
    /// Whether the next block is received.
    received: bool,
    mask: &'k AttnMask,
    p: usize,
    i: usize,
    half: usize,
}

impl<'k, B: Backend> KvShift<'k, B> {
    /// Takes the two buffers visiting blocks arrive in (the relay's two
    /// blocks: the copy of the local one it sends first, and the first
    /// receive).
    fn new(
        b: &B,
        ring: &dyn ProcessGroup<B>,
        k: &'k Tensor<B>,
        v: &'k Tensor<B>,
        mask: &'k AttnMask,
    ) -> Result<Self> {
        let pair = || {
            [k, v]
                .into_iter()
                .map(|t| b.zeros(t.shape(), t.dtype(), Category::Comm))
                .collect::<Result<Vec<_>>>()
        };
        let (current, spare) = (pair()?, pair()?);
        Ok(KvShift {
            k,
            v,
            current: Some(current),
            spare: Some(spare),
            in_flight: None,
            idle: None,
            received: false,
            mask,
            p: ring.size(),
            i: ring.rank(),
            half: k.rows() / 2,
        })
    }

    fn needed(&self, receiver: usize, step: usize) -> bool {
        block_needed(receiver, step, self.p, self.half, self.mask)
    }

    /// Starts `step`'s shift into the spare buffers: this rank's block to
    /// rank `i+step` if that rank needs it, the block of rank `i-step` if
    /// this one needs it.
    fn start(&mut self, ring: &dyn ProcessGroup<B>, step: usize) -> Result<()> {
        let (p, i) = (self.p, self.i);
        let to = Some((i + step) % p).filter(|&r| self.needed(r, step));
        let from = Some((i + p - step) % p).filter(|_| self.needed(i, step));
        self.received = from.is_some();
        let bufs = self.spare.take().expect("the spare buffers are free");
        if to.is_none() && from.is_none() {
            self.idle = Some(bufs);
            return Ok(());
        }
        // SAFETY: K and V are shared borrows for 'k, which outlives this
        // KvShift, and the transfer is waited for in `arrive` or dropped
        // (joined) with it
        let pending = unsafe { ring.start_shift_from(&[self.k, self.v], to, bufs, from)? };
        self.in_flight = Some(pending);
        Ok(())
    }

    /// `step`'s visiting `[K, V]`, or `None` when this rank skips the step.
    /// Starts the next step's shift into the buffers the step before read,
    /// or at the last step releases them.
    fn arrive(&mut self, ring: &dyn ProcessGroup<B>, step: usize) -> Result<Option<&[Tensor<B>]>> {
        let arrived = match self.in_flight.take() {
            Some(pending) => pending.wait_all()?.received,
            None => self.idle.take().expect("a step's buffers"),
        };
        let received = self.received;
        self.spare = self.current.replace(arrived);
        if step + 1 < self.p {
            self.start(ring, step + 1)?;
        } else {
            self.spare = None;
        }
        let current = self.current.as_deref().expect("this step's buffers");
        Ok(received.then_some(current))
    }
}

/// This rank's K/V gradients: the local block's, then those of every rank
/// its block visited, added in as they come home, in step order.
struct HomeGrads<'g, B: Backend> {
    dk: &'g mut Tensor<B>,
    dv: &'g mut Tensor<B>,
    /// How the local block's gradients (the first) are written; later ones add.
    first: Option<GradWrite>,
}

impl<B: Backend> HomeGrads<'_, B> {
    /// Sends `grads`, the gradients of the block visited at `step`, back to
    /// its owner (rank `i-step`) if that block was computed, and receives
    /// this rank's block's from rank `i+step` if that rank computed it, then
    /// adds them in (step 0: `grads` are the local block's, nothing moves).
    /// Returns the receive buffers zeroed, for the next visiting block's
    /// gradients: the relay's order of buffers (`ring::pass_grads`).
    fn exchange(
        &mut self,
        b: &B,
        ring: &dyn ProcessGroup<B>,
        mask: &AttnMask,
        step: usize,
        grads: Vec<Tensor<B>>,
    ) -> Result<Vec<Tensor<B>>> {
        let (p, i, half) = (ring.size(), ring.rank(), self.dk.rows() / 2);
        let mut recv = grads
            .iter()
            .map(|t| b.zeros(t.shape(), t.dtype(), Category::Comm))
            .collect::<Result<Vec<_>>>()?;
        if step == 0 {
            self.take_in(b, &grads)?;
            return Ok(recv);
        }
        let to = Some((i + p - step) % p).filter(|_| block_needed(i, step, p, half, mask));
        let from = Some((i + step) % p).filter(|&r| block_needed(r, step, p, half, mask));
        if to.is_some() || from.is_some() {
            let done = ring.start_shift(grads, to, recv, from)?.wait_all()?;
            drop(done.sent);
            recv = done.received;
        } else {
            drop(grads);
        }
        if from.is_some() {
            self.take_in(b, &recv)?;
            for t in recv.iter_mut() {
                b.fill(t, 0.0)?;
            }
        }
        Ok(recv)
    }

    /// Writes or adds `[dK, dV]` of this rank's block into its gradients.
    fn take_in(&mut self, b: &B, grads: &[Tensor<B>]) -> Result<()> {
        let write = self.first.take().unwrap_or(GradWrite::Add);
        for (dst, src) in [(&mut *self.dk, &grads[0]), (&mut *self.dv, &grads[1])] {
            match write {
                GradWrite::Add => b.axpy(dst, 1.0, src)?,
                GradWrite::Overwrite => b.copy(dst.mat_mut(), src.mat())?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::layout::SeqLayout;
    use crate::backend::BoundedMask;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{AttnGradWrites, DType};
    use crate::comm::MeshShape;
    use crate::comm::local::run_ranks;
    use crate::comm::traffic::{Sent, TrafficGroup};

    /// Documents at `starts` in `seq` tokens, each query seeing at most
    /// `window` keys of its document (`None`: its whole document).
    fn bounded(starts: &[u32], seq: usize, window: Option<usize>) -> AttnMask {
        let m = BoundedMask::documents(starts, seq).unwrap();
        AttnMask::Bounded(match window {
            Some(w) => m.with_window(w).unwrap(),
            None => m,
        })
    }

    /// Brute force over positions: some query ring rank `r` holds sees some
    /// key of rank `r - step`.
    fn sees_any(mask: &AttnMask, l: &SeqLayout, r: usize, step: usize, p: usize) -> bool {
        let keys = l.ring_shard_positions((r + p - step % p) % p);
        let queries = l.ring_shard_positions(r);
        queries
            .iter()
            .any(|&q| keys.iter().any(|&k| mask.allows(q, k)))
    }

    /// `block_needed` is exactly "some local query sees some visiting key",
    /// over documents (mid-chunk, of length 1, across ranks) and windows
    /// shorter than a chunk, spanning chunks and longer than the sequence.
    #[test]
    fn block_needed_equals_brute_force_over_positions() {
        for p in 1..6 {
            for half in [2, 3] {
                let seq = 2 * p * half;
                let l = SeqLayout::new(seq, 1, p).unwrap();
                let starts: Vec<u32> = [0u32, 2, 3, 7, 8, 16, 17]
                    .into_iter()
                    .filter(|&s| (s as usize) < seq)
                    .collect();
                for docs in [&[0u32][..], &starts] {
                    for window in [
                        None,
                        Some(1),
                        Some(2),
                        Some(half + 1),
                        Some(3 * half),
                        Some(seq + 5),
                    ] {
                        let mask = bounded(docs, seq, window);
                        for r in 0..p {
                            for step in 0..p {
                                assert_eq!(
                                    block_needed(r, step, p, half, &mask),
                                    sees_any(&mask, &l, r, step, p),
                                    "p={p} half={half} docs {docs:?} window {window:?} r={r} step={step}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// One rank's attention forward and backward (fixed seeded inputs) with
    /// `fwd`/`bwd`: (O, LSE, dQ, dK, dV) and the tensors it sent.
    type RankRun = (Vec<Vec<f32>>, Vec<Sent>);

    fn run_ring(p: usize, seq: usize, mask: &AttnMask, shifts: bool) -> Vec<RankRun> {
        let (hq, hkv, d) = (2, 1, 4);
        let scale = crate::attention::AttnDims::default_softmax_scale(d);
        let n = seq / p;
        let shape = MeshShape::new(1, p, 1).unwrap();
        run_ranks(shape, CpuBackend::new, |rank, b, mesh| {
            let b = b.as_ref();
            let ring = TrafficGroup::new(mesh.ring.as_ref());
            let mut rng = crate::rng::Rng::new(40 + rank as u64);
            let mut t = |shape: &[usize]| {
                let v = rng.normal_vec(shape.iter().product(), 1.0);
                b.from_host(&v, shape, DType::F32, Category::Workspace)
            };
            let (q, k, v, d_o) = (
                t(&[n, hq, d])?,
                t(&[n, hkv, d])?,
                t(&[n, hkv, d])?,
                t(&[n, hq, d])?,
            );
            let (o, lse) = match shifts {
                true => forward(b, &ring, &q, &k, &v, mask, scale)?,
                false => ring::forward(b, &ring, &q, &k, &v, mask, scale)?,
            };
            let mut g = [&q, &k, &v].map(|x| b.zeros(x.shape(), DType::F32, Category::Grads));
            let [dq, dk, dv] = &mut g;
            let (dq, dk, dv) = (
                dq.as_mut().unwrap(),
                dk.as_mut().unwrap(),
                dv.as_mut().unwrap(),
            );
            let args = RingBwd {
                q: &q,
                k: &k,
                v: &v,
                o: &o,
                d_o: &d_o,
                lse: &lse,
                dq,
                dk,
                dv,
                writes: AttnGradWrites::ADD,
                mask,
                scale,
            };
            match shifts {
                true => backward(b, &ring, args)?,
                false => ring::backward(b, &ring, args)?,
            }
            let out = [&o, &lse, &*dq, &*dk, &*dv].map(|x| b.to_host(x));
            Ok((out.into_iter().collect::<Result<Vec<_>>>()?, ring.sent()))
        })
        .unwrap()
    }

    /// The sends direct shifts must make, by brute force over positions:
    /// (sender, receiver) of each K/V block some query of the receiver sees
    /// (forward, and again in backward), and in backward the same blocks'
    /// gradients going home (receiver to sender); each two tensors (K and V,
    /// dK and dV) of `block_bytes`.
    fn predicted_sends(
        p: usize,
        seq: usize,
        mask: &AttnMask,
        block_bytes: usize,
    ) -> Vec<Vec<Sent>> {
        let l = SeqLayout::new(seq, 1, p).unwrap();
        let mut sends = vec![Vec::new(); p];
        let kv = |sends: &mut Vec<Vec<Sent>>, from: usize, to: usize| {
            for _ in 0..2 {
                sends[from].push(Sent {
                    to,
                    bytes: block_bytes,
                });
            }
        };
        let needed = |step: usize| (0..p).filter(move |&r| sees_any(mask, &l, r, step, p));
        // forward: the K/V shifts
        for step in 1..p {
            for r in needed(step) {
                kv(&mut sends, (r + p - step) % p, r);
            }
        }
        // backward: step 1's shift before the local block, then at each step
        // the previous step's gradients home and the next step's shift
        for r in needed(1) {
            kv(&mut sends, (r + p - 1) % p, r);
        }
        for step in 1..p {
            for r in needed(step - 1).filter(|_| step > 1) {
                kv(&mut sends, r, (r + p - (step - 1)) % p);
            }
            for r in needed(step + 1).filter(|_| step + 1 < p) {
                kv(&mut sends, (r + p - step - 1) % p, r);
            }
        }
        for r in needed(p - 1) {
            kv(&mut sends, r, (r + 1) % p);
        }
        sends
    }

    /// On rings of 2 and 4 (chunks of 12 and 6 tokens), a Mistral-style
    /// window shorter than a chunk sends only the blocks of steps 1 and P-1
    /// that some query sees (2(P-1) of the relay's P(P-1) forward),
    /// documents each within one chunk send nothing, and a window spanning
    /// chunks or documents spanning ranks send what brute force predicts;
    /// the results are the relay's (forward bit for bit, gradients to 1e-5).
    #[test]
    fn direct_shifts_send_only_the_blocks_some_query_sees() {
        for p in [2, 4] {
            let seq = 48;
            let block_bytes = (seq / p) * 4 * 4; // [n, hkv=1, d=4] F32
            let within_chunks: Vec<u32> = (0..8).flat_map(|c| [6 * c, 6 * c + 2]).collect();
            for (mask, forward_blocks) in [
                (bounded(&[0], seq, Some(5)), Some(2 * (p - 1))),
                (bounded(&within_chunks, seq, None), Some(0)),
                (bounded(&[0, 5, 30], seq, Some(14)), None),
                (bounded(&[0, 13], seq, None), None),
            ] {
                let direct = run_ring(p, seq, &mask, true);
                let relay = run_ring(p, seq, &mask, false);
                let want = predicted_sends(p, seq, &mask, block_bytes);
                for (r, ((got, sent), (reference, relayed))) in
                    direct.iter().zip(&relay).enumerate()
                {
                    assert_eq!(sent, &want[r], "{mask} p={p} rank {r}: the sends");
                    assert_eq!(
                        relayed.len(),
                        4 * (p - 1) + 2 * p,
                        "the relay moves every block"
                    );
                    assert_eq!(got[..2], reference[..2], "{mask} rank {r}: forward");
                    for (x, (a, b)) in got.iter().zip(reference).enumerate().skip(2) {
                        let err = crate::attention::trial::rel_err(a, b);
                        assert!(err <= 1e-5, "{mask} rank {r}: gradient {x} rel err {err:e}");
                    }
                }
                if let Some(blocks) = forward_blocks {
                    let tensors: usize = want.iter().map(|s| s.len()).sum();
                    // forward and backward shifts, and as many gradient
                    // returns, two tensors each
                    assert_eq!(tensors, 3 * 2 * blocks, "{mask} p={p}");
                }
            }
        }
    }
}

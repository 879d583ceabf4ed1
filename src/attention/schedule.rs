//! The UPipe stage schedule (DESIGN.md §4): which query and kv heads each
//! Ulysses rank handles in each stage. Pure index math.
//!
//! Ulysses degree `pu`, `heads` query heads, `kv_heads` kv heads, group size
//! `g = heads / kv_heads`, `chunk` = U heads per stage (a multiple of `pu`),
//! `u = U / pu` heads per rank per stage.
//!
//! Rank r owns the same contiguous block of heads as under Ulysses (query
//! heads `[r*H/pu, +H/pu)`) and the stages walk through it:
//!
//! - `kv_heads >= pu`: a kv phase gives rank r the kv heads
//!   `[r*kv_heads/pu + k*m, +m)` with `m = max(1, u/g)`; its query heads are
//!   those kv heads' groups in order, `u` per stage. K/V are exchanged once
//!   per phase.
//! - `kv_heads < pu`: stage t gives rank r the query heads
//!   `[r*H/pu + t*u, +u)` and the one kv head they share; K/V (replicated)
//!   are exchanged per stage.
//!
//! Every rank's heads in a stage are a contiguous range in canonical (HF)
//! order, so projections use a contiguous block of weight rows. DESIGN.md §4
//! deals phase k's kv heads out round-robin (rank r gets `(k*pu + r)*m`);
//! owning blocks instead costs the same memory and traffic, and lets the
//! forward run in stages of any valid width (a union of consecutive backward
//! stages is then still one range per rank, at the same offset on every
//! rank: [`lse_pieces`]).

use crate::backend::GradWrite;
use crate::error::Result;
use std::ops::Range;

/// One stage: the query heads each Ulysses rank attends with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// `q_heads[r]`: canonical query heads of Ulysses rank `r` (length `u`).
    pub q_heads: Vec<Range<usize>>,
}

/// A kv phase: one K/V exchange serving one or more stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPhase {
    /// `kv_heads[r]`: canonical kv heads Ulysses rank `r` holds in this phase.
    pub kv_heads: Vec<Range<usize>>,
    pub stages: Vec<Stage>,
}

/// The whole layer's schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSchedule {
    pub heads: usize,
    pub kv_heads: usize,
    pub pu: usize,
    /// Heads per stage (U).
    pub chunk: usize,
    pub phases: Vec<KvPhase>,
}

impl StageSchedule {
    /// Builds the schedule, or explains which constraint fails and what would work.
    pub fn new(heads: usize, kv_heads: usize, pu: usize, chunk: usize) -> Result<Self> {
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return crate::config_err!(
                "{heads} query heads cannot be shared by {kv_heads} kv heads: heads must be a multiple of kv heads"
            );
        }
        if pu == 0 || !heads.is_multiple_of(pu) {
            return crate::config_err!(
                "Ulysses degree {pu} must divide the {heads} query heads; valid degrees: {:?} (or use --ring for the rest)",
                divisors(heads)
            );
        }
        if kv_heads >= pu && !kv_heads.is_multiple_of(pu) {
            return crate::config_err!(
                "Ulysses degree {pu} must divide the {kv_heads} kv heads (or exceed them, replicating kv); valid degrees: {:?}",
                divisors(heads)
                    .into_iter()
                    .filter(|&p| kv_heads.is_multiple_of(p)
                        || (p > kv_heads && heads.is_multiple_of(p)))
                    .collect::<Vec<_>>()
            );
        }
        if let Some(why) = chunk_problem(heads, kv_heads, pu, chunk) {
            return crate::config_err!(
                "--chunk-heads {chunk}: {why}; valid values for {heads} heads, {kv_heads} kv heads, Ulysses degree {pu}: {:?}",
                valid_chunks(heads, kv_heads, pu)
            );
        }
        let g = heads / kv_heads;
        let u = chunk / pu;
        let phases = if kv_heads >= pu {
            let m = (u / g).max(1);
            let stages_per_phase = m * g / u;
            // rank r's kv heads in phase k
            let kv_first = |k: usize, r: usize| r * (kv_heads / pu) + k * m;
            (0..kv_heads / (pu * m))
                .map(|k| KvPhase {
                    kv_heads: (0..pu)
                        .map(|r| kv_first(k, r)..kv_first(k, r) + m)
                        .collect(),
                    stages: (0..stages_per_phase)
                        .map(|j| Stage {
                            q_heads: (0..pu)
                                .map(|r| {
                                    let first = kv_first(k, r) * g + j * u;
                                    first..first + u
                                })
                                .collect(),
                        })
                        .collect(),
                })
                .collect()
        } else {
            (0..heads / chunk)
                .map(|t| {
                    let q_heads: Vec<Range<usize>> = (0..pu)
                        .map(|r| {
                            let first = r * (heads / pu) + t * u;
                            first..first + u
                        })
                        .collect();
                    KvPhase {
                        kv_heads: q_heads
                            .iter()
                            .map(|q| q.start / g..q.start / g + 1)
                            .collect(),
                        stages: vec![Stage { q_heads }],
                    }
                })
                .collect()
        };
        Ok(StageSchedule {
            heads,
            kv_heads,
            pu,
            chunk,
            phases,
        })
    }

    /// Query heads per rank per stage.
    pub fn u(&self) -> usize {
        self.chunk / self.pu
    }
    /// kv heads per rank per phase.
    pub fn m(&self) -> usize {
        self.phases[0].kv_heads[0].len()
    }
    /// Number of stages in the layer.
    pub fn n_stages(&self) -> usize {
        self.phases.iter().map(|p| p.stages.len()).sum()
    }
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// Why `chunk` cannot be a stage size, if it cannot.
fn chunk_problem(heads: usize, kv_heads: usize, pu: usize, chunk: usize) -> Option<String> {
    if chunk == 0 || !chunk.is_multiple_of(pu) {
        return Some(format!(
            "must be a positive multiple of the Ulysses degree {pu}"
        ));
    }
    if !heads.is_multiple_of(chunk) {
        return Some(format!("must divide the {heads} query heads"));
    }
    let (g, u) = (heads / kv_heads, chunk / pu);
    if kv_heads >= pu {
        if u % g != 0 && g % u != 0 {
            return Some(format!(
                "{u} heads per rank per stage must divide or be a multiple of the GQA group size {g}"
            ));
        }
    } else if g % u != 0 {
        return Some(format!(
            "with fewer kv heads than Ulysses ranks, the {u} heads per rank per stage must divide the GQA group size {g}"
        ));
    }
    None
}

/// All stage sizes the schedule accepts.
pub fn valid_chunks(heads: usize, kv_heads: usize, pu: usize) -> Vec<usize> {
    (1..=heads)
        .filter(|&c| chunk_problem(heads, kv_heads, pu, c).is_none())
        .collect()
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// One backward stage's LSE inside a forward stage's `[n, u_f]` LSE: the
/// columns `cols` (this rank's query heads of backward stage `bwd_stage`,
/// counted from the forward stage's first head).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LsePiece {
    pub bwd_stage: usize,
    pub cols: Range<usize>,
}

/// How a forward run in wider stages (`fwd`) hands the backward's stages
/// (`bwd`) their LSE: for each forward stage (in order), the backward
/// stages it computes, as column pieces of its LSE. The forward may run in
/// wider stages only where every rank keeps the same query heads: each
/// backward stage's heads on every rank lie inside one forward stage's heads
/// on that rank, at the same offset on every rank. An error says why not.
pub fn lse_pieces(fwd: &StageSchedule, bwd: &StageSchedule) -> Result<Vec<Vec<LsePiece>>> {
    if (fwd.heads, fwd.kv_heads, fwd.pu) != (bwd.heads, bwd.kv_heads, bwd.pu) {
        return crate::config_err!(
            "forward and backward stages must split the same heads over the same ranks"
        );
    }
    if !fwd.chunk.is_multiple_of(bwd.chunk) {
        return crate::config_err!(
            "forward stages of {} heads must be a multiple of the {} heads of a backward stage",
            fwd.chunk,
            bwd.chunk
        );
    }
    let fwd_stages: Vec<&Stage> = fwd.phases.iter().flat_map(|p| &p.stages).collect();
    let mut pieces = vec![Vec::new(); fwd_stages.len()];
    for (b, stage) in bwd.phases.iter().flat_map(|p| &p.stages).enumerate() {
        let inside = |f: &Stage| {
            let off = stage.q_heads[0].start.checked_sub(f.q_heads[0].start)?;
            stage
                .q_heads
                .iter()
                .zip(&f.q_heads)
                .all(|(q, fq)| q.start >= fq.start && q.end <= fq.end && q.start - fq.start == off)
                .then_some(off)
        };
        let Some((f, off)) = fwd_stages
            .iter()
            .enumerate()
            .find_map(|(f, st)| inside(st).map(|off| (f, off)))
        else {
            return crate::config_err!(
                "forward stages of {} heads move query heads to other ranks than backward stages of {} heads do, so the backward would lack its LSE",
                fwd.chunk,
                bwd.chunk
            );
        };
        pieces[f].push(LsePiece {
            bwd_stage: b,
            cols: off..off + bwd.u(),
        });
    }
    Ok(pieces)
}

/// The forward stage sizes that serve backward stages of `bwd`
/// ([`lse_pieces`]), smallest first (the first is `bwd.chunk` itself).
pub fn valid_fwd_chunks(bwd: &StageSchedule) -> Vec<usize> {
    valid_chunks(bwd.heads, bwd.kv_heads, bwd.pu)
        .into_iter()
        .filter(|&c| {
            StageSchedule::new(bwd.heads, bwd.kv_heads, bwd.pu, c)
                .and_then(|f| lse_pieces(&f, bwd))
                .is_ok()
        })
        .collect()
}

/// What the stage loop prefetches after stage `t` of phase `p` starts
/// (`overlap`): the next stage of the same phase, the first stage of the next
/// phase together with that phase's K/V, or nothing after the last stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upcoming {
    Stage,
    PhaseStart,
    End,
}

/// [`Upcoming`] after stage `t` of phase `p`, for `phases` phases of which
/// phase `p` has `stages` stages.
pub fn upcoming(p: usize, t: usize, phases: usize, stages: usize) -> Upcoming {
    if t + 1 < stages {
        Upcoming::Stage
    } else if p + 1 < phases {
        Upcoming::PhaseStart
    } else {
        Upcoming::End
    }
}

/// How the staged backward's attention calls write a gradient that `calls`
/// stages contribute to on a ring of `pr` ranks: overwritten (in the compute
/// dtype) when one call makes it whole, no per-head norm's backward
/// (`normed`, kept in F32) follows, and the backend writes such a gradient
/// in place (`in_place`: cuDNN, or a backend whose compute dtype is F32; our
/// CUDA kernels add in F32 and would need F32 scratch beside it); otherwise
/// added up in F32.
pub fn grad_write(calls: usize, pr: usize, normed: bool, in_place: bool) -> GradWrite {
    if calls == 1 && pr == 1 && !normed && in_place {
        GradWrite::Overwrite
    } else {
        GradWrite::Add
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_call_without_ring_norm_or_scratch_overwrites() {
        assert_eq!(grad_write(1, 1, false, true), GradWrite::Overwrite);
        // ring steps, later stages of a kv phase, a norm's F32 backward, and
        // kernels that would need F32 scratch add
        assert_eq!(grad_write(1, 2, false, true), GradWrite::Add);
        assert_eq!(grad_write(4, 1, false, true), GradWrite::Add);
        assert_eq!(grad_write(1, 1, true, true), GradWrite::Add);
        assert_eq!(grad_write(1, 1, false, false), GradWrite::Add);
    }

    #[test]
    fn upcoming_walks_stages_then_phases() {
        assert_eq!(upcoming(0, 0, 2, 3), Upcoming::Stage);
        assert_eq!(upcoming(0, 2, 2, 3), Upcoming::PhaseStart);
        assert_eq!(upcoming(1, 1, 2, 3), Upcoming::Stage);
        assert_eq!(upcoming(1, 2, 2, 3), Upcoming::End);
        assert_eq!(upcoming(0, 0, 1, 1), Upcoming::End);
    }
    use proptest::prelude::*;

    fn check_cover(s: &StageSchedule) {
        let g = s.group();
        let mut seen = vec![0usize; s.heads];
        for p in &s.phases {
            assert_eq!(p.kv_heads.len(), s.pu);
            for st in &p.stages {
                for (r, q) in st.q_heads.iter().enumerate() {
                    assert_eq!(q.len(), s.u());
                    for h in q.clone() {
                        seen[h] += 1;
                        // each query head attends with its own kv head, held by its rank in this phase
                        assert!(
                            p.kv_heads[r].contains(&(h / g)),
                            "head {h} lacks kv head {}",
                            h / g
                        );
                    }
                    // the GQA kernel maps local query head j to local kv head j / (u / m)
                    let m = p.kv_heads[r].len();
                    let ratio = (s.u() / m).max(1);
                    for (j, h) in q.clone().enumerate() {
                        assert_eq!(p.kv_heads[r].start + j / ratio, h / g);
                    }
                }
            }
        }
        assert!(
            seen.iter().all(|&c| c == 1),
            "every query head exactly once: {seen:?}"
        );
        // each rank walks through the block of heads Ulysses gives it, in order
        let block = s.heads / s.pu;
        for r in 0..s.pu {
            let walked: Vec<usize> = s
                .phases
                .iter()
                .flat_map(|p| &p.stages)
                .flat_map(|st| st.q_heads[r].clone())
                .collect();
            assert_eq!(walked, (r * block..(r + 1) * block).collect::<Vec<_>>());
        }
        if s.kv_heads >= s.pu {
            let mut kv_seen = vec![0usize; s.kv_heads];
            for p in &s.phases {
                for r in &p.kv_heads {
                    for k in r.clone() {
                        kv_seen[k] += 1;
                    }
                }
            }
            assert!(
                kv_seen.iter().all(|&c| c == 1),
                "each kv head exchanged once: {kv_seen:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn every_query_head_once_with_its_kv_head(kv in 1usize..9, g in 1usize..9, pu in 1usize..9, c in 1usize..65) {
            let heads = kv * g;
            if let Ok(s) = StageSchedule::new(heads, kv, pu, c) {
                check_cover(&s);
                prop_assert_eq!(s.n_stages(), heads / c);
            }
        }
    }

    #[test]
    fn llama3_8b_on_8_ranks_one_head_per_rank_per_stage() {
        let s = StageSchedule::new(32, 8, 8, 8).unwrap();
        assert_eq!(s.phases.len(), 1);
        assert_eq!(s.phases[0].stages.len(), 4);
        assert_eq!(s.phases[0].stages[1].q_heads[3], 13..14);
        check_cover(&s);
    }

    #[test]
    fn replicated_kv_when_fewer_kv_heads_than_ranks() {
        let s = StageSchedule::new(8, 2, 4, 4).unwrap();
        assert_eq!(s.phases.len(), 2);
        // ranks 0-1 own heads 0..4 (kv head 0), ranks 2-3 heads 4..8 (kv head 1)
        assert_eq!(s.phases[1].kv_heads, vec![0..1, 0..1, 1..2, 1..2]);
        assert_eq!(s.phases[1].stages[0].q_heads, vec![1..2, 3..4, 5..6, 7..8]);
        check_cover(&s);
    }

    #[test]
    fn llama3_8b_forward_stages_of_any_wider_valid_size() {
        // U=2 on 2 ranks: one head per rank per stage, 4 stages per kv head
        let bwd = StageSchedule::new(32, 8, 2, 2).unwrap();
        let fwd = StageSchedule::new(32, 8, 2, 8).unwrap();
        let pieces = lse_pieces(&fwd, &bwd).unwrap();
        assert_eq!(pieces.len(), 4);
        assert_eq!(
            pieces[1],
            (4..8)
                .map(|b| LsePiece {
                    bwd_stage: b,
                    cols: b - 4..b - 3
                })
                .collect::<Vec<_>>()
        );
        // every rank keeps its block of heads, so every wider stage serves,
        // up to one stage of all heads (the Ulysses forward)
        assert_eq!(valid_fwd_chunks(&bwd), vec![2, 4, 8, 16, 32]);
        let whole = StageSchedule::new(32, 8, 2, 32).unwrap();
        assert_eq!(whole.phases[0].stages[0].q_heads, vec![0..16, 16..32]);
        let pieces = lse_pieces(&whole, &bwd).unwrap();
        assert_eq!(pieces[0].len(), 16);
        assert_eq!(pieces[0][5].cols, 5..6);
        // a forward that moved heads to other ranks would leave the backward
        // without its LSE
        let mut swapped = whole.clone();
        swapped.phases[0].stages[0].q_heads.reverse();
        let e = lse_pieces(&swapped, &bwd).unwrap_err().to_string();
        assert!(e.contains("other ranks"), "{e}");
        let e = lse_pieces(
            &StageSchedule::new(32, 8, 2, 4).unwrap(),
            &StageSchedule::new(32, 8, 2, 8).unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("multiple"), "{e}");
    }

    proptest! {
        #[test]
        fn forward_pieces_cover_every_backward_stage_once(kv in 1usize..9, g in 1usize..9, pu in 1usize..9, c in 1usize..65) {
            let heads = kv * g;
            if let Ok(bwd) = StageSchedule::new(heads, kv, pu, c) {
                let valid = valid_fwd_chunks(&bwd);
                // every valid stage size that unions whole backward stages serves
                let wider: Vec<usize> = valid_chunks(heads, kv, pu)
                    .into_iter()
                    .filter(|f| f.is_multiple_of(c))
                    .collect();
                prop_assert_eq!(&valid, &wider);
                prop_assert_eq!(valid.first().copied(), Some(c));
                for f in valid {
                    let fwd = StageSchedule::new(heads, kv, pu, f).unwrap();
                    let pieces = lse_pieces(&fwd, &bwd).unwrap();
                    let mut seen = vec![0usize; bwd.n_stages()];
                    let bwd_stages: Vec<&Stage> = bwd.phases.iter().flat_map(|p| &p.stages).collect();
                    for (fs, ps) in fwd.phases.iter().flat_map(|p| &p.stages).zip(&pieces) {
                        // the pieces tile the forward stage's columns
                        prop_assert_eq!(ps.len(), fwd.u() / bwd.u());
                        let mut cols: Vec<usize> = ps.iter().flat_map(|p| p.cols.clone()).collect();
                        cols.sort_unstable();
                        prop_assert_eq!(cols, (0..fwd.u()).collect::<Vec<_>>());
                        for p in ps {
                            seen[p.bwd_stage] += 1;
                            for r in 0..pu {
                                let h = &bwd_stages[p.bwd_stage].q_heads[r];
                                prop_assert_eq!(h.start, fs.q_heads[r].start + p.cols.start);
                                prop_assert_eq!(h.len(), p.cols.len());
                            }
                        }
                    }
                    prop_assert!(seen.iter().all(|&n| n == 1));
                }
            }
        }
    }

    #[test]
    fn bad_chunk_names_valid_values() {
        let e = StageSchedule::new(32, 8, 4, 6).unwrap_err().to_string();
        assert!(e.contains("multiple of the Ulysses degree 4"), "{e}");
        assert!(e.contains("[4, 8, 16, 32]"), "{e}");
        let e = StageSchedule::new(12, 3, 2, 2).unwrap_err().to_string();
        assert!(e.contains("kv heads"), "{e}");
    }
}

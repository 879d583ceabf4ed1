//! The mesh of a run: the degrees given (`--data-parallel`, `--ulysses`,
//! `--ring`), or a default mesh that fills the ranks available
//! ([`default_mesh`]); shared by `train`, `plan`, `eval` and `bench`.

use crate::attention::{AttnDims, CpPlan, Strategy};
use crate::error::Result;
use crate::model::ModelConfig;
use crate::model::decoder::attn_dims;

/// The mesh flags as given (`None`: left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MeshFlags {
    pub data: Option<usize>,
    pub ulysses: Option<usize>,
    pub ring: Option<usize>,
}

/// Mesh degrees for a [`TrainConfig`]: data replicas, Ulysses and ring degree
/// (as `--data-parallel`, `--ulysses`, `--ring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshChoice {
    pub data: usize,
    pub ulysses: usize,
    pub ring: usize,
}

impl MeshChoice {
    /// Ranks of the mesh.
    pub fn world_size(&self) -> usize {
        self.data * self.ulysses * self.ring
    }

    /// Checks that the mesh has at most [`MAX_MESH_RANKS`] ranks (a typo of
    /// many digits), before the sizes derived from it (2 x ring x Ulysses
    /// tokens, ...) could overflow.
    pub fn check_countable(&self) -> crate::error::Result<()> {
        let ranks = self.data.checked_mul(self.ulysses);
        let ranks = ranks.and_then(|r| r.checked_mul(self.ring));
        if ranks.is_some_and(|r| r <= MAX_MESH_RANKS) {
            return Ok(());
        }
        crate::config_err!(
            "--data-parallel {} x --ulysses {} x --ring {} is more than {MAX_MESH_RANKS} ranks, \
             more GPUs than any cluster holds; give the mesh of the run you mean",
            self.data,
            self.ulysses,
            self.ring
        )
    }
}

/// The mesh of a run on the CPU with no mesh flag: one replica, 2 Ulysses
/// x 2 ring.
pub const CPU_DEFAULT_MESH: MeshChoice = MeshChoice {
    data: 1,
    ulysses: 2,
    ring: 2,
};

/// Most ranks of any mesh: no cluster comes near 2^32 GPUs, and sizes
/// derived from the mesh (2 x ring x Ulysses tokens, ...) stay countable.
pub const MAX_MESH_RANKS: usize = 1 << 32;

/// Divisors of `n`, ascending.
fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The default mesh of exactly `n` ranks for `strategy` on `model` at `seq`
/// tokens, or `None` when no such mesh is valid ([`fit_mesh`] with no
/// degree given).
///
/// Context parallelism first: the fewest data replicas, then, within one
/// context group of `C` ranks, the largest Ulysses degree that divides the
/// kv heads (no K/V replication), the ring taking the rest; larger Ulysses
/// degrees (replicating K/V) and data replicas only when nothing else fits.
/// `local` attention has no context group: `n` data replicas. For the tiny
/// model (4 heads, 2 kv heads, seq 256) this gives 2 GPUs: Pu 2; 4 GPUs:
/// Pu 2 x Pr 2 (the CPU default); 8 GPUs: Pu 2 x Pr 4; 3 GPUs: 3 replicas.
pub fn default_mesh(
    strategy: Strategy,
    model: &ModelConfig,
    seq: usize,
    chunk_heads: Option<usize>,
    n: usize,
) -> Option<MeshChoice> {
    fit_mesh(MeshFlags::default(), strategy, model, seq, chunk_heads, n)
}

/// The mesh of exactly `n` ranks that has the degrees `flags` gives and
/// fits the others around them, in [`default_mesh`]'s order of preference
/// (the fewest data replicas, then the largest Ulysses degree without K/V
/// replication); `None` when no valid mesh of `n` ranks has them.
pub fn fit_mesh(
    flags: MeshFlags,
    strategy: Strategy,
    model: &ModelConfig,
    seq: usize,
    chunk_heads: Option<usize>,
    n: usize,
) -> Option<MeshChoice> {
    if n == 0 {
        return None;
    }
    let agrees = |m: &MeshChoice| {
        flags.data.is_none_or(|d| d == m.data)
            && flags.ulysses.is_none_or(|u| u == m.ulysses)
            && flags.ring.is_none_or(|r| r == m.ring)
    };
    if strategy == Strategy::Local {
        let m = MeshChoice {
            data: n,
            ulysses: 1,
            ring: 1,
        };
        return agrees(&m).then_some(m);
    }
    let dims = attn_dims(model);
    for data in divisors(n) {
        let c = n / data;
        let mut pus = divisors(c);
        // no K/V replication first, then the largest Ulysses degree
        pus.sort_by_key(|&pu| (pu > model.kv_heads, std::cmp::Reverse(pu)));
        for pu in pus {
            let (ulysses, ring) = match strategy {
                Strategy::Ulysses => (c, 1),
                Strategy::Ring => (1, c),
                _ => (pu, c / pu),
            };
            let m = MeshChoice {
                data,
                ulysses,
                ring,
            };
            if agrees(&m) && CpPlan::new(strategy, &dims, seq, ulysses, ring, chunk_heads).is_ok() {
                return Some(m);
            }
        }
    }
    None
}

/// The mesh of a run, for `train`, `plan` and `eval` alike. With no mesh
/// flag: [`default_mesh`] for the `ranks` available (the launched world
/// size, the visible GPUs, `plan --gpus`), else the CPU default
/// ([`CPU_DEFAULT_MESH`]). With some: the degrees given, the others fitted
/// around them to `ranks` ([`fit_mesh`]); where no mesh of that many ranks
/// has them, or no ranks are known (the CPU), the others are 1. `local`
/// attention always has Ulysses and ring degree 1.
pub fn resolve_mesh(
    flags: MeshFlags,
    strategy: Strategy,
    model: &ModelConfig,
    seq: usize,
    chunk_heads: Option<usize>,
    ranks: Option<usize>,
) -> MeshChoice {
    let given = flags.data.is_some() || flags.ulysses.is_some() || flags.ring.is_some();
    let fitted = ranks.and_then(|n| fit_mesh(flags, strategy, model, seq, chunk_heads, n));
    let mut m = match (fitted, given) {
        (Some(m), _) => m,
        (None, false) => CPU_DEFAULT_MESH,
        (None, true) => MeshChoice {
            data: flags.data.unwrap_or(1),
            ulysses: flags.ulysses.unwrap_or(1),
            ring: flags.ring.unwrap_or(1),
        },
    };
    if strategy == Strategy::Local {
        m.ulysses = 1;
        m.ring = 1;
    }
    m
}

/// Resolves `strategy` on `gpus` GPUs: `(plan, data degree)`. Without an
/// explicit mesh, all GPUs form the context group (ulysses/ring/upipe), and
/// usp takes the largest Ulysses degree ≤ 8 (one node) that divides the heads.
#[allow(clippy::too_many_arguments)]
pub fn resolve_plan(
    strategy: Strategy,
    dims: &AttnDims,
    seq: usize,
    gpus: usize,
    ulysses: Option<usize>,
    ring: Option<usize>,
    chunk_heads: Option<usize>,
) -> Result<(CpPlan, usize)> {
    if gpus == 0 {
        return crate::config_err!("--gpus must be at least 1");
    }
    let (pu, pr) = match (strategy, ulysses, ring) {
        (Strategy::Local, _, _) => (1, 1),
        (_, Some(u), Some(r)) => (u, r),
        (_, Some(u), None) => (u, 1),
        (_, None, Some(r)) => (1, r),
        (Strategy::Usp, None, None) => {
            let pu = (1..=gpus.min(8))
                .rev()
                .find(|&p| gpus.is_multiple_of(p) && dims.heads.is_multiple_of(p))
                .unwrap_or(1);
            (pu, gpus / pu)
        }
        (Strategy::Ring, None, None) => (1, gpus),
        (_, None, None) => (gpus, 1),
    };
    let c = pu * pr;
    if c == 0 || !gpus.is_multiple_of(c) {
        return crate::config_err!(
            "{gpus} GPUs are not a multiple of the context mesh {pu} (ulysses) x {pr} (ring) = {c}; \
             use --gpus {} or a mesh whose product divides {gpus}",
            c.max(1) * (gpus / c.max(1)).max(1)
        );
    }
    let chunk = if strategy == Strategy::Upipe {
        chunk_heads
    } else {
        None
    };
    let plan = CpPlan::new(strategy, dims, seq, pu, pr, chunk)
        .map_err(|e| crate::Error::Config(format!("{strategy}: {}", strip(&e))))?;
    Ok((plan, gpus / c))
}

fn strip(e: &crate::Error) -> String {
    let s = e.to_string();
    s.strip_prefix("invalid configuration: ")
        .map(str::to_string)
        .unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ModelConfig {
        ModelConfig::resolve("tiny").unwrap()
    }

    fn mesh(data: usize, ulysses: usize, ring: usize) -> MeshChoice {
        MeshChoice {
            data,
            ulysses,
            ring,
        }
    }

    #[test]
    fn default_mesh_fills_the_gpus_within_the_tiny_models_heads() {
        let m = tiny(); // 4 heads, 2 kv heads
        let up = |n| default_mesh(Strategy::Upipe, &m, 256, None, n).unwrap();
        assert_eq!(up(1), mesh(1, 1, 1));
        assert_eq!(up(2), mesh(1, 2, 1));
        assert_eq!(up(4), mesh(1, 2, 2), "the CPU default");
        assert_eq!(up(8), mesh(1, 2, 4));
        // 3 ranks: Pu 3 does not divide 4 heads, a ring of 3 not 256 tokens
        // (2 x 3 zigzag chunks): three replicas
        assert_eq!(up(3), mesh(3, 1, 1));
        // the ring of 8 ranks needs 16 | seq; at seq 8 it is Pu 2 x Pr 2 x 2 replicas
        assert_eq!(
            default_mesh(Strategy::Upipe, &m, 8, None, 8),
            Some(mesh(2, 2, 2))
        );
        // K/V replication (Pu 4 > 2 kv heads) when nothing else fits
        assert_eq!(
            default_mesh(Strategy::Ulysses, &m, 256, None, 4),
            Some(mesh(1, 4, 1))
        );
        assert_eq!(
            default_mesh(Strategy::Ring, &m, 256, None, 2),
            Some(mesh(1, 1, 2))
        );
        assert_eq!(
            default_mesh(Strategy::Local, &m, 256, None, 2),
            Some(mesh(2, 1, 1))
        );
        // every default is a valid plan of exactly n ranks
        for s in [
            Strategy::Upipe,
            Strategy::Usp,
            Strategy::Ulysses,
            Strategy::Ring,
        ] {
            for n in 1..=8 {
                let c = default_mesh(s, &m, 256, None, n).unwrap();
                assert_eq!(c.world_size(), n, "{s} {n}");
                let plan = CpPlan::new(s, &attn_dims(&m), 256, c.ulysses, c.ring, None).unwrap();
                assert_eq!(plan.mesh_shape().world_size() * c.data, n);
            }
        }
        assert_eq!(default_mesh(Strategy::Upipe, &m, 256, None, 0), None);
    }

    #[test]
    fn mesh_flags_win_over_the_default_mesh() {
        let m = tiny();
        let none = MeshFlags::default();
        let r = |flags, ranks| resolve_mesh(flags, Strategy::Upipe, &m, 256, None, ranks);
        assert_eq!(r(none, None), CPU_DEFAULT_MESH);
        assert_eq!(r(none, Some(2)), mesh(1, 2, 1));
        assert_eq!(r(none, Some(8)), mesh(1, 2, 4));
        // some flags given: the rest fitted around them to the ranks
        let data2 = MeshFlags {
            data: Some(2),
            ..none
        };
        assert_eq!(r(data2, Some(8)), mesh(2, 2, 2));
        assert_eq!(r(data2, Some(2)), mesh(2, 1, 1));
        let ring1 = MeshFlags {
            ring: Some(1),
            ..none
        };
        // the fewest replicas first: Pu 4 (replicating K/V) before 2 replicas
        assert_eq!(r(ring1, Some(4)), mesh(1, 4, 1));
        let pu2 = MeshFlags {
            ulysses: Some(2),
            ..none
        };
        assert_eq!(r(pu2, Some(8)), mesh(1, 2, 4));
        // no ranks known (the CPU), or no mesh of them has the flags: the rest at 1
        assert_eq!(r(data2, None), mesh(2, 1, 1));
        assert_eq!(r(ring1, None), mesh(1, 1, 1));
        let pu3 = MeshFlags {
            ulysses: Some(3),
            ..none
        };
        assert_eq!(r(pu3, Some(8)), mesh(1, 3, 1));
        let local = resolve_mesh(data2, Strategy::Local, &m, 256, None, None);
        assert_eq!(local, mesh(2, 1, 1));
    }

    /// Every mesh fitted around the flags has them and exactly the ranks.
    #[test]
    fn fitted_meshes_keep_the_flags_and_fill_the_ranks() {
        let m = tiny();
        for n in 1..=8 {
            for (d, u, r) in [
                (Some(2), None, None),
                (None, Some(2), None),
                (None, None, Some(2)),
            ] {
                let flags = MeshFlags {
                    data: d,
                    ulysses: u,
                    ring: r,
                };
                if let Some(c) = fit_mesh(flags, Strategy::Upipe, &m, 256, None, n) {
                    assert_eq!(c.world_size(), n, "{flags:?} {n}");
                    assert!(d.is_none_or(|d| d == c.data) && u.is_none_or(|u| u == c.ulysses));
                    assert!(r.is_none_or(|r| r == c.ring), "{flags:?} {n}: {c:?}");
                }
            }
        }
    }
}

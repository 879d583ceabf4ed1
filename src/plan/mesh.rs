//! The mesh of a run: the degrees given (`--data-parallel`, `--ulysses`,
//! `--ring`), or a default mesh that fills the ranks available
//! ([`default_mesh`]); shared by `train`, `plan`, `eval` and `bench`.

use crate::attention::{AttnDims, CpPlan, FittedMesh, Strategy};
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

/// The default mesh of exactly `n` ranks for `strategy` on `model` at `seq`
/// tokens, or `None` when no such mesh is valid ([`fit_mesh`] with no
/// degree given).
///
/// The strategy's own rule ([`Strategy::fit_mesh`]): context parallelism
/// first, the fewest data replicas, then, within one context group of `C`
/// ranks, the largest Ulysses degree that divides the kv heads (no K/V
/// replication) and stays inside a node ([`crate::attention::NODE_GPUS`]), the ring taking
/// the rest; larger Ulysses degrees and data replicas only when nothing
/// else fits. `local` attention has no context group: `n` data replicas.
/// For the tiny model (4 heads, 2 kv heads, seq 256) this gives 2 GPUs:
/// Pu 2; 4 GPUs: Pu 2 x Pr 2 (the CPU default); 8 GPUs: Pu 2 x Pr 4;
/// 3 GPUs: 3 replicas.
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
/// fits the others around them, in [`default_mesh`]'s order of preference;
/// `None` when no valid mesh of `n` ranks has them.
pub fn fit_mesh(
    flags: MeshFlags,
    strategy: Strategy,
    model: &ModelConfig,
    seq: usize,
    chunk_heads: Option<usize>,
    n: usize,
) -> Option<MeshChoice> {
    let agrees = |m: FittedMesh| {
        let m = MeshChoice::from(m);
        flags.data.is_none_or(|d| d == m.data)
            && flags.ulysses.is_none_or(|u| u == m.ulysses)
            && flags.ring.is_none_or(|r| r == m.ring)
    };
    let dims = attn_dims(model);
    let fitted = strategy.fit_mesh(&dims, seq, chunk_heads, n, agrees);
    fitted.map(MeshChoice::from)
}

impl From<FittedMesh> for MeshChoice {
    fn from(m: FittedMesh) -> Self {
        MeshChoice {
            data: m.data,
            ulysses: m.context.ulysses,
            ring: m.context.ring,
        }
    }
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
    let m = match (fitted, given) {
        (Some(m), _) => m,
        (None, false) => CPU_DEFAULT_MESH,
        (None, true) => MeshChoice {
            data: flags.data.unwrap_or(1),
            ulysses: flags.ulysses.unwrap_or(1),
            ring: flags.ring.unwrap_or(1),
        },
    };
    let context = strategy.given_mesh(Some(m.ulysses), Some(m.ring));
    MeshChoice {
        data: m.data,
        ulysses: context.ulysses,
        ring: context.ring,
    }
}

/// Resolves `strategy` on `gpus` GPUs: `(plan, data degree)`. With a
/// Ulysses or ring degree given, the context mesh they make
/// ([`Strategy::given_mesh`]; the other 1) and as many replicas of it as
/// fill the GPUs. With neither, the default mesh of the GPUs
/// ([`default_mesh`], the strategy's own rule); where no mesh of them is
/// valid, the error of the one-replica mesh the rule prefers.
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
    let fitted = match (ulysses, ring) {
        (None, None) => strategy.fit_mesh(dims, seq, chunk_heads, gpus, |_| true),
        _ => None,
    };
    let (context, data) = match fitted {
        Some(m) => (m.context, m.data),
        None => {
            let preferred = strategy
                .context_meshes(dims.kv_heads, gpus)
                .into_iter()
                .next();
            let given = strategy.given_mesh(ulysses, ring);
            let context = match (ulysses, ring) {
                (None, None) => preferred.unwrap_or(given),
                _ => given,
            };
            (context, context.replicas_on(gpus)?)
        }
    };
    let plan = strategy.plan_on(dims, seq, context, chunk_heads)?;
    Ok((plan, data))
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

    /// `plan --gpus N` resolves the mesh `train` fits to N ranks, where it
    /// once gave the context group all N (Ulysses over all of them; USP a
    /// Pu up to 8 dividing the query heads, replicating K/V).
    #[test]
    fn plan_on_gpus_resolves_the_mesh_train_fits() {
        let llama = ModelConfig::resolve("llama3-8b").unwrap(); // 32 heads, 8 kv heads
        let d = attn_dims(&llama);
        let on = |s, gpus| {
            let (plan, data) = resolve_plan(s, &d, 1 << 20, gpus, None, None, None).unwrap();
            mesh(data, plan.layout.pu, plan.layout.pr)
        };
        assert_eq!(on(Strategy::Ulysses, 6), mesh(3, 2, 1));
        assert_eq!(on(Strategy::Upipe, 8), mesh(1, 8, 1));
        // 16 GPUs: Ulysses over the 8 kv heads inside a node, a ring of 2 across
        assert_eq!(on(Strategy::Upipe, 16), mesh(1, 8, 2));
        assert_eq!(on(Strategy::Usp, 16), mesh(1, 8, 2));
        let tiny_dims = attn_dims(&tiny());
        let (plan, _) = resolve_plan(Strategy::Usp, &tiny_dims, 256, 4, None, None, None).unwrap();
        assert_eq!((plan.layout.pu, plan.layout.pr), (2, 2));
        // 32 kv heads on 16 GPUs: the Ulysses group stays inside a node
        let mha = with_heads(32, 32);
        let m = default_mesh(Strategy::Upipe, &mha, 4096, None, 16);
        assert_eq!(m, Some(mesh(1, 8, 2)));
    }

    /// A model of `heads` query heads sharing `kv_heads` (the tiny model's
    /// other sizes).
    fn with_heads(heads: usize, kv_heads: usize) -> ModelConfig {
        let mut m = tiny();
        (m.heads, m.kv_heads) = (heads, kv_heads);
        m.hidden = heads * m.head_dim;
        m
    }

    proptest::proptest! {
        /// One rule: the default mesh `train` and `eval` fit to `n` ranks
        /// ([`default_mesh`]) is the one `plan` resolves on `n` GPUs
        /// ([`resolve_plan`] with no degree given, which fails exactly where
        /// no mesh fits); `fit_mesh` accepts it given in full, and every mesh
        /// `fit_mesh` fits around flags has them, fills the ranks, is what
        /// `resolve_plan` resolves from its degrees, and has no fewer
        /// replicas than the default.
        #[test]
        fn train_plan_and_eval_resolve_one_mesh(
            s in 0usize..5,
            kv_heads in 1usize..=16,
            group in 1usize..=4,
            n in 1usize..=32,
            seq in proptest::sample::select(vec![1usize, 6, 8, 24, 96, 256, 4096, 3 << 10]),
            data in proptest::option::of(1usize..=8),
            ulysses in proptest::option::of(1usize..=8),
            ring in proptest::option::of(1usize..=8),
        ) {
            let strategy = Strategy::ALL[s];
            let model = with_heads(kv_heads * group, kv_heads);
            let dims = attn_dims(&model);
            let default = default_mesh(strategy, &model, seq, None, n);
            let planned = resolve_plan(strategy, &dims, seq, n, None, None, None);
            match (default, &planned) {
                (Some(m), Ok((plan, data))) => {
                    let shape = plan.mesh_shape();
                    proptest::prop_assert_eq!((m.data, m.ulysses, m.ring), (*data, shape.ulysses, shape.ring));
                    let given = MeshFlags { data: Some(m.data), ulysses: Some(m.ulysses), ring: Some(m.ring) };
                    proptest::prop_assert_eq!(fit_mesh(given, strategy, &model, seq, None, n), Some(m));
                    let resolved = resolve_mesh(MeshFlags::default(), strategy, &model, seq, None, Some(n));
                    proptest::prop_assert_eq!(resolved, m);
                }
                (None, Err(_)) => {}
                (m, p) => proptest::prop_assert!(false, "{strategy} on {n}: default {m:?}, plan {p:?}"),
            }
            let flags = MeshFlags { data, ulysses, ring };
            if let Some(m) = fit_mesh(flags, strategy, &model, seq, None, n) {
                proptest::prop_assert_eq!(m.world_size(), n);
                proptest::prop_assert!(data.is_none_or(|d| d == m.data), "{m:?}");
                proptest::prop_assert!(ulysses.is_none_or(|u| u == m.ulysses), "{m:?}");
                proptest::prop_assert!(ring.is_none_or(|r| r == m.ring), "{m:?}");
                let (u, r) = (Some(m.ulysses), Some(m.ring));
                let (plan, replicas) = resolve_plan(strategy, &dims, seq, n, u, r, None).unwrap();
                let shape = plan.mesh_shape();
                proptest::prop_assert_eq!((replicas, shape.ulysses, shape.ring), (m.data, m.ulysses, m.ring));
                proptest::prop_assert!(default.is_some_and(|d| d.data <= m.data), "{default:?} {m:?}");
                proptest::prop_assert_eq!(resolve_mesh(flags, strategy, &model, seq, None, Some(n)), m);
            }
        }
    }
}

//! NCCL process groups on two GPUs, one process per GPU: every collective
//! against its definition (bf16 and f32, world and sub-groups), and the
//! attention layer under each strategy against the CPU f32 reference.
//!
//! The test re-runs its own binary as the two ranks (so it needs no `upipe`
//! binary and works wherever the test binary is copied). Skipped with a
//! message where fewer than two GPUs (or no NCCL) exist.

use std::sync::Arc;
use std::time::Duration;
mod common;

use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{
    RankInputs, RankOptions, TrialInputs, assemble, gather_runs, run_rank, run_trial,
};
use upipe::attention::{AttnDims, CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::{Backend, Category, DType};
use upipe::comm::env::DistEnv;
use upipe::comm::nccl::NcclWorld;
use upipe::comm::rendezvous::Rendezvous;
use upipe::comm::{MeshShape, ProcessGroup};

/// Set in the children: which test body to run as a rank.
const ROLE: &str = "UPIPE_GPU_NCCL_ROLE";

/// Parent: starts two ranks running `test` and checks both succeed.
fn launch_two(test: &str) {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    if let Some(why) = common::two_gpus_missing() {
        eprintln!("SKIP gpu_nccl::{test}: {why}");
        return;
    }
    // well under the GPU script's limit for the whole test, so a hung rank's
    // output is still printed
    let ranks = common::run_two_ranks(test, ROLE, &[], Duration::from_secs(80));
    assert!(
        ranks.iter().all(|r| r.success),
        "a rank failed (see its output above)"
    );
}

/// Child: this rank's environment, rendezvous and NCCL world.
fn join() -> (DistEnv, Rendezvous, NcclWorld) {
    let env = DistEnv::from_env().unwrap().expect("RANK/WORLD_SIZE set");
    let mut rv = Rendezvous::connect(&env, Duration::from_secs(60)).unwrap();
    let b = Arc::new(CudaBackend::new(env.local_rank).unwrap());
    let world = NcclWorld::connect(&env, &mut rv, b).unwrap();
    (env, rv, world)
}

fn collectives_on(b: &CudaBackend, g: &dyn ProcessGroup<CudaBackend>, dt: DType) {
    let (me, p) = (g.rank(), g.size());
    let n = 4 * p;
    let send: Vec<f32> = (0..n).map(|i| (me * 100 + i) as f32).collect();
    let s = b.from_host(&send, &[n], dt, Category::Comm).unwrap();

    let mut r = b.zeros(&[n], dt, Category::Comm).unwrap();
    g.all_to_all(&s, &mut r).unwrap();
    let expect: Vec<f32> = (0..p)
        .flat_map(|j| (0..4).map(move |i| (j * 100 + me * 4 + i) as f32))
        .collect();
    assert_eq!(b.to_host(&r).unwrap(), expect, "all_to_all {dt:?}");

    let mut ag = b.zeros(&[n * p], dt, Category::Comm).unwrap();
    g.all_gather(&s, &mut ag).unwrap();
    let expect: Vec<f32> = (0..p)
        .flat_map(|j| (0..n).map(move |i| (j * 100 + i) as f32))
        .collect();
    assert_eq!(b.to_host(&ag).unwrap(), expect, "all_gather {dt:?}");

    let mut rs = b.zeros(&[4], dt, Category::Comm).unwrap();
    g.reduce_scatter(&s, &mut rs).unwrap();
    let expect: Vec<f32> = (0..4)
        .map(|i| (0..p).map(|j| (j * 100 + me * 4 + i) as f32).sum())
        .collect();
    assert_eq!(b.to_host(&rs).unwrap(), expect, "reduce_scatter {dt:?}");

    let mut ar = b
        .from_host(&[me as f32 + 1.0, 2.0], &[2], dt, Category::Comm)
        .unwrap();
    g.all_reduce(&mut ar).unwrap();
    let tri = (p * (p + 1) / 2) as f32;
    assert_eq!(
        b.to_host(&ar).unwrap(),
        vec![tri, 2.0 * p as f32],
        "all_reduce {dt:?}"
    );

    let mut sr = b.zeros(&[n], dt, Category::Comm).unwrap();
    g.send_recv(&s, (me + 1) % p, &mut sr, (me + p - 1) % p)
        .unwrap();
    let prev = (me + p - 1) % p;
    let expect: Vec<f32> = (0..n).map(|i| (prev * 100 + i) as f32).collect();
    assert_eq!(b.to_host(&sr).unwrap(), expect, "send_recv {dt:?}");

    // mismatched dtypes are an error, not a crash
    let other = if dt == DType::F32 {
        DType::BF16
    } else {
        DType::F32
    };
    let mut wrong = b.zeros(&[n], other, Category::Comm).unwrap();
    let err = g.all_to_all(&s, &mut wrong).unwrap_err();
    assert!(err.to_string().contains("all_to_all"), "{err}");
}

#[test]
fn nccl_collectives_match_definitions() {
    launch_two("nccl_collectives_match_definitions");
    if std::env::var(ROLE).as_deref() != Ok("nccl_collectives_match_definitions") {
        return;
    }
    let (env, _rv, world) = join();
    let b = world.backend().clone();
    for shape in [
        MeshShape::new(1, 1, 2).unwrap(),
        MeshShape::new(1, 2, 1).unwrap(),
    ] {
        let mesh = world.mesh(shape).unwrap();
        for dt in [DType::F32, DType::BF16] {
            for g in [
                &mesh.world,
                &mesh.ulysses,
                &mesh.ring,
                &mesh.context,
                &mesh.data,
            ] {
                collectives_on(&b, g.as_ref(), dt);
            }
        }
        println!("rank {} mesh {shape:?}: collectives ok", env.rank);
    }
}

#[test]
fn nccl_attention_layer_matches_cpu() {
    launch_two("nccl_attention_layer_matches_cpu");
    if std::env::var(ROLE).as_deref() != Ok("nccl_attention_layer_matches_cpu") {
        return;
    }
    let (env, mut rv, world) = join();
    let b = world.backend().clone();
    let d = AttnDims {
        hidden: 256,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        qk_norm: true,
        norm_eps: 1e-6,
        rope: RopeConfig {
            theta: 10000.0,
            scaling: None,
        },
    };
    let seq = 256;
    let inputs = TrialInputs::random(&d, seq, 7);
    let reference = (env.rank == 0).then(|| {
        let plan = CpPlan::new(Strategy::Local, &d, seq, 1, 1, None).unwrap();
        run_trial(&plan, &d, &inputs, CpuBackend::new).unwrap()
    });
    // a failing rank 0 must not stop early: rank 1 would wait for it in the
    // next collective, and neither process would exit
    let mut failures = Vec::new();
    for (s, pu, pr, u) in [
        (Strategy::Ulysses, 2, 1, None),
        (Strategy::Ring, 2, 1, None),
        (Strategy::Usp, 2, 1, None),
        (Strategy::Upipe, 2, 1, None),
        (Strategy::Upipe, 2, 1, Some(4)),
    ] {
        eprintln!("rank {}: {s} {pu}x{pr} U={u:?}", env.rank);
        let plan = CpPlan::new(s, &d, seq, pu, pr, u).unwrap();
        let mesh = world.mesh(plan.mesh_shape()).unwrap();
        let (x, dy) = inputs.shard(&plan, d.hidden, mesh.ring.rank(), mesh.ulysses.rank());
        let ri = RankInputs {
            x: &x,
            dy: &dy,
            weights: &inputs.weights,
        };
        let run = run_rank(&plan, &d, ri, b.as_ref(), &mesh, &RankOptions::ONCE).unwrap();
        drop(mesh);
        let runs = gather_runs(&mut rv, run).unwrap();
        if let Some(r) = &reference {
            let got = assemble(&plan, d.hidden, &runs);
            let errs = got.errors_against(r);
            println!("nccl {s} {pu}x{pr} U={u:?}: {errs:?}");
            for (name, e) in errs {
                if e > upipe::attention::trial::bf16_tolerance(&name) {
                    failures.push(format!("{s} {pu}x{pr} U={u:?}: {name} rel err {e:e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

//! NCCL process groups on two GPUs, one process per GPU: every collective
//! against its definition (bf16 and f32, world and sub-groups), and the
//! attention layer under each strategy against the CPU f32 reference.
//!
//! The test re-runs its own binary as the two ranks (so it needs no `upipe`
//! binary and works wherever the test binary is copied). Skipped with a
//! message where fewer than two GPUs (or no NCCL) exist. The watchdog test
//! has a rank leave a collective its peer is in, and checks the peer gets
//! the watchdog's error instead of waiting forever.

use crate::common;
use std::sync::Arc;
use std::time::{Duration, Instant};

use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{
    RankInputs, RankOptions, TrialInputs, assemble, gather_runs, run_rank_masked, run_trial_masked,
};
use upipe::attention::{AttnDims, CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::{AttnMask, Backend, BoundedMask, Category, DType};
use upipe::comm::env::DistEnv;
use upipe::comm::nccl::NcclWorld;
use upipe::comm::rendezvous::Rendezvous;
use upipe::comm::{MeshShape, ProcessGroup};

/// Set in the children: which test body to run as a rank.
const ROLE: &str = "UPIPE_GPU_NCCL_ROLE";

/// Parent: starts two ranks running `test` and checks both succeed.
fn launch_two(test: &str) {
    launch_two_with(test, &[]);
}

/// Parent: starts two ranks running `test` with `env` added, checks both
/// exit successfully, and returns what they printed (`None` in a child, or
/// where the test is skipped).
fn launch_two_with(test: &str, env: &[(&str, String)]) -> Option<Vec<common::RankOutput>> {
    if std::env::var(ROLE).is_ok() {
        return None;
    }
    if let Some(why) = common::two_gpus_missing() {
        eprintln!("SKIP gpu_nccl::{test}: {why}");
        return None;
    }
    // well under the GPU script's limit for the whole test, so a hung rank's
    // output is still printed
    let ranks = common::run_two_ranks(module_path!(), test, ROLE, env, Duration::from_secs(80));
    for (rank, r) in ranks.iter().enumerate() {
        assert!(
            r.success,
            "rank {rank} failed ({}; see its output above)",
            r.status
        );
    }
    Some(ranks)
}

/// Child: this rank's environment, rendezvous and NCCL world.
fn join() -> (DistEnv, Rendezvous, NcclWorld) {
    let env = DistEnv::from_env().unwrap().expect("RANK/WORLD_SIZE set");
    let mut rv = Rendezvous::connect(&env, Duration::from_secs(60)).unwrap();
    let b = Arc::new(CudaBackend::new(env.local_rank).unwrap());
    let world = NcclWorld::connect(&env, &mut rv, b).unwrap();
    (env, rv, world)
}

/// Child of `test` only: its log (`RUST_LOG`) on stderr, then [`join`].
fn join_logging(test: &str) -> Option<(DistEnv, Rendezvous, NcclWorld)> {
    if std::env::var(ROLE).as_deref() != Ok(test) {
        return None;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    Some(join())
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
    layer_matches_cpu(
        &env,
        &mut rv,
        &world,
        &[
            (Strategy::Ulysses, 2, 1, None, false),
            (Strategy::Ring, 2, 1, None, false),
            (Strategy::Usp, 2, 1, None, false),
            (Strategy::Upipe, 2, 1, None, false),
            (Strategy::Upipe, 2, 1, Some(4), false),
        ],
    );
}

/// The zigzag ring's direct shifts over NCCL (`ProcessGroup::start_shift_from`,
/// grouped `ncclSend`/`ncclRecv` with either side left out): ring and USP
/// layers under a sliding window shorter than a chunk (both ranks send and
/// receive), documents where only rank 1 needs rank 0's block (rank 0
/// sends without receiving, rank 1 receives without sending), and the two
/// composed, against the CPU f32 layer under the same mask.
#[test]
fn nccl_ring_shifts_match_cpu_under_windows_and_documents() {
    let test = "nccl_ring_shifts_match_cpu_under_windows_and_documents";
    launch_two(test);
    if std::env::var(ROLE).as_deref() != Ok(test) {
        return;
    }
    let (env, mut rv, world) = join();
    // 256 tokens on a ring of 2: zigzag chunks of 64
    let docs = || BoundedMask::documents(&[0, 192], 256).unwrap();
    for mask in [
        AttnMask::Bounded(docs().with_window(40).unwrap()),
        AttnMask::Bounded(
            BoundedMask::documents(&[0], 256)
                .unwrap()
                .with_window(40)
                .unwrap(),
        ),
        AttnMask::Bounded(docs()),
    ] {
        eprintln!("rank {}: under {mask}", env.rank);
        layer_matches_cpu_masked(
            &env,
            &mut rv,
            &world,
            &[
                (Strategy::Ring, 2, 1, None, false),
                (Strategy::Usp, 1, 2, None, true),
                (Strategy::Upipe, 1, 2, Some(2), false),
            ],
            mask,
        );
    }
}

/// With an exchange window (`UPIPE_CE_EXCHANGE_MB`) the Ulysses group's
/// all-to-alls run on copy engines (NCCL logs its copy-engine init, which
/// only the zero-CTA path does): collectives on the window's buffers keep
/// their definitions, and the layer still matches the CPU reference, with
/// and without overlap; a buffer larger than the window is an error naming
/// the fix.
#[test]
fn nccl_copy_engine_exchanges_match_cpu() {
    let test = "nccl_copy_engine_exchanges_match_cpu";
    let env = [
        ("UPIPE_CE_EXCHANGE_MB", "2".to_string()),
        ("NCCL_DEBUG", "INFO".to_string()),
        ("NCCL_DEBUG_SUBSYS", "INIT".to_string()),
        ("RUST_LOG", "upipe=info".to_string()),
    ];
    if let Some(ranks) = launch_two_with(test, &env) {
        for (rank, r) in ranks.iter().enumerate() {
            let log = format!("{}{}", r.stdout, r.stderr);
            assert!(
                log.contains("Init CE"),
                "rank {rank}: NCCL never set up its copy-engine collectives"
            );
            assert!(
                log.contains("buffers handed out"),
                "rank {rank}: no exchange window report"
            );
        }
        return;
    }
    let Some((env, mut rv, world)) = join_logging(test) else {
        return;
    };
    {
        let b = world.backend().clone();
        let mesh = world.mesh(MeshShape::new(1, 1, 2).unwrap()).unwrap();
        for dt in [DType::F32, DType::BF16] {
            let (me, p) = (mesh.ulysses.rank(), mesh.ulysses.size());
            let n = 4096 * p;
            // small integers: exact in bf16
            let host: Vec<f32> = (0..n).map(|i| (me * 128 + i % 97) as f32).collect();
            let mut s = mesh
                .ulysses
                .exchange_buffer(&[n], dt)
                .unwrap()
                .expect("window buffer");
            let staged = b.from_host(&host, &[n], dt, Category::Comm).unwrap();
            b.copy(s.mat_mut(), staged.mat()).unwrap();
            let mut r = mesh
                .ulysses
                .exchange_buffer(&[n], dt)
                .unwrap()
                .expect("window buffer");
            mesh.ulysses.all_to_all(&s, &mut r).unwrap();
            let expect: Vec<f32> = (0..p)
                .flat_map(|j| (0..4096).map(move |i| (j * 128 + (me * 4096 + i) % 97) as f32))
                .collect();
            assert_eq!(b.to_host(&r).unwrap(), expect, "window all_to_all {dt:?}");
            // larger than the whole window: an error that names the fix
            let full = mesh.ulysses.exchange_buffer(&[1 << 21], dt).unwrap_err();
            assert!(full.to_string().contains("UPIPE_CE_EXCHANGE_MB"), "{full}");
        }
    }
    layer_matches_cpu(
        &env,
        &mut rv,
        &world,
        &[
            (Strategy::Ulysses, 2, 1, None, false),
            (Strategy::Upipe, 2, 1, None, false),
            (Strategy::Upipe, 2, 1, None, true),
            (Strategy::Upipe, 2, 1, Some(4), false),
        ],
    );
}

/// Child body: the Llama-like layer (GQA, QK norm) under each
/// `(strategy, pu, pr, U, overlap)` over NCCL against the CPU f32 layer.
fn layer_matches_cpu(
    env: &DistEnv,
    rv: &mut Rendezvous,
    world: &NcclWorld,
    cases: &[(Strategy, usize, usize, Option<usize>, bool)],
) {
    layer_matches_cpu_masked(env, rv, world, cases, AttnMask::Causal);
}

/// [`layer_matches_cpu`] with the layer attending under `mask`.
fn layer_matches_cpu_masked(
    env: &DistEnv,
    rv: &mut Rendezvous,
    world: &NcclWorld,
    cases: &[(Strategy, usize, usize, Option<usize>, bool)],
    mask: AttnMask,
) {
    let b = world.backend().clone();
    let d = AttnDims {
        hidden: 256,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        qk_norm: true,
        norm: upipe::backend::RmsNorm::plain(1e-6),
        rope: RopeConfig {
            theta: 10000.0,
            scaling: None,
        },
        softmax_scale: AttnDims::default_softmax_scale(64),
        precision: upipe::backend::fp8::Precision::Bf16,
    };
    let seq = 256;
    let inputs = TrialInputs::random(&d, seq, 7);
    let reference = (env.rank == 0).then(|| {
        let plan = CpPlan::new(Strategy::Local, &d, seq, 1, 1, None).unwrap();
        run_trial_masked(&plan, &d, &inputs, mask.clone(), CpuBackend::new).unwrap()
    });
    // a failing rank 0 must not stop early: rank 1 would wait for it in the
    // next collective, and neither process would exit
    let mut failures = Vec::new();
    for &(s, pu, pr, u, overlap) in cases {
        eprintln!("rank {}: {s} {pu}x{pr} U={u:?} overlap={overlap}", env.rank);
        let plan = CpPlan::new(s, &d, seq, pu, pr, u)
            .unwrap()
            .with_overlap(overlap);
        let mesh = world.mesh(plan.mesh_shape()).unwrap();
        let (x, dy) = inputs.shard(&plan, d.hidden, mesh.ring.rank(), mesh.ulysses.rank());
        let ri = RankInputs {
            x: &x,
            dy: &dy,
            weights: &inputs.weights,
        };
        let opts = &RankOptions::ONCE;
        let run = run_rank_masked(&plan, &d, ri, b.as_ref(), &mesh, opts, mask.clone()).unwrap();
        drop(mesh);
        let runs = gather_runs(rv, run).unwrap();
        if let Some(r) = &reference {
            let got = assemble(&plan, d.hidden, &runs);
            let errs = got.errors_against(r);
            println!("nccl {s} {pu}x{pr} U={u:?} overlap={overlap} {mask}: {errs:?}");
            for (name, e) in errs {
                if e > upipe::attention::trial::bf16_tolerance(&name) {
                    failures.push(format!(
                        "{s} {pu}x{pr} U={u:?} overlap={overlap} {mask}: {name} rel err {e:e}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// What rank 0 prints once the watchdog failed its collective as expected.
const WATCHDOG_OK: &str = "WATCHDOG_REPORTED";

#[test]
fn nccl_watchdog_fails_a_collective_whose_peer_left() {
    let test = "nccl_watchdog_fails_a_collective_whose_peer_left";
    let env = [
        ("UPIPE_NCCL_TIMEOUT_S", "5".to_string()),
        // the watchdog's own log and NCCL's warnings, for a failure's diagnosis
        ("RUST_LOG", "upipe=info,upipe::comm::nccl=trace".to_string()),
        ("NCCL_DEBUG", "WARN".to_string()),
    ];
    if let Some(ranks) = launch_two_with(test, &env) {
        // both exited 0: rank 0 got the error (its assertions passed) and
        // rank 1 left cleanly; rank 0 says so
        assert!(
            ranks[0].stdout.contains(WATCHDOG_OK),
            "rank 0 did not report the watchdog's error"
        );
        assert!(
            ranks[1].stdout.contains("rank 1: left"),
            "rank 1 did not leave"
        );
        return;
    }
    let Some((env, _rv, world)) = join_logging(test) else {
        return;
    };
    assert_eq!(world.timeout(), Some(Duration::from_secs(5)));
    let b = world.backend().clone();
    let mesh = world.mesh(MeshShape::new(1, 1, 2).unwrap()).unwrap();
    let mut t = b
        .from_host(&[env.rank as f32 + 1.0], &[1], DType::F32, Category::Comm)
        .unwrap();
    mesh.world.all_reduce(&mut t).unwrap();
    assert_eq!(b.to_host(&t).unwrap(), vec![3.0], "the good all_reduce");
    world.health().unwrap();
    if env.rank == 1 {
        // never joins the second all_reduce: stays alive past rank 0's
        // timeout (a hung peer), then leaves (destroying its communicators,
        // which lets rank 0's NCCL finish freeing its aborted ones)
        std::thread::sleep(Duration::from_secs(8));
        println!("rank 1: left without the second all_reduce");
        // a dead peer: leave without destroying the communicators (that
        // would wait for rank 0, which is inside the collective)
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::process::exit(0);
    }
    eprintln!("rank 0: second all_reduce, which rank 1 never joins");
    let start = Instant::now();
    // the collective is only queued; the download waits for it
    let got = mesh.world.all_reduce(&mut t).and_then(|()| b.to_host(&t));
    let waited = start.elapsed();
    let err = got.expect_err("rank 1 never joined").to_string();
    for want in [
        "all_reduce 4 B on group world",
        "UPIPE_NCCL_TIMEOUT_S",
        "peer rank likely died or hung",
    ] {
        assert!(err.contains(want), "{want:?} missing from: {err}");
    }
    assert!(
        waited >= Duration::from_millis(4900) && waited < Duration::from_secs(20),
        "reported after {waited:?}, expected about 5 s"
    );
    // from now on every collective fails at once, the split groups' too
    let again = Instant::now();
    let e2 = mesh.ulysses.all_reduce(&mut t).unwrap_err().to_string();
    assert!(e2.contains("UPIPE_NCCL_TIMEOUT_S"), "{e2}");
    let e3 = mesh
        .world
        .all_gather(&t, &mut b.zeros(&[2], DType::F32, Category::Comm).unwrap());
    assert!(e3.is_err());
    assert!(world.health().is_err());
    assert!(again.elapsed() < Duration::from_secs(1));
    println!("{WATCHDOG_OK} after {waited:?}: {err}");
}

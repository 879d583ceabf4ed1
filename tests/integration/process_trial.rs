//! The process-rank path of the trial harness without a GPU: each rank runs
//! the shared per-rank body, results travel over the real TCP rendezvous on
//! loopback (as `bench attn --device cuda` does between processes), and the
//! assembled result must equal the thread-rank `run_trial` exactly.

use std::sync::Arc;
use std::time::Duration;
use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{
    RankInputs, RankOptions, TrialInputs, assemble, gather_runs, run_rank, run_trial,
};
use upipe::attention::{AttnDims, CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::comm::env::DistEnv;
use upipe::comm::local::LocalWorld;
use upipe::comm::rendezvous::Rendezvous;

#[test]
fn process_ranks_over_rendezvous_equal_thread_ranks() {
    let d = AttnDims {
        hidden: 64,
        heads: 8,
        kv_heads: 2,
        head_dim: 8,
        qk_norm: true,
        norm: upipe::backend::RmsNorm::plain(1e-6),
        rope: RopeConfig {
            theta: 10000.0,
            scaling: None,
        },
        softmax_scale: AttnDims::default_softmax_scale(8),
        precision: upipe::backend::fp8::Precision::Bf16,
    };
    let seq = 64;
    let inputs = TrialInputs::random(&d, seq, 3);
    for (s, pu, pr, u) in [
        (Strategy::Upipe, 2, 2, Some(2)),
        (Strategy::Ulysses, 4, 1, None),
        (Strategy::Ring, 4, 1, None),
    ] {
        let plan = CpPlan::new(s, &d, seq, pu, pr, u).unwrap();
        let expect = run_trial(&plan, &d, &inputs, CpuBackend::new).unwrap();
        let shape = plan.mesh_shape();
        let n = shape.world_size();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let local = LocalWorld::new(n);
        let got: Vec<_> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..n)
                .map(|rank| {
                    let (plan, inputs, d, local) = (&plan, &inputs, &d, &local);
                    sc.spawn(move || {
                        let env = DistEnv {
                            rank,
                            world_size: n,
                            local_rank: rank,
                            local_world_size: n,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                        };
                        let mut rv = Rendezvous::connect(&env, Duration::from_secs(30)).unwrap();
                        let b = Arc::new(CpuBackend::new());
                        let mesh = local.mesh(shape, rank, b.clone());
                        let (x, dy) =
                            inputs.shard(plan, d.hidden, mesh.ring.rank(), mesh.ulysses.rank());
                        let ri = RankInputs {
                            x: &x,
                            dy: &dy,
                            weights: &inputs.weights,
                        };
                        let opts = RankOptions {
                            warmup: 1,
                            iters: 2,
                            keep_outputs: true,
                        };
                        let run = run_rank(plan, d, ri, b.as_ref(), &mesh, &opts).unwrap();
                        assert_eq!(run.seconds.len(), 2);
                        let runs = gather_runs(&mut rv, run).unwrap();
                        assemble(plan, d.hidden, &runs)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in got {
            assert_eq!(r.y, expect.y, "{s}");
            assert_eq!(r.dx, expect.dx, "{s}");
            assert_eq!(r.grads, expect.grads, "{s}");
            assert_eq!(r.peak_bytes, expect.peak_bytes, "{s}");
            assert_eq!(r.act_bytes, expect.act_bytes, "{s}");
            assert_eq!(r.ranks, n);
        }
    }
}

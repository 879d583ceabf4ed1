//! `upipe plan` at a length resolves exactly what `upipe train` would at
//! that length: over models × meshes × lengths × memory policies ×
//! strategies, the request each command builds from its own flags
//! (`cli::train::run_request`, `cli::plan::plan_request`) resolves
//! (`plan::resolve_run`) to the same decisions and the same prediction.

use clap::{Args, Command, FromArgMatches};
use upipe::attention::Strategy;
use upipe::cli::plan::{PlanArgs, plan_request};
use upipe::cli::train::{MeshFlags, TrainArgs, resolve_mesh, run_request, train_config};
use upipe::optim::StateFormat;
use upipe::plan::resolve::{Decisions, host_share};
use upipe::plan::{Depth, DeviceKind, RankBudget, RunRequest, resolve_run};

const GIB: usize = 1 << 30;

/// `A` parsed from `argv` (the flags after the subcommand).
fn parse<A: Args + FromArgMatches>(argv: &[String]) -> A {
    let cmd = A::augment_args(Command::new("x").no_binary_name(true));
    let m = cmd.try_get_matches_from(argv).unwrap();
    A::from_arg_matches(&m).unwrap()
}

/// One configuration of a run, as both commands take it.
struct Case<'a> {
    model: &'a str,
    strategy: Strategy,
    mesh: (usize, usize, usize),
    seq: usize,
    gpu_mem_gib: f64,
    host_mem_gib: usize,
    policy: &'a [&'a str],
}

impl Case<'_> {
    fn world(&self) -> usize {
        self.mesh.0 * self.mesh.1 * self.mesh.2
    }

    /// The flags both commands share.
    fn common(&self) -> Vec<String> {
        let (d, u, r) = self.mesh;
        let mut v: Vec<String> = [
            "--model",
            self.model,
            "--attn",
            self.strategy.name(),
            "--seq",
            &self.seq.to_string(),
            "--data-parallel",
            &d.to_string(),
            "--ulysses",
            &u.to_string(),
            "--ring",
            &r.to_string(),
            "--host-mem",
            &self.host_mem_gib.to_string(),
        ]
        .map(String::from)
        .to_vec();
        v.extend(self.policy.iter().map(|s| s.to_string()));
        v
    }

    /// What `upipe train` with these flags resolves on GPUs of
    /// `gpu_mem_gib` (a node of `world` GPUs).
    fn train_request(&self) -> RunRequest {
        let mut argv = self.common();
        argv.extend(["--device", "cuda"].map(String::from));
        let a: TrainArgs = parse(&argv);
        let c = a.validate().unwrap();
        let (d, u, r) = self.mesh;
        let flags = MeshFlags {
            data: Some(d),
            ulysses: Some(u),
            ring: Some(r),
        };
        let mesh = resolve_mesh(flags, c.strategy, &c.model, a.seq, None, Some(self.world()));
        let cfg = train_config(&a, &c, mesh);
        cfg.plan().unwrap();
        let memory = (self.gpu_mem_gib * GIB as f64) as usize;
        let device = DeviceKind::cuda_with(c.kernel);
        let budget = RankBudget {
            memory: Some(memory),
            ledger: Some(device.ledger_budget(memory)),
            host: Some(host_share(self.host_mem_gib * GIB, self.world())),
        };
        run_request(&a, &cfg, c.fsdp, device, budget)
    }

    /// What `upipe plan` with these flags predicts at `seq`.
    fn plan_request(&self) -> RunRequest {
        let mut argv = self.common();
        let more = [
            "--gpus",
            &self.world().to_string(),
            "--gpu-mem",
            &self.gpu_mem_gib.to_string(),
        ];
        argv.extend(more.map(String::from));
        let a: PlanArgs = parse(&argv);
        plan_request(a, self.strategy, self.seq).unwrap()
    }
}

/// Both commands' requests resolve alike; what they decided.
fn check(case: &Case) -> Decisions {
    let what = format!(
        "{} {} mesh {:?} seq {} {:?}",
        case.model, case.strategy, case.mesh, case.seq, case.policy
    );
    let train = resolve_run(&case.train_request(), Depth::Run).unwrap();
    let plan = resolve_run(&case.plan_request(), Depth::Run).unwrap();
    assert_eq!(train.decisions, plan.decisions, "{what}");
    assert_eq!(train.prediction, plan.prediction, "{what}");
    assert_eq!(train.spec.fsdp_replicas, plan.spec.fsdp_replicas, "{what}");
    plan.decisions
}

const POLICIES: &[&[&str]] = &[
    // the defaults of both: fsdp auto, save-attention auto, chunk-heads auto
    &[],
    &["--checkpoint"],
    &[
        "--checkpoint",
        "--tiled-mlp",
        "--offload=auto",
        "--offload-optimizer=auto",
    ],
    &["--checkpoint", "--save-attention", "1", "--fsdp", "on"],
    &[
        "--fsdp",
        "off",
        "--offload-optimizer=2",
        "--chunk-heads",
        "auto",
    ],
];

#[test]
fn plan_resolves_what_train_resolves_on_the_tiny_model() {
    for strategy in [Strategy::Upipe, Strategy::Ulysses] {
        for mesh in [(1, 2, 2), (2, 2, 1)] {
            for seq in [256, 4096] {
                for policy in POLICIES {
                    // little memory, so that every `auto` has to choose
                    let case = Case {
                        model: "tiny",
                        strategy,
                        mesh,
                        seq,
                        gpu_mem_gib: 1.53,
                        host_mem_gib: 1,
                        policy,
                    };
                    check(&case);
                }
            }
        }
    }
}

#[test]
fn plan_resolves_what_train_resolves_on_llama_models() {
    let mut decided = Vec::new();
    for model in ["llama3.2-1b", "llama3-8b"] {
        for mesh in [(1, 8, 1), (1, 2, 2)] {
            for policy in POLICIES {
                let case = Case {
                    model,
                    strategy: Strategy::Upipe,
                    mesh,
                    seq: 131072,
                    gpu_mem_gib: 80.0,
                    host_mem_gib: 256,
                    policy,
                };
                decided.push(check(&case));
            }
        }
    }
    // the cases make the `auto`s choose differently
    assert!(decided.iter().any(|d| d.fsdp) && decided.iter().any(|d| !d.fsdp));
    assert!(decided.iter().any(|d| d.chunk_heads.is_some()));
    assert!(decided.iter().any(|d| d.policy.save_attention > 0));
}

/// `--optim-state auto` takes the first training state of the ladder whose
/// resolved step fits (each state resolved alone says which), the last
/// where none does; `plan` resolves the same. The memories make it take
/// each of the three.
#[test]
fn optim_state_auto_takes_the_most_exact_state_that_fits() {
    let ladder = StateFormat::AUTO_LADDER;
    let mut taken = Vec::new();
    for gpu_mem_gib in [40.0, 24.0, 20.0, 12.0] {
        let case = Case {
            model: "llama3.2-1b",
            strategy: Strategy::Upipe,
            mesh: (1, 1, 1),
            seq: 32768,
            gpu_mem_gib,
            host_mem_gib: 16,
            policy: &["--checkpoint", "--tiled-mlp", "--optim-state", "auto"],
        };
        let req = case.train_request();
        assert!(req.state_auto);
        let fitting = ladder.iter().position(|&state| {
            let alone = RunRequest {
                state,
                state_auto: false,
                ..req.clone()
            };
            let run = resolve_run(&alone, Depth::Run).unwrap();
            req.budget.fits(&run.prediction, true)
        });
        let auto = resolve_run(&req, Depth::Run).unwrap();
        let want = ladder[fitting.unwrap_or(ladder.len() - 1)];
        assert_eq!(auto.spec.state, want, "{gpu_mem_gib} GiB");
        assert!(
            auto.notes[0].starts_with(&format!("--optim-state auto: {want}")),
            "{:?}",
            auto.notes
        );
        check(&case);
        taken.push(fitting);
    }
    assert_eq!(taken, [Some(0), Some(1), Some(2), None]);
}

/// `--optim-state auto` chooses the master weights and the gradients'
/// dtype too, so either given beside it is refused naming the fix.
#[test]
fn optim_state_auto_refuses_a_given_master_or_gradient_dtype() {
    for (flag, value) in [("--master-weights", "none"), ("--grad-dtype", "bf16")] {
        let argv: Vec<String> = ["--model", "tiny", "--optim-state", "auto", flag, value]
            .map(String::from)
            .to_vec();
        let a: TrainArgs = parse(&argv);
        let Err(e) = a.validate() else {
            panic!("{flag} {value} beside --optim-state auto was accepted")
        };
        let e = e.to_string();
        assert!(
            e.contains("--optim-state auto chooses") && e.contains(flag),
            "{e}"
        );
    }
}

/// Under an FP8 attention backward, a run whose calls would give cuDNN
/// more than 28 grouped query heads at once (run at half BF16's speed)
/// says so before it starts: a strategy without head stages (one call of
/// all of a rank's heads) and a fixed `--chunk-heads` too wide; UPipe's
/// `auto` keeps its stages under it, and BF16 attention is never slow.
#[test]
fn a_slow_fp8_attention_backward_is_named_before_the_run() {
    let notes = |strategy, precision, extra: &[&str]| {
        let mut policy = vec![
            "--device",
            "cuda",
            "--precision",
            precision,
            "--checkpoint",
            "--tiled-mlp",
            "--optim-state",
            "8bit",
            "--master-weights",
            "none",
            "--grad-dtype",
            "bf16",
            "--offload-optimizer",
            "all",
        ];
        policy.extend(extra);
        let case = Case {
            model: "llama3-8b",
            strategy,
            mesh: (1, 1, 1),
            seq: 16384,
            gpu_mem_gib: 79.18,
            host_mem_gib: 108,
            policy: &policy,
        };
        resolve_run(&case.plan_request(), Depth::Run).unwrap().notes
    };
    let slow = |notes: &[String], start: &str| {
        notes
            .iter()
            .any(|n| n.starts_with(start) && n.contains("half BF16's speed"))
    };
    let local = notes(Strategy::Local, "fp8-attention-bwd", &[]);
    assert!(slow(&local, "--attn local: "), "{local:?}");
    let wide = notes(Strategy::Upipe, "fp8-attention", &["--chunk-heads", "32"]);
    assert!(slow(&wide, "--chunk-heads 32: "), "{wide:?}");
    let auto = notes(Strategy::Upipe, "fp8-attention-bwd", &[]);
    assert!(
        auto.iter()
            .any(|n| n.starts_with("--chunk-heads auto: stages of 16 ")),
        "{auto:?}"
    );
    for (strategy, extra) in [
        (Strategy::Local, &[][..]),
        (Strategy::Upipe, &["--chunk-heads", "32"]),
    ] {
        let bf16 = notes(strategy, "fp8", extra);
        assert!(
            !bf16.iter().any(|n| n.contains("half BF16's speed")),
            "{bf16:?}"
        );
    }
}

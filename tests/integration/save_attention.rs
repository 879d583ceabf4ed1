//! `--save-attention`: checkpointed blocks that keep their attention output
//! and LSEs skip the attention recompute with the same arithmetic, so every
//! setting trains bit-identically to `none`; `auto` keeps what fits; bad
//! combinations are errors naming the fix.

use std::collections::BTreeMap;
use std::sync::Arc;
use upipe::attention::trial::rel_err;
use upipe::attention::{CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::{Backend, Tensor};
use upipe::comm::local::run_ranks;
use upipe::model::decoder::attn_dims;
use upipe::model::{
    BlockWeights, Decoder, HeadView, MemoryPolicy, ModelConfig, ModelWeights, ParamStore, Unit,
};
use upipe::optim::AdamWConfig;
use upipe::plan::preflight::{self, RankMemory};
use upipe::plan::{
    DeviceKind, SaveAttention, StepSpec, predict_step, resolve_plan, save_attention_auto,
};
use upipe::rng::Rng;
use upipe::train::replicated::ReplicatedStore;
use upipe::train::trainer::{TrainConfig, loss_and_grads_cpu, train_cpu};

use crate::common;

/// The tiny model with 8 heads (2 kv heads) and 3 blocks.
/// The shared tiny model with three blocks.
fn tiny(qk_norm: bool) -> ModelConfig {
    let mut c = common::tiny(qk_norm);
    c.layers = 3;
    c.validate().unwrap();
    c
}

fn checkpointed(tiled_mlp: bool, save_attention: usize) -> MemoryPolicy {
    MemoryPolicy {
        checkpoint: true,
        tiled_mlp,
        save_attention,
        ..Default::default()
    }
}

/// (strategy, Pu, Pr, U) of the meshes compared.
const MESHES: [(Strategy, usize, usize, Option<usize>); 4] = [
    (Strategy::Upipe, 2, 2, Some(2)),
    (Strategy::Ulysses, 4, 1, None),
    (Strategy::Ring, 1, 4, None),
    (Strategy::Local, 1, 1, None),
];

type LossGrads = (f64, BTreeMap<String, Vec<f32>>);

fn one_step(
    cfg: &ModelConfig,
    mesh: (Strategy, usize, usize, Option<usize>),
    p: MemoryPolicy,
) -> LossGrads {
    let (s, pu, pr, u) = mesh;
    let seq = 256; // 64 tokens per rank on 4 ranks: 2 MLP tiles of `hidden` rows
    let plan = CpPlan::new(s, &attn_dims(cfg), seq, pu, pr, u).unwrap();
    let mut rng = Rng::new(11);
    let t: Vec<u32> = (0..=seq)
        .map(|_| rng.below(cfg.vocab as u64) as u32)
        .collect();
    let init = |b: &CpuBackend| ModelWeights::random(b, cfg, 5);
    loss_and_grads_cpu(cfg, &plan, p, &t[..seq], &t[1..], &init).unwrap()
}

#[test]
fn every_setting_gives_the_gradients_of_no_saved_attention_exactly() {
    let cfg = tiny(true);
    for mesh in MESHES {
        for tiled in [false, true] {
            let none = one_step(&cfg, mesh, checkpointed(tiled, 0));
            // no checkpointing: the recompute is the forward's arithmetic again
            let plain = one_step(
                &cfg,
                mesh,
                MemoryPolicy {
                    tiled_mlp: tiled,
                    ..Default::default()
                },
            );
            let what = format!("{mesh:?} tiled MLP {tiled}");
            assert_eq!(none, plain, "{what}: checkpointing against none");
            for save in 1..=cfg.layers {
                let got = one_step(&cfg, mesh, checkpointed(tiled, save));
                assert_eq!(got.0, none.0, "{what}: loss, {save} blocks saved");
                for (name, g) in &none.1 {
                    assert!(got.1[name] == *g, "{what}: {name}, {save} blocks saved");
                }
            }
        }
        // tiling changes the order of the MLP's sums only
        let untiled = one_step(&cfg, mesh, checkpointed(false, 1));
        let tiled = one_step(&cfg, mesh, checkpointed(true, 1));
        assert!(((tiled.0 - untiled.0) / untiled.0).abs() <= 1e-6);
        for (name, g) in &untiled.1 {
            let e = rel_err(&tiled.1[name], g);
            assert!(e <= 1e-6, "{mesh:?}: tiled {name} rel err {e:e}");
        }
    }
}

/// The weights a run saved, as bytes.
fn saved_weights(dir: &std::path::Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors")).unwrap()
}

#[test]
fn training_is_bit_identical_under_every_setting() {
    let mut rng = Rng::new(2);
    let tokens: Arc<[u32]> = (0..4096).map(|_| rng.below(256) as u32).collect();
    let base = std::env::temp_dir().join(format!("upipe-save-attn-{}", std::process::id()));
    for (i, ((s, pu, pr, u), fsdp)) in [
        (MESHES[0], false),
        (MESHES[0], true),
        (MESHES[1], false),
        (MESHES[2], true),
    ]
    .into_iter()
    .enumerate()
    {
        let model = tiny(true);
        let run = |policy: MemoryPolicy| {
            let dir = base.join(format!(
                "{i}-{}-{}",
                policy.tiled_mlp, policy.save_attention
            ));
            let cfg = TrainConfig {
                strategy: s,
                ulysses: pu,
                ring: pr,
                chunk_heads: u,
                policy,
                fsdp,
                save_dir: Some(dir.clone()),
                ..TrainConfig::new(
                    model.clone(),
                    256,
                    3,
                    AdamWConfig::schedule(3e-3, 3e-4, 1, 3),
                )
            };
            let summary = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap();
            let steps: Vec<(f64, f64)> = summary
                .reports
                .iter()
                .map(|r| (r.loss, r.grad_norm))
                .collect();
            (steps, saved_weights(&dir))
        };
        for tiled in [false, true] {
            let none = run(checkpointed(tiled, 0));
            assert_eq!(none.0.len(), 3);
            for save in [1, model.layers] {
                let got = run(checkpointed(tiled, save));
                let what = format!("{s} {pu}x{pr} fsdp {fsdp} tiled {tiled}: {save} saved");
                assert_eq!(got.0, none.0, "{what}: losses and gradient norms");
                assert!(got.1 == none.1, "{what}: parameters after 3 steps");
            }
        }
    }
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn bad_settings_are_errors_naming_the_fix() {
    let parse = |s: &str| s.parse::<SaveAttention>();
    assert_eq!(parse("auto").unwrap(), SaveAttention::Auto);
    assert_eq!(parse("all").unwrap(), SaveAttention::All);
    assert_eq!(parse("none").unwrap(), SaveAttention::Blocks(0));
    assert_eq!(parse("3").unwrap(), SaveAttention::Blocks(3));
    let e = parse("half").unwrap_err().to_string();
    assert!(e.contains("none, all, a number of blocks, or auto"), "{e}");

    let model = tiny(false);
    let (plan, data) =
        resolve_plan(Strategy::Upipe, &attn_dims(&model), 64, 2, None, None, None).unwrap();
    let spec = |policy| StepSpec {
        model: model.clone(),
        plan: plan.clone(),
        data,
        policy,
        fsdp: false,
        fsdp_replicas: 1,
        grad_accum: 1,
        device: DeviceKind::Cpu,
        optimizer: true,
        state: Default::default(),
        precision: Default::default(),
        freeze: Default::default(),
        lora: None,
    };
    let plain = spec(MemoryPolicy::default());
    // without checkpointing auto and none do nothing, the rest name --checkpoint
    assert_eq!(
        SaveAttention::Auto.resolve(&plain, Some(1 << 40)).unwrap(),
        0
    );
    assert_eq!(SaveAttention::Blocks(0).resolve(&plain, None).unwrap(), 0);
    for given in [SaveAttention::All, SaveAttention::Blocks(1)] {
        let e = given.resolve(&plain, None).unwrap_err().to_string();
        assert!(
            e.contains(&format!("--save-attention {given} ")) && e.contains("add --checkpoint"),
            "{e}"
        );
    }
    let ckpt = spec(checkpointed(false, 0));
    assert_eq!(SaveAttention::All.resolve(&ckpt, None).unwrap(), 3);
    assert_eq!(
        SaveAttention::Auto.resolve(&ckpt, None).unwrap(),
        0,
        "unknown budget"
    );
    let e = SaveAttention::Blocks(4)
        .resolve(&ckpt, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the model has 3 blocks; use at most 3 (or all)"),
        "{e}"
    );
    // the planner and the engine refuse the same policies
    let e = predict_step(&spec(checkpointed(false, 4)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("the model has 3 blocks"), "{e}");
    let cfg = TrainConfig {
        policy: MemoryPolicy {
            save_attention: 1,
            ..Default::default()
        },
        ..TrainConfig::new(model, 64, 1, AdamWConfig::schedule(3e-3, 3e-4, 1, 1))
    };
    let e = cfg.plan().unwrap_err().to_string();
    assert!(e.contains("add --checkpoint"), "{e}");
}

/// What `auto` keeps for the Llama 3.2 1B architecture on one H200.
#[test]
fn auto_keeps_the_most_blocks_that_fit() {
    let model = ModelConfig::resolve("llama3.2-1b").unwrap();
    let layers = model.layers;
    let spec = |seq: usize, tiled_mlp: bool| {
        let (plan, data) = resolve_plan(
            Strategy::Upipe,
            &attn_dims(&model),
            seq,
            1,
            Some(1),
            Some(1),
            None,
        )
        .unwrap();
        StepSpec {
            model: model.clone(),
            plan,
            data,
            policy: checkpointed(tiled_mlp, 0),
            fsdp: false,
            fsdp_replicas: 1,
            grad_accum: 1,
            device: DeviceKind::CUDA,
            optimizer: true,
            state: Default::default(),
            precision: Default::default(),
            freeze: Default::default(),
            lora: None,
        }
    };
    let peak = |s: &StepSpec, n: usize| {
        let mut s = s.clone();
        s.policy.save_attention = n;
        predict_step(&s).unwrap().peak
    };
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let h200 = DeviceKind::CUDA.ledger_budget(139 << 30);
    for seq in [32768, 131072, 262144, 524288, 589824] {
        let s = spec(seq, false);
        let n = save_attention_auto(&s, h200).unwrap();
        eprintln!(
            "llama3.2-1b seq {seq} on 139 GiB: auto keeps {n}/{layers} (peak {:.2} GiB; none {:.2} GiB, all {:.2} GiB)",
            gib(peak(&s, n)),
            gib(peak(&s, 0)),
            gib(peak(&s, layers))
        );
        assert!(peak(&s, n) <= h200);
        assert!(
            n == layers || peak(&s, n + 1) > h200,
            "seq {seq}: {n} is not the most"
        );
    }
    // an explicit `all` that does not fit is refused before anything is
    // allocated, naming auto
    let mut s = spec(589824, false);
    s.policy.save_attention = layers;
    let pred = predict_step(&s).unwrap();
    let mem = RankMemory {
        device: h200,
        host: None,
    };
    let e = preflight::check(&s, &pred, mem).unwrap_err().to_string();
    assert!(e.contains("Adding --save-attention auto fits"), "{e}");
    s.policy.save_attention = save_attention_auto(&s, h200).unwrap();
    preflight::check(&s, &predict_step(&s).unwrap(), mem).unwrap();

    let s = spec(131072, true);
    let (none, all) = (peak(&s, 0), peak(&s, layers));
    assert!(none < all, "kept outputs cost memory");
    // every block costs the same: a budget between the ends keeps some
    let mid = none + (all - none) / 2;
    let n = save_attention_auto(&s, mid).unwrap();
    assert!(0 < n && n < layers, "{n}");
    assert!(peak(&s, n) <= mid && peak(&s, n + 1) > mid);
    assert_eq!(save_attention_auto(&s, all).unwrap(), layers);
    assert_eq!(
        save_attention_auto(&s, none - 1).unwrap(),
        0,
        "nothing fits: none"
    );
    let more = save_attention_auto(&s, mid + (all - mid) / 2).unwrap();
    assert!(more >= n, "a larger budget keeps at least as many");

    // with the backward stopping above the lowest blocks, auto counts only
    // the blocks whose backward runs: at most those from the floor up
    let mut s = spec(131072, true);
    s.freeze = upipe::model::Freeze::parse("embeddings,blocks:0-9").unwrap();
    let floor = s.backward_floor();
    assert_eq!(floor, 10);
    assert_eq!(save_attention_auto(&s, usize::MAX).unwrap(), layers - floor);
    let all = peak(&s, layers);
    assert_eq!(
        peak(&s, layers - floor),
        all,
        "the blocks below keep nothing"
    );
    let n = save_attention_auto(&s, all - 1).unwrap();
    assert!(n < layers - floor && peak(&s, n) < all, "{n}");
}

/// A parameter store that measures each block's backward recompute: the
/// ledger's high-water mark between the block's backward `acquire` and its
/// `block_grads`, above the bytes allocated when it began.
struct Windows<'a> {
    inner: ReplicatedStore<'a, CpuBackend>,
    acquired: Vec<usize>,
    start: usize,
    windows: BTreeMap<usize, usize>,
}

impl ParamStore<CpuBackend> for Windows<'_> {
    fn acquire(&mut self, b: &CpuBackend, unit: Unit) -> upipe::Result<()> {
        self.inner.acquire(b, unit)?;
        if let Unit::Block(l) = unit {
            self.acquired[l] += 1;
            if self.acquired[l] == 2 {
                self.start = b.ledger().current();
                b.ledger().reset_peak();
            }
        }
        Ok(())
    }
    fn release(&mut self, unit: Unit) -> upipe::Result<()> {
        self.inner.release(unit)
    }
    fn embed(&self) -> upipe::Result<&Tensor<CpuBackend>> {
        self.inner.embed()
    }
    fn block(&self, l: usize) -> upipe::Result<&BlockWeights<CpuBackend>> {
        self.inner.block(l)
    }
    fn final_norm(&self) -> upipe::Result<&Tensor<CpuBackend>> {
        self.inner.final_norm()
    }
    fn head(&self) -> upipe::Result<&Tensor<CpuBackend>> {
        self.inner.head()
    }
    fn block_grads(
        &mut self,
        b: &CpuBackend,
        l: usize,
    ) -> upipe::Result<(
        &BlockWeights<CpuBackend>,
        &mut upipe::model::BlockGrads<CpuBackend>,
    )> {
        self.windows.insert(l, b.ledger().peak() - self.start);
        self.inner.block_grads(b, l)
    }
    fn head_grads(&mut self, b: &CpuBackend) -> upipe::Result<HeadView<'_, CpuBackend>> {
        self.inner.head_grads(b)
    }
    fn embed_grads(&mut self, b: &CpuBackend) -> upipe::Result<Option<&mut Tensor<CpuBackend>>> {
        self.inner.embed_grads(b)
    }
    fn grads_done(&mut self, b: &CpuBackend, unit: Unit) -> upipe::Result<()> {
        self.inner.grads_done(b, unit)
    }
    fn finish(&mut self, b: &CpuBackend) -> upipe::Result<()> {
        self.inner.finish(b)
    }
}

/// Rank 0's recompute high-water per block (see [`Windows`]).
fn recompute_windows(
    cfg: &ModelConfig,
    mesh: (Strategy, usize, usize, Option<usize>),
    policy: MemoryPolicy,
    seq: usize,
) -> BTreeMap<usize, usize> {
    let (s, pu, pr, u) = mesh;
    let plan = CpPlan::new(s, &attn_dims(cfg), seq, pu, pr, u).unwrap();
    let mut rng = Rng::new(3);
    let t: Vec<u32> = (0..=seq)
        .map(|_| rng.below(cfg.vocab as u64) as u32)
        .collect();
    let out = run_ranks(plan.mesh_shape(), CpuBackend::new, |_, b, mesh| {
        let b = b.as_ref();
        let decoder = Decoder::new(b, cfg.clone(), plan.clone(), &mesh, policy)?;
        let w = ModelWeights::random(b, cfg, 5)?;
        let mut store = Windows {
            inner: ReplicatedStore::new(b, cfg, w, mesh.world.as_ref())?,
            acquired: vec![0; cfg.layers],
            start: 0,
            windows: BTreeMap::new(),
        };
        let pos = plan
            .layout
            .rank_positions(mesh.ring.rank(), mesh.ulysses.rank());
        let ids: Vec<u32> = pos.iter().map(|&p| t[p]).collect();
        let tg: Vec<u32> = pos.iter().map(|&p| t[p + 1]).collect();
        decoder.forward_backward(b, &mesh, &mut store, &ids, &tg, 1.0 / seq as f32)?;
        Ok(store.windows)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// A block that kept its attention state recomputes `a = RMSNorm(h)`,
/// `y = O·Woᵀ` and `h1 = h + y` only (and, untiled, the MLP's intermediates
/// for its backward): no attention forward, no block output, and under a
/// tiled MLP no tile's forward before the tiled backward runs it.
#[test]
fn a_saved_block_recomputes_only_its_output_projection_and_residual() {
    let cfg = tiny(true);
    let layers = cfg.layers;
    let seq = 256;
    for mesh in [MESHES[0], MESHES[3]] {
        let ranks = mesh.1 * mesh.2;
        let io = seq / ranks * cfg.hidden * 4; // one f32 [s, hidden]
        let ffn = seq / ranks * cfg.ffn * 4;
        for tiled in [true, false] {
            let w = recompute_windows(&cfg, mesh, checkpointed(tiled, 1), seq);
            let saved = &w[&(layers - 1)];
            // a, y, h1 (y freed before the MLP); untiled: m, gate, up, act
            let want = if tiled { 3 * io } else { 3 * io + 3 * ffn };
            assert_eq!(
                *saved, want,
                "{mesh:?} tiled {tiled}: the saved block's recompute"
            );
            for l in 0..layers - 1 {
                assert!(
                    w[&l] > want,
                    "{mesh:?} tiled {tiled}: block {l} runs its attention forward again ({} B)",
                    w[&l]
                );
            }
        }
    }
}

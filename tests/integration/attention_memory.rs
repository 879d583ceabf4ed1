//! UPipe's activation memory, measured by the allocator ledger against
//! Ulysses on the same layer and ranks (DESIGN.md §1, §5).

use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{TrialInputs, run_trial};
use upipe::attention::{AttnDims, CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;

fn act_bytes(heads: usize, kv_heads: usize, strategy: Strategy, chunk: Option<usize>) -> usize {
    let d = AttnDims {
        hidden: 64,
        heads,
        kv_heads,
        head_dim: 16,
        qk_norm: false,
        norm: upipe::backend::RmsNorm::plain(1e-6),
        rope: RopeConfig {
            theta: 10000.0,
            scaling: None,
        },
        softmax_scale: AttnDims::default_softmax_scale(16),
        precision: upipe::backend::fp8::Precision::Bf16,
    };
    let seq = 128;
    let inputs = TrialInputs::random(&d, seq, 5);
    let plan = CpPlan::new(strategy, &d, seq, 8, 1, chunk).unwrap();
    run_trial(&plan, &d, &inputs, CpuBackend::new)
        .unwrap()
        .act_bytes
}

/// Returns (Ulysses, UPipe at U = H, 2C, C) activation bytes for C = 8.
fn ladder(heads: usize, kv_heads: usize) -> [usize; 4] {
    [
        act_bytes(heads, kv_heads, Strategy::Ulysses, None),
        act_bytes(heads, kv_heads, Strategy::Upipe, Some(heads)),
        act_bytes(heads, kv_heads, Strategy::Upipe, Some(16)),
        act_bytes(heads, kv_heads, Strategy::Upipe, Some(8)),
    ]
}

fn check_ladder(heads: usize, kv_heads: usize, max_ratio: f64) {
    let [uly, u_h, u_2c, u_c] = ladder(heads, kv_heads);
    assert_eq!(uly, u_h, "UPipe with U = H is Ulysses");
    assert!(
        u_2c < u_h && u_c < u_2c,
        "activation bytes fall as U goes H -> 2C -> C: {u_h} {u_2c} {u_c}"
    );
    let ratio = u_c as f64 / uly as f64;
    assert!(
        ratio <= max_ratio,
        "UPipe(U=C) / Ulysses = {ratio:.3} > {max_ratio}"
    );
}

#[test]
fn llama3_8b_layout_upipe_at_most_half_of_ulysses() {
    check_ladder(32, 8, 0.50);
}

#[test]
fn qwen3_32b_layout_upipe_at_most_35_percent_of_ulysses() {
    check_ladder(64, 8, 0.35);
}

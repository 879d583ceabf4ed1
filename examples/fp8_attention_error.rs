//! What FP8 attention's roundings cost, on the CPU: the emulation of
//! `--precision fp8-attention` (`backend::fp8::attention::emulate`) against
//! exact f32 attention, by sequence length, under the bound-based scales
//! the device sets and under ideal ones (each output's scale from its own
//! amax, known only after the call), and of `fp8-attention-bwd` (the
//! backward alone in FP8). Relative L2 error of O, dQ, dK, dV, and each
//! output's amax as a fraction of its bound.
//!
//! `cargo run --release --example fp8_attention_error [-- S,S,...]`
//! (default 1024,4096; head dim 128, 2 query heads over 1 kv head, causal).

use upipe::backend::fp8::Fp8Passes;
use upipe::backend::fp8::attention::{
    AttnOutputs, AttnProblem, device_scales, emulate_passes, exact, pow2_scale,
};

mod support;

use support::{Rng, rel_l2};

/// `n` uniform values in (-amp, amp) from `seed`.
fn uniform(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    Rng(seed | 1).vec(n, amp)
}

fn amax(x: &[f32]) -> f32 {
    upipe::backend::fp8::amax(x.iter().copied())
}

fn errors(got: &AttnOutputs, want: &AttnOutputs) -> [f32; 4] {
    [
        rel_l2(&got.o, &want.o),
        rel_l2(&got.dq, &want.dq),
        rel_l2(&got.dk, &want.dk),
        rel_l2(&got.dv, &want.dv),
    ]
}

fn main() {
    let lens: Vec<usize> = std::env::args()
        .nth(1)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![1024, 4096]);
    let (hq, hkv, d) = (2, 1, 128);
    println!("| S | scales | err O | err dQ | err dK | err dV | amax/bound O | dQ | dK | dV |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for s in lens {
        let q = uniform(s * hq * d, 1, 2.0);
        let k = uniform(s * hkv * d, 2, 2.0);
        let v = uniform(s * hkv * d, 3, 1.0);
        let d_o = uniform(s * hq * d, 4, 1e-3);
        let p = AttnProblem {
            q: &q,
            k: &k,
            v: &v,
            d_o: &d_o,
            s,
            hq,
            hkv,
            d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let want = exact(&p);
        let bounds = device_scales(&p);
        let ratio = [
            amax(&want.o) / bounds.bound_o,
            amax(&want.dq) / bounds.bound_dq,
            amax(&want.dk) / bounds.bound_dk,
            amax(&want.dv) / bounds.bound_dv,
        ];
        let (e4, e5) = (448.0, 57344.0);
        let ideal = upipe::backend::fp8::attention::AttnScales {
            o: pow2_scale(amax(&want.o), e4),
            dq: pow2_scale(amax(&want.dq), e5),
            dk: pow2_scale(amax(&want.dk), e5),
            dv: pow2_scale(amax(&want.dv), e5),
            ..bounds
        };
        let both = Fp8Passes {
            forward: true,
            backward: true,
        };
        let bwd = Fp8Passes {
            forward: false,
            ..both
        };
        for (name, f, passes) in [
            ("bounds", &bounds, both),
            ("ideal", &ideal, both),
            ("bounds, backward only", &bounds, bwd),
        ] {
            let e = errors(&emulate_passes(&p, f, passes), &want);
            println!(
                "| {s} | {name} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.1e} | {:.1e} | {:.1e} | {:.1e} |",
                e[0], e[1], e[2], e[3], ratio[0], ratio[1], ratio[2], ratio[3]
            );
        }
    }
}

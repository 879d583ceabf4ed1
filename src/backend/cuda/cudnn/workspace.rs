//! The kept cuDNN workspace of one call: cuDNN's own plan workspace, then
//! what the graphs keep there (the backward's dQ accumulator and softmax
//! sums; a ragged call's dK and dV per query head with GQA, and its
//! tables), each 256-byte aligned. The engine lays a call out by these
//! offsets and the planner walks the same sizes.

use super::ragged;
use super::sdpa_graph::{self, SdpaShape};

/// `x` rounded up to 256 bytes.
pub(super) fn align(x: usize) -> usize {
    x.div_ceil(256) * 256
}

/// Byte offsets in the workspace of a backward of `s`: the dQ accumulator,
/// the softmax sums, dK and dV per query head (ragged GQA) and the ragged
/// tables, after cuDNN's own `plan_workspace`; then the end.
pub(super) fn bwd_layout(s: &SdpaShape, plan_workspace: usize) -> [usize; 6] {
    let (acc_bytes, sum_bytes) = sdpa_graph::backward_scratch_bytes(s);
    let full = align(sdpa_graph::backward_full_head_bytes(s));
    let acc = align(plan_workspace);
    let sum = acc + align(acc_bytes);
    let dk_full = sum + align(sum_bytes);
    let tables = dk_full + 2 * full;
    [
        acc,
        sum,
        dk_full,
        dk_full + full,
        tables,
        tables + table_bytes(s),
    ]
}

/// Bytes of a ragged call's tables' region (0 for the others).
fn table_bytes(s: &SdpaShape) -> usize {
    s.ragged.map_or(0, |_| ragged::table_bytes(s.sq))
}

/// Bytes of the workspace a backward of `s` needs (cuDNN's own
/// `plan_workspace`, then our dQ accumulator and softmax sums; for a
/// ragged call with GQA dK and dV per query head, and for any ragged call
/// its tables). The workspace is kept between calls and grown to the
/// largest need.
pub fn bwd_workspace_bytes(s: &SdpaShape, plan_workspace: usize) -> usize {
    bwd_layout(s, plan_workspace)[5]
}

/// Bytes of the workspace a forward of `s` needs: cuDNN's own (at least
/// [`FWD_PLAN_RESERVE`] for one document), then a ragged call's tables.
pub fn fwd_workspace_bytes(s: &SdpaShape, plan_workspace: usize) -> usize {
    match s.ragged {
        None => plan_workspace.max(FWD_PLAN_RESERVE),
        Some(_) => align(plan_workspace) + table_bytes(s),
    }
}

/// The room a one-document forward keeps for cuDNN's own plan workspace,
/// whatever the plan asks below it: cuDNN 9.14's forward plans need none
/// where the keys are a multiple of 128 and a few hundred bytes otherwise
/// (252 at 8,000 keys, 32 query and 8 kv heads of 64; H200, 2026-12-04),
/// which the planner, running without a GPU, cannot know. Engine and
/// planner both keep this much; a plan needing more grows the workspace
/// past the plan.
pub const FWD_PLAN_RESERVE: usize = 4 << 10;

/// cuDNN's own backward plan workspace for `s` as measured on cuDNN 9.14
/// (H200, 2026-11-30, exact to the byte on three shapes): with GQA inside
/// the call (`hq > hkv`) it expands dK/dV to every query head in f32
/// (`sk·hq·d·4`), plus under 256 bytes. Only a built plan knows the real
/// figure; the memory planner, which runs without a GPU, uses this.
pub fn estimated_bwd_plan_workspace(s: &SdpaShape) -> usize {
    // a ragged call keeps dK, dV per query head in our workspace instead
    // (`sdpa_graph::backward_full_head_bytes`; not yet measured on a GPU)
    if s.ragged.is_some() {
        return RAGGED_PLAN_RESERVE;
    }
    let gqa_expansion = if s.hq > s.hkv {
        s.sk * s.hq * s.d * 4
    } else {
        0
    };
    gqa_expansion + 256
}

/// cuDNN's plan workspace of an FP8 backward (`sdpa_fp8`), as the
/// planner estimates it: an f32 dQ accumulator and softmax sums (the FP8
/// graph keeps them inside the plan), with GQA dK and dV per query head
/// in f32, and 256 bytes. Measured with GQA on cuDNN 9.14 (H100,
/// 2026-12-07: 4K and 32K, 32:8 and 28:4 heads, to the byte).
pub fn estimated_fp8_bwd_plan_workspace(s: &SdpaShape) -> usize {
    let per_head = if s.hq > s.hkv {
        2 * s.sk * s.hq * s.d * 4
    } else {
        0
    };
    s.sq * s.hq * s.d * 4 + s.sq * s.hq * 4 + per_head + 256
}

/// The room a ragged call (several documents) reserves for cuDNN's own
/// plan workspace, whatever the plan asks: its size varies with the
/// number of documents (1,280 to 2,944 bytes measured on cuDNN 9.14, H200,
/// 2026-12-04, for 2 to 4 documents), which the planner cannot know, so
/// both reserve this instead and the engine refuses a plan that needs more.
pub const RAGGED_PLAN_RESERVE: usize = 64 << 10;

/// cuDNN's own part of a call's workspace, as the engine lays it out and
/// the planner walks it: the plan's `plan_workspace` for one document,
/// [`RAGGED_PLAN_RESERVE`] for a ragged call (an error if its plan needs
/// more).
pub fn own_workspace(s: &SdpaShape, plan_workspace: usize) -> crate::error::Result<usize> {
    match s.ragged {
        None => Ok(plan_workspace),
        Some(_) if plan_workspace <= RAGGED_PLAN_RESERVE => Ok(RAGGED_PLAN_RESERVE),
        Some(r) => Err(crate::error::Error::Backend(format!(
            "cuDNN's plan for {} documents of up to {} tokens needs {plan_workspace} bytes of \
             workspace, above the {RAGGED_PLAN_RESERVE} a ragged call reserves; use \
             --attn-kernel native for documents",
            r.b, r.s_max
        ))),
    }
}

/// Bytes the kept workspace occupies once grown to `need` bytes.
pub fn kept_workspace_bytes(need: usize) -> usize {
    need.max(1).div_ceil(4) * 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{AttnMask, BoundedMask};

    /// A ragged backward keeps, after the dense call's regions, dK and dV
    /// per query head (GQA only) and the tables' region, all depending on
    /// the call's rows and heads, not on its documents.
    #[test]
    fn a_ragged_call_keeps_its_heads_and_tables_after_the_dense_regions() {
        let (s, hq, hkv, d) = (1338, 8, 2, 64);
        let shape = |starts: &[u32], hkv: usize| {
            let m = AttnMask::Bounded(BoundedMask::documents(starts, s).unwrap());
            super::super::dense_shape(s, s, hq, hkv, d, m)
        };
        let one = super::super::dense_shape(s, s, hq, hkv, d, AttnMask::Causal);
        for starts in [&[0, 1][..], &[0, 1, 38, 338], &[0, 700]] {
            let r = shape(starts, hkv);
            assert!(r.ragged.is_some());
            let full = align(s * hq * d * 4);
            let dense = bwd_workspace_bytes(&one, 256);
            let tables = ragged::table_bytes(s);
            assert_eq!(bwd_workspace_bytes(&r, 256), dense + 2 * full + tables);
            assert_eq!(fwd_workspace_bytes(&r, 0), tables);
            let mha = shape(starts, hq);
            let dense_mha = super::super::dense_shape(s, s, hq, hq, d, AttnMask::Causal);
            assert_eq!(
                bwd_workspace_bytes(&mha, 256),
                bwd_workspace_bytes(&dense_mha, 256) + tables
            );
        }
        // one document: cuDNN's own part at least the forward reserve
        assert_eq!(fwd_workspace_bytes(&one, 0), FWD_PLAN_RESERVE);
        assert_eq!(fwd_workspace_bytes(&one, 252), FWD_PLAN_RESERVE);
        let big = FWD_PLAN_RESERVE + 4;
        assert_eq!(fwd_workspace_bytes(&one, big), big);
        // cuDNN's own part of a ragged call is the fixed reserve, planned and run alike
        let r = shape(&[0, 1], hkv);
        assert_eq!(estimated_bwd_plan_workspace(&r), RAGGED_PLAN_RESERVE);
        assert_eq!(own_workspace(&r, 2944).unwrap(), RAGGED_PLAN_RESERVE);
        assert_eq!(own_workspace(&one, 2944).unwrap(), 2944);
        let e = own_workspace(&r, RAGGED_PLAN_RESERVE + 1).unwrap_err();
        assert!(e.to_string().contains("--attn-kernel native"), "{e}");
    }
}

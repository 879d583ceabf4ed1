//! The operands of one attention call on raw device memory, as every
//! implementation (the flash kernels, the naive kernels, cuDNN) takes them.

use crate::backend::{AttnMask, DType};

/// Operands of one attention forward. Pointers already point at the first row
/// of each view; strides are elements between consecutive token rows.
#[derive(Debug, Clone)]
pub struct AttnFwd {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    /// Dtype of q, k and v.
    pub dt: DType,
    pub o: u64,
    pub o_dt: DType,
    /// f32 `[sq, hq]` (natural log).
    pub lse: u64,
    pub q_rs: usize,
    pub k_rs: usize,
    pub v_rs: usize,
    pub o_rs: usize,
    pub lse_rs: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
    /// The rows' key bounds of a documents mask on the device (`[2·sq]`
    /// int32, `BoundedMask::row_bounds`), or 0.
    pub bounds: u64,
    /// The softmax scale of the scores.
    pub scale: f32,
}

/// Operands of one attention backward; `dq`, `dk`, `dv` are f32 and accumulated.
#[derive(Debug, Clone)]
pub struct AttnBwd {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub dt: DType,
    pub o: u64,
    pub o_dt: DType,
    pub d_o: u64,
    pub d_o_dt: DType,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub q_rs: usize,
    pub k_rs: usize,
    pub v_rs: usize,
    pub o_rs: usize,
    pub d_o_rs: usize,
    pub lse_rs: usize,
    pub dq_rs: usize,
    pub dk_rs: usize,
    pub dv_rs: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
    /// As in [`AttnFwd`].
    pub bounds: u64,
    /// As in [`AttnFwd`].
    pub scale: f32,
}

impl AttnBwd {
    /// The forward whose outputs (`o`, `lse`) this backward differentiates:
    /// the operands both passes read.
    pub fn forward(&self) -> AttnFwd {
        AttnFwd {
            q: self.q,
            k: self.k,
            v: self.v,
            dt: self.dt,
            o: self.o,
            o_dt: self.o_dt,
            lse: self.lse,
            q_rs: self.q_rs,
            k_rs: self.k_rs,
            v_rs: self.v_rs,
            o_rs: self.o_rs,
            lse_rs: self.lse_rs,
            sq: self.sq,
            sk: self.sk,
            hq: self.hq,
            hkv: self.hkv,
            d: self.d,
            mask: self.mask.clone(),
            bounds: self.bounds,
            scale: self.scale,
        }
    }
}

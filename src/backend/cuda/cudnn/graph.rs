//! A small builder of cuDNN operation graphs: tensors (by unique id), the
//! pointwise / reduction / matmul / reshape operations the SDPA patterns use,
//! and the finalized operation graph.

use super::desc::{Attr, Desc, Kind};
use crate::error::Result;
use cudarc::cudnn::sys;

pub use sys::cudnnDataType_t as Dt;
pub use sys::cudnnPointwiseMode_t as Pw;
pub use sys::cudnnReduceTensorOp_t as Red;

/// A tensor of the graph (its descriptor and its unique id).
pub struct T {
    pub uid: i64,
    pub desc: Desc,
}

/// What kind of tensor to declare.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Device memory given in the variant pack.
    Io,
    /// Produced and consumed inside the fused kernel.
    Virtual,
    /// A host scalar given by value in the variant pack.
    ByValue,
}

#[derive(Default)]
pub struct Graph {
    pub tensors: Vec<T>,
    pub ops: Vec<Desc>,
    next_virtual: i64,
}

/// Dense strides of `dims` (last dimension fastest).
pub fn packed(dims: &[i64]) -> Vec<i64> {
    let mut s = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

impl Graph {
    pub fn new() -> Graph {
        Graph {
            next_virtual: 1000,
            ..Default::default()
        }
    }

    /// Declares a tensor; `uid` 0 picks a fresh id (for virtual tensors).
    pub fn tensor(
        &mut self,
        uid: i64,
        dt: Dt,
        dims: &[i64],
        strides: &[i64],
        role: Role,
    ) -> Result<usize> {
        self.tensor_ragged(uid, dt, dims, strides, role, None)
    }

    /// Declares a tensor whose batches start where the int32 `[b + 1]`
    /// tensor `ragged` (declared before) says: its element offsets replace
    /// the batch stride (cuDNN's ragged layout).
    pub fn tensor_ragged(
        &mut self,
        uid: i64,
        dt: Dt,
        dims: &[i64],
        strides: &[i64],
        role: Role,
        ragged: Option<usize>,
    ) -> Result<usize> {
        let uid = if uid == 0 {
            self.next_virtual += 1;
            self.next_virtual
        } else {
            uid
        };
        let d = Desc::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.dtype(Attr::CUDNN_ATTR_TENSOR_DATA_TYPE, dt)?
            .i64s(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, dims)?
            .i64s(Attr::CUDNN_ATTR_TENSOR_STRIDES, strides)?
            .i64(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, uid)?
            .i64(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16)?;
        if role == Role::Virtual {
            d.boolean(Attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL, true)?;
        }
        if role == Role::ByValue {
            d.boolean(Attr::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
        }
        if let Some(r) = ragged {
            d.desc(Attr::CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, self.t(r))?;
        }
        d.finalize()?;
        self.tensors.push(T { uid, desc: d });
        Ok(self.tensors.len() - 1)
    }

    /// A virtual tensor with packed strides.
    pub fn virt(&mut self, dt: Dt, dims: &[i64]) -> Result<usize> {
        self.tensor(0, dt, dims, &packed(dims), Role::Virtual)
    }

    /// A virtual tensor with explicit strides.
    pub fn virt_strided(&mut self, dt: Dt, dims: &[i64], strides: &[i64]) -> Result<usize> {
        self.tensor(0, dt, dims, strides, Role::Virtual)
    }

    /// A by-value scalar `[1, 1, 1, 1]`.
    pub fn scalar(&mut self, uid: i64, dt: Dt) -> Result<usize> {
        self.tensor(uid, dt, &[1, 1, 1, 1], &[1, 1, 1, 1], Role::ByValue)
    }

    fn t(&self, i: usize) -> &Desc {
        &self.tensors[i].desc
    }

    /// `y = mode(x[, b[, t]])` with math precision `prec`.
    #[allow(clippy::too_many_arguments)]
    pub fn pointwise(
        &mut self,
        mode: Pw,
        prec: Dt,
        x: usize,
        b: Option<usize>,
        t: Option<usize>,
        y: usize,
        axis: Option<i64>,
    ) -> Result<()> {
        let pw = Desc::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.pw_mode(Attr::CUDNN_ATTR_POINTWISE_MODE, mode)?
            .dtype(Attr::CUDNN_ATTR_POINTWISE_MATH_PREC, prec)?;
        if let Some(a) = axis {
            pw.i64(Attr::CUDNN_ATTR_POINTWISE_AXIS, a)?;
        }
        pw.finalize()?;
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.desc(Attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &pw)?
            .desc(Attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, self.t(x))?;
        if let Some(b) = b {
            op.desc(Attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, self.t(b))?;
        }
        op.desc(Attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, self.t(y))?;
        if let Some(t) = t {
            op.desc(Attr::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, self.t(t))?;
        }
        op.f32(Attr::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0)?
            .f32(Attr::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0)?
            .finalize()?;
        self.ops.push(op);
        Ok(())
    }

    /// Binary pointwise op in f32.
    pub fn binary(&mut self, mode: Pw, x: usize, b: usize, y: usize) -> Result<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, x, Some(b), None, y, None)
    }

    /// Unary pointwise op in f32.
    pub fn unary(&mut self, mode: Pw, x: usize, y: usize) -> Result<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, x, None, None, y, None)
    }

    /// `y = reduce(x)` over the dimensions where `y` has extent 1.
    pub fn reduction(&mut self, op_kind: Red, x: usize, y: usize) -> Result<()> {
        let r = Desc::new(Kind::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        r.reduce_op(Attr::CUDNN_ATTR_REDUCTION_OPERATOR, op_kind)?
            .dtype(Attr::CUDNN_ATTR_REDUCTION_COMP_TYPE, Dt::CUDNN_DATA_FLOAT)?
            .finalize()?;
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.desc(Attr::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, self.t(x))?
            .desc(Attr::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, self.t(y))?
            .desc(Attr::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &r)?
            .finalize()?;
        self.ops.push(op);
        Ok(())
    }

    /// `c = a @ b` (batched over the leading dims), f32 compute.
    pub fn matmul(&mut self, a: usize, b: usize, c: usize) -> Result<()> {
        self.matmul_over(a, b, c, [None; 3])
    }

    /// `c = a @ b` whose GEMM extents `[m, n, k]` are overridden per batch
    /// by the int32 `[b, 1, 1, 1]` tensors given (sequence lengths of a
    /// ragged call).
    pub fn matmul_over(
        &mut self,
        a: usize,
        b: usize,
        c: usize,
        over: [Option<usize>; 3],
    ) -> Result<()> {
        let m = Desc::new(Kind::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        m.dtype(Attr::CUDNN_ATTR_MATMUL_COMP_TYPE, Dt::CUDNN_DATA_FLOAT)?
            .finalize()?;
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.desc(Attr::CUDNN_ATTR_OPERATION_MATMUL_ADESC, self.t(a))?
            .desc(Attr::CUDNN_ATTR_OPERATION_MATMUL_BDESC, self.t(b))?
            .desc(Attr::CUDNN_ATTR_OPERATION_MATMUL_CDESC, self.t(c))?
            .desc(Attr::CUDNN_ATTR_OPERATION_MATMUL_DESC, &m)?;
        let attrs = [
            Attr::CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC,
            Attr::CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC,
            Attr::CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC,
        ];
        for (attr, t) in attrs.into_iter().zip(over) {
            if let Some(t) = t {
                op.desc(attr, self.t(t))?;
            }
        }
        op.finalize()?;
        self.ops.push(op);
        Ok(())
    }

    /// `y` = `x` viewed with other dims/strides (a transpose, for the fused kernels).
    pub fn reshape(&mut self, x: usize, y: usize) -> Result<()> {
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.desc(Attr::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, self.t(x))?
            .desc(Attr::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, self.t(y))?
            .finalize()?;
        self.ops.push(op);
        Ok(())
    }

    /// The finalized operation graph.
    pub fn finalize(&self, handle: sys::cudnnHandle_t) -> Result<Desc> {
        let g = Desc::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        let ops: Vec<&Desc> = self.ops.iter().collect();
        g.handle(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?
            .descs(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?
            .finalize()?;
        Ok(g)
    }
}

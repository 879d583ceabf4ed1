//! Device tensors and the views ops take.

use super::memory::{Category, MemoryLedger};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    /// 8-bit codes: an optimizer's compact state (AdamW's 8-bit moments);
    /// only the optimizer's ops read them.
    U8,
    /// FP8 E4M3 ("e4m3fn"): a linear layer's weights and activations,
    /// written by `Backend::fp8_quantize` (the CPU keeps each code's value
    /// in an f32 cell).
    F8E4M3,
    /// FP8 E5M2: a linear layer's gradients (as `F8E4M3`).
    F8E5M2,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
            DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }
    /// The dtype of FP8 `format`.
    pub fn of_fp8(format: super::fp8::Fp8Format) -> DType {
        match format {
            super::fp8::Fp8Format::E4M3 => DType::F8E4M3,
            super::fp8::Fp8Format::E5M2 => DType::F8E5M2,
        }
    }
    /// The FP8 format of an FP8 dtype.
    pub fn fp8_format(self) -> Option<super::fp8::Fp8Format> {
        use super::fp8::Fp8Format;
        match self {
            DType::F8E4M3 => Some(Fp8Format::E4M3),
            DType::F8E5M2 => Some(Fp8Format::E5M2),
            _ => None,
        }
    }
}

/// What a tensor needs of the device it lives on: the type of its storage
/// (every [`Backend`](super::Backend) is one).
pub trait TensorDevice {
    /// Device storage of one tensor.
    type Storage: Send + Sync;
}

/// A dense, row-major tensor on one backend's device. Its bytes are counted in
/// the backend's ledger from creation until drop.
pub struct Tensor<B: TensorDevice> {
    storage: B::Storage,
    shape: Vec<usize>,
    dtype: DType,
    category: Category,
    ledger: Arc<MemoryLedger>,
}

impl<B: TensorDevice> Tensor<B> {
    /// Wraps freshly allocated storage and records its bytes. Backends only.
    pub fn from_parts(
        storage: B::Storage,
        shape: &[usize],
        dtype: DType,
        category: Category,
        ledger: Arc<MemoryLedger>,
    ) -> Self {
        let t = Tensor {
            storage,
            shape: shape.to_vec(),
            dtype,
            category,
            ledger,
        };
        t.ledger.acquire(category, t.bytes());
        t
    }

    pub fn storage(&self) -> &B::Storage {
        &self.storage
    }
    pub fn storage_mut(&mut self) -> &mut B::Storage {
        &mut self.storage
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn category(&self) -> Category {
        self.category
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
    /// Size of the first dimension (tokens, for activations).
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
    /// Elements per first-dimension row.
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// Reinterprets the shape (same number of elements).
    pub fn reshape(&mut self, shape: &[usize]) {
        assert_eq!(
            shape.iter().product::<usize>(),
            self.numel(),
            "reshape {:?} -> {:?}",
            self.shape,
            shape
        );
        self.shape = shape.to_vec();
    }

    /// The whole tensor as a `[rows, row_len]` matrix.
    pub fn mat(&self) -> Mat<'_, B> {
        Mat {
            t: self,
            l: MatLayout::row_major(self.rows(), self.row_len()),
        }
    }
    /// The whole tensor as a mutable `[rows, row_len]` matrix.
    pub fn mat_mut(&mut self) -> MatMut<'_, B> {
        let l = MatLayout::row_major(self.rows(), self.row_len());
        MatMut { t: self, l }
    }
    /// A view with an explicit layout.
    pub fn view(&self, l: MatLayout) -> Mat<'_, B> {
        l.check(self.numel());
        Mat { t: self, l }
    }
    /// A mutable view with an explicit layout.
    pub fn view_mut(&mut self, l: MatLayout) -> MatMut<'_, B> {
        l.check(self.numel());
        MatMut { t: self, l }
    }
    /// A range of first-dimension rows.
    pub fn rows_view(&self, r: Range<usize>) -> Rows<'_, B> {
        assert!(r.end <= self.rows());
        Rows { t: self, range: r }
    }
    /// All rows.
    pub fn all_rows(&self) -> Rows<'_, B> {
        self.rows_view(0..self.rows())
    }
    /// A mutable range of first-dimension rows.
    pub fn rows_view_mut(&mut self, r: Range<usize>) -> RowsMut<'_, B> {
        assert!(r.end <= self.rows());
        RowsMut { t: self, range: r }
    }
    /// All rows, mutable.
    pub fn all_rows_mut(&mut self) -> RowsMut<'_, B> {
        let n = self.rows();
        self.rows_view_mut(0..n)
    }
}

impl<B: TensorDevice> Drop for Tensor<B> {
    fn drop(&mut self) {
        self.ledger.release(self.category, self.bytes());
    }
}

impl<B: TensorDevice> fmt::Debug for Tensor<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor{:?}<{:?}, {}>",
            self.shape,
            self.dtype,
            self.category.name()
        )
    }
}

/// A logical `rows x cols` matrix inside a flat buffer: element `(i, j)` lives at
/// `offset + i * ld + j`, or at `offset + j * ld + i` when `trans` is set. This is
/// exactly what BLAS-style libraries (and cuBLASLt) can address without a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatLayout {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub trans: bool,
}

impl MatLayout {
    /// A dense row-major matrix at offset 0.
    pub fn row_major(rows: usize, cols: usize) -> Self {
        MatLayout {
            offset: 0,
            rows,
            cols,
            ld: cols,
            trans: false,
        }
    }
    /// A `rows x cols` block of a row-major matrix with leading dimension `ld`.
    pub fn block(offset: usize, rows: usize, cols: usize, ld: usize) -> Self {
        MatLayout {
            offset,
            rows,
            cols,
            ld,
            trans: false,
        }
    }
    /// The transposed view of the same memory.
    pub fn t(self) -> Self {
        MatLayout {
            rows: self.cols,
            cols: self.rows,
            trans: !self.trans,
            ..self
        }
    }
    /// Row and column strides in elements.
    pub fn strides(&self) -> (usize, usize) {
        if self.trans {
            (1, self.ld)
        } else {
            (self.ld, 1)
        }
    }
    /// One past the last element touched.
    pub fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return self.offset;
        }
        let (rs, cs) = self.strides();
        self.offset + (self.rows - 1) * rs + (self.cols - 1) * cs + 1
    }
    fn check(&self, numel: usize) {
        let stored_cols = if self.trans { self.rows } else { self.cols };
        assert!(
            stored_cols <= self.ld,
            "view wider than its leading dimension: {self:?}"
        );
        assert!(
            self.extent() <= numel,
            "view {self:?} exceeds {numel} elements"
        );
    }
}

/// An immutable matrix view.
pub struct Mat<'a, B: TensorDevice> {
    pub t: &'a Tensor<B>,
    pub l: MatLayout,
}

impl<B: TensorDevice> Clone for Mat<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: TensorDevice> Copy for Mat<'_, B> {}

impl<'a, B: TensorDevice> Mat<'a, B> {
    /// The transposed view.
    pub fn t(self) -> Self {
        Mat {
            t: self.t,
            l: self.l.t(),
        }
    }
}

/// A mutable matrix view.
pub struct MatMut<'a, B: TensorDevice> {
    pub t: &'a mut Tensor<B>,
    pub l: MatLayout,
}

/// A range of token rows of a `[s, heads, d]` or `[s, heads]` tensor.
pub struct Rows<'a, B: TensorDevice> {
    pub t: &'a Tensor<B>,
    pub range: Range<usize>,
}

impl<B: TensorDevice> Rows<'_, B> {
    pub fn len(&self) -> usize {
        self.range.len()
    }
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
    /// Heads (second dim).
    pub fn heads(&self) -> usize {
        self.t.shape().get(1).copied().unwrap_or(1)
    }
    /// Head dim (third dim).
    pub fn head_dim(&self) -> usize {
        self.t.shape().get(2).copied().unwrap_or(1)
    }
}

/// A mutable range of token rows.
pub struct RowsMut<'a, B: TensorDevice> {
    pub t: &'a mut Tensor<B>,
    pub range: Range<usize>,
}

impl<B: TensorDevice> RowsMut<'_, B> {
    pub fn len(&self) -> usize {
        self.range.len()
    }
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
    pub fn heads(&self) -> usize {
        self.t.shape().get(1).copied().unwrap_or(1)
    }
    pub fn head_dim(&self) -> usize {
        self.t.shape().get(2).copied().unwrap_or(1)
    }
}

/// A tensor either borrowed or freshly made (e.g. by a dtype conversion).
pub enum TensorRef<'a, B: TensorDevice> {
    Borrowed(&'a Tensor<B>),
    Owned(Tensor<B>),
}

impl<B: TensorDevice> std::ops::Deref for TensorRef<'_, B> {
    type Target = Tensor<B>;
    fn deref(&self) -> &Tensor<B> {
        match self {
            TensorRef::Borrowed(t) => t,
            TensorRef::Owned(t) => t,
        }
    }
}

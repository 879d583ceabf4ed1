//! One slot's AdamW moment in the format it is kept in
//! ([`MomentFormat`]): an F32 or BF16 tensor, or 8-bit codes with an F32
//! scale per block of each piece (`adamw/compact_adamw.rs`). Checkpoints
//! see F32 values either way: [`Moment::to_f32`] decodes, and
//! [`Moment::load_f32`] encodes them back to the same bytes.

use super::MomentFormat;
use super::adamw::compact_adamw::{q8_blocks, q8_decode_piece, q8_encode_piece};
use crate::backend::{Backend, Category, DType, HostValuesMut, Tensor};
use crate::error::Result;
use std::ops::Range;

/// Which moment: the first is signed, the second is not (8-bit codes
/// differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    First,
    Second,
}

/// A moment of one slot.
pub struct Moment<B: Backend> {
    /// `[..]` the slot's shape: values, or 8-bit codes.
    pub values: Tensor<B>,
    /// 8-bit codes' scales: `[blocks]` F32, the blocks of each piece in turn.
    pub scales: Option<Tensor<B>>,
    which: Which,
}

impl<B: Backend> Moment<B> {
    /// Zeros of `shape` in `format`, on the device, its 8-bit blocks cut
    /// along `pieces`.
    pub fn zeros(
        b: &B,
        shape: &[usize],
        format: MomentFormat,
        pieces: &[Range<usize>],
        which: Which,
    ) -> Result<Self> {
        let zeros = |shape: &[usize], dtype| b.zeros(shape, dtype, Category::OptimState);
        Self::made(zeros, (shape, format, pieces), which)
    }

    /// [`zeros`](Moment::zeros) in pinned host memory (the state of
    /// `--offload-optimizer`).
    pub fn host_zeros(
        b: &B,
        shape: &[usize],
        format: MomentFormat,
        pieces: &[Range<usize>],
        which: Which,
    ) -> Result<Self> {
        let zeros = |shape: &[usize], dtype| host_zeros(b, shape, dtype);
        Self::made(zeros, (shape, format, pieces), which)
    }

    /// A zero moment whose tensors `zeros(shape, dtype)` makes.
    fn made(
        zeros: impl Fn(&[usize], DType) -> Result<Tensor<B>>,
        (shape, format, pieces): (&[usize], MomentFormat, &[Range<usize>]),
        which: Which,
    ) -> Result<Self> {
        let values = zeros(shape, format.dtype())?;
        let scales = match format {
            MomentFormat::Q8 => {
                let blocks = pieces.iter().map(|p| q8_blocks(p.len())).sum::<usize>();
                Some(zeros(&[blocks], DType::F32)?)
            }
            _ => None,
        };
        Ok(Moment {
            values,
            scales,
            which,
        })
    }

    /// Tensors of this moment's shapes and dtypes on the device, contents
    /// unspecified (`Category::OptimState`): where host state is paged for
    /// its update (`optim::paged`).
    pub fn device_twin(&self, b: &B) -> Result<Self> {
        let like = |t: &Tensor<B>| b.empty(t.shape(), t.dtype(), Category::OptimState);
        Ok(Moment {
            values: like(&self.values)?,
            scales: self.scales.as_ref().map(like).transpose()?,
            which: self.which,
        })
    }

    /// Its tensors: the values, then the scales where it has them.
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor<B>> {
        std::iter::once(&self.values).chain(self.scales.as_ref())
    }

    /// [`tensors`](Moment::tensors), writable.
    pub fn tensors_mut(&mut self) -> impl Iterator<Item = &mut Tensor<B>> {
        std::iter::once(&mut self.values).chain(self.scales.as_mut())
    }

    /// The moment's values as F32 (elements in no piece read as zero).
    pub fn to_f32(&self, b: &B, pieces: &[Range<usize>]) -> Result<Vec<f32>> {
        let raw = b.to_host(&self.values)?;
        let Some(scales) = &self.scales else {
            return Ok(raw);
        };
        let scales = b.to_host(scales)?;
        let mut out = vec![0.0; raw.len()];
        let mut at = 0;
        for p in pieces {
            let n = q8_blocks(p.len());
            let decoded = q8_decode_piece(&raw[p.clone()], &scales[at..at + n], self.signed());
            out[p.clone()].copy_from_slice(&decoded);
            at += n;
        }
        Ok(out)
    }

    /// Sets the moment from F32 values, encoded in its format.
    pub fn load_f32(&mut self, b: &B, pieces: &[Range<usize>], values: &[f32]) -> Result<()> {
        if values.len() != self.values.numel() {
            return Err(crate::Error::Checkpoint(format!(
                "{} moment values for a slot of {}",
                values.len(),
                self.values.numel()
            )));
        }
        let Some(scales) = &mut self.scales else {
            return b.upload(&mut self.values, values);
        };
        let mut codes = vec![0.0; values.len()];
        let mut block_scales = vec![0.0; scales.numel()];
        let mut at = 0;
        for p in pieces {
            let n = q8_blocks(p.len());
            codes[p.clone()].copy_from_slice(&values[p.clone()]);
            let signed = self.which == Which::First;
            q8_encode_piece(&mut codes[p.clone()], &mut block_scales[at..at + n], signed);
            at += n;
        }
        b.upload(&mut self.values, &codes)?;
        b.upload(scales, &block_scales)
    }

    fn signed(&self) -> bool {
        self.which == Which::First
    }
}

/// A zero tensor of `shape` and `dtype` in host memory (a moment, or its
/// 8-bit blocks' scales).
fn host_zeros<B: Backend>(b: &B, shape: &[usize], dtype: DType) -> Result<Tensor<B>> {
    let mut t = b.empty(shape, dtype, Category::Offload)?;
    if !b.rehearsing() {
        match b.host_values_mut(&mut t)? {
            HostValuesMut::F32(x) => x.fill(0.0),
            HostValuesMut::Bf16(x) => x.fill(0),
            HostValuesMut::U8(x) => x.fill(0),
        }
    }
    Ok(t)
}

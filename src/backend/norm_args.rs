//! The argument checks of the RMSNorm ops (`rms_norm_fwd`,
//! `add_rms_norm_fwd`, `rms_norm_bwd`, `rms_norm_bwd_add`), one for the
//! forms of each direction, shared by the CPU reference, the CUDA backend
//! and the rehearsal: a call one refuses, each refuses alike.

use super::{Backend, Tensor, check_same_numel};
use crate::error::{Error, Result};

/// The rows of a norm over `n` elements with a weight of `dim`: an error
/// unless they are whole rows.
pub fn norm_rows(n: usize, dim: usize, op: &str) -> Result<usize> {
    if dim == 0 || !n.is_multiple_of(dim) {
        return Err(Error::Backend(format!(
            "{op}: {n} elements are not rows of the norm weight's {dim}"
        )));
    }
    Ok(n / dim)
}

/// The rows of a forward norm of `x` `[rows, dim]` by `w` `[dim]` into
/// `out`, `added` (`add_rms_norm_fwd`'s `y`, added into `x` first) shaped
/// like `x` too.
pub fn check_norm_fwd<B: Backend>(
    x: &Tensor<B>,
    added: Option<&Tensor<B>>,
    w: &Tensor<B>,
    out: &Tensor<B>,
    op: &str,
) -> Result<usize> {
    if let Some(y) = added {
        check_same_numel(x, y, op)?;
    }
    check_same_numel(x, out, op)?;
    norm_rows(x.numel(), w.numel(), op)
}

/// The rows of a norm backward of `x` `[rows, dim]` by `w` `[dim]`: `dy`
/// and `dx` shaped like `x`, `dw` (none for a frozen weight) like `w`.
pub fn check_norm_bwd<B: Backend>(
    x: &Tensor<B>,
    w: &Tensor<B>,
    dy: &Tensor<B>,
    dx: &Tensor<B>,
    dw: Option<&Tensor<B>>,
    op: &str,
) -> Result<usize> {
    check_same_numel(x, dy, op)?;
    check_same_numel(x, dx, op)?;
    if let Some(dw) = dw {
        check_same_numel(w, dw, op)?;
    }
    norm_rows(x.numel(), w.numel(), op)
}

//! The block inputs a step keeps from forward for its backward
//! (checkpoints), in block order, each with what else its block keeps
//! (`K`): on the device, or copied to host memory (`--offload`) and
//! brought back one block ahead of its backward. Under segment
//! checkpointing (`model::segments`) the backward also pushes the inputs
//! a segment's recompute rebuilds; they stay on the device.

use crate::backend::{Backend, Category, CopyDone, Tensor};
use crate::error::Result;

/// One block's kept input `[s_local, hidden]` and what else it keeps.
pub struct KeptInput<B: Backend, K> {
    pub block: usize,
    /// On the device, or in host memory (ledger category `Offload`).
    pub input: Tensor<B>,
    pub keep: K,
}

/// The kept inputs of a step, a stack whose top is the next backward's.
pub struct KeptInputs<B: Backend, K> {
    stack: Vec<KeptInput<B, K>>,
    /// An offloaded input's device copy, released once its copy to the
    /// host is done (beside the next block's forward).
    leaving: Option<(Tensor<B>, CopyDone)>,
    /// The top input's device copy on its way back from the host.
    coming: Option<(Tensor<B>, CopyDone)>,
}

impl<B: Backend, K> KeptInputs<B, K> {
    pub fn with_capacity(n: usize) -> Self {
        KeptInputs {
            stack: Vec::with_capacity(n),
            leaving: None,
            coming: None,
        }
    }

    /// Keeps block `block`'s input `x` (forward, in block order): with
    /// `offload`, a host copy starts and the device copy of the input kept
    /// before is released once its own copy is done.
    pub fn keep(
        &mut self,
        b: &B,
        block: usize,
        x: Tensor<B>,
        keep: K,
        offload: bool,
    ) -> Result<()> {
        let input = if offload {
            let mut host = b.empty(x.shape(), x.dtype(), Category::Offload)?;
            let done = b.copy_start(&mut host, &x)?;
            settle_copy(b, self.leaving.replace((x, done)))?;
            host
        } else {
            x
        };
        self.stack.push(KeptInput { block, input, keep });
        Ok(())
    }

    /// A device input the backward rebuilt (a segment's recompute).
    pub fn push_rebuilt(&mut self, block: usize, input: Tensor<B>, keep: K) {
        self.stack.push(KeptInput { block, input, keep });
    }

    /// The end of forward: the last offloaded input's device copy goes once
    /// its copy is done.
    pub fn settle(&mut self, b: &B) -> Result<()> {
        settle_copy(b, self.leaving.take())
    }

    /// The block whose input is on top (the next backward's).
    pub fn top_block(&self) -> Option<usize> {
        self.stack.last().map(|k| k.block)
    }

    /// Starts bringing the top input back to the device when it is in host
    /// memory (one block ahead of its backward).
    pub fn prefetch(&mut self, b: &B) -> Result<()> {
        self.coming = reload(b, self.stack.last().map(|k| &k.input))?;
        Ok(())
    }

    /// Takes the top input, on the device (waiting for its copy back), and
    /// its host copy when it was offloaded (released when the caller drops
    /// it: after the block's backward).
    pub fn take(&mut self, b: &B) -> Result<Option<Taken<B, K>>> {
        let Some(mut top) = self.stack.pop() else {
            return Ok(None);
        };
        let host = match self.coming.take() {
            Some((dev, done)) => {
                b.copy_wait(done)?;
                Some(std::mem::replace(&mut top.input, dev))
            }
            None => None,
        };
        Ok(Some((top, host)))
    }
}

/// A kept input taken for its backward, on the device, with its host copy
/// when it was offloaded.
pub type Taken<B, K> = (KeptInput<B, K>, Option<Tensor<B>>);

/// Releases an offloaded block input's device copy once its copy to host
/// memory is done (in stream order: no host wait).
fn settle_copy<B: Backend>(b: &B, leaving: Option<(Tensor<B>, CopyDone)>) -> Result<()> {
    if let Some((device, done)) = leaving {
        b.copy_wait(done)?;
        drop(device);
    }
    Ok(())
}

/// Starts copying an offloaded block input back to the device (`None` for
/// an input that stayed there).
fn reload<B: Backend>(b: &B, kept: Option<&Tensor<B>>) -> Result<Option<(Tensor<B>, CopyDone)>> {
    match kept {
        Some(host) if host.category() == Category::Offload => {
            let mut dev = b.empty(host.shape(), host.dtype(), Category::Activations)?;
            let done = b.copy_start(&mut dev, host)?;
            Ok(Some((dev, done)))
        }
        _ => Ok(None),
    }
}

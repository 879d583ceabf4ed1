//! The attention kernel a `train` run uses, decided once the route is
//! known and before anything is planned or allocated
//! (`cudnn::decide_run_kernel`): from GPU 0, the loadable cuDNN, the
//! model's head dim and whether the run's windows may hold several
//! documents. The planner walks that kernel and every rank's backend
//! serves every call with it.

use super::{Device, Route};
use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::cudnn::{self, AttentionKernel, AttnKernel, KernelDecision};
use crate::data::PackMode;
use crate::data::TokenFormat;
use crate::data::doc_index::index_path;
use crate::error::Result;
use std::path::Path;

/// Whether the windows of `--pack pack` over `--data data` may hold several
/// documents (documents masks): a packing that keeps documents apart over
/// ids with a document index beside them (as `load_dataset` reads them).
pub fn may_hold_documents(pack: PackMode, data: Option<&Path>) -> bool {
    pack != PackMode::Stream
        && data.is_some_and(|p| TokenFormat::of_path(p).is_some() && index_path(p).exists())
}

/// The run's kernel on `route` (`None` on the CPU), `ask` being
/// `--attn-kernel`; `say`: log the warning or note (once per run: the
/// process that reports, not a parent that launches its ranks).
pub fn decide(
    route: &Route,
    device: Device,
    ask: AttnKernel,
    head_dim: usize,
    documents: bool,
    say: bool,
) -> Result<Option<AttentionKernel>> {
    if *route == Route::CpuThreads {
        if ask == AttnKernel::Cudnn {
            let why = match device {
                Device::Cpu => "--device cpu runs on the CPU",
                _ => "no GPU is visible, so the run is on the CPU",
            };
            return crate::config_err!(
                "--attn-kernel cudnn: {why}, whose attention is upipe's f32 reference \
                 (cuDNN runs on GPUs only); drop --attn-kernel, or run on a machine with a GPU"
            );
        }
        return Ok(None);
    }
    let facts = CudaBackend::kernel_facts(0, head_dim, documents)?;
    let KernelDecision {
        kernel,
        warning,
        note,
    } = cudnn::decide_run_kernel(ask, &facts)?;
    if say {
        if let Some(w) = warning {
            tracing::warn!("{w}");
        }
        if let Some(n) = note {
            tracing::info!("{n}");
        }
    }
    Ok(Some(kernel))
}

/// `--attn-kernel` as the run file records a decided kernel (`cudnn`, or
/// `native` for upipe's kernels): the run repeats with the same kernel.
pub fn flag_of(kernel: AttentionKernel) -> &'static str {
    match kernel {
        AttentionKernel::Cudnn { .. } => "cudnn",
        AttentionKernel::Flash | AttentionKernel::Naive => "native",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Documents masks are possible only where the packing keeps documents
    /// apart and the ids have an index beside them; on the CPU `cudnn` is
    /// an error and the others decide nothing.
    #[test]
    fn documents_need_an_index_and_the_cpu_has_no_kernel_to_decide() {
        let dir = std::env::temp_dir().join(format!("upipe-kernel-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ids = dir.join("ids.u32");
        std::fs::write(&ids, [0u8; 16]).unwrap();
        let text = dir.join("corpus.txt");
        std::fs::write(&text, "text").unwrap();
        assert!(!may_hold_documents(PackMode::Documents, Some(&ids)));
        std::fs::write(index_path(&ids), [0u8; 8]).unwrap();
        assert!(may_hold_documents(PackMode::Documents, Some(&ids)));
        assert!(may_hold_documents(PackMode::Bfd, Some(&ids)));
        assert!(!may_hold_documents(PackMode::Stream, Some(&ids)));
        assert!(!may_hold_documents(PackMode::Documents, Some(&text)));
        assert!(!may_hold_documents(PackMode::Documents, None));
        std::fs::remove_dir_all(&dir).unwrap();
        let cpu = |ask| decide(&Route::CpuThreads, Device::Cpu, ask, 64, false, false);
        assert_eq!(cpu(AttnKernel::Auto).unwrap(), None);
        assert_eq!(cpu(AttnKernel::Native).unwrap(), None);
        let e = cpu(AttnKernel::Cudnn).unwrap_err().to_string();
        assert!(
            e.contains("--attn-kernel cudnn") && e.contains("--device cpu"),
            "{e}"
        );
    }
}

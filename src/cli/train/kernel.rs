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

/// `--precision fp8-attention` (or `fp8-attention-bwd`) where the run can
/// take it: every attention call's forward and backward (or backward) on
/// cuDNN's FP8 graphs, which on Hopper take head dim 128,
/// no documents masks and no sliding windows (`cudnn::sdpa_fp8`), and on
/// a GPU of compute capability 9.0 or above. An error naming the fix
/// otherwise, before anything is allocated.
pub fn check_fp8_attention(
    precision: crate::backend::fp8::Precision,
    kernel: Option<AttentionKernel>,
    model: &crate::model::ModelConfig,
    documents: bool,
) -> Result<()> {
    if !precision.fp8_attention().any() {
        return Ok(());
    }
    let cudnn = match kernel {
        Some(AttentionKernel::Cudnn { version }) => Some(version),
        _ => None,
    };
    fp8_attention_fits(precision, cudnn, kernel.is_some(), model, documents)?;
    let gpus = crate::backend::cuda::device::gpus()?;
    if let Some(g) = gpus.first()
        && g.compute_capability.0 < 9
    {
        return crate::config_err!(
            "--precision {precision} needs a Hopper GPU or newer (compute capability 9.0); \
             this one is {}.{}: {FP8_FIX}",
            g.compute_capability.0,
            g.compute_capability.1
        );
    }
    Ok(())
}

const FP8_FIX: &str = "use --precision fp8 (FP8 linear layers, BF16 attention)";

/// What FP8 attention (`precision`) asks of a run whose attention is on
/// cuDNN `cudnn` (`None`: on upipe's kernels; `gpu`: on a GPU at all), as
/// `train` checks it and `plan` plans it.
pub fn fp8_attention_fits(
    precision: crate::backend::fp8::Precision,
    cudnn: Option<usize>,
    gpu: bool,
    model: &crate::model::ModelConfig,
    documents: bool,
) -> Result<()> {
    let fix = FP8_FIX;
    if !gpu {
        return crate::config_err!(
            "--precision {precision} runs cuDNN's FP8 attention, on a GPU only; on the CPU \
             {fix}"
        );
    }
    let Some(version) = cudnn else {
        return crate::config_err!(
            "--precision {precision} runs on cuDNN, but the run's attention is on upipe's \
             kernels (--attn-kernel native, or no cuDNN 9.1+ found): drop --attn-kernel native \
             or install cuDNN, or {fix}"
        );
    };
    if version < 90100 {
        return crate::config_err!(
            "--precision {precision} needs cuDNN 9.1 or newer (found {version}), or {fix}"
        );
    }
    if model.head_dim != 128 {
        return crate::config_err!(
            "--precision {precision}: cuDNN's FP8 attention backward on Hopper takes head dim \
             128 only, and this model's is {}; {fix}",
            model.head_dim
        );
    }
    if documents {
        return crate::config_err!(
            "--precision {precision}: cuDNN's FP8 attention takes no documents masks on \
             Hopper; use --pack stream, or {fix}"
        );
    }
    if (0..model.layers).any(|l| model.layer_attention(l).window.is_some()) {
        return crate::config_err!(
            "--precision {precision}: this model attends through sliding windows, which \
             cuDNN's FP8 attention does not take; {fix}"
        );
    }
    Ok(())
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

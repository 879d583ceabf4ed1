//! The device `upipe plan` plans for (`--device`, `--attn-kernel`) and,
//! where attention runs on cuDNN, the cuDNN version it assumes:
//! `--cudnn-version` (`9.19`, `9.19.0` or `91900`), else the cuDNN this
//! machine loads (`UPIPE_CUDNN_LIB` or the library search `upipe info`
//! shows), else the planned default ([`PLANNED_CUDNN_VERSION`], 9.14). The
//! version decides which attention calls the planner puts on cuDNN, as it
//! decides which ones a run does.

use crate::backend::cuda::cudnn::{self, AttnKernel, select::version_text};
use crate::error::Result;
use crate::plan::PLANNED_CUDNN_VERSION;
use crate::plan::{CudnnVersion, DeviceKind};

/// The cuDNN version a plan assumes, and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedCudnn {
    pub version: usize,
    /// `--cudnn-version`, the loaded library, or the default.
    pub source: String,
}

impl PlannedCudnn {
    /// `asked` (`--cudnn-version`), else the version of the cuDNN this
    /// machine loads (`cudnn::probe`), else [`PLANNED_CUDNN_VERSION`].
    pub fn resolve(asked: Option<CudnnVersion>) -> PlannedCudnn {
        Self::of(asked, cudnn::probe().map(|(v, _)| v).ok())
    }

    /// [`Self::resolve`] given the loaded cuDNN's version (`None`: none loads).
    pub fn of(asked: Option<CudnnVersion>, loaded: Option<usize>) -> PlannedCudnn {
        match (asked, loaded) {
            (Some(v), _) => PlannedCudnn {
                version: v.0,
                source: "--cudnn-version".into(),
            },
            (None, Some(v)) => PlannedCudnn {
                version: v,
                source: "the cuDNN loaded here".into(),
            },
            (None, None) => PlannedCudnn {
                version: PLANNED_CUDNN_VERSION,
                source: "no cuDNN loads here; --cudnn-version plans another".into(),
            },
        }
    }

    /// `planned for cuDNN 9.19.0 (--cudnn-version)`.
    pub fn line(&self) -> String {
        format!(
            "planned for cuDNN {} ({})",
            version_text(self.version),
            self.source
        )
    }
}

/// The device `--device` names with the attention kernels `kernel`: `auto`
/// as `train --device auto` decides it here, with the cuDNN version it plans
/// where attention runs on cuDNN (`asked`: `--cudnn-version`).
pub fn plan_device(
    device: &str,
    kernel: AttnKernel,
    asked: Option<CudnnVersion>,
) -> Result<(DeviceKind, Option<PlannedCudnn>)> {
    let device = match device {
        "cuda" => DeviceKind::cuda_with(kernel),
        "cpu" => DeviceKind::Cpu,
        "auto" if crate::cli::train::visible_gpus() > 0 => DeviceKind::cuda_with(kernel),
        "auto" => DeviceKind::Cpu,
        other => {
            return crate::config_err!(
                "--device {other} ([run] device): plan for cuda (bf16), cpu (f32) or auto"
            );
        }
    };
    if device.cudnn().is_none() {
        if let Some(v) = asked {
            return crate::config_err!(
                "--cudnn-version {v} ([plan] cudnn-version): the plan is for {}, where no \
                 attention runs on cuDNN; drop it, or plan --device cuda --attn-kernel auto",
                device.name()
            );
        }
        return Ok((device, None));
    }
    let cudnn = PlannedCudnn::resolve(asked);
    Ok((device.with_cudnn(cudnn.version), Some(cudnn)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_wins_then_the_loaded_cudnn_then_the_default() {
        let asked = Some(CudnnVersion(91900));
        assert_eq!(PlannedCudnn::of(asked, Some(91000)).version, 91900);
        assert_eq!(PlannedCudnn::of(None, Some(91000)).version, 91000);
        let default = PlannedCudnn::of(None, None);
        assert_eq!(default.version, PLANNED_CUDNN_VERSION);
        assert!(
            default
                .line()
                .starts_with("planned for cuDNN 9.14.0 (no cuDNN loads here")
        );
    }
}

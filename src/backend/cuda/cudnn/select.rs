//! Choosing the attention kernel: `--attn-kernel auto|cudnn|native`.

use super::sdpa_graph::SdpaShape;
use crate::backend::AttnMask;
use crate::error::{Error, Result};

/// Which attention implementation the CUDA backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnKernel {
    /// cuDNN where it is present and supports the call, else native.
    #[default]
    Auto,
    /// cuDNN only (an unsupported call is an error).
    Cudnn,
    /// Our own kernels only.
    Native,
}

impl std::str::FromStr for AttnKernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<AttnKernel> {
        match s {
            "auto" => Ok(AttnKernel::Auto),
            "cudnn" => Ok(AttnKernel::Cudnn),
            "native" => Ok(AttnKernel::Native),
            _ => Err(Error::Config(format!(
                "--attn-kernel must be auto, cudnn or native, got {s:?}"
            ))),
        }
    }
}

/// The outcome of the selection for one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    Cudnn,
    /// Native kernels, and why cuDNN was not used.
    Native(String),
}

/// Whether the fused cuDNN SDPA of `version` (e.g. 91400) handles this shape,
/// forward (`bwd = false`) or backward; `Err(reason)` otherwise.
pub fn shape_supported(
    version: usize,
    s: &SdpaShape,
    bwd: bool,
) -> std::result::Result<(), String> {
    if version < 90000 {
        return Err(format!("cuDNN {version} is older than 9.0"));
    }
    if s.d != 64 && s.d != 128 {
        return Err(format!("head_dim {} (cuDNN path handles 64 and 128)", s.d));
    }
    if s.hkv == 0 || !s.hq.is_multiple_of(s.hkv) {
        return Err(format!("hq {} is not a multiple of hkv {}", s.hq, s.hkv));
    }
    if s.sq == 0 || s.sk == 0 {
        return Err("empty sequence".into());
    }
    if s.sq == 1 && s.sk == 1 {
        return Err("s_q = s_kv = 1 is not supported by cuDNN SDPA".into());
    }
    s.mask.check_shape(s.sq, s.sk)?;
    match &s.mask {
        AttnMask::Full | AttnMask::Causal => {}
        AttnMask::Bounded(_) => {
            return Err("the cuDNN path does not take a documents mask yet".into());
        }
    }
    // 16-byte alignment of every bf16 row (and so of every head's start).
    for (name, rs) in [("q", s.q_rs), ("k", s.k_rs), ("v", s.v_rs), ("o", s.o_rs)] {
        if !rs.is_multiple_of(8) {
            return Err(format!(
                "{name} row stride {rs} is not a multiple of 8 elements"
            ));
        }
    }
    // cuDNN <= 9.15 backward needs s_kv % 128 == 0 unless a padding mask is
    // given (cuDNN frontend applies a padding-mask workaround; we fall back).
    if bwd && version <= 91500 && !s.sk.is_multiple_of(128) {
        return Err(format!(
            "backward with s_kv {} % 128 != 0 needs cuDNN > 9.15 (have {version})",
            s.sk
        ));
    }
    Ok(())
}

/// The "auto" decision: `available` is `Ok(version)` when cuDNN loaded (or why not).
pub fn decide(
    kernel: AttnKernel,
    available: std::result::Result<usize, String>,
    s: &SdpaShape,
    bwd: bool,
) -> Result<Choice> {
    let why = match (&available, kernel) {
        (_, AttnKernel::Native) => return Ok(Choice::Native("--attn-kernel native".into())),
        (Err(e), _) => format!("cuDNN unavailable: {e}"),
        (Ok(v), _) => match shape_supported(*v, s, bwd) {
            Ok(()) => return Ok(Choice::Cudnn),
            Err(r) => r,
        },
    };
    match kernel {
        AttnKernel::Cudnn => Err(Error::Backend(format!("--attn-kernel cudnn: {why}"))),
        _ => Ok(Choice::Native(why)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(s: usize, d: usize, causal: bool) -> SdpaShape {
        let mask = if causal {
            AttnMask::Causal
        } else {
            AttnMask::Full
        };
        SdpaShape {
            sq: s,
            sk: s,
            hq: 8,
            hkv: 2,
            d,
            mask,
            q_rs: 8 * d,
            k_rs: 2 * d,
            v_rs: 2 * d,
            o_rs: 8 * d,
            lse_rs: 8,
            lse_hs: 1,
            head_major: false,
        }
    }

    #[test]
    fn auto_picks_cudnn_for_supported_shapes_and_says_why_not() {
        let ok = shape(1024, 128, true);
        assert_eq!(
            decide(AttnKernel::Auto, Ok(91900), &ok, true).unwrap(),
            Choice::Cudnn
        );
        let Choice::Native(why) =
            decide(AttnKernel::Auto, Ok(91900), &shape(1024, 96, true), false).unwrap()
        else {
            panic!("d 96 must fall back");
        };
        assert!(why.contains("head_dim 96"), "{why}");
        let Choice::Native(why) =
            decide(AttnKernel::Auto, Err("not found".into()), &ok, false).unwrap()
        else {
            panic!("missing cuDNN must fall back");
        };
        assert!(why.contains("not found"));
        // 9.14 backward with odd s_kv falls back; 9.19 takes it; forward is fine on both.
        let odd = shape(1000, 64, false);
        assert!(matches!(
            decide(AttnKernel::Auto, Ok(91400), &odd, true).unwrap(),
            Choice::Native(_)
        ));
        assert_eq!(
            decide(AttnKernel::Auto, Ok(91900), &odd, true).unwrap(),
            Choice::Cudnn
        );
        assert_eq!(
            decide(AttnKernel::Auto, Ok(91400), &odd, false).unwrap(),
            Choice::Cudnn
        );
    }

    #[test]
    fn forced_modes() {
        let bad = shape(1024, 96, false);
        assert!(decide(AttnKernel::Cudnn, Ok(91900), &bad, false).is_err());
        assert!(matches!(
            decide(
                AttnKernel::Native,
                Ok(91900),
                &shape(1024, 128, false),
                false
            )
            .unwrap(),
            Choice::Native(_)
        ));
        assert_eq!("native".parse::<AttnKernel>().unwrap(), AttnKernel::Native);
        assert!("fast".parse::<AttnKernel>().is_err());
    }
}

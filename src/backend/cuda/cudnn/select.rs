//! Choosing the attention kernel: `--attn-kernel auto|cudnn|native`.

use super::ragged::{self, FIRST_RAGGED_VERSION, RaggedDims};
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

/// The head dims upipe runs on cuDNN's fused SDPA: 64 and 128 (Llama,
/// Qwen, Mistral) and 256 (Gemma 3 1B-12B; Hopper's forward and backward
/// take up to 256).
pub const CUDNN_HEAD_DIMS: [usize; 3] = [64, 128, 256];

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
    if !CUDNN_HEAD_DIMS.contains(&s.d) {
        return Err(format!(
            "head_dim {} (cuDNN path handles 64, 128 and 256)",
            s.d
        ));
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
    if let Some(r) = s.ragged {
        ragged_supported(version, s, r)?;
    }
    match (&s.mask, s.window) {
        (AttnMask::Full, None) | (AttnMask::Causal, _) => {}
        (AttnMask::Full, Some(_)) => {
            // cuDNN 9.14.0 computes non-causal windows over 1024 keys wrongly
            return Err("a sliding window without a causal mask".into());
        }
        (AttnMask::Bounded(_), _) => {
            return Err(
                "the cuDNN path takes several documents only over the call's own rows \
                 without a sliding window (not ring blocks of two runs, nor windows)"
                    .into(),
            );
        }
    }
    if s.window.is_some() && version < 90200 {
        return Err(format!("sliding windows need cuDNN 9.2 (have {version})"));
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
    if bwd && version <= 91500 && s.ragged.is_none() && !s.sk.is_multiple_of(128) {
        return Err(format!(
            "backward with s_kv {} % 128 != 0 needs cuDNN > 9.15 (have {version})",
            s.sk
        ));
    }
    if s.fp8
        && let Some(why) = super::sdpa_fp8::unsupported(s, bwd)
    {
        return Err(format!("FP8 attention on cuDNN does not take {why}"));
    }
    Ok(())
}

/// Whether a ragged call (several documents, [`ragged`]) can run: cuDNN
/// 9.10 or newer, dense token rows (the offsets of Q serve O, dO and dQ,
/// those of K serve V, dK and dV), one causal block per document, and
/// element offsets within int32.
fn ragged_supported(
    version: usize,
    s: &SdpaShape,
    r: RaggedDims,
) -> std::result::Result<(), String> {
    if version < FIRST_RAGGED_VERSION {
        return Err(format!(
            "several documents in one call need cuDNN 9.10 (ragged offsets and a padding \
             mask, forward and backward); have {version}"
        ));
    }
    let dense = !s.head_major
        && s.q_rs == s.hq * s.d
        && s.o_rs == s.q_rs
        && s.k_rs == s.hkv * s.d
        && s.v_rs == s.k_rs
        && (s.lse_rs, s.lse_hs) == (s.hq, 1);
    if !dense || s.sq != s.sk || s.window.is_some() || s.mask != AttnMask::Causal {
        return Err(
            "several documents in one call need causal attention over dense token rows".into(),
        );
    }
    if r.b == 0 || r.b > s.sq || r.s_max < ragged::MIN_S_MAX {
        return Err(format!("{} documents in a call of {} rows", r.b, s.sq));
    }
    if !ragged::offsets_fit(s.sq, s.q_rs) || !ragged::offsets_fit(s.sk, s.k_rs) {
        return Err(format!(
            "{} rows of {} elements: the ragged offsets exceed int32",
            s.sq, s.q_rs
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

/// Tokens/s of upipe's flash kernels against cuDNN SDPA for a whole step:
/// 21,052 against 32,143 (Llama 3.2 1B, 32K tokens, one H200, 2026-12-03).
pub const NATIVE_SPEED_AT_32K: f64 = 0.65;

/// The attention kernel a run uses, decided once before it plans
/// ([`decide_run_kernel`]) and given to the backend
/// (`CudaBackend::set_attention_kernel`), which serves every call with it:
/// the planner counts the same kernel's workspaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// cuDNN SDPA of this version (e.g. 91400) for every call
    /// [`shape_supported`] lets it take (bf16, head dim 64/128, causal or
    /// full masks, sliding windows, several documents over a call's own
    /// rows from 9.10); the flash kernels for the rest (F32 operands, cuDNN
    /// 9.15's backward on `s_kv % 128 != 0`, ring blocks of documents).
    Cudnn { version: usize },
    /// upipe's flash kernels (bf16, head dim 64/128/256, sm_90), the naive ones
    /// for what they do not take.
    Flash,
    /// upipe's naive kernels only (`UPIPE_ATTENTION=naive`, or a GPU below sm_90).
    Naive,
}

impl AttentionKernel {
    /// Whether a call of `shape` (`bwd`: the backward) runs on cuDNN.
    pub fn takes_on_cudnn(self, shape: &SdpaShape, bwd: bool) -> bool {
        match self {
            AttentionKernel::Cudnn { version } => shape_supported(version, shape, bwd).is_ok(),
            AttentionKernel::Flash | AttentionKernel::Naive => false,
        }
    }

    /// The cuDNN version of a cuDNN run.
    pub fn cudnn_version(self) -> Option<usize> {
        match self {
            AttentionKernel::Cudnn { version } => Some(version),
            AttentionKernel::Flash | AttentionKernel::Naive => None,
        }
    }
}

impl std::fmt::Display for AttentionKernel {
    /// `cudnn 9.14.0`, `flash`, `naive` (what the run header and the
    /// metrics' `attention_kernel` say).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AttentionKernel::Cudnn { version } => write!(f, "cudnn {}", version_text(*version)),
            AttentionKernel::Flash => f.write_str("flash"),
            AttentionKernel::Naive => f.write_str("naive"),
        }
    }
}

/// A cuDNN version number as cuDNN writes it: 91400 is `9.14.0`.
pub fn version_text(version: usize) -> String {
    format!(
        "{}.{}.{}",
        version / 10000,
        (version % 10000) / 100,
        version % 100
    )
}

/// What a run's attention kernel is decided from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelFacts {
    /// cuDNN's version where it loads and can be used; why not otherwise.
    pub cudnn: std::result::Result<usize, String>,
    /// Whether upipe's flash kernels run on the device (sm_90, and
    /// `UPIPE_ATTENTION` is not `naive`).
    pub flash: bool,
    /// The model's head dim.
    pub head_dim: usize,
    /// Whether the run's windows may hold several documents (`--pack
    /// documents|bfd`): cuDNN takes them from 9.10 (ragged calls; ring
    /// blocks and documents under a sliding window stay on the flash
    /// kernels call by call).
    pub documents: bool,
}

/// A run's kernel, and what to tell the user about the choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelDecision {
    pub kernel: AttentionKernel,
    /// A warning: `auto` found no usable cuDNN (the run is slower).
    pub warning: Option<String>,
    /// Why `auto` did not take cuDNN where that is by design (head dim,
    /// documents masks).
    pub note: Option<String>,
}

/// Why cuDNN cannot serve the run `f` describes (`None`: it can).
fn cudnn_unfit(f: &KernelFacts) -> Option<String> {
    match &f.cudnn {
        Err(e) => Some(format!("cuDNN is not usable: {e}")),
        Ok(v) if *v < 90000 => Some(format!("cuDNN {v} is older than 9.0")),
        Ok(_) if !CUDNN_HEAD_DIMS.contains(&f.head_dim) => Some(format!(
            "head_dim {} (cuDNN SDPA is used for 64, 128 and 256)",
            f.head_dim
        )),
        Ok(v) if f.documents && *v < FIRST_RAGGED_VERSION => Some(format!(
            "cuDNN {v} does not take the documents masks of --pack documents|bfd (9.10 does)"
        )),
        Ok(_) => None,
    }
}

/// The kernel a run uses, decided before it plans: `--attn-kernel native`
/// is upipe's kernels; `cudnn` is cuDNN or an error naming why it cannot
/// be (before anything is allocated); `auto` is cuDNN where it serves the
/// run, else upipe's kernels, with a warning naming the slowdown when
/// cuDNN is missing or unusable (a note when it is by design: head dims
/// other than 64/128, documents masks).
pub fn decide_run_kernel(ask: AttnKernel, f: &KernelFacts) -> Result<KernelDecision> {
    let native = if f.flash {
        AttentionKernel::Flash
    } else {
        AttentionKernel::Naive
    };
    let plain = |kernel| KernelDecision {
        kernel,
        warning: None,
        note: None,
    };
    if ask == AttnKernel::Native {
        return Ok(plain(native));
    }
    let Some(why) = cudnn_unfit(f) else {
        let version = f.cudnn.clone().unwrap_or_default();
        return Ok(plain(AttentionKernel::Cudnn { version }));
    };
    if ask == AttnKernel::Cudnn {
        let fix = match (&f.cudnn, f.documents) {
            (Ok(_), true) => "use --attn-kernel auto (upipe's flash kernels) or --pack stream",
            (Ok(_), false) => "use --attn-kernel auto or native",
            (Err(_), _) => {
                "install cuDNN 9 or point UPIPE_CUDNN_LIB at a loadable libcudnn.so.9 \
                 (`upipe info` lists what it finds), or use --attn-kernel auto or native"
            }
        };
        return Err(Error::Config(format!("--attn-kernel cudnn: {why}; {fix}")));
    }
    let speed = match native {
        AttentionKernel::Flash => {
            format!("expect about {NATIVE_SPEED_AT_32K}x cuDNN's tokens/s (a 32K step on an H200)")
        }
        _ => "upipe's naive kernels are far slower than cuDNN".to_string(),
    };
    Ok(match f.cudnn {
        Err(_) => KernelDecision {
            kernel: native,
            warning: Some(format!(
                "--attn-kernel auto: attention on upipe's {native} kernels because {why}; \
                 {speed} (--attn-kernel native chooses them without this warning)"
            )),
            note: None,
        },
        Ok(_) => KernelDecision {
            kernel: native,
            warning: None,
            note: Some(format!("attention on upipe's {native} kernels: {why}")),
        },
    })
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
            window: None,
            q_rs: 8 * d,
            k_rs: 2 * d,
            v_rs: 2 * d,
            o_rs: 8 * d,
            lse_rs: 8,
            lse_hs: 1,
            head_major: false,
            ragged: None,
            fp8: false,
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

    fn facts(cudnn: std::result::Result<usize, String>, d: usize, documents: bool) -> KernelFacts {
        KernelFacts {
            cudnn,
            flash: true,
            head_dim: d,
            documents,
        }
    }

    /// `auto` takes cuDNN where it serves the whole run, and upipe's flash
    /// kernels otherwise: with a warning naming the slowdown when cuDNN is
    /// not usable, a note when it is by design (head dim, documents).
    #[test]
    fn a_run_decides_its_kernel_before_it_plans() {
        let d = decide_run_kernel(AttnKernel::Auto, &facts(Ok(91400), 64, false)).unwrap();
        assert_eq!(d.kernel, AttentionKernel::Cudnn { version: 91400 });
        assert_eq!((d.warning, d.note), (None, None));
        assert_eq!(d.kernel.to_string(), "cudnn 9.14.0");
        let gone = facts(
            Err("libcudnn.so.9: cannot open shared object file".into()),
            64,
            false,
        );
        let d = decide_run_kernel(AttnKernel::Auto, &gone).unwrap();
        assert_eq!(d.kernel, AttentionKernel::Flash);
        let w = d.warning.unwrap();
        assert!(
            w.contains("cannot open shared object") && w.contains("0.65x"),
            "{w}"
        );
        let docs = decide_run_kernel(AttnKernel::Auto, &facts(Ok(90500), 128, true)).unwrap();
        assert_eq!(docs.kernel, AttentionKernel::Flash);
        assert!(docs.warning.is_none());
        assert!(docs.note.unwrap().contains("documents"));
        let d96 = decide_run_kernel(AttnKernel::Auto, &facts(Ok(91900), 96, false)).unwrap();
        assert_eq!(d96.kernel, AttentionKernel::Flash);
        assert!(d96.note.unwrap().contains("head_dim 96"));
        // below sm_90 (or UPIPE_ATTENTION=naive) the native kernels are the naive ones
        let old_gpu = KernelFacts {
            flash: false,
            ..gone.clone()
        };
        let d = decide_run_kernel(AttnKernel::Auto, &old_gpu).unwrap();
        assert_eq!(d.kernel, AttentionKernel::Naive);
        assert!(d.warning.unwrap().contains("far slower"));
        let n = decide_run_kernel(AttnKernel::Native, &facts(Ok(91400), 64, false)).unwrap();
        assert_eq!(n.kernel, AttentionKernel::Flash);
        assert_eq!((n.warning, n.note), (None, None));
    }

    /// `--attn-kernel cudnn` that cuDNN cannot serve is an error naming the
    /// cause and the fix.
    #[test]
    fn cudnn_asked_for_and_unusable_is_an_error() {
        let err = |f: KernelFacts| match decide_run_kernel(AttnKernel::Cudnn, &f) {
            Err(Error::Config(m)) => m,
            other => panic!("expected a configuration error, got {other:?}"),
        };
        let m = err(facts(
            Err("UPIPE_CUDNN_LIB=/x/libcudnn.so.9: not found".into()),
            64,
            false,
        ));
        assert!(
            m.contains("--attn-kernel cudnn") && m.contains("/x/libcudnn.so.9"),
            "{m}"
        );
        assert!(
            m.contains("UPIPE_CUDNN_LIB") && m.contains("--attn-kernel auto"),
            "{m}"
        );
        let m = err(facts(Ok(90500), 64, true));
        assert!(
            m.contains("documents") && m.contains("--pack stream"),
            "{m}"
        );
        assert!(err(facts(Ok(91400), 96, false)).contains("head_dim 96"));
        assert!(err(facts(Ok(8900), 64, false)).contains("older than 9.0"));
        let ok = decide_run_kernel(AttnKernel::Cudnn, &facts(Ok(91900), 128, false)).unwrap();
        assert_eq!(ok.kernel, AttentionKernel::Cudnn { version: 91900 });
    }

    /// A cuDNN run puts on cuDNN exactly the calls `shape_supported` takes.
    #[test]
    fn a_cudnn_run_routes_by_its_version() {
        let odd = shape(1000, 64, false);
        let old = AttentionKernel::Cudnn { version: 91400 };
        let new = AttentionKernel::Cudnn { version: 91900 };
        assert!(old.takes_on_cudnn(&odd, false) && !old.takes_on_cudnn(&odd, true));
        assert!(new.takes_on_cudnn(&odd, true));
        assert!(!AttentionKernel::Flash.takes_on_cudnn(&odd, false));
    }

    /// Documents go to cuDNN from 9.10 (`auto` and `cudnn`), to the flash
    /// kernels under `native` or an older cuDNN; calls route one by one:
    /// several documents over a call's own rows on cuDNN, ring blocks and
    /// windows over documents on the flash kernels.
    #[test]
    fn documents_run_on_cudnn_from_9_10() {
        for ask in [AttnKernel::Auto, AttnKernel::Cudnn] {
            for d in [64, 128] {
                let k = decide_run_kernel(ask, &facts(Ok(91400), d, true)).unwrap();
                assert_eq!(k.kernel, AttentionKernel::Cudnn { version: 91400 });
                assert_eq!((k.warning, k.note), (None, None));
            }
        }
        let n = decide_run_kernel(AttnKernel::Native, &facts(Ok(91400), 128, true)).unwrap();
        assert_eq!(n.kernel, AttentionKernel::Flash);
        let old = decide_run_kernel(AttnKernel::Auto, &facts(Ok(90500), 64, true)).unwrap();
        assert!(old.note.unwrap().contains("9.10"));

        let docs = crate::backend::BoundedMask::documents(&[0, 1, 38, 338], 1338).unwrap();
        let (hq, hkv) = (8, 2);
        for d in [64, 128] {
            let call =
                super::super::dense_shape(1338, 1338, hq, hkv, d, AttnMask::Bounded(docs.clone()));
            assert_eq!(call.ragged, Some(RaggedDims { b: 4, s_max: 1024 }));
            assert_eq!(call.mask, AttnMask::Causal);
            for bwd in [false, true] {
                assert_eq!(shape_supported(91400, &call, bwd), Ok(()));
                assert!(AttentionKernel::Cudnn { version: 91400 }.takes_on_cudnn(&call, bwd));
                let e = shape_supported(90500, &call, bwd).unwrap_err();
                assert!(e.contains("cuDNN 9.10"), "{e}");
            }
        }
        let run = |m: crate::backend::BoundedMask, s: usize| {
            super::super::dense_shape(s, s, hq, hkv, 64, AttnMask::Bounded(m))
        };
        // a ring block holds two runs of positions: flash
        use crate::backend::RowPositions;
        let two = RowPositions::two_runs(0..669, 1000..1338);
        let ring = run(docs.with_rows(two, two), 1007);
        assert!(ring.ragged.is_none());
        let e = shape_supported(91400, &ring, false).unwrap_err();
        assert!(e.contains("ring blocks"), "{e}");
        // documents under a sliding window: flash
        let windowed = run(docs.clone().with_window(100).unwrap(), 1338);
        assert!(windowed.ragged.is_none() && shape_supported(91400, &windowed, true).is_err());
        // one document: the plain causal call, as before
        let one = run(
            crate::backend::BoundedMask::documents(&[0], 256).unwrap(),
            256,
        );
        assert_eq!((one.ragged, &one.mask), (None, &AttnMask::Causal));
        // offsets past int32 stay on flash
        let mut big = run(docs, 1338);
        big.q_rs = 1 << 21;
        big.o_rs = big.q_rs;
        big.hq = big.q_rs / 64;
        assert!(shape_supported(91400, &big, false).is_err());
    }
}

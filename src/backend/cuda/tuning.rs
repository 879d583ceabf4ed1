//! Picking a kernel by measurement: the choice shared by cuBLASLt's
//! algorithms (`UPIPE_GEMM_ALGO`) and cuDNN's engine configurations
//! (`UPIPE_CUDNN_PLAN`, in `cudnn/`).

use crate::error::{Error, Result};

/// Index of the fastest of `times_ms` (the first on ties; `None` when empty).
pub fn fastest(times_ms: &[f64]) -> Option<usize> {
    (0..times_ms.len()).reduce(|best, i| {
        if times_ms[i] < times_ms[best] {
            i
        } else {
            best
        }
    })
}

/// Which of cuBLASLt's heuristic algorithms a GEMM problem runs
/// (`UPIPE_GEMM_ALGO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPick {
    /// The heuristic's first algorithm (default).
    First,
    /// On a problem's first call that overwrites its output (`beta = 0`),
    /// time each of the heuristic's first [`GEMM_CANDIDATES`] algorithms on
    /// that call's own operands and keep the fastest. The workspace is the
    /// same for every candidate, so memory does not change.
    Fastest,
}

/// How many of the heuristic's algorithms `GemmPick::Fastest` times.
pub const GEMM_CANDIDATES: usize = 8;

impl std::str::FromStr for GemmPick {
    type Err = Error;
    fn from_str(v: &str) -> Result<GemmPick> {
        match v.trim() {
            "" | "first" => Ok(GemmPick::First),
            "fastest" => Ok(GemmPick::Fastest),
            _ => Err(Error::Config(format!(
                "UPIPE_GEMM_ALGO={v}: use `first` (the heuristic's first algorithm) or `fastest`"
            ))),
        }
    }
}

impl GemmPick {
    /// From `UPIPE_GEMM_ALGO` (unset: `first`).
    pub fn from_env() -> Result<GemmPick> {
        std::env::var("UPIPE_GEMM_ALGO").unwrap_or_default().parse()
    }

    /// Whether a call with this `beta` times the candidates of a problem not
    /// yet tuned: only a call that overwrites its output can run each
    /// candidate on its own operands and still leave the right result.
    pub fn tunes(self, beta: f32, candidates: usize) -> bool {
        self == GemmPick::Fastest && beta == 0.0 && candidates > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fastest_candidate_is_the_minimum_first_on_ties() {
        assert_eq!(fastest(&[]), None);
        assert_eq!(fastest(&[3.0]), Some(0));
        assert_eq!(fastest(&[7.0, 13.5]), Some(0));
        assert_eq!(fastest(&[13.5, 7.0, 9.0]), Some(1));
        assert_eq!(fastest(&[2.0, 1.0, 1.0]), Some(1));
    }

    #[test]
    fn gemm_pick_parses_and_names_the_fix() {
        assert_eq!("".parse::<GemmPick>().unwrap(), GemmPick::First);
        assert_eq!("first".parse::<GemmPick>().unwrap(), GemmPick::First);
        assert_eq!(" fastest ".parse::<GemmPick>().unwrap(), GemmPick::Fastest);
        let e = "3".parse::<GemmPick>().unwrap_err().to_string();
        assert!(
            e.contains("UPIPE_GEMM_ALGO=3") && e.contains("fastest"),
            "{e}"
        );
    }

    #[test]
    fn only_calls_that_overwrite_their_output_tune() {
        assert!(GemmPick::Fastest.tunes(0.0, 4));
        assert!(!GemmPick::Fastest.tunes(1.0, 4));
        assert!(!GemmPick::Fastest.tunes(0.0, 1));
        assert!(!GemmPick::First.tunes(0.0, 4));
    }
}

//! GPU time by operation (`UPIPE_PROFILE=1`): a pair of CUDA events around
//! each backend op and collective, summed by kind on request. Off by
//! default, when it costs one branch per op.
//!
//! Times are each op's own stream time (end event minus start event), so
//! with work on two streams at once (collectives beside kernels) the kinds
//! add up to more than the wall time: that excess is the overlap.

use crate::error::{Error, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// One kind's total over the recorded ops.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    pub kind: &'static str,
    pub ms: f64,
    pub calls: u64,
}

/// A finished op: its kind and start and end events.
type Recorded = (&'static str, CudaEvent, CudaEvent);

/// Recorded spans of one backend.
pub struct OpProfile {
    enabled: bool,
    spans: Mutex<Vec<Recorded>>,
}

/// An op in flight: records its end event when dropped.
pub struct Span<'a> {
    profile: &'a OpProfile,
    kind: &'static str,
    stream: &'a CudaStream,
    start: Option<CudaEvent>,
}

impl OpProfile {
    /// Enabled when `UPIPE_PROFILE` is set to anything but `0` or empty.
    pub fn from_env() -> Self {
        let on = std::env::var("UPIPE_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
        OpProfile::new(on)
    }

    pub fn new(enabled: bool) -> Self {
        OpProfile {
            enabled,
            spans: Mutex::new(Vec::new()),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Starts timing an op of `kind` queued next on `stream`; `None` when off.
    pub fn span<'a>(
        &'a self,
        kind: &'static str,
        stream: &'a CudaStream,
    ) -> Result<Option<Span<'a>>> {
        if !self.enabled {
            return Ok(None);
        }
        let start = timing_event(stream)?;
        Ok(Some(Span {
            profile: self,
            kind,
            stream,
            start: Some(start),
        }))
    }

    /// Waits for the recorded ops, returns their totals by kind (largest
    /// first) and forgets them.
    pub fn take(&self) -> Result<Vec<OpTime>> {
        let spans = std::mem::take(&mut *self.lock()?);
        let mut by_kind: BTreeMap<&'static str, (f64, u64)> = BTreeMap::new();
        for (kind, start, end) in spans {
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| Error::Backend(format!("profile: event timing: {e:?}")))?;
            let e = by_kind.entry(kind).or_default();
            e.0 += ms as f64;
            e.1 += 1;
        }
        let mut out: Vec<OpTime> = by_kind
            .into_iter()
            .map(|(kind, (ms, calls))| OpTime { kind, ms, calls })
            .collect();
        out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(out)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Vec<Recorded>>> {
        self.spans
            .lock()
            .map_err(|_| Error::Backend("profile: a thread panicked while recording".into()))
    }
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        // a failed end event drops the span rather than failing the op
        if let (Some(start), Ok(end)) = (self.start.take(), timing_event(self.stream))
            && let Ok(mut spans) = self.profile.lock()
        {
            spans.push((self.kind, start, end));
        }
    }
}

fn timing_event(stream: &CudaStream) -> Result<CudaEvent> {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| Error::Backend(format!("profile: record event: {e:?}")))
}

/// Formats totals as a table, with each kind's share of `wall_ms` when given.
pub fn table(times: &[OpTime], wall_ms: Option<f64>) -> String {
    let mut s = format!("{:<16} {:>10} {:>8} {:>7}\n", "op", "ms", "calls", "share");
    for t in times {
        let share = wall_ms.map_or(String::new(), |w| format!("{:.1}%", 100.0 * t.ms / w));
        s += &format!(
            "{:<16} {:>10.2} {:>8} {:>7}\n",
            t.kind, t.ms, t.calls, share
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lists_kinds_with_their_share_of_the_wall_time() {
        let times = [
            OpTime {
                kind: "attention_bwd",
                ms: 30.0,
                calls: 16,
            },
            OpTime {
                kind: "gemm",
                ms: 5.0,
                calls: 96,
            },
        ];
        let t = table(&times, Some(50.0));
        let rows: Vec<&str> = t.lines().collect();
        assert_eq!(rows.len(), 3);
        assert!(
            rows[1].starts_with("attention_bwd") && rows[1].ends_with("60.0%"),
            "{t}"
        );
        assert!(rows[2].contains("96") && rows[2].ends_with("10.0%"), "{t}");
        assert!(!table(&times, None).contains('%'));
    }

    #[test]
    fn off_unless_asked() {
        assert!(!OpProfile::new(false).enabled());
        assert!(OpProfile::new(true).enabled());
        assert!(OpProfile::new(false).take().unwrap().is_empty());
    }
}

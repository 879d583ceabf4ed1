//! GPU time by operation (`UPIPE_PROFILE=1`): a pair of CUDA events around
//! each backend op and collective, summed by kind on request; with
//! `UPIPE_PROFILE=shapes` also by kind and shape (GEMM `m×n×k`, copy
//! `rows×cols`, ...), to find which calls of a kind cost the time. Off by
//! default, when it costs one branch per op.
//!
//! Times are each op's own stream time (end event minus start event), so
//! with work on two streams at once (collectives beside kernels) the kinds
//! add up to more than the wall time: that excess is the overlap. A
//! collective's time includes waiting for its peers. The compute stream's
//! gaps between its ops are summed too (`OpTotals::idle_ms`): time it
//! waited for transfers it joins, or for the host. The host's share is the
//! part of each gap before the next op was even queued (host clock against
//! the events' clock, both counted from the first op; an upper bound:
//! [`stream_gaps`]).
//!
//! An op another op runs inside its span is part of the outer span, not one
//! of its own (`backend::profile::Outermost`). [`OpProfile::take_step`]
//! hands a whole step's spans to `backend::profile` (op classes, the
//! table, the trace), with the compute, copy and communication streams as
//! their own tracks.

use crate::backend::profile::{Outermost, Phase, RawSpan, StepProfile, Track};
use crate::error::{Error, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

/// One kind's (or one kind and shape's) total over the recorded ops.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The op kind, followed by its shape in a by-shape total.
    pub kind: String,
    pub ms: f64,
    pub calls: u64,
}

/// Totals of the recorded ops, largest first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpTotals {
    pub by_kind: Vec<OpTime>,
    /// Empty unless shapes are profiled (`UPIPE_PROFILE=shapes`).
    pub by_shape: Vec<OpTime>,
    /// Time the stream asked about sat between its recorded ops, from the
    /// first op's start to the last one's end: waiting for transfers it
    /// joins, for the host, or running work no span covers.
    pub idle_ms: f64,
    /// The part of `idle_ms` when the next op was not queued yet: the
    /// stream waited for the host.
    pub host_wait_ms: f64,
    /// `idle_ms` by the kind of op each gap came before, largest first.
    pub idle_before: Vec<OpTime>,
}

impl OpTotals {
    /// Divides every total by `passes` (per-pass figures).
    pub fn per_pass(mut self, passes: f64) -> Self {
        for t in self.by_kind.iter_mut().chain(self.by_shape.iter_mut()) {
            t.ms /= passes;
        }
        for t in self.idle_before.iter_mut() {
            t.ms /= passes;
        }
        self.idle_ms /= passes;
        self.host_wait_ms /= passes;
        self
    }
}

/// How much is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum ProfileLevel {
    Off = 0,
    Kinds = 1,
    Shapes = 2,
}

impl ProfileLevel {
    /// `UPIPE_PROFILE`: unset, empty or `0` = off, `shapes` = by shape too,
    /// anything else = by kind.
    pub fn parse(v: Option<&str>) -> Self {
        match v {
            None | Some("") | Some("0") => ProfileLevel::Off,
            Some("shapes") => ProfileLevel::Shapes,
            Some(_) => ProfileLevel::Kinds,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => ProfileLevel::Off,
            1 => ProfileLevel::Kinds,
            _ => ProfileLevel::Shapes,
        }
    }
}

/// A finished op: its kind, its shape (when recorded), start and end events
/// and the stream they were recorded on.
struct Recorded {
    kind: &'static str,
    shape: Option<String>,
    start: CudaEvent,
    end: CudaEvent,
    stream: usize,
    /// When the host queued it.
    queued: std::time::Instant,
    /// The backend's phase then.
    phase: Phase,
}

/// Recorded spans of one backend.
pub struct OpProfile {
    /// A [`ProfileLevel`]: set at creation, raised by [`OpProfile::enable`].
    level: AtomicU8,
    /// A [`Phase`], tagging the spans started now.
    phase: AtomicU8,
    spans: Mutex<Vec<Recorded>>,
    /// The stream whose gaps between ops [`OpTotals::idle_ms`] sums (the
    /// compute stream).
    idle_stream: Option<usize>,
    /// The copy stream, a track of its own in [`OpProfile::take_step`].
    copy_stream: Option<usize>,
}

/// An op in flight: records its end event when dropped.
pub struct Span<'a> {
    profile: &'a OpProfile,
    kind: &'static str,
    shape: Option<String>,
    stream: &'a CudaStream,
    start: Option<CudaEvent>,
    queued: std::time::Instant,
    phase: Phase,
    _outer: Outermost,
}

impl OpProfile {
    /// The level `UPIPE_PROFILE` asks for.
    pub fn from_env() -> Self {
        let v = std::env::var("UPIPE_PROFILE").ok();
        OpProfile::new(ProfileLevel::parse(v.as_deref()))
    }

    pub fn new(level: ProfileLevel) -> Self {
        OpProfile {
            level: AtomicU8::new(level as u8),
            phase: AtomicU8::new(Phase::Step as u8),
            spans: Mutex::new(Vec::new()),
            idle_stream: None,
            copy_stream: None,
        }
    }

    /// The same profile, with `stream` as the copy stream's track.
    pub fn with_copy_stream(self, stream: &CudaStream) -> Self {
        OpProfile {
            copy_stream: Some(stream.cu_stream() as usize),
            ..self
        }
    }

    /// Records by kind from now on, unless already recording (`--profile`).
    pub fn enable(&self) {
        self.level
            .fetch_max(ProfileLevel::Kinds as u8, Ordering::Relaxed);
    }

    /// Tags the spans started from now on with `phase`.
    pub fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
    }

    fn level(&self) -> ProfileLevel {
        ProfileLevel::from_u8(self.level.load(Ordering::Relaxed))
    }

    /// The same profile, summing the gaps between the ops of `stream`.
    pub fn with_idle_of(self, stream: &CudaStream) -> Self {
        OpProfile {
            idle_stream: Some(stream.cu_stream() as usize),
            ..self
        }
    }

    pub fn enabled(&self) -> bool {
        self.level() > ProfileLevel::Off
    }

    /// Starts timing an op of `kind` queued next on `stream`; `None` when off.
    pub fn span<'a>(
        &'a self,
        kind: &'static str,
        stream: &'a CudaStream,
    ) -> Result<Option<Span<'a>>> {
        self.span_shaped(kind, stream, String::new)
    }

    /// As [`Self::span`], with the op's shape (made only when shapes are profiled).
    pub fn span_shaped<'a>(
        &'a self,
        kind: &'static str,
        stream: &'a CudaStream,
        shape: impl FnOnce() -> String,
    ) -> Result<Option<Span<'a>>> {
        if !self.enabled() {
            return Ok(None);
        }
        let Some(outer) = Outermost::enter() else {
            return Ok(None);
        };
        let shape = (self.level() == ProfileLevel::Shapes).then(shape);
        let queued = std::time::Instant::now();
        let start = timing_event(stream)?;
        Ok(Some(Span {
            profile: self,
            kind,
            shape,
            stream,
            start: Some(start),
            queued,
            phase: Phase::from_u8(self.phase.load(Ordering::Relaxed)),
            _outer: outer,
        }))
    }

    /// Waits for the recorded ops and returns them as one step (times
    /// from the events, compute, copy and other streams as their own
    /// tracks), forgetting them; `None` when off.
    pub fn take_step(&self) -> Result<Option<StepProfile>> {
        if !self.enabled() {
            return Ok(None);
        }
        let spans = std::mem::take(&mut *self.lock()?);
        let Some(first) = spans.first() else {
            return Ok(Some(StepProfile::default()));
        };
        let ms = |to: &CudaEvent| {
            first
                .start
                .elapsed_ms(to)
                .map(f64::from)
                .map_err(|e| Error::Backend(format!("profile: event timing: {e:?}")))
        };
        let mut comm: Vec<usize> = Vec::new();
        let mut raw = Vec::with_capacity(spans.len());
        for r in &spans {
            let track = if Some(r.stream) == self.idle_stream {
                Track::Compute
            } else if Some(r.stream) == self.copy_stream {
                Track::Copy
            } else {
                let n = comm.iter().position(|&s| s == r.stream).unwrap_or_else(|| {
                    comm.push(r.stream);
                    comm.len() - 1
                });
                Track::Comm(n)
            };
            raw.push(RawSpan {
                kind: r.kind,
                phase: r.phase,
                track,
                start_ms: ms(&r.start)?,
                end_ms: ms(&r.end)?,
            });
        }
        Ok(Some(StepProfile::from_spans(raw)))
    }

    /// Waits for the recorded ops, returns their totals (with the idle time
    /// of the stream given to [`Self::with_idle_of`]) and forgets them.
    pub fn take(&self) -> Result<OpTotals> {
        let spans = std::mem::take(&mut *self.lock()?);
        let ms = |from: &CudaEvent, to: &CudaEvent| {
            from.elapsed_ms(to)
                .map(f64::from)
                .map_err(|e| Error::Backend(format!("profile: event timing: {e:?}")))
        };
        let watched: Vec<&Recorded> = spans
            .iter()
            .filter(|r| Some(r.stream) == self.idle_stream)
            .collect();
        let mut placed = Vec::with_capacity(watched.len());
        if let Some(first) = watched.first() {
            for r in &watched {
                placed.push(Placed {
                    kind: r.kind,
                    start: ms(&first.start, &r.start)?,
                    end: ms(&first.start, &r.end)?,
                    queued: 1e3 * r.queued.duration_since(first.queued).as_secs_f64(),
                });
            }
        }
        let gaps = stream_gaps(&placed);
        let mut timed = Vec::with_capacity(spans.len());
        for r in spans {
            timed.push((r.kind, r.shape, ms(&r.start, &r.end)?));
        }
        Ok(OpTotals {
            idle_ms: gaps.idle_ms,
            host_wait_ms: gaps.host_wait_ms,
            idle_before: gaps.idle_before,
            ..totals(timed)
        })
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Vec<Recorded>>> {
        self.spans
            .lock()
            .map_err(|_| Error::Backend("profile: a thread panicked while recording".into()))
    }
}

/// One op of the watched stream, in ms: its GPU start and end from the
/// first op's start, and when the host queued it from the first op's queueing.
struct Placed {
    kind: &'static str,
    start: f64,
    end: f64,
    queued: f64,
}

/// The watched stream's gaps between consecutive ops.
struct Gaps {
    idle_ms: f64,
    host_wait_ms: f64,
    idle_before: Vec<OpTime>,
}

/// Sums the gaps between consecutive ops, and the part of each gap before
/// the next op was queued (the stream then waited for the host). The two
/// clocks are aligned as if the first op started the moment it was queued;
/// it starts later (by the launch latency, or more if the stream was still
/// busy), and every op's host share is overstated by that much, never
/// understated: an upper bound.
fn stream_gaps(ops: &[Placed]) -> Gaps {
    let mut before: BTreeMap<&'static str, (f64, u64)> = BTreeMap::new();
    let (mut idle_ms, mut host_wait_ms) = (0.0, 0.0);
    for w in ops.windows(2) {
        let (prev, next) = (&w[0], &w[1]);
        let gap = (next.start - prev.end).max(0.0);
        idle_ms += gap;
        host_wait_ms += (next.queued - prev.end).clamp(0.0, gap);
        let e = before.entry(next.kind).or_default();
        e.0 += gap;
        e.1 += 1;
    }
    let mut idle_before: Vec<OpTime> = before
        .into_iter()
        .map(|(kind, (ms, calls))| OpTime {
            kind: kind.to_string(),
            ms,
            calls,
        })
        .collect();
    idle_before.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    Gaps {
        idle_ms,
        host_wait_ms,
        idle_before,
    }
}

/// Sums timed ops `(kind, shape, ms)` by kind and by kind and shape.
fn totals(timed: Vec<(&'static str, Option<String>, f64)>) -> OpTotals {
    let mut by_kind: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    let mut by_shape: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    for (kind, shape, ms) in timed {
        let e = by_kind.entry(kind.to_string()).or_default();
        e.0 += ms;
        e.1 += 1;
        if let Some(shape) = shape {
            let e = by_shape.entry(format!("{kind} {shape}")).or_default();
            e.0 += ms;
            e.1 += 1;
        }
    }
    let sorted = |m: BTreeMap<String, (f64, u64)>| {
        let mut v: Vec<OpTime> = m
            .into_iter()
            .map(|(kind, (ms, calls))| OpTime { kind, ms, calls })
            .collect();
        v.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        v
    };
    OpTotals {
        by_kind: sorted(by_kind),
        by_shape: sorted(by_shape),
        ..OpTotals::default()
    }
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        // a failed end event drops the span rather than failing the op
        if let (Some(start), Ok(end)) = (self.start.take(), timing_event(self.stream))
            && let Ok(mut spans) = self.profile.lock()
        {
            spans.push(Recorded {
                kind: self.kind,
                shape: self.shape.take(),
                start,
                end,
                stream: self.stream.cu_stream() as usize,
                queued: self.queued,
                phase: self.phase,
            });
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
    let w = times
        .iter()
        .map(|t| t.kind.len())
        .max()
        .unwrap_or(0)
        .max(16);
    let mut s = format!("{:<w$} {:>10} {:>8} {:>7}\n", "op", "ms", "calls", "share");
    for t in times {
        let share = wall_ms.map_or(String::new(), |w| format!("{:.1}%", 100.0 * t.ms / w));
        s += &format!(
            "{:<w$} {:>10.2} {:>8} {:>7}\n",
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
                kind: "attention_bwd".into(),
                ms: 30.0,
                calls: 16,
            },
            OpTime {
                kind: "gemm".into(),
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
        assert_eq!(ProfileLevel::parse(None), ProfileLevel::Off);
        assert_eq!(ProfileLevel::parse(Some("0")), ProfileLevel::Off);
        assert_eq!(ProfileLevel::parse(Some("1")), ProfileLevel::Kinds);
        assert_eq!(ProfileLevel::parse(Some("shapes")), ProfileLevel::Shapes);
        assert!(!OpProfile::new(ProfileLevel::Off).enabled());
        assert!(OpProfile::new(ProfileLevel::Kinds).enabled());
        let none = OpProfile::new(ProfileLevel::Off).take().unwrap();
        assert!(none.by_kind.is_empty() && none.by_shape.is_empty());
    }

    #[test]
    fn gaps_split_into_waiting_for_the_host_and_for_other_streams() {
        let op = |kind, start, end, queued| Placed {
            kind,
            start,
            end,
            queued,
        };
        let g = stream_gaps(&[
            op("gemm", 0.0, 1.0, 0.0),
            // queued long before the gemm ended: a 0.5 ms wait for a transfer
            op("copy", 1.5, 2.0, 0.1),
            // queued 0.25 ms after the copy ended, started 0.3 ms after it
            op("gemm", 2.3, 3.0, 2.25),
            // back to back
            op("copy", 3.0, 3.5, 0.2),
        ]);
        assert!((g.idle_ms - 0.8).abs() < 1e-12);
        assert!((g.host_wait_ms - 0.25).abs() < 1e-12);
        let before: Vec<(&str, u64)> = g
            .idle_before
            .iter()
            .map(|o| (o.kind.as_str(), o.calls))
            .collect();
        assert_eq!(before, [("copy", 2), ("gemm", 1)]);
        assert!((g.idle_before[0].ms - 0.5).abs() < 1e-12);
        let none = stream_gaps(&[]);
        assert_eq!((none.idle_ms, none.host_wait_ms), (0.0, 0.0));
    }

    #[test]
    fn totals_by_kind_and_by_shape() {
        let t = totals(vec![
            ("gemm", Some("8x8x8".into()), 1.0),
            ("gemm", Some("4x4x4".into()), 2.0),
            ("gemm", Some("8x8x8".into()), 4.0),
            ("copy", None, 0.5),
        ]);
        let kinds: Vec<(&str, f64, u64)> = t
            .by_kind
            .iter()
            .map(|o| (o.kind.as_str(), o.ms, o.calls))
            .collect();
        assert_eq!(kinds, [("gemm", 7.0, 3), ("copy", 0.5, 1)]);
        let shapes: Vec<(&str, f64, u64)> = t
            .by_shape
            .iter()
            .map(|o| (o.kind.as_str(), o.ms, o.calls))
            .collect();
        assert_eq!(shapes, [("gemm 8x8x8", 5.0, 2), ("gemm 4x4x4", 2.0, 1)]);
        let per = t.per_pass(2.0);
        assert_eq!(per.by_kind[0].ms, 3.5);
        assert_eq!(per.by_shape[1].ms, 1.0);
    }
}

//! A whole step's profile, device-independent (`upipe train --profile`,
//! `--trace`): the class of each op kind ([`op_class`]), one step's timed
//! ops ([`StepProfile`]) with their totals by class and the compute track's
//! idle time ([`ClassTotals`]), the table that shows them, and the
//! Chrome/Perfetto trace of the step. The CPU backend times its ops on the
//! host clock here ([`HostProfile`]); CUDA records events per stream
//! (`cuda/profile.rs`) and hands its spans over as [`RawSpan`]s.
//!
//! Ops that run while the decoder recomputes a checkpointed block's forward
//! in backward carry [`Phase::Recompute`] and count as
//! [`OpClass::Recompute`], except transfers off the compute track (copy
//! stream, collectives), which keep their own class.

use crate::error::{Error, Result};
use std::cell::Cell;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Instant;

/// What an op's time is counted as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpClass {
    Gemm,
    AttnFwd,
    AttnBwd,
    /// Any compute op of a checkpointed block's forward rerun in backward.
    Recompute,
    /// Norms, RoPE, SwiGLU, embedding, axpy.
    Elementwise,
    Loss,
    /// AdamW and the gradient norm.
    Optimizer,
    /// Device copies, fills, host↔device copies (compute or copy stream).
    Copy,
    Collective,
}

impl OpClass {
    pub const ALL: [OpClass; 9] = [
        OpClass::Gemm,
        OpClass::AttnFwd,
        OpClass::AttnBwd,
        OpClass::Recompute,
        OpClass::Elementwise,
        OpClass::Loss,
        OpClass::Optimizer,
        OpClass::Copy,
        OpClass::Collective,
    ];

    /// Its short name (JSON key `{name}_ms`, trace category).
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Gemm => "gemm",
            OpClass::AttnFwd => "attn_fwd",
            OpClass::AttnBwd => "attn_bwd",
            OpClass::Recompute => "recompute",
            OpClass::Elementwise => "elementwise",
            OpClass::Loss => "loss",
            OpClass::Optimizer => "optimizer",
            OpClass::Copy => "copy",
            OpClass::Collective => "collective",
        }
    }
}

/// The class of an op kind as the backends record it (the names of
/// `span`/`span_shaped` in `backend/`, NCCL's in `comm/nccl.rs`); a kind
/// not listed is elementwise.
pub fn op_class(kind: &str) -> OpClass {
    match kind {
        "gemm" | "fp8_gemm" => OpClass::Gemm,
        "attention_fwd" | "lse_merge" => OpClass::AttnFwd,
        "attention_bwd" => OpClass::AttnBwd,
        "cross_entropy" => OpClass::Loss,
        "adamw" | "adamw_multi" | "sum_squares" => OpClass::Optimizer,
        "copy" | "copy_start" | "memset" | "fill" | "upload" | "download" => OpClass::Copy,
        "all_to_all" | "send_recv" | "shift" | "all_gather" | "reduce_scatter" | "all_reduce" => {
            OpClass::Collective
        }
        // rms_norm, rms_norm_bwd, add_rms_norm, rms_norm_bwd_add, rope,
        // gated_act, gated_act_bwd, embedding, embedding_bwd, axpy, add_bias_rows,
        // bias_grad
        _ => OpClass::Elementwise,
    }
}

/// The class of an op of `kind` recorded in `phase` on `track`.
pub fn classify(kind: &str, phase: Phase, track: Track) -> OpClass {
    let class = op_class(kind);
    match (phase, track) {
        (Phase::Recompute, Track::Compute) if class != OpClass::Collective => OpClass::Recompute,
        _ => class,
    }
}

/// What the ops queued now belong to (set by the decoder).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Step = 0,
    /// A checkpointed block's forward rerun in backward.
    Recompute = 1,
}

impl Phase {
    /// The phase stored as [`Phase`]` as u8`.
    pub fn from_u8(v: u8) -> Phase {
        if v == Phase::Recompute as u8 {
            Phase::Recompute
        } else {
            Phase::Step
        }
    }
}

/// Where an op ran: a track of the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Track {
    /// The compute stream (the CPU's calling thread).
    Compute,
    /// The copy stream (`Backend::copy_start`).
    Copy,
    /// The `n`th communication stream.
    Comm(usize),
}

impl Track {
    /// The trace's thread id.
    pub fn tid(self) -> usize {
        match self {
            Track::Compute => 1,
            Track::Copy => 2,
            Track::Comm(n) => 3 + n,
        }
    }

    pub fn name(self) -> String {
        match self {
            Track::Compute => "compute stream".into(),
            Track::Copy => "copy stream".into(),
            Track::Comm(0) => "communication stream".into(),
            Track::Comm(n) => format!("communication stream {n}"),
        }
    }
}

/// A backend's record of one op: times in ms on any clock shared by the step's ops.
#[derive(Debug, Clone, PartialEq)]
pub struct RawSpan {
    pub kind: &'static str,
    pub phase: Phase,
    pub track: Track,
    pub start_ms: f64,
    pub end_ms: f64,
}

/// One timed op of a step, in ms from the step's first op's start.
#[derive(Debug, Clone, PartialEq)]
pub struct OpEvent {
    pub kind: &'static str,
    pub class: OpClass,
    pub track: Track,
    pub start_ms: f64,
    pub dur_ms: f64,
}

/// The ops one backend recorded over a step, sorted by start.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepProfile {
    pub events: Vec<OpEvent>,
}

/// A step's time by class, and the compute track's gaps between ops.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ClassTotals {
    /// Indexed by [`OpClass`] in the order of [`OpClass::ALL`].
    pub ms: [f64; OpClass::ALL.len()],
    pub calls: [u64; OpClass::ALL.len()],
    /// Time the compute track sat between its ops, from its first op's
    /// start to its last one's end (waiting for transfers, the host, peers).
    pub idle_ms: f64,
}

impl StepProfile {
    /// The step of `spans`: classified, times from the earliest start, sorted.
    pub fn from_spans(spans: Vec<RawSpan>) -> StepProfile {
        let origin = spans
            .iter()
            .map(|s| s.start_ms)
            .fold(f64::INFINITY, f64::min);
        let mut events: Vec<OpEvent> = spans
            .into_iter()
            .map(|s| OpEvent {
                kind: s.kind,
                class: classify(s.kind, s.phase, s.track),
                track: s.track,
                start_ms: s.start_ms - origin,
                dur_ms: (s.end_ms - s.start_ms).max(0.0),
            })
            .collect();
        events.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        StepProfile { events }
    }

    /// Time by class, and the compute track's idle time.
    pub fn totals(&self) -> ClassTotals {
        let mut t = ClassTotals::default();
        let mut end: Option<f64> = None;
        for e in &self.events {
            let i = e.class as usize;
            t.ms[i] += e.dur_ms;
            t.calls[i] += 1;
            if e.track == Track::Compute {
                if let Some(prev) = end {
                    t.idle_ms += (e.start_ms - prev).max(0.0);
                }
                let this = e.start_ms + e.dur_ms;
                end = Some(end.map_or(this, |p: f64| p.max(this)));
            }
        }
        t
    }

    /// The Chrome trace-event JSON of the step (µs), one track per stream,
    /// under process `rank`.
    pub fn trace_json(&self, rank: usize) -> serde_json::Value {
        let mut tracks: Vec<Track> = self.events.iter().map(|e| e.track).collect();
        tracks.push(Track::Compute);
        tracks.sort();
        tracks.dedup();
        let mut out = vec![serde_json::json!({
            "name": "process_name", "ph": "M", "pid": rank, "tid": 0,
            "args": {"name": format!("rank {rank}")},
        })];
        for t in tracks {
            out.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": rank, "tid": t.tid(),
                "args": {"name": t.name()},
            }));
            out.push(serde_json::json!({
                "name": "thread_sort_index", "ph": "M", "pid": rank, "tid": t.tid(),
                "args": {"sort_index": t.tid()},
            }));
        }
        for e in &self.events {
            out.push(serde_json::json!({
                "name": e.kind,
                "cat": e.class.name(),
                "ph": "X",
                "ts": 1e3 * e.start_ms,
                "dur": 1e3 * e.dur_ms,
                "pid": rank,
                "tid": e.track.tid(),
            }));
        }
        serde_json::json!({ "traceEvents": out, "displayTimeUnit": "ms" })
    }

    /// Writes [`Self::trace_json`] to `path` (`--trace`).
    pub fn write_trace(&self, path: &Path, rank: usize) -> Result<()> {
        let text = serde_json::to_string(&self.trace_json(rank))
            .map_err(|e| Error::Backend(format!("profile: trace JSON: {e}")))?;
        std::fs::write(path, text).map_err(|e| Error::io(format!("--trace {}", path.display()), e))
    }
}

impl ClassTotals {
    pub fn ms_of(&self, c: OpClass) -> f64 {
        self.ms[c as usize]
    }

    /// Every class's time, and idle: `{"gemm_ms": .., .., "idle_ms": ..}`.
    pub fn to_map(&self) -> std::collections::BTreeMap<String, f64> {
        let mut m: std::collections::BTreeMap<String, f64> = OpClass::ALL
            .iter()
            .map(|&c| (format!("{}_ms", c.name()), self.ms_of(c)))
            .collect();
        m.insert("idle_ms".into(), self.idle_ms);
        m
    }

    /// The classes as a table with their share of `wall_ms`, and idle.
    pub fn table(&self, wall_ms: f64) -> String {
        let share = |ms: f64| format!("{:.1}%", 100.0 * ms / wall_ms.max(f64::MIN_POSITIVE));
        let mut s = format!("{:<12} {:>10} {:>8} {:>7}\n", "class", "ms", "ops", "share");
        for c in OpClass::ALL {
            let (ms, calls) = (self.ms_of(c), self.calls[c as usize]);
            s += &format!(
                "{:<12} {:>10.2} {:>8} {:>7}\n",
                c.name(),
                ms,
                calls,
                share(ms)
            );
        }
        s += &format!(
            "{:<12} {:>10.2} {:>8} {:>7}\n",
            "idle",
            self.idle_ms,
            "",
            share(self.idle_ms)
        );
        s
    }
}

thread_local! {
    /// Whether this thread is inside a recorded span: an op another op
    /// calls is part of the outer one, not a span of its own.
    static IN_SPAN: Cell<bool> = const { Cell::new(false) };
}

/// This thread's outermost span, while it lives (`None`: already in one).
pub struct Outermost(());

impl Outermost {
    pub fn enter() -> Option<Outermost> {
        IN_SPAN.with(|c| (!c.replace(true)).then_some(Outermost(())))
    }
}

impl Drop for Outermost {
    fn drop(&mut self) {
        IN_SPAN.with(|c| c.set(false));
    }
}

/// Host wall-clock spans of a synchronous backend (the CPU): off until
/// [`HostProfile::enable`], when a span costs one branch.
#[derive(Default)]
pub struct HostProfile {
    on: AtomicBool,
    phase: AtomicU8,
    spans: Mutex<Vec<HostRecord>>,
}

/// A finished host span: kind, phase, track, start, end.
type HostRecord = (&'static str, Phase, Track, Instant, Instant);

/// An op being timed on the host; recorded when dropped.
pub struct HostSpan<'a> {
    profile: &'a HostProfile,
    kind: &'static str,
    phase: Phase,
    track: Track,
    start: Instant,
    _outer: Outermost,
}

impl HostProfile {
    pub fn enable(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    pub fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
    }

    /// Times an op of `kind` on `track`; `None` when off or inside another span.
    pub fn span(&self, kind: &'static str, track: Track) -> Option<HostSpan<'_>> {
        if !self.enabled() {
            return None;
        }
        Some(HostSpan {
            profile: self,
            kind,
            phase: Phase::from_u8(self.phase.load(Ordering::Relaxed)),
            track,
            _outer: Outermost::enter()?,
            start: Instant::now(),
        })
    }

    /// The spans since the last call (forgotten here); `None` when off.
    pub fn take(&self) -> Result<Option<StepProfile>> {
        if !self.enabled() {
            return Ok(None);
        }
        let spans = std::mem::take(&mut *self.lock()?);
        let Some(origin) = spans.iter().map(|s| s.3).min() else {
            return Ok(Some(StepProfile::default()));
        };
        let ms = |t: Instant| 1e3 * t.duration_since(origin).as_secs_f64();
        let raw = spans
            .into_iter()
            .map(|(kind, phase, track, start, end)| RawSpan {
                kind,
                phase,
                track,
                start_ms: ms(start),
                end_ms: ms(end),
            })
            .collect();
        Ok(Some(StepProfile::from_spans(raw)))
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Vec<HostRecord>>> {
        self.spans
            .lock()
            .map_err(|_| Error::Backend("profile: a thread panicked while recording".into()))
    }
}

impl Drop for HostSpan<'_> {
    fn drop(&mut self) {
        let end = Instant::now();
        if let Ok(mut spans) = self.profile.spans.lock() {
            spans.push((self.kind, self.phase, self.track, self.start, end));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind the backends and NCCL record, with its class.
    const KINDS: &[(&str, OpClass)] = &[
        ("gemm", OpClass::Gemm),
        ("fp8_gemm", OpClass::Gemm),
        ("fp8_quantize", OpClass::Elementwise),
        ("attention_fwd", OpClass::AttnFwd),
        ("lse_merge", OpClass::AttnFwd),
        ("attention_bwd", OpClass::AttnBwd),
        ("rms_norm", OpClass::Elementwise),
        ("rms_norm_bwd", OpClass::Elementwise),
        ("add_rms_norm", OpClass::Elementwise),
        ("rms_norm_bwd_add", OpClass::Elementwise),
        ("rope", OpClass::Elementwise),
        ("gated_act", OpClass::Elementwise),
        ("gated_act_bwd", OpClass::Elementwise),
        ("embedding", OpClass::Elementwise),
        ("embedding_bwd", OpClass::Elementwise),
        ("axpy", OpClass::Elementwise),
        ("add_bias_rows", OpClass::Elementwise),
        ("bias_grad", OpClass::Elementwise),
        ("cross_entropy", OpClass::Loss),
        ("adamw", OpClass::Optimizer),
        ("adamw_multi", OpClass::Optimizer),
        ("sum_squares", OpClass::Optimizer),
        ("copy", OpClass::Copy),
        ("copy_start", OpClass::Copy),
        ("memset", OpClass::Copy),
        ("fill", OpClass::Copy),
        ("upload", OpClass::Copy),
        ("download", OpClass::Copy),
        ("all_to_all", OpClass::Collective),
        ("send_recv", OpClass::Collective),
        ("shift", OpClass::Collective),
        ("all_gather", OpClass::Collective),
        ("reduce_scatter", OpClass::Collective),
        ("all_reduce", OpClass::Collective),
    ];

    /// The kinds named by `span("..."`, `span_shaped("..."` and `issue("..."` in `src`.
    fn recorded(src: &str) -> Vec<String> {
        let mut out = Vec::new();
        for call in ["span(\"", "span_shaped(\"", "issue(\""] {
            for (i, _) in src.match_indices(call) {
                let rest = &src[i + call.len()..];
                out.push(rest[..rest.find('"').unwrap()].to_string());
            }
        }
        out
    }

    #[test]
    fn every_recorded_kind_has_its_class() {
        for (kind, class) in KINDS {
            assert_eq!(op_class(kind), *class, "{kind}");
        }
        let sources = [
            include_str!("cpu/mod.rs"),
            include_str!("cuda/mod.rs"),
            include_str!("cuda/backend.rs"),
            include_str!("cuda/ops.rs"),
            include_str!("cuda/memory_ops.rs"),
            include_str!("cuda/attention_ops.rs"),
            include_str!("cuda/elementwise_ops.rs"),
            include_str!("cuda/fused_update.rs"),
            include_str!("cuda/gemm.rs"),
            include_str!("cuda/gemm_ops.rs"),
            include_str!("cuda/fp8_ops.rs"),
            include_str!("cuda/attention.rs"),
            include_str!("../comm/nccl/group.rs"),
            include_str!("../comm/nccl/exchange_window.rs"),
        ];
        let found: Vec<String> = sources.iter().flat_map(|s| recorded(s)).collect();
        assert!(found.len() > 40, "{found:?}");
        for kind in &found {
            assert!(
                KINDS.iter().any(|(k, _)| k == kind),
                "op kind {kind} is recorded but not listed here with its class"
            );
        }
    }

    #[test]
    fn recompute_takes_compute_ops_but_not_transfers() {
        let r = Phase::Recompute;
        assert_eq!(classify("gemm", r, Track::Compute), OpClass::Recompute);
        assert_eq!(
            classify("attention_fwd", r, Track::Compute),
            OpClass::Recompute
        );
        assert_eq!(classify("copy_start", r, Track::Copy), OpClass::Copy);
        assert_eq!(
            classify("all_to_all", r, Track::Comm(0)),
            OpClass::Collective
        );
        assert_eq!(classify("gemm", Phase::Step, Track::Compute), OpClass::Gemm);
        assert_eq!(Phase::from_u8(Phase::Recompute as u8), Phase::Recompute);
        assert_eq!(Phase::from_u8(0), Phase::Step);
    }

    fn span(kind: &'static str, track: Track, start_ms: f64, end_ms: f64) -> RawSpan {
        RawSpan {
            kind,
            phase: Phase::Step,
            track,
            start_ms,
            end_ms,
        }
    }

    fn example() -> StepProfile {
        StepProfile::from_spans(vec![
            span("gemm", Track::Compute, 12.0, 13.0),
            span("all_to_all", Track::Comm(0), 12.5, 14.0),
            span("attention_fwd", Track::Compute, 10.0, 11.5),
            // 1 ms waiting for the exchange
            span("attention_bwd", Track::Compute, 14.0, 16.0),
            span("copy_start", Track::Copy, 13.0, 13.5),
        ])
    }

    #[test]
    fn totals_by_class_and_compute_idle() {
        let p = example();
        assert_eq!(p.events[0].kind, "attention_fwd");
        assert_eq!(p.events[0].start_ms, 0.0);
        assert!(p.events.windows(2).all(|w| w[0].start_ms <= w[1].start_ms));
        let t = p.totals();
        assert_eq!(t.ms_of(OpClass::Gemm), 1.0);
        assert_eq!(t.ms_of(OpClass::AttnFwd), 1.5);
        assert_eq!(t.ms_of(OpClass::AttnBwd), 2.0);
        assert_eq!(t.ms_of(OpClass::Collective), 1.5);
        assert_eq!(t.ms_of(OpClass::Copy), 0.5);
        assert_eq!(t.calls[OpClass::Gemm as usize], 1);
        // gaps 11.5..12 and 13..14 on the compute track
        assert!((t.idle_ms - 1.5).abs() < 1e-12, "{}", t.idle_ms);
        let m = t.to_map();
        assert_eq!(m.len(), OpClass::ALL.len() + 1);
        assert_eq!(m["gemm_ms"], 1.0);
        assert_eq!(m["idle_ms"], t.idle_ms);
        assert_eq!(StepProfile::default().totals(), ClassTotals::default());
    }

    #[test]
    fn table_lists_every_class_and_idle_with_shares() {
        let t = example().totals().table(10.0);
        let rows: Vec<&str> = t.lines().collect();
        assert_eq!(rows.len(), 2 + OpClass::ALL.len());
        let bwd = rows.iter().find(|r| r.starts_with("attn_bwd")).unwrap();
        assert!(bwd.ends_with("20.0%"), "{t}");
        assert!(rows.last().unwrap().starts_with("idle"), "{t}");
    }

    #[test]
    fn trace_has_a_track_per_stream_and_complete_events_in_us() {
        let v = example().trace_json(0);
        let text = serde_json::to_string(&v).unwrap();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        let ev = back["traceEvents"].as_array().unwrap();
        let names: Vec<(u64, &str)> = ev
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            names,
            [
                (1, "compute stream"),
                (2, "copy stream"),
                (3, "communication stream")
            ]
        );
        let ops: Vec<&serde_json::Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(ops.len(), 5);
        let a2a = ops.iter().find(|e| e["name"] == "all_to_all").unwrap();
        assert_eq!(
            (a2a["ts"].as_f64(), a2a["dur"].as_f64()),
            (Some(2500.0), Some(1500.0))
        );
        assert_eq!(
            (a2a["cat"].as_str(), a2a["tid"].as_u64()),
            (Some("collective"), Some(3))
        );
    }

    #[test]
    fn host_spans_are_off_until_enabled_and_nested_ops_are_the_outer_one() {
        let p = HostProfile::default();
        assert!(p.span("gemm", Track::Compute).is_none());
        assert_eq!(p.take().unwrap(), None);
        p.enable();
        {
            let _outer = p.span("attention_bwd", Track::Compute);
            assert!(p.span("memset", Track::Compute).is_none(), "nested");
        }
        p.set_phase(Phase::Recompute);
        drop(p.span("gemm", Track::Compute));
        p.set_phase(Phase::Step);
        drop(p.span("copy_start", Track::Copy));
        let step = p.take().unwrap().unwrap();
        let got: Vec<(&str, OpClass, Track)> = step
            .events
            .iter()
            .map(|e| (e.kind, e.class, e.track))
            .collect();
        assert_eq!(
            got,
            [
                ("attention_bwd", OpClass::AttnBwd, Track::Compute),
                ("gemm", OpClass::Recompute, Track::Compute),
                ("copy_start", OpClass::Copy, Track::Copy),
            ]
        );
        assert!(
            step.events
                .iter()
                .all(|e| e.dur_ms >= 0.0 && e.start_ms >= 0.0)
        );
        assert_eq!(p.take().unwrap().unwrap().events.len(), 0, "taken once");
    }
}

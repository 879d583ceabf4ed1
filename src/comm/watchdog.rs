//! Collective watchdog policy: when has a collective waited too long?
//!
//! A rank whose peer died or hung would otherwise wait forever inside an
//! NCCL kernel (PyTorch's answer is its NCCL watchdog with a process-group
//! timeout). This module is the decision, free of CUDA and NCCL so it is
//! tested on the CPU: a [`Watchdog`] holds the collectives in flight (what
//! each one is, when it was issued, a probe that says whether it finished)
//! and [`Watchdog::poll`] drains the finished ones, reports an asynchronous
//! error the caller's probe found, and reports a [`Failure::Timeout`] once the
//! oldest unfinished collective has waited the configured time. The NCCL
//! process groups ([`super::nccl`]) run it on a background thread with
//! `cuEventQuery` on each collective's end event as the probe and
//! `ncclCommGetAsyncError` as the asynchronous-error check.

use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Seconds a collective may take before the watchdog fails it (0: no watchdog).
pub const TIMEOUT_VAR: &str = "UPIPE_NCCL_TIMEOUT_S";

/// The timeout when [`TIMEOUT_VAR`] is unset: 10 minutes, as PyTorch's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// Longest accepted timeout (a year): beyond it the value is surely a typo.
const MAX_TIMEOUT_S: f64 = 365.0 * 24.0 * 3600.0;

/// Parses a [`TIMEOUT_VAR`] value: seconds (decimals allowed), `0` turns the
/// watchdog off (`None`), unset means [`DEFAULT_TIMEOUT`].
pub fn parse_timeout(value: Option<&str>) -> Result<Option<Duration>> {
    let Some(raw) = value else {
        return Ok(Some(DEFAULT_TIMEOUT));
    };
    let s = raw.trim();
    let bad = |why: &str| {
        Err(Error::Config(format!(
            "{TIMEOUT_VAR}={raw:?} {why}; give the seconds a collective may take \
             (e.g. {TIMEOUT_VAR}=1800), or 0 to turn the NCCL watchdog off"
        )))
    };
    let secs: f64 = match s.parse() {
        Ok(v) => v,
        Err(_) => return bad("is not a number of seconds"),
    };
    if !secs.is_finite() || secs < 0.0 {
        return bad("is not a non-negative number of seconds");
    }
    if secs > MAX_TIMEOUT_S {
        return bad("is longer than a year");
    }
    if secs == 0.0 {
        return Ok(None);
    }
    let d = Duration::from_secs_f64(secs);
    if d < Duration::from_millis(1) {
        return bad("is below a millisecond");
    }
    Ok(Some(d))
}

/// [`parse_timeout`] of this process's [`TIMEOUT_VAR`].
pub fn timeout_from_env() -> Result<Option<Duration>> {
    match std::env::var(TIMEOUT_VAR) {
        Ok(v) => parse_timeout(Some(&v)),
        Err(std::env::VarError::NotPresent) => parse_timeout(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::Config(format!(
            "{TIMEOUT_VAR}={v:?} is not a number of seconds"
        ))),
    }
}

/// How often a watchdog with `timeout` should poll: a tenth of the timeout,
/// between 10 and 100 ms (so a failure is reported at most ~100 ms late).
pub fn poll_interval(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(10), Duration::from_millis(100))
}

/// One unit of work the watchdog follows (an issued collective).
pub trait InFlight {
    /// Whether it has finished (`Err`: finding out failed, with why).
    fn finished(&self) -> std::result::Result<bool, String>;
    /// What it is, for the error message (e.g. `all_to_all 33554432 B on group ulysses`).
    fn describe(&self) -> String;
}

/// Why the watchdog gave up on the collectives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The oldest unfinished collective was issued `waited` ago, at least `timeout`.
    Timeout {
        what: String,
        waited: Duration,
        timeout: Duration,
    },
    /// The communication library reported an error of its own (`text`) while
    /// `in_flight` (if any) was the oldest unfinished collective.
    AsyncError {
        text: String,
        in_flight: Option<String>,
    },
    /// Asking whether `what` finished failed (e.g. a CUDA error).
    Probe { what: String, text: String },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peer = "a peer rank likely died or hung — see its log";
        match self {
            Failure::Timeout {
                what,
                waited,
                timeout,
            } => write!(
                f,
                "NCCL watchdog: {what} has not finished after {:.1} s (timeout {} s): {peer}; \
                 if it is only slow, raise {TIMEOUT_VAR} (seconds; 0 turns the watchdog off)",
                waited.as_secs_f64(),
                timeout.as_secs_f64()
            ),
            Failure::AsyncError { text, in_flight } => {
                write!(
                    f,
                    "NCCL watchdog: NCCL reported an asynchronous error: {text}"
                )?;
                if let Some(w) = in_flight {
                    write!(f, " (while {w} was in flight)")?;
                }
                write!(
                    f,
                    "; {peer} (collectives are also failed after {TIMEOUT_VAR} seconds)"
                )
            }
            Failure::Probe { what, text } => write!(
                f,
                "NCCL watchdog: checking whether {what} finished failed: {text}; \
                 the GPU or its driver reported an error (see the log above)"
            ),
        }
    }
}

/// A followed collective: `work`, issued at `issued`. Where the queue was full,
/// it stands for a run of collectives (`merged` later ones folded in; see
/// [`Watchdog::push`]) and `first` describes the one that opened the run.
struct Entry<W> {
    work: W,
    issued: Instant,
    first: Option<String>,
    merged: usize,
}

impl<W: InFlight> Entry<W> {
    fn describe(&self) -> String {
        match &self.first {
            None => self.work.describe(),
            Some(first) => format!(
                "{first} (or one of the {} collectives issued after it, the last being {})",
                self.merged,
                self.work.describe()
            ),
        }
    }
}

/// The collectives in flight and the timeout they are held to.
pub struct Watchdog<W> {
    timeout: Duration,
    capacity: usize,
    queue: VecDeque<Entry<W>>,
}

impl<W: InFlight> Watchdog<W> {
    /// A watchdog failing collectives unfinished after `timeout`, following at
    /// most `capacity` (at least 1) entries.
    pub fn new(timeout: Duration, capacity: usize) -> Self {
        Watchdog {
            timeout,
            capacity: capacity.max(1),
            queue: VecDeque::new(),
        }
    }

    /// The timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Entries followed (finished ones leave at the next [`Watchdog::poll`]).
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether nothing is followed.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Follows `work`, issued at `issued`. When the queue is full the newest
    /// entry absorbs `work`: it keeps its own (earlier) issue time and takes
    /// `work`'s probe, which is right for work that completes in issue order
    /// (one stream): `work` finished means the entry's earlier work did too,
    /// and the run is timed from its first issue, so no hang goes unseen
    /// (at worst a run is failed early, when the queue holds `capacity`
    /// collectives in flight for longer than the timeout).
    pub fn push(&mut self, work: W, issued: Instant) {
        if self.queue.len() >= self.capacity {
            let back = self.queue.back_mut().expect("capacity is at least 1");
            if back.first.is_none() {
                back.first = Some(back.work.describe());
            }
            back.merged += 1;
            back.work = work;
            return;
        }
        self.queue.push_back(Entry {
            work,
            issued,
            first: None,
            merged: 0,
        });
    }

    /// One watchdog step at `now`: drops every finished entry, then reports
    /// (first match wins) a failed probe, an error from `async_error` (the
    /// communication library's own error state, checked every step), or a
    /// timeout of the oldest unfinished entry (`now - issued >= timeout`).
    pub fn poll(
        &mut self,
        now: Instant,
        async_error: impl FnOnce() -> Option<String>,
    ) -> Option<Failure> {
        let mut probe_failure = None;
        self.queue.retain(|e| match e.work.finished() {
            Ok(done) => !done,
            Err(text) => {
                if probe_failure.is_none() {
                    probe_failure = Some(Failure::Probe {
                        what: e.describe(),
                        text,
                    });
                }
                true
            }
        });
        if probe_failure.is_some() {
            return probe_failure;
        }
        let oldest = self.queue.iter().min_by_key(|e| e.issued);
        if let Some(text) = async_error() {
            return Some(Failure::AsyncError {
                text,
                in_flight: oldest.map(Entry::describe),
            });
        }
        let e = oldest?;
        let waited = now.saturating_duration_since(e.issued);
        (waited >= self.timeout).then(|| Failure::Timeout {
            what: e.describe(),
            waited,
            timeout: self.timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

    /// Work that finishes when its flag is set.
    #[derive(Clone)]
    struct Flag {
        name: String,
        done: Arc<AtomicBool>,
    }

    impl Flag {
        fn new(name: &str) -> Self {
            Flag {
                name: name.into(),
                done: Arc::new(AtomicBool::new(false)),
            }
        }
        fn finish(&self) {
            self.done.store(true, Ordering::SeqCst);
        }
    }

    impl InFlight for Flag {
        fn finished(&self) -> std::result::Result<bool, String> {
            Ok(self.done.load(Ordering::SeqCst))
        }
        fn describe(&self) -> String {
            self.name.clone()
        }
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn finished_work_drains_and_nothing_is_reported() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(T, 16);
        let a = Flag::new("all_reduce 8 B on group world");
        let b = Flag::new("all_to_all 64 B on group ulysses");
        w.push(a.clone(), t0);
        w.push(b.clone(), t0 + Duration::from_secs(1));
        assert_eq!(w.poll(t0 + Duration::from_secs(2), || None), None);
        assert_eq!(w.len(), 2);
        a.finish();
        assert_eq!(w.poll(t0 + Duration::from_secs(3), || None), None);
        assert_eq!(w.len(), 1);
        b.finish();
        // long after both deadlines: finished work is never reported
        assert_eq!(w.poll(t0 + Duration::from_secs(60), || None), None);
        assert!(w.is_empty());
    }

    #[test]
    fn a_stuck_collective_times_out_exactly_at_the_timeout() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(T, 16);
        let stuck = Flag::new("all_reduce 8 B on group world");
        w.push(stuck.clone(), t0);
        let just_before = t0 + T - Duration::from_nanos(1);
        assert_eq!(w.poll(just_before, || None), None);
        let got = w.poll(t0 + T, || None).expect("timed out at the deadline");
        assert_eq!(
            got,
            Failure::Timeout {
                what: "all_reduce 8 B on group world".into(),
                waited: T,
                timeout: T
            }
        );
        let msg = got.to_string();
        for want in [
            "all_reduce 8 B on group world",
            TIMEOUT_VAR,
            "5.0 s",
            "peer rank likely died or hung",
        ] {
            assert!(msg.contains(want), "{want:?} missing from {msg}");
        }
    }

    #[test]
    fn the_oldest_unfinished_collective_is_the_one_reported() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(T, 16);
        let (a, b) = (Flag::new("a"), Flag::new("b"));
        w.push(a.clone(), t0);
        w.push(b, t0 + Duration::from_secs(2));
        a.finish();
        // a finished: b's deadline (t0 + 7 s) counts, not a's
        assert_eq!(w.poll(t0 + Duration::from_secs(6), || None), None);
        match w.poll(t0 + Duration::from_secs(7), || None) {
            Some(Failure::Timeout { what, waited, .. }) => {
                assert_eq!((what.as_str(), waited), ("b", T));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_async_error_is_reported_with_its_text_before_the_deadline() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(T, 16);
        w.push(Flag::new("send_recv 4096 B on group ring"), t0);
        let got = w
            .poll(t0 + Duration::from_millis(100), || {
                Some("ncclRemoteError: peer closed the connection".into())
            })
            .unwrap();
        assert_eq!(
            got,
            Failure::AsyncError {
                text: "ncclRemoteError: peer closed the connection".into(),
                in_flight: Some("send_recv 4096 B on group ring".into())
            }
        );
        let msg = got.to_string();
        assert!(msg.contains("peer closed the connection"), "{msg}");
        assert!(msg.contains("send_recv 4096 B on group ring"), "{msg}");
        // with nothing in flight it is still reported
        let mut idle: Watchdog<Flag> = Watchdog::new(T, 16);
        let got = idle.poll(t0, || Some("boom".into())).unwrap();
        assert_eq!(
            got,
            Failure::AsyncError {
                text: "boom".into(),
                in_flight: None
            }
        );
    }

    /// Work whose probe fails.
    struct Broken;
    impl InFlight for Broken {
        fn finished(&self) -> std::result::Result<bool, String> {
            Err("CUDA_ERROR_ILLEGAL_ADDRESS".into())
        }
        fn describe(&self) -> String {
            "all_gather 128 B on group context".into()
        }
    }

    #[test]
    fn a_failing_probe_is_reported() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(T, 4);
        w.push(Broken, t0);
        let got = w.poll(t0, || None).unwrap();
        assert_eq!(
            got,
            Failure::Probe {
                what: "all_gather 128 B on group context".into(),
                text: "CUDA_ERROR_ILLEGAL_ADDRESS".into()
            }
        );
    }

    /// Work that counts how often it was probed.
    struct Counted(Arc<AtomicU8>);
    impl InFlight for Counted {
        fn finished(&self) -> std::result::Result<bool, String> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(false)
        }
        fn describe(&self) -> String {
            "counted".into()
        }
    }

    #[test]
    fn the_async_probe_runs_every_step_even_when_idle() {
        let mut w: Watchdog<Counted> = Watchdog::new(T, 4);
        let calls = std::cell::Cell::new(0);
        let t0 = Instant::now();
        for i in 0..3 {
            assert_eq!(
                w.poll(t0 + Duration::from_secs(i), || {
                    calls.set(calls.get() + 1);
                    None
                }),
                None
            );
        }
        assert_eq!(calls.get(), 3);
        // and each followed collective is probed once per step
        let n = Arc::new(AtomicU8::new(0));
        w.push(Counted(n.clone()), t0);
        w.poll(t0, || None);
        w.poll(t0, || None);
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_full_queue_folds_new_work_into_the_newest_entry() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(T, 2);
        let flags: Vec<_> = (0..5).map(|i| Flag::new(&format!("c{i}"))).collect();
        for (i, f) in flags.iter().enumerate() {
            w.push(f.clone(), t0 + Duration::from_secs(i as u64));
        }
        assert_eq!(w.len(), 2, "bounded");
        flags[0].finish();
        assert_eq!(w.poll(t0 + Duration::from_secs(5), || None), None);
        assert_eq!(w.len(), 1);
        // c1..c4 are one entry timed from c1's issue, finished by c4's probe
        match w.poll(t0 + Duration::from_secs(6), || None) {
            Some(Failure::Timeout { what, waited, .. }) => {
                assert_eq!(waited, T);
                assert!(what.starts_with("c1 "), "{what}");
                assert!(
                    what.contains("3 collectives") && what.contains("c4"),
                    "{what}"
                );
            }
            other => panic!("{other:?}"),
        }
        flags[4].finish();
        assert_eq!(w.poll(t0 + Duration::from_secs(60), || None), None);
        assert!(w.is_empty());
    }

    #[test]
    fn timeouts_parse_once_with_clear_errors() {
        assert_eq!(parse_timeout(None).unwrap(), Some(DEFAULT_TIMEOUT));
        assert_eq!(
            parse_timeout(Some("5")).unwrap(),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            parse_timeout(Some(" 0.25 ")).unwrap(),
            Some(Duration::from_millis(250))
        );
        assert_eq!(parse_timeout(Some("0")).unwrap(), None);
        assert_eq!(parse_timeout(Some("0.0")).unwrap(), None);
        for bad in ["", "ten", "-1", "nan", "inf", "1e12", "0.0000001", "5s"] {
            let e = parse_timeout(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(TIMEOUT_VAR), "{bad}: {e}");
            assert!(e.contains("0 to turn"), "{bad}: {e}");
        }
        assert_eq!(
            poll_interval(Duration::from_secs(600)),
            Duration::from_millis(100)
        );
        assert_eq!(
            poll_interval(Duration::from_millis(200)),
            Duration::from_millis(20)
        );
        assert_eq!(
            poll_interval(Duration::from_millis(5)),
            Duration::from_millis(10)
        );
    }

    #[test]
    fn real_time_stuck_work_times_out_and_finished_work_does_not() {
        let mut w = Watchdog::new(Duration::from_millis(50), 8);
        let (stuck, quick) = (Flag::new("stuck"), Flag::new("quick"));
        w.push(quick.clone(), Instant::now());
        quick.finish();
        w.push(stuck, Instant::now());
        let start = Instant::now();
        let failure = loop {
            if let Some(f) = w.poll(Instant::now(), || None) {
                break f;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(start.elapsed() >= Duration::from_millis(45));
        assert!(matches!(failure, Failure::Timeout { ref what, .. } if what == "stuck"));
        assert_eq!(w.len(), 1, "the finished one drained");
    }

    /// One step of a random schedule.
    #[derive(Debug, Clone)]
    enum Step {
        Push,
        Finish(usize),
        Advance(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            Just(Step::Push),
            (0usize..64).prop_map(Step::Finish),
            (0u64..3000).prop_map(Step::Advance),
        ]
    }

    proptest! {
        /// Against a direct model: the watchdog reports a timeout exactly
        /// when some pushed, unfinished collective has waited the timeout,
        /// names the oldest such one, and never follows finished work
        /// after a poll.
        #[test]
        fn poll_matches_the_model(steps in proptest::collection::vec(step(), 1..80)) {
            let t0 = Instant::now();
            let timeout = Duration::from_millis(2500);
            let mut w = Watchdog::new(timeout, 1000);
            let mut now = t0;
            let mut issued: Vec<(Flag, Instant)> = Vec::new();
            for s in steps {
                match s {
                    Step::Push => {
                        let f = Flag::new(&format!("c{}", issued.len()));
                        w.push(f.clone(), now);
                        issued.push((f, now));
                    }
                    Step::Finish(i) => {
                        if !issued.is_empty() {
                            issued[i % issued.len()].0.finish();
                        }
                    }
                    Step::Advance(ms) => now += Duration::from_millis(ms),
                }
                let oldest = issued
                    .iter()
                    .filter(|(f, _)| !f.done.load(Ordering::SeqCst))
                    .min_by_key(|(_, t)| *t);
                let expect = oldest
                    .filter(|(_, t)| now - *t >= timeout)
                    .map(|(f, t)| (f.name.clone(), now - *t));
                let got = w.poll(now, || None);
                match (got, expect) {
                    (None, None) => {}
                    (Some(Failure::Timeout { what, waited, .. }), Some((name, wait))) => {
                        prop_assert_eq!(what, name);
                        prop_assert_eq!(waited, wait);
                        return Ok(());
                    }
                    (got, expect) => prop_assert!(false, "got {:?}, expected {:?}", got, expect),
                }
                let live = issued.iter().filter(|(f, _)| !f.done.load(Ordering::SeqCst)).count();
                prop_assert_eq!(w.len(), live);
            }
        }
    }
}

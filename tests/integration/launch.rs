//! `upipe launch` and the TCP rendezvous with real processes on loopback,
//! through the hidden `rendezvous-check` subcommand.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const UPIPE: &str = env!("CARGO_BIN_EXE_upipe");

/// A port that was free a moment ago (bound to port 0, then released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `upipe` command with no distributed variables inherited from the test's environment.
fn upipe(args: &[&str]) -> Command {
    let mut cmd = Command::new(UPIPE);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, _) in std::env::vars() {
        if name.starts_with("SLURM_")
            || [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            ]
            .contains(&name.as_str())
        {
            cmd.env_remove(name);
        }
    }
    cmd
}

/// A started process whose stdout arrives line by line and whose stderr is collected.
struct Running {
    child: Child,
    started: Instant,
    stdout: Receiver<String>,
    stderr: JoinHandle<String>,
}

/// What a finished process did.
struct Finished {
    code: Option<i32>,
    elapsed: Duration,
    stdout: Vec<String>,
    stderr: String,
}

impl Running {
    fn start(mut cmd: Command) -> Running {
        let mut child = cmd.spawn().expect("spawn upipe");
        let (tx, stdout) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        });
        Running {
            child,
            started: Instant::now(),
            stdout,
            stderr,
        }
    }

    /// Collects stdout lines until `count` of them satisfy `pred` (or `limit` passes).
    fn wait_for_lines(
        &self,
        count: usize,
        limit: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let deadline = Instant::now() + limit;
        let mut seen = Vec::new();
        while seen.iter().filter(|l: &&String| pred(l)).count() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) => seen.push(line),
                Err(_) => panic!("expected {count} matching lines within {limit:?}, got {seen:#?}"),
            }
        }
        seen
    }

    /// Waits for exit; kills the process and fails the test after `limit`.
    fn finish(mut self, limit: Duration) -> Finished {
        let code = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status.code();
            }
            if self.started.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "upipe still running after {limit:?}; stderr so far:\n{}",
                    self.stderr.join().unwrap()
                );
            }
            thread::sleep(Duration::from_millis(10));
        };
        let elapsed = self.started.elapsed();
        let stderr = self.stderr.join().unwrap();
        let stdout = self.stdout.iter().collect();
        Finished {
            code,
            elapsed,
            stdout,
            stderr,
        }
    }
}

/// The pids printed by `rendezvous-check` ("rank R pid P joining ...").
fn pids(lines: &[String]) -> Vec<u32> {
    lines
        .iter()
        .filter_map(|l| {
            let rest = l.split(" pid ").nth(1)?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .collect()
}

/// Whether a process with this pid is still running (Linux: it has a /proc
/// entry and is not a zombie waiting to be reaped).
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) S ...": the state follows the last ')'.
    let state = stat.rsplit(')').next().unwrap_or("").trim_start();
    !state.starts_with('Z') && !state.starts_with('X')
}

/// `upipe launch --nproc-per-node N --master-port PORT -- rendezvous-check ARGS`.
fn launch_check(nproc: usize, port: &str, args: &[&str]) -> Command {
    let nproc = nproc.to_string();
    let mut all = vec![
        "launch",
        "--nproc-per-node",
        &nproc,
        "--master-port",
        port,
        "--",
        "rendezvous-check",
    ];
    all.extend_from_slice(args);
    upipe(&all)
}

#[test]
fn four_ranks_agree_on_ranks_and_id() {
    let port = free_port().to_string();
    let cmd = launch_check(4, &port, &["--timeout-ms", "15000"]);
    let done = Running::start(cmd).finish(Duration::from_secs(20));
    assert_eq!(done.code, Some(0), "stderr:\n{}", done.stderr);
    let mut ids = Vec::new();
    for rank in 0..4 {
        let prefix = format!("[rank {rank}] rank {rank}/4 saw [0,1,2,3] id=");
        let lines: Vec<&String> = done
            .stdout
            .iter()
            .filter(|l| l.starts_with(&prefix))
            .collect();
        assert_eq!(lines.len(), 1, "rank {rank} in {:#?}", done.stdout);
        ids.push(lines[0][prefix.len()..].to_string());
    }
    assert_eq!(ids[0].len(), 32, "{ids:?}");
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    assert!(
        done.stdout.iter().all(|l| l.starts_with("[rank ")),
        "{:#?}",
        done.stdout
    );
}

#[test]
fn failing_rank_stops_the_others_and_sets_the_status() {
    let port = free_port().to_string();
    let cmd = launch_check(4, &port, &["--fail-rank", "2", "--timeout-ms", "20000"]);
    let done = Running::start(cmd).finish(Duration::from_secs(25));
    assert_eq!(done.code, Some(3), "stderr:\n{}", done.stderr);
    // The survivors sleep for 20 s unless the launcher stops them.
    assert!(
        done.elapsed < Duration::from_secs(10),
        "took {:?}",
        done.elapsed
    );
    assert!(
        done.stderr.contains("rank 2 exited with status 3"),
        "{}",
        done.stderr
    );
    assert!(
        done.stdout.iter().all(|l| !l.contains(" saw ")),
        "{:#?}",
        done.stdout
    );
    let pids = pids(&done.stdout);
    assert_eq!(pids.len(), 4, "{:#?}", done.stdout);
    for pid in pids {
        assert!(!alive(pid), "rank process {pid} survived the launcher");
    }
}

#[test]
fn missing_rank_is_named_within_the_timeout() {
    let port = free_port().to_string();
    let ranks: Vec<Running> = (0..3)
        .map(|rank| {
            let mut cmd = upipe(&["rendezvous-check", "--timeout-ms", "1500"]);
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", "4")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port);
            Running::start(cmd)
        })
        .collect();
    for (rank, running) in ranks.into_iter().enumerate() {
        let done = running.finish(Duration::from_secs(10));
        assert_eq!(done.code, Some(2), "rank {rank} stderr:\n{}", done.stderr);
        // 1.5 s timeout + 2 s grace for the peers' verdict + process start-up.
        assert!(
            done.elapsed < Duration::from_secs(7),
            "rank {rank} took {:?}",
            done.elapsed
        );
        assert!(
            done.stderr
                .contains("ranks [3] never arrived (world size 4)"),
            "rank {rank} stderr:\n{}",
            done.stderr
        );
    }
}

#[test]
fn port_in_use_is_reported_with_the_fix() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let cmd = launch_check(2, &port, &["--timeout-ms", "20000"]);
    let done = Running::start(cmd).finish(Duration::from_secs(15));
    assert_ne!(done.code, Some(0));
    assert!(
        done.elapsed < Duration::from_secs(10),
        "took {:?}",
        done.elapsed
    );
    assert!(
        done.stderr.contains(&format!("port {port}")) && done.stderr.contains("--master-port"),
        "{}",
        done.stderr
    );
    drop(held);
}

#[test]
fn terminating_the_launcher_stops_the_ranks() {
    let port = free_port().to_string();
    // No rank 7 exists, so both ranks connect and then wait to be stopped.
    let cmd = launch_check(2, &port, &["--fail-rank", "7", "--timeout-ms", "20000"]);
    let running = Running::start(cmd);
    let lines = running.wait_for_lines(2, Duration::from_secs(10), |l| {
        l.contains("waiting to be stopped")
    });
    let status = Command::new("kill")
        .args(["-TERM", &running.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    let done = running.finish(Duration::from_secs(15));
    assert_eq!(done.code, Some(128 + 15), "stderr:\n{}", done.stderr);
    assert!(
        done.elapsed < Duration::from_secs(12),
        "took {:?}",
        done.elapsed
    );
    let pids = pids(&lines);
    assert_eq!(pids.len(), 2, "{lines:#?}");
    for pid in pids {
        assert!(!alive(pid), "rank process {pid} survived the launcher");
    }
}

#[test]
fn invalid_flags_fail_before_starting_anything() {
    let done = Running::start(upipe(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "3",
        "--master-addr",
        "10.0.0.1",
        "--",
        "rendezvous-check",
    ]))
    .finish(Duration::from_secs(10));
    assert_eq!(done.code, Some(2));
    assert!(
        done.stderr
            .contains("--node-rank 3 is not below --nnodes 2"),
        "{}",
        done.stderr
    );
    assert!(done.stdout.is_empty(), "{:#?}", done.stdout);
}

#[test]
fn killing_the_launcher_outright_still_ends_the_ranks() {
    let port = free_port().to_string();
    let cmd = launch_check(2, &port, &["--fail-rank", "7", "--timeout-ms", "20000"]);
    let mut running = Running::start(cmd);
    let lines = running.wait_for_lines(2, Duration::from_secs(10), |l| {
        l.contains("waiting to be stopped")
    });
    // SIGKILL: the launcher cannot react; the kernel's parent-death signal must.
    running.child.kill().unwrap();
    let pids = pids(&lines);
    assert_eq!(pids.len(), 2, "{lines:#?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&pid| alive(pid)) {
        assert!(
            Instant::now() < deadline,
            "ranks {pids:?} outlived the killed launcher"
        );
        thread::sleep(Duration::from_millis(20));
    }
    running.finish(Duration::from_secs(10));
}

#[test]
fn terminating_the_launcher_while_it_starts_many_ranks_ends_it_within_seconds() {
    let port = free_port().to_string();
    // 1000 ranks take about a minute to start on 2 cores; SIGTERM comes
    // as soon as the first one runs
    let cmd = launch_check(1000, &port, &["--timeout-ms", "60000"]);
    let running = Running::start(cmd);
    let lines = running.wait_for_lines(1, Duration::from_secs(20), |l| l.contains(" joining "));
    let signalled = Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &running.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    let done = running.finish(Duration::from_secs(60));
    assert_eq!(done.code, Some(128 + 15), "stderr:\n{}", done.stderr);
    assert!(
        signalled.elapsed() < Duration::from_secs(20),
        "took {:?} after SIGTERM",
        signalled.elapsed()
    );
    let all: Vec<String> = lines.into_iter().chain(done.stdout).collect();
    let pids = pids(&all);
    assert!(
        !pids.is_empty() && pids.len() < 1000,
        "{} ranks",
        pids.len()
    );
    for pid in pids {
        assert!(!alive(pid), "rank process {pid} survived the launcher");
    }
}

#[test]
fn absurd_process_counts_are_refused_at_once() {
    let port = free_port().to_string();
    let cmd = launch_check(100_000, &port, &["--timeout-ms", "1000"]);
    let done = Running::start(cmd).finish(Duration::from_secs(20));
    assert_eq!(done.code, Some(2), "stderr:\n{}", done.stderr);
    assert!(
        done.stderr
            .contains("--nproc-per-node 100000 is more than 1024"),
        "{}",
        done.stderr
    );
    assert!(done.stdout.is_empty(), "{:#?}", done.stdout);
}

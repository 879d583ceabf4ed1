//! `upipe launch`: start one process per local rank (torchrun-style), give
//! each the distributed environment ([`crate::comm::env::DistEnv`] reads it),
//! prefix their output with their rank, and stop them all as soon as one
//! fails or the launcher is interrupted.

mod output;
mod signals;

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::comm::env::{DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT};
use crate::config_err;
use crate::error::{Error, Result};
use output::Sink;

/// How long children get to exit after SIGTERM before they are killed.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How often the supervisor checks for a stop signal.
const SIGNAL_POLL: Duration = Duration::from_millis(20);
/// Stack of the launcher's helper threads (3 per rank: two output
/// forwarders and an exit waiter), which only copy lines or wait.
const HELPER_STACK: usize = 256 * 1024;
/// Most processes one launcher starts. A rank is one process per GPU, and
/// the largest nodes hold 8 to 16 GPUs; far beyond that a typo (an extra
/// zero) would start thousands of processes and threads (3 per rank here):
/// 1024 ranks took 52 s to start on a 2-core machine, and 100000 exhaust
/// the default pid space (32768).
const MAX_NPROC_PER_NODE: usize = 1024;

#[derive(clap::Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Processes to start on this node (usually one per GPU).
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Number of nodes taking part (run `upipe launch` once on each).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// Index of this node, 0..nnodes; node 0 hosts the rendezvous.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0, reachable from every node.
    #[arg(long, default_value = DEFAULT_MASTER_ADDR)]
    pub master_addr: String,
    /// TCP port of the rendezvous on node 0.
    #[arg(long, default_value_t = DEFAULT_MASTER_PORT)]
    pub master_port: u16,
    /// The upipe subcommand and its arguments, after `--` (e.g. `-- train --steps 10`).
    #[arg(last = true, required = true, value_name = "SUBCOMMAND")]
    pub command: Vec<String>,
}

/// Starts the ranks of this node and supervises them; returns the exit
/// status the launcher should exit with (the first failing rank's status).
pub fn run(args: LaunchArgs) -> Result<i32> {
    run_with(&args, true)
}

/// This process's own command line after the program name, checked to be
/// `upipe subcommand ...`: what a self-launch passes to each rank.
pub fn own_command(subcommand: &str) -> Result<Vec<String>> {
    let argv = std::env::args_os()
        .skip(1)
        .map(|s| {
            s.into_string().map_err(|s| {
                Error::Config(format!("argument {s:?} is not UTF-8; use `upipe launch`"))
            })
        })
        .collect::<Result<Vec<String>>>()?;
    rank_command(&argv, subcommand)
}

/// `argv` (a command line after the program name) if it is `subcommand ...`:
/// the ranks of a self-launch run it unchanged, so each resolves the same
/// mesh from the same flags and checks it against its world size.
pub fn rank_command(argv: &[String], subcommand: &str) -> Result<Vec<String>> {
    if argv.first().map(String::as_str) != Some(subcommand) {
        return config_err!(
            "cannot start one process per GPU: expected `upipe {subcommand} ...`, got {argv:?}; \
             use `upipe launch --nproc-per-node N -- {subcommand} ...`"
        );
    }
    Ok(argv.to_vec())
}

/// Starts `nproc` ranks of `command` on this machine alone (rendezvous on a
/// free loopback port) and supervises them as `upipe launch --nproc-per-node
/// nproc -- command...` would, except that the ranks' stdout is passed
/// through without the `[rank R]` prefix (only rank 0 writes it, so
/// `--json` output stays JSON); stderr keeps the prefix. What `upipe train`
/// uses to start one process per GPU by itself.
pub fn run_local(nproc: usize, command: Vec<String>) -> Result<i32> {
    let port = std::net::TcpListener::bind((DEFAULT_MASTER_ADDR, 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::io("finding a free port for the rendezvous", e))?
        .port();
    let args = LaunchArgs {
        nproc_per_node: nproc,
        nnodes: 1,
        node_rank: 0,
        master_addr: DEFAULT_MASTER_ADDR.into(),
        master_port: port,
        command,
    };
    run_with(&args, false)
}

fn run_with(args: &LaunchArgs, prefix_stdout: bool) -> Result<i32> {
    validate(args)?;
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("finding the upipe executable to launch", e))?;
    signals::install_stop_handlers();
    let mut group = RankGroup::new(prefix_stdout, HELPER_STACK);
    if let Err(e) = group.start_all(&exe, args) {
        group.stop_all(signals::SIGKILL);
        group.wait_all();
        group.finish_output();
        return Err(e);
    }
    let code = group.supervise();
    group.finish_output();
    Ok(code)
}

/// Checks the flags before anything is started.
fn validate(args: &LaunchArgs) -> Result<()> {
    if args.nproc_per_node == 0 {
        return config_err!("--nproc-per-node must be at least 1 (one process per GPU)");
    }
    if args.nproc_per_node > MAX_NPROC_PER_NODE {
        return config_err!(
            "--nproc-per-node {} is more than {MAX_NPROC_PER_NODE}: upipe launch starts one \
             process per GPU of this node (see `upipe info`), and no node holds that many; \
             give the GPUs of one node, and --nnodes for more nodes",
            args.nproc_per_node
        );
    }
    if args.nnodes == 0 {
        return config_err!("--nnodes must be at least 1");
    }
    if args.nnodes.checked_mul(args.nproc_per_node).is_none() {
        return config_err!(
            "--nnodes {} x --nproc-per-node {} is more ranks than can be counted; give the \
             number of nodes of the run",
            args.nnodes,
            args.nproc_per_node
        );
    }
    if args.node_rank >= args.nnodes {
        return config_err!(
            "--node-rank {} is not below --nnodes {}; nodes are numbered 0..{}",
            args.node_rank,
            args.nnodes,
            args.nnodes - 1
        );
    }
    if args.master_port == 0 {
        return config_err!(
            "--master-port must be a TCP port in 1..=65535 (e.g. {DEFAULT_MASTER_PORT})"
        );
    }
    if args.master_addr.trim().is_empty() {
        return config_err!(
            "--master-addr is empty: give the address of node 0 (e.g. {DEFAULT_MASTER_ADDR} on one node)"
        );
    }
    if args.nnodes > 1 && is_loopback_name(&args.master_addr) {
        return config_err!(
            "--master-addr {} only reaches this machine, but --nnodes is {}; set --master-addr \
             to an address of node 0 that every node can reach",
            args.master_addr,
            args.nnodes
        );
    }
    match args.command.first().map(String::as_str) {
        None => config_err!(
            "give the upipe subcommand to run after `--`, e.g. `upipe launch --nproc-per-node 4 -- train`"
        ),
        Some("launch") => config_err!(
            "`upipe launch -- launch` would nest launchers; give a subcommand such as `train`"
        ),
        Some(_) => Ok(()),
    }
}

fn is_loopback_name(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The environment of local rank `local_rank`.
fn rank_env(args: &LaunchArgs, local_rank: usize) -> Vec<(&'static str, String)> {
    let world_size = args.nnodes * args.nproc_per_node;
    let rank = args.node_rank * args.nproc_per_node + local_rank;
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world_size.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string()),
        ("GROUP_RANK", args.node_rank.to_string()),
        ("MASTER_ADDR", args.master_addr.clone()),
        ("MASTER_PORT", args.master_port.to_string()),
    ]
}

/// Exit status as a shell reports it: the code, or 128 + the killing signal.
fn exit_code(status: &ExitStatus) -> i32 {
    if let Some(code) = status.code() {
        return code;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signum) = status.signal() {
            return 128 + signum;
        }
    }
    1
}

/// One started rank.
struct Member {
    rank: usize,
    pid: u32,
    /// Set once its exit was reported (its pid must not be signalled after).
    exited: bool,
}

/// A channel end on which a rank's waiter reports its exit.
type ExitReport = mpsc::Sender<(usize, std::io::Result<ExitStatus>)>;

/// The children of this launcher: their pids, a channel on which a waiter
/// thread per child reports its exit (in exit order), and the threads that
/// forward their output.
struct RankGroup {
    members: Vec<Member>,
    report: ExitReport,
    exits: Receiver<(usize, std::io::Result<ExitStatus>)>,
    forwarders: Vec<JoinHandle<()>>,
    /// Whether stdout lines get the `[rank R] ` prefix (stderr always does).
    prefix_stdout: bool,
    /// Stack bytes of each helper thread.
    helper_stack: usize,
}

impl RankGroup {
    fn new(prefix_stdout: bool, helper_stack: usize) -> RankGroup {
        let (report, exits) = mpsc::channel();
        RankGroup {
            members: Vec::new(),
            report,
            exits,
            forwarders: Vec::new(),
            prefix_stdout,
            helper_stack,
        }
    }

    /// Starts every local rank, one by one, unless a stop signal arrives
    /// first (then [`Self::supervise`] stops those started). On an error
    /// the ranks started so far keep running: the caller stops them.
    fn start_all(&mut self, exe: &std::path::Path, args: &LaunchArgs) -> Result<()> {
        for local_rank in 0..args.nproc_per_node {
            if signals::received().is_some() {
                return Ok(());
            }
            let env = rank_env(args, local_rank);
            let rank = args.node_rank * args.nproc_per_node + local_rank;
            let child = start_child(exe, &args.command, &env)
                .map_err(|e| start_error(e, rank, args, exe))?;
            self.adopt(rank, child)?;
        }
        Ok(())
    }

    /// Takes ownership of a started child: forwards its output and waits
    /// for it. When a thread for it cannot be started, the child is killed.
    fn adopt(&mut self, rank: usize, mut child: Child) -> Result<()> {
        let streams = [
            (
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn Read + Send>),
                Sink::Stdout,
            ),
            (
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn Read + Send>),
                Sink::Stderr,
            ),
        ];
        let mut started = Ok(());
        for (stream, sink) in streams {
            let Some(stream) = stream else { continue };
            let prefix = matches!(sink, Sink::Stderr) || self.prefix_stdout;
            match output::forward(rank, stream, sink, prefix, self.helper_stack) {
                Ok(handle) => self.forwarders.push(handle),
                Err(e) => {
                    started = Err(e);
                    break;
                }
            }
        }
        let index = self.members.len();
        let report = self.report.clone();
        // the child is handed over once the waiter runs, so that it is
        // still here to kill if the waiter cannot start
        let (hand_over, handed) = mpsc::channel::<Child>();
        let waiter = started.and_then(|()| {
            std::thread::Builder::new()
                .name(format!("rank {rank} waiter"))
                .stack_size(self.helper_stack)
                .spawn(move || {
                    if let Ok(mut child) = handed.recv() {
                        let _ = report.send((index, child.wait()));
                    }
                })
        });
        if let Err(e) = waiter {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::thread_spawn(
                format!("rank {rank} of upipe launch"),
                e,
            ));
        }
        self.members.push(Member {
            rank,
            pid: child.id(),
            exited: false,
        });
        // the waiter holds the receiving end until it has the child
        let _ = hand_over.send(child);
        Ok(())
    }

    /// Waits until every rank succeeded (0), one failed (its status), or a
    /// stop signal arrived (128 + signal); in the latter two cases the other
    /// ranks are stopped first.
    fn supervise(&mut self) -> i32 {
        loop {
            if let Some(signum) = signals::received() {
                tracing::warn!("upipe launch: received signal {signum}; stopping all ranks");
                self.stop_all(signals::SIGTERM);
                self.wait_all_with_grace();
                return 128 + signum;
            }
            if self.running() == 0 {
                return 0;
            }
            let (index, status) = match self.exits.recv_timeout(SIGNAL_POLL) {
                Ok(exit) => exit,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return 0,
            };
            self.members[index].exited = true;
            let rank = self.members[index].rank;
            let code = match &status {
                Ok(status) => exit_code(status),
                Err(e) => {
                    tracing::error!("upipe launch: lost track of rank {rank}: {e}");
                    1
                }
            };
            if code != 0 {
                let others: Vec<usize> = self.running_ranks();
                tracing::error!(
                    "upipe launch: rank {rank} exited with status {code}; stopping ranks {others:?}"
                );
                self.stop_all(signals::SIGTERM);
                self.wait_all_with_grace();
                return code;
            }
        }
    }

    fn running(&self) -> usize {
        self.members.iter().filter(|m| !m.exited).count()
    }

    fn running_ranks(&self) -> Vec<usize> {
        self.members
            .iter()
            .filter(|m| !m.exited)
            .map(|m| m.rank)
            .collect()
    }

    /// Signals every rank whose exit has not been reported yet.
    fn stop_all(&self, signum: i32) {
        for member in self.members.iter().filter(|m| !m.exited) {
            signals::send(member.pid, signum);
        }
    }

    /// Waits up to [`STOP_GRACE`] for the stopped ranks, then kills the rest.
    fn wait_all_with_grace(&mut self) {
        let deadline = Instant::now() + STOP_GRACE;
        while self.running() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    "upipe launch: ranks {:?} ignored SIGTERM for {STOP_GRACE:?}; killing them",
                    self.running_ranks()
                );
                self.stop_all(signals::SIGKILL);
                break;
            }
            match self.exits.recv_timeout(left) {
                Ok((index, _)) => self.members[index].exited = true,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        self.wait_all();
    }

    /// Waits for every remaining exit report.
    fn wait_all(&mut self) {
        while self.running() > 0 {
            match self.exits.recv() {
                Ok((index, _)) => self.members[index].exited = true,
                Err(_) => return,
            }
        }
    }

    /// Lets the forwarders print the children's last lines.
    fn finish_output(&mut self) {
        for forwarder in self.forwarders.drain(..) {
            let _ = forwarder.join();
        }
    }
}

/// Why rank `rank` could not start, with the fix: out of processes or
/// memory (fewer ranks), or another failure of starting `exe`.
fn start_error(e: std::io::Error, rank: usize, args: &LaunchArgs, exe: &std::path::Path) -> Error {
    use std::io::ErrorKind;
    if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::OutOfMemory) {
        return Error::Config(format!(
            "cannot start rank {rank} of --nproc-per-node {} ({e}): this machine's process \
             limits are reached; start fewer processes (one per GPU), stop other processes, \
             or raise the limits (`ulimit -u`, kernel.pid_max)",
            args.nproc_per_node
        ));
    }
    Error::io(format!("starting rank {rank} ({})", exe.display()), e)
}

/// Starts one rank: this executable with `command` and the rank's environment.
fn start_child(
    exe: &std::path::Path,
    command: &[String],
    env: &[(&'static str, String)],
) -> std::io::Result<Child> {
    let mut cmd = Command::new(exe);
    cmd.args(command)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    signals::terminate_with_parent(&mut cmd);
    cmd.spawn()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: LaunchArgs,
    }

    fn parse(argv: &[&str]) -> LaunchArgs {
        Wrapper::try_parse_from(std::iter::once("launch").chain(argv.iter().copied()))
            .unwrap()
            .args
    }

    fn error_of(argv: &[&str]) -> String {
        match validate(&parse(argv)) {
            Err(Error::Config(msg)) => msg,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn parses_command_after_double_dash() {
        let args = parse(&["--nproc-per-node", "4", "--", "train", "--steps", "3"]);
        assert_eq!(args.nproc_per_node, 4);
        assert_eq!(args.command, ["train", "--steps", "3"]);
        assert_eq!(args.master_port, DEFAULT_MASTER_PORT);
        validate(&args).unwrap();
        assert!(Wrapper::try_parse_from(["launch", "--nproc-per-node", "2"]).is_err());
    }

    #[test]
    fn rejects_bad_flags_with_the_fix() {
        assert!(error_of(&["--nproc-per-node", "0", "--", "train"]).contains("--nproc-per-node"));
        let msg = error_of(&[
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--master-addr",
            "10.0.0.1",
            "--",
            "train",
        ]);
        assert!(
            msg.contains("--node-rank 2 is not below --nnodes 2"),
            "{msg}"
        );
        let msg = error_of(&["--nnodes", "2", "--", "train"]);
        assert!(msg.contains("--master-addr"), "{msg}");
        assert!(error_of(&["--master-port", "0", "--", "train"]).contains("--master-port"));
        let msg = error_of(&["--master-addr", " ", "--", "train"]);
        assert!(msg.contains("--master-addr is empty"), "{msg}");
        let nodes = usize::MAX.to_string();
        let msg = error_of(&[
            "--nnodes",
            &nodes,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "10.0.0.1",
            "--",
            "train",
        ]);
        assert!(msg.contains("more ranks than can be counted"), "{msg}");
        assert!(error_of(&["--", "launch", "--", "train"]).contains("nest"));
    }

    /// A helper thread that cannot start (a stack no machine can map stands
    /// in for a process out of threads) is an error naming the fix, not a
    /// panic, and the rank it was for is killed and reaped.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_helper_thread_that_cannot_start_is_an_error_with_the_fix() {
        let mut group = RankGroup::new(true, 1 << 62);
        let args = parse(&["--nproc-per-node", "3", "--", "30"]);
        let started = Instant::now();
        let got = group.start_all(std::path::Path::new("/bin/sleep"), &args);
        match got {
            Err(Error::Config(msg)) => {
                assert!(msg.contains("rank 0 of upipe launch"), "{msg}");
                assert!(msg.contains("run fewer ranks"), "{msg}");
            }
            other => panic!("expected a configuration error, got {other:?}"),
        }
        assert!(group.members.is_empty(), "the rank was not killed");
        group.stop_all(signals::SIGKILL);
        group.wait_all();
        group.finish_output();
        assert!(started.elapsed() < Duration::from_secs(20));
    }

    #[test]
    fn absurd_process_counts_are_refused() {
        let msg = error_of(&["--nproc-per-node", "100000", "--", "train"]);
        assert!(
            msg.contains("more than 1024") && msg.contains("one process per GPU"),
            "{msg}"
        );
        validate(&parse(&["--nproc-per-node", "1024", "--", "train"])).unwrap();
    }

    #[test]
    fn ranks_are_numbered_by_node() {
        let args = parse(&[
            "--nproc-per-node",
            "4",
            "--nnodes",
            "3",
            "--node-rank",
            "2",
            "--master-addr",
            "node0",
            "--master-port",
            "1234",
            "--",
            "train",
        ]);
        let env: std::collections::HashMap<_, _> = rank_env(&args, 1).into_iter().collect();
        assert_eq!(env["RANK"], "9");
        assert_eq!(env["WORLD_SIZE"], "12");
        assert_eq!(env["LOCAL_RANK"], "1");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "4");
        assert_eq!(env["MASTER_ADDR"], "node0");
        assert_eq!(env["MASTER_PORT"], "1234");
    }
}

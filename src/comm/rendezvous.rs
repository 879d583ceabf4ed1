//! A small TCP store that hands bytes (the 128-byte NCCL unique id, host
//! names, …) between the ranks of a run before any GPU collective exists.
//!
//! Rank 0 listens at `MASTER_ADDR:MASTER_PORT`; every other rank connects to
//! it (retrying with backoff while rank 0 starts) and announces its rank and
//! world size. Once all ranks have arrived rank 0 closes the listener (the
//! port is free again) and relays every collective through the star of
//! connections. Rank 0 checks every announcement and, when something is wrong
//! (a rank never arrives, two processes claim one rank, world sizes differ, a
//! rank disconnects), fails with a message naming the ranks involved and
//! forwards that message to every connected rank so all of them fail alike.
//!
//! Every rank must call the same collectives in the same order; a mismatch is
//! detected and reported. Only joining has a timeout: a collective waits as
//! long as the slowest rank takes to reach it (ranks may legitimately be busy),
//! but fails as soon as a rank disconnects.
//!
//! ```no_run
//! # use std::time::Duration;
//! # use upipe::comm::{env::DistEnv, rendezvous::Rendezvous};
//! # fn main() -> upipe::Result<()> {
//! let env = DistEnv::from_env()?.expect("started by upipe launch, torchrun or srun");
//! let mut rv = Rendezvous::connect(&env, Duration::from_secs(300))?;
//! let nccl_id = [0u8; 128]; // from ncclGetUniqueId on rank 0
//! let id = rv.broadcast_bytes(env.is_master().then_some(&nccl_id[..]))?;
//! assert_eq!(id.len(), 128);
//! # Ok(())
//! # }
//! ```

mod wire;

use std::io::ErrorKind;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::comm::env::DistEnv;
use crate::error::{Error, Result};
use wire::{Hello, Tag, WireError};

/// How long a rank waits for rank 0's verdict beyond the rendezvous timeout,
/// so that rank 0's own timeout message (which names the missing ranks)
/// arrives first.
const ROOT_GRACE: Duration = Duration::from_secs(2);
/// Longest wait for a freshly accepted connection to announce itself.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How often rank 0 checks for new connections and the deadline.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// First and largest pause between connection attempts of a non-zero rank.
const BACKOFF_START: Duration = Duration::from_millis(20);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// A connected rendezvous: every rank of the run has arrived.
#[derive(Debug)]
pub struct Rendezvous {
    rank: usize,
    world_size: usize,
    /// `MASTER_ADDR:MASTER_PORT`, for messages.
    endpoint: String,
    link: Link,
}

/// This rank's connections.
#[derive(Debug)]
enum Link {
    /// World size 1: nothing to connect.
    Solo,
    /// Rank 0: one stream per other rank, index `r - 1` for rank `r`.
    Root(Vec<TcpStream>),
    /// Any other rank: the stream to rank 0.
    Peer(TcpStream),
}

impl Rendezvous {
    /// Joins the rendezvous of `env`, waiting at most `timeout` for every rank
    /// to arrive. Rank 0 binds `MASTER_ADDR:MASTER_PORT`; the others connect.
    pub fn connect(env: &DistEnv, timeout: Duration) -> Result<Rendezvous> {
        let endpoint = format!("{}:{}", env.master_addr, env.master_port);
        if u32::try_from(env.world_size).is_err() {
            return Err(Error::Config(format!(
                "world size {} is too large for the rendezvous",
                env.world_size
            )));
        }
        let link = if env.world_size == 1 {
            Link::Solo
        } else if env.is_master() {
            Link::Root(serve(env, &endpoint, timeout)?)
        } else {
            Link::Peer(join(env, &endpoint, timeout)?)
        };
        tracing::debug!(rank = env.rank, world_size = env.world_size, %endpoint, "rendezvous complete");
        Ok(Rendezvous {
            rank: env.rank,
            world_size: env.world_size,
            endpoint,
            link,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the run.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Every rank's `mine`, indexed by rank (the same list on every rank).
    pub fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let rank = self.rank;
        match &mut self.link {
            Link::Solo => Ok(vec![mine.to_vec()]),
            Link::Root(peers) => abort_on_error(peers, |peers| {
                let mut all = vec![mine.to_vec()];
                for (i, peer) in peers.iter_mut().enumerate() {
                    all.push(recv_from_peer(peer, i + 1, Tag::AllGather)?);
                }
                send_to_peers(peers, Tag::AllGather, &wire::encode_list(&all))?;
                Ok(all)
            }),
            Link::Peer(root) => {
                send_to_root(root, rank, Tag::AllGather, mine)?;
                let payload = recv_from_root(root, rank, Tag::AllGather)?;
                wire::decode_list(&payload)
                    .filter(|all| all.len() == self.world_size)
                    .ok_or_else(|| {
                        Error::Comm(format!(
                            "rank {rank}: malformed all_gather_bytes reply from rank 0 at {}",
                            self.endpoint
                        ))
                    })
            }
        }
    }

    /// Rank 0's bytes on every rank. Rank 0 passes `Some(bytes)`; what other
    /// ranks pass is ignored (pass `None`).
    pub fn broadcast_bytes(&mut self, from_rank0: Option<&[u8]>) -> Result<Vec<u8>> {
        let rank = self.rank;
        let missing = || {
            Error::Comm("broadcast_bytes on rank 0 needs the bytes to send, got None".to_string())
        };
        match &mut self.link {
            Link::Solo => from_rank0.map(<[u8]>::to_vec).ok_or_else(missing),
            Link::Root(peers) => abort_on_error(peers, |peers| {
                let bytes = from_rank0.ok_or_else(missing)?;
                send_to_peers(peers, Tag::Broadcast, bytes)?;
                Ok(bytes.to_vec())
            }),
            Link::Peer(root) => recv_from_root(root, rank, Tag::Broadcast),
        }
    }

    /// Checks that every rank decided `mine` alike (`what` names it: a
    /// choice each process makes on its own, from what it reads of its
    /// machine). When they differ every rank fails alike, with rank 0's
    /// value, the first rank that differs and its value, and `fix`.
    pub fn agree(&mut self, what: &str, mine: &str, fix: &str) -> Result<()> {
        let all = self.all_gather_bytes(mine.as_bytes())?;
        match first_disagreement(&all) {
            None => Ok(()),
            Some(r) => Err(Error::Config(format!(
                "the ranks resolved {what} differently: rank 0 {}, rank {r} {}; {fix}",
                String::from_utf8_lossy(&all[0]),
                String::from_utf8_lossy(&all[r]),
            ))),
        }
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&mut self) -> Result<()> {
        let rank = self.rank;
        match &mut self.link {
            Link::Solo => Ok(()),
            Link::Root(peers) => abort_on_error(peers, |peers| {
                for (i, peer) in peers.iter_mut().enumerate() {
                    recv_from_peer(peer, i + 1, Tag::Barrier)?;
                }
                send_to_peers(peers, Tag::Barrier, &[])
            }),
            Link::Peer(root) => {
                send_to_root(root, rank, Tag::Barrier, &[])?;
                recv_from_root(root, rank, Tag::Barrier).map(drop)
            }
        }
    }
}

/// The first rank whose bytes differ from rank 0's (`None`: all agree).
fn first_disagreement(all: &[Vec<u8>]) -> Option<usize> {
    let first = all.first()?;
    all.iter().position(|b| b != first)
}

// ---- rank 0: accepting -------------------------------------------------

/// Binds, waits for every other rank, checks their announcements and
/// welcomes them; returns the streams ordered by rank.
fn serve(env: &DistEnv, endpoint: &str, timeout: Duration) -> Result<Vec<TcpStream>> {
    let listener = bind(env, endpoint)?;
    listener.set_nonblocking(true).map_err(|e| {
        Error::io(
            format!("configuring the rendezvous listener at {endpoint}"),
            e,
        )
    })?;
    let deadline = Instant::now() + timeout;
    let mut arrived: Vec<Option<(TcpStream, SocketAddr)>> =
        (1..env.world_size).map(|_| None).collect();
    while arrived.iter().any(Option::is_none) {
        let result = match listener.accept() {
            Ok((stream, from)) => admit(&mut arrived, stream, from, env.world_size, deadline),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    Err(Error::Comm(timeout_message(endpoint, timeout, &arrived)))
                } else {
                    std::thread::sleep(ACCEPT_POLL);
                    Ok(())
                }
            }
            Err(e) if is_transient_accept_error(&e) => Ok(()),
            Err(e) => Err(Error::io(
                format!("accepting at the rendezvous {endpoint}"),
                e,
            )),
        };
        if let Err(e) = result {
            let mut streams: Vec<TcpStream> =
                arrived.into_iter().flatten().map(|(s, _)| s).collect();
            abort_peers(&mut streams, &e);
            return Err(e);
        }
    }
    let mut peers: Vec<TcpStream> = arrived.into_iter().flatten().map(|(s, _)| s).collect();
    abort_on_error(&mut peers, |peers| send_to_peers(peers, Tag::Welcome, &[]))?;
    Ok(peers)
}

/// The listening socket. A loopback `MASTER_ADDR` is bound as is; any other
/// is bound on all interfaces of its family, because a host name may resolve
/// differently on the master itself (e.g. to 127.0.1.1) than on other nodes.
fn bind(env: &DistEnv, endpoint: &str) -> Result<TcpListener> {
    let resolved: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| {
            Error::Config(format!(
                "MASTER_ADDR='{}' does not resolve ({e}); set it to this node's address",
                env.master_addr
            ))
        })?
        .collect();
    let target = match resolved.iter().find(|a| a.ip().is_loopback()) {
        Some(loopback) => *loopback,
        None if resolved.iter().any(SocketAddr::is_ipv6)
            && !resolved.iter().any(SocketAddr::is_ipv4) =>
        {
            SocketAddr::from((Ipv6Addr::UNSPECIFIED, env.master_port))
        }
        None => SocketAddr::from((Ipv4Addr::UNSPECIFIED, env.master_port)),
    };
    TcpListener::bind(target).map_err(|e| {
        if e.kind() == ErrorKind::AddrInUse {
            Error::Comm(format!(
                "rendezvous port {port} at {endpoint} is already in use (another job, or a \
                 previous run that has not exited, holds it); choose a free port with \
                 `upipe launch --master-port <PORT>` or MASTER_PORT",
                port = env.master_port
            ))
        } else {
            Error::io(
                format!("binding the rendezvous at {target} (MASTER_ADDR:MASTER_PORT={endpoint})"),
                e,
            )
        }
    })
}

/// Reads a new connection's hello and records it. Stray connections that do
/// not speak the protocol are dropped with a warning; a wrong world size or a
/// rank claimed twice is an error.
fn admit(
    arrived: &mut [Option<(TcpStream, SocketAddr)>],
    mut stream: TcpStream,
    from: SocketAddr,
    world_size: usize,
    deadline: Instant,
) -> Result<()> {
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(1), HELLO_TIMEOUT);
    let setup = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(wait)))
        .and_then(|()| stream.set_nodelay(true));
    if let Err(e) = setup {
        tracing::warn!("rendezvous: dropping connection from {from}: {e}");
        return Ok(());
    }
    let hello = match wire::read_hello(&mut stream) {
        Ok(hello) => hello,
        Err(e) => {
            tracing::warn!("rendezvous: dropping connection from {from}: {e}");
            return Ok(());
        }
    };
    if let Err(e) = check_hello(arrived, hello, from, world_size) {
        let _ = wire::write_frame(&mut stream, Tag::Abort, e.to_string().as_bytes());
        return Err(e);
    }
    if let Err(e) = stream.set_read_timeout(None) {
        return Err(Error::io(
            format!("configuring the connection of rank {}", hello.rank),
            e,
        ));
    }
    arrived[hello.rank as usize - 1] = Some((stream, from));
    Ok(())
}

/// Validates an announcement against rank 0's world size and the ranks seen so far.
fn check_hello(
    arrived: &[Option<(TcpStream, SocketAddr)>],
    hello: Hello,
    from: SocketAddr,
    world_size: usize,
) -> Result<()> {
    let Hello {
        rank,
        world_size: theirs,
    } = hello;
    if theirs as usize != world_size {
        return Err(Error::Comm(format!(
            "rank {rank} (from {from}) has world size {theirs} but rank 0 has world size \
             {world_size}; start every process with the same WORLD_SIZE"
        )));
    }
    if rank == 0 || rank as usize >= world_size {
        return Err(Error::Comm(format!(
            "a process at {from} claims rank {rank}, but rank 0 is this process and ranks end \
             at {}; every process needs a distinct RANK in 0..WORLD_SIZE",
            world_size - 1
        )));
    }
    if let Some((_, first)) = &arrived[rank as usize - 1] {
        return Err(Error::Comm(format!(
            "rank {rank} arrived twice (from {first} and from {from}); every process needs a \
             distinct RANK — check --node-rank / SLURM_PROCID on each node"
        )));
    }
    Ok(())
}

/// The error text for ranks that never arrived.
fn timeout_message(
    endpoint: &str,
    timeout: Duration,
    arrived: &[Option<(TcpStream, SocketAddr)>],
) -> String {
    let missing: Vec<usize> = arrived
        .iter()
        .enumerate()
        .filter(|(_, slot)| slot.is_none())
        .map(|(i, _)| i + 1)
        .collect();
    format!(
        "rendezvous at {endpoint} timed out after {timeout:?}: ranks {missing:?} never arrived \
         (world size {}); check that every node started and uses the same MASTER_ADDR/MASTER_PORT",
        arrived.len() + 1
    )
}

/// Accept errors caused by one client (it went away) rather than the listener.
fn is_transient_accept_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Interrupted | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}

// ---- other ranks: connecting -------------------------------------------

/// Connects to rank 0, announces this rank and waits for the welcome.
fn join(env: &DistEnv, endpoint: &str, timeout: Duration) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut stream = dial(env, endpoint, timeout, deadline)?;
    let hello = Hello {
        rank: env.rank as u32,
        world_size: env.world_size as u32,
    };
    let verdict_wait = deadline.saturating_duration_since(Instant::now()) + ROOT_GRACE;
    stream
        .set_nodelay(true)
        .and_then(|()| wire::write_hello(&mut stream, hello))
        .and_then(|()| stream.set_read_timeout(Some(verdict_wait)))
        .map_err(|e| {
            Error::io(
                format!(
                    "rank {}: announcing itself to rank 0 at {endpoint}",
                    env.rank
                ),
                e,
            )
        })?;
    match wire::read_frame(&mut stream) {
        Ok((Tag::Welcome, _)) => {}
        Ok((Tag::Abort, reason)) => return Err(aborted_by_root(env.rank, &reason)),
        Ok((tag, _)) => return Err(mismatch(0, tag, env.rank, Tag::Welcome)),
        Err(WireError::Io(e)) if is_timeout(&e) => {
            return Err(Error::Comm(format!(
                "rendezvous at {endpoint} timed out after {timeout:?}: rank {} connected but \
                 rank 0 never reported that all {} ranks arrived; check that every node started",
                env.rank, env.world_size
            )));
        }
        Err(e) => return Err(lost_root(env.rank, endpoint, "connect", &e)),
    }
    stream.set_read_timeout(None).map_err(|e| {
        Error::io(
            format!("rank {}: configuring the rendezvous stream", env.rank),
            e,
        )
    })?;
    Ok(stream)
}

/// Connects to `endpoint`, retrying with exponential backoff until `deadline`.
fn dial(env: &DistEnv, endpoint: &str, timeout: Duration, deadline: Instant) -> Result<TcpStream> {
    let mut backoff = BACKOFF_START;
    loop {
        let attempt = (env.master_addr.as_str(), env.master_port)
            .to_socket_addrs()
            .and_then(|addrs| connect_any(addrs, deadline));
        let last_error = match attempt {
            Ok(stream) => return Ok(stream),
            Err(e) => e,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Comm(format!(
                "rendezvous at {endpoint} timed out after {timeout:?}: rank {} could not reach \
                 rank 0 (last error: {last_error}); check that rank 0 started and that \
                 MASTER_ADDR/MASTER_PORT are the same on every node",
                env.rank
            )));
        }
        std::thread::sleep(backoff.min(deadline - now));
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Tries each resolved address once.
fn connect_any(
    addrs: impl Iterator<Item = SocketAddr>,
    deadline: Instant,
) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(ErrorKind::NotFound, "the address resolved to nothing");
    for addr in addrs {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), Duration::from_secs(2));
        match TcpStream::connect_timeout(&addr, wait) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

// ---- framing with error context ----------------------------------------

fn send_to_peers(peers: &mut [TcpStream], tag: Tag, payload: &[u8]) -> Result<()> {
    for (i, peer) in peers.iter_mut().enumerate() {
        wire::write_frame(peer, tag, payload)
            .map_err(|e| lost_peer(i + 1, tag, &WireError::Io(e)))?;
    }
    Ok(())
}

fn recv_from_peer(peer: &mut TcpStream, rank: usize, expected: Tag) -> Result<Vec<u8>> {
    match wire::read_frame(peer) {
        Ok((tag, payload)) if tag == expected => Ok(payload),
        Ok((Tag::Abort, reason)) => Err(Error::Comm(format!(
            "rank {rank} aborted: {}",
            String::from_utf8_lossy(&reason)
        ))),
        Ok((tag, _)) => Err(mismatch(rank, tag, 0, expected)),
        Err(e) => Err(lost_peer(rank, expected, &e)),
    }
}

fn send_to_root(root: &mut TcpStream, rank: usize, tag: Tag, payload: &[u8]) -> Result<()> {
    wire::write_frame(root, tag, payload)
        .map_err(|e| lost_root(rank, &peer_name(root), tag.operation(), &WireError::Io(e)))
}

fn recv_from_root(root: &mut TcpStream, rank: usize, expected: Tag) -> Result<Vec<u8>> {
    match wire::read_frame(root) {
        Ok((tag, payload)) if tag == expected => Ok(payload),
        Ok((Tag::Abort, reason)) => Err(aborted_by_root(rank, &reason)),
        Ok((tag, _)) => Err(mismatch(0, tag, rank, expected)),
        Err(e) => Err(lost_root(rank, &peer_name(root), expected.operation(), &e)),
    }
}

/// Runs rank 0's part of a collective; on failure tells every peer why.
fn abort_on_error<T>(
    peers: &mut [TcpStream],
    op: impl FnOnce(&mut [TcpStream]) -> Result<T>,
) -> Result<T> {
    op(peers).inspect_err(|e| abort_peers(peers, e))
}

/// Best effort: forward rank 0's error to every peer still listening.
fn abort_peers(peers: &mut [TcpStream], error: &Error) {
    let reason = match error {
        Error::Comm(message) => message.clone(),
        other => other.to_string(),
    };
    for peer in peers {
        let _ = wire::write_frame(peer, Tag::Abort, reason.as_bytes());
    }
}

fn aborted_by_root(rank: usize, reason: &[u8]) -> Error {
    Error::Comm(format!(
        "rank {rank}: rank 0 aborted the rendezvous: {}",
        String::from_utf8_lossy(reason)
    ))
}

fn mismatch(sender: usize, got: Tag, receiver: usize, expected: Tag) -> Error {
    Error::Comm(format!(
        "rank {sender} called {} while rank {receiver} called {}; every rank must call the same \
         rendezvous operations in the same order",
        got.operation(),
        expected.operation()
    ))
}

fn lost_peer(rank: usize, during: Tag, e: &WireError) -> Error {
    Error::Comm(format!(
        "rank {rank} disconnected during {} ({e}); it probably exited or crashed, see its log",
        during.operation()
    ))
}

fn lost_root(rank: usize, endpoint: &str, during: &str, e: &WireError) -> Error {
    Error::Comm(format!(
        "rank {rank}: lost the connection to rank 0 at {endpoint} during {during} ({e}); \
         rank 0 probably exited or crashed, see its log"
    ))
}

fn peer_name(stream: &TcpStream) -> String {
    stream
        .peer_addr()
        .map_or_else(|_| "the rendezvous".to_string(), |a| a.to_string())
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn env(rank: usize, world_size: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    /// Runs `body` on `ranks` threads, each with its own rendezvous.
    fn run_ranks<T: Send + 'static>(
        world_size: usize,
        ranks: &[usize],
        timeout: Duration,
        body: impl Fn(Result<Rendezvous>) -> T + Send + Sync + Copy + 'static,
    ) -> Vec<T> {
        let port = free_port();
        let handles: Vec<_> = ranks
            .iter()
            .map(|&r| {
                thread::spawn(move || body(Rendezvous::connect(&env(r, world_size, port), timeout)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn collectives_agree_across_ranks() {
        let results = run_ranks(4, &[3, 1, 0, 2], Duration::from_secs(10), |rv| {
            let mut rv = rv.unwrap();
            let mine = vec![rv.rank() as u8; rv.rank()];
            let all = rv.all_gather_bytes(&mine).unwrap();
            let id = rv
                .broadcast_bytes((rv.rank() == 0).then_some(&b"id-xyz"[..]))
                .unwrap();
            rv.barrier().unwrap();
            let again = rv.all_gather_bytes(&[]).unwrap();
            (all, id, again.len())
        });
        for (all, id, n) in results {
            assert_eq!(all, vec![vec![], vec![1], vec![2, 2], vec![3, 3, 3]]);
            assert_eq!(id, b"id-xyz");
            assert_eq!(n, 4);
        }
    }

    #[test]
    fn ranks_that_decided_differently_all_fail_naming_the_fix() {
        let agreed = run_ranks(3, &[2, 0, 1], Duration::from_secs(10), |rv| {
            rv.unwrap().agree("U", "4", "pass --chunk-heads").is_ok()
        });
        assert_eq!(agreed, vec![true; 3]);
        let errors = run_ranks(3, &[1, 2, 0], Duration::from_secs(10), |rv| {
            let mut rv = rv.unwrap();
            let mine = if rv.rank() == 2 { "2" } else { "4" };
            rv.agree("U", mine, "pass --chunk-heads")
                .unwrap_err()
                .to_string()
        });
        for e in errors {
            assert!(e.contains("rank 0 4, rank 2 2; pass --chunk-heads"), "{e}");
        }
        assert_eq!(first_disagreement(&[]), None);
        assert_eq!(first_disagreement(&[vec![1], vec![1]]), None);
        assert_eq!(
            first_disagreement(&[vec![1], vec![1], vec![], vec![2]]),
            Some(2)
        );
    }

    #[test]
    fn world_of_one_needs_no_network() {
        let mut rv = Rendezvous::connect(&env(0, 1, 1), Duration::from_millis(10)).unwrap();
        assert_eq!(rv.all_gather_bytes(b"a").unwrap(), vec![b"a".to_vec()]);
        assert_eq!(rv.broadcast_bytes(Some(b"b")).unwrap(), b"b");
        assert!(rv.broadcast_bytes(None).is_err());
        rv.barrier().unwrap();
    }

    #[test]
    fn missing_rank_is_named_on_every_rank() {
        let start = Instant::now();
        let results = run_ranks(4, &[0, 1, 2], Duration::from_millis(500), |rv| {
            rv.map(drop).unwrap_err().to_string()
        });
        assert!(start.elapsed() < Duration::from_secs(5));
        for msg in results {
            assert!(
                msg.contains("ranks [3] never arrived (world size 4)"),
                "{msg}"
            );
        }
    }

    #[test]
    fn mismatched_world_size_is_rejected() {
        let port = free_port();
        let root =
            thread::spawn(move || Rendezvous::connect(&env(0, 2, port), Duration::from_secs(5)));
        let peer = Rendezvous::connect(&env(1, 3, port), Duration::from_secs(5)).unwrap_err();
        let root = root.join().unwrap().unwrap_err();
        for msg in [root.to_string(), peer.to_string()] {
            assert!(
                msg.contains("world size 3 but rank 0 has world size 2"),
                "{msg}"
            );
        }
    }

    #[test]
    fn duplicated_rank_is_rejected() {
        let results = run_ranks(3, &[0, 1, 1], Duration::from_secs(5), |rv| {
            rv.map(drop).unwrap_err().to_string()
        });
        for msg in results {
            assert!(msg.contains("rank 1 arrived twice"), "{msg}");
        }
    }

    #[test]
    fn port_in_use_names_the_port() {
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let err = Rendezvous::connect(&env(0, 2, port), Duration::from_secs(1)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("port {port}")) && msg.contains("--master-port"),
            "{msg}"
        );
    }

    #[test]
    fn absent_rank_zero_times_out_on_peers() {
        let port = free_port();
        let start = Instant::now();
        let err = Rendezvous::connect(&env(1, 2, port), Duration::from_millis(300)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(err.to_string().contains("could not reach rank 0"), "{err}");
    }

    #[test]
    fn mismatched_collectives_are_reported() {
        let results = run_ranks(2, &[0, 1], Duration::from_secs(5), |rv| {
            let mut rv = rv.unwrap();
            if rv.rank() == 0 {
                rv.barrier().map(drop)
            } else {
                rv.all_gather_bytes(b"x").map(drop)
            }
            .unwrap_err()
            .to_string()
        });
        for msg in results {
            assert!(
                msg.contains("rank 1 called all_gather_bytes while rank 0 called barrier"),
                "{msg}"
            );
        }
    }

    #[test]
    fn stray_connection_is_ignored() {
        let port = free_port();
        let root =
            thread::spawn(move || Rendezvous::connect(&env(0, 2, port), Duration::from_secs(10)));
        // A foreign client that sends garbage, then the real rank 1.
        let mut stray = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        };
        std::io::Write::write_all(&mut stray, b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut peer = Rendezvous::connect(&env(1, 2, port), Duration::from_secs(10)).unwrap();
        let mut root = root.join().unwrap().unwrap();
        let t = thread::spawn(move || root.broadcast_bytes(Some(b"ok")).unwrap());
        assert_eq!(peer.broadcast_bytes(None).unwrap(), b"ok");
        t.join().unwrap();
    }
}

//! This process's world communicator and the mesh groups split from it.

use super::comm::{Comm, drv, drv_bind, fault_check, lock};
use super::exchange_window::{self, ExchangeWindow};
use super::group::{NcclGroup, zero_cta_config};
use super::library::{check, library, native_alltoall, supports_split};
use super::split::split_specs;
use super::unique_id::{exchange_unique_id, new_unique_id};
use super::watch::{WATCH_CAPACITY, Watch, WatchThread, require_watchdog_symbols};
use crate::backend::cuda::CudaBackend;
use crate::comm::env::DistEnv;
use crate::comm::rendezvous::Rendezvous;
use crate::comm::watchdog::{self, Watchdog};
use crate::comm::{GroupKind, Mesh, MeshShape, ProcessGroup};
use crate::error::{Error, Result};
use cudarc::nccl::sys;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// This process's world communicator on its GPU; builds meshes.
pub struct NcclWorld {
    backend: Arc<CudaBackend>,
    /// The world communicator; its stream is the one every collective of
    /// this process runs on, ordered against the compute stream by events.
    comm: Arc<Comm>,
    rank: usize,
    size: usize,
    /// Ranks per node (consecutive global ranks share a node).
    local_world_size: usize,
    /// The collectives and communicators the watchdog follows (`None`: off).
    watch: Option<Arc<Watch>>,
    /// Its thread, stopped and joined first on drop.
    watch_thread: Option<WatchThread>,
    timeout: Option<Duration>,
}

impl NcclWorld {
    /// Joins the world of `env` on `backend`'s GPU: loads libnccl (logging the
    /// file), exchanges the unique id through `rv` and initialises the
    /// communicator. Collective over all ranks. Starts the watchdog unless
    /// `UPIPE_NCCL_TIMEOUT_S=0` (a bad value is an error here).
    // Long: joining the world is one ordered, collective sequence (library,
    // unique id through the rendezvous, communicator, watchdog).
    pub fn connect(
        env: &DistEnv,
        rv: &mut Rendezvous,
        backend: Arc<CudaBackend>,
    ) -> Result<NcclWorld> {
        let lib = library()?;
        tracing::info!(rank = env.rank, "NCCL: {}", lib.describe());
        let timeout = watchdog::timeout_from_env()?;
        if timeout.is_some() {
            require_watchdog_symbols()?;
        }
        if let Some(v) = &lib.api_version
            && !supports_split(v)
        {
            return Err(Error::LibraryMissing(format!(
                "NCCL {v} at {} lacks ncclCommSplit (needs 2.18 or newer); set UPIPE_NCCL_LIB to a newer libnccl.so.2",
                lib.path.display()
            )));
        }
        if rv.world_size() != env.world_size || rv.rank() != env.rank {
            return Err(Error::Comm(format!(
                "rendezvous is rank {}/{} but the environment says {}/{}",
                rv.rank(),
                rv.world_size(),
                env.rank,
                env.world_size
            )));
        }
        let id = exchange_unique_id(rv, new_unique_id)?;
        let nranks = i32::try_from(env.world_size)
            .map_err(|_| Error::Config("world size exceeds NCCL's int".into()))?;
        drv_bind(&backend)?;
        // the highest priority the device has, so that beside compute
        // (`--overlap`) the block scheduler prefers NCCL's blocks to the
        // compute kernels' pending ones (on 2×H200 this did not make overlap
        // pay: RESULTS.md); collectives not beside compute are unaffected
        let (_, greatest) = drv(
            cudarc::driver::result::stream::get_priority_range(),
            "stream priority range",
        )?;
        let comm_stream = drv(
            backend.context().new_stream_with_priority(greatest),
            "create the communication stream",
        )?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: `raw` is a valid out pointer, the context of the backend's
        // GPU is current, and every rank passes the same id and world size.
        check(
            unsafe { sys::ncclCommInitRank(&mut raw, nranks, uid, env.rank as i32) },
            "ncclCommInitRank (world)",
            None,
        )?;
        let fault = backend.comm_fault().clone();
        let comm = Arc::new(Comm::new(raw, "world", comm_stream, fault.clone()));
        let (watch, thread) = match timeout {
            None => {
                tracing::info!(
                    rank = env.rank,
                    "NCCL watchdog off ({}=0)",
                    watchdog::TIMEOUT_VAR
                );
                (None, None)
            }
            Some(t) => {
                let watch = Arc::new(Watch {
                    dog: Mutex::new(Watchdog::new(t, WATCH_CAPACITY)),
                    comms: Mutex::new(Vec::new()),
                    rank: env.rank,
                });
                watch.register(&comm);
                let thread =
                    WatchThread::spawn(watch.clone(), backend.context().clone(), fault, t)?;
                (Some(watch), Some(thread))
            }
        };
        Ok(NcclWorld {
            backend,
            comm,
            rank: env.rank,
            size: env.world_size,
            local_world_size: env.local_world_size,
            watch,
            watch_thread: thread,
            timeout,
        })
    }

    /// The watchdog's timeout (`None`: off).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// `Err` with the watchdog's message once it has failed a collective
    /// (the same error every later collective and sync returns).
    pub fn health(&self) -> Result<()> {
        fault_check(self.backend.comm_fault())
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The backend the communicators run on.
    pub fn backend(&self) -> &Arc<CudaBackend> {
        &self.backend
    }

    /// The process groups of `shape` for this rank, split from the world
    /// communicator. Collective over all ranks (all must pass the same shape).
    // Long: each group's split, its optional copy-engine window and its
    // watchdog registration happen in the same order on every rank (they are
    // collective); one loop keeps that order in view.
    pub fn mesh(&self, shape: MeshShape) -> Result<Mesh<CudaBackend>> {
        if shape.world_size() != self.size {
            return Err(Error::Config(format!(
                "a {}x{}x{} mesh needs {} ranks but {} were launched (data x ring x ulysses)",
                shape.data,
                shape.ring,
                shape.ulysses,
                shape.world_size(),
                self.size
            )));
        }
        let window_bytes = exchange_window::size_from_env()?;
        if window_bytes.is_some() && !native_alltoall() {
            let version = library()?.api_version.clone().unwrap_or_default();
            return Err(Error::Config(format!(
                "{} needs ncclAlltoAll (copy engines): NCCL 2.28 or newer (this is {version:?}; \
                 UPIPE_NCCL_LIB picks another libnccl.so.2) and UPIPE_NCCL_ALLTOALL not 0; \
                 or unset {}",
                exchange_window::SIZE_VAR,
                exchange_window::SIZE_VAR
            )));
        }
        drv_bind(&self.backend)?;
        let mut groups = Vec::new();
        for spec in split_specs(shape, self.rank)? {
            let mut raw: sys::ncclComm_t = std::ptr::null_mut();
            // the Ulysses group moves its all-to-alls on copy engines when
            // it has an exchange window (zero-CTA policy)
            let window =
                window_bytes.filter(|_| spec.kind == GroupKind::Ulysses && spec.members.len() > 1);
            if window.is_some() && !exchange_window::one_node(&spec.members, self.local_world_size)
            {
                return Err(Error::Config(format!(
                    "{} needs each Ulysses group on one node (copy engines reach NVLink peers only), \
                     but group {:?} spans nodes of {} ranks; unset it or keep --ulysses within a node",
                    exchange_window::SIZE_VAR,
                    spec.members,
                    self.local_world_size
                )));
            }
            let mut config = window.map(|_| zero_cta_config());
            let config_ptr = config
                .as_mut()
                .map_or(std::ptr::null_mut(), |c| c as *mut sys::ncclConfig_t);
            let world_lock = lock(&self.comm)?;
            // SAFETY: the world communicator is valid; a null config inherits
            // the parent's; every rank makes the same sequence of splits
            // with the same configs.
            check(
                unsafe {
                    sys::ncclCommSplit(self.comm.raw, spec.color, spec.key, &mut raw, config_ptr)
                },
                &format!("ncclCommSplit ({:?} group {:?})", spec.kind, spec.members),
                Some(self.comm.raw),
            )?;
            drop(world_lock);
            if raw.is_null() {
                return Err(Error::Comm(format!(
                    "NCCL returned no communicator for the {:?} group {:?}",
                    spec.kind, spec.members
                )));
            }
            let name = format!(
                "{} {:?}",
                format!("{:?}", spec.kind).to_lowercase(),
                spec.members
            );
            let comm = Arc::new(Comm::new(
                raw,
                &name,
                self.comm.stream.clone(),
                self.backend.comm_fault().clone(),
            ));
            // A communicator of one rank has no peer to fail, and on the
            // 2xH200 run (NCCL 2.28.3) the watchdog's first
            // ncclCommGetAsyncError on a fresh one-rank split never returned:
            // its collectives are still timed by their end events.
            if let Some(w) = self.watch.as_ref().filter(|_| spec.members.len() > 1) {
                w.register(&comm);
            }
            let window = match window {
                Some(bytes) => Some(ExchangeWindow::register(
                    comm.clone(),
                    self.backend.clone(),
                    bytes,
                )?),
                None => None,
            };
            groups.push(self.group_with_window(comm, spec.members, window));
        }
        let mut it = groups.into_iter();
        let mut next = || it.next().expect("six splits");
        let (ulysses, ring, context, data) = (next(), next(), next(), next());
        let (shard, replica) = (next(), next());
        Ok(Mesh {
            shape,
            rank: self.rank,
            world: self.group(self.comm.clone(), (0..self.size).collect()),
            ulysses,
            ring,
            context,
            data,
            shard,
            replica,
        })
    }

    fn group(&self, comm: Arc<Comm>, members: Vec<usize>) -> Box<dyn ProcessGroup<CudaBackend>> {
        self.group_with_window(comm, members, None)
    }

    fn group_with_window(
        &self,
        comm: Arc<Comm>,
        members: Vec<usize>,
        window: Option<Arc<ExchangeWindow>>,
    ) -> Box<dyn ProcessGroup<CudaBackend>> {
        let me = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("split_specs puts the rank in its groups");
        Box::new(NcclGroup {
            backend: self.backend.clone(),
            comm,
            me,
            size: members.len(),
            watch: self.watch.clone(),
            window,
        })
    }
}

impl Drop for NcclWorld {
    fn drop(&mut self) {
        // stop watching before the communicators go
        drop(self.watch_thread.take());
    }
}

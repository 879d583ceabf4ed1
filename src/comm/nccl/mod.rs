//! NCCL process groups: one process per GPU.
//!
//! The library is found and opened by [`crate::backend::cuda::libs`] (the
//! same discovery as every other CUDA library; `UPIPE_NCCL_LIB` overrides).
//! Rank 0 creates the 128-byte NCCL unique id and hands it to every rank
//! through the TCP [`Rendezvous`]; every rank then joins the world
//! communicator on its own GPU. The groups of a [`Mesh`] (Ulysses, ring,
//! context, data) are split from the world communicator with
//! `ncclCommSplit` (colour = the group's lowest global rank, key = the rank's
//! position in [`MeshShape::members`]), so their membership and group-rank
//! order are exactly those of the thread-rank meshes.
//!
//! Every collective is queued on the [`CudaBackend`]'s stream, in stream
//! order with the kernels around it; nothing waits on the host. An error
//! returned by NCCL names the call, NCCL's error string and the
//! communicator's last error message.
//!
//! A watchdog thread per [`NcclWorld`] (`UPIPE_NCCL_TIMEOUT_S`, default
//! 600 s, 0 = off; policy in [`super::watchdog`]) follows every issued
//! collective by its end event (`cuEventQuery`) and every communicator by
//! `ncclCommGetAsyncError`. When a collective outlives the timeout or NCCL
//! reports an error it logs which collective of which group, records the
//! failure in the backend's [`CudaBackend::comm_fault`], and aborts every
//! communicator (`ncclCommAbort`), so NCCL kernels waiting for a dead peer
//! exit and the stream syncs blocked behind them return; from then on every
//! collective, every [`Pending`] wait and every backend sync returns
//! [`Error::Comm`] with the watchdog's message.
//!
//! [`Rendezvous`]: super::rendezvous::Rendezvous
//! [`Mesh`]: super::Mesh
//! [`MeshShape::members`]: super::MeshShape::members
//! [`CudaBackend`]: crate::backend::cuda::CudaBackend
//! [`CudaBackend::comm_fault`]: crate::backend::cuda::CudaBackend::comm_fault
//! [`Pending`]: super::Pending
//! [`Error::Comm`]: crate::error::Error::Comm

mod comm;
pub mod exchange_window;
mod group;
mod library;
mod split;
mod unique_id;
mod watch;
mod world;

pub use library::library;
pub use split::{SplitSpec, split_specs};
pub use unique_id::{UNIQUE_ID_BYTES, exchange_unique_id};
pub use world::NcclWorld;

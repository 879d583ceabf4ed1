//! The NCCL unique id: made by rank 0 and handed to every rank through the
//! TCP rendezvous.

use super::library::{check, library};
use crate::comm::rendezvous::Rendezvous;
use crate::error::{Error, Result};
use cudarc::nccl::sys;

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Hands rank 0's NCCL unique id to every rank. `make_id` runs on rank 0 only.
pub fn exchange_unique_id(
    rv: &mut Rendezvous,
    make_id: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES]>,
) -> Result<[u8; UNIQUE_ID_BYTES]> {
    let mine = if rv.rank() == 0 {
        Some(make_id()?)
    } else {
        None
    };
    let got = rv.broadcast_bytes(mine.as_ref().map(|m| &m[..]))?;
    got.as_slice().try_into().map_err(|_| {
        Error::Comm(format!(
            "rank {}: received a {}-byte NCCL id from rank 0, expected {UNIQUE_ID_BYTES}",
            rv.rank(),
            got.len()
        ))
    })
}

/// A new NCCL unique id (rank 0 only).
pub(super) fn new_unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    library()?;
    let mut id = sys::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a valid out pointer; the library is loaded.
    check(
        unsafe { sys::ncclGetUniqueId(&mut id) },
        "ncclGetUniqueId",
        None,
    )?;
    Ok(id.internal.map(|c| c as u8))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::env::DistEnv;
    use std::time::Duration;

    #[test]
    fn unique_id_reaches_every_rank_over_tcp() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let env = |rank| DistEnv {
            rank,
            world_size: 3,
            local_rank: rank,
            local_world_size: 3,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        };
        let id: [u8; UNIQUE_ID_BYTES] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let e = env(rank);
                std::thread::spawn(move || {
                    let mut rv = Rendezvous::connect(&e, Duration::from_secs(10))?;
                    exchange_unique_id(&mut rv, || {
                        assert_eq!(rank, 0, "only rank 0 makes the id");
                        Ok(id)
                    })
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), id);
        }
    }

    #[test]
    fn id_source_errors_are_reported() {
        let mut rv = Rendezvous::connect(
            &DistEnv {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                master_addr: "127.0.0.1".into(),
                master_port: 1,
            },
            Duration::from_millis(10),
        )
        .unwrap();
        assert_eq!(
            exchange_unique_id(&mut rv, || Ok([9; 128])).unwrap(),
            [9; 128]
        );
        // a failing id source on rank 0 is reported, not panicked on
        let err = exchange_unique_id(&mut rv, || Err(Error::Comm("no nccl".into()))).unwrap_err();
        assert!(err.to_string().contains("no nccl"), "{err}");
    }
}

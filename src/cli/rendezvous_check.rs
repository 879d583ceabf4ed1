//! `upipe rendezvous-check` (hidden): exercises the rendezvous with real
//! processes. Each rank connects, all-gathers its rank, receives an id from
//! rank 0 and prints `rank R/W saw [0,1,..] id=<hex>`. With `--fail-rank` it
//! checks instead that `upipe launch` stops the surviving ranks.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use crate::comm::env::DistEnv;
use crate::comm::rendezvous::Rendezvous;
use crate::error::{Error, Result};

/// Status of the rank chosen by `--fail-rank`.
pub const FAIL_STATUS: i32 = 3;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// This rank exits with status 3 right after connecting; the other ranks
    /// then wait up to --timeout-ms for the launcher to stop them.
    #[arg(long)]
    pub fail_rank: Option<usize>,
    /// How long to wait for every rank to arrive, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub timeout_ms: u64,
}

pub fn run(args: Args) -> Result<i32> {
    let env = DistEnv::from_env()?.ok_or_else(|| {
        Error::Config(
            "rendezvous-check needs RANK and WORLD_SIZE (or Slurm's variables); \
             run it under `upipe launch --nproc-per-node N -- rendezvous-check`"
                .to_string(),
        )
    })?;
    println!(
        "rank {} pid {} joining {}:{}",
        env.rank,
        std::process::id(),
        env.master_addr,
        env.master_port
    );
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut rv = Rendezvous::connect(&env, timeout)?;
    match args.fail_rank {
        Some(failing) if failing == env.rank => {
            eprintln!("rank {failing} failing on purpose (--fail-rank)");
            return Ok(FAIL_STATUS);
        }
        Some(failing) => {
            // Give the launcher the chance to stop this rank: only if it does
            // not within the timeout does this rank go on (and notice the
            // failed rank itself).
            println!(
                "rank {} waiting to be stopped after rank {failing} fails",
                env.rank
            );
            std::thread::sleep(timeout);
        }
        None => {}
    }
    let ranks = gather_ranks(&mut rv)?;
    let id = rv.broadcast_bytes(env.is_master().then(fresh_id).as_deref())?;
    rv.barrier()?;
    let ranks: Vec<String> = ranks.iter().map(u64::to_string).collect();
    println!(
        "rank {}/{} saw [{}] id={}",
        env.rank,
        env.world_size,
        ranks.join(","),
        hex(&id)
    );
    Ok(0)
}

/// Every rank's rank, as gathered (so index i must hold i).
fn gather_ranks(rv: &mut Rendezvous) -> Result<Vec<u64>> {
    let mine = (rv.rank() as u64).to_le_bytes();
    rv.all_gather_bytes(&mine)?
        .into_iter()
        .map(|bytes| {
            <[u8; 8]>::try_from(bytes.as_slice())
                .map(u64::from_le_bytes)
                .map_err(|_| Error::Comm(format!("a rank sent {} bytes instead of 8", bytes.len())))
        })
        .collect()
}

/// 16 unpredictable bytes (randomly keyed hashes of the pid and the time).
fn fresh_id() -> Vec<u8> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    (0..2u64)
        .flat_map(|i| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(i);
            h.write_u32(std::process::id());
            h.write_u128(nanos);
            h.finish().to_le_bytes()
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

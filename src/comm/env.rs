//! The distributed environment of this process: its rank, the world size and
//! where the rendezvous lives, read from the variables torchrun (and `upipe
//! launch`) or Slurm set.
//!
//! Precedence: torchrun's `RANK`/`WORLD_SIZE` win over Slurm's `SLURM_PROCID`
//! /`SLURM_NTASKS`, so `upipe launch` inside a Slurm allocation behaves like
//! torchrun. `MASTER_ADDR`/`MASTER_PORT` win over anything derived from Slurm.

use crate::config_err;
use crate::error::{Error, Result};

/// Rendezvous port used when `MASTER_PORT` is not set (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Rendezvous address used for single-node runs when `MASTER_ADDR` is not set.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// Where this process sits in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the run.
    pub world_size: usize,
    /// Rank among the processes of this node; selects the GPU.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Host name or address of rank 0, where the rendezvous listens.
    pub master_addr: String,
    /// TCP port of the rendezvous.
    pub master_port: u16,
}

impl DistEnv {
    /// Reads the process environment. `Ok(None)` when the process was not
    /// launched distributed (neither `RANK` nor `SLURM_PROCID` is set).
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Parses the environment given by `lookup` (variable name → value); the
    /// pure core of [`DistEnv::from_env`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let var = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            return torchrun(&var).map(Some);
        }
        if var("SLURM_PROCID").is_some() {
            return slurm(&var).map(Some);
        }
        Ok(None)
    }

    /// Whether this rank is the one that hosts the rendezvous.
    pub fn is_master(&self) -> bool {
        self.rank == 0
    }
}

/// torchrun / `upipe launch` variables.
fn torchrun(var: &impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
    let rank = required(var, "RANK", "this process's global rank")?;
    let world_size = required(var, "WORLD_SIZE", "the total number of processes")?;
    let local_world_size = optional(var, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
    let local_rank = match optional(var, "LOCAL_RANK")? {
        Some(r) => r,
        None => rank % local_world_size.max(1),
    };
    let (master_addr, master_port) = master(var, None, world_size, local_world_size)?;
    validate(
        DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        },
        ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    )
}

/// Slurm (`srun`) variables.
fn slurm(var: &impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
    let rank = required(var, "SLURM_PROCID", "this task's global rank")?;
    let world_size = match optional(var, "SLURM_NTASKS")? {
        Some(n) => n,
        None => required(var, "SLURM_NPROCS", "the number of tasks (srun --ntasks)")?,
    };
    let local_rank = required(var, "SLURM_LOCALID", "this task's rank on its node")?;
    let local_world_size = slurm_tasks_on_this_node(var)?.unwrap_or(world_size);
    let slurm_master = var("SLURM_JOB_NODELIST")
        .or_else(|| var("SLURM_NODELIST"))
        .map(|list| first_host(&list))
        .transpose()?
        .or_else(|| var("SLURM_LAUNCH_NODE_IPADDR"));
    let (master_addr, master_port) = master(var, slurm_master, world_size, local_world_size)?;
    validate(
        DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        },
        [
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_NTASKS_PER_NODE",
        ],
    )
}

/// Number of tasks on this node: `SLURM_NTASKS_PER_NODE`, else this node's
/// entry of `SLURM_TASKS_PER_NODE` (`"4(x2),3"` form, indexed by `SLURM_NODEID`).
fn slurm_tasks_on_this_node(var: &impl Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    if let Some(n) = optional(var, "SLURM_NTASKS_PER_NODE")? {
        return Ok(Some(n));
    }
    let Some(list) = var("SLURM_TASKS_PER_NODE") else {
        return Ok(None);
    };
    let counts = expand_tasks_per_node(&list)?;
    let node = optional(var, "SLURM_NODEID")?.unwrap_or(0);
    counts.get(node).copied().map(Some).ok_or_else(|| {
        Error::Config(format!(
            "SLURM_NODEID={node} has no entry in SLURM_TASKS_PER_NODE='{list}' ({} nodes); \
             run under srun, or set LOCAL_WORLD_SIZE",
            counts.len()
        ))
    })
}

/// Expands Slurm's compressed per-node task counts: `"4(x2),3"` → `[4, 4, 3]`.
fn expand_tasks_per_node(list: &str) -> Result<Vec<usize>> {
    let bad = || {
        Error::Config(format!(
            "SLURM_TASKS_PER_NODE='{list}' is not of the form '4(x2),3'; \
             run under srun, or set SLURM_NTASKS_PER_NODE"
        ))
    };
    let mut counts = Vec::new();
    for item in list.split(',').map(str::trim) {
        let (count, repeat) = match item.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(bad)?),
            None => (item, "1"),
        };
        let count: usize = count.parse().map_err(|_| bad())?;
        let repeat: usize = repeat.parse().map_err(|_| bad())?;
        counts.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(counts)
}

/// First host of a Slurm host list: `"gpu[003-010,12],login1"` → `"gpu003"`,
/// `"rack[1-2]-n[07-08]"` → `"rack1-n07"`.
pub fn first_host(list: &str) -> Result<String> {
    let bad = || {
        Error::Config(format!(
            "SLURM_JOB_NODELIST='{list}' is not a Slurm host list; set MASTER_ADDR to the first node"
        ))
    };
    let mut host = String::new();
    let mut rest = list.trim();
    loop {
        let stop = rest.find(['[', ',']).unwrap_or(rest.len());
        host.push_str(&rest[..stop]);
        rest = &rest[stop..];
        if !rest.starts_with('[') {
            break;
        }
        let close = rest.find(']').ok_or_else(bad)?;
        let range = &rest[1..close];
        let first = range.split([',', '-']).next().unwrap_or("");
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if host.is_empty() {
        return Err(bad());
    }
    Ok(host)
}

/// `MASTER_ADDR`/`MASTER_PORT`, with fallbacks: the Slurm-derived master,
/// then loopback for single-node runs.
fn master(
    var: &impl Fn(&str) -> Option<String>,
    fallback_addr: Option<String>,
    world_size: usize,
    local_world_size: usize,
) -> Result<(String, u16)> {
    let addr = match var("MASTER_ADDR").or(fallback_addr) {
        Some(a) => a.trim().to_string(),
        None if local_world_size >= world_size => DEFAULT_MASTER_ADDR.to_string(),
        None => {
            return config_err!(
                "MASTER_ADDR is not set and this run spans several nodes \
                 (WORLD_SIZE={world_size}, {local_world_size} per node); \
                 set MASTER_ADDR to the address of the node running rank 0"
            );
        }
    };
    let port = match var("MASTER_PORT") {
        None => DEFAULT_MASTER_PORT,
        Some(p) => match p.trim().parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => {
                return config_err!(
                    "MASTER_PORT='{p}' is not a TCP port; set it to a free port in 1..=65535 \
                     (e.g. {DEFAULT_MASTER_PORT}) on every process"
                );
            }
        },
    };
    Ok((addr, port))
}

/// Checks that the numbers agree; `names` are the variables that carried
/// (rank, world size, local rank, local world size), for the messages.
fn validate(env: DistEnv, names: [&str; 4]) -> Result<DistEnv> {
    let [rank, world, local_rank, local_world] = names;
    if env.world_size == 0 {
        return config_err!("{world}=0: a run needs at least one process");
    }
    if env.rank >= env.world_size {
        return config_err!(
            "{rank}={} is not below {world}={}: ranks are numbered 0..{world}-1; \
             check that every process was started with the same {world}",
            env.rank,
            env.world_size
        );
    }
    if env.local_world_size == 0 || env.local_world_size > env.world_size {
        return config_err!(
            "{local_world}={} must be in 1..={world} ({}); set it to the number of processes on this node",
            env.local_world_size,
            env.world_size
        );
    }
    if env.local_rank >= env.local_world_size {
        return config_err!(
            "{local_rank}={} is not below {local_world}={}: local ranks are numbered 0..{local_world}-1",
            env.local_rank,
            env.local_world_size
        );
    }
    Ok(env)
}

/// A variable that must be present and hold a non-negative integer.
fn required(var: &impl Fn(&str) -> Option<String>, name: &str, meaning: &str) -> Result<usize> {
    optional(var, name)?.ok_or_else(|| {
        Error::Config(format!(
            "{name} is not set; set it to {meaning} (or start the processes with `upipe launch`)"
        ))
    })
}

/// A variable that, when present, must hold a non-negative integer.
fn optional(var: &impl Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    let Some(value) = var(name) else {
        return Ok(None);
    };
    value.trim().parse().map(Some).map_err(|_| {
        Error::Config(format!(
            "{name}='{value}' is not a non-negative integer; fix or unset {name}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<DistEnv>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(|name| map.get(name).cloned())
    }

    fn config_message(vars: &[(&str, &str)]) -> String {
        match parse(vars) {
            Err(Error::Config(msg)) => msg,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn not_distributed_without_rank_variables() {
        assert_eq!(parse(&[]).unwrap(), None);
        assert_eq!(parse(&[("MASTER_ADDR", "10.0.0.1")]).unwrap(), None);
        assert_eq!(parse(&[("RANK", "")]).unwrap(), None);
    }

    #[test]
    fn torchrun_full() {
        let env = parse(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            env,
            DistEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                master_addr: "node0".into(),
                master_port: 1234,
            }
        );
        assert!(!env.is_master());
    }

    #[test]
    fn torchrun_single_node_defaults() {
        let env = parse(&[("RANK", "2"), ("WORLD_SIZE", "4")])
            .unwrap()
            .unwrap();
        assert_eq!(env.local_rank, 2);
        assert_eq!(env.local_world_size, 4);
        assert_eq!(env.master_addr, DEFAULT_MASTER_ADDR);
        assert_eq!(env.master_port, DEFAULT_MASTER_PORT);
    }

    #[test]
    fn torchrun_wins_over_slurm() {
        let env = parse(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((env.rank, env.world_size), (1, 2));
    }

    #[test]
    fn torchrun_errors_name_the_variable() {
        let msg = config_message(&[("RANK", "4"), ("WORLD_SIZE", "4")]);
        assert!(
            msg.contains("RANK=4") && msg.contains("WORLD_SIZE=4"),
            "{msg}"
        );
        let msg = config_message(&[("RANK", "one"), ("WORLD_SIZE", "4")]);
        assert!(msg.contains("RANK='one'"), "{msg}");
        let msg = config_message(&[("RANK", "0")]);
        assert!(msg.contains("WORLD_SIZE is not set"), "{msg}");
        let msg = config_message(&[("WORLD_SIZE", "2")]);
        assert!(msg.contains("RANK is not set"), "{msg}");
        let msg = config_message(&[("RANK", "0"), ("WORLD_SIZE", "0")]);
        assert!(msg.contains("WORLD_SIZE=0"), "{msg}");
        let msg = config_message(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
        ]);
        assert!(msg.contains("LOCAL_RANK=2"), "{msg}");
        let msg = config_message(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")]);
        assert!(msg.contains("MASTER_PORT='99999'"), "{msg}");
        let msg = config_message(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")]);
        assert!(msg.contains("MASTER_PORT"), "{msg}");
    }

    #[test]
    fn multi_node_needs_master_addr() {
        let msg = config_message(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "4"),
        ]);
        assert!(msg.contains("MASTER_ADDR is not set"), "{msg}");
    }

    #[test]
    fn slurm_with_nodelist() {
        let env = parse(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_JOB_NODELIST", "gpu[007-008]"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            env,
            DistEnv {
                rank: 6,
                world_size: 8,
                local_rank: 2,
                local_world_size: 4,
                master_addr: "gpu007".into(),
                master_port: DEFAULT_MASTER_PORT,
            }
        );
    }

    #[test]
    fn slurm_tasks_per_node_and_overrides() {
        let env = parse(&[
            ("SLURM_PROCID", "8"),
            ("SLURM_NTASKS", "9"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2),1"),
            ("SLURM_JOB_NODELIST", "a1,b2"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "40000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.local_world_size, 1);
        assert_eq!(env.master_addr, "10.1.2.3");
        assert_eq!(env.master_port, 40000);
    }

    #[test]
    fn slurm_launch_node_ip_fallback() {
        let env = parse(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_LAUNCH_NODE_IPADDR", "192.168.0.9"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.local_world_size, 2);
        assert_eq!(env.master_addr, "192.168.0.9");
    }

    #[test]
    fn slurm_errors_name_the_variable() {
        let msg = config_message(&[
            ("SLURM_PROCID", "4"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
        ]);
        assert!(
            msg.contains("SLURM_PROCID=4") && msg.contains("SLURM_NTASKS=4"),
            "{msg}"
        );
        let msg = config_message(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "x")]);
        assert!(msg.contains("SLURM_NTASKS='x'"), "{msg}");
        let msg = config_message(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]);
        assert!(msg.contains("SLURM_LOCALID is not set"), "{msg}");
        let msg = config_message(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_TASKS_PER_NODE", "2(x"),
        ]);
        assert!(msg.contains("SLURM_TASKS_PER_NODE"), "{msg}");
    }

    #[test]
    fn host_lists() {
        assert_eq!(first_host("node1").unwrap(), "node1");
        assert_eq!(first_host("gpu[003-010,12],login1").unwrap(), "gpu003");
        assert_eq!(first_host("rack[1-2]-n[07-08]").unwrap(), "rack1-n07");
        assert_eq!(first_host("a,b[1-2]").unwrap(), "a");
        assert!(first_host("gpu[003").is_err());
        assert!(first_host("[]").is_err());
        assert!(first_host("").is_err());
    }

    #[test]
    fn tasks_per_node_expansion() {
        assert_eq!(expand_tasks_per_node("4").unwrap(), vec![4]);
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), vec![2, 2, 2, 1]);
        assert!(expand_tasks_per_node("2(x3").is_err());
        assert!(expand_tasks_per_node("a").is_err());
    }
}

//! Where the ranks of a training run go (see the module docs of
//! `cli::train`): threads on the CPU, threads on GPUs, one NCCL process per
//! GPU, or a self-launch of one process per GPU; and the memory each rank has.

use crate::backend::cuda::cudnn::AttnKernel;
use crate::comm::MeshShape;
use crate::comm::env::DistEnv;
use crate::data::Mixture;
use crate::error::Result;
use crate::train::trainer::{
    StepReport, TrainConfig, TrainSummary, check_local_rank, check_world_size,
};

use super::args::Device;

/// Device memory per rank: a GPU's memory, shared by the thread ranks on it.
pub fn gpu_memory_per_rank(world: usize, gpus: usize) -> Option<usize> {
    let mem = crate::backend::cuda::device::gpus()
        .ok()?
        .first()?
        .total_mem;
    Some(mem / world.div_ceil(gpus.max(1)))
}

/// `MemAvailable` of `/proc/meminfo` (Linux), in bytes.
pub fn host_available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Where this process sits when a launcher started it with more than one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launched {
    pub world_size: usize,
    pub local_rank: usize,
}

impl Launched {
    /// A launch of more than one process (a world of one trains like an
    /// unlaunched process, e.g. `upipe train` inside a one-task `srun`).
    pub fn from_env(env: Option<&DistEnv>) -> Option<Launched> {
        env.filter(|e| e.world_size > 1).map(|e| Launched {
            world_size: e.world_size,
            local_rank: e.local_rank,
        })
    }
}

/// How a run executes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Ranks as threads on the CPU.
    CpuThreads,
    /// Ranks as threads spread round-robin over `gpus` GPUs, exchanging
    /// through host memory; `why` says why not one process per GPU.
    GpuThreads { gpus: usize, why: String },
    /// This process is one NCCL rank of a launched run.
    ProcessRank,
    /// Start `nproc` processes of this command, one per GPU.
    SelfLaunch { nproc: usize },
}

/// Decides where a run of mesh `shape` goes (see the module docs), given the
/// launch (if any), the visible GPUs and whether NCCL loads (asked only
/// before a self-launch). Errors name the fix.
pub fn route(
    device: Device,
    launched: Option<Launched>,
    gpus: usize,
    shape: MeshShape,
    nccl: &dyn Fn() -> std::result::Result<(), String>,
) -> Result<Route> {
    route_for("train", device, launched, gpus, shape, nccl)
}

/// [`route`] for the subcommand `command` (`train`, `eval`), named in its errors.
pub fn route_for(
    command: &str,
    device: Device,
    launched: Option<Launched>,
    gpus: usize,
    shape: MeshShape,
    nccl: &dyn Fn() -> std::result::Result<(), String>,
) -> Result<Route> {
    if device == Device::Cuda && gpus == 0 {
        return crate::config_err!(
            "--device cuda: no GPU is visible (see `upipe info`); use --device cpu"
        );
    }
    if let Some(l) = launched {
        let how = format!(
            "this process was launched as one of {} ranks (RANK/WORLD_SIZE or SLURM_PROCID set), \
             and a multi-process `upipe {command}` runs one NCCL rank per GPU",
            l.world_size
        );
        if device == Device::Cpu {
            return crate::config_err!(
                "--device cpu: {how}; on the CPU the ranks are threads of one process: \
                 run `upipe {command} --device cpu` without upipe launch/torchrun/srun"
            );
        }
        if gpus == 0 {
            return crate::config_err!(
                "no GPU is visible (see `upipe info`), but {how}; run `upipe {command}` without \
                 upipe launch/torchrun/srun to run with CPU thread ranks"
            );
        }
        check_world_size(command, shape, l.world_size)?;
        check_local_rank(l.local_rank, gpus)?;
        return Ok(Route::ProcessRank);
    }
    let w = shape.world_size();
    if device == Device::Cpu || gpus == 0 {
        super::mesh::check_thread_ranks(command, w)?;
        return Ok(Route::CpuThreads);
    }
    let threads = |why: String| {
        super::mesh::check_thread_ranks(command, w)?;
        Ok(Route::GpuThreads { gpus, why })
    };
    if w == 1 {
        return threads("the mesh has one rank".into());
    }
    if gpus == 1 {
        return threads(format!(
            "one GPU is visible: the {w} thread ranks share it and exchange through host memory"
        ));
    }
    if w > gpus {
        return threads(format!(
            "the mesh has {w} ranks but {gpus} GPUs are visible: thread ranks share the GPUs \
             and exchange through host memory; a mesh of at most {gpus} ranks (or no mesh flag) \
             runs one NCCL process per GPU"
        ));
    }
    if let Err(e) = nccl() {
        return threads(format!(
            "NCCL is not available ({e}): thread ranks exchange through host memory"
        ));
    }
    Ok(Route::SelfLaunch { nproc: w })
}

/// Thread ranks spread round-robin over `gpus` devices.
pub(super) fn train_on_gpus(
    cfg: &TrainConfig,
    data: Mixture,
    gpus: usize,
    kernel: AttnKernel,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainSummary> {
    use crate::backend::cuda::CudaBackend;
    use std::sync::atomic::{AtomicUsize, Ordering};
    // open every device once here, so a failure is an error rather than a
    // failure inside a rank thread
    for g in 0..gpus {
        CudaBackend::new(g)?;
    }
    let next = AtomicUsize::new(0);
    let make = || {
        let g = next.fetch_add(1, Ordering::Relaxed) % gpus;
        let mut b = CudaBackend::new(g).expect("the device opened a moment ago");
        b.set_attn_kernel(kernel);
        if let Some(k) = cfg.attention_kernel {
            b.set_attention_kernel(k);
        }
        b.set_attention_fp8(cfg.precision.fp8_attention());
        b.set_host_budget(cfg.host_budget);
        b
    };
    crate::train::trainer::train_threads(cfg, data, make, on_step)
}

/// GPUs visible to the driver (none when CUDA is unavailable).
pub fn visible_gpus() -> usize {
    crate::backend::cuda::device::gpus().map_or(0, |g| g.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn shape(data: usize, ring: usize, ulysses: usize) -> MeshShape {
        MeshShape::new(data, ring, ulysses).unwrap()
    }

    fn no_nccl() -> std::result::Result<(), String> {
        Err("libnccl.so.2 not found".into())
    }

    fn nccl_ok() -> std::result::Result<(), String> {
        Ok(())
    }

    fn config_error(r: Result<Route>) -> String {
        match r {
            Err(Error::Config(m)) => m,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn routes() {
        let w2 = shape(1, 1, 2);
        let w4 = shape(1, 2, 2);
        let auto = |gpus, s| route(Device::Auto, None, gpus, s, &nccl_ok).unwrap();
        assert_eq!(auto(0, w4), Route::CpuThreads);
        assert_eq!(auto(2, w2), Route::SelfLaunch { nproc: 2 });
        assert_eq!(auto(8, w4), Route::SelfLaunch { nproc: 4 });
        assert_eq!(
            route(Device::Cuda, None, 2, w2, &nccl_ok).unwrap(),
            Route::SelfLaunch { nproc: 2 }
        );
        // --device cpu never launches
        assert_eq!(
            route(Device::Cpu, None, 0, w2, &nccl_ok).unwrap(),
            Route::CpuThreads
        );
        let why = |r: Route| match r {
            Route::GpuThreads { why, .. } => why,
            other => panic!("expected thread ranks on GPUs, got {other:?}"),
        };
        let w = why(auto(2, w4));
        assert!(w.contains("4 ranks but 2 GPUs"), "{w}");
        assert!(why(auto(1, w2)).contains("one GPU"));
        assert!(why(auto(2, shape(1, 1, 1))).contains("one rank"));
        let w = why(route(Device::Auto, None, 2, w2, &no_nccl).unwrap());
        assert!(w.contains("libnccl.so.2 not found"), "{w}");
        let e = config_error(route(Device::Cuda, None, 0, w2, &nccl_ok));
        assert!(e.contains("--device cpu"), "{e}");
    }

    #[test]
    fn thread_meshes_beyond_the_cap_are_refused_with_the_fix() {
        let cap = super::super::mesh::MAX_THREAD_RANKS;
        let at_cap = shape(cap / 4, 2, 2);
        let over = shape(cap / 2, 2, 2);
        assert_eq!(
            route(Device::Cpu, None, 0, at_cap, &nccl_ok).unwrap(),
            Route::CpuThreads
        );
        let e = config_error(route(Device::Cpu, None, 0, over, &nccl_ok));
        assert!(
            e.contains(&format!("mesh of {} ranks", 2 * cap))
                && e.contains(&format!("at most {cap}"))
                && e.contains("upipe launch --nproc-per-node"),
            "{e}"
        );
        // thread ranks sharing GPUs too (more ranks than GPUs), and for eval
        let e = config_error(route_for("eval", Device::Auto, None, 2, over, &nccl_ok));
        assert!(e.contains("-- eval --device cuda"), "{e}");
    }

    #[test]
    fn launched_ranks_and_their_errors() {
        let l = |world_size, local_rank| {
            Some(Launched {
                world_size,
                local_rank,
            })
        };
        let w2 = shape(1, 1, 2);
        let never = || -> std::result::Result<(), String> {
            panic!("NCCL is not asked about under a launch")
        };
        assert_eq!(
            route(Device::Auto, l(2, 1), 2, w2, &never).unwrap(),
            Route::ProcessRank
        );
        let e = config_error(route(Device::Auto, l(2, 0), 2, shape(1, 2, 2), &never));
        assert!(
            e.contains("needs 4 processes, but 2 were launched")
                && e.contains("--nproc-per-node 4"),
            "{e}"
        );
        let e = config_error(route(Device::Auto, l(4, 3), 2, shape(1, 2, 2), &never));
        assert!(
            e.contains("LOCAL_RANK is 3") && e.contains("--nproc-per-node 2"),
            "{e}"
        );
        let e = config_error(route(Device::Cpu, l(2, 0), 0, w2, &never));
        assert!(
            e.contains("--device cpu") && e.contains("without upipe launch"),
            "{e}"
        );
        let e = config_error(route(Device::Auto, l(2, 0), 0, w2, &never));
        assert!(e.contains("no GPU is visible"), "{e}");
        // a world of one is no launch (one-task srun on a CPU node)
        let env = DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        };
        assert_eq!(Launched::from_env(Some(&env)), None);
        let env2 = DistEnv {
            world_size: 2,
            rank: 1,
            local_rank: 1,
            ..env
        };
        assert_eq!(Launched::from_env(Some(&env2)), l(2, 1));
    }
}

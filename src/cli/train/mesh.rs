//! The mesh of a training run (resolved in [`crate::plan::mesh`]) and the
//! most ranks a run puts on threads of one process.

pub use crate::plan::mesh::{CPU_DEFAULT_MESH, MeshChoice, MeshFlags, default_mesh, resolve_mesh};

/// Most ranks a run puts on threads of one process (`--device cpu`, or
/// thread ranks sharing GPUs). Their exchanges go through host mailboxes
/// (`comm/local.rs`) that the memory planner does not walk, and an
/// all-reduce leaves a copy of the buffer from every member at every member
/// (ranks² copies). Measured (maximum RSS, `/usr/bin/time -v`) of `upipe
/// train --device cpu --steps 1` on the tiny model, whose planner predicts
/// 2.16 MiB per rank: 16 ranks 87 MB, 32 207 MB, 64 590 MB, 128 2.7 GB,
/// 256 10.6 GB, 512 aborted ("memory allocation failed"). At 64 the process
/// stays under 1 GB; larger meshes are for one process per GPU.
pub const MAX_THREAD_RANKS: usize = 64;

/// Checks that a mesh of `ranks` thread ranks is within [`MAX_THREAD_RANKS`];
/// the error names the fix (`command`: the subcommand, e.g. `train`).
pub fn check_thread_ranks(command: &str, ranks: usize) -> crate::error::Result<()> {
    if ranks <= MAX_THREAD_RANKS {
        return Ok(());
    }
    crate::config_err!(
        "a mesh of {ranks} ranks would run as threads of one process, which takes at most \
         {MAX_THREAD_RANKS}: their exchanges grow with ranks² in host memory outside the memory \
         plan; give a mesh (--data-parallel x --ulysses x --ring) of at most {MAX_THREAD_RANKS} \
         ranks, or run one process per GPU (`upipe launch --nproc-per-node N -- {command} \
         --device cuda`)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::Strategy;
    use crate::cli::launch::rank_command;
    use crate::model::ModelConfig;

    fn tiny() -> ModelConfig {
        ModelConfig::resolve("tiny").unwrap()
    }

    #[test]
    fn self_launched_children_resolve_the_parents_mesh() {
        let argv: Vec<String> = ["train", "--steps", "3"].map(String::from).to_vec();
        assert_eq!(rank_command(&argv, "train").unwrap(), argv);
        let e = rank_command(&["eval".to_string()], "train").unwrap_err();
        assert!(e.to_string().contains("upipe launch"), "{e}");
        let m = tiny();
        for s in [Strategy::Upipe, Strategy::Ulysses, Strategy::Local] {
            for flags in [
                MeshFlags::default(),
                MeshFlags {
                    ring: Some(1),
                    ..MeshFlags::default()
                },
            ] {
                for gpus in 2..=8 {
                    let parent = resolve_mesh(flags, s, &m, 256, None, Some(gpus));
                    let w = parent.world_size();
                    if w > 1 && w <= gpus {
                        let child = resolve_mesh(flags, s, &m, 256, None, Some(w));
                        assert_eq!(child, parent, "{s} {flags:?} on {gpus} GPUs");
                    }
                }
            }
        }
    }
}

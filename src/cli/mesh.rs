//! The mesh flags of every subcommand that runs or plans ranks (`train`,
//! `plan`, `eval`, `bench attn`): one flag group, run-file section
//! `[parallel]`, resolved below the CLI (`plan::mesh`, `plan::resolve`).

use crate::cli::config::{at_least, run_keys};
use crate::error::Result;
use crate::plan::mesh::MeshFlags;
use crate::plan::stage_width::ChunkHeads;

/// The mesh (data replicas × Ulysses × ring) and UPipe's stage width.
/// With no mesh flag, `train`, `eval` and `plan` fit the mesh to the ranks
/// there are (`plan --gpus N`: N; the launched processes or the visible
/// GPUs; else 2 Ulysses × 2 ring on the CPU, one rank for `eval`) by the
/// strategy's own rule (`attention::mesh_rule`). Once one is given,
/// `train`, `eval` and `plan` alike fit the others around it to those
/// ranks (`plan::mesh::resolve_mesh`);
/// where no mesh of that many ranks has the degrees given, or on the CPU,
/// the others are 1. `bench attn` runs Pu 4 × Pr 1 by default.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct MeshArgs {
    /// Data-parallel replicas, each its own context-parallel group. Left
    /// out: with no mesh flag the mesh fits the ranks (GPUs, launched
    /// processes; the CPU: 1); with another mesh flag, fitted
    /// around it to those ranks, else 1. Not on `bench attn`.
    #[arg(long, help_heading = "Mesh")]
    pub data_parallel: Option<usize>,
    /// Ulysses degree Pu. Left out: with no mesh flag the mesh fits the
    /// ranks (the CPU: 2); with another mesh flag, fitted around it to the
    /// ranks, else 1; `bench attn`: 4.
    #[arg(long, help_heading = "Mesh")]
    pub ulysses: Option<usize>,
    /// Ring degree Pr. Left out: with no mesh flag the mesh fits the ranks
    /// (the CPU: 2); with another mesh flag, fitted around it to the ranks,
    /// else 1; `bench attn`: 1.
    #[arg(long, help_heading = "Mesh")]
    pub ring: Option<usize>,
    /// UPipe heads per backward stage U. On `train` and `plan`, `auto` (the
    /// default): the widest stages whose predicted peak fits each rank's
    /// memory beside what the run decided before (offloaded blocks, kept
    /// attention), at least Pu; wider stages run larger GEMMs, narrower
    /// ones hold less of the layer. On `eval` and `bench attn` a number
    /// (default: Pu).
    #[arg(long, help_heading = "Mesh")]
    pub chunk_heads: Option<ChunkHeads>,
}

impl MeshArgs {
    run_keys! {
        data_parallel => parallel.data_parallel,
        ulysses => parallel.ulysses,
        ring => parallel.ring,
        chunk_heads => parallel.chunk_heads,
    }

    /// Each degree and a numeric `--chunk-heads` given is at least 1; the
    /// error names the flag and its key.
    pub fn validate(&self) -> Result<()> {
        for (id, v) in [
            ("ulysses", self.ulysses),
            ("ring", self.ring),
            ("data_parallel", self.data_parallel),
            ("chunk_heads", ChunkHeads::start(self.chunk_heads)),
        ] {
            if let Some(v) = v {
                at_least(Self::KEYS, id, v, 1)?;
            }
        }
        Ok(())
    }

    /// The degrees as given.
    pub fn flags(&self) -> MeshFlags {
        MeshFlags {
            data: self.data_parallel,
            ulysses: self.ulysses,
            ring: self.ring,
        }
    }

    /// Whether any degree was given (otherwise the mesh fits the ranks).
    pub fn any_given(&self) -> bool {
        self.data_parallel.is_some() || self.ulysses.is_some() || self.ring.is_some()
    }
}

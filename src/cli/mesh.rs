//! The mesh flags of every subcommand that runs or plans ranks (`train`,
//! `plan`, `eval`, `bench attn`): one flag group, run-file section
//! `[parallel]`, resolved below the CLI (`plan::mesh`, `plan::resolve`).

use crate::cli::config::{at_least, run_keys};
use crate::error::Result;
use crate::plan::mesh::MeshFlags;
use crate::plan::stage_width::ChunkHeads;

/// The mesh (data replicas × Ulysses × ring) and UPipe's stage width.
/// A degree left out takes the subcommand's default: with no mesh flag at
/// all, `train`, `eval` and `plan` fit the mesh to the ranks there are (the
/// launched processes or the visible GPUs, else 2 Ulysses × 2 ring on the
/// CPU; `plan --gpus N`: N ranks); once one is given, `train` takes the rest
/// at 1 replica × Pu 2 × Pr 2, `eval` at 1, `plan` gives the context group
/// the GPUs the replicas leave, and `bench attn` runs Pu 4 × Pr 1.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct MeshArgs {
    /// Data-parallel replicas, each its own context-parallel group
    /// (default: `train` and `eval` 1, `plan` what the GPUs leave beside the
    /// context group; with no mesh flag the mesh fits the ranks). Not on
    /// `bench attn`, which runs one group.
    #[arg(long)]
    pub data_parallel: Option<usize>,
    /// Ulysses degree Pu (default: `train` 2, `eval` 1, `plan` all the GPUs
    /// the replicas leave, usp up to 8, `bench attn` 4; with no mesh flag on
    /// `train`, `eval` and `plan` the mesh fits the ranks).
    #[arg(long)]
    pub ulysses: Option<usize>,
    /// Ring degree Pr (default: `train` 2, `eval` 1, `plan` 1 or for ring
    /// all GPUs, `bench attn` 1; with no mesh flag on `train`, `eval` and
    /// `plan` the mesh fits the ranks).
    #[arg(long)]
    pub ring: Option<usize>,
    /// UPipe heads per backward stage U. On `train` and `plan`, `auto` (the
    /// default): the widest stages whose predicted peak fits each rank's
    /// memory beside what the run decided before (offloaded blocks, kept
    /// attention), at least Pu; wider stages run larger GEMMs, narrower
    /// ones hold less of the layer. On `eval` and `bench attn` a number
    /// (default: Pu).
    #[arg(long)]
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

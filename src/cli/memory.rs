//! The memory-policy flags shared by `train` and `plan` (run-file sections
//! `[memory]` and `[segments]`), and the [`MemoryChoices`] they make.

use crate::cli::config::{at_least, run_keys};
use crate::error::Result;
use crate::model::MemoryPolicy;
use crate::plan::{
    CheckpointEvery, HostUpdateChoice, MemoryChoices, OffloadBlocks, OptimizerOffload,
    SaveAttention,
};

/// What a step keeps, recomputes and moves to the host.
#[derive(clap::Args, Debug, Clone)]
pub struct MemoryArgs {
    /// Full activation checkpointing per block (`--checkpoint=false` turns
    /// off what a run file turned on; so for every on/off flag).
    #[arg(long, help_heading = "Memory", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub checkpoint: bool,
    /// With --checkpoint: blocks (the first ones) whose checkpointed input
    /// is held in host memory: all (the flag alone), N, auto (the fewest
    /// that make this --seq fit the GPU, or the most the host holds; `plan`
    /// resolves it at each length it predicts), none.
    #[arg(long, help_heading = "Memory", num_args = 0..=1, default_missing_value = "all",
          default_value_t = OffloadBlocks::Blocks(0))]
    pub offload: OffloadBlocks,
    /// Units (the embedding, each block, the head) whose master weights
    /// and AdamW moments (as --optim-state and --master-weights keep them)
    /// live in pinned host memory, updated on the host's threads while the
    /// next forward runs: all (the flag alone), N
    /// (the last N blocks first, then the embedding and the head), auto (the
    /// fewest that make this --seq fit the GPU beside everything else the
    /// run decides; `plan` resolves it at each length), none. The others
    /// keep theirs on the GPU and update there.
    #[arg(long, help_heading = "Memory", num_args = 0..=1, default_missing_value = "all",
          default_value_t = OptimizerOffload::Units(0))]
    pub offload_optimizer: OptimizerOffload,
    /// Where the optimizer state --offload-optimizer puts on the host is
    /// updated: gpu (each unit's state copied to the GPU ahead of its
    /// update, updated by the kernel that updates state kept there, and
    /// copied back: the numbers of state on the GPU, for two units' state
    /// of GPU memory), cpu (the host's threads, in place), auto (on GPUs,
    /// gpu for BF16 or 8-bit moments and cpu for F32 ones; cpu on the CPU).
    #[arg(long, help_heading = "Memory", default_value_t = HostUpdateChoice::Auto)]
    pub host_update: HostUpdateChoice,
    /// Tiled MLP/RMSNorm (token tiles of a quarter of the rows, hidden to 4·hidden).
    #[arg(long, help_heading = "Memory", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub tiled_mlp: bool,
    /// Rows of logits per fused-loss chunk (one `[rows, vocab]` buffer:
    /// fewer rows save memory, more keep the head's GEMMs efficient).
    #[arg(long, help_heading = "Memory", default_value_t = crate::model::DEFAULT_LOSS_CHUNK)]
    pub loss_chunk: usize,
    /// With --checkpoint: blocks (the last ones) that keep their attention
    /// output and LSEs, so their backward skips the attention recompute:
    /// none, all, N, or auto (as many as fit this GPU's memory, or this
    /// host's per rank, beside the rest of the planned step; `plan` fits
    /// them in --gpu-mem minus --reserve at that length, and its search
    /// finds the longest length with none and shows what auto keeps there).
    #[arg(long, help_heading = "Memory", default_value_t = SaveAttention::Auto)]
    pub save_attention: SaveAttention,
    /// With --checkpoint: segment checkpointing, one checkpointed block
    /// input kept every K blocks (each segment's first; the last segment
    /// keeps all of its own); each earlier segment's backward first runs
    /// its forward again to rebuild the others, one more forward of most
    /// blocks for about L/K + K kept inputs instead of L. K, or auto (the
    /// fewest recomputed blocks whose step fits this GPU and host beside
    /// --offload; `plan` resolves it at each length, and its search for
    /// the longest context too). Left out: 1, every block keeps its input.
    #[arg(long, help_heading = "Memory")]
    pub checkpoint_every: Option<CheckpointEvery>,
    /// Parameters not trained (no gradient, no optimizer state, no weight
    /// gradient computed): a comma list of embeddings, head, norms, attn,
    /// mlp, blocks:A-B (inclusive), or none. With tied embeddings, head and
    /// embeddings are one matrix. Under --fsdp on, whole units only.
    #[arg(long, help_heading = "Model", default_value = "none")]
    pub freeze: String,
}

impl MemoryArgs {
    run_keys! {
        checkpoint => memory.checkpoint,
        offload => memory.offload,
        offload_optimizer => memory.offload_optimizer,
        host_update => memory.host_update,
        tiled_mlp => memory.tiled_mlp,
        loss_chunk => memory.loss_chunk,
        save_attention => memory.save_attention,
        checkpoint_every => segments.checkpoint_every,
        freeze => model.freeze,
    }

    /// The flags' ranges, errors naming the flag and its key.
    pub fn validate(&self) -> Result<()> {
        at_least(Self::KEYS, "loss_chunk", self.loss_chunk, 1)
    }

    /// `--freeze`, checked against `model`; errors name the flag and its key.
    pub fn freeze(&self, model: &crate::model::ModelConfig) -> Result<crate::model::Freeze> {
        let frozen =
            crate::model::Freeze::parse(&self.freeze).and_then(|f| f.check(model).map(|()| f));
        crate::cli::config::for_key(Self::KEYS, "freeze", frozen)
    }

    /// The choices these flags make, their `auto`s undecided.
    pub fn choices(&self) -> MemoryChoices {
        MemoryChoices {
            checkpoint: self.checkpoint,
            offload: self.offload,
            offload_optimizer: self.offload_optimizer,
            host_update: self.host_update,
            tiled_mlp: self.tiled_mlp,
            loss_chunk: self.loss_chunk,
            save_attention: self.save_attention,
            checkpoint_every: self.checkpoint_every.unwrap_or_default(),
        }
    }

    /// The policy of a model of `layers` blocks ([`MemoryChoices::policy`]).
    pub fn policy(&self, layers: usize, auto_blocks: usize) -> MemoryPolicy {
        self.choices().policy(layers, auto_blocks)
    }
}

#[cfg(test)]
mod tests {
    use crate::cli::config::{Given, RunArgs, parse};
    use crate::cli::plan::PlanArgs;
    use crate::cli::train::TrainArgs;
    use clap::{Args, Command, FromArgMatches};

    /// `A` parsed from `argv` (after the subcommand), with its matches.
    fn args<A: Args + FromArgMatches>(argv: &[&str]) -> (A, clap::ArgMatches) {
        let cmd = A::augment_args(Command::new("x").no_binary_name(true));
        let m = cmd.try_get_matches_from(argv).unwrap();
        (A::from_arg_matches(&m).unwrap(), m)
    }

    const FLAGS: &[&str] = &[
        "--checkpoint",
        "--offload=2",
        "--offload-optimizer",
        "--tiled-mlp",
        "--loss-chunk",
        "64",
        "--save-attention",
        "1",
    ];

    #[test]
    fn train_and_plan_write_and_read_the_same_memory_keys() {
        let (t, _) = args::<TrainArgs>(FLAGS);
        let (p, _) = args::<PlanArgs>(FLAGS);
        let (tm, mut pm) = (t.to_file().memory, p.to_file().memory);
        assert_eq!(pm.policies.take().as_deref(), Some("none"));
        assert_eq!(tm, pm);
        assert_eq!(t.memory.policy(4, 0), p.memory.policy(4, 0));
        // the section `train` writes is what `plan` reads
        let file = parse(&crate::cli::config::resolved_toml(&t).unwrap()).unwrap();
        let (mut q, m) = args::<PlanArgs>(&[]);
        q.take_file(&file, &Given(&m));
        assert_eq!(q.to_file().memory, p.to_file().memory);
    }

    #[test]
    fn offload_all_is_every_block_and_auto_waits_for_a_budget() {
        let (t, _) = args::<TrainArgs>(&["--checkpoint", "--offload"]);
        assert_eq!(t.memory.policy(6, 0).offload, 6);
        let (t, _) = args::<TrainArgs>(&["--checkpoint", "--offload=auto"]);
        assert_eq!(t.memory.policy(6, 0).offload, 0);
        assert_eq!(t.memory.policy(6, 6).offload, 6);
    }
}

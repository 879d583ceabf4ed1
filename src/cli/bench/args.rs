//! The flags of `upipe bench attn` ([`AttnArgs`]) and what they give: the
//! layer's dimensions and the strategies to run.

use crate::attention::rope::RopeConfig;
use crate::attention::{AttnDims, Strategy};
use crate::cli::config::{Given, RunArgs, RunFile, run_keys};
use crate::cli::mesh::MeshArgs;
use crate::cli::schedule::ScheduleArgs;
use crate::error::{Error, Result};
use crate::plan::resolve::Strategies;
use std::path::{Path, PathBuf};

/// Flags of `upipe bench attn`.
#[derive(clap::Args, Debug, Clone)]
pub struct AttnArgs {
    /// A run file (TOML): the keys of `[bench]`, `[parallel]`, `[data] seq`
    /// and `[run]` this command has flags for; flags given here win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Device to run on (cpu: ranks as threads, f32; cuda: one process per
    /// GPU, bf16, NCCL: started by itself when the mesh fits the visible
    /// GPUs, or under `upipe launch`, torchrun or srun).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 8)]
    pub head_dim: usize,
    /// Global sequence length (tokens).
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// Per-head RMSNorm of q and k (Qwen3).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub qk_norm: bool,
    /// Attention kernel on CUDA: auto (cuDNN SDPA where it supports the call,
    /// else our flash kernels), cudnn (error where it cannot), native (ours).
    #[arg(long, default_value = "auto")]
    pub attn_kernel: String,
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Comma-separated strategies, or `all`.
    #[arg(long, default_value = "all")]
    pub methods: String,
    /// Fail (exit 1) if any strategy differs from `local` by more than the tolerance.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub check: bool,
    /// Print one JSON object per strategy instead of a table.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub json: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Untimed passes before the timed ones (cuda).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed forward+backward passes; the median is reported (cuda).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Rounds over the strategies (cuda): each round runs every strategy's
    /// warm-up and timed passes, in reverse order every other round (A B,
    /// B A, ...) so clocks that drift during a run favour no strategy; the
    /// median pools the timed passes of all rounds.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
}

impl AttnArgs {
    run_keys! {
        device => bench.device,
        hidden => bench.hidden,
        heads => bench.heads,
        kv_heads => bench.kv_heads,
        head_dim => bench.head_dim,
        qk_norm => bench.qk_norm,
        methods => bench.methods,
        check => bench.check,
        warmup => bench.warmup,
        iters => bench.iters,
        rounds => bench.rounds,
        seq => data.seq,
        attn_kernel => run.attn_kernel,
        json => run.json,
        seed => run.seed;
        flatten mesh, schedule
    }
}

impl AttnArgs {
    /// The Ulysses degree Pu (`--ulysses`, default 4).
    pub fn ulysses(&self) -> usize {
        self.mesh.ulysses.unwrap_or(4)
    }

    /// The ring degree Pr (`--ring`, default 1).
    pub fn ring(&self) -> usize {
        self.mesh.ring.unwrap_or(1)
    }

    /// The mesh flags this command takes: one context group, so no data
    /// replicas.
    pub(super) fn check_mesh(&self) -> Result<()> {
        match self.mesh.data_parallel {
            None | Some(1) => Ok(()),
            Some(d) => crate::config_err!(
                "--data-parallel {d}: `bench attn` runs one context group (--ulysses x --ring); \
                 leave --data-parallel out"
            ),
        }
    }
}

impl RunArgs for AttnArgs {
    fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }
    fn take_file(&mut self, file: &RunFile, given: &Given) {
        self.take_keys(file, given);
    }
    fn to_file(&self) -> RunFile {
        let mut f = RunFile::default();
        self.put_keys(&mut f);
        f
    }
}

/// The layer dimensions of the flags.
pub(super) fn attn_dims(a: &AttnArgs) -> AttnDims {
    AttnDims {
        hidden: a.hidden,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        qk_norm: a.qk_norm,
        norm: crate::backend::RmsNorm::plain(1e-6),
        rope: RopeConfig {
            theta: 500000.0,
            scaling: None,
        },
        softmax_scale: AttnDims::default_softmax_scale(a.head_dim),
        precision: crate::backend::fp8::Precision::Bf16,
    }
}

/// `(is_all, strategies)` of `--methods`; UPipe's stage flags given
/// without upipe among them are an error (they would do nothing).
pub(super) fn methods_of(a: &AttnArgs) -> Result<(bool, Vec<Strategy>)> {
    let (all, methods) = parse_methods(&a.methods)?;
    let fwd_given = a.schedule.fwd.fwd_chunk_heads != crate::cli::schedule::FwdChunk::Auto;
    let flag = match (a.mesh.chunk_heads.is_some(), fwd_given) {
        (true, _) => "--chunk-heads",
        (false, true) => "--fwd-chunk-heads",
        (false, false) => return Ok((all, methods)),
    };
    if !methods.contains(&Strategy::Upipe) {
        return crate::config_err!(
            "{flag} sets UPipe's stages, and --methods {} has no upipe: add upipe to \
             --methods, or leave {flag} out",
            a.methods
        );
    }
    Ok((all, methods))
}

/// `(is_all, strategies)` from the `--methods` flag.
fn parse_methods(s: &str) -> Result<(bool, Vec<Strategy>)> {
    match s.parse()? {
        Strategies::All => Ok((true, Strategy::ALL.to_vec())),
        Strategies::Listed(list) if list.is_empty() => Err(Error::Config(
            "--methods needs at least one strategy".into(),
        )),
        Strategies::Listed(list) => Ok((false, list)),
    }
}

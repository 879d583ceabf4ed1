//! Run files: `--config run.toml` for `train`, `eval`, `plan` and `bench`.
//!
//! One schema ([`RunFile`]) serves every subcommand: a flag `--name` of a
//! subcommand is the key `name` in one section, the same section for every
//! subcommand that has the flag, so `upipe plan --config` and `upipe eval
//! --config` read the file `upipe train --config` runs. A subcommand takes
//! the keys it has a flag for and leaves the others; a key no subcommand
//! knows, or a value of the wrong type, is an error naming the key. Flags
//! given on the command line win over the file (clap's
//! [`ArgMatches::value_source`] says which were given); a key absent from
//! the file keeps the flag's default. Paths are relative to the working
//! directory, as on the command line. `docs/getting-started.md` lists the
//! sections.

use crate::attention::Settle;
use crate::error::{Error, Result};
use crate::plan::stage_width::{ChunkHeads, FwdChunk};
use crate::plan::{
    CheckpointEvery, HostUpdateChoice, OffloadBlocks, OptimizerOffload, SaveAttention,
};
use clap::ArgMatches;
use clap::parser::ValueSource;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The keys of a run file, by section (every key optional).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunFile {
    pub model: ModelKeys,
    pub data: DataKeys,
    pub parallel: ParallelKeys,
    pub memory: MemoryKeys,
    pub segments: SegmentKeys,
    pub optim: OptimKeys,
    pub checkpoint: CheckpointKeys,
    pub run: RunKeys,
    pub hardware: HardwareKeys,
    pub plan: PlanKeys,
    pub eval: EvalKeys,
    pub bench: BenchKeys,
}

/// `[model]`: what is trained or planned.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct ModelKeys {
    pub model: Option<String>,
    pub init_from: Option<PathBuf>,
    pub allow_extra_tensors: Option<bool>,
    /// `--freeze` (a flag of the memory group, which `train` and `plan` share).
    pub freeze: Option<String>,
    /// The LoRA flags (`cli::lora`, shared by `train` and `plan`).
    pub lora_rank: Option<usize>,
    pub lora_alpha: Option<f64>,
    pub lora_targets: Option<String>,
    pub lora_rslora: Option<bool>,
    pub lora_from: Option<PathBuf>,
}

/// `[data]`: tokens and sequences.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct DataKeys {
    pub data: Option<PathBuf>,
    pub tokenizer: Option<String>,
    pub seq: Option<usize>,
    pub pack: Option<crate::data::PackMode>,
    pub grad_accum: Option<usize>,
}

/// `[parallel]`: attention strategy, mesh, stages and sharding.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct ParallelKeys {
    pub attn: Option<String>,
    pub data_parallel: Option<usize>,
    pub ulysses: Option<usize>,
    pub ring: Option<usize>,
    pub chunk_heads: Option<ChunkHeads>,
    pub fwd_chunk_heads: Option<FwdChunk>,
    pub overlap: Option<bool>,
    pub settle_every: Option<Settle>,
    pub fsdp: Option<String>,
    pub fsdp_replicate: Option<usize>,
}

/// `[memory]`: memory policies.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct MemoryKeys {
    pub checkpoint: Option<bool>,
    pub offload: Option<OffloadBlocks>,
    pub offload_optimizer: Option<OptimizerOffload>,
    pub host_update: Option<HostUpdateChoice>,
    pub tiled_mlp: Option<bool>,
    pub loss_chunk: Option<usize>,
    pub save_attention: Option<SaveAttention>,
    /// `upipe plan --policies` (added to the keys above).
    pub policies: Option<String>,
}

/// `[segments]`: segment checkpointing (a flag of the memory group, which
/// `train` and `plan` share), a section of its own so that the `[memory]`
/// of a run without it reads as it did before it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct SegmentKeys {
    pub checkpoint_every: Option<CheckpointEvery>,
}

/// `[optim]`: AdamW and its schedule.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct OptimKeys {
    pub lr: Option<f64>,
    pub min_lr: Option<f64>,
    pub warmup: Option<u32>,
    pub schedule: Option<String>,
    pub decay_fraction: Option<f64>,
    pub betas: Option<String>,
    pub eps: Option<f64>,
    pub weight_decay: Option<f64>,
    pub clip: Option<f64>,
    pub optim_state: Option<String>,
    pub master_weights: Option<String>,
    pub grad_dtype: Option<String>,
    pub skip_nonfinite: Option<u32>,
}

/// `[checkpoint]`: where training checkpoints go.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct CheckpointKeys {
    pub save_dir: Option<PathBuf>,
    pub merge_lora: Option<PathBuf>,
    pub save_every: Option<u32>,
    pub save_dtype: Option<String>,
    pub max_shard_size: Option<String>,
    pub resume: Option<bool>,
    pub overwrite: Option<bool>,
    pub keep_last: Option<u32>,
    pub keep_best: Option<bool>,
}

/// `[run]`: length, seed, device and output of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RunKeys {
    pub steps: Option<u32>,
    pub precision: Option<String>,
    pub epochs: Option<u32>,
    pub seed: Option<u64>,
    pub device: Option<String>,
    pub attn_kernel: Option<String>,
    pub json: Option<bool>,
    pub metrics: Option<PathBuf>,
    pub tensorboard: Option<PathBuf>,
    pub profile: Option<bool>,
    pub trace: Option<PathBuf>,
    pub rehearse: Option<bool>,
}

/// `[hardware]`: the machines `upipe plan` plans for.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct HardwareKeys {
    pub gpus: Option<usize>,
    pub gpu_mem: Option<f64>,
    pub reserve: Option<f64>,
    pub host_mem: Option<f64>,
    pub gpus_per_node: Option<usize>,
}

/// `[plan]`: the planner's own keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct PlanKeys {
    pub max_seq: Option<usize>,
    pub cudnn_version: Option<crate::plan::CudnnVersion>,
    pub svg: Option<PathBuf>,
}

/// `[eval]`: `upipe eval`'s own keys (its model directory defaults to
/// `[checkpoint] save-dir`, what the run wrote).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct EvalKeys {
    pub model_dir: Option<PathBuf>,
    pub tokens: Option<PathBuf>,
    /// Inputs per window (the run's `[data] seq` is its training length).
    pub seq: Option<usize>,
    pub buckets: Option<usize>,
    pub fwd_chunk_heads: Option<usize>,
    pub metrics: Option<PathBuf>,
    /// `upipe train`'s held-out evaluation during the run.
    pub eval_data: Option<PathBuf>,
    pub eval_every: Option<u32>,
    pub eval_buckets: Option<usize>,
    /// `upipe train`'s retrieval trials during the run (`--eval-task`).
    pub eval_task: Option<String>,
    pub eval_task_lengths: Option<String>,
    pub eval_task_depths: Option<usize>,
    pub eval_task_trials: Option<usize>,
    pub eval_task_chat_template: Option<String>,
    /// `upipe eval --task`'s retrieval trials.
    pub task: Option<String>,
    pub lengths: Option<String>,
    pub depths: Option<usize>,
    pub trials: Option<usize>,
    pub haystack: Option<PathBuf>,
    pub needles: Option<usize>,
    pub digits: Option<usize>,
    pub intro_template: Option<String>,
    pub needle_template: Option<String>,
    pub question_template: Option<String>,
    pub answer_template: Option<String>,
    pub chat_template: Option<String>,
    pub out: Option<PathBuf>,
    pub write_corpus: Option<PathBuf>,
    pub documents: Option<usize>,
}

/// `[bench]`: `upipe bench attn`'s own keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct BenchKeys {
    pub device: Option<String>,
    pub hidden: Option<usize>,
    pub heads: Option<usize>,
    pub kv_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub qk_norm: Option<bool>,
    pub methods: Option<String>,
    pub check: Option<bool>,
    pub warmup: Option<usize>,
    pub iters: Option<usize>,
    pub rounds: Option<usize>,
}

/// Which flags the command line gave (not defaults).
pub struct Given<'a>(pub &'a ArgMatches);

impl Given<'_> {
    /// Whether the flag with clap id `id` was on the command line.
    pub fn has(&self, id: &str) -> bool {
        self.0.value_source(id) == Some(ValueSource::CommandLine)
    }
}

/// A flag's value as a run-file key: the key holds `T`; the flag holds `T`
/// or, for flags without a default, `Option<T>`.
pub trait Key<T> {
    /// Takes the key's value, when the file sets it.
    fn take(&mut self, key: &Option<T>);
    /// The value to write under the key (`None`: left out).
    fn put(&self) -> Option<T>;
}

impl<T: Clone> Key<T> for T {
    fn take(&mut self, key: &Option<T>) {
        if let Some(v) = key {
            *self = v.clone();
        }
    }
    fn put(&self) -> Option<T> {
        Some(self.clone())
    }
}

impl<T: Clone> Key<T> for Option<T> {
    fn take(&mut self, key: &Option<T>) {
        if key.is_some() {
            self.clone_from(key);
        }
    }
    fn put(&self) -> Option<T> {
        self.clone()
    }
}

/// Maps a subcommand's flags onto run-file keys: `field => section.key`
/// for each flag (its clap id is the field's name), then optionally
/// `; flatten a, b` for the fields holding flattened flag groups with
/// their own keys. Defines `KEYS` (this struct's own flags), `take_keys`
/// (the file's keys for the flags not given) and `put_keys`, both through
/// the flattened groups too.
macro_rules! run_keys {
    ($($field:ident => $section:ident . $key:ident),* $(,)? $(; flatten $($group:ident),+ $(,)?)?) => {
        /// `(flag id, section, key)` of every flag with a run-file key.
        pub const KEYS: &'static [(&'static str, &'static str, &'static str)] =
            &[$((stringify!($field), stringify!($section), stringify!($key))),*];

        /// Takes the file's value of every key whose flag was not given.
        pub fn take_keys(
            &mut self,
            file: &$crate::cli::config::RunFile,
            given: &$crate::cli::config::Given,
        ) {
            $(
                if !given.has(stringify!($field)) {
                    $crate::cli::config::Key::take(&mut self.$field, &file.$section.$key);
                }
            )*
            $($( self.$group.take_keys(file, given); )+)?
        }

        /// Writes every flag's value under its key.
        pub fn put_keys(&self, file: &mut $crate::cli::config::RunFile) {
            $( file.$section.$key = $crate::cli::config::Key::put(&self.$field); )*
            $($( self.$group.put_keys(file); )+)?
        }
    };
}
pub(crate) use run_keys;

/// `[section] key` of flag `id` in `keys` (a `KEYS` table), as errors name it.
pub fn key_name(keys: &[(&str, &str, &str)], id: &str) -> String {
    match keys.iter().find(|(f, _, _)| *f == id) {
        Some((_, section, key)) => format!("[{section}] {}", key.replace('_', "-")),
        None => format!("--{}", id.replace('_', "-")),
    }
}

/// `r` with a configuration error's message naming the flag and key of `id`.
pub fn for_key<T>(keys: &[(&str, &str, &str)], id: &str, r: Result<T>) -> Result<T> {
    r.map_err(|e| match e {
        Error::Config(m) => Error::Config(format!("{m} (run-file key {})", key_name(keys, id))),
        other => other,
    })
}

/// Checks `value >= min` for flag `id`, naming the flag and the key.
pub fn at_least<T: PartialOrd + std::fmt::Display>(
    keys: &[(&str, &str, &str)],
    id: &str,
    value: T,
    min: T,
) -> Result<()> {
    if value >= min {
        return Ok(());
    }
    crate::config_err!(
        "--{} / {} is {value}: must be at least {min}",
        id.replace('_', "-"),
        key_name(keys, id)
    )
}

/// Reads and checks a run file: a syntax error, an unknown key or a value
/// of the wrong type is an error naming the file, the key and what it takes.
pub fn load(path: &Path) -> Result<RunFile> {
    crate::input_path::check_file(path, "--config")?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading --config {}", path.display()), e))?;
    parse(&text).map_err(|m| Error::Config(format!("--config {}: {m}", path.display())))
}

/// Parses run-file text (errors as [`load`] words them, without the file).
pub fn parse(text: &str) -> std::result::Result<RunFile, String> {
    let de = toml::Deserializer::parse(text).map_err(|e| toml_error(text, &e, None))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        toml_error(text, e.inner(), Some(path))
    })
}

/// A toml error as one line: the key (when known), the line, the message.
fn toml_error(text: &str, e: &toml::de::Error, path: Option<String>) -> String {
    let line = e
        .span()
        .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
    let msg = e.message().trim().replace('\n', " ");
    let msg = explain(&msg);
    let at = line.map(|l| format!(" (line {l})")).unwrap_or_default();
    match path.filter(|p| !p.is_empty() && p != ".") {
        Some(p) => format!("key `{p}`{at}: {msg}"),
        None => format!("{}{at}", msg),
    }
}

/// serde's messages in the words of a run file: which sections there are.
fn explain(msg: &str) -> String {
    if msg.starts_with("unknown field") && msg.contains("`bench`") {
        return msg.replacen("unknown field", "unknown section", 1);
    }
    msg.to_string()
}

/// Refuses a path flag whose path is not UTF-8: the run file (`run.toml`,
/// `--print-config`) is TOML, which holds UTF-8 text only.
pub fn utf8_path(flag: &str, path: &Path) -> Result<()> {
    match path.to_str() {
        Some(_) => Ok(()),
        None => crate::config_err!(
            "{flag} {} is not a UTF-8 path, and the run file that repeats this run \
             (run.toml, --print-config) is TOML, which holds UTF-8 text only; give {flag} \
             a path of UTF-8 characters",
            path.display()
        ),
    }
}

/// A run file as TOML, sections with no key left out.
pub fn to_toml(file: &RunFile) -> Result<String> {
    let mut table = toml::Table::try_from(file)
        .map_err(|e| Error::Config(format!("cannot write the run file: {e}")))?;
    table.retain(|_, v| v.as_table().is_none_or(|t| !t.is_empty()));
    toml::to_string(&table).map_err(|e| Error::Config(format!("cannot write the run file: {e}")))
}

/// A subcommand's flags read as a run file.
pub trait RunArgs: Sized {
    /// `--config`, when given.
    fn config_path(&self) -> Option<&Path>;
    /// Takes the file's keys for the flags not `given`.
    fn take_file(&mut self, file: &RunFile, given: &Given);
    /// The resolved flags as a run file.
    fn to_file(&self) -> RunFile;
    /// Fills what follows from other flags when neither the command line
    /// nor the run file (`None` without `--config`) gave it.
    fn infer(&mut self, _file: Option<&RunFile>, _given: &Given) {}
}

/// `args` (parsed from the command line `m`) with the keys of its
/// `--config` file taken for every flag the command line did not give.
pub fn resolve<A: RunArgs>(mut args: A, m: &ArgMatches) -> Result<A> {
    let file = match args.config_path() {
        Some(path) => Some(load(path)?),
        None => None,
    };
    if let Some(file) = &file {
        args.take_file(file, &Given(m));
    }
    args.infer(file.as_ref(), &Given(m));
    Ok(args)
}

/// The TOML of `args`' resolved flags.
pub fn resolved_toml<A: RunArgs>(args: &A) -> Result<String> {
    to_toml(&args.to_file())
}

/// Serde for a flag type written as its `Display` text: a number as a TOML
/// integer, anything else as a string; read back through `FromStr`.
macro_rules! serde_via_text {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                let text = self.to_string();
                match text.parse::<u64>() {
                    Ok(n) => s.serialize_u64(n),
                    Err(_) => s.serialize_str(&text),
                }
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                d.deserialize_any(TextVisitor::<$t>(std::marker::PhantomData))
            }
        }
    )*};
}

serde_via_text!(
    ChunkHeads,
    FwdChunk,
    Settle,
    SaveAttention,
    OffloadBlocks,
    OptimizerOffload,
    HostUpdateChoice,
    CheckpointEvery
);

/// Reads a string or an integer through `T::from_str`.
struct TextVisitor<T>(std::marker::PhantomData<T>);

impl<T: FromStr> serde::de::Visitor<'_> for TextVisitor<T>
where
    T::Err: fmt::Display,
{
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or a number")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<T, E> {
        v.parse().map_err(|e: T::Err| E::custom(e.to_string()))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<T, E> {
        self.visit_str(&v.to_string())
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<T, E> {
        self.visit_str(&v.to_string())
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<T, E> {
        self.visit_str(if v { "true" } else { "false" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::bench::AttnArgs;
    use crate::cli::eval::EvalArgs;
    use crate::cli::memory::MemoryArgs;
    use crate::cli::mesh::MeshArgs;
    use crate::cli::plan::PlanArgs;
    use crate::cli::schedule::{FwdChunkArgs, ScheduleArgs};
    use crate::cli::train::TrainArgs;
    use clap::{Args, Command, FromArgMatches};

    /// `A` parsed from `argv` (after the subcommand), with its matches.
    fn args<A: Args + FromArgMatches>(argv: &[&str]) -> (A, ArgMatches) {
        let cmd = A::augment_args(Command::new("x").no_binary_name(true));
        let m = cmd.try_get_matches_from(argv).unwrap();
        (A::from_arg_matches(&m).unwrap(), m)
    }

    /// Every flag of `A` but `--config`/`--print-config` has a key.
    fn every_flag_has_a_key<A: Args>(keys: &[&[(&str, &str, &str)]]) {
        let cmd = A::augment_args(Command::new("x"));
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "config" | "print_config" | "help") {
                continue;
            }
            let found = keys.iter().flat_map(|k| k.iter()).any(|(f, _, _)| *f == id);
            assert!(found, "--{id} has no run-file key");
        }
    }

    #[test]
    fn every_flag_of_every_subcommand_has_a_key() {
        let (memory, schedule, fwd) = (MemoryArgs::KEYS, ScheduleArgs::KEYS, FwdChunkArgs::KEYS);
        let mesh = MeshArgs::KEYS;
        let lora = crate::cli::lora::LoraArgs::KEYS;
        every_flag_has_a_key::<TrainArgs>(&[TrainArgs::KEYS, memory, mesh, fwd, lora]);
        let task = crate::cli::eval::TaskArgs::KEYS;
        every_flag_has_a_key::<EvalArgs>(&[EvalArgs::KEYS, mesh, task]);
        every_flag_has_a_key::<PlanArgs>(&[PlanArgs::KEYS, mesh, schedule, fwd, memory, lora]);
        every_flag_has_a_key::<AttnArgs>(&[AttnArgs::KEYS, mesh, schedule, fwd]);
    }

    #[test]
    fn a_flag_is_the_same_key_in_every_subcommand() {
        let all = [
            TrainArgs::KEYS,
            EvalArgs::KEYS,
            PlanArgs::KEYS,
            ScheduleArgs::KEYS,
            FwdChunkArgs::KEYS,
            MemoryArgs::KEYS,
            MeshArgs::KEYS,
            AttnArgs::KEYS,
            crate::cli::lora::LoraArgs::KEYS,
        ];
        for a in all.iter().flat_map(|k| k.iter()) {
            for b in all.iter().flat_map(|k| k.iter()) {
                let own = ["device", "warmup", "metrics", "seq", "fwd_chunk_heads"];
                if a.0 == b.0 && !own.contains(&a.0) {
                    assert_eq!(a, b, "--{} maps to two keys", a.0);
                }
            }
        }
    }

    #[test]
    fn file_keys_fill_the_flags_not_given_and_flags_win() {
        let file = parse_ok(
            "[data]\nseq = 512\n[run]\nsteps = 9\nseed = 4\n[memory]\ncheckpoint = true\n",
        );
        let (mut a, m) = args::<TrainArgs>(&["--steps", "3", "--checkpoint=false"]);
        a.take_file(&file, &Given(&m));
        assert_eq!((a.seq, a.steps, a.seed), (512, 3, 4));
        assert!(
            !a.memory.checkpoint,
            "--checkpoint=false turns off the file's checkpoint"
        );
        assert_eq!(a.lr, 3e-3, "a key the file leaves out keeps its default");
        // a default equal to the file's value is still the file's
        let (mut b, m) = args::<TrainArgs>(&[]);
        b.take_file(&file, &Given(&m));
        assert_eq!(b.steps, 9);
        assert!(b.memory.checkpoint);
    }

    fn parse_ok(text: &str) -> RunFile {
        super::parse(text).unwrap()
    }

    #[test]
    fn bad_files_name_the_key_and_what_it_takes() {
        let e = parse("[data]\nsq = 512\n").unwrap_err();
        assert!(
            e.contains("data") && e.contains("`sq`") && e.contains("`seq`"),
            "{e}"
        );
        let e = parse("[data]\nseq = \"long\"\n").unwrap_err();
        assert!(
            e.contains("key `data.seq`") && e.contains("usize") && e.contains("line 2"),
            "{e}"
        );
        let e = parse("[dta]\nseq = 1\n").unwrap_err();
        assert!(
            e.contains("unknown section `dta`") && e.contains("`data`"),
            "{e}"
        );
        let e = parse("[parallel]\nfwd-chunk-heads = \"wide\"\n").unwrap_err();
        assert!(
            e.contains("parallel.fwd-chunk-heads") && e.contains("auto"),
            "{e}"
        );
        let e = parse("[run\nsteps = 1\n").unwrap_err();
        assert!(e.contains("line 1"), "{e}");
    }

    #[test]
    fn resolved_flags_write_and_read_back_the_same() {
        let (a, _) =
            args::<TrainArgs>(&["--seq", "1024", "--fwd-chunk-heads", "4", "--lr", "1e-4"]);
        let text = resolved_toml(&a).unwrap();
        assert!(text.contains("lr = 0.0001\n"), "{text}");
        assert!(text.contains("fwd-chunk-heads = 4\n"), "{text}");
        let (mut b, m) = args::<TrainArgs>(&[]);
        b.take_file(&parse_ok(&text), &Given(&m));
        assert_eq!(resolved_toml(&b).unwrap(), text);
        let (p, _) = args::<PlanArgs>(&["--settle-every", "phase", "--model", "tiny"]);
        let text = resolved_toml(&p).unwrap();
        assert!(text.contains("settle-every = \"phase\""), "{text}");
        assert_eq!(parse_ok(&text).parallel.settle_every, Some(Settle::Phase));
    }

    #[test]
    fn a_flag_that_needs_another_names_it() {
        let e = |argv: &[&str]| {
            args::<TrainArgs>(argv)
                .0
                .validate()
                .unwrap_err()
                .to_string()
        };
        let m = e(&["--save-every", "5"]);
        assert!(
            m.contains("--save-every / [checkpoint] save-every does nothing without --save-dir"),
            "{m}"
        );
        let m = e(&["--resume"]);
        assert!(
            m.contains("--resume") && m.contains("add --save-dir"),
            "{m}"
        );
        let m = e(&["--allow-extra-tensors"]);
        assert!(m.contains("without --init-from"), "{m}");
        let m = e(&["--overwrite"]);
        assert!(
            m.contains("--overwrite") && m.contains("add --save-dir"),
            "{m}"
        );
        let (mut a, m) = args::<TrainArgs>(&[]);
        a.take_file(&parse_ok("[checkpoint]\nsave-every = 3\n"), &Given(&m));
        let m = a.validate().unwrap_err().to_string();
        assert!(m.contains("[checkpoint] save-every"), "{m}");
        assert!(
            args::<TrainArgs>(&["--save-every", "0"])
                .0
                .validate()
                .is_ok()
        );
        let with_dir = ["--save-every", "5", "--resume", "--save-dir", "/tmp/x"];
        assert!(args::<TrainArgs>(&with_dir).0.validate().is_ok());
    }

    #[test]
    fn non_finite_and_negative_numbers_are_refused() {
        for (text, key) in [
            ("[optim]\nlr = nan\n", "[optim] lr"),
            ("[optim]\nmin-lr = -1e-4\n", "[optim] min-lr"),
            ("[optim]\nweight-decay = inf\n", "[optim] weight-decay"),
            ("[optim]\nclip = -1.0\n", "[optim] clip"),
            ("[hardware]\nhost-mem = nan\n", "[hardware] host-mem"),
            ("[hardware]\nhost-mem = -2.0\n", "[hardware] host-mem"),
        ] {
            let (mut a, m) = args::<TrainArgs>(&[]);
            a.take_file(&parse_ok(text), &Given(&m));
            let e = a.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn range_errors_name_the_flag_and_the_key() {
        let (mut a, m) = args::<TrainArgs>(&[]);
        a.take_file(&parse_ok("[run]\nsteps = 0\n"), &Given(&m));
        let e = a.validate().unwrap_err().to_string();
        assert!(
            e.contains("--steps / [run] steps is 0: must be at least 1"),
            "{e}"
        );
        let (mut a, m) = args::<TrainArgs>(&[]);
        a.take_file(&parse_ok("[parallel]\nfsdp = \"maybe\"\n"), &Given(&m));
        let e = a.validate().unwrap_err().to_string();
        assert!(
            e.contains("auto, on or off") && e.contains("[parallel] fsdp"),
            "{e}"
        );
    }
}

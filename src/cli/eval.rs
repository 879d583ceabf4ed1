//! `upipe eval`: mean next-token cross-entropy of an HF checkpoint on a token
//! file taken as one sequence, under any strategy — for checking against
//! other frameworks on the same weights.

use crate::attention::{CpPlan, Strategy};
use crate::backend::{Category, IGNORE};
use crate::error::{Error, Result};
use crate::model::decoder::attn_dims;
use crate::model::{MemoryPolicy, ModelConfig};
use crate::train::checkpoint::load_hf_model;
use crate::train::data::Tokens;
use crate::train::trainer::{loss_and_grads_cpu, weights_from_host};
use std::path::PathBuf;

/// Flags of `upipe eval`.
#[derive(clap::Args, Debug, Clone)]
pub struct EvalArgs {
    /// HF model directory (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    pub model_dir: PathBuf,
    /// Token ids: `.u32` (little-endian uint32) or `.u16`/`.bin` (uint16).
    #[arg(long)]
    pub tokens: PathBuf,
    /// Attention strategy.
    #[arg(long, default_value = "upipe")]
    pub attn: String,
    #[arg(long, default_value_t = 1)]
    pub ulysses: usize,
    #[arg(long, default_value_t = 1)]
    pub ring: usize,
    #[arg(long)]
    pub chunk_heads: Option<usize>,
}

pub fn run(a: EvalArgs) -> Result<i32> {
    let cfg = ModelConfig::resolve(&a.model_dir.to_string_lossy())?;
    let tokens = Tokens::open_checked(&a.tokens, cfg.vocab)?;
    let tokens = tokens.read(0..tokens.len());
    if tokens.len() < 2 {
        return Err(Error::Config(format!(
            "{} holds {} tokens; at least 2 are needed to predict one",
            a.tokens.display(),
            tokens.len()
        )));
    }
    let strategy: Strategy = a.attn.parse()?;
    let (pu, pr) = if strategy == Strategy::Local {
        (1, 1)
    } else {
        (a.ulysses, a.ring)
    };
    // Pad the sequence to a length the layout accepts; padded positions come
    // last, so causal attention keeps them out of every real prediction.
    let n = tokens.len() - 1;
    let unit = if pr > 1 { 2 * pr * pu } else { pu };
    let seq = n.div_ceil(unit) * unit;
    let mut ids = tokens[..n].to_vec();
    let mut targets = tokens[1..].to_vec();
    ids.resize(seq, 0);
    targets.resize(seq, IGNORE);
    let plan = CpPlan::new(strategy, &attn_dims(&cfg), seq, pu, pr, a.chunk_heads)?;
    let host = load_hf_model(&a.model_dir, &cfg)?;
    let weights = |b: &crate::backend::cpu::CpuBackend| {
        weights_from_host(
            b,
            &cfg,
            &host,
            crate::backend::DType::F32,
            Category::Weights,
        )
    };
    let (loss, _) = loss_and_grads_cpu(
        &cfg,
        &plan,
        MemoryPolicy::default(),
        &ids,
        &targets,
        &weights,
    )?;
    println!("{}", serde_json::json!({ "loss": loss, "tokens": n }));
    Ok(0)
}

//! [`ModelConfig`], the validated configuration everyone reads: its
//! validation, and the parameters with the exact HF names and shapes that
//! checkpoints must carry (resolving a preset or a Hugging Face
//! `config.json`, each parsed by its family: `config_source.rs`).

use super::families::{BlockParam, BlockSpec, Family, LayerType, Param, WindowRule};
use crate::attention::rope::RopeConfig;
use crate::backend::{DType, RmsNorm};
use crate::error::{Error, Result};

pub use crate::attention::rope::{Llama3Scaling, RopeScaling, YarnScaling};

/// Dimensions and options of a Llama-family decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// A human-readable name (preset name or HF `_name_or_path`).
    pub name: String,
    /// The family: its `config.json` schema, parameter names and quirks
    /// (QK-norm: [`ModelConfig::qk_norm`]).
    pub family: Family,
    /// Model (residual stream) width.
    pub hidden: usize,
    /// Number of decoder layers.
    pub layers: usize,
    /// Number of query heads.
    pub heads: usize,
    /// Number of key/value heads (GQA); divides `heads`.
    pub kv_heads: usize,
    /// Width of one attention head (need not equal `hidden / heads`, e.g. Qwen3-32B).
    pub head_dim: usize,
    /// SwiGLU intermediate width.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// Optional RoPE scaling (Llama 3's or YaRN).
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Whether the LM head shares the embedding matrix (`tie_word_embeddings`).
    pub tie_embeddings: bool,
    /// The longest context the model is configured for.
    pub max_position: usize,
    /// Keys each query sees at most, itself included (`sliding_window`:
    /// Mistral's 4096); `None` for full causal attention. Only a family
    /// with a window reads one ([`Family::has_sliding_window`]).
    pub sliding_window: Option<usize>,
    /// Each layer's attention (`layer_types`) in a family that attends
    /// differently per layer ([`WindowRule::PerLayer`]: Gemma 3's five
    /// sliding layers to one global); empty where every layer is alike.
    pub layer_types: Vec<LayerType>,
    /// The RoPE base of the sliding layers of a per-layer family, which
    /// take no RoPE scaling (Gemma 3's `rope_local_base_freq`).
    pub local_rope_theta: Option<f32>,
    /// Scores are scaled by the inverse square root of this
    /// (`query_pre_attn_scalar`: Gemma 3 27B's 168) instead of `head_dim`'s.
    pub query_pre_attn_scalar: Option<f32>,
}

/// How one layer attends: its window and its RoPE.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    /// Keys each query sees at most, itself included; `None`: causal over
    /// the whole window.
    pub window: Option<usize>,
    pub rope: RopeConfig,
}

/// The most layers a model may have ([`ModelConfig::validate`]).
pub const MAX_LAYERS: usize = 1024;

impl ModelConfig {
    /// Checks the config once, at the edge; every error names the fix.
    pub fn validate(&self) -> Result<()> {
        let dims = [
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
            ("max_position", self.max_position),
        ];
        for (what, v) in dims {
            if v == 0 {
                return Err(self.err(format!("{what} is 0; every dimension must be at least 1")));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(self.err(format!(
                "heads ({}) is not a multiple of kv_heads ({}); choose kv_heads dividing heads, e.g. {}",
                self.heads,
                self.kv_heads,
                largest_divisor_at_most(self.heads, self.kv_heads)
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(self.err(format!(
                "head_dim ({}) is odd; RoPE rotates pairs of dimensions, use an even head_dim such as {}",
                self.head_dim,
                self.head_dim + 1
            )));
        }
        self.validate_size()?;
        positive_finite(self, "rope_theta", self.rope_theta)?;
        positive_finite(self, "rms_norm_eps", self.rms_norm_eps)?;
        if let Some(s) = &self.rope_scaling {
            self.validate_rope_scaling(s)?;
        }
        if let Some(t) = self.local_rope_theta {
            positive_finite(self, "rope_local_base_freq", t)?;
        }
        if let Some(q) = self.query_pre_attn_scalar {
            positive_finite(self, "query_pre_attn_scalar", q)?;
        }
        self.validate_sliding_window()?;
        self.validate_layer_types()
    }

    /// One layer type per layer in a per-layer family, none elsewhere.
    fn validate_layer_types(&self) -> Result<()> {
        let per_layer = self.spec().window == WindowRule::PerLayer;
        match (per_layer, self.layer_types.len()) {
            (false, 0) => Ok(()),
            (false, _) => Err(self.err(format!(
                "layer_types on a {} model, whose layers all attend alike; remove layer_types",
                self.family.name()
            ))),
            (true, n) if n == self.layers => Ok(()),
            (true, n) => Err(self.err(format!(
                "layer_types lists {n} layers but the model has {} (num_hidden_layers); list one \
                 per layer",
                self.layers
            ))),
        }
    }

    /// A window of at least one key, on a family whose attention slides.
    fn validate_sliding_window(&self) -> Result<()> {
        match self.sliding_window {
            None => Ok(()),
            Some(_) if !self.family.has_sliding_window() => Err(self.err(format!(
                "a sliding window on a {} model, whose attention does not slide; use a Mistral \
                 config (model_type 'mistral') or no window",
                self.family.name()
            ))),
            Some(0) => Err(self.err(
                "sliding_window is 0, which hides every key; use at least 1 (or null for none)"
                    .to_string(),
            )),
            Some(_) => Ok(()),
        }
    }

    /// A model small enough to count: at most [`MAX_LAYERS`] layers (a
    /// config.json with a typo of millions would take the planner hours),
    /// and parameters whose bytes (weights, gradients and two moments in
    /// f32) fit a `usize`, so no size computed from them overflows.
    fn validate_size(&self) -> Result<()> {
        if self.layers > MAX_LAYERS {
            return Err(self.err(format!(
                "{} layers (num_hidden_layers), above the {MAX_LAYERS} upipe accepts; published \
                 models have at most a few hundred: check config.json",
                self.layers
            )));
        }
        if self
            .checked_param_count()
            .and_then(|n| n.checked_mul(16))
            .is_none()
        {
            return Err(self.err(format!(
                "its parameters (hidden {}, heads {} x head_dim {}, ffn {}, vocab {}, {} layers) \
                 are too many to count in memory; check config.json",
                self.hidden, self.heads, self.head_dim, self.ffn, self.vocab, self.layers
            )));
        }
        Ok(())
    }

    /// [`ModelConfig::param_count`] without overflow (`None` where it would).
    fn checked_param_count(&self) -> Option<usize> {
        let (h, hd) = (self.hidden, self.head_dim);
        let q = self.heads.checked_mul(hd)?.checked_mul(h)?;
        let kv = self.kv_heads.checked_mul(hd)?.checked_mul(h)?;
        let mlp = self.ffn.checked_mul(h)?.checked_mul(3)?;
        // at most four norms of the hidden size and two of the head's
        let norms = h.checked_mul(4)?.checked_add(hd.checked_mul(2)?)?;
        let layer = q.checked_mul(2)?.checked_add(kv.checked_mul(2)?)?;
        let biases = if self.qkv_bias() {
            self.heads
                .checked_add(self.kv_heads.checked_mul(2)?)?
                .checked_mul(hd)?
        } else {
            0
        };
        let layer = layer
            .checked_add(mlp)?
            .checked_add(norms)?
            .checked_add(biases)?;
        let embed = self.vocab.checked_mul(h)?;
        let head = if self.tie_embeddings { 0 } else { embed };
        layer
            .checked_mul(self.layers)?
            .checked_add(embed)?
            .checked_add(head)?
            .checked_add(h)
    }

    fn validate_rope_scaling(&self, s: &RopeScaling) -> Result<()> {
        match s {
            RopeScaling::Llama3(s) => self.validate_llama3_scaling(s),
            RopeScaling::Yarn(y) => y.invalid().map_or(Ok(()), |m| Err(self.err(m))),
            RopeScaling::Linear(f) => positive_finite(self, "rope_scaling.factor", *f),
        }
    }

    fn validate_llama3_scaling(&self, s: &Llama3Scaling) -> Result<()> {
        positive_finite(self, "rope_scaling.factor", s.factor)?;
        positive_finite(self, "rope_scaling.low_freq_factor", s.low_freq_factor)?;
        positive_finite(self, "rope_scaling.high_freq_factor", s.high_freq_factor)?;
        if s.high_freq_factor <= s.low_freq_factor {
            return Err(self.err(format!(
                "rope_scaling.high_freq_factor ({}) must exceed low_freq_factor ({}); Llama 3 uses 4 and 1",
                s.high_freq_factor, s.low_freq_factor
            )));
        }
        if s.original_max_position_embeddings == 0 {
            return Err(self.err(
                "rope_scaling.original_max_position_embeddings is 0; Llama 3 uses 8192".to_string(),
            ));
        }
        Ok(())
    }

    fn err(&self, msg: String) -> Error {
        Error::Config(format!("model '{}': {msg}", self.name))
    }

    /// Query heads per kv head.
    pub fn group_size(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Total number of parameters (tied embeddings counted once).
    pub fn param_count(&self) -> usize {
        self.hf_param_shapes()
            .iter()
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum()
    }

    /// The block its family declares.
    pub fn spec(&self) -> &'static BlockSpec {
        self.family.spec()
    }

    /// Every RMSNorm of the model: its eps and its family's weight offset.
    pub fn norm(&self) -> RmsNorm {
        RmsNorm {
            eps: self.rms_norm_eps,
            weight_offset: self.spec().norm_weight_offset,
        }
    }

    /// The factor attention scores are scaled by: `1/√head_dim`, or
    /// `1/√query_pre_attn_scalar` where the model gives one.
    pub fn softmax_scale(&self) -> f32 {
        match self.query_pre_attn_scalar {
            Some(q) => 1.0 / q.sqrt(),
            None => crate::attention::AttnDims::default_softmax_scale(self.head_dim),
        }
    }

    /// The embedding's scale where the family scales its embedding:
    /// `√hidden` in the activations' `dtype`, as `transformers` casts it to
    /// the weights' dtype (rounded to bf16 in a bf16 model).
    pub fn embed_scale(&self, dtype: DType) -> Option<f32> {
        let scale = (self.hidden as f32).sqrt();
        self.spec().scaled_embedding.then(|| match dtype {
            DType::BF16 => half::bf16::from_f32(scale).to_f32(),
            _ => scale,
        })
    }

    /// How layer `l` attends.
    pub fn layer_attention(&self, l: usize) -> LayerAttention {
        let global = RopeConfig {
            theta: self.rope_theta,
            scaling: self.rope_scaling,
        };
        match self.spec().window {
            WindowRule::Never => LayerAttention {
                window: None,
                rope: global,
            },
            WindowRule::Uniform => LayerAttention {
                window: self.sliding_window,
                rope: global,
            },
            WindowRule::PerLayer => match self.layer_types.get(l) {
                Some(LayerType::Sliding) => LayerAttention {
                    window: self.sliding_window,
                    rope: RopeConfig {
                        theta: self.local_rope_theta.unwrap_or(self.rope_theta),
                        scaling: None,
                    },
                },
                Some(LayerType::Full) | None => LayerAttention {
                    window: None,
                    rope: global,
                },
            },
        }
    }

    /// Whether q and k are RMS-normalised per head before RoPE (the
    /// family's quirk: Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.family.qk_norm()
    }

    /// Whether the q/k/v projections carry biases (the family's quirk: Qwen2).
    pub fn qkv_bias(&self) -> bool {
        self.family.qkv_bias()
    }

    /// The HF name of parameter `p` in this model's family.
    pub fn hf_name(&self, p: Param) -> String {
        self.family.hf_name(p)
    }

    /// Every parameter by role with its shape, in model (HF) order: the
    /// embedding, each block's [`Family::block_params`], the final norm and
    /// the LM head unless tied.
    pub fn params(&self) -> Vec<(Param, Vec<usize>)> {
        let (h, v) = (self.hidden, self.vocab);
        let mut out = vec![(Param::Embed, vec![v, h])];
        for l in 0..self.layers {
            let block = self.family.block_params().into_iter();
            out.extend(block.map(|bp| (Param::Block(l, bp), bp.shape(self))));
        }
        out.push((Param::FinalNorm, vec![h]));
        if !self.tie_embeddings {
            out.push((Param::LmHead, vec![v, h]));
        }
        out
    }

    /// Every parameter with its exact Hugging Face name and shape, in model order.
    pub fn hf_param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.params()
            .into_iter()
            .map(|(p, shape)| (self.hf_name(p), shape))
            .collect()
    }

    /// Whether a tensor a checkpoint holds under `name` carries no
    /// parameter: a buffer of the family ([`Family::is_buffer`]), or the LM
    /// head of a model whose head is tied to the embeddings.
    pub fn is_parameterless(&self, name: &str) -> bool {
        self.family.is_buffer(name) || (self.tie_embeddings && name == self.hf_name(Param::LmHead))
    }
}

fn positive_finite(cfg: &ModelConfig, what: &str, v: f32) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(cfg.err(format!(
            "{what} is {v}; it must be a positive finite number"
        )))
    }
}

/// The largest divisor of `n` that is at most `k` (at least 1).
fn largest_divisor_at_most(n: usize, k: usize) -> usize {
    (1..=k.min(n))
        .rev()
        .find(|&d| n.is_multiple_of(d))
        .unwrap_or(1)
}

impl BlockParam {
    /// Its shape in a model of `cfg`'s dimensions.
    pub fn shape(self, cfg: &ModelConfig) -> Vec<usize> {
        let (h, hd, ffn) = (cfg.hidden, cfg.head_dim, cfg.ffn);
        let (q, kv) = (cfg.heads * hd, cfg.kv_heads * hd);
        match self {
            BlockParam::AttnNorm
            | BlockParam::MlpNorm
            | BlockParam::PostAttnNorm
            | BlockParam::PostMlpNorm => vec![h],
            BlockParam::Wq => vec![q, h],
            BlockParam::Wk | BlockParam::Wv => vec![kv, h],
            BlockParam::Bq => vec![q],
            BlockParam::Bk | BlockParam::Bv => vec![kv],
            BlockParam::Wo => vec![h, q],
            BlockParam::QNorm | BlockParam::KNorm => vec![hd],
            BlockParam::Gate | BlockParam::Up => vec![ffn, h],
            BlockParam::Down => vec![h, ffn],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config_source::PRESETS;
    use crate::model::families::presets;
    use serde_json::Value;

    fn approx(count: usize, expected: f64, rel: f64) -> bool {
        ((count as f64) - expected).abs() / expected < rel
    }

    #[test]
    fn presets_are_valid_and_resolvable() {
        for name in PRESETS {
            let cfg = ModelConfig::resolve(name).unwrap();
            assert_eq!(cfg.name, *name);
            cfg.validate().unwrap();
        }
    }

    #[test]
    fn preset_param_counts_match_published_sizes() {
        let count = |n: &str| ModelConfig::preset(n).unwrap().param_count();
        assert_eq!(count("llama3-8b"), 8_030_261_248);
        assert_eq!(count("llama3.2-1b"), 1_235_814_400);
        assert!(approx(count("llama3-70b"), 70.55e9, 0.005));
        assert!(approx(count("qwen3-32b"), 32.76e9, 0.005));
        let tiny = ModelConfig::preset("tiny").unwrap();
        // embed + lm_head + 2 layers of (2 norms, q,k,v,o, 3 MLP) + final norm
        let per_layer = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 172 * 64;
        assert_eq!(tiny.param_count(), 2 * 256 * 64 + 2 * per_layer + 64);
    }

    #[test]
    fn published_presets_are_their_config_json_with_published_sizes() {
        let listed: Vec<&str> = presets::hf_preset_names().collect();
        for name in &listed {
            assert!(PRESETS.contains(name), "{name} is not in PRESETS");
            let src = ModelConfig::hf_source(name).unwrap().unwrap();
            assert_eq!(src["torch_dtype"], "bfloat16", "{name}");
            // a multimodal config names its text model's tokens in its tokenizer
            match src.get("text_config") {
                None => assert!(src["bos_token_id"].is_number(), "{name}"),
                Some(text) => assert_eq!(text["model_type"], "gemma3_text", "{name}"),
            }
        }
        let count = |n: &str| ModelConfig::preset(n).unwrap().param_count();
        assert_eq!(count("llama3.1-8b"), 8_030_261_248);
        assert_eq!(count("llama3.1-70b"), 70_553_706_496);
        assert_eq!(count("llama3.3-70b"), 70_553_706_496);
        assert_eq!(count("llama3.2-3b"), 3_212_749_824);
        assert_eq!(count("qwen3-8b"), 8_190_735_360);
        assert_eq!(count("qwen3-0.6b"), 596_049_920);
        assert_eq!(count("qwen3-4b"), 4_022_468_096);
        assert_eq!(count("qwen3-14b"), 14_768_307_200);
        // Qwen2.5: with the q/k/v biases, the published exact counts
        assert_eq!(count("qwen2.5-0.5b-instruct"), 494_032_768);
        assert_eq!(count("qwen2.5-7b-instruct"), 7_615_616_512);
        assert!(approx(count("qwen2.5-72b-instruct"), 72.7e9, 0.001));
        let l31 = ModelConfig::preset("llama3.1-8b").unwrap();
        assert_eq!(
            l31,
            ModelConfig {
                name: "llama3.1-8b".into(),
                ..ModelConfig::preset("llama3-8b").unwrap()
            }
        );
        assert_eq!(l31.rope_scaling.unwrap().factor(), 8.0);
        assert_eq!(ModelConfig::hf_source("tiny").unwrap(), None);
    }

    #[test]
    fn hf_shapes_follow_hf_naming() {
        let cfg = ModelConfig::preset("qwen3-32b").unwrap();
        let shapes: BTreeMapShapes = cfg.hf_param_shapes().into_iter().collect();
        assert_eq!(shapes["model.embed_tokens.weight"], vec![151_936, 5120]);
        assert_eq!(
            shapes["model.layers.63.self_attn.q_proj.weight"],
            vec![8192, 5120]
        );
        assert_eq!(
            shapes["model.layers.0.self_attn.k_proj.weight"],
            vec![1024, 5120]
        );
        assert_eq!(
            shapes["model.layers.0.self_attn.v_proj.weight"],
            vec![1024, 5120]
        );
        assert_eq!(
            shapes["model.layers.0.self_attn.o_proj.weight"],
            vec![5120, 8192]
        );
        assert_eq!(shapes["model.layers.0.self_attn.q_norm.weight"], vec![128]);
        assert_eq!(shapes["model.layers.0.self_attn.k_norm.weight"], vec![128]);
        assert_eq!(
            shapes["model.layers.0.mlp.gate_proj.weight"],
            vec![25_600, 5120]
        );
        assert_eq!(
            shapes["model.layers.0.mlp.down_proj.weight"],
            vec![5120, 25_600]
        );
        assert_eq!(shapes["lm_head.weight"], vec![151_936, 5120]);
        assert_eq!(shapes.len(), 1 + 64 * 11 + 2);

        let tied = ModelConfig::preset("llama3.2-1b").unwrap();
        let names: Vec<String> = tied.hf_param_shapes().into_iter().map(|(n, _)| n).collect();
        assert!(!names.iter().any(|n| n == "lm_head.weight"));
        assert!(!names.iter().any(|n| n.contains("q_norm")));
        assert_eq!(names.last().unwrap(), "model.norm.weight");
    }

    type BTreeMapShapes = std::collections::BTreeMap<String, Vec<usize>>;

    const LLAMA31_JSON: &str = r#"{
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3"
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256
    }"#;

    const QWEN3_JSON: &str = r#"{
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": false,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "max_position_embeddings": 40960,
        "max_window_layers": 64,
        "model_type": "qwen3",
        "num_attention_heads": 64,
        "num_hidden_layers": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": null,
        "rope_theta": 1000000,
        "sliding_window": null,
        "tie_word_embeddings": false,
        "use_sliding_window": false,
        "vocab_size": 151936
    }"#;

    #[test]
    fn parses_llama31_config() {
        let cfg = ModelConfig::from_hf_json(LLAMA31_JSON).unwrap();
        let preset = ModelConfig::preset("llama3-8b").unwrap();
        assert_eq!(
            cfg,
            ModelConfig {
                name: "llama".into(),
                ..preset
            }
        );
    }

    #[test]
    fn parses_qwen3_config() {
        let cfg = ModelConfig::from_hf_json(QWEN3_JSON).unwrap();
        let preset = ModelConfig::preset("qwen3-32b").unwrap();
        assert_eq!(
            cfg,
            ModelConfig {
                name: "qwen3".into(),
                ..preset
            }
        );
    }

    #[test]
    fn hf_defaults_apply() {
        let cfg = ModelConfig::from_hf_json(
            r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":1,
                "num_attention_heads":4,"intermediate_size":128,"vocab_size":256,
                "rope_scaling":{"type":"llama3","factor":2,"low_freq_factor":1,
                "high_freq_factor":4,"original_max_position_embeddings":64}}"#,
        )
        .unwrap();
        assert_eq!(cfg.kv_heads, 4);
        assert_eq!(cfg.head_dim, 16);
        assert_eq!(cfg.rope_theta, 10_000.0);
        assert!(!cfg.tie_embeddings && !cfg.qk_norm());
        assert_eq!(cfg.rope_scaling.unwrap().factor(), 2.0);
    }

    #[test]
    fn reads_rope_parameters_of_newer_transformers() {
        let json = QWEN3_JSON.replace("\"rope_theta\": 1000000,", "").replace(
            "\"rope_scaling\": null,",
            "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1000000.0},",
        );
        assert!(!json.contains("\"rope_theta\": 1000000,"));
        let cfg = ModelConfig::from_hf_json(&json).unwrap();
        assert_eq!(cfg.rope_theta, 1_000_000.0);
        assert_eq!(cfg.rope_scaling, None);
        let llama = LLAMA31_JSON
            .replace("\"rope_scaling\"", "\"rope_parameters\"")
            .replace("\"rope_theta\": 500000.0,", "")
            .replace(
                "\"rope_type\": \"llama3\"",
                "\"rope_type\": \"llama3\", \"rope_theta\": 500000.0",
            );
        let cfg = ModelConfig::from_hf_json(&llama).unwrap();
        assert_eq!(cfg.rope_theta, 500_000.0);
        assert_eq!(cfg.rope_scaling.unwrap().factor(), 8.0);
        // a null rope_scaling beside them defers to rope_parameters
        let with_null = llama.replacen('{', "{\"rope_scaling\": null,", 1);
        let cfg = ModelConfig::from_hf_json(&with_null).unwrap();
        assert_eq!(cfg.rope_scaling.unwrap().factor(), 8.0);
    }

    #[test]
    fn hf_json_round_trips() {
        for name in PRESETS {
            let cfg = ModelConfig::preset(name).unwrap();
            assert_eq!(ModelConfig::from_hf_json(&cfg.to_hf_json()).unwrap(), cfg);
        }
        let json: Value =
            serde_json::from_str(&ModelConfig::preset("tiny").unwrap().to_hf_json()).unwrap();
        assert_eq!(
            json["rms_norm_eps"].as_f64(),
            Some(1e-5),
            "written as the decimal 1e-5"
        );
    }

    fn config_error(json: &str) -> String {
        match ModelConfig::from_hf_json(json) {
            Err(Error::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn bad_hf_configs_are_refused_clearly() {
        let longrope = LLAMA31_JSON.replace("\"llama3\"", "\"longrope\"");
        let e = config_error(&longrope);
        assert!(
            e.contains("rope_scaling type 'longrope'") && e.contains("'yarn'"),
            "{e}"
        );
        let no_hidden = LLAMA31_JSON.replace("\"hidden_size\"", "\"hidden\"");
        assert!(config_error(&no_hidden).contains("'hidden_size'"));
        let gemma = LLAMA31_JSON.replace("\"llama\"", "\"gemma2\"");
        assert!(config_error(&gemma).contains("model_type 'gemma2'"));
        let qwen2 = QWEN3_JSON.replace("\"qwen3\"", "\"qwen2\"");
        let window = qwen2.replace(
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true",
        );
        assert!(config_error(&window).contains("use_sliding_window"));
        let bias = LLAMA31_JSON.replace("\"attention_bias\": false", "\"attention_bias\": true");
        assert!(config_error(&bias).contains("attention_bias"));
        assert!(config_error("[1, 2]").contains("JSON object"));
        assert!(config_error("{").contains("not valid JSON"));
        let odd_kv =
            LLAMA31_JSON.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5");
        assert!(config_error(&odd_kv).contains("kv_heads (5)"));
        let negative =
            LLAMA31_JSON.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": -2");
        assert!(config_error(&negative).contains("num_hidden_layers"));
    }

    #[test]
    fn absurd_sizes_are_refused_before_anything_counts_them() {
        let base = ModelConfig::preset("tiny").unwrap();
        let msg = |cfg: ModelConfig| cfg.validate().unwrap_err().to_string();
        let m = msg(ModelConfig {
            layers: 100_000_000,
            ..base.clone()
        });
        assert!(m.contains("100000000 layers") && m.contains("1024"), "{m}");
        let ok = ModelConfig {
            layers: MAX_LAYERS,
            ..base.clone()
        };
        assert!(ok.validate().is_ok());
        for huge in [
            ModelConfig {
                ffn: usize::MAX,
                ..base.clone()
            },
            ModelConfig {
                vocab: 1 << 62,
                ..base.clone()
            },
            ModelConfig {
                heads: 1 << 40,
                kv_heads: 1 << 40,
                head_dim: 1 << 30,
                ..base.clone()
            },
        ] {
            assert!(msg(huge).contains("too many to count"));
        }
        let json = LLAMA31_JSON.replace(
            "\"intermediate_size\": 14336",
            "\"intermediate_size\": 18446744073709551615",
        );
        assert!(config_error(&json).contains("too many to count"));
    }

    #[test]
    fn validation_names_the_fix() {
        let base = ModelConfig::preset("tiny").unwrap();
        let msg = |cfg: ModelConfig| cfg.validate().unwrap_err().to_string();
        let m = msg(ModelConfig {
            kv_heads: 3,
            ..base.clone()
        });
        assert!(
            m.contains("heads (4) is not a multiple of kv_heads (3)") && m.contains("e.g. 2"),
            "{m}"
        );
        assert!(
            msg(ModelConfig {
                head_dim: 15,
                ..base.clone()
            })
            .contains("head_dim (15) is odd")
        );
        assert!(
            msg(ModelConfig {
                layers: 0,
                ..base.clone()
            })
            .contains("layers is 0")
        );
        assert!(
            msg(ModelConfig {
                rms_norm_eps: 0.0,
                ..base.clone()
            })
            .contains("rms_norm_eps")
        );
        assert!(
            msg(ModelConfig {
                rope_theta: f32::NAN,
                ..base.clone()
            })
            .contains("rope_theta")
        );
        let bad_scaling = RopeScaling::Llama3(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 1.0,
            original_max_position_embeddings: 8192,
        });
        let m = msg(ModelConfig {
            rope_scaling: Some(bad_scaling),
            ..base
        });
        assert!(m.contains("high_freq_factor"), "{m}");
    }

    #[test]
    fn resolve_reads_files_and_dirs_and_lists_presets() {
        let dir = std::env::temp_dir().join(format!("upipe-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), QWEN3_JSON).unwrap();
        let from_dir = ModelConfig::resolve(dir.to_str().unwrap()).unwrap();
        let from_file = ModelConfig::resolve(dir.join("config.json").to_str().unwrap()).unwrap();
        assert_eq!(from_dir, from_file);
        assert!(from_dir.qk_norm());
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        let m = ModelConfig::resolve(dir.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(m.contains("config.json") && m.contains("model_type"), "{m}");
        std::fs::remove_dir_all(&dir).unwrap();
        let m = ModelConfig::resolve("llama-9000").unwrap_err().to_string();
        assert!(
            m.contains("llama-9000") && m.contains("llama3.2-1b, llama3-8b"),
            "{m}"
        );
    }
}

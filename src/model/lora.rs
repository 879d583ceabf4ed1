//! LoRA adapters as PEFT defines them: [`LoraConfig`] (rank, alpha, rsLoRA,
//! the target modules by PEFT's names), validated against a model; the
//! adapter tensors of each block and target ([`LoraFactors`]: `lora_A`
//! `[r, in_features]`, `lora_B` `[out_features, r]`, PEFT's shapes) with
//! PEFT's initialisation (A Kaiming-uniform with a = √5, B zero), seeded
//! from the run's seed; parameter counts. The math on them is
//! `lora_math.rs`; the files (`adapter_config.json`,
//! `adapter_model.safetensors`) are `checkpoint/peft.rs`.

use super::{BlockParam, ModelConfig};
use crate::error::{Error, Result};
use crate::rng::Rng;

/// A linear layer of a block that an adapter can target, by PEFT's module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LoraTarget {
    /// Every target in block order (what PEFT's `all-linear` means for a
    /// Llama-like decoder: every linear layer but the LM head).
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// PEFT's (and `transformers`') module name: `q_proj`, ..., `down_proj`.
    pub fn peft_name(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    /// The module's path inside a decoder layer: `self_attn.q_proj`, `mlp.up_proj`.
    pub fn module_path(self) -> String {
        let parent = match self {
            LoraTarget::Q | LoraTarget::K | LoraTarget::V | LoraTarget::O => "self_attn",
            LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down => "mlp",
        };
        format!("{parent}.{}", self.peft_name())
    }

    /// The target named `name` (PEFT's module name), if upipe has it.
    pub fn from_peft_name(name: &str) -> Option<LoraTarget> {
        LoraTarget::ALL.into_iter().find(|t| t.peft_name() == name)
    }

    /// The block weight the adapter adds to.
    pub fn base_param(self) -> BlockParam {
        match self {
            LoraTarget::Q => BlockParam::Wq,
            LoraTarget::K => BlockParam::Wk,
            LoraTarget::V => BlockParam::Wv,
            LoraTarget::O => BlockParam::Wo,
            LoraTarget::Gate => BlockParam::Gate,
            LoraTarget::Up => BlockParam::Up,
            LoraTarget::Down => BlockParam::Down,
        }
    }

    /// `(in_features, out_features)` of the layer in `cfg`'s model (its
    /// weight is `[out, in]`; GQA: k/v out = `kv_heads · head_dim`).
    pub fn features(self, cfg: &ModelConfig) -> (usize, usize) {
        let shape = self.base_param().shape(cfg);
        (shape[1], shape[0])
    }

    /// Its position in [`LoraTarget::ALL`].
    fn index(self) -> usize {
        self as usize
    }
}

/// The valid target names, as errors list them.
fn valid_targets() -> String {
    let names: Vec<&str> = LoraTarget::ALL.iter().map(|t| t.peft_name()).collect();
    format!("{} (or all-linear: all seven)", names.join(", "))
}

/// Parses target modules as PEFT spells them: names separated by commas
/// (`q_proj,v_proj`), or `all-linear`. The result is in block order, each
/// target once; an unknown name is an error listing the valid ones.
pub fn parse_targets(text: &str) -> Result<Vec<LoraTarget>> {
    let names: Vec<&str> = text.split(',').map(str::trim).collect();
    targets_from_names(&names, "--lora-targets")
}

/// [`parse_targets`] for names already split (`target_modules` of an
/// `adapter_config.json`); `what` names where they came from.
pub fn targets_from_names(names: &[&str], what: &str) -> Result<Vec<LoraTarget>> {
    if names == ["all-linear"] {
        return Ok(LoraTarget::ALL.to_vec());
    }
    let mut targets = Vec::new();
    for name in names {
        match LoraTarget::from_peft_name(name) {
            Some(t) => targets.push(t),
            None if name.is_empty() => {
                return crate::config_err!(
                    "{what}: an empty target module name; give {}",
                    valid_targets()
                );
            }
            None => {
                return crate::config_err!(
                    "{what}: unknown target module '{name}'; upipe adapts {}",
                    valid_targets()
                );
            }
        }
    }
    targets.sort();
    targets.dedup();
    if targets.is_empty() {
        return crate::config_err!("{what}: no target modules; give {}", valid_targets());
    }
    Ok(targets)
}

/// A LoRA adapter's hyper-parameters, as PEFT's `LoraConfig` has them.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank `r` of every adapter.
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (rsLoRA: `alpha / √r`).
    pub alpha: f64,
    /// rsLoRA's scaling (`use_rslora`).
    pub use_rslora: bool,
    /// The adapted layers of every block, in block order, each once.
    pub targets: Vec<LoraTarget>,
}

impl std::fmt::Display for LoraConfig {
    /// `r 16, alpha 32, targets q_proj,v_proj` (and `, rsLoRA`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.targets.iter().map(|t| t.peft_name()).collect();
        write!(
            f,
            "r {}, alpha {}, targets {}",
            self.rank,
            self.alpha,
            names.join(",")
        )?;
        if self.use_rslora {
            write!(f, ", rsLoRA")?;
        }
        Ok(())
    }
}

impl LoraConfig {
    /// A config, checked on its own (rank above 0, alpha positive and
    /// finite, at least one target, in block order without repeats);
    /// [`LoraConfig::validate`] checks it against a model.
    pub fn new(
        rank: usize,
        alpha: f64,
        use_rslora: bool,
        targets: Vec<LoraTarget>,
    ) -> Result<LoraConfig> {
        if rank == 0 {
            return crate::config_err!(
                "LoRA rank 0 (--lora-rank, `r` of adapter_config.json): the rank must be at \
                 least 1 (8 or 16 are common)"
            );
        }
        if !(alpha.is_finite() && alpha > 0.0) {
            return crate::config_err!(
                "LoRA alpha {alpha} (--lora-alpha, `lora_alpha` of adapter_config.json): it \
                 must be a positive number (commonly the rank or twice the rank)"
            );
        }
        let mut targets = targets;
        targets.sort();
        targets.dedup();
        if targets.is_empty() {
            return crate::config_err!(
                "no LoRA target modules (--lora-targets, `target_modules` of \
                 adapter_config.json); give {}",
                valid_targets()
            );
        }
        Ok(LoraConfig {
            rank,
            alpha,
            use_rslora,
            targets,
        })
    }

    /// Checks the rank against `cfg`'s layers: at most the smaller
    /// dimension of every target (a larger rank adds nothing a full update
    /// could not, at more cost); the error names the flag and the limit.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        let (limit, target) = self
            .targets
            .iter()
            .map(|&t| {
                let (i, o) = t.features(cfg);
                (i.min(o), t)
            })
            .min()
            .expect("a LoraConfig has a target");
        if self.rank > limit {
            let (i, o) = target.features(cfg);
            return Err(Error::Config(format!(
                "LoRA rank {} (--lora-rank, `r` of adapter_config.json) is above {limit}, the \
                 most model '{}' allows: its {} is [{o}, {i}] (out, in) and a rank is at most \
                 the smaller dimension of every target; give --lora-rank {limit} or less",
                self.rank,
                cfg.name,
                target.peft_name()
            )));
        }
        Ok(())
    }

    /// The factor the update `B·A` is multiplied by: `alpha / r`, or with
    /// rsLoRA `alpha / √r`.
    pub fn scale(&self) -> f32 {
        let r = self.rank as f64;
        let denominator = if self.use_rslora { r.sqrt() } else { r };
        (self.alpha / denominator) as f32
    }

    /// The shapes of `target`'s factors in `cfg`'s model: `lora_A`
    /// `[r, in]` and `lora_B` `[out, r]`.
    pub fn factor_shapes(&self, cfg: &ModelConfig, target: LoraTarget) -> [[usize; 2]; 2] {
        let (i, o) = target.features(cfg);
        [[self.rank, i], [o, self.rank]]
    }

    /// The [`LoraDims`] of `target` in `cfg`'s model.
    pub fn dims(&self, cfg: &ModelConfig, target: LoraTarget) -> LoraDims {
        let (in_features, out_features) = target.features(cfg);
        LoraDims {
            rank: self.rank,
            in_features,
            out_features,
        }
    }

    /// Adapter parameters of one block: `Σ r·(in + out)` over the targets.
    pub fn params_per_block(&self, cfg: &ModelConfig) -> usize {
        let per = |t: &LoraTarget| {
            let (i, o) = t.features(cfg);
            self.rank * (i + o)
        };
        self.targets.iter().map(per).sum()
    }

    /// Bytes of one block's adapter parameters at `bytes_per_value`.
    pub fn bytes_per_block(&self, cfg: &ModelConfig, bytes_per_value: usize) -> usize {
        self.params_per_block(cfg) * bytes_per_value
    }

    /// Adapter parameters of the whole model (every block adapted).
    pub fn param_count(&self, cfg: &ModelConfig) -> usize {
        cfg.layers * self.params_per_block(cfg)
    }
}

/// The dimensions of one adapter: `lora_A` `[rank, in_features]`,
/// `lora_B` `[out_features, rank]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraDims {
    pub rank: usize,
    pub in_features: usize,
    pub out_features: usize,
}

/// One adapter's factors (one target of one block), row-major f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraFactors {
    pub dims: LoraDims,
    /// `lora_A` `[rank, in_features]`.
    pub a: Vec<f32>,
    /// `lora_B` `[out_features, rank]`.
    pub b: Vec<f32>,
}

impl LoraFactors {
    /// PEFT's initial factors, seeded by `(seed, layer, target)` alone (so
    /// any adapter can be drawn on its own, and adding a target leaves the
    /// others' values as they were): A uniform in `±1/√in` (PyTorch's
    /// `kaiming_uniform_` with `a = √5`, which PEFT uses), B zero, so the
    /// adapted model starts equal to the base.
    pub fn init(dims: LoraDims, seed: u64, layer: usize, target: LoraTarget) -> LoraFactors {
        let stream = (layer * LoraTarget::ALL.len() + target.index()) as u64;
        let mut rng = Rng::new(seed ^ LORA_SEED ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        let bound = 1.0 / (dims.in_features as f64).sqrt();
        let a = (0..dims.rank * dims.in_features)
            .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
            .collect();
        LoraFactors {
            dims,
            a,
            b: vec![0.0; dims.out_features * dims.rank],
        }
    }
}

/// Mixed into the run's seed so the adapters' stream differs from the
/// base weights' (`RandomInit`).
const LORA_SEED: u64 = 0x4C6F_5241_0000_0001;

/// A model's adapters: every block's factors for every target of `config`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraWeights {
    pub config: LoraConfig,
    /// `[layer][i]`: the factors of `config.targets[i]` in block `layer`.
    pub layers: Vec<Vec<LoraFactors>>,
}

impl LoraWeights {
    /// PEFT's initial adapters for `cfg`'s model ([`LoraFactors::init`]),
    /// after [`LoraConfig::validate`].
    pub fn init(cfg: &ModelConfig, config: &LoraConfig, seed: u64) -> Result<LoraWeights> {
        config.validate(cfg)?;
        let layers = (0..cfg.layers)
            .map(|l| {
                let targets = config.targets.iter();
                targets
                    .map(|&t| LoraFactors::init(config.dims(cfg, t), seed, l, t))
                    .collect()
            })
            .collect();
        Ok(LoraWeights {
            config: config.clone(),
            layers,
        })
    }

    /// The factors of `target` in block `layer`, if the adapter has them.
    pub fn get(&self, layer: usize, target: LoraTarget) -> Option<&LoraFactors> {
        let i = self.config.targets.iter().position(|&t| t == target)?;
        self.layers.get(layer).map(|factors| &factors[i])
    }
}

/// The prefix PEFT's `PeftModelForCausalLM` puts before the base model's names.
pub const PEFT_LAYER_PREFIX: &str = "base_model.model.model.layers.";

/// One of an adapter's two factors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Factor {
    /// `lora_A` `[r, in]`.
    A,
    /// `lora_B` `[out, r]`.
    B,
}

impl Factor {
    pub fn peft_name(self) -> &'static str {
        match self {
            Factor::A => "lora_A",
            Factor::B => "lora_B",
        }
    }
}

/// The name PEFT saves factor `factor` of `target` in block `layer` under.
pub fn tensor_name(layer: usize, target: LoraTarget, factor: Factor) -> String {
    let (module, f) = (target.module_path(), factor.peft_name());
    format!("{PEFT_LAYER_PREFIX}{layer}.{module}.{f}.weight")
}

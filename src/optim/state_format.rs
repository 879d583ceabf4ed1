//! How a run keeps its training state (`--optim-state`, `--master-weights`,
//! `--grad-dtype`): AdamW's moments in F32, BF16 or 8-bit block-wise codes,
//! F32 master weights or none (BF16 weights updated by stochastic
//! rounding), and the weight matrices' gradients in F32 or BF16. The
//! optimizer's arithmetic is `optim::adamw::compact_adamw`'s; F32 throughout,
//! the default, is the plain update, bit for bit.

use crate::backend::DType;
use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// The moments' format (`--optim-state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MomentFormat {
    #[default]
    F32,
    /// BF16, rounded to nearest even.
    Bf16,
    /// 8-bit block-wise codes, a scale per 256 elements.
    Q8,
}

/// Where the exact weights live (`--master-weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MasterWeights {
    /// An F32 master copy of weights trained in a lower precision.
    #[default]
    F32,
    /// None: BF16 weights updated in place by stochastic rounding.
    None,
}

/// The dtype of the weight matrices' gradients (`--grad-dtype`): the
/// projections', the MLP's and the LM head's, which the backward's GEMMs
/// accumulate into. Norms, biases, the embedding (a scatter-add) and LoRA
/// factors keep F32 gradients either way: well under 1 % of a model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradDtype {
    #[default]
    F32,
    /// BF16: each accumulation rounded to nearest even, as a BF16 model's
    /// gradients are; summed over ranks in F32.
    Bf16,
}

/// How a run keeps its training state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateFormat {
    pub moments: MomentFormat,
    pub master: MasterWeights,
    pub grads: GradDtype,
}

impl MomentFormat {
    /// The dtype of a moment tensor.
    pub fn dtype(self) -> DType {
        match self {
            MomentFormat::F32 => DType::F32,
            MomentFormat::Bf16 => DType::BF16,
            MomentFormat::Q8 => DType::U8,
        }
    }

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            MomentFormat::F32 => "f32",
            MomentFormat::Bf16 => "bf16",
            MomentFormat::Q8 => "8bit",
        }
    }
}

impl MasterWeights {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            MasterWeights::F32 => "f32",
            MasterWeights::None => "none",
        }
    }
}

impl GradDtype {
    /// The dtype of a weight matrix's gradient.
    pub fn dtype(self) -> DType {
        match self {
            GradDtype::F32 => DType::F32,
            GradDtype::Bf16 => DType::BF16,
        }
    }

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            GradDtype::F32 => "f32",
            GradDtype::Bf16 => "bf16",
        }
    }
}

impl StateFormat {
    /// What `--optim-state auto` tries, the most exact first: F32
    /// throughout; BF16 gradients (2 bytes a parameter fewer); 8-bit
    /// moments, no master and BF16 gradients (10 fewer than F32; on the
    /// device, or the host where `--offload-optimizer` puts it). The first
    /// whose step fits is the run's.
    pub const AUTO_LADDER: [StateFormat; 3] = [
        StateFormat {
            moments: MomentFormat::F32,
            master: MasterWeights::F32,
            grads: GradDtype::F32,
        },
        StateFormat {
            moments: MomentFormat::F32,
            master: MasterWeights::F32,
            grads: GradDtype::Bf16,
        },
        StateFormat {
            moments: MomentFormat::Q8,
            master: MasterWeights::None,
            grads: GradDtype::Bf16,
        },
    ];

    /// F32 throughout: the plain, exact step.
    pub fn is_plain(&self) -> bool {
        *self == StateFormat::default()
    }

    /// F32 moments and masters: AdamW's plain update (whatever the
    /// gradients' dtype, which the optimizer reads as it finds it).
    pub fn optimizer_is_plain(&self) -> bool {
        self.moments == MomentFormat::F32 && self.master == MasterWeights::F32
    }

    /// What a checkpoint records and a resume compares: the optimizer's
    /// state (the gradients are not saved).
    pub fn saved(&self) -> StateFormat {
        StateFormat {
            grads: GradDtype::F32,
            ..*self
        }
    }
}

impl fmt::Display for StateFormat {
    /// `moments 8bit, master none` (how run headers and metrics say it),
    /// `, grads bf16` after it where the gradients are BF16.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "moments {}, master {}",
            self.moments.name(),
            self.master.name()
        )?;
        match self.grads {
            GradDtype::F32 => Ok(()),
            g => write!(f, ", grads {}", g.name()),
        }
    }
}

impl FromStr for MomentFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "fp32" => Ok(MomentFormat::F32),
            "bf16" => Ok(MomentFormat::Bf16),
            "8bit" | "int8" | "q8" => Ok(MomentFormat::Q8),
            other => crate::config_err!(
                "--optim-state {other}: choose f32 (exact, 8 bytes a parameter), bf16 (4) or \
                 8bit (block-wise codes, about 2)"
            ),
        }
    }
}

impl FromStr for MasterWeights {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "fp32" => Ok(MasterWeights::F32),
            "none" => Ok(MasterWeights::None),
            other => crate::config_err!(
                "--master-weights {other}: choose f32 (an F32 copy of BF16 weights, 4 bytes a \
                 parameter) or none (BF16 weights updated by stochastic rounding)"
            ),
        }
    }
}

impl FromStr for GradDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "fp32" => Ok(GradDtype::F32),
            "bf16" => Ok(GradDtype::Bf16),
            other => crate::config_err!(
                "--grad-dtype {other}: choose f32 (exact, 4 bytes a parameter) or bf16 (2: the \
                 weight matrices' gradients rounded as a BF16 model's are)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_say_the_format() {
        for m in [MomentFormat::F32, MomentFormat::Bf16, MomentFormat::Q8] {
            assert_eq!(m.name().parse::<MomentFormat>().unwrap(), m);
        }
        for w in [MasterWeights::F32, MasterWeights::None] {
            assert_eq!(w.name().parse::<MasterWeights>().unwrap(), w);
        }
        assert!("fp8".parse::<MomentFormat>().is_err());
        assert!("bf16".parse::<MasterWeights>().is_err());
        for g in [GradDtype::F32, GradDtype::Bf16] {
            assert_eq!(g.name().parse::<GradDtype>().unwrap(), g);
        }
        assert!("8bit".parse::<GradDtype>().is_err());
        assert!(StateFormat::default().is_plain());
        let compact = StateFormat {
            moments: MomentFormat::Q8,
            master: MasterWeights::None,
            grads: GradDtype::F32,
        };
        assert_eq!(compact.to_string(), "moments 8bit, master none");
        let narrow = StateFormat {
            grads: GradDtype::Bf16,
            ..StateFormat::default()
        };
        assert_eq!(narrow.to_string(), "moments f32, master f32, grads bf16");
        assert!(!narrow.is_plain() && narrow.optimizer_is_plain());
        assert_eq!(narrow.saved(), StateFormat::default());
    }
}

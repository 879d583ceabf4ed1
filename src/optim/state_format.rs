//! How AdamW keeps its state (`--optim-state`, `--master-weights`): the
//! moments in F32, BF16 or 8-bit block-wise codes, and F32 master weights
//! or none (BF16 weights updated by stochastic rounding). The arithmetic is
//! `backend::compact_adamw`'s; F32 moments with F32 masters, the default,
//! are the plain update, bit for bit.

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

/// The state format of one optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateFormat {
    pub moments: MomentFormat,
    pub master: MasterWeights,
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

impl StateFormat {
    /// F32 moments and masters: the plain update.
    pub fn is_plain(&self) -> bool {
        *self == StateFormat::default()
    }
}

impl fmt::Display for StateFormat {
    /// `moments 8bit, master none` (how run headers and metrics say it).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "moments {}, master {}",
            self.moments.name(),
            self.master.name()
        )
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
        assert!(StateFormat::default().is_plain());
        let compact = StateFormat {
            moments: MomentFormat::Q8,
            master: MasterWeights::None,
        };
        assert_eq!(compact.to_string(), "moments 8bit, master none");
    }
}

//! [`SaveDtype`], the dtype a checkpoint's model files are stored in
//! (`--save-dtype`): the source model's by default, so a BF16 model comes
//! back as BF16. Optimizer state and F32 masters are always F32.

use crate::backend::tensor::DType;
use crate::error::{Error, Result};
use safetensors::tensor::Dtype as StDtype;

/// The dtype the weights of a checkpoint's HF model files are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SaveDtype {
    /// 4 bytes a value; what training computes in on the CPU.
    F32,
    /// 2 bytes a value, rounded to nearest even (the models published today).
    #[default]
    BF16,
    /// IEEE half precision, 2 bytes a value.
    F16,
}

impl SaveDtype {
    /// The names `--save-dtype` takes, as messages list them.
    pub const NAMES: &'static str = "f32, bf16 or fp16";

    /// Bytes of one stored value.
    pub fn size(self) -> usize {
        match self {
            SaveDtype::F32 => 4,
            SaveDtype::BF16 | SaveDtype::F16 => 2,
        }
    }

    /// Its name in a `config.json` (`torch_dtype`/`dtype`).
    pub fn hf_name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "float32",
            SaveDtype::BF16 => "bfloat16",
            SaveDtype::F16 => "float16",
        }
    }

    /// Its safetensors dtype.
    pub fn safetensors(self) -> StDtype {
        match self {
            SaveDtype::F32 => StDtype::F32,
            SaveDtype::BF16 => StDtype::BF16,
            SaveDtype::F16 => StDtype::F16,
        }
    }

    /// The dtype of a safetensors header entry or a `config.json` name,
    /// if it is one of these.
    pub fn from_name(name: &str) -> Option<SaveDtype> {
        match name {
            "F32" | "float32" => Some(SaveDtype::F32),
            "BF16" | "bfloat16" => Some(SaveDtype::BF16),
            "F16" | "float16" => Some(SaveDtype::F16),
            _ => None,
        }
    }
}

impl From<DType> for SaveDtype {
    fn from(d: DType) -> SaveDtype {
        match d {
            DType::F32 => SaveDtype::F32,
            DType::BF16 => SaveDtype::BF16,
            // 8-bit codes read back as their values are exact in F32
            DType::U8 => SaveDtype::F32,
            // FP8 values read back are exact in F32
            DType::F8E4M3 | DType::F8E5M2 => SaveDtype::F32,
        }
    }
}

impl std::str::FromStr for SaveDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<SaveDtype> {
        match s {
            "f32" | "float32" => Ok(SaveDtype::F32),
            "bf16" | "bfloat16" => Ok(SaveDtype::BF16),
            "fp16" | "f16" | "float16" => Ok(SaveDtype::F16),
            other => Err(Error::Config(format!(
                "--save-dtype {other}: use {} (or auto: the dtype of --init-from's model, \
                 bf16 without one)",
                SaveDtype::NAMES
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_ones_name_the_flag() {
        assert_eq!("bf16".parse::<SaveDtype>().unwrap(), SaveDtype::BF16);
        assert_eq!("fp16".parse::<SaveDtype>().unwrap(), SaveDtype::F16);
        assert_eq!("f32".parse::<SaveDtype>().unwrap(), SaveDtype::F32);
        let e = "int8".parse::<SaveDtype>().unwrap_err().to_string();
        assert!(
            e.contains("--save-dtype int8") && e.contains("f32, bf16 or fp16"),
            "{e}"
        );
        for d in [SaveDtype::F32, SaveDtype::BF16, SaveDtype::F16] {
            assert_eq!(SaveDtype::from_name(d.hf_name()), Some(d));
        }
    }
}

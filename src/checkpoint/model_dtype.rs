//! The dtype a model directory came in ([`SaveDtype::of_model_dir`]): what
//! its `config.json` names, else what its weight files hold.

use super::peft_config::ADAPTER_WEIGHTS;
use super::ranged::{RangedFile, RangedModel};
use super::save_dtype::SaveDtype;
use super::train_state::is_adapter_only;
use crate::error::Result;
use serde_json::Value;
use std::path::Path;

impl SaveDtype {
    /// The dtype the model of an HF directory came in: its `config.json`'s
    /// `dtype` (`torch_dtype` before transformers 5), else the dtype of the
    /// first tensor of its weight files; `None` when neither says.
    pub fn of_model_dir(dir: &Path) -> Result<Option<SaveDtype>> {
        if let Ok(text) = std::fs::read_to_string(dir.join("config.json")) {
            let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let named = ["dtype", "torch_dtype"]
                .iter()
                .find_map(|k| value.get(k).and_then(Value::as_str))
                .and_then(SaveDtype::from_name);
            if named.is_some() {
                return Ok(named);
            }
        }
        // a LoRA checkpoint: the dtype its adapter was saved in
        if is_adapter_only(dir) {
            let file = RangedFile::open(&dir.join(ADAPTER_WEIGHTS))?;
            return Ok(file.first_dtype().and_then(SaveDtype::from_name));
        }
        let model = RangedModel::open(dir)?;
        Ok(model.first_dtype().and_then(SaveDtype::from_name))
    }
}

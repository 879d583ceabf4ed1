//! `upipe eval`.

use crate::error::{Error, Result};

#[derive(clap::Args, Debug)]
pub struct EvalArgs {}

pub fn run(_args: EvalArgs) -> Result<i32> {
    Err(Error::Config("upipe eval is not built yet".into()))
}

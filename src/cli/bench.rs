//! `upipe bench`.

use crate::error::{Error, Result};

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// One attention layer forward+backward under each strategy.
    Attn,
}

pub fn run(_cmd: BenchCommand) -> Result<i32> {
    Err(Error::Config("upipe bench is not built yet".into()))
}

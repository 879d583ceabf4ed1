//! `upipe launch`: one process per local rank.

use crate::error::{Error, Result};

#[derive(clap::Args, Debug)]
pub struct LaunchArgs {}

pub fn run(_args: LaunchArgs) -> Result<i32> {
    Err(Error::Config("upipe launch is not built yet".into()))
}

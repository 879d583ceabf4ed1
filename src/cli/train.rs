//! `upipe train`.

use crate::error::{Error, Result};

#[derive(clap::Args, Debug)]
pub struct TrainArgs {}

pub fn run(_args: TrainArgs) -> Result<i32> {
    Err(Error::Config("upipe train is not built yet".into()))
}

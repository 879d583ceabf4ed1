//! `upipe plan`.

use crate::error::{Error, Result};

#[derive(clap::Args, Debug)]
pub struct PlanArgs {}

pub fn run(_args: PlanArgs) -> Result<i32> {
    Err(Error::Config("upipe plan is not built yet".into()))
}

//! `upipe info`: devices and GPU libraries.

use crate::error::Result;

#[derive(clap::Args, Debug)]
pub struct InfoArgs {}

pub fn run(_args: InfoArgs) -> Result<i32> {
    println!("upipe {}", env!("CARGO_PKG_VERSION"));
    println!("cpu backend: f32 reference, {} threads", rayon::current_num_threads());
    println!("CUDA: not available (this build has no CUDA backend yet)");
    Ok(0)
}

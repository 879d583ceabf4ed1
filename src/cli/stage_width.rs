//! How wide UPipe's stages are, as `train`, `plan`, `eval` and `bench`
//! take it: `auto` or a number of heads (`--chunk-heads`,
//! `--fwd-chunk-heads`), with its text form for flags and run files.

use crate::error::Result;
use std::fmt;
use std::str::FromStr;

/// `--chunk-heads`: UPipe's heads per (backward) stage U, a number or, on
/// `train` and `plan`, `auto` (their default): the widest stages whose
/// predicted peak fits each rank's memory beside what the run already decided
/// (offload, kept attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkHeads {
    Auto,
    Heads(usize),
}

impl ChunkHeads {
    /// The fixed U of `chunk` for a subcommand that cannot choose one
    /// (`None`: U = Pu); `auto` is an error naming `train`.
    pub fn fixed(chunk: Option<ChunkHeads>, command: &str) -> Result<Option<usize>> {
        match chunk {
            Some(ChunkHeads::Heads(n)) => Ok(Some(n)),
            None => Ok(None),
            Some(ChunkHeads::Auto) => crate::config_err!(
                "--chunk-heads auto is chosen by `upipe train` from the memory it has \
                 (`upipe plan` shows its pick); `upipe {command}` needs a number \
                 (default: the Ulysses degree)"
            ),
        }
    }

    /// The U a run starts from: the number, or for `auto` (and by default) Pu.
    pub fn start(chunk: Option<ChunkHeads>) -> Option<usize> {
        match chunk {
            Some(ChunkHeads::Heads(n)) => Some(n),
            _ => None,
        }
    }
}

/// `--fwd-chunk-heads`: `auto` or a number of heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FwdChunk {
    /// The widest forward stages that keep the planned peak
    /// ([`crate::plan::widest_free_forward`]).
    Auto,
    Heads(usize),
}

/// `Display` and `FromStr` of a flag that is `auto` or a number of heads.
macro_rules! auto_or_heads_text {
    ($($t:ident),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    $t::Auto => f.write_str("auto"),
                    $t::Heads(n) => write!(f, "{n}"),
                }
            }
        }

        impl FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s {
                    "auto" => Ok($t::Auto),
                    n => n
                        .parse()
                        .map($t::Heads)
                        .map_err(|_| format!("{s}: use auto or a number of heads")),
                }
            }
        }
    )*};
}

auto_or_heads_text!(ChunkHeads, FwdChunk);

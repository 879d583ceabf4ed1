//! Library error type. Every failure a user can cause is an `Error` whose
//! message names the fix; panics are reserved for broken internal invariants.

use thiserror::Error;

/// Errors returned by the upipe library.
#[derive(Debug, Error)]
pub enum Error {
    /// A configuration or input the user chose cannot work; the message names a valid alternative.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A backend (device, driver, library) failure.
    #[error("backend error: {0}")]
    Backend(String),
    /// A CUDA library that was looked for could not be found or loaded.
    #[error("CUDA library not available: {0}")]
    LibraryMissing(String),
    /// A device allocation could not be satisfied.
    #[error(
        "out of memory on {device}: asked for {requested} bytes with {in_use} bytes in use ({by_category}){device_state}; \
         try a shorter sequence, a smaller --chunk-heads, or --offload"
    )]
    OutOfMemory {
        device: String,
        requested: usize,
        in_use: usize,
        by_category: String,
        /// What the device's allocator held when it failed (empty where it
        /// has nothing to add): e.g. `; the pool held 78.10 GiB for 77.95
        /// GiB in use, the driver 0.05 GiB free`.
        device_state: String,
    },
    /// A collective or rendezvous failed.
    #[error("communication error: {0}")]
    Comm(String),
    /// A weights or checkpoint file is malformed or does not match the model.
    #[error("checkpoint error: {0}")]
    Checkpoint(String),
    /// Training stopped at a step whose loss or gradient norm is not
    /// finite; the message names the step, the last checkpoint and the causes.
    #[error("training diverged: {0}")]
    Diverged(String),
    /// Filesystem or socket failure.
    #[error("I/O error: {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// Library result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// A thread for `what` could not be started (the process or the
    /// machine ran out of threads, processes or memory): names the fix.
    pub fn thread_spawn(what: impl std::fmt::Display, source: std::io::Error) -> Self {
        Error::Config(format!(
            "cannot start a thread for {what}: {source}; this machine's thread/process limits \
             are reached: run fewer ranks, stop other processes, or raise the limits \
             (`ulimit -u`, `ulimit -v`, kernel.pid_max, kernel.threads-max)"
        ))
    }
}

/// Shorthand for `Err(Error::Config(..))` with `format!` arguments.
#[macro_export]
macro_rules! config_err {
    ($($arg:tt)*) => { Err($crate::error::Error::Config(format!($($arg)*))) };
}

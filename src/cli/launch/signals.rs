//! The few process-signal operations the launcher needs, through the C
//! library that std already links (no extra crate): noting SIGINT/SIGTERM/
//! SIGHUP sent to the launcher, signalling children, and asking the kernel to
//! terminate a child when the launcher dies.

use std::sync::atomic::{AtomicI32, Ordering};

/// The last stop signal received by the launcher; 0 while none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// Signal numbers (identical on Linux and macOS).
pub const SIGHUP: i32 = 1;
pub const SIGINT: i32 = 2;
pub const SIGKILL: i32 = 9;
pub const SIGTERM: i32 = 15;

#[cfg(unix)]
mod ffi {
    use std::ffi::c_int;

    unsafe extern "C" {
        pub fn signal(signum: c_int, handler: usize) -> usize;
        pub fn kill(pid: i32, signum: c_int) -> c_int;
    }

    #[cfg(target_os = "linux")]
    unsafe extern "C" {
        pub fn prctl(option: c_int, ...) -> c_int;
        pub fn getppid() -> i32;
    }
}

/// Async-signal-safe handler: only records the signal.
#[cfg(unix)]
extern "C" fn note_signal(signum: std::ffi::c_int) {
    RECEIVED.store(signum, Ordering::SeqCst);
}

/// Routes SIGINT, SIGTERM and SIGHUP to [`received`] instead of killing the
/// launcher, so it can stop its children first.
pub fn install_stop_handlers() {
    #[cfg(unix)]
    for signum in [SIGINT, SIGTERM, SIGHUP] {
        let handler: extern "C" fn(std::ffi::c_int) = note_signal;
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            ffi::signal(signum, handler as usize);
        }
    }
}

/// The stop signal received so far, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        signum => Some(signum),
    }
}

/// Sends `signum` to process `pid`; false if it could not be delivered.
pub fn send(pid: u32, signum: i32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = i32::try_from(pid) else {
            return false;
        };
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { ffi::kill(pid, signum) == 0 }
    }
    #[cfg(not(unix))]
    {
        let _ = (pid, signum);
        false
    }
}

/// Makes `command`'s process receive SIGTERM when the launcher dies, even by
/// SIGKILL (Linux only; elsewhere a no-op).
pub fn terminate_with_parent(command: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        const PR_SET_PDEATHSIG: std::ffi::c_int = 1;
        let parent = i32::try_from(std::process::id()).unwrap_or(-1);
        // SAFETY: the closure runs between fork and exec and only calls
        // prctl and getppid, which are async-signal-safe, and builds its
        // errors from OS codes without allocating.
        unsafe {
            command.pre_exec(move || {
                if ffi::prctl(PR_SET_PDEATHSIG, SIGTERM as std::ffi::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died before prctl took effect.
                if ffi::getppid() != parent {
                    const ESRCH: i32 = 3;
                    return Err(std::io::Error::from_raw_os_error(ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

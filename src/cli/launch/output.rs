//! Forwarding a child's output line by line with a `[rank R] ` prefix.

use std::io::{BufRead, BufReader, Read, Write};
use std::thread::JoinHandle;

/// Which of the launcher's streams a child stream goes to.
#[derive(Clone, Copy, Debug)]
pub enum Sink {
    Stdout,
    Stderr,
}

/// Copies `source` to `sink` on a new thread of `stack` bytes of stack,
/// prefixing each line with `[rank R] ` (when `prefix`). Whole lines are
/// written under the sink's lock, so lines of different ranks never
/// interleave. Write failures (closed terminal) are ignored while the source
/// is still drained, so the child never blocks. Fails (and `source` is
/// dropped) when the thread cannot be started.
pub fn forward(
    rank: usize,
    source: impl Read + Send + 'static,
    sink: Sink,
    prefix: bool,
    stack: usize,
) -> std::io::Result<JoinHandle<()>> {
    let thread = std::thread::Builder::new()
        .name(format!("rank {rank} {sink:?}"))
        .stack_size(stack);
    thread.spawn(move || {
        let prefix = if prefix {
            format!("[rank {rank}] ")
        } else {
            String::new()
        };
        let mut reader = BufReader::new(source);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let _ = write_line(sink, prefix.as_bytes(), &line);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    })
}

fn write_line(sink: Sink, prefix: &[u8], line: &[u8]) -> std::io::Result<()> {
    fn emit(mut out: impl Write, prefix: &[u8], line: &[u8]) -> std::io::Result<()> {
        out.write_all(prefix)?;
        out.write_all(line)?;
        out.flush()
    }
    match sink {
        Sink::Stdout => emit(std::io::stdout().lock(), prefix, line),
        Sink::Stderr => emit(std::io::stderr().lock(), prefix, line),
    }
}

//! Progress of long CLI work (`bench`, `lab all`) on a terminal: one line on stderr,
//! rewritten in place; nothing at all when stderr is piped or redirected, so logs and
//! captured output stay clean.

use std::io::{IsTerminal, Write};

/// A `[step/total] what` line on stderr, while stderr is a terminal.
pub struct Progress {
    total: usize,
    done: usize,
    shown: bool,
}

impl Progress {
    /// Progress over `total` steps; silent unless stderr is a terminal.
    pub fn new(total: usize) -> Self {
        Progress {
            total,
            done: 0,
            shown: std::io::stderr().is_terminal(),
        }
    }

    /// Says that the next step, `what`, is under way.
    pub fn step(&mut self, what: &str) {
        self.done += 1;
        if self.shown {
            let mut err = std::io::stderr().lock();
            // `\r` back to the line's start, `\x1b[2K` clears it.
            let _ = write!(err, "\r\x1b[2K[{}/{}] {what}", self.done, self.total);
            let _ = err.flush();
        }
    }

    /// Clears the line, so what is printed next starts clean.
    pub fn clear(&self) {
        if self.shown {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.clear();
    }
}

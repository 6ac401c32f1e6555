//! What kind of hold a request asks for: an exclusive lock (the mutex), a read or a write
//! hold of a read-write lock, or one permit of a counting semaphore.

use std::{fmt, num::NonZeroU32};

/// The kind of hold an [`AcquireRequest`](crate::spi::AcquireRequest) asks for and a
/// [`Grant`](crate::spi::Grant) carries.
///
/// The rules every backend keeps (the conformance suite checks them):
/// - [`LockKind::Exclusive`] and [`LockKind::Write`] exclude every hold of another owner
///   on the key, of any kind; [`LockKind::Read`] holds of different owners share the key.
/// - A writer waiting for the key blocks new readers (writer preference), those of its own
///   owner too, so a stream of readers cannot starve it; a reader that already reads
///   (re-entry) or writes (downgrade) is not blocked.
/// - An owner that writes may also read (downgrade: a separate hold, granted at once). An
///   owner that only reads and asks to write (or for a plain lock) is refused with
///   [`Error::WouldDeadlock`](crate::Error::WouldDeadlock): it would wait for itself.
/// - At most `limit` [`LockKind::Permit`] holds exist on a key at once. A permit is never
///   reentrant: every acquisition is a new permit with its own lease, token and loss signal.
/// - Every new hold of any kind takes a fresh fencing token from the key's one counter, so
///   tokens grow per key for writers and per permit.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LockKind {
    /// The plain lock: one holder (reentrant by owner). A mutex counts as a writer.
    #[default]
    Exclusive,
    /// A shared hold of a read-write lock.
    Read,
    /// The exclusive hold of a read-write lock.
    Write,
    /// One of at most `limit` permits of a counting semaphore.
    Permit {
        /// How many permits the semaphore has; every client of a key must agree on it.
        limit: NonZeroU32,
    },
}

impl LockKind {
    /// Whether holds of this kind are counted per owner (re-entry) rather than one per
    /// acquisition (permits).
    pub fn is_reentrant(self) -> bool {
        !matches!(self, LockKind::Permit { .. })
    }

    /// Whether a hold of this kind excludes every other owner (a mutex or a writer).
    pub fn is_exclusive(self) -> bool {
        matches!(self, LockKind::Exclusive | LockKind::Write)
    }

    /// The semaphore's permit count, for [`LockKind::Permit`].
    pub fn limit(self) -> Option<u32> {
        match self {
            LockKind::Permit { limit } => Some(limit.get()),
            _ => None,
        }
    }

    /// A short lower-case name: `lock`, `read`, `write`, `permit`.
    pub fn name(self) -> &'static str {
        match self {
            LockKind::Exclusive => "lock",
            LockKind::Read => "read",
            LockKind::Write => "write",
            LockKind::Permit { .. } => "permit",
        }
    }
}

impl fmt::Display for LockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockKind::Exclusive => f.write_str("an exclusive lock"),
            LockKind::Read => f.write_str("a read lock"),
            LockKind::Write => f.write_str("a write lock"),
            LockKind::Permit { limit } => write!(f, "a permit of a {limit}-permit semaphore"),
        }
    }
}

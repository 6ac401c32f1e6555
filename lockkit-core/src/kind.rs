//! What kind of hold a request asks for: an exclusive lock (the mutex), a read or a write
//! hold of a read-write lock, or one permit of a counting semaphore.

use std::{fmt, num::NonZeroU32};

use crate::{AcquireRequest, Error, OwnerId};

/// The kind of hold an [`AcquireRequest`](crate::spi::AcquireRequest) asks for and a
/// [`Grant`](crate::spi::Grant) carries.
///
/// The rules every backend keeps (the conformance suite checks them):
/// - [`LockKind::Exclusive`] and [`LockKind::Write`] exclude every hold of another owner
///   on the key, of any kind; [`LockKind::Read`] holds of different owners share the key.
/// - A writer waiting for the key blocks new readers of other owners (writer preference),
///   so a stream of readers cannot starve it; a reader that already reads (re-entry) or
///   writes (downgrade) is not blocked.
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

/// One live hold of a key, as [`admit`] sees it; `E` is the backend's expiry type.
pub(crate) struct HoldView<E> {
    pub(crate) owner: OwnerId,
    pub(crate) kind: LockKind,
    pub(crate) expires: E,
}

/// Why [`admit`] refused a request.
pub(crate) enum Refusal<E> {
    /// Held by others: try again when woken, or at the earliest end of a blocking lease
    /// (`None`: only a waiting writer blocks, and its going away wakes).
    Busy(Option<E>),
    /// Never grantable as asked (an upgrade, a change of kind).
    Refused(Error),
}

/// Whether a stored hold of `held` (owner, kind), whose acquisitions are `attempts`, is the
/// hold that `attempt` of `asked` asks for again: the owner's hold of that kind (a re-entry
/// or a retry), or, for a permit, which is never reentrant, only the permit that attempt
/// took.
pub(crate) fn same_hold(
    held: (OwnerId, LockKind),
    asked: (OwnerId, LockKind),
    attempts: &crate::AttemptLedger,
    attempt: uuid::Uuid,
) -> bool {
    held == asked && (held.1.is_reentrant() || attempts.has(attempt))
}

/// The rules of [`LockKind`] for a backend that sees every live hold of a key at once
/// (memory, file): may `req`, whose owner has no hold of `req.kind` on the key yet (that
/// would be a re-entry), be granted beside `holds`? `writer_waits`: a writer (or plain
/// locker) of any owner is waiting for the key: a new read of the writer's own owner waits
/// too, or that writer would wait for its own owner's read.
pub(crate) fn admit<E: Ord + Copy>(
    req: &AcquireRequest,
    holds: &[HoldView<E>],
    writer_waits: bool,
) -> Result<(), Refusal<E>> {
    let mine = |kind: LockKind| holds.iter().any(|h| h.owner == req.owner && h.kind == kind);
    let mismatch = |found: String| {
        Refusal::Refused(Error::KindMismatch {
            key: req.key.clone(),
            found,
            asked: req.kind,
        })
    };
    // What the key is used as, by anyone.
    match (req.kind, holds.first().map(|h| h.kind)) {
        (LockKind::Permit { limit }, Some(LockKind::Permit { limit: theirs }))
            if limit != theirs =>
        {
            return Err(mismatch(format!("is a semaphore of {theirs} permits")));
        }
        (LockKind::Permit { .. }, Some(other)) if !matches!(other, LockKind::Permit { .. }) => {
            return Err(mismatch(format!("is held as {other}")));
        }
        (asked, Some(LockKind::Permit { limit })) if !matches!(asked, LockKind::Permit { .. }) => {
            return Err(mismatch(format!("is a semaphore of {limit} permits")));
        }
        _ => {}
    }
    let earliest = |blocking: &mut dyn Iterator<Item = &HoldView<E>>| {
        Refusal::Busy(blocking.map(|h| h.expires).min())
    };
    match req.kind {
        LockKind::Write | LockKind::Exclusive if mine(LockKind::Read) && !mine(LockKind::Write) => {
            Err(Refusal::Refused(Error::WouldDeadlock {
                key: req.key.clone(),
                held: LockKind::Read,
                asked: req.kind,
            }))
        }
        LockKind::Write | LockKind::Read if mine(LockKind::Exclusive) => Err(mismatch(
            "is held by this owner as an exclusive lock".into(),
        )),
        LockKind::Exclusive if mine(LockKind::Write) => Err(mismatch(
            "is held by this owner as a read-write lock".into(),
        )),
        // A downgrade: the owner writes, so nobody else holds the key.
        LockKind::Read if mine(LockKind::Write) => Ok(()),
        LockKind::Read => {
            let mut writing = holds
                .iter()
                .filter(|h| h.owner != req.owner && h.kind.is_exclusive())
                .peekable();
            if writing.peek().is_some() {
                return Err(earliest(&mut writing));
            }
            if writer_waits {
                return Err(Refusal::Busy(None));
            }
            Ok(())
        }
        LockKind::Permit { limit } => {
            if holds.len() >= limit.get() as usize {
                return Err(earliest(&mut holds.iter()));
            }
            Ok(())
        }
        LockKind::Exclusive | LockKind::Write => {
            let mut others = holds.iter().filter(|h| h.owner != req.owner).peekable();
            if others.peek().is_some() {
                return Err(earliest(&mut others));
            }
            Ok(())
        }
    }
}

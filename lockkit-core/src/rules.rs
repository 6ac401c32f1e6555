//! The rules of [`LockKind`] for backends that see every live hold of a key at once (the
//! memory and file backends): who may hold beside whom.

use crate::{AcquireRequest, Error, LockKind, OwnerId};

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

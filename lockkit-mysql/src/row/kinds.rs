//! Read, write and permit holds in row mode: the rules of [`LockKind`] over the key's rows,
//! and the rows of `<table>_holds` (one per reader or writer and kind, one per permit, and
//! a short-lived `q` marker per waiting writer).
//!
//! Every change to a key's holds is made under the lock of the key's row in `<table>`
//! (the serialization point and the fencing counter), taken first; renewals only lengthen a
//! live hold and take no key lock.

use std::{
    num::NonZeroU32,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use lockkit_core::spi::{AcquireRequest, AttemptLedger};
use lockkit_core::{Error, FencingToken, HolderIdentity, HolderInfo, LockKey, LockKind, Result};
use sqlx::{Row, mysql::MySqlRow};

use crate::db::{Db, db_error, micros, query, row_text};

/// How long a waiting writer's marker keeps new readers out unless its wait renews it
/// (every poll of the wait does, and polls are at most a few hundred milliseconds apart):
/// a writer that dies while waiting blocks readers at most this long.
pub(super) const WRITER_MARKER: Duration = Duration::from_secs(3);

/// The one-letter kind stored in `<table>_holds.kind`.
pub(super) fn code(kind: LockKind) -> &'static str {
    match kind {
        LockKind::Read => "r",
        LockKind::Write => "w",
        LockKind::Permit { .. } => "p",
        // Plain locks live in `<table>` itself; never stored here.
        _ => "x",
    }
}

/// The `holder` column of `req`'s hold: the owner for reads and writes (one hold per owner
/// and kind, reentrant), the attempt for a permit (never reentrant: each acquisition is a
/// permit of its own, and its retry finds it by the attempt).
pub(super) fn holder_of(kind: LockKind, owner: &str, attempt: uuid::Uuid) -> String {
    match kind {
        LockKind::Permit { .. } if !attempt.is_nil() => attempt.simple().to_string(),
        _ => owner.to_owned(),
    }
}

/// One hold of a key as the rules see it: the mutex holder (as [`LockKind::Exclusive`]) or
/// a live row of `<table>_holds`.
#[derive(Debug, Clone)]
pub(super) struct HoldView {
    pub(super) kind: LockKind,
    pub(super) owner: String,
    /// Lease left; `None` when unknown (a for-update holder).
    pub(super) left: Option<Duration>,
}

/// What [`decide`] says of a request that is not a re-entry.
#[derive(Debug)]
pub(super) enum Verdict {
    /// Grant a new hold.
    Grant,
    /// Held by others: retry after at most this long (`None`: only a waiting writer blocks).
    Busy(Option<Duration>),
    /// Never grantable as asked.
    Refused(Error),
}

/// The rules of [`LockKind`] (those of `lockkit_core`'s memory and file backends): may
/// `req`, whose owner (`owner`, as stored) holds no hold of `req.kind` on the key yet, be
/// granted beside `holds` (every live hold)? `writer_waits`: a writer (or plain locker) of
/// any owner waits for the key, so a new read, of that writer's owner too, waits.
pub(super) fn decide(
    req: &AcquireRequest,
    owner: &str,
    holds: &[HoldView],
    writer_waits: bool,
) -> Verdict {
    let mine = |kind: LockKind| holds.iter().any(|h| h.owner == owner && h.kind == kind);
    let mismatch = |found: String| {
        Verdict::Refused(Error::KindMismatch {
            key: req.key.clone(),
            found,
            asked: req.kind,
        })
    };
    let permits = holds.iter().find_map(|h| h.kind.limit());
    // What the key is used as, by anyone.
    match (req.kind, permits) {
        (LockKind::Permit { limit }, Some(theirs)) if limit.get() != theirs => {
            return mismatch(format!("is a semaphore of {theirs} permits"));
        }
        (LockKind::Permit { .. }, None) => {
            if let Some(other) = holds.first() {
                return mismatch(format!("is held as {}", other.kind));
            }
        }
        (LockKind::Permit { .. }, Some(_)) => {}
        (_, Some(theirs)) => return mismatch(format!("is a semaphore of {theirs} permits")),
        (_, None) => {}
    }
    let earliest = |blocking: &mut dyn Iterator<Item = &HoldView>| {
        let lefts: Vec<Option<Duration>> = blocking.map(|h| h.left).collect();
        // An unknown lease (a for-update holder) is polled for; otherwise the earliest end.
        Verdict::Busy(if lefts.iter().any(Option::is_none) {
            None
        } else {
            lefts.into_iter().flatten().min()
        })
    };
    match req.kind {
        LockKind::Write | LockKind::Exclusive if mine(LockKind::Read) && !mine(LockKind::Write) => {
            Verdict::Refused(Error::WouldDeadlock {
                key: req.key.clone(),
                held: LockKind::Read,
                asked: req.kind,
            })
        }
        LockKind::Write | LockKind::Read if mine(LockKind::Exclusive) => {
            mismatch("is held by this owner as an exclusive lock".into())
        }
        LockKind::Exclusive if mine(LockKind::Write) => {
            mismatch("is held by this owner as a read-write lock".into())
        }
        // A downgrade: the owner writes, so nobody else holds the key.
        LockKind::Read if mine(LockKind::Write) => Verdict::Grant,
        LockKind::Read => {
            let mut writing = holds
                .iter()
                .filter(|h| h.owner != owner && h.kind.is_exclusive())
                .peekable();
            if writing.peek().is_some() {
                return earliest(&mut writing);
            }
            if writer_waits {
                return Verdict::Busy(None);
            }
            Verdict::Grant
        }
        LockKind::Permit { limit } => {
            if holds.len() >= usize::try_from(limit.get()).unwrap_or(usize::MAX) {
                return earliest(&mut holds.iter());
            }
            Verdict::Grant
        }
        _ => {
            let mut others = holds.iter().filter(|h| h.owner != owner).peekable();
            if others.peek().is_some() {
                return earliest(&mut others);
            }
            Verdict::Grant
        }
    }
}

/// One row of `<table>_holds` as an acquisition reads it (under the key's row lock).
#[derive(Debug)]
pub(super) struct HoldRow {
    pub(super) kind: String,
    pub(super) holder: String,
    pub(super) owner: String,
    pub(super) holds: u32,
    pub(super) token: u64,
    pub(super) permits: Option<u32>,
    pub(super) attempts: AttemptLedger,
    pub(super) live: bool,
    pub(super) left: Duration,
}

impl HoldRow {
    pub(super) fn parse(row: &MySqlRow) -> std::result::Result<HoldRow, sqlx::Error> {
        let left_us = row.try_get::<Option<i64>, _>("left_us").ok().flatten();
        Ok(HoldRow {
            kind: row.try_get("kind")?,
            holder: row.try_get("holder")?,
            owner: row.try_get("owner")?,
            holds: row.try_get("holds")?,
            token: row.try_get("token")?,
            permits: row.try_get("permits")?,
            attempts: AttemptLedger::parse(&row_text(row, "attempts").unwrap_or_default()),
            live: row.try_get::<Option<i64>, _>("live").ok().flatten() == Some(1),
            left: Duration::from_micros(left_us.and_then(|us| u64::try_from(us).ok()).unwrap_or(0)),
        })
    }

    /// The kind of hold the row is, `None` for a waiting writer's marker (or a kind this
    /// version does not know).
    pub(super) fn lock_kind(&self) -> Option<LockKind> {
        kind_of(&self.kind, self.permits)
    }
}

/// The [`LockKind`] of a stored kind letter (and permit count).
fn kind_of(code: &str, permits: Option<u32>) -> Option<LockKind> {
    match code {
        "r" => Some(LockKind::Read),
        "w" => Some(LockKind::Write),
        "p" => Some(LockKind::Permit {
            limit: permits.and_then(NonZeroU32::new).unwrap_or(NonZeroU32::MIN),
        }),
        _ => None,
    }
}

/// A waiting writer's marker, as its attempts and its caller know it.
#[derive(Debug, Clone, Default)]
pub(super) struct Marker {
    /// An attempt has written (or may write) the marker.
    marked: Arc<AtomicBool>,
    /// The wait is over: attempts still running must not write it.
    cancelled: Arc<AtomicBool>,
}

impl Marker {
    /// Called by an attempt holding the key's row lock, before it writes the marker:
    /// whether it still may. Either the attempt sees the wait is over (and writes nothing),
    /// or the caller, which sets `cancelled` before it reads `marked`, sees the mark and
    /// deletes it under the key's row lock, so after this attempt's commit.
    pub(super) fn may_mark(&self) -> bool {
        self.marked.store(true, Ordering::SeqCst);
        !self.cancelled.load(Ordering::SeqCst)
    }

    /// Whether an attempt of this wait has written (or may have written) the marker.
    pub(super) fn has_marked(&self) -> bool {
        self.marked.load(Ordering::SeqCst)
    }

    /// The wait ended in a grant, whose transaction deleted the marker.
    pub(super) fn granted(&self) {
        self.marked.store(false, Ordering::SeqCst);
    }

    /// The wait is over: whether a marker may have been written that must go.
    fn end(&self) -> bool {
        self.cancelled.store(true, Ordering::SeqCst);
        self.marked.load(Ordering::SeqCst)
    }
}

/// Deletes a waiting writer's marker when its wait ends without a grant (dropped, timed
/// out, refused), in the background, so readers are let in at once rather than when the
/// marker's lease runs out.
pub(super) struct WriterMark {
    pub(super) db: Arc<Db>,
    pub(super) key: LockKey,
    pub(super) owner: String,
    pub(super) marker: Marker,
}

impl Drop for WriterMark {
    fn drop(&mut self) {
        if !self.marker.end() {
            return;
        }
        let (db, key, owner) = (self.db.clone(), self.key.clone(), self.owner.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for _ in 0..3 {
                    match unmark(&db, &key, &owner).await {
                        Ok(()) => return,
                        Err(error) => {
                            tracing::debug!(%error, %key, "removing a waiting writer's marker failed; retrying");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
                tracing::warn!(%key, "could not remove a waiting writer's marker; it runs out by itself within {WRITER_MARKER:?}");
            });
        }
    }
}

/// Deletes `owner`'s marker on `key`, under the key's row lock (after any attempt that is
/// writing it has committed).
async fn unmark(db: &Db, key: &LockKey, owner: &str) -> Result<()> {
    let name = key.as_str().as_bytes();
    let fail = |e| db.fail("removing a waiting writer's marker", e);
    let mut tx = db.begin().await.map_err(fail)?;
    query(&db.sql.row_select_for_update)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    query(&db.sql.marker_delete)
        .bind(name)
        .bind(owner)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    tx.commit().await.map_err(fail)
}

/// Every live read, write and permit hold of `key`: the writer first, then by token.
pub(super) async fn live_holders(db: &Db, key: &LockKey) -> Result<Vec<HolderInfo>> {
    let rows = db
        .retry_gone(|| {
            query(&db.sql.holds_live)
                .bind(key.as_str().as_bytes().to_vec())
                .fetch_all(&db.pool)
        })
        .await
        .map_err(|e| db.fail("listing the holders", e))?;
    let mut holders = Vec::with_capacity(rows.len());
    for row in &rows {
        let fail = |e| db_error("reading a holder", e);
        let code: String = row.try_get("kind").map_err(fail)?;
        let Some(kind) = kind_of(&code, row.try_get("permits").map_err(fail)?) else {
            continue;
        };
        let owner: String = row.try_get("owner").map_err(fail)?;
        let left = row
            .try_get::<Option<i64>, _>("left_us")
            .map_err(fail)?
            .and_then(|us| u64::try_from(us).ok())
            .map(Duration::from_micros);
        let identity =
            row_text(row, "identity").and_then(|text| HolderIdentity::decode_for(&text, &owner));
        holders.push(
            HolderInfo::new(
                owner,
                row.try_get("holds").map_err(fail)?,
                Some(FencingToken::new(row.try_get("token").map_err(fail)?)),
                left,
            )
            .with_identity(identity)
            .with_kind(kind),
        );
    }
    Ok(holders)
}

/// The lease of a read, write or permit hold (`ttl` from now, never shorter): `false` when
/// the hold is not there or not live any more.
pub(super) async fn renew(
    db: &Db,
    grant: &lockkit_core::spi::Grant,
    ttl: Duration,
) -> Result<bool> {
    let owner = grant.owner.to_string();
    // (Sent again on a dead connection: a renewal repeated changes nothing more.)
    let done = db
        .retry_gone(|| {
            query(&db.sql.holds_renew)
                .bind(micros(ttl))
                .bind(grant.key.as_str().as_bytes().to_vec())
                .bind(code(grant.kind))
                .bind(holder_of(grant.kind, &owner, grant.attempt))
                .execute(&db.pool)
        })
        .await
        .map_err(|e| db.fail("renewing the lease", e))?;
    Ok(done.rows_affected() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockkit_core::{LossSignal, OwnerId};

    fn req(kind: LockKind, owner: OwnerId) -> AcquireRequest {
        AcquireRequest::new(
            LockKey::new("k").unwrap(),
            owner,
            Duration::from_secs(1),
            LossSignal::new(),
        )
        .with_kind(kind)
    }

    fn hold(kind: LockKind, owner: OwnerId) -> HoldView {
        HoldView {
            kind,
            owner: owner.to_string(),
            left: Some(Duration::from_secs(5)),
        }
    }

    fn three() -> LockKind {
        LockKind::Permit {
            limit: NonZeroU32::new(3).unwrap(),
        }
    }

    fn verdict(kind: LockKind, me: OwnerId, holds: &[HoldView], waits: bool) -> String {
        match decide(&req(kind, me), &me.to_string(), holds, waits) {
            Verdict::Grant => "grant".into(),
            Verdict::Busy(_) => "busy".into(),
            Verdict::Refused(Error::WouldDeadlock { .. }) => "deadlock".into(),
            Verdict::Refused(Error::KindMismatch { .. }) => "mismatch".into(),
            Verdict::Refused(other) => format!("{other}"),
        }
    }

    /// The rules of `LockKind`, as lockkit-core's `admit` keeps them.
    #[test]
    fn decides_as_the_reference_rules() {
        let (me, other) = (OwnerId::random(), OwnerId::random());
        let (r, w, x) = (LockKind::Read, LockKind::Write, LockKind::Exclusive);
        let cases: &[(LockKind, &[HoldView], bool, &str)] = &[
            (r, &[], false, "grant"),
            (r, &[hold(r, other)], false, "grant"),
            (r, &[hold(r, other)], true, "busy"),
            (r, &[hold(w, other)], false, "busy"),
            (r, &[hold(x, other)], false, "busy"),
            (r, &[hold(w, me)], true, "grant"),
            (r, &[hold(x, me)], false, "mismatch"),
            (w, &[hold(r, me)], false, "deadlock"),
            (x, &[hold(r, me)], false, "deadlock"),
            (w, &[hold(r, me), hold(w, me)], false, "grant"),
            (w, &[hold(r, other)], false, "busy"),
            (w, &[hold(x, me)], false, "mismatch"),
            (x, &[hold(w, me)], false, "mismatch"),
            (x, &[hold(r, other)], false, "busy"),
            (w, &[], true, "grant"),
            (
                three(),
                &[hold(three(), other), hold(three(), other)],
                false,
                "grant",
            ),
            (
                three(),
                &[
                    hold(three(), other),
                    hold(three(), me),
                    hold(three(), other),
                ],
                false,
                "busy",
            ),
            (
                LockKind::Permit {
                    limit: NonZeroU32::MIN,
                },
                &[hold(three(), other)],
                false,
                "mismatch",
            ),
            (three(), &[hold(r, other)], false, "mismatch"),
            (three(), &[hold(x, other)], false, "mismatch"),
            (x, &[hold(three(), other)], false, "mismatch"),
            (r, &[hold(three(), other)], false, "mismatch"),
        ];
        for (kind, holds, waits, expected) in cases {
            assert_eq!(
                verdict(*kind, me, holds, *waits),
                *expected,
                "{kind:?} beside {holds:?} (writer waits: {waits})"
            );
        }
    }

    #[test]
    fn a_permit_is_named_by_its_attempt_and_a_read_by_its_owner() {
        let attempt = uuid::Uuid::new_v4();
        assert_eq!(
            holder_of(three(), "o:1", attempt),
            attempt.simple().to_string()
        );
        assert_eq!(holder_of(LockKind::Read, "o:1", attempt), "o:1");
        assert_eq!(holder_of(three(), "o:1", uuid::Uuid::nil()), "o:1");
    }
}

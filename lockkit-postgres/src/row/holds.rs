//! mode=row, read-write locks and semaphores: one row of `<table>_holds` per read or write
//! hold (per owner, reentrant), per permit (per acquisition, never reentrant) and per
//! waiting writer's marker (per wait).
//!
//! Every decision over a key's holds is made under the lock of the key's row in the main
//! table (`SELECT ... FOR UPDATE`), the same row the plain lock lives in, and reads the
//! holds in a statement of its own after that lock is held (a statement that waited for the
//! row lock would still see the holds as of its start). So a plain lock, a read-write lock
//! and a semaphore on one key exclude each other, and every new hold takes its token from
//! the key's one `fence`. Releases, renewals and markers' removals lock only their own rows
//! (after the key's row, where they take it): no two transactions wait for each other in
//! opposite orders.
//!
//! The rules are those of [`LockKind`]. A waiting writer (or a plain locker waiting where
//! readers hold) leaves a marker with a lease of [`MARKER_LEASE`], renewed by each of its
//! retries (at least every [`MARKER_REFRESH`]): while one is live, new reads of every owner
//! wait (re-entries and downgrades do not). A wait that ends without a grant removes its
//! marker and announces that, as every full release is announced, so readers kept out
//! retry at once.

use std::{
    num::NonZeroU32,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use lockkit_core::spi::{AcquireRequest, Attempt, AttemptLedger, Grant, Interrupt, Released};
use lockkit_core::{Error, FencingToken, HolderIdentity, HolderInfo, LockKey, LockKind, Result};
use sqlx::{PgConnection, Postgres, Row, Transaction, postgres::PgRow};
use tokio::time::Instant;

use super::{ADVISORY_RECHECK, RowLocks, announce_release, caller_gone, first_attempt};
use crate::db::{Db, micros, query};

/// How long a waiting writer's marker keeps new readers out unless its wait renews it: a
/// writer that dies while waiting keeps readers out at most this long.
pub(crate) const MARKER_LEASE: Duration = Duration::from_secs(3);

/// The longest a waiting writer sleeps between retries, each of which renews its marker.
pub(crate) const MARKER_REFRESH: Duration = Duration::from_secs(1);

/// The `kind` column's code of a kind of hold (`x`, the plain lock, is never stored here).
fn code(kind: LockKind) -> &'static str {
    match kind {
        LockKind::Read => "r",
        LockKind::Write => "w",
        LockKind::Permit { .. } => "p",
        _ => "x",
    }
}

/// The `holder` column of a hold of `kind` by `owner` taken by `attempt`: the owner for
/// reentrant holds, the attempt for a permit (never reentrant, so a retried attempt finds
/// its own permit and nothing else).
fn holder_of(kind: LockKind, owner: &str, attempt: impl std::fmt::Display) -> String {
    if kind.is_reentrant() {
        owner.to_owned()
    } else {
        attempt.to_string()
    }
}

/// The plain lock of the key, when it is live: its owner (`None`: an advisory lock held by
/// a session with no record) and lease left (`None`: not known, an advisory hold).
#[derive(Debug, Clone)]
pub(crate) struct Plain {
    pub(crate) owner: Option<String>,
    pub(crate) left: Option<Duration>,
}

/// One live row of the holds table, as a decision sees it.
#[derive(Debug, Clone)]
pub(crate) struct HoldRow {
    kind: String,
    holder: String,
    owner: String,
    holds: u32,
    token: u64,
    attempts: String,
    permits: Option<u32>,
    left: Duration,
}

impl HoldRow {
    /// The row and whether its lease is still running.
    fn read(row: &PgRow) -> std::result::Result<(HoldRow, bool), sqlx::Error> {
        let left_us: Option<i64> = row.try_get("left_us")?;
        let left_us = left_us.unwrap_or(0);
        let hold = HoldRow {
            kind: row.try_get("kind")?,
            holder: row.try_get("holder")?,
            owner: row.try_get("owner")?,
            holds: u32::try_from(row.try_get::<i32, _>("holds")?).unwrap_or(0),
            token: u64::try_from(row.try_get::<i64, _>("token")?).unwrap_or(0),
            attempts: row
                .try_get::<Option<String>, _>("attempts")?
                .unwrap_or_default(),
            permits: row
                .try_get::<Option<i32>, _>("permits")?
                .and_then(|p| u32::try_from(p).ok()),
            left: Duration::from_micros(u64::try_from(left_us).unwrap_or(0)),
        };
        Ok((hold, left_us > 0))
    }
}

/// What the rules say about a request, given the key's live plain lock and holds.
#[derive(Debug)]
pub(crate) enum Decision {
    /// The request's own hold, at this index: a re-entry, or the retry of an attempt that
    /// took effect.
    Again(usize),
    /// A new hold may be granted.
    New,
    /// Held against the request: retry after `left` (or when woken); `mark`: a writer that
    /// waits leaves its marker.
    Busy { left: Duration, mark: bool },
    /// Never grantable as asked.
    Refused(Error),
}

/// The earliest of leases (an unknown one counts as [`ADVISORY_RECHECK`]).
fn earliest(leases: impl Iterator<Item = Option<Duration>>) -> Option<Duration> {
    leases.map(|left| left.unwrap_or(ADVISORY_RECHECK)).min()
}

/// The rules of [`LockKind`] over one key: `plain` is its live plain lock (not asked for
/// by `req` as a re-entry: that is the plain lock's own path), `holds` its live rows.
pub(crate) fn decide(req: &AcquireRequest, plain: Option<&Plain>, holds: &[HoldRow]) -> Decision {
    let me = req.owner.to_string();
    let asked = code(req.kind);
    let holder = holder_of(req.kind, &me, req.attempt);
    if let Some(at) = holds
        .iter()
        .position(|h| h.kind == asked && h.holder == holder)
    {
        return Decision::Again(at);
    }
    let mismatch = |found: String| {
        Decision::Refused(Error::KindMismatch {
            key: req.key.clone(),
            found,
            asked: req.kind,
        })
    };
    // What the key is used as, by anyone.
    let permits = holds
        .iter()
        .find(|h| h.kind == "p")
        .map(|h| h.permits.unwrap_or(0));
    let other_use = holds
        .iter()
        .find_map(|h| match h.kind.as_str() {
            "r" => Some(LockKind::Read),
            "w" => Some(LockKind::Write),
            _ => None,
        })
        // A plain lock of row mode or advisory mode with its record; an advisory lock
        // without one (another client's) only blocks: what it is used as is not known.
        .or(plain
            .filter(|p| p.owner.is_some())
            .map(|_| LockKind::Exclusive));
    match (req.kind, permits, other_use) {
        (LockKind::Permit { limit }, Some(theirs), _) if limit.get() != theirs => {
            return mismatch(format!("is a semaphore of {theirs} permits"));
        }
        (LockKind::Permit { .. }, _, Some(other)) => {
            return mismatch(format!("is held as {other}"));
        }
        (asked, Some(theirs), _) if !matches!(asked, LockKind::Permit { .. }) => {
            return mismatch(format!("is a semaphore of {theirs} permits"));
        }
        _ => {}
    }
    let mine = |code: &str| holds.iter().any(|h| h.kind == code && h.owner == me);
    let plain_mine = plain.is_some_and(|p| p.owner.as_deref() == Some(me.as_str()));
    let plain_other = plain.filter(|_| !plain_mine);
    match req.kind {
        LockKind::Write | LockKind::Exclusive if mine("r") && !mine("w") => {
            Decision::Refused(Error::WouldDeadlock {
                key: req.key.clone(),
                held: LockKind::Read,
                asked: req.kind,
            })
        }
        LockKind::Write | LockKind::Read if plain_mine => {
            mismatch("is held by this owner as an exclusive lock".into())
        }
        LockKind::Exclusive if mine("w") => {
            mismatch("is held by this owner as a read-write lock".into())
        }
        // A downgrade: the owner writes, so nobody else holds the key.
        LockKind::Read if mine("w") => Decision::New,
        LockKind::Read => {
            let writing = plain_other.map(|p| p.left).into_iter().chain(
                holds
                    .iter()
                    .filter(|h| h.kind == "w" && h.owner != me)
                    .map(|h| Some(h.left)),
            );
            if let Some(left) = earliest(writing) {
                return Decision::Busy { left, mark: false };
            }
            // A writer waits (of any owner, this one's too: it would wait for this read).
            let markers = holds.iter().filter(|h| h.kind == "q").map(|h| Some(h.left));
            if let Some(left) = earliest(markers) {
                return Decision::Busy { left, mark: false };
            }
            Decision::New
        }
        LockKind::Permit { limit } => {
            if let Some(left) = earliest(plain_other.map(|p| p.left).into_iter()) {
                return Decision::Busy { left, mark: false };
            }
            let out = holds.iter().filter(|h| h.kind == "p");
            let full = out.clone().count() >= usize::try_from(limit.get()).unwrap_or(usize::MAX);
            match earliest(out.map(|h| Some(h.left))) {
                Some(left) if full => Decision::Busy { left, mark: false },
                _ => Decision::New,
            }
        }
        // A writer or a plain locker: nobody else may hold the key, of any kind.
        _ => {
            let others = plain_other.map(|p| p.left).into_iter().chain(
                holds
                    .iter()
                    .filter(|h| h.kind != "q" && h.owner != me)
                    .map(|h| Some(h.left)),
            );
            match earliest(others) {
                Some(left) => Decision::Busy {
                    // A plain locker marks only where readers come: behind another writer
                    // readers are kept out anyway.
                    left,
                    mark: req.kind == LockKind::Write || holds.iter().any(|h| h.kind == "r"),
                },
                None => Decision::New,
            }
        }
    }
}

/// The key's live holds and markers, locked until the transaction ends; the rows whose
/// lease is over are deleted. Run after the key's row is locked, as a statement of its own.
pub(crate) async fn live_holds(
    inner: &Db,
    conn: &mut PgConnection,
    name: &[u8],
) -> std::result::Result<Vec<HoldRow>, sqlx::Error> {
    let rows = query(&inner.sql.holds.lock_all)
        .bind(name)
        .fetch_all(&mut *conn)
        .await?;
    let mut live = Vec::with_capacity(rows.len());
    let mut over = false;
    for row in &rows {
        let (hold, running) = HoldRow::read(row)?;
        if running {
            live.push(hold);
        } else {
            over = true;
        }
    }
    if over {
        query(&inner.sql.holds.prune)
            .bind(name)
            .execute(&mut *conn)
            .await?;
    }
    Ok(live)
}

/// A waiting writer's marker, as its attempts and its caller know it (see [`WriterMark`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Marker {
    /// An attempt has written (or may write) the marker.
    marked: Arc<AtomicBool>,
    /// The wait is over: attempts still running must not write it.
    cancelled: Arc<AtomicBool>,
}

impl Marker {
    /// Whether an attempt of the wait has written (or may have written) the marker.
    pub(crate) fn is_marked(&self) -> bool {
        self.marked.load(Ordering::SeqCst)
    }
}

/// Ends a refused acquisition: a writer that waits (`marker`) and `mark`s leaves its
/// marker, and retries within [`MARKER_REFRESH`] to renew it; what was pruned is kept.
pub(crate) async fn busy(
    inner: &Db,
    mut tx: Transaction<'static, Postgres>,
    req: &AcquireRequest,
    left: Duration,
    mark: bool,
    marker: Option<&Marker>,
) -> Result<Attempt> {
    let fail = |e| inner.error("the acquire transaction", e);
    if let Some(marker) = marker.filter(|_| mark) {
        // Said before the caller's flag is read, and the caller sets its flag before it
        // reads this one: either this attempt sees the caller left (and marks nothing), or
        // the caller sees the mark and removes it (after this transaction: its removal
        // locks the key's row first, which this transaction holds).
        marker.marked.store(true, Ordering::SeqCst);
        if !marker.cancelled.load(Ordering::SeqCst) {
            query(&inner.sql.holds.mark)
                .bind(req.key.as_str().as_bytes())
                .bind(req.attempt.to_string())
                .bind(req.owner.to_string())
                .bind(micros(MARKER_LEASE))
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            return Ok(Attempt::busy(left.min(MARKER_REFRESH)));
        }
    }
    tx.commit().await.map_err(fail)?;
    Ok(Attempt::busy(left))
}

/// Decides a read, write or permit request over the key whose row `tx` has locked (`plain`:
/// its live plain lock), and carries the decision out.
pub(crate) async fn acquire(
    inner: &Db,
    mut tx: Transaction<'static, Postgres>,
    req: &AcquireRequest,
    plain: Option<Plain>,
    marker: Option<&Marker>,
    interrupt: &Interrupt,
    start: Instant,
) -> Result<Attempt> {
    let fail = |e| inner.error("the acquire transaction", e);
    let name = req.key.as_str().as_bytes();
    let owner = req.owner.to_string();
    let ttl = micros(req.ttl);
    let holds = live_holds(inner, &mut tx, name).await.map_err(fail)?;
    match decide(req, plain.as_ref(), &holds) {
        Decision::Refused(error) => {
            tx.rollback().await.map_err(fail)?;
            Err(error)
        }
        Decision::Busy { left, mark } => busy(inner, tx, req, left, mark, marker).await,
        Decision::Again(at) => {
            let hold = &holds[at];
            let mut attempts = AttemptLedger::parse(&hold.attempts);
            let token = FencingToken::new(hold.token);
            if !req.kind.is_reentrant() || attempts.has(req.attempt) {
                // A retry of an acquisition that took effect (its COMMIT's reply was lost):
                // the same grant, its lease running at least as long as the retry's guard
                // counts it.
                query(&inner.sql.holds.extend)
                    .bind(ttl)
                    .bind(name)
                    .bind(&hold.kind)
                    .bind(&hold.holder)
                    .execute(&mut *tx)
                    .await
                    .map_err(fail)?;
                tx.commit().await.map_err(fail)?;
                return Ok(Attempt::Granted(Grant::new(req, token, hold.holds, start)));
            }
            attempts.add(req.attempt);
            query(&inner.sql.holds.reenter)
                .bind(attempts.render())
                .bind(ttl)
                .bind(name)
                .bind(&hold.kind)
                .bind(&hold.holder)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            Ok(Attempt::Granted(Grant::new(
                req,
                token,
                hold.holds.saturating_add(1),
                start,
            )))
        }
        Decision::New if caller_gone(interrupt).await => {
            tx.rollback().await.map_err(fail)?;
            Ok(Attempt::Busy { lease_left: None })
        }
        Decision::New => {
            let permits = req
                .kind
                .limit()
                .map(|l| i32::try_from(l).unwrap_or(i32::MAX));
            let granted = query(&inner.sql.holds.grant)
                .bind(name)
                .bind(code(req.kind))
                .bind(holder_of(req.kind, &owner, req.attempt))
                .bind(&owner)
                .bind(ttl)
                .bind(first_attempt(req))
                .bind(req.identity.encode_for(&owner))
                .bind(permits)
                .bind(req.attempt.to_string())
                .fetch_one(&mut *tx)
                .await
                .map_err(fail)?;
            let token: i64 = granted.try_get("token").map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            Ok(Attempt::Granted(Grant::new(
                req,
                FencingToken::new(u64::try_from(token).unwrap_or(0)),
                1,
                start,
            )))
        }
    }
}

/// Removes the marker of the wait of `attempt` in `tx` (a plain lock granted to it).
pub(crate) async fn unmark_in(
    inner: &Db,
    conn: &mut PgConnection,
    key: &LockKey,
    attempt: &str,
) -> std::result::Result<(), sqlx::Error> {
    query(&inner.sql.holds.unmark)
        .bind(key.as_str().as_bytes())
        .bind(attempt)
        .execute(conn)
        .await
        .map(|_| ())
}

/// Removes the marker of the wait of `attempt`, after any transaction deciding over the key
/// (the key's row is locked first), and announces its removal.
async fn unmark(backend: &RowLocks, key: &LockKey, attempt: &str) -> Result<()> {
    let inner = &backend.inner;
    let fail = |e| inner.error("removing a waiting writer's marker", e);
    let name = key.as_str().as_bytes();
    let mut tx = inner.begin().await.map_err(fail)?;
    query(&inner.sql.holds.key_lock)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    let removed = query(&inner.sql.holds.unmark)
        .bind(name)
        .bind(attempt)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    if removed.rows_affected() > 0 {
        // Readers it kept out may enter now.
        announce_release(inner, key, &mut tx).await.map_err(fail)?;
    }
    tx.commit().await.map_err(fail)
}

/// Removes a waiting writer's marker when its wait ends without a grant (a grant removes
/// it in its own transaction), also when the wait is dropped with an attempt still running
/// (see [`busy`]).
pub(crate) struct WriterMark {
    backend: RowLocks,
    key: LockKey,
    attempt: String,
    marker: Marker,
}

impl WriterMark {
    pub(crate) fn new(backend: &RowLocks, req: &AcquireRequest) -> Self {
        WriterMark {
            backend: backend.clone(),
            key: req.key.clone(),
            attempt: req.attempt.to_string(),
            marker: Marker::default(),
        }
    }

    /// What the wait's attempts record their marking in.
    pub(crate) fn marker(&self) -> Marker {
        self.marker.clone()
    }

    /// The wait was granted: the grant took the marker with it.
    pub(crate) fn granted(&self) {
        self.marker.marked.store(false, Ordering::SeqCst);
    }
}

impl Drop for WriterMark {
    fn drop(&mut self) {
        self.marker.cancelled.store(true, Ordering::SeqCst);
        if !self.marker.marked.load(Ordering::SeqCst) {
            return;
        }
        let (backend, key, attempt) = (
            self.backend.clone(),
            self.key.clone(),
            std::mem::take(&mut self.attempt),
        );
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = unmark(&backend, &key, &attempt).await {
                    tracing::debug!(%error, %key, "could not remove a waiting writer's marker; it runs out by itself");
                }
            });
        }
    }
}

/// Sets the lease of a read, write or permit hold to at least `ttl` from now, if it is
/// still live.
pub(crate) async fn renew(backend: &RowLocks, grant: &Grant, ttl: Duration) -> Result<()> {
    let inner = &backend.inner;
    let owner = grant.owner.to_string();
    let holder = holder_of(grant.kind, &owner, grant.attempt);
    // Sent again on another connection if the pooled one is gone: a renewal only lengthens.
    let done = inner
        .retry_gone(|| {
            inner.execute_one(
                query(&inner.sql.holds.renew)
                    .bind(micros(ttl))
                    .bind(grant.key.as_str().as_bytes())
                    .bind(code(grant.kind))
                    .bind(&holder)
                    .bind(&owner),
            )
        })
        .await
        .map_err(|e| inner.error("renewing the lease", e))?;
    if done.rows_affected() == 1 {
        Ok(())
    } else {
        Err(Error::NotHeld {
            key: grant.key.clone(),
        })
    }
}

/// Gives back one read or write hold (reentrant: the last one ends it) or a permit; a
/// hold that ends is announced when the transaction commits.
pub(crate) async fn release(backend: &RowLocks, grant: &Grant) -> Result<Released> {
    let inner = &backend.inner;
    let sql = &inner.sql.holds;
    let fail = |e| inner.error("the release transaction", e);
    let name = grant.key.as_str().as_bytes();
    let owner = grant.owner.to_string();
    let (kind, holder) = (
        code(grant.kind),
        holder_of(grant.kind, &owner, grant.attempt),
    );
    let mut tx = inner.begin().await.map_err(fail)?;
    let row = query(&sql.lock_one)
        .bind(name)
        .bind(kind)
        .bind(&holder)
        .bind(&owner)
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    let Some(row) = row else {
        tx.rollback().await.map_err(fail)?;
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    };
    let holds = u32::try_from(row.try_get::<i32, _>("holds").map_err(fail)?).unwrap_or(0);
    let mut attempts = AttemptLedger::parse(
        &row.try_get::<Option<String>, _>("attempts")
            .map_err(fail)?
            .unwrap_or_default(),
    );
    if grant.kind.is_reentrant() {
        if !attempts.take(grant.attempt, holds) {
            // A retried release: it took effect already.
            tx.rollback().await.map_err(fail)?;
            return Ok(Released::Partially { remaining: holds });
        }
        if holds > 1 {
            query(&sql.release_one)
                .bind(attempts.render())
                .bind(name)
                .bind(kind)
                .bind(&holder)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            return Ok(Released::Partially {
                remaining: holds - 1,
            });
        }
    }
    query(&sql.delete)
        .bind(name)
        .bind(kind)
        .bind(&holder)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    announce_release(inner, &grant.key, &mut tx)
        .await
        .map_err(fail)?;
    tx.commit().await.map_err(fail)?;
    Ok(Released::Fully)
}

/// Every live hold of `key`: the plain lock (or advisory hold) first, then the writer,
/// then readers or permits by token.
pub(crate) async fn holders(backend: &RowLocks, key: &LockKey) -> Result<Vec<HolderInfo>> {
    let inner = &backend.inner;
    let mut all: Vec<HolderInfo> = inner.inspect_lease(key).await?.into_iter().collect();
    let fail = |e| inner.error("listing the holds", e);
    let rows = inner
        .retry_gone(|| {
            query(&inner.sql.holds.list)
                .bind(key.as_str().as_bytes())
                .fetch_all(&inner.pool)
        })
        .await
        .map_err(fail)?;
    for row in rows {
        let code: String = row.try_get("kind").map_err(fail)?;
        let owner: String = row.try_get("owner").map_err(fail)?;
        let permits = row
            .try_get::<Option<i32>, _>("permits")
            .map_err(fail)?
            .and_then(|p| u32::try_from(p).ok())
            .and_then(NonZeroU32::new);
        let kind = match (code.as_str(), permits) {
            ("r", _) => Some(LockKind::Read),
            ("w", _) => Some(LockKind::Write),
            ("p", Some(limit)) => Some(LockKind::Permit { limit }),
            _ => None,
        };
        let left: Option<i64> = row.try_get("left_us").map_err(fail)?;
        let identity: Option<String> = row.try_get("identity").map_err(fail)?;
        let info = HolderInfo::new(
            owner.clone(),
            u32::try_from(row.try_get::<i32, _>("holds").map_err(fail)?).unwrap_or(1),
            Some(FencingToken::new(
                u64::try_from(row.try_get::<i64, _>("token").map_err(fail)?).unwrap_or(0),
            )),
            left.and_then(|us| u64::try_from(us).ok())
                .map(Duration::from_micros),
        )
        .with_identity(identity.and_then(|i| HolderIdentity::decode_for(&i, &owner)));
        all.push(match kind {
            Some(kind) => info.with_kind(kind),
            None => info,
        });
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockkit_core::{LossSignal, OwnerId};

    fn request(owner: OwnerId, kind: LockKind) -> AcquireRequest {
        AcquireRequest::new(
            LockKey::new("k").expect("a valid key"),
            owner,
            Duration::from_secs(10),
            LossSignal::new(),
        )
        .with_kind(kind)
    }

    fn hold(kind: &str, owner: OwnerId, left_ms: u64) -> HoldRow {
        HoldRow {
            kind: kind.into(),
            holder: owner.to_string(),
            owner: owner.to_string(),
            holds: 1,
            token: 1,
            attempts: String::new(),
            permits: (kind == "p").then_some(2),
            left: Duration::from_millis(left_ms),
        }
    }

    fn permit(limit: u32) -> LockKind {
        LockKind::Permit {
            limit: NonZeroU32::new(limit).expect("not zero"),
        }
    }

    #[test]
    fn readers_share_and_writers_exclude() {
        let (a, b) = (OwnerId::random(), OwnerId::random());
        let reading = [hold("r", a, 500)];
        assert!(matches!(
            decide(&request(b, LockKind::Read), None, &reading),
            Decision::New
        ));
        assert!(matches!(
            decide(&request(b, LockKind::Write), None, &reading),
            Decision::Busy { mark: true, left } if left == Duration::from_millis(500)
        ));
        assert!(matches!(
            decide(&request(b, LockKind::Exclusive), None, &reading),
            Decision::Busy { mark: true, .. }
        ));
        let writing = [hold("w", a, 700)];
        assert!(matches!(
            decide(&request(b, LockKind::Read), None, &writing),
            Decision::Busy { mark: false, .. }
        ));
        assert!(matches!(
            decide(&request(b, LockKind::Exclusive), None, &writing),
            Decision::Busy { mark: false, .. }
        ));
        let plain = Plain {
            owner: Some(a.to_string()),
            left: Some(Duration::from_secs(1)),
        };
        assert!(matches!(
            decide(&request(b, LockKind::Read), Some(&plain), &[]),
            Decision::Busy { mark: false, .. }
        ));
        assert!(matches!(
            decide(&request(b, LockKind::Write), Some(&plain), &[]),
            Decision::Busy { mark: true, .. }
        ));
    }

    #[test]
    fn upgrades_and_changes_of_kind_are_refused() {
        let a = OwnerId::random();
        let reading = [hold("r", a, 500)];
        for asked in [LockKind::Write, LockKind::Exclusive] {
            assert!(matches!(
                decide(&request(a, asked), None, &reading),
                Decision::Refused(Error::WouldDeadlock { .. })
            ));
        }
        let both = [hold("w", a, 500), hold("r", a, 500)];
        assert!(matches!(
            decide(&request(a, LockKind::Exclusive), None, &both),
            Decision::Refused(Error::KindMismatch { .. })
        ));
        let plain = Plain {
            owner: Some(a.to_string()),
            left: Some(Duration::from_secs(1)),
        };
        for asked in [LockKind::Read, LockKind::Write] {
            assert!(matches!(
                decide(&request(a, asked), Some(&plain), &[]),
                Decision::Refused(Error::KindMismatch { .. })
            ));
        }
        assert!(matches!(
            decide(&request(a, permit(2)), Some(&plain), &[]),
            Decision::Refused(Error::KindMismatch { .. })
        ));
        let permits = [hold("p", OwnerId::random(), 500)];
        assert!(matches!(
            decide(&request(a, permit(3)), None, &permits),
            Decision::Refused(Error::KindMismatch { .. })
        ));
        assert!(matches!(
            decide(&request(a, LockKind::Exclusive), None, &permits),
            Decision::Refused(Error::KindMismatch { .. })
        ));
    }

    #[test]
    fn an_advisory_lock_without_a_record_only_blocks() {
        let unknown = Plain {
            owner: None,
            left: None,
        };
        for asked in [LockKind::Read, LockKind::Write, permit(3)] {
            assert!(matches!(
                decide(&request(OwnerId::random(), asked), Some(&unknown), &[]),
                Decision::Busy { left, .. } if left == ADVISORY_RECHECK
            ));
        }
    }

    #[test]
    fn a_marker_keeps_new_reads_out_but_not_reentries_or_downgrades() {
        let (a, w) = (OwnerId::random(), OwnerId::random());
        let holds = [hold("r", a, 5000), hold("q", w, 2000)];
        assert!(matches!(
            decide(&request(OwnerId::random(), LockKind::Read), None, &holds),
            Decision::Busy { left, mark: false } if left == Duration::from_millis(2000)
        ));
        assert!(matches!(
            decide(&request(w, LockKind::Read), None, &holds),
            Decision::Busy { .. }
        ));
        assert!(matches!(
            decide(&request(a, LockKind::Read), None, &holds),
            Decision::Again(0)
        ));
        let writing = [hold("w", a, 5000), hold("q", w, 2000)];
        assert!(matches!(
            decide(&request(a, LockKind::Read), None, &writing),
            Decision::New
        ));
    }

    #[test]
    fn permits_are_counted_and_never_reentered() {
        let a = OwnerId::random();
        let one = [hold("p", a, 500)];
        assert!(matches!(
            decide(&request(a, permit(2)), None, &one),
            Decision::New
        ));
        let two = [hold("p", a, 500), hold("p", OwnerId::random(), 300)];
        assert!(matches!(
            decide(&request(a, permit(2)), None, &two),
            Decision::Busy { left, .. } if left == Duration::from_millis(300)
        ));
        let req = request(a, permit(2));
        let mut mine = hold("p", a, 500);
        mine.holder = req.attempt.to_string();
        assert!(matches!(decide(&req, None, &[mine]), Decision::Again(0)));
    }
}

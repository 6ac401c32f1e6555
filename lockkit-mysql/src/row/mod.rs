//! mode=row: the lease table. A plain lock is the key's row in `<table>` (owner, hold
//! count, fence, expiry); reads, writes and permits are rows of `<table>_holds` (see
//! [`kinds`]), decided under the lock of the key's row, whose `fence` is the one counter
//! every new hold of the key takes its token from.

mod kinds;

use std::time::Duration;

use std::sync::Arc;

use async_trait::async_trait;
use lockkit_core::spi::{
    AcquireRequest, Attempt, AttemptLedger, Backoff, Grant, Polling, Released, WaitPolicy,
    detached_acquire, wait_for_grant,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LockKind, Result,
};
use sqlx::{MySql, Row, Transaction};
use tokio::time::Instant;

use crate::db::{
    BACKEND, Db, LOCK_NOWAIT, LOCK_WAIT_TIMEOUT, error_number, micros, query, row_text,
};
use kinds::{HoldRow, HoldView, Marker, Verdict, WriterMark};

/// The lease table's locks over one database.
#[derive(Clone)]
pub(crate) struct RowLocks {
    inner: Arc<Db>,
}

impl RowLocks {
    pub(crate) fn new(db: Arc<Db>) -> Self {
        RowLocks { inner: db }
    }

    /// Live leases, holds and waiting writers' markers on keys under `prefix`, seen from a
    /// fresh connection. For leak checks.
    #[cfg(feature = "testing")]
    pub(crate) async fn held_under(&self, prefix: &str) -> Result<u64> {
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(
            self.inner.sql.live_under_prefix.clone(),
        ))
        .bind(prefix.as_bytes())
        .bind(prefix.as_bytes())
        .fetch_one(&self.inner.pool)
        .await
        .map_err(|e| crate::db::db_error("counting live leases", e))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}

impl std::fmt::Debug for RowLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowLocks")
            .field("table", &self.inner.config.table)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl LockBackend for RowLocks {
    fn info(&self) -> BackendInfo {
        let capabilities = Capabilities {
            notified_wait: false,
            min_ttl: Duration::from_millis(1),
            read_write: true,
            // Waiting writers leave a marker row with a short lease (kinds::WRITER_MARKER).
            writer_preference: true,
            semaphore: true,
            ..Capabilities::default()
        };
        BackendInfo::new(BACKEND, Consistency::Cp, capabilities)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        try_acquire(self, req).await
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        acquire(self, req, wait).await
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        renew(self, grant, ttl).await
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        release(self, grant).await
    }

    async fn ping(&self) -> Result<()> {
        self.inner.ping().await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        Ok(self.holders(key).await?.into_iter().next())
    }

    /// The mutex holder (or a for-update holder on a shared table), then every live read,
    /// write and permit hold: the writer first, then by token.
    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        let mut all: Vec<HolderInfo> = self.inner.inspect_lease(key).await?.into_iter().collect();
        all.extend(kinds::live_holders(&self.inner, key).await?);
        Ok(all)
    }
}

/// Test hook: a pause between a retried acquisition's look at its lease and its extension
/// (zero: none), to put the lease's end inside that window.
#[cfg(feature = "testing")]
static RETRY_PAUSE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Sets the pause of a retried acquisition between its `SELECT ... FOR UPDATE` and the
/// extension of its lease (test hook).
#[cfg(feature = "testing")]
pub fn set_retry_pause(pause: Duration) {
    RETRY_PAUSE_MS.store(
        u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
        std::sync::atomic::Ordering::SeqCst,
    );
}

#[cfg(feature = "testing")]
async fn retry_pause() {
    let ms = RETRY_PAUSE_MS.load(std::sync::atomic::Ordering::SeqCst);
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// The ledger of a new holder: just this attempt.
fn first_attempt(req: &AcquireRequest) -> String {
    let mut attempts = AttemptLedger::new();
    attempts.add(req.attempt);
    attempts.render()
}

/// One acquire transaction: lock the key's row, decide by the rules of the kind asked,
/// write, commit. `marker`: the caller waits, so a writer that is refused leaves (or
/// renews) its waiting marker.
async fn run_acquire(
    backend: &RowLocks,
    req: &AcquireRequest,
    marker: Option<&Marker>,
) -> Result<Attempt> {
    let inner = &backend.inner;
    let sql = &inner.sql;
    let name = req.key.as_str().as_bytes();
    let owner = req.owner.to_string();
    let ttl = micros(req.ttl);
    let start = Instant::now();
    let fail = |e| inner.fail("the acquire transaction", e);
    // A plain lock on a free key: one statement decides and grants. Not for a waiter that
    // has left a writer's marker (the full transaction deletes it with the grant).
    if req.kind == LockKind::Exclusive && marker.is_none_or(|m| !m.has_marked()) {
        // A pooled connection that died since its last use (pools ping only after an idle
        // spell, or soon after a dead one was seen): again on another. Repeating is
        // harmless either way: had the first taken effect, the lease is this attempt's and
        // the full transaction below grants it again.
        let taken = inner
            .retry_gone(|| {
                inner.execute_one(
                    query(&sql.row_take_free)
                        .bind(owner.clone())
                        .bind(ttl)
                        .bind(first_attempt(req))
                        .bind(req.identity.encode_for(&owner))
                        .bind(name.to_vec()),
                )
            })
            .await
            .map_err(fail)?;
        if taken.rows_affected() == 1 {
            return Ok(Attempt::Granted(Grant::new(
                req,
                FencingToken::new(taken.last_insert_id()),
                1,
                start,
            )));
        }
        // Perhaps the key's first use: its row, already held, as the full transaction would
        // create it (a key without a row has no holds to weigh). A duplicate: the row is
        // there, held or with more to decide; the full transaction looks.
        // (Sent again on a dead connection: had the first taken effect, the duplicate
        // sends this attempt to the full transaction, which finds the lease its own.)
        let created = inner
            .retry_gone(|| {
                inner.execute_one(
                    query(&sql.row_insert)
                        .bind(name.to_vec())
                        .bind(owner.clone())
                        .bind(ttl)
                        .bind(first_attempt(req))
                        .bind(req.identity.encode_for(&owner)),
                )
            })
            .await;
        match created {
            Ok(_) => {
                return Ok(Attempt::Granted(Grant::new(
                    req,
                    FencingToken::new(1),
                    1,
                    start,
                )));
            }
            Err(e) if error_number(&e) == Some(1062) => {}
            Err(e) => return Err(fail(e)),
        }
    }
    let mut tx = inner.begin().await.map_err(fail)?;
    let row = query(&sql.row_select_for_update)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    let Some(row) = row else {
        // First use of this key: create its row (already held, for a plain lock).
        let created = if req.kind == LockKind::Exclusive {
            query(&sql.row_insert)
                .bind(name)
                .bind(&owner)
                .bind(ttl)
                .bind(first_attempt(req))
                .bind(req.identity.encode_for(&owner))
                .execute(&mut *tx)
                .await
        } else {
            query(&sql.row_insert_free)
                .bind(name)
                .execute(&mut *tx)
                .await
        };
        return match created {
            Ok(_) if req.kind == LockKind::Exclusive => {
                tx.commit().await.map_err(fail)?;
                Ok(Attempt::Granted(Grant::new(
                    req,
                    FencingToken::new(1),
                    1,
                    start,
                )))
            }
            Ok(_) => decide_holds(inner, tx, req, 0, None, marker, start).await,
            // Another client created it first: try again at once.
            Err(e) if error_number(&e) == Some(1062) => Ok(Attempt::busy(Duration::ZERO)),
            Err(e) => Err(fail(e)),
        };
    };
    let live = row.try_get::<Option<i64>, _>("live").ok().flatten() == Some(1);
    let fence: u64 = row.try_get("fence").map_err(fail)?;
    let holds: u32 = row.try_get("holds").map_err(fail)?;
    let holder = row_text(&row, "owner");
    if req.kind == LockKind::Exclusive && live && holder.as_deref() == Some(owner.as_str()) {
        let mut attempts = AttemptLedger::parse(&row_text(&row, "attempts").unwrap_or_default());
        if attempts.has(req.attempt) {
            // A retry of an acquisition that took effect (its COMMIT's reply was lost): the
            // same grant again, not a second hold. Its guard counts the lease from this
            // retry, so the lease on the server runs at least that long too (never shorter),
            // even if it ran out since the SELECT above: the row lock kept everyone out
            // (review 17, M1: the renew's `expires_at > now` could match nothing here and
            // the grant went out on an expired lease).
            #[cfg(feature = "testing")]
            retry_pause().await;
            query(&sql.row_extend_locked)
                .bind(ttl)
                .bind(name)
                .bind(&owner)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            return Ok(Attempt::Granted(Grant::new(
                req,
                FencingToken::new(fence),
                holds,
                start,
            )));
        }
        attempts.add(req.attempt);
        query(&sql.row_reenter)
            .bind(attempts.render())
            .bind(ttl)
            .bind(name)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        return Ok(Attempt::Granted(Grant::new(
            req,
            FencingToken::new(fence),
            holds + 1,
            start,
        )));
    }
    let left = Duration::from_micros(
        row.try_get::<Option<i64>, _>("left_us")
            .ok()
            .flatten()
            .and_then(|us| u64::try_from(us).ok())
            .unwrap_or(0),
    );
    // The mutex holder, as a hold the rules weigh (it excludes every other kind).
    let mut mutex = None;
    if live {
        if req.kind == LockKind::Exclusive {
            // Held by another owner: nothing else to look at.
            tx.rollback().await.map_err(fail)?;
            return Ok(Attempt::busy(left));
        }
        mutex = Some(HoldView {
            kind: LockKind::Exclusive,
            owner: holder.clone().unwrap_or_default(),
            left: Some(left),
        });
    }
    // A holder with no expiry is a for-update holder (mode=for-update shares this table):
    // it holds the key for as long as its transaction keeps the mutex row locked. Probe
    // that lock without waiting; taking it here also keeps a for-update client from being
    // granted until this transaction commits the lease (it then finds the lease live).
    let for_update_holder = holder.is_some()
        && row
            .try_get::<Option<i64>, _>("live")
            .ok()
            .flatten()
            .is_none();
    if for_update_holder {
        match query(&sql.mutex_lock_nowait)
            .bind(name)
            .fetch_optional(&mut *tx)
            .await
        {
            Ok(_) => {}
            Err(e) if matches!(error_number(&e), Some(LOCK_WAIT_TIMEOUT | LOCK_NOWAIT)) => {
                if req.kind == LockKind::Exclusive {
                    tx.rollback().await.map_err(fail)?;
                    return Ok(Attempt::busy(FOR_UPDATE_HOLDER_POLL));
                }
                mutex = Some(HoldView {
                    kind: LockKind::Exclusive,
                    owner: holder.clone().unwrap_or_default(),
                    left: None,
                });
            }
            Err(e) => return Err(fail(e)),
        }
    }
    decide_holds(inner, tx, req, fence, mutex, marker, start).await
}

/// The rest of an acquire transaction that holds the key's row lock, whose mutex holder
/// (if any) is `mutex` and whose counter is `fence`: reads the key's holds, deletes those
/// whose lease ran out, then re-enters, grants, or answers busy (leaving a waiting
/// writer's marker).
async fn decide_holds(
    inner: &Db,
    mut tx: Transaction<'static, MySql>,
    req: &AcquireRequest,
    fence: u64,
    mutex: Option<HoldView>,
    marker: Option<&Marker>,
    start: Instant,
) -> Result<Attempt> {
    let sql = &inner.sql;
    let name = req.key.as_str().as_bytes();
    let owner = req.owner.to_string();
    let ttl = micros(req.ttl);
    let fail = |e| inner.fail("the acquire transaction", e);
    let rows = query(&sql.holds_of_key)
        .bind(name)
        .fetch_all(&mut *tx)
        .await
        .map_err(fail)?
        .iter()
        .map(HoldRow::parse)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(fail)?;
    // Holds whose lease ran out are over: delete them, each by its key. (A hold seen live
    // here stays live for this decision, even if it runs out before the commit: the row
    // lock keeps everyone else out meanwhile.) The read above saw committed rows only: a
    // renewal that was changing a row then (it takes no key lock) may have committed a
    // longer lease since, which the locking delete sees; then decide again.
    let mut changed = false;
    for over in rows.iter().filter(|r| !r.live) {
        let done = query(&sql.holds_delete_expired)
            .bind(name)
            .bind(&over.kind)
            .bind(&over.holder)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        if done.rows_affected() == 0 {
            tx.rollback().await.map_err(fail)?;
            return Ok(Attempt::busy(Duration::ZERO));
        }
        changed = true;
    }
    let live: Vec<&HoldRow> = rows.iter().filter(|r| r.live).collect();
    let code = kinds::code(req.kind);
    let holder = kinds::holder_of(req.kind, &owner, req.attempt);
    if req.kind != LockKind::Exclusive
        && let Some(mine) = live.iter().find(|r| r.kind == code && r.holder == holder)
    {
        if mine.attempts.has(req.attempt) {
            // A retry of an acquisition that took effect: the same grant, its lease made to
            // run at least `ttl` from now (see the plain lock's retry above).
            #[cfg(feature = "testing")]
            retry_pause().await;
            query(&sql.holds_extend_locked)
                .bind(ttl)
                .bind(name)
                .bind(code)
                .bind(&holder)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            return Ok(Attempt::Granted(Grant::new(
                req,
                FencingToken::new(mine.token),
                mine.holds,
                start,
            )));
        }
        if req.kind.is_reentrant() {
            let mut attempts = mine.attempts.clone();
            attempts.add(req.attempt);
            query(&sql.holds_reenter)
                .bind(attempts.render())
                .bind(ttl)
                .bind(name)
                .bind(code)
                .bind(&holder)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            return Ok(Attempt::Granted(Grant::new(
                req,
                FencingToken::new(mine.token),
                mine.holds + 1,
                start,
            )));
        }
        // A permit asked again by an attempt with no id (nil): not this permit, and the
        // row's key is taken (a Locker never sends one). Busy, as a full semaphore would be.
        tx.rollback().await.map_err(fail)?;
        return Ok(Attempt::Busy { lease_left: None });
    }
    let mut views: Vec<HoldView> = mutex.into_iter().collect();
    views.extend(live.iter().filter_map(|r| {
        r.lock_kind().map(|kind| HoldView {
            kind,
            owner: r.owner.clone(),
            left: Some(r.left),
        })
    }));
    let writer_waits = live.iter().any(|r| r.kind == "q");
    let my_marker = live.iter().any(|r| r.kind == "q" && r.holder == owner);
    match kinds::decide(req, &owner, &views, writer_waits) {
        Verdict::Refused(error) => {
            // Nothing written, no marker left (an expired hold deleted can wait).
            tx.rollback().await.map_err(fail)?;
            Err(error)
        }
        Verdict::Busy(lease_left) => {
            // A plain locker counts as a writer, but marks only where readers come: its
            // polls then write nothing.
            let marks = req.kind == LockKind::Write
                || (req.kind == LockKind::Exclusive && live.iter().any(|r| r.kind == "r"));
            if let Some(marker) = marker.filter(|_| marks)
                && marker.may_mark()
            {
                let lease = micros(kinds::WRITER_MARKER);
                if my_marker {
                    query(&sql.marker_refresh)
                        .bind(lease)
                        .bind(name)
                        .bind(&owner)
                        .execute(&mut *tx)
                        .await
                } else {
                    query(&sql.marker_insert)
                        .bind(name)
                        .bind(&owner)
                        .bind(&owner)
                        .bind(lease)
                        .execute(&mut *tx)
                        .await
                }
                .map_err(fail)?;
                changed = true;
            }
            if changed {
                tx.commit().await.map_err(fail)?;
            } else {
                tx.rollback().await.map_err(fail)?;
            }
            Ok(Attempt::Busy { lease_left })
        }
        Verdict::Grant => {
            let token = fence + 1;
            let taken = if req.kind == LockKind::Exclusive {
                query(&sql.row_take)
                    .bind(&owner)
                    .bind(ttl)
                    .bind(first_attempt(req))
                    .bind(req.identity.encode_for(&owner))
                    .bind(name)
                    .execute(&mut *tx)
                    .await
                    .map(|done| done.rows_affected() == 1)
            } else {
                let inserted = match query(&sql.fence_next).bind(name).execute(&mut *tx).await {
                    Ok(_) => {
                        query(&sql.holds_insert)
                            .bind(name)
                            .bind(code)
                            .bind(&holder)
                            .bind(&owner)
                            .bind(token)
                            .bind(req.kind.limit())
                            .bind(ttl)
                            .bind(first_attempt(req))
                            .bind(req.identity.encode_for(&owner))
                            .execute(&mut *tx)
                            .await
                    }
                    Err(e) => Err(e),
                };
                match inserted {
                    Ok(_) => Ok(true),
                    Err(e) if error_number(&e) == Some(1062) => Ok(false),
                    Err(e) => Err(e),
                }
            };
            if !taken.map_err(fail)? {
                // Cannot happen under the row lock (the holds seen are all there are); if
                // it does, nothing is taken and the caller tries again.
                tx.rollback().await.map_err(fail)?;
                return Ok(Attempt::busy(Duration::ZERO));
            }
            if my_marker && req.kind.is_exclusive() {
                query(&sql.marker_delete)
                    .bind(name)
                    .bind(&owner)
                    .execute(&mut *tx)
                    .await
                    .map_err(fail)?;
            }
            tx.commit().await.map_err(fail)?;
            Ok(Attempt::Granted(Grant::new(
                req,
                FencingToken::new(token),
                1,
                start,
            )))
        }
    }
}

/// How long a waiter behind a for-update holder sleeps between polls at most (that holder
/// has no lease in the table to wait out).
const FOR_UPDATE_HOLDER_POLL: Duration = Duration::from_millis(100);

/// Deadlocks are InnoDB's way of asking for a retry.
const DEADLOCK: u16 = 1213;

/// Whether `error` is InnoDB's deadlock (the server rolled the transaction back).
fn is_deadlock(error: &Error) -> bool {
    matches!(
        error,
        Error::Backend { source: Some(source), .. }
            if source.downcast_ref::<sqlx::Error>().and_then(error_number) == Some(DEADLOCK)
    )
}

/// A cancel-safe attempt: a grant whose caller has gone is given back.
async fn attempt(
    backend: &RowLocks,
    req: &AcquireRequest,
    marker: Option<Marker>,
) -> Result<Attempt> {
    let (this, request, giver) = (backend.clone(), req.clone(), backend.clone());
    detached_acquire(
        BACKEND,
        move |_| async move {
            match run_acquire(&this, &request, marker.as_ref()).await {
                // Rolled back by the server: nothing was taken; try again at once.
                Err(error) if is_deadlock(&error) => Ok(Attempt::busy(Duration::ZERO)),
                outcome => outcome,
            }
        },
        Attempt::into_grant,
        move |grant| async move {
            if let Err(error) = release(&giver, &grant).await {
                tracing::warn!(%error, "could not give back an orphaned grant; its lease will run out");
            }
        },
    )
    .await
}

async fn try_acquire(backend: &RowLocks, req: &AcquireRequest) -> Result<Option<Grant>> {
    // A row created by a racing client (or a deadlock the server broke) is not contention:
    // retry that once.
    for _ in 0..2 {
        match attempt(backend, req, None).await? {
            Attempt::Granted(grant) => return Ok(Some(grant)),
            Attempt::Busy {
                lease_left: Some(left),
            } if left.is_zero() => continue,
            Attempt::Busy { .. } => return Ok(None),
        }
    }
    Ok(None)
}

/// First poll delay, and the cap of the exponential backoff (well under a third of
/// [`kinds::WRITER_MARKER`], so a waiting writer's polls keep its marker alive).
const FIRST_POLL: Duration = Duration::from_millis(2);
const MAX_POLL: Duration = Duration::from_millis(100);

/// Waits by polling with capped exponential backoff and jitter, never sleeping past the
/// holder's remaining lease or the deadline. A waiting writer (or plain locker where
/// readers hold) keeps new readers out with its marker while it waits; the marker goes with
/// the grant, or as soon as the wait ends otherwise (dropped, timed out, refused).
async fn acquire(backend: &RowLocks, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
    let policy = WaitPolicy::new(Backoff::new(FIRST_POLL, MAX_POLL));
    let mark = req.kind.is_exclusive().then(|| WriterMark {
        db: backend.inner.clone(),
        key: req.key.clone(),
        owner: req.owner.to_string(),
        marker: Marker::default(),
    });
    let marker = mark.as_ref().map(|mark| mark.marker.clone());
    let granted = wait_for_grant(&req.key, wait, policy, &mut Polling, || {
        attempt(backend, req, marker.clone())
    })
    .await;
    if granted.is_ok()
        && let Some(mark) = &mark
    {
        // The grant's transaction took the marker with it.
        mark.marker.granted();
    }
    granted
}

async fn renew(backend: &RowLocks, grant: &Grant, ttl: Duration) -> Result<()> {
    let inner = &backend.inner;
    let renewed = if grant.kind == LockKind::Exclusive {
        // (Sent again on a dead connection: a renewal repeated changes nothing more.)
        let done = inner
            .retry_gone(|| {
                inner.execute_one(
                    query(&inner.sql.row_renew)
                        .bind(micros(ttl))
                        .bind(grant.key.as_str().as_bytes().to_vec())
                        .bind(grant.owner.to_string()),
                )
            })
            .await
            .map_err(|e| inner.fail("renewing the lease", e))?;
        done.rows_affected() == 1
    } else {
        kinds::renew(inner, grant, ttl).await?
    };
    if renewed {
        Ok(())
    } else {
        Err(Error::NotHeld {
            key: grant.key.clone(),
        })
    }
}

/// Gives back one hold of `grant` (once, however often it is retried). A deadlock the
/// server broke is retried here: nothing was changed.
async fn release(backend: &RowLocks, grant: &Grant) -> Result<Released> {
    let mut tries = 0;
    loop {
        tries += 1;
        let outcome = if grant.kind == LockKind::Exclusive {
            release_lease(backend, grant).await
        } else {
            release_hold(backend, grant).await
        };
        match outcome {
            Err(error) if tries < 3 && is_deadlock(&error) => continue,
            outcome => return outcome,
        }
    }
}

/// Gives back one hold of a plain lock.
async fn release_lease(backend: &RowLocks, grant: &Grant) -> Result<Released> {
    let inner = &backend.inner;
    let sql = &inner.sql;
    let name = grant.key.as_str().as_bytes();
    let fail = |e| inner.fail("the release transaction", e);
    let owner = grant.owner.to_string();
    // The sole hold of a fresh acquisition: one statement. Anything else (a re-entered
    // hold, a retried release, a lease no longer ours) goes to the full transaction.
    let mut sole = AttemptLedger::new();
    sole.add(grant.attempt);
    let release_sole = || {
        inner.execute_one(
            query(&sql.row_release_sole)
                .bind(name.to_vec())
                .bind(owner.clone())
                .bind(sole.render()),
        )
    };
    match release_sole().await {
        Ok(done) if done.rows_affected() == 1 => return Ok(Released::Fully),
        Ok(_) => {}
        // A pooled connection that died since its last use: again on another (up to
        // `pool_size` more times). If that matches nothing, whether the first one took
        // effect is unknown: say so (a retryable error; a retry finds out).
        Err(e) if inner.gone(&e) => {
            let again = inner.retry_gone(&release_sole).await;
            return match again {
                Ok(done) if done.rows_affected() == 1 => Ok(Released::Fully),
                Ok(_) => Err(fail(e)),
                Err(again) => Err(fail(again)),
            };
        }
        Err(e) => return Err(fail(e)),
    }
    let mut tx = inner.begin().await.map_err(fail)?;
    let row = query(&sql.row_select_for_update)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    let ours = row.as_ref().is_some_and(|row| {
        row.try_get::<Option<i64>, _>("live").ok().flatten() == Some(1)
            && row_text(row, "owner").as_deref() == Some(owner.as_str())
    });
    let (holds, mut attempts): (u32, AttemptLedger) = match (&row, ours) {
        (Some(row), true) => (
            row.try_get("holds").map_err(fail)?,
            AttemptLedger::parse(&row_text(row, "attempts").unwrap_or_default()),
        ),
        _ => {
            tx.rollback().await.map_err(fail)?;
            return Err(Error::NotHeld {
                key: grant.key.clone(),
            });
        }
    };
    if !attempts.take(grant.attempt, holds) {
        // A retried release: it took effect already.
        tx.rollback().await.map_err(fail)?;
        return Ok(Released::Partially { remaining: holds });
    }
    let outcome = if holds > 1 {
        query(&sql.row_release_one)
            .bind(attempts.render())
            .bind(name)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        Released::Partially {
            remaining: holds - 1,
        }
    } else {
        query(&sql.row_release_all)
            .bind(name)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        Released::Fully
    };
    tx.commit().await.map_err(fail)?;
    Ok(outcome)
}

/// Gives back one read, write or permit hold: under the key's row lock (as every change to
/// the key's holds), so no acquisition is deciding on it meanwhile.
async fn release_hold(backend: &RowLocks, grant: &Grant) -> Result<Released> {
    let inner = &backend.inner;
    let sql = &inner.sql;
    let name = grant.key.as_str().as_bytes();
    let owner = grant.owner.to_string();
    let code = kinds::code(grant.kind);
    let fail = |e| inner.fail("the release transaction", e);
    let mut tx = inner.begin().await.map_err(fail)?;
    query(&sql.row_select_for_update)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    let row = if matches!(grant.kind, LockKind::Permit { .. }) && grant.attempt.is_nil() {
        // "Any one hold of the owner": the owner's permit (one per owner from a Locker).
        query(&sql.holds_select_permit_of)
            .bind(name)
            .bind(&owner)
            .fetch_optional(&mut *tx)
            .await
    } else {
        query(&sql.holds_select_one)
            .bind(name)
            .bind(code)
            .bind(kinds::holder_of(grant.kind, &owner, grant.attempt))
            .fetch_optional(&mut *tx)
            .await
    }
    .map_err(fail)?;
    let Some(row) = row else {
        tx.rollback().await.map_err(fail)?;
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    };
    let holder: String = row.try_get("holder").map_err(fail)?;
    let holds: u32 = row.try_get("holds").map_err(fail)?;
    let mut attempts = AttemptLedger::parse(&row_text(&row, "attempts").unwrap_or_default());
    if !attempts.take(grant.attempt, holds) {
        // A retried release: it took effect already.
        tx.rollback().await.map_err(fail)?;
        return Ok(Released::Partially { remaining: holds });
    }
    let outcome = if holds > 1 {
        query(&sql.holds_release_one)
            .bind(attempts.render())
            .bind(name)
            .bind(code)
            .bind(&holder)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        Released::Partially {
            remaining: holds - 1,
        }
    } else {
        query(&sql.holds_delete)
            .bind(name)
            .bind(code)
            .bind(&holder)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        Released::Fully
    };
    tx.commit().await.map_err(fail)?;
    Ok(outcome)
}

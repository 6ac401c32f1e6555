//! mode=row: the lease table, its holds table for read-write locks and semaphores
//! (`holds`), and its waiters' wake-ups (`notify`).

pub(crate) mod holds;
pub(crate) mod notify;

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use lockkit_core::spi::{
    AcquireRequest, Attempt, AttemptLedger, Backoff, Grant, Interrupt, Released, WaitPolicy,
    deadline_after, detached_acquire, wait_for_grant,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LockKind, Result,
};
use sqlx::Row;
use tokio::time::Instant;

use crate::db::{
    BACKEND, Db, fence_of, micros, query, release_channel, row_text, sql_state, state,
};
use holds::{Decision, Marker, Plain, WriterMark};
use notify::{Releases, release_payload};

/// The lease table's locks over one database.
#[derive(Clone)]
pub(crate) struct RowLocks {
    inner: Arc<Db>,
    releases: Arc<Releases>,
}

impl RowLocks {
    pub(crate) fn new(db: Arc<Db>) -> Self {
        let releases = Releases::new(
            release_channel(&db.config.table),
            db.config.connect.clone(),
            db.config.connect_timeout,
        );
        RowLocks {
            inner: db,
            releases,
        }
    }

    /// Live leases on keys under `prefix`, seen from a fresh connection. For leak checks.
    #[cfg(feature = "testing")]
    pub(crate) async fn held_under(&self, prefix: &str) -> Result<u64> {
        self.inner.leases_under(prefix).await
    }

    /// Stops listening for release announcements (closes that connection).
    pub(crate) fn stop_listening(&self) {
        self.releases.stop();
    }

    /// Keys with a waiter registered for release announcements now.
    #[cfg(feature = "testing")]
    pub(crate) fn waiting_keys(&self) -> usize {
        self.releases.waiting_keys()
    }

    /// Clears `key`'s live lease, and its live read, write and permit holds, as if they had
    /// expired, and announces the release. Whether there was any.
    pub(crate) async fn take_away(&self, key: &LockKey) -> Result<bool> {
        let inner = &self.inner;
        let fail = |e| inner.error("clearing a lease", e);
        let name = key.as_str().as_bytes();
        let mut tx = inner.begin().await.map_err(fail)?;
        // The key's row first, then its holds, as every transaction over them does: no
        // acquisition is half-way through its decision while they go.
        query(&inner.sql.holds.key_lock)
            .bind(name)
            .fetch_optional(&mut *tx)
            .await
            .map_err(fail)?;
        let done = query(&inner.sql.row_clear_live)
            .bind(name)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        let shared = query(&inner.sql.holds.clear_live)
            .bind(name)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        let cleared = done.rows_affected() == 1 || shared.rows_affected() > 0;
        if cleared {
            announce_release(inner, key, &mut tx).await.map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        Ok(cleared)
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
            notified_wait: true,
            read_write: true,
            // Waiting writers' markers (see `holds`).
            writer_preference: true,
            semaphore: true,
            min_ttl: Duration::from_millis(1),
            // `timestamptz` ends in the year 294276: keep leases well inside it.
            max_ttl: Some(Duration::from_secs(100 * 365 * 24 * 3600)),
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
        match grant.kind {
            LockKind::Exclusive => renew(self, grant, ttl).await,
            _ => holds::renew(self, grant, ttl).await,
        }
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

    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        holds::holders(self, key).await
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

/// How long a row-mode waiter behind a `mode=advisory` holder waits, unless woken by its
/// release announcement, before it looks again (the holder's session may have ended
/// without one).
const ADVISORY_RECHECK: Duration = Duration::from_millis(500);

/// The ledger of a new holder: just this attempt.
fn first_attempt(req: &AcquireRequest) -> String {
    let mut attempts = AttemptLedger::new();
    attempts.add(req.attempt);
    attempts.render()
}

/// `pg_notify` of `key`'s release, delivered when `tx` commits. In a savepoint of its own:
/// an announcement that fails (a full notification queue) must not undo the release; the
/// waiters then find the key free at their next retry.
async fn announce_release(
    inner: &Db,
    key: &LockKey,
    tx: &mut sqlx::PgConnection,
) -> std::result::Result<(), sqlx::Error> {
    sqlx::raw_sql("SAVEPOINT lockkit_announce")
        .execute(&mut *tx)
        .await?;
    let announced = query(&inner.sql.notify_release)
        .bind(release_channel(&inner.config.table))
        .bind(release_payload(key.as_str()))
        .execute(&mut *tx)
        .await;
    if let Err(error) = announced {
        tracing::warn!(%error, %key, "could not announce a release; waiters find it by retrying");
        sqlx::raw_sql("ROLLBACK TO SAVEPOINT lockkit_announce")
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// Locks `key`'s row of the main table, if it has one, and reads its plain lock.
async fn lock_key_row(
    inner: &Db,
    conn: &mut sqlx::PgConnection,
    key: &LockKey,
) -> std::result::Result<Option<sqlx::postgres::PgRow>, sqlx::Error> {
    query(&inner.sql.row_select_for_update)
        .bind(key.as_str().as_bytes())
        .bind(inner.advisory_id(key))
        .fetch_optional(conn)
        .await
}

/// One acquire transaction: lock the key's row, decide, write, commit. `marker`: the
/// caller waits, and a writer refused leaves (or renews) its marker.
async fn run_acquire(
    backend: &RowLocks,
    req: &AcquireRequest,
    marker: Option<&Marker>,
    interrupt: &Interrupt,
) -> Result<Attempt> {
    let inner = &backend.inner;
    let sql = &inner.sql;
    let name = req.key.as_str().as_bytes();
    let owner = req.owner.to_string();
    let ttl = micros(req.ttl);
    let start = Instant::now();
    let fail = |e| inner.error("the acquire transaction", e);
    // A plain lock on a free key, asked by a wait that left no marker: one statement.
    if req.kind == LockKind::Exclusive && !marker.is_some_and(Marker::is_marked) {
        if caller_gone(interrupt).await {
            return Ok(Attempt::Busy { lease_left: None });
        }
        match grant_free(inner, req, &owner, ttl).await {
            Ok(Some(fence)) => {
                return Ok(Attempt::Granted(Grant::new(
                    req,
                    FencingToken::new(fence),
                    1,
                    start,
                )));
            }
            Ok(None) => {}
            // A pooled connection found dead (pooled connections used within the last
            // second are not checked first; the loss is noted, so they are now): the
            // transaction below begins on another. If the statement took effect after all
            // (its reply lost), this attempt is in the lease's ledger and the transaction
            // grants the same hold again.
            Err(e) if inner.gone(&e) => {
                tracing::debug!(error = %e, key = %req.key, "the one-statement grant lost its connection; deciding in a transaction");
            }
            Err(e) => return Err(inner.error("granting a free key", e)),
        }
    }
    let mut tx = inner.begin().await.map_err(fail)?;
    let mut row = lock_key_row(inner, &mut tx, &req.key).await.map_err(fail)?;
    if row.is_none() {
        // First use of this key: make its row (free), then lock it; a statement of its own
        // sees the row whoever made it. A plain lock too: deciding on the locked row is
        // what checks the key's advisory lock, which another session may hold.
        query(&sql.holds.key_row)
            .bind(name)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        row = lock_key_row(inner, &mut tx, &req.key).await.map_err(fail)?;
    }
    let Some(row) = row else {
        if req.kind != LockKind::Exclusive {
            tx.rollback().await.map_err(fail)?;
            return Ok(Attempt::busy(Duration::ZERO));
        }
        if caller_gone(interrupt).await {
            tx.rollback().await.map_err(fail)?;
            return Ok(Attempt::Busy { lease_left: None });
        }
        // First use of this key: create its row, already held (a key without a row has no
        // holds either: they are added under its row's lock).
        let created = query(&sql.row_insert)
            .bind(name)
            .bind(&owner)
            .bind(ttl)
            .bind(first_attempt(req))
            .bind(req.identity.encode_for(&owner))
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        if created.rows_affected() == 0 {
            // Another client created it first: try again at once.
            tx.rollback().await.map_err(fail)?;
            return Ok(Attempt::busy(Duration::ZERO));
        }
        tx.commit().await.map_err(fail)?;
        return Ok(Attempt::Granted(Grant::new(
            req,
            FencingToken::new(1),
            1,
            start,
        )));
    };
    // Readers of mode=advisory hold the key's lock shared, which the row's `live` cannot
    // see (row mode takes it shared too); they also hold the readers' lock, which only the
    // transaction holding the key's row tries (here, exclusively, to its end). Whatever the
    // row says, they hold the key: an advisory lock without a record, which only blocks.
    let (hi, lo) = inner.readers_lock(&req.key);
    let (no_readers,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_xact_lock($1, $2)")
        .bind(hi)
        .bind(lo)
        .fetch_one(&mut *tx)
        .await
        .map_err(fail)?;
    let live: bool = !no_readers || row.try_get("live").map_err(fail)?;
    let fence = fence_of(&row).map_err(fail)?;
    let holds: i32 = row.try_get("holds").map_err(fail)?;
    let holds = u32::try_from(holds).unwrap_or(0);
    let holder = row_text(&row, "owner").filter(|_| no_readers);
    let left: Option<i64> = row
        .try_get::<Option<i64>, _>("left_us")
        .map_err(fail)?
        .filter(|_| no_readers);
    if req.kind != LockKind::Exclusive {
        let plain = live.then(|| Plain {
            // A running lease of row mode, or the record of an advisory hold (no lease
            // here), names its holder; past a lease that ran out, the advisory lock that
            // keeps the key is another session's.
            owner: holder.clone().filter(|_| left.is_none_or(|left| left > 0)),
            left: left
                .filter(|left| *left > 0)
                .map(|left| Duration::from_micros(u64::try_from(left).unwrap_or(0))),
        });
        return holds::acquire(inner, tx, req, plain, marker, interrupt, start).await;
    }
    if live && holder.as_deref() == Some(owner.as_str()) {
        let mut attempts = AttemptLedger::parse(&row_text(&row, "attempts").unwrap_or_default());
        if attempts.has(req.attempt) {
            // A retry of an acquisition that took effect (its COMMIT's reply was lost): the
            // same grant again, not a second hold. Its guard counts the lease from this
            // retry, so the lease on the server runs at least that long too (never shorter),
            // even if it ran out since the SELECT above: the row lock kept everyone out.
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
    if live {
        tx.rollback().await.map_err(fail)?;
        return Ok(Attempt::busy(match left {
            Some(left) if left > 0 => Duration::from_micros(u64::try_from(left).unwrap_or(0)),
            // An advisory lock holds the key (a mode=advisory hold, or another client's):
            // no lease to wait out. A lockkit release is announced; a session that ends, or
            // another client's unlock, is not, so look again now and then.
            _ => ADVISORY_RECHECK,
        }));
    }
    // No plain lock: the key may still be held as a read-write lock or a semaphore.
    let shared = holds::live_holds(inner, &mut tx, name)
        .await
        .map_err(fail)?;
    match holds::decide(req, None, &shared) {
        Decision::New | Decision::Again(_) => {}
        Decision::Busy { left, mark } => {
            return holds::busy(inner, tx, req, left, mark, marker).await;
        }
        Decision::Refused(error) => {
            tx.rollback().await.map_err(fail)?;
            return Err(error);
        }
    }
    if caller_gone(interrupt).await {
        tx.rollback().await.map_err(fail)?;
        return Ok(Attempt::Busy { lease_left: None });
    }
    let taken: i64 = query(&sql.row_take)
        .bind(&owner)
        .bind(ttl)
        .bind(first_attempt(req))
        .bind(name)
        .bind(req.identity.encode_for(&owner))
        .fetch_one(&mut *tx)
        .await
        .map_err(fail)?
        .try_get("fence")
        .map_err(fail)?;
    if marker.is_some_and(Marker::is_marked) {
        // The wait's marker goes with the grant.
        holds::unmark_in(inner, &mut tx, &req.key, &req.attempt.to_string())
            .await
            .map_err(fail)?;
    }
    tx.commit().await.map_err(fail)?;
    Ok(Attempt::Granted(Grant::new(
        req,
        FencingToken::new(u64::try_from(taken).unwrap_or(fence + 1)),
        1,
        start,
    )))
}

/// The fast path of a plain lock: grants `req` in one statement (one round trip, one
/// commit) if the key is free of every kind of hold and nothing changed it while the
/// statement ran (see `Sql::row_grant_free`); `Ok(None)`: nothing was changed, decide in a
/// transaction. The new hold's fencing token on a grant.
async fn grant_free(
    inner: &Db,
    req: &AcquireRequest,
    owner: &str,
    ttl: i64,
) -> std::result::Result<Option<u64>, sqlx::Error> {
    let (hi, lo) = inner.readers_lock(&req.key);
    let granted = inner
        .fetch_optional_one(
            query(&inner.sql.row_grant_free)
                .bind(req.key.as_str().as_bytes())
                .bind(owner)
                .bind(ttl)
                .bind(first_attempt(req))
                .bind(req.identity.encode_for(owner))
                .bind(inner.advisory_id(&req.key))
                .bind(hi)
                .bind(lo),
        )
        .await?;
    granted.map(|row| fence_of(&row)).transpose()
}

/// Whether the caller of a detached attempt has gone (its future was dropped): an attempt
/// that would make a new hold for nobody makes none (it would only be given back, after
/// keeping the key from others meanwhile). A caller that goes later still has its grant
/// given back.
async fn caller_gone(interrupt: &Interrupt) -> bool {
    tokio::select! {
        biased;
        () = interrupt.interrupted() => true,
        () = std::future::ready(()) => false,
    }
}

/// Whether `error` is the server's request to run the transaction again (a serialization
/// failure or a deadlock it broke): the transaction was rolled back, nothing was taken.
fn server_asks_retry(error: &Error) -> bool {
    let Error::Backend {
        source: Some(source),
        ..
    } = error
    else {
        return false;
    };
    source
        .downcast_ref::<sqlx::Error>()
        .and_then(sql_state)
        .is_some_and(|c| c == state::SERIALIZATION_FAILURE || c == state::DEADLOCK)
}

/// A cancel-safe attempt: a grant whose caller has gone is given back.
async fn attempt(
    backend: &RowLocks,
    req: &AcquireRequest,
    marker: Option<Marker>,
) -> Result<Attempt> {
    let (this, request, giver) = (backend.clone(), req.clone(), backend.clone());
    let outcome = detached_acquire(
        BACKEND,
        move |interrupt| async move {
            run_acquire(&this, &request, marker.as_ref(), &interrupt).await
        },
        Attempt::into_grant,
        move |grant| async move {
            if let Err(error) = release(&giver, &grant).await {
                tracing::warn!(%error, "could not give back an orphaned grant; its lease will run out");
            }
        },
    )
    .await;
    match outcome {
        // Retry at once, as after a lost race to create the key's row.
        Err(error) if server_asks_retry(&error) => {
            tracing::debug!(%error, "the server asks for the acquire transaction again");
            Ok(Attempt::busy(Duration::ZERO))
        }
        outcome => outcome,
    }
}

async fn try_acquire(backend: &RowLocks, req: &AcquireRequest) -> Result<Option<Grant>> {
    // A row created by a racing client is not contention: retry that once.
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

/// While no release announcement can be relied on (the listener is down): the first
/// retry delay and the cap of the exponential backoff.
const FIRST_POLL: Duration = Duration::from_millis(2);
const MAX_POLL: Duration = Duration::from_millis(100);

/// Waits for the holder's release announcement or the end of its lease, whichever comes
/// first, never past the deadline; polls with capped backoff while the listener is down.
/// A writer (or a plain locker behind readers) keeps a marker while it waits, which keeps
/// new readers out; the marker goes when the wait ends, however it ends.
async fn acquire(backend: &RowLocks, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
    let policy = WaitPolicy::new(Backoff::new(FIRST_POLL, MAX_POLL));
    let mut wake = backend.releases.waiter(req.key.as_str());
    let deadline = deadline_after(wait);
    let mark = WriterMark::new(backend, req);
    let marker = (!wait.is_zero()).then(|| mark.marker());
    // An attempt stuck behind another client's open transaction ends at the deadline (the
    // server's lock_timeout ends it too); dropped, it gives back a grant it still gets.
    let granted = wait_for_grant(&req.key, wait, policy, &mut wake, || {
        let marker = marker.clone();
        async move {
            if wait.is_zero() {
                return attempt(backend, req, marker).await;
            }
            match tokio::time::timeout_at(deadline, attempt(backend, req, marker)).await {
                Ok(outcome) => outcome,
                Err(_) => Err(Error::backend(
                    BACKEND,
                    true,
                    "the acquire attempt did not finish by the deadline",
                )),
            }
        }
    })
    .await;
    if granted.is_ok() {
        mark.granted();
    }
    granted
}

async fn renew(backend: &RowLocks, grant: &Grant, ttl: Duration) -> Result<()> {
    let inner = &backend.inner;
    // Sent again on another connection if the pooled one is gone: a renewal only lengthens.
    let done = inner
        .retry_gone(|| {
            inner.execute_one(
                query(&inner.sql.row_renew)
                    .bind(micros(ttl))
                    .bind(grant.key.as_str().as_bytes())
                    .bind(grant.owner.to_string()),
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

async fn release(backend: &RowLocks, grant: &Grant) -> Result<Released> {
    if grant.kind != LockKind::Exclusive {
        return holds::release(backend, grant).await;
    }
    let inner = &backend.inner;
    let sql = &inner.sql;
    let name = grant.key.as_str().as_bytes();
    let fail = |e| inner.error("the release transaction", e);
    if !grant.attempt.is_nil() {
        // The last hold of a running lease, as a fresh grant leaves it: one statement.
        let mut ledger = AttemptLedger::new();
        ledger.add(grant.attempt);
        let released = inner
            .fetch_optional_one(
                query(&sql.row_release_last)
                    .bind(name)
                    .bind(grant.owner.to_string())
                    .bind(ledger.render())
                    .bind(release_channel(&inner.config.table))
                    .bind(release_payload(grant.key.as_str()))
                    .bind(!grant.owner_returns),
            )
            .await;
        match released {
            Ok(Some(_)) => return Ok(Released::Fully),
            // Anything else (a deeper hold, a retried release, a lease that ran out) is
            // decided in the transaction below.
            Ok(None) => {}
            // The row stayed locked past `lock_timeout`, or the statement ran past
            // `statement_timeout`: the transaction would wait as long again.
            Err(e)
                if sql_state(&e)
                    .is_some_and(|c| c == state::LOCK_NOT_AVAILABLE || c == "57014") =>
            {
                return Err(fail(e));
            }
            // The statement failed as a whole (a full notification queue): nothing was
            // changed; the transaction below lets go even when the announcement fails.
            // Or its pooled connection was gone (pooled connections used within the last
            // second are not checked first; the loss is noted, so they are now): the
            // transaction begins on another. If the statement took effect after all (its
            // reply lost), the transaction finds the lease gone (`NotHeld`), as a retry of
            // the release would.
            Err(error) if inner.gone(&error) || matches!(error, sqlx::Error::Database(_)) => {
                tracing::debug!(%error, key = %grant.key, "the one-statement release failed; releasing in a transaction");
            }
            Err(e) => return Err(fail(e)),
        }
    }
    let mut tx = inner.begin().await.map_err(fail)?;
    let row = query(&sql.row_select_for_update)
        .bind(name)
        .bind(inner.advisory_id(&grant.key))
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    let ours = row.as_ref().is_some_and(|row| {
        row.try_get::<bool, _>("live").unwrap_or(false)
            && row_text(row, "owner").as_deref() == Some(grant.owner.to_string().as_str())
    });
    let (holds, mut attempts): (u32, AttemptLedger) = match (&row, ours) {
        (Some(row), true) => (
            u32::try_from(row.try_get::<i32, _>("holds").map_err(fail)?).unwrap_or(0),
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
        announce_release(inner, &grant.key, &mut tx)
            .await
            .map_err(fail)?;
        Released::Fully
    };
    tx.commit().await.map_err(fail)?;
    Ok(outcome)
}

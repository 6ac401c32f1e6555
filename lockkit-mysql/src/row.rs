//! mode=row: the lease table.

use std::time::Duration;

use std::sync::Arc;

use async_trait::async_trait;
use lockkit_core::spi::{
    AcquireRequest, Attempt, AttemptLedger, Backoff, Grant, Polling, Released, WaitPolicy,
    detached_acquire, wait_for_grant,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    Result,
};
use sqlx::Row;
use tokio::time::Instant;

use crate::db::{
    BACKEND, Db, LOCK_NOWAIT, LOCK_WAIT_TIMEOUT, db_error, error_number, micros, query, row_text,
};

/// The lease table's locks over one database.
#[derive(Clone)]
pub(crate) struct RowLocks {
    inner: Arc<Db>,
}

impl RowLocks {
    pub(crate) fn new(db: Arc<Db>) -> Self {
        RowLocks { inner: db }
    }

    /// Live leases on keys under `prefix`, seen from a fresh connection. For leak checks.
    #[cfg(feature = "testing")]
    pub(crate) async fn held_under(&self, prefix: &str) -> Result<u64> {
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(
            self.inner.sql.live_under_prefix.clone(),
        ))
        .bind(prefix.as_bytes())
        .fetch_one(&self.inner.pool)
        .await
        .map_err(|e| db_error("counting live leases", e))?;
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
        self.inner.inspect_lease(key).await
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

/// One acquire transaction: lock the key's row, decide, write, commit.
async fn run_acquire(backend: &RowLocks, req: &AcquireRequest) -> Result<Attempt> {
    let inner = &backend.inner;
    let sql = &inner.sql;
    let name = req.key.as_str().as_bytes();
    let owner = req.owner.to_string();
    let ttl = micros(req.ttl);
    let start = Instant::now();
    let fail = |e| db_error("the acquire transaction", e);
    let mut tx = inner.pool.begin().await.map_err(fail)?;
    let row = query(&sql.row_select_for_update)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    let Some(row) = row else {
        // First use of this key: create its row, already held.
        return match query(&sql.row_insert)
            .bind(name)
            .bind(&owner)
            .bind(ttl)
            .bind(first_attempt(req))
            .bind(req.identity.encode_for(&owner))
            .execute(&mut *tx)
            .await
        {
            Ok(_) => {
                tx.commit().await.map_err(fail)?;
                Ok(Attempt::Granted(Grant::new(
                    req,
                    FencingToken::new(1),
                    1,
                    start,
                )))
            }
            // Another client created it first: try again at once.
            Err(e) if error_number(&e) == Some(1062) => Ok(Attempt::busy(Duration::ZERO)),
            Err(e) => Err(fail(e)),
        };
    };
    let live = row.try_get::<Option<i64>, _>("live").ok().flatten() == Some(1);
    let fence: u64 = row.try_get("fence").map_err(fail)?;
    let holds: u32 = row.try_get("holds").map_err(fail)?;
    let holder = row_text(&row, "owner");
    if live && holder.as_deref() == Some(owner.as_str()) {
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
    if live {
        let left = row
            .try_get::<Option<i64>, _>("left_us")
            .ok()
            .flatten()
            .unwrap_or(0);
        tx.rollback().await.map_err(fail)?;
        return Ok(Attempt::busy(Duration::from_micros(
            u64::try_from(left).unwrap_or(0),
        )));
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
                tx.rollback().await.map_err(fail)?;
                return Ok(Attempt::busy(FOR_UPDATE_HOLDER_POLL));
            }
            Err(e) => return Err(fail(e)),
        }
    }
    query(&sql.row_take)
        .bind(&owner)
        .bind(ttl)
        .bind(first_attempt(req))
        .bind(req.identity.encode_for(&owner))
        .bind(name)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    tx.commit().await.map_err(fail)?;
    Ok(Attempt::Granted(Grant::new(
        req,
        FencingToken::new(fence + 1),
        1,
        start,
    )))
}

/// How long a waiter behind a for-update holder sleeps between polls at most (that holder
/// has no lease in the table to wait out).
const FOR_UPDATE_HOLDER_POLL: Duration = Duration::from_millis(100);

/// Deadlocks are InnoDB's way of asking for a retry.
const DEADLOCK: u16 = 1213;

/// A cancel-safe attempt: a grant whose caller has gone is given back.
async fn attempt(backend: &RowLocks, req: &AcquireRequest) -> Result<Attempt> {
    let (this, request, giver) = (backend.clone(), req.clone(), backend.clone());
    detached_acquire(
        BACKEND,
        move |_| async move {
            match run_acquire(&this, &request).await {
                Err(Error::Backend {
                    source: Some(source),
                    ..
                }) if source.downcast_ref::<sqlx::Error>().and_then(error_number) == Some(DEADLOCK) => {
                    Ok(Attempt::busy(Duration::ZERO))
                }
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
    // A row created by a racing client is not contention: retry that once.
    for _ in 0..2 {
        match attempt(backend, req).await? {
            Attempt::Granted(grant) => return Ok(Some(grant)),
            Attempt::Busy {
                lease_left: Some(left),
            } if left.is_zero() => continue,
            Attempt::Busy { .. } => return Ok(None),
        }
    }
    Ok(None)
}

/// First poll delay, and the cap of the exponential backoff.
const FIRST_POLL: Duration = Duration::from_millis(2);
const MAX_POLL: Duration = Duration::from_millis(100);

/// Waits by polling with capped exponential backoff and jitter, never sleeping past the
/// holder's remaining lease or the deadline.
async fn acquire(backend: &RowLocks, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
    let policy = WaitPolicy::new(Backoff::new(FIRST_POLL, MAX_POLL));
    wait_for_grant(&req.key, wait, policy, &mut Polling, || {
        attempt(backend, req)
    })
    .await
}

async fn renew(backend: &RowLocks, grant: &Grant, ttl: Duration) -> Result<()> {
    let inner = &backend.inner;
    let done = query(&inner.sql.row_renew)
        .bind(micros(ttl))
        .bind(grant.key.as_str().as_bytes())
        .bind(grant.owner.to_string())
        .execute(&inner.pool)
        .await
        .map_err(|e| db_error("renewing the lease", e))?;
    if done.rows_affected() == 1 {
        Ok(())
    } else {
        Err(Error::NotHeld {
            key: grant.key.clone(),
        })
    }
}

async fn release(backend: &RowLocks, grant: &Grant) -> Result<Released> {
    let inner = &backend.inner;
    let sql = &inner.sql;
    let name = grant.key.as_str().as_bytes();
    let fail = |e| db_error("the release transaction", e);
    let mut tx = inner.pool.begin().await.map_err(fail)?;
    let row = query(&sql.row_select_for_update)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(fail)?;
    let ours = row.as_ref().is_some_and(|row| {
        row.try_get::<Option<i64>, _>("live").ok().flatten() == Some(1)
            && row_text(row, "owner").as_deref() == Some(grant.owner.to_string().as_str())
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

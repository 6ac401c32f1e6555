//! mode=for-update: a dedicated connection holds `SELECT ... FOR UPDATE` in an open
//! transaction; waiters queue in the server's lock manager.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use lockkit_core::spi::{
    AcquireRequest, Backoff, CountRelease, Grant, HoldCount, Interrupt, Lent, LocalHolds, Released,
    deadline_after, detached_acquire, granted_or_timeout,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LockKind, Result,
};
use sqlx::{AssertSqlSafe, Connection, MySql, Row, pool::PoolConnection};
use tokio::time::Instant;

use crate::db::{
    BACKEND, Db, HOLD_CONNECTION_WAIT, LOCK_NOWAIT, LOCK_WAIT_TIMEOUT, connection_gone, db_error,
    error_number, holder_identity, query, row_text, unreachable_error,
};

/// The holds of this client, by owner and key (reentrancy is local in this mode).
type Holds = Arc<LocalHolds<Held>>;

/// Locks held by open `SELECT ... FOR UPDATE` transactions, over one database.
#[derive(Clone)]
pub(crate) struct ForUpdateLocks {
    inner: Arc<Db>,
    held: Holds,
    /// `true` once [`ForUpdateLocks::close`] began: waiters stop waiting, and a grant that
    /// lands after it lets go at once.
    closing: Arc<tokio::sync::watch::Sender<bool>>,
}

impl ForUpdateLocks {
    pub(crate) fn new(db: Arc<Db>) -> Self {
        ForUpdateLocks {
            inner: db,
            held: Holds::default(),
            closing: Arc::new(tokio::sync::watch::Sender::new(false)),
        }
    }

    /// Ends every hold of this client by closing its connection (the server rolls the
    /// lock transaction back; each guard hears `SessionLost` from its hold's watch), and
    /// every wait (by `KILL` of its connection, as at its deadline), so that closing the
    /// pool of dedicated connections need not wait for them. A grant that lands meanwhile
    /// lets go at once. Call it after the pool of dedicated connections was marked closed,
    /// so that no new acquisition starts.
    pub(crate) async fn close(&self) {
        self.closing.send_replace(true);
        for held in self.held.all() {
            forget(self, &held);
            let mut conn = held.conn.lock().await;
            // Under the connection's lock, and only if the hold still had it: a release
            // that completed meanwhile is no loss.
            if let Some(mut taken) = conn.take() {
                held.broken.store(true, Ordering::SeqCst);
                taken.close_on_drop();
            }
        }
    }

    /// The server connection id holding `key` in this client, if any.
    pub(crate) fn connection_holding(&self, key: &LockKey) -> Option<u64> {
        self.held.any_on(key).map(|h| h.connection_id)
    }

    /// Rows under `prefix` that are locked now, probed from a fresh connection.
    #[cfg(feature = "testing")]
    pub(crate) async fn held_under(&self, prefix: &str) -> Result<u64> {
        locked_under(self, prefix).await
    }
}

impl std::fmt::Debug for ForUpdateLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForUpdateLocks")
            .field("table", &self.inner.config.table)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl LockBackend for ForUpdateLocks {
    fn info(&self) -> BackendInfo {
        let capabilities = Capabilities {
            pushes_loss: true,
            // Waiters queue in the server's lock manager.
            queued_wait: true,
            min_ttl: Duration::from_secs(1),
            max_ttl: Some(Duration::from_secs(365 * 24 * 3600)),
            ..Capabilities::default()
        };
        BackendInfo::new(BACKEND, Consistency::Cp, capabilities)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        plain_lock_only(req)?;
        acquire(self, req, Duration::ZERO).await
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        plain_lock_only(req)?;
        granted_or_timeout(&req.key, acquire(self, req, wait)).await
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
        inspect(self, key).await
    }
}

const QUERY_INTERRUPTED: u16 = 1317;

/// Refuses anything but a plain lock: this mode has no read-write locks or semaphores
/// (its capabilities say so, and the `Locker` refuses them before any I/O; this catches a
/// request sent to the backend directly, which would otherwise be taken as a plain lock).
fn plain_lock_only(req: &AcquireRequest) -> Result<()> {
    if req.kind == LockKind::Exclusive {
        return Ok(());
    }
    Err(Error::Unsupported {
        backend: BACKEND,
        what: format!(
            "{} in mode=for-update; use mode=row for read-write locks and semaphores",
            req.kind
        ),
    })
}

/// One for-update hold: its connection (inside the lock transaction) and local depth.
pub(crate) struct Held {
    conn: tokio::sync::Mutex<Option<PoolConnection<MySql>>>,
    /// When that connection left its pool (see [`Db::keep_hold_connection`]).
    out_since: std::time::Instant,
    /// The server's id of that connection (for `KILL`).
    pub(crate) connection_id: u64,
    key: LockKey,
    owner: lockkit_core::OwnerId,
    token: FencingToken,
    /// Depth, the acquisitions behind it and the lease (the session may idle out this long
    /// after it, in whole seconds rounded up).
    count: HoldCount,
    /// The connection died: the server has rolled the transaction back.
    broken: AtomicBool,
}

/// Forgets a hold that is over and closes its connection (the server rolls back).
async fn end_stale(backend: &ForUpdateLocks, held: &Held) {
    held.broken.store(true, Ordering::SeqCst);
    forget(backend, held);
    if let Some(mut conn) = held.conn.lock().await.take() {
        conn.close_on_drop();
    }
}

impl Held {
    /// Still a hold its owner may re-enter: the connection is alive and the lease is not
    /// over.
    fn is_live(&self) -> bool {
        !self.broken.load(Ordering::SeqCst) && Instant::now() < self.lease_until()
    }

    fn lease_until(&self) -> Instant {
        self.count.lease_until()
    }
}

impl Drop for Held {
    /// A hold dropped with its connection still in it (never released, never found over)
    /// ends with that connection: back in the pool it would keep the row locked.
    fn drop(&mut self) {
        if let Some(conn) = self.conn.get_mut().as_mut() {
            conn.close_on_drop();
        }
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("key", &self.key)
            .field("token", &self.token)
            .finish()
    }
}

/// Whole seconds, at least one, rounded up: the server counts these timeouts in seconds.
fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The hold behind `grant`, if it is a live hold of this client for that owner and key:
/// ownership is checked here, since the server only knows which connection holds the row.
fn held_of(backend: &ForUpdateLocks, grant: &Grant) -> Result<Arc<Held>> {
    backend.held.held_of(grant)
}

/// [`HoldCount::reenter`], with the server told first when the re-entry lengthens the lease: the
/// session's `wait_timeout` (which ends the lock when its holder goes quiet) is raised to
/// cover the new lease before the guard can believe it, so a holder paused right after a
/// longer re-entry is not cut off at the outer lease while it believes the longer one.
/// Runs under the connection's lock, so the liveness check cannot set a shorter timeout
/// in between. `Ok(None)`: the hold is over or released, ask afresh.
async fn reenter_on_server(
    held: &Held,
    req: &AcquireRequest,
    start: Instant,
) -> Result<Option<u32>> {
    let mut conn = held.conn.lock().await;
    let Some(c) = conn
        .as_mut()
        .filter(|_| !held.broken.load(Ordering::SeqCst))
    else {
        return Ok(None);
    };
    if lockkit_core::spi::lease_end(start, req.ttl) > held.lease_until() {
        let statement = format!(
            "SET SESSION wait_timeout = {}",
            whole_seconds(req.ttl).max(1)
        );
        sqlx::raw_sql(AssertSqlSafe(statement))
            .execute(&mut **c)
            .await
            .map_err(|e| db_error("lengthening the lease of a re-entry", e))?;
    }
    Ok(held
        .count
        .reenter(req, start, held.broken.load(Ordering::SeqCst)))
}

fn grant_for(req: &AcquireRequest, held: &Arc<Held>, depth: u32, start: Instant) -> Grant {
    Grant::new(req, held.token, depth, start).with_state(held.clone())
}

/// Takes the lock, waiting up to `wait` in the server's queue. `Ok(None)`: not granted in
/// time.
async fn acquire(
    backend: &ForUpdateLocks,
    req: &AcquireRequest,
    wait: Duration,
) -> Result<Option<Grant>> {
    let start = Instant::now();
    let existing = backend.held.get(req.owner, &req.key);
    if let Some(held) = existing {
        if held.is_live() {
            // Its own task, like a fresh acquisition: if the caller goes away while the
            // depth is being recorded for `inspect`, the hold it added is given back.
            let (recorder, request, giver) = (backend.clone(), req.clone(), backend.clone());
            let reentered = detached_acquire(
                BACKEND,
                move |_| async move {
                    let Some(depth) = reenter_on_server(&held, &request, start).await? else {
                        return Ok(None);
                    };
                    record_depth(&recorder, &held, depth).await;
                    Ok(Some(grant_for(&request, &held, depth, start)))
                },
                std::convert::identity,
                move |grant| async move {
                    if let Err(error) = release(&giver, &grant).await {
                        tracing::warn!(%error, "could not give back an orphaned re-entry");
                    }
                },
            )
            .await?;
            if let Some(grant) = reentered {
                return Ok(Some(grant));
            }
            // Released to depth 0 by another task of this owner just now: its connection
            // is being let go. Ask afresh.
        } else {
            // A hold that is over (its lease ran out, or its connection died): never
            // re-enter it, the server may have let someone else in. Drop it, ask afresh.
            end_stale(backend, &held).await;
        }
    }
    // Cancelling the caller interrupts the server-side wait at once.
    let (this, request, giver) = (backend.clone(), req.clone(), backend.clone());
    detached_acquire(
        BACKEND,
        move |interrupt| async move { lock(&this, &request, wait, interrupt).await },
        std::convert::identity,
        move |grant| async move {
            if let Err(error) = release(&giver, &grant).await {
                tracing::warn!(%error, "could not give back an orphaned grant");
            }
        },
    )
    .await
}

async fn lock(
    backend: &ForUpdateLocks,
    req: &AcquireRequest,
    wait: Duration,
    interrupt: Interrupt,
) -> Result<Option<Grant>> {
    let inner = &backend.inner;
    // The wait counts from the request, not from when a dedicated connection was free.
    let deadline = deadline_after(wait);
    // One round trip sets the session up, opens the lock transaction, learns the
    // connection's id (for the killer below) and tries the row lock without waiting: an
    // uncontended lock needs no round trip of its own. A pooled connection that died since
    // its last use fails before the id arrives, before anything was done: close it and take
    // another (every one of them may have died, in a server restart: up to `max_holds + 1`
    // tries).
    // `NOWAIT` covers row locks, not the table's metadata lock (which an `ALTER` queued
    // behind a holder's transaction keeps out): `lock_wait_timeout` bounds that wait, which
    // comes before the killer below exists, by the wait asked (a second at least).
    let session = format!(
        "SET SESSION wait_timeout = {}, innodb_lock_wait_timeout = {wait_s}, \
         lock_wait_timeout = {wait_s}; START TRANSACTION; \
         SELECT CONNECTION_ID(); SELECT name FROM `{}_mutex` WHERE name = X'{}' FOR UPDATE NOWAIT",
        whole_seconds(req.ttl).max(1),
        inner.config.table,
        hex(req.key.as_str().as_bytes()),
        wait_s = whole_seconds(wait).max(1),
    );
    // A try waits briefly for a dedicated connection while every one is in use; a wait,
    // until its deadline.
    let give_up = if wait.is_zero() {
        Instant::now() + HOLD_CONNECTION_WAIT
    } else {
        deadline
    };
    let mut tries = 0;
    let (lent, id, first_try) = loop {
        tries += 1;
        let lent = match inner.lend_hold_connection(give_up, &interrupt).await {
            Ok(lent) => lent,
            Err(no_connection) => {
                let waits = !wait.is_zero();
                let max_holds = inner.config.max_holds;
                return match no_connection.answer(BACKEND, "for-update", &req.key, max_holds, waits)
                {
                    Ok(answer) => answer,
                    // With room in the pool: it could not open one.
                    Err(e @ sqlx::Error::PoolTimedOut) => Err(unreachable_error(
                        "opening a dedicated connection",
                        inner.config.connect_timeout,
                        e,
                    )),
                    Err(e) => Err(db_error("opening a dedicated connection", e)),
                };
            }
        };
        let (mut conn, out_since) = (lent.conn, lent.out_since);
        let set_up = set_up_and_try(&mut conn, &session).await;
        match set_up {
            Ok((id, tried)) => {
                // Not free: a wait goes on with the waiting statement in a transaction of
                // its own. Not in the one the try opened: on MariaDB a `NOWAIT` that finds
                // the row locked is a lock wait timeout, and with
                // `innodb_rollback_on_timeout=ON` that rolls back the whole transaction,
                // leaving the session in autocommit, where a granted `FOR UPDATE` would let
                // go of the row at once.
                let first_try = match tried {
                    Err(e) if !wait.is_zero() && is_busy(&e) => None,
                    tried => Some(tried),
                };
                break (Lent { conn, out_since }, id, first_try);
            }
            Err(e) => {
                // Never back to the pool half set up.
                conn.close_on_drop();
                if tries > inner.config.max_holds || !inner.gone(&e) {
                    return Err(db_error("taking the row lock", e));
                }
            }
        }
    };
    let (mut conn, out_since) = (lent.conn, lent.out_since);
    if (!wait.is_zero() && Instant::now() >= deadline) || interrupt.is_interrupted() {
        // Lent a connection only past the deadline (the pool was full), or the caller went
        // away meanwhile: whatever the set-up's try found, take nothing (no token spent, no
        // record written).
        end_and_restore(inner, conn, out_since).await;
        return Ok(None);
    }
    // The server waits in whole seconds; the deadline and cancellation interrupt it sooner,
    // by `KILL` of this connection (a `KILL QUERY` that arrives between two statements does
    // nothing). The killer is stopped and *awaited* before the connection is used for
    // anything else, and a connection it fired at is closed, never reused.
    let (stop_killer, stopped) = tokio::sync::oneshot::channel::<()>();
    let (fire, fired) = tokio::sync::watch::channel(false);
    let killer = {
        // `KILL` goes on a connection of its own, opened for it: never behind the shared
        // pool (which statements stuck behind other transactions' row locks can fill), and
        // never a shared control connection that a partition could leave hanging.
        let (options, bound) = (inner.config.connect.clone(), inner.config.connect_timeout);
        let mut closing = backend.closing.subscribe();
        tokio::spawn(async move {
            let deadline_passes = async {
                if wait.is_zero() {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep_until(deadline).await;
            };
            tokio::select! {
                _ = deadline_passes => {}
                _ = interrupt.interrupted() => {}
                _ = closing.wait_for(|closed| *closed) => {}
                _ = stopped => return false,
            }
            fire.send_replace(true);
            let kill = async {
                let mut control = sqlx::MySqlConnection::connect_with(&options).await?;
                sqlx::raw_sql(AssertSqlSafe(format!("KILL {id}")))
                    .execute(&mut control)
                    .await?;
                control.close().await
            };
            match tokio::time::timeout(bound, kill).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::debug!(%error, "KILL of a waiter's connection failed"),
                Err(_) => tracing::debug!("KILL of a waiter's connection got no answer in time"),
            }
            true
        })
    };
    let outcome = lock_and_record(backend, req, &mut conn, wait, deadline, fired, first_try).await;
    let _ = stop_killer.send(());
    // A killer that fired is waited for no longer than its own bound (its KILL opens a
    // connection): if it has not finished by then the connection is treated as killed and
    // closed, so the waiter keeps its deadline either way.
    let killed = tokio::time::timeout(inner.config.connect_timeout, killer)
        .await
        .map_or(true, |joined| joined.unwrap_or(true));
    let (token, granted_at) = match outcome {
        _ if killed => {
            // Past the deadline or abandoned by the caller: whatever the outcome, the
            // connection may carry a pending kill. Closing it ends any lock it took.
            conn.close_on_drop();
            return Ok(None);
        }
        Ok(Some(granted)) => granted,
        Ok(None) => {
            end_and_restore(inner, conn, out_since).await;
            return Ok(None);
        }
        Err(e) => {
            if e.connection_gone {
                inner.dead_seen.note();
                conn.close_on_drop();
            } else {
                end_and_restore(inner, conn, out_since).await;
            }
            return Err(e.error);
        }
    };
    let held = Arc::new(Held {
        conn: tokio::sync::Mutex::new(Some(conn)),
        out_since,
        connection_id: id,
        key: req.key.clone(),
        owner: req.owner,
        token: FencingToken::new(token),
        count: HoldCount::new(req, granted_at),
        broken: AtomicBool::new(false),
    });
    backend
        .held
        .insert(req.owner, req.key.clone(), held.clone());
    if *backend.closing.borrow() {
        // Granted as the client closed (after `close` listed the holds): let go at once.
        end_stale(backend, &held).await;
        return Err(Error::backend(
            BACKEND,
            false,
            "the client was closed while this acquisition was granted; the lock was let go",
        ));
    }
    tokio::spawn(watch(
        backend.clone(),
        Arc::downgrade(&held),
        req.loss.clone(),
    ));
    Ok(Some(grant_for(req, &held, 1, granted_at)))
}

/// The outcome of a row-lock statement: the key's row (locked), none (the key's row does
/// not exist yet), or the error (a lock wait error when it is taken).
type LockTry = std::result::Result<Option<sqlx::mysql::MySqlRow>, sqlx::Error>;

/// Whether `e` says the row lock is taken (not a failure).
fn is_busy(e: &sqlx::Error) -> bool {
    matches!(error_number(e), Some(LOCK_WAIT_TIMEOUT | LOCK_NOWAIT))
}

/// Runs `session` (the set-up, `SELECT CONNECTION_ID()`, then the row lock's `NOWAIT` try)
/// on `conn`. `Err`: the set-up failed before the connection's id arrived (nothing was
/// done). `Ok((id, try))`: the id, and how the try ended.
async fn set_up_and_try(
    conn: &mut PoolConnection<MySql>,
    session: &str,
) -> std::result::Result<(u64, LockTry), sqlx::Error> {
    use futures_util::TryStreamExt as _;
    let mut results = sqlx::raw_sql(AssertSqlSafe(session.to_owned())).fetch_many(&mut **conn);
    let mut rows = Vec::with_capacity(2);
    let ended = loop {
        match results.try_next().await {
            Ok(Some(sqlx::Either::Right(row))) => rows.push(row),
            Ok(Some(sqlx::Either::Left(_))) => {}
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    drop(results);
    let mut rows = rows.into_iter();
    let Some(first) = rows.next() else {
        return Err(ended.err().unwrap_or(sqlx::Error::RowNotFound));
    };
    let id = first.try_get::<u64, _>(0)?;
    Ok((id, ended.map(|()| rows.next())))
}

/// Puts the server's defaults of `wait_timeout` and `lock_wait_timeout` back on a connection
/// about to return to the pool (a hold or a waiter set them to its lease and its wait); sent
/// with the connection's last statement, never as a round trip of its own.
pub(crate) const RESTORE_SESSION: &str = "SET SESSION wait_timeout = @@GLOBAL.wait_timeout, \
     lock_wait_timeout = @@GLOBAL.lock_wait_timeout";

/// Ends the transaction of a connection that took no lock (or whose lock is not wanted) and
/// makes it fit for the pool again, in one round trip, then keeps it for the next hold or
/// gives it back ([`Db::keep_hold_connection`]); a connection where that fails is closed
/// instead.
async fn end_and_restore(
    inner: &Db,
    mut conn: PoolConnection<MySql>,
    out_since: std::time::Instant,
) {
    let statement = format!("ROLLBACK; {RESTORE_SESSION}");
    match sqlx::raw_sql(AssertSqlSafe(statement))
        .execute(&mut *conn)
        .await
    {
        Ok(_) => inner.keep_hold_connection(Lent { conn, out_since }),
        Err(_) => conn.close_on_drop(),
    }
}

/// Why [`lock_and_record`] failed, and whether the connection went with it.
struct LockFailure {
    error: Error,
    connection_gone: bool,
}

impl LockFailure {
    fn new(doing: &str, e: sqlx::Error) -> Self {
        LockFailure {
            connection_gone: connection_gone(&e),
            error: db_error(doing, e),
        }
    }
}

/// How long a for-update waiter sleeps between looks at a row-mode lease on its key (that
/// holder is not in the server's lock queue).
const ROW_LEASE_POLL: Duration = Duration::from_millis(100);

/// Takes the key's mutex row lock on `conn` (waiting in the server's queue) and records
/// this holder and its new fencing token. `Ok(None)`: not granted by the deadline (or
/// `fired` says the killer interrupted the wait). The caller ends the transaction on
/// every path but a grant.
async fn lock_and_record(
    backend: &ForUpdateLocks,
    req: &AcquireRequest,
    conn: &mut PoolConnection<MySql>,
    wait: Duration,
    deadline: Instant,
    mut fired: tokio::sync::watch::Receiver<bool>,
    mut first_try: Option<LockTry>,
) -> std::result::Result<Option<(u64, Instant)>, LockFailure> {
    let inner = &backend.inner;
    let name = req.key.as_str().as_bytes();
    let statement = if wait.is_zero() {
        &inner.sql.mutex_lock_nowait
    } else {
        &inner.sql.mutex_lock
    };
    let mut row_lease_poll = Backoff::new(ROW_LEASE_POLL, ROW_LEASE_POLL);
    // The caller's set-up opened the first transaction, which only the set-up's own try
    // may use (a `START TRANSACTION` ends it otherwise).
    let mut in_transaction = first_try.is_some();
    loop {
        if *fired.borrow() {
            return Ok(None);
        }
        let mut locked = Ok(None);
        for _ in 0..2 {
            let begun = if std::mem::take(&mut in_transaction) {
                Ok(Default::default())
            } else {
                sqlx::raw_sql("START TRANSACTION")
                    .execute(&mut **conn)
                    .await
            };
            locked = match (begun, first_try.take()) {
                // The set-up's try, in the transaction it opened.
                (_, Some(tried)) => tried,
                (Ok(_), None) => {
                    query(statement)
                        .bind(name)
                        .fetch_optional(&mut **conn)
                        .await
                }
                (Err(e), None) => Err(e),
            };
            if !matches!(locked, Ok(None)) {
                break;
            }
            // First use of this key: create its row outside any transaction, then lock it.
            let _ = sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await;
            locked = query(&inner.sql.mutex_insert)
                .bind(name)
                .execute(&mut **conn)
                .await
                .map(|_| None);
            if locked.is_err() {
                break;
            }
        }
        match locked {
            Ok(Some(_)) => {}
            Ok(None) => {
                return Err(LockFailure {
                    error: Error::backend(
                        BACKEND,
                        true,
                        format!("the lock row of `{}` could not be created", req.key),
                    ),
                    connection_gone: false,
                });
            }
            Err(e)
                if matches!(
                    error_number(&e),
                    Some(LOCK_WAIT_TIMEOUT | LOCK_NOWAIT | QUERY_INTERRUPTED)
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(LockFailure::new("taking the row lock", e)),
        }
        // On a pooled connection, where the killer cannot reach: it may wait behind a
        // row-mode transaction, so the deadline and the caller's going away end it too.
        let recorded = tokio::select! {
            recorded = record_holder(backend, req) => recorded,
            _ = fired.wait_for(|fired| *fired) => return Ok(None),
        };
        if let Some(token) = recorded
            .map_err(|e| LockFailure::new("recording the holder and its fencing token", e))?
        {
            // The token was committed on another connection: make sure this one (and so
            // the lock) was still there afterwards. Had it died in between, the next holder
            // could already hold a smaller token than ours. The lease starts before this
            // request: the server counts `wait_timeout` from its reply.
            let confirming_at = Instant::now();
            sqlx::raw_sql("DO 0")
                .execute(&mut **conn)
                .await
                .map_err(|e| LockFailure::new("confirming the row lock", e))?;
            return Ok(Some((token, confirming_at)));
        }
        // A row-mode lease (mode=row shares the table) holds the key: wait it out.
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await;
        let now = Instant::now();
        if wait.is_zero() || now >= deadline {
            return Ok(None);
        }
        tokio::select! {
            _ = tokio::time::sleep_until((now + row_lease_poll.next_delay()).min(deadline)) => {}
            _ = fired.wait_for(|fired| *fired) => return Ok(None),
        }
    }
}

/// Records `req`'s owner as the holder with a new fencing token, committed at once on a
/// pooled connection ([`Db::execute_one`]: a kept one when there is, with no give-back
/// ping), outside the lock transaction: if this holder's transaction rolls
/// back, its token stays used. `Ok(None)`: a live row-mode lease holds the key; nothing
/// was changed.
async fn record_holder(
    backend: &ForUpdateLocks,
    req: &AcquireRequest,
) -> std::result::Result<Option<u64>, sqlx::Error> {
    let inner = &backend.inner;
    let (name, owner) = (req.key.as_str().as_bytes(), req.owner.to_string());
    let identity = req.identity.encode_for(&owner);
    // Each statement is sent again if its pooled connection turns out dead: this holder
    // has the key's lock, so a take repeated only spends a token more, and an insert
    // repeated finds its own record (`take_weighing_holds` takes it).
    let taken = inner
        .retry_gone(|| {
            inner.execute_one(
                query(&inner.sql.holder_take)
                    .bind(owner.clone())
                    .bind(identity.clone())
                    .bind(name.to_vec()),
            )
        })
        .await?;
    if taken.rows_affected() == 1 {
        return Ok(Some(taken.last_insert_id()));
    }
    // No row yet, or a live lease or row-mode holds to weigh.
    match inner
        .retry_gone(|| {
            inner.execute_one(
                query(&inner.sql.holder_insert)
                    .bind(name.to_vec())
                    .bind(owner.clone())
                    .bind(identity.clone()),
            )
        })
        .await
    {
        Ok(_) => Ok(Some(1)),
        Err(e) if error_number(&e) == Some(DUPLICATE_KEY) => {
            take_weighing_holds(inner, name, &owner, &identity).await
        }
        Err(e) => Err(e),
    }
}

/// The record of a for-update holder whose key's row has mode=row holds (or a lease) to
/// weigh, decided under that row's lock as mode=row's acquisitions decide: expired read,
/// write and permit holds are deleted, each by a locking delete that waits for a renewal
/// in flight and then sees it (`holder_take` alone, whose read of the holds is not a
/// locking one, never takes the record while such a row exists); a live hold or lease
/// holds the key (`Ok(None)`).
async fn take_weighing_holds(
    inner: &Db,
    name: &[u8],
    owner: &str,
    identity: &str,
) -> std::result::Result<Option<u64>, sqlx::Error> {
    let sql = &inner.sql;
    let mut tx = inner.begin().await?;
    let row = query(&sql.row_select_for_update)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
    let free = row
        .as_ref()
        .is_some_and(|row| row.try_get::<Option<i64>, _>("live").ok().flatten() != Some(1));
    if !free {
        tx.rollback().await?;
        return Ok(None);
    }
    for hold in query(&sql.holds_of_key)
        .bind(name)
        .fetch_all(&mut *tx)
        .await?
    {
        let kind: String = hold.try_get("kind")?;
        if !matches!(kind.as_str(), "r" | "w" | "p") {
            continue;
        }
        let live = hold.try_get::<Option<i64>, _>("live")?.unwrap_or(0) == 1;
        let over = !live
            && query(&sql.holds_delete_expired)
                .bind(name)
                .bind(&kind)
                .bind(hold.try_get::<String, _>("holder")?)
                .execute(&mut *tx)
                .await?
                .rows_affected()
                == 1;
        if !over {
            tx.rollback().await?;
            return Ok(None);
        }
    }
    let taken = query(&sql.holder_take)
        .bind(owner)
        .bind(identity)
        .bind(name)
        .execute(&mut *tx)
        .await?;
    if taken.rows_affected() != 1 {
        tx.rollback().await?;
        return Ok(None);
    }
    tx.commit().await?;
    Ok(Some(taken.last_insert_id()))
}

const DUPLICATE_KEY: u16 = 1062;

/// Checks the hold's connection every `liveness` and fires the loss signal the moment it
/// is gone: the server has then rolled the lock transaction back. Each check also sets the
/// session's `wait_timeout` to what is left of the lease, so the checks never keep a lease
/// alive that its holder stopped renewing: the server ends the session when it runs out.
async fn watch(
    backend: ForUpdateLocks,
    held: std::sync::Weak<Held>,
    loss: lockkit_core::LossSignal,
) {
    let every = backend.inner.config.liveness;
    loop {
        tokio::time::sleep(every).await;
        let Some(held) = held.upgrade() else { return };
        if held.lease_until() <= Instant::now() {
            // Not renewed in time: the hold is over. Close its connection now (the server
            // would only end it at wait_timeout), free its slot and map entry, and say so.
            end_stale(&backend, &held).await;
            loss.fire(lockkit_core::LostReason::LeaseExpired);
            return;
        }
        let mut conn = held.conn.lock().await;
        let Some(c) = conn.as_mut() else {
            // Released (nothing to say), or ended by the client's close: say so.
            if held.broken.load(Ordering::SeqCst) {
                loss.fire(lockkit_core::LostReason::SessionLost);
            }
            return;
        };
        // Read under the connection's lock: a re-entry or renewal that lengthened the lease
        // meanwhile has told the server, and this must not set a shorter timeout after it.
        let left = held.lease_until().saturating_duration_since(Instant::now());
        match set_wait_timeout(&backend, c, whole_seconds(left).max(1)).await {
            Ok(()) => {}
            Err(Some(error)) if !backend.inner.gone(&error) => {
                tracing::debug!(%error, "liveness check failed; retrying");
            }
            // Gone, or silent past the bound.
            Err(_) => {
                held.broken.store(true, Ordering::SeqCst);
                if let Some(mut dead) = conn.take() {
                    dead.close_on_drop();
                }
                drop(conn);
                forget(&backend, &held);
                loss.fire(lockkit_core::LostReason::SessionLost);
                return;
            }
        }
    }
}

/// Sets the `wait_timeout` of a hold's connection to `seconds`, answered within the
/// client's `connect_timeout`. `Err(None)`: no answer in time, from a link gone silent (a
/// partition, a stalled proxy: no error comes, and none may for many minutes). The
/// connection is then in the middle of a statement: the caller closes it and the hold is
/// over. Without the bound, the statement kept the hold's connection locked for as long as
/// the link stayed silent, and with it the hold's renewals, its release and the client's
/// `close()` (helper-31's review, F1).
async fn set_wait_timeout(
    backend: &ForUpdateLocks,
    conn: &mut sqlx::MySqlConnection,
    seconds: u64,
) -> std::result::Result<(), Option<sqlx::Error>> {
    let statement = format!("SET SESSION wait_timeout = {seconds}");
    let answer = tokio::time::timeout(
        backend.inner.config.connect_timeout,
        sqlx::raw_sql(AssertSqlSafe(statement)).execute(conn),
    )
    .await;
    match answer {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(Some(e)),
        Err(_) => Err(None),
    }
}

/// Best effort: shows the depth to `inspect`.
async fn record_depth(backend: &ForUpdateLocks, held: &Held, depth: u32) {
    let inner = &backend.inner;
    // Best effort, and bounded: it only feeds `inspect`, and a link gone silent must not
    // hold up the re-entry or release whose depth it records.
    let record = query(&inner.sql.holder_depth)
        .bind(depth)
        .bind(held.key.as_str().as_bytes())
        .bind(held.owner.to_string())
        .bind(held.token.get())
        .execute(&inner.pool);
    let _ = tokio::time::timeout(inner.config.connect_timeout, record).await;
}

fn forget(backend: &ForUpdateLocks, held: &Held) {
    backend.held.forget(held.owner, &held.key, held);
}

/// Keeps the dedicated connection busy (so `wait_timeout` does not end it) and sets the
/// lease to `ttl`. A dead connection means the server already rolled back: `NotHeld`.
async fn renew(backend: &ForUpdateLocks, grant: &Grant, ttl: Duration) -> Result<()> {
    let held = held_of(backend, grant)?;
    let mut conn = held.conn.lock().await;
    let Some(c) = conn
        .as_mut()
        .filter(|_| !held.broken.load(Ordering::SeqCst))
    else {
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    };
    let start = Instant::now();
    // Never shorten the lease: another guard of this hold may rely on it. The server's
    // timeout covers the whole of it, not just `ttl`.
    let until = held
        .lease_until()
        .max(lockkit_core::spi::lease_end(start, ttl));
    let seconds = whole_seconds(until.saturating_duration_since(start)).max(1);
    match set_wait_timeout(backend, c, seconds).await {
        Ok(()) => {
            held.count.extend_lease(until);
            Ok(())
        }
        Err(Some(e)) if !backend.inner.gone(&e) => {
            Err(db_error("keeping the lock connection alive", e))
        }
        // Gone, or silent past the bound: the session (and the lock with it) is over, by
        // the server or by this close. Said as such before the `NotHeld` (which the guard
        // would report as taken away); the first reason fired wins.
        Err(_) => {
            held.broken.store(true, Ordering::SeqCst);
            if let Some(mut dead) = conn.take() {
                dead.close_on_drop();
            }
            forget(backend, &held);
            grant.loss.fire(lockkit_core::LostReason::SessionLost);
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        }
    }
}

async fn release(backend: &ForUpdateLocks, grant: &Grant) -> Result<Released> {
    let held = held_of(backend, grant)?;
    if held.broken.load(Ordering::SeqCst) {
        forget(backend, &held);
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    }
    match held.count.release(grant.attempt) {
        // A retried release: it took effect already.
        CountRelease::Retried { remaining } => return Ok(Released::Partially { remaining }),
        CountRelease::Partial { remaining } => {
            record_depth(backend, &held, remaining).await;
            return Ok(Released::Partially { remaining });
        }
        CountRelease::Empty => {
            return Err(Error::NotHeld {
                key: grant.key.clone(),
            });
        }
        CountRelease::Last => {}
    }
    forget(backend, &held);
    let mut conn = held.conn.lock().await;
    let Some(c) = conn.take() else {
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    };
    // A release dropped before its statement ran must not put a connection still in the
    // lock transaction back in the pool.
    let mut guard = ClosedIfDropped(Some(c));
    let Some(c) = guard.0.as_mut() else {
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    };
    // One round trip: clear the holder record inside the lock transaction (so the row lock
    // keeps the next holder out until the record is gone), commit (which ends the lock),
    // and make the connection fit for the pool again.
    let (name, owner) = (held.key.as_str().as_bytes(), held.owner.to_string());
    // The record is this hold's own (its token, no expiry: a for-update record), never a
    // later holder's of the same owner.
    let fence = held.token.get();
    let statement = format!(
        "UPDATE `{}` SET owner = NULL, holds = 0, holder = NULL \
         WHERE name = X'{}' AND owner = X'{}' AND fence = {fence} AND expires_at IS NULL; \
         COMMIT; {RESTORE_SESSION}",
        backend.inner.config.table,
        hex(name),
        hex(owner.as_bytes())
    );
    let Err(e) = sqlx::raw_sql(AssertSqlSafe(statement))
        .execute(&mut **c)
        .await
    else {
        // Committed, and the session's defaults back: kept for the next hold, or back
        // to the pool.
        if let Some(conn) = guard.0.take() {
            backend.inner.keep_hold_connection(Lent {
                conn,
                out_since: held.out_since,
            });
        }
        return Ok(Released::Fully);
    };
    if backend.inner.gone(&e) {
        // The server ended the transaction when the connection died: the lock was
        // already gone.
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    }
    // The record could not be cleared in the transaction (say, its row stayed locked past
    // the session's lock wait): end the lock anyway, then clear the record on its own,
    // best effort, as `inspect` and mode=row treat a record whose row is unlocked as over.
    if let Err(e) = sqlx::raw_sql(AssertSqlSafe(format!("ROLLBACK; {RESTORE_SESSION}")))
        .execute(&mut **c)
        .await
    {
        return if connection_gone(&e) {
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        } else {
            Err(db_error("ending the lock transaction", e))
        };
    }
    // Back to the pool (which checks it).
    drop(guard.0.take());
    tracing::debug!(error = %e, "clearing the holder record in the lock transaction failed");
    #[cfg(feature = "testing")]
    release_clear_pause().await;
    // The lock is over: the same owner may hold the key again by now, with a record of its
    // own, which only this hold's token tells apart.
    let inner = &backend.inner;
    let _ = inner
        .retry_gone(|| {
            query(&inner.sql.holder_clear)
                .bind(name.to_vec())
                .bind(owner.clone())
                .bind(fence)
                .execute(&inner.pool)
        })
        .await;
    Ok(Released::Fully)
}

/// Test hook: a pause between a release's `ROLLBACK` (after the holder record could not be
/// cleared in the lock transaction) and its clearing of the record on its own (zero: none).
#[cfg(feature = "testing")]
static RELEASE_CLEAR_PAUSE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Sets the pause of a for-update release between the end of its lock transaction and its
/// clearing of the holder record, when that record could not be cleared inside the
/// transaction (test hook).
#[cfg(feature = "testing")]
pub fn set_release_clear_pause(pause: Duration) {
    RELEASE_CLEAR_PAUSE_MS.store(
        u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
        Ordering::SeqCst,
    );
}

#[cfg(feature = "testing")]
async fn release_clear_pause() {
    let ms = RELEASE_CLEAR_PAUSE_MS.load(Ordering::SeqCst);
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// A pooled connection that is closed rather than given back to the pool when dropped
/// before its last statement ran (then the caller takes it out).
struct ClosedIfDropped(Option<PoolConnection<MySql>>);

impl Drop for ClosedIfDropped {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

/// `bytes` as hexadecimal digits, for an `X'...'` literal.
fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

async fn inspect(backend: &ForUpdateLocks, key: &LockKey) -> Result<Option<HolderInfo>> {
    let name = key.as_str().as_bytes();
    if !backend.inner.is_locked(name).await? {
        // A row-mode lease on the key (mode=row shares the table) holds it too.
        return backend.inner.inspect_lease(key).await;
    }
    let inner = &backend.inner;
    let row = inner
        .retry_gone(|| {
            query(&inner.sql.holder_read)
                .bind(name.to_vec())
                .fetch_optional(&inner.pool)
        })
        .await
        .map_err(|e| inner.fail("reading the holder record", e))?;
    Ok(Some(match row {
        Some(row) => HolderInfo::new(
            row_text(&row, "owner").unwrap_or_else(|| "an unknown holder".into()),
            row.try_get("holds").unwrap_or(1),
            row.try_get::<u64, _>("fence").ok().map(FencingToken::new),
            None,
        )
        .with_identity(holder_identity(&row)),
        None => HolderInfo::new("an unknown holder", 1, None, None),
    }))
}

/// Rows under `prefix` that are locked now.
#[cfg(feature = "testing")]
async fn locked_under(backend: &ForUpdateLocks, prefix: &str) -> Result<u64> {
    let inner = &backend.inner;
    let rows = query(&inner.sql.mutex_rows_under_prefix)
        .bind(prefix.as_bytes())
        .fetch_all(&inner.pool)
        .await
        .map_err(|e| db_error("listing lock rows", e))?;
    let mut locked = 0;
    for row in rows {
        let name: Vec<u8> = row
            .try_get("name")
            .map_err(|e| db_error("reading a lock row", e))?;
        if backend.inner.is_locked(&name).await? {
            locked += 1;
        }
    }
    Ok(locked)
}

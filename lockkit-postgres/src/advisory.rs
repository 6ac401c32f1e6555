//! mode=advisory: a dedicated connection per hold holds `pg_advisory_lock(<key id>)`;
//! waiters queue in the server's lock manager.
//!
//! - **Read-write locks.** A writer takes the key's lock as a plain lock does
//!   (`pg_advisory_lock`), so a plain lock and a writer exclude each other; a reader takes
//!   it shared (`pg_advisory_lock_shared`), and also holds the key's readers' lock
//!   ([`Db::readers_lock`]) shared, which is how row mode sees advisory readers. The
//!   server queues a new shared request behind a waiting exclusive one (the `waitMask`
//!   check of `LockAcquire`), `pg_try_advisory_lock_shared` included: writer preference.
//!   A downgrade (an owner that writes takes read) runs on the write's own connection: a
//!   second session would wait for its own owner's write; on the same session the server
//!   grants it at once, ahead of any queued writer. That connection then carries both
//!   holds (a [`Session`]) until the last of them ends. Upgrades answer `WouldDeadlock`.
//! - **Semaphores** are not offered: see `docs/design/rwlock-semaphore.md` §6.8.
//!
//! - **Key.** [`advisory_id`](crate::advisory_id): 64 bits of SHA-256 of
//!   `lockkit:<table>:<key>`, so each table is a namespace of its own.
//! - **Wait.** The server's `lock_timeout` ends a wait at its deadline. A caller that goes
//!   away has the waiting backend terminated (`pg_terminate_backend`) from an idle pooled
//!   connection if one answers at once, else from a connection opened for that, and the
//!   waiting connection is never reused.
//! - **Lease.** The session's `idle_session_timeout` (PostgreSQL 14+): a holder that stops
//!   talking (paused, cut off) has its session, and so its lock, ended by the server when
//!   its lease runs out. A liveness check sets it to what is left of the lease every
//!   `liveness`, and notices a connection that died.
//! - **Fencing token.** The key's row in the lease table: its `fence` is raised and
//!   committed by the lock's own connection once the lock is held (so a session that lost
//!   the lock writes nothing). The row's `expires_at = 'infinity'` marks an advisory hold,
//!   and `mode=row` clients also stay out of a key whose advisory lock any session holds;
//!   a live row-mode lease makes an advisory holder let go and wait it out.

use std::{
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use lockkit_core::spi::{
    AcquireRequest, Backoff, CountRelease, Grant, HoldCount, Interrupt, KeptConnections, Lent,
    LocalHolds, NoConnection, Released, deadline_after, detached_acquire, granted_or_timeout,
    sweep_while,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LockKind, LostReason, Result,
};
use sqlx::{
    AssertSqlSafe, Connection, PgPool, Postgres, Row,
    pool::PoolConnection,
    postgres::{PgConnection, PgPoolOptions},
};
use tokio::time::Instant;

use crate::db::{
    BACKEND, Db, DeadSeen, KEPT_AT_MOST, PING_AFTER_LOSS, PING_IDLE_AFTER, advisory_release_script,
    connection_gone, db_error, ping_if_idle, pool_timed_out, query, release_channel, row_text,
    sql_state,
};
use crate::row::notify::release_payload;

/// The holds of this client, by owner, key and kind (reentrancy is local in this mode).
type Holds = Arc<Registry>;

/// An owner's plain lock, read and write of one key are holds of their own (a downgrade is
/// a read beside the owner's write).
#[derive(Default)]
struct Registry {
    plain: LocalHolds<Held>,
    reads: LocalHolds<Held>,
    writes: LocalHolds<Held>,
}

impl Registry {
    /// The holds of `kind` (a permit never gets this far).
    fn of(&self, kind: LockKind) -> &LocalHolds<Held> {
        match kind {
            LockKind::Read => &self.reads,
            LockKind::Write => &self.writes,
            _ => &self.plain,
        }
    }

    fn all(&self) -> Vec<Arc<Held>> {
        let mut all = self.plain.all();
        all.extend(self.reads.all());
        all.extend(self.writes.all());
        all
    }

    /// `owner`'s hold of `kind` on `key`, if it is live.
    fn live(
        &self,
        owner: lockkit_core::OwnerId,
        key: &LockKey,
        kind: LockKind,
    ) -> Option<Arc<Held>> {
        self.of(kind).get(owner, key).filter(|held| held.is_live())
    }
}

/// The longest lease: `idle_session_timeout` is a 32-bit count of milliseconds.
const MAX_LEASE: Duration = Duration::from_millis(i32::MAX as u64);

/// How long after its deadline a waiter is terminated if the server's `lock_timeout` has
/// not ended its wait (a wait too long for `lock_timeout`, or a server that is slow).
const DEADLINE_GRACE: Duration = Duration::from_secs(1);

/// How long the end of an abandoned waiter's session is tried from an idle pooled
/// connection before a connection is opened for it.
const QUICK_TERMINATE: Duration = Duration::from_millis(500);

/// How long a try (an acquisition that does not wait) waits for a dedicated connection to
/// come free while every one is in use, before it answers that they are.
const TRY_PATIENCE: Duration = Duration::from_millis(100);

/// How long an advisory waiter behind a row-mode lease sleeps between looks.
const ROW_LEASE_POLL: Duration = Duration::from_millis(100);

/// Every dedicated connection's session: statements may wait as long as the lock wait
/// asks (`lock_timeout` is set per wait), and nothing is left idle in a transaction. The
/// backend's start, which names it for the terminator with its pid, is read once, into
/// the session's `lockkit.backend_start` (reading it from the server's activity table
/// for every acquisition cost more than the rest of that statement).
const SESSION: &str = "SET statement_timeout = 0; SET lock_timeout = 0; \
     SET idle_in_transaction_session_timeout = '5s'; SET idle_session_timeout = 0; \
     SELECT set_config('lockkit.backend_start', backend_start::text, false) \
     FROM pg_stat_get_activity(pg_backend_pid())";

/// Locks held by `pg_advisory_lock` on dedicated connections, over one database.
#[derive(Clone)]
pub(crate) struct AdvisoryLocks {
    inner: Arc<Db>,
    /// Dedicated connections: one per hold and per waiter.
    dedicated: Arc<Dedicated>,
    held: Holds,
    /// `true` once [`AdvisoryLocks::close`] began: waiters stop waiting, and a grant that
    /// lands after it lets go at once.
    closing: Arc<tokio::sync::watch::Sender<bool>>,
}

/// The pool of dedicated connections, and those kept out of it between holds.
///
/// sqlx checks every connection given back to its pool (a round trip, in a task of its
/// own): a connection whose hold ended cleanly (the release let go of every lock on it and
/// cleared its lease and name, in one statement) is kept for the next acquisition instead,
/// a few at a time, as the shared pool's one-statement calls do ([`KeptConnections`]). A
/// kept connection goes back to the pool once it idled [`PING_IDLE_AFTER`] (the pool then
/// checks it before lending it again), or was out [`KEPT_AT_MOST`]; every one goes back
/// when the pool closes or a connection was seen gone lately. An acquisition takes a kept
/// connection before asking the pool, and a connection is kept only while the pool has one
/// to spare, so none waits for a connection that sits kept.
struct Dedicated {
    pool: PgPool,
    /// The pool's size (`max_holds`).
    max: u32,
    kept: KeptConnections<PoolConnection<Postgres>>,
    dead_seen: Arc<DeadSeen>,
}

impl Dedicated {
    /// Whether every kept connection must go back to the pool now.
    fn return_all_kept(&self) -> bool {
        self.pool.is_closed() || self.dead_seen.within(PING_AFTER_LOSS)
    }

    /// Whether every dedicated connection is open and lent out: a caller of the pool waits
    /// for one to come back.
    fn all_in_use(&self) -> bool {
        self.pool.size() >= self.max && self.pool.num_idle() == 0
    }

    /// A connection for an acquisition that stops waiting for one at `give_up`: a kept one
    /// or the pool's; while every connection is in use, one that
    /// comes back before `give_up` (see [`KeptConnections::lend_by`]). An acquisition
    /// takes nothing past its deadline (see [`prepared_connection`]).
    async fn lend_by(
        &self,
        give_up: Instant,
        interrupt: &Interrupt,
    ) -> std::result::Result<Lent<PoolConnection<Postgres>>, NoConnection<sqlx::Error>> {
        self.kept
            .lend_by(
                || self.return_all_kept(),
                || self.pool.acquire(),
                |e| matches!(e, sqlx::Error::PoolTimedOut),
                || self.all_in_use(),
                give_up,
                interrupt,
            )
            .await
    }

    /// Keeps `conn`, which holds no lock, no lease and no name (a statement that let go of
    /// all of them just completed on it), for the next acquisition, if there is room and
    /// the pool can spare it (an idle connection, or room to open one: else a caller may be
    /// waiting for a connection, and gets this one); otherwise it goes back to the pool.
    fn keep_clean(&self, conn: PoolConnection<Postgres>, out_since: std::time::Instant) {
        let lent = Lent { conn, out_since };
        let spare = self.pool.num_idle() > 0 || self.pool.size() < self.max;
        self.kept.keep(lent, || spare && !self.return_all_kept());
    }
}

impl Drop for Dedicated {
    /// Kept connections go back to the pool, or are closed in place outside a runtime
    /// ([`KeptConnections::drop_all`]).
    fn drop(&mut self) {
        self.kept.drop_all(|conn| drop(conn.detach()));
    }
}

impl AdvisoryLocks {
    /// Opens (lazily) the pool of dedicated connections, after checking that the server
    /// has `idle_session_timeout`.
    pub(crate) async fn new(db: Arc<Db>) -> Result<Self> {
        if let Err(e) = sqlx::query("SELECT current_setting('idle_session_timeout')")
            .execute(&db.pool)
            .await
        {
            return Err(if sql_state(&e).as_deref() == Some("42704") {
                Error::Config(
                    "mode=advisory needs PostgreSQL 14 or later (its lease is the session's \
                     idle_session_timeout); use mode=row on this server"
                        .into(),
                )
            } else {
                db.error("checking the server's idle_session_timeout", e)
            });
        }
        let seen = db.dead_seen.clone();
        let holds_pool = PgPoolOptions::new()
            .max_connections(db.config.max_holds)
            .min_connections(0)
            .acquire_timeout(db.config.connect_timeout)
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                let seen = seen.clone();
                Box::pin(async move { ping_if_idle(conn, meta, &seen).await })
            })
            .after_connect(|conn, _| {
                Box::pin(async move { sqlx::raw_sql(SESSION).execute(conn).await.map(|_| ()) })
            })
            .connect_lazy_with(db.config.connect.clone());
        let dedicated = Arc::new(Dedicated {
            pool: holds_pool,
            max: db.config.max_holds,
            kept: KeptConnections::new(
                usize::try_from(db.config.max_holds / 4).unwrap_or(0),
                PING_IDLE_AFTER,
                KEPT_AT_MOST,
            ),
            dead_seen: db.dead_seen.clone(),
        });
        if dedicated.kept.at_most() > 0 {
            // Gives back idle kept connections while the client lives and its pool is open.
            tokio::spawn(sweep_while(
                Arc::downgrade(&dedicated),
                PING_IDLE_AFTER,
                |dedicated: &Dedicated| {
                    dedicated.kept.sweep(dedicated.return_all_kept());
                    !dedicated.pool.is_closed()
                },
            ));
        }
        Ok(AdvisoryLocks {
            inner: db,
            dedicated,
            held: Holds::default(),
            closing: Arc::new(tokio::sync::watch::Sender::new(false)),
        })
    }

    /// Ends every hold of this client (each guard hears `SessionLost`) and every wait (its
    /// session terminated, as at its deadline), and closes the dedicated connections. A
    /// grant that lands meanwhile lets go at once.
    pub(crate) async fn close(&self) {
        // Closed first (sqlx marks the pool closed when `close` is called), so that no
        // acquisition starts and a release completing meanwhile does not keep its
        // connection; then the holds and waits end and the kept connections go back (the
        // close waits for every connection out of the pool).
        let closing = self.dedicated.pool.close();
        self.closing.send_replace(true);
        for held in self.held.all() {
            // Not `ended` (that is a release): its watch hears the closed session.
            forget(self, &held);
            end_session(&held.session, &mut *held.session.conn.lock().await);
        }
        drop(self.dedicated.kept.take_all());
        closing.await;
    }

    /// Operator action: ends the session holding `key`'s advisory lock (whoever it is).
    /// Whether there was one.
    pub(crate) async fn take_away(&self, key: &LockKey) -> Result<bool> {
        let inner = &self.inner;
        // One statement: the session is ended while it holds the lock, never a session
        // that let go (or a new one that reused its pid) after a separate look.
        let (ended,): (i64,) = sqlx::query_as(AssertSqlSafe(inner.sql.advisory_take_away.clone()))
            .bind(inner.advisory_id(key))
            .fetch_one(&inner.pool)
            .await
            .map_err(|e| inner.error("ending the holder's session", e))?;
        Ok(ended > 0)
    }

    /// Keys under `prefix` held now: advisory locks (by any session) of the keys with a row
    /// in the table, which every lockkit holder writes (the ids are hashes, so only named
    /// keys can be looked up), and live row leases. For leak checks.
    #[cfg(feature = "testing")]
    pub(crate) async fn held_under(&self, prefix: &str) -> Result<u64> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT name FROM \"{}\" WHERE position($1 in name) = 1",
            self.inner.config.table
        )))
        .bind(prefix.as_bytes())
        .fetch_all(&self.inner.pool)
        .await
        .map_err(|e| self.inner.error("listing key rows", e))?;
        let mut held = 0;
        for row in rows {
            let name: Vec<u8> = row
                .try_get("name")
                .map_err(|e| db_error("reading a key row", e))?;
            let Ok(key) = LockKey::new(String::from_utf8_lossy(&name)) else {
                continue;
            };
            if self.is_locked(&key).await? {
                held += 1;
            }
        }
        let leased = self.inner.leases_under(prefix).await?;
        Ok(held + leased)
    }

    /// How many dedicated connections are kept out of their pool now.
    #[cfg(feature = "testing")]
    pub(crate) fn kept_count(&self) -> usize {
        self.dedicated.kept.len()
    }

    /// Whether some session holds `key`'s advisory lock now.
    #[cfg(feature = "testing")]
    async fn is_locked(&self, key: &LockKey) -> Result<bool> {
        let inner = &self.inner;
        let (locked,): (bool,) = sqlx::query_as(AssertSqlSafe(inner.sql.advisory_locked.clone()))
            .bind(inner.advisory_id(key))
            .fetch_one(&inner.pool)
            .await
            .map_err(|e| inner.error("looking for the advisory lock", e))?;
        Ok(locked)
    }
}

impl std::fmt::Debug for AdvisoryLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdvisoryLocks")
            .field("table", &self.inner.config.table)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl LockBackend for AdvisoryLocks {
    fn info(&self) -> BackendInfo {
        let capabilities = Capabilities {
            pushes_loss: true,
            // Waiters queue in the server's lock manager.
            queued_wait: true,
            read_write: true,
            // The server queues a new shared request behind a waiting exclusive one.
            writer_preference: true,
            counts_waiters: true,
            // The session's idle timeout is the lease from the moment it waits: a shorter
            // one could end the session between two of its own statements.
            min_ttl: Duration::from_secs(1),
            max_ttl: Some(MAX_LEASE),
            ..Capabilities::default()
        };
        BackendInfo::new(BACKEND, Consistency::Cp, capabilities)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        refuse(self, req)?;
        acquire(self, req, Duration::ZERO).await
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        refuse(self, req)?;
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

    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        holders(self, key).await
    }
}

/// Refuses, before any I/O, what this mode never grants: a permit (no semaphores here, see
/// the design doc), an upgrade (`WouldDeadlock`: a reader asking to write or for a plain
/// lock would wait for itself), and a change of kind by an owner that holds the key
/// (`KindMismatch`).
fn refuse(backend: &AdvisoryLocks, req: &AcquireRequest) -> Result<()> {
    let live = |kind| backend.held.live(req.owner, &req.key, kind).is_some();
    let mismatch = |found: &str| {
        Err(Error::KindMismatch {
            key: req.key.clone(),
            found: found.into(),
            asked: req.kind,
        })
    };
    match req.kind {
        LockKind::Exclusive | LockKind::Read | LockKind::Write => {}
        _ => {
            return Err(Error::Unsupported {
                backend: BACKEND,
                what: format!(
                    "{} in mode=advisory: the server's lock queue cannot wait for any one of \
                     N locks, and the permit count has no home that ends with the holders' \
                     sessions; use mode=row for semaphores",
                    req.kind
                ),
            });
        }
    }
    match req.kind {
        LockKind::Write | LockKind::Exclusive if live(LockKind::Read) && !live(LockKind::Write) => {
            Err(Error::WouldDeadlock {
                key: req.key.clone(),
                held: LockKind::Read,
                asked: req.kind,
            })
        }
        LockKind::Write | LockKind::Read if live(LockKind::Exclusive) => {
            mismatch("is held by this owner as an exclusive lock")
        }
        LockKind::Exclusive if live(LockKind::Write) => {
            mismatch("is held by this owner as a read-write lock")
        }
        _ => Ok(()),
    }
}

fn lock_std<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A dedicated connection and the holds on it: one hold, or an owner's write and the read
/// it downgraded to (on the write's own session, see the module docs). Its lease on the
/// server (`idle_session_timeout`) is the latest lease of its live holds.
pub(crate) struct Session {
    conn: tokio::sync::Mutex<Option<PoolConnection<Postgres>>>,
    /// When the connection left the pool (see [`Dedicated`]).
    out_since: std::time::Instant,
    /// The connection died or was closed: the server has let its locks go.
    broken: AtomicBool,
    /// The holds on this connection (one that ended is skipped).
    members: std::sync::Mutex<Vec<Weak<Held>>>,
}

impl Session {
    fn new(lent: Lent<PoolConnection<Postgres>>) -> Arc<Session> {
        Arc::new(Session {
            conn: tokio::sync::Mutex::new(Some(lent.conn)),
            out_since: lent.out_since,
            broken: AtomicBool::new(false),
            members: std::sync::Mutex::new(Vec::new()),
        })
    }

    fn join(&self, held: &Arc<Held>) {
        let mut members = lock_std(&self.members);
        members.retain(|m| m.strong_count() > 0);
        members.push(Arc::downgrade(held));
    }

    /// The holds on this session that are not over.
    fn live_members(&self) -> Vec<Arc<Held>> {
        lock_std(&self.members)
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|h| !h.ended.load(Ordering::SeqCst))
            .collect()
    }

    /// Whether a hold on this session other than `except` is still live.
    fn others_live(&self, except: &Held) -> bool {
        self.live_members()
            .iter()
            .any(|h| !std::ptr::eq(Arc::as_ptr(h), except) && h.is_live())
    }

    /// The end of the latest lease of the session's holds that are not over (`None`: none).
    fn lease_until(&self) -> Option<Instant> {
        self.live_members().iter().map(|h| h.lease_until()).max()
    }

    /// The session's `application_name`, which names its holds for `holders` (read from
    /// `pg_stat_activity` by every client): `lockkit <owner> <k><token>x<depth>...`, `k`
    /// being `l` (plain lock), `w` or `r`.
    fn app_name(&self) -> String {
        let members = self.live_members();
        let mut name = match members.first() {
            Some(first) => format!("{APP_PREFIX} {}", first.owner),
            None => return String::new(),
        };
        for h in members {
            name.push_str(&format!(
                " {}{}x{}",
                kind_letter(h.kind),
                h.token.get(),
                h.count.depth()
            ));
        }
        name
    }
}

impl Drop for Session {
    /// A connection still here when the last hold goes (a `let_go` whose caller went
    /// away half-way) may hold a lock: close it, never pool it.
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.get_mut().take() {
            conn.close_on_drop();
        }
    }
}

/// The first word of the `application_name` of a session that holds advisory locks.
const APP_PREFIX: &str = "lockkit";

fn kind_letter(kind: LockKind) -> char {
    match kind {
        LockKind::Read => 'r',
        LockKind::Write => 'w',
        _ => 'l',
    }
}

/// One advisory hold: the session holding it, and its own token, depth and lease.
pub(crate) struct Held {
    session: Arc<Session>,
    key: LockKey,
    owner: lockkit_core::OwnerId,
    kind: LockKind,
    token: FencingToken,
    /// Depth, the acquisitions behind it and the lease.
    count: HoldCount,
    /// Released, or ended as stale: its lock is let go (or going) on the session.
    ended: AtomicBool,
}

impl Held {
    /// Still a hold its owner may re-enter: the connection is alive, the hold is not over
    /// and its lease has not run out.
    fn is_live(&self) -> bool {
        !self.session.broken.load(Ordering::SeqCst)
            && !self.ended.load(Ordering::SeqCst)
            && Instant::now() < self.lease_until()
    }

    fn lease_until(&self) -> Instant {
        self.count.lease_until()
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("key", &self.key)
            .field("kind", &self.kind)
            .field("token", &self.token)
            .finish()
    }
}

/// Whole milliseconds, at least one (zero would mean "no timeout"), at most `i32::MAX`.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .clamp(1, i32::MAX as u64)
}

/// `millis`, rounded up: a session's lease on the server never ends before the local one.
fn millis_up(d: Duration) -> u64 {
    millis(d + Duration::from_nanos(999_999))
}

/// The statement that sets a hold's lease on its session.
fn lease_statement(lease: Duration) -> String {
    format!("SET idle_session_timeout = {}", millis_up(lease))
}

/// `future`, unless `fired` says the terminator ended (or is ending) the session first:
/// then `None`, and the caller closes the connection.
async fn unless_fired<T>(
    future: impl std::future::Future<Output = T>,
    fired: &mut tokio::sync::watch::Receiver<bool>,
) -> Option<T> {
    tokio::select! {
        out = future => Some(out),
        _ = fired.wait_for(|fired| *fired) => None,
    }
}

/// Ends a hold that is over (its lease ran out, its session died), unless its release or
/// another ending already runs: that one lets go (a re-entry that met a release under way
/// and closed its session made the release report a clean release as a loss).
async fn end_stale(backend: &AdvisoryLocks, held: &Held) {
    if !held.ended.swap(true, Ordering::SeqCst) {
        let_go(backend, held).await;
    }
}

/// Lets an ended hold go: forgets it and lets its lock go. Another live hold on its
/// session (a downgrade's write or read) keeps the connection, and only this hold's lock is
/// let go; otherwise, or if that fails, the connection is closed (the server lets every
/// lock of the session go).
async fn let_go(backend: &AdvisoryLocks, held: &Held) {
    forget(backend, held);
    let session = &held.session;
    let mut conn = session.conn.lock().await;
    if let Some(c) = conn
        .as_mut()
        .filter(|_| session.others_live(held) && !session.broken.load(Ordering::SeqCst))
    {
        let unlock = unlock_one(backend, held).execute(&mut **c);
        if matches!(
            tokio::time::timeout(backend.inner.config.connect_timeout, unlock).await,
            Ok(Ok(_))
        ) {
            return;
        }
    }
    end_session(session, &mut conn);
}

/// Lets its ended hold go ([`let_go`]) in a task of its own when dropped still armed.
struct LetGoIfDropped(Option<(AdvisoryLocks, Arc<Held>)>);

impl Drop for LetGoIfDropped {
    fn drop(&mut self) {
        if let Some((backend, held)) = self.0.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move { let_go(&backend, &held).await });
        }
    }
}

/// Closes a session's connection (the server lets its locks go); its holds are over.
fn end_session(session: &Session, conn: &mut Option<PoolConnection<Postgres>>) {
    session.broken.store(true, Ordering::SeqCst);
    if let Some(mut c) = conn.take() {
        c.close_on_drop();
    }
}

/// The statement that lets go of `held`'s lock only, on its session.
fn unlock_one(
    backend: &AdvisoryLocks,
    held: &Held,
) -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments> {
    let id = backend.inner.advisory_id(&held.key);
    if held.kind == LockKind::Read {
        let (hi, lo) = backend.inner.readers_lock(&held.key);
        sqlx::query("SELECT pg_advisory_unlock_shared($1), pg_advisory_unlock_shared($2, $3)")
            .bind(id)
            .bind(hi)
            .bind(lo)
    } else {
        sqlx::query("SELECT pg_advisory_unlock($1)").bind(id)
    }
}

fn forget(backend: &AdvisoryLocks, held: &Held) {
    backend
        .held
        .of(held.kind)
        .forget(held.owner, &held.key, held);
}

fn held_of(backend: &AdvisoryLocks, grant: &Grant) -> Result<Arc<Held>> {
    backend.held.of(grant.kind).held_of(grant)
}

fn grant_for(req: &AcquireRequest, held: &Arc<Held>, depth: u32, start: Instant) -> Grant {
    Grant::new(req, held.token, depth, start).with_state(held.clone())
}

/// [`HoldCount::reenter`], with the server told first when the re-entry lengthens the
/// lease, under the connection's lock (so the liveness check cannot set a shorter one in
/// between). `Ok(None)`: the hold is over or released, ask afresh. A session found gone
/// here (the server ended it at its idle timeout a moment before the local lease ran out,
/// or it was terminated, and the liveness check has not seen it yet) holds nothing: it is
/// closed, its guards hear the loss from their watch, and the owner asks afresh.
async fn reenter_on_server(
    backend: &AdvisoryLocks,
    held: &Held,
    req: &AcquireRequest,
    start: Instant,
) -> Result<Option<u32>> {
    let session = &held.session;
    let mut conn = session.conn.lock().await;
    let Some(c) = conn
        .as_mut()
        .filter(|_| !session.broken.load(Ordering::SeqCst))
    else {
        return Ok(None);
    };
    // The session's lease is the latest of its holds' (a downgrade's write and read).
    if session
        .lease_until()
        .is_none_or(|until| lockkit_core::spi::lease_end(start, req.ttl) > until)
    {
        match sqlx::raw_sql(AssertSqlSafe(lease_statement(req.ttl)))
            .execute(&mut **c)
            .await
        {
            Ok(_) => {}
            Err(e) if backend.inner.gone(&e) => {
                tracing::debug!(error = %e, key = %req.key, "the session of a re-entered hold was gone; asking afresh");
                end_session(session, &mut conn);
                drop(conn);
                forget(backend, held);
                return Ok(None);
            }
            Err(e) => return Err(db_error("lengthening the lease of a re-entry", e)),
        }
    }
    let ended = session.broken.load(Ordering::SeqCst) || held.ended.load(Ordering::SeqCst);
    Ok(held.count.reenter(req, start, ended))
}

/// Takes the lock, waiting up to `wait` in the server's queue. `Ok(None)`: not granted in
/// time.
async fn acquire(
    backend: &AdvisoryLocks,
    req: &AcquireRequest,
    wait: Duration,
) -> Result<Option<Grant>> {
    let start = Instant::now();
    if let Some(held) = backend.held.of(req.kind).get(req.owner, &req.key) {
        if held.is_live() {
            // Its own task, like a fresh acquisition: if the caller goes away while the
            // depth is being recorded for `inspect`, the hold it added is given back.
            let (recorder, request, giver) = (backend.clone(), req.clone(), backend.clone());
            let reentered = detached_acquire(
                BACKEND,
                move |_| async move {
                    let Some(depth) = reenter_on_server(&recorder, &held, &request, start).await?
                    else {
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
            // Released to depth 0 by another task of this owner just now. Ask afresh.
        } else {
            // A hold that is over (its lease ran out, or its connection died): never
            // re-enter it, the server may have let someone else in. Drop it, ask afresh.
            end_stale(backend, &held).await;
        }
    }
    if let Some(write) = (req.kind == LockKind::Read)
        .then(|| backend.held.live(req.owner, &req.key, LockKind::Write))
        .flatten()
    {
        let (this, request, giver) = (backend.clone(), req.clone(), backend.clone());
        let downgraded = detached_acquire(
            BACKEND,
            move |_| async move { downgrade(&this, &request, &write).await },
            std::convert::identity,
            move |grant| async move {
                if let Err(error) = release(&giver, &grant).await {
                    tracing::warn!(%error, "could not give back an orphaned downgrade");
                }
            },
        )
        .await?;
        if let Some(grant) = downgraded {
            return Ok(Some(grant));
        }
        // The write ended just now: a read of its own, as anyone's.
    }
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

/// A dedicated connection ready for `req`'s wait, with its backend's pid and start (which
/// name it for the terminator). One round trip: those, the first wait's `lock_timeout` and
/// the lease, already (a waiter paused once it is granted, before its record, must not keep
/// the key past its lease), and, where [`tries_at_set_up`] says so, a first try of the lock
/// (`Some(got)`; the statement never waits for it). A kept connection ([`Dedicated`]) or a
/// pooled one used within the last second
/// ([`PING_IDLE_AFTER`](crate::db::PING_IDLE_AFTER)) is handed out unchecked, so one found
/// dead here (its server restarted, its link cut) is closed, noted (the pools then check
/// every connection for a while), and the statement sent again on another, up to
/// `max_holds + 1` times in all: a dead session holds nothing. A connection whose statement
/// failed otherwise, or did not answer in time, is closed: that ends any lock its try took.
///
/// While every dedicated connection is in use, a wait waits for one to come free until its
/// `deadline` and then answers `Ok(None)` (not granted in time: its caller says `Timeout`),
/// however short or long the pool's own acquire timeout; a try (a zero `wait`) waits
/// [`TRY_PATIENCE`] and then answers a retryable error saying every one is in use (the key
/// itself may be free). `Ok(None)` too when the caller went away (`interrupt`) before a
/// connection was lent.
async fn prepared_connection(
    backend: &AdvisoryLocks,
    req: &AcquireRequest,
    wait: Duration,
    deadline: Instant,
    interrupt: &Interrupt,
) -> Result<Option<(Lent<PoolConnection<Postgres>>, i32, String, Option<bool>)>> {
    let inner = &backend.inner;
    let id = inner.advisory_id(&req.key);
    let (hi, lo) = inner.readers_lock(&req.key);
    let give_up = if wait.is_zero() {
        Instant::now() + TRY_PATIENCE
    } else {
        deadline
    };
    let mut sent = 0;
    loop {
        sent += 1;
        let mut lent = match backend.dedicated.lend_by(give_up, interrupt).await {
            Ok(lent) => lent,
            Err(no_connection) => {
                let waits = !wait.is_zero();
                let max_holds = inner.config.max_holds;
                return match no_connection.answer(BACKEND, "advisory", &req.key, max_holds, waits) {
                    Ok(answer) => answer,
                    // Not every connection in use (`lend_by` waits for those): one could
                    // not be opened.
                    Err(sqlx::Error::PoolTimedOut) => Err(pool_timed_out(
                        "opening a dedicated connection",
                        &backend.dedicated.pool,
                        backend.dedicated.max,
                        "max_holds",
                        &inner.config,
                    )),
                    Err(e) => Err(db_error("opening a dedicated connection", e)),
                };
            }
        };
        // Past its deadline already (the pool was slow to lend a connection), a wait takes
        // nothing here: the terminator is about to end it.
        let tries =
            tries_at_set_up(req.kind, wait) && (wait.is_zero() || Instant::now() < deadline);
        // A name of this send's own: a set-up sent again (here on another connection, or
        // by a caller that retries the same attempt) is never ended for a lost one.
        let name = set_up_name();
        let statement = match (tries, req.kind == LockKind::Read) {
            (false, _) => SET_UP,
            (true, false) => SET_UP_AND_TRY,
            (true, true) => SET_UP_AND_TRY_SHARED,
        };
        let mut set_up =
            sqlx::query_as::<_, (i32, String, String, String, Option<bool>)>(statement)
                .bind(lock_timeout(deadline).to_string())
                .bind(millis_up(req.ttl).to_string());
        if tries {
            set_up = set_up.bind(&name).bind(id);
            if req.kind == LockKind::Read {
                set_up = set_up.bind(hi).bind(lo);
            }
        }
        let session = set_up.fetch_one(&mut *lent.conn);
        let answered = tokio::time::timeout(inner.config.connect_timeout, session).await;
        #[cfg(feature = "testing")]
        if let Ok(Ok((_, _, _, _, Some(true)))) = &answered
            && set_up_reply_lost(&req.key)
        {
            // As if the answer had been lost on a link gone silent: no goodbye reaches the
            // server, and the session (still holding the lock) stays open.
            std::mem::forget(lent.conn.detach());
            tokio::spawn(end_unanswered_set_up(backend.clone(), name));
            return Err(set_up_unanswered());
        }
        match answered {
            Ok(Ok((pid, started, _, _, tried))) => return Ok(Some((lent, pid, started, tried))),
            Ok(Err(e)) => {
                lent.conn.close_on_drop();
                if inner.gone(&e) && sent <= inner.config.max_holds {
                    tracing::debug!(error = %e, "a dedicated connection was dead; trying another");
                    continue;
                }
                return Err(db_error("preparing a dedicated connection", e));
            }
            Err(_) => {
                lent.conn.close_on_drop();
                if tries {
                    // The try may have taken the lock, and the close may never reach the
                    // server (a link gone silent): end the session from elsewhere, or the
                    // key would stay held, by nobody, for the lease.
                    tokio::spawn(end_unanswered_set_up(backend.clone(), name));
                }
                return Err(set_up_unanswered());
            }
        }
    }
}

/// A set-up that did not answer in time.
fn set_up_unanswered() -> Error {
    Error::backend(
        BACKEND,
        true,
        "a dedicated connection did not answer in time; is the server reachable?",
    )
}

/// Test hook: the next set-up of one key that takes the lock loses its answer.
#[cfg(feature = "testing")]
static SET_UP_REPLY_LOST: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Makes the next acquisition of `key` whose set-up statement takes the lock behave as if
/// that statement's answer had been lost on a link gone silent (test hook): its connection
/// is dropped without a goodbye, its session left open on the server, holding the lock.
#[cfg(feature = "testing")]
pub fn set_set_up_reply_lost(key: &str) {
    *SET_UP_REPLY_LOST.lock().unwrap_or_else(|e| e.into_inner()) = Some(key.to_owned());
}

#[cfg(feature = "testing")]
fn set_up_reply_lost(key: &LockKey) -> bool {
    let mut set = SET_UP_REPLY_LOST.lock().unwrap_or_else(|e| e.into_inner());
    let lost = set.as_deref() == Some(key.as_str());
    if lost {
        *set = None;
    }
    lost
}

/// The set-up of a dedicated connection ([`prepared_connection`]): `$1` the wait's
/// `lock_timeout`, `$2` the lease (`idle_session_timeout`), both in ms.
const SET_UP: &str = "SELECT pg_backend_pid(), \
     COALESCE(NULLIF(current_setting('lockkit.backend_start', true), ''), \
     (SELECT backend_start::text FROM pg_stat_get_activity(pg_backend_pid()))), \
     set_config('lock_timeout', $1, false), set_config('idle_session_timeout', $2, false), \
     NULL::bool";

/// [`SET_UP`], and a try of the key's lock `$4` (`pg_try_advisory_lock`: it never waits, and
/// the server refuses it while a waiter is queued for the key, so it jumps no queue). The
/// lease is the session's from the statement's end, the lock's too. The session is named
/// `$3` ([`set_up_name`]) first (a `CASE` evaluates its condition first): a set-up whose
/// answer never comes has that session ended by name ([`end_unanswered_set_up`]).
const SET_UP_AND_TRY: &str = "SELECT pg_backend_pid(), \
     COALESCE(NULLIF(current_setting('lockkit.backend_start', true), ''), \
     (SELECT backend_start::text FROM pg_stat_get_activity(pg_backend_pid()))), \
     set_config('lock_timeout', $1, false), set_config('idle_session_timeout', $2, false), \
     CASE WHEN set_config('application_name', $3, false) IS NULL THEN NULL \
     ELSE pg_try_advisory_lock($4) END";

/// [`SET_UP_AND_TRY`] for a reader: the key's lock `$4` and its readers' lock (`$5`, `$6`),
/// shared. A reader
/// tries only when it does not wait: a try that took the first and not the second would
/// leave the session holding one, which the wait would then take a second time.
const SET_UP_AND_TRY_SHARED: &str = "SELECT pg_backend_pid(), \
     COALESCE(NULLIF(current_setting('lockkit.backend_start', true), ''), \
     (SELECT backend_start::text FROM pg_stat_get_activity(pg_backend_pid()))), \
     set_config('lock_timeout', $1, false), set_config('idle_session_timeout', $2, false), \
     CASE WHEN set_config('application_name', $3, false) IS NULL THEN NULL \
     WHEN pg_try_advisory_lock_shared($4) THEN pg_try_advisory_lock_shared($5, $6) \
     ELSE false END";

/// The name a set-up that tries the lock gives its session first (`application_name`, at
/// most 63 bytes): unique to the send. The grant's record renames the session for
/// `holders`; a wait keeps it; a reset or release clears it.
fn set_up_name() -> String {
    format!("{APP_PREFIX}-set-up {}", uuid::Uuid::new_v4().simple())
}

/// Ends the session a set-up that tries the lock named `name`, after its answer did not
/// come in time: from an idle pooled connection if one answers within
/// [`QUICK_TERMINATE`], else from a connection opened for it, each within the connect
/// timeout. Best effort: a session that is still there after that ends at its lease
/// (`idle_session_timeout`, set by the same statement).
async fn end_unanswered_set_up(backend: AdvisoryLocks, name: String) {
    let inner = &backend.inner;
    let end = || {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(name.clone())
    };
    terminate_elsewhere(
        &inner.pool,
        &inner.config.connect,
        inner.config.connect_timeout,
        "an unanswered set-up's session",
        end,
    )
    .await;
}

/// Runs `end` (a `pg_terminate_backend` statement) from elsewhere than the session it ends:
/// from an idle pooled connection if one answers within [`QUICK_TERMINATE`] (opening a
/// connection, authentication included, can take a second on a loaded machine), else from
/// a connection opened for it, within `bound` (a pool that is busy or cut off gets a moment
/// only). Best effort: a failure is logged, naming `what` was to end.
async fn terminate_elsewhere(
    pool: &PgPool,
    options: &sqlx::postgres::PgConnectOptions,
    bound: Duration,
    what: &str,
    end: impl Fn() -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments>,
) {
    let pooled = async {
        let mut c = pool.acquire().await?;
        end().execute(&mut *c).await
    };
    if matches!(
        tokio::time::timeout(QUICK_TERMINATE.min(bound), pooled).await,
        Ok(Ok(_))
    ) {
        return;
    }
    let terminate = async {
        let mut control = PgConnection::connect_with(options).await?;
        end().execute(&mut control).await?;
        control.close().await
    };
    match tokio::time::timeout(bound, terminate).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::debug!(%error, "ending {what} failed"),
        Err(_) => tracing::debug!("ending {what} got no answer in time"),
    }
}

/// Whether the set-up statement also tries the lock: always when the caller does not
/// wait; when it waits, for a plain lock or a writer (the set-up's round trip then decides
/// an uncontended key, and a busy one goes on to wait in the server's queue as before).
fn tries_at_set_up(kind: LockKind, wait: Duration) -> bool {
    wait.is_zero() || kind != LockKind::Read
}

/// How one try on the dedicated connection ended.
enum Locked {
    /// The lock is held, with this fencing token; its lease runs from this instant.
    Held(u64, Instant),
    /// Not granted by the deadline (or the wait was interrupted).
    NotGranted,
    /// A live row-mode lease holds the key: the advisory lock was let go again.
    RowLease,
}

/// Why a try failed, and whether the connection (and any lock on it) went with it.
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

async fn lock(
    backend: &AdvisoryLocks,
    req: &AcquireRequest,
    wait: Duration,
    interrupt: Interrupt,
) -> Result<Option<Grant>> {
    let inner = &backend.inner;
    // The wait counts from the request, not from when a dedicated connection was free.
    let deadline = deadline_after(wait);
    let Some((lent, pid, started, tried)) =
        prepared_connection(backend, req, wait, deadline, &interrupt).await?
    else {
        // No dedicated connection came free by the deadline, or the caller went away.
        return Ok(None);
    };
    let (mut conn, out_since) = (lent.conn, lent.out_since);
    // The server ends the wait at the deadline (`lock_timeout`); the caller's going away,
    // or a wait the server did not end, is ended by terminating this connection's backend
    // from the shared pool if it answers within `QUICK_TERMINATE`, else from a connection
    // opened for that (a partition or busy holders can leave the pool hanging; it only
    // gets that moment). The terminator is stopped and awaited before the
    // connection is used again; a connection it fired at is closed, never reused.
    let (stop_terminator, stopped) = tokio::sync::oneshot::channel::<()>();
    let (fire, fired) = tokio::sync::watch::channel(false);
    let terminator = {
        let (options, bound) = (inner.config.connect.clone(), inner.config.connect_timeout);
        let pool = inner.pool.clone();
        let mut closing = backend.closing.subscribe();
        tokio::spawn(async move {
            // A zero wait is a single try: ended only if it hangs (a link gone silent).
            let grace = if wait.is_zero() {
                bound
            } else {
                DEADLINE_GRACE
            };
            let deadline_passes = tokio::time::sleep_until(deadline + grace);
            tokio::select! {
                () = deadline_passes => {}
                () = interrupt.interrupted() => {}
                _ = closing.wait_for(|closed| *closed) => {}
                _ = stopped => return false,
            }
            fire.send_replace(true);
            // That backend only: not another that reused its pid.
            let end = || {
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE pid = $1 AND backend_start::text = $2",
                )
                .bind(pid)
                .bind(started.clone())
            };
            // A queued waiter keeps its place (and, for a writer, keeps new readers out)
            // until its session ends.
            terminate_elsewhere(&pool, &options, bound, "a waiter's session", end).await;
            true
        })
    };
    let outcome = lock_and_record(backend, req, &mut conn, tried, wait, deadline, fired).await;
    if let Err(e) = &outcome
        && e.connection_gone
    {
        inner.dead_seen.note();
    }
    let _ = stop_terminator.send(());
    let terminated = tokio::time::timeout(inner.config.connect_timeout, terminator)
        .await
        .map_or(true, |joined| joined.unwrap_or(true));
    let (token, granted_at) = match outcome {
        _ if terminated => {
            // Past the deadline or abandoned by the caller: the connection may be ended
            // under it at any moment. Closing it ends any lock it took.
            conn.close_on_drop();
            return Ok(None);
        }
        Ok(Some(granted)) => granted,
        Ok(None) => {
            reset_or_close(backend, conn, out_since).await;
            return Ok(None);
        }
        Err(e) => {
            if e.connection_gone {
                conn.close_on_drop();
            } else {
                reset_or_close(backend, conn, out_since).await;
            }
            return Err(e.error);
        }
    };
    let session = Session::new(Lent { conn, out_since });
    let held = Arc::new(Held {
        session: session.clone(),
        key: req.key.clone(),
        owner: req.owner,
        kind: req.kind,
        token: FencingToken::new(token),
        count: HoldCount::new(req, granted_at),
        ended: AtomicBool::new(false),
    });
    session.join(&held);
    backend
        .held
        .of(req.kind)
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

/// How long a downgrade may wait for the readers' lock (which a row-mode transaction
/// deciding over the key holds for a moment); the key's own lock is granted at once.
const DOWNGRADE_WAIT: Duration = Duration::from_secs(5);

/// A downgrade: `req`, a read of the owner that holds `write`, taken on the write's own
/// session, where the server grants it at once, ahead of any queued writer (a second
/// session would queue behind its own owner's write, and the try form is refused while a
/// writer waits). It takes a fresh token, as every new hold does. `Ok(None)`: the write
/// ended meanwhile; ask as anyone would.
async fn downgrade(
    backend: &AdvisoryLocks,
    req: &AcquireRequest,
    write: &Arc<Held>,
) -> Result<Option<Grant>> {
    let inner = &backend.inner;
    let session = &write.session;
    let mut conn = session.conn.lock().await;
    // Under the session's lock: a release of the write either went first (the write is
    // over) or sees this read on the session and lets go of the write only.
    let Some(c) = conn.as_mut().filter(|_| write.is_live()) else {
        return Ok(None);
    };
    let id = inner.advisory_id(&req.key);
    let (hi, lo) = inner.readers_lock(&req.key);
    let lease = session.lease_until().map_or(req.ttl, |until| {
        until.saturating_duration_since(Instant::now()).max(req.ttl)
    });
    let prepare = format!(
        "SET lock_timeout = {}; {}",
        millis(DOWNGRADE_WAIT),
        lease_statement(lease)
    );
    let take = async {
        sqlx::raw_sql(AssertSqlSafe(prepare))
            .execute(&mut **c)
            .await?;
        sqlx::query("SELECT pg_advisory_lock_shared($1), pg_advisory_lock_shared($2, $3)")
            .bind(id)
            .bind(hi)
            .bind(lo)
            .execute(&mut **c)
            .await?;
        let granted_at = Instant::now();
        // Named below with both holds of the session.
        Ok::<_, sqlx::Error>((record_holder(backend, req, c, false).await?, granted_at))
    };
    let bound = inner.config.connect_timeout + DOWNGRADE_WAIT;
    let (token, granted_at) = match tokio::time::timeout(bound, take).await {
        Ok(Ok((Some(token), granted_at))) => (token, granted_at),
        outcome => {
            // Not taken (or not recorded): let go of the read only, or, when that cannot
            // be done, end the session: its write is lost with it, and its guard hears it.
            let why = match outcome {
                Ok(Err(e)) if inner.gone(&e) => None,
                Ok(Err(e)) => Some(db_error("taking a read beside the owner's write", e)),
                Ok(Ok(_)) => Some(Error::backend(
                    BACKEND,
                    true,
                    "a row-mode hold appeared beside the owner's write; try again",
                )),
                Err(_) => None,
            };
            let unlock = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT pg_advisory_unlock_shared({id}), pg_advisory_unlock_shared({hi}, {lo})"
            )));
            let undone = match (&why, conn.as_mut()) {
                (Some(_), Some(c)) => matches!(
                    tokio::time::timeout(inner.config.connect_timeout, unlock.execute(&mut **c))
                        .await,
                    Ok(Ok(_))
                ),
                _ => false,
            };
            if !undone {
                end_session(session, &mut conn);
            }
            return Err(why.unwrap_or_else(|| {
                Error::backend(
                    BACKEND,
                    true,
                    "the connection of the owner's write went away during a downgrade; \
                     the write is lost (its guard says so)",
                )
            }));
        }
    };
    let held = Arc::new(Held {
        session: session.clone(),
        key: req.key.clone(),
        owner: req.owner,
        kind: req.kind,
        token: FencingToken::new(token),
        count: HoldCount::new(req, granted_at),
        ended: AtomicBool::new(false),
    });
    session.join(&held);
    if let Some(c) = conn.as_mut() {
        name_session(session, c, inner.config.connect_timeout).await;
    }
    drop(conn);
    backend
        .held
        .reads
        .insert(req.owner, req.key.clone(), held.clone());
    tokio::spawn(watch(
        backend.clone(),
        Arc::downgrade(&held),
        req.loss.clone(),
    ));
    Ok(Some(grant_for(req, &held, 1, granted_at)))
}

/// Best effort: names the session's holds in its `application_name` (for `holders`).
async fn name_session(session: &Session, conn: &mut PoolConnection<Postgres>, bound: Duration) {
    let set = sqlx::query("SELECT set_config('application_name', $1, false)")
        .bind(session.app_name())
        .execute(&mut **conn);
    if !matches!(tokio::time::timeout(bound, set).await, Ok(Ok(_))) {
        tracing::debug!("could not name an advisory session's holds");
    }
}

/// Lets go of every advisory lock of a session, clears its lease and its name.
const RESET: &str =
    "SELECT pg_advisory_unlock_all(); SET idle_session_timeout = 0; RESET application_name";

/// Lets go of any advisory lock `conn` holds and clears its lease, then keeps it for the
/// next acquisition or gives it back to the pool ([`Dedicated::keep_clean`]); closes it
/// instead if that fails or takes longer than the connect timeout.
async fn reset_or_close(
    backend: &AdvisoryLocks,
    mut conn: PoolConnection<Postgres>,
    out_since: std::time::Instant,
) {
    let reset = sqlx::raw_sql(RESET).execute(&mut *conn);
    match tokio::time::timeout(backend.inner.config.connect_timeout, reset).await {
        Ok(Ok(_)) => backend.dedicated.keep_clean(conn, out_since),
        _ => conn.close_on_drop(),
    }
}

/// Takes `id`'s advisory lock on `conn` (waiting in the server's queue), records this
/// holder and its new fencing token, and sets the lease. `Ok(None)`: not granted by the
/// deadline (or `fired` says the terminator ended the wait). On every path but a grant,
/// the connection holds no advisory lock afterwards, or is reported gone.
async fn lock_and_record(
    backend: &AdvisoryLocks,
    req: &AcquireRequest,
    conn: &mut PoolConnection<Postgres>,
    mut tried: Option<bool>,
    wait: Duration,
    deadline: Instant,
    mut fired: tokio::sync::watch::Receiver<bool>,
) -> std::result::Result<Option<(u64, Instant)>, LockFailure> {
    let id = backend.inner.advisory_id(&req.key);
    let mut row_lease_poll = Backoff::new(ROW_LEASE_POLL, ROW_LEASE_POLL);
    // The caller set the first try's `lock_timeout`.
    let mut first = true;
    loop {
        if *fired.borrow() {
            return Ok(None);
        }
        let locked = try_lock_once(
            backend,
            req,
            conn,
            id,
            (wait, deadline),
            (first, tried.take()),
            &mut fired,
        )
        .await?;
        first = false;
        match locked {
            Locked::Held(token, at) => return Ok(Some((token, at))),
            Locked::NotGranted => return Ok(None),
            Locked::RowLease => {}
        }
        // A row-mode lease holds the key (its holder is not in the server's lock queue):
        // wait it out, looking again now and then.
        let now = Instant::now();
        if wait.is_zero() || now >= deadline {
            return Ok(None);
        }
        tokio::select! {
            () = tokio::time::sleep_until((now + row_lease_poll.next_delay()).min(deadline)) => {}
            _ = fired.wait_for(|fired| *fired) => return Ok(None),
        }
    }
}

/// The `lock_timeout` (milliseconds) that ends a wait at `deadline`: 0 ("none") beyond what
/// it can count, where the terminator ends the wait.
fn lock_timeout(deadline: Instant) -> u64 {
    let left = deadline.saturating_duration_since(Instant::now());
    if left >= MAX_LEASE { 0 } else { millis(left) }
}

/// One take of the advisory lock, then the record and the lease. `first`: the session's
/// `lock_timeout` is already set for this wait; `tried`: the set-up statement tried the
/// lock already, and got it (`Some(true)`) or found it busy.
async fn try_lock_once(
    backend: &AdvisoryLocks,
    req: &AcquireRequest,
    conn: &mut PoolConnection<Postgres>,
    id: i64,
    (wait, deadline): (Duration, Instant),
    (first, tried): (bool, Option<bool>),
    fired: &mut tokio::sync::watch::Receiver<bool>,
) -> std::result::Result<Locked, LockFailure> {
    // Every statement on `conn` gives way to the terminator: on a link that went silent
    // it would never answer, and the terminated connection is closed anyway.
    let fail = |e| LockFailure::new("taking the advisory lock", e);
    let read = req.kind == LockKind::Read;
    // A reader also takes the readers' lock (shared), which row mode looks for; on any
    // path but a grant the caller lets go of every lock of this connection.
    let (hi, lo) = backend.inner.readers_lock(&req.key);
    if tried == Some(true) {
        // Taken by the set-up statement.
    } else if wait.is_zero() {
        if tried == Some(false) {
            return Ok(Locked::NotGranted);
        }
        let tried = if read {
            sqlx::query_as::<_, (bool,)>(
                "SELECT CASE WHEN pg_try_advisory_lock_shared($1) \
                 THEN pg_try_advisory_lock_shared($2, $3) ELSE false END",
            )
            .bind(id)
            .bind(hi)
            .bind(lo)
        } else {
            sqlx::query_as::<_, (bool,)>("SELECT pg_try_advisory_lock($1)").bind(id)
        }
        .fetch_one(&mut **conn);
        let Some(tried) = unless_fired(tried, fired).await else {
            return Ok(Locked::NotGranted);
        };
        let (got,) = tried.map_err(fail)?;
        if !got {
            return Ok(Locked::NotGranted);
        }
    } else {
        if Instant::now() >= deadline {
            return Ok(Locked::NotGranted);
        }
        if !first {
            let timeout = lock_timeout(deadline);
            let set = sqlx::raw_sql(AssertSqlSafe(format!("SET lock_timeout = {timeout}")))
                .execute(&mut **conn);
            let Some(set) = unless_fired(set, fired).await else {
                return Ok(Locked::NotGranted);
            };
            set.map_err(fail)?;
        }
        let waited = if read {
            sqlx::query("SELECT pg_advisory_lock_shared($1), pg_advisory_lock_shared($2, $3)")
                .bind(id)
                .bind(hi)
                .bind(lo)
        } else {
            sqlx::query("SELECT pg_advisory_lock($1)").bind(id)
        }
        .execute(&mut **conn);
        let Some(waited) = unless_fired(waited, fired).await else {
            return Ok(Locked::NotGranted);
        };
        match waited {
            Ok(_) => {}
            // `lock_not_available`: the server's lock_timeout ended the wait.
            Err(e) if sql_state(&e).as_deref() == Some("55P03") => {
                return Ok(Locked::NotGranted);
            }
            Err(e) => return Err(fail(e)),
        }
    }
    #[cfg(feature = "testing")]
    GRANT_PAUSE.take(&req.key).await;
    // Held. Record the holder and its new token on this very connection, committed at once
    // (a token is never reused): its answer also proves the session, and so the lock,
    // was there when the token was taken, and the lease (the session's idle timeout, set
    // before the wait) runs from it. A session that lost the lock meanwhile writes
    // nothing. The record may wait behind a row-mode transaction, as long as the wait
    // may last (`lock_timeout`), and gives way to the terminator.
    let recording_at = Instant::now();
    // The record also names the hold for `holders` (every client reads it from
    // `pg_stat_activity`).
    let Some(recorded) = unless_fired(record_holder(backend, req, conn, true), fired).await else {
        return Ok(Locked::NotGranted);
    };
    let recorded = match recorded {
        Ok(recorded) => recorded,
        // The row stayed locked past the wait's end (the caller lets go of the lock).
        Err(e) if sql_state(&e).as_deref() == Some("55P03") => return Ok(Locked::NotGranted),
        Err(e) => return Err(LockFailure::new("recording the holder", e)),
    };
    let Some(token) = recorded else {
        // This connection holds nothing else.
        let unlock = sqlx::query("SELECT pg_advisory_unlock_all()").execute(&mut **conn);
        let Some(unlocked) = unless_fired(unlock, fired).await else {
            return Ok(Locked::NotGranted);
        };
        unlocked.map_err(|e| LockFailure::new("letting go of the advisory lock", e))?;
        return Ok(Locked::RowLease);
    };
    Ok(Locked::Held(token, recording_at))
}

/// Records `req`'s owner as the key's advisory holder with a new fencing token, on the
/// lock's own connection, and with `named`, names the hold on its session in the same
/// statement (`application_name`, see [`Session::app_name`]). `Ok(None)`: a live row-mode
/// lease or hold keeps the key; nothing was changed but holds that had run out.
async fn record_holder(
    backend: &AdvisoryLocks,
    req: &AcquireRequest,
    conn: &mut PoolConnection<Postgres>,
    named: bool,
) -> std::result::Result<Option<u64>, sqlx::Error> {
    let inner = &backend.inner;
    let (name, owner) = (req.key.as_str().as_bytes(), req.owner.to_string());
    let identity = req.identity.encode_for(&owner);
    // `<prefix> <owner> <kind>`; the statement appends `<token>x1`.
    let app_name = named.then(|| format!("{APP_PREFIX} {} {}", req.owner, kind_letter(req.kind)));
    // Take the row, or create it; once more if another client created it meanwhile, or
    // if the key had row-mode hold rows, after deleting those that ran out (the take does
    // not tell a hold that ran out from one whose renewal is in flight; the delete waits
    // for such a renewal). The uncontended path is the first statement alone.
    for statement in [
        &inner.sql.advisory_take,
        &inner.sql.advisory_insert,
        &inner.sql.advisory_prune,
        &inner.sql.advisory_take,
    ] {
        if Arc::ptr_eq(statement, &inner.sql.advisory_prune) {
            query(statement).bind(name).execute(&mut **conn).await?;
            continue;
        }
        let fence: Option<i64> = query(statement)
            .bind(&owner)
            .bind(name)
            .bind(&identity)
            .bind(app_name.as_deref())
            .fetch_optional(&mut **conn)
            .await?
            .map(|row| row.try_get("fence"))
            .transpose()?;
        if let Some(fence) = fence {
            return Ok(Some(u64::try_from(fence).unwrap_or(0)));
        }
    }
    Ok(None)
}

/// Checks the hold's connection every `liveness` and fires the loss signal the moment it is
/// gone. Each check also sets the session's `idle_session_timeout` to what is left of the
/// latest lease of its holds, so the checks never keep alive a lease its holder stopped
/// renewing.
async fn watch(backend: AdvisoryLocks, held: Weak<Held>, loss: lockkit_core::LossSignal) {
    let every = backend.inner.config.liveness;
    loop {
        tokio::time::sleep(every).await;
        let Some(held) = held.upgrade() else { return };
        let session = &held.session;
        if held.ended.load(Ordering::SeqCst) {
            // Released: nothing to say.
            return;
        }
        if held.lease_until() <= Instant::now() {
            // Not renewed in time: the hold is over. Let go of its lock now (the server
            // ends the session at its idle timeout anyway), and say so.
            end_stale(&backend, &held).await;
            loss.fire(LostReason::LeaseExpired);
            return;
        }
        let mut conn = session.conn.lock().await;
        let Some(c) = conn.as_mut() else {
            // Released (nothing to say), or ended elsewhere (the backend closed, the
            // session's other hold saw it die).
            if session.broken.load(Ordering::SeqCst) {
                forget(&backend, &held);
                loss.fire(LostReason::SessionLost);
            }
            return;
        };
        // Read under the connection's lock: a re-entry or renewal that lengthened a lease
        // meanwhile has told the server, and this must not set a shorter timeout after it.
        let until = held.lease_until();
        let session_until = session.lease_until().map_or(until, |s| s.max(until));
        let left = session_until.saturating_duration_since(Instant::now());
        let check = sqlx::raw_sql(AssertSqlSafe(lease_statement(left))).execute(&mut **c);
        // A check still unanswered when the lease runs out (a paused server, a cut link)
        // leaves nothing to keep: the hold is over either way.
        let reason = match tokio::time::timeout_at(until, check).await {
            Ok(Ok(_)) => continue,
            Ok(Err(e)) if backend.inner.gone(&e) => LostReason::SessionLost,
            Ok(Err(error)) => {
                tracing::debug!(%error, "liveness check failed; retrying");
                continue;
            }
            Err(_) => LostReason::LeaseExpired,
        };
        // The connection is gone or silent: every hold on it is over (the other hold's
        // watch hears it from the closed session).
        end_session(session, &mut conn);
        drop(conn);
        forget(&backend, &held);
        loss.fire(reason);
        return;
    }
}

/// Best effort: shows the depth to `inspect` and `holders`.
async fn record_depth(backend: &AdvisoryLocks, held: &Held, depth: u32) {
    let inner = &backend.inner;
    // Best effort, and bounded: it only feeds `inspect`, and a link gone silent must not
    // hold up the re-entry or release whose depth it records.
    let record = inner.retry_gone(|| {
        query(&inner.sql.advisory_depth)
            .bind(i32::try_from(depth).unwrap_or(i32::MAX))
            .bind(held.key.as_str().as_bytes())
            .bind(held.owner.to_string())
            .bind(token_param(held.token))
            .execute(&inner.pool)
    });
    let _ = tokio::time::timeout(inner.config.connect_timeout, record).await;
    let mut conn = held.session.conn.lock().await;
    if let Some(c) = conn.as_mut() {
        name_session(&held.session, c, inner.config.connect_timeout).await;
    }
}

/// A fencing token as the `bigint` of the `fence` column.
fn token_param(token: FencingToken) -> i64 {
    i64::try_from(token.get()).unwrap_or(i64::MAX)
}

/// Sets the lease to `ttl` from now (never shorter than it is): the idle timeout on the
/// server first (never below the lease of the session's other hold), then the local lease.
/// A dead connection means the lock is gone: `NotHeld`.
async fn renew(backend: &AdvisoryLocks, grant: &Grant, ttl: Duration) -> Result<()> {
    let held = held_of(backend, grant)?;
    let session = &held.session;
    let mut conn = session.conn.lock().await;
    let Some(c) = conn
        .as_mut()
        .filter(|_| !session.broken.load(Ordering::SeqCst) && !held.ended.load(Ordering::SeqCst))
    else {
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    };
    let start = Instant::now();
    let until = held
        .lease_until()
        .max(lockkit_core::spi::lease_end(start, ttl));
    let session_until = session.lease_until().map_or(until, |s| s.max(until));
    let statement = lease_statement(session_until.saturating_duration_since(start));
    match sqlx::raw_sql(AssertSqlSafe(statement))
        .execute(&mut **c)
        .await
    {
        Ok(_) => {
            held.count.extend_lease(until);
            Ok(())
        }
        Err(e) if backend.inner.gone(&e) => {
            end_session(session, &mut conn);
            forget(backend, &held);
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        }
        Err(e) => Err(db_error("renewing the lease", e)),
    }
}

async fn release(backend: &AdvisoryLocks, grant: &Grant) -> Result<Released> {
    let held = held_of(backend, grant)?;
    let session = &held.session;
    if session.broken.load(Ordering::SeqCst) {
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
    if held.ended.swap(true, Ordering::SeqCst) {
        // Ended as stale meanwhile (its lease ran out, its session died): that ending
        // lets go, and the hold was not this release's to let go any more.
        return Err(Error::NotHeld {
            key: grant.key.clone(),
        });
    }
    #[cfg(feature = "testing")]
    RELEASE_PAUSE.take(&held.key).await;
    forget(backend, &held);
    let not_held = || Error::NotHeld {
        key: grant.key.clone(),
    };
    let bound = backend.inner.config.connect_timeout;
    // Dropped while it waits for the session (a renewal or a liveness check has it on a
    // slow link), the release lets go in the background: its hold is forgotten already, so
    // nothing else would, and a session that lives on (a downgrade's other hold) would keep
    // the lock.
    let mut waiting = LetGoIfDropped(Some((backend.clone(), held.clone())));
    let mut conn = session.conn.lock().await;
    if conn.is_none() {
        waiting.0 = None;
        // Closed (the hold is lost), or given back to the pool by the release of the
        // session's other hold, which let go of every lock on it, this one's too.
        if session.broken.load(Ordering::SeqCst) {
            return Err(not_held());
        }
        drop(conn);
        clear_record(backend, &held).await;
        return Ok(Released::Fully);
    }
    if session.others_live(&held) {
        // A downgrade's write or read stays on this session: let go of this lock only.
        let Some(c) = conn.as_mut() else {
            return Err(not_held());
        };
        let unlocked =
            tokio::time::timeout(bound, unlock_one(backend, &held).execute(&mut **c)).await;
        let outcome = match unlocked {
            Ok(Ok(_)) => {
                name_session(session, c, bound).await;
                Ok(Released::Fully)
            }
            // Not let go: end the session (the other hold's guard hears it) rather than
            // keep a lock nobody holds a guard of.
            Ok(Err(e)) if backend.inner.gone(&e) => Err(not_held()),
            Ok(Err(e)) => Err(db_error("letting go of the advisory lock", e)),
            Err(_) => Err(no_answer()),
        };
        if outcome.is_err() {
            end_session(session, &mut conn);
        }
        // Armed until now: dropped before the unlock's outcome was known, the lock might
        // stay on a session the other hold keeps alive.
        waiting.0 = None;
        drop(conn);
        clear_record(backend, &held).await;
        return outcome;
    }
    // From here the connection is this release's own: a statement sent on it completes
    // (its first lets go of every lock), and a connection dropped half-way is not reused
    // before sqlx has read that statement's answer.
    waiting.0 = None;
    let Some(mut c) = conn.take() else {
        return Err(not_held());
    };
    drop(conn);
    // One round trip: let go first, then clear the record if it is still this hold's and
    // announce that (the record only says who held it, and the next advisory holder
    // overwrites it anyway). The connection, without a lock, a lease or a name, is kept
    // for the next acquisition or goes back to the pool ([`Dedicated::keep_clean`]).
    #[cfg(feature = "testing")]
    let pause = clear_pause();
    #[cfg(not(feature = "testing"))]
    let pause = Duration::ZERO;
    let script = advisory_release_script(
        &backend.inner.config.table,
        held.key.as_str(),
        &held.owner.to_string(),
        token_param(held.token),
        pause,
    );
    let released = sqlx::raw_sql(AssertSqlSafe(script)).execute(&mut *c);
    let unlocked = match tokio::time::timeout(bound + pause, released).await {
        Ok(Ok(_)) => {
            backend.dedicated.keep_clean(c, session.out_since);
            return Ok(Released::Fully);
        }
        // The script failed part-way (the record's row stayed locked, a full notification
        // queue): undone but for the unlock, if that ran. Reset the connection as before,
        // then clear the record from the pool.
        Ok(Err(sqlx::Error::Database(error))) => {
            tracing::debug!(%error, key = %held.key, "the one-trip advisory release failed; releasing in steps");
            match tokio::time::timeout(bound, sqlx::raw_sql(RESET).execute(&mut *c)).await {
                Ok(unlocked) => unlocked,
                Err(_) => {
                    c.close_on_drop();
                    return Err(no_answer());
                }
            }
        }
        Ok(Err(e)) => Err(e),
        Err(_) => {
            c.close_on_drop();
            return Err(no_answer());
        }
    };
    let outcome = match unlocked {
        Ok(_) => Ok(Released::Fully),
        Err(e) => {
            c.close_on_drop();
            if backend.inner.gone(&e) {
                // The server let the lock go when the connection died.
                return Err(not_held());
            }
            Err(db_error("letting go of the advisory lock", e))
        }
    };
    drop(c);
    clear_record(backend, &held).await;
    outcome
}

/// A release the server did not answer in time.
fn no_answer() -> Error {
    Error::backend(
        BACKEND,
        true,
        "the server did not answer the release; the lock ends with the session, \
         at the latest when its lease runs out",
    )
}

/// Test hook: a pause, taken once, by the next operation on one key that reaches its point.
#[cfg(feature = "testing")]
struct KeyedPause(std::sync::Mutex<Option<(String, Duration)>>);

#[cfg(feature = "testing")]
impl KeyedPause {
    const fn new() -> Self {
        KeyedPause(std::sync::Mutex::new(None))
    }

    fn set(&self, key: &str, pause: Duration) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) =
            (!pause.is_zero()).then(|| (key.to_owned(), pause));
    }

    async fn take(&self, key: &LockKey) {
        // Once: the next operation on the key is not paused.
        let pause = {
            let mut set = self.0.lock().unwrap_or_else(|e| e.into_inner());
            match set.as_ref() {
                Some((k, pause)) if k == key.as_str() => {
                    let pause = *pause;
                    *set = None;
                    Some(pause)
                }
                _ => None,
            }
        };
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
    }
}

/// Test hook: a pause, for the next acquisition of one key, between the server's grant of
/// the advisory lock and anything after it (the holder paused there, as by SIGSTOP).
#[cfg(feature = "testing")]
static GRANT_PAUSE: KeyedPause = KeyedPause::new();

/// Pauses the next acquisition of `key` between the server's grant and the holder's
/// record (test hook); `Duration::ZERO` clears it.
#[cfg(feature = "testing")]
pub fn set_grant_pause(key: &str, pause: Duration) {
    GRANT_PAUSE.set(key, pause);
}

/// Test hook: a pause, for the next last release of one key, after the hold is marked
/// ended and before it is forgotten (a re-entry of its owner finds it there, ended).
#[cfg(feature = "testing")]
static RELEASE_PAUSE: KeyedPause = KeyedPause::new();

/// Pauses the next last release of `key` between marking its hold ended and forgetting
/// it (test hook); `Duration::ZERO` clears it.
#[cfg(feature = "testing")]
pub fn set_release_pause(key: &str, pause: Duration) {
    RELEASE_PAUSE.set(key, pause);
}

/// Test hook: a pause between a release's unlock and the clearing of its record.
#[cfg(feature = "testing")]
static CLEAR_PAUSE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Sets the pause of an advisory release between its unlock and the clearing of its
/// holder record (test hook).
#[cfg(feature = "testing")]
pub fn set_clear_pause(pause: Duration) {
    CLEAR_PAUSE_MS.store(
        u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
        Ordering::SeqCst,
    );
}

/// The pause [`set_clear_pause`] asks for (the release script sleeps on the server).
#[cfg(feature = "testing")]
fn clear_pause() -> Duration {
    Duration::from_millis(CLEAR_PAUSE_MS.load(Ordering::SeqCst))
}

/// Clears the holder record (if it is still this hold's) and announces the release to
/// row-mode waiters. Best effort: a stale record is ignored by everyone once the advisory
/// lock is free.
async fn clear_record(backend: &AdvisoryLocks, held: &Held) {
    let inner = &backend.inner;
    // One statement: the announcement goes out only if the record was cleared, when the
    // statement's own transaction commits.
    // Only this hold's record (its token): the owner may hold the key again already.
    // Sent again on another connection if the pooled one is gone: a second run finds
    // nothing to clear (and announces nothing).
    let cleared = inner
        .retry_gone(|| {
            query(&inner.sql.advisory_clear)
                .bind(held.key.as_str().as_bytes())
                .bind(held.owner.to_string())
                .bind(release_channel(&inner.config.table))
                .bind(release_payload(held.key.as_str()))
                .bind(token_param(held.token))
                .execute(&inner.pool)
        })
        .await;
    if let Err(error) = cleared {
        tracing::debug!(%error, key = %held.key, "could not clear an advisory holder's record");
    }
}

async fn inspect(backend: &AdvisoryLocks, key: &LockKey) -> Result<Option<HolderInfo>> {
    let Some(holder) = holders(backend, key).await?.into_iter().next() else {
        return Ok(None);
    };
    // The server's queue for the lock: every session waiting in `pg_advisory_lock`.
    let inner = &backend.inner;
    let (waiters,): (i64,) = inner
        .retry_gone(|| {
            sqlx::query_as(AssertSqlSafe(inner.sql.advisory_waiters.clone()))
                .bind(inner.advisory_id(key))
                .fetch_one(&inner.pool)
        })
        .await
        .map_err(|e| inner.error("counting the lock's waiters", e))?;
    Ok(Some(
        holder.with_waiters(u32::try_from(waiters).unwrap_or(0)),
    ))
}

/// Every holder of `key`: a live row-mode lease (the lease table's record), or every session
/// granted the key's advisory lock (`pg_locks`), the exclusive one first, each named by its
/// `application_name` (owner, token, depth; see [`Session::app_name`]). The identity is
/// the key's record's, for the hold it names (the last one taken). A session that is not
/// lockkit's is "an unknown holder".
async fn holders(backend: &AdvisoryLocks, key: &LockKey) -> Result<Vec<HolderInfo>> {
    let inner = &backend.inner;
    let record = inner.inspect_lease(key).await?;
    let rows = inner
        .retry_gone(|| {
            sqlx::query(AssertSqlSafe(inner.sql.advisory_holders.clone()))
                .bind(inner.advisory_id(key))
                .fetch_all(&inner.pool)
        })
        .await
        .map_err(|e| inner.error("listing the advisory lock's holders", e))?;
    if rows.is_empty() {
        // Not held in the lock manager: at most a row-mode lease.
        return Ok(record.into_iter().collect());
    }
    let mut all = Vec::with_capacity(rows.len());
    for row in rows {
        let shared = row_text(&row, "mode").as_deref() == Some("ShareLock");
        let named =
            row_text(&row, "application_name").and_then(|name| parse_app_name(&name, shared));
        let Some((owner, kind, token, depth)) = named else {
            all.push(HolderInfo::new("an unknown holder", 1, None, None));
            continue;
        };
        let identity = record
            .as_ref()
            .filter(|r| r.owner == owner && r.token == Some(token))
            .and_then(|r| r.identity.clone());
        let info = HolderInfo::new(owner, depth, Some(token), None).with_identity(identity);
        all.push(match kind {
            LockKind::Exclusive => info,
            kind => info.with_kind(kind),
        });
    }
    Ok(all)
}

/// The hold a lockkit session's `application_name` names for its shared (`r`) or exclusive
/// (`w`, `l`) lock: owner, kind, token, depth.
fn parse_app_name(name: &str, shared: bool) -> Option<(String, LockKind, FencingToken, u32)> {
    let mut words = name.split_whitespace();
    if words.next() != Some(APP_PREFIX) {
        return None;
    }
    let owner = words.next()?.to_owned();
    words.find_map(|hold| {
        let mut chars = hold.chars();
        let kind = match (chars.next()?, shared) {
            ('r', true) => LockKind::Read,
            ('w', false) => LockKind::Write,
            ('l', false) => LockKind::Exclusive,
            _ => return None,
        };
        let (token, depth) = chars.as_str().split_once('x')?;
        Some((
            owner.clone(),
            kind,
            FencingToken::new(token.parse().ok()?),
            depth.parse().ok()?,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_app_name_names_the_hold_of_each_lock_mode() {
        let name = "lockkit 6f1c:3 w12x1 r13x2";
        let read = parse_app_name(name, true).unwrap();
        assert_eq!(
            read,
            ("6f1c:3".into(), LockKind::Read, FencingToken::new(13), 2)
        );
        let write = parse_app_name(name, false).unwrap();
        assert_eq!(
            write,
            ("6f1c:3".into(), LockKind::Write, FencingToken::new(12), 1)
        );
        let plain = parse_app_name("lockkit o:1 l7x3", false).unwrap();
        assert_eq!(plain.1, LockKind::Exclusive);
        assert!(parse_app_name("lockkit o:1 l7x3", true).is_none());
        // Another client's session, or a name the server cut short: no holder named.
        assert!(parse_app_name("psql", false).is_none());
        assert!(parse_app_name("lockkit o:1 w12x1 r13", true).is_none());
        assert!(parse_app_name("lockkit o:1 w12x1 r13x", true).is_none());
    }
}

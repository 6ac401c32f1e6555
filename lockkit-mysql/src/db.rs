//! The database both modes share: its connection pools, tables and statements, error
//! mapping, and the reads both modes answer the same way (is a key's row locked now, what
//! does the lease table say about a key).

use std::{future::Future, sync::Arc, time::Duration};

use lockkit_core::{
    Error, FencingToken, HolderIdentity, HolderInfo, LockKey, Result,
    spi::{KeptConnections, Lent, NoConnection, sweep_while},
};
use sqlx::{
    AssertSqlSafe, MySql, MySqlPool, Row, Transaction,
    mysql::{MySqlArguments, MySqlPoolOptions, MySqlQueryResult, MySqlRow},
    pool::PoolConnection,
    query::Query,
};
use tokio::sync::OnceCell;

use crate::MysqlConfig;

pub(crate) const BACKEND: &str = "mysql";

/// Server errors (MySQL and MariaDB numbers) that a later try may not meet: lock wait
/// timeout (1205), deadlock (1213), server shutting down (1053), query interrupted or
/// connection killed (1317, 1927), too many connections (1040, 1203), read-only during a
/// failover (1290, 1836), idle client disconnected (4031), statement time limits (3024,
/// 1969). Their SQLSTATE is often the catch-all `HY000`, which many lasting errors share
/// too (a full table or disk, a bad value), so the number decides.
const RETRYABLE_ERRORS: &[u16] = &[
    LOCK_WAIT_TIMEOUT,
    1213,
    1053,
    1317,
    1927,
    1040,
    1203,
    1290,
    1836,
    4031,
    3024,
    1969,
];

/// Maps a driver error, saying what was being done and what to do.
pub(crate) fn db_error(doing: &str, e: sqlx::Error) -> Error {
    let code = match &e {
        sqlx::Error::Database(db) => db.code().map(|c| c.to_string()),
        _ => None,
    };
    let retryable = match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(_) => {
            error_number(&e).is_some_and(|n| RETRYABLE_ERRORS.contains(&n))
                || matches!(code.as_deref(), Some("40001" | "08S01" | "08004" | "70100"))
        }
        _ => false,
    };
    let hint = match &e {
        sqlx::Error::Io(_) => "; is the server running and reachable?",
        sqlx::Error::PoolTimedOut => "; all pooled connections are busy (raise pool_size)",
        _ => "",
    };
    Error::backend_with_source(BACKEND, retryable, format!("{doing} failed: {e}{hint}"), e)
}

/// A pool that timed out with room for another connection could not open one: the server
/// is down, refuses connections or cannot be reached. (sqlx says `PoolTimedOut` either
/// way; the busy pool's advice, to raise its size, sent users the wrong way.)
pub(crate) fn unreachable_error(doing: &str, within: Duration, e: sqlx::Error) -> Error {
    Error::backend_with_source(
        BACKEND,
        true,
        format!(
            "{doing} failed: could not reach the MySQL server (no connection could be opened \
             within {within:?}); is it running and reachable?"
        ),
        e,
    )
}

/// How long a try (an acquisition that does not wait) waits for a dedicated (for-update)
/// connection while every one is in use (`max_holds` reached): then it fails, saying so. A
/// wait waits until its deadline. Opening a new one is given `connect_timeout` (this bound
/// used to cover that too, and a server slower than 250 ms to connect to got no for-update
/// lock at all).
pub(crate) const HOLD_CONNECTION_WAIT: Duration = Duration::from_millis(250);

/// Errors after which the connection (and so any transaction and lock it had) is gone.
pub(crate) fn connection_gone(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Io(_) | sqlx::Error::Protocol(_))
        || matches!(error_number(e), Some(1927 | 1053 | 2006 | 2013 | 4031))
}

/// MySQL error numbers lockkit reacts to.
pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    }
}

pub(crate) fn query(
    sql: &Arc<str>,
) -> sqlx::query::Query<'static, sqlx::MySql, sqlx::mysql::MySqlArguments> {
    sqlx::query(AssertSqlSafe(sql.clone()))
}

/// `d` in µs (at least 1, at most [`lockkit_core::MAX_TTL`]'s: a lease is added to the
/// server's clock, and `u64::MAX` µs came out as a time in the past).
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.min(lockkit_core::MAX_TTL).as_micros())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// Errors that mean a row lock could not be taken in time (not failures).
pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;
pub(crate) const LOCK_NOWAIT: u16 = 3572;

/// How long after a dead connection was seen the pools ping before every use.
pub(crate) const PING_AFTER_DEATH: Duration = Duration::from_secs(5);

/// When a connection to this database was last found dead (a server restart, a `KILL`, a
/// network drop): for a while afterwards the pools ping every connection before handing it
/// out, not only those that idled, since the others are likely dead too.
pub(crate) type DeadSeen = lockkit_core::spi::RecentLoss;

/// One database: the pools and the statements on its tables.
pub(crate) struct Db {
    pub(crate) config: MysqlConfig,
    /// Shared with both pools' checks before use.
    pub(crate) dead_seen: Arc<DeadSeen>,
    pub(crate) pool: MySqlPool,
    /// Dedicated connections for for-update holds and waiters.
    pub(crate) holds_pool: MySqlPool,
    pub(crate) sql: Sql,
    schema: OnceCell<()>,
    /// Connections of the shared pool kept out of it between one-statement calls
    /// ([`Db::execute_one`]): at most a quarter of `pool_size` (none for a pool of up to
    /// three).
    kept: KeptConnections<PoolConnection<MySql>>,
    /// Dedicated connections kept out of `holds_pool` between for-update holds
    /// ([`Db::lend_hold_connection`], [`Db::keep_hold_connection`]): at most a quarter of
    /// `max_holds`.
    kept_holds: KeptConnections<PoolConnection<MySql>>,
}

/// How long a connection stays out of the pool at most, however busy: then it goes back,
/// so the pool's checks and `max_lifetime` (a failover behind one address) still reach it.
const KEPT_AT_MOST: Duration = Duration::from_secs(60);

/// MySQL errors after which a connection is clean (the autocommitted statement rolled
/// back): it may be kept.
const DUPLICATE_KEY: u16 = 1062;
const DEADLOCK: u16 = 1213;

impl Drop for Db {
    /// Kept connections go back to the pool, or are closed in place outside a runtime
    /// ([`KeptConnections::drop_all`]).
    fn drop(&mut self) {
        self.kept.drop_all(|conn| drop(conn.detach()));
        self.kept_holds.drop_all(|conn| drop(conn.detach()));
    }
}

impl Db {
    /// Opens the pools `config` asks for and makes sure the tables are there.
    pub(crate) async fn connect(config: MysqlConfig) -> Result<Arc<Db>> {
        let dead_seen = Arc::new(DeadSeen::new());
        let (seen, holds_seen) = (dead_seen.clone(), dead_seen.clone());
        // No ping before every statement (it was a round trip of its own on every lock
        // operation): a connection that has just been used is taken as alive, and one that
        // has idled for a while is pinged first, so a server restart during a quiet spell
        // never fails the next call. A connection that died within the last
        // `IDLE_PING_AFTER` (a restart right after a busy spell) fails its first statement:
        // that is noted (`DeadSeen`), every connection is then pinged before use for
        // `PING_AFTER_DEATH`, and the statements that may be sent again (`retry_gone`,
        // `begin`) are, so the call itself succeeds.
        let pool = MySqlPoolOptions::new()
            .max_connections(config.pool_size)
            .acquire_timeout(config.connect_timeout)
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                let seen = seen.clone();
                Box::pin(async move { ping_if_idle(conn, meta, &seen).await })
            })
            .after_connect(|conn, _| Box::pin(shared_session(conn)))
            .connect_with(config.connect.clone())
            .await
            .map_err(|e| match e {
                // Nothing was open yet: none could be.
                sqlx::Error::PoolTimedOut => {
                    unreachable_error("connecting to MySQL", config.connect_timeout, e)
                }
                e => db_error("connecting to MySQL", e),
            })?;
        let holds_pool = MySqlPoolOptions::new()
            .max_connections(config.max_holds)
            .min_connections(0)
            // Opening a connection may take up to `connect_timeout`; waiting for one in
            // use is bounded by `HOLD_CONNECTION_WAIT` (`lend_hold_connection`).
            .acquire_timeout(config.connect_timeout)
            // A hold sets its connection's wait_timeout to its lease: every path that gives
            // a connection back puts the server's default back in the same round trip as
            // its last statement (`for_update::RESTORE_SESSION`), or closes it. Pinged
            // before use only after an idle spell or soon after a dead connection was seen,
            // as the shared pool; a dead connection fails the first statement of a lock
            // attempt, which nothing has happened before, and the attempt takes another.
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                let seen = holds_seen.clone();
                Box::pin(async move { ping_if_idle(conn, meta, &seen).await })
            })
            .after_connect(|conn, _| Box::pin(read_committed(conn)))
            .connect_lazy_with(config.connect.clone());
        let keep_at_most = config.pool_size / 4;
        let keep_holds_at_most = config.max_holds / 4;
        let db = Arc::new(Db {
            sql: Sql::new(&config.table),
            config,
            dead_seen,
            pool,
            holds_pool,
            schema: OnceCell::new(),
            kept: KeptConnections::new(
                usize::try_from(keep_at_most).unwrap_or(0),
                IDLE_PING_AFTER,
                KEPT_AT_MOST,
            ),
            kept_holds: KeptConnections::new(
                usize::try_from(keep_holds_at_most).unwrap_or(0),
                IDLE_PING_AFTER,
                KEPT_AT_MOST,
            ),
        });
        if db.kept.at_most() > 0 || db.kept_holds.at_most() > 0 {
            // Gives back idle kept connections while the client lives and its pools are
            // open.
            tokio::spawn(sweep_while(
                Arc::downgrade(&db),
                IDLE_PING_AFTER,
                |db: &Db| {
                    db.kept.sweep(db.return_all_kept());
                    db.kept_holds.sweep(db.return_all_kept_holds());
                    !db.pool.is_closed() || !db.holds_pool.is_closed()
                },
            ));
        }
        db.ensure_schema().await?;
        Ok(db)
    }

    /// Whether `e` means the connection is gone; if so, the pools ping every connection
    /// before use for a while.
    pub(crate) fn gone(&self, e: &sqlx::Error) -> bool {
        let gone = connection_gone(e);
        if gone {
            self.dead_seen.note();
        }
        gone
    }

    /// [`db_error`], noting a dead connection.
    pub(crate) fn fail(&self, doing: &str, e: sqlx::Error) -> Error {
        self.gone(&e);
        if matches!(e, sqlx::Error::PoolTimedOut) && self.pool.size() < self.config.pool_size {
            return unreachable_error(doing, self.config.connect_timeout, e);
        }
        db_error(doing, e)
    }

    /// Runs `statement` on the shared pool, and again on another connection while the one
    /// it was sent on turns out dead (it died since its last use, say in a server restart),
    /// up to `pool_size + 1` times in all. Only for statements that are harmless to send
    /// again (a first statement that was never run, or one whose repetition changes
    /// nothing the caller relies on). Before each try, a kept connection goes back to a
    /// full pool ([`Db::make_room`]).
    pub(crate) async fn retry_gone<T, F, Fut>(
        &self,
        mut statement: F,
    ) -> std::result::Result<T, sqlx::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = std::result::Result<T, sqlx::Error>>,
    {
        let mut tries = 0;
        loop {
            tries += 1;
            self.make_room();
            match statement().await {
                Err(e) if self.gone(&e) && tries <= self.config.pool_size => {}
                outcome => return outcome,
            }
        }
    }

    /// Runs one autocommitted statement on a connection of the shared pool, like
    /// `statement.execute(&pool)`, without sqlx's cost of giving a connection back: sqlx
    /// pings every connection returned to its pool (a round trip and a task of its own),
    /// which doubled the time of two one-row `UPDATE`s here (`mysql_pool_probe`). So a
    /// connection whose statement completed (or failed with an error that leaves it clean:
    /// a duplicate key, a lock wait timeout, a deadlock) is kept out of the pool for the
    /// next call, up to [`Db::keep_at_most`], which come out of `pool_size`, and only while
    /// the pool has a connection to spare (a caller waiting for one gets it instead).
    /// A kept connection goes back to the pool (which checks it before use) once it idled
    /// [`IDLE_PING_AFTER`] (a sweeper looks every second), once it has been out for
    /// [`KEPT_AT_MOST`] (so the pool's `max_lifetime` still applies), at once when any
    /// connection was seen dead within [`PING_AFTER_DEATH`], and when the pool closes. A
    /// connection whose statement failed on the way, or whose caller went away mid-way, is
    /// never kept: it goes back to the pool, which pings it or closes it, as before.
    pub(crate) async fn execute_one(
        &self,
        statement: Query<'_, MySql, MySqlArguments>,
    ) -> std::result::Result<MySqlQueryResult, sqlx::Error> {
        let mut lent = self
            .kept
            .lend(
                || self.return_all_kept(),
                self.pool.acquire(),
                |e| matches!(e, sqlx::Error::PoolTimedOut),
            )
            .await?;
        let done = statement.execute(&mut *lent.conn).await;
        let clean = match &done {
            Ok(_) => true,
            Err(e) => matches!(
                error_number(e),
                Some(DUPLICATE_KEY | LOCK_WAIT_TIMEOUT | DEADLOCK)
            ),
        };
        if clean {
            self.keep(lent);
        }
        done
    }

    /// Whether every kept connection must go back to the pool now: the pool closed, or a
    /// connection was seen dead within [`PING_AFTER_DEATH`].
    fn return_all_kept(&self) -> bool {
        self.pool.is_closed() || self.dead_seen.within(PING_AFTER_DEATH)
    }

    /// Keeps `lent` for the next [`Db::execute_one`] if there is room and the pool is open
    /// and can spare it; otherwise it goes back to the pool.
    fn keep(&self, lent: Lent<PoolConnection<MySql>>) {
        let spare = self.pool.num_idle() > 0 || self.pool.size() < self.config.pool_size;
        self.kept.keep(lent, || spare && !self.return_all_kept());
    }

    /// How many connections are kept now.
    #[cfg(feature = "testing")]
    pub(crate) fn kept_count(&self) -> usize {
        self.kept.len()
    }

    /// Whether every kept dedicated connection must go back to its pool now: the pool
    /// closed, or a connection was seen dead within [`PING_AFTER_DEATH`].
    fn return_all_kept_holds(&self) -> bool {
        self.holds_pool.is_closed() || self.dead_seen.within(PING_AFTER_DEATH)
    }

    /// A dedicated connection for a for-update hold or waiter that stops waiting for one at
    /// `give_up`. Kept ones are taken first, and kept only while the pool has one to spare
    /// ([`Db::keep_hold_connection`]), so no caller waits for a connection that sits kept;
    /// then an idle one, or a new one (opened within `connect_timeout`); while every
    /// connection is open and lent (`max_holds` reached), one that comes back before
    /// `give_up` (see [`KeptConnections::lend_by`]).
    ///
    /// # Cancel safety
    /// Cancel safe: dropped, it holds no connection.
    pub(crate) async fn lend_hold_connection(
        &self,
        give_up: tokio::time::Instant,
        interrupt: &lockkit_core::spi::Interrupt,
    ) -> std::result::Result<Lent<PoolConnection<MySql>>, NoConnection<sqlx::Error>> {
        self.kept_holds
            .lend_by(
                || self.return_all_kept_holds(),
                || self.holds_pool.acquire(),
                |e| matches!(e, sqlx::Error::PoolTimedOut),
                || self.holds_pool_is_full(),
                give_up,
                interrupt,
            )
            .await
    }

    /// Whether every dedicated connection is open and lent.
    fn holds_pool_is_full(&self) -> bool {
        self.holds_pool.size() >= self.config.max_holds && self.holds_pool.num_idle() == 0
    }

    /// Keeps a dedicated connection whose last statement ended its transaction and put
    /// the session's defaults back (a release's commit, a rollback), for the next hold,
    /// if there is room; otherwise it goes back to `holds_pool`. sqlx checks every
    /// connection given back to its pool (a round trip, in a task of its own).
    pub(crate) fn keep_hold_connection(&self, lent: Lent<PoolConnection<MySql>>) {
        // Only while the pool can spare it (an idle connection, or room to open one): else
        // a caller may be waiting for a connection, and gets this one.
        let spare =
            self.holds_pool.num_idle() > 0 || self.holds_pool.size() < self.config.max_holds;
        self.kept_holds
            .keep(lent, || spare && !self.return_all_kept_holds());
    }

    /// How many dedicated connections are kept now.
    #[cfg(feature = "testing")]
    pub(crate) fn kept_holds_count(&self) -> usize {
        self.kept_holds.len()
    }

    /// Gives every kept dedicated connection back to `holds_pool` (when it closes: it waits
    /// for all its connections).
    pub(crate) fn return_kept_holds(&self) {
        drop(self.kept_holds.take_all());
    }

    /// Gives every kept connection back to the pool (when the pool closes: it waits for
    /// all its connections).
    pub(crate) fn return_kept(&self) {
        drop(self.kept.take_all());
    }

    /// The server ids of the connections kept for one-statement calls now.
    #[cfg(feature = "testing")]
    pub(crate) async fn kept_connection_ids(&self) -> std::result::Result<Vec<u64>, sqlx::Error> {
        let mut ids = Vec::new();
        let mut back = Vec::new();
        while let Some(mut lent) = self.kept.take(self.return_all_kept()) {
            let id = sqlx::query_as::<_, (u64,)>("SELECT CONNECTION_ID()")
                .fetch_one(&mut *lent.conn)
                .await;
            back.push(lent);
            ids.push(id?.0);
        }
        // Back in their order of use (the most recent was taken first).
        for lent in back.into_iter().rev() {
            self.keep(lent);
        }
        Ok(ids)
    }

    /// A transaction on the shared pool, begun on a connection that answers (a kept
    /// connection goes back to a full pool first: see [`Db::retry_gone`]).
    pub(crate) async fn begin(
        &self,
    ) -> std::result::Result<Transaction<'static, MySql>, sqlx::Error> {
        self.retry_gone(|| self.pool.begin()).await
    }

    /// When the pool is at its size with no idle connection, gives one kept connection
    /// back to it, so a caller that asks the pool for one does not wait for a connection
    /// that sits kept (until the sweeper would give it back, a second or two). Below its
    /// size the pool opens a connection instead, which costs less than a kept one's
    /// return.
    fn make_room(&self) {
        if self.pool.num_idle() == 0 && self.pool.size() >= self.config.pool_size {
            drop(self.kept.take(false));
        }
    }

    /// Creates the tables if allowed; otherwise checks they exist.
    pub(crate) async fn ensure_schema(&self) -> Result<()> {
        let inner = self;
        inner
            .schema
            .get_or_try_init(|| async {
                let table = &inner.config.table;
                if inner.config.create_schema {
                    for statement in ddl(table).split(';').map(str::trim).filter(|s| !s.is_empty()) {
                        sqlx::raw_sql(AssertSqlSafe(statement.to_owned()))
                            .execute(&inner.pool)
                            .await
                            .map_err(|e| db_error(&format!("creating table `{table}`"), e))?;
                    }
                } else {
                    match query(&inner.sql.table_exists).fetch_optional(&inner.pool).await {
                        Ok(_) => {}
                        Err(e) if error_number(&e) == Some(1146) => {
                            return Err(Error::Config(format!(
                                "table `{table}` does not exist and create_schema=false; create it with:\n{}",
                                ddl(table)
                            )));
                        }
                        Err(e) => return Err(db_error(&format!("checking table `{table}`"), e)),
                    }
                }
                self.ensure_columns().await?;
                self.ensure_holds_table().await
            })
            .await
            .map(|_| ())
    }

    /// Tables made before a column existed (`attempts`, `holder`) get it (or, with
    /// create_schema=false, an error with the statement to run).
    async fn ensure_columns(&self) -> Result<()> {
        let inner = self;
        let table = &inner.config.table;
        for (column, add) in [
            ("attempts", &inner.sql.add_attempts_column),
            ("holder", &inner.sql.add_holder_column),
        ] {
            let (present,): (i64,) = sqlx::query_as(AssertSqlSafe(inner.sql.column_exists.clone()))
                .bind(table)
                .bind(column)
                .fetch_one(&inner.pool)
                .await
                .map_err(|e| db_error(&format!("checking the columns of `{table}`"), e))?;
            if present > 0 {
                continue;
            }
            if !inner.config.create_schema {
                return Err(Error::Config(format!(
                    "table `{table}` lacks the `{column}` column and create_schema=false; add it with:\n{add};"
                )));
            }
            match self.alter_briefly(add).await {
                // 1060: another client added it first.
                Ok(()) => {}
                Err(e) if error_number(&e) == Some(1060) => {}
                Err(e) if error_number(&e) == Some(LOCK_WAIT_TIMEOUT) => {
                    return Err(Error::Config(format!(
                        "could not add the `{column}` column to `{table}` within {} s: another \
                         session holds the table (a long transaction or a dump); run this at a \
                         quiet moment, then connect again:\n{add};",
                        ALTER_LOCK_WAIT.as_secs()
                    )));
                }
                Err(e) => {
                    return Err(db_error(
                        &format!(
                            "adding the {column} column to `{table}` (or run it yourself: {add})"
                        ),
                        e,
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks that `<table>_holds` exists (it is created with the others when the client
    /// may change the schema; a table made before read-write locks existed lacks it).
    ///
    /// # Errors
    /// [`Error::Config`] with the statement to run when it is missing and
    /// create_schema=false; database errors.
    async fn ensure_holds_table(&self) -> Result<()> {
        let table = &self.config.table;
        match query(&self.sql.holds_table_exists)
            .fetch_optional(&self.pool)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if error_number(&e) == Some(1146) => Err(Error::Config(format!(
                "table `{table}_holds` (read-write locks and semaphores) does not exist and \
                 create_schema=false; create it with:\n{}",
                holds_ddl(table)
            ))),
            Err(e) => Err(db_error(&format!("checking table `{table}_holds`"), e)),
        }
    }

    /// Takes `key` away from whoever holds it in row mode (the mutex lease and every read,
    /// write and permit hold), as if their leases had run out; waiting writers' markers
    /// stay. Returns whether anything live was there.
    pub(crate) async fn clear_live(&self, key: &[u8]) -> Result<bool> {
        let fail = |e| self.fail("clearing a lease", e);
        let mut tx = self.begin().await.map_err(fail)?;
        // The key's row first, as every lock transaction does: no deadlock with them, and
        // no acquisition is halfway through its decision while the holds go.
        query(&self.sql.row_select_for_update)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await
            .map_err(fail)?;
        let lease = query(&self.sql.row_clear_live)
            .bind(key)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        let holds = query(&self.sql.holds_clear_live)
            .bind(key)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok(lease.rows_affected() + holds.rows_affected() > 0)
    }

    /// Runs `alter` on a connection of its own that waits at most [`ALTER_LOCK_WAIT`] for
    /// the table's metadata lock: queued behind a long transaction, an `ALTER` would hold
    /// up every statement on the table (renewals too) for as long as it waits. The
    /// connection is closed afterwards, so its session setting never reaches the pool.
    async fn alter_briefly(&self, alter: &Arc<str>) -> std::result::Result<(), sqlx::Error> {
        let mut conn = self.pool.acquire().await?.detach();
        let outcome = async {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "SET SESSION lock_wait_timeout = {}",
                ALTER_LOCK_WAIT.as_secs()
            )))
            .execute(&mut conn)
            .await?;
            query(alter).execute(&mut conn).await.map(|_| ())
        }
        .await;
        let _ = sqlx::Connection::close(conn).await;
        outcome
    }

    /// One round trip to the server.
    pub(crate) async fn ping(&self) -> Result<()> {
        let _: (i32,) = self
            .retry_gone(|| sqlx::query_as("SELECT 1").fetch_one(&self.pool))
            .await
            .map_err(|e| self.fail("SELECT 1", e))?;
        Ok(())
    }

    /// Whether `key`'s row is locked now, probed without waiting.
    pub(crate) async fn is_locked(&self, key: &[u8]) -> Result<bool> {
        let fail = |e| self.fail("probing the row lock", e);
        let mut tx = self.begin().await.map_err(fail)?;
        let probe = query(&self.sql.mutex_lock_nowait)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await;
        let _ = tx.rollback().await;
        match probe {
            Ok(_) => Ok(false),
            Err(e) if matches!(error_number(&e), Some(LOCK_WAIT_TIMEOUT | LOCK_NOWAIT)) => Ok(true),
            Err(e) => Err(fail(e)),
        }
    }

    /// Who holds `key` according to the lease table: a live row-mode lease, or the record
    /// of a for-update holder whose row is still locked.
    pub(crate) async fn inspect_lease(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let row = self
            .retry_gone(|| {
                query(&self.sql.inspect)
                    .bind(key.as_str().as_bytes().to_vec())
                    .fetch_optional(&self.pool)
            })
            .await
            .map_err(|e| self.fail("inspecting the lease", e))?;
        let Some(row) = row else { return Ok(None) };
        let left = row.try_get::<Option<i64>, _>("left_us").ok().flatten();
        if left.is_none() && !self.is_locked(key.as_str().as_bytes()).await? {
            // The record of a for-update holder whose transaction has ended.
            return Ok(None);
        }
        Ok(Some(
            HolderInfo::new(
                row_text(&row, "owner").unwrap_or_default(),
                row.try_get("holds").unwrap_or(1),
                row.try_get::<u64, _>("fence").ok().map(FencingToken::new),
                left.and_then(|us| u64::try_from(us).ok())
                    .map(Duration::from_micros),
            )
            .with_identity(holder_identity(&row)),
        ))
    }
}

/// How long a pooled connection may idle before it is pinged on its way out of the pool.
pub(crate) const IDLE_PING_AFTER: Duration = Duration::from_secs(1);

/// The pools' check before handing out a connection: a ping, but only after an idle spell
/// of [`IDLE_PING_AFTER`] (a dead connection is closed and another one taken).
/// Also pinged: every connection within [`PING_AFTER_DEATH`] of one found dead.
async fn ping_if_idle(
    conn: &mut sqlx::MySqlConnection,
    meta: sqlx::pool::PoolConnectionMetadata,
    dead_seen: &DeadSeen,
) -> std::result::Result<bool, sqlx::Error> {
    if (meta.idle_for >= IDLE_PING_AFTER || dead_seen.within(PING_AFTER_DEATH))
        && let Err(e) = sqlx::Connection::ping(conn).await
    {
        dead_seen.note();
        return Err(e);
    }
    Ok(true)
}

/// Lock transactions lock only the rows they name: no gap locks between neighbouring
/// keys, so unrelated keys never deadlock each other.
async fn read_committed(conn: &mut sqlx::MySqlConnection) -> std::result::Result<(), sqlx::Error> {
    sqlx::raw_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(conn)
        .await
        .map(|_| ())
}

/// How long the server lets a shared-pool connection sit idle inside a transaction before
/// it ends the connection (and the transaction with its row locks). Every transaction of
/// the shared pool is a few statements sent back to back; one left open is a client that
/// stalled (paused, or cut off by a link gone silent) while it held the key's row locked,
/// which otherwise kept every other client off the key until the server's `wait_timeout`
/// (8 hours by default): past its lease, so the lease no longer bounded a dead contender
/// (helper-31's review, F2). Dedicated (for-update) connections hold their transaction for
/// the whole hold, and are bounded by their lease instead.
pub(crate) const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// MariaDB's error for a system variable it does not know (MySQL has no
/// `idle_transaction_timeout`).
const UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;

/// The session of a shared-pool connection: read committed (as the dedicated ones), and a
/// transaction left idle ends after [`IDLE_IN_TRANSACTION`] (MariaDB's
/// `idle_transaction_timeout`; on a server without it, `wait_timeout`, which also ends a
/// connection idle in the pool that long: the pool pings a connection that idled before
/// it hands it out, and opens another).
async fn shared_session(conn: &mut sqlx::MySqlConnection) -> std::result::Result<(), sqlx::Error> {
    read_committed(&mut *conn).await?;
    let seconds = IDLE_IN_TRANSACTION.as_secs();
    let idle = format!("SET SESSION idle_transaction_timeout = {seconds}");
    match sqlx::raw_sql(AssertSqlSafe(idle)).execute(&mut *conn).await {
        Err(e) if error_number(&e) == Some(UNKNOWN_SYSTEM_VARIABLE) => {
            let idle = format!("SET SESSION wait_timeout = {seconds}");
            sqlx::raw_sql(AssertSqlSafe(idle))
                .execute(conn)
                .await
                .map(|_| ())
        }
        outcome => outcome.map(|_| ()),
    }
}

/// The `holder` column of `row`, decoded, if it was written for the row's `owner` (a client
/// that does not know the column, an older lockkit, leaves a previous holder's there).
pub(crate) fn holder_identity(row: &MySqlRow) -> Option<HolderIdentity> {
    let owner = row_text(row, "owner")?;
    row_text(row, "holder").and_then(|text| HolderIdentity::decode_for(&text, &owner))
}

pub(crate) fn row_text(row: &MySqlRow, column: &str) -> Option<String> {
    row.try_get::<Option<String>, _>(column).ok().flatten()
}

// ---- the tables and their statements

/// The DDL for `table`, `<table>_mutex` (used by for-update mode) and `<table>_holds`
/// (read, write and permit holds, and waiting writers, of row mode).
pub fn ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{table}` (\n  \
           name VARBINARY(512) NOT NULL,\n  \
           owner VARCHAR(80) NULL,\n  \
           holds INT UNSIGNED NOT NULL DEFAULT 0,\n  \
           fence BIGINT UNSIGNED NOT NULL DEFAULT 0,\n  \
           expires_at DATETIME(6) NULL,\n  \
           attempts TEXT NULL,\n  \
           holder TEXT CHARACTER SET ascii NULL,\n  \
           PRIMARY KEY (name)\n\
         ) ENGINE=InnoDB;\n\
         CREATE TABLE IF NOT EXISTS `{table}_mutex` (\n  \
           name VARBINARY(512) NOT NULL,\n  \
           PRIMARY KEY (name)\n\
         ) ENGINE=InnoDB;\n\
         {}",
        holds_ddl(table)
    )
}

/// The table of read, write and permit holds and of waiting writers' markers (row mode;
/// for-update mode reads it so that it never takes a key a row-mode reader holds).
pub(crate) fn holds_ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{table}_holds` (\n  \
           name VARBINARY(512) NOT NULL,\n  \
           kind CHAR(1) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,\n  \
           holder VARCHAR(80) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,\n  \
           owner VARCHAR(80) NOT NULL,\n  \
           holds INT UNSIGNED NOT NULL DEFAULT 1,\n  \
           token BIGINT UNSIGNED NOT NULL DEFAULT 0,\n  \
           permits INT UNSIGNED NULL,\n  \
           expires_at DATETIME(6) NOT NULL,\n  \
           attempts TEXT NULL,\n  \
           identity TEXT CHARACTER SET ascii NULL,\n  \
           PRIMARY KEY (name, kind, holder)\n\
         ) ENGINE=InnoDB;"
    )
}

/// The change that brings a table made before the `attempts` column existed up to date.
pub(crate) fn add_attempts_column(table: &str) -> String {
    format!("ALTER TABLE `{table}` ADD COLUMN attempts TEXT NULL AFTER expires_at")
}

/// The longest a schema change waits for its table lock before it gives up.
pub(crate) const ALTER_LOCK_WAIT: Duration = Duration::from_secs(5);

/// The change that brings a table made before the `holder` column (who holds the lock:
/// [`lockkit_core::HolderIdentity`], encoded) existed up to date.
pub(crate) fn add_holder_column(table: &str) -> String {
    format!("ALTER TABLE `{table}` ADD COLUMN holder TEXT CHARACTER SET ascii NULL")
}

/// Every statement, prepared once per connection by the driver's statement cache.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) table_exists: Arc<str>,
    pub(crate) column_exists: Arc<str>,
    pub(crate) add_attempts_column: Arc<str>,
    pub(crate) add_holder_column: Arc<str>,
    pub(crate) row_select_for_update: Arc<str>,
    pub(crate) row_insert: Arc<str>,
    pub(crate) row_take: Arc<str>,
    pub(crate) row_take_free: Arc<str>,
    pub(crate) row_reenter: Arc<str>,
    pub(crate) row_renew: Arc<str>,
    pub(crate) row_extend_locked: Arc<str>,
    pub(crate) row_release_one: Arc<str>,
    pub(crate) row_release_all: Arc<str>,
    pub(crate) row_release_sole: Arc<str>,
    pub(crate) row_clear_live: Arc<str>,
    pub(crate) inspect: Arc<str>,
    pub(crate) mutex_insert: Arc<str>,
    pub(crate) mutex_lock: Arc<str>,
    pub(crate) mutex_lock_nowait: Arc<str>,
    pub(crate) holder_take: Arc<str>,
    pub(crate) holder_insert: Arc<str>,
    pub(crate) holder_read: Arc<str>,
    pub(crate) holder_depth: Arc<str>,
    pub(crate) holder_clear: Arc<str>,
    pub(crate) holds_table_exists: Arc<str>,
    pub(crate) row_insert_free: Arc<str>,
    pub(crate) fence_next: Arc<str>,
    pub(crate) holds_of_key: Arc<str>,
    pub(crate) holds_delete: Arc<str>,
    pub(crate) holds_insert: Arc<str>,
    pub(crate) holds_reenter: Arc<str>,
    pub(crate) holds_extend_locked: Arc<str>,
    pub(crate) holds_renew: Arc<str>,
    pub(crate) holds_select_one: Arc<str>,
    pub(crate) holds_select_permit_of: Arc<str>,
    pub(crate) holds_release_one: Arc<str>,
    pub(crate) holds_live: Arc<str>,
    pub(crate) holds_clear_live: Arc<str>,
    pub(crate) holds_delete_expired: Arc<str>,
    pub(crate) marker_insert: Arc<str>,
    pub(crate) marker_refresh: Arc<str>,
    pub(crate) marker_delete: Arc<str>,
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) live_under_prefix: Arc<str>,
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) mutex_rows_under_prefix: Arc<str>,
}

impl Sql {
    pub(crate) fn new(t: &str) -> Self {
        let s = |text: String| Arc::<str>::from(text);
        // For the mutex statements on `t` (aliased `t`): no live read, write or permit.
        let no_live_holds = format!(
            "NOT EXISTS (SELECT 1 FROM `{t}_holds` h WHERE h.name = t.name \
             AND h.kind IN ('r', 'w', 'p') AND h.expires_at > UTC_TIMESTAMP(6))"
        );
        // For the statements that decide without locking `{t}_holds` (the one-statement
        // take of a free row, a for-update holder's record): no read, write or permit row
        // at all, live or not. Their read of `{t}_holds` is not a locking one: it sees the
        // last committed version of a hold whose renewal (which takes no key lock) is still
        // in flight, so it cannot tell an expired hold from one about to be extended. Rows
        // are only inserted and deleted under the key's row lock, which these statements
        // hold while they read, so "no row" cannot change under them; an expired row is left
        // to a transaction that deletes it with a locking delete (which waits for the
        // renewal).
        let no_holds = format!(
            "NOT EXISTS (SELECT 1 FROM `{t}_holds` h WHERE h.name = t.name \
             AND h.kind IN ('r', 'w', 'p'))"
        );
        Sql {
            table_exists: s(format!("SELECT 1 FROM `{t}` JOIN `{t}_mutex` LIMIT 0")),
            column_exists: s("SELECT COUNT(*) FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = ?"
                .to_owned()),
            add_attempts_column: s(add_attempts_column(t)),
            add_holder_column: s(add_holder_column(t)),
            row_select_for_update: s(format!(
                "SELECT owner, holds, fence, attempts, expires_at > UTC_TIMESTAMP(6) AS live, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS left_us \
                 FROM `{t}` WHERE name = ? FOR UPDATE"
            )),
            row_insert: s(format!(
                "INSERT INTO `{t}` (name, owner, holds, fence, expires_at, attempts, holder) \
                 VALUES (?, ?, 1, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, ?)"
            )),
            // Never over a live read, write or permit hold (the caller has checked under the
            // row lock; this keeps the rule in the statement too).
            row_take: s(format!(
                "UPDATE `{t}` t SET owner = ?, holds = 1, fence = fence + 1, \
                 expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, attempts = ?, holder = ? \
                 WHERE name = ? AND {no_live_holds}"
            )),
            // The whole decision of an uncontended acquisition in one statement: the row
            // is free (no live lease, no for-update holder's record: `owner` set with no
            // expiry) and the key has no read, write or permit hold row at all (`no_holds`:
            // not even an expired one, whose renewal may be in flight). It waits for
            // the row's lock like the `SELECT ... FOR UPDATE` of the full transaction
            // (an equality search on the primary key takes no semi-consistent shortcut),
            // then evaluates this condition on the latest committed row and holds (read
            // committed: the subquery reads after the lock is granted), though not with a
            // locking read (hence `no_holds`, not `no_live_holds`). The new token is
            // handed back through `LAST_INSERT_ID`. Anything else (no row yet, held,
            // a for-update record, holds to weigh or to clean up, a re-entry or a retry)
            // matches nothing and goes to the full transaction.
            row_take_free: s(format!(
                "UPDATE `{t}` t SET fence = LAST_INSERT_ID(fence + 1), owner = ?, holds = 1, \
                 expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, attempts = ?, holder = ? \
                 WHERE name = ? AND NOT COALESCE(expires_at > UTC_TIMESTAMP(6), FALSE) \
                 AND (owner IS NULL OR expires_at IS NOT NULL) AND {no_holds}"
            )),
            row_reenter: s(format!(
                "UPDATE `{t}` SET holds = holds + 1, attempts = ?, \
                 expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) WHERE name = ?"
            )),
            row_renew: s(format!(
                "UPDATE `{t}` SET expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE name = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6)"
            )),
            // Under the row lock of a transaction that just saw the lease live and ours: no
            // one else can have taken it since, so extend it even if it ran out meanwhile.
            row_extend_locked: s(format!(
                "UPDATE `{t}` SET expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE name = ? AND owner = ?"
            )),
            row_release_one: s(format!(
                "UPDATE `{t}` SET holds = holds - 1, attempts = ? WHERE name = ?"
            )),
            row_release_all: s(format!(
                "UPDATE `{t}` SET owner = NULL, holds = 0, expires_at = NULL, attempts = NULL, holder = NULL WHERE name = ?"
            )),
            // The release of a sole hold in one statement: live, ours, one hold, and the
            // ledger exactly the releasing attempt's (so a retried release, or one the
            // ledger must weigh, matches nothing and goes to the full transaction).
            row_release_sole: s(format!(
                "UPDATE `{t}` SET owner = NULL, holds = 0, expires_at = NULL, attempts = NULL, holder = NULL \
                 WHERE name = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6) AND holds = 1 AND attempts = ?"
            )),
            row_clear_live: s(format!(
                "UPDATE `{t}` SET owner = NULL, holds = 0, expires_at = NULL, attempts = NULL, holder = NULL \
                 WHERE name = ? AND expires_at > UTC_TIMESTAMP(6)"
            )),
            inspect: s(format!(
                "SELECT owner, holds, fence, holder, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS left_us \
                 FROM `{t}` WHERE name = ? AND owner IS NOT NULL \
                 AND (expires_at IS NULL OR expires_at > UTC_TIMESTAMP(6))"
            )),
            mutex_insert: s(format!("INSERT IGNORE INTO `{t}_mutex` (name) VALUES (?)")),
            mutex_lock: s(format!(
                "SELECT name FROM `{t}_mutex` WHERE name = ? FOR UPDATE"
            )),
            mutex_lock_nowait: s(format!(
                "SELECT name FROM `{t}_mutex` WHERE name = ? FOR UPDATE NOWAIT"
            )),
            // A for-update holder: a new token and no expiry, unless a row-mode lease is
            // live on the key (both modes share the table).
            // Nor where the key has row-mode read, write or permit hold rows, live or not
            // (`no_holds`; `for_update::take_weighing_holds` weighs them under the row lock).
            // (Under READ COMMITTED the subquery reads after the row lock is granted: it
            // sees the holds committed by the row-mode transaction it waited for.)
            holder_take: s(format!(
                "UPDATE `{t}` t SET fence = LAST_INSERT_ID(fence + 1), owner = ?, holds = 1, \
                 expires_at = NULL, attempts = NULL, holder = ? WHERE name = ? \
                 AND NOT COALESCE(expires_at > UTC_TIMESTAMP(6), FALSE) AND {no_holds}"
            )),
            holder_insert: s(format!(
                "INSERT INTO `{t}` (name, owner, holds, fence, holder) VALUES (?, ?, 1, 1, ?)"
            )),
            holder_read: s(format!(
                "SELECT owner, holds, fence, holder FROM `{t}` WHERE name = ?"
            )),
            holder_depth: s(format!(
                "UPDATE `{t}` SET holds = ? WHERE name = ? AND owner = ? AND fence = ? \
                 AND expires_at IS NULL"
            )),
            holder_clear: s(format!(
                "UPDATE `{t}` SET owner = NULL, holds = 0, holder = NULL \
                 WHERE name = ? AND owner = ? AND fence = ? AND expires_at IS NULL"
            )),
            live_under_prefix: s(format!(
                "SELECT CAST((SELECT COUNT(*) FROM `{t}` WHERE name LIKE CONCAT(?, '%') AND expires_at > UTC_TIMESTAMP(6)) \
                 + (SELECT COUNT(*) FROM `{t}_holds` WHERE name LIKE CONCAT(?, '%') AND expires_at > UTC_TIMESTAMP(6)) AS SIGNED)"
            )),
            holds_table_exists: s(format!("SELECT 1 FROM `{t}_holds` LIMIT 0")),
            // A key's row with no mutex holder, for its first read, write or permit.
            row_insert_free: s(format!("INSERT INTO `{t}` (name) VALUES (?)")),
            fence_next: s(format!("UPDATE `{t}` SET fence = fence + 1 WHERE name = ?")),
            holds_of_key: s(format!(
                "SELECT kind, holder, owner, holds, token, permits, attempts, \
                 expires_at > UTC_TIMESTAMP(6) AS live, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS left_us \
                 FROM `{t}_holds` WHERE name = ?"
            )),
            holds_delete: s(format!(
                "DELETE FROM `{t}_holds` WHERE name = ? AND kind = ? AND holder = ?"
            )),
            holds_insert: s(format!(
                "INSERT INTO `{t}_holds` (name, kind, holder, owner, holds, token, permits, expires_at, attempts, identity) \
                 VALUES (?, ?, ?, ?, 1, ?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, ?)"
            )),
            holds_reenter: s(format!(
                "UPDATE `{t}_holds` SET holds = holds + 1, attempts = ?, \
                 expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE name = ? AND kind = ? AND holder = ?"
            )),
            // Under the key's row lock, for a hold just seen live: see row_extend_locked.
            holds_extend_locked: s(format!(
                "UPDATE `{t}_holds` SET expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE name = ? AND kind = ? AND holder = ?"
            )),
            holds_renew: s(format!(
                "UPDATE `{t}_holds` SET expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE name = ? AND kind = ? AND holder = ? AND expires_at > UTC_TIMESTAMP(6)"
            )),
            holds_select_one: s(format!(
                "SELECT holder, holds, attempts FROM `{t}_holds` \
                 WHERE name = ? AND kind = ? AND holder = ? AND expires_at > UTC_TIMESTAMP(6) FOR UPDATE"
            )),
            holds_select_permit_of: s(format!(
                "SELECT holder, holds, attempts FROM `{t}_holds` \
                 WHERE name = ? AND kind = 'p' AND owner = ? AND expires_at > UTC_TIMESTAMP(6) LIMIT 1 FOR UPDATE"
            )),
            holds_release_one: s(format!(
                "UPDATE `{t}_holds` SET holds = holds - 1, attempts = ? WHERE name = ? AND kind = ? AND holder = ?"
            )),
            holds_live: s(format!(
                "SELECT kind, owner, holds, token, permits, identity, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS left_us \
                 FROM `{t}_holds` WHERE name = ? AND kind IN ('r', 'w', 'p') \
                 AND expires_at > UTC_TIMESTAMP(6) ORDER BY kind = 'w' DESC, token"
            )),
            holds_clear_live: s(format!(
                "DELETE FROM `{t}_holds` WHERE name = ? AND kind IN ('r', 'w', 'p') AND expires_at > UTC_TIMESTAMP(6)"
            )),
            // A locking delete: it sees a renewal that committed after the holds were read.
            holds_delete_expired: s(format!(
                "DELETE FROM `{t}_holds` WHERE name = ? AND kind = ? AND holder = ? \
                 AND expires_at <= UTC_TIMESTAMP(6)"
            )),
            // Plain INSERT and UPDATE by key, never INSERT ... ON DUPLICATE KEY UPDATE, whose
            // next-key lock on a duplicate would lock the gap before it (a neighbouring key's
            // rows) even under READ COMMITTED.
            marker_insert: s(format!(
                "INSERT INTO `{t}_holds` (name, kind, holder, owner, holds, token, expires_at) \
                 VALUES (?, 'q', ?, ?, 1, 0, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"
            )),
            marker_refresh: s(format!(
                "UPDATE `{t}_holds` SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                 WHERE name = ? AND kind = 'q' AND holder = ?"
            )),
            marker_delete: s(format!(
                "DELETE FROM `{t}_holds` WHERE name = ? AND kind = 'q' AND holder = ?"
            )),
            mutex_rows_under_prefix: s(format!(
                "SELECT name FROM `{t}_mutex` WHERE name LIKE CONCAT(?, '%')"
            )),
        }
    }
}

#[cfg(test)]
mod retryable_tests {
    use sqlx::Connection;

    use super::db_error;

    /// Server errors raised on a real server with `SIGNAL`, by number and SQLSTATE: a
    /// lasting `HY000` (an incorrect value, a full table) is not retryable; a lock wait
    /// timeout, a deadlock or a read-only server during a failover is. Before, every
    /// `HY000` counted as retryable, so a wait went on retrying a lasting error until its
    /// deadline instead of failing at once.
    #[tokio::test]
    async fn retryable_is_decided_by_the_error_number() {
        let Some(url) = lockkit_conformance::env::service_url("LOCKKIT_TEST_MYSQL_URL") else {
            return;
        };
        let mut conn = sqlx::MySqlConnection::connect(&url).await.unwrap();
        for (state, number, retryable) in [
            ("HY000", 1366, false),
            ("HY000", 1114, false),
            ("HY000", 1021, false),
            ("42000", 1142, false),
            ("HY000", 1205, true),
            ("40001", 1213, true),
            ("HY000", 1290, true),
            ("08004", 1040, true),
        ] {
            let signal = format!(
                "SIGNAL SQLSTATE '{state}' SET MYSQL_ERRNO = {number}, MESSAGE_TEXT = 'signalled'"
            );
            let error = sqlx::raw_sql(sqlx::AssertSqlSafe(signal))
                .execute(&mut conn)
                .await
                .expect_err("SIGNAL raises an error");
            assert_eq!(
                db_error("signalling", error).is_retryable(),
                retryable,
                "error {number} ({state})"
            );
        }
    }
}

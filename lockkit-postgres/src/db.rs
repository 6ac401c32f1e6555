//! The database: its connection pool, the lease table and its statements, error mapping,
//! and the reads every mode answers the same way.

use std::{future::Future, sync::Arc, time::Duration};

use lockkit_core::{
    Error, FencingToken, HolderIdentity, HolderInfo, LockKey, Result,
    spi::{KeptConnections, Lent, sweep_while},
};
use sqlx::{
    AssertSqlSafe, PgPool, Postgres, Row, Transaction,
    pool::PoolConnection,
    postgres::{PgArguments, PgPoolOptions, PgQueryResult, PgRow},
};

use crate::PostgresConfig;

pub(crate) const BACKEND: &str = "postgres";

/// SQLSTATEs lockkit reacts to.
pub(crate) mod state {
    /// `unique_violation`.
    pub(crate) const UNIQUE_VIOLATION: &str = "23505";
    /// `undefined_table`.
    pub(crate) const UNDEFINED_TABLE: &str = "42P01";
    pub(crate) const UNDEFINED_COLUMN: &str = "42703";
    pub(crate) const DUPLICATE_COLUMN: &str = "42701";
    pub(crate) const DUPLICATE_OBJECT: &str = "42710";
    pub(crate) const DUPLICATE_TABLE: &str = "42P07";
    pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// `serialization_failure`, `deadlock_detected`: the server asks for a retry.
    pub(crate) const SERIALIZATION_FAILURE: &str = "40001";
    pub(crate) const DEADLOCK: &str = "40P01";
}

/// The SQLSTATE of a database error.
pub(crate) fn sql_state(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.to_string()),
        _ => None,
    }
}

/// Errors after which the connection, and so any session lock on it, is gone.
pub(crate) fn connection_gone(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed
    ) || sql_state(e).is_some_and(|c| c.starts_with("57P") || c.starts_with("08"))
}

/// Maps a driver error, saying what was being done and what to do.
pub(crate) fn db_error(doing: &str, e: sqlx::Error) -> Error {
    let code = sql_state(&e);
    let retryable = match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        // Serialization failure, deadlock, lock not available (`lock_timeout`), a statement
        // cancelled (`statement_timeout`), a transaction ended by
        // `idle_in_transaction_session_timeout`, the server shutting down or restarting
        // (class 57P: operator intervention), connection failures (class 08).
        sqlx::Error::Database(_) => code.as_deref().is_some_and(|c| {
            matches!(
                c,
                state::SERIALIZATION_FAILURE | state::DEADLOCK | "55P03" | "57014" | "25P03"
            ) || c.starts_with("57P")
                || c.starts_with("08")
        }),
        _ => false,
    };
    let hint = match &e {
        sqlx::Error::Io(_) => "; is the server running and reachable?",
        // Which of the two, only the pool can tell: see `Db::error` and `pool_timed_out`.
        sqlx::Error::PoolTimedOut => {
            "; no connection came free, and none could be opened, within connect_timeout"
        }
        _ => "",
    };
    Error::backend_with_source(BACKEND, retryable, format!("{doing} failed: {e}{hint}"), e)
}

/// The error of a pool of at most `max` connections to `config`'s server whose acquire
/// timeout (`connect_timeout`) ran out while `doing`, judged by the pool's state now: with
/// fewer than `max` connections open it could have opened one and could not (the server
/// refused, did not answer, or is at its connection limit), so the server could not be
/// reached; with all `max` open, every one stayed busy, and `raise` says which option to
/// raise. sqlx 0.9 keeps no cause for a timed-out open (it retries a refused connection
/// until its timeout, then answers `PoolTimedOut`), so none is given. Retryable; never
/// shows the password.
pub(crate) fn pool_timed_out(
    doing: &str,
    pool: &PgPool,
    max: u32,
    raise: &str,
    config: &PostgresConfig,
) -> Error {
    let message = if pool.size() < max {
        format!(
            "{doing} failed: could not reach the server at {} within connect_timeout \
             ({:?}): no connection could be opened (refused, no answer, or the server at its \
             connection limit); is it running and reachable there, and does it accept more \
             connections?",
            server_address(config),
            config.connect_timeout
        )
    } else {
        format!(
            "{doing} failed: all {max} pooled connections stayed busy for connect_timeout \
             ({:?}); raise {raise}, or hold them for less long",
            config.connect_timeout
        )
    };
    Error::backend_with_source(BACKEND, true, message, sqlx::Error::PoolTimedOut)
}

/// `host:port` (or the socket directory) of `config`'s server, for messages.
fn server_address(config: &PostgresConfig) -> String {
    let port = config.connect.get_port();
    match config.connect.get_socket() {
        Some(socket) => format!("{} (port {port})", socket.display()),
        None => format!("{}:{port}", config.connect.get_host()),
    }
}

pub(crate) fn query(
    sql: &Arc<str>,
) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(sql.clone()))
}

/// The `pg_advisory_lock` key of `key` in `table`'s namespace: the first 8 bytes of
/// SHA-256 of `lockkit:<table>:<key>`, big-endian. Any SQL client computes the same with
/// [`advisory_id_sql`]. Two keys share an id with odds of about 2^-64 per pair; if they
/// did, they would only exclude each other (never both be granted).
pub fn advisory_id(table: &str, key: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(b"lockkit:")
        .chain_update(table.as_bytes())
        .chain_update(b":")
        .chain_update(key.as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// The SQL expression of [`advisory_id`] for a `text` parameter `$1` holding
/// `lockkit:<table>:<key>`, for clients that are not lockkit (`psql`, another language):
/// `SELECT pg_advisory_lock(<this>)` takes the same lock as lockkit's `mode=advisory`.
pub const fn advisory_id_sql() -> &'static str {
    "('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 16))::bit(64)::bigint"
}

/// Whole microseconds, at least one, as the `bigint` the statements take.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX).max(1)
}

/// Every pooled connection's session: transactions lock only the rows they name (READ
/// COMMITTED, whatever the server's default), and no statement, row-lock wait or
/// transaction left open by a paused or cut-off client can hold a key's row for long: the
/// server ends it, and the waiter retries.
const SESSION: &str = "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED; \
     SET lock_timeout = '5s'; SET statement_timeout = '10s'; \
     SET idle_in_transaction_session_timeout = '5s'";

/// A pooled connection that sat idle at least this long is checked (a round trip) before
/// it is handed out; one used more recently is handed out at once. A connection that failed
/// is never given back to the pool (the pool checks each one it gets back), so what this
/// can hand out dead is a connection whose server or link went away within this long of
/// its last use (a server restart, `pg_terminate_backend`, right after a busy spell). The
/// first statement sent on one fails; that is noted ([`DeadSeen`]), every connection of
/// the backend's pools is then checked before use for [`PING_AFTER_LOSS`], and the
/// statements that may be sent again ([`Db::retry_gone`], [`Db::begin`]) are sent again on
/// another connection, so the call itself succeeds.
pub(crate) const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

/// How long after a connection of a backend was found gone its pools check every
/// connection before handing it out, not only those that idled (the others likely went
/// with it).
pub(crate) const PING_AFTER_LOSS: Duration = Duration::from_secs(5);

/// When a connection of one backend (one `connect`: its shared pool and its dedicated
/// connections) was last found gone. Per backend: one server's restart does not make the
/// pools of other backends check every connection.
pub(crate) type DeadSeen = lockkit_core::spi::RecentLoss;

/// The pools' check before handing out a connection (their `before_acquire`): a ping
/// after an idle spell of [`PING_IDLE_AFTER`], or within [`PING_AFTER_LOSS`] of a
/// connection found gone. A connection that fails it is closed and another one taken.
pub(crate) async fn ping_if_idle(
    conn: &mut sqlx::PgConnection,
    meta: sqlx::pool::PoolConnectionMetadata,
    dead_seen: &DeadSeen,
) -> std::result::Result<bool, sqlx::Error> {
    if (meta.idle_for >= PING_IDLE_AFTER || dead_seen.within(PING_AFTER_LOSS))
        && let Err(e) = sqlx::Connection::ping(conn).await
    {
        dead_seen.note();
        return Err(e);
    }
    Ok(true)
}

/// The database: a pool for short statements and the statements on its table.
pub(crate) struct Db {
    pub(crate) config: PostgresConfig,
    /// Shared with the checks of the shared pool and of the dedicated connections.
    pub(crate) dead_seen: Arc<DeadSeen>,
    pub(crate) pool: PgPool,
    pub(crate) sql: Sql,
    /// Connections of the shared pool kept out of it between one-statement calls
    /// ([`Db::execute_one`], [`Db::fetch_optional_one`]): at most a quarter of `pool_size`
    /// (none for a pool of up to three).
    kept: KeptConnections<PoolConnection<Postgres>>,
}

/// How long a connection stays out of the pool at most, however busy: then it goes back,
/// so the pool's checks and `max_lifetime` still reach it.
pub(crate) const KEPT_AT_MOST: Duration = Duration::from_secs(60);

impl Drop for Db {
    /// Kept connections go back to the pool, or are closed in place outside a runtime
    /// ([`KeptConnections::drop_all`]).
    fn drop(&mut self) {
        self.kept.drop_all(|conn| drop(conn.detach()));
    }
}

impl Db {
    /// Opens the pool `config` asks for and makes sure the table is there.
    pub(crate) async fn connect(config: PostgresConfig) -> Result<Arc<Db>> {
        let dead_seen = Arc::new(DeadSeen::new());
        let seen = dead_seen.clone();
        let pool = PgPoolOptions::new()
            .max_connections(config.pool_size)
            .acquire_timeout(config.connect_timeout)
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                let seen = seen.clone();
                Box::pin(async move { ping_if_idle(conn, meta, &seen).await })
            })
            .after_connect(|conn, _| {
                Box::pin(async move { sqlx::raw_sql(SESSION).execute(conn).await.map(|_| ()) })
            })
            .connect_lazy_with(config.connect.clone());
        // The first connection, opened now (as `connect_with` would), so that a server that
        // cannot be reached is reported here.
        pool.acquire().await.map_err(|e| match e {
            sqlx::Error::PoolTimedOut => pool_timed_out(
                "connecting to PostgreSQL",
                &pool,
                config.pool_size,
                "pool_size",
                &config,
            ),
            e => db_error("connecting to PostgreSQL", e),
        })?;
        let keep_at_most = usize::try_from(config.pool_size / 4).unwrap_or(0);
        let db = Arc::new(Db {
            sql: Sql::new(&config.table),
            config,
            dead_seen,
            pool,
            kept: KeptConnections::new(keep_at_most, PING_IDLE_AFTER, KEPT_AT_MOST),
        });
        if db.kept.at_most() > 0 {
            // Gives back idle kept connections while the client lives and its pool is open.
            tokio::spawn(sweep_while(
                Arc::downgrade(&db),
                PING_IDLE_AFTER,
                |db: &Db| {
                    db.kept.sweep(db.return_all_kept());
                    !db.pool.is_closed()
                },
            ));
        }
        db.ensure_schema().await?;
        Ok(db)
    }

    /// Maps a driver error like [`db_error`], telling a pool wait that ran out because no
    /// connection could be opened from one where every connection was busy
    /// ([`pool_timed_out`]).
    pub(crate) fn error(&self, doing: &str, e: sqlx::Error) -> Error {
        match e {
            sqlx::Error::PoolTimedOut => pool_timed_out(
                doing,
                &self.pool,
                self.config.pool_size,
                "pool_size",
                &self.config,
            ),
            e => db_error(doing, e),
        }
    }

    /// Whether `e` means the connection is gone ([`connection_gone`]); if so, the pools
    /// check every connection before use for a while ([`PING_AFTER_LOSS`]).
    pub(crate) fn gone(&self, e: &sqlx::Error) -> bool {
        let gone = connection_gone(e);
        if gone {
            self.dead_seen.note();
        }
        gone
    }

    /// Runs `statement` on the shared pool, and again on another connection while the one
    /// it was sent on turns out gone (it died since its last use, say in a server
    /// restart), up to `pool_size + 1` times in all. Only for statements that are harmless
    /// to send again: reads, renewals (which only lengthen a lease), a `BEGIN`, statements
    /// whose second run changes nothing the first did not. Before each try, a kept
    /// connection goes back to a full pool ([`Db::make_room`]).
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
                Err(e) if self.gone(&e) && tries <= self.config.pool_size => {
                    tracing::debug!(error = %e, "a pooled connection was gone; sending the statement on another");
                }
                outcome => return outcome,
            }
        }
    }

    /// Runs one autocommitted statement like `statement.execute(&pool)`, without sqlx's
    /// cost of giving a connection back to its pool (a check, a round trip, in a task of
    /// its own, on every return): the connection is kept for the next one-statement call
    /// while the pool can spare it (see [`KeptConnections`]). A connection whose statement
    /// failed on the way, or whose caller went away mid-way, is never kept: it goes back to
    /// the pool, which checks it, as before.
    pub(crate) async fn execute_one(
        &self,
        statement: sqlx::query::Query<'_, Postgres, PgArguments>,
    ) -> std::result::Result<PgQueryResult, sqlx::Error> {
        let mut lent = self.lend().await?;
        let done = statement.execute(&mut *lent.conn).await;
        self.keep(lent, &done);
        done
    }

    /// [`Db::execute_one`] for a statement that returns at most one row.
    pub(crate) async fn fetch_optional_one(
        &self,
        statement: sqlx::query::Query<'_, Postgres, PgArguments>,
    ) -> std::result::Result<Option<PgRow>, sqlx::Error> {
        let mut lent = self.lend().await?;
        let done = statement.fetch_optional(&mut *lent.conn).await;
        self.keep(lent, &done);
        done
    }

    /// A kept connection, or one from the pool.
    async fn lend(&self) -> std::result::Result<Lent<PoolConnection<Postgres>>, sqlx::Error> {
        self.kept
            .lend(
                || self.return_all_kept(),
                self.pool.acquire(),
                |e| matches!(e, sqlx::Error::PoolTimedOut),
            )
            .await
    }

    /// Keeps `lent` after a statement that completed, or failed with an error that leaves
    /// the connection clean (the autocommitted statement rolled back: a unique violation,
    /// a lock not available, a serialization failure or deadlock), if there is room and
    /// the pool is open and can spare it; otherwise it goes back to the pool.
    fn keep<T>(
        &self,
        lent: Lent<PoolConnection<Postgres>>,
        done: &std::result::Result<T, sqlx::Error>,
    ) {
        let clean = match done {
            Ok(_) => true,
            Err(e) => sql_state(e).is_some_and(|c| {
                [
                    state::UNIQUE_VIOLATION,
                    state::LOCK_NOT_AVAILABLE,
                    state::SERIALIZATION_FAILURE,
                    state::DEADLOCK,
                ]
                .contains(&c.as_str())
            }),
        };
        if !clean {
            return;
        }
        let spare = self.pool.num_idle() > 0 || self.pool.size() < self.config.pool_size;
        self.kept.keep(lent, || spare && !self.return_all_kept());
    }

    /// Whether every kept connection must go back to the pool now: the pool closed, or a
    /// connection was seen gone within [`PING_AFTER_LOSS`].
    fn return_all_kept(&self) -> bool {
        self.pool.is_closed() || self.dead_seen.within(PING_AFTER_LOSS)
    }

    /// How many connections are kept now.
    #[cfg(feature = "testing")]
    pub(crate) fn kept_count(&self) -> usize {
        self.kept.len()
    }

    /// Gives every kept connection back to the pool (when the pool closes: it waits for
    /// all its connections).
    pub(crate) fn return_kept(&self) {
        drop(self.kept.take_all());
    }

    /// The server process ids of the connections kept for one-statement calls now.
    #[cfg(feature = "testing")]
    pub(crate) async fn kept_connection_pids(&self) -> std::result::Result<Vec<i32>, sqlx::Error> {
        let mut pids = Vec::new();
        let mut back = Vec::new();
        while let Some(mut lent) = self.kept.take(self.return_all_kept()) {
            let pid = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                .fetch_one(&mut *lent.conn)
                .await;
            back.push(lent);
            pids.push(pid?);
        }
        // Back in their order of use (the most recent was taken first).
        for lent in back.into_iter().rev() {
            self.keep(lent, &Ok::<(), sqlx::Error>(()));
        }
        Ok(pids)
    }

    /// A transaction on the shared pool, begun on a connection that answers (a kept
    /// connection goes back to a full pool first: see [`Db::retry_gone`]).
    pub(crate) async fn begin(
        &self,
    ) -> std::result::Result<Transaction<'static, Postgres>, sqlx::Error> {
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

    /// Checks the table is there, and creates it if it is not and that is allowed (so a
    /// role without `CREATE` on the schema works once the table exists).
    async fn ensure_schema(&self) -> Result<()> {
        let table = &self.config.table;
        let missing = |e: &sqlx::Error| sql_state(e).as_deref() == Some(state::UNDEFINED_TABLE);
        match query(&self.sql.table_exists).execute(&self.pool).await {
            Ok(_) => {
                self.ensure_holder_column().await?;
                return self.ensure_holds_table().await;
            }
            Err(e) if missing(&e) && self.config.create_schema => {}
            Err(e) if missing(&e) => {
                return Err(Error::Config(format!(
                    "table `{table}` does not exist and create_schema=false; create it with:\n{}",
                    ddl(table)
                )));
            }
            Err(e) => return Err(self.error(&format!("checking table `{table}`"), e)),
        }
        // Concurrent `CREATE TABLE IF NOT EXISTS` can still collide on the catalog's unique
        // index (23505) or on the table's row type (42710, "type ... already exists"): the
        // other client made it, which is all this wanted.
        match sqlx::raw_sql(AssertSqlSafe(ddl(table)))
            .execute(&self.pool)
            .await
        {
            Ok(_) => {}
            // The catalog's unique index, or the table's row type, says it first.
            Err(e)
                if matches!(
                    sql_state(&e).as_deref(),
                    Some(state::UNIQUE_VIOLATION | state::DUPLICATE_OBJECT)
                ) => {}
            Err(e) => return Err(self.error(&format!("creating table `{table}`"), e)),
        }
        // Whoever created the tables, both must be there now.
        self.ensure_holds_table().await
    }

    /// A table made before the `holder` column existed gets it (or, with
    /// create_schema=false, an error with the statement to run).
    async fn ensure_holder_column(&self) -> Result<()> {
        let table = &self.config.table;
        let undefined = |e: &sqlx::Error| sql_state(e).as_deref() == Some(state::UNDEFINED_COLUMN);
        match query(&self.sql.holder_column_exists)
            .execute(&self.pool)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if undefined(&e) && self.config.create_schema => {
                match self.alter_briefly(&self.sql.add_holder_column).await {
                    Ok(()) => Ok(()),
                    Err(e) if sql_state(&e).as_deref() == Some(state::LOCK_NOT_AVAILABLE) => {
                        Err(Error::Config(format!(
                            "could not add the `holder` column to `{table}` within {} s: \
                             another session holds the table (a long transaction or a dump); \
                             run this at a quiet moment, then connect again:\n{};",
                            ALTER_LOCK_WAIT.as_secs(),
                            self.sql.add_holder_column
                        )))
                    }
                    // Another client added it at the same moment (IF NOT EXISTS checks
                    // before it locks): what this wanted.
                    Err(e)
                        if matches!(
                            sql_state(&e).as_deref(),
                            Some(state::DUPLICATE_COLUMN | state::UNIQUE_VIOLATION)
                        ) =>
                    {
                        Ok(())
                    }
                    Err(e) => Err(self.error(
                        &format!(
                            "adding the holder column to `{table}` (or run it yourself: {})",
                            self.sql.add_holder_column
                        ),
                        e,
                    )),
                }
            }
            Err(e) if undefined(&e) => Err(Error::Config(format!(
                "table `{table}` lacks the `holder` column and create_schema=false; add it with:\n{};",
                self.sql.add_holder_column
            ))),
            Err(e) => Err(self.error(&format!("checking the columns of `{table}`"), e)),
        }
    }

    /// A table made before read-write locks and semaphores existed gets its holds table
    /// (`<table>_holds`), or, with create_schema=false, an error with the statement to run.
    async fn ensure_holds_table(&self) -> Result<()> {
        let table = holds_table(&self.config.table);
        let missing = |e: &sqlx::Error| sql_state(e).as_deref() == Some(state::UNDEFINED_TABLE);
        match query(&self.sql.holds.exist).execute(&self.pool).await {
            Ok(_) => Ok(()),
            Err(e) if missing(&e) && self.config.create_schema => {
                let statement = holds_ddl(&self.config.table);
                match sqlx::raw_sql(AssertSqlSafe(statement.clone()))
                    .execute(&self.pool)
                    .await
                {
                    Ok(_) => Ok(()),
                    // Another client created it at the same moment: what this wanted.
                    Err(e)
                        if matches!(
                            sql_state(&e).as_deref(),
                            Some(
                                state::UNIQUE_VIOLATION
                                    | state::DUPLICATE_OBJECT
                                    | state::DUPLICATE_TABLE
                            )
                        ) =>
                    {
                        Ok(())
                    }
                    Err(e) => Err(self.error(
                        &format!("creating table `{table}` (or run it yourself: {statement})"),
                        e,
                    )),
                }
            }
            Err(e) if missing(&e) => Err(Error::Config(format!(
                "table `{table}` (holds of read-write locks and semaphores, which every lock \
                 checks) does not exist and create_schema=false; create it with:\n{};",
                holds_ddl(&self.config.table)
            ))),
            Err(e) => Err(self.error(&format!("checking table `{table}`"), e)),
        }
    }

    /// Runs `alter` in a transaction that waits at most [`ALTER_LOCK_WAIT`] for the table's
    /// lock: queued behind a long transaction, an `ALTER` would hold up every statement on
    /// the table (renewals too) for as long as it waits.
    async fn alter_briefly(&self, alter: &Arc<str>) -> std::result::Result<(), sqlx::Error> {
        let mut tx = self.begin().await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET LOCAL lock_timeout = '{}s'",
            ALTER_LOCK_WAIT.as_secs()
        )))
        .execute(&mut *tx)
        .await?;
        query(alter).execute(&mut *tx).await?;
        tx.commit().await
    }

    /// Live row-mode leases on keys under `prefix`. For leak checks.
    #[cfg(feature = "testing")]
    pub(crate) async fn leases_under(&self, prefix: &str) -> Result<u64> {
        let (n,): (i64,) = sqlx::query_as(AssertSqlSafe(self.sql.live_under_prefix.clone()))
            .bind(prefix.as_bytes())
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.error("counting live leases", e))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// `key`'s advisory lock id in this table's namespace.
    pub(crate) fn advisory_id(&self, key: &LockKey) -> i64 {
        advisory_id(&self.config.table, key.as_str())
    }

    /// The readers' lock of `key`: the two-`int4` advisory lock (`objsubid` 2 in
    /// `pg_locks`, a lock of its own) of the halves of [`Db::advisory_id`]. Every advisory
    /// reader holds it shared beside the key's lock. Row mode cannot see a shared hold of
    /// the key's lock (its own transactions take that lock shared while they decide), so it
    /// tries this one, exclusively, once it holds the key's row: nothing else takes it.
    pub(crate) fn readers_lock(&self, key: &LockKey) -> (i32, i32) {
        let id = self.advisory_id(key);
        let [a, b, c, d, e, f, g, h] = id.to_be_bytes();
        (
            i32::from_be_bytes([a, b, c, d]),
            i32::from_be_bytes([e, f, g, h]),
        )
    }

    /// One round trip to the server.
    pub(crate) async fn ping(&self) -> Result<()> {
        let _: (i32,) = self
            .retry_gone(|| sqlx::query_as("SELECT 1").fetch_one(&self.pool))
            .await
            .map_err(|e| self.error("SELECT 1", e))?;
        Ok(())
    }

    /// Who holds `key` according to the lease table: a live lease.
    pub(crate) async fn inspect_lease(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let row = self
            .retry_gone(|| {
                query(&self.sql.inspect)
                    .bind(key.as_str().as_bytes())
                    .bind(self.advisory_id(key))
                    .fetch_optional(&self.pool)
            })
            .await
            .map_err(|e| self.error("inspecting the lease", e))?;
        let Some(row) = row else { return Ok(None) };
        let left = row.try_get::<Option<i64>, _>("left_us").ok().flatten();
        Ok(Some(
            HolderInfo::new(
                row_text(&row, "owner").unwrap_or_default(),
                row.try_get::<i32, _>("holds")
                    .ok()
                    .and_then(|h| u32::try_from(h).ok())
                    .unwrap_or(1),
                fence_of(&row).ok().map(FencingToken::new),
                left.and_then(|us| u64::try_from(us).ok())
                    .map(Duration::from_micros),
            )
            // Only if written for this owner: a client that does not know the column (an
            // older lockkit) leaves a previous holder's there.
            .with_identity(row_text(&row, "owner").and_then(|owner| {
                row_text(&row, "holder").and_then(|h| HolderIdentity::decode_for(&h, &owner))
            })),
        ))
    }
}

pub(crate) fn row_text(row: &PgRow, column: &str) -> Option<String> {
    row.try_get::<Option<String>, _>(column).ok().flatten()
}

/// The row's `fence` (a `bigint` that only grows from 0).
pub(crate) fn fence_of(row: &PgRow) -> std::result::Result<u64, sqlx::Error> {
    let fence: i64 = row.try_get("fence")?;
    Ok(u64::try_from(fence).unwrap_or(0))
}

/// The longest a schema change waits for its table lock before it gives up.
pub(crate) const ALTER_LOCK_WAIT: Duration = Duration::from_secs(5);

// ---- the table and its statements

/// The DDL for `table` (quoted as given): one row per key, never deleted, so its fence only
/// grows; then its holds table, `<table>_holds` (read and write holds, permits, waiting
/// writers' markers), separated by `;\n`.
pub fn ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS \"{table}\" (\n  \
           name BYTEA NOT NULL PRIMARY KEY CHECK (octet_length(name) <= 512),\n  \
           owner TEXT NULL,\n  \
           holds INTEGER NOT NULL DEFAULT 0,\n  \
           fence BIGINT NOT NULL DEFAULT 0,\n  \
           expires_at TIMESTAMPTZ NULL,\n  \
           attempts TEXT NULL,\n  \
           holder TEXT NULL\n\
         );\n{}",
        holds_ddl(table)
    )
}

/// The holds table of `table`: `<table>_holds`.
pub(crate) fn holds_table(table: &str) -> String {
    format!("{table}_holds")
}

/// The DDL of `table`'s holds table: one row per read or write hold (per owner), per
/// permit (per acquisition) and per waiting writer's marker. The key's row in `table`
/// stays the point every change of its holds is serialized on, and its fencing counter.
fn holds_ddl(table: &str) -> String {
    let holds = holds_table(table);
    format!(
        "CREATE TABLE IF NOT EXISTS \"{holds}\" (\n  \
           name BYTEA NOT NULL CHECK (octet_length(name) <= 512),\n  \
           kind TEXT NOT NULL CHECK (kind IN ('r', 'w', 'p', 'q')),\n  \
           holder TEXT NOT NULL,\n  \
           owner TEXT NOT NULL,\n  \
           holds INTEGER NOT NULL DEFAULT 1,\n  \
           token BIGINT NOT NULL DEFAULT 0,\n  \
           expires_at TIMESTAMPTZ NOT NULL,\n  \
           attempts TEXT NULL,\n  \
           identity TEXT NULL,\n  \
           permits INTEGER NULL,\n  \
           PRIMARY KEY (name, kind, holder)\n\
         )"
    )
}

/// The channel releases are announced on (`NOTIFY`), one per table; the payload is the
/// key. At most 60 bytes: the table name is at most 48, and channel names are cut at 63.
pub(crate) fn release_channel(table: &str) -> String {
    format!("lockkit_rel_{table}")
}

/// `key` as the hex a release announces (any key fits any database encoding).
pub(crate) fn key_hex(key: &str) -> String {
    use std::fmt::Write as _;
    key.bytes()
        .fold(String::with_capacity(key.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

/// The payload of a release of `key` on [`release_channel`].
pub(crate) fn release_payload(key: &str) -> String {
    format!("r:{}", key_hex(key))
}

/// `bytes` as an SQL expression of type `bytea` that needs no quoting: hex digits only.
fn bytea_literal(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut hex = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(hex, "{b:02x}");
    }
    format!("decode('{hex}', 'hex')")
}

/// `text` as an SQL expression of type `text` that needs no quoting (any text: it is
/// carried as hex).
fn text_literal(text: &str) -> String {
    format!("convert_from({}, 'UTF8')", bytea_literal(text.as_bytes()))
}

/// How long the clearing of an advisory holder's record in its release script waits for
/// the key's row (a row-mode transaction deciding over the key holds it for a moment).
pub(crate) const CLEAR_LOCK_WAIT: Duration = Duration::from_secs(1);

/// The last release of an advisory session, in one round trip (a simple query: its
/// statements run as one transaction, which commits at its end): lets go of every advisory
/// lock of the session (at once: session locks are not transactional), clears its lease
/// and its name, and clears the key's record if it is still this hold's (`owner`, `token`)
/// with the announcement to row-mode waiters, which goes out when the script commits.
/// The script's commit does not wait for its WAL flush (`synchronous_commit = off`, for this
/// transaction only): the record only names a holder while the key's advisory lock is held,
/// so a clearing lost in a server crash leaves a record of a hold that is over, which every
/// client reads as free (and no advisory lock outlives the crash); the fence is not
/// touched. `pause` (tests only) sleeps between the unlock and the clearing. If the script fails,
/// the unlock has taken effect or the connection is unusable; its `SET`s are undone with the
/// rest of the transaction, so the caller resets the connection again (or closes it).
pub(crate) fn advisory_release_script(
    table: &str,
    key: &str,
    owner: &str,
    token: i64,
    pause: Duration,
) -> String {
    let pause = if pause.is_zero() {
        String::new()
    } else {
        format!("SELECT pg_sleep({}); ", pause.as_secs_f64())
    };
    format!(
        "SELECT pg_advisory_unlock_all(); {pause}SET idle_session_timeout = 0; \
         RESET application_name; SET lock_timeout = {wait}; SET LOCAL synchronous_commit = off; \
         WITH cleared AS (UPDATE \"{table}\" SET owner = NULL, holds = 0, expires_at = NULL, \
         attempts = NULL, holder = NULL WHERE name = {name} AND owner = {owner} \
         AND fence = {token} AND expires_at = 'infinity' RETURNING 1) \
         SELECT pg_notify({channel}, {payload}) FROM cleared",
        wait = CLEAR_LOCK_WAIT.as_millis(),
        name = bytea_literal(key.as_bytes()),
        owner = text_literal(owner),
        channel = text_literal(&release_channel(table)),
        payload = text_literal(&release_payload(key)),
    )
}

/// `now + $n microseconds` on the server's clock: `clock_timestamp()`, the time of the
/// statement itself (not `now()`, the time the transaction began).
fn from_now(param: u8) -> String {
    format!("clock_timestamp() + ${param}::bigint * interval '1 microsecond'")
}

/// Every statement, prepared once per connection by the driver's statement cache.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) holder_column_exists: Arc<str>,
    pub(crate) add_holder_column: Arc<str>,
    pub(crate) advisory_waiters: Arc<str>,
    pub(crate) advisory_holders: Arc<str>,
    pub(crate) table_exists: Arc<str>,
    pub(crate) row_select_for_update: Arc<str>,
    pub(crate) row_insert: Arc<str>,
    pub(crate) row_take: Arc<str>,
    pub(crate) row_reenter: Arc<str>,
    pub(crate) row_renew: Arc<str>,
    pub(crate) row_extend_locked: Arc<str>,
    pub(crate) row_release_one: Arc<str>,
    pub(crate) row_release_all: Arc<str>,
    pub(crate) row_clear_live: Arc<str>,
    /// One statement that grants a free plain lock, or changes nothing (see `Sql::new`).
    pub(crate) row_grant_free: Arc<str>,
    /// One statement that lets go of a plain lock of depth one and announces it, or
    /// changes nothing (see `Sql::new`).
    pub(crate) row_release_last: Arc<str>,
    pub(crate) notify_release: Arc<str>,
    pub(crate) inspect: Arc<str>,
    pub(crate) advisory_take: Arc<str>,
    pub(crate) advisory_insert: Arc<str>,
    /// Deletes the key's read, write and permit holds whose lease is over (see `Sql::new`).
    pub(crate) advisory_prune: Arc<str>,
    pub(crate) advisory_depth: Arc<str>,
    pub(crate) advisory_clear: Arc<str>,
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) advisory_locked: Arc<str>,
    pub(crate) advisory_take_away: Arc<str>,
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) live_under_prefix: Arc<str>,
    /// The statements on the holds table (read-write locks and semaphores).
    pub(crate) holds: HoldsSql,
}

/// The statements on `<table>_holds`. Every one that adds a hold or a marker runs under the
/// lock of the key's row in the main table (taken by `row_select_for_update`, or
/// `key_lock`), so one transaction at a time decides over a key's holds.
#[derive(Debug)]
pub(crate) struct HoldsSql {
    pub(crate) exist: Arc<str>,
    /// Creates the key's row in the main table, free, if it has none.
    pub(crate) key_row: Arc<str>,
    /// Locks the key's row in the main table.
    pub(crate) key_lock: Arc<str>,
    /// Every hold and marker of a key, locked, with its lease left (µs; <= 0: over).
    pub(crate) lock_all: Arc<str>,
    pub(crate) prune: Arc<str>,
    /// A new hold: the key's fence + 1 is its token; the asking wait's marker goes.
    pub(crate) grant: Arc<str>,
    pub(crate) reenter: Arc<str>,
    pub(crate) extend: Arc<str>,
    pub(crate) mark: Arc<str>,
    pub(crate) unmark: Arc<str>,
    pub(crate) renew: Arc<str>,
    pub(crate) lock_one: Arc<str>,
    pub(crate) release_one: Arc<str>,
    pub(crate) delete: Arc<str>,
    pub(crate) list: Arc<str>,
    pub(crate) clear_live: Arc<str>,
}

impl HoldsSql {
    fn new(t: &str) -> Self {
        let s = |text: String| Arc::<str>::from(text);
        let h = holds_table(t);
        let left_us = "(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000000)::bigint";
        HoldsSql {
            exist: s(format!(
                "SELECT name, kind, holder, owner, holds, token, expires_at, attempts, identity, \
                 permits FROM \"{h}\" LIMIT 0"
            )),
            key_row: s(format!(
                "INSERT INTO \"{t}\" (name) VALUES ($1) ON CONFLICT (name) DO NOTHING"
            )),
            key_lock: s(format!("SELECT 1 FROM \"{t}\" WHERE name = $1 FOR UPDATE")),
            lock_all: s(format!(
                "SELECT kind, holder, owner, holds, token, attempts, permits, {left_us} AS left_us \
                 FROM \"{h}\" WHERE name = $1 FOR UPDATE"
            )),
            prune: s(format!(
                "DELETE FROM \"{h}\" WHERE name = $1 AND expires_at <= clock_timestamp()"
            )),
            grant: s(format!(
                "WITH fenced AS (UPDATE \"{t}\" SET fence = fence + 1 WHERE name = $1 RETURNING fence), \
                 unmarked AS (DELETE FROM \"{h}\" WHERE name = $1 AND kind = 'q' AND holder = $9) \
                 INSERT INTO \"{h}\" (name, kind, holder, owner, holds, token, expires_at, attempts, \
                 identity, permits) SELECT $1, $2, $3, $4, 1, fence, {}, $6, $7, $8 FROM fenced \
                 ON CONFLICT (name, kind, holder) DO UPDATE SET owner = EXCLUDED.owner, holds = 1, \
                 token = EXCLUDED.token, expires_at = EXCLUDED.expires_at, \
                 attempts = EXCLUDED.attempts, identity = EXCLUDED.identity, \
                 permits = EXCLUDED.permits RETURNING token",
                from_now(5)
            )),
            reenter: s(format!(
                "UPDATE \"{h}\" SET holds = holds + 1, attempts = $1, \
                 expires_at = GREATEST(expires_at, {}) WHERE name = $3 AND kind = $4 AND holder = $5",
                from_now(2)
            )),
            // Under the row locks of a transaction that just saw the hold live: extended even
            // if it ran out meanwhile (nobody else decided over the key since).
            extend: s(format!(
                "UPDATE \"{h}\" SET expires_at = GREATEST(expires_at, {}) \
                 WHERE name = $2 AND kind = $3 AND holder = $4",
                from_now(1)
            )),
            mark: s(format!(
                "INSERT INTO \"{h}\" (name, kind, holder, owner, holds, token, expires_at) \
                 VALUES ($1, 'q', $2, $3, 1, 0, {}) ON CONFLICT (name, kind, holder) \
                 DO UPDATE SET expires_at = EXCLUDED.expires_at",
                from_now(4)
            )),
            unmark: s(format!(
                "DELETE FROM \"{h}\" WHERE name = $1 AND kind = 'q' AND holder = $2"
            )),
            renew: s(format!(
                "UPDATE \"{h}\" SET expires_at = GREATEST(expires_at, {}) \
                 WHERE name = $2 AND kind = $3 AND holder = $4 AND owner = $5 \
                 AND expires_at > clock_timestamp()",
                from_now(1)
            )),
            lock_one: s(format!(
                "SELECT holds, attempts FROM \"{h}\" WHERE name = $1 AND kind = $2 AND holder = $3 \
                 AND owner = $4 AND expires_at > clock_timestamp() FOR UPDATE"
            )),
            release_one: s(format!(
                "UPDATE \"{h}\" SET holds = holds - 1, attempts = $1 \
                 WHERE name = $2 AND kind = $3 AND holder = $4"
            )),
            delete: s(format!(
                "DELETE FROM \"{h}\" WHERE name = $1 AND kind = $2 AND holder = $3"
            )),
            list: s(format!(
                "SELECT kind, owner, holds, token, identity, permits, {left_us} AS left_us \
                 FROM \"{h}\" WHERE name = $1 AND kind <> 'q' AND expires_at > clock_timestamp() \
                 ORDER BY kind <> 'w', token"
            )),
            clear_live: s(format!(
                "DELETE FROM \"{h}\" WHERE name = $1 AND kind <> 'q' \
                 AND expires_at > clock_timestamp()"
            )),
        }
    }
}

impl Sql {
    pub(crate) fn new(t: &str) -> Self {
        let s = |text: String| Arc::<str>::from(text);
        // A key whose advisory lock another session holds is held (by a `mode=advisory`
        // client, or any other): `pg_try_advisory_xact_lock_shared` succeeds only for a lock
        // this transaction may take, and then keeps advisory holders (exclusive) out until it
        // commits. Shared, because it is taken before the row lock is granted (a `SELECT ...
        // FOR UPDATE` computes its columns first): two row-mode transactions on one key, one
        // waiting for the other's row lock, must not take each other for an advisory holder.
        // Past that, a row whose `expires_at` is `infinity` records an advisory hold that is
        // over, and any other row is live while its lease runs.
        let left_us = "CASE WHEN expires_at = 'infinity' THEN NULL ELSE \
             (EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000000)::bigint END";
        let live = "CASE WHEN NOT pg_try_advisory_xact_lock_shared($2) THEN TRUE \
             WHEN expires_at = 'infinity' THEN FALSE \
             ELSE COALESCE(expires_at > clock_timestamp(), FALSE) END";
        // A lease of mode=row, running now.
        let leased = "(expires_at <> 'infinity' AND expires_at > clock_timestamp())";
        // The advisory lock `$n` granted to some session of this database.
        let advisory_held = |n: u8| {
            format!(
                "EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND classid = ((${n} >> 32) & 4294967295)::oid \
                 AND objid = (${n} & 4294967295)::oid AND objsubid = 1)"
            )
        };
        let h = holds_table(t);
        // A recorded advisory hold names itself on its session, in the same statement:
        // `$4 || <token> || 'x1'` as its `application_name` (none when `$4` is null).
        let name_hold = "CASE WHEN $4::text IS NULL THEN NULL \
             ELSE set_config('application_name', $4::text || fence::text || 'x1', false) END AS named";
        Sql {
            holds: HoldsSql::new(t),
            holder_column_exists: s(format!("SELECT holder FROM \"{t}\" LIMIT 0")),
            add_holder_column: s(format!(
                "ALTER TABLE \"{t}\" ADD COLUMN IF NOT EXISTS holder TEXT NULL"
            )),
            // Sessions queued for the advisory lock `$1` (not granted yet).
            advisory_waiters: s(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND classid = (($1 >> 32) & 4294967295)::oid \
                 AND objid = ($1 & 4294967295)::oid AND objsubid = 1"
                    .to_owned(),
            ),
            // Sessions granted the advisory lock `$1`, the exclusive one first, with their
            // names (a session of another role shows none).
            advisory_holders: s(
                "SELECT l.mode, a.application_name FROM pg_locks l \
                 LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.locktype = 'advisory' AND l.granted \
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND l.classid = (($1 >> 32) & 4294967295)::oid \
                 AND l.objid = ($1 & 4294967295)::oid AND l.objsubid = 1 \
                 ORDER BY l.mode <> 'ExclusiveLock', l.pid"
                    .to_owned(),
            ),
            table_exists: s(format!(
                "SELECT name, owner, holds, fence, expires_at, attempts FROM \"{t}\" LIMIT 0"
            )),
            row_select_for_update: s(format!(
                "SELECT owner, holds, fence, attempts, {live} AS live, {left_us} AS left_us \
                 FROM \"{t}\" WHERE name = $1 FOR UPDATE"
            )),
            row_insert: s(format!(
                "INSERT INTO \"{t}\" (name, owner, holds, fence, expires_at, attempts, holder) \
                 VALUES ($1, $2, 1, 1, {}, $4, $5) ON CONFLICT (name) DO NOTHING",
                from_now(3)
            )),
            row_take: s(format!(
                "UPDATE \"{t}\" SET owner = $1, holds = 1, fence = fence + 1, expires_at = {}, \
                 attempts = $3, holder = $5 WHERE name = $4 RETURNING fence",
                from_now(2)
            )),
            row_reenter: s(format!(
                "UPDATE \"{t}\" SET holds = holds + 1, attempts = $1, \
                 expires_at = GREATEST(expires_at, {}) WHERE name = $3",
                from_now(2)
            )),
            row_renew: s(format!(
                "UPDATE \"{t}\" SET expires_at = GREATEST(expires_at, {}) \
                 WHERE name = $2 AND owner = $3 AND {leased}",
                from_now(1)
            )),
            // Under the row lock of a transaction that just saw the lease live and ours: no
            // one else can have taken it since, so extend it even if it ran out meanwhile.
            row_extend_locked: s(format!(
                "UPDATE \"{t}\" SET expires_at = GREATEST(expires_at, {}) \
                 WHERE name = $2 AND owner = $3",
                from_now(1)
            )),
            row_release_one: s(format!(
                "UPDATE \"{t}\" SET holds = holds - 1, attempts = $1 WHERE name = $2"
            )),
            row_release_all: s(format!(
                "UPDATE \"{t}\" SET owner = NULL, holds = 0, expires_at = NULL, attempts = NULL, \
                 holder = NULL WHERE name = $1"
            )),
            row_clear_live: s(format!(
                "UPDATE \"{t}\" SET owner = NULL, holds = 0, expires_at = NULL, attempts = NULL, \
                 holder = NULL WHERE name = $1 AND {leased}"
            )),
            // The plain lock's fast path, one statement in a transaction of its own: `$1` is
            // the key, `$2` the owner, `$3` the lease (µs), `$4` the ledger, `$5` the holder
            // identity, `$6` the key's advisory id, `$7`/`$8` its readers' lock. It grants
            // only where the transaction of `run_acquire` would make a new hold with nothing
            // else to do, and otherwise changes nothing (the caller then runs that
            // transaction):
            // - the key's row exists, with no running row-mode lease (`took`), or it does not
            //   exist yet (`made`: a key without a row has no holds either);
            // - no other session holds the key's advisory lock exclusively, and no advisory
            //   reader holds its readers' lock (the same tries as the transaction's);
            // - the key has no row in the holds table but waiting writers' markers (not a
            //   live hold: any row at all, so that a hold renewed or re-entered meanwhile is
            //   never taken for one that ran out);
            // - the row is the version this statement's snapshot sees (`xmin`). A
            //   transaction that added a hold committed an update of this row (its `fence`)
            //   under the row's lock; if that happened after this statement's snapshot, the
            //   `UPDATE` re-checks the newer version of the row but would still read the
            //   holds table as of its snapshot, and miss the hold. The `xmin` of the newer
            //   version differs from the one the snapshot sees, so nothing is changed then.
            row_grant_free: s(format!(
                "WITH took AS (UPDATE \"{t}\" SET owner = $2, holds = 1, fence = fence + 1, \
                 expires_at = {lease}, attempts = $4, holder = $5 \
                 WHERE name = $1 AND xmin = (SELECT xmin FROM \"{t}\" WHERE name = $1) \
                 AND NOT COALESCE({leased}, FALSE) \
                 AND NOT EXISTS (SELECT 1 FROM \"{h}\" WHERE name = $1 AND kind <> 'q') \
                 AND pg_try_advisory_xact_lock_shared($6) AND pg_try_advisory_xact_lock($7, $8) \
                 RETURNING fence), \
                 made AS (INSERT INTO \"{t}\" (name, owner, holds, fence, expires_at, attempts, holder) \
                 SELECT $1, $2, 1, 1, {lease}, $4, $5 \
                 WHERE NOT EXISTS (SELECT 1 FROM \"{t}\" WHERE name = $1) \
                 AND pg_try_advisory_xact_lock_shared($6) AND pg_try_advisory_xact_lock($7, $8) \
                 ON CONFLICT (name) DO NOTHING RETURNING fence) \
                 SELECT fence FROM took UNION ALL SELECT fence FROM made",
                lease = from_now(3)
            )),
            // The release's fast path, one statement in a transaction of its own: `$1` the
            // key, `$2` the owner, `$3` the ledger of the one hold being let go; `$4`, `$5`
            // the announcement. Only a running row-mode lease of depth one whose ledger is
            // exactly this hold's (the release `release` would make with nothing else to
            // do); the announcement goes out when the statement commits. A row means done.
            // With `$6` (the owner never returns: `Grant::owner_returns` is false) its commit
            // does not wait for the WAL flush: `set_config(.., true)` is `SET LOCAL` for the
            // statement's own transaction, read when it commits, and evaluated only when it
            // let go (nothing else writes). A release lost in a server crash (or missing on
            // a standby promoted after it) then leaves the lease to run out, as a holder's
            // crash would, since nobody re-enters that hold; the fence is not touched. An
            // acquisition that commits after it flushes its WAL record too (the log is one
            // sequence), so a grant that survives a crash never rests on a release that did
            // not. The release of an owner that returns stays synchronous: lost, it would let
            // that owner re-enter the stale hold, and hold the key from others as long as it
            // kept coming back. Grants and renewals always are: lost, they could hand the
            // key out twice. Never run inside a transaction of more statements, whose
            // commit would stop waiting too.
            row_release_last: s(format!(
                "WITH released AS (UPDATE \"{t}\" SET owner = NULL, holds = 0, expires_at = NULL, \
                 attempts = NULL, holder = NULL \
                 WHERE name = $1 AND owner = $2 AND holds = 1 AND attempts = $3 AND {leased} \
                 RETURNING 1) SELECT pg_notify($4, $5), \
                 CASE WHEN $6 THEN set_config('synchronous_commit', 'off', true) END FROM released"
            )),
            notify_release: s("SELECT pg_notify($1, $2)".to_owned()),
            inspect: s(format!(
                "SELECT owner, holds, fence, holder, {left_us} AS left_us FROM \"{t}\" \
                 WHERE name = $1 AND owner IS NOT NULL \
                 AND ({leased} OR (expires_at = 'infinity' AND {}))",
                advisory_held(2)
            )),
            // Leases, holds and waiting writers' markers.
            live_under_prefix: s(format!(
                "SELECT (SELECT COUNT(*) FROM \"{t}\" WHERE position($1 in name) = 1 AND {leased}) \
                 + (SELECT COUNT(*) FROM \"{h}\" WHERE position($1 in name) = 1 \
                 AND expires_at > clock_timestamp())"
            )),
            // Not beside a live row-mode lease, nor where the key has any row-mode read,
            // write or permit hold row, live or not (only writers' markers, `q`, are let
            // be). Its statement begins after the advisory lock was granted, so it sees every
            // hold committed before, and row mode adds none while the lock is held: a
            // row-mode transaction decides with `pg_try_advisory_xact_lock_shared` of the key
            // (and its readers' lock), which it holds to its commit (an advisory request
            // queues behind it) or which fails (it sees the key held). But a renewal
            // (`HoldsSql::renew`) takes no key lock: while it is in flight this statement's
            // snapshot sees the hold's old, maybe expired, version, so "expired" cannot be
            // told from "about to be extended" here. A hold row that is there at all keeps
            // it out; `advisory_prune` deletes the expired ones (waiting for a renewal in
            // flight), then this runs again.
            advisory_take: s(format!(
                "UPDATE \"{t}\" SET fence = fence + 1, owner = $1, holds = 1, \
                 expires_at = 'infinity', attempts = NULL, holder = $3 \
                 WHERE name = $2 AND NOT COALESCE({leased}, FALSE) \
                 AND NOT EXISTS (SELECT 1 FROM \"{h}\" h WHERE h.name = $2 AND h.kind <> 'q') \
                 RETURNING fence, {name_hold}"
            )),
            // The key's read, write and permit holds whose lease is over. A locking delete:
            // a hold whose renewal is in flight is waited for, and its renewed version
            // checked again (then kept). Run by an advisory holder only, once the take found
            // hold rows (never on the uncontended path).
            advisory_prune: s(format!(
                "DELETE FROM \"{h}\" WHERE name = $1 AND kind <> 'q' \
                 AND expires_at <= clock_timestamp()"
            )),
            advisory_insert: s(format!(
                "INSERT INTO \"{t}\" (name, owner, holds, fence, expires_at, holder) \
                 VALUES ($2, $1, 1, 1, 'infinity', $3) ON CONFLICT (name) DO NOTHING \
                 RETURNING fence, {name_hold}"
            )),
            advisory_depth: s(format!(
                "UPDATE \"{t}\" SET holds = $1 \
                 WHERE name = $2 AND owner = $3 AND fence = $4 AND expires_at = 'infinity'"
            )),
            advisory_clear: s(format!(
                "WITH cleared AS (UPDATE \"{t}\" SET owner = NULL, holds = 0, expires_at = NULL, \
                 attempts = NULL, holder = NULL WHERE name = $1 AND owner = $2 AND fence = $5 \
                 AND expires_at = 'infinity' RETURNING 1) SELECT pg_notify($3, $4) FROM cleared"
            )),
            advisory_locked: s(format!("SELECT {}", advisory_held(1))),
            // The function runs only on the rows the inner WHERE keeps.
            advisory_take_away: s(
                "SELECT count(*) FILTER (WHERE ended) FROM (SELECT pg_terminate_backend(pid) AS ended \
                 FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND classid = (($1 >> 32) & 4294967295)::oid \
                 AND objid = ($1 & 4294967295)::oid AND objsubid = 1) AS holders"
                    .to_owned(),
            ),
        }
    }
}

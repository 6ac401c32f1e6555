//! `MysqlBackend`: connection pools, schema, error mapping, and the `LockBackend` impl that
//! dispatches to the mode.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use lockkit_core::{
    AcquireRequest, BackendInfo, Capabilities, Consistency, Error, Grant, HolderInfo, LockBackend,
    LockKey, OwnerId, Released, Result,
};
use sqlx::{
    AssertSqlSafe, MySqlPool,
    mysql::{MySqlPoolOptions, MySqlRow},
};
use tokio::sync::OnceCell;

use crate::{
    Mode, MysqlConfig,
    for_update::Held,
    schema::{Sql, ddl},
};

pub(crate) const BACKEND: &str = "mysql";

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
        // Lock wait timeout, deadlock, server shutting down, connection killed, lost.
        sqlx::Error::Database(_) => {
            matches!(code.as_deref(), Some("HY000" | "40001" | "08S01" | "70100"))
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

pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

pub(crate) struct Inner {
    pub(crate) config: MysqlConfig,
    pub(crate) pool: MySqlPool,
    /// Dedicated connections for for-update holds and waiters.
    pub(crate) holds_pool: MySqlPool,
    pub(crate) sql: Sql,
    schema: OnceCell<()>,
    /// For-update holds of this client, by owner and key (reentrancy is local there).
    pub(crate) held: Mutex<HashMap<(OwnerId, LockKey), Arc<Held>>>,
}

/// Locks in a MySQL or MariaDB database; see the crate docs for the two modes.
#[derive(Clone)]
pub struct MysqlBackend {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for MysqlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlBackend")
            .field("mode", &self.inner.config.mode)
            .field("table", &self.inner.config.table)
            .finish()
    }
}

impl MysqlBackend {
    /// Connects as a `mysql://user:pw@host:port/db?mode=row|for-update` URL says (see
    /// [`MysqlConfig::parse`]). The schema is created on first use unless
    /// `create_schema=false`.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL; [`Error::Backend`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::from_config(MysqlConfig::parse(url)?).await
    }

    /// Connects as `config` says.
    ///
    /// # Errors
    /// As [`MysqlBackend::connect`].
    pub async fn from_config(config: MysqlConfig) -> Result<Self> {
        let pool = MySqlPoolOptions::new()
            .max_connections(config.pool_size)
            .acquire_timeout(config.connect_timeout)
            .after_connect(|conn, _| Box::pin(read_committed(conn)))
            .connect_with(config.connect.clone())
            .await
            .map_err(|e| db_error("connecting to MySQL", e))?;
        let holds_pool = MySqlPoolOptions::new()
            .max_connections(config.max_holds)
            .min_connections(0)
            .acquire_timeout(Duration::from_millis(250))
            // A hold sets its connection's wait_timeout to its lease: put the server's
            // default back when the connection returns (or drop it), and test a pooled
            // connection before use, so an idle spell or a server restart never fails the
            // next acquisition.
            .test_before_acquire(true)
            .after_release(|conn, _| {
                Box::pin(async move {
                    Ok(
                        sqlx::raw_sql("SET SESSION wait_timeout = @@GLOBAL.wait_timeout")
                            .execute(&mut *conn)
                            .await
                            .is_ok(),
                    )
                })
            })
            .after_connect(|conn, _| Box::pin(read_committed(conn)))
            .connect_lazy_with(config.connect.clone());
        let backend = MysqlBackend {
            inner: Arc::new(Inner {
                sql: Sql::new(&config.table),
                config,
                pool,
                holds_pool,
                schema: OnceCell::new(),
                held: Mutex::new(HashMap::new()),
            }),
        };
        backend.ensure_schema().await?;
        Ok(backend)
    }

    /// The configuration in force.
    pub fn config(&self) -> &MysqlConfig {
        &self.inner.config
    }

    /// Closes every connection of this client. Holds still open end with their connections.
    pub async fn close(&self) {
        self.inner.holds_pool.close().await;
        self.inner.pool.close().await;
    }

    /// Dedicated for-update connections open now (held or waiting locks, and idle ones).
    pub fn dedicated_connections(&self) -> u32 {
        self.inner.holds_pool.size()
    }

    /// The server connection id holding `key` for-update in this client, if any (for
    /// operators and fault tests: `KILL <id>` ends that hold).
    pub fn connection_holding(&self, key: &LockKey) -> Option<u64> {
        let held = self.inner.held.lock().unwrap_or_else(|e| e.into_inner());
        held.iter()
            .find(|((_, k), _)| k == key)
            .map(|(_, h)| h.connection_id)
    }

    /// Operator action (row mode): clears `key`'s lease as if it had expired; its holder
    /// finds out at its next renewal. Returns whether there was a live lease.
    ///
    /// # Errors
    /// Database errors.
    pub async fn clear_lease(&self, key: &LockKey) -> Result<bool> {
        let done = query(&self.inner.sql.row_clear_live)
            .bind(key.as_str().as_bytes())
            .execute(&self.inner.pool)
            .await
            .map_err(|e| db_error("clearing a lease", e))?;
        Ok(done.rows_affected() == 1)
    }

    /// Operator action: `KILL <id>` a server connection (e.g. one from
    /// [`MysqlBackend::connection_holding`]).
    ///
    /// # Errors
    /// Database errors (e.g. no such connection, or no privilege).
    pub async fn kill_connection(&self, id: u64) -> Result<()> {
        sqlx::raw_sql(AssertSqlSafe(format!("KILL {id}")))
            .execute(&self.inner.pool)
            .await
            .map_err(|e| db_error(&format!("KILL {id}"), e))?;
        Ok(())
    }

    /// Creates the tables if allowed; otherwise checks they exist.
    pub(crate) async fn ensure_schema(&self) -> Result<()> {
        let inner = &self.inner;
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
                self.ensure_attempts_column().await
            })
            .await
            .map(|_| ())
    }

    /// Tables made before the `attempts` column existed get it (or, with
    /// create_schema=false, an error with the statement to run).
    async fn ensure_attempts_column(&self) -> Result<()> {
        let inner = &self.inner;
        let table = &inner.config.table;
        let (present,): (i64,) =
            sqlx::query_as(AssertSqlSafe(inner.sql.attempts_column_exists.clone()))
                .bind(table)
                .fetch_one(&inner.pool)
                .await
                .map_err(|e| db_error(&format!("checking the columns of `{table}`"), e))?;
        if present > 0 {
            return Ok(());
        }
        if !inner.config.create_schema {
            return Err(Error::Config(format!(
                "table `{table}` lacks the `attempts` column and create_schema=false; add it with:\n{};",
                inner.sql.add_attempts_column
            )));
        }
        match query(&inner.sql.add_attempts_column)
            .execute(&inner.pool)
            .await
        {
            // 1060: another client added it first.
            Ok(_) => Ok(()),
            Err(e) if error_number(&e) == Some(1060) => Ok(()),
            Err(e) => Err(db_error(
                &format!("adding the attempts column to `{table}`"),
                e,
            )),
        }
    }

    /// Keys under `prefix` that are held now: live leases (row) or locked rows
    /// (for-update), seen from a fresh connection. For leak checks.
    ///
    /// # Errors
    /// Database errors.
    pub async fn held_under(&self, prefix: &str) -> Result<u64> {
        match self.inner.config.mode {
            Mode::Row => {
                let (n,): (i64,) =
                    sqlx::query_as(AssertSqlSafe(self.inner.sql.live_under_prefix.clone()))
                        .bind(prefix.as_bytes())
                        .fetch_one(&self.inner.pool)
                        .await
                        .map_err(|e| db_error("counting live leases", e))?;
                Ok(u64::try_from(n).unwrap_or(0))
            }
            Mode::ForUpdate => crate::for_update::locked_under(self, prefix).await,
        }
    }
}

/// Lock transactions lock only the rows they name: no gap locks between neighbouring
/// keys, so unrelated keys never deadlock each other.
async fn read_committed(conn: &mut sqlx::MySqlConnection) -> std::result::Result<(), sqlx::Error> {
    sqlx::raw_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(conn)
        .await
        .map(|_| ())
}

pub(crate) fn row_text(row: &MySqlRow, column: &str) -> Option<String> {
    use sqlx::Row;
    row.try_get::<Option<String>, _>(column).ok().flatten()
}

#[async_trait]
impl LockBackend for MysqlBackend {
    fn info(&self) -> BackendInfo {
        let capabilities = match self.inner.config.mode {
            Mode::Row => Capabilities {
                notified_wait: false,
                min_ttl: Duration::from_millis(1),
                ..Capabilities::default()
            },
            Mode::ForUpdate => Capabilities {
                pushes_loss: true,
                // Waiters queue in the server's lock manager.
                queued_wait: true,
                min_ttl: Duration::from_secs(1),
                max_ttl: Some(Duration::from_secs(365 * 24 * 3600)),
                ..Capabilities::default()
            },
        };
        BackendInfo::new(BACKEND, Consistency::Cp, capabilities)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        match self.inner.config.mode {
            Mode::Row => crate::row::try_acquire(self, req).await,
            Mode::ForUpdate => crate::for_update::acquire(self, req, Duration::ZERO).await,
        }
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        let started = tokio::time::Instant::now();
        let outcome = match self.inner.config.mode {
            Mode::Row => crate::row::acquire(self, req, wait).await.map(Some),
            Mode::ForUpdate => crate::for_update::acquire(self, req, wait).await,
        };
        match outcome? {
            Some(grant) => Ok(grant),
            None => Err(Error::Timeout {
                key: req.key.clone(),
                waited: started.elapsed(),
            }),
        }
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        match self.inner.config.mode {
            Mode::Row => crate::row::renew(self, grant, ttl).await,
            Mode::ForUpdate => crate::for_update::renew(self, grant, ttl).await,
        }
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        match self.inner.config.mode {
            Mode::Row => crate::row::release(self, grant).await,
            Mode::ForUpdate => crate::for_update::release(self, grant).await,
        }
    }

    async fn ping(&self) -> Result<()> {
        let _: (i32,) = sqlx::query_as("SELECT 1")
            .fetch_one(&self.inner.pool)
            .await
            .map_err(|e| db_error("SELECT 1", e))?;
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        match self.inner.config.mode {
            Mode::Row => crate::row::inspect(self, key).await,
            Mode::ForUpdate => crate::for_update::inspect(self, key).await,
        }
    }
}

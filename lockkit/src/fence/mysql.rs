//! The SQL fence for MySQL and MariaDB: one transaction locks the resource's fence row,
//! checks and raises its token, runs the caller's write, and commits.

use std::future::Future;

use lockkit_mysql::MysqlConfig;
use sqlx::{AssertSqlSafe, MySqlConnection, MySqlPool, mysql::MySqlPoolOptions};

use super::{FencedWork, admitted, check_sql_resource, sql_commit_failed, sql_work_failed};
use crate::{Error, FencingToken, Result};

const BACKEND: &str = "mysql";

/// The default fence table.
pub const TABLE: &str = "lockkit_fences";

/// The fence table's DDL, to run once (or let [`MysqlFence::create_table`] run it): one row
/// per resource with the newest token that wrote to it.
pub fn ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{table}` (\n  \
         resource VARBINARY(512) NOT NULL PRIMARY KEY,\n  \
         token BIGINT UNSIGNED NOT NULL\n) ENGINE=InnoDB"
    )
}

fn db_error(doing: &str, e: sqlx::Error) -> Error {
    let retryable = matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
    );
    Error::backend_with_source(BACKEND, retryable, format!("{doing} failed: {e}"), e)
}

/// InnoDB's answer to two transactions that wait for each other: one is rolled back and
/// may simply try again.
const DEADLOCK: u16 = 1213;

/// MySQL's "table doesn't exist".
const NO_SUCH_TABLE: u16 = 1146;

/// Runs `statement` again (up to five times, briefly spaced) while InnoDB picks it as a
/// deadlock's victim.
async fn retry_deadlocks<T, F, Fut>(mut statement: F) -> std::result::Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let mut tries = 0;
    loop {
        match statement().await {
            Err(sqlx::Error::Database(e))
                if tries < 5
                    && e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                        .is_some_and(|m| m.number() == DEADLOCK) =>
            {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(2 * tries)).await;
            }
            outcome => return outcome,
        }
    }
}

/// A fence in MySQL or MariaDB: per resource, a row of [`ddl`] with the newest token that
/// wrote. [`MysqlFence::write`] runs the caller's statements in the transaction that
/// holds that row, so the check, the raise and the write commit together or not at all,
/// and writers of one resource are serialised by the row lock.
#[derive(Debug, Clone)]
pub struct MysqlFence {
    pool: MySqlPool,
    table: String,
}

impl MysqlFence {
    /// A fence over `pool`, in the table `lockkit_fences` ([`super::MYSQL_TABLE`]).
    pub fn new(pool: MySqlPool) -> Self {
        MysqlFence {
            pool,
            table: TABLE.to_owned(),
        }
    }

    /// The same fence in another table.
    ///
    /// # Errors
    /// [`Error::Config`] unless `table` is 1 to 64 letters, digits or underscores.
    pub fn with_table(mut self, table: &str) -> Result<Self> {
        let ok = !table.is_empty()
            && table.len() <= 64
            && table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(Error::Config(format!(
                "fence table `{table}` must be 1 to 64 letters, digits or underscores"
            )));
        }
        self.table = table.to_owned();
        Ok(self)
    }

    /// Connects to the database of a `mysql://` lock URL and creates the fence table if
    /// it is missing; with the URL's `?create_schema=false` it only checks that the table
    /// exists.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL, or (with `create_schema=false`) a missing table,
    /// naming the DDL to run; [`Error::Backend`] when the server cannot be reached or
    /// refuses the table.
    pub async fn connect(url: &str) -> Result<Self> {
        let config = MysqlConfig::parse(url)?;
        let pool = MySqlPoolOptions::new()
            .max_connections(config.pool_size)
            .acquire_timeout(config.connect_timeout)
            .connect_with(config.connect.clone())
            .await
            .map_err(|e| db_error("connecting the fence", e))?;
        let fence = Self::new(pool);
        if config.create_schema {
            fence.create_table().await?;
        } else {
            fence.check_table().await?;
        }
        Ok(fence)
    }

    /// Checks that this fence's table exists with its two columns, without creating it.
    ///
    /// # Errors
    /// [`Error::Config`] naming the DDL to run when it is missing; database errors (a
    /// table with other columns, or no `SELECT` privilege on it).
    pub async fn check_table(&self) -> Result<()> {
        let table = &self.table;
        match sqlx::query(AssertSqlSafe(format!(
            "SELECT resource, token FROM `{table}` LIMIT 0"
        )))
        .fetch_optional(&self.pool)
        .await
        {
            Ok(_) => Ok(()),
            Err(sqlx::Error::Database(e))
                if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                    .is_some_and(|m| m.number() == NO_SUCH_TABLE) =>
            {
                Err(Error::Config(format!(
                    "fence table `{table}` does not exist and create_schema=false; create it \
                     with:\n{}",
                    ddl(table)
                )))
            }
            Err(e) => Err(db_error("checking the fence table", e)),
        }
    }

    /// Runs [`ddl`] for this fence's table.
    ///
    /// # Errors
    /// Database errors.
    pub async fn create_table(&self) -> Result<()> {
        sqlx::raw_sql(AssertSqlSafe(ddl(&self.table)))
            .execute(&self.pool)
            .await
            .map_err(|e| db_error("creating the fence table", e))?;
        Ok(())
    }

    /// Accepts `token` for `resource` if it is not older than the newest that wrote,
    /// raising the bar to it, without writing anything else (`lockkit fence`).
    ///
    /// # Errors
    /// [`Error::Fenced`] for an older token; [`Error::Backend`] for database errors.
    pub async fn admit(&self, token: impl Into<FencingToken>, resource: &str) -> Result<()> {
        self.write(token, resource, |_| Box::pin(async { Ok(()) }))
            .await
    }

    /// Runs `work` on the fence's transaction if `token` is not older than the newest
    /// token that wrote to `resource`, and commits it with the raised fence. `work`'s
    /// error rolls everything back and comes back as [`Error::Backend`] with it as the
    /// source.
    ///
    /// `work` must use the connection it is given (statements on another connection are
    /// not fenced) and must not commit on its own (DDL, `COMMIT`, `LOCK TABLES` end the
    /// transaction and the fence with it). One server: on multi-primary clusters (Galera,
    /// Group Replication) the row lock does not span nodes.
    ///
    /// ```no_run
    /// # async fn f(fence: lockkit::fence::MysqlFence, guard: lockkit::LockGuard) -> lockkit::Result<()> {
    /// fence
    ///     .write(&guard, "orders/42", |tx| {
    ///         Box::pin(async move {
    ///             sqlx::query("UPDATE orders SET state = 'paid' WHERE id = 42")
    ///                 .execute(&mut *tx)
    ///                 .await?;
    ///             Ok(())
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Fenced`] (nothing written) for an older token; [`Error::Backend`] for
    /// database errors and `work`'s own.
    pub async fn write<T, F>(
        &self,
        token: impl Into<FencingToken>,
        resource: &str,
        work: F,
    ) -> Result<T>
    where
        F: for<'c> FnOnce(&'c mut MySqlConnection) -> FencedWork<'c, T>,
    {
        let token = token.into();
        let table = &self.table;
        let name = resource.as_bytes();
        check_sql_resource(resource)?;
        // The row exists from the first write on: create it (token 0) in a statement of its
        // own, so the transaction below only ever locks an existing row (a record lock; a
        // missing row would take gap locks, and concurrent first writers deadlock on them).
        retry_deadlocks(|| async {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT IGNORE INTO `{table}` (resource, token) VALUES (?, 0)"
            )))
            .bind(name)
            .execute(&self.pool)
            .await
        })
        .await
        .map_err(|e| db_error("creating the fence row", e))?;
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(|e| db_error("starting the fenced write", e))?;
        let (newest,): (u64,) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT token FROM `{table}` WHERE resource = ? FOR UPDATE"
        )))
        .bind(name)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| db_error("locking the fence row", e))?;
        let newest = FencingToken::new(newest);
        if let Err(refused) = admitted(resource, token, Some(newest)) {
            let _ = tx.rollback().await;
            return Err(refused);
        }
        if token > newest {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE `{table}` SET token = ? WHERE resource = ?"
            )))
            .bind(token.get())
            .bind(name)
            .execute(&mut *tx)
            .await
            .map_err(|e| db_error("raising the fence", e))?;
        }
        let out = match work(&mut tx).await {
            Ok(out) => out,
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(sql_work_failed(BACKEND, resource, e));
            }
        };
        tx.commit()
            .await
            .map_err(|e| sql_commit_failed(BACKEND, resource, e))?;
        Ok(out)
    }
}

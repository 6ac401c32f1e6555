//! The SQL fence for PostgreSQL: one transaction locks the resource's fence row, checks
//! and raises its token, runs the caller's write, and commits.

use lockkit_postgres::PostgresConfig;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, postgres::PgPoolOptions};

use super::{
    FencedWork, MAX_SQL_RESOURCE, admitted, check_sql_resource, sql_commit_failed, sql_work_failed,
};
use crate::{Error, FencingToken, Result};

const BACKEND: &str = "postgres";

/// The default fence table.
pub const TABLE: &str = "lockkit_fences";

/// `undefined_table`.
const UNDEFINED_TABLE: &str = "42P01";

/// `serialization_failure`.
const SERIALIZATION_FAILURE: &str = "40001";

/// `deadlock_detected`.
const DEADLOCK_DETECTED: &str = "40P01";

/// How many times a fenced write starts its transaction (or the creation of the fence row)
/// again when it fails with one of the two errors above (each follows another writer's
/// commit).
const LOCK_RETRIES: u32 = 100;

/// The fence table's DDL, to run once (or let [`PostgresFence::create_table`] run it):
/// one row per resource with the newest token that wrote to it.
pub fn ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\n  \
         resource BYTEA NOT NULL PRIMARY KEY CHECK (octet_length(resource) <= {MAX_SQL_RESOURCE}),\n  \
         token BIGINT NOT NULL CHECK (token >= 0)\n)"
    )
}

fn db_error(doing: &str, e: sqlx::Error) -> Error {
    let retryable = matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
    );
    Error::backend_with_source(BACKEND, retryable, format!("{doing} failed: {e}"), e)
}

fn sql_state(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.to_string()),
        _ => None,
    }
}

/// A serialization failure or a deadlock: the transaction (or statement) may be run again.
fn must_start_again(e: &sqlx::Error) -> bool {
    matches!(
        sql_state(e).as_deref(),
        Some(SERIALIZATION_FAILURE | DEADLOCK_DETECTED)
    )
}

/// A fence in PostgreSQL: per resource, a row of [`ddl`] with the newest token that wrote.
/// [`PostgresFence::write`] runs the caller's statements in the transaction that holds
/// that row, so the check, the raise and the write commit together or not at all, and
/// writers of one resource are serialised by the row lock.
#[derive(Debug, Clone)]
pub struct PostgresFence {
    pool: PgPool,
    table: String,
}

impl PostgresFence {
    /// A fence over `pool`, in the table `lockkit_fences` ([`super::POSTGRES_TABLE`]).
    pub fn new(pool: PgPool) -> Self {
        PostgresFence {
            pool,
            table: TABLE.to_owned(),
        }
    }

    /// The same fence in another table (in the connection's `search_path`).
    ///
    /// # Errors
    /// [`Error::Config`] unless `table` is 1 to 63 lower-case letters, digits or
    /// underscores, not starting with a digit.
    pub fn with_table(mut self, table: &str) -> Result<Self> {
        let ok = !table.is_empty()
            && table.len() <= 63
            && table
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && !table.starts_with(|c: char| c.is_ascii_digit());
        if !ok {
            return Err(Error::Config(format!(
                "fence table `{table}` must be 1 to 63 lower-case letters, digits or \
                 underscores, not starting with a digit"
            )));
        }
        self.table = table.to_owned();
        Ok(self)
    }

    /// Connects to the database of a `postgres://` lock URL and creates the fence table
    /// if it is missing; with the URL's `?create_schema=false` it only checks that the
    /// table exists.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL, or (with `create_schema=false`) a missing table,
    /// naming the DDL to run; [`Error::Backend`] when the server cannot be reached or
    /// refuses the table.
    pub async fn connect(url: &str) -> Result<Self> {
        let config = PostgresConfig::parse(url)?;
        let pool = PgPoolOptions::new()
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

    /// Runs [`ddl`] for this fence's table.
    ///
    /// # Errors
    /// Database errors.
    pub async fn create_table(&self) -> Result<()> {
        match sqlx::raw_sql(AssertSqlSafe(ddl(&self.table)))
            .execute(&self.pool)
            .await
        {
            Ok(_) => Ok(()),
            // Two clients creating it at once collide on the catalog (a `pg_type` unique
            // violation, or `duplicate_table` when the other's commit lands between the
            // `IF NOT EXISTS` check and the creation): it exists.
            Err(e) if matches!(sql_state(&e).as_deref(), Some("23505" | "42P07" | "42710")) => {
                Ok(())
            }
            Err(e) => Err(db_error("creating the fence table", e)),
        }
    }

    /// Checks that this fence's table exists with its two columns, without creating it.
    ///
    /// # Errors
    /// [`Error::Config`] naming the DDL to run when it is missing; database errors (a
    /// table with other columns, or no `SELECT` privilege on it).
    pub async fn check_table(&self) -> Result<()> {
        let table = &self.table;
        match sqlx::query(AssertSqlSafe(format!(
            "SELECT resource, token FROM {table} LIMIT 0"
        )))
        .execute(&self.pool)
        .await
        {
            Ok(_) => Ok(()),
            Err(e) if sql_state(&e).as_deref() == Some(UNDEFINED_TABLE) => {
                Err(Error::Config(format!(
                    "fence table `{table}` does not exist and create_schema=false; create it \
                     with:\n{}",
                    ddl(table)
                )))
            }
            Err(e) => Err(db_error("checking the fence table", e)),
        }
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
    /// not fenced) and must not end the transaction (`COMMIT`, `ROLLBACK`). Tokens are
    /// stored as `BIGINT`: one above `i64::MAX` is refused. The transaction has the
    /// connection's isolation level; under REPEATABLE READ or SERIALIZABLE, a serialization
    /// failure while taking the fence row (another writer committed meanwhile) starts the
    /// transaction again before `work` runs; one in `work` or at commit is returned.
    ///
    /// ```no_run
    /// # async fn f(fence: lockkit::fence::PostgresFence, guard: lockkit::LockGuard) -> lockkit::Result<()> {
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
    /// [`Error::Fenced`] (nothing written) for an older token; [`Error::Config`] for a
    /// resource name of 0 or more than 512 bytes or a token above `i64::MAX`;
    /// [`Error::Backend`] for database errors and `work`'s own.
    pub async fn write<T, F>(
        &self,
        token: impl Into<FencingToken>,
        resource: &str,
        work: F,
    ) -> Result<T>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> FencedWork<'c, T>,
    {
        let token = token.into();
        let table = &self.table;
        let name = resource.as_bytes();
        check_sql_resource(resource)?;
        let Ok(stored) = i64::try_from(token.get()) else {
            return Err(Error::Config(format!(
                "token {token} does not fit the fence's BIGINT column"
            )));
        };
        // The row exists from the first write on: create it (token 0) in a statement of its
        // own, so the transaction below only ever waits on an existing row's lock.
        // A statement of its own: under REPEATABLE READ it fails like the lock below when the
        // row was raised after its snapshot, and is simply run again.
        let mut retries = 0;
        loop {
            match sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {table} (resource, token) VALUES ($1, 0) \
                 ON CONFLICT (resource) DO NOTHING"
            )))
            .bind(name)
            .execute(&self.pool)
            .await
            {
                Ok(_) => break,
                Err(e) if retries < LOCK_RETRIES && must_start_again(&e) => retries += 1,
                Err(e) => return Err(db_error("creating the fence row", e)),
            }
        }
        // Under REPEATABLE READ or SERIALIZABLE (a database's or role's
        // `default_transaction_isolation`), a writer that waited for the row while another
        // raised it fails with a serialization error when the other commits: nothing ran
        // yet, so start again with a fresh snapshot (each retry follows another writer's
        // commit, so they make progress).
        let mut retries = 0;
        let (mut tx, newest) = loop {
            let mut tx = self
                .pool
                .begin()
                .await
                .map_err(|e| db_error("starting the fenced write", e))?;
            match sqlx::query_as::<_, (i64,)>(AssertSqlSafe(format!(
                "SELECT token FROM {table} WHERE resource = $1 FOR UPDATE"
            )))
            .bind(name)
            .fetch_one(&mut *tx)
            .await
            {
                Ok((newest,)) => break (tx, newest),
                Err(e) if retries < LOCK_RETRIES && must_start_again(&e) => {
                    let _ = tx.rollback().await;
                    retries += 1;
                }
                Err(e) => return Err(db_error("locking the fence row", e)),
            }
        };
        let newest = FencingToken::new(u64::try_from(newest).unwrap_or(0));
        if let Err(refused) = admitted(resource, token, Some(newest)) {
            let _ = tx.rollback().await;
            return Err(refused);
        }
        if token > newest {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {table} SET token = $1 WHERE resource = $2"
            )))
            .bind(stored)
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

//! The storage a lab holder protects, behind the guard users get ([`lockkit::fence`]): a
//! write whose fencing token is older than one the store has accepted is refused.
//!
//! Which store a scenario writes to follows its backend, as a user's would: a Redis the lab
//! never breaks (`redis-store`, through [`RedisFence`]) for the Redis backends, the database
//! itself (through [`MysqlFence`] or [`PostgresFence`], in the transaction that holds the
//! fence row) for the MySQL and PostgreSQL ones, and a file (through [`FileFence`]) for the
//! file and ZooKeeper backends.

use std::{
    fmt,
    fs::OpenOptions,
    io::Write,
    path::{Path, PathBuf},
};

use lockkit::fence::{FileFence, MysqlFence, PostgresFence, RedisFence};
use lockkit_core::{FencingToken, FileBackend};
use sqlx::{AssertSqlSafe, MySqlPool, PgPool};

use crate::{Context, LabError};

/// A write refused because a newer holder wrote first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaleWrite {
    /// The token offered.
    pub offered: FencingToken,
    /// The newest token the store has accepted.
    pub highest: FencingToken,
}

impl fmt::Display for StaleWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "token {} is older than token {} that already wrote",
            self.offered, self.highest
        )
    }
}

/// Which guard a store writes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// A file, through [`FileFence`].
    File,
    /// A Redis list, through [`RedisFence`].
    Redis,
    /// A MariaDB table, through [`MysqlFence`].
    Mysql,
    /// A PostgreSQL table, through [`PostgresFence`].
    Postgres,
}

impl StoreKind {
    /// The guard's name, as the docs/cap.md table shows it.
    pub fn guard(self) -> &'static str {
        match self {
            StoreKind::File => "FileFence",
            StoreKind::Redis => "RedisFence",
            StoreKind::Mysql => "MysqlFence",
            StoreKind::Postgres => "PostgresFence",
        }
    }
}

/// The table of accepted values in the MySQL store.
const WRITES_TABLE: &str = "lockkit_lab_writes";

#[derive(Clone)]
enum Guarded {
    File(PathBuf),
    Redis {
        fence: RedisFence,
        /// The lab's own connection, to read and remove what the fence guards.
        conn: redis::aio::MultiplexedConnection,
    },
    Mysql {
        fence: MysqlFence,
        pool: MySqlPool,
    },
    Postgres {
        fence: PostgresFence,
        pool: PgPool,
    },
}

/// A fenced store of accepted values (`token value`, in order) for one resource, shared by
/// the lab's processes: the parent opens it, the child holder opens the same one from its
/// [`FencedStore::location`] and [`FencedStore::resource`].
#[derive(Clone)]
pub struct FencedStore {
    location: String,
    resource: String,
    guarded: Guarded,
}

impl fmt::Debug for FencedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedStore")
            .field("kind", &self.kind())
            .field("resource", &self.resource)
            .finish_non_exhaustive()
    }
}

impl FencedStore {
    /// Opens the store at `location` for `resource`: `file:///abs/path` (a file, fenced by
    /// `<path>.fence`), `redis://…` (one server) or `mysql://…` (a plain database URL; the
    /// fence table and the lab's table of values are created if missing).
    ///
    /// # Errors
    /// An unknown scheme, or a server that cannot be reached.
    pub async fn open(location: &str, resource: &str) -> Result<FencedStore, LabError> {
        let guarded = if location.starts_with("file://") {
            Guarded::File(FileBackend::dir_of_url(location).context("the file store's URL")?)
        } else if location.starts_with("redis://") {
            let conn = redis::Client::open(location)
                .context("the Redis store's URL")?
                .get_multiplexed_async_connection()
                .await
                .context("connecting the Redis store")?;
            Guarded::Redis {
                fence: RedisFence::connect(location)
                    .await
                    .context("connecting the Redis store")?,
                conn,
            }
        } else if location.starts_with("mysql://") {
            let pool = MySqlPool::connect(location)
                .await
                .context("connecting the MySQL store")?;
            let fence = MysqlFence::new(pool.clone());
            fence
                .create_table()
                .await
                .context("creating the fence table")?;
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE TABLE IF NOT EXISTS `{WRITES_TABLE}` (\n  \
                 id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,\n  \
                 resource VARBINARY(512) NOT NULL,\n  \
                 token BIGINT UNSIGNED NOT NULL,\n  \
                 value VARCHAR(255) NOT NULL,\n  \
                 KEY (resource)\n) ENGINE=InnoDB"
            )))
            .execute(&pool)
            .await
            .context("creating the lab's table of values")?;
            Guarded::Mysql { fence, pool }
        } else if location.starts_with("postgres://") {
            let pool = PgPool::connect(location)
                .await
                .context("connecting the PostgreSQL store")?;
            let fence = PostgresFence::new(pool.clone());
            fence
                .create_table()
                .await
                .context("creating the fence table")?;
            let created = sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE TABLE IF NOT EXISTS {WRITES_TABLE} (\n  \
                 id BIGSERIAL PRIMARY KEY,\n  \
                 resource BYTEA NOT NULL,\n  \
                 token BIGINT NOT NULL,\n  \
                 value TEXT NOT NULL\n)"
            )))
            .execute(&pool)
            .await;
            match created {
                // The parent and the child holder may create it at once.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("23505") => {}
                other => {
                    other.context("creating the lab's table of values")?;
                }
            }
            Guarded::Postgres { fence, pool }
        } else {
            return Err(LabError::new(format!(
                "a lab store is file:///path, redis://, mysql:// or postgres://, not `{location}`"
            )));
        };
        Ok(FencedStore {
            location: location.to_owned(),
            resource: resource.to_owned(),
            guarded,
        })
    }

    /// Where it lives (what [`FencedStore::open`] takes).
    pub fn location(&self) -> &str {
        &self.location
    }

    /// The fenced resource.
    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// Which guard it writes through.
    pub fn kind(&self) -> StoreKind {
        match self.guarded {
            Guarded::File(_) => StoreKind::File,
            Guarded::Redis { .. } => StoreKind::Redis,
            Guarded::Mysql { .. } => StoreKind::Mysql,
            Guarded::Postgres { .. } => StoreKind::Postgres,
        }
    }

    /// Appends `value` if `token` is not older than any token accepted so far, in the
    /// guard's one atomic step (the file's flock, the Redis script, the MySQL transaction).
    ///
    /// # Errors
    /// `Ok(Err(StaleWrite))` when a newer holder wrote first; `Err` when the store failed.
    pub async fn write(
        &self,
        token: FencingToken,
        value: &str,
    ) -> Result<Result<(), StaleWrite>, LabError> {
        let written = match &self.guarded {
            Guarded::File(path) => {
                let (path, line) = (path.clone(), format!("{} {value}\n", token.get()));
                tokio::task::spawn_blocking(move || {
                    FileFence::new().run(token, &path, || append(&path, &line))
                })
                .await
                .context("the file store's writer")?
            }
            Guarded::Redis { fence, .. } => fence
                .eval(
                    token,
                    &self.resource,
                    "redis.call('RPUSH', KEYS[2], ARGV[1] .. ' ' .. ARGV[2]) return 1",
                    &[&self.values_key()],
                    &[value],
                )
                .await
                .map(|_| ()),
            Guarded::Mysql { fence, .. } => {
                let (resource, value) = (self.resource.clone(), value.to_owned());
                fence
                    .write(token, &self.resource, move |tx| {
                        Box::pin(async move {
                            sqlx::query(AssertSqlSafe(format!(
                                "INSERT INTO `{WRITES_TABLE}` (resource, token, value) \
                                 VALUES (?, ?, ?)"
                            )))
                            .bind(resource.as_bytes())
                            .bind(token.get())
                            .bind(value)
                            .execute(&mut *tx)
                            .await?;
                            Ok(())
                        })
                    })
                    .await
            }
            Guarded::Postgres { fence, .. } => {
                let (resource, value) = (self.resource.clone(), value.to_owned());
                let stored = i64::try_from(token.get()).unwrap_or(i64::MAX);
                fence
                    .write(token, &self.resource, move |tx| {
                        Box::pin(async move {
                            sqlx::query(AssertSqlSafe(format!(
                                "INSERT INTO {WRITES_TABLE} (resource, token, value) \
                                 VALUES ($1, $2, $3)"
                            )))
                            .bind(resource.as_bytes())
                            .bind(stored)
                            .bind(value)
                            .execute(&mut *tx)
                            .await?;
                            Ok(())
                        })
                    })
                    .await
            }
        };
        match written {
            Ok(()) => Ok(Ok(())),
            Err(lockkit::Error::Fenced { newer, .. }) => Ok(Err(StaleWrite {
                offered: token,
                highest: newer,
            })),
            Err(e) => Err(LabError::new(format!(
                "the {} store failed: {e}",
                self.kind().guard()
            ))),
        }
    }

    /// The accepted values, in order, as `token value`.
    ///
    /// # Errors
    /// When the store cannot be read (one never written to is empty).
    pub async fn values(&self) -> Result<Vec<String>, LabError> {
        match &self.guarded {
            Guarded::File(path) => match std::fs::read_to_string(path) {
                Ok(text) => Ok(text.lines().map(str::to_owned).collect()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
                Err(e) => Err(LabError::new(format!("reading {}: {e}", path.display()))),
            },
            Guarded::Redis { conn, .. } => redis::cmd("LRANGE")
                .arg(self.values_key())
                .arg(0)
                .arg(-1)
                .query_async(&mut conn.clone())
                .await
                .context("reading the values"),
            Guarded::Mysql { pool, .. } => {
                let rows: Vec<(u64, String)> = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT token, value FROM `{WRITES_TABLE}` WHERE resource = ? ORDER BY id"
                )))
                .bind(self.resource.as_bytes())
                .fetch_all(pool)
                .await
                .context("reading the values")?;
                Ok(rows.into_iter().map(|(t, v)| format!("{t} {v}")).collect())
            }
            Guarded::Postgres { pool, .. } => {
                let rows: Vec<(i64, String)> = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT token, value FROM {WRITES_TABLE} WHERE resource = $1 ORDER BY id"
                )))
                .bind(self.resource.as_bytes())
                .fetch_all(pool)
                .await
                .context("reading the values")?;
                Ok(rows.into_iter().map(|(t, v)| format!("{t} {v}")).collect())
            }
        }
    }

    /// Removes the values and the resource's fence (the end of a run), outside the fence:
    /// it relies on the resource being this run's alone and its writers being gone.
    ///
    /// # Errors
    /// When the store cannot be reached.
    pub async fn remove(&self) -> Result<(), LabError> {
        match &self.guarded {
            Guarded::File(path) => {
                let mut fence = path.as_os_str().to_owned();
                fence.push(".fence");
                for file in [path.as_path(), Path::new(&fence)] {
                    match std::fs::remove_file(file) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            return Err(LabError::new(format!("removing {}: {e}", file.display())));
                        }
                        _ => {}
                    }
                }
                Ok(())
            }
            Guarded::Redis { fence, conn } => redis::cmd("DEL")
                .arg(fence.fence_key(&self.resource))
                .arg(self.values_key())
                .query_async::<()>(&mut conn.clone())
                .await
                .context("removing the Redis store"),
            Guarded::Mysql { pool, .. } => {
                for table in [WRITES_TABLE, lockkit::fence::MYSQL_TABLE] {
                    sqlx::query(AssertSqlSafe(format!(
                        "DELETE FROM `{table}` WHERE resource = ?"
                    )))
                    .bind(self.resource.as_bytes())
                    .execute(pool)
                    .await
                    .context("removing the MySQL store")?;
                }
                Ok(())
            }
            Guarded::Postgres { pool, .. } => {
                for table in [WRITES_TABLE, lockkit::fence::POSTGRES_TABLE] {
                    sqlx::query(AssertSqlSafe(format!(
                        "DELETE FROM {table} WHERE resource = $1"
                    )))
                    .bind(self.resource.as_bytes())
                    .execute(pool)
                    .await
                    .context("removing the PostgreSQL store")?;
                }
                Ok(())
            }
        }
    }

    fn values_key(&self) -> String {
        format!("lockkit:lab:values:{}", self.resource)
    }
}

/// Appends `line` to `path` and syncs it.
fn append(path: &Path, line: &str) -> lockkit::Result<()> {
    let fail = |doing: &'static str| {
        move |e: std::io::Error| lockkit::Error::backend_with_source("lab", false, doing, e)
    };
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(fail("opening the store"))?;
    file.write_all(line.as_bytes())
        .map_err(fail("appending to the store"))?;
    file.sync_data().map_err(fail("syncing the store"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_file_store_refuses_older_tokens_and_keeps_accepted_values() {
        let dir = std::env::temp_dir().join(format!("lockkit-store-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let location = FileBackend::url_of(&dir.join("s"));
        let store = FencedStore::open(&location, "r").await.unwrap();
        assert_eq!(store.kind(), StoreKind::File);
        assert!(
            store
                .write(FencingToken::new(5), "a")
                .await
                .unwrap()
                .is_ok()
        );
        assert!(
            store
                .write(FencingToken::new(5), "b")
                .await
                .unwrap()
                .is_ok()
        );
        assert!(
            store
                .write(FencingToken::new(7), "c")
                .await
                .unwrap()
                .is_ok()
        );
        let stale = store
            .write(FencingToken::new(6), "d")
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(stale.highest, FencingToken::new(7));
        assert_eq!(store.values().await.unwrap(), vec!["5 a", "5 b", "7 c"]);
        store.remove().await.unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn an_unknown_store_is_refused() {
        let refused = FencedStore::open("s3://bucket/x", "r").await.unwrap_err();
        assert!(refused.0.contains("file:///path"), "{refused}");
    }
}

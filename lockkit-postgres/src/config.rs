//! PostgreSQL URLs: `postgres://user:pw@host:port/db?mode=row&table=...`.

use std::{str::FromStr, time::Duration};

use lockkit_core::{
    Error, Result,
    config::{LockUrl, parse_count, parse_duration},
};
use sqlx::postgres::PgConnectOptions;

/// How locks are kept in the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// A lease table: one row per key with owner, hold count, fence and expiry, changed by
    /// short transactions on the server's clock (`clock_timestamp()`). Survives client and
    /// server restarts; grants and renewals wait for their commit to reach the disk. The
    /// last release of a lock taken without an [`Owner`](lockkit_core::Owner) does not (one
    /// fsync less per lock): one acknowledged just before a server crash may come back
    /// after it, and the key then stays held until that lease runs out, as after a holder's
    /// crash. A release is announced with `NOTIFY`, so waiters wake at once.
    /// Read-write locks and counting semaphores live in `<table>_holds` beside it.
    Row,
    /// `pg_advisory_lock` held by a dedicated connection per hold; waiters queue in the
    /// server's lock manager. The lease is the session's `idle_session_timeout` (PostgreSQL
    /// 14 or later), kept up by a liveness check while the holder lives; a hold ends with
    /// its connection (a crash, a server restart). The fencing token is the key's row in
    /// the lease table, shared with `mode=row`, so the two modes exclude each other. Plain
    /// locks only: read-write locks and semaphores are `Unsupported` (use `Row`).
    Advisory,
}

/// Everything a PostgreSQL URL says. Its `Debug` output leaves the password out.
#[derive(Clone)]
#[non_exhaustive]
pub struct PostgresConfig {
    /// Where and as whom to connect.
    pub connect: PgConnectOptions,
    /// `?mode=`: `row` (the default) or `advisory`.
    pub mode: Mode,
    /// `?table=` (default `lockkit_locks`), in the connection's `search_path`.
    pub table: String,
    /// `?create_schema=false` refuses to create the table and reports the DDL to run.
    pub create_schema: bool,
    /// `?pool_size=` connections for short statements (default 8), plus one that listens
    /// for releases. Row mode keeps a quarter of them (none below 4) out of sqlx's pool
    /// between its one-statement calls, which spares the check sqlx makes of every
    /// connection given back.
    pub pool_size: u32,
    /// `?max_holds=` (advisory): dedicated connections for held and waiting locks
    /// (default 32); each hold and each waiter uses one.
    pub max_holds: u32,
    /// `?liveness=` (advisory, default 250 ms): how often a hold's connection is checked,
    /// so its loss is signalled within about this long.
    pub liveness: Duration,
    /// `?connect_timeout=` (default 5 s, above zero): how long opening a connection, and
    /// waiting for a pooled one, may take.
    pub connect_timeout: Duration,
    /// `?ttl=`: the default lease of locks taken through this URL (the facade applies it).
    pub ttl: Option<Duration>,
}

impl Default for PostgresConfig {
    /// `postgres://lockkit@127.0.0.1:5432/lockkit` in row mode, every option at its default.
    fn default() -> Self {
        PostgresConfig {
            connect: PgConnectOptions::new_without_pgpass()
                .host("127.0.0.1")
                .port(5432)
                .username("lockkit")
                .database("lockkit"),
            mode: Mode::Row,
            table: "lockkit_locks".into(),
            create_schema: true,
            pool_size: 8,
            max_holds: 32,
            liveness: Duration::from_millis(250),
            connect_timeout: Duration::from_secs(5),
            ttl: None,
        }
    }
}

impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("host", &self.connect.get_host())
            .field("port", &self.connect.get_port())
            .field("user", &self.connect.get_username())
            .field("database", &self.connect.get_database())
            .field("mode", &self.mode)
            .field("table", &self.table)
            .field("create_schema", &self.create_schema)
            .field("pool_size", &self.pool_size)
            .field("max_holds", &self.max_holds)
            .field("liveness", &self.liveness)
            .field("connect_timeout", &self.connect_timeout)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

const OPTIONS: &str =
    "mode, table, create_schema, pool_size, max_holds, liveness, connect_timeout, ttl";

/// The driver's own options, passed through.
const DRIVER_OPTIONS: &[&str] = &[
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "application_name",
    "options",
    "statement-cache-capacity",
];

/// Every URL scheme this crate accepts.
pub const SCHEMES: &[&str] = &["postgres", "postgresql"];

const FORM: &str = "postgres://user:password@host:port/database?mode=row|advisory";

impl PostgresConfig {
    /// Parses a lockkit PostgreSQL URL; the driver's own options (`sslmode`,
    /// `application_name`, ...) go to the driver.
    ///
    /// # Errors
    /// [`Error::Config`] saying what is wrong and what is accepted.
    pub fn parse(url: &str) -> Result<Self> {
        let parts = LockUrl::parse(url, SCHEMES, FORM)?;
        let shown = parts.shown.clone();
        if parts.path.as_deref().is_none_or(str::is_empty) {
            return Err(Error::Config(format!(
                "`{shown}` names no database; write {FORM}"
            )));
        }
        parts.require_hosts(FORM)?;
        let mut config = PostgresConfig {
            connect: PgConnectOptions::new_without_pgpass(),
            ..PostgresConfig::default()
        };
        let mut driver = Vec::new();
        for option in &parts.options {
            let (name, value) = (option.name.as_str(), option.value.as_str());
            match name {
                "mode" => {
                    config.mode = match value {
                        "row" => Mode::Row,
                        "advisory" => Mode::Advisory,
                        other => {
                            return Err(Error::Config(format!(
                                "`mode={other}` is unknown; use mode=row or mode=advisory"
                            )));
                        }
                    }
                }
                "table" => {
                    let ok = !value.is_empty()
                        && value.len() <= 48
                        && value
                            .chars()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                        && !value.starts_with(|c: char| c.is_ascii_digit());
                    if !ok {
                        return Err(Error::Config(format!(
                            "`table={value}` must be 1 to 48 lower-case letters, digits or \
                             underscores, not starting with a digit"
                        )));
                    }
                    config.table = value.to_owned();
                }
                "create_schema" => {
                    config.create_schema = match value {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        other => {
                            return Err(Error::Config(format!(
                                "`create_schema={other}` must be true or false"
                            )));
                        }
                    }
                }
                "pool_size" => config.pool_size = parse_count(name, value)?.max(1),
                "max_holds" => config.max_holds = parse_count(name, value)?.max(1),
                "liveness" => {
                    config.liveness = parse_duration(name, value)?;
                    if config.liveness.is_zero() {
                        return Err(Error::Config(
                            "`liveness=0` would check a hold's connection without pause; \
                             give a period such as 250ms"
                                .into(),
                        ));
                    }
                }
                "connect_timeout" => {
                    let timeout = parse_duration(name, value)?;
                    if timeout.is_zero() {
                        // sqlx would give every connection, and every wait for a pooled
                        // one, no time at all: nothing could ever connect.
                        return Err(Error::Config(format!(
                            "`connect_timeout={value}` in `{shown}` must be above zero; give \
                             a duration such as 5s"
                        )));
                    }
                    config.connect_timeout = timeout;
                }
                "ttl" => config.ttl = Some(parse_duration(name, value)?),
                _ if DRIVER_OPTIONS.contains(&name) => driver.push(option.raw.as_str()),
                _ => {
                    return Err(parts.unknown_option(
                        option,
                        &format!("{OPTIONS} (and the driver's {})", DRIVER_OPTIONS.join(", ")),
                    ));
                }
            }
        }
        let base = parts.base.as_str();
        let driver_url = if driver.is_empty() {
            format!("postgres://{base}")
        } else {
            format!("postgres://{base}?{}", driver.join("&"))
        };
        let connect = PgConnectOptions::from_str(&driver_url)
            .map_err(|e| Error::Config(format!("`{shown}` is not a valid PostgreSQL URL: {e}")))?;
        config.connect = connect;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_local_server_with_default_options() {
        let parsed = PostgresConfig::parse("postgres://lockkit@127.0.0.1:5432/lockkit").unwrap();
        assert_eq!(
            format!("{:?}", PostgresConfig::default()),
            format!("{parsed:?}")
        );
    }

    #[test]
    fn parses() {
        let c = PostgresConfig::parse(
            "postgresql://u:p@127.0.0.1:15432/db?mode=row&table=t1&pool_size=3&ttl=5s&application_name=x",
        )
        .unwrap();
        assert_eq!(
            (c.mode, c.table.as_str(), c.pool_size, c.ttl),
            (Mode::Row, "t1", 3, Some(Duration::from_secs(5)))
        );
        assert_eq!(c.connect.get_port(), 15432);
        let a = PostgresConfig::parse("postgres://u@h/db?mode=advisory&max_holds=4&liveness=100ms")
            .unwrap();
        assert_eq!(
            (a.mode, a.max_holds, a.liveness),
            (Mode::Advisory, 4, Duration::from_millis(100))
        );
        assert_eq!(c.connect.get_database(), Some("db"));
    }

    #[test]
    fn refuses() {
        for bad in [
            "",
            "mysql://u@h/db",
            "postgres://u@h",
            "postgres://u@h/",
            "postgres:///db",
            "postgres://u@h/db?mode=lease",
            "postgres://u@h/db?liveness=0s",
            "postgres://u@h/db?connect_timeout=0s",
            "postgres://u@h/db?mode=advisory&connect_timeout=0ms",
            "postgres://u@h/db?table=a-b",
            "postgres://u@h/db?table=Upper",
            "postgres://u@h/db?table=",
            "postgres://u@h/db?bogus=1",
            "postgres://u@h/db?ttl=5",
            "postgres://u@h:notaport/db",
        ] {
            assert!(
                matches!(PostgresConfig::parse(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn messages_hide_the_password() {
        for url in [
            "postgres://u:s3cret@h/db?bogus=1",
            "postgres://u:s3cret@h/db?connect_timeout=0s",
        ] {
            let Err(Error::Config(message)) = PostgresConfig::parse(url) else {
                panic!("{url} not refused");
            };
            assert!(!message.contains("s3cret"), "{message}");
        }
    }
}

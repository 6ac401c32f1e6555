//! MySQL URLs: `mysql://user:pw@host:port/db?mode=row|for-update&table=...`.

use std::{str::FromStr, time::Duration};

use lockkit_core::{
    Error, Result,
    config::{LockUrl, parse_count, parse_duration},
};
use sqlx::mysql::MySqlConnectOptions;

/// How locks are kept in the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A lease table: one row per key with owner, hold count, fence and expiry, changed by
    /// short transactions on the server's clock, and a row per reader, writer and permit
    /// in `<table>_holds`. Survives client and server restarts. Read-write locks and
    /// counting semaphores are available in this mode only.
    Row,
    /// A dedicated connection holds a transaction with `SELECT ... FOR UPDATE` on the key's
    /// row; waiters queue inside the server. Ends when that connection ends. Plain locks
    /// only (read-write locks and semaphores: use [`Mode::Row`]).
    ForUpdate,
}

/// Everything a MySQL URL says. Its `Debug` output leaves the password out.
#[derive(Clone)]
#[non_exhaustive]
pub struct MysqlConfig {
    /// Where and as whom to connect.
    pub connect: MySqlConnectOptions,
    /// `?mode=` (default `row`).
    pub mode: Mode,
    /// `?table=` (default `lockkit_locks`); for-update mode also uses `<table>_mutex`.
    pub table: String,
    /// `?create_schema=false` refuses to create tables and reports the DDL to run instead.
    pub create_schema: bool,
    /// `?pool_size=` connections for short statements (default 8). Row mode keeps a
    /// quarter of them (none below 4) out of sqlx's pool between its one-statement calls,
    /// which spares the ping sqlx sends on every connection given back.
    pub pool_size: u32,
    /// `?max_holds=` (for-update): dedicated connections for held and waiting locks
    /// (default 32). Each hold and each waiter uses one; past that, acquisitions fail with
    /// an error saying so.
    pub max_holds: u32,
    /// `?connect_timeout=` (default 5 s).
    pub connect_timeout: Duration,
    /// `?ttl=`: the default lease of locks taken through this URL (the facade applies it).
    pub ttl: Option<Duration>,
    /// `?liveness=` (for-update, default 250 ms): how often a hold's connection is checked,
    /// so that its holder learns the lock is gone (connection killed, server down) before
    /// a restarted server can grant it to someone else.
    pub liveness: Duration,
}

impl Default for MysqlConfig {
    /// `mysql://lockkit@127.0.0.1:3306/lockkit` in row mode, every option at its default.
    fn default() -> Self {
        MysqlConfig {
            connect: MySqlConnectOptions::new()
                .host("127.0.0.1")
                .port(3306)
                .username("lockkit")
                .database("lockkit"),
            mode: Mode::Row,
            table: "lockkit_locks".into(),
            create_schema: true,
            pool_size: 8,
            max_holds: 32,
            connect_timeout: Duration::from_secs(5),
            ttl: None,
            liveness: Duration::from_millis(250),
        }
    }
}

impl std::fmt::Debug for MysqlConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlConfig")
            .field("host", &self.connect.get_host())
            .field("port", &self.connect.get_port())
            .field("user", &self.connect.get_username())
            .field("database", &self.connect.get_database())
            .field("mode", &self.mode)
            .field("table", &self.table)
            .field("create_schema", &self.create_schema)
            .field("pool_size", &self.pool_size)
            .field("max_holds", &self.max_holds)
            .field("connect_timeout", &self.connect_timeout)
            .field("ttl", &self.ttl)
            .field("liveness", &self.liveness)
            .finish_non_exhaustive()
    }
}

const OPTIONS: &str =
    "mode, table, create_schema, pool_size, max_holds, connect_timeout, ttl, liveness";

/// Every URL scheme this crate accepts.
pub const SCHEMES: &[&str] = &["mysql", "mariadb"];

impl MysqlConfig {
    /// Parses a lockkit MySQL URL; other query options go to the driver.
    ///
    /// # Errors
    /// [`Error::Config`] saying what is wrong and what is accepted.
    pub fn parse(url: &str) -> Result<Self> {
        // Messages show the URL without its password.
        let shown = lockkit_core::config::redact_url(url);
        let parts = LockUrl::parse(
            url,
            SCHEMES,
            "mysql://user:password@host:port/database?mode=row",
        )?;
        if parts.path.as_deref().is_none_or(str::is_empty) {
            return Err(Error::Config(format!(
                "`{shown}` names no database; write mysql://user:password@host:port/database"
            )));
        }
        let base = parts.base.as_str();
        let mut config = MysqlConfig {
            connect: MySqlConnectOptions::new(),
            ..MysqlConfig::default()
        };
        let mut driver = Vec::new();
        for option in &parts.options {
            let (name, value) = (option.name.as_str(), option.value.as_str());
            match name {
                "mode" => {
                    config.mode = match value {
                        "row" => Mode::Row,
                        "for-update" | "for_update" => Mode::ForUpdate,
                        other => {
                            return Err(Error::Config(format!(
                                "`mode={other}` is unknown; use mode=row or mode=for-update"
                            )));
                        }
                    }
                }
                "table" => {
                    let ok = !value.is_empty()
                        && value.len() <= 56
                        && value.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                    if !ok {
                        return Err(Error::Config(format!(
                            "`table={value}` must be 1 to 56 letters, digits or underscores"
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
                "connect_timeout" => config.connect_timeout = parse_duration(name, value)?,
                "ttl" => config.ttl = Some(parse_duration(name, value)?),
                "liveness" => {
                    config.liveness = parse_duration(name, value)?.max(Duration::from_millis(10))
                }
                "ssl-mode"
                | "ssl-ca"
                | "charset"
                | "collation"
                | "statement-cache-capacity"
                | "socket"
                | "timezone" => driver.push(option.raw.as_str()),
                _ => {
                    return Err(parts.unknown_option(
                        option,
                        &format!("{OPTIONS} (and the driver's ssl-mode, ssl-ca, charset, socket)"),
                    ));
                }
            }
        }
        let driver_url = if driver.is_empty() {
            format!("mysql://{base}")
        } else {
            format!("mysql://{base}?{}", driver.join("&"))
        };
        config.connect = MySqlConnectOptions::from_str(&driver_url)
            .map_err(|e| Error::Config(format!("`{shown}` is not a valid MySQL URL: {e}")))?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_local_server_with_default_options() {
        let parsed = MysqlConfig::parse("mysql://lockkit@127.0.0.1:3306/lockkit").unwrap();
        assert_eq!(
            format!("{:?}", MysqlConfig::default()),
            format!("{parsed:?}")
        );
    }

    #[test]
    fn parses() {
        let c = MysqlConfig::parse(
            "mysql://u:p@127.0.0.1:13306/db?mode=for-update&table=t1&max_holds=4",
        )
        .unwrap();
        assert_eq!(
            (c.mode, c.table.as_str(), c.max_holds),
            (Mode::ForUpdate, "t1", 4)
        );
        assert_eq!(c.connect.get_port(), 13306);
        assert_eq!(
            MysqlConfig::parse("mysql://u@h/db").unwrap().mode,
            Mode::Row
        );
    }

    /// A socket-only URL names no host; the driver takes it (review 13, F8).
    #[test]
    fn a_socket_url_needs_no_host() {
        let c = MysqlConfig::parse("mysql:///lockkit?socket=/run/mysqld/mysqld.sock");
        assert!(c.is_ok(), "{c:?}");
    }

    #[test]
    fn refuses() {
        for bad in [
            "",
            "postgres://u@h/db",
            "mysql://u@h",
            "mysql://u@h/",
            "mysql://u@h/db?mode=lease",
            "mysql://u@h/db?table=a-b",
            "mysql://u@h/db?table=",
            "mysql://u@h/db?bogus=1",
            "mysql://u@h/db?ttl=5",
            "mysql://u@h:notaport/db",
        ] {
            assert!(
                matches!(MysqlConfig::parse(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }
}

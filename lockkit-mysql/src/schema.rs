//! The tables, and the SQL that uses them (with the validated table name filled in).

use std::sync::Arc;

/// The DDL for `table` (and `<table>_mutex`, used by for-update mode).
pub fn ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS `{table}` (\n  \
           name VARBINARY(512) NOT NULL,\n  \
           owner VARCHAR(80) NULL,\n  \
           holds INT UNSIGNED NOT NULL DEFAULT 0,\n  \
           fence BIGINT UNSIGNED NOT NULL DEFAULT 0,\n  \
           expires_at DATETIME(6) NULL,\n  \
           attempts TEXT NULL,\n  \
           PRIMARY KEY (name)\n\
         ) ENGINE=InnoDB;\n\
         CREATE TABLE IF NOT EXISTS `{table}_mutex` (\n  \
           name VARBINARY(512) NOT NULL,\n  \
           PRIMARY KEY (name)\n\
         ) ENGINE=InnoDB;"
    )
}

/// The change that brings a table made before the `attempts` column existed up to date.
pub(crate) fn add_attempts_column(table: &str) -> String {
    format!("ALTER TABLE `{table}` ADD COLUMN attempts TEXT NULL AFTER expires_at")
}

/// Every statement, prepared once per connection by the driver's statement cache.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) table_exists: Arc<str>,
    pub(crate) attempts_column_exists: Arc<str>,
    pub(crate) add_attempts_column: Arc<str>,
    pub(crate) row_select_for_update: Arc<str>,
    pub(crate) row_insert: Arc<str>,
    pub(crate) row_take: Arc<str>,
    pub(crate) row_reenter: Arc<str>,
    pub(crate) row_renew: Arc<str>,
    pub(crate) row_release_one: Arc<str>,
    pub(crate) row_release_all: Arc<str>,
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
    pub(crate) live_under_prefix: Arc<str>,
    pub(crate) mutex_rows_under_prefix: Arc<str>,
}

impl Sql {
    pub(crate) fn new(t: &str) -> Self {
        let s = |text: String| Arc::<str>::from(text);
        Sql {
            table_exists: s(format!("SELECT 1 FROM `{t}` JOIN `{t}_mutex` LIMIT 0")),
            attempts_column_exists: s("SELECT COUNT(*) FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'attempts'"
                .to_owned()),
            add_attempts_column: s(add_attempts_column(t)),
            row_select_for_update: s(format!(
                "SELECT owner, holds, fence, attempts, expires_at > UTC_TIMESTAMP(6) AS live, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS left_us \
                 FROM `{t}` WHERE name = ? FOR UPDATE"
            )),
            row_insert: s(format!(
                "INSERT INTO `{t}` (name, owner, holds, fence, expires_at, attempts) \
                 VALUES (?, ?, 1, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?)"
            )),
            row_take: s(format!(
                "UPDATE `{t}` SET owner = ?, holds = 1, fence = fence + 1, \
                 expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, attempts = ? WHERE name = ?"
            )),
            row_reenter: s(format!(
                "UPDATE `{t}` SET holds = holds + 1, attempts = ?, \
                 expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) WHERE name = ?"
            )),
            row_renew: s(format!(
                "UPDATE `{t}` SET expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE name = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6)"
            )),
            row_release_one: s(format!(
                "UPDATE `{t}` SET holds = holds - 1, attempts = ? WHERE name = ?"
            )),
            row_release_all: s(format!(
                "UPDATE `{t}` SET owner = NULL, holds = 0, expires_at = NULL, attempts = NULL WHERE name = ?"
            )),
            row_clear_live: s(format!(
                "UPDATE `{t}` SET owner = NULL, holds = 0, expires_at = NULL, attempts = NULL \
                 WHERE name = ? AND expires_at > UTC_TIMESTAMP(6)"
            )),
            inspect: s(format!(
                "SELECT owner, holds, fence, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS left_us \
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
            holder_take: s(format!(
                "UPDATE `{t}` SET fence = LAST_INSERT_ID(fence + 1), owner = ?, holds = 1, \
                 expires_at = NULL, attempts = NULL WHERE name = ? AND NOT COALESCE(expires_at > UTC_TIMESTAMP(6), FALSE)"
            )),
            holder_insert: s(format!(
                "INSERT INTO `{t}` (name, owner, holds, fence) VALUES (?, ?, 1, 1)"
            )),
            holder_read: s(format!(
                "SELECT owner, holds, fence FROM `{t}` WHERE name = ?"
            )),
            holder_depth: s(format!(
                "UPDATE `{t}` SET holds = ? WHERE name = ? AND owner = ?"
            )),
            holder_clear: s(format!(
                "UPDATE `{t}` SET owner = NULL, holds = 0 WHERE name = ? AND owner = ?"
            )),
            live_under_prefix: s(format!(
                "SELECT COUNT(*) FROM `{t}` WHERE name LIKE CONCAT(?, '%') AND expires_at > UTC_TIMESTAMP(6)"
            )),
            mutex_rows_under_prefix: s(format!(
                "SELECT name FROM `{t}_mutex` WHERE name LIKE CONCAT(?, '%')"
            )),
        }
    }
}

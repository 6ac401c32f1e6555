//! # lockkit-mysql
//!
//! MySQL 8 / MariaDB 10.6+ locks for lockkit, for teams whose one dependable server is the
//! database. Two modes, chosen by URL (`?mode=row|for-update`):
//!
//! - **row** ([`Mode::Row`]): a lease table, one row per key (owner, hold count, fence,
//!   expiry). Acquire, renew and release are short transactions on the **server's** clock
//!   (`UTC_TIMESTAMP(6)`, whatever the session time zone), so client clocks do not matter. Rows are never deleted, so the fence only
//!   grows. Leases survive client and server restarts. Waiters poll with capped
//!   exponential backoff and jitter. Read-write locks and counting semaphores too: each
//!   reader, writer and permit is a row of `<table>_holds` with its own lease and a fresh
//!   token from the key's counter, decided under the lock of the key's row; a waiting
//!   writer keeps new readers out with a marker row whose short lease its polls renew.
//! - **for-update** ([`Mode::ForUpdate`]): a dedicated connection holds a transaction with
//!   `SELECT ... FOR UPDATE` on the key's row in `<table>_mutex`; waiters queue inside the
//!   server and wake the instant it commits. The session's `wait_timeout` (the lease,
//!   rounded up to whole seconds) bounds a dead or paused holder; the watchdog's renewals
//!   keep a live one's connection busy. The fence is committed outside the lock
//!   transaction, so a rolled-back holder's token is never handed out again. Plain locks
//!   only: read-write locks and semaphores are `Unsupported` here (use mode=row).
//!
//! Keys are stored as `VARBINARY(512)`: compared byte for byte, so no two keys collide
//! under a collation.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod backend;
mod config;
mod db;
mod for_update;
mod row;

pub use backend::MysqlBackend;
pub use config::{Mode, MysqlConfig, SCHEMES};

/// Connects to the database a `mysql://` URL (any of [`SCHEMES`]) names.
///
/// # Errors
/// As [`MysqlBackend::connect`].
pub async fn connect(
    url: &str,
) -> lockkit_core::Result<std::sync::Arc<dyn lockkit_core::LockBackend>> {
    Ok(std::sync::Arc::new(MysqlBackend::connect(url).await?))
}
pub use db::ddl;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub use for_update::set_release_clear_pause;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub use row::set_retry_pause;

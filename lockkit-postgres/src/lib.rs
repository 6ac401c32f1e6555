//! # lockkit-postgres
//!
//! PostgreSQL locks for lockkit. `mode=row`: a lease table, one row per key (owner, hold
//! count, fence, expiry), changed by short transactions on the **server's** clock
//! (`clock_timestamp()`), so client clocks do not matter. Rows are never deleted, so the
//! fence only grows, and leases survive client and server restarts. A release is announced
//! with `NOTIFY` in its own transaction: waiters `LISTEN` on one connection per client and
//! retry the moment it commits; a holder that dies unannounced is waited out to the end of
//! its lease.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod backend;
mod config;
mod db;
mod notify;
mod row;

pub use backend::PostgresBackend;
pub use config::{Mode, PostgresConfig, SCHEMES};
pub use db::ddl;
pub use notify::LISTENER_APPLICATION_NAME;

/// Connects to the database a `postgres://` URL (any of [`SCHEMES`]) names.
///
/// # Errors
/// As [`PostgresBackend::connect`].
pub async fn connect(
    url: &str,
) -> lockkit_core::Result<std::sync::Arc<dyn lockkit_core::LockBackend>> {
    Ok(std::sync::Arc::new(PostgresBackend::connect(url).await?))
}
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub use row::set_retry_pause;

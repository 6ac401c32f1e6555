//! # lockkit-postgres
//!
//! PostgreSQL locks for lockkit. `mode=row`: a lease table, one row per key (owner, hold
//! count, fence, expiry), changed by short transactions on the **server's** clock
//! (`clock_timestamp()`), so client clocks do not matter. Rows are never deleted, so the
//! fence only grows, and leases survive client and server restarts. A release is announced
//! with `NOTIFY` in its own transaction: waiters `LISTEN` on one connection per client and
//! retry the moment it commits; a holder that dies unannounced is waited out to the end of
//! its lease.
//!
//! Row mode also has read-write locks and counting semaphores: one row per read or write
//! hold, per permit and per waiting writer in `<table>_holds` (made beside the table, and
//! beside an older one on connect), decided under the lock of the key's row in the table,
//! which stays the key's one fencing counter. A plain lock, a read-write lock and a
//! semaphore on one key exclude each other. A waiting writer leaves a marker with a lease
//! of seconds that keeps new readers out (writer preference); its release, and the removal
//! of a marker when its wait ends, are announced as a release is.
//!
//! `mode=advisory`: `pg_advisory_lock` held by a dedicated connection per hold, waiters
//! queued in the server's lock manager (no polling, no herd). The key's lock id is
//! [`advisory_id`] (64 bits of SHA-256 of `lockkit:<table>:<key>`; [`advisory_id_sql`]
//! computes it in SQL, for other clients to share the lock). The lease is the holder's
//! session `idle_session_timeout` (PostgreSQL 14+), so a paused or cut-off holder loses the
//! lock when its lease runs out; a server restart ends every advisory hold, and the holder
//! is told (`SessionLost`). The fencing token is the key's row in the lease table, shared
//! with `mode=row`: the two modes exclude each other on the same table, and row mode also
//! stays out of a key whose advisory lock any other session holds exclusively (row mode
//! takes it shared while it decides, so that its own transactions on one key never take
//! each other for an advisory holder; a client that holds it shared is not seen, except
//! advisory readers, which also hold the key's readers' lock that row mode tries).
//!
//! Advisory mode's limits: it needs a session per hold, so a transaction-pooling
//! PgBouncer (or any pooler that hands one server session to several clients) breaks it;
//! session pooling with `DISCARD ALL` on release works. A server or proxy set to drop
//! silent connections sooner than the lease (`tcp_keepalives_*`, `tcp_user_timeout`, an
//! idle timeout) can end a holder's session, and so its lock, before the holder's next
//! liveness check notices: keep such timeouts above the lease, and fence your writes. A
//! client that is not lockkit and holds only a row-mode lease has nothing in the server's
//! lock manager: plain `pg_advisory_lock` users do not see it. Read-write locks: readers
//! hold the key's lock shared (`pg_advisory_lock_shared`), writers exclusively; the server
//! queues new readers behind a waiting writer (writer preference); a downgrade runs on the
//! write's own session. Semaphores are not offered in this mode (`Unsupported`; use
//! `mode=row`): the server's lock queue cannot wait for any one of N locks. An advisory
//! holder stays out of a key that row-mode readers, writers or permits hold, and the two
//! modes' readers do not share a key.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod advisory;
mod backend;
mod config;
mod db;
mod row;

pub use backend::PostgresBackend;
pub use config::{Mode, PostgresConfig, SCHEMES};
pub use db::{advisory_id, advisory_id_sql, ddl};
pub use row::notify::LISTENER_APPLICATION_NAME;

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
pub use advisory::{set_clear_pause, set_grant_pause, set_release_pause, set_set_up_reply_lost};
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub use row::set_retry_pause;

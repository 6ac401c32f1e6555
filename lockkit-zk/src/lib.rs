//! # lockkit-zk
//!
//! ZooKeeper locks for lockkit — the CP backend: it stays safe through failures and tells
//! its holder the moment it can no longer be sure.
//!
//! - Contenders are `EPHEMERAL_SEQUENTIAL` nodes named as Apache Curator's
//!   InterProcessMutex names them (`<root>/<key>/_c_<uuid>-lock-<seq>`), under a container
//!   node per key; each waiter watches only its predecessor (no herd).
//! - Read-write locks use Curator's InterProcessReadWriteLock names
//!   (`_c_<uuid>-__READ__<seq>`, `_c_<uuid>-__WRIT__<seq>`) in the same queue: a reader
//!   holds when no writer comes before it (a waiting writer keeps new readers out), a
//!   writer at the head. A writer may read at once (downgrade: a read node that keeps the
//!   writer's sequence, CURATOR-621's fixed form); a reader asking to write is refused
//!   with `WouldDeadlock`.
//! - Semaphores use Curator's InterProcessSemaphoreV2 layout (`<key>/locks`,
//!   `<key>/leases/_c_<uuid>-lease-<seq>`), so Curator's leases and lockkit's permits count
//!   together; the permit count, which Curator does not store, is kept in lockkit's own
//!   `<key>/lockkit-permits` and checked among lockkit clients (`KindMismatch`).
//! - With `?layout=kazoo` ([`ZkLayout::Kazoo`]) the same queues use kazoo's names
//!   (`<uuid hex>__lock__<seq>` for plain and write locks, `<uuid hex>__rlock__<seq>` for
//!   reads) and permits use kazoo's `Semaphore` layout (a persistent `<key>` node whose data
//!   is the count, one ephemeral lease `<key>/<uuid hex>` per permit, taken under a kazoo
//!   lock at `<key>-__lock__`), so stock kazoo clients see lockkit's holds. A key's
//!   directory is then persistent, as kazoo's `ensure_path` makes it (a kazoo `Lock` relies
//!   on its path once it checked it), where Curator's layout makes a container.
//! - The fencing token is the holder node's `czxid` (a reader's, a lease's).
//! - Leases: a hold whose lease runs out unrenewed is given up (its node deleted); a dead,
//!   paused or cut-off holder's node goes with its session, so leases are at least the
//!   session timeout (`?session_timeout=`, default 10 s).
//! - Loss is pushed: session expiry, or a disconnect lasting two thirds of the session
//!   timeout on the local monotonic clock.
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod backend;
mod config;
pub mod path;
mod queue;

pub use backend::ZkBackend;
pub use config::{SCHEMES, ZkConfig, ZkLayout};

/// Connects to the ensemble a `zk://` URL (any of [`SCHEMES`]) names.
///
/// # Errors
/// As [`ZkBackend::connect`].
pub async fn connect(
    url: &str,
) -> lockkit_core::Result<std::sync::Arc<dyn lockkit_core::LockBackend>> {
    Ok(std::sync::Arc::new(ZkBackend::connect(url).await?))
}

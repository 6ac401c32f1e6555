//! # lockkit-etcd
//!
//! etcd locks for lockkit — the Raft-backed CP backend most cloud-native teams already run.
//!
//! - A contender is the key `<prefix>/<key>/<lease id in hex>` under an etcd lease of its
//!   own, the layout of etcd's `concurrency.Mutex`, so `etcdctl lock /lockkit/<key>`, Go
//!   services and lockkit exclude each other on the same lock.
//! - The first key of the range by create revision holds the lock; each waiter watches only
//!   the key just before its own (no herd).
//! - The fencing token is the holder key's create revision: cluster-wide, monotonic, no
//!   clock involved.
//! - Leases: a hold whose lease runs out unrenewed is given up (its etcd lease revoked); a
//!   dead, paused or cut-off holder's key goes with its etcd lease, so leases are at least
//!   the etcd lease's TTL (`?session_ttl=`, default 10 s).
//! - Loss is pushed: the cluster refusing a keep-alive, none confirmed for two thirds of
//!   the TTL on the local monotonic clock, or the key deleted under the holder.
//! - Read-write locks use the layout of etcd's recipe `RWMutex` (`<prefix>/<key>/read/…`,
//!   `<prefix>/<key>/write/…`, one key per hold on a lease of its own, never rewritten):
//!   a writer waits for every key created before its own, a reader for every earlier key
//!   that is not a reader's (writers, plain locks, `etcdctl lock`). FIFO by create revision
//!   gives writer preference. A downgrade (a writer that reads) is granted at once; once
//!   the write is let go its key stays, marked `…/downgraded`, until the read ends, so that
//!   writers queued behind it stay out while other readers join. Upgrades are refused with
//!   `WouldDeadlock`. Re-entry is counted here, not in the key.
//! - Semaphores (lockkit-only layout): a permit is the key
//!   `<prefix>/<key>/permits/<N>/<lease id in hex>` and holds when fewer than N permit keys
//!   were created before it (FIFO); waiters watch the permits' range for deletions, so a
//!   release wakes every waiter of the semaphore, each then reading the range once (a herd
//!   bounded by the waiters, unlike the plain lock's and the read-write lock's one watched
//!   key). Each permit's token is its create revision. A semaphore and any lock on one
//!   key exclude each other (`KindMismatch`), as do semaphores of different counts (the
//!   oldest permit key says the count).
//! - Mixed fleets: recipe readers ignore plain-lock contenders, and the recipe orders by
//!   mod revision, which a reentrant plain lock changes (its depth is rewritten into its
//!   key for `inspect`): do not use one key as a recipe `RWMutex` and a plain lock at once.
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod backend;
mod config;
mod lease;
pub mod path;
mod request;

pub use backend::EtcdBackend;
pub use config::{EtcdConfig, SCHEMES};

/// Connects to the cluster an `etcd://` URL (any of [`SCHEMES`]) names.
///
/// # Errors
/// As [`EtcdBackend::connect`].
pub async fn connect(
    url: &str,
) -> lockkit_core::Result<std::sync::Arc<dyn lockkit_core::LockBackend>> {
    Ok(std::sync::Arc::new(EtcdBackend::connect(url).await?))
}

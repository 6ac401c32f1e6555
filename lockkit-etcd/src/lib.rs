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

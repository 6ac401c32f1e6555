//! # lockkit-redis
//!
//! Redis locks for lockkit — the AP backend: fast, and honest about what it cannot
//! promise.
//!
//! - [`RedisBackend`]: one server (`redis://`, `rediss://`) or a Redis Cluster
//!   (`redis+cluster://`).
//! - [`RedlockBackend`]: Redlock over independent masters (`redlock://h1,h2,h3,h4,h5`).
//!
//! The wire layout is Redisson's RLock (see [`LockNames`]), so Redisson and lockkit clients
//! exclude each other on the same lock name.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod config;
mod conn;
mod redlock;
mod single;
mod wire;

pub use config::{
    DEFAULT_KEEPALIVE, MAX_KEEPALIVE, MAX_TIMEOUT, MIN_KEEPALIVE, RedisConfig, SCHEMES, Topology,
};
pub use redlock::RedlockBackend;
pub use single::RedisBackend;
pub use wire::LockNames;

/// The connection that single servers' commands run on, for its own tests.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub use conn::direct::DirectConn;

use lockkit_core::{LockBackend, Result};

/// Connects to whatever a Redis URL names: a server, a cluster, or Redlock masters (any
/// of [`SCHEMES`]).
///
/// # Errors
/// [`lockkit_core::Error::Config`] for a bad URL, a backend error if a server is down.
pub async fn connect(url: &str) -> Result<std::sync::Arc<dyn LockBackend>> {
    let config = RedisConfig::parse(url)?;
    Ok(match config.topology {
        Topology::Redlock(_) => std::sync::Arc::new(RedlockBackend::from_config(config).await?),
        _ => std::sync::Arc::new(RedisBackend::from_config(config).await?),
    })
}

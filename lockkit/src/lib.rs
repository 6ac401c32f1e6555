//! # lockkit
//!
//! Distributed locks with one contract — leases, fencing tokens, reentrancy, waiting with
//! a deadline, a lost signal — and backends chosen by configuration:
//!
//! ```no_run
//! # async fn demo() -> lockkit::Result<()> {
//! let locker = lockkit::connect("redis://127.0.0.1:6379").await?;   // or zk://, mysql://, file://
//! let guard = locker.acquire("orders/42").await?;
//! let token = guard.token();      // send it with every write made under the lock
//! guard.release().await?;
//! # let _ = token; Ok(()) }
//! ```
//!
//! | scheme | backend | feature |
//! |---|---|---|
//! | `memory://` | [`MemoryBackend`] (one process) | always |
//! | `file:///dir` | [`FileBackend`] (one host) | always |
//! | `redis://`, `rediss://`, `redis+cluster://`, `redlock://` | [`redis`] | `redis` |
//! | `zk://h1,h2,h3/chroot` | [`zk`] | `zk` |
//! | `mysql://...?mode=row\|for-update` | [`mysql`] | `mysql` |
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

use std::sync::Arc;

pub use lockkit_core::*;
#[cfg(feature = "mysql")]
pub use lockkit_mysql as mysql;
#[cfg(feature = "redis")]
pub use lockkit_redis as redis;
#[cfg(feature = "zk")]
pub use lockkit_zk as zk;

/// Every scheme lockkit knows, with the feature that enables it (`None`: always there).
pub const SCHEMES: &[(&str, Option<&str>)] = &[
    ("memory", None),
    ("file", None),
    ("redis", Some("redis")),
    ("rediss", Some("redis")),
    ("redis+cluster", Some("redis")),
    ("rediss+cluster", Some("redis")),
    ("redlock", Some("redis")),
    ("zk", Some("zk")),
    ("zookeeper", Some("zk")),
    ("mysql", Some("mysql")),
    ("mariadb", Some("mysql")),
];

/// The environment variable naming the default backend URL.
pub const URL_VAR: &str = "LOCKKIT_URL";

/// The embedded default when no URL is given: a lock directory under the system's
/// temporary directory, shared by the processes of this host.
pub fn default_url() -> String {
    format!("file://{}", std::env::temp_dir().join("lockkit").display())
}

/// Connects to the backend `url` names, with default options.
///
/// # Errors
/// [`Error::Config`] for a malformed URL or an unknown scheme (listing the known ones),
/// [`Error::Unsupported`] for a scheme whose feature is off (naming the feature), and the
/// backend's error if its server cannot be reached.
pub async fn connect(url: &str) -> Result<Locker> {
    connect_with(url, LockOptions::default()).await
}

/// Connects to the backend `url` names; acquisitions use `options` unless told otherwise.
///
/// # Errors
/// As [`connect`].
pub async fn connect_with(url: &str, options: LockOptions) -> Result<Locker> {
    Ok(Locker::from_arc(backend(url).await?).with_options(options))
}

/// Connects to `$LOCKKIT_URL`, or to [`default_url`] when it is unset.
///
/// # Errors
/// As [`connect`].
pub async fn connect_env() -> Result<Locker> {
    let url = std::env::var(URL_VAR)
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(default_url);
    connect(&url).await
}

/// The scheme of `url` and whether it is known, enabled or disabled.
fn scheme_of(url: &str) -> Result<&'static str> {
    let known = || {
        SCHEMES
            .iter()
            .map(|(s, _)| format!("{s}://"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(Error::Config(format!(
            "`{url}` is not a URL; use one of {}",
            known()
        )));
    };
    let Some((name, feature)) = SCHEMES.iter().find(|(s, _)| *s == scheme) else {
        return Err(Error::Config(format!(
            "unknown lock backend scheme `{scheme}`; known schemes: {}",
            known()
        )));
    };
    if let Some(feature) = feature
        && !enabled(feature)
    {
        return Err(Error::Unsupported {
            backend: "lockkit",
            what: format!(
                "`{scheme}://` URLs in this build: enable the `{feature}` feature of the lockkit crate"
            ),
        });
    }
    Ok(name)
}

fn enabled(feature: &str) -> bool {
    (feature == "redis" && cfg!(feature = "redis"))
        || (feature == "zk" && cfg!(feature = "zk"))
        || (feature == "mysql" && cfg!(feature = "mysql"))
}

/// The backend `url` names, shared so it can be wrapped or inspected.
///
/// # Errors
/// As [`connect`].
pub async fn backend(url: &str) -> Result<Arc<dyn LockBackend>> {
    Ok(match scheme_of(url)? {
        "memory" => Arc::new(MemoryBackend::from_url(url)?),
        "file" => Arc::new(FileBackend::from_url(url)?),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" | "redlock" => {
            lockkit_redis::connect(url).await?
        }
        #[cfg(feature = "zk")]
        "zk" | "zookeeper" => Arc::new(lockkit_zk::ZkBackend::connect(url).await?),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => Arc::new(lockkit_mysql::MysqlBackend::connect(url).await?),
        other => {
            return Err(Error::Unsupported {
                backend: "lockkit",
                what: format!("`{other}://` URLs in this build"),
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_schemes_list_the_known_ones() {
        let err = scheme_of("postgres://x").unwrap_err().to_string();
        assert!(
            err.contains("postgres") && err.contains("redlock://") && err.contains("zk://"),
            "{err}"
        );
        assert!(matches!(scheme_of("no-scheme"), Err(Error::Config(_))));
    }

    #[test]
    fn every_scheme_is_enabled_in_the_default_build() {
        for (scheme, _) in SCHEMES {
            assert_eq!(scheme_of(&format!("{scheme}://x")).unwrap(), *scheme);
        }
    }
}

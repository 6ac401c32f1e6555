#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

use std::{future::Future, pin::Pin, sync::Arc};

pub mod fence;

pub use lockkit_core::*;
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use lockkit_etcd as etcd;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use lockkit_mysql as mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use lockkit_postgres as postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use lockkit_redis as redis;
#[cfg(feature = "zk")]
#[cfg_attr(docsrs, doc(cfg(feature = "zk")))]
pub use lockkit_zk as zk;

/// Builds a backend from a URL.
pub type ConnectFn =
    fn(String) -> Pin<Box<dyn Future<Output = Result<Arc<dyn LockBackend>>> + Send>>;

/// One backend the facade can build from a URL: its schemes come from the backend itself
/// (each backend crate exports its `SCHEMES` and `connect`), so a scheme a backend
/// accepts is never refused here.
#[derive(Debug, Clone, Copy)]
pub struct Driver {
    /// The backend's name.
    pub name: &'static str,
    /// The URL schemes it accepts.
    pub schemes: &'static [&'static str],
    /// The facade feature that builds it in (`None`: always there).
    pub feature: Option<&'static str>,
    /// How to connect; `None` when its feature is off in this build.
    pub connect: Option<ConnectFn>,
}

/// Every backend lockkit knows, in this build.
pub const DRIVERS: &[Driver] = &[
    Driver {
        name: "memory",
        schemes: MemoryBackend::SCHEMES,
        feature: None,
        connect: Some(|url| {
            Box::pin(async move {
                let backend: Arc<dyn LockBackend> = Arc::new(MemoryBackend::from_url(&url)?);
                Ok(backend)
            })
        }),
    },
    Driver {
        name: "file",
        schemes: FileBackend::SCHEMES,
        feature: None,
        connect: Some(|url| {
            Box::pin(async move {
                let backend: Arc<dyn LockBackend> = Arc::new(FileBackend::from_url(&url)?);
                Ok(backend)
            })
        }),
    },
    #[cfg(feature = "redis")]
    Driver {
        name: "redis",
        schemes: lockkit_redis::SCHEMES,
        feature: Some("redis"),
        connect: Some(|url| Box::pin(async move { lockkit_redis::connect(&url).await })),
    },
    #[cfg(not(feature = "redis"))]
    Driver {
        name: "redis",
        schemes: REDIS_SCHEMES,
        feature: Some("redis"),
        connect: None,
    },
    #[cfg(feature = "zk")]
    Driver {
        name: "zookeeper",
        schemes: lockkit_zk::SCHEMES,
        feature: Some("zk"),
        connect: Some(|url| Box::pin(async move { lockkit_zk::connect(&url).await })),
    },
    #[cfg(not(feature = "zk"))]
    Driver {
        name: "zookeeper",
        schemes: ZK_SCHEMES,
        feature: Some("zk"),
        connect: None,
    },
    #[cfg(feature = "mysql")]
    Driver {
        name: "mysql",
        schemes: lockkit_mysql::SCHEMES,
        feature: Some("mysql"),
        connect: Some(|url| Box::pin(async move { lockkit_mysql::connect(&url).await })),
    },
    #[cfg(not(feature = "mysql"))]
    Driver {
        name: "mysql",
        schemes: MYSQL_SCHEMES,
        feature: Some("mysql"),
        connect: None,
    },
    #[cfg(feature = "postgres")]
    Driver {
        name: "postgres",
        schemes: lockkit_postgres::SCHEMES,
        feature: Some("postgres"),
        connect: Some(|url| Box::pin(async move { lockkit_postgres::connect(&url).await })),
    },
    #[cfg(not(feature = "postgres"))]
    Driver {
        name: "postgres",
        schemes: POSTGRES_SCHEMES,
        feature: Some("postgres"),
        connect: None,
    },
    #[cfg(feature = "etcd")]
    Driver {
        name: "etcd",
        schemes: lockkit_etcd::SCHEMES,
        feature: Some("etcd"),
        connect: Some(|url| Box::pin(async move { lockkit_etcd::connect(&url).await })),
    },
    #[cfg(not(feature = "etcd"))]
    Driver {
        name: "etcd",
        schemes: ETCD_SCHEMES,
        feature: Some("etcd"),
        connect: None,
    },
];

/// The schemes of lockkit-redis, known even when its feature is off (to say which feature
/// to turn on); a test holds them equal to `lockkit_redis::SCHEMES`.
#[cfg_attr(feature = "redis", allow(dead_code))]
const REDIS_SCHEMES: &[&str] = &[
    "redis",
    "rediss",
    "redis+cluster",
    "rediss+cluster",
    "redlock",
    "redlocks",
];
/// The schemes of lockkit-zk (see [`REDIS_SCHEMES`]).
#[cfg_attr(feature = "zk", allow(dead_code))]
const ZK_SCHEMES: &[&str] = &["zk", "zookeeper"];
/// The schemes of lockkit-mysql (see [`REDIS_SCHEMES`]).
#[cfg_attr(feature = "mysql", allow(dead_code))]
const MYSQL_SCHEMES: &[&str] = &["mysql", "mariadb"];
/// The schemes of lockkit-postgres (see [`REDIS_SCHEMES`]).
#[cfg_attr(feature = "postgres", allow(dead_code))]
const POSTGRES_SCHEMES: &[&str] = &["postgres", "postgresql"];
/// The schemes of lockkit-etcd (see [`REDIS_SCHEMES`]).
#[cfg_attr(feature = "etcd", allow(dead_code))]
const ETCD_SCHEMES: &[&str] = &["etcd"];

/// Every scheme lockkit knows, with the feature that enables it (`None`: always there).
pub fn schemes() -> impl Iterator<Item = (&'static str, Option<&'static str>)> {
    DRIVERS
        .iter()
        .flat_map(|d| d.schemes.iter().map(move |s| (*s, d.feature)))
}

/// The environment variable naming the default backend URL.
pub const URL_VAR: &str = "LOCKKIT_URL";

/// The embedded default when no URL is given: a lock directory under the system's
/// temporary directory, shared by the processes of this host. That directory may be a
/// tmpfs (emptied at every boot) or cleaned of old files, so the fencing tokens of its keys
/// start again from the wall clock, below earlier ones if the clock was set back: for
/// tokens that keep growing whatever the clock does, name a directory on a disk, e.g.
/// `file:///var/lib/<app>/locks`.
pub fn default_url() -> String {
    lockkit_core::FileBackend::url_of(&std::env::temp_dir().join("lockkit"))
}

/// Connects to the backend `url` names, with default options. A `?ttl=` in the URL (every
/// backend takes it) sets the default lease.
///
/// # Errors
/// [`Error::Config`] for a malformed URL or an unknown scheme (listing the known ones),
/// [`Error::Unsupported`] for a scheme whose feature is off (naming the feature), and the
/// backend's error if its server cannot be reached.
pub async fn connect(url: &str) -> Result<Locker> {
    let mut options = LockOptions::default();
    if let Some(ttl) = config::url_ttl(url)? {
        if ttl.is_zero() {
            return Err(Error::Config(format!(
                "`ttl=0` in `{}`: a lease must be longer than zero; write e.g. `?ttl=30s`",
                config::redact_url(url)
            )));
        }
        options.ttl = ttl;
    }
    connect_with(url, options).await
}

/// Connects to the backend `url` names; acquisitions use `options` unless told otherwise.
/// The URL's `?ttl=` is not applied here: the options given are the ones used.
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

/// The driver for `url`'s scheme, if it is known and built in.
fn driver_of(url: &str) -> Result<(&'static Driver, ConnectFn)> {
    let known = || {
        schemes()
            .map(|(s, _)| format!("{s}://"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(Error::Config(format!(
            "`{}` is not a URL; use one of {}",
            config::redact_url(url),
            known()
        )));
    };
    let Some(driver) = DRIVERS.iter().find(|d| d.schemes.contains(&scheme)) else {
        return Err(Error::Config(format!(
            "unknown lock backend scheme `{scheme}`; known schemes: {}",
            known()
        )));
    };
    match driver.connect {
        Some(connect) => Ok((driver, connect)),
        None => Err(Error::Unsupported {
            backend: "lockkit",
            what: format!(
                "`{scheme}://` URLs in this build: enable the `{}` feature of the lockkit crate",
                driver.feature.unwrap_or(driver.name)
            ),
        }),
    }
}

/// The backend `url` names, shared so it can be wrapped or inspected.
///
/// # Errors
/// As [`connect`].
pub async fn backend(url: &str) -> Result<Arc<dyn LockBackend>> {
    let (_, connect) = driver_of(url)?;
    connect(url.to_owned()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The lists used when a feature is off are the backends' own lists.
    #[test]
    fn the_schemes_known_without_a_feature_are_the_backends_own() {
        #[cfg(feature = "redis")]
        assert_eq!(REDIS_SCHEMES, lockkit_redis::SCHEMES);
        #[cfg(feature = "zk")]
        assert_eq!(ZK_SCHEMES, lockkit_zk::SCHEMES);
        #[cfg(feature = "mysql")]
        assert_eq!(MYSQL_SCHEMES, lockkit_mysql::SCHEMES);
        #[cfg(feature = "postgres")]
        assert_eq!(POSTGRES_SCHEMES, lockkit_postgres::SCHEMES);
        #[cfg(feature = "etcd")]
        assert_eq!(ETCD_SCHEMES, lockkit_etcd::SCHEMES);
        for scheme in REDIS_SCHEMES
            .iter()
            .chain(ZK_SCHEMES)
            .chain(MYSQL_SCHEMES)
            .chain(POSTGRES_SCHEMES)
            .chain(ETCD_SCHEMES)
        {
            assert!(schemes().any(|(s, _)| s == *scheme), "{scheme}");
        }
    }

    /// `?ttl=` means the default lease on every backend: each parses it, and the facade
    /// applies it.
    #[tokio::test]
    async fn every_backend_takes_ttl_and_the_facade_applies_it() {
        let locker = connect("memory://?ttl=7s").await.unwrap();
        assert_eq!(locker.options().ttl, Duration::from_secs(7));
        let dir = std::env::temp_dir().join(format!("lockkit-ttl-{}", std::process::id()));
        let locker = connect(&format!("file://{}?ttl=250ms", dir.display()))
            .await
            .unwrap();
        assert_eq!(locker.options().ttl, Duration::from_millis(250));
        std::fs::remove_dir_all(dir).ok();
        #[cfg(feature = "redis")]
        assert_eq!(
            lockkit_redis::RedisConfig::parse("redlock://a,b,c?ttl=5s")
                .unwrap()
                .ttl,
            Some(Duration::from_secs(5))
        );
        #[cfg(feature = "zk")]
        assert_eq!(
            lockkit_zk::ZkConfig::parse("zk://a:1,b:2/app?ttl=5s")
                .unwrap()
                .ttl,
            Some(Duration::from_secs(5))
        );
        #[cfg(feature = "mysql")]
        assert_eq!(
            lockkit_mysql::MysqlConfig::parse("mysql://u@h/db?ttl=5s")
                .unwrap()
                .ttl,
            Some(Duration::from_secs(5))
        );
        #[cfg(feature = "postgres")]
        assert_eq!(
            lockkit_postgres::PostgresConfig::parse("postgres://u@h/db?ttl=5s")
                .unwrap()
                .ttl,
            Some(Duration::from_secs(5))
        );
        #[cfg(feature = "etcd")]
        assert_eq!(
            lockkit_etcd::EtcdConfig::parse("etcd://a,b:2?ttl=5s")
                .unwrap()
                .ttl,
            Some(Duration::from_secs(5))
        );
        assert!(matches!(
            connect("memory://?ttl=5").await,
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn unknown_schemes_list_the_known_ones() {
        let err = driver_of("consul://x").unwrap_err().to_string();
        assert!(
            err.contains("consul") && err.contains("redlocks://") && err.contains("etcd://"),
            "{err}"
        );
        assert!(matches!(driver_of("no-scheme"), Err(Error::Config(_))));
    }

    /// Every scheme any backend accepts is accepted here, by that backend.
    #[test]
    fn every_scheme_of_every_backend_is_accepted() {
        let backends: &[(&str, &[&str])] = &[
            ("memory", MemoryBackend::SCHEMES),
            ("file", FileBackend::SCHEMES),
            #[cfg(feature = "redis")]
            ("redis", lockkit_redis::SCHEMES),
            #[cfg(feature = "zk")]
            ("zookeeper", lockkit_zk::SCHEMES),
            #[cfg(feature = "mysql")]
            ("mysql", lockkit_mysql::SCHEMES),
            #[cfg(feature = "postgres")]
            ("postgres", lockkit_postgres::SCHEMES),
            #[cfg(feature = "etcd")]
            ("etcd", lockkit_etcd::SCHEMES),
        ];
        for (name, schemes) in backends {
            assert!(!schemes.is_empty(), "{name} declares no scheme");
            for scheme in *schemes {
                let (driver, _) = driver_of(&format!("{scheme}://x"))
                    .unwrap_or_else(|e| panic!("`{scheme}://` of {name} is refused: {e}"));
                assert_eq!(
                    driver.name, *name,
                    "`{scheme}://` goes to the wrong backend"
                );
            }
        }
        let built_in: Vec<_> = DRIVERS
            .iter()
            .filter(|d| d.connect.is_some())
            .flat_map(|d| d.schemes.iter())
            .collect();
        let total: usize = backends.iter().map(|(_, s)| s.len()).sum();
        assert_eq!(built_in.len(), total, "this build connects {built_in:?}");
    }

    #[test]
    fn no_scheme_belongs_to_two_backends() {
        let mut seen = std::collections::BTreeSet::new();
        for (scheme, _) in schemes() {
            assert!(seen.insert(scheme), "`{scheme}://` is claimed twice");
        }
    }
}

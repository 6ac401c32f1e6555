//! `lockkit::connect` picks the backend from the URL, for every scheme.

use std::time::Duration;

use lockkit::{Consistency, Error};
use lockkit_conformance::env;

async fn round_trip(url: &str, scheme: &str) {
    let locker = lockkit::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    assert_eq!(locker.info().scheme, scheme, "{url}");
    let key = format!("facade/{scheme}/{}", std::process::id());
    let guard = locker
        .acquire(key.as_str())
        .ttl(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(locker.try_acquire(key.as_str()).await.unwrap().is_none());
    guard.release().await.unwrap();
}

#[tokio::test]
async fn embedded_backends_need_no_server() {
    round_trip("memory://", "memory").await;
    let dir = concat!(env!("CARGO_TARGET_TMPDIR"), "/facade-locks");
    round_trip(&format!("file://{dir}"), "file").await;
    let default = lockkit::connect(&lockkit::default_url()).await.unwrap();
    assert_eq!(default.info().consistency, Consistency::Cp);
}

#[tokio::test]
async fn every_server_backend_by_url() {
    for (var, scheme, options) in [
        ("LOCKKIT_TEST_REDIS_URL", "redis", ""),
        ("LOCKKIT_TEST_REDIS_CLUSTER_URL", "redis+cluster", ""),
        ("LOCKKIT_TEST_REDLOCK_URL", "redlock", ""),
        ("LOCKKIT_TEST_ZK_URL", "zk", "?session_timeout=5s"),
        (
            "LOCKKIT_TEST_MYSQL_URL",
            "mysql",
            "?mode=for-update&table=lockkit_facade",
        ),
        (
            "LOCKKIT_TEST_MYSQL_URL",
            "mysql",
            "?mode=row&table=lockkit_facade_row",
        ),
        (
            "LOCKKIT_TEST_POSTGRES_URL",
            "postgres",
            "?mode=row&table=lockkit_facade_row",
        ),
    ] {
        let Some(url) = env::service_url(var) else {
            continue;
        };
        round_trip(&format!("{url}{options}"), scheme).await;
    }
}

#[tokio::test]
async fn bad_urls_are_typed_errors() {
    for url in [
        "",
        "nope",
        "postgres://x",
        "memory://host",
        "file://relative",
    ] {
        let err = lockkit::connect(url).await.unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{url}: {err}");
    }
    let err = lockkit::connect("redis://127.0.0.1:1?connect_timeout=300ms")
        .await
        .unwrap_err();
    assert!(
        err.is_retryable(),
        "a server that is down is retryable: {err}"
    );
}

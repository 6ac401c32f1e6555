//! MySQL-specific behaviour beyond the shared suite.

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{Error, LockKey, Locker, LostReason};
use lockkit_mysql::MysqlBackend;
use uuid::Uuid;

fn url(options: &str) -> Option<String> {
    env::service_url("LOCKKIT_TEST_MYSQL_URL").map(|u| format!("{u}?{options}"))
}

fn key() -> LockKey {
    LockKey::new(format!("mysql-test/{}", Uuid::new_v4().simple())).unwrap()
}

#[tokio::test]
async fn without_create_schema_a_missing_table_reports_the_ddl() {
    let Some(url) = url(&format!(
        "table=missing_{}&create_schema=false",
        &Uuid::new_v4().simple().to_string()[..8]
    )) else {
        return;
    };
    let err = MysqlBackend::connect(&url).await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(
        err.to_string().contains("CREATE TABLE IF NOT EXISTS"),
        "{err}"
    );
}

#[tokio::test]
async fn past_max_holds_for_update_fails_clearly() {
    let Some(url) = url("mode=for-update&table=lockkit_test_fu&max_holds=2") else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let one = locker.try_acquire(key()).await.unwrap().unwrap();
    let two = locker.try_acquire(key()).await.unwrap().unwrap();
    let err = locker.try_acquire(key()).await.unwrap_err();
    assert!(err.to_string().contains("max_holds"), "{err}");
    assert!(err.is_retryable());
    one.release().await.unwrap();
    let three = locker
        .try_acquire(key())
        .await
        .unwrap()
        .expect("a freed connection is reused");
    two.release().await.unwrap();
    three.release().await.unwrap();
}

#[tokio::test]
async fn killing_the_holders_connection_fires_lost_promptly() {
    let Some(url) = url("mode=for-update&table=lockkit_test_fu") else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let rival = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let key = key();
    let guard = locker
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let id = backend
        .connection_holding(&key)
        .expect("the hold's connection");
    MysqlBackend::connect(&url)
        .await
        .unwrap()
        .kill_connection(id)
        .await
        .unwrap();
    // Well before the 30 s lease: the liveness check notices the dead connection.
    let reason = tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("lost never fired");
    assert_eq!(reason, LostReason::SessionLost);
    let next = rival
        .acquire(&key)
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        next.token() > guard.token(),
        "a killed holder's token is never reused"
    );
    assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
    next.release().await.unwrap();
}

#[tokio::test]
async fn row_leases_use_the_server_clock_and_keep_growing_fences() {
    let Some(url) = url("mode=row&table=lockkit_test_row") else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let key = key();
    let mut last = 0;
    for _ in 0..5 {
        let guard = locker
            .acquire(&key)
            .ttl(Duration::from_secs(5))
            .await
            .unwrap();
        let info = locker.inspect(&key).await.unwrap().unwrap();
        let left = info.ttl_left.unwrap();
        assert!(
            left <= Duration::from_secs(5) && left > Duration::from_secs(3),
            "{left:?}"
        );
        assert!(guard.token().get() > last);
        last = guard.token().get();
        guard.release().await.unwrap();
    }
}

/// A for-update connection goes back to the pool after a hold with the hold's short
/// `wait_timeout`; the next acquisition after an idle spell must still work (the pool
/// resets the session on release and tests connections before use).
#[tokio::test]
async fn for_update_works_after_an_idle_spell() {
    let Some(url) = url("mode=for-update&table=lockkit_test_fu_idle&max_holds=1") else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let key = key();
    let held = locker
        .acquire(&key)
        .ttl(Duration::from_secs(1))
        .await
        .unwrap();
    held.release().await.unwrap();
    // Longer than the 1 s wait_timeout the hold set on its connection.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let again = locker
        .acquire(&key)
        .ttl(Duration::from_secs(1))
        .wait(Duration::from_secs(5))
        .await
        .expect("the first acquisition after an idle spell must work");
    again.release().await.unwrap();
}

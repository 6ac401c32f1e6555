//! No leaks: after 1,000 acquire/cancel cycles in each mode the server's process list is
//! back to its baseline once the clients close, and no transaction is left open.
//! (Its own test binary, so that no other test's connections are counted.)

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_mysql::MysqlBackend;
use sqlx::{Connection, MySqlConnection};
use uuid::Uuid;

async fn counts(admin: &mut MySqlConnection) -> (i64, i64) {
    let (processes,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE USER = 'lockkit'",
    )
    .fetch_one(&mut *admin)
    .await
    .unwrap();
    let (transactions,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM information_schema.INNODB_TRX")
            .fetch_one(&mut *admin)
            .await
            .unwrap();
    (processes, transactions)
}

async fn cycles(mode: &str, url: &str) {
    let options = format!(
        "{url}?mode={mode}&table=lockkit_test_{}",
        if mode == "row" { "row" } else { "fu" }
    );
    let backend = MysqlBackend::connect(&options).await.unwrap();
    let locker = Locker::new(backend.clone());
    let rival_backend = MysqlBackend::connect(&options).await.unwrap();
    let rival = Locker::new(rival_backend.clone());
    let run = Uuid::new_v4().simple().to_string();
    let busy = LockKey::new(format!("leaks/{run}/busy")).unwrap();
    let held = rival
        .acquire(&busy)
        .ttl(Duration::from_secs(120))
        .await
        .unwrap();
    for i in 0..1_000u64 {
        if i % 2 == 0 {
            // A waiter on a held key, cancelled mid-wait.
            let waiting = locker
                .acquire(&busy)
                .ttl(Duration::from_secs(60))
                .wait(Duration::from_secs(30));
            assert!(
                tokio::time::timeout(Duration::from_millis(3), waiting)
                    .await
                    .is_err()
            );
        } else {
            // An acquisition of a free key dropped somewhere in flight.
            let key = LockKey::new(format!("leaks/{run}/k{}", i % 20)).unwrap();
            let attempt = locker.acquire(&key).ttl(Duration::from_secs(60));
            if let Ok(guard) =
                tokio::time::timeout(Duration::from_micros((i * 37) % 3000), attempt).await
            {
                guard.unwrap().release().await.unwrap();
            }
        }
    }
    held.release().await.unwrap();
    // Background give-backs and interrupted waits settle; then nothing may stay held.
    let prefix = format!("leaks/{run}/");
    let mut left = u64::MAX;
    for _ in 0..100 {
        left = backend.held_under(&prefix).await.unwrap();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(left, 0, "{mode}: locks left held by cancelled acquisitions");
    backend.close().await;
    rival_backend.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_cancelled_cycles_per_mode_leave_nothing_behind() {
    let Some(url) = env::service_url("LOCKKIT_TEST_MYSQL_URL") else {
        return;
    };
    let mut admin = MySqlConnection::connect(&url).await.unwrap();
    let baseline = counts(&mut admin).await;
    for mode in ["row", "for-update"] {
        cycles(mode, &url).await;
        let mut now = (i64::MAX, i64::MAX);
        for _ in 0..100 {
            now = counts(&mut admin).await;
            if now.0 <= baseline.0 && now.1 <= baseline.1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            now.0 <= baseline.0,
            "{mode}: {} server connections, {} before",
            now.0,
            baseline.0
        );
        assert!(
            now.1 <= baseline.1,
            "{mode}: {} open transactions, {} before",
            now.1,
            baseline.1
        );
    }
}

//! PostgreSQL-specific behaviour against the private server from `scripts/services.sh`.

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_postgres::PostgresBackend;

fn key(what: &str) -> LockKey {
    LockKey::new(format!("pg-test/{what}/{}", uuid::Uuid::new_v4())).unwrap()
}

async fn locker() -> Option<(Locker, PostgresBackend)> {
    let url = env::service_url("LOCKKIT_TEST_POSTGRES_URL")?;
    let backend = PostgresBackend::connect(&format!("{url}?table=lockkit_test_pg"))
        .await
        .unwrap();
    Some((Locker::new(backend.clone()), backend))
}

#[tokio::test]
async fn extend_renews_the_lease_on_the_server() {
    let Some((locker, _)) = locker().await else {
        return;
    };
    let k = key("extend");
    let held = locker
        .try_acquire(&k)
        .ttl(Duration::from_millis(400))
        .no_watchdog()
        .await
        .unwrap()
        .unwrap();
    held.extend(Duration::from_secs(30)).await.unwrap();
    let info = locker.inspect(&k).await.unwrap().unwrap();
    assert!(info.ttl_left.unwrap() > Duration::from_secs(20), "{info:?}");
    held.release().await.unwrap();
    assert!(locker.inspect(&k).await.unwrap().is_none());
}

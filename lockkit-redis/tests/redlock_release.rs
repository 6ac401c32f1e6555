//! What a Redlock release reports (helper-42's nit): the holds a quorum of masters keeps,
//! not the highest count any one master reports.

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker, spi::Released};
use lockkit_redis::{LockNames, RedlockBackend};
use uuid::Uuid;

/// A stray copy of the hold on one master (here a count raised there alone, as a re-entry's
/// give-back that never landed leaves it) does not make a quorum's full release read
/// `Partially`.
#[tokio::test]
async fn a_stray_copy_on_one_master_does_not_make_a_full_release_partial() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDLOCK_URL") else {
        return;
    };
    let masters = env::host_ports(&url);
    let locker = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let key = LockKey::new(format!("redlock-release/{}", Uuid::new_v4().simple())).unwrap();
    let guard = locker
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let name = LockNames::new("", &key, false).unwrap().lock;
    let mut stray = redis::Client::open(format!("redis://{}", masters[0]))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(&name)
        .query_async(&mut stray)
        .await
        .unwrap();
    let owner_field = fields
        .iter()
        .find(|f| !f.starts_with("lockkit-"))
        .expect("the owner's count");
    let _: i64 = redis::cmd("HINCRBY")
        .arg(&name)
        .arg(owner_field)
        .arg(1)
        .query_async(&mut stray)
        .await
        .unwrap();
    let released = guard.release().await.unwrap();
    assert_eq!(
        released,
        Released::Fully,
        "four of five masters let go: the lock is free"
    );
    let _: i64 = redis::cmd("DEL")
        .arg(&name)
        .query_async(&mut stray)
        .await
        .unwrap();
}

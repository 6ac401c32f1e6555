//! No leaks: after 10,000 acquire / release / cancel cycles the server is back to its
//! baseline: no lock keys, no subscriptions, no extra client connections.

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_redis::RedisBackend;
use redis::AsyncCommands;
use uuid::Uuid;

async fn client_list(admin: &mut redis::aio::MultiplexedConnection) -> String {
    redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(admin)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_cycles_leave_nothing_behind() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let run = Uuid::new_v4().simple().to_string();
    let prefix = format!("leaks-{}/", &run[..8]);
    let prefixed = format!("{url}?prefix={prefix}");
    let backend = RedisBackend::connect(&prefixed).await.unwrap();
    let locker = Locker::new(backend.clone());
    let rival = Locker::new(RedisBackend::connect(&prefixed).await.unwrap());
    let mut admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let channel_pattern = format!("redisson_lock__channel:{{{prefix}*");
    let keys: Vec<LockKey> = (0..10)
        .map(|i| LockKey::new(format!("k{i}")).unwrap())
        .collect();
    let held = rival
        .acquire("busy")
        .ttl(Duration::from_secs(120))
        .await
        .unwrap();

    // Warm up: the shared subscriber connection opens on the first wait, then stays.
    let warm_up = locker.acquire("busy").wait(Duration::from_secs(30));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), warm_up)
            .await
            .is_err()
    );
    let before_clients = client_list(&mut admin).await;
    let before = before_clients.lines().count();

    let mut outcomes = [0usize; 3];
    for i in 0..10_000usize {
        match i % 10 {
            // A waiter on a held key, cancelled mid-wait (subscribes, then unsubscribes).
            0 => {
                let waiting = locker.acquire("busy").wait(Duration::from_secs(30));
                assert!(
                    tokio::time::timeout(Duration::from_millis(2), waiting)
                        .await
                        .is_err()
                );
                outcomes[0] += 1;
            }
            // An acquisition dropped at some point in flight.
            1 => {
                let budget = Duration::from_micros((i as u64 / 10) % 400);
                let attempt = locker
                    .acquire(&keys[i % keys.len()])
                    .ttl(Duration::from_secs(120));
                if let Ok(guard) = tokio::time::timeout(budget, attempt).await {
                    guard.unwrap().release().await.unwrap();
                }
                outcomes[1] += 1;
            }
            _ => {
                let key = &keys[i % keys.len()];
                let guard = locker
                    .acquire(key)
                    .ttl(Duration::from_secs(120))
                    .await
                    .unwrap();
                guard.release().await.unwrap();
                outcomes[2] += 1;
            }
        }
    }
    held.release().await.unwrap();
    assert_eq!(outcomes, [1000, 1000, 8000]);

    // Background give-backs and unsubscribes land within moments.
    let mut left = (usize::MAX, usize::MAX, usize::MAX);
    for _ in 0..100 {
        let lock_keys: Vec<String> = admin.keys(format!("{prefix}*")).await.unwrap();
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .arg(&channel_pattern)
            .query_async(&mut admin)
            .await
            .unwrap();
        left = (
            lock_keys.len(),
            channels.len(),
            client_list(&mut admin).await.lines().count(),
        );
        if left.0 == 0 && left.1 == 0 && left.2 <= before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(left.0, 0, "lock keys left behind");
    assert_eq!(left.1, 0, "subscriptions left behind");
    let after_clients = client_list(&mut admin).await;
    assert!(
        left.2 <= before,
        "client connections grew from {before} to {}:\nbefore:\n{before_clients}\nafter:\n{after_clients}",
        left.2
    );
    assert_eq!(
        backend.subscribed_channels(),
        0,
        "local waiter registrations left behind"
    );
}

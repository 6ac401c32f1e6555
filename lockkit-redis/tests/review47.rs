//! Review 47 (helper-47): a second look at helper-45's fixes of the Redis command line.

use std::time::{Duration, Instant};

use lockkit_conformance::{FaultProxy, SilencedLinks, env};
use lockkit_core::{LockKey, Locker};
use lockkit_redis::RedisBackend;
use uuid::Uuid;

/// An acquisition whose request reached the server but whose answer did not come in time
/// is given back by its attempt id. When that give-back goes out on a line that is then
/// given up as silent, the line's abort (0912f36) drops it; the hold the acquisition took
/// must still be given back (on another line), not kept for its whole lease by nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_on_a_line_given_up_as_silent_is_sent_again() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let upstream = url
        .trim_start_matches("redis://")
        .split(['/', '?'])
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let via_proxy = format!(
        "redis://{}?keepalive=2s&response_timeout=500ms&connect_timeout=500ms",
        proxy.local_addr()
    );
    let client = Locker::new(RedisBackend::connect(&via_proxy).await.unwrap());
    let observer = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let key = LockKey::new(format!("review47/{}", Uuid::new_v4().simple())).unwrap();
    // The scripts are loaded, the line is open.
    client
        .acquire(format!("review47/{}", Uuid::new_v4().simple()))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    client.inspect(&key).await.unwrap();
    // The acquisition reaches the proxy (and, 1.5 s later, the server); then everything
    // the client sends on that line is dropped: the give-back of the unanswered attempt.
    proxy.set_delay(Duration::from_millis(1_500));
    let acquiring = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move { client.try_acquire(&key).ttl(Duration::from_secs(60)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let Some(silenced) = SilencedLinks::to_port(proxy.local_addr().port()) else {
        return;
    };
    let tried = acquiring.await.unwrap();
    assert!(
        matches!(&tried, Err(e) if e.is_retryable()),
        "{:?}",
        tried.map(|g| g.map(|g| g.token()))
    );
    proxy.set_delay(Duration::ZERO);
    // The acquisition lands on the server.
    let started = Instant::now();
    while observer.inspect(&key).await.unwrap().is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the acquisition never landed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Until the silent line is given up (a new line answers).
    let started = Instant::now();
    while client.inspect(&key).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "never given up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let given_up = Instant::now();
    while given_up.elapsed() < Duration::from_secs(10) {
        if observer.inspect(&key).await.unwrap().is_none() {
            drop(silenced);
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let holder = observer.inspect(&key).await.unwrap();
    drop(silenced);
    panic!(
        "the hold of the unanswered acquisition is still there 10 s after its line was given \
         up (its give-back went down with the line): {holder:?}"
    );
}

//! Review 45 (helper-45): a second look at the fixes of review 44 and the session before.

use std::time::{Duration, Instant};

use lockkit_conformance::{FaultProxy, SilencedLinks, env};
use lockkit_core::{LockKey, Locker};
use lockkit_redis::RedisBackend;
use uuid::Uuid;

fn key() -> LockKey {
    LockKey::new(format!("review45/{}", Uuid::new_v4().simple())).unwrap()
}

/// The shared server's URL, a proxy to it, and a URL through the proxy with a 2 s
/// keepalive.
async fn through_a_proxy() -> Option<(String, FaultProxy, String)> {
    let url = env::service_url("LOCKKIT_TEST_REDIS_URL")?;
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
    Some((url, proxy, via_proxy))
}

/// A command line given up as silent (nothing heard for the keepalive while the kernel
/// retransmits) takes the requests still on it with it: once the caller was told its
/// acquisition failed and the line was replaced, that acquisition must not land on the
/// server when the link comes back, as a hold nobody knows of (here for its whole 60 s
/// lease), nor run out of order behind requests sent later on the new line.
///
/// Finding 1 (helper-45): the line was only shut down (`shutdown(Both)`, a FIN queued behind
/// the data) and closed gracefully, so its kernel went on retransmitting the unacknowledged
/// requests, as an orphan socket, for minutes; before 6f7ac31 the line's user timeout
/// aborted it and dropped them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_a_line_given_up_as_silent_does_not_land_later() {
    let Some((url, proxy, via_proxy)) = through_a_proxy().await else {
        return;
    };
    let client = Locker::new(RedisBackend::connect(&via_proxy).await.unwrap());
    let observer = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let key = key();
    // The scripts used below are loaded (an `EVALSHA` the server does not know fails
    // there, whatever the line).
    client
        .acquire(self::key())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    client.inspect(&key).await.unwrap();
    let Some(silenced) = SilencedLinks::to_port(proxy.local_addr().port()) else {
        return;
    };
    let silenced_at = Instant::now();
    let tried = client.try_acquire(&key).ttl(Duration::from_secs(60)).await;
    assert!(
        matches!(&tried, Err(e) if e.is_retryable()),
        "{:?}",
        tried.map(|g| g.map(|g| g.token()))
    );
    // Until the line is given up and a new one answers.
    loop {
        match client.inspect(&key).await {
            Ok(None) => break,
            Ok(Some(holder)) => panic!("held on the new line: {holder:?}"),
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                assert!(
                    silenced_at.elapsed() < Duration::from_secs(40),
                    "still failing after {:?}: {e}",
                    silenced_at.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let given_up_after = silenced_at.elapsed();
    drop(silenced);
    let healed_at = Instant::now();
    while healed_at.elapsed() < Duration::from_secs(20) {
        if let Some(holder) = observer.inspect(&key).await.unwrap() {
            panic!(
                "the acquisition given up with its line {given_up_after:?} after the silence \
                 landed {:?} after the link came back: a hold nobody knows of, {:?} left: \
                 {holder:?}",
                healed_at.elapsed(),
                holder.ttl_left
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

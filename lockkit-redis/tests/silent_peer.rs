//! A connection whose peer goes silent at the TCP level (a NAT or load balancer that forgot
//! it, a host gone: nothing acknowledged, nothing sent back) is given up after about the
//! URL's `keepalive` and replaced (helper-41's finding). Before, an idle subscriber never
//! noticed, so a waiter heard no release and woke only at the holder's lease end; and a
//! command line failed every request by its response timeout until the kernel gave up
//! retransmitting, about 15 minutes.

use std::time::{Duration, Instant};

use lockkit_conformance::{FaultProxy, SilencedLinks, env};
use lockkit_core::{LockKey, Locker};
use lockkit_redis::RedisBackend;
use uuid::Uuid;

fn key() -> LockKey {
    LockKey::new(format!("silent/{}", Uuid::new_v4().simple())).unwrap()
}

/// The shared server's URL, a proxy to it, and a URL through the proxy with a 3 s
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
        "redis://{}?keepalive=3s&response_timeout=500ms&connect_timeout=500ms",
        proxy.local_addr()
    );
    Some((url, proxy, via_proxy))
}

/// A waiter whose links went silent while it waited still hears the release soon after it
/// (its links are replaced within the keepalive), not at the holder's lease end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_links_went_silent_hears_the_release() {
    let Some((url, proxy, via_proxy)) = through_a_proxy().await else {
        return;
    };
    let waiting_client = Locker::new(RedisBackend::connect(&via_proxy).await.unwrap());
    let holding_client = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let key = key();
    // A lease far past the test: only a release can wake the waiter in time.
    let held = holding_client
        .acquire(&key)
        .ttl(Duration::from_secs(120))
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let granted = waiting_client
                .acquire(&key)
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(90))
                .await;
            (granted.map(|g| g.token()), Instant::now())
        }
    });
    // The waiter has asked, found the key held and subscribed: both its lines are open.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let Some(silenced) = SilencedLinks::to_port(proxy.local_addr().port()) else {
        return;
    };
    assert!(
        silenced.client_ports.len() >= 2,
        "the command line and the subscriber: {:?}",
        silenced.client_ports
    );
    // Past the keepalive's probes (3 s: idle 1 s, then 3 probes 1 s apart) with margin.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let released_at = Instant::now();
    held.release().await.unwrap();
    let (granted, at) = tokio::time::timeout(Duration::from_secs(60), waiter)
        .await
        .expect("the waiter never heard the release (nor its deadline)")
        .unwrap();
    granted.expect("granted after the release");
    let after = at.saturating_duration_since(released_at);
    assert!(
        after < Duration::from_secs(20),
        "granted {after:?} after the release: the silent subscriber was never replaced"
    );
    drop(silenced);
}

/// Requests on a command line gone silent fail by their response timeout until the line is
/// given up (nothing heard for `keepalive` while the kernel retransmits), then go through on
/// a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_on_a_silent_line_go_through_again_within_the_keepalive() {
    let Some((_, proxy, via_proxy)) = through_a_proxy().await else {
        return;
    };
    let client = Locker::new(RedisBackend::connect(&via_proxy).await.unwrap());
    let key = key();
    client.inspect(&key).await.unwrap();
    let Some(silenced) = SilencedLinks::to_port(proxy.local_addr().port()) else {
        return;
    };
    let silenced_at = Instant::now();
    let answered = loop {
        match client.inspect(&key).await {
            Ok(_) => break silenced_at.elapsed(),
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
    };
    // The first request after the silence cannot have been answered on the old line.
    assert!(answered >= Duration::from_millis(400), "{answered:?}");
    drop(silenced);
}

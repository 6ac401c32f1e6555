//! Redlock under failures: masters down, partial grants, slow rounds, token monotonicity.
//! Each client reaches each master through its own fault proxy, so "down" and "slow" are
//! per client and the shared servers are never disturbed.

use std::{net::SocketAddr, time::Duration};

use lockkit_conformance::{FaultProxy, env};
use lockkit_core::{LockKey, Locker};
use lockkit_redis::{LockNames, RedlockBackend};
use redis::AsyncCommands;
use uuid::Uuid;

struct Client {
    locker: Locker,
    proxies: Vec<FaultProxy>,
}

fn masters() -> Option<Vec<String>> {
    env::service_url("LOCKKIT_TEST_REDLOCK_URL").map(|url| env::host_ports(&url))
}

async fn client(masters: &[String], options: &str) -> Client {
    let mut proxies = Vec::new();
    for master in masters {
        proxies.push(
            FaultProxy::start(master.parse::<SocketAddr>().unwrap())
                .await
                .unwrap(),
        );
    }
    let hosts: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
    let url = format!("redlock://{}{options}", hosts.join(","));
    Client {
        locker: Locker::new(RedlockBackend::connect(&url).await.unwrap()),
        proxies,
    }
}

fn key() -> LockKey {
    LockKey::new(format!("redlock-test/{}", Uuid::new_v4().simple())).unwrap()
}

async fn admin(master: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://{master}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// How many masters hold a lock hash for `key`.
async fn holders(masters: &[String], key: &LockKey) -> usize {
    let name = LockNames::new("", key, false).unwrap().lock;
    let mut n = 0;
    for master in masters {
        let exists: bool = admin(master).await.exists(&name).await.unwrap();
        n += usize::from(exists);
    }
    n
}

#[tokio::test]
async fn acquires_with_two_of_five_masters_down() {
    let Some(masters) = masters() else { return };
    let c = client(&masters, "").await;
    c.proxies[0].reset();
    c.proxies[1].reset();
    let key = key();
    let guard = c
        .locker
        .try_acquire(&key)
        .await
        .unwrap()
        .expect("3 of 5 masters are a quorum");
    assert_eq!(holders(&masters, &key).await, 3);
    guard.release().await.unwrap();
    assert_eq!(holders(&masters, &key).await, 0);
}

#[tokio::test]
async fn refuses_with_three_of_five_down_naming_the_quorum() {
    let Some(masters) = masters() else { return };
    let c = client(&masters, "").await;
    for proxy in &c.proxies[..3] {
        proxy.reset();
    }
    let key = key();
    let err = c.locker.try_acquire(&key).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(err.to_string().contains("quorum of 3"), "{err}");
    assert_eq!(holders(&masters, &key).await, 0, "nothing may stay behind");
}

#[tokio::test]
async fn a_partial_acquisition_is_rolled_back_on_every_master() {
    let Some(masters) = masters() else { return };
    let c = client(&masters, "").await;
    let key = key();
    let name = LockNames::new("", &key, false).unwrap().lock;
    // A rival holds a majority (masters 0..3); we can win at most masters 3 and 4.
    for master in &masters[..3] {
        let _: () = admin(master)
            .await
            .set_ex(&name, "rival", 30)
            .await
            .unwrap();
    }
    assert!(c.locker.try_acquire(&key).await.unwrap().is_none());
    for master in &masters[3..] {
        let exists: bool = admin(master).await.exists(&name).await.unwrap();
        assert!(!exists, "{master} kept a minority grant");
    }
    for master in &masters[..3] {
        let value: String = admin(master).await.get(&name).await.unwrap();
        assert_eq!(value, "rival", "the rival's hold must be untouched");
        let _: () = admin(master).await.del(&name).await.unwrap();
    }
}

#[tokio::test]
async fn a_slow_acquisition_is_refused_and_given_back() {
    let Some(masters) = masters() else { return };
    // Let each master take long, and delay every answer past the lease.
    let c = client(&masters, "?node_timeout=2s").await;
    for proxy in &c.proxies {
        proxy.set_delay(Duration::from_millis(150));
    }
    let key = key();
    let err = c
        .locker
        .try_acquire(&key)
        .ttl(Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("took"), "{err}");
    for proxy in &c.proxies {
        proxy.set_delay(Duration::ZERO);
    }
    // The give-back went through the same slow proxies; give it a moment to land.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        holders(&masters, &key).await,
        0,
        "a refused grant must be given back everywhere"
    );
}

#[tokio::test]
async fn tokens_stay_monotonic_across_different_quorums() {
    let Some(masters) = masters() else { return };
    let key = key();
    // First holder sees masters 2,3,4; the second sees 0,1,2: only master 2 is shared.
    let first = client(&masters, "").await;
    first.proxies[0].reset();
    first.proxies[1].reset();
    let mut last = 0;
    for _ in 0..3 {
        let guard = first.locker.try_acquire(&key).await.unwrap().unwrap();
        last = guard.token().get();
        guard.release().await.unwrap();
    }
    let second = client(&masters, "").await;
    second.proxies[3].reset();
    second.proxies[4].reset();
    let guard = second.locker.try_acquire(&key).await.unwrap().unwrap();
    assert!(
        guard.token().get() > last,
        "token {} after {last}",
        guard.token()
    );
    guard.release().await.unwrap();
}

#[tokio::test]
async fn contenders_on_different_master_subsets_never_overlap() {
    let Some(masters) = masters() else { return };
    let key = key();
    let history = lockkit_conformance::History::new();
    let mut tasks = Vec::new();
    for i in 0..4 {
        let c = client(&masters, "").await;
        // Each contender misses a different master.
        c.proxies[i].reset();
        let (key, history) = (key.clone(), history.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let guard = c
                    .locker
                    .acquire(&key)
                    .wait(Duration::from_secs(30))
                    .await
                    .unwrap();
                let open = history.begin(format!("client {i}"), &guard);
                tokio::task::yield_now().await;
                history.end(open, &guard);
                guard.release().await.unwrap();
            }
            drop(c.proxies);
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(history.records().len(), 20);
    history.assert_linear();
}

#[tokio::test]
async fn a_master_down_at_connect_counts_once_it_is_back() {
    let Some(masters) = masters() else { return };
    let mut proxies = Vec::new();
    for master in &masters {
        proxies.push(
            FaultProxy::start(master.parse::<SocketAddr>().unwrap())
                .await
                .unwrap(),
        );
    }
    // Masters 0 and 1 are down while the client connects (3 of 5: enough to start).
    proxies[0].reset();
    proxies[1].reset();
    let hosts: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
    let locker = Locker::new(
        RedlockBackend::connect(&format!("redlock://{}", hosts.join(",")))
            .await
            .unwrap(),
    );
    // They come back, and two others go down: only the returned ones make a quorum.
    proxies[0].heal();
    proxies[1].heal();
    proxies[3].reset();
    proxies[4].reset();
    let key = key();
    let guard = locker
        .acquire(&key)
        .wait(Duration::from_secs(10))
        .await
        .expect("masters 0, 1, 2 are a quorum once 0 and 1 are back");
    assert_eq!(holders(&masters[..3], &key).await, 3);
    guard.release().await.unwrap();
    assert_eq!(holders(&masters, &key).await, 0);
}

/// A re-entry on a quorum that still has the owner's hold keeps the hold's token, even when
/// the hold had lapsed on the other masters (they grant afresh there, with a higher
/// counter): nested holds keep their token (found by the randomized test under chaos).
#[tokio::test]
async fn a_reentry_on_a_quorum_keeps_the_token_where_minority_masters_lapsed() {
    let Some(masters) = masters() else {
        return;
    };
    let c = client(&masters, "").await;
    let key = key();
    let owner = c.locker.owner();
    let outer = owner
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    // The hold lapses on two of five masters.
    let name = LockNames::new("", &key, false).unwrap().lock;
    for master in &masters[..2] {
        let _: () = admin(master).await.del(&name).await.unwrap();
    }
    let inner = owner
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(inner.depth(), 2);
    assert_eq!(
        inner.token(),
        outer.token(),
        "a re-entry on the quorum that holds the key changed its token"
    );
    inner.release().await.unwrap();
    outer.release().await.unwrap();
}

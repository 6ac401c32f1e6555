//! helper-58's review of 757e431 and fd05a55 (a master marked "last request failed" is
//! waited for while the answers in hand are short of a quorum the answers still out could
//! complete): where the answers in hand decide that no quorum renews or grants, the marked
//! master's answer can still decide *what* the outcome is (not held, busy, refused), and
//! not waiting for it turns those into a retryable "too few masters answered".
//!
//! Each test: masters 3 and 4 of five are down, a hold sits on masters 0, 1 and 2, and
//! master 2 is marked by one failed request (its link cut), then answers again, 20 ms each
//! way (well within the 100 ms per-master timeout of a 10 s lease). The operation under
//! test comes well within the 200 ms before the background PING can clear the mark.

use std::time::{Duration, Instant};

use lockkit_conformance::{FaultProxy, ProxiedClients, env};
use lockkit_core::LockBackend;
use lockkit_core::spi::{AcquireRequest, Grant};
use lockkit_core::{Error, LockKey, LockKind, Locker, LossSignal, OwnerId};
use lockkit_redis::{LockNames, RedlockBackend};
use redis::AsyncCommands;
use uuid::Uuid;

fn masters() -> Option<Vec<String>> {
    env::service_url("LOCKKIT_TEST_REDLOCK_URL").map(|url| env::host_ports(&url))
}

fn key() -> LockKey {
    LockKey::new(format!("review58/{}", Uuid::new_v4().simple())).unwrap()
}

async fn client(masters: &[String]) -> (Vec<FaultProxy>, Locker) {
    let (proxies, hosts) = ProxiedClients::<RedlockBackend>::start_proxies(masters).await;
    let locker = Locker::new(
        RedlockBackend::connect(&format!("redlock://{hosts}"))
            .await
            .unwrap(),
    );
    (proxies, locker)
}

const TTL: Duration = Duration::from_secs(10);

/// Marks master 2: its link is cut for one renewal of `grant` (which fails there), then it
/// answers again, 20 ms each way. Returns when the mark was set.
async fn mark_master_2(
    proxies: &[FaultProxy],
    backend: &dyn LockBackend,
    grant: &Grant,
) -> Instant {
    proxies[2].cut();
    let _ = backend.renew(grant, TTL).await;
    let failed_at = Instant::now();
    proxies[2].set_delay(Duration::from_millis(20));
    proxies[2].heal();
    failed_at
}

fn conclusive(failed_at: Instant) {
    let after = failed_at.elapsed();
    assert!(
        after < Duration::from_millis(150),
        "inconclusive: the operation ended {after:?} after master 2 failed, when its mark may \
         have been cleared"
    );
}

/// Masters 0, 1 and 2 answer that the hold is not theirs (its key was deleted there, as a
/// restart without persistence would) and 3 and 4 are down: no quorum can hold it, and a
/// renewal says `NotHeld` (the watchdog then reports the loss at once). With master 2
/// marked, a renewal that stops once 0 and 1 answered counts 2 refusals and 3 failures and
/// says "only 0 masters renewed" (retryable): the guard stays valid for the rest of its
/// lease while another owner can take the key on 0, 1 and 2.
#[tokio::test]
async fn a_renewal_that_no_quorum_can_hold_is_not_held_while_one_of_its_masters_is_marked() {
    let Some(masters) = masters() else { return };
    assert_eq!(masters.len(), 5, "five masters");
    let (proxies, locker) = client(&masters).await;
    let backend = locker.backend();
    proxies[3].reset();
    proxies[4].reset();
    let key = key();
    let request = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    let grant = backend
        .try_acquire(&request)
        .await
        .unwrap()
        .expect("masters 0, 1 and 2 are a quorum");
    let name = LockNames::new("", &key, false).unwrap().lock;
    for master in &masters[..3] {
        let mut admin = redis::Client::open(format!("redis://{master}"))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: i64 = admin.del(&name).await.unwrap();
    }
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    let renewed = backend.renew(&grant, TTL).await;
    conclusive(failed_at);
    proxies[2].set_delay(Duration::ZERO);
    // The same renewal once the mark is cleared: the answer the masters give.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let unmarked = backend.renew(&grant, TTL).await;
    assert!(
        matches!(unmarked, Err(Error::NotHeld { .. })),
        "control: with master 2 unmarked the renewal said {unmarked:?}"
    );
    assert!(
        matches!(renewed, Err(Error::NotHeld { .. })),
        "masters 0, 1 and 2 answer (master 2 in 20 ms) that the hold is not theirs and 3 and \
         4 are down, yet the renewal with master 2 marked said: {renewed:?}"
    );
}

/// A key held by another owner on masters 0, 1 and 2 (3 and 4 down) is busy: `try_acquire`
/// answers `Ok(None)`. With master 2 marked, a round that stops once 0 and 1 answered busy
/// counts master 2 as failed, three of five, and answers a retryable error.
#[tokio::test]
async fn a_busy_key_is_busy_while_one_of_its_holders_masters_is_marked() {
    let Some(masters) = masters() else { return };
    assert_eq!(masters.len(), 5, "five masters");
    let (proxies, locker) = client(&masters).await;
    let backend = locker.backend();
    proxies[3].reset();
    proxies[4].reset();
    let key = key();
    let holder = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    let grant = backend
        .try_acquire(&holder)
        .await
        .unwrap()
        .expect("masters 0, 1 and 2 are a quorum");
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    let other = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    let tried = backend.try_acquire(&other).await;
    conclusive(failed_at);
    proxies[2].set_delay(Duration::ZERO);
    assert!(
        matches!(tried, Ok(None)),
        "masters 0, 1 and 2 answer (master 2 in 20 ms) that another owner holds the key, yet \
         try_acquire with master 2 marked said: {:?}",
        tried.map(|g| g.map(|g| g.token))
    );
    let _ = backend.release(&grant).await;
}

/// An owner holding a read lock on masters 0, 1 and 2 (3 and 4 down) that asks to write is
/// refused (`WouldDeadlock`) by all three: a quorum refuses, so the round says so. With
/// master 2 marked, a round that stops once 0 and 1 refused counts two refusals and three
/// failures and answers a retryable error (an `acquire` would wait on an upgrade that can
/// never be granted for as long as the mark lasts).
#[tokio::test]
async fn an_upgrade_is_refused_while_one_of_the_read_holds_masters_is_marked() {
    let Some(masters) = masters() else { return };
    assert_eq!(masters.len(), 5, "five masters");
    let (proxies, locker) = client(&masters).await;
    let backend = locker.backend();
    proxies[3].reset();
    proxies[4].reset();
    let (key, owner) = (key(), OwnerId::random());
    let read =
        AcquireRequest::new(key.clone(), owner, TTL, LossSignal::new()).with_kind(LockKind::Read);
    let grant = backend
        .try_acquire(&read)
        .await
        .unwrap()
        .expect("masters 0, 1 and 2 are a quorum");
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    let write =
        AcquireRequest::new(key.clone(), owner, TTL, LossSignal::new()).with_kind(LockKind::Write);
    let tried = backend.try_acquire(&write).await;
    conclusive(failed_at);
    proxies[2].set_delay(Duration::ZERO);
    assert!(
        matches!(tried, Err(Error::WouldDeadlock { .. })),
        "masters 0, 1 and 2 answer (master 2 in 20 ms) that this owner reads the key, yet \
         its upgrade with master 2 marked said: {:?}",
        tried.map(|g| g.map(|g| g.token))
    );
    let _ = backend.release(&grant).await;
}

/// The cost side of the rules above: with one master of five frozen (and marked once a
/// request to it failed), rounds that find the key busy on the other four and renewals the
/// other four renew are decided without it, so they do not wait the per-master timeout
/// (100 ms for a 10 s lease) for it: ten of each take well under the 2 s they would cost
/// waiting for it.
#[tokio::test]
async fn a_frozen_master_costs_busy_rounds_and_renewals_nothing_once_it_failed() {
    let Some(masters) = masters() else { return };
    assert_eq!(masters.len(), 5, "five masters");
    let (proxies, locker) = client(&masters).await;
    let backend = locker.backend();
    proxies[1].cut();
    let key = key();
    let holder = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    // The first request to master 1 waits for it, and fails: marked.
    let grant = backend
        .try_acquire(&holder)
        .await
        .unwrap()
        .expect("masters 0, 2, 3 and 4 are a quorum");
    let started = Instant::now();
    for _ in 0..10 {
        let other = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
        let tried = backend.try_acquire(&other).await;
        assert!(
            matches!(tried, Ok(None)),
            "busy on four masters: {:?}",
            tried.map(|g| g.map(|g| g.token))
        );
        backend
            .renew(&grant, TTL)
            .await
            .expect("four masters renew");
    }
    let took = started.elapsed();
    proxies[1].heal();
    let _ = backend.release(&grant).await;
    assert!(
        took < Duration::from_secs(1),
        "ten busy rounds and ten renewals with one master frozen took {took:?}"
    );
}

/// A health check (`ping`) and an inspection ask every master and need a quorum of answers.
/// With masters 3 and 4 down and master 2 marked while it answers (20 ms), masters 0, 1 and
/// 2 are a quorum that answers; not waiting for master 2 once 0 and 1 answered said "only
/// 2 masters answered PING" (and "only 2 masters answered" to an inspection) while the mark
/// lasted.
#[tokio::test]
async fn a_ping_and_an_inspection_count_a_marked_master_that_answers() {
    let Some(masters) = masters() else { return };
    assert_eq!(masters.len(), 5, "five masters");
    let (proxies, locker) = client(&masters).await;
    let backend = locker.backend();
    proxies[3].reset();
    proxies[4].reset();
    let key = key();
    let request = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    let grant = backend
        .try_acquire(&request)
        .await
        .unwrap()
        .expect("masters 0, 1 and 2 are a quorum");
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    let pinged = backend.ping().await;
    conclusive(failed_at);
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    let inspected = backend.inspect(&key).await;
    conclusive(failed_at);
    assert!(
        pinged.is_ok(),
        "masters 0, 1 and 2 answer (master 2 in 20 ms), yet with master 2 marked the health \
         check said: {pinged:?}"
    );
    assert!(
        inspected.is_ok(),
        "masters 0, 1 and 2 answer (master 2 in 20 ms), yet with master 2 marked the \
         inspection said: {inspected:?}"
    );
}

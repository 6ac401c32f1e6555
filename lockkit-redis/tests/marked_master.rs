//! A Redlock master marked "last request failed" (see `Master::revive_later`) while it
//! answers, in the state where its answer matters: masters 3 and 4 of five are down, so
//! masters 0, 1 and 2 are a bare quorum and every call needs master 2. A marked master is
//! asked but not waited for only when the answers in hand decide the call's outcome
//! whatever it answers. From helper-57's review (renewals and acquisitions short of a
//! quorum without it) and helper-58's (outcomes it could still change: not held, busy,
//! refused), and the health check and inspection after them.
//!
//! Master 2 is marked by one failed request (its link cut), then answers again, 5-12 ms
//! each way (well within the 100 ms per-master timeout of a lease of seconds). An operation
//! under test comes well within the 200 ms before the background PING can clear the mark,
//! or the test says it is inconclusive; or short rounds of a 100 ms lease (a 10 ms
//! per-master timeout) keep failing there and keep it marked.

use std::time::{Duration, Instant};

use lockkit_conformance::{FaultProxy, ProxiedClients, env};
use lockkit_core::LockBackend;
use lockkit_core::spi::{AcquireRequest, Grant};
use lockkit_core::{Error, LockKey, LockKind, Locker, LossSignal, OwnerId};
use lockkit_redis::{LockNames, RedisBackend, RedlockBackend};
use redis::AsyncCommands;
use uuid::Uuid;

fn masters() -> Option<Vec<String>> {
    env::service_url("LOCKKIT_TEST_REDLOCK_URL").map(|url| env::host_ports(&url))
}

fn key() -> LockKey {
    LockKey::new(format!("marked-master/{}", Uuid::new_v4().simple())).unwrap()
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

/// A client through proxies with masters 3 and 4 down: masters 0, 1 and 2 are a bare
/// quorum of the five.
async fn bare_quorum(masters: &[String]) -> (Vec<FaultProxy>, Locker) {
    assert_eq!(masters.len(), 5, "five masters");
    let (proxies, locker) = client(masters).await;
    proxies[3].reset();
    proxies[4].reset();
    (proxies, locker)
}

/// Grants `request` on masters 0, 1 and 2 (3 and 4 down, see [`bare_quorum`]).
/// A round that missed a master's 100 ms on a loaded machine (each of the three is needed)
/// gives its grants back and is tried again, five times at most.
async fn on_masters_0_1_2(backend: &dyn LockBackend, request: &AcquireRequest) -> Grant {
    let mut tries = Vec::new();
    for _ in 0..5 {
        match backend.try_acquire(request).await {
            Ok(Some(grant)) => return grant,
            other => tries.push(format!("{:?}", other.map(|g| g.map(|g| g.token)))),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("masters 0, 1 and 2 are a quorum, yet five rounds said: {tries:?}")
}

const TTL: Duration = Duration::from_secs(10);

/// Master 2's delay each way while [`keep_master_2_marked`] runs: a round trip past the
/// 10 ms per-master timeout of a 100 ms lease, so those rounds fail there, and far within
/// the 100 ms of a lease of seconds, also when a loaded CI machine and the proxy's queue of
/// the short rounds' chunks add to it (25 ms each way missed it there now and then).
const SLOWER_THAN_SHORT_ROUNDS: Duration = Duration::from_millis(12);

/// Marks master 2: its link is cut for one renewal of `grant` (which fails there), then it
/// answers again, 5 ms each way: after masters 0 and 1, and well within the 100 ms
/// per-master timeout also on a loaded CI machine (20 ms each way once missed it there).
/// Returns when the mark was set.
async fn mark_master_2(
    proxies: &[FaultProxy],
    backend: &dyn LockBackend,
    grant: &Grant,
) -> Instant {
    proxies[2].cut();
    let _ = backend.renew(grant, TTL).await;
    let failed_at = Instant::now();
    proxies[2].set_delay(Duration::from_millis(5));
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

/// A connection straight to `master`, not through a proxy.
async fn admin(master: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://{master}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Deletes `key`'s lock on `masters` (asked directly, not through a proxy), as a restart
/// without persistence would.
async fn forget_on(masters: &[String], key: &LockKey) {
    let name = LockNames::new("", key, false).unwrap().lock;
    for master in masters {
        let mut admin = admin(master).await;
        let _: i64 = admin.del(&name).await.unwrap();
    }
}

/// The lease left of `key`'s hold on each master (asked directly, not through a proxy);
/// `None` where it is not held.
async fn leases(masters: &[String], key: &LockKey) -> Vec<Option<Duration>> {
    let name = LockNames::new("", key, false).unwrap().lock;
    let mut leases = Vec::new();
    for master in masters {
        let mut admin = admin(master).await;
        let left: i64 = admin.pttl(&name).await.unwrap();
        leases.push(u64::try_from(left).ok().map(Duration::from_millis));
    }
    leases
}

/// Takes locks of a 100 ms lease (a 10 ms per-master timeout) on fresh keys every 5 ms
/// until `stop`: with master 2 [`SLOWER_THAN_SHORT_ROUNDS`] each way, each round fails there
/// and keeps it marked.
/// Answers how many rounds it made.
fn keep_master_2_marked(
    locker: &Locker,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<u32> {
    let (locker, stop) = (locker.clone(), stop.clone());
    tokio::spawn(async move {
        let mut rounds = 0_u32;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = locker
                .try_acquire(key())
                .ttl(Duration::from_millis(100))
                .await;
            rounds += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        rounds
    })
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
    let (proxies, locker) = bare_quorum(&masters).await;
    let backend = locker.backend();
    let key = key();
    let request = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    let grant = on_masters_0_1_2(backend.as_ref(), &request).await;
    forget_on(&masters[..3], &key).await;
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
    let (proxies, locker) = bare_quorum(&masters).await;
    let backend = locker.backend();
    let key = key();
    let holder = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    let grant = on_masters_0_1_2(backend.as_ref(), &holder).await;
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
    let (proxies, locker) = bare_quorum(&masters).await;
    let backend = locker.backend();
    let (key, owner) = (key(), OwnerId::random());
    let read =
        AcquireRequest::new(key.clone(), owner, TTL, LossSignal::new()).with_kind(LockKind::Read);
    let grant = on_masters_0_1_2(backend.as_ref(), &read).await;
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
    let (proxies, locker) = bare_quorum(&masters).await;
    let backend = locker.backend();
    let key = key();
    let request = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    let grant = on_masters_0_1_2(backend.as_ref(), &request).await;
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    let pinged = backend.ping().await;
    conclusive(failed_at);
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    conclusive(failed_at);
    let inspected = backend.inspect(&key).await;
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

/// A hold granted on exactly a quorum (masters 0, 1, 2 of five; 3 and 4 stay down) is
/// renewed while master 2 is marked "last request failed" but answers (20 ms each way, well
/// within the 100 ms per-master timeout of a 10 s lease): its one failed request was a
/// renewal while its link was stalled, and the renewal right after the link healed comes
/// well within the 200 ms before its background PING can clear the mark. Masters 0, 1 and
/// 2 hold the key throughout and all three renew it, so the renewal must succeed. Without
/// waiting for master 2 while the renewals in hand are short of a quorum, only 0 and 1
/// count and the renewal fails (retryably), as long as the mark lasts.
#[tokio::test]
async fn a_renewal_waits_for_a_marked_master_while_the_answers_in_hand_are_short_of_a_quorum() {
    let Some(masters) = masters() else { return };
    let (proxies, locker) = bare_quorum(&masters).await;
    let backend = locker.backend();
    let ttl = Duration::from_secs(10);
    let request = AcquireRequest::new(key(), OwnerId::random(), ttl, LossSignal::new());
    let grant = on_masters_0_1_2(backend.as_ref(), &request).await;
    // Masters 3 and 4 failed once already (at the acquisition): marked, and down.
    backend.renew(&grant, ttl).await.expect("0, 1, 2 renew");

    // Master 2's link stalls for one renewal (which fails there), then heals, a little slow.
    proxies[2].cut();
    let stalled = backend.renew(&grant, ttl).await;
    assert!(
        matches!(&stalled, Err(e) if e.is_retryable()),
        "two of five renewed: {stalled:?}"
    );
    let failed_at = Instant::now();
    proxies[2].set_delay(Duration::from_millis(20));
    proxies[2].heal();
    let renewed = backend.renew(&grant, ttl).await;
    let after = failed_at.elapsed();
    proxies[2].set_delay(Duration::ZERO);
    assert!(
        after < Duration::from_millis(150),
        "inconclusive: the renewal ended {after:?} after master 2 failed, when its mark may \
         have been cleared"
    );
    assert!(
        renewed.is_ok(),
        "masters 0, 1 and 2 hold the key and answer (master 2 in 20 ms), yet the renewal \
         {after:?} after master 2's one failure said: {renewed:?}"
    );
    let _ = backend.release(&grant).await;
}

/// The watchdog's view of the same state, kept up: a hold of a 3 s lease granted on masters
/// 0, 1, 2 (3 and 4 stay down) while the same backend also takes locks of a 100 ms lease
/// elsewhere. Master 2's proxy delays each way by 12 ms: within the 100 ms per-master
/// timeout of the long lease, past the 10 ms one of the short leases, whose rounds
/// therefore fail there and keep master 2 marked (each mark cleared by a PING 200 ms later,
/// and set again by the next short round). Masters 0, 1 and 2 hold the long hold and renew
/// it throughout, yet a renewal that does not wait for a marked master counts only two, and
/// the watchdog fires the lost signal (`LeaseExpired`) once its retries have all met the
/// mark, while the three masters still hold the key with nearly 3 s of lease left. Fails
/// 5/5 without this review's renewal fix (lost after 3 or 6 s), passes with it.
#[tokio::test]
async fn a_hold_on_a_bare_quorum_is_not_lost_while_one_of_its_masters_is_kept_marked() {
    let Some(masters) = masters() else { return };
    let (proxies, locker) = bare_quorum(&masters).await;
    let held = key();
    let guard = locker
        .try_acquire(&held)
        .ttl(Duration::from_secs(3))
        .await
        .unwrap()
        .expect("masters 0, 1 and 2 are a quorum");
    proxies[2].set_delay(SLOWER_THAN_SHORT_ROUNDS);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let short_rounds = keep_master_2_marked(&locker, &stop);
    let watched = Duration::from_secs(10);
    let lost = tokio::time::timeout(watched, guard.lost()).await;
    let held_by = leases(&masters, &held).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = short_rounds.await.unwrap();
    proxies[2].set_delay(Duration::ZERO);
    assert!(
        lost.is_err(),
        "masters 0, 1 and 2 held and answered throughout ({rounds} short rounds kept master 2 \
         marked), yet the hold was lost: {lost:?}; the leases left on the masters then: \
         {held_by:?}"
    );
    assert!(guard.is_valid());
    guard.release().await.unwrap();
}

/// Acquisitions in the state of the test above: masters 0, 1, 2 answer (master 2 12 ms each
/// way, within the 100 ms per-master timeout of a 3 s lease), 3 and 4 are down, and master
/// 2 is kept marked "last request failed" by the rounds of a 100 ms lease. A round that does
/// not wait for master 2 once 0 and 1 granted is short of a quorum: with the renewal fix
/// alone (757e431), 28-34 of 33-38 `try_acquire`s failed and an `acquire` waiting 3 s timed
/// out (3 runs of 3); on 6e9f389, before masters were marked, 11 of 11 were granted and the
/// wait was granted in 162 ms.
#[tokio::test]
async fn a_key_whose_quorum_needs_a_marked_master_is_granted_while_it_answers() {
    let Some(masters) = masters() else { return };
    let (proxies, locker) = bare_quorum(&masters).await;
    proxies[2].set_delay(SLOWER_THAN_SHORT_ROUNDS);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let short_rounds = keep_master_2_marked(&locker, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (mut granted, mut failed) = (0, 0);
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        match locker.try_acquire(key()).ttl(Duration::from_secs(3)).await {
            Ok(Some(guard)) => {
                granted += 1;
                let _ = guard.release().await;
            }
            _ => failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = Instant::now();
    let waited = locker
        .acquire(key())
        .ttl(Duration::from_secs(3))
        .wait(Duration::from_secs(3))
        .await;
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    short_rounds.await.unwrap();
    proxies[2].set_delay(Duration::ZERO);
    // Master 2's proxy delays its chunks one after another, so a try that meets a burst of
    // the short rounds there may really miss its 100 ms per-master timeout (1 of 10 did,
    // once in 5 runs beside a build): a quarter may fail. Not waiting for a marked master
    // failed most (28-34 of 33-38).
    assert!(
        waited.is_ok() && failed * 4 <= granted + failed,
        "masters 0, 1 and 2 answer, yet {failed} of {} try_acquires failed, and an acquire \
         waiting 3 s said {:?} after {took:?}",
        granted + failed,
        waited.map(|_| ())
    );
}

/// An inspection's answer depends on which masters list a holder, not only on how many
/// answered (helper-59's review of a72f7f2): all five masters up, the hold on masters 0, 1
/// and 2 only (its key deleted on 3 and 4, as a restart without persistence leaves it),
/// master 2 marked while it answers (20 ms). An inspection that stopped once 0, 1, 3 and 4
/// answered counted the holder listed by 2 and master 2 silent, and said "may be held"
/// (retryable), where master 2's answer makes the holder agreed; `holders` alike.
#[tokio::test]
async fn an_inspection_waits_for_a_marked_master_that_lists_the_holder() {
    let Some(masters) = masters() else { return };
    assert_eq!(masters.len(), 5, "five masters");
    let (proxies, locker) = client(&masters).await;
    let backend = locker.backend();
    let key = key();
    let request = AcquireRequest::new(key.clone(), OwnerId::random(), TTL, LossSignal::new());
    let grant = backend
        .try_acquire(&request)
        .await
        .unwrap()
        .expect("five masters grant");
    forget_on(&masters[3..], &key).await;
    // Each call begins while the mark is set (it reads the marks when it begins; it may
    // then wait for master 2 past the time the mark could be cleared).
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    conclusive(failed_at);
    let inspected = backend.inspect(&key).await;
    let failed_at = mark_master_2(&proxies, backend.as_ref(), &grant).await;
    conclusive(failed_at);
    let holders = backend.holders(&key).await;
    proxies[2].set_delay(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let unmarked = backend.inspect(&key).await;
    let _ = backend.release(&grant).await;
    assert!(
        matches!(&unmarked, Ok(Some(_))),
        "control: with master 2 unmarked the inspection said {unmarked:?}"
    );
    assert!(
        matches!(&inspected, Ok(Some(_))),
        "masters 0, 1 and 2 hold the key and all five answer (master 2 in 20 ms), yet with \
         master 2 marked the inspection said: {inspected:?}"
    );
    assert!(
        matches!(&holders, Ok(list) if list.len() == 1),
        "with master 2 marked, holders said: {holders:?}"
    );
}

/// One owner never holds a key under two tokens (the fresh-clone CI's finding on a6550e6 in
/// `redlock::histories_stay_linear`): another attempt of the owner took the key first on
/// master 2 under a higher token (stood in for by a hold taken on master 2 alone, its
/// counter 10 s ahead), so this owner's round is a re-entry there, answering that token,
/// and fresh grants on masters 0, 1, 3 and 4. With master 2 marked (50 ms each way, within
/// a 1 s per-master timeout), a round that stopped on the quorum of fresh grants kept its
/// own lower token; one that waits for master 2 takes the highest of all.
#[tokio::test]
async fn a_round_that_may_be_granted_waits_for_a_marked_masters_higher_token() {
    let Some(masters) = masters() else { return };
    assert_eq!(masters.len(), 5, "five masters");
    let (proxies, hosts) = ProxiedClients::<RedlockBackend>::start_proxies(&masters).await;
    let backend = RedlockBackend::connect(&format!("redlock://{hosts}?node_timeout=1s"))
        .await
        .unwrap();
    let (key, owner) = (key(), OwnerId::random());
    let mut admin = admin(&masters[2]).await;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let ahead = now.unwrap().as_micros() + 10_000_000;
    let token_name = LockNames::new("", &key, false).unwrap().token;
    let () = admin.set(&token_name, ahead.to_string()).await.unwrap();
    let first = AcquireRequest::new(key.clone(), owner, TTL, LossSignal::new());
    let on_2 = RedisBackend::connect(&format!("redis://{}", masters[2]))
        .await
        .unwrap()
        .try_acquire(&first)
        .await
        .unwrap()
        .expect("master 2 is free");
    let failed_at = mark_master_2(&proxies, &backend, &on_2).await;
    proxies[2].set_delay(Duration::from_millis(50));
    let began = failed_at.elapsed();
    let second = AcquireRequest::new(key.clone(), owner, TTL, LossSignal::new());
    let granted = backend.try_acquire(&second).await;
    proxies[2].set_delay(Duration::ZERO);
    assert!(
        began < Duration::from_millis(150),
        "inconclusive: the round began {began:?} after master 2 failed"
    );
    let granted = granted.unwrap().expect("five masters grant");
    let _ = backend.release(&granted).await;
    assert!(
        granted.token >= on_2.token,
        "owner {owner} holds the key under token {} on master 2, yet its round with master \
         2 marked was granted token {} (depth {}): two tokens for one owner",
        on_2.token,
        granted.token,
        granted.depth
    );
}

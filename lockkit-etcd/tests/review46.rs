//! Review 46 of the etcd backend: a mixed fleet with `etcdctl lock`, an operator's hand on
//! leases and revisions, and callers that go away.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker, LostReason};
use lockkit_etcd::EtcdBackend;
use tokio::time::Instant;

fn unique() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// `etcdctl lock /lockkit/<key> -- sh -c <script>` against `endpoints`.
fn etcdctl_lock(endpoints: &str, key: &LockKey, script: &str) -> Child {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args([
            &format!("--endpoints={endpoints}"),
            "lock",
            &format!("/lockkit/{key}"),
            "--",
            "sh",
            "-c",
            script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl")
}

/// The next line `child` prints, read off the test's runtime.
async fn next_line(child: &mut Child) -> String {
    let stdout = child.stdout.take().unwrap();
    let (line, stdout) = tokio::task::spawn_blocking(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        (line, reader.into_inner())
    })
    .await
    .unwrap();
    child.stdout = Some(stdout);
    line.trim().to_owned()
}

/// A lockkit waiter behind an `etcdctl lock` holder is woken by the holder's release, not
/// by a recheck (twice the session TTL) nor by etcdctl's lease running out (60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_behind_etcdctl_is_woken_at_its_release() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let locker = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let endpoints = env::host_ports(&url).join(",");
    let key = LockKey::new(format!("review46-etcdctl-{}", unique())).unwrap();
    // etcdctl holds, then waits for a line on stdin... it has none: it holds for 3 s.
    let mut etcdctl = etcdctl_lock(&endpoints, &key, "echo held; sleep 3");
    assert_eq!(next_line(&mut etcdctl).await, "held");
    let started = Instant::now();
    let guard = locker
        .acquire(&key)
        .wait(Duration::from_secs(60))
        .await
        .expect("granted once etcdctl let go");
    let waited = started.elapsed();
    let status = tokio::task::spawn_blocking(move || etcdctl.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    assert!(
        waited < Duration::from_secs(6),
        "woken {waited:?} after etcdctl took the lock for 3 s"
    );
    guard.release().await.unwrap();
}

/// lockkit holder, then an etcdctl waiter, then a lockkit waiter: the lockkit waiter is
/// woken when etcdctl (its predecessor) lets go, never granted beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockkit_and_etcdctl_interleave_in_queue_order() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let first = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let third = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let endpoints = env::host_ports(&url).join(",");
    let key = LockKey::new(format!("review46-chain-{}", unique())).unwrap();
    let guard = first.acquire(&key).await.unwrap();
    let mut etcdctl = etcdctl_lock(
        &endpoints,
        &key,
        "echo \"held $ETCD_LOCK_REV $ETCD_LOCK_KEY\"; sleep 2",
    );
    // etcdctl queues behind the lockkit holder.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let waiter = {
        let (third, key) = (third.clone(), key.clone());
        tokio::spawn(async move {
            let guard = third
                .acquire(&key)
                .wait(Duration::from_secs(60))
                .await
                .unwrap();
            (guard, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiter.is_finished(),
        "the third was granted beside the first"
    );
    guard.release().await.unwrap();
    let line = next_line(&mut etcdctl).await;
    let etcdctl_held = Instant::now();
    let (header_revision, etcdctl_key) = line
        .strip_prefix("held ")
        .and_then(|rest| rest.split_once(' '))
        .unwrap();
    let header_revision: u64 = header_revision.parse().unwrap();
    let got = EtcdBackend::connect(&url)
        .await
        .unwrap()
        .client()
        .get(etcdctl_key, None)
        .await
        .unwrap();
    let revision = u64::try_from(got.kvs()[0].create_revision()).unwrap();
    assert!(
        !waiter.is_finished(),
        "the third was granted beside etcdctl"
    );
    let (guard, granted) = waiter.await.unwrap();
    let waited = granted - etcdctl_held;
    assert!(guard.token().get() > revision);
    // etcdctl's $ETCD_LOCK_REV is the revision it saw the lock free at, not its key's
    // create revision: a lockkit waiter queued before then may have a lower token (the
    // README says so).
    assert!(header_revision >= revision);
    assert!(
        waited < Duration::from_secs(5),
        "granted {waited:?} after etcdctl took a 2 s hold"
    );
    let status = tokio::task::spawn_blocking(move || etcdctl.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    guard.release().await.unwrap();
}

/// An operator revoking the holder's etcd lease: the holder hears of it well within the
/// etcd lease's TTL, and the next holder's token is larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_revoked_by_an_operator_is_lost_at_once() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let url = format!("{url}?session_ttl=6s");
    let backend = EtcdBackend::connect(&url).await.unwrap();
    let mut admin = backend.client();
    let holder = Locker::new(backend.clone());
    let next = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let key = LockKey::new(format!("review46-revoke-{}", unique())).unwrap();
    let guard = holder
        .acquire(&key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap();
    let got = admin
        .get(
            backend.lock_range(&key),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let lease = got.kvs()[0].lease();
    let revoked = Instant::now();
    admin.lease_revoke(lease).await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(3), guard.lost())
        .await
        .expect("a revoked lease was not reported lost within 3 s");
    assert!(
        matches!(reason, LostReason::NotOurs | LostReason::SessionLost),
        "{reason:?} after {:?}",
        revoked.elapsed()
    );
    assert!(!guard.is_valid());
    let second = next.try_acquire(&key).await.unwrap().expect("free");
    assert!(second.token() > guard.token());
    assert!(matches!(
        guard.release().await,
        Err(lockkit_core::Error::Lost { .. } | lockkit_core::Error::NotHeld { .. })
    ));
    second.release().await.unwrap();
}

/// A holder whose connection goes silent at the TCP level (a NAT or load balancer in front
/// of etcd that forgot it: nothing acknowledged, nothing sent back) while the member itself
/// is fine, and new connections pass: the hold must be kept alive through a new connection
/// before its loss deadline (2/3 of the session TTL), not lost because every keep-alive
/// went to the dead one until HTTP/2's ping gave up on it (6 s + `connect_timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_outlives_a_silent_connection_to_a_healthy_single_member() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let upstream = env::host_ports(&url)[0].parse().unwrap();
    let proxy = lockkit_conformance::FaultProxy::start(upstream)
        .await
        .unwrap();
    let via_proxy = format!(
        "etcd://{}?session_ttl=6s&connect_timeout=2s",
        proxy.local_addr()
    );
    let holder = Locker::new(EtcdBackend::connect(&via_proxy).await.unwrap());
    let rival = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let key = LockKey::new(format!("review46-silent-{}", unique())).unwrap();
    let guard = holder
        .acquire(&key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap();
    // Keep-alive streams and the watch on the held key are open.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let Some(silenced) = lockkit_conformance::SilencedLinks::to_port(proxy.local_addr().port())
    else {
        return;
    };
    let silenced_at = Instant::now();
    // Past the loss deadline (4 s after the last confirmed keep-alive) and past HTTP/2's
    // ping (6 s) and its timeout (2 s).
    let lost = tokio::time::timeout(Duration::from_secs(10), guard.lost()).await;
    assert!(
        lost.is_err(),
        "the hold was lost ({lost:?}) {:?} after its connection went silent, although the \
         member answered on a new one",
        silenced_at.elapsed()
    );
    assert!(guard.is_valid());
    assert!(
        rival.try_acquire(&key).await.unwrap().is_none(),
        "a rival was granted the lock"
    );
    guard.release().await.unwrap();
    drop(silenced);
}

/// A waiter whose connection goes silent while it waits (the member fine, new connections
/// passing) still hears the release soon after it: its predecessor watch is given up with
/// the connection (HTTP/2's ping: 6 s and `connect_timeout`), not at a recheck or the
/// holder's lease end, and its own lease is kept alive meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_connection_went_silent_hears_the_release() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let upstream = env::host_ports(&url)[0].parse().unwrap();
    let proxy = lockkit_conformance::FaultProxy::start(upstream)
        .await
        .unwrap();
    let options = "session_ttl=10s&connect_timeout=2s";
    let via_proxy = format!("etcd://{}?{options}", proxy.local_addr());
    let waiting = Locker::new(EtcdBackend::connect(&via_proxy).await.unwrap());
    let holding = Locker::new(
        EtcdBackend::connect(&format!("{url}?{options}"))
            .await
            .unwrap(),
    );
    let key = LockKey::new(format!("review46-silent-waiter-{}", unique())).unwrap();
    let held = holding
        .acquire(&key)
        .ttl(Duration::from_secs(120))
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let granted = waiting
                .acquire(&key)
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(90))
                .await;
            (granted.map(|g| g.token()), Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let Some(silenced) = lockkit_conformance::SilencedLinks::to_port(proxy.local_addr().port())
    else {
        return;
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let released_at = Instant::now();
    held.release().await.unwrap();
    let (granted, at) = tokio::time::timeout(Duration::from_secs(60), waiter)
        .await
        .expect("the waiter never heard the release")
        .unwrap();
    granted.expect("granted after the release");
    let after = at.saturating_duration_since(released_at);
    assert!(
        after < Duration::from_secs(10),
        "granted {after:?} after the release"
    );
    eprintln!("granted {after:?} after the release");
    drop(silenced);
}

/// The holder's watch on its own key broken (links reset) while the key's history is
/// compacted away: reopened from a compacted revision, it reads the key instead. A key
/// still the hold's own is no loss; one deleted meanwhile is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_reopened_past_a_compaction_tells_loss_from_no_loss() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let options = "session_ttl=6s&connect_timeout=2s";
    let admin = EtcdBackend::connect(&format!("{url}?{options}"))
        .await
        .unwrap();
    let mut etcd = admin.client();
    let (proxies, hosts) =
        lockkit_conformance::ProxiedClients::<EtcdBackend>::start_proxies(&env::host_ports(&url))
            .await;
    let holder = Locker::new(
        EtcdBackend::connect(&format!("etcd://{hosts}?{options}"))
            .await
            .unwrap(),
    );
    let key = LockKey::new(format!("review46-compact-{}", unique())).unwrap();
    let guard = holder
        .acquire(&key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap();
    let compact = |mut etcd: etcd_client::Client| async move {
        // Revisions past the hold's: its watch must reopen from a compacted one.
        for i in 0..3 {
            etcd.put(
                format!("/review46/filler/{}", unique()),
                format!("{i}"),
                None,
            )
            .await
            .unwrap();
        }
        let now = etcd
            .get("/", None)
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision();
        etcd.compact(now, None).await.unwrap();
    };
    // A compaction alone: the key is still the hold's.
    proxies.iter().for_each(|p| p.reset());
    compact(etcd.clone()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxies.iter().for_each(|p| p.heal());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(guard.is_valid(), "a compaction alone was taken for a loss");
    // The key deleted while the watch is down, then compacted past.
    proxies.iter().for_each(|p| p.reset());
    etcd.delete(
        admin.lock_range(&key),
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await
    .unwrap();
    compact(etcd.clone()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxies.iter().for_each(|p| p.heal());
    let reason = tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("a key deleted and compacted away was never reported lost");
    assert_eq!(reason, LostReason::NotOurs);
}

/// A creation whose first try was applied but whose answer was lost: the retry finds the
/// key on its own lease and queues with it (its create revision the token), rather than
/// creating a second contender or failing. Made deterministic through the spare lease,
/// whose id is known before the contender uses it: the "first try" is put by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creation_applied_before_its_retry_queues_once() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let backend = EtcdBackend::connect(&format!("{url}?session_ttl=6s"))
        .await
        .unwrap();
    let mut admin = backend.client();
    let locker = Locker::new(backend.clone());
    let rival = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    for round in 0..10 {
        let key = LockKey::new(format!("review46-retry-{}-{round}", unique())).unwrap();
        let range = backend.lock_range(&key);
        // Two acquisitions close together: a spare is granted.
        for _ in 0..2 {
            let guard = locker.try_acquire(&key).await.unwrap().expect("free");
            guard.release().await.unwrap();
        }
        let appeared = Instant::now() + Duration::from_secs(5);
        let spare = loop {
            if let Some(spare) = backend.spare_lease() {
                break spare;
            }
            assert!(Instant::now() < appeared, "no spare lease was granted");
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        // The first try, applied: the contender key on the spare, behind a rival's hold.
        let held = rival.acquire(&key).await.unwrap();
        let put = admin
            .put(
                format!("{range}{spare:x}"),
                "earlier-try\n",
                Some(etcd_client::PutOptions::new().with_lease(spare)),
            )
            .await
            .unwrap();
        let revision = put.header().unwrap().revision();
        let waiter = tokio::spawn({
            let (locker, key) = (locker.clone(), key.clone());
            async move { locker.acquire(&key).wait(Duration::from_secs(20)).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let keys = admin
            .get(
                range.clone(),
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await
            .unwrap()
            .count();
        held.release().await.unwrap();
        let guard = waiter.await.unwrap().unwrap();
        if backend.spares_lost() > 0 || keys != 2 {
            // The spare went stale before it was taken: the contender made a key of its
            // own. Try again.
            guard.release().await.unwrap();
            continue;
        }
        assert_eq!(
            guard.token().get(),
            u64::try_from(revision).unwrap(),
            "round {round}: the retry did not take the key its first try made"
        );
        guard.release().await.unwrap();
        let left = admin
            .get(
                range,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await
            .unwrap()
            .count();
        assert_eq!(left, 0);
        return;
    }
    panic!("no round took its spare while it was fresh: the machine was too slow");
}

/// One member of the cluster unreachable without a word (its proxy stalls every
/// connection, new ones too, as a frozen member does): new connections to it (given after
/// each unanswered try) stall as well; holds are kept and every request is answered
/// through the other members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_member_costs_no_hold_and_no_request() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_CLUSTER_URL") else {
        return;
    };
    let (proxies, hosts) =
        lockkit_conformance::ProxiedClients::<EtcdBackend>::start_proxies(&env::host_ports(&url))
            .await;
    let options = "session_ttl=3s&connect_timeout=1s";
    let client = Locker::new(
        EtcdBackend::connect(&format!("etcd://{hosts}?{options}"))
            .await
            .unwrap(),
    );
    let key = LockKey::new(format!("review46-stalled-{}", unique())).unwrap();
    let other = LockKey::new(format!("review46-stalled-other-{}", unique())).unwrap();
    let guard = client
        .acquire(&key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap();
    for (stalled, proxy) in proxies.iter().enumerate() {
        proxy.cut();
        let until = Instant::now() + Duration::from_secs(6);
        while Instant::now() < until {
            let started = Instant::now();
            let round = client
                .acquire(&other)
                .wait(Duration::from_secs(5))
                .await
                .unwrap_or_else(|e| panic!("member {stalled} stalled: {e}"));
            round
                .release()
                .await
                .unwrap_or_else(|e| panic!("member {stalled} stalled: release: {e}"));
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "member {stalled} stalled: a round took {:?}",
                started.elapsed()
            );
        }
        assert!(
            guard.is_valid(),
            "the hold was lost with member {stalled} stalled"
        );
        proxy.heal();
    }
    guard.release().await.unwrap();
}

//! The 3-member cluster losing a member: holds are kept, and every request keeps working
//! although the client still spreads requests over the dead member too (each failed or
//! unanswered try is sent again, and may reach a live one).

use std::{process::Command, time::Duration};

use etcd_client::{Client, ConnectOptions};
use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_etcd::EtcdBackend;

/// The tests here kill and freeze members of the one cluster: one at a time.
static ONE_FAULT_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Resumes and restarts every member when a test ends, passed or failed, so that a
/// failure leaves no member frozen or down for the tests after it.
struct RestoreMembers(usize);

impl Drop for RestoreMembers {
    fn drop(&mut self) {
        let names: Vec<String> = (1..=self.0).map(|i| format!("etcd-{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        services(&[&["resume"], names.as_slice()].concat());
        services(&[&["up"], names.as_slice()].concat());
    }
}

fn services(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services.sh");
    let status = Command::new("bash")
        .arg(script)
        .args(args)
        .status()
        .unwrap();
    assert!(status.success(), "services.sh {args:?} failed");
}

/// The instance names (`etcd-N`) of the leader and of one follower.
async fn roles(members: &[String]) -> (String, String) {
    for _ in 0..100 {
        let (mut leader, mut follower) = (None, None);
        for (i, addr) in members.iter().enumerate() {
            let options = ConnectOptions::new()
                .with_connect_timeout(Duration::from_secs(1))
                .with_timeout(Duration::from_secs(1));
            let Ok(mut client) = Client::connect([format!("http://{addr}")], Some(options)).await
            else {
                continue;
            };
            if let Ok(status) = client.status().await
                && let Some(header) = status.header()
            {
                if header.member_id() == status.leader() {
                    leader = Some(format!("etcd-{}", i + 1));
                } else if status.leader() != 0 {
                    follower = Some(format!("etcd-{}", i + 1));
                }
            }
        }
        if let (Some(l), Some(f)) = (leader, follower) {
            return (l, f);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("the cluster has no leader");
}

/// A holder's and a rival's client of the cluster at `url` with etcd leases of
/// `session_ttl`, and a number no earlier run used, for key names.
async fn clients(url: &str, session_ttl: &str) -> (Locker, Locker, u128) {
    let url = format!("{url}?session_ttl={session_ttl}");
    let holder = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let rival = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    (holder, rival, unique)
}

/// Ten acquire + release rounds by `locker` on `key`, all of which must succeed.
async fn rounds(locker: &Locker, key: &LockKey, during: &str) {
    for round in 0..10 {
        let guard = locker
            .acquire(key)
            .wait(Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("round {round} with {during}: {e}"));
        guard
            .release()
            .await
            .unwrap_or_else(|e| panic!("round {round} with {during}: release: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_survive_and_requests_work_with_a_member_down() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_CLUSTER_URL") else {
        return;
    };
    let _alone = ONE_FAULT_AT_A_TIME.lock().await;
    let members = env::host_ports(&url);
    let _restore = RestoreMembers(members.len());
    let (holder, rival, unique) = clients(&url, "10s").await;
    let key = LockKey::new(format!("etcd-cluster/{unique}")).unwrap();
    let other = LockKey::new(format!("etcd-cluster/{unique}-other")).unwrap();
    let guard = holder
        .acquire(&key)
        .ttl(Duration::from_secs(10))
        .await
        .unwrap();

    for role in ["follower", "leader"] {
        let (leader, follower) = roles(&members).await;
        let victim = if role == "leader" { leader } else { follower };
        services(&["kill", &victim]);
        // Past the holder's etcd lease: kept alive through the members left.
        tokio::time::sleep(Duration::from_secs(12)).await;
        assert!(guard.is_valid(), "lost the lock when the {role} died");
        assert!(
            rival.try_acquire(&key).await.unwrap().is_none(),
            "a rival took the lock while the {role} was down"
        );
        rounds(&rival, &other, &format!("the {role} ({victim}) down")).await;
        services(&["up", &victim]);
    }
    guard.release().await.unwrap();
    rounds(&rival, &key, "every member back").await;
}

/// A member frozen (SIGSTOP: its connections stay open and answer nothing) for longer than
/// the holder's etcd lease, each member in turn, so that one of them carries the holder's
/// keep-alive stream: the holder notices the silence in time, keeps its lease alive through
/// another member, and keeps the lock; no rival gets it meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_survives_each_member_frozen_in_turn() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_CLUSTER_URL") else {
        return;
    };
    let _alone = ONE_FAULT_AT_A_TIME.lock().await;
    let members = env::host_ports(&url);
    let _restore = RestoreMembers(members.len());
    let (holder, rival, unique) = clients(&url, "6s").await;
    let key = LockKey::new(format!("etcd-frozen/{unique}")).unwrap();
    // A lock lease far longer than the test: only the etcd lease can end the hold.
    let guard = holder
        .acquire(&key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap();
    {
        let members = members.clone();
        tokio::spawn(async move {
            let mut last: Vec<String> = vec![String::new(); members.len()];
            loop {
                for (i, addr) in members.iter().enumerate() {
                    let options = ConnectOptions::new()
                        .with_connect_timeout(Duration::from_millis(100))
                        .with_timeout(Duration::from_millis(100));
                    let now = match Client::connect([format!("http://{addr}")], Some(options)).await
                    {
                        Ok(mut c) => match c.status().await {
                            Ok(s) => format!(
                                "me {:x} leader {:x}",
                                s.header().map(|h| h.member_id()).unwrap_or(0),
                                s.leader()
                            ),
                            Err(_) => "no answer".to_string(),
                        },
                        Err(_) => "no conn".to_string(),
                    };
                    if now != last[i] {
                        eprintln!("DBG {:?} etcd-{} says {now}", dbg_t(), i + 1);
                        last[i] = now;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
    for i in 1..=members.len() {
        let victim = format!("etcd-{i}");
        let (l, _) = roles(&members).await;
        eprintln!("DBG {:?} pausing {victim}, leader {l}", dbg_t());
        services(&["pause", &victim]);
        // Past the etcd lease's TTL (6 s), with the victim silent throughout.
        tokio::time::sleep(Duration::from_secs(8)).await;
        let valid = guard.is_valid();
        // The client spreads requests over the frozen member too: a try may go
        // unanswered (an error), but none may be granted.
        let mut tries = Vec::new();
        for _ in 0..3 {
            let taken = rival.try_acquire(&key).await;
            let answered = matches!(taken, Ok(None));
            tries.push(taken.map(|grant| grant.is_some()));
            if answered {
                break;
            }
        }
        services(&["resume", &victim]);
        assert!(valid, "the hold was lost while {victim} was frozen");
        assert!(
            tries.iter().any(|t| matches!(t, Ok(false)))
                && !tries.iter().any(|t| matches!(t, Ok(true))),
            "a rival's tries while {victim} was frozen: {tries:?}"
        );
        // Let the resumed member catch up before freezing the next one.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert!(
        guard.is_valid(),
        "the hold was lost after the members resumed"
    );
    guard.release().await.unwrap();
    rounds(&rival, &key, "every member back").await;
}

fn dbg_t() -> f64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() % 1000) as f64 + f64::from(d.subsec_millis()) / 1000.0
}

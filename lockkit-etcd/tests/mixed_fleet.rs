//! A randomized history of a mixed fleet on etcd: lockkit clients (tries, waits, and waits
//! dropped mid-way) and `etcdctl lock` loops (etcd's own `concurrency.Mutex`) contend for
//! the same two locks. Every holder writes its critical sections into a shared ledger
//! (`lockkit_conformance::Ledger`); the case fails on two holders of one lock at once, on a
//! wait never granted within 30 s, and on a lock left held at the end. Needs `etcdctl`
//! (Debian `etcd-client`; scripts/services.sh installs it).
//!
//! Seeded: `LOCKKIT_TORTURE_SEED=<n>` replays the lockkit side of a run.

use std::{
    process::{Command, Stdio},
    sync::Arc,
    time::Duration,
};

use lockkit_conformance::{Ledger, Rng, env, fleet, torture_seed};
use lockkit_core::Locker;
use lockkit_etcd::EtcdBackend;
use tokio::time::Instant;

/// One `etcdctl lock` loop: until its end, locks one of the two names at random and, while
/// holding it, writes its section (up to 30 ms) into the ledger; prints its holds.
const ETCDCTL_HOLDER: &str = r#"
endpoints=$1 ledger=$2 seconds=$3 seed=$4 first=$5 second=$6
RANDOM=$seed
end=$((SECONDS + seconds)) holds=0
while [ "$SECONDS" -lt "$end" ]; do
  i=$((RANDOM % 2))
  if [ "$i" = 0 ]; then name=$first; else name=$second; fi
  pause=$(printf '0.%03d' $((RANDOM % 30)))
  ETCDCTL_API=3 timeout 30 etcdctl --endpoints="$endpoints" lock "$name" -- \
    bash -c "printf 'enter $i etcdctl-%s\n' \$\$ >> '$ledger'; sleep $pause; printf 'exit $i etcdctl-%s\n' \$\$ >> '$ledger'" \
    > /dev/null || { echo "etcdctl lock $name failed"; exit 1; }
  holds=$((holds + 1))
done
echo "$holds"
"#;

const LOCKKIT_CLIENTS: usize = 2;
const TASKS_PER_CLIENT: usize = 3;
const ETCDCTL_LOOPS: usize = 2;
const SECONDS: u64 = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockkit_and_etcdctl_never_hold_a_lock_twice() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let seed = torture_seed();
    eprintln!("etcd mixed fleet: LOCKKIT_TORTURE_SEED={seed}");
    let run = format!("{seed:x}");
    let keys: Vec<String> = (0..2).map(|i| format!("mixed-{run}-{i}")).collect();
    let ledger = Arc::new(Ledger::new().unwrap());
    let endpoints = env::host_ports(&url).join(",");
    let loops: Vec<_> = (0..ETCDCTL_LOOPS)
        .map(|n| {
            Command::new("bash")
                .args(["-c", ETCDCTL_HOLDER, "etcdctl-holder", &endpoints])
                .arg(ledger.path())
                .arg(SECONDS.to_string())
                .arg(((seed ^ n as u64) % 32_768).to_string())
                .args(keys.iter().map(|key| format!("/lockkit/{key}")))
                .stdout(Stdio::piped())
                .spawn()
                .expect("bash")
        })
        .collect();
    let until = Instant::now() + Duration::from_secs(SECONDS);
    let mut rng = Rng(seed);
    let mut tasks = Vec::new();
    for client in 0..LOCKKIT_CLIENTS {
        let locker = Locker::new(EtcdBackend::connect(&url).await.unwrap());
        for task in 0..TASKS_PER_CLIENT {
            tasks.push(tokio::spawn(fleet::lockkit_holder(
                locker.clone(),
                keys.clone(),
                ledger.clone(),
                format!("lockkit-{client}.{task}"),
                rng.next_u64(),
                until,
            )));
        }
    }
    let mut lockkit_holds = 0;
    for task in tasks {
        lockkit_holds += task
            .await
            .expect("a lockkit task failed (its message is above)");
    }
    let said: Vec<String> = tokio::task::spawn_blocking(move || {
        loops
            .into_iter()
            .map(|holder| {
                let out = holder.wait_with_output().unwrap();
                let said = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                assert!(out.status.success(), "an etcdctl loop failed: {said}");
                said
            })
            .collect()
    })
    .await
    .unwrap();
    let summary = ledger
        .check()
        .unwrap_or_else(|violation| panic!("{violation}"));
    eprintln!(
        "lockkit holds {lockkit_holds}, etcdctl loops said {said:?}; ledger: {:?}",
        summary.holds
    );
    assert_eq!(summary.of("lockkit"), lockkit_holds);
    assert!(
        summary.of("lockkit") > 0 && summary.of("etcdctl") > 0,
        "both kinds of client must have held: {:?}",
        summary.holds
    );
    // Nothing left held: a fresh lockkit client takes every lock at once.
    let check = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    for key in &keys {
        let guard = check
            .acquire(key.as_str())
            .try_now()
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{key} is still held after the fleet stopped"));
        guard.release().await.unwrap();
    }
}

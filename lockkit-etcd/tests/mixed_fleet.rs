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
    time::Duration,
};

use lockkit_conformance::{
    env,
    fleet::{Fleet, Peer},
};
use lockkit_core::Locker;
use lockkit_etcd::EtcdBackend;

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
const SECONDS: u64 = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockkit_and_etcdctl_never_hold_a_lock_twice() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let fleet = Fleet::new("etcd mixed fleet", 2, Duration::from_secs(SECONDS));
    let endpoints = env::host_ports(&url).join(",");
    let loops: Vec<_> = (0..ETCDCTL_LOOPS)
        .map(|n| {
            Command::new("bash")
                .args(["-c", ETCDCTL_HOLDER, "etcdctl-holder", &endpoints])
                .arg(fleet.ledger.path())
                .arg(SECONDS.to_string())
                .arg(((fleet.seed ^ n as u64) % 32_768).to_string())
                .args(fleet.keys.iter().map(|key| format!("/lockkit/{key}")))
                .stdout(Stdio::piped())
                .spawn()
                .map(Peer::Process)
                .expect("bash")
        })
        .collect();
    let mut lockers = Vec::new();
    for _ in 0..LOCKKIT_CLIENTS {
        lockers.push(Locker::new(EtcdBackend::connect(&url).await.unwrap()));
    }
    fleet
        .run_beside_peers(&lockers, TASKS_PER_CLIENT, loops, "etcdctl")
        .await;
    let check = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    fleet.assert_all_free(&check).await;
}

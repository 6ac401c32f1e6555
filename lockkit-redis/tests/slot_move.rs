//! Redis Cluster: a held lock survives the migration of its own slot to another master,
//! and exclusion holds throughout. (Its own test binary: it reshapes the shared cluster,
//! and test binaries run one at a time.)

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_redis::{LockNames, RedisBackend};
use redis::{Value, aio::MultiplexedConnection};
use uuid::Uuid;

async fn node(addr: &str) -> MultiplexedConnection {
    redis::Client::open(format!("redis://{addr}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn cmd<T: redis::FromRedisValue>(conn: &mut MultiplexedConnection, args: &[&str]) -> T {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// (node id, address) of the master serving `slot`, and all masters.
async fn masters(nodes: &[String]) -> Vec<(String, String, Vec<(u16, u16)>)> {
    let mut conn = node(&nodes[0]).await;
    let listing: String = cmd(&mut conn, &["CLUSTER", "NODES"]).await;
    listing
        .lines()
        .filter(|l| l.contains("master"))
        .map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            let addr = parts[1].split('@').next().unwrap().to_owned();
            let ranges = parts[8..]
                .iter()
                .filter(|r| !r.starts_with('['))
                .map(|r| match r.split_once('-') {
                    Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
                    None => (r.parse().unwrap(), r.parse().unwrap()),
                })
                .collect();
            (parts[0].to_owned(), addr, ranges)
        })
        .collect()
}

/// Moves `slot` (and its keys) from `from` to `to`, the way `redis-cli --cluster reshard` does.
async fn move_slot(slot: u16, from: &(String, String), to: &(String, String), all: &[String]) {
    let (mut src, mut dst) = (node(&from.1).await, node(&to.1).await);
    let s = slot.to_string();
    let _: () = cmd(&mut dst, &["CLUSTER", "SETSLOT", &s, "IMPORTING", &from.0]).await;
    let _: () = cmd(&mut src, &["CLUSTER", "SETSLOT", &s, "MIGRATING", &to.0]).await;
    let (host, port) = to.1.split_once(':').unwrap();
    loop {
        let keys: Vec<String> = cmd(&mut src, &["CLUSTER", "GETKEYSINSLOT", &s, "100"]).await;
        if keys.is_empty() {
            break;
        }
        let mut migrate = redis::cmd("MIGRATE");
        migrate
            .arg(host)
            .arg(port)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS");
        for k in &keys {
            migrate.arg(k);
        }
        let _: Value = migrate.query_async(&mut src).await.unwrap();
    }
    for addr in all {
        let mut c = node(addr).await;
        let _: () = cmd(&mut c, &["CLUSTER", "SETSLOT", &s, "NODE", &to.0]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_survives_its_slot_moving_to_another_master() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_CLUSTER_URL") else {
        return;
    };
    let nodes = env::host_ports(&url);
    let holder = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let rival = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let key = LockKey::new(format!("slot-move/{}", Uuid::new_v4().simple())).unwrap();
    let name = LockNames::new("", &key, true).unwrap().lock;
    let mut any = node(&nodes[0]).await;
    let slot: u16 = cmd(&mut any, &["CLUSTER", "KEYSLOT", &name]).await;

    let ttl = Duration::from_millis(600);
    let guard = holder.acquire(&key).ttl(ttl).await.unwrap();
    let token = guard.token();

    let all = masters(&nodes).await;
    let owner = all
        .iter()
        .find(|(_, _, ranges)| ranges.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
        .unwrap();
    let other = all.iter().find(|m| m.0 != owner.0).unwrap();
    let addrs: Vec<String> = all.iter().map(|m| m.1.clone()).collect();
    let (from, to) = (
        (owner.0.clone(), owner.1.clone()),
        (other.0.clone(), other.1.clone()),
    );

    move_slot(slot, &from, &to, &addrs).await;
    // Several leases pass: the watchdog must follow the key to its new master.
    tokio::time::sleep(ttl * 4).await;
    assert!(
        guard.is_valid(),
        "the holder lost its lock when the slot moved"
    );
    assert!(
        rival.try_acquire(&key).await.unwrap().is_none(),
        "exclusion broke after the move"
    );

    move_slot(slot, &to, &from, &addrs).await;
    tokio::time::sleep(ttl * 2).await;
    assert!(
        guard.is_valid(),
        "the holder lost its lock when the slot moved back"
    );
    guard.release().await.unwrap();
    let next = rival
        .try_acquire(&key)
        .await
        .unwrap()
        .expect("free after release");
    assert!(next.token() > token);
    next.release().await.unwrap();
}

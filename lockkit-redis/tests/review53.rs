//! Review 53 of the Redlock wake-ups' background remaking of a master's subscriber
//! connection (bc36805, 0586fbf). Each test runs `redis-server`s of its own.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use lockkit_conformance::OwnRedis;
use lockkit_core::{LockKey, Locker};
use lockkit_redis::RedlockBackend;
use redis::aio::MultiplexedConnection;
use uuid::Uuid;

fn five_masters() -> Option<Vec<OwnRedis>> {
    (0..5).map(|_| OwnRedis::start(&[])).collect()
}

fn redlock_url(masters: &[OwnRedis]) -> String {
    let hosts: Vec<String> = masters
        .iter()
        .map(|m| format!("127.0.0.1:{}", m.port))
        .collect();
    format!("redlock://{}", hosts.join(","))
}

async fn admin_at(port: u16) -> MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn pubsub_clients(conn: &mut MultiplexedConnection) -> usize {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(conn)
        .await
        .unwrap();
    list.lines().filter(|line| !line.is_empty()).count()
}

async fn numsub(conn: &mut MultiplexedConnection, channel: &str) -> i64 {
    let (_, count): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .unwrap();
    count
}

async fn evalsha_calls(conn: &mut MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse::<u64>().unwrap())
}

fn channel_of(name: &str) -> String {
    format!("redisson_lock__channel:{{{name}}}")
}

/// A `redis-server` on `port` (a killed master's), killed when dropped.
struct Restarted(Child);

impl Drop for Restarted {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn restart_on(port: u16) -> Restarted {
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let restarted = Restarted(child);
    let started = Instant::now();
    loop {
        if let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            && let Ok(mut conn) = client.get_multiplexed_async_connection().await
            && redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .is_ok()
        {
            return restarted;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no restart");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `count` waiters on `name` through `locker`, each answering when it was granted.
fn waiters(locker: &Locker, name: &str, count: usize) -> Vec<tokio::task::JoinHandle<Instant>> {
    (0..count)
        .map(|_| {
            let (locker, name) = (locker.clone(), name.to_owned());
            tokio::spawn(async move {
                let guard = locker
                    .acquire(name.as_str())
                    .wait(Duration::from_secs(60))
                    .await
                    .expect("granted");
                let at = Instant::now();
                tokio::time::sleep(Duration::from_millis(10)).await;
                guard.release().await.unwrap();
                at
            })
        })
        .collect()
}

/// Checked sound: a master killed (SIGKILL) while waiters listen to it, and a new server
/// started on its port a second later: the waiters' backend subscribes there again, on one
/// connection (1.06-1.10 s after the restart, the next wake-up's background remaking), and
/// the waiters are granted 4-50 ms after the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_and_restarted_on_its_port_is_heard_again() {
    let Some(masters) = five_masters() else {
        return;
    };
    let url = redlock_url(&masters);
    let holder = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let backend = RedlockBackend::connect(&url).await.unwrap();
    let name = format!("restart/{}", Uuid::new_v4().simple());
    let leader = backend.leader_master(&LockKey::new(name.as_str()).unwrap());
    let killed = (leader + 1) % 5;
    let port = masters[killed].port;
    let guard = holder
        .acquire(name.as_str())
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let locker = Locker::new(backend);
    let waiting = waiters(&locker, &name, 3);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut admin = admin_at(port).await;
    assert_eq!(numsub(&mut admin, &channel_of(&name)).await, 1);
    masters[killed].signal("-KILL");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let _restarted = restart_on(port).await;
    let mut admin = admin_at(port).await;
    let started = Instant::now();
    let mut heard_after = None;
    while started.elapsed() < Duration::from_secs(10) {
        if numsub(&mut admin, &channel_of(&name)).await == 1 {
            heard_after = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let clients = pubsub_clients(&mut admin).await;
    eprintln!("subscribed again {heard_after:?} after the restart; {clients} pubsub clients");
    assert!(
        heard_after.is_some(),
        "not subscribed again on the restarted master"
    );
    assert_eq!(clients, 1, "subscriber connections on the restarted master");
    let freed = Instant::now();
    guard.release().await.unwrap();
    let mut afters = Vec::new();
    for waiter in waiting {
        let at = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("granted")
            .unwrap();
        afters.push(at.saturating_duration_since(freed));
    }
    eprintln!("granted {afters:?} after the release");
}

/// Checked sound: a master frozen (SIGSTOP) for 4 s after its subscriber connection was
/// given up (an ended wait's UNSUBSCRIBE went unanswered), under sixteen waiters on four
/// names: once thawed it is subscribed again within milliseconds, on one connection, to the
/// waited channels only (not the ended wait's), and no connection piled up there (as many
/// clients as before the freeze); the last of each four waiters is granted 43-58 ms after
/// its release (the same on 39d0ed7, before bc36805).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thawed_master_is_subscribed_again_once() {
    let Some(masters) = five_masters() else {
        return;
    };
    let url = redlock_url(&masters);
    let holder = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let backend = RedlockBackend::connect(&url).await.unwrap();
    let names: Vec<String> = (0..5)
        .map(|_| format!("thaw/{}", Uuid::new_v4().simple()))
        .collect();
    let leader = backend.leader_master(&LockKey::new(names[0].as_str()).unwrap());
    let frozen = (leader + 1) % 5;
    let mut guards = Vec::new();
    for name in &names {
        guards.push(
            holder
                .acquire(name.as_str())
                .ttl(Duration::from_secs(60))
                .await
                .unwrap(),
        );
    }
    let locker = Locker::new(backend);
    let mut waiting = Vec::new();
    for name in &names[..4] {
        waiting.push(waiters(&locker, name, 4));
    }
    let leaving = {
        let (locker, name) = (locker.clone(), names[4].clone());
        tokio::spawn(async move {
            let _ = locker
                .acquire(name.as_str())
                .wait(Duration::from_secs(60))
                .await;
        })
    };
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut admin = admin_at(masters[frozen].port).await;
    let before_clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut admin)
        .await
        .unwrap();
    masters[frozen].signal("-STOP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    leaving.abort();
    tokio::time::sleep(Duration::from_millis(4000)).await;
    masters[frozen].signal("-CONT");
    let started = Instant::now();
    let mut subscribed_after = None;
    while started.elapsed() < Duration::from_secs(10) {
        let mut all = true;
        for name in &names[..4] {
            all &= numsub(&mut admin, &channel_of(name)).await == 1;
        }
        if all {
            subscribed_after = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let clients = pubsub_clients(&mut admin).await;
    let left = numsub(&mut admin, &channel_of(&names[4])).await;
    let all_clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut admin)
        .await
        .unwrap();
    eprintln!(
        "subscribed again {subscribed_after:?} after the thaw; {clients} pubsub clients; \
         {} clients before the freeze, {} after",
        before_clients.lines().count(),
        all_clients.lines().count()
    );
    assert!(subscribed_after.is_some(), "not subscribed again");
    assert_eq!(clients, 1, "subscriber connections on the thawed master");
    assert_eq!(left, 0, "the abandoned wait's channel is subscribed");
    assert!(
        all_clients.lines().count() <= before_clients.lines().count() + 1,
        "connections piled up: {all_clients}"
    );
    let mut afters = Vec::new();
    for (guard, waiting) in guards.drain(..4).zip(waiting) {
        let freed = Instant::now();
        guard.release().await.unwrap();
        let mut last = Duration::ZERO;
        for waiter in waiting {
            let at = tokio::time::timeout(Duration::from_secs(30), waiter)
                .await
                .expect("granted")
                .unwrap();
            last = last.max(at.saturating_duration_since(freed));
        }
        afters.push(last);
    }
    eprintln!("the last of four granted {afters:?} after each release");
}

/// Checked sound: a master killed for good under six waiters: nobody spins (12-13 rounds in
/// 3 s on another master before the kill, 13-18 after). Noticed and left: with the master
/// dead each grant in turn comes about 115 ms after the one before (205-706 ms for the
/// six), against 14 ms with it alive; the same on 39d0ed7, so not this round's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_master_makes_nobody_spin() {
    let Some(masters) = five_masters() else {
        return;
    };
    let url = redlock_url(&masters);
    let holder = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let backend = RedlockBackend::connect(&url).await.unwrap();
    let name = format!("dead/{}", Uuid::new_v4().simple());
    let leader = backend.leader_master(&LockKey::new(name.as_str()).unwrap());
    let killed = (leader + 1) % 5;
    let other = (leader + 2) % 5;
    let guard = holder
        .acquire(name.as_str())
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let locker = Locker::new(backend);
    let waiting = waiters(&locker, &name, 6);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut admin = admin_at(masters[other].port).await;
    let before = evalsha_calls(&mut admin).await;
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let alive_rate = evalsha_calls(&mut admin).await - before;
    masters[killed].signal("-KILL");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = evalsha_calls(&mut admin).await;
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let dead_rate = evalsha_calls(&mut admin).await - before;
    eprintln!("rounds on another master in 3 s: {alive_rate} alive, {dead_rate} with one dead");
    assert!(
        dead_rate <= alive_rate * 3 + 30,
        "{dead_rate} rounds in 3 s with a dead master, {alive_rate} before"
    );
    let freed = Instant::now();
    guard.release().await.unwrap();
    let mut afters = Vec::new();
    for waiter in waiting {
        let at = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("granted")
            .unwrap();
        afters.push(at.saturating_duration_since(freed));
    }
    eprintln!("granted {afters:?} after the release");
}

/// Connections to a server other than `admin`'s own.
async fn other_clients(admin: &mut MultiplexedConnection) -> Vec<String> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(admin)
        .await
        .unwrap();
    list.lines()
        .filter(|line| !line.contains("cmd=client|list"))
        .map(str::to_owned)
        .collect()
}

/// Finding 1: a backend dropped after its waits ended leaves its subscriber connection
/// open on every master (unsubscribed from everything, so `CLIENT LIST TYPE pubsub` does
/// not show it), with the task that reads it: nothing closes it, neither the one made when
/// the waits began nor one made again in the background (bc36805) after the connections
/// died. Measured on 0586fbf: one connection (`cmd=unsubscribe sub=0`) per master after
/// the first backend's drop, a second on each master whose connection the second backend
/// made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_stays_connected_after_the_backend_is_dropped() {
    let Some(masters) = five_masters() else {
        return;
    };
    let url = redlock_url(&masters);
    let mut admins = Vec::new();
    for master in &masters {
        admins.push(admin_at(master.port).await);
    }
    for round in 0..2 {
        let holder = Locker::new(RedlockBackend::connect(&url).await.unwrap());
        let backend = RedlockBackend::connect(&url).await.unwrap();
        let name = format!("dropped/{}", Uuid::new_v4().simple());
        let guard = holder
            .acquire(name.as_str())
            .ttl(Duration::from_secs(60))
            .await
            .unwrap();
        let locker = Locker::new(backend);
        let waiting = waiters(&locker, &name, 3);
        tokio::time::sleep(Duration::from_millis(800)).await;
        if round == 1 {
            // The connections die; the waiters, woken, have them made again in the
            // background.
            for admin in &mut admins {
                let _: () = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("pubsub")
                    .query_async(admin)
                    .await
                    .unwrap();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for waiter in &waiting {
            waiter.abort();
        }
        drop(locker);
        guard.release().await.unwrap();
        drop(holder);
        let started = Instant::now();
        let mut left = Vec::new();
        while started.elapsed() < Duration::from_secs(3) {
            left.clear();
            for admin in &mut admins {
                left.extend(other_clients(admin).await);
            }
            if left.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!("round {round}: {} connections left: {left:#?}", left.len());
        assert!(
            left.is_empty(),
            "round {round}: {} connections left 3 s after the backends were dropped",
            left.len()
        );
    }
}

/// The same for a single server's backend (its waits ride on the same subscriber).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_stays_connected_after_a_single_server_backend_is_dropped() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let mut admin = admin_at(server.port).await;
    let holder = Locker::new(
        lockkit_redis::RedisBackend::connect(&server.url())
            .await
            .unwrap(),
    );
    let locker = Locker::new(
        lockkit_redis::RedisBackend::connect(&server.url())
            .await
            .unwrap(),
    );
    let name = format!("dropped/{}", Uuid::new_v4().simple());
    let guard = holder
        .acquire(name.as_str())
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let waiting = waiters(&locker, &name, 3);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for waiter in &waiting {
        waiter.abort();
    }
    drop(locker);
    guard.release().await.unwrap();
    drop(holder);
    let started = Instant::now();
    let mut left = other_clients(&mut admin).await;
    while !left.is_empty() && started.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = other_clients(&mut admin).await;
    }
    eprintln!("{} connections left: {left:#?}", left.len());
    assert!(left.is_empty(), "{} connections left", left.len());
}

/// Checked sound (as far as measured): every master's subscriber connection dies (CLIENT
/// KILL TYPE pubsub on all five, as a network blip does) while a waiter waits, and the
/// holder lets go 0-6 ms later. Since bc36805 the waiter's round after the deaths no longer
/// waits for the connections to be made again, so a release between that round and the
/// background resubscription could go unheard until the waiter looks again; in 40 and 16
/// trials none was (granted 2-30 ms after the release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_right_after_every_subscriber_connection_died_is_heard() {
    let Some(masters) = five_masters() else {
        return;
    };
    let url = redlock_url(&masters);
    let mut admins = Vec::new();
    for master in &masters {
        admins.push(admin_at(master.port).await);
    }
    let holder = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let locker = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let mut afters = Vec::new();
    for trial in 0..24_u64 {
        let name = format!("blip/{}", Uuid::new_v4().simple());
        let guard = holder
            .acquire(name.as_str())
            .ttl(Duration::from_secs(60))
            .await
            .unwrap();
        let mut waiting = waiters(&locker, &name, 1);
        tokio::time::sleep(Duration::from_millis(400)).await;
        let kills = admins.iter_mut().map(|admin| async move {
            let _: () = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("pubsub")
                .query_async(admin)
                .await
                .unwrap();
        });
        futures_util::future::join_all(kills).await;
        tokio::time::sleep(Duration::from_micros(250 * (trial % 24))).await;
        let freed = Instant::now();
        guard.release().await.unwrap();
        let at = tokio::time::timeout(Duration::from_secs(30), waiting.remove(0))
            .await
            .expect("granted")
            .unwrap();
        afters.push(at.saturating_duration_since(freed));
    }
    eprintln!("granted {afters:?} after the release");
    let slow = afters
        .iter()
        .filter(|after| **after > Duration::from_millis(500))
        .count();
    assert_eq!(
        slow, 0,
        "{slow} of 24 releases unheard: granted {afters:?} after the release"
    );
}

//! The waiter queue of a single Redis server: a release names the next lockkit waiter, and
//! only that one runs a script; the others sleep on. A release that names nobody (a
//! Redisson holder's, a bare `0`) still wakes every waiter, and a named waiter that never
//! comes costs the others a short grace (50 ms), not the lease they learned.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lockkit_conformance::{FaultProxy, ProxiedClients, env};
use lockkit_core::{LockGuard, Locker};
use lockkit_redis::RedisBackend;
use redis::AsyncCommands;
use uuid::Uuid;

const TTL: Duration = Duration::from_secs(30);

fn server() -> Option<String> {
    env::service_url("LOCKKIT_TEST_REDIS_URL")
}

fn key() -> String {
    format!("queue/{}", Uuid::new_v4().simple())
}

async fn admin(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// A client of its own (its own connections and subscriber).
async fn client(url: &str) -> Locker {
    Locker::new(RedisBackend::connect(url).await.unwrap())
}

/// `locker` waits for `key` (a minute at most).
async fn wait_for(locker: &Locker, key: &str) -> LockGuard {
    locker
        .acquire(key)
        .ttl(TTL)
        .wait(Duration::from_secs(60))
        .await
        .unwrap()
}

/// `locker` waits for `key` in a task of its own: the guard, and when it was granted.
fn spawn_wait(locker: &Locker, key: &str) -> tokio::task::JoinHandle<(LockGuard, Instant)> {
    let (locker, key) = (locker.clone(), key.to_owned());
    tokio::spawn(async move {
        let guard = wait_for(&locker, &key).await;
        (guard, Instant::now())
    })
}

/// The guard of `waiter`, which must be granted well within 5 s of `released` (it would
/// otherwise sleep until the 30 s lease it learned).
async fn granted_soon_after(
    waiter: tokio::task::JoinHandle<(LockGuard, Instant)>,
    released: Instant,
) -> LockGuard {
    let (guard, granted) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter slept until the lease it learned")
        .unwrap();
    let after = granted - released;
    assert!(
        after < Duration::from_secs(5),
        "granted {after:?} after the release"
    );
    guard
}

/// `n` clients of the server, each with its own connections, all through one proxy that
/// counts what they send.
async fn clients_through_one_proxy(url: &str, n: usize) -> (FaultProxy, Vec<Locker>) {
    let host = url.trim_start_matches("redis://").trim_end_matches('/');
    let (mut proxies, hosts) =
        ProxiedClients::<RedisBackend>::start_proxies(&[host.to_owned()]).await;
    let mut clients = Vec::new();
    for _ in 0..n {
        let backend = RedisBackend::connect(&format!("redis://{hosts}"))
            .await
            .unwrap();
        clients.push(Locker::new(backend));
    }
    (proxies.remove(0), clients)
}

/// Seven lockkit waiters of seven clients queue behind a holder; each release names one,
/// which is granted and releases in turn. Without the queue every release woke every
/// waiter left, and each ran a script for one grant (43 requests for the seven handoffs
/// here, three runs); with it, a handoff costs the named waiter's acquisition, its release
/// and its unsubscription (22 here, three runs).
#[tokio::test]
async fn a_release_wakes_only_the_waiter_it_names() {
    let Some(url) = server() else { return };
    const WAITERS: usize = 7;
    let (proxy, clients) = clients_through_one_proxy(&url, WAITERS + 1).await;
    let key = key();
    let holder = clients[0].acquire(key.as_str()).ttl(TTL).await.unwrap();
    let history = lockkit_conformance::History::new();
    let mut waiters = Vec::new();
    for (i, locker) in clients.iter().enumerate().skip(1) {
        let (locker, key, history) = (locker.clone(), key.clone(), history.clone());
        waiters.push(tokio::spawn(async move {
            let guard = wait_for(&locker, &key).await;
            let open = history.begin(format!("waiter {i}"), &guard);
            tokio::task::yield_now().await;
            history.end(open, &guard);
            guard.release().await.unwrap();
        }));
    }
    // Every waiter has made its first attempt (and queued) by then.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = proxy.requests_seen();
    holder.release().await.unwrap();
    for waiter in waiters {
        waiter.await.unwrap();
    }
    history.assert_linear();
    assert_eq!(history.records().len(), WAITERS);
    let seen = proxy.requests_seen() - before;
    assert!(
        seen <= 5 * WAITERS as u64,
        "{seen} requests for {WAITERS} handoffs: released waiters that were not named ran scripts"
    );
}

/// Three waiters queue; the release names the first, which then holds the key for a while.
/// The other two heard it named, and then heard it take the key: they sleep through its
/// hold instead of each trying once the grace has passed (two requests, within 50 ms, when
/// the grant said nothing).
#[tokio::test]
async fn the_others_sleep_through_the_hold_of_the_waiter_a_release_named() {
    let Some(url) = server() else { return };
    let (proxy, clients) = clients_through_one_proxy(&url, 4).await;
    let key = key();
    let holder = clients[0].acquire(key.as_str()).ttl(TTL).await.unwrap();
    let (granted_tx, mut granted_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut waiters = Vec::new();
    for (i, locker) in clients.iter().enumerate().skip(1) {
        let (locker, key, granted) = (locker.clone(), key.clone(), granted_tx.clone());
        waiters.push(tokio::spawn(async move {
            let guard = wait_for(&locker, &key).await;
            granted.send(i).unwrap();
            tokio::time::sleep(Duration::from_millis(400)).await;
            guard.release().await.unwrap();
        }));
        // One after the other, so the queue's order is known.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    holder.release().await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(20), granted_rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first, 1, "the earliest waiter is named first");
    // Past the named waiter's unsubscription, well within the others' grace.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let before = proxy.requests_seen();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let during = proxy.requests_seen() - before;
    assert_eq!(
        during, 0,
        "{during} requests while the named waiter held the key: the others tried"
    );
    for _ in 0..2 {
        tokio::time::timeout(Duration::from_secs(20), granted_rx.recv())
            .await
            .unwrap()
            .unwrap();
    }
    for waiter in waiters {
        waiter.await.unwrap();
    }
}

/// A release names a waiter that is gone (its place left behind: a crash, a wait that gave
/// up before leaving the queue). The other waiter, told that someone else is next, tries
/// anyway after a short grace, not when the lease it learned runs out (30 s here).
#[tokio::test]
async fn a_named_waiter_that_never_comes_holds_the_others_back_briefly() {
    let Some(url) = server() else { return };
    let (holding, waiting) = (client(&url).await, client(&url).await);
    let key = key();
    let queue = format!("{{{key}}}:lockkit_queue");
    let holder = holding.acquire(key.as_str()).ttl(TTL).await.unwrap();
    let waiter = spawn_wait(&waiting, &key);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut admin = admin(&url).await;
    let queued: Vec<(String, f64)> = admin.zrange_withscores(&queue, 0, -1).await.unwrap();
    assert_eq!(queued.len(), 1, "the waiter queued: {queued:?}");
    // A dead waiter ahead of it: queued earlier, never to come.
    let ghost = (1u64 << 61) + 12_345;
    let _: () = admin.zadd(&queue, ghost, 1.0).await.unwrap();
    let released = Instant::now();
    holder.release().await.unwrap();
    granted_soon_after(waiter, released)
        .await
        .release()
        .await
        .unwrap();
    let left: Vec<String> = admin.zrange(&queue, 0, -1).await.unwrap();
    assert!(
        left.is_empty(),
        "the ghost was popped, the waiter left: {left:?}"
    );
}

/// What a release says on the channel: the next waiter's id, then the `0` every Redisson
/// waiter acts on. Both are numbers (Redisson reads messages as `long`s and ignores all but
/// `0` and `1`), the id at least 2^61; the waiter leaves the queue with its grant, and the
/// queue is gone with it.
#[tokio::test]
async fn a_release_names_the_next_waiter_before_its_zero() {
    let Some(url) = server() else { return };
    let (holding, waiting) = (client(&url).await, client(&url).await);
    let key = key();
    let channel = format!("redisson_lock__channel:{{{key}}}");
    let queue = format!("{{{key}}}:lockkit_queue");
    let mut listener = redis::Client::open(url.as_str())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    listener.subscribe(&channel).await.unwrap();
    let holder = holding.acquire(key.as_str()).ttl(TTL).await.unwrap();
    let waiter = spawn_wait(&waiting, &key);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut admin = admin(&url).await;
    let flag: Option<String> = admin.hget(&key, "lockkit-queue").await.unwrap();
    assert_eq!(flag.as_deref(), Some("q"), "the waiter flagged the hold");
    let released = Instant::now();
    holder.release().await.unwrap();
    let guard = granted_soon_after(waiter, released).await;
    let mut messages = listener.on_message();
    let mut said = Vec::new();
    for _ in 0..2 {
        let message = tokio::time::timeout(Duration::from_secs(5), messages.next())
            .await
            .expect("two messages per release")
            .unwrap();
        said.push(message.get_payload::<String>().unwrap());
    }
    let named: u64 = said[0].parse().expect("the name is a number");
    assert!((1u64 << 61..1u64 << 62).contains(&named), "{said:?}");
    assert_eq!(said[1], "0", "{said:?}");
    let exists: bool = admin.exists(&queue).await.unwrap();
    assert!(
        !exists,
        "the granted waiter left the queue, and nobody else is in it"
    );
    let flag: Option<String> = admin.hget(&key, "lockkit-queue").await.unwrap();
    assert_eq!(flag, None, "nobody else waits: the new hold is not flagged");
    drop(messages);
    guard.release().await.unwrap();
}

/// A hold in Redisson's layout that lockkit did not make (a Redisson client's) is released
/// with a bare `0`: the queued lockkit waiter still hears it at once, not after its lease.
#[tokio::test]
async fn a_bare_release_still_wakes_a_queued_waiter() {
    let Some(url) = server() else { return };
    let waiting = client(&url).await;
    let key = key();
    let channel = format!("redisson_lock__channel:{{{key}}}");
    let mut admin = admin(&url).await;
    let redisson_owner = format!("{}:1", Uuid::new_v4());
    let _: () = admin.hset(&key, &redisson_owner, 1).await.unwrap();
    let _: () = admin.pexpire(&key, 30_000).await.unwrap();
    let waiter = spawn_wait(&waiting, &key);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    let _: () = admin.del(&key).await.unwrap();
    let _: () = admin.publish(&channel, 0).await.unwrap();
    granted_soon_after(waiter, released)
        .await
        .release()
        .await
        .unwrap();
}

/// Two tasks of one owner wait on a key (no in-process gate), in one place of the queue. The
/// release names it: one is granted, the other re-enters at once (not at its deadline), and
/// the place is gone: while the owner holds, only the third waiter is queued, so the
/// owner's last release names it (a place left behind cost the third waiter the grace).
/// From helper-28's review.
#[tokio::test]
async fn a_waiter_granted_by_re_entry_leaves_the_queue() {
    let Some(url) = server() else { return };
    let key = key();
    let queue = format!("{{{key}}}:lockkit_queue");
    let holding = client(&url).await;
    let owning = client(&url).await.without_waiter_gates();
    let third = client(&url).await;
    let holder = holding.acquire(key.as_str()).ttl(TTL).await.unwrap();
    let owner = owning.owner();
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (owner, key) = (owner.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            owner
                .acquire(key.as_str())
                .ttl(TTL)
                .wait(Duration::from_secs(20))
                .await
                .unwrap()
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = spawn_wait(&third, &key);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut admin = admin(&url).await;
    let before: Vec<String> = admin.zrange(&queue, 0, -1).await.unwrap();
    assert_eq!(
        before.len(),
        2,
        "the owner's two waits share a place: {before:?}"
    );
    let released = Instant::now();
    holder.release().await.unwrap();
    let first = tasks.remove(0).await.unwrap();
    let second = tasks.remove(0).await.unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "the owner's second wait re-entered {:?} after the release (its wait is 20 s)",
        released.elapsed()
    );
    let during: Vec<String> = admin.zrange(&queue, 0, -1).await.unwrap();
    assert_eq!(
        during.len(),
        1,
        "only the third waiter is queued while the owner holds twice: {during:?}"
    );
    first.release().await.unwrap();
    second.release().await.unwrap();
    waiting.await.unwrap().0.release().await.unwrap();
}

/// Another key under the queue's name (a lock named `{k}:lockkit_queue`, of another type):
/// the waiter goes without a queue, the flagged hold is still released (and its `0`
/// published), and the waiter is granted. Before, the release failed after deleting the
/// lock (nobody was told), and a waiter's grant failed on every try.
#[tokio::test]
async fn a_foreign_key_under_the_queues_name_costs_the_queue_only() {
    let Some(url) = server() else { return };
    let key = key();
    let queue = format!("{{{key}}}:lockkit_queue");
    let mut admin = admin(&url).await;
    let _: () = admin.set_ex(&queue, "not a sorted set", 60).await.unwrap();
    let (holding, waiting) = (client(&url).await, client(&url).await);
    let holder = holding.acquire(key.as_str()).ttl(TTL).await.unwrap();
    let _: () = admin.hset(&key, "lockkit-queue", "q").await.unwrap();
    let waiter = spawn_wait(&waiting, &key);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    holder
        .release()
        .await
        .expect("the release of a flagged hold");
    granted_soon_after(waiter, released)
        .await
        .release()
        .await
        .unwrap();
    let _: () = admin.del(&queue).await.unwrap();
}

/// Two waiters queue behind a holder. A release names the first, but a newcomer took the
/// key before it came (here: the queue is popped and the first named while the holder
/// keeps the key, which is what the named waiter finds): it tries, finds the key busy and
/// queues again, at the place it had, not behind the waiter that queued after it. So the
/// next release names it again, and it is granted first. Before, it queued again at the
/// back: a waiter that lost the race at every handoff waited out the whole queue each time.
#[tokio::test]
async fn a_named_waiter_that_loses_the_key_keeps_its_place() {
    let Some(url) = server() else { return };
    let (holding, first, second) = (client(&url).await, client(&url).await, client(&url).await);
    let key = key();
    let channel = format!("redisson_lock__channel:{{{key}}}");
    let queue = format!("{{{key}}}:lockkit_queue");
    let mut admin = admin(&url).await;
    let holder = holding.acquire(key.as_str()).ttl(TTL).await.unwrap();
    let queued_within = async |admin: &mut redis::aio::MultiplexedConnection, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let queued: Vec<String> = admin.zrange(&queue, 0, -1).await.unwrap();
            if queued.len() == n {
                return queued;
            }
            assert!(Instant::now() < deadline, "never {n} queued: {queued:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let first_waiter = spawn_wait(&first, &key);
    let [first_id]: [String; 1] = queued_within(&mut admin, 1).await.try_into().unwrap();
    let second_waiter = spawn_wait(&second, &key);
    let queued = queued_within(&mut admin, 2).await;
    assert_eq!(queued[0], first_id, "the first waiter queued first");
    // The release's pop and name, with the key still taken (by the newcomer, here the
    // holder).
    let popped: Vec<(String, f64)> = redis::cmd("ZPOPMIN")
        .arg(&queue)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(popped[0].0, first_id);
    let _: () = admin.publish(&channel, &first_id).await.unwrap();
    let _: () = admin.publish(&channel, 0).await.unwrap();
    let queued = queued_within(&mut admin, 2).await;
    assert_eq!(
        queued[0], first_id,
        "the named waiter that found the key taken queued at its old place"
    );
    let released = Instant::now();
    holder.release().await.unwrap();
    let (guard, _) = tokio::time::timeout(Duration::from_secs(10), first_waiter)
        .await
        .expect("the release named the first waiter, who was granted")
        .unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "granted {:?} after the release",
        released.elapsed()
    );
    assert!(
        !second_waiter.is_finished(),
        "the second waiter waits for the first's release"
    );
    guard.release().await.unwrap();
    second_waiter.await.unwrap().0.release().await.unwrap();
}

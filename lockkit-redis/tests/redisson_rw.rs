//! Read-write locks and semaphores against Redisson's layouts (`RReadWriteLock`,
//! `RPermitExpirableSemaphore`), at the wire level: no Redisson jar can be had here, so the
//! Redisson side is written with plain Redis commands, exactly as its scripts write it, and
//! lockkit's own states are read back with `HGETALL`, `PTTL`, `ZRANGE`.

use std::time::Duration;

use futures_util::StreamExt;
use lockkit_conformance::env;
use lockkit_core::{Locker, spi::Released};
use lockkit_redis::RedisBackend;
use redis::AsyncCommands;
use uuid::Uuid;

struct Setup {
    locker: Locker,
    admin: redis::aio::MultiplexedConnection,
    client: redis::Client,
    /// The lock name (no prefix): the hash of an RW lock, the count of a semaphore.
    name: String,
}

async fn setup() -> Option<Setup> {
    let url = env::service_url("LOCKKIT_TEST_REDIS_URL")?;
    let backend = RedisBackend::connect(&url).await.unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let admin = client.get_multiplexed_async_connection().await.unwrap();
    Some(Setup {
        locker: Locker::new(backend),
        admin,
        client,
        name: format!("rw-interop/{}", Uuid::new_v4().simple()),
    })
}

const TTL: Duration = Duration::from_secs(30);

/// A Redisson read hold of thread 7 of another JVM, as `RedissonReadLock.tryLockInnerAsync`
/// writes it on a free key.
async fn redisson_read(s: &mut Setup) -> String {
    let field = format!("{}:7", Uuid::new_v4());
    let _: () = s
        .admin
        .hset_multiple(&s.name, &[("mode", "read"), (field.as_str(), "1")])
        .await
        .unwrap();
    let timeout = format!("{{{}}}:{field}:rwlock_timeout:1", s.name);
    let _: () = s.admin.pset_ex(&timeout, 1, 30_000).await.unwrap();
    let _: () = s.admin.pexpire(&s.name, 30_000).await.unwrap();
    field
}

/// Redisson's read unlock (`RedissonReadLock.unlockInnerAsync`, steps 3 to 6), as a script.
const REDISSON_READ_UNLOCK: &str = r"
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then return nil end
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then return nil end
local counter = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if counter == 0 then redis.call('hdel', KEYS[1], ARGV[1]) end
redis.call('del', KEYS[3] .. ':' .. (counter + 1))
if redis.call('hlen', KEYS[1]) > 1 then
  local maxRemainTime = -3
  local keys = redis.call('hkeys', KEYS[1])
  for n, key in ipairs(keys) do
    counter = tonumber(redis.call('hget', KEYS[1], key))
    if type(counter) == 'number' then
      for i = counter, 1, -1 do
        local remainTime = redis.call('pttl', KEYS[4] .. ':' .. key .. ':rwlock_timeout:' .. i)
        maxRemainTime = math.max(remainTime, maxRemainTime)
      end
    end
  end
  if maxRemainTime > 0 then
    redis.call('pexpire', KEYS[1], maxRemainTime)
    return 0
  end
  if mode == 'write' then return 0 end
end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], 0)
return 1
";

#[tokio::test]
async fn a_redisson_reader_admits_lockkit_readers_and_blocks_lockkit_writers() {
    let Some(mut s) = setup().await else { return };
    let redisson = redisson_read(&mut s).await;
    assert!(
        s.locker
            .write(s.name.as_str())
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "a lockkit writer entered beside a Redisson reader"
    );
    assert!(
        s.locker
            .try_acquire(s.name.as_str())
            .await
            .unwrap()
            .is_none(),
        "a lockkit mutex entered beside a Redisson reader"
    );
    let read = s
        .locker
        .read(s.name.as_str())
        .ttl(TTL)
        .try_now()
        .await
        .unwrap()
        .expect("a lockkit reader shares with a Redisson reader");
    let key = lockkit_core::LockKey::new(s.name.as_str()).unwrap();
    let holders = s.locker.backend().holders(&key).await.unwrap();
    let owners: Vec<&str> = holders.iter().map(|h| h.owner.as_str()).collect();
    assert!(
        owners.contains(&redisson.as_str()) && owners.contains(&read.owner().to_string().as_str()),
        "holders() lists both readers: {holders:?}"
    );
    // Redisson's own read unlock runs over lockkit's fields without looping on them and
    // keeps the hash for lockkit's live reader.
    let unlocked: Option<i64> = redis::Script::new(REDISSON_READ_UNLOCK)
        .key(&s.name)
        .key(format!("redisson_rwlock:{{{}}}", s.name))
        .key(format!("{{{}}}:{redisson}:rwlock_timeout", s.name))
        .key(format!("{{{}}}", s.name))
        .arg(&redisson)
        .invoke_async(&mut s.admin)
        .await
        .unwrap();
    assert_eq!(unlocked, Some(0), "the hash stays for lockkit's reader");
    let mode: String = s.admin.hget(&s.name, "mode").await.unwrap();
    assert_eq!(mode, "read");
    assert!(
        s.locker
            .write(s.name.as_str())
            .try_now()
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(read.release().await.unwrap(), Released::Fully);
    let exists: bool = s.admin.exists(&s.name).await.unwrap();
    assert!(!exists, "the last reader's release deletes the hash");
    let writer = s
        .locker
        .write(s.name.as_str())
        .ttl(TTL)
        .try_now()
        .await
        .unwrap()
        .expect("free once both readers left");
    writer.release().await.unwrap();
}

#[tokio::test]
async fn a_dead_redisson_reader_no_longer_blocks_a_writer() {
    let Some(mut s) = setup().await else { return };
    let redisson = redisson_read(&mut s).await;
    let read = s
        .locker
        .read(s.name.as_str())
        .ttl(TTL)
        .try_now()
        .await
        .unwrap()
        .unwrap();
    // The Redisson JVM dies: its timeout key runs out, its count field stays (C11).
    let _: () = s
        .admin
        .del(format!("{{{}}}:{redisson}:rwlock_timeout:1", s.name))
        .await
        .unwrap();
    read.release().await.unwrap();
    let exists: bool = s.admin.exists(&s.name).await.unwrap();
    assert!(
        !exists,
        "with no live reader left the last release deletes the hash"
    );
    // And a writer meeting only dead readers' fields takes the key.
    let _: () = s
        .admin
        .hset_multiple(&s.name, &[("mode", "read"), (redisson.as_str(), "1")])
        .await
        .unwrap();
    let _: () = s.admin.pexpire(&s.name, 30_000).await.unwrap();
    let writer = s
        .locker
        .write(s.name.as_str())
        .ttl(TTL)
        .try_now()
        .await
        .unwrap()
        .expect("a reader whose timeout keys are gone holds nothing");
    writer.release().await.unwrap();
}

#[tokio::test]
async fn a_redisson_writer_excludes_lockkit() {
    let Some(mut s) = setup().await else { return };
    let field = format!("{}:7:write", Uuid::new_v4());
    let _: () = s
        .admin
        .hset_multiple(&s.name, &[("mode", "write"), (field.as_str(), "1")])
        .await
        .unwrap();
    let _: () = s.admin.pexpire(&s.name, 30_000).await.unwrap();
    assert!(
        s.locker
            .read(s.name.as_str())
            .try_now()
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        s.locker
            .write(s.name.as_str())
            .try_now()
            .await
            .unwrap()
            .is_none()
    );
    // Redisson's write unlock: delete, publish 1 (READ_UNLOCK_MESSAGE): a lockkit reader
    // waiting behind it wakes.
    let waiter = {
        let (locker, name) = (s.locker.clone(), s.name.clone());
        tokio::spawn(async move {
            locker
                .read(name.as_str())
                .ttl(TTL)
                .wait(Duration::from_secs(20))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _: () = s.admin.del(&s.name).await.unwrap();
    let _: () = s
        .admin
        .publish(format!("redisson_rwlock:{{{}}}", s.name), 1)
        .await
        .unwrap();
    let read = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the reader was not woken by Redisson's unlock message")
        .unwrap()
        .unwrap();
    read.release().await.unwrap();
}

/// Every field of `hash` that lockkit added (`lockkit-*`); the rest is Redisson's.
type Fields = Vec<(String, String)>;

fn split(fields: Fields) -> (Fields, Fields) {
    let (mut ours, mut redisson): (Vec<_>, Vec<_>) = fields
        .into_iter()
        .partition(|(f, _)| f.starts_with("lockkit-"));
    ours.sort();
    redisson.sort();
    for (field, value) in &ours {
        assert!(
            value.parse::<f64>().is_err(),
            "lockkit field {field} holds a number ({value}): Redisson's read unlock would loop on it"
        );
    }
    (ours, redisson)
}

#[tokio::test]
async fn lockkit_rw_holds_have_redissons_shape_at_every_step() {
    let Some(mut s) = setup().await else { return };
    let n = s.name.clone();
    let rw_channel = format!("redisson_rwlock:{{{n}}}");
    let mut listener = s.client.get_async_pubsub().await.unwrap();
    listener.subscribe(&rw_channel).await.unwrap();
    let owner = s.locker.owner();
    let o = owner.id().to_string();
    let timeout = |i: u32| format!("{{{n}}}:{o}:rwlock_timeout:{i}");

    // A read: mode=read, <o>=1, one timeout key with the lease.
    let read = owner.read(n.as_str()).ttl(TTL).await.unwrap();
    let (ours, redisson) = split(s.admin.hgetall(&n).await.unwrap());
    assert_eq!(
        redisson,
        vec![
            (o.clone(), "1".to_owned()),
            ("mode".to_owned(), "read".to_owned())
        ]
    );
    let names: Vec<&str> = ours.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(names.len(), 3, "attempt, holder, token: {ours:?}");
    assert!(names.contains(&format!("lockkit-token:{o}").as_str()));
    assert!(names.contains(&format!("lockkit-holder:{o}").as_str()));
    let one: String = s.admin.get(timeout(1)).await.unwrap();
    assert_eq!(one, "1");
    let pttl: i64 = s.admin.pttl(timeout(1)).await.unwrap();
    assert!((1..=30_000).contains(&pttl), "timeout key lease {pttl}");
    let hash_pttl: i64 = s.admin.pttl(&n).await.unwrap();
    assert!(hash_pttl >= pttl - 50, "the hash outlives the read lease");

    // A re-entry: <o>=2, a second timeout key.
    let again = owner.read(n.as_str()).ttl(TTL).await.unwrap();
    let count: String = s.admin.hget(&n, &o).await.unwrap();
    assert_eq!(count, "2");
    let two: bool = s.admin.exists(timeout(2)).await.unwrap();
    assert!(two);
    assert_eq!(
        again.release().await.unwrap(),
        Released::Partially { remaining: 1 }
    );
    let two: bool = s.admin.exists(timeout(2)).await.unwrap();
    assert!(!two, "a read release deletes the topmost timeout key");
    assert_eq!(read.release().await.unwrap(), Released::Fully);
    let exists: bool = s.admin.exists(&n).await.unwrap();
    assert!(!exists);
    let message = tokio::time::timeout(Duration::from_secs(5), listener.on_message().next())
        .await
        .expect("no read unlock message")
        .unwrap();
    assert_eq!(message.get_payload::<String>().unwrap(), "0");

    // A write, then a downgrade: mode=write, <o>:write=1, <o>=1; releasing the write leaves
    // mode=read and publishes 1.
    let write = owner.write(n.as_str()).ttl(TTL).await.unwrap();
    let (_, redisson) = split(s.admin.hgetall(&n).await.unwrap());
    assert_eq!(
        redisson,
        vec![
            (format!("{o}:write"), "1".to_owned()),
            ("mode".to_owned(), "write".to_owned())
        ]
    );
    let read = owner.read(n.as_str()).ttl(TTL).await.unwrap();
    let (_, redisson) = split(s.admin.hgetall(&n).await.unwrap());
    assert_eq!(
        redisson,
        vec![
            (o.clone(), "1".to_owned()),
            (format!("{o}:write"), "1".to_owned()),
            ("mode".to_owned(), "write".to_owned())
        ]
    );
    assert_eq!(write.release().await.unwrap(), Released::Fully);
    let (_, redisson) = split(s.admin.hgetall(&n).await.unwrap());
    assert_eq!(
        redisson,
        vec![
            (o.clone(), "1".to_owned()),
            ("mode".to_owned(), "read".to_owned())
        ]
    );
    let message = tokio::time::timeout(Duration::from_secs(5), listener.on_message().next())
        .await
        .expect("no write unlock message")
        .unwrap();
    assert_eq!(message.get_payload::<String>().unwrap(), "1");
    read.release().await.unwrap();
    let exists: bool = s.admin.exists(&n).await.unwrap();
    assert!(!exists);

    // The same owner's plain lock on its RW key is refused, never a silent re-entry.
    let read = owner.read(n.as_str()).ttl(TTL).await.unwrap();
    let request = lockkit_core::spi::AcquireRequest::new(
        lockkit_core::LockKey::new(n.as_str()).unwrap(),
        owner.id(),
        TTL,
        lockkit_core::LossSignal::new(),
    );
    let refused = s.locker.backend().try_acquire(&request).await;
    assert!(
        matches!(refused, Err(lockkit_core::Error::KindMismatch { .. })),
        "a mutex by the reader: {refused:?}"
    );
    read.release().await.unwrap();
}

#[tokio::test]
async fn lockkit_permits_have_redissons_shape_and_count_redisson_permits() {
    let Some(mut s) = setup().await else { return };
    let n = s.name.clone();
    let zset = format!("{{{n}}}:timeout");
    let channel = format!("redisson_sc:{{{n}}}");
    let mut listener = s.client.get_async_pubsub().await.unwrap();
    listener.subscribe(&channel).await.unwrap();
    let semaphore = s.locker.semaphore(n.as_str(), 2);
    let permit = semaphore.try_acquire().ttl(TTL).await.unwrap().unwrap();
    let available: i64 = s.admin.get(&n).await.unwrap();
    assert_eq!(available, 1, "the string holds the available permits");
    let permits: Vec<(Vec<u8>, f64)> = s.admin.zrange_withscores(&zset, 0, -1).await.unwrap();
    assert_eq!(permits.len(), 1);
    assert_eq!(permits[0].0.len(), 16, "a permit id is 16 raw bytes");
    let (seconds, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut s.admin).await.unwrap();
    let now_ms = seconds * 1000 + micros / 1000;
    let left = permits[0].1 - now_ms as f64;
    assert!(
        (25_000.0..=30_000.0).contains(&left),
        "score = server TIME + lease, {left} ms ahead"
    );
    // A Redisson client takes the other permit (its own clock; here the server's).
    let redisson_id = Uuid::new_v4().as_bytes().to_vec();
    let _: () = s
        .admin
        .zadd(&zset, &redisson_id, (now_ms + 30_000) as f64)
        .await
        .unwrap();
    let _: () = s.admin.decr(&n, 1).await.unwrap();
    assert!(
        semaphore.try_acquire().await.unwrap().is_none(),
        "a third permit of two"
    );
    let holders = semaphore.holders().await.unwrap();
    assert_eq!(holders.len(), 2, "{holders:?}");
    assert!(
        holders.iter().any(|h| h.token.is_none()),
        "Redisson's permit has no token"
    );
    permit.release().await.unwrap();
    let message = tokio::time::timeout(Duration::from_secs(5), listener.on_message().next())
        .await
        .expect("no release message")
        .unwrap();
    assert_eq!(
        message.get_payload::<String>().unwrap(),
        "1",
        "the new count"
    );
    let three = s.locker.semaphore(n.as_str(), 3).try_acquire().await;
    assert!(
        matches!(three, Err(lockkit_core::Error::KindMismatch { .. })),
        "2 permits asked as 3: {three:?}"
    );
    let _: () = s.admin.del(&[&n, &zset]).await.unwrap();
}

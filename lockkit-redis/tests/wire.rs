//! Pins the wire layout shared with Redisson's RLock by reading Redis directly after each
//! operation, so Java services on Redisson and Rust services on lockkit can share locks.

use std::time::Duration;

use futures_util::StreamExt;
use lockkit_conformance::env;
use lockkit_core::Locker;
use lockkit_core::spi::Released;
use lockkit_redis::RedisBackend;
use redis::AsyncCommands;
use uuid::Uuid;

struct Setup {
    locker: Locker,
    admin: redis::aio::MultiplexedConnection,
    client: redis::Client,
    name: String,
}

async fn setup(prefix: &str) -> Option<Setup> {
    let url = env::service_url("LOCKKIT_TEST_REDIS_URL")?;
    let backend = RedisBackend::connect(&format!("{url}?prefix={prefix}"))
        .await
        .unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let admin = client.get_multiplexed_async_connection().await.unwrap();
    Some(Setup {
        locker: Locker::new(backend),
        admin,
        client,
        name: format!("wire/{}", Uuid::new_v4().simple()),
    })
}

#[tokio::test]
async fn layout_matches_redisson_rlock_at_every_step() {
    let Some(mut s) = setup("app%3A").await else {
        return;
    };
    let hash = format!("app:{}", s.name);
    let channel = format!("redisson_lock__channel:{{{hash}}}");
    let counter = format!("redisson_lock_token:{{{hash}}}");

    let mut listener = s.client.get_async_pubsub().await.unwrap();
    listener.subscribe(&channel).await.unwrap();

    let owner = s.locker.owner();
    let field = owner.id().to_string();
    assert!(field.contains(':'), "owner field is <uuid>:<n>");

    let outer = owner
        .acquire(s.name.as_str())
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let fields: Vec<(String, String)> = s.admin.hgetall(&hash).await.unwrap();
    // The owner's hold count (Redisson's field), plus one marker per acquisition that
    // makes a retried request take effect once, the holder's identity and the hold's
    // token (Redisson ignores other fields).
    assert_eq!(
        fields
            .iter()
            .filter(|(f, _)| !f.starts_with("lockkit-attempt:")
                && f != "lockkit-holder"
                && f != "lockkit-token")
            .cloned()
            .collect::<Vec<_>>(),
        vec![(field.clone(), "1".to_owned())]
    );
    assert_eq!(
        fields.len(),
        4,
        "one attempt marker, one holder, one token: {fields:?}"
    );
    let kept = fields.iter().find(|(f, _)| f == "lockkit-token");
    assert_eq!(
        kept.map(|(_, v)| v.clone()),
        Some(format!("t{}", outer.token().get())),
        "the hold keeps its token, not a number (no hold count)"
    );
    let holder = fields
        .iter()
        .find(|(f, _)| f == "lockkit-holder")
        .and_then(|(_, v)| lockkit_core::HolderIdentity::decode(v))
        .expect("the holder field names this process");
    assert_eq!(holder.pid, std::process::id());
    let pttl: i64 = s.admin.pttl(&hash).await.unwrap();
    assert!(
        (1..=30_000).contains(&pttl),
        "PEXPIRE lease, got pttl {pttl}"
    );
    let token: u64 = s.admin.get(&counter).await.unwrap();
    assert_eq!(token, outer.token().get());

    let inner = owner
        .acquire(s.name.as_str())
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let count: String = s.admin.hget(&hash, &field).await.unwrap();
    assert_eq!(count, "2", "reentry increments the hold count");
    let token_after: u64 = s.admin.get(&counter).await.unwrap();
    assert_eq!(
        token_after, token,
        "reentry does not increment the fencing counter"
    );

    assert_eq!(
        inner.release().await.unwrap(),
        Released::Partially { remaining: 1 }
    );
    let count: String = s.admin.hget(&hash, &field).await.unwrap();
    assert_eq!(count, "1");

    assert_eq!(outer.release().await.unwrap(), Released::Fully);
    let exists: bool = s.admin.exists(&hash).await.unwrap();
    assert!(!exists, "the last release deletes the hash");
    let message = tokio::time::timeout(Duration::from_secs(5), listener.on_message().next())
        .await
        .expect("no unlock message published")
        .unwrap();
    assert_eq!(message.get_channel_name(), channel);
    assert_eq!(
        message.get_payload::<String>().unwrap(),
        "0",
        "Redisson's UNLOCK_MESSAGE"
    );

    let next = s.locker.acquire(s.name.as_str()).await.unwrap();
    let counted: u64 = s.admin.get(&counter).await.unwrap();
    assert!(
        next.token().get() > token && counted == next.token().get(),
        "a new holder's token is greater and is what the counter holds"
    );
    next.release().await.unwrap();
}

#[tokio::test]
async fn a_redisson_style_hold_excludes_lockkit_and_is_reported() {
    let Some(mut s) = setup("").await else { return };
    // What Redisson writes for a thread of another JVM.
    let redisson_field = format!("{}:42", Uuid::new_v4());
    let _: () = s.admin.hset(&s.name, &redisson_field, 1).await.unwrap();
    let _: () = s.admin.pexpire(&s.name, 30_000).await.unwrap();
    assert!(
        s.locker
            .try_acquire(s.name.as_str())
            .await
            .unwrap()
            .is_none()
    );
    let info = s.locker.inspect(s.name.as_str()).await.unwrap().unwrap();
    assert_eq!(info.owner, redisson_field);
    // Redisson's unlock: delete and publish 0; a lockkit waiter wakes at once.
    let waiter = {
        let locker = s.locker.clone();
        let name = s.name.clone();
        tokio::spawn(async move {
            locker
                .acquire(name.as_str())
                .wait(Duration::from_secs(20))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _: () = s.admin.del(&s.name).await.unwrap();
    let _: () = s
        .admin
        .publish(format!("redisson_lock__channel:{{{}}}", s.name), 0)
        .await
        .unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("waiter not woken by the unlock message")
        .unwrap()
        .unwrap();
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_plain_string_from_another_client_counts_as_held() {
    let Some(mut s) = setup("").await else { return };
    let _: () = s.admin.set_ex(&s.name, "someone-else", 30).await.unwrap();
    assert!(
        s.locker
            .try_acquire(s.name.as_str())
            .await
            .unwrap()
            .is_none(),
        "held, not an error"
    );
    let info = s.locker.inspect(s.name.as_str()).await.unwrap().unwrap();
    assert!(info.owner.contains("someone-else"), "{}", info.owner);
    let err = s
        .locker
        .acquire(s.name.as_str())
        .wait(Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, lockkit_core::Error::Timeout { .. }), "{err}");
    let value: String = s.admin.get(&s.name).await.unwrap();
    assert_eq!(value, "someone-else", "the foreign value is untouched");
    let _: () = s.admin.del(&s.name).await.unwrap();
}

#[tokio::test]
async fn a_server_that_is_down_is_a_typed_retryable_error() {
    // Port 1 on loopback: nothing listens there.
    let err = RedisBackend::connect("redis://127.0.0.1:1?connect_timeout=500ms")
        .await
        .unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(
        err.to_string().contains("127.0.0.1:1"),
        "names the server: {err}"
    );
}

#[tokio::test]
async fn tokens_never_fall_behind_the_server_clock_even_after_the_counter_is_lost() {
    let Some(mut s) = setup("").await else {
        return;
    };
    let counter = format!("redisson_lock_token:{{{}}}", s.name);
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut s.admin).await.unwrap();
    let before = secs * 1_000_000 + micros;
    let first = s.locker.acquire(s.name.as_str()).await.unwrap();
    assert!(
        first.token().get() > before,
        "a new counter starts from the server clock: token {} vs TIME {before}",
        first.token()
    );
    let first_token = first.token();
    first.release().await.unwrap();
    // The server forgets the counter (a restart without persistence, a failover to a
    // replica that never saw it): the next holder must still get a greater token.
    let _: () = s.admin.del(&counter).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2)).await;
    let second = s.locker.acquire(s.name.as_str()).await.unwrap();
    assert!(
        second.token() > first_token,
        "token {} after the counter was lost is not greater than {first_token}",
        second.token()
    );
    second.release().await.unwrap();
}

/// A new holder's token is the counter plus one when the counter is at or past the clock
/// (an operator's or a peer's counter far ahead), and the counter follows it; a counter that
/// is not an integer, or not a string, refuses the grant and is left as it was (as `INCR`
/// refuses it), with no lock taken.
#[tokio::test]
async fn a_counter_ahead_of_the_clock_or_not_a_number_is_respected() {
    let Some(mut s) = setup("").await else {
        return;
    };
    let counter = format!("redisson_lock_token:{{{}}}", s.name);
    let ahead: u64 = 4_000_000_000_000_000; // year 2096 in µs: past any clock here
    let _: () = s.admin.set(&counter, ahead).await.unwrap();
    let guard = s.locker.acquire(s.name.as_str()).await.unwrap();
    assert_eq!(
        guard.token().get(),
        ahead + 1,
        "the counter ahead was not counted on"
    );
    let counted: u64 = s.admin.get(&counter).await.unwrap();
    assert_eq!(
        counted,
        ahead + 1,
        "the counter must hold the token handed out"
    );
    guard.release().await.unwrap();

    // Past 2^53 the script cannot count in Lua's doubles: `INCR` counts, exactly, and the
    // counter never goes back, also between grants and a Redisson client's `INCR`s
    // (helper-62's review: the first cut set it back from 2^53 + 1 to 2^53).
    let near: u64 = (1 << 53) - 1;
    let _: () = s.admin.set(&counter, near).await.unwrap();
    let mut last = near;
    for _ in 0..2 {
        let guard = s.locker.acquire(s.name.as_str()).await.unwrap();
        guard.release().await.unwrap();
        let counted: u64 = s.admin.get(&counter).await.unwrap();
        assert_eq!(counted, last + 1, "a grant past 2^53 did not count by one");
        let redisson: u64 = s.admin.incr(&counter, 1).await.unwrap();
        assert_eq!(redisson, last + 2);
        last += 2;
    }

    // What `INCR` refuses (not an integer, leading zeros, past 2^63 - 1) is refused, and
    // left as it was, its TTL with it.
    for (what, bad) in [
        ("not an integer", "12abc"),
        ("a fraction", "1.5"),
        ("with leading zeros", "007"),
        ("at 2^63 - 1", "9223372036854775807"),
        ("past 2^64", "99999999999999999999"),
    ] {
        let _: () = s.admin.set(&counter, bad).await.unwrap();
        let _: () = s.admin.pexpire(&counter, 600_000).await.unwrap();
        let refused = s.locker.try_acquire(s.name.as_str()).await;
        assert!(refused.is_err(), "a counter {what} gave {refused:?}");
        let kept: String = s.admin.get(&counter).await.unwrap();
        assert_eq!(kept, bad, "a counter {what} was overwritten");
        let ttl: i64 = s.admin.pttl(&counter).await.unwrap();
        assert!(ttl > 0, "a counter {what} lost its TTL");
        let exists: bool = s.admin.exists(&s.name).await.unwrap();
        assert!(!exists, "a refused grant left a lock behind ({what})");
    }

    let _: () = s.admin.del(&counter).await.unwrap();
    let _: () = s.admin.hset(&counter, "f", "v").await.unwrap();
    let refused = s.locker.try_acquire(s.name.as_str()).await;
    assert!(
        refused.is_err(),
        "a counter of another type gave {refused:?}"
    );
    let kind: String = redis::cmd("TYPE")
        .arg(&counter)
        .query_async(&mut s.admin)
        .await
        .unwrap();
    assert_eq!(kind, "hash");
    let exists: bool = s.admin.exists(&s.name).await.unwrap();
    assert!(
        !exists,
        "a refused grant left a lock behind (a hash counter)"
    );
    let _: () = s.admin.del(&counter).await.unwrap();
}

/// Drives the backend SPI directly, as a client library's retry would.
fn request(
    name: &str,
    owner: lockkit_core::OwnerId,
    ttl: Duration,
) -> lockkit_core::spi::AcquireRequest {
    lockkit_core::spi::AcquireRequest::new(
        lockkit_core::LockKey::new(name).unwrap(),
        owner,
        ttl,
        lockkit_core::LossSignal::new(),
    )
}

/// A backend driven through the SPI, an admin connection, a fresh lock name under `group`,
/// an owner and its hash field; `None` without a server.
async fn spi_setup(
    group: &str,
) -> Option<(
    RedisBackend,
    redis::aio::MultiplexedConnection,
    String,
    lockkit_core::OwnerId,
    String,
)> {
    let url = env::service_url("LOCKKIT_TEST_REDIS_URL")?;
    let backend = RedisBackend::connect(&url).await.unwrap();
    let admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let name = format!("wire/{group}/{}", Uuid::new_v4().simple());
    let owner = lockkit_core::OwnerId::random();
    let field = owner.to_string();
    Some((backend, admin, name, owner, field))
}

#[tokio::test]
async fn a_retried_acquire_or_release_takes_effect_once() {
    use lockkit_core::LockBackend;
    let Some((backend, mut admin, name, owner, field)) = spi_setup("retry").await else {
        return;
    };

    // A fresh owner's acquire sent twice (the first reply lost): one hold, not two.
    let req = request(&name, owner, Duration::from_secs(30));
    let first = backend.try_acquire(&req).await.unwrap().unwrap();
    let again = backend.try_acquire(&req).await.unwrap().unwrap();
    assert_eq!((first.depth, again.depth), (1, 1), "a retry added a hold");
    assert_eq!(again.token, first.token);
    let count: String = admin.hget(&name, &field).await.unwrap();
    assert_eq!(count, "1");

    // A reentrant hold released twice (the first reply lost): the outer hold survives.
    let inner = backend
        .try_acquire(&request(&name, owner, Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(inner.depth, 2);
    assert_eq!(
        backend.release(&inner).await.unwrap(),
        Released::Partially { remaining: 1 }
    );
    assert_eq!(
        backend.release(&inner).await.unwrap(),
        Released::Partially { remaining: 1 },
        "a retried release dropped the outer hold"
    );
    let count: String = admin.hget(&name, &field).await.unwrap();
    assert_eq!(count, "1", "the outer hold must still be counted");

    // A give-back for an attempt that never took effect here (a Redlock master whose vote
    // failed) changes nothing.
    let never = request(&name, owner, Duration::from_secs(30));
    let phantom =
        lockkit_core::spi::Grant::new(&never, first.token, 1, tokio::time::Instant::now());
    assert_eq!(
        backend.release(&phantom).await.unwrap(),
        Released::Partially { remaining: 1 }
    );
    let count: String = admin.hget(&name, &field).await.unwrap();
    assert_eq!(
        count, "1",
        "a give-back for a failed vote took the owner's hold"
    );

    assert_eq!(backend.release(&first).await.unwrap(), Released::Fully);
    let exists: bool = admin.exists(&name).await.unwrap();
    assert!(!exists);
}

#[tokio::test]
async fn a_lease_out_of_range_changes_nothing() {
    use lockkit_core::LockBackend;
    let Some((backend, mut admin, name, owner, _)) = spi_setup("absurd").await else {
        return;
    };
    // Past what PEXPIRE accepts: the script must refuse before writing anything.
    let absurd = request(&name, owner, Duration::from_secs(u64::MAX / 2000));
    assert!(backend.try_acquire(&absurd).await.is_err());
    let exists: bool = admin.exists(&name).await.unwrap();
    assert!(
        !exists,
        "a refused acquire left a lock behind (with no expiry)"
    );
    // The facade refuses it before any I/O, naming the limit.
    let locker = Locker::new(backend);
    let refused = locker
        .acquire(name.as_str())
        .ttl(Duration::from_secs(u64::MAX / 2000))
        .await;
    assert!(
        matches!(refused, Err(lockkit_core::Error::InvalidTtl { .. })),
        "{refused:?}"
    );
}

/// The release and renewal scripts read the hash with one `HMGET`: what is not the grant's
/// own (a plain string another client wrote over it, a read-write lock's hash where the
/// owner's field is a read count, a hash of another owner) is never changed, and a hold
/// count that is not an integer is an error, not a deletion.
#[tokio::test]
async fn release_and_renewal_leave_what_is_not_theirs_untouched() {
    use lockkit_core::{Error, LockBackend};
    let Some((backend, mut admin, name, owner, field)) = spi_setup("not-theirs").await else {
        return;
    };
    let grant = backend
        .try_acquire(&request(&name, owner, Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    let fields: Vec<(String, String)> = admin.hgetall(&name).await.unwrap();
    let attempt = fields
        .into_iter()
        .map(|(f, _)| f)
        .find(|f| f.starts_with("lockkit-attempt:"))
        .expect("the grant's attempt field");
    let refused = |outcome: Result<(), Error>, what: &str| {
        assert!(
            matches!(outcome, Err(Error::NotHeld { .. })),
            "{what}: {outcome:?}"
        );
    };

    let _: () = admin.set_ex(&name, "someone-else", 30).await.unwrap();
    refused(
        backend.release(&grant).await.map(drop),
        "release of a string",
    );
    refused(
        backend.renew(&grant, Duration::from_secs(60)).await,
        "renewal of a string",
    );
    let value: String = admin.get(&name).await.unwrap();
    assert_eq!(value, "someone-else");

    let _: () = admin.del(&name).await.unwrap();
    let _: () = admin
        .hset_multiple(&name, &[("mode", "read"), (field.as_str(), "1")])
        .await
        .unwrap();
    refused(
        backend.release(&grant).await.map(drop),
        "release of a rw hash",
    );
    refused(
        backend.renew(&grant, Duration::from_secs(60)).await,
        "renewal of a rw hash",
    );
    let mut fields: Vec<(String, String)> = admin.hgetall(&name).await.unwrap();
    fields.sort();
    let mut expected = vec![
        ("mode".to_owned(), "read".to_owned()),
        (field.clone(), "1".to_owned()),
    ];
    expected.sort();
    assert_eq!(fields, expected, "the read-write lock's hash changed");
    let pttl: i64 = admin.pttl(&name).await.unwrap();
    assert_eq!(pttl, -1, "a renewal set an expiry on another lock's hash");

    let _: () = admin.del(&name).await.unwrap();
    let _: () = admin.hset(&name, "other-owner:1", "1").await.unwrap();
    refused(
        backend.release(&grant).await.map(drop),
        "release of another owner's hold",
    );
    let count: String = admin.hget(&name, "other-owner:1").await.unwrap();
    assert_eq!(count, "1");

    // Counts `HINCRBY` would refuse, whether Lua's `tonumber` reads them or not, beside the
    // grant's own attempt field (without it the release would report the count and stop).
    for count in ["many", "1.0", "0x1", " 1"] {
        let _: () = admin.del(&name).await.unwrap();
        let _: () = admin
            .hset_multiple(&name, &[(field.as_str(), count), (attempt.as_str(), "1")])
            .await
            .unwrap();
        let outcome = backend.release(&grant).await;
        assert!(
            matches!(outcome, Err(Error::Backend { .. })),
            "a count of {count:?}: {outcome:?}"
        );
        let kept: Option<String> = admin.hget(&name, &field).await.unwrap();
        assert_eq!(
            kept.as_deref(),
            Some(count),
            "a hash whose count is {count:?} was changed"
        );
    }
    let _: () = admin.del(&name).await.unwrap();
}

//! Review 44 (helper-44): a second look at the fixes of reviews 41 to 43.
//!
//! Some tests here run a Redis server of their own (`redis-server` on `PATH`, on a free
//! port, stopped with `SIGSTOP` and resumed with `SIGCONT`), so that freezing it touches no
//! shared server; they say SKIPPED and pass when `redis-server` is missing (in CI they fail).

use std::time::{Duration, Instant};

use lockkit_conformance::OwnRedis;
use lockkit_core::{LockKey, Locker};
use lockkit_redis::RedisBackend;
use uuid::Uuid;

/// Keys held on `server` (`EXISTS`), through a connection of its own.
async fn exists(server: &OwnRedis, key: &str) -> bool {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(&mut conn)
        .await
        .unwrap()
        == 1
}

/// A server that is only stopped (`SIGSTOP`, a long `DEBUG SLEEP` or script, a VM
/// paused by its host) keeps its connections: its kernel still acknowledges, so the
/// commands written to it wait in order and run when it resumes (DirectConn's line order,
/// which give-backs rely on). Here a holder's release is written while the server is
/// stopped, behind other requests that filled the server's receive window; the server
/// resumes after a few seconds. The release must then land, and the key be free, not held
/// until its lease (60 s) ends.
///
/// Finding 1 (helper-44): with `TCP_USER_TIMEOUT` on the line (dfc2860), the kernel gave
/// the line up once the server's zero window had lasted `keepalive`: the commands not yet
/// in the server's buffer, the release among them, were lost with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_written_to_a_stopped_server_lands_when_it_resumes() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let url = format!(
        "redis://127.0.0.1:{}?keepalive=2s&response_timeout=500ms&connect_timeout=500ms",
        server.port
    );
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let key = LockKey::new(format!("review44/{}", Uuid::new_v4().simple())).unwrap();
    let guard = locker
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    // Every script used below is loaded (an `EVALSHA` of one the server does not know
    // would fail there, whatever the line); inspections of long keys fill the window below.
    let other = LockKey::new(format!("review44/{}", Uuid::new_v4().simple())).unwrap();
    locker
        .acquire(&other)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let long = |i: usize| LockKey::new(format!("review44/{i:06}/{}", "x".repeat(480))).unwrap();
    locker.inspect(&long(0)).await.unwrap();
    let lock_key = {
        let names = lockkit_redis::LockNames::new("", &key, false).unwrap();
        names.lock.clone()
    };
    assert!(exists(&server, &lock_key).await);

    server.signal("-STOP");
    // About 1 kB each: far more than the server's receive buffer (128 kB) and this side's
    // send buffer together.
    let mut floods = Vec::new();
    for i in 0..1_500 {
        let locker = locker.clone();
        let key = long(i);
        floods.push(tokio::spawn(async move {
            let _ = locker.inspect(&key).await;
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = guard.release().await;
    eprintln!("release while stopped: {released:?}");
    // Longer than the keepalive (2 s), far shorter than the lease.
    tokio::time::sleep(Duration::from_secs(8)).await;
    server.signal("-CONT");
    for flood in floods {
        let _ = flood.await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while exists(&server, &lock_key).await {
        assert!(
            Instant::now() < deadline,
            "the release written while the server was stopped never ran: the key stays held \
             until its lease ends (the stopped server's line was given up, and the commands \
             queued on it with it)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every `?keepalive=` the URL accepts gives connections that open and work; a longer one
/// is refused as a configuration error. Finding 2 (helper-44): a third of it is the
/// keepalive idle time, which Linux takes up to 32,767 s only (`TCP_KEEPIDLE`): up to
/// [`lockkit_redis::MAX_TIMEOUT`] (24.8 days) was accepted, and from `keepalive=27.4h` on
/// every connection then failed to open with `EINVAL`, reported as a (retryable) server
/// that cannot be reached.
#[tokio::test]
async fn every_keepalive_the_url_accepts_gives_working_connections() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    for keepalive in ["2s", "30s", "10h", "27.3h", "27.4h", "48h", "596h"] {
        let url = format!(
            "redis://127.0.0.1:{}?keepalive={keepalive}&connect_timeout=2s",
            server.port
        );
        let backend = match RedisBackend::connect(&url).await {
            Ok(backend) => backend,
            // Above the longest the kernel can do: refused up front, or working.
            Err(lockkit_core::Error::Config(e))
                if ["27.4h", "48h", "596h"].contains(&keepalive) =>
            {
                assert!(e.contains("keepalive"), "{e}");
                continue;
            }
            Err(e) => panic!("keepalive={keepalive}: {e:?}"),
        };
        let locker = Locker::new(backend);
        let key = LockKey::new(format!("review44/{}", Uuid::new_v4().simple())).unwrap();
        let guard = locker.try_acquire(&key).await;
        assert!(
            matches!(guard, Ok(Some(_))),
            "keepalive={keepalive}: {guard:?}"
        );
    }
}

//! Mixed fleet: redis-py's `Lock` (a plain `SET NX PX` string with a token) and lockkit on
//! the same key exclude each other, and a lockkit waiter behind a redis-py holder gets the
//! lock soon after redis-py lets go (redis-py publishes nothing, so lockkit looks again
//! every 100 ms instead of sleeping out the holder's TTL). Needs `$LOCKKIT_TEST_PYTHON` with
//! redis-py (scripts/services.sh installs it).

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use lockkit_conformance::env;
use lockkit_core::Locker;
use lockkit_redis::RedisBackend;
use uuid::Uuid;

const REDIS_PY: &str = r#"
import sys, time, redis
url, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
lock = redis.Redis.from_url(url).lock(name, timeout=20)
if mode == "hold":
    assert lock.acquire(blocking=True, blocking_timeout=20)
    print("held", flush=True)
    time.sleep(float(sys.argv[4]))
    lock.release()
    print("released", flush=True)
else:
    got = lock.acquire(blocking=False)
    print("got" if got else "busy", flush=True)
    if got:
        lock.release()
"#;

fn redis_py(python: &str, url: &str, name: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(python);
    cmd.args(["-c", REDIS_PY, url, name]).args(args);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_py_holder_excludes_lockkit_and_its_release_is_noticed_soon() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let Some(python) = env::service_url("LOCKKIT_TEST_PYTHON") else {
        return;
    };
    let name = format!("redis-py/{}", Uuid::new_v4().simple());
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let mut holder = redis_py(&python, &url, &name, &["hold", "1"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "held");
    assert!(
        locker.try_acquire(name.as_str()).await.unwrap().is_none(),
        "lockkit was granted a lock redis-py holds"
    );
    let waited = tokio::time::Instant::now();
    let guard = locker
        .acquire(name.as_str())
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit waiter must get the lock once redis-py releases");
    let waited = waited.elapsed();
    assert_eq!(lines.next().unwrap().unwrap(), "released");
    assert!(
        waited < Duration::from_secs(10),
        "granted {waited:?} after a 1 s redis-py hold with a 20 s TTL: it slept out the TTL"
    );
    guard.release().await.unwrap();
    assert!(holder.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_holder_excludes_redis_py() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let Some(python) = env::service_url("LOCKKIT_TEST_PYTHON") else {
        return;
    };
    let name = format!("redis-py/{}", Uuid::new_v4().simple());
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let guard = locker.acquire(name.as_str()).await.unwrap();
    let out = redis_py(&python, &url, &name, &["try"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "busy");
    guard.release().await.unwrap();
    let out = redis_py(&python, &url, &name, &["try"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "got");
}

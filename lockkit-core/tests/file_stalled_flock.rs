//! A key's file whose `flock` another process keeps (stopped in the middle of an operation):
//! waits and tries still end.
#![cfg(unix)]

use std::{path::PathBuf, time::Duration};

use lockkit_core::{Error, FileBackend, LockKey, Locker, spi::file_name};

fn temp_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lockkit-stalled-{name}-{}", uuid::Uuid::new_v4()))
}

/// The `flock` of `key`'s file, kept as a process stopped in the middle of an operation
/// keeps it, until the returned file is dropped.
fn keep_flock(dir: &std::path::Path, key: &LockKey) -> std::fs::File {
    let stopped = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(file_name(key)))
        .unwrap();
    stopped.lock().unwrap();
    stopped
}

/// Another process took a key's file `flock` for an operation and was stopped there
/// (SIGSTOP, a debugger): a wait of 300 ms still ends near its deadline with `Timeout`,
/// and a try does not wait for good either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_ends_at_its_deadline_while_a_stopped_process_keeps_the_flock() {
    let dir = temp_dir("flock");
    let locker = Locker::new(FileBackend::open(&dir).unwrap());
    let key = LockKey::new("k").unwrap();
    // The key's file exists (a first grant, released).
    locker
        .try_acquire(&key)
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    let stopped = keep_flock(&dir, &key);

    let waited = tokio::time::timeout(
        Duration::from_secs(20),
        locker.acquire(&key).wait(Duration::from_millis(300)),
    )
    .await;
    match waited {
        Ok(Err(Error::Timeout { .. })) => {}
        Ok(other) => panic!("{:?}", other.map(|g| g.token())),
        Err(_) => panic!("a wait of 300 ms was still waiting after 20 s"),
    }
    let tried = tokio::time::timeout(Duration::from_secs(20), locker.try_acquire(&key)).await;
    match tried {
        Ok(Ok(None))
        | Ok(Err(Error::Backend {
            retryable: true, ..
        })) => {}
        Ok(other) => panic!("{:?}", other.map(|g| g.map(|g| g.token()))),
        Err(_) => panic!("a try was still waiting after 20 s"),
    }

    // Once the process goes on (here: lets go), the key is free and nothing was left
    // behind by the attempts given up.
    drop(stopped);
    let guard = tokio::time::timeout(
        Duration::from_secs(20),
        locker.acquire(&key).wait(Duration::from_secs(10)),
    )
    .await
    .expect("granted once the flock is free")
    .unwrap();
    guard.release().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A release (and an inquiry) while another process keeps the key file's `flock` (stopped
/// in the middle of an operation) answers at the backend's bound with an error, and the
/// release still takes effect once that process goes on: before, both waited for as long as
/// the `flock` was kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_ends_while_a_stopped_process_keeps_the_flock() {
    let dir = temp_dir("release");
    let locker = Locker::new(FileBackend::open(&dir).unwrap());
    let key = LockKey::new("k").unwrap();
    let guard = locker
        .acquire(&key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap();
    let stopped = keep_flock(&dir, &key);

    let released = tokio::time::timeout(Duration::from_secs(30), guard.release()).await;
    match released {
        // Not retryable: the release goes on by itself (the error says so).
        Ok(Err(error)) => assert!(error.to_string().contains("background"), "{error}"),
        Ok(Ok(outcome)) => panic!("released through a kept flock: {outcome:?}"),
        Err(_) => panic!("a release was still waiting after 30 s"),
    }
    let inspected = tokio::time::timeout(Duration::from_secs(60), locker.inspect(&key)).await;
    assert!(
        matches!(inspected, Ok(Err(_))),
        "an inquiry through a kept flock: {:?}",
        inspected.map(|i| i.map(|h| h.is_some()))
    );

    // The process goes on: the release given up on takes effect, and the key (with a
    // 600 s lease) is free again well before that lease would have run out.
    drop(stopped);
    let other = Locker::new(FileBackend::open(&dir).unwrap());
    let guard = tokio::time::timeout(
        Duration::from_secs(60),
        other.acquire(&key).wait(Duration::from_secs(30)),
    )
    .await
    .expect("the released key was granted")
    .unwrap();
    guard.release().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `give_up` (operations given up on, one way or another) on a key whose file's
/// `flock` another process keeps, in a runtime with `blocking_threads` blocking threads;
/// then a free key must still be granted within `wait`, and, once the `flock` is free, the
/// stalled key too (nothing left behind).
fn with_a_stalled_key(
    name: &str,
    blocking_threads: usize,
    wait: Duration,
    give_up: impl AsyncFn(&Locker, &LockKey),
) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(blocking_threads)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let dir = temp_dir(name);
        let locker = Locker::new(FileBackend::open(&dir).unwrap());
        let key = LockKey::new("stalled").unwrap();
        locker
            .try_acquire(&key)
            .await
            .unwrap()
            .unwrap()
            .release()
            .await
            .unwrap();
        let stopped = keep_flock(&dir, &key);
        give_up(&locker, &key).await;
        let other = LockKey::new("other").unwrap();
        let granted =
            tokio::time::timeout(Duration::from_secs(20), locker.acquire(&other).wait(wait))
                .await
                .expect("still waiting after 20 s");
        let guard = granted.unwrap_or_else(|e| {
            panic!("a key nobody holds was refused while another key's flock is kept: {e}")
        });
        guard.release().await.unwrap();
        drop(stopped);
        let guard = tokio::time::timeout(
            Duration::from_secs(20),
            locker.acquire(&key).wait(Duration::from_secs(10)),
        )
        .await
        .expect("still waiting after 20 s")
        .unwrap();
        guard.release().await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Tries given up on a key whose `flock` a stopped process keeps must not each leave a
/// blocking thread waiting for it: a caller that retries a retryable error (as the error
/// says to) piled them up, one per try, until the runtime's blocking pool was all waiting
/// for that one `flock`, and every other key's operation that needs a blocking thread (a
/// new key's first grant syncs its ceiling there) was given up too. Here the pool has 3
/// threads and 5 tries are given up on the stalled key: another key must still be granted.
#[test]
fn tries_given_up_on_a_stalled_key_leave_other_keys_alone() {
    with_a_stalled_key("pileup", 3, Duration::from_secs(5), async |locker, key| {
        for _ in 0..5 {
            let tried = tokio::time::timeout(Duration::from_secs(20), locker.try_acquire(key))
                .await
                .expect("a try was still waiting after 20 s");
            assert!(tried.is_err() || matches!(tried, Ok(None)));
        }
    });
}

/// Review 39: tries that their *callers* drop (a `tokio::time::timeout` shorter than the
/// backend's own bound of a second, a `select!` on shutdown) while the key's file `flock`
/// is kept must not pile up blocking threads either. The attempt given up by its own bound
/// is noted as stalled, but one whose future is dropped was not: each dropped try left its
/// attempt, and the locker's give-back of it, on a blocking thread of their own, until the
/// pool (3 threads here) was all waiting for that one `flock` and a free key was refused.
#[test]
fn tries_dropped_by_their_callers_on_a_stalled_key_leave_other_keys_alone() {
    with_a_stalled_key("dropped", 3, Duration::from_secs(5), async |locker, key| {
        for _ in 0..5 {
            // The caller gives up first (its own timeout), before the backend's bound.
            let tried =
                tokio::time::timeout(Duration::from_millis(200), locker.try_acquire(key)).await;
            assert!(!matches!(tried, Ok(Ok(Some(_)))), "granted a kept key");
        }
    });
}

/// Review 39: with the file backend's response bound of 5 s (4edc33f), an inquiry is given
/// up at 5 s while another process keeps the key file's `flock`, but its operation goes on
/// waiting for that `flock` on a blocking thread. A caller that asks again (a monitor, a
/// status page) leaves one more blocking thread each time, until the pool (2 threads here)
/// is all waiting for that one `flock` and a free key's first grant (which syncs on a
/// blocking thread) is refused.
#[test]
fn inquiries_given_up_on_a_stalled_key_leave_other_keys_alone() {
    with_a_stalled_key(
        "inquiries",
        2,
        Duration::from_secs(3),
        async |locker, key| {
            for _ in 0..2 {
                let asked = tokio::time::timeout(Duration::from_secs(20), locker.inspect(key))
                    .await
                    .expect("an inquiry was still waiting after 20 s");
                assert!(asked.is_err(), "answered through a kept flock");
            }
        },
    );
}

//! A key's file whose `flock` another process keeps (stopped in the middle of an operation):
//! waits and tries still end.
#![cfg(unix)]

use std::{path::PathBuf, time::Duration};

use lockkit_core::{Error, FileBackend, LockKey, Locker, spi::file_name};

fn temp_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lockkit-stalled-{name}-{}", uuid::Uuid::new_v4()))
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
    let stopped = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(file_name(&key)))
        .unwrap();
    stopped.lock().unwrap();

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

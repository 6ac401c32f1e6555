//! A Tokio runtime built without its timers (`Builder::new_current_thread().build()`, no
//! `enable_all()`): lockkit says so with a typed error, and never panics in the caller.

use lockkit_core::{Error, FileBackend, LockKey, Locker, MemoryBackend};

fn timerless() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

fn says_timers(outcome: lockkit_core::Result<impl std::fmt::Debug>) -> bool {
    matches!(&outcome, Err(Error::Config(text)) if text.contains("enable_all"))
}

#[test]
fn a_runtime_without_timers_gets_a_typed_error() {
    let dir = std::env::temp_dir().join(format!("lockkit-timerless-{}", uuid::Uuid::new_v4()));
    let file = Locker::new(FileBackend::open(&dir).unwrap());
    let memory = Locker::new(MemoryBackend::new());
    let key = LockKey::new("k").unwrap();
    let outcomes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        timerless().block_on(async {
            let mut outcomes = Vec::new();
            for (name, locker) in [("file", &file), ("memory", &memory)] {
                let tried = locker.try_acquire(&key).await.map(|g| g.is_some());
                outcomes.push((name, "try_acquire", says_timers(tried)));
                let waited = locker
                    .acquire(&key)
                    .wait(std::time::Duration::from_secs(1))
                    .await
                    .map(|_| ());
                outcomes.push((name, "acquire", says_timers(waited)));
                let inspected = locker.inspect(&key).await.map(|h| h.is_some());
                outcomes.push((name, "inspect", says_timers(inspected)));
            }
            outcomes
        })
    }))
    .expect("lockkit panicked in a runtime without timers");
    let wrong: Vec<_> = outcomes.iter().filter(|(_, _, typed)| !typed).collect();
    assert!(wrong.is_empty(), "no typed error from {wrong:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

//! The holds that wait for their keeper wait on a timer thread of their own, not on a task of
//! some runtime: a runtime whose workers are all blocked holds back no other runtime's
//! holds. Alone in its test binary, so the stalled runtime is the first to take a hold (a
//! timer kept on a runtime would have started there).

use std::time::Duration;

use lockkit_core::{Locker, MemoryBackend};

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

#[test]
fn a_stalled_runtime_holds_back_no_other_runtimes_keeper() {
    let locker = Locker::new(MemoryBackend::new());
    let stalled = multi_thread();
    let first = stalled.block_on(async {
        locker
            .acquire("stall/first")
            .ttl(Duration::from_secs(30))
            .await
            .expect("granted")
    });
    let healthy = multi_thread();
    let ttl = Duration::from_millis(300);
    let guard = healthy.block_on(async {
        locker
            .acquire("stall/second")
            .ttl(ttl)
            .await
            .expect("granted")
    });
    // Every worker of the first runtime blocks (a caller's bug, but not this hold's).
    let stall = Duration::from_secs(3);
    let (started, blocked) = std::sync::mpsc::channel();
    for _ in 0..2 {
        let started = started.clone();
        stalled.spawn(async move {
            let _ = started.send(());
            std::thread::sleep(stall);
        });
    }
    for _ in 0..2 {
        blocked.recv().expect("a worker blocked");
    }
    healthy.block_on(async {
        tokio::time::sleep(ttl * 6).await;
        assert!(
            guard.is_valid(),
            "the hold's keeper waited for a blocked runtime and its lease ran out"
        );
        assert!(
            locker
                .try_acquire("stall/second")
                .await
                .expect("asked")
                .is_none(),
            "the key was free while its holder held it"
        );
        guard.release().await.expect("released");
    });
    drop(first);
}

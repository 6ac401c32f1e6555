//! A hold's keeper (watchdog renewals, local expiry, loss report) is spawned only when it is
//! first due: an uncontended acquire+release on a multi-thread runtime spawns no task, and
//! nothing a keeper does is lost or late for it (issue 13). The loss report is tested in
//! `keeper_start_loss.rs` (it installs the process's log subscriber), a stalled runtime in
//! `keeper_start_stall.rs` (it must be the first runtime to hold).

use std::time::Duration;

use lockkit_core::{Locker, LostReason, MemoryBackend};

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

#[test]
fn an_uncontended_hold_spawns_no_task() {
    let runtime = multi_thread();
    runtime.block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        locker
            .acquire("no-task/warm-up")
            .await
            .expect("granted")
            .release()
            .await
            .expect("released");
        // The warm-up's tasks (a keeper told to stop, on the old code) end first.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.num_alive_tasks();
        let guard = locker
            .acquire("no-task")
            .ttl(Duration::from_secs(30))
            .await
            .expect("granted");
        assert_eq!(
            metrics.num_alive_tasks(),
            before,
            "a hold far from its first renewal got a task of its own"
        );
        guard.release().await.expect("released");
    });
}

#[test]
fn a_hold_past_its_first_renewal_is_renewed() {
    let runtime = multi_thread();
    runtime.block_on(async {
        let backend = MemoryBackend::new();
        let locker = Locker::new(backend.clone());
        let ttl = Duration::from_millis(300);
        let guard = locker.acquire("renewed").ttl(ttl).await.expect("granted");
        tokio::time::sleep(ttl * 6).await;
        assert!(guard.is_valid(), "the watchdog never renewed the lease");
        assert!(
            locker
                .try_acquire("renewed")
                .await
                .expect("asked")
                .is_none(),
            "the lease ran out on the server while its holder held it"
        );
        guard.release().await.expect("released");
    });
}

#[test]
fn an_extension_to_a_shorter_ttl_before_the_first_renewal_is_kept() {
    let runtime = multi_thread();
    runtime.block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        let guard = locker
            .acquire("extended")
            .ttl(Duration::from_secs(30))
            .await
            .expect("granted");
        let short = Duration::from_millis(300);
        guard.extend(short).await.expect("extended");
        // The keeper was due at 10 s for the old TTL; the new one needs renewals every 100 ms.
        tokio::time::sleep(short * 6).await;
        assert!(guard.is_valid(), "nobody renewed the shortened lease");
        guard.release().await.expect("released");
    });
}

/// A runtime that shuts down while its hold waits for a keeper strands no hold of another
/// runtime (the timer is a thread of its own, not a task of the first runtime to hold).
#[test]
fn a_runtime_going_away_strands_no_other_runtimes_hold() {
    let locker = Locker::new(MemoryBackend::new());
    let first = multi_thread();
    let kept = first.block_on(async {
        locker
            .acquire("stranded/first")
            .ttl(Duration::from_secs(30))
            .await
            .expect("granted")
    });
    let second = multi_thread();
    let ttl = Duration::from_millis(400);
    let guard = second.block_on(async {
        locker
            .acquire("stranded/second")
            .ttl(ttl)
            .await
            .expect("granted")
    });
    drop(kept);
    first.shutdown_timeout(Duration::from_secs(10));
    second.block_on(async {
        tokio::time::sleep(ttl * 6).await;
        assert!(
            guard.is_valid(),
            "the hold's keeper never started after the other runtime went"
        );
        guard.release().await.expect("released");
    });
}

#[tokio::test(start_paused = true)]
async fn a_current_thread_runtime_keeps_its_own_clock() {
    let locker = Locker::new(MemoryBackend::new());
    let guard = locker
        .acquire("paused")
        .ttl(Duration::from_secs(5))
        .no_watchdog()
        .await
        .expect("granted");
    // Paused time jumps to the next timer: the keeper's local expiry.
    assert_eq!(guard.lost().await, LostReason::LeaseExpired);
}

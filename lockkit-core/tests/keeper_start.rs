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

/// No watchdog: the keeper is first due at the local expiry, and the loss fires then, not
/// before and not never.
#[test]
fn without_a_watchdog_the_loss_fires_at_the_local_expiry() {
    multi_thread().block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        let ttl = Duration::from_millis(300);
        let guard = locker
            .acquire("no-watchdog")
            .ttl(ttl)
            .no_watchdog()
            .await
            .expect("granted");
        let until = guard.valid_until().expect("valid");
        let reason = tokio::time::timeout(Duration::from_secs(60), guard.lost())
            .await
            .expect("the loss never fired");
        assert_eq!(reason, LostReason::LeaseExpired);
        assert!(
            tokio::time::Instant::now() >= until,
            "lost before its deadline"
        );
    });
}

/// A re-entry with a longer TTL before the keeper is due moves the local expiry later: the
/// loss comes at the new deadline, not the old one, and not never.
#[test]
fn a_longer_re_entry_before_the_keeper_is_due_moves_the_loss_later() {
    multi_thread().block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        let owner = locker.owner();
        let outer = locker
            .acquire("absorbed")
            .owner(&owner)
            .ttl(Duration::from_millis(300))
            .no_watchdog()
            .await
            .expect("granted");
        let inner = locker
            .acquire("absorbed")
            .owner(&owner)
            .ttl(Duration::from_millis(1_000))
            .no_watchdog()
            .await
            .expect("re-entered");
        assert_eq!(inner.depth(), 2);
        let until = outer.valid_until().expect("valid");
        let reason = tokio::time::timeout(Duration::from_secs(60), outer.lost())
            .await
            .expect("the loss never fired");
        assert_eq!(reason, LostReason::LeaseExpired);
        assert!(
            tokio::time::Instant::now() >= until,
            "lost before the re-entry's deadline"
        );
        drop(inner);
    });
}

/// A partial release before the first renewal must not stop the renewals of the rest.
#[test]
fn a_partial_release_before_the_first_renewal_keeps_the_renewals() {
    multi_thread().block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        let owner = locker.owner();
        let ttl = Duration::from_millis(300);
        let g1 = locker
            .acquire("partial")
            .owner(&owner)
            .ttl(ttl)
            .await
            .expect("granted");
        let g2 = locker
            .acquire("partial")
            .owner(&owner)
            .ttl(ttl)
            .await
            .expect("reentered");
        g2.release().await.expect("partial");
        tokio::time::sleep(ttl * 6).await;
        assert!(g1.is_valid(), "renewals stopped after a partial release");
        assert!(
            locker
                .try_acquire("partial")
                .await
                .expect("asked")
                .is_none()
        );
        g1.release().await.expect("released");
    });
}

/// Extending to a longer TTL before the first renewal: the hold is kept at the new period.
#[test]
fn an_extension_to_a_longer_ttl_before_the_first_renewal_is_kept() {
    multi_thread().block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        let guard = locker
            .acquire("longer")
            .ttl(Duration::from_millis(300))
            .await
            .expect("granted");
        guard
            .extend(Duration::from_millis(900))
            .await
            .expect("extended");
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(guard.is_valid());
        assert!(locker.try_acquire("longer").await.expect("asked").is_none());
        guard.release().await.expect("released");
    });
}

/// max_hold: renewals stop at the cap and the loss fires at the last lease's end.
#[test]
fn a_capped_hold_is_reported_lost_at_its_cap() {
    multi_thread().block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        let guard = locker
            .acquire("maxhold")
            .ttl(Duration::from_millis(300))
            .max_hold(Duration::from_millis(500))
            .await
            .expect("granted");
        let reason = tokio::time::timeout(Duration::from_secs(3), guard.lost())
            .await
            .expect("fired");
        assert_eq!(reason, LostReason::LeaseExpired);
    });
}

/// Many short holds dropped around their due time, others kept: every kept hold is
/// renewed, nothing hangs, and no task is left behind.
#[test]
fn holds_dropped_around_their_due_time_leave_the_others_kept() {
    let rt = multi_thread();
    rt.block_on(async {
        let locker = Locker::new(MemoryBackend::new());
        locker
            .acquire("churn/warm")
            .await
            .expect("g")
            .release()
            .await
            .expect("r");
        let metrics = tokio::runtime::Handle::current().metrics();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let before = metrics.num_alive_tasks();
        let mut kept = Vec::new();
        let mut tasks = Vec::new();
        for round in 0..20u64 {
            for i in 0..50u64 {
                let locker = locker.clone();
                tasks.push(tokio::spawn(async move {
                    let ttl = Duration::from_millis(30 + (i % 7));
                    let g = locker
                        .acquire(format!("churn/{round}/{i}"))
                        .ttl(ttl)
                        .await
                        .expect("granted");
                    tokio::time::sleep(Duration::from_micros(
                        9_000 + spread(round * 50 + i) % 3_000,
                    ))
                    .await;
                    drop(g);
                }));
            }
            kept.push(
                locker
                    .acquire(format!("churn/kept/{round}"))
                    .ttl(Duration::from_millis(400))
                    .await
                    .expect("granted"),
            );
        }
        for t in tasks {
            t.await.expect("task");
        }
        tokio::time::sleep(Duration::from_millis(800)).await;
        for (i, g) in kept.iter().enumerate() {
            assert!(g.is_valid(), "kept hold {i} not renewed");
        }
        drop(kept);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(metrics.num_alive_tasks(), before, "tasks left behind");
    });
}

fn spread(x: u64) -> u64 {
    x.wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        >> 33
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

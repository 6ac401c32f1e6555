//! Small measuring helpers shared by the backends' benchmarks.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use lockkit_core::{Locker, Result};

/// The `p` quantile (0.0..=1.0) of `samples`, which it sorts.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((samples.len() - 1) as f64 * p).round() as usize;
    samples[rank.min(samples.len() - 1)]
}

/// A duration in microseconds.
pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Hot-key handoff: `waiters` clients (each from `connect`) take `key` `rounds` times each;
/// returns every release-to-next-grant delay.
///
/// # Panics
/// When a client cannot take the key within two minutes: the benchmark is broken then.
pub async fn handoff<F, Fut>(connect: F, key: &str, waiters: usize, rounds: usize) -> Vec<Duration>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Locker>,
{
    try_handoff(
        || {
            let connecting = connect();
            async move { Ok(connecting.await) }
        },
        key,
        waiters,
        rounds,
    )
    .await
    .unwrap_or_else(|e| panic!("hot-key handoff failed: {e}"))
}

/// [`handoff`], failing with the first error a client meets instead of panicking.
///
/// # Errors
/// A client that cannot connect, or cannot take or release the key (each wait is at most
/// two minutes).
pub async fn try_handoff<F, Fut>(
    connect: F,
    key: &str,
    waiters: usize,
    rounds: usize,
) -> Result<Vec<Duration>>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Locker>>,
{
    let last_release: Arc<Mutex<Option<Instant>>> = Arc::default();
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..waiters {
        let locker = connect().await?;
        let (last_release, samples, key) = (last_release.clone(), samples.clone(), key.to_owned());
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let guard = locker
                    .acquire(key.as_str())
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(120))
                    .await?;
                let granted = Instant::now();
                let released = last_release
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                if let Some(released) = released {
                    samples
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(granted - released);
                }
                *last_release.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                guard.release().await?;
            }
            Result::Ok(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| {
            lockkit_core::Error::backend("bench", false, format!("a waiter task failed: {e}"))
        })??;
    }
    Ok(std::mem::take(
        &mut *samples.lock().unwrap_or_else(|e| e.into_inner()),
    ))
}

/// `n` uncontended acquire+release pairs through `locker` (30 s leases), over 50 keys in
/// turn: one sample each.
///
/// # Errors
/// The first acquisition or release that fails (a benchmark has nothing to measure then).
pub async fn uncontended(locker: &Locker, n: usize) -> Result<Vec<Duration>> {
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("bench/uncontended/{}", i % 50);
        let start = Instant::now();
        let guard = locker
            .acquire(key.as_str())
            .ttl(Duration::from_secs(30))
            .await?;
        guard.release().await?;
        samples.push(start.elapsed());
    }
    Ok(samples)
}

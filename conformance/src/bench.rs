//! Small measuring helpers shared by the backends' benchmarks.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use lockkit_core::Locker;

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
    let last_release: Arc<Mutex<Option<Instant>>> = Arc::default();
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..waiters {
        let locker = connect().await;
        let (last_release, samples, key) = (last_release.clone(), samples.clone(), key.to_owned());
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let guard = locker
                    .acquire(key.as_str())
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(120))
                    .await
                    .unwrap_or_else(|e| panic!("acquiring the hot key: {e}"));
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
                guard
                    .release()
                    .await
                    .unwrap_or_else(|e| panic!("releasing the hot key: {e}"));
            }
        }));
    }
    for task in tasks {
        task.await
            .unwrap_or_else(|e| panic!("a waiter failed: {e}"));
    }
    std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()))
}

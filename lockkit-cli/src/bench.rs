//! `lockkit bench`: the backend's own round trip, uncontended latency, throughput and
//! hot-key handoff, measured in one run and printed as ratios.

use std::time::{Duration, Instant};

use lockkit::Result;
use lockkit_conformance::bench::{micros as us, percentile, try_handoff};

/// What one run measured.
#[derive(Debug)]
pub struct Figures {
    backend: String,
    ping: Duration,
    lock_p50: Duration,
    lock_p99: Duration,
    lock_p999: Duration,
    per_second: f64,
    handoff_p50: Duration,
    handoff_p99: Duration,
}

impl Figures {
    fn ratio(&self) -> f64 {
        if self.ping.is_zero() {
            0.0
        } else {
            us(self.lock_p50) / us(self.ping)
        }
    }

    /// One JSON object.
    pub fn json(&self) -> String {
        format!(
            "{{\"backend\":{:?},\"round_trip_p50_us\":{:.1},\"lock_p50_us\":{:.1},\"lock_p99_us\":{:.1},\"lock_p999_us\":{:.1},\"lock_to_round_trip\":{:.2},\"acquire_release_per_s\":{:.0},\"handoff_p50_us\":{:.1},\"handoff_p99_us\":{:.1}}}",
            self.backend,
            us(self.ping),
            us(self.lock_p50),
            us(self.lock_p99),
            us(self.lock_p999),
            self.ratio(),
            self.per_second,
            us(self.handoff_p50),
            us(self.handoff_p99)
        )
    }

    /// A readable table.
    pub fn text(&self) -> String {
        format!(
            "backend                         {}\n\
             backend round trip (p50)        {:>10.1} us\n\
             acquire+release p50/p99/p99.9   {:>10.1} / {:.1} / {:.1} us  ({:.2}x the round trip)\n\
             throughput                      {:>10.0} acquire+release/s\n\
             hot-key handoff p50/p99         {:>10.1} / {:.1} us",
            self.backend,
            us(self.ping),
            us(self.lock_p50),
            us(self.lock_p99),
            us(self.lock_p999),
            self.ratio(),
            self.per_second,
            us(self.handoff_p50),
            us(self.handoff_p99)
        )
    }
}

/// Runs every measurement against `url`.
pub async fn run(url: &str, clients: u32, keys: u32, duration: Duration) -> Result<Figures> {
    let locker = lockkit::connect(url).await?;
    let prefix = format!("bench/{}", std::process::id());
    let keys = keys.max(1);
    let mut progress = crate::progress::Progress::new(4);

    // The backend's own round trip.
    progress.step("the backend's round trip (500 pings)");
    let mut pings = Vec::new();
    for i in 0..600 {
        let start = Instant::now();
        locker.backend().ping().await?;
        if i >= 100 {
            pings.push(start.elapsed());
        }
    }

    // Uncontended acquire+release on one client.
    progress.step("uncontended acquire + release (1,000 rounds)");
    let mut locks = Vec::new();
    for i in 0..1100u32 {
        let key = format!("{prefix}/u/{}", i % keys);
        let start = Instant::now();
        let guard = locker.acquire(key.as_str()).await?;
        guard.release().await?;
        if i >= 100 {
            locks.push(start.elapsed());
        }
    }

    // Throughput: `clients` clients over `keys` keys for `duration`.
    progress.step(&format!(
        "throughput: {clients} clients over {keys} keys for {duration:?}"
    ));
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for c in 0..clients.max(1) {
        let locker = lockkit::connect(url).await?;
        let prefix = prefix.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            let mut i = c;
            while Instant::now() < deadline {
                let key = format!("{prefix}/t/{}", i % keys);
                if let Some(guard) = locker.try_acquire(key.as_str()).await? {
                    guard.release().await?;
                    done += 1;
                }
                i = i.wrapping_add(clients);
            }
            Result::Ok(done)
        }));
    }
    let mut done = 0;
    for task in tasks {
        if let Ok(count) = task.await {
            done += count?;
        }
    }
    let per_second = done as f64 / duration.as_secs_f64();

    // Handoff: `clients` waiters on one hot key.
    progress.step(&format!("handoff: {clients} waiters on one key"));
    let hot = format!("{prefix}/hot");
    let mut handoffs = try_handoff(
        || lockkit::connect(url),
        &hot,
        usize::try_from(clients.max(1)).unwrap_or(1),
        10,
    )
    .await?;
    drop(progress);

    Ok(Figures {
        backend: lockkit::config::redact_url(url),
        ping: percentile(&mut pings, 0.5),
        lock_p50: percentile(&mut locks, 0.5),
        lock_p99: percentile(&mut locks, 0.99),
        lock_p999: percentile(&mut locks, 0.999),
        per_second,
        handoff_p50: percentile(&mut handoffs, 0.5),
        handoff_p99: percentile(&mut handoffs, 0.99),
    })
}

//! The 16-client handoff of the peer benchmark, longer and with the servers' own count of
//! the commands it cost: 16 lockkit clients (one `Locker` each) take and give back one key
//! `rounds` times each; prints the p50/p99 in µs of the time from one grant to the next
//! (the holder's release included) and, per handoff, the commands every server ran
//! (`INFO commandstats`, summed over the servers of the URL). Run with `cargo run --release
//! -p lockkit-bench --example handoff -- [rounds] [runs] URL` (a `redis://` or
//! `redlock://` URL; 50 rounds and 3 runs by default).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CLIENTS: usize = 16;

/// Every command's call count on the server at `url`.
async fn command_calls(url: &str) -> BTreeMap<String, u64> {
    let client = redis::Client::open(url).expect("a Redis URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("the server answers");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO commandstats");
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|field| field.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

async fn all_calls(servers: &[String]) -> BTreeMap<String, u64> {
    let mut sum = BTreeMap::new();
    for server in servers {
        for (name, calls) in command_calls(server).await {
            *sum.entry(name).or_insert(0) += calls;
        }
    }
    sum
}

fn percentile(sorted: &[u128], q: f64) -> u128 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = args.last().expect("a redis:// or redlock:// URL").clone();
    let rounds: usize = args
        .first()
        .filter(|_| args.len() > 1)
        .map_or(50, |n| n.parse().expect("rounds"));
    let runs: usize = args
        .get(1)
        .filter(|_| args.len() > 2)
        .map_or(3, |n| n.parse().expect("runs"));
    let servers: Vec<String> = url
        .split_once("://")
        .map(|(_, rest)| rest.split(['/', '?']).next().unwrap_or_default())
        .unwrap_or_default()
        .split(',')
        .map(|host| format!("redis://{host}"))
        .collect();
    let mut lockers = Vec::new();
    for _ in 0..CLIENTS {
        lockers.push(lockkit::connect(&url).await.expect("lockkit connects"));
    }
    for run in 0..runs {
        let key = format!("handoff/{}/{run}", std::process::id());
        let before = all_calls(&servers).await;
        let last_grant: Arc<Mutex<Option<Instant>>> = Arc::default();
        let gaps: Arc<Mutex<Vec<u128>>> = Arc::default();
        let started = Instant::now();
        let mut tasks = Vec::new();
        for locker in &lockers {
            let (locker, key) = (locker.clone(), key.clone());
            let (last_grant, gaps) = (last_grant.clone(), gaps.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..rounds {
                    let guard = locker
                        .acquire(key.as_str())
                        .ttl(Duration::from_secs(30))
                        .wait(Duration::from_secs(120))
                        .await
                        .expect("granted within two minutes");
                    let now = Instant::now();
                    {
                        let mut last = last_grant.lock().expect("not poisoned");
                        if let Some(at) = last.replace(now) {
                            gaps.lock()
                                .expect("not poisoned")
                                .push((now - at).as_micros());
                        }
                    }
                    guard.release().await.expect("released");
                }
            }));
        }
        for task in tasks {
            task.await.expect("a client task ends");
        }
        let took = started.elapsed();
        let after = all_calls(&servers).await;
        let mut gaps = std::mem::take(&mut *gaps.lock().expect("not poisoned"));
        gaps.sort_unstable();
        let handoffs = gaps.len() as f64;
        let per_handoff: Vec<String> = after
            .iter()
            .filter_map(|(name, calls)| {
                let delta = calls - before.get(name).copied().unwrap_or(0);
                (delta > 0 && name != "info")
                    .then(|| format!("{name} {:.2}", delta as f64 / handoffs))
            })
            .collect();
        println!(
            "run {run}: {} handoffs in {:.2} s; p50 {} µs, p99 {} µs; per handoff: {}",
            gaps.len(),
            took.as_secs_f64(),
            percentile(&gaps, 0.5),
            percentile(&gaps, 0.99),
            per_handoff.join(", ")
        );
    }
}

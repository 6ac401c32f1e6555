//! MySQL lock benchmark, both modes, next to a `SELECT 1` round trip from the same run.
//!
//! ```text
//! eval "$(scripts/services.sh env)"
//! cargo bench -p lockkit-mysql --bench mysql
//! ```

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use lockkit_core::Locker;
use lockkit_mysql::MysqlBackend;
use sqlx::{Connection, MySqlConnection};

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

fn p99(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples
        .get(samples.len() * 99 / 100)
        .copied()
        .unwrap_or_default()
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

async fn select_one(url: &str, n: usize) -> Vec<Duration> {
    let mut conn = MySqlConnection::connect(url).await.expect("connect");
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        let _: (i32,) = sqlx::query_as("SELECT 1")
            .fetch_one(&mut conn)
            .await
            .expect("select");
        samples.push(start.elapsed());
    }
    samples
}

async fn uncontended(locker: &Locker, n: usize) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("bench/uncontended/{}", i % 50);
        let start = Instant::now();
        let guard = locker
            .acquire(key.as_str())
            .ttl(Duration::from_secs(30))
            .await
            .expect("acquire");
        guard.release().await.expect("release");
        samples.push(start.elapsed());
    }
    samples
}

async fn handoff(url: &str, waiters: usize, rounds: usize) -> Vec<Duration> {
    let last_release: Arc<Mutex<Option<Instant>>> = Arc::default();
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..waiters {
        let locker = Locker::new(MysqlBackend::connect(url).await.expect("connect"));
        let (last_release, samples) = (last_release.clone(), samples.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let guard = locker
                    .acquire("bench/hot")
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(120))
                    .await
                    .expect("acquire hot key");
                let granted = Instant::now();
                if let Some(released) = last_release.lock().unwrap().take() {
                    samples.lock().unwrap().push(granted - released);
                }
                *last_release.lock().unwrap() = Some(Instant::now());
                guard.release().await.expect("release hot key");
            }
        }));
    }
    for task in tasks {
        task.await.expect("waiter");
    }
    let mut collected = samples.lock().unwrap();
    std::mem::take(&mut *collected)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Ok(url) = std::env::var("LOCKKIT_TEST_MYSQL_URL") else {
        eprintln!("set LOCKKIT_TEST_MYSQL_URL (eval \"$(scripts/services.sh env)\")");
        return;
    };
    let _ = select_one(&url, 200).await;
    let mut select = select_one(&url, 2000).await;
    let select50 = median(&mut select);
    println!("SELECT 1 median               {:>8.1} us", us(select50));
    let mut json = vec![format!("\"select1_p50_us\":{:.1}", us(select50))];
    for (mode, table) in [
        ("row", "lockkit_bench_row"),
        ("for-update", "lockkit_bench_fu"),
    ] {
        let mode_url = format!("{url}?mode={mode}&table={table}&max_holds=40");
        let locker = Locker::new(MysqlBackend::connect(&mode_url).await.expect("connect"));
        let _ = uncontended(&locker, 100).await;
        let mut lock = uncontended(&locker, 1000).await;
        let mut hand = handoff(&mode_url, 16, 15).await;
        let (l50, l99, h50, h99) = (
            median(&mut lock),
            p99(&mut lock),
            median(&mut hand),
            p99(&mut hand),
        );
        println!(
            "{mode:<10} acquire+release  {:>8.1} us ({:.1}x SELECT 1), p99 {:.1} us; handoff (16 waiters) median {:.1} us, p99 {:.1} us",
            us(l50),
            us(l50) / us(select50),
            us(l99),
            us(h50),
            us(h99)
        );
        let m = mode.replace('-', "_");
        json.push(format!(
            "\"{m}_lock_p50_us\":{:.1},\"{m}_ratio_to_select1\":{:.2},\"{m}_handoff_p50_us\":{:.1},\"{m}_handoff_p99_us\":{:.1}",
            us(l50), us(l50) / us(select50), us(h50), us(h99)
        ));
    }
    println!("{{{}}}", json.join(","));
}

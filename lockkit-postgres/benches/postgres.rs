//! PostgreSQL lock benchmark (row and advisory modes), next to a `SELECT 1` round trip and a plain
//! `pg_advisory_lock` + unlock from the same run.
//!
//! ```text
//! eval "$(scripts/services.sh env)"
//! cargo bench -p lockkit-postgres --bench postgres
//! ```

use std::time::{Duration, Instant};

use lockkit_conformance::bench::{handoff, micros as us, percentile, uncontended};
use lockkit_core::Locker;
use lockkit_postgres::PostgresBackend;
use sqlx::{Connection, PgConnection};

async fn select_one(url: &str, n: usize) -> Vec<Duration> {
    let mut conn = PgConnection::connect(url).await.expect("connect");
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

/// The floor a lock service on PostgreSQL could reach: a session advisory lock and its
/// unlock, two round trips, no lease, no fence.
async fn advisory(url: &str, n: usize) -> Vec<Duration> {
    let mut conn = PgConnection::connect(url).await.expect("connect");
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let key = 4_000_000_i64 + i64::try_from(i % 50).expect("small");
        let start = Instant::now();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(key)
            .execute(&mut conn)
            .await
            .expect("lock");
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(key)
            .execute(&mut conn)
            .await
            .expect("unlock");
        samples.push(start.elapsed());
    }
    samples
}

async fn handoffs(url: &str, waiters: usize, rounds: usize) -> Vec<Duration> {
    let connect = || async { Locker::new(PostgresBackend::connect(url).await.expect("connect")) };
    handoff(connect, "bench/hot", waiters, rounds).await
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Ok(url) = std::env::var("LOCKKIT_TEST_POSTGRES_URL") else {
        eprintln!("set LOCKKIT_TEST_POSTGRES_URL (eval \"$(scripts/services.sh env)\")");
        return;
    };
    let _ = select_one(&url, 200).await;
    let mut select = select_one(&url, 2000).await;
    let select50 = percentile(&mut select, 0.5);
    println!("SELECT 1 median               {:>8.1} us", us(select50));
    let mut json = vec![format!("\"select1_p50_us\":{:.1}", us(select50))];
    let _ = advisory(&url, 200).await;
    let mut raw = advisory(&url, 2000).await;
    let raw50 = percentile(&mut raw, 0.5);
    println!("pg_advisory_lock+unlock median {:>7.1} us", us(raw50));
    json.push(format!("\"advisory_p50_us\":{:.1}", us(raw50)));
    for (mode, table) in [
        ("row", "lockkit_bench_row"),
        ("advisory", "lockkit_bench_adv"),
    ] {
        let mode_url = format!("{url}?mode={mode}&table={table}");
        let locker = Locker::new(PostgresBackend::connect(&mode_url).await.expect("connect"));
        let _ = uncontended(&locker, 100).await.expect("warm-up");
        let mut lock = uncontended(&locker, 1000).await.expect("uncontended");
        let mut hand = handoffs(&mode_url, 16, 15).await;
        let (l50, l99, h50, h99) = (
            percentile(&mut lock, 0.5),
            percentile(&mut lock, 0.99),
            percentile(&mut hand, 0.5),
            percentile(&mut hand, 0.99),
        );
        println!(
            "{mode:<10} acquire+release  {:>8.1} us ({:.1}x SELECT 1, {:.1}x pg_advisory_lock+unlock), p99 {:.1} us; handoff (16 waiters) median {:.1} us, p99 {:.1} us",
            us(l50),
            us(l50) / us(select50),
            us(l50) / us(raw50),
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

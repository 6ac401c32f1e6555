//! Where a MySQL `mode=row` acquire+release's time goes beyond two commits (issue 13):
//! two one-row `UPDATE`s on one held connection, the same two through sqlx's pool (a
//! checkout per statement, and sqlx pings every connection given back), and lockkit's
//! pair on one key, interleaved in batches of 200, 3,000 of each. Run it against the
//! private servers: `eval "$(scripts/services.sh env)"; cargo run --release -p
//! lockkit-bench --example mysql_pool_probe`.
use std::time::{Duration, Instant};

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p) as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = std::env::var("LOCKKIT_TEST_MYSQL_URL").unwrap();
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    let mut held = pool.acquire().await.unwrap();
    for s in [
        "CREATE TABLE IF NOT EXISTS peerbench_floor (id INT PRIMARY KEY, n BIGINT NOT NULL) ENGINE=InnoDB",
        "INSERT IGNORE INTO peerbench_floor VALUES (1, 0)",
    ] {
        sqlx::query(s).execute(&mut *held).await.unwrap();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    let locker = lockkit::connect(&format!("{url}{sep}mode=row"))
        .await
        .unwrap();
    let key = format!("probe/{}/same", std::process::id());
    // `PROBE_ONLY=0|1|2` runs one of the three alone (to count its statements on the server).
    let only: Option<usize> = std::env::var("PROBE_ONLY")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut t: [Vec<f64>; 3] = [vec![], vec![], vec![]];
    for _round in 0..15 {
        #[allow(clippy::needless_range_loop)]
        for which in 0..3 {
            if only.is_some_and(|only| only != which) {
                continue;
            }
            for _ in 0..200 {
                let start = Instant::now();
                match which {
                    0 => {
                        for _ in 0..2 {
                            sqlx::query("UPDATE peerbench_floor SET n = n + 1 WHERE id = 1")
                                .execute(&mut *held)
                                .await
                                .unwrap();
                        }
                    }
                    1 => {
                        for _ in 0..2 {
                            sqlx::query("UPDATE peerbench_floor SET n = n + 1 WHERE id = 1")
                                .execute(&pool)
                                .await
                                .unwrap();
                        }
                    }
                    _ => {
                        let g = locker
                            .acquire(key.as_str())
                            .ttl(Duration::from_secs(30))
                            .await
                            .unwrap();
                        g.release().await.unwrap();
                    }
                }
                t[which].push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    for (name, v) in [
        "held conn, 2 UPDATEs",
        "pool, 2 UPDATEs",
        "lockkit row pair",
    ]
    .iter()
    .zip(t.iter_mut())
    {
        if !v.is_empty() {
            println!("{name:24} p50 {:7.1} p99 {:7.1}", pct(v, 0.5), pct(v, 0.99));
        }
    }
}

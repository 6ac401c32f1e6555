//! Redlock with one master of five down, lockkit beside rslock on the same masters: an
//! acquisition and its release (uncontended, a new key each time), p50/p99 in µs, with all
//! five masters answering, with the fifth refusing connections (a closed port: a master
//! killed), and with the fifth frozen (a port that accepts and never answers). Run with the
//! four live masters' URLs and nothing else: `cargo run --release -p lockkit-bench --example
//! redlock_minority -- [samples] redis://127.0.0.1:PORT ×4` (the fifth is made here for the
//! down cases; the all-answering case needs a fifth live URL as a fifth argument).

use std::time::{Duration, Instant};

use tokio::net::TcpListener;

/// A port nothing listens on.
async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    listener.local_addr().expect("its address").port()
}

/// A port that accepts connections and never answers on them.
async fn frozen_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let port = listener.local_addr().expect("its address").port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    port
}

fn percentiles(mut samples: Vec<u128>) -> String {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    format!("{} / {}", at(0.5), at(0.99))
}

async fn lockkit_pairs(masters: &[String], samples: usize, label: &str) -> String {
    let url = format!(
        "redlock://{}",
        masters
            .iter()
            .map(|url| url.trim_start_matches("redis://"))
            .collect::<Vec<_>>()
            .join(",")
    );
    let locker = lockkit::connect(&url).await.expect("lockkit connects");
    let mut took = Vec::with_capacity(samples);
    for round in 0..samples + 5 {
        let key = format!("minority/lockkit/{label}/{}/{round}", std::process::id());
        let started = Instant::now();
        let guard = locker
            .acquire(key.as_str())
            .ttl(Duration::from_secs(30))
            .await
            .expect("a quorum grants");
        guard.release().await.expect("released");
        if round >= 5 {
            took.push(started.elapsed().as_micros());
        }
    }
    percentiles(took)
}

async fn rslock_pairs(masters: &[String], samples: usize, label: &str) -> String {
    let manager = rslock::LockManager::new(masters.to_vec());
    let mut took = Vec::with_capacity(samples);
    for round in 0..samples + 5 {
        let key = format!("minority/rslock/{label}/{}/{round}", std::process::id());
        let started = Instant::now();
        let lock = manager
            .lock(key.as_bytes(), Duration::from_secs(30))
            .await
            .expect("a quorum grants");
        manager.unlock(&lock).await;
        if round >= 5 {
            took.push(started.elapsed().as_micros());
        }
    }
    percentiles(took)
}

#[tokio::main]
async fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let samples: usize = match args.first().map(|first| first.parse()) {
        Some(Ok(samples)) => {
            args.remove(0);
            samples
        }
        _ => 200,
    };
    assert!(
        args.len() == 4 || args.len() == 5,
        "four live redis:// URLs (and a fifth for the all-answering case)"
    );
    let live: Vec<String> = args.iter().take(4).cloned().collect();
    let mut cases: Vec<(&str, Vec<String>)> = Vec::new();
    if let Some(fifth) = args.get(4) {
        let mut all = live.clone();
        all.push(fifth.clone());
        cases.push(("all five answer", all));
    }
    let mut dead = live.clone();
    dead.push(format!("redis://127.0.0.1:{}", closed_port().await));
    cases.push(("the fifth refuses connections", dead));
    let mut frozen = live.clone();
    frozen.push(format!("redis://127.0.0.1:{}", frozen_port().await));
    cases.push(("the fifth is frozen", frozen));
    println!(
        "| masters | lockkit acquire+release, p50 / p99 µs | rslock lock+unlock, p50 / p99 µs |"
    );
    println!("|---|---|---|");
    for (label, masters) in cases {
        let tag = label.replace(' ', "-");
        let lockkit = lockkit_pairs(&masters, samples, &tag).await;
        let rslock = rslock_pairs(&masters, samples, &tag).await;
        println!("| {label} | {lockkit} | {rslock} |");
    }
}

//! Latency per uncontended acquire+release on one Redis key, for `perf stat` and `/usr/bin/time`
//! (CPU and context switches per pair): `cpu_per_pair <lockkit|rslock|redlock|rslock5|url|raw|ping> <pairs>`, with
//! `LOCKKIT_TEST_REDIS_URL` set (`scripts/services.sh env`; `redlock` and `rslock5` use
//! `LOCKKIT_TEST_REDLOCK_URL`'s five masters; `url` any backend at `CPP_URL`); `SPAWN=1` runs it in a task.
//! `cpu_per_pair throughput <seconds>` runs the peer benchmark's throughput scenario alone
//! (32 tasks over 1,000 keys, `try_acquire` + release, `CPP_URL` or the Redis URL) and prints
//! pairs/s and the pairs done, for `perf record` and `perf stat`; `throughput-set` the `SET` floor.
//! `cpu_per_pair wake <rounds>` times the wake of a waiter blocked 200-300 ms (release call to
//! its grant; `SHOW=1` prints when each release returned, `ALONE=1` drops the waiter), and
//! `wake-floor` / `wake-floor-rs` the same with a raw `PUBLISH` heard by a raw (or redis-rs)
//! subscriber that then sends a `PING`; `idle-ping` one `PING` after each such pause.
//! `cpu_per_pair hot <seconds>` has `TASKS` tasks (16) of one client take turns on one key,
//! each holding it `HOLD_MS` (0), at `CPP_URL` or the Redis URL, and prints holds/s and,
//! on a `redis://` URL, the server's script calls per hold (server-wide: run it alone);
//! `UNGATED=1` lets the client's waiters reach the server all at once (no waiter queue).
use std::time::{Duration, Instant};
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::var_os("SPAWN").is_some() {
        tokio::spawn(body()).await.unwrap();
    } else {
        body().await
    }
}
/// `n` uncontended pairs on one key through lockkit at `url`.
async fn lockkit_pairs(url: &str, n: usize, samples: &mut Vec<Duration>) {
    let locker = lockkit::connect(url).await.unwrap();
    for _ in 0..n {
        let s = Instant::now();
        let g = locker
            .acquire("cpu/same")
            .ttl(Duration::from_secs(30))
            .await
            .unwrap();
        g.release().await.unwrap();
        samples.push(s.elapsed());
    }
}

/// `n` uncontended pairs on one key through rslock over `masters`.
async fn rslock_pairs(masters: Vec<String>, n: usize, samples: &mut Vec<Duration>) {
    let m = rslock::LockManager::new(masters);
    for _ in 0..n {
        let s = Instant::now();
        let l = m.lock(b"cpu/rs", Duration::from_secs(30)).await.unwrap();
        m.unlock(&l).await;
        samples.push(s.elapsed());
    }
}

/// Who hears the floor's `PUBLISH`: a raw RESP connection, or redis-rs's subscriber (as
/// lockkit uses).
enum Subscriber {
    Raw(tokio::net::TcpStream),
    Rs {
        /// Kept: dropping it would end the subscription.
        _sink: redis::aio::PubSubSink,
        stream: redis::aio::PubSubStream,
    },
}

impl Subscriber {
    async fn new(url: &str, raw: bool) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        if !raw {
            let client = redis::Client::open(url).unwrap();
            let (mut sink, stream) = client.get_async_pubsub().await.unwrap().split();
            sink.subscribe("wf").await.unwrap();
            return Subscriber::Rs {
                _sink: sink,
                stream,
            };
        }
        let addr = url.trim_start_matches("redis://");
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        stream
            .write_all(b"*2\r\n$9\r\nSUBSCRIBE\r\n$2\r\nwf\r\n")
            .await
            .unwrap();
        let _ = stream.read(&mut [0u8; 256]).await.unwrap();
        Subscriber::Raw(stream)
    }

    /// Waits for the next message.
    async fn heard(&mut self) {
        use futures_util::StreamExt;
        use tokio::io::AsyncReadExt;
        match self {
            Subscriber::Raw(stream) => {
                let _ = stream.read(&mut [0u8; 256]).await.unwrap();
            }
            Subscriber::Rs { stream, .. } => {
                let _ = stream.next().await.unwrap();
            }
        }
    }
}

/// The floor under a wake: a subscriber idle for 200-300 ms hears a `PUBLISH` and sends a
/// `PING`; from the publisher's call to the `PING`'s reply, in raw RESP on this runtime
/// (`raw`: the subscriber too, else redis-rs's).
async fn wake_floor(url: &str, n: usize, samples: &mut Vec<Duration>, raw: bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = url.trim_start_matches("redis://").to_owned();
    let mut publisher = tokio::net::TcpStream::connect(&addr).await.unwrap();
    publisher.set_nodelay(true).unwrap();
    let mut subscriber = Subscriber::new(url, raw).await;
    let mut pinger = tokio::net::TcpStream::connect(&addr).await.unwrap();
    pinger.set_nodelay(true).unwrap();
    let mut buf = [0u8; 256];
    for round in 0..n {
        let waiting = tokio::spawn(async move {
            let mut buf = [0u8; 256];
            subscriber.heard().await;
            pinger.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
            let mut got = 0;
            while got < 7 {
                got += pinger.read(&mut buf[got..]).await.unwrap();
            }
            (Instant::now(), subscriber, pinger)
        });
        tokio::time::sleep(Duration::from_millis(200 + (round as u64 * 37) % 100)).await;
        let released = Instant::now();
        publisher
            .write_all(b"*3\r\n$7\r\nPUBLISH\r\n$2\r\nwf\r\n$1\r\n0\r\n")
            .await
            .unwrap();
        let _ = publisher.read(&mut buf).await.unwrap();
        let (granted, s, p) = waiting.await.unwrap();
        (subscriber, pinger) = (s, p);
        samples.push(granted - released);
    }
}

/// `n` wakes of a waiter blocked on a key another client holds.
async fn wakes(url: &str, n: usize, samples: &mut Vec<Duration>) {
    let holder = lockkit::connect(url).await.unwrap();
    let waiter = lockkit::connect(url).await.unwrap();
    for round in 0..n {
        let key = format!("cpu/wake/{}/{round}", std::process::id());
        let held = holder
            .acquire(key.as_str())
            .ttl(Duration::from_secs(30))
            .await
            .unwrap();
        let alone = std::env::var_os("ALONE").is_some();
        let waiting = {
            let (waiter, key) = (waiter.clone(), key.clone());
            tokio::spawn(async move {
                if alone {
                    return Instant::now();
                }
                let guard = waiter
                    .acquire(key.as_str())
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(60))
                    .await
                    .unwrap();
                let granted = Instant::now();
                guard.release().await.unwrap();
                granted
            })
        };
        tokio::time::sleep(Duration::from_millis(200 + (round as u64 * 37) % 100)).await;
        let released = Instant::now();
        held.release().await.unwrap();
        let returned = released.elapsed();
        let granted = waiting.await.unwrap() - released;
        if std::env::var_os("SHOW").is_some() {
            println!("release returned after {returned:?}, granted after {granted:?}");
        }
        samples.push(granted);
    }
}

/// The peer benchmark's throughput scenario: 32 tasks over 1,000 keys for `seconds`.
async fn throughput(url: &str, seconds: u64, set_floor: bool) {
    let locker = lockkit::connect(url).await.unwrap();
    let conn = redis::Client::open(std::env::var("LOCKKIT_TEST_REDIS_URL").unwrap())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut handles = Vec::new();
    for t in 0..32usize {
        let (locker, mut conn) = (locker.clone(), conn.clone());
        handles.push(tokio::spawn(async move {
            let (mut done, mut i) = (0u64, t);
            while Instant::now() < deadline {
                let key = format!("cpu/{}/{}", if set_floor { "set" } else { "t" }, i % 1000);
                if set_floor {
                    let () = redis::cmd("SET")
                        .arg(&key)
                        .arg("x")
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    done += 1;
                } else if let Some(guard) = locker.try_acquire(key.as_str()).await.unwrap() {
                    guard.release().await.unwrap();
                    done += 1;
                }
                i += 32;
            }
            done
        }));
    }
    let mut total = 0;
    for handle in handles {
        total += handle.await.unwrap();
    }
    println!(
        "throughput: {total} in {seconds} s, {:.0}/s",
        total as f64 / seconds as f64
    );
}

/// `TASKS` tasks (16 by default) of one client take turns on one key for `seconds`
/// (blocking `acquire` + release): handoffs per second, and the server's script calls per
/// handoff (`INFO commandstats`), which show how many local waiters each release wakes.
async fn hot(url: &str, seconds: u64) {
    let tasks: usize = std::env::var("TASKS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(16);
    let hold = Duration::from_millis(
        std::env::var("HOLD_MS")
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(0),
    );
    let locker = lockkit::connect(url).await.unwrap();
    let locker = if std::env::var("UNGATED").is_ok_and(|v| v == "1") {
        locker.without_waiter_gates()
    } else {
        locker
    };
    // Script calls are read from the server under test only when it is one Redis server.
    let mut conn = if url.starts_with("redis://") {
        Some(
            redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        )
    } else {
        None
    };
    let key = format!("cpu/hot/{}", std::process::id());
    async fn scripts(conn: &mut Option<redis::aio::MultiplexedConnection>) -> Option<u64> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(conn.as_mut()?)
            .await
            .unwrap();
        Some(
            info.lines()
                .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
                .filter_map(|l| {
                    l.split("calls=")
                        .nth(1)?
                        .split(',')
                        .next()?
                        .parse::<u64>()
                        .ok()
                })
                .sum(),
        )
    }
    let before = scripts(&mut conn).await;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (locker, key) = (locker.clone(), key.clone());
        handles.push(tokio::spawn(async move {
            let mut done = 0u64;
            while Instant::now() < deadline {
                let guard = locker
                    .acquire(key.as_str())
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(60))
                    .await
                    .unwrap();
                if !hold.is_zero() {
                    tokio::time::sleep(hold).await;
                }
                guard.release().await.unwrap();
                done += 1;
            }
            done
        }));
    }
    let mut total = 0;
    for handle in handles {
        total += handle.await.unwrap();
    }
    let per_hold = match (before, scripts(&mut conn).await) {
        (Some(before), Some(after)) => format!(
            ", {:.1} script calls per hold",
            (after - before) as f64 / total.max(1) as f64
        ),
        _ => String::new(),
    };
    println!(
        "hot: {tasks} tasks, hold {hold:?}, {total} holds in {seconds} s, {:.1}/s{per_hold}",
        total as f64 / seconds as f64,
    );
}

async fn body() {
    let args: Vec<String> = std::env::args().collect();
    let which = args[1].clone();
    if which.starts_with("throughput") {
        let url = std::env::var("CPP_URL")
            .or_else(|_| std::env::var("LOCKKIT_TEST_REDIS_URL"))
            .unwrap();
        return throughput(&url, args[2].parse().unwrap(), which == "throughput-set").await;
    }
    if which == "hot" {
        let url = std::env::var("CPP_URL")
            .or_else(|_| std::env::var("LOCKKIT_TEST_REDIS_URL"))
            .unwrap();
        return hot(&url, args[2].parse().unwrap()).await;
    }
    let n: usize = args[2].parse().unwrap();
    let url = std::env::var("LOCKKIT_TEST_REDIS_URL").unwrap();
    let mut samples = Vec::with_capacity(n);
    match which.as_str() {
        "lockkit" => lockkit_pairs(&url, n, &mut samples).await,
        "redlock" => {
            let url = std::env::var("LOCKKIT_TEST_REDLOCK_URL").unwrap();
            lockkit_pairs(&url, n, &mut samples).await
        }
        // Any backend: `CPP_URL` (say a `mysql://...?mode=for-update` URL).
        "url" => lockkit_pairs(&std::env::var("CPP_URL").unwrap(), n, &mut samples).await,
        // The wake of one blocked waiter (release call to the waiter's grant), `CPP_URL` or
        // the Redis URL.
        "idle-ping" => {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let addr = url.trim_start_matches("redis://").to_owned();
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.set_nodelay(true).unwrap();
            let mut buf = [0u8; 64];
            for round in 0..n {
                tokio::time::sleep(Duration::from_millis(200 + (round as u64 * 37) % 100)).await;
                let t = Instant::now();
                s.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
                let mut got = 0;
                while got < 7 {
                    got += s.read(&mut buf[got..]).await.unwrap();
                }
                samples.push(t.elapsed());
            }
        }
        "wake-floor-rs" => wake_floor(&url, n, &mut samples, false).await,
        "wake-floor" => wake_floor(&url, n, &mut samples, true).await,
        "wake" => {
            let url = std::env::var("CPP_URL").unwrap_or(url.clone());
            wakes(&url, n, &mut samples).await
        }
        "rslock" => rslock_pairs(vec![url.clone()], n, &mut samples).await,
        "rslock5" => {
            let url = std::env::var("LOCKKIT_TEST_REDLOCK_URL").unwrap();
            let masters = url
                .trim_start_matches("redlock://")
                .split(',')
                .map(|h| format!("redis://{h}"))
                .collect();
            rslock_pairs(masters, n, &mut samples).await
        }
        "raw" => {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let addr = url.trim_start_matches("redis://").to_owned();
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.set_nodelay(true).unwrap();
            let mut buf = [0u8; 64];
            for _ in 0..n {
                let t = Instant::now();
                for _ in 0..2 {
                    s.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
                    let mut got = 0;
                    while got < 7 {
                        got += s.read(&mut buf[got..]).await.unwrap();
                    }
                }
                samples.push(t.elapsed());
            }
        }
        _ => {
            let c = redis::Client::open(url.as_str()).unwrap();
            let mut con = c.get_multiplexed_async_connection().await.unwrap();
            for _ in 0..n {
                let s = Instant::now();
                let _: String = redis::cmd("PING").query_async(&mut con).await.unwrap();
                let _: String = redis::cmd("PING").query_async(&mut con).await.unwrap();
                samples.push(s.elapsed());
            }
        }
    }
    samples.sort();
    println!(
        "{which}: p50 {:?} p99 {:?}",
        samples[n / 2],
        samples[n * 99 / 100]
    );
}

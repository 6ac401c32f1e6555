//! The clients a run measures: lockkit, the peers (rslock in-process; redis-py, kazoo and
//! Curator as child processes speaking a line protocol), and each server's floor (the
//! fewest raw requests a lock could need).

use std::{
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures_util::future::join_all;
use lockkit::Locker;
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    process::{Child, ChildStdin, ChildStdout},
};

/// Microseconds of one sample.
pub type Micros = f64;

/// What went wrong while measuring (a message; the run reports it and goes on).
pub type Failure = String;

/// A measured scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// Uncontended acquire+release, always the same key.
    SameKey,
    /// Uncontended acquire+release, a key never used before each time.
    NewKey,
    /// A holder releases; one client blocked on the key takes it (release call to grant).
    Wake,
    /// 16 clients take one key in turn (release call to the next grant).
    Handoff,
}

fn us(d: Duration) -> Micros {
    d.as_secs_f64() * 1e6
}

/// A server's floor: the raw requests the simplest lock on it needs, on one connection.
#[allow(clippy::large_enum_variant)] // a handful of values per run
pub enum Floor {
    /// Redis `PING` (one round trip).
    Ping(redis::aio::MultiplexedConnection),
    /// Two `EVALSHA`s of a script that only returns, on one connection: what any lock made
    /// of an acquire script and a release script costs at the least (throughput: pairs).
    ScriptPair(redis::aio::MultiplexedConnection),
    /// `PING` to every master at once (one parallel round of Redlock).
    PingAll(Vec<redis::aio::MultiplexedConnection>),
    /// ZooKeeper: create an ephemeral node and delete it (two fsync'd writes).
    ZkCreateDelete(zookeeper_client::Client),
    /// `SELECT 1` on one MySQL connection.
    MysqlSelect1(sqlx::pool::PoolConnection<sqlx::MySql>),
    /// `GET_LOCK` + `RELEASE_LOCK` on one MySQL connection.
    MysqlGetLock(sqlx::pool::PoolConnection<sqlx::MySql>),
    /// Two autocommitted one-row `UPDATE`s on one MySQL connection: the writes a lease
    /// table needs at the least (a grant and a release), each a commit.
    MysqlTwoCommits(sqlx::pool::PoolConnection<sqlx::MySql>),
    /// The same on PostgreSQL (each commit waits for the WAL flush: `fsync=on`).
    PgTwoCommits(sqlx::pool::PoolConnection<sqlx::Postgres>),
    /// `SELECT 1` on one PostgreSQL connection.
    PgSelect1(sqlx::pool::PoolConnection<sqlx::Postgres>),
    /// `pg_advisory_lock` + `pg_advisory_unlock` on one PostgreSQL connection.
    PgAdvisory(sqlx::pool::PoolConnection<sqlx::Postgres>),
    /// etcd put + delete (two fsync'd writes).
    EtcdPutDelete(etcd_client::Client),
    /// `flock(LOCK_EX)` + `flock(LOCK_UN)` on an open file.
    Flock(std::fs::File),
}

/// One client under measurement.
#[allow(clippy::large_enum_variant)] // a handful of values per run
pub enum Subject {
    /// lockkit through its facade, from a URL.
    Lockkit {
        label: String,
        url: String,
        locker: Locker,
        prefix: String,
    },
    /// rslock 0.10 (in-process, same masters).
    Rslock {
        label: String,
        masters: Vec<String>,
        manager: rslock::LockManager,
    },
    /// A peer in a child process (`peers/peer.py`, `peers/CuratorPeer.java`).
    External {
        label: String,
        _child: Child,
        input: ChildStdin,
        output: Lines<BufReader<ChildStdout>>,
    },
    /// The server's floor.
    Floor { label: String, floor: Floor },
}

impl Subject {
    /// lockkit connected to `url`.
    pub async fn lockkit(label: &str, url: &str) -> Result<Self, Failure> {
        let locker = lockkit::connect(url).await.map_err(|e| e.to_string())?;
        Ok(Subject::Lockkit {
            label: label.to_owned(),
            url: url.to_owned(),
            locker,
            prefix: format!(
                "peerbench/{}/{}",
                std::process::id(),
                label.replace(' ', "-")
            ),
        })
    }

    /// rslock over `masters` (`redis://h:p` each).
    pub fn rslock(label: &str, masters: Vec<String>) -> Self {
        let manager = rslock::LockManager::new(masters.clone());
        Subject::Rslock {
            label: label.to_owned(),
            masters,
            manager,
        }
    }

    /// Starts a peer process (`program args...`) and waits for its `ready` line.
    pub async fn external(label: &str, program: &str, args: &[String]) -> Result<Self, Failure> {
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {program}: {e}"))?;
        let input = child.stdin.take().ok_or("no stdin")?;
        let output = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        let mut subject = Subject::External {
            label: label.to_owned(),
            _child: child,
            input,
            output,
        };
        let ready = tokio::time::timeout(Duration::from_secs(60), subject.read_line())
            .await
            .map_err(|_| format!("{label} did not start within 60 s"))??;
        if !ready.contains("ready") {
            return Err(format!("{label} did not start: {ready}"));
        }
        Ok(subject)
    }

    /// A floor.
    pub fn floor(label: &str, floor: Floor) -> Self {
        Subject::Floor {
            label: label.to_owned(),
            floor,
        }
    }

    /// The name in the table.
    pub fn label(&self) -> &str {
        match self {
            Subject::Lockkit { label, .. }
            | Subject::Rslock { label, .. }
            | Subject::External { label, .. }
            | Subject::Floor { label, .. } => label,
        }
    }

    /// Whether this is a floor (measured for the uncontended pair only).
    pub fn is_floor(&self) -> bool {
        matches!(self, Subject::Floor { .. })
    }

    /// Whether this is lockkit.
    pub fn is_lockkit(&self) -> bool {
        matches!(self, Subject::Lockkit { .. })
    }

    async fn read_line(&mut self) -> Result<String, Failure> {
        let Subject::External { output, label, .. } = self else {
            return Err("not a child process".into());
        };
        match output.next_line().await {
            Ok(Some(line)) => Ok(line),
            Ok(None) => Err(format!("{label} exited")),
            Err(e) => Err(format!("{label}: {e}")),
        }
    }

    /// Runs `scenario` `n` times (for `Handoff`: 16 clients, `n` rounds each) and returns
    /// one sample per operation, or `None` where the scenario does not apply.
    pub async fn run(
        &mut self,
        scenario: Scenario,
        n: usize,
    ) -> Result<Option<Vec<Micros>>, Failure> {
        if let Subject::Floor { floor, .. } = self {
            return match scenario {
                Scenario::SameKey => floor.samples(n).await.map(Some),
                _ => Ok(None),
            };
        }
        if let Subject::External { input, .. } = self {
            let command = match scenario {
                Scenario::SameKey => format!("same {n}\n"),
                Scenario::NewKey => format!("new {n}\n"),
                Scenario::Wake => format!("wake {n}\n"),
                Scenario::Handoff => format!("handoff 16 {n}\n"),
            };
            input
                .write_all(command.as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            input.flush().await.map_err(|e| e.to_string())?;
            let line = tokio::time::timeout(Duration::from_secs(600), self.read_line())
                .await
                .map_err(|_| "no answer within 10 minutes".to_owned())??;
            let value: serde_json::Value =
                serde_json::from_str(&line).map_err(|e| format!("{e}: {line}"))?;
            if let Some(error) = value.get("error") {
                return Err(error.to_string());
            }
            let samples = value
                .get("us")
                .and_then(|v| v.as_array())
                .ok_or_else(|| format!("no samples in {line}"))?
                .iter()
                .filter_map(serde_json::Value::as_f64)
                .collect();
            return Ok(Some(samples));
        }
        match scenario {
            Scenario::SameKey | Scenario::NewKey => self
                .uncontended(n, scenario == Scenario::NewKey)
                .await
                .map(Some),
            Scenario::Wake => self.wake(n).await.map(Some),
            Scenario::Handoff => self.handoff(16, n).await.map(Some),
        }
    }

    async fn uncontended(&mut self, n: usize, new_key: bool) -> Result<Vec<Micros>, Failure> {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let which = if new_key {
                format!(
                    "new/{}",
                    COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                )
            } else {
                "same".to_owned()
            };
            match self {
                Subject::Lockkit { locker, prefix, .. } => {
                    let key = format!("{prefix}/{which}");
                    let start = Instant::now();
                    let guard = locker
                        .acquire(key.as_str())
                        .ttl(Duration::from_secs(30))
                        .await
                        .map_err(|e| e.to_string())?;
                    guard.release().await.map_err(|e| e.to_string())?;
                    samples.push(us(start.elapsed()));
                }
                Subject::Rslock { manager, .. } => {
                    let key = format!("peerbench/rslock/{}/{which}", std::process::id());
                    let start = Instant::now();
                    let lock = manager
                        .lock(key.as_bytes(), Duration::from_secs(30))
                        .await
                        .map_err(|e| format!("rslock: {e:?}"))?;
                    manager.unlock(&lock).await;
                    samples.push(us(start.elapsed()));
                }
                _ => return Err("not an in-process client".into()),
            }
        }
        Ok(samples)
    }

    /// A second client of the same kind, for a waiter.
    async fn sibling(&self) -> Result<Subject, Failure> {
        match self {
            Subject::Lockkit { label, url, .. } => Subject::lockkit(label, url).await,
            Subject::Rslock { label, masters, .. } => Ok(Subject::rslock(label, masters.clone())),
            _ => Err("no sibling".into()),
        }
    }

    async fn wake(&mut self, rounds: usize) -> Result<Vec<Micros>, Failure> {
        let waiter = Arc::new(self.sibling().await?);
        let mut samples = Vec::with_capacity(rounds);
        for round in 0..rounds {
            let key = format!(
                "peerbench/{}/wake/{}/{round}",
                std::process::id(),
                fastrand_u64()
            );
            let held = self.take(&key).await?;
            let waiting = {
                let (waiter, key) = (waiter.clone(), key.clone());
                tokio::spawn(async move {
                    let hold = waiter.take(&key).await?;
                    let granted = Instant::now();
                    hold.give_back().await;
                    Ok::<Instant, Failure>(granted)
                })
            };
            // The waiter is blocked by now; a random phase, so that a polling client's
            // sleep is not in step with the release.
            tokio::time::sleep(Duration::from_millis(200 + fastrand_u64() % 100)).await;
            let released = Instant::now();
            held.give_back().await;
            let granted = tokio::time::timeout(Duration::from_secs(120), waiting)
                .await
                .map_err(|_| "wake: the waiter was never granted".to_owned())?
                .map_err(|e| e.to_string())??;
            samples.push(us(granted.saturating_duration_since(released)));
        }
        Ok(samples)
    }

    async fn handoff(&mut self, waiters: usize, rounds: usize) -> Result<Vec<Micros>, Failure> {
        let key = format!("peerbench/{}/hot/{}", std::process::id(), fastrand_u64());
        let released: Arc<Mutex<Option<Instant>>> = Arc::default();
        let samples: Arc<Mutex<Vec<Micros>>> = Arc::default();
        let mut tasks = Vec::new();
        for _ in 0..waiters {
            let client = self.sibling().await?;
            let (released, samples, key) = (released.clone(), samples.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..rounds {
                    let hold = client.take(&key).await?;
                    let granted = Instant::now();
                    {
                        let mut last = released.lock().unwrap_or_else(|e| e.into_inner());
                        if let Some(at) = last.take() {
                            samples
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(us(granted - at));
                        }
                        *last = Some(Instant::now());
                    }
                    hold.give_back().await;
                }
                Ok::<(), Failure>(())
            }));
        }
        for task in join_all(tasks).await {
            task.map_err(|e| e.to_string())??;
        }
        let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()));
        Ok(samples)
    }

    /// Blocks until `key` is held (two minutes at most).
    async fn take(&self, key: &str) -> Result<Hold<'_>, Failure> {
        match self {
            Subject::Lockkit { locker, prefix, .. } => {
                let guard = locker
                    .acquire(format!("{prefix}/{key}").as_str())
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(120))
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Hold::Lockkit(guard))
            }
            Subject::Rslock { manager, .. } => {
                let lock = tokio::time::timeout(
                    Duration::from_secs(120),
                    manager.acquire_no_guard(key.as_bytes(), Duration::from_secs(30)),
                )
                .await
                .map_err(|_| "rslock: not granted within 2 minutes".to_owned())?
                .map_err(|e| format!("rslock: {e:?}"))?;
                Ok(Hold::Rslock(manager, lock))
            }
            _ => Err("not an in-process client".into()),
        }
    }

    /// `tasks` tasks take and give back keys among `keys` for `run` with `try_acquire`;
    /// returns acquire+release pairs per second (lockkit, rslock with `lock`), `SET`s per
    /// second (the `PING` floor) or pairs of empty scripts per second (the script floor).
    pub async fn throughput(
        &self,
        tasks: usize,
        keys: usize,
        run: Duration,
    ) -> Result<Option<f64>, Failure> {
        let deadline = Instant::now() + run;
        let mut handles = Vec::new();
        match self {
            Subject::Lockkit { locker, prefix, .. } => {
                for t in 0..tasks {
                    let (locker, prefix) = (locker.clone(), prefix.clone());
                    handles.push(tokio::spawn(async move {
                        let (mut done, mut i) = (0u64, t);
                        while Instant::now() < deadline {
                            let key = format!("{prefix}/t/{}", i % keys);
                            if let Some(guard) = locker
                                .try_acquire(key.as_str())
                                .await
                                .map_err(|e| e.to_string())?
                            {
                                guard.release().await.map_err(|e| e.to_string())?;
                                done += 1;
                            }
                            i += tasks;
                        }
                        Ok::<u64, Failure>(done)
                    }));
                }
            }
            Subject::Floor {
                floor: Floor::Ping(conn),
                ..
            } => {
                for t in 0..tasks {
                    let mut conn = conn.clone();
                    handles.push(tokio::spawn(async move {
                        let (mut done, mut i) = (0u64, t);
                        while Instant::now() < deadline {
                            let () = redis::cmd("SET")
                                .arg(format!("peerbench/set/{}", i % keys))
                                .arg("x")
                                .query_async(&mut conn)
                                .await
                                .map_err(|e| e.to_string())?;
                            done += 1;
                            i += tasks;
                        }
                        Ok::<u64, Failure>(done)
                    }));
                }
            }
            Subject::Rslock { manager, .. } => {
                for t in 0..tasks {
                    let manager = manager.clone();
                    handles.push(tokio::spawn(async move {
                        let (mut done, mut i) = (0u64, t);
                        while Instant::now() < deadline {
                            let key = format!("peerbench/rslock/t/{}", i % keys);
                            // `lock` retries a busy key (3 times, 200 ms apart) and then
                            // gives up: rslock's nearest to a `try_acquire`.
                            if let Ok(lock) =
                                manager.lock(key.as_bytes(), Duration::from_secs(30)).await
                            {
                                manager.unlock(&lock).await;
                                done += 1;
                            }
                            i += tasks;
                        }
                        Ok::<u64, Failure>(done)
                    }));
                }
            }
            Subject::Floor {
                floor: Floor::ScriptPair(conn),
                ..
            } => {
                for _ in 0..tasks {
                    let mut conn = conn.clone();
                    handles.push(tokio::spawn(async move {
                        let mut done = 0u64;
                        while Instant::now() < deadline {
                            for _ in 0..2 {
                                let () = EMPTY_SCRIPT
                                    .invoke_async(&mut conn)
                                    .await
                                    .map_err(|e| e.to_string())?;
                            }
                            done += 1;
                        }
                        Ok::<u64, Failure>(done)
                    }));
                }
            }
            _ => return Ok(None),
        }
        let mut total = 0;
        for handle in join_all(handles).await {
            total += handle.map_err(|e| e.to_string())??;
        }
        Ok(Some(total as f64 / run.as_secs_f64()))
    }
}

/// A script that does nothing (returns nil), for [`Floor::ScriptPair`].
static EMPTY_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new("return nil"));

/// A held key of an in-process client.
enum Hold<'a> {
    Lockkit(lockkit::LockGuard),
    Rslock(&'a rslock::LockManager, rslock::Lock),
}

impl Hold<'_> {
    async fn give_back(self) {
        match self {
            Hold::Lockkit(guard) => {
                let _ = guard.release().await;
            }
            Hold::Rslock(manager, lock) => manager.unlock(&lock).await,
        }
    }
}

fn fastrand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

impl Floor {
    async fn samples(&mut self, n: usize) -> Result<Vec<Micros>, Failure> {
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            let start = Instant::now();
            match self {
                Floor::Ping(conn) => {
                    let _: String = redis::cmd("PING")
                        .query_async(conn)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Floor::ScriptPair(conn) => {
                    for _ in 0..2 {
                        let () = EMPTY_SCRIPT
                            .invoke_async(conn)
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                }
                Floor::PingAll(conns) => {
                    let pings = conns.iter_mut().map(|conn| async move {
                        redis::cmd("PING").query_async::<String>(conn).await
                    });
                    for answer in join_all(pings).await {
                        answer.map_err(|e| e.to_string())?;
                    }
                }
                Floor::ZkCreateDelete(client) => {
                    let path = format!("/peerbench-floor/n{}", i % 10);
                    let options = zookeeper_client::CreateMode::Ephemeral
                        .with_acls(zookeeper_client::Acls::anyone_all());
                    client
                        .create(&path, b"", &options)
                        .await
                        .map_err(|e| e.to_string())?;
                    client
                        .delete(&path, None)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Floor::MysqlSelect1(conn) => {
                    sqlx::query("SELECT 1")
                        .execute(&mut **conn)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Floor::MysqlGetLock(conn) => {
                    sqlx::query("SELECT GET_LOCK('peerbench-floor', 10)")
                        .execute(&mut **conn)
                        .await
                        .map_err(|e| e.to_string())?;
                    sqlx::query("SELECT RELEASE_LOCK('peerbench-floor')")
                        .execute(&mut **conn)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Floor::MysqlTwoCommits(conn) => {
                    for _ in 0..2 {
                        sqlx::query("UPDATE peerbench_floor SET n = n + 1 WHERE id = 1")
                            .execute(&mut **conn)
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                }
                Floor::PgTwoCommits(conn) => {
                    for _ in 0..2 {
                        sqlx::query("UPDATE peerbench_floor SET n = n + 1 WHERE id = 1")
                            .execute(&mut **conn)
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                }
                Floor::PgSelect1(conn) => {
                    sqlx::query("SELECT 1")
                        .execute(&mut **conn)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Floor::PgAdvisory(conn) => {
                    sqlx::query("SELECT pg_advisory_lock(424242)")
                        .execute(&mut **conn)
                        .await
                        .map_err(|e| e.to_string())?;
                    sqlx::query("SELECT pg_advisory_unlock(424242)")
                        .execute(&mut **conn)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Floor::EtcdPutDelete(client) => {
                    let key = format!("peerbench-floor/{}", i % 10);
                    client
                        .put(key.as_str(), "", None)
                        .await
                        .map_err(|e| e.to_string())?;
                    client
                        .delete(key.as_str(), None)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Floor::Flock(file) => {
                    rustix::fs::flock(&*file, rustix::fs::FlockOperation::LockExclusive)
                        .map_err(|e| e.to_string())?;
                    rustix::fs::flock(&*file, rustix::fs::FlockOperation::Unlock)
                        .map_err(|e| e.to_string())?;
                }
            }
            samples.push(us(start.elapsed()));
        }
        Ok(samples)
    }
}

/// Connects a floor, naming what failed.
pub async fn connect_floor(kind: &str, address: &str) -> Result<Floor, Failure> {
    let redis_conn = |url: String| async move {
        redis::Client::open(url.as_str())
            .map_err(|e| e.to_string())?
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())
    };
    Ok(match kind {
        "ping" => Floor::Ping(redis_conn(address.to_owned()).await?),
        "script-pair" => Floor::ScriptPair(redis_conn(address.to_owned()).await?),
        "ping-all" => {
            let mut conns = Vec::new();
            for node in address.split(',') {
                conns.push(redis_conn(format!("redis://{node}")).await?);
            }
            Floor::PingAll(conns)
        }
        "zk" => {
            let client = zookeeper_client::Client::connect(address)
                .await
                .map_err(|e| format!("zookeeper: {e}"))?;
            let _ = client
                .mkdir(
                    "/peerbench-floor",
                    &zookeeper_client::CreateMode::Persistent
                        .with_acls(zookeeper_client::Acls::anyone_all()),
                )
                .await;
            Floor::ZkCreateDelete(client)
        }
        "mysql-select" | "mysql-get-lock" | "mysql-commits" => {
            let pool = sqlx::MySqlPool::connect(address)
                .await
                .map_err(|e| e.to_string())?;
            let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
            match kind {
                "mysql-select" => Floor::MysqlSelect1(conn),
                "mysql-get-lock" => Floor::MysqlGetLock(conn),
                _ => {
                    for statement in [
                        "CREATE TABLE IF NOT EXISTS peerbench_floor (id INT PRIMARY KEY, n BIGINT NOT NULL) ENGINE=InnoDB",
                        "INSERT IGNORE INTO peerbench_floor VALUES (1, 0)",
                    ] {
                        sqlx::query(statement)
                            .execute(&mut *conn)
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    Floor::MysqlTwoCommits(conn)
                }
            }
        }
        "pg-select" | "pg-advisory" | "pg-commits" => {
            let pool = sqlx::PgPool::connect(address)
                .await
                .map_err(|e| e.to_string())?;
            let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
            match kind {
                "pg-select" => Floor::PgSelect1(conn),
                "pg-advisory" => Floor::PgAdvisory(conn),
                _ => {
                    for statement in [
                        "CREATE TABLE IF NOT EXISTS peerbench_floor (id INT PRIMARY KEY, n BIGINT NOT NULL)",
                        "INSERT INTO peerbench_floor VALUES (1, 0) ON CONFLICT DO NOTHING",
                    ] {
                        sqlx::query(statement)
                            .execute(&mut *conn)
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    Floor::PgTwoCommits(conn)
                }
            }
        }
        "etcd" => Floor::EtcdPutDelete(
            etcd_client::Client::connect([address], None)
                .await
                .map_err(|e| e.to_string())?,
        ),
        "flock" => Floor::Flock(
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(address)
                .map_err(|e| format!("{address}: {e}"))?,
        ),
        other => return Err(format!("unknown floor {other}")),
    })
}

//! The scenarios: what each one breaks, on which backend, and what it expects.

use std::{net::SocketAddr, time::Duration};

use lockkit_core::{Consistency, FencingToken, LockGuard, LockKey, Locker, LostReason};
use nix::sys::signal::Signal;
use tokio::time::Instant;
use uuid::Uuid;

use super::{
    Context, Lab, LabError, SCENARIO_LIMIT,
    child::ChildHolder,
    report::{Expect, LostSignal, Observed, Report, Stale, judge},
    servers::redis_command,
    store::FileFencedStore,
};
use lockkit_conformance::{
    FaultProxy, History,
    env::{host_ports, zk_mode},
    history::{HoldRecord, OpenHold},
};

/// What a scenario does to the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// A holder in a child process is SIGSTOPped past its lease.
    HolderPaused,
    /// `redis-single` is SIGSTOPped past the lease.
    RedisPaused,
    /// The ZooKeeper ensemble's leader is SIGSTOPped.
    ZkLeaderPaused,
    /// The holder's TCP link is cut by a proxy.
    CutOff,
    /// `redis-single` (no persistence) is SIGKILLed and restarted empty.
    RedisRestarted,
    /// `redis-aof` (appendfsync always) is SIGKILLed and restarted.
    RedisAofRestarted,
    /// The ZooKeeper ensemble's leader is SIGKILLed and restarted.
    ZkLeaderRestarted,
    /// MariaDB is restarted.
    MysqlRestarted,
    /// The primary dies before the grant reached the replica, which is promoted.
    Failover,
    /// Two of five Redlock masters are SIGKILLed while the lock is held.
    RedlockTwoDown,
    /// A Redlock master that granted the lock restarts empty.
    RedlockRestartedEmpty,
}

/// One scenario on one backend.
#[derive(Debug, Clone, Copy)]
pub struct ScenarioDef {
    /// The scenario id (`lockkit lab <scenario>`).
    pub scenario: &'static str,
    /// The backend label (`--backend`).
    pub backend: &'static str,
    /// One line: what the lab does.
    pub what: &'static str,
    /// What the backend should do.
    pub expect: Expect,
    plan: Plan,
    /// The URL variable the scenario locks on, and what it appends to it.
    url: (&'static str, &'static str),
    /// Instances the scenario breaks; `services.sh up` brings them back afterwards.
    touches: &'static [&'static str],
}

const SAFE_PAUSED: Expect = Expect {
    double_grant: false,
    lost: LostSignal::AfterRival,
    stale: Stale::Refused,
};
const LOST_FIRST: Expect = Expect {
    double_grant: false,
    lost: LostSignal::BeforeRival,
    stale: Stale::Refused,
};
const KEPT: Expect = Expect {
    double_grant: false,
    lost: LostSignal::Never,
    stale: Stale::NoStaleHolder,
};
const HAZARD: Expect = Expect {
    double_grant: true,
    lost: LostSignal::AfterRival,
    stale: Stale::Refused,
};

const PAUSED_WHAT: &str = "holder (another process) SIGSTOPped past its 2 s lease; a rival takes the lock; the holder resumes and writes";

macro_rules! paused {
    ($backend:literal, $var:literal, $extra:literal) => {
        ScenarioDef {
            scenario: "holder-paused",
            backend: $backend,
            what: PAUSED_WHAT,
            expect: SAFE_PAUSED,
            plan: Plan::HolderPaused,
            url: ($var, $extra),
            touches: &[],
        }
    };
}

/// Every scenario, in the order of the issue and of `docs/cap.md`.
pub const CATALOGUE: &[ScenarioDef] = &[
    paused!("file", "file", ""),
    paused!("redis", "LOCKKIT_TEST_REDIS_URL", ""),
    paused!("redis-cluster", "LOCKKIT_TEST_REDIS_CLUSTER_URL", ""),
    paused!("redlock", "LOCKKIT_TEST_REDLOCK_URL", ""),
    paused!("zk", "LOCKKIT_TEST_ZK_URL", "?session_timeout=2s"),
    paused!(
        "mysql-row",
        "LOCKKIT_TEST_MYSQL_URL",
        "?mode=row&table=lockkit_lab_row"
    ),
    paused!(
        "mysql-for-update",
        "LOCKKIT_TEST_MYSQL_URL",
        "?mode=for-update&table=lockkit_lab_fu"
    ),
    ScenarioDef {
        scenario: "server-paused",
        backend: "redis",
        what: "the Redis server SIGSTOPped for about 5 s, past the holder's 3 s lease; a rival tries during and after",
        expect: LOST_FIRST,
        plan: Plan::RedisPaused,
        url: ("LOCKKIT_TEST_REDIS_URL", ""),
        touches: &["redis-single"],
    },
    ScenarioDef {
        scenario: "server-paused",
        backend: "zk-ensemble",
        what: "the ensemble's leader SIGSTOPped for 8 s (past the followers' 5 s leader timeout); 20 s sessions",
        expect: KEPT,
        plan: Plan::ZkLeaderPaused,
        url: ("LOCKKIT_TEST_ZK_ENSEMBLE_URL", "?session_timeout=20s"),
        touches: &["zk-1", "zk-2", "zk-3"],
    },
    ScenarioDef {
        scenario: "holder-cut-off",
        backend: "redis",
        what: "the holder's link stalls in a TCP proxy; 3 s lease",
        expect: LOST_FIRST,
        plan: Plan::CutOff,
        url: ("LOCKKIT_TEST_REDIS_URL", ""),
        touches: &[],
    },
    ScenarioDef {
        scenario: "holder-cut-off",
        backend: "zk",
        what: "the holder's link stalls in a TCP proxy; 3 s session",
        expect: LOST_FIRST,
        plan: Plan::CutOff,
        url: ("LOCKKIT_TEST_ZK_URL", "?session_timeout=3s"),
        touches: &[],
    },
    ScenarioDef {
        scenario: "server-restarted",
        backend: "redis",
        what: "Redis without persistence SIGKILLed and restarted mid-hold (30 s lease, between renewals)",
        expect: HAZARD,
        plan: Plan::RedisRestarted,
        url: ("LOCKKIT_TEST_REDIS_URL", ""),
        touches: &["redis-single"],
    },
    ScenarioDef {
        scenario: "server-restarted",
        backend: "redis-aof",
        what: "Redis with appendonly + appendfsync always SIGKILLed and restarted mid-hold",
        expect: KEPT,
        plan: Plan::RedisAofRestarted,
        url: ("LOCKKIT_TEST_REDIS_AOF_URL", ""),
        touches: &["redis-aof"],
    },
    ScenarioDef {
        scenario: "server-restarted",
        backend: "zk-ensemble",
        what: "one of three ZooKeeper servers (the leader) SIGKILLed and restarted mid-hold",
        expect: KEPT,
        plan: Plan::ZkLeaderRestarted,
        url: ("LOCKKIT_TEST_ZK_ENSEMBLE_URL", "?session_timeout=10s"),
        touches: &["zk-1", "zk-2", "zk-3"],
    },
    ScenarioDef {
        scenario: "server-restarted",
        backend: "mysql-for-update",
        what: "MariaDB restarted (TERM, then start) mid-hold: the hold is an open transaction",
        expect: LOST_FIRST,
        plan: Plan::MysqlRestarted,
        url: (
            "LOCKKIT_TEST_MYSQL_URL",
            "?mode=for-update&table=lockkit_lab_fu",
        ),
        touches: &["mariadb"],
    },
    ScenarioDef {
        scenario: "server-restarted",
        backend: "mysql-row",
        what: "MariaDB restarted (TERM, then start) mid-hold: the hold is a committed lease row",
        expect: KEPT,
        plan: Plan::MysqlRestarted,
        url: ("LOCKKIT_TEST_MYSQL_URL", "?mode=row&table=lockkit_lab_row"),
        touches: &["mariadb"],
    },
    ScenarioDef {
        scenario: "failover",
        backend: "redis",
        what: "grant on the primary while replication stalls (TCP proxy); primary SIGKILLed; replica promoted",
        expect: HAZARD,
        plan: Plan::Failover,
        url: ("LOCKKIT_TEST_REDIS_PRIMARY_URL", ""),
        touches: &["redis-primary", "redis-replica"],
    },
    ScenarioDef {
        scenario: "failover",
        backend: "redis-wait-replicas",
        what: "the same failover with `?wait_replicas=1`: the grant waits for the replica",
        expect: LOST_FIRST,
        plan: Plan::Failover,
        url: ("LOCKKIT_TEST_REDIS_PRIMARY_URL", "?wait_replicas=1"),
        touches: &["redis-primary", "redis-replica"],
    },
    ScenarioDef {
        scenario: "redlock-two-down",
        backend: "redlock",
        what: "2 of 5 masters SIGKILLed while the lock is held",
        expect: KEPT,
        plan: Plan::RedlockTwoDown,
        url: ("LOCKKIT_TEST_REDLOCK_URL", ""),
        touches: &["redlock-4", "redlock-5"],
    },
    ScenarioDef {
        scenario: "redlock-restart",
        backend: "redlock",
        what: "granted on masters 1-3 (4, 5 down); 4, 5 back empty; master 3 restarted empty",
        expect: HAZARD,
        plan: Plan::RedlockRestartedEmpty,
        url: ("LOCKKIT_TEST_REDLOCK_URL", ""),
        touches: &["redlock-3", "redlock-4", "redlock-5"],
    },
];

impl ScenarioDef {
    /// `scenario/backend`, as reports and the test runner name it.
    pub fn name(&self) -> String {
        format!("{}/{}", self.scenario, self.backend)
    }
}

/// One run's state: its timeline, history, fenced store and observations.
struct Ctx<'a> {
    lab: &'a Lab,
    t0: Instant,
    timeline: Vec<(Duration, String)>,
    history: History,
    store: FileFencedStore,
    key: LockKey,
    holder_lost_at: Option<Instant>,
    rival_at: Option<Instant>,
    stale: Stale,
    consistency: Option<Consistency>,
}

impl Ctx<'_> {
    fn note(&mut self, text: impl Into<String>) {
        self.note_at(Instant::now(), text);
    }

    /// Notes something that happened at `instant` (the timeline is sorted by time).
    fn note_at(&mut self, instant: Instant, text: impl Into<String>) {
        let text = text.into();
        let at = instant.saturating_duration_since(self.t0);
        if self.lab.live {
            println!("  {:>7.3}s  {text}", at.as_secs_f64());
        }
        self.timeline.push((at, text));
    }

    async fn locker(&mut self, url: &str) -> Result<Locker, LabError> {
        let locker = self.lab.locker(url).await?;
        self.consistency = Some(locker.info().consistency);
        Ok(locker)
    }

    /// A fenced write by a current holder: must be accepted.
    fn write(&mut self, who: &str, token: FencingToken) -> Result<(), LabError> {
        match self
            .store
            .write(token, who)
            .context("writing the fenced store")?
        {
            Ok(()) => {
                self.note(format!("{who} writes with token {token}: accepted"));
                Ok(())
            }
            Err(stale) => Err(LabError::new(format!(
                "{who} holds the lock but its write was refused: {stale}"
            ))),
        }
    }

    /// A fenced write by a holder that has been superseded.
    fn stale_write(&mut self, who: &str, token: FencingToken) -> Result<(), LabError> {
        match self
            .store
            .write(token, who)
            .context("writing the fenced store")?
        {
            Ok(()) => {
                self.stale = Stale::Accepted;
                self.note(format!(
                    "{who} writes with stale token {token}: ACCEPTED (fencing failed)"
                ));
            }
            Err(stale) => {
                self.stale = Stale::Refused;
                self.note(format!(
                    "{who} writes with token {token}: refused ({stale})"
                ));
            }
        }
        Ok(())
    }

    /// Opens the history record of `guard`, held by `who`.
    fn open(&mut self, who: &str, guard: LockGuard) -> Hold {
        let open = self.history.begin(who, &guard);
        (guard, open)
    }

    /// A rival was granted: record it.
    fn rival_granted(&mut self, guard: &LockGuard) {
        let now = Instant::now();
        self.rival_at.get_or_insert(now);
        self.note(format!("rival granted, token {}", guard.token()));
    }

    /// The holder's guard fired (or was found) lost.
    fn holder_lost(&mut self, guard: &LockGuard, reason: LostReason) {
        let at = guard.lost_at().unwrap_or_else(Instant::now);
        self.holder_lost_at.get_or_insert(at);
        self.note_at(at, format!("holder's guard fired lost ({reason:?})"));
    }

    /// Tries to take the key during an outage, for at most `limit`; notes the outcome and
    /// returns a grant if there was one.
    async fn attempt(
        &mut self,
        locker: &Locker,
        ttl: Duration,
        wait: Duration,
        limit: Duration,
    ) -> Option<LockGuard> {
        let key = self.key.clone();
        let tried = tokio::time::timeout(limit, locker.acquire(&key).ttl(ttl).wait(wait)).await;
        match tried {
            Ok(Ok(guard)) => {
                self.rival_granted(&guard);
                Some(guard)
            }
            Ok(Err(e)) => {
                self.note(format!("rival refused: {e}"));
                None
            }
            Err(_) => {
                self.note(format!(
                    "rival got no answer within {:.0} s (attempt cancelled)",
                    limit.as_secs_f64()
                ));
                None
            }
        }
    }

    fn observed(&self) -> Observed {
        let violations = self.history.violations();
        let double_grant = violations
            .iter()
            .any(|v| matches!(v, lockkit_conformance::Violation::Overlap { .. }));
        let lost = match (self.holder_lost_at, self.rival_at) {
            (None, _) => LostSignal::Never,
            (Some(lost), Some(rival)) if rival < lost => LostSignal::AfterRival,
            (Some(_), _) => LostSignal::BeforeRival,
        };
        Observed {
            double_grant,
            lost,
            stale: self.stale,
            violations,
        }
    }
}

/// See [`super::run`].
pub(crate) async fn run(lab: &Lab, def: &ScenarioDef) -> Report {
    let started = Instant::now();
    let run_id = Uuid::new_v4().simple().to_string();
    let mut report = Report {
        scenario: def.scenario,
        backend: def.backend,
        consistency: None,
        expect: def.expect,
        observed: None,
        timeline: Vec::new(),
        problems: Vec::new(),
        elapsed: Duration::ZERO,
    };
    let _lock = match lab.services.lock().await {
        Ok(lock) => lock,
        Err(e) => {
            report.problems.push(e.to_string());
            return report;
        }
    };
    let key = match LockKey::new(format!(
        "lab/{}/{}/{}",
        def.scenario,
        def.backend,
        &run_id[..12]
    )) {
        Ok(k) => k,
        Err(e) => {
            report.problems.push(e.to_string());
            return report;
        }
    };
    let mut ctx = Ctx {
        lab,
        t0: Instant::now(),
        timeline: Vec::new(),
        history: History::new(),
        store: FileFencedStore::new(lab.scratch().join(format!("store-{run_id}"))),
        key,
        holder_lost_at: None,
        rival_at: None,
        stale: Stale::NoStaleHolder,
        consistency: None,
    };
    if lab.live {
        println!("== {} ==", def.name());
    }
    let mut needed: Vec<&str> = def.touches.to_vec();
    if def.plan == Plan::Failover {
        needed = vec!["redis-primary", "redis-replica"];
    }
    let outcome = async {
        if !needed.is_empty() {
            lab.services.up(&needed).await?;
        }
        let url = match def.url.0 {
            "file" => format!("file://{}", lab.scratch().join("file-locks").display()),
            var => format!("{}{}", lab.url(var)?, def.url.1),
        };
        ctx.note(format!("lock `{}` on {url}", ctx.key));
        tokio::time::timeout(SCENARIO_LIMIT, play(&mut ctx, def, &url))
            .await
            .map_err(|_| {
                LabError::new(format!(
                    "the scenario took longer than {} s",
                    SCENARIO_LIMIT.as_secs()
                ))
            })?
    }
    .await;
    let restored = restore(lab, def).await;
    ctx.timeline.sort_by_key(|(at, _)| *at);
    report.timeline = std::mem::take(&mut ctx.timeline);
    report.consistency = ctx.consistency;
    match outcome {
        Ok(()) => {
            let seen = ctx.observed();
            report.problems.extend(judge(&def.expect, &seen));
            report.observed = Some(seen);
        }
        Err(e) => report.problems.push(e.to_string()),
    }
    if let Err(e) = restored {
        report
            .problems
            .push(format!("restoring the servers failed: {e}"));
    }
    let _ = std::fs::remove_file(ctx.store.path());
    report.elapsed = started.elapsed();
    if report.elapsed > SCENARIO_LIMIT {
        report.problems.push(format!(
            "took {:.1} s with the restore, over the {} s limit",
            report.elapsed.as_secs_f64(),
            SCENARIO_LIMIT.as_secs()
        ));
    }
    report
}

/// Brings back what the scenario broke.
async fn restore(lab: &Lab, def: &ScenarioDef) -> Result<(), LabError> {
    if def.plan == Plan::Failover {
        // The promoted replica must follow the (restarted, empty) primary again; try both
        // steps whatever the first one says.
        let primary = lab.services.up(&["redis-primary"]).await;
        let replica = lab.services.act("restart", &["redis-replica"]).await;
        return primary.and(replica);
    }
    if def.touches.is_empty() {
        return Ok(());
    }
    lab.services.up(def.touches).await
}

async fn play(ctx: &mut Ctx<'_>, def: &ScenarioDef, url: &str) -> Result<(), LabError> {
    match def.plan {
        Plan::HolderPaused => holder_paused(ctx, url).await,
        Plan::RedisPaused => redis_paused(ctx, url).await,
        Plan::ZkLeaderPaused => zk_leader_outage(ctx, url, "pause").await,
        Plan::ZkLeaderRestarted => zk_leader_outage(ctx, url, "kill").await,
        Plan::CutOff => cut_off(ctx, url).await,
        Plan::RedisRestarted => redis_restarted(ctx, url).await,
        Plan::RedisAofRestarted => redis_aof_restarted(ctx, url).await,
        Plan::MysqlRestarted => mysql_restarted(ctx, url, def.expect.lost).await,
        Plan::Failover => failover(ctx, url, def.expect.double_grant).await,
        Plan::RedlockTwoDown => redlock_two_down(ctx, url).await,
        Plan::RedlockRestartedEmpty => redlock_restarted_empty(ctx, url).await,
    }
}

/// Waits up to `within` for the guard to fire lost and records it.
async fn await_lost(ctx: &mut Ctx<'_>, guard: &LockGuard, within: Duration) {
    if let Ok(reason) = tokio::time::timeout(within, guard.lost()).await {
        ctx.holder_lost(guard, reason);
    } else {
        ctx.note(format!(
            "holder's guard did not fire lost within {:.0} s",
            within.as_secs_f64()
        ));
    }
}

/// Renews until the server answers (a restarted server may refuse a few first attempts);
/// records a loss.
async fn renew_through(ctx: &mut Ctx<'_>, guard: &LockGuard, ttl: Duration) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match guard.extend(ttl).await {
            Ok(()) => {
                ctx.note(format!("holder renews its lease ({} s): ok", ttl.as_secs()));
                return true;
            }
            Err(e) if !guard.is_valid() || Instant::now() > deadline => {
                ctx.note(format!("holder renews its lease: {e}"));
                if !guard.is_valid() {
                    let reason = guard.lost().await;
                    ctx.holder_lost(guard, reason);
                }
                return false;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The rival checks the key is still held (busy); a grant here is recorded.
async fn expect_busy(ctx: &mut Ctx<'_>, rival: &Locker) -> Result<Option<LockGuard>, LabError> {
    let key = ctx.key.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match rival.try_acquire(&key).await {
            Ok(None) => {
                ctx.note("rival tries: busy (the holder still has it)");
                return Ok(None);
            }
            Ok(Some(guard)) => {
                ctx.rival_granted(&guard);
                return Ok(Some(guard));
            }
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("rival try failed, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(LabError::new(format!("rival's try kept failing: {e}"))),
        }
    }
}

/// A hold and its open history record.
type Hold = (LockGuard, OpenHold);

/// The holder takes the key, says so, and writes with its token.
async fn take(
    ctx: &mut Ctx<'_>,
    locker: &Locker,
    ttl: Duration,
    watchdog: bool,
    what: &str,
    describe: impl FnOnce(FencingToken) -> String,
) -> Result<Hold, LabError> {
    let mut acquire = locker.acquire(&ctx.key).ttl(ttl);
    if !watchdog {
        acquire = acquire.no_watchdog();
    }
    let guard = acquire.await.context(what)?;
    ctx.note(describe(guard.token()));
    let hold = ctx.open("holder", guard);
    ctx.write("holder", hold.0.token())?;
    Ok(hold)
}

/// The lock was kept through the fault: the rival finds it busy, the holder renews and
/// writes, then releases, and the rival gets it with a greater token.
async fn kept(
    ctx: &mut Ctx<'_>,
    holder: Hold,
    rival: &Locker,
    ttl: Duration,
    during: Option<Hold>,
) -> Result<(), LabError> {
    let busy = expect_busy(ctx, rival).await?;
    let busy = busy.map(|g| ctx.open("rival", g));
    if holder.0.is_valid() {
        if renew_through(ctx, &holder.0, ttl).await {
            ctx.write("holder", holder.0.token())?;
        }
    } else {
        let reason = holder.0.lost().await;
        ctx.holder_lost(&holder.0, reason);
    }
    let token = holder.0.token();
    finish(ctx, Some(holder), during.or(busy)).await;
    ctx.note("holder released");
    let next = handoff(ctx, rival, ttl, token).await?;
    finish(ctx, None, Some(next)).await;
    Ok(())
}

/// The rival waits up to `wait` for the key and is granted it.
async fn rival_takes(
    ctx: &mut Ctx<'_>,
    rival: &Locker,
    ttl: Duration,
    wait: Duration,
    what: &str,
) -> Result<Hold, LabError> {
    let guard = rival
        .acquire(&ctx.key)
        .ttl(ttl)
        .wait(wait)
        .await
        .context(what)?;
    ctx.rival_granted(&guard);
    Ok(ctx.open("rival", guard))
}

/// The rival waits up to `wait` for the key while the holder's guard may fire lost (up
/// to `lost_within`); both are recorded at the instants they happened.
async fn race(
    ctx: &mut Ctx<'_>,
    holder: &LockGuard,
    rival: &Locker,
    ttl: Duration,
    lost_within: Duration,
    why: &str,
) -> Result<Hold, LabError> {
    let rival_wait = rival
        .acquire(ctx.key.clone())
        .ttl(ttl)
        .wait(Duration::from_secs(30));
    let (granted, lost) = tokio::join!(
        async {
            let granted = rival_wait.await;
            (granted, Instant::now())
        },
        tokio::time::timeout(lost_within, holder.lost())
    );
    match lost {
        Ok(reason) => ctx.holder_lost(holder, reason),
        Err(_) => ctx.note("holder's guard did not fire lost"),
    }
    let (guard, at) = granted;
    let guard = guard.context(format!("the rival ({why})"))?;
    ctx.rival_at.get_or_insert(at);
    ctx.note_at(at, format!("rival granted token {} ({why})", guard.token()));
    // The record starts when the grant came back, not after the holder's side settled.
    let open = ctx.history.begin_at("rival", &guard, at);
    Ok((guard, open))
}

/// Closes both holds in the history and releases them.
async fn finish(ctx: &mut Ctx<'_>, holder: Option<Hold>, rival: Option<Hold>) {
    for (guard, open) in [holder, rival].into_iter().flatten() {
        ctx.history.end(open, &guard);
        let _ = tokio::time::timeout(Duration::from_secs(5), guard.release()).await;
    }
}

/// After the holder released: the rival must get the key with a greater token.
async fn handoff(
    ctx: &mut Ctx<'_>,
    rival: &Locker,
    ttl: Duration,
    after: FencingToken,
) -> Result<Hold, LabError> {
    let guard = rival
        .acquire(&ctx.key)
        .ttl(ttl)
        .wait(Duration::from_secs(20))
        .await
        .context("the rival after the holder released")?;
    ctx.rival_granted(&guard);
    if guard.token() <= after {
        return Err(LabError::new(format!(
            "the rival's token {} is not greater than the holder's {after}",
            guard.token()
        )));
    }
    let open = ctx.history.begin("rival", &guard);
    Ok((guard, open))
}

async fn holder_paused(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(2);
    let key = ctx.key.clone();
    let store = ctx.store.clone();
    let mut child = ChildHolder::spawn(ctx.lab, url, &key, ttl, &store).await?;
    ctx.note(format!(
        "holder (pid {}) granted token {} with a {} s lease, watchdog on",
        child.pid(),
        child.token,
        ttl.as_secs()
    ));
    let rival = ctx.locker(url).await?;
    tokio::time::sleep(ttl / 2).await;
    let early = child.drain(Duration::from_millis(50)).await;
    if !early.is_empty() {
        return Err(LabError::new(format!(
            "the holder reported {early:?} before it was frozen"
        )));
    }
    child.signal(Signal::SIGSTOP)?;
    let paused = Instant::now();
    ctx.note("holder SIGSTOPped: no watchdog, no I/O (a GC pause, a swapped-out VM)");
    let early = child.drain(Duration::from_millis(100)).await;
    if !early.is_empty() {
        return Err(LabError::new(format!(
            "the holder reported {early:?} before it was frozen"
        )));
    }
    if let Some(until) = child.valid_until {
        ctx.note_at(
            until,
            "the frozen holder's lease deadline passes (on its own clock)",
        );
    }
    let guard = rival
        .acquire(&key)
        .ttl(ttl)
        .wait(Duration::from_secs(30))
        .await
        .context("the rival while the holder is frozen")?;
    ctx.rival_granted(&guard);
    ctx.note(format!(
        "  ... {:.2} s after the pause",
        paused.elapsed().as_secs_f64()
    ));
    let rival_open = ctx.history.begin("rival", &guard);
    ctx.write("rival", guard.token())?;
    child.request_write().await?;
    child.signal(Signal::SIGCONT)?;
    ctx.note(format!(
        "holder SIGCONTed; it writes with token {} as it meant to before the pause",
        child.token
    ));
    let (mut wrote, mut lost) = (false, false);
    let deadline = Instant::now() + ttl * 3 + Duration::from_secs(10);
    while !(wrote && lost) {
        let Some(event) = child.next_event(deadline - Instant::now()).await else {
            break;
        };
        if let Some(rest) = event.strip_prefix("WROTE ") {
            wrote = true;
            ctx.stale = if rest.starts_with("refused") {
                Stale::Refused
            } else if rest.starts_with("accepted") {
                Stale::Accepted
            } else {
                return Err(LabError::new(format!("the holder could not write: {rest}")));
            };
            ctx.note(format!("holder's write: {rest}"));
        } else if let Some(reason) = event.strip_prefix("LOST ") {
            lost = true;
            ctx.holder_lost_at.get_or_insert(Instant::now());
            ctx.note(format!("holder's guard fired lost on resume ({reason})"));
        } else {
            ctx.note(format!("holder says: {event}"));
        }
    }
    if !wrote {
        ctx.note("the holder never reported its write");
    }
    ctx.history.push(HoldRecord {
        holder: "holder (child process)".into(),
        key: key.clone(),
        token: child.token,
        start: child.held_at,
        end: None,
        valid_until: child.valid_until,
    });
    finish(ctx, None, Some((guard, rival_open))).await;
    child.finish().await;
    Ok(())
}

async fn redis_paused(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(3);
    let holder_locker = ctx.locker(url).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} with a {} s lease, watchdog on",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    ctx.lab.services.act("pause", &["redis-single"]).await?;
    let paused = Instant::now();
    ctx.note("Redis server SIGSTOPped");
    let during = ctx
        .attempt(&rival, ttl, Duration::from_secs(2), Duration::from_secs(5))
        .await;
    let during = during.map(|g| ctx.open("rival (during the pause)", g));
    await_lost(ctx, &holder, ttl + Duration::from_secs(5)).await;
    let resume_at = paused + ttl + Duration::from_secs(1);
    tokio::time::sleep_until(resume_at).await;
    ctx.lab.services.act("resume", &["redis-single"]).await?;
    ctx.note("Redis server SIGCONTed (its clock moved on: the lease has run out)");
    let rival_hold = match during {
        Some(hold) => hold,
        None => {
            let (guard, open) = rival_takes(
                ctx,
                &rival,
                ttl,
                Duration::from_secs(15),
                "the rival after the resume",
            )
            .await?;
            (guard, open)
        }
    };
    ctx.write("rival", rival_hold.0.token())?;
    ctx.stale_write("holder", holder.token())?;
    finish(ctx, Some((holder, holder_open)), Some(rival_hold)).await;
    Ok(())
}

/// The ZooKeeper instance (`zk-N`) that is the ensemble's leader.
async fn zk_leader(url: &str) -> Result<(String, String), LabError> {
    for _ in 0..50 {
        for (i, addr) in host_ports(url).iter().enumerate() {
            if zk_mode(addr).await.as_deref() == Some("leader") {
                return Ok((format!("zk-{}", i + 1), addr.clone()));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(LabError::new(format!("no leader among {url}")))
}

/// Waits until every server of the ensemble is a leader or a follower.
async fn zk_settled(url: &str) -> Result<String, LabError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut modes = Vec::new();
        for addr in host_ports(url) {
            modes.push(zk_mode(&addr).await.unwrap_or_else(|| "down".into()));
        }
        let leaders = modes.iter().filter(|m| *m == "leader").count();
        let all = modes.iter().all(|m| m == "leader" || m == "follower");
        if all && leaders == 1 {
            return Ok(modes.join(", "));
        }
        if Instant::now() > deadline {
            return Err(LabError::new(format!(
                "the ensemble did not settle in 30 s: {}",
                modes.join(", ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `action` is `pause` (SIGSTOP for 8 s, then SIGCONT) or `kill` (SIGKILL, then start).
async fn zk_leader_outage(ctx: &mut Ctx<'_>, url: &str, action: &str) -> Result<(), LabError> {
    let ttl = if action == "pause" {
        Duration::from_secs(20)
    } else {
        Duration::from_secs(10)
    };
    zk_settled(url).await?;
    let holder_locker = ctx.locker(url).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} ({} s session and lease)",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    let (leader, addr) = zk_leader(url).await?;
    ctx.lab.services.act(action, &[leader.as_str()]).await?;
    let during = if action == "pause" {
        let resume_at = Instant::now() + Duration::from_secs(8);
        ctx.note(format!("leader {leader} ({addr}) SIGSTOPped"));
        tokio::time::sleep(Duration::from_secs(4)).await;
        let during = ctx
            .attempt(&rival, ttl, Duration::from_secs(3), Duration::from_secs(4))
            .await;
        tokio::time::sleep_until(resume_at).await;
        ctx.lab.services.act("resume", &[leader.as_str()]).await?;
        ctx.note(format!("{leader} SIGCONTed"));
        during
    } else {
        ctx.note(format!("leader {leader} ({addr}) SIGKILLed"));
        let during = ctx
            .attempt(&rival, ttl, Duration::from_secs(3), Duration::from_secs(6))
            .await;
        ctx.lab.services.up(&[leader.as_str()]).await?;
        ctx.note(format!("{leader} restarted"));
        during
    };
    let modes = zk_settled(url).await?;
    ctx.note(format!("ensemble settled: {modes}"));
    let during = during.map(|g| ctx.open("rival (during the outage)", g));
    kept(ctx, (holder, holder_open), &rival, ttl, during).await
}

async fn cut_off(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(3);
    let key = ctx.key.clone();
    let upstream: SocketAddr = host_ports(url)
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| LabError::new(format!("no host:port in {url}")))?;
    let proxy = FaultProxy::start(upstream)
        .await
        .context("starting the proxy")?;
    // Only host:port changes: credentials, path (database, chroot) and query stay.
    let upstream_text = upstream.to_string();
    if !url.contains(&upstream_text) {
        return Err(LabError::new(format!(
            "cannot route {url} through the proxy: `{upstream_text}` is not spelled in it"
        )));
    }
    let proxied = url.replacen(&upstream_text, &proxy.local_addr().to_string(), 1);
    let holder_locker = ctx.locker(&proxied).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder (through the proxy) granted token {}; {} s lease, watchdog on",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.cut();
    ctx.note("link cut: the holder's packets stall, the server hears nothing");
    if let Ok(Some(info)) = rival.inspect(&key).await
        && let Some(left) = info.ttl_left
    {
        ctx.note_at(
            Instant::now() + left,
            "the holder's lease runs out on the server (its TTL as read after the cut)",
        );
    }
    let (guard, rival_open) = race(
        ctx,
        &holder,
        &rival,
        ttl,
        ttl * 3,
        "the server let the lease run out",
    )
    .await?;
    ctx.write("rival", guard.token())?;
    ctx.stale_write("holder", holder.token())?;
    proxy.heal();
    finish(ctx, Some((holder, holder_open)), Some((guard, rival_open))).await;
    Ok(())
}

async fn redis_restarted(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(30);
    let holder_locker = ctx.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, false, "holder", |token| {
        format!(
            "holder granted token {} with a 30 s lease (between renewals for the rest of the run)",
            token
        )
    })
    .await?;
    ctx.lab.services.act("kill", &["redis-single"]).await?;
    ctx.note("Redis SIGKILLed (no RDB, no AOF: the lock lived only in memory)");
    ctx.lab.services.up(&["redis-single"]).await?;
    ctx.note("Redis restarted, empty");
    let rival = ctx.lab.locker(url).await?;
    let (guard, rival_open) = rival_takes(
        ctx,
        &rival,
        ttl,
        Duration::from_secs(10),
        "the rival after the restart",
    )
    .await?;
    ctx.write("rival", guard.token())?;
    renew_through(ctx, &holder, ttl).await;
    ctx.stale_write("holder", holder.token())?;
    finish(ctx, Some((holder, holder_open)), Some((guard, rival_open))).await;
    Ok(())
}

async fn redis_aof_restarted(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(10);
    let holder_locker = ctx.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} with a 10 s lease, watchdog on",
            token
        )
    })
    .await?;
    ctx.lab.services.act("kill", &["redis-aof"]).await?;
    ctx.note("Redis (appendfsync always) SIGKILLed");
    ctx.lab.services.up(&["redis-aof"]).await?;
    ctx.note("Redis restarted from its append-only file");
    let rival = ctx.lab.locker(url).await?;
    kept(ctx, (holder, holder_open), &rival, ttl, None).await
}

async fn mysql_restarted(ctx: &mut Ctx<'_>, url: &str, expect: LostSignal) -> Result<(), LabError> {
    let for_update = expect != LostSignal::Never;
    let ttl = if for_update {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(20)
    };
    let holder_locker = ctx.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} with a {} s lease, watchdog on",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    ctx.lab.services.act("restart", &["mariadb"]).await?;
    ctx.note("MariaDB restarted");
    let rival = ctx.lab.locker(url).await?;
    if for_update {
        // The rival asks at once; the holder's guard races it.
        let (guard, rival_open) = race(
            ctx,
            &holder,
            &rival,
            ttl,
            Duration::from_secs(20),
            "the restart ended the holder's transaction",
        )
        .await?;
        ctx.write("rival", guard.token())?;
        ctx.stale_write("holder", holder.token())?;
        finish(ctx, Some((holder, holder_open)), Some((guard, rival_open))).await;
        return Ok(());
    }
    kept(ctx, (holder, holder_open), &rival, ttl, None).await
}

async fn failover(ctx: &mut Ctx<'_>, url: &str, lagging: bool) -> Result<(), LabError> {
    let ttl = Duration::from_secs(5);
    let replica_url = ctx.lab.url("LOCKKIT_TEST_REDIS_REPLICA_URL")?.to_owned();
    let replica_addr = host_ports(&replica_url)
        .first()
        .cloned()
        .ok_or_else(|| LabError::new(format!("no host:port in {replica_url}")))?;
    let primary: SocketAddr = host_ports(url)
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| LabError::new(format!("no host:port in {url}")))?;
    let link = FaultProxy::start(primary)
        .await
        .context("starting the replication proxy")?;
    let (host, port) = (
        link.local_addr().ip().to_string(),
        link.local_addr().port().to_string(),
    );
    redis_command(&replica_addr, &["REPLICAOF", &host, &port]).await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !redis_command(&replica_addr, &["INFO", "replication"])
        .await?
        .contains("master_link_status:up")
    {
        if Instant::now() > deadline {
            return Err(LabError::new(
                "the replica did not sync through the proxy in 20 s",
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ctx.note("the replica follows the primary through a TCP proxy, in sync");
    let holder_locker = ctx.locker(url).await?;
    // An earlier holder's grant reaches the replica, fencing counter included, so the
    // promoted replica starts from an old counter rather than none.
    let (earlier, earlier_open) = take(
        ctx,
        &holder_locker,
        ttl,
        true,
        "the earlier holder",
        |token| format!("an earlier holder takes the key (token {token})"),
    )
    .await?;
    finish(ctx, Some((earlier, earlier_open)), None).await;
    let counter = format!("redisson_lock_token:{{{}}}", ctx.key);
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis_command(&replica_addr, &["GET", &counter])
        .await?
        .is_empty()
    {
        if Instant::now() > deadline {
            return Err(LabError::new(
                "the fencing counter never reached the replica",
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ctx.note("it released; the replica has its lock's fencing counter");
    if lagging {
        link.cut();
        ctx.note("replication link stalls: the replica receives nothing more (lag, partition)");
    }
    let (holder, holder_open) = take(
        ctx,
        &holder_locker,
        ttl,
        true,
        "holder on the primary",
        |token| {
            format!(
                "holder granted token {} by the primary ({} s lease, watchdog on){}",
                token,
                ttl.as_secs(),
                if lagging {
                    ""
                } else {
                    "; the replica confirmed the grant (WAIT 1)"
                }
            )
        },
    )
    .await?;
    ctx.lab.services.act("kill", &["redis-primary"]).await?;
    ctx.note("primary SIGKILLed");
    redis_command(&replica_addr, &["REPLICAOF", "NO", "ONE"]).await?;
    drop(link);
    ctx.note("replica promoted (REPLICAOF NO ONE); clients move to it");
    let rival = ctx.lab.locker(&replica_url).await?;
    let rival_hold = if lagging {
        let (guard, open) = rival_takes(
            ctx,
            &rival,
            ttl,
            Duration::from_secs(10),
            "the rival on the promoted replica",
        )
        .await?;
        ctx.write("rival", guard.token())?;
        await_lost(ctx, &holder, ttl + Duration::from_secs(5)).await;
        (guard, open)
    } else {
        let busy = expect_busy(ctx, &rival).await?;
        let busy = busy.map(|g| ctx.open("rival (early)", g));
        match busy {
            Some(hold) => hold,
            None => {
                let (guard, open) = race(
                    ctx,
                    &holder,
                    &rival,
                    ttl,
                    ttl * 3,
                    "the replicated lease ran out on the new primary",
                )
                .await?;
                ctx.write("rival", guard.token())?;
                (guard, open)
            }
        }
    };
    ctx.stale_write("holder", holder.token())?;
    finish(ctx, Some((holder, holder_open)), Some(rival_hold)).await;
    Ok(())
}

async fn redlock_two_down(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(5);
    let holder_locker = ctx.locker(url).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} by the 5 masters ({} s lease, watchdog on)",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    ctx.lab
        .services
        .act("kill", &["redlock-4", "redlock-5"])
        .await?;
    ctx.note("masters 4 and 5 SIGKILLed (3 of 5 left: still a quorum)");
    let during = ctx
        .attempt(&rival, ttl, Duration::from_secs(2), Duration::from_secs(6))
        .await;
    let during = during.map(|g| ctx.open("rival", g));
    kept(ctx, (holder, holder_open), &rival, ttl, during).await
}

async fn redlock_restarted_empty(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(30);
    ctx.lab
        .services
        .act("kill", &["redlock-4", "redlock-5"])
        .await?;
    ctx.note("masters 4 and 5 SIGKILLed");
    let holder_locker = ctx.locker(url).await?;
    let (holder, holder_open) = take(
        ctx,
        &holder_locker,
        ttl,
        false,
        "holder on masters 1-3",
        |token| {
            format!(
                "holder granted token {} by masters 1, 2, 3 (a quorum of 5); 30 s lease",
                token
            )
        },
    )
    .await?;
    ctx.lab.services.up(&["redlock-4", "redlock-5"]).await?;
    ctx.note("masters 4 and 5 back, empty");
    ctx.lab.services.act("kill", &["redlock-3"]).await?;
    ctx.lab.services.up(&["redlock-3"]).await?;
    ctx.note("master 3 SIGKILLed and restarted without persistence: it forgot the grant");
    let rival = ctx.lab.locker(url).await?;
    let (guard, rival_open) = rival_takes(
        ctx,
        &rival,
        ttl,
        Duration::from_secs(10),
        "the rival on masters 3, 4, 5",
    )
    .await?;
    ctx.write("rival", guard.token())?;
    renew_through(ctx, &holder, ttl).await;
    ctx.stale_write("holder", holder.token())?;
    finish(ctx, Some((holder, holder_open)), Some((guard, rival_open))).await;
    Ok(())
}

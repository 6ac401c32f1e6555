//! Running one scenario: servers up, the plan played within its time limit, the servers restored, the outcome judged.

use std::time::Duration;

use lockkit_core::{FileBackend, LockKey};
use tokio::time::Instant;
use uuid::Uuid;

use crate::{
    Lab, LabError, SCENARIO_LIMIT, StoreKind,
    report::{Report, Stale, judge},
    store::FencedStore,
};
use lockkit_conformance::History;

use super::{any_backend::*, catalogue::*, ctx::*, mysql::*, redis::*, zookeeper::*};

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
        faults: 0,
        history: History::new(),
        store: None,
        accepted_writes: Vec::new(),
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
    let (store_instance, store_location) = match def.store() {
        StoreKind::File => (
            None,
            Ok(FileBackend::url_of(
                &lab.scratch().join(format!("store-{run_id}")),
            )),
        ),
        StoreKind::Redis => (
            Some("redis-store"),
            lab.url("LOCKKIT_TEST_REDIS_STORE_URL").map(str::to_owned),
        ),
        StoreKind::Mysql => (
            Some("mariadb"),
            lab.url("LOCKKIT_TEST_MYSQL_URL").map(str::to_owned),
        ),
        StoreKind::Postgres => (
            Some("postgres"),
            lab.url("LOCKKIT_TEST_POSTGRES_URL").map(str::to_owned),
        ),
    };
    needed.extend(store_instance.filter(|i| !needed.contains(i)));
    let outcome = async {
        if !needed.is_empty() {
            lab.services.up(&needed).await?;
        }
        let url = match def.url.0 {
            "file" => FileBackend::url_of(&lab.scratch().join("file-locks")),
            var => format!("{}{}", lab.url(var)?, def.url.1),
        };
        let store_location = store_location?;
        let played = async {
            let store = FencedStore::open(&store_location, ctx.key.as_str()).await?;
            ctx.note(format!(
                "fenced store: `{}` through lockkit::fence::{}",
                store.resource(),
                store.kind().guard()
            ));
            ctx.store = Some(store);
            ctx.note(format!("lock `{}` on {url}", ctx.key));
            play(&mut ctx, def, &url).await
        };
        tokio::time::timeout(SCENARIO_LIMIT, played)
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
    ctx.timeline.sort_by_key(|e| e.at);
    report.timeline = std::mem::take(&mut ctx.timeline);
    report.consistency = ctx.consistency;
    match outcome {
        Ok(()) => {
            let seen = ctx.observed();
            report.problems.extend(judge(&def.expect, &seen));
            report.observed = Some(seen);
            // Judged first, so a guard that let a stale write through still shows as such.
            if let Some(store) = &ctx.store
                && let Err(e) = check_store(store, &ctx.accepted_writes).await
            {
                report.problems.push(e.to_string());
            }
        }
        Err(e) => report.problems.push(e.to_string()),
    }
    if let Err(e) = restored {
        report
            .problems
            .push(format!("restoring the servers failed: {e}"));
    }
    if let Some(store) = &ctx.store
        && let Err(e) = store.remove().await
    {
        report.problems.push(format!("cleaning the store up: {e}"));
    }
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

/// What the store kept must be exactly the writes its guard said it accepted (`token who`,
/// in order: a refused write left nothing, an accepted one was not lost), and its tokens
/// must never fall.
async fn check_store(store: &FencedStore, accepted: &[(u64, String)]) -> Result<(), LabError> {
    let values = store.values().await?;
    let guard = store.kind().guard();
    let expected: Vec<String> = accepted.iter().map(|(t, v)| format!("{t} {v}")).collect();
    if values != expected {
        return Err(LabError::new(format!(
            "the {guard} store kept {values:?}, but its guard accepted {expected:?}"
        )));
    }
    let mut tokens = Vec::with_capacity(values.len());
    for value in &values {
        let token: u64 = value
            .split(' ')
            .next()
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| LabError::new(format!("the {guard} store kept `{value}`")))?;
        tokens.push(token);
    }
    if tokens.windows(2).any(|w| w[1] < w[0]) {
        return Err(LabError::new(format!(
            "the {guard} store kept an older token after a newer one: {values:?}"
        )));
    }
    Ok(())
}

/// Brings back what the scenario broke.
pub(super) async fn restore(lab: &Lab, def: &ScenarioDef) -> Result<(), LabError> {
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

pub(super) async fn play(ctx: &mut Ctx<'_>, def: &ScenarioDef, url: &str) -> Result<(), LabError> {
    match def.plan {
        Plan::HolderPaused => holder_paused(ctx, url, 0).await,
        Plan::PermitPaused => holder_paused(ctx, url, 1).await,
        Plan::RedisPaused => redis_paused(ctx, url).await,
        Plan::ZkLeaderPaused => leader_outage(ctx, url, "pause", Quorum::Zk).await,
        Plan::ZkLeaderRestarted => leader_outage(ctx, url, "kill", Quorum::Zk).await,
        Plan::EtcdLeaderPaused => leader_outage(ctx, url, "pause", Quorum::Etcd).await,
        Plan::EtcdLeaderRestarted => leader_outage(ctx, url, "kill", Quorum::Etcd).await,
        Plan::CutOff => cut_off(ctx, url).await,
        Plan::RedisRestarted => redis_restarted(ctx, url).await,
        Plan::RedisAofRestarted => redis_aof_restarted(ctx, url).await,
        Plan::DatabaseRestarted => database_restarted(ctx, url, def).await,
        Plan::Failover => failover(ctx, url, def.expect.double_grant).await,
        Plan::RedlockTwoDown => redlock_two_down(ctx, url).await,
        Plan::RedlockRestartedEmpty => redlock_restarted_empty(ctx, url).await,
    }
}

#[cfg(test)]
mod tests {
    use lockkit_core::FencingToken;

    use super::*;

    #[tokio::test]
    async fn the_store_check_finds_lost_extra_and_falling_writes() {
        let dir = std::env::temp_dir().join(format!("lockkit-check-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let store = FencedStore::open(&FileBackend::url_of(&path), "r")
            .await
            .unwrap();
        store
            .write(FencingToken::new(5), "rival")
            .await
            .unwrap()
            .unwrap();
        let rival = vec![(5, "rival".to_owned())];
        check_store(&store, &rival)
            .await
            .expect("exactly what was accepted");
        let lost = vec![(5, "rival".to_owned()), (6, "holder".to_owned())];
        assert!(
            check_store(&store, &lost).await.is_err(),
            "an accepted write is missing"
        );
        assert!(
            check_store(&store, &[]).await.is_err(),
            "a value nobody accepted"
        );
        // A guard that let an older token in after a newer one.
        std::fs::write(&path, "5 rival\n4 holder\n").unwrap();
        let falling = vec![(5, "rival".to_owned()), (4, "holder".to_owned())];
        let err = check_store(&store, &falling).await.unwrap_err();
        assert!(err.0.contains("older token"), "{err}");
        store.remove().await.unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }
}

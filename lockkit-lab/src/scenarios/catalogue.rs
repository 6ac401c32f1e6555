//! What each scenario breaks, on which backend, and what it expects.

use crate::{
    StoreKind,
    report::{Expect, LostSignal, Stale},
};

/// What a scenario does to the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// A holder in a child process is SIGSTOPped past its lease.
    HolderPaused,
    /// The same with the only permit of a one-permit semaphore.
    PermitPaused,
    /// `redis-single` is SIGSTOPped past the lease.
    RedisPaused,
    /// The ZooKeeper ensemble's leader is SIGSTOPped.
    ZkLeaderPaused,
    /// The etcd cluster's leader is SIGSTOPped.
    EtcdLeaderPaused,
    /// The holder's TCP link is cut by a proxy.
    CutOff,
    /// `redis-single` (no persistence) is SIGKILLed and restarted empty.
    RedisRestarted,
    /// `redis-aof` (appendfsync always) is SIGKILLed and restarted.
    RedisAofRestarted,
    /// The ZooKeeper ensemble's leader is SIGKILLed and restarted.
    ZkLeaderRestarted,
    /// The etcd cluster's leader is SIGKILLed and restarted.
    EtcdLeaderRestarted,
    /// The database (`touches`: MariaDB or PostgreSQL) is restarted.
    DatabaseRestarted,
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
    pub(super) plan: Plan,
    /// The URL variable the scenario locks on, and what it appends to it.
    pub(super) url: (&'static str, &'static str),
    /// Instances the scenario breaks; `services.sh up` brings them back afterwards.
    pub(super) touches: &'static [&'static str],
}

impl ScenarioDef {
    /// The store its holders write to, as a user of this backend would: Redis (a server
    /// the lab never breaks) for the Redis backends, the database itself for the MySQL and
    /// PostgreSQL ones, a file for the file, ZooKeeper and etcd backends.
    pub fn store(&self) -> StoreKind {
        if self.backend.starts_with("redis") || self.backend == "redlock" {
            StoreKind::Redis
        } else if self.backend.starts_with("mysql") {
            StoreKind::Mysql
        } else if self.backend.starts_with("postgres") {
            StoreKind::Postgres
        } else {
            StoreKind::File
        }
    }
}

pub(super) const SAFE_PAUSED: Expect = Expect {
    double_grant: false,
    lost: LostSignal::AfterRival,
    stale: Stale::Refused,
};
pub(super) const LOST_FIRST: Expect = Expect {
    double_grant: false,
    lost: LostSignal::BeforeRival,
    stale: Stale::Refused,
};
pub(super) const KEPT: Expect = Expect {
    double_grant: false,
    lost: LostSignal::Never,
    stale: Stale::NoStaleHolder,
};
pub(super) const HAZARD: Expect = Expect {
    double_grant: true,
    lost: LostSignal::AfterRival,
    stale: Stale::Refused,
};

pub(super) const PERMIT_WHAT: &str = "holder (another process) of the only permit of a 1-permit semaphore SIGSTOPped past its 2 s lease; a rival takes the permit; the holder resumes and writes";

macro_rules! permit_paused {
    ($backend:literal, $var:literal, $extra:literal) => {
        ScenarioDef {
            scenario: "permit-paused",
            backend: $backend,
            what: PERMIT_WHAT,
            expect: SAFE_PAUSED,
            plan: Plan::PermitPaused,
            url: ($var, $extra),
            touches: &[],
        }
    };
}

pub(super) const PAUSED_WHAT: &str = "holder (another process) SIGSTOPped past its 2 s lease; a rival takes the lock; the holder resumes and writes";

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
    paused!(
        "postgres-row",
        "LOCKKIT_TEST_POSTGRES_URL",
        "?mode=row&table=lockkit_lab_row"
    ),
    paused!(
        "postgres-advisory",
        "LOCKKIT_TEST_POSTGRES_URL",
        "?mode=advisory&table=lockkit_lab_adv"
    ),
    paused!("etcd", "LOCKKIT_TEST_ETCD_URL", "?session_ttl=2s"),
    permit_paused!("file", "file", ""),
    permit_paused!("redis", "LOCKKIT_TEST_REDIS_URL", ""),
    permit_paused!("zk", "LOCKKIT_TEST_ZK_URL", "?session_timeout=2s"),
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
        scenario: "server-paused",
        backend: "etcd-cluster",
        what: "the cluster's leader SIGSTOPped for 8 s (past the 1 s election timeout); 20 s etcd leases",
        expect: KEPT,
        plan: Plan::EtcdLeaderPaused,
        url: ("LOCKKIT_TEST_ETCD_CLUSTER_URL", "?session_ttl=20s"),
        touches: &["etcd-1", "etcd-2", "etcd-3"],
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
        scenario: "holder-cut-off",
        backend: "etcd",
        what: "the holder's link stalls in a TCP proxy; 3 s etcd lease",
        expect: LOST_FIRST,
        plan: Plan::CutOff,
        url: ("LOCKKIT_TEST_ETCD_URL", "?session_ttl=3s"),
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
        backend: "etcd-cluster",
        what: "one of three etcd members (the leader) SIGKILLed and restarted mid-hold",
        expect: KEPT,
        plan: Plan::EtcdLeaderRestarted,
        url: ("LOCKKIT_TEST_ETCD_CLUSTER_URL", "?session_ttl=10s"),
        touches: &["etcd-1", "etcd-2", "etcd-3"],
    },
    ScenarioDef {
        scenario: "server-restarted",
        backend: "mysql-for-update",
        what: "MariaDB restarted (TERM, then start) mid-hold: the hold is an open transaction",
        expect: LOST_FIRST,
        plan: Plan::DatabaseRestarted,
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
        plan: Plan::DatabaseRestarted,
        url: ("LOCKKIT_TEST_MYSQL_URL", "?mode=row&table=lockkit_lab_row"),
        touches: &["mariadb"],
    },
    ScenarioDef {
        scenario: "server-restarted",
        backend: "postgres-advisory",
        what: "PostgreSQL restarted (fast shutdown, then start) mid-hold: the hold is a session's advisory lock",
        expect: LOST_FIRST,
        plan: Plan::DatabaseRestarted,
        url: (
            "LOCKKIT_TEST_POSTGRES_URL",
            "?mode=advisory&table=lockkit_lab_adv",
        ),
        touches: &["postgres"],
    },
    ScenarioDef {
        scenario: "server-restarted",
        backend: "postgres-row",
        what: "PostgreSQL restarted (fast shutdown, then start) mid-hold: the hold is a committed lease row",
        expect: KEPT,
        plan: Plan::DatabaseRestarted,
        url: (
            "LOCKKIT_TEST_POSTGRES_URL",
            "?mode=row&table=lockkit_lab_row",
        ),
        touches: &["postgres"],
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instance a scenario touches and every URL variable it locks on is in the
    /// instance table `services.sh` reads: the table is the one place servers are named.
    #[test]
    fn scenarios_name_only_instances_and_urls_of_the_table() {
        let table = crate::parse_instances(include_str!("../../../scripts/instances.tsv"))
            .expect("the instance table parses");
        let vars = crate::url_vars(&table);
        for def in CATALOGUE {
            for name in def.touches {
                assert!(
                    table.iter().any(|i| i.name == *name),
                    "{} touches `{name}`, which is not in scripts/instances.tsv",
                    def.name()
                );
            }
            assert!(
                def.url.0 == "file" || vars.iter().any(|v| v == def.url.0),
                "{} locks on `{}`, which is not a URL variable of scripts/instances.tsv",
                def.name(),
                def.url.0
            );
        }
    }
}

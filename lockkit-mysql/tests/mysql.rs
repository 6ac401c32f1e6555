//! MySQL-specific behaviour beyond the shared suite.

use std::time::{Duration, Instant};

use lockkit_conformance::env;
use lockkit_core::{Error, LockKey, Locker, LostReason};
use lockkit_mysql::MysqlBackend;
use sqlx::{Connection, MySqlConnection};
use uuid::Uuid;

fn url(options: &str) -> Option<String> {
    env::service_url("LOCKKIT_TEST_MYSQL_URL").map(|u| format!("{u}?{options}"))
}

fn key() -> LockKey {
    LockKey::new(format!("mysql-test/{}", Uuid::new_v4().simple())).unwrap()
}

#[tokio::test]
async fn without_create_schema_a_missing_table_reports_the_ddl() {
    let Some(url) = url(&format!(
        "table=missing_{}&create_schema=false",
        &Uuid::new_v4().simple().to_string()[..8]
    )) else {
        return;
    };
    let err = MysqlBackend::connect(&url).await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(
        err.to_string().contains("CREATE TABLE IF NOT EXISTS"),
        "{err}"
    );
}

#[tokio::test]
async fn past_max_holds_for_update_fails_clearly() {
    let Some(url) = url("mode=for-update&table=lockkit_test_fu&max_holds=2") else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let one = locker.try_acquire(key()).await.unwrap().unwrap();
    let two = locker.try_acquire(key()).await.unwrap().unwrap();
    let err = locker.try_acquire(key()).await.unwrap_err();
    assert!(err.to_string().contains("max_holds"), "{err}");
    assert!(err.is_retryable());
    one.release().await.unwrap();
    let three = locker
        .try_acquire(key())
        .await
        .unwrap()
        .expect("a freed connection is reused");
    two.release().await.unwrap();
    three.release().await.unwrap();
}

#[tokio::test]
async fn killing_the_holders_connection_fires_lost_promptly() {
    let Some(url) = url("mode=for-update&table=lockkit_test_fu") else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let rival = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let key = key();
    let guard = locker
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let id = backend
        .connection_holding(&key)
        .expect("the hold's connection");
    MysqlBackend::connect(&url)
        .await
        .unwrap()
        .kill_connection(id)
        .await
        .unwrap();
    // Well before the 30 s lease: the liveness check notices the dead connection.
    let reason = tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("lost never fired");
    assert_eq!(reason, LostReason::SessionLost);
    let next = rival
        .acquire(&key)
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        next.token() > guard.token(),
        "a killed holder's token is never reused"
    );
    assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
    next.release().await.unwrap();
}

#[tokio::test]
async fn row_leases_use_the_server_clock_and_keep_growing_fences() {
    let Some(url) = url("mode=row&table=lockkit_test_row") else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let key = key();
    let mut last = 0;
    for _ in 0..5 {
        let guard = locker
            .acquire(&key)
            .ttl(Duration::from_secs(5))
            .await
            .unwrap();
        let info = locker.inspect(&key).await.unwrap().unwrap();
        let left = info.ttl_left.unwrap();
        assert!(
            left <= Duration::from_secs(5) && left > Duration::from_secs(3),
            "{left:?}"
        );
        assert!(guard.token().get() > last);
        last = guard.token().get();
        guard.release().await.unwrap();
    }
}

/// A for-update connection goes back to the pool after a hold with the hold's short
/// `wait_timeout`; the next acquisition after an idle spell must still work (the pool
/// resets the session on release and tests connections before use).
#[tokio::test]
async fn for_update_works_after_an_idle_spell() {
    let Some(url) = url("mode=for-update&table=lockkit_test_fu_idle&max_holds=1") else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let key = key();
    let held = locker
        .acquire(&key)
        .ttl(Duration::from_secs(1))
        .await
        .unwrap();
    held.release().await.unwrap();
    // Longer than the 1 s wait_timeout the hold set on its connection.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let again = locker
        .acquire(&key)
        .ttl(Duration::from_secs(1))
        .wait(Duration::from_secs(5))
        .await
        .expect("the first acquisition after an idle spell must work");
    again.release().await.unwrap();
}

/// Row mode and for-update mode share the default table: a client in one mode must not be
/// granted a key a client in the other mode holds (finding 22), and a for-update
/// acquisition must not overwrite a row-mode holder's record.
#[tokio::test]
async fn row_and_for_update_modes_exclude_each_other() {
    let table = "lockkit_test_mixed_modes";
    let (Some(row_url), Some(fu_url)) = (
        url(&format!("mode=row&table={table}")),
        url(&format!("mode=for-update&table={table}")),
    ) else {
        return;
    };
    let row = Locker::new(MysqlBackend::connect(&row_url).await.unwrap());
    let for_update = Locker::new(MysqlBackend::connect(&fu_url).await.unwrap());
    let ttl = Duration::from_secs(30);

    // A for-update holder keeps row-mode clients out, and is not mistaken for a free row.
    let key = key();
    let held = for_update.acquire(&key).ttl(ttl).await.unwrap();
    let fu_token = held.token();
    assert!(
        row.try_acquire(&key).await.unwrap().is_none(),
        "row mode was granted a key held in for-update mode"
    );
    let shown = row
        .inspect(&key)
        .await
        .unwrap()
        .expect("row mode sees the for-update holder");
    assert_eq!(shown.owner, held.owner().to_string());
    held.release().await.unwrap();
    assert!(row.inspect(&key).await.unwrap().is_none());
    let after = row
        .acquire(&key)
        .ttl(ttl)
        .wait(Duration::from_secs(10))
        .await
        .expect("row mode gets the key once the for-update holder released it");
    assert!(after.token() > fu_token);

    // A row-mode lease keeps for-update clients out and its record intact.
    assert!(
        for_update.try_acquire(&key).await.unwrap().is_none(),
        "for-update mode was granted a key held by a row-mode lease"
    );
    let info = row
        .inspect(&key)
        .await
        .unwrap()
        .expect("the lease is still there");
    let seen = for_update.inspect(&key).await.unwrap();
    assert_eq!(seen.map(|i| i.owner), Some(after.owner().to_string()));
    assert_eq!(info.owner, after.owner().to_string());
    assert_eq!(info.token, Some(after.token()));
    let row_token = after.token();

    // A for-update waiter behind a row-mode lease gets the key once it is released, with a
    // larger token.
    let waiter = {
        let (for_update, key) = (for_update.clone(), key.clone());
        tokio::spawn(async move {
            for_update
                .acquire(&key)
                .ttl(ttl)
                .wait(Duration::from_secs(20))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "the for-update waiter did not wait");
    after.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the for-update waiter was never woken")
        .unwrap()
        .unwrap();
    assert!(next.token() > row_token);
    next.release().await.unwrap();
}

/// A for-update wait interrupted at its deadline sends `KILL QUERY` to its connection; that
/// kill must never land on a later statement of the same pooled connection (finding 20).
/// With one dedicated connection, every acquisition reuses the connection of the waiter
/// whose deadline passed just as its holder released.
#[tokio::test]
async fn a_deadline_kill_never_hits_the_next_user_of_the_connection() {
    let table = "lockkit_test_fu_kill";
    let (Some(holder_url), Some(waiter_url)) = (
        url(&format!("mode=for-update&table={table}")),
        url(&format!("mode=for-update&table={table}&max_holds=1")),
    ) else {
        return;
    };
    let holder = Locker::new(MysqlBackend::connect(&holder_url).await.unwrap());
    let waiter = Locker::new(MysqlBackend::connect(&waiter_url).await.unwrap());
    let ttl = Duration::from_secs(30);
    for round in 0..16u64 {
        let contended = key();
        let held = holder.acquire(&contended).ttl(ttl).await.unwrap();
        let wait = Duration::from_millis(200);
        let contender = {
            let (waiter, key) = (waiter.clone(), contended.clone());
            tokio::spawn(async move { waiter.acquire(&key).ttl(ttl).wait(wait).await })
        };
        // Release around the waiter's deadline: sometimes before, sometimes after.
        tokio::time::sleep(Duration::from_micros(196_000 + (round % 8) * 1_000)).await;
        held.release().await.unwrap();
        match contender.await.unwrap() {
            Ok(guard) => {
                guard.release().await.unwrap();
            }
            Err(Error::Timeout { .. }) => {}
            Err(e) => panic!("round {round}: the waiter failed: {e}"),
        }
        // The next user of the waiter's only connection.
        let next = waiter
            .acquire(key())
            .ttl(ttl)
            .wait(Duration::from_secs(5))
            .await
            .unwrap_or_else(|e| panic!("round {round}: the next acquisition failed: {e}"));
        next.release().await.unwrap();
    }
}

/// A table made before the `attempts` and `holder` columns (and the `_holds` table of
/// read-write locks and semaphores) existed is brought up to date when the client may
/// change the schema, and named with the statement to run when it may not (each missing
/// column and table in turn).
#[tokio::test]
async fn a_table_without_the_attempts_column_is_upgraded_or_reported() {
    let table = format!("old_{}", &Uuid::new_v4().simple().to_string()[..8]);
    let Some(base) = env::service_url("LOCKKIT_TEST_MYSQL_URL") else {
        return;
    };
    let admin = sqlx::MySqlPool::connect(&base).await.unwrap();
    let old_ddl = lockkit_mysql::ddl(&table)
        .split(';')
        .filter(|statement| !statement.contains("_holds"))
        .collect::<Vec<_>>()
        .join(";")
        .replace("  attempts TEXT NULL,\n", "")
        .replace("  holder TEXT CHARACTER SET ascii NULL,\n", "");
    assert!(
        !old_ddl.contains("attempts") && !old_ddl.contains("holder"),
        "{old_ddl}"
    );
    for statement in old_ddl.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()))
            .execute(&admin)
            .await
            .unwrap();
    }
    let refused =
        MysqlBackend::connect(&url(&format!("table={table}&create_schema=false")).unwrap())
            .await
            .unwrap_err();
    assert!(
        refused.to_string().contains("ADD COLUMN attempts"),
        "{refused}"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE `{table}` ADD COLUMN attempts TEXT NULL AFTER expires_at"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let refused =
        MysqlBackend::connect(&url(&format!("table={table}&create_schema=false")).unwrap())
            .await
            .unwrap_err();
    assert!(
        refused.to_string().contains("ADD COLUMN holder"),
        "{refused}"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE `{table}` ADD COLUMN holder TEXT CHARACTER SET ascii NULL"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let refused =
        MysqlBackend::connect(&url(&format!("table={table}&create_schema=false")).unwrap())
            .await
            .unwrap_err();
    assert!(matches!(refused, Error::Config(_)), "{refused}");
    assert!(
        refused
            .to_string()
            .contains(&format!("CREATE TABLE IF NOT EXISTS `{table}_holds`")),
        "{refused}"
    );
    let locker = Locker::new(
        MysqlBackend::connect(&url(&format!("table={table}")).unwrap())
            .await
            .unwrap(),
    );
    let key = key();
    let guard = locker.try_acquire(&key).await.unwrap().expect("free key");
    let holder = locker.inspect(&key).await.unwrap().expect("held");
    assert_eq!(holder.identity.map(|i| i.pid), Some(std::process::id()));
    guard.release().await.unwrap();
    let read = locker
        .read(&key)
        .try_now()
        .await
        .unwrap()
        .expect("free key");
    assert_eq!(locker.holders(&key).await.unwrap().len(), 1);
    read.release().await.unwrap();
    for suffix in ["", "_mutex", "_holds"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE `{table}{suffix}`")))
            .execute(&admin)
            .await
            .unwrap();
    }
}

/// A row-mode client paused inside its acquire transaction (it holds the
/// `<table>` row lock) keeps a for-update waiter inside `record_holder` (on the shared
/// pool, not the lock connection, so KILL QUERY cannot reach it) for the pool session's
/// innodb_lock_wait_timeout (50 s by default), far past the waiter's 1 s deadline.
#[tokio::test]
async fn a_for_update_waiter_keeps_its_deadline_behind_a_paused_row_transaction() {
    let table = "lockkit_test_paused_row_txn";
    let (Some(row_url), Some(fu_url), Some(raw)) = (
        url(&format!("mode=row&table={table}")),
        url(&format!("mode=for-update&table={table}")),
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
    ) else {
        return;
    };
    let row = Locker::new(MysqlBackend::connect(&row_url).await.unwrap());
    let for_update = Locker::new(MysqlBackend::connect(&fu_url).await.unwrap());
    let key = key();
    // The key's row exists (a row-mode lease came and went).
    row.acquire(&key).await.unwrap().release().await.unwrap();

    // A row-mode client paused between its SELECT ... FOR UPDATE and its COMMIT.
    let mut paused = MySqlConnection::connect(&raw).await.unwrap();
    sqlx::raw_sql("START TRANSACTION")
        .execute(&mut paused)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT owner FROM `{table}` WHERE name = ? FOR UPDATE"
    )))
    .bind(key.as_str().as_bytes())
    .fetch_optional(&mut paused)
    .await
    .unwrap();

    let started = Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(15),
        for_update.acquire(&key).wait(Duration::from_secs(1)),
    )
    .await;
    let took = started.elapsed();
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut paused)
        .await
        .unwrap();
    eprintln!(
        "for-update acquire with wait=1s: {:?} after {took:?}",
        outcome.as_ref().map(|r| r.as_ref().map(|_| ()))
    );
    assert!(outcome.is_ok(), "still waiting 15 s after a 1 s deadline");
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

/// Second review, finding 1: a for-update re-entry with a longer TTL lengthened only the
/// local lease; the session's `wait_timeout` (what ends the lock on the server when its
/// holder goes quiet) stayed at the outer lease until the next liveness check. A holder
/// paused right after the re-entry was cut off at the outer lease, another client got the
/// key, and the paused holder woke up still believing its guard.
#[test]
fn a_holder_paused_after_a_longer_reentry_is_not_cut_off_at_the_outer_lease() {
    let Some(url) = url("mode=for-update") else {
        return;
    };
    let key = key();
    // The holder's runtime runs only inside `block_on`: between calls it is paused, like a
    // process stopped by SIGSTOP or a long GC pause.
    let holder_runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (owner, outer, inner) = holder_runtime.block_on(async {
        let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
        let owner = locker.owner();
        let outer = owner
            .acquire(&key)
            .ttl(Duration::from_secs(2))
            .await
            .unwrap();
        // Let a liveness check or two run, so the server's timeout is the outer lease's.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let inner = owner
            .acquire(&key)
            .ttl(Duration::from_secs(60))
            .await
            .unwrap();
        (owner, outer, inner)
    });
    let rival = {
        let (url, key) = (url.clone(), key.clone());
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
                    let got = locker
                        .acquire(&key)
                        .ttl(Duration::from_secs(30))
                        .wait(Duration::from_secs(6))
                        .await;
                    let granted = got.is_ok();
                    if let Ok(guard) = got {
                        guard.release().await.unwrap();
                    }
                    granted
                })
        })
    };
    // Paused well past the outer lease (2 s, whole seconds on the server), far inside
    // the re-entry's 60 s.
    std::thread::sleep(Duration::from_secs(7));
    let believed = inner.is_valid();
    let rival_granted = rival.join().unwrap();
    assert!(
        believed,
        "the re-entry's 60 s lease cannot be over after 7 s"
    );
    assert!(
        !rival_granted,
        "another client was granted the key while the paused holder's guard believed it"
    );
    holder_runtime.block_on(async move {
        inner.release().await.unwrap();
        outer.release().await.unwrap();
        drop(owner);
    });
}

/// Second review, finding 4: more for-update waiters stuck behind paused row-mode
/// transactions than the pool has connections filled the pool (each waiter's holder
/// record waits there for the row lock), and the deadline's `KILL`, sent through the same
/// pool, waited for its acquire timeout: a 1 s wait took 6 s. `KILL` now has a connection
/// of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn for_update_deadlines_hold_when_stuck_holder_records_fill_the_pool() {
    let Some(for_update_url) = url("mode=for-update&pool_size=2") else {
        return;
    };
    let base = env::service_url("LOCKKIT_TEST_MYSQL_URL").unwrap();
    let locker = Locker::new(MysqlBackend::connect(&for_update_url).await.unwrap());
    let row = Locker::new(
        MysqlBackend::connect(&url("mode=row").unwrap())
            .await
            .unwrap(),
    );
    let keys: Vec<LockKey> = (0..4).map(|_| key()).collect();
    // Each key's row exists (a row-mode hold, released); then a paused transaction locks it.
    let mut paused = Vec::new();
    for k in &keys {
        row.acquire(k).await.unwrap().release().await.unwrap();
        let mut c = MySqlConnection::connect(&base).await.unwrap();
        sqlx::raw_sql("BEGIN").execute(&mut c).await.unwrap();
        sqlx::query("SELECT name FROM lockkit_locks WHERE name = ? FOR UPDATE")
            .bind(k.as_str().as_bytes())
            .fetch_all(&mut c)
            .await
            .unwrap();
        paused.push(c);
    }
    let wait = Duration::from_secs(1);
    let waiters: Vec<_> = keys
        .iter()
        .map(|k| {
            let (locker, k) = (locker.clone(), k.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                let outcome = locker.acquire(&k).wait(wait).await;
                (outcome.map(|_| ()), started.elapsed())
            })
        })
        .collect();
    let mut worst = Duration::ZERO;
    for waiter in waiters {
        let (outcome, took) = waiter.await.unwrap();
        eprintln!("{outcome:?} after {took:?}");
        assert!(matches!(outcome, Err(Error::Timeout { .. })), "{outcome:?}");
        worst = worst.max(took);
    }
    for c in paused {
        c.close().await.unwrap();
    }
    // Wide margin: the pool's acquire timeout (5 s) is what the old KILL waited for.
    assert!(worst < wait * 3, "a {wait:?} wait took {worst:?}");
}

/// `take_away` on a key a for-update holder holds says it cannot, instead of answering
/// that nothing was held (review 12, F3), and leaves the hold alone.
#[tokio::test]
async fn take_away_refuses_a_for_update_hold_instead_of_finding_nothing() {
    let Some(url) = url("mode=for-update&table=lockkit_test_fu") else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let key = key();
    assert!(
        !backend.take_away(&key).await.unwrap(),
        "a free key had nothing to take away"
    );
    let held = locker
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let refused = backend.take_away(&key).await.unwrap_err();
    assert!(matches!(refused, Error::Unsupported { .. }), "{refused}");
    assert!(refused.to_string().contains("KILL"), "{refused}");
    assert!(held.is_valid());
    held.release().await.expect("still held after the refusal");
}

/// A retried row-mode acquisition (same attempt id, as after a lost COMMIT answer) whose
/// lease runs out between its look at the row and its extension is still extended, under
/// the row lock: the grant it returns never rests on an expired lease (review 17, M1). The
/// same for a read, a write and a permit, whose holds are rows of `<table>_holds`.
#[tokio::test]
async fn a_retried_row_acquire_never_returns_an_expired_lease() {
    use lockkit_core::{LockBackend, LockKind, LossSignal, OwnerId, spi::AcquireRequest};
    let Some(url) = url("mode=row&table=lockkit_test_retry") else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    for kind in [
        LockKind::Exclusive,
        LockKind::Read,
        LockKind::Write,
        LockKind::Permit {
            limit: std::num::NonZeroU32::MIN,
        },
    ] {
        let k = key();
        let req = AcquireRequest::new(
            k.clone(),
            OwnerId::random(),
            Duration::from_secs(1),
            LossSignal::new(),
        )
        .with_kind(kind);
        backend
            .try_acquire(&req)
            .await
            .unwrap()
            .expect("a free key");
        // The retry sees the lease live, then waits past its end before extending it.
        lockkit_mysql::set_retry_pause(Duration::from_millis(1500));
        let retried = backend.try_acquire(&req).await;
        lockkit_mysql::set_retry_pause(Duration::ZERO);
        let retried = retried.unwrap().expect("the retry is the same grant");
        let held = backend.inspect(&k).await.unwrap();
        assert!(
            held.is_some(),
            "{kind:?}: the retried grant went out while the server's lease had run out"
        );
        assert_eq!(retried.depth, 1, "{kind:?}: a retry is not a second hold");
        // Its lease now runs a second from the extension; a slow machine may see it out.
        let _ = backend.release(&retried).await;
    }
}

/// A client that does not know the `holder` column (an older lockkit) takes over an expired
/// lease with its own UPDATE: the previous holder's identity, still in the column, is not
/// reported as the new holder's.
#[tokio::test]
async fn a_takeover_that_leaves_the_holder_column_is_not_misreported() {
    let table = "lockkit_test_stale_holder";
    let (Some(row_url), Some(raw)) = (
        url(&format!("mode=row&table={table}")),
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
    ) else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&row_url).await.unwrap());
    let key = key();
    let guard = locker
        .try_acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap()
        .expect("free key");
    let before = locker.inspect(&key).await.unwrap().expect("held");
    assert_eq!(before.identity.map(|i| i.pid), Some(std::process::id()));
    // The older client's take-over: owner, holds, fence and lease, not `holder`.
    let admin = sqlx::MySqlPool::connect(&raw).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE `{table}` SET owner = 'older-client:1', holds = 1, fence = fence + 1, \
         expires_at = UTC_TIMESTAMP(6) + INTERVAL 60 SECOND WHERE name = ?"
    )))
    .bind(key.as_str().as_bytes())
    .execute(&admin)
    .await
    .unwrap();
    let after = locker.inspect(&key).await.unwrap().expect("held");
    assert_eq!(after.owner, "older-client:1");
    assert_eq!(
        after.identity, None,
        "a stale identity was reported: {after:?}"
    );
    drop(guard);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE `{table}` SET owner = NULL, holds = 0, expires_at = NULL WHERE name = ?"
    )))
    .bind(key.as_str().as_bytes())
    .execute(&admin)
    .await
    .unwrap();
}

/// Read-write locks and semaphores in row mode: `holders()` lists every reader and permit
/// with its kind, token, lease and identity, and `inspect` reports one of them.
#[tokio::test]
async fn holders_lists_every_reader_and_permit() {
    use lockkit_core::LockKind;
    let Some(url) = url("mode=row&table=lockkit_test_row") else {
        return;
    };
    let (a, b) = (
        Locker::new(MysqlBackend::connect(&url).await.unwrap()),
        Locker::new(MysqlBackend::connect(&url).await.unwrap()),
    );
    let ttl = Duration::from_secs(30);
    let k = key();
    let owner = a.owner();
    let one = owner.read(&k).ttl(ttl).try_now().await.unwrap().unwrap();
    let two = b.read(&k).ttl(ttl).try_now().await.unwrap().unwrap();
    let again = owner.read(&k).ttl(ttl).try_now().await.unwrap().unwrap();
    assert_eq!(again.depth(), 2);
    let holders = a.holders(&k).await.unwrap();
    assert_eq!(holders.len(), 2, "one entry per reader: {holders:?}");
    assert_eq!(holders.iter().map(|h| h.depth).max(), Some(2));
    for h in &holders {
        assert_eq!(h.kind, Some(LockKind::Read));
        assert!(h.token.is_some());
        assert!(h.ttl_left.is_some_and(|left| left <= ttl && left > ttl / 2));
        assert_eq!(h.identity.as_ref().map(|i| i.pid), Some(std::process::id()));
    }
    let tokens: Vec<_> = holders.iter().filter_map(|h| h.token).collect();
    assert!(tokens.contains(&one.token()) && tokens.contains(&two.token()));
    let shown = a
        .inspect(&k)
        .await
        .unwrap()
        .expect("one holder is reported");
    assert_eq!(shown.kind, Some(LockKind::Read));
    again.release().await.unwrap();
    one.release().await.unwrap();
    two.release().await.unwrap();

    let s = key();
    let semaphore = a.semaphore(&s, 2);
    let p1 = semaphore.try_acquire().ttl(ttl).await.unwrap().unwrap();
    let p2 = semaphore.try_acquire().ttl(ttl).await.unwrap().unwrap();
    let holders = semaphore.holders().await.unwrap();
    assert_eq!(holders.len(), 2, "{holders:?}");
    assert!(
        holders
            .iter()
            .all(|h| h.kind.and_then(LockKind::limit) == Some(2))
    );
    p1.release().await.unwrap();
    p2.release().await.unwrap();
    assert!(a.holders(&s).await.unwrap().is_empty());
}

/// A retried read or permit acquisition (same attempt id, as after a lost COMMIT answer)
/// is the same hold again: one reader at depth 1, one permit, the same token.
#[tokio::test]
async fn a_retried_read_or_permit_takes_effect_once() {
    use lockkit_core::{LockBackend, LockKind, LossSignal, OwnerId, spi::AcquireRequest};
    use std::num::NonZeroU32;
    let Some(url) = url("mode=row&table=lockkit_test_row") else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    for kind in [
        LockKind::Read,
        LockKind::Write,
        LockKind::Permit {
            limit: NonZeroU32::new(2).unwrap(),
        },
    ] {
        let k = key();
        let req = AcquireRequest::new(
            k.clone(),
            OwnerId::random(),
            Duration::from_secs(30),
            LossSignal::new(),
        )
        .with_kind(kind);
        let first = backend.try_acquire(&req).await.unwrap().expect("free");
        let again = backend.try_acquire(&req).await.unwrap().expect("a retry");
        assert_eq!((again.token, again.depth), (first.token, 1), "{kind:?}");
        assert_eq!(backend.holders(&k).await.unwrap().len(), 1, "{kind:?}");
        backend.release(&first).await.unwrap();
        assert!(
            matches!(backend.release(&again).await, Err(Error::NotHeld { .. })),
            "{kind:?}: the retry added no second hold"
        );
    }
}

/// A reader that dies (no release, no renewal) holds the key only until its lease runs
/// out on the server's clock; a writer then gets it with a larger token.
#[tokio::test]
async fn a_dead_readers_hold_ends_with_its_lease() {
    let Some(url) = url("mode=row&table=lockkit_test_row") else {
        return;
    };
    let (a, b) = (
        Locker::new(MysqlBackend::connect(&url).await.unwrap()),
        Locker::new(MysqlBackend::connect(&url).await.unwrap()),
    );
    let k = key();
    let reader = a
        .read(&k)
        .ttl(Duration::from_millis(500))
        .no_watchdog()
        .try_now()
        .await
        .unwrap()
        .unwrap();
    let token = reader.token();
    std::mem::forget(reader);
    assert!(b.write(&k).try_now().await.unwrap().is_none());
    let started = Instant::now();
    let writer = b
        .write(&k)
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(writer.token() > token);
    writer.release().await.unwrap();
}

/// A plain lock and a read lock asked at once on fresh keys (both find no row and create
/// it) are never both granted.
#[tokio::test]
async fn a_plain_lock_and_a_reader_racing_on_a_fresh_key_exclude_each_other() {
    let Some(url) = url("mode=row&table=lockkit_test_row") else {
        return;
    };
    let (a, b) = (
        Locker::new(MysqlBackend::connect(&url).await.unwrap()),
        Locker::new(MysqlBackend::connect(&url).await.unwrap()),
    );
    let ttl = Duration::from_secs(30);
    for _ in 0..40 {
        let k = key();
        let (plain, read) = tokio::join!(async { a.try_acquire(&k).ttl(ttl).await }, async {
            b.read(&k).ttl(ttl).try_now().await
        });
        let (plain, read) = (plain.unwrap(), read.unwrap());
        assert!(
            plain.is_none() || read.is_none(),
            "a plain lock and a reader were both granted"
        );
        if let Some(g) = plain {
            g.release().await.unwrap();
        }
        if let Some(g) = read {
            g.release().await.unwrap();
        }
    }
}

/// Row mode's readers and for-update mode's plain locks share a table: each keeps the
/// other out, and for-update mode refuses read-write locks and semaphores, saying so.
#[tokio::test]
async fn row_readers_and_for_update_locks_exclude_each_other() {
    let table = "lockkit_test_mixed_modes";
    let (Some(row_url), Some(fu_url)) = (
        url(&format!("mode=row&table={table}")),
        url(&format!("mode=for-update&table={table}")),
    ) else {
        return;
    };
    let row = Locker::new(MysqlBackend::connect(&row_url).await.unwrap());
    let for_update = Locker::new(MysqlBackend::connect(&fu_url).await.unwrap());
    let ttl = Duration::from_secs(30);
    let k = key();
    let reader = row.read(&k).ttl(ttl).try_now().await.unwrap().unwrap();
    assert!(
        for_update.try_acquire(&k).await.unwrap().is_none(),
        "for-update mode was granted a key a row-mode reader holds"
    );
    reader.release().await.unwrap();
    let held = for_update.acquire(&k).ttl(ttl).await.unwrap();
    assert!(
        row.read(&k).try_now().await.unwrap().is_none(),
        "row mode granted a read of a key held in for-update mode"
    );
    held.release().await.unwrap();
    let refused = for_update.read(&k).try_now().await.unwrap_err();
    assert!(matches!(refused, Error::Unsupported { .. }), "{refused}");
}

/// A waiting writer that dies (its process gone, so nothing deletes its marker) keeps new
/// readers out only for the marker's short lease, while readers already in may re-enter.
#[tokio::test]
async fn a_dead_waiting_writers_marker_runs_out() {
    let table = "lockkit_test_row";
    let (Some(url), Some(base)) = (
        url(&format!("mode=row&table={table}")),
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
    ) else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let ttl = Duration::from_secs(30);
    let k = key();
    let owner = locker.owner();
    let first = owner.read(&k).ttl(ttl).try_now().await.unwrap().unwrap();
    // What a writer's busy poll leaves, written as a process that then died would.
    let mut admin = MySqlConnection::connect(&base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{table}_holds` (name, kind, holder, owner, holds, token, expires_at) \
         VALUES (?, 'q', 'dead:1', 'dead:1', 1, 0, UTC_TIMESTAMP(6) + INTERVAL 2 SECOND)"
    )))
    .bind(k.as_str().as_bytes())
    .execute(&mut admin)
    .await
    .unwrap();
    assert!(
        locker.read(&k).try_now().await.unwrap().is_none(),
        "a new reader passed a waiting writer's marker"
    );
    let again = owner.read(&k).ttl(ttl).try_now().await.unwrap();
    again
        .expect("a reader re-enters behind a waiting writer")
        .release()
        .await
        .unwrap();
    let started = Instant::now();
    let late = locker
        .read(&k)
        .ttl(ttl)
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        waited > Duration::from_millis(1000) && waited < Duration::from_secs(4),
        "the marker's lease decides: waited {waited:?}"
    );
    late.release().await.unwrap();
    first.release().await.unwrap();
}

/// Plain locks, reads and writes of one key from many clients at once: a plain lock or a
/// writer never holds beside anyone, and no acquisition fails (a deadlock InnoDB breaks
/// is retried, never reported).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_locks_reads_and_writes_of_one_key_stay_exclusive() {
    use std::sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    };
    let Some(url) = url("mode=row&table=lockkit_test_row") else {
        return;
    };
    let k = key();
    let (readers, exclusive) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let mut tasks = Vec::new();
    for task in 0..6u64 {
        let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
        let (k, readers, exclusive) = (k.clone(), readers.clone(), exclusive.clone());
        tasks.push(tokio::spawn(async move {
            let ttl = Duration::from_secs(30);
            let wait = Duration::from_secs(30);
            for round in 0..15u64 {
                let hold = Duration::from_millis((task * 7 + round * 3) % 5);
                match (task + round) % 3 {
                    0 => {
                        let guard = locker.read(&k).ttl(ttl).wait(wait).await.unwrap();
                        readers.fetch_add(1, Ordering::SeqCst);
                        assert_eq!(
                            exclusive.load(Ordering::SeqCst),
                            0,
                            "a reader beside a writer"
                        );
                        tokio::time::sleep(hold).await;
                        readers.fetch_sub(1, Ordering::SeqCst);
                        guard.release().await.unwrap();
                    }
                    kind => {
                        let guard = if kind == 1 {
                            locker.acquire(&k).ttl(ttl).wait(wait).await.unwrap()
                        } else {
                            locker.write(&k).ttl(ttl).wait(wait).await.unwrap()
                        };
                        assert_eq!(exclusive.fetch_add(1, Ordering::SeqCst), 0, "two writers");
                        assert_eq!(readers.load(Ordering::SeqCst), 0, "a writer beside readers");
                        tokio::time::sleep(hold).await;
                        exclusive.fetch_sub(1, Ordering::SeqCst);
                        guard.release().await.unwrap();
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

/// For-update mode has no read-write locks or semaphores: the `Locker` refuses them before
/// any I/O, and the backend itself refuses a request sent to it directly (rather than
/// taking it as a plain lock), saying which mode has them.
#[tokio::test]
async fn for_update_refuses_reads_and_permits_sent_to_it_directly() {
    use lockkit_core::{LockBackend, LockKind, LossSignal, OwnerId, spi::AcquireRequest};
    let Some(url) = url("mode=for-update&table=lockkit_test_fu") else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    for kind in [
        LockKind::Read,
        LockKind::Write,
        LockKind::Permit {
            limit: std::num::NonZeroU32::MIN,
        },
    ] {
        let req = AcquireRequest::new(
            key(),
            OwnerId::random(),
            Duration::from_secs(30),
            LossSignal::new(),
        )
        .with_kind(kind);
        let refused = backend.try_acquire(&req).await.unwrap_err();
        assert!(matches!(refused, Error::Unsupported { .. }), "{refused}");
        assert!(refused.to_string().contains("mode=row"), "{refused}");
        let refused = backend
            .acquire(&req, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(refused, Error::Unsupported { .. }), "{refused}");
    }
}

/// Whether the server still has connection `id` open (a user sees its own connections in
/// the process list without the PROCESS privilege).
async fn connection_open(url: &str, id: u64) -> bool {
    let mut conn = MySqlConnection::connect(url).await.unwrap();
    let (n,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?")
            .bind(id)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    n == 1
}

/// A dedicated connection goes back to the pool with the server's `wait_timeout`, put back
/// in the round trip of its last statement (a released hold, and an attempt that found the
/// key taken), never left at a hold's one-second lease for the server to cut it.
#[tokio::test]
async fn for_update_connections_return_with_the_servers_wait_timeout() {
    let table = "lockkit_test_fu_restore";
    let (Some(base), Some(url), Some(rival_url)) = (
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
        url(&format!("mode=for-update&table={table}&max_holds=1")),
        url(&format!("mode=for-update&table={table}")),
    ) else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let rival = Locker::new(MysqlBackend::connect(&rival_url).await.unwrap());
    let (mine, theirs) = (key(), key());
    let ttl = Duration::from_secs(1);
    let held = locker.acquire(&mine).ttl(ttl).await.unwrap();
    let id = backend.connection_holding(&mine).unwrap();
    held.release().await.unwrap();
    // The release cleared the holder record in the lock transaction.
    let mut probe = MySqlConnection::connect(&base).await.unwrap();
    let (owner, holds): (Option<String>, u32) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT owner, holds FROM `{table}` WHERE name = ?"
    )))
    .bind(mine.as_str().as_bytes())
    .fetch_one(&mut probe)
    .await
    .unwrap();
    assert_eq!((owner, holds), (None, 0), "the holder record is cleared");
    // Longer than the one-second wait_timeout the hold set.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        connection_open(&base, id).await,
        "the server closed the pooled connection after a release: its wait_timeout was left \
         at the lease"
    );
    let taken = rival
        .acquire(&theirs)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        locker
            .try_acquire(&theirs)
            .ttl(ttl)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        locker
            .try_acquire(&theirs)
            .ttl(ttl)
            .await
            .unwrap()
            .map(|g| g.token()),
        None
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        connection_open(&base, id).await,
        "the server closed the pooled connection after a refused attempt: its wait_timeout \
         was left at the lease"
    );
    let again = locker.try_acquire(&mine).await.unwrap().unwrap();
    assert_eq!(
        backend.connection_holding(&mine),
        Some(id),
        "the same connection"
    );
    again.release().await.unwrap();
    taken.release().await.unwrap();
}

/// Pools ping a connection only after an idle spell: one killed just after its last use
/// (no idle spell) costs its first statement, never the caller's call. For-update takes
/// another dedicated connection; row mode sends its one-statement acquisition and release
/// again on another pooled connection.
#[tokio::test]
async fn a_pooled_connection_killed_right_after_use_fails_no_call() {
    let (Some(fu_url), Some(row_url)) = (
        url("mode=for-update&table=lockkit_test_fu_killed_idle&max_holds=1"),
        url("mode=row&table=lockkit_test_row_killed_idle&pool_size=1"),
    ) else {
        return;
    };
    let killer = MysqlBackend::connect(&row_url).await.unwrap();
    let kill = |id: u64| {
        let killer = killer.clone();
        async move {
            // After the pool's own ping of a returned connection, which would find it
            // dead; well within the idle spell after which the pool pings before use.
            tokio::time::sleep(Duration::from_millis(200)).await;
            killer.kill_connection(id).await.unwrap();
            // Let the server finish closing it.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };

    let backend = MysqlBackend::connect(&fu_url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let key = key();
    let held = locker.try_acquire(&key).await.unwrap().unwrap();
    let id = backend.connection_holding(&key).unwrap();
    held.release().await.unwrap();
    kill(id).await;
    let again = locker
        .try_acquire(&key)
        .await
        .expect("a dead pooled dedicated connection is replaced")
        .expect("the key is free");
    assert_ne!(backend.connection_holding(&key), Some(id));
    again.release().await.unwrap();

    let backend = MysqlBackend::connect(&row_url).await.unwrap();
    let locker = Locker::new(backend.clone());
    kill(backend.pooled_connection_id().await.unwrap()).await;
    let held = locker
        .try_acquire(&key)
        .await
        .expect("the acquisition goes to another connection")
        .expect("the key is free");
    kill(backend.pooled_connection_id().await.unwrap()).await;
    held.release()
        .await
        .expect("the release goes to another connection");
    assert!(locker.inspect(&key).await.unwrap().is_none());
}

/// The one-statement acquisition of a free key waits for the key's row lock like the full
/// transaction, and then sees the read hold committed by the transaction it waited for
/// (its holds check reads after the lock is granted, not from a snapshot taken before the
/// wait): a plain lock is never granted over a reader that was being admitted meanwhile.
#[tokio::test]
async fn a_free_key_is_not_granted_over_a_reader_admitted_during_the_wait() {
    let table = "lockkit_test_row_fast_path";
    let (Some(base), Some(url)) = (
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
        url(&format!("mode=row&table={table}")),
    ) else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let key = key();
    // The key's row exists and is free.
    locker
        .try_acquire(&key)
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    // A reader's admission, as mode=row makes it: the key's row locked, a live read hold
    // written, the commit still to come.
    let mut reader = MySqlConnection::connect(&base).await.unwrap();
    sqlx::raw_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut reader)
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut reader).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT fence FROM `{table}` WHERE name = ? FOR UPDATE"
    )))
    .bind(key.as_str().as_bytes())
    .fetch_one(&mut reader)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{table}_holds` (name, kind, holder, owner, holds, token, expires_at) \
         VALUES (?, 'r', 'a-reader', 'a-reader', 1, 0, UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)"
    )))
    .bind(key.as_str().as_bytes())
    .execute(&mut reader)
    .await
    .unwrap();
    let attempt = {
        let (locker, key) = (locker.clone(), key.clone());
        tokio::spawn(async move { locker.try_acquire(&key).await })
    };
    // The attempt is now waiting for the row lock.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!attempt.is_finished(), "the attempt waits for the row lock");
    sqlx::raw_sql("COMMIT").execute(&mut reader).await.unwrap();
    let granted = attempt.await.unwrap().unwrap();
    assert!(
        granted.is_none(),
        "a plain lock was granted over a live read hold"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM `{table}_holds` WHERE name = ?"
    )))
    .bind(key.as_str().as_bytes())
    .execute(&mut reader)
    .await
    .unwrap();
}

/// Writes a read hold on `key` in `table` with one second left, then starts its renewal
/// (the `holds_renew` statement, run while the hold is live) and leaves it uncommitted for
/// 1.3 s, past the old expiry: a renewal whose commit is slow (an fsync), widened. Returns
/// the connection, to commit the renewal on.
async fn renewal_in_flight(base: &str, table: &str, key: &LockKey) -> MySqlConnection {
    let mut c = MySqlConnection::connect(base).await.unwrap();
    sqlx::raw_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut c)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{table}_holds` (name, kind, holder, owner, holds, token, expires_at) \
         VALUES (?, 'r', 'a-reader', 'a-reader', 1, 0, UTC_TIMESTAMP(6) + INTERVAL 1 SECOND)"
    )))
    .bind(key.as_str().as_bytes())
    .execute(&mut c)
    .await
    .unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut c).await.unwrap();
    let renewed = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE `{table}_holds` SET expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL 30 SECOND) \
         WHERE name = ? AND kind = 'r' AND holder = 'a-reader' AND expires_at > UTC_TIMESTAMP(6)"
    )))
    .bind(key.as_str().as_bytes())
    .execute(&mut c)
    .await
    .unwrap();
    assert_eq!(
        renewed.rows_affected(),
        1,
        "the renewal matched a live hold"
    );
    tokio::time::sleep(Duration::from_millis(1300)).await;
    c
}

/// A plain lock attempt (`try_acquire` of `locker`) made while a reader's renewal is in
/// flight past the hold's old expiry, the renewal committed 400 ms later: whether it was
/// granted, and the holders listed by `lister` afterwards.
async fn try_over_a_renewal_in_flight(
    base: &str,
    table: &str,
    locker: &Locker,
    lister: &Locker,
    key: &LockKey,
) -> (bool, usize) {
    let mut renewal = renewal_in_flight(base, table, key).await;
    let attempt = {
        let (locker, key) = (locker.clone(), key.clone());
        tokio::spawn(async move { locker.try_acquire(&key).await })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    sqlx::raw_sql("COMMIT").execute(&mut renewal).await.unwrap();
    let granted = attempt.await.unwrap().unwrap();
    let holders = lister.holders(key).await.unwrap().len();
    let was_granted = granted.is_some();
    if let Some(granted) = granted {
        granted.release().await.unwrap();
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM `{table}_holds` WHERE name = ?"
    )))
    .bind(key.as_str().as_bytes())
    .execute(&mut renewal)
    .await
    .unwrap();
    (was_granted, holders)
}

/// The one-statement acquisition of a free key never grants a plain lock over a read hold
/// whose renewal is in flight: its read of the holds is not a locking one and sees the
/// hold's last committed (expired) version, so it leaves any key with hold rows to the
/// full transaction, whose locking delete of the expired hold waits for the renewal.
#[tokio::test]
async fn a_free_key_is_not_granted_over_a_read_hold_whose_renewal_is_in_flight() {
    let table = "lockkit_test_row_fast_path";
    let (Some(base), Some(url)) = (
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
        url(&format!("mode=row&table={table}")),
    ) else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let key = key();
    // The key's row exists and is free.
    let held = locker.try_acquire(&key).await.unwrap().unwrap();
    held.release().await.unwrap();
    let (granted, holders) =
        try_over_a_renewal_in_flight(&base, table, &locker, &locker, &key).await;
    assert!(
        !granted,
        "a plain lock was granted beside the renewed read hold ({holders} holders listed)"
    );
}

/// The same for a for-update holder's record on a table shared with mode=row: never taken
/// over a read hold whose renewal is in flight.
#[tokio::test]
async fn for_update_is_not_granted_over_a_read_hold_whose_renewal_is_in_flight() {
    let table = "lockkit_test_mixed_modes";
    let (Some(base), Some(row_url), Some(fu_url)) = (
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
        url(&format!("mode=row&table={table}")),
        url(&format!("mode=for-update&table={table}")),
    ) else {
        return;
    };
    let row = Locker::new(MysqlBackend::connect(&row_url).await.unwrap());
    let for_update = Locker::new(MysqlBackend::connect(&fu_url).await.unwrap());
    let key = key();
    let held = for_update.try_acquire(&key).await.unwrap().unwrap();
    held.release().await.unwrap();
    let (granted, holders) =
        try_over_a_renewal_in_flight(&base, table, &for_update, &row, &key).await;
    assert!(
        !granted,
        "a for-update lock was granted beside the renewed read hold ({holders} row-mode holders listed)"
    );
}

/// An expired read hold left behind (its reader gone, no row-mode acquisition of the key
/// since to delete it) does not keep for-update clients out: the for-update acquisition
/// deletes it under the key's row lock and takes the key.
#[tokio::test]
async fn for_update_deletes_an_expired_read_hold_and_takes_the_key() {
    let table = "lockkit_test_mixed_modes";
    let (Some(base), Some(fu_url)) = (
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
        url(&format!("mode=for-update&table={table}")),
    ) else {
        return;
    };
    let for_update = Locker::new(MysqlBackend::connect(&fu_url).await.unwrap());
    let key = key();
    let held = for_update.try_acquire(&key).await.unwrap().unwrap();
    let first = held.token();
    held.release().await.unwrap();
    let mut c = MySqlConnection::connect(&base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{table}_holds` (name, kind, holder, owner, holds, token, expires_at) \
         VALUES (?, 'r', 'a-reader', 'a-reader', 1, 0, UTC_TIMESTAMP(6) - INTERVAL 1 SECOND)"
    )))
    .bind(key.as_str().as_bytes())
    .execute(&mut c)
    .await
    .unwrap();
    let held = for_update
        .try_acquire(&key)
        .await
        .unwrap()
        .expect("an expired read hold does not hold the key");
    assert!(held.token() > first);
    let (left,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{table}_holds` WHERE name = ?"
    )))
    .bind(key.as_str().as_bytes())
    .fetch_one(&mut c)
    .await
    .unwrap();
    assert_eq!(left, 0, "the expired hold was deleted");
    held.release().await.unwrap();
}

/// A for-update release whose in-transaction clearing of the holder record fails (here:
/// the record's row stays locked past the hold's one-second lock wait) ends the lock and
/// then clears the record on its own. The same owner may hold the key again by then: that
/// later hold's record is left alone, so mode=row keeps out while it lasts.
#[tokio::test]
async fn a_late_clearing_of_a_for_update_record_leaves_the_owners_next_hold_alone() {
    let table = "lockkit_test_fu_late_clear";
    let (Some(base), Some(row_url), Some(fu_url)) = (
        env::service_url("LOCKKIT_TEST_MYSQL_URL"),
        url(&format!("mode=row&table={table}")),
        url(&format!("mode=for-update&table={table}")),
    ) else {
        return;
    };
    let row = Locker::new(MysqlBackend::connect(&row_url).await.unwrap());
    let for_update = Locker::new(MysqlBackend::connect(&fu_url).await.unwrap());
    let key = key();
    let owner = for_update.owner();
    let first = for_update
        .acquire(&key)
        .owner(&owner)
        .try_now()
        .await
        .unwrap()
        .unwrap();
    // Someone holds the record's row (a row-mode transaction that stalls).
    let mut blocker = MySqlConnection::connect(&base).await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT fence FROM `{table}` WHERE name = ? FOR UPDATE"
    )))
    .bind(key.as_str().as_bytes())
    .fetch_one(&mut blocker)
    .await
    .unwrap();
    lockkit_mysql::set_release_clear_pause(Duration::from_millis(2500));
    let release = tokio::spawn(first.release());
    // The release's UPDATE gives up after one second and the lock ends; the row is free
    // again a little later, well before the release clears the record on its own.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sqlx::raw_sql("COMMIT").execute(&mut blocker).await.unwrap();
    let second = for_update
        .acquire(&key)
        .owner(&owner)
        .try_now()
        .await
        .unwrap()
        .expect("the first hold's lock has ended");
    release.await.unwrap().unwrap();
    lockkit_mysql::set_release_clear_pause(Duration::ZERO);
    let beside = row.try_acquire(&key).await.unwrap();
    let listed = for_update.inspect(&key).await.unwrap();
    let granted_beside = beside.is_some();
    if let Some(beside) = beside {
        beside.release().await.unwrap();
    }
    second.release().await.unwrap();
    assert!(
        !granted_beside,
        "mode=row granted the key beside the owner's second for-update hold (its record \
         was wiped by the first hold's release; inspect said {listed:?})"
    );
}

/// Kills every connection of `backend`'s shared pool of two (as a server restart would),
/// after they were last used well within the idle spell after which the pool pings.
async fn kill_both_pooled_connections(killer: &MysqlBackend, backend: &MysqlBackend) {
    let (mut a, mut b) = (0, 0);
    for _ in 0..20 {
        let (x, y) = tokio::join!(
            backend.pooled_connection_id(),
            backend.pooled_connection_id()
        );
        (a, b) = (x.unwrap(), y.unwrap());
        if a != b {
            break;
        }
    }
    assert_ne!(a, b, "two pooled connections");
    tokio::time::sleep(Duration::from_millis(200)).await;
    killer.kill_connection(a).await.unwrap();
    killer.kill_connection(b).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Every pooled connection dead (a server restart), none idle long enough to be pinged:
/// no call fails for it, whether it starts with a single statement (the plain lock's
/// acquisition and release, a renewal, a listing) or a transaction (a read's acquisition
/// and release).
#[tokio::test]
async fn dead_pooled_connections_fail_no_call() {
    let Some(url) = url("mode=row&table=lockkit_test_row_killed_idle&pool_size=2") else {
        return;
    };
    let killer = MysqlBackend::connect(&url).await.unwrap();
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let key = key();
    let ttl = Duration::from_secs(30);

    kill_both_pooled_connections(&killer, &backend).await;
    let plain = locker
        .try_acquire(&key)
        .await
        .expect("a plain lock's acquisition after every pooled connection died")
        .expect("the key is free");
    kill_both_pooled_connections(&killer, &backend).await;
    plain
        .extend(ttl)
        .await
        .expect("a renewal after every pooled connection died");
    kill_both_pooled_connections(&killer, &backend).await;
    plain
        .release()
        .await
        .expect("a plain lock's release after every pooled connection died");

    kill_both_pooled_connections(&killer, &backend).await;
    let read = locker
        .read(&key)
        .ttl(ttl)
        .try_now()
        .await
        .expect("a read's acquisition (a transaction) after every pooled connection died")
        .expect("the key is free");
    kill_both_pooled_connections(&killer, &backend).await;
    assert_eq!(
        locker
            .holders(&key)
            .await
            .expect("a listing after every pooled connection died")
            .len(),
        1
    );
    kill_both_pooled_connections(&killer, &backend).await;
    read.release()
        .await
        .expect("a read's release (a transaction) after every pooled connection died");
}

/// A transaction's `BEGIN` that lands on a dead pooled connection (the first call after a
/// server restart is a read's acquisition, nothing seen dead before) is sent again on a
/// live one.
#[tokio::test]
async fn a_transaction_after_dead_pooled_connections_begins_on_a_live_one() {
    let Some(url) = url("mode=row&table=lockkit_test_row_killed_idle&pool_size=2") else {
        return;
    };
    let killer = MysqlBackend::connect(&url).await.unwrap();
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let key = key();
    kill_both_pooled_connections(&killer, &backend).await;
    let read = locker
        .read(&key)
        .try_now()
        .await
        .expect("a read's acquisition (a transaction) after every pooled connection died")
        .expect("the key is free");
    read.release().await.unwrap();
}

/// Row mode keeps a few pooled connections out of sqlx's pool between its one-statement
/// calls (sqlx pings every connection given back). Killed right after use (a server
/// restart), a kept connection costs its first statement, never the caller's call: the
/// grant of a free key, a renewal and a release, each on a client of its own (a dead
/// connection seen sends a client's next calls to the pool for a while).
#[tokio::test]
async fn a_kept_connection_killed_right_after_use_fails_no_call() {
    let Some(url) = url("mode=row&table=lockkit_test_row_kept&pool_size=4") else {
        return;
    };
    let killer = MysqlBackend::connect(&url).await.unwrap();
    for call in ["grant", "renewal", "release"] {
        let backend = MysqlBackend::connect(&url).await.unwrap();
        let locker = Locker::new(backend.clone());
        let key = key();
        // The key's row exists and is free; one connection is kept.
        let first = locker.try_acquire(&key).await.unwrap().expect("free");
        let held = match call {
            "grant" => {
                first.release().await.unwrap();
                None
            }
            _ => Some(first),
        };
        let kept = backend.kept_connection_ids().await.unwrap();
        assert_eq!(kept.len(), 1, "{call}: the last call's connection is kept");
        // Well within the idle spell after which a kept connection goes back to the pool.
        killer.kill_connection(kept[0]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        match (call, held) {
            ("grant", None) => locker
                .try_acquire(&key)
                .await
                .expect("a grant on a dead kept connection goes to another")
                .expect("free")
                .release()
                .await
                .map(|_| ())
                .unwrap(),
            ("renewal", Some(held)) => {
                held.extend(Duration::from_secs(30))
                    .await
                    .expect("a renewal on a dead kept connection goes to another");
                held.release().await.map(|_| ()).unwrap();
            }
            (_, Some(held)) => held
                .release()
                .await
                .map(|_| ())
                .expect("a release on a dead kept connection goes to another"),
            _ => unreachable!(),
        }
        assert!(locker.inspect(&key).await.unwrap().is_none(), "{call}");
        tokio::time::timeout(Duration::from_secs(30), backend.close())
            .await
            .expect("close gives the kept connections back and ends");
    }
}

/// `close` ends while a one-statement call is in flight on a kept connection: the call's
/// connection goes back to the closing pool, not into the kept set (sqlx's `close` waits
/// for every connection of the pool).
#[tokio::test]
async fn close_ends_with_a_renewal_in_flight_on_a_kept_connection() {
    let table = "lockkit_test_row_kept";
    let Some(url) = url(&format!("mode=row&table={table}&pool_size=4")) else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let key = key();
    let held = locker
        .try_acquire(&key)
        .ttl(Duration::from_secs(30))
        .no_watchdog()
        .await
        .unwrap()
        .expect("free");
    assert_eq!(backend.kept_connection_ids().await.unwrap().len(), 1);
    // Another connection holds the key's row lock: the renewal waits on it.
    let base = env::service_url("LOCKKIT_TEST_MYSQL_URL").unwrap();
    let mut outside = MySqlConnection::connect(&base).await.unwrap();
    sqlx::query("BEGIN").execute(&mut outside).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT name FROM `{table}` WHERE name = ? FOR UPDATE"
    )))
    .bind(key.as_str().as_bytes())
    .fetch_optional(&mut outside)
    .await
    .unwrap()
    .expect("the key's row");
    let renewal = tokio::spawn(async move {
        let _ = held.extend(Duration::from_secs(30)).await;
        held
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let closing = tokio::spawn({
        let backend = backend.clone();
        async move { backend.close().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("COMMIT").execute(&mut outside).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), closing)
        .await
        .expect("close ended while a renewal was in flight on a kept connection")
        .unwrap();
    drop(renewal.await.unwrap());
}

/// A client dropped after its runtime (or on a thread without one) closes its kept
/// connections in place: sqlx gives pooled connections back in a task, and would panic
/// without a runtime.
#[test]
fn a_client_with_kept_connections_drops_outside_a_runtime() {
    let Some(url) = url("mode=row&table=lockkit_test_row_kept&pool_size=4") else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let backend = runtime.block_on(async {
        let backend = MysqlBackend::connect(&url).await.unwrap();
        let locker = Locker::new(backend.clone());
        let held = locker.try_acquire(key()).await.unwrap().expect("free");
        held.release().await.unwrap();
        assert_eq!(backend.kept_connection_ids().await.unwrap().len(), 1);
        backend
    });
    drop(runtime);
    std::thread::spawn(move || drop(backend))
        .join()
        .expect("dropping the client outside a runtime must not panic");
}

/// A transaction is never kept waiting for a connection that sits kept between
/// one-statement calls: with every other connection of the pool busy, its `BEGIN` takes the
/// kept one back (else it would wait until the sweeper gave it back, a second or two).
#[tokio::test]
async fn a_transaction_takes_back_a_kept_connection_when_the_pool_is_full() {
    let table = "lockkit_test_row_kept";
    let Some(url) = url(&format!("mode=row&table={table}&pool_size=4")) else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let (read_key, other) = (key(), key());
    for k in [&read_key, &other] {
        locker
            .try_acquire(k)
            .await
            .unwrap()
            .expect("free")
            .release()
            .await
            .unwrap();
    }
    // Counted without using it: its last use (the release above) starts its idle second.
    let released = std::time::Instant::now();
    assert_eq!(backend.kept_connections(), 1);
    // An outside session holds the key's row: each read's transaction waits on it, on a
    // connection of its own.
    let base = env::service_url("LOCKKIT_TEST_MYSQL_URL").unwrap();
    let mut outside = MySqlConnection::connect(&base).await.unwrap();
    sqlx::query("BEGIN").execute(&mut outside).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT name FROM `{table}` WHERE name = ? FOR UPDATE"
    )))
    .bind(read_key.as_str().as_bytes())
    .fetch_optional(&mut outside)
    .await
    .unwrap()
    .expect("the key's row");
    let reads: Vec<_> = (0..4)
        .map(|_| {
            let (locker, key) = (locker.clone(), read_key.clone());
            tokio::spawn(async move {
                locker
                    .read(&key)
                    .ttl(Duration::from_secs(30))
                    .try_now()
                    .await
            })
        })
        .collect();
    // Three reads take the pool's other connections; the fourth takes the kept one back
    // at once. Without that it would wait until the kept one had idled a second.
    while backend.kept_connections() > 0 && released.elapsed() < Duration::from_millis(900) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        backend.kept_connections(),
        0,
        "the fourth read's transaction took the kept connection back"
    );
    sqlx::query("COMMIT").execute(&mut outside).await.unwrap();
    for read in reads {
        let read = read
            .await
            .unwrap()
            .expect("a read's transaction got a connection")
            .expect("readers share the key");
        read.release().await.unwrap();
    }
}

/// For-update mode keeps a released hold's dedicated connection out of sqlx's pool for the
/// next acquisition (sqlx checks every connection given back: a round trip, in a task of
/// its own). The kept connection is out of its lock transaction: another client takes the
/// key at once; the next acquisition takes it (none is kept while it holds); a busy try's
/// connection, rolled back, is kept too; `close` gives them back and ends.
#[tokio::test]
async fn a_for_update_release_keeps_its_connection_clean_for_the_next_hold() {
    let table = "lockkit_test_fu_kept";
    let (Some(url), Some(other_url)) = (
        url(&format!("mode=for-update&table={table}&max_holds=4")),
        url(&format!("mode=for-update&table={table}")),
    ) else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let key = key();
    let held = locker.try_acquire(&key).await.unwrap().expect("free");
    assert_eq!(backend.kept_dedicated_connections(), 0);
    held.release().await.unwrap();
    assert_eq!(
        backend.kept_dedicated_connections(),
        1,
        "the released hold's connection is kept"
    );
    let other_backend = MysqlBackend::connect(&other_url).await.unwrap();
    let other = Locker::new(other_backend.clone());
    let theirs = other
        .try_acquire(&key)
        .await
        .unwrap()
        .expect("another client takes the key at once");
    assert!(
        locker.try_acquire(&key).await.unwrap().is_none(),
        "the key is busy while the other client holds it"
    );
    assert_eq!(
        backend.kept_dedicated_connections(),
        1,
        "the busy try's connection, rolled back, is kept"
    );
    theirs.release().await.unwrap();
    // Well within the idle second after which the sweeper gives a kept connection back.
    let again = locker.try_acquire(&key).await.unwrap().expect("free");
    assert_eq!(
        backend.kept_dedicated_connections(),
        0,
        "the next acquisition took the kept connection"
    );
    again.release().await.unwrap();
    assert_eq!(backend.kept_dedicated_connections(), 1);
    other_backend.close().await;
    tokio::time::timeout(Duration::from_secs(30), backend.close())
        .await
        .expect("close gives the kept connection back and ends");
}

/// A dedicated connection is kept only while the pool has one to spare: with every
/// dedicated connection out and an acquisition waiting for one, a release hands its
/// connection to that acquisition (kept, it would wait until the sweeper gave it back, a
/// second or more after the release: past the 250 ms the pool waits for a connection).
#[tokio::test]
async fn a_released_dedicated_connection_goes_to_an_acquisition_waiting_for_one() {
    let Some(url) = url("mode=for-update&table=lockkit_test_fu_kept&max_holds=4") else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(locker.try_acquire(key()).await.unwrap().expect("free"));
    }
    let fifth = tokio::spawn({
        let locker = locker.clone();
        async move { locker.try_acquire(key()).await }
    });
    // The fifth waits for a dedicated connection now.
    tokio::time::sleep(Duration::from_millis(100)).await;
    held.pop().unwrap().release().await.unwrap();
    let fifth = fifth
        .await
        .unwrap()
        .expect("the released connection went to the waiting acquisition")
        .expect("free");
    fifth.release().await.unwrap();
    for h in held {
        h.release().await.unwrap();
    }
    backend.close().await;
}

/// An acquisition lent a dedicated connection only after its deadline (the pool was full)
/// takes nothing, whatever its set-up's try found: no token is spent and no record written
/// for a grant nobody waits for any more. The wait counts from the request.
#[tokio::test]
async fn an_acquisition_past_its_deadline_before_its_set_up_takes_nothing() {
    let table = "lockkit_test_fu_kept";
    let Some(url) = url(&format!("mode=for-update&table={table}&max_holds=1")) else {
        return;
    };
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let only = locker.try_acquire(key()).await.unwrap().expect("free");
    let late = key();
    let waiting = tokio::spawn({
        let (locker, late) = (locker.clone(), late.clone());
        async move { locker.acquire(&late).wait(Duration::from_millis(50)).await }
    });
    // Past the waiter's deadline, and within the 250 ms the pool waits for a connection,
    // the only dedicated connection comes free.
    tokio::time::sleep(Duration::from_millis(120)).await;
    only.release().await.unwrap();
    let outcome = waiting.await.unwrap();
    assert!(
        outcome.is_err(),
        "granted past its deadline: {:?}",
        outcome.map(|g| g.token())
    );
    let mut admin = MySqlConnection::connect(&env::service_url("LOCKKIT_TEST_MYSQL_URL").unwrap())
        .await
        .unwrap();
    let (records,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{table}` WHERE name = ? AND fence > 0"
    )))
    .bind(late.as_str().as_bytes())
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert_eq!(
        records, 0,
        "a late acquisition wrote a record (and spent a token)"
    );
    backend.close().await;
}

/// Closing a client while it holds locks ends the holds (each guard hears it) and its
/// waits, instead of waiting for their connections for as long as they are held or wait,
/// in both modes, as PostgreSQL's close does; another client then gets the keys.
#[tokio::test]
async fn closing_a_client_ends_its_holds() {
    for mode in ["for-update", "row"] {
        let Some(url) = url(&format!(
            "mode={mode}&table=lockkit_test_close_{}",
            mode.replace('-', "_")
        )) else {
            return;
        };
        let backend = MysqlBackend::connect(&url).await.unwrap();
        let locker = Locker::new(backend.clone());
        let rival = Locker::new(MysqlBackend::connect(&url).await.unwrap());
        let k = key();
        let held = locker
            .try_acquire(&k)
            .ttl(Duration::from_secs(60))
            .await
            .unwrap()
            .expect("a free key");
        let lost = held.lost();
        // Waiters of this client, for far longer than the test: behind its own hold (granted
        // when close lets that go) and behind a rival's (whose hold close does not touch).
        let rivals = rival
            .try_acquire(key())
            .ttl(Duration::from_secs(60))
            .await
            .unwrap()
            .expect("a free key");
        let waiters = [k.clone(), rivals.key().clone()].map(|k| {
            let locker = locker.clone();
            tokio::spawn(async move {
                locker
                    .acquire(&k)
                    .ttl(Duration::from_secs(60))
                    .wait(Duration::from_secs(600))
                    .await
            })
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        tokio::time::timeout(Duration::from_secs(10), backend.close())
            .await
            .unwrap_or_else(|_| panic!("{mode}: close() waited for a live hold or a waiter"));
        for waiter in waiters {
            let waited = tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .unwrap_or_else(|_| panic!("{mode}: a waiter went on waiting on a closed client"))
                .unwrap();
            assert!(
                waited.is_err(),
                "{mode}: a waiter was granted on a closed client (token {:?})",
                waited.map(|g| g.token())
            );
        }
        rivals.release().await.unwrap();
        if mode == "for-update" {
            // The hold lived on its connection, which is gone: its guard is told.
            tokio::time::timeout(Duration::from_secs(10), lost)
                .await
                .unwrap_or_else(|_| panic!("{mode}: the hold's guard was not told"));
            rival
                .acquire(&k)
                .wait(Duration::from_secs(20))
                .await
                .expect("the key is free once its holder's client closed")
                .release()
                .await
                .unwrap();
        } else {
            // A row lease lives in the table: it runs out (or is released) as before.
            drop(lost);
        }
        drop(held);
    }
}

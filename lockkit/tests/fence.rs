//! The storage-side fences against real servers: a stale token is refused, an equal one
//! accepted, a newer one raises the bar, and concurrent writers with interleaved tokens end
//! with the highest token's write, every refusal naming a newer token that was accepted.

use std::time::{SystemTime, UNIX_EPOCH};

use lockkit::{Error, FencingToken, Locker, MemoryBackend, fence};
use lockkit_conformance::env::service_url;

/// A resource name no other run uses.
fn resource(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("fence-test/{what}/{}-{nanos}", std::process::id())
}

const TOKENS: [u64; 8] = [3, 7, 1, 8, 2, 6, 4, 5];

/// Checks the outcomes of the concurrent writers of [`TOKENS`].
fn check_concurrent(outcomes: &[(u64, lockkit::Result<()>)]) {
    let accepted: Vec<u64> = outcomes
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(t, _)| *t)
        .collect();
    assert!(
        accepted.contains(&8),
        "the highest token is always accepted: {accepted:?}"
    );
    for (t, outcome) in outcomes {
        match outcome {
            Ok(()) => {}
            Err(Error::Fenced { newer, .. }) => assert!(
                newer.get() > *t && accepted.contains(&newer.get()),
                "{t} refused for {newer}, which was not accepted: {accepted:?}"
            ),
            Err(other) => panic!("{t}: {other}"),
        }
    }
}

/// The SQL fences' cases, on one database: `write(token, resource)` writes the token as the
/// resource's value through the fence, `read(resource)` reads the value back, `admit` and
/// `fail` (a write whose own statements fail) go through the same fence.
async fn check_sql_fence<W, WF, R, RF, A, AF, X, XF>(
    what: &str,
    write: W,
    read: R,
    admit: A,
    fail: X,
) where
    W: Fn(u64, String) -> WF,
    WF: std::future::Future<Output = lockkit::Result<()>> + Send + 'static,
    R: Fn(String) -> RF,
    RF: std::future::Future<Output = String>,
    A: Fn(u64, String) -> AF,
    AF: std::future::Future<Output = lockkit::Result<()>>,
    X: Fn(u64, String) -> XF,
    XF: std::future::Future<Output = lockkit::Result<()>>,
{
    let res = resource(what);
    write(5, res.clone()).await.unwrap();
    write(5, res.clone()).await.unwrap();
    let refused = write(4, res.clone()).await.unwrap_err();
    assert!(
        matches!(&refused, Error::Fenced { token, newer, .. } if token.get() == 4 && newer.get() == 5),
        "{refused}"
    );
    assert_eq!(read(res.clone()).await, "5");
    write(9, res.clone()).await.unwrap();
    assert!(matches!(
        admit(8, res.clone()).await,
        Err(Error::Fenced { .. })
    ));
    // A failing write rolls back, fence raise included.
    let failed = fail(20, res.clone()).await;
    assert!(matches!(failed, Err(Error::Backend { .. })), "{failed:?}");
    write(10, res.clone())
        .await
        .expect("the rolled-back 20 did not raise the bar");

    let res = resource(&format!("{what}-concurrent"));
    let writers: Vec<_> = TOKENS
        .into_iter()
        .map(|t| {
            let job = write(t, res.clone());
            tokio::spawn(async move { (t, job.await) })
        })
        .collect();
    let mut outcomes = Vec::new();
    for w in writers {
        outcomes.push(w.await.unwrap());
    }
    check_concurrent(&outcomes);
    assert_eq!(read(res).await, "8");
}

/// Eight concurrent file writers with interleaved tokens.
#[test]
fn file_fence_keeps_the_highest_of_concurrent_writers() {
    let dir = std::env::temp_dir().join(resource("file").replace('/', "-"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("data");
    let writers: Vec<_> = TOKENS
        .into_iter()
        .map(|t| {
            let path = path.clone();
            std::thread::spawn(move || {
                let written = fence::FileFence::new().write(
                    FencingToken::new(t),
                    &path,
                    t.to_string().as_bytes(),
                );
                (t, written)
            })
        })
        .collect();
    let outcomes: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    check_concurrent(&outcomes);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "8");
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn redis_fence_refuses_stale_writes() {
    let Some(url) = service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let fence = fence::RedisFence::connect(&url).await.unwrap();
    let (res, key) = (resource("redis"), resource("redis-data"));
    let t = FencingToken::new;
    fence.set(t(5), &res, &key, "five").await.unwrap();
    fence.set(t(5), &res, &key, "five again").await.unwrap();
    let refused = fence.set(t(4), &res, &key, "four").await.unwrap_err();
    assert!(
        matches!(&refused, Error::Fenced { token, newer, .. } if token.get() == 4 && newer.get() == 5),
        "{refused}"
    );
    assert!(refused.to_string().contains("lost its lock"), "{refused}");
    let value = fence
        .eval(
            t(5),
            &res,
            "return redis.call('GET', KEYS[2])",
            &[&key],
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        redis::from_redis_value::<String>(value).unwrap(),
        "five again"
    );
    // Tokens beyond 2^53 compare exactly (Lua numbers would not).
    let big = (1u64 << 60) + 1;
    fence.admit(t(big), &res).await.unwrap();
    assert!(matches!(
        fence.admit(t(big - 1), &res).await,
        Err(Error::Fenced { .. })
    ));
    fence.del(t(big), &res, &key).await.unwrap();

    // helper-43's nit: a fence that is not a token refuses, saying so (it read as a newer
    // holder's token u64::MAX before).
    let corrupt = resource("redis-corrupt");
    let mut raw = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(fence.fence_key(&corrupt))
        .arg("garbage")
        .query_async(&mut raw)
        .await
        .unwrap();
    let refused = fence.admit(t(5), &corrupt).await.unwrap_err();
    assert!(
        matches!(&refused, Error::Backend { .. }) && refused.to_string().contains("not a token"),
        "{refused}"
    );

    // A guard works as the token.
    let locker = Locker::new(MemoryBackend::new());
    let guard = locker.acquire("k").await.unwrap();
    let fresh = resource("redis-guard");
    fence
        .hset(&guard, &fresh, &key, "field", "v")
        .await
        .unwrap();
    guard.release().await.unwrap();
}

#[tokio::test]
async fn redis_fence_keeps_the_highest_of_concurrent_writers() {
    let Some(url) = service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let fence = fence::RedisFence::connect(&url).await.unwrap();
    let (res, key) = (
        resource("redis-concurrent"),
        resource("redis-concurrent-data"),
    );
    let writers: Vec<_> = TOKENS
        .into_iter()
        .map(|t| {
            let (fence, res, key) = (fence.clone(), res.clone(), key.clone());
            tokio::spawn(async move {
                let outcome = fence
                    .set(FencingToken::new(t), &res, &key, &t.to_string())
                    .await;
                (t, outcome)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for w in writers {
        outcomes.push(w.await.unwrap());
    }
    check_concurrent(&outcomes);
    let value = fence
        .eval(
            FencingToken::new(8),
            &res,
            "return redis.call('GET', KEYS[2])",
            &[&key],
            &[],
        )
        .await
        .unwrap();
    assert_eq!(redis::from_redis_value::<String>(value).unwrap(), "8");
}

#[tokio::test]
async fn mysql_fence_refuses_stale_writes_and_keeps_the_highest() {
    let Some(url) = service_url("LOCKKIT_TEST_MYSQL_URL") else {
        return;
    };
    let fence = fence::MysqlFence::connect(&url).await.unwrap();
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS lockkit_fence_test (resource VARBINARY(512) PRIMARY KEY, \
         value VARCHAR(64) NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let write = |token: u64, res: String| {
        let fence = fence.clone();
        async move {
            let value = token.to_string();
            let res2 = res.clone();
            fence
                .write(FencingToken::new(token), &res, move |tx| {
                    Box::pin(async move {
                        sqlx::query(
                            "REPLACE INTO lockkit_fence_test (resource, value) VALUES (?, ?)",
                        )
                        .bind(res2.as_bytes())
                        .bind(value)
                        .execute(&mut *tx)
                        .await?;
                        Ok(())
                    })
                })
                .await
        }
    };
    let read = |res: String| {
        let pool = pool.clone();
        async move {
            let (value,): (String,) =
                sqlx::query_as("SELECT value FROM lockkit_fence_test WHERE resource = ?")
                    .bind(res.as_bytes())
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            value
        }
    };

    let admit = |token: u64, res: String| {
        let fence = fence.clone();
        async move { fence.admit(FencingToken::new(token), &res).await }
    };
    let fail = |token: u64, res: String| {
        let fence = fence.clone();
        async move {
            fence
                .write(FencingToken::new(token), &res, |_| {
                    Box::pin(async { Err::<(), _>("the caller's write failed".into()) })
                })
                .await
        }
    };
    check_sql_fence("mysql", write, read, admit, fail).await;
}

/// `?create_schema=false` never creates the fence table: a missing one is a
/// configuration error that names the DDL to run.
#[tokio::test]
async fn mysql_fence_without_create_schema_only_checks_the_table() {
    let Some(url) = service_url("LOCKKIT_TEST_MYSQL_URL") else {
        return;
    };
    fence::MysqlFence::connect(&url).await.unwrap();
    let separator = if url.contains('?') { '&' } else { '?' };
    let checked = fence::MysqlFence::connect(&format!("{url}{separator}create_schema=false"))
        .await
        .expect("the table exists now, so create_schema=false connects");
    let missing = format!("lockkit_fence_missing_{}", std::process::id());
    let refused = checked
        .clone()
        .with_table(&missing)
        .unwrap()
        .check_table()
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::Config(m) if m.contains(&missing) && m.contains("CREATE TABLE")),
        "{refused}"
    );
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    let (exists,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() \
         AND table_name = ?",
    )
    .bind(&missing)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(exists, 0, "checking must not create the table");
}

#[tokio::test]
async fn postgres_fence_refuses_stale_writes_and_keeps_the_highest() {
    let Some(url) = service_url("LOCKKIT_TEST_POSTGRES_URL") else {
        return;
    };
    let fence = fence::PostgresFence::connect(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS lockkit_fence_test (resource BYTEA PRIMARY KEY, \
         value TEXT NOT NULL)",
    )
    .execute(&pool)
    .await
    .ok();
    let write = |token: u64, res: String| {
        let fence = fence.clone();
        async move {
            let value = token.to_string();
            let res2 = res.clone();
            fence
                .write(FencingToken::new(token), &res, move |tx| {
                    Box::pin(async move {
                        sqlx::query(
                            "INSERT INTO lockkit_fence_test (resource, value) VALUES ($1, $2) \
                             ON CONFLICT (resource) DO UPDATE SET value = EXCLUDED.value",
                        )
                        .bind(res2.as_bytes())
                        .bind(value)
                        .execute(&mut *tx)
                        .await?;
                        Ok(())
                    })
                })
                .await
        }
    };
    let read = |res: String| {
        let pool = pool.clone();
        async move {
            let (value,): (String,) =
                sqlx::query_as("SELECT value FROM lockkit_fence_test WHERE resource = $1")
                    .bind(res.as_bytes())
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            value
        }
    };

    let admit = |token: u64, res: String| {
        let fence = fence.clone();
        async move { fence.admit(FencingToken::new(token), &res).await }
    };
    let fail = |token: u64, res: String| {
        let fence = fence.clone();
        async move {
            fence
                .write(FencingToken::new(token), &res, |_| {
                    Box::pin(async { Err::<(), _>("the caller's write failed".into()) })
                })
                .await
        }
    };
    check_sql_fence("postgres", write, read, admit, fail).await;
    // A token the BIGINT column cannot hold is refused before anything is written.
    assert!(matches!(
        fence
            .admit(FencingToken::new(u64::MAX), &resource("postgres"))
            .await,
        Err(Error::Config(_))
    ));
}

/// `?create_schema=false` never creates the PostgreSQL fence table either.
#[tokio::test]
async fn postgres_fence_without_create_schema_only_checks_the_table() {
    let Some(url) = service_url("LOCKKIT_TEST_POSTGRES_URL") else {
        return;
    };
    fence::PostgresFence::connect(&url).await.unwrap();
    let checked = fence::PostgresFence::connect(&format!("{url}?create_schema=false"))
        .await
        .expect("the table exists now, so create_schema=false connects");
    let missing = format!("lockkit_fence_missing_{}", std::process::id());
    let refused = checked
        .with_table(&missing)
        .unwrap()
        .check_table()
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::Config(m) if m.contains(&missing) && m.contains("CREATE TABLE")),
        "{refused}"
    );
}

/// Clients that create the fence table at once on a fresh database all succeed: the
/// catalog's collisions (`duplicate_table`, a `pg_type` unique violation) mean it exists.
/// Found by a CI run in which two tests created `lockkit_fences` at the same moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_fence_tables_created_at_once_all_succeed() {
    let Some(url) = service_url("LOCKKIT_TEST_POSTGRES_URL") else {
        return;
    };
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    for round in 0..10 {
        let table = format!("lockkit_fence_race_{}_{round}", std::process::id());
        let creations = (0..8).map(|_| {
            let (pool, table) = (pool.clone(), table.clone());
            tokio::spawn(async move {
                fence::PostgresFence::new(pool)
                    .with_table(&table)
                    .unwrap()
                    .create_table()
                    .await
            })
        });
        let creations: Vec<_> = creations.collect();
        for created in creations {
            created
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&pool)
            .await
            .unwrap();
    }
}

/// helper-43, finding 4: on a PostgreSQL whose transactions default to REPEATABLE READ or
/// SERIALIZABLE (`default_transaction_isolation`, set per database or role), a fenced writer
/// that waited on another's row lock failed with a serialization error (40001) the moment
/// the other committed, instead of reading the raised token and being admitted or refused:
/// concurrent writers of one resource got errors that a retry alone would fix.
#[tokio::test]
async fn postgres_fence_writers_wait_for_each_other_under_repeatable_read() {
    let Some(url) = service_url("LOCKKIT_TEST_POSTGRES_URL") else {
        return;
    };
    fence::PostgresFence::connect(&url).await.unwrap();
    for level in ["repeatable read", "serializable"] {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "SET default_transaction_isolation = '{level}'"
                    )))
                    .execute(conn)
                    .await?;
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .unwrap();
        let fence = fence::PostgresFence::new(pool);
        let res = resource("postgres-repeatable-read");
        // Each writer holds the row a little, so that the others queue behind it.
        let writers: Vec<_> = TOKENS
            .into_iter()
            .map(|t| {
                let (fence, res) = (fence.clone(), res.clone());
                tokio::spawn(async move {
                    let outcome = fence
                        .write(FencingToken::new(t), &res, |tx| {
                            Box::pin(async move {
                                sqlx::query("SELECT pg_sleep(0.05)")
                                    .execute(&mut *tx)
                                    .await?;
                                Ok(())
                            })
                        })
                        .await;
                    (t, outcome)
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for w in writers {
            outcomes.push(w.await.unwrap());
        }
        for (t, outcome) in &outcomes {
            if let Err(e) = outcome
                && !matches!(e, Error::Fenced { .. })
            {
                panic!("{level}: token {t}: {e}");
            }
        }
        check_concurrent(&outcomes);
    }
}

//! The command connection driven by its callers' tasks (`direct.rs`): every reply reaches
//! the request it answers, however many requests share the connection and however many of
//! them are dropped mid-way; a request cut short keeps its place in the stream (a later one
//! never overtakes it); a connection the server closed is replaced.

use std::{net::SocketAddr, time::Duration};

use lockkit_conformance::{FaultProxy, env};
use lockkit_redis::DirectConn;
use uuid::Uuid;

/// Far beyond anything below: only a request that is never answered trips it.
const NEVER: Duration = Duration::from_secs(30);

/// `fut`'s output, unless `budget` runs out first; a zero budget gives it one poll.
async fn within<F: std::future::Future>(budget: Duration, fut: F) -> Result<F::Output, ()> {
    if budget.is_zero() {
        let mut fut = std::pin::pin!(fut);
        return match futures_util::poll!(fut.as_mut()) {
            std::task::Poll::Ready(out) => Ok(out),
            std::task::Poll::Pending => Err(()),
        };
    }
    tokio::time::timeout(budget, fut).await.map_err(|_| ())
}

async fn direct(url: &str, response_timeout: Duration) -> DirectConn {
    let client = redis::Client::open(url).unwrap();
    DirectConn::connect(&client, Duration::from_secs(2), response_timeout)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_reach_their_requests_while_others_are_dropped() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let conn = direct(&url, Duration::from_secs(10)).await;
    let mut tasks = Vec::new();
    for task in 0..16u64 {
        let mut conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let (mut answered, mut dropped) = (0u32, 0u32);
            for i in 0..300u64 {
                let payload = format!("{task}-{i}");
                // Every third request is dropped after a poll or two (or a few
                // milliseconds), most of them with their reply still to come.
                let budget = if (task + i) % 3 == 0 {
                    Duration::from_micros(i % 4 * 500)
                } else {
                    NEVER
                };
                if i % 7 == 0 {
                    let mut pipe = redis::pipe();
                    pipe.cmd("ECHO").arg(&payload).cmd("ECHO").arg("second");
                    match within(budget, pipe.query_async(&mut conn)).await {
                        Ok(reply) => {
                            let (first, second): (String, String) = reply.unwrap();
                            assert_eq!(
                                (first.as_str(), second.as_str()),
                                (payload.as_str(), "second")
                            );
                            answered += 1;
                        }
                        Err(_) => dropped += 1,
                    }
                    continue;
                }
                let mut cmd = redis::cmd("ECHO");
                cmd.arg(&payload);
                let echo = cmd.query_async::<String>(&mut conn);
                match within(budget, echo).await {
                    Ok(reply) => {
                        assert_eq!(reply.unwrap(), payload, "a reply reached another request");
                        answered += 1;
                    }
                    Err(_) => dropped += 1,
                }
            }
            (answered, dropped)
        }));
    }
    let (mut answered, mut dropped) = (0, 0);
    for task in tasks {
        let (a, d) = tokio::time::timeout(NEVER, task)
            .await
            .expect("a request was never answered")
            .unwrap();
        answered += a;
        dropped += d;
    }
    eprintln!("{answered} answered, {dropped} dropped");
    assert!(
        answered > 0 && dropped > 0,
        "{answered} answered, {dropped} dropped"
    );
    // The connection still answers, in order, after all that.
    let mut conn = conn;
    let last: String =
        tokio::time::timeout(NEVER, redis::cmd("ECHO").arg("last").query_async(&mut conn))
            .await
            .expect("the connection stopped answering")
            .unwrap();
    assert_eq!(last, "last");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_timed_out_keeps_its_place_in_the_stream() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let upstream: SocketAddr = url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let mut conn = direct(
        &format!("redis://{}", proxy.local_addr()),
        Duration::from_millis(200),
    )
    .await;
    let key = format!("direct/order/{}", Uuid::new_v4().simple());
    proxy.cut();
    // Sent into the stalled link; its caller gives up (the response timeout).
    let first: redis::RedisResult<()> = redis::cmd("SET")
        .arg(&key)
        .arg("first")
        .query_async(&mut conn)
        .await;
    assert!(first.unwrap_err().is_timeout());
    // A later command on the same connection, also stalled until the link heals.
    let mut later_conn = conn.clone();
    let later_key = key.clone();
    let later = tokio::spawn(async move {
        redis::cmd("SET")
            .arg(&later_key)
            .arg("later")
            .query_async::<()>(&mut later_conn)
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        proxy.open_connections(),
        1,
        "a timed-out request must not move its successors to a new stream"
    );
    proxy.heal();
    let _ = later.await.unwrap();
    let mut plain = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stored: String = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut plain)
        .await
        .unwrap();
    assert_eq!(
        stored, "later",
        "the later command ran before the one sent first"
    );
    let () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut plain)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_server_closed_is_replaced() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let mut conn = direct(&url, Duration::from_secs(10)).await;
    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut plain = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query_async(&mut plain)
        .await
        .unwrap();
    assert_eq!(killed, 1);
    // Until the close is seen, a request may fail once (retryable); then a new line serves.
    let mut answered = None;
    for _ in 0..50 {
        match redis::cmd("CLIENT")
            .arg("ID")
            .query_async::<i64>(&mut conn)
            .await
        {
            Ok(new_id) => {
                answered = Some(new_id);
                break;
            }
            Err(e) => {
                assert!(e.is_io_error() || e.is_connection_dropped(), "{e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let new_id = answered.expect("the connection was never replaced");
    assert_ne!(new_id, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_request_leaves_the_socket_watched() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let upstream: SocketAddr = url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let conn = direct(
        &format!("redis://{}", proxy.local_addr()),
        Duration::from_secs(20),
    )
    .await;
    proxy.set_delay(Duration::from_millis(300));
    // The first request waits in a task of its own...
    let mut first_conn = conn.clone();
    let first = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let reply: String = redis::cmd("ECHO")
            .arg("first")
            .query_async(&mut first_conn)
            .await
            .unwrap();
        (reply, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // ...while a second one, polled last (so the socket's readiness would wake it), is
    // dropped by a task that then goes on with other things.
    let mut second_conn = conn.clone();
    tokio::spawn(async move {
        let mut cmd = redis::cmd("ECHO");
        cmd.arg("second");
        let second = cmd.query_async::<String>(&mut second_conn);
        let _ = tokio::time::timeout(Duration::from_millis(50), second).await;
        tokio::time::sleep(NEVER).await;
    });
    let (reply, took) = tokio::time::timeout(NEVER, first).await.unwrap().unwrap();
    assert_eq!(reply, "first");
    // Its reply comes after about 600 ms (the delay each way); a request nobody wakes
    // would wait for its 20 s response timeout.
    assert!(
        took < Duration::from_secs(10),
        "the first request was left unwatched for {took:?}"
    );
}

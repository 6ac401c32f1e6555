//! A release whose deletion of the lock key is sent again after a try failed on the way
//! (helper-60): a later try that finds the key gone is no loss only when the earlier try
//! took it, not when the hold was lost before the release (its lease revoked, its key
//! deleted or re-created by someone else) while the holder had not heard of it yet.
//!
//! The holder reaches the member through a proxy that can hold back the member's replies
//! (requests still pass): the first try of the deletion reaches the member, its answer
//! does not come back within a try's time (half the request limit), and the retry's
//! answer is let through.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lockkit_conformance::env;
use lockkit_core::{Error, LockKey, Locker, spi::Released};
use lockkit_etcd::EtcdBackend;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
    time::Instant,
};

/// The holder's options: a 2 s request limit, so one try may stay unanswered 1 s.
const OPTIONS: &str = "session_ttl=6s&connect_timeout=2s";
/// Past one try's time: the first try of the deletion has been given up and sent again.
const PAST_ONE_TRY: Duration = Duration::from_millis(1500);

/// A TCP proxy to one upstream that passes every request and can hold the replies back
/// (kept, not dropped: they pass in order once let through).
struct ReplyHolder {
    local: SocketAddr,
    held: watch::Sender<bool>,
    /// Reads from clients (a request, or a batch of frames).
    requests: Arc<AtomicU64>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl ReplyHolder {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let local = listener.local_addr().unwrap();
        let (held, _) = watch::channel(false);
        let requests = Arc::new(AtomicU64::new(0));
        let acceptor = tokio::spawn({
            let (held, requests) = (held.clone(), requests.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let requests = requests.clone();
                    tokio::spawn(pump(client_read, server_write, None, Some(requests)));
                    tokio::spawn(pump(
                        server_read,
                        client_write,
                        Some(held.subscribe()),
                        None,
                    ));
                }
            }
        });
        ReplyHolder {
            local,
            held,
            requests,
            acceptor,
        }
    }

    fn url(&self) -> String {
        format!("etcd://{}?{OPTIONS}", self.local)
    }

    /// Holds every reply back from now on (also on connections opened later).
    fn hold_replies(&self) {
        self.held.send_replace(true);
    }

    /// Lets the replies held back, and those after them, through.
    fn let_replies_through(&self) {
        self.held.send_replace(false);
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for ReplyHolder {
    fn drop(&mut self) {
        self.let_replies_through();
        self.acceptor.abort();
    }
}

/// Copies `from` to `to`; while `held` says so, keeps what it read until it no longer does.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut held: Option<watch::Receiver<bool>>,
    reads: Option<Arc<AtomicU64>>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(reads) = &reads {
            reads.fetch_add(1, Ordering::SeqCst);
        }
        if let Some(held) = &mut held
            && held.wait_for(|held| !*held).await.is_err()
        {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

fn unique() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

struct Setup {
    proxy: ReplyHolder,
    holder: Locker,
    admin: etcd_client::Client,
    range: String,
    key: LockKey,
}

/// A holder through a fresh [`ReplyHolder`], an admin client straight to the member, and a
/// key named after `name`.
async fn setup(name: &str) -> Option<Setup> {
    let url = env::service_url("LOCKKIT_TEST_ETCD_URL")?;
    let upstream = env::host_ports(&url)[0].parse().unwrap();
    let proxy = ReplyHolder::start(upstream).await;
    let backend = EtcdBackend::connect(&proxy.url()).await.unwrap();
    let key = LockKey::new(format!("{name}-{}", unique())).unwrap();
    let range = backend.lock_range(&key);
    let admin = EtcdBackend::connect(&format!("{url}?{OPTIONS}"))
        .await
        .unwrap()
        .client();
    Some(Setup {
        proxy,
        holder: Locker::new(backend),
        admin,
        range,
        key,
    })
}

/// The one contender key of `range`: its name, lease and create revision.
async fn the_key(admin: &mut etcd_client::Client, range: &str) -> Option<(String, i64, i64)> {
    let got = admin
        .get(range, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert!(got.kvs().len() <= 1, "{:?}", got.kvs());
    got.kvs().first().map(|kv| {
        (
            String::from_utf8(kv.key().to_vec()).unwrap(),
            kv.lease(),
            kv.create_revision(),
        )
    })
}

/// Releases `guard` with the replies held back from before the release until past one
/// try's time (`tamper` runs with the replies held, before the release is sent), then
/// lets them through; returns the release's outcome, and how many reads the proxy saw from
/// the holder while the replies were held.
async fn release_with_first_answer_lost(
    setup: &mut Setup,
    guard: lockkit_core::LockGuard,
    tamper: impl AsyncFnOnce(&mut etcd_client::Client, &str),
) -> (lockkit_core::Result<Released>, u64) {
    setup.proxy.hold_replies();
    tamper(&mut setup.admin, &setup.range).await;
    let before = setup.proxy.requests();
    let started = Instant::now();
    let release = tokio::spawn(guard.release());
    tokio::time::sleep_until(started + PAST_ONE_TRY).await;
    let sent = setup.proxy.requests() - before;
    setup.proxy.let_replies_through();
    let outcome = tokio::time::timeout(Duration::from_secs(10), release)
        .await
        .expect("the release did not end")
        .unwrap();
    assert!(
        started.elapsed() >= PAST_ONE_TRY,
        "the release ended before its first try's answer could come back"
    );
    (outcome, sent)
}

/// `setup`'s key held with a lease that outlives the test.
async fn hold(setup: &Setup) -> lockkit_core::LockGuard {
    setup
        .holder
        .acquire(&setup.key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap()
}

/// The honest case: the first try deleted the key, its answer was lost, the retry finds the
/// key gone. The hold lasted until then: released fully.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_first_answer_was_lost_is_still_full() {
    let Some(mut setup) = setup("release-retry-honest").await else {
        return;
    };
    let guard = hold(&setup).await;
    let (name, _, _) = the_key(&mut setup.admin, &setup.range).await.unwrap();
    let (outcome, sent) = release_with_first_answer_lost(&mut setup, guard, async |_, _| {}).await;
    assert!(sent >= 2, "{sent} reads from the holder: no retry");
    assert!(
        matches!(outcome, Ok(Released::Fully)),
        "{outcome:?} for a hold that lasted until its release deleted `{name}`"
    );
    assert!(the_key(&mut setup.admin, &setup.range).await.is_none());
}

/// The hold's lease revoked (its key with it) just before the release, the holder not told
/// yet (the member's replies held back): the retried deletion finds the key gone, and the
/// release must say the hold was lost, not that it released it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_release_of_a_hold_whose_lease_was_revoked_reports_the_loss() {
    let Some(mut setup) = setup("release-retry-revoked").await else {
        return;
    };
    let guard = hold(&setup).await;
    let (outcome, sent) =
        release_with_first_answer_lost(&mut setup, guard, async |admin, range| {
            let (_, lease, _) = the_key(admin, range).await.unwrap();
            admin.lease_revoke(lease).await.unwrap();
            assert!(the_key(admin, range).await.is_none());
        })
        .await;
    assert!(sent >= 2, "{sent} reads from the holder: no retry");
    assert!(
        matches!(outcome, Err(Error::NotHeld { .. } | Error::Lost { .. })),
        "{outcome:?} for a hold whose lease was revoked before its release"
    );
}

/// The hold's key deleted and created again under the same name (and lease) by someone
/// else just before the release: the retried deletion finds a key of another create
/// revision, and the release must say the hold was lost (and leave that key alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_release_of_a_hold_whose_key_was_recreated_reports_the_loss() {
    let Some(mut setup) = setup("release-retry-recreated").await else {
        return;
    };
    let guard = hold(&setup).await;
    let (outcome, sent) =
        release_with_first_answer_lost(&mut setup, guard, async |admin, range| {
            let (name, lease, revision) = the_key(admin, range).await.unwrap();
            admin.delete(name.as_str(), None).await.unwrap();
            let put = etcd_client::PutOptions::new().with_lease(lease);
            admin
                .put(name.as_str(), "another", Some(put))
                .await
                .unwrap();
            let (_, _, now) = the_key(admin, range).await.unwrap();
            assert_ne!(now, revision);
        })
        .await;
    assert!(sent >= 2, "{sent} reads from the holder: no retry");
    assert!(
        matches!(outcome, Err(Error::NotHeld { .. } | Error::Lost { .. })),
        "{outcome:?} for a hold whose key was re-created by another before its release"
    );
    let _ = setup
        .admin
        .delete(
            setup.range.as_str(),
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await;
}

/// An owner's write let go while its downgraded read relies on the write key (the key is
/// kept and marked): the write key's lease revoked just before, the holder not told yet,
/// the retried mark finds the key gone, and letting the write go must say it was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_mark_of_a_kept_write_key_whose_lease_was_revoked_reports_the_loss() {
    let Some(mut setup) = setup("release-retry-downgrade").await else {
        return;
    };
    let owner = setup.holder.owner();
    let write = owner
        .write(&setup.key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap();
    let read = owner
        .read(&setup.key)
        .ttl(Duration::from_secs(600))
        .await
        .unwrap();
    let (outcome, sent) =
        release_with_first_answer_lost(&mut setup, write, async |admin, range| {
            let got = admin
                .get(
                    format!("{range}write/"),
                    Some(etcd_client::GetOptions::new().with_prefix()),
                )
                .await
                .unwrap();
            let lease = got.kvs()[0].lease();
            admin.lease_revoke(lease).await.unwrap();
        })
        .await;
    assert!(sent >= 2, "{sent} reads from the holder: no retry");
    assert!(
        matches!(outcome, Err(Error::NotHeld { .. } | Error::Lost { .. })),
        "{outcome:?} for a write whose key's lease was revoked before it was let go"
    );
    let _ = read.release().await;
}

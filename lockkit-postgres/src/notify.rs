//! Release announcements: one `LISTEN` connection per client, shared by all its waiters.
//!
//! A release commits `pg_notify(<channel>, 'r:<key>')` in its own transaction; the
//! listener wakes that key's waiters the moment it arrives. A listener that lost its
//! connection cannot know what it missed, so it wakes every waiter when it is back. A
//! connection that dies without a word (a paused server, a cut link) is found by a
//! heartbeat: while anyone waits, the client announces `h` every [`HEARTBEAT`] and a
//! listener that heard nothing for [`STALE_AFTER`] is replaced; until then waiters poll.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use async_trait::async_trait;
use lockkit_core::spi::{Armed, Backoff, Wake, armed, never};
use sqlx::{
    PgPool,
    postgres::{PgConnectOptions, PgListener, PgPoolOptions},
};
use tokio::{
    sync::{Notify, mpsc, watch},
    task::JoinHandle,
    time::Instant,
};

/// How often a client with waiters announces a heartbeat.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// A listener that heard nothing (no release, no heartbeat) this long is replaced.
const STALE_AFTER: Duration = Duration::from_secs(3);

/// The payload of a release of `key`.
pub(crate) fn release_payload(key: &str) -> String {
    format!("r:{key}")
}

const HEARTBEAT_PAYLOAD: &str = "h";

/// Waiters by key, and whether the listener is connected and listening.
struct Shared {
    keys: Mutex<HashMap<String, (Arc<Notify>, usize)>>,
    listening: watch::Sender<bool>,
}

impl Shared {
    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Arc<Notify>, usize)>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake(&self, key: &str) {
        if let Some((notify, _)) = self.keys().get(key) {
            notify.notify_waiters();
        }
    }

    fn wake_all(&self) {
        for (notify, _) in self.keys().values() {
            notify.notify_waiters();
        }
    }

    fn set_listening(&self, listening: bool) {
        if self.listening.send_replace(listening) != listening {
            // Either way the waiters must look again: they may have missed a release, or
            // may now sleep until one is announced.
            self.wake_all();
        }
    }
}

/// One client's release listener (started by its first waiter).
pub(crate) struct Releases {
    channel: String,
    connect: PgConnectOptions,
    connect_timeout: Duration,
    pool: PgPool,
    shared: Arc<Shared>,
    task: OnceLock<JoinHandle<()>>,
}

impl Drop for Releases {
    fn drop(&mut self) {
        if let Some(task) = self.task.get() {
            task.abort();
        }
    }
}

impl Releases {
    pub(crate) fn new(
        channel: String,
        connect: PgConnectOptions,
        connect_timeout: Duration,
        pool: PgPool,
    ) -> Arc<Self> {
        Arc::new(Releases {
            channel,
            connect,
            connect_timeout,
            pool,
            shared: Arc::new(Shared {
                keys: Mutex::default(),
                listening: watch::channel(false).0,
            }),
            task: OnceLock::new(),
        })
    }

    /// A waiter's wake-ups for `key`.
    pub(crate) fn waiter(self: &Arc<Self>, key: &str) -> ReleaseNotes {
        ReleaseNotes {
            releases: self.clone(),
            key: key.to_owned(),
            notify: None,
        }
    }

    fn subscribe(&self, key: &str) -> Arc<Notify> {
        let notify = {
            let mut keys = self.shared.keys();
            let entry = keys.entry(key.to_owned()).or_default();
            entry.1 += 1;
            entry.0.clone()
        };
        self.task.get_or_init(|| {
            tokio::spawn(listen(
                self.shared.clone(),
                self.channel.clone(),
                self.connect.clone(),
                self.pool.clone(),
            ))
        });
        notify
    }

    fn unsubscribe(&self, key: &str) {
        let mut keys = self.shared.keys();
        if let Some(entry) = keys.get_mut(key) {
            entry.1 -= 1;
            if entry.1 == 0 {
                keys.remove(key);
            }
        }
    }

    /// Waiters registered now (for tests).
    #[cfg(feature = "testing")]
    pub(crate) fn waiting_keys(&self) -> usize {
        self.shared.keys().len()
    }
}

/// The listener: connects, listens, wakes waiters; replaced when it goes quiet.
async fn listen(shared: Arc<Shared>, channel: String, connect: PgConnectOptions, pool: PgPool) {
    let reconnect = || Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut pause = reconnect();
    loop {
        match listen_once(&shared, &channel, &connect, &pool).await {
            Ok(()) => pause = reconnect(),
            Err(error) => {
                tracing::debug!(%error, "release listener failed; waiters poll meanwhile");
            }
        }
        shared.set_listening(false);
        tokio::time::sleep(pause.next_delay()).await;
    }
}

/// One listener connection, until it is lost or goes quiet. `Ok`: it had worked.
async fn listen_once(
    shared: &Shared,
    channel: &str,
    connect: &PgConnectOptions,
    pool: &PgPool,
) -> Result<(), sqlx::Error> {
    let own = PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_with(connect.clone())
        .await?;
    let mut listener = PgListener::connect_with(&own).await?;
    listener.eager_reconnect(false);
    listener.listen(channel).await?;
    // The receiver runs on its own, so a quiet connection can be dropped without
    // cancelling a read half-way.
    let (heard, mut hearing) = mpsc::channel::<Option<String>>(64);
    let receiver = AbortOnDrop(tokio::spawn(async move {
        loop {
            let message = match listener.try_recv().await {
                Ok(Some(note)) => Some(note.payload().to_owned()),
                Ok(None) | Err(_) => None,
            };
            let lost = message.is_none();
            if heard.send(message).await.is_err() || lost {
                return;
            }
        }
    }));
    // Wakes every waiter: whatever was released before the LISTEN took effect was not
    // heard.
    shared.set_listening(true);
    let mut last_heard = Instant::now();
    let mut beat = tokio::time::interval(HEARTBEAT);
    loop {
        tokio::select! {
            message = hearing.recv() => {
                let Some(Some(payload)) = message else { break };
                last_heard = Instant::now();
                if let Some(key) = payload.strip_prefix("r:") {
                    shared.wake(key);
                }
            }
            _ = beat.tick() => {
                if shared.keys().is_empty() {
                    // Nobody waits: nothing to keep alive, and nothing goes stale.
                    last_heard = Instant::now();
                    continue;
                }
                if last_heard.elapsed() > STALE_AFTER {
                    tracing::debug!("release listener heard nothing, not even its heartbeat; replacing it");
                    break;
                }
                let pool = pool.clone();
                let channel = channel.to_owned();
                tokio::spawn(async move {
                    let _ = sqlx::query("SELECT pg_notify($1, $2)")
                        .bind(channel)
                        .bind(HEARTBEAT_PAYLOAD)
                        .execute(&pool)
                        .await;
                });
            }
        }
    }
    // Dropping the receiver drops the listener and its connection.
    drop(receiver);
    Ok(())
}

/// Aborts its task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A waiter's wake-ups: release announcements for its key, once the listener listens.
pub(crate) struct ReleaseNotes {
    releases: Arc<Releases>,
    key: String,
    notify: Option<Arc<Notify>>,
}

impl Drop for ReleaseNotes {
    fn drop(&mut self) {
        if self.notify.take().is_some() {
            self.releases.unsubscribe(&self.key);
        }
    }
}

#[async_trait]
impl Wake for ReleaseNotes {
    async fn ready(&mut self) -> bool {
        if self.notify.is_none() {
            self.notify = Some(self.releases.subscribe(&self.key));
            let mut listening = self.releases.shared.listening.subscribe();
            let bound = self.releases.connect_timeout;
            return tokio::time::timeout(bound, listening.wait_for(|on| *on))
                .await
                .is_ok_and(|waited| waited.is_ok());
        }
        *self.releases.shared.listening.borrow()
    }

    fn arm(&self) -> Armed<'_> {
        match &self.notify {
            Some(notify) => armed(notify),
            None => never(),
        }
    }
}

//! Release announcements: one `LISTEN` connection per client, shared by all its waiters.
//!
//! A release commits `pg_notify(<channel>, 'r:<key in hex>')` in its own transaction; the
//! listener wakes that key's waiters the moment it arrives. A listener that lost its
//! connection cannot know what it missed, so it wakes every waiter when it is back. A
//! connection that dies without a word (a paused server, a cut link) is found by a
//! heartbeat: while anyone waits, the listener announces `h` on its own connection (a
//! session hears its own announcements) every [`HEARTBEAT`], and at once when the first
//! waiter comes; a listener that heard nothing for [`STALE_AFTER`] after a heartbeat was
//! asked for is replaced. Waiters rely on announcements
//! only while the listener has heard something recently; otherwise they poll.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use lockkit_core::spi::{Armed, Backoff, Wake, armed, never};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::{
    sync::{Notify, mpsc},
    task::JoinHandle,
    time::Instant,
};

/// How often a client with waiters announces a heartbeat.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// A listener that heard nothing this long after a heartbeat went out is replaced; one
/// that heard nothing for this long is not relied on.
const STALE_AFTER: Duration = Duration::from_secs(3);

// Built in `db`, which writes the advisory release script's announcement too.
pub(crate) use crate::db::{key_hex as hex, release_payload};

const HEARTBEAT_PAYLOAD: &str = "h";

/// The `application_name` of every listener connection.
pub const LISTENER_APPLICATION_NAME: &str = "lockkit release listener";

/// Waiters by key (hex), and what the listener last heard.
struct Shared {
    keys: Mutex<HashMap<String, (Arc<Notify>, usize)>>,
    state: Mutex<ListenerState>,
    /// Asks the listener for a heartbeat now (a first waiter came).
    poke: Notify,
    /// Told whenever the listener hears something, and when it failed to connect (a
    /// waiter waiting for its first connection then stops waiting).
    heard: Notify,
}

#[derive(Default)]
struct ListenerState {
    /// The listener is connected and listening.
    listening: bool,
    /// When it last heard anything (a release, a heartbeat).
    heard_at: Option<Instant>,
    /// It has listened at some point (so being down now means it is reconnecting).
    ever_listened: bool,
    /// It tried to connect and failed at some point: while down, it is not waited for.
    ever_failed: bool,
}

impl ListenerState {
    /// Whether a new waiter should wait for the listener to be heard before it relies on
    /// polling: while it is connected but unchecked, or connecting for the first time with
    /// no failure yet (so that a healthy client's first waiter misses no release). A
    /// listener that is down after it listened or failed to connect is not waited for: it
    /// reconnects in the background, and waiters poll meanwhile.
    fn worth_waiting_for(&self) -> bool {
        self.listening || !(self.ever_listened || self.ever_failed)
    }
}

impl Shared {
    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Arc<Notify>, usize)>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ListenerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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

    fn heard(&self) {
        self.state().heard_at = Some(Instant::now());
        self.heard.notify_waiters();
    }

    fn set_listening(&self, listening: bool) {
        let changed = {
            let mut state = self.state();
            let changed = state.listening != listening;
            state.listening = listening;
            state.ever_listened |= listening;
            if !listening {
                state.heard_at = None;
            }
            changed
        };
        if changed {
            // Either way the waiters must look again: they may have missed a release, or
            // may now sleep until one is announced.
            self.wake_all();
        }
    }

    /// Notes that the listener could not connect, and has every waiter that waits for it
    /// look again ([`ListenerState::worth_waiting_for`]).
    fn connect_failed(&self) {
        self.state().ever_failed = true;
        self.heard.notify_waiters();
    }

    /// Whether announcements can be relied on now: listening, and heard from lately.
    fn reliable(&self) -> bool {
        let state = self.state();
        state.listening && state.heard_at.is_some_and(|at| at.elapsed() < STALE_AFTER)
    }
}

/// Marks the listener down when its task ends, however it ends.
struct ListeningGuard(Arc<Shared>);

impl Drop for ListeningGuard {
    fn drop(&mut self) {
        self.0.set_listening(false);
    }
}

/// One client's release listener (started by its first waiter, started again if its task
/// ever ended).
pub(crate) struct Releases {
    channel: String,
    connect: PgConnectOptions,
    connect_timeout: Duration,
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Releases {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Releases {
    pub(crate) fn new(
        channel: String,
        connect: PgConnectOptions,
        connect_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Releases {
            channel,
            connect,
            connect_timeout,
            shared: Arc::new(Shared {
                keys: Mutex::default(),
                state: Mutex::default(),
                poke: Notify::new(),
                heard: Notify::new(),
            }),
            task: Mutex::new(None),
        })
    }

    /// Stops the listener and closes its connection.
    pub(crate) fn stop(&self) {
        if let Some(task) = self.task.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }

    /// A waiter's wake-ups for `key`.
    pub(crate) fn waiter(self: &Arc<Self>, key: &str) -> ReleaseNotes {
        ReleaseNotes {
            releases: self.clone(),
            key: hex(key),
            notify: None,
        }
    }

    fn subscribe(&self, key: &str) -> Arc<Notify> {
        let (notify, first) = {
            let mut keys = self.shared.keys();
            let first = keys.is_empty();
            let entry = keys.entry(key.to_owned()).or_default();
            entry.1 += 1;
            (entry.0.clone(), first)
        };
        let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
        if task.as_ref().is_none_or(JoinHandle::is_finished) {
            *task = Some(tokio::spawn(listen(
                self.shared.clone(),
                self.channel.clone(),
                self.connect.clone(),
                self.connect_timeout,
            )));
        }
        if first {
            // Nobody waited, so nothing was checked: have the listener prove itself now.
            self.shared.poke.notify_one();
        }
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
async fn listen(
    shared: Arc<Shared>,
    channel: String,
    connect: PgConnectOptions,
    connect_timeout: Duration,
) {
    let _down_when_done = ListeningGuard(shared.clone());
    let reconnect = || Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut pause = reconnect();
    loop {
        let started = Instant::now();
        if let Err(error) = listen_once(&shared, &channel, &connect, connect_timeout).await {
            // `listen_once` fails only before it listens: connecting, or asking to LISTEN.
            tracing::debug!(%error, "release listener could not connect; waiters poll meanwhile");
            shared.connect_failed();
        }
        shared.set_listening(false);
        // Only a connection that lasted resets the pace: one that dies right after LISTEN
        // must not be reopened (and every waiter woken) every 50 ms.
        if started.elapsed() > STALE_AFTER {
            pause = reconnect();
        }
        tokio::time::sleep(pause.next_delay()).await;
    }
}

/// One listener connection, until it is lost or goes quiet.
async fn listen_once(
    shared: &Shared,
    channel: &str,
    connect: &PgConnectOptions,
    connect_timeout: Duration,
) -> Result<(), sqlx::Error> {
    let own = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(connect_timeout)
        // Its one connection is handed out once, just made: no ping needed.
        .test_before_acquire(false)
        .max_lifetime(None)
        .idle_timeout(None)
        // Named, so an operator (or a test) can tell it in `pg_stat_activity`.
        .connect_with(connect.clone().application_name(LISTENER_APPLICATION_NAME))
        .await?;
    let mut listener = PgListener::connect_with(&own).await?;
    listener.eager_reconnect(false);
    listener.listen(channel).await?;
    // The listener's connection runs on its own task, so a quiet connection can be dropped
    // without cancelling a read half-way. It also sends the heartbeats: a session hears its
    // own `NOTIFY`, so a heartbeat that comes back proves this very connection listens, and
    // costs no pooled connection (nor its ping) while waiters wait.
    let (heard, mut hearing) = mpsc::channel::<Option<String>>(64);
    let (beats, mut beat_requests) = mpsc::channel::<()>(1);
    let heartbeat_channel = channel.to_owned();
    let receiver = AbortOnDrop(tokio::spawn(async move {
        loop {
            // `try_recv` is cancel-safe: sqlx keeps a message read half-way in its buffer
            // (and notifications that come during a query for the next `try_recv`).
            let message = tokio::select! {
                biased;
                request = beat_requests.recv() => {
                    if request.is_none() {
                        return;
                    }
                    let sent = sqlx::query("SELECT pg_notify($1, $2)")
                        .bind(&heartbeat_channel)
                        .bind(HEARTBEAT_PAYLOAD)
                        .execute(&mut listener)
                        .await;
                    match sent {
                        Ok(_) => continue,
                        // The connection is gone: so is the listener.
                        Err(sqlx::Error::Io(_) | sqlx::Error::Protocol(_)) => None,
                        // Anything else (a full notification queue) leaves the listener as
                        // it is; the heartbeat stays unanswered, and a listener that hears
                        // nothing at all is replaced when that runs out.
                        Err(error) => {
                            tracing::debug!(%error, "a release listener's heartbeat failed");
                            continue;
                        }
                    }
                }
                received = listener.try_recv() => match received {
                    Ok(Some(note)) => Some(note.payload().to_owned()),
                    Ok(None) | Err(_) => None,
                },
            };
            let lost = message.is_none();
            if heard.send(message).await.is_err() || lost {
                return;
            }
        }
    }));
    // Wakes every waiter: whatever was released before the LISTEN took effect was not
    // heard. Reliable only once something is heard (the heartbeat below).
    // After an earlier connection or a failed attempt, waiters may be waiting (polling).
    let reconnected = {
        let state = shared.state();
        state.ever_listened || state.ever_failed
    };
    shared.set_listening(true);
    // The oldest heartbeat asked for since the listener last heard anything.
    let mut unanswered: Option<Instant> = None;
    // The first beat a full period from now: a first waiter pokes for one at once, and
    // waiters already waiting when the listener reconnects get one now.
    let mut beat = tokio::time::interval_at(Instant::now() + HEARTBEAT, HEARTBEAT);
    if reconnected && !shared.keys().is_empty() {
        let _ = beats.try_send(());
        unanswered = Some(Instant::now());
    }
    loop {
        let send_beat = tokio::select! {
            message = hearing.recv() => {
                let Some(Some(payload)) = message else { break };
                shared.heard();
                unanswered = None;
                if let Some(key) = payload.strip_prefix("r:") {
                    shared.wake(key);
                }
                false
            }
            () = shared.poke.notified() => true,
            _ = beat.tick() => !shared.keys().is_empty(),
        };
        if !send_beat {
            continue;
        }
        if unanswered.is_some_and(|sent| sent.elapsed() > STALE_AFTER) {
            tracing::debug!("release listener heard nothing, not even its heartbeat; replacing it");
            break;
        }
        // A full queue means a heartbeat is still on its way (or stuck: then `unanswered`
        // runs out).
        let _ = beats.try_send(());
        unanswered.get_or_insert_with(Instant::now);
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

/// A waiter's wake-ups: release announcements for its key, once the listener is heard.
pub(crate) struct ReleaseNotes {
    releases: Arc<Releases>,
    /// The key, in hex as announced.
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
    /// Registers on the first call, and then waits (up to the connect timeout) for the
    /// listener to be heard from, when it is connecting for the first time or is connected
    /// but unchecked (nobody waited lately); a listener known to be down (it listened and
    /// was lost, or failed to connect) is not waited for, nor one that goes down or fails
    /// to connect meanwhile. While announcements cannot be relied on, the waiter polls; it
    /// relies on them again once the listener, which keeps reconnecting, is heard.
    async fn ready(&mut self) -> bool {
        let shared = self.releases.shared.clone();
        if self.notify.is_none() {
            self.notify = Some(self.releases.subscribe(&self.key));
            let worth_waiting = shared.state().worth_waiting_for();
            if worth_waiting {
                let until = Instant::now() + self.releases.connect_timeout;
                loop {
                    let heard = shared.heard.notified();
                    tokio::pin!(heard);
                    heard.as_mut().enable();
                    if shared.reliable() || Instant::now() >= until {
                        break;
                    }
                    // Also looks again now and then: the listener may have gone down.
                    let step = (Instant::now() + Duration::from_millis(250)).min(until);
                    tokio::select! {
                        () = heard => {}
                        () = tokio::time::sleep_until(step) => {}
                    }
                    if !shared.state().worth_waiting_for() {
                        break;
                    }
                }
            }
        }
        shared.reliable()
    }

    fn arm(&self) -> Armed<'_> {
        match &self.notify {
            Some(notify) => armed(notify),
            None => never(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_announced_in_hex() {
        assert_eq!(release_payload("a/b"), "r:612f62");
        assert_eq!(hex("é"), "c3a9");
    }

    #[test]
    fn only_a_listener_never_down_is_waited_for() {
        let state = |listening, ever_listened, ever_failed| ListenerState {
            listening,
            heard_at: None,
            ever_listened,
            ever_failed,
        };
        // Connecting for the first time, or connected: waited for.
        assert!(state(false, false, false).worth_waiting_for());
        assert!(state(true, true, false).worth_waiting_for());
        assert!(state(true, true, true).worth_waiting_for());
        // Down after it listened, or after it failed to connect: waiters poll.
        assert!(!state(false, true, false).worth_waiting_for());
        assert!(!state(false, false, true).worth_waiting_for());
    }
}

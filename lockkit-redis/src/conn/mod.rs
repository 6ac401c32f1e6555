//! One command connection, to a single server or to a cluster, and error mapping; and the
//! release notifications: one shared subscriber connection per backend fans the
//! `redisson_lock__channel:{name}` messages out to the local waiters of each lock.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use futures_util::StreamExt;
use lockkit_core::spi::{Armed, Interrupt, Wake, armed, never};
use lockkit_core::{Error, Result, async_trait};
use redis::{
    Cmd, RedisError, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager, PubSubSink},
    cluster_async::ClusterConnection,
};
use tokio::sync::{Notify, Semaphore, SemaphorePermit};

pub(crate) mod direct;
pub(crate) mod tcp;

pub(crate) const BACKEND: &str = "redis";

/// A reconnecting, multiplexed command connection.
#[derive(Clone)]
pub(crate) enum Conn {
    /// One plain-TCP server, driven by the callers' tasks (see [`direct`]).
    Direct(direct::DirectConn),
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Direct(c) => c.req_packed_command(cmd),
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Direct(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Direct(c) => c.get_db(),
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Maps a client error to lockkit's, saying what was being done.
pub(crate) fn backend_error(doing: &str, target: &str, e: RedisError) -> Error {
    // The target may be a URL with a password: never show it.
    let target = &lockkit_core::config::redact_url(target);
    let retryable = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error();
    let hint = if e.is_connection_refusal() || e.is_io_error() {
        "; is the server running and reachable?"
    } else if e.is_timeout() {
        "; the server is slow or paused, or response_timeout is too short"
    } else {
        ""
    };
    Error::backend_with_source(
        BACKEND,
        retryable,
        format!("{doing} on {target} failed: {e}{hint}"),
        e,
    )
}

/// The connections acquisitions run on: the command connection itself, or with
/// `wait_replicas` a few of their own.
///
/// `WAIT` blocks the connection it is sent on for up to its timeout, so an acquisition must
/// not be queued on the server behind another's `WAIT`: it would hold up grants of other
/// keys, and one queued past its response timeout fails although its script may still run
/// and grant (a hold nobody knows of, until its lease ends). So each acquisition has a
/// connection to itself, and waits here, before sending anything, for one to be free.
pub(crate) enum GrantConns {
    /// Multiplexed: every acquisition shares it.
    Shared(Conn),
    /// One acquisition at a time on each.
    Exclusive {
        idle: Mutex<Vec<Conn>>,
        permits: Semaphore,
    },
}

/// An acquisition's use of a grant connection; dropping it hands the connection back.
pub(crate) struct GrantSlot<'a> {
    pub(crate) conn: Conn,
    home: Option<(&'a Mutex<Vec<Conn>>, SemaphorePermit<'a>)>,
}

impl Drop for GrantSlot<'_> {
    fn drop(&mut self) {
        // The connection goes back before the permit (a field, dropped after this).
        if let Some((idle, _)) = &self.home {
            idle.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(self.conn.clone());
        }
    }
}

impl GrantConns {
    pub(crate) fn exclusive(conns: Vec<Conn>) -> Self {
        let permits = Semaphore::new(conns.len());
        GrantConns::Exclusive {
            idle: Mutex::new(conns),
            permits,
        }
    }

    /// A connection for one acquisition, waiting (before anything is sent) while all of
    /// them are in use: at most `within`, and not past `interrupt` (the caller went away).
    /// Either way nothing was sent, so the error is a clean retryable refusal.
    pub(crate) async fn pick(
        &self,
        within: Duration,
        interrupt: Option<&Interrupt>,
    ) -> Result<GrantSlot<'_>, Error> {
        match self {
            GrantConns::Shared(conn) => Ok(GrantSlot {
                conn: conn.clone(),
                home: None,
            }),
            GrantConns::Exclusive { idle, permits } => {
                let unavailable =
                    || Error::backend(BACKEND, true, "no grant connection is available");
                let interrupted = async {
                    match interrupt {
                        Some(interrupt) => interrupt.interrupted().await,
                        None => std::future::pending().await,
                    }
                };
                let permit = tokio::select! {
                    permit = tokio::time::timeout(within, permits.acquire()) => match permit {
                        Ok(Ok(permit)) => permit,
                        Ok(Err(_)) => return Err(unavailable()),
                        Err(_) => {
                            return Err(Error::backend(
                                BACKEND,
                                true,
                                format!(
                                    "every connection for grants that wait for replicas stayed \
                                     busy for {within:?} (other acquisitions waiting on WAIT); \
                                     nothing was sent: retry, or check the replicas"
                                ),
                            ));
                        }
                    },
                    () = interrupted => {
                        return Err(Error::backend(BACKEND, true, "the acquisition was abandoned"));
                    }
                };
                let conn = idle
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .pop()
                    .ok_or_else(unavailable)?;
                Ok(GrantSlot {
                    conn,
                    home: Some((idle, permit)),
                })
            }
        }
    }
}

// ---- release notifications

/// Local waiters on one channel.
#[derive(Debug, Default)]
pub(crate) struct Channel {
    /// Notified on every release (once per release: the `0` after a named waiter is the
    /// same release) and when the subscriber connection is lost, so waiters retry instead
    /// of sleeping on a dead subscription.
    pub(crate) notify: Notify,
    /// What the releases heard so far said (see [`Turns`]).
    turns: Mutex<Turns>,
    /// Subscriptions held; changed only under the sink lock.
    refs: Mutex<usize>,
}

/// The releases heard on one channel, for waiters that queue (see `wire::queue_of`).
#[derive(Debug, Default)]
struct Turns {
    /// Releases that named nobody (a bare `0`, any other message, a lost connection):
    /// every waiter tries.
    open: u64,
    /// The latest named releases and queued waiters' grants, with their sequence numbers
    /// (the last [`EVENTS_KEPT`]).
    events: std::collections::VecDeque<(u64, Event)>,
    /// The sequence number of the next event.
    next_event: u64,
    /// When the last release that named a waiter was heard (see [`Channel::round_gate`]).
    last_named_at: Option<tokio::time::Instant>,
    /// The last message named a waiter, heard on the subscriber connection of this
    /// generation: the `0` right after it on that connection is the same release. (A
    /// reader of a connection given up may still hand over a name after the reset: its
    /// mark must not swallow a `0` of the next connection.)
    zero_follows: Option<u64>,
}

/// What a message from a lockkit script said, beyond "the key is free".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// A release named this waiter as the next.
    Named(u64),
    /// A queued waiter was granted the key (its id, published negated), and when the lease
    /// of that grant ends, once the message after it said so (see
    /// `wire::TAKEN_LEASE_BASE`).
    Taken(u64, Option<tokio::time::Instant>),
}

/// How many events a channel remembers; a waiter that has not looked for longer tries, as
/// after a release that named nobody.
const EVENTS_KEPT: usize = 64;

/// How long a waiter that heard a release name another waiter sleeps on before it tries
/// anyway, unless it hears a queued waiter take the key first: the named waiter may have
/// died, given up, or be paused. Each named release after the first while it sleeps does
/// not extend it.
pub(crate) const NAMED_GRACE: Duration = Duration::from_millis(50);

/// Where a waiter stood at [`Channel::mark`]: the releases after it decide whether it
/// tries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark {
    open: u64,
    next_event: u64,
}

/// What the messages since a [`Mark`] tell a waiter.
#[derive(Debug, PartialEq, Eq)]
enum Turn {
    /// Nothing, or the key was last taken by a queued waiter: sleep on, until that grant's
    /// lease ends at most (when the grant said when).
    Nothing(Option<tokio::time::Instant>),
    /// Try now: a release named nobody, or named this waiter, or its owner took the key,
    /// or the waiter lost track.
    Try,
    /// The last release named another waiter, who has not been heard taking the key.
    Others,
}

impl Channel {
    fn turns(&self) -> MutexGuard<'_, Turns> {
        self.turns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes in one message's payload, heard on the subscriber connection of `generation`;
    /// whether the channel's waiters are to be woken.
    fn heard(&self, payload: &[u8], generation: u64) -> bool {
        let mut turns = self.turns();
        let min = i64::try_from(crate::wire::NAMED_WAITER_MIN).unwrap_or(i64::MAX);
        let lease_base = i64::try_from(crate::wire::TAKEN_LEASE_BASE).unwrap_or(i64::MAX);
        let number = std::str::from_utf8(payload)
            .ok()
            .and_then(|text| text.parse::<i64>().ok());
        if let Some(n) = number.filter(|n| *n <= -lease_base) {
            // The lease of the grant just published as taken: the waiters that sleep on
            // behind it wake when it ends, if nothing else wakes them first.
            let ms = n.unsigned_abs() - crate::wire::TAKEN_LEASE_BASE;
            let ends = tokio::time::Instant::now()
                .checked_add(Duration::from_millis(ms.saturating_add(1)))
                .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400));
            let next_event = turns.next_event;
            if let Some((seq, Event::Taken(_, lease))) = turns.events.back_mut()
                && *seq + 1 == next_event
            {
                *lease = Some(ends);
                return true;
            }
            return false;
        }
        let event = match number {
            Some(n) if n >= min => Some(Event::Named(n.unsigned_abs())),
            Some(n) if n <= -min => Some(Event::Taken(n.unsigned_abs(), None)),
            _ => None,
        };
        match event {
            Some(event) => {
                let seq = turns.next_event;
                turns.next_event += 1;
                turns.events.push_back((seq, event));
                if turns.events.len() > EVENTS_KEPT {
                    turns.events.pop_front();
                }
                turns.zero_follows = matches!(event, Event::Named(_)).then_some(generation);
                if matches!(event, Event::Named(_)) {
                    turns.last_named_at = Some(tokio::time::Instant::now());
                }
                true
            }
            None if payload == b"0" && turns.zero_follows.take() == Some(generation) => false,
            None => {
                turns.zero_follows = None;
                turns.open += 1;
                true
            }
        }
    }

    /// Every waiter tries (the connection was lost, so releases may have been missed).
    fn open_up(&self) {
        let mut turns = self.turns();
        turns.zero_follows = None;
        turns.open += 1;
    }

    pub(crate) fn mark(&self) -> Mark {
        let turns = self.turns();
        Mark {
            open: turns.open,
            next_event: turns.next_event,
        }
    }

    /// What the messages since `mark` mean for waiter `me`.
    fn turn_since(&self, mark: Mark, me: u64) -> Turn {
        let turns = self.turns();
        if turns.open != mark.open {
            return Turn::Try;
        }
        if turns.next_event == mark.next_event {
            return Turn::Nothing(None);
        }
        match turns.events.front() {
            Some((oldest, _)) if *oldest <= mark.next_event => {}
            _ => return Turn::Try,
        }
        let mut turn = Turn::Nothing(None);
        for (_, event) in turns
            .events
            .iter()
            .filter(|(seq, _)| *seq >= mark.next_event)
        {
            turn = match event {
                // Named, or its own owner took the key (another wait of the owner): it
                // goes to the server, to be granted or to re-enter.
                Event::Named(id) | Event::Taken(id, _) if *id == me => return Turn::Try,
                Event::Named(_) => Turn::Others,
                Event::Taken(_, lease) => Turn::Nothing(*lease),
            };
        }
        turn
    }

    /// Whether a round of queued waiter `me` that no message of this channel called for
    /// (its timer, another server's message) goes to the server now, from what this
    /// channel heard since `mark` (taken when its last round began). A release that named
    /// another waiter, not yet heard taking the key, holds the round back until
    /// [`NAMED_GRACE`] after that release at most; a queued waiter heard taking the key
    /// since makes the round needless: the holder is fresh, and its lease (when known) is
    /// what the waiter waits for. A round called for (a release named `me` or nobody) and a
    /// round after nothing was heard go at once.
    pub(crate) fn round_gate(&self, mark: Mark, me: u64) -> RoundGate {
        let now = tokio::time::Instant::now();
        let heard_nothing = self.turns().next_event == mark.next_event;
        match self.turn_since(mark, me) {
            Turn::Try => RoundGate::Go,
            Turn::Nothing(_) if heard_nothing => RoundGate::Go,
            Turn::Nothing(Some(lease_end)) if lease_end <= now => RoundGate::Go,
            Turn::Nothing(lease_end) => RoundGate::Skip(lease_end),
            Turn::Others => match self.turns().last_named_at {
                Some(named) if named + NAMED_GRACE > now => {
                    RoundGate::HoldUntil(named + NAMED_GRACE)
                }
                _ => RoundGate::Go,
            },
        }
    }
}

/// What [`Channel::round_gate`] tells a queued waiter's round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RoundGate {
    /// Ask the server now.
    Go,
    /// Another waiter was named: ask once it is heard taking the key or this instant
    /// passes (the channel's `notify` says when it heard something).
    HoldUntil(tokio::time::Instant),
    /// A queued waiter took the key since: no round; sleep until its lease ends (`None`:
    /// not heard yet), or a message wakes the waiter.
    Skip(Option<tokio::time::Instant>),
}

/// Resolves when waiter `me` (see `wire::queue_of`) is to try again on `channel`: a release
/// named it or nobody since this call, or [`NAMED_GRACE`] passed since a release named
/// another waiter and no queued waiter was heard taking the key after it, or the lease of
/// the queued waiter last heard taking the key ran out (its holder may have died: nobody
/// publishes that; the lease the waiter learned before was the previous holder's). Marked
/// at the call, so a release that comes before the first poll counts.
pub(crate) fn armed_for_turn(channel: &Channel, me: u64) -> Armed<'_> {
    let mut notified = armed(&channel.notify);
    let mark = channel.mark();
    Box::pin(async move {
        let mut grace: Option<tokio::time::Instant> = None;
        let mut lease_end: Option<tokio::time::Instant> = None;
        loop {
            match grace.into_iter().chain(lease_end).min() {
                Some(until) => {
                    tokio::select! {
                        () = &mut notified => {}
                        () = tokio::time::sleep_until(until) => return,
                    }
                }
                None => (&mut notified).await,
            }
            // Listening again before reading what was heard: nothing slips in between.
            notified = armed(&channel.notify);
            match channel.turn_since(mark, me) {
                Turn::Try => return,
                Turn::Others => {
                    grace.get_or_insert_with(|| tokio::time::Instant::now() + NAMED_GRACE);
                }
                Turn::Nothing(lease) => {
                    grace = None;
                    lease_end = lease;
                }
            }
        }
    })
}

#[derive(Default)]
struct Shared {
    channels: Mutex<HashMap<String, Arc<Channel>>>,
    /// The generation of the last connection whose reader ended.
    dead_generation: AtomicU64,
}

impl Shared {
    fn channels(&self) -> MutexGuard<'_, HashMap<String, Arc<Channel>>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake_all(&self) {
        for channel in self.channels().values() {
            channel.open_up();
            channel.notify.notify_waiters();
        }
    }
}

/// The connection in use and a generation number that changes when it is replaced.
struct Link {
    generation: u64,
    sink: Option<PubSubSink>,
    /// The reader of the connection in use: aborted (closing that connection) when the
    /// link gives the connection up, so an abandoned connection never lingers.
    reader: Option<tokio::task::JoinHandle<()>>,
    /// When the last attempt to open the connection failed: new attempts wait
    /// [`RECONNECT_PAUSE`] after it, so waiters behind a dead server fail fast instead of
    /// each spending a timeout under the lock.
    failed_at: Option<tokio::time::Instant>,
}

/// The pause between attempts to reopen a subscriber connection that failed to open.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

/// The shared subscriber of one backend.
pub(crate) struct Wakeups {
    client: redis::Client,
    target: String,
    /// Bounds every exchange with the server made under `link` (opening the connection,
    /// SUBSCRIBE, UNSUBSCRIBE): a frozen server must not hold the lock, and with it every
    /// other waiter, for longer.
    timeout: Duration,
    shared: Arc<Shared>,
    /// The generation of the connection in use, 0 for none: what [`Link`] says, readable
    /// without its lock (see [`Wakeups::check_connected`]).
    live_generation: AtomicU64,
    /// Serialises SUBSCRIBE/UNSUBSCRIBE so their order on the wire matches the refcounts.
    link: tokio::sync::Mutex<Link>,
}

impl std::fmt::Debug for Wakeups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wakeups")
            .field("target", &self.target)
            .finish()
    }
}

impl Drop for Wakeups {
    /// The backend, its waits and their background work have all gone: the reader of the
    /// connection in use stops, closing that connection, which would else stay open (and
    /// the task with it) for as long as the server keeps it.
    fn drop(&mut self) {
        if let Some(reader) = self.link.get_mut().reader.take() {
            reader.abort();
        }
    }
}

/// One waiter's subscription; unsubscribes (in the background) when the last local
/// waiter on the channel goes.
pub(crate) struct Subscription {
    wakeups: Arc<Wakeups>,
    name: String,
    pub(crate) channel: Arc<Channel>,
}

impl Subscription {
    /// The channel's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Whether the subscriber connection this subscription rides on is alive, without
    /// waiting: a dead one is made again in the background (see
    /// [`Wakeups::check_connected`]).
    ///
    /// # Errors
    /// While the connection is dead.
    pub(crate) fn check_connected(&self) -> Result<()> {
        self.wakeups.check_connected()
    }
}

/// A waiter's wake-ups: release messages on its key's channels, once subscribed. The first
/// [`Wake::ready`] subscribes (a failure leaves the waiter polling); later ones reconnect a
/// subscriber connection that died, and answer whether messages can be relied on.
pub(crate) struct ReleaseMessages {
    wakeups: Arc<Wakeups>,
    names: Vec<String>,
    subscriptions: Vec<Subscription>,
    tried: bool,
    /// The waiter's queue id, for a waiter that queues (see `wire::queue_of`): it then
    /// sleeps through releases that name other waiters, for [`NAMED_GRACE`] at most.
    queued_as: Option<u64>,
    /// For a plain lock's wait on one server: the key's deletion, heard through keyspace
    /// notifications while the key is held in another format (see [`ForeignWatch`]).
    foreign: Option<Arc<ForeignWatch>>,
    /// The subscription to the key's keyspace channel, once the wait met a foreign holder.
    keyspace: Option<Subscription>,
    /// The server refused the keyspace subscription: the wait polls the foreign holder.
    keyspace_refused: bool,
}

/// A wait's view of a holder in another format: a plain string (redis-py's `Lock`,
/// redsync, rslock), whose owner publishes nothing when it lets go. Where the server sends
/// keyspace notifications of generic commands (`notify-keyspace-events` with `K` and `g`,
/// or `A`), the waiter subscribes to the key's keyspace channel (`__keyspace@<db>__:<key>`)
/// once an attempt found such a holder, and is woken when the key is deleted (`del`,
/// `expired`, `evicted`, renamed or moved away), instead of looking again every
/// [`FOREIGN_HOLDER_POLL`](crate::single) only. Heeded only while the last attempt found a
/// foreign holder: a lockkit or Redisson holder's release deletes the key too, and waking
/// every waiter on it would undo the waiter queue.
#[derive(Debug)]
pub(crate) struct ForeignWatch {
    /// The key's keyspace channel.
    channel: String,
    /// Whether the server sends the notifications (found out once per backend, see
    /// `RedisBackend::keyspace_events`); unset until known.
    events_on: Arc<OnceLock<bool>>,
    /// The wait's last attempt found the key held in another format.
    seen: AtomicBool,
    /// The keyspace subscription is made (and its connection alive, as far as known): a
    /// foreign holder's deletion wakes the waiter.
    heard: AtomicBool,
    /// The last attempt's answer: a foreign holder whose deletion the armed wake-up hears
    /// (what [`ForeignWatch::saw_foreign_holder`] answered last).
    hears: AtomicBool,
}

impl ForeignWatch {
    /// A watch of lock `name` in database `db`; `events_on` says whether the server sends
    /// keyspace notifications, once known.
    pub(crate) fn new(db: i64, name: &str, events_on: Arc<OnceLock<bool>>) -> Arc<Self> {
        Arc::new(ForeignWatch {
            channel: format!("__keyspace@{db}__:{name}"),
            events_on,
            seen: AtomicBool::new(false),
            heard: AtomicBool::new(false),
            hears: AtomicBool::new(false),
        })
    }

    /// The key's keyspace channel.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// Whether the wait's last attempt found the key held in another format.
    pub(crate) fn seen(&self) -> bool {
        self.seen.load(Ordering::Acquire)
    }

    /// What the last [`ForeignWatch::saw_foreign_holder`] answered: the key is held in
    /// another format, and its deletion wakes the waiter.
    pub(crate) fn hears(&self) -> bool {
        self.hears.load(Ordering::Acquire)
    }

    /// Whether a keyspace subscription should be made for this watch now: the last attempt
    /// found a foreign holder and the server is known to send the notifications.
    pub(crate) fn wants_keyspace(&self) -> bool {
        self.seen() && self.events_on.get() == Some(&true)
    }

    /// Records whether the keyspace subscription is made and alive.
    pub(crate) fn set_heard(&self, heard: bool) {
        self.heard.store(heard, Ordering::Release);
    }

    /// Records what the wait's last attempt found: a holder in another format or not.
    /// Answers whether the key's deletion wakes the waiter from this attempt's answer (so
    /// it need not poll often): the keyspace subscription is made, and the wake-up armed
    /// before this attempt heeds it, because the attempt before found a foreign holder
    /// too. A foreign holder found after a lockkit or Redisson one (whose release woke the
    /// waiter) is polled as before until the next attempt.
    pub(crate) fn saw_foreign_holder(&self, foreign: bool) -> bool {
        let heeded = self.seen.swap(foreign, Ordering::AcqRel);
        let hears = foreign && heeded && self.heard.load(Ordering::Acquire);
        self.hears.store(hears, Ordering::Release);
        hears
    }
}

/// Whether a message on a keyspace channel says the key is gone: deleted (`DEL` and
/// `UNLINK` both say `del`), expired, evicted, renamed or moved away.
fn keyspace_says_gone(payload: &[u8]) -> bool {
    matches!(
        payload,
        b"del" | b"expired" | b"evicted" | b"rename_from" | b"move_from"
    )
}

/// Whether `channel` is a keyspace notification channel (never a lock's release channel,
/// which starts with Redisson's `redisson_lock__channel`).
fn is_keyspace_channel(channel: &[u8]) -> bool {
    channel.starts_with(b"__keyspace@")
}

impl ReleaseMessages {
    pub(crate) fn new(wakeups: Arc<Wakeups>, name: String) -> Self {
        Self::on(wakeups, vec![name])
    }

    /// Wake-ups from a message on any of `names`.
    pub(crate) fn on(wakeups: Arc<Wakeups>, names: Vec<String>) -> Self {
        ReleaseMessages {
            wakeups,
            names,
            subscriptions: Vec::new(),
            tried: false,
            queued_as: None,
            foreign: None,
            keyspace: None,
            keyspace_refused: false,
        }
    }

    /// Also hears the key's deletion through `watch` while the key is held in another
    /// format (see [`ForeignWatch`]).
    pub(crate) fn watching(mut self, watch: Arc<ForeignWatch>) -> Self {
        self.foreign = Some(watch);
        self
    }

    /// Subscribes to the key's keyspace channel once an attempt found a foreign holder and
    /// the server is known to send the notifications. A failure leaves the wait polling
    /// that holder as before.
    async fn watch_keyspace(&mut self) {
        let Some(watch) = &self.foreign else {
            return;
        };
        if self.keyspace.is_some() || self.keyspace_refused || !watch.wants_keyspace() {
            return;
        }
        match self.wakeups.subscribe(&watch.channel).await {
            Ok(subscription) => {
                self.keyspace = Some(subscription);
                watch.set_heard(true);
            }
            Err(error) => {
                // A refusal (an ACL without the keyspace channels) is not asked again by
                // this wait; a lost connection is, once the connection is back.
                self.keyspace_refused = !error.is_retryable();
                tracing::debug!(%error, "no keyspace notifications; polling the foreign holder");
            }
        }
    }

    /// Wake-ups of waiter `id` on `name`, a waiter that queues (see `wire::queue_of`).
    pub(crate) fn queued(wakeups: Arc<Wakeups>, name: String, id: u64) -> Self {
        ReleaseMessages {
            queued_as: Some(id),
            ..Self::new(wakeups, name)
        }
    }
}

#[async_trait]
impl Wake for ReleaseMessages {
    async fn ready(&mut self) -> bool {
        let ready = self.ready_for_releases().await;
        if ready {
            self.watch_keyspace().await;
        }
        ready
    }

    fn arm(&self) -> Armed<'_> {
        let releases = self.arm_for_releases();
        match (&self.keyspace, &self.foreign) {
            (Some(keyspace), Some(watch)) if watch.seen.load(Ordering::Acquire) => {
                let deleted = armed(&keyspace.channel.notify);
                Box::pin(async move {
                    futures_util::future::select(releases, deleted).await;
                })
            }
            _ => releases,
        }
    }
}

impl ReleaseMessages {
    async fn ready_for_releases(&mut self) -> bool {
        if !std::mem::replace(&mut self.tried, true) {
            for name in &self.names {
                match self.wakeups.subscribe(name).await {
                    Ok(subscription) => self.subscriptions.push(subscription),
                    Err(error) => {
                        // All or nothing: a waiter deaf to one channel polls.
                        self.subscriptions.clear();
                        tracing::warn!(%error, "no release notifications; falling back to timed retries");
                        return false;
                    }
                }
            }
            return true;
        }
        if self.subscriptions.is_empty() {
            return false;
        }
        match self.wakeups.ensure_connected().await {
            Ok(()) => true,
            Err(error) => {
                tracing::debug!(%error, "subscriber connection down; retrying on the timer");
                false
            }
        }
    }

    fn arm_for_releases(&self) -> Armed<'_> {
        match self.subscriptions.as_slice() {
            [] => never(),
            [one] => match self.queued_as {
                Some(me) => armed_for_turn(&one.channel, me),
                None => armed(&one.channel.notify),
            },
            several => {
                // Each armed at once, so a message that comes before the first poll counts.
                let all: Vec<Armed<'_>> =
                    several.iter().map(|s| armed(&s.channel.notify)).collect();
                Box::pin(async move {
                    futures_util::future::select_all(all).await;
                })
            }
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let wakeups = self.wakeups.clone();
        let name = std::mem::take(&mut self.name);
        if name.is_empty() {
            // Its reference was given back already (a channel the server refused).
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { wakeups.unsubscribe(&name).await });
        }
    }
}

impl Wakeups {
    /// A subscriber for `client`; each exchange with the server may take up to `timeout`.
    pub(crate) fn new(client: redis::Client, target: String, timeout: Duration) -> Arc<Self> {
        Arc::new(Wakeups {
            client,
            target,
            timeout,
            shared: Arc::default(),
            live_generation: AtomicU64::new(0),
            link: tokio::sync::Mutex::new(Link {
                generation: 0,
                sink: None,
                reader: None,
                failed_at: None,
            }),
        })
    }

    /// Subscribes to `name` and returns once the server confirmed, so a release published
    /// after this returns cannot be missed. A channel the server refuses (an ACL's
    /// `NOPERM`) is an error that leaves the connection, and every other subscription on
    /// it, as it was.
    ///
    /// # Cancel safety
    /// If dropped mid-way the reference is still counted and given back by a background
    /// unsubscribe, so nothing leaks.
    pub(crate) async fn subscribe(self: &Arc<Self>, name: &str) -> Result<Subscription> {
        let mut link = self.link.lock().await;
        let channel = self
            .shared
            .channels()
            .entry(name.to_owned())
            .or_default()
            .clone();
        let subscription = Subscription {
            wakeups: self.clone(),
            name: name.to_owned(),
            channel: channel.clone(),
        };
        let first = {
            let mut refs = channel.refs.lock().unwrap_or_else(|e| e.into_inner());
            *refs += 1;
            *refs == 1
        };
        if self.is_dead(&link) {
            self.connect(&mut link).await?;
        } else if first {
            let sink = link.sink.as_mut().ok_or_else(|| self.gone())?;
            match tokio::time::timeout(self.timeout, sink.subscribe(name)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) if matches!(e.kind(), redis::ErrorKind::Server(_)) => {
                    // The server refused the channel (an ACL's `NOPERM`): the connection is
                    // well, and stays, with every other waiter's wake-ups on it. The
                    // reference is given back now, so no reconnection asks for the channel.
                    let mut subscription = subscription;
                    subscription.name.clear();
                    self.release_ref(name);
                    return Err(backend_error("SUBSCRIBE", &self.target, e));
                }
                Ok(Err(e)) => {
                    self.abandon(&mut link);
                    return Err(backend_error("SUBSCRIBE", &self.target, e));
                }
                Err(_) => {
                    self.abandon(&mut link);
                    return Err(self.timed_out("SUBSCRIBE"));
                }
            }
        }
        Ok(subscription)
    }

    /// Gives the connection up: its reader stops, and with it the connection. Waiters
    /// subscribed through it are told (as when a connection dies by itself), so they retry
    /// and resubscribe instead of sleeping on a subscription that no longer hears anything.
    fn abandon(&self, link: &mut Link) {
        link.sink = None;
        self.live_generation.store(0, Ordering::SeqCst);
        if let Some(reader) = link.reader.take() {
            reader.abort();
            self.shared
                .dead_generation
                .fetch_max(link.generation, Ordering::SeqCst);
            self.shared.wake_all();
        }
    }

    fn gone(&self) -> lockkit_core::Error {
        lockkit_core::Error::backend(
            BACKEND,
            true,
            format!("the subscriber connection to {} is gone", self.target),
        )
    }

    fn timed_out(&self, doing: &str) -> lockkit_core::Error {
        lockkit_core::Error::backend(
            BACKEND,
            true,
            format!(
                "{doing} on the subscriber connection to {} got no answer within {:?}; is the \
                 server overloaded or partitioned away?",
                self.target, self.timeout
            ),
        )
    }

    /// Opens the subscriber connection and subscribes every channel with waiters, within
    /// the timeout; after a failure, fails at once for [`RECONNECT_PAUSE`].
    async fn connect(&self, link: &mut Link) -> Result<()> {
        self.abandon(link);
        if link
            .failed_at
            .is_some_and(|at| at.elapsed() < RECONNECT_PAUSE)
        {
            return Err(self.gone());
        }
        let opened = tokio::time::timeout(self.timeout, self.open()).await;
        let outcome = match opened {
            Ok(Ok(sink)) => Ok(sink),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(self.timed_out("opening and subscribing")),
        };
        match outcome {
            Ok(sink) => {
                link.failed_at = None;
                link.generation += 1;
                link.sink = Some(sink.0);
                self.live_generation
                    .store(link.generation, Ordering::SeqCst);
                link.reader = Some(self.spawn_reader(sink.1, link.generation));
                if link.generation > 1 {
                    // Made again: a release published while no connection was subscribed
                    // was heard by nobody. Every waiter asleep on this backend (a Redlock
                    // waiter's round does not wait for the background remaking) tries
                    // once more; one being made ready now is armed after this and
                    // unaffected.
                    self.shared.wake_all();
                }
                Ok(())
            }
            Err(e) => {
                link.failed_at = Some(tokio::time::Instant::now());
                Err(e)
            }
        }
    }

    /// A new subscriber connection, subscribed to every channel with waiters.
    async fn open(&self) -> Result<(PubSubSink, redis::aio::PubSubStream)> {
        let pubsub = self
            .client
            .get_async_pubsub()
            .await
            .map_err(|e| backend_error("opening the subscriber connection", &self.target, e))?;
        let (mut sink, stream) = pubsub.split();
        let wanted: Vec<String> = self
            .shared
            .channels()
            .iter()
            .filter(|(_, c)| *c.refs.lock().unwrap_or_else(|e| e.into_inner()) > 0)
            .map(|(name, _)| name.clone())
            .collect();
        if !wanted.is_empty() {
            sink.subscribe(&wanted)
                .await
                .map_err(|e| backend_error("SUBSCRIBE", &self.target, e))?;
        }
        Ok((sink, stream))
    }

    /// Fans the messages of connection `generation` out to the local waiters.
    fn spawn_reader(
        &self,
        mut stream: redis::aio::PubSubStream,
        generation: u64,
    ) -> tokio::task::JoinHandle<()> {
        let shared = self.shared.clone();
        tokio::spawn(async move {
            while let Some(message) = stream.next().await {
                let name = message.get_channel_name();
                let channel = shared.channels().get(name).cloned();
                let payload = message.get_payload_bytes();
                // A keyspace channel says more than deletions (a holder's `expire`, a
                // lockkit grant's `hset`): only a deletion wakes.
                if let Some(channel) = channel
                    && (!is_keyspace_channel(name.as_bytes()) || keyspace_says_gone(payload))
                    && channel.heard(payload, generation)
                {
                    channel.notify.notify_waiters();
                }
            }
            // The connection is gone: wake everyone so they retry and reconnect.
            // An older generation ending later must not hide a newer one's death.
            shared
                .dead_generation
                .fetch_max(generation, Ordering::SeqCst);
            shared.wake_all();
        })
    }

    /// Drops one reference; true when it was the last, and the channel is forgotten.
    fn release_ref(&self, name: &str) -> bool {
        let mut channels = self.shared.channels();
        let Some(channel) = channels.get(name).cloned() else {
            return false;
        };
        let mut refs = channel.refs.lock().unwrap_or_else(|e| e.into_inner());
        *refs = refs.saturating_sub(1);
        if *refs > 0 {
            return false;
        }
        drop(refs);
        channels.remove(name);
        true
    }

    async fn unsubscribe(&self, name: &str) {
        let mut link = self.link.lock().await;
        if !self.release_ref(name) {
            return;
        }
        if let Some(sink) = link.sink.as_mut() {
            match tokio::time::timeout(self.timeout, sink.unsubscribe(name)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, "UNSUBSCRIBE failed; dropping the subscriber connection");
                    self.abandon(&mut link);
                }
                Err(_) => {
                    tracing::debug!(
                        "UNSUBSCRIBE got no answer; dropping the subscriber connection"
                    );
                    self.abandon(&mut link);
                }
            }
        }
    }

    fn is_dead(&self, link: &Link) -> bool {
        link.sink.is_none() || self.shared.dead_generation.load(Ordering::SeqCst) == link.generation
    }

    /// Reconnects (and resubscribes every channel with waiters) if the subscriber
    /// connection died. Cheap when it is alive.
    ///
    /// # Errors
    /// When the server cannot be reached; waiters then fall back to timed retries.
    pub(crate) async fn ensure_connected(&self) -> Result<()> {
        let mut link = self.link.lock().await;
        if self.is_dead(&link) {
            self.connect(&mut link).await?;
        }
        Ok(())
    }

    /// [`Wakeups::ensure_connected`] for a waiter that must not wait on this server (a
    /// Redlock master, of which a minority may be frozen): answers at once whether the
    /// connection is alive. A dead one is made again by a task of its own, which records
    /// its failure (so the next ones fail fast for [`RECONNECT_PAUSE`]); a caller that
    /// waited for it would wait on a frozen server every time, and, dropped at its bound,
    /// would record nothing, so that the next caller waited again.
    ///
    /// # Errors
    /// While the connection is dead (or being made again): the caller counts this
    /// server's messages as unheard for now.
    pub(crate) fn check_connected(self: &Arc<Self>) -> Result<()> {
        let live = self.live_generation.load(Ordering::SeqCst);
        if live != 0 && self.shared.dead_generation.load(Ordering::SeqCst) != live {
            return Ok(());
        }
        // Dead: made again by a task of its own, unless an exchange (maybe that task) is
        // under way.
        if self.link.try_lock().is_err() {
            return Err(self.gone());
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let wakeups = self.clone();
            runtime.spawn(async move {
                // Not for nobody: the waiters may all have gone by now (and the backend
                // with them), and a connection made then would subscribe to nothing.
                if wakeups.shared.channels().is_empty() {
                    return;
                }
                if let Err(error) = wakeups.ensure_connected().await {
                    tracing::debug!(%error, "subscriber connection still down");
                }
            });
        }
        Err(self.gone())
    }

    /// Channels with local subscribers (for leak checks).
    #[cfg(feature = "testing")]
    pub(crate) fn active_channels(&self) -> usize {
        self.shared.channels().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: u64 = crate::wire::NAMED_WAITER_MIN + 7;
    const OTHER: u64 = crate::wire::NAMED_WAITER_MIN + 8;

    fn said(channel: &Channel, payload: &str) -> bool {
        channel.heard(payload.as_bytes(), 1)
    }

    #[test]
    fn a_release_that_names_a_waiter_counts_once_and_only_for_it() {
        let channel = Channel::default();
        let mark = channel.mark();
        assert!(
            said(&channel, &OTHER.to_string()),
            "a name wakes the channel"
        );
        assert!(
            !said(&channel, "0"),
            "the 0 after a name is the same release"
        );
        assert_eq!(channel.turn_since(mark, ME), Turn::Others);
        assert_eq!(channel.turn_since(mark, OTHER), Turn::Try);
        assert!(said(&channel, &ME.to_string()));
        assert!(!said(&channel, "0"));
        assert_eq!(channel.turn_since(mark, ME), Turn::Try);
    }

    #[test]
    fn a_bare_zero_or_a_lost_connection_sends_everyone() {
        let channel = Channel::default();
        let mark = channel.mark();
        assert!(said(&channel, "0"), "a release that names nobody");
        assert_eq!(channel.turn_since(mark, ME), Turn::Try);
        let mark = channel.mark();
        assert!(said(&channel, &OTHER.to_string()));
        channel.open_up();
        assert!(
            said(&channel, "0"),
            "after a reconnection a 0 is not taken for the named release's"
        );
        assert_eq!(channel.turn_since(mark, ME), Turn::Try);
        let mark = channel.mark();
        assert!(said(&channel, "1"), "Redisson's read-unlock message");
        assert_eq!(channel.turn_since(mark, ME), Turn::Try);
    }

    #[test]
    fn a_queued_waiters_grant_ends_the_grace() {
        let channel = Channel::default();
        let mark = channel.mark();
        said(&channel, &OTHER.to_string());
        said(&channel, "0");
        assert_eq!(channel.turn_since(mark, ME), Turn::Others);
        assert!(said(&channel, &format!("-{OTHER}")), "taken");
        assert_eq!(channel.turn_since(mark, ME), Turn::Nothing(None));
        assert_eq!(
            channel.turn_since(mark, OTHER),
            Turn::Try,
            "a wait of the owner that took the key re-enters"
        );
        said(&channel, &OTHER.to_string());
        assert_eq!(channel.turn_since(mark, ME), Turn::Others);
        assert!(!said(&channel, "0"));
        assert!(
            said(&channel, "0"),
            "only the 0 right after a name is swallowed"
        );
        assert_eq!(channel.turn_since(mark, ME), Turn::Try);
    }

    fn lease_message(ms: u64) -> String {
        format!("-{}", crate::wire::TAKEN_LEASE_BASE + ms)
    }

    #[test]
    fn the_lease_after_a_grant_bounds_the_sleep_and_nothing_else() {
        let channel = Channel::default();
        let mark = channel.mark();
        assert!(
            !said(&channel, &lease_message(1_000)),
            "a lease that follows no grant says nothing"
        );
        assert_eq!(channel.turn_since(mark, ME), Turn::Nothing(None));
        said(&channel, &OTHER.to_string());
        said(&channel, "0");
        said(&channel, &format!("-{OTHER}"));
        let before = tokio::time::Instant::now();
        assert!(said(&channel, &lease_message(1_000)), "wakes to re-read");
        let Turn::Nothing(Some(ends)) = channel.turn_since(mark, ME) else {
            panic!("{:?}", channel.turn_since(mark, ME));
        };
        assert!(ends >= before + Duration::from_millis(1_000), "{ends:?}");
        assert!(ends <= tokio::time::Instant::now() + Duration::from_millis(1_001));
        assert_eq!(channel.turn_since(mark, OTHER), Turn::Try);
        // The holder's release names ME; the 0 after it is the same release.
        said(&channel, &ME.to_string());
        assert!(!said(&channel, "0"));
        assert_eq!(channel.turn_since(mark, ME), Turn::Try);
    }

    /// Helper-41's finding: a waiter that heard a queued waiter take the key sleeps until
    /// that grant's lease ends at most, not until the lease it learned before the handoff.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_behind_a_taken_key_wakes_when_its_lease_ends() {
        let channel = Channel::default();
        let woken = armed_for_turn(&channel, ME);
        let started = tokio::time::Instant::now();
        for message in [OTHER.to_string(), "0".into(), format!("-{OTHER}")] {
            if channel.heard(message.as_bytes(), 1) {
                channel.notify.notify_waiters();
            }
        }
        if channel.heard(lease_message(2_000).as_bytes(), 1) {
            channel.notify.notify_waiters();
        }
        woken.await;
        let slept = started.elapsed();
        assert!(
            slept >= Duration::from_millis(2_000) && slept < Duration::from_millis(2_100),
            "{slept:?}"
        );
    }

    #[test]
    fn a_name_from_a_connection_given_up_does_not_swallow_the_next_ones_zero() {
        let channel = Channel::default();
        let mark = channel.mark();
        assert!(channel.heard(OTHER.to_string().as_bytes(), 1));
        assert!(
            channel.heard(b"0", 2),
            "a 0 on the next connection is a release of its own"
        );
        assert_eq!(channel.turn_since(mark, ME), Turn::Try);
    }

    /// Helper-54's review of the round gate: what each thing heard since a waiter's last
    /// round means for a round no message called for.
    #[tokio::test(start_paused = true)]
    async fn the_round_gate_holds_for_a_name_and_skips_after_a_grant() {
        let channel = Channel::default();
        // Nothing heard: the round goes (a stale record on the leader is covered).
        let mark = channel.mark();
        assert_eq!(channel.round_gate(mark, ME), RoundGate::Go);
        // Another waiter named: held until the grace after that release at most.
        said(&channel, &OTHER.to_string());
        said(&channel, "0");
        let named = tokio::time::Instant::now();
        assert_eq!(
            channel.round_gate(mark, ME),
            RoundGate::HoldUntil(named + NAMED_GRACE)
        );
        assert_eq!(
            channel.round_gate(mark, OTHER),
            RoundGate::Go,
            "the named waiter's own round goes"
        );
        tokio::time::advance(NAMED_GRACE).await;
        assert_eq!(
            channel.round_gate(mark, ME),
            RoundGate::Go,
            "a named waiter that never came holds nobody past the grace"
        );
        // Heard taking the key: skipped until its lease (once heard), then it goes.
        said(&channel, &format!("-{OTHER}"));
        assert_eq!(channel.round_gate(mark, ME), RoundGate::Skip(None));
        assert_eq!(
            channel.round_gate(mark, OTHER),
            RoundGate::Go,
            "a wait of the owner that took the key re-enters"
        );
        said(&channel, &lease_message(300));
        let RoundGate::Skip(Some(ends)) = channel.round_gate(mark, ME) else {
            panic!("{:?}", channel.round_gate(mark, ME));
        };
        tokio::time::advance(Duration::from_millis(301)).await;
        assert!(tokio::time::Instant::now() >= ends);
        assert_eq!(channel.round_gate(mark, ME), RoundGate::Go);
        // A skip counts as a round: the same grant never skips two rounds.
        let mark = channel.mark();
        assert_eq!(channel.round_gate(mark, ME), RoundGate::Go);
        // A release naming this waiter, or nobody, or a lost connection: it goes.
        said(&channel, &ME.to_string());
        assert_eq!(channel.round_gate(mark, ME), RoundGate::Go);
        let mark = channel.mark();
        said(&channel, &OTHER.to_string());
        channel.open_up();
        assert_eq!(channel.round_gate(mark, ME), RoundGate::Go);
        let mark = channel.mark();
        said(&channel, &format!("-{OTHER}"));
        said(&channel, "0");
        assert_eq!(channel.round_gate(mark, ME), RoundGate::Go);
    }

    #[test]
    fn a_waiter_that_lost_track_tries() {
        let channel = Channel::default();
        let mark = channel.mark();
        for _ in 0..=EVENTS_KEPT {
            said(&channel, &OTHER.to_string());
            said(&channel, "0");
        }
        assert_eq!(channel.turn_since(mark, ME), Turn::Try);
        let mark = channel.mark();
        said(&channel, &OTHER.to_string());
        assert_eq!(channel.turn_since(mark, ME), Turn::Others);
    }
}

//! `RedlockBackend`: a lock over N independent Redis masters, granted by a majority.

mod foreign;
mod kinds;
mod turns;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use futures_util::{
    StreamExt,
    future::{Either, join_all, select, select_all},
    stream::FuturesUnordered,
};
use lockkit_core::spi::{
    AcquireRequest, Armed, Attempt, Backoff, Grant, Released, WaitPolicy, Wake, armed,
    local_validity, never, wait_for_grant,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LockKind, Result,
};
use tokio::time::Instant;

use self::{foreign::ForeignHolders, turns::LeaderTurns};
use crate::{
    RedisBackend, RedisConfig, Topology,
    conn::{RoundGate, Subscription, armed_for_turn},
    single::{ForgetWriter, MarkShare, QueueTurn, WriterMarker, leave_queue_later, queue_id},
    wire,
};

const BACKEND: &str = "redlock";

/// Redlock over independent masters: a lock is held when a majority (N/2+1) of masters
/// granted it within its lease, and it is valid for `ttl − elapsed − drift`, where the
/// drift allowance is 1% of the lease plus 2 ms (Redlock's suggested factor).
///
/// - A partial acquisition (no quorum, or slower than the lease) is given back on every
///   master; a waiter retries after a random delay of about a millisecond.
/// - Fencing tokens stay monotonic across the quorum: the grant takes the highest counter
///   among the granting masters and writes it back to them, so any later quorum, which
///   shares at least one master with this one, counts past it.
/// - Waiters are woken by release messages from any master. A waiting plain lock's rounds
///   after its first ask the key's leader master alone first (chosen from the key and the
///   masters' addresses, the same in every client that lists the same addresses) and the
///   others once the leader granted, so contenders woken by one release meet at one
///   master instead of splitting the masters between them. There they queue, as on one
///   server: the leader's release of the hold they wait behind names the next waiter, and
///   only that one asks again. After a round that found the key busy, only the masters
///   that answered busy wake the waiter (never its own give-back), or the leader alone
///   when it was one of them and nothing was granted, and a full round follows a busy
///   leader within a second.
///
/// Read-write locks ([`LockKind::Read`], [`LockKind::Write`]) work the same way, with the
/// single server's scripts and Redisson's `RReadWriteLock` layout on each master (a
/// Redisson client on one master sees lockkit's hold there): any two majorities share a
/// master, and there the scripts exclude a writer from every other hold. Reads re-enter, a
/// writer may read (downgrade), and a reader asking to write is refused with
/// [`Error::WouldDeadlock`] once enough masters refuse that no majority could grant it.
/// A waiting writer (or plain lock) registers as waiting on every master where it is
/// busy, which keeps new readers out there: since it lacks a majority, the masters it
/// marked are enough that no new reader can gather one (writer preference). A master that
/// does not answer a writer's round in time is not marked, so while one is slow new readers
/// may still pass; the markers go when the wait ends, on every master.
///
/// Counting semaphores are refused with [`Error::Unsupported`]: a majority quorum cannot
/// bound a count (with 5 masters and N ≥ 2 permits, N+1 holders can each hold a
/// majority). Use `redis://`, `redis+cluster://`, ZooKeeper, etcd or SQL row mode for
/// semaphores, or N plain locks (stripes).
///
/// Redlock's safety rests on clocks and on masters not losing writes: a master restarted
/// without persistence forgets its grants (the documented hazard, shown by `lockkit lab
/// redlock-restart`). Fencing tokens are the defence: a master that lost its counter seeds
/// it from its clock, so the next quorum still counts past every earlier token.
#[derive(Clone)]
pub struct RedlockBackend {
    nodes: Arc<Vec<Master>>,
    config: RedisConfig,
}

/// One master: its configuration and, once it answered, its client. A master that was
/// down when the backend connected is tried again by every operation.
///
/// Its connection is made again once, at once, when it is lost (no retries with backoff:
/// a request waits for that one attempt, and a master that is down then fails at once
/// rather than holding every round for the per-master timeout and every release for
/// longer). A master whose request failed is asked in the background (see
/// [`Master::revive_later`]) until it answers, so that one back is connected again before
/// the next round needs it.
struct Master {
    config: RedisConfig,
    node: tokio::sync::OnceCell<RedisBackend>,
    /// A background task is asking this master until it answers.
    reviving: AtomicBool,
    /// Give-backs still out in the background (see [`RedlockBackend::give_back`]), each
    /// with its acquisition's attempt; the sender side is dropped when it is over.
    giving_back: std::sync::Mutex<Vec<(uuid::Uuid, tokio::sync::watch::Receiver<()>)>>,
}

/// How often a master whose request failed is asked again in the background.
const REVIVE_EVERY: Duration = Duration::from_millis(200);

/// Clears a master's `reviving` mark when its revive task ends (see
/// [`Master::revive_later`]).
struct Unmark {
    nodes: std::sync::Weak<Vec<Master>>,
    index: usize,
}

impl Drop for Unmark {
    fn drop(&mut self) {
        if let Some(nodes) = self.nodes.upgrade()
            && let Some(master) = nodes.get(self.index)
        {
            master.reviving.store(false, Ordering::Release);
        }
    }
}

impl Master {
    fn new(config: RedisConfig) -> Self {
        Master {
            config,
            node: tokio::sync::OnceCell::new(),
            reviving: AtomicBool::new(false),
            giving_back: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Records a give-back of `attempt` out in the background until `over` closes.
    fn giving_back(&self, attempt: uuid::Uuid, over: tokio::sync::watch::Receiver<()>) {
        let mut out = self
            .giving_back
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        out.retain(|(_, over)| over.has_changed().is_ok());
        out.push((attempt, over));
    }

    /// Waits until no give-back of `attempt` is out here any more. A request of the same
    /// attempt sent before one is over could reach the master before it (the give-back
    /// waiting for a connection being made again, or sent again after `NOSCRIPT`), and the
    /// give-back would then take back what that request was granted.
    async fn given_back(&self, attempt: uuid::Uuid) {
        let out: Vec<tokio::sync::watch::Receiver<()>> = self
            .giving_back
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(of, _)| *of == attempt)
            .map(|(_, over)| over.clone())
            .collect();
        for mut over in out {
            // Only ever closed, never sent to.
            let _ = over.changed().await;
        }
    }

    /// After a request to master `index` of `nodes` failed: asks it (`PING`, connecting
    /// first if it never answered) every [`REVIVE_EVERY`] in a task of its own until it
    /// answers (each ask makes its lost connection again) or the backend is dropped. One
    /// such task per master at most.
    fn revive_later(nodes: &Arc<Vec<Master>>, index: usize) {
        let Some(master) = nodes.get(index) else {
            return;
        };
        if master.reviving.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            master.reviving.store(false, Ordering::Release);
            return;
        };
        let nodes = Arc::downgrade(nodes);
        // Dropped with the task however it ends, also unfinished with its runtime (a backend
        // may outlive the runtime it was used on): the master is then not left marked as
        // failing for good, never waited for again (see `RedlockBackend::on_masters`), and
        // its next failed request starts another such task.
        let unmark = Unmark {
            nodes: nodes.clone(),
            index,
        };
        runtime.spawn(async move {
            let _unmark = unmark;
            loop {
                tokio::time::sleep(REVIVE_EVERY).await;
                let Some(nodes) = nodes.upgrade() else {
                    return;
                };
                let Some(master) = nodes.get(index) else {
                    return;
                };
                let timeout = master.config.response_timeout;
                let answered =
                    tokio::time::timeout(timeout, async { master.get().await?.ping().await }).await;
                if matches!(answered, Ok(Ok(()))) {
                    master.reviving.store(false, Ordering::Release);
                    return;
                }
            }
        });
    }

    /// The client, if this master has answered once.
    fn connected(&self) -> Option<&RedisBackend> {
        self.node.get()
    }

    /// The client, connecting first if this master has never answered.
    async fn get(&self) -> Result<RedisBackend> {
        self.node
            .get_or_try_init(|| RedisBackend::connect_as(self.config.clone(), false))
            .await
            .cloned()
    }
}

impl std::fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("masters", &self.nodes.len())
            .field("quorum", &self.quorum())
            .finish()
    }
}

/// A Redlock waiter's wake-ups: release messages from the masters it could subscribe to.
/// After a plain lock's round that found the key busy, only the messages of the masters
/// that answered busy wake it (see [`RedlockBackend::run_acquire`]).
struct MastersMessages<'a> {
    backend: &'a RedlockBackend,
    /// The key's release channels (the mutex's; for read-write locks Redisson's too).
    channels: Vec<String>,
    /// `None` until the first [`Wake::ready`] subscribed; each with its master's index.
    subscriptions: Option<Vec<(usize, Subscription)>>,
    /// Masters (bits by index) whose subscriber connection died and could not be made
    /// again by the last [`Wake::ready`]: a waiter cannot count on their messages.
    deaf: u64,
    /// For a plain lock: the masters (bits by index) whose messages wake the waiter, as
    /// its last round left them; 0 for all. A master that did not answer busy cannot
    /// change that round's answer by a release, and one that granted and was given back
    /// publishes this waiter's own release: their messages would each cost a round per
    /// waiter and release (and a waiter woken by its own give-back spins).
    heeded: Option<Arc<AtomicU64>>,
    /// For a plain lock: the leader master's index and the waiter's id in its queue. The
    /// leader's messages then wake the waiter only when they name it or nobody (see
    /// `conn::armed_for_turn`).
    queued_at_leader: Option<(usize, u64)>,
    /// For a waiter queued at the leader: what its rounds that no message called for heard
    /// on the leader's release channel (see [`LeaderTurns`]); given the channel here.
    leader_turns: Option<Arc<LeaderTurns>>,
    /// For a plain lock: the masters' answers about holders in another format, whose
    /// deletions (heard through keyspace notifications) wake the waiter once enough masters
    /// let go (see [`ForeignHolders`]).
    foreign: Option<Arc<ForeignHolders>>,
    /// The keyspace subscriptions made, each with its master's index.
    keyspace: Vec<(usize, Subscription)>,
    /// Masters (bits by index) that refused a keyspace subscription (an ACL): not asked
    /// again by this wait.
    keyspace_refused: u64,
}

impl MastersMessages<'_> {
    /// Subscribes, on every master whose last answer was a holder in another format and
    /// that sends keyspace notifications, to the key's keyspace channel there (each bounded
    /// by `bound`), and records in each watch whether its master's deletions are heard.
    async fn watch_keyspace(&mut self, bound: Instant) {
        let Some(foreign) = self.foreign.clone() else {
            return;
        };
        let (subscribed, refused, deaf) = (&self.keyspace, self.keyspace_refused, self.deaf);
        let subscribing = self
            .backend
            .nodes
            .iter()
            .enumerate()
            .filter(|(index, _)| {
                let bit = master_bit(*index);
                (refused | deaf) & bit == 0 && !subscribed.iter().any(|(i, _)| i == index)
            })
            .filter_map(|(index, master)| {
                let watch = foreign.made(index)?.clone();
                Some((index, master.connected()?, watch))
            })
            .filter(|(_, _, watch)| watch.wants_keyspace())
            .map(|(index, node, watch)| async move {
                let subscribed = tokio::time::timeout_at(bound, node.subscribe(watch.channel()))
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::backend(
                            BACKEND,
                            true,
                            "keyspace subscription timed out",
                        ))
                    });
                (index, subscribed)
            });
        for (index, subscribed) in join_all(subscribing).await {
            match subscribed {
                Ok(subscription) => self.keyspace.push((index, subscription)),
                Err(error) => {
                    if !error.is_retryable() {
                        self.keyspace_refused |= master_bit(index);
                    }
                    tracing::debug!(%error, master = index, "no keyspace notifications; polling the foreign holder");
                }
            }
        }
        for index in 0..self.backend.nodes.len() {
            if let Some(watch) = foreign.made(index) {
                let heard = self.deaf & master_bit(index) == 0
                    && self.keyspace.iter().any(|(i, _)| *i == index);
                watch.set_heard(heard);
            }
        }
    }

    /// Wakes once the keyspace notifications of enough masters whose last answer was a
    /// holder in another format said the key is gone there (see [`ForeignHolders`]); a
    /// master's message counts if its answer still is that when the message comes.
    fn arm_for_deletions(&self) -> Armed<'_> {
        let Some(foreign) = self.foreign.as_deref() else {
            return never();
        };
        let mut waits: Vec<(usize, Armed<'_>)> = self
            .keyspace
            .iter()
            .map(|(index, s)| (*index, armed(&s.channel.notify)))
            .collect();
        if waits.is_empty() {
            return never();
        }
        Box::pin(async move {
            let mut gone = 0_u64;
            loop {
                if waits.is_empty() {
                    never().await;
                }
                let (mut indices, armed): (Vec<usize>, Vec<Armed<'_>>) = waits.into_iter().unzip();
                let ((), fired, rest) = select_all(armed).await;
                // `select_all` moves the last future into the place of the one that fired.
                let from = indices.swap_remove(fired);
                waits = indices.into_iter().zip(rest).collect();
                if foreign.seen_at(from) {
                    gone |= master_bit(from);
                    if gone.count_ones() as usize >= foreign.needed() {
                        return;
                    }
                }
            }
        })
    }
}

/// A Redlock wait's place in the leader master's waiter queue: left (in the background)
/// when the wait ends without a grant, as the single server's `QueuePlace`, and when it
/// ends with a grant that the leader did not make from the queue: a quorum of the others
/// may grant while the leader answers busy (and queues the waiter), and a place left there
/// would be named at a release while its owner no longer waits, holding the waiters that
/// hear it back for [`crate::conn::NAMED_GRACE`]. Each round keeps the place (in its
/// [`Contended`]) until it has ended, so a wait dropped mid-round leaves the queue after
/// that round's ask to the leader, never before it (the ask would queue it again; it may
/// also connect to the leader first).
struct LeaderQueuePlace {
    backend: RedlockBackend,
    leader: usize,
    queue: String,
    id: u64,
    /// A round was sent: the waiter may be queued at the leader.
    may_be_queued: AtomicBool,
    /// Whether the waiter may be queued at the leader after the last round that ended,
    /// from the leader's answer (set by [`RedlockBackend::run_acquire`]).
    queued: AtomicBool,
    /// The wait ended with a grant.
    granted: AtomicBool,
}

impl Drop for LeaderQueuePlace {
    fn drop(&mut self) {
        let queued = if *self.granted.get_mut() {
            *self.queued.get_mut()
        } else {
            *self.may_be_queued.get_mut()
        };
        if !queued {
            return;
        }
        if let Some(leader) = self
            .backend
            .nodes
            .get(self.leader)
            .and_then(|slot| slot.connected())
        {
            leave_queue_later(leader, std::mem::take(&mut self.queue), self.id);
        }
    }
}

/// Sends `request` now and lets it finish in the background, within `timeout`: its first
/// poll, here, puts a Redis command on its connection when the connection is up, ahead of
/// this client's later commands there (not while the connection is being made again, nor
/// a script sent again after `NOSCRIPT`: see [`Master::given_back`]).
fn send_then_detach(
    request: impl std::future::Future<Output = ()> + Send + 'static,
    timeout: Duration,
) {
    let mut request = Box::pin(async move {
        let _ = tokio::time::timeout(timeout, request).await;
    });
    let mut context = std::task::Context::from_waker(futures_util::task::noop_waker_ref());
    if request.as_mut().poll(&mut context).is_pending()
        && let Ok(runtime) = tokio::runtime::Handle::try_current()
    {
        runtime.spawn(request);
    }
}

/// A master's answer that did not come within `timeout`.
fn unanswered(timeout: Duration) -> Error {
    Error::backend(
        BACKEND,
        true,
        format!("a master did not answer within {timeout:?}"),
    )
}

/// The bit of master `index` in a mask of masters; none past the 64th.
fn master_bit(index: usize) -> u64 {
    u32::try_from(index)
        .ok()
        .and_then(|index| 1_u64.checked_shl(index))
        .unwrap_or(0)
}

#[async_trait]
impl Wake for MastersMessages<'_> {
    /// Subscribes on every master at once, each bounded by the response timeout (at most
    /// 500 ms): a frozen master (a minority Redlock tolerates) must not hold the waiter or
    /// the subscriptions on the others up; without its messages the waiter still polls.
    /// Later calls count the masters whose subscriber connection died as deaf, at once,
    /// and have it made again (resubscribing) in the background: deaf until a later call
    /// finds it alive.
    async fn ready(&mut self) -> bool {
        let backend = self.backend;
        let bound = Instant::now()
            + backend
                .config
                .response_timeout
                .min(Duration::from_millis(500));
        if let Some(subscriptions) = &self.subscriptions {
            // One subscriber connection per master, whatever the channels; a master heard
            // only through its keyspace channel (its release channel's subscription failed
            // when the wait began) is made again and counted deaf as well.
            let mut masters: Vec<(usize, &Subscription)> = Vec::new();
            for (index, subscription) in subscriptions.iter().chain(&self.keyspace) {
                if !masters.iter().any(|(seen, _)| seen == index) {
                    masters.push((*index, subscription));
                }
            }
            // Without waiting: a master frozen while its connection is made again (or while
            // a subscription there waits for its answer) would hold every wake-up back by
            // the bound. A dead connection is made again in the background.
            self.deaf = masters
                .into_iter()
                .filter(|(_, subscription)| subscription.check_connected().is_err())
                .fold(0, |deaf, (index, _)| deaf | master_bit(index));
        } else {
            let channels = &self.channels;
            let subscribing = backend
                .nodes
                .iter()
                .enumerate()
                .filter_map(|(index, master)| Some((index, master.connected()?)))
                .flat_map(|(index, node)| {
                    channels.iter().map(move |channel| (index, node, channel))
                })
                .map(|(index, node, channel)| async move {
                    let subscribed = tokio::time::timeout_at(bound, node.subscribe(channel)).await;
                    Some((index, subscribed.ok()?.ok()?))
                });
            let subscribed: Vec<(usize, Subscription)> =
                join_all(subscribing).await.into_iter().flatten().collect();
            if let (Some(turns), Some((leader, _)), Some(mutex_channel)) = (
                &self.leader_turns,
                self.queued_at_leader,
                self.channels.first(),
            ) && let Some((_, subscription)) = subscribed
                .iter()
                .find(|(index, s)| *index == leader && s.name() == mutex_channel)
            {
                turns.listen(subscription.channel.clone());
            }
            self.subscriptions = Some(subscribed);
        }
        self.watch_keyspace(bound).await;
        self.subscriptions.as_ref().is_some_and(|s| !s.is_empty())
    }

    /// Any master's message wakes the waiter, except that after a plain lock's round that
    /// found the key busy (the mask is read when a message comes, so after the round armed
    /// here) only the masters that answered busy do, as long as the waiter hears them all
    /// (else every message wakes it). Deletions heard on masters held in another format
    /// wake it too (see [`MastersMessages::arm_for_deletions`]).
    fn arm(&self) -> Armed<'_> {
        let releases = self.arm_for_releases();
        if self.keyspace.is_empty() {
            return releases;
        }
        let deletions = self.arm_for_deletions();
        Box::pin(async move {
            select(releases, deletions).await;
        })
    }
}

impl MastersMessages<'_> {
    /// [`Wake::arm`] for the key's release channels.
    fn arm_for_releases(&self) -> Armed<'_> {
        match self.subscriptions.as_deref() {
            Some(subscriptions) if !subscriptions.is_empty() => {
                let mut armed: Vec<(usize, Armed<'_>)> = subscriptions
                    .iter()
                    .map(|(index, s)| match self.queued_at_leader {
                        Some((leader, me)) if leader == *index => {
                            (*index, armed_for_turn(&s.channel, me))
                        }
                        _ => (*index, armed(&s.channel.notify)),
                    })
                    .collect();
                let heard = subscriptions
                    .iter()
                    .fold(0, |heard, (index, _)| heard | master_bit(*index))
                    & !self.deaf;
                let heeded = self.heeded.as_deref();
                Box::pin(async move {
                    loop {
                        if armed.is_empty() {
                            never().await;
                        }
                        let (indices, waits): (Vec<usize>, Vec<Armed<'_>>) =
                            armed.into_iter().unzip();
                        let ((), fired, rest) = select_all(waits).await;
                        let mask = heeded.map_or(0, |h| h.load(Ordering::Acquire));
                        let wakes = mask == 0
                            || mask & !heard != 0
                            || indices
                                .get(fired)
                                .is_none_or(|from| mask & master_bit(*from) != 0);
                        if wakes {
                            return;
                        }
                        // `select_all` hands the rest back with the last future moved
                        // into the place of the one that fired (`swap_remove`): the
                        // indices must move the same way, or a master's message would
                        // count as another's.
                        let mut indices = indices;
                        indices.swap_remove(fired);
                        armed = indices.into_iter().zip(rest).collect();
                    }
                })
            }
            _ => never(),
        }
    }
}

/// How far ahead of this client's clock a round's proposed token is: enough that it stays
/// ahead of each master's own clock while the round's request reaches it, so that a
/// quorum's masters answer one same token; half the [`wire::PROPOSAL_AHEAD_AT_MOST`] a
/// master accepts, which leaves room for master clocks up to 10 ms apart from this one.
const PROPOSAL_LEAD: Duration = Duration::from_millis(10);
const _: () = assert!(PROPOSAL_LEAD.as_micros() < wire::PROPOSAL_AHEAD_AT_MOST.as_micros());

/// The token a Redlock round proposes to every master: this client's clock in microseconds
/// since the epoch, plus [`PROPOSAL_LEAD`]. It only ever raises a master's counter, and a
/// master takes it only while it is at most [`wire::PROPOSAL_AHEAD_AT_MOST`] ahead of its
/// own clock. So a plain lock's token may be up to that much (plus the masters' clock skew)
/// ahead of the clocks of the masters that gave it, where before proposals it was at most
/// the fastest one's clock: a majority of masters wiped (restarted without persistence, or
/// replaced by replicas behind) within those 20 ms could count from their clocks to a
/// smaller token. Redlock already asks a master restarted empty to stay away for a lease
/// (its locks are lost too), which is far longer. A master whose counter or clock is ahead
/// of the proposal, or that refuses it, answers another token, and the round then writes
/// the highest back (as it always did).
fn proposed_token() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        + PROPOSAL_LEAD;
    u64::try_from(now.as_micros()).unwrap_or(u64::MAX)
}

/// A plain lock's round within a wait (see [`RedlockBackend::run_acquire`]).
struct Contended {
    /// Ask the key's leader master alone first.
    leader_first: bool,
    /// Set by the round: the masters (bits by index) that answered busy, if it found the
    /// key busy; else 0 (see [`MastersMessages::heeded`]).
    busy_masters: Arc<AtomicU64>,
    /// The waiter's place in the leader master's waiter queue (see `wire::queue_of`): a
    /// busy leader queues it, and the release of the hold it waits behind names it there.
    /// The other masters are asked without one.
    turn: QueueTurn,
    /// What each master's answer says of a holder in another format, for the wait's
    /// wake-ups (see [`ForeignHolders`]).
    foreign: Arc<ForeignHolders>,
    /// The wait's place there; the round records in it, from the leader's answer, whether
    /// the waiter may be queued there after the round, and keeps it until the round ends.
    place: Arc<LeaderQueuePlace>,
}

/// What a round not made answers (see [`LeaderTurns`]): busy, until the lease of the queued
/// waiter that took the key ends (`lease_end`; `None`: not heard), within the next full
/// round's time.
fn skipped_round(lease_end: Option<Instant>) -> Attempt {
    let lease_left = lease_end.map_or(FULL_ROUND_EVERY, |end| {
        end.saturating_duration_since(Instant::now())
            .min(FULL_ROUND_EVERY)
    });
    Attempt::Busy {
        lease_left: Some(lease_left),
    }
}

/// How often at least a waiting plain lock asks every master rather than the leader alone:
/// a leader that still has the record of a hold nobody keeps (a contender that died between
/// the leader's grant and giving it back) keeps answering busy until that record's lease
/// ends, while a quorum of the others may be free.
const FULL_ROUND_EVERY: Duration = Duration::from_secs(1);

/// The mean delay before the next round of a wait after a round that was granted somewhere
/// but not by a quorum (Redlock's random retry delay), uniform in half to one and a half
/// of it.
const SPLIT_RETRY_AFTER: Duration = Duration::from_millis(1);

/// What one master said to an acquire attempt.
enum Vote {
    Granted(Grant),
    Busy(Option<Duration>),
    /// The master could not be asked, or did not answer in time.
    Failed(Error),
    /// The master answered that it never grants this as asked (an upgrade, a key used as
    /// another kind): decisive once no majority is left without such masters.
    Refused(Error),
}

impl From<Result<Attempt>> for Vote {
    fn from(answer: Result<Attempt>) -> Self {
        match answer {
            Ok(Attempt::Granted(grant)) => Vote::Granted(grant),
            Ok(Attempt::Busy { lease_left }) => Vote::Busy(lease_left),
            Err(e) if refusal(&e) => Vote::Refused(e),
            Err(e) => Vote::Failed(e),
        }
    }
}

/// Whether a master's answer to an acquire attempt is a [`Vote::Refused`].
fn refusal(e: &Error) -> bool {
    matches!(
        e,
        Error::WouldDeadlock { .. } | Error::KindMismatch { .. } | Error::Unsupported { .. }
    )
}

/// The index of the master of `masters` (node URLs) whose address scores highest for
/// `key`.
fn leader_among(key: &str, masters: &[String]) -> usize {
    masters
        .iter()
        .enumerate()
        .max_by_key(|(_, url)| leader_score(key, &master_address(url)))
        .map_or(0, |(index, _)| index)
}

/// The `host:port` of a node URL, lower-cased, without scheme, user, password, database or
/// options: clients that reach a master with other credentials (an ACL user each, a
/// password being rotated) or another database still pick the same leader. Clients that
/// name one master differently (`localhost`, `127.0.0.1`) may not: that costs speed only.
fn master_address(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    host_port.to_ascii_lowercase()
}

/// The holds left after a release, as the masters that released report them: the count a
/// quorum of them reports at least (a stray copy on a minority, such as a re-entry's
/// give-back that never landed, does not make a quorum's full release read partial); the
/// highest any reports when fewer than a quorum answered.
fn agreed_remaining(released: &[Released], quorum: usize) -> u32 {
    let mut counts: Vec<u32> = released
        .iter()
        .map(|r| match r {
            Released::Fully => 0,
            Released::Partially { remaining } => *remaining,
        })
        .collect();
    counts.sort_unstable_by(|a, b| b.cmp(a));
    match counts.get(quorum.saturating_sub(1)) {
        Some(agreed) => *agreed,
        None => counts.first().copied().unwrap_or(0),
    }
}

/// Whether the answers still out (`missing`) can no longer change what
/// [`agreed_remaining`] makes of `released` (the answers in): the holds a quorum reports
/// can only rise, and only when the answers above them now, with every missing one, would
/// make a quorum. A re-entry granted afresh where the outer hold had lapsed answers none
/// left there while the quorum that holds the outer hold answers one: a release that
/// stopped waiting for one of that quorum would read fully released, and the outer guard
/// would be told lost.
fn holds_left_decided(released: &[Released], missing: usize, quorum: usize) -> bool {
    let left = |r: &Released| match r {
        Released::Fully => 0,
        Released::Partially { remaining } => *remaining,
    };
    let agreed = agreed_remaining(released, quorum);
    released.iter().filter(|r| left(r) > agreed).count() + missing < quorum
}

/// Refuses a list of masters (node URLs) that names one master twice (by `host:port`,
/// whatever the credentials, database or letter case): it would count twice towards the
/// quorum, so that master alone could grant while another client, listing each master once,
/// is granted by the others. One IP address written two ways is one master (see
/// [`one_spelling`]); names that differ but reach one server (`localhost` and `127.0.0.1`,
/// two DNS names) cannot be told apart here.
///
/// # Errors
/// [`Error::Config`] naming the master listed twice.
fn refuse_masters_listed_twice(masters: &[String]) -> Result<()> {
    let addresses: Vec<String> = masters
        .iter()
        .map(|url| one_spelling(&master_address(url)))
        .collect();
    for (i, address) in addresses.iter().enumerate() {
        if addresses[..i].contains(address) {
            return Err(Error::Config(format!(
                "the Redlock masters list `{address}` twice: each must be a server of its own \
                 (one listed twice counts twice towards the quorum, and could grant alone)"
            )));
        }
    }
    Ok(())
}

/// `address` (a [`master_address`]) with an IP address in one spelling of each: `[0::1]`
/// and `[::1]` are one master, as are an IPv4 address and its IPv4-mapped IPv6 form. Host
/// names are left as they are.
fn one_spelling(address: &str) -> String {
    let Some((host, port)) = address.rsplit_once(':') else {
        return address.to_owned();
    };
    let ip = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    match (ip.parse::<std::net::IpAddr>(), port.parse::<u16>()) {
        (Ok(ip), Ok(port)) => std::net::SocketAddr::new(ip.to_canonical(), port).to_string(),
        _ => address.to_owned(),
    }
}

/// A score of `address` for `key` (FNV-1a, then a SplitMix64 finish): stable across
/// processes, platforms and releases, unlike the standard library's hasher.
fn leader_score(key: &str, address: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key.bytes().chain([0xff]).chain(address.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

impl RedlockBackend {
    /// Connects to the masters of a `redlock://h1,h2,h3,...` URL. A quorum must answer;
    /// masters that are down are tried again by every operation (within the per-master
    /// timeout), so one that comes back counts again.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL; [`Error::Backend`] when fewer than a quorum of
    /// masters answer.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::from_config(RedisConfig::parse(url)?).await
    }

    /// Connects as `config` says.
    ///
    /// # Errors
    /// [`Error::Config`] unless `config` is a Redlock topology; [`Error::Backend`] when
    /// fewer than a quorum of masters can be reached.
    pub async fn from_config(config: RedisConfig) -> Result<Self> {
        let Topology::Redlock(masters) = &config.topology else {
            return Err(Error::Config(
                "RedlockBackend needs a redlock://h1,h2,h3,... URL".into(),
            ));
        };
        refuse_masters_listed_twice(masters)?;
        let quorum = masters.len() / 2 + 1;
        let nodes: Vec<Master> = masters
            .iter()
            .map(|url| {
                let mut node = config.clone();
                node.topology = Topology::Single(url.clone());
                Master::new(node)
            })
            .collect();
        let connecting = nodes.iter().map(Master::get);
        let mut up = 0;
        let mut down = Vec::new();
        for (url, node) in masters.iter().zip(join_all(connecting).await) {
            match node {
                Ok(_) => up += 1,
                Err(e) => down.push(format!("{url}: {e}")),
            }
        }
        if up < quorum {
            return Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "only {up} of {} masters answered; Redlock needs a quorum of {quorum}: {}",
                    masters.len(),
                    down.join("; ")
                ),
            ));
        }
        if !down.is_empty() {
            tracing::warn!(down = ?down, "some Redlock masters are down; continuing with a quorum");
        }
        Ok(RedlockBackend {
            nodes: Arc::new(nodes),
            config,
        })
    }

    /// The Redis names of `key` on every master.
    fn names(&self, key: &LockKey) -> Result<wire::LockNames> {
        wire::LockNames::new(&self.config.prefix, key, false)
    }

    /// Masters needed for a grant.
    pub fn quorum(&self) -> usize {
        self.master_count() / 2 + 1
    }

    fn master_count(&self) -> usize {
        match &self.config.topology {
            Topology::Redlock(masters) => masters.len(),
            _ => self.nodes.len(),
        }
    }

    /// The per-master timeout of one round: small against the lease, as Redlock asks, so
    /// a dead master costs little of it (a twentieth of the lease, 10..=100 ms).
    fn node_timeout(&self, ttl: Duration) -> Duration {
        self.config.node_timeout.unwrap_or_else(|| {
            (ttl / 20).clamp(Duration::from_millis(10), Duration::from_millis(100))
        })
    }

    /// Runs `op` on every master at once, each bounded by `timeout`, for a caller that needs
    /// a quorum of answers and nothing else from them (a health check): a master whose last
    /// request failed is waited for while the answers in hand are short of a quorum that
    /// the answers still out could complete (with the others down, a bare quorum that
    /// answers would otherwise read as too few while its mark lasts).
    async fn on_all<T, F, Fut>(&self, timeout: Duration, op: F) -> Vec<Result<T>>
    where
        F: Fn(RedisBackend) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let quorum = self.quorum();
        let settled = |answers: &[Option<Result<T>>]| {
            let answered = answers.iter().filter(|a| matches!(a, Some(Ok(_)))).count();
            let out = answers.iter().filter(|a| a.is_none()).count();
            answered >= quorum || answered + out < quorum
        };
        self.on_masters(timeout, |_| true, |_, node| op(node), settled)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Runs `op` at once on every master whose index `which` picks, each bounded by
    /// `timeout`; one entry per master, `None` for those not picked. A master whose last
    /// request failed and that has not answered since (see [`Master::revive_later`]) is
    /// asked too, but not waited for once every other master picked answered: its answer
    /// is then an error (a frozen master would otherwise cost every round the whole
    /// `timeout`). With no other master picked, it is waited for, and so it is while
    /// `settled` says the answers in hand do not decide (see [`RedlockBackend::run_acquire`]
    /// and [`LockBackend::renew`]).
    async fn on_masters<T, F, Fut>(
        &self,
        timeout: Duration,
        which: impl Fn(usize) -> bool,
        op: F,
        settled: impl Fn(&[Option<Result<T>>]) -> bool,
    ) -> Vec<Option<Result<T>>>
    where
        F: Fn(usize, RedisBackend) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let op = &op;
        let picked: Vec<usize> = (0..self.nodes.len()).filter(|i| which(*i)).collect();
        let was_failing = self.failing_masters();
        let mut healthy_left = picked
            .iter()
            .filter(|i| !was_failing.get(**i).copied().unwrap_or(false))
            .count();
        let wait_for_all = healthy_left == 0;
        let mut calls: FuturesUnordered<_> = picked
            .iter()
            .filter_map(|index| Some((*index, self.nodes.get(*index)?)))
            .map(|(index, master)| async move {
                let call = async { op(index, master.get().await?).await };
                let answer = tokio::time::timeout(timeout, call)
                    .await
                    .unwrap_or_else(|_| Err(unanswered(timeout)));
                if answer.as_ref().is_err_and(Error::is_retryable) {
                    Master::revive_later(&self.nodes, index);
                }
                (index, answer)
            })
            .collect();
        let mut answers: Vec<Option<Result<T>>> = (0..self.nodes.len()).map(|_| None).collect();
        while let Some((index, answer)) = calls.next().await {
            if !was_failing.get(index).copied().unwrap_or(false) {
                healthy_left = healthy_left.saturating_sub(1);
            }
            if let Some(slot) = answers.get_mut(index) {
                *slot = Some(answer);
            }
            if !wait_for_all && healthy_left == 0 && settled(&answers) {
                break;
            }
        }
        for index in picked {
            if let Some(slot @ None) = answers.get_mut(index) {
                *slot = Some(Err(Error::backend(
                    BACKEND,
                    true,
                    "a master whose last request failed was not waited for once the others answered",
                )));
            }
        }
        answers
    }

    /// Whether each master's last request failed and it has not answered since.
    fn failing_masters(&self) -> Vec<bool> {
        self.nodes
            .iter()
            .map(|master| master.reviving.load(Ordering::Acquire))
            .collect()
    }

    /// Releases `grant` on every master, each within the response timeout: once a quorum
    /// released and the answers still out cannot change the holds left (see
    /// [`holds_left_decided`]), the others are waited for a per-master timeout (see
    /// [`Self::node_timeout`]) more at most (a master whose last request failed and that
    /// has not answered since, not at all), and those still out finish in a task of their
    /// own (a frozen master would otherwise hold every release for the whole response
    /// timeout, though a quorum's answers already decide it). The answers, in the masters'
    /// order; an error for each master not waited for.
    async fn release_on_masters(&self, grant: &Grant) -> Vec<Result<Released>> {
        type Answer = std::pin::Pin<
            Box<dyn std::future::Future<Output = (usize, Result<Released>)> + Send + 'static>,
        >;
        let timeout = self.config.response_timeout;
        let mut pending: FuturesUnordered<Answer> = (0..self.nodes.len())
            .map(|index| {
                let (nodes, grant) = (self.nodes.clone(), grant.clone());
                Box::pin(async move {
                    let release = async {
                        let master = nodes
                            .get(index)
                            .ok_or_else(|| Error::backend(BACKEND, false, "no such master"))?;
                        master.get().await?.release(&grant).await
                    };
                    let answer = tokio::time::timeout(timeout, release)
                        .await
                        .unwrap_or_else(|_| Err(unanswered(timeout)));
                    if answer.as_ref().is_err_and(Error::is_retryable) {
                        Master::revive_later(&nodes, index);
                    }
                    (index, answer)
                }) as Answer
            })
            .collect();
        let mut answers: Vec<Option<Result<Released>>> =
            (0..self.nodes.len()).map(|_| None).collect();
        let mut until = Instant::now() + timeout;
        let mut quorum_released = false;
        let was_failing = self.failing_masters();
        while let Ok(Some((index, answer))) = tokio::time::timeout_at(until, pending.next()).await {
            if let Some(slot) = answers.get_mut(index) {
                *slot = Some(answer);
            }
            let released: Vec<Released> = answers
                .iter()
                .filter_map(|a| match a {
                    Some(Ok(released)) => Some(*released),
                    _ => None,
                })
                .collect();
            let missing = answers.iter().filter(|a| a.is_none()).count();
            if !quorum_released
                && released.len() >= self.quorum()
                && holds_left_decided(&released, missing, self.quorum())
            {
                quorum_released = true;
                until = until.min(Instant::now() + self.node_timeout(grant.ttl));
            }
            // Past a quorum, a master whose last request failed is not waited for.
            let healthy_out = answers
                .iter()
                .zip(&was_failing)
                .any(|(answer, failing)| answer.is_none() && !failing);
            if quorum_released && !healthy_out {
                break;
            }
        }
        if !pending.is_empty()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move { while pending.next().await.is_some() {} });
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| Err(unanswered(timeout))))
            .collect()
    }

    /// The index (in the URL's order) of the master that waiting plain locks of `key` ask
    /// first; for tests.
    #[doc(hidden)]
    pub fn leader_master(&self, key: &LockKey) -> usize {
        self.leader_of(key)
    }

    /// The master a contended round of a plain lock asks first (see [`Self::run_acquire`]):
    /// the one whose address scores highest hashed with the key (rendezvous hashing), so
    /// that every client listing the same masters, in any order, picks the same one, and
    /// keys spread over all masters.
    fn leader_of(&self, key: &LockKey) -> usize {
        match &self.config.topology {
            Topology::Redlock(masters) => leader_among(key.as_str(), masters),
            _ => 0,
        }
    }

    /// One Redlock round: ask every master, then keep the grant only if a quorum agreed
    /// within the lease; otherwise give back what was granted. With `marker`, a writer or
    /// plain lock registers as waiting on the masters where it is busy. Also answers
    /// whether every master granted (then none keeps a marker of this owner: a grant
    /// removes it).
    ///
    /// With `leader_first` (a plain lock's round after its wait found the key busy), the
    /// round asks the key's leader master ([`Self::leader_of`]) alone first, and the others
    /// only once the leader granted. Contenders woken by one release then meet at one
    /// master, where one of them wins, instead of splitting the masters between them and
    /// giving their shares back (each give-back a release message that wakes them all
    /// again). A busy leader ends the round as busy. A leader that fails or refuses has the
    /// others asked as in a plain round, so a leader that is down costs one per-master
    /// timeout, never the grant. Safety is the plain round's: the grant needs a quorum
    /// within the lease counted from before the leader was asked.
    async fn run_acquire(
        &self,
        req: &AcquireRequest,
        marker: bool,
        contended: Option<&Contended>,
    ) -> (Result<Attempt>, bool) {
        let start = Instant::now();
        let proposed = proposed_token();
        let timeout = self.node_timeout(req.ttl);
        let leader = self.leader_of(&req.key);
        let turn = contended
            .filter(|_| req.kind == LockKind::Exclusive && self.nodes.len() > 1)
            .map(|contended| contended.turn.clone());
        let foreign = contended
            .filter(|_| req.kind == LockKind::Exclusive)
            .map(|contended| &contended.foreign);
        let ask = |index: usize, node: RedisBackend| {
            let req = req.clone();
            let turn = turn.clone().filter(|_| index == leader);
            let watch = foreign.and_then(|foreign| foreign.watch(index, &node));
            let nodes = self.nodes.clone();
            async move {
                // An earlier round's give-back of this attempt still out at this master goes
                // first (within this round's per-master timeout).
                if let Some(master) = nodes.get(index) {
                    master.given_back(req.attempt).await;
                }
                node.run_acquire_marking(&req, None, marker, Some(proposed), turn, watch.as_deref())
                    .await
            }
        };
        let mut votes: Vec<Option<Vote>> = vec![];
        if let Some(contended) = contended {
            contended.busy_masters.store(0, Ordering::Release);
            if contended.leader_first && req.kind == LockKind::Exclusive && self.nodes.len() > 1 {
                votes = self
                    .on_masters(timeout, |index| index == leader, ask, |_| true)
                    .await
                    .into_iter()
                    .map(|answer| answer.map(Vote::from))
                    .collect();
                // A leader held in another format (rslock's Redlock, whose holds no lockkit
                // waiter queues behind) may be one of a minority still held: once the
                // masters' deletions wake the waiter (only when a quorum let go), the
                // others are asked as in a plain round. A waiter that polls such a holder
                // asks the leader alone, as before.
                let woken_by_deletions = contended.foreign.hears_at(leader);
                if let Some(Some(Vote::Busy(lease_left))) = votes.get(leader)
                    && !woken_by_deletions
                {
                    contended.place.queued.store(true, Ordering::Release);
                    contended
                        .busy_masters
                        .store(master_bit(leader), Ordering::Release);
                    // Woken by then for the next full round (see `FULL_ROUND_EVERY`).
                    let lease_left =
                        lease_left.map_or(FULL_ROUND_EVERY, |left| left.min(FULL_ROUND_EVERY));
                    return (
                        Ok(Attempt::Busy {
                            lease_left: contended.foreign.pace(Some(lease_left)),
                        }),
                        false,
                    );
                }
            }
        }
        let asked: Vec<bool> = votes.iter().map(Option::is_some).collect();
        // A master whose last request failed is left out only from a round the answers in
        // hand leave short of a quorum for good, and only once they decide which way (busy,
        // refused, failed; see `Self::decide`). A round that is or may be granted waits for
        // it (within the per-master timeout), since its answer can change what the grant
        // is: its grant may carry a higher token (two tasks of one owner racing for a key
        // each take some masters first, and each must end with the highest token of all,
        // or the owner holds the key under two tokens: the randomized history test found
        // that once in a CI run and once in 20 runs under load), or a re-entry's answer
        // that makes it a continuation; and a key whose quorum needs that master (the
        // others down) would be refused while its mark lasts.
        let quorum = self.quorum();
        let granted_before = votes
            .iter()
            .filter(|v| matches!(v, Some(Vote::Granted(_))))
            .count();
        let refused_before = votes
            .iter()
            .filter(|v| matches!(v, Some(Vote::Refused(_))))
            .count();
        let failed_before = votes
            .iter()
            .filter(|v| matches!(v, Some(Vote::Failed(_))))
            .count();
        let masters = self.master_count();
        let settled = |answers: &[Option<Result<Attempt>>]| {
            let granted = granted_before
                + answers
                    .iter()
                    .filter(|a| matches!(a, Some(Ok(Attempt::Granted(_)))))
                    .count();
            let out = answers
                .iter()
                .enumerate()
                .filter(|(index, a)| a.is_none() && !asked.get(*index).copied().unwrap_or(false))
                .count();
            // Short of a quorum for good, the round is refused, failed or busy (see
            // `Self::decide`), and a master not waited for counts as failed: the answers
            // still out must not be able to change which (a busy key would read as too few
            // masters answering, an upgrade that a quorum refuses as one to wait for).
            granted + out < quorum && {
                let refused = refused_before
                    + answers
                        .iter()
                        .filter(|a| matches!(a, Some(Err(e)) if refusal(e)))
                        .count();
                let failed = failed_before
                    + answers
                        .iter()
                        .filter(|a| matches!(a, Some(Err(e)) if !refusal(e)))
                        .count();
                refused > masters.saturating_sub(quorum)
                    || (refused + out <= masters.saturating_sub(quorum)
                        && masters.saturating_sub(failed + out) >= quorum)
            }
        };
        let rest = self
            .on_masters(
                timeout,
                |index| !asked.get(index).copied().unwrap_or(false),
                ask,
                settled,
            )
            .await;
        let votes: Vec<Vote> = rest
            .into_iter()
            .enumerate()
            .map(|(index, answer)| match answer {
                Some(answer) => Vote::from(answer),
                None => votes
                    .get_mut(index)
                    .and_then(Option::take)
                    .unwrap_or_else(|| Vote::Failed(Error::backend(BACKEND, true, "not asked"))),
            })
            .collect();
        if let Some(contended) = contended {
            for (index, vote) in votes.iter().enumerate() {
                if matches!(vote, Vote::Failed(_)) {
                    contended.foreign.unanswered(index);
                }
            }
        }
        if let (Some(contended), Some(turn), Some(vote)) =
            (contended, turn.as_ref(), votes.get(leader))
        {
            match vote {
                // Queued (or kept its place) behind the hold it found.
                Vote::Busy(_) => contended.place.queued.store(true, Ordering::Release),
                // A grant that was told the waiter may be queued left the queue (in the
                // script); a first round's grant finds it not queued.
                Vote::Granted(_) if turn.may_be_queued => {
                    contended.place.queued.store(false, Ordering::Release);
                }
                // Refused before the script queued anyone (a key of another kind).
                Vote::Granted(_) | Vote::Refused(_) => {}
                // The script may have run (a lost reply): it may be queued.
                Vote::Failed(_) => contended.place.queued.store(true, Ordering::Release),
            }
        }
        let everywhere = votes.iter().all(|v| matches!(v, Vote::Granted(_)));
        let granted_by = votes
            .iter()
            .filter(|v| matches!(v, Vote::Granted(_)))
            .count();
        let some_granted = granted_by > 0;
        // Busy masters whose holder publishes its release (not one in another format).
        let published_by = contended.map_or(0, |contended| {
            votes
                .iter()
                .enumerate()
                .filter(|(index, v)| {
                    matches!(v, Vote::Busy(_)) && !contended.foreign.seen_at(*index)
                })
                .count()
        });
        let busy_masters = if self.nodes.len() <= 64 {
            votes
                .iter()
                .enumerate()
                .filter(|(_, v)| matches!(v, Vote::Busy(_)))
                .fold(0, |mask, (index, _)| mask | master_bit(index))
        } else {
            0
        };
        let mut outcome = self.decide(req, start, votes).await;

        if let Some(contended) = contended
            && let Ok(Attempt::Busy { lease_left }) = &mut outcome
        {
            let leader_bit = master_bit(leader);
            let queued_at_leader =
                turn.is_some() && !some_granted && busy_masters & leader_bit != 0;
            if queued_at_leader {
                // Queued at the leader behind the hold it found: the leader's release names
                // the next waiter, and the other masters' messages would only wake every
                // waiter at once (as after a leader-first round). A stale record on the
                // leader is covered by the next full round, within a second.
                contended.busy_masters.store(leader_bit, Ordering::Release);
                *lease_left =
                    Some(lease_left.map_or(FULL_ROUND_EVERY, |left| left.min(FULL_ROUND_EVERY)));
            } else {
                contended
                    .busy_masters
                    .store(busy_masters, Ordering::Release);
            }
            // The busy masters whose holders publish their releases are heard, unless only
            // the leader's messages wake the waiter and the leader is held in another
            // format (it names nobody when it lets go).
            let published = if queued_at_leader && contended.foreign.seen_at(leader) {
                0
            } else {
                published_by
            };
            contended
                .foreign
                .round_granted(granted_by, published, self.quorum());
            *lease_left = contended.foreign.pace(*lease_left);
            if some_granted {
                // Split, or a quorum held without a master that granted: what was granted
                // was given back. Redlock's random delay keeps contenders from meeting in
                // step again; the masters that granted do not wake this waiter (their
                // messages are its own releases).
                let delay = SPLIT_RETRY_AFTER.mul_f64(0.5 + fastrand::f64());
                tokio::time::sleep(delay).await;
            }
        }
        (outcome, everywhere)
    }

    /// Decides a round sent at `start` from the masters' votes (see [`Self::run_acquire`]).
    async fn decide(
        &self,
        req: &AcquireRequest,
        start: Instant,
        votes: Vec<Vote>,
    ) -> Result<Attempt> {
        let granted: Vec<&Grant> = votes
            .iter()
            .filter_map(|v| match v {
                Vote::Granted(g) => Some(g),
                _ => None,
            })
            .collect();
        let quorum = self.quorum();
        let elapsed = start.elapsed();
        let valid = local_validity(req.ttl).saturating_sub(elapsed);
        if granted.len() >= quorum && !valid.is_zero() {
            // A quorum that already had this owner's hold (depth above 1 there) held it
            // throughout, so no other owner can have had a quorum since: a continuation,
            // which keeps the hold's token (masters where the owner's hold had lapsed
            // count past it, and the next holder gets more than either). Otherwise a new
            // hold: the highest counter of the quorum.
            let continuing: Vec<&&Grant> = granted.iter().filter(|g| g.depth > 1).collect();
            let from = if continuing.len() >= quorum {
                continuing
            } else {
                granted.iter().collect()
            };
            let token = from
                .iter()
                .map(|g| g.token)
                .max()
                .unwrap_or(FencingToken::new(0));
            let depth = granted.iter().map(|g| g.depth).max().unwrap_or(1);
            // Where every granting master answered this very token (the usual case for a
            // plain lock: each raised its counter to the round's proposed token), their
            // counters already stand at it, and writing it back would change nothing.
            let recorded =
                kinds::hold_field(req).is_none() && granted.iter().all(|g| g.token == token);
            if !recorded && kinds::hold_field(req).is_none() {
                tracing::debug!(
                    key = %req.key,
                    "the masters answered different tokens (a clock or counter ahead of the \
                     proposal, or a late request): writing the highest back"
                );
            }
            if recorded || self.write_back(req, token, &votes).await >= quorum {
                return Ok(Attempt::Granted(Grant::new(req, token, depth, start)));
            }
            self.give_back(req, &votes).await;
            return Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "the fencing token of `{}` could not be recorded on a quorum of {quorum}; the grant was given back",
                    req.key
                ),
            ));
        }
        self.give_back(req, &votes).await;
        if granted.len() >= quorum {
            return Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "acquiring `{}` took {elapsed:?}, past its {:?} lease less clock drift; the \
                     grant was refused and given back on every master (masters slow? raise the ttl)",
                    req.key, req.ttl
                ),
            ));
        }
        let busy: Vec<Option<Duration>> = votes
            .iter()
            .filter_map(|v| match v {
                Vote::Busy(left) => Some(*left),
                _ => None,
            })
            .collect();
        let failed: Vec<String> = votes
            .iter()
            .filter_map(|v| match v {
                Vote::Failed(e) => Some(e.to_string()),
                _ => None,
            })
            .collect();
        let refused = votes
            .iter()
            .filter(|v| matches!(v, Vote::Refused(_)))
            .count();
        if refused > self.master_count() - quorum {
            // Too many masters refuse for the rest to make a quorum: their answer stands.
            if let Some(refusal) = votes.into_iter().find_map(|v| match v {
                Vote::Refused(e) => Some(e),
                _ => None,
            }) {
                return Err(refusal);
            }
            return Ok(Attempt::busy(Duration::from_millis(50)));
        }
        if self.master_count() - failed.len() < quorum {
            return Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "only {} of {} masters answered; Redlock needs a quorum of {quorum}: {}",
                    self.master_count() - failed.len(),
                    self.master_count(),
                    failed.join("; ")
                ),
            ));
        }
        // Contended: wait at most as long as the longest lease we saw.
        let left = busy.iter().copied().max().flatten();
        Ok(Attempt::busy(left.unwrap_or(Duration::from_millis(50))))
    }

    /// Raises the token counter to `token` on every granting master (and, for a read or
    /// write hold, records `token` as the hold's own there); returns how many recorded it.
    async fn write_back(&self, req: &AcquireRequest, token: FencingToken, votes: &[Vote]) -> usize {
        let Ok(names) = self.names(&req.key) else {
            return 0;
        };
        let field = kinds::hold_field(req);
        let writes = self
            .nodes
            .iter()
            .zip(votes)
            .filter(|(_, v)| matches!(v, Vote::Granted(_)))
            .filter_map(|(master, _)| master.connected())
            .map(|node| {
                let (name, lock, field) = (names.token.clone(), names.lock.clone(), field.clone());
                let mut conn = node.conn_handle();
                async move {
                    let raised: std::result::Result<i64, _> = match field {
                        None => {
                            wire::RAISE_TOKEN
                                .key(&name)
                                .arg(token.get())
                                .invoke_async(&mut conn)
                                .await
                        }
                        Some(field) => {
                            wire::RAISE_HOLD_TOKEN
                                .key(&name)
                                .key(&lock)
                                .arg(token.get())
                                .arg(field)
                                .invoke_async(&mut conn)
                                .await
                        }
                    };
                    raised.is_ok_and(|now| u64::try_from(now).is_ok_and(|now| now >= token.get()))
                }
            });
        let timeout = self.node_timeout(req.ttl);
        join_all(writes.map(|w| tokio::time::timeout(timeout, w)))
            .await
            .into_iter()
            .filter(|ok| matches!(ok, Ok(true)))
            .count()
    }

    /// Gives back a failed round's grants on every master that granted or did not answer.
    ///
    /// Waits for the masters that granted no longer than a round may take (the per-master
    /// timeout), and not for those that did not answer: their give-backs are sent at once
    /// and finish in the background, and the next round's request of this acquisition to
    /// such a master waits until its give-back there is over (see [`Master::given_back`]):
    /// a give-back's first poll does not always put it on the connection (one being made
    /// again), and one answered `NOSCRIPT` is sent again later, so it could otherwise land
    /// after that round's grant there and, carrying the same attempt marker, take it back.
    /// So a slow or frozen master still applies it before this owner's next round; and a release carries the
    /// acquisition's attempt marker, so it can only take back what this acquisition added,
    /// never an outer hold of the same owner. Waiting out the full response timeout made
    /// every busy round behind a frozen minority master cost that long, and waiting for a
    /// master that did not answer cost each such round the per-master timeout once more.
    async fn give_back(&self, req: &AcquireRequest, votes: &[Vote]) {
        let mut granted = Vec::new();
        for (master, vote) in self.nodes.iter().zip(votes) {
            let Some(node) = master.connected().cloned() else {
                continue;
            };
            match vote {
                Vote::Busy(_) | Vote::Refused(_) => {}
                Vote::Granted(grant) => {
                    let grant = grant.clone();
                    granted.push(async move {
                        let _ = node.release(&grant).await;
                    });
                }
                // No answer (down, frozen, too slow): its grant may land late. The give-back
                // is sent now and finishes in the background (within the response timeout):
                // a master that does not answer costs the round nothing more.
                // The next round's request of this attempt to this master waits until this
                // is over (see `Master::given_back`): being sent first is not enough, as it
                // may wait for a connection being made again, or be sent again after
                // `NOSCRIPT`, and would then take back that round's grant there.
                Vote::Failed(_) => {
                    let grant = Grant::new(req, FencingToken::new(0), 1, Instant::now());
                    let (over, waited) = tokio::sync::watch::channel(());
                    master.giving_back(req.attempt, waited);
                    send_then_detach(
                        async move {
                            let _ = node.release(&grant).await;
                            drop(over);
                        },
                        self.config.response_timeout,
                    );
                }
            }
        }
        let _ = tokio::time::timeout(self.node_timeout(req.ttl), join_all(granted)).await;
    }

    /// A cancel-safe round: it runs in its own task, and a grant nobody waits for any more
    /// is given back. With `marker` (a waiting writer or plain lock), the round marks the
    /// owner as waiting where it is busy, and tells `marker` when it is over, so the markers
    /// are forgotten by whichever ends last, the wait or its rounds (see [`MarkShare`]).
    async fn attempt(
        &self,
        req: &AcquireRequest,
        marker: Option<Arc<MarkShare>>,
        contended: Option<Contended>,
    ) -> Result<Attempt> {
        let (this, request, giver) = (self.clone(), req.clone(), self.clone());
        lockkit_core::spi::detached_acquire(
            BACKEND,
            move |_| {
                // Counted before the round's task is spawned (in the same poll), so a wait
                // dropped from here on leaves the markers to this round.
                if let Some(share) = &marker {
                    share.start();
                }
                async move {
                    let (outcome, everywhere) = this
                        .run_acquire(&request, marker.is_some(), contended.as_ref())
                        .await;
                    if marker
                        .as_ref()
                        .is_some_and(|share| share.finish_with(everywhere))
                    {
                        this.forget_writer_later(&request);
                    }
                    outcome
                }
            },
            Attempt::into_grant,
            move |grant| async move {
                let _ = giver.release(&grant).await;
            },
        )
        .await
    }
}

#[async_trait]
impl LockBackend for RedlockBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo::new(
            BACKEND,
            Consistency::Ap,
            Capabilities {
                min_ttl: Duration::from_millis(10),
                max_ttl: Some(Duration::from_millis(wire::MAX_TTL_MS)),
                counts_waiters: true,
                read_write: true,
                writer_preference: true,
                ..Capabilities::default()
            },
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        kinds::refuse_permits(req.kind)?;
        Ok(self.attempt(req, None, None).await?.into_grant())
    }

    /// Waits for a quorum, woken by release messages from any master. A writer or plain
    /// lock keeps a waiting-writer marker on the masters where it is busy (refreshed by each
    /// round), forgotten on every master when the wait ends, also when this future is
    /// dropped (by the last round still out, if one is).
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        kinds::refuse_permits(req.kind)?;
        let names = self.names(&req.key)?;
        let mut channels = vec![names.channel.clone()];
        if matches!(req.kind, LockKind::Read | LockKind::Write) {
            channels.push(wire::KindNames::new(&names).rw_channel);
        }
        let marker = req
            .kind
            .is_exclusive()
            .then(|| WriterMarker::new(self.clone(), req.clone()));
        let share = marker.as_ref().map(WriterMarker::share);
        let plain = req.kind == LockKind::Exclusive;
        let busy_masters = Arc::new(AtomicU64::new(0));
        let foreign = ForeignHolders::new(names.clone(), self.nodes.len(), self.quorum());
        let leader = self.leader_of(&req.key);
        let place = Arc::new(LeaderQueuePlace {
            backend: self.clone(),
            leader,
            queue: wire::queue_of(&names),
            id: queue_id(&req.owner),
            may_be_queued: AtomicBool::new(false),
            queued: AtomicBool::new(false),
            granted: AtomicBool::new(false),
        });
        // A plain lock waits in the leader's queue (with one master there is no leader).
        let queues = plain && self.nodes.len() > 1;
        let leader_turns = queues.then(|| LeaderTurns::new(place.id));
        let mut messages = MastersMessages {
            backend: self,
            channels,
            subscriptions: None,
            deaf: 0,
            heeded: plain.then(|| busy_masters.clone()),
            queued_at_leader: queues.then_some((leader, place.id)),
            leader_turns: leader_turns.clone(),
            foreign: plain.then(|| foreign.clone()),
            keyspace: Vec::new(),
            keyspace_refused: 0,
        };
        // Contenders woken by one release must not split the masters between them. A plain
        // lock's rounds after the first meet at the key's leader master (see
        // `run_acquire`), so they go at once; read-write rounds ask every master, and wait
        // up to a millisecond after a wake-up, since masters publish one release one by one.
        let settle = if plain {
            Duration::ZERO
        } else {
            Duration::from_millis(1)
        };
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(160),
        ))
        .settle(settle);
        let mut first_round = true;
        let mut last_full_round = Instant::now();
        // A round held back for another waiter's turn is held up to the wait's end at most.
        let deadline = last_full_round.checked_add(wait);
        let place_score = Arc::new(AtomicU64::new(0));
        let outcome = wait_for_grant(&req.key, wait, policy, &mut messages, || {
            // A round that would land between a release naming another waiter and that
            // waiter's grant waits for the grant; one after it is not made (see
            // `LeaderTurns`).
            let gate = leader_turns.as_ref().map_or(RoundGate::Go, |t| t.gate());
            if let (RoundGate::Skip(lease_end), Some(turns)) = (gate, &leader_turns) {
                turns.round_begins();
                return Either::Left(std::future::ready(Ok(skipped_round(lease_end))));
            }
            let leader_first = !first_round && last_full_round.elapsed() < FULL_ROUND_EVERY;
            first_round = false;
            if !leader_first {
                last_full_round = Instant::now();
            }
            let contended = plain.then(|| Contended {
                leader_first,
                busy_masters: busy_masters.clone(),
                turn: QueueTurn::new(
                    place.id,
                    place.may_be_queued.swap(queues, Ordering::AcqRel),
                    place_score.clone(),
                ),
                place: place.clone(),
                foreign: foreign.clone(),
            });
            let (share, turns) = (share.clone(), leader_turns.clone());
            Either::Right(async move {
                if let (RoundGate::HoldUntil(until), Some(turns)) = (gate, &turns) {
                    let bound = deadline.map_or(until, |deadline| until.min(deadline));
                    match turns.hold(bound).await {
                        RoundGate::Skip(lease_end) => {
                            turns.round_begins();
                            return Ok(skipped_round(lease_end));
                        }
                        // Held to the end of the wait while the named waiter's grace still
                        // runs: the wait ends as busy (timed out) instead of taking its
                        // turn a grace past its end.
                        _ if bound < until && matches!(turns.gate(), RoundGate::HoldUntil(_)) => {
                            turns.round_begins();
                            return Ok(Attempt::Busy { lease_left: None });
                        }
                        _ => {}
                    }
                }
                if let Some(turns) = &turns {
                    turns.round_begins();
                }
                self.attempt(req, share, contended).await
            })
        })
        .await;
        // A grant leaves the place to the rounds' account of the leader's answers.
        place.granted.store(outcome.is_ok(), Ordering::Release);
        drop(place);
        // Even after a grant: masters outside the granting quorum may keep a marker.
        drop(marker);
        outcome
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        kinds::refuse_permits(grant.kind)?;
        // A master whose last request failed is waited for (within the per-master timeout)
        // while the renewals in hand are short of a quorum that the answers still out could
        // complete: a hold granted on a bare quorum (the other masters down) needs every one
        // of its masters, and one of them marked while it answers (a request of another
        // lock's shorter per-master timeout failed there, or its link was reset once) would
        // fail every renewal while the mark lasts, until the lease ran out and the hold was
        // reported lost while its quorum held it.
        // Short of a quorum for good, the answers still out must not be able to change
        // whether so many masters disown the hold that no quorum can hold it (`NotHeld`,
        // reported lost at once) or not (retryable): a master not waited for counts as one
        // that may hold it, and a hold its answering masters disown would otherwise stay
        // valid for the rest of its lease while another owner can take the key.
        let (quorum, masters) = (self.quorum(), self.master_count());
        let settled = |answers: &[Option<Result<()>>]| {
            let renewed = answers.iter().filter(|a| matches!(a, Some(Ok(())))).count();
            let out = answers.iter().filter(|a| a.is_none()).count();
            let refused = answers
                .iter()
                .filter(|a| matches!(a, Some(Err(Error::NotHeld { .. }))))
                .count();
            renewed >= quorum
                || (renewed + out < quorum
                    && (masters.saturating_sub(refused) < quorum
                        || masters.saturating_sub(refused + out) >= quorum))
        };
        let results: Vec<Result<()>> = self
            .on_masters(
                self.node_timeout(ttl),
                |_| true,
                |_, node| {
                    let grant = grant.clone();
                    async move { node.renew(&grant, ttl).await }
                },
                settled,
            )
            .await
            .into_iter()
            .flatten()
            .collect();
        let renewed = results.iter().filter(|r| r.is_ok()).count();
        let refused = results
            .iter()
            .filter(|r| matches!(r, Err(Error::NotHeld { .. })))
            .count();
        if renewed >= self.quorum() {
            Ok(())
        } else if self.master_count() - refused < self.quorum() {
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        } else {
            Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "only {renewed} masters renewed `{}`; a quorum of {} is needed",
                    grant.key,
                    self.quorum()
                ),
            ))
        }
    }

    /// Releases on every master: released once a quorum let go (or some did and none said
    /// it is not theirs); [`Error::NotHeld`] once so many masters say it is not theirs that
    /// no quorum can hold it (as [`Self::renew`] decides); else a retryable error (a quorum
    /// may still hold it on masters that did not answer: never a loss).
    async fn release(&self, grant: &Grant) -> Result<Released> {
        kinds::refuse_permits(grant.kind)?;
        let results = self.release_on_masters(grant).await;
        let released: Vec<Released> = results
            .iter()
            .filter_map(|r| r.as_ref().ok().copied())
            .collect();
        let refused = results
            .iter()
            .filter(|r| matches!(r, Err(Error::NotHeld { .. })))
            .count();
        if released.len() >= self.quorum() || (!released.is_empty() && refused == 0) {
            let remaining = agreed_remaining(&released, self.quorum());
            return Ok(match remaining {
                0 => Released::Fully,
                remaining => Released::Partially { remaining },
            });
        }
        if self.master_count() - refused < self.quorum() {
            // Too few masters are left that could hold it for it to be held.
            return Err(Error::NotHeld {
                key: grant.key.clone(),
            });
        }
        // A quorum may still hold it: the masters that released it and those that did not
        // answer (masters outside the quorum that granted it say it is not theirs). As a
        // renewal in this state, that is no loss; the rest runs out with the lease.
        match results
            .into_iter()
            .find(|r| matches!(r, Err(Error::Backend { .. })))
        {
            Some(Err(e)) if released.is_empty() => Err(e),
            _ => Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "only {} masters released `{}` and {refused} do not hold it; the others did \
                     not answer, and a quorum of {} is needed to tell: where it is still held, \
                     its lease runs out",
                    released.len(),
                    grant.key,
                    self.quorum()
                ),
            )),
        }
    }

    /// One round to every master, as a lock round is.
    async fn ping(&self) -> Result<()> {
        let results = self
            .on_all(self.config.response_timeout, |node| async move {
                node.ping().await
            })
            .await;
        let answered = results.iter().filter(|r| r.is_ok()).count();
        if answered >= self.quorum() {
            Ok(())
        } else {
            Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "only {answered} masters answered PING; a quorum of {} is needed",
                    self.quorum()
                ),
            ))
        }
    }

    /// The hold a quorum of masters agrees on (the writer or plain lock first; for a key
    /// several readers hold, one of them), with the highest token, the shortest lease and
    /// the most waiters any master counts.
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let answered = self
            .each_master(key, |node, key| async move { node.inspect(&key).await })
            .await?;
        let held: Vec<Vec<HolderInfo>> = answered.into_iter().map(Vec::from_iter).collect();
        let agreed = kinds::agreed_holders(&held, self.quorum());
        let readers = held
            .iter()
            .flatten()
            .any(|i| i.kind == Some(LockKind::Read));
        if agreed.is_empty() && readers {
            // Each master names one of its readers, maybe not the same one.
            return Ok(self.holders(key).await?.into_iter().next());
        }
        if agreed.is_empty() {
            self.free_unless_undecided(key, &held)?;
        }
        Ok(agreed.into_iter().next())
    }

    /// Every hold a quorum of masters agrees on: the writer (or plain lock) first, then each
    /// reader, with the highest token and depth and the shortest lease seen.
    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        let answered = self
            .each_master(key, |node, key| async move { node.holders(&key).await })
            .await?;
        let agreed = kinds::agreed_holders(&answered, self.quorum());
        if agreed.is_empty() {
            self.free_unless_undecided(key, &answered)?;
        }
        Ok(agreed)
    }
}

impl RedlockBackend {
    /// Whether `key`, on which no hold has a quorum's agreement in `per_master` (the lists of
    /// the masters that answered), can be told free: not while some hold lacks a quorum only
    /// for want of the masters that did not answer (one of a bare quorum may be slow).
    ///
    /// # Errors
    /// A retryable [`Error::Backend`] saying the key may be held.
    fn free_unless_undecided(&self, key: &LockKey, per_master: &[Vec<HolderInfo>]) -> Result<()> {
        let silent = self.master_count().saturating_sub(per_master.len());
        match kinds::most_listed_short_of(per_master, self.quorum()) {
            Some(listed) if listed + silent >= self.quorum() => Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "`{key}` may be held: {listed} masters list a holder and {silent} did not \
                     answer; a quorum of {} is needed to tell",
                    self.quorum()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Asks every master about `key` and waits for each (within the response timeout); the
    /// answers of those that answered, if a quorum did.
    async fn each_master<T, F, Fut>(&self, key: &LockKey, ask: F) -> Result<Vec<T>>
    where
        F: Fn(RedisBackend, LockKey) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let ask = &ask;
        // Every master is waited for (within the response timeout), a marked one too: which
        // masters list a holder decides the answer, not how many answered. With a quorum
        // in hand a marked master's list could still make a holder agreed, or the key
        // free, or add a reader (helper-59's review).
        let results = self
            .on_masters(
                self.config.response_timeout,
                |_| true,
                |_, node| ask(node, key.clone()),
                |_| false,
            )
            .await;
        let answered: Vec<T> = results
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .collect();
        if answered.len() < self.quorum() {
            return Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "only {} masters answered; a quorum of {} is needed to tell who holds `{key}`",
                    answered.len(),
                    self.quorum()
                ),
            ));
        }
        Ok(answered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masters(addresses: &[&str]) -> Vec<String> {
        addresses.iter().map(|a| format!("redis://{a}")).collect()
    }

    #[test]
    fn every_order_of_the_same_masters_picks_the_same_leader() {
        let listed = masters(&["10.0.0.1:6379", "10.0.0.2:6379", "10.0.0.3:6379"]);
        let mut reversed = listed.clone();
        reversed.reverse();
        for key in ["orders/1", "orders/2", "a", "ключ"] {
            let picked = &listed[leader_among(key, &listed)];
            assert_eq!(picked, &reversed[leader_among(key, &reversed)], "{key}");
        }
    }

    #[test]
    fn credentials_database_and_case_do_not_change_the_leader() {
        let plain = masters(&["db-a:6379/0", "db-b:6379/0", "db-c:6379/0"]);
        let other: Vec<String> = ["DB-A:6379/3", "db-b:6379/3?x=1", "db-c:6379"]
            .iter()
            .map(|a| format!("rediss://user:s3cr@t@{a}"))
            .collect();
        for n in 0..100 {
            let key = format!("orders/{n}");
            assert_eq!(
                leader_among(&key, &plain),
                leader_among(&key, &other),
                "{key}"
            );
        }
        assert_eq!(master_address("redis://u:p@Host-1:6379/0"), "host-1:6379");
        assert_eq!(master_address("redis://[::1]:6379"), "[::1]:6379");
    }

    /// Finding 4 (helper-44): one IP address written two ways (`[::1]` and `[0::1]`, or an
    /// IPv4 address and its IPv4-mapped IPv6 form) is one master listed twice, which counts
    /// twice towards the quorum (c874a02's double grant). Unlike two DNS names, these are
    /// told apart without any I/O.
    #[test]
    fn one_ip_address_written_two_ways_is_a_master_listed_twice() {
        for twice in [
            ["[::1]:6379", "[0::1]:6379", "[::2]:6379"],
            ["[::1]:6379", "[0:0:0:0:0:0:0:1]:6379", "[::2]:6379"],
            ["127.0.0.1:6379", "[::ffff:127.0.0.1]:6379", "[::2]:6379"],
            ["[2001:db8::1]:1", "[2001:DB8:0::1]:1", "[2001:db8::2]:1"],
        ] {
            assert!(
                matches!(
                    refuse_masters_listed_twice(&masters(&twice)),
                    Err(Error::Config(_))
                ),
                "{twice:?}"
            );
        }
        let distinct = masters(&["[::1]:6379", "[::1]:6380", "127.0.0.1:6379"]);
        assert!(refuse_masters_listed_twice(&distinct).is_ok());
    }

    #[test]
    fn the_holds_left_are_what_a_quorum_reports() {
        let partially = |remaining| Released::Partially { remaining };
        let full = Released::Fully;
        // A stray copy on one master: the quorum let go.
        assert_eq!(agreed_remaining(&[partially(1), full, full], 2), 0);
        assert_eq!(
            agreed_remaining(&[full, partially(1), full, full, full], 3),
            0
        );
        // A real outer hold: every master keeps it.
        assert_eq!(
            agreed_remaining(&[partially(1), partially(1), partially(1)], 2),
            1
        );
        assert_eq!(agreed_remaining(&[partially(2), partially(1), full], 2), 1);
        // Fewer than a quorum answered: the highest, to be safe.
        assert_eq!(agreed_remaining(&[partially(1)], 3), 1);
        assert_eq!(agreed_remaining(&[], 3), 0);
    }

    #[test]
    fn the_holds_left_are_decided_once_the_answers_out_cannot_change_them() {
        let partially = |remaining| Released::Partially { remaining };
        let full = Released::Fully;
        // Every answer in agrees: nothing out can change it.
        assert!(holds_left_decided(&[full, full, full], 2, 3));
        assert!(holds_left_decided(&[partially(1); 3], 2, 3));
        // Two of the quorum that still holds an outer hold answered, the third is out.
        assert!(!holds_left_decided(
            &[partially(1), partially(1), full, full],
            1,
            3
        ));
        // All in.
        assert!(holds_left_decided(
            &[partially(1), partially(1), full, full, full],
            0,
            3
        ));
    }

    #[test]
    fn a_master_listed_twice_is_refused() {
        assert!(refuse_masters_listed_twice(&masters(&["a:1", "b:1", "c:1"])).is_ok());
        let twice = masters(&["a:1", "b:1", "A:1/2"]);
        assert!(matches!(
            refuse_masters_listed_twice(&twice),
            Err(Error::Config(e)) if e.contains("`a:1` twice")
        ));
    }

    #[test]
    fn keys_spread_over_every_master() {
        let listed = masters(&["a:1", "b:1", "c:1", "d:1", "e:1"]);
        let mut per_master = [0_u32; 5];
        for n in 0..5_000 {
            per_master[leader_among(&format!("orders/{n}"), &listed)] += 1;
        }
        assert!(
            per_master.iter().all(|&n| (800..1_200).contains(&n)),
            "{per_master:?}"
        );
    }

    /// Clients of different lockkit versions must pick the same leader: the score is a
    /// wire format.
    #[test]
    fn the_leader_score_is_pinned() {
        assert_eq!(
            leader_score("orders/1", &master_address("redis://127.0.0.1:6379/0")),
            PINNED
        );
    }

    /// Computed apart from this code (FNV-1a 64 over the key, 0xff and `127.0.0.1:6379`; the
    /// SplitMix64 finish).
    const PINNED: u64 = 12_065_251_416_611_559_501;
}

//! `ZkBackend`: sessions, contenders, predecessor watches, leases and loss.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use lockkit_core::spi::{
    AcquireRequest, Backoff, CountRelease, Grant, HoldCount, Interrupt, LocalHolds, Released,
    Stamp, contender_record, deadline_after, detached_acquire, granted_or_timeout,
    parse_contender_record,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LockKind, LossSignal, LostReason, OwnerId, Result,
};
use tokio::time::Instant;
use uuid::Uuid;
use zookeeper_client::{Acls, Client, CreateMode, SessionState};

use crate::{
    ZkConfig, ZkLayout,
    path::encode,
    queue::{
        KAZOO_SEMAPHORE_LOCK_SUFFIX, LEASES_DIR, LOCKS_DIR, PERMITS_DIR, Standing,
        contender_prefix, contenders_in_order, downgrade_name, holding, is_contender,
        is_kazoo_lease, kind_of_node, sequence_of, standing,
    },
};

const BACKEND: &str = "zk";

/// An error that says the connection failed, not what the server did: the request may or
/// may not have been applied, and the session may well live on (the client reconnects).
/// zookeeper-client reports a connection that stopped answering ("no response from
/// connection in ...ms", under load) as a custom error, not as `ConnectionLoss`.
fn connection_failed(e: &zookeeper_client::Error) -> bool {
    matches!(
        e,
        zookeeper_client::Error::ConnectionLoss
            | zookeeper_client::Error::Timeout
            | zookeeper_client::Error::Custom(_)
    )
}

/// Pause before asking again after a connection failure while waiting.
const RECONNECT_RETRY: Duration = Duration::from_millis(50);

/// Waits [`RECONNECT_RETRY`] (at most until `deadline`) before asking again; false if the
/// caller went away meanwhile.
async fn pause_unless_interrupted(deadline: Instant, interrupt: &Interrupt) -> bool {
    tokio::select! {
        () = tokio::time::sleep(RECONNECT_RETRY.min(deadline.saturating_duration_since(Instant::now()))) => true,
        () = interrupt.interrupted() => false,
    }
}

/// Why a waiter stopped waiting for a request's answer.
enum Unanswered {
    /// The caller went away.
    Interrupted,
    /// The request was still unanswered at its bound (see `ZkBackend::request_end`).
    TooLate,
}

/// The answer to `request`, unless the caller goes away or `end` passes first.
///
/// zookeeper-client queues requests while it reconnects and fails them only when it gives
/// the session up (7/5 of the session timeout after the server last answered), so a
/// request sent to a silent server can take far longer than any wait: an acquisition must
/// bound every request itself.
async fn answer_by<T>(
    request: impl std::future::Future<Output = T>,
    end: Instant,
    interrupt: &Interrupt,
) -> std::result::Result<T, Unanswered> {
    tokio::select! {
        answer = request => Ok(answer),
        () = tokio::time::sleep_until(end) => Err(Unanswered::TooLate),
        () = interrupt.interrupted() => Err(Unanswered::Interrupted),
    }
}

/// The error for a request the server left unanswered until the acquisition had to end.
fn unanswered(doing: &str, limit: Duration) -> Error {
    Error::backend(
        BACKEND,
        true,
        format!(
            "{doing}: ZooKeeper did not answer within {limit:?} (is the server up and \
             reachable? the session's connection is being re-established)"
        ),
    )
}

/// Why the root node could not be created. Under a chroot that does not exist, the server
/// answers `NoNode` for the root: that is said as such, since only the user can mend it.
fn root_error(config: &ZkConfig, e: zookeeper_client::Error) -> Error {
    if matches!(e, zookeeper_client::Error::NoNode)
        && let Some((_, chroot)) = config.connect.split_once('/')
    {
        return Error::Config(format!(
            "the chroot `/{chroot}` does not exist on the ZooKeeper servers: create it \
             (e.g. `zkCli.sh create /{chroot}`) or leave it out of the URL"
        ));
    }
    zk_error("creating the root node", e)
}

fn zk_error(doing: &str, e: zookeeper_client::Error) -> Error {
    let retryable = connection_failed(&e) || matches!(e, zookeeper_client::Error::SessionExpired);
    Error::backend_with_source(BACKEND, retryable, format!("{doing} failed: {e}"), e)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One hold: a contender node that reached the head of its queue.
pub(crate) struct Held {
    node: String,
    key: LockKey,
    owner: OwnerId,
    token: FencingToken,
    /// Depth, the acquisitions behind it and the lease.
    count: HoldCount,
    loss: LossSignal,
    session: Arc<Session>,
    released: AtomicBool,
    /// Who took the hold, encoded: the second line of the node's data.
    identity: String,
    /// The kind of hold (which registry it is in).
    kind: LockKind,
    /// The attempt that made the hold (a permit's key in the registry of permits).
    attempt: Uuid,
    /// A node that goes with the hold: a permit's child of `lockkit-permits`.
    marker: Option<String>,
}

/// A hold that nobody refers to any more and that was never released deletes its node:
/// a hold given up as lost while its session lived on (the link was silent past two thirds
/// of the session timeout, then came back) is not released by its guard, and its node
/// would keep the key for as long as the session lives. The node is this hold's alone (a
/// newer hold of the same owner has a node of its own), so deleting it is always safe.
impl Drop for Held {
    fn drop(&mut self) {
        if self.released.load(Ordering::SeqCst) || self.session.dead.load(Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (session, node, marker) =
            (self.session.clone(), self.node.clone(), self.marker.clone());
        runtime.spawn(async move {
            delete_until_gone(session.clone(), node).await;
            if let Some(marker) = marker {
                delete_until_gone(session, marker).await;
            }
        });
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").field("node", &self.node).finish()
    }
}

/// One ZooKeeper session and the holds that live and die with it.
pub(crate) struct Session {
    client: Client,
    /// When the last request that the server answered was sent (monotonic clock), stamped
    /// with the machine's suspended time when the answer came: the session's timeout runs
    /// on on the servers while the machine is suspended.
    last_contact: Mutex<Stamp>,
    holds: Mutex<Vec<Weak<Held>>>,
    dead: AtomicBool,
}

/// How clean-up retries after a connection loss are spaced: 20 ms doubling to a second.
fn cleanup_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(20), Duration::from_secs(1))
}

/// Deletes `node` until it is gone: tried at once, then retried in the background with
/// backoff after a connection loss, for as long as the session lives (the node goes with
/// the session anyway). A node nobody deletes would wedge its key while the session lives.
/// Returns whether the first try already deleted it (or found it gone).
async fn delete_until_gone(session: Arc<Session>, node: String) -> bool {
    let gone = |r: &std::result::Result<(), zookeeper_client::Error>| {
        matches!(
            r,
            Ok(()) | Err(zookeeper_client::Error::NoNode | zookeeper_client::Error::SessionExpired)
        )
    };
    if gone(&session.client.delete(&node, None).await) {
        return true;
    }
    tokio::spawn(async move {
        let mut backoff = cleanup_backoff();
        while !session.dead.load(Ordering::SeqCst) {
            tokio::time::sleep(backoff.next_delay()).await;
            let result = session.client.delete(&node, None).await;
            if gone(&result) {
                return;
            }
            tracing::debug!(node, ?result, "deleting a lock node failed; retrying");
        }
    });
    false
}

/// Deletes its node until gone, in the background, when dropped still armed.
struct DeleteOnDrop(Option<(Arc<Session>, String)>);

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        if let Some((session, node)) = self.0.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(delete_until_gone(session, node));
        }
    }
}

impl Session {
    fn touch(&self, sent: Instant) {
        let mut last = lock(&self.last_contact);
        if sent > last.instant() {
            *last = Stamp::new(sent);
        }
    }

    /// Fires every hold's loss signal; their nodes go with the session (or are deleted
    /// once the client reconnects, if the session survives).
    fn lose_all(&self, reason: LostReason) {
        for held in lock(&self.holds).drain(..).filter_map(|w| w.upgrade()) {
            held.loss.fire(reason);
        }
    }
}

pub(crate) struct Inner {
    config: ZkConfig,
    session: tokio::sync::Mutex<Arc<Session>>,
    /// Plain (exclusive) holds.
    held: LocalHolds<Held>,
    /// Read holds of read-write locks: an owner's read and write holds of a key are two
    /// holds (a writer may read: downgrade).
    reads: LocalHolds<Held>,
    /// Write holds of read-write locks.
    writes: LocalHolds<Held>,
    /// Semaphore permits, by the attempt that took them: never reentrant, so one hold per
    /// acquisition, whatever its owner.
    permits: Mutex<HashMap<Uuid, Arc<Held>>>,
    /// Predecessor watches that fired, for herd checks.
    wakeups: std::sync::atomic::AtomicU64,
    /// Lock directories recently seen to exist.
    dirs: KnownDirs,
    /// Whether an expired session is being reopened (see [`ZkBackend::session`]).
    reopening: AtomicBool,
    /// Counts the reopenings that ended, for the callers waiting for one.
    reopened: tokio::sync::watch::Sender<u64>,
    /// Why the last reopening that failed failed.
    reopen_failure: Mutex<Option<Error>>,
}

/// Ends a reopening (see [`ZkBackend::session`]) when dropped, even by a panic: clears the
/// flag, then tells the waiting callers.
struct ReopeningEnd(Arc<Inner>);

impl Drop for ReopeningEnd {
    fn drop(&mut self) {
        self.0.reopening.store(false, Ordering::SeqCst);
        self.0
            .reopened
            .send_modify(|ended| *ended = ended.wrapping_add(1));
    }
}

/// How many lock directories a backend remembers as existing.
const KNOWN_DIRS: usize = 4096;

/// The lock directories (containers) this backend recently created or saw exist, so that
/// a key used again needs no create of its directory. Only a hint: the server removes an
/// empty container, and so may another client, so a directory found missing is forgotten
/// and created again. At most [`KNOWN_DIRS`] are kept; when full, all are forgotten (a
/// directory forgotten costs one create more, sent with its contender's, not a round trip).
#[derive(Debug, Default)]
struct KnownDirs(Mutex<HashSet<String>>);

impl KnownDirs {
    /// Whether `dir` was recently seen to exist.
    fn contains(&self, dir: &str) -> bool {
        lock(&self.0).contains(dir)
    }

    /// Remembers that `dir` exists.
    fn insert(&self, dir: &str) {
        let mut dirs = lock(&self.0);
        if dirs.contains(dir) {
            return;
        }
        if dirs.len() >= KNOWN_DIRS {
            dirs.clear();
        }
        dirs.insert(dir.to_owned());
    }

    /// Forgets `dir` (found missing).
    fn remove(&self, dir: &str) {
        lock(&self.0).remove(dir);
    }
}

/// A ZooKeeper lock service: the CP backend.
///
/// Each contender is an `EPHEMERAL_SEQUENTIAL` node `<root>/<key>/_c_<uuid>-lock-<seq>`
/// under a container node per key, named as Apache Curator's InterProcessMutex names them,
/// so Curator and lockkit exclude each other on the same path. Each waiter watches only
/// its predecessor. The fencing token is the holder node's `czxid`.
///
/// Read and write holds queue in the same directory under Curator's read-write lock names
/// (`__READ__`, `__WRIT__`); a waiting reader watches only the nearest writer before it.
/// Permits follow Curator's InterProcessSemaphoreV2 (`<key>/locks`, `<key>/leases`), with
/// the permit count in lockkit's `<key>/lockkit-permits`. Each read, write or permit is a
/// hold of its own node, lease and loss signal. With `?layout=kazoo` the names are kazoo's
/// and permits follow kazoo's `Semaphore` (see [`ZkLayout`](crate::ZkLayout)).
///
/// A hold ends when its lease runs out unrenewed (its node is deleted), when its session
/// expires, or when the client stays disconnected for two thirds of the session timeout,
/// counted on the local monotonic clock from the last request the server answered: the
/// holder hears of the loss before the server can expire the session and grant the lock
/// to anyone else.
#[derive(Clone)]
pub struct ZkBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ZkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkBackend")
            .field("connect", &self.inner.config.connect)
            .field("root", &self.inner.config.root)
            .finish()
    }
}

impl ZkBackend {
    /// Connects as a `zk://h1:p1,h2:p2/chroot?session_timeout=10s&root=/lockkit` URL says.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL or a session timeout the servers will not grant;
    /// [`Error::Backend`] when no server answers.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::from_config(ZkConfig::parse(url)?).await
    }

    /// Connects as `config` says.
    ///
    /// # Errors
    /// As [`ZkBackend::connect`].
    pub async fn from_config(config: ZkConfig) -> Result<Self> {
        let session = open_session(&config).await?;
        Ok(ZkBackend {
            inner: Arc::new(Inner {
                config,
                session: tokio::sync::Mutex::new(session),
                held: LocalHolds::new(),
                reads: LocalHolds::new(),
                writes: LocalHolds::new(),
                permits: Mutex::new(HashMap::new()),
                wakeups: std::sync::atomic::AtomicU64::new(0),
                dirs: KnownDirs::default(),
                reopening: AtomicBool::new(false),
                reopened: tokio::sync::watch::Sender::new(0),
                reopen_failure: Mutex::new(None),
            }),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &ZkConfig {
        &self.inner.config
    }

    /// How many times a waiter of this client was woken by its predecessor's watch. With
    /// predecessor watches, one release wakes exactly one waiter (no herd).
    pub fn watch_wakeups(&self) -> u64 {
        self.inner.wakeups.load(Ordering::SeqCst)
    }

    /// How a key's directory is made: a container (as Curator makes it; the server removes
    /// it once empty) in Curator's layout; persistent in kazoo's, as kazoo's
    /// `ensure_path` makes it, since a kazoo `Lock` checks its path once and then relies on
    /// it: a container removed while the key was idle made kazoo's next acquisition fail
    /// with `NoNodeError`.
    fn lock_dir_mode(&self) -> CreateMode {
        match self.inner.config.layout {
            ZkLayout::Kazoo => CreateMode::Persistent,
            _ => CreateMode::Container,
        }
    }

    /// The container node under which `key`'s contenders queue.
    pub fn lock_dir(&self, key: &LockKey) -> String {
        format!("{}/{}", self.inner.config.root, encode(key))
    }

    /// Holds the current session keeps track of (to fire their loss signals when it
    /// ends); ended holds are dropped from it as new ones come. For leak checks.
    pub async fn tracked_holds(&self) -> usize {
        lock(&self.inner.session.lock().await.holds).len()
    }

    /// The client of the current session (for operators and tests).
    pub async fn client(&self) -> Result<Client> {
        Ok(self.session().await?.client.clone())
    }

    /// How long one request may stay unanswered: the client's own limit for a connection
    /// that stopped answering (`connect_timeout` when at most 3/5 of the session, else 2/5
    /// of the session). An acquisition ends at most this long after its wait's deadline.
    fn request_limit(&self) -> Duration {
        let config = &self.inner.config;
        let limit = if config.connect_timeout.is_zero()
            || config.connect_timeout > config.session_timeout * 3 / 5
        {
            config.session_timeout * 2 / 5
        } else {
            config.connect_timeout
        };
        limit.max(Duration::from_millis(100))
    }

    /// How long a request sent now may stay unanswered by an acquisition whose wait ends
    /// at `deadline`: until the deadline, and one request limit of silence past it (or past
    /// now, for a request sent after it). Bounded per request, so slow answers that keep
    /// coming never fail an acquisition, while a silent server ends it: at most one
    /// request limit after its deadline, and one more if deleting its node is unanswered.
    fn request_end(&self, deadline: Instant) -> Instant {
        let from = deadline.max(Instant::now());
        from.checked_add(self.request_limit()).unwrap_or(from)
    }

    /// The current session, reopened if it expired.
    ///
    /// The reopening runs in a task of its own: a caller that stops waiting for it (its
    /// deadline, its going away) leaves it to finish for the callers after it. Cut short
    /// with each caller, a reopening slower than a caller's bound never finished, and no
    /// acquisition got a session for as long as reopening stayed that slow.
    ///
    /// One reopening at a time: a caller that finds one under way waits for its outcome
    /// instead of queueing a reopening of its own behind it (callers that gave up left one
    /// each, and the queue of connection attempts for callers long gone grew for as long
    /// as the servers could not be reached).
    async fn session(&self) -> Result<Arc<Session>> {
        {
            let current = self.inner.session.lock().await;
            if !current.dead.load(Ordering::SeqCst) {
                return Ok(current.clone());
            }
        }
        // Subscribed before the flag is read: a reopening under way tells of its end after
        // clearing the flag, so its end is seen (or this call starts the next one).
        let mut ended = self.inner.reopened.subscribe();
        if !self.inner.reopening.swap(true, Ordering::SeqCst) {
            let inner = self.inner.clone();
            // Made before the task: a task dropped before it first runs (its runtime shut
            // down) still ends the reopening, or later callers waited for it in vain.
            let end = ReopeningEnd(inner.clone());
            tokio::spawn(async move {
                let _end = end;
                let mut current = inner.session.lock().await;
                // Another caller's reopening may have finished meanwhile.
                if current.dead.load(Ordering::SeqCst) {
                    match open_session(&inner.config).await {
                        Ok(session) => {
                            *current = session;
                            *lock(&inner.reopen_failure) = None;
                        }
                        Err(error) => *lock(&inner.reopen_failure) = Some(error),
                    }
                }
            });
        }
        let _ = ended.changed().await;
        let current = self.inner.session.lock().await;
        if !current.dead.load(Ordering::SeqCst) {
            return Ok(current.clone());
        }
        Err(match lock(&self.inner.reopen_failure).as_ref() {
            Some(Error::Config(message)) => Error::Config(message.clone()),
            Some(error) => Error::backend(BACKEND, error.is_retryable(), error.to_string()),
            None => Error::backend(
                BACKEND,
                true,
                "reopening the expired ZooKeeper session failed; try again",
            ),
        })
    }

    /// The registry of an owner's holds of `kind`; `None` for permits, which are kept by
    /// attempt (see [`Inner::permits`]).
    fn registry(&self, kind: LockKind) -> Option<&LocalHolds<Held>> {
        match kind {
            LockKind::Read => Some(&self.inner.reads),
            LockKind::Write => Some(&self.inner.writes),
            LockKind::Permit { .. } => None,
            _ => Some(&self.inner.held),
        }
    }

    /// Forgets `held` if it is still the registered hold (a newer one stays).
    fn forget(&self, held: &Held) {
        match self.registry(held.kind) {
            Some(registry) => registry.forget(held.owner, &held.key, held),
            None => {
                let mut permits = lock(&self.inner.permits);
                if permits
                    .get(&held.attempt)
                    .is_some_and(|h| std::ptr::eq(Arc::as_ptr(h), held))
                {
                    permits.remove(&held.attempt);
                }
            }
        }
    }

    /// The live hold behind `grant`, checking it belongs to this client, owner and key.
    fn held_of(&self, grant: &Grant) -> Result<Arc<Held>> {
        if let Some(registry) = self.registry(grant.kind) {
            return registry.held_of(grant);
        }
        let held = grant
            .state
            .clone()
            .and_then(|state| state.downcast::<Held>().ok())
            .filter(|held| held.key == grant.key && held.owner == grant.owner);
        match (held, lock(&self.inner.permits).get(&grant.attempt)) {
            (Some(held), Some(current)) if Arc::ptr_eq(&held, current) => Ok(held),
            _ => Err(Error::NotHeld {
                key: grant.key.clone(),
            }),
        }
    }

    /// `owner`'s registered hold of `kind` on `key`, unless it is known to be lost.
    fn live(&self, kind: LockKind, owner: OwnerId, key: &LockKey) -> Option<Arc<Held>> {
        self.registry(kind)?
            .get(owner, key)
            .filter(|h| !h.loss.is_fired() && !h.released.load(Ordering::SeqCst))
    }

    /// Refuses, before any I/O, what `req`'s owner can never get beside what it holds in
    /// this client: a write or a plain lock while it only reads (`WouldDeadlock`: it would
    /// wait for itself), and a plain lock beside its write or a read or write beside its
    /// plain lock (`KindMismatch`).
    fn refuse_conflicting_kinds(&self, req: &AcquireRequest) -> Result<()> {
        let holds = |kind| self.live(kind, req.owner, &req.key).is_some();
        let mismatch = |found: &str| {
            Err(Error::KindMismatch {
                key: req.key.clone(),
                found: found.into(),
                asked: req.kind,
            })
        };
        match req.kind {
            LockKind::Write | LockKind::Exclusive
                if holds(LockKind::Read) && !holds(LockKind::Write) =>
            {
                Err(Error::WouldDeadlock {
                    key: req.key.clone(),
                    held: LockKind::Read,
                    asked: req.kind,
                })
            }
            LockKind::Read | LockKind::Write if holds(LockKind::Exclusive) => {
                mismatch("is held by this owner as an exclusive lock")
            }
            LockKind::Exclusive if holds(LockKind::Write) => {
                mismatch("is held by this owner as a read-write lock")
            }
            _ => Ok(()),
        }
    }

    /// Creates this attempt's contender node, finding it after a connection loss instead
    /// of creating a second one, and (with `list`) lists `dir` in the same round trip.
    ///
    /// The requests go out back to back without waiting for each other's answers: the
    /// directory's create when `dir` is not known to exist (see [`KnownDirs`]), the
    /// contender's create, and the listing. A session's requests are applied in the order
    /// sent, so the listing, answered after the create, includes the new node: it is
    /// handed back (with the time it was sent) for the first look at the queue. A
    /// directory believed to exist but gone (the server removes an empty container; so
    /// may another client) answers `NoNode`, and the next try creates it in the same way.
    ///
    /// `None` when the caller went away; an error when the server left a request
    /// unanswered past its bound. Either way, a node the attempt may have created is
    /// deleted in the background.
    async fn create_contender(
        &self,
        attempt: &Attempting<'_>,
        dir: &str,
        kind: LockKind,
        req: &AcquireRequest,
        list: bool,
    ) -> Result<Option<Created>> {
        let Attempting {
            session, interrupt, ..
        } = *attempt;
        // The bound of these requests starts one request limit past the attempt's deadline
        // (as it did when the callers passed `request_end(deadline)` in).
        let deadline = self.request_end(attempt.deadline);
        let client = &session.client;
        let unique = contender_prefix(self.inner.config.layout, kind, Uuid::new_v4());
        // After a lost reply a create may have happened without our knowing: any node of
        // ours but the one we use must go, or it would hold the key while the session lives.
        let mut uncertain = false;
        let sweep = |keep: Option<String>| {
            let (session, dir, unique) = (session.clone(), dir.to_owned(), unique.clone());
            tokio::spawn(async move {
                let mut backoff = cleanup_backoff();
                while !session.dead.load(Ordering::SeqCst) {
                    match session.client.list_children(&dir).await {
                        Ok(children) => {
                            for name in children.iter().filter(|c| c.starts_with(&unique)) {
                                if keep.as_deref() != Some(name.as_str()) {
                                    delete_until_gone(session.clone(), format!("{dir}/{name}"))
                                        .await;
                                }
                            }
                            return;
                        }
                        // No directory, so no node of ours: the session's requests are
                        // ordered, and the create went out before this list.
                        Err(zookeeper_client::Error::NoNode) => return,
                        Err(_) => {}
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            });
        };
        let prefix = format!("{dir}/{unique}");
        let data = contender_record(&req.owner.to_string(), 1, &req.identity.encode());
        let acls = Acls::anyone_all();
        let ephemeral = CreateMode::EphemeralSequential.with_acls(acls);
        let container = self.lock_dir_mode().with_acls(acls);
        // Once a create is sent, its outcome is unknown until answered: a request left
        // unanswered (the caller gone, or its bound passed) leaves a node to sweep.
        let unanswered_create = |why: Unanswered| {
            sweep(None);
            match why {
                Unanswered::Interrupted => Ok(None),
                Unanswered::TooLate => Err(unanswered(
                    "creating the contender node",
                    self.request_limit(),
                )),
            }
        };
        let mut dir_known = self.inner.dirs.contains(dir);
        for _ in 0..5 {
            let sent = Instant::now();
            // zookeeper-client sends each request when it is made: these three go out in
            // this order before any answer is awaited.
            let making_dir = (!dir_known).then(|| client.create(dir, &[], &container));
            let creating = client.create(&prefix, data.as_bytes(), &ephemeral);
            let listing = list.then(|| client.get_children(dir));
            let created = match answer_by(creating, self.request_end(deadline), interrupt).await {
                Ok(created) => created,
                Err(why) => return unanswered_create(why),
            };
            // Answered before the contender's create (answers come in order): at once.
            let made_dir = match making_dir {
                Some(making) => {
                    match answer_by(making, self.request_end(deadline), interrupt).await {
                        Ok(made) => Some(made),
                        Err(why) => return unanswered_create(why),
                    }
                }
                None => None,
            };
            match created {
                Ok((stat, sequence)) => {
                    session.touch(sent);
                    self.inner.dirs.insert(dir);
                    let name = format!("{unique}{sequence}");
                    if uncertain {
                        sweep(Some(name.clone()));
                    }
                    // The listing is only a head start: a failed one, or one without the
                    // node (never expected), leaves the first look to the queue. One left
                    // unanswered is passed on: a caller gone is heeded now.
                    let listed = match listing {
                        Some(listing) => {
                            // Bounded as a listing sent on its own was: one request
                            // limit past the attempt's deadline.
                            let listing_end = self.request_end(attempt.deadline);
                            match answer_by(listing, listing_end, interrupt).await {
                                Ok(Ok((children, stat))) if children.contains(&name) => {
                                    session.touch(sent);
                                    Ok(Some(Listed {
                                        sent,
                                        children,
                                        stat,
                                    }))
                                }
                                Ok(_) => Ok(None),
                                Err(why) => Err(why),
                            }
                        }
                        None => Ok(None),
                    };
                    return Ok(Some(Created {
                        node: format!("{prefix}{sequence}"),
                        czxid: u64::try_from(stat.czxid).unwrap_or(0),
                        listed,
                    }));
                }
                Err(zookeeper_client::Error::NoNode) => {
                    self.inner.dirs.remove(dir);
                    // The directory's own create, when sent, answered first: unless it
                    // found no root either, the directory is there now, or the next try
                    // makes it with the contender (a container gone since it was known).
                    match made_dir {
                        // No root either: made below.
                        Some(Err(zookeeper_client::Error::NoNode)) => {}
                        // The server refused the directory (an ACL, a quota): its reason,
                        // not a retry. The contender's create found no directory, so there
                        // is nothing to sweep.
                        Some(Err(e))
                            if !connection_failed(&e)
                                && !matches!(e, zookeeper_client::Error::NodeExists) =>
                        {
                            return Err(zk_error("creating the lock's container node", e));
                        }
                        _ => {
                            dir_known = false;
                            continue;
                        }
                    }
                    // The root is persistent; each key's directory a container, removed by
                    // the server once empty. Neither holds a lock: nothing to sweep.
                    // A semaphore's `locks` and `leases` are containers in the key's.
                    let persistent = CreateMode::Persistent.with_acls(acls);
                    let directories = async {
                        client
                            .mkdir(&self.inner.config.root, &persistent)
                            .await
                            .map_err(|e| root_error(&self.inner.config, e))?;
                        client
                            .mkdir(dir, &container)
                            .await
                            .map_err(|e| zk_error("creating the lock's container node", e))
                    };
                    match answer_by(directories, self.request_end(deadline), interrupt).await {
                        Ok(made) => made?,
                        Err(why) => return unanswered_create(why),
                    }
                    dir_known = true;
                }
                Err(e) if connection_failed(&e) => {
                    // The create may have happened: look for our uuid before trying again.
                    uncertain = true;
                    let lookup = async {
                        let children = client.list_children(dir).await.ok()?;
                        let name = children.iter().find(|c| c.starts_with(&unique))?.clone();
                        let node = format!("{dir}/{name}");
                        let stat = client.check_stat(&node).await.ok()??;
                        Some((name, node, stat))
                    };
                    match answer_by(lookup, self.request_end(deadline), interrupt).await {
                        Ok(Some((name, node, stat))) => {
                            sweep(Some(name));
                            return Ok(Some(Created {
                                node,
                                czxid: u64::try_from(stat.czxid).unwrap_or(0),
                                listed: Ok(None),
                            }));
                        }
                        Ok(None) => {
                            if !pause_unless_interrupted(self.request_end(deadline), interrupt)
                                .await
                            {
                                return unanswered_create(Unanswered::Interrupted);
                            }
                        }
                        Err(why) => return unanswered_create(why),
                    }
                }
                Err(e) => {
                    // A timeout or any other failure may also hide a create that happened.
                    sweep(None);
                    return Err(zk_error("creating the contender node", e));
                }
            }
        }
        if uncertain {
            sweep(None);
        }
        Err(Error::backend(
            BACKEND,
            true,
            format!("could not create a contender for `{}`", req.key),
        ))
    }

    /// Queues `req` in `dir` as a contender of `kind` (named as the layout names it) and
    /// waits until the queue rule ([`standing`]) says it holds, watching only the one node
    /// it waits for. `None` when the wait ran out or the caller went away (the node is
    /// deleted then). In the key's own directory, a key in use as a semaphore (of either
    /// layout) is refused with `KindMismatch`.
    async fn queue_for(
        &self,
        attempt: &Attempting<'_>,
        dir: &str,
        kind: LockKind,
        req: &AcquireRequest,
    ) -> Result<Option<Queued>> {
        let Attempting {
            session,
            deadline,
            patient,
            interrupt,
        } = *attempt;
        let client = session.client.clone();
        let mut check_semaphore = dir == self.lock_dir(&req.key);
        let Some(Created {
            node,
            czxid,
            listed,
        }) = self.create_contender(attempt, dir, kind, req, true).await?
        else {
            return Ok(None);
        };
        let name = node[dir.len() + 1..].to_owned();
        // Deletes the node, waiting for that at most one request limit (the deletion goes
        // on in the background after that, for as long as the session lives).
        let limit = self.request_limit();
        let give_up = |node: String| {
            let session = session.clone();
            async move {
                let deleting = tokio::spawn(delete_until_gone(session, node.clone()));
                let deleted = tokio::time::timeout(limit, deleting).await;
                if !matches!(deleted, Ok(Ok(true))) {
                    tracing::warn!(
                        node,
                        "could not delete a contender node yet; retrying in the background"
                    );
                }
            }
        };
        // After a request failed on the connection: ask again after a pause while the
        // deadline allows (the session, and so our node, may well outlive the connection;
        // if the session ends, the node goes with it and the check below says so). Past
        // the deadline the failure is the answer; a caller gone wants none.
        let retry_or_give_up = |node: &str, failure: zookeeper_client::Error, doing: &str| {
            let (node, doing) = (node.to_owned(), doing.to_owned());
            let interrupt = interrupt.clone();
            let give_up = &give_up;
            async move {
                let retry = Instant::now() < deadline;
                if retry && pause_unless_interrupted(deadline, &interrupt).await {
                    return Ok(true);
                }
                give_up(node).await;
                if retry {
                    Ok(false)
                } else {
                    Err(zk_error(&doing, failure))
                }
            }
        };
        // A request still unanswered at its bound: the server is not answering (a retryable
        // error, so the caller does not take it for a held lock); a caller gone wants none.
        let unanswered_wait = |why: Unanswered, doing: &str| match why {
            Unanswered::Interrupted => Ok(None),
            Unanswered::TooLate => Err(unanswered(doing, self.request_limit())),
        };
        let mut listed = match listed {
            Ok(listed) => listed,
            Err(why) => {
                give_up(node).await;
                return unanswered_wait(why, "listing contenders");
            }
        };
        // The lease starts when the grant is observed (the request that found this node at
        // the head of the queue was sent), not when the wait began: a wait longer than the
        // TTL must not yield an expired grant.
        let granted_at = loop {
            // The first look at the queue is the listing sent with the create, if it came.
            let (sent, answer) = match listed.take() {
                Some(Listed {
                    sent,
                    children,
                    stat,
                }) => (sent, Ok((children, stat))),
                None => {
                    let sent = Instant::now();
                    match answer_by(
                        client.get_children(dir),
                        self.request_end(deadline),
                        interrupt,
                    )
                    .await
                    {
                        Ok(answer) => (sent, answer),
                        Err(why) => {
                            give_up(node).await;
                            return unanswered_wait(why, "listing contenders");
                        }
                    }
                }
            };
            let (children, dir_stat) = match answer {
                Ok(listed) => listed,
                Err(e) if connection_failed(&e) => {
                    if retry_or_give_up(&node, e, "listing contenders").await? {
                        continue;
                    }
                    return Ok(None);
                }
                Err(e) => {
                    give_up(node).await;
                    return Err(zk_error("listing contenders", e));
                }
            };
            session.touch(sent);
            // Semaphores keep non-sequential children (Curator's directories, kazoo's
            // leases) or data (kazoo's count) in the key's node; a lock's node has neither.
            if check_semaphore
                && (dir_stat.data_length > 0 || children.iter().any(|c| !is_contender(c)))
            {
                check_semaphore = false;
                let found = match answer_by(
                    semaphore_in_use(&client, dir),
                    self.request_end(deadline),
                    interrupt,
                )
                .await
                {
                    Ok(found) => found,
                    Err(why) => {
                        give_up(node).await;
                        return unanswered_wait(why, "reading the semaphore's nodes");
                    }
                };
                match found {
                    Ok(None) => {}
                    Ok(Some(found)) => {
                        give_up(node).await;
                        return Err(Error::KindMismatch {
                            key: req.key.clone(),
                            found,
                            asked: req.kind,
                        });
                    }
                    Err(e) => {
                        give_up(node).await;
                        return Err(e);
                    }
                }
            }
            let queue = contenders_in_order(&children);
            let Some(position) = queue.iter().position(|c| **c == name) else {
                // Our node vanished: the session expired while we waited.
                return Err(Error::backend(
                    BACKEND,
                    true,
                    "the contender node vanished (session expired?)",
                ));
            };
            let Standing::Behind(blocker) = standing(&queue, position) else {
                break sent;
            };
            if !patient || Instant::now() >= deadline {
                give_up(node).await;
                return Ok(None);
            }
            let predecessor = format!("{dir}/{}", queue[blocker]);
            let watched = match answer_by(
                client.check_and_watch_stat(&predecessor),
                self.request_end(deadline),
                interrupt,
            )
            .await
            {
                Ok(watched) => watched,
                Err(why) => {
                    give_up(node).await;
                    return unanswered_wait(why, "watching the predecessor");
                }
            };
            let watcher = match watched {
                Ok((Some(_), watcher)) => watcher,
                Ok((None, _)) => continue,
                Err(e) if connection_failed(&e) => {
                    if retry_or_give_up(&node, e, "watching the predecessor").await? {
                        continue;
                    }
                    return Ok(None);
                }
                Err(e) => {
                    give_up(node).await;
                    return Err(zk_error("watching the predecessor", e));
                }
            };
            tokio::select! {
                _ = watcher.changed() => {
                    self.inner.wakeups.fetch_add(1, Ordering::SeqCst);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    give_up(node).await;
                    return Ok(None);
                }
                _ = interrupt.interrupted() => {
                    give_up(node).await;
                    return Ok(None);
                }
            }
        };
        Ok(Some(Queued {
            node,
            czxid,
            granted_at,
        }))
    }

    /// Takes `req`'s hold anew (no hold of its owner and kind is live in this client):
    /// a downgrade at once beside the owner's write, a permit, or a place in the key's
    /// queue. `None` when the wait ran out or the caller went away.
    async fn contend(
        &self,
        req: &AcquireRequest,
        wait: Duration,
        interrupt: Interrupt,
    ) -> Result<Option<Grant>> {
        let deadline = deadline_after(wait);
        if req.kind == LockKind::Read
            && let Some(writer) = self.live(LockKind::Write, req.owner, &req.key)
            && let Some(answer) = self.downgrade(req, &writer, deadline, &interrupt).await?
        {
            return Ok(answer);
        }
        // Reopening an expired session may take the client's whole connection timeout,
        // and concurrent acquisitions wait for each other's reopening (one lock): bounded
        // like any request of this acquisition, or the n-th of them answered after n
        // connection attempts to unreachable servers, whatever its wait.
        let session = match answer_by(self.session(), self.request_end(deadline), &interrupt).await
        {
            Ok(session) => session?,
            Err(Unanswered::Interrupted) => return Ok(None),
            Err(Unanswered::TooLate) => {
                return Err(unanswered(
                    "reopening the expired ZooKeeper session",
                    self.request_limit(),
                ));
            }
        };
        let attempt = Attempting {
            session: &session,
            deadline,
            patient: !wait.is_zero(),
            interrupt: &interrupt,
        };
        if let LockKind::Permit { limit } = req.kind {
            return self.take_permit(&attempt, req, limit.get()).await;
        }
        let dir = self.lock_dir(&req.key);
        let Some(queued) = self.queue_for(&attempt, &dir, req.kind, req).await? else {
            return Ok(None);
        };
        Ok(Some(self.register(req, &session, queued, None)))
    }

    /// Makes the hold `req` was granted with `queued`'s node: tracked by its session (loss
    /// fires with it), registered for re-entry and release, its lease enforced.
    fn register(
        &self,
        req: &AcquireRequest,
        session: &Arc<Session>,
        queued: Queued,
        marker: Option<String>,
    ) -> Grant {
        let held = Arc::new(Held {
            node: queued.node,
            key: req.key.clone(),
            owner: req.owner,
            token: FencingToken::new(queued.czxid),
            count: HoldCount::new(req, queued.granted_at),
            loss: req.loss.clone(),
            session: session.clone(),
            released: AtomicBool::new(false),
            identity: req.identity.encode(),
            kind: req.kind,
            attempt: req.attempt,
            marker,
        });
        {
            // Ended holds go as new ones come, so the list stays as long as what is held.
            let mut holds = lock(&session.holds);
            holds.retain(|h| h.strong_count() > 0);
            holds.push(Arc::downgrade(&held));
        }
        match self.registry(req.kind) {
            Some(registry) => registry.insert(req.owner, req.key.clone(), held.clone()),
            None => {
                lock(&self.inner.permits).insert(req.attempt, held.clone());
            }
        }
        if session.dead.load(Ordering::SeqCst) {
            held.loss.fire(LostReason::SessionLost);
        }
        tokio::spawn(enforce_lease(self.clone(), Arc::downgrade(&held)));
        Grant::new(req, held.token, 1, queued.granted_at).with_state(held)
    }

    /// A read beside the owner's own write (downgrade), granted at once: a plain
    /// `EPHEMERAL` read node that carries the writer's sequence (the fixed form of
    /// CURATOR-621), so it keeps the writer's place when the write is released: readers
    /// queued behind may then enter, writers queued behind stay behind. Its token is its
    /// own node's `czxid`. A retried create after a lost reply finds the node it made.
    /// `Some(None)` when the caller went away; `None` when the write ended meanwhile (the
    /// read node is deleted): the read then queues like any other.
    async fn downgrade(
        &self,
        req: &AcquireRequest,
        writer: &Held,
        deadline: Instant,
        interrupt: &Interrupt,
    ) -> Result<Option<Option<Grant>>> {
        let session = writer.session.clone();
        let client = &session.client;
        let dir = self.lock_dir(&req.key);
        let writer_name = writer.node.rsplit('/').next().unwrap_or_default();
        let layout = self.inner.config.layout;
        let Some(name) = downgrade_name(layout, writer_name, Uuid::new_v4()) else {
            return Err(Error::backend(
                BACKEND,
                false,
                format!("the write node `{writer_name}` has no sequence to downgrade with"),
            ));
        };
        let node = format!("{dir}/{name}");
        let data = contender_record(&req.owner.to_string(), 1, &req.identity.encode());
        let ephemeral = CreateMode::Ephemeral.with_acls(Acls::anyone_all());
        // Once sent, a create's outcome is unknown until answered: delete the node unless
        // the hold is made.
        let mut unknown = DeleteOnDrop(Some((session.clone(), node.clone())));
        for _ in 0..5 {
            let sent = Instant::now();
            let created = match answer_by(
                client.create(&node, data.as_bytes(), &ephemeral),
                self.request_end(deadline),
                interrupt,
            )
            .await
            {
                Ok(created) => created,
                Err(Unanswered::Interrupted) => return Ok(Some(None)),
                Err(Unanswered::TooLate) => {
                    return Err(unanswered("creating the read node", self.request_limit()));
                }
            };
            let czxid = match created {
                Ok((stat, _)) => stat.czxid,
                // Ours (its name is new): the reply to an earlier try was lost.
                Err(zookeeper_client::Error::NodeExists) => match client.check_stat(&node).await {
                    Ok(Some(stat)) => stat.czxid,
                    Ok(None) => continue,
                    Err(e) => return Err(zk_error("reading the read node", e)),
                },
                Err(e) if connection_failed(&e) => {
                    if !pause_unless_interrupted(self.request_end(deadline), interrupt).await {
                        return Ok(Some(None));
                    }
                    continue;
                }
                Err(e) => return Err(zk_error("creating the read node", e)),
            };
            session.touch(sent);
            if writer.loss.is_fired() || writer.released.load(Ordering::SeqCst) {
                // The write ended meanwhile: the read must queue like any other (its node,
                // which may stand in the write's place, is deleted first). Answering "not
                // granted" here failed a read with a long wait at once with `Timeout`.
                unknown.0 = None;
                let deleting = tokio::spawn(delete_until_gone(session.clone(), node));
                let _ = tokio::time::timeout(self.request_limit(), deleting).await;
                return Ok(None);
            }
            unknown.0 = None;
            let queued = Queued {
                node,
                czxid: u64::try_from(czxid).unwrap_or(0),
                granted_at: sent,
            };
            return Ok(Some(Some(self.register(req, &session, queued, None))));
        }
        Err(Error::backend(
            BACKEND,
            true,
            format!("could not create a read node for `{}`", req.key),
        ))
    }

    /// One permit, as Curator's InterProcessSemaphoreV2 takes a lease: register in
    /// `lockkit-permits` (which checks the permit count), take the semaphore's mutex in
    /// `<key>/locks` (the FIFO queue, with predecessor watches), create the lease
    /// `<key>/leases/_c_<uuid>-lease-<seq>`, and wait (watching `leases`) until at most
    /// `limit` leases exist, the own one included. The mutex is let go in every case; on
    /// a timeout, an error or cancellation the lease and the registration are deleted too.
    async fn take_permit(
        &self,
        attempt: &Attempting<'_>,
        req: &AcquireRequest,
        limit: u32,
    ) -> Result<Option<Grant>> {
        let Attempting {
            session,
            deadline,
            patient,
            interrupt,
        } = *attempt;
        if self.inner.config.layout == ZkLayout::Kazoo {
            return self.take_kazoo_permit(attempt, req, limit).await;
        }
        let client = &session.client;
        let dir = self.lock_dir(&req.key);
        let marker = format!("{dir}/{PERMITS_DIR}/{}", Uuid::new_v4());
        let mut unmark = DeleteOnDrop(Some((session.clone(), marker.clone())));
        match answer_by(
            self.mark_permit(client, &dir, &marker, req, limit),
            self.request_end(deadline),
            interrupt,
        )
        .await
        {
            Ok(marked) => marked?,
            Err(Unanswered::Interrupted) => return Ok(None),
            Err(Unanswered::TooLate) => {
                return Err(unanswered("registering the permit", self.request_limit()));
            }
        }
        let leases = format!("{dir}/{LEASES_DIR}");
        // First without the mutex: a lease that finds at most `limit` leases, its own
        // included, holds. That is safe whoever else takes leases at once (each checks a
        // count that includes every lease granted before its check), and it lets permits
        // be taken concurrently while the semaphore has room. Only when it is full does a
        // waiter queue on the mutex, as Curator's do: a lease taken this way backs off at
        // once when it sees one too many, so queued waiters keep their turn.
        let queued = match self.lease(attempt, &leases, req, limit, false).await? {
            Leased::Granted(queued) => queued,
            Leased::GaveUp => return Ok(None),
            Leased::Full if !patient => return Ok(None),
            Leased::Full => {
                let locks = format!("{dir}/{LOCKS_DIR}");
                let Some(mutex) = self
                    .queue_for(attempt, &locks, LockKind::Exclusive, req)
                    .await?
                else {
                    return Ok(None);
                };
                // Let go of when this returns, whatever happens (as Curator's `finally`).
                let _unlock = DeleteOnDrop(Some((session.clone(), mutex.node)));
                match self.lease(attempt, &leases, req, limit, true).await? {
                    Leased::Granted(queued) => queued,
                    Leased::Full | Leased::GaveUp => return Ok(None),
                }
            }
        };
        unmark.0 = None;
        Ok(Some(self.register(req, session, queued, Some(marker))))
    }

    /// One permit in kazoo's `Semaphore` layout (`layout=kazoo`), taken as kazoo takes a
    /// lease: the semaphore node `<root>/<key>` (persistent, its data the permit count,
    /// checked as kazoo checks it), then kazoo's `Lock` at the sibling
    /// `<root>/<key>-__lock__` (the FIFO queue, with predecessor watches, in kazoo's names),
    /// and under it: list the leases (watching them), create the lease `<root>/<key>/<uuid
    /// hex>` (ephemeral, not sequential) when fewer than `limit` exist, or wait for the
    /// leases to change. Always under the lock, unlike the Curator layout's first try: kazoo
    /// counts before it creates, so a lease created beside a kazoo lock holder could make
    /// one too many. Only the lock's holder watches the leases (no herd). The lock is let go
    /// in every case; a lease whose create was sent is deleted unless it is granted.
    async fn take_kazoo_permit(
        &self,
        attempt: &Attempting<'_>,
        req: &AcquireRequest,
        limit: u32,
    ) -> Result<Option<Grant>> {
        let Attempting {
            session,
            deadline,
            interrupt,
            ..
        } = *attempt;
        let semaphore = self.lock_dir(&req.key);
        match answer_by(
            self.kazoo_semaphore_node(&session.client, &semaphore, req, limit),
            self.request_end(deadline),
            interrupt,
        )
        .await
        {
            Ok(made) => made?,
            Err(Unanswered::Interrupted) => return Ok(None),
            Err(Unanswered::TooLate) => {
                return Err(unanswered(
                    "setting up the semaphore node",
                    self.request_limit(),
                ));
            }
        }
        let lock_dir = format!("{semaphore}{KAZOO_SEMAPHORE_LOCK_SUFFIX}");
        let Some(mutex) = self
            .queue_for(attempt, &lock_dir, LockKind::Exclusive, req)
            .await?
        else {
            return Ok(None);
        };
        // Let go of when this returns, whatever happens (kazoo's `finally: lock.release()`).
        let mut unlock = DeleteOnDrop(Some((session.clone(), mutex.node.clone())));
        let leased = self.kazoo_lease(attempt, &semaphore, req, limit).await;
        // Deleted before answering, so that a client that asks next finds the lock free
        // (kept on in the background if the server is slow).
        unlock.0 = None;
        let deleting = tokio::spawn(delete_until_gone(session.clone(), mutex.node));
        let _ = tokio::time::timeout(self.request_limit(), deleting).await;
        Ok(leased?.map(|queued| self.register(req, session, queued, None)))
    }

    /// Under a kazoo semaphore's lock: the lease of one permit in `semaphore`, as kazoo's
    /// `_get_lease` takes it (list the leases with a watch; create one when fewer than
    /// `limit` exist), waiting for the leases to change while it may. A create whose reply
    /// was lost is found again by its name (new for each attempt). `None` when the wait ran
    /// out or the caller went away; a lease whose create was sent is deleted then.
    ///
    /// # Errors
    /// [`Error::KindMismatch`] when the key's node holds lock contenders or a Curator-layout
    /// semaphore (decided on the leader's view); [`Error::Backend`] when ZooKeeper fails.
    async fn kazoo_lease(
        &self,
        attempt: &Attempting<'_>,
        semaphore: &str,
        req: &AcquireRequest,
        limit: u32,
    ) -> Result<Option<Queued>> {
        let Attempting {
            session,
            deadline,
            patient,
            interrupt,
        } = *attempt;
        let client = &session.client;
        let name = Uuid::new_v4().simple().to_string();
        let lease = format!("{semaphore}/{name}");
        let data = contender_record(&req.owner.to_string(), 1, &req.identity.encode());
        let ephemeral = CreateMode::Ephemeral.with_acls(Acls::anyone_all());
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        // Armed once a create is sent: its outcome is unknown until answered.
        let mut unlease = DeleteOnDrop(None);
        // When the first create was sent: a lease found after a lost reply may date from it.
        let mut first_sent: Option<Instant> = None;
        let mut synced = false;
        let unanswered_wait = |why: Unanswered, doing: &str| match why {
            Unanswered::Interrupted => Ok(None),
            Unanswered::TooLate => Err(unanswered(doing, self.request_limit())),
        };
        let granted = |unlease: &mut DeleteOnDrop, czxid: i64, granted_at: Instant| {
            unlease.0 = None;
            Ok(Some(Queued {
                node: lease.clone(),
                czxid: u64::try_from(czxid).unwrap_or(0),
                granted_at,
            }))
        };
        loop {
            let sent = Instant::now();
            let listed = match answer_by(
                client.list_and_watch_children(semaphore),
                self.request_end(deadline),
                interrupt,
            )
            .await
            {
                Ok(listed) => listed,
                Err(why) => return unanswered_wait(why, "listing the semaphore's leases"),
            };
            let (children, watcher) = match listed {
                Ok(listed) => listed,
                Err(e) if connection_failed(&e) && Instant::now() < deadline => {
                    if !pause_unless_interrupted(deadline, interrupt).await {
                        return Ok(None);
                    }
                    continue;
                }
                Err(zookeeper_client::Error::NoNode) => {
                    return Err(Error::backend(
                        BACKEND,
                        true,
                        format!("the semaphore node `{semaphore}` was deleted meanwhile"),
                    ));
                }
                Err(e) => return Err(zk_error("listing the semaphore's leases", e)),
            };
            session.touch(sent);
            if children.contains(&name) {
                // Our create went through, its reply was lost.
                match client.check_stat(&lease).await {
                    Ok(Some(stat)) => {
                        return granted(&mut unlease, stat.czxid, first_sent.unwrap_or(sent));
                    }
                    Ok(None) => {
                        return Err(Error::backend(
                            BACKEND,
                            true,
                            "the lease node vanished (session expired?)",
                        ));
                    }
                    Err(e) => return Err(zk_error("reading the lease node", e)),
                }
            }
            let other = children.iter().find(|c| !is_kazoo_lease(c));
            if let Some(other) = other {
                // A refusal is final: decided on the leader's view (the sync), never on a
                // follower's that may still list a deleted node.
                if !synced {
                    client
                        .sync("/")
                        .await
                        .map_err(|e| zk_error("syncing before refusing a permit", e))?;
                    synced = true;
                    continue;
                }
                let found = if is_contender(other) {
                    "is used as a lock".to_owned()
                } else {
                    "is a semaphore in Curator's layout (take its permits with \
                     `layout=curator`)"
                        .to_owned()
                };
                return Err(Error::KindMismatch {
                    key: req.key.clone(),
                    found,
                    asked: req.kind,
                });
            }
            if children.len() < limit {
                let sent = Instant::now();
                first_sent.get_or_insert(sent);
                unlease.0 = Some((session.clone(), lease.clone()));
                let created = match answer_by(
                    client.create(&lease, data.as_bytes(), &ephemeral),
                    self.request_end(deadline),
                    interrupt,
                )
                .await
                {
                    Ok(created) => created,
                    Err(why) => return unanswered_wait(why, "creating the lease node"),
                };
                match created {
                    Ok((stat, _)) => {
                        session.touch(sent);
                        return granted(&mut unlease, stat.czxid, sent);
                    }
                    // Listed again: the lease is found by its name if it was made.
                    Err(e) if connection_failed(&e) || e == zookeeper_client::Error::NodeExists => {
                        if !pause_unless_interrupted(self.request_end(deadline), interrupt).await {
                            return Ok(None);
                        }
                        continue;
                    }
                    Err(e) => return Err(zk_error("creating the lease node", e)),
                }
            }
            if !patient || Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::select! {
                _ = watcher.changed() => {
                    self.inner.wakeups.fetch_add(1, Ordering::SeqCst);
                }
                _ = tokio::time::sleep_until(deadline) => return Ok(None),
                _ = interrupt.interrupted() => return Ok(None),
            }
        }
    }

    /// Makes sure `semaphore` is a kazoo semaphore node of `limit` permits, as kazoo's
    /// `Semaphore._ensure_path` does: created persistent (kazoo's node stays after the last
    /// lease) with the count as its data when missing; otherwise its data is checked. Data
    /// that is not a number is accepted unchecked, as kazoo accepts it. An empty node
    /// without children (a lock's container, which the server would remove under kazoo's
    /// feet, or a node kazoo has not written its count to yet) is replaced by a persistent
    /// node with the count.
    ///
    /// # Errors
    /// [`Error::KindMismatch`] when the node keeps another count (kazoo's `ValueError`),
    /// decided on the leader's view; [`Error::Backend`] when ZooKeeper fails.
    async fn kazoo_semaphore_node(
        &self,
        client: &Client,
        semaphore: &str,
        req: &AcquireRequest,
        limit: u32,
    ) -> Result<()> {
        let count = limit.to_string();
        let acls = Acls::anyone_all();
        let persistent = CreateMode::Persistent.with_acls(acls);
        let mut synced = false;
        for _ in 0..8 {
            let (data, stat) = match client.get_data(semaphore).await {
                Ok(read) => read,
                Err(zookeeper_client::Error::NoNode) => {
                    client
                        .mkdir(&self.inner.config.root, &persistent)
                        .await
                        .map_err(|e| root_error(&self.inner.config, e))?;
                    match client
                        .create(semaphore, count.as_bytes(), &persistent)
                        .await
                    {
                        Ok(_) => return Ok(()),
                        Err(
                            zookeeper_client::Error::NodeExists | zookeeper_client::Error::NoNode,
                        ) => continue,
                        Err(e) => return Err(zk_error("creating the semaphore node", e)),
                    }
                }
                Err(e) => return Err(zk_error("reading the semaphore node", e)),
            };
            match kazoo_count(&data) {
                Some(stored) if stored == i64::from(limit) => return Ok(()),
                Some(_) if !synced => {
                    client
                        .sync("/")
                        .await
                        .map_err(|e| zk_error("syncing before refusing a permit", e))?;
                    synced = true;
                }
                Some(stored) => {
                    return Err(Error::KindMismatch {
                        key: req.key.clone(),
                        found: format!(
                            "is a kazoo semaphore of {stored} permits (the count is the data of \
                             `{semaphore}`, which stays after the last lease: delete that node \
                             to change it)"
                        ),
                        asked: req.kind,
                    });
                }
                None if !data.is_empty() => return Ok(()),
                // In use (a lock's queue, a Curator-layout semaphore): the lease loop
                // refuses it.
                None if stat.num_children > 0 => return Ok(()),
                // Empty: a lock's node (a container, which the server removes once its last
                // child went, under kazoo's feet: its node must stay) or one kazoo's
                // `ensure_path` made before writing its count. The server hides containers
                // in `Stat`, so either is replaced, in one transaction (never missing for
                // anyone), by the persistent node with the count.
                None => {
                    let mut replace = client.new_multi_writer();
                    replace
                        .add_delete(semaphore, Some(stat.version))
                        .and_then(|()| replace.add_create(semaphore, count.as_bytes(), &persistent))
                        .map_err(|e| zk_error("making the semaphore node", e))?;
                    match replace
                        .commit()
                        .await
                        .map_err(zookeeper_client::Error::from)
                    {
                        Ok(_) => return Ok(()),
                        // Changed meanwhile: look again.
                        Err(
                            zookeeper_client::Error::NoNode
                            | zookeeper_client::Error::BadVersion
                            | zookeeper_client::Error::NotEmpty
                            | zookeeper_client::Error::NodeExists,
                        ) => {}
                        Err(e) => return Err(zk_error("making the semaphore node", e)),
                    }
                }
            }
        }
        Err(Error::backend(
            BACKEND,
            true,
            format!("could not set up the semaphore node of `{}`", req.key),
        ))
    }

    /// Creates a lease in `leases` and, while `wait`ing (and the deadline allows), waits
    /// (watching `leases`) until at most `limit` leases exist, its own included. A lease
    /// that does not hold is deleted.
    async fn lease(
        &self,
        attempt: &Attempting<'_>,
        leases: &str,
        req: &AcquireRequest,
        limit: u32,
        wait: bool,
    ) -> Result<Leased> {
        let Attempting {
            session,
            deadline,
            interrupt,
            ..
        } = *attempt;
        let client = &session.client;
        // Listed below with a watch, not with the create.
        let Some(Created {
            node: lease, czxid, ..
        }) = self
            .create_contender(attempt, leases, req.kind, req, false)
            .await?
        else {
            return Ok(Leased::GaveUp);
        };
        let mut unlease = DeleteOnDrop(Some((session.clone(), lease.clone())));
        let name = lease[leases.len() + 1..].to_owned();
        let granted_at = loop {
            let sent = Instant::now();
            let listed = match answer_by(
                client.list_and_watch_children(leases),
                self.request_end(deadline),
                interrupt,
            )
            .await
            {
                Ok(listed) => listed,
                Err(Unanswered::Interrupted) => return Ok(Leased::GaveUp),
                Err(Unanswered::TooLate) => {
                    return Err(unanswered("listing leases", self.request_limit()));
                }
            };
            let (children, watcher) = match listed {
                Ok(listed) => listed,
                Err(e) if connection_failed(&e) && Instant::now() < deadline => {
                    if !pause_unless_interrupted(deadline, interrupt).await {
                        return Ok(Leased::GaveUp);
                    }
                    continue;
                }
                Err(e) => return Err(zk_error("listing leases", e)),
            };
            session.touch(sent);
            if !children.contains(&name) {
                return Err(Error::backend(
                    BACKEND,
                    true,
                    "the lease node vanished (session expired?)",
                ));
            }
            if children.len() <= usize::try_from(limit).unwrap_or(usize::MAX) {
                break sent;
            }
            if !wait || Instant::now() >= deadline {
                // Gone before anyone queues behind it, so the count it inflated is right
                // again when this returns.
                unlease.0 = None;
                let limit = self.request_limit();
                // In a task of its own: a first delete left unanswered past the limit, or
                // this future dropped while it waits, must not leave the lease behind.
                let deleting = tokio::spawn(delete_until_gone(session.clone(), lease));
                let _ = tokio::time::timeout(limit, deleting).await;
                return Ok(if wait { Leased::GaveUp } else { Leased::Full });
            }
            tokio::select! {
                _ = watcher.changed() => {
                    self.inner.wakeups.fetch_add(1, Ordering::SeqCst);
                }
                _ = tokio::time::sleep_until(deadline) => return Ok(Leased::GaveUp),
                _ = interrupt.interrupted() => return Ok(Leased::GaveUp),
            }
        };
        unlease.0 = None;
        Ok(Leased::Granted(Queued {
            node: lease,
            czxid,
            granted_at,
        }))
    }

    /// Registers a permit of a `limit`-permit semaphore as the ephemeral node `marker`
    /// under `<dir>/lockkit-permits`: a container whose data is the permit count (Curator
    /// stores none), so lockkit clients can check they agree on it. A container left by
    /// a semaphore nobody uses any more (no registration) is replaced.
    ///
    /// # Errors
    /// [`Error::KindMismatch`] when lockkit permits of another count are out, or the key
    /// is queued for as a lock; [`Error::Backend`] when ZooKeeper fails (the marker may
    /// exist then: the caller deletes it).
    async fn mark_permit(
        &self,
        client: &Client,
        dir: &str,
        marker: &str,
        req: &AcquireRequest,
        limit: u32,
    ) -> Result<()> {
        let mismatch = |found: String| Error::KindMismatch {
            key: req.key.clone(),
            found,
            asked: req.kind,
        };
        let permits = format!("{dir}/{PERMITS_DIR}");
        // Both asked at once: one round trip.
        let (mut listed, mut first) =
            tokio::join!(client.get_children(dir), client.get_data(&permits));
        // A lock's contenders, or a kazoo semaphore's count or leases in the key's node
        // (kazoo would count Curator's directories as leases).
        let as_lock = |children: &[String]| !contenders_in_order(children).is_empty();
        let as_kazoo = |children: &[String], stat: &zookeeper_client::Stat| {
            stat.data_length > 0 || children.iter().any(|c| is_kazoo_lease(c))
        };
        if matches!(&listed, Ok((children, stat)) if as_lock(children) || as_kazoo(children, stat))
        {
            // A follower may still list a lock's node that another session deleted: a
            // refusal is final, so it is decided on the leader's view (the sync), never on
            // a lagging one. Only this rare path pays the round trip.
            client
                .sync("/")
                .await
                .map_err(|e| zk_error("syncing before refusing a permit", e))?;
            (listed, first) = tokio::join!(client.get_children(dir), client.get_data(&permits));
        }
        match listed {
            Ok((children, _)) if as_lock(&children) => {
                return Err(mismatch("is used as a lock".into()));
            }
            Ok((children, stat)) if as_kazoo(&children, &stat) => {
                return Err(mismatch(
                    "is a semaphore in kazoo's layout (its node keeps kazoo's count or leases): \
                     take its permits with `layout=kazoo`"
                        .into(),
                ));
            }
            Ok(_) | Err(zookeeper_client::Error::NoNode) => {}
            Err(e) => return Err(zk_error("listing the key's nodes", e)),
        }
        let mut first = Some(first);
        let mut synced = false;
        let acls = Acls::anyone_all();
        let container = CreateMode::Container.with_acls(acls);
        let ephemeral = CreateMode::Ephemeral.with_acls(acls);
        for _ in 0..8 {
            let read = match first.take() {
                Some(read) => read,
                None => client.get_data(&permits).await,
            };
            match read {
                Ok((data, stat)) => {
                    let stored = String::from_utf8_lossy(&data).trim().to_owned();
                    if stored != limit.to_string() {
                        if stat.num_children > 0 && !synced {
                            // As above: refuse only on the leader's view.
                            client
                                .sync("/")
                                .await
                                .map_err(|e| zk_error("syncing before refusing a permit", e))?;
                            synced = true;
                            continue;
                        }
                        if stat.num_children > 0 {
                            return Err(mismatch(format!("is a semaphore of {stored} permits")));
                        }
                        // Nobody's: a container the server has not removed yet.
                        let _ = client.delete(&permits, Some(stat.version)).await;
                        continue;
                    }
                    match client.create(marker, &[], &ephemeral).await {
                        Ok(_) | Err(zookeeper_client::Error::NodeExists) => return Ok(()),
                        Err(zookeeper_client::Error::NoNode) => continue,
                        Err(e) => return Err(zk_error("registering the permit", e)),
                    }
                }
                Err(zookeeper_client::Error::NoNode) => {
                    let persistent = CreateMode::Persistent.with_acls(acls);
                    client
                        .mkdir(&self.inner.config.root, &persistent)
                        .await
                        .map_err(|e| root_error(&self.inner.config, e))?;
                    client
                        .mkdir(dir, &container)
                        .await
                        .map_err(|e| zk_error("creating the key's container node", e))?;
                    match client
                        .create(&permits, limit.to_string().as_bytes(), &container)
                        .await
                    {
                        Ok(_)
                        | Err(
                            zookeeper_client::Error::NodeExists | zookeeper_client::Error::NoNode,
                        ) => {}
                        Err(e) => return Err(zk_error("creating the permit count node", e)),
                    }
                }
                Err(e) => return Err(zk_error("reading the permit count", e)),
            }
        }
        Err(Error::backend(
            BACKEND,
            true,
            format!("could not register a permit of `{}`", req.key),
        ))
    }

    async fn acquire_within(&self, req: &AcquireRequest, wait: Duration) -> Result<Option<Grant>> {
        self.refuse_conflicting_kinds(req)?;
        let existing = match self.registry(req.kind) {
            Some(registry) => registry.get(req.owner, &req.key),
            // A permit is never re-entered; only a retried attempt finds its own.
            None => lock(&self.inner.permits).get(&req.attempt).cloned(),
        };
        if let Some(held) = existing.filter(|h| !h.loss.is_fired()) {
            // Its own task, like a fresh acquisition: if the caller goes away while the
            // depth is being recorded for `inspect`, the hold it added is given back.
            let (request, giver, this) = (req.clone(), self.clone(), self.clone());
            let limit = self.request_limit();
            let reentered = detached_acquire(
                BACKEND,
                move |_| async move {
                    let start = Instant::now();
                    let Some(depth) = held.count.reenter(&request, start, held.loss.is_fired())
                    else {
                        return Ok(None);
                    };
                    // Recorded for `inspect`; a silent server must not hold the re-entry up.
                    // An answer that the node is gone ends the hold: it was deleted behind
                    // our back (an operator, a reaper) or went with its session, and another
                    // client may hold the key now. Granting the re-entry then was a double
                    // grant until the next renewal found out.
                    let gone = match tokio::time::timeout(limit, record_depth(&held, depth)).await {
                        Ok(Err(zookeeper_client::Error::NoNode)) => Some(LostReason::NotOurs),
                        // The node went with its session, as `lost()` says of an expiry.
                        Ok(Err(zookeeper_client::Error::SessionExpired)) => {
                            Some(LostReason::SessionLost)
                        }
                        _ => None,
                    };
                    if let Some(reason) = gone {
                        this.forget(&held);
                        held.loss.fire(reason);
                        return Ok(None);
                    }
                    let grant = Grant::new(&request, held.token, depth, start);
                    Ok(Some(grant.with_state(held)))
                },
                std::convert::identity,
                move |grant| async move {
                    let _ = giver.release(&grant).await;
                },
            )
            .await?;
            if let Some(grant) = reentered {
                return Ok(Some(grant));
            }
            // Another task of this owner just released the last hold (its node is being
            // deleted): the hold is over. Ask afresh.
        }
        let (this, request, giver) = (self.clone(), req.clone(), self.clone());
        detached_acquire(
            BACKEND,
            move |interrupt| async move { this.contend(&request, wait, interrupt).await },
            std::convert::identity,
            move |grant| async move {
                let _ = giver.release(&grant).await;
            },
        )
        .await
    }
}

/// What one acquisition works with: its session, its deadline, whether it may wait at
/// all (`false` for a try), and its caller's interrupt.
#[derive(Clone, Copy)]
struct Attempting<'a> {
    session: &'a Arc<Session>,
    deadline: Instant,
    patient: bool,
    interrupt: &'a Interrupt,
}

/// What one try for a lease came to.
enum Leased {
    /// The lease holds.
    Granted(Queued),
    /// The semaphore was full (the lease is deleted).
    Full,
    /// The wait ran out or the caller went away (the lease is deleted).
    GaveUp,
}

/// A contender node just created.
struct Created {
    node: String,
    czxid: u64,
    /// Its directory's children, listed in the same round trip (after the create), if
    /// listed; why not, if that listing went unanswered (the caller gone, or its bound
    /// passed): the node must be given up then.
    listed: std::result::Result<Option<Listed>, Unanswered>,
}

/// A listing of a lock's directory.
struct Listed {
    /// When the listing was sent.
    sent: Instant,
    children: Vec<String>,
    stat: zookeeper_client::Stat,
}

/// A contender node that reached the point where it holds.
struct Queued {
    node: String,
    czxid: u64,
    /// When the request that saw it hold was sent: the lease counts from here.
    granted_at: Instant,
}

/// The holders at `nodes` (path and kind), each with `waiters`; `None` when a node is gone
/// (the queue moved: list it again).
async fn read_holders(
    client: &Client,
    nodes: Vec<(String, LockKind)>,
    waiters: u32,
) -> Result<Option<Vec<HolderInfo>>> {
    let mut found = Vec::with_capacity(nodes.len());
    for (node, kind) in nodes {
        let name = node.rsplit('/').next().unwrap_or_default();
        match client.get_data(&node).await {
            Ok((data, stat)) => {
                let (owner, depth, identity) =
                    parse_contender_record(&data, &format!("node {name}"));
                let token = FencingToken::new(u64::try_from(stat.czxid).unwrap_or(0));
                let info = HolderInfo::new(owner, depth, Some(token), None)
                    .with_identity(identity)
                    .with_waiters(waiters);
                // A plain lock is reported as before: no kind.
                found.push(match kind {
                    LockKind::Exclusive => info,
                    kind => info.with_kind(kind),
                });
            }
            Err(zookeeper_client::Error::NoNode) => return Ok(None),
            Err(e) => return Err(zk_error("reading the holder node", e)),
        }
    }
    Ok(Some(found))
}

/// A semaphore's holders: its leases in sequence order, the first `limit` of them when
/// lockkit stored the count (more exist only while a waiter checks), all otherwise.
async fn permit_holders(client: &Client, dir: &str) -> Result<Option<Vec<HolderInfo>>> {
    let limit = match client.get_data(&format!("{dir}/{PERMITS_DIR}")).await {
        Ok((data, _)) => String::from_utf8_lossy(&data).trim().parse::<u32>().ok(),
        Err(zookeeper_client::Error::NoNode) => None,
        Err(e) => return Err(zk_error("reading the permit count", e)),
    };
    let leases = format!("{dir}/{LEASES_DIR}");
    let mut children = match client.list_children(&leases).await {
        Ok(children) => children,
        Err(zookeeper_client::Error::NoNode) => return Ok(Some(Vec::new())),
        Err(e) => return Err(zk_error("listing leases", e)),
    };
    children.sort_by_key(|c| (sequence_of(c), c.clone()));
    let total = u32::try_from(children.len()).unwrap_or(u32::MAX);
    let holding = limit.unwrap_or(total).min(total);
    let kind =
        std::num::NonZeroU32::new(limit.unwrap_or(total)).map(|limit| LockKind::Permit { limit });
    let nodes = children
        .iter()
        .take(usize::try_from(holding).unwrap_or(usize::MAX))
        .filter_map(|c| Some((format!("{leases}/{c}"), kind?)))
        .collect();
    read_holders(client, nodes, total - holding).await
}

/// A kazoo semaphore's holders: every lease in its node (kazoo counts them all), with the
/// count its data keeps; `waiters` counts the contenders of its lock at
/// `<dir>-__lock__` (the one at the head may be about to take a free lease).
async fn kazoo_permit_holders(
    client: &Client,
    dir: &str,
    children: &[String],
) -> Result<Option<Vec<HolderInfo>>> {
    let limit = match client.get_data(dir).await {
        Ok((data, _)) => kazoo_count(&data).and_then(|n| u32::try_from(n).ok()),
        Err(zookeeper_client::Error::NoNode) => return Ok(None),
        Err(e) => return Err(zk_error("reading the semaphore's count", e)),
    };
    let waiters = match client
        .list_children(&format!("{dir}{KAZOO_SEMAPHORE_LOCK_SUFFIX}"))
        .await
    {
        Ok(queued) => u32::try_from(contenders_in_order(&queued).len()).unwrap_or(u32::MAX),
        Err(zookeeper_client::Error::NoNode) => 0,
        Err(e) => return Err(zk_error("listing the semaphore's lock", e)),
    };
    let leases: Vec<&String> = children.iter().filter(|c| is_kazoo_lease(c)).collect();
    let total = u32::try_from(leases.len()).unwrap_or(u32::MAX);
    let kind =
        std::num::NonZeroU32::new(limit.unwrap_or(total)).map(|limit| LockKind::Permit { limit });
    let nodes = leases
        .into_iter()
        .filter_map(|c| Some((format!("{dir}/{c}"), kind?)))
        .collect();
    read_holders(client, nodes, waiters).await
}

/// Whether the key whose directory is `dir` is in use as a semaphore (leases or lockkit
/// permit registrations exist), and as what.
async fn semaphore_in_use(client: &Client, dir: &str) -> Result<Option<String>> {
    if semaphore_seen(client, dir).await?.is_none() {
        return Ok(None);
    }
    // A refusal is final: decide it on the leader's view, not a follower's that may still
    // list another session's released permits (only this rare path pays the sync).
    client
        .sync("/")
        .await
        .map_err(|e| zk_error("syncing before refusing a lock", e))?;
    semaphore_seen(client, dir).await
}

/// [`semaphore_in_use`] on whatever view the session's server has: a kazoo semaphore (a
/// count in the key's node, or leases in it) or a Curator one.
async fn semaphore_seen(client: &Client, dir: &str) -> Result<Option<String>> {
    let (children, data) = match tokio::join!(client.list_children(dir), client.get_data(dir)) {
        (Ok(children), Ok((data, _))) => (children, data),
        (Err(zookeeper_client::Error::NoNode), _) | (_, Err(zookeeper_client::Error::NoNode)) => {
            return Ok(None);
        }
        (Err(e), _) | (_, Err(e)) => return Err(zk_error("reading the key's node", e)),
    };
    if let Some(count) = kazoo_count(&data) {
        return Ok(Some(format!(
            "is a kazoo semaphore of {count} permits (kazoo keeps its node `{dir}` and the \
             count in it after the last lease: delete the node to use the key otherwise)"
        )));
    }
    if children.iter().any(|c| is_kazoo_lease(c)) {
        return Ok(Some("is used as a semaphore (kazoo's layout)".into()));
    }
    if !children.iter().any(|c| c == LEASES_DIR || c == PERMITS_DIR) {
        return Ok(None);
    }
    curator_semaphore_seen(client, dir).await
}

/// The permit count a kazoo semaphore keeps as its node's data, read as kazoo reads it
/// (`int(data.decode("utf-8"))`); `None` for data that is not a number, which kazoo
/// ignores too.
fn kazoo_count(data: &[u8]) -> Option<i64> {
    std::str::from_utf8(data).ok()?.trim().parse().ok()
}

/// A Curator-layout semaphore in `dir`: leases, or lockkit's permit registrations.
async fn curator_semaphore_seen(client: &Client, dir: &str) -> Result<Option<String>> {
    let leases = match client.list_children(&format!("{dir}/{LEASES_DIR}")).await {
        Ok(leases) => leases.len(),
        Err(zookeeper_client::Error::NoNode) => 0,
        Err(e) => return Err(zk_error("listing leases", e)),
    };
    let (count, marked) = match client.get_data(&format!("{dir}/{PERMITS_DIR}")).await {
        Ok((data, stat)) => (
            Some(String::from_utf8_lossy(&data).trim().to_owned()),
            stat.num_children,
        ),
        Err(zookeeper_client::Error::NoNode) => (None, 0),
        Err(e) => return Err(zk_error("reading the permit count", e)),
    };
    if leases == 0 && marked == 0 {
        return Ok(None);
    }
    Ok(Some(match count {
        Some(count) if marked > 0 => format!("is a semaphore of {count} permits"),
        _ => "is used as a semaphore".into(),
    }))
}

/// Node data with the hold count when above one (for `inspect`): the server's answer.
async fn record_depth(held: &Held, depth: u32) -> std::result::Result<(), zookeeper_client::Error> {
    let data = contender_record(&held.owner.to_string(), depth, &held.identity);
    held.session
        .client
        .set_data(&held.node, data.as_bytes(), None)
        .await
        .map(|_| ())
}

async fn open_session(config: &ZkConfig) -> Result<Arc<Session>> {
    let sent = Instant::now();
    let client = Client::connector()
        .with_session_timeout(config.session_timeout)
        .with_connection_timeout(config.connect_timeout)
        .connect(&config.connect)
        .await
        .map_err(|e| match e {
            zookeeper_client::Error::NoHosts | zookeeper_client::Error::Timeout => {
                Error::backend_with_source(
                    BACKEND,
                    true,
                    format!(
                        "no ZooKeeper server of `{}` answered; are they running?",
                        config.connect
                    ),
                    e,
                )
            }
            e => zk_error(&format!("connecting to `{}`", config.connect), e),
        })?;
    let negotiated = client.session_timeout();
    if negotiated != config.session_timeout {
        return Err(Error::Config(format!(
            "the servers granted a {negotiated:?} session for the {:?} asked: they accept only \
             timeouts within their minSessionTimeout..maxSessionTimeout; choose a \
             session_timeout in that range",
            config.session_timeout
        )));
    }
    let session = Arc::new(Session {
        client,
        last_contact: Mutex::new(Stamp::new(sent)),
        holds: Mutex::new(Vec::new()),
        dead: AtomicBool::new(false),
    });
    tokio::spawn(monitor(Arc::downgrade(&session), config.session_timeout));
    Ok(session)
}

/// Watches one session: expiry loses every hold at once; a disconnect loses them once two
/// thirds of the session timeout have passed since the server last answered; in between,
/// a cheap request every quarter of the timeout keeps `last_contact` fresh.
async fn monitor(session: Weak<Session>, timeout: Duration) {
    let Some(mut watcher) = session.upgrade().map(|s| s.client.state_watcher()) else {
        return;
    };
    let ping_every = timeout / 4;
    let mut connected = true;
    // The deadline the holds were already given up for: not armed again until the server
    // answers and the deadline moves (re-arming a past deadline spun a core at 100%).
    let mut given_up: Option<Instant> = None;
    loop {
        let deadline = match session.upgrade() {
            // Not moved by a suspend: compared with the deadline given up for, it must
            // not change between two readings (the suspended time jitters). A suspend is
            // reported by `validity_bound` at once.
            Some(s) => lock(&s.last_contact).instant() + timeout * 2 / 3,
            None => return,
        };
        let armed = !connected && given_up != Some(deadline);
        tokio::select! {
            state = watcher.changed() => match state {
                SessionState::Expired | SessionState::Closed | SessionState::AuthFailed => {
                    if let Some(s) = session.upgrade() {
                        s.dead.store(true, Ordering::SeqCst);
                        s.lose_all(LostReason::SessionLost);
                    }
                    return;
                }
                SessionState::Disconnected => connected = false,
                SessionState::SyncConnected | SessionState::ConnectedReadOnly => connected = true,
            },
            _ = tokio::time::sleep(ping_every), if connected => {
                let Some(s) = session.upgrade() else { return };
                let sent = Instant::now();
                if let Ok(Ok(_)) = tokio::time::timeout(ping_every, s.client.check_stat("/")).await {
                    s.touch(sent);
                }
            }
            _ = tokio::time::sleep_until(deadline), if armed => {
                if let Some(s) = session.upgrade() {
                    // The server may expire the session any moment now: holders must stop.
                    s.lose_all(LostReason::SessionLost);
                }
                given_up = Some(deadline);
            }
        }
    }
}

/// Deletes a hold's node when its lease runs out unrenewed: a live holder that stops
/// renewing loses the lock just as a dead one does.
///
/// A hold found lost (its session's link silent for 2/3 of the timeout, its lease run out
/// on the guard's side) is forgotten by the registry at once: nobody may re-enter it, and
/// once its grants are dropped nothing refers to it, so its node is deleted then (see
/// `Held`'s drop) rather than keep the key for the rest of its lease while the session
/// lives on.
async fn enforce_lease(backend: ZkBackend, held: Weak<Held>) {
    let Some(loss) = held.upgrade().map(|h| h.loss.clone()) else {
        return;
    };
    let mut lost = std::pin::pin!(loss.fired());
    let mut forgotten = false;
    loop {
        let Some(until) = held.upgrade().map(|h| h.count.lease_until()) else {
            return;
        };
        tokio::select! {
            () = tokio::time::sleep_until(until) => {}
            _ = &mut lost, if !forgotten => {
                forgotten = true;
                if let Some(h) = held.upgrade() {
                    backend.forget(&h);
                }
                continue;
            }
        }
        let Some(h) = held.upgrade() else { return };
        if h.released.load(Ordering::SeqCst) {
            return;
        }
        if Instant::now() >= h.count.lease_until() {
            backend.forget(&h);
            h.loss.fire(LostReason::LeaseExpired);
            delete_until_gone(h.session.clone(), h.node.clone()).await;
            if let Some(marker) = &h.marker {
                delete_until_gone(h.session.clone(), marker.clone()).await;
            }
            return;
        }
    }
}

#[async_trait]
impl LockBackend for ZkBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo::new(
            BACKEND,
            Consistency::Cp,
            Capabilities {
                pushes_loss: true,
                // A crashed holder keeps the lock until its session expires.
                min_ttl: self.inner.config.session_timeout,
                // Each waiter watches only its predecessor.
                queued_wait: true,
                counts_waiters: true,
                // Curator's read-write lock layout; FIFO, so a waiting writer keeps new
                // readers out.
                read_write: true,
                writer_preference: true,
                // Curator's InterProcessSemaphoreV2 layout.
                semaphore: true,
                ..Capabilities::default()
            },
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        self.acquire_within(req, Duration::ZERO).await
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        granted_or_timeout(&req.key, self.acquire_within(req, wait)).await
    }

    /// After 2/3 of the session timeout without an answer the session may be gone on the
    /// servers, and the node with it: no hold is believed past that, whatever its TTL. The
    /// time the machine spent suspended since counts (the servers' clocks ran on).
    fn validity_bound(&self, grant: &Grant) -> Option<Instant> {
        let held = self.held_of(grant).ok()?;
        let heard = *lock(&held.session.last_contact);
        Some(heard.deadline(self.inner.config.session_timeout * 2 / 3))
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let held = self.held_of(grant)?;
        let sent = Instant::now();
        match held.session.client.check_stat(&held.node).await {
            Ok(Some(_)) if !held.loss.is_fired() => {
                held.session.touch(sent);
                // Never shorten the lease: another guard of this hold may rely on it.
                held.count
                    .extend_lease(lockkit_core::spi::lease_end(sent, ttl));
                Ok(())
            }
            Ok(_) | Err(zookeeper_client::Error::SessionExpired) => {
                self.forget(&held);
                Err(Error::NotHeld {
                    key: grant.key.clone(),
                })
            }
            Err(e) => Err(zk_error("checking the lock node", e)),
        }
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        let held = self.held_of(grant)?;
        match held.count.release(grant.attempt) {
            // A retried release: it took effect already.
            CountRelease::Retried { remaining } => return Ok(Released::Partially { remaining }),
            CountRelease::Partial { remaining } => {
                // Best effort, only for `inspect`.
                let _ = record_depth(&held, remaining).await;
                return Ok(Released::Partially { remaining });
            }
            CountRelease::Empty => {
                return Err(Error::NotHeld {
                    key: grant.key.clone(),
                });
            }
            CountRelease::Last => {}
        }
        held.released.store(true, Ordering::SeqCst);
        self.forget(&held);
        let lost = held.loss.is_fired();
        // Dropped before the answer (the caller went away), the deletion is still seen
        // through in the background: the request sent may be lost with the connection.
        let mut unanswered = DeleteOnDrop(Some((held.session.clone(), held.node.clone())));
        let deleted = held.session.client.delete(&held.node, None).await;
        unanswered.0 = None;
        if let Some(marker) = &held.marker {
            // Only lockkit's count check depends on it: deleted in the background.
            drop(DeleteOnDrop(Some((held.session.clone(), marker.clone()))));
        }
        match deleted {
            Ok(()) if !lost => Ok(Released::Fully),
            Ok(())
            | Err(zookeeper_client::Error::NoNode | zookeeper_client::Error::SessionExpired) => {
                Err(Error::NotHeld {
                    key: grant.key.clone(),
                })
            }
            Err(e) => {
                // The hold is over for us either way; never leave its node behind. Retried
                // in a task of its own, so a caller that stops waiting cannot cut it short.
                drop(DeleteOnDrop(Some((
                    held.session.clone(),
                    held.node.clone(),
                ))));
                Err(zk_error(
                    "deleting the lock node (retried in the background)",
                    e,
                ))
            }
        }
    }

    async fn ping(&self) -> Result<()> {
        let session = self.session().await?;
        session
            .client
            .check_stat("/")
            .await
            .map_err(|e| zk_error("exists /", e))?;
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        Ok(self.holders(key).await?.into_iter().next())
    }

    /// Every holder: the readers (or the writer or mutex holder) at the front of the key's
    /// queue, or a semaphore's leases (the first `limit` by sequence when more exist: the
    /// rest wait), each with its kind, its node's `czxid` as token and the identity lockkit
    /// stored in the node (a peer's nodes carry none). `waiters` counts the contenders
    /// that do not hold.
    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        let session = self.session().await?;
        let client = &session.client;
        let dir = self.lock_dir(key);
        // A follower may serve reads that lag the leader: catch up first, so the answer
        // includes every change another session made before this call (a new holder, a
        // re-entry's depth).
        client
            .sync("/")
            .await
            .map_err(|e| zk_error("syncing before inspecting", e))?;
        // A holder deleted between the listing and the read of its node: list again, so
        // the contender behind it is seen as the holder it now is.
        for _ in 0..3 {
            let children = match client.list_children(&dir).await {
                Ok(children) => children,
                Err(zookeeper_client::Error::NoNode) => return Ok(Vec::new()),
                Err(e) => return Err(zk_error("listing contenders", e)),
            };
            let queue = contenders_in_order(&children);
            let found = if queue.is_empty() && children.iter().any(|c| c == LEASES_DIR) {
                permit_holders(client, &dir).await?
            } else if queue.is_empty() && children.iter().any(|c| is_kazoo_lease(c)) {
                kazoo_permit_holders(client, &dir, &children).await?
            } else {
                let holding = holding(&queue);
                let waiters = u32::try_from(queue.len() - holding.len()).unwrap_or(u32::MAX);
                let nodes = holding
                    .into_iter()
                    .map(|i| (format!("{dir}/{}", queue[i]), kind_of_node(queue[i])))
                    .collect();
                read_holders(client, nodes, waiters).await?
            };
            if let Some(found) = found {
                return Ok(found);
            }
        }
        Err(Error::backend(
            BACKEND,
            true,
            format!("the holders of `{key}` kept changing while being read"),
        ))
    }
}

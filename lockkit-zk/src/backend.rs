//! `ZkBackend`: sessions, contenders, predecessor watches, leases and loss.

use std::{
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use lockkit_core::spi::{
    AcquireRequest, Backoff, CountRelease, Grant, HoldCount, Interrupt, LocalHolds, Released,
    contender_record, deadline_after, detached_acquire, granted_or_timeout, parse_contender_record,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LossSignal, LostReason, OwnerId, Result,
};
use tokio::time::Instant;
use uuid::Uuid;
use zookeeper_client::{Acls, Client, CreateMode, SessionState};

use crate::{ZkConfig, path::encode};

const BACKEND: &str = "zk";
/// Apache Curator's InterProcessMutex lock name.
const LOCK_NAME: &str = "-lock-";

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
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").field("node", &self.node).finish()
    }
}

/// One ZooKeeper session and the holds that live and die with it.
pub(crate) struct Session {
    client: Client,
    /// When the last request that the server answered was sent (monotonic clock).
    last_contact: Mutex<Instant>,
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
        if sent > *last {
            *last = sent;
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
    held: LocalHolds<Held>,
    /// Predecessor watches that fired, for herd checks.
    wakeups: std::sync::atomic::AtomicU64,
}

/// A ZooKeeper lock service: the CP backend.
///
/// Each contender is an `EPHEMERAL_SEQUENTIAL` node `<root>/<key>/_c_<uuid>-lock-<seq>`
/// under a container node per key, named as Apache Curator's InterProcessMutex names them,
/// so Curator and lockkit exclude each other on the same path. Each waiter watches only
/// its predecessor. The fencing token is the holder node's `czxid`.
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
                wakeups: std::sync::atomic::AtomicU64::new(0),
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
    async fn session(&self) -> Result<Arc<Session>> {
        let mut current = self.inner.session.lock().await;
        if current.dead.load(Ordering::SeqCst) {
            *current = open_session(&self.inner.config).await?;
        }
        Ok(current.clone())
    }

    fn forget(&self, held: &Held) {
        self.inner.held.forget(held.owner, &held.key, held);
    }

    /// The live hold behind `grant`, checking it belongs to this client, owner and key.
    fn held_of(&self, grant: &Grant) -> Result<Arc<Held>> {
        self.inner.held.held_of(grant)
    }

    /// Creates this attempt's contender node, finding it after a connection loss instead
    /// of creating a second one. `None` when the caller went away; an error when the
    /// server left a request unanswered past its bound. Either way, a node the attempt may
    /// have created is deleted in the background.
    async fn create_contender(
        &self,
        session: &Arc<Session>,
        dir: &str,
        req: &AcquireRequest,
        deadline: Instant,
        interrupt: &Interrupt,
    ) -> Result<Option<(String, u64)>> {
        let client = &session.client;
        let unique = format!("_c_{}{LOCK_NAME}", Uuid::new_v4());
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
        for _ in 0..5 {
            let sent = Instant::now();
            let created = match answer_by(
                client.create(&prefix, data.as_bytes(), &ephemeral),
                self.request_end(deadline),
                interrupt,
            )
            .await
            {
                Ok(created) => created,
                Err(why) => return unanswered_create(why),
            };
            match created {
                Ok((stat, sequence)) => {
                    session.touch(sent);
                    if uncertain {
                        sweep(Some(format!("{unique}{sequence}")));
                    }
                    return Ok(Some((
                        format!("{prefix}{sequence}"),
                        u64::try_from(stat.czxid).unwrap_or(0),
                    )));
                }
                Err(zookeeper_client::Error::NoNode) => {
                    // The root is persistent; each key's directory a container, removed by
                    // the server once empty. Neither holds a lock: nothing to sweep.
                    let persistent = CreateMode::Persistent.with_acls(acls);
                    let container = CreateMode::Container.with_acls(acls);
                    let directories = async {
                        client
                            .mkdir(&self.inner.config.root, &persistent)
                            .await
                            .map_err(|e| zk_error("creating the root node", e))?;
                        match client.create(dir, &[], &container).await {
                            Ok(_) | Err(zookeeper_client::Error::NodeExists) => Ok(()),
                            Err(e) => Err(zk_error("creating the lock's container node", e)),
                        }
                    };
                    match answer_by(directories, self.request_end(deadline), interrupt).await {
                        Ok(made) => made?,
                        Err(why) => return unanswered_create(why),
                    }
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
                            return Ok(Some((node, u64::try_from(stat.czxid).unwrap_or(0))));
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

    /// Queues for the lock and waits at the head; `None` when `wait` ran out or the caller
    /// went away (the node is deleted then).
    async fn contend(
        &self,
        req: &AcquireRequest,
        wait: Duration,
        interrupt: Interrupt,
    ) -> Result<Option<Grant>> {
        let deadline = deadline_after(wait);
        let session = self.session().await?;
        let client = session.client.clone();
        let dir = self.lock_dir(&req.key);
        let Some((node, czxid)) = self
            .create_contender(&session, &dir, req, self.request_end(deadline), &interrupt)
            .await?
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
        // The lease starts when the grant is observed (the request that found this node at
        // the head of the queue was sent), not when the wait began: a wait longer than the
        // TTL must not yield an expired grant.
        let granted_at = loop {
            let sent = Instant::now();
            let listed = match answer_by(
                client.list_children(&dir),
                self.request_end(deadline),
                &interrupt,
            )
            .await
            {
                Ok(listed) => listed,
                Err(why) => {
                    give_up(node).await;
                    return unanswered_wait(why, "listing contenders");
                }
            };
            let children = match listed {
                Ok(children) => children,
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
            let queue = contenders_in_order(&children);
            let Some(position) = queue.iter().position(|c| **c == name) else {
                // Our node vanished: the session expired while we waited.
                return Err(Error::backend(
                    BACKEND,
                    true,
                    "the contender node vanished (session expired?)",
                ));
            };
            if position == 0 {
                break sent;
            }
            if wait.is_zero() || Instant::now() >= deadline {
                give_up(node).await;
                return Ok(None);
            }
            let predecessor = format!("{dir}/{}", queue[position - 1]);
            let watched = match answer_by(
                client.check_and_watch_stat(&predecessor),
                self.request_end(deadline),
                &interrupt,
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
        let held = Arc::new(Held {
            node,
            key: req.key.clone(),
            owner: req.owner,
            token: FencingToken::new(czxid),
            count: HoldCount::new(req, granted_at),
            loss: req.loss.clone(),
            session: session.clone(),
            released: AtomicBool::new(false),
            identity: req.identity.encode(),
        });
        {
            // Ended holds go as new ones come, so the list stays as long as what is held.
            let mut holds = lock(&session.holds);
            holds.retain(|h| h.strong_count() > 0);
            holds.push(Arc::downgrade(&held));
        }
        self.inner
            .held
            .insert(req.owner, req.key.clone(), held.clone());
        if session.dead.load(Ordering::SeqCst) {
            held.loss.fire(LostReason::SessionLost);
        }
        tokio::spawn(enforce_lease(self.clone(), Arc::downgrade(&held)));
        Ok(Some(
            Grant::new(req, held.token, 1, granted_at).with_state(held),
        ))
    }

    async fn acquire_within(&self, req: &AcquireRequest, wait: Duration) -> Result<Option<Grant>> {
        let existing = self.inner.held.get(req.owner, &req.key);
        if let Some(held) = existing.filter(|h| !h.loss.is_fired()) {
            // Its own task, like a fresh acquisition: if the caller goes away while the
            // depth is being recorded for `inspect`, the hold it added is given back.
            let (request, giver) = (req.clone(), self.clone());
            let limit = self.request_limit();
            let reentered = detached_acquire(
                BACKEND,
                move |_| async move {
                    let start = Instant::now();
                    let Some(depth) = held.count.reenter(&request, start, held.loss.is_fired())
                    else {
                        return Ok(None);
                    };
                    // Only for `inspect`: a silent server must not hold the re-entry up.
                    let _ = tokio::time::timeout(limit, record_depth(&held, depth)).await;
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

/// Node data with the hold count when above one (best effort, for `inspect`).
async fn record_depth(held: &Held, depth: u32) {
    let data = contender_record(&held.owner.to_string(), depth, &held.identity);
    let _ = held
        .session
        .client
        .set_data(&held.node, data.as_bytes(), None)
        .await;
}

/// The sequence number ZooKeeper appended to a sequential node's name: its last 10 digits
/// (one counter per parent, so it orders every contender in a lock's directory), or `None`
/// for a node that is not sequential.
fn sequence_of(name: &str) -> Option<u64> {
    let digits = name.get(name.len().checked_sub(10)?..)?;
    if digits.bytes().all(|b| b.is_ascii_digit()) {
        digits.parse().ok()
    } else {
        None
    }
}

/// The contenders in a lock's directory, in queue order: every sequential child, whoever
/// made it (lockkit's and Curator's `_c_<uuid>-lock-N`, kazoo's `<uuid>__lock__N`, read
/// locks of read-write recipes such as `__rlock__` or `__READ__`, which exclude a mutex
/// too, the ZooKeeper recipe's `x-<session>-N`), so mixed fleets exclude each other.
fn contenders_in_order(children: &[String]) -> Vec<&String> {
    let mut queue: Vec<(u64, &String)> = children
        .iter()
        .filter_map(|c| Some((sequence_of(c)?, c)))
        .collect();
    queue.sort();
    queue.into_iter().map(|(_, c)| c).collect()
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
        last_contact: Mutex::new(sent),
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
            Some(s) => *lock(&s.last_contact) + timeout * 2 / 3,
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
async fn enforce_lease(backend: ZkBackend, held: Weak<Held>) {
    loop {
        let Some(until) = held.upgrade().map(|h| h.count.lease_until()) else {
            return;
        };
        tokio::time::sleep_until(until).await;
        let Some(h) = held.upgrade() else { return };
        if h.released.load(Ordering::SeqCst) {
            return;
        }
        if Instant::now() >= h.count.lease_until() {
            backend.forget(&h);
            h.loss.fire(LostReason::LeaseExpired);
            delete_until_gone(h.session.clone(), h.node.clone()).await;
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
    /// servers, and the node with it: no hold is believed past that, whatever its TTL.
    fn validity_bound(&self, grant: &Grant) -> Option<Instant> {
        let held = self.held_of(grant).ok()?;
        let heard = *lock(&held.session.last_contact);
        Some(heard + self.inner.config.session_timeout * 2 / 3)
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let held = self.held_of(grant)?;
        let sent = Instant::now();
        match held.session.client.check_stat(&held.node).await {
            Ok(Some(_)) if !held.loss.is_fired() => {
                held.session.touch(sent);
                // Never shorten the lease: another guard of this hold may rely on it.
                held.count.extend_lease(sent + ttl);
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
                record_depth(&held, remaining).await;
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
        match deleted {
            Ok(()) if !lost => Ok(Released::Fully),
            Ok(())
            | Err(zookeeper_client::Error::NoNode | zookeeper_client::Error::SessionExpired) => {
                Err(Error::NotHeld {
                    key: grant.key.clone(),
                })
            }
            Err(e) => {
                // The hold is over for us either way; never leave its node behind.
                delete_until_gone(held.session.clone(), held.node.clone()).await;
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
        let children = match client.list_children(&dir).await {
            Ok(children) => children,
            Err(zookeeper_client::Error::NoNode) => return Ok(None),
            Err(e) => return Err(zk_error("listing contenders", e)),
        };
        let queue = contenders_in_order(&children);
        for (position, head) in queue.iter().enumerate() {
            match client.get_data(&format!("{dir}/{head}")).await {
                Ok((data, stat)) => {
                    let (owner, depth, identity) =
                        parse_contender_record(&data, &format!("node {head}"));
                    let waiters = u32::try_from(queue.len() - position - 1).unwrap_or(u32::MAX);
                    return Ok(Some(
                        HolderInfo::new(
                            owner,
                            depth,
                            Some(FencingToken::new(u64::try_from(stat.czxid).unwrap_or(0))),
                            None,
                        )
                        .with_identity(identity)
                        .with_waiters(waiters),
                    ));
                }
                Err(zookeeper_client::Error::NoNode) => continue,
                Err(e) => return Err(zk_error("reading the holder node", e)),
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod queue_tests {
    use super::*;

    #[test]
    fn every_sequential_child_is_a_contender_in_sequence_order() {
        let children: Vec<String> = [
            "_c_0b5e-lock-0000000007",
            "f00d__lock__0000000003",
            "beef__rlock__0000000009",
            "x-1234-0000000005",
            "not-a-contender",
            "_c_aa-lock-0000000001",
        ]
        .map(String::from)
        .to_vec();
        let order: Vec<&str> = contenders_in_order(&children)
            .into_iter()
            .map(String::as_str)
            .collect();
        assert_eq!(
            order,
            [
                "_c_aa-lock-0000000001",
                "f00d__lock__0000000003",
                "x-1234-0000000005",
                "_c_0b5e-lock-0000000007",
                "beef__rlock__0000000009",
            ]
        );
    }
}

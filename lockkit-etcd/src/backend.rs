//! `EtcdBackend`: leased contender keys ordered by create revision, predecessor watches,
//! keep-alives and loss.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchFilterType, WatchOptions,
};
use lockkit_core::spi::{
    AcquireRequest, CountRelease, Grant, HoldCount, Interrupt, LocalHolds, Released,
    contender_record, deadline_after, detached_acquire, granted_or_timeout, parse_contender_record,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LossSignal, LostReason, OwnerId, Result,
};
use tokio::time::Instant;

use crate::{
    EtcdConfig,
    lease::{Lease, retry_backoff},
    path::lock_range,
    request::{BACKEND, RETRY_PAUSE, Unanswered, ask, etcd_error, unanswered},
};

/// How often HTTP/2 pings check a connection with streams open (etcd's
/// `--grpc-keepalive-min-time` refuses anything under 5 s).
const HTTP2_PING_EVERY: Duration = Duration::from_secs(6);

/// The range answer of a transaction's `index`th operation.
fn range_of(answer: &TxnResponse, index: usize) -> Vec<etcd_client::KeyValue> {
    match answer.op_responses().into_iter().nth(index) {
        Some(TxnOpResponse::Get(mut got)) => got.take_kvs(),
        _ => Vec::new(),
    }
}

fn revision_of(answer: &TxnResponse) -> i64 {
    answer
        .header()
        .map_or(0, etcd_client::ResponseHeader::revision)
}

/// The contender just before the one created at `revision`: the key of the range with the
/// highest create revision below it (etcd's `concurrency.Mutex` asks the same).
fn predecessor_query(revision: i64) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_max_create_revision(revision - 1)
        .with_limit(1)
}

/// One hold: a contender key that became the first of its range.
pub(crate) struct Held {
    /// The contender key, `<range><lease id in hex>`.
    name: String,
    /// Its create revision: the fencing token.
    revision: i64,
    key: LockKey,
    owner: OwnerId,
    /// Depth, the acquisitions behind it and the lease.
    count: HoldCount,
    loss: LossSignal,
    lease: Arc<Lease>,
    released: AtomicBool,
    /// Who took the hold, encoded: the second line of the key's value.
    identity: String,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").field("name", &self.name).finish()
    }
}

/// Ends a lease when dropped: however its owner's future ends, even dropped mid-way.
struct EndOnDrop<'a>(&'a Lease);

impl Drop for EndOnDrop<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}

impl Drop for Held {
    /// A hold nobody refers to any more gives its lease (and so its key) up.
    fn drop(&mut self) {
        self.lease.end();
    }
}

pub(crate) struct Inner {
    config: EtcdConfig,
    client: Client,
    /// One client per member (the same client when there is one member), for keep-alive
    /// streams.
    members: Arc<[Client]>,
    /// Which member the next lease's keep-alives start on.
    next_member: AtomicUsize,
    held: LocalHolds<Held>,
    /// Predecessor watches that fired, for herd checks.
    wakeups: AtomicU64,
}

/// An etcd lock service: the Raft-backed CP backend.
///
/// A contender is the key `<prefix>/<key>/<lease id in hex>` put under an etcd lease of
/// its own, as etcd's `concurrency.Mutex` (and so `etcdctl lock`) names them, so etcdctl,
/// Go services and lockkit exclude each other on the same lock. The first key of the range
/// by create revision holds the lock; each waiter watches only the key just before its
/// own. The fencing token is the holder key's create revision.
///
/// A hold ends when its lease runs out unrenewed (its etcd lease is revoked), when the
/// cluster stops confirming keep-alives for two thirds of the etcd lease's TTL (counted on
/// the local monotonic clock, so the holder hears of it before the cluster can expire the
/// lease and grant the lock to anyone else), or when its key is deleted under it.
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.inner.config.endpoints)
            .field("prefix", &self.inner.config.prefix)
            .finish()
    }
}

impl EtcdBackend {
    /// Connects as an `etcd://h1:2379,h2,h3?prefix=/lockkit&session_ttl=10s` URL says.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL or a session TTL the cluster will not grant;
    /// [`Error::Backend`] when no member answers or the cluster has no leader.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::from_config(EtcdConfig::parse(url)?).await
    }

    /// Connects as `config` says, and checks that the cluster answers and grants leases of
    /// the session TTL asked.
    ///
    /// # Errors
    /// As [`EtcdBackend::connect`].
    pub async fn from_config(config: EtcdConfig) -> Result<Self> {
        let options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            // HTTP/2 pings find a dead connection; etcd answers pings more often than every
            // 5 s, or pings on a connection without streams, by closing the connection.
            .with_keep_alive(HTTP2_PING_EVERY, config.connect_timeout)
            .with_keep_alive_while_idle(false)
            .with_require_leader(true);
        let members = config.endpoints.join(",");
        let mut client = Client::connect(&config.endpoints, Some(options.clone()))
            .await
            .map_err(|e| etcd_error(&format!("connecting to `{members}`"), e))?;
        // Each connects lazily, when a keep-alive stream first goes through it.
        let mut member_clients = Vec::new();
        if config.endpoints.len() > 1 {
            for endpoint in &config.endpoints {
                let member = Client::connect([endpoint], Some(options.clone()))
                    .await
                    .map_err(|e| etcd_error(&format!("connecting to `{endpoint}`"), e))?;
                member_clients.push(member);
            }
        } else {
            member_clients.push(client.clone());
        }
        // The client connects lazily: a lease grant proves a member answers and the
        // cluster has a leader, and says which TTL the cluster grants.
        let asked = config.session_ttl.as_secs();
        let granted = tokio::time::timeout(
            config.connect_timeout,
            client.lease_grant(i64::try_from(asked).unwrap_or(i64::MAX), None),
        )
        .await
        .map_err(|_| {
            Error::backend(
                BACKEND,
                true,
                format!(
                    "no etcd member of `{members}` answered within {:?}; are they running, \
                     and does the cluster have a leader?",
                    config.connect_timeout
                ),
            )
        })?
        .map_err(|e| etcd_error(&format!("granting a lease on `{members}`"), e))?;
        let probe = granted.id();
        let mut revoker = client.clone();
        tokio::spawn(async move { revoker.lease_revoke(probe).await });
        if u64::try_from(granted.ttl()).ok() != Some(asked) {
            return Err(Error::Config(format!(
                "the cluster granted a {} s lease for the {asked} s session_ttl asked: it \
                 grants no lease shorter than its minimum (about 1.5 election timeouts); \
                 choose a longer session_ttl",
                granted.ttl()
            )));
        }
        Ok(EtcdBackend {
            inner: Arc::new(Inner {
                config,
                client,
                members: member_clients.into(),
                next_member: AtomicUsize::new(0),
                held: LocalHolds::new(),
                wakeups: AtomicU64::new(0),
            }),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The etcd client (for operators and tests).
    pub fn client(&self) -> Client {
        self.inner.client.clone()
    }

    /// How many times a waiter of this client was woken by its predecessor's deletion.
    /// With predecessor watches, one release wakes exactly one waiter (no herd).
    pub fn watch_wakeups(&self) -> u64 {
        self.inner.wakeups.load(Ordering::SeqCst)
    }

    /// The key range whose keys are `key`'s contenders (ends with `/`).
    pub fn lock_range(&self, key: &LockKey) -> String {
        lock_range(&self.inner.config.prefix, key)
    }

    /// How long one request may stay unanswered: `connect_timeout`, but at most a third of
    /// the session TTL.
    fn request_limit(&self) -> Duration {
        let config = &self.inner.config;
        config
            .connect_timeout
            .min(config.session_ttl / 3)
            .max(Duration::from_millis(100))
    }

    /// How long a request sent now may stay unanswered by an acquisition whose wait ends
    /// at `deadline`: until the deadline, and one request limit of silence past it (or past
    /// now, for a request sent after it).
    fn request_end(&self, deadline: Instant) -> Instant {
        let from = deadline.max(Instant::now());
        from.checked_add(self.request_limit()).unwrap_or(from)
    }

    fn forget(&self, held: &Held) {
        self.inner.held.forget(held.owner, &held.key, held);
    }

    /// The live hold behind `grant`, checking it belongs to this client, owner and key.
    fn held_of(&self, grant: &Grant) -> Result<Arc<Held>> {
        self.inner.held.held_of(grant)
    }

    /// Ends a contender that will not hold the lock, waiting at most one request limit for
    /// its lease (and key) to be revoked; the revocation goes on in the background after.
    async fn give_up(lease: &Lease) {
        if !lease.end_and_revoke().await {
            tracing::warn!(
                lease = lease.id,
                "could not revoke a contender's lease yet; retrying in the background"
            );
        }
    }

    /// How long one try of a request may stay unanswered before it is sent again (perhaps
    /// to another member): half the request limit.
    fn per_try(&self) -> Duration {
        (self.request_limit() / 2).max(Duration::from_millis(100))
    }

    /// Asks `request` (idempotent) with retries until one request limit from now.
    async fn ask_within_limit<T, F, Fut>(&self, request: F, doing: &str) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let end = Instant::now() + self.request_limit();
        match ask(request, end, self.per_try(), None).await {
            Ok((answer, _)) => answer.map_err(|e| etcd_error(doing, e)),
            Err(_) => Err(unanswered(doing, self.request_limit())),
        }
    }

    /// Whether `key` exists; `false` also when the cluster does not answer in time (the
    /// caller then looks again).
    async fn still_there(&self, key: &[u8]) -> bool {
        let client = self.client();
        let read = || {
            let (mut client, key) = (client.clone(), key.to_vec());
            async move {
                client
                    .get(key, Some(GetOptions::new().with_count_only()))
                    .await
            }
        };
        self.ask_within_limit(read, "reading the predecessor")
            .await
            .is_ok_and(|got| got.count() > 0)
    }

    /// Queues for the lock and waits to be first; `None` when `wait` ran out or the caller
    /// went away (the contender's lease is revoked then).
    async fn contend(
        &self,
        req: &AcquireRequest,
        wait: Duration,
        interrupt: Interrupt,
    ) -> Result<Option<Grant>> {
        let deadline = deadline_after(wait);
        let range = self.lock_range(&req.key);
        let session_ttl = i64::try_from(self.inner.config.session_ttl.as_secs()).unwrap_or(1);
        let per_try = self.per_try();
        // Requests that fail on the way (a member down or frozen, a connection that broke
        // while idle) are asked again until the wait ends, and one request limit past it.
        // A lease granted whose answer never arrives carries no key and expires by itself.
        let client = self.client();
        let grant_lease = || {
            let mut client = client.clone();
            async move { client.lease_grant(session_ttl, None).await }
        };
        let (granted, sent) = match ask(
            grant_lease,
            self.request_end(deadline),
            per_try,
            Some(&interrupt),
        )
        .await
        {
            Ok((Ok(granted), sent)) => (granted, sent),
            Ok((Err(e), _)) => return Err(etcd_error("granting the contender's lease", e)),
            Err(Unanswered::Interrupted) => return Ok(None),
            Err(Unanswered::TooLate) => {
                return Err(unanswered("granting a lease", self.request_limit()));
            }
        };
        let ttl = Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(0));
        let first_member = self.inner.next_member.fetch_add(1, Ordering::Relaxed);
        let lease = Lease::keep(
            self.client(),
            (self.inner.members.clone(), first_member),
            granted.id(),
            ttl,
            sent,
            self.request_limit(),
        );
        let name = format!("{range}{:x}", granted.id());
        // Any failure from here on gives the contender up (its lease revoked).
        let failed = |why: std::result::Result<etcd_client::Error, Unanswered>, doing: &str| {
            let lease = lease.clone();
            let outcome = match why {
                Ok(e) => Err(etcd_error(doing, e)),
                Err(Unanswered::Interrupted) => Ok(None),
                Err(Unanswered::TooLate) => Err(unanswered(doing, self.request_limit())),
            };
            async move {
                Self::give_up(&lease).await;
                outcome
            }
        };

        // Create the contender key, unless an earlier try whose answer was lost did; the
        // same transaction reads the key just before it.
        let create = Txn::new()
            .when([Compare::create_revision(name.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(
                    name.clone(),
                    contender_record(&req.owner.to_string(), 1, &req.identity.encode()),
                    Some(PutOptions::new().with_lease(granted.id())),
                ),
                TxnOp::get(
                    range.clone(),
                    Some(
                        GetOptions::new()
                            .with_prefix()
                            .with_sort(SortTarget::Create, SortOrder::Descend)
                            .with_limit(2),
                    ),
                ),
            ])
            .or_else([TxnOp::get(name.clone(), None)]);
        let send_create = || {
            let (mut client, create) = (client.clone(), create.clone());
            async move { client.txn(create).await }
        };
        let (answer, sent) = match ask(
            send_create,
            self.request_end(deadline),
            per_try,
            Some(&interrupt),
        )
        .await
        {
            Ok((Ok(answer), sent)) => (answer, sent),
            Ok((Err(e), _)) => return failed(Ok(e), "creating the contender key").await,
            Err(why) => return failed(Err(why), "creating the contender key").await,
        };
        let at = revision_of(&answer);
        let (revision, mut look) = if answer.succeeded() {
            // Ours is the newest key of the range; the next one down precedes it.
            let predecessor = range_of(&answer, 1)
                .into_iter()
                .find(|kv| kv.create_revision() < at)
                .map(|kv| kv.key().to_vec());
            (at, Some((sent, at, predecessor)))
        } else {
            match range_of(&answer, 0).first() {
                // An earlier try created it: look for its predecessor afresh.
                Some(kv) if kv.lease() == granted.id() => (kv.create_revision(), None),
                _ => {
                    Self::give_up(&lease).await;
                    return Err(Error::backend(
                        BACKEND,
                        true,
                        format!("the contender key `{name}` belongs to another lease"),
                    ));
                }
            }
        };

        // The lease starts when the grant is observed (the request that found no key
        // before ours was sent), not when the wait began: a wait longer than the TTL must
        // not yield an expired grant.
        let check = Txn::new()
            .when([Compare::create_revision(
                name.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::get(range.clone(), Some(predecessor_query(revision)))]);
        // A watch that broke without a word (a frozen member) must not keep a waiter past
        // its predecessor's release for longer than this.
        let recheck_every = self.inner.config.session_ttl * 2;
        let lost_while_waiting = || {
            Error::backend(
                BACKEND,
                true,
                "the contender's lease was lost while waiting (the cluster stopped confirming \
                 keep-alives)",
            )
        };
        let (granted_at, seen_at) = loop {
            if lease.lost().is_some() {
                // Looking again would find the key until the cluster expires it, and the
                // watch would end at once: a loop of requests, not a wait.
                Self::give_up(&lease).await;
                return Err(lost_while_waiting());
            }
            let (sent, at, predecessor) = match look.take() {
                Some(seen) => seen,
                None => {
                    let send_check = || {
                        let (mut client, check) = (client.clone(), check.clone());
                        async move { client.txn(check).await }
                    };
                    let (answer, sent) = match ask(
                        send_check,
                        self.request_end(deadline),
                        per_try,
                        Some(&interrupt),
                    )
                    .await
                    {
                        Ok((Ok(answer), sent)) => (answer, sent),
                        Ok((Err(e), _)) => {
                            return failed(Ok(e), "looking for the predecessor").await;
                        }
                        Err(why) => return failed(Err(why), "looking for the predecessor").await,
                    };
                    if !answer.succeeded() {
                        Self::give_up(&lease).await;
                        return Err(Error::backend(
                            BACKEND,
                            true,
                            "the contender key vanished while waiting (its lease expired, or \
                             it was deleted)",
                        ));
                    }
                    let predecessor = range_of(&answer, 0).first().map(|kv| kv.key().to_vec());
                    (sent, revision_of(&answer), predecessor)
                }
            };
            let Some(predecessor) = predecessor else {
                break (sent, at);
            };
            if wait.is_zero() || Instant::now() >= deadline {
                Self::give_up(&lease).await;
                return Ok(None);
            }
            // Deletions of the predecessor from now on. (A watch from the listing's revision
            // would see the ones in between too, but etcd serves a watch that starts in the
            // past from a catch-up loop that runs every 100 ms: a slow wake-up under load.
            // The gap is closed below instead.)
            let watch = WatchOptions::new().with_filters([WatchFilterType::NoPut]);
            let open_watch = || {
                let (mut client, predecessor, watch) =
                    (client.clone(), predecessor.clone(), watch.clone());
                async move { client.watch(predecessor, Some(watch)).await }
            };
            let mut stream = match ask(
                open_watch,
                self.request_end(deadline),
                per_try,
                Some(&interrupt),
            )
            .await
            {
                Ok((Ok(stream), _)) => stream,
                Ok((Err(e), _)) => return failed(Ok(e), "watching the predecessor").await,
                Err(why) => return failed(Err(why), "watching the predecessor").await,
            };
            let recheck_at = Instant::now() + recheck_every;
            loop {
                tokio::select! {
                    message = stream.message() => match message {
                        Ok(Some(answer)) => {
                            if answer.events().iter().any(|e| e.event_type() == EventType::Delete) {
                                self.inner.wakeups.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            if answer.canceled() {
                                // The member lost its leader: look again after a pause.
                                tokio::time::sleep(RETRY_PAUSE).await;
                                break;
                            }
                            let watched_from = answer.header().map_or(0, |h| h.revision());
                            if answer.created()
                                && watched_from > at
                                && !self.still_there(&predecessor).await
                            {
                                // Deleted between the listing and the watch.
                                self.inner.wakeups.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                        }
                        // The stream broke: look again after a pause.
                        Ok(None) | Err(_) => {
                            tokio::time::sleep(RETRY_PAUSE).await;
                            break;
                        }
                    },
                    () = tokio::time::sleep_until(recheck_at) => break,
                    () = tokio::time::sleep_until(deadline) => {
                        Self::give_up(&lease).await;
                        return Ok(None);
                    }
                    () = interrupt.interrupted() => {
                        Self::give_up(&lease).await;
                        return Ok(None);
                    }
                    () = lease.over() => break,
                }
            }
        };
        if lease.lost().is_some() {
            Self::give_up(&lease).await;
            return Err(lost_while_waiting());
        }
        let held = Arc::new(Held {
            name: name.clone(),
            revision,
            key: req.key.clone(),
            owner: req.owner,
            count: HoldCount::new(req, granted_at),
            loss: req.loss.clone(),
            lease: lease.clone(),
            released: AtomicBool::new(false),
            identity: req.identity.encode(),
        });
        self.inner
            .held
            .insert(req.owner, req.key.clone(), held.clone());
        lease.attach(held.loss.clone());
        tokio::spawn(watch_own_key(
            self.client(),
            lease,
            name,
            revision,
            seen_at + 1,
        ));
        tokio::spawn(enforce_lease(self.clone(), Arc::downgrade(&held)));
        let token = FencingToken::new(u64::try_from(revision).unwrap_or(0));
        Ok(Some(Grant::new(req, token, 1, granted_at).with_state(held)))
    }

    async fn acquire_within(&self, req: &AcquireRequest, wait: Duration) -> Result<Option<Grant>> {
        let existing = self.inner.held.get(req.owner, &req.key);
        if let Some(held) = existing.filter(|h| !h.loss.is_fired()) {
            // Its own task, like a fresh acquisition: if the caller goes away while the
            // depth is being recorded for `inspect`, the hold it added is given back.
            let (request, giver, this) = (req.clone(), self.clone(), self.clone());
            let reentered = detached_acquire(
                BACKEND,
                move |_| async move {
                    let start = Instant::now();
                    let Some(depth) = held.count.reenter(&request, start, held.loss.is_fired())
                    else {
                        return Ok(None);
                    };
                    this.record_depth(&held, depth).await;
                    let token = FencingToken::new(u64::try_from(held.revision).unwrap_or(0));
                    let grant = Grant::new(&request, token, depth, start);
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
            // Another task of this owner just released the last hold (its key is being
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

    /// Key value ([`contender_record`]) with the hold count (best effort, for `inspect`; a
    /// silent cluster does not hold the caller up).
    async fn record_depth(&self, held: &Held, depth: u32) {
        let data = contender_record(&held.owner.to_string(), depth, &held.identity);
        let write = Txn::new()
            .when([Compare::create_revision(
                held.name.clone(),
                CompareOp::Equal,
                held.revision,
            )])
            .and_then([TxnOp::put(
                held.name.clone(),
                data,
                Some(PutOptions::new().with_lease(held.lease.id)),
            )]);
        let client = self.client();
        let send = || {
            let (mut client, write) = (client.clone(), write.clone());
            async move { client.txn(write).await }
        };
        let _ = self
            .ask_within_limit(send, "recording the hold count")
            .await;
    }
}

/// Tells the hold on `lease` when its key `name` (created at `revision`) is deleted under
/// it (a DELETE event from revision `from` on), until the lease is over.
///
/// A watch reopened after a break starts again from `from`, which moves only past what was
/// surely seen: a header's revision says nothing of events still on their way (a watch's
/// `created` answer carries the store's newest revision before any event it replays), so
/// moving past it could skip the DELETE. Replaying from an old revision costs nothing (the
/// server filters the PUTs); once that revision is compacted away, a read says whether the
/// key is still the hold's own.
async fn watch_own_key(
    client: Client,
    lease: Arc<Lease>,
    name: String,
    revision: i64,
    mut from: i64,
) {
    let mut backoff = retry_backoff();
    while !lease.is_over() {
        let watch = WatchOptions::new()
            .with_start_revision(from)
            .with_filters([WatchFilterType::NoPut]);
        let mut watcher = client.clone();
        let opened = tokio::select! {
            opened = watcher.watch(name.clone(), Some(watch)) => opened,
            () = lease.over() => return,
        };
        let mut stream = match opened {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(name, error = %e, "watching a held key failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff.next_delay()) => continue,
                    () = lease.over() => return,
                }
            }
        };
        loop {
            tokio::select! {
                message = stream.message() => match message {
                    Ok(Some(answer)) => {
                        if answer.events().iter().any(|e| e.event_type() == EventType::Delete) {
                            lease.lose(LostReason::NotOurs);
                            return;
                        }
                        if answer.canceled() {
                            // Compacted past (or no leader): is the key still the one the
                            // hold created? A linearizable read says so as of its revision.
                            let mut getter = client.clone();
                            let read = tokio::time::timeout(
                                lease.ttl / 3,
                                getter.get(name.clone(), Some(GetOptions::new().with_keys_only())),
                            );
                            if let Ok(Ok(got)) = read.await {
                                let ours = got
                                    .kvs()
                                    .first()
                                    .is_some_and(|kv| kv.create_revision() == revision);
                                if !ours {
                                    lease.lose(LostReason::NotOurs);
                                    return;
                                }
                                from = got.header().map_or(from, |h| from.max(h.revision() + 1));
                            }
                            break;
                        }
                    }
                    Ok(None) | Err(_) => break,
                },
                () = lease.over() => return,
            }
        }
        tokio::select! {
            () = tokio::time::sleep(backoff.next_delay()) => {}
            () = lease.over() => return,
        }
    }
}

/// Revokes a hold's lease when its lock lease runs out unrenewed: a live holder that
/// stops renewing loses the lock just as a dead one does.
async fn enforce_lease(backend: EtcdBackend, held: std::sync::Weak<Held>) {
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
            h.lease.lose(LostReason::LeaseExpired);
            h.loss.fire(LostReason::LeaseExpired);
            return;
        }
    }
}

#[async_trait]
impl LockBackend for EtcdBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo::new(
            BACKEND,
            Consistency::Cp,
            Capabilities {
                pushes_loss: true,
                // A crashed holder keeps the lock until its etcd lease expires.
                min_ttl: self.inner.config.session_ttl,
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

    /// Without a confirmed keep-alive for 2/3 of the etcd lease's TTL the cluster may
    /// expire it, and the key with it: no hold is believed past that, whatever its TTL.
    fn validity_bound(&self, grant: &Grant) -> Option<Instant> {
        let held = self.held_of(grant).ok()?;
        Some(held.lease.alive_until())
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let held = self.held_of(grant)?;
        let client = self.client();
        let sent = Instant::now();
        let look = || {
            let (mut client, name) = (client.clone(), held.name.clone());
            async move {
                client
                    .get(name, Some(GetOptions::new().with_keys_only()))
                    .await
            }
        };
        // The lease is extended from before the first try was sent: no later than the
        // try that was answered.
        let got = self.ask_within_limit(look, "checking the lock key").await?;
        let ours = got
            .kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == held.revision);
        if ours && !held.loss.is_fired() {
            // Never shorten the lease: another guard of this hold may rely on it.
            held.count.extend_lease(sent + ttl);
            Ok(())
        } else {
            self.forget(&held);
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        }
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        let held = self.held_of(grant)?;
        match held.count.release(grant.attempt) {
            // A retried release: it took effect already.
            CountRelease::Retried { remaining } => return Ok(Released::Partially { remaining }),
            CountRelease::Partial { remaining } => {
                self.record_depth(&held, remaining).await;
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
        held.lease.releasing();
        // From here the hold is over whatever happens to this future: dropped mid-way, it
        // still ends the lease (revoked in the background), although the caller keeps the
        // grant.
        let _end = EndOnDrop(&held.lease);
        let lost = held.loss.is_fired();
        // Delete the key if it is still ours (saying whether the hold lasted), then revoke
        // the lease in the background (it carries nothing after that). A try that failed
        // on the way may have deleted it: a later try that finds it gone is no loss.
        let delete = Txn::new()
            .when([Compare::create_revision(
                held.name.clone(),
                CompareOp::Equal,
                held.revision,
            )])
            .and_then([TxnOp::delete(held.name.clone(), None)]);
        let client = self.client();
        let tries = std::sync::atomic::AtomicU32::new(0);
        let send = || {
            let (mut client, delete) = (client.clone(), delete.clone());
            tries.fetch_add(1, Ordering::SeqCst);
            async move { client.txn(delete).await }
        };
        let deleted = self
            .ask_within_limit(
                send,
                "deleting the lock key (its lease is revoked in the background)",
            )
            .await;
        let retried = tries.load(Ordering::SeqCst) > 1;
        match deleted? {
            answer if (answer.succeeded() || retried) && !lost => Ok(Released::Fully),
            _ => Err(Error::NotHeld {
                key: grant.key.clone(),
            }),
        }
    }

    async fn ping(&self) -> Result<()> {
        let client = self.client();
        let prefix = self.inner.config.prefix.clone();
        let read = || {
            let (mut client, prefix) = (client.clone(), prefix.clone());
            async move {
                client
                    .get(prefix, Some(GetOptions::new().with_count_only()))
                    .await
            }
        };
        self.ask_within_limit(read, "reading the prefix").await?;
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let range = self.lock_range(key);
        let client = self.client();
        let first = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let read = || {
            let (mut client, range, first) = (client.clone(), range.clone(), first.clone());
            async move { client.get(range, Some(first)).await }
        };
        let got = self
            .ask_within_limit(read, "reading the contenders")
            .await?;
        let Some(head) = got.kvs().first() else {
            return Ok(None);
        };
        let name = String::from_utf8_lossy(head.key());
        let name = format!("key {}", name.strip_prefix(&range).unwrap_or(&name));
        let (owner, depth, identity) = parse_contender_record(head.value(), &name);
        // The count is of the whole range, whatever the limit.
        let waiters = u32::try_from(got.count().saturating_sub(1)).unwrap_or(u32::MAX);
        Ok(Some(
            HolderInfo::new(
                owner,
                depth,
                Some(FencingToken::new(
                    u64::try_from(head.create_revision()).unwrap_or(0),
                )),
                None,
            )
            .with_identity(identity)
            .with_waiters(waiters),
        ))
    }
}

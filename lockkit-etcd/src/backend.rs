//! `EtcdBackend`: leased contender keys ordered by create revision, predecessor watches,
//! keep-alives and loss.

mod holds;
mod kinds;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnResponse, WatchFilterType, WatchOptions,
};
use lockkit_core::spi::{
    AcquireRequest, CountRelease, Grant, HoldCount, Interrupt, Released, contender_record,
    deadline_after, detached_acquire, granted_or_timeout, parse_contender_record,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    LockKind, LossSignal, LostReason, OwnerId, Result,
};
use tokio::time::Instant;

use crate::{
    EtcdConfig,
    lease::{
        Lease, lease_not_found, retry_backoff,
        spare::{Spare, SpareLease},
    },
    path::{Contender, DOWNGRADED, classify, contender_name, lock_range},
    request::{BACKEND, Members, RETRY_PAUSE, Unanswered, ask, etcd_error, unanswered},
};
use holds::{Downgrade, Holds, Slot, WriteState};
use kinds::{Blocker, range_of};

/// How often HTTP/2 pings check a connection with streams open (etcd's
/// `--grpc-keepalive-min-time` refuses anything under 5 s).
const HTTP2_PING_EVERY: Duration = Duration::from_secs(6);

fn revision_of(answer: &TxnResponse) -> i64 {
    answer
        .header()
        .map_or(0, etcd_client::ResponseHeader::revision)
}

/// One hold: a contender key that its kind's rules let hold (see [`kinds`]).
pub(crate) struct Held {
    /// The contender key (see [`crate::path::contender_name`]).
    name: String,
    /// What is held.
    kind: LockKind,
    /// Its place among the owner's holds of the key.
    slot: Slot,
    /// For a read taken while the owner wrote the key: that write.
    downgrade: Option<Downgrade>,
    /// For a write: whether downgraded reads rely on it.
    readers: std::sync::Mutex<WriteState>,
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
    /// A hold nobody refers to any more gives its lease (and so its key) up, and the
    /// write key a downgraded read kept.
    fn drop(&mut self) {
        self.end_downgrade();
        self.lease.end();
    }
}

impl Held {
    /// For a downgraded read that is over: ends the write it kept, if the owner let that
    /// go already (once). Returns that write, whose lease is ending.
    fn end_downgrade(&self) -> Option<&Held> {
        let downgrade = self.downgrade.as_ref()?;
        if !downgrade.end() {
            return None;
        }
        let write = &downgrade.write;
        write.lease.releasing();
        write.lease.end();
        Some(write)
    }

    /// The fencing token: the key's create revision.
    fn token(&self) -> FencingToken {
        FencingToken::new(u64::try_from(self.revision).unwrap_or(0))
    }
}

pub(crate) struct Inner {
    config: EtcdConfig,
    client: Client,
    /// One client per member (the same client when there is one member): requests and
    /// keep-alive streams go to them in turn.
    members: Arc<Members>,
    held: Holds,
    /// Predecessor watches that fired, for herd checks.
    wakeups: AtomicU64,
    /// A lease granted ahead of need (see [`crate::lease::spare`]).
    spare: Spare,
    /// Spares the cluster no longer knew when a contender used them.
    spares_lost: AtomicU64,
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
        let client = Client::connect(&config.endpoints, Some(options.clone()))
            .await
            .map_err(|e| etcd_error(&format!("connecting to `{members}`"), e))?;
        // Each connects lazily, when a request first goes through it.
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
        let (limit, try_time) = (request_limit_of(&config), per_try_of(&config));
        let member_clients = Arc::new(Members::new(
            member_clients,
            config.endpoints.clone(),
            try_time,
        ));
        // The client connects lazily: a lease grant proves a member answers and the
        // cluster has a leader, and says which TTL the cluster grants. Asked of the members
        // in turn: one of them down or frozen does not fail the connection.
        let asked = config.session_ttl.as_secs();
        let asked_ttl = i64::try_from(asked).unwrap_or(i64::MAX);
        let grant = |mut client: Client| async move { client.lease_grant(asked_ttl, None).await };
        let end = Instant::now() + config.connect_timeout;
        let granted = match ask(&member_clients, grant, end, try_time, None).await {
            Ok((Ok(granted), _)) => granted,
            Ok((Err(e), _)) => {
                return Err(etcd_error(&format!("granting a lease on `{members}`"), e));
            }
            Err(_) => {
                return Err(Error::backend(
                    BACKEND,
                    true,
                    format!(
                        "no etcd member of `{members}` answered within {:?}; are they \
                         running, and does the cluster have a leader?",
                        config.connect_timeout
                    ),
                ));
            }
        };
        let probe = granted.id();
        revoke_in_background(member_clients.clone(), probe, limit, try_time);
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
                members: member_clients,
                held: Holds::default(),
                wakeups: AtomicU64::new(0),
                spare: Spare::default(),
                spares_lost: AtomicU64::new(0),
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

    /// The spare lease's id, if there is one (see [`crate::lease::spare`]; for tests).
    #[doc(hidden)]
    pub fn spare_lease(&self) -> Option<i64> {
        self.inner.spare.peek()
    }

    /// How many spare leases the cluster no longer knew when a contender used them (the
    /// contender was then granted a lease of its own; for tests).
    #[doc(hidden)]
    pub fn spares_lost(&self) -> u64 {
        self.inner.spares_lost.load(Ordering::SeqCst)
    }

    /// The key range whose keys are `key`'s contenders (ends with `/`).
    pub fn lock_range(&self, key: &LockKey) -> String {
        lock_range(&self.inner.config.prefix, key)
    }

    /// How long one request may stay unanswered (see [`request_limit_of`]).
    fn request_limit(&self) -> Duration {
        request_limit_of(&self.inner.config)
    }

    /// How long a request sent now may stay unanswered by an acquisition whose wait ends
    /// at `deadline`: until the deadline, and one request limit of silence past it (or past
    /// now, for a request sent after it).
    fn request_end(&self, deadline: Instant) -> Instant {
        let from = deadline.max(Instant::now());
        from.checked_add(self.request_limit()).unwrap_or(from)
    }

    /// Forgets `held` (a grant of it is no longer accepted); a downgraded read that is
    /// over ends the write key it kept.
    fn forget(&self, held: &Held) {
        self.inner
            .held
            .forget(held.owner, &held.key, held.slot, held);
        held.end_downgrade();
    }

    /// The live hold behind `grant`, checking it belongs to this client, owner and key.
    fn held_of(&self, grant: &Grant) -> Result<Arc<Held>> {
        self.inner.held.held_of(grant)
    }

    /// Gives a contender up ([`Self::give_up`]) after a request failed (`Ok`) or went
    /// unanswered (`Err`): an error saying what it was `doing`, or no grant when the caller
    /// went away.
    async fn abandon(
        &self,
        lease: &Lease,
        why: std::result::Result<etcd_client::Error, Unanswered>,
        doing: &str,
    ) -> Result<Option<Grant>> {
        let outcome = match why {
            Ok(e) => Err(etcd_error(doing, e)),
            Err(Unanswered::Interrupted) => Ok(None),
            Err(Unanswered::TooLate) => Err(unanswered(doing, self.request_limit())),
        };
        Self::give_up(lease).await;
        outcome
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

    /// How long one try of a request may stay unanswered (see [`per_try_of`]).
    fn per_try(&self) -> Duration {
        per_try_of(&self.inner.config)
    }

    /// Grants the next spare lease in the background (see [`crate::lease::spare`]); the caller
    /// took the refill from [`Spare::take`].
    fn refill_spare(&self, session_ttl: i64) {
        let backend = self.clone();
        tokio::spawn(async move {
            let inner = &backend.inner;
            let (limit, per_try) = (backend.request_limit(), backend.per_try());
            let grant =
                |mut client: Client| async move { client.lease_grant(session_ttl, None).await };
            let granted =
                match ask(&inner.members, grant, Instant::now() + limit, per_try, None).await {
                    Ok((Ok(granted), sent)) => Some(SpareLease {
                        id: granted.id(),
                        ttl: granted.ttl(),
                        sent,
                    }),
                    Ok((Err(error), _)) => {
                        tracing::debug!(%error, "granting a spare lease failed");
                        None
                    }
                    Err(_) => None,
                };
            if let Some(surplus) = inner.spare.refilled(granted) {
                revoke_in_background(inner.members.clone(), surplus.id, limit, per_try);
            }
        });
    }

    /// Asks `request` (idempotent) with retries until one request limit from now.
    async fn ask_within_limit<T, F, Fut>(&self, request: F, doing: &str) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let end = Instant::now() + self.request_limit();
        match ask(&self.inner.members, request, end, self.per_try(), None).await {
            Ok((answer, _)) => answer.map_err(|e| etcd_error(doing, e)),
            Err(_) => Err(unanswered(doing, self.request_limit())),
        }
    }

    /// Whether what `blocker` stands for changed since it was read: the check `check` (of
    /// a contender of `kind` created at `revision`) finds another blocker, none, or no
    /// contender key; also when the cluster does not answer in time (the caller then
    /// looks again).
    async fn blocker_moved(
        &self,
        check: &Txn,
        (range, kind, revision): (&str, LockKind, i64),
        blocker: &Blocker,
    ) -> bool {
        let send = |mut client: Client| {
            let check = check.clone();
            async move { client.txn(check).await }
        };
        match self.ask_within_limit(send, "looking again").await {
            Ok(answer) if answer.succeeded() => kinds::blocker(range, kind, revision, &answer, 0)
                .is_none_or(|now| now.keys != blocker.keys),
            _ => true,
        }
    }

    /// Queues for the lock as `req.kind` says and waits until that kind's rules let it
    /// hold (see [`kinds`]); `None` when `wait` ran out or the caller went away (the
    /// contender's lease is revoked then). A read that downgrades its owner's write
    /// (`downgrade`) holds as soon as its key exists.
    async fn contend(
        &self,
        req: &AcquireRequest,
        wait: Duration,
        interrupt: Interrupt,
        downgrade: Option<Downgrade>,
    ) -> Result<Option<Grant>> {
        let deadline = deadline_after(wait);
        let range = self.lock_range(&req.key);
        let session_ttl = i64::try_from(self.inner.config.session_ttl.as_secs()).unwrap_or(1);
        let per_try = self.per_try();
        // Requests that fail on the way (a member down or frozen, a connection that broke
        // while idle) are asked again until the wait ends, and one request limit past it.
        // A lease granted whose answer never arrives carries no key and expires by itself.
        let members = &self.inner.members;
        let taken = self.inner.spare.take(Instant::now());
        if let Some(stale) = taken.stale {
            revoke_in_background(members.clone(), stale.id, self.request_limit(), per_try);
        }
        if taken.refill {
            self.refill_spare(session_ttl);
        }
        // A spare the cluster no longer knows (revoked by someone, lost in a restore) fails
        // the creation with nothing written: the contender then asks for a lease of its own.
        let mut spare = taken.lease;
        let (granted, lease, name, answer, sent) = loop {
            let from_spare = spare.is_some();
            let granted = match spare.take() {
                Some(spare) => spare,
                None => {
                    let grant_lease = |mut client: Client| async move {
                        client.lease_grant(session_ttl, None).await
                    };
                    match ask(
                        members,
                        grant_lease,
                        self.request_end(deadline),
                        per_try,
                        Some(&interrupt),
                    )
                    .await
                    {
                        Ok((Ok(granted), sent)) => SpareLease {
                            id: granted.id(),
                            ttl: granted.ttl(),
                            sent,
                        },
                        Ok((Err(e), _)) => {
                            return Err(etcd_error("granting the contender's lease", e));
                        }
                        Err(Unanswered::Interrupted) => return Ok(None),
                        Err(Unanswered::TooLate) => {
                            return Err(unanswered("granting a lease", self.request_limit()));
                        }
                    }
                }
            };
            let ttl = Duration::from_secs(u64::try_from(granted.ttl).unwrap_or(0));
            let lease = Lease::keep(
                self.inner.members.clone(),
                granted.id,
                ttl,
                granted.sent,
                self.request_limit(),
            );
            let name = contender_name(&range, req.kind, granted.id);
            // Create the contender key, unless an earlier try whose answer was lost did; the
            // same transaction reads the key just before it, and whether the range is used as
            // another kind (a semaphore, or a lock for a semaphore).
            let conflicts = kinds::conflict_ops(&range, req.kind);
            let mut created = vec![
                TxnOp::put(
                    name.clone(),
                    contender_record(&req.owner.to_string(), 1, &req.identity.encode()),
                    Some(PutOptions::new().with_lease(granted.id)),
                ),
                TxnOp::get(
                    range.clone(),
                    Some(
                        GetOptions::new()
                            .with_prefix()
                            .with_keys_only()
                            .with_sort(SortTarget::Create, SortOrder::Descend)
                            .with_limit(2),
                    ),
                ),
            ];
            created.extend(conflicts.iter().cloned());
            let mut found = vec![TxnOp::get(name.clone(), None)];
            found.extend(conflicts);
            let create = Txn::new()
                .when([Compare::create_revision(name.clone(), CompareOp::Equal, 0)])
                .and_then(created)
                .or_else(found);
            let send_create = |mut client: Client| {
                let create = create.clone();
                async move { client.txn(create).await }
            };
            let why = match ask(
                members,
                send_create,
                self.request_end(deadline),
                per_try,
                Some(&interrupt),
            )
            .await
            {
                Ok((Ok(answer), sent)) => break (granted, lease, name, answer, sent),
                Ok((Err(e), _)) if from_spare && lease_not_found(&e) => {
                    self.inner.spares_lost.fetch_add(1, Ordering::SeqCst);
                    lease.end();
                    continue;
                }
                Ok((Err(e), _)) => Ok(e),
                Err(why) => Err(why),
            };
            return self
                .abandon(&lease, why, "creating the contender key")
                .await;
        };
        // Any failure from here on gives the contender up (its lease revoked).
        let failed = |why: std::result::Result<etcd_client::Error, Unanswered>,
                      doing: &'static str| {
            self.abandon(&lease, why, doing)
        };
        let at = revision_of(&answer);
        let (revision, conflicts_at) = if answer.succeeded() {
            (at, 2)
        } else {
            match range_of(&answer, 0).first() {
                // An earlier try created it: look afresh for what it waits for.
                Some(kv) if kv.lease() == granted.id => (kv.create_revision(), 1),
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
        if let Some(found) = kinds::mismatch(&range, req.kind, &answer, conflicts_at) {
            Self::give_up(&lease).await;
            return Err(Error::KindMismatch {
                key: req.key.clone(),
                found,
                asked: req.kind,
            });
        }
        let mut look = if downgrade.is_some() {
            // The owner writes: nobody else holds the key, and the write key stays while
            // this read lasts.
            Some((sent, at, None))
        } else if answer.succeeded()
            && !matches!(req.kind, LockKind::Read | LockKind::Permit { .. })
        {
            // A plain lock or a writer waits for any key before its own: ours is the
            // newest key of the range, and the next one down precedes it.
            let predecessor = range_of(&answer, 1)
                .into_iter()
                .find(|kv| kv.create_revision() < at)
                .map(|kv| Blocker::deletion_of(kv.key().to_vec()));
            Some((sent, at, predecessor))
        } else {
            None
        };

        // The lease starts when the grant is observed (the request that found nothing
        // blocking ours was sent), not when the wait began: a wait longer than the TTL
        // must not yield an expired grant.
        let check = Txn::new()
            .when([Compare::create_revision(
                name.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then(kinds::check_ops(&range, req.kind, revision));
        // A watch that broke without a word (a frozen member) must not keep a waiter past
        // its blocker's release for longer than this.
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
            let (sent, at, blocker) = match look.take() {
                Some(seen) => seen,
                None => {
                    let send_check = |mut client: Client| {
                        let check = check.clone();
                        async move { client.txn(check).await }
                    };
                    let (answer, sent) = match ask(
                        members,
                        send_check,
                        self.request_end(deadline),
                        per_try,
                        Some(&interrupt),
                    )
                    .await
                    {
                        Ok((Ok(answer), sent)) => (answer, sent),
                        Ok((Err(e), _)) => {
                            return failed(Ok(e), "looking for what the contender waits for").await;
                        }
                        Err(why) => {
                            return failed(Err(why), "looking for what the contender waits for")
                                .await;
                        }
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
                    let blocker = kinds::blocker(&range, req.kind, revision, &answer, 0);
                    (sent, revision_of(&answer), blocker)
                }
            };
            let Some(blocker) = blocker else {
                break (sent, at);
            };
            if wait.is_zero() || Instant::now() >= deadline {
                Self::give_up(&lease).await;
                return Ok(None);
            }
            // Changes from now on. (A watch from the listing's revision would see the ones
            // in between too, but etcd serves a watch that starts in the past from a
            // catch-up loop that runs every 100 ms: a slow wake-up under load. The gap is
            // closed below instead.)
            let mut watch = WatchOptions::new();
            if let Some(end) = &blocker.end {
                watch = watch.with_range(end.clone());
            }
            if blocker.deletes_only {
                watch = watch.with_filters([WatchFilterType::NoPut]);
            }
            let open_watch = |mut client: Client| {
                let (key, watch) = (blocker.key.clone(), watch.clone());
                async move { client.watch(key, Some(watch)).await }
            };
            let mut stream = match ask(
                members,
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
                            let woken = answer.events().iter().any(|e| {
                                !blocker.deletes_only || e.event_type() == EventType::Delete
                            });
                            if woken {
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
                                && self
                                    .blocker_moved(&check, (&range, req.kind, revision), &blocker)
                                    .await
                            {
                                // Changed between the listing and the watch.
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
        let slot = Slot::of(req.kind, req.attempt.as_u128());
        let held = Arc::new(Held {
            name: name.clone(),
            kind: req.kind,
            slot,
            downgrade,
            readers: std::sync::Mutex::default(),
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
            .insert(req.owner, req.key.clone(), slot, held.clone());
        lease.attach(held.loss.clone());
        if let Some(downgrade) = &held.downgrade {
            // Without the write key, writers queued behind it would enter beside this read.
            downgrade.write.lease.attach(held.loss.clone());
            // A read whose own lease is lost needs the write key no more: a write let go
            // goes now, not when the read is released or forgotten.
            let (read, lease) = (Arc::downgrade(&held), lease.clone());
            tokio::spawn(async move {
                lease.over().await;
                if lease.lost().is_some()
                    && let Some(read) = read.upgrade()
                {
                    read.end_downgrade();
                }
            });
        }
        tokio::spawn(watch_own_key(
            (self.inner.members.clone(), self.request_limit(), per_try),
            lease,
            name,
            revision,
            seen_at + 1,
        ));
        tokio::spawn(enforce_lease(self.clone(), Arc::downgrade(&held)));
        Ok(Some(
            Grant::new(req, held.token(), 1, granted_at).with_state(held),
        ))
    }

    /// The owner's live hold of `key` in `slot`.
    fn live(&self, req: &AcquireRequest, slot: Slot) -> Option<Arc<Held>> {
        self.inner
            .held
            .get(req.owner, &req.key, slot)
            .filter(|h| !h.loss.is_fired())
    }

    /// Refuses what `req`'s owner may never be granted beside its own holds of the key
    /// (an upgrade, a change of kind); the owner's write when `req` downgrades it.
    fn owner_rules(&self, req: &AcquireRequest) -> Result<Option<Arc<Held>>> {
        let reads = self.live(req, Slot::Read).is_some();
        let write = self.live(req, Slot::Write);
        let plain = self.live(req, Slot::Lock).is_some();
        let mismatch = |found: &str| Error::KindMismatch {
            key: req.key.clone(),
            found: found.into(),
            asked: req.kind,
        };
        match req.kind {
            LockKind::Write | LockKind::Exclusive if reads && write.is_none() => {
                Err(Error::WouldDeadlock {
                    key: req.key.clone(),
                    held: LockKind::Read,
                    asked: req.kind,
                })
            }
            LockKind::Read | LockKind::Write if plain => {
                Err(mismatch("is held by this owner as an exclusive lock"))
            }
            LockKind::Exclusive if write.is_some() => {
                Err(mismatch("is held by this owner as a read-write lock"))
            }
            LockKind::Read => Ok(write),
            _ => Ok(None),
        }
    }

    async fn acquire_within(&self, req: &AcquireRequest, wait: Duration) -> Result<Option<Grant>> {
        // Re-entry (for a permit: a retried attempt), if the owner holds what it asks for.
        let slot = Slot::of(req.kind, req.attempt.as_u128());
        if let Some(held) = self.live(req, slot) {
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
                    if held.kind == LockKind::Exclusive {
                        // Read-write and permit keys are never rewritten (etcd's recipe
                        // orders by mod revision).
                        this.record_depth(&held, depth).await;
                    }
                    let grant = Grant::new(&request, held.token(), depth, start);
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
        let downgrade = self.owner_rules(req)?.and_then(Downgrade::take);
        let (this, request, giver) = (self.clone(), req.clone(), self.clone());
        detached_acquire(
            BACKEND,
            move |interrupt| async move {
                this.contend(&request, wait, interrupt, downgrade).await
            },
            std::convert::identity,
            move |grant| async move {
                let _ = giver.release(&grant).await;
            },
        )
        .await
    }

    /// Lets the owner's write go while a downgraded read of the same owner relies on its
    /// key: the key stays (it keeps out the writers queued behind it, which the read's
    /// newer key would not), and a marker beside it, on the same lease, lets other readers
    /// join. The read's end takes both (see [`Held::end_downgrade`]).
    async fn keep_for_read(&self, held: &Held, grant: &Grant) -> Result<Released> {
        self.inner
            .held
            .forget(held.owner, &held.key, held.slot, held);
        let lost = held.loss.is_fired();
        // The mark is put again by a retried try: a try that failed on the way leaves the
        // key (and so the compare) as it was. A compare that fails found the key gone or
        // re-created (the `or_else` branch reads it).
        let mark = Txn::new()
            .when([Compare::create_revision(
                held.name.clone(),
                CompareOp::Equal,
                held.revision,
            )])
            .and_then([TxnOp::put(
                format!("{}{DOWNGRADED}", held.name),
                "",
                Some(PutOptions::new().with_lease(held.lease.id)),
            )])
            .or_else([TxnOp::get(
                held.name.clone(),
                Some(GetOptions::new().with_keys_only()),
            )]);
        let send = |mut client: Client| {
            let mark = mark.clone();
            async move { client.txn(mark).await }
        };
        let marked = self
            .ask_within_limit(send, "marking the write key as kept for a downgraded read")
            .await;
        // The read may have ended meanwhile and taken the key and its lease with it (the
        // mark then finds no key, or no lease): no loss either.
        let read_took_it = held.lease.lost().is_none() && held.lease.is_over();
        let lasted = match marked {
            Ok(answer) if answer.succeeded() => true,
            Ok(answer) if read_took_it => self.revoked_for_read(held, &answer).await?,
            Ok(_) => false,
            Err(_) if read_took_it => true,
            Err(e) => return Err(e),
        };
        if lasted && !lost {
            Ok(Released::Fully)
        } else {
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        }
    }

    /// For a write let go while a downgraded read relied on it, whose mark found the key
    /// not `held`'s (`answer`, the `or_else` branch: the key as read then) after the read
    /// ended and so ended the write's lease: whether that lease's revocation took the key.
    ///
    /// Not when the key was re-created under another create revision, nor while the lease
    /// is still alive on the cluster (the key went without it: deleted by someone else).
    /// A lease gone is taken as this client's revocation; an expiry or an operator's
    /// revocation just before it is not told apart (reported as released), nor is a key
    /// deleted without its lease just before the revocation.
    async fn revoked_for_read(&self, held: &Held, answer: &TxnResponse) -> Result<bool> {
        if !range_of(answer, 0).is_empty() {
            return Ok(false);
        }
        Ok(!self.lease_alive(held.lease.id).await?)
    }

    /// Whether etcd lease `id` is alive on the cluster (its `LeaseTimeToLive`); the
    /// error when no member answers within the request limit.
    async fn lease_alive(&self, id: i64) -> Result<bool> {
        let read = |mut client: Client| async move { client.lease_time_to_live(id, None).await };
        let left = self.ask_within_limit(read, "reading a lease").await?;
        // A lease the cluster no longer knows answers -1; 0 is about to expire (taken as
        // gone: the holder's keep-alives have gone unconfirmed for its whole TTL).
        Ok(left.ttl() > 0)
    }

    /// For a release whose deletion of `held`'s key was sent more than once and whose
    /// answered try found the key not `held`'s (`answer`, the `or_else` branch: the key as
    /// read then): whether an earlier try, whose answer was lost, deleted it while it was
    /// still `held`'s.
    ///
    /// Only when the key is gone and its lease is still alive on the cluster: the key
    /// lives on that lease, and this client revokes the lease only after the release (the
    /// keeper keeps it alive meanwhile; [`Lease::lose`] is a no-op once releasing), so a
    /// key that went with its lease (expired, or revoked by an operator) was lost before
    /// the deletion. A key found again under another create revision (deleted and
    /// re-created by someone else) is a loss too. Without an answer about the lease, the
    /// error: no claim either way.
    ///
    /// What no evidence here tells apart (reported as released): the key deleted without
    /// its lease (`etcdctl del`, an operator's delete) after the watch on the hold's own key
    /// last told this client, and before the retried try, when the first try failed on the
    /// way. A deletion the holder heard of before the release began fired its loss signal,
    /// and is reported as a loss.
    async fn took_it_before(&self, held: &Held, answer: &TxnResponse) -> Result<bool> {
        if !range_of(answer, 0).is_empty() {
            // Another key of the same name: ours was deleted, by someone else.
            return Ok(false);
        }
        self.lease_alive(held.lease.id).await
    }

    /// What is left of etcd lease `lease` (`None`: no lease, gone, or no answer).
    async fn lease_left(&self, lease: i64) -> Option<Duration> {
        if lease == 0 {
            return None;
        }
        let read = |mut client: Client| async move { client.lease_time_to_live(lease, None).await };
        let left = self.ask_within_limit(read, "reading a lease").await.ok()?;
        u64::try_from(left.ttl())
            .ok()
            .filter(|left| *left > 0)
            .map(Duration::from_secs)
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
        let send = |mut client: Client| {
            let write = write.clone();
            async move { client.txn(write).await }
        };
        let _ = self
            .ask_within_limit(send, "recording the hold count")
            .await;
    }
}

/// Revokes lease `id` (it carries nothing) in a task of its own, best effort: one that
/// stays is expired by the cluster within its TTL.
fn revoke_in_background(members: Arc<Members>, id: i64, limit: Duration, per_try: Duration) {
    tokio::spawn(async move {
        let revoke = |mut client: Client| async move { client.lease_revoke(id).await };
        let _ = ask(&members, revoke, Instant::now() + limit, per_try, None).await;
    });
}

/// How long one request may stay unanswered: `connect_timeout`, but at most a third of the
/// session TTL.
fn request_limit_of(config: &EtcdConfig) -> Duration {
    config
        .connect_timeout
        .min(config.session_ttl / 3)
        .max(Duration::from_millis(100))
}

/// How long one try of a request may stay unanswered before it is sent again (to another
/// member): half the request limit.
fn per_try_of(config: &EtcdConfig) -> Duration {
    (request_limit_of(config) / 2).max(Duration::from_millis(100))
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
///
/// The watch is opened, and the key read, through the members in turn (`members`, with the
/// request limit and the time of one try), so a frozen member does not keep it unopened.
async fn watch_own_key(
    (members, limit, per_try): (Arc<Members>, Duration, Duration),
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
        let open = |mut client: Client| {
            let (name, watch) = (name.clone(), watch.clone());
            async move { client.watch(name, Some(watch)).await }
        };
        let opened = tokio::select! {
            opened = ask(&members, open, Instant::now() + limit, per_try, None) => opened,
            () = lease.over() => return,
        };
        let mut stream = match opened {
            Ok((Ok(stream), _)) => stream,
            failed => {
                let error = match failed {
                    Ok((Err(e), _)) => e.to_string(),
                    _ => "no member answered".to_owned(),
                };
                tracing::debug!(name, error, "watching a held key failed; retrying");
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
                            let get = |mut client: Client| {
                                let name = name.clone();
                                async move {
                                    client
                                        .get(name, Some(GetOptions::new().with_keys_only()))
                                        .await
                                }
                            };
                            let end = Instant::now() + lease.ttl / 3;
                            if let Ok((Ok(got), _)) = ask(&members, get, end, per_try, None).await {
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
                // etcd's recipe `RWMutex` layout, FIFO by create revision.
                read_write: true,
                writer_preference: true,
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

    /// Without a confirmed keep-alive for 2/3 of the etcd lease's TTL the cluster may
    /// expire it, and the key with it: no hold is believed past that, whatever its TTL.
    /// A downgraded read also relies on its owner's write key (and lease). The time the
    /// machine spent suspended since counts (the cluster's clock ran on).
    fn validity_bound(&self, grant: &Grant) -> Option<Instant> {
        let held = self.held_of(grant).ok()?;
        let own = held.lease.believed_until();
        Some(match &held.downgrade {
            Some(downgrade) => own.min(downgrade.write.lease.believed_until()),
            None => own,
        })
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let held = self.held_of(grant)?;
        let sent = Instant::now();
        let look = |mut client: Client| {
            let name = held.name.clone();
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
            held.count
                .extend_lease(lockkit_core::spi::lease_end(sent, ttl));
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
                if held.kind == LockKind::Exclusive {
                    self.record_depth(&held, remaining).await;
                }
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
        if held.kind == LockKind::Write && WriteState::let_go(&held.readers) {
            return self.keep_for_read(&held, grant).await;
        }
        // A downgraded read whose write was let go takes the write key with it.
        let write_ends = held.end_downgrade();
        self.forget(&held);
        held.lease.releasing();
        // From here the hold is over whatever happens to this future: dropped mid-way, it
        // still ends the lease (revoked in the background), although the caller keeps the
        // grant.
        let _end = EndOnDrop(&held.lease);
        let lost = held.loss.is_fired();
        // Delete the key if it is still ours (saying whether the hold lasted), then revoke
        // the lease in the background (it carries nothing after that). Otherwise read the
        // key: a try that failed on the way may have deleted it (see
        // [`Self::took_it_before`]).
        let delete = Txn::new()
            .when([Compare::create_revision(
                held.name.clone(),
                CompareOp::Equal,
                held.revision,
            )])
            .and_then([TxnOp::delete(held.name.clone(), None)])
            .or_else([TxnOp::get(
                held.name.clone(),
                Some(GetOptions::new().with_keys_only()),
            )]);
        let tries = std::sync::atomic::AtomicU32::new(0);
        let send = |mut client: Client| {
            let delete = delete.clone();
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
        if let Some(write) = write_ends {
            // Waiters behind the write key may enter once this returns.
            Self::give_up(&write.lease).await;
        }
        let answer = deleted?;
        let lasted = !lost
            && (answer.succeeded() || (retried && self.took_it_before(&held, &answer).await?));
        if lasted {
            Ok(Released::Fully)
        } else {
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        }
    }

    async fn ping(&self) -> Result<()> {
        let prefix = self.inner.config.prefix.clone();
        let read = |mut client: Client| {
            let prefix = prefix.clone();
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
        let first = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let read = |mut client: Client| {
            let (range, first) = (range.clone(), first.clone());
            async move { client.get(range, Some(first)).await }
        };
        let got = self
            .ask_within_limit(read, "reading the contenders")
            .await?;
        let Some(head) = got.kvs().first() else {
            return Ok(None);
        };
        if classify(&range, head.key()) != Contender::Lock {
            // Readers, a writer or permits: the first of the holders.
            return Ok(self.holders(key).await?.into_iter().next());
        }
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

    /// Every key of the range that holds: the plain lock or the writer (the first key),
    /// each reader with no writer or plain lock before it (or behind its own owner's
    /// write: a downgrade), each permit with fewer than N permits before it; with its kind,
    /// token (create revision), the etcd lease left and who took it; each says how many
    /// contenders wait. A write key kept only for a downgraded read is not listed.
    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        let range = self.lock_range(key);
        let all = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let read = |mut client: Client| {
            let (range, all) = (range.clone(), all.clone());
            async move { client.get(range, Some(all)).await }
        };
        let got = self
            .ask_within_limit(read, "reading the contenders")
            .await?;
        let (holding, waiting) = kinds::holding(&range, got.kvs());
        let mut holders = Vec::with_capacity(holding.len());
        for hold in holding {
            let kv = hold.kv;
            let name = String::from_utf8_lossy(kv.key());
            let name = format!("key {}", name.strip_prefix(&range).unwrap_or(&name));
            let (owner, depth, identity) = parse_contender_record(kv.value(), &name);
            let ttl_left = self.lease_left(kv.lease()).await;
            let info = HolderInfo::new(
                owner,
                depth,
                Some(FencingToken::new(
                    u64::try_from(kv.create_revision()).unwrap_or(0),
                )),
                ttl_left,
            )
            .with_identity(identity)
            .with_waiters(waiting);
            holders.push(match hold.kind {
                Some(kind) => info.with_kind(kind),
                None => info,
            });
        }
        Ok(holders)
    }
}

//! `RedisBackend`: one Redis server, or one Redis Cluster.

mod kinds;

pub(crate) use kinds::{ForgetWriter, MARKER_REFRESH, MarkShare, WriterMarker};

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use lockkit_core::spi::{
    AcquireRequest, Attempt, Backoff, Grant, Released, WaitPolicy, wait_for_grant,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderIdentity, HolderInfo,
    LockBackend, LockKey, LockKind, Result,
};
use redis::{
    Value,
    aio::{ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClientBuilder,
};
use tokio::time::Instant;

use crate::{
    RedisConfig, Topology,
    conn::{Conn, ForeignWatch, GrantConns, ReleaseMessages, Wakeups, backend_error},
    wire::{self, LockNames},
};

/// How long a waiter behind a holder in a foreign format (no release notification) sleeps
/// between attempts at most.
pub(crate) const FOREIGN_HOLDER_POLL: Duration = Duration::from_millis(100);

/// The same, while the key's deletion wakes the waiter through keyspace notifications
/// (see [`ForeignWatch`]): a safety net for notifications turned off at the server since.
const FOREIGN_HOLDER_POLL_NOTIFIED: Duration = Duration::from_secs(1);

/// How a waiter paces its retries: without a live subscription (or after an error) it
/// polls every 50 ms, backing off to 160–240 ms; with one it sleeps until the holder's
/// lease ends (a second when the key has no expiry), woken earlier by the release.
pub(super) fn wait_policy() -> WaitPolicy {
    WaitPolicy::new(Backoff::new(
        Duration::from_millis(50),
        Duration::from_millis(160),
    ))
}

/// The hash field that marks one acquisition (see [`wire::ATTEMPT_FIELD_PREFIX`]); empty
/// for the nil attempt, which releases one hold whatever acquired it.
pub(crate) fn attempt_field(attempt: uuid::Uuid) -> String {
    if attempt.is_nil() {
        String::new()
    } else {
        format!("{}{attempt}", wire::ATTEMPT_FIELD_PREFIX)
    }
}

/// A waiting plain acquisition's place in the key's waiter queue (see [`wire::queue_of`]).
#[derive(Debug, Clone)]
pub(crate) struct QueueTurn {
    /// The waiter's id in the queue and in release messages ([`queue_id`], its owner's).
    pub(crate) id: u64,
    /// An earlier attempt of the wait may have queued it: a grant leaves the queue.
    pub(crate) may_be_queued: bool,
    /// The score of the wait's place (0: none yet), shared by its attempts: each sends it,
    /// and a busy answer that queued the waiter records it. A waiter that a release named
    /// and popped, and that then found the key taken by a newcomer, queues again at this
    /// place rather than at the back (see [`wire::ACQUIRE`]).
    pub(crate) place_score: Arc<AtomicU64>,
}

impl QueueTurn {
    /// The turn of a wait's next attempt.
    pub(crate) fn new(id: u64, may_be_queued: bool, place_score: Arc<AtomicU64>) -> Self {
        Self {
            id,
            may_be_queued,
            place_score,
        }
    }
}

/// The queue id of `owner`'s waits: at least [`wire::NAMED_WAITER_MIN`] and below twice
/// that, spread over all of the owner's bits (SplitMix64's finish). One per owner, not per
/// wait: two waits of one owner on a key (without the in-process gate) share one place, so
/// that a release naming it, or a grant taking the key for it, sends both to the server,
/// where the one not granted re-enters. Two owners with one id would only both try at a
/// release naming it.
pub(crate) fn queue_id(owner: &lockkit_core::OwnerId) -> u64 {
    let (high, low) = owner.client().as_u64_pair();
    let mut z = high ^ low.rotate_left(29) ^ owner.n().wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    wire::NAMED_WAITER_MIN | (z & (wire::NAMED_WAITER_MIN - 1))
}

pub(crate) fn ttl_millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Connections of their own for acquisitions that wait for replicas (`WAIT` blocks one):
/// this many acquisitions of one client wait for their replicas at once, the rest queue.
const GRANT_CONNECTIONS: usize = 4;

struct Inner {
    conn: Conn,
    /// Where acquisitions run: `conn` itself, or with `wait_replicas` connections of their
    /// own, since `WAIT` blocks the connection it is sent on (renewals on `conn` must not
    /// queue behind it) and must follow the grant's write on the same connection.
    grant_conns: GrantConns,
    wakeups: Arc<Wakeups>,
    config: RedisConfig,
    cluster: bool,
    target: String,
    /// The database of a single server's keys (keyspace channels name it).
    db: i64,
    /// Whether the server sends keyspace notifications of generic commands, once asked
    /// (see [`RedisBackend::probe_keyspace_events`]).
    keyspace_events: Arc<std::sync::OnceLock<bool>>,
    /// The question is out.
    keyspace_probing: AtomicBool,
}

/// A Redis lock service on one server or one Redis Cluster.
///
/// Locks use Redisson's RLock layout (a hash per lock, hold counts per owner, release
/// messages on `redisson_lock__channel:{name}`) plus Redisson's fencing counter, so Java
/// services on Redisson and Rust services on lockkit exclude each other on the same name.
/// Acquire, renew and release are single Lua scripts run by SHA.
///
/// Redis is AP: a failover to a replica that had not yet received a grant can grant the
/// lock twice. Use `?wait_replicas=N` to make a grant wait for replicas, and fencing tokens
/// to make a stale holder harmless.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("target", &self.inner.target)
            .field("cluster", &self.inner.cluster)
            .field("prefix", &self.inner.config.prefix)
            .finish()
    }
}

impl RedisBackend {
    /// Connects to the server or cluster a `redis://`, `rediss://` or `redis+cluster://`
    /// URL names (see [`RedisConfig::parse`]).
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL; [`Error::Backend`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::from_config(RedisConfig::parse(url)?).await
    }

    /// Connects as `config` says.
    ///
    /// # Errors
    /// As [`RedisBackend::connect`].
    pub async fn from_config(config: RedisConfig) -> Result<Self> {
        Self::connect_as(config, true).await
    }

    /// As [`RedisBackend::from_config`]; `direct` lets a plain-TCP server's commands run on
    /// a [`crate::conn::direct::DirectConn`]. Redlock's masters do not: measured on this project's
    /// 2-core machine, five masters' rounds gained no latency from it (the masters' own CPU
    /// bounds them there) and lost 30-45% of their throughput over 1,000 keys x 32 tasks
    /// (each request its own write, where the multiplexed connection batches concurrent ones).
    /// Without `direct` (Redlock's masters), a lost connection is also made again once, at
    /// once, without redis-rs's retries and backoff: a master that is down must fail at once
    /// rather than hold every round and release while they run (see `redlock::Master`).
    pub(crate) async fn connect_as(config: RedisConfig, direct: bool) -> Result<Self> {
        // A config built in code has not been through `RedisConfig::parse`.
        config.check_timeouts()?;
        let bad_url = |e: redis::RedisError| Error::Config(format!("invalid Redis address: {e}"));
        // A grant confirmed by `WAIT` needs the two on one connection, never retried on a
        // new one (a fresh connection's `WAIT` confirms nothing).
        let grant_timeout = config
            .response_timeout
            .saturating_add(config.wait_replicas_timeout);
        // Redlock's masters (not `direct`) are made again once, at once (see above).
        let connect_retries = if direct { 2 } else { 0 };
        let (conn, grant_conns, subscriber, target, cluster) = match &config.topology {
            Topology::Single(url) => {
                let client = crate::conn::tcp::client(url, config.keepalive).map_err(bad_url)?;
                let target = lockkit_core::config::redact_url(url);
                let manager = |response_timeout, retries| {
                    let manager_config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(config.connect_timeout))
                        .set_response_timeout(Some(response_timeout))
                        .set_number_of_retries(retries);
                    ConnectionManager::new_with_config(client.clone(), manager_config)
                };
                // A plain-TCP server is driven from the callers' tasks (one hand-off per
                // round trip less each way); TLS, Unix sockets and RESP3 stay on redis-rs's
                // multiplexed connection.
                let conn = if direct && crate::conn::direct::supports(&client) {
                    Conn::Direct(
                        crate::conn::direct::DirectConn::connect(
                            &client,
                            config.connect_timeout,
                            config.response_timeout,
                        )
                        .await
                        .map_err(|e| backend_error("connecting", url, e))?,
                    )
                } else {
                    Conn::Single(
                        manager(config.response_timeout, connect_retries)
                            .await
                            .map_err(|e| backend_error("connecting", url, e))?,
                    )
                };
                let grant_conns = if config.wait_replicas > 0 {
                    let mut own = Vec::with_capacity(GRANT_CONNECTIONS);
                    for _ in 0..GRANT_CONNECTIONS {
                        own.push(Conn::Single(
                            manager(grant_timeout, 0)
                                .await
                                .map_err(|e| backend_error("connecting", url, e))?,
                        ));
                    }
                    GrantConns::exclusive(own)
                } else {
                    GrantConns::Shared(conn.clone())
                };
                (conn, grant_conns, client, target, false)
            }
            Topology::Cluster(nodes) => {
                let client = ClusterClientBuilder::new(nodes.clone())
                    .tcp_settings(crate::conn::tcp::settings(config.keepalive))
                    .connection_timeout(config.connect_timeout)
                    .response_timeout(config.response_timeout)
                    .build()
                    .map_err(bad_url)?;
                let target = lockkit_core::config::redact_url(&nodes.join(","));
                let conn = client
                    .get_async_connection()
                    .await
                    .map_err(|e| backend_error("connecting to the cluster", &target, e))?;
                // `wait_replicas` is refused for clusters (RedisConfig::parse).
                let grant_conns = GrantConns::Shared(Conn::Cluster(conn.clone()));
                // Classic PUBLISH reaches every node of a cluster: one subscriber will do.
                let first = nodes
                    .first()
                    .ok_or_else(|| Error::Config("no cluster node".into()))?;
                let subscriber =
                    crate::conn::tcp::client(first, config.keepalive).map_err(bad_url)?;
                (Conn::Cluster(conn), grant_conns, subscriber, target, true)
            }
            Topology::Redlock(_) => {
                return Err(Error::Config(
                    "redlock:// URLs are served by RedlockBackend, not RedisBackend".into(),
                ));
            }
        };
        let db = subscriber.get_connection_info().redis_settings().db();
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                db,
                keyspace_events: Arc::default(),
                keyspace_probing: AtomicBool::new(false),
                conn,
                grant_conns,
                wakeups: Wakeups::new(
                    subscriber,
                    target.clone(),
                    config.connect_timeout.max(config.response_timeout),
                ),
                config,
                cluster,
                target,
            }),
        })
    }

    /// A wait's watch of the key named `lock` held in another format (see
    /// [`ForeignWatch`]); none in a cluster, where keyspace notifications are node-local.
    pub(crate) fn foreign_watch(&self, lock: &str) -> Option<Arc<ForeignWatch>> {
        (!self.inner.cluster)
            .then(|| ForeignWatch::new(self.inner.db, lock, self.inner.keyspace_events.clone()))
    }

    /// How long a wait behind a holder in another format sleeps at most: a second while the
    /// holder's deletion wakes it (`hears_deletion`, see [`ForeignWatch`]), else
    /// [`FOREIGN_HOLDER_POLL`] (and, for a wait that watches, the server is asked once
    /// whether it sends keyspace notifications).
    pub(crate) fn foreign_holder_poll(&self, watched: bool, hears_deletion: bool) -> Duration {
        if hears_deletion {
            FOREIGN_HOLDER_POLL_NOTIFIED
        } else {
            if watched {
                self.probe_keyspace_events();
            }
            FOREIGN_HOLDER_POLL
        }
    }

    /// Asks the server once, in the background, whether it sends keyspace notifications
    /// of generic commands (`CONFIG GET notify-keyspace-events` has `K` and `g`, or `K` and
    /// `A`), for waits behind holders in another format (see [`ForeignWatch`]). A server
    /// that refuses `CONFIG` (an ACL, a managed service) or does not answer counts as
    /// sending none; the answer is kept for the backend's life (a server's setting changed
    /// later is seen by backends made after).
    fn probe_keyspace_events(&self) {
        if self.inner.keyspace_events.get().is_some()
            || self.inner.keyspace_probing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.inner.keyspace_probing.store(false, Ordering::Release);
            return;
        };
        let this = self.clone();
        runtime.spawn(async move {
            let mut conn = this.conn();
            let asked = tokio::time::timeout(
                this.inner.config.response_timeout,
                redis::cmd("CONFIG")
                    .arg("GET")
                    .arg("notify-keyspace-events")
                    .query_async::<Vec<String>>(&mut conn),
            )
            .await;
            let on = match asked {
                Ok(Ok(reply)) => reply.get(1).is_some_and(|flags| {
                    flags.contains('K') && (flags.contains('g') || flags.contains('A'))
                }),
                Ok(Err(error)) => {
                    tracing::debug!(%error, "CONFIG GET notify-keyspace-events refused; polling foreign holders");
                    false
                }
                Err(_) => false,
            };
            let _ = this.inner.keyspace_events.set(on);
        });
    }

    /// The configuration in force.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The Redis names of `key`'s lock, channel and fencing counter.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for names a cluster cannot keep in one slot.
    pub fn names(&self, key: &LockKey) -> Result<LockNames> {
        LockNames::new(&self.inner.config.prefix, key, self.inner.cluster)
    }

    /// Channels this backend's shared subscriber is listening on (for leak checks).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn subscribed_channels(&self) -> usize {
        self.inner.wakeups.active_channels()
    }

    fn conn(&self) -> Conn {
        self.inner.conn.clone()
    }

    /// The command connection (cheap clone).
    pub(crate) fn conn_handle(&self) -> Conn {
        self.conn()
    }

    /// Subscribes this backend's shared subscriber to `channel`.
    pub(crate) async fn subscribe(&self, channel: &str) -> Result<crate::conn::Subscription> {
        self.inner.wakeups.subscribe(channel).await
    }

    fn fail(&self, doing: &str, e: redis::RedisError) -> Error {
        backend_error(doing, &self.inner.target, e)
    }

    /// Runs the acquire script of `req`'s kind once. Not cancel safe by itself: see
    /// [`Self::attempt`]. With `marker`, a busy writer or plain lock
    /// registers as a waiting writer (see [`Self::attempt_marking`]): the caller must then
    /// see that the marker is forgotten when its wait ends without a grant.
    ///
    /// `proposed_token` (Redlock's, for a plain lock only) raises a new holder's token to
    /// at least that value (see [`wire::ACQUIRE`]); read and write holds ignore it. With
    /// `foreign`, the attempt tells that watch whether the key is held in another format
    /// (a plain lock's wait; see [`ForeignWatch`]).
    pub(crate) async fn run_acquire_marking(
        &self,
        req: &AcquireRequest,
        interrupt: Option<&lockkit_core::spi::Interrupt>,
        marker: bool,
        proposed_token: Option<u64>,
        turn: Option<QueueTurn>,
        foreign: Option<&ForeignWatch>,
    ) -> Result<Attempt> {
        if req.kind != LockKind::Exclusive {
            return self.run_kind_acquire(req, interrupt, marker, foreign).await;
        }
        let names = self.names(&req.key)?;
        let waiting_writers = wire::waiting_writers_of(&names);
        let queue = wire::queue_of(&names);
        let proposed = proposed_token.map(|t| t.to_string()).unwrap_or_default();
        let (queue_id, may_be_queued, place_score) = match &turn {
            Some(turn) => (
                turn.id.to_string(),
                if turn.may_be_queued { "1" } else { "" },
                match turn.place_score.load(Ordering::Acquire) {
                    0 => String::new(),
                    score => score.to_string(),
                },
            ),
            None => (String::new(), "", String::new()),
        };
        let marker_ms = if marker {
            wire::WRITER_MARKER_MS.to_string()
        } else {
            String::new()
        };
        // The script reads an absent argument as an empty one, so the empty ones at the end
        // (a `try_acquire`'s every one) are not sent: each costs the server an object and a
        // Lua string per call.
        let optional = [
            marker_ms.as_str(),
            &proposed,
            &queue_id,
            may_be_queued,
            &place_score,
        ];
        let optional = &optional[..optional
            .iter()
            .rposition(|arg| !arg.is_empty())
            .map_or(0, |last| last + 1)];
        let config = &self.inner.config;
        let within = config
            .response_timeout
            .saturating_add(config.wait_replicas_timeout);
        let slot = self.inner.grant_conns.pick(within, interrupt).await?;
        let mut conn = slot.conn.clone();
        let start = Instant::now();
        let wanted = self.inner.config.wait_replicas;
        let (outcome, confirmed): (Vec<i64>, Option<i64>) = if wanted == 0 {
            let mut script = wire::ACQUIRE.key(&names.lock);
            script
                .key(&names.token)
                .key(&waiting_writers)
                .key(&queue)
                .key(&names.channel)
                .arg(ttl_millis(req.ttl))
                .arg(req.owner.to_string())
                .arg(attempt_field(req.attempt))
                .arg(req.identity.encode())
                .arg(optional);
            let outcome: Vec<i64> = script
                .invoke_async(&mut conn)
                .await
                .map_err(|e| self.fail("running the acquire script", e))?;
            (outcome, None)
        } else {
            // One pipeline, so `WAIT` runs on the connection that made the grant, right
            // after it: on any other connection it would confirm nothing.
            let mut pipe = redis::pipe();
            pipe.cmd("EVAL")
                .arg(wire::ACQUIRE_LUA)
                .arg(5)
                .arg(&names.lock)
                .arg(&names.token)
                .arg(&waiting_writers)
                .arg(&queue)
                .arg(&names.channel)
                .arg(ttl_millis(req.ttl))
                .arg(req.owner.to_string())
                .arg(attempt_field(req.attempt))
                .arg(req.identity.encode())
                .arg(optional)
                .cmd("WAIT")
                .arg(wanted)
                .arg(ttl_millis(self.inner.config.wait_replicas_timeout));
            let (outcome, confirmed): (Vec<i64>, i64) = pipe
                .query_async(&mut conn)
                .await
                .map_err(|e| self.fail("running the acquire script with WAIT", e))?;
            (outcome, Some(confirmed))
        };
        let (granted, value, depth, place) = match outcome.as_slice() {
            [granted, value, depth, place @ ..] => (*granted, *value, *depth, place),
            _ => {
                return Err(self.fail(
                    "running the acquire script",
                    redis::RedisError::from((
                        redis::ErrorKind::UnexpectedReturnType,
                        "the acquire script answered with an unexpected shape",
                        format!("{outcome:?}"),
                    )),
                ));
            }
        };
        if let (Some(turn), [score]) = (&turn, place) {
            turn.place_score
                .store(u64::try_from(*score).unwrap_or(0), Ordering::Release);
        }
        if granted == -1 {
            return Err(Error::KindMismatch {
                key: req.key.clone(),
                found: "is held by this owner as a read-write lock".into(),
                asked: req.kind,
            });
        }
        let watch = foreign;
        let hears_deletion =
            watch.is_some_and(|watch| watch.saw_foreign_holder(granted == 0 && depth == 1));
        if granted != 1 {
            let mut left = u64::try_from(value).ok().map(Duration::from_millis);
            if depth == 1 {
                // A holder in another format (redis-py, redsync: a plain string) publishes
                // nothing when it lets go: look again soon instead of sleeping out its TTL,
                // or, once its deletion wakes the waiter, now and then (a safety net).
                let poll = self.foreign_holder_poll(watch.is_some(), hears_deletion);
                left = Some(left.map_or(poll, |l| l.min(poll)));
            }
            if depth == wire::BUSY_MARKED {
                // Marked as a waiting writer: come back before the marker runs out.
                left = Some(left.map_or(MARKER_REFRESH, |l| l.min(MARKER_REFRESH)));
            }
            return Ok(Attempt::Busy {
                lease_left: if value == -2 {
                    Some(Duration::ZERO)
                } else {
                    left
                },
            });
        }
        let grant = Grant::new(
            req,
            FencingToken::new(u64::try_from(value).unwrap_or(0)),
            u32::try_from(depth).unwrap_or(u32::MAX),
            start,
        );
        if let Some(confirmed) = confirmed {
            self.check_replicas(&grant, confirmed).await?;
        }
        Ok(Attempt::Granted(grant))
    }

    /// With `wait_replicas=N`: keeps a grant that `confirmed` replicas acknowledged (the
    /// `WAIT` sent right after it), or gives it back and says so.
    async fn check_replicas(&self, grant: &Grant, confirmed: i64) -> Result<()> {
        let wanted = self.inner.config.wait_replicas;
        if confirmed >= i64::from(wanted) {
            return Ok(());
        }
        let _ = self.release(grant).await;
        let timeout = self.inner.config.wait_replicas_timeout;
        Err(Error::backend(
            crate::conn::BACKEND,
            true,
            format!(
                "the grant of `{}` was refused and given back: {wanted} replica(s) had to \
                 confirm it within {timeout:?} but {confirmed} confirmed; check the replicas or \
                 lower wait_replicas",
                grant.key
            ),
        ))
    }

    /// One cancel-safe acquire attempt: the script runs in its own task, and if the caller
    /// goes away before the answer arrives, a grant that arrives anyway is given back.
    pub(crate) async fn attempt(&self, req: &AcquireRequest) -> Result<Attempt> {
        self.attempt_marking(req, None, None, None).await
    }

    /// [`Self::attempt`]; with `marker`, a write or plain lock that finds the key busy also registers
    /// (or refreshes) its owner as a waiting writer, which keeps new readers out, and the
    /// attempt tells `marker` when its script has run (see [`MarkShare`]). With `turn`, a
    /// waiter's place in the queue: the attempt keeps it until its script has answered, so
    /// that a wait dropped meanwhile leaves the queue after this attempt, never before it.
    async fn attempt_marking(
        &self,
        req: &AcquireRequest,
        marker: Option<std::sync::Arc<MarkShare>>,
        turn: Option<(QueueTurn, Arc<QueuePlace>)>,
        foreign: Option<Arc<ForeignWatch>>,
    ) -> Result<Attempt> {
        let (turn, place) = turn.unzip();
        let (this, request, giver) = (self.clone(), req.clone(), self.clone());
        lockkit_core::spi::detached_acquire(
            crate::conn::BACKEND,
            move |interrupt| {
                // Counted before the attempt's task is spawned (in the same poll), so a
                // wait dropped from here on leaves the marker to this attempt.
                if let Some(share) = &marker {
                    share.start();
                }
                async move {
                    let outcome = this
                        .run_acquire_marking(
                            &request,
                            Some(&interrupt),
                            marker.is_some(),
                            None,
                            turn,
                            foreign.as_deref(),
                        )
                        .await;
                    if marker.as_ref().is_some_and(|share| share.finish()) {
                        this.forget_writer_later(&request);
                    }
                    drop(place);
                    outcome
                }
            },
            Attempt::into_grant,
            move |grant| async move {
                if let Err(error) = giver.release(&grant).await {
                    tracing::warn!(%error, key = %grant.key, "could not give back a grant nobody waited for; its lease will run out");
                }
            },
        )
        .await
    }

    /// Waits for `req`, woken by release messages on the key's channel, retrying transient
    /// errors until the deadline. A plain lock counts as a writer: while it waits behind a
    /// read-write lock it keeps a waiting-writer marker, refreshed by each attempt, removed
    /// by its grant, and forgotten when the wait ends without one (also when this future is
    /// dropped), as a waiting writer's is.
    async fn acquire_waiting(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        if req.kind != LockKind::Exclusive {
            return self.acquire_kind_waiting(req, wait).await;
        }
        let names = self.names(&req.key)?;
        let marker = WriterMarker::new(self.clone(), req.clone());
        let share = marker.share();
        let id = queue_id(&req.owner);
        let place = Arc::new(QueuePlace {
            backend: self.clone(),
            queue: wire::queue_of(&names),
            id,
            may_be_queued: AtomicBool::new(false),
        });
        let watch = self.foreign_watch(&names.lock);
        let mut messages = ReleaseMessages::queued(self.inner.wakeups.clone(), names.channel, id);
        if let Some(watch) = &watch {
            messages = messages.watching(watch.clone());
        }
        let place_score = Arc::new(AtomicU64::new(0));
        let outcome = wait_for_grant(&req.key, wait, wait_policy(), &mut messages, || {
            let turn = QueueTurn::new(
                id,
                place.may_be_queued.swap(true, Ordering::AcqRel),
                place_score.clone(),
            );
            self.attempt_marking(
                req,
                Some(share.clone()),
                Some((turn, place.clone())),
                watch.clone(),
            )
        })
        .await;
        if outcome.is_ok() {
            // The grant removed the marker and the waiter's place in the queue (in its
            // script, atomically).
            marker.granted();
            place.may_be_queued.store(false, Ordering::Release);
        }
        drop(marker);
        drop(place);
        outcome
    }
}

/// A wait's place in the key's waiter queue: left (in the background) when the wait ends
/// without a grant, also when its future is dropped, once the last attempt of the wait has
/// answered (each attempt keeps the place; an attempt sent after the place was left would
/// queue the waiter again, to be named at a release while nobody waits). The place is the
/// owner's: another wait of the same owner on the key loses it too, and takes a new one at
/// its next busy answer.
pub(crate) struct QueuePlace {
    backend: RedisBackend,
    queue: String,
    id: u64,
    /// An attempt was sent: the waiter may be queued.
    may_be_queued: AtomicBool,
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        if *self.may_be_queued.get_mut() {
            leave_queue_later(&self.backend, std::mem::take(&mut self.queue), self.id);
        }
    }
}

/// Takes waiter `id` out of `queue` on `backend`'s server, in the background (nothing when
/// no runtime runs): the place of a wait that ended without a grant from that server. A
/// removal that fails (the link cut at that moment) is tried again, [`LEAVE_TRIES`] times at
/// most, backing off from 100 ms to 2 s: a place left behind is named at a later release
/// while nobody waits for it, and every waiter that hears the name sleeps through
/// [`crate::conn::NAMED_GRACE`] (until the queue's 60 s life ends). Removing it again is
/// harmless: a wait of the same owner that queued meanwhile queues again at its next busy
/// answer, at the place it had.
pub(crate) fn leave_queue_later(backend: &RedisBackend, queue: String, id: u64) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let mut conn = backend.conn();
    runtime.spawn(async move {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        for tried in 1..=LEAVE_TRIES {
            let left: std::result::Result<i64, _> = redis::cmd("ZREM")
                .arg(&queue)
                .arg(id)
                .query_async(&mut conn)
                .await;
            match left {
                Ok(_) => return,
                Err(error) if tried == LEAVE_TRIES => {
                    tracing::debug!(%error, "could not leave the waiter queue; the first release to name this waiter pops it");
                }
                Err(_) => tokio::time::sleep(backoff.next_delay()).await,
            }
        }
    });
}

/// How many times a wait's place in the waiter queue is asked to go at most (see
/// [`leave_queue_later`]).
const LEAVE_TRIES: u32 = 8;

#[async_trait]
impl LockBackend for RedisBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo::new(
            if self.inner.cluster {
                "redis+cluster"
            } else {
                "redis"
            },
            Consistency::Ap,
            Capabilities {
                min_ttl: Duration::from_millis(1),
                max_ttl: Some(Duration::from_millis(wire::MAX_TTL_MS)),
                counts_waiters: !self.inner.cluster,
                read_write: true,
                writer_preference: true,
                semaphore: true,
                ..Capabilities::default()
            },
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        Ok(self.attempt(req).await?.into_grant())
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        self.acquire_waiting(req, wait).await
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        if grant.kind != LockKind::Exclusive {
            return self.renew_kind(grant, ttl).await;
        }
        let names = self.names(&grant.key)?;
        let renewed: i64 = wire::RENEW
            .key(&names.lock)
            .arg(ttl_millis(ttl))
            .arg(grant.owner.to_string())
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.fail("running the renew script", e))?;
        if renewed == 1 {
            Ok(())
        } else {
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        }
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        if grant.kind != LockKind::Exclusive {
            return self.release_kind(grant).await;
        }
        let names = self.names(&grant.key)?;
        let left: i64 = wire::RELEASE
            .key(&names.lock)
            .key(&names.channel)
            .key(wire::queue_of(&names))
            .arg(grant.owner.to_string())
            .arg(attempt_field(grant.attempt))
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.fail("running the release script", e))?;
        match u32::try_from(left) {
            Ok(0) => Ok(Released::Fully),
            Ok(remaining) => Ok(Released::Partially { remaining }),
            Err(_) => Err(Error::NotHeld {
                key: grant.key.clone(),
            }),
        }
    }

    async fn ping(&self) -> Result<()> {
        let _: String = redis::cmd("PING")
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.fail("PING", e))?;
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let names = self.names(key)?;
        let reply: Vec<Value> = wire::INSPECT
            .key(&names.lock)
            .key(&names.token)
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.fail("running the inspect script", e))?;
        let (info, channel) = if may_be_kinds(&reply) {
            let holders = self.kind_holders(key).await?;
            match holders {
                Some(holders) => {
                    let Some(first) = holders.into_iter().next() else {
                        return Ok(None);
                    };
                    let channel = match first.kind {
                        Some(LockKind::Permit { .. }) => self.kind_names(key)?.sem_channel,
                        _ => names.channel.clone(),
                    };
                    (first, channel)
                }
                None => match parse_inspect(&reply) {
                    Some(info) => (info, names.channel.clone()),
                    None => return Ok(None),
                },
            }
        } else {
            match parse_inspect(&reply) {
                Some(info) => (info, names.channel.clone()),
                None => return Ok(None),
            }
        };
        if self.inner.cluster {
            // A cluster's subscribers are spread over its nodes: one node cannot count them.
            return Ok(Some(info));
        }
        // Waiting clients subscribe to the release channel (Redisson's too): an estimate, as
        // one connection may carry several waiters and a client may listen between waits.
        // A server that refuses it (an ACL without pub/sub commands, a proxy) still says
        // who holds the key; only the estimate is missing.
        let counts: std::result::Result<Vec<(String, i64)>, _> = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut self.conn())
            .await;
        Ok(Some(match counts {
            Ok(counts) => {
                let waiters = counts.first().map_or(0, |(_, n)| *n);
                info.with_waiters(u32::try_from(waiters).unwrap_or(0))
            }
            Err(e) => {
                tracing::debug!(error = %e, "PUBSUB NUMSUB refused: waiters not counted");
                info
            }
        }))
    }

    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        match self.kind_holders(key).await? {
            Some(holders) => Ok(holders),
            None => Ok(self.inspect(key).await?.into_iter().collect()),
        }
    }
}

/// Whether an inspect reply may be a read-write lock (a hash with `mode`) or a semaphore
/// (a number string), which the holders script describes.
fn may_be_kinds(reply: &[Value]) -> bool {
    let rest = reply.get(3..).unwrap_or_default();
    match reply.first().and_then(text).as_deref() {
        Some("hash") => rest
            .chunks(2)
            .any(|pair| pair.first().and_then(text).as_deref() == Some("mode")),
        Some("string") => rest.first().and_then(number).is_some(),
        _ => false,
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

fn number(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        other => text(other).and_then(|t| t.parse().ok()),
    }
}

/// Reads the inspect script's reply: `{type, pttl, token, fields...}`.
pub(crate) fn parse_inspect(reply: &[Value]) -> Option<HolderInfo> {
    let kind = reply.first().and_then(text)?;
    let ttl_left = reply
        .get(1)
        .and_then(number)
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis);
    let token = reply
        .get(2)
        .and_then(number)
        .and_then(|t| u64::try_from(t).ok())
        .map(FencingToken::new);
    let rest = reply.get(3..).unwrap_or_default();
    match kind.as_str() {
        "none" => None,
        "hash" => {
            let fields = || {
                rest.chunks(2)
                    .filter_map(|pair| Some((text(pair.first()?)?, pair.get(1)?)))
            };
            let identity = fields()
                .find(|(field, _)| field == wire::HOLDER_FIELD)
                .and_then(|(_, value)| text(value))
                .and_then(|value| HolderIdentity::decode(&value));
            // The hold's own token, where the counter is behind it (gone).
            let own = fields()
                .find(|(field, _)| field == wire::TOKEN_FIELD)
                .and_then(|(_, value)| text(value))
                .and_then(|value| value.strip_prefix('t')?.parse::<u64>().ok())
                .map(FencingToken::new);
            let token = token.max(own);
            let (owner, depth) = fields()
                .filter(|(field, _)| {
                    !field.starts_with(wire::ATTEMPT_FIELD_PREFIX)
                        && field != wire::HOLDER_FIELD
                        && field != wire::QUEUE_FIELD
                        && field != wire::TOKEN_FIELD
                })
                .filter_map(|(field, value)| Some((field, number(value)?)))
                .max_by_key(|(_, depth)| *depth)?;
            Some(
                HolderInfo::new(owner, u32::try_from(depth).unwrap_or(1), token, ttl_left)
                    .with_identity(identity),
            )
        }
        other => {
            let value = rest.first().and_then(text).unwrap_or_default();
            Some(HolderInfo::new(
                format!("foreign {other} value {value:?} (not a lockkit or Redisson lock)"),
                1,
                None,
                ttl_left,
            ))
        }
    }
}

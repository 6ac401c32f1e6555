//! `RedlockBackend`: a lock over N independent Redis masters, granted by a majority.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use futures_util::future::{join_all, select_all};
use lockkit_core::spi::{
    AcquireRequest, Armed, Attempt, Backoff, Grant, Released, WaitPolicy, Wake, armed,
    local_validity, never, wait_for_grant,
};
use lockkit_core::{
    BackendInfo, Capabilities, Consistency, Error, FencingToken, HolderInfo, LockBackend, LockKey,
    Result,
};
use tokio::time::Instant;

use crate::{RedisBackend, RedisConfig, Topology, conn::Subscription, wire};

const BACKEND: &str = "redlock";

/// Redlock over independent masters: a lock is held when a majority (N/2+1) of masters
/// granted it within its lease, and it is valid for `ttl − elapsed − drift`, where the
/// drift allowance is 1% of the lease plus 2 ms (Redlock's suggested factor).
///
/// - A partial acquisition (no quorum, or slower than the lease) is given back on every
///   master before retrying with jitter.
/// - Fencing tokens stay monotonic across the quorum: the grant takes the highest counter
///   among the granting masters and writes it back to them, so any later quorum, which
///   shares at least one master with this one, counts past it.
/// - Waiters are woken by release messages from any master.
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
struct Master {
    config: RedisConfig,
    node: tokio::sync::OnceCell<RedisBackend>,
}

impl Master {
    fn new(config: RedisConfig) -> Self {
        Master {
            config,
            node: tokio::sync::OnceCell::new(),
        }
    }

    /// The client, if this master has answered once.
    fn connected(&self) -> Option<&RedisBackend> {
        self.node.get()
    }

    /// The client, connecting first if this master has never answered.
    async fn get(&self) -> Result<RedisBackend> {
        self.node
            .get_or_try_init(|| RedisBackend::from_config(self.config.clone()))
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

/// A Redlock waiter's wake-ups: release messages from any master it could subscribe to.
struct MastersMessages<'a> {
    backend: &'a RedlockBackend,
    channel: String,
    /// `None` until the first [`Wake::ready`] subscribed.
    subscriptions: Option<Vec<Subscription>>,
}

#[async_trait]
impl Wake for MastersMessages<'_> {
    /// Subscribes on every master at once, each bounded by the response timeout (at most
    /// 500 ms): a frozen master (a minority Redlock tolerates) must not hold the waiter or
    /// the subscriptions on the others up; without its messages the waiter still polls.
    async fn ready(&mut self) -> bool {
        if self.subscriptions.is_none() {
            let backend = self.backend;
            let bound = Instant::now()
                + backend
                    .config
                    .response_timeout
                    .min(Duration::from_millis(500));
            let subscribing = backend
                .nodes
                .iter()
                .filter_map(Master::connected)
                .map(|node| tokio::time::timeout_at(bound, node.subscribe(&self.channel)));
            let subscribed = join_all(subscribing)
                .await
                .into_iter()
                .filter_map(|outcome| outcome.ok()?.ok())
                .collect();
            self.subscriptions = Some(subscribed);
        }
        self.subscriptions.as_ref().is_some_and(|s| !s.is_empty())
    }

    fn arm(&self) -> Armed<'_> {
        match self.subscriptions.as_deref() {
            Some(subscriptions) if !subscriptions.is_empty() => {
                let armed: Vec<_> = subscriptions
                    .iter()
                    .map(|s| armed(&s.channel.notify))
                    .collect();
                Box::pin(async move {
                    select_all(armed).await;
                })
            }
            _ => never(),
        }
    }
}

/// What one master said to an acquire attempt.
enum Vote {
    Granted(Grant),
    Busy(Option<Duration>),
    Failed(Error),
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

    /// Runs `op` on every master at once, each bounded by `timeout`.
    async fn on_all<T, F, Fut>(&self, timeout: Duration, op: F) -> Vec<Result<T>>
    where
        F: Fn(RedisBackend) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let op = &op;
        let calls = self.nodes.iter().map(|master| {
            let call = async move { op(master.get().await?).await };
            async move {
                tokio::time::timeout(timeout, call)
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::backend(
                            BACKEND,
                            true,
                            format!("a master did not answer within {timeout:?}"),
                        ))
                    })
            }
        });
        join_all(calls).await
    }

    /// One Redlock round: ask every master, then keep the grant only if a quorum agreed
    /// within the lease; otherwise give back what was granted.
    async fn run_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let start = Instant::now();
        let votes: Vec<Vote> = self
            .on_all(self.node_timeout(req.ttl), |node| {
                let req = req.clone();
                async move { node.run_acquire(&req, None).await }
            })
            .await
            .into_iter()
            .map(|vote| match vote {
                Ok(Attempt::Granted(grant)) => Vote::Granted(grant),
                Ok(Attempt::Busy { lease_left }) => Vote::Busy(lease_left),
                Err(e) => Vote::Failed(e),
            })
            .collect();
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
            if self.write_back(req, token, &votes).await >= quorum {
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

    /// Raises the token counter to `token` on every granting master; returns how many
    /// recorded it.
    async fn write_back(&self, req: &AcquireRequest, token: FencingToken, votes: &[Vote]) -> usize {
        let Ok(names) = self.names(&req.key) else {
            return 0;
        };
        let writes = self
            .nodes
            .iter()
            .zip(votes)
            .filter(|(_, v)| matches!(v, Vote::Granted(_)))
            .filter_map(|(master, _)| master.connected())
            .map(|node| {
                let name = names.token.clone();
                let mut conn = node.conn_handle();
                async move {
                    let raised: std::result::Result<i64, _> = wire::RAISE_TOKEN
                        .key(&name)
                        .arg(token.get())
                        .invoke_async(&mut conn)
                        .await;
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
    /// Waits for the answers no longer than a round may take (the per-master timeout):
    /// each release is on its master's connection by then, ahead of any later command of
    /// this client there, so a slow or frozen master still applies it before this owner's
    /// next round; and a release carries the acquisition's attempt marker, so it can only
    /// take back what this acquisition added, never an outer hold of the same owner. Waiting out the full response timeout instead made every
    /// busy round behind a frozen minority master cost that long, and waiters overran their
    /// deadlines by it.
    async fn give_back(&self, req: &AcquireRequest, votes: &[Vote]) {
        let releases = self
            .nodes
            .iter()
            .zip(votes)
            .filter(|(_, v)| !matches!(v, Vote::Busy(_)))
            .filter_map(|(master, vote)| master.connected().map(|node| (node, vote)))
            .map(|(node, vote)| {
                let grant = match vote {
                    Vote::Granted(g) => g.clone(),
                    _ => Grant::new(req, FencingToken::new(0), 1, Instant::now()),
                };
                let node = node.clone();
                async move {
                    let _ = node.release(&grant).await;
                }
            });
        let _ = tokio::time::timeout(self.node_timeout(req.ttl), join_all(releases)).await;
    }

    /// A cancel-safe round: it runs in its own task, and a grant nobody waits for any more
    /// is given back.
    async fn attempt(&self, req: &AcquireRequest) -> Result<Attempt> {
        let (this, request, giver) = (self.clone(), req.clone(), self.clone());
        lockkit_core::spi::detached_acquire(
            BACKEND,
            move |_| async move { this.run_acquire(&request).await },
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
                ..Capabilities::default()
            },
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        Ok(self.attempt(req).await?.into_grant())
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        let names = self.names(&req.key)?;
        let mut messages = MastersMessages {
            backend: self,
            channel: names.channel,
            subscriptions: None,
        };
        // Masters publish one release one by one: after a wake-up, wait up to a
        // millisecond, so contenders do not split the masters between them.
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(160),
        ))
        .settle(Duration::from_millis(1));
        wait_for_grant(&req.key, wait, policy, &mut messages, || self.attempt(req)).await
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let results = self
            .on_all(self.node_timeout(ttl), |node| {
                let grant = grant.clone();
                async move { node.renew(&grant, ttl).await }
            })
            .await;
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

    async fn release(&self, grant: &Grant) -> Result<Released> {
        let results = self
            .on_all(self.config.response_timeout, |node| {
                let grant = grant.clone();
                async move { node.release(&grant).await }
            })
            .await;
        let released: Vec<Released> = results
            .iter()
            .filter_map(|r| r.as_ref().ok().copied())
            .collect();
        let refused = results
            .iter()
            .filter(|r| matches!(r, Err(Error::NotHeld { .. })))
            .count();
        if released.len() >= self.quorum() || (!released.is_empty() && refused == 0) {
            // The hold count the masters report.
            let remaining = released
                .iter()
                .map(|r| match r {
                    Released::Fully => 0,
                    Released::Partially { remaining } => *remaining,
                })
                .max()
                .unwrap_or(0);
            return Ok(match remaining {
                0 => Released::Fully,
                remaining => Released::Partially { remaining },
            });
        }
        match results
            .into_iter()
            .find(|r| matches!(r, Err(Error::Backend { .. })))
        {
            Some(Err(e)) if released.is_empty() && refused < self.quorum() => Err(e),
            _ => Err(Error::NotHeld {
                key: grant.key.clone(),
            }),
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

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let results = self
            .on_all(self.config.response_timeout, |node| {
                let key = key.clone();
                async move { node.inspect(&key).await }
            })
            .await;
        let answered: Vec<Option<HolderInfo>> =
            results.into_iter().filter_map(Result::ok).collect();
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
        let held: Vec<HolderInfo> = answered.into_iter().flatten().collect();
        // The owner a quorum agrees on, with the highest token and shortest lease seen.
        let mut owners: Vec<(&str, usize)> = Vec::new();
        for info in &held {
            match owners.iter_mut().find(|(o, _)| *o == info.owner) {
                Some((_, n)) => *n += 1,
                None => owners.push((&info.owner, 1)),
            }
        }
        let Some((owner, _)) = owners.iter().max_by_key(|(_, n)| *n).copied() else {
            return Ok(None);
        };
        let same: Vec<&HolderInfo> = held.iter().filter(|i| i.owner == owner).collect();
        if same.len() < self.quorum() {
            return Ok(None);
        }
        let info = HolderInfo::new(
            owner,
            same.iter().map(|i| i.depth).max().unwrap_or(1),
            same.iter().filter_map(|i| i.token).max(),
            same.iter().filter_map(|i| i.ttl_left).min(),
        )
        .with_identity(majority_identity(&same));
        Ok(Some(match same.iter().filter_map(|i| i.waiters).max() {
            Some(waiters) => info.with_waiters(waiters),
            None => info,
        }))
    }
}

/// The identity most of `holds` (one per master) report: a master whose copy of the hold
/// lapsed and was made again by a re-entry carries that re-entry's identity instead.
fn majority_identity(holds: &[&HolderInfo]) -> Option<lockkit_core::HolderIdentity> {
    let identities: Vec<&lockkit_core::HolderIdentity> =
        holds.iter().filter_map(|i| i.identity.as_ref()).collect();
    identities
        .iter()
        .max_by_key(|candidate| identities.iter().filter(|i| i == candidate).count())
        .map(|i| (*i).clone())
}

//! `MemoryBackend`: the whole contract inside one process, for tests and examples.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use tokio::{sync::Notify, time::Instant};

use crate::{
    AcquireRequest, AttemptLedger, BackendInfo, Capabilities, Consistency, Error, FencingToken,
    Grant, HolderIdentity, HolderInfo, LockBackend, LockKey, LockKind, LostReason, OwnerId,
    Released, Result, WAIT_FOREVER,
    lost::LossSignal,
    rules::{HoldView, Refusal, admit, same_hold},
    wait::{Armed, Attempt, Backoff, WaitPolicy, Wake, armed, wait_for_grant},
};

const SCHEME: &str = "memory";

#[derive(Debug)]
struct Entry {
    owner: OwnerId,
    /// A plain lock, a read or write hold, or a permit: an owner's holds of one key are
    /// one entry per kind.
    kind: LockKind,
    depth: u32,
    token: u64,
    expires: Instant,
    session: u64,
    loss: LossSignal,
    /// The acquisitions behind `depth`, so retries take effect once.
    attempts: AttemptLedger,
    /// Who took the hold.
    identity: Arc<HolderIdentity>,
}

/// Waiters on one key; removed when the last waiter leaves. `waiters` changes only
/// under the state lock.
#[derive(Debug, Default)]
struct WaitSlot {
    notify: Notify,
    waiters: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    /// Every hold of a key: one plain lock or writer, or readers, or permits.
    locks: HashMap<LockKey, Vec<Entry>>,
    waits: HashMap<LockKey, Arc<WaitSlot>>,
    /// Writers (and plain lockers) waiting for a key, by owner: new readers of other owners
    /// stay out while there are any (writer preference).
    writers: HashMap<LockKey, HashMap<OwnerId, u32>>,
    /// One counter for all keys: strictly growing per key as well.
    last_token: u64,
}

impl State {
    fn live(&self, key: &LockKey, now: Instant) -> impl Iterator<Item = &Entry> {
        self.locks
            .get(key)
            .into_iter()
            .flatten()
            .filter(move |e| e.expires > now)
    }

    fn held_by(&mut self, grant: &Grant, now: Instant) -> Option<&mut Entry> {
        self.locks.get_mut(&grant.key)?.iter_mut().find(|e| {
            e.expires > now
                && same_hold(
                    (e.owner, e.kind),
                    (grant.owner, grant.kind),
                    &e.attempts,
                    grant.attempt,
                )
        })
    }

    fn wake(&self, key: &LockKey) {
        if let Some(slot) = self.waits.get(key) {
            slot.notify.notify_waiters();
        }
    }
}

#[derive(Debug, Default)]
struct Server {
    state: Mutex<State>,
    next_session: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state is plain data updated in single steps: a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An in-process lock service honouring the whole lockkit contract: leases expire on a
/// monotonic clock, tokens strictly grow, waiters are woken by notification (and at the
/// holder's expiry instant), and dropping a waiting future leaves nothing behind.
///
/// A `MemoryBackend` value is one *client session* on a shared in-process *server*.
/// [`MemoryBackend::connect`] opens another session on the same server, so two clients
/// contend as two processes would; clones share the session. Locks do not cross process
/// boundaries ([`Capabilities::cross_process`] is false).
#[derive(Debug, Clone)]
pub struct MemoryBackend {
    server: Arc<Server>,
    session: Arc<AtomicU64>,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// Keeps a waiter registered on a key; unregisters (and frees the slot) when dropped, so a
/// cancelled waiter leaves no residue.
struct Registration<'a> {
    server: &'a Server,
    key: LockKey,
    slot: Arc<WaitSlot>,
    /// Set for a waiting writer: the owner whose waiting keeps new readers out.
    writer: Option<OwnerId>,
}

#[async_trait]
impl Wake for Registration<'_> {
    /// A release in this process always notifies.
    async fn ready(&mut self) -> bool {
        true
    }

    fn arm(&self) -> Armed<'_> {
        armed(&self.slot.notify)
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.server.state);
        if let Some(owner) = self.writer
            && let Some(writers) = state.writers.get_mut(&self.key)
        {
            if let Some(count) = writers.get_mut(&owner) {
                *count -= 1;
                if *count == 0 {
                    writers.remove(&owner);
                }
            }
            if writers.is_empty() {
                state.writers.remove(&self.key);
            }
            // Readers the writer kept out may enter now.
            state.wake(&self.key);
        }
        if self.slot.waiters.fetch_sub(1, Ordering::Relaxed) == 1 {
            state.waits.remove(&self.key);
        }
    }
}

impl MemoryBackend {
    /// The URL schemes this backend is built from (`memory://`).
    pub const SCHEMES: &'static [&'static str] = &[SCHEME];

    /// A new server with one session on it.
    pub fn new() -> Self {
        let server = Arc::new(Server::default());
        let session = Arc::new(AtomicU64::new(
            server.next_session.fetch_add(1, Ordering::Relaxed),
        ));
        MemoryBackend { server, session }
    }

    /// A new server from a URL: `memory://`, with at most a `?ttl=` (each call is a new
    /// server).
    ///
    /// # Errors
    /// [`Error::Config`] for any other URL, saying what is accepted.
    pub fn from_url(url: &str) -> Result<Self> {
        let Some((scheme, rest)) = url.split_once(':') else {
            return Err(Error::Config(format!(
                "`{url}` is not a URL; the in-memory backend is `memory://`"
            )));
        };
        if scheme != SCHEME {
            return Err(Error::Config(format!(
                "`{url}` has scheme `{scheme}`, not `{SCHEME}`; the in-memory backend is `memory://`"
            )));
        }
        let (place, query) = rest.split_once('?').unwrap_or((rest, ""));
        if !matches!(place, "" | "//") {
            return Err(Error::Config(format!(
                "`{url}`: the in-memory backend takes no host or path; use `memory://[?ttl=30s]`"
            )));
        }
        crate::config::only_ttl_option(url, query)?;
        Ok(Self::new())
    }

    /// Another client session on the same server.
    pub fn connect(&self) -> Self {
        MemoryBackend {
            session: Arc::new(AtomicU64::new(
                self.server.next_session.fetch_add(1, Ordering::Relaxed),
            )),
            server: self.server.clone(),
        }
    }

    fn session(&self) -> u64 {
        self.session.load(Ordering::Relaxed)
    }

    /// Fault hook: ends this client's session as a server would on session expiry. Every
    /// lock it held is freed at once and its holders' loss signals fire; the client then
    /// continues on a new session.
    pub fn kill_session(&self) {
        let old = self.session.swap(
            self.server.next_session.fetch_add(1, Ordering::Relaxed),
            Ordering::Relaxed,
        );
        let mut state = lock(&self.server.state);
        let doomed: Vec<LockKey> = state
            .locks
            .iter()
            .filter(|(_, entries)| entries.iter().any(|e| e.session == old))
            .map(|(k, _)| k.clone())
            .collect();
        for key in doomed {
            if let Some(entries) = state.locks.get_mut(&key) {
                entries.retain(|entry| {
                    if entry.session == old {
                        entry.loss.fire(LostReason::SessionLost);
                    }
                    entry.session != old
                });
            }
            state.wake(&key);
        }
    }

    /// Operator action: takes `key` away from its holder, as an operator's `DEL` would.
    /// The holder finds out at its next renewal. Returns whether a live lock was there. Every
    /// backend that can do this names it `take_away`, with this signature.
    ///
    /// # Errors
    /// None for this backend; the `Result` keeps the signature of the others.
    pub async fn take_away(&self, key: &LockKey) -> Result<bool> {
        let mut state = lock(&self.server.state);
        let now = Instant::now();
        let was = state
            .locks
            .remove(key)
            .is_some_and(|entries| entries.iter().any(|e| e.expires > now));
        state.wake(key);
        Ok(was)
    }

    /// Server state left for keys starting with `prefix`: live or expired lock entries
    /// plus registered waiters. Zero means nothing leaked.
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn residue(&self, prefix: &str) -> usize {
        let state = lock(&self.server.state);
        let now = Instant::now();
        let locks = state
            .locks
            .iter()
            .filter(|(k, _)| k.as_str().starts_with(prefix))
            .map(|(_, entries)| entries.iter().filter(|e| e.expires > now).count())
            .sum::<usize>();
        let writers = state
            .writers
            .keys()
            .filter(|k| k.as_str().starts_with(prefix))
            .count();
        let waits = state
            .waits
            .keys()
            .filter(|k| k.as_str().starts_with(prefix))
            .count();
        locks + waits + writers
    }

    /// One atomic grant attempt, by the rules of [`LockKind`].
    fn try_grant(&self, req: &AcquireRequest) -> std::result::Result<Grant, Refusal<Instant>> {
        let now = Instant::now();
        let mut guard = lock(&self.server.state);
        let state = &mut *guard;
        let entries = state.locks.entry(req.key.clone()).or_default();
        entries.retain(|e| e.expires > now);
        if let Some(entry) = entries.iter_mut().find(|e| {
            same_hold(
                (e.owner, e.kind),
                (req.owner, req.kind),
                &e.attempts,
                req.attempt,
            )
        }) {
            if !entry.attempts.has(req.attempt) {
                // A re-entry (a retry of one that took effect adds nothing).
                entry.depth += 1;
                entry.attempts.add(req.attempt);
            }
            // Never shorten the lease an outer guard of this hold relies on; a retried
            // grant's guard counts the lease from now, so it runs at least that long.
            entry.expires = entry.expires.max(crate::options::lease_end(now, req.ttl));
            return Ok(Grant::new(
                req,
                FencingToken::new(entry.token),
                entry.depth,
                now,
            ));
        }
        let holds: Vec<HoldView<Instant>> = entries
            .iter()
            .map(|e| HoldView {
                owner: e.owner,
                kind: e.kind,
                expires: e.expires,
            })
            .collect();
        let writer_waits = state.writers.contains_key(&req.key);
        if let Err(refusal) = admit(req, &holds, writer_waits) {
            if state.locks.get(&req.key).is_some_and(Vec::is_empty) {
                state.locks.remove(&req.key);
            }
            return Err(match refusal {
                // Woken when the writer is granted and releases, or gives up waiting.
                Refusal::Busy(until) => {
                    Refusal::Busy(Some(until.unwrap_or(now + Duration::from_secs(1))))
                }
                refused => refused,
            });
        }
        state.last_token += 1;
        let token = state.last_token;
        let entry = Entry {
            owner: req.owner,
            kind: req.kind,
            depth: 1,
            token,
            expires: crate::options::lease_end(now, req.ttl),
            session: self.session(),
            loss: req.loss.clone(),
            attempts: {
                let mut attempts = AttemptLedger::new();
                attempts.add(req.attempt);
                attempts
            },
            identity: req.identity.clone(),
        };
        state.locks.entry(req.key.clone()).or_default().push(entry);
        Ok(Grant::new(req, FencingToken::new(token), 1, now))
    }

    /// Registers a waiter; a writer (or plain locker) also keeps new readers out while it
    /// waits.
    fn register(&self, req: &AcquireRequest) -> Registration<'_> {
        let mut state = lock(&self.server.state);
        let key = &req.key;
        let slot = state.waits.entry(key.clone()).or_default().clone();
        slot.waiters.fetch_add(1, Ordering::Relaxed);
        let writer = req.kind.is_exclusive().then_some(req.owner);
        if let Some(owner) = writer {
            *state
                .writers
                .entry(key.clone())
                .or_default()
                .entry(owner)
                .or_default() += 1;
        }
        Registration {
            server: &self.server,
            key: key.clone(),
            slot,
            writer,
        }
    }
}

#[async_trait]
impl LockBackend for MemoryBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo::new(
            SCHEME,
            Consistency::Cp,
            Capabilities {
                pushes_loss: true,
                cross_process: false,
                counts_waiters: true,
                read_write: true,
                writer_preference: true,
                semaphore: true,
                ..Capabilities::default()
            },
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        match self.try_grant(req) {
            Ok(grant) => Ok(Some(grant)),
            Err(Refusal::Busy(_)) => Ok(None),
            Err(Refusal::Refused(error)) => Err(error),
        }
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        // Woken by a release, or at the instant the holder's lease runs out.
        let mut registration = self.register(req);
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(50),
        ))
        .notified_cap(WAIT_FOREVER);
        wait_for_grant(&req.key, wait, policy, &mut registration, || async {
            match self.try_grant(req) {
                Ok(grant) => Ok(Attempt::Granted(grant)),
                Err(Refusal::Busy(until)) => {
                    Ok(Attempt::busy(until.map_or(Duration::ZERO, |until| {
                        until.saturating_duration_since(Instant::now())
                    })))
                }
                Err(Refusal::Refused(error)) => Err(error),
            }
        })
        .await
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let now = Instant::now();
        let mut state = lock(&self.server.state);
        match state.held_by(grant, now) {
            Some(e) => {
                e.expires = e.expires.max(crate::options::lease_end(now, ttl));
                Ok(())
            }
            None => Err(Error::NotHeld {
                key: grant.key.clone(),
            }),
        }
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        let now = Instant::now();
        let mut state = lock(&self.server.state);
        let Some(entry) = state.held_by(grant, now) else {
            return Err(Error::NotHeld {
                key: grant.key.clone(),
            });
        };
        if !entry.attempts.take(grant.attempt, entry.depth) {
            // A retried release: it took effect already.
            return Ok(Released::Partially {
                remaining: entry.depth,
            });
        }
        entry.depth -= 1;
        if entry.depth > 0 {
            return Ok(Released::Partially {
                remaining: entry.depth,
            });
        }
        if let Some(entries) = state.locks.get_mut(&grant.key) {
            entries.retain(|e| e.depth > 0 && e.expires > now);
            if entries.is_empty() {
                state.locks.remove(&grant.key);
            }
        }
        state.wake(&grant.key);
        Ok(Released::Fully)
    }

    async fn ping(&self) -> Result<()> {
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        Ok(self.holders(key).await?.into_iter().next())
    }

    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        let now = Instant::now();
        let state = lock(&self.server.state);
        let waiters = state.waits.get(key).map_or(0, |slot| {
            u32::try_from(slot.waiters.load(Ordering::Relaxed)).unwrap_or(u32::MAX)
        });
        let mut holders: Vec<&Entry> = state.live(key, now).collect();
        // The writer first, then by token.
        holders.sort_by_key(|e| (!e.kind.is_exclusive(), e.token));
        Ok(holders
            .into_iter()
            .map(|e| {
                let info = HolderInfo::new(
                    e.owner.to_string(),
                    e.depth,
                    Some(FencingToken::new(e.token)),
                    Some(e.expires.saturating_duration_since(now)),
                )
                .with_identity(Some(HolderIdentity::clone(&e.identity)))
                .with_waiters(waiters);
                if e.kind == LockKind::Exclusive {
                    info
                } else {
                    info.with_kind(e.kind)
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(key: &LockKey, ttl: Duration) -> AcquireRequest {
        AcquireRequest::new(
            key.clone(),
            OwnerId::new(uuid::Uuid::new_v4(), 1),
            ttl,
            LossSignal::new(),
        )
    }

    /// `take_away` answers whether a *live* lock was there, as the other backends do: an
    /// entry whose lease ran out is not one (review 12, F3).
    #[tokio::test(start_paused = true)]
    async fn take_away_reports_only_a_live_lock() {
        let backend = MemoryBackend::new();
        let key = LockKey::new("take-away").expect("a valid key");
        let ttl = Duration::from_millis(50);
        let live = backend
            .try_acquire(&request(&key, ttl))
            .await
            .expect("infallible");
        assert!(live.is_some());
        assert!(backend.take_away(&key).await.expect("infallible"));
        let expiring = backend
            .try_acquire(&request(&key, ttl))
            .await
            .expect("infallible");
        assert!(expiring.is_some(), "free again after it was taken away");
        tokio::time::sleep(ttl * 2).await;
        assert!(
            !backend.take_away(&key).await.expect("infallible"),
            "an expired lease was reported as taken away"
        );
    }
}

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
    Grant, HolderIdentity, HolderInfo, LockBackend, LockKey, LostReason, OwnerId, Released, Result,
    WAIT_FOREVER,
    lost::LossSignal,
    wait::{Armed, Attempt, Backoff, WaitPolicy, Wake, armed, wait_for_grant},
};

const SCHEME: &str = "memory";

#[derive(Debug)]
struct Entry {
    owner: OwnerId,
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
    locks: HashMap<LockKey, Entry>,
    waits: HashMap<LockKey, Arc<WaitSlot>>,
    /// One counter for all keys: strictly growing per key as well.
    last_token: u64,
}

impl State {
    fn live(&self, key: &LockKey, now: Instant) -> Option<&Entry> {
        self.locks.get(key).filter(|e| e.expires > now)
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
            .filter(|(_, e)| e.session == old)
            .map(|(k, _)| k.clone())
            .collect();
        for key in doomed {
            if let Some(entry) = state.locks.remove(&key) {
                entry.loss.fire(LostReason::SessionLost);
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
        let was = state
            .locks
            .remove(key)
            .is_some_and(|e| e.expires > Instant::now());
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
            .filter(|(k, e)| k.as_str().starts_with(prefix) && e.expires > now)
            .count();
        let waits = state
            .waits
            .keys()
            .filter(|k| k.as_str().starts_with(prefix))
            .count();
        locks + waits
    }

    /// One atomic grant attempt. `Err(expiry)` when held by another owner until `expiry`.
    fn try_grant(&self, req: &AcquireRequest) -> std::result::Result<Grant, Instant> {
        let now = Instant::now();
        let mut state = lock(&self.server.state);
        if let Some(entry) = state.locks.get_mut(&req.key).filter(|e| e.expires > now) {
            if entry.owner != req.owner {
                return Err(entry.expires);
            }
            if entry.attempts.has(req.attempt) {
                // A retry of an acquisition that took effect: the same grant again. Its
                // guard counts the lease from now, so the lease runs at least that long.
                entry.expires = entry.expires.max(now + req.ttl);
                return Ok(Grant::new(
                    req,
                    FencingToken::new(entry.token),
                    entry.depth,
                    now,
                ));
            }
            entry.depth += 1;
            entry.attempts.add(req.attempt);
            // Never shorten the lease an outer guard of this hold relies on.
            entry.expires = entry.expires.max(now + req.ttl);
            return Ok(Grant::new(
                req,
                FencingToken::new(entry.token),
                entry.depth,
                now,
            ));
        }
        state.last_token += 1;
        let token = state.last_token;
        let entry = Entry {
            owner: req.owner,
            depth: 1,
            token,
            expires: now + req.ttl,
            session: self.session(),
            loss: req.loss.clone(),
            attempts: {
                let mut attempts = AttemptLedger::new();
                attempts.add(req.attempt);
                attempts
            },
            identity: req.identity.clone(),
        };
        state.locks.insert(req.key.clone(), entry);
        Ok(Grant::new(req, FencingToken::new(token), 1, now))
    }

    fn register(&self, key: &LockKey) -> Registration<'_> {
        let mut state = lock(&self.server.state);
        let slot = state.waits.entry(key.clone()).or_default().clone();
        slot.waiters.fetch_add(1, Ordering::Relaxed);
        Registration {
            server: &self.server,
            key: key.clone(),
            slot,
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
                ..Capabilities::default()
            },
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        Ok(self.try_grant(req).ok())
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        // Woken by a release, or at the instant the holder's lease runs out.
        let mut registration = self.register(&req.key);
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(50),
        ))
        .notified_cap(WAIT_FOREVER);
        wait_for_grant(&req.key, wait, policy, &mut registration, || async {
            Ok(match self.try_grant(req) {
                Ok(grant) => Attempt::Granted(grant),
                Err(expires) => Attempt::busy(expires.saturating_duration_since(Instant::now())),
            })
        })
        .await
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let now = Instant::now();
        let mut state = lock(&self.server.state);
        match state.locks.get_mut(&grant.key) {
            Some(e) if e.expires > now && e.owner == grant.owner => {
                e.expires = e.expires.max(now + ttl);
                Ok(())
            }
            _ => Err(Error::NotHeld {
                key: grant.key.clone(),
            }),
        }
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        let now = Instant::now();
        let mut state = lock(&self.server.state);
        let entry = match state.locks.get_mut(&grant.key) {
            Some(e) if e.expires > now && e.owner == grant.owner => e,
            _ => {
                return Err(Error::NotHeld {
                    key: grant.key.clone(),
                });
            }
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
        state.locks.remove(&grant.key);
        state.wake(&grant.key);
        Ok(Released::Fully)
    }

    async fn ping(&self) -> Result<()> {
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let now = Instant::now();
        let state = lock(&self.server.state);
        let waiters = state.waits.get(key).map_or(0, |slot| {
            u32::try_from(slot.waiters.load(Ordering::Relaxed)).unwrap_or(u32::MAX)
        });
        Ok(state.live(key, now).map(|e| {
            HolderInfo::new(
                e.owner.to_string(),
                e.depth,
                Some(FencingToken::new(e.token)),
                Some(e.expires.saturating_duration_since(now)),
            )
            .with_identity(Some(HolderIdentity::clone(&e.identity)))
            .with_waiters(waiters)
        }))
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

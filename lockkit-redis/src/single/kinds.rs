//! Read-write locks and counting semaphores on one server or cluster (the layouts and
//! scripts are in [`crate::wire`]): acquire with writer preference, renew, release, and
//! the list of every holder.

use std::{num::NonZeroU32, time::Duration};

use lockkit_core::spi::{AcquireRequest, Attempt, Grant, Interrupt, Released, wait_for_grant};
use lockkit_core::{Error, FencingToken, HolderIdentity, HolderInfo, LockKey, LockKind, Result};
use redis::{Script, Value};
use tokio::time::Instant;

use super::{RedisBackend, attempt_field, number, text, ttl_millis};
use crate::{
    conn::{ForeignWatch, ReleaseMessages},
    wire::{self, KindNames},
};

/// How long a waiting writer sleeps at most between attempts: each attempt refreshes its
/// marker, which lives [`wire::WRITER_MARKER_MS`].
pub(crate) const MARKER_REFRESH: Duration = Duration::from_millis(wire::WRITER_MARKER_MS / 3);

/// One script call: the script, its source (for `EVAL` before `WAIT`), keys and arguments.
struct Call {
    script: &'static Script,
    source: &'static str,
    keys: Vec<String>,
    args: Vec<Vec<u8>>,
}

impl Call {
    fn new(script: &'static Script, source: &'static str, keys: Vec<String>) -> Self {
        Call {
            script,
            source,
            keys,
            args: Vec::new(),
        }
    }

    fn arg(mut self, arg: impl AsRef<[u8]>) -> Self {
        self.args.push(arg.as_ref().to_vec());
        self
    }
}

/// The permit id of an acquisition: its attempt uuid as Redisson's 16 raw bytes, and hex.
fn permit_id(attempt: uuid::Uuid) -> (Vec<u8>, String) {
    (attempt.as_bytes().to_vec(), attempt.simple().to_string())
}

fn write_field(owner: &str) -> String {
    format!("{owner}:write")
}

/// What a waiting writer and its attempts know of its marker. An attempt runs in a task of
/// its own and may still reach the server (and mark the writer) after the waiting future
/// was dropped: so the marker is forgotten by whichever ends last, the wait or the attempts
/// out, and never before the script of the last attempt has run.
#[derive(Debug, Default)]
pub(crate) struct MarkShare(std::sync::Mutex<MarkState>);

#[derive(Debug, Default)]
struct MarkState {
    /// Attempts started and not finished.
    in_flight: u32,
    /// An attempt may have marked the writer (and no grant removed it since).
    set: bool,
    /// The wait is over without a grant.
    cancelled: bool,
}

impl MarkShare {
    fn state(&self) -> std::sync::MutexGuard<'_, MarkState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An attempt is about to be sent (called before its task is spawned).
    pub(crate) fn start(&self) {
        let mut state = self.state();
        state.in_flight += 1;
        state.set = true;
    }

    /// An attempt's script has answered (or failed): whether the marker must go now.
    pub(crate) fn finish(&self) -> bool {
        self.finish_with(false)
    }

    /// [`Self::finish`]; `clean`: the attempt left no marker anywhere (every server it
    /// asked granted, and a grant removes the marker), so nothing is left to forget unless
    /// another attempt is still out.
    pub(crate) fn finish_with(&self, clean: bool) -> bool {
        let mut state = self.state();
        state.in_flight = state.in_flight.saturating_sub(1);
        if clean && state.in_flight == 0 {
            state.set = false;
        }
        state.cancelled && state.set && state.in_flight == 0
    }

    /// The wait is over without a grant: whether the marker must go now (else the last
    /// attempt out takes it away).
    fn cancel(&self) -> bool {
        let mut state = self.state();
        state.cancelled = true;
        state.set && state.in_flight == 0
    }

    /// A grant removed the marker in its own script.
    fn granted(&self) {
        self.state().set = false;
    }
}

/// Who removes a waiting writer's marker: one server or cluster, or every Redlock master.
pub(crate) trait ForgetWriter: Send + Sync + 'static {
    /// Removes `req`'s owner's waiting-writer marker, in the background (with no runtime,
    /// it runs out by itself).
    fn forget_writer_later(&self, req: &AcquireRequest);
}

/// Forgets the waiting writer's marker when its wait ends without a grant, also when the
/// waiting future is dropped (see [`MarkShare`]).
pub(crate) struct WriterMarker<F: ForgetWriter> {
    forgetter: F,
    req: AcquireRequest,
    share: std::sync::Arc<MarkShare>,
}

impl<F: ForgetWriter> WriterMarker<F> {
    /// A marker for the wait of `req`, forgotten through `forgetter`.
    pub(crate) fn new(forgetter: F, req: AcquireRequest) -> Self {
        WriterMarker {
            forgetter,
            req,
            share: std::sync::Arc::default(),
        }
    }

    /// What the wait's attempts share with it.
    pub(crate) fn share(&self) -> std::sync::Arc<MarkShare> {
        self.share.clone()
    }

    /// A grant removed the marker in its own script: nothing to forget.
    pub(crate) fn granted(&self) {
        self.share.granted();
    }
}

impl<F: ForgetWriter> Drop for WriterMarker<F> {
    fn drop(&mut self) {
        if self.share.cancel() {
            self.forgetter.forget_writer_later(&self.req);
        }
    }
}

impl ForgetWriter for RedisBackend {
    fn forget_writer_later(&self, req: &AcquireRequest) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Ok(names) = self.kind_names(&req.key) else {
            return;
        };
        let (backend, owner) = (self.clone(), req.owner.to_string());
        runtime.spawn(async move {
            let forgot: std::result::Result<i64, _> = wire::FORGET_WRITER
                .key(&names.waiting_writers)
                .key(&names.lock_channel)
                .arg(&owner)
                .invoke_async(&mut backend.conn())
                .await;
            if let Err(error) = forgot {
                tracing::debug!(%error, "could not remove a waiting writer's marker; it runs out by itself");
            }
        });
    }
}

impl RedisBackend {
    pub(super) fn kind_names(&self, key: &LockKey) -> Result<KindNames> {
        Ok(KindNames::new(&self.names(key)?))
    }

    /// Runs `call` on a grant connection; with `wait_replicas`, as `EVAL` followed by `WAIT`
    /// on the same connection. Returns the script's `{code, value, extra}` and the replicas
    /// that confirmed.
    async fn eval_grant(
        &self,
        call: Call,
        interrupt: Option<&Interrupt>,
    ) -> Result<((i64, i64, i64), Option<i64>)> {
        let config = &self.inner.config;
        let within = config
            .response_timeout
            .saturating_add(config.wait_replicas_timeout);
        let slot = self.inner.grant_conns.pick(within, interrupt).await?;
        let mut conn = slot.conn.clone();
        let wanted = config.wait_replicas;
        if wanted == 0 {
            let mut invocation = call.script.prepare_invoke();
            for key in &call.keys {
                invocation.key(key);
            }
            for arg in &call.args {
                invocation.arg(arg.as_slice());
            }
            let outcome = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(|e| self.fail("running an acquire script", e))?;
            return Ok((outcome, None));
        }
        let mut pipe = redis::pipe();
        let eval = pipe.cmd("EVAL").arg(call.source).arg(call.keys.len());
        for key in &call.keys {
            eval.arg(key);
        }
        for arg in &call.args {
            eval.arg(arg.as_slice());
        }
        pipe.cmd("WAIT")
            .arg(wanted)
            .arg(ttl_millis(config.wait_replicas_timeout));
        let (outcome, confirmed): ((i64, i64, i64), i64) = pipe
            .query_async(&mut conn)
            .await
            .map_err(|e| self.fail("running an acquire script with WAIT", e))?;
        Ok((outcome, Some(confirmed)))
    }

    /// One attempt at a read, write or permit (not cancel safe by itself: see
    /// [`RedisBackend::attempt`]). With `marker`, a busy writer registers as waiting.
    pub(super) async fn run_kind_acquire(
        &self,
        req: &AcquireRequest,
        interrupt: Option<&Interrupt>,
        marker: bool,
        foreign: Option<&ForeignWatch>,
    ) -> Result<Attempt> {
        let names = self.kind_names(&req.key)?;
        let owner = req.owner.to_string();
        let ttl = ttl_millis(req.ttl).to_string();
        let identity = req.identity.encode();
        let call = match req.kind {
            LockKind::Read => Call::new(
                &wire::ACQUIRE_READ,
                wire::ACQUIRE_READ_LUA,
                vec![
                    names.lock.clone(),
                    names.token.clone(),
                    names.waiting_writers.clone(),
                    names.read_timeouts(&owner),
                ],
            )
            .arg(&ttl)
            .arg(&owner)
            .arg(write_field(&owner))
            .arg(attempt_field(req.attempt))
            .arg(&identity)
            .arg(&names.base),
            LockKind::Write => Call::new(
                &wire::ACQUIRE_WRITE,
                wire::ACQUIRE_WRITE_LUA,
                vec![
                    names.lock.clone(),
                    names.token.clone(),
                    names.waiting_writers.clone(),
                ],
            )
            .arg(&ttl)
            .arg(&owner)
            .arg(write_field(&owner))
            .arg(attempt_field(req.attempt))
            .arg(&identity)
            .arg(&names.base)
            .arg(if marker { wire::WRITER_MARKER_MS } else { 0 }.to_string()),
            LockKind::Permit { limit } => {
                let (id, hex) = permit_id(req.attempt);
                Call::new(
                    &wire::ACQUIRE_PERMIT,
                    wire::ACQUIRE_PERMIT_LUA,
                    vec![
                        names.lock.clone(),
                        names.permits.clone(),
                        names.sem_channel.clone(),
                        names.permit_info.clone(),
                        names.token.clone(),
                    ],
                )
                .arg(limit.get().to_string())
                .arg(&ttl)
                .arg(id)
                .arg(format!("|{owner}|{identity}"))
                .arg(hex)
            }
            other => {
                return Err(Error::Unsupported {
                    backend: crate::conn::BACKEND,
                    what: format!("{other} through the read-write path"),
                });
            }
        };
        let start = Instant::now();
        let ((code, value, extra), confirmed) = self.eval_grant(call, interrupt).await?;
        let hears_deletion = foreign.is_some_and(|watch| {
            watch.saw_foreign_holder(code == 0 && extra == wire::BUSY_FOREIGN)
        });
        match code {
            1 => {
                let grant = Grant::new(
                    req,
                    FencingToken::new(u64::try_from(value).unwrap_or(0)),
                    u32::try_from(extra).unwrap_or(u32::MAX),
                    start,
                );
                if let Some(confirmed) = confirmed {
                    self.check_replicas(&grant, confirmed).await?;
                }
                Ok(Attempt::Granted(grant))
            }
            0 => {
                let mut left = match value {
                    -2 => Some(Duration::ZERO),
                    ms => u64::try_from(ms).ok().map(Duration::from_millis),
                };
                if extra == wire::BUSY_FOREIGN {
                    // A holder in another format publishes nothing when it lets go.
                    let poll = self.foreign_holder_poll(foreign.is_some(), hears_deletion);
                    left = Some(left.map_or(poll, |l| l.min(poll)));
                }
                if marker && req.kind == LockKind::Write {
                    left = Some(left.map_or(MARKER_REFRESH, |l| l.min(MARKER_REFRESH)));
                }
                Ok(Attempt::Busy { lease_left: left })
            }
            -2 => Err(Error::WouldDeadlock {
                key: req.key.clone(),
                held: LockKind::Read,
                asked: req.kind,
            }),
            _ => Err(Error::KindMismatch {
                key: req.key.clone(),
                found: mismatch(value, extra),
                asked: req.kind,
            }),
        }
    }

    /// Waits for a read, write or permit, woken by release messages: on the mutex and
    /// rw channels for locks, on the semaphore channel for permits. A waiting writer keeps
    /// a marker that holds new readers back, refreshed by each attempt and removed when
    /// the wait ends without a grant (also when this future is dropped).
    pub(super) async fn acquire_kind_waiting(
        &self,
        req: &AcquireRequest,
        wait: Duration,
    ) -> Result<Grant> {
        let names = self.kind_names(&req.key)?;
        let channels = match req.kind {
            LockKind::Permit { .. } => vec![names.sem_channel.clone()],
            _ => vec![names.lock_channel.clone(), names.rw_channel.clone()],
        };
        let writer = req.kind == LockKind::Write;
        let marker = writer.then(|| WriterMarker::new(self.clone(), req.clone()));
        let mut messages = ReleaseMessages::on(self.inner.wakeups.clone(), channels);
        // Heard letting go when held in another format (see `ForeignWatch`).
        let watch = self.foreign_watch(&names.lock);
        if let Some(watch) = &watch {
            messages = messages.watching(watch.clone());
        }
        let share = marker.as_ref().map(WriterMarker::share);
        let outcome = wait_for_grant(&req.key, wait, super::wait_policy(), &mut messages, || {
            self.attempt_marking(req, share.clone(), None, watch.clone())
        })
        .await;
        if let (Some(marker), Ok(_)) = (&marker, &outcome) {
            // The grant removed the marker (in its script, atomically).
            marker.granted();
        }
        drop(marker);
        outcome
    }

    pub(super) async fn renew_kind(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let names = self.kind_names(&grant.key)?;
        let owner = grant.owner.to_string();
        let ttl = ttl_millis(ttl);
        let mut conn = self.conn();
        let renewed: i64 = match grant.kind {
            LockKind::Read => {
                wire::RENEW_READ
                    .key(&names.lock)
                    .key(names.read_timeouts(&owner))
                    .arg(ttl)
                    .arg(&owner)
                    .arg(&names.base)
                    .invoke_async(&mut conn)
                    .await
            }
            LockKind::Write => {
                wire::RENEW_WRITE
                    .key(&names.lock)
                    .arg(ttl)
                    .arg(write_field(&owner))
                    .invoke_async(&mut conn)
                    .await
            }
            _ => {
                let (id, hex) = permit_id(grant.attempt);
                wire::RENEW_PERMIT
                    .key(&names.lock)
                    .key(&names.permits)
                    .key(&names.sem_channel)
                    .key(&names.permit_info)
                    .arg(id)
                    .arg(ttl)
                    .arg(hex)
                    .invoke_async(&mut conn)
                    .await
            }
        }
        .map_err(|e| self.fail("running the renew script", e))?;
        if renewed == 1 {
            Ok(())
        } else {
            Err(Error::NotHeld {
                key: grant.key.clone(),
            })
        }
    }

    pub(super) async fn release_kind(&self, grant: &Grant) -> Result<Released> {
        let names = self.kind_names(&grant.key)?;
        let owner = grant.owner.to_string();
        let mut conn = self.conn();
        let left: i64 = match grant.kind {
            LockKind::Read => {
                wire::RELEASE_READ
                    .key(&names.lock)
                    .key(&names.rw_channel)
                    .key(&names.lock_channel)
                    .key(names.read_timeouts(&owner))
                    .arg(&owner)
                    .arg(attempt_field(grant.attempt))
                    .arg(&names.base)
                    .invoke_async(&mut conn)
                    .await
            }
            LockKind::Write => {
                wire::RELEASE_WRITE
                    .key(&names.lock)
                    .key(&names.rw_channel)
                    .key(&names.lock_channel)
                    .arg(write_field(&owner))
                    .arg(attempt_field(grant.attempt))
                    .arg(&owner)
                    .arg(&names.base)
                    .invoke_async(&mut conn)
                    .await
            }
            _ => {
                if grant.attempt.is_nil() {
                    // A permit is known by its attempt only.
                    return Err(Error::NotHeld {
                        key: grant.key.clone(),
                    });
                }
                let (id, hex) = permit_id(grant.attempt);
                wire::RELEASE_PERMIT
                    .key(&names.lock)
                    .key(&names.permits)
                    .key(&names.sem_channel)
                    .key(&names.permit_info)
                    .key(names.permit_latch(&hex))
                    .arg(id)
                    .arg(hex)
                    .invoke_async(&mut conn)
                    .await
            }
        }
        .map_err(|e| self.fail("running the release script", e))?;
        match u32::try_from(left) {
            Ok(0) => Ok(Released::Fully),
            Ok(remaining) => Ok(Released::Partially { remaining }),
            Err(_) => Err(Error::NotHeld {
                key: grant.key.clone(),
            }),
        }
    }

    /// Every live hold of `key` if it is a read-write lock or a semaphore (`None`: it is
    /// something else: free, a plain lock, a foreign value). Writer first, then readers;
    /// permits by id.
    pub(super) async fn kind_holders(&self, key: &LockKey) -> Result<Option<Vec<HolderInfo>>> {
        let names = self.kind_names(key)?;
        let reply: Vec<Value> = wire::HOLDERS
            .key(&names.lock)
            .key(&names.token)
            .key(&names.permits)
            .key(&names.permit_info)
            .key(&names.waiting_writers)
            .arg(&names.base)
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.fail("running the holders script", e))?;
        Ok(parse_holders(&reply))
    }
}

fn mismatch(what: i64, n: i64) -> String {
    match what {
        wire::MISMATCH_OWN_LOCK => "is held by this owner as an exclusive lock".into(),
        wire::MISMATCH_OWN_RW => "is held by this owner as a read-write lock".into(),
        wire::MISMATCH_PERMITS => format!(
            "is a semaphore of {n} permits (available plus given out, as Redisson counts them)"
        ),
        wire::MISMATCH_IS_LOCK => "is a lock, not a semaphore".into(),
        _ => "is used as another kind of lock".into(),
    }
}

fn millis(value: Option<&Value>) -> Option<Duration> {
    value
        .and_then(number)
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis)
}

fn stored_token(value: Option<&Value>) -> Option<FencingToken> {
    let value = value.and_then(text)?;
    value
        .strip_prefix('t')?
        .parse::<u64>()
        .ok()
        .map(FencingToken::new)
}

/// Reads the holders script's reply (see [`wire::HOLDERS`]).
pub(super) fn parse_holders(reply: &[Value]) -> Option<Vec<HolderInfo>> {
    let kind = reply.first().and_then(text)?;
    match kind.as_str() {
        "rw" => {
            let holders = reply
                .get(2..)
                .unwrap_or_default()
                .chunks(5)
                .filter_map(|hold| {
                    let field = text(hold.first()?)?;
                    let depth = u32::try_from(number(hold.get(1)?)?).unwrap_or(1);
                    let (owner, kind) = match field.strip_suffix(":write") {
                        Some(owner) => (owner.to_owned(), LockKind::Write),
                        None => (field, LockKind::Read),
                    };
                    let identity = hold
                        .get(4)
                        .and_then(text)
                        .and_then(|v| HolderIdentity::decode(&v));
                    Some(
                        HolderInfo::new(
                            owner,
                            depth,
                            stored_token(hold.get(3)),
                            millis(hold.get(2)),
                        )
                        .with_identity(identity)
                        .with_kind(kind),
                    )
                })
                .collect();
            Some(holders)
        }
        "sem" => {
            let available = reply.get(1).and_then(number).unwrap_or(0);
            let out = reply.get(2).and_then(number).unwrap_or(0);
            let limit = u32::try_from(available.saturating_add(out))
                .ok()
                .and_then(NonZeroU32::new);
            let holders = reply
                .get(3..)
                .unwrap_or_default()
                .chunks(3)
                .filter_map(|permit| {
                    let hex = text(permit.first()?)?;
                    let ttl = millis(permit.get(1));
                    let stored = permit.get(2).and_then(text).unwrap_or_default();
                    let mut parts = stored.splitn(3, '|');
                    let token = parts
                        .next()
                        .and_then(|t| t.strip_prefix('t'))
                        .and_then(|t| t.parse::<u64>().ok())
                        .map(FencingToken::new);
                    let owner = parts
                        .next()
                        .map_or_else(|| format!("permit {hex}"), str::to_owned);
                    let identity = parts.next().and_then(HolderIdentity::decode);
                    let info = HolderInfo::new(owner, 1, token, ttl).with_identity(identity);
                    Some(match limit {
                        Some(limit) => info.with_kind(LockKind::Permit { limit }),
                        None => info,
                    })
                })
                .collect();
            Some(holders)
        }
        _ => None,
    }
}

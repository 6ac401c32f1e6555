//! One etcd lease per contender: kept alive while the contender lives, revoked when it
//! ends, and its loss told on the local monotonic clock before the cluster can expire it.

use std::{
    collections::VecDeque,
    pin::pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use etcd_client::Client;
use lockkit_core::{
    LossSignal, LostReason,
    spi::{Backoff, Stamp},
};

pub(crate) mod spare;

use crate::request::{Members, ask};
use tokio::{sync::Notify, time::Instant};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How reconnects and revoke retries are spaced: 20 ms doubling to a second.
pub(crate) fn retry_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(20), Duration::from_secs(1))
}

/// Whether `e` says the lease is gone on the server (expired or revoked).
pub(crate) fn lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => status.code() == tonic::Code::NotFound,
        etcd_client::Error::LeaseKeepAliveError(message) => message.contains("not found"),
        _ => false,
    }
}

#[derive(Default)]
struct State {
    /// Why the lease was lost, once it was.
    lost: Option<LostReason>,
    /// The loss signals of the holds that rely on this lease: the one whose key it carries,
    /// once granted, and a read that downgraded that hold (a write).
    signals: Vec<LossSignal>,
    /// The contender ended (released, or gave up waiting): stop keeping the lease alive.
    ended: bool,
    /// Its hold is being released: the deletion of its key that follows is no loss.
    releasing: bool,
    /// The cluster said the lease is gone (the keeper's revocation, or one that found it
    /// gone already).
    gone: bool,
}

/// An etcd lease carrying one contender key.
pub(crate) struct Lease {
    pub(crate) id: i64,
    /// The TTL the cluster granted.
    pub(crate) ttl: Duration,
    /// The cluster's members: a keep-alive stream that goes silent is opened afresh on
    /// another member, not again on the silent one while another is left to try;
    /// revocations go to them in turn.
    members: Arc<Members>,
    /// When the last keep-alive the server confirmed (or the grant) was sent: the cluster
    /// cannot expire the lease before this plus the TTL (on its clock, which runs on while
    /// the machine is suspended: stamped with the suspended time when it was confirmed).
    confirmed: Mutex<Stamp>,
    /// When the last keep-alive was sent, confirmed or not: the cluster may keep the lease
    /// until this plus the TTL (and longer after a leader change).
    last_sent: Mutex<Instant>,
    state: Mutex<State>,
    changed: Notify,
    /// How long one request may stay unanswered.
    request_limit: Duration,
}

impl Lease {
    /// Starts keeping lease `id` (granted with `ttl` by a request sent at `sent`) alive,
    /// through the members in turn.
    pub(crate) fn keep(
        members: Arc<Members>,
        id: i64,
        ttl: Duration,
        sent: Instant,
        request_limit: Duration,
    ) -> Arc<Lease> {
        let lease = Arc::new(Lease {
            id,
            ttl,
            members,
            confirmed: Mutex::new(Stamp::new(sent)),
            last_sent: Mutex::new(sent),
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            request_limit,
        });
        tokio::spawn(keep_alive(lease.clone()));
        lease
    }

    /// Until when the lease is surely alive on the cluster, with a third of its TTL to
    /// spare for clock-rate differences and the time the loss signal takes to act: two
    /// thirds of the TTL after the last confirmed keep-alive was sent.
    pub(crate) fn alive_until(&self) -> Instant {
        lock(&self.confirmed).instant() + self.ttl * 2 / 3
    }

    /// [`Lease::alive_until`] moved earlier by the time the machine spent suspended since
    /// the keep-alive was confirmed (the cluster's clock ran on): what a hold is believed
    /// until. Not for comparing with an earlier result (the suspended time jitters).
    pub(crate) fn believed_until(&self) -> Instant {
        lock(&self.confirmed).deadline(self.ttl * 2 / 3)
    }

    fn confirm(&self, sent: Instant) {
        let mut confirmed = lock(&self.confirmed);
        if sent > confirmed.instant() {
            *confirmed = Stamp::new(sent);
        }
    }

    /// Why the lease was lost, if it was.
    pub(crate) fn lost(&self) -> Option<LostReason> {
        lock(&self.state).lost
    }

    /// Whether the lease is lost or its contender ended.
    pub(crate) fn is_over(&self) -> bool {
        let state = lock(&self.state);
        state.lost.is_some() || state.ended
    }

    /// Completes once the lease is lost or its contender ended.
    pub(crate) async fn over(&self) {
        loop {
            let mut changed = pin!(self.changed.notified());
            changed.as_mut().enable();
            if self.is_over() {
                return;
            }
            changed.await;
        }
    }

    /// Ties the lease to the loss signal of a hold that relies on it; fires it at once if
    /// the lease is lost already.
    pub(crate) fn attach(&self, signal: LossSignal) {
        let mut state = lock(&self.state);
        if let Some(reason) = state.lost {
            signal.fire(reason);
        }
        state.signals.push(signal);
    }

    /// Records the loss of the lease (once, unless the contender ended first) and tells
    /// its hold; the keeper stops keeping it alive and revokes it.
    pub(crate) fn lose(&self, reason: LostReason) {
        {
            let mut state = lock(&self.state);
            if state.lost.is_some() || state.ended || state.releasing {
                return;
            }
            state.lost = Some(reason);
            for signal in &state.signals {
                signal.fire(reason);
            }
        }
        self.changed.notify_waiters();
    }

    /// Says its hold is being released: what happens to the key from now on is no loss.
    pub(crate) fn releasing(&self) {
        lock(&self.state).releasing = true;
    }

    /// Ends the contender: the keeper stops keeping the lease alive and revokes it
    /// (deleting every key attached), retrying in the background.
    pub(crate) fn end(&self) {
        lock(&self.state).ended = true;
        self.changed.notify_waiters();
    }

    /// Ends the contender and waits at most one request limit for the keeper's revocation
    /// (one revocation: each is a Raft write); false if it did not happen yet (the keeper
    /// retries it in the background).
    pub(crate) async fn end_and_revoke(&self) -> bool {
        self.end();
        let gone = async {
            loop {
                let mut changed = pin!(self.changed.notified());
                changed.as_mut().enable();
                if lock(&self.state).gone {
                    return;
                }
                changed.await;
            }
        };
        tokio::time::timeout(self.request_limit, gone).await.is_ok()
    }

    /// The cluster said the lease is gone.
    fn gone(&self) {
        lock(&self.state).gone = true;
        self.changed.notify_waiters();
    }

    /// Revokes the lease until the cluster says it is gone, or until it has surely expired
    /// there anyway (well past the last keep-alive sent, leader changes included).
    async fn revoke_until_gone(&self) {
        let give_up_at = *lock(&self.last_sent) + self.ttl + Duration::from_secs(60);
        let mut backoff = retry_backoff();
        loop {
            let revoke = |mut client: Client| async move { client.lease_revoke(self.id).await };
            let end = Instant::now() + self.request_limit;
            match ask(&self.members, revoke, end, self.request_limit / 2, None).await {
                Ok((Ok(_), _)) => return self.gone(),
                Ok((Err(e), _)) if lease_not_found(&e) => return self.gone(),
                Ok((Err(e), _)) => {
                    tracing::debug!(lease = self.id, error = %e, "revoking a lease failed");
                }
                Err(_) => tracing::debug!(lease = self.id, "revoking a lease went unanswered"),
            }
            if Instant::now() >= give_up_at {
                tracing::warn!(
                    lease = self.id,
                    "could not revoke a lock's lease; the cluster expires it"
                );
                return;
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }
}

/// Why a keep-alive stream stopped.
enum Stopped {
    /// The lease is lost or its contender ended: revoke it.
    Over,
    /// The stream failed: open another.
    Failed,
    /// The stream left a keep-alive unanswered for a whole interval: open another, on a new
    /// connection (see [`Members::unanswered`]).
    Silent,
}

/// Keeps `lease` alive every sixth of its TTL until it is lost or its contender ends, then
/// revokes it. The lease is lost when the cluster says it is gone, or when no keep-alive
/// was confirmed by [`Lease::alive_until`].
///
/// A stream that leaves a keep-alive unanswered for a sixth of the TTL (its member frozen,
/// its connection dead without a word, or the member stuck forwarding it to a frozen
/// leader) is opened afresh on another member (one not tried since the last confirmed
/// keep-alive, and not passed over if there is such a one; see [`Members`]), and the silent
/// member is given a new connection (see [`Members::unanswered`]: a connection can go
/// silent while its member is fine; with one member, the next stream goes there): the silence
/// is noticed at most a third of the TTL after the last confirmed keep-alive was sent,
/// which leaves another third before the loss deadline for the next member (or the one
/// after it) to answer.
///
/// The lease was granted with its whole TTL, so the first stream is opened when the first
/// keep-alive is due, a sixth of the TTL after the grant was sent, as every keep-alive after
/// it: a hold released before then never opens one (a gRPC stream and a keep-alive request
/// less per short hold). A member that is frozen when the first stream opens is passed
/// over one keep-alive interval later, as one that freezes later is; the loss deadline
/// still counts from when the grant was sent (two thirds of the TTL after it).
async fn keep_alive(lease: Arc<Lease>) {
    let first_due = *lock(&lease.last_sent) + keep_alive_every(lease.ttl);
    tokio::select! {
        () = tokio::time::sleep_until(first_due) => {}
        () = lease.over() => {}
    }
    let mut backoff = retry_backoff();
    let mut member = lease.members.first();
    // The members whose streams failed since the last confirmed keep-alive: the next stream
    // goes to one that is not among them, so that a frozen member is not tried again while
    // another is left.
    let mut tried = Vec::new();
    while !lease.is_over() {
        let confirmed = lease.alive_until();
        match keep_one_stream(&lease, member).await {
            Stopped::Over => break,
            stopped => {
                if let Stopped::Silent = stopped {
                    lease.members.unanswered(member);
                } else {
                    lease.members.failed(member);
                }
                if lease.alive_until() > confirmed {
                    // The stream worked for a while: this is a fresh failure.
                    backoff = retry_backoff();
                    tried.clear();
                }
                member = lease.members.next_avoiding(member, &mut tried);
                tokio::select! {
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                    () = tokio::time::sleep_until(lease.alive_until()) => {
                        lease.lose(LostReason::SessionLost);
                    }
                    () = lease.over() => {}
                }
            }
        }
    }
    lease.revoke_until_gone().await;
}

/// How often a lease of `ttl` is kept alive: every sixth of it, at most ten times a second.
pub(crate) fn keep_alive_every(ttl: Duration) -> Duration {
    (ttl / 6).max(Duration::from_millis(100))
}

/// Completes at `at`, or never when there is none.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Opens one keep-alive stream through `member` and keeps the lease alive through it
/// while it works: a keep-alive every sixth of the TTL; [`Stopped::Silent`] as soon as the
/// oldest unanswered one has waited a whole interval (exactly then, not at the next tick: a
/// tick that comes a hair early would let the silence run a second interval).
async fn keep_one_stream(lease: &Lease, member: usize) -> Stopped {
    let every = keep_alive_every(lease.ttl);
    let sent = Instant::now();
    *lock(&lease.last_sent) = sent;
    let mut client = lease.members.client(member).clone();
    // A stream opened on a frozen member never answers: try another after one interval.
    let opened = tokio::select! {
        opened = client.lease_keep_alive(lease.id) => opened,
        () = tokio::time::sleep(every) => return Stopped::Silent,
        () = tokio::time::sleep_until(lease.alive_until()) => {
            lease.lose(LostReason::SessionLost);
            return Stopped::Over;
        }
        () = lease.over() => return Stopped::Over,
    };
    let (mut keeper, mut stream) = match opened {
        Ok(opened) => opened,
        Err(e) if lease_not_found(&e) => {
            lease.lose(LostReason::SessionLost);
            return Stopped::Over;
        }
        Err(e) => {
            tracing::debug!(lease = lease.id, error = %e, "opening a keep-alive stream failed");
            return Stopped::Failed;
        }
    };
    // Opening the stream sent a keep-alive and read its answer.
    lease.confirm(sent);
    lease.members.answered(member);
    let mut pending: VecDeque<Instant> = VecDeque::new();
    let mut ticks = tokio::time::interval_at(sent + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = sleep_until_some(pending.front().map(|sent| *sent + every)) => {
                // A whole interval without an answer: the member may be frozen, the
                // connection dead without a word, or the member stuck forwarding the
                // keep-alive to a frozen leader (etcd answers the stream's requests in
                // order, so nothing behind it gets through either); open a stream afresh.
                return Stopped::Silent;
            }
            _ = ticks.tick() => {
                let sent = Instant::now();
                *lock(&lease.last_sent) = sent;
                if keeper.keep_alive().await.is_err() {
                    return Stopped::Failed;
                }
                pending.push_back(sent);
            }
            answer = stream.message() => match answer {
                Ok(Some(answer)) if answer.ttl() > 0 => {
                    if let Some(sent) = pending.pop_front() {
                        lease.confirm(sent);
                    }
                }
                Ok(Some(_)) => {
                    // The cluster no longer knows the lease: it expired or was revoked.
                    lease.lose(LostReason::SessionLost);
                    return Stopped::Over;
                }
                Ok(None) | Err(_) => return Stopped::Failed,
            },
            () = tokio::time::sleep_until(lease.alive_until()) => {
                lease.lose(LostReason::SessionLost);
                return Stopped::Over;
            }
            () = lease.over() => return Stopped::Over,
        }
    }
}

//! Requests to a cluster whose members may be down or frozen: what a failure means, and
//! asking again until an answer or a bound.

use std::{
    future::Future,
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use etcd_client::Client;
use lockkit_core::{Error, spi::Interrupt};
use tokio::time::Instant;

pub(crate) const BACKEND: &str = "etcd";

/// Pause before asking again after a request failed on the way.
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Whether `e` says the request failed on the way (the member is down, unreachable, has no
/// leader or timed out): it may or may not have been applied, and asking again may work.
pub(crate) fn transient(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => matches!(
            status.code(),
            tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Cancelled
                | tonic::Code::Unknown
                | tonic::Code::Aborted
                // "too many requests": the member is busy applying; a later try may pass.
                | tonic::Code::ResourceExhausted
        ),
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

pub(crate) fn etcd_error(doing: &str, e: etcd_client::Error) -> Error {
    Error::backend_with_source(BACKEND, transient(&e), format!("{doing} failed: {e}"), e)
}

/// The error for a request the cluster left unanswered until its bound.
pub(crate) fn unanswered(doing: &str, limit: Duration) -> Error {
    Error::backend(
        BACKEND,
        true,
        format!(
            "{doing}: etcd did not answer within {limit:?} (are the members up and reachable, \
             and do they have a leader?)"
        ),
    )
}

/// How long a member that left a try unanswered, or failed one on the way, is passed over
/// as the first member of a request: long enough that a frozen or dead member costs one
/// try's wait now and then rather than on a third of all requests.
pub(crate) const PASS_OVER: Duration = Duration::from_secs(10);

/// The cluster's members, a client of each, and which one a request goes to first.
///
/// etcd-client's own client spreads requests over the members at random (tonic's
/// power-of-two-choices balancer with no load measure), so a try sent again after a frozen
/// member left it unanswered went to that member again one time in three, and a request
/// with two tries in its limit failed one time in nine with one member of three frozen.
/// A request's tries here go to the members in turn, never twice to one while another is
/// left, and start on a member that no recent try found silent or failing.
pub(crate) struct Members {
    clients: Box<[Client]>,
    /// The member the next request starts on (round robin).
    next: AtomicUsize,
    /// Per member: until when it is passed over as a request's first member.
    passed_over_until: Box<[Mutex<Option<Instant>>]>,
}

impl Members {
    /// One client per member (at least one).
    pub(crate) fn new(clients: Vec<Client>) -> Self {
        let passed_over_until = clients.iter().map(|_| Mutex::new(None)).collect();
        Members {
            clients: clients.into(),
            next: AtomicUsize::new(0),
            passed_over_until,
        }
    }

    /// The client of member `member` (counted round the members).
    pub(crate) fn client(&self, member: usize) -> &Client {
        &self.clients[member % self.clients.len()]
    }

    fn passed_over(&self, member: usize) -> &Mutex<Option<Instant>> {
        &self.passed_over_until[member % self.clients.len()]
    }

    /// The member a new request (or keep-alive stream) starts on: the next in turn that is
    /// not passed over, or the next in turn if every member is.
    pub(crate) fn first(&self) -> usize {
        self.in_turn_from(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// The member to ask after `member`: the next one after it that is not passed over,
    /// or simply the next one if every other member is.
    pub(crate) fn after(&self, member: usize) -> usize {
        self.in_turn_from(member.wrapping_add(1))
    }

    /// The first member from `start` on (in turn) that is not passed over, or `start`.
    fn in_turn_from(&self, start: usize) -> usize {
        let now = Instant::now();
        (0..self.clients.len())
            .map(|i| start.wrapping_add(i))
            .find(|&member| {
                self.passed_over(member)
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_none_or(|until| until <= now)
            })
            .unwrap_or(start)
    }

    /// `member` left a try unanswered or failed it on the way: pass it over for a while.
    pub(crate) fn failed(&self, member: usize) {
        if self.clients.len() > 1 {
            *self
                .passed_over(member)
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + PASS_OVER);
        }
    }

    /// `member` answered: first in turn again.
    pub(crate) fn answered(&self, member: usize) {
        let mut until = self
            .passed_over(member)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if until.is_some() {
            *until = None;
        }
    }
}

/// Why a request has no answer.
pub(crate) enum Unanswered {
    /// The caller went away.
    Interrupted,
    /// No try was answered by the bound.
    TooLate,
}

/// Completes when `interrupt` (if any) fires.
async fn interrupted(interrupt: Option<&Interrupt>) {
    match interrupt {
        Some(interrupt) => interrupt.interrupted().await,
        None => std::future::pending().await,
    }
}

/// Sends `request` (built afresh for each try, given the client of the member to ask) until
/// an answer, asking again after a failure on the way or a try left unanswered for
/// `per_try`: each try goes to the next of `members` in turn, starting on one that is not
/// passed over (see [`Members`]), so a dead or frozen member costs at most one try while
/// another member is left. Only for requests that may be applied twice. Returns the answer
/// and when the try that got it was sent. At `end` the last failure is the answer
/// (`TooLate` if no try was answered at all); a caller gone wants none.
pub(crate) async fn ask<T, F, Fut>(
    members: &Members,
    mut request: F,
    end: Instant,
    per_try: Duration,
    interrupt: Option<&Interrupt>,
) -> Result<(Result<T, etcd_client::Error>, Instant), Unanswered>
where
    F: FnMut(Client) -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let mut failure = None;
    let mut member = members.first();
    loop {
        let sent = Instant::now();
        if sent >= end {
            return failure.ok_or(Unanswered::TooLate);
        }
        let answer = tokio::select! {
            answer = request(members.client(member).clone()) => Some(answer),
            () = tokio::time::sleep_until((sent + per_try).min(end)) => None,
            () = interrupted(interrupt) => return Err(Unanswered::Interrupted),
        };
        match answer {
            Some(Err(e)) if transient(&e) => {
                members.failed(member);
                member = members.after(member);
                failure = Some((Err(e), sent));
                tokio::select! {
                    () = tokio::time::sleep_until((Instant::now() + RETRY_PAUSE).min(end)) => {}
                    () = interrupted(interrupt) => return Err(Unanswered::Interrupted),
                }
            }
            Some(answer) => {
                members.answered(member);
                return Ok((answer, sent));
            }
            None => {
                // Cut short at the end of the whole request, the member may just be slow.
                if Instant::now() < end {
                    members.failed(member);
                }
                member = members.after(member);
            }
        }
    }
}

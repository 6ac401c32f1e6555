//! Requests to a cluster whose members may be down or frozen: what a failure means, and
//! asking again until an answer or a bound.

mod members;

use std::{future::Future, time::Duration};

use etcd_client::Client;
use lockkit_core::{Error, spi::Interrupt};
use tokio::time::Instant;

pub(crate) use members::Members;

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
/// `per_try`: the tries go to members in turn, starting on one that is not passed over (see
/// [`Members`]), and to every member once before any gets a second try, so a dead or frozen
/// member costs at most one try while another is left. Only for requests that may be
/// applied twice. Returns the answer and when the try that got it was sent. At `end` the
/// last failure is the answer (`TooLate` if no try was answered at all); a caller gone
/// wants none.
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
    let mut tried = Vec::new();
    loop {
        let sent = Instant::now();
        if sent >= end {
            return failure.ok_or(Unanswered::TooLate);
        }
        let try_end = (sent + per_try).min(end);
        let answer = tokio::select! {
            answer = request(members.client(member).clone()) => Some(answer),
            () = tokio::time::sleep_until(try_end) => None,
            () = interrupted(interrupt) => return Err(Unanswered::Interrupted),
        };
        match answer {
            Some(Err(e)) if transient(&e) => {
                members.failed(member);
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
                // A try cut short by the end of the whole request says nothing of its member
                // unless it had half a try's time.
                if try_end - sent >= per_try / 2 {
                    members.unanswered(member);
                }
            }
        }
        member = members.next_avoiding(member, &mut tried);
    }
}

//! Cancel-safe backend calls: a request runs to completion even if its caller goes away
//! (then in a task of its own), so dropping the caller cannot strand what the server
//! already granted.

use std::{future::Future, panic::AssertUnwindSafe, pin::Pin, task::Poll};

use tokio_util::sync::CancellationToken;

use crate::{Error, Grant, Result};

/// The work of a [`detached`] call not finished yet, and what to do with its output if
/// the caller goes away first.
struct Unfinished<T: Send + 'static, O: FnOnce(T) + Send + 'static> {
    work: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    orphan: Option<O>,
    runtime: Option<tokio::runtime::Handle>,
    /// The caller's span, which the rest of the work keeps when it moves to a task.
    span: tracing::Span,
}

impl<T: Send + 'static, O: FnOnce(T) + Send + 'static> Drop for Unfinished<T, O> {
    fn drop(&mut self) {
        let (Some(work), Some(orphan)) = (self.work.take(), self.orphan.take()) else {
            return;
        };
        // Dropped before the output was delivered: the work goes on as a task of its own,
        // and its output goes to the orphan handler. Without a runtime (it is gone) the
        // work cannot go on, as a task would not have either.
        if let Some(runtime) = self.runtime.take() {
            let span = std::mem::replace(&mut self.span, tracing::Span::none());
            runtime.spawn(tracing::Instrument::instrument(
                Box::pin(async move {
                    orphan(work.await);
                }) as Pin<Box<dyn Future<Output = ()> + Send>>,
                span,
            ));
        } else {
            tracing::warn!(
                "a cancelled lockkit call could not finish: no Tokio runtime was there when it \
                 started; what it took on the server runs out with its lease"
            );
        }
    }
}

/// Runs `work` to completion and returns its output.
///
/// The work is polled in the caller's task while the caller waits (no task switch on the
/// way). If the returned future is dropped before it delivers the output, the rest of the
/// work is moved into a Tokio task of its own, and `orphan` receives the output whenever
/// it is ready: a backend gives back a grant there, so a cancelled acquisition never
/// leaves a lock behind. Returns `None` if the work panicked.
///
/// # Cancel safety
/// That is its purpose: the work always completes and its output is always consumed (as
/// long as the runtime lives).
pub async fn detached<T, W, O>(work: W, orphan: O) -> Option<T>
where
    T: Send + 'static,
    W: Future<Output = T> + Send + 'static,
    O: FnOnce(T) + Send + 'static,
{
    let mut unfinished = Unfinished {
        work: Some(Box::pin(work)),
        orphan: Some(orphan),
        runtime: tokio::runtime::Handle::try_current().ok(),
        span: tracing::Span::current(),
    };
    std::future::poll_fn(move |cx| {
        let Some(work) = unfinished.work.as_mut() else {
            return Poll::Ready(None);
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| work.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => {
                unfinished.work = None;
                Poll::Ready(Some(value))
            }
            Err(_) => {
                // A panicked future is not polled again.
                unfinished.work = None;
                Poll::Ready(None)
            }
        }
    })
    .await
}

/// Lets a detached acquisition learn that its caller has gone, so it can stop waiting
/// (and clean up) instead of waiting out its whole deadline.
///
/// Once fired it stays fired: every later [`Interrupt::interrupted`] resolves at once, so
/// one part of an attempt that noticed the interrupt cannot hide it from another.
#[derive(Debug, Clone, Default)]
pub struct Interrupt(CancellationToken);

impl Interrupt {
    /// Resolves once the caller of [`detached_acquire`] has dropped its future, and at once
    /// from then on.
    ///
    /// # Cancel safety
    /// Cancel safe: drop it and call again at any time; an interrupt that came while
    /// nobody waited is seen by every later call.
    pub async fn interrupted(&self) {
        self.0.cancelled().await;
    }

    /// Whether the caller has gone already (see [`Interrupt::interrupted`]).
    pub fn is_interrupted(&self) -> bool {
        self.0.is_cancelled()
    }
}

/// Fires the interrupt when the caller's future is dropped before the end.
struct InterruptOnDrop(Option<Interrupt>);

impl Drop for InterruptOnDrop {
    fn drop(&mut self) {
        if let Some(interrupt) = self.0.take() {
            interrupt.0.cancel();
        }
    }
}

/// The cancel-safe shape of a backend's acquisition: runs `attempt` to completion (see
/// [`detached`]); if the caller goes away, the attempt is told through its [`Interrupt`],
/// and a grant it still produces (`grant_of` finds it in the output) is handed to
/// `give_back` on the runtime, so no lock is left behind.
///
/// # Errors
/// The attempt's own error, or a retryable [`Error::Backend`] naming `backend` if the task
/// died.
pub async fn detached_acquire<T, A, W, G, F>(
    backend: &'static str,
    attempt: A,
    grant_of: fn(T) -> Option<Grant>,
    give_back: G,
) -> Result<T>
where
    T: Send + 'static,
    A: FnOnce(Interrupt) -> W,
    W: Future<Output = Result<T>> + Send + 'static,
    G: FnOnce(Grant) -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let interrupt = Interrupt::default();
    let mut on_drop = InterruptOnDrop(Some(interrupt.clone()));
    let outcome = detached(attempt(interrupt), move |orphan: Result<T>| {
        let grant = orphan.ok().and_then(grant_of);
        if let (Some(grant), Ok(runtime)) = (grant, tokio::runtime::Handle::try_current()) {
            runtime.spawn(give_back(grant));
        }
    })
    .await;
    on_drop.0 = None;
    outcome.unwrap_or_else(|| {
        Err(Error::backend(
            backend,
            true,
            "the acquisition panicked; nothing is known of its outcome",
        ))
    })
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
        time::Duration,
    };

    use super::*;

    #[tokio::test]
    async fn delivers_to_the_caller() {
        let got = detached(async { 7 }, |_| panic!("not an orphan")).await;
        assert_eq!(got, Some(7));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_value_is_delivered_or_orphaned_exactly_once() {
        let delivered = Arc::new(AtomicUsize::new(0));
        let orphaned = Arc::new(AtomicUsize::new(0));
        for i in 0..2_000u64 {
            let orphans = orphaned.clone();
            let work = async move {
                if i % 3 == 0 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                } else if i % 3 == 1 {
                    tokio::task::yield_now().await;
                }
                i
            };
            let call = detached(work, move |_| {
                orphans.fetch_add(1, Ordering::SeqCst);
            });
            // A zero timeout gives up after the first poll: whatever is not done then is cut
            // short.
            let patience = Duration::from_micros(if i % 2 == 0 { 0 } else { 20_000 });
            if tokio::time::timeout(patience, call).await.is_ok() {
                delivered.fetch_add(1, Ordering::SeqCst);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            delivered.load(Ordering::SeqCst) + orphaned.load(Ordering::SeqCst),
            2_000
        );
        assert!(
            orphaned.load(Ordering::SeqCst) >= 300,
            "calls cut short were not orphaned"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_work_runs_in_the_callers_task_until_the_caller_goes() {
        tokio::spawn(the_work_runs_in_the_callers_task_until_the_caller_goes_in_a_task())
            .await
            .unwrap();
    }

    async fn the_work_runs_in_the_callers_task_until_the_caller_goes_in_a_task() {
        let caller = tokio::task::id();
        let seen = detached(async { tokio::task::try_id() }, |_| {}).await;
        assert_eq!(
            seen,
            Some(Some(caller)),
            "no task switch while the caller waits"
        );

        // Cut short: the rest runs in a task of its own and the orphan gets the output.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (release, hold) = tokio::sync::oneshot::channel::<()>();
        let work = async move {
            let _ = hold.await;
            tokio::task::try_id()
        };
        let call = detached(work, move |id| {
            let _ = tx.send(id);
        });
        assert!(
            tokio::time::timeout(Duration::from_millis(20), call)
                .await
                .is_err()
        );
        release.send(()).unwrap();
        let finished_in = tokio::time::timeout(Duration::from_secs(60), rx)
            .await
            .expect("the orphan handler was never called")
            .unwrap();
        assert!(finished_in.is_some_and(|id| id != caller));
    }

    #[tokio::test]
    async fn a_panic_in_the_work_is_none() {
        let got = detached(async { panic!("boom") }, |_: ()| {}).await;
        assert_eq!(got, None);
    }

    /// An attempt may look for its caller's interrupt in more than one place (a quick check,
    /// then a wait): the first look must not use it up (a second wait hung forever).
    #[tokio::test]
    async fn an_interrupt_is_seen_by_every_later_look() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let call = detached_acquire(
            "test",
            move |interrupt| async move {
                interrupt.interrupted().await;
                let again = tokio::time::timeout(Duration::from_secs(60), async {
                    interrupt.interrupted().await;
                    interrupt.interrupted().await;
                })
                .await;
                let _ = tx.send(again.is_ok());
                Ok(())
            },
            |()| None,
            |_grant| async {},
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(20), call)
                .await
                .is_err()
        );
        let seen_again = tokio::time::timeout(Duration::from_secs(120), rx)
            .await
            .expect("the attempt ended")
            .expect("it answered");
        assert!(seen_again, "a second look at the interrupt waited forever");
    }
}

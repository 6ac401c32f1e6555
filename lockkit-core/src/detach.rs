//! Cancel-safe backend calls: run a request in its own task so that dropping the caller
//! cannot strand what the server already granted.

use std::{
    future::Future,
    sync::{Arc, Mutex},
};

use tokio::sync::{Notify, oneshot};

use crate::{Error, Grant, Result};

type Orphan<T> = Arc<Mutex<Option<Box<dyn FnOnce(T) + Send>>>>;

fn take<T>(orphan: &Orphan<T>) -> Option<Box<dyn FnOnce(T) + Send>> {
    orphan.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Hands the value to the orphan handler if the caller never took it.
struct Waiting<T> {
    answer: Option<oneshot::Receiver<T>>,
    orphan: Orphan<T>,
}

impl<T> Drop for Waiting<T> {
    fn drop(&mut self) {
        if let Some(mut answer) = self.answer.take() {
            // Either the task has not answered yet (then its send fails and it calls the
            // handler itself) or the answer is waiting here unread.
            answer.close();
            if let Ok(value) = answer.try_recv()
                && let Some(handle) = take(&self.orphan)
            {
                handle(value);
            }
        }
    }
}

/// Runs `work` as its own Tokio task and returns its output.
///
/// If the returned future is dropped before it delivers the output, `orphan` receives the
/// output instead, whenever it is ready: a backend gives back a grant there, so a
/// cancelled acquisition never leaves a lock behind. Returns `None` if the task panicked
/// or the runtime is shutting down.
///
/// # Cancel safety
/// That is its purpose: the work always completes and its output is always consumed.
pub async fn detached<T, W, O>(work: W, orphan: O) -> Option<T>
where
    T: Send + 'static,
    W: Future<Output = T> + Send + 'static,
    O: FnOnce(T) + Send + 'static,
{
    let (deliver, answer) = oneshot::channel();
    let orphan: Orphan<T> = Arc::new(Mutex::new(Some(Box::new(orphan))));
    let task_orphan = orphan.clone();
    tokio::spawn(async move {
        let value = work.await;
        if let Err(value) = deliver.send(value)
            && let Some(handle) = take(&task_orphan)
        {
            handle(value);
        }
    });
    let mut waiting = Waiting {
        answer: Some(answer),
        orphan,
    };
    let value = match waiting.answer.as_mut() {
        Some(answer) => answer.await.ok(),
        None => None,
    };
    waiting.answer = None;
    value
}

/// Lets a detached acquisition learn that its caller has gone, so it can stop waiting
/// (and clean up) instead of waiting out its whole deadline.
#[derive(Debug, Clone, Default)]
pub struct Interrupt(Arc<Notify>);

impl Interrupt {
    /// Resolves once the caller of [`detached_acquire`] has dropped its future.
    ///
    /// # Cancel safety
    /// Cancel safe; a wake-up that arrives while nobody waits is kept for the next call.
    pub async fn interrupted(&self) {
        self.0.notified().await;
    }
}

/// Fires the interrupt when the caller's future is dropped before the end.
struct InterruptOnDrop(Option<Interrupt>);

impl Drop for InterruptOnDrop {
    fn drop(&mut self) {
        if let Some(interrupt) = self.0.take() {
            interrupt.0.notify_one();
        }
    }
}

/// The cancel-safe shape of a backend's acquisition: runs `attempt` as its own task (see
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
            "the acquisition task ended without an answer (runtime shutting down?)",
        ))
    })
}

#[cfg(test)]
mod tests {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
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
                    tokio::task::yield_now().await;
                }
                i
            };
            let call = detached(work, move |_| {
                orphans.fetch_add(1, Ordering::SeqCst);
            });
            if tokio::time::timeout(Duration::from_micros(i % 50), call)
                .await
                .is_ok()
            {
                delivered.fetch_add(1, Ordering::SeqCst);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            delivered.load(Ordering::SeqCst) + orphaned.load(Ordering::SeqCst),
            2_000
        );
    }
}

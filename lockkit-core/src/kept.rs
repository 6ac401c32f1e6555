//! Connections a SQL backend keeps out of its pool between one-statement calls.
//!
//! sqlx checks every connection given back to its pool (a round trip and a task of its
//! own), which nearly doubled the time of two one-row statements (`mysql_pool_probe` in
//! `lockkit-bench`). A backend's one-statement calls (a grant of a free key, a release, a
//! renewal) therefore keep the connection they used for the next such call, a few at a
//! time, and give each back once it idles, has been out too long, or the pool needs it.
//! This store holds them and decides which must go back; the backend decides when one may
//! be kept (a clean statement, a pool with a connection to spare).

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{Error, LockKey};

/// Why [`KeptConnections::lend_by`] lent no connection.
#[derive(Debug)]
pub enum NoConnection<E> {
    /// Every connection stayed lent until the acquisition gave up waiting.
    AllInUse,
    /// The caller went away.
    Interrupted,
    /// The pool failed otherwise: it could not open a connection, or it closed.
    Failed(E),
}

impl<E> NoConnection<E> {
    /// What an acquisition answers when [`KeptConnections::lend_by`] lent it no dedicated
    /// connection, except for a failed pool ([`NoConnection::Failed`]), whose error comes
    /// back as `Err` for the backend to word.
    ///
    /// It promises: the caller's going away, and a wait (`waits`) that ran out with every
    /// connection in use, answer `Ok(None)` (not granted in time; the caller says
    /// `Timeout`); a try that found every connection in use answers a retryable
    /// [`Error::Backend`] that says the key may be free and to raise `max_holds`.
    /// `locks` names the mode's holds in that message (`"for-update"`, `"advisory"`).
    ///
    /// # Errors
    /// `Err(error)` for [`NoConnection::Failed`]: the pool could not open a connection, or
    /// it closed.
    pub fn answer<T>(
        self,
        backend: &'static str,
        locks: &str,
        key: &LockKey,
        max_holds: u32,
        waits: bool,
    ) -> Result<crate::Result<Option<T>>, E> {
        match self {
            NoConnection::Interrupted => Ok(Ok(None)),
            NoConnection::AllInUse if waits => {
                tracing::debug!(
                    %key,
                    max_holds,
                    "a wait ran out with every dedicated connection in use; raise max_holds \
                     or hold fewer locks"
                );
                Ok(Ok(None))
            }
            NoConnection::AllInUse => Ok(Err(Error::backend(
                backend,
                true,
                format!(
                    "all {max_holds} dedicated connections are in use by held or waiting \
                     {locks} locks, so `{key}` could not be tried (it may be free); try again, \
                     raise max_holds (each hold and each waiter uses one server connection) \
                     or hold fewer locks"
                ),
            ))),
            NoConnection::Failed(error) => Err(error),
        }
    }
}

/// Connections kept out of a pool, ordered by last use (the longest idle first).
///
/// Dropping a connection taken out of the store gives it back to its pool, as dropping a
/// pooled connection does: the store never closes or checks one itself.
pub struct KeptConnections<C> {
    kept: Mutex<Vec<Kept<C>>>,
    at_most: usize,
    idle_at_most: Duration,
    out_at_most: Duration,
}

impl<C> std::fmt::Debug for KeptConnections<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptConnections")
            .field("kept", &self.lock().len())
            .field("at_most", &self.at_most)
            .finish()
    }
}

struct Kept<C> {
    conn: C,
    /// When its last statement completed.
    used: Instant,
    /// When it left the pool.
    out_since: Instant,
}

/// A connection taken from the store or from the pool, for one call.
#[derive(Debug)]
pub struct Lent<C> {
    /// The connection.
    pub conn: C,
    /// When it left the pool (the store bounds how long a connection stays out).
    pub out_since: Instant,
}

impl<C> Lent<C> {
    /// A connection just taken from the pool.
    pub fn from_pool(conn: C) -> Self {
        Lent {
            conn,
            out_since: Instant::now(),
        }
    }
}

impl<C> KeptConnections<C> {
    /// A store of at most `at_most` connections (0: it keeps none), each given back once it
    /// idled `idle_at_most` or has been out of the pool `out_at_most`.
    pub fn new(at_most: usize, idle_at_most: Duration, out_at_most: Duration) -> Self {
        KeptConnections {
            kept: Mutex::new(Vec::new()),
            at_most,
            idle_at_most,
            out_at_most,
        }
    }

    /// How many connections it keeps at most.
    pub fn at_most(&self) -> usize {
        self.at_most
    }

    /// How many connections it keeps now (without touching them).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it keeps none now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Kept<C>>> {
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The most recently used connection still fit to use. Those that idled or have been
    /// out too long are given back to the pool on the way (all of them with `return_all`:
    /// the pool closed, a connection was seen dead), outside the store's lock.
    pub fn take(&self, return_all: bool) -> Option<Lent<C>> {
        let mut kept = self.lock();
        let returned = self.unfit(&mut kept, return_all);
        let taken = kept.pop().map(|k| Lent {
            conn: k.conn,
            out_since: k.out_since,
        });
        drop(kept);
        drop(returned);
        taken
    }

    /// A kept connection ([`Self::take`]), or else one from the pool through `acquire`. If
    /// the pool's wait runs out (`timed_out` says which error that is), a connection kept
    /// meanwhile is taken rather than fail: one kept while the pool had a connection to
    /// spare, which another caller took as this one began to wait.
    ///
    /// # Errors
    /// `acquire`'s error, when no connection was kept meanwhile.
    pub async fn lend<E>(
        &self,
        return_all: impl Fn() -> bool,
        acquire: impl std::future::Future<Output = Result<C, E>>,
        timed_out: impl FnOnce(&E) -> bool,
    ) -> Result<Lent<C>, E> {
        if let Some(lent) = self.take(return_all()) {
            return Ok(lent);
        }
        match acquire.await {
            Ok(conn) => Ok(Lent::from_pool(conn)),
            Err(error) if timed_out(&error) => self.take(return_all()).ok_or(error),
            Err(error) => Err(error),
        }
    }

    /// [`Self::lend`] for an acquisition that stops waiting for a connection at `give_up`
    /// (a wait's deadline; a try's short patience). Asked while the pool is full (every
    /// connection open and lent: `full` says so), it waits for one to come back until
    /// `give_up`, asking the pool again (a new `acquire()`) after each of the pool's own
    /// timeouts that ends before, and then answers [`NoConnection::AllInUse`]. Asked while
    /// the pool has room, it waits as long as the pool allows, past `give_up` if need be:
    /// the pool is opening a connection for it (sqlx counts one being opened as lent, so
    /// the pool's state cannot tell that apart later), and the caller takes nothing past
    /// its deadline. The caller's going away (`interrupt`) ends it at once.
    ///
    /// # Errors
    /// [`NoConnection`]: every connection stayed lent, the caller went away, or the pool
    /// failed otherwise (it could not open a connection, or it closed).
    ///
    /// # Cancel safety
    /// Cancel safe: dropped, it holds no connection.
    pub async fn lend_by<E, Fut>(
        &self,
        return_all: impl Fn() -> bool,
        mut acquire: impl FnMut() -> Fut,
        timed_out: impl Fn(&E) -> bool,
        full: impl Fn() -> bool,
        give_up: tokio::time::Instant,
        interrupt: &crate::detach::Interrupt,
    ) -> Result<Lent<C>, NoConnection<E>>
    where
        Fut: std::future::Future<Output = Result<C, E>>,
    {
        let all_in_use = || self.take(return_all()).ok_or(NoConnection::AllInUse);
        loop {
            let mut bounded = full();
            let lend = self.lend(&return_all, acquire(), &timed_out);
            tokio::pin!(lend);
            let lent = loop {
                tokio::select! {
                    lent = &mut lend => break lent,
                    () = interrupt.interrupted() => return Err(NoConnection::Interrupted),
                    () = tokio::time::sleep_until(give_up), if bounded => {
                        if full() {
                            return all_in_use();
                        }
                        // One came back just now: the pool hands it out.
                        bounded = false;
                    }
                }
            };
            match lent {
                Ok(lent) => return Ok(lent),
                Err(error) if timed_out(&error) && full() => {
                    if tokio::time::Instant::now() >= give_up {
                        return all_in_use();
                    }
                    // Every connection stayed lent for the pool's whole timeout, which
                    // ended before `give_up`: ask again.
                }
                Err(error) => return Err(NoConnection::Failed(error)),
            }
        }
    }

    /// Keeps `lent` for the next [`Self::take`] when `allowed` (the caller's judgement: a
    /// clean statement, an open pool with a connection to spare), there is room, and it
    /// has not been out too long; otherwise it goes back to the pool. `allowed` is asked
    /// under the store's lock, so a pool marked closed before [`Self::take_all`] never has
    /// a connection kept after it.
    pub fn keep(&self, lent: Lent<C>, allowed: impl FnOnce() -> bool) {
        let mut kept = self.lock();
        if kept.len() < self.at_most && lent.out_since.elapsed() < self.out_at_most && allowed() {
            kept.push(Kept {
                conn: lent.conn,
                used: Instant::now(),
                out_since: lent.out_since,
            });
        } else {
            drop(kept);
            drop(lent);
        }
    }

    /// Gives back every connection that idled or has been out too long (every one with
    /// `return_all`). For a sweeper that runs while nobody calls.
    pub fn sweep(&self, return_all: bool) {
        let mut kept = self.lock();
        let returned = self.unfit(&mut kept, return_all);
        drop(kept);
        drop(returned);
    }

    /// Takes every kept connection out, for the caller to give back or detach.
    pub fn take_all(&self) -> Vec<C> {
        let kept = std::mem::take(&mut *self.lock());
        kept.into_iter().map(|k| k.conn).collect()
    }

    /// [`Self::take_all`] through `&mut self`, for a `Drop` that cannot block.
    pub fn take_all_mut(&mut self) -> Vec<C> {
        let kept = std::mem::take(
            self.kept
                .get_mut()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        kept.into_iter().map(|k| k.conn).collect()
    }

    /// For the owner's `Drop`: kept connections go back to their pool as they drop, which
    /// for sqlx needs a Tokio runtime (it gives a connection back in a task, and panics
    /// without one). Outside one (an owner dropped after its runtime, or on a thread of its
    /// own), each is handed to `close_in_place` instead.
    pub fn drop_all(&mut self, close_in_place: impl FnMut(C)) {
        let kept = self.take_all_mut();
        if tokio::runtime::Handle::try_current().is_err() {
            kept.into_iter().for_each(close_in_place);
        }
    }

    /// Takes out of `kept` every connection that must go back to the pool (for the caller
    /// to drop after letting go of the lock).
    fn unfit(&self, kept: &mut Vec<Kept<C>>, return_all: bool) -> Vec<Kept<C>> {
        if return_all {
            return std::mem::take(kept);
        }
        // Ordered by last use: the idle ones come first.
        let idle = kept
            .iter()
            .take_while(|k| k.used.elapsed() >= self.idle_at_most)
            .count();
        let mut unfit: Vec<Kept<C>> = kept.drain(..idle).collect();
        let (old, fit): (Vec<Kept<C>>, Vec<Kept<C>>) = std::mem::take(kept)
            .into_iter()
            .partition(|k| k.out_since.elapsed() >= self.out_at_most);
        *kept = fit;
        unfit.extend(old);
        unfit
    }
}

/// A sweeper to spawn beside a store of kept connections: every `every`, while `owner`
/// lives, runs `sweep` (give back what idled, see [`KeptConnections::sweep`]), and stops
/// once it answers `false` (the pool closed).
pub async fn sweep_while<T>(
    owner: std::sync::Weak<T>,
    every: Duration,
    sweep: impl Fn(&T) -> bool,
) {
    loop {
        tokio::time::sleep(every).await;
        let Some(owner) = owner.upgrade() else { return };
        if !sweep(&owner) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(at_most: usize) -> KeptConnections<u32> {
        KeptConnections::new(at_most, Duration::from_millis(50), Duration::from_secs(60))
    }

    #[test]
    fn keeps_up_to_its_bound_and_lends_the_latest_first() {
        let s = store(2);
        for conn in 1..=3 {
            s.keep(Lent::from_pool(conn), || true);
        }
        assert_eq!(s.take(false).map(|l| l.conn), Some(2));
        assert_eq!(s.take(false).map(|l| l.conn), Some(1));
        assert!(s.take(false).is_none());
    }

    #[test]
    fn keeps_nothing_the_caller_does_not_allow_or_a_store_of_none() {
        let s = store(2);
        s.keep(Lent::from_pool(1), || false);
        assert!(s.take(false).is_none());
        let none = store(0);
        none.keep(Lent::from_pool(1), || true);
        assert!(none.take(false).is_none());
    }

    #[test]
    fn gives_back_idle_old_and_all_when_asked() {
        let s = store(3);
        s.keep(Lent::from_pool(1), || true);
        std::thread::sleep(Duration::from_millis(60));
        s.keep(Lent::from_pool(2), || true);
        s.sweep(false);
        assert_eq!(s.take_all(), vec![2], "the idle one went back");
        let old = Lent {
            conn: 3,
            out_since: Instant::now() - Duration::from_secs(61),
        };
        s.keep(old, || true);
        assert!(s.take(false).is_none(), "out too long: not kept");
        s.keep(Lent::from_pool(4), || true);
        assert!(s.take(true).is_none(), "return_all gives everything back");
    }

    #[tokio::test]
    async fn lends_a_kept_connection_first_then_the_pools_then_one_kept_while_it_waited() {
        let s = store(2);
        s.keep(Lent::from_pool(1), || true);
        let asked = std::sync::atomic::AtomicU32::new(0);
        let pool = |conn: std::result::Result<u32, &'static str>| {
            let asked = &asked;
            async move {
                asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                conn
            }
        };
        let timed_out = |e: &&str| *e == "timed out";
        let kept = s.lend(|| false, pool(Ok(9)), timed_out).await;
        assert_eq!(kept.map(|l| l.conn), Ok(1), "the kept one, not the pool's");
        let pooled = s.lend(|| false, pool(Ok(9)), timed_out).await;
        assert_eq!(pooled.map(|l| l.conn), Ok(9));
        // The pool's wait ran out while a connection was kept meanwhile: that one.
        let waited = s.lend(
            || false,
            async {
                s.keep(Lent::from_pool(2), || true);
                Err("timed out")
            },
            timed_out,
        );
        assert_eq!(waited.await.map(|l| l.conn), Ok(2));
        let failed = s.lend(|| false, pool(Err("timed out")), timed_out).await;
        assert_eq!(
            failed.map(|l| l.conn),
            Err("timed out"),
            "nothing kept: the error"
        );
        s.keep(Lent::from_pool(3), || true);
        let refused = s.lend(|| true, pool(Err("refused")), timed_out).await;
        assert_eq!(
            refused.map(|l| l.conn),
            Err("refused"),
            "return_all: none is lent"
        );
        let other = s.lend(|| false, pool(Err("refused")), timed_out).await;
        assert_eq!(other.map(|l| l.conn), Err("refused"));
        // Asked only where nothing fit was kept: not for the first lend.
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 4);
    }
}

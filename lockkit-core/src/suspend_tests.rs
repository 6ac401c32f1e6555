//! Guards across a suspend of the machine (see [`crate::suspend`]): a module of tests
//! of its own, so that the guard's module need not import the `Locker` that imports it.

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use async_trait::async_trait;
    use tokio::{sync::Notify, time::Instant};

    use crate::{
        AcquireRequest, Grant, LockBackend, LockKey, Locker, LostReason, MemoryBackend, Released,
        Result,
    };

    /// A machine suspended past a hold's lease (a laptop's lid closed, a VM suspended): the
    /// monotonic clock stood still meanwhile, the server's lease did not. Before, the guard
    /// still called itself valid, for as long as it had left before the suspend; now it is
    /// invalid at once, and its deadline is in the past.
    #[tokio::test]
    async fn a_suspend_past_the_lease_ends_the_guards_belief() {
        let locker = Locker::new(MemoryBackend::new());
        let guard = locker
            .acquire("suspend")
            .ttl(Duration::from_secs(30))
            .await
            .expect("granted");
        assert!(guard.is_valid());
        crate::suspend::pretend_suspended(Duration::from_secs(40));
        assert!(
            !guard.is_valid(),
            "the guard still calls itself valid after a 40 s suspend with a 30 s lease"
        );
        assert_eq!(guard.valid_until(), None);
        assert!(guard.lost_at().is_some());
    }

    /// A backend whose holds live as long as a session it last heard from at `heard`, as
    /// ZooKeeper's and etcd's do: it bounds them at 2/3 of the session's timeout after that.
    #[derive(Debug)]
    struct SessionBound {
        inner: MemoryBackend,
        heard: crate::spi::Stamp,
        session: Duration,
    }

    #[async_trait]
    impl LockBackend for SessionBound {
        fn info(&self) -> crate::BackendInfo {
            self.inner.info()
        }
        async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
            self.inner.try_acquire(req).await
        }
        async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
            self.inner.acquire(req, wait).await
        }
        async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
            self.inner.renew(grant, ttl).await
        }
        async fn release(&self, grant: &Grant) -> Result<Released> {
            self.inner.release(grant).await
        }
        async fn inspect(&self, key: &LockKey) -> Result<Option<crate::HolderInfo>> {
            self.inner.inspect(key).await
        }
        fn validity_bound(&self, _grant: &Grant) -> Option<Instant> {
            Some(self.heard.deadline(self.session * 2 / 3))
        }
    }

    /// A suspend longer than the session's timeout ends the session on the server while
    /// the hold's own lease (a longer TTL) would outlast it: the backend's bound, heard
    /// before the suspend, must end the guard's belief.
    #[tokio::test]
    async fn a_session_heard_before_a_suspend_past_its_timeout_ends_the_guards_belief() {
        let locker = Locker::new(SessionBound {
            inner: MemoryBackend::new(),
            heard: crate::spi::Stamp::new(Instant::now()),
            session: Duration::from_secs(10),
        });
        let guard = locker
            .acquire("session")
            .ttl(Duration::from_secs(60))
            .await
            .expect("granted");
        assert!(guard.is_valid());
        crate::suspend::pretend_suspended(Duration::from_secs(20));
        assert!(
            !guard.is_valid(),
            "still valid after a 20 s suspend, past a 10 s session heard just before"
        );
    }

    /// Pretends a suspend of `suspended` and its resume once `guard`'s keeper waits, and
    /// answers what `lost()` resolved with within 2 s of it (`None`: not resolved).
    async fn lost_after_a_resume(
        guard: &crate::LockGuard,
        suspended: Duration,
    ) -> Option<LostReason> {
        let lost = guard.lost();
        // The keeper waits for its first renewal.
        tokio::task::yield_now().await;
        crate::suspend::pretend_suspended(suspended);
        crate::suspend::pretend_resumed();
        tokio::time::timeout(Duration::from_secs(2), lost)
            .await
            .ok()
    }

    /// After a resume past the lease, `lost()` resolves when the resume is noticed, not at
    /// the keeper's next renewal (a third of the TTL later on the monotonic clock).
    #[tokio::test]
    async fn a_resume_past_the_lease_resolves_lost_at_once() {
        let locker = Locker::new(MemoryBackend::new());
        let guard = locker
            .acquire("resume")
            .ttl(Duration::from_secs(30))
            .await
            .expect("granted");
        let reason = lost_after_a_resume(&guard, Duration::from_secs(40)).await;
        assert_eq!(
            reason,
            Some(LostReason::LeaseExpired),
            "lost() did not resolve within 2 s of a resume after a 40 s suspend (30 s lease)"
        );
    }

    /// A backend whose renewals are never answered (a network gone after a resume); it says
    /// when one is under way.
    #[derive(Debug)]
    struct RenewalUnanswered {
        inner: MemoryBackend,
        renewing: Arc<Notify>,
    }

    #[async_trait]
    impl LockBackend for RenewalUnanswered {
        fn info(&self) -> crate::BackendInfo {
            self.inner.info()
        }
        async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
            self.inner.try_acquire(req).await
        }
        async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
            self.inner.acquire(req, wait).await
        }
        async fn renew(&self, _grant: &Grant, _ttl: Duration) -> Result<()> {
            self.renewing.notify_one();
            std::future::pending().await
        }
        async fn release(&self, grant: &Grant) -> Result<Released> {
            self.inner.release(grant).await
        }
        async fn inspect(&self, key: &LockKey) -> Result<Option<crate::HolderInfo>> {
            self.inner.inspect(key).await
        }
    }

    /// A renewal sent before a suspend and unanswered after it: the keeper waits for its
    /// answer, and must still notice the resume past the lease then, not only when the wait
    /// it counted on the monotonic clock before the suspend runs out.
    #[tokio::test]
    async fn a_resume_during_an_unanswered_renewal_resolves_lost_at_once() {
        let renewing = Arc::new(Notify::new());
        let locker = Locker::new(RenewalUnanswered {
            inner: MemoryBackend::new(),
            renewing: renewing.clone(),
        });
        let guard = locker
            .acquire("resume-renewing")
            .ttl(Duration::from_secs(6))
            .await
            .expect("granted");
        let lost = guard.lost();
        // The first renewal goes out after 2 s and has about 4 s left to be answered.
        tokio::time::timeout(Duration::from_secs(5), renewing.notified())
            .await
            .expect("the renewal went out");
        crate::suspend::pretend_suspended(Duration::from_secs(40));
        crate::suspend::pretend_resumed();
        let reason = tokio::time::timeout(Duration::from_secs(2), lost).await;
        assert_eq!(
            reason.ok(),
            Some(LostReason::LeaseExpired),
            "lost() did not resolve within 2 s of a resume after a 40 s suspend (6 s lease) \
             while a renewal was unanswered"
        );
    }

    /// A suspend past a backend's session bound (ZooKeeper's, etcd's), the hold's own lease
    /// longer: `lost()` resolves at the resume, as `is_valid()` turns false, without anyone
    /// asking `is_valid()`.
    #[tokio::test]
    async fn a_resume_past_the_session_bound_resolves_lost_at_once() {
        let locker = Locker::new(SessionBound {
            inner: MemoryBackend::new(),
            heard: crate::spi::Stamp::new(Instant::now()),
            session: Duration::from_secs(10),
        });
        let guard = locker
            .acquire("resume-session")
            .ttl(Duration::from_secs(60))
            .await
            .expect("granted");
        let reason = lost_after_a_resume(&guard, Duration::from_secs(20)).await;
        assert_eq!(
            reason,
            Some(LostReason::LeaseExpired),
            "lost() did not resolve within 2 s of a resume after a 20 s suspend, past a 10 s \
             session heard just before (60 s lease)"
        );
    }

    /// An uncontended acquisition on a multi-thread runtime (its keeper put off) reads the
    /// suspended time once: three or more `clock_gettime` calls a reading, on the hot path.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn an_acquisition_reads_the_suspended_time_once() {
        let locker = Locker::new(MemoryBackend::new());
        let before = crate::suspend::readings();
        let guard = locker.acquire("readings").await.expect("granted");
        let read = crate::suspend::readings() - before;
        assert_eq!(
            read, 1,
            "the acquisition read the suspended time {read} times"
        );
        guard.release().await.expect("released");
    }

    /// A shorter suspend moves the deadline earlier by the time suspended, and a renewal
    /// (here an extension) counts afresh from its own start.
    #[tokio::test]
    async fn a_short_suspend_shortens_what_is_left_and_a_renewal_counts_afresh() {
        let locker = Locker::new(MemoryBackend::new());
        let guard = locker
            .acquire("suspend-short")
            .ttl(Duration::from_secs(30))
            .await
            .expect("granted");
        let before = guard.valid_until().expect("valid");
        crate::suspend::pretend_suspended(Duration::from_secs(10));
        let after = guard.valid_until().expect("still valid");
        let moved = before.saturating_duration_since(after);
        assert!(
            // The two readings of the clocks differ by their jitter (microseconds).
            moved > Duration::from_millis(9_900) && moved < Duration::from_millis(10_100),
            "moved by {moved:?}"
        );
        guard
            .extend(Duration::from_secs(30))
            .await
            .expect("extended");
        let renewed = guard.valid_until().expect("valid");
        assert!(
            renewed.saturating_duration_since(Instant::now()) > Duration::from_secs(25),
            "the extension counts from its own start"
        );
        guard.release().await.expect("released");
    }
}

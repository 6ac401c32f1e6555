//! A hold lost before its keeper was first due is reported at once (the keeper starts on the
//! loss), not at its first renewal. Alone in its test binary: it installs the process's log
//! subscriber.

use std::{
    io::Write,
    sync::{Arc, Mutex},
    time::Duration,
};

use lockkit_core::{Locker, LostReason, MemoryBackend};

/// Everything logged at `error` from now on (the process's subscriber).
fn errors_logged() -> Arc<Mutex<Vec<u8>>> {
    let log = Arc::new(Mutex::new(Vec::new()));
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::ERROR)
        .with_ansi(false)
        .with_writer(move || Sink(writer.clone()))
        .init();
    log
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_loss_before_the_first_renewal_is_reported_at_once() {
    let log = errors_logged();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let backend = MemoryBackend::new();
        let locker = Locker::new(backend.clone());
        let guard = locker
            .acquire("reported-at-once")
            .ttl(Duration::from_secs(600))
            .await
            .expect("granted");
        backend.kill_session();
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(60), guard.lost())
                .await
                .expect("the loss signal fired"),
            LostReason::SessionLost
        );
        let reported = async {
            loop {
                let text = String::from_utf8_lossy(&log.lock().expect("log")).into_owned();
                if text.lines().any(|line| {
                    line.contains("lock lost while held") && line.contains("key=reported-at-once")
                }) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        // Its first renewal is 200 s away: a keeper that waited for it would miss this bound.
        tokio::time::timeout(Duration::from_secs(30), reported)
            .await
            .expect("the loss was not reported at once (its keeper waited for its first renewal)");
        drop(guard);
    });
}

//! Release notifications: one shared subscriber connection per backend fans the
//! `redisson_lock__channel:{name}` messages out to the local waiters of each lock.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures_util::StreamExt;
use lockkit_core::Result;
use redis::aio::PubSubSink;
use tokio::sync::Notify;

use crate::conn::backend_error;

/// Local waiters on one channel.
#[derive(Debug, Default)]
pub(crate) struct Channel {
    /// Notified on every release message (and when the subscriber connection is lost, so
    /// waiters retry instead of sleeping on a dead subscription).
    pub(crate) notify: Notify,
    /// Subscriptions held; changed only under the sink lock.
    refs: Mutex<usize>,
}

#[derive(Default)]
struct Shared {
    channels: Mutex<HashMap<String, Arc<Channel>>>,
    /// The generation of the last connection whose reader ended.
    dead_generation: AtomicU64,
}

impl Shared {
    fn channels(&self) -> MutexGuard<'_, HashMap<String, Arc<Channel>>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake_all(&self) {
        for channel in self.channels().values() {
            channel.notify.notify_waiters();
        }
    }
}

/// The connection in use and a generation number that changes when it is replaced.
struct Link {
    generation: u64,
    sink: Option<PubSubSink>,
    /// The reader of the connection in use: aborted (closing that connection) when the
    /// link gives the connection up, so an abandoned connection never lingers.
    reader: Option<tokio::task::JoinHandle<()>>,
    /// When the last attempt to open the connection failed: new attempts wait
    /// [`RECONNECT_PAUSE`] after it, so waiters behind a dead server fail fast instead of
    /// each spending a timeout under the lock.
    failed_at: Option<tokio::time::Instant>,
}

/// The pause between attempts to reopen a subscriber connection that failed to open.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

/// The shared subscriber of one backend.
pub(crate) struct Wakeups {
    client: redis::Client,
    target: String,
    /// Bounds every exchange with the server made under `link` (opening the connection,
    /// SUBSCRIBE, UNSUBSCRIBE): a frozen server must not hold the lock, and with it every
    /// other waiter, for longer.
    timeout: Duration,
    shared: Arc<Shared>,
    /// Serialises SUBSCRIBE/UNSUBSCRIBE so their order on the wire matches the refcounts.
    link: tokio::sync::Mutex<Link>,
}

impl std::fmt::Debug for Wakeups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wakeups")
            .field("target", &self.target)
            .finish()
    }
}

/// One waiter's subscription; unsubscribes (in the background) when the last local
/// waiter on the channel goes.
pub(crate) struct Subscription {
    wakeups: Arc<Wakeups>,
    name: String,
    pub(crate) channel: Arc<Channel>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let wakeups = self.wakeups.clone();
        let name = std::mem::take(&mut self.name);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { wakeups.unsubscribe(&name).await });
        }
    }
}

impl Wakeups {
    /// A subscriber for `client`; each exchange with the server may take up to `timeout`.
    pub(crate) fn new(client: redis::Client, target: String, timeout: Duration) -> Arc<Self> {
        Arc::new(Wakeups {
            client,
            target,
            timeout,
            shared: Arc::default(),
            link: tokio::sync::Mutex::new(Link {
                generation: 0,
                sink: None,
                reader: None,
                failed_at: None,
            }),
        })
    }

    /// Subscribes to `name` and returns once the server confirmed, so a release published
    /// after this returns cannot be missed.
    ///
    /// # Cancel safety
    /// If dropped mid-way the reference is still counted and given back by a background
    /// unsubscribe, so nothing leaks.
    pub(crate) async fn subscribe(self: &Arc<Self>, name: &str) -> Result<Subscription> {
        let mut link = self.link.lock().await;
        let channel = self
            .shared
            .channels()
            .entry(name.to_owned())
            .or_default()
            .clone();
        let subscription = Subscription {
            wakeups: self.clone(),
            name: name.to_owned(),
            channel: channel.clone(),
        };
        let first = {
            let mut refs = channel.refs.lock().unwrap_or_else(|e| e.into_inner());
            *refs += 1;
            *refs == 1
        };
        if self.is_dead(&link) {
            self.connect(&mut link).await?;
        } else if first {
            let sink = link.sink.as_mut().ok_or_else(|| self.gone())?;
            match tokio::time::timeout(self.timeout, sink.subscribe(name)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.abandon(&mut link);
                    return Err(backend_error("SUBSCRIBE", &self.target, e));
                }
                Err(_) => {
                    self.abandon(&mut link);
                    return Err(self.timed_out("SUBSCRIBE"));
                }
            }
        }
        Ok(subscription)
    }

    /// Gives the connection up: its reader stops, and with it the connection. Waiters
    /// subscribed through it are told (as when a connection dies by itself), so they retry
    /// and resubscribe instead of sleeping on a subscription that no longer hears anything.
    fn abandon(&self, link: &mut Link) {
        link.sink = None;
        if let Some(reader) = link.reader.take() {
            reader.abort();
            self.shared
                .dead_generation
                .fetch_max(link.generation, Ordering::SeqCst);
            self.shared.wake_all();
        }
    }

    fn gone(&self) -> lockkit_core::Error {
        lockkit_core::Error::backend(
            crate::conn::BACKEND,
            true,
            format!("the subscriber connection to {} is gone", self.target),
        )
    }

    fn timed_out(&self, doing: &str) -> lockkit_core::Error {
        lockkit_core::Error::backend(
            crate::conn::BACKEND,
            true,
            format!(
                "{doing} on the subscriber connection to {} got no answer within {:?}; is the \
                 server overloaded or partitioned away?",
                self.target, self.timeout
            ),
        )
    }

    /// Opens the subscriber connection and subscribes every channel with waiters, within
    /// the timeout; after a failure, fails at once for [`RECONNECT_PAUSE`].
    async fn connect(&self, link: &mut Link) -> Result<()> {
        self.abandon(link);
        if link
            .failed_at
            .is_some_and(|at| at.elapsed() < RECONNECT_PAUSE)
        {
            return Err(self.gone());
        }
        let opened = tokio::time::timeout(self.timeout, self.open()).await;
        let outcome = match opened {
            Ok(Ok(sink)) => Ok(sink),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(self.timed_out("opening and subscribing")),
        };
        match outcome {
            Ok(sink) => {
                link.failed_at = None;
                link.generation += 1;
                link.sink = Some(sink.0);
                link.reader = Some(self.spawn_reader(sink.1, link.generation));
                Ok(())
            }
            Err(e) => {
                link.failed_at = Some(tokio::time::Instant::now());
                Err(e)
            }
        }
    }

    /// A new subscriber connection, subscribed to every channel with waiters.
    async fn open(&self) -> Result<(PubSubSink, redis::aio::PubSubStream)> {
        let pubsub = self
            .client
            .get_async_pubsub()
            .await
            .map_err(|e| backend_error("opening the subscriber connection", &self.target, e))?;
        let (mut sink, stream) = pubsub.split();
        let wanted: Vec<String> = self
            .shared
            .channels()
            .iter()
            .filter(|(_, c)| *c.refs.lock().unwrap_or_else(|e| e.into_inner()) > 0)
            .map(|(name, _)| name.clone())
            .collect();
        if !wanted.is_empty() {
            sink.subscribe(&wanted)
                .await
                .map_err(|e| backend_error("SUBSCRIBE", &self.target, e))?;
        }
        Ok((sink, stream))
    }

    /// Fans the messages of connection `generation` out to the local waiters.
    fn spawn_reader(
        &self,
        mut stream: redis::aio::PubSubStream,
        generation: u64,
    ) -> tokio::task::JoinHandle<()> {
        let shared = self.shared.clone();
        tokio::spawn(async move {
            while let Some(message) = stream.next().await {
                let channel = shared.channels().get(message.get_channel_name()).cloned();
                if let Some(channel) = channel {
                    channel.notify.notify_waiters();
                }
            }
            // The connection is gone: wake everyone so they retry and reconnect.
            // An older generation ending later must not hide a newer one's death.
            shared
                .dead_generation
                .fetch_max(generation, Ordering::SeqCst);
            shared.wake_all();
        })
    }

    /// Drops one reference; true when it was the last, and the channel is forgotten.
    fn release_ref(&self, name: &str) -> bool {
        let mut channels = self.shared.channels();
        let Some(channel) = channels.get(name).cloned() else {
            return false;
        };
        let mut refs = channel.refs.lock().unwrap_or_else(|e| e.into_inner());
        *refs = refs.saturating_sub(1);
        if *refs > 0 {
            return false;
        }
        drop(refs);
        channels.remove(name);
        true
    }

    async fn unsubscribe(&self, name: &str) {
        let mut link = self.link.lock().await;
        if !self.release_ref(name) {
            return;
        }
        if let Some(sink) = link.sink.as_mut() {
            match tokio::time::timeout(self.timeout, sink.unsubscribe(name)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, "UNSUBSCRIBE failed; dropping the subscriber connection");
                    self.abandon(&mut link);
                }
                Err(_) => {
                    tracing::debug!(
                        "UNSUBSCRIBE got no answer; dropping the subscriber connection"
                    );
                    self.abandon(&mut link);
                }
            }
        }
    }

    fn is_dead(&self, link: &Link) -> bool {
        link.sink.is_none() || self.shared.dead_generation.load(Ordering::SeqCst) == link.generation
    }

    /// Reconnects (and resubscribes every channel with waiters) if the subscriber
    /// connection died. Cheap when it is alive.
    ///
    /// # Errors
    /// When the server cannot be reached; waiters then fall back to timed retries.
    pub(crate) async fn ensure_connected(&self) -> Result<()> {
        let mut link = self.link.lock().await;
        if self.is_dead(&link) {
            self.connect(&mut link).await?;
        }
        Ok(())
    }

    /// Channels with local subscribers (for leak checks).
    pub(crate) fn active_channels(&self) -> usize {
        self.shared.channels().len()
    }
}

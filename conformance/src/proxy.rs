//! A small TCP fault proxy: put it between a client and a server, then cut, reset, delay
//! and heal the link from a test.

use std::{
    io,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};

/// The state of the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkState {
    /// Bytes flow (after the configured delay).
    Open,
    /// A partition: connections stay open but no byte passes until healed, as when
    /// packets are dropped and TCP keeps retransmitting.
    Cut,
    /// Every connection is closed and new ones are closed at once, until healed.
    Reset,
}

#[derive(Debug)]
struct Control {
    state: watch::Sender<LinkState>,
    delay: Mutex<Duration>,
    pumps: Mutex<Vec<JoinHandle<()>>>,
    /// Reads from clients (each a request or a batch of pipelined ones).
    requests: std::sync::atomic::AtomicU64,
}

/// A TCP proxy on a loopback port, forwarding to one upstream address.
///
/// Dropping it stops the listener and closes every proxied connection.
#[derive(Debug)]
pub struct FaultProxy {
    local: SocketAddr,
    control: Arc<Control>,
    acceptor: JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        for pump in self
            .control
            .pumps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            pump.abort();
        }
    }
}

impl FaultProxy {
    /// Starts a proxy on `127.0.0.1:0` forwarding to `upstream`.
    ///
    /// # Errors
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let local = listener.local_addr()?;
        let (state, _) = watch::channel(LinkState::Open);
        let control = Arc::new(Control {
            state,
            delay: Mutex::new(Duration::ZERO),
            pumps: Mutex::new(Vec::new()),
            requests: std::sync::atomic::AtomicU64::new(0),
        });
        let acceptor = tokio::spawn(accept_loop(listener, upstream, control.clone()));
        Ok(FaultProxy {
            local,
            control,
            acceptor,
        })
    }

    /// Where clients should connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stalls the link in both directions; connections stay open.
    pub fn cut(&self) {
        self.control.state.send_replace(LinkState::Cut);
    }

    /// Closes every connection now and refuses new ones until [`FaultProxy::heal`].
    pub fn reset(&self) {
        self.control.state.send_replace(LinkState::Reset);
        for pump in self
            .control
            .pumps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            pump.abort();
        }
    }

    /// Lets bytes flow again.
    pub fn heal(&self) {
        self.control.state.send_replace(LinkState::Open);
    }

    /// Delays every chunk forwarded from now on by `delay`.
    pub fn set_delay(&self, delay: Duration) {
        *self.control.delay.lock().unwrap_or_else(|e| e.into_inner()) = delay;
    }

    /// How many times a client's bytes reached the proxy so far: one per request, or per
    /// batch of pipelined requests. A waiter that polls shows up here; one woken by a
    /// notification sends a handful.
    pub fn requests_seen(&self) -> u64 {
        self.control
            .requests
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The current state.
    pub fn state(&self) -> LinkState {
        *self.control.state.borrow()
    }

    /// Proxied connections currently open.
    pub fn open_connections(&self) -> usize {
        let mut pumps = self.control.pumps.lock().unwrap_or_else(|e| e.into_inner());
        pumps.retain(|p| !p.is_finished());
        pumps.len()
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, control: Arc<Control>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        if *control.state.borrow() == LinkState::Reset {
            drop(client);
            continue;
        }
        let pump = tokio::spawn(proxy_connection(client, upstream, control.clone()));
        let mut pumps = control.pumps.lock().unwrap_or_else(|e| e.into_inner());
        pumps.retain(|p| !p.is_finished());
        pumps.push(pump);
    }
}

async fn proxy_connection(client: TcpStream, upstream: SocketAddr, control: Arc<Control>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = pump(client_read, server_write, &control, true) => {}
        _ = pump(server_read, client_write, &control, false) => {}
    }
}

/// Waits until the link is open; false if it was reset.
async fn wait_open(state: &mut watch::Receiver<LinkState>) -> bool {
    loop {
        match *state.borrow_and_update() {
            LinkState::Open => return true,
            LinkState::Reset => return false,
            LinkState::Cut => {}
        }
        if state.changed().await.is_err() {
            return false;
        }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    control: &Control,
    from_client: bool,
) {
    let mut state = control.state.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if from_client {
            control
                .requests
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if !wait_open(&mut state).await {
            return;
        }
        let delay = *control.delay.lock().unwrap_or_else(|e| e.into_inner());
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
            if !wait_open(&mut state).await {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The clients a harness made, each with the fault proxies in front of it (one per server)
/// and its backend as its own type (for the backend's diagnostics): the link hooks of a
/// [`Harness`](crate::Harness) whose clients all go through proxies.
pub struct ProxiedClients<B> {
    clients: std::sync::Mutex<Vec<ProxiedClient<B>>>,
}

struct ProxiedClient<B> {
    shared: std::sync::Arc<dyn lockkit_core::LockBackend>,
    proxies: Vec<FaultProxy>,
    backend: B,
}

impl<B> std::fmt::Debug for ProxiedClients<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let clients = self.clients.lock().map_or(0, |c| c.len());
        f.debug_struct("ProxiedClients")
            .field("clients", &clients)
            .finish()
    }
}

impl<B: Clone> Default for ProxiedClients<B> {
    fn default() -> Self {
        ProxiedClients {
            clients: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl<B: Clone> ProxiedClients<B> {
    /// Starts one proxy in front of each `host:port` of `servers`; returns them and the
    /// `host:port` clients should connect to instead, joined by commas.
    ///
    /// # Panics
    /// If a server address does not parse or a proxy cannot start (test code).
    pub async fn start_proxies(servers: &[String]) -> (Vec<FaultProxy>, String) {
        let mut proxies = Vec::new();
        for server in servers {
            let upstream = server
                .parse()
                .unwrap_or_else(|e| panic!("server address `{server}`: {e}"));
            let proxy = FaultProxy::start(upstream)
                .await
                .unwrap_or_else(|e| panic!("a proxy in front of {server}: {e}"));
            proxies.push(proxy);
        }
        let hosts: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
        (proxies, hosts.join(","))
    }

    /// Records a client: `shared` as lockers see it, `proxies` in front of it, `backend`.
    pub fn add(
        &self,
        shared: std::sync::Arc<dyn lockkit_core::LockBackend>,
        proxies: Vec<FaultProxy>,
        backend: B,
    ) {
        self.lock().push(ProxiedClient {
            shared,
            proxies,
            backend,
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<ProxiedClient<B>>> {
        self.clients.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn find<T>(
        &self,
        client: &lockkit_core::Locker,
        f: impl FnOnce(&ProxiedClient<B>) -> T,
    ) -> crate::HookResult<T> {
        let clients = self.lock();
        clients
            .iter()
            .find(|c| {
                std::ptr::addr_eq(
                    std::sync::Arc::as_ptr(&c.shared),
                    std::sync::Arc::as_ptr(client.backend()),
                )
            })
            .map(f)
            .ok_or_else(|| crate::HookError::Failed("unknown client".into()))
    }

    /// Runs `f` on the proxies in front of `client`.
    ///
    /// # Errors
    /// [`HookError::Failed`](crate::HookError) for a client this harness did not make.
    pub fn with_proxies<T>(
        &self,
        client: &lockkit_core::Locker,
        f: impl FnOnce(&[FaultProxy]) -> T,
    ) -> crate::HookResult<T> {
        self.find(client, |c| f(&c.proxies))
    }

    /// `client`'s backend as its own type.
    ///
    /// # Errors
    /// As [`ProxiedClients::with_proxies`].
    pub fn backend_of(&self, client: &lockkit_core::Locker) -> crate::HookResult<B> {
        self.find(client, |c| c.backend.clone())
    }

    /// Closes `client`'s connections and refuses new ones (the `kill_connection` hook).
    ///
    /// # Errors
    /// As [`ProxiedClients::with_proxies`].
    pub fn reset(&self, client: &lockkit_core::Locker) -> crate::HookResult {
        self.with_proxies(client, |proxies| proxies.iter().for_each(FaultProxy::reset))
    }

    /// Requests `client` sent, over all its proxies (the `requests_sent` hook).
    ///
    /// # Errors
    /// As [`ProxiedClients::with_proxies`].
    pub fn requests_sent(&self, client: &lockkit_core::Locker) -> crate::HookResult<u64> {
        self.with_proxies(client, |proxies| {
            proxies.iter().map(FaultProxy::requests_seen).sum()
        })
    }

    /// Delays everything `client` sends and receives (the `delay_link` hook).
    ///
    /// # Errors
    /// As [`ProxiedClients::with_proxies`].
    pub fn delay(&self, client: &lockkit_core::Locker, delay: Duration) -> crate::HookResult {
        self.with_proxies(client, |proxies| {
            proxies.iter().for_each(|p| p.set_delay(delay));
        })
    }

    /// Stalls (`cut`) or heals `client`'s links (the `cut_link` hook).
    ///
    /// # Errors
    /// As [`ProxiedClients::with_proxies`].
    pub fn cut(&self, client: &lockkit_core::Locker, cut: bool) -> crate::HookResult {
        self.with_proxies(client, |proxies| {
            for proxy in proxies {
                if cut { proxy.cut() } else { proxy.heal() }
            }
        })
    }
}

//! The conformance suite against the private PostgreSQL from `scripts/services.sh`. Every
//! client reaches the server through its own fault proxy (its pool and its release
//! listener both).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use lockkit_conformance::{FaultProxy, Harness, HookError, HookResult, env};
use lockkit_core::{LockBackend, LockKey, Locker, async_trait};
use lockkit_postgres::PostgresBackend;

struct Client {
    dyn_backend: Arc<dyn LockBackend>,
    proxy: FaultProxy,
}

struct PostgresHarness {
    mode: &'static str,
    url: String,
    server: SocketAddr,
    clients: Mutex<Vec<Client>>,
}

impl PostgresHarness {
    async fn new(mode: &'static str) -> Option<Self> {
        let url = env::service_url("LOCKKIT_TEST_POSTGRES_URL")?;
        let server = env::host_ports(&url)[0].parse().unwrap();
        Some(PostgresHarness {
            mode,
            url,
            server,
            clients: Mutex::new(Vec::new()),
        })
    }

    fn url_via(&self, addr: &str) -> String {
        let (scheme_user, rest) = self.url.split_once('@').unwrap();
        let db = rest.split_once('/').unwrap().1;
        let table = if self.mode == "row" {
            "lockkit_test_row"
        } else {
            "lockkit_test_adv"
        };
        format!("{scheme_user}@{addr}/{db}?mode={}&table={table}", self.mode)
    }

    async fn admin(&self) -> PostgresBackend {
        PostgresBackend::connect(&self.url_via(&self.server.to_string()))
            .await
            .unwrap()
    }

    /// Runs `f` on the fault proxy in front of `client`.
    fn with_proxy<T>(&self, client: &Locker, f: impl FnOnce(&FaultProxy) -> T) -> HookResult<T> {
        let clients = self.clients.lock().unwrap();
        let found = clients
            .iter()
            .find(|c| std::ptr::addr_eq(Arc::as_ptr(&c.dyn_backend), Arc::as_ptr(client.backend())))
            .ok_or_else(|| HookError::Failed("unknown client".into()))?;
        Ok(f(&found.proxy))
    }
}

#[async_trait]
impl Harness for PostgresHarness {
    fn name(&self) -> String {
        format!("postgres-{}", self.mode)
    }

    async fn client(&self) -> Locker {
        let proxy = FaultProxy::start(self.server).await.unwrap();
        let backend = PostgresBackend::connect(&self.url_via(&proxy.local_addr().to_string()))
            .await
            .unwrap();
        let dyn_backend: Arc<dyn LockBackend> = Arc::new(backend);
        self.clients.lock().unwrap().push(Client {
            dyn_backend: dyn_backend.clone(),
            proxy,
        });
        Locker::from_arc(dyn_backend)
    }

    /// A new client's first acquisition opens a connection (a PostgreSQL backend process
    /// and SCRAM authentication: ~40 ms here, several times that on a loaded CI machine),
    /// which must not eat the whole lease.
    fn short_ttl(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn expiry_slack(&self) -> Duration {
        Duration::from_secs(1)
    }

    async fn connect(&self, url: &str) -> lockkit_core::Result<Locker> {
        PostgresBackend::connect(url).await.map(Locker::new)
    }

    fn malformed_urls(&self) -> Vec<String> {
        [
            "postgres://",
            "postgres://lockkit@127.0.0.1:15432",
            "postgres://lockkit@127.0.0.1:15432/lockkit?mode=lease",
            "postgres://lockkit@127.0.0.1:15432/lockkit?table=drop;table",
            "postgres://lockkit@127.0.0.1:15432/lockkit?unknown=1",
            "postgres://lockkit@127.0.0.1:notaport/lockkit",
            "mysql://lockkit@127.0.0.1/lockkit",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn take_away(&self, key: &LockKey) -> HookResult {
        // An operator clears the lease row (row mode) or ends the holder's session
        // (advisory mode).
        let cleared = self
            .admin()
            .await
            .take_away(key)
            .await
            .map_err(|e| HookError::Failed(e.to_string()))?;
        if cleared {
            Ok(())
        } else {
            Err(HookError::Failed(format!("`{key}` had no holder")))
        }
    }

    async fn kill_connection(&self, client: &Locker) -> HookResult {
        self.with_proxy(client, FaultProxy::reset)
    }

    async fn requests_sent(&self, client: &Locker) -> HookResult<u64> {
        self.with_proxy(client, FaultProxy::requests_seen)
    }

    async fn delay_link(&self, client: &Locker, delay: Duration) -> HookResult {
        self.with_proxy(client, |proxy| proxy.set_delay(delay))
    }

    async fn cut_link(&self, client: &Locker, cut: bool) -> HookResult {
        self.with_proxy(client, |proxy| if cut { proxy.cut() } else { proxy.heal() })
    }

    async fn residue(&self, prefix: &str) -> HookResult<usize> {
        let held = self
            .admin()
            .await
            .held_under(prefix)
            .await
            .map_err(|e| HookError::Failed(e.to_string()))?;
        Ok(usize::try_from(held).unwrap_or(usize::MAX))
    }
}

mod row {
    lockkit_conformance::suite!(super::PostgresHarness::new("row").await);
}

mod advisory {
    lockkit_conformance::suite!(super::PostgresHarness::new("advisory").await);
}

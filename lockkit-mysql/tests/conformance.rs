//! The conformance suite against the private MariaDB from `scripts/services.sh`, in both
//! modes. Every client reaches the server through its own fault proxy.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use lockkit_conformance::{FaultProxy, Harness, HookError, HookResult, env};
use lockkit_core::{LockBackend, LockKey, Locker, async_trait};
use lockkit_mysql::MysqlBackend;

struct Client {
    backend: MysqlBackend,
    dyn_backend: Arc<dyn LockBackend>,
    proxy: FaultProxy,
}

struct MysqlHarness {
    mode: &'static str,
    url: String,
    server: SocketAddr,
    clients: Mutex<Vec<Client>>,
}

impl MysqlHarness {
    async fn new(mode: &'static str) -> Option<Self> {
        let url = env::service_url("LOCKKIT_TEST_MYSQL_URL")?;
        let server = env::host_ports(&url)[0].parse().unwrap();
        Some(MysqlHarness {
            mode,
            url,
            server,
            clients: Mutex::new(Vec::new()),
        })
    }

    fn table(&self) -> &'static str {
        if self.mode == "row" {
            "lockkit_test_row"
        } else {
            "lockkit_test_fu"
        }
    }

    fn url_via(&self, addr: &str) -> String {
        let (scheme_user, rest) = self.url.split_once('@').unwrap();
        let db = rest.split_once('/').unwrap().1;
        format!(
            "{scheme_user}@{addr}/{db}?mode={}&table={}",
            self.mode,
            self.table()
        )
    }

    async fn admin(&self) -> MysqlBackend {
        MysqlBackend::connect(&self.url_via(&self.server.to_string()))
            .await
            .unwrap()
    }
}

impl MysqlHarness {
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
impl Harness for MysqlHarness {
    fn name(&self) -> String {
        format!("mysql-{}", self.mode)
    }

    async fn client(&self) -> Locker {
        let proxy = FaultProxy::start(self.server).await.unwrap();
        let backend = MysqlBackend::connect(&self.url_via(&proxy.local_addr().to_string()))
            .await
            .unwrap();
        let dyn_backend: Arc<dyn LockBackend> = Arc::new(backend.clone());
        self.clients.lock().unwrap().push(Client {
            backend,
            dyn_backend: dyn_backend.clone(),
            proxy,
        });
        Locker::from_arc(dyn_backend)
    }

    fn short_ttl(&self) -> Duration {
        if self.mode == "row" {
            Duration::from_millis(400)
        } else {
            Duration::from_secs(1)
        }
    }

    fn expiry_slack(&self) -> Duration {
        if self.mode == "row" {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(2)
        }
    }

    async fn connect(&self, url: &str) -> lockkit_core::Result<Locker> {
        MysqlBackend::connect(url).await.map(Locker::new)
    }

    fn malformed_urls(&self) -> Vec<String> {
        [
            "mysql://",
            "mysql://lockkit@127.0.0.1:13306",
            "mysql://lockkit@127.0.0.1:13306/lockkit?mode=lease",
            "mysql://lockkit@127.0.0.1:13306/lockkit?table=drop;table",
            "mysql://lockkit@127.0.0.1:13306/lockkit?unknown=1",
            "mysql://lockkit@127.0.0.1:notaport/lockkit",
            "postgres://lockkit@127.0.0.1/lockkit",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn take_away(&self, key: &LockKey) -> HookResult {
        if self.mode == "row" {
            // An operator clears the lease row.
            let admin = self.admin().await;
            let cleared = admin
                .take_away(key)
                .await
                .map_err(|e| HookError::Failed(e.to_string()))?;
            return if cleared {
                Ok(())
            } else {
                Err(HookError::Failed(format!("`{key}` had no live lease")))
            };
        }
        // An operator kills the connection that holds the row lock.
        let id = {
            let clients = self.clients.lock().unwrap();
            clients
                .iter()
                .find_map(|c| c.backend.connection_holding(key))
        };
        let id = id.ok_or_else(|| HookError::Failed(format!("no client holds `{key}`")))?;
        self.admin()
            .await
            .kill_connection(id)
            .await
            .map_err(|e| HookError::Failed(e.to_string()))
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
    lockkit_conformance::suite!(super::MysqlHarness::new("row").await);
}

mod for_update {
    lockkit_conformance::suite!(super::MysqlHarness::new("for-update").await);
}

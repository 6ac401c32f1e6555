//! The conformance suite against the private ZooKeeper servers from
//! `scripts/services.sh`: the standalone server and the 3-node ensemble.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use lockkit_conformance::{FaultProxy, Harness, HookError, HookResult, env};
use lockkit_core::{LockBackend, LockKey, Locker, async_trait};
use lockkit_zk::{ZkBackend, path::encode_str};

/// A client's backend (shared, and as itself for its diagnostics) and its proxies, one per
/// server.
type Client = (Arc<dyn LockBackend>, Vec<FaultProxy>, ZkBackend);

struct ZkHarness {
    name: &'static str,
    url: String,
    clients: Mutex<Vec<Client>>,
}

const SESSION: Duration = Duration::from_secs(2);

impl ZkHarness {
    async fn new(name: &'static str, var: &str) -> Option<Self> {
        let url = env::service_url(var)?;
        Some(ZkHarness {
            name,
            url: format!("{url}?session_timeout=2s"),
            clients: Mutex::new(Vec::new()),
        })
    }

    async fn admin(&self) -> ZkBackend {
        ZkBackend::connect(&self.url).await.unwrap()
    }
}

fn hook_error(e: impl std::fmt::Display) -> HookError {
    HookError::Failed(e.to_string())
}

impl ZkHarness {
    /// Runs `f` on the fault proxies in front of `client` (one per server).
    fn with_proxies<T>(
        &self,
        client: &Locker,
        f: impl FnOnce(&[FaultProxy]) -> T,
    ) -> HookResult<T> {
        let clients = self.clients.lock().unwrap();
        let (_, proxies, _) = clients
            .iter()
            .find(|(shared, _, _)| {
                std::ptr::addr_eq(Arc::as_ptr(shared), Arc::as_ptr(client.backend()))
            })
            .ok_or_else(|| HookError::Failed("unknown client".into()))?;
        Ok(f(proxies))
    }
}

#[async_trait]
impl Harness for ZkHarness {
    fn name(&self) -> String {
        self.name.into()
    }

    async fn client(&self) -> Locker {
        // Each client reaches each server through its own fault proxy.
        let mut proxies = Vec::new();
        for server in env::host_ports(&self.url) {
            proxies.push(FaultProxy::start(server.parse().unwrap()).await.unwrap());
        }
        let hosts: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
        let url = format!("zk://{}?session_timeout=2s", hosts.join(","));
        let backend = ZkBackend::connect(&url).await.unwrap();
        let shared: Arc<dyn LockBackend> = Arc::new(backend.clone());
        self.clients
            .lock()
            .unwrap()
            .push((shared.clone(), proxies, backend));
        Locker::from_arc(shared)
    }

    fn short_ttl(&self) -> Duration {
        SESSION
    }

    fn expiry_slack(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn connect(&self, url: &str) -> lockkit_core::Result<Locker> {
        ZkBackend::connect(url).await.map(Locker::new)
    }

    fn malformed_urls(&self) -> Vec<String> {
        [
            "zk://",
            "zk://127.0.0.1:notaport",
            "zk://127.0.0.1:12181,",
            "zk://127.0.0.1:12181/",
            "zk://127.0.0.1:12181?root=relative",
            "zk://127.0.0.1:12181?unknown=1",
            "zk://127.0.0.1:12181?session_timeout=10",
            "zookeeper:/127.0.0.1",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn take_away(&self, key: &LockKey) -> HookResult {
        let admin = self.admin().await;
        let client = admin.client().await.map_err(hook_error)?;
        let dir = admin.lock_dir(key);
        let mut children = client.list_children(&dir).await.map_err(hook_error)?;
        children.sort_by_key(|c| c.rsplit("-lock-").next().unwrap_or_default().to_owned());
        let head = children
            .first()
            .ok_or_else(|| HookError::Failed(format!("`{key}` has no holder")))?;
        client
            .delete(&format!("{dir}/{head}"), None)
            .await
            .map_err(hook_error)
    }

    async fn kill_connection(&self, client: &Locker) -> HookResult {
        // Cut the client off from every server for good: its session expires on the
        // servers, and the client must notice first.
        self.with_proxies(client, |proxies| proxies.iter().for_each(FaultProxy::reset))
    }

    async fn requests_sent(&self, client: &Locker) -> HookResult<u64> {
        self.with_proxies(client, |proxies| {
            proxies.iter().map(FaultProxy::requests_seen).sum()
        })
    }

    async fn watch_wakeups(&self, client: &Locker) -> HookResult<u64> {
        let clients = self.clients.lock().unwrap();
        clients
            .iter()
            .find(|(shared, _, _)| {
                std::ptr::addr_eq(Arc::as_ptr(shared), Arc::as_ptr(client.backend()))
            })
            .map(|(_, _, backend)| backend.watch_wakeups())
            .ok_or_else(|| HookError::Failed("unknown client".into()))
    }

    async fn delay_link(&self, client: &Locker, delay: Duration) -> HookResult {
        self.with_proxies(client, |proxies| {
            proxies.iter().for_each(|p| p.set_delay(delay));
        })
    }

    async fn cut_link(&self, client: &Locker, cut: bool) -> HookResult {
        self.with_proxies(client, |proxies| {
            for proxy in proxies {
                if cut { proxy.cut() } else { proxy.heal() }
            }
        })
    }

    async fn residue(&self, prefix: &str) -> HookResult<usize> {
        let admin = self.admin().await;
        let client = admin.client().await.map_err(hook_error)?;
        let root = &admin.config().root;
        let dirs = match client.list_children(root).await {
            Ok(dirs) => dirs,
            Err(zookeeper_client::Error::NoNode) => return Ok(0),
            Err(e) => return Err(hook_error(e)),
        };
        let encoded = encode_str(prefix);
        let mut contenders = 0;
        for dir in dirs.iter().filter(|d| d.starts_with(&encoded)) {
            match client.list_children(&format!("{root}/{dir}")).await {
                Ok(children) => contenders += children.len(),
                Err(zookeeper_client::Error::NoNode) => {}
                Err(e) => return Err(hook_error(e)),
            }
        }
        Ok(contenders)
    }
}

mod standalone {
    lockkit_conformance::suite!(
        super::ZkHarness::new("zk-standalone", "LOCKKIT_TEST_ZK_URL").await
    );
}

mod ensemble {
    lockkit_conformance::suite!(
        super::ZkHarness::new("zk-ensemble", "LOCKKIT_TEST_ZK_ENSEMBLE_URL").await
    );
}

//! The conformance suite against the private etcd servers from `scripts/services.sh`: the
//! single member and the 3-member cluster.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use etcd_client::{GetOptions, SortOrder, SortTarget};
use lockkit_conformance::{FaultProxy, Harness, HookError, HookResult, env};
use lockkit_core::{LockBackend, LockKey, Locker, async_trait};
use lockkit_etcd::{EtcdBackend, path::encode_str};

/// A client's backend (shared, and as itself for its diagnostics) and its proxies, one per
/// member.
type Client = (Arc<dyn LockBackend>, Vec<FaultProxy>, EtcdBackend);

/// The shortest etcd lease the servers grant (1.5 election timeouts, rounded up).
const SESSION: Duration = Duration::from_secs(2);
const OPTIONS: &str = "session_ttl=2s&connect_timeout=1s";

struct EtcdHarness {
    name: &'static str,
    url: String,
    clients: Mutex<Vec<Client>>,
}

impl EtcdHarness {
    async fn new(name: &'static str, var: &str) -> Option<Self> {
        let url = env::service_url(var)?;
        Some(EtcdHarness {
            name,
            url: format!("{url}?{OPTIONS}"),
            clients: Mutex::new(Vec::new()),
        })
    }

    async fn admin(&self) -> EtcdBackend {
        EtcdBackend::connect(&self.url).await.unwrap()
    }

    /// Runs `f` on the fault proxies in front of `client` (one per member).
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

fn hook_error(e: impl std::fmt::Display) -> HookError {
    HookError::Failed(e.to_string())
}

#[async_trait]
impl Harness for EtcdHarness {
    fn name(&self) -> String {
        self.name.into()
    }

    async fn client(&self) -> Locker {
        // Each client reaches each member through its own fault proxy.
        let mut proxies = Vec::new();
        for member in env::host_ports(&self.url) {
            proxies.push(FaultProxy::start(member.parse().unwrap()).await.unwrap());
        }
        let hosts: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
        let url = format!("etcd://{}?{OPTIONS}", hosts.join(","));
        let backend = EtcdBackend::connect(&url).await.unwrap();
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

    /// The cluster checks lease expiry every 500 ms, and a cut-off holder's last
    /// keep-alive reached it up to a third of the TTL before the cut.
    fn expiry_slack(&self) -> Duration {
        Duration::from_secs(3)
    }

    async fn connect(&self, url: &str) -> lockkit_core::Result<Locker> {
        EtcdBackend::connect(url).await.map(Locker::new)
    }

    fn malformed_urls(&self) -> Vec<String> {
        [
            "etcd://",
            "etcd://127.0.0.1:notaport",
            "etcd://127.0.0.1:12379,",
            "etcd://127.0.0.1:12379/",
            "etcd://127.0.0.1:12379?prefix=relative",
            "etcd://127.0.0.1:12379?unknown=1",
            "etcd://127.0.0.1:12379?session_ttl=10",
            "etcd://127.0.0.1:12379?session_ttl=1500ms",
            "etcd:/127.0.0.1",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn take_away(&self, key: &LockKey) -> HookResult {
        let admin = self.admin().await;
        let mut client = admin.client();
        let first = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let got = client
            .get(admin.lock_range(key), Some(first))
            .await
            .map_err(hook_error)?;
        let head = got
            .kvs()
            .first()
            .ok_or_else(|| HookError::Failed(format!("`{key}` has no holder")))?;
        client
            .delete(head.key().to_vec(), None)
            .await
            .map_err(hook_error)?;
        Ok(())
    }

    async fn kill_connection(&self, client: &Locker) -> HookResult {
        // Cut the client off from every member for good: its leases expire on the cluster,
        // and the client must notice first.
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
        let range = format!("{}/{}", admin.config().prefix, encode_str(prefix));
        let got = admin
            .client()
            .get(
                range,
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .map_err(hook_error)?;
        Ok(usize::try_from(got.count()).unwrap_or(usize::MAX))
    }
}

mod single {
    lockkit_conformance::suite!(
        super::EtcdHarness::new("etcd-single", "LOCKKIT_TEST_ETCD_URL").await
    );
}

mod cluster {
    lockkit_conformance::suite!(
        super::EtcdHarness::new("etcd-cluster", "LOCKKIT_TEST_ETCD_CLUSTER_URL").await
    );
}

//! The conformance suite against the private etcd servers from `scripts/services.sh`: the
//! single member and the 3-member cluster.

use std::{sync::Arc, time::Duration};

use etcd_client::{GetOptions, SortOrder, SortTarget};
use lockkit_conformance::{Harness, HookError, HookResult, ProxiedClients, env};
use lockkit_core::{LockBackend, LockKey, Locker, async_trait};
use lockkit_etcd::{EtcdBackend, path::encode_str};

/// The shortest etcd lease the servers grant (1.5 election timeouts, rounded up).
const SESSION: Duration = Duration::from_secs(2);
const OPTIONS: &str = "session_ttl=2s&connect_timeout=1s";

struct EtcdHarness {
    name: &'static str,
    url: String,
    clients: ProxiedClients<EtcdBackend>,
}

impl EtcdHarness {
    async fn new(name: &'static str, var: &str) -> Option<Self> {
        let url = env::service_url(var)?;
        Some(EtcdHarness {
            name,
            url: format!("{url}?{OPTIONS}"),
            clients: ProxiedClients::default(),
        })
    }

    async fn admin(&self) -> EtcdBackend {
        EtcdBackend::connect(&self.url).await.unwrap()
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
        let (proxies, hosts) =
            ProxiedClients::<EtcdBackend>::start_proxies(&env::host_ports(&self.url)).await;
        let backend = EtcdBackend::connect(&format!("etcd://{hosts}?{OPTIONS}"))
            .await
            .unwrap();
        let shared: Arc<dyn LockBackend> = Arc::new(backend.clone());
        self.clients.add(shared.clone(), proxies, backend);
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
        self.clients.reset(client)
    }

    async fn requests_sent(&self, client: &Locker) -> HookResult<u64> {
        self.clients.requests_sent(client)
    }

    async fn watch_wakeups(&self, client: &Locker) -> HookResult<u64> {
        Ok(self.clients.backend_of(client)?.watch_wakeups())
    }

    async fn delay_link(&self, client: &Locker, delay: Duration) -> HookResult {
        self.clients.delay(client, delay)
    }

    async fn cut_link(&self, client: &Locker, cut: bool) -> HookResult {
        self.clients.cut(client, cut)
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

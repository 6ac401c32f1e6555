//! The conformance suite against the private ZooKeeper servers from
//! `scripts/services.sh`: the standalone server and the 3-node ensemble (Curator's layout,
//! the default), and the standalone server once more with kazoo's layout (`layout=kazoo`).

use std::{sync::Arc, time::Duration};

use lockkit_conformance::{Harness, HookError, HookResult, ProxiedClients, env};
use lockkit_core::{LockBackend, LockKey, Locker, async_trait};
use lockkit_zk::{ZkBackend, path::encode_str};

struct ZkHarness {
    name: &'static str,
    url: String,
    /// The URL options of every client: the session timeout, and the layout.
    options: String,
    clients: ProxiedClients<ZkBackend>,
    /// [`Harness::parallel_cases`].
    parallel_cases: Option<usize>,
    /// The session timeout of every client, and so the short lease of the suite.
    session: Duration,
}

/// The session timeout on the standalone server. A request unanswered for 2/5 of it
/// (800 ms) counts the server as gone.
const SESSION: Duration = Duration::from_secs(2);

/// The session timeout on the ensemble: its three JVMs share the machine's two cores with
/// everything else, and CI still saw one request of its cases unanswered within the 800 ms
/// a 2 s session allows (`a_different_permit_count_is_refused`, with 3 cases at once); 3 s
/// allows 1.2 s.
const ENSEMBLE_SESSION: Duration = Duration::from_secs(3);

/// How many ensemble cases run at once in the test process, whatever `RUST_TEST_THREADS`
/// says. The ensemble's three JVMs share two cores with the standalone server: with 8 or
/// 12 test threads (the ensemble's cases sort first, so that many of them at once) CI saw
/// requests unanswered past the 800 ms the 2 s session allows (`ZooKeeper did not answer
/// within 800ms`, session re-established); with 4 it passed. 3 stays below that; the
/// ensemble's 96 cases take ~66 s at 3 (~51 s at 4, ~96 s at 2, ~31 s unbounded at 8).
const ENSEMBLE_CASES: usize = 3;

impl ZkHarness {
    async fn new(name: &'static str, var: &str) -> Option<Self> {
        Self::with_layout(name, var, "curator").await
    }

    async fn with_layout(name: &'static str, var: &str, layout: &str) -> Option<Self> {
        let url = env::service_url(var)?;
        let options = format!("session_timeout={}s&layout={layout}", SESSION.as_secs());
        Some(ZkHarness {
            name,
            url: format!("{url}?{options}"),
            options,
            clients: ProxiedClients::default(),
            parallel_cases: None,
            session: SESSION,
        })
    }

    /// Clients with this session timeout.
    fn with_session(mut self, session: Duration) -> Self {
        let options = self.options.replace(
            &format!("session_timeout={}s", self.session.as_secs()),
            &format!("session_timeout={}s", session.as_secs()),
        );
        self.url = self.url.replace(&self.options, &options);
        self.options = options;
        self.session = session;
        self
    }

    /// At most `cases` cases of this harness at once in the test process.
    fn bounded(mut self, cases: usize) -> Self {
        self.parallel_cases = Some(cases);
        self
    }

    async fn admin(&self) -> ZkBackend {
        ZkBackend::connect(&self.url).await.unwrap()
    }
}

fn hook_error(e: impl std::fmt::Display) -> HookError {
    HookError::Failed(e.to_string())
}

#[async_trait]
impl Harness for ZkHarness {
    fn name(&self) -> String {
        self.name.into()
    }

    async fn client(&self) -> Locker {
        // Each client reaches each server through its own fault proxy.
        let (proxies, hosts) =
            ProxiedClients::<ZkBackend>::start_proxies(&env::host_ports(&self.url)).await;
        let backend = ZkBackend::connect(&format!("zk://{hosts}?{}", self.options))
            .await
            .unwrap();
        let shared: Arc<dyn LockBackend> = Arc::new(backend.clone());
        self.clients.add(shared.clone(), proxies, backend);
        Locker::from_arc(shared)
    }

    fn parallel_cases(&self) -> Option<usize> {
        self.parallel_cases
    }

    fn short_ttl(&self) -> Duration {
        self.session
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
        // In queue order: by the sequence ZooKeeper appended (the last 10 characters),
        // whatever the layout's prefix.
        children.sort_by_key(|c| c[c.len().saturating_sub(10)..].to_owned());
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
            let dir = format!("{root}/{dir}");
            let children = match client.list_children(&dir).await {
                Ok(children) => children,
                Err(zookeeper_client::Error::NoNode) => continue,
                Err(e) => return Err(hook_error(e)),
            };
            for child in children {
                // A semaphore's containers (which the server removes once empty) count
                // by what is in them: leases, its mutex's nodes, permit registrations.
                if !["leases", "locks", "lockkit-permits"].contains(&child.as_str()) {
                    contenders += 1;
                    continue;
                }
                match client.list_children(&format!("{dir}/{child}")).await {
                    Ok(inside) => contenders += inside.len(),
                    Err(zookeeper_client::Error::NoNode) => {}
                    Err(e) => return Err(hook_error(e)),
                }
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

mod kazoo_layout {
    lockkit_conformance::suite!(
        super::ZkHarness::with_layout("zk-standalone-kazoo", "LOCKKIT_TEST_ZK_URL", "kazoo").await
    );
}

mod ensemble {
    lockkit_conformance::suite!(
        super::ZkHarness::new("zk-ensemble", "LOCKKIT_TEST_ZK_ENSEMBLE_URL")
            .await
            .map(|h| h
                .bounded(super::ENSEMBLE_CASES)
                .with_session(super::ENSEMBLE_SESSION))
    );
}

//! The conformance suite against the private Redis servers from `scripts/services.sh`:
//! a single server (each client behind its own fault proxy) and a 3-master cluster.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use lockkit_conformance::{FaultProxy, Harness, HookError, HookResult, env};
use lockkit_core::{LockBackend, LockKey, Locker, async_trait};
use lockkit_redis::LockNames;
use redis::AsyncCommands;

struct Client {
    backend: Arc<dyn LockBackend>,
    proxies: Vec<FaultProxy>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Single,
    Cluster,
    Redlock,
}

/// Clients on one Redis server or cluster; the admin connection plays the operator.
struct RedisHarness {
    name: &'static str,
    url: String,
    nodes: Vec<String>,
    kind: Kind,
    clients: Mutex<Vec<Client>>,
}

impl RedisHarness {
    async fn single() -> Option<Self> {
        let url = env::service_url("LOCKKIT_TEST_REDIS_URL")?;
        Some(RedisHarness {
            name: "redis-single",
            nodes: env::host_ports(&url),
            url,
            kind: Kind::Single,
            clients: Mutex::new(Vec::new()),
        })
    }

    async fn cluster() -> Option<Self> {
        let url = env::service_url("LOCKKIT_TEST_REDIS_CLUSTER_URL")?;
        Some(RedisHarness {
            name: "redis-cluster",
            nodes: env::host_ports(&url),
            url,
            kind: Kind::Cluster,
            clients: Mutex::new(Vec::new()),
        })
    }

    async fn redlock() -> Option<Self> {
        let url = env::service_url("LOCKKIT_TEST_REDLOCK_URL")?;
        Some(RedisHarness {
            name: "redlock",
            nodes: env::host_ports(&url),
            url,
            kind: Kind::Redlock,
            clients: Mutex::new(Vec::new()),
        })
    }

    async fn admin(&self, node: &str) -> redis::aio::MultiplexedConnection {
        redis::Client::open(format!("redis://{node}"))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    async fn node_of(&self, key: &str) -> String {
        if self.kind != Kind::Cluster {
            return self.nodes[0].clone();
        }
        // Ask any node which one serves the key's slot.
        let mut admin = self.admin(&self.nodes[0]).await;
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut admin)
            .await
            .unwrap();
        let slots: redis::Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut admin)
            .await
            .unwrap();
        let redis::Value::Array(ranges) = slots else {
            panic!("CLUSTER SLOTS: {slots:?}")
        };
        for range in ranges {
            let redis::Value::Array(parts) = range else {
                continue;
            };
            let (redis::Value::Int(lo), redis::Value::Int(hi)) = (&parts[0], &parts[1]) else {
                continue;
            };
            if (*lo..=*hi).contains(&i64::from(slot)) {
                let redis::Value::Array(master) = &parts[2] else {
                    continue;
                };
                let host = match &master[0] {
                    redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                    other => panic!("{other:?}"),
                };
                let redis::Value::Int(port) = master[1] else {
                    continue;
                };
                return format!("{host}:{port}");
            }
        }
        panic!("no node serves slot {slot}");
    }
}

impl RedisHarness {
    /// Runs `f` on the fault proxies in front of `client` (cluster clients have none).
    fn with_proxies<T>(
        &self,
        client: &Locker,
        f: impl FnOnce(&[FaultProxy]) -> T,
    ) -> HookResult<T> {
        let clients = self.clients.lock().unwrap();
        let found = clients
            .iter()
            .find(|c| std::ptr::addr_eq(Arc::as_ptr(&c.backend), Arc::as_ptr(client.backend())))
            .ok_or_else(|| HookError::Failed("unknown client".into()))?;
        if found.proxies.is_empty() {
            return Err(HookError::Unsupported(
                "cluster clients connect to the nodes directly".into(),
            ));
        }
        Ok(f(&found.proxies))
    }
}

#[async_trait]
impl Harness for RedisHarness {
    fn name(&self) -> String {
        self.name.into()
    }

    async fn client(&self) -> Locker {
        // Single and Redlock clients reach each server through their own fault proxy.
        let mut proxies = Vec::new();
        let url = match self.kind {
            Kind::Cluster => self.url.clone(),
            Kind::Single | Kind::Redlock => {
                let mut hosts = Vec::new();
                for node in &self.nodes {
                    let proxy = FaultProxy::start(node.parse::<SocketAddr>().unwrap())
                        .await
                        .unwrap();
                    hosts.push(proxy.local_addr().to_string());
                    proxies.push(proxy);
                }
                let scheme = if self.kind == Kind::Single {
                    "redis"
                } else {
                    "redlock"
                };
                format!("{scheme}://{}", hosts.join(","))
            }
        };
        let backend = lockkit_redis::connect(&url).await.unwrap();
        self.clients.lock().unwrap().push(Client {
            backend: backend.clone(),
            proxies,
        });
        Locker::from_arc(backend)
    }

    fn short_ttl(&self) -> Duration {
        Duration::from_millis(400)
    }

    async fn connect(&self, url: &str) -> lockkit_core::Result<Locker> {
        lockkit_redis::connect(url).await.map(Locker::from_arc)
    }

    fn malformed_urls(&self) -> Vec<String> {
        [
            "redis://",
            "redis://127.0.0.1:notaport",
            "redis://127.0.0.1:1,127.0.0.1:2",
            "redis://127.0.0.1/notadb",
            "redis://127.0.0.1?unknown=1",
            "redis://127.0.0.1?ttl=30",
            "redis+cluster://127.0.0.1:1/5",
            "redlock://127.0.0.1:1,127.0.0.1:2",
            "rediz://127.0.0.1",
            "127.0.0.1:6379",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn take_away(&self, key: &LockKey) -> HookResult {
        let name = LockNames::new("", key, self.kind == Kind::Cluster)
            .unwrap()
            .lock;
        let nodes = match self.kind {
            Kind::Redlock => self.nodes.clone(),
            _ => vec![self.node_of(&name).await],
        };
        let mut deleted = 0;
        for node in nodes {
            let n: i64 = self
                .admin(&node)
                .await
                .del(&name)
                .await
                .map_err(|e| HookError::Failed(e.to_string()))?;
            deleted += n;
        }
        if deleted > 0 {
            Ok(())
        } else {
            Err(HookError::Failed(format!("`{name}` was not there")))
        }
    }

    async fn requests_sent(&self, client: &Locker) -> HookResult<u64> {
        self.with_proxies(client, |proxies| {
            proxies.iter().map(FaultProxy::requests_seen).sum()
        })
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

    async fn kill_connection(&self, client: &Locker) -> HookResult {
        let clients = self.clients.lock().unwrap();
        let found = clients
            .iter()
            .find(|c| std::ptr::addr_eq(Arc::as_ptr(&c.backend), Arc::as_ptr(client.backend())))
            .ok_or_else(|| HookError::Failed("unknown client".into()))?;
        if found.proxies.is_empty() {
            return Err(HookError::Unsupported(
                "cluster clients connect to the nodes directly".into(),
            ));
        }
        // Close its connections and refuse new ones: the client is cut off for good.
        for proxy in &found.proxies {
            proxy.reset();
        }
        Ok(())
    }

    async fn residue(&self, prefix: &str) -> HookResult<usize> {
        let mut total = 0;
        for node in &self.nodes {
            let mut admin = self.admin(node).await;
            let keys: Vec<String> = admin
                .keys(format!("{prefix}*"))
                .await
                .map_err(|e| HookError::Failed(e.to_string()))?;
            let channels: Vec<String> = redis::cmd("PUBSUB")
                .arg("CHANNELS")
                .arg(format!("redisson_lock__channel:{{{prefix}*"))
                .query_async(&mut admin)
                .await
                .map_err(|e| HookError::Failed(e.to_string()))?;
            total += keys.len() + channels.len();
        }
        Ok(total)
    }
}

mod single {
    lockkit_conformance::suite!(super::RedisHarness::single().await);
}

mod cluster {
    lockkit_conformance::suite!(super::RedisHarness::cluster().await);
}

mod redlock {
    lockkit_conformance::suite!(super::RedisHarness::redlock().await);
}

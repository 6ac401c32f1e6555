//! The private servers from `scripts/services.sh` answer their own protocols. In CI a
//! missing address is a failure; elsewhere these tests skip loudly.

use std::time::Duration;

use lockkit_conformance::env::{host_ports, service_url};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

async fn exchange(addr: &str, send: &[u8], read_at_least: usize) -> Vec<u8> {
    let attempt = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(send).await?;
        let mut got = Vec::new();
        let mut buf = [0u8; 512];
        while got.len() < read_at_least {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        std::io::Result::Ok(got)
    };
    tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .unwrap_or_else(|_| panic!("{addr} did not answer within 10 s"))
        .unwrap_or_else(|e| panic!("{addr}: {e}"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn check_redis(var: &str, expected_nodes: usize) {
    let Some(url) = service_url(var) else { return };
    let nodes = host_ports(&url);
    assert_eq!(nodes.len(), expected_nodes, "{var}={url}");
    runtime().block_on(async {
        for node in nodes {
            let reply = exchange(&node, b"PING\r\n", 7).await;
            assert_eq!(reply, b"+PONG\r\n", "{node} is not a Redis server");
        }
    });
}

fn check_zookeeper(var: &str, expected_nodes: usize) {
    let Some(url) = service_url(var) else { return };
    let nodes = host_ports(&url);
    assert_eq!(nodes.len(), expected_nodes, "{var}={url}");
    runtime().block_on(async {
        for node in nodes {
            let reply = exchange(&node, b"ruok", 4).await;
            assert_eq!(reply, b"imok", "{node} is not a healthy ZooKeeper server");
        }
    });
}

#[test]
fn redis_single_answers() {
    check_redis("LOCKKIT_TEST_REDIS_URL", 1);
}

#[test]
fn redlock_masters_answer() {
    check_redis("LOCKKIT_TEST_REDLOCK_URL", 5);
}

#[test]
fn redis_cluster_is_formed() {
    let Some(url) = service_url("LOCKKIT_TEST_REDIS_CLUSTER_URL") else {
        return;
    };
    let nodes = host_ports(&url);
    assert_eq!(nodes.len(), 3);
    runtime().block_on(async {
        for node in nodes {
            let reply = exchange(&node, b"CLUSTER INFO\r\n", 64).await;
            let text = String::from_utf8_lossy(&reply);
            assert!(text.contains("cluster_state:ok"), "{node}: {text}");
        }
    });
}

#[test]
fn postgres_answers_an_ssl_request() {
    let Some(url) = service_url("LOCKKIT_TEST_POSTGRES_URL") else {
        return;
    };
    let nodes = host_ports(&url);
    assert_eq!(nodes.len(), 1);
    runtime().block_on(async {
        // SSLRequest (length 8, code 80877103): a PostgreSQL server answers one byte, `N`
        // (no TLS here) or `S`.
        let answer = exchange(&nodes[0], &[0, 0, 0, 8, 4, 210, 22, 47], 1).await;
        assert_eq!(answer, b"N", "{} is not a PostgreSQL server", nodes[0]);
    });
}

#[test]
fn mariadb_greets() {
    let Some(url) = service_url("LOCKKIT_TEST_MYSQL_URL") else {
        return;
    };
    let nodes = host_ports(&url);
    assert_eq!(nodes.len(), 1);
    runtime().block_on(async {
        // The server speaks first: a handshake packet, protocol version 10.
        let greeting = exchange(&nodes[0], b"", 5).await;
        assert_eq!(
            greeting.get(4),
            Some(&10),
            "{} is not a MySQL server",
            nodes[0]
        );
        assert!(String::from_utf8_lossy(&greeting).contains("MariaDB"));
    });
}

#[test]
fn zookeeper_standalone_answers() {
    check_zookeeper("LOCKKIT_TEST_ZK_URL", 1);
}

#[test]
fn zookeeper_ensemble_has_a_leader() {
    check_zookeeper("LOCKKIT_TEST_ZK_ENSEMBLE_URL", 3);
    let Some(url) = service_url("LOCKKIT_TEST_ZK_ENSEMBLE_URL") else {
        return;
    };
    runtime().block_on(async {
        let mut modes = Vec::new();
        for node in host_ports(&url) {
            let reply = exchange(&node, b"srvr", 200).await;
            let text = String::from_utf8_lossy(&reply).into_owned();
            let mode = text
                .lines()
                .find_map(|l| l.strip_prefix("Mode: "))
                .unwrap_or_else(|| panic!("{node}: no mode in {text}"))
                .to_owned();
            modes.push(mode);
        }
        modes.sort();
        assert_eq!(modes, ["follower", "follower", "leader"]);
    });
}

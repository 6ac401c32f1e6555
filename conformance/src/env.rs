//! Where the private test servers are: `LOCKKIT_TEST_*` variables from
//! `scripts/services.sh env`.

use std::io::Write;

/// True when running in CI (`CI=true` or `CI=1`): a missing server is then a failure.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The URL in `var`, e.g. `LOCKKIT_TEST_REDIS_URL`.
///
/// When it is unset: in CI this panics (the test fails, naming the fix); elsewhere it
/// prints a loud SKIP line to the real stderr (not captured by the test harness) and
/// returns `None`.
pub fn service_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if in_ci() => panic!(
            "{var} is not set but CI=true: a missing test server is a failure in CI. \
             Run `scripts/services.sh up` and `eval \"$(scripts/services.sh env)\"`."
        ),
        _ => {
            let _ = writeln!(
                std::io::stderr(),
                "lockkit: SKIPPED, {var} is not set; run `scripts/services.sh up` and \
                 `eval \"$(scripts/services.sh env)\"` to test against a real server"
            );
            None
        }
    }
}

/// Splits a `scheme://h1:p1,h2:p2/...` URL into its `host:port` parts.
pub fn host_ports(url: &str) -> Vec<String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The mode (`leader`, `follower`, `standalone`) a ZooKeeper server reports via `srvr`.
pub async fn zk_mode(addr: &str) -> Option<String> {
    let talk = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        tokio::io::AsyncWriteExt::write_all(&mut stream, b"srvr")
            .await
            .ok()?;
        let mut text = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stream, &mut text)
            .await
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("Mode: "))
            .map(|m| m.trim().to_owned())
    };
    tokio::time::timeout(std::time::Duration::from_secs(3), talk)
        .await
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_hosts() {
        assert_eq!(
            host_ports("redlock://127.0.0.1:1,127.0.0.1:2"),
            vec!["127.0.0.1:1", "127.0.0.1:2"]
        );
        assert_eq!(
            host_ports("mysql://u:p@127.0.0.1:3306/db?x=1"),
            vec!["127.0.0.1:3306"]
        );
        assert_eq!(host_ports("zk://a:1,b:2/chroot"), vec!["a:1", "b:2"]);
    }
}

//! The TCP settings of every connection to Redis: no Nagle delay, and a peer that stops
//! answering at the TCP level is noticed (see [`crate::RedisConfig::keepalive`]).

use std::{io, time::Duration};

use redis::io::tcp::{TcpSettings, socket2};

/// Keepalive probes sent before an idle connection is given up.
const PROBES: u32 = 3;

/// The settings for connections that give up on a silent peer after about `keepalive`:
/// idle for a third of it, then [`PROBES`] probes a sixth of it apart (at least a second
/// each, as the kernel counts them); and data left unacknowledged for `keepalive` fails
/// the connection.
pub(crate) fn settings(keepalive: Duration) -> TcpSettings {
    let whole_seconds = |d: Duration| Duration::from_secs(d.as_secs().max(1));
    let probes = socket2::TcpKeepalive::new()
        .with_time(whole_seconds(keepalive / 3))
        .with_interval(whole_seconds(keepalive / 6))
        .with_retries(PROBES);
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(probes)
        .set_user_timeout(keepalive)
}

/// A client of the server `url` names, whose connections use [`settings`].
pub(crate) fn client(url: &str, keepalive: Duration) -> redis::RedisResult<redis::Client> {
    use redis::IntoConnectionInfo;
    let info = url
        .into_connection_info()?
        .set_tcp_settings(settings(keepalive));
    redis::Client::open(info)
}

/// Applies `settings` to a stream opened by hand, but for the user timeout: a command line
/// of [`crate::conn::direct`] must not be given up while its server is only stopped, and
/// on Linux (5.11 on) the user timeout also gives up a line whose data waits behind a full
/// receive window, which a stopped server's kernel announces once requests fill its
/// buffer: the requests not yet taken in were lost, and the line's order with them
/// (helper-44's finding 1). The line's owner asks [`retransmissions`] instead. Idle, the
/// keepalive probes still give the line up (a stopped server's kernel answers them).
pub(crate) fn apply(stream: &tokio::net::TcpStream, settings: &TcpSettings) -> io::Result<()> {
    stream.set_nodelay(settings.nodelay())?;
    let socket = socket2::SockRef::from(stream);
    if let Some(probes) = settings.keepalive() {
        socket.set_tcp_keepalive(probes)?;
    }
    socket.set_tcp_user_timeout(None)
}

/// How many times in a row the kernel has sent data to `stream`'s peer again for want of
/// its acknowledgement, while it does: `None` when it does not (everything sent was
/// acknowledged; a peer that announces a zero window, as a stopped server's kernel does once
/// its buffer is full, is probed, not retransmitted to), or when it cannot be told (not
/// Linux). Read from `/proc/net/tcp` (and `tcp6`): the retransmission timer (`tr` 1) and
/// `retrnsmt` of the row whose inode is `stream`'s socket's. Not by its ports: another
/// connection may have the same two ports (the same local port towards another address),
/// and its row may come first (helper-45's finding 2).
pub(crate) fn retransmissions(stream: &tokio::net::TcpStream) -> Option<u32> {
    use std::os::fd::AsRawFd;
    // `socket:[<inode>]`
    let link = std::fs::read_link(format!("/proc/self/fd/{}", stream.as_raw_fd())).ok()?;
    let inode = link
        .to_str()?
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .to_owned();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid
            // timeout inode ...
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(timer), Some(count), Some(row_inode)) =
                (fields.get(5), fields.get(6), fields.get(9))
            else {
                continue;
            };
            if *row_inode == inode {
                let retransmitting = timer.split(':').next() == Some("01");
                let count = u32::from_str_radix(count, 16).ok()?;
                return (retransmitting && count > 0).then_some(count);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stream_gets_the_keepalive_and_the_user_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        apply(&stream, &settings(Duration::from_secs(30))).unwrap();
        let socket = socket2::SockRef::from(&stream);
        assert!(socket.keepalive().unwrap());
        assert_eq!(
            socket.tcp_keepalive_time().unwrap(),
            Duration::from_secs(10)
        );
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), PROBES);
        // Not on a line opened by hand (see `apply`): its owner asks `retransmissions`.
        assert_eq!(socket.tcp_user_timeout().unwrap(), None);
        assert_eq!(retransmissions(&stream), None, "nothing unacknowledged");
        assert!(socket.tcp_nodelay().unwrap());
        // The shortest keepalive still probes whole seconds apart.
        apply(&stream, &settings(crate::MIN_KEEPALIVE)).unwrap();
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(1)
        );
    }

    /// Two connections may share both ports: one local port (connections to different
    /// addresses may be given the same one, as Redlock's masters on one port of several
    /// hosts may be) and the server's port. Only the silent one is retransmitting; the other
    /// must not be taken for it (given up although it answers), nor hide it (a silent line
    /// kept until the kernel gives it up, about 15 minutes).
    ///
    /// Finding 2 (helper-45): `retransmissions` matched the rows of `/proc/net/tcp` by the
    /// two ports only and read the first such row, whichever connection it was.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_silent_one_of_two_lines_with_the_same_ports_retransmits() {
        use std::process::Command;
        let nft = "/usr/sbin/nft";
        if !Command::new(nft)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            assert!(
                std::env::var("CI").is_err(),
                "nft is missing but CI is set: run `scripts/services.sh up`"
            );
            eprintln!("lockkit: SKIPPED, `nft` is missing (Debian nftables; run as root)");
            return;
        }
        let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let connect = |local: std::net::SocketAddr, to: &str| {
            let socket = socket2::Socket::new(
                socket2::Domain::IPV4,
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )
            .unwrap();
            socket.set_reuse_address(true).unwrap();
            socket.bind(&local.into()).unwrap();
            let to: std::net::SocketAddr = format!("{to}:{port}").parse().unwrap();
            socket.connect(&to.into()).unwrap();
            let stream = std::net::TcpStream::from(socket);
            stream.set_nonblocking(true).unwrap();
            tokio::net::TcpStream::from_std(stream).unwrap()
        };
        let answering = connect("127.0.0.1:0".parse().unwrap(), "127.0.0.1");
        let silent = connect(answering.local_addr().unwrap(), "127.0.0.2");
        assert_eq!(
            silent.local_addr().unwrap(),
            answering.local_addr().unwrap()
        );
        let table = format!("lockkit_review45_{}_{port}", std::process::id());
        let rules = format!(
            "table inet {table} {{\n  chain input {{\n    type filter hook input priority -10; \
             policy accept;\n    iifname \"lo\" ip daddr 127.0.0.2 tcp dport {port} drop\n  }}\n}}\n"
        );
        let added = Command::new(nft)
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                child.stdin.take().unwrap().write_all(rules.as_bytes())?;
                child.wait_with_output()
            })
            .unwrap();
        assert!(added.status.success(), "{added:?}");
        struct Table(String);
        impl Drop for Table {
            fn drop(&mut self) {
                let _ = std::process::Command::new("/usr/sbin/nft")
                    .args(["delete", "table", "inet", &self.0])
                    .output();
            }
        }
        let _table = Table(table);
        silent.try_write(b"PING\r\n").unwrap();
        answering.try_write(b"PING\r\n").unwrap();
        // Past the first retransmissions (200 ms, then 400 ms).
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(retransmissions(&answering), None, "everything acknowledged");
        assert!(
            retransmissions(&silent).is_some_and(|count| count >= 2),
            "{:?}",
            retransmissions(&silent)
        );
    }
}

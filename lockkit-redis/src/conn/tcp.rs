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
/// `retrnsmt`.
pub(crate) fn retransmissions(stream: &tokio::net::TcpStream) -> Option<u32> {
    let local = stream.local_addr().ok()?.port();
    let remote = stream.peer_addr().ok()?.port();
    let port_is = |address: &str, port: u16| {
        address
            .rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
            == Some(port)
    };
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt ...
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(from), Some(to), Some(timer), Some(count)) =
                (fields.get(1), fields.get(2), fields.get(5), fields.get(6))
            else {
                continue;
            };
            if port_is(from, local) && port_is(to, remote) {
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
}

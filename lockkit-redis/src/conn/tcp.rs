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

/// Applies `settings` to a stream opened by hand.
pub(crate) fn apply(stream: &tokio::net::TcpStream, settings: &TcpSettings) -> io::Result<()> {
    stream.set_nodelay(settings.nodelay())?;
    let socket = socket2::SockRef::from(stream);
    if let Some(probes) = settings.keepalive() {
        socket.set_tcp_keepalive(probes)?;
    }
    socket.set_tcp_user_timeout(settings.user_timeout())
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
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(30))
        );
        assert!(socket.tcp_nodelay().unwrap());
        // The shortest keepalive still probes whole seconds apart.
        apply(&stream, &settings(crate::MIN_KEEPALIVE)).unwrap();
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(1)
        );
    }
}

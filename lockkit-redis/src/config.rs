//! Redis URLs: `redis://`, `rediss://`, `redis+cluster://`, `redlock://`.

use std::time::Duration;

use lockkit_core::{
    Error, Result,
    config::{LockUrl, parse_count, parse_duration},
};

/// How the backend reaches Redis. Its `Debug` output hides passwords.
#[derive(Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server (or a primary with replicas behind it).
    Single(String),
    /// A Redis Cluster, given by some of its nodes.
    Cluster(Vec<String>),
    /// Independent masters for Redlock.
    Redlock(Vec<String>),
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |urls: &[String]| -> Vec<String> {
            urls.iter()
                .map(|u| lockkit_core::config::redact_url(u))
                .collect()
        };
        match self {
            Topology::Single(url) => f
                .debug_tuple("Single")
                .field(&lockkit_core::config::redact_url(url))
                .finish(),
            Topology::Cluster(urls) => f.debug_tuple("Cluster").field(&redact(urls)).finish(),
            Topology::Redlock(urls) => f.debug_tuple("Redlock").field(&redact(urls)).finish(),
        }
    }
}

/// Everything a Redis URL says.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// Servers, as `redis://` connection URLs for the `redis` crate.
    pub topology: Topology,
    /// Prepended to every lock name (`?prefix=`); default empty, as Redisson.
    pub prefix: String,
    /// `?ttl=`: the default lease of locks taken through this URL (the facade applies it).
    pub ttl: Option<Duration>,
    /// Connection timeout (`?connect_timeout=`, default 2 s).
    pub connect_timeout: Duration,
    /// Per-command response timeout (`?response_timeout=`, default 2 s).
    pub response_timeout: Duration,
    /// Replicas that must confirm a grant with `WAIT` (`?wait_replicas=`, default 0).
    pub wait_replicas: u32,
    /// How long `WAIT` may take (`?wait_replicas_timeout=`, default 1 s).
    pub wait_replicas_timeout: Duration,
    /// Redlock only: how long one master may take to answer one round
    /// (`?node_timeout=`; default a twentieth of the lease, within 10..=100 ms).
    pub node_timeout: Option<Duration>,
    /// `?keepalive=` (default 30 s, 2 s to about 27 hours, [`MAX_KEEPALIVE`]): a connection
    /// whose peer stops answering at the TCP level (its host gone, or a NAT or load balancer
    /// that forgot the connection, which sends nothing back) is given up after about this
    /// long and replaced. The kernel probes an idle connection (keepalive); a plain-TCP
    /// command line is given up when nothing came from the server for this long while the
    /// kernel sends it data again for want of acknowledgements, and redis-rs's own
    /// connections (TLS, RESP3, `wait_replicas`' grant connections, cluster, subscriber) when
    /// data stays unacknowledged this long (`TCP_USER_TIMEOUT`). A server that is only slow,
    /// or stopped, keeps its plain-TCP command lines, with the order of the requests on them,
    /// even once they fill its receive buffer; on redis-rs's connections the user timeout
    /// then gives the line up, and the requests not yet taken in are lost (helper-44's
    /// finding 1). Without it, such a
    /// connection failed every command by its response timeout for as long as the kernel
    /// kept retransmitting (about 15 minutes on Linux), and an idle subscriber never
    /// noticed: waiters heard no release.
    pub keepalive: Duration,
}

impl Default for RedisConfig {
    /// `redis://127.0.0.1:6379/0` with every option at its default.
    fn default() -> Self {
        RedisConfig {
            topology: Topology::Single("redis://127.0.0.1:6379/0".into()),
            prefix: String::new(),
            ttl: None,
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(2),
            wait_replicas: 0,
            wait_replicas_timeout: Duration::from_secs(1),
            node_timeout: None,
            keepalive: DEFAULT_KEEPALIVE,
        }
    }
}

/// The longest timeout a Redis URL (or a [`RedisConfig`] given to a backend) may set:
/// `i32::MAX` ms, about 24.8 days (as ZooKeeper's URLs). Two of them added (the grant
/// connections wait for the response timeout plus `WAIT`'s) stay far from overflowing, and
/// `WAIT` takes its milliseconds.
pub const MAX_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// [`RedisConfig::keepalive`]'s default.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(30);

/// The shortest [`RedisConfig::keepalive`]: keepalive probes are counted in whole seconds.
pub const MIN_KEEPALIVE: Duration = Duration::from_secs(2);

/// The longest [`RedisConfig::keepalive`], about 27.3 hours: a connection is idle for a
/// third of it before the first probe, and Linux takes at most 32,767 s for that
/// (`TCP_KEEPIDLE`; a longer one fails every connection with `EINVAL`).
pub const MAX_KEEPALIVE: Duration = Duration::from_secs(3 * 32_767);

/// Every URL scheme this crate accepts: a server, a cluster or Redlock masters, each
/// also over TLS.
pub const SCHEMES: &[&str] = &[
    "redis",
    "rediss",
    "redis+cluster",
    "rediss+cluster",
    "redlock",
    "redlocks",
];

/// [`SCHEMES`] as a message lists them.
fn schemes_listed() -> String {
    SCHEMES
        .iter()
        .map(|s| format!("{s}://"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl RedisConfig {
    /// Parses a lockkit Redis URL.
    ///
    /// ```text
    /// redis://[user:password@]host[:port][/db][?prefix=app:&ttl=30s&wait_replicas=1]
    /// rediss://...                                        (TLS)
    /// redis+cluster://h1:p1,h2:p2,h3:p3[?prefix=...]
    /// redlock://h1:p1,h2:p2,h3:p3,h4:p4,h5:p5[?node_timeout=50ms]
    /// ```
    ///
    /// # Errors
    /// [`Error::Config`] naming what is wrong and the accepted form.
    pub fn parse(url: &str) -> Result<Self> {
        // Messages show the URL without its password.
        let shown = lockkit_core::config::redact_url(url);
        let (scheme, _) = url.split_once("://").ok_or_else(|| {
            Error::Config(format!(
                "`{shown}` is not a URL; expected one of {}",
                schemes_listed()
            ))
        })?;
        let (tls, kind) = match scheme {
            "redis" => (false, "single"),
            "rediss" => (true, "single"),
            "redis+cluster" => (false, "cluster"),
            "rediss+cluster" => (true, "cluster"),
            "redlock" => (false, "redlock"),
            "redlocks" => (true, "redlock"),
            other => {
                return Err(Error::Config(format!(
                    "`{other}` is not a Redis scheme; expected one of {}",
                    schemes_listed()
                )));
            }
        };
        let form = format!("`{scheme}://127.0.0.1:6379`");
        let parts = LockUrl::parse(url, SCHEMES, &form)?;
        parts.require_hosts(&form)?;
        let userinfo = parts.userinfo.as_deref();
        let hosts: Vec<&str> = parts.hosts.iter().map(String::as_str).collect();
        let path = parts.path.as_deref().unwrap_or("");
        let db = match path {
            "" => None,
            db => Some(db.parse::<u32>().map_err(|_| {
                Error::Config(format!(
                    "`/{db}` in `{shown}` is not a database number; write e.g. `/0` or nothing"
                ))
            })?),
        };
        if kind != "single" && db.is_some_and(|db| db != 0) {
            return Err(Error::Config(format!(
                "`{shown}`: {kind} mode has only database 0"
            )));
        }
        if kind == "single" && hosts.len() != 1 {
            return Err(Error::Config(format!(
                "`{shown}` names {} hosts; a single server takes one (use redis+cluster:// or redlock:// for several)",
                hosts.len()
            )));
        }
        let mut nodes = Vec::new();
        for host in &hosts {
            nodes.push(node_url(&shown, tls, userinfo, host, db.unwrap_or(0))?);
        }
        let mut config = RedisConfig {
            topology: match kind {
                "single" => Topology::Single(nodes.remove(0)),
                "cluster" => Topology::Cluster(nodes),
                _ => {
                    if nodes.len() < 3 {
                        return Err(Error::Config(format!(
                            "`{shown}` names {} masters; Redlock needs at least 3 independent masters (5 is usual)",
                            nodes.len()
                        )));
                    }
                    Topology::Redlock(nodes)
                }
            },
            ..RedisConfig::default()
        };
        for option in &parts.options {
            let (name, value) = (option.name.as_str(), option.value.as_str());
            match name {
                "prefix" => config.prefix = value.to_owned(),
                "ttl" => config.ttl = Some(parse_duration(name, value)?),
                "connect_timeout" => config.connect_timeout = parse_duration(name, value)?,
                "response_timeout" => config.response_timeout = parse_duration(name, value)?,
                "wait_replicas" => config.wait_replicas = parse_count(name, value)?,
                "wait_replicas_timeout" => {
                    config.wait_replicas_timeout = parse_duration(name, value)?;
                }
                "node_timeout" => config.node_timeout = Some(parse_duration(name, value)?),
                "keepalive" => config.keepalive = parse_duration(name, value)?,
                _ => {
                    return Err(parts.unknown_option(
                        option,
                        "prefix, ttl, connect_timeout, response_timeout, wait_replicas, \
                         wait_replicas_timeout, node_timeout, keepalive",
                    ));
                }
            }
        }
        config.check_timeouts()?;
        if config.wait_replicas > 0 && !matches!(config.topology, Topology::Single(_)) {
            return Err(Error::Config(
                "`wait_replicas` applies to a single primary with replicas (redis://)".into(),
            ));
        }
        Ok(config)
    }
}

impl RedisConfig {
    /// Refuses a timeout under a millisecond or above [`MAX_TIMEOUT`]: with a zero
    /// `response_timeout` every script would be sent, run (and grant) on the server, and its
    /// answer given up on before it could come; `connect_timeout=0` could never connect; a
    /// zero `WAIT` timeout would block a grant connection for good; and two huge ones
    /// overflowed when added (a panic in the caller).
    ///
    /// # Errors
    /// [`Error::Config`] naming the option.
    pub(crate) fn check_timeouts(&self) -> Result<()> {
        let timeouts = [
            ("connect_timeout", Some(self.connect_timeout)),
            ("response_timeout", Some(self.response_timeout)),
            ("wait_replicas_timeout", Some(self.wait_replicas_timeout)),
            ("node_timeout", self.node_timeout),
        ];
        for (name, timeout) in timeouts {
            let Some(timeout) = timeout else { continue };
            if timeout < Duration::from_millis(1) || timeout > MAX_TIMEOUT {
                return Err(Error::Config(format!(
                    "`{name}` of {timeout:?} is out of range: give 1ms to {MAX_TIMEOUT:?} \
                     (e.g. {name}=2s)"
                )));
            }
        }
        if self.keepalive < MIN_KEEPALIVE || self.keepalive > MAX_KEEPALIVE {
            return Err(Error::Config(format!(
                "`keepalive` of {:?} is out of range: give {MIN_KEEPALIVE:?} to {MAX_KEEPALIVE:?} \
                 (e.g. keepalive=30s)",
                self.keepalive
            )));
        }
        Ok(())
    }
}

fn node_url(shown: &str, tls: bool, userinfo: Option<&str>, host: &str, db: u32) -> Result<String> {
    let (name, port) = match host.rsplit_once(':') {
        Some((name, port)) if !name.ends_with(']') || host.starts_with('[') => {
            let port: u16 = port.parse().map_err(|_| {
                Error::Config(format!(
                    "`{host}` in `{shown}` has a bad port; write host:port"
                ))
            })?;
            (name, port)
        }
        _ => (host, 6379),
    };
    if name.is_empty() {
        return Err(Error::Config(format!("`{shown}` names an empty host")));
    }
    let scheme = if tls { "rediss" } else { "redis" };
    let auth = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
    Ok(format!("{scheme}://{auth}{name}:{port}/{db}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_local_server_with_default_options() {
        assert_eq!(
            RedisConfig::default(),
            RedisConfig::parse("redis://127.0.0.1:6379").unwrap()
        );
    }

    #[test]
    fn parses_each_form() {
        let c = RedisConfig::parse("redis://127.0.0.1:16379/2?prefix=app%3A&ttl=5s").unwrap();
        assert_eq!(
            c.topology,
            Topology::Single("redis://127.0.0.1:16379/2".into())
        );
        assert_eq!(
            (c.prefix.as_str(), c.ttl),
            ("app:", Some(Duration::from_secs(5)))
        );
        let c = RedisConfig::parse("redis+cluster://a:1,b:2,c:3").unwrap();
        assert_eq!(
            c.topology,
            Topology::Cluster(vec![
                "redis://a:1/0".into(),
                "redis://b:2/0".into(),
                "redis://c:3/0".into()
            ])
        );
        let c = RedisConfig::parse("redlock://u:p@a:1,b:2,c:3").unwrap();
        assert!(matches!(c.topology, Topology::Redlock(ref n) if n[0] == "redis://u:p@a:1/0"));
        assert!(RedisConfig::parse("redis://localhost").is_ok());
        let c = RedisConfig::parse("redlock://a:1,b:2,c:3?keepalive=5s").unwrap();
        assert_eq!(c.keepalive, Duration::from_secs(5));
    }

    #[test]
    fn refuses_bad_urls() {
        for bad in [
            "",
            "localhost:6379",
            "http://x",
            "redis://",
            "redis://a:1,b:2",
            "redis://a:notaport",
            "redis://a/x",
            "redis://a?bogus=1",
            "redis://a?ttl=5",
            "redlock://a:1,b:2",
            "redis+cluster://a:1/3",
            "redis+cluster://a:1?wait_replicas=1",
            "redis://a?response_timeout=0s",
            "redis://a?connect_timeout=0ms",
            "redis://a?wait_replicas=1&wait_replicas_timeout=0s",
            "redis://a?response_timeout=0.5ms",
            "redis://a?response_timeout=600h",
            "redlock://a:1,b:2,c:3?node_timeout=0s",
            "redis://a?keepalive=1s",
            "redis://a?keepalive=0s",
            "redis://a?keepalive=600h",
            "redis://a?keepalive=27.4h",
        ] {
            assert!(
                matches!(RedisConfig::parse(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }
}

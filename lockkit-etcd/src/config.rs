//! etcd URLs: `etcd://h1:2379,h2,h3?prefix=/lockkit&session_ttl=10s&connect_timeout=5s&ttl=30s`.

use std::time::Duration;

use lockkit_core::{
    Error, Result,
    config::{LockUrl, parse_duration},
};

/// Everything an etcd URL says.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// The members to talk to, as `http://host:port` (port 2379 when the URL names none).
    pub endpoints: Vec<String>,
    /// `?prefix=` (default `/lockkit`): each lock is the range `<prefix>/<key>/`, its
    /// contenders the keys in it.
    pub prefix: String,
    /// `?session_ttl=` (default 10 s, whole seconds): the TTL of the etcd lease behind each
    /// contender. A dead, paused or cut-off holder's key is deleted by the cluster this long
    /// after its last keep-alive, so it is also the shortest lease accepted.
    pub session_ttl: Duration,
    /// `?connect_timeout=` (default 5 s): how long connecting, and any one request, may
    /// stay unanswered.
    pub connect_timeout: Duration,
    /// `?ttl=`: the default lease of locks taken through this URL (the facade applies it),
    /// as on every backend.
    pub ttl: Option<Duration>,
}

impl Default for EtcdConfig {
    /// `etcd://127.0.0.1:2379` with every option at its default.
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            prefix: "/lockkit".into(),
            session_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            ttl: None,
        }
    }
}

/// Every URL scheme this crate accepts.
pub const SCHEMES: &[&str] = &["etcd"];

const FORM: &str = "etcd://host[:port][,host[:port]...][?prefix=/lockkit&session_ttl=10s]";

/// `prefix` as given, if it is an absolute path without a trailing slash.
fn checked_prefix(value: &str) -> Result<String> {
    if !value.starts_with('/') || value.len() < 2 || value.ends_with('/') {
        return Err(Error::Config(format!(
            "`prefix={value}` must be an absolute path without a trailing slash, like /lockkit"
        )));
    }
    Ok(value.to_owned())
}

impl EtcdConfig {
    /// Parses a lockkit etcd URL.
    ///
    /// # Errors
    /// [`Error::Config`] saying what is wrong and what is accepted.
    pub fn parse(url: &str) -> Result<Self> {
        let parts = LockUrl::parse(url, SCHEMES, FORM)?;
        parts.require_hosts(FORM)?;
        let shown = parts.shown.as_str();
        if parts.userinfo.is_some() {
            return Err(Error::Config(format!(
                "`{shown}` names a user; lockkit does not support etcd authentication yet: \
                 write {FORM}"
            )));
        }
        if parts.path.is_some() {
            return Err(Error::Config(format!(
                "`{shown}` has a path; etcd URLs take none (set the key prefix with \
                 `?prefix=`): write {FORM}"
            )));
        }
        let mut endpoints = Vec::new();
        for host in &parts.hosts {
            let (name, port) = match host.rsplit_once(':') {
                Some((name, port)) => (
                    name,
                    port.parse::<u16>().map_err(|_| {
                        Error::Config(format!("`{host}` in `{shown}` has a bad port"))
                    })?,
                ),
                None => (host.as_str(), 2379),
            };
            if name.is_empty() {
                return Err(Error::Config(format!(
                    "`{host}` in `{shown}` names no host; write {FORM}"
                )));
            }
            endpoints.push(format!("http://{name}:{port}"));
        }
        let mut config = EtcdConfig {
            endpoints,
            ..EtcdConfig::default()
        };
        for option in &parts.options {
            let (name, value) = (option.name.as_str(), option.value.as_str());
            match name {
                "prefix" => config.prefix = checked_prefix(value)?,
                "session_ttl" => {
                    let ttl = parse_duration(name, value)?;
                    if ttl < Duration::from_secs(1) || ttl.subsec_nanos() != 0 {
                        return Err(Error::Config(format!(
                            "`session_ttl={value}` in `{shown}`: etcd leases last whole \
                             seconds; write at least 1s, like session_ttl=10s"
                        )));
                    }
                    config.session_ttl = ttl;
                }
                "connect_timeout" => {
                    let timeout = parse_duration(name, value)?;
                    if timeout.is_zero() {
                        return Err(Error::Config(format!(
                            "`connect_timeout={value}` in `{shown}` must be above zero"
                        )));
                    }
                    config.connect_timeout = timeout;
                }
                "ttl" => config.ttl = Some(parse_duration(name, value)?),
                _ => {
                    return Err(
                        parts.unknown_option(option, "prefix, session_ttl, connect_timeout, ttl")
                    );
                }
            }
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_local_server_with_default_options() {
        assert_eq!(
            EtcdConfig::default(),
            EtcdConfig::parse("etcd://127.0.0.1:2379").unwrap()
        );
    }

    #[test]
    fn parses() {
        let c = EtcdConfig::parse("etcd://a:1,b,c:3?prefix=/locks&session_ttl=3s&ttl=20s").unwrap();
        assert_eq!(
            c.endpoints,
            ["http://a:1", "http://b:2379", "http://c:3"].map(String::from)
        );
        assert_eq!(c.prefix, "/locks");
        assert_eq!(c.session_ttl, Duration::from_secs(3));
        assert_eq!(c.ttl, Some(Duration::from_secs(20)));
    }

    #[test]
    fn refuses() {
        for bad in [
            "",
            "etcd://",
            "etcd://a:x",
            "etcd://a:1,",
            "etcd://a:1/",
            "etcd://a:1/x",
            "etcd://u:p@a:1",
            "etcd://a:1?prefix=x",
            "etcd://a:1?prefix=/x/",
            "etcd://a:1?session_ttl=1500ms",
            "etcd://a:1?session_ttl=0s",
            "etcd://a:1?connect_timeout=0s",
            "etcd://a:1?x=1",
            "redis://a",
        ] {
            assert!(
                matches!(EtcdConfig::parse(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_password_never_reaches_the_message() {
        let Err(Error::Config(message)) = EtcdConfig::parse("etcd://user:secret@a:1") else {
            panic!("accepted a user");
        };
        assert!(!message.contains("secret"), "{message}");
    }
}

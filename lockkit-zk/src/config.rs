//! ZooKeeper URLs: `zk://h1:p1,h2:p2,h3:p3/chroot?session_timeout=10s&root=/lockkit&layout=curator`.

use std::time::Duration;

use lockkit_core::{
    Error, Result,
    config::{LockUrl, parse_duration},
};

/// Everything a ZooKeeper URL says.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZkConfig {
    /// The connect string for the client: `h1:p1,h2:p2/chroot`.
    pub connect: String,
    /// `?session_timeout=` (default 10 s): a dead or cut-off holder's locks are freed when
    /// its session expires, so it is also the shortest lease accepted.
    pub session_timeout: Duration,
    /// `?root=` (default `/lockkit`): the parent of every lock's container node.
    pub root: String,
    /// `?connect_timeout=` (default 5 s).
    pub connect_timeout: Duration,
    /// `?ttl=`: the default lease of locks taken through this URL (the facade applies it),
    /// as on every backend.
    pub ttl: Option<Duration>,
    /// `?layout=curator|kazoo` (default `curator`): whose node names lockkit creates, so
    /// that clients of that library on the same paths see lockkit's holds.
    pub layout: ZkLayout,
}

/// Whose node names lockkit creates (`?layout=`). Whatever the layout, lockkit *reads*
/// the lock, read and write contenders of both (and the ZooKeeper recipe's), so it always
/// excludes both; the layout decides which of the two sees lockkit, and which semaphores
/// count together with lockkit's permits. Use one layout for every lockkit client of a
/// key: the two semaphore layouts cannot share a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ZkLayout {
    /// Apache Curator's: InterProcessMutex's `_c_<uuid>-lock-<seq>`,
    /// InterProcessReadWriteLock's `_c_<uuid>-__READ__<seq>` and `_c_<uuid>-__WRIT__<seq>`,
    /// InterProcessSemaphoreV2's `<path>/locks` and `<path>/leases/_c_<uuid>-lease-<seq>`.
    #[default]
    Curator,
    /// kazoo's (2.x): `Lock` and `WriteLock`'s `<uuid hex>__lock__<seq>`, `ReadLock`'s
    /// `<uuid hex>__rlock__<seq>`, and `Semaphore`'s layout: a persistent node `<path>`
    /// whose data is the permit count, one ephemeral lease `<path>/<uuid hex>` per permit,
    /// taken under a kazoo `Lock` at the sibling path `<path>-__lock__`. A stock kazoo
    /// client needs no `extra_lock_patterns` to see lockkit.
    Kazoo,
}

impl ZkLayout {
    /// The option's value: `curator` or `kazoo`.
    pub fn name(self) -> &'static str {
        match self {
            ZkLayout::Curator => "curator",
            ZkLayout::Kazoo => "kazoo",
        }
    }
}

impl Default for ZkConfig {
    /// `zk://127.0.0.1:2181` with every option at its default.
    fn default() -> Self {
        ZkConfig {
            connect: "127.0.0.1:2181".into(),
            session_timeout: Duration::from_secs(10),
            root: "/lockkit".into(),
            connect_timeout: Duration::from_secs(5),
            ttl: None,
            layout: ZkLayout::Curator,
        }
    }
}

/// Every URL scheme this crate accepts.
pub const SCHEMES: &[&str] = &["zk", "zookeeper"];

/// `root` as given, if it is an absolute path without a trailing or double slash.
fn checked_root(value: &str) -> Result<String> {
    if !value.starts_with('/') || value.len() < 2 || value.ends_with('/') || value.contains("//") {
        return Err(Error::Config(format!(
            "`root={value}` must be an absolute path like /lockkit"
        )));
    }
    refuse_what_servers_refuse(&format!("`root={value}`"), value)?;
    Ok(value.to_owned())
}

/// Refuses, before any request, an absolute node path that every ZooKeeper server refuses
/// (a `.` or `..` part, a NUL) or keeps for itself (`/zookeeper`); `what` names it.
fn refuse_what_servers_refuse(what: &str, path: &str) -> Result<()> {
    if path
        .split('/')
        .skip(1)
        .any(|part| part == "." || part == "..")
        || path.contains('\0')
    {
        return Err(Error::Config(format!(
            "{what}: ZooKeeper refuses paths with `.` or `..` parts or a NUL; name the \
             nodes plainly, like /lockkit"
        )));
    }
    if path == "/zookeeper" || path.starts_with("/zookeeper/") {
        return Err(Error::Config(format!(
            "{what}: /zookeeper is the servers' own tree, where no client may create nodes; \
             use another path, like /lockkit"
        )));
    }
    Ok(())
}

/// `value` of a timeout option, if the servers can take it: not zero, and at most what
/// the protocol carries (a signed 32-bit count of milliseconds, about 24 days).
fn checked_timeout(name: &str, value: &str) -> Result<Duration> {
    let timeout = parse_duration(name, value)?;
    if timeout < Duration::from_millis(1) || timeout > Duration::from_millis(i32::MAX as u64) {
        return Err(Error::Config(format!(
            "`{name}={value}` must be at least 1ms and at most 24 days (ZooKeeper counts it \
             in milliseconds, as a signed 32-bit number), e.g. 10s"
        )));
    }
    Ok(timeout)
}

impl ZkConfig {
    /// Parses a lockkit ZooKeeper URL.
    ///
    /// # Errors
    /// [`Error::Config`] saying what is wrong and what is accepted.
    pub fn parse(url: &str) -> Result<Self> {
        let form = "zk://host:port[,host:port...][/chroot]";
        let parts = LockUrl::parse(url, SCHEMES, form)?;
        parts.require_hosts(form)?;
        let url = parts.shown.as_str();
        if parts.userinfo.is_some() {
            return Err(Error::Config(format!(
                "`{url}` names a user; ZooKeeper URLs take none: zk://host:port[,host:port...][/chroot]"
            )));
        }
        let hosts = parts.hosts.join(",");
        let chroot = parts
            .path
            .as_deref()
            .map(|p| format!("/{p}"))
            .unwrap_or_default();
        let chroot = chroot.as_str();
        for host in hosts.split(',') {
            let port = host.rsplit_once(':').map(|(_, p)| p);
            if port.is_some_and(|p| p.parse::<u16>().is_err()) {
                return Err(Error::Config(format!("`{host}` in `{url}` has a bad port")));
            }
        }
        if chroot == "/" || chroot.ends_with('/') || chroot.contains("//") {
            return Err(Error::Config(format!(
                "chroot `{chroot}` in `{url}` must be an absolute path without a trailing slash"
            )));
        }
        if !chroot.is_empty() {
            refuse_what_servers_refuse(&format!("chroot `{chroot}` in `{url}`"), chroot)?;
        }
        let mut config = ZkConfig {
            connect: format!("{hosts}{chroot}"),
            ..ZkConfig::default()
        };
        for option in &parts.options {
            let (name, value) = (option.name.as_str(), option.value.as_str());
            match name {
                // Read as written, as before URLs were decoded: a decoded root would put
                // the locks of old and new clients in different trees.
                "root" => config.root = checked_root(option.raw_value())?,
                "session_timeout" => config.session_timeout = checked_timeout(name, value)?,
                "connect_timeout" => config.connect_timeout = checked_timeout(name, value)?,
                "ttl" => config.ttl = Some(parse_duration(name, value)?),
                "layout" => {
                    config.layout = match value {
                        "curator" => ZkLayout::Curator,
                        "kazoo" => ZkLayout::Kazoo,
                        _ => {
                            return Err(Error::Config(format!(
                                "`layout={value}` in `{url}`: the layout is `curator` (the \
                                 default: Apache Curator's node names) or `kazoo` (kazoo's)"
                            )));
                        }
                    }
                }
                _ => {
                    return Err(parts.unknown_option(
                        option,
                        "session_timeout, connect_timeout, root, ttl, layout",
                    ));
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
            ZkConfig::default(),
            ZkConfig::parse("zk://127.0.0.1:2181").unwrap()
        );
    }

    #[test]
    fn parses() {
        let c = ZkConfig::parse("zk://a:1,b:2/app?session_timeout=3s&root=/locks").unwrap();
        // `root` is read as written (review 13, F1): `+` stays a plus.
        assert_eq!(ZkConfig::parse("zk://h?root=/a+b").unwrap().root, "/a+b");
        assert_eq!(c.connect, "a:1,b:2/app");
        assert_eq!(
            (c.session_timeout, c.root.as_str()),
            (Duration::from_secs(3), "/locks")
        );
        assert_eq!(c.layout, ZkLayout::Curator);
        let kazoo = ZkConfig::parse("zk://h?layout=kazoo").unwrap().layout;
        assert_eq!((kazoo, kazoo.name()), (ZkLayout::Kazoo, "kazoo"));
        let curator = ZkConfig::parse("zk://h?layout=curator").unwrap().layout;
        assert_eq!(curator, ZkLayout::Curator);
    }

    #[test]
    fn refuses() {
        for bad in [
            "",
            "zk://",
            "zk://a:x",
            "zk://a:1,",
            "zk://a:1/",
            "zk://a:1?root=x",
            "zk://a:1?x=1",
            "zk://a:1?layout=",
            "zk://a:1?layout=Kazoo",
            "zk://a:1?layout=zookeeper",
            "zk://a:1?session_timeout=0s",
            "zk://a:1?session_timeout=600h",
            "zk://a:1?connect_timeout=0s",
            "zk://a:1?session_timeout=0.5ms",
            "zk://a:1?root=/a/../b",
            "zk://a:1?root=/a/.",
            "zk://a:1?root=/zookeeper",
            "zk://a:1?root=/zookeeper/locks",
            "zk://a:1/zookeeper",
            "zk://a:1/app/..",
            "redis://a",
        ] {
            assert!(
                matches!(ZkConfig::parse(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }
}

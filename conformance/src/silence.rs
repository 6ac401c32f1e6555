//! Links whose peer goes silent at the TCP level, as behind a NAT or load balancer that
//! forgot the connection, or a host that vanished: nothing is acknowledged and nothing is
//! sent back, so neither side's kernel reports an error until its own timers run out.
//! ([`crate::FaultProxy`] cannot do this: its kernel still acknowledges what it is sent.)
//!
//! Made with an `nftables` rule that drops the packets the connections already open to a
//! port send to it (new connections to that port pass). Needs root and `nft` (Debian
//! `nftables`, which `scripts/services.sh up` installs): in CI a missing `nft` is a
//! failure, elsewhere [`SilencedLinks::to_port`] says SKIPPED and returns `None`.

use std::{io::Write, process::Command};

/// The packets of some open connections, dropped until this is dropped.
#[derive(Debug)]
pub struct SilencedLinks {
    table: String,
    /// The local (client-side) ports of the connections silenced.
    pub client_ports: Vec<u16>,
}

impl SilencedLinks {
    /// Silences every loopback connection of this host now open to `port` (their packets
    /// to `port` are dropped: no data, no acknowledgement, no keepalive reply reaches the
    /// peer); connections opened later pass. Panics if none is open, or if `nft` fails in CI.
    pub fn to_port(port: u16) -> Option<Self> {
        let nft = ["/usr/sbin/nft", "/sbin/nft", "nft"]
            .into_iter()
            .find(|nft| {
                Command::new(nft)
                    .arg("--version")
                    .output()
                    .is_ok_and(|o| o.status.success())
            });
        let Some(nft) = nft else {
            assert!(
                !crate::env::in_ci(),
                "nft is missing but CI=true: run `scripts/services.sh up` (it installs nftables)"
            );
            let _ = writeln!(
                std::io::stderr(),
                "lockkit: SKIPPED, `nft` is missing (Debian nftables; run as root)"
            );
            return None;
        };
        remove_tables_of_dead_processes(nft);
        let client_ports = established_to(port);
        assert!(
            !client_ports.is_empty(),
            "no connection to port {port} is open"
        );
        let table = format!("{TABLE_PREFIX}{}_{port}", std::process::id());
        let ports = client_ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let rules = format!(
            "table inet {table} {{\n  chain input {{\n    type filter hook input priority -10; policy accept;\n    iifname \"lo\" tcp dport {port} tcp sport {{ {ports} }} drop\n  }}\n}}\n"
        );
        let made = Command::new(nft)
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                child
                    .stdin
                    .take()
                    .map(|mut stdin| stdin.write_all(rules.as_bytes()))
                    .transpose()?;
                child.wait_with_output()
            });
        match made {
            Ok(out) if out.status.success() => Some(SilencedLinks {
                table,
                client_ports,
            }),
            other => panic!("nft could not add the rule (run as root?): {other:?}"),
        }
    }
}

impl Drop for SilencedLinks {
    fn drop(&mut self) {
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.table])
            .output();
        let _ = Command::new("/usr/sbin/nft")
            .args(["delete", "table", "inet", &self.table])
            .output();
    }
}

/// The prefix of every table [`SilencedLinks`] adds (`<prefix><pid>_<port>`).
const TABLE_PREFIX: &str = "lockkit_silence_";

/// Deletes the tables that test processes no longer running left (a test SIGKILLed, or
/// stopped by a timeout, never ran its `Drop`): a rule left behind would silence a later
/// connection that happens to get one of the same client ports.
fn remove_tables_of_dead_processes(nft: &str) {
    let Ok(listed) = Command::new(nft).args(["list", "tables"]).output() else {
        return;
    };
    for table in String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|line| line.strip_prefix("table inet "))
    {
        let Some(pid) = table
            .strip_prefix(TABLE_PREFIX)
            .and_then(|rest| rest.split_once('_'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new(nft)
                .args(["delete", "table", "inet", table])
                .output();
        }
    }
}

/// The local ports of the established IPv4 and IPv6 TCP connections to `port`.
fn established_to(port: u16) -> Vec<u16> {
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(remote), Some(state)) =
                (fields.get(1), fields.get(2), fields.get(3))
            else {
                continue;
            };
            let port_of = |address: &str| {
                address
                    .rsplit_once(':')
                    .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
            };
            // 01: ESTABLISHED.
            if *state == "01" && port_of(remote) == Some(port) {
                ports.extend(port_of(local));
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table left by a test process that no longer runs (SIGKILLed before its `Drop`) is
    /// removed by the next silencing; a live process's table is kept.
    #[test]
    fn a_table_left_by_a_dead_test_process_is_removed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
        let port = listener.local_addr().expect("its address").port();
        let _client = std::net::TcpStream::connect(("127.0.0.1", port)).expect("a connection");
        let _server = listener.accept().expect("accepted");
        // Above the kernel's largest pid (2^22): never a live process.
        let stale = format!("{TABLE_PREFIX}4194305_{port}");
        let nft = ["/usr/sbin/nft", "/sbin/nft"]
            .into_iter()
            .find(|nft| std::path::Path::new(nft).exists());
        let Some(nft) = nft else {
            assert!(!crate::env::in_ci(), "nft is missing but CI=true");
            return;
        };
        let made = Command::new(nft)
            .args(["add", "table", "inet", &stale])
            .output()
            .expect("nft runs");
        if !made.status.success() {
            assert!(
                !crate::env::in_ci(),
                "nft could not add a table in CI: {made:?}"
            );
            return;
        }
        let tables = || {
            String::from_utf8_lossy(
                &Command::new(nft)
                    .args(["list", "tables"])
                    .output()
                    .expect("nft lists")
                    .stdout,
            )
            .into_owned()
        };
        let silenced = SilencedLinks::to_port(port).expect("nft is there");
        let listed = tables();
        let _ = Command::new(nft)
            .args(["delete", "table", "inet", &stale])
            .output();
        assert!(
            !listed.contains(&stale),
            "the dead process's table is gone: {listed}"
        );
        assert!(
            listed.contains(&silenced.table),
            "this process's own is kept: {listed}"
        );
    }
}

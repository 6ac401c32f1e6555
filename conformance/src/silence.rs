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
        let client_ports = established_to(port);
        assert!(
            !client_ports.is_empty(),
            "no connection to port {port} is open"
        );
        let table = format!("lockkit_silence_{}_{port}", std::process::id());
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

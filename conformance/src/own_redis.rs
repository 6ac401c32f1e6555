//! A `redis-server` of a test's own, for tests that change a server's settings or stop it
//! (`SIGSTOP`), which must touch no shared server.

use std::{
    io::Write,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A `redis-server` on a free loopback port, without persistence, killed when dropped.
#[derive(Debug)]
pub struct OwnRedis {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl OwnRedis {
    /// Starts one with `args` added to its command line (e.g. `["--notify-keyspace-events",
    /// "Kg"]`) and waits until it accepts connections. `None` (the test then says SKIPPED)
    /// when `redis-server` is missing outside CI; in CI that fails.
    pub fn start(args: &[&str]) -> Option<OwnRedis> {
        // A port found free may be taken again before the server binds it (another test's
        // listener): the server then exits, and another port is tried.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .ok()?
                .local_addr()
                .ok()?
                .port();
            let child = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let Ok(child) = child else {
                assert!(
                    !crate::env::in_ci(),
                    "redis-server is missing but CI=true: run `scripts/services.sh up`"
                );
                let _ = writeln!(
                    std::io::stderr(),
                    "lockkit: SKIPPED, `redis-server` is missing"
                );
                return None;
            };
            let mut server = OwnRedis { child, port };
            if server.answers() {
                return Some(server);
            }
        }
        panic!("redis-server did not start on any of five ports");
    }

    /// Waits until this server answers on its port (10 s at most), checked by the pid its
    /// `INFO` reports, so that another test's server or proxy that took the port never
    /// passes for it; false when it exited (its port was taken).
    fn answers(&mut self) -> bool {
        let started = Instant::now();
        let ours = format!("process_id:{}\r\n", self.child.id());
        while started.elapsed() < Duration::from_secs(10) {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return false;
            }
            let info = std::net::TcpStream::connect(("127.0.0.1", self.port)).and_then(|mut s| {
                s.set_read_timeout(Some(Duration::from_secs(1)))?;
                s.write_all(b"INFO server\r\n")?;
                let mut reply = Vec::new();
                let mut buf = [0u8; 4096];
                while !reply.ends_with(b"\r\n\r\n") && reply.len() < 64 * 1024 {
                    let n = std::io::Read::read(&mut s, &mut buf)?;
                    if n == 0 {
                        break;
                    }
                    reply.extend_from_slice(&buf[..n]);
                }
                Ok(String::from_utf8_lossy(&reply).into_owned())
            });
            if info.is_ok_and(|info| info.contains(&ours)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not answer within 10 s");
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Sends the server `signal` (`-STOP`, `-CONT`).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status();
        assert!(
            status.as_ref().is_ok_and(|s| s.success()),
            "kill {signal} failed: {status:?}"
        );
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.signal("-CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

//! The private servers, driven through `scripts/services.sh`, and the raw Redis call the
//! lab needs (`REPLICAOF NO ONE`).

use std::{
    collections::BTreeMap,
    fs::File,
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
    process::Command,
};

use super::{Context, LabError};

/// Where the servers' script sits in a lockkit checkout.
const SCRIPT: &str = "scripts/services.sh";

/// The instance table's file, beside the services script.
const TABLE: &str = "instances.tsv";

/// One private server, as the instance table (`scripts/instances.tsv`, read by
/// `services.sh` too) describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// The instance's name (`redis-single`, `zk-2`), as `services.sh` takes it.
    pub name: String,
    /// What runs there (`redis`, `cluster`, `mariadb`, `zk-standalone`, `zk-ensemble`,
    /// `postgres`, `etcd-single`, `etcd-cluster`).
    pub kind: String,
    /// Its port before `LOCKKIT_PORT_OFFSET`.
    pub port: u16,
    /// The URL variable `services.sh env` prints for it (shared by the members of a
    /// group, e.g. the Redlock masters).
    pub url_var: String,
    /// The URL form, `{hosts}` standing for the group's addresses.
    pub url_form: String,
}

/// Parses the instance table: one row per instance, five whitespace-separated columns,
/// `#` comments and blank lines ignored.
///
/// # Errors
/// A row without exactly five columns, a bad port, or a name given twice.
pub fn parse_instances(text: &str) -> Result<Vec<Instance>, LabError> {
    let mut instances: Vec<Instance> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let columns: Vec<&str> = line.split_whitespace().collect();
        let [name, kind, port, url_var, url_form] = columns[..] else {
            return Err(LabError::new(format!(
                "line {} of the instance table has {} columns, not 5: `{line}`",
                n + 1,
                columns.len()
            )));
        };
        let port = port
            .parse()
            .map_err(|_| LabError::new(format!("line {}: `{port}` is not a port", n + 1)))?;
        if instances.iter().any(|i| i.name == name) {
            return Err(LabError::new(format!(
                "line {}: `{name}` is listed twice",
                n + 1
            )));
        }
        instances.push(Instance {
            name: name.to_owned(),
            kind: kind.to_owned(),
            port,
            url_var: url_var.to_owned(),
            url_form: url_form.to_owned(),
        });
    }
    Ok(instances)
}

/// The distinct URL variables of `instances`, in table order.
pub fn url_vars(instances: &[Instance]) -> Vec<String> {
    let mut vars: Vec<String> = Vec::new();
    for instance in instances {
        if !vars.contains(&instance.url_var) {
            vars.push(instance.url_var.clone());
        }
    }
    vars
}

/// The line that marks lockkit's services script (in its first kilobyte).
const MARKER: &str = "lockkit-services-script";

/// Whether `path` is a file whose first kilobyte carries [`MARKER`].
fn is_lockkit_script(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 1024];
    let Ok(mut file) = File::open(path) else {
        return false;
    };
    let n = file.read(&mut head).unwrap_or(0);
    String::from_utf8_lossy(&head[..n]).contains(MARKER)
}

/// `scripts/services.sh` and the directory it keeps its state in.
#[derive(Debug, Clone)]
pub struct Services {
    script: PathBuf,
    state_dir: PathBuf,
}

/// Held while a scenario runs: one scenario at a time per checkout, across processes.
#[derive(Debug)]
pub struct LabLock {
    _file: File,
}

impl Services {
    /// The servers' script and state directory, found at run time, never at build time (so
    /// a `lockkit` binary built elsewhere works in any checkout):
    ///
    /// - the script is `$LOCKKIT_SERVICES_SCRIPT` (as `services.sh env` prints it: the servers
    ///   belong to the script that started them), else `scripts/services.sh` of the nearest
    ///   checkout at or above the current directory;
    /// - its state is in `$LOCKKIT_TEST_SERVICES_DIR` (as `services.sh env` prints it), else
    ///   in `target/services` of that checkout.
    ///
    /// # Errors
    /// When neither the variable is set nor a checkout is found above the current directory.
    pub fn locate() -> Result<Services, LabError> {
        let here = std::env::current_dir().context("cannot read the current directory")?;
        Self::locate_from(&here, std::env::var_os("LOCKKIT_SERVICES_SCRIPT"))
    }

    /// [`Services::locate`] from `start`, with `script` as `$LOCKKIT_SERVICES_SCRIPT`. Only
    /// a script that carries lockkit's marker line is ever run: another project's
    /// `scripts/services.sh` above the current directory is passed over, and a variable
    /// naming one is refused.
    ///
    /// # Errors
    /// As [`Services::locate`], and when `script` is not lockkit's services script.
    pub fn locate_from(
        start: &Path,
        script: Option<std::ffi::OsString>,
    ) -> Result<Services, LabError> {
        let script = match script {
            Some(script) => {
                let script = PathBuf::from(script);
                if !is_lockkit_script(&script) {
                    return Err(LabError::new(format!(
                        "LOCKKIT_SERVICES_SCRIPT={} is not lockkit's services script (no \
                         `{MARKER}` line): point it at scripts/services.sh of a lockkit checkout",
                        script.display()
                    )));
                }
                script
            }
            None => start
                .ancestors()
                .map(|dir| dir.join(SCRIPT))
                .find(|script| is_lockkit_script(script))
                .ok_or_else(|| {
                    LabError::new(format!(
                        "cannot find lockkit's {SCRIPT} at or above {}: run the lab inside a \
                         lockkit checkout or set LOCKKIT_SERVICES_SCRIPT to the script's path",
                        start.display()
                    ))
                })?,
        };
        let state_dir = match std::env::var_os("LOCKKIT_TEST_SERVICES_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => script
                .parent()
                .and_then(Path::parent)
                .map(|repo| repo.join("target/services"))
                .ok_or_else(|| {
                    LabError::new(format!(
                        "{} is not in a checkout's scripts/ directory: set \
                         LOCKKIT_TEST_SERVICES_DIR to the servers' state directory",
                        script.display()
                    ))
                })?,
        };
        Ok(Services { script, state_dir })
    }

    /// The instance table beside the script (`scripts/instances.tsv`).
    ///
    /// # Errors
    /// When the table cannot be read or parsed.
    pub fn instances(&self) -> Result<Vec<Instance>, LabError> {
        let path = self
            .script
            .parent()
            .map_or_else(|| PathBuf::from(TABLE), |dir| dir.join(TABLE));
        let text = std::fs::read_to_string(&path)
            .context(format!("cannot read the instance table {}", path.display()))?;
        parse_instances(&text)
    }

    /// The script.
    pub fn script(&self) -> &Path {
        &self.script
    }

    /// Its state directory.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Runs the script with `args`; fails with the script's own words.
    ///
    /// # Errors
    /// When it cannot be started or exits non-zero.
    pub async fn call(&self, args: &[&str]) -> Result<String, LabError> {
        let out = Command::new("bash")
            .arg(&self.script)
            .args(args)
            .kill_on_drop(true)
            .output()
            .await
            .context(format!("cannot run {}", self.script.display()))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(15).collect();
            return Err(LabError::new(format!(
                "`services.sh {}` failed ({}):\n{}",
                args.join(" "),
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Starts (or resumes, or leaves alone) the named instances and waits until they answer.
    ///
    /// # Errors
    /// As [`Services::call`].
    pub async fn up(&self, names: &[&str]) -> Result<(), LabError> {
        let mut args = vec!["up"];
        args.extend_from_slice(names);
        self.call(&args).await.map(drop)
    }

    /// One of `pause`, `resume`, `kill`, `restart`, `down` on the named instances.
    ///
    /// # Errors
    /// As [`Services::call`].
    pub async fn act(&self, action: &str, names: &[&str]) -> Result<(), LabError> {
        let mut args = vec![action];
        args.extend_from_slice(names);
        self.call(&args).await.map(drop)
    }

    /// The `LOCKKIT_TEST_*` URLs from `services.sh env`.
    ///
    /// # Errors
    /// As [`Services::call`].
    pub async fn urls(&self) -> Result<BTreeMap<String, String>, LabError> {
        let text = self.call(&["env"]).await?;
        Ok(text
            .lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .filter(|(k, _)| k.ends_with("_URL"))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect())
    }

    /// Takes the lab lock (waiting up to 10 minutes for another lab run to finish).
    ///
    /// # Errors
    /// When the lock file cannot be opened or the wait times out.
    pub async fn lock(&self) -> Result<LabLock, LabError> {
        let path = self.state_dir.join("lab.lock");
        std::fs::create_dir_all(&self.state_dir)
            .context(format!("cannot create {}", self.state_dir.display()))?;
        let file = File::create(&path).context(format!("cannot open {}", path.display()))?;
        let locked = tokio::time::timeout(
            Duration::from_secs(600),
            tokio::task::spawn_blocking(move || file.lock().map(|()| file)),
        )
        .await
        .map_err(|_| {
            LabError::new(format!(
                "another lab run has held {} for 10 minutes",
                path.display()
            ))
        })?
        .context("lab lock task")?
        .context("locking the lab")?;
        Ok(LabLock { _file: locked })
    }
}

/// Sends one Redis command (RESP) to `addr` and returns the reply: a status or integer
/// line, or the text of a bulk string.
///
/// # Errors
/// On connection failure, a timeout (5 s) or an error reply.
pub async fn redis_command(addr: &str, args: &[&str]) -> Result<String, LabError> {
    let talk = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .context(format!("connecting to {addr}"))?;
        let mut request = format!("*{}\r\n", args.len());
        for a in args {
            request.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        stream
            .write_all(request.as_bytes())
            .await
            .context(format!("writing to {addr}"))?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader
            .read_line(&mut line)
            .await
            .context(format!("reading from {addr}"))?;
        let line = line.trim_end().to_owned();
        if let Some(err) = line.strip_prefix('-') {
            return Err(LabError::new(format!(
                "{addr} refused `{}`: {err}",
                args.join(" ")
            )));
        }
        if let Some(len) = line.strip_prefix('$') {
            let Ok(len) = usize::try_from(len.parse::<i64>().unwrap_or(-1)) else {
                return Ok(String::new());
            };
            let mut body = vec![0u8; len + 2];
            reader
                .read_exact(&mut body)
                .await
                .context(format!("reading from {addr}"))?;
            body.truncate(len);
            return Ok(String::from_utf8_lossy(&body).into_owned());
        }
        Ok(line)
    };
    tokio::time::timeout(Duration::from_secs(5), talk)
        .await
        .map_err(|_| LabError::new(format!("{addr} did not answer `{}` in 5 s", args.join(" "))))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with_script(name: &str, text: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("lockkit-locate-{}-{name}", std::process::id()));
        std::fs::create_dir_all(dir.join("scripts")).expect("a temp dir");
        std::fs::write(dir.join(SCRIPT), text).expect("a script");
        dir
    }

    #[test]
    fn the_instance_table_parses_and_refuses_bad_rows() {
        let table = parse_instances(include_str!("../../scripts/instances.tsv")).expect("parses");
        assert_eq!(table.len(), 23);
        assert_eq!(url_vars(&table).len(), 13);
        let redlock: Vec<_> = table
            .iter()
            .filter(|i| i.url_var == "LOCKKIT_TEST_REDLOCK_URL")
            .map(|i| i.name.as_str())
            .collect();
        assert_eq!(
            redlock,
            [
                "redlock-1",
                "redlock-2",
                "redlock-3",
                "redlock-4",
                "redlock-5"
            ]
        );
        for bad in [
            "a redis 1 V",
            "a redis port V f",
            "a redis 1 V f\na redis 2 V f",
        ] {
            assert!(parse_instances(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn another_projects_services_script_is_never_run() {
        let foreign = dir_with_script("foreign", "#!/bin/sh\nexit 0\n");
        assert!(Services::locate_from(&foreign, None).is_err());
        let named = Some(foreign.join(SCRIPT).into_os_string());
        let refused = Services::locate_from(Path::new("/"), named).expect_err("refused");
        assert!(
            refused
                .to_string()
                .contains("not lockkit's services script"),
            "{refused}"
        );
        std::fs::remove_dir_all(foreign).ok();
    }

    #[test]
    fn the_nearest_lockkit_checkout_above_a_foreign_one_is_found() {
        let checkout = dir_with_script("checkout", &format!("#!/bin/sh\n# {MARKER}\n"));
        let inner = checkout.join("vendor/other");
        std::fs::create_dir_all(inner.join("scripts")).expect("a nested project");
        std::fs::write(inner.join(SCRIPT), "#!/bin/sh\nexit 0\n").expect("a foreign script");
        let found = Services::locate_from(&inner, None).expect("found");
        assert_eq!(found.script(), checkout.join(SCRIPT));
        std::fs::remove_dir_all(checkout).ok();
    }
}

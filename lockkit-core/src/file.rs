//! `FileBackend`: locks shared by the processes of one host, in a directory.

use std::{
    collections::HashMap,
    fs::{File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use tokio::{sync::Notify, time::Instant};

use crate::{
    AcquireRequest, BackendInfo, Capabilities, Consistency, Error, FencingToken, Grant, HolderInfo,
    LockBackend, LockKey, OwnerId, Released, Result, deadline_after, detached_acquire,
};

const SCHEME: &str = "file";

/// Nanoseconds on the host's monotonic clock (`CLOCK_MONOTONIC`), the same for every
/// process on the host and never set back, unlike the wall clock.
fn host_now() -> Result<u64> {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_err(|e| {
        Error::backend_with_source(SCHEME, false, "reading the monotonic clock failed", e)
    })?;
    let nanos = i128::from(now.tv_sec()) * 1_000_000_000 + i128::from(now.tv_nsec());
    Ok(u64::try_from(nanos).unwrap_or(0))
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Longest encoded name kept as is; longer ones are shortened with a SHA-256 of the key
/// (file systems allow 255 bytes).
const MAX_NAME: usize = 200;

/// A key's file as a name: bytes outside `[A-Za-z0-9._-]` percent-encoded (`%` too), and
/// `.`/`..` encoded whole, so two keys never share a file and no key leaves the directory.
/// Names longer than 200 bytes become their first 100 bytes, `~`, and the SHA-256 of the key
/// in hex (`~` is always encoded otherwise, so such names cannot meet a short one).
pub fn file_name(key: &LockKey) -> String {
    let name = encoded_name(key);
    if name.len() <= MAX_NAME + ".lock".len() {
        return name;
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(key.as_str().as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut cut = 100;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}~{hex}.lock", &name[..cut])
}

fn encoded_name(key: &LockKey) -> String {
    let text = key.as_str();
    let mut out = match text {
        "." => return "%2E.lock".into(),
        ".." => return "%2E%2E.lock".into(),
        _ => String::with_capacity(text.len() + 5),
    };
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out.push_str(".lock");
    out
}

/// The state of one lock as stored in its file: `token owner depth expires`. The token
/// stays when the lock is free, so it keeps growing.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct State {
    token: u64,
    owner: Option<OwnerId>,
    depth: u32,
    /// Host monotonic nanoseconds.
    expires: u64,
}

impl State {
    fn parse(text: &str) -> State {
        let mut parts = text.split_whitespace();
        let token = parts.next().and_then(|t| t.parse().ok()).unwrap_or(0);
        let owner = parts
            .next()
            .filter(|o| *o != "-")
            .and_then(|o| o.parse().ok());
        let depth = parts.next().and_then(|d| d.parse().ok()).unwrap_or(0);
        let expires = parts.next().and_then(|e| e.parse().ok()).unwrap_or(0);
        State {
            token,
            owner,
            depth,
            expires,
        }
    }

    fn render(&self) -> String {
        let owner = self.owner.map_or_else(|| "-".to_owned(), |o| o.to_string());
        format!("{} {owner} {} {}\n", self.token, self.depth, self.expires)
    }

    fn holder(&self, now: u64) -> Option<OwnerId> {
        self.owner.filter(|_| self.depth > 0 && self.expires > now)
    }
}

/// One lock file, locked (`flock`) for the duration of one operation.
struct Locked {
    file: File,
    state: State,
}

impl Locked {
    fn open(path: &Path) -> std::io::Result<Locked> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        file.lock()?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        Ok(Locked {
            state: State::parse(&text),
            file,
        })
    }

    fn write(&mut self) -> std::io::Result<()> {
        let text = self.state.render();
        self.file.seek(SeekFrom::Start(0))?;
        self.file.write_all(text.as_bytes())?;
        self.file.set_len(text.len() as u64)?;
        self.file.sync_data()
    }
}

enum Attempt {
    Granted(Grant),
    /// Held by someone else for this much longer.
    Busy(Duration),
}

impl Attempt {
    fn into_grant(self) -> Option<Grant> {
        match self {
            Attempt::Granted(grant) => Some(grant),
            Attempt::Busy(_) => None,
        }
    }
}

/// Locks shared between the processes of one host, kept as one small file per key in a
/// directory: `file:///var/lock/myapp`. Each operation takes the file's `flock` for a
/// moment and reads or writes `token owner depth expiry`, the expiry on the host's
/// monotonic clock. Tokens survive restarts in the files.
///
/// Waiters in the same process are woken at once; waiters in other processes poll with a
/// backoff of 1 ms doubling to 50 ms, never sleeping past the holder's lease.
#[derive(Debug, Clone)]
pub struct FileBackend {
    dir: Arc<PathBuf>,
    wakers: Arc<Mutex<HashMap<LockKey, Arc<Notify>>>>,
}

fn io_error(doing: &str, path: &Path, e: std::io::Error) -> Error {
    Error::backend_with_source(
        SCHEME,
        matches!(
            e.kind(),
            std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
        ),
        format!(
            "{doing} `{}` failed: {e}; is the directory writable?",
            path.display()
        ),
        e,
    )
}

impl FileBackend {
    /// Uses (and creates, if needed) the directory `dir`.
    ///
    /// # Errors
    /// [`Error::Config`] if the directory cannot be created or written.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| {
            Error::Config(format!(
                "cannot create lock directory `{}`: {e}",
                dir.display()
            ))
        })?;
        let probe = dir.join(".lockkit-probe");
        File::create(&probe).map_err(|e| {
            Error::Config(format!(
                "lock directory `{}` is not writable: {e}",
                dir.display()
            ))
        })?;
        let _ = std::fs::remove_file(probe);
        Ok(FileBackend {
            dir: Arc::new(dir),
            wakers: Arc::default(),
        })
    }

    /// From a `file:///absolute/dir` URL.
    ///
    /// # Errors
    /// [`Error::Config`] for any other URL.
    pub fn from_url(url: &str) -> Result<Self> {
        let Some(path) = url.strip_prefix("file://") else {
            return Err(Error::Config(format!(
                "`{url}` is not a file URL; write file:///absolute/path/to/dir"
            )));
        };
        if !path.starts_with('/') || path.contains('?') {
            return Err(Error::Config(format!(
                "`{url}` must name an absolute directory and no options: file:///var/lock/app"
            )));
        }
        Self::open(path)
    }

    /// Operator action: frees `key` as if its lease had run out (the token is kept, so
    /// tokens still grow). Its holder finds out at its next renewal.
    ///
    /// # Errors
    /// File errors.
    pub async fn clear(&self, key: &LockKey) -> Result<bool> {
        self.with_file(key, "clearing", |file, now| {
            let held = file.state.holder(now).is_some();
            file.state.owner = None;
            file.state.depth = 0;
            file.state.expires = 0;
            Ok(held)
        })
        .await
    }

    /// How many keys starting with `prefix` are held now (for leak checks).
    ///
    /// # Errors
    /// File errors.
    pub fn held_under(&self, prefix: &str) -> Result<usize> {
        let encoded = match LockKey::new(prefix) {
            Ok(key) => file_name(&key).trim_end_matches(".lock").to_owned(),
            Err(_) => String::new(),
        };
        let now = host_now()?;
        let entries =
            std::fs::read_dir(&*self.dir).map_err(|e| io_error("listing", &self.dir, e))?;
        let mut held = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(&encoded) || !name.ends_with(".lock") {
                continue;
            }
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            held += usize::from(State::parse(&text).holder(now).is_some());
        }
        Ok(held)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &LockKey) -> PathBuf {
        self.dir.join(file_name(key))
    }

    fn waker(&self, key: &LockKey) -> Arc<Notify> {
        let mut wakers = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
        wakers.entry(key.clone()).or_default().clone()
    }

    /// Runs `op` on the locked file of `key` on a blocking thread, to completion even if
    /// the caller goes away.
    async fn with_file<T, F>(&self, key: &LockKey, doing: &'static str, op: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Locked, u64) -> Result<T> + Send + 'static,
    {
        let path = self.path(key);
        let work = tokio::task::spawn_blocking(move || {
            let mut locked = Locked::open(&path).map_err(|e| io_error(doing, &path, e))?;
            let before = locked.state.clone();
            let outcome = op(&mut locked, host_now()?);
            if outcome.is_ok() && locked.state != before {
                locked.write().map_err(|e| io_error(doing, &path, e))?;
            }
            outcome
        });
        work.await
            .map_err(|e| Error::backend_with_source(SCHEME, true, "a file operation panicked", e))?
    }

    async fn attempt(&self, req: &AcquireRequest) -> Result<Attempt> {
        let (this, request, giver) = (self.clone(), req.clone(), self.clone());
        detached_acquire(
            SCHEME,
            move |_| async move {
                let start = Instant::now();
                let req = request.clone();
                this.with_file(&request.key, "acquiring", move |file, now| {
                    let state = &mut file.state;
                    match state.holder(now) {
                        Some(owner) if owner == req.owner => {
                            state.depth += 1;
                            state.expires = now + nanos(req.ttl);
                            Ok(Attempt::Granted(Grant::new(
                                &req,
                                FencingToken::new(state.token),
                                state.depth,
                                start,
                            )))
                        }
                        Some(_) => Ok(Attempt::Busy(Duration::from_nanos(state.expires - now))),
                        None => {
                            state.token += 1;
                            state.owner = Some(req.owner);
                            state.depth = 1;
                            state.expires = now + nanos(req.ttl);
                            Ok(Attempt::Granted(Grant::new(
                                &req,
                                FencingToken::new(state.token),
                                1,
                                start,
                            )))
                        }
                    }
                })
                .await
            },
            Attempt::into_grant,
            move |grant| async move {
                let _ = giver.release(&grant).await;
            },
        )
        .await
    }
}

#[async_trait]
impl LockBackend for FileBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo::new(
            SCHEME,
            Consistency::Cp,
            Capabilities {
                notified_wait: false,
                ..Capabilities::default()
            },
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        Ok(self.attempt(req).await?.into_grant())
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        let started = Instant::now();
        let deadline = deadline_after(wait);
        let waker = self.waker(&req.key);
        let mut delay = Duration::from_millis(1);
        loop {
            let notified = waker.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let left = match self.attempt(req).await? {
                Attempt::Granted(grant) => return Ok(grant),
                Attempt::Busy(left) => left,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    key: req.key.clone(),
                    waited: started.elapsed(),
                });
            }
            let sleep = delay.min(left + Duration::from_millis(1));
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until((now + sleep).min(deadline)) => {}
            }
            delay = (delay * 2).min(Duration::from_millis(50));
        }
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let (key, owner) = (grant.key.clone(), grant.owner);
        self.with_file(&grant.key, "renewing", move |file, now| {
            let state = &mut file.state;
            if state.holder(now) != Some(owner) {
                return Err(Error::NotHeld { key });
            }
            state.expires = now + nanos(ttl);
            Ok(())
        })
        .await
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        let (key, owner) = (grant.key.clone(), grant.owner);
        let outcome = self
            .with_file(&grant.key, "releasing", move |file, now| {
                let state = &mut file.state;
                if state.holder(now) != Some(owner) {
                    return Err(Error::NotHeld { key });
                }
                state.depth -= 1;
                if state.depth > 0 {
                    return Ok(Released::Partially {
                        remaining: state.depth,
                    });
                }
                state.owner = None;
                state.expires = 0;
                Ok(Released::Fully)
            })
            .await;
        if matches!(outcome, Ok(Released::Fully)) {
            self.waker(&grant.key).notify_waiters();
        }
        outcome
    }

    async fn ping(&self) -> Result<()> {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || {
            std::fs::metadata(&*dir)
                .map(|_| ())
                .map_err(|e| io_error("reading", &dir, e))
        })
        .await
        .map_err(|e| Error::backend_with_source(SCHEME, true, "a file operation panicked", e))?
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let path = self.path(key);
        if !path.exists() {
            return Ok(None);
        }
        self.with_file(key, "inspecting", move |file, now| {
            let state = &file.state;
            Ok(state.holder(now).map(|owner| {
                HolderInfo::new(
                    owner.to_string(),
                    state.depth,
                    Some(FencingToken::new(state.token)),
                    Some(Duration::from_nanos(state.expires - now)),
                )
            }))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips() {
        let state = State {
            token: 7,
            owner: Some(OwnerId::random()),
            depth: 2,
            expires: 99,
        };
        assert_eq!(State::parse(&state.render()), state);
        assert_eq!(State::parse(""), State::default());
    }

    #[test]
    fn names_never_collide_or_escape() {
        let name = |k: &str| file_name(&LockKey::new(k).unwrap());
        assert_eq!(name("orders-42"), "orders-42.lock");
        assert_eq!(name("../x"), "..%2Fx.lock");
        assert_eq!(name(".."), "%2E%2E.lock");
        assert_ne!(name("a/b"), name("a%2Fb"));
        let long = "k".repeat(LockKey::MAX_BYTES);
        let longer = format!("{}x", "k".repeat(LockKey::MAX_BYTES - 1));
        assert!(name(&long).len() < 255);
        assert_ne!(name(&long), name(&longer));
    }
}

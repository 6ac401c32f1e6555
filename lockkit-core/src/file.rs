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
    AcquireRequest, AttemptLedger, BackendInfo, Capabilities, Consistency, Error, FencingToken,
    Grant, HolderIdentity, HolderInfo, LockBackend, LockKey, OwnerId, Released, Result,
    detached_acquire,
    wait::{Armed, Attempt, Backoff, WaitPolicy, Wake, armed, wait_for_grant},
};

const SCHEME: &str = "file";

/// Nanoseconds on the host's monotonic clock (`CLOCK_MONOTONIC`), the same for every
/// process on the host and never set back, unlike the wall clock.
fn host_now() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let nanos = i128::from(now.tv_sec) * 1_000_000_000 + i128::from(now.tv_nsec);
    u64::try_from(nanos).unwrap_or(0)
}

/// This boot of the host (`/proc/sys/kernel/random/boot_id`), stored beside each expiry:
/// `CLOCK_MONOTONIC` starts again after a reboot, so an expiry written before it means
/// nothing after it (the lease counts as over). `-` where the host does not tell.
fn boot_id() -> &'static str {
    static BOOT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BOOT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|id| id.trim().to_owned())
            .filter(|id| !id.is_empty() && !id.contains(char::is_whitespace))
            .unwrap_or_else(|| "-".to_owned())
    })
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

/// The state of one lock as stored in its file: `token owner depth expires boot attempts`.
/// The token stays when the lock is free, so it keeps growing. A file without a boot id
/// (written before it was stored) is read as written in this boot: a holder of an older
/// version may still be running, and a double grant is worse than a key that stays held
/// until that expiry. A file without attempts has an empty ledger: its holds are released
/// unconditionally.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct State {
    token: u64,
    owner: Option<OwnerId>,
    depth: u32,
    /// Host monotonic nanoseconds.
    expires: u64,
    /// The acquisitions behind `depth`.
    attempts: AttemptLedger,
    /// Who took the hold, encoded ([`HolderIdentity::encode`]) on the file's second line.
    identity: Option<String>,
}

/// Reads a lock file's text as of this boot: an expiry written in another boot is over.
fn load(text: &str) -> State {
    let mut state = State::parse(text);
    let boot = text.split_whitespace().nth(4);
    // Only two known ids can tell boots apart: `-` (a host that does not say) matches all.
    let ours = boot_id();
    if boot.is_some_and(|b| b != "-" && ours != "-" && b != ours) {
        state.expires = 0;
    }
    state
}

impl State {
    fn parse(text: &str) -> State {
        let mut lines = text.lines();
        let mut parts = lines.next().unwrap_or("").split_whitespace();
        let token = parts.next().and_then(|t| t.parse().ok()).unwrap_or(0);
        let owner = parts
            .next()
            .filter(|o| *o != "-")
            .and_then(|o| o.parse().ok());
        let depth = parts.next().and_then(|d| d.parse().ok()).unwrap_or(0);
        let expires = parts.next().and_then(|e| e.parse().ok()).unwrap_or(0);
        let attempts = parts.nth(1).map(AttemptLedger::parse).unwrap_or_default();
        let identity = lines
            .next()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned);
        State {
            token,
            owner,
            depth,
            expires,
            attempts,
            identity,
        }
    }

    fn render(&self) -> String {
        let owner = self.owner.map_or_else(|| "-".to_owned(), |o| o.to_string());
        let mut text = format!(
            "{} {owner} {} {} {} {}\n",
            self.token,
            self.depth,
            self.expires,
            boot_id(),
            self.attempts.render()
        );
        if let Some(identity) = self.identity.as_deref().filter(|_| self.owner.is_some()) {
            text.push_str(identity);
            text.push('\n');
        }
        text
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
            state: load(&text),
            file,
        })
    }

    /// Writes the state back. `durable`: also wait for the disk (`fdatasync`). Only a new
    /// token needs that (it must never be handed out twice, even after a power loss); a
    /// renewal or release changes only the lease, which a crash ends anyway, and syncing
    /// it made renewals miss short leases under load.
    fn write(&mut self, durable: bool) -> std::io::Result<()> {
        let text = self.state.render();
        self.file.seek(SeekFrom::Start(0))?;
        self.file.write_all(text.as_bytes())?;
        self.file.set_len(text.len() as u64)?;
        if durable {
            self.file.sync_data()?;
        }
        Ok(())
    }
}

/// A waiter's registration in [`FileBackend::wakers`].
struct Waker<'a> {
    backend: &'a FileBackend,
    key: LockKey,
    notify: Arc<Notify>,
}

/// Wakes waiters on a release in this process; other processes' releases are found by
/// polling, so the wake-ups are never relied on alone.
impl Wake for Waker<'_> {
    fn arm(&self) -> Armed<'_> {
        armed(&self.notify)
    }
}

impl Drop for Waker<'_> {
    fn drop(&mut self) {
        let mut wakers = self.backend.wakers();
        // The map's reference and ours: no other waiter of this process is left.
        if Arc::strong_count(&self.notify) == 2 {
            wakers.remove(&self.key);
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
    /// The URL schemes this backend is built from (`file://`).
    pub const SCHEMES: &'static [&'static str] = &[SCHEME];

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
        let (path, query) = path.split_once('?').unwrap_or((path, ""));
        if !path.starts_with('/') {
            return Err(Error::Config(format!(
                "`{url}` must name an absolute directory: file:///var/lock/app[?ttl=30s]"
            )));
        }
        crate::config::only_ttl_option(url, query)?;
        Self::open(path)
    }

    /// Operator action: takes `key` away from its holder, as if its lease had run out (the
    /// token is kept, so tokens still grow). Its holder finds out at its next renewal.
    /// Returns whether a live hold was there. Every backend that can do this names it
    /// `take_away`, with this signature.
    ///
    /// # Errors
    /// File errors.
    pub async fn take_away(&self, key: &LockKey) -> Result<bool> {
        self.with_file(key, "clearing", |file, now| {
            let held = file.state.holder(now).is_some();
            file.state.owner = None;
            file.state.depth = 0;
            file.state.expires = 0;
            file.state.attempts.clear();
            Ok(held)
        })
        .await
    }

    /// Test hook: how many keys starting with `prefix` are held now (for leak checks), with
    /// the signature of every backend's `held_under`.
    ///
    /// # Errors
    /// File errors.
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub async fn held_under(&self, prefix: &str) -> Result<u64> {
        let encoded = match LockKey::new(prefix) {
            Ok(key) => file_name(&key).trim_end_matches(".lock").to_owned(),
            Err(_) => String::new(),
        };
        let now = host_now();
        let entries =
            std::fs::read_dir(&*self.dir).map_err(|e| io_error("listing", &self.dir, e))?;
        let mut held = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(&encoded) || !name.ends_with(".lock") {
                continue;
            }
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            held += u64::from(load(&text).holder(now).is_some());
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

    fn wakers(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, Arc<Notify>>> {
        self.wakers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a waiter of this process on `key`; the entry goes when its last waiter
    /// does, so the map holds only keys being waited on.
    fn waker(&self, key: &LockKey) -> Waker<'_> {
        let notify = self.wakers().entry(key.clone()).or_default().clone();
        Waker {
            backend: self,
            key: key.clone(),
            notify,
        }
    }

    /// Wakes this process's waiters on `key`, if there are any.
    fn wake(&self, key: &LockKey) {
        if let Some(notify) = self.wakers().get(key) {
            notify.notify_waiters();
        }
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
            let outcome = op(&mut locked, host_now());
            if outcome.is_ok() && locked.state != before {
                let durable = locked.state.token != before.token;
                locked
                    .write(durable)
                    .map_err(|e| io_error(doing, &path, e))?;
            }
            outcome
        });
        work.await.map_err(|e| {
            Error::backend_with_source(SCHEME, false, "a file operation panicked", e)
        })?
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
                        Some(owner) if owner == req.owner && state.attempts.has(req.attempt) => {
                            // A retry of an acquisition that took effect: the same grant.
                            // Its guard counts the lease from now: the lease runs that long.
                            state.expires = state.expires.max(now.saturating_add(nanos(req.ttl)));
                            Ok(Attempt::Granted(Grant::new(
                                &req,
                                FencingToken::new(state.token),
                                state.depth,
                                start,
                            )))
                        }
                        Some(owner) if owner == req.owner => {
                            state.depth += 1;
                            state.attempts.add(req.attempt);
                            // Never shorten the lease an outer guard relies on.
                            state.expires = state.expires.max(now.saturating_add(nanos(req.ttl)));
                            Ok(Attempt::Granted(Grant::new(
                                &req,
                                FencingToken::new(state.token),
                                state.depth,
                                start,
                            )))
                        }
                        Some(_) => Ok(Attempt::busy(Duration::from_nanos(state.expires - now))),
                        None => {
                            state.token += 1;
                            state.owner = Some(req.owner);
                            state.identity = Some(req.identity.encode());
                            state.depth = 1;
                            state.attempts.clear();
                            state.attempts.add(req.attempt);
                            state.expires = now.saturating_add(nanos(req.ttl));
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
        let mut waker = self.waker(&req.key);
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(50),
        ));
        wait_for_grant(&req.key, wait, policy, &mut waker, || self.attempt(req)).await
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let (key, owner) = (grant.key.clone(), grant.owner);
        self.with_file(&grant.key, "renewing", move |file, now| {
            let state = &mut file.state;
            if state.holder(now) != Some(owner) {
                return Err(Error::NotHeld { key });
            }
            state.expires = state.expires.max(now.saturating_add(nanos(ttl)));
            Ok(())
        })
        .await
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        let (key, owner, attempt) = (grant.key.clone(), grant.owner, grant.attempt);
        let outcome = self
            .with_file(&grant.key, "releasing", move |file, now| {
                let state = &mut file.state;
                if state.holder(now) != Some(owner) {
                    return Err(Error::NotHeld { key });
                }
                if !state.attempts.take(attempt, state.depth) {
                    // A retried release: it took effect already.
                    return Ok(Released::Partially {
                        remaining: state.depth,
                    });
                }
                state.depth -= 1;
                if state.depth > 0 {
                    return Ok(Released::Partially {
                        remaining: state.depth,
                    });
                }
                state.owner = None;
                state.expires = 0;
                state.attempts.clear();
                Ok(Released::Fully)
            })
            .await;
        if matches!(outcome, Ok(Released::Fully)) {
            self.wake(&grant.key);
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
                .with_identity(state.identity.as_deref().and_then(HolderIdentity::decode))
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
            attempts: AttemptLedger::parse(&format!(
                "{},{}",
                uuid::Uuid::new_v4(),
                uuid::Uuid::new_v4()
            )),
            identity: Some(HolderIdentity::now().encode()),
        };
        assert_eq!(State::parse(&state.render()), state);
        // A file from before attempts were stored: released unconditionally.
        let owner = OwnerId::random();
        let mut legacy = load(&format!("7 {owner} 2 99 -"));
        assert_eq!((legacy.token, legacy.depth), (7, 2));
        assert!(legacy.attempts.take(uuid::Uuid::new_v4(), legacy.depth));
        assert_eq!(State::parse(""), State::default());
    }

    fn temp_dir(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("lockkit-file-unit-{name}-{}", uuid::Uuid::new_v4()))
    }

    fn request(key: &LockKey, ttl: Duration) -> AcquireRequest {
        AcquireRequest::new(
            key.clone(),
            OwnerId::random(),
            ttl,
            crate::lost::LossSignal::new(),
        )
    }

    #[tokio::test]
    async fn a_lease_written_before_a_reboot_is_over() {
        let backend = FileBackend::open(temp_dir("boot")).unwrap();
        let key = LockKey::new("k").unwrap();
        let far = host_now() + nanos(Duration::from_secs(3600));
        let owner = OwnerId::random();
        // Held for another hour, but by the clock of another boot: the lease is over.
        std::fs::write(
            backend.path(&key),
            format!("5 {owner} 1 {far} 00000000-0000-0000-0000-000000000000\n"),
        )
        .unwrap();
        let grant = backend
            .try_acquire(&request(&key, Duration::from_secs(5)))
            .await
            .unwrap()
            .expect("a lease of an earlier boot must not hold the key");
        assert_eq!(grant.token.get(), 6);
        // The same lease written in this boot (or by a version that stored no boot id) holds.
        for boot in [boot_id(), ""] {
            std::fs::write(backend.path(&key), format!("9 {owner} 1 {far} {boot}\n")).unwrap();
            let busy = backend
                .try_acquire(&request(&key, Duration::from_secs(5)))
                .await
                .unwrap();
            assert!(
                busy.is_none(),
                "a live lease of this boot was ignored ({boot:?})"
            );
        }
    }

    #[tokio::test]
    async fn waiters_leave_no_entry_behind() {
        let backend = FileBackend::open(temp_dir("wakers")).unwrap();
        for i in 0..20 {
            let key = LockKey::new(format!("k{i}")).unwrap();
            let held = backend
                .try_acquire(&request(&key, Duration::from_secs(5)))
                .await
                .unwrap()
                .unwrap();
            // A waiter that times out, and one that is granted after the release.
            let timed_out = backend
                .acquire(
                    &request(&key, Duration::from_secs(5)),
                    Duration::from_millis(5),
                )
                .await;
            assert!(matches!(timed_out, Err(Error::Timeout { .. })));
            let waiter = {
                let backend = backend.clone();
                let key = key.clone();
                tokio::spawn(async move {
                    backend
                        .acquire(
                            &request(&key, Duration::from_secs(5)),
                            Duration::from_secs(5),
                        )
                        .await
                })
            };
            tokio::time::sleep(Duration::from_millis(5)).await;
            backend.release(&held).await.unwrap();
            let grant = waiter.await.unwrap().unwrap();
            backend.release(&grant).await.unwrap();
        }
        assert_eq!(backend.wakers().len(), 0, "the wakers map only grows");
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

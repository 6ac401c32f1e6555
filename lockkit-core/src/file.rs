//! `FileBackend`: locks shared by the processes of one host, in a directory.
//!
//! The directory must be on a local file system of that host's kernel, and on a disk:
//! `/var/lib/<app>/locks`, not `/var/lock` or `/run/lock` (a tmpfs on systemd
//! distributions, emptied at every boot: tokens would start again from the wall clock). See
//! [`FileBackend`], "Where to put the directory".
//!
//! One file per key. Its first line is `ceiling owner depth expires boot attempts [kind]
//! [t<held token>] [n<last token>]`; the lines after it hold the holder's identity, readers
//! and permits, and waiting writers' markers. Format change (issue 13): the
//! first field, which older versions read as the key's counter, is now a durable ceiling
//! on the tokens handed out, synced only when it moves, and `n<token>` (ignored by older
//! versions) is the last token handed out, trusted only in the boot that wrote it; see
//! [`FileBackend`], "Fencing tokens", for why a mix of versions and a power loss still
//! never repeat a token.

use std::{
    collections::HashMap,
    fs::{File, OpenOptions},
    io::Read,
    path::{Path, PathBuf},
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use tokio::{sync::Notify, time::Instant};

use crate::{
    AcquireRequest, AttemptLedger, BackendInfo, Capabilities, Consistency, Error, FencingToken,
    Grant, HolderIdentity, HolderInfo, LockBackend, LockKey, LockKind, OwnerId, Released, Result,
    detached_acquire,
    file_watch::Wakers,
    rules::{HoldView, Refusal, admit, same_hold},
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

/// The state of one lock as stored in its file: `ceiling owner depth expires boot attempts
/// [kind] [t<held token>] [n<last token>]`. The tokens stay when the lock is free, so they
/// keep growing (see [`FileBackend`], "Fencing tokens"). A file without a boot id
/// (written before it was stored) is read as written in this boot: a holder of an older
/// version may still be running, and a double grant is worse than a key that stays held
/// until that expiry. A file without attempts has an empty ledger: its holds are released
/// unconditionally.
///
/// Read-write locks and semaphores add lines after the identity line: one per reader
/// (`r`) or permit (`p<limit>`), `<tag> owner depth expires token attempts identity`, and
/// one per waiting writer (`q owner expires`), whose marker keeps new readers out. The first
/// line's seventh field says what its holder is: `x` a plain lock, `w` a writer, `s` a
/// summary of the shared holders (their latest expiry under one of their owners), written
/// so that a lockkit version that reads only the first line still sees the key held.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct State {
    /// The reserve ceiling: every token handed out is at most this, and it is on the disk
    /// (synced) before any token up to it is handed out. The first field of the first line,
    /// which older versions read as the key's counter (and add one to).
    ceiling: u64,
    /// The last token handed out, to any kind of hold (at most [`State::ceiling`]). Written
    /// as a last field `n<token>` when below the ceiling (older versions ignore it), and
    /// trusted only in the boot that wrote it: read in another boot, or from a file without
    /// it, it is the ceiling (see [`load`]).
    token: u64,
    /// The first line's holder's own token, when it has one (0 when nobody holds it). It is
    /// the counter unless a shared hold was granted beside it since (a downgrade), and only
    /// then written, as an eighth field `t<token>` (older versions ignore it).
    held_token: u64,
    owner: Option<OwnerId>,
    depth: u32,
    /// Host monotonic nanoseconds.
    expires: u64,
    /// The acquisitions behind `depth`.
    attempts: AttemptLedger,
    /// Who took the hold, encoded ([`HolderIdentity::encode`]) on the file's second line.
    identity: Option<String>,
    /// What the first line's holder holds: [`LockKind::Exclusive`] or [`LockKind::Write`].
    kind: LockKind,
    /// Readers or permits.
    shared: Vec<SharedHold>,
    /// Writers waiting, with the expiry of their marker.
    writers: Vec<(OwnerId, u64)>,
}

/// A reader's or a permit's hold, on a line of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SharedHold {
    kind: LockKind,
    owner: OwnerId,
    depth: u32,
    expires: u64,
    token: u64,
    attempts: AttemptLedger,
    identity: Option<String>,
}

impl SharedHold {
    /// Parses a line `tag owner depth expires token attempts identity` (the identity is the
    /// rest of the line, spaces and all).
    fn parse(line: &str) -> Option<SharedHold> {
        let mut parts = line.splitn(7, ' ');
        let tag = parts.next()?;
        let kind = match tag {
            "r" => LockKind::Read,
            _ => LockKind::Permit {
                limit: tag.strip_prefix('p')?.parse().ok()?,
            },
        };
        Some(SharedHold {
            kind,
            owner: parts.next()?.parse().ok()?,
            depth: parts.next()?.parse().ok()?,
            expires: parts.next()?.parse().ok()?,
            token: parts.next()?.parse().ok()?,
            attempts: AttemptLedger::parse(parts.next()?),
            identity: parts
                .next()
                .map(str::trim)
                .filter(|i| !i.is_empty() && *i != "-")
                .map(str::to_owned),
        })
    }

    fn render(&self) -> String {
        let tag = match self.kind.limit() {
            Some(limit) => format!("p{limit}"),
            None => "r".to_owned(),
        };
        format!(
            "{tag} {} {} {} {} {} {}\n",
            self.owner,
            self.depth,
            self.expires,
            self.token,
            self.attempts.render(),
            self.identity.as_deref().unwrap_or("-")
        )
    }
}

/// How long a waiting writer's marker keeps readers out unless its wait renews it (a poll
/// does once half of it has run, so that polls rewrite nothing in between): a writer that
/// dies while waiting blocks readers at most this long, and one whose polls stop for more
/// than half of it (a paused process) lets new readers in until it polls again.
const WRITER_MARKER: Duration = Duration::from_secs(3);

/// How many tokens a key's ceiling moves up at a time ([`State::next_token`]): one sync per
/// this many new holders of a key, while the boot lasts. A reboot, a crash between a
/// ceiling's write and its sync, or an older version's write skips what was left of it.
const RESERVE: u64 = 1024;

/// The highest token handed out: 2^63 - 1, so that tokens fit a signed 64-bit number,
/// which is how storage often keeps them (see [`State::next_token`]).
const MAX_TOKEN: u64 = i64::MAX as u64;

/// Reads a lock file's text as of this boot: an expiry written in another boot is over, and
/// so is the reserve of tokens below the ceiling (`n<token>`), which only the boot that
/// wrote it can trust: its writes need not have reached the disk, the ceiling's did.
fn load(text: &str) -> State {
    let mut state = State::parse(text);
    let boot = text.split_whitespace().nth(4);
    // Only two known ids can tell boots apart: `-` (a host that does not say) matches all.
    let ours = boot_id();
    if boot.is_some_and(|b| b != "-" && ours != "-" && b != ours) {
        state.expires = 0;
        state.shared.clear();
        state.writers.clear();
    }
    if ours == "-" || boot != Some(ours) {
        state.token = state.ceiling;
    }
    state
}

impl State {
    fn parse(text: &str) -> State {
        let mut lines = text.lines();
        let mut parts = lines.next().unwrap_or("").split_whitespace();
        let ceiling = parts.next().and_then(|t| t.parse().ok()).unwrap_or(0);
        let owner = parts
            .next()
            .filter(|o| *o != "-")
            .and_then(|o| o.parse().ok());
        let depth = parts.next().and_then(|d| d.parse().ok()).unwrap_or(0);
        let expires = parts.next().and_then(|e| e.parse().ok()).unwrap_or(0);
        let attempts = parts.nth(1).map(AttemptLedger::parse).unwrap_or_default();
        // Then optionally the holder's kind (`x`, `w`, `s`), its own token (`t<token>`) and
        // the last token handed out (`n<token>`), in this order.
        let (mut tag, mut held, mut next) = (None, None, None);
        for field in parts {
            if let Some(t) = field.strip_prefix('t') {
                held = t.parse::<u64>().ok();
            } else if let Some(n) = field.strip_prefix('n') {
                next = n.parse::<u64>().ok();
            } else {
                tag = Some(field);
            }
        }
        let held_token = held.unwrap_or(ceiling);
        // Never above the ceiling: a larger `n` (no version writes one) raises it.
        let token = next.unwrap_or(ceiling);
        let ceiling = ceiling.max(token);
        let identity = lines
            .next()
            .map(str::trim)
            .filter(|line| !line.is_empty() && *line != "-")
            .map(str::to_owned);
        let mut state = State {
            ceiling,
            token,
            held_token: if owner.is_some() { held_token } else { 0 },
            owner,
            depth,
            expires,
            attempts,
            identity,
            kind: if tag == Some("w") {
                LockKind::Write
            } else {
                LockKind::Exclusive
            },
            shared: Vec::new(),
            writers: Vec::new(),
        };
        if tag == Some("s") {
            // A summary for older versions, not a holder.
            state.owner = None;
            state.held_token = 0;
            state.depth = 0;
            state.expires = 0;
            state.attempts.clear();
            state.identity = None;
        }
        for line in lines {
            let mut parts = line.split_whitespace();
            match parts.next() {
                Some("q") => {
                    let owner = parts.next().and_then(|o| o.parse().ok());
                    let expires = parts.next().and_then(|e| e.parse().ok());
                    if let (Some(owner), Some(expires)) = (owner, expires) {
                        state.writers.push((owner, expires));
                    }
                }
                Some(_) => state.shared.extend(SharedHold::parse(line)),
                None => {}
            }
        }
        state
    }

    fn render(&self) -> String {
        let extra = !self.shared.is_empty() || !self.writers.is_empty();
        let summary = self
            .shared
            .iter()
            .max_by_key(|hold| hold.expires)
            .filter(|_| self.owner.is_none());
        let (owner, depth, expires, attempts, tag) = match summary {
            Some(latest) => (
                latest.owner.to_string(),
                1,
                latest.expires,
                "-".to_owned(),
                " s",
            ),
            None => (
                self.owner.map_or_else(|| "-".to_owned(), |o| o.to_string()),
                self.depth,
                self.expires,
                self.attempts.render(),
                match (self.kind, extra || self.pinned() || self.reserved()) {
                    (LockKind::Write, _) => " w",
                    (_, true) => " x",
                    _ => "",
                },
            ),
        };
        let held = match summary {
            None if self.pinned() => format!(" t{}", self.held_token),
            _ => String::new(),
        };
        let next = if self.reserved() {
            format!(" n{}", self.token)
        } else {
            String::new()
        };
        let mut text = format!(
            "{} {owner} {depth} {expires} {} {attempts}{tag}{held}{next}\n",
            self.ceiling,
            boot_id(),
        );
        match self.identity.as_deref().filter(|_| self.owner.is_some()) {
            Some(identity) => {
                text.push_str(identity);
                text.push('\n');
            }
            None if extra => text.push_str("-\n"),
            None => {}
        }
        for hold in &self.shared {
            text.push_str(&hold.render());
        }
        for (owner, expires) in &self.writers {
            text.push_str(&format!("q {owner} {expires}\n"));
        }
        text
    }

    /// Whether the first line's holder has a token other than the first field (the
    /// ceiling, which is what older versions take for it): see [`State::held_token`].
    fn pinned(&self) -> bool {
        self.owner.is_some() && self.held_token != self.ceiling
    }

    /// Whether tokens below the ceiling are still to hand out (then written as `n<token>`).
    fn reserved(&self) -> bool {
        self.token != self.ceiling
    }

    /// Hands out the next token. When it would pass the ceiling, the ceiling moves a
    /// reserve of [`RESERVE`] tokens up, which the caller must sync before the token
    /// leaves (see [`FileBackend::with_file`]). Where the boot cannot be told
    /// ([`boot_id`] is `-`), `n` is never trusted, so the reserve is one token: a sync per
    /// grant, as before the reserve.
    ///
    /// # Errors
    /// The key's tokens are used up: the next would pass [`MAX_TOKEN`] (a first field or
    /// `n` written near it by hand or by another program; a key gets there in no other way).
    fn next_token(&mut self, key: &LockKey) -> Result<u64> {
        if self.token == 0 && self.ceiling == 0 {
            // A key without a file: never used, or its file was deleted or emptied (a
            // cleaner of the temporary directory, a person). Its tokens start from the
            // wall clock in µs, as the Redis backend's do on a wiped server, so they still
            // pass those handed out before the file went: a fenced store would otherwise
            // take the new holders' tokens for stale ones (or an old holder's for current).
            self.token = wall_clock_micros().min(MAX_TOKEN / 2);
        }
        let next = self.token.checked_add(1).filter(|t| *t <= MAX_TOKEN);
        let Some(next) = next else {
            return Err(Error::backend(
                SCHEME,
                false,
                format!(
                    "the fencing tokens of `{key}` are used up (the last handed out is {}, and \
                     tokens stay below 2^63): use another key name; do not restart this key's \
                     tokens by deleting its file, as storage fenced by them would then take \
                     a new holder's writes for an old one's",
                    self.token
                ),
            ));
        };
        self.token = next;
        if self.token > self.ceiling {
            let reserve = if boot_id() == "-" { 1 } else { RESERVE };
            self.ceiling = self.token.saturating_add(reserve - 1).min(MAX_TOKEN);
        }
        Ok(self.token)
    }

    fn holder(&self, now: u64) -> Option<OwnerId> {
        self.owner.filter(|_| self.depth > 0 && self.expires > now)
    }

    /// Forgets shared holds and writer markers whose time is over.
    /// Forgets the first line's holder too once its lease is over, so that a file with
    /// readers never goes out with an expired holder on its first line where the summary
    /// belongs (an older lockkit would read that line as free). The token stays.
    fn prune(&mut self, now: u64) {
        self.shared.retain(|hold| hold.expires > now);
        self.writers.retain(|(_, expires)| *expires > now);
        if self.owner.is_some() && self.holder(now).is_none() {
            self.clear_first();
        }
    }

    /// Empties the first line but for the token.
    fn clear_first(&mut self) {
        self.owner = None;
        self.held_token = 0;
        self.depth = 0;
        self.expires = 0;
        self.attempts.clear();
        self.identity = None;
        self.kind = LockKind::Exclusive;
    }

    /// Every live hold, for the rules of [`admit`].
    fn views(&self, now: u64) -> Vec<HoldView<u64>> {
        let first = self.holder(now).map(|owner| HoldView {
            owner,
            kind: self.kind,
            expires: self.expires,
        });
        first
            .into_iter()
            .chain(
                self.shared
                    .iter()
                    .filter(|hold| hold.expires > now)
                    .map(|hold| HoldView {
                        owner: hold.owner,
                        kind: hold.kind,
                        expires: hold.expires,
                    }),
            )
            .collect()
    }

    /// The live hold of `grant`'s owner and kind, as (depth, expires, attempts).
    fn hold_of(&mut self, grant: &Grant, now: u64) -> Option<HeldRef<'_>> {
        if grant.kind.is_exclusive() {
            return (self.holder(now) == Some(grant.owner) && self.kind == grant.kind).then_some(
                HeldRef {
                    depth: &mut self.depth,
                    expires: &mut self.expires,
                    attempts: &mut self.attempts,
                },
            );
        }
        self.shared
            .iter_mut()
            .find(|h| {
                h.expires > now
                    && same_hold(
                        (h.owner, h.kind),
                        (grant.owner, grant.kind),
                        &h.attempts,
                        grant.attempt,
                    )
            })
            .map(|hold| HeldRef {
                depth: &mut hold.depth,
                expires: &mut hold.expires,
                attempts: &mut hold.attempts,
            })
    }

    /// Ends the hold of `grant`'s owner and kind.
    fn end(&mut self, grant: &Grant) {
        if grant.kind.is_exclusive() {
            self.clear_first();
        } else {
            self.shared.retain(|h| h.depth > 0);
        }
    }
}

/// The counts of one hold in a [`State`], whichever line it is on.
struct HeldRef<'a> {
    depth: &'a mut u32,
    expires: &'a mut u64,
    attempts: &'a mut AttemptLedger,
}

/// One lock file, locked (`flock`) for the duration of one operation.
struct Locked {
    file: File,
    state: State,
    /// The file's length, as read or last written.
    len: u64,
}

impl Locked {
    /// Opens (creates) the file of a key, not locked yet. A symbolic link there is refused
    /// (`O_NOFOLLOW`), never followed: whoever can write to the directory (the default one
    /// is under the temporary directory) could otherwise have a lock's state written into
    /// any file the caller may write, through a link planted where a key's file goes.
    fn open(path: &Path) -> std::io::Result<File> {
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::custom_flags(
            &mut options,
            rustix::fs::OFlags::NOFOLLOW.bits().cast_signed(),
        );
        options.open(path).map_err(|e| {
            if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "it is a symbolic link, which lockkit never follows (a lock file is a \
                         regular file it creates itself; someone who can write to the lock \
                         directory may have planted it: check the directory's owner and \
                         permissions) ({e})"
                    ),
                )
            } else {
                e
            }
        })
    }

    /// Reads the state of `file`, whose `flock` the caller holds.
    fn read(mut file: File) -> std::io::Result<Locked> {
        // Read to the end without asking for the size first (`read_to_string` does: a
        // `statx` and an `lseek` more per operation).
        let mut bytes = Vec::new();
        let mut chunk = [0_u8; 1024];
        loop {
            match file.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let text = String::from_utf8(bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        Ok(Locked {
            state: load(&text),
            len: text.len() as u64,
            file,
        })
    }

    /// Writes the state back, after `op` changed it from `before`. A moved ceiling
    /// ([`State::next_token`]) goes to the disk first, on its own: the state is written
    /// with every token up to the new ceiling counted as handed out (no `n`), and synced
    /// (`fdatasync`); only then is the next token written (`n<token>`, not synced). So a
    /// file that says `n` in this boot has its ceiling on the disk: a process that dies
    /// between the write and its sync leaves a file whose reserve is all spent, and the
    /// next grant moves the ceiling (and syncs) again. The directory is synced after the file
    /// (its entry for the file: a new key's file, whose first ceiling this is, must not go
    /// missing in a power loss, which would start its tokens again from the wall clock; an already
    /// synced directory costs next to nothing). Nothing else is synced: a renewal or
    /// release changes only a lease, which a crash ends anyway, and syncing it made
    /// renewals miss short leases under load.
    fn store(&mut self, before: &State, path: &Path) -> std::io::Result<()> {
        if self.state.ceiling != before.ceiling {
            let spent = State {
                token: self.state.ceiling,
                ..self.state.clone()
            };
            let text = spent.render();
            let written = self
                .write(&text)
                .and_then(|()| injected(path, Failing::Write));
            let synced_all = written
                .and_then(|()| sync(&self.file, path))
                .and_then(|()| sync_dir(path));
            if let Err(e) = synced_all {
                // The new ceiling may be in the file (all or part of the write) but not on
                // the disk: put the file back as it was, so that no retry of this attempt
                // finds its grant there (it would take the grant's token as granted) and
                // the next grant moves the ceiling again.
                let _ = self.write(&before.render());
                return Err(e);
            }
            synced(path, &text);
            if !self.state.reserved() {
                return Ok(());
            }
        }
        let text = self.state.render();
        self.write(&text)
    }

    /// Replaces the file's text: one positioned write. A text shorter than the file by at
    /// most [`PAD_AT_MOST`] bytes is padded to the file's length with spaces at the end of
    /// its first line (which every version reads by whitespace), so a release does not
    /// truncate the file and the next grant does not grow it again: a truncation took
    /// about a sixth of an uncontended pair's CPU. A text shorter by more is written as it
    /// is and the file truncated, so a file is never more than that longer than its text.
    fn write(&mut self, text: &str) -> std::io::Result<()> {
        let padded = pad_to(text, self.len);
        let bytes = padded.as_deref().unwrap_or(text).as_bytes();
        // Counted before the write: one that fails part way may have grown the file, and the
        // next write (the restore of a failed ceiling's store) must cover or cut all of it.
        self.len = self.len.max(bytes.len() as u64);
        #[cfg(unix)]
        std::os::unix::fs::FileExt::write_all_at(&self.file, bytes, 0)?;
        #[cfg(not(unix))]
        {
            std::io::Seek::seek(&mut self.file, std::io::SeekFrom::Start(0))?;
            std::io::Write::write_all(&mut self.file, bytes)?;
        }
        let len = bytes.len() as u64;
        if len < self.len {
            self.file.set_len(len)?;
        }
        self.len = len;
        Ok(())
    }
}

/// How many spaces [`Locked::write`] pads a shorter text with, at most, rather than
/// truncating the file: more than a hold's line and its holder's identity line usually take.
const PAD_AT_MOST: u64 = 1024;

/// `text` with spaces added at the end of its first line (before its first `\n`, or at the
/// end without one) up to `len` bytes, when it is shorter by at most [`PAD_AT_MOST`];
/// `None` when it is to be written as it is.
fn pad_to(text: &str, len: u64) -> Option<String> {
    let missing = usize::try_from(len.checked_sub(text.len() as u64)?).ok()?;
    if missing == 0 || missing as u64 > PAD_AT_MOST {
        return None;
    }
    let first_line_end = text.find('\n').unwrap_or(text.len());
    let mut padded = String::with_capacity(text.len() + missing);
    padded.push_str(&text[..first_line_end]);
    const SPACES: &str = "                                                                ";
    let mut left = missing;
    while left > 0 {
        let run = left.min(SPACES.len());
        padded.push_str(&SPACES[..run]);
        left -= run;
    }
    padded.push_str(&text[first_line_end..]);
    Some(padded)
}

/// `fdatasync`s `file`, the file of `path` (for the test hook that fails it).
fn sync(file: &File, path: &Path) -> std::io::Result<()> {
    injected(path, Failing::Sync)?;
    file.sync_data()
}

/// `fsync`s the directory of the file `path`: its entry for the file.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let Some(dir) = path.parent() else {
        return Ok(());
    };
    File::open(dir)?.sync_all()?;
    dir_synced(path);
    Ok(())
}

/// Test hook: which step of a new ceiling's store fails for a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failing {
    /// The write reaches the file and then reports an error.
    Write,
    /// The sync fails.
    Sync,
}

/// Test hook: the error injected at `step` for `path`, if any (never outside tests).
#[cfg(test)]
fn injected(path: &Path, step: Failing) -> std::io::Result<()> {
    match failing_syncs().get(path) {
        Some(failing) if *failing == step => Err(std::io::Error::other(format!(
            "{step:?} failed (test hook)"
        ))),
        _ => Ok(()),
    }
}

#[cfg(not(test))]
fn injected(_: &Path, _: Failing) -> std::io::Result<()> {
    Ok(())
}

/// Test hook: the files whose writes or syncs fail.
#[cfg(test)]
fn failing_syncs() -> std::sync::MutexGuard<'static, HashMap<PathBuf, Failing>> {
    static FAILING: OnceLock<std::sync::Mutex<HashMap<PathBuf, Failing>>> = OnceLock::new();
    FAILING
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Test hook: each lock file's syncs, as (how many, the text last synced).
#[cfg(test)]
fn syncs() -> std::sync::MutexGuard<'static, HashMap<PathBuf, (u64, String)>> {
    static SYNCS: OnceLock<std::sync::Mutex<HashMap<PathBuf, (u64, String)>>> = OnceLock::new();
    SYNCS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
fn synced(path: &Path, text: &str) {
    let mut syncs = syncs();
    let entry = syncs.entry(path.to_owned()).or_default();
    entry.0 += 1;
    entry.1 = text.to_owned();
}

#[cfg(not(test))]
fn synced(_: &Path, _: &str) {}

/// Test hook: how many times the directory was synced for each lock file.
#[cfg(test)]
fn dir_syncs() -> std::sync::MutexGuard<'static, HashMap<PathBuf, u64>> {
    static SYNCS: OnceLock<std::sync::Mutex<HashMap<PathBuf, u64>>> = OnceLock::new();
    SYNCS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
fn dir_synced(path: &Path) {
    *dir_syncs().entry(path.to_owned()).or_default() += 1;
}

#[cfg(not(test))]
fn dir_synced(_: &Path) {}

/// A waiter's registration in [`FileBackend::wakers`].
struct Waker<'a> {
    backend: &'a FileBackend,
    /// The key's file name.
    name: String,
    notify: Arc<Notify>,
}

/// Wakes waiters on a release in this process, and on any change to the key's file made by
/// another process where the directory can be watched ([`crate::file_watch`]). The wait
/// still polls, so the wake-ups are never relied on alone.
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
            wakers.remove(&self.name);
        }
    }
}

/// Locks shared between the processes of one host, kept as one small file per key in a
/// directory: `file:///var/lib/myapp/locks`. Each operation takes the file's `flock` for a
/// moment and reads or writes `token owner depth expiry`, the expiry on the host's
/// monotonic clock. Tokens survive restarts in the files.
///
/// # Where to put the directory
///
/// On a disk of the host whose processes share the locks: the files are the tokens' only
/// record. Not on a tmpfs (`/tmp` on some distributions, and `/var/lock`, which systemd
/// distributions link to `/run/lock`): it is emptied at every boot, and the tokens start
/// again from the wall clock, which keeps them above those of before only while the clock
/// is not set back (a warning is logged at [`FileBackend::open`] for a tmpfs).
/// `/var/lib/<app>/locks` is a good place.
///
/// The backend needs one kernel: `flock` and the expiries (`CLOCK_MONOTONIC`, the boot id)
/// are those of the kernel that runs the processes. So not a network file system shared by
/// several hosts (NFS, SMB), and not a directory shared between virtual machines or
/// sandboxes with kernels of their own (virtiofs, 9p, gVisor, Kata containers): their locks
/// and clocks are not one. A network or FUSE file system used by one host still works, but
/// every operation on it runs on a blocking thread (a `flock` there is a request to a
/// server, which an outage could keep from returning): slower, never on the runtime's
/// workers.
///
/// Within a boot, the reserve of tokens (below) trusts the kernel's page cache: a write is
/// seen by every later read, synced or not. What breaks that could repeat a token: a disk
/// that loses its volatile write cache while the host stays up, or a process restored from
/// a checkpoint (CRIU) or a virtual machine resumed from a memory snapshot, either of which
/// goes back to an earlier state in the same boot.
///
/// # Fencing tokens
///
/// A key's token must never be handed out twice, even after a power loss, but a sync of
/// the file per grant cost most of an uncontended acquisition (~177 µs of ~234 µs). So the
/// file's first field is a *ceiling*, synced whenever it moves, and the last token handed
/// out is written beside it as a last field `n<token>`, not synced: a grant takes the next
/// token and, only when that passes the ceiling, moves the ceiling 1,024 tokens up
/// and syncs (once per 1,024 new holders of a key). `n` is trusted only in the boot that
/// wrote it (the file records its boot): after a reboot, whatever of the later writes the
/// disk kept, every token up to the synced ceiling counts as handed out, and the next one
/// is above it. A moved ceiling is written and synced with no `n` (all of it spent), and
/// only then is `n` written, so a process that dies before its sync leaves nothing that
/// lets another trust an unsynced ceiling, and a write or sync of a new ceiling that fails
/// puts the file back as it was. Writes that do not move the ceiling leave its bytes as
/// they are, so a power loss that keeps only some of them (a sector is written whole)
/// keeps the synced ceiling. Where the boot cannot be told, each grant syncs, as before.
/// Within a boot, tokens still count up by one. A moved ceiling's sync syncs the directory
/// too (its entry for the file), so a power loss cannot take a new key's file away and
/// start its tokens again. Tokens stay below 2^63 (they fit a signed 64-bit number): a
/// key whose tokens are used up (only a first field written near the end by hand gets
/// there) refuses new holds with an error. A key without a file (a new key, or one whose
/// file was deleted or emptied: a cleaner of the temporary directory) counts from the wall
/// clock in µs, as the Redis backend does on a wiped server, so its tokens pass those handed
/// out before the file went unless the clock was set back meanwhile (a key hands out at
/// most one token per grant, far fewer than one per µs).
///
/// Older versions read the first field as the key's counter: their grant adds one to it
/// (above every token handed out, all of which are at most the ceiling) and syncs, and any
/// of their writes drops `n`, which spends the reserve: the next grant of this version
/// moves the ceiling. A holder's own token is written as `t<token>` (which versions since
/// read-write locks read) whenever it is not the first field.
///
/// Waiters are woken at once by a release in the same process and, on Linux, by any change
/// to the key's file (the directory is watched with inotify, one thread per process); they
/// also poll, with a backoff of 1 ms doubling to 50 ms, never sleeping past the holder's
/// lease, which is all they have where the directory cannot be watched (a network file
/// system: other hosts' changes are not seen).
#[derive(Debug, Clone)]
pub struct FileBackend {
    dir: Arc<PathBuf>,
    /// This process's waiters, by their key's file name.
    wakers: Arc<Wakers>,
    /// The directory's watch for other processes' changes, if it can be watched (made on
    /// the first wait; ends with the backend's last clone).
    watched: Arc<OnceLock<Option<crate::file_watch::Watch>>>,
    /// What the directory's file system is (read once, at [`FileBackend::open`]).
    fs: FsKind,
    /// Attempts of this process given up at their bound while still waiting for their key
    /// file's `flock` (see [`FileBackend::attempt`]), by the file's name.
    stalled: Arc<std::sync::Mutex<HashMap<String, StalledAttempt>>>,
    /// Turns of this process's operations that wait for a key file's `flock` on a
    /// blocking thread, by the file's name (see [`FileBackend::flock_turn`]).
    flock_turns: Arc<std::sync::Mutex<HashMap<String, FlockGate>>>,
}

/// One key's turns at waiting for its file's `flock` on a blocking thread (at most one
/// thread of this process waits for it; one more may hold it): the gate, and how many
/// operations hold or wait for a turn (the entry goes when none does).
#[derive(Debug, Default)]
struct FlockGate {
    gate: Arc<tokio::sync::Mutex<()>>,
    users: usize,
}

/// An operation's turn at its key file's `flock` on a blocking thread (or its place in
/// the queue for one); gives it up, and the key's entry with the last user, when dropped.
struct FlockTurn {
    turns: Arc<std::sync::Mutex<HashMap<String, FlockGate>>>,
    name: String,
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for FlockTurn {
    fn drop(&mut self) {
        drop(self.held.take());
        let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = turns.get_mut(&self.name) {
            entry.users = entry.users.saturating_sub(1);
            if entry.users == 0 {
                turns.remove(&self.name);
            }
        }
    }
}

/// An attempt given up at its bound that still runs: `done` fires once it and the
/// give-back of a grant it made have finished.
#[derive(Debug)]
struct StalledAttempt {
    id: uuid::Uuid,
    done: tokio_util::sync::CancellationToken,
}

/// What a lock directory's file system is, as far as the backend cares (`statfs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FsKind {
    /// A local disk's, or one not known here.
    Local,
    /// A network or FUSE file system's (NFS, SMB/CIFS, FUSE and virtiofs, 9p, Ceph, AFS,
    /// Coda, Lustre, GlusterFS, cluster file systems): a `flock`, a read, a write or a
    /// close may wait for a server, for as long as an outage lasts.
    Remote,
    /// In memory (`tmpfs`, `ramfs`): emptied at every boot, tokens with it.
    Tmpfs,
}

impl FsKind {
    /// From `statfs`'s `f_type` (the magic numbers of `linux/magic.h` and statfs(2)).
    fn from_magic(magic: u64) -> FsKind {
        match magic & 0xFFFF_FFFF {
            0x6969 // NFS
            | 0x517B // SMB
            | 0xFF53_4D42 // CIFS
            | 0xFE53_4D42 // SMB2
            | 0x6573_5546 // FUSE (virtiofs, sshfs, glusterfs, ...)
            | 0x0102_1997 // 9p
            | 0x00C3_6400 // Ceph
            | 0x5346_414F // AFS
            | 0x6B41_4653 // kAFS
            | 0x7375_7245 // Coda
            | 0x0BD0_0BD0 // Lustre
            | 0x7461_636F // OCFS2
            | 0x0116_1970 // GFS2
            => FsKind::Remote,
            0x0102_1994 // tmpfs
            | 0x8584_58F6 // ramfs
            => FsKind::Tmpfs,
            _ => FsKind::Local,
        }
    }

    /// The file system of `dir`; [`FsKind::Local`] where it cannot be told.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn of(dir: &Path) -> FsKind {
        match rustix::fs::statfs(dir) {
            #[allow(clippy::unnecessary_cast, clippy::cast_sign_loss)]
            Ok(stat) => FsKind::from_magic(stat.f_type as i64 as u64),
            Err(_) => FsKind::Local,
        }
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn of(_: &Path) -> FsKind {
        FsKind::Local
    }
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
        // A name of its own, created new (`O_EXCL`, which never follows a symbolic link): a
        // link planted at a fixed name would have had the victim's file truncated here.
        let probe = dir.join(format!(".lockkit-probe-{}", uuid::Uuid::new_v4().simple()));
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe)
            .map_err(|e| {
                Error::Config(format!(
                    "lock directory `{}` is not writable: {e}",
                    dir.display()
                ))
            })?;
        let _ = std::fs::remove_file(probe);
        warn_if_others_can_break_locks(&dir);
        let fs = FsKind::of(&dir);
        if fs == FsKind::Tmpfs {
            tracing::warn!(
                dir = %dir.display(),
                "lock directory is on tmpfs, emptied at every boot: fencing tokens start \
                 again from the wall clock after a reboot, below earlier ones if the clock \
                 was set back; use a directory on a disk, e.g. /var/lib/<app>/locks"
            );
        }
        Ok(FileBackend {
            dir: Arc::new(dir),
            wakers: Arc::default(),
            watched: Arc::default(),
            fs,
            stalled: Arc::default(),
            flock_turns: Arc::default(),
        })
    }

    /// From a `file:///absolute/dir` URL (RFC 8089): the host is empty or `localhost`, the
    /// path is percent-decoded (`file:///var/lib/my%20locks` is `/var/lib/my locks`), and
    /// the only option is `?ttl=`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other URL: another scheme or host, a relative path, a
    /// fragment (`#...` names no directory; a `#` in the path is written `%23`), a bad or
    /// NUL escape, an option other than `ttl`; and a path with escapes whose literal
    /// reading (older versions took the path as written) is an existing directory.
    pub fn from_url(url: &str) -> Result<Self> {
        Self::open(Self::dir_of_url(url)?)
    }

    /// The directory a `file://` URL names, as [`FileBackend::from_url`] reads it (for tools
    /// that keep other files beside the locks, such as a file fence).
    ///
    /// # Errors
    /// [`Error::Config`], as [`FileBackend::from_url`].
    pub fn dir_of_url(url: &str) -> Result<PathBuf> {
        dir_of_url(url)
    }

    /// The `file://` URL of the absolute directory `dir`, which [`FileBackend::from_url`]
    /// reads back as `dir`: a `%`, `#`, `?`, a control character or a byte that is not
    /// UTF-8 is percent-escaped.
    #[must_use]
    pub fn url_of(dir: &Path) -> String {
        use std::{fmt::Write as _, os::unix::ffi::OsStrExt};
        let mut url = String::from("file://");
        for chunk in dir.as_os_str().as_bytes().utf8_chunks() {
            for c in chunk.valid().chars() {
                if matches!(c, '%' | '#' | '?') || c.is_control() {
                    let mut utf8 = [0; 4];
                    for byte in c.encode_utf8(&mut utf8).bytes() {
                        let _ = write!(url, "%{byte:02X}");
                    }
                } else {
                    url.push(c);
                }
            }
            for byte in chunk.invalid() {
                let _ = write!(url, "%{byte:02X}");
            }
        }
        url
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
            let held = !file.state.views(now).is_empty();
            file.state.clear_first();
            file.state.shared.clear();
            file.state.writers.clear();
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
            held += u64::from(!load(&text).views(now).is_empty());
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

    fn wakers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        self.wakers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a waiter of this process on `key`; the entry goes when its last waiter
    /// does, so the map holds only keys being waited on.
    fn waker(&self, key: &LockKey) -> Waker<'_> {
        // Other processes' changes to the key's file wake this process's waiters too.
        self.watched
            .get_or_init(|| crate::file_watch::watch(&self.dir, &self.wakers));
        let name = file_name(key);
        let notify = self.wakers().entry(name.clone()).or_default().clone();
        Waker {
            backend: self,
            name,
            notify,
        }
    }

    /// Wakes this process's waiters on `key`, if there are any.
    fn wake(&self, key: &LockKey) {
        if let Some(notify) = self.wakers().get(&file_name(key)) {
            notify.notify_waiters();
        }
    }

    /// Runs `op` on the locked file of `key`, to completion even if the caller goes away.
    ///
    /// Where the file's `flock` is free at once (an uncontended key on a local disk), the
    /// operation runs in the caller's task, in its first poll: a few syscalls on the file,
    /// cheaper than a hand-off to a blocking thread and back, with no await point while
    /// the `flock` is held. The rest runs on a blocking thread, which finishes it whatever
    /// becomes of the caller: an operation that finds the `flock` taken (a paused process
    /// may hold it long) waits for it there, and one whose state needs a sync (a moved
    /// ceiling of tokens, [`Locked::store`], which only a grant moves) lets go of the
    /// `flock` before anything is written and runs again there from the start (so `op` may
    /// run twice; only its last run's changes are written). So no `flock` is ever held
    /// while waiting for a blocking thread: with the pool busy (its threads waiting for
    /// `flock`s, say), one held there would keep its key from every process, and a thread
    /// waiting for that same `flock` would wait forever. A grant's caller that goes away
    /// still receives its grant ([`detached_acquire`] gives it back).
    ///
    /// On a network or FUSE file system (see [`FsKind`]) every operation runs on a blocking
    /// thread: a `flock` there is a request to a server, and an outage could block the
    /// runtime's worker for as long as it lasts.
    async fn with_file<T, F>(&self, key: &LockKey, doing: &'static str, op: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&mut Locked, u64) -> Result<T> + Send + 'static,
    {
        in_runtime()?;
        let path = self.path(key);
        let mut opened = None;
        if self.fs != FsKind::Remote {
            let file = Locked::open(&path).map_err(|e| io_error(doing, &path, e))?;
            match file.try_lock() {
                Ok(()) => match apply(file, &path, doing, &op)? {
                    Applied::Done(outcome) => return outcome,
                    // Nothing written yet: the `flock` goes with the file (closed here),
                    // and the operation runs again on a blocking thread.
                    Applied::Unsynced(_) => {}
                },
                Err(std::fs::TryLockError::WouldBlock) => opened = Some(file),
                Err(std::fs::TryLockError::Error(e)) => return Err(io_error(doing, &path, e)),
            }
        }
        // One blocking thread per key waits for its `flock` at a time; this process's other
        // operations on the key wait for their turn here, without a thread: given up at
        // their bound (an inquiry, a release at `response_bound`), they left a blocking
        // thread each waiting for a `flock` another process kept, until the pool was all
        // waiting for it and other keys' operations were refused.
        let turn = self.flock_turn(&path).await;
        blocking(move || {
            let file = match opened {
                Some(file) => file,
                None => Locked::open(&path).map_err(|e| io_error(doing, &path, e))?,
            };
            let locked = file.lock();
            // The turn is for waiting: once the `flock` is taken (or refused), the next
            // operation may begin its own wait while this one works, and is handed the
            // `flock` by the kernel the moment this one lets go (a handoff among this
            // process's waiters took one more wake-up and thread hand-over before).
            drop(turn);
            locked.map_err(|e| io_error(doing, &path, e))?;
            match apply(file, &path, doing, &op)? {
                Applied::Done(outcome) => outcome,
                Applied::Unsynced(write) => (*write).finish(&path, doing),
            }
        })
        .await
    }

    /// The turn of an operation on the file at `path` to wait for its `flock` on a
    /// blocking thread (see [`FileBackend::with_file`]).
    async fn flock_turn(&self, path: &Path) -> FlockTurn {
        let name = path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default();
        let gate = {
            let mut turns = self.flock_turns.lock().unwrap_or_else(|e| e.into_inner());
            let entry = turns.entry(name.clone()).or_default();
            entry.users += 1;
            entry.gate.clone()
        };
        let mut turn = FlockTurn {
            turns: self.flock_turns.clone(),
            name,
            held: None,
        };
        turn.held = Some(gate.lock_owned().await);
        turn
    }

    /// One grant attempt, given up at `until` (see [`FLOCK_GRACE`]): [`Stalled`] then.
    /// `waiting`: the caller waits, so a writer that is refused leaves (or renews) its
    /// marker, as its [`Marker`] records.
    ///
    /// While an earlier attempt of this process on the same key was given up and still
    /// waits for the file's `flock`, a new one waits for it to end (within its own bound)
    /// instead of waiting for that `flock` on a blocking thread of its own: retried tries
    /// otherwise piled up one blocking thread each, until the pool was all waiting for one
    /// `flock` and other keys' operations waited behind them; and a next attempt of the
    /// same request could be granted the very hold the earlier one's give-back then let go.
    async fn attempt(
        &self,
        req: &AcquireRequest,
        waiting: Option<Marker>,
        until: Instant,
    ) -> std::result::Result<Result<Attempt>, Stalled> {
        // A timer needs a runtime with timers: without, the error that says so (not a panic).
        if let Err(error) = in_runtime().and_then(|()| crate::backend::timers_enabled()) {
            return Ok(Err(error));
        }
        if let Some(earlier) = self.stalled_on(&req.key)
            && tokio::time::timeout_at(until, earlier.cancelled_owned())
                .await
                .is_err()
        {
            return Err(Stalled);
        }
        // The attempt runs detached: given up here, it goes on in a task of its own, and a
        // grant it still makes (once the flock is free) is given back.
        let done = tokio_util::sync::CancellationToken::new();
        let finished = Arc::new(done.clone().drop_guard());
        // Noted as stalled when given up here, and also when the caller drops this future
        // first (its own timeout, a `select!`): the attempt goes on detached all the same.
        let mut unfinished = NoteUnfinished {
            backend: self,
            key: &req.key,
            done: Some(done),
        };
        match tokio::time::timeout_at(until, self.detached_attempt(req, waiting, finished)).await {
            Ok(outcome) => {
                unfinished.done = None;
                Ok(outcome)
            }
            Err(_) => Err(Stalled),
        }
    }

    /// The end of an earlier attempt on `key` given up while it waited, if one still runs.
    fn stalled_on(&self, key: &LockKey) -> Option<tokio_util::sync::CancellationToken> {
        let stalled = self.stalled.lock().unwrap_or_else(|e| e.into_inner());
        if stalled.is_empty() {
            return None;
        }
        stalled
            .get(&file_name(key))
            .map(|attempt| attempt.done.clone())
            .filter(|done| !done.is_cancelled())
    }

    /// Notes an attempt on `key` given up while it still runs, until `done` fires.
    fn note_stalled(&self, key: &LockKey, done: tokio_util::sync::CancellationToken) {
        // Without a runtime (a future dropped after its runtime), nothing could take the
        // note away again.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if done.is_cancelled() {
            return;
        }
        let (name, id) = (file_name(key), uuid::Uuid::new_v4());
        let attempt = StalledAttempt {
            id,
            done: done.clone(),
        };
        self.stalled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), attempt);
        let stalled = self.stalled.clone();
        runtime.spawn(async move {
            done.cancelled().await;
            let mut stalled = stalled.lock().unwrap_or_else(|e| e.into_inner());
            if stalled.get(&name).is_some_and(|attempt| attempt.id == id) {
                stalled.remove(&name);
            }
        });
    }

    /// `finished` is dropped once the attempt, and the give-back of a grant it made after
    /// its caller went away, are over.
    async fn detached_attempt(
        &self,
        req: &AcquireRequest,
        waiting: Option<Marker>,
        finished: Arc<tokio_util::sync::DropGuard>,
    ) -> Result<Attempt> {
        let (this, request, giver) = (self.clone(), req.clone(), self.clone());
        let giving_back = finished.clone();
        detached_acquire(
            SCHEME,
            move |_| async move {
                let _finished = finished;
                let start = Instant::now();
                let req = request.clone();
                this.with_file(&request.key, "acquiring", move |file, now| {
                    grant_in(&mut file.state, &req, now, start, waiting.as_ref())
                })
                .await
            },
            Attempt::into_grant,
            move |grant| async move {
                let _finished = giving_back;
                // Not `release`, which would wait for this very attempt to end.
                let _ = giver.release_file(&grant).await;
            },
        )
        .await
    }

    /// Releases `grant` on its key's file (see [`LockBackend::release`]).
    async fn release_file(&self, grant: &Grant) -> Result<Released> {
        let held = grant.clone();
        let outcome = self
            .with_file(&grant.key, "releasing", move |file, now| {
                let Some(hold) = file.state.hold_of(&held, now) else {
                    return Err(Error::NotHeld {
                        key: held.key.clone(),
                    });
                };
                if !hold.attempts.take(held.attempt, *hold.depth) {
                    // A retried release: it took effect already.
                    return Ok(Released::Partially {
                        remaining: *hold.depth,
                    });
                }
                *hold.depth -= 1;
                if *hold.depth > 0 {
                    return Ok(Released::Partially {
                        remaining: *hold.depth,
                    });
                }
                file.state.end(&held);
                file.state.prune(now);
                Ok(Released::Fully)
            })
            .await;
        if matches!(outcome, Ok(Released::Fully)) {
            self.wake(&grant.key);
        }
        outcome
    }

    /// Removes `owner`'s writer marker from `key`, in the background.
    fn unmark(&self, key: &LockKey, owner: OwnerId) {
        let (this, key) = (self.clone(), key.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let removed = this
                    .with_file(&key, "unmarking", move |file, _| {
                        let before = file.state.writers.len();
                        file.state.writers.retain(|(o, _)| *o != owner);
                        Ok(file.state.writers.len() != before)
                    })
                    .await;
                if matches!(removed, Ok(true)) {
                    this.wake(&key);
                }
            });
        }
    }
}

/// How long past the caller's deadline (a try's: from its start) an acquisition attempt
/// may still wait for its key file's `flock`, or its sync, before it is given up. Another
/// process keeps a `flock` only for one short read and write, unless it was stopped in the
/// middle of one (SIGSTOP, a debugger) or its file system does not answer: without a bound,
/// a wait of a second waited for as long as that lasted.
const FLOCK_GRACE: Duration = Duration::from_secs(1);

/// How long any other operation waits for its key file's `flock` before its caller hears
/// a retryable error (see [`FileBackend`]'s `response_bound`).
const FLOCK_KEPT_AT_MOST: Duration = Duration::from_secs(5);

/// An attempt given up at its bound (see [`FLOCK_GRACE`]).
#[derive(Debug)]
struct Stalled;

/// Notes an attempt as stalled (see [`FileBackend::attempt`]) unless its outcome was
/// delivered: given up at its bound, or dropped by its caller before that.
struct NoteUnfinished<'a> {
    backend: &'a FileBackend,
    key: &'a LockKey,
    done: Option<tokio_util::sync::CancellationToken>,
}

impl Drop for NoteUnfinished<'_> {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            self.backend.note_stalled(self.key, done);
        }
    }
}

impl Stalled {
    /// What a try that was given up says.
    fn error(key: &LockKey) -> Error {
        Error::backend(
            SCHEME,
            true,
            format!(
                "the file of `{key}` stayed locked (`flock`) by an operation of another \
                 process for over {FLOCK_GRACE:?}: a process stopped in the middle of one \
                 (SIGSTOP, a debugger), or a file system that does not answer; try again \
                 (whatever this attempt may still take is given back)"
            ),
        )
    }
}

/// A file operation after its `op` ran: done, or a write to finish that needs a sync.
enum Applied<T> {
    Done(Result<T>),
    Unsynced(Box<Unsynced<T>>),
}

/// A file operation whose state moved the ceiling of tokens: still to write, with a sync
/// ([`Locked::store`]), before its outcome may leave. Holds the file's `flock`.
struct Unsynced<T> {
    locked: Locked,
    before: State,
    outcome: Result<T>,
}

impl<T> Unsynced<T> {
    /// Writes and syncs the state: the operation's outcome, or the write's error.
    fn finish(self, path: &Path, doing: &'static str) -> Result<T> {
        let Unsynced {
            mut locked,
            before,
            outcome,
        } = self;
        locked
            .store(&before, path)
            .map_err(|e| io_error(doing, path, e))?;
        outcome
    }
}

/// Reads `file` (its `flock` taken), prunes it, runs `op` on it and writes what `op`
/// changed, unless that needs a sync, which is left to the caller ([`Applied::Unsynced`]).
fn apply<T, F>(file: File, path: &Path, doing: &'static str, op: &F) -> Result<Applied<T>>
where
    F: Fn(&mut Locked, u64) -> Result<T>,
{
    let mut locked = Locked::read(file).map_err(|e| io_error(doing, path, e))?;
    let now = host_now();
    // Every write leaves the file pruned (see `State::prune`).
    locked.state.prune(now);
    let before = locked.state.clone();
    let outcome = op(&mut locked, now);
    if outcome.is_err() || locked.state == before {
        return Ok(Applied::Done(outcome));
    }
    if locked.state.ceiling != before.ceiling {
        return Ok(Applied::Unsynced(Box::new(Unsynced {
            locked,
            before,
            outcome,
        })));
    }
    locked
        .store(&before, path)
        .map_err(|e| io_error(doing, path, e))?;
    Ok(Applied::Done(outcome))
}

/// Warns when every user may delete or rename the lock files in `dir` (writable by others,
/// without the sticky bit that `/tmp` has): any of them could then take a held key's file
/// away, and another process would be granted the key while its holder still believes in
/// it (until its next renewal finds out). Not refused: a directory made under `umask 000`
/// (common in containers) is like that by accident, and still works among trusted users.
fn warn_if_others_can_break_locks(dir: &Path) {
    #[cfg(not(unix))]
    let _ = dir;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let Ok(meta) = std::fs::metadata(dir) else {
            return;
        };
        let mode = meta.permissions().mode();
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            tracing::warn!(
                dir = %dir.display(),
                "lock directory is writable by every user and not sticky: any user can \
                 delete or replace lock files and break the locks; `chmod o-w` it (or \
                 `chmod +t`), or use a directory of your own, e.g. /var/lib/<app>/locks"
            );
        }
    }
}

/// Microseconds since the Unix epoch by the wall clock (0 before it).
fn wall_clock_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
        })
}

/// Every file operation needs a Tokio runtime, whether or not this one would have used its
/// blocking threads: an error that says so, not a panic some of the time.
fn in_runtime() -> Result<()> {
    match tokio::runtime::Handle::try_current() {
        Ok(_) => Ok(()),
        Err(_) => Err(Error::Config(
            "the file backend needs a Tokio runtime (a taken flock and a sync are waited for \
             on its blocking threads); call it from within one"
                .into(),
        )),
    }
}

/// Runs `work` on a blocking thread; it finishes even if the caller goes away.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::backend_with_source(SCHEME, false, "a file operation panicked", e))?
}

/// Decides `req` on the state of its key's file (locked): a re-entry, a new hold by the
/// rules of [`admit`], or busy.
fn grant_in(
    state: &mut State,
    req: &AcquireRequest,
    now: u64,
    start: Instant,
    waiting: Option<&Marker>,
) -> Result<Attempt> {
    state.prune(now);
    let lease_end = now.saturating_add(nanos(req.ttl));
    let mine = if req.kind.is_exclusive() {
        (state.holder(now) == Some(req.owner) && state.kind == req.kind).then_some((
            &mut state.depth,
            &mut state.expires,
            &mut state.attempts,
            state.held_token,
        ))
    } else {
        state
            .shared
            .iter_mut()
            .find(|h| {
                same_hold(
                    (h.owner, h.kind),
                    (req.owner, req.kind),
                    &h.attempts,
                    req.attempt,
                )
            })
            .map(|h| (&mut h.depth, &mut h.expires, &mut h.attempts, h.token))
    };
    if let Some((depth, expires, attempts, token)) = mine {
        if !attempts.has(req.attempt) {
            // A re-entry (a retry of one that took effect adds nothing).
            *depth += 1;
            attempts.add(req.attempt);
        }
        // Never shorten the lease an outer guard relies on; a retried grant's guard counts
        // the lease from now, so it runs at least that long.
        *expires = (*expires).max(lease_end);
        return Ok(Attempt::Granted(Grant::new(
            req,
            FencingToken::new(token),
            *depth,
            start,
        )));
    }
    let writer_waits = !state.writers.is_empty();
    match admit(req, &state.views(now), writer_waits) {
        Err(Refusal::Refused(error)) => Err(error),
        Err(Refusal::Busy(until)) => {
            // A plain locker counts as a writer, but marks only where readers come: a
            // plain lock's poll then rewrites nothing.
            let marks = req.kind == LockKind::Write
                || (req.kind == LockKind::Exclusive && !state.shared.is_empty());
            if let Some(marker) = waiting.filter(|_| marks) {
                // Said before the caller's flag is read, and the caller sets its flag before
                // it reads this one: either this attempt sees that the caller left (and
                // marks nothing), or the caller sees the mark and takes it away (after this
                // file operation, whose flock it waits for).
                marker.marked.store(true, Ordering::SeqCst);
                // Renewed only once half of it has run: an attempt that rewrites nothing
                // does not wake the key's waiters (the file's changes wake them), itself
                // included.
                let fresh_until = now.saturating_add(nanos(WRITER_MARKER / 2));
                let fresh = state
                    .writers
                    .iter()
                    .any(|(owner, until)| *owner == req.owner && *until > fresh_until);
                if marker.cancelled.load(Ordering::SeqCst) {
                    state.writers.retain(|(owner, _)| *owner != req.owner);
                } else if !fresh {
                    state.writers.retain(|(owner, _)| *owner != req.owner);
                    let until = now.saturating_add(nanos(WRITER_MARKER));
                    state.writers.push((req.owner, until));
                }
            }
            Ok(match until {
                Some(until) => Attempt::busy(Duration::from_nanos(until.saturating_sub(now))),
                None => Attempt::Busy { lease_left: None },
            })
        }
        Ok(()) => {
            state.next_token(&req.key)?;
            state.writers.retain(|(owner, _)| *owner != req.owner);
            let mut attempts = AttemptLedger::new();
            attempts.add(req.attempt);
            let identity = Some(req.identity.encode());
            if req.kind.is_exclusive() {
                state.owner = Some(req.owner);
                state.held_token = state.token;
                state.kind = req.kind;
                state.identity = identity;
                state.depth = 1;
                state.attempts = attempts;
                state.expires = lease_end;
            } else {
                state.shared.push(SharedHold {
                    kind: req.kind,
                    owner: req.owner,
                    depth: 1,
                    expires: lease_end,
                    token: state.token,
                    attempts,
                    identity,
                });
            }
            Ok(Attempt::Granted(Grant::new(
                req,
                FencingToken::new(state.token),
                1,
                start,
            )))
        }
    }
}

/// A waiting writer's marker, as its attempts and its caller know it.
#[derive(Debug, Clone, Default)]
struct Marker {
    /// An attempt has written (or may write) the marker.
    marked: Arc<AtomicBool>,
    /// The wait is over: attempts still running must not write it.
    cancelled: Arc<AtomicBool>,
}

/// Takes a waiting writer's marker away when its wait ends without a grant (a grant takes
/// it in the same file operation), also when the wait is dropped with an attempt still
/// running (see [`grant_in`]).
struct WriterMark<'a> {
    backend: &'a FileBackend,
    req: &'a AcquireRequest,
    marker: Marker,
}

impl Drop for WriterMark<'_> {
    fn drop(&mut self) {
        self.marker.cancelled.store(true, Ordering::SeqCst);
        if self.marker.marked.load(Ordering::SeqCst) {
            self.backend.unmark(&self.req.key, self.req.owner);
        }
    }
}

#[async_trait]
impl LockBackend for FileBackend {
    /// 5 s. An operation waits only for the file's `flock`, which its holder keeps for one
    /// short read and write (and, once per 1,024 grants, a sync), unless that process was
    /// stopped in the middle of one (SIGSTOP, a debugger) or its file system does not
    /// answer. Then a release or an inquiry answers an error at this bound, rather than
    /// wait for as long as that lasts. The [`Locker`](crate::Locker)'s release given up on
    /// goes on in the background (a direct caller of this trait must keep polling it, or
    /// detach it, for it to take effect) and takes effect once the `flock` is free. An
    /// acquisition bounds itself more tightly: a second past its deadline at the latest (a
    /// try: a second after it began).
    fn response_bound(&self) -> Duration {
        FLOCK_KEPT_AT_MOST
    }

    fn info(&self) -> BackendInfo {
        BackendInfo::new(
            SCHEME,
            Consistency::Cp,
            Capabilities {
                notified_wait: false,
                read_write: true,
                writer_preference: true,
                semaphore: true,
                ..Capabilities::default()
            },
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        match self.attempt(req, None, Instant::now() + FLOCK_GRACE).await {
            Ok(attempt) => Ok(attempt?.into_grant()),
            Err(Stalled) => Err(Stalled::error(&req.key)),
        }
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        let started = Instant::now();
        let deadline = crate::wait::deadline_after(wait);
        // Each attempt is given up at the deadline, or a moment after it for one that began
        // late (see `FLOCK_GRACE`): past the deadline, a key whose file another process
        // keeps locked is busy.
        let bound = move || deadline.max(Instant::now() + FLOCK_GRACE);
        let timeout = || Error::Timeout {
            key: req.key.clone(),
            waited: started.elapsed(),
        };
        // A free key is granted before any waiting is set up (the waiter's registration,
        // the directory's watch, whose thread then hears every write in the directory).
        // A refusal falls through to the wait, which tries again at once.
        // Errors as the wait takes them: only a retryable one is tried again.
        match self.attempt(req, None, bound()).await {
            Ok(Ok(Attempt::Granted(grant))) => return Ok(grant),
            Ok(Ok(Attempt::Busy { .. })) | Err(Stalled) if Instant::now() >= deadline => {
                return Err(timeout());
            }
            Ok(Ok(Attempt::Busy { .. })) | Err(Stalled) => {}
            Ok(Err(e)) if e.is_retryable() && !wait.is_zero() => {}
            Ok(Err(e)) => return Err(e),
        }
        let mut waker = self.waker(&req.key);
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(50),
        ));
        let mark = WriterMark {
            backend: self,
            req,
            marker: Marker::default(),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let granted = wait_for_grant(&req.key, left, policy, &mut waker, || {
            let attempt = self.attempt(req, Some(mark.marker.clone()), bound());
            async move {
                attempt
                    .await
                    .unwrap_or(Ok(Attempt::Busy { lease_left: None }))
            }
        })
        .await
        .map_err(|error| match error {
            // The whole wait, the first attempt's included.
            Error::Timeout { .. } => timeout(),
            other => other,
        });
        if granted.is_ok() {
            // The grant took the marker with it.
            mark.marker.marked.store(false, Ordering::SeqCst);
        }
        granted
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        let held = grant.clone();
        self.with_file(&grant.key, "renewing", move |file, now| {
            let Some(hold) = file.state.hold_of(&held, now) else {
                return Err(Error::NotHeld {
                    key: held.key.clone(),
                });
            };
            *hold.expires = (*hold.expires).max(now.saturating_add(nanos(ttl)));
            Ok(())
        })
        .await
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        // Behind an attempt on the key given up while it waited for the file's `flock` (a
        // process stopped mid-operation keeps it): waited for here, without a blocking
        // thread each. A failed acquisition's give-back (sent by the locker for an attempt
        // whose outcome it cannot know) is such a release, one per try given up.
        if let Some(earlier) = self.stalled_on(&grant.key) {
            earlier.cancelled_owned().await;
        }
        self.release_file(grant).await
    }

    async fn ping(&self) -> Result<()> {
        in_runtime()?;
        let dir = self.dir.clone();
        blocking(move || {
            std::fs::metadata(&*dir)
                .map(|_| ())
                .map_err(|e| io_error("reading", &dir, e))
        })
        .await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        Ok(self.holders(key).await?.into_iter().next())
    }

    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        in_runtime()?;
        let path = self.path(key);
        // Not made for an inspection. A stat, which on a network file system may wait for
        // its server: off the runtime's workers there, as every file operation.
        let exists = match self.fs {
            FsKind::Remote => {
                let path = path.clone();
                blocking(move || Ok(path.exists())).await?
            }
            _ => path.exists(),
        };
        if !exists {
            return Ok(Vec::new());
        }
        self.with_file(key, "inspecting", move |file, now| {
            let state = &file.state;
            let info = |owner: OwnerId, depth, token, expires: u64, identity: Option<&str>| {
                HolderInfo::new(
                    owner.to_string(),
                    depth,
                    Some(FencingToken::new(token)),
                    Some(Duration::from_nanos(expires.saturating_sub(now))),
                )
                .with_identity(identity.and_then(HolderIdentity::decode))
            };
            let first = state.holder(now).map(|owner| {
                let holder = info(
                    owner,
                    state.depth,
                    state.held_token,
                    state.expires,
                    state.identity.as_deref(),
                );
                match state.kind {
                    LockKind::Exclusive => holder,
                    kind => holder.with_kind(kind),
                }
            });
            let shared = state.shared.iter().filter(|h| h.expires > now).map(|h| {
                info(h.owner, h.depth, h.token, h.expires, h.identity.as_deref()).with_kind(h.kind)
            });
            Ok(first.into_iter().chain(shared).collect())
        })
        .await
    }
}

/// The directory a `file://` URL names (see [`FileBackend::from_url`]).
fn dir_of_url(url: &str) -> Result<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    let shown = crate::config::redact_url(url);
    let Some(rest) = url.strip_prefix("file://") else {
        return Err(Error::Config(format!(
            "`{shown}` is not a file URL; write file:///absolute/path/to/dir"
        )));
    };
    if rest.contains('#') {
        return Err(Error::Config(format!(
            "`{shown}` has a fragment (`#...`), which names no directory: write a `#` in the \
             path as %23"
        )));
    }
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    // file:///dir and file://localhost/dir name the same directory; no other host does.
    let (host, path) = match rest.find('/') {
        Some(slash) => rest.split_at(slash),
        None => (rest, ""),
    };
    if !host.is_empty() && !host.eq_ignore_ascii_case("localhost") {
        return Err(Error::Config(format!(
            "`{shown}` names the host `{host}`: a file URL names a directory of this machine, \
             file:///absolute/path/to/dir (or file://localhost/...)"
        )));
    }
    if path.is_empty() {
        return Err(Error::Config(format!(
            "`{shown}` must name an absolute directory: file:///var/lib/app/locks[?ttl=30s]"
        )));
    }
    crate::config::only_ttl_option(url, query)?;
    let bad = |what: &str| Error::Config(format!("{what} in the path of `{shown}`"));
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let byte = path
                .get(i + 1..i + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or_else(|| bad("a bad percent escape (write %XX with two hex digits)"))?;
            if byte == 0 {
                return Err(bad("a NUL (%00), which no path may hold"));
            }
            decoded.push(byte);
            i += 3;
        } else {
            decoded.push(bytes[i]);
            i += 1;
        }
    }
    let dir = PathBuf::from(std::ffi::OsString::from_vec(decoded));
    // Versions before this one took the path literally (and created it): where that
    // directory exists, processes of those versions lock there, and this one would lock
    // in another directory, each granting the same keys.
    let literal = Path::new(path);
    if dir.as_path() != literal && literal.is_dir() {
        return Err(Error::Config(format!(
            "`{shown}` names `{}` (its path is percent-decoded), but `{}` exists, which older lockkit \
             versions (taking a file URL's path literally) lock in for this URL: the two would \
             each grant the same keys. Write each literal `%` as `%25` to keep using \
             `{}`, or move it away",
            dir.display(),
            literal.display(),
            literal.display()
        )));
    }
    Ok(dir)
}

#[cfg(test)]
mod url_tests {
    use super::*;

    /// The directory of `url`, or the error's text.
    fn dir(url: &str) -> std::result::Result<PathBuf, String> {
        dir_of_url(url).map_err(|e| e.to_string())
    }

    #[test]
    fn file_urls_name_local_directories_percent_decoded() {
        assert_eq!(dir("file:///var/lib/locks"), Ok("/var/lib/locks".into()));
        assert_eq!(
            dir("file:///var/lib/locks?ttl=3s"),
            Ok("/var/lib/locks".into())
        );
        assert_eq!(
            dir("file://localhost/var/lib/locks"),
            Ok("/var/lib/locks".into())
        );
        assert_eq!(dir("file://LOCALHOST/x"), Ok("/x".into()));
        assert_eq!(dir("file:///var/my%20locks"), Ok("/var/my locks".into()));
        // A `+` in a path is itself, not a space (that is only in query strings).
        assert_eq!(dir("file:///var/a+b"), Ok("/var/a+b".into()));
        assert_eq!(dir("file:///tmp/%23one"), Ok("/tmp/#one".into()));
        assert_eq!(dir("file:///tmp/caf%C3%A9"), Ok("/tmp/caf\u{e9}".into()));
        // Not UTF-8 is still a path on Linux.
        assert_eq!(
            dir("file:///tmp/%FF").map(|p| p.into_os_string().into_encoded_bytes()),
            Ok(b"/tmp/\xff".to_vec())
        );
    }

    #[test]
    fn the_url_of_a_directory_reads_back_as_that_directory() {
        use std::os::unix::ffi::OsStrExt;
        for dir in [
            &b"/var/lib/locks"[..],
            b"/tmp/a b",
            b"/tmp/100%",
            b"/tmp/x#y?z=1",
            b"/tmp/caf\xc3\xa9",
            b"/tmp/\xff\xfe",
            b"/tmp/line\nbreak",
        ] {
            let dir = Path::new(std::ffi::OsStr::from_bytes(dir));
            let url = FileBackend::url_of(dir);
            assert_eq!(dir_of_url(&url).ok().as_deref(), Some(dir), "{url}");
        }
        assert_eq!(
            FileBackend::url_of(Path::new("/tmp/lockkit")),
            "file:///tmp/lockkit"
        );
    }

    /// Finding 3 (helper-44): before b312e2b the path of a file URL was taken literally, and
    /// `FileBackend::open` created it: `file:///var/my%20locks` locked in `/var/my%20locks`.
    /// Read percent-decoded, the same URL names `/var/my locks`, a directory of its own: a
    /// process of the older version and one of this one, configured alike (a rolling
    /// upgrade), would each grant the same key. Where the literal directory exists, the URL
    /// is refused, saying which directory it named before.
    #[test]
    fn a_url_whose_escapes_an_older_version_read_literally_is_refused_where_that_directory_exists()
    {
        let base = std::env::temp_dir().join(format!("lockkit-url-{}", uuid::Uuid::new_v4()));
        let literal = base.join("my%20locks");
        std::fs::create_dir_all(&literal).unwrap();
        let url = format!("file://{}", literal.display());
        let outcome = dir(&url);
        // The URL of the directory that exists still reads back as it.
        let escaped = dir_of_url(&FileBackend::url_of(&literal)).ok();
        std::fs::remove_dir_all(&base).ok();
        assert_eq!(escaped.as_deref(), Some(literal.as_path()));
        let error = outcome.expect_err(
            "the URL named the literal directory before (which exists) and now another one",
        );
        assert!(
            error.contains("my%20locks") && error.contains("%25"),
            "{error}"
        );
    }

    #[test]
    fn file_urls_that_name_no_local_directory_are_refused_saying_why() {
        for (url, says) in [
            ("redis://h/x", "not a file URL"),
            ("file://", "absolute directory"),
            ("file://localhost", "absolute directory"),
            ("file://relative/dir", "names the host `relative`"),
            ("file://server.example/share", "names the host"),
            ("file:///tmp/locks#part", "fragment"),
            ("file:///tmp/locks?ttl=3s#part", "fragment"),
            ("file:///tmp/%zz", "bad percent escape"),
            ("file:///tmp/%4", "bad percent escape"),
            ("file:///tmp/a%00b", "NUL"),
            ("file:///tmp/x?wait=3s", "unknown option `wait`"),
        ] {
            let error = dir(url).expect_err(url);
            assert!(error.contains(says), "{url}: {error}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Seek, SeekFrom, Write};

    use super::*;

    #[test]
    fn state_round_trips() {
        let state = State {
            ceiling: 7,
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
            held_token: 7,
            ..State::default()
        };
        assert_eq!(State::parse(&state.render()), state);
        assert_eq!(
            state
                .render()
                .lines()
                .next()
                .unwrap()
                .split_whitespace()
                .count(),
            6
        );
        // A holder whose token is below the counter (a read was granted beside it since):
        // an eighth field, which older versions do not read.
        let pinned = State {
            ceiling: 9,
            token: 9,
            ..state.clone()
        };
        let text = pinned.render();
        assert_eq!(State::parse(&text), pinned);
        let first: Vec<&str> = text.lines().next().unwrap().split_whitespace().collect();
        assert_eq!((first[0], first[6], first[7]), ("9", "x", "t7"), "{text}");
        // Tokens reserved up to 1030, the last handed out 8: the ceiling first (what older
        // versions count from), the holder's own token where they read it, `n` last.
        let reserved = State {
            ceiling: 1030,
            token: 8,
            ..state.clone()
        };
        let text = reserved.render();
        assert_eq!(State::parse(&text), reserved);
        let first: Vec<&str> = text.lines().next().unwrap().split_whitespace().collect();
        assert_eq!(
            (first[0], first[6], first[7], first[8]),
            ("1030", "x", "t7", "n8"),
            "{text}"
        );
        // Free, with a reserve: `n` after the tag.
        let free = State {
            ceiling: 1030,
            token: 8,
            ..State::default()
        };
        let text = free.render();
        assert_eq!(State::parse(&text), free);
        assert!(
            text.starts_with("1030 - 0 0 ") && text.ends_with(" - x n8\n"),
            "{text}"
        );
        // Read in this boot, the reserve stands; in another, or without a boot id, it is
        // spent.
        assert_eq!(load(&text).token, 8);
        let other = text.replace(boot_id(), "00000000-0000-0000-0000-000000000000");
        assert_eq!((load(&other).token, load(&other).ceiling), (1030, 1030));
        // A file from before attempts were stored: released unconditionally.
        let owner = OwnerId::random();
        let mut legacy = load(&format!("7 {owner} 2 99 -"));
        assert_eq!((legacy.token, legacy.depth), (7, 2));
        assert!(legacy.attempts.take(uuid::Uuid::new_v4(), legacy.depth));
        assert_eq!(State::parse(""), State::default());
    }

    /// Readers, permits and waiting writers round-trip, and a file held only by readers
    /// shows a live holder on its first line, which is all an older lockkit reads.
    #[test]
    fn shared_holds_round_trip_and_look_held_to_older_versions() {
        let reader = |kind| SharedHold {
            kind,
            owner: OwnerId::random(),
            depth: 2,
            expires: 500,
            token: 8,
            attempts: AttemptLedger::parse(&uuid::Uuid::new_v4().to_string()),
            identity: Some(HolderIdentity::now().encode()),
        };
        let permit = LockKind::Permit {
            limit: std::num::NonZeroU32::new(4).unwrap(),
        };
        let state = State {
            ceiling: 9,
            token: 9,
            shared: vec![reader(LockKind::Read), reader(permit)],
            writers: vec![(OwnerId::random(), 700)],
            ..State::default()
        };
        let text = state.render();
        assert_eq!(State::parse(&text), state);
        let first: Vec<&str> = text.lines().next().unwrap().split_whitespace().collect();
        assert!(
            state.shared.iter().any(|h| first[1] == h.owner.to_string()),
            "{text}"
        );
        assert_eq!((first[2], first[3]), ("1", "500"), "{text}");
        let writer = State {
            ceiling: 3,
            token: 3,
            held_token: 3,
            owner: Some(OwnerId::random()),
            depth: 1,
            expires: 99,
            kind: LockKind::Write,
            ..State::default()
        };
        assert_eq!(State::parse(&writer.render()), writer);
    }

    fn temp_dir(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("lockkit-file-unit-{name}-{}", uuid::Uuid::new_v4()))
    }

    /// A test's lock directory, removed when dropped (before, every run of these tests left
    /// its directories behind: over 1,800 of them in this machine's `/tmp`).
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            Scratch(temp_dir(name))
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A backend on a scratch directory of its own; the directory goes with the
    /// [`Scratch`] (bind it before the backend, so the backend is dropped first).
    fn scratch_backend(name: &str) -> (Scratch, FileBackend) {
        let scratch = Scratch::new(name);
        let backend = FileBackend::open(&scratch.0).unwrap();
        (scratch, backend)
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
        let (_scratch, backend) = scratch_backend("boot");
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

    const OTHER_BOOT: &str = "00000000-0000-0000-0000-000000000000";

    /// Grants `key` to a new owner and releases it at once: the token handed out.
    async fn grant_once(backend: &FileBackend, key: &LockKey) -> u64 {
        let grant = backend
            .try_acquire(&request(key, Duration::from_secs(30)))
            .await
            .unwrap()
            .expect("the key is free");
        backend.release(&grant).await.unwrap();
        grant.token.get()
    }

    #[test]
    fn padding_goes_on_the_first_line_and_only_within_its_bound() {
        assert_eq!(pad_to("1 - 0\n", 6), None, "as long as the file");
        assert_eq!(pad_to("1 - 0\n", 3), None, "longer than the file");
        assert_eq!(pad_to("1 - 0\n", 9).as_deref(), Some("1 - 0   \n"));
        assert_eq!(pad_to("1 - 0", 7).as_deref(), Some("1 - 0  "));
        assert_eq!(
            pad_to("1 a 1\nwho\nr b 1\n", 20).as_deref(),
            Some("1 a 1    \nwho\nr b 1\n")
        );
        let text = "7 - 0 0 boot -\n";
        let at_most = text.len() as u64 + PAD_AT_MOST;
        let padded = pad_to(text, at_most).unwrap();
        assert_eq!(padded.len() as u64, at_most);
        assert_eq!(State::parse(&padded), State::parse(text));
        assert_eq!(pad_to(text, at_most + 1), None, "past the bound: truncated");
    }

    /// A release pads the shorter free text to the file's length instead of truncating
    /// (a truncation cost a sixth of an uncontended pair), the padded file reads as the
    /// text it pads, and a file far longer than its text is still cut down to it.
    #[tokio::test]
    async fn a_release_pads_the_file_rather_than_truncating_it() {
        let (_scratch, backend) = scratch_backend("pad");
        let key = LockKey::new("k").unwrap();
        let path = backend.path(&key);
        let first = grant_once(&backend, &key).await;
        let held = backend
            .try_acquire(&request(&key, Duration::from_secs(30)))
            .await
            .unwrap()
            .expect("the key is free");
        let held_text = std::fs::read_to_string(&path).unwrap();
        backend.release(&held).await.unwrap();
        let free_text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(free_text.len(), held_text.len(), "{free_text:?}");
        let (first_line, rest) = free_text.split_once('\n').unwrap();
        assert!(first_line.ends_with(' '), "{free_text:?}");
        assert_eq!(rest, "", "the padding stays on the first line");
        let state = load(&free_text);
        assert_eq!(state.owner, None);
        assert_eq!(state, load(&State::parse(&free_text).render()));
        assert_eq!(grant_once(&backend, &key).await, held.token.get() + 1);
        assert!(held.token.get() > first);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            held_text.len() as u64
        );

        // Far longer than its text (a file that once had many readers): cut down.
        let now = std::fs::read_to_string(&path).unwrap();
        let long = format!(
            "{}\n{}\n",
            now.lines().next().unwrap().trim_end(),
            " ".repeat(3000)
        );
        std::fs::write(&path, &long).unwrap();
        let token = grant_once(&backend, &key).await;
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(len <= held_text.len() as u64 + 8, "{len} bytes left");
        assert_eq!(token, held.token.get() + 2);
    }

    fn dir_sync_count(path: &Path) -> u64 {
        dir_syncs().get(path).copied().unwrap_or(0)
    }

    fn sync_count(path: &Path) -> u64 {
        syncs().get(path).map_or(0, |(count, _)| *count)
    }

    /// What a power loss and the reboot after it leave of `path`: the text `disk` (what had
    /// reached the disk), written in the boot before this one.
    fn power_loss(path: &Path, disk: &str) {
        std::fs::write(path, disk.replace(boot_id(), OTHER_BOOT)).unwrap();
    }

    #[tokio::test]
    async fn uncontended_grants_sync_once_per_reserve() {
        let (_scratch, backend) = scratch_backend("reserve");
        let key = LockKey::new("k").unwrap();
        // A new key's tokens start from the wall clock (µs); then one by one.
        let first = grant_once(&backend, &key).await;
        assert!(first > 1_600_000_000_000_000, "{first}");
        for i in 1..300 {
            assert_eq!(grant_once(&backend, &key).await, first + i);
        }
        assert_eq!(
            sync_count(&backend.path(&key)),
            1,
            "300 grants of a key synced more than its one reserve"
        );
        // A read and a permit draw on the same reserve.
        let read = backend
            .try_acquire(&request(&key, Duration::from_secs(30)).with_kind(LockKind::Read))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read.token.get(), first + 300);
        backend.release(&read).await.unwrap();
        assert_eq!(sync_count(&backend.path(&key)), 1);
    }

    /// A power loss keeps of a lock file what was synced, or any later state (the writes
    /// since may or may not have reached the disk, the first line's fields in one piece: a
    /// sector is written whole, and only a padded line's trailing spaces reach past the
    /// first), and the reboot after it brings a new boot id: the next token is
    /// above every token handed out before, whichever it kept.
    #[tokio::test]
    async fn a_power_loss_never_hands_out_a_token_twice() {
        let (_scratch, backend) = scratch_backend("power");
        let key = LockKey::new("k").unwrap();
        let path = backend.path(&key);
        let mut highest = 0;
        for round in 0..8 {
            let mut written = Vec::new();
            for _ in 0..3 + round {
                let token = grant_once(&backend, &key).await;
                assert!(token > highest, "round {round}: {token} after {highest}");
                highest = token;
                written.push(std::fs::read_to_string(&path).unwrap());
            }
            // Sometimes a holder was still there when the power went.
            let held = (round % 2 == 1).then_some(());
            let held = match held {
                Some(()) => {
                    let grant = backend
                        .try_acquire(&request(&key, Duration::from_secs(3600)))
                        .await
                        .unwrap()
                        .unwrap();
                    assert!(grant.token.get() > highest);
                    highest = grant.token.get();
                    Some(grant)
                }
                None => None,
            };
            let synced = syncs().get(&path).unwrap().1.clone();
            let latest = std::fs::read_to_string(&path).unwrap();
            let disk = match round % 4 {
                0 => synced,
                1 => latest,
                // Some of the writes since reached the disk, the later ones did not.
                2 => written[1].clone(),
                // The first line synced, the rest from later (the file spans sectors).
                _ => {
                    let first = synced.lines().next().unwrap().to_owned();
                    let rest: String = latest.lines().skip(1).map(|l| format!("{l}\n")).collect();
                    format!("{first}\n{rest}")
                }
            };
            power_loss(&path, &disk);
            drop(held);
        }
        let token = grant_once(&backend, &key).await;
        assert!(token > highest, "{token} after {highest}");
    }

    /// A process that dies between writing a new ceiling and its sync leaves a ceiling that
    /// may not be on the disk: the next grant in this boot syncs again rather than trust it.
    #[tokio::test]
    async fn a_ceiling_that_may_not_be_synced_is_not_relied_on() {
        let (_scratch, backend) = scratch_backend("unsynced");
        let key = LockKey::new("k").unwrap();
        let path = backend.path(&key);
        let first = grant_once(&backend, &key).await;
        // The first write of a grant that moves the ceiling, as it was before its sync.
        let written = syncs().get(&path).unwrap().1.clone();
        std::fs::write(&path, &written).unwrap();
        // Its grant's lease holds the key until it runs out: end it now.
        assert!(backend.take_away(&key).await.unwrap());
        let before = sync_count(&path);
        let token = grant_once(&backend, &key).await;
        assert!(token > first);
        assert_eq!(
            sync_count(&path),
            before + 1,
            "an unconfirmed ceiling was relied on"
        );
        // And then the power goes: the disk has what that grant synced.
        let synced = syncs().get(&path).unwrap().1.clone();
        assert_ne!(synced, written);
        power_loss(&path, &synced);
        assert!(grant_once(&backend, &key).await > token);
    }

    /// A grant whose ceiling's sync fails is not granted, and leaves nothing in the file
    /// that a retry of the same attempt (the same request) could take for its grant: the
    /// retry's token is under a synced ceiling.
    #[tokio::test]
    async fn a_failed_sync_grants_nothing_a_retry_could_find() {
        let (_scratch, backend) = scratch_backend("failsync");
        let key = LockKey::new("k").unwrap();
        let path = backend.path(&key);
        grant_once(&backend, &key).await;
        for step in [Failing::Sync, Failing::Write] {
            // Spend the reserve so that the next grant moves the ceiling.
            let text = std::fs::read_to_string(&path).unwrap();
            let spent: String = text
                .split_inclusive(' ')
                .filter(|f| !f.starts_with('n'))
                .collect();
            std::fs::write(&path, spent).unwrap();
            let req = request(&key, Duration::from_secs(30));
            failing_syncs().insert(path.clone(), step);
            let failed = backend.acquire(&req, Duration::from_secs(1)).await;
            failing_syncs().remove(&path);
            assert!(failed.is_err(), "{step:?}: granted without a sync");
            assert!(
                backend.inspect(&key).await.unwrap().is_none(),
                "{step:?}: a failed grant holds"
            );
            let grant = backend.try_acquire(&req).await.unwrap().unwrap();
            backend.release(&grant).await.unwrap();
            let synced = syncs().get(&path).unwrap().1.clone();
            power_loss(&path, &synced);
            assert!(grant_once(&backend, &key).await > grant.token.get());
        }
    }

    /// What a lockkit version from before the reserve does to a key's file (it reads the
    /// first field as the key's counter, knows `t<token>` but not `n<token>`): a grant adds
    /// one to the first field, and is synced; its release leaves that token; any other
    /// write keeps the first field and drops `n`. Returns the token it granted.
    fn older_version_writes(path: &Path, grant: bool) -> Option<u64> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .unwrap();
        file.lock().unwrap();
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        let first = text.lines().next().unwrap_or("").to_owned();
        let counter: u64 = first
            .split_whitespace()
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        let (text, token) = if grant {
            let token = counter + 1;
            (format!("{token} - 0 0 {} -\n", boot_id()), Some(token))
        } else {
            let kept: Vec<&str> = first
                .split_whitespace()
                .filter(|f| !f.starts_with('n'))
                .collect();
            let rest: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
            (format!("{}\n{rest}", kept.join(" ")), None)
        };
        file.seek(SeekFrom::Start(0)).unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file.set_len(text.len() as u64).unwrap();
        if grant {
            file.sync_data().unwrap();
            synced(path, &text);
        }
        token
    }

    /// Older and newer versions on one key: every token is above all handed out before, by
    /// either, also after a power loss.
    #[tokio::test]
    async fn older_and_newer_versions_on_one_key_never_repeat_a_token() {
        let (_scratch, backend) = scratch_backend("mixed");
        let key = LockKey::new("k").unwrap();
        let path = backend.path(&key);
        let mut highest = 0;
        let mut saw = |token: u64, who: &str| {
            assert!(token > highest, "{who} handed out {token} after {highest}");
            highest = token;
        };
        for round in 0..4 {
            for _ in 0..3 {
                saw(grant_once(&backend, &key).await, "newer");
            }
            // An older version rewrites the file while a newer holder holds it (a
            // writer's marker, say), and drops `n`.
            let grant = backend
                .try_acquire(&request(&key, Duration::from_secs(30)))
                .await
                .unwrap()
                .unwrap();
            saw(grant.token.get(), "newer");
            older_version_writes(&path, false);
            // The holder keeps its token (the older version kept `t`).
            let info = backend.inspect(&key).await.unwrap().unwrap();
            assert_eq!(info.token.map(|t| t.get()), Some(grant.token.get()));
            backend.release(&grant).await.unwrap();
            saw(grant_once(&backend, &key).await, "newer");
            saw(older_version_writes(&path, true).unwrap(), "older");
            saw(grant_once(&backend, &key).await, "newer");
            saw(grant_once(&backend, &key).await, "newer");
            if round % 2 == 1 {
                let synced = syncs().get(&path).unwrap().1.clone();
                power_loss(&path, &synced);
                saw(older_version_writes(&path, true).unwrap(), "older");
            }
        }
    }

    /// The first grant of a key moves its ceiling, so its sync runs on a blocking thread
    /// after the grant is decided: a caller that goes away then still gets its grant given
    /// back (the key is free again), and the file's `flock` is let go.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_dropped_during_its_sync_is_given_back() {
        let (_scratch, backend) = scratch_backend("dropped");
        let mut cut_short = 0;
        for i in 0..20 {
            let key = LockKey::new(format!("k{i}")).unwrap();
            let req = request(&key, Duration::from_secs(3600));
            let mut attempt = Box::pin(backend.try_acquire(&req));
            // One poll: the grant is decided, its sync under way.
            let first = tokio::select! {
                biased;
                done = &mut attempt => Some(done),
                () = std::future::ready(()) => None,
            };
            if first.is_none() {
                cut_short += 1;
            }
            drop(attempt);
            let mut free = false;
            for _ in 0..500 {
                if backend.inspect(&key).await.unwrap().is_none() {
                    free = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            if first.is_none() {
                assert!(
                    free,
                    "a grant dropped during its sync was left behind: {}",
                    std::fs::read_to_string(backend.path(&key)).unwrap()
                );
            }
        }
        assert!(
            cut_short > 0,
            "no attempt was ever cut short during its sync"
        );
    }

    /// An operation that finds the file's `flock` taken waits for it on a blocking thread:
    /// the caller's runtime (here a single thread) goes on meanwhile.
    #[tokio::test]
    async fn a_taken_flock_is_waited_for_off_the_runtime() {
        let (_scratch, backend) = scratch_backend("flock");
        let key = LockKey::new("k").unwrap();
        let first = grant_once(&backend, &key).await;
        let other = Locked::open(&backend.path(&key)).unwrap();
        other.lock().unwrap();
        let attempt = tokio::spawn({
            let backend = backend.clone();
            let key = key.clone();
            async move { grant_once(&backend, &key).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!attempt.is_finished(), "granted through a taken flock");
        drop(other);
        let token = tokio::time::timeout(Duration::from_secs(10), attempt)
            .await
            .expect("the attempt never took the flock")
            .unwrap();
        assert_eq!(token, first + 1);
    }

    /// Whether another process could take `path`'s `flock` now.
    fn flock_free(path: &Path) -> bool {
        Locked::open(path).unwrap().try_lock().is_ok()
    }

    /// A first grant moves its key's ceiling, whose sync needs a blocking thread. With the
    /// blocking pool busy (here its one thread waits for another key's `flock`, held by a
    /// paused process), the grant waits for a thread without holding its key's `flock`:
    /// other processes can take the key meanwhile.
    #[test]
    fn a_grant_waiting_for_a_blocking_thread_holds_no_flock() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (_scratch, backend) = scratch_backend("parked");
            let k2 = LockKey::new("k2").unwrap();
            let paused = Locked::open(&backend.path(&k2)).unwrap();
            paused.lock().unwrap();
            let b = backend.clone();
            let w =
                tokio::spawn(
                    async move { b.try_acquire(&request(&k2, Duration::from_secs(30))).await },
                );
            tokio::time::sleep(Duration::from_millis(100)).await;
            let k = LockKey::new("k").unwrap();
            let a = tokio::time::timeout(
                Duration::from_millis(300),
                backend.try_acquire(&request(&k, Duration::from_secs(30))),
            )
            .await;
            assert!(a.is_err(), "granted with the only blocking thread busy");
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                assert!(
                    flock_free(&backend.path(&k)),
                    "a grant waiting for a blocking thread holds its key's flock"
                );
            }
            drop(paused);
            w.await.unwrap().unwrap().unwrap();
        });
    }

    /// The blocking pool's threads wait for a key's `flock`; when its holder lets go, a
    /// first grant in the caller's task may take the flock before them, and must not then
    /// wait for a blocking thread with it (they would wait for each other forever).
    #[test]
    fn a_grant_never_waits_for_a_blocking_thread_with_a_flock_waited_for_there() {
        let mut stuck = 0;
        for round in 0..10 {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .max_blocking_threads(1 + round % 2)
                .enable_all()
                .build()
                .unwrap();
            let deadlocked = rt.block_on(async {
                let (_scratch, backend) = scratch_backend("deadlock");
                let k = LockKey::new("k").unwrap();
                let other_process = Locked::open(&backend.path(&k)).unwrap();
                other_process.lock().unwrap();
                for _ in 0..2 {
                    let (b, k) = (backend.clone(), k.clone());
                    tokio::spawn(async move {
                        b.try_acquire(&request(&k, Duration::from_secs(30))).await
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                drop(other_process);
                let a = tokio::time::timeout(
                    Duration::from_secs(3),
                    backend.try_acquire(&request(&k, Duration::from_secs(30))),
                )
                .await;
                a.is_err()
            });
            if deadlocked {
                stuck += 1;
                // A deadlocked runtime cannot shut down its blocking pool: leak it.
                std::mem::forget(rt);
            }
        }
        assert_eq!(stuck, 0, "{stuck} of 10 rounds deadlocked");
    }

    /// Outside a Tokio runtime, a file operation says so (it needs the runtime's blocking
    /// threads for a taken flock or a sync), whether or not it would have needed them.
    #[test]
    fn outside_a_runtime_operations_fail_with_a_clear_error() {
        let (_scratch, backend) = scratch_backend("noruntime");
        let key = LockKey::new("k").unwrap();
        let req = request(&key, Duration::from_secs(30));
        let mut attempt = Box::pin(backend.try_acquire(&req));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match attempt.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Err(Error::Config(message))) => {
                assert!(message.contains("Tokio runtime"), "{message}");
            }
            other => panic!("{:?}", other.map(|r| r.map(|g| g.map(|g| g.token)))),
        }
    }

    /// Tokens stay below 2^63 (storage often keeps them as a signed 64-bit number): a key
    /// whose tokens are used up refuses new holds with an error that says so, and a
    /// ceiling near the end is cut short there.
    #[tokio::test]
    async fn used_up_tokens_refuse_new_holds() {
        let (_scratch, backend) = scratch_backend("overflow");
        let key = LockKey::new("k").unwrap();
        let path = backend.path(&key);
        let max = MAX_TOKEN;
        std::fs::write(&path, format!("{} - 0 0 {} -\n", max - 3, boot_id())).unwrap();
        assert_eq!(grant_once(&backend, &key).await, max - 2);
        assert_eq!(load(&std::fs::read_to_string(&path).unwrap()).ceiling, max);
        assert_eq!(grant_once(&backend, &key).await, max - 1);
        assert_eq!(grant_once(&backend, &key).await, max);
        for text in [
            format!("{max} - 0 0 {} -\n", boot_id()),
            format!("{} - 0 0 {} - x n{}\n", u64::MAX, boot_id(), u64::MAX),
        ] {
            std::fs::write(&path, &text).unwrap();
            let refused = backend
                .try_acquire(&request(&key, Duration::from_secs(30)))
                .await
                .unwrap_err();
            assert!(refused.to_string().contains("used up"), "{refused}");
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        }
    }

    /// The first grant of a new key syncs the directory too (the file's entry in it), so a
    /// power loss cannot take the file, and with it the key's tokens, away; later grants
    /// from the same reserve sync nothing.
    #[tokio::test]
    async fn a_new_keys_directory_entry_is_synced_before_its_first_token() {
        let (_scratch, backend) = scratch_backend("direntry");
        let key = LockKey::new("k").unwrap();
        let path = backend.path(&key);
        assert_eq!(dir_sync_count(&path), 0);
        grant_once(&backend, &key).await;
        assert_eq!(dir_sync_count(&path), 1);
        for _ in 0..5 {
            grant_once(&backend, &key).await;
        }
        assert_eq!(dir_sync_count(&path), 1);
    }

    /// On a network or FUSE file system every operation runs on a blocking thread: the
    /// same outcomes, and a caller's runtime that never runs file I/O on its workers
    /// (here a taken `flock` on a single-threaded runtime: a timer still fires meanwhile).
    #[tokio::test]
    async fn on_a_network_file_system_operations_run_off_the_runtime() {
        let (_scratch, mut backend) = scratch_backend("remote");
        backend.fs = FsKind::Remote;
        let key = LockKey::new("k").unwrap();
        let first = grant_once(&backend, &key).await;
        for i in 1..3 {
            assert_eq!(grant_once(&backend, &key).await, first + i);
        }
        let held = backend
            .try_acquire(&request(&key, Duration::from_secs(30)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(backend.holders(&key).await.unwrap().len(), 1);
        backend.release(&held).await.unwrap();
        assert!(backend.inspect(&key).await.unwrap().is_none());
        let other = Locked::open(&backend.path(&key)).unwrap();
        other.lock().unwrap();
        let attempt = tokio::spawn({
            let backend = backend.clone();
            let key = key.clone();
            async move { grant_once(&backend, &key).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!attempt.is_finished());
        drop(other);
        assert_eq!(attempt.await.unwrap(), first + 4);
        assert!(
            backend.flock_turns.lock().unwrap().is_empty(),
            "a key's turns at its flock outlived their operations"
        );
    }

    #[test]
    fn network_and_fuse_file_systems_are_told_apart() {
        for magic in [0x6969, 0xFF53_4D42, 0xFE53_4D42, 0x6573_5546, 0x0102_1997] {
            assert_eq!(FsKind::from_magic(magic), FsKind::Remote, "{magic:#x}");
        }
        assert_eq!(FsKind::from_magic(0x0102_1994), FsKind::Tmpfs);
        assert_eq!(FsKind::from_magic(0xEF53), FsKind::Local);
    }

    /// A free key is granted without setting up a wait: no directory watch (whose thread
    /// would then hear every write in the directory) and no waiter's entry.
    #[tokio::test]
    async fn an_uncontended_acquire_sets_up_no_wait() {
        let (_scratch, backend) = scratch_backend("fast");
        let key = LockKey::new("k").unwrap();
        for _ in 0..3 {
            let grant = backend
                .acquire(
                    &request(&key, Duration::from_secs(30)),
                    Duration::from_secs(5),
                )
                .await
                .unwrap();
            backend.release(&grant).await.unwrap();
        }
        assert!(backend.watched.get().is_none(), "the directory was watched");
        assert_eq!(backend.wakers().len(), 0);
    }

    #[tokio::test]
    async fn waiters_leave_no_entry_behind() {
        let (_scratch, backend) = scratch_backend("wakers");
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_process_changing_a_key_wakes_its_waiters_here() {
        // Two backends on one directory share no wakers map, as two processes do not: only
        // the directory watch can carry B's release to A's waiter.
        let scratch = Scratch::new("watch");
        let dir = scratch.0.clone();
        let (here, there) = (
            FileBackend::open(&dir).unwrap(),
            FileBackend::open(&dir).unwrap(),
        );
        let key = LockKey::new("watched").unwrap();
        let held = there
            .try_acquire(&request(&key, Duration::from_secs(30)))
            .await
            .unwrap()
            .unwrap();
        let waker = here.waker(&key);
        assert!(
            here.watched.get().is_some_and(Option::is_some),
            "the lock directory is not watched (inotify)"
        );
        let woken = waker.arm();
        there.release(&held).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), woken)
            .await
            .expect("the release by another backend on the directory woke nobody");
        // A key nobody here waits on wakes nothing and leaves no entry.
        drop(waker);
        let other = LockKey::new("unwatched").unwrap();
        let grant = there
            .try_acquire(&request(&other, Duration::from_secs(30)))
            .await
            .unwrap()
            .unwrap();
        there.release(&grant).await.unwrap();
        assert_eq!(here.wakers().len(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_writers_polls_do_not_rewrite_its_marker_each_time() {
        // Every write to a key's file wakes its waiters: a writer that rewrote its marker on
        // every poll would wake itself at once, for ever.
        let (_scratch, backend) = scratch_backend("marker");
        let key = LockKey::new("marked").unwrap();
        let read = backend
            .try_acquire(&request(&key, Duration::from_secs(30)).with_kind(LockKind::Read))
            .await
            .unwrap()
            .unwrap();
        let writer = {
            let backend = backend.clone();
            let key = key.clone();
            tokio::spawn(async move {
                backend
                    .acquire(
                        &request(&key, Duration::from_secs(30)).with_kind(LockKind::Write),
                        Duration::from_secs(60),
                    )
                    .await
            })
        };
        let path = backend.path(&key);
        let marker = || {
            std::fs::read_to_string(&path)
                .unwrap()
                .lines()
                .find(|l| l.starts_with("q "))
                .map(str::to_owned)
        };
        let mut first = None;
        for _ in 0..1000 {
            first = marker();
            if first.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(first.is_some(), "the waiting writer left no marker");
        // Polls every 50 ms at most: several of them, and the marker line is unchanged.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(
            marker(),
            first,
            "a poll rewrote the waiting writer's marker"
        );
        backend.release(&read).await.unwrap();
        let grant = tokio::time::timeout(Duration::from_secs(60), writer)
            .await
            .expect("the writer was never granted")
            .unwrap()
            .unwrap();
        backend.release(&grant).await.unwrap();
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

    /// Review 40 (probe): many tasks of this process on one key while another process
    /// takes and keeps its `flock` for over a second at a time (stopped mid-operation):
    /// tries, waits and inquiries given up by their callers at random points and by their
    /// own bounds. No two grants may be believed in at once, and once the flock is free
    /// nothing is left behind (turns, stalled notes, holds).
    #[test]
    fn stalls_and_drops_at_random_points_grant_once_and_leave_nothing() {
        // Also on a network file system, where every operation goes through the key's turns.
        for fs in [FsKind::Local, FsKind::Remote] {
            stalls_and_drops_probe(fs);
        }
    }

    fn stalls_and_drops_probe(fs: FsKind) {
        use std::sync::atomic::AtomicUsize;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(4)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (_scratch, mut backend) = scratch_backend("probe");
            backend.fs = fs;
            let key = LockKey::new("k").unwrap();
            grant_once(&backend, &key).await;
            let inside = Arc::new(AtomicUsize::new(0));
            let overlaps = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let path = backend.path(&key);
            let stopper = tokio::spawn({
                let stop = stop.clone();
                async move {
                    for _ in 0..3 {
                        let path = path.clone();
                        let held = tokio::task::spawn_blocking(move || {
                            let file = Locked::open(&path).unwrap();
                            file.lock().unwrap();
                            file
                        })
                        .await
                        .unwrap();
                        tokio::time::sleep(Duration::from_millis(1_300)).await;
                        drop(held);
                        tokio::time::sleep(Duration::from_millis(400)).await;
                    }
                    stop.store(true, Ordering::SeqCst);
                }
            });
            let mut workers = Vec::new();
            for w in 0..10u64 {
                let (backend, key) = (backend.clone(), key.clone());
                let (inside, overlaps, stop) = (inside.clone(), overlaps.clone(), stop.clone());
                let locker = crate::Locker::new(backend.clone());
                workers.push(tokio::spawn(async move {
                    let seed: u64 = std::env::var("PROBE_SEED")
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                    let mut rng = fastrand::Rng::with_seed(w + 100 * seed);
                    while !stop.load(Ordering::SeqCst) {
                        let patience = Duration::from_millis(rng.u64(0..1_500));
                        let req = request(&key, Duration::from_secs(3));
                        let grant = match rng.u8(0..5) {
                            0 => tokio::time::timeout(patience, backend.try_acquire(&req))
                                .await
                                .ok()
                                .and_then(|g| g.ok().flatten()),
                            1 => tokio::time::timeout(
                                patience,
                                backend.acquire(&req, Duration::from_millis(rng.u64(0..1_200))),
                            )
                            .await
                            .ok()
                            .and_then(Result::ok),
                            2 => {
                                let _ = tokio::time::timeout(patience, backend.inspect(&key)).await;
                                None
                            }
                            _ => {
                                let wait = Duration::from_millis(rng.u64(0..1_200));
                                let guard = tokio::time::timeout(
                                    patience,
                                    locker.acquire(&key).ttl(Duration::from_secs(3)).wait(wait),
                                )
                                .await
                                .ok()
                                .and_then(Result::ok);
                                if let Some(guard) = guard {
                                    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                                        overlaps.fetch_add(1, Ordering::SeqCst);
                                    }
                                    tokio::time::sleep(Duration::from_millis(rng.u64(0..30))).await;
                                    inside.fetch_sub(1, Ordering::SeqCst);
                                    let _ = guard.release().await;
                                }
                                None
                            }
                        };
                        if let Some(grant) = grant {
                            if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                                overlaps.fetch_add(1, Ordering::SeqCst);
                            }
                            tokio::time::sleep(Duration::from_millis(rng.u64(0..30))).await;
                            inside.fetch_sub(1, Ordering::SeqCst);
                            let _ = backend.release(&grant).await;
                        }
                    }
                }));
            }
            stopper.await.unwrap();
            for worker in workers {
                tokio::time::timeout(Duration::from_secs(30), worker)
                    .await
                    .expect("a worker was still busy 30 s after the flock was free")
                    .unwrap();
            }
            assert_eq!(
                overlaps.load(Ordering::SeqCst),
                0,
                "two grants believed in at once"
            );
            // Everything given up settles once the flock is free.
            let settled = tokio::time::timeout(Duration::from_secs(20), async {
                loop {
                    let turns = backend.flock_turns.lock().unwrap().is_empty();
                    let stalled = backend.stalled.lock().unwrap().is_empty();
                    let free = backend.inspect(&key).await.unwrap().is_none();
                    if turns && stalled && free {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await;
            let turns = backend.flock_turns.lock().unwrap().len();
            let stalled = backend.stalled.lock().unwrap().len();
            let holder = backend.inspect(&key).await.map(|h| h.is_some());
            assert!(
                settled.is_ok(),
                "left behind: turns {turns}, stalled {stalled}, holder {holder:?}"
            );
        });
    }
}

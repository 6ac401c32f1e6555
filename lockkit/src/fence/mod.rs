//! Fencing end to end: guards on the storage side, so a fencing token actually stops a
//! stale writer.
//!
//! A lock alone cannot stop a holder that was paused (GC, SIGSTOP, a slow disk) past its
//! lease from writing after a new holder took over. Its token can, if the storage checks
//! it: each guard here keeps, per resource, the newest token that wrote, and runs a write
//! only if its token is not older, atomically with the check. An equal token (the same
//! holder writing twice) is accepted; a newer one raises the bar; an older one is refused
//! with [`Error::Fenced`] and nothing is written.
//!
//! | store | guard | atomic by |
//! |---|---|---|
//! | files | [`FileFence`] | `flock` on `<path>.fence`, then write-and-rename |
//! | Redis | [`RedisFence`] (feature `redis`) | one Lua script: check, raise, write |
//! | MySQL / MariaDB | [`MysqlFence`] (feature `mysql`) | one transaction holding the resource's fence row |
//! | PostgreSQL | [`PostgresFence`] (feature `postgres`) | one transaction holding the resource's fence row |
//!
//! Every guard takes `impl Into<FencingToken>`: a [`crate::LockGuard`] (`&guard`) or a
//! bare token (from `LOCKKIT_TOKEN` in a `lockkit run` job).
//!
//! Object stores are not covered. A conditional put there compares the ETag or version
//! the store assigned, not a number the writer brings, so the guard would be a
//! compare-and-swap loop on the object itself: read its token (user metadata) and ETag from
//! one response, refuse an older token, else put with `If-Match` on that ETag
//! (object_store's `PutMode::Update`; `PutMode::Create` for the first write) and start
//! again on a precondition failure; a delete would have to leave a tombstone carrying the
//! token, or a stale writer could create the object again. lockkit tests every guard
//! against a real server, and the only S3-compatible server Debian packages is Ceph's
//! `radosgw`, a whole Ceph cluster to run in CI (object_store's `LocalFileSystem` does not
//! implement `PutMode::Update`; its `InMemory` store would be a mock). Until then, keep a
//! fence in one of the stores above beside the object.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

use crate::{Error, FencingToken, Result};

/// The caller's write in a SQL fence (`MysqlFence::write`, `PostgresFence::write`): runs
/// on the fence's transaction, after the check.
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub type FencedWork<'c, T> = std::pin::Pin<
    Box<dyn std::future::Future<Output = std::result::Result<T, crate::BoxError>> + Send + 'c>,
>;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use mysql::{MysqlFence, TABLE as MYSQL_TABLE, ddl};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::{PostgresFence, TABLE as POSTGRES_TABLE, ddl as postgres_ddl};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::RedisFence;

const SCHEME: &str = "fence";
/// The file fence's own files beside a fenced file.
const FENCE_SUFFIX: &str = ".fence";
const TMP_SUFFIX: &str = ".lockkit-tmp";

/// The longest resource name of the SQL fences (their tables' key column).
#[cfg(any(feature = "mysql", feature = "postgres"))]
const MAX_SQL_RESOURCE: usize = 512;

/// Refuses a SQL fence's resource name of 0 or more than [`MAX_SQL_RESOURCE`] bytes.
#[cfg(any(feature = "mysql", feature = "postgres"))]
fn check_sql_resource(resource: &str) -> Result<()> {
    let len = resource.len();
    if len == 0 || len > MAX_SQL_RESOURCE {
        return Err(Error::Config(format!(
            "a fenced resource name must be 1 to {MAX_SQL_RESOURCE} bytes; `{resource}` is {len}"
        )));
    }
    Ok(())
}

/// The caller's write failed inside a SQL fence: everything was rolled back.
#[cfg(any(feature = "mysql", feature = "postgres"))]
fn sql_work_failed(backend: &'static str, resource: &str, e: crate::BoxError) -> Error {
    Error::Backend {
        backend,
        message: format!("the fenced write to `{resource}` failed and was rolled back: {e}"),
        retryable: false,
        source: Some(e),
    }
}

/// A SQL fence's commit failed: it may have happened, so say so rather than invite a retry
/// that would apply the work twice (or be refused as if nothing was written).
#[cfg(any(feature = "mysql", feature = "postgres"))]
fn sql_commit_failed(backend: &'static str, resource: &str, e: sqlx::Error) -> Error {
    Error::Backend {
        backend,
        message: format!(
            "committing the fenced write to `{resource}` failed: {e}; it may or may not have \
             been applied, so check before writing again (or make the write idempotent)"
        ),
        retryable: false,
        source: Some(Box::new(e)),
    }
}

#[cfg(test)]
thread_local! {
    /// How many directories this thread synced (the tests' window on durability).
    static DIR_SYNCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Syncs the directory that holds `path`, so that an entry created or renamed in it
/// survives a crash (a file's own sync does not make its name durable).
fn sync_parent_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()?;
    #[cfg(test)]
    DIR_SYNCS.with(|syncs| syncs.set(syncs.get() + 1));
    Ok(())
}

/// Whether a write with `token` may go ahead where `newest` already wrote.
fn admitted(resource: &str, token: FencingToken, newest: Option<FencingToken>) -> Result<()> {
    match newest {
        Some(newer) if token < newer => Err(Error::Fenced {
            resource: resource.to_owned(),
            token,
            newer,
        }),
        _ => Ok(()),
    }
}

fn io_error(doing: &str, path: &Path, e: std::io::Error) -> Error {
    Error::backend_with_source(
        SCHEME,
        false,
        format!("{doing} `{}` failed: {e}", path.display()),
        e,
    )
}

/// A fence for files: `write` replaces a file's contents only if the token is not older
/// than the newest that wrote it. The newest token is kept beside the file in
/// `<path>.fence`, whose `flock` serialises writers across processes; the contents go to
/// `<path>.lockkit-tmp` first and are renamed over the file (the directory is synced after),
/// so a reader never sees half a write.
///
/// The token is raised (and synced) before the contents are replaced: a crash in between
/// leaves old contents behind a raised bar, never new contents behind an old one. It is
/// written in place as 20 digits, never truncated first, so a crash cannot leave the fence
/// empty; a fence that does not read as a token refuses every write (fail closed) until an
/// operator looks at it. Paths ending in `.fence` or `.lockkit-tmp` are refused, so one
/// resource's fence is never another's data. The fence is keyed on the path as given: do
/// not reach one file through several paths (symlinks).
///
/// `flock` is advisory: it holds off other fenced writers, not a process that writes the
/// file without this fence. When `run`'s work fails, the raised bar stays (unlike
/// `MysqlFence`'s rollback): it only refuses tokens older than one already handed
/// out.
///
/// The calls block (file I/O and `flock`): in async code, call them from
/// `tokio::task::spawn_blocking`.
#[derive(Debug, Clone, Default)]
pub struct FileFence;

impl FileFence {
    /// A file fence.
    pub fn new() -> Self {
        FileFence
    }

    fn sibling(path: &Path, suffix: &str) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    }

    /// Runs `work` (your own update of `path`: an append, an edit in place) if `token` is
    /// not older than the newest that wrote, with the fence raised to `token` first and
    /// held locked until `work` returns, so no other fenced writer runs in between.
    ///
    /// # Errors
    /// [`Error::Fenced`] (`work` not run) for an older token; [`Error::Backend`] for the
    /// fence's file errors; `work`'s own error.
    pub fn run<T>(
        &self,
        token: impl Into<FencingToken>,
        path: impl AsRef<Path>,
        work: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        self.fenced(token.into(), path.as_ref(), work)
    }

    fn fenced<T>(
        &self,
        token: FencingToken,
        path: &Path,
        work: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let shown = path.display().to_string();
        if shown.ends_with(FENCE_SUFFIX) || shown.ends_with(TMP_SUFFIX) {
            return Err(Error::Config(format!(
                "`{shown}` ends in {FENCE_SUFFIX} or {TMP_SUFFIX}, which the file fence keeps \
                 for itself; name the file otherwise"
            )));
        }
        let fence_path = Self::sibling(path, FENCE_SUFFIX);
        let mut fence = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&fence_path)
            .map_err(|e| io_error("opening the fence", &fence_path, e))?;
        fence
            .lock()
            .map_err(|e| io_error("locking the fence", &fence_path, e))?;
        let mut text = String::new();
        fence
            .read_to_string(&mut text)
            .map_err(|e| io_error("reading the fence", &fence_path, e))?;
        let newest = match text.trim() {
            // A fence never raised (a crash can leave one empty only before its first raise,
            // when no fenced write has happened yet).
            "" => None,
            digits => Some(FencingToken::new(digits.parse().map_err(|_| {
                Error::backend(
                    SCHEME,
                    false,
                    format!(
                        "the fence `{}` holds `{digits}`, not a token: every write is refused \
                         until it is repaired (write the newest token that wrote, or remove it \
                         if no fenced writer can still be running)",
                        fence_path.display()
                    ),
                )
            })?)),
        };
        admitted(&shown, token, newest)?;
        if newest != Some(token) {
            let raise = |fence: &mut File| -> std::io::Result<()> {
                // In place, fixed width: never an empty fence, whatever is interrupted.
                fence.seek(SeekFrom::Start(0))?;
                fence.write_all(format!("{:020}", token.get()).as_bytes())?;
                fence.set_len(20)?;
                fence.sync_data()?;
                if newest.is_none() {
                    // The fence may have just been created: its name must be as durable
                    // as its token, or a crash could forget the bar while `run`'s work (or
                    // CMD's, through `lockkit fence`) stays written.
                    sync_parent_dir(&fence_path)?;
                }
                Ok(())
            };
            raise(&mut fence).map_err(|e| io_error("raising the fence", &fence_path, e))?;
        }
        work()
    }

    /// Accepts `token` for `path` if it is not older than the newest that wrote, raising
    /// the bar to it, without writing anything else (`lockkit fence`).
    ///
    /// # Errors
    /// [`Error::Fenced`] for an older token; [`Error::Backend`] for file errors.
    pub fn admit(&self, token: impl Into<FencingToken>, path: impl AsRef<Path>) -> Result<()> {
        self.fenced(token.into(), path.as_ref(), || Ok(()))
    }

    /// Replaces the contents of `path` with `contents` if `token` is not older than the
    /// newest token that wrote it.
    ///
    /// # Errors
    /// [`Error::Fenced`] (nothing written) for an older token; [`Error::Backend`] for file
    /// errors.
    pub fn write(
        &self,
        token: impl Into<FencingToken>,
        path: impl AsRef<Path>,
        contents: &[u8],
    ) -> Result<()> {
        let path = path.as_ref();
        self.fenced(token.into(), path, || {
            let tmp = Self::sibling(path, TMP_SUFFIX);
            let replace = || -> std::io::Result<()> {
                let mut file = File::create(&tmp)?;
                file.write_all(contents)?;
                file.sync_data()?;
                std::fs::rename(&tmp, path)?;
                // The rename is durable only once the directory is.
                sync_parent_dir(path)
            };
            replace().map_err(|e| io_error("writing", path, e))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory of one test, removed when the test ends (passed or not).
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("lockkit-fence-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("a scratch dir");
            Self(dir)
        }

        fn data(&self) -> PathBuf {
            self.0.join("data")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_stale_token_is_refused_an_equal_one_accepted_a_newer_one_raises_the_bar() {
        let scratch = Scratch::new("order");
        let (fence, path) = (FileFence::new(), scratch.data());
        fence
            .write(FencingToken::new(5), &path, b"five")
            .expect("first write");
        fence
            .write(FencingToken::new(5), &path, b"five again")
            .expect("same holder again");
        let refused = fence
            .write(FencingToken::new(4), &path, b"four")
            .expect_err("stale");
        assert!(
            matches!(refused, Error::Fenced { token, newer, .. } if token.get() == 4 && newer.get() == 5),
            "{refused}"
        );
        assert_eq!(std::fs::read(&path).expect("readable"), b"five again");
        fence
            .write(FencingToken::new(9), &path, b"nine")
            .expect("newer");
        assert!(
            fence.admit(FencingToken::new(8), &path).is_err(),
            "the bar was raised to 9"
        );
        assert_eq!(std::fs::read(&path).expect("readable"), b"nine");
    }

    /// A fence made by `admit` or `run` (no rename after it, so nothing else synced its
    /// directory) has its name synced with its first token: before, a crash could forget
    /// the whole fence while the work it admitted stayed written, and an older token was then
    /// admitted.
    #[test]
    fn a_new_fence_is_durable_by_name_before_the_work_it_admits() {
        let scratch = Scratch::new("durable");
        let (fence, path) = (FileFence::new(), scratch.data());
        let syncs = || DIR_SYNCS.with(|syncs| syncs.get());
        let before = syncs();
        let synced_before_work = fence
            .run(FencingToken::new(3), &path, || Ok(syncs()))
            .expect("admitted");
        assert_eq!(
            synced_before_work,
            before + 1,
            "the new fence's directory is synced before the work runs"
        );
        let again = syncs();
        fence
            .admit(FencingToken::new(3), &path)
            .expect("same token");
        fence.admit(FencingToken::new(4), &path).expect("newer");
        assert_eq!(
            syncs(),
            again,
            "a fence that exists needs only its own sync"
        );
    }

    /// Review 15, H2: a fence that does not read as a token refuses every write, and the
    /// fence's own files cannot be written as data.
    #[test]
    fn a_corrupt_fence_fails_closed_and_its_own_files_are_refused() {
        let scratch = Scratch::new("corrupt");
        let (fence, path) = (FileFence::new(), scratch.data());
        fence
            .write(FencingToken::new(9), &path, b"nine")
            .expect("first write");
        let fence_file = FileFence::sibling(&path, FENCE_SUFFIX);
        assert_eq!(
            std::fs::read_to_string(&fence_file).expect("a fence"),
            format!("{:020}", 9)
        );
        std::fs::write(&fence_file, "x").expect("corrupted");
        let refused = fence
            .write(FencingToken::new(4), &path, b"four")
            .expect_err("fail closed");
        assert!(refused.to_string().contains("not a token"), "{refused}");
        assert_eq!(std::fs::read(&path).expect("readable"), b"nine");
        assert!(matches!(
            fence.write(FencingToken::new(1), &fence_file, b"0"),
            Err(Error::Config(_))
        ));
        let tmp = FileFence::sibling(&path, TMP_SUFFIX);
        assert!(matches!(
            fence.write(FencingToken::new(1), &tmp, b"0"),
            Err(Error::Config(_))
        ));
    }
}

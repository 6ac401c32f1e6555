//! A fenced store in a file, shared by the lab's processes: the storage layer that refuses
//! a write whose fencing token is older than one it has seen.

use std::{
    fmt,
    fs::OpenOptions,
    io::Write,
    path::{Path, PathBuf},
};

use lockkit::fence::FileFence;
use lockkit_core::FencingToken;

/// A write refused because a newer holder wrote first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaleWrite {
    /// The token offered.
    pub offered: FencingToken,
    /// The highest token the store has accepted.
    pub highest: FencingToken,
}

impl fmt::Display for StaleWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "token {} is older than token {} that already wrote",
            self.offered, self.highest
        )
    }
}

/// An append-only file of accepted values (`token value` lines), fenced by lockkit's own
/// [`FileFence`] (its newest token in `<path>.fence`), so several processes can write.
#[derive(Debug, Clone)]
pub struct FileFencedStore {
    path: PathBuf,
}

impl FileFencedStore {
    /// A store in `path` (created on first write).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileFencedStore { path: path.into() }
    }

    /// Where it lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `value` if `token` is not older than any token accepted so far, through
    /// lockkit's own file fence ([`lockkit::fence::FileFence`]): the lab's stale writes
    /// meet the guard users get.
    ///
    /// # Errors
    /// `Ok(Err(StaleWrite))` when a newer holder wrote first; `Err` on I/O failure.
    pub fn write(
        &self,
        token: FencingToken,
        value: &str,
    ) -> std::io::Result<Result<(), StaleWrite>> {
        let append = || -> lockkit::Result<()> {
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)
                .and_then(|mut file| {
                    file.write_all(format!("{} {value}\n", token.get()).as_bytes())?;
                    Ok(file)
                })
                .map_err(|e| lockkit::Error::backend_with_source("lab", false, "appending", e))?;
            file.sync_data()
                .map_err(|e| lockkit::Error::backend_with_source("lab", false, "syncing", e))
        };
        match FileFence::new().run(token, &self.path, append) {
            Ok(()) => Ok(Ok(())),
            Err(lockkit::Error::Fenced { newer, .. }) => Ok(Err(StaleWrite {
                offered: token,
                highest: newer,
            })),
            Err(e) => Err(std::io::Error::other(e)),
        }
    }

    /// The accepted values, in order, as `token value`.
    ///
    /// # Errors
    /// On I/O failure (a store never written to is empty).
    pub fn values(&self) -> std::io::Result<Vec<String>> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => Ok(text.lines().map(str::to_owned).collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_older_tokens_and_keeps_accepted_values() {
        let dir = std::env::temp_dir().join(format!("lockkit-store-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = FileFencedStore::new(dir.join("s"));
        assert!(store.write(FencingToken::new(5), "a").unwrap().is_ok());
        assert!(store.write(FencingToken::new(5), "b").unwrap().is_ok());
        assert!(store.write(FencingToken::new(7), "c").unwrap().is_ok());
        let stale = store.write(FencingToken::new(6), "d").unwrap().unwrap_err();
        assert_eq!(stale.highest, FencingToken::new(7));
        assert_eq!(store.values().unwrap(), vec!["5 a", "5 b", "7 c"]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}

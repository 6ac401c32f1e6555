//! A fenced store in a file, shared by the lab's processes: the storage layer that refuses
//! a write whose fencing token is older than one it has seen.

use std::{
    fmt,
    fs::{File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

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

/// A file holding the highest token accepted and the values written, guarded by an
/// exclusive file lock so several processes can write.
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

    /// Appends `value` if `token` is not older than any token accepted so far.
    ///
    /// # Errors
    /// `Ok(Err(StaleWrite))` when a newer holder wrote first; `Err` on I/O failure.
    pub fn write(
        &self,
        token: FencingToken,
        value: &str,
    ) -> std::io::Result<Result<(), StaleWrite>> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path)?;
        file.lock()?;
        let result = Self::write_locked(&mut file, token, value);
        let _ = file.unlock();
        result
    }

    fn write_locked(
        file: &mut File,
        token: FencingToken,
        value: &str,
    ) -> std::io::Result<Result<(), StaleWrite>> {
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        let mut lines = text.lines();
        let highest = lines.next().and_then(|l| l.trim().parse::<u64>().ok());
        if let Some(highest) = highest.filter(|h| token.get() < *h) {
            return Ok(Err(StaleWrite {
                offered: token,
                highest: FencingToken::new(highest),
            }));
        }
        let mut out = format!("{}\n", token.get());
        for line in lines {
            out.push_str(line);
            out.push('\n');
        }
        out.push_str(&format!("{} {value}\n", token.get()));
        file.seek(SeekFrom::Start(0))?;
        file.set_len(0)?;
        file.write_all(out.as_bytes())?;
        file.sync_data()?;
        Ok(Ok(()))
    }

    /// The accepted values, in order, as `token value`.
    ///
    /// # Errors
    /// On I/O failure (a store never written to is empty).
    pub fn values(&self) -> std::io::Result<Vec<String>> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => Ok(text.lines().skip(1).map(str::to_owned).collect()),
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

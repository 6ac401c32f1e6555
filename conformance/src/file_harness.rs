//! The harness for [`FileBackend`]: every client is a separate backend value on one
//! directory, and child processes open the same directory.

use std::path::PathBuf;

use async_trait::async_trait;
use lockkit_core::{FileBackend, LockKey, Locker};

use crate::{Harness, HookError, HookResult};

/// Clients on one lock directory.
#[derive(Debug)]
pub struct FileHarness {
    dir: PathBuf,
}

impl FileHarness {
    /// A harness on `dir` (created if needed). Give a fixed path: the child processes of
    /// the crash cases must find the same directory.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FileHarness { dir: dir.into() }
    }

    fn backend(&self) -> FileBackend {
        FileBackend::open(&self.dir).unwrap_or_else(|e| panic!("lock directory: {e}"))
    }
}

#[async_trait]
impl Harness for FileHarness {
    fn name(&self) -> String {
        "file".into()
    }

    async fn client(&self) -> Locker {
        Locker::new(self.backend())
    }

    async fn connect(&self, url: &str) -> lockkit_core::Result<Locker> {
        FileBackend::from_url(url).map(Locker::new)
    }

    fn malformed_urls(&self) -> Vec<String> {
        [
            "file://relative/dir",
            "file:///tmp/x?ttl=1s&prefix=a",
            "file:///tmp/x?ttl=soon",
            "/tmp/no-scheme",
            "files:///tmp",
            "",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn take_away(&self, key: &LockKey) -> HookResult {
        match self.backend().take_away(key).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(HookError::Failed(format!("`{key}` was not held"))),
            Err(e) => Err(HookError::Failed(e.to_string())),
        }
    }

    async fn residue(&self, prefix: &str) -> HookResult<usize> {
        self.backend()
            .held_under(prefix)
            .await
            .map(|held| usize::try_from(held).unwrap_or(usize::MAX))
            .map_err(|e| HookError::Failed(e.to_string()))
    }
}

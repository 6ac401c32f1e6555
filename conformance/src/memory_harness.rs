//! The harness for [`MemoryBackend`]: the reference instantiation of the suite.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use lockkit_core::{LockBackend, LockKey, Locker, MemoryBackend};

use crate::{Harness, HookError, HookResult};

/// Every client is a separate session on one in-process server.
#[derive(Debug)]
pub struct MemoryHarness {
    server: MemoryBackend,
    sessions: Mutex<Vec<(Arc<dyn LockBackend>, MemoryBackend)>>,
}

impl Default for MemoryHarness {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryHarness {
    /// A harness over a fresh server.
    pub fn new() -> Self {
        MemoryHarness {
            server: MemoryBackend::new(),
            sessions: Mutex::new(Vec::new()),
        }
    }

    fn session_of(&self, client: &Locker) -> Option<MemoryBackend> {
        let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions
            .iter()
            .find(|(arc, _)| std::ptr::addr_eq(Arc::as_ptr(arc), Arc::as_ptr(client.backend())))
            .map(|(_, session)| session.clone())
    }
}

#[async_trait]
impl Harness for MemoryHarness {
    fn name(&self) -> String {
        "memory".into()
    }

    async fn client(&self) -> Locker {
        let session = self.server.connect();
        let backend: Arc<dyn LockBackend> = Arc::new(session.clone());
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((backend.clone(), session));
        Locker::from_arc(backend)
    }

    async fn connect(&self, url: &str) -> lockkit_core::Result<Locker> {
        MemoryBackend::from_url(url).map(Locker::new)
    }

    fn malformed_urls(&self) -> Vec<String> {
        [
            "memory://somehost",
            "memory:///a/path",
            "memory://?wait=5s",
            "memory://?ttl=5",
            "redis://127.0.0.1:6379",
            "not a url",
            "",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn take_away(&self, key: &LockKey) -> HookResult {
        match self.server.take_away(key).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(HookError::Failed(format!("`{key}` was not held"))),
            Err(e) => Err(HookError::Failed(e.to_string())),
        }
    }

    async fn kill_connection(&self, client: &Locker) -> HookResult {
        let session = self
            .session_of(client)
            .ok_or_else(|| HookError::Failed("that client was not made by this harness".into()))?;
        session.kill_session();
        Ok(())
    }

    async fn residue(&self, prefix: &str) -> HookResult<usize> {
        Ok(self.server.residue(prefix))
    }

    fn cross_process(&self) -> bool {
        false
    }
}

//! A toy storage service that honours fencing tokens, and its unfenced control.

use std::sync::{Arc, Mutex};

use lockkit_core::FencingToken;

/// A write was refused because a newer holder already wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaleToken {
    /// The token the write carried.
    pub offered: FencingToken,
    /// The highest token the store has accepted.
    pub highest: FencingToken,
}

/// A value guarded by fencing: a write with a token lower than the highest seen is
/// refused. Writes with equal tokens (the same holder) are accepted.
#[derive(Debug, Clone, Default)]
pub struct FencedStore {
    inner: Arc<Mutex<(Option<FencingToken>, Vec<String>)>>,
}

impl FencedStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `value` if `token` is not older than any token seen.
    ///
    /// # Errors
    /// [`StaleToken`] when a newer holder has written already.
    pub fn write(&self, token: FencingToken, value: impl Into<String>) -> Result<(), StaleToken> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(highest) = inner.0.filter(|h| token < *h) {
            return Err(StaleToken {
                offered: token,
                highest,
            });
        }
        inner.0 = Some(token);
        inner.1.push(value.into());
        Ok(())
    }

    /// Everything accepted, in order.
    pub fn values(&self) -> Vec<String> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .clone()
    }
}

/// The control: a store that ignores tokens, showing what goes wrong without fencing.
#[derive(Debug, Clone, Default)]
pub struct UnfencedStore {
    values: Arc<Mutex<Vec<String>>>,
}

impl UnfencedStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `value`, whoever writes.
    pub fn write(&self, value: impl Into<String>) {
        self.values
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(value.into());
    }

    /// Everything written, in order.
    pub fn values(&self) -> Vec<String> {
        self.values
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl std::fmt::Display for StaleToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stale write refused: token {} is older than {}",
            self.offered, self.highest
        )
    }
}

impl std::error::Error for StaleToken {}

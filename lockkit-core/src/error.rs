//! The one error type of lockkit.

use std::time::Duration;

use crate::{FencingToken, LockKey};

/// A boxed error from a backend's client library, kept as the `source` of
/// [`Error::Backend`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias used throughout lockkit.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while taking, keeping or giving back a lock.
///
/// Every message says what happened *and* what to do about it. Use
/// [`Error::is_retryable`] to decide whether trying again can help.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock stayed held by someone else for the whole wait.
    #[error(
        "timed out after {waited:?} waiting for lock `{key}`: another owner still holds it; \
         wait longer, or inspect the holder"
    )]
    Timeout {
        /// The contended key.
        key: LockKey,
        /// How long the caller actually waited.
        waited: Duration,
    },

    /// The lock was held once but is gone or can no longer be confirmed (expired lease,
    /// session loss, stolen). Anything written under it since must be treated as suspect;
    /// use the fencing token so storage can refuse it.
    #[error(
        "lock `{key}` (token {token}) was lost: {reason}; stop work guarded by it and \
         acquire again"
    )]
    Lost {
        /// The key that was lost.
        key: LockKey,
        /// The token of the hold that was lost.
        token: FencingToken,
        /// Why the hold counts as lost.
        reason: LostReason,
    },

    /// The caller does not hold this lock (already released, or never held by this owner).
    #[error("lock `{key}` is not held by this owner; it was already released or never taken")]
    NotHeld {
        /// The key.
        key: LockKey,
    },

    /// The key cannot be used as a lock name.
    #[error("invalid lock key: {reason}")]
    InvalidKey {
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// The lease time-to-live is outside what lockkit or the backend accepts.
    #[error("invalid lease ttl {ttl:?}: {reason}")]
    InvalidTtl {
        /// The refused value.
        ttl: Duration,
        /// What range is accepted.
        reason: String,
    },

    /// A configuration value (URL, option) is malformed or inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A storage-side fence refused a write: a newer holder's token already wrote to the
    /// resource, so this writer's lock is gone (paused, partitioned, expired) and its write
    /// would have overwritten newer data. Nothing was written.
    #[error(
        "write to `{resource}` refused: token {token} is older than token {newer} that \
         already wrote; this holder lost its lock, so stop and acquire it again"
    )]
    Fenced {
        /// The resource written to.
        resource: String,
        /// The token offered.
        token: FencingToken,
        /// The newest token that wrote to the resource.
        newer: FencingToken,
    },

    /// The owner reads `key` and asked to write it: the write would wait for the owner's
    /// own read hold forever (an upgrade deadlock). Nothing was sent or written.
    #[error(
        "owner holds {held} on `{key}` and asked for {asked}: it would wait for itself; \
         release the read lock first, or take the write lock first and then read (downgrade)"
    )]
    WouldDeadlock {
        /// The key.
        key: LockKey,
        /// What the owner holds.
        held: crate::LockKind,
        /// What it asked for.
        asked: crate::LockKind,
    },

    /// The key is used as another kind of lock than the one asked for: a semaphore with a
    /// different permit count, a read-write lock asked for as a plain lock, or the other
    /// way round. Use one kind (and one permit count) per key.
    #[error(
        "`{key}` {found}; asked for {asked}: use one kind of lock (and one permit count) per key"
    )]
    KindMismatch {
        /// The key.
        key: LockKey,
        /// What the key is used as, e.g. "is a semaphore of 5 permits".
        found: String,
        /// What was asked for.
        asked: crate::LockKind,
    },

    /// The backend cannot do what was asked.
    #[error("`{backend}` does not support {what}")]
    Unsupported {
        /// Backend scheme.
        backend: &'static str,
        /// The operation or option that is not supported.
        what: String,
    },

    /// The backend's server or client library failed.
    #[error("{backend} backend error: {message}")]
    Backend {
        /// Backend scheme.
        backend: &'static str,
        /// What was being done, and what to do about it.
        message: String,
        /// Whether retrying the operation can help (connection errors: yes).
        retryable: bool,
        /// The underlying error.
        #[source]
        source: Option<BoxError>,
    },
}

impl Error {
    /// True when trying the same operation again may succeed: timeouts and transient
    /// backend failures (connection resets, a server briefly unavailable).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Timeout { .. } => true,
            Error::Backend { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// Builds a [`Error::Backend`] without a source.
    pub fn backend(backend: &'static str, retryable: bool, message: impl Into<String>) -> Self {
        Error::Backend {
            backend,
            message: message.into(),
            retryable,
            source: None,
        }
    }

    /// Builds a [`Error::Backend`] that keeps `source`.
    pub fn backend_with_source(
        backend: &'static str,
        retryable: bool,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Backend {
            backend,
            message: message.into(),
            retryable,
            source: Some(source.into()),
        }
    }
}

/// Why a hold counts as lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LostReason {
    /// The backend said the lock now belongs to someone else or to nobody
    /// (renewal refused, entry deleted behind the holder's back).
    NotOurs,
    /// The local lease deadline passed without a confirmed renewal (no watchdog, the
    /// watchdog stopped at `max_hold`, or the backend could not be reached in time).
    LeaseExpired,
    /// The session or connection that held the lock ended (ZooKeeper session expiry,
    /// a killed database connection).
    SessionLost,
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LostReason::NotOurs => "the backend reports it now belongs to another owner or none",
            LostReason::LeaseExpired => "the lease ran out before a renewal was confirmed",
            LostReason::SessionLost => "the session or connection holding it ended",
        })
    }
}

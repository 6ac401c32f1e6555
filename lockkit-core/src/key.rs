//! Lock names: the type. Its rules and conversions are in `into_key`, beside the error
//! they produce.

use std::{borrow::Borrow, fmt, sync::Arc};

/// The name of a lock, validated once and cheap to clone.
///
/// # Rules
/// - not empty;
/// - at most [`LockKey::MAX_BYTES`] bytes of UTF-8;
/// - no control characters (`U+0000..=U+001F`, `U+007F`): they cannot be shown in logs or
///   stored in every backend, so every backend refuses them alike.
///
/// Everything else — Unicode, spaces, `/`, `..`, `%` — is a legal key and each backend
/// must represent it faithfully: two different keys never name the same lock.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(pub(crate) Arc<str>);

impl LockKey {
    /// The longest key accepted, in bytes of UTF-8.
    pub const MAX_BYTES: usize = 512;

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LockKey({:?})", &*self.0)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for LockKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

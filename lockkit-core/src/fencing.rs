//! Fencing tokens.

use std::fmt;

/// A number that strictly grows with every new holder of a key.
///
/// Pass it along with every write made under the lock; the storage remembers the highest
/// token it has seen for the resource and refuses writes that carry a lower one. That is
/// what makes a paused or partitioned former holder harmless (Kleppmann, "How to do
/// distributed locking"). Reentrant acquisitions by the same owner keep the holder's token.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value as produced by a backend.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw value, e.g. to store in a database column.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.0
    }
}

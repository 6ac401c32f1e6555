//! Making a [`LockKey`]: the rules a name must keep, and the conversions that check them.

use std::sync::Arc;

use crate::{Error, LockKey, Result};

impl LockKey {
    /// Validates `name` as a lock key.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] saying which rule was broken.
    pub fn new(name: impl AsRef<str>) -> Result<Self> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(Error::InvalidKey {
                reason: "the key is empty; name the resource the lock protects, e.g. `orders/42`"
                    .into(),
            });
        }
        if name.len() > Self::MAX_BYTES {
            return Err(Error::InvalidKey {
                reason: format!(
                    "the key is {} bytes long, more than the {} allowed; hash long names \
                     (e.g. SHA-256 hex) before using them as keys",
                    name.len(),
                    Self::MAX_BYTES
                ),
            });
        }
        if let Some((at, c)) = name.char_indices().find(|(_, c)| c.is_control()) {
            return Err(Error::InvalidKey {
                reason: format!(
                    "the key has control character {:?} at byte {at}; control characters \
                     (including NUL) are not allowed in lock keys",
                    c
                ),
            });
        }
        Ok(LockKey(Arc::from(name)))
    }
}

impl TryFrom<&str> for LockKey {
    type Error = Error;
    fn try_from(value: &str) -> Result<Self> {
        LockKey::new(value)
    }
}

impl TryFrom<String> for LockKey {
    type Error = Error;
    fn try_from(value: String) -> Result<Self> {
        LockKey::new(value)
    }
}

impl TryFrom<&String> for LockKey {
    type Error = Error;
    fn try_from(value: &String) -> Result<Self> {
        LockKey::new(value)
    }
}

impl TryFrom<&LockKey> for LockKey {
    type Error = Error;
    fn try_from(value: &LockKey) -> Result<Self> {
        Ok(value.clone())
    }
}

/// Anything that can name a lock: `&str`, `String`, or an already validated [`LockKey`].
pub trait IntoLockKey {
    /// Validates and converts.
    ///
    /// # Errors
    /// [`Error::InvalidKey`].
    fn into_lock_key(self) -> Result<LockKey>;
}

impl IntoLockKey for LockKey {
    fn into_lock_key(self) -> Result<LockKey> {
        Ok(self)
    }
}
impl IntoLockKey for &LockKey {
    fn into_lock_key(self) -> Result<LockKey> {
        Ok(self.clone())
    }
}
impl IntoLockKey for &str {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}
impl IntoLockKey for String {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}
impl IntoLockKey for &String {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_odd_but_printable_keys() {
        for k in [
            "a",
            "orders/42",
            "../etc",
            "with space",
            "ключ",
            "🔒",
            "%2F",
        ] {
            assert_eq!(LockKey::new(k).unwrap().as_str(), k);
        }
    }

    #[test]
    fn refuses_empty_long_and_control() {
        assert!(matches!(LockKey::new(""), Err(Error::InvalidKey { .. })));
        let long = "x".repeat(LockKey::MAX_BYTES + 1);
        assert!(matches!(LockKey::new(&long), Err(Error::InvalidKey { .. })));
        assert!(LockKey::new("x".repeat(LockKey::MAX_BYTES)).is_ok());
        assert!(matches!(
            LockKey::new("a\0b"),
            Err(Error::InvalidKey { .. })
        ));
        assert!(matches!(
            LockKey::new("a\nb"),
            Err(Error::InvalidKey { .. })
        ));
    }
}

//! Where a lock lives in Redis: names compatible with Redisson's RLock.
//!
//! For lock name `n` (prefix + key):
//! - the lock is a hash at `n`, field `<owner-uuid>:<id>`, value the hold count;
//! - the release channel is `redisson_lock__channel:{n}`;
//! - the fencing counter is `redisson_lock_token:{n}`.
//!
//! Redisson writes `prefix:{name}` unless the name already has a `{`; then it writes
//! `prefix:name`, so that a name's own hash tag keeps all three in one cluster slot.

use lockkit_core::{Error, LockKey, Result};

/// The three Redis names of one lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockNames {
    /// The hash holding owner -> hold count.
    pub lock: String,
    /// The channel a release publishes `0` on.
    pub channel: String,
    /// The fencing counter.
    pub token: String,
}

/// The hash tag Redis Cluster would use for `key`, if it has one.
fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let close = key[open + 1..].find('}')?;
    (close > 0).then(|| &key[open + 1..open + 1 + close])
}

fn prefixed(prefix: &str, name: &str) -> String {
    if name.contains('{') {
        format!("{prefix}:{name}")
    } else {
        format!("{prefix}:{{{name}}}")
    }
}

impl LockNames {
    /// Names for `key` under `prefix`. In cluster mode a name whose braces would put its
    /// counter in another slot than its lock is refused.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] in cluster mode for names with unbalanced or empty braces.
    pub fn new(prefix: &str, key: &LockKey, cluster: bool) -> Result<Self> {
        let lock = format!("{prefix}{key}");
        // A name with braces but no hash tag is hashed whole, while the counter and
        // channel (`prefix:{name}`) would take the text up to its first `}` as their tag:
        // another slot.
        if cluster && lock.contains(['{', '}']) && hash_tag(&lock).is_none() {
            return Err(Error::InvalidKey {
                reason: format!(
                    "in Redis Cluster mode `{lock}` has braces but no non-empty `{{tag}}`, so its \
                     counter and channel could land in another slot; balance the braces or drop them"
                ),
            });
        }
        Ok(LockNames {
            channel: prefixed("redisson_lock__channel", &lock),
            token: prefixed("redisson_lock_token", &lock),
            lock,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(key: &str, cluster: bool) -> Result<LockNames> {
        LockNames::new("", &LockKey::new(key).unwrap(), cluster)
    }

    #[test]
    fn redisson_layout() {
        let n = names("orders/42", false).unwrap();
        assert_eq!(n.lock, "orders/42");
        assert_eq!(n.channel, "redisson_lock__channel:{orders/42}");
        assert_eq!(n.token, "redisson_lock_token:{orders/42}");
        let n = names("a{b}c", true).unwrap();
        assert_eq!(n.channel, "redisson_lock__channel:a{b}c");
        assert_eq!(hash_tag(&n.channel), hash_tag(&n.lock));
    }

    #[test]
    fn cluster_refuses_braces_without_a_tag() {
        assert!(names("a{", true).is_err());
        assert!(names("a{}b", true).is_err());
        assert!(
            names("a}b", true).is_err(),
            "a `}}` alone moves the counter's slot"
        );
        assert!(names("a}b", false).is_ok());
        assert!(names("a{", false).is_ok());
    }
}

//! Lock keys as ZooKeeper node names: one flat node per key, so no key can reach into
//! another key's subtree.
//!
//! Bytes outside `[A-Za-z0-9._-]` are percent-encoded (`%` itself too), and the names `.`
//! and `..` become `%2E` and `%2E%2E`. Since `%` is always encoded, the mapping is
//! injective: two keys never share a node. Simple keys (`orders-42`, `job.daily`) keep
//! their name, so Curator clients can use the same path.

use lockkit_core::LockKey;

/// The node name for `key`.
pub fn encode(key: &LockKey) -> String {
    encode_str(key.as_str())
}

/// Encodes a key prefix the same way (a prefix of a key encodes to a prefix of its node
/// name, except for the whole names `.` and `..`).
pub fn encode_str(text: &str) -> String {
    match text {
        "." => return "%2E".into(),
        ".." => return "%2E%2E".into(),
        _ => {}
    }
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(s: &str) -> String {
        encode(&LockKey::new(s).unwrap())
    }

    #[test]
    fn simple_names_are_kept_and_odd_ones_encoded() {
        assert_eq!(enc("orders-42"), "orders-42");
        assert_eq!(enc("a/b"), "a%2Fb");
        assert_eq!(enc("a%2Fb"), "a%252Fb");
        assert_eq!(enc(".."), "%2E%2E");
        assert_eq!(enc("..."), "...");
        assert_eq!(enc("ключ"), "%D0%BA%D0%BB%D1%8E%D1%87");
    }
}

//! Lock keys as etcd key ranges: the lock `k` is the range `<prefix>/<k>/`, its contenders
//! the keys `<prefix>/<k>/<lease id in hex>` in it, as etcd's `concurrency.Mutex` and
//! `etcdctl lock <prefix>/<k>` name theirs.
//!
//! `/` and `%` in a key are percent-encoded, so no key's range contains another key's
//! contenders (`a` and `a/b` would otherwise share `<prefix>/a/`); every other byte is
//! kept, so simple keys (`orders-42`) keep their name for `etcdctl lock`.

use lockkit_core::LockKey;

/// The range prefix of `key`'s contenders (ends with `/`).
pub fn lock_range(prefix: &str, key: &LockKey) -> String {
    format!("{prefix}/{}/", encode_str(key.as_str()))
}

/// Encodes a key (or a key prefix: a prefix of a key encodes to a prefix of its name).
pub fn encode_str(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '/' => out.push_str("%2F"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(s: &str) -> String {
        lock_range("/lockkit", &LockKey::new(s).unwrap())
    }

    #[test]
    fn simple_names_are_kept_and_slashes_encoded() {
        assert_eq!(range("orders-42"), "/lockkit/orders-42/");
        assert_eq!(range("a/b"), "/lockkit/a%2Fb/");
        assert_eq!(range("a%2Fb"), "/lockkit/a%252Fb/");
        assert_eq!(range("ключ"), "/lockkit/ключ/");
        assert!(!range("a/b").starts_with(&range("a")));
    }
}

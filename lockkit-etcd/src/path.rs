//! Lock keys as etcd key ranges: the lock `k` is the range `<prefix>/<k>/`, its contenders
//! the keys `<prefix>/<k>/<lease id in hex>` in it, as etcd's `concurrency.Mutex` and
//! `etcdctl lock <prefix>/<k>` name theirs.
//!
//! `/` and `%` in a key are percent-encoded, so no key's range contains another key's
//! contenders (`a` and `a/b` would otherwise share `<prefix>/a/`); every other byte is
//! kept, so simple keys (`orders-42`) keep their name for `etcdctl lock`.
//!
//! Read-write locks use the layout of etcd's recipe `RWMutex` with the lock's range as its
//! prefix: readers `<range>read/<lease id in hex>`, writers `<range>write/<lease id in
//! hex>` (the recipe's own clients name theirs by a timestamp; only the sub-range counts).
//! A writer that let go while its owner still reads through a downgrade keeps its key and
//! adds `<writer key>/downgraded` beside it (lockkit-only). Semaphore permits are
//! `<range>permits/<limit>/<lease id in hex>` (lockkit-only). Every contender of the range
//! excludes a plain lock's contender, which waits behind whatever came first.

use lockkit_core::{LockKey, LockKind};

/// The sub-range of readers, as etcd's recipe `RWMutex` names it.
pub const READ: &str = "read/";
/// The sub-range of writers, as etcd's recipe `RWMutex` names it.
pub const WRITE: &str = "write/";
/// The sub-range of semaphore permits (lockkit-only).
pub const PERMITS: &str = "permits/";
/// What a writer key that only a downgraded read keeps is marked with: this suffix.
pub const DOWNGRADED: &str = "/downgraded";

/// The range prefix of `key`'s contenders (ends with `/`).
pub fn lock_range(prefix: &str, key: &LockKey) -> String {
    format!("{prefix}/{}/", encode_str(key.as_str()))
}

/// The contender key of a hold of `kind` on the lease `lease`, in the lock range `range`.
pub fn contender_name(range: &str, kind: LockKind, lease: i64) -> String {
    match kind {
        LockKind::Read => format!("{range}{READ}{lease:x}"),
        LockKind::Write => format!("{range}{WRITE}{lease:x}"),
        LockKind::Permit { limit } => format!("{range}{PERMITS}{limit}/{lease:x}"),
        _ => format!("{range}{lease:x}"),
    }
}

/// The end of the range of every key that starts with `prefix` (etcd's prefix end: the
/// last byte below 0xff raised by one; empty, meaning no end, when there is none).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// What a key of a lock's range is, by its name after the range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contender {
    /// A plain lock's contender (lockkit's, `etcdctl lock`'s, `concurrency.Mutex`'s), or a
    /// key nobody here knows: it excludes everyone.
    Lock,
    /// A reader (lockkit's or the recipe's).
    Read,
    /// A writer (lockkit's or the recipe's).
    Write,
    /// The mark beside a writer key that only a downgraded read keeps: the full name of
    /// that writer key.
    Downgraded(String),
    /// A semaphore permit, of a semaphore of this many permits.
    Permit(u32),
}

/// Classifies `name`, a key of the lock range `range`.
pub fn classify(range: &str, name: &[u8]) -> Contender {
    let name = String::from_utf8_lossy(name);
    let rest = name.strip_prefix(range).unwrap_or(&name);
    if rest.starts_with(READ) {
        Contender::Read
    } else if rest.starts_with(WRITE) {
        match name.strip_suffix(DOWNGRADED) {
            Some(writer) => Contender::Downgraded(writer.to_owned()),
            None => Contender::Write,
        }
    } else if let Some(permit) = rest.strip_prefix(PERMITS) {
        permit
            .split_once('/')
            .and_then(|(limit, _)| limit.parse::<u32>().ok())
            .filter(|limit| *limit > 0)
            .map_or(Contender::Lock, Contender::Permit)
    } else {
        Contender::Lock
    }
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

    #[test]
    fn contenders_are_named_and_classified_by_kind() {
        let r = range("k");
        let three = std::num::NonZeroU32::new(3).unwrap();
        let names = [
            (LockKind::Exclusive, "/lockkit/k/1f", Contender::Lock),
            (LockKind::Read, "/lockkit/k/read/1f", Contender::Read),
            (LockKind::Write, "/lockkit/k/write/1f", Contender::Write),
            (
                LockKind::Permit { limit: three },
                "/lockkit/k/permits/3/1f",
                Contender::Permit(3),
            ),
        ];
        for (kind, name, class) in names {
            assert_eq!(contender_name(&r, kind, 0x1f), name);
            assert_eq!(classify(&r, name.as_bytes()), class);
        }
        assert_eq!(
            classify(&r, b"/lockkit/k/write/1f/downgraded"),
            Contender::Downgraded("/lockkit/k/write/1f".into())
        );
        // The recipe's own names.
        assert_eq!(
            classify(&r, b"/lockkit/k/read/1700000000000"),
            Contender::Read
        );
        assert_eq!(classify(&r, b"/lockkit/k/permits/x/1"), Contender::Lock);
        assert_eq!(prefix_end(b"/lockkit/k/"), b"/lockkit/k0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
    }
}

//! Node names and queue rules, without I/O: which children of a lock's directory are
//! contenders, in what order, which of them are readers, and which hold the lock now.
//!
//! Names follow Apache Curator (protected `_c_<uuid>-` prefix): its InterProcessMutex's
//! `lock-`, InterProcessReadWriteLock's `__READ__` and `__WRIT__`, and
//! InterProcessSemaphoreV2's `locks/` and `leases/lease-`; or, with `layout=kazoo`,
//! kazoo's (`<uuid hex>__lock__`, `<uuid hex>__rlock__`, and its Semaphore's lease nodes
//! and sibling `-__lock__` path). Whatever the layout, kazoo's `__lock__` and `__rlock__`
//! and the ZooKeeper recipe's `x-` are read as contenders too.

use lockkit_core::LockKind;
use uuid::Uuid;

use crate::ZkLayout;

/// The name Curator's InterProcessMutex gives its contenders, after the protected prefix.
pub(crate) const LOCK_LABEL: &str = "-lock-";
/// Curator's read-lock contenders (`InterProcessReadWriteLock.READ_LOCK_NAME`).
pub(crate) const READ_LABEL: &str = "-__READ__";
/// Curator's write-lock contenders (`InterProcessReadWriteLock.WRITE_LOCK_NAME`).
pub(crate) const WRITE_LABEL: &str = "-__WRIT__";
/// Curator's semaphore leases (`InterProcessSemaphoreV2.LEASE_BASE_NAME`).
pub(crate) const LEASE_LABEL: &str = "-lease-";
/// The directory of a semaphore's internal mutex (`InterProcessSemaphoreV2.LOCK_PARENT`).
pub(crate) const LOCKS_DIR: &str = "locks";
/// The directory of a semaphore's leases (`InterProcessSemaphoreV2.LEASE_PARENT`).
pub(crate) const LEASES_DIR: &str = "leases";
/// lockkit's own node beside Curator's: a container whose data is the permit count, with
/// one ephemeral child per lockkit permit holder or waiter (Curator stores no count).
pub(crate) const PERMITS_DIR: &str = "lockkit-permits";

/// kazoo's `Lock` and `WriteLock` contenders (`Lock._NODE_NAME`).
pub(crate) const KAZOO_LOCK_LABEL: &str = "__lock__";
/// kazoo's `ReadLock` contenders (`ReadLock._NODE_NAME`).
pub(crate) const KAZOO_READ_LABEL: &str = "__rlock__";
/// What kazoo's `Semaphore` appends to its path for the path of its lock
/// (`lock_path = path + "-" + "__lock__"`).
pub(crate) const KAZOO_SEMAPHORE_LOCK_SUFFIX: &str = "-__lock__";

/// The prefix of a new contender node of `kind` (ZooKeeper appends the sequence):
/// Curator's protected `_c_<unique>-lock-`, `-__READ__`, `-__WRIT__`, `-lease-`; kazoo's
/// `<unique hex>__lock__` (plain and write locks, and a kazoo semaphore's lock) or
/// `<unique hex>__rlock__`. `unique` makes it this attempt's: after a lost reply, the node
/// is found again by its prefix.
pub(crate) fn contender_prefix(layout: ZkLayout, kind: LockKind, unique: Uuid) -> String {
    match layout {
        ZkLayout::Kazoo => {
            let label = if kind == LockKind::Read {
                KAZOO_READ_LABEL
            } else {
                KAZOO_LOCK_LABEL
            };
            format!("{}{label}", unique.simple())
        }
        _ => format!("_c_{unique}{}", label_of(kind)),
    }
}

/// The contender label for a kind of hold (permits use [`LEASE_LABEL`]).
pub(crate) fn label_of(kind: LockKind) -> &'static str {
    match kind {
        LockKind::Read => READ_LABEL,
        LockKind::Write => WRITE_LABEL,
        LockKind::Permit { .. } => LEASE_LABEL,
        _ => LOCK_LABEL,
    }
}

/// The sequence number ZooKeeper appended to a sequential node's name: its last 10 digits
/// (one counter per parent, so it orders every contender in a lock's directory), or `None`
/// for a node that is not sequential.
pub(crate) fn sequence_of(name: &str) -> Option<u64> {
    sequence_text(name)?.parse().ok()
}

/// The last 10 characters of `name` when they are all digits.
pub(crate) fn sequence_text(name: &str) -> Option<&str> {
    let digits = name.get(name.len().checked_sub(10)?..)?;
    digits.bytes().all(|b| b.is_ascii_digit()).then_some(digits)
}

/// Whether `name` is kazoo's `uuid4().hex` (32 lowercase hex digits): the name of a kazoo
/// `Semaphore`'s lease, and of lockkit's in kazoo's layout. No lock layout names a
/// contender so, yet its last 10 characters are all digits in about one name of 110: such a
/// name is still a lease.
pub(crate) fn is_uuid_hex(name: &str) -> bool {
    name.len() == 32 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether a child of a lock's directory is a contender: a sequential node of any layout
/// (its name ends in ZooKeeper's 10-digit sequence), not a kazoo lease.
pub(crate) fn is_contender(name: &str) -> bool {
    sequence_of(name).is_some() && !is_uuid_hex(name)
}

/// Whether a contender is a read lock's (Curator's `__READ__`, kazoo's `__rlock__`); every
/// other contender (a write lock's, a mutex's) excludes everyone.
pub(crate) fn is_reader(name: &str) -> bool {
    name.contains("__READ__") || name.contains("__rlock__")
}

/// The kind of hold a contender's name says it asks for.
pub(crate) fn kind_of_node(name: &str) -> LockKind {
    if is_reader(name) {
        LockKind::Read
    } else if name.contains("__WRIT__") {
        LockKind::Write
    } else {
        LockKind::Exclusive
    }
}

/// The contenders in a lock's directory, in queue order: every child whose name ends in a
/// sequence number, whoever made it (lockkit's and Curator's `_c_<uuid>-lock-N`,
/// `__READ__`/`__WRIT__`, kazoo's `<uuid>__lock__N` and `__rlock__N`, the ZooKeeper
/// recipe's `x-<session>-N`), so mixed fleets exclude each other. Ordered by sequence;
/// a downgrade's read node shares its writer's sequence and comes right after it.
pub(crate) fn contenders_in_order(children: &[String]) -> Vec<&String> {
    let mut queue: Vec<(u64, bool, &String)> = children
        .iter()
        .filter(|c| is_contender(c))
        .filter_map(|c| Some((sequence_of(c)?, is_reader(c), c)))
        .collect();
    queue.sort();
    queue.into_iter().map(|(_, _, c)| c).collect()
}

/// Where the contender at `position` of `queue` stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// It holds the lock.
    Holds,
    /// It waits; the contender at this index is the one whose deletion may change that
    /// (the only node it watches, so one release wakes only the waiters it concerns).
    Behind(usize),
}

/// The queue rule. A writer (or mutex) holds at the head, and otherwise waits for its
/// immediate predecessor, of either kind. A reader holds when no writer comes before it,
/// and otherwise waits for the nearest writer before it; a writer of the reader's own
/// sequence is the writer that downgraded to it, and does not count. FIFO: a reader that
/// comes after a waiting writer waits, which gives writers preference.
pub(crate) fn standing(queue: &[&String], position: usize) -> Standing {
    let Some(me) = queue.get(position) else {
        return Standing::Holds;
    };
    if !is_reader(me) {
        return match position.checked_sub(1) {
            None => Standing::Holds,
            Some(before) => Standing::Behind(before),
        };
    }
    let mine = sequence_of(me);
    queue[..position]
        .iter()
        .rposition(|c| !is_reader(c) && sequence_of(c) != mine)
        .map_or(Standing::Holds, Standing::Behind)
}

/// The indices of `queue` whose contenders hold the lock now.
pub(crate) fn holding(queue: &[&String]) -> Vec<usize> {
    (0..queue.len())
        .filter(|&i| standing(queue, i) == Standing::Holds)
        .collect()
}

/// The name of the read node that downgrades the write node `writer` (the fixed form of
/// CURATOR-621): a plain ephemeral node that carries the writer's sequence, so it keeps the
/// writer's place in the queue when the write is released. `None` when `writer` is not
/// sequential. kazoo compares sequence strings, so its writers queued behind see the
/// kazoo-named read node (`<hex>__rlock__<s>`) before them, and its readers do not count it.
pub(crate) fn downgrade_name(layout: ZkLayout, writer: &str, unique: Uuid) -> Option<String> {
    Some(format!(
        "{}{}",
        contender_prefix(layout, LockKind::Read, unique),
        sequence_text(writer)?
    ))
}

/// Whether a child of a key's node is one of kazoo's semaphore leases (or anything else
/// kazoo's `Semaphore` would count as one): neither a contender nor one of Curator's
/// semaphore directories.
pub(crate) fn is_kazoo_lease(name: &str) -> bool {
    !is_contender(name) && ![LEASES_DIR, LOCKS_DIR, PERMITS_DIR].contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn every_sequential_child_is_a_contender_in_sequence_order() {
        let children = names(&[
            "_c_0b5e-lock-0000000007",
            "f00d__lock__0000000003",
            "beef__rlock__0000000009",
            "x-1234-0000000005",
            "not-a-contender",
            "leases",
            "_c_aa-lock-0000000001",
        ]);
        let order: Vec<&str> = contenders_in_order(&children)
            .into_iter()
            .map(String::as_str)
            .collect();
        assert_eq!(
            order,
            [
                "_c_aa-lock-0000000001",
                "f00d__lock__0000000003",
                "x-1234-0000000005",
                "_c_0b5e-lock-0000000007",
                "beef__rlock__0000000009",
            ]
        );
    }

    #[test]
    fn readers_share_until_a_writer_and_each_waiter_watches_one_node() {
        let children = names(&[
            "_c_a-__READ__0000000001",
            "_c_b-__READ__0000000002",
            "_c_c-__WRIT__0000000003",
            "_c_d-__READ__0000000004",
            "_c_e-__READ__0000000005",
            "_c_f-__WRIT__0000000006",
        ]);
        let queue = contenders_in_order(&children);
        assert_eq!(holding(&queue), [0, 1]);
        // The writer waits for its immediate predecessor; readers behind it for it (not
        // for each other): no herd when the writer goes.
        assert_eq!(standing(&queue, 2), Standing::Behind(1));
        assert_eq!(standing(&queue, 3), Standing::Behind(2));
        assert_eq!(standing(&queue, 4), Standing::Behind(2));
        assert_eq!(standing(&queue, 5), Standing::Behind(4));
    }

    #[test]
    fn kazoo_names_are_kazoos() {
        let unique = Uuid::from_u128(0xab);
        let hex = unique.simple().to_string();
        assert_eq!(
            contender_prefix(ZkLayout::Kazoo, LockKind::Exclusive, unique),
            format!("{hex}__lock__")
        );
        assert_eq!(
            contender_prefix(ZkLayout::Kazoo, LockKind::Write, unique),
            format!("{hex}__lock__")
        );
        assert_eq!(
            contender_prefix(ZkLayout::Kazoo, LockKind::Read, unique),
            format!("{hex}__rlock__")
        );
        assert_eq!(
            contender_prefix(ZkLayout::Curator, LockKind::Write, unique),
            format!("_c_{unique}-__WRIT__")
        );
        let writer = format!("{hex}__lock__0000000012");
        let read = downgrade_name(ZkLayout::Kazoo, &writer, unique).unwrap();
        assert_eq!(read, format!("{hex}__rlock__0000000012"));
        assert_eq!(kind_of_node(&read), LockKind::Read);
        assert!(is_kazoo_lease(&hex));
        assert!(!is_kazoo_lease(&writer) && !is_kazoo_lease(LEASES_DIR));
    }

    #[test]
    fn a_kazoo_lease_whose_hex_name_ends_in_ten_digits_is_no_contender() {
        // `uuid4().hex` ends in ten decimal digits about once in 110 names.
        let lease = "abcdef0123456789abcdef0123456789";
        assert_eq!(lease.len(), 32);
        assert!(is_kazoo_lease(lease), "a kazoo lease");
        let children = names(&[lease, "f00d__lock__0000000003"]);
        let queue = contenders_in_order(&children);
        assert_eq!(queue, ["f00d__lock__0000000003"]);
    }

    #[test]
    fn a_downgrade_keeps_the_writers_place() {
        let writer = "_c_w-__WRIT__0000000004";
        let unique = Uuid::from_u128(1);
        let read = downgrade_name(ZkLayout::Curator, writer, unique).unwrap();
        assert_eq!(read, format!("_c_{unique}-__READ__0000000004"));
        let children = names(&[
            "_c_x-__WRIT__0000000006",
            &read,
            "_c_y-__READ__0000000005",
            writer,
        ]);
        let queue = contenders_in_order(&children);
        assert_eq!(
            queue,
            [
                writer,
                read.as_str(),
                "_c_y-__READ__0000000005",
                "_c_x-__WRIT__0000000006"
            ]
        );
        // The writer and its own read hold; the reader behind waits for the writer.
        assert_eq!(holding(&queue), [0, 1]);
        assert_eq!(standing(&queue, 2), Standing::Behind(0));
        // Once the write is released, readers behind join; the writer behind stays out.
        let after: Vec<&String> = queue[1..].to_vec();
        assert_eq!(holding(&after), [0, 1]);
        assert_eq!(standing(&after, 2), Standing::Behind(1));
    }

    #[test]
    fn a_mutex_counts_as_a_writer_and_kinds_are_read_from_names() {
        let children = names(&["_c_a-__READ__0000000001", "_c_b-lock-0000000002"]);
        let queue = contenders_in_order(&children);
        assert_eq!(holding(&queue), [0]);
        assert_eq!(kind_of_node(queue[1]), LockKind::Exclusive);
        assert_eq!(kind_of_node("_c_b-__WRIT__0000000002"), LockKind::Write);
        assert_eq!(kind_of_node("ab__rlock__0000000002"), LockKind::Read);
        assert_eq!(label_of(LockKind::Exclusive), LOCK_LABEL);
    }
}

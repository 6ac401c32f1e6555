//! What each kind of hold waits for in a lock range, and who holds it.
//!
//! - A plain lock or a writer waits for every key created before its own (etcd's
//!   `concurrency.Mutex` and the recipe `RWMutex`'s writer): it watches the nearest.
//! - A reader waits for every key before its own that is not a reader's (writers, plain
//!   locks of lockkit, `etcdctl lock` and `concurrency.Mutex`), except a writer key kept
//!   only for its owner's downgraded read: it watches the nearest, and the marker that may
//!   be put beside it. FIFO by create revision gives writer preference: a writer's key
//!   keeps every later reader out.
//! - A permit of a semaphore of N waits until fewer than N permit keys precede its own:
//!   it watches the permits' range for deletions.
//!
//! Keys are never rewritten after they are created (the recipe orders by mod revision).

use std::collections::HashSet;

use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget, TxnOp, TxnOpResponse, TxnResponse};
use lockkit_core::{LockKind, spi::parse_contender_record};

use crate::path::{Contender, PERMITS, READ, classify, prefix_end};

/// The answer of a transaction's `index`th operation, if it was a range.
fn get_of(answer: &TxnResponse, index: usize) -> Option<etcd_client::GetResponse> {
    match answer.op_responses().into_iter().nth(index) {
        Some(TxnOpResponse::Get(got)) => Some(got),
        _ => None,
    }
}

/// The keys a transaction's `index`th operation read.
pub(crate) fn range_of(answer: &TxnResponse, index: usize) -> Vec<KeyValue> {
    get_of(answer, index).map_or_else(Vec::new, |mut got| got.take_kvs())
}

/// How many keys a transaction's `index`th operation counted.
fn count_of(answer: &TxnResponse, index: usize) -> i64 {
    get_of(answer, index).map_or(0, |got| got.count())
}

/// The contender just before the one created at `revision`: the key of the range with the
/// highest create revision below it (etcd's `concurrency.Mutex` asks the same).
fn predecessor_query(revision: i64) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_max_create_revision(revision - 1)
        .with_limit(1)
}

/// The oldest key of the sub-range `sub` (by create revision), name only.
fn oldest_in(sub: &str) -> TxnOp {
    TxnOp::get(
        sub,
        Some(
            GetOptions::new()
                .with_range(prefix_end(sub.as_bytes()))
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_keys_only()
                .with_limit(1),
        ),
    )
}

/// The range operations that tell whether the lock range `range` is used as another kind
/// than `kind` (see [`mismatch`]), to go in the transaction that creates a contender key.
pub(crate) fn conflict_ops(range: &str, kind: LockKind) -> Vec<TxnOp> {
    let permits = format!("{range}{PERMITS}");
    match kind {
        LockKind::Permit { .. } => vec![
            TxnOp::get(
                range,
                Some(
                    GetOptions::new()
                        .with_range(permits.clone())
                        .with_count_only(),
                ),
            ),
            TxnOp::get(
                prefix_end(permits.as_bytes()),
                Some(
                    GetOptions::new()
                        .with_range(prefix_end(range.as_bytes()))
                        .with_count_only(),
                ),
            ),
            oldest_in(&permits),
        ],
        _ => vec![oldest_in(&permits)],
    }
}

/// What the lock range is used as when that is not `kind` (what
/// [`lockkit_core::Error::KindMismatch`] says), from the answers of [`conflict_ops`], the
/// first at index `first` of `answer`: a semaphore asked for as a lock or as a semaphore
/// of another count, or a lock asked for as a semaphore. The oldest permit key says what
/// count the semaphore has.
pub(crate) fn mismatch(
    range: &str,
    kind: LockKind,
    answer: &TxnResponse,
    first: usize,
) -> Option<String> {
    let oldest_limit = |index: usize| {
        range_of(answer, index)
            .first()
            .and_then(|kv| match classify(range, kv.key()) {
                Contender::Permit(limit) => Some(limit),
                _ => None,
            })
    };
    match kind {
        LockKind::Permit { limit } => {
            if count_of(answer, first) + count_of(answer, first + 1) > 0 {
                return Some("is held as a lock or a read-write lock".into());
            }
            oldest_limit(first + 2)
                .filter(|theirs| *theirs != limit.get())
                .map(|theirs| format!("is a semaphore of {theirs} permits"))
        }
        _ => oldest_limit(first).map(|theirs| format!("is a semaphore of {theirs} permits")),
    }
}

/// The range operations that find what a contender of `kind` created at `revision` in
/// `range` waits for (see [`blocker`]).
pub(crate) fn check_ops(range: &str, kind: LockKind, revision: i64) -> Vec<TxnOp> {
    match kind {
        LockKind::Read => {
            let readers = format!("{range}{READ}");
            // Every key of the range but the readers', with no revision bound: a marker
            // put after this reader's key counts too.
            vec![
                TxnOp::get(
                    range,
                    Some(
                        GetOptions::new()
                            .with_range(readers.clone())
                            .with_keys_only(),
                    ),
                ),
                TxnOp::get(
                    prefix_end(readers.as_bytes()),
                    Some(
                        GetOptions::new()
                            .with_range(prefix_end(range.as_bytes()))
                            .with_keys_only(),
                    ),
                ),
            ]
        }
        LockKind::Permit { limit } => {
            let permits = format!("{range}{PERMITS}");
            vec![TxnOp::get(
                permits.clone(),
                Some(
                    GetOptions::new()
                        .with_range(prefix_end(permits.as_bytes()))
                        .with_keys_only()
                        .with_sort(SortTarget::Create, SortOrder::Descend)
                        .with_max_create_revision(revision - 1)
                        .with_limit(i64::from(limit.get())),
                ),
            )]
        }
        _ => vec![TxnOp::get(range, Some(predecessor_query(revision)))],
    }
}

/// What a contender waits for, and how to watch it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Blocker {
    /// The key watched, or the first key of the range watched.
    pub(crate) key: Vec<u8>,
    /// The end of the range watched (`None`: the key alone).
    pub(crate) end: Option<Vec<u8>>,
    /// Whether only deletions wake the waiter (else any change in what is watched).
    pub(crate) deletes_only: bool,
    /// The keys that block it: when they change, it looks again.
    pub(crate) keys: Vec<Vec<u8>>,
}

impl Blocker {
    /// Waiting for the deletion of `key` alone.
    pub(crate) fn deletion_of(key: Vec<u8>) -> Blocker {
        Blocker {
            keys: vec![key.clone()],
            key,
            end: None,
            deletes_only: true,
        }
    }
}

/// What the contender of `kind` created at `revision` in `range` waits for, from the
/// answers of [`check_ops`] (from index `first` of `answer`); `None` when it holds.
pub(crate) fn blocker(
    range: &str,
    kind: LockKind,
    revision: i64,
    answer: &TxnResponse,
    first: usize,
) -> Option<Blocker> {
    match kind {
        LockKind::Read => {
            let mut keys = range_of(answer, first);
            keys.extend(range_of(answer, first + 1));
            let downgraded = downgraded_writers(range, &keys);
            let nearest = keys
                .iter()
                .filter(|kv| kv.create_revision() < revision)
                .filter(|kv| blocks_readers(range, kv, &downgraded))
                .max_by_key(|kv| kv.create_revision())?;
            // The key and whatever is put beside it (`<key>/downgraded`): no contender's
            // name continues its key with a byte below `0`.
            let mut end = nearest.key().to_vec();
            end.push(b'0');
            Some(Blocker {
                key: nearest.key().to_vec(),
                end: Some(end),
                deletes_only: false,
                keys: vec![nearest.key().to_vec()],
            })
        }
        LockKind::Permit { limit } => {
            let before = range_of(answer, first);
            if before.len() < usize::try_from(limit.get()).unwrap_or(usize::MAX) {
                return None;
            }
            let permits = format!("{range}{PERMITS}");
            Some(Blocker {
                end: Some(prefix_end(permits.as_bytes())),
                key: permits.into_bytes(),
                deletes_only: true,
                keys: before.iter().map(|kv| kv.key().to_vec()).collect(),
            })
        }
        _ => range_of(answer, first)
            .first()
            .map(|kv| Blocker::deletion_of(kv.key().to_vec())),
    }
}

/// The writer keys that a marker says are kept only for their owner's downgraded read.
fn downgraded_writers(range: &str, keys: &[KeyValue]) -> HashSet<Vec<u8>> {
    keys.iter()
        .filter_map(|kv| match classify(range, kv.key()) {
            Contender::Downgraded(writer) => Some(writer.into_bytes()),
            _ => None,
        })
        .collect()
}

/// Whether `kv` keeps a later reader out.
fn blocks_readers(range: &str, kv: &KeyValue, downgraded: &HashSet<Vec<u8>>) -> bool {
    match classify(range, kv.key()) {
        Contender::Read | Contender::Downgraded(_) => false,
        Contender::Write => !downgraded.contains(kv.key()),
        Contender::Lock | Contender::Permit(_) => true,
    }
}

/// One key of a lock range that holds, with the kind it holds as (`None`: a plain lock).
pub(crate) struct Holding<'a> {
    pub(crate) kv: &'a KeyValue,
    pub(crate) kind: Option<LockKind>,
}

/// Who holds the lock range `range` whose keys are `keys` (in create-revision order), and
/// how many contenders wait.
///
/// The first key holds whatever it is; a reader holds when no key before it keeps readers
/// out, or when the first key is its own owner's write (a downgrade); a permit of
/// N holds when fewer than N permits precede it. A writer key kept only for a downgraded
/// read, and its marker, are not holds.
pub(crate) fn holding<'a>(range: &str, keys: &'a [KeyValue]) -> (Vec<Holding<'a>>, u32) {
    let downgraded = downgraded_writers(range, keys);
    // Keys without a record (the recipe's) are told apart by name.
    let owner =
        |kv: &KeyValue| parse_contender_record(kv.value(), &String::from_utf8_lossy(kv.key())).0;
    // The first key, if a writer's (held, or kept for its owner's downgraded read).
    let head_writer = keys
        .first()
        .filter(|kv| classify(range, kv.key()) == Contender::Write)
        .map(owner);
    let mut holders = Vec::new();
    let mut waiting = 0u32;
    let mut readers_kept_out = false;
    let mut permits_before = 0u32;
    for (index, kv) in keys.iter().enumerate() {
        let class = classify(range, kv.key());
        let holds = match class {
            Contender::Downgraded(_) => continue,
            Contender::Write if downgraded.contains(kv.key()) => continue,
            Contender::Read => {
                !readers_kept_out
                    || head_writer
                        .as_ref()
                        .is_some_and(|writer| *writer == owner(kv))
            }
            Contender::Permit(limit) => {
                permits_before += 1;
                permits_before <= limit
            }
            Contender::Lock | Contender::Write => index == 0,
        };
        if blocks_readers(range, kv, &downgraded) {
            readers_kept_out = true;
        }
        if holds {
            let kind = match class {
                Contender::Read => Some(LockKind::Read),
                Contender::Write => Some(LockKind::Write),
                Contender::Permit(limit) => {
                    std::num::NonZeroU32::new(limit).map(|limit| LockKind::Permit { limit })
                }
                _ => None,
            };
            holders.push(Holding { kv, kind });
        } else {
            waiting = waiting.saturating_add(1);
        }
    }
    (holders, waiting)
}

//! Read-write locks over the Redlock quorum: what differs from the plain lock (the
//! semaphore refusal, the waiting-writer markers on every master, the hold's token written
//! back into each master's copy of the hold, and the holders a quorum agrees on).
//!
//! Each master runs the single-server scripts of [`crate::wire`] (Redisson's
//! `RReadWriteLock` layout); a hold is granted when a majority granted it. Any two
//! majorities share a master, and on that master the scripts exclude: so two writers, or a
//! writer and a reader, of different owners never both hold a majority.

use lockkit_core::spi::AcquireRequest;
use lockkit_core::{Error, HolderIdentity, HolderInfo, LockKind, Result};

use super::{BACKEND, RedlockBackend};
use crate::single::ForgetWriter;

/// Why semaphores are refused on Redlock, and what to use instead.
const NO_SEMAPHORES: &str = "counting semaphores: a majority quorum cannot bound a count \
    (with 5 masters and N >= 2 permits, N+1 holders can each hold a majority, each master \
    seeing at most N of them); use redis:// or redis+cluster:// (Redisson's \
    RPermitExpirableSemaphore layout), zk://, etcd://, or mysql/postgres mode=row for \
    semaphores, or N plain Redlock locks `key#0..N` (stripes)";

/// Refuses a permit request before any I/O: semaphores cannot be made sound on a quorum.
///
/// # Errors
/// [`Error::Unsupported`] for [`LockKind::Permit`], saying why and what to use instead.
pub(super) fn refuse_permits(kind: LockKind) -> Result<()> {
    match kind {
        LockKind::Permit { .. } => Err(Error::Unsupported {
            backend: BACKEND,
            what: NO_SEMAPHORES.into(),
        }),
        _ => Ok(()),
    }
}

/// The hash field of `req`'s hold on each master, whose stored token Redlock's write-back
/// sets (`None` for a plain lock: its token is the counter itself).
pub(super) fn hold_field(req: &AcquireRequest) -> Option<String> {
    match req.kind {
        LockKind::Read => Some(req.owner.to_string()),
        LockKind::Write => Some(format!("{}:write", req.owner)),
        _ => None,
    }
}

impl ForgetWriter for RedlockBackend {
    /// Forgets the waiting-writer marker on every master that ever answered (a master the
    /// marker could have reached); one that is down keeps it until it runs out (seconds).
    fn forget_writer_later(&self, req: &AcquireRequest) {
        for node in self.nodes.iter().filter_map(super::Master::connected) {
            node.forget_writer_later(req);
        }
    }
}

/// The holds a quorum of masters agree on, from each master's list of holders: one entry
/// per owner and kind that at least `quorum` masters list, writers (and plain locks) first.
/// Depth and token are the highest seen, the lease the shortest, the identity the one most
/// masters report, the waiters the most any master counts.
pub(super) fn agreed_holders(per_master: &[Vec<HolderInfo>], quorum: usize) -> Vec<HolderInfo> {
    /// One hold: its owner and kind, and each master's copy of it.
    type Group<'a> = ((&'a str, Option<LockKind>), Vec<&'a HolderInfo>);
    let mut groups: Vec<Group<'_>> = Vec::new();
    for holds in per_master {
        for info in holds {
            let id = (info.owner.as_str(), info.kind);
            match groups.iter_mut().find(|(g, _)| *g == id) {
                Some((_, same)) => same.push(info),
                None => groups.push((id, vec![info])),
            }
        }
    }
    let mut agreed: Vec<HolderInfo> = groups
        .into_iter()
        .filter(|(_, same)| same.len() >= quorum)
        .map(|((owner, kind), same)| {
            let info = HolderInfo::new(
                owner,
                same.iter().map(|i| i.depth).max().unwrap_or(1),
                same.iter().filter_map(|i| i.token).max(),
                same.iter().filter_map(|i| i.ttl_left).min(),
            )
            .with_identity(majority_identity(&same));
            let info = match kind {
                Some(kind) => info.with_kind(kind),
                None => info,
            };
            match same.iter().filter_map(|i| i.waiters).max() {
                Some(waiters) => info.with_waiters(waiters),
                None => info,
            }
        })
        .collect();
    agreed.sort_by_key(|info| matches!(info.kind, Some(LockKind::Read)));
    agreed
}

/// How many masters list the hold that most of them list, among the holds fewer than
/// `quorum` masters list (one per owner and kind, as [`agreed_holders`] groups them); `None`
/// when no such hold is listed.
pub(super) fn most_listed_short_of(per_master: &[Vec<HolderInfo>], quorum: usize) -> Option<usize> {
    let mut counts: Vec<((&str, Option<LockKind>), usize)> = Vec::new();
    for holds in per_master {
        for info in holds {
            let id = (info.owner.as_str(), info.kind);
            match counts.iter_mut().find(|(g, _)| *g == id) {
                Some((_, n)) => *n += 1,
                None => counts.push((id, 1)),
            }
        }
    }
    counts
        .into_iter()
        .map(|(_, n)| n)
        .filter(|n| *n < quorum)
        .max()
}

/// The identity most of `holds` (one per master) report: a master whose copy of the hold
/// lapsed and was made again by a re-entry carries that re-entry's identity instead.
fn majority_identity(holds: &[&HolderInfo]) -> Option<HolderIdentity> {
    let identities: Vec<&HolderIdentity> =
        holds.iter().filter_map(|i| i.identity.as_ref()).collect();
    identities
        .iter()
        .max_by_key(|candidate| identities.iter().filter(|i| i == candidate).count())
        .map(|i| (*i).clone())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lockkit_core::FencingToken;

    use super::*;

    fn hold(owner: &str, kind: Option<LockKind>, token: u64, ttl_ms: u64) -> HolderInfo {
        let info = HolderInfo::new(
            owner,
            1,
            Some(FencingToken::new(token)),
            Some(Duration::from_millis(ttl_ms)),
        );
        match kind {
            Some(kind) => info.with_kind(kind),
            None => info,
        }
    }

    #[test]
    fn only_holds_a_quorum_lists_are_agreed_writers_first() {
        let read = Some(LockKind::Read);
        let write = Some(LockKind::Write);
        let masters = vec![
            vec![hold("a", read, 5, 900), hold("b", read, 7, 800)],
            vec![hold("b", read, 7, 700), hold("a", read, 5, 950)],
            vec![hold("c", write, 9, 100), hold("b", read, 6, 990)],
        ];
        let agreed = agreed_holders(&masters, 2);
        let owners: Vec<(&str, u64, Duration)> = agreed
            .iter()
            .map(|i| {
                (
                    i.owner.as_str(),
                    i.token.unwrap().get(),
                    i.ttl_left.unwrap(),
                )
            })
            .collect();
        assert_eq!(
            owners,
            vec![
                ("a", 5, Duration::from_millis(900)),
                ("b", 7, Duration::from_millis(700)),
            ],
            "c is on one master only; b's token is the highest, its lease the shortest"
        );
        let masters = vec![
            vec![hold("c", write, 9, 100)],
            vec![hold("a", read, 5, 900), hold("c", write, 9, 100)],
        ];
        let agreed = agreed_holders(&masters, 1);
        assert_eq!(agreed[0].kind, write, "the writer comes first");
        assert_eq!(agreed[1].kind, read);
    }

    #[test]
    fn the_most_listed_hold_short_of_a_quorum_is_counted() {
        let masters = vec![
            vec![hold("a", None, 1, 100)],
            vec![
                hold("a", None, 1, 100),
                hold("b", Some(LockKind::Read), 2, 100),
            ],
            vec![],
        ];
        assert_eq!(most_listed_short_of(&masters, 3), Some(2));
        assert_eq!(most_listed_short_of(&masters, 2), Some(1), "a is agreed");
        assert_eq!(most_listed_short_of(&[vec![], vec![]], 2), None);
    }

    #[test]
    fn a_plain_lock_and_a_read_of_one_owner_are_two_holds() {
        let masters = vec![
            vec![hold("a", None, 1, 100)],
            vec![hold("a", Some(LockKind::Read), 2, 100)],
        ];
        assert!(agreed_holders(&masters, 2).is_empty());
    }

    #[test]
    fn permits_are_refused_saying_why() {
        let limit = std::num::NonZeroU32::new(3).unwrap();
        let refused = refuse_permits(LockKind::Permit { limit }).unwrap_err();
        let text = refused.to_string();
        assert!(matches!(refused, Error::Unsupported { .. }));
        assert!(text.contains("quorum cannot bound a count"), "{text}");
        assert!(text.contains("redis://"), "{text}");
        assert!(refuse_permits(LockKind::Read).is_ok());
    }
}

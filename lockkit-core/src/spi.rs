//! What only backend authors (and authors of backend wrappers) need: the request and grant
//! types of [`LockBackend`](crate::LockBackend), the attempt ledger that makes retries take
//! effect once, the cancel-safe shape of an acquisition, the one wait loop (attempt,
//! wake-up, backoff, deadline), and the deadline and lease helpers every backend uses alike. Lock users need none of it: they use [`Locker`](crate::Locker).

pub use crate::attempts::AttemptLedger;
pub use crate::backend::{AcquireRequest, Grant, Released, sql_response_bound};
pub use crate::detach::{Interrupt, detached, detached_acquire};
pub use crate::file::file_name;
pub use crate::guard::local_validity;
pub use crate::holder::{
    MAX_ENCODED_BYTES, MAX_NAME_BYTES, contender_record, parse_contender_record,
};
pub use crate::kept::{KeptConnections, Lent, NoConnection, sweep_while};
pub use crate::local_hold::{CountRelease, HoldCount, LocalHolds};
pub use crate::options::{lease_end, validate_ttl};
pub use crate::recent_loss::RecentLoss;
pub use crate::suspend::Stamp;
pub use crate::wait::{
    Armed, Attempt, Backoff, Polling, WaitPolicy, Wake, armed, never, wait_for_grant,
};
pub use crate::wait::{deadline_after, granted_or_timeout};

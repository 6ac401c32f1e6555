//! # lockkit-core
//!
//! The contract every lockkit backend keeps, and the machinery shared by all of them.
//!
//! - [`Locker`] takes locks; [`LockGuard`] is a held lock: its [`FencingToken`], its
//!   lease (renewed by a watchdog while the guard lives), and a [`LockGuard::lost`] signal.
//! - [`Owner`] gives an explicit identity for reentrant locking (never a thread or task).
//! - [`LockBackend`] is the small SPI a lock service implements; [`MemoryBackend`] is the
//!   in-process reference implementation.
//!
//! Every failure is an [`Error`] that says what to do; nothing here panics on bad input.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod attempts;
mod backend;
pub mod config;
mod detach;
mod error;
mod fencing;
mod file;
mod file_watch;
mod gate;
mod guard;
mod holder;
mod into_key;
mod keeper_start;
mod kept;
mod key;
mod kind;
mod local_hold;
mod locker;
mod lost;
mod memory;
mod options;
mod owner;
mod recent_loss;
mod rules;
pub mod spi;
mod suspend;
mod suspend_tests;
pub mod telemetry;
mod wait;

pub(crate) use attempts::AttemptLedger;
pub(crate) use backend::{AcquireRequest, Grant, Released};
pub use backend::{
    BackendInfo, Capabilities, Consistency, DEFAULT_RESPONSE_BOUND, HolderInfo, LockBackend,
    MAX_TTL,
};
pub(crate) use detach::detached_acquire;
pub use error::{BoxError, Error, LostReason, Result};
pub use fencing::FencingToken;
pub use file::FileBackend;
pub use guard::LockGuard;
pub use holder::HolderIdentity;
pub use into_key::IntoLockKey;
pub use key::LockKey;
pub use kind::LockKind;
pub use locker::{Acquire, Locker, Owner, Semaphore, TryAcquire};
pub use lost::LossSignal;
pub use memory::MemoryBackend;
pub use options::{DEFAULT_TTL, LockOptions};
pub use owner::OwnerId;
pub use wait::WAIT_FOREVER;

/// Re-exported so backends implement [`LockBackend`] with the same macro version.
pub use async_trait::async_trait;

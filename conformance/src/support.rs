//! Small helpers the cases share.

use std::fmt::{Debug, Display};

use lockkit_core::LockKey;
use uuid::Uuid;

/// A unique key namespace per case run, so cases run in parallel and reruns never meet
/// leftovers.
#[derive(Debug, Clone)]
pub struct Space {
    prefix: String,
}

impl Space {
    /// A namespace `lockkit-test/<random>/<case>/`.
    pub fn new(case: &str) -> Self {
        let run = Uuid::new_v4().simple().to_string();
        Space {
            prefix: format!("lockkit-test/{}/{case}/", &run[..12]),
        }
    }

    /// The prefix shared by all keys of this namespace.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A key in this namespace.
    pub fn key(&self, name: &str) -> LockKey {
        LockKey::new(format!("{}{name}", self.prefix))
            .unwrap_or_else(|e| panic!("test key `{name}` is invalid: {e}"))
    }
}

/// Turns an unexpected error into a case failure that says what was being done.
pub trait Check<T> {
    /// Returns the value, or fails the case with `doing` and the error.
    fn check(self, doing: &str) -> T;
}

impl<T, E: Display> Check<T> for Result<T, E> {
    #[track_caller]
    fn check(self, doing: &str) -> T {
        match self {
            Ok(v) => v,
            Err(e) => panic!("{doing}: unexpected error: {e}"),
        }
    }
}

impl<T> Check<T> for Option<T> {
    #[track_caller]
    fn check(self, doing: &str) -> T {
        match self {
            Some(v) => v,
            None => panic!("{doing}: got nothing"),
        }
    }
}

/// Fails unless `result` is the error `matches` accepts.
#[track_caller]
pub fn expect_err<T: Debug>(
    result: lockkit_core::Result<T>,
    doing: &str,
    matches: impl FnOnce(&lockkit_core::Error) -> bool,
) -> lockkit_core::Error {
    match result {
        Err(e) if matches(&e) => e,
        Err(e) => panic!("{doing}: wrong error: {e:?}"),
        Ok(v) => panic!("{doing}: expected an error, got {v:?}"),
    }
}

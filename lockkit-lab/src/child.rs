//! The lab's holder in another process, so it can be frozen with SIGSTOP: the `lockkit`
//! binary speaking the suite's child-holder protocol ([`lockkit_conformance::holder`]),
//! with the lock's URL and a fenced store (its location and resource) in its environment,
//! so its `WRITE`s go to the store with its token (as a holder does that checked its lock
//! before it was paused).

use std::time::Duration;

use lockkit_conformance::holder::{self, HolderProcess, HolderSpec};
use lockkit_core::{LockKey, Locker};
use tokio::process::Command;

use super::{Connect, Lab, LabError, store::FencedStore};

/// Set (to the lock's URL) in the child's environment.
pub const CHILD_VAR: &str = "LOCKKIT_LAB_CHILD_URL";
const STORE_VAR: &str = "LOCKKIT_LAB_CHILD_STORE";
const RESOURCE_VAR: &str = "LOCKKIT_LAB_CHILD_RESOURCE";

/// What the child holder writes to the store.
pub(crate) const CHILD_VALUE: &str = "written by the child holder";

/// Whether this process was started as the lab's child holder.
pub fn child_requested() -> bool {
    std::env::var_os(CHILD_VAR).is_some()
}

/// The child's side. Returns the process exit code: 0 after the parent closed stdin, 2 if
/// the lock could not be taken.
pub async fn child_main(connect: Connect) -> i32 {
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let url = var(CHILD_VAR);
    let Some(spec) = HolderSpec::from_env() else {
        println!(
            "{} FAILED no holder spec in the environment",
            holder::PREFIX
        );
        return 2;
    };
    let backend = match connect(url.clone()).await {
        Ok(backend) => backend,
        Err(e) => {
            println!("{} FAILED connecting to {url}: {e}", holder::PREFIX);
            return 2;
        }
    };
    let store = match FencedStore::open(&var(STORE_VAR), &var(RESOURCE_VAR)).await {
        Ok(store) => store,
        Err(e) => {
            println!("{} FAILED opening the store: {e}", holder::PREFIX);
            return 2;
        }
    };
    let locker = Locker::from_arc(backend);
    holder::serve(&locker, &spec, async |token| {
        match store.write(token, CHILD_VALUE).await {
            Ok(Ok(())) => "accepted".to_owned(),
            Ok(Err(stale)) => format!("refused ({stale})"),
            Err(e) => format!("error {e}"),
        }
    })
    .await
}

/// The parent's handle on the lab's child holder.
pub(crate) type ChildHolder = HolderProcess;

/// Starts the lab's child holding `key` on `url` with a watchdog (a permit of a semaphore
/// of `permits` permits when not 0), writing to `store`, and waits (up to 30 s) until it
/// holds the lock.
pub(crate) async fn spawn_child(
    lab: &Lab,
    url: &str,
    key: &LockKey,
    ttl: Duration,
    store: &FencedStore,
    permits: u32,
) -> Result<ChildHolder, LabError> {
    let mut command = Command::new(&lab.child.program);
    command
        .args(&lab.child.args)
        .env(CHILD_VAR, url)
        .env(STORE_VAR, store.location())
        .env(RESOURCE_VAR, store.resource());
    let spec = HolderSpec {
        key: key.clone(),
        ttl,
        watchdog: true,
        permits,
    };
    HolderProcess::start(command, &spec, Duration::from_secs(30))
        .await
        .map_err(|e| LabError::new(format!("{} ({e})", lab.child.program.display())))
}

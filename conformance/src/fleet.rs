//! Mixed fleets: lockkit clients beside other clients (kazoo, redis-py, rslock, etcdctl)
//! on the same keys, each holder recording its critical sections in a shared [`Ledger`].

use std::time::Duration;

use lockkit_core::Locker;
use tokio::time::Instant;

use crate::{Ledger, Rng};

/// Far longer than any wait of a fleet needs: every hold lasts [`HOLD_AT_MOST`] at most.
pub const FLEET_WAIT: Duration = Duration::from_secs(30);

/// The longest hold of a fleet's holder.
pub const HOLD_AT_MOST: Duration = Duration::from_millis(30);

/// One lockkit task of a fleet, named `who` (`lockkit-<n>`), until `until`: picks one of
/// `keys` (the ledger names them by index), then tries it, waits for it, or starts a wait
/// and drops it after up to 40 ms (which must leave nothing held), holds what it got for up
/// to [`HOLD_AT_MOST`] and releases it. Answers its holds.
///
/// # Panics
/// When a wait of [`FLEET_WAIT`] is not granted, an operation fails, or the ledger cannot
/// be written: each a failure of the fleet's test.
pub async fn lockkit_holder(
    locker: Locker,
    keys: Vec<String>,
    ledger: std::sync::Arc<Ledger>,
    who: String,
    seed: u64,
    until: Instant,
) -> usize {
    let mut rng = Rng(seed);
    let mut holds = 0;
    while Instant::now() < until {
        let index = rng.below(keys.len() as u64) as usize;
        let key = keys[index].as_str();
        let guard = match rng.below(10) {
            0 => match locker.acquire(key).try_now().await {
                Ok(Some(guard)) => guard,
                Ok(None) => continue,
                Err(error) => panic!("{who}: a try failed: {error}"),
            },
            1 | 2 => {
                let cut = Duration::from_millis(rng.below(40));
                match tokio::time::timeout(cut, locker.acquire(key).wait(FLEET_WAIT)).await {
                    Ok(Ok(guard)) => guard,
                    Ok(Err(error)) => panic!("{who}: a wait failed: {error}"),
                    Err(_) => continue,
                }
            }
            _ => match locker.acquire(key).wait(FLEET_WAIT).await {
                Ok(guard) => guard,
                Err(error) => panic!("{who}: not granted within {FLEET_WAIT:?}: {error}"),
            },
        };
        let index = index.to_string();
        if let Err(error) = ledger.enter(&index, &who) {
            panic!("{who}: the ledger: {error}");
        }
        tokio::time::sleep(rng.duration(HOLD_AT_MOST)).await;
        if let Err(error) = ledger.exit(&index, &who) {
            panic!("{who}: the ledger: {error}");
        }
        if let Err(error) = guard.release().await {
            panic!("{who}: a release failed: {error}");
        }
        holds += 1;
    }
    holds
}

//! Which grants say their owner may return (`Grant::owner_returns`): a backend may make the
//! last release of a grant whose owner never returns cheaper (PostgreSQL row mode does not
//! wait for its commit to reach the disk), so the flag must be false only where no one can
//! ask for the key again under that owner once its guards are gone.

use lockkit_core::{Locker, MemoryBackend};

#[tokio::test]
async fn only_an_owner_made_for_one_acquisition_never_returns() {
    let locker = Locker::new(MemoryBackend::new());

    let one_use = locker.acquire("returns/one-use").await.expect("granted");
    assert!(
        !one_use.grant().owner_returns,
        "the locker's own owner for one acquisition is never used again"
    );
    let inner = one_use.reenter().await.expect("re-entered");
    assert!(
        !inner.grant().owner_returns,
        "a re-entry keeps the owner it re-enters"
    );
    inner.release().await.expect("released");
    one_use.release().await.expect("released");
    let tried = locker
        .try_acquire("returns/one-use")
        .await
        .expect("answered")
        .expect("free");
    assert!(!tried.grant().owner_returns);
    tried.release().await.expect("released");

    let owner = locker.owner();
    let owned = owner.acquire("returns/owner").await.expect("granted");
    assert!(
        owned.grant().owner_returns,
        "an Owner may take the key again after its release"
    );
    let again = owned.reenter().await.expect("re-entered");
    assert!(again.grant().owner_returns);
    again.release().await.expect("released");
    owned.release().await.expect("released");
    let tried = owner
        .try_acquire("returns/owner")
        .await
        .expect("answered")
        .expect("free");
    assert!(tried.grant().owner_returns);
    tried.release().await.expect("released");
}

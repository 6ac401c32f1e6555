//! A MariaDB restart in the middle of holds: for-update holders see lost before the server
//! is back, row leases survive, and no key is ever granted twice (history check).
//! (Its own test binary: it restarts the shared server.)

use std::{process::Command, time::Duration};

use lockkit_conformance::{History, env};
use lockkit_core::{LockKey, Locker};
use lockkit_mysql::MysqlBackend;
use uuid::Uuid;

fn restart_mariadb() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services.sh");
    let status = Command::new("bash")
        .arg(script)
        .args(["restart", "mariadb"])
        .status()
        .unwrap();
    assert!(status.success(), "services.sh restart mariadb failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn for_update_holds_are_lost_and_row_leases_survive_a_server_restart() {
    let Some(url) = env::service_url("LOCKKIT_TEST_MYSQL_URL") else {
        return;
    };
    let run = Uuid::new_v4().simple().to_string();
    let (row_key, fu_key) = (
        LockKey::new(format!("restart/{run}/row")).unwrap(),
        LockKey::new(format!("restart/{run}/fu")).unwrap(),
    );
    let row_url = format!("{url}?mode=row&table=lockkit_test_row");
    let fu_url = format!("{url}?mode=for-update&table=lockkit_test_fu");
    let row_holder = Locker::new(MysqlBackend::connect(&row_url).await.unwrap());
    let fu_holder = Locker::new(MysqlBackend::connect(&fu_url).await.unwrap());
    let history = History::new();

    let row_guard = row_holder
        .acquire(&row_key)
        .ttl(Duration::from_secs(20))
        .await
        .unwrap();
    let fu_guard = fu_holder
        .acquire(&fu_key)
        .ttl(Duration::from_secs(5))
        .await
        .unwrap();
    let row_open = history.begin("row holder", &row_guard);
    let fu_open = history.begin("for-update holder", &fu_guard);

    tokio::task::spawn_blocking(restart_mariadb).await.unwrap();

    // The for-update hold died with its connection; its holder must know.
    tokio::time::timeout(Duration::from_secs(10), fu_guard.lost())
        .await
        .expect("for-update holder never saw the loss");
    history.end(fu_open, &fu_guard);

    // A rival gets the for-update key, with a greater token.
    let fu_rival = Locker::new(MysqlBackend::connect(&fu_url).await.unwrap());
    let next = fu_rival
        .acquire(&fu_key)
        .wait(Duration::from_secs(20))
        .await
        .unwrap();
    assert!(next.token() > fu_guard.token());
    let next_open = history.begin("for-update rival", &next);

    // The row lease is still there, and renewals resume on new connections.
    let row_rival = Locker::new(MysqlBackend::connect(&row_url).await.unwrap());
    assert!(
        row_rival.try_acquire(&row_key).await.unwrap().is_none(),
        "the row lease was lost in the restart"
    );
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        row_guard.is_valid(),
        "the row holder could not renew after the restart"
    );
    assert!(row_rival.try_acquire(&row_key).await.unwrap().is_none());

    history.end(next_open, &next);
    history.end(row_open, &row_guard);
    next.release().await.unwrap();
    row_guard.release().await.unwrap();
    history.assert_linear();
}

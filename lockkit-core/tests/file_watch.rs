//! The file backend's directory watches (inotify, for wake-ups across processes) end with
//! the backends that made them: a service that waits in many directories over its life
//! does not collect the user's limited watches.
#![cfg(target_os = "linux")]

use std::{collections::BTreeSet, os::unix::fs::MetadataExt, path::PathBuf, time::Duration};

use lockkit_core::{FileBackend, Locker};

/// The inodes this process's inotify instances watch.
fn watched_inodes() -> BTreeSet<u64> {
    let mut inodes = BTreeSet::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let link = std::fs::read_link(entry.path()).unwrap_or_default();
        if !link.to_string_lossy().contains("inotify") {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            entry.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        for line in info.lines().filter(|l| l.starts_with("inotify wd:")) {
            if let Some(ino) = line
                .split_whitespace()
                .find_map(|f| f.strip_prefix("ino:"))
                .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            {
                inodes.insert(ino);
            }
        }
    }
    inodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_is_watched_while_a_backend_on_it_lives() {
    let mut dirs: Vec<(PathBuf, u64)> = Vec::new();
    let mut lockers = Vec::new();
    for i in 0..10 {
        let dir = std::env::temp_dir().join(format!("lockkit-watch-{i}-{}", uuid::Uuid::new_v4()));
        let locker = Locker::new(FileBackend::open(&dir).unwrap());
        let held = locker.try_acquire("k").await.unwrap().unwrap();
        // A wait is what watches the directory.
        assert!(
            locker
                .acquire("k")
                .wait(Duration::from_millis(5))
                .await
                .is_err()
        );
        held.release().await.unwrap();
        let ino = std::fs::metadata(&dir).unwrap().ino();
        dirs.push((dir, ino));
        lockers.push(locker);
    }
    let watched = watched_inodes();
    assert!(
        dirs.iter().all(|(_, ino)| watched.contains(ino)),
        "a directory waited in is not watched"
    );
    drop(lockers);
    // A backend's last clone may go a moment after the lockers do (a hold's keeper task,
    // an attempt cut short by the wait's deadline finishing in the background): the
    // watches must end within a few seconds, not at once.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let left = loop {
        let watched = watched_inodes();
        let left: Vec<_> = dirs
            .iter()
            .filter(|(_, ino)| watched.contains(ino))
            .collect();
        if left.is_empty() || std::time::Instant::now() > deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(left.is_empty(), "watches outlived their backends: {left:?}");
    for (dir, _) in dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
}

//! The file backend in a lock directory others can write to (the default one is under the
//! temporary directory): nothing is ever written through a symbolic link planted there,
//! and a key whose file a cleaner deleted still hands out growing tokens.
#![cfg(unix)]

use std::path::PathBuf;

use lockkit_core::{FileBackend, LockKey, Locker, spi::file_name};

fn temp_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lockkit-hostile-{name}-{}", uuid::Uuid::new_v4()))
}

/// A file of the victim's, outside the lock directory, that lockkit must never write.
fn victim(name: &str) -> (PathBuf, String) {
    let path = temp_dir(&format!("victim-{name}"));
    // Text (a lock file is read as UTF-8) and long: a shorter state would truncate it.
    let text = "export PATH=/usr/bin\n".repeat(200);
    std::fs::write(&path, &text).unwrap();
    (path, text)
}

/// Someone who can write to the lock directory (the default one is under the temporary
/// directory, which every user can write) plants a symbolic link where a key's file goes:
/// an acquisition must not follow it and write lock state into the victim's file.
#[tokio::test]
async fn a_symlink_planted_as_a_lock_file_is_never_written_through() {
    let dir = temp_dir("dir");
    let backend = FileBackend::open(&dir).unwrap();
    let (target, text) = victim("lock");
    let key = LockKey::new("nightly-report").unwrap();
    std::os::unix::fs::symlink(&target, dir.join(file_name(&key))).unwrap();
    let locker = Locker::new(backend);
    let outcome = locker.try_acquire(&key).await;
    let after = std::fs::read_to_string(&target).unwrap();
    assert_eq!(
        after.len(),
        text.len(),
        "the victim's file was rewritten through the link ({outcome:?}): {:?}",
        after.lines().next()
    );
    assert_eq!(after, text);
    assert!(
        outcome.is_err(),
        "a key whose file is a symbolic link was granted"
    );
    let _ = std::fs::remove_file(&target);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The directory's writability probe must not truncate a file through a planted link
/// either: `FileBackend::open` runs on every start of a program that uses it.
#[test]
fn opening_a_directory_never_truncates_through_a_planted_probe_link() {
    let dir = temp_dir("probe");
    std::fs::create_dir_all(&dir).unwrap();
    let (target, text) = victim("probe");
    std::os::unix::fs::symlink(&target, dir.join(".lockkit-probe")).unwrap();
    let _ = FileBackend::open(&dir);
    let after = std::fs::read_to_string(&target).unwrap();
    assert!(
        after == text,
        "the probe rewrote the victim's file through the link: {} bytes left of {}",
        after.len(),
        text.len()
    );
    let _ = std::fs::remove_file(&target);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cleaner of the temporary directory (systemd-tmpfiles, a person) deletes or empties an
/// idle key's file. The key's next holder must still get a token above every token handed
/// out before: a store fenced by them would otherwise refuse every new holder (or, while an
/// old holder still writes, take its writes for the current one's). Before, the tokens
/// started again at 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_or_emptied_lock_file_does_not_restart_its_tokens() {
    let dir = temp_dir("cleaned");
    let locker = Locker::new(FileBackend::open(&dir).unwrap());
    let key = LockKey::new("k").unwrap();
    let mut last = 0;
    for cleaning in ["deleted", "emptied"] {
        for _ in 0..3 {
            let guard = locker.try_acquire(&key).await.unwrap().unwrap();
            assert!(guard.token().get() > last);
            last = guard.token().get();
            guard.release().await.unwrap();
        }
        let path = dir.join(file_name(&key));
        match cleaning {
            "deleted" => std::fs::remove_file(&path).unwrap(),
            _ => std::fs::write(&path, "").unwrap(),
        }
        let guard = locker.try_acquire(&key).await.unwrap().unwrap();
        assert!(
            guard.token().get() > last,
            "after its file was {cleaning}, the key handed out token {} after {last}",
            guard.token().get()
        );
        last = guard.token().get();
        guard.release().await.unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lock directory every user may write, without the sticky bit (made under `umask 000`,
/// or by another user first): any user can delete a held key's file and have the key
/// granted again. Opening it warns and says how to mend it; a private one does not.
#[cfg(unix)]
#[test]
fn a_lock_directory_every_user_may_write_is_warned_of() {
    use std::os::unix::fs::PermissionsExt;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let warnings_when_opening = |mode: u32| {
        let dir = temp_dir("perms");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || FileBackend::open(&dir).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
        String::from_utf8(captured.0.lock().unwrap().clone()).unwrap()
    };
    let open_to_all = warnings_when_opening(0o777);
    assert!(
        open_to_all.contains("writable by every user"),
        "no warning for a 0777 directory: {open_to_all:?}"
    );
    for mode in [0o755, 0o775, 0o1777] {
        let text = warnings_when_opening(mode);
        assert!(
            !text.contains("writable by every user"),
            "{mode:o}: {text:?}"
        );
    }
}

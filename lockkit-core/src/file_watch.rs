//! Wake-ups across processes for the file backend: the lock directory is watched with
//! inotify, and a change to a key's file (a release, an expiry pruned, a renewal) wakes this
//! process's waiters on that key at once, instead of at their next poll.
//!
//! One inotify instance and one thread per process, whatever the number of backends and
//! runtimes (a task would die with the runtime that spawned it; instances are limited per
//! user). Only `IN_MODIFY`, `IN_DELETE` and `IN_MOVED_TO` are watched: every operation
//! opens the file for writing, so `IN_CLOSE_WRITE` would fire for attempts that changed
//! nothing, and a busy waiter would wake itself. The wake-ups are never relied on alone:
//! waiters still poll (a directory on a network file system hears no other host's changes).

use std::{
    collections::HashMap,
    path::Path,
    sync::{Arc, Mutex, Weak},
};

use tokio::sync::Notify;

/// A backend's waiters, by the name of their key's file.
pub(crate) type Wakers = Mutex<HashMap<String, Arc<Notify>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wakes every waiter of `wakers` on `name` (all of them for `None`).
fn wake(wakers: &Wakers, name: Option<&str>) {
    let wakers = lock(wakers);
    match name {
        Some(name) => {
            if let Some(notify) = wakers.get(name) {
                notify.notify_waiters();
            }
        }
        None => wakers.values().for_each(|n| n.notify_waiters()),
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::{collections::HashMap, mem::MaybeUninit, os::fd::OwnedFd, sync::OnceLock};

    use rustix::{
        fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags},
        io::Errno,
    };

    use super::{Arc, Mutex, Path, Wakers, Weak, lock, wake};

    /// The process's inotify instance and who listens on each watched directory.
    pub(super) struct Watcher {
        fd: OwnedFd,
        dirs: Mutex<HashMap<i32, Vec<Weak<Wakers>>>>,
    }

    static WATCHER: OnceLock<Option<Arc<Watcher>>> = OnceLock::new();

    fn start() -> Option<Arc<Watcher>> {
        let fd = inotify::init(CreateFlags::CLOEXEC)
            .map_err(|e| tracing::debug!(error = %e, "no inotify: file waiters poll"))
            .ok()?;
        let watcher = Arc::new(Watcher {
            fd,
            dirs: Mutex::default(),
        });
        let reading = watcher.clone();
        std::thread::Builder::new()
            .name("lockkit-file-watch".into())
            .spawn(move || reading.run())
            .map_err(|e| tracing::debug!(error = %e, "no watch thread: file waiters poll"))
            .ok()?;
        Some(watcher)
    }

    impl Watcher {
        fn run(&self) {
            let mut buffer = [MaybeUninit::<u8>::uninit(); 8192];
            let mut reader = inotify::Reader::new(&self.fd, &mut buffer);
            loop {
                let event = match reader.next() {
                    Ok(event) => event,
                    Err(Errno::INTR) => continue,
                    Err(error) => {
                        tracing::debug!(%error, "the inotify watch ended: file waiters poll");
                        return;
                    }
                };
                let overflow = event.events().contains(ReadFlags::QUEUE_OVERFLOW);
                let name = event.file_name().and_then(|n| n.to_str().ok());
                let listeners: Vec<Arc<Wakers>> = {
                    let mut dirs = lock(&self.dirs);
                    let mut found = Vec::new();
                    for (wd, list) in dirs.iter_mut() {
                        if overflow || *wd == event.wd() {
                            list.retain(|w| w.strong_count() > 0);
                            found.extend(list.iter().filter_map(Weak::upgrade));
                        }
                    }
                    found
                };
                for wakers in listeners {
                    // Events lost to an overflow may have been anyone's release.
                    wake(&wakers, if overflow { None } else { name });
                }
            }
        }
    }

    pub(super) fn watch(dir: &Path, wakers: &Arc<Wakers>) -> Option<super::Watch> {
        let watcher = WATCHER.get_or_init(start).as_ref()?;
        let flags = WatchFlags::MODIFY | WatchFlags::DELETE | WatchFlags::MOVED_TO;
        // Under the lock, so that a watch being ended (below) cannot remove the kernel's
        // watch of a directory another backend is just adding.
        let mut dirs = lock(&watcher.dirs);
        match inotify::add_watch(&watcher.fd, dir, flags) {
            Ok(wd) => {
                let list = dirs.entry(wd).or_default();
                list.retain(|w| w.strong_count() > 0);
                list.push(Arc::downgrade(wakers));
                Some(super::Watch {
                    wd,
                    wakers: Arc::downgrade(wakers),
                })
            }
            Err(error) => {
                tracing::debug!(%error, dir = %dir.display(), "cannot watch the lock directory: file waiters poll");
                None
            }
        }
    }

    /// Stops `wakers` hearing the directory `wd`; the kernel's watch ends with its last
    /// listener.
    pub(super) fn unwatch(wd: i32, wakers: &Weak<Wakers>) {
        let Some(Some(watcher)) = WATCHER.get() else {
            return;
        };
        let mut dirs = lock(&watcher.dirs);
        let Some(list) = dirs.get_mut(&wd) else {
            return;
        };
        list.retain(|w| w.strong_count() > 0 && !w.ptr_eq(wakers));
        if list.is_empty() {
            dirs.remove(&wd);
            // Fails only if the watch already ended (the directory was deleted).
            let _ = inotify::remove_watch(&watcher.fd, wd);
        }
    }
}

/// A backend's watch of its directory: ends when dropped (with the backend's last clone),
/// and the kernel's watch with the directory's last one.
#[derive(Debug)]
pub(crate) struct Watch {
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    wd: i32,
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    wakers: Weak<Wakers>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        linux::unwatch(self.wd, &self.wakers);
    }
}

/// Has changes to the files of `dir` wake the waiters in `wakers` until the returned watch
/// is dropped. `None` where the directory cannot be watched (no inotify, limits reached,
/// another OS): waiters only poll.
pub(crate) fn watch(dir: &Path, wakers: &Arc<Wakers>) -> Option<Watch> {
    #[cfg(target_os = "linux")]
    {
        linux::watch(dir, wakers)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (dir, wakers, wake as fn(&Wakers, Option<&str>));
        None
    }
}

//! Per-file data locks: order writes against truncation, hole punching and reclaim of the
//! same file, and nothing else. Reads, writes and fallocate share a file's lock; a
//! truncation, a punched hole or a trim of its data takes it alone, so a trim can never
//! destroy a write that came after it. Only that file's operations wait for it.
//!
//! Memory is bounded by use: a file's entry exists while someone holds or waits for its
//! lock, and goes with the last guard.

use kochab_proto::InodeId;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// The locks of the files in use.
#[derive(Default)]
pub struct FileLocks {
    files: Mutex<FxHashMap<InodeId, Entry>>,
}

struct Entry {
    lock: Arc<RwLock<()>>,
    /// Guards held and waits under way (a wait that is cancelled counts down too).
    users: usize,
}

/// One holder or waiter of a file's lock: counted in while it lives.
struct User<'a> {
    locks: &'a FileLocks,
    id: InodeId,
}

impl Drop for User<'_> {
    fn drop(&mut self) {
        let mut files = self.locks.files.lock();
        if let Some(e) = files.get_mut(&self.id) {
            e.users -= 1;
            if e.users == 0 {
                files.remove(&self.id);
            }
        }
    }
}

/// A held file lock, shared or exclusive; dropping it releases the lock and, if nobody
/// else holds or waits for it, the file's entry.
pub struct FileGuard<'a> {
    // Fields drop in order: the lock is released before the user counts out.
    held: Held,
    _user: User<'a>,
}

enum Held {
    Shared(#[allow(dead_code)] OwnedRwLockReadGuard<()>),
    Exclusive(#[allow(dead_code)] OwnedRwLockWriteGuard<()>),
}

impl FileLocks {
    fn enter(&self, id: InodeId) -> (Arc<RwLock<()>>, User<'_>) {
        let mut files = self.files.lock();
        let e = files.entry(id).or_insert_with(|| Entry {
            lock: Arc::default(),
            users: 0,
        });
        e.users += 1;
        (e.lock.clone(), User { locks: self, id })
    }

    /// Shares the lock of `id` (reads, writes, fallocate).
    pub async fn shared(&self, id: InodeId) -> FileGuard<'_> {
        let (lock, user) = self.enter(id);
        FileGuard {
            held: Held::Shared(lock.read_owned().await),
            _user: user,
        }
    }

    /// Takes the lock of `id` alone (truncation, hole punching, trims).
    pub async fn exclusive(&self, id: InodeId) -> FileGuard<'_> {
        let (lock, user) = self.enter(id);
        FileGuard {
            held: Held::Exclusive(lock.write_owned().await),
            _user: user,
        }
    }

    /// Files with an entry (for tests: entries must not pile up).
    pub fn len(&self) -> usize {
        self.files.lock().len()
    }

    /// True if no file has an entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl FileGuard<'_> {
    /// True if the lock is held alone.
    pub fn is_exclusive(&self) -> bool {
        matches!(self.held, Held::Exclusive(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn entries_go_when_unused_and_files_do_not_wait_for_each_other() {
        let locks = FileLocks::default();
        let a = locks.exclusive(1).await;
        assert!(a.is_exclusive());
        // Another file is not held up by file 1's exclusive lock.
        let b = locks.shared(2).await;
        let b2 = locks.shared(2).await;
        assert_eq!(locks.len(), 2);
        // A waiter on file 1 keeps its entry while the holder drops.
        let waiter = {
            let fut = locks.shared(1);
            tokio::pin!(fut);
            assert!(futures_poll_once(fut.as_mut()).await.is_none());
            drop(a);
            fut.await
        };
        assert!(!waiter.is_exclusive());
        drop((b, b2));
        assert_eq!(locks.len(), 1);
        // A wait given up (its task cancelled) leaves nothing behind either.
        {
            let fut = locks.exclusive(1);
            tokio::pin!(fut);
            assert!(futures_poll_once(fut.as_mut()).await.is_none());
        }
        drop(waiter);
        assert!(locks.is_empty());
    }

    /// Polls a future once: `Some` if it completed.
    async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
        let mut f = f;
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}

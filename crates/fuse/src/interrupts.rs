//! FUSE_INTERRUPT: the kernel's request to end a request whose caller got a signal. Only
//! waiting locks (F_SETLKW, flock without LOCK_NB) are open-ended, so only they watch for
//! interrupts; every other request ends on its own within the client's retry bounds.

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::Notify;

/// Interrupts remembered for requests not (yet) watched. The kernel sends an interrupt
/// only after the request was read from /dev/fuse, but another reader thread may handle
/// the interrupt before the request's own thread starts watching; interrupts of requests
/// that are not lock waits land here too and are forgotten oldest first.
const EARLY_INTERRUPTS_MAX: usize = 256;

/// Lock waits in progress, by FUSE request id.
#[derive(Default)]
pub(crate) struct Interrupts {
    inner: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    watched: FxHashMap<u64, Arc<Notify>>,
    early: VecDeque<u64>,
}

/// A watched request; stops watching when dropped.
pub(crate) struct Watch {
    unique: u64,
    notify: Arc<Notify>,
    state: Arc<Mutex<State>>,
}

impl Interrupts {
    /// Starts watching request `unique` for an interrupt.
    pub(crate) fn watch(&self, unique: u64) -> Watch {
        let notify = Arc::new(Notify::new());
        let mut s = self.inner.lock();
        if let Some(i) = s.early.iter().position(|&u| u == unique) {
            s.early.remove(i);
            notify.notify_one();
        }
        s.watched.insert(unique, notify.clone());
        Watch {
            unique,
            notify,
            state: self.inner.clone(),
        }
    }

    /// The kernel interrupts request `unique`.
    pub(crate) fn interrupt(&self, unique: u64) {
        let mut s = self.inner.lock();
        match s.watched.get(&unique) {
            Some(n) => n.notify_one(),
            None => {
                if s.early.len() >= EARLY_INTERRUPTS_MAX {
                    s.early.pop_front();
                }
                s.early.push_back(unique);
            }
        }
    }
}

impl Watch {
    /// Resolves once the request is interrupted (at once if it already was).
    pub(crate) async fn interrupted(&self) {
        self.notify.notified().await;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.state.lock().watched.remove(&self.unique);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn fired(w: &Watch) -> bool {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_millis(10), w.interrupted())
                .await
                .is_ok()
        })
    }

    #[test]
    fn an_interrupt_reaches_its_watcher_even_if_it_came_first() {
        let i = Interrupts::default();
        let w = i.watch(7);
        assert!(!fired(&w));
        i.interrupt(8);
        assert!(!fired(&w), "another request's interrupt");
        i.interrupt(7);
        assert!(fired(&w));
        drop(w);
        i.interrupt(9);
        assert!(fired(&i.watch(9)), "the interrupt arrived before the watch");
        assert!(!fired(&i.watch(9)), "and counts once");
    }

    #[test]
    fn early_interrupts_are_bounded() {
        let i = Interrupts::default();
        for u in 0..(EARLY_INTERRUPTS_MAX as u64 + 5) {
            i.interrupt(u);
        }
        assert_eq!(i.inner.lock().early.len(), EARLY_INTERRUPTS_MAX);
        assert!(!fired(&i.watch(0)), "the oldest was forgotten");
        assert!(fired(&i.watch(EARLY_INTERRUPTS_MAX as u64)));
    }
}

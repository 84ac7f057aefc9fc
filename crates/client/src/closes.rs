//! Closes gathered into one request per server.
//!
//! Every file a program creates or opens is closed again, and each close was a request of
//! its own (a third of the server requests of a create through the mount: ~10 us of CPU
//! per create between the mount and the server). A close that has nothing to report (no
//! locks to end, no writes held back: the mount decides) may go a little later, since
//! nobody waits for it: the kernel's RELEASE is answered at once. Such closes wait here
//! for [`GATHER`] and then go to their server as one [`Op::CloseMany`]; the server closes
//! them all or, if it no longer serves one of the files, none (the handles are then closed
//! one by one, routed as any close is).
//!
//! Closes are gathered per lane (a FUSE queue's thread and its connections, see
//! `pool::lane`), so a queue's closes are sent from its own thread. Whoever needs the
//! closes to have happened waits for [`Gathered::flushed`] (a statfs: an unlinked file
//! that was open frees its space at its last close).
//!
//! [`Op::CloseMany`]: kochab_proto::Op::CloseMany

use kochab_proto::CLOSE_MANY_HANDLES_MAX;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How long a close waits for others to go with it.
pub const GATHER: Duration = Duration::from_millis(1);

/// A handle waiting to be closed: the server it was opened on, its number, and what the
/// client knew of it.
type Waiting<H> = (Arc<str>, u64, H);

/// Closes for one server, as one `CloseMany`: its address, and each handle with what the
/// client knew of it.
pub(crate) type Group<H> = (Arc<str>, Vec<(u64, H)>);

/// Handles waiting to be closed, by lane.
pub(crate) struct Gathered<H> {
    lanes: Mutex<FxHashMap<Option<usize>, Vec<Waiting<H>>>>,
    /// Handles gathered and not yet closed (or given up on).
    pending: AtomicUsize,
    done: tokio::sync::Notify,
}

impl<H> Default for Gathered<H> {
    fn default() -> Self {
        Gathered {
            lanes: Mutex::default(),
            pending: AtomicUsize::new(0),
            done: tokio::sync::Notify::new(),
        }
    }
}

impl<H> Gathered<H> {
    /// Adds a handle to `lane`'s closes; true if it is the first there, so the caller
    /// starts the lane's send (after [`GATHER`]).
    pub fn push(&self, lane: Option<usize>, addr: Arc<str>, handle: u64, known: H) -> bool {
        self.pending.fetch_add(1, Ordering::AcqRel);
        let mut lanes = self.lanes.lock();
        let list = lanes.entry(lane).or_default();
        list.push((addr, handle, known));
        list.len() == 1
    }

    /// Takes `lane`'s closes, grouped by server, in groups of at most
    /// [`CLOSE_MANY_HANDLES_MAX`] (what one `CloseMany` may carry).
    pub fn take(&self, lane: Option<usize>) -> Vec<Group<H>> {
        let list = self.lanes.lock().remove(&lane).unwrap_or_default();
        let mut by_server: FxHashMap<Arc<str>, Vec<Vec<(u64, H)>>> = FxHashMap::default();
        for (addr, handle, known) in list {
            let groups = by_server.entry(addr).or_default();
            match groups.last_mut() {
                Some(g) if g.len() < CLOSE_MANY_HANDLES_MAX => g.push((handle, known)),
                _ => groups.push(vec![(handle, known)]),
            }
        }
        by_server
            .into_iter()
            .flat_map(|(addr, groups)| groups.into_iter().map(move |g| (addr.clone(), g)))
            .collect()
    }

    /// Records that `n` taken closes are over.
    pub fn finished(&self, n: usize) {
        if self.pending.fetch_sub(n, Ordering::AcqRel) == n {
            self.done.notify_waiters();
        }
    }

    /// Waits until every close gathered before now is over.
    pub async fn flushed(&self) {
        loop {
            let woken = self.done.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.pending.load(Ordering::Acquire) == 0 {
                return;
            }
            woken.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_close_of_a_lane_starts_its_send_and_take_groups_by_server() {
        let g: Gathered<()> = Gathered::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a:1".into(), "b:1".into());
        assert!(g.push(Some(0), a.clone(), 1, ()));
        assert!(!g.push(Some(0), b.clone(), 2, ()));
        assert!(!g.push(Some(0), a.clone(), 3, ()));
        assert!(
            g.push(Some(1), a.clone(), 4, ()),
            "another lane starts its own"
        );
        let lane0 = g.take(Some(0));
        let handles = |addr: &Arc<str>| -> Vec<u64> {
            let groups = lane0.iter().filter(|(a, _)| a == addr);
            groups.flat_map(|(_, g)| g.iter().map(|h| h.0)).collect()
        };
        assert_eq!(handles(&a), vec![1, 3]);
        assert_eq!(handles(&b), vec![2]);
        assert!(
            g.push(Some(0), a, 5, ()),
            "after a take, the next close starts a send"
        );
    }

    #[test]
    fn a_server_gets_its_closes_in_groups_a_close_many_may_carry() {
        let g: Gathered<()> = Gathered::default();
        let a: Arc<str> = "a:1".into();
        let n = CLOSE_MANY_HANDLES_MAX * 2 + 1;
        for h in 0..n as u64 {
            g.push(None, a.clone(), h, ());
        }
        let sizes: Vec<usize> = g.take(None).iter().map(|(_, g)| g.len()).collect();
        assert_eq!(sizes, [CLOSE_MANY_HANDLES_MAX, CLOSE_MANY_HANDLES_MAX, 1]);
    }

    #[tokio::test]
    async fn flushed_waits_for_every_pending_close() {
        let g: Arc<Gathered<()>> = Arc::default();
        g.flushed().await;
        g.push(None, "a:1".into(), 1, ());
        g.push(None, "a:1".into(), 2, ());
        let waiter = tokio::spawn({
            let g = g.clone();
            async move { g.flushed().await }
        });
        tokio::task::yield_now().await;
        let taken = g.take(None);
        g.finished(1);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one close is still pending");
        g.finished(taken.iter().map(|(_, g)| g.len()).sum::<usize>() - 1);
        waiter.await.unwrap();
    }
}

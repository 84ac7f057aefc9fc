//! Directory opens held back for a moment, so that a listing costs one server request.
//!
//! A directory open takes a server-side handle, so that a directory removed while open
//! lives on (nlink 0) until its last close, as on a local file system. The kernel has
//! checked the permissions already and nothing waits for the handle, so the open is
//! answered at once and sent later. A walk (`find`, `ls -R`, `rm -r`) opens, lists and
//! closes each directory within a fraction of a millisecond: held for [`HOLD`] first, such
//! an open is usually closed before it is sent, and then neither the open nor its close
//! reaches the servers (a cold `find` made three server requests per directory, two of
//! them for the handle). Opens still held after [`HOLD`] are sent.
//!
//! A removal or rename from this mount first sends every held open and waits for those in
//! flight (`Inner::dir_opens_done`), so it never overtakes an open this mount answered.
//! One from another mount within the hold can remove a directory first; its descriptor
//! then answers fstat with ESTALE, as it could within the open's round trip before.

use kochab_proto::{Credentials, InodeId};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// How long a directory open is held before it is sent.
pub const HOLD: Duration = Duration::from_millis(1);

/// An open answered to the kernel and not yet sent.
pub struct Held {
    pub id: InodeId,
    pub flags: u32,
    pub cred: Credentials,
    /// When it was answered.
    pub at: Instant,
}

#[derive(Default)]
struct State {
    /// By handle number.
    held: FxHashMap<u64, Held>,
    /// Taken to be sent and not yet answered.
    in_flight: usize,
    /// A timer task runs, which sends each held open once it was held for [`HOLD`] and
    /// ends when none is left.
    timer: bool,
}

/// The directory opens of a mount that have not reached their servers.
#[derive(Default)]
pub struct DirOpens {
    state: Mutex<State>,
    answered: tokio::sync::Notify,
}

impl DirOpens {
    /// Holds the open of `handle`; true if the caller must start the timer task (which
    /// calls [`DirOpens::take_due`] after [`HOLD`]).
    pub fn hold(&self, handle: u64, open: Held) -> bool {
        let mut s = self.state.lock();
        s.held.insert(handle, open);
        !std::mem::replace(&mut s.timer, true)
    }

    /// Every held open, to be sent now; they count as in flight until [`DirOpens::sent`].
    pub fn take(&self) -> Vec<(u64, Held)> {
        let mut s = self.state.lock();
        let taken: Vec<_> = s.held.drain().collect();
        s.in_flight += taken.len();
        taken
    }

    /// For the timer task: the opens held for [`HOLD`] at `now`, to be sent (in flight
    /// until [`DirOpens::sent`]), and when the next of the others is due; none, and the
    /// task ends, if no other is held.
    pub fn take_due(&self, now: Instant) -> (Vec<(u64, Held)>, Option<Instant>) {
        let mut s = self.state.lock();
        let due: Vec<u64> = s
            .held
            .iter()
            .filter(|(_, h)| now.saturating_duration_since(h.at) >= HOLD)
            .map(|(&handle, _)| handle)
            .collect();
        let taken: Vec<_> = due
            .into_iter()
            .filter_map(|handle| Some((handle, s.held.remove(&handle)?)))
            .collect();
        s.in_flight += taken.len();
        let next = s.held.values().map(|h| h.at + HOLD).min();
        s.timer = next.is_some();
        (taken, next)
    }

    /// `n` opens taken have been answered (or failed).
    pub fn sent(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut s = self.state.lock();
        s.in_flight -= n;
        if s.in_flight == 0 {
            self.answered.notify_waiters();
        }
    }

    /// `handle` is closed: true if its open was still held, so that nothing reached the
    /// servers and nothing is to be closed there.
    pub fn closed_while_held(&self, handle: u64) -> bool {
        self.state.lock().held.remove(&handle).is_some()
    }

    /// Waits until no open taken before now is in flight (call after sending the held
    /// ones).
    pub async fn in_flight_done(&self) {
        loop {
            let woken = self.answered.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.state.lock().in_flight == 0 {
                return;
            }
            woken.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(id: InodeId) -> Held {
        open_at(id, Instant::now())
    }

    fn open_at(id: InodeId, at: Instant) -> Held {
        Held {
            id,
            at,
            flags: 0,
            cred: Credentials {
                uid: 0,
                gid: 0,
                groups: Vec::new(),
            },
        }
    }

    #[test]
    fn an_open_closed_while_held_is_never_sent_and_the_first_hold_starts_the_timer() {
        let d = DirOpens::default();
        assert!(d.hold(1, open(10)), "the first hold starts the timer");
        assert!(!d.hold(2, open(11)), "one timer for all held");
        assert!(d.closed_while_held(1));
        assert!(!d.closed_while_held(1), "once");
        let taken = d.take();
        assert_eq!(taken.len(), 1);
        assert_eq!((taken[0].0, taken[0].1.id), (2, 11));
        assert!(
            !d.closed_while_held(2),
            "sent: its close goes to the server"
        );
        assert!(!d.hold(3, open(12)), "the timer task still runs");
    }

    #[test]
    fn the_timer_sends_only_opens_held_long_enough_and_ends_when_none_is_left() {
        let d = DirOpens::default();
        let t = Instant::now();
        assert!(d.hold(1, open_at(10, t)));
        assert!(!d.hold(2, open_at(11, t + HOLD / 2)));
        let (due, next) = d.take_due(t + HOLD);
        assert_eq!(due.iter().map(|(h, _)| *h).collect::<Vec<_>>(), vec![1]);
        assert_eq!(next, Some(t + HOLD / 2 + HOLD), "the other is due later");
        assert!(d.closed_while_held(2));
        let (due, next) = d.take_due(t + 2 * HOLD);
        assert!(
            due.is_empty() && next.is_none(),
            "nothing left: the task ends"
        );
        assert!(d.hold(3, open_at(12, t)), "so the next hold starts one");
    }

    #[tokio::test]
    async fn waiters_wait_for_the_opens_taken_until_they_are_answered() {
        let d = std::sync::Arc::new(DirOpens::default());
        d.in_flight_done().await;
        d.hold(1, open(10));
        d.hold(2, open(11));
        assert_eq!(d.take().len(), 2);
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.in_flight_done().await }
        });
        tokio::task::yield_now().await;
        d.sent(1);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one still in flight");
        d.sent(1);
        waiter.await.unwrap();
    }
}

//! The borrows of one incarnation and the operations waiting for them or running under
//! them. Operations that need the same tables share one borrow: each join is one more
//! user, and the tables go back (RETURN) when the last user of a granted borrow leaves.
//!
//! `W` is how the host wakes a waiting operation (a channel in the server, the operation
//! itself in the simulation).

use std::collections::BTreeMap;

use kochab_proto::cluster::{BorrowId, TableId};

/// New operations join a granted borrow for this long; after it, they wait for the next
/// one, so a steady stream of them cannot keep other servers' borrows of those tables
/// waiting for ever.
pub const BORROW_JOIN_MS: u64 = 200;

/// How long an operation waits for its borrow before the client is told to ask again (the
/// borrow stays asked for; granted after everyone left, it is returned at once). Well
/// under the client's retry budget, so the client's retry still has time to succeed.
pub const BORROW_WAIT_MS: u64 = 10_000;

struct Slot<W> {
    tables: Vec<TableId>,
    /// When the coordinator granted it (host clock), once it has.
    granted_ms: Option<u64>,
    users: usize,
    /// Woken when it is granted or refused.
    waiters: Vec<W>,
}

/// What an operation that needs `tables` does (see [`Borrows::join`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Join<W> {
    /// It joined a borrow granted moments ago: run now (its waiter is handed back unused).
    Run {
        /// The borrow it runs under.
        id: BorrowId,
        /// The waiter it came with.
        waiter: W,
    },
    /// It joined a borrow not granted yet: its waiter is woken by [`Borrows::granted`] or
    /// [`Borrows::failed`].
    Wait(BorrowId),
    /// No borrow to join: ask the participant for one, then call [`Borrows::asked`].
    Ask(W),
}

/// What to do once the coordinator granted a borrow (see [`Borrows::granted`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Granted<W> {
    /// Run these waiting operations under it; each calls [`Borrows::leave`] when done.
    Run(Vec<W>),
    /// Nobody uses it any more: return it now (`Participant::borrow_done`).
    Return,
}

/// This incarnation's borrows that operations wait for or run under.
pub struct Borrows<W> {
    slots: BTreeMap<BorrowId, Slot<W>>,
}

impl<W> Default for Borrows<W> {
    fn default() -> Self {
        Borrows {
            slots: BTreeMap::new(),
        }
    }
}

impl<W> Borrows<W> {
    /// No borrows.
    pub fn new() -> Self {
        Self::default()
    }

    /// An operation needs all of `tables` here at `now_ms`: it joins a borrow that covers
    /// them while that borrow is asked for or younger than [`BORROW_JOIN_MS`], else it
    /// must ask for a new one.
    pub fn join(&mut self, tables: &[TableId], now_ms: u64, waiter: W) -> Join<W> {
        let joined = self.slots.iter_mut().find(|(_, s)| {
            s.granted_ms
                .is_none_or(|g| now_ms < g.saturating_add(BORROW_JOIN_MS))
                && tables.iter().all(|t| s.tables.contains(t))
        });
        let Some((id, slot)) = joined else {
            return Join::Ask(waiter);
        };
        slot.users += 1;
        if slot.granted_ms.is_some() {
            return Join::Run { id: *id, waiter };
        }
        slot.waiters.push(waiter);
        Join::Wait(*id)
    }

    /// The participant asked for borrow `id` of `tables` for the operation of `waiter`
    /// (after [`Join::Ask`]).
    pub fn asked(&mut self, id: BorrowId, tables: &[TableId], waiter: W) {
        let slot = Slot {
            tables: tables.to_vec(),
            granted_ms: None,
            users: 1,
            waiters: vec![waiter],
        };
        // The participant numbers its borrows: an id seen twice is a bug.
        assert!(
            self.slots.insert(id, slot).is_none(),
            "borrow {id:?} asked for twice"
        );
    }

    /// One user of `id` is done (it ran, or gave up waiting). True: it was the last user
    /// of a granted borrow, so return it now. A borrow not granted yet stays until
    /// [`Borrows::granted`] returns it.
    pub fn leave(&mut self, id: BorrowId) -> bool {
        let Some(slot) = self.slots.get_mut(&id) else {
            return false;
        };
        slot.users = slot.users.saturating_sub(1);
        if slot.users == 0 && slot.granted_ms.is_some() {
            self.slots.remove(&id);
            return true;
        }
        false
    }

    /// The coordinator granted `id` at `now_ms` (its tables are all here): run its waiting
    /// operations, or return it at once if none waits any more (or it is not known).
    pub fn granted(&mut self, id: BorrowId, now_ms: u64) -> Granted<W> {
        match self.slots.get_mut(&id) {
            Some(slot) if slot.users > 0 => {
                slot.granted_ms = Some(now_ms);
                Granted::Run(std::mem::take(&mut slot.waiters))
            }
            _ => {
                self.slots.remove(&id);
                Granted::Return
            }
        }
    }

    /// The coordinator refused `id`: forget it; these waiters are told to ask again (their
    /// later [`Borrows::leave`] does nothing).
    pub fn failed(&mut self, id: BorrowId) -> Vec<W> {
        self.slots
            .remove(&id)
            .map(|s| s.waiters)
            .unwrap_or_default()
    }

    /// Every operation still waiting for a grant.
    pub fn waiters(&self) -> impl Iterator<Item = &W> {
        self.slots.values().flat_map(|s| s.waiters.iter())
    }

    /// Borrows asked for or running.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True without borrows.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::cluster::{Epoch, ServerId};

    fn id(seq: u64) -> BorrowId {
        BorrowId {
            server: ServerId(1),
            epoch: Epoch(2),
            seq,
        }
    }

    const AB: [TableId; 2] = [TableId(10), TableId(20)];

    #[test]
    fn operations_of_the_same_tables_share_one_borrow_until_it_is_granted() {
        let mut b = Borrows::new();
        assert_eq!(b.join(&AB, 0, "first"), Join::Ask("first"));
        b.asked(id(0), &AB, "first");
        assert_eq!(b.join(&AB[1..], 50, "second"), Join::Wait(id(0)));
        // A table the borrow does not cover needs a borrow of its own.
        assert_eq!(
            b.join(&[TableId(10), TableId(30)], 60, "third"),
            Join::Ask("third")
        );
        assert_eq!(b.waiters().count(), 2);
        assert_eq!(
            b.granted(id(0), 1_000),
            Granted::Run(vec!["first", "second"])
        );
        assert_eq!(b.waiters().count(), 0);
        assert!(!b.leave(id(0)), "one user is still running");
        assert!(b.leave(id(0)), "the last user returns the tables");
        assert!(b.is_empty());
        assert!(!b.leave(id(0)), "returned once only");
    }

    #[test]
    fn a_join_after_the_borrow_started_waits_for_the_next_one() {
        let mut b = Borrows::new();
        b.asked(id(0), &AB, 1);
        assert_eq!(b.granted(id(0), 1_000), Granted::Run(vec![1]));
        assert_eq!(
            b.join(&AB, 1_000 + BORROW_JOIN_MS - 1, 2),
            Join::Run {
                id: id(0),
                waiter: 2
            }
        );
        assert_eq!(b.join(&AB, 1_000 + BORROW_JOIN_MS, 3), Join::Ask(3));
        assert!(!b.leave(id(0)));
        assert!(b.leave(id(0)), "the joined user counted too");
    }

    #[test]
    fn a_borrow_nobody_waits_for_any_more_is_returned_when_granted() {
        let mut b = Borrows::new();
        b.asked(id(0), &AB, ());
        assert!(!b.leave(id(0)), "not granted: nothing to return yet");
        assert_eq!(b.len(), 1, "kept until the grant comes");
        assert_eq!(b.granted(id(0), 5), Granted::Return);
        assert!(b.is_empty());
        // A grant of a borrow this incarnation does not know is returned too.
        assert_eq!(b.granted(id(9), 5), Granted::Return);
    }

    #[test]
    fn a_refused_borrow_tells_its_waiters_and_is_forgotten() {
        let mut b = Borrows::new();
        b.asked(id(0), &AB, 1);
        assert_eq!(b.join(&AB, 1, 2), Join::Wait(id(0)));
        assert_eq!(b.failed(id(0)), vec![1, 2]);
        assert!(!b.leave(id(0)), "a refused borrow is never returned");
        assert!(b.failed(id(0)).is_empty());
        assert_eq!(b.join(&AB, 2, 3), Join::Ask(3));
    }

    #[test]
    #[should_panic(expected = "asked for twice")]
    fn one_borrow_id_is_asked_for_once() {
        let mut b = Borrows::new();
        b.asked(id(0), &AB, ());
        b.asked(id(0), &AB, ());
    }
}

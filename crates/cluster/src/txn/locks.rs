//! A participant's lock table: exclusive locks on keys, taken all at once per transaction,
//! with wait-die between transactions. An attempt may wait only for younger ones (holders
//! or waiters); where it would wait for an older one it dies instead (votes no; its
//! initiator retries with the same age). Every wait edge therefore runs from older to
//! younger, here and across servers, so the waits-for graph has no cycle: no deadlock.
//! An attempt never holds some of its keys here while waiting for others (all or none),
//! and a younger attempt may not take a free key an older one waits for (no starvation of
//! the old).

use std::collections::BTreeMap;

use super::{Age, Key, TxnId};

/// Most attempts waiting in one table; beyond it new ones die at once (bounded memory
/// under a storm of conflicting transactions).
pub const WAITERS_MAX: usize = 1_024;

/// What became of an attempt's request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquire {
    /// It holds all its keys.
    Granted,
    /// It waits for younger attempts; [`LockTable::release`] or [`LockTable::cancel`]
    /// decides it later.
    Wait,
    /// It would wait for an older attempt: it gets nothing and must abort.
    Die,
}

/// Exclusive locks on keys.
#[derive(Clone, Debug, Default)]
pub struct LockTable {
    holders: BTreeMap<Key, TxnId>,
    held: BTreeMap<TxnId, (Age, Vec<Key>)>,
    /// Oldest first.
    waiting: BTreeMap<(Age, TxnId), Vec<Key>>,
}

impl LockTable {
    /// Asks for all of `keys` at once.
    pub fn acquire(&mut self, txn: TxnId, age: Age, keys: &[Key]) -> Acquire {
        assert!(
            !self.held.contains_key(&txn) && !self.is_waiting(txn),
            "{txn:?} asked twice"
        );
        let verdict = self.judge(txn, age, keys, false);
        match verdict {
            Acquire::Granted => self.grant(txn, age, keys.to_vec()),
            Acquire::Wait if self.waiting.len() >= WAITERS_MAX => return Acquire::Die,
            Acquire::Wait => {
                self.waiting.insert((age, txn), keys.to_vec());
            }
            Acquire::Die => {}
        }
        verdict
    }

    /// Gives `txn` its keys without asking: a participant restoring the locks of the
    /// transactions it is in doubt about after a restart. `false` (and nothing taken) if
    /// another attempt holds one: the journal was not written by this protocol.
    pub fn restore(&mut self, txn: TxnId, age: Age, keys: &[Key]) -> bool {
        if self.held.contains_key(&txn) || keys.iter().any(|k| self.holders.contains_key(k)) {
            return false;
        }
        self.grant(txn, age, keys.to_vec());
        true
    }

    /// Adds `keys` to what `txn` holds, without asking: a participant taking over another
    /// server's part of an attempt it is in doubt about itself. `false` (and nothing
    /// taken) if `txn` holds nothing or another attempt holds one of them.
    pub fn extend(&mut self, txn: TxnId, keys: &[Key]) -> bool {
        if !self.held.contains_key(&txn) || keys.iter().any(|k| self.holders.contains_key(k)) {
            return false;
        }
        for k in keys {
            self.holders.insert(k.clone(), txn);
        }
        if let Some((_, held)) = self.held.get_mut(&txn) {
            held.extend(keys.iter().cloned());
        }
        true
    }

    /// Frees what `txn` holds; returns its keys and what became of the waiters that could
    /// move.
    pub fn release(&mut self, txn: TxnId) -> (Vec<Key>, Vec<(TxnId, Acquire)>) {
        let Some((_, keys)) = self.held.remove(&txn) else {
            return (Vec::new(), Vec::new());
        };
        for k in &keys {
            let h = self.holders.remove(k);
            assert_eq!(h, Some(txn), "lock table lost track of {k:?}");
        }
        (keys, self.reconsider())
    }

    /// Stops `txn` waiting; returns what became of the waiters that could move.
    pub fn cancel(&mut self, txn: TxnId) -> Vec<(TxnId, Acquire)> {
        let before = self.waiting.len();
        self.waiting.retain(|(_, t), _| *t != txn);
        if self.waiting.len() == before {
            return Vec::new();
        }
        self.reconsider()
    }

    /// Whether `txn` holds its keys.
    pub fn holds(&self, txn: TxnId) -> bool {
        self.held.contains_key(&txn)
    }

    /// Whether `txn` holds `key`.
    pub fn holds_key(&self, txn: TxnId, key: &Key) -> bool {
        self.holders.get(key) == Some(&txn)
    }

    /// Whether `key` is locked (an operation outside any transaction must wait).
    pub fn is_locked(&self, key: &Key) -> bool {
        self.holders.contains_key(key)
    }

    /// Whether `txn` waits for its keys.
    pub fn is_waiting(&self, txn: TxnId) -> bool {
        self.waiting.keys().any(|(_, t)| *t == txn)
    }

    /// Keys held, attempts waiting.
    pub fn load(&self) -> (usize, usize) {
        (self.holders.len(), self.waiting.len())
    }

    fn grant(&mut self, txn: TxnId, age: Age, keys: Vec<Key>) {
        for k in &keys {
            let prev = self.holders.insert(k.clone(), txn);
            assert!(prev.is_none(), "{k:?} granted twice");
        }
        self.held.insert(txn, (age, keys));
    }

    /// Wait-die for `txn` asking for `keys`: conflicts are holders of the keys and
    /// waiters for them (when reconsidering, `older_waiters_only`: the younger ones are
    /// reconsidered after it).
    fn judge(&self, txn: TxnId, age: Age, keys: &[Key], older_waiters_only: bool) -> Acquire {
        let mut conflict = false;
        for k in keys {
            if let Some(h) = self.holders.get(k).filter(|h| **h != txn) {
                conflict = true;
                let (hage, _) = &self.held[h];
                if *hage < age {
                    return Acquire::Die;
                }
            }
        }
        for ((wage, w), wkeys) in &self.waiting {
            if *w == txn || (older_waiters_only && *wage >= age) {
                continue;
            }
            if wkeys.iter().any(|k| keys.contains(k)) {
                conflict = true;
                if *wage < age {
                    return Acquire::Die;
                }
            }
        }
        if conflict {
            Acquire::Wait
        } else {
            Acquire::Granted
        }
    }

    /// Grants or kills waiters, oldest first, after a release or cancel.
    fn reconsider(&mut self) -> Vec<(TxnId, Acquire)> {
        let mut out = Vec::new();
        let order: Vec<(Age, TxnId)> = self.waiting.keys().copied().collect();
        for (age, txn) in order {
            let Some(keys) = self.waiting.get(&(age, txn)).cloned() else {
                continue;
            };
            match self.judge(txn, age, &keys, true) {
                Acquire::Wait => {}
                v => {
                    self.waiting.remove(&(age, txn));
                    if v == Acquire::Granted {
                        self.grant(txn, age, keys);
                    }
                    out.push((txn, v));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::cluster::ServerId;

    fn t(seq: u64) -> TxnId {
        TxnId {
            origin: ServerId(0),
            epoch: 1,
            seq,
        }
    }

    /// Attempt `seq`, started at `ms` (smaller is older).
    fn a(seq: u64, ms: u64) -> (TxnId, Age) {
        (
            t(seq),
            Age {
                start_ms: ms,
                first: t(seq),
            },
        )
    }

    fn k(i: u64) -> Key {
        Key::Inode(i)
    }

    #[test]
    fn older_waits_younger_dies() {
        let mut l = LockTable::default();
        let (old, old_age) = a(1, 10);
        let (young, young_age) = a(2, 20);
        let (mid, mid_age) = a(3, 15);
        assert_eq!(l.acquire(mid, mid_age, &[k(1), k(2)]), Acquire::Granted);
        assert_eq!(l.acquire(young, young_age, &[k(2)]), Acquire::Die);
        assert_eq!(l.acquire(old, old_age, &[k(2), k(3)]), Acquire::Wait);
        assert!(!l.is_locked(&k(3)), "a waiter holds nothing");
        let (freed, moved) = l.release(mid);
        assert_eq!(freed, vec![k(1), k(2)]);
        assert_eq!(moved, vec![(old, Acquire::Granted)]);
        assert!(l.holds_key(old, &k(3)));
    }

    #[test]
    fn a_younger_one_cannot_overtake_an_older_waiter() {
        let mut l = LockTable::default();
        let (h, hage) = a(1, 30);
        let (old, old_age) = a(2, 10);
        let (young, young_age) = a(3, 20);
        assert_eq!(l.acquire(h, hage, &[k(1)]), Acquire::Granted);
        assert_eq!(l.acquire(old, old_age, &[k(1), k(2)]), Acquire::Wait);
        // k(2) is free, but the older waiter wants it.
        assert_eq!(l.acquire(young, young_age, &[k(2)]), Acquire::Die);
        assert_eq!(l.cancel(old), vec![]);
        assert_eq!(l.load(), (1, 0));
    }

    #[test]
    fn release_kills_waiters_now_behind_an_older_holder() {
        let mut l = LockTable::default();
        let (h, hage) = a(1, 40);
        let (mid, mid_age) = a(2, 20);
        let (old, old_age) = a(3, 10);
        assert_eq!(l.acquire(h, hage, &[k(1)]), Acquire::Granted);
        assert_eq!(l.acquire(mid, mid_age, &[k(1)]), Acquire::Wait);
        assert_eq!(l.acquire(old, old_age, &[k(1)]), Acquire::Wait);
        let (_, moved) = l.release(h);
        assert_eq!(moved, vec![(old, Acquire::Granted), (mid, Acquire::Die)]);
    }

    #[test]
    fn restore_refuses_a_key_held_twice() {
        let mut l = LockTable::default();
        let (x, xage) = a(1, 1);
        let (y, yage) = a(2, 2);
        assert!(l.restore(x, xage, &[k(1)]));
        assert!(!l.restore(y, yage, &[k(1), k(2)]));
        assert!(!l.is_locked(&k(2)));
    }
}

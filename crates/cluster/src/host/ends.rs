//! Operations that ran and wait for their journal record to be durable before they end
//! (`Participant::end_op`). Until then they count as in flight on their tables, so a
//! table that is moving (DROP) or was borrowed is let go only once every record that
//! touched it is durable: the next owner replays the journal up to there.
//!
//! `T` is what the host ends with the operation (its tables in the server; the operation
//! and its borrow in the simulation).

use std::collections::BTreeMap;

/// Operations waiting for the journal, by the LSN of their record.
pub struct Ends<T> {
    by_lsn: BTreeMap<u64, Vec<T>>,
}

impl<T> Default for Ends<T> {
    fn default() -> Self {
        Ends {
            by_lsn: BTreeMap::new(),
        }
    }
}

impl<T> Ends<T> {
    /// None waiting.
    pub fn new() -> Self {
        Self::default()
    }

    /// An operation whose record is `lsn` ran while the journal is durable up to
    /// `durable`: `Some` if it ends now, else it waits for [`Ends::durable`].
    pub fn done(&mut self, lsn: u64, durable: u64, item: T) -> Option<T> {
        if lsn <= durable {
            return Some(item);
        }
        self.wait(lsn, item);
        None
    }

    /// An operation whose record is `lsn` waits for it to be durable.
    pub fn wait(&mut self, lsn: u64, item: T) {
        self.by_lsn.entry(lsn).or_default().push(item);
    }

    /// The journal is durable up to `durable`: the operations that end now, oldest first.
    pub fn durable(&mut self, durable: u64) -> Vec<T> {
        let later = match durable.checked_add(1) {
            Some(next) => self.by_lsn.split_off(&next),
            None => BTreeMap::new(),
        };
        std::mem::replace(&mut self.by_lsn, later)
            .into_values()
            .flatten()
            .collect()
    }

    /// Every operation still waiting, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.by_lsn.values().flatten()
    }

    /// True if none waits.
    pub fn is_empty(&self) -> bool {
        self.by_lsn.is_empty()
    }

    /// Forgets them all (the process crashed: nothing of it ends any more).
    pub fn clear(&mut self) {
        self.by_lsn.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operation_ends_only_once_its_record_is_durable() {
        let mut e = Ends::new();
        assert_eq!(e.done(4, 4, "a"), Some("a"), "durable already");
        assert_eq!(e.done(5, 4, "b"), None);
        assert_eq!(e.done(7, 4, "c"), None);
        e.wait(5, "d");
        assert!(e.durable(4).is_empty(), "not before its record is durable");
        assert_eq!(e.iter().count(), 3);
        assert_eq!(e.durable(6), vec!["b", "d"]);
        assert!(e.durable(6).is_empty(), "each ends once");
        assert_eq!(e.durable(u64::MAX), vec!["c"]);
        assert!(e.is_empty());
    }

    #[test]
    fn a_crash_forgets_what_waited() {
        let mut e = Ends::new();
        e.wait(1, ());
        e.clear();
        assert!(e.durable(u64::MAX).is_empty());
    }
}

//! The per-client reply cache: a retried create, unlink or rename is answered from here
//! instead of running twice. Entries are rebuilt from the journal after a crash (each
//! journal record carries the client, sequence number and outcome of its operation).
//!
//! Clients acknowledge replies with a sequence floor, so a well-behaved client's entries
//! are just its requests in flight; the caps below only bound misbehaving ones.

use kochab_proto::InodeId;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// Entries kept per client beyond its floor.
pub const PER_CLIENT_MAX: usize = 16384;
/// Clients remembered. Beyond this the least recently active client is forgotten.
pub const CLIENTS_MAX: usize = 16384;

/// The outcome of a completed non-idempotent operation: the inode it created or linked.
pub type Outcome = Option<InodeId>;

#[derive(Default)]
struct ClientEntries {
    by_seq: FxHashMap<u64, Outcome>,
    /// Sequence numbers in insertion order, for trimming.
    order: VecDeque<u64>,
    floor: u64,
    last_active: u64,
}

impl ClientEntries {
    fn trim(&mut self) {
        while let Some(&front) = self.order.front() {
            if front >= self.floor && self.order.len() <= PER_CLIENT_MAX {
                break;
            }
            self.order.pop_front();
            self.by_seq.remove(&front);
        }
    }
}

/// All clients' remembered outcomes.
#[derive(Default)]
pub struct ReplyCache {
    clients: FxHashMap<u64, ClientEntries>,
    tick: u64,
}

impl ReplyCache {
    /// The outcome of `(client, seq)` if it already ran.
    pub fn get(&self, client: u64, seq: u64) -> Option<Outcome> {
        self.clients.get(&client)?.by_seq.get(&seq).copied()
    }

    /// Forgets entries of `client` below `floor` (the client has those replies).
    pub fn acknowledge(&mut self, client: u64, floor: u64) {
        if let Some(c) = self.clients.get_mut(&client)
            && floor > c.floor
        {
            c.floor = floor;
            c.trim();
        }
    }

    /// Remembers that `(client, seq)` ran with `outcome`.
    pub fn insert(&mut self, client: u64, seq: u64, outcome: Outcome) {
        self.tick += 1;
        if !self.clients.contains_key(&client) && self.clients.len() >= CLIENTS_MAX {
            self.evict_oldest();
        }
        let c = self.clients.entry(client).or_default();
        c.last_active = self.tick;
        if seq < c.floor {
            return;
        }
        if c.by_seq.insert(seq, outcome).is_none() {
            c.order.push_back(seq);
        }
        c.trim();
    }

    fn evict_oldest(&mut self) {
        if let Some((&id, _)) = self.clients.iter().min_by_key(|(_, c)| c.last_active) {
            self.clients.remove(&id);
        }
    }

    /// Number of clients remembered.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// Number of entries over all clients.
    pub fn entries(&self) -> usize {
        self.clients.values().map(|c| c.by_seq.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_until_acknowledged_and_bounded() {
        let mut c = ReplyCache::default();
        c.insert(1, 10, Some(5));
        c.insert(1, 11, None);
        assert_eq!(c.get(1, 10), Some(Some(5)));
        assert_eq!(c.get(1, 11), Some(None));
        assert_eq!(c.get(1, 12), None);
        assert_eq!(c.get(2, 10), None);
        c.acknowledge(1, 11);
        assert_eq!(c.get(1, 10), None, "acknowledged");
        assert_eq!(c.get(1, 11), Some(None), "not yet acknowledged");
        for s in 0..PER_CLIENT_MAX as u64 + 10 {
            c.insert(1, 100 + s, None);
        }
        assert_eq!(c.get(1, 11), None, "oldest entries fall out at the cap");
        assert!(c.entries() <= PER_CLIENT_MAX);
    }
}

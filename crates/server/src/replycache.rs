//! The per-client reply cache: a retried create, unlink or rename is answered from here
//! instead of running twice. Entries are rebuilt from the journal after a crash (each
//! journal record carries the client, sequence number and outcome of its operation).
//!
//! Clients acknowledge replies with a sequence floor, so a well-behaved client's entries
//! are just its requests in flight; the caps below only bound misbehaving ones (and many
//! clients at once: the cache as a whole is bounded in bytes, oldest clients go first).

use kochab_proto::InodeId;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// Entries kept per client beyond its floor.
pub const PER_CLIENT_MAX: usize = 16384;
/// Clients remembered. Beyond this the least recently active client is forgotten.
pub const CLIENTS_MAX: usize = 16384;
/// Memory the whole cache may take, as counted by [`ENTRY_BYTES`] and [`CLIENT_BYTES`].
/// Beyond it the least recently active clients are forgotten (a retry of theirs would run
/// again: the cost of a bound). 64 MiB is a million entries: a thousand clients with a
/// thousand requests in flight each, far more than well-behaved clients keep (their
/// entries are only requests in flight), while the per-client caps alone allowed
/// 16384 x 16384 entries, many GiB.
pub const BYTES_MAX: usize = 64 << 20;
/// What one entry costs: its slot in the hash map (key, outcome, control byte, spare
/// capacity) and in the order queue.
pub const ENTRY_BYTES: usize = 64;
/// What one client costs besides its entries (its map slot and the empty structures).
pub const CLIENT_BYTES: usize = 192;
/// When over [`BYTES_MAX`], clients are forgotten until the cache is this fraction of it
/// (in percent), so that one pass over the clients pays for many inserts.
const EVICT_TO_PERCENT: usize = 90;

/// The outcome of a completed non-idempotent operation: the inode it created or linked.
pub type Outcome = Option<InodeId>;

/// Reply-cache entries a table's manifest carries at most: handed over with a released
/// table, or recovered by the server that took a failed one's over (a well-behaved
/// client's are only its requests in flight).
pub(crate) const HANDED_OVER_MAX: usize = 4096;

/// Reply-cache entries handed from a server that releases a table to its next owner (in
/// the table's manifest).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HandedOver {
    /// (client, seq, outcome).
    pub entries: Vec<(u64, u64, Outcome)>,
    /// (client, floor): what the client had acknowledged.
    pub floors: Vec<(u64, u64)>,
}

impl HandedOver {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.floors.is_empty()
    }
}

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
pub struct ReplyCache {
    clients: FxHashMap<u64, ClientEntries>,
    tick: u64,
    /// Entries over all clients.
    entries: usize,
    bytes_max: usize,
}

impl Default for ReplyCache {
    fn default() -> ReplyCache {
        ReplyCache::with_bytes_max(BYTES_MAX)
    }
}

impl ReplyCache {
    /// A cache bounded to `bytes_max` (tests use small ones).
    pub fn with_bytes_max(bytes_max: usize) -> ReplyCache {
        ReplyCache {
            clients: FxHashMap::default(),
            tick: 0,
            entries: 0,
            bytes_max,
        }
    }

    /// Memory the cache takes, as it counts it.
    pub fn bytes(&self) -> usize {
        self.entries * ENTRY_BYTES + self.clients.len() * CLIENT_BYTES
    }

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
            let before = c.by_seq.len();
            c.trim();
            self.entries -= before - c.by_seq.len();
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
        let before = c.by_seq.len();
        if c.by_seq.insert(seq, outcome).is_none() {
            c.order.push_back(seq);
        }
        c.trim();
        self.entries = self.entries + c.by_seq.len() - before;
        if self.bytes() > self.bytes_max {
            self.evict_to(self.bytes_max / 100 * EVICT_TO_PERCENT, client);
        }
    }

    /// Takes in the entries of `other` (rebuilt from the journal of tables that just joined
    /// this server), so that a retry of an operation on them is still answered once.
    pub fn merge_from(&mut self, other: ReplyCache) {
        for (client, c) in other.clients {
            for seq in c.order {
                if let Some(&outcome) = c.by_seq.get(&seq) {
                    self.insert(client, seq, outcome);
                }
            }
            self.acknowledge(client, c.floor);
        }
    }

    fn evict_oldest(&mut self) {
        if let Some((&id, _)) = self.clients.iter().min_by_key(|(_, c)| c.last_active) {
            self.forget(id);
        }
    }

    /// Forgets the least recently active clients (never `keep`, the one being served)
    /// until the cache takes at most `target` bytes.
    fn evict_to(&mut self, target: usize, keep: u64) {
        let mut by_age: Vec<(u64, u64)> = self
            .clients
            .iter()
            .filter(|(id, _)| **id != keep)
            .map(|(&id, c)| (c.last_active, id))
            .collect();
        by_age.sort_unstable();
        for (_, id) in by_age {
            if self.bytes() <= target {
                break;
            }
            self.forget(id);
        }
    }

    fn forget(&mut self, client: u64) {
        if let Some(c) = self.clients.remove(&client) {
            self.entries -= c.by_seq.len();
        }
    }

    /// The outcomes a server hands over with a table it releases, so that a retry of an
    /// operation that ran here and then reaches the table's next owner is answered once
    /// there too: every remembered entry (a well-behaved client's are only its requests in
    /// flight), the most recently active clients' first, at most `max` of them, and each
    /// client's floor.
    pub fn export(&self, max: usize) -> HandedOver {
        let mut clients: Vec<(&u64, &ClientEntries)> = self.clients.iter().collect();
        clients.sort_unstable_by_key(|(_, c)| std::cmp::Reverse(c.last_active));
        let mut out = HandedOver::default();
        for (&client, c) in clients {
            if out.entries.len() >= max {
                break;
            }
            out.floors.push((client, c.floor));
            for &seq in c.order.iter().rev().take(max - out.entries.len()) {
                if let Some(&outcome) = c.by_seq.get(&seq) {
                    out.entries.push((client, seq, outcome));
                }
            }
        }
        out
    }

    /// Takes in what the server that released a table handed over with it.
    pub fn import(&mut self, h: &HandedOver) {
        for &(client, seq, outcome) in &h.entries {
            self.insert(client, seq, outcome);
        }
        for &(client, floor) in &h.floors {
            self.acknowledge(client, floor);
        }
    }

    /// Number of clients remembered.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// Number of entries over all clients.
    pub fn entries(&self) -> usize {
        self.entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handed_over_entries_answer_at_the_next_owner_and_keep_floors() {
        let mut a = ReplyCache::default();
        a.insert(1, 10, Some(5));
        a.insert(1, 11, None);
        a.acknowledge(1, 11);
        a.insert(2, 7, Some(9));
        let h = a.export(100);
        let mut b = ReplyCache::default();
        b.import(&h);
        assert_eq!(b.get(1, 11), Some(None));
        assert_eq!(b.get(1, 10), None, "below the floor");
        assert_eq!(b.get(2, 7), Some(Some(9)));
        b.insert(1, 10, Some(5));
        assert_eq!(b.get(1, 10), None, "the floor came along");
        // Bounded: the most recently active client first.
        let h = a.export(1);
        assert_eq!(h.entries, vec![(2, 7, Some(9))]);
    }

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
        assert_eq!(
            c.entries(),
            c.clients.values().map(|e| e.by_seq.len()).sum::<usize>()
        );
    }

    #[test]
    fn the_whole_cache_is_bounded_in_bytes_and_forgets_the_oldest_clients() {
        // Many clients each at their own cap: the old cache kept every one of them
        // (16384 clients x 16384 entries), so memory grew with the number of clients.
        let mut c = ReplyCache::default();
        let clients = BYTES_MAX / (PER_CLIENT_MAX * ENTRY_BYTES) * 2;
        for client in 0..clients as u64 {
            for s in 0..PER_CLIENT_MAX as u64 {
                c.insert(client, 1 + s, Some(s));
            }
        }
        let counted = c.entries() * ENTRY_BYTES + c.clients() * CLIENT_BYTES;
        assert!(counted <= BYTES_MAX, "{counted} bytes");
        assert_eq!(c.bytes(), counted);
        assert_eq!(
            c.entries(),
            c.clients.values().map(|e| e.by_seq.len()).sum::<usize>()
        );
        let newest = clients as u64 - 1;
        assert_eq!(c.get(newest, 7), Some(Some(6)), "the active client is kept");
        assert_eq!(c.get(0, 7), None, "the oldest client was forgotten");
    }
}

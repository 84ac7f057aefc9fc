//! What the core hands the shell to carry out before its lock is let go: journal records,
//! numbered by the core, and callback frames (see `step`).

/// Frames a connection's writer sends ahead of its replies (callbacks).
pub type CallbackTx = tokio::sync::mpsc::UnboundedSender<Vec<u8>>;

/// Journal records and callbacks a step produced, carried out by the shell before the core
/// lock is let go.
#[derive(Default)]
pub struct Outbox {
    /// The LSN of the first record here (the rest follow it one by one).
    pub(crate) first_lsn: u64,
    /// Record payloads back to back; `ends[i]` is where record `first_lsn + i` ends.
    pub(crate) bytes: Vec<u8>,
    pub(crate) ends: Vec<usize>,
    /// Frames for connections' writers: callbacks.
    pub(crate) callbacks: Vec<(CallbackTx, Vec<u8>)>,
    /// Start a journal flush once the lock is let go (a reply waits for it), rather than
    /// within the journal's lazy wait.
    pub(crate) flush: bool,
    /// Cleanup is queued: wake the task that works through it.
    pub(crate) wake_cleanup: bool,
    /// Slice objects freed by a record (lsn, inode, generation, objects): deleted once it
    /// is durable.
    pub(crate) frees: Vec<(u64, u64, u64, Vec<u64>)>,
    /// Chunks with too many refs (inode, generation, chunk): compacted later.
    pub(crate) compact: Vec<(u64, u64, u64)>,
}

impl Outbox {
    /// True if there is nothing to carry out.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
            && self.callbacks.is_empty()
            && !self.flush
            && !self.wake_cleanup
            && self.frees.is_empty()
            && self.compact.is_empty()
    }

    /// The records, in LSN order: (lsn, payload).
    pub fn records(&self) -> impl Iterator<Item = (u64, &[u8])> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(self.ends.iter().copied())
            .enumerate()
            .map(|(i, (a, b))| (self.first_lsn + i as u64, &self.bytes[a..b]))
    }
}

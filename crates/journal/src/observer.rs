//! What the journal's writer reports, for metrics: used by the writer and by the uploads of
//! a journal as objects.

/// Observations of the flusher, for metrics.
pub trait JournalObserver: Send + Sync {
    /// One group commit (in segments: one durable write; as objects: one object, reported
    /// when it is acknowledged): records and bytes written, how long the durable write or
    /// the PUT took, and how long its first record had waited for it.
    fn on_commit(&self, records: u64, bytes: u64, sync_seconds: f64, waited_seconds: f64);
}

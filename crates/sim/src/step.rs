//! What one step of a simulated client needs of the world ([`Ctx`]) and what a run
//! counts ([`SimStats`]): below the clients and the world, which both use them.

use kochab_cluster::sim::Rng;

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct SimStats {
    pub ops: u64,
    pub flushes: u64,
    pub checkpoints: u64,
    /// Journals of earlier processes that checkpoints deleted (no table needed them).
    pub journals_deleted: u64,
    /// Crashes of the process (what it wrote stays) and of the machine (only what was
    /// synced stays).
    pub kills: u64,
    pub power_losses: u64,
    /// Pauses after which a successor took over while the old process still ran.
    pub fences: u64,
    pub replays: u64,
    pub dropped_replies: u64,
    /// Creates, writes, reads and fsyncs of file data.
    pub data_ops: u64,
    /// Handles data clients reopened (a reclaim) after their server went.
    pub reopens: u64,
    /// Callbacks a lease holder answered.
    pub callbacks: u64,
    /// Pauses of everything (the clock jumped, up to past a lease).
    pub pauses: u64,
    /// Times the holder's cache ran out with its lease (on its own clock).
    pub leases_run_out: u64,
    /// Writes acknowledged only once a stalled holder's callback ran out (or it answered
    /// late).
    pub late_acks: u64,
    /// Times the holder went into default (a callback missed, or answered too slowly).
    pub defaults: u64,
}

/// What one step needs of the world.
pub struct Ctx<'a> {
    pub rng: &'a mut Rng,
    pub rt: &'a tokio::runtime::Runtime,
    pub stats: &'a mut SimStats,
    /// The seed, when steps are traced.
    pub trace: Option<u64>,
}

impl Ctx<'_> {
    pub(crate) fn trace(&self, what: impl FnOnce() -> String) {
        if let Some(seed) = self.trace {
            eprintln!("[{seed}] {}", what());
        }
    }
}

//! Start-up: load every table's checkpoint, replay the journal after the oldest replay
//! point (each record only into tables whose checkpoint does not hold it yet), rebuild the
//! reply cache, and create the root of a new cluster.

use crate::checkpoint::{Manifest, load_table, read_manifest};
use crate::core::JournalEntry;
use crate::datadir::DataDir;
use crate::replycache::ReplyCache;
use kochab_journal::RecoveryReport;
use kochab_meta::Engine;
use std::io;
use std::time::{Duration, Instant};

/// The state rebuilt at start-up.
pub struct Recovered {
    pub engine: Engine,
    pub replies: ReplyCache,
    pub manifests: Vec<Manifest>,
    pub journal: RecoveryReport,
    pub boxes_loaded: u64,
    pub load_time: Duration,
    pub replay_time: Duration,
}

/// Rebuilds the in-memory state of the data directory's server.
pub fn recover(dir: &DataDir) -> io::Result<Recovered> {
    let mut engine =
        Engine::new(dir.meta.engine.clone(), &dir.meta.tables).map_err(io::Error::other)?;
    let store = dir.store.as_ref();
    let started = Instant::now();
    let mut manifests = Vec::new();
    for t in engine.tables() {
        manifests.push(read_manifest(store, t.lo, t.hi)?);
    }
    // Tables load independently: spread them over the cores.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8);
    let mut boxes_loaded = 0;
    std::thread::scope(|s| -> io::Result<()> {
        let mut work: Vec<Vec<(&mut kochab_meta::Table, &Manifest)>> =
            (0..threads).map(|_| Vec::new()).collect();
        let mut load: Vec<u64> = vec![0; threads];
        let mut pairs: Vec<_> = engine
            .tables_mut()
            .iter_mut()
            .zip(manifests.iter())
            .collect();
        // Biggest first onto the least loaded thread.
        pairs
            .sort_by_key(|(_, m)| std::cmp::Reverse(m.images.iter().map(|i| i.bytes).sum::<u64>()));
        for (t, m) in pairs {
            let k = (0..threads).min_by_key(|&k| load[k]).unwrap_or(0);
            load[k] += m.images.iter().map(|i| i.bytes).sum::<u64>();
            work[k].push((t, m));
        }
        let handles: Vec<_> = work
            .into_iter()
            .map(|items| {
                s.spawn(move || -> io::Result<u64> {
                    let mut n = 0;
                    for (t, m) in items {
                        n += load_table(store, t, m)?;
                    }
                    Ok(n)
                })
            })
            .collect();
        for h in handles {
            boxes_loaded += h
                .join()
                .map_err(|_| io::Error::other("checkpoint loader panicked"))??;
        }
        Ok(())
    })?;
    let load_time = started.elapsed();

    let started = Instant::now();
    let replay_after = manifests.iter().map(|m| m.replay_from).min().unwrap_or(0);
    let mut replies = ReplyCache::default();
    let journal = kochab_journal::recover(store, replay_after, |lsn, payload| {
        let entry: JournalEntry =
            postcard::from_bytes(payload).map_err(|e| format!("undecodable entry: {e}"))?;
        engine.replay(lsn, &entry.muts)?;
        if entry.seq_floor != 0 {
            replies.acknowledge(entry.client, entry.seq_floor);
        }
        if entry.seq != 0 {
            replies.insert(entry.client, entry.seq, entry.outcome);
        }
        Ok(())
    })
    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    engine.recompute_counters();
    let replay_time = started.elapsed();
    if let Some(cut) = &journal.cut {
        tracing::warn!(
            "recovery cut a torn journal tail: {} bytes at offset {} of {} ({})",
            cut.bytes,
            cut.offset,
            cut.segment,
            cut.reason
        );
    }
    Ok(Recovered {
        engine,
        replies,
        manifests,
        journal,
        boxes_loaded,
        load_time,
        replay_time,
    })
}

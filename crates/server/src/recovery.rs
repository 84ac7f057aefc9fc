//! Start-up: load every table's checkpoint, replay the journal after the oldest replay
//! point (each record only into tables whose checkpoint does not hold it yet), rebuild the
//! reply cache, and create the root of a new cluster. Also the offline check and the
//! explicit repair (`kochab fsck --data DIR [--repair --accept-loss]`) of a stopped
//! server's directory whose journal is damaged.

use crate::checkpoint::{Manifest, load_table, put_manifest, read_manifest};
use crate::core::JournalEntry;
use crate::datadir::{DataDir, DataDirLock};
use crate::replycache::ReplyCache;
use kochab_journal::{RecoveryError, RecoveryReport};
use kochab_meta::Engine;
use std::io;
use std::path::Path;
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
    let rehashed = engine
        .rehash_legacy_dentries()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    if rehashed > 0 {
        tracing::info!(
            "rehashed {rehashed} directory entries of format-1 checkpoints (63-bit cookies); \
             the next checkpoint rewrites their tables in full"
        );
    }
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
    .map_err(|e| {
        let hint = match e {
            RecoveryError::Damaged(_) => format!(
                "; nothing was changed. To start anyway, dropping the damaged part and \
                 everything after it (the command lists exactly what goes): \
                 kochab fsck --data {} --repair --accept-loss",
                dir.path.display()
            ),
            _ => String::new(),
        };
        io::Error::new(io::ErrorKind::InvalidData, format!("{e}{hint}"))
    })?;
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

/// What the offline check found (and, when repairing, did), as lines for a person.
pub struct OfflineReport {
    pub lines: Vec<String>,
    /// The directory would not start as it is (before a repair) / does not start (after).
    pub refuses_to_start: bool,
}

/// The checkpoints' replay points of every table in `dir`.
fn manifests(dir: &DataDir) -> io::Result<Vec<Manifest>> {
    dir.meta
        .tables
        .iter()
        .map(|&(lo, hi)| read_manifest(dir.store.as_ref(), lo, hi))
        .collect()
}

/// Reads a stopped server's journal and checkpoints without changing anything: where the
/// journal is damaged, if it is, and whether a start would refuse.
pub fn check_offline(path: &Path) -> io::Result<OfflineReport> {
    let _lock = DataDirLock::acquire(path)?;
    let dir = DataDir::open_existing(path)?;
    let ins = kochab_journal::inspect(dir.store.as_ref()).map_err(io::Error::other)?;
    let mut lines = Vec::new();
    for seg in &ins.segments {
        lines.push(describe_segment("segment", seg));
    }
    let mut refuses = false;
    match &ins.damage {
        None => lines.push(format!(
            "journal: one valid chain up to LSN {}",
            ins.chain_end
        )),
        Some(d) if d.torn_tail => lines.push(format!(
            "journal: valid up to LSN {}, then a torn tail that a start cuts by itself: {d}",
            ins.chain_end
        )),
        Some(d) => {
            refuses = true;
            lines.push(format!(
                "journal DAMAGED: {d}; valid up to LSN {}. A start refuses; \
                 `kochab fsck --data {} --repair --accept-loss` drops the rest",
                ins.chain_end,
                path.display()
            ));
        }
    }
    let replay_after = manifests(&dir)?
        .iter()
        .map(|m| m.replay_from)
        .min()
        .unwrap_or(0);
    let first = ins.segments.iter().find_map(|s| s.lsns.map(|l| l.0));
    if let Some(first) = first
        && first > replay_after + 1
    {
        refuses = true;
        lines.push(format!(
            "checkpoints need journal records from LSN {}, the oldest is {first}",
            replay_after + 1
        ));
    }
    if ins.chain_end < replay_after && first.is_some() {
        refuses = true;
        lines.push(format!(
            "checkpoints need the journal up to LSN {replay_after}, it ends at {}",
            ins.chain_end
        ));
    }
    Ok(OfflineReport {
        lines,
        refuses_to_start: refuses,
    })
}

fn describe_segment(what: &str, s: &kochab_journal::SegmentSummary) -> String {
    match s.lsns {
        Some((a, b)) => format!(
            "{what} {} ({} bytes): {} records, LSN {a}..={b}",
            s.name, s.bytes, s.records
        ),
        None => format!("{what} {} ({} bytes): no valid records", s.name, s.bytes),
    }
}

/// Makes a stopped server's directory start again after journal damage, accepting the
/// loss: the journal is cut at the last valid record before the damage (the rest of that
/// segment and every later segment are dropped, see `kochab_journal::repair_accept_loss`),
/// and tables whose checkpoints point past the new end replay from it, so that records
/// written after the repair are never skipped. Every drop is listed. The namespace may
/// have lost operations that spanned tables; the started server's `kochab fsck` says.
pub fn repair_accept_loss(path: &Path) -> io::Result<OfflineReport> {
    let lock = DataDirLock::acquire(path)?;
    let dir = DataDir::open_existing(path)?;
    let store = dir.store.as_ref();
    let repair = kochab_journal::repair_accept_loss(store).map_err(io::Error::other)?;
    let mut lines = Vec::new();
    match &repair.damage {
        None => lines.push("journal: no damage found; nothing dropped".to_string()),
        Some(d) => {
            lines.push(format!("journal damage: {d}"));
            lines.push(format!(
                "kept: every journal record up to LSN {}",
                repair.kept_through
            ));
        }
    }
    if let Some(c) = &repair.cut {
        lines.push(format!(
            "dropped: bytes {}..{} of {} (whatever followed LSN {} there)",
            c.offset,
            c.offset + c.bytes,
            c.segment,
            repair.kept_through
        ));
    }
    for seg in &repair.deleted {
        lines.push(describe_segment("dropped: segment", seg));
    }
    // The first LSN the journal still holds, if any: tables must not need older ones.
    let first_kept = kochab_journal::inspect(store)
        .map_err(io::Error::other)?
        .segments
        .iter()
        .find_map(|s| s.lsns.map(|l| l.0));
    for mut m in manifests(&dir)? {
        let old = m.replay_from;
        if old > repair.kept_through {
            m.replay_from = repair.kept_through;
            lines.push(format!(
                "table {:016x}: its checkpoint reflects records up to LSN {old}; it now \
                 replays from LSN {}, so records written from now on are never skipped",
                m.lo, repair.kept_through
            ));
        } else if let Some(first) = first_kept
            && old + 1 < first
        {
            m.replay_from = first - 1;
            lines.push(format!(
                "table {:016x}: records {}..={} it needs are gone from the journal; \
                 dropped: it replays from LSN {first}",
                m.lo,
                old + 1,
                first - 1
            ));
        } else {
            continue;
        }
        put_manifest(store, &m)?;
    }
    // Proof that it starts: the recovery a start would run.
    drop(dir);
    let dir = DataDir::open_existing(path)?;
    let refuses = match recover(&dir) {
        Ok(r) => {
            lines.push(format!(
                "the directory now recovers: {} inodes, journal ends at LSN {}; \
                 start it and run `kochab fsck` to check the namespace",
                r.engine.counts().0,
                r.journal.last_lsn
            ));
            false
        }
        Err(e) => {
            lines.push(format!("the directory still does not recover: {e}"));
            true
        }
    };
    drop(lock);
    Ok(OfflineReport {
        lines,
        refuses_to_start: refuses,
    })
}

//! Start-up and table loading: load each table's checkpoint, seal every journal its
//! manifest names (earlier incarnations: a restart takes over from its predecessor) and
//! replay from each the records in the table's range of LSNs, rebuild the reply cache, then
//! claim each table (the next version of its manifest names this incarnation as owner and
//! its journal as the one to replay from) before anything is served. Also the offline
//! check and the explicit repair (`kochab fsck --data DIR [--repair --accept-loss]`) of a
//! stopped server's directory whose journal is damaged.

use crate::core::JournalEntry;
use crate::datadir::{ClusterMeta, DataDir, DataDirLock};
use crate::manifest::{JournalPos, Manifest, Owner, load_table, manifests_covering, swap_manifest};
use crate::replycache::ReplyCache;
use kochab_journal::{JournalId, RecoveryError, RecoveryReport};
use kochab_meta::{Engine, EngineConfig};
use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

/// The state rebuilt at start-up.
pub struct Recovered {
    pub engine: Engine,
    pub replies: ReplyCache,
    /// The claimed manifests of the loaded tables.
    pub manifests: Vec<Manifest>,
    /// What the journals' replay found, summed over them (`cut`: the last tail cut).
    pub journal: RecoveryReport,
    /// The first LSN of this incarnation's journal (after every LSN this server used).
    pub next_lsn: u64,
    pub boxes_loaded: u64,
    /// Tables built from a copy this server kept since it released them (plus deltas).
    pub from_kept: Vec<u64>,
    /// Splits the store showed inside the ranges asked for (`(lower, upper)` table ids,
    /// lowest first): both halves were loaded.
    pub splits: Vec<(u64, u64)>,
    pub load_time: Duration,
    pub replay_time: Duration,
}

/// Rebuilds the in-memory state of the data directory's server (every table of the
/// cluster), as incarnation `me`.
pub fn recover(dir: &DataDir, me: JournalId) -> io::Result<Recovered> {
    recover_tables(
        dir.store.as_ref(),
        dir.meta.engine.clone(),
        &dir.meta.tables,
        me,
        None,
        Some(&dir.path),
        Vec::new(),
    )
}

/// Loads the tables `ranges` from their checkpoints and journals and claims them for `me`,
/// whose journal will start at the returned `next_lsn` (exactly `running_next_lsn` if
/// given: a running server adding a table goes on with its own journal, and only its
/// records after that LSN can touch the table). `data_path` is for the repair hint in
/// errors. `kept`: copies of released tables this server still holds; one whose manifest
/// shows nothing but deltas since is used instead of reading all its images.
pub fn recover_tables(
    store: &dyn kochab_store::ObjectStore,
    config: EngineConfig,
    ranges: &[(u64, u64)],
    me: JournalId,
    running_next_lsn: Option<u64>,
    data_path: Option<&Path>,
    kept: Vec<crate::released::Released>,
) -> io::Result<Recovered> {
    let started = Instant::now();
    let mut manifests = BTreeMap::new();
    let mut splits = Vec::new();
    for &(lo, hi) in ranges {
        let pieces = manifests_covering(store, lo, Some(hi))?;
        splits.extend(pieces.windows(2).map(|w| (w[0].lo, w[1].lo)));
        for m in pieces {
            if m.journals.iter().any(|p| p.id() == me) {
                return Err(io::Error::other(format!(
                    "table {:016x} already names {me}: two incarnations with one epoch",
                    m.lo
                )));
            }
            manifests.insert(m.lo, m);
        }
    }
    let pieces: Vec<(u64, u64)> = manifests.values().map(|m| (m.lo, m.hi)).collect();
    let mut engine = Engine::new(config, &pieces).map_err(io::Error::other)?;
    // What each table still needs read: all its images, or only the deltas a kept copy
    // lacks (then the copy takes the empty table's place).
    let mut to_load = manifests.clone();
    let mut from_kept = Vec::new();
    for k in kept {
        let Some(m) = manifests.get(&k.table.lo) else {
            continue;
        };
        let same_range = (k.table.lo, k.table.hi) == (m.lo, m.hi);
        let Some(rest) = k
            .missing(&m.images)
            .filter(|_| same_range && m.journals.is_empty())
        else {
            continue;
        };
        let rest = rest.to_vec();
        if engine.remove_table(m.lo).is_some() {
            engine.insert_table(k.table).map_err(io::Error::other)?;
            if let Some(l) = to_load.get_mut(&m.lo) {
                l.images = rest;
            }
            from_kept.push(m.lo);
        }
    }
    let boxes_loaded = load_images(store, &mut engine, &to_load)?;
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
    let mut replies = ReplyCache::default();
    // Entries a manifest carries (handed over with a released table, or recovered by the
    // running server that took it over) until its owner's next checkpoint saves them in
    // a snapshot of its own: the journals they came from may be named by no table now.
    for m in manifests.values() {
        replies.import(&m.replies);
    }
    let mut total = RecoveryReport::default();
    let mut ends: BTreeMap<JournalId, u64> = BTreeMap::new();
    for j in journal_order(manifests.values()) {
        if j == me {
            return Err(io::Error::other(format!(
                "a table to load names {me}, the journal of the loading server itself"
            )));
        }
        // Nothing the old incarnation acknowledges after this can be missing from our read.
        kochab_journal::seal(store, j)?;
        let report = replay_journal(store, &mut engine, &manifests, j, &mut replies)
            .map_err(|e| explain(e, data_path.map(|p| repair_command(store, p)).as_deref()))?;
        total.replayed += report.replayed;
        total.skipped += report.skipped;
        total.segments += report.segments;
        if report.cut.is_some() {
            total.cut = report.cut.clone();
        }
        if let Some(cut) = &report.cut {
            tracing::warn!(
                "recovery cut a torn journal tail: {} bytes at offset {} of {} ({})",
                cut.bytes,
                cut.offset,
                cut.segment,
                cut.reason
            );
        }
        ends.insert(j, report.last_lsn);
    }
    engine.fill_region_next();
    let replay_time = started.elapsed();

    // This server's LSNs only grow across its incarnations (status and logs stay readable).
    let used = ends
        .iter()
        .filter(|(j, _)| j.server == me.server)
        .map(|(_, &l)| l)
        .chain(
            manifests
                .values()
                .flat_map(|m| m.journals.iter())
                .filter(|p| p.server == me.server)
                .map(|p| p.until.unwrap_or(p.after)),
        )
        .max()
        .unwrap_or(0);
    let next_lsn = running_next_lsn.unwrap_or(used + 1);
    total.last_lsn = next_lsn - 1;
    if running_next_lsn.is_none() {
        // The reply cache as recovered becomes this incarnation's snapshot before any claim
        // lets the old journals (and their snapshots) go: a client may still retry or
        // replay an operation whose entry only they held.
        crate::manifest::write_replies(store, me, next_lsn - 1, replies.export(usize::MAX))?;
    }
    if running_next_lsn.is_some() {
        // A running server takes the tables over and keeps these entries in memory only
        // until its next checkpoint round; the claim below stops naming journals with
        // nothing left to replay, whose snapshots held them. So each manifest carries them
        // (as a release hands entries over) until then: a crash of this server first must
        // not lose a reply a client may still ask for again (the operation would run twice,
        // or a create answer EEXIST to its own retry).
        let carried = replies.export(crate::replycache::HANDED_OVER_MAX);
        for m in manifests.values_mut() {
            m.replies = carried.clone();
        }
    }
    let mut claimed = Vec::new();
    // Highest first: the upper half of a split is written before the claim of its lower
    // half drops the copy of its manifest (`Manifest::split`).
    for (lo, m) in manifests.into_iter().rev() {
        let m = claim(store, m, me, next_lsn - 1, &ends)?;
        if let Some(i) = engine.table_index(lo) {
            let t = &mut engine.tables_mut()[i];
            t.replay_from = next_lsn - 1;
            t.replay_until = u64::MAX;
        }
        claimed.push(m);
    }
    Ok(Recovered {
        engine,
        replies,
        manifests: claimed,
        journal: total,
        next_lsn,
        boxes_loaded,
        from_kept,
        splits,
        load_time,
        replay_time,
    })
}

/// Loads every table's images, spread over the cores (tables load independently).
fn load_images(
    store: &dyn kochab_store::ObjectStore,
    engine: &mut Engine,
    manifests: &BTreeMap<u64, Manifest>,
) -> io::Result<u64> {
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
            .filter_map(|t| {
                let m = manifests.get(&t.lo)?;
                Some((t, m))
            })
            .collect();
        // Biggest first onto the least loaded thread.
        pairs.sort_by_key(|(_, m)| std::cmp::Reverse(m.image_bytes()));
        for (t, m) in pairs {
            let k = (0..threads).min_by_key(|&k| load[k]).unwrap_or(0);
            load[k] += m.image_bytes();
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
    Ok(boxes_loaded)
}

/// The journals the manifests name, in an order that keeps each table's own order (each
/// step takes a journal that no table lists after another journal still to come).
fn journal_order<'a>(manifests: impl Iterator<Item = &'a Manifest> + Clone) -> Vec<JournalId> {
    let mut left: Vec<Vec<JournalId>> = manifests
        .map(|m| m.journals.iter().map(|p| p.id()).collect())
        .collect();
    let mut order = Vec::new();
    loop {
        left.retain(|l| !l.is_empty());
        let Some(next) = left
            .iter()
            .map(|l| l[0])
            .find(|j| left.iter().all(|l| !l[1..].contains(j)))
        else {
            // Empty, or lists that disagree on order (two tables that saw two journals in
            // opposite orders cannot happen: records of one journal never follow another's
            // in one table): take the first left, deterministic either way.
            match left.first() {
                Some(l) => {
                    let j = l[0];
                    order.push(j);
                    for l in &mut left {
                        l.retain(|x| *x != j);
                    }
                    continue;
                }
                None => return order,
            }
        };
        order.push(next);
        for l in &mut left {
            l.retain(|x| *x != next);
        }
    }
}

/// Replays journal `j` into the tables whose manifests name it, each from its own position.
fn replay_journal(
    store: &dyn kochab_store::ObjectStore,
    engine: &mut Engine,
    manifests: &BTreeMap<u64, Manifest>,
    j: JournalId,
    replies: &mut ReplyCache,
) -> Result<RecoveryReport, RecoveryError> {
    let mut after = u64::MAX;
    let mut until = Some(0u64);
    for t in engine.tables_mut() {
        match manifests.get(&t.lo).and_then(|m| m.position_in(j)) {
            Some(p) => {
                t.replay_from = p.after;
                t.replay_until = p.until.unwrap_or(u64::MAX);
                after = after.min(p.after);
                until = match (until, p.until) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
            None => {
                t.replay_from = u64::MAX;
                t.replay_until = 0;
            }
        }
    }
    if after == u64::MAX {
        return Ok(RecoveryReport::default());
    }
    // The reply cache as the journal's writer last saved it, and the records after that
    // (their mutations only where a table's checkpoint does not cover them yet).
    if let Some(snap) = crate::manifest::read_replies(store, j)? {
        replies.import(&snap.replies);
        after = after.min(snap.lsn);
    }
    kochab_journal::recover_range(store, j, after, until, |lsn, payload| {
        let entry: JournalEntry =
            postcard::from_bytes(payload).map_err(|e| format!("undecodable entry: {e}"))?;
        engine.replay(lsn, &entry.muts)?;
        // Reply-cache entries go with the tables their operation changed (those loaded here
        // that need this journal, checkpointed past the record or not): a retry of an
        // operation on a table served elsewhere is that server's to answer. A change that
        // changed nothing (a rename between two names of one inode) names no table: its
        // entry is kept wherever the journal is replayed (a retry elsewhere finds nothing
        // to do either).
        let ours = entry.muts.is_empty()
            || entry.muts.iter().any(|m| {
                engine
                    .table_index(m.table_key())
                    .is_some_and(|i| lsn <= engine.tables()[i].replay_until)
            });
        if !ours {
            return Ok(());
        }
        if entry.seq_floor != 0 {
            replies.acknowledge(entry.client, entry.seq_floor);
        }
        if entry.seq != 0 {
            replies.insert(entry.client, entry.seq, entry.outcome);
        }
        Ok(())
    })
}

fn explain(e: RecoveryError, repair: Option<&str>) -> io::Error {
    let hint = match (&e, repair) {
        (RecoveryError::Damaged(_), Some(command)) => format!(
            "; nothing was changed. To start anyway, dropping the damaged part and \
             everything after it (the command lists exactly what goes): {command}"
        ),
        _ => String::new(),
    };
    io::Error::new(io::ErrorKind::InvalidData, format!("{e}{hint}"))
}

/// The command that repairs the store of the data directory `path` (its own, or one on S3).
fn repair_command(store: &dyn kochab_store::ObjectStore, path: &Path) -> String {
    if store.positioned_io() {
        format!(
            "kochab fsck --data {} --repair --accept-loss",
            path.display()
        )
    } else {
        "kochab fsck --store s3://BUCKET/PREFIX --repair --accept-loss (with every server \
         of the store stopped)"
            .to_string()
    }
}

/// Writes the next version of `m` naming `me` as owner and its journal (from `after`) as the
/// last to replay; the sealed journals read for it keep the end found (`ends`). Refused
/// (the store's `AlreadyExists`) if another incarnation claimed or checkpointed the table
/// since `m` was read.
pub fn claim(
    store: &dyn kochab_store::ObjectStore,
    mut m: Manifest,
    me: JournalId,
    after: u64,
    ends: &BTreeMap<JournalId, u64>,
) -> io::Result<Manifest> {
    let mut journals: Vec<JournalPos> = Vec::new();
    for p in &m.journals {
        let until = p.until.or_else(|| ends.get(&p.id()).copied());
        // A journal with nothing for this table past its position is not needed any more.
        if until.is_some_and(|u| u <= p.after) {
            continue;
        }
        journals.push(JournalPos { until, ..*p });
    }
    journals.push(JournalPos {
        server: me.server,
        epoch: me.epoch,
        after,
        until: None,
    });
    m.journals = journals;
    m.split = None;
    m.owner = Some(Owner {
        server: me.server,
        epoch: me.epoch,
    });
    swap_manifest(store, &mut m).map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "table {:016x} was claimed by another server incarnation while {me} \
                     loaded it",
                    m.lo
                ),
            )
        } else {
            e
        }
    })?;
    Ok(m)
}

/// What the offline check found (and, when repairing, did), as lines for a person.
pub struct OfflineReport {
    pub lines: Vec<String>,
    /// The directory would not start as it is (before a repair) / does not start (after).
    pub refuses_to_start: bool,
}

/// A stopped cluster's store as the offline tools see it: the store, its cluster
/// description, and the command that repairs it (for messages).
pub struct Offline<'a> {
    pub store: &'a dyn kochab_store::ObjectStore,
    pub meta: &'a ClusterMeta,
    pub repair_command: String,
}

impl<'a> Offline<'a> {
    /// The store of data directory `dir`.
    pub fn of(dir: &'a DataDir) -> Offline<'a> {
        Offline {
            store: dir.store.as_ref(),
            meta: &dir.meta,
            repair_command: repair_command(dir.store.as_ref(), &dir.path),
        }
    }
}

/// The manifests of every table in the store: of each range the cluster was made with, and
/// of the tables split off them since.
fn manifests(o: &Offline<'_>) -> io::Result<Vec<Manifest>> {
    let mut out = Vec::new();
    for &(lo, hi) in &o.meta.tables {
        out.extend(manifests_covering(o.store, lo, Some(hi))?);
    }
    Ok(out)
}

/// Reads a stopped server's journals and checkpoints without changing anything: where a
/// journal is damaged, if one is, and whether a start would refuse.
pub fn check_offline(path: &Path) -> io::Result<OfflineReport> {
    let _lock = DataDirLock::acquire(path)?;
    let dir = DataDir::open_existing(path)?;
    check_store_offline(&Offline::of(&dir))
}

/// [`check_offline`] of a store (every server using it stopped).
pub fn check_store_offline(o: &Offline<'_>) -> io::Result<OfflineReport> {
    let store = o.store;
    let manifests = manifests(o)?;
    let mut lines = Vec::new();
    let mut refuses = false;
    for j in kochab_journal::segment::list_journals(store)? {
        let ins = kochab_journal::inspect(store, j).map_err(io::Error::other)?;
        if !ins.segments.is_empty() && ins.segments.iter().all(|s| s.name.ends_with(".jo")) {
            // Objects are many and small (one per group commit): one line for them all.
            let records: u64 = ins.segments.iter().map(|s| s.records).sum();
            let bytes: u64 = ins.segments.iter().map(|s| s.bytes).sum();
            lines.push(format!(
                "{j}: {} objects, {bytes} bytes, {records} records",
                ins.segments.len()
            ));
        } else {
            for seg in &ins.segments {
                lines.push(describe_segment("segment", seg));
            }
        }
        match &ins.damage {
            None => lines.push(format!("{j}: one valid chain up to LSN {}", ins.chain_end)),
            Some(d) if d.torn_tail => lines.push(format!(
                "{j}: valid up to LSN {}, then a torn tail that a start cuts by itself: {d}",
                ins.chain_end
            )),
            Some(d) => {
                refuses = true;
                lines.push(format!(
                    "{j} DAMAGED: {d}; valid up to LSN {}. A start refuses; \
                     `{}` drops the rest",
                    ins.chain_end, o.repair_command
                ));
            }
        }
        let first = ins.segments.iter().find_map(|s| s.lsns.map(|l| l.0));
        for m in &manifests {
            let Some(p) = m.position_in(j) else { continue };
            if let Some(first) = first
                && first > p.after + 1
            {
                refuses = true;
                lines.push(format!(
                    "table {:016x} needs {j} from LSN {}, the oldest is {first}",
                    m.lo,
                    p.after + 1
                ));
            }
            if ins.chain_end < p.after && first.is_some() {
                refuses = true;
                lines.push(format!(
                    "table {:016x} needs {j} up to LSN {}, it ends at {}",
                    m.lo, p.after, ins.chain_end
                ));
            }
        }
    }
    Ok(OfflineReport {
        lines,
        refuses_to_start: refuses,
    })
}

fn describe_segment(what: &str, s: &kochab_journal::SegmentSummary) -> String {
    // A journal on a store of whole objects is objects, not segments.
    let what = if s.name.ends_with(".jo") {
        what.replace("segment", "object")
    } else {
        what.to_string()
    };
    match s.lsns {
        Some((a, b)) => format!(
            "{what} {} ({} bytes): {} records, LSN {a}..={b}",
            s.name, s.bytes, s.records
        ),
        None => format!("{what} {} ({} bytes): no valid records", s.name, s.bytes),
    }
}

/// Makes a stopped server's directory start again after journal damage, accepting the
/// loss: each damaged journal is cut at the last valid record before the damage (the rest
/// of that segment and every later segment are dropped, see
/// `kochab_journal::repair_accept_loss`), and tables whose manifests point past the new end
/// replay from it, so that records written after the repair are never skipped. Every drop
/// is listed. The namespace may have lost operations that spanned tables; the started
/// server's `kochab fsck` says.
pub fn repair_accept_loss(path: &Path) -> io::Result<OfflineReport> {
    let _lock = DataDirLock::acquire(path)?;
    let dir = DataDir::open_existing(path)?;
    repair_store_accept_loss(&Offline::of(&dir))
}

/// [`repair_accept_loss`] of a store (every server using it stopped).
pub fn repair_store_accept_loss(o: &Offline<'_>) -> io::Result<OfflineReport> {
    let store = o.store;
    let mut lines = Vec::new();
    let mut all = manifests(o)?;
    for j in kochab_journal::segment::list_journals(store)? {
        let repair = kochab_journal::repair_accept_loss(store, j).map_err(io::Error::other)?;
        match &repair.damage {
            None => {
                lines.push(format!("{j}: no damage found; nothing dropped"));
            }
            Some(d) => {
                lines.push(format!("{j} damage: {d}"));
                lines.push(format!(
                    "kept: every record of {j} up to LSN {}",
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
        let first_kept = kochab_journal::inspect(store, j)
            .map_err(io::Error::other)?
            .segments
            .iter()
            .find_map(|s| s.lsns.map(|l| l.0));
        for m in &mut all {
            let Some(idx) = m.journals.iter().position(|p| p.id() == j) else {
                continue;
            };
            let p = &mut m.journals[idx];
            let old = p.after;
            if old > repair.kept_through {
                p.after = repair.kept_through;
                lines.push(format!(
                    "table {:016x}: its checkpoint reflects records of {j} up to LSN {old}; \
                     it now replays from LSN {}, so records written from now on are never \
                     skipped",
                    m.lo, repair.kept_through
                ));
            } else if let Some(first) = first_kept
                && old + 1 < first
            {
                p.after = first - 1;
                lines.push(format!(
                    "table {:016x}: records {}..={} of {j} it needs are gone; dropped: it \
                     replays from LSN {first}",
                    m.lo,
                    old + 1,
                    first - 1
                ));
            } else if repair.damage.is_none() {
                continue;
            }
            if let Some(u) = p.until {
                p.until = Some(u.min(repair.kept_through).max(p.after));
            }
            swap_manifest(store, m)?;
        }
    }
    // Proof that it starts: the loading a start would run, on a copy of nothing (read-only
    // check of the replay, without claiming).
    let refuses = match dry_run(o) {
        Ok((inodes, replayed)) => {
            lines.push(format!(
                "the directory now recovers: {inodes} inodes, {replayed} journal records \
                 replayed; start it and run `kochab fsck` to check the namespace"
            ));
            false
        }
        Err(e) => {
            lines.push(format!("the directory still does not recover: {e}"));
            true
        }
    };
    Ok(OfflineReport {
        lines,
        refuses_to_start: refuses,
    })
}

/// What loading every table of a stopped directory found about its namespace.
pub struct NamespaceReport {
    pub tables: usize,
    pub inodes: u64,
    pub replayed: u64,
    /// Broken invariants (orphans, cycles, wrong nlink, ...); empty when consistent.
    pub problems: Vec<String>,
}

/// Loads every table of a stopped directory (one server's, or a whole cluster's: every
/// table from its manifest and the journals it names, whichever server wrote them) and
/// checks the namespace invariants across all of them. Claims, seals and rewrites nothing
/// but what a start would anyway (a torn journal tail is zeroed, as replay does).
pub fn check_namespace_offline(path: &Path) -> io::Result<NamespaceReport> {
    let _lock = DataDirLock::acquire(path)?;
    let dir = DataDir::open_existing(path)?;
    check_store_namespace(&Offline::of(&dir))
}

/// [`check_namespace_offline`] of a store (every server using it stopped).
pub fn check_store_namespace(o: &Offline<'_>) -> io::Result<NamespaceReport> {
    let (engine, replayed) = load_all(o)?;
    Ok(NamespaceReport {
        tables: engine.tables().len(),
        inodes: engine.counts().0,
        replayed,
        problems: engine.check_invariants(),
    })
}

/// Loads every table and replays its journals as a start would, without claiming anything.
fn dry_run(o: &Offline<'_>) -> io::Result<(u64, u64)> {
    let (engine, replayed) = load_all(o)?;
    Ok((engine.counts().0, replayed))
}

/// Every table of the store loaded from its checkpoint and journals, unclaimed; and the
/// number of journal records replayed.
fn load_all(o: &Offline<'_>) -> io::Result<(Engine, u64)> {
    let store = o.store;
    let manifests: BTreeMap<u64, Manifest> = manifests(o)?.into_iter().map(|m| (m.lo, m)).collect();
    let ranges: Vec<(u64, u64)> = manifests.values().map(|m| (m.lo, m.hi)).collect();
    let mut engine = Engine::new(o.meta.engine.clone(), &ranges).map_err(io::Error::other)?;
    load_images(store, &mut engine, &manifests)?;
    let mut replies = ReplyCache::default();
    let mut replayed = 0;
    for j in journal_order(manifests.values()) {
        replayed += replay_journal(store, &mut engine, &manifests, j, &mut replies)
            .map_err(|e| explain(e, None))?
            .replayed;
    }
    engine.fill_region_next();
    Ok((engine, replayed))
}

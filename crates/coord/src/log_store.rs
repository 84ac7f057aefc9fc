//! The Raft log on disk: append-only segment files of checksummed entries, plus two small
//! files replaced atomically: the vote and the last purged log id.
//!
//! A record is `[len u32 LE][crc32c u32 LE][postcard Entry]`. An append is written and
//! fdatasynced before openraft is told it is flushed, so an acknowledged entry is on disk.
//! On restart a bad record in the last segment is a torn tail (the write that was never
//! acknowledged) and is cut off; a bad record in an earlier segment is corruption and the
//! replica refuses to start. Entries are also kept in memory: a coordinator's log is small
//! and is purged after each snapshot.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::ops::{Bound, RangeBounds};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{Entry, LogId, OptionalSend, RaftLogId, StorageError, StorageIOError, Vote};

use crate::{ReplicaId, ReplicatedState, TypeConfig};

/// A segment is closed and a new one started past this size, so purging can delete whole
/// files. 4 MiB: a few thousand coordinator commands.
pub const SEGMENT_BYTES_MAX: u64 = 4 << 20;

/// One record's payload may not exceed this (a corrupt length must not make us allocate
/// gigabytes). Matches the wire's frame limit.
pub const RECORD_BYTES_MAX: usize = crate::wire::MAX_FRAME_BYTES;

const RECORD_HEAD: usize = 8;
const VOTE_FILE: &str = "vote";
const PURGED_FILE: &str = "purged";
const SEGMENT_PREFIX: &str = "log-";
const SEGMENT_SUFFIX: &str = ".seg";
/// Mode of every file a replica writes: its state holds the cluster's client keys (sealed,
/// see `kochab_proto::auth::seal_client_key`), the membership and the leases, for the
/// replica's owner alone, as the data directory's key files.
pub(crate) const FILE_MODE: u32 = 0o600;
/// Mode of the directories it makes.
const DIR_MODE: u32 = 0o700;

type C<S> = TypeConfig<S>;
type SErr = StorageError<ReplicaId>;

fn io_err(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn write_err(e: io::Error) -> SErr {
    StorageIOError::write_logs(&e).into()
}

/// fsyncs a directory so a create, rename or unlink inside it is durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` (and parents) and makes its entry in the parent durable.
pub(crate) fn create_dir_durable(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)?;
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => sync_dir(p),
        _ => Ok(()),
    }
}

/// Replaces `dir/name` with `[crc32c][bytes]`, atomically: temp file, fsync, rename,
/// fsync of the directory.
pub(crate) fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    {
        let _ = fs::remove_file(&tmp);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&tmp)?;
        f.write_all(&crc32c::crc32c(bytes).to_le_bytes())?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// Reads a file written by `write_atomic`; `None` if it does not exist.
pub(crate) fn read_atomic(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let mut buf = Vec::new();
    match File::open(path) {
        Ok(mut f) => f.read_to_end(&mut buf)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if buf.len() < 4 {
        return Err(io_err(format!("{}: too short", path.display())));
    }
    let crc = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    let body = buf.split_off(4);
    if crc32c::crc32c(&body) != crc {
        return Err(io_err(format!("{}: checksum mismatch", path.display())));
    }
    Ok(Some(body))
}

fn segment_name(first: u64) -> String {
    format!("{SEGMENT_PREFIX}{first:020}{SEGMENT_SUFFIX}")
}

fn parse_segment_name(name: &str) -> Option<u64> {
    name.strip_prefix(SEGMENT_PREFIX)?
        .strip_suffix(SEGMENT_SUFFIX)?
        .parse()
        .ok()
}

/// Encodes one log record.
fn encode_record<S: ReplicatedState>(entry: &Entry<C<S>>) -> io::Result<Vec<u8>> {
    let payload = postcard::to_stdvec(entry).map_err(|e| io_err(e.to_string()))?;
    if payload.len() > RECORD_BYTES_MAX {
        return Err(io_err(format!("log entry of {} bytes", payload.len())));
    }
    let mut rec = Vec::with_capacity(RECORD_HEAD + payload.len());
    rec.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    rec.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    rec.extend_from_slice(&payload);
    Ok(rec)
}

/// Decodes the record at the start of `buf`: `Ok(Some((entry, bytes used)))`, `Ok(None)` if
/// it is short or its checksum fails (a torn write), `Err` if it checks but does not decode
/// (a bug, not a torn write).
fn decode_record<S: ReplicatedState>(buf: &[u8]) -> io::Result<Option<(Entry<C<S>>, usize)>> {
    if buf.len() < RECORD_HEAD {
        return Ok(None);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    let crc = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    if len > RECORD_BYTES_MAX || buf.len() < RECORD_HEAD + len {
        return Ok(None);
    }
    let payload = &buf[RECORD_HEAD..RECORD_HEAD + len];
    if crc32c::crc32c(payload) != crc {
        return Ok(None);
    }
    let entry = postcard::from_bytes(payload)
        .map_err(|e| io_err(format!("log record checks but does not decode: {e}")))?;
    Ok(Some((entry, RECORD_HEAD + len)))
}

struct Segment {
    path: PathBuf,
    /// Bytes of valid records.
    len: u64,
    /// Highest index stored in it, if any.
    last: Option<u64>,
}

struct Inner<S: ReplicatedState> {
    dir: PathBuf,
    /// Every entry not purged, by index.
    entries: BTreeMap<u64, Entry<C<S>>>,
    /// Where each entry in `entries` starts: (segment's first index, byte offset).
    locs: BTreeMap<u64, (u64, u64)>,
    /// Segments by first index; the last one is appended to.
    segments: BTreeMap<u64, Segment>,
    /// The last segment, open for appending.
    active: Option<File>,
    last_purged: Option<LogId<ReplicaId>>,
    vote: Option<Vote<ReplicaId>>,
    /// `SEGMENT_BYTES_MAX`, smaller in tests.
    segment_bytes_max: u64,
}

/// The durable Raft log (openraft's `RaftLogStorage`). Clones share one log; a clone is
/// also the log reader the replication tasks use.
pub struct LogStore<S: ReplicatedState> {
    inner: Arc<Mutex<Inner<S>>>,
}

impl<S: ReplicatedState> Clone for LogStore<S> {
    fn clone(&self) -> Self {
        LogStore {
            inner: Arc::clone(&self.inner),
        }
    }
}

/// What `LogStore::open` found on disk, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogRecovery {
    /// Entries loaded.
    pub entries: u64,
    /// Bytes cut from the last segment's torn tail.
    pub torn_bytes: u64,
}

impl<S: ReplicatedState> LogStore<S> {
    /// Opens (creating if needed) the log in `dir`, cutting a torn tail.
    pub fn open(dir: &Path) -> io::Result<(LogStore<S>, LogRecovery)> {
        create_dir_durable(dir)?;
        let vote = match read_atomic(&dir.join(VOTE_FILE))? {
            Some(b) => Some(postcard::from_bytes(&b).map_err(|e| io_err(e.to_string()))?),
            None => None,
        };
        let last_purged: Option<LogId<ReplicaId>> = match read_atomic(&dir.join(PURGED_FILE))? {
            Some(b) => postcard::from_bytes(&b).map_err(|e| io_err(e.to_string()))?,
            None => None,
        };
        let mut firsts = Vec::new();
        for de in fs::read_dir(dir)? {
            let de = de?;
            if let Some(first) = de.file_name().to_str().and_then(parse_segment_name) {
                firsts.push(first);
            }
        }
        firsts.sort_unstable();
        let mut inner = Inner {
            dir: dir.to_path_buf(),
            entries: BTreeMap::new(),
            locs: BTreeMap::new(),
            segments: BTreeMap::new(),
            active: None,
            last_purged,
            vote,
            segment_bytes_max: SEGMENT_BYTES_MAX,
        };
        let mut rec = LogRecovery::default();
        let purged_idx = last_purged.map(|l| l.index);
        for (i, &first) in firsts.iter().enumerate() {
            let is_last = i + 1 == firsts.len();
            inner.load_segment(first, is_last, purged_idx, &mut rec)?;
        }
        if let Some((&first, seg)) = inner.segments.iter().next_back() {
            let f = OpenOptions::new().append(true).open(&seg.path)?;
            debug_assert!(first <= seg.last.unwrap_or(first));
            inner.active = Some(f);
        }
        rec.entries = inner.entries.len() as u64;
        Ok((
            LogStore {
                inner: Arc::new(Mutex::new(inner)),
            },
            rec,
        ))
    }

    fn lock(&self) -> MutexGuard<'_, Inner<S>> {
        // A panic while holding the lock already aborts the process (panic = "abort").
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends `entries` (consecutive, following the last index) and syncs them.
    fn append_entries(&self, entries: Vec<Entry<C<S>>>) -> io::Result<()> {
        let mut g = self.lock();
        let mut recs = Vec::with_capacity(entries.len());
        let fresh = g.entries.is_empty() && g.last_purged.is_none();
        let mut expect = g.last_index().map_or(0, |l| l + 1);
        for e in &entries {
            let idx = e.get_log_id().index;
            if idx != expect && !(fresh && recs.is_empty()) {
                return Err(io_err(format!("append of {idx}, expected {expect}")));
            }
            expect = idx + 1;
            recs.push((idx, encode_record::<S>(e)?));
        }
        let placed = g.append_records(&recs)?;
        for ((idx, seg, off), e) in placed.into_iter().zip(entries) {
            g.locs.insert(idx, (seg, off));
            g.entries.insert(idx, e);
        }
        Ok(())
    }

    /// The index range of entries held (not purged), for tests and status.
    pub fn index_range(&self) -> Option<(u64, u64)> {
        let g = self.lock();
        let first = *g.entries.keys().next()?;
        let last = *g.entries.keys().next_back()?;
        Some((first, last))
    }
}

impl<S: ReplicatedState> Inner<S> {
    fn last_index(&self) -> Option<u64> {
        let e = self.entries.keys().next_back().copied();
        let p = self.last_purged.map(|l| l.index);
        e.max(p)
    }

    fn load_segment(
        &mut self,
        first: u64,
        is_last: bool,
        purged: Option<u64>,
        rec: &mut LogRecovery,
    ) -> io::Result<()> {
        let path = self.dir.join(segment_name(first));
        let buf = fs::read(&path)?;
        let mut off = 0usize;
        let mut last = None;
        while off < buf.len() {
            let Some((entry, used)) = decode_record::<S>(&buf[off..])? else {
                if !is_last {
                    return Err(io_err(format!(
                        "{}: bad record at byte {off} in a closed segment",
                        path.display()
                    )));
                }
                // The torn tail of the last, unacknowledged write.
                let f = OpenOptions::new().write(true).open(&path)?;
                f.set_len(off as u64)?;
                f.sync_all()?;
                rec.torn_bytes = (buf.len() - off) as u64;
                tracing::warn!(
                    path = %path.display(),
                    offset = off,
                    bytes = rec.torn_bytes,
                    "cut a torn tail from the raft log"
                );
                break;
            };
            let idx = entry.get_log_id().index;
            last = Some(idx);
            if Some(idx) > purged {
                if let Some(prev) = self.last_index()
                    && idx != prev + 1
                {
                    return Err(io_err(format!(
                        "{}: entry {idx} follows {prev}",
                        path.display()
                    )));
                }
                self.locs.insert(idx, (first, off as u64));
                self.entries.insert(idx, entry);
            }
            off += used;
        }
        self.segments.insert(
            first,
            Segment {
                path,
                len: off as u64,
                last,
            },
        );
        Ok(())
    }

    /// Writes `recs` (index, bytes) durably, starting segments as needed.
    fn append_records(&mut self, recs: &[(u64, Vec<u8>)]) -> io::Result<Vec<(u64, u64, u64)>> {
        let mut placed = Vec::with_capacity(recs.len());
        let mut new_segment = false;
        let mut pending: Vec<u8> = Vec::new();
        for (idx, bytes) in recs {
            let full = match self.segments.iter().next_back() {
                Some((_, seg)) => seg.len + pending.len() as u64 >= self.segment_bytes_max,
                None => true,
            };
            if full || self.active.is_none() {
                self.flush_pending(&mut pending)?;
                let path = self.dir.join(segment_name(*idx));
                let f = OpenOptions::new()
                    .create(true)
                    .truncate(true)
                    .write(true)
                    .mode(FILE_MODE)
                    .open(&path)?;
                if let Some(old) = self.active.take() {
                    old.sync_data()?;
                }
                self.active = Some(f);
                self.segments.insert(
                    *idx,
                    Segment {
                        path,
                        len: 0,
                        last: None,
                    },
                );
                new_segment = true;
            }
            let Some((&first, seg)) = self.segments.iter_mut().next_back() else {
                unreachable!("a segment was just ensured");
            };
            placed.push((*idx, first, seg.len + pending.len() as u64));
            pending.extend_from_slice(bytes);
            seg.last = Some(*idx);
        }
        self.flush_pending(&mut pending)?;
        if let Some(f) = &self.active {
            f.sync_data()?;
        }
        if new_segment {
            sync_dir(&self.dir)?;
        }
        Ok(placed)
    }

    fn flush_pending(&mut self, pending: &mut Vec<u8>) -> io::Result<()> {
        if pending.is_empty() {
            return Ok(());
        }
        let Some(f) = self.active.as_mut() else {
            return Err(io_err("no active segment"));
        };
        f.write_all(pending)?;
        if let Some((_, seg)) = self.segments.iter_mut().next_back() {
            seg.len += pending.len() as u64;
        }
        pending.clear();
        Ok(())
    }

    /// Removes entries from `index` on, from memory and disk.
    fn truncate_from(&mut self, index: u64) -> io::Result<()> {
        let Some(&(seg_first, off)) = self.locs.get(&index) else {
            return Ok(()); // nothing at or after `index`
        };
        let later: Vec<u64> = self
            .segments
            .range((Bound::Excluded(seg_first), Bound::Unbounded))
            .map(|(k, _)| *k)
            .collect();
        self.active = None;
        for k in later {
            if let Some(seg) = self.segments.remove(&k) {
                fs::remove_file(&seg.path)?;
            }
        }
        let Some(seg) = self.segments.get_mut(&seg_first) else {
            return Err(io_err("truncate: segment vanished"));
        };
        let f = OpenOptions::new().write(true).open(&seg.path)?;
        f.set_len(off)?;
        f.sync_all()?;
        seg.len = off;
        seg.last = index.checked_sub(1).filter(|&l| l >= seg_first);
        sync_dir(&self.dir)?;
        self.active = Some(OpenOptions::new().append(true).open(&seg.path)?);
        self.entries.split_off(&index);
        self.locs.split_off(&index);
        Ok(())
    }

    /// Forgets entries up to `log_id` and deletes segments that hold nothing newer.
    fn purge_upto(&mut self, log_id: LogId<ReplicaId>) -> io::Result<()> {
        let bytes = postcard::to_stdvec(&Some(log_id)).map_err(|e| io_err(e.to_string()))?;
        // Recorded first: after a crash, entries up to it are skipped on load.
        write_atomic(&self.dir, PURGED_FILE, &bytes)?;
        self.last_purged = Some(log_id);
        let keep = self.entries.split_off(&(log_id.index + 1));
        self.entries = keep;
        let keep = self.locs.split_off(&(log_id.index + 1));
        self.locs = keep;
        let dead: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.last.is_none_or(|l| l <= log_id.index))
            .map(|(k, _)| *k)
            .collect();
        let last_seg = self.segments.keys().next_back().copied();
        let mut removed = false;
        for k in dead {
            if Some(k) == last_seg {
                self.active = None;
            }
            if let Some(seg) = self.segments.remove(&k) {
                fs::remove_file(&seg.path)?;
                removed = true;
            }
        }
        if removed {
            sync_dir(&self.dir)?;
        }
        Ok(())
    }
}

impl<S: ReplicatedState> RaftLogReader<C<S>> for LogStore<S> {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + std::fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<C<S>>>, SErr> {
        let g = self.lock();
        Ok(g.entries.range(range).map(|(_, e)| e.clone()).collect())
    }
}

impl<S: ReplicatedState> RaftLogStorage<C<S>> for LogStore<S> {
    type LogReader = LogStore<S>;

    async fn get_log_state(&mut self) -> Result<LogState<C<S>>, SErr> {
        let g = self.lock();
        let last = g.entries.values().next_back().map(|e| *e.get_log_id());
        Ok(LogState {
            last_purged_log_id: g.last_purged,
            last_log_id: last.or(g.last_purged),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<ReplicaId>) -> Result<(), SErr> {
        let mut g = self.lock();
        let bytes = postcard::to_stdvec(vote)
            .map_err(|e| StorageIOError::write_vote(&io_err(e.to_string())))?;
        write_atomic(&g.dir, VOTE_FILE, &bytes).map_err(|e| StorageIOError::write_vote(&e))?;
        g.vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<ReplicaId>>, SErr> {
        Ok(self.lock().vote)
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<C<S>>) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<C<S>>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry<C<S>>> = entries.into_iter().collect();
        match self.append_entries(entries) {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                // openraft stops on a storage error; a partial write left behind is the
                // torn tail the next open cuts.
                let msg = e.to_string();
                callback.log_io_completed(Err(e));
                Err(write_err(io::Error::other(msg)))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<ReplicaId>) -> Result<(), SErr> {
        self.lock().truncate_from(log_id.index).map_err(write_err)
    }

    async fn purge(&mut self, log_id: LogId<ReplicaId>) -> Result<(), SErr> {
        self.lock().purge_upto(log_id).map_err(write_err)
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload};
    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Clone, Default, Serialize, Deserialize)]
    struct Sum(u64);

    impl ReplicatedState for Sum {
        type Command = u64;
        type Reply = u64;
        fn apply(&mut self, cmd: &u64) -> u64 {
            self.0 += cmd;
            self.0
        }
    }

    fn entry(term: u64, index: u64) -> Entry<C<Sum>> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Normal(index * 10 + term),
        }
    }

    fn open(dir: &Path) -> (LogStore<Sum>, LogRecovery) {
        let (log, rec) = LogStore::<Sum>::open(dir).unwrap();
        // Small segments, so these tests cross segment boundaries.
        log.lock().segment_bytes_max = 100;
        (log, rec)
    }

    fn terms(log: &LogStore<Sum>) -> Vec<(u64, u64)> {
        let g = log.lock();
        g.entries
            .values()
            .map(|e| (e.log_id.index, e.log_id.leader_id.term))
            .collect()
    }

    fn segments(dir: &Path) -> usize {
        fs::read_dir(dir)
            .unwrap()
            .filter(|d| {
                let n = d.as_ref().unwrap().file_name();
                n.to_str().and_then(parse_segment_name).is_some()
            })
            .count()
    }

    #[test]
    fn append_reopen_truncate_purge() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (log, _) = open(dir);
        log.append_entries((1..=50).map(|i| entry(1, i)).collect())
            .unwrap();
        assert!(segments(dir) > 3);
        drop(log);

        let (log, rec) = open(dir);
        assert_eq!(
            rec,
            LogRecovery {
                entries: 50,
                torn_bytes: 0
            }
        );
        assert_eq!(log.index_range(), Some((1, 50)));
        // A new leader overwrites a suffix.
        log.lock().truncate_from(30).unwrap();
        log.append_entries((30..=35).map(|i| entry(2, i)).collect())
            .unwrap();
        drop(log);

        let (log, _) = open(dir);
        let t = terms(&log);
        assert_eq!(t.len(), 35);
        assert_eq!(t[28], (29, 1));
        assert_eq!(t[29], (30, 2));
        assert_eq!(t[34], (35, 2));
        let before = segments(dir);
        log.lock()
            .purge_upto(LogId::new(CommittedLeaderId::new(1, 1), 20))
            .unwrap();
        assert!(segments(dir) < before);
        drop(log);

        let (mut log, _) = open(dir);
        assert_eq!(log.index_range(), Some((21, 35)));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let st = rt.block_on(log.get_log_state()).unwrap();
        assert_eq!(st.last_purged_log_id.map(|l| l.index), Some(20));
        assert_eq!(st.last_log_id.map(|l| l.index), Some(35));
        // Out-of-order appends are refused, not written.
        assert!(log.append_entries(vec![entry(2, 40)]).is_err());
    }

    #[test]
    fn every_file_of_the_log_is_for_its_owner_alone() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("raft-log");
        let (log, _) = open(&dir);
        log.append_entries((1..=20).map(|i| entry(1, i)).collect())
            .unwrap();
        log.lock()
            .purge_upto(LogId::new(CommittedLeaderId::new(1, 1), 5))
            .unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), DIR_MODE);
        let files: Vec<PathBuf> = fs::read_dir(&dir)
            .unwrap()
            .map(|d| d.unwrap().path())
            .collect();
        assert!(files.len() > 2, "segments and the purge mark: {files:?}");
        for f in files {
            assert_eq!(mode(&f), FILE_MODE, "{}", f.display());
        }
    }

    #[test]
    fn purge_past_the_end_after_a_snapshot_install() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (log, _) = open(dir);
        log.append_entries((0..=9).map(|i| entry(1, i)).collect())
            .unwrap();
        log.lock()
            .purge_upto(LogId::new(CommittedLeaderId::new(3, 1), 100))
            .unwrap();
        assert_eq!(segments(dir), 0);
        log.append_entries(vec![entry(3, 101), entry(3, 102)])
            .unwrap();
        drop(log);
        let (mut log, _) = open(dir);
        assert_eq!(log.index_range(), Some((101, 102)));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let st = rt.block_on(log.get_log_state()).unwrap();
        assert_eq!(st.last_purged_log_id.map(|l| l.index), Some(100));
    }

    #[test]
    fn torn_tail_is_cut_but_a_bad_closed_segment_refuses() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (log, _) = open(dir);
        log.append_entries((1..=30).map(|i| entry(1, i)).collect())
            .unwrap();
        drop(log);
        let mut names: Vec<u64> = fs::read_dir(dir)
            .unwrap()
            .filter_map(|d| parse_segment_name(d.unwrap().file_name().to_str()?))
            .collect();
        names.sort_unstable();
        let last = dir.join(segment_name(*names.last().unwrap()));
        let len = fs::metadata(&last).unwrap().len();
        // Half a record at the end: cut.
        let mut bytes = fs::read(&last).unwrap();
        bytes.extend_from_slice(&[50, 0, 0, 0, 1, 2]);
        fs::write(&last, &bytes).unwrap();
        let (log, rec) = open(dir);
        assert_eq!(
            rec,
            LogRecovery {
                entries: 30,
                torn_bytes: 6
            }
        );
        assert_eq!(fs::metadata(&last).unwrap().len(), len);
        drop(log);
        // A flipped bit in a closed segment is corruption, not a torn write.
        let first = dir.join(segment_name(names[0]));
        let mut bytes = fs::read(&first).unwrap();
        bytes[RECORD_HEAD] ^= 1;
        fs::write(&first, &bytes).unwrap();
        assert!(LogStore::<Sum>::open(dir).is_err());
    }

    #[tokio::test]
    async fn vote_survives_reopen_and_a_bad_vote_file_refuses() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (mut log, _) = open(dir);
        assert_eq!(log.read_vote().await.unwrap(), None);
        let v = Vote::new(7, 2);
        log.save_vote(&v).await.unwrap();
        drop(log);
        let (mut log, _) = open(dir);
        assert_eq!(log.read_vote().await.unwrap(), Some(v));
        drop(log);
        let mut bytes = fs::read(dir.join(VOTE_FILE)).unwrap();
        let n = bytes.len() - 1;
        bytes[n] ^= 0x40;
        fs::write(dir.join(VOTE_FILE), &bytes).unwrap();
        assert!(LogStore::<Sum>::open(dir).is_err());
    }
}

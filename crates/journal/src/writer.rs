//! Group commit with double buffering.
//!
//! Appenders add records to the active buffer under a short lock and get their LSN. The
//! flusher thread takes the whole active buffer (every record that arrived while the
//! previous flush ran), swaps in the idle one and writes it with one durable write:
//! O_DIRECT | O_DSYNC where the store allows it (one device write with FUA; measured here
//! p50 0.13 ms against 0.15 ms for write + fdatasync), else write + fdatasync. Direct I/O
//! writes whole blocks, so each flush rewrites the partial block it starts in; the bytes of
//! earlier records in it are rewritten unchanged, so a torn write cannot damage them.
//! Durability is published as the highest durable LSN, to threads (a condvar) and async
//! tasks (a watch channel).
//!
//! (Two flushers with overlapping writes were measured too: equal throughput on this
//! machine, where every direct write costs a VM exit, and each flush then needs padding.)
//!
//! Who writes: records someone waits for are written by the committer task
//! ([`Journal::committer`]) where a server runs one on a runtime of one worker thread:
//! on that thread, after every ready batch appended, so a group commit costs no thread
//! hand-off and no wake-up (a capped server paid more CPU for those than for the
//! operations once batches were shallow, issue 32). The flusher thread writes the rest:
//! records answered early, after `lazy_flush`; those of callers that wait on a thread
//! ([`Journal::wait_durable`]); all of them where no committer runs. Whoever writes holds
//! the segment writer, so group commits go one at a time, in LSN order.
//!
//! Fencing: after each durable write and before publishing it, the writer checks that the
//! journal's seal object does not exist (one stat(2) per group commit, a few microseconds,
//! no extra fsync). A sealer creates the seal and only then reads the journal, so a record
//! made durable before the seal existed is seen by that reader, and one made durable after
//! is never acknowledged: the journal fails (fail-stop) instead.
//!
//! That is the journal in segments, on a store with positioned I/O (the local directory).
//! On a store of whole objects only (S3) each group commit becomes an immutable object
//! instead, several PUTs in flight and acknowledged in order (`uploads`), and fencing costs
//! nothing per commit: a sealer creates the object the writer would write next (`objects`).
//! The flusher, the buffers and the durability published are the same for both.

use crate::objects::{self, Content, Listing};
use crate::observer::JournalObserver;
use crate::record::{MAX_RECORD_BYTES, encode_record_with, record_len};
use crate::segment::{
    self, BLOCK, JournalId, SEGMENT_DATA_START, SEGMENT_HEADER_BYTES, encode_header, segment_name,
};
use crate::uploads::{Acks, Kept, Uploads};
use kochab_breaks::{Break, Breaks};
use kochab_store::{AlignedBuf, Object, ObjectStore};
use parking_lot::{Condvar, Mutex};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::watch;

/// How the journal writes.
#[derive(Clone, Debug)]
pub struct JournalOptions {
    /// Bytes per segment.
    pub segment_bytes: u64,
    /// Make every flush durable before its records count as durable. Off is the named
    /// "buffered" mode: a crash of the machine (not of the process) may lose acknowledged
    /// operations.
    pub fsync: bool,
    /// Longest a record waits for its flush when nobody asked for one (see [`LAZY_FLUSH`],
    /// the default). A deterministic simulation sets it beyond its run, so that records
    /// become durable only when it asks ([`Journal::flush_now`], [`Journal::wait_durable`]).
    pub lazy_flush: std::time::Duration,
    /// Deliberate bugs switched on (only a simulation sets any).
    pub breaks: Breaks,
    /// Prepare the zero-filled spare segment on the writer's own thread (at the start and
    /// right after each rollover) instead of on a thread of its own. Off by default: a
    /// rollover then waits for a whole segment to be zero-filled. A deterministic
    /// simulation sets it, so that what the store holds when it takes a crash image
    /// follows from its calls alone, not from how far that thread had got.
    pub spare_inline: bool,
    /// [`Journal::flush_now`] starts no write: it only notes what was asked, written when
    /// someone waits ([`Journal::wait_asked`], [`Journal::wait_durable`]). A deterministic
    /// simulation sets it, so that a kill may fall between a record asked for and its
    /// write, and what was written does not depend on how far the writer's thread got.
    pub held_flushes: bool,
}

/// Longest a record waits for its flush when nobody has asked for it ([`Journal::flush_now`]
/// or a waiter), by default ([`JournalOptions::lazy_flush`]): records answered early (the
/// mount's default) are flushed in groups at least this far apart instead of one flush per
/// operation of a lone writer. It bounds what a crash of a server and its clients together
/// can lose.
pub const LAZY_FLUSH: std::time::Duration = std::time::Duration::from_millis(5);

impl Default for JournalOptions {
    fn default() -> Self {
        // 32 MiB: about 200k create records, a few tenths of a second of replay.
        JournalOptions {
            segment_bytes: 32 << 20,
            fsync: true,
            lazy_flush: LAZY_FLUSH,
            breaks: Breaks::NONE,
            spare_inline: false,
            held_flushes: false,
        }
    }
}

struct State {
    active: Vec<u8>,
    active_records: u64,
    /// LSN of the last record in `active`.
    active_last: u64,
    next_lsn: u64,
    shutdown: bool,
    /// Someone waits for the records in `active`: flush them at once.
    urgent: bool,
    /// The last LSN a flush was asked for ([`Journal::flush_now`]).
    asked_upto: u64,
    /// A thread blocks until they are durable ([`Journal::wait_durable`]): the flusher
    /// thread writes them at once, even while the committer task runs (which may be
    /// waiting for that very thread).
    flusher_asked: bool,
    /// When the first record of `active` was appended.
    pending_since: Option<Instant>,
    /// The flusher thread waits without a timeout: the next record must wake it (it starts
    /// the `lazy_flush` clock). While records keep coming it waits with a timeout instead,
    /// so that appenders need not wake it once per batch.
    flusher_asleep: bool,
    /// The committer task runs: awaited records are its to write. Under this lock, so
    /// that a record is never asked of one that has just stopped or not yet started.
    committer_running: bool,
}

struct Shared {
    state: Mutex<State>,
    wake_flusher: Condvar,
    /// The segment being written, for a journal in segments. Whoever holds it commits: the
    /// flusher thread, or the committer task ([`Journal::committer`]). So group commits
    /// are written one at a time, in LSN order.
    writer: Option<Mutex<SegmentSink>>,
    /// Test hook: `KOCHAB_JOURNAL_DELAY_MS` holds every flush that long (a slow disk), so
    /// crash tests find acknowledged early replies that are not durable yet. Such flushes
    /// are left to the flusher thread.
    delay: Option<std::time::Duration>,
    /// Wakes the committer task ([`Journal::committer`]), while it runs.
    committer_wake: tokio::sync::Notify,
    durable: AtomicU64,
    durable_lock: Mutex<()>,
    durable_cv: Condvar,
    durable_tx: watch::Sender<u64>,
    failed: AtomicBool,
    /// Why the journal failed (the first reason), for everyone who must stop.
    failure_tx: watch::Sender<Option<String>>,
    bytes: AtomicU64,
    segments: AtomicU64,
    store: Arc<dyn ObjectStore>,
    options: JournalOptions,
    id: JournalId,
    /// The seal object's name, checked after every durable write.
    seal_name: String,
}

impl Shared {
    /// Puts the journal into its failed state: nothing appended from now on becomes
    /// durable, waiters are woken, and subscribers learn why. The first reason sticks.
    fn fail(&self, why: String) {
        tracing::error!("journal failed: {why}; no further operation will be acknowledged");
        self.failure_tx.send_if_modified(|f| {
            if f.is_some() {
                return false;
            }
            *f = Some(why);
            true
        });
        self.failed.store(true, Ordering::Release);
        // Taking each lock before notifying means no waiter can miss the flag.
        drop(self.state.lock());
        self.wake_flusher.notify_all();
        let _g = self.durable_lock.lock();
        self.durable_cv.notify_all();
    }

    /// Largest record payload this journal takes: a record must fit in one segment.
    fn record_limit(&self) -> usize {
        let room = self
            .options
            .segment_bytes
            .saturating_sub(SEGMENT_DATA_START);
        (room as usize).min(MAX_RECORD_BYTES)
    }

    /// True if someone waits for records that are not written yet.
    fn awaited(&self) -> bool {
        let st = self.state.lock();
        st.urgent && !st.active.is_empty() && !self.failed.load(Ordering::Acquire)
    }

    /// One group commit into the segments, by the holder of `writer`: takes every record
    /// appended so far (the idle buffer becomes the active one), writes them durably,
    /// checks the seal and publishes them. False if there was nothing to write or the
    /// journal failed.
    fn commit_segments(&self, w: &mut SegmentSink) -> bool {
        let (last, records, waited) = {
            let mut st = self.state.lock();
            st.urgent = false;
            st.flusher_asked = false;
            if st.active.is_empty() || self.failed.load(Ordering::Acquire) {
                return false;
            }
            std::mem::swap(&mut st.active, &mut w.flushing);
            let waited = st
                .pending_since
                .take()
                .map_or(0.0, |t| t.elapsed().as_secs_f64());
            (
                st.active_last,
                std::mem::take(&mut st.active_records),
                waited,
            )
        };
        let flushing = std::mem::take(&mut w.flushing);
        let ok = w.commit(self, &flushing, last, records, waited);
        w.flushing = flushing;
        w.flushing.clear();
        if w.flushing.capacity() > 64 << 20 {
            w.flushing.shrink_to(1 << 20);
        }
        ok
    }

    /// Every record up to `lsn` is durable: tell threads and tasks.
    fn publish(&self, lsn: u64) {
        self.durable.store(lsn, Ordering::Release);
        self.durable_tx.send_replace(lsn);
        let _g = self.durable_lock.lock();
        self.durable_cv.notify_all();
    }
}

impl Acks for Shared {
    fn durable(&self, lsn: u64) {
        self.publish(lsn);
    }

    fn fail(&self, why: String) {
        Shared::fail(self, why);
    }

    fn room(&self) {
        // Under the flusher's lock, so that it cannot miss the wake-up between its check
        // of the room and its wait.
        drop(self.state.lock());
        self.wake_flusher.notify_one();
    }
}

/// The journal of one server.
pub struct Journal {
    shared: Arc<Shared>,
    flusher: Mutex<Option<JoinHandle<()>>>,
    /// The objects in flight and kept, for a journal as objects.
    uploads: Option<Arc<Uploads>>,
}

/// The segment being filled and what writing it needs.
struct SegmentSink {
    seg: Segment,
    aligned: AlignedBuf,
    staging: Vec<u8>,
    /// The preparation of the zero-filled spare segment, while it runs on its own thread.
    spare: Option<JoinHandle<()>>,
    /// The records being written (the idle buffer of the two).
    flushing: Vec<u8>,
    observer: Option<Arc<dyn JournalObserver>>,
}

/// The segment being filled, as the flusher sees it.
struct Segment {
    obj: Arc<dyn Object>,
    /// The same object opened for direct synchronous writes, if the store can.
    direct: Option<Arc<dyn Object>>,
    /// Offset of the next record.
    pos: u64,
    /// The bytes of the partly filled block at `pos` (rewritten with the next flush).
    tail: Vec<u8>,
}

impl Journal {
    /// Starts a journal whose next record gets `next_lsn`, in a fresh segment (after
    /// recovery nothing is ever appended behind a cut tail).
    pub fn start(
        store: Arc<dyn ObjectStore>,
        id: JournalId,
        next_lsn: u64,
        options: JournalOptions,
        observer: Option<Arc<dyn JournalObserver>>,
    ) -> io::Result<Journal> {
        if next_lsn == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "LSNs start at 1",
            ));
        }
        if options.segment_bytes < 1 << 16 || !options.segment_bytes.is_multiple_of(BLOCK as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "journal segments are whole blocks, at least 64 KiB",
            ));
        }
        let sealed = || {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{id} is sealed: this incarnation was taken over and may not write"),
            )
        };
        if segment::is_sealed(store.as_ref(), id)? {
            return Err(sealed());
        }
        let (existing, existing_bytes, segment, objects) = if store.positioned_io() {
            store.sync_dir(&id.dir())?;
            let existing = segment::list_segments(store.as_ref(), id)?
                .into_iter()
                .filter(|(l, _)| *l != next_lsn)
                .count() as u64;
            let mut aligned = AlignedBuf::new();
            // The header block is written now, so an empty journal is a valid one.
            let seg = open_segment(store.as_ref(), id, next_lsn, &options, &mut aligned)?;
            let bytes = existing * options.segment_bytes + SEGMENT_DATA_START;
            (existing + 1, bytes, Some((seg, aligned)), None)
        } else {
            let (next_seq, kept, marker) = existing_objects(store.as_ref(), id).map_err(|e| {
                if e.kind() == io::ErrorKind::PermissionDenied {
                    sealed()
                } else {
                    e
                }
            })?;
            let n = kept.len() as u64;
            let bytes = kept.iter().map(|k| k.bytes).sum();
            (n, bytes, None, Some((next_seq, kept, marker)))
        };
        let writer = segment.map(|(seg, aligned)| {
            Mutex::new(SegmentSink {
                seg,
                aligned,
                staging: Vec::with_capacity(1 << 20),
                spare: prepare_spare(&store, id, &options),
                flushing: Vec::with_capacity(1 << 20),
                observer: observer.clone(),
            })
        });
        let delay = std::env::var("KOCHAB_JOURNAL_DELAY_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(std::time::Duration::from_millis);
        let (durable_tx, _) = watch::channel(next_lsn - 1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                active: Vec::with_capacity(1 << 20),
                active_records: 0,
                active_last: next_lsn - 1,
                next_lsn,
                shutdown: false,
                urgent: false,
                asked_upto: 0,
                flusher_asked: false,
                pending_since: None,
                flusher_asleep: false,
                committer_running: false,
            }),
            wake_flusher: Condvar::new(),
            writer,
            delay,
            committer_wake: tokio::sync::Notify::new(),
            durable: AtomicU64::new(next_lsn - 1),
            durable_lock: Mutex::new(()),
            durable_cv: Condvar::new(),
            durable_tx,
            failed: AtomicBool::new(false),
            failure_tx: watch::channel(None).0,
            bytes: AtomicU64::new(existing_bytes),
            segments: AtomicU64::new(existing),
            store,
            options,
            id,
            seal_name: id.seal_name(),
        });
        let uploads = match objects {
            Some((next_seq, kept, marker)) => Some(Uploads::start(
                shared.store.clone(),
                id,
                next_seq,
                kept,
                marker,
                shared.clone(),
                observer,
            )?),
            None => None,
        };
        assert!(
            shared.writer.is_some() != uploads.is_some(),
            "a journal is in segments or in objects"
        );
        let (s, u) = (shared.clone(), uploads.clone());
        let flusher = std::thread::Builder::new()
            .name("journal-flush".into())
            .spawn(move || flusher_loop(s, u))?;
        Ok(Journal {
            shared,
            flusher: Mutex::new(Some(flusher)),
            uploads,
        })
    }

    /// Appends one record whose payload `write_payload` produces and returns its LSN.
    /// Records become durable in LSN order; callers that need order across threads (the
    /// engine) call this while holding their own lock.
    ///
    /// A payload larger than [`Journal::record_limit`] is not written: the journal fails
    /// (see [`Journal::failure`]), so that neither it nor any later record is ever
    /// acknowledged. Callers whose state already reflects the record (the engine applies
    /// before it journals) must therefore keep every record within the limit by
    /// construction; reaching it is a bug that stops the server cleanly.
    pub fn append_with(&self, write_payload: impl FnOnce(&mut Vec<u8>)) -> u64 {
        let lsn = self.append_deferred(write_payload);
        self.flush_now();
        lsn
    }

    /// Like `append_with`, but leaves waking the flusher to a later [`Journal::flush_now`]:
    /// a server appends a whole batch of operations, then starts one flush for all of them.
    pub fn append_deferred(&self, write_payload: impl FnOnce(&mut Vec<u8>)) -> u64 {
        let mut st = self.shared.state.lock();
        let lsn = st.next_lsn;
        st.next_lsn += 1;
        if st.pending_since.is_none() {
            // The flusher's clock starts (it flushes within `lazy_flush` unasked). Awake,
            // it looks at the clock within `lazy_flush` anyway: no wake-up needed.
            st.pending_since = Some(Instant::now());
            if st.flusher_asleep {
                st.flusher_asleep = false;
                self.shared.wake_flusher.notify_one();
            }
        }
        if self.failed() {
            // Nothing will be written any more: buffering would only grow memory.
            return lsn;
        }
        match encode_record_with(
            &mut st.active,
            lsn,
            self.shared.id.epoch,
            self.shared.record_limit(),
            write_payload,
        ) {
            Ok(_) => {
                st.active_records += 1;
                st.active_last = lsn;
            }
            Err(e) => {
                drop(st);
                self.shared.fail(format!("record {lsn} was refused: {e}"));
            }
        }
        lsn
    }

    /// The incarnation this journal belongs to.
    pub fn id(&self) -> JournalId {
        self.shared.id
    }

    /// Stops the journal for good: nothing appended from now on becomes durable, waiters
    /// are woken, subscribers of [`Journal::subscribe_failure`] learn `why` (for a server
    /// that finds itself fenced by other means than the seal, e.g. a refused manifest).
    pub fn fail_stop(&self, why: String) {
        self.shared.fail(why);
    }

    /// Largest record payload this journal accepts (at most
    /// [`crate::record::MAX_RECORD_BYTES`], and what fits in one segment).
    pub fn record_limit(&self) -> usize {
        self.shared.record_limit()
    }

    /// Flushes what is appended at once (someone waits for it), not within `lazy_flush`:
    /// the committer task writes it if one runs ([`Journal::committer`]), else the flusher
    /// thread. A server calls it after each batch of operations: the committer, woken on
    /// the same thread, runs once every other ready batch appended too, and one durable
    /// write covers them all.
    pub fn flush_now(&self) {
        let running = {
            let mut st = self.shared.state.lock();
            // Nothing waits in the active buffer (what was asked for is being written): a
            // flag left set would make the next lone record, which nobody waits for, skip
            // its lazy wait.
            if st.active.is_empty() {
                return;
            }
            st.asked_upto = st.active_last;
            if self.shared.options.held_flushes {
                return;
            }
            st.urgent = true;
            st.committer_running
        };
        if running {
            self.shared.committer_wake.notify_one();
        } else {
            self.shared.wake_flusher.notify_one();
        }
    }

    /// The committer task, to spawn on the runtime whose tasks append (a server's): on a
    /// runtime of one worker thread it writes what [`Journal::flush_now`] asks for on
    /// that thread, once every task ready to run there had its turn (one durable write
    /// for every batch that ran), so a group commit costs no hand-off to the flusher
    /// thread and no wake-up of it or of the worker. The thread blocks for the write (a
    /// fraction of a millisecond); it has nothing else ready to run by then, and what
    /// becomes ready meanwhile goes in the next write. It ends when the journal stops.
    ///
    /// With several worker threads it ends at once: the flusher thread writes while the
    /// workers run batches, and a write on a worker holds up the tasks queued behind it
    /// (measured with an uncapped server of two workers: half the creates per second). So
    /// it does for a journal as objects (each group is a PUT) and under
    /// `KOCHAB_JOURNAL_DELAY_MS`.
    pub fn committer(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        committer_loop(self.shared.clone())
    }

    /// Appends a record carrying `payload`.
    pub fn append(&self, payload: &[u8]) -> u64 {
        self.append_with(|o| o.extend_from_slice(payload))
    }

    /// Makes every record a flush was asked for ([`Journal::flush_now`]) durable, and
    /// waits for it (false if the journal failed). For a simulation, whose steps must not
    /// race the writer: with nothing appended meanwhile, what is durable afterwards does
    /// not depend on when the write ran (see [`JournalOptions::held_flushes`]).
    pub fn wait_asked(&self) -> bool {
        let upto = self.shared.state.lock().asked_upto;
        self.wait_durable(upto)
    }

    /// Highest LSN known durable.
    pub fn durable_lsn(&self) -> u64 {
        self.shared.durable.load(Ordering::Acquire)
    }

    /// LSN of the last record appended (durable or not).
    pub fn last_lsn(&self) -> u64 {
        self.shared.state.lock().next_lsn - 1
    }

    /// A channel that carries the durable LSN to async tasks.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.durable_tx.subscribe()
    }

    /// True once a write failed; the server must stop acknowledging.
    pub fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// Why the journal failed, once it has.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure_tx.borrow().clone()
    }

    /// A channel that carries the reason once the journal fails (a write, sync or segment
    /// error, or a refused record): the server stops serving when it changes.
    pub fn subscribe_failure(&self) -> watch::Receiver<Option<String>> {
        self.shared.failure_tx.subscribe()
    }

    /// Starts the write of the records up to `lsn` now, unless it runs already (what a
    /// waiter that cannot block, a task, asks before it waits on [`Journal::subscribe`]).
    pub fn ask_durable(&self, lsn: u64) {
        if self.durable_lsn() >= lsn {
            return;
        }
        let mut st = self.shared.state.lock();
        // Ask only for records still waiting in the active buffer. Those already taken by
        // a flush become durable without asking, and a flag left set would make the
        // flusher write the next records, which nobody waits for, at once: what is durable
        // would depend on whether the flush began before this call.
        let first_waiting = st.active_last + 1 - st.active_records;
        if st.active_records > 0 && first_waiting <= lsn {
            st.urgent = true;
            st.flusher_asked = true;
            self.shared.wake_flusher.notify_one();
        }
    }

    /// Blocks until `lsn` is durable. False if the journal failed first.
    pub fn wait_durable(&self, lsn: u64) -> bool {
        self.ask_durable(lsn);
        let mut g = self.shared.durable_lock.lock();
        loop {
            if self.durable_lsn() >= lsn {
                return true;
            }
            if self.failed() {
                return false;
            }
            self.shared.durable_cv.wait(&mut g);
        }
    }

    /// Approximate bytes of journal kept in the store.
    pub fn bytes(&self) -> u64 {
        match &self.uploads {
            Some(u) => u.kept().1,
            None => self.shared.bytes.load(Ordering::Relaxed),
        }
    }

    /// Segments (or journal objects) kept in the store.
    pub fn segments(&self) -> u64 {
        match &self.uploads {
            Some(u) => u.kept().0,
            None => self.shared.segments.load(Ordering::Relaxed),
        }
    }

    /// True if this journal is a sequence of objects (a store without positioned I/O).
    pub fn as_objects(&self) -> bool {
        self.uploads.is_some()
    }

    /// Deletes every segment (or journal object) whose records all have LSNs below
    /// `keep_from` (they are in every table's checkpoint). The segment being written (the
    /// newest object acknowledged) is never deleted.
    pub fn trim(&self, keep_from: u64) -> io::Result<u64> {
        if let Some(u) = &self.uploads {
            return u.trim(keep_from);
        }
        let store = &self.shared.store;
        let segs = segment::list_segments(store.as_ref(), self.shared.id)?;
        let mut removed = 0;
        for w in segs.windows(2) {
            let (_, name) = &w[0];
            let (next_first, _) = w[1];
            if next_first > keep_from {
                break;
            }
            store.delete(name)?;
            removed += 1;
        }
        if removed > 0 {
            store.sync_dir(&self.shared.id.dir())?;
            self.shared.segments.fetch_sub(removed, Ordering::Relaxed);
            self.shared.bytes.fetch_sub(
                removed * self.shared.options.segment_bytes,
                Ordering::Relaxed,
            );
        }
        Ok(removed)
    }

    /// Writes everything appended so far and stops the flusher (and the committer).
    pub fn shutdown(&self) {
        self.shared.state.lock().shutdown = true;
        self.shared.wake_flusher.notify_all();
        self.shared.committer_wake.notify_one();
        if let Some(h) = self.flusher.lock().take() {
            let _ = h.join();
        }
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Opens the segment that starts at `first_lsn` (the pre-zeroed spare if it is ready,
/// else a new zero-filled object) and writes its header block. Zeros matter: a block no
/// write reached reads as a clean end. Either way the object gets its segment name only
/// once it is zero-filled to full length, so a short segment is always damage. The rename
/// is made durable before any record in the segment can be acknowledged.
fn open_segment(
    store: &dyn ObjectStore,
    id: JournalId,
    first_lsn: u64,
    options: &JournalOptions,
    aligned: &mut AlignedBuf,
) -> io::Result<Segment> {
    let name = segment_name(id, first_lsn);
    let spare = id.spare_name();
    let spare_ready =
        store.open(&spare, false).ok().and_then(|o| o.len().ok()) == Some(options.segment_bytes);
    if spare_ready {
        store.rename(&spare, &name)?;
    } else {
        let tmp = next_tmp_name(id);
        segment::write_zeroed(store, &tmp, options.segment_bytes)?;
        store.rename(&tmp, &name)?;
    }
    store.sync_dir(&id.dir())?;
    let obj = store.open(&name, false)?;
    let direct = if options.fsync {
        store.open_sync_direct(&name)?
    } else {
        None
    };
    let mut seg = Segment {
        obj,
        direct,
        pos: 0,
        tail: Vec::new(),
    };
    let mut header = vec![0u8; BLOCK];
    header[..SEGMENT_HEADER_BYTES]
        .copy_from_slice(&encode_header(first_lsn, options.segment_bytes));
    write_blocks(&seg, aligned.fill(&header), 0, options.fsync)?;
    seg.pos = SEGMENT_DATA_START;
    Ok(seg)
}

/// Where a segment is zero-filled when no spare is ready (never at the same time as the
/// spare's own temporary: the flusher waits for the spare's preparation first).
pub(crate) fn next_tmp_name(id: JournalId) -> String {
    format!("{}/next.tmp", id.dir())
}

/// Where the spare is zero-filled before it gets its name.
pub(crate) fn spare_tmp_name(id: JournalId) -> String {
    format!("{}/spare.tmp", id.dir())
}

/// Prepares the zero-filled spare so that a rollover rarely waits: in the background (the
/// handle to join before the next rollover), or here with
/// [`JournalOptions::spare_inline`].
fn prepare_spare(
    store: &Arc<dyn ObjectStore>,
    id: JournalId,
    options: &JournalOptions,
) -> Option<JoinHandle<()>> {
    let bytes = options.segment_bytes;
    if options.spare_inline {
        make_spare(store.as_ref(), id, bytes);
        return None;
    }
    let store = store.clone();
    Some(std::thread::spawn(move || {
        make_spare(store.as_ref(), id, bytes)
    }))
}

/// Zero-fills the spare segment unless it is ready. A failure is no error: the rollover
/// then zero-fills its segment itself.
fn make_spare(store: &dyn ObjectStore, id: JournalId, bytes: u64) {
    let spare = id.spare_name();
    if store.open(&spare, false).ok().and_then(|o| o.len().ok()) == Some(bytes) {
        return;
    }
    let tmp = spare_tmp_name(id);
    let result = segment::write_zeroed(store, &tmp, bytes).and_then(|_| store.rename(&tmp, &spare));
    if let Err(e) = result {
        tracing::warn!("could not prepare a spare journal segment: {e}");
    }
}

/// Writes whole blocks durably (directly if possible, else write + fdatasync).
fn write_blocks(seg: &Segment, blocks: &[u8], offset: u64, fsync: bool) -> io::Result<()> {
    debug_assert!(offset.is_multiple_of(BLOCK as u64) && blocks.len().is_multiple_of(BLOCK));
    match &seg.direct {
        Some(d) => d.write_at(blocks, offset),
        None => {
            seg.obj.write_at(blocks, offset)?;
            if fsync { seg.obj.sync_data() } else { Ok(()) }
        }
    }
}

/// Writes whole records at the segment's position: from the start of the partly filled
/// block, whose earlier bytes are rewritten unchanged, to the end of the last block (the
/// zeros after the records mark the end). Returns the bytes written.
fn write_records(
    seg: &mut Segment,
    records: &[u8],
    staging: &mut Vec<u8>,
    aligned: &mut AlignedBuf,
    fsync: bool,
) -> io::Result<u64> {
    let block_start = seg.pos - seg.tail.len() as u64;
    staging.clear();
    staging.extend_from_slice(&seg.tail);
    staging.extend_from_slice(records);
    let blocks = aligned.fill(staging);
    write_blocks(seg, blocks, block_start, fsync)?;
    seg.pos += records.len() as u64;
    let keep = staging.len() % BLOCK;
    seg.tail.clear();
    seg.tail.extend_from_slice(&staging[staging.len() - keep..]);
    Ok(blocks.len() as u64)
}

/// The next seq, the acknowledged objects and the newest start marker of journal `id` on a
/// store of whole objects: none for a new incarnation. A journal restarted (tests do) goes
/// on after its chain, which must be whole: one that holds a fence, or objects past a gap,
/// was taken over (`PermissionDenied`).
fn existing_objects(store: &dyn ObjectStore, id: JournalId) -> io::Result<(u64, Vec<Kept>, u64)> {
    let listing = Listing::read(store, id)?;
    let marker = listing.starts.last().map_or(0, |(s, _)| *s);
    let taken = || {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{id} holds a fence or objects past a gap"),
        )
    };
    if !listing.beyond().is_empty() {
        return Err(taken());
    }
    let chain = listing.chain();
    let names: Vec<String> = chain.iter().map(|(_, n)| n.clone()).collect();
    let mut kept = Vec::with_capacity(names.len());
    for ((seq, name), data) in chain.iter().zip(store.get_many(&names)?) {
        let data = data.ok_or_else(|| io::Error::other(format!("{name} vanished")))?;
        let bytes = data.len() as u64;
        match objects::decode(*seq, id.epoch, &data) {
            Ok(Content::Records {
                first_lsn, records, ..
            }) => kept.push(Kept {
                seq: *seq,
                last_lsn: first_lsn + records as u64 - 1,
                bytes,
            }),
            Ok(Content::Fence) => return Err(taken()),
            Err(why) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{name}: {why}"),
                ));
            }
        }
    }
    Ok((listing.first_gap(), kept, marker))
}

impl SegmentSink {
    /// Writes `records` durably into the segments (rolling over as they fill), checks the
    /// seal and publishes `last` as durable. False if the journal failed.
    fn commit(
        &mut self,
        shared: &Shared,
        records: &[u8],
        last: u64,
        count: u64,
        waited: f64,
    ) -> bool {
        let seg_bytes = shared.options.segment_bytes;
        let started = Instant::now();
        let mut written = 0u64;
        let mut result: io::Result<()> = Ok(());
        let mut off = 0;
        while off < records.len() {
            // Whole records that fit in this segment.
            let mut end = off;
            while end < records.len() {
                let next = end + record_len(&records[end..]);
                if self.seg.pos + (next - off) as u64 > seg_bytes {
                    break;
                }
                end = next;
            }
            if end > off {
                match write_records(
                    &mut self.seg,
                    &records[off..end],
                    &mut self.staging,
                    &mut self.aligned,
                    shared.options.fsync,
                ) {
                    Ok(n) => written += n,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                off = end;
                continue;
            }
            // The next record starts a new segment.
            if let Some(h) = self.spare.take() {
                let _ = h.join();
            }
            let first = objects::record_lsn(&records[off..]);
            match open_segment(
                shared.store.as_ref(),
                shared.id,
                first,
                &shared.options,
                &mut self.aligned,
            ) {
                Ok(s) => self.seg = s,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            shared.segments.fetch_add(1, Ordering::Relaxed);
            self.spare = prepare_spare(&shared.store, shared.id, &shared.options);
            if self.seg.pos + record_len(&records[off..]) as u64 > seg_bytes {
                result = Err(io::Error::other(
                    "a journal record does not fit in an empty segment",
                ));
                break;
            }
        }
        if let Err(e) = result {
            // A journal that cannot write must not acknowledge anything more (fail-stop:
            // the server tells its clients and exits).
            shared.fail(format!("write failed: {e}"));
            return false;
        }
        // Durable, but not yet acknowledged: only if nobody has sealed the journal since
        // (see the module comment for why this order makes fencing exact).
        let sealed = match shared.options.breaks.has(Break::Fencing) {
            true => Ok(false),
            false => shared.store.exists(&shared.seal_name),
        };
        match sealed {
            Ok(false) => {}
            Ok(true) => {
                shared.fail(format!(
                    "{} was sealed: another server took over this incarnation's tables",
                    shared.id
                ));
                return false;
            }
            Err(e) => {
                shared.fail(format!("cannot check the seal of {}: {e}", shared.id));
                return false;
            }
        }
        if let Some(o) = &self.observer {
            o.on_commit(count, written, started.elapsed().as_secs_f64(), waited);
        }
        shared
            .bytes
            .fetch_add(records.len() as u64, Ordering::Relaxed);
        shared.publish(last);
        true
    }
}

/// See [`Journal::committer`].
async fn committer_loop(shared: Arc<Shared>) {
    let Some(writer) = shared.writer.as_ref() else {
        return;
    };
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    if shared.delay.is_some() || workers != 1 {
        return;
    }
    shared.state.lock().committer_running = true;
    // However this task ends (the journal stops, or the runtime drops it), the flusher
    // thread takes over what is awaited.
    let _stop = CommitterStop(&shared);
    loop {
        if shared.state.lock().shutdown || shared.failed.load(Ordering::Acquire) {
            return;
        }
        while shared.awaited() {
            // Every task ready to run on this thread (batches of other connections)
            // appends first; those that become ready during the write go in the next.
            behind_ready_tasks().await;
            shared.commit_segments(&mut writer.lock());
        }
        shared.committer_wake.notified().await;
    }
}

/// Lets every task already queued on this thread run first: the caller goes to the back
/// of the run queue. (`tokio::task::yield_now` waits for the thread to run out of tasks or
/// for its next look at the I/O driver, which on a busy server delays every commit.)
async fn behind_ready_tasks() {
    let mut queued = false;
    std::future::poll_fn(|cx| {
        if queued {
            return std::task::Poll::Ready(());
        }
        queued = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await
}

/// Ends the committer: the flusher thread takes over.
struct CommitterStop<'a>(&'a Arc<Shared>);

impl Drop for CommitterStop<'_> {
    fn drop(&mut self) {
        let shared = self.0;
        shared.state.lock().committer_running = false;
        shared.wake_flusher.notify_one();
    }
}

/// The flusher thread: writes records the committer task does not (those answered early)
/// within `lazy_flush` of the first, or at once when asked ([`Journal::flush_now`]); all
/// of them where no committer runs; for a journal as objects, every group.
fn flusher_loop(shared: Arc<Shared>, uploads: Option<Arc<Uploads>>) {
    let mut flushing: Vec<u8> = Vec::new();
    let lazy = shared.options.lazy_flush;
    let has_room = || uploads.as_ref().is_none_or(|u| u.has_room());
    // `next_lsn` when the flusher last found nothing to write.
    let mut seen = 0u64;
    loop {
        {
            let mut st = shared.state.lock();
            loop {
                if st.shutdown || shared.failed.load(Ordering::Acquire) {
                    break;
                }
                let age = st.pending_since.map(|t| t.elapsed());
                match age {
                    // Nothing to write (or others wrote it): watch for one `lazy_flush` while
                    // records keep coming, then sleep until the next one.
                    _ if st.active.is_empty() && st.next_lsn == seen => {
                        st.flusher_asleep = true;
                        shared.wake_flusher.wait(&mut st);
                        st.flusher_asleep = false;
                    }
                    _ if st.active.is_empty() => {
                        seen = st.next_lsn;
                        shared.wake_flusher.wait_for(&mut st, lazy);
                    }
                    // Every PUT slot is taken: the group grows until one returns.
                    _ if !has_room() => shared.wake_flusher.wait(&mut st),
                    // Awaited records are the committer's, while it runs; should it not
                    // write them within `lazy_flush`, this thread does.
                    Some(a)
                        if !st.flusher_asked
                            && (!st.urgent || st.committer_running)
                            && a < lazy =>
                    {
                        shared.wake_flusher.wait_for(&mut st, lazy - a);
                    }
                    _ => break,
                }
            }
            if let Some(d) = shared.delay {
                drop(st);
                std::thread::sleep(d);
                st = shared.state.lock();
            }
            if st.active.is_empty() || shared.failed.load(Ordering::Acquire) {
                break;
            }
        }
        match (&shared.writer, &uploads) {
            (Some(writer), _) => {
                shared.commit_segments(&mut writer.lock());
            }
            (None, Some(u)) => {
                let waited = {
                    let mut st = shared.state.lock();
                    std::mem::swap(&mut st.active, &mut flushing);
                    st.urgent = false;
                    st.flusher_asked = false;
                    st.active_records = 0;
                    st.pending_since
                        .take()
                        .map_or(0.0, |t| t.elapsed().as_secs_f64())
                };
                u.submit(&flushing, waited);
                flushing.clear();
                if flushing.capacity() > 64 << 20 {
                    flushing.shrink_to(1 << 20);
                }
            }
            (None, None) => unreachable!("a journal is in segments or in objects"),
        }
    }
    // Stops after the last group: waits for the spare's preparation, or for the PUTs in
    // flight.
    if let Some(writer) = &shared.writer
        && let Some(h) = writer.lock().spare.take()
    {
        let _ = h.join();
    }
    if let Some(u) = uploads {
        u.finish();
    }
}

//! Group commit with double buffering. Appenders add records to the active buffer under a
//! short lock and get their LSN; one writer thread swaps the buffers, writes the full one
//! and fdatasyncs it, so one fsync covers every record that arrived while the previous one
//! ran. Durability is published as the highest durable LSN, both to threads (a condvar)
//! and to async tasks (a watch channel).

use crate::record::{RECORD_HEADER_BYTES, encode_record_with, record_len};
use crate::segment::{self, SEGMENT_HEADER_BYTES, SPARE_NAME, encode_header, segment_name};
use kochab_store::{Object, ObjectStore};
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
    /// fdatasync before a record counts as durable. Off is the named "buffered" mode: a
    /// crash of the machine (not of the process) may lose acknowledged operations.
    pub fsync: bool,
}

impl Default for JournalOptions {
    fn default() -> Self {
        // 32 MiB: about 200k create records, a few tenths of a second of replay.
        JournalOptions {
            segment_bytes: 32 << 20,
            fsync: true,
        }
    }
}

/// Observations of the writer, for metrics.
pub trait JournalObserver: Send + Sync {
    /// One group commit: records and bytes written, and how long the sync took.
    fn on_commit(&self, records: u64, bytes: u64, sync_seconds: f64);
}

struct State {
    active: Vec<u8>,
    active_records: u64,
    /// LSN of the last record in `active`.
    active_last: u64,
    next_lsn: u64,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    wake_writer: Condvar,
    durable: AtomicU64,
    durable_cv: Condvar,
    durable_lock: Mutex<()>,
    durable_tx: watch::Sender<u64>,
    failed: AtomicBool,
    /// Bytes in segments before the current one plus the current one's used part.
    bytes: AtomicU64,
    segments: AtomicU64,
    /// Serializes taking and adding recycled segments.
    recycle_lock: Mutex<()>,
}

/// Trimmed segments kept for reuse.
const RECYCLE_KEEP: usize = 4;

/// The journal of one server.
pub struct Journal {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
    store: Arc<dyn ObjectStore>,
    options: JournalOptions,
}

/// Where the writer is in the current segment.
struct SegmentCursor {
    obj: Arc<dyn Object>,
    pos: u64,
}

impl Journal {
    /// Starts a journal whose next record gets `next_lsn`, in a fresh segment (after
    /// recovery nothing is ever appended behind a cut tail).
    pub fn start(
        store: Arc<dyn ObjectStore>,
        next_lsn: u64,
        options: JournalOptions,
        observer: Option<Arc<dyn JournalObserver>>,
    ) -> io::Result<Journal> {
        assert!(next_lsn >= 1, "LSNs start at 1");
        assert!(
            options.segment_bytes >= 1 << 16,
            "segments below 64 KiB make no sense"
        );
        store.sync_dir(segment::JOURNAL_DIR)?;
        let existing = segment::list_segments(store.as_ref())?;
        let cursor = open_segment(store.as_ref(), next_lsn, &options, &Mutex::new(()))?;
        let (durable_tx, _) = watch::channel(next_lsn - 1);
        let used: u64 =
            existing.iter().filter(|(l, _)| *l != next_lsn).count() as u64 * options.segment_bytes;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                active: Vec::with_capacity(1 << 20),
                active_records: 0,
                active_last: next_lsn - 1,
                next_lsn,
                shutdown: false,
            }),
            wake_writer: Condvar::new(),
            durable: AtomicU64::new(next_lsn - 1),
            durable_cv: Condvar::new(),
            durable_lock: Mutex::new(()),
            durable_tx,
            failed: AtomicBool::new(false),
            bytes: AtomicU64::new(used + SEGMENT_HEADER_BYTES as u64),
            segments: AtomicU64::new(
                existing.iter().filter(|(l, _)| *l != next_lsn).count() as u64 + 1,
            ),
            recycle_lock: Mutex::new(()),
        });
        let writer_shared = shared.clone();
        let writer_store = store.clone();
        let writer_opts = options.clone();
        let handle = std::thread::Builder::new()
            .name("journal-writer".into())
            .spawn(move || {
                writer_loop(writer_shared, writer_store, writer_opts, cursor, observer)
            })?;
        Ok(Journal {
            shared,
            writer: Mutex::new(Some(handle)),
            store,
            options,
        })
    }

    /// Appends one record whose payload `write_payload` produces and returns its LSN.
    /// Records become durable in LSN order; callers that need order across threads (the
    /// engine) call this while holding their own lock.
    pub fn append_with(&self, write_payload: impl FnOnce(&mut Vec<u8>)) -> u64 {
        let mut st = self.shared.state.lock();
        let lsn = st.next_lsn;
        st.next_lsn += 1;
        let was_empty = st.active.is_empty();
        encode_record_with(&mut st.active, lsn, write_payload);
        st.active_records += 1;
        st.active_last = lsn;
        drop(st);
        if was_empty {
            self.shared.wake_writer.notify_one();
        }
        lsn
    }

    /// Appends a record carrying `payload`.
    pub fn append(&self, payload: &[u8]) -> u64 {
        self.append_with(|o| o.extend_from_slice(payload))
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

    /// True once a write or sync failed; the server must stop acknowledging.
    pub fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// Blocks until `lsn` is durable. False if the journal failed first.
    pub fn wait_durable(&self, lsn: u64) -> bool {
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
        self.shared.bytes.load(Ordering::Relaxed)
    }

    /// Segments kept in the store.
    pub fn segments(&self) -> u64 {
        self.shared.segments.load(Ordering::Relaxed)
    }

    /// Retires every segment whose records all have LSNs below `keep_from` (they are in
    /// every table's checkpoint): a few are kept for reuse, the rest deleted. The segment
    /// being written is never touched.
    pub fn trim(&self, keep_from: u64) -> io::Result<u64> {
        let segs = segment::list_segments(self.store.as_ref())?;
        let _pool = self.shared.recycle_lock.lock();
        let mut recycled = segment::list_recycled(self.store.as_ref())?.len();
        let mut removed = 0;
        for w in segs.windows(2) {
            let (first, name) = &w[0];
            let (next_first, _) = w[1];
            if next_first > keep_from {
                break;
            }
            let full_size = self
                .store
                .open(name, false)
                .and_then(|o| o.len())
                .is_ok_and(|l| l == self.options.segment_bytes);
            if recycled < RECYCLE_KEEP && full_size {
                self.store
                    .rename(name, &format!("{}{first:020}.seg", segment::RECYCLE_PREFIX))?;
                recycled += 1;
            } else {
                self.store.delete(name)?;
            }
            removed += 1;
        }
        if removed > 0 {
            self.store.sync_dir(segment::JOURNAL_DIR)?;
            self.shared.segments.fetch_sub(removed, Ordering::Relaxed);
            self.shared
                .bytes
                .fetch_sub(removed * self.options.segment_bytes, Ordering::Relaxed);
        }
        Ok(removed)
    }

    /// Writes and syncs everything appended so far, stops the writer thread.
    pub fn shutdown(&self) {
        self.shared.state.lock().shutdown = true;
        self.shared.wake_writer.notify_one();
        if let Some(h) = self.writer.lock().take() {
            let _ = h.join();
        }
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Opens the segment that starts at `first_lsn`: a recycled segment if there is one, else
/// the pre-zeroed spare, else a new zero-filled object. The rename is made durable before
/// any record in it is acknowledged. Leftover records of a recycled segment have lower LSNs
/// and every write ends in a zero header, so readers stop cleanly where new data ends.
fn open_segment(
    store: &dyn ObjectStore,
    first_lsn: u64,
    options: &JournalOptions,
    recycle_lock: &Mutex<()>,
) -> io::Result<SegmentCursor> {
    let name = segment_name(first_lsn);
    let fits = |n: &str| {
        store.open(n, false).ok().and_then(|o| o.len().ok()) == Some(options.segment_bytes)
    };
    let recycled = {
        let _g = recycle_lock.lock();
        let found = segment::list_recycled(store)?.into_iter().find(|n| fits(n));
        if let Some(r) = &found {
            store.rename(r, &name)?;
        }
        found.is_some()
    };
    if !recycled {
        if fits(SPARE_NAME) {
            store.rename(SPARE_NAME, &name)?;
        } else {
            segment::write_zeroed(store, &name, options.segment_bytes)?;
        }
    }
    store.sync_dir(segment::JOURNAL_DIR)?;
    let obj = store.open(&name, false)?;
    obj.write_at(&encode_header(first_lsn), 0)?;
    obj.write_at(&[0u8; RECORD_HEADER_BYTES], SEGMENT_HEADER_BYTES as u64)?;
    Ok(SegmentCursor {
        obj,
        pos: SEGMENT_HEADER_BYTES as u64,
    })
}

/// Prepares the zero-filled spare in the background, unless a recycled segment or a
/// spare is already waiting, so that rolling over never waits for zero-filling.
fn prepare_spare(store: Arc<dyn ObjectStore>, bytes: u64) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let has_recycled = segment::list_recycled(store.as_ref()).is_ok_and(|r| !r.is_empty());
        let has_spare = store
            .open(SPARE_NAME, false)
            .ok()
            .and_then(|o| o.len().ok())
            == Some(bytes);
        if has_recycled || has_spare {
            return;
        }
        let tmp = "journal/spare.tmp";
        let result = segment::write_zeroed(store.as_ref(), tmp, bytes)
            .and_then(|_| store.rename(tmp, SPARE_NAME));
        if let Err(e) = result {
            tracing::warn!("could not prepare a spare journal segment: {e}");
        }
    })
}

fn writer_loop(
    shared: Arc<Shared>,
    store: Arc<dyn ObjectStore>,
    options: JournalOptions,
    mut cursor: SegmentCursor,
    observer: Option<Arc<dyn JournalObserver>>,
) {
    let mut flushing: Vec<u8> = Vec::with_capacity(1 << 20);
    let mut spare = Some(prepare_spare(store.clone(), options.segment_bytes));
    loop {
        let (last, records) = {
            let mut st = shared.state.lock();
            while st.active.is_empty() && !st.shutdown {
                shared.wake_writer.wait(&mut st);
            }
            if st.active.is_empty() {
                break;
            }
            std::mem::swap(&mut st.active, &mut flushing);
            let records = std::mem::take(&mut st.active_records);
            (st.active_last, records)
        };
        let started = Instant::now();
        let result = write_buffer(
            &shared,
            &store,
            &options,
            &mut cursor,
            &flushing,
            &mut spare,
        )
        .and_then(|()| {
            if options.fsync {
                cursor.obj.sync_data()
            } else {
                Ok(())
            }
        });
        if let Err(e) = result {
            // A journal that cannot write must not acknowledge anything more.
            tracing::error!("journal write failed: {e}; no further operation will be acknowledged");
            shared.failed.store(true, Ordering::Release);
            let _g = shared.durable_lock.lock();
            shared.durable_cv.notify_all();
            return;
        }
        if let Some(o) = &observer {
            o.on_commit(
                records,
                flushing.len() as u64,
                started.elapsed().as_secs_f64(),
            );
        }
        shared
            .bytes
            .fetch_add(flushing.len() as u64, Ordering::Relaxed);
        flushing.clear();
        if flushing.capacity() > 64 << 20 {
            flushing.shrink_to(1 << 20);
        }
        shared.durable.store(last, Ordering::Release);
        shared.durable_tx.send_replace(last);
        let _g = shared.durable_lock.lock();
        shared.durable_cv.notify_all();
    }
    if let Some(h) = spare.take() {
        let _ = h.join();
    }
}

/// Writes whole records, moving to a new segment when the next one does not fit.
fn write_buffer(
    shared: &Shared,
    store: &Arc<dyn ObjectStore>,
    options: &JournalOptions,
    cursor: &mut SegmentCursor,
    buf: &[u8],
    spare: &mut Option<JoinHandle<()>>,
) -> io::Result<()> {
    let mut run_start = 0;
    let mut off = 0;
    while off < buf.len() {
        let len = record_len(&buf[off..]);
        debug_assert!(len >= RECORD_HEADER_BYTES && off + len <= buf.len());
        // Keep a zero header's room at the end so a reader always finds a clean end.
        if cursor.pos + (off - run_start + len) as u64 + RECORD_HEADER_BYTES as u64
            > options.segment_bytes
        {
            if off > run_start {
                write_run(cursor, &buf[run_start..off])?;
            }
            if options.fsync {
                cursor.obj.sync_data()?;
            }
            if let Some(h) = spare.take() {
                let _ = h.join();
            }
            let first = u64::from_le_bytes(buf[off + 8..off + 16].try_into().expect("8 bytes"));
            *cursor = open_segment(store.as_ref(), first, options, &shared.recycle_lock)?;
            shared.segments.fetch_add(1, Ordering::Relaxed);
            *spare = Some(prepare_spare(store.clone(), options.segment_bytes));
            run_start = off;
        }
        off += len;
    }
    if off > run_start {
        write_run(cursor, &buf[run_start..off])?;
    }
    Ok(())
}

/// Writes whole records at the cursor, followed by a zero header that marks the end (the
/// next write overwrites it), and advances the cursor past the records.
fn write_run(cursor: &mut SegmentCursor, records: &[u8]) -> io::Result<()> {
    cursor.obj.write_at(records, cursor.pos)?;
    cursor.obj.write_at(
        &[0u8; RECORD_HEADER_BYTES],
        cursor.pos + records.len() as u64,
    )?;
    cursor.pos += records.len() as u64;
    Ok(())
}

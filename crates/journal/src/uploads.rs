//! Journal objects in flight: the flusher hands each group commit over as one object (or a
//! few), up to [`PUTS_IN_FLIGHT_MAX`] PUTs run at once on uploader threads, and they are
//! acknowledged in seq order, whatever order they complete in. So a journal on a store
//! with milliseconds of latency per request commits a group every fraction of a PUT's
//! latency instead of one group per PUT, and a record is durable only once the PUT holding
//! it and every earlier one returned (see `objects` for the chain this makes).

use crate::objects::{self, OBJECT_BODY_BYTES_MAX, encode_records, object_name, record_lsn};
use crate::observer::JournalObserver;
use crate::record::record_len;
use crate::segment::JournalId;
use kochab_store::ObjectStore;
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

/// PUTs of journal objects in flight at once. With k in flight a group leaves about every
/// k-th of a PUT's latency, so an operation waits about (1 + 1/2k) PUT latencies; but an
/// engine's latency grows with the PUTs it is given at once, the more so when it is short
/// of CPU. Measured on Ceph RGW here (one OSD, on the same two cores as server and clients;
/// `kochab bench --clients 256`, creates/s, mean PUT latency): under other builds' load
/// (load average 11) 1 in flight 31k (3.2-4.2 ms), 2: 30-34k (3.7-4.3 ms), 3: 30k, 4: 26k
/// (5.1 ms), 8: 22k (7.1 ms), 16: 16k (10.8 ms); quiet, 1: 38-39k, 2: 29-34k, 3: 31k, 4:
/// 27k; with a slow disk (4 KiB dsync 3 ms), 3: 12-15k (12 ms), 8: 11k, 16: 9k. Two keep
/// more than one PUT in flight (an engine with parallel capacity to spare, as AWS S3 has,
/// gains from it) at close to the best rate of this one.
pub const PUTS_IN_FLIGHT_MAX: usize = 2;
/// Object buffers kept for reuse between PUTs (each up to a group commit's size).
const SPARE_BUFFERS_MAX: usize = PUTS_IN_FLIGHT_MAX;
/// Pauses between tries of a journal PUT the store did not take: short at first (a lost
/// connection is often back at once), doubling up to a pause that still notices a
/// restarted store within a second or two (Ceph RGW restarts in 2-3 s here).
const STALL_PAUSE_MIN: std::time::Duration = std::time::Duration::from_millis(50);
const STALL_PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(1);
/// How often a stalled journal says it is still waiting.
const STALL_REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// What the uploads tell the journal.
pub(crate) trait Acks: Send + Sync {
    /// Every record up to `lsn` is durable (called in LSN order).
    fn durable(&self, lsn: u64);
    /// A PUT failed or was fenced: nothing more may be acknowledged.
    fn fail(&self, why: String);
    /// A PUT finished: the flusher may cut the next group.
    fn room(&self);
}

/// A journal object acknowledged and still in the store.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Kept {
    pub seq: u64,
    pub last_lsn: u64,
    pub bytes: u64,
}

struct Job {
    seq: u64,
    data: Vec<u8>,
    last_lsn: u64,
    records: u64,
    waited: f64,
}

struct Done {
    last_lsn: u64,
    records: u64,
    bytes: u64,
    put_seconds: f64,
    waited: f64,
}

struct State {
    queue: VecDeque<Job>,
    next_seq: u64,
    /// Completed out of order, waiting for an earlier one.
    done: BTreeMap<u64, Done>,
    /// The lowest seq not acknowledged yet.
    next_ack: u64,
    kept: VecDeque<Kept>,
    /// The newest start marker written (0: none).
    start_marker: u64,
    spare: Vec<Vec<u8>>,
    failed: bool,
    /// `finish` was called: a PUT the store did not take is not retried.
    stopping: bool,
    stop: bool,
}

/// The journal objects of one incarnation being written.
pub(crate) struct Uploads {
    store: Arc<dyn ObjectStore>,
    id: JournalId,
    state: Mutex<State>,
    /// Wakes uploaders (work queued, or stop).
    work: Condvar,
    /// Wakes `finish` (an object completed).
    drained: Condvar,
    /// Objects handed over and not yet completed.
    in_flight: AtomicUsize,
    acks: Arc<dyn Acks>,
    observer: Option<Arc<dyn JournalObserver>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// One trim at a time.
    trimming: Mutex<()>,
}

impl Uploads {
    /// Starts the uploaders of journal `id`, whose next object is `next_seq` and whose
    /// acknowledged objects in the store are `kept` (oldest first).
    pub fn start(
        store: Arc<dyn ObjectStore>,
        id: JournalId,
        next_seq: u64,
        kept: Vec<Kept>,
        start_marker: u64,
        acks: Arc<dyn Acks>,
        observer: Option<Arc<dyn JournalObserver>>,
    ) -> io::Result<Arc<Uploads>> {
        let u = Arc::new(Uploads {
            store,
            id,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                next_seq,
                done: BTreeMap::new(),
                next_ack: next_seq,
                kept: kept.into(),
                start_marker,
                spare: Vec::new(),
                failed: false,
                stopping: false,
                stop: false,
            }),
            work: Condvar::new(),
            drained: Condvar::new(),
            in_flight: AtomicUsize::new(0),
            acks,
            observer,
            threads: Mutex::new(Vec::new()),
            trimming: Mutex::new(()),
        });
        for k in 0..PUTS_IN_FLIGHT_MAX {
            let me = u.clone();
            let h = std::thread::Builder::new()
                .name(format!("journal-put-{k}"))
                .spawn(move || me.uploader())?;
            u.threads.lock().push(h);
        }
        Ok(u)
    }

    /// True if another object may be handed over without exceeding the PUTs in flight.
    pub fn has_room(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) < PUTS_IN_FLIGHT_MAX
    }

    /// Hands over a group commit (whole records, in LSN order) as one object, or several
    /// of at most [`OBJECT_BODY_BYTES_MAX`] bytes each. `waited`: how long its first
    /// record waited.
    pub fn submit(&self, records: &[u8], waited: f64) {
        let mut off = 0;
        while off < records.len() {
            let first = record_lsn(&records[off..]);
            let (mut end, mut last, mut n) = (off, first, 0u32);
            while end < records.len() {
                let len = record_len(&records[end..]);
                if end > off && end + len - off > OBJECT_BODY_BYTES_MAX {
                    break;
                }
                last = record_lsn(&records[end..]);
                end += len;
                n += 1;
            }
            let mut st = self.state.lock();
            let seq = st.next_seq;
            st.next_seq += 1;
            let mut data = st.spare.pop().unwrap_or_default();
            data.clear();
            encode_records(&mut data, seq, self.id.epoch, first, n, &records[off..end]);
            st.queue.push_back(Job {
                seq,
                data,
                last_lsn: last,
                records: n as u64,
                waited,
            });
            self.in_flight.fetch_add(1, Ordering::AcqRel);
            drop(st);
            self.work.notify_one();
            off = end;
        }
    }

    fn uploader(&self) {
        loop {
            let job = {
                let mut st = self.state.lock();
                loop {
                    if let Some(j) = st.queue.pop_front() {
                        break j;
                    }
                    if st.stop {
                        return;
                    }
                    self.work.wait(&mut st);
                }
            };
            let started = Instant::now();
            let result = self.put_until_settled(&job);
            let put_seconds = started.elapsed().as_secs_f64();
            let mut st = self.state.lock();
            let bytes = job.data.len() as u64;
            if st.spare.len() < SPARE_BUFFERS_MAX
                && job.data.capacity() <= 2 * OBJECT_BODY_BYTES_MAX
            {
                st.spare.push(job.data);
            }
            match result {
                Ok(()) => {
                    st.done.insert(
                        job.seq,
                        Done {
                            last_lsn: job.last_lsn,
                            records: job.records,
                            bytes,
                            put_seconds,
                            waited: job.waited,
                        },
                    );
                    self.acknowledge(&mut st);
                }
                Err(None) => {}
                Err(Some(e)) => {
                    let first = !st.failed;
                    st.failed = true;
                    drop(st);
                    if first {
                        self.acks.fail(self.why(job.seq, &e));
                    }
                    st = self.state.lock();
                }
            }
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            drop(st);
            self.drained.notify_all();
            self.acks.room();
        }
    }

    /// Creates the job's object, waiting out a store that cannot be reached: a store
    /// restarting (every Ceph daemon killed, an S3 endpoint briefly gone) stalls the
    /// journal, and with it every reply waiting to be durable, but never ends it. Only an
    /// answer that cannot change by waiting ends the journal: the name taken by another
    /// writer (a fence), or a request the store refuses as malformed. `Err(None)`: the
    /// journal failed meanwhile (it writes nothing more: it would never be acknowledged).
    fn put_until_settled(&self, job: &Job) -> Result<(), Option<io::Error>> {
        let name = object_name(self.id, job.seq);
        let mut pause = STALL_PAUSE_MIN;
        let mut stalled_since: Option<Instant> = None;
        let mut last_report = Instant::now();
        let mut tries = 0u32;
        loop {
            {
                let st = self.state.lock();
                // A stop gives up on a store that did not take a try (it is shutting
                // down; what is not acknowledged is simply not durable).
                if st.failed || (st.stopping && tries > 0) {
                    return Err(None);
                }
            }
            tries += 1;
            let e = match self.store.create_if_absent(&name, &job.data) {
                Ok(()) => {
                    if let Some(t) = stalled_since {
                        tracing::warn!(
                            "journal {}: the store answers again; object {} written after \
                             {:.1} s",
                            self.id,
                            job.seq,
                            t.elapsed().as_secs_f64()
                        );
                    }
                    return Ok(());
                }
                Err(e) => e,
            };
            match e.kind() {
                // Ours after all if it holds exactly our bytes: an earlier try of this
                // create succeeded but its answer was lost (the store died before
                // replying). A fence object never holds a records object's bytes.
                io::ErrorKind::AlreadyExists => {
                    return match self.store.get(&name) {
                        Ok(Some(found)) if found == job.data => Ok(()),
                        Ok(_) => Err(Some(e)),
                        // Cannot tell yet whose it is: wait and ask again.
                        Err(read) => {
                            self.report_stall(job.seq, &read, &mut stalled_since, &mut last_report);
                            std::thread::sleep(pause);
                            pause = (pause * 2).min(STALL_PAUSE_MAX);
                            continue;
                        }
                    };
                }
                io::ErrorKind::InvalidInput
                | io::ErrorKind::InvalidData
                | io::ErrorKind::Unsupported => return Err(Some(e)),
                _ => {}
            }
            self.report_stall(job.seq, &e, &mut stalled_since, &mut last_report);
            std::thread::sleep(pause);
            pause = (pause * 2).min(STALL_PAUSE_MAX);
        }
    }

    /// Logs a stalled PUT when it starts and then every [`STALL_REPORT_EVERY`].
    fn report_stall(
        &self,
        seq: u64,
        e: &io::Error,
        since: &mut Option<Instant>,
        last: &mut Instant,
    ) {
        match since {
            None => {
                *since = Some(Instant::now());
                *last = Instant::now();
                tracing::warn!(
                    "journal {}: object {seq} not written, retrying until the store answers \
                     (replies wait meanwhile): {e}",
                    self.id
                );
            }
            Some(t) if last.elapsed() >= STALL_REPORT_EVERY => {
                *last = Instant::now();
                tracing::warn!(
                    "journal {}: the store has not answered for {:.0} s (object {seq}): {e}",
                    self.id,
                    t.elapsed().as_secs_f64()
                );
            }
            Some(_) => {}
        }
    }

    fn why(&self, seq: u64, e: &io::Error) -> String {
        if e.kind() == io::ErrorKind::AlreadyExists {
            format!(
                "{} was sealed: another server took over this incarnation's tables (object \
                 {seq} of its journal was fenced: {e})",
                self.id
            )
        } else {
            format!("write failed: journal object {seq}: {e}")
        }
    }

    /// Acknowledges the completed objects that follow the last acknowledged one without a
    /// gap, in seq order, under the state lock (so durability only ever moves forward).
    fn acknowledge(&self, st: &mut State) {
        if st.failed {
            return;
        }
        let mut last = None;
        while let Some(d) = st.done.remove(&st.next_ack) {
            st.kept.push_back(Kept {
                seq: st.next_ack,
                last_lsn: d.last_lsn,
                bytes: d.bytes,
            });
            st.next_ack += 1;
            if let Some(o) = &self.observer {
                o.on_commit(d.records, d.bytes, d.put_seconds, d.waited);
            }
            last = Some(d.last_lsn);
        }
        if let Some(lsn) = last {
            self.acks.durable(lsn);
        }
    }

    /// Waits until every object handed over completed (or the journal failed, or a PUT
    /// stalled on a store that cannot be reached gave up), then stops the uploaders.
    pub fn finish(&self) {
        let mut st = self.state.lock();
        st.stopping = true;
        while self.in_flight.load(Ordering::Acquire) > 0 && !st.failed {
            self.drained.wait(&mut st);
        }
        st.stop = true;
        drop(st);
        self.work.notify_all();
        for h in self.threads.lock().drain(..) {
            let _ = h.join();
        }
    }

    /// Journal objects kept in the store and their bytes.
    pub fn kept(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.kept.len() as u64, st.kept.iter().map(|k| k.bytes).sum())
    }

    /// Deletes every acknowledged object whose records all have LSNs below `keep_from`,
    /// except the newest acknowledged one: a start marker naming the first object kept is
    /// written first, then the objects below it go (concurrently, in any order; see
    /// `objects`). Returns the objects removed.
    pub fn trim(&self, keep_from: u64) -> io::Result<u64> {
        let _one = self.trimming.lock();
        let (start, names, old_marker) = {
            let st = self.state.lock();
            let n = st
                .kept
                .iter()
                .take(st.kept.len().saturating_sub(1))
                .take_while(|k| k.last_lsn < keep_from)
                .count();
            if n == 0 {
                return Ok(0);
            }
            let names: Vec<String> = st
                .kept
                .iter()
                .take(n)
                .map(|k| object_name(self.id, k.seq))
                .collect();
            (st.kept[n].seq, names, st.start_marker)
        };
        self.store.put(&objects::start_name(self.id, start), b"")?;
        self.state.lock().start_marker = start;
        self.store.delete_many(&names)?;
        if old_marker != 0 {
            self.store
                .delete(&objects::start_name(self.id, old_marker))?;
        }
        let mut st = self.state.lock();
        let n = st.kept.iter().take_while(|k| k.seq < start).count();
        st.kept.drain(..n);
        Ok(n as u64)
    }
}

//! The journal as immutable objects, on an in-memory store of whole objects (as S3 is):
//! records survive, trimming, the chain that stops at the first gap, PUTs that complete out
//! of order and are acknowledged in order, a writer that crashes with PUTs in flight, and
//! fencing (two writers; the fenced one's next commit refused).

use kochab_journal::objects::{self, Listing, object_name};
use kochab_journal::{Journal, JournalId, JournalOptions, RecoveryError, recover};
use kochab_store::{Capacity, MemStore, Object, ObjectStore};
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeSet;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

const J: JournalId = JournalId {
    server: 4,
    epoch: 2,
};

fn opts() -> JournalOptions {
    JournalOptions {
        segment_bytes: 1 << 20,
        fsync: true,
        ..Default::default()
    }
}

fn payload(i: u64) -> Vec<u8> {
    format!("record number {i} ")
        .repeat((i % 7 + 1) as usize)
        .into_bytes()
}

fn collect(s: &dyn ObjectStore, id: JournalId, after: u64) -> Vec<(u64, Vec<u8>)> {
    let mut got = Vec::new();
    recover(s, id, after, |l, p| {
        got.push((l, p.to_vec()));
        Ok(())
    })
    .unwrap();
    got
}

fn seqs(s: &dyn ObjectStore, id: JournalId) -> Vec<u64> {
    Listing::read(s, id)
        .unwrap()
        .objects
        .iter()
        .map(|(q, _)| *q)
        .collect()
}

#[test]
fn records_survive_as_objects_and_a_restart_goes_on() {
    let s = MemStore::objects_only();
    let store: Arc<dyn ObjectStore> = Arc::new(s.clone());
    let j = Journal::start(store.clone(), J, 1, opts(), None).unwrap();
    assert!(j.as_objects());
    for i in 1..=2000 {
        assert_eq!(j.append(&payload(i)), i);
        if i % 50 == 0 {
            assert!(j.wait_durable(i));
        }
    }
    assert!(j.wait_durable(2000));
    j.shutdown();
    assert!(
        s.objects().keys().all(|n| !n.ends_with(".seg")),
        "no segment on a store of whole objects"
    );
    assert!(seqs(&s, J).len() >= 40, "one object per group commit");
    let got = collect(&s, J, 0);
    assert_eq!(got.len(), 2000);
    for (l, p) in &got {
        assert_eq!(p, &payload(*l));
    }
    let j = Journal::start(store.clone(), J, 2001, opts(), None).unwrap();
    assert!(j.wait_durable(j.append(b"after restart")));
    drop(j);
    let got = collect(&s, J, 1990);
    assert_eq!(got.first().unwrap().0, 1991);
    assert_eq!(got.last().unwrap(), &(2001, b"after restart".to_vec()));
}

#[test]
fn a_large_group_commit_is_cut_into_objects_of_whole_records() {
    let s = MemStore::objects_only();
    let big_records = JournalOptions {
        segment_bytes: 8 << 20,
        fsync: true,
        ..Default::default()
    };
    let j = Journal::start(Arc::new(s.clone()), J, 1, big_records, None).unwrap();
    let big = vec![9u8; 3 << 20];
    for _ in 0..5 {
        j.append_deferred(|o| o.extend_from_slice(&big));
    }
    j.flush_now();
    assert!(j.wait_durable(5));
    drop(j);
    for (name, data) in s.objects() {
        assert!(
            data.len() <= objects::OBJECT_BODY_BYTES_MAX + 64,
            "{name}: {}",
            data.len()
        );
    }
    assert_eq!(collect(&s, J, 0).len(), 5);
}

#[test]
fn trimming_writes_a_start_and_deletes_whole_objects_but_the_newest() {
    let s = MemStore::objects_only();
    let j = Journal::start(Arc::new(s.clone()), J, 1, opts(), None).unwrap();
    let mut next = 1;
    for round in 0..5 {
        for _ in 0..300 {
            j.append(&payload(next));
            if next % 10 == 0 {
                assert!(j.wait_durable(next));
            }
            next += 1;
        }
        assert!(j.wait_durable(next - 1));
        let before = j.segments();
        let removed = j.trim(next - 20).unwrap();
        assert!(removed > 0, "round {round}");
        assert_eq!(j.segments(), before - removed);
    }
    // Everything checkpointed: all but the newest acknowledged object go.
    assert!(j.trim(u64::MAX).unwrap() > 0);
    assert_eq!(j.segments(), 1);
    drop(j);
    let listing = Listing::read(&s, J).unwrap();
    assert_eq!(listing.starts.len(), 1, "older start markers are deleted");
    assert_eq!(listing.objects.len(), 1);
    let got = collect(&s, J, next - 2);
    assert_eq!(got, vec![(next - 1, payload(next - 1))]);
    // Asking for trimmed records is an error, not silent loss.
    assert!(recover(&s, J, 10, |_, _| Ok(())).is_err());
}

#[test]
fn recovery_stops_at_the_first_missing_object() {
    let s = MemStore::objects_only();
    let j = Journal::start(Arc::new(s.clone()), J, 1, opts(), None).unwrap();
    for i in 1..=40 {
        assert!(j.wait_durable(j.append(&payload(i))));
    }
    drop(j);
    let all = seqs(&s, J);
    assert_eq!(all.len(), 40, "one object per commit");
    // Object 21 never made it (its PUT was in flight at a crash): 22.. were never
    // acknowledged, so they are not read.
    s.delete(&object_name(J, 21)).unwrap();
    let got = collect(&s, J, 0);
    assert_eq!(got.len(), 20);
    assert_eq!(got.last().unwrap().0, 20);
    let ins = kochab_journal::inspect(&s, J).unwrap();
    assert_eq!(ins.chain_end, 20);
    assert!(ins.damage.is_none(), "a gap is an end, not damage");
    // A damaged object inside the chain is refused, then repaired by accepting the loss.
    let name = object_name(J, 10);
    let mut bad = s.get(&name).unwrap().unwrap();
    let at = bad.len() - 3;
    bad[at] ^= 1;
    s.put(&name, &bad).unwrap();
    assert!(matches!(
        recover(&s, J, 0, |_, _| Ok(())),
        Err(RecoveryError::Damaged(_))
    ));
    let repair = kochab_journal::repair_accept_loss(&s, J).unwrap();
    assert_eq!(repair.kept_through, 9);
    assert!(repair.deleted.iter().any(|d| d.name == name));
    assert_eq!(collect(&s, J, 0).len(), 9);
    // The damaged object's place now holds a fence: nobody can extend the chain there.
    let e = s.create_if_absent(&name, b"late").unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
}

/// A store of whole objects whose conditional creates of chosen names wait until released
/// (a slow PUT), and which can "crash": take a copy of what is stored at that instant.
struct GatedStore {
    inner: MemStore,
    held: Mutex<BTreeSet<String>>,
    released: Condvar,
    /// Names whose conditional create was asked for.
    attempted: Mutex<BTreeSet<String>>,
    /// The store cannot be reached: every conditional create and read fails.
    down: AtomicBool,
    /// The next conditional creates store their object, then fail as if the answer was
    /// lost on the way back.
    lose_answers: AtomicUsize,
}

impl GatedStore {
    fn new() -> Arc<GatedStore> {
        Arc::new(GatedStore {
            inner: MemStore::objects_only(),
            held: Mutex::new(BTreeSet::new()),
            released: Condvar::new(),
            attempted: Mutex::new(BTreeSet::new()),
            down: AtomicBool::new(false),
            lose_answers: AtomicUsize::new(0),
        })
    }

    /// Waits until the create of `name` was asked for (bounded).
    fn wait_attempt(&self, name: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !self.attempted.lock().contains(name) {
            assert!(std::time::Instant::now() < deadline, "no PUT of {name}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn hold(&self, name: String) {
        self.held.lock().insert(name);
    }

    fn release(&self, name: &str) {
        self.held.lock().remove(name);
        self.released.notify_all();
    }
}

impl ObjectStore for GatedStore {
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        self.inner.put(name, data)
    }
    fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        if self.down.load(Ordering::SeqCst) {
            return Err(unreachable_store());
        }
        self.inner.get(name)
    }
    fn delete(&self, name: &str) -> io::Result<()> {
        self.inner.delete(name)
    }
    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        self.inner.list(prefix)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn Object>> {
        self.inner.open(name, create)
    }
    fn open_sync_direct(&self, name: &str) -> io::Result<Option<Arc<dyn Object>>> {
        self.inner.open_sync_direct(name)
    }
    fn open_direct(&self, name: &str, create: bool) -> io::Result<Option<Arc<dyn Object>>> {
        self.inner.open_direct(name, create)
    }
    fn sync_dir(&self, prefix: &str) -> io::Result<()> {
        self.inner.sync_dir(prefix)
    }
    fn capacity(&self) -> io::Result<Capacity> {
        self.inner.capacity()
    }
    fn positioned_io(&self) -> bool {
        false
    }
    fn create_if_absent(&self, name: &str, data: &[u8]) -> io::Result<()> {
        self.attempted.lock().insert(name.to_string());
        let mut held = self.held.lock();
        while held.contains(name) {
            self.released.wait(&mut held);
        }
        drop(held);
        if self.down.load(Ordering::SeqCst) {
            return Err(unreachable_store());
        }
        let lost = self
            .lose_answers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        self.inner.create_if_absent(name, data)?;
        if lost {
            return Err(unreachable_store());
        }
        Ok(())
    }
}

/// What an S3 client says after its own retries when every daemon of the store is down.
fn unreachable_store() -> io::Error {
    io::Error::other("connection refused (after 5 retries)")
}

/// Appends records `from..from + n`, each its own object: the next is appended only once
/// the PUT of the last started (journal `J`, which started at LSN 1, so object = LSN).
fn one_object_each(s: &GatedStore, j: &Journal, from: u64, n: u64) {
    for i in from..from + n {
        j.append(&payload(i));
        s.wait_attempt(&object_name(J, i));
    }
}

#[test]
fn puts_that_complete_out_of_order_are_acknowledged_in_order() {
    let s = GatedStore::new();
    let j = Journal::start(s.clone(), J, 1, opts(), None).unwrap();
    one_object_each(&s, &j, 1, 1);
    assert!(j.wait_durable(1));
    // Object 2 is slow; 3, 4 and 5 complete before it.
    s.hold(object_name(J, 2));
    one_object_each(&s, &j, 2, 4);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while seqs(&s.inner, J).len() < 4 {
        assert!(std::time::Instant::now() < deadline, "PUTs 3..5 complete");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(seqs(&s.inner, J), vec![1, 3, 4, 5]);
    assert_eq!(
        j.durable_lsn(),
        1,
        "nothing past the slow PUT is acknowledged"
    );
    s.release(&object_name(J, 2));
    assert!(j.wait_durable(5));
    assert_eq!(j.durable_lsn(), 5);
    drop(j);
    assert_eq!(collect(&s.inner, J, 0).len(), 5);
}

#[test]
fn a_store_that_cannot_be_reached_stalls_the_journal_and_never_ends_it() {
    let s = GatedStore::new();
    let j = Journal::start(s.clone(), J, 1, opts(), None).unwrap();
    one_object_each(&s, &j, 1, 1);
    assert!(j.wait_durable(1));
    // Every daemon of the store killed: PUTs fail (after the client's own retries) for a
    // while; the journal waits, acknowledges nothing, and does not fail.
    s.down.store(true, Ordering::SeqCst);
    one_object_each(&s, &j, 2, 2);
    j.append(&payload(4));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        j.durable_lsn(),
        1,
        "nothing is durable while the store is down"
    );
    // The store back: what waited is written and acknowledged, and the journal goes on.
    s.down.store(false, Ordering::SeqCst);
    assert!(
        j.wait_durable(4),
        "the journal resumes when the store answers again"
    );
    // A create whose object was stored but whose answer was lost: the retry finds the
    // object holding its own bytes and takes it as written, not as a fence.
    s.lose_answers.store(1, Ordering::SeqCst);
    one_object_each(&s, &j, 5, 1);
    assert!(j.wait_durable(5), "a lost answer is not a fence");
    assert!(j.wait_durable(j.append(b"after")));
    drop(j);
    let got = collect(&s.inner, J, 0);
    assert_eq!(got.len(), 6);
    for (l, p) in got.iter().take(5) {
        assert_eq!(p, &payload(*l));
    }
    // A stop while the store is down ends (what was not written is not acknowledged).
    let j = Journal::start(s.clone(), J, 7, opts(), None).unwrap();
    s.down.store(true, Ordering::SeqCst);
    j.append(b"never written");
    std::thread::sleep(Duration::from_millis(200));
    j.shutdown();
    assert_eq!(j.durable_lsn(), 6);
}

#[test]
fn a_crash_with_puts_in_flight_keeps_every_acknowledged_record() {
    let s = GatedStore::new();
    let j = Journal::start(s.clone(), J, 1, opts(), None).unwrap();
    one_object_each(&s, &j, 1, 3);
    assert!(j.wait_durable(3));
    s.hold(object_name(J, 4));
    one_object_each(&s, &j, 4, 3);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while seqs(&s.inner, J) != vec![1, 2, 3, 5, 6] {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            seqs(&s.inner, J)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The crash: what the store holds now is all a restart finds.
    let after_crash = s.inner.deep_clone();
    let acknowledged = j.durable_lsn();
    assert_eq!(acknowledged, 3);
    s.release(&object_name(J, 4));
    drop(j);
    // The restart seals the crashed incarnation first: its chain ends at the first gap.
    kochab_journal::seal(&after_crash, J).unwrap();
    let got = collect(&after_crash, J, 0);
    assert_eq!(
        got.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
        vec![1, 2, 3],
        "every acknowledged record, and nothing past the gap"
    );
    // The fence took the name of the PUT that was in flight.
    let fence = after_crash.get(&object_name(J, 4)).unwrap().unwrap();
    assert_eq!(
        objects::decode(4, J.epoch, &fence),
        Ok(objects::Content::Fence)
    );
}

#[test]
fn a_fenced_writer_acknowledges_nothing_its_sealer_did_not_read() {
    // Two incarnations write at once (the old one, about to be fenced, and a new one); a
    // sealer fences the old one in the middle of its stream and reads it at once. Every
    // record the old writer acknowledged must be in what the sealer read; its next commit
    // is refused by the store itself, and the new one goes on.
    for round in 0..5 {
        let s = MemStore::objects_only();
        let store: Arc<dyn ObjectStore> = Arc::new(s.clone());
        let old = JournalId {
            server: 1,
            epoch: 1,
        };
        let new = JournalId {
            server: 2,
            epoch: 1,
        };
        let a = Arc::new(Journal::start(store.clone(), old, 1, opts(), None).unwrap());
        let b = Arc::new(Journal::start(store.clone(), new, 1, opts(), None).unwrap());
        let writer = |j: Arc<Journal>| {
            std::thread::spawn(move || {
                let mut acked = Vec::new();
                for i in 1..=3_000u64 {
                    let lsn = j.append(&payload(i));
                    if i % 3 == 0 {
                        if !j.wait_durable(lsn) {
                            break;
                        }
                        acked.push(lsn);
                    }
                }
                acked
            })
        };
        let (wa, wb) = (writer(a.clone()), writer(b.clone()));
        std::thread::sleep(Duration::from_millis(5 + round * 7));
        kochab_journal::seal(&s, old).unwrap();
        let mut seen = BTreeSet::new();
        recover(&s, old, 0, |l, _| {
            seen.insert(l);
            Ok(())
        })
        .unwrap();
        let acked = wa.join().unwrap();
        // Its next commit (if its stream had not met the fence yet) is refused.
        let next = a.append(b"after the fence");
        assert!(!a.wait_durable(next), "round {round}");
        assert!(a.failed(), "round {round}: the fenced writer stopped");
        let why = a.failure().unwrap();
        assert!(why.contains("sealed"), "{why}");
        for l in &acked {
            assert!(seen.contains(l), "round {round}: acknowledged {l} not read");
        }
        assert_eq!(wb.join().unwrap().len(), 1_000, "the other is untouched");
        assert!(!b.failed());
        // What the sealer read is what any later reader reads.
        let again: BTreeSet<u64> = collect(&s, old, 0).into_iter().map(|(l, _)| l).collect();
        assert_eq!(again, seen);
        assert!(Journal::start(store.clone(), old, 99, opts(), None).is_err());
    }
}

#[test]
fn a_fence_in_the_writers_next_name_refuses_its_next_commit() {
    // The fencer's create of the next name wins the race with the writer's PUT: that PUT is
    // refused and nothing from it on is acknowledged, without the writer ever asking.
    let s = GatedStore::new();
    let j = Journal::start(s.clone(), J, 1, opts(), None).unwrap();
    one_object_each(&s, &j, 1, 2);
    assert!(j.wait_durable(2));
    s.hold(object_name(J, 3));
    let lsn = j.append(&payload(3));
    s.wait_attempt(&object_name(J, 3));
    assert_eq!(objects::fence(&s.inner, J).unwrap(), 3);
    s.release(&object_name(J, 3));
    assert!(!j.wait_durable(lsn));
    let why = j.failure().unwrap();
    assert!(why.contains("sealed") && why.contains("object 3"), "{why}");
    drop(j);
    assert_eq!(collect(&s.inner, J, 0).len(), 2);
}

use kochab_journal::segment::{list_segments, segment_name};
use kochab_journal::{Journal, JournalId, JournalOptions, recover};

const J: JournalId = JournalId {
    server: 1,
    epoch: 1,
};
use kochab_store::{LocalStore, ObjectStore};
use std::sync::Arc;

fn store() -> (tempfile::TempDir, Arc<dyn ObjectStore>) {
    let dir = tempfile::tempdir().unwrap();
    let s: Arc<dyn ObjectStore> = Arc::new(LocalStore::open(dir.path()).unwrap());
    (dir, s)
}

fn small() -> JournalOptions {
    JournalOptions {
        segment_bytes: 1 << 16,
        fsync: true,
        ..JournalOptions::default()
    }
}

fn payload(i: u64) -> Vec<u8> {
    format!("record number {i} ")
        .repeat((i % 7 + 1) as usize)
        .into_bytes()
}

fn collect(
    s: &dyn ObjectStore,
    after: u64,
) -> (Vec<(u64, Vec<u8>)>, kochab_journal::RecoveryReport) {
    let mut got = Vec::new();
    let rep = recover(s, J, after, |l, p| {
        got.push((l, p.to_vec()));
        Ok(())
    })
    .unwrap();
    (got, rep)
}

#[test]
fn records_survive_across_segments_and_restarts() {
    let (_d, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    for i in 1..=2000 {
        assert_eq!(j.append(&payload(i)), i);
    }
    assert!(j.wait_durable(2000));
    j.shutdown();
    assert!(
        list_segments(s.as_ref(), J).unwrap().len() >= 2,
        "segments rolled over"
    );
    let (got, rep) = collect(s.as_ref(), 0);
    assert_eq!(rep.last_lsn, 2000);
    assert!(rep.cut.is_none());
    assert_eq!(got.len(), 2000);
    for (l, p) in &got {
        assert_eq!(p, &payload(*l));
    }
    // Continue after recovery, then replay only the tail.
    let j = Journal::start(s.clone(), J, 2001, small(), None).unwrap();
    j.append(b"after restart");
    assert!(j.wait_durable(2001));
    drop(j);
    let (got, rep) = collect(s.as_ref(), 1990);
    assert_eq!(rep.last_lsn, 2001);
    assert_eq!(got.first().unwrap().0, 1991);
    assert_eq!(got.last().unwrap().1, b"after restart");
}

#[test]
fn torn_tail_is_reported_and_cut() {
    let (dir, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    for i in 1..=10 {
        j.append(&payload(i));
    }
    assert!(j.wait_durable(10));
    drop(j);
    // Tear the last record: flip a byte in its middle, as a partially written page would.
    let path = dir.path().join(segment_name(J, 1));
    let mut bytes = std::fs::read(&path).unwrap();
    let needle = payload(10);
    let at = bytes
        .windows(needle.len())
        .rposition(|w| w == &needle[..])
        .unwrap();
    bytes[at + needle.len() / 2] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let (got, rep) = collect(s.as_ref(), 0);
    assert_eq!(got.len(), 9, "the torn record is not replayed");
    let cut = rep.cut.expect("the cut is reported");
    assert!(cut.reason.contains("checksum"), "{}", cut.reason);
    // The cut is permanent: a second recovery is clean and new records follow on.
    let (got2, rep2) = collect(s.as_ref(), 0);
    assert_eq!(got2.len(), 9);
    assert!(rep2.cut.is_none());
    let j = Journal::start(s.clone(), J, rep2.last_lsn + 1, small(), None).unwrap();
    j.append(b"new");
    assert!(j.wait_durable(10));
    drop(j);
    let (got3, _) = collect(s.as_ref(), 0);
    assert_eq!(got3.len(), 10);
    assert_eq!(got3[9], (10, b"new".to_vec()));
}

#[test]
fn trim_keeps_what_replay_needs() {
    let (_d, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    for i in 1..=3000 {
        j.append(&payload(i));
    }
    assert!(j.wait_durable(3000));
    let before = list_segments(s.as_ref(), J).unwrap().len();
    let removed = j.trim(2500).unwrap();
    assert!(removed > 0);
    assert_eq!(
        list_segments(s.as_ref(), J).unwrap().len(),
        before - removed as usize
    );
    drop(j);
    let (got, rep) = collect(s.as_ref(), 2499);
    assert_eq!(got.first().unwrap().0, 2500);
    assert_eq!(rep.last_lsn, 3000);
    // Asking for records that were trimmed is an error, not silent loss.
    assert!(recover(s.as_ref(), J, 10, |_, _| Ok(())).is_err());
}

#[test]
fn concurrent_appenders_get_dense_lsns_and_group_commits() {
    let (_d, s) = store();
    let j = Arc::new(Journal::start(s.clone(), J, 1, JournalOptions::default(), None).unwrap());
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let j = j.clone();
            std::thread::spawn(move || {
                for _ in 0..200 {
                    let l = j.append(b"x");
                    assert!(j.wait_durable(l));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(j.durable_lsn(), 1600);
    drop(j);
    let (got, _) = collect(s.as_ref(), 0);
    assert_eq!(
        got.iter().map(|x| x.0).collect::<Vec<_>>(),
        (1..=1600).collect::<Vec<_>>()
    );
}

#[test]
fn trimmed_journals_keep_going() {
    let (_d, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    let mut next = 1;
    for _ in 0..5 {
        for _ in 0..1500 {
            j.append(&payload(next));
            next += 1;
        }
        assert!(j.wait_durable(next - 1));
        // Retire everything but the newest records, as a checkpoint would.
        j.trim(next - 100).unwrap();
    }
    drop(j);
    let (got, rep) = collect(s.as_ref(), next - 101);
    assert!(
        rep.cut.is_none(),
        "a clean end, not a torn tail: {:?}",
        rep.cut
    );
    assert_eq!(rep.last_lsn, next - 1);
    assert_eq!(got.len(), 100);
    for (l, p) in &got {
        assert_eq!(p, &payload(*l));
    }
}

#[test]
fn records_after_an_unwritten_block_are_not_replayed() {
    // A write that reached the disk only in part: a block in its middle is still zeros.
    // Nothing after the gap was acknowledged; recovery stops there.
    let (dir, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    let big = vec![7u8; 3000];
    for _ in 0..4 {
        let l = j.append(&big);
        assert!(j.wait_durable(l));
    }
    drop(j);
    let path = dir.path().join(segment_name(J, 1));
    let mut bytes = std::fs::read(&path).unwrap();
    // Records start at 4096 and are 3016 bytes: record 3 spans offsets 10128..13144.
    bytes[3 * 4096..4 * 4096].fill(0);
    std::fs::write(&path, &bytes).unwrap();
    let (got, rep) = collect(s.as_ref(), 0);
    assert_eq!(
        got.len(),
        2,
        "records 1 and 2 survive, 3 is torn, 4 is past the gap"
    );
    assert_eq!(rep.last_lsn, 2);
}

/// Shortens segment `first` of the store in `dir` to `len` bytes, as a lost write-back or a
/// careless copy would.
fn truncate_segment(dir: &std::path::Path, first: u64, len: u64) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(segment_name(J, first)))
        .unwrap();
    f.set_len(len).unwrap();
}

#[test]
fn a_segment_truncated_at_a_record_boundary_is_damage_not_a_clean_end() {
    // The old recovery read the zeros after a truncation at a record boundary as the clean
    // end of the journal: records 6..=10, acknowledged, vanished without a word.
    let (dir, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    let mut ends = Vec::new();
    for i in 1..=10 {
        j.append(&payload(i));
        assert!(j.wait_durable(i));
        ends.push(4096 + (1..=i).map(|k| 16 + payload(k).len() as u64).sum::<u64>());
    }
    drop(j);
    truncate_segment(dir.path(), 1, ends[4]);
    let err = recover(s.as_ref(), J, 0, |_, _| Ok(())).unwrap_err();
    assert!(
        err.to_string().contains("truncated"),
        "refused with a clear reason: {err}"
    );
    // Nothing was changed by the refusal.
    let path = dir.path().join(segment_name(J, 1));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), ends[4]);
}

#[test]
fn a_segment_truncated_inside_a_record_is_damage_not_a_torn_tail() {
    // The old recovery cut this as a torn tail and started, having lost records 4..=10.
    let (dir, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    for i in 1..=10 {
        j.append(&payload(i));
    }
    assert!(j.wait_durable(10));
    drop(j);
    truncate_segment(dir.path(), 1, 4096 + 200);
    assert!(matches!(
        recover(s.as_ref(), J, 0, |_, _| Ok(())),
        Err(kochab_journal::RecoveryError::Damaged(_))
    ));
}

#[test]
fn an_emptied_later_segment_is_damage() {
    // A later segment cut to nothing: the old recovery took it for an unused one.
    let (dir, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    for i in 1..=2000 {
        j.append(&payload(i));
    }
    assert!(j.wait_durable(2000));
    drop(j);
    let segs = list_segments(s.as_ref(), J).unwrap();
    assert!(segs.len() >= 3);
    let (last_first, _) = segs[segs.len() - 1];
    truncate_segment(dir.path(), last_first, 0);
    let err = recover(s.as_ref(), J, 0, |_, _| Ok(())).unwrap_err();
    assert!(err.to_string().contains("shorter than its header"), "{err}");
}

#[test]
fn repair_accept_loss_drops_exactly_what_follows_the_damage() {
    let (dir, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    for i in 1..=2000 {
        j.append(&payload(i));
    }
    assert!(j.wait_durable(2000));
    drop(j);
    let segs = list_segments(s.as_ref(), J).unwrap();
    assert!(segs.len() >= 3, "{segs:?}");
    // Cut the second segment in the middle of its records.
    let (second, _) = segs[1];
    let (third, _) = segs[2];
    let before = kochab_journal::inspect(s.as_ref(), J).unwrap();
    assert!(before.damage.is_none());
    assert_eq!(before.chain_end, 2000);
    truncate_segment(dir.path(), second, 20_000);
    let ins = kochab_journal::inspect(s.as_ref(), J).unwrap();
    let damage = ins.damage.clone().expect("damage found");
    assert!(!damage.torn_tail);
    assert_eq!(damage.segment, segment_name(J, second));
    let kept = ins.chain_end;
    assert!(kept > second && kept < third, "{kept}");

    let repair = kochab_journal::repair_accept_loss(s.as_ref(), J).unwrap();
    assert_eq!(repair.kept_through, kept);
    let cut = repair
        .cut
        .expect("the damaged segment keeps its first records");
    assert_eq!(cut.segment, segment_name(J, second));
    let deleted: Vec<_> = repair.deleted.iter().map(|d| d.name.clone()).collect();
    assert_eq!(
        deleted,
        segs[2..].iter().map(|(_, n)| n.clone()).collect::<Vec<_>>(),
        "every later segment goes, and only those"
    );
    assert_eq!(repair.deleted[0].lsns.map(|l| l.0), Some(third));
    assert_eq!(repair.deleted.last().unwrap().lsns.map(|l| l.1), Some(2000));

    // The journal is one valid chain again, ending where the report says.
    let (got, rep) = collect(s.as_ref(), 0);
    assert_eq!(rep.last_lsn, kept);
    assert_eq!(got.len() as u64, kept);
    for (l, p) in &got {
        assert_eq!(p, &payload(*l));
    }
    let j = Journal::start(s.clone(), J, kept + 1, small(), None).unwrap();
    j.append(b"after the repair");
    assert!(j.wait_durable(kept + 1));
    drop(j);
    let (got, _) = collect(s.as_ref(), kept);
    assert_eq!(got, vec![(kept + 1, b"after the repair".to_vec())]);
    // A second repair finds nothing to do.
    assert!(
        kochab_journal::repair_accept_loss(s.as_ref(), J)
            .unwrap()
            .damage
            .is_none()
    );
}

#[test]
fn an_oversized_record_fails_the_journal_instead_of_aborting() {
    // The old code asserted in the encoder (panic=abort in release: the whole server died,
    // and died again on every start if the input survived).
    let (_d, s) = store();
    let j = Journal::start(s.clone(), J, 1, small(), None).unwrap();
    let mut failure = j.subscribe_failure();
    let ok = j.append(b"fine");
    assert!(j.wait_durable(ok));
    let big = vec![0u8; j.record_limit() + 1];
    let l = j.append(&big);
    assert!(!j.wait_durable(l), "an oversized record is never durable");
    assert!(j.failed());
    assert!(failure.has_changed().unwrap());
    let why = failure.borrow_and_update().clone().expect("a reason");
    assert!(why.contains("exceeds the limit"), "{why}");
    let after = j.append(b"later");
    assert!(
        !j.wait_durable(after),
        "nothing after a failure is acknowledged"
    );
    drop(j);
    let (got, _) = collect(s.as_ref(), 0);
    assert_eq!(got, vec![(1, b"fine".to_vec())]);
}

/// A store whose writes start failing when told to, as a disk that returns EIO would.
struct FailingStore {
    inner: Arc<dyn ObjectStore>,
    fail: Arc<std::sync::atomic::AtomicBool>,
}

struct FailingObject {
    inner: Arc<dyn kochab_store::Object>,
    fail: Arc<std::sync::atomic::AtomicBool>,
}

impl kochab_store::Object for FailingObject {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(std::io::Error::from_raw_os_error(libc_eio()));
        }
        self.inner.write_at(data, offset)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.inner.sync_data()
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.inner.set_len(len)
    }
}

fn libc_eio() -> i32 {
    5
}

impl ObjectStore for FailingStore {
    fn put(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        self.inner.put(name, data)
    }
    fn get(&self, name: &str) -> std::io::Result<Option<Vec<u8>>> {
        self.inner.get(name)
    }
    fn delete(&self, name: &str) -> std::io::Result<()> {
        self.inner.delete(name)
    }
    fn list(&self, prefix: &str) -> std::io::Result<Vec<String>> {
        self.inner.list(prefix)
    }
    fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        self.inner.rename(from, to)
    }
    fn open(&self, name: &str, create: bool) -> std::io::Result<Arc<dyn kochab_store::Object>> {
        Ok(Arc::new(FailingObject {
            inner: self.inner.open(name, create)?,
            fail: self.fail.clone(),
        }))
    }
    fn open_sync_direct(
        &self,
        _name: &str,
    ) -> std::io::Result<Option<Arc<dyn kochab_store::Object>>> {
        Ok(None)
    }
    fn open_direct(
        &self,
        _name: &str,
        _create: bool,
    ) -> std::io::Result<Option<Arc<dyn kochab_store::Object>>> {
        Ok(None)
    }
    fn sync_dir(&self, prefix: &str) -> std::io::Result<()> {
        self.inner.sync_dir(prefix)
    }
    fn capacity(&self) -> std::io::Result<kochab_store::Capacity> {
        self.inner.capacity()
    }
}

#[test]
fn a_write_error_fails_the_journal_and_says_why() {
    let (_d, inner) = store();
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s: Arc<dyn ObjectStore> = Arc::new(FailingStore {
        inner,
        fail: fail.clone(),
    });
    let j = Journal::start(s, J, 1, small(), None).unwrap();
    let failure = j.subscribe_failure();
    assert!(j.wait_durable(j.append(b"before")));
    fail.store(true, std::sync::atomic::Ordering::Relaxed);
    let l = j.append(b"lost");
    assert!(!j.wait_durable(l));
    let why = j.failure().expect("a reason");
    assert!(why.contains("write failed"), "{why}");
    assert!(failure.has_changed().unwrap());
    assert_eq!(j.durable_lsn(), 1);
}

#[test]
fn a_sealed_journal_acknowledges_nothing_its_reader_did_not_see() {
    // Two incarnations write at once (the old one, about to be fenced, and a new one); a
    // sealer seals the old one in the middle of its stream and reads it at once. Every
    // record the old writer acknowledged must be in what the sealer read; after the seal
    // the old writer fails, the new one goes on.
    for round in 0..5 {
        let (_d, s) = store();
        let old = JournalId {
            server: 1,
            epoch: 1,
        };
        let new = JournalId {
            server: 2,
            epoch: 1,
        };
        let opts = JournalOptions {
            segment_bytes: 4 << 20,
            fsync: true,
            ..JournalOptions::default()
        };
        let a = Arc::new(Journal::start(s.clone(), old, 1, opts.clone(), None).unwrap());
        let b = Arc::new(Journal::start(s.clone(), new, 1, opts, None).unwrap());
        let writer = |j: Arc<Journal>| {
            std::thread::spawn(move || {
                let mut acked = Vec::new();
                for i in 1..=6_000u64 {
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
        std::thread::sleep(std::time::Duration::from_millis(5 + round * 7));
        kochab_journal::seal(s.as_ref(), old).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        kochab_journal::recover(s.as_ref(), old, 0, |l, _| {
            seen.insert(l);
            Ok(())
        })
        .unwrap();
        let acked = wa.join().unwrap();
        assert!(a.failed(), "round {round}: the sealed writer stopped");
        assert!(a.failure().unwrap().contains("sealed"));
        for l in &acked {
            assert!(seen.contains(l), "round {round}: acknowledged {l} not read");
        }
        assert!(!a.wait_durable(a.last_lsn() + 1));
        let acked_b = wb.join().unwrap();
        assert_eq!(
            acked_b.len(),
            6_000 / 3,
            "the other incarnation is untouched"
        );
        assert!(!b.failed());
        // A sealed journal cannot be started again.
        assert!(Journal::start(s.clone(), old, 99, small(), None).is_err());
    }
}

#[test]
fn a_long_lazy_flush_leaves_records_unflushed_until_asked() {
    let (_d, s) = store();
    let opts = JournalOptions {
        lazy_flush: std::time::Duration::from_secs(1 << 30),
        ..small()
    };
    let j = Journal::start(s, J, 1, opts, None).unwrap();
    let lsn = j.append_deferred(|b| b.extend_from_slice(b"early"));
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(j.durable_lsn(), 0, "nobody asked: nothing flushed");
    j.flush_now();
    assert!(j.wait_durable(lsn));
    assert_eq!(j.durable_lsn(), lsn);
}

#[test]
fn a_short_lazy_flush_flushes_unasked() {
    let (_d, s) = store();
    let opts = JournalOptions {
        lazy_flush: std::time::Duration::from_millis(1),
        ..small()
    };
    let j = Journal::start(s, J, 1, opts, None).unwrap();
    let lsn = j.append_deferred(|b| b.extend_from_slice(b"early"));
    let t0 = std::time::Instant::now();
    while j.durable_lsn() < lsn {
        assert!(t0.elapsed().as_secs() < 10, "never flushed");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Appenders on a runtime with one worker (the committer task writes on it, as in a
/// capped server) or two (the committer leaves the writes to the flusher thread): what
/// `flush_now` asks for becomes durable, across segment rollovers, and nothing is lost
/// or reordered.
fn committer_writes_what_flush_now_asks_for(workers: usize) {
    let (_d, s) = store();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap();
    // Nothing unasked: only the committer, or the flusher thread in its stead, writes.
    let opts = JournalOptions {
        lazy_flush: std::time::Duration::from_secs(1 << 30),
        ..small()
    };
    let j = Arc::new(Journal::start(s.clone(), J, 1, opts, None).unwrap());
    rt.block_on(async {
        let committer = tokio::spawn(j.committer());
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let j = j.clone();
            tasks.push(tokio::spawn(async move {
                let mut durable = j.subscribe();
                for i in 0..250u64 {
                    let lsn = j.append_deferred(|b| b.extend_from_slice(&payload(t * 1000 + i)));
                    j.flush_now();
                    while *durable.borrow_and_update() < lsn {
                        durable.changed().await.unwrap();
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        j.shutdown();
        committer.await.unwrap();
    });
    assert!(
        list_segments(s.as_ref(), J).unwrap().len() >= 2,
        "rolled over"
    );
    let (got, rep) = collect(s.as_ref(), 0);
    assert_eq!(rep.last_lsn, 2000);
    assert!(rep.cut.is_none());
    let lsns: Vec<u64> = got.iter().map(|(l, _)| *l).collect();
    assert_eq!(lsns, (1..=2000).collect::<Vec<_>>());
    let mut payloads: Vec<Vec<u8>> = got.into_iter().map(|(_, p)| p).collect();
    let mut want: Vec<Vec<u8>> = (0..8u64)
        .flat_map(|t| (0..250u64).map(move |i| payload(t * 1000 + i)))
        .collect();
    payloads.sort();
    want.sort();
    assert_eq!(payloads, want);
}

#[test]
fn the_committer_task_writes_on_a_single_worker() {
    committer_writes_what_flush_now_asks_for(1);
}

#[test]
fn the_flusher_writes_for_several_workers() {
    committer_writes_what_flush_now_asks_for(2);
}

/// A thread that blocks for durability on the runtime's only worker, where the committer
/// would write: the flusher thread writes for it.
#[test]
fn wait_durable_on_the_committers_thread_does_not_wait_for_the_committer() {
    let (_d, s) = store();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let opts = JournalOptions {
        lazy_flush: std::time::Duration::from_secs(1 << 30),
        ..small()
    };
    let j = Arc::new(Journal::start(s, J, 1, opts, None).unwrap());
    rt.block_on(async {
        tokio::spawn(j.committer());
        tokio::task::yield_now().await;
        let j2 = j.clone();
        let ok = tokio::spawn(async move {
            let lsn = j2.append_deferred(|b| b.extend_from_slice(b"blocking"));
            j2.flush_now();
            j2.wait_durable(lsn)
        });
        assert!(ok.await.unwrap());
        j.shutdown();
    });
}

/// A store whose object writes wait while the gate is shut, telling who waits: a flush
/// can be held after it took its records and before they are durable.
#[derive(Clone)]
struct GateStore {
    inner: Arc<dyn ObjectStore>,
    /// (shut, writers waiting).
    gate: Arc<(std::sync::Mutex<(bool, usize)>, std::sync::Condvar)>,
}

struct GateObject {
    inner: Arc<dyn kochab_store::Object>,
    gate: Arc<(std::sync::Mutex<(bool, usize)>, std::sync::Condvar)>,
}

impl GateStore {
    fn new() -> GateStore {
        GateStore {
            inner: Arc::new(kochab_store::MemStore::new()),
            gate: Arc::default(),
        }
    }

    fn shut(&self, shut: bool) {
        self.gate.0.lock().unwrap().0 = shut;
        self.gate.1.notify_all();
    }

    /// Returns once a writer waits at the shut gate.
    fn await_writer(&self) {
        let (m, cv) = &*self.gate;
        let _g = cv.wait_while(m.lock().unwrap(), |g| g.1 == 0).unwrap();
    }
}

impl kochab_store::Object for GateObject {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        let (m, cv) = &*self.gate;
        let mut g = m.lock().unwrap();
        g.1 += 1;
        cv.notify_all();
        g = cv.wait_while(g, |g| g.0).unwrap();
        g.1 -= 1;
        drop(g);
        self.inner.write_at(data, offset)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.inner.sync_data()
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.inner.set_len(len)
    }
}

impl ObjectStore for GateStore {
    fn put(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        self.inner.put(name, data)
    }
    fn get(&self, name: &str) -> std::io::Result<Option<Vec<u8>>> {
        self.inner.get(name)
    }
    fn delete(&self, name: &str) -> std::io::Result<()> {
        self.inner.delete(name)
    }
    fn list(&self, prefix: &str) -> std::io::Result<Vec<String>> {
        self.inner.list(prefix)
    }
    fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        self.inner.rename(from, to)
    }
    fn open(&self, name: &str, create: bool) -> std::io::Result<Arc<dyn kochab_store::Object>> {
        Ok(Arc::new(GateObject {
            inner: self.inner.open(name, create)?,
            gate: self.gate.clone(),
        }))
    }
    fn open_sync_direct(
        &self,
        _name: &str,
    ) -> std::io::Result<Option<Arc<dyn kochab_store::Object>>> {
        Ok(None)
    }
    fn open_direct(
        &self,
        _name: &str,
        _create: bool,
    ) -> std::io::Result<Option<Arc<dyn kochab_store::Object>>> {
        Ok(None)
    }
    fn sync_dir(&self, prefix: &str) -> std::io::Result<()> {
        self.inner.sync_dir(prefix)
    }
    fn capacity(&self) -> std::io::Result<kochab_store::Capacity> {
        self.inner.capacity()
    }
    fn exists(&self, name: &str) -> std::io::Result<bool> {
        self.inner.exists(name)
    }
}

/// A wait for records the flusher has already taken (the flush `flush_now` asked for may
/// start before the caller's `wait_durable` runs, on another core) must not leave the
/// flusher asked: a record appended meanwhile, which nobody waits for, would go with that
/// flush's successor at once instead of with the next flush asked for. What is durable at
/// any moment must follow from the calls alone, not from which thread ran first (the
/// simulation replays a seed by it).
#[test]
fn a_wait_for_records_being_written_leaves_the_next_one_unflushed() {
    let store = GateStore::new();
    let opts = JournalOptions {
        lazy_flush: std::time::Duration::from_secs(1 << 30),
        ..small()
    };
    let j = Arc::new(Journal::start(Arc::new(store.clone()), J, 1, opts, None).unwrap());
    let asked = j.append_deferred(|b| b.extend_from_slice(b"asked for"));
    store.shut(true);
    j.flush_now();
    // The flusher holds the record, not yet durable, when the wait begins.
    store.await_writer();
    let waiter = {
        let j = j.clone();
        std::thread::spawn(move || j.wait_durable(asked))
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    // Appended before the flusher looks for more work.
    let lone = j.append_deferred(|b| b.extend_from_slice(b"nobody waits"));
    store.shut(false);
    assert!(waiter.join().unwrap());
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(
        j.durable_lsn(),
        asked,
        "nobody asked for {lone}: not flushed"
    );
    j.flush_now();
    assert!(j.wait_durable(lone));
}

/// With `spare_inline` the spare segment is ready whenever the journal's calls have
/// returned: after the start, and after every flush that rolled over into it.
#[test]
fn an_inline_spare_is_ready_when_the_calls_return() {
    let s: Arc<dyn ObjectStore> = Arc::new(kochab_store::MemStore::new());
    let opts = JournalOptions {
        spare_inline: true,
        ..small()
    };
    let spare_len = |s: &Arc<dyn ObjectStore>| s.get(&J.spare_name()).unwrap().map(|d| d.len());
    let j = Journal::start(s.clone(), J, 1, opts.clone(), None).unwrap();
    assert_eq!(spare_len(&s), Some(opts.segment_bytes as usize));
    let mut rollovers = 0;
    for i in 1..=2000 {
        let before = j.segments();
        j.append(&payload(i));
        assert!(j.wait_durable(i));
        if j.segments() > before {
            rollovers += 1;
            assert_eq!(
                spare_len(&s),
                Some(opts.segment_bytes as usize),
                "record {i}"
            );
        }
    }
    assert!(rollovers >= 2, "segments rolled over");
    j.shutdown();
    let (got, rep) = collect(s.as_ref(), 0);
    assert_eq!(rep.last_lsn, 2000);
    assert_eq!(got.len(), 2000);
}

use kochab_journal::segment::{list_segments, segment_name};
use kochab_journal::{Journal, JournalOptions, recover};
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
    let rep = recover(s, after, |l, p| {
        got.push((l, p.to_vec()));
        Ok(())
    })
    .unwrap();
    (got, rep)
}

#[test]
fn records_survive_across_segments_and_restarts() {
    let (_d, s) = store();
    let j = Journal::start(s.clone(), 1, small(), None).unwrap();
    for i in 1..=2000 {
        assert_eq!(j.append(&payload(i)), i);
    }
    assert!(j.wait_durable(2000));
    j.shutdown();
    assert!(
        list_segments(s.as_ref()).unwrap().len() >= 2,
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
    let j = Journal::start(s.clone(), 2001, small(), None).unwrap();
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
    let j = Journal::start(s.clone(), 1, small(), None).unwrap();
    for i in 1..=10 {
        j.append(&payload(i));
    }
    assert!(j.wait_durable(10));
    drop(j);
    // Tear the last record: flip a byte in its middle, as a partially written page would.
    let path = dir.path().join(segment_name(1));
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
    let j = Journal::start(s.clone(), rep2.last_lsn + 1, small(), None).unwrap();
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
    let j = Journal::start(s.clone(), 1, small(), None).unwrap();
    for i in 1..=3000 {
        j.append(&payload(i));
    }
    assert!(j.wait_durable(3000));
    let before = list_segments(s.as_ref()).unwrap().len();
    let removed = j.trim(2500).unwrap();
    assert!(removed > 0);
    assert_eq!(
        list_segments(s.as_ref()).unwrap().len(),
        before - removed as usize
    );
    drop(j);
    let (got, rep) = collect(s.as_ref(), 2499);
    assert_eq!(got.first().unwrap().0, 2500);
    assert_eq!(rep.last_lsn, 3000);
    // Asking for records that were trimmed is an error, not silent loss.
    assert!(recover(s.as_ref(), 10, |_, _| Ok(())).is_err());
}

#[test]
fn concurrent_appenders_get_dense_lsns_and_group_commits() {
    let (_d, s) = store();
    let j = Arc::new(Journal::start(s.clone(), 1, JournalOptions::default(), None).unwrap());
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
    let j = Journal::start(s.clone(), 1, small(), None).unwrap();
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
    let j = Journal::start(s.clone(), 1, small(), None).unwrap();
    let big = vec![7u8; 3000];
    for _ in 0..4 {
        let l = j.append(&big);
        assert!(j.wait_durable(l));
    }
    drop(j);
    let path = dir.path().join(segment_name(1));
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

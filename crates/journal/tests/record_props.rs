//! Property tests of record decoding and recovery over damaged journals: whatever the bytes
//! of the segments are, scanning and recovery never panic, every record recovery hands out
//! is exactly a record that was written, in LSN order without a gap (so nothing past the
//! first damage ever comes back), an undamaged journal comes back whole, and after
//! `repair_accept_loss` the journal is one valid chain again.
//!
//! Case counts are set per test (see `cases`); `PROPTEST_CASES=N` runs N cases of each
//! instead (docs/TESTING.md). The store is in memory, so a case costs no disk I/O.

use kochab_journal::record::{RECORD_HEADER_BYTES, Scan, encode_record, scan, scan_limited};
use kochab_journal::segment::{
    BLOCK, JournalId, LSN_MAX, SEGMENT_DATA_START, decode_header, encode_header, segment_name,
};
use kochab_journal::{inspect, recover, repair_accept_loss};
use kochab_store::{MemStore, ObjectStore};
use proptest::collection::vec;
use proptest::prelude::*;

/// The one journal these tests write (server 1 at epoch 1); records carry its epoch.
const JID: JournalId = JournalId {
    server: 1,
    epoch: 1,
};

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases: n,
        ..ProptestConfig::default()
    }
}

// ---- journals and their damage --------------------------------------------------------------

/// A journal as the writer lays it out: records packed from the data start of each
/// segment, a record that does not fit starting the next segment (named by its LSN),
/// zeros after the last record, every segment its created length.
struct Written {
    store: MemStore,
    /// Segment names in order.
    segments: Vec<String>,
    /// payloads[i] is the record with LSN `first + i`.
    first: u64,
    payloads: Vec<Vec<u8>>,
}

fn write_journal(first: u64, payloads: Vec<Vec<u8>>, seg_blocks: u64) -> Written {
    let seg_bytes = SEGMENT_DATA_START + seg_blocks * BLOCK as u64;
    let store = MemStore::new();
    let mut segments: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, p) in payloads.iter().enumerate() {
        let lsn = first + i as u64;
        let need = (RECORD_HEADER_BYTES + p.len()) as u64;
        let fits = segments
            .last()
            .is_some_and(|(_, d)| d.len() as u64 + need <= seg_bytes);
        if !fits {
            let mut d = encode_header(lsn, seg_bytes).to_vec();
            d.resize(SEGMENT_DATA_START as usize, 0);
            segments.push((segment_name(JID, lsn), d));
        }
        if let Some((_, d)) = segments.last_mut() {
            encode_record(d, lsn, JID.epoch, p).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let mut names = Vec::new();
    for (name, mut d) in segments {
        d.resize(seg_bytes as usize, 0);
        store.put(&name, &d).unwrap_or_else(|e| panic!("{e}"));
        names.push(name);
    }
    // The writer keeps a zero-filled spare next to the segments.
    store
        .put(&JID.spare_name(), &vec![0u8; seg_bytes as usize])
        .unwrap_or_else(|e| panic!("{e}"));
    Written {
        store,
        segments: names,
        first,
        payloads,
    }
}

#[derive(Clone, Debug)]
enum Damage {
    /// XOR a byte (never with 0) at a position of a segment.
    Flip {
        seg: usize,
        at: prop::sample::Index,
        xor: u8,
    },
    /// Zero a range of a segment.
    Zero {
        seg: usize,
        at: prop::sample::Index,
        len: usize,
    },
    /// Cut a segment short.
    Truncate { seg: usize, at: prop::sample::Index },
    /// Remove a segment.
    Delete { seg: usize },
    /// Put another segment's bytes under this one's name.
    CopyFrom { seg: usize, from: usize },
    /// An object with a segment's name and arbitrary contents.
    Stray { lsn: u64, bytes: Vec<u8> },
    /// A segment with a valid header for `lsn` and valid records or garbage; `lsn` is out
    /// of range or past the journal's end, so its records are never ones written before.
    StrayHeader {
        lsn: u64,
        blocks: u64,
        bytes: Vec<u8>,
    },
    /// Append bytes to a segment.
    Append { seg: usize, bytes: Vec<u8> },
}

fn damage() -> impl Strategy<Value = Damage> {
    let seg = 0usize..4;
    prop_oneof![
        4 => (seg.clone(), any::<prop::sample::Index>(), 1u8..=255)
            .prop_map(|(seg, at, xor)| Damage::Flip { seg, at, xor }),
        1 => (seg.clone(), any::<prop::sample::Index>(), 1usize..200)
            .prop_map(|(seg, at, len)| Damage::Zero { seg, at, len }),
        2 => (seg.clone(), any::<prop::sample::Index>())
            .prop_map(|(seg, at)| Damage::Truncate { seg, at }),
        1 => seg.clone().prop_map(|seg| Damage::Delete { seg }),
        1 => (seg.clone(), seg.clone()).prop_map(|(seg, from)| Damage::CopyFrom { seg, from }),
        1 => (0u64..80, vec(any::<u8>(), 0..5000))
            .prop_map(|(lsn, bytes)| Damage::Stray { lsn, bytes }),
        1 => (prop_oneof![Just(0u64), 1000u64..1010, (LSN_MAX - 2)..=(LSN_MAX + 2), Just(u64::MAX)], 0u64..3, vec(any::<u8>(), 0..200))
            .prop_map(|(lsn, blocks, bytes)| Damage::StrayHeader { lsn, blocks, bytes }),
        1 => (seg, vec(any::<u8>(), 1..64)).prop_map(|(seg, bytes)| Damage::Append { seg, bytes }),
    ]
}

/// Applies `d`; false if it changed nothing (no such segment, or the same bytes).
fn apply_damage(w: &Written, d: &Damage) -> bool {
    let s = &w.store;
    let name = |seg: usize| w.segments.get(seg % w.segments.len().max(1)).cloned();
    let get = |n: &str| s.get(n).ok().flatten();
    let put = |n: &str, data: &[u8]| s.put(n, data).is_ok();
    match d {
        Damage::Flip { seg, at, xor } => {
            let Some(n) = name(*seg) else { return false };
            let Some(mut data) = get(&n) else {
                return false;
            };
            if data.is_empty() {
                return false;
            }
            let i = at.index(data.len());
            data[i] ^= xor;
            put(&n, &data)
        }
        Damage::Zero { seg, at, len } => {
            let Some(n) = name(*seg) else { return false };
            let Some(mut data) = get(&n) else {
                return false;
            };
            if data.is_empty() {
                return false;
            }
            let i = at.index(data.len());
            let end = (i + len).min(data.len());
            let before = data.clone();
            data[i..end].fill(0);
            data != before && put(&n, &data)
        }
        Damage::Truncate { seg, at } => {
            let Some(n) = name(*seg) else { return false };
            let Some(mut data) = get(&n) else {
                return false;
            };
            if data.is_empty() {
                return false;
            }
            data.truncate(at.index(data.len()));
            put(&n, &data)
        }
        Damage::Delete { seg } => {
            let Some(n) = name(*seg) else { return false };
            get(&n).is_some() && s.delete(&n).is_ok()
        }
        Damage::CopyFrom { seg, from } => {
            let (Some(n), Some(f)) = (name(*seg), name(*from)) else {
                return false;
            };
            match (get(&n), get(&f)) {
                (Some(a), Some(b)) if a != b => put(&n, &b),
                (None, Some(b)) => put(&n, &b),
                _ => false,
            }
        }
        Damage::Stray { lsn, bytes } => {
            let n = segment_name(JID, *lsn);
            get(&n).as_deref() != Some(&bytes[..]) && put(&n, bytes)
        }
        Damage::StrayHeader { lsn, blocks, bytes } => {
            let n = segment_name(JID, *lsn);
            let len = SEGMENT_DATA_START + blocks * BLOCK as u64;
            let mut d = encode_header(*lsn, len).to_vec();
            d.resize(SEGMENT_DATA_START as usize, 0);
            // Records at the LSNs the header promises, or garbage.
            if bytes.first().is_some_and(|b| b % 2 == 0) {
                for (i, chunk) in bytes.chunks(16).enumerate() {
                    let _ = encode_record(&mut d, lsn.wrapping_add(i as u64), JID.epoch, chunk);
                }
            } else {
                d.extend_from_slice(bytes);
            }
            d.resize((len as usize).max(d.len()), 0);
            get(&n).as_deref() != Some(&d[..]) && put(&n, &d)
        }
        Damage::Append { seg, bytes } => {
            let Some(n) = name(*seg) else { return false };
            let Some(mut data) = get(&n) else {
                return false;
            };
            data.extend_from_slice(bytes);
            put(&n, &data)
        }
    }
}

/// What recovery handed out, and its result.
type Recovered = (
    Vec<(u64, Vec<u8>)>,
    Result<kochab_journal::RecoveryReport, String>,
);

/// Runs recovery.
fn run_recover(store: &MemStore, after: u64) -> Recovered {
    let mut got = Vec::new();
    let r = recover(store, JID, after, |lsn, p| {
        got.push((lsn, p.to_vec()));
        Ok(())
    })
    .map_err(|e| e.to_string());
    (got, r)
}

/// Every record handed out is the record written with that LSN, in order from
/// `after + 1` without a gap: nothing damaged, and nothing past damage.
fn check_prefix(w: &Written, after: u64, got: &[(u64, Vec<u8>)]) -> Result<(), TestCaseError> {
    for (k, (lsn, p)) in got.iter().enumerate() {
        prop_assert_eq!(*lsn, after + 1 + k as u64, "records in order without a gap");
        let i = lsn.checked_sub(w.first);
        let want = i.and_then(|i| w.payloads.get(i as usize));
        prop_assert_eq!(Some(p), want, "record {} is one that was written", lsn);
    }
    Ok(())
}

fn payloads() -> impl Strategy<Value = Vec<Vec<u8>>> {
    vec(vec(any::<u8>(), 0..900), 1..40)
}

proptest! {
    #![proptest_config(cases(400))]

    /// An undamaged journal comes back whole, from any replay point inside it.
    #[test]
    fn undamaged_journals_recover_whole(first in 1u64..5, ps in payloads(), blocks in 1u64..4,
                                        skip in 0usize..40) {
        let w = write_journal(first, ps, blocks);
        let after = first - 1 + (skip % (w.payloads.len() + 1)) as u64;
        let (got, r) = run_recover(&w.store, after);
        let rep = r.map_err(TestCaseError::fail)?;
        check_prefix(&w, after, &got)?;
        let last = first + w.payloads.len() as u64 - 1;
        prop_assert_eq!(rep.last_lsn, last);
        prop_assert_eq!(got.len() as u64, last - after);
        prop_assert!(rep.cut.is_none());
        let ins = inspect(&w.store, JID).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(ins.damage.is_none());
        prop_assert_eq!(ins.chain_end, last);
    }

    /// Damaged journals: recovery never panics and hands out only a gap-free prefix of what
    /// was written. When it succeeds, a second recovery agrees and cuts nothing more.
    /// Inspection and repair never panic, and after a repair the journal has no damage.
    #[test]
    fn damaged_journals_never_yield_records_past_damage(
        first in 1u64..5, ps in payloads(), blocks in 1u64..4,
        damages in vec(damage(), 1..4), skip in 0usize..3,
    ) {
        let w = write_journal(first, ps, blocks);
        let after = first - 1 + skip.min(w.payloads.len()) as u64;
        let mut changed = false;
        for d in &damages {
            changed |= apply_damage(&w, d);
        }
        let fresh = w.store.deep_clone();
        let (got, r) = run_recover(&w.store, after);
        check_prefix(&w, after, &got)?;
        if !changed {
            prop_assert!(r.is_ok(), "undamaged: {:?}", r);
        }
        if let Ok(rep) = &r {
            let expect_last = got.last().map_or(after, |(l, _)| *l);
            prop_assert_eq!(rep.last_lsn, expect_last);
            let (again, r2) = run_recover(&w.store, after);
            let rep2 = r2.map_err(TestCaseError::fail)?;
            prop_assert!(rep2.cut.is_none(), "a cut is made once: {:?}", rep2.cut);
            prop_assert_eq!(&again, &got);
        }
        // Read-only inspection and the explicit repair, on the damaged bytes.
        let ins = inspect(&fresh, JID).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let repair = repair_accept_loss(&fresh, JID).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(repair.kept_through, ins.chain_end);
        let after_repair = inspect(&fresh, JID).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(after_repair.damage.is_none(), "still damaged after repair: {:?}", after_repair.damage);
        let (got, _) = run_recover(&fresh, after);
        check_prefix(&w, after, &got)?;
    }
}

proptest! {
    #![proptest_config(cases(3000))]

    /// Any bytes at any expected LSN: the record scanner answers without panicking, and a
    /// record it returns lies inside the buffer and carries the LSN asked for.
    #[test]
    fn scanning_arbitrary_bytes_never_panics(buf in vec(any::<u8>(), 0..128), lsn in any::<u64>(),
                                             limit in 0usize..200) {
        for r in [scan(&buf, lsn), scan_limited(&buf, lsn, limit)] {
            if let Scan::Record { lsn: l, payload, len, .. } = r {
                prop_assert_eq!(l, lsn);
                prop_assert!(len <= buf.len());
                prop_assert_eq!(payload.len() + RECORD_HEADER_BYTES, len);
            }
        }
        let _ = decode_header(&buf);
    }

    /// A record with any payload round-trips; any single damaged byte is caught.
    #[test]
    fn records_round_trip_and_damage_is_caught(payload in vec(any::<u8>(), 0..300), lsn in any::<u64>(),
                                               at in any::<prop::sample::Index>(), xor in 1u8..=255) {
        let mut buf = Vec::new();
        let n = encode_record(&mut buf, lsn, JID.epoch, &payload).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(n, buf.len());
        match scan(&buf, lsn) {
            Scan::Record { lsn: l, payload: p, len, epoch } => {
                prop_assert_eq!(l, lsn);
                prop_assert_eq!(p, &payload[..]);
                prop_assert_eq!(len, n);
                prop_assert_eq!(epoch, JID.epoch);
            }
            other => prop_assert!(false, "{:?}", other),
        }
        let i = at.index(buf.len());
        buf[i] ^= xor;
        let damaged_record = matches!(scan(&buf, lsn), Scan::Record { .. });
        prop_assert!(!damaged_record, "byte {} damaged", i);
    }
}

/// Found by `damaged_journals_never_yield_records_past_damage`: with the first segment gone,
/// recovery handed the next segment's records (LSN 7 on, where 1 was needed) to the caller
/// before it reported the gap.
#[test]
fn records_after_a_missing_first_segment_are_never_handed_out() {
    let w = write_journal(1, vec![vec![5u8; 1500]; 12], 1);
    assert!(w.segments.len() >= 2);
    w.store.delete(&w.segments[0]).unwrap();
    let (got, r) = run_recover(&w.store, 0);
    assert!(
        got.is_empty(),
        "handed out {:?}",
        got.iter().map(|g| g.0).collect::<Vec<_>>()
    );
    let err = r.unwrap_err();
    assert!(err.contains("records after 0 are needed"), "{err}");
}

/// Found by the damage property in a debug build: a checksummed segment header naming LSN
/// 0 or 2^64 - 1 overflowed recovery's LSN arithmetic (a panic with overflow checks, and in
/// release a wrapped chain end of 2^64 - 1 and no damage reported).
#[test]
fn segments_naming_impossible_lsns_are_damage() {
    for lsn in [0, u64::MAX] {
        let store = MemStore::new();
        let mut d = encode_header(lsn, SEGMENT_DATA_START + BLOCK as u64).to_vec();
        d.resize(SEGMENT_DATA_START as usize, 0);
        encode_record(&mut d, lsn, JID.epoch, b"crafted").unwrap();
        d.resize(SEGMENT_DATA_START as usize + BLOCK, 0);
        store.put(&segment_name(JID, lsn), &d).unwrap();
        let ins = inspect(&store, JID).unwrap();
        assert!(ins.damage.is_some(), "LSN {lsn}: {ins:?}");
        assert_eq!(ins.chain_end, lsn.saturating_sub(1), "LSN {lsn}");
        // As the only segment, a bad header is a torn tail: cut, nothing handed out.
        let copy = store.deep_clone();
        let (got, _) = run_recover(&copy, 0);
        assert!(got.is_empty(), "LSN {lsn}: {got:?}");
        let repair = repair_accept_loss(&store, JID).unwrap();
        assert!(repair.damage.is_some());
        assert!(inspect(&store, JID).unwrap().damage.is_none());
    }
}

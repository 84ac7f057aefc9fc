//! Journal records and recovery: the record scanner over any bytes, and recovery,
//! inspection and repair of a journal whose segments are the input (the first segment
//! behind a valid header, so that the fuzzer reaches the records). Records handed out are
//! gap-free from LSN 1; nothing panics.
#![no_main]

use kochab_journal::record::{Scan, scan};
use kochab_journal::segment::{
    BLOCK, JournalId, SEGMENT_DATA_START, decode_header, encode_header, segment_name,
};
use kochab_journal::{inspect, recover, repair_accept_loss};
use kochab_store::{MemStore, ObjectStore};
use libfuzzer_sys::fuzz_target;

/// The one journal the input becomes (server 1 at epoch 1).
const JID: JournalId = JournalId {
    server: 1,
    epoch: 1,
};

fuzz_target!(|data: &[u8]| {
    let mut off = 0;
    let mut lsn = 1;
    while off < data.len() {
        match scan(&data[off..], lsn) {
            Scan::Record { len, .. } => {
                off += len;
                lsn += 1;
            }
            _ => break,
        }
    }
    let _ = decode_header(data);

    // Segments: the input split at 0xff 0xfe markers; the first gets a valid header.
    let store = MemStore::new();
    let mut first = 1u64;
    for (k, part) in data.split(|&b| b == 0xfe).enumerate() {
        let mut seg = if k == 0 {
            let len = SEGMENT_DATA_START + BLOCK as u64;
            let mut s = encode_header(1, len).to_vec();
            s.resize(SEGMENT_DATA_START as usize, 0);
            s
        } else {
            Vec::new()
        };
        seg.extend_from_slice(part);
        let _ = store.put(&segment_name(JID, first), &seg);
        first += 1 + part.len() as u64 / 16;
    }
    let copy = store.deep_clone();
    let mut next = 1;
    let _ = recover(&store, JID, 0, |l, _| {
        assert_eq!(l, next, "records are handed out in order without a gap");
        next += 1;
        Ok(())
    });
    let _ = inspect(&copy, JID);
    if repair_accept_loss(&copy, JID).is_ok() {
        let after = inspect(&copy, JID).expect("inspect after repair");
        assert!(
            after.damage.is_none(),
            "damage left after repair: {:?}",
            after.damage
        );
    }
});

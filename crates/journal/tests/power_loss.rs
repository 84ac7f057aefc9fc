//! The journal over a store that loses what was not synced (`MemStore::crash_image`: a
//! power cut at that moment, unsynced changes dropped whole or torn per 4 KiB block): at
//! any moment of a running journal, every record it reported durable is recovered, with
//! its payload, in order; what is recovered past that is a prefix of what was appended.
//! A journal that acknowledged before its write was synced (the fdatasync of a group
//! commit, a segment's rename before its folder sync) fails this.

use kochab_journal::{JournalId, JournalOptions, recover};
use kochab_store::{MemLoss, MemStore};
use std::sync::Arc;

/// Crash images taken per run; each is recovered and checked.
const IMAGES: u64 = 120;

/// xorshift64*: small and seeded.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn payload(lsn: u64) -> Vec<u8> {
    // Sizes from a few bytes to several blocks, so that group commits span blocks and
    // segments roll over often.
    let len = (lsn * 2_654_435_761 % 9000) as usize + 1;
    (0..len).map(|i| (lsn as usize + i) as u8).collect()
}

fn run(seed: u64) {
    let mut rng = Rng(seed | 1);
    let store = MemStore::new();
    let id = JournalId {
        server: 1,
        epoch: 1,
    };
    let options = JournalOptions {
        segment_bytes: 64 << 10,
        fsync: true,
        ..Default::default()
    };
    let journal = kochab_journal::Journal::start(Arc::new(store.clone()), id, 1, options, None)
        .expect("journal");
    let mut appended = 0u64;
    let mut reported = 0u64;
    for image in 0..IMAGES {
        for _ in 0..rng.below(12) {
            appended = journal.append(&payload(appended + 1));
        }
        if rng.below(4) == 0 {
            assert!(journal.wait_durable(appended));
        }
        // What the journal said was durable before the cut.
        let durable = journal.durable_lsn();
        let loss = if image % 2 == 0 {
            MemLoss::Drop
        } else {
            MemLoss::Tear { seed: rng.next() }
        };
        let img = store.crash_image(loss);
        let mut next = 1u64;
        let report = recover(&img, id, 0, |lsn, p| {
            if lsn != next {
                return Err(format!("record {lsn} handed out after {}", next - 1).into());
            }
            if p != payload(lsn).as_slice() {
                return Err(format!("record {lsn} has other bytes than appended").into());
            }
            next += 1;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("seed {seed}, image {image} ({loss:?}): recovery failed: {e}"));
        assert!(
            report.last_lsn >= durable,
            "seed {seed}, image {image} ({loss:?}): {durable} records were reported durable, \
             {} recovered",
            report.last_lsn
        );
        assert!(report.last_lsn <= appended);
        reported = reported.max(durable);
    }
    journal.shutdown();
    assert!(reported > 0);
}

#[test]
fn every_record_reported_durable_survives_a_power_loss() {
    let base = std::env::var("KOCHAB_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_u64);
    for k in 0..4 {
        run(base.wrapping_add(k));
    }
}

//! Checkpoint loading: the input as one image of the root's table, raw and also cut into
//! checksummed records (so that the fuzzer reaches the box-image decoder and the table
//! loader); then the engine answers read-only operations. Nothing panics.
#![no_main]

use kochab_journal::record::encode_record_with;
use kochab_meta::{Engine, EngineConfig};
use kochab_proto::{Credentials, Op};
use kochab_server::checkpoint::{
    BOX_IMAGE_BYTES_MAX, ImageRef, Manifest, load_table, swap_manifest,
};
use kochab_store::{MemStore, ObjectStore};
use libfuzzer_sys::fuzz_target;

fn load(image: &[u8]) {
    let Ok(mut e) = Engine::new_cluster(EngineConfig::with_key([1, 2])) else {
        return;
    };
    let Some(idx) = e.table_index(e.root()) else {
        return;
    };
    let (lo, hi) = (e.tables()[idx].lo, e.tables()[idx].hi);
    let store = MemStore::new();
    let mut m = Manifest {
        lo,
        hi,
        images: vec![ImageRef {
            seq: 1,
            bytes: image.len() as u64,
            full: true,
            server: 1,
            epoch: 1,
            // One object, as on a store with positioned I/O.
            parts: 0,
        }],
        next_seq: 2,
        ..Manifest::default()
    };
    let _ = store.put(&format!("tables/{lo:016x}/{:010}.1.1.img", 1), image);
    let _ = swap_manifest(&store, &mut m);
    if load_table(&store, &mut e.tables_mut()[idx], &m).is_err() {
        return;
    }
    let _ = e.rehash_legacy_dentries();
    e.fill_region_next();
    let _ = e.check_invariants();
    let ids: Vec<u64> = e.tables()[idx]
        .iter_inodes()
        .map(|(id, _)| id)
        .take(100)
        .collect();
    let c = Credentials::root();
    for id in ids {
        let mut out = Vec::new();
        for op in [
            Op::GetAttr { id },
            Op::Readdir {
                id,
                cookie: 0,
                max_entries: 20,
                plus: true,
            },
            Op::Lookup {
                parent: id,
                name: b"..".to_vec(),
            },
            Op::ListXattr { id },
        ] {
            let _ = e.execute(&c, &op, 1, &mut out);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    load(data);
    let mut framed = Vec::new();
    for (k, part) in data.split(|&b| b == 0xfe).enumerate() {
        let _ = encode_record_with(&mut framed, k as u64 + 1, 1, BOX_IMAGE_BYTES_MAX, |o| {
            o.extend_from_slice(part)
        });
    }
    load(&framed);
});

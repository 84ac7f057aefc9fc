//! Slice objects over a store of whole objects in memory (as on S3), read through layouts.

use super::*;
use kochab_proto::layout::push_slice;
use kochab_store::MemStore;

fn new_store() -> (MemStore, SliceStore) {
    let mem = MemStore::objects_only();
    let s = SliceStore::new(Arc::new(mem.clone()));
    (mem, s)
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8 + 1)
        .collect()
}

/// A file as a byte vector, and its layout as the engine would keep it.
struct Model {
    bytes: Vec<u8>,
    layout: Vec<(u64, Vec<SliceRef>)>,
    next: u64,
}

impl Model {
    fn write(&mut self, s: &SliceStore, offset: u64, data: &[u8]) {
        let end = offset as usize + data.len();
        if self.bytes.len() < end {
            self.bytes.resize(end, 0);
        }
        self.bytes[offset as usize..end].copy_from_slice(data);
        let mut at = 0;
        for (chunk, within, n) in pieces(offset, data.len() as u64) {
            self.next += 1;
            let r = SliceRef {
                object: self.next,
                pos: within as u32,
                len: n as u32,
            };
            s.put(1, 2, chunk, &r, &data[at..at + n]).unwrap();
            at += n;
            let i = match self.layout.binary_search_by_key(&chunk, |(c, _)| *c) {
                Ok(i) => i,
                Err(i) => {
                    self.layout.insert(i, (chunk, Vec::new()));
                    i
                }
            };
            push_slice(&mut self.layout[i].1, r);
        }
    }
}

#[test]
fn reads_through_a_layout_see_the_newest_ref_and_zeros_elsewhere() {
    let (_mem, s) = new_store();
    let mut m = Model {
        bytes: Vec::new(),
        layout: Vec::new(),
        next: 0,
    };
    m.write(&s, 100, &pattern(1, 300_000));
    m.write(&s, CHUNK_BYTES - 10, &pattern(2, 50));
    m.write(&s, 5000, &pattern(3, 70_000));
    m.write(&s, 3 * CHUNK_BYTES + 7, &pattern(4, 10));
    let size = m.bytes.len() as u64;
    for (offset, len) in [
        (0, size),
        (90, 20),
        (CHUNK_BYTES - 20, 100),
        (200_000, 2 << 20),
    ] {
        let len = len.min(size - offset);
        let got = s.read(1, 2, &m.layout, offset, len).unwrap();
        assert_eq!(
            got,
            m.bytes[offset as usize..(offset + len) as usize],
            "at {offset} for {len}"
        );
    }
}

#[test]
fn a_chunk_reads_back_whole_for_compaction() {
    let (_mem, s) = new_store();
    let mut m = Model {
        bytes: Vec::new(),
        layout: Vec::new(),
        next: 0,
    };
    for i in 0..20u64 {
        m.write(&s, 1000 + i * 3000, &pattern(i, 5000));
    }
    let refs = &m.layout[0].1;
    let (lo, bytes) = s.read_chunk(1, 2, 0, refs).unwrap().unwrap();
    assert_eq!(lo, 1000);
    assert_eq!(bytes, m.bytes[1000..]);
    let zeros = [SliceRef {
        object: 0,
        pos: 0,
        len: 10,
    }];
    assert_eq!(s.read_chunk(1, 2, 0, &zeros).unwrap(), None);
}

#[test]
fn a_missing_object_is_not_found_and_a_wrong_one_is_caught() {
    let (mem, s) = new_store();
    let r = SliceRef {
        object: 9,
        pos: 0,
        len: 10,
    };
    let layout = vec![(0, vec![r])];
    let e = s.read(1, 2, &layout, 0, 10).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    // An object put for another chunk under the name: its header says so.
    s.put(1, 2, 5, &r, &[1u8; 10]).unwrap();
    let e = s.read(1, 2, &layout, 0, 10).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidData);
    // Written once: the name cannot be taken again.
    let e = s.put(1, 2, 0, &r, &[1u8; 10]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    assert_eq!(mem.objects().len(), 1);
}

#[test]
fn only_a_removal_deletes_by_listing_the_folder() {
    let (_mem, s) = new_store();
    for object in 1..=3 {
        let r = SliceRef {
            object,
            pos: 0,
            len: 4,
        };
        s.put(7, 1, 0, &r, b"abcd").unwrap();
    }
    let cut = Reclaim {
        id: 7,
        generation: 1,
        from: 2,
    };
    assert!(s.reclaim_plan(&cut).unwrap().is_empty());
    let gone = Reclaim { from: 0, ..cut };
    let names = s.reclaim_plan(&gone).unwrap();
    assert_eq!(names.len(), 3);
    s.delete_objects(&names).unwrap();
    s.end_reclaim(&gone).unwrap();
    assert_eq!(s.count_objects().unwrap(), 0);
}

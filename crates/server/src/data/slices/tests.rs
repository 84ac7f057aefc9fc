//! The slice layout over a store of whole objects in memory (as on S3).

use super::*;
use kochab_store::MemStore;

fn new_store() -> (MemStore, SliceStore) {
    let mem = MemStore::objects_only();
    let s = SliceStore::new(Arc::new(mem.clone()));
    (mem, s)
}

/// Slice objects in the store.
fn slice_names(mem: &MemStore) -> Vec<String> {
    mem.objects()
        .into_keys()
        .filter(|n| n.starts_with("data/"))
        .collect()
}

fn reclaim(s: &SliceStore, id: InodeId, generation: u64, from: u64) {
    s.reclaim(&Reclaim {
        id,
        generation,
        from,
    })
    .unwrap();
}

/// A file as a byte vector: what the slices must read as.
struct Model(Vec<u8>);

impl Model {
    fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset as usize + data.len();
        if self.0.len() < end {
            self.0.resize(end, 0);
        }
        self.0[offset as usize..end].copy_from_slice(data);
    }
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8 + 1)
        .collect()
}

fn read_all(s: &SliceStore, id: InodeId, generation: u64, size: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < size {
        let n = (size - pos).min(3 << 20) as u32;
        out.extend(s.read(id, generation, size, pos, n).unwrap());
        pos += n as u64;
    }
    out
}

#[test]
fn names_carry_the_extent_and_parse_back() {
    let s = Slice {
        seq: 0x1234,
        offset: 0x3ff000,
        len: 0x1000,
        zeros: false,
    };
    let name = slice_name(5, 9, 3, &s);
    assert_eq!(
        name,
        "data/05/0000000000000005.0000000000000009.s/0000000000000003.0000000000001234.d3ff000.001000"
    );
    assert_eq!(parse_slice(&name), Some((3, s)));
    let z = Slice { zeros: true, ..s };
    assert_eq!(parse_slice(&slice_name(5, 9, 3, &z)), Some((3, z)));
    let full = Slice {
        seq: 1,
        offset: 0,
        len: CHUNK_BYTES as u32,
        zeros: false,
    };
    assert_eq!(parse_slice(&slice_name(1, 1, 0, &full)), Some((0, full)));
    for bad in [
        "x/0000000000000003.0000000000001234.d3ff000.002000", // past the chunk
        "x/0000000000000003.0000000000001234.d000000.000000", // empty
        "x/0000000000000003.0000000000001234.q000000.000010", // no such kind
        "x/0000000000000003.0000000000001234.d000000",        // no length
        "x/0000000000000003.0000000000001234.d000000.000010.x",
    ] {
        assert_eq!(parse_slice(bad), None, "{bad}");
    }
}

#[test]
fn writes_across_chunks_and_holes_read_back() {
    let (mem, s) = new_store();
    let off = CHUNK_BYTES - 3;
    s.write(5, 1, off, b"abcdef").unwrap();
    let size = off + 6;
    assert_eq!(s.read(5, 1, size, off, 100).unwrap(), b"abcdef");
    assert_eq!(s.read(5, 1, size, 0, 4).unwrap(), vec![0; 4], "a hole");
    assert_eq!(
        s.read(5, 2, size, off, 6).unwrap(),
        vec![0; 6],
        "another generation sees nothing"
    );
    assert!(s.read(5, 1, size, size, 10).unwrap().is_empty());
    assert_eq!(slice_names(&mem).len(), 2, "one slice per chunk touched");
    // Far offsets: chunk numbers are u64; a far write costs one slice.
    let far = kochab_proto::FILE_BYTES_MAX - 16;
    s.write(5, 1, far, b"far away").unwrap();
    assert_eq!(
        s.read(5, 1, kochab_proto::FILE_BYTES_MAX, far, 8).unwrap(),
        b"far away"
    );
    // Large writes read back whole, in pieces of any alignment.
    let big = pattern(3, (2 * CHUNK_BYTES + 12345) as usize);
    s.write(6, 1, 777, &big).unwrap();
    let size = 777 + big.len() as u64;
    let mut model = Model(Vec::new());
    model.write(777, &big);
    assert_eq!(read_all(&s, 6, 1, size), model.0);
    assert_eq!(
        s.read(6, 1, size, CHUNK_BYTES - 100_000, 200_001).unwrap(),
        model.0[(CHUNK_BYTES - 100_000) as usize..(CHUNK_BYTES + 100_001) as usize]
    );
}

#[test]
fn overlapping_overwrites_newest_wins() {
    let (_mem, s) = new_store();
    let mut model = Model(Vec::new());
    let writes: [(u64, usize); 6] = [
        (0, 300_000),
        (100_000, 50_000),
        (65_536, 65_536),
        (250_000, 200_000),
        (10, 1),
        (131_071, 2),
    ];
    for (i, &(off, n)) in writes.iter().enumerate() {
        let d = pattern(i as u64 + 1, n);
        s.write(8, 1, off, &d).unwrap();
        model.write(off, &d);
        assert_eq!(
            read_all(&s, 8, 1, model.0.len() as u64),
            model.0,
            "after {i}"
        );
    }
    // A second owner lists the same slices and resolves them the same way.
    let again = SliceStore::new(s.store.clone());
    assert_eq!(read_all(&again, 8, 1, model.0.len() as u64), model.0);
}

#[test]
fn truncate_then_extend_reads_zeros() {
    let (mem, s) = new_store();
    let data = pattern(9, (CHUNK_BYTES + 5000) as usize);
    s.write(9, 1, 0, &data).unwrap();
    s.write(9, 1, 3 * CHUNK_BYTES, b"later chunk").unwrap();
    // Cut at 1000: a zeros slice over the rest of chunk 0, every later chunk deleted.
    reclaim(&s, 9, 1, 1000);
    let names = slice_names(&mem);
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names.iter().any(|n| n.contains(".z0003e8.")), "{names:?}");
    let size = 4 * CHUNK_BYTES;
    let back = read_all(&s, 9, 1, size);
    assert_eq!(&back[..1000], &data[..1000]);
    assert!(
        back[1000..].iter().all(|&b| b == 0),
        "the cut bytes stay gone"
    );
    // So does a new owner that lists the folder.
    let again = SliceStore::new(s.store.clone());
    assert_eq!(read_all(&again, 9, 1, size), back);
    // A cut on a chunk boundary deletes that chunk.
    s.write(9, 2, 0, &pattern(1, (2 * CHUNK_BYTES) as usize))
        .unwrap();
    reclaim(&s, 9, 2, CHUNK_BYTES);
    assert!(
        s.read(9, 2, 2 * CHUNK_BYTES, CHUNK_BYTES, 100)
            .unwrap()
            .iter()
            .all(|&b| b == 0)
    );
    assert_eq!(
        s.existing_chunks(9, 2, 0..=u64::MAX).unwrap(),
        vec![0],
        "chunk 1 is gone"
    );
}

#[test]
fn zeroing_writes_zeros_slices_or_deletes_whole_chunks() {
    let (mem, s) = new_store();
    let mut model = Model(Vec::new());
    let data = pattern(4, (3 * CHUNK_BYTES) as usize);
    s.write(3, 1, 0, &data).unwrap();
    model.write(0, &data);
    let zero = |offset: u64, len: u64| {
        let chunks = s
            .existing_chunks(3, 1, super::super::chunk_span(offset, len))
            .unwrap();
        s.zero(3, 1, offset, len, &chunks).unwrap();
    };
    zero(10, 20);
    model.write(10, &[0; 20]);
    // Covers chunk 1 whole and parts of 0 and 2.
    zero(CHUNK_BYTES - 5, CHUNK_BYTES + 10);
    model.write(CHUNK_BYTES - 5, &vec![0; (CHUNK_BYTES + 10) as usize]);
    assert_eq!(read_all(&s, 3, 1, model.0.len() as u64), model.0);
    assert_eq!(s.existing_chunks(3, 1, 0..=10).unwrap(), vec![0, 2]);
    assert!(
        !slice_names(&mem)
            .iter()
            .any(|n| n.contains(".s/0000000000000001.")),
        "the covered chunk's slices are gone"
    );
}

#[test]
fn compaction_keeps_bytes_and_bounds_slices() {
    let (mem, s) = new_store();
    let mut model = Model(Vec::new());
    // 40 overlapping writes into chunk 0 (and a few into chunk 1).
    for i in 0..40u64 {
        let off = (i * 37_000) % 900_000 + if i % 9 == 0 { CHUNK_BYTES } else { 0 };
        let d = pattern(i + 100, 70_000 + (i as usize * 1000));
        s.write(2, 1, off, &d).unwrap();
        model.write(off, &d);
        let n = s
            .file(2, 1)
            .unwrap()
            .state
            .lock()
            .chunks
            .get(&0)
            .map_or(0, Vec::len);
        assert!(n <= COMPACT_SLICES_MAX, "{n} slices after write {i}");
    }
    assert_eq!(read_all(&s, 2, 1, model.0.len() as u64), model.0);
    assert!(slice_names(&mem).len() <= 2 * COMPACT_SLICES_MAX);
    let again = SliceStore::new(s.store.clone());
    assert_eq!(read_all(&again, 2, 1, model.0.len() as u64), model.0);
}

#[test]
fn a_crash_between_merge_and_deletion_reads_the_same() {
    let (mem, s) = new_store();
    let mut model = Model(Vec::new());
    for i in 0..COMPACT_SLICES_MAX as u64 {
        let d = pattern(i, 50_000);
        s.write(4, 1, i * 20_000, &d).unwrap();
        model.write(i * 20_000, &d);
    }
    let before = mem.objects();
    // The next write makes the chunk too many: merged, then the merged ones deleted.
    let d = pattern(99, 10);
    s.write(4, 1, 5, &d).unwrap();
    model.write(5, &d);
    let after = mem.objects();
    assert!(after.len() < before.len(), "compacted");
    // A crash before the deletions: both the merged slice and those it merged.
    let crashed = MemStore::objects_only();
    for (name, bytes) in before.iter().chain(after.iter()) {
        crashed.put(name, bytes).unwrap();
    }
    let next = SliceStore::new(Arc::new(crashed.clone()));
    let size = model.0.len() as u64;
    assert_eq!(read_all(&next, 4, 1, size), model.0);
    // Work goes on from there: writes win over both, and the duplicates merge away.
    for i in 0..COMPACT_SLICES_MAX as u64 + 2 {
        let d = pattern(i + 50, 3000);
        next.write(4, 1, i * 4000, &d).unwrap();
        model.write(i * 4000, &d);
    }
    assert_eq!(read_all(&next, 4, 1, size), model.0);
    assert!(slice_names(&crashed).len() <= COMPACT_SLICES_MAX);
}

#[test]
fn reclaim_deletes_everything() {
    let (mem, s) = new_store();
    for i in 0..5u64 {
        s.write(7, 1, i * CHUNK_BYTES + i, &pattern(i, 100_000))
            .unwrap();
        s.write(7, 1, i * CHUNK_BYTES, &pattern(i + 9, 10)).unwrap();
    }
    s.write(7, 2, 0, b"another generation").unwrap();
    // Slices the index never saw (another owner's) go too: reclaim lists the folder.
    let other = SliceStore::new(s.store.clone());
    other.write(7, 1, 1 << 40, b"unseen").unwrap();
    reclaim(&s, 7, 1, 0);
    let left = slice_names(&mem);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].contains(".0000000000000002.s/"));
    assert!(s.files.lock().get(&(7, 1)).is_none(), "the index goes too");
    reclaim(&s, 7, 1, 0);
    reclaim(&s, 7, 2, 0);
    assert!(slice_names(&mem).is_empty());
}

#[test]
fn a_second_owner_continues_the_seqs() {
    let (mem, first) = new_store();
    first.write(1, 1, 0, &pattern(1, 1000)).unwrap();
    first.write(1, 1, 500, &pattern(2, 1000)).unwrap();
    // The file's table moves: its next owner lists the folder and writes above it.
    let second = SliceStore::new(Arc::new(mem.clone()));
    second.write(1, 1, 0, b"second owner").unwrap();
    let mut model = Model(Vec::new());
    model.write(0, &pattern(1, 1000));
    model.write(500, &pattern(2, 1000));
    model.write(0, b"second owner");
    assert_eq!(read_all(&second, 1, 1, 1500), model.0);
    let seqs: Vec<u64> = slice_names(&mem)
        .iter()
        .filter_map(|n| parse_slice(n))
        .map(|(_, s)| s.seq)
        .collect();
    assert_eq!(seqs, vec![1, 2, 3]);
    // The first owner, unaware (fenced, say), takes a name the second has: its create is
    // refused, it lists again and writes above.
    first.write(1, 1, 0, b"second owner").unwrap();
    let seqs: Vec<u64> = slice_names(&mem)
        .iter()
        .filter_map(|n| parse_slice(n))
        .map(|(_, s)| s.seq)
        .collect();
    assert_eq!(seqs, vec![1, 2, 3, 4], "seq 3 refused, 4 taken");
    // A third owner sees the same bytes as everyone.
    let third = SliceStore::new(Arc::new(mem.clone()));
    assert_eq!(read_all(&third, 1, 1, 1500), model.0);
}

#[test]
fn a_new_file_needs_no_listing_and_a_moved_table_is_listed_again() {
    let (mem, s) = new_store();
    s.created(3, 1);
    s.write(3, 1, 0, b"new").unwrap();
    // Another server writes the file (the table moved away and back): forgetting the
    // range makes the next touch list it.
    let other = SliceStore::new(Arc::new(mem.clone()));
    other.write(3, 1, 0, b"NEW").unwrap();
    assert_eq!(s.read(3, 1, 3, 0, 3).unwrap(), b"new", "stale, as cached");
    s.forget_range(0, 4);
    assert_eq!(s.read(3, 1, 3, 0, 3).unwrap(), b"NEW");
}

#[test]
fn a_damaged_slice_is_an_error_not_bytes() {
    let (mem, s) = new_store();
    s.write(6, 1, 0, &pattern(6, 200_000)).unwrap();
    let name = slice_names(&mem).pop().unwrap();
    let mut bytes = mem.get(&name).unwrap().unwrap();
    bytes[HEADER_BYTES + 70_000] ^= 1;
    mem.put(&name, &bytes).unwrap();
    let fresh = SliceStore::new(Arc::new(mem.clone()));
    assert_eq!(
        fresh.read(6, 1, 200_000, 0, 1000).unwrap(),
        pattern(6, 1000),
        "an intact block still reads"
    );
    let e = fresh.read(6, 1, 200_000, 60_000, 20_000).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
}

/// Random writes, zeroing and truncation against a byte vector, reread by a second owner
/// at the end.
#[test]
fn random_operations_match_a_model() {
    let (_mem, s) = new_store();
    let mut model = Model(Vec::new());
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rand = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let span = 3 * CHUNK_BYTES;
    for step in 0..300u64 {
        match rand(10) {
            0 => {
                let (off, len) = (rand(span), rand(CHUNK_BYTES) + 1);
                let chunks = s
                    .existing_chunks(1, 1, super::super::chunk_span(off, len))
                    .unwrap();
                s.zero(1, 1, off, len, &chunks).unwrap();
                if (off as usize) < model.0.len() {
                    let end = ((off + len) as usize).min(model.0.len());
                    model.0[off as usize..end].fill(0);
                }
            }
            1 => {
                let to = rand(model.0.len() as u64 + 1);
                reclaim(&s, 1, 1, to);
                model.0.truncate(to as usize);
            }
            _ => {
                let off = rand(span);
                let len = 1 + if rand(3) == 0 {
                    rand(1 << 20)
                } else {
                    rand(9000)
                };
                let d = pattern(step, len as usize);
                s.write(1, 1, off, &d).unwrap();
                model.write(off, &d);
            }
        }
        if step % 25 == 0 {
            let size = model.0.len() as u64;
            assert_eq!(read_all(&s, 1, 1, size), model.0, "step {step}");
        }
    }
    let size = model.0.len() as u64;
    assert_eq!(read_all(&s, 1, 1, size), model.0);
    let again = SliceStore::new(s.store.clone());
    assert_eq!(read_all(&again, 1, 1, size), model.0);
    for list in s.file(1, 1).unwrap().state.lock().chunks.values() {
        assert!(list.len() <= COMPACT_SLICES_MAX + 1);
    }
}

/// Writers of one chunk at once (as under the shared file lock) and readers beside them:
/// compaction runs between writes but never hides one still in flight, and a read whose
/// slices a compaction deleted under it reads the merged one.
#[test]
fn concurrent_writes_and_reads_of_one_chunk_lose_nothing() {
    let (_mem, s) = new_store();
    let s = Arc::new(s);
    const WRITERS: u64 = 6;
    const ROUNDS: u64 = 60;
    const PIECE: u64 = 3000;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let s = s.clone();
            std::thread::spawn(move || {
                for r in 0..ROUNDS {
                    let off = (r * WRITERS + w) * PIECE;
                    s.write(11, 1, off, &pattern(r * WRITERS + w, PIECE as usize))
                        .unwrap();
                }
            })
        })
        .collect();
    let size = WRITERS * ROUNDS * PIECE;
    let reader = {
        let s = s.clone();
        std::thread::spawn(move || {
            for _ in 0..50 {
                assert_eq!(
                    s.read(11, 1, size, 0, size as u32).unwrap().len() as u64,
                    size
                );
            }
        })
    };
    for w in writers {
        w.join().unwrap();
    }
    reader.join().unwrap();
    let mut model = Model(Vec::new());
    for k in 0..WRITERS * ROUNDS {
        model.write(k * PIECE, &pattern(k, PIECE as usize));
    }
    assert_eq!(read_all(&s, 11, 1, size), model.0);
    let again = SliceStore::new(s.store.clone());
    assert_eq!(read_all(&again, 11, 1, size), model.0);
}

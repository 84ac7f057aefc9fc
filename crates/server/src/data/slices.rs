//! File data as immutable slice objects, for a store without positioned I/O (S3): the file
//! data of a server's inodes lives in the store every host shares, so when a host fails its
//! files' next owner reads their data.
//!
//! A chunk's bytes are a sequence of slices, each an object created once (conditional
//! create, never overwritten) in the file generation's folder:
//! `data/<id & 0xff>/<id>.<generation>.s/<chunk>.<seq>.<kind><offset>.<len>` (chunk and seq
//! 16 hex digits, kind `d` for data or `z` for zeros, offset and length within the chunk 6
//! hex digits). The name carries the slice's extent, so that one LIST of the folder is all
//! it takes to know every slice of the file and where it lies (with the extent only in the
//! object's header, building that knowledge would cost a GET per slice). Where slices
//! overlap, the higher seq wins; bytes no slice covers, and bytes of a zeros slice, read as
//! zeros. Zeroing, hole punching and truncation write a zeros slice (its header only) or
//! delete whole chunks' slices; nothing is rewritten.
//!
//! An object is a header (magic, kind, offset, length, chunk, seq, and a crc32c of these)
//! and, for data, the bytes in blocks of `BLOCK_BYTES`, each followed by its crc32c: a read
//! fetches just the blocks it needs (one ranged GET) and checks every block it returns.
//!
//! seq orders the slices of one file across its owners. The server that owns the inode's
//! table is the file's only writer; it keeps an index per file (built from one LIST of the
//! folder when the file is first touched, or empty for a file whose "may have data" mark it
//! has just set, then kept up to date) and continues from the highest seq listed. A create
//! that finds its name taken (another server still writing: a fenced owner) lists again and
//! retries with a higher seq. A write returns once its PUT returned, so the journal record
//! of the write, and its early reply, never precede the data; fsync has nothing to do.
//!
//! Compaction: a chunk of more than `COMPACT_SLICES_MAX` slices is merged into one new
//! slice with a higher seq by the write that found it so, under that write's hold on the
//! file (its shared data lock keeps truncation, zeroing and reclaim out) and only while no
//! other write of the chunk is in flight (a write given a lower seq, still on its way,
//! would otherwise be hidden by the merged slice); then the merged slices are deleted. A
//! crash in between leaves duplicates that read the same.
//!
//! Known gap (issue 31 closes it with slice lists in the journal): a slice is visible from
//! the moment its PUT returns, journaled or not. A slice PUT by a server that then crashes
//! before journaling the write, or by a fenced owner before it stops, becomes part of the
//! file for the next owner.

use super::{ReclaimPlan, pieces};
use kochab_meta::Reclaim;
use kochab_proto::{CHUNK_BYTES, InodeId};
use kochab_store::ObjectStore;
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::io::{self, ErrorKind};
use std::ops::{Range, RangeInclusive};
use std::sync::Arc;

/// Slices a chunk may hold before it is compacted: a read of the chunk resolves at most this
/// many overlapping slices (a GET each, at worst), and sequential writes of 128 KiB or more
/// fill a chunk in at most 32, so compaction rewrites each byte about once more.
pub const COMPACT_SLICES_MAX: usize = 16;
/// Bytes per checksummed block of a data slice: a FUSE read (128 KiB, aligned) fetches whole
/// blocks only, and 4 bytes of crc per 64 KiB cost nothing.
const BLOCK_BYTES: usize = 64 << 10;
const CRC_BYTES: usize = 4;
/// magic 4, kind 1, zero 3, offset 4, length 4, chunk 8, seq 8, crc32c 4.
const HEADER_BYTES: usize = 36;
const MAGIC: &[u8; 4] = b"KSL1";
const KIND_DATA: u8 = 1;
const KIND_ZEROS: u8 = 2;
/// Files whose index is kept in memory. An index is a few dozen bytes per slice; evicting
/// one costs a LIST when the file is touched again. Bounds the memory of a server that
/// touches millions of files.
const FILES_INDEXED_MAX: usize = 65536;
/// Attempts at a free name for a slice: each failed one lists the folder and continues
/// above the highest seq there, so more than a couple means another server keeps writing
/// the file.
const SEQ_TRIES_MAX: usize = 8;
/// Attempts at a read whose slices were deleted under it (compaction merged them, or their
/// file was truncated by another owner): each lists the folder again.
const READ_TRIES_MAX: usize = 4;

/// One slice: `len` bytes at `offset` of its chunk, data or zeros. Ordered by seq (then by
/// extent, so that two slices of one seq, possible only if two servers wrote the file,
/// still order the same way everywhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slice {
    pub seq: u64,
    pub offset: u32,
    pub len: u32,
    pub zeros: bool,
}

impl Slice {
    fn end(&self) -> u32 {
        self.offset + self.len
    }
}

fn shard_folder(id: InodeId) -> String {
    format!("data/{:02x}", id & 0xff)
}

/// The folder of a file generation's slices.
pub fn slice_folder(id: InodeId, generation: u64) -> String {
    format!("{}/{id:016x}.{generation:016x}.s", shard_folder(id))
}

/// The object name of a slice of chunk `chunk`.
pub fn slice_name(id: InodeId, generation: u64, chunk: u64, s: &Slice) -> String {
    format!(
        "{}/{chunk:016x}.{:016x}.{}{:06x}.{:06x}",
        slice_folder(id, generation),
        s.seq,
        if s.zeros { 'z' } else { 'd' },
        s.offset,
        s.len
    )
}

/// The chunk and slice a listed name stands for (`None` for anything else).
fn parse_slice(name: &str) -> Option<(u64, Slice)> {
    let last = name.rsplit('/').next()?;
    let mut parts = last.split('.');
    let (chunk, seq, kind_off, len) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || chunk.len() != 16 || seq.len() != 16 || kind_off.len() != 7 {
        return None;
    }
    if len.len() != 6 {
        return None;
    }
    let zeros = match kind_off.as_bytes()[0] {
        b'd' => false,
        b'z' => true,
        _ => return None,
    };
    let s = Slice {
        seq: u64::from_str_radix(seq, 16).ok()?,
        offset: u32::from_str_radix(&kind_off[1..], 16).ok()?,
        len: u32::from_str_radix(len, 16).ok()?,
        zeros,
    };
    (s.len > 0 && u64::from(s.end()) <= CHUNK_BYTES)
        .then_some((u64::from_str_radix(chunk, 16).ok()?, s))
}

fn header(chunk: u64, s: &Slice) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(MAGIC);
    h[4] = if s.zeros { KIND_ZEROS } else { KIND_DATA };
    h[8..12].copy_from_slice(&s.offset.to_le_bytes());
    h[12..16].copy_from_slice(&s.len.to_le_bytes());
    h[16..24].copy_from_slice(&chunk.to_le_bytes());
    h[24..32].copy_from_slice(&s.seq.to_le_bytes());
    let crc = crc32c::crc32c(&h[..32]);
    h[32..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// A slice's object: its header, then (for data) each block and its crc32c.
fn encode(chunk: u64, s: &Slice, data: &[u8]) -> Vec<u8> {
    let blocks = data.len().div_ceil(BLOCK_BYTES);
    let mut out = Vec::with_capacity(HEADER_BYTES + data.len() + blocks * CRC_BYTES);
    out.extend_from_slice(&header(chunk, s));
    for b in data.chunks(BLOCK_BYTES) {
        out.extend_from_slice(b);
        out.extend_from_slice(&crc32c::crc32c(b).to_le_bytes());
    }
    out
}

/// Where block `i` of a data slice starts in its object.
fn block_pos(i: usize) -> usize {
    HEADER_BYTES + i * (BLOCK_BYTES + CRC_BYTES)
}

fn corrupt(name: &str, what: &str) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, format!("slice {name}: {what}"))
}

/// What one file generation's index holds.
#[derive(Default)]
struct FileState {
    /// Listed (or known to have nothing): the index is complete.
    loaded: bool,
    /// The seq the next slice gets.
    next_seq: u64,
    /// Each chunk's slices, ascending.
    chunks: BTreeMap<u64, Vec<Slice>>,
    /// Writes of a chunk given a seq whose PUT has not returned yet.
    in_flight: FxHashMap<u64, u32>,
    /// Chunks being compacted.
    compacting: FxHashSet<u64>,
}

impl FileState {
    fn insert(&mut self, chunk: u64, s: Slice) {
        let list = self.chunks.entry(chunk).or_default();
        if let Err(at) = list.binary_search(&s) {
            list.insert(at, s);
        }
        self.next_seq = self.next_seq.max(s.seq + 1);
    }

    /// Replaces the index with a listing of the folder (slices in flight come in when
    /// their PUT returns).
    fn fill(&mut self, names: &[String]) {
        self.chunks.clear();
        self.next_seq = self.next_seq.max(1);
        for n in names {
            if let Some((chunk, s)) = parse_slice(n) {
                self.insert(chunk, s);
            }
        }
        self.loaded = true;
    }

    /// A seq for a write of `chunk`, counted in flight until [`FileState::end`].
    fn begin(&mut self, chunk: u64) -> u64 {
        let seq = self.next_seq.max(1);
        self.next_seq = seq + 1;
        *self.in_flight.entry(chunk).or_default() += 1;
        seq
    }

    fn end(&mut self, chunk: u64, written: Option<Slice>) {
        if let Some(n) = self.in_flight.get_mut(&chunk) {
            *n -= 1;
            if *n == 0 {
                self.in_flight.remove(&chunk);
            }
        }
        if let Some(s) = written {
            self.insert(chunk, s);
        }
    }
}

#[derive(Default)]
struct FileIndex {
    state: Mutex<FileState>,
}

/// One part of a chunk range as the overlay resolves it: `range` (offsets in the chunk)
/// comes from `from`, or is zeros (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Part {
    range: (u32, u32),
    from: Option<Slice>,
}

/// Resolves `want` (offsets in a chunk) against `slices` (ascending seq): newest first, each
/// slice takes what no newer one took. Parts come back in offset order and cover `want`.
fn resolve(slices: &[Slice], want: Range<u32>) -> Vec<Part> {
    let mut open = vec![(want.start, want.end)];
    let mut parts = Vec::new();
    for s in slices.iter().rev() {
        if open.is_empty() {
            break;
        }
        let mut still = Vec::with_capacity(open.len() + 1);
        for (a, b) in open {
            let (lo, hi) = (a.max(s.offset), b.min(s.end()));
            if lo >= hi {
                still.push((a, b));
                continue;
            }
            parts.push(Part {
                range: (lo, hi),
                from: (!s.zeros).then_some(*s),
            });
            if a < lo {
                still.push((a, lo));
            }
            if hi < b {
                still.push((hi, b));
            }
        }
        open = still;
    }
    parts.extend(open.into_iter().map(|r| Part {
        range: r,
        from: None,
    }));
    parts.sort_unstable_by_key(|p| p.range.0);
    parts
}

/// One ranged read of a slice: the chunk offsets `span` of `slice`, copied out by parts.
struct Fetch {
    chunk: u64,
    slice: Slice,
    span: (u32, u32),
    /// (chunk offsets, where in the output they go).
    parts: Vec<((u32, u32), usize)>,
}

/// Reads and writes file data as slices (see the module).
pub struct SliceStore {
    store: Arc<dyn ObjectStore>,
    files: Mutex<FxHashMap<(InodeId, u64), Arc<FileIndex>>>,
}

impl SliceStore {
    pub fn new(store: Arc<dyn ObjectStore>) -> SliceStore {
        SliceStore {
            store,
            files: Mutex::new(FxHashMap::default()),
        }
    }

    /// The file's index entry, made (unlisted) if absent. Entries no operation holds are
    /// evicted beyond `FILES_INDEXED_MAX` (an entry is only cloned under the map's lock, so
    /// one counted once there is held by nobody).
    fn entry(&self, id: InodeId, generation: u64) -> Arc<FileIndex> {
        let mut files = self.files.lock();
        if let Some(f) = files.get(&(id, generation)) {
            return f.clone();
        }
        if files.len() >= FILES_INDEXED_MAX {
            let mut excess = files.len() - FILES_INDEXED_MAX / 2;
            files.retain(|_, f| {
                let evict = excess > 0 && Arc::strong_count(f) == 1;
                excess -= usize::from(evict);
                !evict
            });
        }
        files.entry((id, generation)).or_default().clone()
    }

    /// The file's index, listed first if it is not yet.
    fn file(&self, id: InodeId, generation: u64) -> io::Result<Arc<FileIndex>> {
        let f = self.entry(id, generation);
        {
            let mut st = f.state.lock();
            if !st.loaded {
                self.list_into(id, generation, &mut st)?;
            }
        }
        Ok(f)
    }

    fn list_into(&self, id: InodeId, generation: u64, st: &mut FileState) -> io::Result<()> {
        let names = self.store.list(&slice_folder(id, generation))?;
        st.fill(&names);
        Ok(())
    }

    /// The file's index, listed again now.
    fn relisted(&self, id: InodeId, generation: u64) -> io::Result<Arc<FileIndex>> {
        let f = self.entry(id, generation);
        self.list_into(id, generation, &mut f.state.lock())?;
        Ok(f)
    }

    /// See [`super::DataStore::created`].
    pub fn created(&self, id: InodeId, generation: u64) {
        let f = self.entry(id, generation);
        let mut st = f.state.lock();
        if !st.loaded {
            st.loaded = true;
            st.next_seq = st.next_seq.max(1);
        }
    }

    /// See [`super::DataStore::forget_range`]. An operation in flight keeps its entry, now
    /// detached: what it adds there is seen by nobody, and the next touch lists again.
    pub fn forget_range(&self, lo: InodeId, hi: InodeId) {
        self.files
            .lock()
            .retain(|(id, _), _| !(lo..hi).contains(id));
    }

    /// Creates one slice of `chunk` at (offset, length) (data, or zeros if `data` is `None`),
    /// then compacts the chunk if it holds too many.
    fn put_slice(
        &self,
        f: &Arc<FileIndex>,
        id: InodeId,
        generation: u64,
        chunk: u64,
        (offset, len): (u32, u32),
        data: Option<&[u8]>,
    ) -> io::Result<()> {
        let mut f = f.clone();
        for _ in 0..SEQ_TRIES_MAX {
            let seq = f.state.lock().begin(chunk);
            let s = Slice {
                seq,
                offset,
                len,
                zeros: data.is_none(),
            };
            let name = slice_name(id, generation, chunk, &s);
            let created = self
                .store
                .create_if_absent(&name, &encode(chunk, &s, data.unwrap_or(&[])));
            match created {
                Ok(()) => {
                    f.state.lock().end(chunk, Some(s));
                    if let Err(e) = self.maybe_compact(&f, id, generation, chunk) {
                        // The write is done and durable; compaction is tried again later.
                        tracing::warn!(
                            "compaction of chunk {chunk} of {id:#x} (generation {generation:#x}) \
                             failed: {e}"
                        );
                    }
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    f.state.lock().end(chunk, None);
                    tracing::warn!(
                        "slice {name} exists already: another server writes this file; \
                         listing it again"
                    );
                    f = self.relisted(id, generation)?;
                }
                Err(e) => {
                    f.state.lock().end(chunk, None);
                    return Err(e);
                }
            }
        }
        Err(io::Error::new(
            ErrorKind::AlreadyExists,
            format!(
                "{SEQ_TRIES_MAX} slice names of {id:#x} (generation {generation:#x}) were \
                 taken: another server keeps writing this file"
            ),
        ))
    }

    /// Writes `data` at `offset`: a slice per chunk touched, durable when this returns.
    pub fn write(&self, id: InodeId, generation: u64, offset: u64, data: &[u8]) -> io::Result<()> {
        let f = self.file(id, generation)?;
        let mut at = 0;
        for (chunk, within, n) in pieces(offset, data.len() as u64) {
            let piece = &data[at..at + n];
            self.put_slice(
                &f,
                id,
                generation,
                chunk,
                (within as u32, n as u32),
                Some(piece),
            )?;
            at += n;
        }
        Ok(())
    }

    /// Reads the chunk offsets `[a, b)` of a data slice: one ranged GET of the blocks that
    /// hold them (from the object's start, header included, when the first block is
    /// needed), each block checked.
    fn read_slice(
        &self,
        id: InodeId,
        generation: u64,
        chunk: u64,
        s: &Slice,
        (a, b): (u32, u32),
    ) -> io::Result<Vec<u8>> {
        let name = slice_name(id, generation, chunk, s);
        let (x, y) = ((a - s.offset) as usize, (b - s.offset) as usize);
        let len = s.len as usize;
        let (i0, i1) = (x / BLOCK_BYTES, (y - 1) / BLOCK_BYTES);
        let block_len = |i: usize| BLOCK_BYTES.min(len - i * BLOCK_BYTES);
        let start = if i0 == 0 { 0 } else { block_pos(i0) };
        let end = block_pos(i1) + block_len(i1) + CRC_BYTES;
        let got = self
            .store
            .get_range(&name, start as u64, (end - start) as u64)?
            .ok_or_else(|| io::Error::new(ErrorKind::NotFound, format!("no slice {name}")))?;
        if got.len() != end - start {
            return Err(corrupt(
                &name,
                &format!("{} bytes where {} were expected", got.len(), end - start),
            ));
        }
        let mut pos = 0;
        if i0 == 0 {
            if got[..HEADER_BYTES] != header(chunk, s) {
                return Err(corrupt(&name, "its header does not match its name"));
            }
            pos = HEADER_BYTES;
        }
        let mut out = Vec::with_capacity(y - x);
        for i in i0..=i1 {
            let bl = block_len(i);
            let block = &got[pos..pos + bl];
            let crc = &got[pos + bl..pos + bl + CRC_BYTES];
            if crc32c::crc32c(block).to_le_bytes() != crc {
                return Err(corrupt(&name, &format!("block {i} fails its checksum")));
            }
            let base = i * BLOCK_BYTES;
            out.extend_from_slice(&block[x.max(base) - base..y.min(base + bl) - base]);
            pos += bl + CRC_BYTES;
        }
        Ok(out)
    }

    /// Runs `fetches` (concurrently when there are several) and copies their parts into
    /// `out`.
    fn run_fetches(
        &self,
        id: InodeId,
        generation: u64,
        fetches: &[Fetch],
        out: &mut [u8],
    ) -> io::Result<()> {
        let fetch = |f: &Fetch| self.read_slice(id, generation, f.chunk, &f.slice, f.span);
        let results: Vec<io::Result<Vec<u8>>> = if fetches.len() <= 1 {
            fetches.iter().map(fetch).collect()
        } else {
            std::thread::scope(|sc| {
                let handles: Vec<_> = fetches.iter().map(|f| sc.spawn(move || fetch(f))).collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(io::Error::other("a slice read panicked")))
                    })
                    .collect()
            })
        };
        for (f, got) in fetches.iter().zip(results) {
            let got = got?;
            for &((a, b), dst) in &f.parts {
                let from = (a - f.span.0) as usize;
                let n = (b - a) as usize;
                out[dst..dst + n].copy_from_slice(&got[from..from + n]);
            }
        }
        Ok(())
    }

    /// The reads that fill `[offset, offset + len)` of the file from `st` (zeros parts need
    /// none: `out` starts zeroed).
    fn plan(st: &FileState, offset: u64, len: u64) -> Vec<Fetch> {
        let mut fetches: Vec<Fetch> = Vec::new();
        let mut dst = 0;
        for (chunk, within, n) in pieces(offset, len) {
            if let Some(slices) = st.chunks.get(&chunk) {
                let want = within as u32..(within as usize + n) as u32;
                let first = fetches.len();
                for p in resolve(slices, want.clone()) {
                    let Some(s) = p.from else { continue };
                    let at = dst + (p.range.0 - want.start) as usize;
                    match fetches[first..]
                        .iter_mut()
                        .find(|f| f.slice == s && f.chunk == chunk)
                    {
                        Some(f) => {
                            f.span = (f.span.0.min(p.range.0), f.span.1.max(p.range.1));
                            f.parts.push((p.range, at));
                        }
                        None => fetches.push(Fetch {
                            chunk,
                            slice: s,
                            span: p.range,
                            parts: vec![(p.range, at)],
                        }),
                    }
                }
            }
            dst += n;
        }
        fetches
    }

    /// Reads `len` bytes at `offset` of a file of `size` bytes (short at the end).
    pub fn read(
        &self,
        id: InodeId,
        generation: u64,
        size: u64,
        offset: u64,
        len: u32,
    ) -> io::Result<Vec<u8>> {
        if offset >= size {
            return Ok(Vec::new());
        }
        let len = (len as u64).min(size - offset);
        let mut f = self.file(id, generation)?;
        let mut out = vec![0u8; len as usize];
        for attempt in 1..=READ_TRIES_MAX {
            let fetches = Self::plan(&f.state.lock(), offset, len);
            match self.run_fetches(id, generation, &fetches, &mut out) {
                Ok(()) => return Ok(out),
                // Merged by a compaction (or cut by another owner) under this read: the
                // index (listed again) shows what replaced them.
                Err(e) if e.kind() == ErrorKind::NotFound && attempt < READ_TRIES_MAX => {
                    out.fill(0);
                    f = self.relisted(id, generation)?;
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Compacts `chunk` if it holds more than `COMPACT_SLICES_MAX` slices and no write of
    /// it is in flight (see the module).
    fn maybe_compact(
        &self,
        f: &Arc<FileIndex>,
        id: InodeId,
        generation: u64,
        chunk: u64,
    ) -> io::Result<()> {
        let (seq, slices) = {
            let mut st = f.state.lock();
            let many = st
                .chunks
                .get(&chunk)
                .is_some_and(|l| l.len() > COMPACT_SLICES_MAX);
            if !many || st.in_flight.contains_key(&chunk) || st.compacting.contains(&chunk) {
                return Ok(());
            }
            st.compacting.insert(chunk);
            // Every write of the chunk from now on gets a higher seq than the merged slice.
            let seq = st.next_seq.max(1);
            st.next_seq = seq + 1;
            (seq, st.chunks.get(&chunk).cloned().unwrap_or_default())
        };
        let result = self.compact(f, id, generation, chunk, seq, &slices);
        f.state.lock().compacting.remove(&chunk);
        result
    }

    /// Merges `slices` (all of `chunk`'s when it was decided) into one slice of seq `seq`
    /// holding what they read as, then deletes them. Also what a test calls to compact.
    fn compact(
        &self,
        f: &Arc<FileIndex>,
        id: InodeId,
        generation: u64,
        chunk: u64,
        seq: u64,
        slices: &[Slice],
    ) -> io::Result<()> {
        let parts = resolve(slices, 0..CHUNK_BYTES as u32);
        let data: Vec<&Part> = parts.iter().filter(|p| p.from.is_some()).collect();
        let (Some(first), Some(last)) = (data.first(), data.last()) else {
            // Nothing but zeros: the slices go, oldest first, so that a crash part-way
            // never uncovers an older slice a newer zeros slice hid.
            for s in slices {
                self.store.delete(&slice_name(id, generation, chunk, s))?;
                remove_slices(f, chunk, std::slice::from_ref(s));
            }
            return Ok(());
        };
        let (lo, hi) = (first.range.0, last.range.1);
        let mut bytes = vec![0u8; (hi - lo) as usize];
        let st = FileState {
            loaded: true,
            chunks: BTreeMap::from([(chunk, slices.to_vec())]),
            ..FileState::default()
        };
        let fetches = Self::plan(&st, chunk * CHUNK_BYTES + u64::from(lo), u64::from(hi - lo));
        self.run_fetches(id, generation, &fetches, &mut bytes)?;
        let merged = Slice {
            seq,
            offset: lo,
            len: hi - lo,
            zeros: false,
        };
        self.store.create_if_absent(
            &slice_name(id, generation, chunk, &merged),
            &encode(chunk, &merged, &bytes),
        )?;
        {
            let mut st = f.state.lock();
            st.insert(chunk, merged);
        }
        remove_slices(f, chunk, slices);
        let names: Vec<String> = slices
            .iter()
            .map(|s| slice_name(id, generation, chunk, s))
            .collect();
        self.store.delete_many(&names)
    }

    /// Chunks of a generation in `span` that hold slices, ascending.
    pub fn existing_chunks(
        &self,
        id: InodeId,
        generation: u64,
        span: RangeInclusive<u64>,
    ) -> io::Result<Vec<u64>> {
        let f = self.file(id, generation)?;
        let st = f.state.lock();
        Ok(st
            .chunks
            .range(span)
            .filter(|(_, l)| !l.is_empty())
            .map(|(c, _)| *c)
            .collect())
    }

    /// Deletes all of `chunk`'s slices, oldest first (a crash part-way leaves each byte as
    /// it was or zero, never an older slice's), and forgets them.
    fn delete_chunk(
        &self,
        f: &Arc<FileIndex>,
        id: InodeId,
        generation: u64,
        chunk: u64,
    ) -> io::Result<()> {
        let slices = f
            .state
            .lock()
            .chunks
            .get(&chunk)
            .cloned()
            .unwrap_or_default();
        for s in &slices {
            self.store.delete(&slice_name(id, generation, chunk, s))?;
            remove_slices(f, chunk, std::slice::from_ref(s));
        }
        Ok(())
    }

    /// Makes `[offset, offset + len)` read as zeros in `chunks`: a chunk the range covers
    /// whole loses its slices, others get a zeros slice over the part that has any. There
    /// is no space to keep reserved. The caller holds the file's exclusive lock.
    pub fn zero(
        &self,
        id: InodeId,
        generation: u64,
        offset: u64,
        len: u64,
        chunks: &[u64],
    ) -> io::Result<()> {
        let f = self.file(id, generation)?;
        let end = offset.saturating_add(len);
        for &chunk in chunks {
            let lo = chunk.saturating_mul(CHUNK_BYTES);
            let hi = lo.saturating_add(CHUNK_BYTES);
            if hi <= offset || end <= lo {
                continue;
            }
            if offset <= lo && hi <= end {
                self.delete_chunk(&f, id, generation, chunk)?;
                continue;
            }
            let (from, to) = ((offset.max(lo) - lo) as u32, (end.min(hi) - lo) as u32);
            let covered_end = f
                .state
                .lock()
                .chunks
                .get(&chunk)
                .map(|l| l.iter().filter(|s| s.offset < to).map(Slice::end).max())
                .unwrap_or_default();
            match covered_end {
                Some(e) if e > from => {
                    self.put_slice(&f, id, generation, chunk, (from, to.min(e) - from), None)?
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Starts a reclaim: lists the file's folder afresh (what the index missed is deleted
    /// too), makes the chunk holding `from` read as zeros from there (a zeros slice), and
    /// returns the chunks to delete. Idempotent.
    pub fn reclaim_plan(&self, r: &Reclaim) -> io::Result<ReclaimPlan> {
        let f = self.relisted(r.id, r.generation)?;
        let first = r.from / CHUNK_BYTES;
        let within = (r.from % CHUNK_BYTES) as u32;
        let mut delete_from = first;
        if within != 0 {
            let covered_end = f
                .state
                .lock()
                .chunks
                .get(&first)
                .and_then(|l| l.iter().map(Slice::end).max());
            if let Some(e) = covered_end
                && e > within
            {
                self.put_slice(&f, r.id, r.generation, first, (within, e - within), None)?;
            }
            delete_from = first + 1;
        }
        let st = f.state.lock();
        Ok(ReclaimPlan {
            chunks: st
                .chunks
                .range(delete_from..)
                .filter(|(_, l)| !l.is_empty())
                .map(|(c, _)| *c)
                .collect(),
        })
    }

    /// Deletes the slices of some of a reclaim plan's chunks (the bytes are past the file's
    /// durable size, so their order does not matter: concurrently).
    pub fn delete_chunks(&self, id: InodeId, generation: u64, chunks: &[u64]) -> io::Result<()> {
        let f = self.file(id, generation)?;
        let names: Vec<String> = {
            let st = f.state.lock();
            chunks
                .iter()
                .flat_map(|&c| {
                    st.chunks
                        .get(&c)
                        .into_iter()
                        .flatten()
                        .map(move |s| slice_name(id, generation, c, s))
                })
                .collect()
        };
        self.store.delete_many(&names)?;
        let mut st = f.state.lock();
        for c in chunks {
            st.chunks.remove(c);
        }
        Ok(())
    }

    /// Ends a reclaim: a whole file's index goes.
    pub fn end_reclaim(&self, r: &Reclaim) -> io::Result<()> {
        if r.from == 0 {
            self.files.lock().remove(&(r.id, r.generation));
        }
        Ok(())
    }

    /// Deletes a reclaim entry's data in one call (tests and small files).
    pub fn reclaim(&self, r: &Reclaim) -> io::Result<()> {
        let plan = self.reclaim_plan(r)?;
        self.delete_chunks(r.id, r.generation, &plan.chunks)?;
        self.end_reclaim(r)
    }

    /// What the store reports (an object store has no fixed size: the S3 store reports a
    /// large fixed figure, `kochab_s3store::REPORTED_CAPACITY`).
    pub fn capacity(&self) -> io::Result<kochab_store::Capacity> {
        self.store.capacity()
    }

    /// Slice objects present in a store that lists folders (S3), for leak checks.
    pub fn count_objects(&self) -> io::Result<usize> {
        let mut n = 0;
        for shard in self.store.list("data")? {
            for name in self.store.list(&shard)? {
                n += if name.ends_with(".s") {
                    self.store.list(&name)?.len()
                } else {
                    1
                };
            }
        }
        Ok(n)
    }
}

/// Forgets `slices` of `chunk` (a chunk left with none goes).
fn remove_slices(f: &FileIndex, chunk: u64, slices: &[Slice]) {
    let mut st = f.state.lock();
    if let Some(list) = st.chunks.get_mut(&chunk) {
        list.retain(|s| !slices.contains(s));
        if list.is_empty() {
            st.chunks.remove(&chunk);
        }
    }
}

#[cfg(test)]
mod tests;

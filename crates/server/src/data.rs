//! File data in the object store: a file is cut into chunks of `CHUNK_BYTES`, each an
//! object named by (inode, generation, chunk). Missing chunks and bytes past a chunk's end
//! read as zeros, so sparse files and holes cost nothing. The generation in the name keeps
//! a reused inode id from ever seeing an old file's data.
//!
//! Block-aligned pieces (all of a sequential stream's) go through direct I/O, bypassing
//! the server's page cache: on this kind of VM, fresh page-cache pages are faults to the
//! hypervisor and buffered writes reach ~300 MB/s, direct ones 1.2-1.7 GB/s (measured with
//! dd). Unaligned pieces use the page cache; Linux keeps the two coherent.

use kochab_meta::Reclaim;
use kochab_proto::{CHUNK_BYTES, InodeId};
use kochab_store::{AlignedBuf, DIRECT_ALIGN, Object, ObjectStore};
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

/// Open chunk objects kept for reuse (each open is a syscall or several).
const OPEN_CHUNKS_MAX: usize = 1024;
/// Bytes of zeros written per call when punching holes.
const ZERO_BLOCK: usize = 1 << 20;

/// One chunk of one file generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkKey {
    pub id: InodeId,
    pub generation: u64,
    pub chunk: u32,
}

/// The object name of a chunk: spread over 256 folders by inode.
pub fn chunk_name(k: ChunkKey) -> String {
    format!(
        "data/{:02x}/{:016x}.{:016x}.{:08x}",
        k.id & 0xff,
        k.id,
        k.generation,
        k.chunk
    )
}

/// A chunk opened for buffered and (where the store can) direct I/O.
#[derive(Clone)]
struct ChunkObjects {
    buffered: Arc<dyn Object>,
    direct: Option<Arc<dyn Object>>,
}

#[derive(Default)]
struct OpenCache {
    objects: FxHashMap<ChunkKey, ChunkObjects>,
    order: VecDeque<ChunkKey>,
}

/// Smallest read served by direct I/O; smaller ones profit from the page cache.
const DIRECT_READ_MIN: usize = 64 << 10;

thread_local! {
    static ALIGNED: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::new());
}

fn aligned(within: u64, n: usize) -> bool {
    within.is_multiple_of(DIRECT_ALIGN as u64) && n.is_multiple_of(DIRECT_ALIGN)
}

/// Reads and writes chunk objects.
pub struct DataStore {
    store: Arc<dyn ObjectStore>,
    open: Mutex<OpenCache>,
    /// Chunks written since their last sync, per file generation.
    dirty: Mutex<FxHashMap<(InodeId, u64), FxHashSet<u32>>>,
}

/// The pieces of a byte range, chunk by chunk: (chunk, offset in chunk, length).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u32, u64, usize)> {
    let mut pos = offset;
    let end = offset.saturating_add(len);
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let chunk = pos / CHUNK_BYTES;
        let within = pos % CHUNK_BYTES;
        let n = (CHUNK_BYTES - within).min(end - pos);
        pos += n;
        Some((chunk as u32, within, n as usize))
    })
}

impl DataStore {
    pub fn new(store: Arc<dyn ObjectStore>) -> DataStore {
        DataStore {
            store,
            open: Mutex::new(OpenCache::default()),
            dirty: Mutex::new(FxHashMap::default()),
        }
    }

    /// The chunk object, opened (and created if `create`); `None` if it does not exist.
    fn object(&self, k: ChunkKey, create: bool) -> io::Result<Option<Arc<dyn Object>>> {
        Ok(self.objects(k, create)?.map(|o| o.buffered))
    }

    fn objects(&self, k: ChunkKey, create: bool) -> io::Result<Option<ChunkObjects>> {
        if let Some(o) = self.open.lock().objects.get(&k) {
            return Ok(Some(o.clone()));
        }
        let name = chunk_name(k);
        let buffered = match self.store.open(&name, create) {
            Ok(o) => o,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let obj = ChunkObjects {
            buffered,
            direct: self.store.open_direct(&name, false)?,
        };
        let mut cache = self.open.lock();
        if cache.objects.insert(k, obj.clone()).is_none() {
            cache.order.push_back(k);
        }
        while cache.order.len() > OPEN_CHUNKS_MAX {
            if let Some(old) = cache.order.pop_front() {
                cache.objects.remove(&old);
            }
        }
        Ok(Some(obj))
    }

    fn forget(&self, id: InodeId, generation: u64, from_chunk: u32) {
        let mut cache = self.open.lock();
        let OpenCache { objects, order } = &mut *cache;
        objects.retain(|k, _| !(k.id == id && k.generation == generation && k.chunk >= from_chunk));
        order.retain(|k| objects.contains_key(k));
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
        let mut out = vec![0u8; len as usize];
        let mut at = 0;
        for (chunk, within, n) in pieces(offset, len) {
            if let Some(obj) = self.objects(
                ChunkKey {
                    id,
                    generation,
                    chunk,
                },
                false,
            )? {
                // Bytes past the chunk's end stay zero: a hole.
                match &obj.direct {
                    Some(d) if n >= DIRECT_READ_MIN && aligned(within, n) => ALIGNED
                        .with_borrow_mut(|buf| {
                            let b = buf.zeroed(n);
                            d.read_at(b, within)?;
                            out[at..at + n].copy_from_slice(&b[..n]);
                            Ok::<_, io::Error>(())
                        })?,
                    _ => {
                        obj.buffered.read_at(&mut out[at..at + n], within)?;
                    }
                }
            }
            at += n;
        }
        Ok(out)
    }

    /// Writes `data` at `offset`.
    pub fn write(&self, id: InodeId, generation: u64, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut at = 0;
        let mut touched = Vec::new();
        for (chunk, within, n) in pieces(offset, data.len() as u64) {
            let k = ChunkKey {
                id,
                generation,
                chunk,
            };
            let obj = self
                .objects(k, true)?
                .ok_or_else(|| io::Error::other("chunk vanished while created"))?;
            let piece = &data[at..at + n];
            match &obj.direct {
                Some(d) if aligned(within, n) => {
                    ALIGNED.with_borrow_mut(|buf| d.write_at(buf.fill(piece), within))?
                }
                _ => obj.buffered.write_at(piece, within)?,
            }
            touched.push(chunk);
            at += n;
        }
        self.dirty
            .lock()
            .entry((id, generation))
            .or_default()
            .extend(touched);
        Ok(())
    }

    /// Writes zeros over `[offset, offset + len)` (a punched hole reads as zeros).
    pub fn zero(&self, id: InodeId, generation: u64, offset: u64, len: u64) -> io::Result<()> {
        let zeros = vec![0u8; ZERO_BLOCK];
        let mut pos = offset;
        let end = offset.saturating_add(len);
        while pos < end {
            let n = (end - pos).min(ZERO_BLOCK as u64) as usize;
            for (chunk, within, m) in pieces(pos, n as u64) {
                if let Some(obj) = self.object(
                    ChunkKey {
                        id,
                        generation,
                        chunk,
                    },
                    false,
                )? {
                    obj.write_at(&zeros[..m], within)?;
                    self.dirty
                        .lock()
                        .entry((id, generation))
                        .or_default()
                        .insert(chunk);
                }
            }
            pos += n as u64;
        }
        Ok(())
    }

    /// Makes the file's written chunks durable.
    pub fn sync(&self, id: InodeId, generation: u64) -> io::Result<()> {
        let chunks = self
            .dirty
            .lock()
            .remove(&(id, generation))
            .unwrap_or_default();
        for chunk in &chunks {
            let key = ChunkKey {
                id,
                generation,
                chunk: *chunk,
            };
            let Some(obj) = self.object(key, false)? else {
                continue;
            };
            if let Err(e) = obj.sync_data() {
                // Keep them dirty so a later fsync tries again.
                self.dirty
                    .lock()
                    .entry((id, generation))
                    .or_default()
                    .extend(chunks.iter().copied());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Deletes a reclaim entry's data: the chunk holding `from` is cut there, later chunks
    /// are deleted. Idempotent.
    pub fn reclaim(&self, r: &Reclaim) -> io::Result<()> {
        let first = (r.from / CHUNK_BYTES) as u32;
        let within = r.from % CHUNK_BYTES;
        let mut delete_from = first;
        if within != 0 {
            let key = ChunkKey {
                id: r.id,
                generation: r.generation,
                chunk: first,
            };
            if let Some(obj) = self.object(key, false)?
                && obj.len()? > within
            {
                obj.set_len(within)?;
                obj.sync_data()?;
            }
            delete_from = first + 1;
        }
        self.forget(r.id, r.generation, delete_from);
        for chunk in delete_from..r.chunks.max(delete_from) {
            self.store.delete(&chunk_name(ChunkKey {
                id: r.id,
                generation: r.generation,
                chunk,
            }))?;
        }
        if delete_from == 0 {
            self.dirty.lock().remove(&(r.id, r.generation));
        }
        Ok(())
    }

    /// Chunk objects present in the store (for leak checks in tests and fsck).
    pub fn count_objects(&self) -> io::Result<usize> {
        let mut n = 0;
        for shard in 0..256 {
            n += self.store.list(&format!("data/{shard:02x}"))?.len();
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_store::LocalStore;

    fn store() -> (tempfile::TempDir, DataStore) {
        let d = tempfile::tempdir().unwrap();
        let s: Arc<dyn ObjectStore> = Arc::new(LocalStore::open(d.path()).unwrap());
        (d, DataStore::new(s))
    }

    #[test]
    fn writes_across_chunks_and_holes_read_back() {
        let (_d, ds) = store();
        let off = CHUNK_BYTES - 3;
        ds.write(5, 1, off, b"abcdef").unwrap();
        let size = off + 6;
        assert_eq!(ds.read(5, 1, size, off, 100).unwrap(), b"abcdef");
        assert_eq!(
            ds.read(5, 1, size, 0, 4).unwrap(),
            vec![0; 4],
            "a hole reads as zeros"
        );
        assert_eq!(
            ds.read(5, 2, size, off, 6).unwrap(),
            vec![0; 6],
            "another generation sees nothing"
        );
        assert!(ds.read(5, 1, size, size, 10).unwrap().is_empty());
        ds.sync(5, 1).unwrap();
        assert_eq!(ds.count_objects().unwrap(), 2);
    }

    #[test]
    fn reclaim_cuts_and_deletes() {
        let (_d, ds) = store();
        ds.write(9, 1, 0, &vec![7u8; (CHUNK_BYTES + 10) as usize])
            .unwrap();
        ds.reclaim(&Reclaim {
            id: 9,
            generation: 1,
            from: 5,
            chunks: 2,
        })
        .unwrap();
        assert_eq!(ds.count_objects().unwrap(), 1);
        // Growing again shows zeros, not the old bytes.
        assert_eq!(
            ds.read(9, 1, 20, 0, 20).unwrap(),
            [vec![7u8; 5], vec![0u8; 15]].concat()
        );
        ds.reclaim(&Reclaim {
            id: 9,
            generation: 1,
            from: 0,
            chunks: 2,
        })
        .unwrap();
        ds.reclaim(&Reclaim {
            id: 9,
            generation: 1,
            from: 0,
            chunks: 2,
        })
        .unwrap();
        assert_eq!(ds.count_objects().unwrap(), 0);
    }

    #[test]
    fn zeroing_punches_holes() {
        let (_d, ds) = store();
        ds.write(3, 1, 0, &[1u8; 100]).unwrap();
        ds.zero(3, 1, 10, 20).unwrap();
        let got = ds.read(3, 1, 100, 0, 100).unwrap();
        assert_eq!(&got[..10], &[1u8; 10]);
        assert_eq!(&got[10..30], &[0u8; 20]);
        assert_eq!(&got[30..], &[1u8; 70]);
    }
}

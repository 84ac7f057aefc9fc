//! File data as immutable slice objects, as servers and clients both see it.
//!
//! A file's bytes live in chunks of [`CHUNK_BYTES`]. The metadata keeps, per chunk, a list
//! of [`SliceRef`]s, oldest first: each says that bytes `[pos, pos + len)` of the chunk are
//! the data of one slice object (or zeros, for `object == 0`), and a newer ref hides what
//! it overlaps. A slice object is written once, by conditional create, and never changed;
//! it becomes part of a file only when a journal record commits its ref, so a slice whose
//! commit never happened is never read (and is reclaimed).
//!
//! Clients of an object store put and get slice objects themselves, with capabilities the
//! server hands out (presigned URLs and commit tokens, see [`Grant`]); the format below is
//! what both sides write and check.

use crate::{CHUNK_BYTES, InodeId};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Bytes per checksummed block of a slice object: a read fetches whole blocks only, and 4
/// bytes of crc per 64 KiB cost nothing.
pub const SLICE_BLOCK_BYTES: usize = 64 << 10;
const CRC_BYTES: usize = 4;
/// magic 4, pad 4, chunk 8, object 8, pos 4, len 4, crc32c 4.
pub const SLICE_HEADER_BYTES: usize = 36;
const MAGIC: &[u8; 4] = b"KSL2";

/// `len` bytes at `pos` of a chunk: the whole data of slice object `object`, or zeros
/// (`object == 0`, no object).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SliceRef {
    pub object: u64,
    pub pos: u32,
    pub len: u32,
}

impl SliceRef {
    pub fn end(&self) -> u32 {
        self.pos.saturating_add(self.len)
    }

    pub fn is_zeros(&self) -> bool {
        self.object == 0
    }

    /// Whether the ref lies within a chunk and is not empty.
    pub fn is_valid(&self) -> bool {
        self.len > 0 && u64::from(self.pos) + u64::from(self.len) <= CHUNK_BYTES
    }
}

fn shard_folder(id: InodeId) -> String {
    format!("data/{:02x}", id & 0xff)
}

/// The folder holding every slice object of a file generation (deleted as a whole when the
/// file goes).
pub fn slice_folder(id: InodeId, generation: u64) -> String {
    format!("{}/{id:016x}.{generation:016x}.s", shard_folder(id))
}

/// The name of slice object `object` of a file generation.
pub fn slice_object_name(id: InodeId, generation: u64, object: u64) -> String {
    format!("{}/{object:016x}", slice_folder(id, generation))
}

/// The (inode, generation, object) a listed name stands for; `None` for anything else.
pub fn parse_slice_object_name(name: &str) -> Option<(InodeId, u64, u64)> {
    let mut parts = name.rsplit('/');
    let object = parts.next()?;
    let folder = parts.next()?;
    let folder = folder.strip_suffix(".s")?;
    let (id, generation) = folder.split_once('.')?;
    if object.len() != 16 || id.len() != 16 || generation.len() != 16 {
        return None;
    }
    let object = u64::from_str_radix(object, 16).ok()?;
    (object != 0).then_some((
        u64::from_str_radix(id, 16).ok()?,
        u64::from_str_radix(generation, 16).ok()?,
        object,
    ))
}

/// The header of a slice object: it names what the object holds, so an object read for
/// the wrong ref (or written for another place) is caught.
pub fn slice_header(chunk: u64, r: &SliceRef) -> [u8; SLICE_HEADER_BYTES] {
    let mut h = [0u8; SLICE_HEADER_BYTES];
    h[..4].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&chunk.to_le_bytes());
    h[16..24].copy_from_slice(&r.object.to_le_bytes());
    h[24..28].copy_from_slice(&r.pos.to_le_bytes());
    h[28..32].copy_from_slice(&r.len.to_le_bytes());
    let crc = crc32c::crc32c(&h[..32]);
    h[32..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// A slice object's bytes: its header, then each block of `data` and its crc32c.
pub fn encode_slice(chunk: u64, r: &SliceRef, data: &[u8]) -> Vec<u8> {
    let blocks = data.len().div_ceil(SLICE_BLOCK_BYTES);
    let mut out = Vec::with_capacity(SLICE_HEADER_BYTES + data.len() + blocks * CRC_BYTES);
    out.extend_from_slice(&slice_header(chunk, r));
    for b in data.chunks(SLICE_BLOCK_BYTES) {
        out.extend_from_slice(b);
        out.extend_from_slice(&crc32c::crc32c(b).to_le_bytes());
    }
    out
}

/// Where block `i` of a slice object starts.
fn block_pos(i: usize) -> usize {
    SLICE_HEADER_BYTES + i * (SLICE_BLOCK_BYTES + CRC_BYTES)
}

/// The byte range `[start, end)` of `r`'s object to fetch for the chunk offsets `[a, b)`
/// (within the ref): the whole blocks that hold them, and the header with the first block.
pub fn slice_fetch_range(r: &SliceRef, (a, b): (u32, u32)) -> (u64, u64) {
    let (x, y) = ((a - r.pos) as usize, (b - r.pos) as usize);
    let len = r.len as usize;
    let (i0, i1) = (x / SLICE_BLOCK_BYTES, (y - 1) / SLICE_BLOCK_BYTES);
    let block_len = SLICE_BLOCK_BYTES.min(len - i1 * SLICE_BLOCK_BYTES);
    let start = if i0 == 0 { 0 } else { block_pos(i0) };
    let end = block_pos(i1) + block_len + CRC_BYTES;
    (start as u64, end as u64)
}

/// Checks what [`slice_fetch_range`] fetched (header, every block's crc) and returns the
/// bytes of chunk offsets `[a, b)`.
pub fn decode_slice_range(
    chunk: u64,
    r: &SliceRef,
    (a, b): (u32, u32),
    got: &[u8],
) -> Result<Vec<u8>, String> {
    let (start, end) = slice_fetch_range(r, (a, b));
    if got.len() as u64 != end - start {
        return Err(format!(
            "{} bytes where {} were expected",
            got.len(),
            end - start
        ));
    }
    let (x, y) = ((a - r.pos) as usize, (b - r.pos) as usize);
    let len = r.len as usize;
    let (i0, i1) = (x / SLICE_BLOCK_BYTES, (y - 1) / SLICE_BLOCK_BYTES);
    let mut pos = 0;
    if i0 == 0 {
        if got[..SLICE_HEADER_BYTES] != slice_header(chunk, r) {
            return Err("its header does not match its ref".into());
        }
        pos = SLICE_HEADER_BYTES;
    }
    let mut out = Vec::with_capacity(y - x);
    for i in i0..=i1 {
        let bl = SLICE_BLOCK_BYTES.min(len - i * SLICE_BLOCK_BYTES);
        let block = &got[pos..pos + bl];
        let crc = &got[pos + bl..pos + bl + CRC_BYTES];
        if crc32c::crc32c(block).to_le_bytes() != crc {
            return Err(format!("block {i} fails its checksum"));
        }
        let base = i * SLICE_BLOCK_BYTES;
        out.extend_from_slice(&block[x.max(base) - base..y.min(base + bl) - base]);
        pos += bl + CRC_BYTES;
    }
    Ok(out)
}

/// One part of a chunk range as a chunk's refs resolve it: chunk offsets `range` come from
/// `from`, or are zeros (`None`: a zeros ref, or nothing written there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlicePart {
    pub range: (u32, u32),
    pub from: Option<SliceRef>,
}

/// Resolves `want` (offsets in a chunk) against a chunk's `refs` (oldest first): newest
/// first, each ref takes what no newer one took. Parts come back in offset order and
/// cover `want` exactly.
pub fn resolve_slices(refs: &[SliceRef], want: Range<u32>) -> Vec<SlicePart> {
    let mut open = vec![(want.start, want.end)];
    let mut parts = Vec::new();
    for r in refs.iter().rev() {
        if open.is_empty() {
            break;
        }
        let mut still = Vec::with_capacity(open.len() + 1);
        for (a, b) in open {
            let (lo, hi) = (a.max(r.pos), b.min(r.end()));
            if lo >= hi {
                still.push((a, b));
                continue;
            }
            parts.push(SlicePart {
                range: (lo, hi),
                from: (!r.is_zeros()).then_some(*r),
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
    parts.extend(
        open.into_iter()
            .map(|range| SlicePart { range, from: None }),
    );
    parts.sort_unstable_by_key(|p| p.range.0);
    parts
}

/// Adds `new` as a chunk's newest ref, dropping the older refs it wholly hides. Returns the
/// objects no ref names any more (to delete once the change is durable).
pub fn push_slice(refs: &mut Vec<SliceRef>, new: SliceRef) -> Vec<u64> {
    let mut freed = Vec::new();
    refs.retain(|r| {
        let hidden = r.pos >= new.pos && r.end() <= new.end();
        if hidden && !r.is_zeros() {
            freed.push(r.object);
        }
        !hidden
    });
    refs.push(new);
    freed.retain(|o| refs.iter().all(|r| r.object != *o));
    freed
}

/// One object a client may create: its name is fixed by `object` (see
/// [`slice_object_name`]), `put_url` creates it (once: the URL carries a signed
/// `If-None-Match: *`), and `token` lets the client commit it before `Grant::expires`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantedObject {
    pub object: u64,
    pub put_url: String,
    #[serde(with = "serde_bytes")]
    pub token: Vec<u8>,
}

/// Capabilities to create slice objects of one file generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub id: InodeId,
    pub generation: u64,
    pub objects: Vec<GrantedObject>,
    /// Unix seconds (server clock) after which the URLs fail and the tokens are refused.
    pub expires: u64,
}

/// A slice a client put and now commits: `r` at chunk `chunk`, with the token it was
/// granted for `r.object` and that grant's expiry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommittedSlice {
    pub chunk: u64,
    pub r: SliceRef,
    #[serde(with = "serde_bytes")]
    pub token: Vec<u8>,
    pub expires: u64,
}

/// One chunk's refs (oldest first) and, for each data ref, a presigned URL that gets its
/// object (`""` for zeros refs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkLayout {
    pub chunk: u64,
    pub refs: Vec<SliceRef>,
    pub get_urls: Vec<String>,
}

/// What a client needs to read a file's chunks straight from the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub id: InodeId,
    pub generation: u64,
    /// The file's size when the layout was taken.
    pub size: u64,
    /// The chunks asked for that hold refs, ascending (others read as zeros).
    pub chunks: Vec<ChunkLayout>,
    /// Unix seconds (server clock) after which the URLs fail.
    pub expires: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(object: u64, pos: u32, len: u32) -> SliceRef {
        SliceRef { object, pos, len }
    }

    #[test]
    fn newer_refs_hide_older_ones_where_they_overlap() {
        let refs = [r(1, 0, 100), r(2, 50, 10), r(0, 90, 20)];
        let parts = resolve_slices(&refs, 0..120);
        let got: Vec<_> = parts
            .iter()
            .map(|p| (p.range, p.from.map(|s| s.object)))
            .collect();
        assert_eq!(
            got,
            vec![
                ((0, 50), Some(1)),
                ((50, 60), Some(2)),
                ((60, 90), Some(1)),
                ((90, 110), None),
                ((110, 120), None),
            ]
        );
    }

    #[test]
    fn a_ref_that_hides_older_ones_frees_their_objects() {
        let mut refs = vec![r(1, 0, 10), r(2, 20, 10), r(3, 5, 30)];
        let freed = push_slice(&mut refs, r(4, 0, 40));
        assert_eq!(freed, vec![1, 2, 3]);
        assert_eq!(refs, vec![r(4, 0, 40)]);
        let freed = push_slice(&mut refs, r(5, 10, 5));
        assert!(freed.is_empty());
        assert_eq!(refs.len(), 2);
    }

    #[test]
    fn a_fetched_range_decodes_and_a_flipped_bit_is_caught() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let s = r(7, 1000, data.len() as u32);
        let obj = encode_slice(3, &s, &data);
        for (a, b) in [
            (1000, 1010),
            (70_000, 200_000),
            (1000, 201_000),
            (150_000, 150_001),
        ] {
            let (start, end) = slice_fetch_range(&s, (a, b));
            let got = decode_slice_range(3, &s, (a, b), &obj[start as usize..end as usize])
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(got, data[(a - 1000) as usize..(b - 1000) as usize]);
        }
        let mut bad = obj.clone();
        bad[SLICE_HEADER_BYTES + 70_000] ^= 1;
        let (start, end) = slice_fetch_range(&s, (70_000, 80_000));
        assert!(
            decode_slice_range(3, &s, (70_000, 80_000), &bad[start as usize..end as usize])
                .is_err()
        );
        assert!(
            decode_slice_range(4, &s, (1000, 1010), &obj[..SLICE_HEADER_BYTES + 65540]).is_err()
        );
    }

    #[test]
    fn object_names_round_trip_and_strangers_are_ignored() {
        let name = slice_object_name(0x1234, 99, 0xabc);
        assert_eq!(parse_slice_object_name(&name), Some((0x1234, 99, 0xabc)));
        assert_eq!(
            parse_slice_object_name("data/34/x.s/0000000000000abc"),
            None
        );
        assert_eq!(
            parse_slice_object_name(&format!("{}/{:016x}", slice_folder(1, 2), 0)),
            None
        );
    }
}

//! An object's bytes in the memory store, as 4 KiB blocks shared between copies.
//!
//! A copy (a crash image, a deep clone, the durable copy of a block just synced) takes
//! references, never bytes: whichever side writes first copies the list of references, then
//! each block it changes. So a crash costs a few pointers per object instead of the
//! object's bytes, and the journal's zero-filled segments cost nothing at all: a block
//! never written, or written with zeros only, is absent and reads as zeros.

use std::sync::Arc;

/// Bytes per block: the memory store's unit of durability and of tearing (what a disk
/// writes atomically), and the unit of sharing.
pub(crate) const BLOCK: usize = 4096;

type Block = [u8; BLOCK];

/// Bytes of one object. Invariants: `blocks` holds `len.div_ceil(BLOCK)` entries, and the
/// bytes of the last block past `len` are zeros (so a block can be shared with a copy of
/// another length whose end falls in the same place, and growing needs no clearing).
#[derive(Clone, Debug, Default)]
pub(crate) struct Blocks {
    len: usize,
    /// `None`: a block of zeros.
    blocks: Arc<Vec<Option<Arc<Block>>>>,
}

/// True if every byte is zero: 64 bytes at a time, which the compiler vectorizes (a
/// byte-wise `all` does not, and the journal writes whole segments of zeros).
fn is_zero(bytes: &[u8]) -> bool {
    let mut chunks = bytes.chunks_exact(64);
    let whole = chunks.all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0);
    whole && chunks.remainder().iter().all(|&b| b == 0)
}

impl Blocks {
    pub(crate) fn from_slice(data: &[u8]) -> Blocks {
        let mut b = Blocks::default();
        b.resize(data.len());
        b.write(0, data);
        b
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Copies the bytes at `offset` into `buf` (as many as there are); returns how many.
    pub(crate) fn read(&self, offset: usize, buf: &mut [u8]) -> usize {
        let start = offset.min(self.len);
        let n = buf.len().min(self.len - start);
        let mut done = 0;
        while done < n {
            let pos = start + done;
            let (b, at) = (pos / BLOCK, pos % BLOCK);
            let k = (BLOCK - at).min(n - done);
            let out = &mut buf[done..done + k];
            match &self.blocks[b] {
                Some(block) => out.copy_from_slice(&block[at..at + k]),
                None => out.fill(0),
            }
            done += k;
        }
        n
    }

    /// The bytes of `[start, end)`, cut at the end.
    pub(crate) fn range(&self, start: usize, end: usize) -> Vec<u8> {
        let start = start.min(self.len);
        let mut out = vec![0u8; end.clamp(start, self.len) - start];
        self.read(start, &mut out);
        out
    }

    pub(crate) fn to_vec(&self) -> Vec<u8> {
        self.range(0, self.len)
    }

    /// Writes `data` at `offset`, which must end within the length (the caller grows the
    /// object first).
    pub(crate) fn write(&mut self, offset: usize, data: &[u8]) {
        let end = offset + data.len();
        assert!(end <= self.len, "a write past the end of the blocks");
        if data.is_empty() {
            return;
        }
        let blocks = Arc::make_mut(&mut self.blocks);
        let mut pos = offset;
        while pos < end {
            let (b, at) = (pos / BLOCK, pos % BLOCK);
            let k = (BLOCK - at).min(end - pos);
            let from = &data[pos - offset..pos - offset + k];
            match &mut blocks[b] {
                None if is_zero(from) => {}
                None => {
                    let mut block = Arc::new([0u8; BLOCK]);
                    Arc::make_mut(&mut block)[at..at + k].copy_from_slice(from);
                    blocks[b] = Some(block);
                }
                Some(block) => Arc::make_mut(block)[at..at + k].copy_from_slice(from),
            }
            pos += k;
        }
    }

    /// Truncates, or extends with zeros.
    pub(crate) fn resize(&mut self, len: usize) {
        if len == self.len {
            return;
        }
        let count = len.div_ceil(BLOCK);
        let blocks = Arc::make_mut(&mut self.blocks);
        if len < self.len {
            blocks.truncate(count);
            let cut = len % BLOCK;
            if cut != 0
                && let Some(Some(last)) = blocks.last_mut()
            {
                Arc::make_mut(last)[cut..].fill(0);
            }
        } else {
            blocks.resize(count, None);
        }
        self.len = len;
    }

    /// Block `b` takes what block `b` of `src` holds, up to this object's length (zeros
    /// past the end of `src`): shared when both end in the same place, else copied.
    pub(crate) fn take_block(&mut self, src: &Blocks, b: usize) {
        let start = b * BLOCK;
        assert!(start < self.len, "a block past the end");
        let end = (start + BLOCK).min(self.len);
        let src_end = (start + BLOCK).min(src.len).max(start);
        let taken = if src_end == end {
            src.blocks[b].clone()
        } else {
            let mut block = [0u8; BLOCK];
            let n = end.min(src_end) - start;
            src.read(start, &mut block[..n]);
            (!is_zero(&block)).then(|| Arc::new(block))
        };
        Arc::make_mut(&mut self.blocks)[b] = taken;
    }

    /// Blocks that hold bytes (the others read as zeros).
    #[cfg(test)]
    pub(crate) fn allocated_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| b.is_some()).count()
    }

    #[cfg(test)]
    fn check(&self) {
        assert_eq!(self.blocks.len(), self.len.div_ceil(BLOCK));
        if let Some(Some(last)) = self.blocks.last() {
            let used = self.len - (self.blocks.len() - 1) * BLOCK;
            assert!(is_zero(&last[used..]), "bytes past the end");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same operations on blocks and on a plain vector read the same.
    #[test]
    fn blocks_read_as_a_vector_does() {
        let mut b = Blocks::default();
        let mut v: Vec<u8> = Vec::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..2000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x % (5 * BLOCK as u64)) as usize;
            let n = ((x >> 20) % (2 * BLOCK as u64)) as usize;
            match i % 4 {
                0 | 1 => {
                    let byte = if i % 8 == 1 { 0 } else { (x >> 40) as u8 | 1 };
                    let data = vec![byte; n];
                    if v.len() < off + n {
                        v.resize(off + n, 0);
                        b.resize(off + n);
                    }
                    v[off..off + n].copy_from_slice(&data);
                    b.write(off, &data);
                }
                2 => {
                    v.resize(off, 0);
                    b.resize(off);
                }
                _ => {
                    let src = Blocks::from_slice(&v[..off.min(v.len())]);
                    let sv = src.to_vec();
                    let at = (x >> 30) as usize % v.len().max(1);
                    if at < v.len() {
                        let blk = at / BLOCK;
                        b.take_block(&src, blk);
                        let s = blk * BLOCK;
                        let e = (s + BLOCK).min(v.len());
                        for (k, o) in v[s..e].iter_mut().enumerate() {
                            *o = sv.get(s + k).copied().unwrap_or(0);
                        }
                    }
                }
            }
            b.check();
            assert_eq!(b.to_vec(), v, "step {i}");
        }
    }

    #[test]
    fn copies_share_blocks_until_written() {
        let mut a = Blocks::from_slice(&[7u8; 3 * BLOCK]);
        let copy = a.clone();
        a.write(BLOCK, &[1]);
        assert_eq!(copy.to_vec(), vec![7u8; 3 * BLOCK], "the copy is untouched");
        assert_eq!(a.range(BLOCK, BLOCK + 2), [1, 7]);
        assert!(Arc::ptr_eq(
            a.blocks[0].as_ref().unwrap(),
            copy.blocks[0].as_ref().unwrap()
        ));
        assert!(!Arc::ptr_eq(
            a.blocks[1].as_ref().unwrap(),
            copy.blocks[1].as_ref().unwrap()
        ));
    }

    #[test]
    fn zeros_take_no_blocks() {
        let mut z = Blocks::default();
        z.resize(64 << 10);
        z.write(0, &vec![0u8; 64 << 10]);
        assert_eq!(z.allocated_blocks(), 0);
        assert_eq!(z.to_vec(), vec![0u8; 64 << 10]);
        z.write(5, b"x");
        assert_eq!(z.allocated_blocks(), 1);
        // A shrink into a block clears what was past the new end.
        z.resize(5);
        z.resize(6);
        assert_eq!(z.to_vec(), [0u8; 6]);
    }
}

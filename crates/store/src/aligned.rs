//! A reusable buffer aligned for direct I/O.

use crate::DIRECT_ALIGN;
use std::alloc::{Layout, alloc_zeroed, dealloc};

/// A heap buffer whose address and length are multiples of `DIRECT_ALIGN`.
pub struct AlignedBuf {
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: the buffer is a plain heap allocation owned by one thread at a time.
unsafe impl Send for AlignedBuf {}

impl Default for AlignedBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl AlignedBuf {
    pub fn new() -> AlignedBuf {
        AlignedBuf {
            ptr: std::ptr::null_mut(),
            cap: 0,
        }
    }

    /// A zeroed slice of `len` bytes rounded up to whole blocks, reusing the allocation.
    pub fn zeroed(&mut self, len: usize) -> &mut [u8] {
        let slice = self.reused(len);
        slice.fill(0);
        slice
    }

    /// Like `zeroed`, without the zeroing: the bytes are what this buffer held last (zero
    /// when new), so a caller must use only what it wrote into them (a read's count).
    pub fn reused(&mut self, len: usize) -> &mut [u8] {
        let need = len.div_ceil(DIRECT_ALIGN).max(1) * DIRECT_ALIGN;
        if need > self.cap {
            self.free();
            let cap = need.next_power_of_two().max(DIRECT_ALIGN * 16);
            let layout = Layout::from_size_align(cap, DIRECT_ALIGN)
                .unwrap_or_else(|_| panic!("aligned buffer of {cap} bytes"));
            // SAFETY: the layout has a non-zero size.
            let ptr = unsafe { alloc_zeroed(layout) };
            if ptr.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            self.ptr = ptr;
            self.cap = cap;
        }
        // SAFETY: `ptr` points to `cap >= need` bytes owned by this buffer, all initialized
        // (allocated zeroed, then only ever written), and the only reference handed out
        // borrows `self` mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, need) }
    }

    /// Replaces the contents with `data`, zero-extended to whole blocks.
    pub fn fill(&mut self, data: &[u8]) -> &[u8] {
        let slice = self.zeroed(data.len());
        slice[..data.len()].copy_from_slice(data);
        slice
    }

    fn free(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated in `zeroed` with exactly this layout.
            unsafe {
                dealloc(
                    self.ptr,
                    Layout::from_size_align_unchecked(self.cap, DIRECT_ALIGN),
                )
            };
            self.ptr = std::ptr::null_mut();
            self.cap = 0;
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_padded() {
        let mut b = AlignedBuf::new();
        let s = b.fill(b"abc");
        assert_eq!(s.len(), DIRECT_ALIGN);
        assert_eq!(s.as_ptr() as usize % DIRECT_ALIGN, 0);
        assert_eq!(&s[..4], b"abc\0");
        assert_eq!(b.zeroed(DIRECT_ALIGN * 3).len(), DIRECT_ALIGN * 3);
    }
}

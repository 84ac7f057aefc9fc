//! The rest of a readdirplus page, kept for the kernel's next request on the same handle.
//!
//! The kernel's readdirplus buffer holds a few dozen entries (a page of memory), while the
//! mount fetches up to `READDIR_PAGE` (512) per round trip: without this, a listing of a
//! large directory fetched 512 entries for every few dozen it used. The rest of a page
//! waits here, per directory handle, for the request that resumes where the kernel
//! stopped; the final, empty request of a listing is answered here too.
//!
//! A kept page is used only while nothing could have made it stale: not after a callback
//! (another client changed something), not after any change this mount made (its own
//! changes call nobody back), and not once older than `PAGE_KEEP_MAX`. One counter, bumped
//! by all of those, says so (`epoch`): a page fetched under another value is dropped.

use kochab_proto::{Attr, DirEntry};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Longest a kept page is used after its fetch (the kernel asks for the next part of a
/// listing at once; a listing paused longer fetches again).
const PAGE_KEEP_MAX: Duration = Duration::from_secs(1);

/// Entries of a listing not yet handed to the kernel.
pub struct Page {
    /// The kernel's inode number of the directory.
    pub dir: u64,
    /// The offset (cookie) the kernel's next request must ask from to be served by it.
    pub next: u64,
    /// The entries, with their attributes.
    pub entries: VecDeque<(DirEntry, Attr)>,
    /// The listing ends after these entries.
    pub eof: bool,
    /// When the request that fetched it reached the mount (TTLs count from then).
    pub arrived: Instant,
    epoch: u64,
}

impl Page {
    /// A page fetched for a request that reached the mount at `arrived`, asked at offset
    /// `next`, when the epoch was `epoch` (read before the fetch was sent).
    pub fn new(
        dir: u64,
        next: u64,
        entries: VecDeque<(DirEntry, Attr)>,
        eof: bool,
        arrived: Instant,
        epoch: u64,
    ) -> Page {
        Page {
            dir,
            next,
            entries,
            eof,
            arrived,
            epoch,
        }
    }
}

/// Kept pages per directory handle.
#[derive(Default)]
pub struct Listings {
    pages: Mutex<FxHashMap<u64, Page>>,
    epoch: AtomicU64,
}

impl Listings {
    /// Something may have changed (a callback, or any change this mount sends: every
    /// handler of one calls this first): no kept page is used any more.
    pub fn changed(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// The current epoch (read before a fetch is sent).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The kept page of handle `fh` if it serves a request for `dir` at `offset` now.
    pub fn take(&self, fh: u64, dir: u64, offset: u64, now: Instant) -> Option<Page> {
        let page = self.pages.lock().remove(&fh)?;
        let fresh = now.saturating_duration_since(page.arrived) < PAGE_KEEP_MAX;
        (page.dir == dir && page.next == offset && page.epoch == self.epoch() && fresh)
            .then_some(page)
    }

    /// Hands `page`'s entries to `add` in order until it says the kernel's buffer is
    /// full, then keeps the rest (or the listing's empty end, once) for handle `fh`'s next
    /// request.
    pub fn serve(&self, fh: u64, mut page: Page, mut add: impl FnMut(&DirEntry, &Attr) -> bool) {
        let mut served = false;
        while let Some((e, attr)) = page.entries.front() {
            if add(e, attr) {
                break;
            }
            served = true;
            page.next = e.cookie;
            page.entries.pop_front();
        }
        if !page.entries.is_empty() || (page.eof && served) {
            self.keep(fh, page);
        }
    }

    /// Keeps what is left of `page` for the handle's next request.
    pub fn keep(&self, fh: u64, page: Page) {
        self.pages.lock().insert(fh, page);
    }

    /// The handle was closed.
    pub fn closed(&self, fh: u64) {
        self.pages.lock().remove(&fh);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(l: &Listings, next: u64, arrived: Instant) -> Page {
        Page::new(5, next, VecDeque::new(), true, arrived, l.epoch())
    }

    #[test]
    fn a_page_serves_only_the_request_that_resumes_it_while_nothing_changed() {
        let l = Listings::default();
        let t = Instant::now();
        l.keep(1, page(&l, 40, t));
        assert!(l.take(1, 5, 41, t).is_none(), "another offset");
        l.keep(1, page(&l, 40, t));
        assert!(l.take(1, 6, 40, t).is_none(), "another directory");
        l.keep(1, page(&l, 40, t));
        assert!(l.take(1, 5, 40, t + PAGE_KEEP_MAX).is_none(), "too old");
        l.keep(1, page(&l, 40, t));
        assert!(l.take(1, 5, 40, t).is_some());
        assert!(l.take(1, 5, 40, t).is_none(), "taken once");
        let p = page(&l, 40, t);
        l.changed();
        l.keep(1, p);
        assert!(l.take(1, 5, 40, t).is_none(), "fetched before a change");
        l.keep(2, page(&l, 40, t));
        l.closed(2);
        assert!(l.take(2, 5, 40, t).is_none(), "closed");
    }
}

//! FUSE over io_uring (Linux 6.14+, `/sys/module/fuse/parameters/enable_uring`), the
//! mount's default transport where the kernel offers it.
//!
//! With /dev/fuse, a request from a program on one CPU wakes whichever request loop waits
//! on the device, mostly on the other CPU, and its reply wakes the program back across
//! CPUs: two cross-CPU wake-ups per request, the dearest part of a request on a virtual
//! machine. The kernel's io_uring transport has one queue per CPU: a request goes to the
//! queue of the CPU its program runs on. Here each queue is served by a thread pinned to
//! that CPU, which drives a runtime of its own: a request the mount answers from its
//! caches (a lookup of a name known absent, a flush or release with nothing to report, a
//! cached attribute, a small write held back) is answered in the turn that took it, and one
//! that needs the servers runs as a task of that runtime, over the queue's own connections
//! (a client lane, `kochab_client::set_lane`, 16 per server at most) whose server side, for
//! a server of this process, runs there too (`kochab_local`). A request is served on its
//! program's CPU from start to end without waking another thread; only the journal's
//! flush, the server's data and parked operations and what other mounts must do happen
//! elsewhere. Nothing a request does may block this thread on the kernel (an invalidation
//! of pages waits for reads that this thread may be the one to answer): such calls go to
//! the runtime's blocking pool.
//!
//! Protocol (kernel `fs/fuse/dev_uring.c`): each ring entry is a header buffer (the in or
//! out header, the operation's first argument, and the entry's commit id and payload size)
//! and a payload buffer (the remaining arguments, or the reply's arguments); REGISTER hands
//! an entry to the kernel, whose completion carries a request; COMMIT_AND_FETCH answers it
//! and hands the entry back. The kernel delivers an entry's next request through task work
//! of the thread that submitted its last command, so every command is submitted by the
//! queue's thread. Until every CPU's queue has an entry the kernel keeps using /dev/fuse,
//! and forgets and interrupts always come through /dev/fuse: the request loops keep running
//! beside the queues. The transport is not negotiated in FUSE_INIT, so a kernel that
//! refuses the registration (the module parameter off) simply keeps /dev/fuse.
//!
//! `KOCHAB_FUSE_URING=0` in the environment keeps /dev/fuse (to measure the difference:
//! docs/BENCHMARKS.md, "FUSE over io_uring").

use fuser::{Dispatch, ReplyChannel};
use io_uring::{IoUring, cqueue, opcode, squeue, types};
use parking_lot::Mutex;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Environment variable that turns FUSE over io_uring off (`0`).
pub const URING_ENV: &str = "KOCHAB_FUSE_URING";

/// Entries a queue starts with: requests of one CPU's programs in the mount at once. A
/// request beyond them waits in the kernel until an entry is answered.
const DEPTH: usize = 64;
/// Entries kept with the kernel for new requests. A request the mount holds for long holds
/// its entry (a blocked lock request until the lock is granted), and the requests queued
/// behind may be the ones that end the wait (the holder's unlock, or its close): when the
/// requests in the mount leave fewer than this many entries with the kernel, the queue
/// registers `GROW` more, up to `MAX_DEPTH` (the kernel has no way to take entries back).
const RESERVE: usize = 16;
const GROW: usize = 16;
const MAX_DEPTH: usize = 4096;

/// `struct fuse_uring_req_header`: in/out header, first argument, `fuse_uring_ent_in_out`.
const IN_OUT_SIZE: usize = 128;
const OP_IN_SIZE: usize = 128;
const HEADER_SIZE: usize = IN_OUT_SIZE + OP_IN_SIZE + 32;
/// Offsets in the header buffer of `fuse_uring_ent_in_out.commit_id` and `.payload_sz`.
const COMMIT_ID_AT: usize = IN_OUT_SIZE + OP_IN_SIZE + 8;
const PAYLOAD_SZ_AT: usize = IN_OUT_SIZE + OP_IN_SIZE + 16;
/// `struct fuse_in_header` and `struct fuse_out_header`.
const IN_HEADER_SIZE: usize = 40;
const OUT_HEADER_SIZE: usize = 16;
/// `enum fuse_uring_cmd`.
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// Set when the first request arrives through a ring (logged once per process).
static ANNOUNCED: AtomicBool = AtomicBool::new(false);

/// Whether the mount tries FUSE over io_uring (unless `KOCHAB_FUSE_URING=0`).
pub fn wanted() -> bool {
    std::env::var(URING_ENV).map_or(true, |v| v != "0")
}

/// The queues of one mount; dropping it does not stop them (see `stop`).
pub struct Ring {
    queues: Vec<Arc<Queue>>,
    running: Arc<Running>,
}

/// The queue threads of a ring still running. A thread counts until it has shut its
/// runtime down and dropped its dispatcher: the dispatcher holds the session's file system,
/// whose last holder runs its `destroy` (flush, wait for durability, end the session at the
/// servers). The session runs it itself, in order, only if no queue thread still holds it
/// when its request loops end; otherwise the last queue thread to end would run it, on its
/// own, while the process goes on to shut its runtime down under it (a panic: "A Tokio 1.x
/// context was found, but it is being shutdown").
#[derive(Default)]
struct Running {
    left: AtomicUsize,
    ended: tokio::sync::Notify,
}

/// Counts one queue thread out when dropped: after `serve` returned, or while a panic
/// unwinds it.
struct ThreadEnd(Arc<Running>);

impl Drop for ThreadEnd {
    fn drop(&mut self) {
        if self.0.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.ended.notify_waiters();
        }
    }
}

impl Ring {
    /// Starts a queue thread per possible CPU, registering ring entries of
    /// `max_payload` bytes on `dev` (a /dev/fuse descriptor of the session, after INIT).
    pub fn start(
        dev: OwnedFd,
        dispatcher: Arc<dyn Dispatch>,
        max_payload: usize,
    ) -> io::Result<Ring> {
        let dev = Arc::new(dev);
        // Every queue's first entries are made before any thread registers one: the ring
        // is used only once each queue has registered.
        let queues = (0..possible_cpus())
            .map(|qid| Queue::new(qid, max_payload).map(Arc::new))
            .collect::<io::Result<Vec<_>>>()?;
        {
            let mut all = ALL_QUEUES.lock();
            all.retain(|q| q.strong_count() > 0);
            all.extend(queues.iter().map(Arc::downgrade));
        }
        let running = Arc::new(Running::default());
        for queue in &queues {
            let (q, dev, dispatcher) = (queue.clone(), dev.clone(), dispatcher.clone());
            running.left.fetch_add(1, Ordering::AcqRel);
            let end = ThreadEnd(running.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("fuse-ring-{}", queue.qid))
                .spawn(move || {
                    serve(q, dev, dispatcher);
                    drop(end);
                });
            // A thread not started counts itself out as its closure (and `end`) is dropped.
            spawned?;
        }
        Ok(Ring { queues, running })
    }

    /// Ends the queue threads once the session is over (each exits when it wakes).
    pub fn stop(&self) {
        for q in &self.queues {
            q.stop.store(true, Ordering::Release);
            q.notify.notify_one();
        }
    }

    /// Waits until every queue thread has ended (see [`Running`]), after [`Ring::stop`].
    pub async fn stopped(&self) {
        loop {
            let ended = self.running.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if self.running.left.load(Ordering::Acquire) == 0 {
                return;
            }
            ended.await;
        }
    }
}

/// One ring entry's buffers. They stay where they are for the life of the queue, and the
/// kernel writes them only between a REGISTER or COMMIT_AND_FETCH and its completion; the
/// mount reads and writes them only between a completion and the next command, through one
/// reply at a time (fuser answers each request once). The payload buffer is mapped, not
/// allocated: its pages cost memory only once a request or reply as large as them has
/// used them, so entries for small requests (and for lock requests that wait) are cheap.
struct Entry {
    header: *mut u8,
    payload: *mut u8,
    iov: Box<[libc::iovec; 2]>,
    commit_id: AtomicU64,
}

// SAFETY: the raw pointers are to buffers the entry owns (freed in `Drop`), used as the
// comment on `Entry` says: by one side at a time.
unsafe impl Send for Entry {}
// SAFETY: as above.
unsafe impl Sync for Entry {}

impl Entry {
    fn new(max_payload: usize) -> io::Result<Entry> {
        // SAFETY: a private anonymous mapping of a new range, no file, no address asked for.
        let payload = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                max_payload,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if payload == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let payload = payload.cast::<u8>();
        let header = Box::into_raw(vec![0u8; HEADER_SIZE].into_boxed_slice()).cast::<u8>();
        let iov = Box::new([
            libc::iovec {
                iov_base: header.cast(),
                iov_len: HEADER_SIZE,
            },
            libc::iovec {
                iov_base: payload.cast(),
                iov_len: max_payload,
            },
        ]);
        Ok(Entry {
            header,
            payload,
            iov,
            commit_id: AtomicU64::new(0),
        })
    }

    // Shared entries hand out their buffers mutably: see `Entry` for who may use them when.
    #[allow(clippy::mut_from_ref)]
    fn header(&self) -> &mut [u8] {
        // SAFETY: see `Entry`: the caller owns the entry between completion and command.
        unsafe { std::slice::from_raw_parts_mut(self.header, HEADER_SIZE) }
    }

    #[allow(clippy::mut_from_ref)]
    fn payload(&self) -> &mut [u8] {
        // SAFETY: as `header`.
        unsafe { std::slice::from_raw_parts_mut(self.payload, self.iov[1].iov_len) }
    }

    /// Copies the request the kernel put in the entry into `out` as a read of /dev/fuse
    /// would have returned it: the in header, the first argument, the rest.
    fn request(&self, out: &mut Vec<u8>) -> io::Result<()> {
        let header = self.header();
        let field = |at: usize| {
            u32::from_ne_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
        };
        let len = field(0) as usize;
        let payload = field(PAYLOAD_SZ_AT) as usize;
        self.commit_id.store(
            u64::from_ne_bytes(
                header[COMMIT_ID_AT..COMMIT_ID_AT + 8]
                    .try_into()
                    .unwrap_or_default(),
            ),
            Ordering::Relaxed,
        );
        let first = len
            .checked_sub(IN_HEADER_SIZE + payload)
            .filter(|&n| n <= OP_IN_SIZE && payload <= self.iov[1].iov_len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed ring request"))?;
        out.clear();
        out.extend_from_slice(&header[..IN_HEADER_SIZE]);
        out.extend_from_slice(&header[IN_OUT_SIZE..IN_OUT_SIZE + first]);
        out.extend_from_slice(&self.payload()[..payload]);
        Ok(())
    }

    /// Writes a reply (out header, then arguments) into the entry; false if it is larger
    /// than the payload buffer.
    fn put_reply(&self, data: &[IoSlice<'_>]) -> bool {
        let total: usize = data.iter().map(|s| s.len()).sum();
        if total < OUT_HEADER_SIZE || total - OUT_HEADER_SIZE > self.iov[1].iov_len {
            return false;
        }
        let (header, payload) = (self.header(), self.payload());
        let (mut at, mut put) = (0, 0);
        for s in data {
            let mut s: &[u8] = s;
            if at < OUT_HEADER_SIZE {
                let n = (OUT_HEADER_SIZE - at).min(s.len());
                header[at..at + n].copy_from_slice(&s[..n]);
                at += n;
                s = &s[n..];
            }
            payload[put..put + s.len()].copy_from_slice(s);
            put += s.len();
        }
        header[PAYLOAD_SZ_AT..PAYLOAD_SZ_AT + 4].copy_from_slice(&(put as u32).to_ne_bytes());
        true
    }

    /// Writes an error reply for the entry's request.
    fn put_error(&self, errno: i32) {
        let unique = self.commit_id.load(Ordering::Relaxed);
        let mut out = [0u8; OUT_HEADER_SIZE];
        out[..4].copy_from_slice(&(OUT_HEADER_SIZE as u32).to_ne_bytes());
        out[4..8].copy_from_slice(&(-errno).to_ne_bytes());
        out[8..].copy_from_slice(&unique.to_ne_bytes());
        self.put_reply(&[IoSlice::new(&out)]);
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        // SAFETY: the header was made by `Box::into_raw` of a boxed slice of this length
        // and the payload mapped with this length in `new`; the queue (so the kernel's use
        // of them) is over.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.header,
                HEADER_SIZE,
            )));
            libc::munmap(self.payload.cast(), self.iov[1].iov_len);
        }
    }
}

/// One CPU's queue: its entries (the first `DEPTH`, then more as needed: slots fill in
/// order and are never emptied, so an index once handed out stays valid), and the entries
/// answered but not yet committed.
struct Queue {
    qid: u16,
    max_payload: usize,
    entries: Box<[std::sync::OnceLock<Entry>]>,
    answered: Mutex<Vec<u32>>,
    /// Wakes the queue's thread: answers are in, a settle is asked, or the session is over.
    notify: tokio::sync::Notify,
    stop: AtomicBool,
    /// Settles asked for (see [`settled`]) and served: a turn that saw `asked` at its start
    /// sets `served` to it at its end, and wakes `turned`.
    asked: AtomicU64,
    served: AtomicU64,
    turned: tokio::sync::Notify,
}

impl Queue {
    fn new(qid: usize, max_payload: usize) -> io::Result<Queue> {
        let queue = Queue {
            qid: u16::try_from(qid).unwrap_or(u16::MAX),
            max_payload,
            entries: (0..MAX_DEPTH).map(|_| std::sync::OnceLock::new()).collect(),
            answered: Mutex::new(Vec::with_capacity(DEPTH)),
            notify: tokio::sync::Notify::new(),
            stop: AtomicBool::new(false),
            asked: AtomicU64::new(0),
            served: AtomicU64::new(0),
            turned: tokio::sync::Notify::new(),
        };
        for index in 0..DEPTH {
            queue.add_entry(index)?;
        }
        Ok(queue)
    }

    /// Ends a turn that saw `settle` settles asked at its start.
    fn turn_ended(&self, settle: u64) {
        if settle > self.served.load(Ordering::Acquire) {
            self.served.fetch_max(settle, Ordering::AcqRel);
            self.turned.notify_waiters();
        }
    }

    /// Makes entry `index`, the first slot not yet filled.
    fn add_entry(&self, index: usize) -> io::Result<()> {
        let slot = self
            .entries
            .get(index)
            .ok_or_else(|| io::Error::other("no ring entry slot left"))?;
        let entry = Entry::new(self.max_payload)?;
        slot.set(entry)
            .map_err(|_| io::Error::other("ring entry made twice"))
    }

    /// Entry `index`, made by `add_entry`.
    fn entry(&self, index: usize) -> Option<&Entry> {
        self.entries.get(index)?.get()
    }

    /// Entry `index` holds its reply: the queue's thread commits it.
    fn answered(&self, index: u32) {
        self.answered.lock().push(index);
        // From the queue's own thread too: a request's task answers while the ring waits.
        self.notify.notify_one();
    }

    /// The 80 command bytes of a `struct fuse_uring_cmd_req`.
    fn command(&self, commit_id: u64) -> [u8; 80] {
        let mut cmd = [0u8; 80];
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        cmd
    }

    /// The REGISTER command of entry `index` (made: see `entry`).
    fn register(&self, dev: RawFd, index: usize) -> Option<squeue::Entry128> {
        let e = self.entry(index)?;
        let sqe = opcode::UringCmd80::new(types::Fd(dev), CMD_REGISTER)
            .cmd(self.command(0))
            .addr(Some(e.iov.as_ptr() as u64))
            .build()
            .user_data(index as u64);
        Some(with_len(sqe, 2))
    }

    fn commit(&self, dev: RawFd, index: usize) -> Option<squeue::Entry128> {
        let id = self.entry(index)?.commit_id.load(Ordering::Relaxed);
        let sqe = opcode::UringCmd80::new(types::Fd(dev), CMD_COMMIT_AND_FETCH)
            .cmd(self.command(id))
            .build()
            .user_data(index as u64);
        Some(sqe)
    }
}

/// Sets an SQE's `len` (the REGISTER command's iovec count), which io-uring's
/// `UringCmd80` builder does not expose.
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: `Entry128` is `repr(C)`: a 64-byte `io_uring_sqe` and 64 command bytes, 128
    // bytes in all; `len` is the u32 at byte 24 of `io_uring_sqe`.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    raw[24..28].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: the same bytes, one field changed to a valid u32.
    unsafe { std::mem::transmute(raw) }
}

/// The reply channel of one ring entry's request.
#[derive(Debug)]
struct EntryReply {
    queue: Arc<Queue>,
    index: u32,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fuse ring queue {}", self.qid)
    }
}

impl ReplyChannel for EntryReply {
    fn send(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        let Some(e) = self.queue.entry(self.index as usize) else {
            return Err(io::Error::other("reply to a ring entry never made"));
        };
        let r = if e.put_reply(data) {
            Ok(())
        } else {
            // The request must still be answered, or its program waits forever.
            e.put_error(libc::EIO);
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "reply larger than the ring entry",
            ))
        };
        self.queue.answered(self.index);
        r
    }
}

thread_local! {
    /// The runtime of the queue whose thread this is.
    static QUEUE_RUNTIME: std::cell::RefCell<Option<tokio::runtime::Handle>> =
        const { std::cell::RefCell::new(None) };
}

/// Every queue of this process, for [`settled`].
static ALL_QUEUES: Mutex<Vec<std::sync::Weak<Queue>>> = Mutex::new(Vec::new());

/// How long [`settled`] waits for one queue at most (a queue's turn takes microseconds;
/// this only bounds a queue that stopped).
const SETTLE_MAX: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits until every queue has taken and dispatched each request the kernel had handed
/// it before this call. The kernel sends a RELEASE in the background to the queue of the
/// CPU that closed, so a lock request from a program on another CPU, sent after close(2)
/// returned, can reach the mount first: it must not overtake the release (which ends the
/// description's OFD locks). A request handed to a queue is delivered by task work on the
/// queue's thread, which runs when that thread next returns from a system call: a turn
/// asked to settle makes one (an empty submit) before it takes its completions.
pub async fn settled() {
    let queues: Vec<Arc<Queue>> = ALL_QUEUES
        .lock()
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .collect();
    for q in queues {
        let ticket = q.asked.fetch_add(1, Ordering::AcqRel) + 1;
        q.notify.notify_one();
        let wait = async {
            loop {
                let turned = q.turned.notified();
                tokio::pin!(turned);
                turned.as_mut().enable();
                if q.served.load(Ordering::Acquire) >= ticket || q.stop.load(Ordering::Acquire) {
                    return;
                }
                turned.await;
            }
        };
        if tokio::time::timeout(SETTLE_MAX, wait).await.is_err() {
            tracing::warn!("fuse ring {} did not settle within {SETTLE_MAX:?}", q.qid);
        }
    }
}

/// On a queue's thread, the runtime that thread drives: a request that needs the servers
/// runs there, start to end.
pub fn queue_runtime() -> Option<tokio::runtime::Handle> {
    QUEUE_RUNTIME.with(|r| r.borrow().clone())
}

/// A queue's thread: drives a runtime of its own, on which it serves the ring and runs the
/// requests that need the servers, over connections of its own (a client lane, see
/// `kochab_client::set_lane`), whose server side, for a server of this process, runs there
/// too: a request is served on the CPU its program runs on without waking another thread.
fn serve(queue: Arc<Queue>, dev: Arc<OwnedFd>, dispatcher: Arc<dyn Dispatch>) {
    serve_until_over(&queue, &dev, dispatcher);
    // Nothing comes through this queue any more: nobody waits for it to settle.
    queue.stop.store(true, Ordering::Release);
    queue.turned.notify_waiters();
}

fn serve_until_over(queue: &Arc<Queue>, dev: &Arc<OwnedFd>, dispatcher: Arc<dyn Dispatch>) {
    pin_to_cpu(usize::from(queue.qid));
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::info!("FUSE over io_uring unavailable (no runtime: {e}); using /dev/fuse");
            return;
        }
    };
    QUEUE_RUNTIME.with(|r| *r.borrow_mut() = Some(rt.handle().clone()));
    kochab_client::set_lane(Some(usize::from(queue.qid)));
    rt.block_on(serve_ring(queue, dev, dispatcher.as_ref()));
    // The session is over: the queue's tasks (requests, connections) end with its runtime,
    // without waiting for blocking calls they started.
    kochab_client::set_lane(None);
    QUEUE_RUNTIME.with(|r| *r.borrow_mut() = None);
    rt.shutdown_background();
}

/// The ring's descriptor, for the runtime's poller (readable: completions are in).
struct RingFd(RawFd);

impl AsRawFd for RingFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Registers the queue's entries, then dispatches each request the kernel puts in one and
/// commits the answers, until the session is over.
async fn serve_ring(queue: &Arc<Queue>, dev: &OwnedFd, dispatcher: &dyn Dispatch) {
    // A completion per entry at most is out at once.
    let (sq, cq) = (DEPTH as u32, MAX_DEPTH as u32);
    let mut ring: IoUring<squeue::Entry128, cqueue::Entry> = match IoUring::builder()
        .setup_cqsize(cq)
        .build(sq)
    {
        Ok(r) => r,
        Err(e) => {
            tracing::info!("FUSE over io_uring unavailable (io_uring setup: {e}); using /dev/fuse");
            return;
        }
    };
    // Declared after the ring, so dropped (deregistered) before the ring's descriptor closes.
    // SAFETY: the descriptor is the ring's, open until the ring is dropped, after `ready`.
    let registered =
        unsafe { AsyncFd::register_with_interest(RingFd(ring.as_raw_fd()), Interest::READABLE) };
    let ready = match registered {
        Ok(r) => r,
        Err(e) => {
            let e = e.into_parts().1;
            tracing::info!("FUSE over io_uring unavailable (poller: {e}); using /dev/fuse");
            return;
        }
    };
    let fd = dev.as_raw_fd();
    let mut pending: Vec<squeue::Entry128> =
        (0..DEPTH).filter_map(|i| queue.register(fd, i)).collect();
    // Entries made, those alive in the ring, and those whose request the mount holds.
    let (mut made, mut live, mut held) = (DEPTH, DEPTH, 0usize);
    let mut request = Vec::with_capacity(64 * 1024);
    let mut done: Vec<(u64, i32)> = Vec::with_capacity(2 * DEPTH);
    let mut commits: Vec<u32> = Vec::with_capacity(DEPTH);
    let mut logged = false;
    loop {
        // A settle asked before this turn (see `settled`): a system call first, which runs
        // the task work that hands this queue the requests the kernel routed to it.
        let settle = queue.asked.load(Ordering::Acquire);
        if settle > queue.served.load(Ordering::Acquire) && pending.is_empty() {
            let _ = ring.submit();
        }
        while !pending.is_empty() {
            {
                let mut sq = ring.submission();
                // What does not fit in the submission queue goes in the next round.
                pending.retain(|sqe| {
                    // SAFETY: every buffer an SQE names (the entries' iovecs and buffers)
                    // lives as long as the queue, which outlives the ring.
                    unsafe { sq.push(sqe) }.is_err()
                });
            }
            // Leaving would close the ring while the kernel routes this CPU's requests to
            // it (they would wait forever): an error other than a signal is logged and
            // retried.
            if let Err(e) = ring.submit()
                && e.raw_os_error() != Some(libc::EINTR)
            {
                tracing::error!("fuse ring {}: {e}", queue.qid);
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                break;
            }
        }
        // Buffers kept from turn to turn: nothing is allocated per turn.
        done.clear();
        done.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        if done.is_empty() && pending.is_empty() && queue.answered.lock().is_empty() {
            queue.turn_ended(settle);
            if live == 0 || queue.stop.load(Ordering::Acquire) {
                return;
            }
            if queue.asked.load(Ordering::Acquire) > settle {
                continue;
            }
            // Nothing to do: wait for a completion or an answer. Readiness is cleared
            // before the completions are looked at again, so none is missed.
            tokio::select! {
                r = ready.readable() => match r {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(e) => {
                        tracing::error!("fuse ring {}: poller: {e}", queue.qid);
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                },
                () = queue.notify.notified() => {}
            }
            continue;
        }
        for &(data, res) in &done {
            let Ok(index) = usize::try_from(data) else {
                continue;
            };
            let Some(entry) = queue.entry(index) else {
                continue;
            };
            if res < 0 {
                let errno = -res;
                if errno == libc::ENOTCONN
                    || errno == libc::ECONNABORTED
                    || errno == libc::ECANCELED
                {
                    live -= 1;
                } else if errno == libc::EOPNOTSUPP || errno == libc::EINVAL {
                    live -= 1;
                    if index >= DEPTH {
                        // One made while the ring served: the ring goes on without it (and
                        // makes no more, see `ending`).
                        tracing::warn!(
                            "fuse ring {}: entry {index} refused: {}",
                            queue.qid,
                            io::Error::from_raw_os_error(errno)
                        );
                    } else if !logged {
                        logged = true;
                        tracing::info!(
                            "FUSE over io_uring refused ({}); using /dev/fuse (the kernel offers it with \
                             `echo Y > /sys/module/fuse/parameters/enable_uring`)",
                            io::Error::from_raw_os_error(errno)
                        );
                    }
                } else {
                    // A commit the kernel could not match (its request ended meanwhile):
                    // the entry is out of the ring; hand it back.
                    tracing::debug!(
                        "fuse ring {}: entry {index}: {}",
                        queue.qid,
                        io::Error::from_raw_os_error(errno)
                    );
                    if errno == libc::EAGAIN {
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    }
                    pending.extend(queue.register(fd, index));
                }
                continue;
            }
            held += 1;
            if !ANNOUNCED.swap(true, Ordering::Relaxed) {
                tracing::info!("FUSE requests arrive through io_uring (a queue per CPU)");
            }
            let reply: Arc<dyn ReplyChannel> = Arc::new(EntryReply {
                queue: queue.clone(),
                index: index as u32,
            });
            // A request that does not parse is not dispatched (so not answered): EIO.
            let dispatched = entry
                .request(&mut request)
                .and_then(|()| dispatcher.dispatch(&request, reply));
            if let Err(e) = dispatched {
                tracing::error!("fuse ring {}: {e}", queue.qid);
                entry.put_error(libc::EIO);
                queue.answered(index as u32);
            }
        }
        std::mem::swap(&mut *queue.answered.lock(), &mut commits);
        held = held.saturating_sub(commits.len());
        for index in commits.drain(..) {
            pending.extend(queue.commit(fd, index as usize));
        }
        // Too few entries left with the kernel: make more (see `RESERVE`), unless the ring
        // is ending or refused (entries ended).
        let ending = live < made || queue.stop.load(Ordering::Acquire);
        let mut grow = if !ending && live.saturating_sub(held) < RESERVE {
            GROW.min(MAX_DEPTH - made)
        } else {
            0
        };
        while grow > 0 {
            grow -= 1;
            match queue.add_entry(made) {
                Ok(()) => {
                    pending.extend(queue.register(fd, made));
                    made += 1;
                    live += 1;
                }
                Err(e) => {
                    tracing::warn!("fuse ring {}: no entry beyond {made}: {e}", queue.qid);
                    break;
                }
            }
        }
        queue.turn_ended(settle);
        // Let the requests this turn spawned run before the next turn.
        tokio::task::yield_now().await;
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays within it for cpu < 1024.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < 1024 {
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                tracing::debug!(
                    "fuse ring {cpu}: not pinned: {}",
                    io::Error::last_os_error()
                );
            }
        }
    }
}

/// The kernel's queue count: its possible CPUs ("0-3" or "0,2-5").
fn possible_cpus() -> usize {
    let parse = |s: &str| -> Option<usize> {
        let mut max = 0;
        for part in s.trim().split(',') {
            let last = part.rsplit('-').next()?.trim().parse::<usize>().ok()?;
            max = max.max(last + 1);
        }
        Some(max)
    };
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| parse(&s))
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

//! FUSE request loops on the tokio runtime instead of threads of their own.
//!
//! With a thread per loop, every request that needs the servers crossed threads twice: the
//! loop's thread read it and woke a runtime worker to run it. Here a runtime task waits
//! until its /dev/fuse descriptor is readable (the runtime's poller) and reads and dispatches
//! requests on the worker that runs it: a request answered from the mount's caches is
//! answered there, and one that needs the servers is spawned onto the same worker, which
//! runs it (and, for a server of this process, the server's side too) without waking
//! another thread. The file system's methods never block for long (they spawn what waits),
//! which is what running them on a worker needs.
//!
//! `KOCHAB_FUSE_THREADS=1` in the environment keeps fuser's thread per loop (to measure
//! the difference).

use crate::uring;
use fuser::{LoopRunner, LoopStep, RequestLoop};
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::{Arc, OnceLock};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Environment variable that keeps fuser's threads (`1`).
pub const THREADS_ENV: &str = "KOCHAB_FUSE_THREADS";

/// Requests one loop reads and dispatches before it lets other tasks of its worker run.
const REQUESTS_PER_TURN: usize = 32;

/// How long a loop waits after it has read all there was before it looks again, while
/// FUSE over io_uring carries the requests. Then /dev/fuse carries only FORGETs and
/// INTERRUPTs: a remove of a file whose inode the kernel then evicts sends one FORGET, and
/// reading each as it comes woke this loop's worker once per remove (13 % of all CPU of a
/// remove phase). Waiting lets the kernel gather them into one BATCH_FORGET; an INTERRUPT
/// (a waiting lock request's signal) is answered at most this much later.
const GATHER_WITH_RING: std::time::Duration = std::time::Duration::from_millis(2);

/// How long the end of a request loop waits for the ring's queue threads to end. A queue
/// thread ends within a turn once stopped (its requests are never waited for: their tasks
/// are dropped with its runtime), so this bounds only a thread stuck in a system call; an
/// unmount then ends without waiting for it.
const RING_STOP_MAX: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether request loops run on the runtime (the default).
pub fn on_runtime() -> bool {
    std::env::var(THREADS_ENV).map_or(true, |v| v != "1")
}

/// A runner that starts each request loop as a task on `rt`, and with the first loop the
/// FUSE-over-io_uring queues (`uring`, entries of `ring_payload` bytes) when asked for.
pub fn runner(rt: tokio::runtime::Handle, ring_payload: usize) -> LoopRunner {
    let ring: Arc<OnceLock<Option<uring::Ring>>> = Arc::new(OnceLock::new());
    LoopRunner(Arc::new(move |lp: Box<dyn RequestLoop>| {
        // The loops start after INIT, which a ring registration needs.
        ring.get_or_init(|| start_ring(lp.as_ref(), ring_payload));
        set_nonblocking(lp.as_fd().as_raw_fd())?;
        let (done, finished) = std::sync::mpsc::channel();
        let ring = ring.clone();
        let gather = matches!(ring.get(), Some(Some(_))).then_some(GATHER_WITH_RING);
        rt.spawn(async move {
            let r = run(lp, gather).await;
            if let Err(e) = &r {
                tracing::error!("FUSE request loop ended: {e}");
            }
            // The session is over (unmounted): so are the queues. The loop's end is
            // reported only once they have ended, so that the session, not a queue thread,
            // runs the file system's `destroy` (see `uring::Ring::stopped`).
            if let Some(Some(ring)) = ring.get() {
                ring.stop();
                if tokio::time::timeout(RING_STOP_MAX, ring.stopped())
                    .await
                    .is_err()
                {
                    tracing::warn!(
                        "FUSE ring threads still running {RING_STOP_MAX:?} after the unmount; \
                         the last of them ends the session"
                    );
                }
            }
            let _ = done.send(r);
        });
        Ok(finished)
    }))
}

fn start_ring(lp: &dyn RequestLoop, payload: usize) -> Option<uring::Ring> {
    if !uring::wanted() {
        return None;
    }
    let started = lp
        .as_fd()
        .try_clone_to_owned()
        .and_then(|dev| uring::Ring::start(dev, lp.dispatcher(), payload));
    match started {
        Ok(ring) => Some(ring),
        Err(e) => {
            tracing::info!("FUSE over io_uring not started: {e}");
            None
        }
    }
}

/// A loop, registered with the poller by its descriptor.
struct Loop(Box<dyn RequestLoop>);

impl AsRawFd for Loop {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Reads and dispatches the loop's requests until the session ends; with `gather`, waits
/// that long after reading all there was before it looks again.
async fn run(lp: Box<dyn RequestLoop>, gather: Option<std::time::Duration>) -> io::Result<()> {
    // ERROR too: an unmount aborts the connection, which the descriptor reports as
    // POLLERR only; the read that follows sees ENODEV and ends the loop.
    let interest = Interest::READABLE | Interest::ERROR;
    // SAFETY: the descriptor is the loop's own, open for as long as the loop lives, and
    // the AsyncFd owns the loop.
    let mut fd = unsafe { AsyncFd::register_with_interest(Loop(lp), interest) }
        .map_err(|e| e.into_parts().1)?;
    loop {
        let mut ready = fd.ready_mut(interest).await?;
        let mut turn = 0;
        loop {
            match ready.get_inner_mut().0.step() {
                Ok(LoopStep::Continue) => {}
                Ok(LoopStep::Finished) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    ready.clear_ready_matching(tokio::io::Ready::READABLE);
                    if let Some(wait) = gather {
                        drop(ready);
                        tokio::time::sleep(wait).await;
                    }
                    break;
                }
                Err(e) => return Err(e),
            }
            turn += 1;
            if turn == REQUESTS_PER_TURN {
                // Still readable: come back after the tasks this turn spawned had a go.
                drop(ready);
                tokio::task::yield_now().await;
                break;
            }
        }
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the loop owns; only the status flags change.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

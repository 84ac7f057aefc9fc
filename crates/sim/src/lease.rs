//! Leases and callbacks (DESIGN.md, "Replies and durability": caching between mounts is
//! coherent by leases and callbacks): a holder whose session asked for leases caches a
//! file's size and bytes as the server showed them, and a writer in another session
//! changes the file. The writer's change is acknowledged only once every callback it
//! caused is done (the session's `Board`), and the holder drops what a callback names
//! before it answers. Time is the simulation's clock, the server's and the holder's: the
//! holder trusts what it cached for a lease from when it asked (as the mount does:
//! `kochab_fuse::coherence::ttl_since`, what is left of the lease since the request
//! reached it), and may stall (a stopped process) without answering its callbacks; the
//! writer's change is then acknowledged once the callback's deadline passed (the holder
//! goes into default) or the holder answers after all. Checked: when the change is
//! acknowledged, and after every step, the holder caches nothing the server has changed,
//! unless a callback of it is pending or its lease ran out on the holder's clock. A third
//! party may answer callbacks it never got (callback ids are a counter: any client can
//! name any); the server must ignore such answers.

use std::sync::Arc;
use std::time::Instant;

use kochab_meta::files::open_flags::{O_RDONLY, O_RDWR};
use kochab_proto::frame::{FRAME_HEADER_BYTES, decode_payload, parse_header};
use kochab_proto::{
    AtimeRule, Credentials, FrameKind, InodeId, Invalidation, OPEN_RECLAIM, Op, Reply, ReplyMode,
    Request,
};
use kochab_server::clock::Clock;
use kochab_server::leases::{CALLBACK_SLOW, LEASE};
use kochab_server::shared::Shared;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::exec::{run_data, run_meta};
use crate::step::{Ctx, SimStats};

/// The holder's session, and the writer's.
const HOLDER: u64 = 300;
const WRITER: u64 = 301;
/// The handle each has the file open with.
const HANDLE: u64 = 1;
/// Bytes of the file the writer writes in.
const SPAN: u64 = 8192;
/// The longest write.
const WRITE_MAX: u64 = 2000;
/// Chance (per mille) that the holder stalls when callbacks reach it, and that a stalled
/// holder comes back at one of its steps.
const STALL_PERMILLE: u64 = 350;
const WAKE_PERMILLE: u64 = 300;

/// What the holder caches of the file.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Cached {
    size: u64,
    bytes: Vec<u8>,
}

/// The holder's end of its connection: callback frames sent to it, not yet taken in.
struct Holder {
    rx: UnboundedReceiver<Vec<u8>>,
    /// Callbacks received, not yet acted on: (id, what to drop, when it arrived).
    inbox: Vec<(u64, Vec<Invalidation>, Instant)>,
    /// What it caches, and when the lease it caches it under was asked for (a lease runs
    /// out after `LEASE`, and the cache with it).
    cached: Option<(Cached, Instant)>,
    /// Stopped: it neither looks nor answers callbacks (they wait in its inbox).
    stalled: bool,
}

impl Holder {
    /// What it still caches at `now` (its own clock).
    fn cache(&self, now: Instant) -> Option<&Cached> {
        let (c, asked) = self.cached.as_ref()?;
        (now.saturating_duration_since(*asked) < LEASE).then_some(c)
    }
}

/// The holder, the writer and their file.
pub struct LeaseClients {
    id: InodeId,
    generation: u64,
    holder: Holder,
    next_value: u8,
    /// The ticket on the writer's board its last write waits for, while a stalled
    /// holder keeps it from being acknowledged.
    waiting: Option<u64>,
    /// The simulation's clock (the server reads the same).
    clock: Clock,
}

impl LeaseClients {
    /// Creates the file (durable, by the writer, which keeps it open for writing) in
    /// `dir` of `s`, and connects the holder.
    pub fn setup(s: &Arc<Shared>, dir: InodeId) -> Result<LeaseClients, String> {
        let op = Op::Create {
            parent: dir,
            name: b"leased".to_vec(),
            mode: 0o644,
            flags: O_RDWR,
            handle: HANDLE,
        };
        let reply = run_meta(s, WRITER, Request::plain(&Credentials::root(), op))?.0;
        let attr = reply
            .entry()
            .ok_or_else(|| format!("leased file: create answered {reply:?}"))?;
        let (id, generation) = (attr.id, attr.generation);
        let holder = connect(s, id)?;
        Ok(LeaseClients {
            id,
            generation,
            holder,
            next_value: 1,
            waiting: None,
            clock: s.clock().clone(),
        })
    }

    /// One step: the holder looks at the file (caching it), or the writer changes it. A
    /// stalled holder may come back first (it takes in its callbacks, late).
    pub fn step(&mut self, cx: &mut Ctx, s: &Arc<Shared>) -> Result<(), String> {
        if self.holder.stalled && cx.rng.chance(WAKE_PERMILLE) {
            cx.trace(|| "the holder comes back".into());
            self.holder.stalled = false;
            self.take_in(cx, s)?;
        }
        match cx.rng.range(0, 9) {
            0..=3 => self.look(cx, s),
            _ => self.change(cx, s),
        }
    }

    /// Time is about to pass: callbacks the server sent meanwhile (a reopen's, a grant's)
    /// reach the holder, and one that is not stalled answers them at once, as a mount
    /// does within milliseconds.
    pub fn before_time_passes(&mut self, cx: &mut Ctx, s: &Shared) -> Result<(), String> {
        match self.holder.stalled {
            true => {
                self.receive();
                Ok(())
            }
            false => self.take_in(cx, s),
        }
    }

    /// The writer's write that waited for a stalled holder is acknowledged once its
    /// callbacks are done (answered late, or run out): the holder caches nothing it
    /// changed, or its lease has run out.
    pub fn settle(&mut self, stats: &mut SimStats, s: &Shared) -> Result<(), String> {
        let Some(ticket) = self.waiting else {
            return Ok(());
        };
        if *s.callback_board(WRITER).subscribe().borrow() < ticket {
            return Ok(());
        }
        self.waiting = None;
        stats.late_acks += 1;
        self.acknowledged(s)
            .map_err(|e| format!("the write was acknowledged late, but {e}"))
    }

    /// The server restarted: both reconnect and reopen the file, and the holder, whose
    /// connection was lost, drops everything it cached (the writer's reply went with its
    /// connection: it waits for nothing).
    pub fn restarted(&mut self, s: &Arc<Shared>) -> Result<(), String> {
        self.waiting = None;
        self.holder = connect(s, self.id)?;
        let op = Op::Open {
            id: self.id,
            flags: O_RDWR | OPEN_RECLAIM,
            handle: HANDLE,
        };
        let reply = run_meta(s, WRITER, Request::plain(&Credentials::root(), op))?.0;
        match reply.entry() {
            Some(_) => Ok(()),
            None => Err(format!(
                "leased file: the writer's reopen answered {reply:?}"
            )),
        }
    }

    /// The holder caches nothing the server has changed, unless a callback of it is still
    /// unanswered (the change is not acknowledged yet) or its lease has run out on its
    /// clock (it trusts the cache no more).
    pub fn check(&self, s: &Shared) -> Result<(), String> {
        let Some(cached) = self.holder.cache(self.clock.now()) else {
            return Ok(());
        };
        let now = self.server_view(s)?;
        if *cached == now {
            return Ok(());
        }
        let core = s.core();
        let called_back = self.holder.inbox.iter().any(|(cb, list, _)| {
            core.callbacks.is_pending(*cb) && list.iter().any(|i| drops(i, self.id))
        });
        if called_back {
            return Ok(());
        }
        Err(format!(
            "the holder caches {} bytes of the leased file, the server has {} bytes \
             (other bytes), and no callback of it is pending",
            cached.size, now.size
        ))
    }

    /// The file as the server has it now.
    fn server_view(&self, s: &Shared) -> Result<Cached, String> {
        let size = s.file_size(self.id).unwrap_or(0);
        let bytes = s
            .data()
            .read(self.id, self.generation, size, 0, size as u32)
            .map_err(|e| format!("reading the leased file: {e}"))?;
        Ok(Cached { size, bytes })
    }

    /// The holder stats and reads the file (a lease on it granted by the stat) and caches
    /// both, having taken in the callbacks that came before the replies.
    fn look(&mut self, cx: &mut Ctx, s: &Arc<Shared>) -> Result<(), String> {
        let asked = self.clock.now();
        if self.holder.stalled || self.holder.cache(asked).is_some() {
            return Ok(());
        }
        if self.holder.cached.take().is_some() {
            cx.stats.leases_run_out += 1;
            cx.trace(|| "the holder's lease ran out: it asks again".into());
        }
        let stat = Request::plain(&Credentials::root(), Op::GetAttr { id: self.id });
        let reply = run_meta(s, HOLDER, stat)?.0;
        let Reply::Attr(attr) = reply else {
            return Err(format!("the holder's stat answered {reply:?}"));
        };
        let op = Op::Read {
            handle: HANDLE,
            offset: 0,
            len: SPAN as u32,
            atime: AtimeRule::Never,
        };
        let reply = run_data(cx, s, HOLDER, Request::plain(&Credentials::root(), op))?.0;
        let Reply::Bytes(bytes) = reply else {
            return Err(format!("the holder's read answered {reply:?}"));
        };
        self.take_in(cx, s)?;
        if s.core().callbacks.is_in_default(HOLDER) {
            // Granted nothing: it caches nothing.
            return Ok(());
        }
        cx.trace(|| format!("holder caches {} bytes", attr.size));
        let cached = Cached {
            size: attr.size,
            bytes,
        };
        self.holder.cached = Some((cached, asked));
        Ok(())
    }

    /// The writer writes the file. Its write is acknowledged once the callbacks it caused
    /// are done; a third session may answer them first (the server must not count that).
    fn change(&mut self, cx: &mut Ctx, s: &Arc<Shared>) -> Result<(), String> {
        let offset = cx.rng.range(0, SPAN - 1);
        let len = cx.rng.range(1, WRITE_MAX).min(SPAN - offset);
        let value = self.next_value;
        self.next_value = self.next_value % 250 + 1;
        let op = Op::Write {
            handle: HANDLE,
            offset,
            data: vec![value; len as usize],
        };
        let mut req = Request::plain(&Credentials::root(), op);
        req.mode = ReplyMode::Durable;
        let reply = run_data(cx, s, WRITER, req)?.0;
        cx.stats.data_ops += 1;
        if !matches!(reply, Reply::Attr(_)) {
            return Err(format!("the writer's write answered {reply:?}"));
        }
        let board = s.callback_board(WRITER);
        let ticket = board.ticket();
        self.receive();
        if !self.holder.inbox.is_empty() && cx.rng.chance(STALL_PERMILLE) {
            // It stops before it takes them in.
            self.holder.stalled = true;
        }
        cx.trace(|| {
            format!(
                "writer wrote {len} at {offset}; ticket {ticket}, holder's inbox {:?}",
                self.holder.inbox
            )
        });
        if cx.rng.chance(500) && !self.holder.inbox.is_empty() {
            // Another session answers the callbacks the holder got.
            let ids: Vec<u64> = self.holder.inbox.iter().map(|(id, _, _)| *id).collect();
            cx.trace(|| format!("another session answers callbacks {ids:?}"));
            s.callbacks_answered(WRITER, &ids);
        }
        if *board.subscribe().borrow() >= ticket {
            self.acknowledged(s)
                .map_err(|e| format!("the write was acknowledged, but {e}"))?;
        }
        if self.holder.stalled {
            // Its reply waits for the callbacks (see `settle`); later replies of the
            // writer wait behind it.
            cx.trace(|| format!("the holder is stalled: the write waits for ticket {ticket}"));
            self.waiting = Some(ticket);
            return Ok(());
        }
        self.take_in(cx, s)?;
        if *board.subscribe().borrow() < ticket {
            return Err("the holder answered every callback, the write is still held".into());
        }
        self.acknowledged(s)
    }

    /// The writer's change is acknowledged: the holder caches nothing it changed (or its
    /// lease has run out).
    fn acknowledged(&self, s: &Shared) -> Result<(), String> {
        match self.holder.cache(self.clock.now()) {
            Some(c) if *c != self.server_view(s)? => Err(format!(
                "the holder still caches the leased file as it was ({} bytes)",
                c.size
            )),
            _ => Ok(()),
        }
    }

    /// Frames sent to the holder reach it (a stalled one too: they wait in its inbox).
    fn receive(&mut self) {
        let now = self.clock.now();
        while let Ok(frame) = self.holder.rx.try_recv() {
            if let Some((cb, list)) = callback_of(&frame) {
                self.holder.inbox.push((cb, list, now));
            }
        }
    }

    /// The holder acts on the callbacks it received, in order: drops what each names,
    /// then answers it. An answer later than `CALLBACK_SLOW` after the callback arrived
    /// may count as slow (the holder is in default then); a prompt one must not.
    fn take_in(&mut self, cx: &mut Ctx, s: &Shared) -> Result<(), String> {
        self.receive();
        let now = self.clock.now();
        for (cb, list, arrived) in std::mem::take(&mut self.holder.inbox) {
            if list.iter().any(|i| drops(i, self.id)) {
                self.holder.cached = None;
            }
            cx.stats.callbacks += 1;
            let (slow, _) = s.callbacks_answered(HOLDER, &[cb]);
            let took = now.saturating_duration_since(arrived);
            if slow && took <= CALLBACK_SLOW {
                return Err(format!(
                    "the holder's answer to callback {cb} after {took:?} counted as slow"
                ));
            }
            if slow {
                cx.stats.defaults += 1;
                cx.trace(|| format!("the answer to callback {cb} after {took:?} was slow"));
            }
        }
        Ok(())
    }
}

/// Whether `i` makes the holder drop what it caches of `id`.
pub(crate) fn drops(i: &Invalidation, id: InodeId) -> bool {
    match i {
        Invalidation::Inode { id: of } => *of == id,
        Invalidation::Everything => true,
        _ => false,
    }
}

/// A callback frame's id and list (`None` for any other frame).
pub(crate) fn callback_of(frame: &[u8]) -> Option<(u64, Vec<Invalidation>)> {
    let h = parse_header(frame).ok()??;
    if h.kind != FrameKind::Callback {
        return None;
    }
    let list = decode_payload(frame.get(FRAME_HEADER_BYTES..h.total_len)?).ok()?;
    Some((h.request_id, list))
}

/// The holder's connection to `s` (asking for leases), with the file open for reading.
fn connect(s: &Arc<Shared>, id: InodeId) -> Result<Holder, String> {
    let (tx, rx) = unbounded_channel();
    let conn = s.next_conn_id();
    s.attach(HOLDER, conn, Some(tx));
    let op = Op::Open {
        id,
        flags: O_RDONLY,
        handle: HANDLE,
    };
    let reply = run_meta(s, HOLDER, Request::plain(&Credentials::root(), op))?.0;
    if reply.entry().is_none() {
        return Err(format!("leased file: the holder's open answered {reply:?}"));
    }
    Ok(Holder {
        rx,
        inbox: Vec::new(),
        cached: None,
        stalled: false,
    })
}

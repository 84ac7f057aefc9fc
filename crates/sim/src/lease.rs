//! Leases and callbacks (DESIGN.md, "Replies and durability": caching between mounts is
//! coherent by leases and callbacks): a holder whose session asked for leases caches a
//! file's size and bytes as the server showed them, and a writer in another session
//! changes the file. The writer's change is acknowledged only once every callback it
//! caused is done (the session's `Board`), and the holder drops what a callback names
//! before it answers. Checked: when the change is acknowledged, and after every step, the
//! holder caches nothing the server has changed. A third party may answer callbacks it
//! never got (callback ids are a counter: any client can name any); the server must
//! ignore such answers.

use std::sync::Arc;
use std::time::Instant;

use kochab_meta::files::open_flags::{O_RDONLY, O_RDWR};
use kochab_proto::frame::{FRAME_HEADER_BYTES, decode_payload, parse_header};
use kochab_proto::{
    AtimeRule, Credentials, FrameKind, InodeId, Invalidation, OPEN_RECLAIM, Op, Reply, ReplyMode,
    Request,
};
use kochab_server::core::Shared;
use kochab_server::leases::LEASE;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::exec::{run_data, run_meta};
use crate::step::Ctx;

/// The holder's session, and the writer's.
const HOLDER: u64 = 300;
const WRITER: u64 = 301;
/// The handle each has the file open with.
const HANDLE: u64 = 1;
/// Bytes of the file the writer writes in.
const SPAN: u64 = 8192;
/// The longest write.
const WRITE_MAX: u64 = 2000;

/// What the holder caches of the file.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Cached {
    size: u64,
    bytes: Vec<u8>,
}

/// The holder's end of its connection: callback frames sent to it, not yet taken in.
struct Holder {
    rx: UnboundedReceiver<Vec<u8>>,
    /// Callbacks received, not yet acted on: (id, what to drop).
    inbox: Vec<(u64, Vec<Invalidation>)>,
    /// What it caches, and when the lease it caches it under was asked for (a lease runs
    /// out after `LEASE`, and the cache with it).
    cached: Option<(Cached, Instant)>,
}

impl Holder {
    /// What it still caches.
    fn cache(&self) -> Option<&Cached> {
        let (c, asked) = self.cached.as_ref()?;
        (asked.elapsed() < LEASE).then_some(c)
    }
}

/// The holder, the writer and their file.
pub struct LeaseClients {
    id: InodeId,
    generation: u64,
    holder: Holder,
    next_value: u8,
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
        })
    }

    /// One step: the holder looks at the file (caching it), or the writer changes it.
    pub fn step(&mut self, cx: &mut Ctx, s: &Arc<Shared>) -> Result<(), String> {
        match cx.rng.range(0, 9) {
            0..=3 => self.look(cx, s),
            _ => self.change(cx, s),
        }
    }

    /// The server restarted: both reconnect and reopen the file, and the holder, whose
    /// connection was lost, drops everything it cached.
    pub fn restarted(&mut self, s: &Arc<Shared>) -> Result<(), String> {
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
    /// unanswered (the change is not acknowledged yet).
    pub fn check(&self, s: &Shared) -> Result<(), String> {
        let Some(cached) = self.holder.cache() else {
            return Ok(());
        };
        let now = self.server_view(s)?;
        if *cached == now {
            return Ok(());
        }
        let core = s.core();
        let called_back = self.holder.inbox.iter().any(|(cb, list)| {
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
        if self.holder.cache().is_some() {
            return Ok(());
        }
        let asked = Instant::now();
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
        cx.trace(|| {
            format!(
                "writer wrote {len} at {offset}; ticket {ticket}, holder's inbox {:?}",
                self.holder.inbox
            )
        });
        if cx.rng.chance(500) && !self.holder.inbox.is_empty() {
            // Another session answers the callbacks the holder got.
            let ids: Vec<u64> = self.holder.inbox.iter().map(|(id, _)| *id).collect();
            cx.trace(|| format!("another session answers callbacks {ids:?}"));
            s.callbacks_answered(WRITER, &ids);
        }
        if *board.subscribe().borrow() >= ticket {
            self.acknowledged(s)
                .map_err(|e| format!("the write was acknowledged, but {e}"))?;
        }
        self.take_in(cx, s)?;
        if *board.subscribe().borrow() < ticket {
            return Err("the holder answered every callback, the write is still held".into());
        }
        self.acknowledged(s)
    }

    /// The writer's change is acknowledged: the holder caches nothing it changed.
    fn acknowledged(&self, s: &Shared) -> Result<(), String> {
        match self.holder.cache() {
            Some(c) if *c != self.server_view(s)? => Err(format!(
                "the holder still caches the leased file as it was ({} bytes)",
                c.size
            )),
            _ => Ok(()),
        }
    }

    /// Frames sent to the holder reach it.
    fn receive(&mut self) {
        while let Ok(frame) = self.holder.rx.try_recv() {
            if let Some(cb) = callback_of(&frame) {
                self.holder.inbox.push(cb);
            }
        }
    }

    /// The holder acts on the callbacks it received, in order: drops what each names,
    /// then answers it.
    fn take_in(&mut self, cx: &mut Ctx, s: &Shared) -> Result<(), String> {
        self.receive();
        for (cb, list) in std::mem::take(&mut self.holder.inbox) {
            if list.iter().any(|i| drops(i, self.id)) {
                self.holder.cached = None;
            }
            cx.stats.callbacks += 1;
            let (slow, _) = s.callbacks_answered(HOLDER, &[cb]);
            if slow {
                return Err(format!(
                    "the holder's answer to callback {cb} counted as slow"
                ));
            }
        }
        Ok(())
    }
}

/// Whether `i` makes the holder drop what it caches of `id`.
fn drops(i: &Invalidation, id: InodeId) -> bool {
    match i {
        Invalidation::Inode { id: of } => *of == id,
        Invalidation::Everything => true,
        _ => false,
    }
}

/// A callback frame's id and list (`None` for any other frame).
fn callback_of(frame: &[u8]) -> Option<(u64, Vec<Invalidation>)> {
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
    })
}

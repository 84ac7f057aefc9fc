//! Clients of file data: each creates a few files in a directory of its own, writes them
//! (answered early and kept until durable, as the mount does, or durable-mode), reads them
//! back and fsyncs them, through the real data path (`filesvc::data_op`, chunks in the
//! in-memory store). After a crash each reopens its handles as the mount does (a reclaim)
//! and replays the writes it kept, in order; a server that does not know a handle (its
//! file's table came from another server) answers EBADF, and the client reopens it there
//! and sends the request again, as the mount does. A request is planned here
//! ([`DataClients::plan`]) and run by the world where it belongs: at the one server
//! ([`DataClients::step`]), or where the cluster's map puts its file (`cluster::data`).
//!
//! What a client knows of a file is, per byte, the values it may hold: one after an
//! acknowledged write; after a power loss also what the last fsync made durable (a write is
//! not durable before fsync, DESIGN.md "Replies and durability"), unless a replay wrote the
//! byte again. Sizes are exact: a write's size record is durable or replayed.

use std::sync::Arc;

use kochab_journal::JournalId;
use kochab_meta::files::open_flags::O_RDWR;
use kochab_proto::auth::ReplayTag;
use kochab_proto::{
    AtimeRule, Credentials, Errno, InodeId, OPEN_RECLAIM, Op, Reply, ReplyMode, Request,
    WRITE_AT_END,
};
use kochab_server::replaytags::SessionTags;
use kochab_server::shared::Shared;

use crate::exec::{run_data, run_meta};
use crate::step::Ctx;

/// Files each data client writes.
const FILES: usize = 2;
/// Bytes of a file a client writes in: three blocks of 4 KiB (what the store keeps or
/// drops whole at a power loss), so that writes cross blocks and partly survive.
const SPAN: u64 = 3 * 4096;
/// The longest write.
const WRITE_MAX: u64 = 3000;
/// The first data client's session (the namespace clients' start at 100).
const FIRST_SESSION: u64 = 200;

/// The values a byte may hold (a set of 256 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Values([u64; 4]);

impl Values {
    fn one(v: u8) -> Values {
        let mut s = Values([0; 4]);
        s.0[v as usize / 64] |= 1 << (v % 64);
        s
    }

    fn has(self, v: u8) -> bool {
        self.0[v as usize / 64] & (1 << (v % 64)) != 0
    }

    fn add(&mut self, other: Values) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a |= b;
        }
    }
}

/// One file as the client's acknowledged replies made it.
struct File {
    name: Vec<u8>,
    handle: u64,
    /// Its inode and generation, once a create was answered.
    id: Option<(InodeId, u64)>,
    size: u64,
    /// Per byte of `SPAN`: what it may read as now.
    now: Vec<Values>,
    /// Per byte: what it may read as after a power loss (as of the last fsync).
    durable: Vec<Values>,
}

impl File {
    /// Bytes up to `end` are modelled: an append planned while the file was short may land
    /// past `SPAN` when it runs after others (one held in a replay window while the same
    /// client wrote at a paused process: seed 3522); bytes never written read as zeros.
    fn cover(&mut self, end: usize) {
        if self.now.len() < end {
            self.now.resize(end, Values::one(0));
            self.durable.resize(end, Values::one(0));
        }
    }
}

/// What a request whose reply the client has not taken in does.
#[derive(Clone, Copy, Debug)]
enum What {
    Create(usize),
    /// A write at `offset`, or an append (`None`: at the end, which the reply tells).
    Write {
        file: usize,
        offset: Option<u64>,
        len: u64,
        value: u8,
    },
}

/// A write answered early whose record may not be durable in the journal `at`: kept to
/// replay.
struct Kept {
    req: Request,
    what: What,
    lsn: u64,
    at: JournalId,
    tag: ReplayTag,
}

/// Sent, its reply lost: sent again before anything else.
struct Lost {
    req: Request,
    what: What,
    /// A server crashed since it was sent: it may have run, and its bytes then been lost
    /// with the crash.
    crashed: bool,
}

struct Client {
    session: u64,
    next_seq: u64,
    dir: InodeId,
    files: Vec<File>,
    kept: Vec<Kept>,
    lost: Option<Lost>,
}

impl Client {
    fn seq_floor(&self) -> u64 {
        let kept = self.kept.iter().map(|k| k.req.seq);
        let lost = self.lost.iter().map(|l| l.req.seq).filter(|&s| s != 0);
        kept.chain(lost).min().unwrap_or(self.next_seq)
    }

    fn request(&mut self, op: Op, mode: ReplyMode, numbered: bool) -> Request {
        let seq = if numbered {
            self.next_seq += 1;
            self.next_seq - 1
        } else {
            0
        };
        Request {
            cred: Credentials::root(),
            seq,
            seq_floor: self.seq_floor(),
            map_version: 0,
            mode,
            op,
        }
    }
}

/// Where a data client's request about file `id` runs: the one server, or the server the
/// map names for the file's table.
pub(crate) type ServerOf<'a> = &'a dyn Fn(InodeId) -> Result<Arc<Shared>, String>;

/// A data client's next request, planned: the world runs it where it belongs (a create
/// where its directory is, anything else where its file is) and hands the reply to
/// [`DataClients::answered`].
pub(crate) struct Next {
    c: usize,
    session: u64,
    req: Request,
    kind: Kind,
    /// Sent before, its reply lost.
    resent: bool,
}

enum Kind {
    /// A create or a write (`crashed`: see [`Lost`]).
    Send {
        what: What,
        crashed: bool,
    },
    Read {
        f: usize,
        offset: u64,
        len: u32,
    },
    Fsync {
        f: usize,
    },
}

impl Next {
    pub(crate) fn session(&self) -> u64 {
        self.session
    }

    pub(crate) fn req(&self) -> &Request {
        &self.req
    }

    /// A create: a request of the batch path, routed by its directory.
    pub(crate) fn is_create(&self) -> bool {
        matches!(
            self.kind,
            Kind::Send {
                what: What::Create(_),
                ..
            }
        )
    }

    /// The file a data operation is about (none for a create).
    pub(crate) fn file(&self, data: &DataClients) -> Option<InodeId> {
        let f = match self.kind {
            Kind::Send {
                what: What::Create(_),
                ..
            } => return None,
            Kind::Send {
                what: What::Write { file, .. },
                ..
            } => file,
            Kind::Read { f, .. } | Kind::Fsync { f } => f,
        };
        data.clients[self.c].files[f].id.map(|(id, _)| id)
    }

    /// Whether `s` would answer it from its reply cache (a resend).
    pub(crate) fn cached_at(&self, s: &Shared) -> bool {
        self.req.seq != 0 && s.reply_cached(self.session, self.req.seq).is_some()
    }
}

/// The data clients of one run.
#[derive(Default)]
pub struct DataClients {
    clients: Vec<Client>,
}

impl DataClients {
    /// `n` clients, each in its own directory, made now (durable) under `root` of `s`.
    pub fn setup(n: usize, s: &Arc<Shared>, root: InodeId) -> Result<DataClients, String> {
        let mut dirs = Vec::with_capacity(n);
        for c in 0..n {
            let op = Op::Mkdir {
                parent: root,
                name: dir_name(c),
                mode: 0o777,
            };
            let session = FIRST_SESSION + c as u64;
            let reply = run_meta(s, session, Request::plain(&Credentials::root(), op))?.0;
            let dir = reply
                .entry()
                .map(|a| a.id)
                .ok_or_else(|| format!("data set-up mkdir answered {reply:?}"))?;
            dirs.push(dir);
        }
        Ok(DataClients::in_dirs(&dirs))
    }

    /// A client in each of `dirs` (made by the world, see [`dir_name`]), no file yet.
    pub(crate) fn in_dirs(dirs: &[InodeId]) -> DataClients {
        let clients = dirs
            .iter()
            .enumerate()
            .map(|(c, &dir)| Client {
                session: FIRST_SESSION + c as u64,
                next_seq: 1,
                dir,
                files: (0..FILES)
                    .map(|f| File {
                        name: format!("f{f}").into_bytes(),
                        handle: f as u64 + 1,
                        id: None,
                        size: 0,
                        now: vec![Values::one(0); SPAN as usize],
                        durable: vec![Values::one(0); SPAN as usize],
                    })
                    .collect(),
                kept: Vec::new(),
                lost: None,
            })
            .collect();
        DataClients { clients }
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// One operation of a client picked at random ([`DataClients::plan`]), run at `s`.
    pub fn step(&mut self, cx: &mut Ctx, s: &Arc<Shared>) -> Result<(), String> {
        let next = self.plan(cx);
        let cached = next.cached_at(s);
        let (reply, lsn) = match next.is_create() {
            true => run_meta(s, next.session, next.req.clone())?,
            false => self.run_at(cx, s, &next)?,
        };
        self.answered(cx, s, next, cached, reply, lsn)
    }

    /// Runs `next`, an operation of a handle, at `s` (see [`run_handle`]).
    pub(crate) fn run_at(
        &self,
        cx: &mut Ctx,
        s: &Arc<Shared>,
        next: &Next,
    ) -> Result<(Reply, u64), String> {
        let f = match next.kind {
            Kind::Send {
                what: What::Write { file, .. },
                ..
            } => file,
            Kind::Read { f, .. } | Kind::Fsync { f } => f,
            Kind::Send {
                what: What::Create(_),
                ..
            } => return Err("a create is not an operation of a handle".into()),
        };
        let cl = &self.clients[next.c];
        run_handle(cx, s, next.c, cl, f, next.req.clone())
    }

    /// Takes back `next`, which waits (a replay window) and is sent at a later step: a
    /// request sent before whose reply was lost is again in doubt until then (returns
    /// `None`; the client sends it again when next picked), a new one is returned to be
    /// kept by the caller.
    pub(crate) fn wait(&mut self, next: Next) -> Option<Next> {
        let cl = &mut self.clients[next.c];
        match next.kind {
            Kind::Send { what, crashed } if cl.lost.is_none() && next.resent => {
                cl.lost = Some(Lost {
                    req: next.req,
                    what,
                    crashed,
                });
                None
            }
            _ => Some(next),
        }
    }

    /// The next request of a client picked at random: its lost request again, or a
    /// create, a write, a read or an fsync.
    pub(crate) fn plan(&mut self, cx: &mut Ctx) -> Next {
        let c = cx.rng.range(0, self.clients.len() as u64 - 1) as usize;
        let cl = &mut self.clients[c];
        let session = cl.session;
        let next = |req, kind| Next {
            c,
            session,
            req,
            kind,
            resent: false,
        };
        if let Some(lost) = cl.lost.take() {
            let kind = Kind::Send {
                what: lost.what,
                crashed: lost.crashed,
            };
            return Next {
                resent: true,
                ..next(lost.req, kind)
            };
        }
        let f = cx.rng.range(0, FILES as u64 - 1) as usize;
        let file = &cl.files[f];
        let Some((_, _)) = file.id else {
            let op = Op::Create {
                parent: cl.dir,
                name: file.name.clone(),
                mode: 0o644,
                flags: O_RDWR,
                handle: file.handle,
            };
            let req = cl.request(op, ReplyMode::Durable, true);
            let kind = Kind::Send {
                what: What::Create(f),
                crashed: false,
            };
            return next(req, kind);
        };
        let handle = file.handle;
        match cx.rng.range(0, 9) {
            0..=5 => {
                let mut offset = Some(cx.rng.range(0, SPAN - 1));
                let mut len = cx.rng.range(1, WRITE_MAX).min(SPAN - offset.unwrap_or(0));
                if cx.rng.chance(250) && file.size + len <= SPAN {
                    offset = None;
                }
                if offset.is_none() {
                    len = len.min(SPAN - file.size);
                }
                let early = cx.rng.chance(850);
                let value = (cl.next_seq % 251 + 1) as u8;
                let op = Op::Write {
                    handle,
                    offset: offset.unwrap_or(WRITE_AT_END),
                    data: vec![value; len as usize],
                };
                let mode = match early {
                    true => ReplyMode::Early,
                    false => ReplyMode::Durable,
                };
                // A write answered early carries a sequence number, and so does an append
                // (a durable-mode write none: it is idempotent).
                let req = cl.request(op, mode, early || offset.is_none());
                let what = What::Write {
                    file: f,
                    offset,
                    len,
                    value,
                };
                let kind = Kind::Send {
                    what,
                    crashed: false,
                };
                next(req, kind)
            }
            6..=8 => {
                let offset = cx.rng.range(0, SPAN - 1);
                let len = cx.rng.range(1, SPAN - offset) as u32;
                let op = Op::Read {
                    handle,
                    offset,
                    len,
                    atime: AtimeRule::Never,
                };
                let req = Request::plain(&Credentials::root(), op);
                next(req, Kind::Read { f, offset, len })
            }
            _ => {
                let op = Op::Fsync {
                    handle,
                    datasync: false,
                };
                next(Request::plain(&Credentials::root(), op), Kind::Fsync { f })
            }
        }
    }

    /// Client `next.c` takes in what `s` answered to `next` (`cached`: from its reply
    /// cache, see [`Next::cached_at`]); a create's or a write's reply may be lost on the
    /// way (the request is sent again later).
    pub(crate) fn answered(
        &mut self,
        cx: &mut Ctx,
        s: &Arc<Shared>,
        next: Next,
        cached: bool,
        reply: Reply,
        lsn: u64,
    ) -> Result<(), String> {
        cx.stats.data_ops += 1;
        let (c, req) = (next.c, next.req);
        let cl = &mut self.clients[c];
        match next.kind {
            Kind::Send { what, crashed } => {
                if cx.rng.chance(40) {
                    cx.stats.dropped_replies += 1;
                    cx.trace(|| format!("data client {c}: reply to {} lost", req.op.name()));
                    cl.lost = Some(Lost { req, what, crashed });
                    return Ok(());
                }
                // A resend that the server answers from its reply cache after a crash did
                // not write again: what it wrote before may have been lost with the crash.
                let unsure = crashed && cached;
                accept(cx, s, c, cl, req, what, reply, lsn, unsure)
            }
            Kind::Read { f, offset, len } => read_back(c, cl, f, offset, len, reply),
            Kind::Fsync { f } => fsynced(cx, s, c, cl, f, reply),
        }
    }

    /// The live server's journal is durable up to `durable`, and the clients know it.
    pub fn after_flush(&mut self, durable: u64) {
        for cl in &mut self.clients {
            cl.kept.retain(|k| k.lsn > durable);
        }
    }

    /// Each journal of `durable` is durable up to its LSN, and the clients know it.
    pub(crate) fn after_flush_at(&mut self, durable: &[(JournalId, u64)]) {
        for cl in &mut self.clients {
            cl.kept
                .retain(|k| !durable.iter().any(|&(j, d)| j == k.at && k.lsn <= d));
        }
    }

    /// The server process is gone (`power_loss`: and what it did not sync): what a byte
    /// may read as widens to what the last fsync left, and every request in flight may
    /// have run and been lost.
    pub fn crashed(&mut self, power_loss: bool) {
        for cl in &mut self.clients {
            if let Some(l) = &mut cl.lost {
                l.crashed = true;
            }
            if !power_loss {
                continue;
            }
            // What survived is durable from now on, whichever it is: the bytes of a write
            // in flight too, if it ran.
            for f in &mut cl.files {
                for (now, durable) in f.now.iter_mut().zip(&mut f.durable) {
                    now.add(*durable);
                    *durable = *now;
                }
            }
            if let Some(Lost {
                what:
                    What::Write {
                        file,
                        offset,
                        len,
                        value,
                    },
                ..
            }) = cl.lost
            {
                let f = &mut cl.files[file];
                let at = offset.unwrap_or(f.size) as usize;
                f.cover(at + len as usize);
                for v in &mut f.durable[at..at + len as usize] {
                    v.add(Values::one(value));
                }
            }
        }
    }

    /// A pause (see `World::fence`): a client whose connection still reaches the old
    /// process `old`, whose journal a successor sealed, writes there to a file `old`
    /// served (`served`). A write it answers early is kept (the old journal never makes
    /// it durable) and replayed at the successor.
    pub fn write_at_old(
        &mut self,
        cx: &mut Ctx,
        old: &Arc<Shared>,
        served: &dyn Fn(InodeId) -> bool,
    ) -> Result<(), String> {
        let c = cx.rng.range(0, self.clients.len() as u64 - 1) as usize;
        let cl = &mut self.clients[c];
        let f = cx.rng.range(0, FILES as u64 - 1) as usize;
        // Only to a file with data: the first write of a file waits for the failed journal
        // (`mark_data`), which tells only on its next check, a second later.
        let Some((id, _)) = cl.files[f].id.filter(|_| cl.lost.is_none()) else {
            return Ok(());
        };
        if cl.files[f].size == 0 || !served(id) {
            return Ok(());
        }
        let offset = cx.rng.range(0, SPAN - 1);
        let len = cx.rng.range(1, WRITE_MAX).min(SPAN - offset);
        let value = (cl.next_seq % 251 + 1) as u8;
        let op = Op::Write {
            handle: cl.files[f].handle,
            offset,
            data: vec![value; len as usize],
        };
        let req = cl.request(op, ReplyMode::Early, true);
        let (reply, lsn) = run_handle(cx, old, c, cl, f, req.clone())?;
        cx.stats.data_ops += 1;
        let what = What::Write {
            file: f,
            offset: Some(offset),
            len,
            value,
        };
        cx.trace(|| format!("data client {c} writes at the old process"));
        accept(cx, old, c, cl, req, what, reply, lsn, false)
    }

    /// After a restart: every client reopens its handles at the new server (a reclaim, as
    /// the mount does on EBADF) and replays the writes it kept, in order.
    pub fn replay(&mut self, cx: &mut Ctx, s: &Arc<Shared>) -> Result<(), String> {
        self.replay_at(cx, &|_| Ok(s.clone()), &|_| true, &|_| true)
    }

    /// After a failover: every client reopens its handles on the files `lost` says lost
    /// theirs (a reclaim, as the mount does on EBADF) and replays the writes it kept in
    /// the journals `gone` says are gone, in order, each where `server_of` says its file
    /// is now.
    pub(crate) fn replay_at(
        &mut self,
        cx: &mut Ctx,
        server_of: ServerOf,
        lost: &dyn Fn(InodeId) -> bool,
        gone: &dyn Fn(JournalId) -> bool,
    ) -> Result<(), String> {
        for c in 0..self.clients.len() {
            let cl = &mut self.clients[c];
            for f in 0..cl.files.len() {
                let Some((id, _)) = cl.files[f].id.filter(|&(id, _)| lost(id)) else {
                    continue;
                };
                reclaim(cx, &server_of(id)?, c, cl, f)?;
            }
            let (theirs, rest) = std::mem::take(&mut cl.kept)
                .into_iter()
                .partition(|k| gone(k.at));
            cl.kept = rest;
            for k in theirs {
                replay_one(cx, server_of, c, cl, k)?;
            }
        }
        Ok(())
    }

    /// Every file reads as its client's acknowledged writes say, at the server
    /// `server_of` names for it.
    pub fn check(&self, server_of: ServerOf) -> Result<(), String> {
        for (c, cl) in self.clients.iter().enumerate() {
            let in_doubt = match cl.lost.as_ref().map(|l| l.what) {
                Some(What::Create(f) | What::Write { file: f, .. }) => Some(f),
                None => None,
            };
            for (f, file) in cl.files.iter().enumerate() {
                let Some((id, generation)) = file.id.filter(|_| in_doubt != Some(f)) else {
                    continue;
                };
                let s = server_of(id)?;
                let size = s.file_size(id);
                if size != Some(file.size) {
                    return Err(format!(
                        "data client {c}: file {f} is {size:?} bytes at the server, {} as \
                         acknowledged (an acknowledged write lost)",
                        file.size
                    ));
                }
                let bytes = s
                    .data()
                    .read(id, generation, file.size, 0, file.size as u32)
                    .map_err(|e| format!("data client {c}: reading file {f}: {e}"))?;
                check_bytes(&file.now, 0, &bytes)
                    .map_err(|e| format!("data client {c}: file {f} in the store: {e}"))?;
            }
        }
        Ok(())
    }

    /// The ids of the clients' files (made so far).
    pub(crate) fn file_ids(&self) -> Vec<InodeId> {
        let files = self.clients.iter().flat_map(|cl| &cl.files);
        files.filter_map(|f| f.id.map(|(id, _)| id)).collect()
    }

    /// How many of the clients' files have ids in `lo..hi` (open handles that move with
    /// that table).
    pub(crate) fn files_in(&self, lo: InodeId, hi: InodeId) -> usize {
        let ids = self.clients.iter().flat_map(|cl| &cl.files);
        ids.filter(|f| f.id.is_some_and(|(id, _)| (lo..hi).contains(&id)))
            .count()
    }
}

/// The name of data client `c`'s directory.
pub(crate) fn dir_name(c: usize) -> Vec<u8> {
    format!("data{c}").into_bytes()
}

/// `bytes`, read at `offset`, may be what `allowed` says.
fn check_bytes(allowed: &[Values], offset: u64, bytes: &[u8]) -> Result<(), String> {
    for (i, &b) in bytes.iter().enumerate() {
        let at = offset as usize + i;
        if !allowed.get(at).is_some_and(|v| v.has(b)) {
            let run = bytes[i..].iter().take_while(|&&x| x == b).count();
            return Err(format!(
                "byte {at} reads {b} ({run} bytes of it), not one acknowledged ({:?}; \
                 an acknowledged write lost or misplaced)",
                allowed
                    .get(at)
                    .map(|v| (0..=255u8).filter(|&x| v.has(x)).collect::<Vec<_>>())
            ));
        }
    }
    Ok(())
}

/// Client `c` takes in the reply to `req` from `s` (`unsure`: a resend after a crash that
/// the reply cache answered, whose bytes the crash may have lost).
#[allow(clippy::too_many_arguments)]
fn accept(
    cx: &mut Ctx,
    s: &Arc<Shared>,
    c: usize,
    cl: &mut Client,
    req: Request,
    what: What,
    reply: Reply,
    lsn: u64,
    unsure: bool,
) -> Result<(), String> {
    cx.trace(|| {
        format!(
            "data client {c}: seq {} {what:?} -> {reply:?} @{lsn}",
            req.seq
        )
    });
    match what {
        What::Create(f) => {
            let attr = reply
                .entry()
                .ok_or_else(|| format!("data client {c}: create answered {reply:?}"))?;
            cl.files[f].id = Some((attr.id, attr.generation));
            Ok(())
        }
        What::Write {
            file,
            offset,
            len,
            value,
        } => {
            let f = &mut cl.files[file];
            // An append lands at the end as acknowledged (the client sent nothing since).
            let offset = offset.unwrap_or(f.size);
            let range = offset as usize..(offset + len) as usize;
            f.cover(range.end);
            if unsure {
                for v in &mut f.now[range] {
                    v.add(Values::one(value));
                }
            } else {
                f.now[range].fill(Values::one(value));
            }
            f.size = f.size.max(offset + len);
            let Reply::Attr(a) = &reply else {
                return Err(format!("data client {c}: write answered {reply:?}"));
            };
            if a.size != f.size {
                return Err(format!(
                    "data client {c}: a write of file {file} answered size {}, {} acknowledged",
                    a.size, f.size
                ));
            }
            if req.mode == ReplyMode::Early && lsn > s.journal().durable_lsn() {
                let tag = SessionTags::new(s.replay_key(), cl.session).write_tag(&req);
                cl.kept.push(Kept {
                    req,
                    what,
                    lsn,
                    at: s.journal().id(),
                    tag,
                });
            }
            Ok(())
        }
    }
}

/// Reopens client `c`'s handle of file `f` at `s`, as the mount does where a server does
/// not know it (a reclaim: same number, no truncation).
fn reclaim(cx: &mut Ctx, s: &Arc<Shared>, c: usize, cl: &Client, f: usize) -> Result<(), String> {
    let file = &cl.files[f];
    let id = file
        .id
        .map(|(id, _)| id)
        .ok_or_else(|| format!("data client {c}: a reopen of file {f}, never made"))?;
    let op = Op::Open {
        id,
        flags: O_RDWR | OPEN_RECLAIM,
        handle: file.handle,
    };
    let reply = run_meta(s, cl.session, Request::plain(&Credentials::root(), op))?.0;
    cx.stats.reopens += 1;
    cx.trace(|| {
        format!(
            "data client {c}: reopen of file {f} at {}",
            s.journal().id()
        )
    });
    if reply.entry().is_none() {
        return Err(format!("data client {c}: reopen answered {reply:?}"));
    }
    Ok(())
}

/// Runs `req`, an operation of client `c`'s handle of file `f`, at `s` as the mount does
/// (`kochab_client`'s `with_handle`): a server that does not know the handle (its file's
/// table came from another server, which kept it) answers EBADF; the handle is then
/// reopened there and the request sent once more.
fn run_handle(
    cx: &mut Ctx,
    s: &Arc<Shared>,
    c: usize,
    cl: &Client,
    f: usize,
    req: Request,
) -> Result<(Reply, u64), String> {
    let (reply, lsn) = run_data(cx, s, cl.session, req.clone())?;
    match &reply {
        Reply::Error(e) if e.errno == Errno::EBADF => {
            reclaim(cx, s, c, cl, f)?;
            run_data(cx, s, cl.session, req)
        }
        _ => Ok((reply, lsn)),
    }
}

/// Checks the reply to client `c`'s read of `len` bytes at `offset` of file `f`.
fn read_back(
    c: usize,
    cl: &Client,
    f: usize,
    offset: u64,
    len: u32,
    reply: Reply,
) -> Result<(), String> {
    let file = &cl.files[f];
    let Reply::Bytes(bytes) = reply else {
        return Err(format!("data client {c}: read answered {reply:?}"));
    };
    let want = (len as u64).min(file.size.saturating_sub(offset));
    if bytes.len() as u64 != want {
        return Err(format!(
            "data client {c}: read of {len} at {offset} of file {f} ({} bytes) got {}",
            file.size,
            bytes.len()
        ));
    }
    check_bytes(&file.now, offset, &bytes).map_err(|e| format!("data client {c}: read: {e}"))
}

/// fsync of file `f` answered by `s`: what it holds is durable.
fn fsynced(
    cx: &mut Ctx,
    s: &Arc<Shared>,
    c: usize,
    cl: &mut Client,
    f: usize,
    reply: Reply,
) -> Result<(), String> {
    if reply != Reply::Empty {
        return Err(format!("data client {c}: fsync answered {reply:?}"));
    }
    cx.trace(|| format!("data client {c}: fsync of file {f}"));
    let file = &mut cl.files[f];
    file.durable = file.now.clone();
    // It flushed its journal too: everything kept there is durable.
    let (at, durable) = (s.journal().id(), s.journal().durable_lsn());
    cl.kept.retain(|k| k.at != at || k.lsn > durable);
    Ok(())
}

fn replay_one(
    cx: &mut Ctx,
    server_of: ServerOf,
    c: usize,
    cl: &mut Client,
    k: Kept,
) -> Result<(), String> {
    cx.stats.replays += 1;
    let What::Write { file, .. } = k.what else {
        return Err(format!("data client {c}: kept a {:?}", k.what));
    };
    let id = cl.files[file]
        .id
        .map(|(id, _)| id)
        .ok_or_else(|| format!("data client {c}: kept a write of file {file}, never made"))?;
    let s = server_of(id)?;
    let mut req = k.req.clone();
    req.mode = ReplyMode::Replay {
        want_id: 0,
        tag: k.tag,
    };
    req.seq_floor = cl.seq_floor().min(req.seq);
    if !SessionTags::new(s.replay_key(), cl.session).genuine(&req) {
        return Err(format!(
            "data client {c}: its replay of seq {} was refused",
            req.seq
        ));
    }
    // Found in the reply cache, the write is not run again (its record was durable).
    let cached = s.reply_cached(cl.session, req.seq).is_some();
    let (reply, _) = run_handle(cx, &s, c, cl, file, req)?;
    cx.trace(|| {
        format!(
            "data client {c}: replay seq {} {:?} @{} of {} at {} (cached {cached}) -> {reply:?}",
            k.req.seq,
            k.what,
            k.lsn,
            k.at,
            s.journal().id()
        )
    });
    if !matches!(reply, Reply::Attr(_)) {
        return Err(format!(
            "data client {c}: seq {} (write) was answered early, its replay {reply:?}",
            k.req.seq
        ));
    }
    if let (
        What::Write {
            file,
            offset,
            len,
            value,
        },
        false,
        Reply::Attr(a),
    ) = (k.what, cached, &reply)
    {
        // Run again: its bytes are written again, whatever the crash left; an append's at
        // the end the reply tells.
        let at = offset.unwrap_or(a.size.saturating_sub(len));
        let f = &mut cl.files[file];
        f.cover((at + len) as usize);
        f.now[at as usize..(at + len) as usize].fill(Values::one(value));
    }
    Ok(())
}

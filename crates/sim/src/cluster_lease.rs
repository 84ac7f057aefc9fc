//! A lease holder and a writer in the cluster simulation: leases and callbacks across
//! tables that move between servers and servers that die.
//!
//! The holder stats a file and caches its attributes under the lease the stat granted,
//! held from whichever server holds the file's table when it asks (one connection per
//! server incarnation, as the mount has one per server); a writer in another session
//! changes the file's mode where the map sends it, and its change counts as acknowledged
//! once its board there says the callbacks are done. As in the single-server simulation
//! (`lease`), the holder drops what a callback names before it answers, may stall, and
//! trusts its cache for a lease from when it asked, on its own clock
//! (`kochab_fuse::coherence::ttl_since`).
//!
//! A table that leaves a server revokes its leases (`Shared::drop_table_waiting`): the
//! world delivers the revocations to the holder in the drop, and the drop goes on once
//! they are answered or ran out (time passes meanwhile if the holder is stalled). A
//! killed server can call nobody back, and its successor knows nothing of its leases: the
//! holder is not told (a machine that dies sends no reset), and what keeps it coherent is
//! the recovering server's replay window, a lease long, in which no change runs.
//!
//! Checked at the writer's acknowledgement and after every step: the holder caches
//! nothing the server holding the file has changed, unless a callback of it is pending
//! (at the live incarnation that sent it; or that incarnation is gone, so the change
//! was never acknowledged) or its lease ran out on its clock.

use std::sync::Arc;
use std::time::Instant;

use kochab_cluster::sim::Rng;
use kochab_journal::JournalId;
use kochab_proto::{Credentials, InodeId, Invalidation, Op, Reply, ReplyMode, Request, SetAttrs};
use kochab_server::clock::Clock;
use kochab_server::leases::{CALLBACK_SLOW, LEASE};
use kochab_server::shared::Shared;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::exec::exec_at;
use crate::lease::{callback_of, drops};

/// The holder's session, and the writer's.
const HOLDER: u64 = 400;
const WRITER: u64 = 401;
/// Permission bits only: the writer's chmod changes these.
const PERMISSIONS: u32 = 0o7777;
/// Chance (per mille) that the holder stalls when callbacks reach it, and that a stalled
/// holder comes back when it could (as in `lease`).
const STALL_PERMILLE: u64 = 350;
const WAKE_PERMILLE: u64 = 300;

/// What the lease holders did in a run.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeaseCounts {
    /// Stats that cached the file under a lease.
    pub cached: u64,
    /// Changes of the file by the writer.
    pub changes: u64,
    /// Callbacks the holder answered (revocations included).
    pub callbacks: u64,
    /// Callbacks that reached the holder while a drop waited for its revocations.
    pub revocations: u64,
    /// Times the holder's cache ran out with its lease (on its own clock).
    pub leases_run_out: u64,
    /// Writes acknowledged only once a stalled holder answered late or its callback ran out.
    pub late_acks: u64,
    /// Times the holder went into default (a slow answer, or a missed deadline).
    pub defaults: u64,
    /// Leases whose server was killed or paused while the holder still trusted them.
    pub orphaned: u64,
}

/// A callback that reached the holder: from which incarnation, its id, what it names, when.
#[derive(Debug)]
struct Received {
    from: JournalId,
    id: u64,
    list: Vec<Invalidation>,
    arrived: Instant,
}

/// What the holder caches: the file's permission bits, when it asked for the lease it
/// caches them under, and which incarnation granted it.
#[derive(Clone, Copy, Debug)]
struct Cached {
    mode: u32,
    asked: Instant,
    from: JournalId,
}

/// The holder and the writer of one file, across the servers.
pub(crate) struct ClusterLeases {
    id: InodeId,
    /// The holder's connections (one per incarnation it asked), with callback frames.
    conns: Vec<(JournalId, UnboundedReceiver<Vec<u8>>)>,
    inbox: Vec<Received>,
    cached: Option<Cached>,
    stalled: bool,
    next_mode: u32,
    /// The ticket on the writer's board (at the incarnation that ran it) that its last
    /// write waits for while a stalled holder keeps it from being acknowledged.
    waiting: Option<(JournalId, u64)>,
    clock: Clock,
    trace: Option<u64>,
}

/// The live incarnation whose journal is `j`.
fn live(servers: &[Arc<Shared>], j: JournalId) -> Option<&Arc<Shared>> {
    servers.iter().find(|s| s.journal().id() == j)
}

impl ClusterLeases {
    /// Makes the file (durable, by the writer) in `dir` at `s`.
    pub(crate) fn setup(
        s: &Arc<Shared>,
        dir: InodeId,
        trace: Option<u64>,
    ) -> Result<ClusterLeases, String> {
        let op = Op::Mknod {
            parent: dir,
            name: b"leased".to_vec(),
            mode: 0o100644,
            rdev: 0,
            exclusive: true,
        };
        let reply = exec_at(s, WRITER, Request::plain(&Credentials::root(), op))?.reply;
        let attr = reply
            .entry()
            .ok_or_else(|| format!("leased file: mknod answered {reply:?}"))?;
        Ok(ClusterLeases {
            id: attr.id,
            conns: Vec::new(),
            inbox: Vec::new(),
            cached: None,
            stalled: false,
            next_mode: 1,
            waiting: None,
            clock: s.clock().clone(),
            trace,
        })
    }

    /// The file (its table says which server serves the holder and the writer).
    pub(crate) fn file(&self) -> InodeId {
        self.id
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if let Some(seed) = self.trace {
            eprintln!("[{seed}] {}", what());
        }
    }

    /// What the holder still trusts at `now` (its own clock).
    fn cache(&self, now: Instant) -> Option<Cached> {
        self.cached
            .filter(|c| now.saturating_duration_since(c.asked) < LEASE)
    }

    /// The writer's change next (else the holder's look); a stalled holder may come back
    /// first, and takes in its callbacks, late.
    pub(crate) fn next_is_change(
        &mut self,
        rng: &mut Rng,
        servers: &[Arc<Shared>],
        counts: &mut LeaseCounts,
    ) -> Result<bool, String> {
        if self.stalled && rng.chance(WAKE_PERMILLE) {
            self.trace(|| "the holder comes back".into());
            self.stalled = false;
            self.take_in(servers, counts)?;
        }
        Ok(rng.range(0, 9) >= 4)
    }

    /// The holder stats the file at `s`, which holds its table (a lease granted by it),
    /// and caches the attributes, having taken in the callbacks that came before the reply.
    pub(crate) fn look(
        &mut self,
        s: &Arc<Shared>,
        servers: &[Arc<Shared>],
        counts: &mut LeaseCounts,
    ) -> Result<(), String> {
        let asked = self.clock.now();
        if self.stalled || self.cache(asked).is_some() {
            return Ok(());
        }
        if self.cached.take().is_some() {
            counts.leases_run_out += 1;
            self.trace(|| "the holder's lease ran out: it asks again".into());
        }
        let at = s.journal().id();
        if !self.conns.iter().any(|(j, _)| *j == at) {
            let (tx, rx) = unbounded_channel();
            s.attach(HOLDER, s.next_conn_id(), Some(tx));
            self.conns.push((at, rx));
        }
        let stat = Request::plain(&Credentials::root(), Op::GetAttr { id: self.id });
        let reply = exec_at(s, HOLDER, stat)?.reply;
        let Reply::Attr(attr) = reply else {
            return Err(format!("the holder's stat at {at} answered {reply:?}"));
        };
        self.take_in(servers, counts)?;
        if s.core().callbacks.is_in_default(HOLDER) {
            // Granted nothing: it caches nothing.
            return Ok(());
        }
        self.trace(|| format!("holder caches mode {:o} from {at}", attr.mode));
        counts.cached += 1;
        self.cached = Some(Cached {
            mode: attr.mode & PERMISSIONS,
            asked,
            from: at,
        });
        Ok(())
    }

    /// The writer changes the file's mode at `s`, which holds its table. Its change is
    /// acknowledged once the callbacks it caused are done; a third session may answer
    /// them first (the server must not count that).
    pub(crate) fn change(
        &mut self,
        rng: &mut Rng,
        s: &Arc<Shared>,
        servers: &[Arc<Shared>],
        counts: &mut LeaseCounts,
    ) -> Result<(), String> {
        let mode = self.next_mode;
        self.next_mode = self.next_mode % 0o777 + 1;
        let set = SetAttrs {
            mode: Some(mode),
            ..SetAttrs::default()
        };
        let mut req = Request::plain(&Credentials::root(), Op::SetAttr { id: self.id, set });
        req.mode = ReplyMode::Durable;
        let reply = exec_at(s, WRITER, req)?.reply;
        if !matches!(reply, Reply::Attr(_)) {
            return Err(format!("the writer's chmod answered {reply:?}"));
        }
        counts.changes += 1;
        let at = s.journal().id();
        let board = s.callback_board(WRITER);
        let ticket = board.ticket();
        self.receive(servers);
        if !self.inbox.is_empty() && rng.chance(STALL_PERMILLE) {
            self.stalled = true;
        }
        self.trace(|| {
            format!(
                "writer chmod {mode:o} at {at}; ticket {ticket}, holder's inbox {:?}",
                self.inbox
            )
        });
        if rng.chance(500) && !self.inbox.is_empty() {
            // Another session answers the callbacks the holder got from there.
            let ids: Vec<u64> = self
                .inbox
                .iter()
                .filter(|r| r.from == at)
                .map(|r| r.id)
                .collect();
            self.trace(|| format!("another session answers callbacks {ids:?}"));
            s.callbacks_answered(WRITER, &ids);
        }
        if *board.subscribe().borrow() >= ticket {
            self.acknowledged(s)
                .map_err(|e| format!("the chmod was acknowledged, but {e}"))?;
        }
        if self.stalled {
            self.trace(|| format!("the holder is stalled: the chmod waits for ticket {ticket}"));
            self.waiting = Some((at, ticket));
            return Ok(());
        }
        self.take_in(servers, counts)?;
        if *board.subscribe().borrow() < ticket {
            return Err("the holder answered every callback, the chmod is still held".into());
        }
        self.acknowledged(s)
    }

    /// Time is about to pass: callbacks sent meanwhile reach the holder, and one that is
    /// not stalled answers them at once, as a mount does within milliseconds.
    pub(crate) fn before_time_passes(
        &mut self,
        servers: &[Arc<Shared>],
        counts: &mut LeaseCounts,
    ) -> Result<(), String> {
        match self.stalled {
            true => {
                self.receive(servers);
                Ok(())
            }
            false => self.take_in(servers, counts),
        }
    }

    /// A table's drop sent its revocations: they reach the holder, which answers unless
    /// stalled (a stalled one may come back now).
    pub(crate) fn revoked(
        &mut self,
        rng: &mut Rng,
        servers: &[Arc<Shared>],
        counts: &mut LeaseCounts,
    ) -> Result<(), String> {
        let before = self.inbox.len();
        self.receive(servers);
        counts.revocations += (self.inbox.len() - before) as u64;
        if self.stalled && rng.chance(WAKE_PERMILLE) {
            self.trace(|| "the holder comes back during a drop".into());
            self.stalled = false;
        }
        match self.stalled {
            true => Ok(()),
            false => self.take_in(servers, counts),
        }
    }

    /// Server incarnation `dead` was killed or paused for good: the connection to it is
    /// gone without the holder being told, and so is the writer's reply it held.
    pub(crate) fn server_gone(&mut self, dead: JournalId, counts: &mut LeaseCounts) {
        if self.waiting.is_some_and(|(at, _)| at == dead) {
            self.waiting = None;
        }
        if self.cache(self.clock.now()).is_some_and(|c| c.from == dead) {
            counts.orphaned += 1;
            self.trace(|| format!("the holder's lease from {dead} outlives its server"));
        }
    }

    /// After a step: frames sent reach the holder, and the writer's change that waited
    /// for a stalled holder is acknowledged once its callbacks are done (checked against
    /// `owner`, which holds the file's table now).
    pub(crate) fn settle(
        &mut self,
        servers: &[Arc<Shared>],
        owner: &Shared,
        counts: &mut LeaseCounts,
    ) -> Result<(), String> {
        self.receive(servers);
        let Some((at, ticket)) = self.waiting else {
            return Ok(());
        };
        let Some(s) = live(servers, at) else {
            self.waiting = None;
            return Ok(());
        };
        if *s.callback_board(WRITER).subscribe().borrow() < ticket {
            return Ok(());
        }
        self.waiting = None;
        counts.late_acks += 1;
        self.acknowledged(owner)
            .map_err(|e| format!("the chmod was acknowledged late, but {e}"))
    }

    /// The invariant (see the module), with `owner` the server the map gives the file's
    /// table.
    pub(crate) fn check(&self, servers: &[Arc<Shared>], owner: &Shared) -> Result<(), String> {
        let Some(cached) = self.cache(self.clock.now()) else {
            return Ok(());
        };
        let now = self.server_mode(owner)?;
        if cached.mode == now {
            return Ok(());
        }
        let called_back = self.inbox.iter().any(|r| {
            r.list.iter().any(|i| drops(i, self.id))
                && live(servers, r.from).is_none_or(|s| s.core().callbacks.is_pending(r.id))
        });
        if called_back {
            return Ok(());
        }
        Err(format!(
            "the holder caches mode {:o} of the leased file (a lease from {}, asked {:?} ago), \
             server {} has {now:o}, and no callback of it is pending",
            cached.mode,
            cached.from,
            self.clock.now().saturating_duration_since(cached.asked),
            owner.journal().id()
        ))
    }

    /// The writer's change is acknowledged: the holder caches nothing it changed (or its
    /// lease has run out), `s` holding the file's table now.
    fn acknowledged(&self, s: &Shared) -> Result<(), String> {
        match self.cache(self.clock.now()) {
            Some(c) if c.mode != self.server_mode(s)? => Err(format!(
                "the holder still caches mode {:o} (a lease from {})",
                c.mode, c.from
            )),
            _ => Ok(()),
        }
    }

    /// The file's permission bits at `s`.
    fn server_mode(&self, s: &Shared) -> Result<u32, String> {
        s.core()
            .engine
            .inode(self.id)
            .map(|i| i.mode & PERMISSIONS)
            .ok_or_else(|| format!("the leased file is not at {}", s.journal().id()))
    }

    /// Frames sent to the holder reach it (a stalled one too: they wait in its inbox);
    /// connections to incarnations that are gone are forgotten.
    fn receive(&mut self, servers: &[Arc<Shared>]) {
        let now = self.clock.now();
        for (from, rx) in &mut self.conns {
            while let Ok(frame) = rx.try_recv() {
                if let Some((id, list)) = callback_of(&frame) {
                    self.inbox.push(Received {
                        from: *from,
                        id,
                        list,
                        arrived: now,
                    });
                }
            }
        }
        self.conns.retain(|(j, _)| live(servers, *j).is_some());
    }

    /// The holder acts on the callbacks it received, in order: drops what each names,
    /// then answers it where it came from (one from an incarnation that is gone is
    /// answered nowhere). An answer later than `CALLBACK_SLOW` after the callback arrived
    /// may count as slow; a prompt one must not.
    fn take_in(&mut self, servers: &[Arc<Shared>], counts: &mut LeaseCounts) -> Result<(), String> {
        self.receive(servers);
        let now = self.clock.now();
        for r in std::mem::take(&mut self.inbox) {
            if r.list.iter().any(|i| drops(i, self.id)) {
                self.cached = None;
            }
            let Some(s) = live(servers, r.from) else {
                continue;
            };
            counts.callbacks += 1;
            let (slow, _) = s.callbacks_answered(HOLDER, &[r.id]);
            let took = now.saturating_duration_since(r.arrived);
            if slow && took <= CALLBACK_SLOW {
                return Err(format!(
                    "the holder's answer to callback {} of {} after {took:?} counted as slow",
                    r.id, r.from
                ));
            }
            if slow {
                counts.defaults += 1;
                self.trace(|| format!("the answer to callback {} after {took:?} was slow", r.id));
            }
        }
        Ok(())
    }
}

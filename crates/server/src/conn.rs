//! One client connection: the handshake, then a reader task that decodes and runs batches
//! of requests and a writer task that sends their replies once the journal has made them
//! durable. A malformed frame closes this connection only; everyone else is unaffected.
//!
//! Trust: the handshake proves a key both ways (see `kochab_proto::auth`); every request's
//! credentials then go through that key's policy (root squash, id ranges) before anything
//! else sees them, and the key's revocation closes the connection at once.

use crate::keys::{KeyConnection, KeyEntry};
use crate::leases::Board;
use crate::replaytags::SessionTags;
use crate::shared::Shared;
use crate::step::Event;
use kochab_proto::auth::{
    ADMIN_KEY_ID, ReplayTag, Transcript, prove_server, session_id, verify_client,
};
use kochab_proto::codec::{CodecError, Frame, FrameCodec};
use kochab_proto::frame::{MAX_FRAME_BYTES, decode_payload, encode_frame};
use kochab_proto::*;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio_util::codec::{Decoder, FramedRead};

/// A connection's read side: plain TCP or TLS.
pub type Rd = Box<dyn tokio::io::AsyncRead + Unpin + Send>;
/// A connection's write side.
pub type Wr = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;
/// A connection's incoming frames.
type Frames = FramedRead<Rd, FrameCodec>;

/// Time a new connection has to authenticate: a real client needs one round trip; an
/// unauthenticated peer holds a connection slot no longer than this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Reply batches queued for the writer before the reader stops reading (backpressure).
const WRITER_QUEUE: usize = 64;
/// Bytes the writer gathers into one write.
const WRITE_BATCH_BYTES: usize = 1 << 20;
/// Longest a durability report waits for replies to ride with (fsync waits for it).
const DURABLE_REPORT_DELAY: Duration = Duration::from_millis(2);
/// How long a revoked key's connection waits for its goodbye to be written before it is
/// cut: a client that reads has it in a round trip.
const REVOKED_GOODBYE_WAIT: Duration = Duration::from_millis(500);
/// Data operations (reads, writes) one connection may have running at once.
const DATA_OPS_IN_FLIGHT: usize = 64;
/// Requests run under one hold of the core lock. A readdirplus of a large directory costs
/// about a millisecond, so a batch holds the lock for tens of milliseconds at worst and
/// other connections are served between batches (the 850 pipelined readdirplus
/// requests held it for a second in one batch).
pub const BATCH_REQUESTS_MAX: usize = 64;
/// Reply bytes one connection may have made but not yet sent. Past it the reader stops
/// reading and running requests until the writer has sent enough: a client that pipelines
/// requests but does not read replies costs the server this much, plus one batch, instead
/// of memory without end (34 KB of readdirplus requests once grew a server by 270 MiB).
pub const REPLY_BACKLOG_BYTES_MAX: usize = 16 << 20;

fn log_bad_frame(shared: &Shared, peer: Peer, what: &str) {
    match shared.may_log_bad_frame() {
        Some(0) => tracing::warn!("closing connection from {peer}: {what}"),
        Some(n) => tracing::warn!(
            "closing connection from {peer}: {what} ({n} more such warnings suppressed)"
        ),
        None => {}
    }
}

/// Reply bytes made but not yet sent, shared by the reader (adds) and the writer (takes).
#[derive(Default)]
struct Backlog {
    bytes: AtomicUsize,
    drained: Notify,
    /// Set when the writer ends: nothing will drain any more, the reader must not wait.
    closed: std::sync::atomic::AtomicBool,
    /// The callbacks this session's changes caused: a reply leaves once those issued
    /// before it was made are done (see `leases`).
    board: Arc<Board>,
}

impl Backlog {
    fn add(&self, n: usize) {
        self.bytes.fetch_add(n, Ordering::AcqRel);
    }

    fn sent(&self, n: usize) {
        self.bytes.fetch_sub(n, Ordering::AcqRel);
        self.drained.notify_waiters();
    }

    /// Waits until the backlog is under its bound.
    async fn below_max(&self) {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.bytes.load(Ordering::Acquire) <= REPLY_BACKLOG_BYTES_MAX
                || self.closed.load(Ordering::Acquire)
            {
                return;
            }
            drained.await;
        }
    }
}

/// Closes the backlog when the writer ends, however it ends.
struct WriterGone(Arc<Backlog>);

impl Drop for WriterGone {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
        self.0.drained.notify_waiters();
    }
}

/// Replies of one batch (or of one data operation), sent once the journal holds `lsn`.
struct Replies {
    lsn: u64,
    /// Highest LSN of the `Unsafe` replies in the group (0: none): the writer sends a
    /// `Durable` frame once the journal holds it.
    unsafe_lsn: u64,
    bytes: Vec<u8>,
    started: Instant,
    /// (operation index, succeeded) per reply, for the metrics.
    ops: Vec<(u8, bool)>,
    /// The callbacks (of this session's changes) that must be done before these replies
    /// leave: every ticket up to this one.
    ticket: u64,
}

impl Replies {
    fn new(started: Instant, n: usize) -> Replies {
        Replies {
            lsn: 0,
            unsafe_lsn: 0,
            bytes: Vec::with_capacity(n * 128),
            started,
            ops: Vec::with_capacity(n),
            ticket: 0,
        }
    }

    /// Adds one reply that may leave once `lsn` is durable.
    fn add(&mut self, rid: u64, op: u8, reply: &Reply, lsn: u64) {
        self.lsn = self.lsn.max(lsn);
        self.ops.push((op, !matches!(reply, Reply::Error(_))));
        if let Err(e) = encode_frame(&mut self.bytes, FrameKind::Reply, rid, reply) {
            let fallback = Reply::Error(fs_err!(EIO, "reply does not fit in a frame: {e}"));
            let _ = encode_frame(&mut self.bytes, FrameKind::Reply, rid, &fallback);
        }
    }

    /// Adds one reply to `req` that leaves now although its record (`lsn`) is not durable
    /// yet, with the replay tag the client keeps for a replay of `req`. Every `Unsafe`
    /// frame is made here, so every early reply carries a tag.
    fn add_unsafe(&mut self, rid: u64, req: &Request, reply: &Reply, lsn: u64, tags: &SessionTags) {
        let tag = tags.tag(req, reply);
        self.add_tagged(rid, req.op.index() as u8, reply, lsn, tag);
    }

    /// [`Replies::add_unsafe`] with the tag made before the request was consumed (a
    /// write's data is not kept for it).
    fn add_tagged(&mut self, rid: u64, op: u8, reply: &Reply, lsn: u64, tag: ReplayTag) {
        self.unsafe_lsn = self.unsafe_lsn.max(lsn);
        self.ops.push((op, !matches!(reply, Reply::Error(_))));
        let frame = (lsn, tag, reply);
        if let Err(e) = encode_frame(&mut self.bytes, FrameKind::Unsafe, rid, &frame) {
            let fallback = Reply::Error(fs_err!(EIO, "reply does not fit in a frame: {e}"));
            let _ = encode_frame(&mut self.bytes, FrameKind::Reply, rid, &fallback);
        }
    }
}

/// Answers the replays in `reqs` whose tags do not verify with EPERM, in `refused`; they
/// run nowhere (not as ordinary requests either: a client that sets the mode without the
/// tag is broken or forging, and a quiet fallback would hide either).
fn refuse_forged_replays(
    shared: &Shared,
    peer: Peer,
    tags: &SessionTags,
    reqs: &mut Vec<(u64, Request)>,
    refused: &mut Replies,
) {
    reqs.retain(|(rid, req)| {
        if tags.genuine(req) {
            return true;
        }
        let what = format!(
            "refused a {} in replay mode from {peer}: its replay tag does not verify",
            req.op.name()
        );
        match shared.may_log_bad_frame() {
            Some(0) => tracing::warn!("{what}"),
            Some(n) => tracing::warn!("{what} ({n} more such warnings suppressed)"),
            None => {}
        }
        let e = fs_err!(
            EPERM,
            "not a replay: its replay tag does not verify for this session (only a \
             request this session was answered early may be replayed)"
        );
        refused.add(*rid, req.op.index() as u8, &Reply::Error(e), 0);
        false
    });
}

enum Outgoing {
    Replies(Replies),
    Goodbye(Vec<u8>),
}

/// Sends a group of replies to the writer, counting it in the backlog; false if the writer
/// is gone.
async fn send_replies(tx: &mpsc::Sender<Outgoing>, backlog: &Backlog, mut group: Replies) -> bool {
    // Made after the operations ran: covers every callback their changes caused.
    group.ticket = backlog.board.ticket();
    let n = group.bytes.len();
    backlog.add(n);
    if tx.send(Outgoing::Replies(group)).await.is_err() {
        backlog.sent(n);
        return false;
    }
    true
}

/// Counts a connection from accept to close (authenticated or not) against the limit, in
/// [`Shared::count_connection`]; uncounted when dropped: when its task ends, or with the task if
/// that never ran (a client's runtime that went away first).
pub struct Counted(Arc<Shared>);

impl Counted {
    /// Counts one more connection, unless `max` are open.
    pub fn take(shared: &Arc<Shared>, max: u64) -> Option<Counted> {
        shared
            .count_connection(max)
            .then(|| Counted(shared.clone()))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.uncount_connection();
    }
}

/// The authenticated identity of a connection.
struct Identity {
    session: u64,
    key: Arc<KeyEntry>,
    /// The client asked for leases (see `leases`).
    leases: bool,
}

/// Who is at the other end of a connection (for the log).
#[derive(Debug, Clone, Copy)]
pub enum Peer {
    Tcp(SocketAddr),
    /// A client of this process (see `kochab_local`).
    Local,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Tcp(a) => a.fmt(f),
            Peer::Local => f.write_str("a client in this process"),
        }
    }
}

/// An accepted connection.
pub enum Accepted {
    Tcp(TcpStream, SocketAddr),
    Local(kochab_local::Stream),
}

impl Accepted {
    pub fn peer(&self) -> Peer {
        match self {
            Accepted::Tcp(_, peer) => Peer::Tcp(*peer),
            Accepted::Local(_) => Peer::Local,
        }
    }
}

/// Serves one accepted connection until it closes or the server shuts down; `counted`
/// uncounts it then.
pub async fn serve(
    counted: Counted,
    accepted: Accepted,
    shutdown: watch::Receiver<bool>,
    tls: Option<crate::tls::TlsAcceptor>,
) {
    let shared = counted.0.clone();
    // TLS and the key handshake share one deadline.
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    let peer = accepted.peer();
    let sock = match accepted {
        Accepted::Tcp(sock, _) => sock,
        Accepted::Local(stream) => {
            // Nothing crosses a wire: no TLS (the key handshake still runs).
            let (r, w) = tokio::io::split(stream);
            serve_stream(
                shared.clone(),
                Box::new(r),
                Box::new(w),
                Peer::Local,
                shutdown,
                deadline,
            )
            .await;
            return;
        }
    };
    let _ = sock.set_nodelay(true);
    kochab_proto::net::size_socket_buffers(&sock);
    let (rd, wr): (Rd, Wr) = match tls {
        None => {
            let (r, w) = sock.into_split();
            (Box::new(r), Box::new(w))
        }
        Some(acceptor) => match tokio::time::timeout_at(deadline, acceptor.accept(sock)).await {
            Ok(Ok(s)) => {
                let (r, w) = tokio::io::split(s);
                (Box::new(r), Box::new(w))
            }
            Ok(Err(e)) => {
                if shared.may_log_bad_frame().is_some() {
                    tracing::info!("TLS handshake with {peer} failed: {e}");
                }
                return;
            }
            Err(_) => return,
        },
    };
    serve_stream(shared.clone(), rd, wr, peer, shutdown, deadline).await;
}

/// [`serve`], from the handshake on.
async fn serve_stream(
    shared: Arc<Shared>,
    rd: Rd,
    mut wr: Wr,
    peer: Peer,
    shutdown: watch::Receiver<bool>,
    deadline: tokio::time::Instant,
) {
    // Never more than the small pre-authentication frame is read before the key is proven.
    let mut frames =
        FramedRead::with_capacity(rd, FrameCodec::preauth(), FrameCodec::PREAUTH_BUFFER);
    // `_held` counts the connection under its key until it is closed (after the writer).
    let (who, _held) =
        match tokio::time::timeout_at(deadline, handshake(&shared, &mut frames, &mut wr)).await {
            Ok(Ok(who)) => who,
            Ok(Err(reason)) => {
                if shared.may_log_bad_frame().is_some() {
                    tracing::info!("connection from {peer} refused: {reason}");
                }
                return;
            }
            Err(_) => {
                if shared.may_log_bad_frame().is_some() {
                    tracing::info!("connection from {peer} did not authenticate in time");
                }
                return;
            }
        };
    // Authenticated: frames up to the size the welcome announced.
    *frames.decoder_mut() = FrameCodec::authenticated(MAX_FRAME_BYTES);
    let session = who.session;
    let conn_id = shared.next_conn_id();
    let (cb_tx, cb_rx) = mpsc::unbounded_channel();
    let board = shared.attach(session, conn_id, who.leases.then_some(cb_tx));
    let _attached = Attached {
        shared: &shared,
        session,
        conn_id,
    };
    let backlog = Arc::new(Backlog {
        bytes: AtomicUsize::new(0),
        drained: Notify::new(),
        closed: Default::default(),
        board,
    });
    let (tx, rx) = mpsc::channel(WRITER_QUEUE);
    let callbacks = who.leases.then_some(cb_rx);
    let mut writer = tokio::spawn(write_loop(
        shared.clone(),
        wr,
        rx,
        callbacks,
        peer,
        backlog.clone(),
    ));
    let key = who.key.clone();
    if key.id == ADMIN_KEY_ID {
        // The cluster key is never revoked: nothing to watch beside the reader.
        read_loop(&shared, who, frames, tx, peer, shutdown, backlog).await;
        let _ = writer.await;
        return;
    }
    let bye = tx.clone();
    tokio::select! {
        () = read_loop(&shared, who, frames, tx, peer, shutdown, backlog) => {}
        // Wherever the reader waits (a client that reads no replies can hold it in the
        // backlog), a revoked key's connection ends now.
        () = revoked(shared.keys().subscribe(), &key) => {
            let bye_frame = goodbye(Errno::EACCES, &format!("key {} was revoked", key.id));
            let _ = bye.try_send(Outgoing::Goodbye(bye_frame));
        }
    }
    drop(bye);
    if key.is_revoked() {
        // Its goodbye gets a moment to leave, no more: the writer of a client that does
        // not read could wait for ever, and the revocation waits for this close.
        if tokio::time::timeout(REVOKED_GOODBYE_WAIT, &mut writer)
            .await
            .is_err()
        {
            writer.abort();
            let _ = writer.await;
        }
    } else {
        let _ = writer.await;
    }
}

/// Resolves once `key` is revoked (`changes` is told of every revocation).
async fn revoked(mut changes: watch::Receiver<u64>, key: &KeyEntry) {
    loop {
        if key.is_revoked() {
            return;
        }
        if changes.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A connection's part in its session, ended when the connection ends, or when its task is
/// dropped before that (served on a client's runtime that went away, see `kochab_local`).
struct Attached<'a> {
    shared: &'a Shared,
    session: u64,
    conn_id: u64,
}

impl Drop for Attached<'_> {
    fn drop(&mut self) {
        self.shared.detach(self.session, self.conn_id);
    }
}

fn goodbye(errno: Errno, message: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = encode_frame(
        &mut out,
        FrameKind::Goodbye,
        0,
        &FsError::new(errno, message),
    );
    out
}

/// Challenge, mutual proof, welcome. Returns the session and key of the client, and its
/// connection counted under that key.
async fn handshake(
    shared: &Shared,
    frames: &mut Frames,
    wr: &mut Wr,
) -> Result<(Identity, KeyConnection), String> {
    let mut nonce = [0u8; 32];
    getrandom::fill(&mut nonce).map_err(|e| format!("no randomness: {e}"))?;
    let mut out = Vec::new();
    encode_frame(
        &mut out,
        FrameKind::Challenge,
        0,
        &Challenge {
            version: PROTOCOL_VERSION,
            nonce,
        },
    )
    .map_err(|e| e.to_string())?;
    wr.write_all(&out).await.map_err(|e| e.to_string())?;
    let frame = match kochab_proto::codec::next(frames).await {
        Some(Ok(f)) => f,
        Some(Err(CodecError::Frame(e))) => {
            let _ = wr.write_all(&goodbye(Errno::EPROTO, &e.to_string())).await;
            return Err(format!("{e} (before authenticating)"));
        }
        Some(Err(CodecError::Io(e))) => return Err(e.to_string()),
        None => return Err("closed during handshake".into()),
    };
    let refuse = |why: &str| goodbye(Errno::EACCES, why);
    if frame.kind != FrameKind::Auth {
        let _ = wr.write_all(&refuse("authenticate first")).await;
        return Err(format!("sent {:?} before authenticating", frame.kind));
    }
    let auth: Auth = match decode_payload(&frame.payload) {
        Ok(a) => a,
        Err(e) => {
            let _ = wr.write_all(&goodbye(Errno::EPROTO, &e.to_string())).await;
            return Err(e.to_string());
        }
    };
    if auth.version != PROTOCOL_VERSION {
        let _ = wr
            .write_all(&goodbye(
                Errno::EPROTO,
                &format!(
                    "protocol version {} is not {PROTOCOL_VERSION}",
                    auth.version
                ),
            ))
            .await;
        return Err(format!("protocol version {}", auth.version));
    }
    let t = Transcript {
        server_nonce: nonce,
        client_nonce: auth.client_nonce,
        key_id: auth.key_id,
        client_id: auth.client_id,
    };
    // One answer for an unknown key and a wrong one: the id alone proves nothing.
    let key = match shared.keys().get(auth.key_id) {
        Some(k) if verify_client(&k.key, &t, &auth.mac) => k,
        _ => {
            let _ = wr.write_all(&refuse("wrong key")).await;
            return Err(format!("wrong key (key id {})", auth.key_id));
        }
    };
    // Counted before the check: a revocation that waits for its key's connections to
    // close (a cluster's, see `cluster_host`) either counts this one or is seen here.
    let held = key.connection();
    if key.is_revoked() {
        let _ = wr
            .write_all(&refuse(&format!("key {} is revoked", key.id)))
            .await;
        return Err(format!("revoked key {}", key.id));
    }
    let session = session_id(&shared.keys().admin().key, key.id, auth.client_id);
    let root = shared.root();
    let welcome = Welcome {
        server_id: shared.server_id(),
        root,
        max_frame_bytes: MAX_FRAME_BYTES as u32,
        session,
        mac: prove_server(&key.key, &t),
        incarnation: shared.incarnation(),
        durable_lsn: shared.journal().durable_lsn(),
        lease_ms: if auth.leases {
            crate::leases::LEASE.as_millis() as u64
        } else {
            0
        },
    };
    out.clear();
    encode_frame(&mut out, FrameKind::Welcome, 0, &welcome).map_err(|e| e.to_string())?;
    wr.write_all(&out).await.map_err(|e| e.to_string())?;
    Ok((
        Identity {
            session,
            key,
            leases: auth.leases,
        },
        held,
    ))
}

/// Sorts a batch by what the key may do: key administration goes to `admin` (refused
/// unless this is the admin key), requests whose credentials the key's policy refuses are
/// answered at once in `early`, and the others stay in `reqs` with their credentials
/// rewritten by the policy.
fn screen(
    key: &KeyEntry,
    reqs: &mut Vec<(u64, Request)>,
    admin: &mut Vec<(u64, Request)>,
    early: &mut Replies,
) {
    for (rid, mut req) in std::mem::take(reqs) {
        let op = req.op.index() as u8;
        if matches!(req.op, Op::Control { .. }) && key.id != ADMIN_KEY_ID {
            let e = fs_err!(EPERM, "only the cluster (admin) key sends control messages");
            early.add(rid, op, &Reply::Error(e), 0);
            continue;
        }
        if req.op.is_key_admin() {
            if key.id == ADMIN_KEY_ID {
                admin.push((rid, req));
            } else {
                let e = fs_err!(EPERM, "only the cluster (admin) key administers keys");
                early.add(rid, op, &Reply::Error(e), 0);
            }
            continue;
        }
        match key.policy.apply(&mut req.cred) {
            Ok(()) => reqs.push((rid, req)),
            Err(e) => early.add(rid, op, &Reply::Error(e), 0),
        }
    }
}

/// Runs one key administration request of a single server (blocking: the key file is
/// written and fsynced).
fn key_admin(keys: &crate::keys::KeyStore, op: &Op) -> Reply {
    let result = match op {
        Op::KeyAdd { policy, note } => keys
            .add(*policy, note)
            .map(|(id, key)| Reply::KeyAdded { id, key }),
        Op::KeyList => Ok(Reply::Keys(keys.list())),
        Op::KeyRevoke { id } => keys.revoke(*id).map(|()| Reply::Empty),
        _ => Err(fs_err!(EINVAL, "{} is no key operation", op.name())),
    };
    result.unwrap_or_else(Reply::Error)
}

/// A frame a client may send once authenticated.
enum Incoming {
    Request(u64, Request),
    /// The client did what the callback with this id asked.
    CallbackDone(u64),
}

/// What a frame carries. Any other frame ends the connection.
fn to_request(f: Frame) -> Result<Incoming, String> {
    match f.kind {
        FrameKind::Request => {
            let req: Request = decode_payload(&f.payload).map_err(|e| e.to_string())?;
            Ok(Incoming::Request(f.request_id, req))
        }
        FrameKind::CallbackDone => Ok(Incoming::CallbackDone(f.request_id)),
        k => Err(format!("unexpected {k:?} frame")),
    }
}

/// Takes one incoming frame: a request joins the batch, a callback's answer `dones`.
fn take_one(f: Frame, reqs: &mut Vec<(u64, Request)>, dones: &mut Vec<u64>) -> Result<(), String> {
    match to_request(f)? {
        Incoming::Request(rid, req) => reqs.push((rid, req)),
        Incoming::CallbackDone(id) => dones.push(id),
    }
    Ok(())
}

/// What a request counts for against [`BATCH_REQUESTS_MAX`]: a `CloseMany` is that many
/// closes.
fn batch_items(req: &Request) -> usize {
    match &req.op {
        Op::CloseMany { handles } => handles.len().max(1),
        _ => 1,
    }
}

/// Decodes every complete frame already read (no new read). An invalid one ends the
/// connection. Stops once `reqs` holds [`BATCH_REQUESTS_MAX`] requests' worth (see
/// [`batch_items`]); returns true if it did (more may follow in the buffer without another
/// read).
fn take_requests(
    frames: &mut Frames,
    reqs: &mut Vec<(u64, Request)>,
    dones: &mut Vec<u64>,
) -> Result<bool, String> {
    // The codec is a pair of limits: a copy decodes the `FramedRead`'s buffer in place.
    let mut codec = *frames.decoder();
    let buf = frames.read_buffer_mut();
    let mut items: usize = reqs.iter().map(|(_, r)| batch_items(r)).sum();
    loop {
        if items >= BATCH_REQUESTS_MAX {
            return Ok(true);
        }
        match codec.decode(buf) {
            Ok(None) => return Ok(false),
            Err(e) => return Err(e.to_string()),
            Ok(Some(f)) => {
                let before = reqs.len();
                take_one(f, reqs, dones)?;
                items += reqs[before..]
                    .iter()
                    .map(|(_, r)| batch_items(r))
                    .sum::<usize>();
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn read_loop(
    shared: &Arc<Shared>,
    who: Identity,
    mut frames: Frames,
    tx: mpsc::Sender<Outgoing>,
    peer: Peer,
    mut shutdown: watch::Receiver<bool>,
    backlog: Arc<Backlog>,
) {
    let Identity { session, key, .. } = who;
    let client = session;
    // Commit tokens are bound to the client key (see `slicesvc`).
    let key_id = key.id;
    let tags = SessionTags::new(shared.replay_key(), session);
    // The admin key with no rule skips the screening (the single-server fast path).
    let screened = key.id != ADMIN_KEY_ID || key.policy != KeyPolicy::TRUSTED;
    let mut journal_failure = shared.journal().subscribe_failure();
    let mut revocations = shared.keys().subscribe();
    let mut reqs = Vec::new();
    let mut dones = Vec::new();
    let mut admin = Vec::new();
    let mut replies = Vec::new();
    let data_slots = Arc::new(Semaphore::new(DATA_OPS_IN_FLIGHT));
    // A bad frame met by the read itself; it ends the connection where a bad frame met in
    // the buffer would (after the batch before it ran).
    let mut broken: Option<String> = None;
    loop {
        if key.is_revoked() {
            let bye = goodbye(Errno::EACCES, &format!("key {} was revoked", key.id));
            let _ = tx.send(Outgoing::Goodbye(bye)).await;
            return;
        }
        // Backpressure: no new work while too many reply bytes wait to be sent.
        tokio::select! {
            _ = backlog.below_max() => {}
            _ = shutdown.changed() => return,
        }
        // The frame the read returned (in `reqs`) and every frame after it in the buffer
        // form one batch: one hold of the core lock.
        let parsed = match broken.take() {
            Some(reason) => Err(reason),
            None => take_requests(&mut frames, &mut reqs, &mut dones),
        };
        let more = matches!(parsed, Ok(true));
        if !dones.is_empty() {
            let (slow, ignored) = shared.callbacks_answered(session, &dones);
            dones.clear();
            if slow {
                shared.metrics().callback_defaults.inc();
                if shared.may_log_bad_frame().is_some() {
                    tracing::warn!(
                        "{peer} (session {session:016x}, key {}) answered a callback later \
                         than {:?}: it gets no leases for a while",
                        key.id,
                        crate::leases::CALLBACK_SLOW
                    );
                }
            }
            // Answers to callbacks that ended (a lease that ran out first) are common;
            // answers to other sessions' callbacks are not.
            if ignored > 0 {
                tracing::debug!(
                    "{peer} (key {}) answered {ignored} callbacks not sent to it or ended",
                    key.id
                );
            }
        }
        if screened || reqs.iter().any(|(_, r)| r.op.is_key_admin()) {
            let mut early = Replies::new(Instant::now(), 0);
            screen(&key, &mut reqs, &mut admin, &mut early);
            if !early.ops.is_empty() && !send_replies(&tx, &backlog, early).await {
                return;
            }
        }
        // Before anything runs, and whatever the key: a replay proves it is one.
        if reqs
            .iter()
            .any(|(_, r)| matches!(r.mode, ReplyMode::Replay { .. }))
        {
            let mut refused = Replies::new(Instant::now(), 0);
            refuse_forged_replays(shared, peer, &tags, &mut reqs, &mut refused);
            if !refused.ops.is_empty() && !send_replies(&tx, &backlog, refused).await {
                return;
            }
        }
        for (rid, req) in admin.drain(..) {
            let op = req.op.index() as u8;
            if shared.cluster().is_some() {
                // A cluster's keys change through the coordinator, and a change is done
                // once every server applied it (seconds if one must be fenced): its own
                // task, as a cluster operation's.
                let (shared, tx, backlog) = (shared.clone(), tx.clone(), backlog.clone());
                shared.runtime().clone().spawn(async move {
                    let (reply, lsn) =
                        crate::cluster_host::task_op(shared, client, key_id, req).await;
                    let mut group = Replies::new(Instant::now(), 1);
                    group.add(rid, op, &reply, lsn);
                    let _ = send_replies(&tx, &backlog, group).await;
                });
                continue;
            }
            let keys = shared.keys().clone();
            let reply = tokio::task::spawn_blocking(move || key_admin(&keys, &req.op))
                .await
                .unwrap_or_else(|e| Reply::Error(fs_err!(EIO, "key operation failed: {e}")));
            let mut group = Replies::new(Instant::now(), 1);
            group.add(rid, op, &reply, 0);
            if !send_replies(&tx, &backlog, group).await {
                return;
            }
        }
        // Data operations run as their own tasks (their I/O must not hold up the batch).
        // So do a member's cluster operations (they wait on the coordinator).
        let member = shared.cluster().is_some();
        let own_task = |op: &Op| crate::filesvc::is_data_op(op) || (member && op.is_cluster());
        let data_ops: Vec<(u64, Request)> = if reqs.iter().any(|(_, r)| own_task(&r.op)) {
            let (data, meta): (Vec<_>, Vec<_>) = reqs.drain(..).partition(|(_, r)| own_task(&r.op));
            reqs = meta;
            data
        } else {
            Vec::new()
        };
        for (rid, req) in data_ops {
            let Ok(permit) = data_slots.clone().acquire_owned().await else {
                return;
            };
            let (shared, tx, backlog) = (shared.clone(), tx.clone(), backlog.clone());
            // Writes and commits of slices only: a truncation, fallocate or fsync answers
            // once durable.
            let early = (req.mode == ReplyMode::Early
                && matches!(req.op, Op::Write { .. } | Op::CommitSlices { .. }))
            .then(|| tags.write_tag(&req));
            // On the server's runtime: a data write or a cluster operation must not end
            // halfway with a client's runtime.
            shared.runtime().clone().spawn(async move {
                let mut group = Replies::new(Instant::now(), 1);
                let op = req.op.index() as u8;
                let (reply, lsn) =
                    crate::cluster_host::task_op(shared.clone(), client, key_id, req).await;
                // A write answered early leaves now, as an `Unsafe` frame with its LSN.
                if let Some(tag) = early
                    && lsn > shared.journal().durable_lsn()
                    && !matches!(reply, Reply::Error(_))
                {
                    group.add_tagged(rid, op, &reply, lsn, tag);
                } else {
                    group.add(rid, op, &reply, lsn);
                }
                let _ = send_replies(&tx, &backlog, group).await;
                drop(permit);
            });
        }
        // After a crash only replays change anything for a while: a new change waits, so
        // that it cannot take a name or an id that a replayed one needs (reads go on).
        // Every request still in replay mode here carried a tag that verified.
        let window = shared.replay_window().left();
        if !window.is_zero()
            && reqs.iter().any(|(_, r)| {
                !matches!(r.mode, ReplyMode::Replay { .. }) && waits_for_replays(&r.op)
            })
        {
            tokio::time::sleep(window).await;
        }
        if !reqs.is_empty() {
            let started = Instant::now();
            let fx = shared.step(Event::Requests {
                client,
                reqs: &reqs,
                flushes: true,
                answers: std::mem::take(&mut replies),
            });
            let parked = fx.parked;
            replies = fx.answers;
            // Requests that need other servers' tables, or other sessions' flushes, wait
            // for them in their own task; the rest of the connection goes on.
            if !parked.is_empty() {
                let (waiting, rest): (Vec<_>, Vec<_>) = reqs
                    .drain(..)
                    .partition(|(rid, _)| parked.iter().any(|(p, _)| p == rid));
                reqs = rest;
                for ((rid, req), (_, why)) in waiting.into_iter().zip(parked) {
                    let (shared, tx, backlog) = (shared.clone(), tx.clone(), backlog.clone());
                    // On the server's runtime, as the data operations above.
                    shared.runtime().clone().spawn(async move {
                        let op = req.op.index() as u8;
                        let (reply, lsn) =
                            crate::cluster_host::parked_op(shared, client, rid, req, why).await;
                        let mut group = Replies::new(Instant::now(), 1);
                        group.add(rid, op, &reply, lsn);
                        let _ = send_replies(&tx, &backlog, group).await;
                    });
                }
            }
            // Two groups: replies that may leave now, and those waiting for the journal (so
            // a lookup does not wait for the fsync of a create that ran in the same batch).
            // Early replies leave now too, as `Unsafe` frames that carry their LSN.
            let durable = shared.journal().durable_lsn();
            let mut now = Replies::new(started, replies.len());
            let mut later = Replies::new(started, 0);
            for (a, (_, req)) in replies.drain(..).zip(reqs.drain(..)) {
                let op = req.op.index() as u8;
                if a.lsn <= durable {
                    now.add(a.rid, op, &a.reply, a.lsn);
                } else if req.mode == ReplyMode::Early && a.early_by(durable) {
                    now.add_unsafe(a.rid, &req, &a.reply, a.lsn, &tags);
                } else {
                    later.add(a.rid, op, &a.reply, a.lsn);
                }
            }
            for group in [now, later] {
                if !group.ops.is_empty() && !send_replies(&tx, &backlog, group).await {
                    return;
                }
            }
        }
        if let Err(reason) = parsed {
            log_bad_frame(shared, peer, &reason);
            let _ = tx
                .send(Outgoing::Goodbye(goodbye(Errno::EPROTO, &reason)))
                .await;
            return;
        }
        if more {
            // The buffer holds more requests: run them before reading (other connections
            // had the core lock in between).
            tokio::task::yield_now().await;
            continue;
        }
        let mut stopping = false;
        tokio::select! {
            // Cancel-safe: a frame half read stays in the `FramedRead`'s buffer.
            f = kochab_proto::codec::next(&mut frames) => match f {
                None => return,
                Some(Ok(f)) => {
                    if let Err(reason) = take_one(f, &mut reqs, &mut dones) {
                        broken = Some(reason);
                    }
                }
                Some(Err(CodecError::Frame(e))) => broken = Some(e.to_string()),
                Some(Err(CodecError::Io(e))) => {
                    tracing::debug!("connection from {peer}: {e}");
                    return;
                }
            },
            _ = shutdown.changed() => stopping = true,
            _ = journal_failure.changed() => stopping = true,
            // Checked at the top of the loop: a revoked key's connection closes at once.
            _ = revocations.changed() => {}
        }
        // Fail-stop: the client learns why the server stops instead of waiting on replies
        // that will never come (the shutdown that follows a failure says so too).
        if shared.journal().failed() {
            let why = shared.journal().failure().unwrap_or_default();
            let bye = goodbye(
                Errno::EIO,
                &format!("the server is stopping: its journal failed: {why}"),
            );
            let _ = tx.send(Outgoing::Goodbye(bye)).await;
            return;
        }
        if stopping {
            return;
        }
    }
}

/// True for the changes that wait out a replay window: those that make, remove or change
/// names and inodes (a replay could find its name taken, its source gone or a newer
/// change undone). Reads, locks, status, maps and administration go on, and so does a
/// reclaim (an open of a handle a client had, without truncation): it is how a client
/// replays the writes it made through that handle, which must land in the window, before
/// anyone's new writes (see `filesvc::data_op`).
pub fn waits_for_replays(op: &Op) -> bool {
    let reclaim = |flags: u32| {
        flags & OPEN_RECLAIM != 0 && flags & kochab_meta::files::open_flags::O_TRUNC == 0
    };
    match op {
        Op::Open { flags, .. } => !reclaim(*flags),
        Op::SetAttr { .. } | Op::Close { .. } | Op::CloseMany { .. } | Op::EndSession => true,
        _ => op.needs_reply_cache(),
    }
}

/// The next callback frame for this connection; never, if it holds no leases.
async fn next_callback(
    callbacks: &mut Option<mpsc::UnboundedReceiver<Vec<u8>>>,
) -> Option<Vec<u8>> {
    match callbacks {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Takes one item for the writer; returns its size.
fn accept(item: Outgoing, waiting: &mut Vec<Replies>, goodbye: &mut Option<Vec<u8>>) -> usize {
    match item {
        Outgoing::Replies(r) => {
            let n = r.bytes.len();
            waiting.push(r);
            n
        }
        Outgoing::Goodbye(bytes) => {
            *goodbye = Some(bytes);
            0
        }
    }
}

/// Sends replies as soon as the journal holds every record each one could reflect; replies
/// leave in that order, not in the order they were made (the protocol is multiplexed), so a
/// lookup never waits behind another request's fsync.
async fn write_loop(
    shared: Arc<Shared>,
    mut wr: Wr,
    mut rx: mpsc::Receiver<Outgoing>,
    mut callbacks: Option<mpsc::UnboundedReceiver<Vec<u8>>>,
    peer: Peer,
    backlog: Arc<Backlog>,
) {
    let _gone = WriterGone(backlog.clone());
    let mut durable = shared.journal().subscribe();
    let mut called_back = backlog.board.subscribe();
    let mut out = Vec::with_capacity(WRITE_BATCH_BYTES);
    // Replies whose records are not durable yet.
    let mut waiting: Vec<Replies> = Vec::new();
    let mut done: Vec<(Instant, Vec<(u8, bool)>)> = Vec::new();
    let mut goodbye: Option<Vec<u8>> = None;
    let mut open = true;
    // Highest LSN sent in an `Unsafe` reply, the durable LSN last reported, and when a
    // report is due if no reply carries it sooner.
    let mut owed = 0u64;
    let mut reported = 0u64;
    let mut report_due: Option<Instant> = None;
    loop {
        // Block for new replies when nothing waits for the journal; otherwise for whichever
        // comes first, a new reply or more of the journal on disk.
        // Callbacks to this client go out at once, ahead of replies.
        let mut taken = 0;
        if waiting.is_empty() && owed <= reported {
            tokio::select! {
                item = rx.recv() => match item {
                    Some(item) => taken += accept(item, &mut waiting, &mut goodbye),
                    None => return,
                },
                Some(f) = next_callback(&mut callbacks) => out.extend_from_slice(&f),
            }
        } else if open && goodbye.is_none() {
            tokio::select! {
                item = rx.recv() => match item {
                    Some(item) => taken += accept(item, &mut waiting, &mut goodbye),
                    None => open = false,
                },
                Some(f) = next_callback(&mut callbacks) => out.extend_from_slice(&f),
                _ = called_back.changed() => {}
                r = tokio::time::timeout(
                    report_due.map_or(Duration::from_secs(1), |t| {
                        t.saturating_duration_since(Instant::now())
                    }),
                    durable.changed(),
                ) => {
                    if let Ok(Err(_)) = r {
                        return; // the journal is gone: the server is stopping
                    }
                }
            }
        } else if let Ok(Err(_)) =
            tokio::time::timeout(Duration::from_secs(1), durable.changed()).await
        {
            return;
        }
        while open
            && goodbye.is_none()
            && taken < WRITE_BATCH_BYTES
            && let Ok(item) = rx.try_recv()
        {
            taken += accept(item, &mut waiting, &mut goodbye);
        }
        if shared.journal().failed() {
            // What is durable may still leave; the rest never will. Then the Goodbye (EIO).
            let on_disk = *durable.borrow_and_update();
            for r in waiting.extract_if(.., |r| r.lsn <= on_disk) {
                out.extend_from_slice(&r.bytes);
            }
            let why = shared.journal().failure().unwrap_or_default();
            out.extend_from_slice(&goodbye.take().unwrap_or_else(|| {
                self::goodbye(
                    Errno::EIO,
                    &format!("the server is stopping: its journal failed: {why}"),
                )
            }));
            tracing::error!("journal failed; closing the connection from {peer}");
            let _ = wr.write_all(&out).await;
            let _ = wr.shutdown().await;
            return;
        }
        while let Some(f) = callbacks.as_mut().and_then(|c| c.try_recv().ok()) {
            out.extend_from_slice(&f);
        }
        // Nothing leaves before the journal holds every record it could reflect (but
        // `Unsafe` replies, which say so), nor before the holders of leases on what this
        // session changed were called back.
        let on_disk = *durable.borrow_and_update();
        let called = *called_back.borrow_and_update();
        let mut sent = 0;
        for r in waiting.extract_if(.., |r| {
            (r.lsn <= on_disk || r.unsafe_lsn > 0) && r.ticket <= called
        }) {
            out.extend_from_slice(&r.bytes);
            sent += r.bytes.len();
            owed = owed.max(r.unsafe_lsn);
            done.push((r.started, r.ops));
        }
        if owed > reported && on_disk > reported {
            // Reported with the next replies, or after a short wait: one report covers the
            // flushes of many operations instead of one message each.
            let now = Instant::now();
            let due = *report_due.get_or_insert(now + DURABLE_REPORT_DELAY);
            if !out.is_empty() || now >= due {
                reported = on_disk;
                report_due = None;
                let _ = encode_frame(&mut out, FrameKind::Durable, 0, &on_disk);
            }
        }
        let closing = waiting.is_empty() && goodbye.is_some();
        if let Some(bytes) = goodbye.take_if(|_| closing) {
            out.extend_from_slice(&bytes);
        }
        if !out.is_empty() {
            if !shared.may_ack() {
                // A member past its lease acknowledges nothing: the client retries elsewhere.
                tracing::warn!("closing the connection from {peer}: this server's lease is over");
                return;
            }
            if wr.write_all(&out).await.is_err() {
                return;
            }
            backlog.sent(sent);
            out.clear();
            out.shrink_to(WRITE_BATCH_BYTES);
        }
        let now = Instant::now();
        for (started, ops) in done.drain(..) {
            let secs = now.duration_since(started).as_secs_f64();
            for (op, ok) in ops {
                shared.metrics().record_op(op as usize, ok, secs);
            }
        }
        if closing {
            let _ = wr.shutdown().await;
            return;
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_reclaim_does_not_wait_out_a_replay_window_but_other_opens_do() {
        const O_TRUNC: u32 = kochab_meta::files::open_flags::O_TRUNC;
        let open = |flags| Op::Open {
            id: 5,
            flags,
            handle: 1,
        };
        assert!(
            !waits_for_replays(&open(OPEN_RECLAIM | 0o2)),
            "a reclaim replays"
        );
        assert!(
            waits_for_replays(&open(OPEN_RECLAIM | O_TRUNC | 0o2)),
            "it truncates"
        );
        assert!(waits_for_replays(&open(0o2)), "a new open");
        assert!(waits_for_replays(&Op::Unlink {
            parent: 1,
            name: b"a".to_vec(),
        }));
        assert!(!waits_for_replays(&Op::Lookup {
            parent: 1,
            name: b"a".to_vec(),
        }));
    }
    use super::*;

    fn request_frames(n: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..n {
            let req = Request {
                cred: Credentials::root(),
                seq: 0,
                seq_floor: 0,
                map_version: 0,
                mode: Default::default(),
                op: Op::GetAttr { id: i },
            };
            encode_frame(&mut out, FrameKind::Request, i, &req).unwrap();
        }
        out
    }

    fn frames_holding(bytes: &[u8]) -> Frames {
        let rd: Rd = Box::new(tokio::io::empty());
        let mut frames = FramedRead::new(rd, FrameCodec::authenticated(MAX_FRAME_BYTES));
        frames.read_buffer_mut().extend_from_slice(bytes);
        frames
    }

    #[test]
    fn frames_already_read_form_batches_of_at_most_64() {
        let n = BATCH_REQUESTS_MAX as u64 + 6;
        let mut bytes = request_frames(n);
        // Half a frame more: it waits for the next read.
        let half = request_frames(1);
        bytes.extend_from_slice(&half[..half.len() / 2]);
        let mut frames = frames_holding(&bytes);
        let mut reqs = Vec::new();
        assert_eq!(
            take_requests(&mut frames, &mut reqs, &mut Vec::new()),
            Ok(true)
        );
        assert_eq!(reqs.len(), BATCH_REQUESTS_MAX);
        assert!(
            reqs.iter()
                .enumerate()
                .all(|(i, (rid, _))| *rid == i as u64)
        );
        reqs.clear();
        assert_eq!(
            take_requests(&mut frames, &mut reqs, &mut Vec::new()),
            Ok(false)
        );
        assert_eq!(reqs.len(), 6);
        assert_eq!(frames.read_buffer().len(), half.len() / 2);
    }

    #[test]
    fn a_close_many_counts_as_its_handles_against_the_batch() {
        let mut bytes = request_frames(10);
        let close_many = |n: u64| Request {
            op: Op::CloseMany {
                handles: (0..n).collect(),
            },
            ..Request::plain(&Credentials::root(), Op::StatFs)
        };
        encode_frame(&mut bytes, FrameKind::Request, 10, &close_many(60)).unwrap();
        bytes.extend_from_slice(&request_frames(1));
        let mut frames = frames_holding(&bytes);
        let mut reqs = Vec::new();
        // 10 requests and 60 closes: the batch is full after the CloseMany.
        assert_eq!(
            take_requests(&mut frames, &mut reqs, &mut Vec::new()),
            Ok(true)
        );
        assert_eq!(reqs.len(), 11);
        // A CloseMany already in the batch (read by the read itself) counts too.
        reqs.clear();
        reqs.push((11, close_many(CLOSE_MANY_HANDLES_MAX as u64)));
        assert_eq!(
            take_requests(&mut frames, &mut reqs, &mut Vec::new()),
            Ok(true)
        );
        assert_eq!(reqs.len(), 1, "the GetAttr waits for the next batch");
    }

    #[test]
    fn a_bad_frame_after_good_ones_keeps_the_good_ones() {
        let mut bytes = request_frames(3);
        let mut reply = Vec::new();
        encode_frame(&mut reply, FrameKind::Reply, 9, &Reply::Empty).unwrap();
        bytes.extend_from_slice(&reply);
        let mut frames = frames_holding(&bytes);
        let mut reqs = Vec::new();
        assert_eq!(
            take_requests(&mut frames, &mut reqs, &mut Vec::new()),
            Err("unexpected Reply frame".to_string())
        );
        assert_eq!(reqs.len(), 3);
    }
}

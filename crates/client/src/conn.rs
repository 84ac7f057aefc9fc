//! One authenticated, multiplexed connection to a server: many requests in flight, replies
//! matched by request id in any order.

use kochab_proto::auth::{ClientKey, ReplayTag, verify_server};
use kochab_proto::codec::{CodecError, Frame, FrameCodec};
use kochab_proto::frame::{MAX_FRAME_BYTES, decode_payload, encode_frame};
use kochab_proto::*;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::FramedRead;

/// Bytes the writer gathers into one write.
const WRITE_BATCH_BYTES: usize = 256 << 10;
/// Frames queued for the writer before senders wait.
const SEND_QUEUE: usize = 4096;
/// Longest a callback waits for the cache it revokes to be dropped before it is answered
/// anyway. A kernel may hold a directory's lock (which its invalidation needs) for a change
/// of its own that waits at the server for this very callback's answer: answering within
/// this bound breaks that wait, at the price of a cached name surviving the change by up
/// to this long.
pub const CALLBACK_ANSWER_MAX: Duration = Duration::from_millis(200);

/// Longest a flush callback waits for the client's held-back writes to reach the servers
/// before it is answered anyway (the server waits a lease at most; no lock of the kernel
/// is in the way, so this bounds only a stuck send).
pub const FLUSH_ANSWER_MAX: Duration = Duration::from_secs(30);

/// Callbacks answered by `CALLBACK_ANSWER_MAX` rather than by the drop they asked for.
static LATE_CALLBACKS: AtomicU64 = AtomicU64::new(0);

type Rd = Box<dyn tokio::io::AsyncRead + Unpin + Send>;
type Wr = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;
/// The server's frames.
type Frames = FramedRead<Rd, FrameCodec>;

/// Why a request got no reply on this connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnError {
    /// The connection is gone (the request may or may not have run).
    Lost(String),
    /// The server refused us (bad key, bad version).
    Refused(FsError),
}

/// A reply, with the LSN of its journal record and its replay tag when the server sent it
/// before that record was durable (an `Unsafe` frame).
pub type Answer = (Reply, Option<crate::replay::EarlyAck>);

type Pending = Mutex<FxHashMap<u64, oneshot::Sender<Result<Answer, ConnError>>>>;

/// What a connection tells its owner besides replies: how far the server's journal is
/// durable, and that the connection is gone (for early replies, see `replay`).
pub trait ConnEvents: Send + Sync {
    /// The server process `incarnation` has made its journal durable up to `lsn`.
    fn durable(&self, incarnation: u64, lsn: u64);
    /// A connection to the server process `incarnation` failed.
    fn lost(&self, incarnation: u64);
    /// The server asks this client to drop what it caches of `list` (a connection that
    /// asked for leases); the callback is answered when `answer` is dropped.
    fn callback(&self, list: Vec<Invalidation>, answer: CallbackAnswer) {
        let _ = (list, answer);
    }
}

/// Answers a callback when dropped (see [`ConnEvents::callback`]).
pub struct CallbackAnswer(Option<oneshot::Sender<()>>);

impl CallbackAnswer {
    /// An answer nobody waits for (a drop the client decided on itself).
    pub fn none() -> CallbackAnswer {
        CallbackAnswer(None)
    }
}

impl Drop for CallbackAnswer {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// A live connection.
pub struct Conn {
    tx: mpsc::Sender<Vec<u8>>,
    pending: Arc<Pending>,
    next_id: AtomicU64,
    alive: Arc<AtomicBool>,
    /// The root directory, as the server announced it.
    pub root: InodeId,
    /// The session the server keeps for this client and key.
    pub session: u64,
    /// The server process (random per process; another after a restart).
    pub incarnation: u64,
    /// Its journal's durable LSN when it welcomed us.
    pub durable_lsn: u64,
    /// How long the leases this connection is granted last (zero: it asked for none).
    pub lease: Duration,
}

impl Conn {
    /// Connects, authenticates with `key` as `client_id` (and the server with the same key:
    /// a server that cannot prove it holds the key is refused), and starts the I/O tasks.
    pub async fn connect(
        addr: SocketAddr,
        key: &ClientKey,
        client_id: u64,
        timeout: Duration,
    ) -> Result<Arc<Conn>, ConnError> {
        Conn::connect_with(addr, key, client_id, timeout, None, None, false).await
    }

    /// [`Conn::connect`], through TLS if `tls` is given: with the address as it was given
    /// ("host:port"), whose host the server's certificate must name.
    pub async fn connect_with(
        addr: SocketAddr,
        key: &ClientKey,
        client_id: u64,
        timeout: Duration,
        tls: Option<(&crate::tls::TlsClient, &str)>,
        events: Option<Arc<dyn ConnEvents>>,
        leases: bool,
    ) -> Result<Arc<Conn>, ConnError> {
        let lost = |e: std::io::Error| ConnError::Lost(format!("{addr}: {e}"));
        // A lane's connection is served on the lane's runtime (see `lane::set_lane`).
        let serve_here =
            crate::lane::lane().and_then(|_| tokio::runtime::Handle::try_current().ok());
        let (rd, mut wr): (Rd, Wr) = match kochab_local::connect(addr, serve_here) {
            // A server of this process: no socket, no TLS (nothing crosses a wire); the
            // key handshake below still runs.
            Some(stream) => {
                let (r, w) = tokio::io::split(stream);
                (Box::new(r), Box::new(w))
            }
            None => dial(addr, timeout, tls).await?,
        };
        // Until the server has proven the key, only small frames (as a server reads them).
        let mut frames =
            FramedRead::with_capacity(rd, FrameCodec::preauth(), FrameCodec::PREAUTH_BUFFER);
        let handshake = async {
            let Frame { kind, payload, .. } = read_frame(&mut frames).await?;
            let challenge: Challenge = match kind {
                FrameKind::Challenge => {
                    decode_payload(&payload).map_err(|e| ConnError::Lost(e.to_string()))?
                }
                FrameKind::Goodbye => return Err(refused(&payload)),
                k => return Err(ConnError::Lost(format!("expected a challenge, got {k:?}"))),
            };
            if challenge.version != PROTOCOL_VERSION {
                return Err(ConnError::Refused(fs_err!(
                    EPROTO,
                    "server speaks protocol {}, we speak {PROTOCOL_VERSION}",
                    challenge.version
                )));
            }
            let mut client_nonce = [0u8; 32];
            getrandom::fill(&mut client_nonce)
                .map_err(|e| ConnError::Lost(format!("no randomness: {e}")))?;
            let (mut auth, t) = Auth::prove(key, challenge.nonce, client_nonce, client_id);
            auth.leases = leases;
            let mut out = Vec::new();
            encode_frame(&mut out, FrameKind::Auth, 0, &auth)
                .map_err(|e| ConnError::Lost(e.to_string()))?;
            wr.write_all(&out).await.map_err(lost)?;
            let Frame { kind, payload, .. } = read_frame(&mut frames).await?;
            match kind {
                FrameKind::Welcome => {
                    let w = decode_payload::<Welcome>(&payload)
                        .map_err(|e| ConnError::Lost(e.to_string()))?;
                    // Mutual authentication: nothing from a server that does not hold the
                    // key is used (a spoofed server could otherwise serve any files).
                    if !verify_server(&key.key, &t, &w.mac) {
                        return Err(ConnError::Refused(fs_err!(
                            EACCES,
                            "{addr} did not prove it holds key {}: not the cluster's server",
                            key.id
                        )));
                    }
                    Ok(w)
                }
                FrameKind::Goodbye => Err(refused(&payload)),
                k => Err(ConnError::Lost(format!("expected a welcome, got {k:?}"))),
            }
        };
        let welcome = tokio::time::timeout(timeout, handshake)
            .await
            .map_err(|_| {
                // A TLS listener waits for a TLS hello and never sends a plain client
                // the challenge: say so, it is the likely cause.
                let hint = if tls.is_none() {
                    " (if the server runs TLS, connect with TLS: --tls-ca)"
                } else {
                    ""
                };
                ConnError::Lost(format!("{addr}: handshake timed out{hint}"))
            })??;
        // The welcome announces what the server accepts; replies may be as large as the
        // protocol allows.
        *frames.decoder_mut() = FrameCodec::authenticated(MAX_FRAME_BYTES);
        let (tx, rx) = mpsc::channel(SEND_QUEUE);
        let pending: Arc<Pending> = Arc::new(Mutex::new(FxHashMap::default()));
        let alive = Arc::new(AtomicBool::new(true));
        tokio::spawn(write_loop(wr, rx, alive.clone(), pending.clone()));
        let notes = Notes {
            events,
            incarnation: welcome.incarnation,
            answers: tx.clone(),
        };
        tokio::spawn(read_loop(frames, pending.clone(), alive.clone(), notes));
        Ok(Arc::new(Conn {
            tx,
            pending,
            next_id: AtomicU64::new(1),
            alive,
            root: welcome.root,
            session: welcome.session,
            incarnation: welcome.incarnation,
            durable_lsn: welcome.durable_lsn,
            lease: Duration::from_millis(welcome.lease_ms),
        }))
    }

    /// False once the connection failed; callers reconnect.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Sends one request and waits for its reply. Dropping the future (a timeout)
    /// forgets the request; a late reply is then discarded.
    pub async fn call(&self, req: &Request) -> Result<Reply, ConnError> {
        self.call_answer(req).await.map(|(reply, _)| reply)
    }

    /// [`Conn::call`], also saying whether the reply came before its record was durable
    /// (and at which LSN).
    pub async fn call_answer(&self, req: &Request) -> Result<Answer, ConnError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut frame = Vec::with_capacity(96 + bulk_len(&req.op));
        if let Err(e) = encode_frame(&mut frame, FrameKind::Request, id, req) {
            return Ok((
                Reply::Error(fs_err!(EINVAL, "request does not fit in a frame: {e}")),
                None,
            ));
        }
        let (tx, rx) = oneshot::channel();
        self.pending.lock().insert(id, tx);
        let guard = Forget {
            pending: &self.pending,
            id,
        };
        if !self.is_alive() || self.tx.send(frame).await.is_err() {
            return Err(ConnError::Lost("connection closed".into()));
        }
        let result = match rx.await {
            Ok(r) => r,
            Err(_) => Err(ConnError::Lost("connection closed".into())),
        };
        std::mem::forget(guard);
        result
    }

    /// Marks the connection dead so that callers reconnect (e.g. after a timeout).
    pub fn mark_dead(&self) {
        self.alive.store(false, Ordering::Release);
    }
}

/// Removes a pending request whose caller stopped waiting.
struct Forget<'a> {
    pending: &'a Pending,
    id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.pending.lock().remove(&self.id);
    }
}

/// Bytes of bulk data an operation carries, so its frame is allocated once.
fn bulk_len(op: &Op) -> usize {
    match op {
        Op::Write { data, .. } => data.len(),
        Op::SetXattr { value, .. } => value.len(),
        Op::Symlink { target, .. } => target.len(),
        _ => 0,
    }
}

fn refused(payload: &[u8]) -> ConnError {
    match decode_payload::<FsError>(payload) {
        Ok(e) => ConnError::Refused(e),
        Err(e) => ConnError::Lost(format!("undecodable goodbye: {e}")),
    }
}

/// A TCP connection to `addr` (through TLS if `tls` is given, checking the certificate
/// against the host of the address as given, else against `addr`), split.
async fn dial(
    addr: SocketAddr,
    timeout: Duration,
    tls: Option<(&crate::tls::TlsClient, &str)>,
) -> Result<(Rd, Wr), ConnError> {
    let sock = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| ConnError::Lost(format!("{addr}: connect timed out")))?
        .map_err(|e| ConnError::Lost(format!("{addr}: {e}")))?;
    let _ = sock.set_nodelay(true);
    kochab_proto::net::size_socket_buffers(&sock);
    let Some((tls, given)) = tls else {
        let (r, w) = sock.into_split();
        return Ok((Box::new(r), Box::new(w)));
    };
    let s = tokio::time::timeout(timeout, tls.connect(given, addr, sock))
        .await
        .map_err(|_| ConnError::Lost(format!("{addr}: TLS handshake timed out")))?
        .map_err(|e| ConnError::Refused(fs_err!(EACCES, "{e}")))?;
    let (r, w) = tokio::io::split(s);
    Ok((Box::new(r), Box::new(w)))
}

async fn read_frame(frames: &mut Frames) -> Result<Frame, ConnError> {
    match kochab_proto::codec::next(frames).await {
        Some(Ok(f)) => Ok(f),
        Some(Err(e)) => Err(ConnError::Lost(e.to_string())),
        None => Err(ConnError::Lost("server closed the connection".into())),
    }
}

/// Fails the connection however its reader ends, also when its task is dropped unfinished
/// (with the runtime it ran on: a lane's, see `lane::set_lane`), so that no caller waits
/// for a reply that cannot come and the next one reconnects.
struct Ended {
    pending: Arc<Pending>,
    alive: Arc<AtomicBool>,
}

impl Drop for Ended {
    fn drop(&mut self) {
        fail_all(&self.pending, &self.alive, "connection ended");
    }
}

fn fail_all(pending: &Pending, alive: &AtomicBool, why: &str) {
    alive.store(false, Ordering::Release);
    let waiters: Vec<_> = pending.lock().drain().collect();
    for (_, tx) in waiters {
        let _ = tx.send(Err(ConnError::Lost(why.to_string())));
    }
}

fn refuse_all(pending: &Pending, alive: &AtomicBool, why: &FsError) {
    alive.store(false, Ordering::Release);
    let waiters: Vec<_> = pending.lock().drain().collect();
    for (_, tx) in waiters {
        let _ = tx.send(Err(ConnError::Refused(why.clone())));
    }
}

async fn write_loop(
    mut wr: Wr,
    mut rx: mpsc::Receiver<Vec<u8>>,
    alive: Arc<AtomicBool>,
    pending: Arc<Pending>,
) {
    let mut out = Vec::with_capacity(WRITE_BATCH_BYTES);
    while let Some(first) = rx.recv().await {
        // A lone (often large) frame goes out as it is; several are gathered into one write.
        let single = match rx.try_recv() {
            Ok(second) => {
                out.extend_from_slice(&first);
                out.extend_from_slice(&second);
                while out.len() < WRITE_BATCH_BYTES {
                    match rx.try_recv() {
                        Ok(f) => out.extend_from_slice(&f),
                        Err(_) => break,
                    }
                }
                None
            }
            Err(_) => Some(first),
        };
        let bytes: &[u8] = single.as_deref().unwrap_or(&out);
        if let Err(e) = wr.write_all(bytes).await {
            fail_all(&pending, &alive, &format!("write failed: {e}"));
            return;
        }
        out.clear();
        if !alive.load(Ordering::Acquire) {
            return;
        }
    }
}

/// Where a connection's read loop reports durability and its end.
struct Notes {
    events: Option<Arc<dyn ConnEvents>>,
    incarnation: u64,
    /// Where callbacks' answers go (the connection's writer).
    answers: mpsc::Sender<Vec<u8>>,
}

impl Drop for Notes {
    fn drop(&mut self) {
        // However the read loop ends.
        if let Some(e) = &self.events {
            e.lost(self.incarnation);
        }
    }
}

async fn read_loop(
    mut frames: Frames,
    pending: Arc<Pending>,
    alive: Arc<AtomicBool>,
    notes: Notes,
) {
    let _ended = Ended {
        pending: pending.clone(),
        alive: alive.clone(),
    };
    loop {
        let f = match kochab_proto::codec::next(&mut frames).await {
            Some(Ok(f)) => f,
            Some(Err(CodecError::Frame(e))) => {
                fail_all(&pending, &alive, &format!("bad frame from server: {e}"));
                return;
            }
            Some(Err(CodecError::Io(e))) => {
                fail_all(&pending, &alive, &format!("read failed: {e}"));
                return;
            }
            None => {
                fail_all(&pending, &alive, "server closed the connection");
                return;
            }
        };
        match f.kind {
            FrameKind::Reply => {
                let reply = decode_payload::<Reply>(&f.payload)
                    .map(|r| (r, None))
                    .map_err(|e| ConnError::Lost(format!("bad reply: {e}")));
                if let Some(tx) = pending.lock().remove(&f.request_id) {
                    let _ = tx.send(reply);
                }
            }
            FrameKind::Unsafe => {
                let reply = decode_payload::<(u64, ReplayTag, Reply)>(&f.payload)
                    .map(|(lsn, tag, r)| (r, Some(crate::replay::EarlyAck { lsn, tag })))
                    .map_err(|e| ConnError::Lost(format!("bad reply: {e}")));
                if let Some(tx) = pending.lock().remove(&f.request_id) {
                    let _ = tx.send(reply);
                }
            }
            FrameKind::Durable => match decode_payload::<u64>(&f.payload) {
                Ok(lsn) => {
                    if let Some(e) = &notes.events {
                        e.durable(notes.incarnation, lsn);
                    }
                }
                Err(e) => {
                    fail_all(&pending, &alive, &format!("bad durable frame: {e}"));
                    return;
                }
            },
            FrameKind::Callback => match decode_payload::<Vec<Invalidation>>(&f.payload) {
                Ok(list) => {
                    let (tx, rx) = oneshot::channel();
                    let answers = notes.answers.clone();
                    let id = f.request_id;
                    let bound = if list.iter().any(|i| matches!(i, Invalidation::Flush { .. })) {
                        FLUSH_ANSWER_MAX
                    } else {
                        CALLBACK_ANSWER_MAX
                    };
                    tokio::spawn(async move {
                        if tokio::time::timeout(bound, rx).await.is_err() {
                            let n = LATE_CALLBACKS.fetch_add(1, Ordering::Relaxed);
                            if n.is_power_of_two() || n == 0 {
                                tracing::warn!(
                                    "callback answered before its cache was dropped or its \
                                     writes sent (after {bound:?}; {} so far)",
                                    n + 1
                                );
                            }
                        }
                        let mut frame = Vec::new();
                        if encode_frame(&mut frame, FrameKind::CallbackDone, id, &()).is_ok() {
                            let _ = answers.send(frame).await;
                        }
                    });
                    let answer = CallbackAnswer(Some(tx));
                    match &notes.events {
                        Some(e) => e.callback(list, answer),
                        None => drop(answer),
                    }
                }
                Err(e) => {
                    fail_all(&pending, &alive, &format!("bad callback frame: {e}"));
                    return;
                }
            },
            FrameKind::Goodbye => {
                match decode_payload::<FsError>(&f.payload) {
                    // The server said why it closes (EIO: its journal failed): that is every
                    // waiting caller's answer, not a reason to retry against a server that
                    // is stopping.
                    Ok(e) => refuse_all(&pending, &alive, &e),
                    Err(_) => fail_all(&pending, &alive, "server closed the connection"),
                }
                return;
            }
            k => {
                fail_all(&pending, &alive, &format!("unexpected {k:?} frame"));
                return;
            }
        }
    }
}

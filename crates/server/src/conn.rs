//! One client connection: the handshake, then a reader task that decodes and runs batches
//! of requests and a writer task that sends their replies once the journal has made them
//! durable. A malformed frame closes this connection only; everyone else is unaffected.

use crate::core::Shared;
use kochab_proto::auth::{ClusterKey, verify};
use kochab_proto::frame::{FRAME_HEADER_BYTES, decode_payload, encode_frame, parse_header};
use kochab_proto::*;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Semaphore, mpsc, watch};

/// Time a new connection has to authenticate.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Reply batches queued for the writer before the reader stops reading (backpressure).
const WRITER_QUEUE: usize = 64;
/// Bytes the writer gathers into one write.
const WRITE_BATCH_BYTES: usize = 1 << 20;
/// Data operations (reads, writes) one connection may have running at once.
const DATA_OPS_IN_FLIGHT: usize = 64;
use kochab_proto::net::READ_CHUNK;

/// Replies of one batch (or of one data operation), sent once the journal holds `lsn`.
struct Replies {
    lsn: u64,
    bytes: Vec<u8>,
    started: Instant,
    /// (operation index, succeeded) per reply, for the metrics.
    ops: Vec<(u8, bool)>,
}

impl Replies {
    fn new(started: Instant, n: usize) -> Replies {
        Replies {
            lsn: 0,
            bytes: Vec::with_capacity(n * 128),
            started,
            ops: Vec::with_capacity(n),
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
}

enum Outgoing {
    Replies(Replies),
    Goodbye(Vec<u8>),
}

/// Serves one accepted connection until it closes or the server shuts down.
pub async fn serve(
    shared: Arc<Shared>,
    key: ClusterKey,
    sock: TcpStream,
    peer: SocketAddr,
    shutdown: watch::Receiver<bool>,
) {
    let _ = sock.set_nodelay(true);
    kochab_proto::net::size_socket_buffers(std::os::fd::AsRawFd::as_raw_fd(&sock));
    let (mut rd, mut wr) = sock.into_split();
    let mut buf = Vec::with_capacity(READ_CHUNK);
    let client = match tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        handshake(&shared, &key, &mut rd, &mut wr, &mut buf),
    )
    .await
    {
        Ok(Ok(client)) => client,
        Ok(Err(reason)) => {
            tracing::info!("connection from {peer} refused: {reason}");
            return;
        }
        Err(_) => {
            tracing::info!("connection from {peer} did not authenticate in time");
            return;
        }
    };
    shared.connections.fetch_add(1, Ordering::Relaxed);
    shared.core.lock().sessions.connect(client);
    let (tx, rx) = mpsc::channel(WRITER_QUEUE);
    let writer = tokio::spawn(write_loop(shared.clone(), wr, rx, peer));
    read_loop(&shared, client, rd, buf, tx, peer, shutdown).await;
    let _ = writer.await;
    shared.connections.fetch_sub(1, Ordering::Relaxed);
    shared
        .core
        .lock()
        .sessions
        .disconnect(client, Instant::now());
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

/// Challenge, proof, welcome. Returns the client id.
async fn handshake(
    shared: &Shared,
    key: &ClusterKey,
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    buf: &mut Vec<u8>,
) -> Result<u64, String> {
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
    let header = loop {
        match parse_header(buf) {
            Ok(Some(h)) => break h,
            Ok(None) => {}
            Err(e) => {
                let _ = wr.write_all(&goodbye(Errno::EPROTO, &e.to_string())).await;
                return Err(e.to_string());
            }
        }
        buf.reserve(READ_CHUNK);
        if rd.read_buf(buf).await.map_err(|e| e.to_string())? == 0 {
            return Err("closed during handshake".into());
        }
    };
    let refuse = |why: &str| goodbye(Errno::EACCES, why);
    if header.kind != FrameKind::Auth {
        let _ = wr.write_all(&refuse("authenticate first")).await;
        return Err(format!("sent {:?} before authenticating", header.kind));
    }
    let auth: Auth = match decode_payload(&buf[FRAME_HEADER_BYTES..header.total_len]) {
        Ok(a) => a,
        Err(e) => {
            let _ = wr.write_all(&goodbye(Errno::EPROTO, &e.to_string())).await;
            return Err(e.to_string());
        }
    };
    buf.drain(..header.total_len);
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
    if !verify(key, &nonce, auth.client_id, &auth.mac) {
        let _ = wr.write_all(&refuse("wrong cluster key")).await;
        return Err("wrong cluster key".into());
    }
    let root = shared.core.lock().engine.root();
    let welcome = Welcome {
        server_id: shared.server_id,
        root,
        max_frame_bytes: frame::MAX_FRAME_BYTES as u32,
    };
    out.clear();
    encode_frame(&mut out, FrameKind::Welcome, 0, &welcome).map_err(|e| e.to_string())?;
    wr.write_all(&out).await.map_err(|e| e.to_string())?;
    Ok(auth.client_id)
}

/// Decodes every complete frame in `buf[*start..]`. An invalid one ends the connection.
fn take_requests(
    buf: &[u8],
    start: &mut usize,
    reqs: &mut Vec<(u64, Request)>,
) -> Result<(), String> {
    loop {
        match parse_header(&buf[*start..]) {
            Ok(None) => return Ok(()),
            Err(e) => return Err(e.to_string()),
            Ok(Some(h)) => {
                if h.kind != FrameKind::Request {
                    return Err(format!("unexpected {:?} frame", h.kind));
                }
                let payload = &buf[*start + FRAME_HEADER_BYTES..*start + h.total_len];
                let req: Request = decode_payload(payload).map_err(|e| e.to_string())?;
                reqs.push((h.request_id, req));
                *start += h.total_len;
            }
        }
    }
}

async fn read_loop(
    shared: &Arc<Shared>,
    client: u64,
    mut rd: OwnedReadHalf,
    mut buf: Vec<u8>,
    tx: mpsc::Sender<Outgoing>,
    peer: SocketAddr,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut journal_failure = shared.journal.subscribe_failure();
    let mut reqs = Vec::new();
    let mut replies = Vec::new();
    let data_slots = Arc::new(Semaphore::new(DATA_OPS_IN_FLIGHT));
    loop {
        let mut start = 0;
        let parsed = take_requests(&buf, &mut start, &mut reqs);
        // Data operations run as their own tasks (their I/O must not hold up the batch).
        let data_ops: Vec<(u64, Request)> =
            if reqs.iter().any(|(_, r)| crate::filesvc::is_data_op(&r.op)) {
                let (data, meta): (Vec<_>, Vec<_>) = reqs
                    .drain(..)
                    .partition(|(_, r)| crate::filesvc::is_data_op(&r.op));
                reqs = meta;
                data
            } else {
                Vec::new()
            };
        for (rid, req) in data_ops {
            let Ok(permit) = data_slots.clone().acquire_owned().await else {
                return;
            };
            let (shared, tx) = (shared.clone(), tx.clone());
            tokio::spawn(async move {
                let mut group = Replies::new(Instant::now(), 1);
                let op = req.op.index() as u8;
                let (reply, lsn) = crate::filesvc::data_op(shared, client, req).await;
                group.add(rid, op, &reply, lsn);
                let _ = tx.send(Outgoing::Replies(group)).await;
                drop(permit);
            });
        }
        if !reqs.is_empty() {
            let started = Instant::now();
            shared.execute_batch(client, &reqs, &mut replies);
            // Two groups: replies that may leave now, and those waiting for the journal (so
            // a lookup does not wait for the fsync of a create that ran in the same batch).
            let durable = shared.journal.durable_lsn();
            let mut now = Replies::new(started, replies.len());
            let mut later = Replies::new(started, 0);
            for ((rid, reply, lsn), (_, req)) in replies.drain(..).zip(reqs.drain(..)) {
                let group = if lsn <= durable { &mut now } else { &mut later };
                group.add(rid, req.op.index() as u8, &reply, lsn);
            }
            for group in [now, later] {
                if !group.ops.is_empty() && tx.send(Outgoing::Replies(group)).await.is_err() {
                    return;
                }
            }
        }
        if let Err(reason) = parsed {
            tracing::warn!("closing connection from {peer}: {reason}");
            let _ = tx
                .send(Outgoing::Goodbye(goodbye(Errno::EPROTO, &reason)))
                .await;
            return;
        }
        buf.drain(..start);
        kochab_proto::net::reserve_for_frame(&mut buf);
        let mut stopping = false;
        tokio::select! {
            r = rd.read_buf(&mut buf) => match r {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!("connection from {peer}: {e}");
                    return;
                }
            },
            _ = shutdown.changed() => stopping = true,
            _ = journal_failure.changed() => stopping = true,
        }
        // Fail-stop: the client learns why the server stops instead of waiting on replies
        // that will never come (the shutdown that follows a failure says so too).
        if shared.journal.failed() {
            let why = shared.journal.failure().unwrap_or_default();
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
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Outgoing>,
    peer: SocketAddr,
) {
    let mut durable = shared.journal.subscribe();
    let mut out = Vec::with_capacity(WRITE_BATCH_BYTES);
    // Replies whose records are not durable yet.
    let mut waiting: Vec<Replies> = Vec::new();
    let mut done: Vec<(Instant, Vec<(u8, bool)>)> = Vec::new();
    let mut goodbye: Option<Vec<u8>> = None;
    let mut open = true;
    loop {
        // Block for new replies when nothing waits for the journal; otherwise for whichever
        // comes first, a new reply or more of the journal on disk.
        let mut taken = 0;
        if waiting.is_empty() {
            match rx.recv().await {
                Some(item) => taken += accept(item, &mut waiting, &mut goodbye),
                None => return,
            }
        } else if open && goodbye.is_none() {
            tokio::select! {
                item = rx.recv() => match item {
                    Some(item) => taken += accept(item, &mut waiting, &mut goodbye),
                    None => open = false,
                },
                r = tokio::time::timeout(Duration::from_secs(1), durable.changed()) => {
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
        if shared.journal.failed() {
            // What is durable may still leave; the rest never will. Then the Goodbye (EIO).
            let on_disk = *durable.borrow_and_update();
            for r in waiting.extract_if(.., |r| r.lsn <= on_disk) {
                out.extend_from_slice(&r.bytes);
            }
            let why = shared.journal.failure().unwrap_or_default();
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
        // Nothing leaves before the journal holds every record it could reflect.
        let on_disk = *durable.borrow_and_update();
        for r in waiting.extract_if(.., |r| r.lsn <= on_disk) {
            out.extend_from_slice(&r.bytes);
            done.push((r.started, r.ops));
        }
        let closing = waiting.is_empty() && goodbye.is_some();
        if let Some(bytes) = goodbye.take_if(|_| closing) {
            out.extend_from_slice(&bytes);
        }
        if !out.is_empty() {
            if wr.write_all(&out).await.is_err() {
                return;
            }
            out.clear();
            out.shrink_to(WRITE_BATCH_BYTES);
        }
        let now = Instant::now();
        for (started, ops) in done.drain(..) {
            let secs = now.duration_since(started).as_secs_f64();
            for (op, ok) in ops {
                shared.metrics.record_op(op as usize, ok, secs);
            }
        }
        if closing {
            let _ = wr.shutdown().await;
            return;
        }
    }
}

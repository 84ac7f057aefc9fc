//! Member-to-member links for transaction messages: one connection per address, opened
//! with the cluster key as the admin client of the member protocol (as the coordinator's
//! controls are), carrying `ControlBody::Txn` requests one way. Replies are read and
//! dropped. A link that fails is opened again for the next message; what it lost the
//! protocol resends. Through TLS when the cluster runs it (the peer's certificate must
//! name the address it registered, as for the coordinator's links to servers).

use kochab_journal::JournalId;
use kochab_proto::auth::{ADMIN_KEY_ID, ClusterKey, Transcript, prove_client, verify_server};
use kochab_proto::cluster::{Control, ControlBody, Epoch, Incarnation, ServerId};
use kochab_proto::codec::FrameCodec;
use kochab_proto::frame::{FrameKind, decode_payload, encode_frame};
use kochab_proto::{Auth, Challenge, Credentials, Op, PROTOCOL_VERSION, Request, Welcome};
use std::collections::HashMap;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::FramedRead;

/// Messages queued per link before new ones are dropped (a peer that does not read):
/// far above one server's transactions in flight (`initiator` takes 1,024 requests).
const QUEUE_MAX: usize = 4096;

/// Connecting and the handshake together take at most this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A link's byte stream: plain TCP or TLS over it.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

pub struct Links {
    key: ClusterKey,
    me: JournalId,
    client_id: u64,
    tls: Option<crate::tls::TlsClient>,
    links: HashMap<String, mpsc::Sender<Vec<u8>>>,
}

impl Links {
    pub fn new(key: ClusterKey, me: JournalId, tls: Option<crate::tls::TlsClient>) -> Links {
        Links {
            key,
            me,
            client_id: kochab_proto::auth::random_u64(),
            tls,
            links: HashMap::new(),
        }
    }

    /// Queues `msg` (an encoded `txn::Msg`) for the member at `addr`.
    pub fn send(&mut self, addr: &str, from: ServerId, msg: Vec<u8>) {
        let control = Control {
            to: Incarnation {
                server: from,
                epoch: Epoch(self.me.epoch),
            },
            body: ControlBody::Txn { from, msg },
        };
        let req = Request {
            cred: Credentials::root(),
            seq: 0,
            seq_floor: 0,
            map_version: 0,
            mode: Default::default(),
            op: Op::Control { control },
        };
        let mut frame = Vec::new();
        if let Err(e) = encode_frame(&mut frame, FrameKind::Request, 1, &req) {
            tracing::warn!("a transaction message does not fit a frame: {e}");
            return;
        }
        if let Some(tx) = self.links.get(addr)
            && !tx.is_closed()
        {
            let _ = tx.try_send(frame);
            return;
        }
        let (tx, rx) = mpsc::channel(QUEUE_MAX);
        let _ = tx.try_send(frame);
        self.links.insert(addr.to_string(), tx);
        let tls = self.tls.clone();
        tokio::spawn(run_link(
            addr.to_string(),
            self.key,
            self.client_id,
            tls,
            rx,
        ));
    }
}

async fn run_link(
    addr: String,
    key: ClusterKey,
    client_id: u64,
    tls: Option<crate::tls::TlsClient>,
    mut rx: mpsc::Receiver<Vec<u8>>,
) {
    let connecting = connect(&addr, &key, client_id, tls.as_ref());
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!("transaction link to {addr}: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!("transaction link to {addr}: timed out");
            return;
        }
    };
    let (rd, mut wr) = tokio::io::split(stream);
    // Replies (empty) are read so the peer never blocks on a full socket.
    let reader = tokio::spawn(async move {
        let mut frames = FramedRead::new(rd, FrameCodec::authenticated(1 << 20));
        while let Some(Ok(_)) = kochab_proto::codec::next(&mut frames).await {}
    });
    while let Some(frame) = rx.recv().await {
        if wr.write_all(&frame).await.is_err() {
            break;
        }
    }
    reader.abort();
}

/// Dials `addr` (through TLS if given) and runs the key handshake as the admin client.
async fn connect(
    addr: &str,
    key: &ClusterKey,
    client_id: u64,
    tls: Option<&crate::tls::TlsClient>,
) -> Result<Box<dyn Stream>, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let _ = tcp.set_nodelay(true);
    let mut stream: Box<dyn Stream> = match tls {
        Some(tls) => {
            let peer = tcp.peer_addr().map_err(|e| e.to_string())?;
            Box::new(
                tls.connect(addr, peer, tcp)
                    .await
                    .map_err(|e| e.to_string())?,
            )
        }
        None => Box::new(tcp),
    };
    let (rd, mut wr) = tokio::io::split(&mut stream);
    let mut frames = FramedRead::new(rd, FrameCodec::preauth());
    let next = |f: Option<Result<kochab_proto::codec::Frame, _>>, want: FrameKind| match f {
        Some(Ok(f)) if f.kind == want => Ok(f),
        Some(Ok(f)) => Err(format!("{:?} where {want:?} was expected", f.kind)),
        Some(Err(e)) => Err(format!("{e}")),
        None => Err("closed during the handshake".to_string()),
    };
    let f = next(
        kochab_proto::codec::next(&mut frames).await,
        FrameKind::Challenge,
    )?;
    let challenge: Challenge = decode_payload(&f.payload).map_err(|e| e.to_string())?;
    let mut client_nonce = [0u8; 32];
    getrandom::fill(&mut client_nonce).map_err(|e| format!("no randomness: {e}"))?;
    let t = Transcript {
        server_nonce: challenge.nonce,
        client_nonce,
        key_id: ADMIN_KEY_ID,
        client_id,
    };
    let auth = Auth {
        version: PROTOCOL_VERSION,
        key_id: ADMIN_KEY_ID,
        client_id,
        client_nonce,
        mac: prove_client(key, &t),
        leases: false,
    };
    let mut out = Vec::new();
    encode_frame(&mut out, FrameKind::Auth, 0, &auth).map_err(|e| e.to_string())?;
    wr.write_all(&out).await.map_err(|e| e.to_string())?;
    let f = next(
        kochab_proto::codec::next(&mut frames).await,
        FrameKind::Welcome,
    )?;
    let welcome: Welcome = decode_payload(&f.payload).map_err(|e| e.to_string())?;
    if !verify_server(key, &t, &welcome.mac) {
        return Err("the server's proof is wrong".into());
    }
    drop(frames);
    drop(wr);
    Ok(stream)
}

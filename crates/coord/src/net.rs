//! The messages between replicas (openraft's AppendEntries, Vote, InstallSnapshot) and from
//! clients, a connection that carries them, and openraft's network factory over it.
//!
//! One request, one response, in order, per connection. Replication keeps its connection;
//! a failed call drops it and the next call dials again.

use std::collections::{BTreeMap, BTreeSet};
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::time::Duration;

use kochab_tls::{TlsAcceptor, TlsClient};
use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::error::CoordError;
use crate::wire::{self, ClusterKey, WireError};
use crate::{ReplicaId, ReplicatedState, TypeConfig};

/// One replica's view of the group, for `kochab status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaStatus {
    /// This replica.
    pub id: ReplicaId,
    /// Leader, Follower, Candidate, Learner or Shutdown.
    pub role: String,
    /// The leader it follows, if any.
    pub leader: Option<ReplicaId>,
    /// Current term.
    pub term: u64,
    /// Index of the last log entry it holds.
    pub last_log_index: Option<u64>,
    /// Index of the last entry applied to its state.
    pub last_applied: Option<u64>,
    /// Index its latest snapshot covers.
    pub snapshot: Option<u64>,
    /// Index up to which its log is purged.
    pub purged: Option<u64>,
    /// Voting members and their addresses.
    pub voters: BTreeMap<ReplicaId, String>,
    /// Non-voting members and their addresses.
    pub learners: BTreeMap<ReplicaId, String>,
}

type C<S> = TypeConfig<S>;

/// Time allowed to open a TCP connection to a peer.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// TLS on a replica's connections: the acceptor of its listener (peers, servers and admin
/// commands reach it through TLS) and the authorities its dials to peers trust (a peer's
/// certificate must name the address dialed, an IP address SAN). `None`: plain TCP.
#[derive(Clone, Default)]
pub struct ReplicaTls {
    /// For the listener.
    pub accept: Option<TlsAcceptor>,
    /// For dials to peers.
    pub dial: Option<TlsClient>,
}

impl std::fmt::Debug for ReplicaTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaTls")
            .field("accept", &self.accept.is_some())
            .field("dial", &self.dial.is_some())
            .finish()
    }
}

/// A byte stream to a replica: plain TCP or TLS over it.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + Sync {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + Sync> Stream for T {}

/// A request to a replica.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub enum Request<S: ReplicatedState> {
    /// Raft AppendEntries (also the heartbeat).
    Append(AppendEntriesRequest<C<S>>),
    /// Raft RequestVote.
    Vote(VoteRequest<ReplicaId>),
    /// One chunk of a Raft snapshot.
    Snapshot(InstallSnapshotRequest<C<S>>),
    /// A client's request.
    Client(ClientRequest<S>),
}

/// What a client may ask a replica.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub enum ClientRequest<S: ReplicatedState> {
    /// Append a command to the log and answer its reply once applied (leader only).
    Propose(S::Command),
    /// The state, read linearizably (leader only).
    Read,
    /// This replica's view of the group (any replica).
    Status,
    /// Add a non-voting member that starts catching up (leader only).
    AddLearner {
        /// Its id.
        id: ReplicaId,
        /// Its address.
        addr: SocketAddr,
    },
    /// Make exactly these replicas the voters (leader only; they must be members).
    ChangeMembership {
        /// The new voter set.
        voters: BTreeSet<ReplicaId>,
    },
}

/// A replica's answer to a client.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub enum ClientReply<S: ReplicatedState> {
    /// The proposed command was applied; its reply.
    Applied(S::Reply),
    /// The state and the log index it reflects.
    State {
        /// The state.
        state: S,
        /// The last applied log index.
        applied: Option<u64>,
    },
    /// This replica's status.
    Status(ReplicaStatus),
    /// A membership request completed.
    Done,
}

/// A replica's answer.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub enum Response<S: ReplicatedState> {
    /// Answer to `Append`.
    Append(Result<AppendEntriesResponse<ReplicaId>, RaftError<ReplicaId>>),
    /// Answer to `Vote`.
    Vote(Result<VoteResponse<ReplicaId>, RaftError<ReplicaId>>),
    /// Answer to `Snapshot`.
    Snapshot(
        Result<InstallSnapshotResponse<ReplicaId>, RaftError<ReplicaId, InstallSnapshotError>>,
    ),
    /// Answer to `Client`.
    Client(Result<ClientReply<S>, CoordError>),
}

/// An authenticated connection to one replica.
pub struct Conn {
    stream: Box<dyn Stream>,
}

impl Conn {
    /// Dials `addr` (through TLS if `tls` is given, the certificate checked against the
    /// address) and completes the handshake.
    pub async fn connect(
        addr: SocketAddr,
        key: &ClusterKey,
        tls: Option<&TlsClient>,
    ) -> Result<Conn, WireError> {
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| {
                WireError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connect to {addr} timed out"),
                ))
            })??;
        stream.set_nodelay(true)?;
        let stream: Box<dyn Stream> = match tls {
            None => Box::new(stream),
            Some(tls) => {
                let given = addr.to_string();
                let s = tokio::time::timeout(
                    wire::HANDSHAKE_TIMEOUT,
                    tls.connect(&given, addr, stream),
                )
                .await
                .map_err(|_| WireError::Timeout)??;
                Box::new(s)
            }
        };
        let mut conn = Conn { stream };
        wire::handshake_dial(&mut conn.stream, key).await?;
        Ok(conn)
    }

    /// Sends `req` and waits for its response.
    pub async fn call<S: ReplicatedState>(
        &mut self,
        req: &Request<S>,
    ) -> Result<Response<S>, WireError> {
        wire::write_msg(&mut self.stream, req).await?;
        wire::read_msg(&mut self.stream).await
    }
}

/// openraft's network factory: one `PeerClient` per target.
pub struct Network<S> {
    key: ClusterKey,
    tls: Option<TlsClient>,
    _s: PhantomData<fn() -> S>,
}

impl<S> Network<S> {
    /// A factory whose clients prove `key`, through TLS if `tls` is given.
    pub fn new(key: ClusterKey, tls: Option<TlsClient>) -> Self {
        Network {
            key,
            tls,
            _s: PhantomData,
        }
    }
}

/// Calls from this replica to one peer.
pub struct PeerClient<S> {
    target: ReplicaId,
    addr: Option<SocketAddr>,
    key: ClusterKey,
    tls: Option<TlsClient>,
    conn: Option<Conn>,
    _s: PhantomData<fn() -> S>,
}

enum CallError {
    /// Could not connect: back off.
    Unreachable(String),
    /// Failed mid-call: retry.
    Network(String),
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Msg(String);

impl CallError {
    fn into_rpc<E: std::error::Error>(self) -> RPCError<ReplicaId, BasicNode, E> {
        match self {
            CallError::Unreachable(m) => RPCError::Unreachable(Unreachable::new(&Msg(m))),
            CallError::Network(m) => RPCError::Network(NetworkError::new(&Msg(m))),
        }
    }
}

impl<S: ReplicatedState> PeerClient<S> {
    async fn call(&mut self, req: Request<S>, ttl: Duration) -> Result<Response<S>, CallError> {
        let Some(addr) = self.addr else {
            return Err(CallError::Unreachable(format!(
                "replica {} has no valid address",
                self.target
            )));
        };
        let run = async {
            if self.conn.is_none() {
                let c = Conn::connect(addr, &self.key, self.tls.as_ref())
                    .await
                    .map_err(|e| CallError::Unreachable(format!("{addr}: {e}")))?;
                self.conn = Some(c);
            }
            let Some(conn) = self.conn.as_mut() else {
                unreachable!("connected above");
            };
            conn.call(&req)
                .await
                .map_err(|e| CallError::Network(format!("{addr}: {e}")))
        };
        let out = match tokio::time::timeout(ttl, run).await {
            Ok(r) => r,
            Err(_) => Err(CallError::Network(format!("{addr}: no answer in {ttl:?}"))),
        };
        if out.is_err() {
            // A late answer must not be read as the next call's.
            self.conn = None;
        }
        out
    }

    fn unexpected<E: std::error::Error>(&self) -> RPCError<ReplicaId, BasicNode, E> {
        CallError::Network(format!(
            "replica {} answered the wrong message",
            self.target
        ))
        .into_rpc()
    }
}

impl<S: ReplicatedState> RaftNetworkFactory<C<S>> for Network<S> {
    type Network = PeerClient<S>;

    async fn new_client(&mut self, target: ReplicaId, node: &BasicNode) -> PeerClient<S> {
        PeerClient {
            target,
            addr: node.addr.parse().ok(),
            key: self.key,
            tls: self.tls.clone(),
            conn: None,
            _s: PhantomData,
        }
    }
}

impl<S: ReplicatedState> RaftNetwork<C<S>> for PeerClient<S> {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C<S>>,
        option: RPCOption,
    ) -> Result<
        AppendEntriesResponse<ReplicaId>,
        RPCError<ReplicaId, BasicNode, RaftError<ReplicaId>>,
    > {
        match self.call(Request::Append(rpc), option.hard_ttl()).await {
            Ok(Response::Append(Ok(r))) => Ok(r),
            Ok(Response::Append(Err(e))) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            Ok(_) => Err(self.unexpected()),
            Err(e) => Err(e.into_rpc()),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<C<S>>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<ReplicaId>,
        RPCError<ReplicaId, BasicNode, RaftError<ReplicaId, InstallSnapshotError>>,
    > {
        match self.call(Request::Snapshot(rpc), option.hard_ttl()).await {
            Ok(Response::Snapshot(Ok(r))) => Ok(r),
            Ok(Response::Snapshot(Err(e))) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            Ok(_) => Err(self.unexpected()),
            Err(e) => Err(e.into_rpc()),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<ReplicaId>,
        option: RPCOption,
    ) -> Result<VoteResponse<ReplicaId>, RPCError<ReplicaId, BasicNode, RaftError<ReplicaId>>> {
        match self.call(Request::Vote(rpc), option.hard_ttl()).await {
            Ok(Response::Vote(Ok(r))) => Ok(r),
            Ok(Response::Vote(Err(e))) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            Ok(_) => Err(self.unexpected()),
            Err(e) => Err(e.into_rpc()),
        }
    }
}

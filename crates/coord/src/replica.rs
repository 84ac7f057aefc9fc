//! A running replica: openraft over our log, state machine and transport, plus the
//! requests the rest of Kochab makes of it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{CheckIsLeaderError, ClientWriteError, InitializeError, RaftError};
use openraft::{BasicNode, ChangeMembers, Config, ServerState, SnapshotPolicy};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;

use crate::error::CoordError;
use crate::log_store::LogStore;
use crate::net::{ClientReply, ClientRequest, Network, ReplicaStatus, Request, Response};
use crate::sm_store::SmStore;
use crate::wire::{self, ClusterKey, WireError};
use crate::{Raft, ReplicaId, ReplicatedState};

/// Connections a replica serves at once (peers plus clients); more wait to be accepted.
pub const CONNECTIONS_MAX: usize = 256;

/// A connection with no request for this long is closed, so half-open connections from
/// vanished peers do not hold `CONNECTIONS_MAX` slots forever. Replication sends a
/// heartbeat every `heartbeat_ms`; a client's next call simply dials again.
pub const CONN_IDLE_MAX: Duration = Duration::from_secs(600);

/// Timing and log-size knobs. Short values suit tests on loopback; the defaults suit a
/// loaded machine, where a missed heartbeat must not start an election.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Leader heartbeat period.
    pub heartbeat_ms: u64,
    /// A follower that hears no leader for a random time in this range stands for election.
    pub election_min_ms: u64,
    /// Upper end of that range.
    pub election_max_ms: u64,
    /// A snapshot is taken after this many entries since the last one.
    pub snapshot_every_entries: u64,
    /// Entries kept in the log behind a snapshot (for followers slightly behind).
    pub entries_kept_after_snapshot: u64,
    /// How long a local `propose` or `read_state` waits for the group.
    pub request_timeout_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            heartbeat_ms: 100,
            election_min_ms: 500,
            election_max_ms: 1000,
            snapshot_every_entries: 1000,
            entries_kept_after_snapshot: 100,
            request_timeout_ms: 3000,
        }
    }
}

/// How to start a replica.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    /// This replica's id.
    pub id: ReplicaId,
    /// Where it listens for peers and clients.
    pub listen: SocketAddr,
    /// The initial group, id to address, this replica included (added if missing). Used
    /// only when `bootstrap` initializes a new group.
    pub peers: BTreeMap<ReplicaId, SocketAddr>,
    /// Its log, vote and snapshot live here.
    pub data_dir: PathBuf,
    /// The group's shared secret.
    pub key: ClusterKey,
    /// Initialize the group from `peers` if this replica's log is empty. Give it to one
    /// replica of a new group (giving it to all with the same `peers` is also safe).
    pub bootstrap: bool,
    /// Timing knobs.
    pub timing: Timing,
    /// TLS on its listener and its dials to peers (default: none).
    pub tls: crate::net::ReplicaTls,
}

/// What `subscribe` delivers: the applied state and whether this replica leads.
#[derive(Clone)]
pub struct CoordView<S> {
    /// The state as last applied here.
    pub state: Arc<S>,
    /// The last applied log index.
    pub last_applied: Option<u64>,
    /// Whether this replica believes it is the leader. A driver that acts only on the
    /// leader should still propose its decisions (a deposed leader's proposals fail).
    pub is_leader: bool,
    /// The leader this replica knows.
    pub leader: Option<ReplicaId>,
    /// Current term.
    pub term: u64,
}

struct Core<S: ReplicatedState> {
    id: ReplicaId,
    raft: Raft<S>,
    sm: SmStore<S>,
    timing: Timing,
}

/// A running replica. Dropping it without `shutdown` stops serving peers and clients at
/// once (no clean Raft shutdown; the disk is consistent, as after a crash).
pub struct Replica<S: ReplicatedState> {
    core: Arc<Core<S>>,
    listen: SocketAddr,
    view: watch::Receiver<CoordView<S>>,
    tasks: Vec<JoinHandle<()>>,
}

fn raft_config(t: &Timing) -> Result<Config, CoordError> {
    let c = Config {
        cluster_name: "kochab-coord".to_string(),
        heartbeat_interval: t.heartbeat_ms,
        election_timeout_min: t.election_min_ms,
        election_timeout_max: t.election_max_ms,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(t.snapshot_every_entries),
        max_in_snapshot_log_to_keep: t.entries_kept_after_snapshot,
        // Well under the wire's frame limit.
        snapshot_max_chunk_size: 1 << 20,
        ..Default::default()
    };
    c.validate()
        .map_err(|e| CoordError::Refused(format!("raft config: {e}")))
}

fn storage_err(what: &str, e: impl std::fmt::Display) -> CoordError {
    CoordError::Storage(format!("{what}: {e}"))
}

fn node(addr: SocketAddr) -> BasicNode {
    BasicNode {
        addr: addr.to_string(),
    }
}

fn forward(leader: Option<ReplicaId>, node: Option<&BasicNode>) -> CoordError {
    CoordError::NotLeader {
        leader,
        addr: node.and_then(|n| n.addr.parse().ok()),
    }
}

fn write_err(e: RaftError<ReplicaId, ClientWriteError<ReplicaId, BasicNode>>) -> CoordError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            forward(f.leader_id, f.leader_node.as_ref())
        }
        RaftError::APIError(ClientWriteError::ChangeMembershipError(m)) => {
            CoordError::Refused(m.to_string())
        }
        RaftError::Fatal(f) => CoordError::Stopped(f.to_string()),
    }
}

impl<S: ReplicatedState> Replica<S> {
    /// Opens the replica's storage (`data_dir/raft-log`: log segments, vote, purge mark;
    /// `data_dir/state`: snapshot), listens, starts Raft and, if asked, bootstraps the group.
    pub async fn start(cfg: ReplicaConfig) -> Result<Replica<S>, CoordError> {
        let rcfg = Arc::new(raft_config(&cfg.timing)?);
        let (log, recovered) = LogStore::<S>::open(&cfg.data_dir.join("raft-log"))
            .map_err(|e| storage_err("raft log", e))?;
        if recovered.torn_bytes > 0 {
            tracing::warn!(bytes = recovered.torn_bytes, "raft log had a torn tail");
        }
        let sm =
            SmStore::<S>::open(&cfg.data_dir.join("state")).map_err(|e| storage_err("state", e))?;
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| CoordError::Unavailable(format!("listen on {}: {e}", cfg.listen)))?;
        let listen = listener
            .local_addr()
            .map_err(|e| CoordError::Unavailable(e.to_string()))?;
        let raft = Raft::<S>::new(
            cfg.id,
            rcfg,
            Network::new(cfg.key, cfg.tls.dial.clone()),
            log,
            sm.clone(),
        )
        .await
        .map_err(|e| CoordError::Stopped(e.to_string()))?;
        let core = Arc::new(Core {
            id: cfg.id,
            raft,
            sm,
            timing: cfg.timing,
        });
        let mut tasks = vec![tokio::spawn(serve(
            listener,
            cfg.key,
            cfg.tls.accept.clone(),
            Arc::clone(&core),
        ))];
        let (view, merger) = spawn_view(&core);
        tasks.push(merger);
        if cfg.bootstrap {
            core.bootstrap(cfg.id, listen, &cfg.peers).await?;
        }
        Ok(Replica {
            core,
            listen,
            view,
            tasks,
        })
    }

    /// The address it listens on (useful with port 0).
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen
    }

    /// This replica's id.
    pub fn id(&self) -> ReplicaId {
        self.core.id
    }

    /// Appends `cmd` to the log and returns its reply once applied. Only the leader
    /// accepts; others answer `NotLeader` with the leader they know.
    pub async fn propose(&self, cmd: S::Command) -> Result<S::Reply, CoordError> {
        self.core.propose(cmd).await
    }

    /// The state, linearizable: reflects every command acknowledged before the call.
    /// Leader only.
    pub async fn read_state(&self) -> Result<S, CoordError> {
        self.core.read().await.map(|(s, _)| s)
    }

    /// The state as applied here, without asking the group (may be stale on a follower).
    pub fn local_state(&self) -> (S, Option<u64>) {
        self.core.sm.current()
    }

    /// Follows the applied state and leadership.
    pub fn subscribe(&self) -> watch::Receiver<CoordView<S>> {
        self.view.clone()
    }

    /// Adds a non-voting member and waits until it has caught up. Leader only.
    pub async fn add_learner(&self, id: ReplicaId, addr: SocketAddr) -> Result<(), CoordError> {
        self.core.add_learner(id, addr).await
    }

    /// Makes exactly `voters` the voting members (joint consensus inside). Leader only.
    pub async fn change_membership(&self, voters: BTreeSet<ReplicaId>) -> Result<(), CoordError> {
        self.core.change_membership(voters).await
    }

    /// Leader, term, indexes and members as this replica sees them.
    pub fn status(&self) -> ReplicaStatus {
        self.core.status()
    }

    /// Asks for a snapshot now (tests; the policy in `Timing` takes them otherwise).
    pub async fn trigger_snapshot(&self) -> Result<(), CoordError> {
        self.core
            .raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| CoordError::Stopped(e.to_string()))
    }

    /// Stops Raft and the listener.
    pub async fn shutdown(self) -> Result<(), CoordError> {
        for t in &self.tasks {
            t.abort();
        }
        self.core
            .raft
            .shutdown()
            .await
            .map_err(|e| CoordError::Stopped(e.to_string()))
    }
}

impl<S: ReplicatedState> Drop for Replica<S> {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl<S: ReplicatedState> Core<S> {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timing.request_timeout_ms)
    }

    async fn bootstrap(
        &self,
        id: ReplicaId,
        listen: SocketAddr,
        peers: &BTreeMap<ReplicaId, SocketAddr>,
    ) -> Result<(), CoordError> {
        let initialized = self
            .raft
            .is_initialized()
            .await
            .map_err(|e| CoordError::Stopped(e.to_string()))?;
        if initialized {
            return Ok(());
        }
        let mut members: BTreeMap<ReplicaId, BasicNode> =
            peers.iter().map(|(i, a)| (*i, node(*a))).collect();
        members.entry(id).or_insert_with(|| node(listen));
        match self.raft.initialize(members).await {
            Ok(()) => Ok(()),
            // Another replica's initialization reached us first: the group exists.
            Err(RaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
            Err(e) => Err(CoordError::Refused(format!("bootstrap: {e}"))),
        }
    }

    async fn propose(&self, mut cmd: S::Command) -> Result<S::Reply, CoordError> {
        S::stamp(&mut cmd);
        let res = tokio::time::timeout(self.timeout(), self.raft.client_write(cmd)).await;
        match res {
            Err(_) => Err(CoordError::Timeout(
                "the proposal was not committed in time (no quorum?)".to_string(),
            )),
            Ok(Err(e)) => Err(write_err(e)),
            Ok(Ok(resp)) => resp
                .data
                .ok_or_else(|| CoordError::Protocol("a command entry had no reply".to_string())),
        }
    }

    async fn read(&self) -> Result<(S, Option<u64>), CoordError> {
        let res = tokio::time::timeout(self.timeout(), self.raft.ensure_linearizable()).await;
        match res {
            Err(_) => Err(CoordError::Timeout(
                "leadership was not confirmed in time (no quorum?)".to_string(),
            )),
            Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)))) => {
                Err(forward(f.leader_id, f.leader_node.as_ref()))
            }
            Ok(Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(q)))) => {
                Err(CoordError::Timeout(q.to_string()))
            }
            Ok(Err(RaftError::Fatal(f))) => Err(CoordError::Stopped(f.to_string())),
            Ok(Ok(_)) => Ok(self.sm.current()),
        }
    }

    async fn add_learner(&self, id: ReplicaId, addr: SocketAddr) -> Result<(), CoordError> {
        self.raft
            .add_learner(id, node(addr), true)
            .await
            .map(|_| ())
            .map_err(write_err)
    }

    async fn change_membership(&self, voters: BTreeSet<ReplicaId>) -> Result<(), CoordError> {
        self.raft
            .change_membership(ChangeMembers::ReplaceAllVoters(voters), false)
            .await
            .map(|_| ())
            .map_err(write_err)
    }

    fn status(&self) -> ReplicaStatus {
        let m = self.raft.metrics().borrow().clone();
        let role = match m.state {
            ServerState::Leader => "Leader",
            ServerState::Follower => "Follower",
            ServerState::Candidate => "Candidate",
            ServerState::Learner => "Learner",
            ServerState::Shutdown => "Shutdown",
        };
        let mem = m.membership_config.membership();
        let voter_ids: BTreeSet<ReplicaId> = mem.voter_ids().collect();
        let mut voters = BTreeMap::new();
        let mut learners = BTreeMap::new();
        for (id, n) in mem.nodes() {
            if voter_ids.contains(id) {
                voters.insert(*id, n.addr.clone());
            } else {
                learners.insert(*id, n.addr.clone());
            }
        }
        ReplicaStatus {
            id: self.id,
            role: role.to_string(),
            leader: m.current_leader,
            term: m.current_term,
            last_log_index: m.last_log_index,
            last_applied: m.last_applied.map(|l| l.index),
            snapshot: m.snapshot.map(|l| l.index),
            purged: m.purged.map(|l| l.index),
            voters,
            learners,
        }
    }

    async fn handle(&self, req: Request<S>) -> Response<S> {
        match req {
            Request::Append(r) => Response::Append(self.raft.append_entries(r).await),
            Request::Vote(r) => Response::Vote(self.raft.vote(r).await),
            Request::Snapshot(r) => Response::Snapshot(self.raft.install_snapshot(r).await),
            Request::Client(c) => Response::Client(self.handle_client(c).await),
        }
    }

    async fn handle_client(&self, req: ClientRequest<S>) -> Result<ClientReply<S>, CoordError> {
        match req {
            ClientRequest::Propose(cmd) => self.propose(cmd).await.map(ClientReply::Applied),
            ClientRequest::Read => self
                .read()
                .await
                .map(|(state, applied)| ClientReply::State { state, applied }),
            ClientRequest::Status => Ok(ClientReply::Status(self.status())),
            ClientRequest::AddLearner { id, addr } => {
                self.add_learner(id, addr).await.map(|()| ClientReply::Done)
            }
            ClientRequest::ChangeMembership { voters } => self
                .change_membership(voters)
                .await
                .map(|()| ClientReply::Done),
        }
    }
}

fn spawn_view<S: ReplicatedState>(
    core: &Arc<Core<S>>,
) -> (watch::Receiver<CoordView<S>>, JoinHandle<()>) {
    let mut applied = core.sm.watch();
    let mut metrics = core.raft.metrics();
    let make = |a: &crate::sm_store::Applied<S>,
                m: &openraft::RaftMetrics<ReplicaId, BasicNode>| {
        CoordView {
            state: Arc::clone(&a.state),
            last_applied: a.last_applied,
            is_leader: m.state == ServerState::Leader,
            leader: m.current_leader,
            term: m.current_term,
        }
    };
    let first = make(&applied.borrow(), &metrics.borrow());
    let (tx, rx) = watch::channel(first);
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                r = applied.changed() => if r.is_err() { break },
                r = metrics.changed() => if r.is_err() { break },
            }
            let v = make(&applied.borrow_and_update(), &metrics.borrow_and_update());
            let changed = {
                let old = tx.borrow();
                !Arc::ptr_eq(&old.state, &v.state)
                    || old.is_leader != v.is_leader
                    || old.leader != v.leader
                    || old.term != v.term
            };
            if changed {
                tx.send_replace(v);
            }
        }
    });
    (rx, task)
}

async fn serve<S: ReplicatedState>(
    listener: TcpListener,
    key: ClusterKey,
    tls: Option<kochab_tls::TlsAcceptor>,
    core: Arc<Core<S>>,
) {
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    loop {
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "coord accept failed");
                continue;
            }
        };
        let core = Arc::clone(&core);
        let tls = tls.clone();
        tokio::spawn(async move {
            if let Err(e) = accept_conn(stream, key, tls, core).await {
                tracing::debug!(%peer, error = %e, "coord connection ended");
            }
            drop(permit);
        });
    }
}

/// TLS first if the listener has it (a plain connection then fails its handshake and is
/// closed), then [`serve_conn`].
async fn accept_conn<S: ReplicatedState>(
    stream: TcpStream,
    key: ClusterKey,
    tls: Option<kochab_tls::TlsAcceptor>,
    core: Arc<Core<S>>,
) -> Result<(), WireError> {
    stream.set_nodelay(true)?;
    match tls {
        None => serve_conn(stream, key, core).await,
        Some(acceptor) => {
            let s = tokio::time::timeout(wire::HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                .await
                .map_err(|_| WireError::Timeout)?
                .map_err(|e| {
                    WireError::Io(std::io::Error::new(
                        e.kind(),
                        format!("TLS handshake failed: {e}"),
                    ))
                })?;
            serve_conn(s, key, core).await
        }
    }
}

async fn serve_conn<S: ReplicatedState, T: crate::net::Stream>(
    mut stream: T,
    key: ClusterKey,
    core: Arc<Core<S>>,
) -> Result<(), WireError> {
    wire::handshake_accept(&mut stream, &key).await?;
    loop {
        let next = tokio::time::timeout(CONN_IDLE_MAX, wire::read_msg(&mut stream)).await;
        let Ok(next) = next else {
            return Ok(()); // idle too long
        };
        let req: Request<S> = match next {
            Ok(r) => r,
            Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let resp = core.handle(req).await;
        wire::write_msg(&mut stream, &resp).await?;
    }
}

/// Runs one replica until SIGINT or SIGTERM, then shuts it down. What `kochab coord` calls.
pub async fn run_replica_until_signal<S: ReplicatedState>(
    cfg: ReplicaConfig,
) -> Result<(), CoordError> {
    let replica = Replica::<S>::start(cfg).await?;
    tracing::info!(id = replica.id(), addr = %replica.listen_addr(), "coordinator replica running");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| CoordError::Stopped(format!("signal handler: {e}")))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("coordinator replica stopping");
    replica.shutdown().await
}

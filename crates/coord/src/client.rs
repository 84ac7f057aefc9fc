//! `CoordClient`: talks to a coordinator group given any of its replicas' addresses.
//!
//! It asks the replica it believes leads, follows `NotLeader` hints, tries the others when
//! one is down or has no leader, and gives up after a budget that covers an election. A
//! proposal that times out or loses its connection is retried, so the same command may
//! be applied twice: commands must carry an idempotency id the state deduplicates.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::error::CoordError;
use crate::net::ReplicaStatus;
use crate::net::{ClientReply, ClientRequest, Conn, Request, Response};
use crate::wire::{ClusterKey, WireError};
use crate::{ReplicaId, ReplicatedState};

/// Pause before trying again when no replica knows a leader (an election is running).
pub const NO_LEADER_PAUSE: Duration = Duration::from_millis(50);

/// How a client reaches the group.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Any replicas' addresses (one suffices; others are learned from hints).
    pub addrs: Vec<SocketAddr>,
    /// The group's shared secret.
    pub key: ClusterKey,
    /// Total time one request may take, retries included. Covers an election.
    pub budget: Duration,
    /// Time one attempt may take before the client tries elsewhere.
    pub attempt_timeout: Duration,
    /// TLS to the replicas (their certificates must name the addresses dialed); plain
    /// TCP if `None`.
    pub tls: Option<kochab_tls::TlsClient>,
}

impl ClientConfig {
    /// Defaults: 5 s budget, 1.5 s per attempt.
    pub fn new(addrs: Vec<SocketAddr>, key: ClusterKey) -> ClientConfig {
        ClientConfig {
            addrs,
            key,
            budget: Duration::from_secs(5),
            attempt_timeout: Duration::from_millis(1500),
            tls: None,
        }
    }
}

struct Route {
    /// Addresses to try, the configured ones plus any learned.
    addrs: Vec<SocketAddr>,
    /// The one to try next.
    next: usize,
    conn: Option<(SocketAddr, Conn)>,
}

/// A client of a coordinator group.
pub struct CoordClient<S: ReplicatedState> {
    cfg: ClientConfig,
    route: Mutex<Route>,
    _s: std::marker::PhantomData<fn() -> S>,
}

fn wire_err(addr: SocketAddr, e: WireError) -> CoordError {
    match e {
        WireError::Auth(m) => CoordError::Auth(format!("{addr}: {m}")),
        WireError::Malformed(m) => CoordError::Protocol(format!("{addr}: {m}")),
        other => CoordError::Unavailable(format!("{addr}: {other}")),
    }
}

impl<S: ReplicatedState> CoordClient<S> {
    /// A client; connects lazily.
    pub fn new(cfg: ClientConfig) -> CoordClient<S> {
        let addrs = cfg.addrs.clone();
        CoordClient {
            cfg,
            route: Mutex::new(Route {
                addrs,
                next: 0,
                conn: None,
            }),
            _s: std::marker::PhantomData,
        }
    }

    /// Proposes `cmd` to the leader and returns its reply once applied.
    pub async fn propose(&self, cmd: S::Command) -> Result<S::Reply, CoordError> {
        match self.routed(ClientRequest::Propose(cmd)).await? {
            ClientReply::Applied(r) => Ok(r),
            _ => Err(CoordError::Protocol(
                "wrong reply to a proposal".to_string(),
            )),
        }
    }

    /// The state, read linearizably through the leader, and its applied index.
    pub async fn read_state(&self) -> Result<(S, Option<u64>), CoordError> {
        match self.routed(ClientRequest::Read).await? {
            ClientReply::State { state, applied } => Ok((state, applied)),
            _ => Err(CoordError::Protocol("wrong reply to a read".to_string())),
        }
    }

    /// Adds a learner through the leader (waits for it to catch up).
    pub async fn add_learner(&self, id: ReplicaId, addr: SocketAddr) -> Result<(), CoordError> {
        match self.routed(ClientRequest::AddLearner { id, addr }).await? {
            ClientReply::Done => Ok(()),
            _ => Err(CoordError::Protocol(
                "wrong reply to add_learner".to_string(),
            )),
        }
    }

    /// Makes exactly `voters` the voting members, through the leader.
    pub async fn change_membership(&self, voters: BTreeSet<ReplicaId>) -> Result<(), CoordError> {
        match self
            .routed(ClientRequest::ChangeMembership { voters })
            .await?
        {
            ClientReply::Done => Ok(()),
            _ => Err(CoordError::Protocol(
                "wrong reply to change_membership".to_string(),
            )),
        }
    }

    /// Asks one replica for its status (no routing, one attempt).
    pub async fn status_of(&self, addr: SocketAddr) -> Result<ReplicaStatus, CoordError> {
        let run = async {
            let mut conn = Conn::connect(addr, &self.cfg.key, self.cfg.tls.as_ref())
                .await
                .map_err(|e| wire_err(addr, e))?;
            let req = Request::<S>::Client(ClientRequest::Status);
            match conn.call(&req).await.map_err(|e| wire_err(addr, e))? {
                Response::Client(Ok(ClientReply::Status(s))) => Ok(s),
                Response::Client(Err(e)) => Err(e),
                _ => Err(CoordError::Protocol(format!(
                    "{addr}: wrong reply to status"
                ))),
            }
        };
        match tokio::time::timeout(self.cfg.attempt_timeout, run).await {
            Ok(r) => r,
            Err(_) => Err(CoordError::Timeout(format!("{addr}: no status answer"))),
        }
    }

    /// The status of every configured replica, in order.
    pub async fn statuses(&self) -> Vec<(SocketAddr, Result<ReplicaStatus, CoordError>)> {
        let mut out = Vec::with_capacity(self.cfg.addrs.len());
        for &a in &self.cfg.addrs {
            out.push((a, self.status_of(a).await));
        }
        out
    }

    /// Sends `req` to the leader, following hints and retrying within the budget.
    async fn routed(&self, req: ClientRequest<S>) -> Result<ClientReply<S>, CoordError> {
        if self.cfg.addrs.is_empty() {
            return Err(CoordError::Unavailable("no replica addresses".to_string()));
        }
        let deadline = Instant::now() + self.cfg.budget;
        let req = Request::Client(req);
        let mut route = self.route.lock().await;
        let mut last = CoordError::Timeout("no attempt finished".to_string());
        let mut tried_without_leader = 0usize;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(CoordError::Timeout(format!(
                    "gave up after {:?}; last error: {last}",
                    self.cfg.budget
                )));
            }
            let addr = route.addrs[route.next % route.addrs.len()];
            let left = deadline - now;
            let attempt = tokio::time::timeout(
                self.cfg.attempt_timeout.min(left),
                attempt(&mut route, addr, &self.cfg, &req),
            )
            .await;
            let err = match attempt {
                Ok(Ok(reply)) => return Ok(reply),
                Ok(Err(e)) => e,
                Err(_) => CoordError::Timeout(format!("{addr}: no answer in time")),
            };
            if !matches!(err, CoordError::NotLeader { addr: Some(_), .. }) {
                // The connection may hold a late answer; start afresh.
                route.conn = None;
            }
            match &err {
                CoordError::NotLeader {
                    addr: Some(leader), ..
                } if *leader != addr => {
                    let pos = match route.addrs.iter().position(|a| a == leader) {
                        Some(p) => p,
                        None => {
                            route.addrs.push(*leader);
                            route.addrs.len() - 1
                        }
                    };
                    route.next = pos;
                    tried_without_leader = 0;
                }
                e if e.is_retryable() => {
                    route.next = (route.next + 1) % route.addrs.len();
                    tried_without_leader += 1;
                    // Once every replica was asked, wait for the election to progress.
                    if tried_without_leader >= route.addrs.len() {
                        tried_without_leader = 0;
                        tokio::time::sleep(NO_LEADER_PAUSE.min(left)).await;
                    }
                }
                _ => return Err(err),
            }
            last = err;
        }
    }
}

async fn attempt<S: ReplicatedState>(
    route: &mut Route,
    addr: SocketAddr,
    cfg: &ClientConfig,
    req: &Request<S>,
) -> Result<ClientReply<S>, CoordError> {
    if route.conn.as_ref().is_none_or(|(a, _)| *a != addr) {
        route.conn = None;
        let c = Conn::connect(addr, &cfg.key, cfg.tls.as_ref())
            .await
            .map_err(|e| wire_err(addr, e))?;
        route.conn = Some((addr, c));
    }
    let Some((_, conn)) = route.conn.as_mut() else {
        unreachable!("connected above");
    };
    match conn.call(req).await.map_err(|e| wire_err(addr, e))? {
        Response::Client(r) => r,
        _ => Err(CoordError::Protocol(format!(
            "{addr}: answered a client with a peer message"
        ))),
    }
}

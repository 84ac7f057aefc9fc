//! The Kochab client library: a pool of multiplexed connections, safe retries, path
//! resolution and one method per file-system operation.
//!
//! Retries are safe because every non-idempotent request carries a sequence number that the
//! server's reply cache remembers: a create whose reply was lost is answered from the cache
//! on retry instead of failing with EEXIST.

mod closes;
pub mod complete;
pub mod conn;
pub mod dircache;
pub mod direct;
mod lane;
mod pool;
pub mod replay;
pub mod routing;
pub use kochab_tls as tls;

use conn::{ConnError, ConnEvents};
use dircache::DirCache;
use kochab_cluster::router::{Retries, Retry, RetryPolicy};
use kochab_proto::auth::ClientKey;
use kochab_proto::cluster::DelegationMap;
use kochab_proto::links::{InodeLinks, LinksCursor, LinksPage};
use kochab_proto::*;
use parking_lot::Mutex;
use pool::Pool;
use replay::{ReplayLog, Unsafe};
use routing::{Routing, Step};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use kochab_proto as proto;
pub use lane::set_lane;

/// Most symlinks followed while resolving one path (Linux's limit).
pub const SYMLINK_FOLLOW_MAX: u32 = 40;

/// Requests answered early and not yet durable that one client keeps at most; a client
/// at the limit waits for durability reports before it sends more (a slow journal slows
/// its writers instead of growing the log and the servers' reply caches).
const UNSAFE_MAX: usize = 4096;

/// Pause between attempts to replay to a server that cannot be reached yet.
const REPLAY_RETRY: Duration = Duration::from_millis(200);

/// Bytes of written data a client keeps at most in requests answered early (writes are
/// replayed with their data, see `replay`); past it writers wait for durability reports,
/// as at `UNSAFE_MAX`. About a hundred 1 MiB write-behind requests: a journal lags a
/// few milliseconds, which is a few MiB of writes at full speed.
const UNSAFE_BYTES_MAX: usize = 64 << 20;

tokio::task_local! {
    /// Set while a replay runs: its own requests (the replayed change, the reopen of its
    /// handle) go out without waiting for replays, which they are part of.
    static IN_REPLAY: ();
}

/// True unless the current task is replaying.
fn outside_replay() -> bool {
    IN_REPLAY.try_with(|_| ()).is_err()
}

/// Times a handle operation reopens its handle where the server does not know it (each a
/// server restart or a table move while the operation is retried) before it fails.
const REOPEN_TRIES: u32 = 8;
/// Handles whose lost commits are remembered at most until reported: one per handle that
/// wrote through a lost server, so a few; the bound only keeps a client that never
/// closes from growing without end (past it the loss is still logged).
const LOST_COMMITS_MAX: usize = 1 << 16;

/// Attempts of a request a single server answers WRONG_SERVER before the client asks it
/// for a map (it became one of many).
const WRONG_SERVER_TRIES: u32 = 3;

/// How a client behaves.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Entry addresses: any of the cluster's servers (each hands out the map). The first
    /// that answers is asked for the delegation map; the others are where a map is fetched
    /// again when the cached one is stale.
    pub entries: Vec<SocketAddr>,
    /// The key and its id (the cluster key is id 0; `kochab key add` makes others).
    pub key: ClientKey,
    /// Connections in the pool; requests are spread over them.
    pub connections: usize,
    /// Time one attempt may take before it is retried.
    pub request_timeout: Duration,
    /// Most attempts per request (the first included) against a single server; the retry
    /// budget bounds them too.
    pub attempts: u32,
    /// How long a request keeps retrying after its first failed attempt (a server that
    /// cannot be reached, a connection lost, no reply in time, a table in flight): long
    /// enough to ride out a restart or a failover. The mount's is longer (`-o
    /// retry=SECONDS`): applications see a server that comes back only as a delay.
    pub retry_budget: Duration,
    /// A delegation map to start from, for servers that do not hand one out yet.
    pub map: Option<DelegationMap>,
    /// Time to connect and authenticate.
    pub connect_timeout: Duration,
    /// TLS to the server (`--tls-ca`); plain TCP if `None`.
    pub tls: Option<tls::TlsClient>,
    /// The entries as they were given ("host:port", in the order of `entries`; see
    /// [`ClientConfig::named`]): they are dialed by that name and a TLS server's
    /// certificate must name its host. Empty: the entries' addresses.
    pub entry_names: Vec<String>,
    /// Ask for early replies (docs/ARCHITECTURE.md, "Early replies"): a change is
    /// acknowledged once applied at its server, kept by the client until the server
    /// reports it durable, and replayed if that server restarts first. The mount's
    /// default; off (durable replies) for the library and the CLI.
    pub early_replies: bool,
    /// Ask for leases on what replies show (docs/ARCHITECTURE.md, "Coherent caching
    /// between mounts"): the servers then call this client back (see
    /// [`Client::on_callback`]) before another client's change to it becomes visible. The
    /// mount's default; off for the library and the CLI, which cache nothing.
    pub leases: bool,
}

impl ClientConfig {
    /// A configuration for `key`: a [`ClientKey`], or a bare cluster key (the admin key).
    pub fn new(addr: SocketAddr, key: impl Into<ClientKey>) -> ClientConfig {
        ClientConfig::with_entries(vec![addr], key)
    }

    /// A configuration with several entry addresses (any servers of one cluster).
    pub fn with_entries(entries: Vec<SocketAddr>, key: impl Into<ClientKey>) -> ClientConfig {
        ClientConfig {
            entries,
            key: key.into(),
            connections: 2,
            request_timeout: Duration::from_secs(15),
            attempts: u32::MAX,
            retry_budget: Duration::from_millis(kochab_cluster::router::RETRY_BUDGET_MS),
            map: None,
            connect_timeout: Duration::from_secs(5),
            tls: None,
            entry_names: Vec::new(),
            early_replies: false,
            leases: false,
        }
    }

    /// A configuration for the comma-separated "host:port" entries of `spec`, each
    /// resolved now (an unknown host fails here) and kept as given: a TLS server's
    /// certificate must then name the host given (`localhost`), not only the address it
    /// resolves to.
    pub fn named(spec: &str, key: impl Into<ClientKey>) -> FsResult<ClientConfig> {
        let named = resolve_named(spec)?;
        let mut cfg =
            ClientConfig::with_entries(named.iter().map(|(_, a)| *a).collect(), key.into());
        cfg.entry_names = named.into_iter().map(|(n, _)| n).collect();
        Ok(cfg)
    }

    /// The entries as the pool dials them: as given, or as resolved.
    fn entry_addrs(&self) -> Vec<String> {
        if self.entry_names.len() == self.entries.len() {
            return self.entry_names.clone();
        }
        self.entries.iter().map(|a| a.to_string()).collect()
    }
}

/// Reads a key file (`HEX` for the cluster key, `ID:HEX` for a client key), refusing one
/// that group or others may read or write: a key readable by others is a key given away.
pub fn read_key_file(path: &std::path::Path) -> std::io::Result<ClientKey> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::PermissionsExt;
    let f = std::fs::File::open(path)?;
    let mode = f.metadata()?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "{} has mode {mode:o}: group or others may read it; chmod 600 it (and \
                 consider the key disclosed)",
                path.display()
            ),
        ));
    }
    let text = std::io::read_to_string(f)?;
    kochab_proto::auth::client_key_from_text(&text).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidData,
            format!("{} holds no key (HEX or ID:HEX)", path.display()),
        )
    })
}

/// Writes a key file, mode 0600, refusing to replace an existing file.
pub fn write_key_file(path: &std::path::Path, key: &ClientKey) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    writeln!(f, "{}", kochab_proto::auth::client_key_to_text(key))?;
    f.sync_all()
}

/// Resolves "host:port" to one address.
pub fn resolve_addr(s: &str) -> FsResult<SocketAddr> {
    s.to_socket_addrs()
        .map_err(|e| fs_err!(EINVAL, "cannot resolve {s:?}: {e}"))?
        .next()
        .ok_or_else(|| fs_err!(EINVAL, "{s:?} resolves to no address"))
}

/// Resolves a comma-separated list of "host:port" entry addresses.
pub fn resolve_addrs(s: &str) -> FsResult<Vec<SocketAddr>> {
    Ok(resolve_named(s)?.into_iter().map(|(_, a)| a).collect())
}

/// [`resolve_addrs`], each address with its text as given.
pub fn resolve_named(s: &str) -> FsResult<Vec<(String, SocketAddr)>> {
    let addrs = s
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|a| Ok((a.to_string(), resolve_addr(a)?)))
        .collect::<FsResult<Vec<_>>>()?;
    if addrs.is_empty() {
        return Err(fs_err!(EINVAL, "no address in {s:?}"));
    }
    Ok(addrs)
}

/// The open(2) flags a reopen must not repeat: it reopens an existing file as it is.
const REOPEN_STRIP: u32 = 0o1000 | 0o100 | 0o200; // O_TRUNC | O_CREAT | O_EXCL

/// open(2)'s O_WRONLY: how a replay reopens a handle the application has closed since.
const O_WRONLY: u32 = 0o1;

/// An open handle, remembered to route its operations (by the inode it was opened on) and
/// to reopen it where it is not known (a restarted server, or a table that moved).
#[derive(Clone)]
struct Handle {
    id: InodeId,
    flags: u32,
    cred: Credentials,
    /// Servers the handle was opened on: a close goes to each.
    servers: Vec<Arc<str>>,
}

struct Inner {
    config: ClientConfig,
    pool: Pool,
    routing: Mutex<Routing>,
    seq: AtomicU64,
    /// Sequence numbers whose replies have not arrived; the smallest is the floor the
    /// server may forget below.
    in_flight: Mutex<std::collections::BTreeSet<u64>>,
    handles: Mutex<rustc_hash::FxHashMap<u64, Handle>>,
    next_handle: AtomicU64,
    client_id: u64,
    /// The entry server that answered at connect: `status` reports on it.
    home: Arc<str>,
    /// Held while a map is fetched.
    fetching: tokio::sync::Mutex<()>,
    root: Mutex<InodeId>,
    /// Directories this client just changed, as the servers' replies left them.
    dirs: Mutex<DirCache>,
    /// Requests answered early, until durable (shared with the connections).
    early: Arc<Early>,
    /// Held while lost processes are looked at and their requests replayed.
    replaying: tokio::sync::Mutex<()>,
    /// How long the servers' leases last (zero: this client asked for none).
    lease: Duration,
    /// Closes waiting to go to their servers together (see `closes`).
    closes: closes::Gathered<Handle>,
    /// Per handle, the first commit of slices answered early whose replay failed for good
    /// (its server was lost and the new one refused it, e.g. its token had expired): the
    /// data is lost, and the next fsync or close of the handle says so.
    lost_commits: Mutex<rustc_hash::FxHashMap<u64, FsError>>,
}

/// What a client that holds leases is told to drop; answered when the
/// [`conn::CallbackAnswer`] is dropped.
pub type CallbackHandler = Arc<dyn Fn(Vec<Invalidation>, conn::CallbackAnswer) + Send + Sync>;

/// The early-reply state the connections report to (and where callbacks go).
#[derive(Default)]
struct Early {
    /// Told what to drop from the cache (see [`Client::on_callback`]).
    callbacks: Mutex<Option<CallbackHandler>>,
    log: Mutex<ReplayLog>,
    /// Wakes whoever waits for durability (fsync) or for room in the log.
    changed: tokio::sync::Notify,
    /// Wakes the replayer: a connection with kept requests was lost, or the client ended.
    lost: tokio::sync::Notify,
    /// Directories whose every name this client knows (see `complete`); callbacks reach
    /// them here, before the handler runs.
    complete: Mutex<complete::CompleteDirs>,
}

impl ConnEvents for Early {
    fn durable(&self, incarnation: u64, lsn: u64) {
        self.log.lock().durable(incarnation, lsn);
        self.changed.notify_waiters();
    }

    fn callback(&self, list: Vec<Invalidation>, answer: conn::CallbackAnswer) {
        {
            let mut complete = self.complete.lock();
            for what in &list {
                complete.called_back(match what {
                    Invalidation::Entry { parent, .. } => Some(*parent),
                    Invalidation::Inode { id } => Some(*id),
                    Invalidation::Names { dir } => Some(*dir),
                    Invalidation::Everything => None,
                    // Drop nothing.
                    Invalidation::Flush { .. } | Invalidation::Hold { .. } => continue,
                });
            }
        }
        self.callback_to_handler(list, answer);
    }

    fn lost(&self, incarnation: u64) {
        // The server forgets the leases of a client whose connection ended: drop all.
        self.complete.lock().called_back(None);
        let handler = self.callbacks.lock().clone();
        if let Some(h) = handler {
            h(vec![Invalidation::Everything], conn::CallbackAnswer::none());
        }
        let suspect = {
            let mut log = self.log.lock();
            log.lost(incarnation);
            log.has_suspects()
        };
        if suspect {
            self.lost.notify_one();
        }
    }
}

impl Early {
    fn callback_to_handler(&self, list: Vec<Invalidation>, answer: conn::CallbackAnswer) {
        let handler = self.callbacks.lock().clone();
        match handler {
            Some(h) => h(list, answer),
            None => drop(answer),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The replayer task ends with the client.
        self.early.lost.notify_one();
    }
}

/// A client of one cluster. Cheap to clone; clones share connections and the client id.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

/// How one attempt at one server ended.
enum Outcome {
    Reply(Reply),
    /// The server's answer is an error: the request's result.
    Error(FsError),
    /// The server refused this client (bad key, revoked key): nowhere else will differ.
    Refused(FsError),
    WrongServer {
        map_version: u64,
        owner: Option<kochab_proto::cluster::ServerId>,
        addr: Option<String>,
    },
    /// No answer: not reachable, connection lost, no reply in time, or stopping.
    Unreachable(FsError),
}

/// How a request to a single server failed.
enum SingleError {
    /// Its last attempt was answered WRONG_SERVER: the server is one of many.
    WrongServer(FsError),
    Other(FsError),
}

impl From<SingleError> for FsError {
    fn from(e: SingleError) -> FsError {
        match e {
            SingleError::WrongServer(e) | SingleError::Other(e) => e,
        }
    }
}

/// Looks at lost server processes and replays what they answered early, whenever a
/// connection with kept requests is lost (and again every `REPLAY_RETRY` while some
/// cannot be replayed yet); ends with the client.
async fn replayer(inner: std::sync::Weak<Inner>) {
    loop {
        let early = match inner.upgrade() {
            Some(i) => i.early.clone(),
            None => return,
        };
        if early.log.lock().has_suspects() {
            tokio::time::sleep(REPLAY_RETRY).await;
        } else {
            early.lost.notified().await;
        }
        drop(early);
        let Some(inner) = inner.upgrade() else {
            return;
        };
        Client { inner }.replay_lost().await;
    }
}

impl Client {
    /// Connects to the cluster through the first entry address that answers (one
    /// connection, to check the key), and asks it for the delegation map: a server that
    /// has none (a single server) then serves every request, as it always did.
    pub async fn connect(config: ClientConfig) -> FsResult<Client> {
        if config.entries.is_empty() {
            return Err(fs_err!(EINVAL, "no server address given"));
        }
        let early = Arc::new(Early::default());
        let pool = Pool::new(
            pool::Dial {
                key: config.key,
                client_id: kochab_proto::auth::random_u64(),
                timeout: config.connect_timeout,
                tls: config.tls.clone(),
                events: Some(early.clone()),
                leases: config.leases,
            },
            config.connections,
        );
        // Every entry in turn, again and again while none can be reached (a server that
        // restarts refuses connections for a moment), within the retry budget (at most
        // the cluster's, so that a mount of a cluster that is not there fails in seconds).
        let budget = config.retry_budget.min(Duration::from_millis(
            kochab_cluster::router::RETRY_BUDGET_MS,
        ));
        let started = Instant::now();
        let mut retries = Retries::since(
            routing::restart_policy(budget.as_millis() as u64, u32::MAX),
            0,
        );
        let (addr, conn) = 'found: loop {
            let mut last = fs_err!(ENOTCONN, "no server address given");
            for e in config.entry_addrs() {
                let addr: Arc<str> = e.into();
                match pool.conn(&addr).await {
                    Ok(c) => break 'found (addr, c),
                    Err(e) if e.errno == Errno::ENOTCONN => last = e,
                    Err(e) => return Err(e),
                }
            }
            match retries.failed(started.elapsed().as_millis() as u64) {
                Retry::GiveUp => return Err(last),
                Retry::After { delay_ms } => {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await
                }
            }
        };
        let probe = tokio::time::timeout(
            config.request_timeout,
            conn.call(&Request::plain(&Credentials::root(), Op::GetMap)),
        )
        .await;
        let served = match probe {
            Ok(Ok(Reply::Map(m))) if !m.tables.is_empty() => Some(m),
            _ => None,
        };
        let entries = config.entry_addrs();
        let routing = match (config.map.clone(), served) {
            (Some(given), served) => {
                let mut r = Routing::cluster(entries, given);
                if let Some(m) = served {
                    r.on_map(m);
                }
                r
            }
            (None, Some(m)) => Routing::cluster(entries, m),
            (None, None) => Routing::Single { addr: addr.clone() },
        };
        early.complete.lock().set_lease(conn.lease);
        let inner = Arc::new(Inner {
            client_id: pool.client_id(),
            home: addr,
            fetching: tokio::sync::Mutex::new(()),
            pool,
            routing: Mutex::new(routing),
            seq: AtomicU64::new(1),
            in_flight: Mutex::new(Default::default()),
            handles: Mutex::new(Default::default()),
            next_handle: AtomicU64::new(1),
            root: Mutex::new(conn.root),
            lease: conn.lease,
            dirs: Mutex::new(if conn.lease.is_zero() {
                DirCache::default()
            } else {
                DirCache::new(conn.lease)
            }),
            config,
            early,
            replaying: tokio::sync::Mutex::new(()),
            closes: Default::default(),
            lost_commits: Mutex::new(Default::default()),
        });
        tokio::spawn(replayer(Arc::downgrade(&inner)));
        Ok(Client { inner })
    }

    /// How long a lease lasts from the moment a server handles the request whose reply
    /// grants it (zero if this client asked for none, see `ClientConfig::leases`).
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// Sets what is told to drop cached names and inodes: another client's change to them
    /// waits until the handler drops its answer (at most `conn::CALLBACK_ANSWER_MAX`).
    /// When a connection that held leases ends, the handler is told `Everything`.
    pub fn on_callback(&self, handler: CallbackHandler) {
        *self.inner.early.callbacks.lock() = Some(handler);
    }

    /// The root directory's id.
    pub fn root(&self) -> InodeId {
        *self.inner.root.lock()
    }

    /// This client's id (keys the server's reply cache).
    pub fn client_id(&self) -> u64 {
        self.inner.client_id
    }

    /// True if requests are routed by a delegation map (many servers), false if one server
    /// serves them all.
    pub fn routes_by_map(&self) -> bool {
        self.inner.routing.lock().is_cluster()
    }

    /// The version of the cached delegation map (0: none, or a single server).
    pub fn map_version(&self) -> u64 {
        self.inner.routing.lock().map_version()
    }

    /// Sends one operation and returns the reply, retrying lost or slow attempts with the
    /// same sequence number. Errors from the server come back as `Err`.
    pub async fn call(&self, cred: &Credentials, op: Op) -> FsResult<Reply> {
        let target = self.target_of(&op);
        Ok(self.call_at(cred, op, target).await?.0)
    }

    /// The inode a request is routed by: the first it names, for a handle operation the
    /// inode the handle was opened on, else the root (its server answers for the cluster).
    fn target_of(&self, op: &Op) -> InodeId {
        let id = match op.handle() {
            Some(h) => self.inner.handles.lock().get(&h).map(|h| h.id),
            None => op.inode_ids()[0],
        };
        id.unwrap_or_else(|| self.root())
    }

    /// [`Client::call`] routed by inode `target`; also says which server answered.
    async fn call_at(
        &self,
        cred: &Credentials,
        op: Op,
        target: InodeId,
    ) -> FsResult<(Reply, Arc<str>)> {
        // Reads change no directory: they skip the cache's lock.
        let ticket = if op.is_read_only() {
            None
        } else {
            self.inner.dirs.lock().begin(&op)
        };
        let sent = Instant::now();
        // Ended however this call ends, cancellation included.
        let mut guard = DirsGuard {
            inner: &self.inner,
            ticket,
            dirs: Vec::new(),
            sent,
        };
        let mut names = self.begin_names(&op, sent);
        let result = self
            .call_once(cred, op, target)
            .await
            .and_then(|(reply, addr)| reply.check_attrs().map(|()| (reply, addr)));
        if let Some(n) = names.as_mut() {
            n.end(result.as_ref().map(|(reply, _)| reply));
        }
        let (reply, addr) = result?;
        match reply {
            Reply::WithDirs { reply, dirs } => {
                guard.dirs = dirs;
                Ok((*reply, addr))
            }
            reply => Ok((reply, addr)),
        }
    }

    /// Notes an operation about to be sent that may change or read names (see `complete`).
    fn begin_names(&self, op: &Op, sent: Instant) -> Option<NamesGuard<'_>> {
        if self.inner.lease.is_zero() {
            return None;
        }
        let change = complete::Change::of(op)?;
        Some(NamesGuard {
            early: &self.inner.early,
            seen: self.inner.early.complete.lock().seen(),
            change: Some(change),
            sent,
        })
    }

    /// How long `name` is known to be absent from directory `dir`, if this client knows
    /// every name in it (a directory it made, see `complete`): then a lookup of the name
    /// needs no round trip.
    pub fn known_absent(&self, dir: InodeId, name: &[u8]) -> Option<Duration> {
        self.ask_complete(|c, now| c.absent(dir, name, now))
    }

    /// How long directory `dir` is known to hold `name`, if this client knows every name
    /// in it (see `complete`; a hash of the name is kept, so the caller must know by other
    /// means which inode the name is).
    pub fn known_present(&self, dir: InodeId, name: &[u8]) -> Option<Duration> {
        self.ask_complete(|c, now| c.present(dir, name, now))
    }

    /// Asks the complete directories (none without leases).
    fn ask_complete(
        &self,
        ask: impl FnOnce(&complete::CompleteDirs, Instant) -> Option<Duration>,
    ) -> Option<Duration> {
        if self.inner.lease.is_zero() {
            return None;
        }
        ask(&self.inner.early.complete.lock(), Instant::now())
    }

    /// Forgets what this client knows of directory `id`'s attributes from its own changes
    /// (`None`: of every directory): a callback said another client changed it.
    pub fn forget_dir_attr(&self, id: Option<InodeId>) {
        self.inner.dirs.lock().forget(id);
    }

    /// The attributes of directory `id` as this client's last change to it left them, if
    /// that was sent less than `max_age` ago (and at most 1 s, or the lease with leases),
    /// with the time they stay good.
    pub fn recent_dir_attr(&self, id: InodeId, max_age: Duration) -> Option<(Attr, Duration)> {
        self.inner.dirs.lock().get(id, max_age, Instant::now())
    }

    async fn call_once(
        &self,
        cred: &Credentials,
        op: Op,
        target: InodeId,
    ) -> FsResult<(Reply, Arc<str>)> {
        if !op.needs_reply_cache() {
            return self.send(&mut Request::plain(cred, op), target).await;
        }
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let seq_floor = {
            let kept = self.inner.early.log.lock().min_seq();
            let mut f = self.inner.in_flight.lock();
            f.insert(seq);
            let first = f.first().copied().unwrap_or(seq);
            kept.map_or(first, |k| k.min(first))
        };
        // Removed from the in-flight set however this call ends, cancellation included.
        let _done = InFlight {
            inner: &self.inner,
            seq,
        };
        // The same seq on every attempt, at whichever server: the reply cache (which moves
        // with a table) answers a retry of a change that already ran.
        let mut req = Request {
            cred: cred.clone(),
            seq,
            seq_floor,
            map_version: 0,
            mode: Default::default(),
            op,
        };
        self.send(&mut req, target).await
    }

    /// Sends `req` about inode `target` to the server that serves it, retrying; returns the
    /// reply and the server that gave it.
    async fn send(&self, req: &mut Request, target: InodeId) -> FsResult<(Reply, Arc<str>)> {
        if !matches!(req.mode, ReplyMode::Replay { .. }) {
            // Boxed: replays are sent through here too (not recursively at run time).
            Box::pin(self.before_send(req)).await;
        }
        self.route(req, target).await
    }

    /// [`Client::send`] without what every new request does first (a replay's own helper
    /// requests, such as the reopen of a handle, go straight out).
    async fn route(&self, req: &mut Request, target: InodeId) -> FsResult<(Reply, Arc<str>)> {
        let single = match &*self.inner.routing.lock() {
            Routing::Single { addr } => Some(addr.clone()),
            Routing::Cluster(_) => None,
        };
        match single {
            Some(addr) => match self.send_single(&addr, req, target).await {
                Ok(reply) => Ok((reply, addr)),
                // A server that says another serves the table is one of many: if it hands
                // out a map now (it had none at connect), route by it from here on.
                Err(SingleError::WrongServer(e)) => {
                    if self.learn_map(&addr).await {
                        self.send_routed(req, target).await
                    } else {
                        Err(e)
                    }
                }
                Err(SingleError::Other(e)) => Err(e),
            },
            None => self.send_routed(req, target).await,
        }
    }

    /// Asks the single server for a map; with one, switches to routing by it.
    async fn learn_map(&self, addr: &Arc<str>) -> bool {
        let Outcome::Reply(Reply::Map(m)) = self
            .attempt(addr, &Request::plain(&Credentials::root(), Op::GetMap))
            .await
        else {
            return false;
        };
        if m.tables.is_empty() {
            return false;
        }
        let cfg = &self.inner.config;
        let entries = cfg.entry_addrs();
        *self.inner.routing.lock() = Routing::cluster(entries, m);
        true
    }

    /// One server serves everything. A server that cannot be reached (restarting: refused
    /// connections, a lost connection, no reply in time) is tried again with a growing
    /// pause until the retry budget is spent (`ClientConfig::retry_budget`; the mount's is
    /// long, as an NFS hard mount waits) or `ClientConfig::attempts` were made; what it
    /// answered early and lost is replayed before the retry (never overtaken by it).
    async fn send_single(
        &self,
        addr: &Arc<str>,
        req: &Request,
        target: InodeId,
    ) -> Result<Reply, SingleError> {
        let cfg = &self.inner.config;
        let mut last_err = fs_err!(ETIMEDOUT, "no attempt made");
        let mut wrong_server = false;
        let budget_ms = cfg.retry_budget.as_millis() as u64;
        let mut retries = Retries::new(routing::restart_policy(budget_ms, cfg.attempts));
        let started = Instant::now();
        let mut pause = None;
        loop {
            if let Some(delay_ms) = pause.take() {
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                self.replays_before_retry().await;
            }
            let conn = match self.inner.pool.conn(addr).await {
                Ok(c) => Some(c),
                Err(e) if e.errno == Errno::ENOTCONN => {
                    wrong_server = false;
                    last_err = e;
                    None
                }
                Err(e) => return Err(SingleError::Other(e)),
            };
            if let Some(conn) = conn {
                self.replays_first(addr, &conn).await;
                match tokio::time::timeout(cfg.request_timeout, conn.call_answer(req)).await {
                    Ok(Ok((Reply::Error(e), _))) => return Err(SingleError::Other(e)),
                    Ok(Ok((Reply::WrongServer { map_version, .. }, _))) => {
                        wrong_server = true;
                        last_err = fs_err!(
                            ESTALE,
                            "server does not serve this table (map version {map_version})"
                        );
                        // Not a server down: a few quick tries, then the caller learns the
                        // map.
                        if retries.failures() >= WRONG_SERVER_TRIES {
                            break;
                        }
                    }
                    Ok(Ok((reply, lsn))) => {
                        self.note_answer(&conn, addr, req, target, &reply, lsn);
                        return Ok(reply);
                    }
                    // A single server that says goodbye stops for good (its journal failed:
                    // fail-stop, the client is told EIO) or refuses this client's key.
                    Ok(Err(ConnError::Refused(e))) => return Err(SingleError::Other(e)),
                    Ok(Err(ConnError::Lost(why))) => {
                        wrong_server = false;
                        last_err = fs_err!(ENOTCONN, "connection lost: {why}");
                    }
                    Err(_) => {
                        wrong_server = false;
                        conn.mark_dead();
                        last_err = fs_err!(ETIMEDOUT, "no reply within {:?}", cfg.request_timeout);
                    }
                }
            }
            match retries.failed(started.elapsed().as_millis() as u64) {
                Retry::GiveUp => break,
                Retry::After { delay_ms } => pause = Some(delay_ms),
            }
        }
        Err(if wrong_server {
            SingleError::WrongServer(last_err)
        } else {
            SingleError::Other(last_err)
        })
    }

    /// Many servers: route by the map, follow WrongServer, refetch the map when a server
    /// cannot be reached, and keep retrying for the retry budget (which covers a failover).
    async fn send_routed(&self, req: &mut Request, target: InodeId) -> FsResult<(Reply, Arc<str>)> {
        let budget_ms = self.inner.config.retry_budget.as_millis() as u64;
        let mut retries = Retries::new(RetryPolicy::cluster(budget_ms));
        let started = Instant::now();
        let mut stale_retried = false;
        loop {
            let step = self.inner.routing.lock().step(target);
            let err = match step {
                // One fetch between two failures (`Retries::fetch`).
                Step::Fetch { entry } if retries.fetch() => {
                    // One fetch at a time: after a move, every request in flight finds the
                    // map dropped, and one GetMap answers them all.
                    let _one = self.inner.fetching.lock().await;
                    if self.inner.routing.lock().routes(target) {
                        continue;
                    }
                    match self.fetch_map(&entry).await {
                        Ok(()) => continue,
                        Err(Outcome::Refused(e)) => return Err(e),
                        Err(Outcome::Error(e) | Outcome::Unreachable(e)) => e,
                        Err(_) => fs_err!(EPROTO, "{entry} answered GetMap with no map"),
                    }
                }
                Step::Fetch { .. } => fs_err!(
                    ESTALE,
                    "the delegation map places no table at inode {target:#x}"
                ),
                Step::Send {
                    addr,
                    table,
                    map_version,
                } => {
                    req.map_version = map_version;
                    match self.attempt_at(&addr, req, target).await {
                        Outcome::Reply(r) => return Ok((r, addr)),
                        Outcome::Error(e) if e.errno == Errno::ESTALE && !stale_retried => {
                            // A server that let the table go may say "no such file" rather
                            // than WrongServer (a handle it still knows whose file moved):
                            // fetch the map again and try once more.
                            stale_retried = true;
                            let routed_by = req.map_version;
                            let mut r = self.inner.routing.lock();
                            r.on_wrong_server(table, routed_by, None, None);
                            continue;
                        }
                        Outcome::Error(e) | Outcome::Refused(e) => {
                            if e.errno == Errno::ESTALE {
                                tracing::debug!(
                                    "{} of inode {target:#x} at {addr}: {e}",
                                    req.op.name()
                                );
                            }
                            return Err(e);
                        }
                        Outcome::WrongServer {
                            map_version,
                            owner,
                            addr: hint,
                        } => {
                            self.inner.routing.lock().on_wrong_server(
                                table,
                                req.map_version,
                                owner,
                                hint.clone(),
                            );
                            // A server that names the table's new owner: go there at once
                            // (a few times per request, so two servers that each name the
                            // other cannot keep a request bouncing without a pause).
                            if hint.as_deref().is_some_and(|h| h != &*addr) && retries.follow_hint()
                            {
                                continue;
                            }
                            fs_err!(
                                ESTALE,
                                "{addr} does not serve inode {target:#x} (map version \
                                 {map_version}) and no server took it over in time"
                            )
                        }
                        Outcome::Unreachable(e) => {
                            let routed_by = req.map_version;
                            self.inner.routing.lock().on_unreachable(table, routed_by);
                            e
                        }
                    }
                }
            };
            let next = retries.failed(started.elapsed().as_millis() as u64);
            tracing::debug!(
                "{} of inode {target:#x}: failure {} ({err}); {next:?}",
                req.op.name(),
                retries.failures()
            );
            match next {
                Retry::GiveUp => return Err(err),
                Retry::After { delay_ms } => {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    self.replays_before_retry().await;
                }
            }
        }
    }

    /// Before a request is sent again after a failure (its server may be gone): what a
    /// lost server process answered early is replayed first, so the retry cannot overtake
    /// it, nor a replay already under way (whose entries have left the log). A write in
    /// flight when its server was killed, retried at the table's new owner before the
    /// replay of the create that made its file, would find no file there.
    async fn replays_before_retry(&self) {
        if outside_replay() && self.inner.early.log.lock().replays_owed() {
            Box::pin(self.replay_lost()).await;
        }
    }

    /// Asks `entry` for the delegation map and caches it if newer.
    async fn fetch_map(&self, entry: &Arc<str>) -> Result<(), Outcome> {
        match self
            .attempt(entry, &Request::plain(&Credentials::root(), Op::GetMap))
            .await
        {
            Outcome::Reply(Reply::Map(m)) => {
                self.inner.routing.lock().on_map(m);
                Ok(())
            }
            Outcome::Reply(other) => Err(Outcome::Error(unexpected(other))),
            other => Err(other),
        }
    }

    /// One attempt of `req` at `addr` (a request that changes nothing: no early reply).
    async fn attempt(&self, addr: &Arc<str>, req: &Request) -> Outcome {
        self.attempt_at(addr, req, self.root()).await
    }

    /// One attempt of `req`, routed by inode `target`, at `addr`.
    async fn attempt_at(&self, addr: &Arc<str>, req: &Request, target: InodeId) -> Outcome {
        let cfg = &self.inner.config;
        let conn = match self.inner.pool.conn(addr).await {
            Ok(c) => c,
            Err(e) if e.errno == Errno::ENOTCONN => return Outcome::Unreachable(e),
            Err(e) => return Outcome::Refused(e),
        };
        // A map is read under the `fetching` lock, and a replay routes by the map: were a
        // GetMap to wait for the replays, it would wait for itself (the replayer, holding
        // `replaying`, waits for `fetching`). Nothing a replay restores is in the map.
        if !matches!(req.op, Op::GetMap) {
            self.replays_first(addr, &conn).await;
        }
        match tokio::time::timeout(cfg.request_timeout, conn.call_answer(req)).await {
            Ok(Ok((Reply::Error(e), _))) => Outcome::Error(e),
            Ok(Ok((
                Reply::WrongServer {
                    map_version,
                    owner,
                    addr,
                },
                _,
            ))) => Outcome::WrongServer {
                map_version,
                owner,
                addr,
            },
            Ok(Ok((reply, lsn))) => {
                self.note_answer(&conn, addr, req, target, &reply, lsn);
                Outcome::Reply(reply)
            }
            // A server that says goodbye with EIO is stopping (its journal failed, it was
            // fenced): another server will take its tables over.
            Ok(Err(ConnError::Refused(e))) if e.errno == Errno::EIO => Outcome::Unreachable(e),
            Ok(Err(ConnError::Refused(e))) => Outcome::Refused(e),
            Ok(Err(ConnError::Lost(why))) => {
                Outcome::Unreachable(fs_err!(ENOTCONN, "{addr}: connection lost: {why}"))
            }
            Err(_) => {
                conn.mark_dead();
                Outcome::Unreachable(fs_err!(
                    ETIMEDOUT,
                    "{addr}: no reply within {:?}",
                    cfg.request_timeout
                ))
            }
        }
    }

    async fn entry(&self, cred: &Credentials, op: Op) -> FsResult<Attr> {
        match self.call(cred, op).await? {
            Reply::Entry(a) | Reply::Attr(a) => Ok(a),
            other => Err(unexpected(other)),
        }
    }

    async fn empty(&self, cred: &Credentials, op: Op) -> FsResult<()> {
        match self.call(cred, op).await? {
            Reply::Empty => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    async fn bytes(&self, cred: &Credentials, op: Op) -> FsResult<Vec<u8>> {
        match self.call(cred, op).await? {
            Reply::Bytes(b) => Ok(b),
            other => Err(unexpected(other)),
        }
    }

    pub async fn lookup(&self, cred: &Credentials, parent: InodeId, name: &[u8]) -> FsResult<Attr> {
        let op = Op::Lookup {
            parent,
            name: name.to_vec(),
        };
        match self.call(cred, op).await? {
            Reply::Entry(a) | Reply::Attr(a) => Ok(a),
            // The name is on the parent's server, the inode on another: ask its owner.
            Reply::Child { id } => self.getattr(cred, id).await,
            other => Err(unexpected(other)),
        }
    }

    pub async fn getattr(&self, cred: &Credentials, id: InodeId) -> FsResult<Attr> {
        self.entry(cred, Op::GetAttr { id }).await
    }

    pub async fn setattr(&self, cred: &Credentials, id: InodeId, set: SetAttrs) -> FsResult<Attr> {
        self.entry(cred, Op::SetAttr { id, set }).await
    }

    /// Creates a regular file (or, with type bits in `mode`, a fifo, socket or device).
    pub async fn mknod(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        mode: u32,
        rdev: u32,
        exclusive: bool,
    ) -> FsResult<Attr> {
        let op = Op::Mknod {
            parent,
            name: name.to_vec(),
            mode,
            rdev,
            exclusive,
        };
        match self.entry(cred, op).await {
            // As in `created_before`: the first attempt made it, the retry's server holds
            // no table of the new inode yet.
            Err(e) if e.errno == Errno::ESTALE => {
                self.lookup(cred, parent, name).await.map_err(|_| e)
            }
            other => other,
        }
    }

    /// Creates a regular file exclusively.
    pub async fn create(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        mode: u32,
    ) -> FsResult<Attr> {
        self.mknod(
            cred,
            parent,
            name,
            mode::S_IFREG | (mode & mode::PERM_MASK),
            0,
            true,
        )
        .await
    }

    pub async fn mkdir(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        mode: u32,
    ) -> FsResult<Attr> {
        self.entry(
            cred,
            Op::Mkdir {
                parent,
                name: name.to_vec(),
                mode,
            },
        )
        .await
    }

    pub async fn symlink(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        target: &[u8],
    ) -> FsResult<Attr> {
        self.entry(
            cred,
            Op::Symlink {
                parent,
                name: name.to_vec(),
                target: target.to_vec(),
            },
        )
        .await
    }

    pub async fn link(
        &self,
        cred: &Credentials,
        id: InodeId,
        new_parent: InodeId,
        new_name: &[u8],
    ) -> FsResult<Attr> {
        self.entry(
            cred,
            Op::Link {
                id,
                new_parent,
                new_name: new_name.to_vec(),
            },
        )
        .await
    }

    pub async fn unlink(&self, cred: &Credentials, parent: InodeId, name: &[u8]) -> FsResult<()> {
        self.empty(
            cred,
            Op::Unlink {
                parent,
                name: name.to_vec(),
            },
        )
        .await
    }

    pub async fn rmdir(&self, cred: &Credentials, parent: InodeId, name: &[u8]) -> FsResult<()> {
        self.empty(
            cred,
            Op::Rmdir {
                parent,
                name: name.to_vec(),
            },
        )
        .await
    }

    pub async fn rename(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        new_parent: InodeId,
        new_name: &[u8],
        flags: u32,
    ) -> FsResult<()> {
        self.empty(
            cred,
            Op::Rename {
                parent,
                name: name.to_vec(),
                new_parent,
                new_name: new_name.to_vec(),
                flags,
            },
        )
        .await
    }

    pub async fn readlink(&self, cred: &Credentials, id: InodeId) -> FsResult<Vec<u8>> {
        self.bytes(cred, Op::Readlink { id }).await
    }

    /// One page of entries after `cookie`.
    pub async fn readdir_page(
        &self,
        cred: &Credentials,
        id: InodeId,
        cookie: u64,
        max_entries: u32,
        plus: bool,
    ) -> FsResult<(Vec<DirEntry>, bool)> {
        match self
            .call(
                cred,
                Op::Readdir {
                    id,
                    cookie,
                    max_entries,
                    plus,
                },
            )
            .await?
        {
            Reply::Dir { entries, eof } => Ok((entries, eof)),
            other => Err(unexpected(other)),
        }
    }

    /// Every entry of a directory except "." and "..".
    pub async fn readdir_all(
        &self,
        cred: &Credentials,
        id: InodeId,
        plus: bool,
    ) -> FsResult<Vec<DirEntry>> {
        let mut all = Vec::new();
        let mut cookie = 0;
        loop {
            let (page, eof) = self.readdir_page(cred, id, cookie, 1024, plus).await?;
            if let Some(last) = page.last() {
                cookie = last.cookie;
            }
            all.extend(
                page.into_iter()
                    .filter(|e| e.name != b"." && e.name != b".."),
            );
            if eof {
                return Ok(all);
            }
        }
    }

    pub async fn setxattr(
        &self,
        cred: &Credentials,
        id: InodeId,
        name: &[u8],
        value: &[u8],
        flags: u32,
    ) -> FsResult<()> {
        self.empty(
            cred,
            Op::SetXattr {
                id,
                name: name.to_vec(),
                value: value.to_vec(),
                flags,
            },
        )
        .await
    }

    pub async fn getxattr(
        &self,
        cred: &Credentials,
        id: InodeId,
        name: &[u8],
    ) -> FsResult<Vec<u8>> {
        self.bytes(
            cred,
            Op::GetXattr {
                id,
                name: name.to_vec(),
            },
        )
        .await
    }

    pub async fn listxattr(&self, cred: &Credentials, id: InodeId) -> FsResult<Vec<u8>> {
        self.bytes(cred, Op::ListXattr { id }).await
    }

    pub async fn removexattr(&self, cred: &Credentials, id: InodeId, name: &[u8]) -> FsResult<()> {
        self.empty(
            cred,
            Op::RemoveXattr {
                id,
                name: name.to_vec(),
            },
        )
        .await
    }

    pub async fn access(&self, cred: &Credentials, id: InodeId, mask: u32) -> FsResult<()> {
        self.empty(cred, Op::Access { id, mask }).await
    }

    /// The file system's sizes. In a cluster every server is asked (each counts the inodes
    /// of its own tables) and the inodes in use are summed; the space is the shared
    /// store's, as any server reports it. (A table that moves between two of the questions
    /// may be counted twice or not at all: a df, not a census.)
    pub async fn statfs(&self, cred: &Credentials) -> FsResult<StatFs> {
        // An unlinked file frees its space at its last close, which may be gathered.
        self.inner.closes.flushed().await;
        let targets = self.inner.routing.lock().one_id_per_server(self.root());
        if targets.len() <= 1 {
            return match self.call(cred, Op::StatFs).await? {
                Reply::StatFs(s) => Ok(s),
                other => Err(unexpected(other)),
            };
        }
        let mut total: Option<StatFs> = None;
        let mut used = 0u64;
        for target in targets {
            match self.call_at(cred, Op::StatFs, target).await?.0 {
                Reply::StatFs(s) => {
                    used = used.saturating_add(s.files.saturating_sub(s.ffree));
                    total.get_or_insert(s);
                }
                other => return Err(unexpected(other)),
            }
        }
        let mut s = total.ok_or_else(|| fs_err!(EIO, "no server answered statfs"))?;
        s.ffree = s.files.saturating_sub(used);
        Ok(s)
    }

    /// The status of the server this client connected to (its first entry address that
    /// answered), also when it routes by a map.
    pub async fn status(&self) -> FsResult<StatusReport> {
        match self.ask_home(Op::Status).await? {
            Reply::Status(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// Opens inode `id` with open(2) `flags`; returns its attributes and the handle.
    pub async fn open(&self, cred: &Credentials, id: InodeId, flags: u32) -> FsResult<(Attr, u64)> {
        let handle = self.new_handle();
        let attr = self.open_as(cred, id, flags, handle).await?;
        Ok((attr, handle))
    }

    /// A fresh handle number, for [`Client::open_as`].
    pub fn new_handle(&self) -> u64 {
        self.inner.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    /// Opens inode `id` as `handle` (from [`Client::new_handle`]): lets a caller use the
    /// handle's number before the open is answered.
    pub async fn open_as(
        &self,
        cred: &Credentials,
        id: InodeId,
        flags: u32,
        handle: u64,
    ) -> FsResult<Attr> {
        let (reply, addr) = self
            .call_at(cred, Op::Open { id, flags, handle }, id)
            .await?;
        let attr = as_attr(reply)?;
        self.inner.handles.lock().insert(
            handle,
            Handle {
                id,
                flags,
                cred: cred.clone(),
                servers: vec![addr],
            },
        );
        Ok(attr)
    }

    /// Creates (or with O_EXCL absent, opens an existing) regular file and opens it.
    pub async fn create_open(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        mode: u32,
        flags: u32,
    ) -> FsResult<(Attr, u64)> {
        let handle = self.inner.next_handle.fetch_add(1, Ordering::Relaxed);
        let op = Op::Create {
            parent,
            name: name.to_vec(),
            mode,
            flags,
            handle,
        };
        let (attr, addr) = match self.call_at(cred, op, parent).await {
            Ok((reply, addr)) => (as_attr(reply)?, addr),
            Err(e) if e.errno == Errno::ESTALE => {
                self.created_before(cred, parent, name, flags, handle, e)
                    .await?
            }
            Err(e) => return Err(e),
        };
        self.inner.handles.lock().insert(
            handle,
            Handle {
                id: attr.id,
                flags,
                cred: cred.clone(),
                servers: vec![addr],
            },
        );
        Ok((attr, handle))
    }

    /// A create whose first attempt ran (its reply lost to a restart or a failover) and
    /// whose retry found the new inode on no table its server holds (the inode's table not
    /// taken over yet): the server answers ESTALE, yet the file is there under its name.
    /// It is opened as the create would have opened it (a reclaim: the creator is not held
    /// to the mode it gave); `err` stands if the name is gone.
    async fn created_before(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &[u8],
        flags: u32,
        handle: u64,
        err: FsError,
    ) -> FsResult<(Attr, Arc<str>)> {
        let found = match self.lookup(cred, parent, name).await {
            Ok(found) => found,
            Err(lookup) => {
                tracing::debug!(
                    "create of {:?} in {parent:#x}: {err}; its lookup: {lookup}",
                    String::from_utf8_lossy(name)
                );
                return Err(err);
            }
        };
        tracing::debug!(
            "create of {:?} in {parent:#x}: {err}; the first attempt made {:#x}",
            String::from_utf8_lossy(name),
            found.id
        );
        let addr = self
            .reclaim(cred, found.id, flags & !REOPEN_STRIP, handle)
            .await?;
        let attr = self.getattr(cred, found.id).await.unwrap_or(found);
        Ok((attr, addr))
    }

    /// Closes a handle, on every server it was opened on (after its table moved, the old
    /// server still holds it in this client's session there).
    pub async fn close(&self, cred: &Credentials, handle: u64) -> FsResult<()> {
        let known = self.inner.handles.lock().remove(&handle);
        self.close_known(cred, handle, known).await
    }

    /// Closes a handle that has nothing to report (no locks to end, no writes held back)
    /// soon, with others in one request to its server (see `closes`); `rt`, the runtime of
    /// the calling thread, sends them. Nobody waits for it but a statfs.
    pub fn close_soon(&self, handle: u64, rt: &tokio::runtime::Handle) {
        let Some(known) = self.inner.handles.lock().remove(&handle) else {
            return;
        };
        if known.servers.len() != 1 {
            // Opened at several servers (its table moved): closed at each, as usual.
            let client = self.clone();
            rt.spawn(async move {
                let cred = known.cred.clone();
                if let Err(e) = client.close_known(&cred, handle, Some(known)).await {
                    tracing::debug!("close of handle {handle} failed: {e}");
                }
            });
            return;
        }
        let lane = lane::lane();
        let addr = known.servers[0].clone();
        if self.inner.closes.push(lane, addr, handle, known) {
            let client = self.clone();
            rt.spawn(async move {
                tokio::time::sleep(closes::GATHER).await;
                client.send_gathered(lane).await;
            });
        }
    }

    /// Sends `lane`'s gathered closes, one request per server; where a server does not
    /// close them all, closes each as [`Client::close`] does.
    async fn send_gathered(&self, lane: Option<usize>) {
        for (addr, list) in self.inner.closes.take(lane) {
            let n = list.len();
            let cred = list[0].1.cred.clone();
            let handles = list.iter().map(|(h, _)| *h).collect();
            let mut req = Request::plain(&cred, Op::CloseMany { handles });
            if self.inner.config.early_replies {
                // As any close: a durable reply would wait for (and so hurry) the journal.
                req.mode = ReplyMode::Early;
            }
            if !matches!(
                self.attempt(&addr, &req).await,
                Outcome::Reply(Reply::Empty)
            ) {
                for (handle, known) in list {
                    let cred = known.cred.clone();
                    if let Err(e) = self.close_known(&cred, handle, Some(known)).await {
                        tracing::debug!("close of handle {handle} failed: {e}");
                    }
                }
            }
            self.inner.closes.finished(n);
        }
    }

    /// [`Client::close`] of a handle already taken from the table.
    async fn close_known(
        &self,
        cred: &Credentials,
        handle: u64,
        known: Option<Handle>,
    ) -> FsResult<()> {
        let target = known.as_ref().map_or_else(|| self.root(), |h| h.id);
        let result = self.call_at(cred, Op::Close { handle }, target).await;
        let answered = result.as_ref().ok().map(|(_, a)| a.clone());
        for addr in known.iter().flat_map(|h| &h.servers) {
            if Some(addr) != answered.as_ref() {
                // Best effort: a server that is gone has dropped the handle anyway.
                let _ = self
                    .attempt(addr, &Request::plain(cred, Op::Close { handle }))
                    .await;
            }
        }
        as_empty(result?.0)
    }

    /// Runs a handle operation. A server that does not know the handle (it restarted, or
    /// the file's table moved to it from the server the handle was opened on) answers
    /// EBADF: the handle is reopened there, with the same number and flags (never
    /// truncating or creating), and the operation tried once more.
    async fn with_handle(&self, cred: &Credentials, handle: u64, op: Op) -> FsResult<Reply> {
        self.with_handle_seq(cred, handle, op, 0).await
    }

    /// [`Client::with_handle`] for a request with a sequence number (an append, which the
    /// server answers once per number).
    async fn with_handle_seq(
        &self,
        cred: &Credentials,
        handle: u64,
        op: Op,
        seq: u64,
    ) -> FsResult<Reply> {
        // Handle operations are idempotent (appends and early writes by their number): the
        // request (which may carry a MiB of data) is built once and reused for a retry.
        debug_assert!(!op.needs_reply_cache());
        let target = self.target_of(&op);
        let mut req = Request::plain(cred, op);
        req.seq = seq;
        let known = |c: &Client| c.inner.handles.lock().get(&handle).cloned();
        let mut reopens = 0;
        loop {
            let err = match self.send(&mut req, target).await {
                Err(e) if e.errno == Errno::EBADF && reopens < REOPEN_TRIES => e,
                other => return Ok(other?.0),
            };
            reopens += 1;
            let Some(h) = known(self) else {
                return Err(err);
            };
            // The server lost the handle: a server process was lost, and the create of
            // the file may wait for its replay, which the reopen must not overtake.
            self.replays_before_retry().await;
            match self
                .reclaim(&h.cred, h.id, h.flags & !REOPEN_STRIP, handle)
                .await
            {
                Ok(addr) => {
                    if let Some(h) = self.inner.handles.lock().get_mut(&handle)
                        && !h.servers.contains(&addr)
                    {
                        h.servers.push(addr);
                    }
                }
                Err(reopen) if reopen.errno == Errno::ENOENT => {
                    tracing::debug!(
                        "{} of handle {handle} (inode {:#x}): {err}; its reopen: {reopen}",
                        req.op.name(),
                        h.id
                    );
                    return Err(fs_err!(ESTALE, "the file is gone: {reopen}"));
                }
                Err(_) => return Err(err),
            }
        }
    }

    /// Reopens `handle` on file `id` with `flags` where its server does not know it (a
    /// restart, a failover, a table that moved), as a reclaim (see `OPEN_RECLAIM`); returns
    /// the server that opened it.
    async fn reclaim(
        &self,
        cred: &Credentials,
        id: InodeId,
        flags: u32,
        handle: u64,
    ) -> FsResult<Arc<str>> {
        let op = Op::Open {
            id,
            flags: flags | kochab_proto::OPEN_RECLAIM,
            handle,
        };
        Ok(self.route(&mut Request::plain(cred, op), id).await?.1)
    }

    pub async fn read(
        &self,
        cred: &Credentials,
        handle: u64,
        offset: u64,
        len: u32,
    ) -> FsResult<Vec<u8>> {
        Ok(self
            .read_atime(cred, handle, offset, len, AtimeRule::Relative)
            .await?
            .0)
    }

    /// Reads with the given access-time rule; also says whether the read set the file's
    /// access time (attributes cached before it are then out of date).
    pub async fn read_atime(
        &self,
        cred: &Credentials,
        handle: u64,
        offset: u64,
        len: u32,
        atime: AtimeRule,
    ) -> FsResult<(Vec<u8>, bool)> {
        let op = Op::Read {
            handle,
            offset,
            len,
            atime,
        };
        match self.with_handle(cred, handle, op).await? {
            Reply::ReadAtime(b) => Ok((b, true)),
            r => Ok((as_bytes(r)?, false)),
        }
    }

    /// Writes `data` at `offset`; returns the attributes after the write. With early
    /// replies the write has a sequence number: it is kept until durable and replayed if
    /// its server is lost first, and a replay of one that was durable after all is
    /// answered by the server's reply cache, never run again over newer changes.
    pub async fn write(
        &self,
        cred: &Credentials,
        handle: u64,
        offset: u64,
        data: Vec<u8>,
    ) -> FsResult<Attr> {
        let op = Op::Write {
            handle,
            offset,
            data,
        };
        self.kept_handle_op(cred, handle, op).await
    }

    /// Appends `data` at the end of the file as its server finds it (O_APPEND), with no
    /// other write in between; returns the attributes after it (the size is where it
    /// ended). A retry after a lost connection does not append twice.
    pub async fn append(&self, cred: &Credentials, handle: u64, data: Vec<u8>) -> FsResult<Attr> {
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        self.inner.in_flight.lock().insert(seq);
        let _done = InFlight {
            inner: &self.inner,
            seq,
        };
        let op = Op::Write {
            handle,
            offset: kochab_proto::WRITE_AT_END,
            data,
        };
        as_attr(self.with_handle_seq(cred, handle, op, seq).await?)
    }

    /// Capabilities to create `objects` slice objects of the handle's file straight in
    /// the object store. EOPNOTSUPP: the store is one the servers write themselves (write
    /// through [`Client::write`]).
    pub async fn data_grant(
        &self,
        cred: &Credentials,
        handle: u64,
        objects: u32,
    ) -> FsResult<kochab_proto::layout::Grant> {
        match self
            .with_handle(cred, handle, Op::DataGrant { handle, objects })
            .await?
        {
            Reply::Grant(g) => Ok(g),
            other => Err(unexpected(other)),
        }
    }

    /// Commits slices put under granted names, in the order given, and makes the size at
    /// least `end`; returns the attributes after it. Sent as a write is: with early
    /// replies it has a sequence number, is kept until durable and replayed if its server
    /// is lost first (exactly once, through the reply cache). A replay refused for good
    /// is reported by [`Client::take_lost_commit`].
    pub async fn commit_slices(
        &self,
        cred: &Credentials,
        handle: u64,
        slices: Vec<kochab_proto::layout::CommittedSlice>,
        end: u64,
    ) -> FsResult<Attr> {
        let op = Op::CommitSlices {
            handle,
            slices,
            end,
        };
        self.kept_handle_op(cred, handle, op).await
    }

    /// Sends a handle operation that changes the file (a write, a commit of slices): with
    /// early replies it gets a sequence number, so that it is kept until durable and a
    /// retry or replay is answered by the server's reply cache, never run twice.
    async fn kept_handle_op(&self, cred: &Credentials, handle: u64, op: Op) -> FsResult<Attr> {
        if !self.inner.config.early_replies {
            return as_attr(self.with_handle(cred, handle, op).await?);
        }
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        self.inner.in_flight.lock().insert(seq);
        let _done = InFlight {
            inner: &self.inner,
            seq,
        };
        as_attr(self.with_handle_seq(cred, handle, op, seq).await?)
    }

    /// The refs of chunks `[first_chunk, first_chunk + chunks)` of the handle's file and
    /// URLs to get their objects. EOPNOTSUPP: read through [`Client::read`].
    pub async fn layout(
        &self,
        cred: &Credentials,
        handle: u64,
        first_chunk: u64,
        chunks: u32,
    ) -> FsResult<kochab_proto::layout::Layout> {
        let op = Op::Layout {
            handle,
            first_chunk,
            chunks,
        };
        match self.with_handle(cred, handle, op).await? {
            Reply::Layout(l) => Ok(l),
            other => Err(unexpected(other)),
        }
    }

    /// The error of a commit of slices through `handle` that was answered early and then
    /// lost with its server and refused at its replay (reported once).
    pub fn take_lost_commit(&self, handle: u64) -> Option<FsError> {
        self.inner.lost_commits.lock().remove(&handle)
    }

    /// Whether [`Client::take_lost_commit`] has something to report for `handle`.
    pub fn has_lost_commit(&self, handle: u64) -> bool {
        self.inner.lost_commits.lock().contains_key(&handle)
    }

    pub async fn fsync(&self, cred: &Credentials, handle: u64, datasync: bool) -> FsResult<()> {
        as_empty(
            self.with_handle(cred, handle, Op::Fsync { handle, datasync })
                .await?,
        )
    }

    pub async fn fallocate(
        &self,
        cred: &Credentials,
        handle: u64,
        offset: u64,
        len: u64,
        mode: u32,
    ) -> FsResult<()> {
        as_empty(
            self.with_handle(
                cred,
                handle,
                Op::Fallocate {
                    handle,
                    offset,
                    len,
                    mode,
                },
            )
            .await?,
        )
    }

    /// The lock that conflicts with `lock`, or `lock` with kind Unlock if none does.
    pub async fn getlk(
        &self,
        cred: &Credentials,
        handle: u64,
        lock: LockSpec,
    ) -> FsResult<LockSpec> {
        as_lock(
            self.with_handle(cred, handle, Op::GetLk { handle, lock })
                .await?,
        )
    }

    /// Takes or releases a lock without waiting (EAGAIN on conflict).
    pub async fn setlk(&self, cred: &Credentials, handle: u64, lock: LockSpec) -> FsResult<()> {
        as_empty(
            self.with_handle(cred, handle, Op::SetLk { handle, lock })
                .await?,
        )
    }

    /// Releases the locks `owner` holds on the handle's file.
    pub async fn release_locks(&self, cred: &Credentials, handle: u64, owner: u64) -> FsResult<()> {
        self.empty(cred, Op::ReleaseLocks { handle, owner }).await
    }

    /// Ends this client's sessions (closes handles, releases locks): on the server, or on
    /// every server it talked to when routing by a map.
    pub async fn end_session(&self) -> FsResult<()> {
        self.inner.handles.lock().clear();
        if !self.routes_by_map() {
            return self.empty(&Credentials::root(), Op::EndSession).await;
        }
        let mut first_err = None;
        for addr in self.inner.pool.sessions() {
            let req = Request::plain(&Credentials::root(), Op::EndSession);
            let err = match self.attempt(&addr, &req).await {
                // A server that is gone keeps no session (it expires, or went with it).
                Outcome::Reply(_) | Outcome::WrongServer { .. } | Outcome::Unreachable(_) => {
                    continue;
                }
                Outcome::Error(e) | Outcome::Refused(e) => e,
            };
            first_err.get_or_insert(err);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Checks the namespace invariants on the server this client connected to (as
    /// `status`: of a cluster, the tables that server holds); returns the problems found.
    /// What every request but a replay does first: sets the reply mode, replays what lost
    /// server processes had answered early (so that a new request never overtakes them),
    /// and waits while the log of early replies is full.
    async fn before_send(&self, req: &mut Request) {
        if self.inner.config.early_replies {
            req.mode = ReplyMode::Early;
        }
        // Replayed before, never overtaken: a create sent while the mkdir of its directory
        // still waits for its replay (the table not taken over yet) would find no
        // directory. A lost server's changes wait for its tables' new owner as long as any
        // request waits for a server (the retry budget).
        let cfg = &self.inner.config;
        let deadline = Instant::now() + cfg.request_timeout.max(cfg.retry_budget);
        while self.inner.early.log.lock().replays_owed() {
            // Waits for a replay under way too (`replay_lost` takes its lock first).
            self.replay_lost().await;
            if Instant::now() >= deadline || !self.inner.early.log.lock().replays_owed() {
                break;
            }
            tokio::time::sleep(REPLAY_RETRY).await;
        }
        if req.mode == ReplyMode::Early {
            let deadline = Instant::now() + self.inner.config.request_timeout;
            loop {
                let early = &self.inner.early;
                let notified = early.changed.notified();
                let room = {
                    let log = early.log.lock();
                    log.len() < UNSAFE_MAX && log.bytes() < UNSAFE_BYTES_MAX
                };
                if room || Instant::now() >= deadline {
                    break;
                }
                let _ = tokio::time::timeout(REPLAY_RETRY, notified).await;
            }
        }
    }

    /// Before a request goes to the process `conn` reached at `addr`: if another process
    /// answered there early before (it restarted), what it lost is replayed first, and a
    /// replay already running is waited for. The server's replay window keeps other
    /// clients' new changes out meanwhile; this keeps this client's own.
    async fn replays_first(&self, addr: &str, conn: &conn::Conn) {
        if !outside_replay() {
            return;
        }
        let superseded = self
            .inner
            .early
            .log
            .lock()
            .superseded(addr, conn.incarnation);
        if superseded {
            tracing::debug!("{addr}: a new server process; replaying what the last one lost");
            Box::pin(self.replay_lost()).await;
        }
    }

    /// Keeps a change the server answered before it was durable (reads and failures need
    /// no replay).
    fn note_answer(
        &self,
        conn: &conn::Conn,
        addr: &Arc<str>,
        req: &Request,
        target: InodeId,
        reply: &Reply,
        early: Option<replay::EarlyAck>,
    ) {
        let Some(ack) = early else {
            return;
        };
        if req.op.is_read_only() || matches!(reply, Reply::Error(_)) {
            return;
        }
        let early = &self.inner.early;
        let mut log = early.log.lock();
        let kept = log.answered(Unsafe {
            req: req.clone(),
            target,
            addr: addr.clone(),
            incarnation: conn.incarnation,
            lsn: ack.lsn,
            created: replay::created_by(reply),
            tag: ack.tag,
        });
        // The connection may have ended between the reply and now: its end was then
        // reported before this entry was kept (and so found nothing to look at). Is the
        // process still there? A connection is marked dead before its end is reported,
        // so one of the two sees the other.
        if kept && !conn.is_alive() {
            log.lost(conn.incarnation);
            drop(log);
            early.lost.notify_one();
        }
    }

    /// Looks at every server process a connection to which was lost while it had
    /// answered requests early: one still running will make them durable (a durable
    /// request to it returns once its journal holds everything before); one gone (a new
    /// process answers at its address, or in a cluster none does) lost what its journal did
    /// not hold, so they are replayed, in the order they were answered, each asking for
    /// the inode its first reply created. The servers' reply caches answer a replay of
    /// what did reach a journal, so each runs once.
    async fn replay_lost(&self) {
        let _one = self.inner.replaying.lock().await;
        let cluster = self.routes_by_map();
        loop {
            let next = self.inner.early.log.lock().next_suspect();
            let Some((inc, addr)) = next else {
                return;
            };
            let reached = match self.inner.pool.conn(&addr).await {
                Ok(conn) if conn.incarnation == inc => {
                    let early = &self.inner.early;
                    early.log.lock().durable(inc, conn.durable_lsn);
                    let upto = early.log.lock().order_now();
                    let sync = Request::plain(&Credentials::root(), Op::StatFs);
                    let timeout = self.inner.config.request_timeout;
                    match tokio::time::timeout(timeout, conn.call(&sync)).await {
                        Ok(Ok(_)) => {
                            let mut log = early.log.lock();
                            log.durable_before(inc, upto);
                            log.alive(inc);
                            true
                        }
                        _ => false,
                    }
                }
                Ok(_) => self.replay_gone(inc).await,
                Err(e) if e.errno == Errno::ENOTCONN && cluster => self.replay_gone(inc).await,
                Err(_) => false,
            };
            self.inner.early.changed.notify_waiters();
            if !reached {
                // Not reachable yet: the replayer tries again shortly.
                return;
            }
        }
    }

    /// Replays what process `inc` answered early; false if a server could not be reached
    /// (the rest is kept for the next try).
    async fn replay_gone(&self, inc: u64) -> bool {
        let taken = self.inner.early.log.lock().take_gone(inc);
        tracing::info!(
            "server process {inc:#x} is gone: replaying {} operations it acknowledged",
            taken.len()
        );
        let mut rest = taken.into_iter();
        while let Some((order, e)) = rest.next() {
            match IN_REPLAY.scope((), self.replay_one(&e)).await {
                Ok(_) => {}
                Err(err)
                    if matches!(
                        err.errno,
                        Errno::ENOTCONN | Errno::ETIMEDOUT | Errno::EIO | Errno::ESTALE
                    ) =>
                {
                    let mut back = vec![(order, e)];
                    back.extend(rest);
                    self.inner.early.log.lock().put_back(back);
                    return false;
                }
                Err(err) => {
                    if let Op::CommitSlices { handle, .. } = &e.req.op {
                        let mut lost = self.inner.lost_commits.lock();
                        if lost.len() < LOST_COMMITS_MAX {
                            lost.entry(*handle).or_insert_with(|| {
                                fs_err!(EIO, "written data was lost: its commit failed at its replay after a server loss ({err})")
                            });
                        }
                    }
                    tracing::warn!(
                        "replay of an acknowledged {} failed: {err}",
                        kochab_proto::OP_NAMES
                            .get(e.req.op.index())
                            .copied()
                            .unwrap_or("operation")
                    );
                }
            }
            self.inner.early.log.lock().replayed(order, &e);
        }
        true
    }

    /// Replays one change answered early by a process that is gone. A change made through
    /// a handle (a write) that the new server does not know is replayed through the handle
    /// reopened there as a reclaim (the file's owner is not held to mode bits changed since
    /// the open, see `OPEN_RECLAIM`); a handle the application has closed since is closed
    /// again after.
    async fn replay_one(&self, e: &Unsafe) -> FsResult<()> {
        let mut req = replay::replay_request(e);
        let mut reopened = None;
        let mut reopens = 0;
        let replayed = loop {
            let err = match self.route(&mut req, e.target).await {
                Err(err) if err.errno == Errno::EBADF && reopens < REOPEN_TRIES => err,
                other => break other.map(drop),
            };
            let Some(handle) = req.op.handle() else {
                break Err(err);
            };
            reopens += 1;
            let open = self
                .inner
                .handles
                .lock()
                .get(&handle)
                .map(|h| h.flags & !REOPEN_STRIP);
            if let Err(e) = self
                .reclaim(&e.req.cred, e.target, open.unwrap_or(O_WRONLY), handle)
                .await
            {
                break Err(e);
            }
            if open.is_none() {
                reopened = Some(handle);
            }
        };
        if let Some(handle) = reopened {
            let close = Op::Close { handle };
            let _ = self
                .route(&mut Request::plain(&e.req.cred, close), e.target)
                .await;
        }
        replayed
    }

    /// Returns once every change this client had answered early before the call is
    /// durable (replayed first where its server was lost): fsync, fsyncdir and O_SYNC
    /// writes wait for it. EIO if that takes longer than a request may.
    pub async fn wait_durable(&self) -> FsResult<()> {
        let early = &self.inner.early;
        let upto = early.log.lock().order_now();
        // A server that restarts or fails over may take the whole retry budget to come
        // back; the replays then follow.
        let cfg = &self.inner.config;
        let deadline = Instant::now() + cfg.request_timeout.max(cfg.retry_budget);
        loop {
            let notified = early.changed.notified();
            let (clear, suspects) = {
                let log = early.log.lock();
                (log.clear_before(upto), log.has_suspects())
            };
            if clear {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(fs_err!(
                    EIO,
                    "changes acknowledged early did not become durable within {:?}",
                    cfg.request_timeout.max(cfg.retry_budget)
                ));
            }
            if suspects {
                self.replay_lost().await;
            }
            let _ = tokio::time::timeout(REPLAY_RETRY, notified).await;
        }
    }

    /// Changes answered early and not known durable yet.
    pub fn unsafe_count(&self) -> usize {
        self.inner.early.log.lock().len()
    }

    /// Sends `op` as root to the server this client connected to (not routed: the
    /// answer is that server's own).
    async fn ask_home(&self, op: Op) -> FsResult<Reply> {
        let req = Request::plain(&Credentials::root(), op);
        self.send_single(&self.inner.home, &req, self.root())
            .await
            .map_err(FsError::from)
    }

    pub async fn fsck(&self) -> FsResult<Vec<String>> {
        match self.ask_home(Op::Fsck).await? {
            Reply::Problems(p) => Ok(p),
            other => Err(unexpected(other)),
        }
    }

    /// One page of the connected server's cross-server link facts (root only; see
    /// `kochab_proto::links`).
    pub async fn fsck_links(&self, after: LinksCursor) -> FsResult<LinksPage> {
        match self.ask_home(Op::FsckLinks { after }).await? {
            Reply::Links(page) => Ok(page),
            other => Err(unexpected(other)),
        }
    }

    /// The connected server's link facts of those of `ids` its tables hold (root only; at
    /// most `kochab_proto::links::FSCK_IDS_MAX`).
    pub async fn fsck_inodes(&self, ids: Vec<InodeId>) -> FsResult<Vec<InodeLinks>> {
        match self.ask_home(Op::FsckInodes { ids }).await? {
            Reply::InodeLinks(found) => Ok(found),
            other => Err(unexpected(other)),
        }
    }

    /// Makes a client key with `policy` (admin key only): its id and secret.
    pub async fn key_add(&self, policy: KeyPolicy, note: &str) -> FsResult<ClientKey> {
        let op = Op::KeyAdd {
            policy,
            note: note.to_string(),
        };
        match self.call(&Credentials::root(), op).await? {
            Reply::KeyAdded { id, key } => Ok(ClientKey { id, key }),
            other => Err(unexpected(other)),
        }
    }

    /// The cluster's client keys (admin key only).
    pub async fn key_list(&self) -> FsResult<Vec<KeyInfo>> {
        match self.call(&Credentials::root(), Op::KeyList).await? {
            Reply::Keys(k) => Ok(k),
            other => Err(unexpected(other)),
        }
    }

    /// Revokes a client key (admin key only): its connections close at once.
    pub async fn key_revoke(&self, id: u32) -> FsResult<()> {
        self.empty(&Credentials::root(), Op::KeyRevoke { id }).await
    }

    /// Resolves an absolute path (relative paths are taken from the root) to its inode,
    /// following symlinks in every component but the last unless `follow_last`.
    pub async fn resolve(
        &self,
        cred: &Credentials,
        path: &str,
        follow_last: bool,
    ) -> FsResult<Attr> {
        let mut follows = 0;
        let mut pending: Vec<Vec<u8>> = components(path.as_bytes());
        pending.reverse();
        let root = self.getattr(cred, self.root()).await?;
        let mut stack: Vec<Attr> = vec![root];
        while let Some(comp) = pending.pop() {
            let cur = stack
                .last()
                .cloned()
                .unwrap_or_else(|| unreachable!("the stack always holds the root"));
            if comp == b"." {
                continue;
            }
            if comp == b".." {
                if stack.len() > 1 {
                    stack.pop();
                }
                continue;
            }
            if cur.kind() != Some(FileKind::Dir) {
                return Err(fs_err!(
                    ENOTDIR,
                    "a component of {path:?} is not a directory"
                ));
            }
            let attr = self.lookup(cred, cur.id, &comp).await?;
            let last = pending.is_empty();
            if attr.kind() == Some(FileKind::Symlink) && (!last || follow_last) {
                follows += 1;
                if follows > SYMLINK_FOLLOW_MAX {
                    return Err(fs_err!(ELOOP, "too many symlinks in {path:?}"));
                }
                let target = self.readlink(cred, attr.id).await?;
                if target.first() == Some(&b'/') {
                    stack.truncate(1);
                }
                let mut more = components(&target);
                more.reverse();
                pending.extend(more);
                continue;
            }
            stack.push(attr);
        }
        stack
            .pop()
            .ok_or_else(|| fs_err!(EIO, "path resolution lost its root"))
    }

    /// Resolves the parent of `path` and returns it with the last component's name.
    pub async fn resolve_parent(
        &self,
        cred: &Credentials,
        path: &str,
    ) -> FsResult<(Attr, Vec<u8>)> {
        let mut comps = components(path.as_bytes());
        let name = comps
            .pop()
            .ok_or_else(|| fs_err!(EINVAL, "{path:?} has no last component"))?;
        if name == b"." || name == b".." {
            return Err(fs_err!(EINVAL, "{path:?} ends in . or .."));
        }
        let parent_path: Vec<u8> = comps.join(&b'/');
        let parent = self
            .resolve(cred, &String::from_utf8_lossy(&parent_path), true)
            .await?;
        if parent.kind() != Some(FileKind::Dir) {
            return Err(fs_err!(ENOTDIR, "parent of {path:?} is not a directory"));
        }
        Ok((parent, name))
    }
}

struct InFlight<'a> {
    inner: &'a Inner,
    seq: u64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.inner.in_flight.lock().remove(&self.seq);
    }
}

/// Hands an operation's outcome to the complete directories; an operation that never
/// ended (cancelled) counts as failed: its outcome is unknown.
struct NamesGuard<'a> {
    early: &'a Early,
    seen: u64,
    change: Option<complete::Change>,
    sent: Instant,
}

impl NamesGuard<'_> {
    fn end(&mut self, outcome: Result<&Reply, &FsError>) {
        if let Some(change) = self.change.take() {
            self.early
                .complete
                .lock()
                .ended(&change, self.seen, outcome, self.sent);
        }
    }
}

impl Drop for NamesGuard<'_> {
    fn drop(&mut self) {
        self.end(Err(&fs_err!(EIO, "cancelled: outcome unknown")));
    }
}

/// Hands an operation's end, and the directory attributes its reply carried, to the
/// directory cache.
struct DirsGuard<'a> {
    inner: &'a Inner,
    ticket: Option<dircache::Ticket>,
    dirs: Vec<Attr>,
    /// When the operation was sent.
    sent: Instant,
}

impl Drop for DirsGuard<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.inner.dirs.lock().end(t, &self.dirs, self.sent);
        }
    }
}

fn components(path: &[u8]) -> Vec<Vec<u8>> {
    path.split(|&c| c == b'/')
        .filter(|c| !c.is_empty())
        .map(|c| c.to_vec())
        .collect()
}

fn as_empty(reply: Reply) -> FsResult<()> {
    match reply {
        Reply::Empty => Ok(()),
        other => Err(unexpected(other)),
    }
}

fn as_attr(reply: Reply) -> FsResult<Attr> {
    match reply {
        Reply::Attr(a) | Reply::Entry(a) => Ok(a),
        other => Err(unexpected(other)),
    }
}

fn as_bytes(reply: Reply) -> FsResult<Vec<u8>> {
    match reply {
        Reply::Bytes(b) => Ok(b),
        other => Err(unexpected(other)),
    }
}

fn as_lock(reply: Reply) -> FsResult<LockSpec> {
    match reply {
        Reply::Lock(l) => Ok(l),
        other => Err(unexpected(other)),
    }
}

fn unexpected(reply: Reply) -> FsError {
    fs_err!(EPROTO, "unexpected reply {reply:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_lists_are_comma_separated() {
        let a = resolve_addrs("127.0.0.1:1, 127.0.0.2:2,").unwrap();
        assert_eq!(
            a,
            vec![
                "127.0.0.1:1".parse::<SocketAddr>().unwrap(),
                "127.0.0.2:2".parse().unwrap()
            ]
        );
        assert_eq!(resolve_addrs(" , ").unwrap_err().errno, Errno::EINVAL);
        assert!(resolve_addrs("127.0.0.1:1,nonsense").is_err());
    }
}

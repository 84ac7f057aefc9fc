//! Messages: the handshake, requests (one `Op` each) and replies.

use crate::cluster::{Control, ControlReply, DelegationMap, ServerId};
use crate::errno::FsError;
use crate::types::*;
use serde::{Deserialize, Serialize};

/// Longest note a key may carry: a label ("build farm", a host name), not a document.
pub const KEY_NOTE_MAX: usize = 256;

/// Most handles one [`Op::CloseMany`] may name: it runs under the server's core lock, where
/// it counts as this many requests against the per-batch bound (64 requests per hold of the
/// lock, `conn::BATCH_REQUESTS_MAX` in kochab-server), so one request never holds the lock
/// longer than a batch of single closes would. A mount gathers far fewer in its 1 ms.
pub const CLOSE_MANY_HANDLES_MAX: usize = 64;

/// Most client keys a cluster holds, revoked ones included (one per machine or service is
/// the expected use; every server keeps them all in memory, and a single server rewrites
/// its whole key file on every change). Past it `kochab key add` fails with ENOSPC.
pub const KEYS_MAX: usize = 4096;

/// Checks what `kochab key add` asks for: a note of at most [`KEY_NOTE_MAX`] bytes and id
/// ranges that are not empty (EINVAL otherwise). One rule for a single server's key file
/// and for a cluster's coordinator.
pub fn check_new_key(policy: &KeyPolicy, note: &str) -> Result<(), FsError> {
    if note.len() > KEY_NOTE_MAX {
        return Err(crate::fs_err!(
            EINVAL,
            "a key's note has at most {KEY_NOTE_MAX} bytes"
        ));
    }
    for r in [policy.uids, policy.gids].into_iter().flatten() {
        if r.lo > r.hi {
            return Err(crate::fs_err!(
                EINVAL,
                "id range {}-{} is empty",
                r.lo,
                r.hi
            ));
        }
    }
    Ok(())
}

/// Version of the message set below. A server refuses a client with another version.
/// 2: mutual authentication with key ids (client and server nonces, a server proof in the
/// welcome), server-derived session ids, key administration operations.
/// 3: many servers: the map version in every request, GetMap and Control, WRONG_SERVER
/// naming the owner.
/// 4: early replies (`Unsafe` and `Durable` frames, the incarnation in the welcome).
/// 5: leases and callbacks (`Auth::leases`, `Welcome::lease_ms`, `Callback` frames).
/// 6: replay tags (`Unsafe` frames carry one, `ReplyMode::Replay` sends it back).
pub const PROTOCOL_VERSION: u16 = 6;

/// First frame on every connection, server to client: a fresh nonce to prove the key against.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    pub version: u16,
    pub nonce: [u8; 32],
}

/// Client to server: who the client is and proof that it holds key `key_id`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Auth {
    pub version: u16,
    /// Which key the proof uses (0: the cluster key).
    pub key_id: u32,
    /// Names the client across its connections; with `key_id` it selects the session.
    pub client_id: u64,
    /// The client's fresh nonce, which the server's proof must cover.
    pub client_nonce: [u8; 32],
    /// `auth::prove_client` over both nonces, the key id and the client id.
    pub mac: [u8; 32],
    /// The client caches what replies show and asks for leases on it: the server then
    /// calls it back before another client's change to it becomes visible (see
    /// [`Invalidation`]). The mount asks; the library and the CLI do not.
    pub leases: bool,
}

impl Auth {
    /// The proof of `key` for a server's nonce, with the transcript the server's answer
    /// must be checked against.
    pub fn prove(
        key: &crate::auth::ClientKey,
        server_nonce: [u8; 32],
        client_nonce: [u8; 32],
        client_id: u64,
    ) -> (Auth, crate::auth::Transcript) {
        let t = crate::auth::Transcript {
            server_nonce,
            client_nonce,
            key_id: key.id,
            client_id,
        };
        let auth = Auth {
            version: PROTOCOL_VERSION,
            key_id: key.id,
            client_id,
            client_nonce,
            mac: crate::auth::prove_client(&key.key, &t),
            leases: false,
        };
        (auth, t)
    }
}

/// Server to client: the connection is authenticated and may send requests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub server_id: u64,
    /// The root directory's inode id.
    pub root: InodeId,
    /// Largest frame the server accepts.
    pub max_frame_bytes: u32,
    /// The session the server keeps for this client and key (`auth::session_id`).
    pub session: u64,
    /// `auth::prove_server` over the same transcript: the server holds the key too.
    pub mac: [u8; 32],
    /// Random per server process: a client that finds a different one after losing its
    /// connection knows the server restarted (and replays what it had acknowledged early).
    pub incarnation: u64,
    /// The server's journal LSN known durable when it welcomed the client.
    pub durable_lsn: u64,
    /// How long a lease lasts from the moment the server handles the request whose reply
    /// grants it (0: this connection holds no leases).
    pub lease_ms: u64,
}

/// What a client that holds leases must drop from its cache (a `Callback` frame carries a
/// list of them). After a crash or a lost connection the client drops everything itself.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Invalidation {
    /// The name `name` in directory `parent` (cached positive or negative).
    Entry {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: Vec<u8>,
    },
    /// The attributes and cached data of an inode.
    Inode { id: InodeId },
    /// Every name the client caches in directory `dir`, and the directory's attributes (a
    /// table leaving this server: the next one knows nothing of this client's cache).
    Names { dir: InodeId },
    /// Everything the client caches. The client library hands this to its callback handler
    /// when a connection that held leases ends (the server forgets them then).
    Everything,
    /// Not a drop: send the writes of inode `id` held back in the client (write-behind)
    /// and write through, holding nothing back, for `write_through_ms` from now. Another
    /// client is about to see the file's size or data (docs/ARCHITECTURE.md, "Coherent
    /// caching between mounts"). A callback frame carries these (or `Hold`) only, never
    /// with drops.
    Flush { id: InodeId, write_through_ms: u64 },
    /// Not a drop: the client may hold writes of inode `id` back again (ends the
    /// write-through of an earlier `Flush`: the leases it covered were called back).
    Hold { id: InodeId },
}

/// One request. `seq` is non-zero for operations that must not run twice: a retry carries
/// the same `seq` and is answered from the server's reply cache. `seq_floor` tells the
/// server that the client has the replies of all its requests below it, so their cache
/// entries can go (as NFSv4.1 session slots do); the cache then holds only what is in
/// flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub cred: Credentials,
    pub seq: u64,
    pub seq_floor: u64,
    /// Version of the delegation map the client routed this request by (0: none yet). A
    /// server that no longer serves the table answers WRONG_SERVER with a newer one.
    pub map_version: u64,
    /// When the reply may leave (see [`ReplyMode`]).
    pub mode: ReplyMode,
    pub op: Op,
}

impl Request {
    /// A request with no sequence number (not answered from the reply cache), routed by
    /// no map version yet, with durable replies.
    pub fn plain(cred: &Credentials, op: Op) -> Request {
        Request {
            cred: cred.clone(),
            seq: 0,
            seq_floor: 0,
            map_version: 0,
            mode: ReplyMode::default(),
            op,
        }
    }
}

/// When a server may answer a request that changes something (the mount's contract in
/// docs/ARCHITECTURE.md, "Early replies").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplyMode {
    /// Once the operation's journal record is durable.
    #[default]
    Durable,
    /// Once it is applied and its record queued: the reply is an `Unsafe` frame carrying
    /// the record's LSN, and a `Durable` frame follows when the journal holds it. The
    /// client keeps the request until then, to replay it if the server restarts.
    Early,
    /// A replay of a request first answered early, sent after the server restarted or the
    /// table failed over; answered once durable. `want_id` (0: none) is the inode the
    /// first reply created: the server gives the replayed create that id if it is free
    /// (and not far past its region's allocation point), so the client's (and the
    /// kernel's) references stay good. `tag` is the replay tag the early reply carried:
    /// a replay whose tag does not verify for this session, sequence number, operation,
    /// routing inode and `want_id` is refused (EPERM) and runs nowhere, so no client can
    /// pick ids or slip into a server's replay window by setting this mode.
    Replay {
        want_id: InodeId,
        tag: crate::auth::ReplayTag,
    },
}

/// Names of the operation kinds, indexed by [`Op::index`].
pub const OP_NAMES: [&str; 42] = [
    "lookup",
    "getattr",
    "setattr",
    "mknod",
    "mkdir",
    "symlink",
    "link",
    "unlink",
    "rmdir",
    "rename",
    "readlink",
    "readdir",
    "setxattr",
    "getxattr",
    "listxattr",
    "removexattr",
    "access",
    "statfs",
    "status",
    "fsck",
    "open",
    "create",
    "close",
    "read",
    "write",
    "fsync",
    "fallocate",
    "getlk",
    "setlk",
    "releaselocks",
    "endsession",
    "keyadd",
    "keylist",
    "keyrevoke",
    "getmap",
    "control",
    "closemany",
    "datagrant",
    "commitslices",
    "layout",
    "fscklinks",
    "fsckinodes",
];

/// Bytes of a name, serialized compactly.
pub type NameBuf = Vec<u8>;

/// The offset of a [`Op::Write`] that appends.
pub const WRITE_AT_END: u64 = u64::MAX;

/// A flag of [`Op::Open`] (a bit no open(2) flag uses): the client reopens a handle it
/// had, at a server that lost it (a restart, a failover), to finish or replay what it
/// wrote through it (NFSv4's reclaim after a server restart). The file's owner is then
/// not held to the mode bits: a file made read-only after it was opened for writing (a
/// create with mode 0444, as tar and git do) stays writable through its handle, as it is
/// on a local file system. That grants nothing new: the owner may chmod the file at any
/// time. Everyone else is checked as for any open.
pub const OPEN_RECLAIM: u32 = 1 << 31;

/// Every file-system operation a metadata server performs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    Lookup {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
    },
    GetAttr {
        id: InodeId,
    },
    SetAttr {
        id: InodeId,
        set: SetAttrs,
    },
    /// Creates a regular file, fifo, socket or device; `mode` carries the type bits.
    /// With `exclusive` false an existing regular file is returned instead of EEXIST.
    Mknod {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
        mode: u32,
        rdev: u32,
        exclusive: bool,
    },
    Mkdir {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
        mode: u32,
    },
    Symlink {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
        #[serde(with = "serde_bytes")]
        target: Vec<u8>,
    },
    Link {
        id: InodeId,
        new_parent: InodeId,
        #[serde(with = "serde_bytes")]
        new_name: NameBuf,
    },
    Unlink {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
    },
    Rmdir {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
    },
    Rename {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
        new_parent: InodeId,
        #[serde(with = "serde_bytes")]
        new_name: NameBuf,
        flags: u32,
    },
    Readlink {
        id: InodeId,
    },
    /// Entries after `cookie` (0 = from the start), at most `max_entries`.
    Readdir {
        id: InodeId,
        cookie: u64,
        max_entries: u32,
        plus: bool,
    },
    SetXattr {
        id: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
        flags: u32,
    },
    GetXattr {
        id: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
    },
    ListXattr {
        id: InodeId,
    },
    RemoveXattr {
        id: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
    },
    Access {
        id: InodeId,
        mask: u32,
    },
    StatFs,
    /// Server state for `kochab status`.
    Status,
    /// Checks the namespace invariants of every table (root only; linear in its size).
    Fsck,
    /// Opens inode `id` (permission checked for `flags`' access mode) as the client's
    /// handle `handle` (chosen by the client; opening it again is harmless).
    Open {
        id: InodeId,
        flags: u32,
        handle: u64,
    },
    /// Creates a regular file and opens it in one round trip; O_EXCL in `flags` makes an
    /// existing name an error, otherwise the existing file is opened.
    Create {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: NameBuf,
        mode: u32,
        flags: u32,
        handle: u64,
    },
    /// Closes a handle. The last close of an unlinked file removes it.
    Close {
        handle: u64,
    },
    Read {
        handle: u64,
        offset: u64,
        len: u32,
        /// Whether the read updates the file's access time (the mount's atime option).
        atime: AtimeRule,
    },
    /// Writes `data` at `offset`, or, at [`WRITE_AT_END`], at the end of the file as the
    /// server finds it (O_APPEND: no other write runs in between, so appends of several
    /// clients never overwrite each other); the reply's size says where it ended. Such an
    /// append carries a `seq`, and a retry with the same one is answered from the handle's
    /// last append instead of appending twice.
    Write {
        handle: u64,
        offset: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Makes the file's data and metadata durable.
    Fsync {
        handle: u64,
        datasync: bool,
    },
    Fallocate {
        handle: u64,
        offset: u64,
        len: u64,
        mode: u32,
    },
    /// The first lock that would conflict with `lock`, or an unlock if none.
    GetLk {
        handle: u64,
        lock: LockSpec,
    },
    /// Takes or releases a record lock or an flock; never waits (EAGAIN on conflict).
    SetLk {
        handle: u64,
        lock: LockSpec,
    },
    /// Releases every lock `owner` holds on the handle's inode (close of a descriptor).
    ReleaseLocks {
        handle: u64,
        owner: u64,
    },
    /// The client is going away: close its handles and release its locks now.
    EndSession,
    /// Makes a client key with this policy (admin key only); the reply carries it.
    KeyAdd {
        policy: KeyPolicy,
        /// What the key is for (at most `KEY_NOTE_MAX` bytes).
        note: String,
    },
    /// The cluster's client keys, without their secrets (admin key only).
    KeyList,
    /// Revokes a client key: refused from then on, its connections closed (admin key only).
    KeyRevoke {
        id: u32,
    },
    /// The delegation map this server knows (any server answers; clients route by it).
    GetMap,
    /// A coordinator's control message for this server (admin key only; served by the
    /// server's participant, never by the engine).
    Control {
        control: Control,
    },
    /// Closes several handles of this client at once, as [`Op::Close`] does each: a mount
    /// gathers the closes that have nothing to report (no locks, no writes held back).
    /// All are closed, or none: if a file's table is not served here (WrongServer) or a
    /// handle is unknown here (EBADF: opened elsewhere, or the server restarted), the client
    /// closes each by itself, routed by its file. At most [`CLOSE_MANY_HANDLES_MAX`]
    /// handles, each once (EINVAL otherwise, before any is looked at).
    CloseMany {
        handles: Vec<u64>,
    },
    /// Capabilities to create `objects` new slice objects of the handle's file (opened for
    /// writing), straight in the object store (see [`crate::layout`]). EOPNOTSUPP on a
    /// store the server writes itself (the local directory): the client then writes
    /// through [`Op::Write`].
    DataGrant {
        handle: u64,
        objects: u32,
    },
    /// Commits slices the client put under names it was granted, in one journal record:
    /// each becomes its chunk's newest ref, in the order given, and the file's size
    /// becomes at least `end` (its mtime and ctime now). Answered early like a write; a
    /// replay with the same sequence number is answered, not run again. At most
    /// [`COMMIT_SLICES_MAX`] slices.
    CommitSlices {
        handle: u64,
        slices: Vec<crate::layout::CommittedSlice>,
        end: u64,
    },
    /// The refs of chunks `[first_chunk, first_chunk + chunks)` of the handle's file, with
    /// URLs that get their objects (EOPNOTSUPP on a store the server reads itself). At
    /// most [`LAYOUT_CHUNKS_MAX`] chunks.
    Layout {
        handle: u64,
        first_chunk: u64,
        chunks: u32,
    },
    /// One page of the cross-server link facts of the tables this server holds, for the
    /// online check of links between servers (root only; see [`crate::links`]).
    FsckLinks {
        after: crate::links::LinksCursor,
    },
    /// The link facts of those of `ids` that lie in tables this server holds (root only;
    /// at most [`crate::links::FSCK_IDS_MAX`], EINVAL otherwise).
    FsckInodes {
        ids: Vec<InodeId>,
    },
}

/// Slices one [`Op::CommitSlices`] carries at most (its record stays a few KiB).
pub const COMMIT_SLICES_MAX: usize = 256;
/// Chunks one [`Op::Layout`] covers at most (1 GiB of a file: its URLs fit one frame).
pub const LAYOUT_CHUNKS_MAX: u32 = 256;

/// A byte-range lock: `[start, end]` inclusive (`end == u64::MAX` means to the end of the
/// file), held by `owner` (the kernel's lock owner: a process's file table for POSIX
/// fcntl locks, an open file description for OFD locks and flock).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockSpec {
    pub owner: u64,
    pub start: u64,
    pub end: u64,
    pub kind: LockKind,
    pub pid: u32,
    /// True for flock(2), false for fcntl(2) record locks: as on Linux the two never
    /// conflict with each other.
    pub flock: bool,
}

/// When a read sets a file's access time, as the atime mount options say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AtimeRule {
    /// noatime.
    Never,
    /// relatime (the default): when atime is not after mtime or ctime, or is a day old.
    #[default]
    Relative,
    /// strictatime: on every read.
    Always,
}

/// Lock types, as F_RDLCK, F_WRLCK, F_UNLCK.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LockKind {
    Read,
    Write,
    Unlock,
}

impl Op {
    /// A dense index of the operation kind (position in [`OP_NAMES`]).
    pub fn index(&self) -> usize {
        match self {
            Op::Lookup { .. } => 0,
            Op::GetAttr { .. } => 1,
            Op::SetAttr { .. } => 2,
            Op::Mknod { .. } => 3,
            Op::Mkdir { .. } => 4,
            Op::Symlink { .. } => 5,
            Op::Link { .. } => 6,
            Op::Unlink { .. } => 7,
            Op::Rmdir { .. } => 8,
            Op::Rename { .. } => 9,
            Op::Readlink { .. } => 10,
            Op::Readdir { .. } => 11,
            Op::SetXattr { .. } => 12,
            Op::GetXattr { .. } => 13,
            Op::ListXattr { .. } => 14,
            Op::RemoveXattr { .. } => 15,
            Op::Access { .. } => 16,
            Op::StatFs => 17,
            Op::Status => 18,
            Op::Fsck => 19,
            Op::Open { .. } => 20,
            Op::Create { .. } => 21,
            Op::Close { .. } => 22,
            Op::Read { .. } => 23,
            Op::Write { .. } => 24,
            Op::Fsync { .. } => 25,
            Op::Fallocate { .. } => 26,
            Op::GetLk { .. } => 27,
            Op::SetLk { .. } => 28,
            Op::ReleaseLocks { .. } => 29,
            Op::EndSession => 30,
            Op::KeyAdd { .. } => 31,
            Op::KeyList => 32,
            Op::KeyRevoke { .. } => 33,
            Op::GetMap => 34,
            Op::Control { .. } => 35,
            Op::CloseMany { .. } => 36,
            Op::DataGrant { .. } => 37,
            Op::CommitSlices { .. } => 38,
            Op::Layout { .. } => 39,
            Op::FsckLinks { .. } => 40,
            Op::FsckInodes { .. } => 41,
        }
    }

    /// A short, stable name for metrics and logs.
    pub fn name(&self) -> &'static str {
        OP_NAMES[self.index()]
    }

    /// True for the key administration operations (admin key only; served by the
    /// connection layer, never by the engine).
    pub fn is_key_admin(&self) -> bool {
        matches!(self, Op::KeyAdd { .. } | Op::KeyList | Op::KeyRevoke { .. })
    }

    /// True for the operations of the cluster layer (served by the server around the
    /// engine, never by it): GetMap, and Control (admin key only).
    pub fn is_cluster(&self) -> bool {
        matches!(self, Op::GetMap | Op::Control { .. })
    }

    /// True if the operation changes the namespace and so must not run twice on a retry.
    pub fn needs_reply_cache(&self) -> bool {
        matches!(
            self,
            Op::Mknod { .. }
                | Op::Mkdir { .. }
                | Op::Symlink { .. }
                | Op::Link { .. }
                | Op::Unlink { .. }
                | Op::Rmdir { .. }
                | Op::Rename { .. }
                | Op::SetXattr { .. }
                | Op::RemoveXattr { .. }
                | Op::Create { .. }
        )
    }

    /// The inode a replay tag binds the request to: the first inode it names by id (the
    /// parent of a creation or removal, the inode of a change), 0 for one naming none
    /// (operations on handles).
    pub fn replay_route(&self) -> InodeId {
        self.inode_ids()[0].unwrap_or(0)
    }

    /// The inodes the operation names by id (directories by name are not resolved here).
    pub fn inode_ids(&self) -> [Option<InodeId>; 2] {
        match *self {
            Op::Lookup { parent, .. }
            | Op::Mknod { parent, .. }
            | Op::Mkdir { parent, .. }
            | Op::Symlink { parent, .. }
            | Op::Unlink { parent, .. }
            | Op::Rmdir { parent, .. }
            | Op::Create { parent, .. } => [Some(parent), None],
            Op::Rename {
                parent, new_parent, ..
            } => [Some(parent), Some(new_parent)],
            Op::Link { id, new_parent, .. } => [Some(id), Some(new_parent)],
            Op::GetAttr { id }
            | Op::SetAttr { id, .. }
            | Op::Readlink { id }
            | Op::Readdir { id, .. }
            | Op::SetXattr { id, .. }
            | Op::GetXattr { id, .. }
            | Op::ListXattr { id }
            | Op::RemoveXattr { id, .. }
            | Op::Access { id, .. }
            | Op::Open { id, .. } => [Some(id), None],
            _ => [None, None],
        }
    }

    /// The open handle the operation acts through, for the operations that name one (they
    /// reach an inode only through it: whoever routes or admits them looks the handle up).
    pub fn handle(&self) -> Option<u64> {
        match *self {
            Op::Close { handle }
            | Op::Read { handle, .. }
            | Op::Write { handle, .. }
            | Op::Fsync { handle, .. }
            | Op::Fallocate { handle, .. }
            | Op::GetLk { handle, .. }
            | Op::SetLk { handle, .. }
            | Op::ReleaseLocks { handle, .. }
            | Op::DataGrant { handle, .. }
            | Op::CommitSlices { handle, .. }
            | Op::Layout { handle, .. } => Some(handle),
            _ => None,
        }
    }

    /// The directories whose entries the operation adds or removes: a successful reply
    /// carries their attributes afterwards (see [`Reply::WithDirs`]).
    pub fn changed_dirs(&self) -> [Option<InodeId>; 2] {
        match *self {
            Op::Mknod { parent, .. }
            | Op::Mkdir { parent, .. }
            | Op::Symlink { parent, .. }
            | Op::Unlink { parent, .. }
            | Op::Rmdir { parent, .. }
            | Op::Create { parent, .. } => [Some(parent), None],
            Op::Link { new_parent, .. } => [Some(new_parent), None],
            Op::Rename {
                parent, new_parent, ..
            } => [Some(parent), (new_parent != parent).then_some(new_parent)],
            _ => [None, None],
        }
    }

    /// True if the operation changes nothing on the servers (handle operations aside,
    /// which change regular files only).
    pub fn is_read_only(&self) -> bool {
        matches!(
            self,
            Op::Lookup { .. }
                | Op::GetAttr { .. }
                | Op::Readlink { .. }
                | Op::Readdir { .. }
                | Op::GetXattr { .. }
                | Op::ListXattr { .. }
                | Op::Access { .. }
                | Op::StatFs
                | Op::Status
                | Op::Fsck
                | Op::FsckLinks { .. }
                | Op::FsckInodes { .. }
                | Op::Read { .. }
                | Op::GetLk { .. }
        )
    }
}

/// The answer to one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Lookup, create, mkdir, mknod, symlink, link: the (new) inode.
    Entry(Attr),
    Attr(Attr),
    Empty,
    #[serde(with = "serde_bytes")]
    Bytes(Vec<u8>),
    Dir {
        entries: Vec<DirEntry>,
        /// True when no entry follows the last one returned.
        eof: bool,
    },
    StatFs(StatFs),
    Status(StatusReport),
    /// Invariant violations found by fsck (empty when consistent).
    Problems(Vec<String>),
    /// GetLk: the conflicting lock, or `LockKind::Unlock` if there is none.
    Lock(LockSpec),
    Error(FsError),
    /// The server does not serve a table this operation needs (now): retry at `owner`
    /// (at `addr`) when the server knows it, else refresh the map (at least `map_version`)
    /// and retry after a pause (the table is moving or being loaded).
    WrongServer {
        map_version: u64,
        owner: Option<ServerId>,
        addr: Option<String>,
    },
    /// A namespace change's reply with the attributes of the directories it changed, as
    /// they were right after it (the FUSE client answers the kernel's next getattr of
    /// those directories from them instead of asking again).
    WithDirs {
        reply: Box<Reply>,
        dirs: Vec<Attr>,
    },
    /// The bytes of a read that set the file's access time (so cached attributes are old).
    ReadAtime(#[serde(with = "serde_bytes")] Vec<u8>),
    /// KeyAdd: the new key (its secret leaves the server this once).
    KeyAdded {
        id: u32,
        key: [u8; 32],
    },
    /// KeyList.
    Keys(Vec<KeyInfo>),
    /// Lookup whose name exists but names an inode another server holds: the caller asks
    /// that inode's owner for its attributes (as NFS clients follow LOOKUP with GETATTR).
    Child {
        id: InodeId,
    },
    /// GetMap.
    Map(DelegationMap),
    /// Control: the participant's answer, if it has one yet (the coordinator resends).
    Control(Option<ControlReply>),
    /// DataGrant.
    Grant(crate::layout::Grant),
    /// Layout.
    Layout(crate::layout::Layout),
    /// FsckLinks.
    Links(crate::links::LinksPage),
    /// FsckInodes: the facts of the asked inodes the server holds, in the order asked.
    InodeLinks(Vec<crate::links::InodeLinks>),
}

impl Reply {
    /// The inode a successful reply created or names (0: none): what a replay of its
    /// request asks for again, and what its replay tag binds.
    pub fn created(&self) -> InodeId {
        match self {
            Reply::Entry(a) => a.id,
            Reply::WithDirs { reply, .. } => reply.created(),
            _ => 0,
        }
    }

    /// Builds an error reply.
    pub fn err(e: FsError) -> Reply {
        Reply::Error(e)
    }

    /// Checks that every attribute set in the reply names a file type: attributes come from
    /// the network, and a mode without a type would otherwise have to be guessed at.
    pub fn check_attrs(&self) -> Result<(), FsError> {
        let bad = |a: &Attr| a.kind().is_none();
        let found = match self {
            Reply::Entry(a) | Reply::Attr(a) => bad(a),
            Reply::Dir { entries, .. } => entries.iter().filter_map(|e| e.attr.as_ref()).any(bad),
            Reply::WithDirs { reply, dirs } => {
                reply.check_attrs()?;
                dirs.iter().any(bad)
            }
            _ => false,
        };
        if found {
            return Err(crate::fs_err!(
                EIO,
                "the server sent attributes whose mode names no file type"
            ));
        }
        Ok(())
    }

    /// The attributes of the inode an entry reply (a lookup or a creation) shows, past the
    /// directory attributes a namespace change adds.
    pub fn entry(&self) -> Option<&Attr> {
        match self {
            Reply::Entry(a) => Some(a),
            Reply::WithDirs { reply, .. } => reply.entry(),
            _ => None,
        }
    }

    /// The reply without the directory attributes a namespace change adds.
    pub fn without_dirs(self) -> Reply {
        match self {
            Reply::WithDirs { reply, .. } => *reply,
            other => other,
        }
    }
}

/// One table (inode-id range) as a server reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableStatus {
    pub lo: InodeId,
    pub hi: InodeId,
    pub region: String,
    pub inodes: u64,
    pub dentries: u64,
    /// Log sequence number from which this table's journal replay starts.
    pub checkpoint_lsn: u64,
}

/// What `kochab status` shows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    pub server_id: u64,
    /// The serving process (an operator or a benchmark puts it in a cgroup by it).
    pub pid: u32,
    /// This incarnation's epoch (its journal is `journal/<server_id>.<epoch>`).
    pub epoch: u64,
    /// The coordinator replicas this server follows (none for a single server).
    pub coordinators: Vec<String>,
    pub uptime_ms: u64,
    pub tables: Vec<TableStatus>,
    pub inodes: u64,
    pub dentries: u64,
    pub journal_bytes: u64,
    pub journal_segments: u64,
    pub applied_lsn: u64,
    pub durable_lsn: u64,
    pub rss_bytes: u64,
    pub connections: u64,
    pub durable_mode: bool,
    /// Where the metadata is durable: the data directory's own store, or a store on S3
    /// (its URL and endpoint, and what its engine's self-test found at start).
    pub store: String,
    /// File data as slice objects (issue 31), since this process started.
    pub slices: SliceCounters,
}

/// What a server did with slice objects since it started (all zero on a store the server
/// writes in place).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceCounters {
    /// Objects no ref named any more (overwritten, truncated, compacted), deleted once the
    /// change that dropped them was durable.
    pub freed_deleted: u64,
    /// Objects never committed (orphans), found and deleted by the garbage collector.
    pub orphans_deleted: u64,
    /// Chunks compacted into one object.
    pub chunks_compacted: u64,
    /// Garbage-collection passes finished.
    pub gc_passes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Errno;

    fn attr(mode: u32) -> Attr {
        Attr::new(7, mode, 1)
    }

    #[test]
    fn attributes_without_a_file_type_are_refused_not_guessed() {
        // The old Attr::kind called any mode without type bits a regular file.
        assert_eq!(attr(0o644).kind(), None);
        assert_eq!(attr(mode::S_IFDIR | 0o755).kind(), Some(FileKind::Dir));
        let bad = attr(0o644);
        let good = attr(mode::S_IFREG | 0o644);
        assert!(Reply::Attr(good.clone()).check_attrs().is_ok());
        assert_eq!(
            Reply::Entry(bad.clone()).check_attrs().map_err(|e| e.errno),
            Err(Errno::EIO)
        );
        let entry = |a: Option<Attr>| DirEntry {
            cookie: 3,
            name: b"x".to_vec(),
            id: 7,
            kind: FileKind::File,
            attr: a,
        };
        let dir = |a| Reply::Dir {
            entries: vec![entry(a)],
            eof: true,
        };
        assert!(dir(None).check_attrs().is_ok(), "no attributes is explicit");
        assert!(dir(Some(bad.clone())).check_attrs().is_err());
        let with = Reply::WithDirs {
            reply: Box::new(Reply::Entry(good)),
            dirs: vec![bad],
        };
        assert!(with.check_attrs().is_err());
    }
}

//! Power loss for tests: the local store records what a crash could still take away, and
//! [`lose_unsynced`] takes it away.
//!
//! A SIGKILL keeps the page cache: every write a killed process made reads back after it,
//! synced or not, so a missing fsync never shows in a test that only kills processes. In
//! this test mode (a process whose environment has `KOCHAB_TEST_CRASH_SIM=1` when it opens
//! a [`crate::LocalStore`], or that called [`record_in_this_process`]; off otherwise) the
//! local store keeps, beside the store (`<root>.crashsim`), what it needs to undo each
//! change that is not durable yet:
//!
//! - a write, truncation or hole punched in an object: the bytes and the length it
//!   replaced (an undo log per inode), until an fdatasync of the object makes it durable.
//!   A write through a descriptor that has O_DSYNC is durable when it returns; the flag is
//!   read back from the descriptor (F_GETFL), so a store that stops asking for it is
//!   noticed.
//! - a name created, removed or renamed: the operation (a removed or replaced object kept
//!   alive by a hard link), until an fsync of its folder that began after it.
//!
//! [`lose_unsynced`], called by a test while the writer is stopped (SIGSTOP, or idle in
//! process) and before it is killed, undoes all of that for one process or for all: each
//! object back to its last synced state ([`Loss::Drop`]), or with each 4 KiB block of an
//! unsynced write kept or undone at random, and the length kept or undone at random
//! ([`Loss::Tear`], as a disk that reorders and tears writes leaves them). Both are states
//! a power cut can leave on a real file system (CrashMonkey and ALICE replay such crash
//! states; FoundationDB's simulated disks lose unsynced data the same way), so whatever was
//! acknowledged as durable must survive each.
//!
//! Simplifications, each of which only keeps more than a crash must (so the states made
//! are still ones a crash can leave, and a test can miss a bug but never invent one):
//! folders are durable as soon as they are made; a rename counts as durable once its
//! destination folder is synced; an operation counts as durable when a folder sync began
//! after it was recorded (just before it ran); a write racing a sync of the same object
//! from another process may count as durable. Files outside the object store (the cluster
//! key, the coordinator's raft log) are not covered.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The environment variable that turns recording on in a process (value `1`).
pub const ENV: &str = "KOCHAB_TEST_CRASH_SIM";

/// Unit in which [`Loss::Tear`] keeps or undoes an unsynced write: a page, the most a
/// disk writes atomically that a file system relies on.
pub const TEAR_BLOCK: u64 = 4096;

static IN_THIS_PROCESS: AtomicBool = AtomicBool::new(false);
/// Makes names of hard links that keep removed objects alive unique within a process.
static GRAVE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Turns recording on for every local store this process opens from now on (in-process
/// tests, which cannot set the environment of a process already running threads).
pub fn record_in_this_process() {
    IN_THIS_PROCESS.store(true, Ordering::SeqCst);
}

/// True if a local store opened now records.
pub(crate) fn enabled() -> bool {
    IN_THIS_PROCESS.load(Ordering::SeqCst) || std::env::var(ENV).is_ok_and(|v| v == "1")
}

/// How a power loss treats what was not synced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// Every object back to its last synced state, every unsynced name change undone.
    Drop,
    /// Names as with `Drop`; of each unsynced write, every 4 KiB block kept or undone at
    /// random, and the length kept or undone at random (seeded, so a run repeats).
    Tear { seed: u64 },
}

/// Whose unsynced changes are lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whose {
    /// One process's: it must still exist (stopped), since its start time tells its
    /// records from those of an earlier process with the same pid.
    Process(u32),
    /// Every process's (a power cut of the machine; every writer must be stopped or dead).
    All,
}

/// What a loss undid.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LossReport {
    /// Unsynced writes, truncations and holes undone (in part, when torn).
    pub writes_undone: u64,
    /// Bytes put back by them.
    pub bytes_undone: u64,
    /// Unsynced name changes undone.
    pub names_undone: u64,
}

impl std::ops::AddAssign for LossReport {
    fn add_assign(&mut self, o: LossReport) {
        self.writes_undone += o.writes_undone;
        self.bytes_undone += o.bytes_undone;
        self.names_undone += o.names_undone;
    }
}

/// Where the records of the store at `root` are kept.
pub fn side_dir(root: &Path) -> PathBuf {
    let mut name = root.file_name().unwrap_or_default().to_os_string();
    name.push(".crashsim");
    root.with_file_name(name)
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the machine, so the
/// records of one process can be ordered against the folder syncs of another.
pub(crate) fn now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `pid.starttime`: a process, told apart from earlier ones that had its pid.
fn process_id(pid: u32) -> io::Result<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let start = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(19))
        .ok_or_else(|| io::Error::other(format!("unreadable /proc/{pid}/stat")))?;
    Ok(format!("{pid}.{start}"))
}

/// A folder (relative to the store's root, "" for the root) as part of a file name.
fn encode_dir(dir: &str) -> String {
    if dir.is_empty() {
        "%".to_string()
    } else {
        dir.replace('/', "%")
    }
}

fn parent_of(rel: &str) -> &str {
    rel.rsplit_once('/').map_or("", |(d, _)| d)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn bad(what: &str) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, format!("crash simulation: {what}"))
}

/// A removed or replaced object kept alive until the folder sync that makes its removal
/// durable.
struct Pending {
    /// The folder whose sync makes the change durable.
    dir: String,
    at: u64,
    grave: PathBuf,
}

/// The recording side of one local store in one process.
pub(crate) struct Recorder {
    root: PathBuf,
    side: PathBuf,
    /// This process's records: `side/proc/<pid>.<start>`.
    me: PathBuf,
    process: String,
    inode_locks: Mutex<HashMap<u64, Arc<Mutex<()>>>>,
    pending: Mutex<Vec<Pending>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recorder({})", self.me.display())
    }
}

/// Record kinds of an undo log.
const UNDO: u8 = 1;
const PIN: u8 = 2;
/// kind, length before, offset, byte count.
const UNDO_HEADER: usize = 1 + 8 + 8 + 8;

impl Recorder {
    pub(crate) fn new(root: &Path) -> io::Result<Recorder> {
        let side = side_dir(root);
        let process = process_id(std::process::id())?;
        let me = side.join("proc").join(&process);
        fs::create_dir_all(me.join("undo"))?;
        fs::create_dir_all(me.join("grave"))?;
        fs::create_dir_all(side.join("dirsync"))?;
        Ok(Recorder {
            root: root.to_path_buf(),
            side,
            me,
            process,
            inode_locks: Mutex::new(HashMap::new()),
            pending: Mutex::new(Vec::new()),
        })
    }

    fn rel(&self, path: &Path) -> io::Result<String> {
        path.strip_prefix(&self.root)
            .ok()
            .and_then(|p| p.to_str())
            .map(str::to_string)
            .ok_or_else(|| bad(&format!("{} is outside the store", path.display())))
    }

    fn log_line(&self, line: &str) -> io::Result<()> {
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.me.join("ns"))?;
        f.write_all(line.as_bytes())
    }

    fn new_grave(&self) -> PathBuf {
        self.me
            .join("grave")
            .join(GRAVE_COUNTER.fetch_add(1, Ordering::Relaxed).to_string())
    }

    /// `path` was just created (or linked): undone unless its folder is synced after.
    pub(crate) fn created(&self, path: &Path, at: u64) -> io::Result<()> {
        let ino = fs::symlink_metadata(path)?.ino();
        self.log_line(&format!("C {at} {ino} {}\n", self.rel(path)?))
    }

    /// Removes `path`, recorded so that a loss can bring it back.
    pub(crate) fn remove(&self, path: &Path) -> io::Result<()> {
        let ino = fs::symlink_metadata(path)?.ino();
        let grave = self.new_grave();
        fs::hard_link(path, &grave)?;
        let rel = self.rel(path)?;
        let at = now();
        self.log_line(&format!(
            "R {at} {ino} {rel} {}\n",
            grave.file_name().and_then(|g| g.to_str()).unwrap_or("")
        ))?;
        lock(&self.pending).push(Pending {
            dir: parent_of(&rel).to_string(),
            at,
            grave,
        });
        fs::remove_file(path)
    }

    /// Renames `from` to `to` (replacing it), recorded so that a loss can undo it.
    pub(crate) fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let ino = fs::symlink_metadata(from)?.ino();
        let grave = match fs::symlink_metadata(to) {
            Ok(_) => {
                let g = self.new_grave();
                fs::hard_link(to, &g)?;
                Some(g)
            }
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        let (rf, rt) = (self.rel(from)?, self.rel(to)?);
        let at = now();
        let g = grave
            .as_ref()
            .and_then(|g| g.file_name())
            .and_then(|g| g.to_str())
            .unwrap_or("-");
        self.log_line(&format!("M {at} {ino} {rf} {rt} {g}\n"))?;
        if let Some(grave) = grave {
            lock(&self.pending).push(Pending {
                dir: parent_of(&rt).to_string(),
                at,
                grave,
            });
        }
        fs::rename(from, to)
    }

    /// Records that a sync of folder `dir` that began at `began` returned: name changes in
    /// it recorded before are durable, and the objects they removed may go.
    pub(crate) fn dir_synced(&self, dir: &Path, began: u64) -> io::Result<()> {
        let rel = self.rel(dir)?;
        let marker =
            self.side
                .join("dirsync")
                .join(format!("{}@{}", self.process, encode_dir(&rel)));
        let tmp = marker.with_extension("new");
        fs::write(&tmp, began.to_string())?;
        fs::rename(&tmp, &marker)?;
        let done: Vec<Pending> = {
            let mut pending = lock(&self.pending);
            let (done, keep) = pending
                .drain(..)
                .partition(|p| p.dir == rel && p.at < began);
            *pending = keep;
            done
        };
        for p in done {
            self.bury(&p.grave)?;
        }
        Ok(())
    }

    /// Drops the last link that kept a removed object; when that frees its inode, every
    /// undo log of it goes first (the inode number may be reused at once).
    fn bury(&self, grave: &Path) -> io::Result<()> {
        let meta = match fs::symlink_metadata(grave) {
            Ok(m) => m,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if meta.nlink() == 1 {
            self.forget_inode(meta.ino())?;
        }
        fs::remove_file(grave)
    }

    /// Removes the undo logs of inode `ino` of every process.
    fn forget_inode(&self, ino: u64) -> io::Result<()> {
        let procs = match fs::read_dir(self.side.join("proc")) {
            Ok(rd) => rd,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        for p in procs {
            let undo = p?.path().join("undo");
            for name in [ino.to_string(), format!("{ino}.syncing")] {
                match fs::remove_file(undo.join(name)) {
                    Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn inode_lock(&self, ino: u64) -> Arc<Mutex<()>> {
        lock(&self.inode_locks).entry(ino).or_default().clone()
    }

    fn append_undo(
        &self,
        ino: u64,
        kind: u8,
        len_before: u64,
        offset: u64,
        bytes: &[u8],
    ) -> io::Result<()> {
        let mut rec = Vec::with_capacity(UNDO_HEADER + bytes.len());
        rec.push(kind);
        rec.extend_from_slice(&len_before.to_le_bytes());
        rec.extend_from_slice(&offset.to_le_bytes());
        rec.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        rec.extend_from_slice(bytes);
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.me.join("undo").join(ino.to_string()))?;
        f.write_all(&rec)
    }

    /// Runs `change`, which replaces `[offset, end)` of the object (and sets its length to
    /// `new_len` if given), after recording what it replaces.
    pub(crate) fn change<T>(
        &self,
        obj: &SimFile,
        offset: u64,
        end: u64,
        new_len: Option<u64>,
        change: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        let l = self.inode_lock(obj.ino);
        let _g = lock(&l);
        let len = obj.plain.metadata()?.len();
        // What a truncation cuts off is replaced too.
        let start = match new_len {
            Some(n) => offset.min(n),
            None => offset,
        };
        let stop = end.min(len);
        let mut old = vec![0u8; stop.saturating_sub(start) as usize];
        if !old.is_empty() {
            obj.plain.read_exact_at(&mut old, start)?;
        }
        self.append_undo(obj.ino, UNDO, len, start, &old)?;
        change()
    }

    /// A write through an O_DSYNC descriptor returned: durable, whatever is undone around
    /// it. Only an object with unsynced changes before it needs the bytes kept (undoing
    /// those would overwrite them); a later unsynced write keeps them as what it replaced.
    /// So a journal segment, zero-filled and synced before its first record, logs nothing.
    pub(crate) fn pinned(&self, obj: &SimFile, offset: u64, data: &[u8]) -> io::Result<()> {
        let l = self.inode_lock(obj.ino);
        let _g = lock(&l);
        let undo = self.me.join("undo");
        let ino = obj.ino;
        if !undo.join(ino.to_string()).exists() && !undo.join(format!("{ino}.syncing")).exists() {
            return Ok(());
        }
        self.append_undo(obj.ino, PIN, 0, offset, data)
    }

    /// Runs `sync` (an fdatasync or fsync of the object): what was written before it began
    /// is durable once it returns.
    pub(crate) fn sync(&self, ino: u64, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        let l = self.inode_lock(ino);
        let _g = lock(&l);
        let undo = self.me.join("undo");
        let log = undo.join(ino.to_string());
        let syncing = undo.join(format!("{ino}.syncing"));
        match fs::rename(&log, &syncing) {
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        sync()?;
        self.forget_inode(ino)
    }
}

/// An object's descriptor as the recorder sees it.
pub(crate) struct SimFile {
    pub(crate) ino: u64,
    /// The descriptor has O_DSYNC: its writes are durable when they return.
    pub(crate) dsync: bool,
    /// A second, buffered descriptor of the same inode, to read what a write replaces
    /// (the object's own may be O_DIRECT, which needs aligned buffers).
    plain: File,
}

impl SimFile {
    pub(crate) fn of(file: &File) -> io::Result<SimFile> {
        let fd = file.as_raw_fd();
        // SAFETY: F_GETFL on a descriptor this process owns; no memory is passed.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let plain = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(format!("/proc/self/fd/{fd}"))?;
        Ok(SimFile {
            ino: file.metadata()?.ino(),
            dsync: flags & libc::O_DSYNC == libc::O_DSYNC,
            plain,
        })
    }
}

/// Takes away what was not durable in the store at `root` (see the module): of the stopped
/// process `pid`, or of every process. The writers must not run meanwhile.
pub fn lose_unsynced(root: &Path, whose: Whose, loss: Loss) -> io::Result<LossReport> {
    let side = side_dir(root);
    let procs_dir = side.join("proc");
    let mut procs: Vec<PathBuf> = match fs::read_dir(&procs_dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) if e.kind() == ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e),
    };
    if let Whose::Process(pid) = whose {
        let id = process_id(pid).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("process {pid} must still exist (stopped) for its loss: {e}"),
            )
        })?;
        procs.retain(|p| p.file_name().and_then(|n| n.to_str()) == Some(id.as_str()));
    }
    procs.sort();
    let synced = folder_syncs(&side)?;
    let mut rng = Rng(match loss {
        Loss::Drop => 1,
        Loss::Tear { seed } => seed | 1,
    });
    let mut report = LossReport::default();
    for p in &procs {
        report.names_undone += undo_names(root, p, &synced)?;
    }
    let inodes = inode_paths(root, &procs_dir)?;
    for p in &procs {
        report += undo_contents(p, &inodes, loss, &mut rng)?;
    }
    for p in &procs {
        fs::remove_dir_all(p)?;
    }
    if whose == Whose::All {
        // Every record is gone: no marker has anything left to order.
        match fs::remove_dir_all(side.join("dirsync")) {
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(report)
}

/// Folder (relative) -> when its latest sync began, over every process.
fn folder_syncs(side: &Path) -> io::Result<HashMap<String, u64>> {
    let mut out: HashMap<String, u64> = HashMap::new();
    let rd = match fs::read_dir(side.join("dirsync")) {
        Ok(rd) => rd,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for e in rd {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((_, enc)) = name.split_once('@') else {
            continue;
        };
        if enc.ends_with(".new") {
            continue;
        }
        let dir = if enc == "%" {
            String::new()
        } else {
            enc.replace('%', "/")
        };
        let Ok(at) = fs::read_to_string(e.path())?.trim().parse::<u64>() else {
            continue;
        };
        let v = out.entry(dir).or_default();
        *v = (*v).max(at);
    }
    Ok(out)
}

fn ino_at(path: &Path) -> Option<u64> {
    fs::symlink_metadata(path).ok().map(|m| m.ino())
}

/// Undoes, newest first, the name changes of one process that no folder sync made durable.
fn undo_names(root: &Path, proc_dir: &Path, synced: &HashMap<String, u64>) -> io::Result<u64> {
    let text = match fs::read_to_string(proc_dir.join("ns")) {
        Ok(t) => t,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let durable = |rel: &str, at: u64| synced.get(parent_of(rel)).is_some_and(|&s| s > at);
    let grave = |g: &str| proc_dir.join("grave").join(g);
    let mut undone = 0;
    // A line cut by the kill (no newline) was never acted on.
    let complete = text.rsplit_once('\n').map_or("", |(done, _)| done);
    for line in complete.lines().rev() {
        let f: Vec<&str> = line.split(' ').collect();
        let parse = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
        let (Some(at), Some(ino)) = (parse(1), parse(2)) else {
            return Err(bad(&format!("unreadable record {line:?}")));
        };
        match (f[0], f.len()) {
            ("C", 4) if !durable(f[3], at) => {
                let path = root.join(f[3]);
                if ino_at(&path) == Some(ino) {
                    fs::remove_file(&path)?;
                    undone += 1;
                }
            }
            ("R", 5) if !durable(f[3], at) => {
                let path = root.join(f[3]);
                if ino_at(&path).is_none() && grave(f[4]).exists() {
                    if let Some(p) = path.parent() {
                        fs::create_dir_all(p)?;
                    }
                    fs::hard_link(grave(f[4]), &path)?;
                    undone += 1;
                }
            }
            ("M", 6) if !durable(f[4], at) => {
                let (from, to) = (root.join(f[3]), root.join(f[4]));
                if ino_at(&to) == Some(ino) {
                    if let Some(p) = from.parent() {
                        fs::create_dir_all(p)?;
                    }
                    fs::rename(&to, &from)?;
                    undone += 1;
                }
                if f[5] != "-" && ino_at(&to).is_none() && grave(f[5]).exists() {
                    fs::hard_link(grave(f[5]), &to)?;
                }
            }
            ("C", 4) | ("R", 5) | ("M", 6) => {}
            _ => return Err(bad(&format!("unreadable record {line:?}"))),
        }
    }
    Ok(undone)
}

/// Inode -> a path of it: every object in the store, and the removed ones kept alive.
fn inode_paths(root: &Path, procs_dir: &Path) -> io::Result<HashMap<u64, PathBuf>> {
    fn walk(dir: &Path, out: &mut HashMap<u64, PathBuf>) -> io::Result<()> {
        let rd = match fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        for e in rd {
            let e = e?;
            let m = fs::symlink_metadata(e.path())?;
            if m.is_dir() {
                walk(&e.path(), out)?;
            } else if m.is_file() {
                out.entry(m.ino()).or_insert_with(|| e.path());
            }
        }
        Ok(())
    }
    let mut out = HashMap::new();
    walk(root, &mut out)?;
    if let Ok(rd) = fs::read_dir(procs_dir) {
        for p in rd {
            walk(&p?.path().join("grave"), &mut out)?;
        }
    }
    Ok(out)
}

/// One record of an undo log.
struct UndoRecord {
    kind: u8,
    len_before: u64,
    offset: u64,
    bytes: Vec<u8>,
}

fn parse_undo(buf: &[u8]) -> Vec<UndoRecord> {
    let mut out = Vec::new();
    let mut off = 0;
    // A record cut by the kill was written before its change, which so never ran.
    while buf.len() - off >= UNDO_HEADER {
        let word =
            |i: usize| u64::from_le_bytes(buf[off + i..off + i + 8].try_into().unwrap_or([0; 8]));
        let (kind, len_before, offset, n) = (buf[off], word(1), word(9), word(17));
        let Some(end) = usize::try_from(n)
            .ok()
            .and_then(|n| (off + UNDO_HEADER).checked_add(n))
            .filter(|&e| e <= buf.len())
        else {
            break;
        };
        out.push(UndoRecord {
            kind,
            len_before,
            offset,
            bytes: buf[off + UNDO_HEADER..end].to_vec(),
        });
        off = end;
    }
    out
}

/// Puts back, newest first, what one process's unsynced changes replaced, then writes
/// again what its O_DSYNC writes made durable.
fn undo_contents(
    proc_dir: &Path,
    inodes: &HashMap<u64, PathBuf>,
    loss: Loss,
    rng: &mut Rng,
) -> io::Result<LossReport> {
    let mut logs: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let rd = match fs::read_dir(proc_dir.join("undo")) {
        Ok(rd) => rd,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(LossReport::default()),
        Err(e) => return Err(e),
    };
    let mut files: Vec<(u64, bool, PathBuf)> = Vec::new();
    for e in rd {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let (ino, syncing) = match name.strip_suffix(".syncing") {
            Some(i) => (i, true),
            None => (name.as_str(), false),
        };
        let Ok(ino) = ino.parse::<u64>() else {
            continue;
        };
        files.push((ino, !syncing, e.path()));
    }
    // Per inode the log that a sync was taking (older) before the one written since.
    files.sort();
    for (ino, _, path) in files {
        logs.entry(ino).or_default().extend(fs::read(path)?);
    }
    let mut report = LossReport::default();
    for (ino, log) in logs {
        let Some(path) = inodes.get(&ino) else {
            // Gone with its name: nothing reads it any more.
            continue;
        };
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        let records = parse_undo(&log);
        for r in records.iter().rev().filter(|r| r.kind == UNDO) {
            let mut put_back = 0u64;
            match loss {
                Loss::Drop => {
                    f.write_all_at(&r.bytes, r.offset)?;
                    put_back = r.bytes.len() as u64;
                    f.set_len(r.len_before)?;
                }
                Loss::Tear { .. } => {
                    let mut at = 0u64;
                    while at < r.bytes.len() as u64 {
                        // Blocks of the file, not of the record.
                        let block_end = ((r.offset + at) / TEAR_BLOCK + 1) * TEAR_BLOCK;
                        let n = (block_end - r.offset - at).min(r.bytes.len() as u64 - at);
                        if rng.next() & 1 == 0 {
                            let s = at as usize;
                            f.write_all_at(&r.bytes[s..s + n as usize], r.offset + at)?;
                            put_back += n;
                        }
                        at += n;
                    }
                    let len = f.metadata()?.len();
                    if len != r.len_before && rng.next() & 1 == 0 {
                        f.set_len(r.len_before)?;
                    } else if len > r.len_before {
                        // The length stays: what the undone write put past the old end
                        // reads as zeros or as written, block by block.
                        let mut at = r.len_before;
                        while at < len {
                            let n = (TEAR_BLOCK - at % TEAR_BLOCK).min(len - at);
                            if rng.next() & 1 == 0 {
                                f.write_all_at(&vec![0u8; n as usize], at)?;
                            }
                            at += n;
                        }
                    }
                }
            }
            report.writes_undone += 1;
            report.bytes_undone += put_back;
        }
        for r in records.iter().filter(|r| r.kind == PIN) {
            f.write_all_at(&r.bytes, r.offset)?;
        }
    }
    Ok(report)
}

/// xorshift64*, seeded: a torn loss repeats for its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalStore, ObjectStore};

    fn store(dir: &Path) -> LocalStore {
        record_in_this_process();
        LocalStore::open(dir.join("store")).unwrap()
    }

    fn lose(dir: &Path, loss: Loss) -> LossReport {
        lose_unsynced(&dir.join("store"), Whose::Process(std::process::id()), loss).unwrap()
    }

    #[test]
    fn what_was_synced_survives_and_the_rest_is_lost() {
        let tmp = tempfile::tempdir().unwrap();
        let s = store(tmp.path());
        s.put("d/put", b"durable").unwrap();
        s.put("d/replaced", b"old").unwrap();
        let o = s.open("d/obj", true).unwrap();
        o.write_at(b"synced", 0).unwrap();
        o.sync_data().unwrap();
        s.sync_dir("d").unwrap();
        s.create_if_absent("d/seal", b"s").unwrap();
        // Not synced from here on.
        o.write_at(b"LOST", 0).unwrap();
        o.write_at(b"tail", 10_000).unwrap();
        s.open("d/new", true).unwrap().write_at(b"new", 0).unwrap();
        s.delete("d/put").unwrap();
        s.open("d/tmp", true).unwrap();
        s.rename("d/tmp", "d/replaced").unwrap();
        let r = lose(tmp.path(), Loss::Drop);
        assert!(r.writes_undone >= 2 && r.names_undone >= 3, "{r:?}");
        let s = LocalStore::open(tmp.path().join("store")).unwrap();
        assert_eq!(s.get("d/obj").unwrap().unwrap(), b"synced");
        assert_eq!(s.get("d/put").unwrap().unwrap(), b"durable");
        assert_eq!(s.get("d/replaced").unwrap().unwrap(), b"old");
        assert_eq!(s.get("d/seal").unwrap().unwrap(), b"s");
        assert_eq!(s.get("d/new").unwrap(), None);
        assert_eq!(
            s.list("d").unwrap(),
            vec!["d/obj", "d/put", "d/replaced", "d/seal"]
        );
        // Nothing is left to undo.
        assert_eq!(lose(tmp.path(), Loss::Drop), LossReport::default());
    }

    #[test]
    fn a_synced_folder_keeps_its_names_and_o_dsync_writes_are_durable() {
        let tmp = tempfile::tempdir().unwrap();
        let s = store(tmp.path());
        let o = s.open("j/seg", true).unwrap();
        o.set_len(8192).unwrap();
        o.sync_data().unwrap();
        s.open("j/gone", true).unwrap();
        s.sync_dir("j").unwrap();
        s.delete("j/gone").unwrap();
        s.sync_dir("j").unwrap();
        let Some(d) = s.open_sync_direct("j/seg").unwrap() else {
            return; // No O_DIRECT here (tmpfs): nothing more to check.
        };
        let mut buf = crate::AlignedBuf::new();
        d.write_at(buf.fill(&[7u8; 4096]), 4096).unwrap();
        // A buffered write after it, not synced, over part of the same block.
        o.write_at(b"xx", 4096).unwrap();
        lose(tmp.path(), Loss::Drop);
        let s = LocalStore::open(tmp.path().join("store")).unwrap();
        assert_eq!(s.list("j").unwrap(), vec!["j/seg"]);
        let data = s.get("j/seg").unwrap().unwrap();
        assert_eq!(data.len(), 8192);
        assert!(data[..4096].iter().all(|&b| b == 0));
        assert!(
            data[4096..].iter().all(|&b| b == 7),
            "the O_DSYNC write stays"
        );
    }

    #[test]
    fn a_torn_loss_keeps_blocks_of_both_ages() {
        let mut kinds = std::collections::BTreeSet::new();
        for seed in 0..6 {
            let tmp = tempfile::tempdir().unwrap();
            let s = store(tmp.path());
            let o = s.open("t/x", true).unwrap();
            o.write_at(&[1u8; 8 * 4096], 0).unwrap();
            o.sync_data().unwrap();
            s.sync_dir("t").unwrap();
            o.write_at(&[2u8; 8 * 4096], 0).unwrap();
            lose(tmp.path(), Loss::Tear { seed });
            let data = LocalStore::open(tmp.path().join("store"))
                .unwrap()
                .get("t/x")
                .unwrap()
                .unwrap();
            assert_eq!(data.len(), 8 * 4096);
            for block in data.chunks(4096) {
                assert!(block.iter().all(|&b| b == block[0]), "torn inside a block");
                kinds.insert(block[0]);
            }
        }
        assert_eq!(kinds, std::collections::BTreeSet::from([1, 2]));
    }
}

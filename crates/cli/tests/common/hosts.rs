//! Hosts made of Linux network namespaces, for tests of servers on separate machines: a
//! bridge, and per host a namespace joined to it by a veth pair, an address of its own in
//! [`SUBNET`] and a scratch directory. Processes are started inside a host (their network
//! namespace only: they share the test's filesystem and mount namespace, so a FUSE mount
//! made on the client host is visible to the test), and every process of a host can be
//! SIGKILLed at once, or its link cut and restored.
//!
//! Needs root and `ip netns` ([`unavailable`] says why not). Everything is named with
//! [`PREFIX`] and the test process's pid: what a killed run left behind (its pid gone) is
//! removed at the next start, and whatever a run makes is removed when it is dropped.
#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The hosts' /24: private, and not one a build machine's own networks (10.0.x, 10.1.x,
/// 172.17.x of Docker, 192.168.x) are likely to use. The bridge has no address in the
/// test's own namespace, so nothing of it is routed from there.
pub const SUBNET: [u8; 3] = [10, 213, 7];

/// Namespaces are named `PREFIX-<pid>-<n>-<host>`; links `kb<pid>x<n>` (bridges) and
/// `kv<pid>x<n>` / `kp<pid>x<n>` (the two ends of a veth pair, 15 characters at most).
pub const PREFIX: &str = "kochabh";

/// Most time one `ip` command may take (they take milliseconds; one stuck on a kernel
/// lock must not hang the test).
const IP_TIMEOUT: Duration = Duration::from_secs(10);

/// Numbers the bridges and veth pairs of this process (never reused while it runs).
static NEXT: AtomicU32 = AtomicU32::new(0);

/// Why hosts cannot be made here (not root, no `ip netns`), or None if they can (asked
/// once per process).
pub fn unavailable() -> Option<String> {
    static WHY: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    WHY.get_or_init(|| {
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Some("hosts in network namespaces need root".into());
        }
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let name = format!("{PREFIX}-{}-{n}-probe", std::process::id());
        if let Err(e) = ip(&["netns", "add", &name]) {
            return Some(format!("`ip netns add` does not work here: {e}"));
        }
        let _ = ip(&["netns", "del", &name]);
        None
    })
    .clone()
}

/// Runs `ip ARGS`, at most [`IP_TIMEOUT`].
pub fn ip(args: &[&str]) -> Result<String, String> {
    run_bounded(Command::new("ip").args(args), IP_TIMEOUT)
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))
}

/// Runs a command to its end, at most `limit` (then kills it): its stdout, or an error with
/// its stderr.
fn run_bounded(cmd: &mut Command, limit: Duration) -> Result<String, String> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("timed out after {limit:?}"));
            }
        }
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The pid in a name made by this module (`PREFIX-<pid>-...` or `k?<pid>x...`).
fn owner_pid(name: &str) -> Option<u32> {
    if let Some(rest) = name.strip_prefix(&format!("{PREFIX}-")) {
        return rest.split('-').next()?.parse().ok();
    }
    let rest = name
        .strip_prefix("kb")
        .or_else(|| name.strip_prefix("kv"))
        .or_else(|| name.strip_prefix("kp"))?;
    let (pid, n) = rest.split_once('x')?;
    n.parse::<u32>().ok()?;
    pid.parse().ok()
}

/// The inode of a network namespace (what `/proc/PID/ns/net` links to as `net:[INODE]`).
fn ns_inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// Every process whose network namespace is the one with inode `ino`.
fn pids_in_ns(ino: u64) -> Vec<i32> {
    let want = format!("net:[{ino}]");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if std::fs::read_link(e.path().join("ns/net")).is_ok_and(|l| l.to_string_lossy() == want) {
            out.push(pid);
        }
    }
    out
}

/// SIGKILLs every process in the namespace with inode `ino` until none is left (a process
/// may fork while it is being killed), at most 10 s. Returns the pids killed.
fn kill_ns(ino: u64) -> Vec<i32> {
    let mut killed = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pids = pids_in_ns(ino);
        if pids.is_empty() || Instant::now() > deadline {
            return killed;
        }
        for p in pids {
            // SAFETY: kill(2) of a process inside a namespace this module made.
            unsafe { libc::kill(p, libc::SIGKILL) };
            if !killed.contains(&p) {
                killed.push(p);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Removes what an earlier run that no longer runs left behind: its namespaces (their
/// processes killed first) and links.
pub fn remove_stale() {
    let me = std::process::id();
    let stale = |name: &str| owner_pid(name).is_some_and(|p| p != me && !pid_alive(p));
    for line in ip(&["netns", "list"]).unwrap_or_default().lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if name.starts_with(PREFIX) && stale(name) {
            if let Some(ino) = ns_inode(&Path::new("/run/netns").join(name)) {
                kill_ns(ino);
            }
            let _ = ip(&["netns", "del", name]);
            eprintln!("hosts: removed the stale namespace {name}");
        }
    }
    // Scratch directories (`PREFIX-<pid>-XXXX` in the temporary directory), after lazily
    // unmounting whatever is mounted under them (a mount whose process was killed).
    for e in std::fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(PREFIX) && stale(&name) {
            let dir = e.path();
            let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
            for m in mounts.lines().filter_map(|l| l.split_whitespace().nth(1)) {
                if Path::new(m).starts_with(&dir) {
                    let _ = run_bounded(Command::new("umount").args(["-l", m]), IP_TIMEOUT);
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!("hosts: removed the stale directory {}", dir.display());
        }
    }
    for line in ip(&["-o", "link", "show"]).unwrap_or_default().lines() {
        // "7: kv123x4@if6: <...>"
        let Some(name) = line
            .split(": ")
            .nth(1)
            .map(|n| n.split('@').next().unwrap_or(n))
        else {
            continue;
        };
        if stale(name) {
            let _ = ip(&["link", "del", name]);
            eprintln!("hosts: removed the stale link {name}");
        }
    }
}

/// Aborts the FUSE connection mounted at `mnt`, if any (`/sys/fs/fuse/connections/N/abort`,
/// N the mount's device minor): requests waiting in it fail at once instead of leaving the
/// threads that made them in uninterruptible sleep, as they were seen to stay (for minutes,
/// in a test process that could then not exit) after the mount process was SIGKILLed while
/// its requests waited.
pub fn abort_fuse(mnt: &Path) {
    let Ok(canon) = std::fs::canonicalize(mnt) else {
        return;
    };
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for l in info.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() > 4
            && Path::new(f[4]) == canon
            && let Some((_, minor)) = f[2].split_once(':')
        {
            let _ = std::fs::write(format!("/sys/fs/fuse/connections/{minor}/abort"), "1");
        }
    }
}

/// A bridge the hosts are plugged into, and their scratch directories.
pub struct Net {
    pub bridge: String,
    n: u32,
    dir: tempfile::TempDir,
}

impl Net {
    /// A new bridge (after removing what a killed run left).
    pub fn new() -> Result<Net, String> {
        remove_stale();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let bridge = format!("kb{}x{n}", std::process::id());
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        let net = Net {
            bridge,
            n,
            dir: tempfile::Builder::new()
                .prefix(&format!("{PREFIX}-{}-", std::process::id()))
                .tempdir()
                .map_err(|e| e.to_string())?,
        };
        ip(&["link", "set", &net.bridge, "up"])?;
        Ok(net)
    }

    /// A host named `name` (unique on this net) at the address `SUBNET.last`.
    pub fn host(&self, name: &str, last: u8) -> Result<Host, String> {
        let pid = std::process::id();
        let k = NEXT.fetch_add(1, Ordering::SeqCst);
        let ns = format!("{PREFIX}-{pid}-{}-{name}", self.n);
        let (veth, peer) = (format!("kv{pid}x{k}"), format!("kp{pid}x{k}"));
        let addr = Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], last);
        let dir = self.dir.path().join(name);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        ip(&["netns", "add", &ns])?;
        // From here on Drop removes what was made, should a step fail.
        let ns_file = std::fs::File::open(Path::new("/run/netns").join(&ns))
            .map_err(|e| format!("/run/netns/{ns}: {e}"))?;
        let host = Host {
            name: name.to_string(),
            ns: ns.clone(),
            addr,
            dir,
            veth: veth.clone(),
            ns_ino: ns_inode(&Path::new("/run/netns").join(&ns)).unwrap_or(0),
            ns_file,
            children: Mutex::new(Vec::new()),
        };
        let cidr = format!("{addr}/24");
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer])?;
        ip(&["link", "set", &peer, "netns", &ns])?;
        ip(&["link", "set", &veth, "master", &self.bridge])?;
        ip(&["link", "set", &veth, "up"])?;
        for args in [
            vec!["link", "set", &peer, "name", "eth0"],
            vec!["addr", "add", &cidr, "dev", "eth0"],
            vec!["link", "set", "eth0", "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut full = vec!["-n", &ns];
            full.extend(args);
            ip(&full)?;
        }
        Ok(host)
    }

    /// The directory hosts' scratch directories are in; also a place for what no one host
    /// owns (a shared data directory standing in for a store).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// One host: a network namespace with its own address and a scratch directory.
pub struct Host {
    pub name: String,
    pub ns: String,
    pub addr: Ipv4Addr,
    pub dir: PathBuf,
    /// Its end of the veth pair on the bridge (what `cut_link` takes down).
    veth: String,
    ns_ino: u64,
    ns_file: std::fs::File,
    /// Processes started here, reaped when killed.
    children: Mutex<Vec<Child>>,
}

impl Host {
    /// `program` as a command that runs in this host's network namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(program);
        let fd = self.ns_file.as_raw_fd();
        // SAFETY: setns(2) in the child between fork and exec, on a descriptor this Host
        // keeps open; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd
    }

    /// Starts `cmd` (made by [`Host::command`]) and keeps it as one of this host's
    /// processes; returns its pid.
    pub fn spawn(&self, cmd: &mut Command) -> std::io::Result<u32> {
        let child = cmd.spawn()?;
        let pid = child.id();
        self.children.lock().unwrap().push(child);
        Ok(pid)
    }

    /// Runs `f` on a thread inside this host's network namespace (sockets it opens, and
    /// threads it starts, such as a tokio runtime's, are the host's).
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let fd = self.ns_file.as_raw_fd();
        std::thread::scope(|s| {
            s.spawn(move || {
                // SAFETY: setns(2) of this thread alone, on a descriptor the Host keeps open.
                let r = unsafe { libc::setns(fd, libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }

    /// Moves the calling thread into this host's network namespace for good (for a thread
    /// of the test's own that is to be a client on this host).
    pub fn enter_this_thread(&self) {
        // SAFETY: setns(2) of the calling thread, on a descriptor the Host keeps open.
        let r = unsafe { libc::setns(self.ns_file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
    }

    /// Every process in this host right now.
    pub fn pids(&self) -> Vec<i32> {
        pids_in_ns(self.ns_ino)
    }

    /// SIGKILLs every process of this host (started here or not: whatever runs in its
    /// namespace) and reaps those it started. Returns the pids killed.
    pub fn kill_all(&self) -> Vec<i32> {
        let killed = kill_ns(self.ns_ino);
        for c in self.children.lock().unwrap().iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.lock().unwrap().clear();
        killed
    }

    /// Reaps this host's processes that exited; returns (pid, exit status) of each.
    pub fn reap(&self) -> Vec<(u32, std::process::ExitStatus)> {
        let mut out = Vec::new();
        self.children
            .lock()
            .unwrap()
            .retain_mut(|c| match c.try_wait() {
                Ok(Some(st)) => {
                    out.push((c.id(), st));
                    false
                }
                _ => true,
            });
        out
    }

    /// True while the process `pid` this host started runs.
    pub fn running(&self, pid: u32) -> bool {
        let mut children = self.children.lock().unwrap();
        children
            .iter_mut()
            .find(|c| c.id() == pid)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Cuts the host off the network: its link to the bridge goes down (packets to and
    /// from it are dropped; its connections stay open on both sides, as after a cable
    /// pulled out).
    pub fn cut_link(&self) -> Result<(), String> {
        ip(&["link", "set", &self.veth, "down"]).map(|_| ())
    }

    /// Puts the link back.
    pub fn restore_link(&self) -> Result<(), String> {
        ip(&["link", "set", &self.veth, "up"]).map(|_| ())
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill_all();
        let _ = ip(&["netns", "del", &self.ns]);
        // Deleting the namespace deletes its end of the pair, and with it this one; if a
        // process still held the namespace, this one is left to delete.
        let _ = ip(&["link", "del", &self.veth]);
    }
}

//! `kochab mount` and the mount of `kochab up --mount`.

use crate::{MountArgs, wait_for_signal};
use kochab_client::{Client, ClientConfig};
use kochab_fuse::{KochabFs, MountConfig};
use kochab_proto::AtimeRule;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What `-o OPTIONS` asks of a mount: the access-time rule, read-only, write-behind or
/// synchronous writes (`sync`), and whether setuid bits and device nodes work (the last of each wins, as in mount(8)); other options are
/// accepted and left alone. Mounts are nosuid,nodev unless `suid`/`dev` are given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Options {
    pub atime: AtimeRule,
    pub read_only: bool,
    pub suid: bool,
    pub dev: bool,
    /// `sync`: every write(2) reaches the servers before it returns (no write-behind),
    /// and every change is durable before it returns (as `dirsync`).
    pub sync: bool,
    /// `dirsync`: every metadata change is durable before it returns (no early replies).
    pub dirsync: bool,
    /// `retry=SECONDS`: how long a request keeps trying a server that cannot be reached
    /// (restarting, failing over) before the application gets an error. Like an NFS hard
    /// mount, applications otherwise see only the delay; SIGKILL ends a waiting process.
    pub retry_secs: u64,
}

/// A mount's default `retry=`: ten minutes rides out a server restart with a large
/// journal, a failover and a machine reboot; a mount whose cluster is gone for good still
/// answers (EIO) eventually.
pub const RETRY_SECS_DEFAULT: u64 = 600;

impl Options {
    /// Whether the mount's client asks for early replies (docs/ARCHITECTURE.md).
    pub fn early_replies(&self) -> bool {
        !self.sync && !self.dirsync
    }

    /// Sets what the options ask of the mount's client: early replies, leases (the kernel
    /// caches for them and callbacks keep it coherent), the retry budget.
    pub fn configure(&self, cfg: &mut ClientConfig) {
        cfg.connections = 2;
        cfg.early_replies = self.early_replies();
        cfg.leases = true;
        cfg.retry_budget = Duration::from_secs(self.retry_secs);
    }
}

/// Parses a mount's comma-separated options.
pub fn options(text: Option<&str>) -> Options {
    let mut o = Options {
        retry_secs: RETRY_SECS_DEFAULT,
        ..Options::default()
    };
    for word in text.unwrap_or("").split(',') {
        let word = word.trim();
        if let Some(secs) = word.strip_prefix("retry=").and_then(|v| v.parse().ok()) {
            o.retry_secs = secs;
            continue;
        }
        match word {
            "noatime" => o.atime = AtimeRule::Never,
            "relatime" | "atime" => o.atime = AtimeRule::Relative,
            "strictatime" => o.atime = AtimeRule::Always,
            "ro" => o.read_only = true,
            "rw" => o.read_only = false,
            "suid" => o.suid = true,
            "nosuid" => o.suid = false,
            "dev" => o.dev = true,
            "nodev" => o.dev = false,
            "sync" => o.sync = true,
            "async" => o.sync = false,
            "dirsync" => o.dirsync = true,
            _ => {}
        }
    }
    o
}

/// A mount made by [`mount`]: its FUSE session and where it is mounted.
pub struct Mounted {
    session: fuser::BackgroundSession,
    dir: PathBuf,
    /// The mount's device number (major, minor), to tell it from another mount at `dir`.
    dev: Option<(u32, u32)>,
}

/// Mounts `client`'s cluster (`source`, its address) at `dir`, served from the current
/// tokio runtime.
pub fn mount(
    client: Client,
    source: &str,
    dir: &Path,
    options: Options,
) -> std::io::Result<Mounted> {
    std::fs::create_dir_all(dir)?;
    let config = MountConfig {
        // Mount options are comma-separated: a list of entry addresses is named with '+'.
        source: source.replace(',', "+"),
        atime: options.atime,
        read_only: options.read_only,
        suid: options.suid,
        dev: options.dev,
        write_behind: !options.sync,
        ..MountConfig::default()
    };
    let fs = KochabFs::new(client, tokio::runtime::Handle::current(), config);
    let config = fs.fuse_config();
    let handle = fs.clone();
    let session = fuser::spawn_mount(fs, dir, &config)?;
    handle.set_notifier(session.notifier());
    let dev = set_read_ahead(dir);
    Ok(Mounted {
        session,
        dir: dir.to_path_buf(),
        dev,
    })
}

/// Connects a mount's client (two connections per server) with `cfg` and mounts the
/// cluster (`source`, its address) at `dir` with `-o`-style `options`: the mount of
/// `kochab up --mount`, one server or many.
pub async fn connect_and_mount(
    mut cfg: ClientConfig,
    source: &str,
    dir: &Path,
    options_text: Option<&str>,
) -> Result<Mounted, String> {
    let opts = options(options_text);
    opts.configure(&mut cfg);
    let client = Client::connect(cfg)
        .await
        .map_err(|e| format!("cannot connect the mount: {e}"))?;
    let session = mount(client, source, dir, opts)
        .map_err(|e| format!("cannot mount {}: {e}", dir.display()))?;
    eprintln!("kochab: mounted at {}", dir.display());
    Ok(session)
}

/// Read-ahead of the mount, in KiB. FUSE's default of 128 KiB makes a sequential read one
/// small round trip after another (measured: 1 GiB cold read 307 MB/s at 128 KiB, 632 MB/s
/// at 1 MiB). At 4 MiB the kernel keeps several 1 MiB reads in flight, and the servers,
/// which read cold data with O_DIRECT, read them in parallel.
const READ_AHEAD_KB: u32 = 4096;

/// Raises the mount's read-ahead (best effort: needs root and sysfs). Returns the mount's
/// device number.
fn set_read_ahead(dir: &Path) -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).ok()?;
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let path = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(e) = std::fs::write(&path, READ_AHEAD_KB.to_string()) {
        tracing::info!("cannot raise read-ahead ({path}): {e}");
    }
    Some((major, minor))
}

/// The device numbers of the mounts at `dir`, bottom to top (/proc/self/mountinfo lists
/// mounts in the order they were made); `None` if that cannot be told. Found without a
/// request to the mount itself (which may be the one that is busy).
fn mounts_at(dir: &Path) -> Option<Vec<(u32, u32)>> {
    let at = match (dir.parent(), dir.file_name()) {
        (Some(parent), Some(name)) => {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            std::fs::canonicalize(parent).ok()?.join(name)
        }
        _ => std::fs::canonicalize(dir).ok()?,
    };
    let at = at.to_str()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines()
        .filter_map(|line| {
            let mut f = line.split(' ');
            let dev = f.nth(2)?;
            let target = f.nth(1)?;
            (unescape_mount_path(target) == at).then_some(dev)
        })
        .map(|dev| {
            let (major, minor) = dev.split_once(':')?;
            Some((major.parse().ok()?, minor.parse().ok()?))
        })
        .collect()
}

/// A path as /proc/self/mountinfo writes it: space, tab, newline and backslash in octal.
fn unescape_mount_path(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 4);
        match code.and_then(|c| u8::from_str_radix(c, 8).ok()) {
            Some(b) => {
                out.push(char::from(b));
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Waits until `stop` resolves (then unmounts) or until someone unmounts the file system,
/// and then until the session has ended (its `destroy` done: writes held back sent, the
/// session ended at the servers). Returns what `stop` gave, if it ended the wait.
pub async fn wait<T>(
    mounted: Mounted,
    stop: impl std::future::Future<Output = T> + Unpin,
) -> Option<T> {
    let Mounted { session, dir, dev } = mounted;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut stop = stop;
    let stopped = loop {
        tokio::select! {
            why = &mut stop => break Some(why),
            _ = tick.tick() => {
                if session.guard.is_finished() {
                    // Unmounted from outside (fusermount3 -u): the session has ended.
                    let ended = tokio::task::spawn_blocking(move || session.join()).await;
                    report_end(&dir, ended);
                    return None;
                }
            }
        }
    };
    let at = dir.clone();
    let ended = tokio::task::spawn_blocking(move || unmount_and_join(session, &dir, dev)).await;
    report_end(&at, ended);
    stopped
}

/// Logs how a session ended, if not in order (its `destroy` may not have run).
fn report_end(dir: &Path, ended: Result<std::io::Result<()>, tokio::task::JoinError>) {
    match ended {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("the session of {} did not end in order: {e}", dir.display()),
        Err(e) => tracing::warn!("the session of {} did not end in order: {e}", dir.display()),
    }
}

/// Unmounts `dir` and waits for the session to end. A busy mount (files open on it) is
/// detached instead, as `umount -l` does: it leaves the namespace at once, and the process
/// serves the files still open until the last is closed, then ends as after any unmount.
/// Leaving at once instead would take the request loops away from the programs still
/// using the mount (their requests would wait for good, and so would a page invalidation of
/// this process's, which keeps the process from exiting: both seen when a busy mount was
/// sent SIGTERM).
///
/// Only this session's mount is unmounted: if it is no longer at `dir`, or another mount is
/// on top of it there, nothing is.
fn unmount_and_join(
    session: fuser::BackgroundSession,
    dir: &Path,
    dev: Option<(u32, u32)>,
) -> std::io::Result<()> {
    if !session.guard.is_finished() {
        if let (Some(there), Some(ours)) = (mounts_at(dir), dev) {
            if !there.contains(&ours) {
                // Not there: unmounted or detached from outside; the session ends with the
                // last file closed on it.
                return session.join();
            }
            if there.last() != Some(&ours) {
                // Under another mount, which unmounting the path would remove (and so would
                // dropping the session): both are left as they are.
                std::mem::forget(session);
                return Err(std::io::Error::other(format!(
                    "another mount is on top of this one at {}: not unmounted",
                    dir.display()
                )));
            }
        }
        match unmount(dir, false) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                eprintln!(
                    "kochab: {} is busy: detached; serving the files still open on it until \
                     they are closed",
                    dir.display()
                );
                unmount(dir, true)?;
            }
            Err(e) => return Err(e),
        }
    }
    session.join()
}

/// Unmounts `dir` (`lazy`: detaches it), through fusermount3 where the caller may not
/// unmount (not root), as fuser does.
fn unmount(dir: &Path, lazy: bool) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: umount2 of a NUL-terminated path.
    if unsafe { libc::umount2(path.as_ptr(), flags) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EPERM) {
        return Err(e);
    }
    let mut helper = std::process::Command::new("fusermount3");
    helper.arg(if lazy { "-uz" } else { "-u" }).arg(dir);
    let out = helper.output()?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr);
    // fusermount3 says why only in words.
    Err(if text.contains("busy") {
        std::io::Error::from_raw_os_error(libc::EBUSY)
    } else {
        std::io::Error::other(format!("fusermount3: {}", text.trim()))
    })
}

/// `kochab mount --foreground`.
pub async fn foreground(args: MountArgs) -> Result<(), String> {
    let mut cfg =
        ClientConfig::named(&args.cluster, args.key.load()?).map_err(|e| e.to_string())?;
    cfg.tls = args.tls.load()?;
    let opts = options(args.options.as_deref());
    opts.configure(&mut cfg);
    let client = Client::connect(cfg)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", args.cluster))?;
    let session = mount(client, &args.cluster, &args.mountpoint, opts)
        .map_err(|e| format!("cannot mount {}: {e}", args.mountpoint.display()))?;
    eprintln!(
        "kochab: {} mounted at {}",
        args.cluster,
        args.mountpoint.display()
    );
    wait(session, Box::pin(wait_for_signal())).await;
    Ok(())
}

/// FUSE mounts at `dir` (a new mount may stack on an old one).
fn fuse_mounts_at(dir: &Path) -> usize {
    let Ok(canon) = std::fs::canonicalize(dir) else {
        return 0;
    };
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return 0;
    };
    mounts
        .lines()
        .filter(|l| {
            let mut f = l.split_whitespace();
            let (_, target, fstype) = (f.next(), f.next(), f.next());
            target == Some(canon.to_str().unwrap_or(""))
                && fstype.is_some_and(|t| t.starts_with("fuse"))
        })
        .count()
}

/// `kochab mount` without --foreground: runs the foreground mount as a detached process
/// and returns once the file system is mounted.
pub fn background(args: &MountArgs) -> Result<(), String> {
    args.key.load()?;
    args.tls.load()?;
    // Done when one more mount is there than before (not when one is there at all).
    let mounts_before = fuse_mounts_at(&args.mountpoint);
    let exe = std::env::current_exe().map_err(|e| format!("cannot find myself: {e}"))?;
    let log_path = args.log.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kochab-mount-{}.log", std::process::id()))
    });
    let log = std::fs::File::create(&log_path)
        .map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("mount")
        .arg(&args.cluster)
        .arg(&args.mountpoint)
        .arg("--foreground")
        .arg("--key-file")
        .arg(&args.key.key_file);
    if let Some(o) = &args.options {
        cmd.arg("-o").arg(o);
    }
    if let Some(ca) = &args.tls.tls_ca {
        cmd.arg("--tls-ca").arg(ca);
    }
    // KOCHAB_KEY, if set, reaches the child through the environment (never argv).
    cmd.stdin(std::process::Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log);
    // SAFETY: setsid() in the child between fork and exec touches no shared state.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start the mount process: {e}"))?;
    for _ in 0..300 {
        if fuse_mounts_at(&args.mountpoint) > mounts_before {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Err(format!("the mount process exited ({status}): {log}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "{} did not appear as a mount within 15 s; see {}",
        args.mountpoint.display(),
        log_path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape_mount_path("/mnt/plain"), "/mnt/plain");
        assert_eq!(unescape_mount_path("/mnt/a\\040b\\011c"), "/mnt/a b\tc");
        assert_eq!(
            unescape_mount_path("/mnt/back\\134slash"),
            "/mnt/back\\slash"
        );
        assert_eq!(unescape_mount_path("/mnt/odd\\9"), "/mnt/odd\\9");
    }

    #[test]
    fn mount_options() {
        assert_eq!(options(None).atime, AtimeRule::Relative);
        assert_eq!(options(None).retry_secs, RETRY_SECS_DEFAULT);
        assert_eq!(options(Some("retry=30,noatime")).retry_secs, 30);
        assert_eq!(options(Some("retry=x")).retry_secs, RETRY_SECS_DEFAULT);
        assert_eq!(options(Some("rw,noatime")).atime, AtimeRule::Never);
        assert_eq!(options(Some("strictatime,nodev")).atime, AtimeRule::Always);
        assert_eq!(options(Some("noatime,relatime")).atime, AtimeRule::Relative);
        assert!(options(Some("rw,ro")).read_only);
        assert!(!options(Some("ro,rw")).read_only);
        assert!(!options(None).sync, "write-behind by default");
        assert!(options(Some("rw,sync")).sync);
        assert!(!options(Some("sync,async")).sync);
    }
}

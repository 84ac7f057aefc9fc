//! `kochab mount` and the mount of `kochab up --mount`.

use crate::{MountArgs, wait_for_signal};
use kochab_client::{Client, ClientConfig};
use kochab_fuse::{KochabFs, MountConfig};
use kochab_proto::AtimeRule;
use std::path::Path;
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

/// Mounts `client`'s cluster (`source`, its address) at `dir`, served from the current
/// tokio runtime.
pub fn mount(
    client: Client,
    source: &str,
    dir: &Path,
    options: Options,
) -> std::io::Result<fuser::BackgroundSession> {
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
    set_read_ahead(dir);
    Ok(session)
}

/// Connects a mount's client (two connections per server) with `cfg` and mounts the
/// cluster (`source`, its address) at `dir` with `-o`-style `options`: the mount of
/// `kochab up --mount`, one server or many.
pub async fn connect_and_mount(
    mut cfg: ClientConfig,
    source: &str,
    dir: &Path,
    options_text: Option<&str>,
) -> Result<fuser::BackgroundSession, String> {
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

/// Raises the mount's read-ahead (best effort: needs root and sysfs).
fn set_read_ahead(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(dir) else {
        return;
    };
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let path = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(e) = std::fs::write(&path, READ_AHEAD_KB.to_string()) {
        tracing::info!("cannot raise read-ahead ({path}): {e}");
    }
}

/// Waits until `stop` resolves (then unmounts) or until someone unmounts the file system.
/// Returns what `stop` gave, if it ended the wait.
pub async fn wait<T>(
    session: fuser::BackgroundSession,
    stop: impl std::future::Future<Output = T> + Unpin,
) -> Option<T> {
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut stop = stop;
    let stopped = loop {
        tokio::select! {
            why = &mut stop => break Some(why),
            _ = tick.tick() => {
                if session.guard.is_finished() {
                    // Unmounted from outside (fusermount3 -u): the session has ended.
                    let _ = tokio::task::spawn_blocking(move || session.join()).await;
                    return None;
                }
            }
        }
    };
    let _ = tokio::task::spawn_blocking(move || session.umount_and_join()).await;
    stopped
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

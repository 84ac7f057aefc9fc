//! `kochab fs`: a small shell for scripts over the native client. Paths are absolute
//! within the cluster; the caller's uid and gid are sent as credentials.

use clap::Subcommand;
use kochab_client::Client;
use kochab_proto::*;

#[derive(Subcommand)]
pub enum FsCommand {
    /// List a directory (or show one non-directory).
    Ls {
        path: String,
        /// Long format, as ls -l: mode, links, owner, group, size, modification time.
        #[arg(short, long)]
        long: bool,
        /// With -l: sizes as 4.0K, 12M, 1.1G.
        #[arg(short = 'H', long)]
        human: bool,
        /// Print each entry's inode id first.
        #[arg(short, long)]
        inode: bool,
        /// JSON lines (every attribute, times in nanoseconds).
        #[arg(long)]
        json: bool,
    },
    /// Show an inode's attributes as JSON.
    Stat {
        path: String,
        /// Do not follow a final symlink.
        #[arg(short = 'L', long)]
        nofollow: bool,
    },
    /// Create a directory.
    Mkdir {
        path: String,
        /// Create missing parents; no error if it exists.
        #[arg(short, long)]
        parents: bool,
        #[arg(short, long, default_value = "755", value_parser = parse_mode)]
        mode: u32,
    },
    /// Create an empty file (or update its times).
    Touch { path: String },
    /// Remove a file, or a directory with -r (recursively).
    Rm {
        path: String,
        #[arg(short, long)]
        recursive: bool,
    },
    /// Rename.
    Mv { from: String, to: String },
    /// Make a hard link (or a symlink with -s).
    Ln {
        target: String,
        link: String,
        #[arg(short, long)]
        symbolic: bool,
    },
    /// Print a symlink's target.
    Readlink { path: String },
    /// Change permission bits (octal).
    Chmod {
        #[arg(value_parser = parse_mode)]
        mode: u32,
        path: String,
    },
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8).map_err(|_| format!("{s:?} is not an octal mode"))
}

fn caller() -> Credentials {
    // SAFETY: getuid and getgid cannot fail and touch no memory of ours.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    Credentials::user(uid, gid)
}

fn kind_char(k: FileKind) -> char {
    match k {
        FileKind::File => '-',
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        FileKind::Fifo => 'p',
        FileKind::Socket => 's',
        FileKind::CharDev => 'c',
        FileKind::BlockDev => 'b',
    }
}

fn mode_string(a: &Attr) -> String {
    let mut s = String::new();
    // '?' for a mode without a type, as ls prints one.
    s.push(a.kind().map_or('?', kind_char));
    for shift in [6, 3, 0] {
        let bits = (a.mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// A size as `ls -h` prints it: bytes below 1 KiB, else one decimal below 10 of the unit
/// (rounded up, as ls does) and whole units above.
fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["K", "M", "G", "T", "P", "E"];
    if bytes < 1024 {
        return bytes.to_string();
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    let tenths = (v * 10.0).ceil() / 10.0;
    if tenths < 10.0 {
        format!("{tenths:.1}{}", UNITS[unit])
    } else {
        format!("{:.0}{}", v.ceil(), UNITS[unit])
    }
}

/// A modification time as `ls -l` prints it, in local time: `Nov 24 01:02` within about six
/// months of `now_ns`, else `Nov 24  2025`.
fn ls_time(ns: i64, now_ns: i64) -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let secs = ns.div_euclid(1_000_000_000) as libc::time_t;
    // SAFETY: localtime_r only writes the `tm` we pass; a zeroed tm is a valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&secs, &mut tm) }.is_null() {
        return format!("{:>12}", secs);
    }
    let month = MONTHS[tm.tm_mon.clamp(0, 11) as usize];
    const HALF_YEAR_NS: i64 = 182 * 24 * 3600 * 1_000_000_000;
    let recent =
        ns <= now_ns.saturating_add(3_600_000_000_000) && now_ns.saturating_sub(ns) < HALF_YEAR_NS;
    if recent {
        format!(
            "{month} {:>2} {:02}:{:02}",
            tm.tm_mday, tm.tm_hour, tm.tm_min
        )
    } else {
        format!("{month} {:>2}  {:>4}", tm.tm_mday, tm.tm_year + 1900)
    }
}

fn attr_json(a: &Attr, name: Option<&[u8]>) -> serde_json::Value {
    let mut v = serde_json::json!({
        "id": a.id, "mode": format!("{:o}", a.mode), "kind": a.kind().map_or("unknown".to_string(), |k| format!("{k:?}").to_lowercase()),
        "nlink": a.nlink, "uid": a.uid, "gid": a.gid, "size": a.size,
        "atime_ns": a.atime, "mtime_ns": a.mtime, "ctime_ns": a.ctime, "btime_ns": a.btime,
    });
    if let Some(n) = name {
        v["name"] = serde_json::Value::String(String::from_utf8_lossy(n).into_owned());
    }
    v
}

fn err(e: FsError) -> String {
    e.to_string()
}

pub async fn run(client: &Client, cmd: FsCommand) -> Result<(), String> {
    let cred = caller();
    match cmd {
        FsCommand::Ls {
            path,
            long,
            human,
            inode,
            json,
        } => {
            let a = client.resolve(&cred, &path, true).await.map_err(err)?;
            let entries: Vec<(Vec<u8>, Attr)> = if a.kind() == Some(FileKind::Dir) {
                let mut v = Vec::new();
                for e in client.readdir_all(&cred, a.id, true).await.map_err(err)? {
                    // An entry whose inode another server holds comes without attributes.
                    let at = match e.attr {
                        Some(at) => at,
                        None => client.getattr(&cred, e.id).await.map_err(err)?,
                    };
                    v.push((e.name, at));
                }
                v.sort_by(|x, y| x.0.cmp(&y.0));
                v
            } else {
                vec![(
                    path.rsplit('/').next().unwrap_or(&path).as_bytes().to_vec(),
                    a,
                )]
            };
            let now = kochab_server::shared::now_ns();
            for (name, at) in entries {
                let id = if inode {
                    format!("{:>20} ", at.id)
                } else {
                    String::new()
                };
                let name = String::from_utf8_lossy(&name);
                if json {
                    println!("{}", attr_json(&at, Some(name.as_bytes())));
                } else if long {
                    let size = if human {
                        human_size(at.size)
                    } else {
                        at.size.to_string()
                    };
                    println!(
                        "{id}{} {:>3} {:>5} {:>5} {:>10} {} {name}",
                        mode_string(&at),
                        at.nlink,
                        at.uid,
                        at.gid,
                        size,
                        ls_time(at.mtime, now),
                    );
                } else {
                    println!("{id}{name}");
                }
            }
        }
        FsCommand::Stat { path, nofollow } => {
            let a = client.resolve(&cred, &path, !nofollow).await.map_err(err)?;
            println!("{}", attr_json(&a, None));
        }
        FsCommand::Mkdir {
            path,
            parents,
            mode,
        } => {
            if parents {
                let mut cur = client.root();
                for comp in path.split('/').filter(|c| !c.is_empty()) {
                    cur = match client.mkdir(&cred, cur, comp.as_bytes(), mode).await {
                        Ok(a) => a.id,
                        Err(e) if e.errno == Errno::EEXIST => {
                            client
                                .lookup(&cred, cur, comp.as_bytes())
                                .await
                                .map_err(err)?
                                .id
                        }
                        Err(e) => return Err(err(e)),
                    };
                }
            } else {
                let (p, name) = client.resolve_parent(&cred, &path).await.map_err(err)?;
                client.mkdir(&cred, p.id, &name, mode).await.map_err(err)?;
            }
        }
        FsCommand::Touch { path } => {
            let (p, name) = client.resolve_parent(&cred, &path).await.map_err(err)?;
            match client
                .mknod(&cred, p.id, &name, mode::S_IFREG | 0o644, 0, false)
                .await
            {
                Ok(a) => {
                    let set = SetAttrs {
                        atime: Some(TimeSet::Now),
                        mtime: Some(TimeSet::Now),
                        ..Default::default()
                    };
                    client.setattr(&cred, a.id, set).await.map_err(err)?;
                }
                Err(e) => return Err(err(e)),
            }
        }
        FsCommand::Rm { path, recursive } => {
            let (p, name) = client.resolve_parent(&cred, &path).await.map_err(err)?;
            let a = client.lookup(&cred, p.id, &name).await.map_err(err)?;
            if a.kind() == Some(FileKind::Dir) {
                if !recursive {
                    return Err(format!("{path}: is a directory (use -r)"));
                }
                remove_tree(client, &cred, a.id).await.map_err(err)?;
                client.rmdir(&cred, p.id, &name).await.map_err(err)?;
            } else {
                client.unlink(&cred, p.id, &name).await.map_err(err)?;
            }
        }
        FsCommand::Mv { from, to } => {
            let (p, name) = client.resolve_parent(&cred, &from).await.map_err(err)?;
            let (np, new_name) = match client.resolve(&cred, &to, true).await {
                Ok(a) if a.kind() == Some(FileKind::Dir) => (a, name.clone()),
                _ => client.resolve_parent(&cred, &to).await.map_err(err)?,
            };
            client
                .rename(&cred, p.id, &name, np.id, &new_name, 0)
                .await
                .map_err(err)?;
        }
        FsCommand::Ln {
            target,
            link,
            symbolic,
        } => {
            let (p, name) = client.resolve_parent(&cred, &link).await.map_err(err)?;
            if symbolic {
                client
                    .symlink(&cred, p.id, &name, target.as_bytes())
                    .await
                    .map_err(err)?;
            } else {
                let t = client.resolve(&cred, &target, false).await.map_err(err)?;
                client.link(&cred, t.id, p.id, &name).await.map_err(err)?;
            }
        }
        FsCommand::Readlink { path } => {
            let a = client.resolve(&cred, &path, false).await.map_err(err)?;
            let t = client.readlink(&cred, a.id).await.map_err(err)?;
            println!("{}", String::from_utf8_lossy(&t));
        }
        FsCommand::Chmod { mode, path } => {
            let a = client.resolve(&cred, &path, true).await.map_err(err)?;
            client
                .setattr(
                    &cred,
                    a.id,
                    SetAttrs {
                        mode: Some(mode),
                        ..Default::default()
                    },
                )
                .await
                .map_err(err)?;
        }
    }
    Ok(())
}

/// Removes everything below directory `dir`, depth first.
async fn remove_tree(client: &Client, cred: &Credentials, dir: InodeId) -> FsResult<()> {
    let mut stack = vec![(dir, false)];
    while let Some((d, expanded)) = stack.pop() {
        let entries = client.readdir_all(cred, d, false).await?;
        if !expanded {
            stack.push((d, true));
            for e in entries.iter().filter(|e| e.kind == FileKind::Dir) {
                stack.push((e.id, false));
            }
            continue;
        }
        for e in entries {
            if e.kind == FileKind::Dir {
                client.rmdir(cred, d, &e.name).await?;
            } else {
                client.unlink(cred, d, &e.name).await?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_ls_h_prints_them() {
        assert_eq!(human_size(0), "0");
        assert_eq!(human_size(1023), "1023");
        assert_eq!(human_size(1024), "1.0K");
        assert_eq!(human_size(4096), "4.0K");
        assert_eq!(human_size(1025), "1.1K");
        assert_eq!(human_size(10 * 1024), "10K");
        assert_eq!(human_size(256 << 20), "256M");
        assert_eq!(human_size(3 << 30), "3.0G");
    }

    #[test]
    fn recent_times_show_the_clock_and_old_ones_the_year() {
        let now = 1_795_480_000 * 1_000_000_000i64; // late 2026
        let recent = ls_time(now - 3_600 * 1_000_000_000, now);
        assert_eq!(recent.len(), 12, "{recent:?}");
        assert!(recent.contains(':'), "{recent:?}");
        let old = ls_time(now - 400 * 24 * 3_600 * 1_000_000_000, now);
        assert_eq!(old.len(), 12, "{old:?}");
        assert!(old.ends_with("2025"), "{old:?}");
    }
}

//! The credentials of a FUSE request. The kernel sends uid, gid and pid only; the
//! supplementary groups are read from /proc/<pid>/status and cached briefly per process,
//! so that servers check permissions against the caller's full group list.

use kochab_proto::{Credentials, MAX_GROUPS};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// How long a process's group list is trusted (groups change rarely; pids are reused
/// rarely within seconds).
const GROUPS_TTL: Duration = Duration::from_secs(2);
/// Processes remembered before the cache is cleared.
const GROUPS_CACHED_MAX: usize = 4096;

/// When a process's groups were read, for which uid, and what they were.
struct Cached {
    at: Instant,
    uid: u32,
    groups: Vec<u32>,
}

#[derive(Default)]
pub struct GroupCache {
    by_pid: Mutex<FxHashMap<u32, Cached>>,
}

fn read_groups(pid: u32) -> Vec<u32> {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Vec::new();
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| {
            g.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .take(MAX_GROUPS)
                .collect()
        })
        .unwrap_or_default()
}

impl GroupCache {
    /// Credentials of process `pid` running as `uid`/`gid`.
    pub fn credentials(&self, uid: u32, gid: u32, pid: u32) -> Credentials {
        if uid == 0 || pid == 0 {
            return Credentials {
                uid,
                gid,
                groups: Vec::new(),
            };
        }
        let now = Instant::now();
        if let Some(c) = self.by_pid.lock().get(&pid)
            && now.duration_since(c.at) < GROUPS_TTL
            && c.uid == uid
        {
            return Credentials {
                uid,
                gid,
                groups: c.groups.clone(),
            };
        }
        let groups = read_groups(pid);
        let mut cache = self.by_pid.lock();
        if cache.len() >= GROUPS_CACHED_MAX {
            cache.clear();
        }
        cache.insert(
            pid,
            Cached {
                at: now,
                uid,
                groups: groups.clone(),
            },
        );
        Credentials { uid, gid, groups }
    }
}

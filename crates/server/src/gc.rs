//! The garbage collector of slice objects that were put and never committed (orphans: a
//! client or server killed between its PUT and its commit, a grant that expired, a commit
//! refused), and of objects freed whose deletion a crash cut short.
//!
//! Each server looks at the folders of the files in the tables it serves: one LIST per
//! shard folder (`data/xx`), the folders of served inodes kept, one LIST of each. An object
//! no ref of its file names (or of a file generation that is gone and has no reclaim entry
//! left to delete its folder) is remembered with the time it was first seen so; if it is
//! still unreferenced at a pass at least [`grant_life`] + [`GC_MARGIN`] later, it is
//! deleted. That is safe without comparing any clock with the store's: an object listed at
//! t1 was put before t1, under a grant made before t1, so its token is refused from t1 +
//! the grant's life on (by the clock of the server that checks it, which the margin
//! covers), and it can never become a ref after that. Objects the server itself is putting
//! are skipped (`SliceWork::is_own_put`).

use crate::grants::grant_life;
use crate::shared::Shared;
use crate::slicesvc::DELETES_IN_FLIGHT_MAX;
use kochab_proto::layout::parse_slice_object_name;
use kochab_proto::{CHUNK_BYTES, FILE_BYTES_MAX, InodeId};
use rustc_hash::{FxHashMap, FxHashSet};
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What the collector waits past a grant's life before an orphan goes: it covers the skew
/// between the clocks of the server that granted an object and the one that checks its
/// commit (NTP keeps them within milliseconds; seconds would be a broken host), and the
/// rounding of expiry to whole seconds.
pub const GC_MARGIN: Duration = Duration::from_secs(10);
/// How often a pass runs unless `KOCHAB_SLICE_GC_SECS` says otherwise: orphans are rare
/// (crashes, expired grants), and a pass lists every served file's folder.
pub const GC_SECS_DEFAULT: u64 = 600;
/// Unreferenced objects remembered between passes at most (a few dozen bytes each): past
/// it the newest are not remembered, and are collected by later passes once older ones
/// went.
const SEEN_MAX: usize = 1 << 20;

/// The interval between passes, from `KOCHAB_SLICE_GC_SECS` (at least 1) or the default.
pub fn gc_interval() -> Duration {
    let secs = std::env::var("KOCHAB_SLICE_GC_SECS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(GC_SECS_DEFAULT, |s| s.max(1));
    Duration::from_secs(secs)
}

/// The inode and generation a file folder (`data/xx/<id>.<generation>.s`) stands for.
fn parse_folder(folder: &str) -> Option<(InodeId, u64)> {
    // Through the object-name parser, with a stand-in object id.
    let (id, generation, _) = parse_slice_object_name(&format!("{folder}/{:016x}", 1u64))?;
    Some((id, generation))
}

/// Runs passes for ever (on a store with slices only).
pub async fn gc_loop(shared: Arc<Shared>) {
    if shared.data().slices().is_none() {
        return;
    }
    let interval = gc_interval();
    let mut seen: FxHashMap<String, Instant> = FxHashMap::default();
    loop {
        tokio::time::sleep(interval).await;
        match gc_pass(&shared, &mut seen).await {
            Ok(n) => {
                if n > 0 {
                    tracing::info!("slice GC: deleted {n} orphan objects");
                }
                shared
                    .slice_work()
                    .gc_passes
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!("slice GC pass failed: {e} (the next one tries again)"),
        }
    }
}

async fn list(shared: &Shared, prefix: String) -> io::Result<Vec<String>> {
    let Some(slices) = shared.data().slices() else {
        return Ok(Vec::new());
    };
    let store = slices.store().clone();
    tokio::task::spawn_blocking(move || store.list(&prefix))
        .await
        .map_err(io::Error::other)?
}

/// One pass; returns how many objects it deleted.
pub async fn gc_pass(shared: &Shared, seen: &mut FxHashMap<String, Instant>) -> io::Result<u64> {
    let wait = grant_life() + GC_MARGIN;
    let mut unreferenced: FxHashSet<String> = FxHashSet::default();
    let mut doomed = Vec::new();
    let now = Instant::now();
    for shard in list(shared, "data".into()).await? {
        let folders: Vec<(String, InodeId, u64)> = {
            let listed = list(shared, shard).await?;
            let core = shared.core();
            listed
                .into_iter()
                .filter_map(|f| parse_folder(&f).map(|(id, g)| (f, id, g)))
                .filter(|(_, id, _)| core.engine.table_index(*id).is_some())
                .collect()
        };
        for (folder, id, generation) in folders {
            let names = list(shared, folder).await?;
            let objects: Vec<(String, u64)> = names
                .into_iter()
                .filter_map(|n| {
                    let (i, g, o) = parse_slice_object_name(&n)?;
                    (i == id && g == generation).then_some((n, o))
                })
                .collect();
            if objects.is_empty() {
                continue;
            }
            let referenced: Option<FxHashSet<u64>> = {
                let core = shared.core();
                let live = core
                    .engine
                    .inode(id)
                    .is_some_and(|i| i.btime as u64 == generation);
                if core.engine.table_index(id).is_none()
                    || (!live && core.engine.reclaim_of(id, generation).is_some())
                {
                    // Not served here any more, or its reclaim entry deletes the folder.
                    None
                } else if live {
                    Some(
                        core.engine
                            .layout(id, 0..FILE_BYTES_MAX.div_ceil(CHUNK_BYTES))
                            .into_iter()
                            .flat_map(|(_, refs)| refs.into_iter().map(|r| r.object))
                            .collect(),
                    )
                } else {
                    Some(FxHashSet::default())
                }
            };
            let Some(referenced) = referenced else {
                continue;
            };
            for (name, object) in objects {
                if referenced.contains(&object) || shared.slice_work().is_own_put(&name) {
                    continue;
                }
                match seen.get(&name) {
                    Some(&t1) if now.duration_since(t1) >= wait => doomed.push(name.clone()),
                    Some(_) => {}
                    None if seen.len() < SEEN_MAX => {
                        seen.insert(name.clone(), now);
                    }
                    None => {}
                }
                unreferenced.insert(name);
            }
        }
    }
    // Forgotten: what is referenced now or gone (a second look starts over).
    seen.retain(|n, _| unreferenced.contains(n));
    let mut deleted = 0;
    for batch in doomed.chunks(DELETES_IN_FLIGHT_MAX) {
        let Some(slices) = shared.data().slices() else {
            break;
        };
        let (store, names) = (slices.store().clone(), batch.to_vec());
        tokio::task::spawn_blocking(move || store.delete_many(&names))
            .await
            .map_err(io::Error::other)??;
        for n in batch {
            seen.remove(n);
        }
        deleted += batch.len() as u64;
        shared
            .slice_work()
            .orphans_deleted
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_parse_back_and_strangers_are_ignored() {
        let f = kochab_proto::layout::slice_folder(0x1234, 7);
        assert_eq!(parse_folder(&f), Some((0x1234, 7)));
        assert_eq!(parse_folder("data/34/0000000000001234.c"), None);
    }
}

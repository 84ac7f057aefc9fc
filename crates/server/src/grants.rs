//! Capabilities for file data that clients move themselves (issue 31): how long a grant
//! lives and the object ids a server hands out. Tokens expire by the core's wall clock in
//! Unix seconds (`Clock::unix_secs`): a client compares nothing with it, and servers of a
//! cluster agree within the GC margin.
//!
//! A grant is stateless: its commit tokens are MACs under the cluster's grant key
//! ([`kochab_proto::auth::GrantKey`]), so any server of the cluster verifies them, and its
//! URLs are presigned by the store. Nothing is kept per grant; an object that was granted
//! and never committed is an orphan that the garbage collector (`data::gc`) deletes once its
//! grant can no longer be used.

use kochab_proto::InodeId;
use parking_lot::Mutex;
use std::time::Duration;

/// How long a grant (its PUT URLs and commit tokens) and a layout's GET URLs live unless
/// `KOCHAB_GRANT_SECS` says otherwise: long enough for a client to put a few hundred MiB of
/// write-behind and commit it, short enough that a revoked key's URLs die soon (the stated
/// bound of SECURITY.md) and that orphans are collected within minutes.
pub const GRANT_SECS_DEFAULT: u64 = 300;
/// The longest grant the environment may ask for (a day): S3 caps presigned URLs at 7 days,
/// and the garbage collector waits a grant's life before it deletes an orphan.
const GRANT_SECS_MAX: u64 = 86_400;
/// Objects one `DataGrant` hands out at most: a mount gathers up to a few dozen slices in
/// flight; 64 URLs and tokens stay well within one frame.
pub const GRANT_OBJECTS_MAX: u32 = 64;

/// The life of grants, from `KOCHAB_GRANT_SECS` (1 to a day) or [`GRANT_SECS_DEFAULT`].
pub fn grant_secs() -> u64 {
    std::env::var("KOCHAB_GRANT_SECS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(GRANT_SECS_DEFAULT, |s| s.clamp(1, GRANT_SECS_MAX))
}

/// [`grant_secs`] as a duration.
pub fn grant_life() -> Duration {
    Duration::from_secs(grant_secs())
}

/// Slice object ids: unique per file generation in practice, never 0 (the zeros ref), never
/// reused across servers and restarts in practice. The high 32 bits mix the server id, its
/// incarnation's epoch and a random number drawn at start; the low 32 bits count. A
/// collision, however unlikely, is refused by the store's conditional create and the
/// writer takes another id.
pub struct ObjectIds {
    seed: u64,
    state: Mutex<(u64, u32)>,
}

/// splitmix64's finalizer: a bijective mix of 64 bits.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl ObjectIds {
    pub fn new(server_id: u64, epoch: u64, random: u64) -> ObjectIds {
        let seed = mix(server_id ^ mix(epoch ^ mix(random)));
        ObjectIds {
            seed,
            state: Mutex::new((Self::prefix(seed, 0), 0)),
        }
    }

    fn prefix(seed: u64, round: u64) -> u64 {
        // Never 0: an id with a zero prefix could be 0, the zeros ref.
        (mix(seed.wrapping_add(round)) | 1 << 63) & !0xffff_ffff
    }

    /// The next id.
    pub fn next(&self) -> u64 {
        let mut st = self.state.lock();
        let (prefix, counter) = &mut *st;
        if *counter == u32::MAX {
            // 4 billion ids from one prefix: a fresh prefix (the round is its high half).
            let round = (*prefix >> 32).wrapping_add(1);
            *prefix = Self::prefix(self.seed, round);
            *counter = 0;
        }
        *counter += 1;
        *prefix | u64::from(*counter)
    }
}

/// The name of slice object `object` of a file generation (see `kochab_proto::layout`).
pub fn object_name(id: InodeId, generation: u64, object: u64) -> String {
    kochab_proto::layout::slice_object_name(id, generation, object)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_nonzero_distinct_and_differ_between_incarnations() {
        let a = ObjectIds::new(1, 1, 5);
        let b = ObjectIds::new(1, 2, 5);
        let xs: Vec<u64> = (0..1000).map(|_| a.next()).collect();
        let ys: Vec<u64> = (0..1000).map(|_| b.next()).collect();
        assert!(xs.iter().chain(&ys).all(|&x| x != 0));
        let mut all: Vec<u64> = xs.iter().chain(&ys).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 2000);
        // A wrapped counter takes a fresh prefix.
        a.state.lock().1 = u32::MAX;
        let after = a.next();
        assert_ne!(after >> 32, xs[0] >> 32);
        assert_ne!(after, 0);
    }
}

//! A cluster's client keys, as part of the coordinator's replicated state: every key with
//! its policy and its secret sealed under the cluster key, the next id to give, and how far
//! each member server has applied them.
//!
//! Every change (an add, a revocation, the import of a single server's key file) bumps
//! `version`. The leader's driver tells each live member that is behind (`Control::Keys`),
//! the member reads the keys, refuses revoked ones, closes their connections and answers
//! with the version it applied, which is recorded here. A change is *settled* once every
//! live member holds it and no fenced incarnation can still be serving; a member that
//! makes no progress for [`apply_grace_ms`] while behind is fenced (see
//! `CoordState::apply`), so a change always settles within a bound.
//!
//! Pure, like the rest of the state: time comes from the commands.

use std::collections::BTreeMap;

use kochab_proto::auth::{ADMIN_KEY_ID, KeyId};
use kochab_proto::cluster::{CoordReply, Epoch, Incarnation, SealedKey, ServerId};
use kochab_proto::{KEYS_MAX, check_new_key, fs_err};
use serde::{Deserialize, Serialize};

/// Least time a member gets to apply a key change before it is fenced. A live member
/// answers the driver's `Keys` control within a round trip to the coordinator, so this is
/// slack for a loaded machine; a member that cannot be told is fenced by its lease anyway.
pub const KEYS_APPLY_MIN_MS: u64 = 5_000;

/// How long a member may go without applying a key change (while behind) before it is
/// fenced: a lease (a member out of touch that long is fenced whatever it was doing), but
/// at least [`KEYS_APPLY_MIN_MS`].
pub fn apply_grace_ms(lease_ms: u64) -> u64 {
    lease_ms.max(KEYS_APPLY_MIN_MS)
}

/// The longest a key change can take to settle: the grace of a member that stops
/// applying, then the rest of its lease once fenced, plus a few driver ticks.
pub fn settle_bound_ms(lease_ms: u64) -> u64 {
    apply_grace_ms(lease_ms) + lease_ms + 2_000
}

/// How far one member server has applied the client keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysHeld {
    /// The incarnation this is about (a new one starts from nothing).
    pub epoch: Epoch,
    pub version: u64,
    /// When it last made progress: its registration, its last report, or the change that
    /// put it behind while it was up to date (coordinator time).
    pub since_ms: u64,
}

/// The client keys of a cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientKeys {
    /// True once keys exist or a data directory's key file was imported: an import comes
    /// first or not at all (its ids are in client key files already).
    pub imported: bool,
    /// The next id to give (0 in a state that never had one: read as 1, id 0 being the
    /// cluster key's).
    pub next_id: KeyId,
    /// Bumped by every change.
    pub version: u64,
    pub keys: BTreeMap<KeyId, SealedKey>,
    /// Per member server, how far it applied them.
    pub held: BTreeMap<ServerId, KeysHeld>,
    /// No fenced incarnation serves past this time (coordinator time): the end of the
    /// latest lease of an incarnation fenced while its lease ran. A change settles only
    /// after it, as such an incarnation may not have heard of it.
    pub fenced_until_ms: u64,
}

impl ClientKeys {
    /// Adds `key` under the next id. A key whose nonce is already here is the same
    /// proposal applied again: answered as the first time, nothing changes.
    pub fn add(&mut self, key: &SealedKey, now_ms: u64) -> CoordReply {
        if let Some((id, _)) = self.keys.iter().find(|(_, k)| k.nonce == key.nonce) {
            return CoordReply::Key {
                id: *id,
                version: self.version,
            };
        }
        if key.revoked {
            return CoordReply::KeyRefused(fs_err!(EINVAL, "a new key cannot be revoked"));
        }
        if let Err(e) = check_new_key(&key.policy, &key.note) {
            return CoordReply::KeyRefused(e);
        }
        let id = self.next_id.max(1);
        if self.keys.len() >= KEYS_MAX || id == KeyId::MAX {
            return CoordReply::KeyRefused(fs_err!(
                ENOSPC,
                "the cluster holds {KEYS_MAX} keys, the most it may"
            ));
        }
        self.keys.insert(id, key.clone());
        self.next_id = id + 1;
        self.imported = true;
        self.bump(now_ms);
        CoordReply::Key {
            id,
            version: self.version,
        }
    }

    /// Revokes key `id` for good (again: the same answer, nothing changes).
    pub fn revoke(&mut self, id: KeyId, now_ms: u64) -> CoordReply {
        if id == ADMIN_KEY_ID {
            return CoordReply::KeyRefused(fs_err!(
                EINVAL,
                "the cluster key cannot be revoked (make a new cluster to replace it)"
            ));
        }
        let Some(k) = self.keys.get_mut(&id) else {
            return CoordReply::KeyRefused(fs_err!(ENOENT, "no key {id}"));
        };
        if !k.revoked {
            k.revoked = true;
            self.bump(now_ms);
        }
        CoordReply::Key {
            id,
            version: self.version,
        }
    }

    /// Takes the keys of a single server's key file, unless keys were imported or added
    /// already.
    pub fn import(
        &mut self,
        next_id: KeyId,
        keys: &[(KeyId, SealedKey)],
        now_ms: u64,
    ) -> CoordReply {
        if self.imported {
            return CoordReply::Stale("the client keys are imported or added already".into());
        }
        if keys.len() > KEYS_MAX {
            return CoordReply::Refused(format!("more than {KEYS_MAX} keys to import"));
        }
        let mut table = BTreeMap::new();
        for (id, k) in keys {
            if *id == ADMIN_KEY_ID || *id >= next_id {
                return CoordReply::Refused(format!("key id {id} is not a client key's"));
            }
            if table.insert(*id, k.clone()).is_some() {
                return CoordReply::Refused(format!("key id {id} is imported twice"));
            }
        }
        self.imported = true;
        self.next_id = next_id.max(1);
        if !table.is_empty() {
            self.keys = table;
            self.bump(now_ms);
        }
        CoordReply::Ok
    }

    /// A new incarnation registered: it holds no keys yet.
    pub fn joined(&mut self, inc: Incarnation, now_ms: u64) {
        self.held.insert(
            inc.server,
            KeysHeld {
                epoch: inc.epoch,
                version: 0,
                since_ms: now_ms,
            },
        );
    }

    /// Incarnation `by` (live: the caller checked) applied every change up to `version`.
    pub fn applied(&mut self, by: Incarnation, version: u64, now_ms: u64) -> CoordReply {
        if version > self.version {
            return CoordReply::Refused(format!(
                "key version {version} is not made yet (the latest is {})",
                self.version
            ));
        }
        match self.held.get_mut(&by.server) {
            Some(h) if h.epoch == by.epoch && h.version < version => {
                h.version = version;
                h.since_ms = now_ms;
                CoordReply::Ok
            }
            Some(h) if h.epoch == by.epoch => CoordReply::Stale("already recorded".into()),
            _ => CoordReply::Stale(format!("{by:?} did not register with the keys")),
        }
    }

    /// The version `inc` has applied (0 if it reported nothing).
    pub fn held_by(&self, inc: Incarnation) -> u64 {
        match self.held.get(&inc.server) {
            Some(h) if h.epoch == inc.epoch => h.version,
            _ => 0,
        }
    }

    /// True if `inc` is behind and made no progress since `now_ms - grace_ms`.
    pub fn late(&self, inc: Incarnation, grace_ms: u64, now_ms: u64) -> bool {
        let since = match self.held.get(&inc.server) {
            Some(h) if h.epoch == inc.epoch => h.since_ms,
            // Registered before the keys were part of the state: as old as can be.
            _ => 0,
        };
        self.held_by(inc) < self.version && now_ms >= since.saturating_add(grace_ms)
    }

    /// An incarnation whose lease runs until `lease_until_ms` was fenced.
    pub fn fenced(&mut self, lease_until_ms: u64) {
        self.fenced_until_ms = self.fenced_until_ms.max(lease_until_ms);
    }

    fn bump(&mut self, now_ms: u64) {
        let before = self.version;
        self.version += 1;
        // Members that were up to date are behind from now on; the others keep the time
        // of their last progress.
        for h in self.held.values_mut() {
            if h.version >= before {
                h.since_ms = now_ms;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_proto::{Errno, KeyPolicy};

    fn key(n: u8) -> SealedKey {
        SealedKey {
            nonce: [n; 16],
            sealed: [n; 32],
            policy: KeyPolicy::TRUSTED,
            revoked: false,
            note: format!("k{n}"),
        }
    }

    fn refused(r: CoordReply) -> Errno {
        match r {
            CoordReply::KeyRefused(e) => e.errno,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn ids_are_given_once_and_a_retried_add_is_the_same_key() {
        let mut k = ClientKeys::default();
        assert_eq!(k.add(&key(1), 10), CoordReply::Key { id: 1, version: 1 });
        assert_eq!(k.add(&key(2), 11), CoordReply::Key { id: 2, version: 2 });
        assert_eq!(k.add(&key(1), 12), CoordReply::Key { id: 1, version: 2 });
        assert_eq!(k.revoke(1, 13), CoordReply::Key { id: 1, version: 3 });
        assert_eq!(k.revoke(1, 14), CoordReply::Key { id: 1, version: 3 });
        assert_eq!(refused(k.revoke(9, 15)), Errno::ENOENT);
        assert_eq!(refused(k.revoke(ADMIN_KEY_ID, 15)), Errno::EINVAL);
        let mut long = key(3);
        long.note = "x".repeat(kochab_proto::KEY_NOTE_MAX + 1);
        assert_eq!(refused(k.add(&long, 16)), Errno::EINVAL);
        assert_eq!(k.next_id, 3, "a refused add takes no id");
        assert!(matches!(k.import(9, &[], 17), CoordReply::Stale(_)));
    }

    #[test]
    fn an_import_keeps_its_ids_and_comes_first_or_not_at_all() {
        let mut k = ClientKeys::default();
        assert!(matches!(
            k.import(3, &[(3, key(1))], 1),
            CoordReply::Refused(_)
        ));
        assert_eq!(k.import(5, &[(2, key(1)), (4, key(2))], 1), CoordReply::Ok);
        assert_eq!((k.version, k.next_id), (1, 5));
        assert!(matches!(k.import(9, &[], 2), CoordReply::Stale(_)));
        assert_eq!(k.add(&key(3), 3), CoordReply::Key { id: 5, version: 2 });
    }

    #[test]
    fn a_member_is_late_only_after_the_grace_without_progress() {
        let mut k = ClientKeys::default();
        let a = Incarnation {
            server: ServerId(2),
            epoch: Epoch(1),
        };
        k.joined(a, 0);
        assert!(!k.late(a, 100, 1_000), "nothing to apply");
        k.add(&key(1), 1_000);
        assert!(!k.late(a, 100, 1_099));
        assert!(k.late(a, 100, 1_100));
        assert_eq!(k.applied(a, 1, 1_050), CoordReply::Ok);
        assert!(!k.late(a, 100, 5_000));
        assert!(matches!(k.applied(a, 1, 1_060), CoordReply::Stale(_)));
        assert!(matches!(k.applied(a, 2, 1_060), CoordReply::Refused(_)));
        // Another incarnation of the same server starts from nothing.
        let a2 = Incarnation {
            epoch: Epoch(2),
            ..a
        };
        assert_eq!(k.held_by(a2), 0);
        assert!(matches!(k.applied(a2, 1, 1_070), CoordReply::Stale(_)));
    }
}

//! Directory entries of one directory, ordered by a keyed hash of the name.
//!
//! Ordering by hash (as ext4's htree does) gives readdir cookies that stay valid while the
//! directory changes: an entry's cookie is its hash bucket plus its slot in the bucket, so
//! inserting or removing other names never moves it. Name hashes are 63 bits wide, so every
//! cookie is a valid, positive directory offset (loff_t) for lseek/seekdir/telldir. Buckets
//! hold names whose 59-bit hashes collide (in practice never more than one).

use crate::name::Name;
use kochab_proto::{FileKind, InodeId};
use std::collections::BTreeMap;
use std::ops::Bound;

/// Readdir cookie after ".".
pub const COOKIE_DOT: u64 = 1;
/// Readdir cookie after "..".
pub const COOKIE_DOTDOT: u64 = 2;
/// Names per bucket: the low 4 bits of a cookie number the slot within a bucket.
pub const BUCKET_SLOTS: usize = 16;
const SLOT_MASK: u64 = BUCKET_SLOTS as u64 - 1;
/// Bucket keys start here so that cookies 0..=2 stay free for start, "." and "..".
const FIRST_BUCKET: u64 = 16;
/// Name hashes (and so cookies) are below this: directory offsets are signed 64-bit.
pub const HASH_LIMIT: u64 = 1 << 63;
/// Checkpoint boxes split a directory into 2^10 hash ranges, so that a checkpoint of a huge
/// directory rewrites only the ranges that changed.
pub const DENTRY_BOX_SHIFT: u32 = 53;
/// The box shift of checkpoint images written before hashes were cut to 63 bits (format 1:
/// 64-bit hashes, 2^10 boxes); such images are loaded and rehashed (`Table::load_image`).
pub const LEGACY_DENTRY_BOX_SHIFT: u32 = 54;

/// One directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dentry {
    pub name: Name,
    pub child: InodeId,
    pub kind: FileKind,
}

#[derive(Clone, Debug)]
enum Bucket {
    One(Dentry),
    /// Colliding names; `None` keeps the slot (and so the cookies of the others) stable.
    Many(Vec<Option<Dentry>>),
}

/// The entries of one directory.
#[derive(Clone, Debug, Default)]
pub struct DirEntries {
    buckets: BTreeMap<u64, Bucket>,
    len: u64,
}

/// The bucket a name hash falls in.
pub fn bucket_of(hash: u64) -> u64 {
    (hash & !SLOT_MASK).max(FIRST_BUCKET)
}

/// The checkpoint box a name hash falls in.
pub fn box_of(hash: u64) -> u16 {
    (bucket_of(hash) >> DENTRY_BOX_SHIFT) as u16
}

/// Returned when a bucket has no free slot (16 names with one 60-bit keyed hash).
#[derive(Debug, PartialEq, Eq)]
pub struct BucketFull;

impl DirEntries {
    /// Number of entries (without "." and "..").
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The entry called `name`, whose hash is `hash`.
    pub fn get(&self, hash: u64, name: &[u8]) -> Option<&Dentry> {
        match self.buckets.get(&bucket_of(hash))? {
            Bucket::One(d) => (d.name.as_bytes() == name).then_some(d),
            Bucket::Many(v) => v.iter().flatten().find(|d| d.name.as_bytes() == name),
        }
    }

    /// True if `name` (hash `hash`) is present or its bucket has a free slot.
    pub fn has_room(&self, hash: u64, name: &[u8]) -> bool {
        match self.buckets.get(&bucket_of(hash)) {
            None | Some(Bucket::One(_)) => true,
            Some(Bucket::Many(v)) => {
                v.len() < BUCKET_SLOTS
                    || v.iter()
                        .any(|e| e.as_ref().is_none_or(|d| d.name.as_bytes() == name))
            }
        }
    }

    /// Inserts or replaces the entry for `d.name`. Returns whether the name is new.
    pub fn insert(&mut self, hash: u64, d: Dentry) -> Result<bool, BucketFull> {
        let key = bucket_of(hash);
        let Some(bucket) = self.buckets.get_mut(&key) else {
            self.buckets.insert(key, Bucket::One(d));
            self.len += 1;
            return Ok(true);
        };
        match bucket {
            Bucket::One(old) if old.name == d.name => {
                *old = d;
                Ok(false)
            }
            Bucket::One(old) => {
                let first = old.clone();
                *bucket = Bucket::Many(vec![Some(first), Some(d)]);
                self.len += 1;
                Ok(true)
            }
            Bucket::Many(v) => {
                if let Some(slot) = v.iter_mut().flatten().find(|e| e.name == d.name) {
                    *slot = d;
                    return Ok(false);
                }
                if let Some(hole) = v.iter_mut().find(|e| e.is_none()) {
                    *hole = Some(d);
                } else if v.len() < BUCKET_SLOTS {
                    v.push(Some(d));
                } else {
                    return Err(BucketFull);
                }
                self.len += 1;
                Ok(true)
            }
        }
    }

    /// Removes the entry called `name`.
    pub fn remove(&mut self, hash: u64, name: &[u8]) -> Option<Dentry> {
        let key = bucket_of(hash);
        let bucket = self.buckets.get_mut(&key)?;
        let removed = match bucket {
            Bucket::One(d) if d.name.as_bytes() == name => {
                let Some(Bucket::One(d)) = self.buckets.remove(&key) else {
                    unreachable!()
                };
                Some(d)
            }
            Bucket::One(_) => None,
            Bucket::Many(v) => {
                let taken = v
                    .iter_mut()
                    .find(|e| e.as_ref().is_some_and(|d| d.name.as_bytes() == name))
                    .and_then(Option::take);
                if v.iter().all(Option::is_none) {
                    self.buckets.remove(&key);
                }
                taken
            }
        };
        if removed.is_some() {
            self.len -= 1;
        }
        removed
    }

    /// Entries after cookie `after` (use `COOKIE_DOTDOT` for the first), each with its own
    /// cookie, in cookie order.
    pub fn iter_after(&self, after: u64) -> impl Iterator<Item = (u64, &Dentry)> + '_ {
        let (start, skip_through) = if after < FIRST_BUCKET {
            (Bound::Unbounded, None)
        } else {
            (Bound::Included(after & !SLOT_MASK), Some(after))
        };
        self.buckets
            .range((start, Bound::Unbounded))
            .flat_map(|(&key, b)| Self::bucket_entries(key, b))
            .filter(move |(cookie, _)| skip_through.is_none_or(|s| *cookie > s))
    }

    /// Entries whose hash falls in checkpoint box `boxno`, with their cookies.
    pub fn iter_box(&self, boxno: u16) -> impl Iterator<Item = (u64, &Dentry)> + '_ {
        self.iter_box_shifted(boxno, DENTRY_BOX_SHIFT)
    }

    fn iter_box_shifted(
        &self,
        boxno: u16,
        shift: u32,
    ) -> impl Iterator<Item = (u64, &Dentry)> + '_ {
        let lo = (boxno as u64) << shift;
        let hi = lo.checked_add(1u64 << shift);
        let upper = match hi {
            Some(h) => Bound::Excluded(h),
            None => Bound::Unbounded,
        };
        self.buckets
            .range((Bound::Included(lo), upper))
            .flat_map(|(&key, b)| Self::bucket_entries(key, b))
    }

    /// Every entry, in cookie order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Dentry)> + '_ {
        self.iter_after(0)
    }

    /// The distinct checkpoint boxes that hold entries.
    pub fn boxes(&self) -> Vec<u16> {
        let mut out: Vec<u16> = Vec::new();
        for key in self.buckets.keys() {
            let b = (key >> DENTRY_BOX_SHIFT) as u16;
            if out.last() != Some(&b) {
                out.push(b);
            }
        }
        out
    }

    /// Drops every entry whose hash falls in box `boxno` (before loading that box's image).
    pub fn clear_box(&mut self, boxno: u16) {
        self.clear_box_shifted(boxno, DENTRY_BOX_SHIFT);
    }

    /// `clear_box` for the boxes of format-1 images.
    pub fn clear_legacy_box(&mut self, boxno: u16) {
        self.clear_box_shifted(boxno, LEGACY_DENTRY_BOX_SHIFT);
    }

    fn clear_box_shifted(&mut self, boxno: u16, shift: u32) {
        let keys: Vec<u64> = self
            .iter_box_shifted(boxno, shift)
            .map(|(c, _)| c & !SLOT_MASK)
            .collect();
        for k in keys {
            if let Some(b) = self.buckets.remove(&k) {
                self.len -= match b {
                    Bucket::One(_) => 1,
                    Bucket::Many(v) => v.iter().flatten().count() as u64,
                };
            }
        }
    }

    /// Puts an entry back at exactly the cookie it had (checkpoint load).
    pub fn insert_at(&mut self, cookie: u64, d: Dentry) {
        let key = cookie & !SLOT_MASK;
        let slot = (cookie & SLOT_MASK) as usize;
        match self.buckets.get_mut(&key) {
            None if slot == 0 => {
                self.buckets.insert(key, Bucket::One(d));
            }
            None => {
                let mut v = vec![None; slot + 1];
                v[slot] = Some(d);
                self.buckets.insert(key, Bucket::Many(v));
            }
            Some(b) => {
                let mut v = match std::mem::replace(b, Bucket::Many(Vec::new())) {
                    Bucket::One(old) => vec![Some(old)],
                    Bucket::Many(v) => v,
                };
                if v.len() <= slot {
                    v.resize(slot + 1, None);
                }
                if v[slot].is_some() {
                    self.len -= 1;
                }
                v[slot] = Some(d);
                *b = Bucket::Many(v);
            }
        }
        self.len += 1;
    }

    fn bucket_entries(key: u64, b: &Bucket) -> Box<dyn Iterator<Item = (u64, &Dentry)> + '_> {
        match b {
            Bucket::One(d) => Box::new(std::iter::once((key, d))),
            Bucket::Many(v) => Box::new(
                v.iter()
                    .enumerate()
                    .filter_map(move |(i, d)| d.as_ref().map(|d| (key | i as u64, d))),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(name: &str, child: u64) -> Dentry {
        Dentry {
            name: Name::new(name.as_bytes()),
            child,
            kind: FileKind::File,
        }
    }

    #[test]
    fn cookies_survive_other_changes() {
        let mut e = DirEntries::default();
        for i in 0..100u64 {
            e.insert(
                i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                d(&format!("f{i}"), i),
            )
            .unwrap();
        }
        let all: Vec<(u64, u64)> = e.iter().map(|(c, d)| (c, d.child)).collect();
        assert_eq!(all.len(), 100);
        let (mid_cookie, _) = all[50];
        // Remove some earlier and later entries; resuming from mid still yields the rest.
        e.remove(0, b"f0");
        e.remove(99u64.wrapping_mul(0x9e37_79b9_7f4a_7c15), b"f99");
        let rest: Vec<u64> = e.iter_after(mid_cookie).map(|(_, d)| d.child).collect();
        let expect: Vec<u64> = all[51..]
            .iter()
            .map(|x| x.1)
            .filter(|&c| c != 0 && c != 99)
            .collect();
        assert_eq!(rest, expect);
    }

    #[test]
    fn colliding_names_share_a_bucket_with_stable_slots() {
        let mut e = DirEntries::default();
        let h = 0x1234_5670;
        e.insert(h, d("a", 1)).unwrap();
        e.insert(h, d("b", 2)).unwrap();
        e.insert(h, d("c", 3)).unwrap();
        let cookies: Vec<u64> = e.iter().map(|(c, _)| c).collect();
        assert_eq!(cookies.len(), 3);
        e.remove(h, b"a");
        let after: Vec<u64> = e.iter().map(|(c, _)| c).collect();
        assert_eq!(after, cookies[1..].to_vec());
        assert_eq!(e.get(h, b"c").unwrap().child, 3);
        assert_eq!(
            e.iter_after(cookies[1])
                .map(|(_, d)| d.child)
                .collect::<Vec<_>>(),
            vec![3]
        );
        for i in 0..14 {
            e.insert(h, d(&format!("x{i}"), 10 + i)).unwrap();
        }
        assert_eq!(e.insert(h, d("overflow", 99)), Err(BucketFull));
        assert_eq!(
            e.insert(h, d("c", 33)),
            Ok(false),
            "replacing is fine when full"
        );
        assert_eq!(e.len(), 16);
    }

    #[test]
    fn box_clear_and_insert_at_round_trip() {
        let mut e = DirEntries::default();
        for i in 0..1000u64 {
            e.insert(
                i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                d(&format!("n{i}"), i),
            )
            .unwrap();
        }
        let boxes = e.boxes();
        let b = boxes[3];
        let saved: Vec<(u64, Dentry)> = e.iter_box(b).map(|(c, d)| (c, d.clone())).collect();
        assert!(!saved.is_empty());
        let before = e.len();
        e.clear_box(b);
        assert_eq!(e.len(), before - saved.len() as u64);
        for (c, d) in saved {
            e.insert_at(c, d);
        }
        assert_eq!(e.len(), before);
    }
}

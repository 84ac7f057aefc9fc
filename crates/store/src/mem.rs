//! An object store in memory, for tests and fuzz targets: recovery and checkpoint loading
//! run over damaged objects thousands of times without touching a disk.
//!
//! It keeps what is durable apart from what was only written, as a disk behind a page
//! cache does: an object's bytes reach its durable copy at `sync_data` (each block written
//! since the last one), a name created, removed or renamed reaches the durable namespace at
//! `sync_dir` of its folder, and `put` and `create_if_absent` are durable when they return.
//! [`MemStore::power_loss`] (or [`MemStore::crash_image`], which leaves the store running)
//! then leaves only what a power cut would: every unsynced change dropped, or each unsynced
//! block kept or dropped at random ([`MemLoss::Tear`]).
//!
//! Bytes are held in blocks shared between copies ([`Blocks`]): a crash image or a deep
//! clone copies the namespace and a list of block references per object, never the bytes,
//! and each side copies a block only when it writes it.

use crate::blocks::{BLOCK, Blocks};
use crate::{Capacity, Object, ObjectStore};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

/// One object's bytes: as written, and as durable (cheap to clone: blocks are shared).
#[derive(Clone, Debug, Default)]
struct Node {
    data: Blocks,
    durable: Blocks,
    /// Blocks written since the last sync (their durable copy may differ).
    dirty: BTreeSet<u64>,
    /// The length changed since the last sync.
    resized: bool,
}

type NodeRef = Arc<Mutex<Node>>;

#[derive(Debug, Default)]
struct State {
    /// The namespace as it reads now.
    names: BTreeMap<String, NodeRef>,
    /// The namespace a power cut would leave.
    durable: BTreeMap<String, NodeRef>,
}

/// How a power loss treats what was not synced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemLoss {
    /// Every object back to its last synced bytes and length; every unsynced name change
    /// undone.
    Drop,
    /// Names as with `Drop`; each unsynced 4 KiB block kept or dropped at random, and an
    /// unsynced length kept or dropped at random (seeded: the same seed, the same state).
    Tear { seed: u64 },
}

/// Objects in a map; clones share the same objects.
#[derive(Clone, Default, Debug)]
pub struct MemStore {
    state: Arc<Mutex<State>>,
    /// Refuse positioned I/O, as a store on S3 does (see [`MemStore::objects_only`]).
    objects_only: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Node {
    fn new_durable(data: &[u8]) -> NodeRef {
        let bytes = Blocks::from_slice(data);
        Arc::new(Mutex::new(Node {
            data: bytes.clone(),
            durable: bytes,
            dirty: BTreeSet::new(),
            resized: false,
        }))
    }

    fn mark(&mut self, from: u64, to: u64) {
        if to > from {
            let block = BLOCK as u64;
            self.dirty.extend(from / block..to.div_ceil(block));
        }
    }

    fn sync(&mut self) {
        self.durable.resize(self.data.len());
        for b in std::mem::take(&mut self.dirty) {
            let b = b as usize;
            if b * BLOCK < self.data.len() {
                self.durable.take_block(&self.data, b);
            }
        }
        self.resized = false;
    }

    /// What a power cut leaves of this object (all of it durable afterwards).
    fn after_loss(&self, loss: MemLoss, rng: &mut u64) -> Node {
        let bytes = match loss {
            MemLoss::Drop => self.durable.clone(),
            MemLoss::Tear { .. } => {
                let keep_len = self.resized && coin(rng);
                let len = if keep_len {
                    self.data.len()
                } else {
                    self.durable.len()
                };
                let mut out = self.durable.clone();
                out.resize(len);
                for &b in &self.dirty {
                    let b = b as usize;
                    if b * BLOCK >= len || !coin(rng) {
                        continue;
                    }
                    out.take_block(&self.data, b);
                }
                out
            }
        };
        Node {
            data: bytes.clone(),
            durable: bytes,
            dirty: BTreeSet::new(),
            resized: false,
        }
    }
}

/// A fair coin from xorshift64*.
fn coin(state: &mut u64) -> bool {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 63) == 1
}

/// Copies of `names` and `durable` with the nodes they share copied once (a node named
/// twice stays one node), each through `copy`.
fn copy_maps(st: &State, mut copy: impl FnMut(&Node) -> Node, durable_only: bool) -> State {
    let mut done: HashMap<*const Mutex<Node>, NodeRef> = HashMap::new();
    let mut one = |n: &NodeRef| {
        done.entry(Arc::as_ptr(n))
            .or_insert_with(|| Arc::new(Mutex::new(copy(&lock(n)))))
            .clone()
    };
    let durable: BTreeMap<String, NodeRef> = st
        .durable
        .iter()
        .map(|(k, n)| (k.clone(), one(n)))
        .collect();
    let names = if durable_only {
        durable.clone()
    } else {
        st.names.iter().map(|(k, n)| (k.clone(), one(n))).collect()
    };
    State { names, durable }
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// A store of whole objects only: positioned I/O and rename are refused and
    /// [`ObjectStore::positioned_io`] is false, as on S3, so the code paths for such a store
    /// (the journal as objects, images in parts) run in memory.
    pub fn objects_only() -> MemStore {
        MemStore {
            objects_only: true,
            ..MemStore::default()
        }
    }

    fn positioned(&self, name: &str) -> io::Result<()> {
        if self.objects_only {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{name}: this store holds whole objects only"),
            ));
        }
        Ok(())
    }

    /// An independent copy of every object (what is durable and what is not).
    pub fn deep_clone(&self) -> MemStore {
        let st = lock(&self.state);
        MemStore {
            state: Arc::new(Mutex::new(copy_maps(&st, |n| n.clone(), false))),
            objects_only: self.objects_only,
        }
    }

    /// Every object as it reads now, by name.
    pub fn objects(&self) -> BTreeMap<String, Vec<u8>> {
        lock(&self.state)
            .names
            .iter()
            .map(|(k, n)| (k.clone(), lock(n).data.to_vec()))
            .collect()
    }

    /// What a power cut at this moment would leave, as an independent store (this one is
    /// left as it is, its writers running on).
    pub fn crash_image(&self, loss: MemLoss) -> MemStore {
        let mut rng = match loss {
            MemLoss::Drop => 1,
            MemLoss::Tear { seed } => seed | 1,
        };
        let st = lock(&self.state);
        MemStore {
            state: Arc::new(Mutex::new(copy_maps(
                &st,
                |n| n.after_loss(loss, &mut rng),
                true,
            ))),
            objects_only: self.objects_only,
        }
    }

    /// A power cut: this store keeps only what [`MemStore::crash_image`] would. Objects
    /// already open read the state after the cut.
    pub fn power_loss(&self, loss: MemLoss) {
        let image = self.crash_image(loss);
        let mut st = lock(&self.state);
        let img = lock(&image.state);
        // Open handles point at nodes of this store: give them the nodes' new contents.
        for (name, node) in &st.durable {
            if let Some(n) = img.durable.get(name) {
                *lock(node) = lock(n).clone();
            }
        }
        let names = st.durable.clone();
        st.names = names;
    }
}

/// The entries of `map` named directly under the folder `prefix`, in name order (a range
/// of the map, not a scan of it).
fn in_folder<'a, V>(
    map: &'a BTreeMap<String, V>,
    prefix: &str,
) -> impl Iterator<Item = (&'a String, &'a V)> {
    let dir = format!("{prefix}/");
    map.range(dir.clone()..)
        .take_while(move |(k, _)| k.starts_with(&dir))
        .filter(move |(k, _)| !k[prefix.len() + 1..].contains('/'))
}

struct MemObject {
    state: Arc<Mutex<State>>,
    node: NodeRef,
}

fn missing(name: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("no object {name}"))
}

fn too_large(what: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("offset or length {what} too large for a store in memory"),
    )
}

/// Objects in memory are bounded by this (a test never needs more).
const MAX_OBJECT_BYTES: u64 = 1 << 32;

impl MemObject {
    /// The node, with the store's lock held so that a crash image sees whole operations.
    fn with<T>(&self, f: impl FnOnce(&mut Node) -> T) -> T {
        let _st = lock(&self.state);
        f(&mut lock(&self.node))
    }
}

impl Object for MemObject {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.with(|node| {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            Ok(node.data.read(start, buf))
        })
    }

    fn write_at(&self, d: &[u8], offset: u64) -> io::Result<()> {
        let end = offset.saturating_add(d.len() as u64);
        if end > MAX_OBJECT_BYTES {
            return Err(too_large(end));
        }
        self.with(|node| {
            let (o, e) = (offset as usize, end as usize);
            if node.data.len() < e {
                node.data.resize(e);
                node.resized = true;
            }
            node.data.write(o, d);
            node.mark(offset, end);
            Ok(())
        })
    }

    fn sync_data(&self) -> io::Result<()> {
        self.with(|node| node.sync());
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.with(|node| node.data.len() as u64))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if len > MAX_OBJECT_BYTES {
            return Err(too_large(len));
        }
        self.with(|node| {
            let old = node.data.len() as u64;
            node.data.resize(len as usize);
            node.mark(len.min(old), len.max(old));
            node.resized = true;
            Ok(())
        })
    }
}

impl ObjectStore for MemStore {
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let node = Node::new_durable(data);
        let mut st = lock(&self.state);
        st.names.insert(name.to_string(), node.clone());
        st.durable.insert(name.to_string(), node);
        Ok(())
    }

    fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        Ok(lock(&self.state)
            .names
            .get(name)
            .map(|n| lock(n).data.to_vec()))
    }

    fn get_range(&self, name: &str, offset: u64, len: u64) -> io::Result<Option<Vec<u8>>> {
        Ok(lock(&self.state).names.get(name).map(|n| {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            let end = usize::try_from(offset.saturating_add(len)).unwrap_or(usize::MAX);
            lock(n).data.range(start, end)
        }))
    }

    fn delete(&self, name: &str) -> io::Result<()> {
        lock(&self.state).names.remove(name);
        Ok(())
    }

    /// Objects and sub-folders directly under `prefix`, as a file system's directory or an
    /// S3 listing with a delimiter gives them (a folder is there while it holds objects).
    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        let st = lock(&self.state);
        let dir = format!("{prefix}/");
        let mut names: Vec<String> = st
            .names
            .range(dir.clone()..)
            .take_while(|(k, _)| k.starts_with(&dir))
            .map(|(k, _)| match k[dir.len()..].find('/') {
                Some(end) => k[..dir.len() + end].to_string(),
                None => k.clone(),
            })
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.positioned(from)?;
        let mut st = lock(&self.state);
        let node = st.names.remove(from).ok_or_else(|| missing(from))?;
        st.names.insert(to.to_string(), node);
        Ok(())
    }

    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn Object>> {
        self.positioned(name)?;
        let mut st = lock(&self.state);
        let node = match st.names.get(name) {
            Some(n) => n.clone(),
            None if create => {
                let n = NodeRef::default();
                st.names.insert(name.to_string(), n.clone());
                n
            }
            None => return Err(missing(name)),
        };
        Ok(Arc::new(MemObject {
            state: self.state.clone(),
            node,
        }))
    }

    fn open_sync_direct(&self, name: &str) -> io::Result<Option<Arc<dyn Object>>> {
        self.positioned(name)?;
        Ok(None)
    }

    fn open_direct(&self, name: &str, _create: bool) -> io::Result<Option<Arc<dyn Object>>> {
        self.positioned(name)?;
        Ok(None)
    }

    fn positioned_io(&self) -> bool {
        !self.objects_only
    }

    /// Names directly under `prefix` become durable as they are now.
    fn sync_dir(&self, prefix: &str) -> io::Result<()> {
        let mut st = lock(&self.state);
        let gone: Vec<String> = in_folder(&st.durable, prefix)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            st.durable.remove(&k);
        }
        let now: Vec<(String, NodeRef)> = in_folder(&st.names, prefix)
            .map(|(k, n)| (k.clone(), n.clone()))
            .collect();
        st.durable.extend(now);
        Ok(())
    }

    /// Atomic under the map's lock, as the trait requires; durable when it returns.
    fn create_if_absent(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let mut st = lock(&self.state);
        if st.names.contains_key(name) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("object {name} exists"),
            ));
        }
        let node = Node::new_durable(data);
        st.names.insert(name.to_string(), node.clone());
        st.durable.insert(name.to_string(), node);
        Ok(())
    }

    fn capacity(&self) -> io::Result<Capacity> {
        Ok(Capacity {
            total_bytes: MAX_OBJECT_BYTES,
            free_bytes: MAX_OBJECT_BYTES,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_names_objects_and_sub_folders_as_a_directory_does() {
        let s = MemStore::new();
        for name in ["j/a/seg1", "j/a/seg2", "j/a-b", "j/b/x/y", "j/c", "k/z"] {
            s.put(name, b"1").unwrap();
        }
        assert_eq!(s.list("j").unwrap(), ["j/a", "j/a-b", "j/b", "j/c"]);
        assert_eq!(s.list("j/b").unwrap(), ["j/b/x"]);
        assert!(s.list("none").unwrap().is_empty());
        s.delete("j/c").unwrap();
        s.delete_many(&["j/a/seg1".to_string(), "j/a/seg2".to_string()])
            .unwrap();
        assert_eq!(
            s.list("j").unwrap(),
            ["j/a-b", "j/b"],
            "an empty folder is gone"
        );
    }

    #[test]
    fn create_if_absent_creates_once() {
        let s = MemStore::new();
        s.create_if_absent("m/x", b"1").unwrap();
        let e = s.create_if_absent("m/x", b"2").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(s.get("m/x").unwrap().unwrap(), b"1");
        assert_eq!(s.swap_version("m/v", 0, b"a").unwrap(), 1);
        assert_eq!(
            s.swap_version("m/v", 0, b"b").unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
    }

    #[test]
    fn ranged_gets_cut_at_the_end() {
        let s = MemStore::objects_only();
        s.put("d/x", b"0123456789").unwrap();
        assert_eq!(s.get_range("d/x", 2, 3).unwrap().unwrap(), b"234");
        assert_eq!(s.get_range("d/x", 8, 10).unwrap().unwrap(), b"89");
        assert_eq!(s.get_range("d/x", 20, 1).unwrap().unwrap(), b"");
        assert_eq!(s.get_range("d/none", 0, 1).unwrap(), None);
        // The trait's default (whole object, then cut) answers the same.
        let local = tempfile::tempdir().unwrap();
        let l = crate::LocalStore::open(local.path()).unwrap();
        l.put("d/x", b"0123456789").unwrap();
        assert_eq!(l.get_range("d/x", 2, 3).unwrap().unwrap(), b"234");
        assert_eq!(l.get_range("d/x", 8, u64::MAX).unwrap().unwrap(), b"89");
        assert_eq!(l.get_range("d/x", u64::MAX, 1).unwrap().unwrap(), b"");
        assert_eq!(l.get_range("d/none", 0, 1).unwrap(), None);
    }

    #[test]
    fn objects_behave_like_files() {
        let s = MemStore::new();
        s.put("journal/a", b"abc").unwrap();
        s.put("journal/sub/b", b"x").unwrap();
        assert_eq!(s.list("journal").unwrap(), ["journal/a", "journal/sub"]);
        let o = s.open("journal/a", false).unwrap();
        o.write_at(b"Z", 5).unwrap();
        assert_eq!(s.get("journal/a").unwrap().unwrap(), b"abc\0\0Z");
        let mut buf = [0u8; 4];
        assert_eq!(o.read_at(&mut buf, 4).unwrap(), 2);
        assert_eq!(o.read_at(&mut buf, u64::MAX).unwrap(), 0);
        assert!(o.write_at(b"x", u64::MAX).is_err());
        o.set_len(1).unwrap();
        assert_eq!(o.len().unwrap(), 1);
        let copy = s.deep_clone();
        s.delete("journal/a").unwrap();
        assert!(s.open("journal/a", false).is_err());
        assert!(copy.get("journal/a").unwrap().is_some());
    }

    #[test]
    fn a_power_loss_keeps_only_what_was_synced() {
        let s = MemStore::new();
        s.put("d/put", b"durable").unwrap();
        let o = s.open("d/obj", true).unwrap();
        o.write_at(b"synced", 0).unwrap();
        o.sync_data().unwrap();
        // The name is not durable until its folder is synced.
        assert_eq!(s.crash_image(MemLoss::Drop).get("d/obj").unwrap(), None);
        s.sync_dir("d").unwrap();
        o.write_at(b"lost", 0).unwrap();
        o.write_at(b"tail", 8192).unwrap();
        s.rename("d/put", "d/moved").unwrap();
        s.open("d/new", true).unwrap();
        assert_eq!(s.get("d/obj").unwrap().unwrap()[..4], *b"lost");
        let img = s.crash_image(MemLoss::Drop);
        assert_eq!(img.get("d/obj").unwrap().unwrap(), b"synced");
        assert_eq!(img.get("d/put").unwrap().unwrap(), b"durable");
        assert_eq!(img.get("d/moved").unwrap(), None);
        assert_eq!(img.get("d/new").unwrap(), None);
        // The running store is untouched by the image; the cut itself changes it.
        assert_eq!(s.get("d/obj").unwrap().unwrap()[..4], *b"lost");
        s.power_loss(MemLoss::Drop);
        assert_eq!(o.len().unwrap(), 6, "an open handle sees the cut");
        assert_eq!(s.get("d/obj").unwrap().unwrap(), b"synced");
        assert_eq!(s.list("d").unwrap(), vec!["d/obj", "d/put"]);
    }

    #[test]
    fn a_torn_loss_keeps_each_unsynced_block_or_not() {
        let s = MemStore::new();
        let o = s.open("t/x", true).unwrap();
        o.write_at(&vec![1u8; 8 * BLOCK], 0).unwrap();
        o.sync_data().unwrap();
        s.sync_dir("t").unwrap();
        o.write_at(&vec![2u8; 8 * BLOCK], 0).unwrap();
        let mut kinds = BTreeSet::new();
        for seed in 0..16 {
            let img = s.crash_image(MemLoss::Tear { seed });
            let data = img.get("t/x").unwrap().unwrap();
            assert_eq!(data.len(), 8 * BLOCK);
            for block in data.chunks(BLOCK) {
                assert!(block.iter().all(|&b| b == block[0]), "torn inside a block");
                kinds.insert(block[0]);
            }
            assert_eq!(
                img.get("t/x").unwrap(),
                s.crash_image(MemLoss::Tear { seed }).get("t/x").unwrap(),
                "a seed repeats"
            );
        }
        assert_eq!(kinds, BTreeSet::from([1, 2]), "blocks of both ages survive");
    }

    /// Every object of `s`, as it reads and as a power cut would leave it.
    fn both_views(s: &MemStore) -> (BTreeMap<String, Vec<u8>>, BTreeMap<String, Vec<u8>>) {
        (s.objects(), s.crash_image(MemLoss::Drop).objects())
    }

    /// A store with synced, unsynced and unnamed bytes, and a handle open on it.
    fn store_with_history() -> (MemStore, Arc<dyn Object>) {
        let s = MemStore::new();
        s.put("d/put", b"durable").unwrap();
        let o = s.open("d/obj", true).unwrap();
        o.write_at(&vec![1u8; 3 * BLOCK], 0).unwrap();
        o.sync_data().unwrap();
        s.sync_dir("d").unwrap();
        o.write_at(&[2u8; 10], BLOCK as u64 - 5).unwrap();
        s.open("d/unnamed", true)
            .unwrap()
            .write_at(b"never synced", 0)
            .unwrap();
        (s, o)
    }

    #[test]
    fn writes_to_the_store_never_show_in_its_images() {
        let (s, o) = store_with_history();
        let images = [
            s.deep_clone(),
            s.crash_image(MemLoss::Drop),
            s.crash_image(MemLoss::Tear { seed: 3 }),
        ];
        let before: Vec<_> = images.iter().map(both_views).collect();
        // Through the handle opened before the images, and through the names.
        o.write_at(&[3u8; 2 * BLOCK], 1).unwrap();
        o.write_at(b"grown", 5 * BLOCK as u64).unwrap();
        o.sync_data().unwrap();
        o.set_len(BLOCK as u64 + 1).unwrap();
        s.put("d/put", b"replaced").unwrap();
        s.rename("d/unnamed", "d/renamed").unwrap();
        s.sync_dir("d").unwrap();
        s.open("d/obj", false)
            .unwrap()
            .write_at(b"again", 7)
            .unwrap();
        s.power_loss(MemLoss::Tear { seed: 9 });
        for (img, was) in images.iter().zip(&before) {
            assert_eq!(both_views(img), *was);
        }
    }

    #[test]
    fn writes_to_an_image_never_show_in_the_store() {
        let (s, o) = store_with_history();
        let before = both_views(&s);
        for img in [
            s.deep_clone(),
            s.crash_image(MemLoss::Drop),
            s.crash_image(MemLoss::Tear { seed: 5 }),
        ] {
            let io = img.open("d/obj", false).unwrap();
            io.write_at(&[4u8; 2 * BLOCK], 3).unwrap();
            io.sync_data().unwrap();
            io.set_len(2).unwrap();
            img.put("d/put", b"other").unwrap();
            img.delete("d/unnamed").unwrap();
            img.open("d/new", true).unwrap().write_at(b"n", 0).unwrap();
            img.sync_dir("d").unwrap();
            img.power_loss(MemLoss::Drop);
            assert_eq!(both_views(&s), before);
        }
        // The store's own handle still writes to the store.
        o.write_at(b"mine", 0).unwrap();
        assert_eq!(s.get("d/obj").unwrap().unwrap()[..4], *b"mine");
    }

    #[test]
    fn an_image_keeps_exactly_what_was_synced() {
        let (s, o) = store_with_history();
        let img = s.crash_image(MemLoss::Drop);
        assert_eq!(img.get("d/obj").unwrap().unwrap(), vec![1u8; 3 * BLOCK]);
        assert_eq!(img.get("d/unnamed").unwrap(), None);
        // A torn image keeps each of the two unsynced blocks whole or not at all.
        let mut seen = BTreeSet::new();
        for seed in 0..32 {
            let torn = s.crash_image(MemLoss::Tear { seed });
            let data = torn.get("d/obj").unwrap().unwrap();
            let first = data[BLOCK - 5..BLOCK] == [2u8; 5];
            let second = data[BLOCK..BLOCK + 5] == [2u8; 5];
            assert!(first || data[..BLOCK] == [1u8; BLOCK][..]);
            assert!(second || data[BLOCK..] == [1u8; 2 * BLOCK][..]);
            seen.insert((first, second));
        }
        assert_eq!(seen.len(), 4, "every combination of the two blocks");
        // Synced later, the bytes are in the next image.
        o.sync_data().unwrap();
        let data = s.crash_image(MemLoss::Drop).get("d/obj").unwrap().unwrap();
        assert_eq!(data[BLOCK - 5..BLOCK + 5], [2u8; 10]);
    }

    #[test]
    fn an_objects_only_store_refuses_positioned_io() {
        let s = MemStore::objects_only();
        assert!(!s.positioned_io());
        s.put("a/x", b"1").unwrap();
        for e in [
            s.open("a/x", false).err(),
            s.open_direct("a/x", false).err(),
            s.open_sync_direct("a/x").err(),
            s.rename("a/x", "a/y").err(),
        ] {
            assert_eq!(e.unwrap().kind(), io::ErrorKind::Unsupported);
        }
        assert!(!s.deep_clone().positioned_io());
        assert_eq!(
            s.get_many(&["a/x".into(), "a/none".into()]).unwrap(),
            vec![Some(b"1".to_vec()), None]
        );
        s.delete_many(&["a/x".into(), "a/none".into()]).unwrap();
        assert!(s.list("a").unwrap().is_empty());
    }
}

//! An object store in memory, for tests and fuzz targets: recovery and checkpoint loading
//! run over damaged objects thousands of times without touching a disk. Not durable.

use crate::{Capacity, Object, ObjectStore};
use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

type Objects = Arc<Mutex<BTreeMap<String, Vec<u8>>>>;

/// Objects in a map; clones share the same objects.
#[derive(Clone, Default, Debug)]
pub struct MemStore {
    objects: Objects,
    /// Refuse positioned I/O, as a store on S3 does (see [`MemStore::objects_only`]).
    objects_only: bool,
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

    /// An independent copy of every object.
    pub fn deep_clone(&self) -> MemStore {
        MemStore {
            objects: Arc::new(Mutex::new(lock(&self.objects).clone())),
            objects_only: self.objects_only,
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

    /// Every object, by name.
    pub fn objects(&self) -> BTreeMap<String, Vec<u8>> {
        lock(&self.objects).clone()
    }
}

struct MemObject {
    objects: Objects,
    name: String,
}

fn lock(o: &Objects) -> MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
    o.lock().unwrap_or_else(|p| p.into_inner())
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

impl Object for MemObject {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let objs = lock(&self.objects);
        let data = objs.get(&self.name).ok_or_else(|| missing(&self.name))?;
        let start = usize::try_from(offset).map_or(data.len(), |o| o.min(data.len()));
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }

    fn write_at(&self, d: &[u8], offset: u64) -> io::Result<()> {
        let end = offset.saturating_add(d.len() as u64);
        if end > MAX_OBJECT_BYTES {
            return Err(too_large(end));
        }
        let (offset, end) = (offset as usize, end as usize);
        let mut objs = lock(&self.objects);
        let data = objs
            .get_mut(&self.name)
            .ok_or_else(|| missing(&self.name))?;
        if data.len() < end {
            data.resize(end, 0);
        }
        data[offset..end].copy_from_slice(d);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let objs = lock(&self.objects);
        Ok(objs
            .get(&self.name)
            .ok_or_else(|| missing(&self.name))?
            .len() as u64)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if len > MAX_OBJECT_BYTES {
            return Err(too_large(len));
        }
        let mut objs = lock(&self.objects);
        let data = objs
            .get_mut(&self.name)
            .ok_or_else(|| missing(&self.name))?;
        data.resize(len as usize, 0);
        Ok(())
    }
}

impl ObjectStore for MemStore {
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        lock(&self.objects).insert(name.to_string(), data.to_vec());
        Ok(())
    }

    fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        Ok(lock(&self.objects).get(name).cloned())
    }

    fn delete(&self, name: &str) -> io::Result<()> {
        lock(&self.objects).remove(name);
        Ok(())
    }

    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        let dir = format!("{prefix}/");
        Ok(lock(&self.objects)
            .keys()
            .filter(|k| k.strip_prefix(&dir).is_some_and(|rest| !rest.contains('/')))
            .cloned()
            .collect())
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.positioned(from)?;
        let mut objs = lock(&self.objects);
        let data = objs.remove(from).ok_or_else(|| missing(from))?;
        objs.insert(to.to_string(), data);
        Ok(())
    }

    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn Object>> {
        self.positioned(name)?;
        let mut objs = lock(&self.objects);
        if !objs.contains_key(name) {
            if !create {
                return Err(missing(name));
            }
            objs.insert(name.to_string(), Vec::new());
        }
        Ok(Arc::new(MemObject {
            objects: self.objects.clone(),
            name: name.to_string(),
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

    fn sync_dir(&self, _prefix: &str) -> io::Result<()> {
        Ok(())
    }

    /// Atomic under the map's lock, as the trait requires.
    fn create_if_absent(&self, name: &str, data: &[u8]) -> io::Result<()> {
        match lock(&self.objects).entry(name.to_string()) {
            std::collections::btree_map::Entry::Occupied(_) => Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("object {name} exists"),
            )),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(data.to_vec());
                Ok(())
            }
        }
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
    fn objects_behave_like_files() {
        let s = MemStore::new();
        s.put("journal/a", b"abc").unwrap();
        s.put("journal/sub/b", b"x").unwrap();
        assert_eq!(s.list("journal").unwrap(), vec!["journal/a".to_string()]);
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

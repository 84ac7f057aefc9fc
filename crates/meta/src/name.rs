//! A directory-entry name stored compactly: names of up to 22 bytes (nearly all of them)
//! live inline in 24 bytes, longer ones on the heap. Memory per entry matters: a server
//! holds millions of them.

use kochab_proto::{FsResult, NAME_MAX, fs_err};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

const INLINE_MAX: usize = 22;

/// The bytes of one name component (1..=255 bytes, no '/' or NUL once validated).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Name(Repr);

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Repr {
    Inline { len: u8, bytes: [u8; INLINE_MAX] },
    Heap(Box<[u8]>),
}

impl Name {
    /// Copies `b` into a name. Does not validate; see [`validate_name`].
    pub fn new(b: &[u8]) -> Name {
        if b.len() <= INLINE_MAX {
            let mut bytes = [0u8; INLINE_MAX];
            bytes[..b.len()].copy_from_slice(b);
            Name(Repr::Inline {
                len: b.len() as u8,
                bytes,
            })
        } else {
            Name(Repr::Heap(b.into()))
        }
    }

    /// The name's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => &bytes[..*len as usize],
            Repr::Heap(b) => b,
        }
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(self.as_bytes()))
    }
}

impl Serialize for Name {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.as_bytes())
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Name, D::Error> {
        let b: &[u8] = serde_bytes::deserialize(d)?;
        Ok(Name::new(b))
    }
}

/// True for "." and "..", which name no entry of their own.
pub fn is_dot_or_dotdot(name: &[u8]) -> bool {
    name == b"." || name == b".."
}

/// Checks a name component from an untrusted client: 1..=255 bytes, no '/' and no NUL.
pub fn validate_name(name: &[u8]) -> FsResult<()> {
    if name.is_empty() {
        return Err(fs_err!(ENOENT, "empty file name"));
    }
    if name.len() > NAME_MAX {
        return Err(fs_err!(
            ENAMETOOLONG,
            "name of {} bytes exceeds {NAME_MAX}",
            name.len()
        ));
    }
    if name.iter().any(|&c| c == b'/' || c == 0) {
        return Err(fs_err!(
            EINVAL,
            "name {:?} contains '/' or NUL",
            String::from_utf8_lossy(name)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_names_round_trip() {
        for len in [1usize, 5, 22, 23, 255] {
            let raw: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            let n = Name::new(&raw);
            assert_eq!(n.as_bytes(), &raw[..]);
            let enc = postcard::to_allocvec(&n).unwrap();
            let back: Name = postcard::from_bytes(&enc).unwrap();
            assert_eq!(back, n);
        }
        assert_eq!(std::mem::size_of::<Name>(), 24);
    }

    #[test]
    fn validation() {
        assert!(validate_name(b"ok").is_ok());
        assert_eq!(
            validate_name(b"").unwrap_err().errno,
            kochab_proto::Errno::ENOENT
        );
        assert_eq!(
            validate_name(&[b'x'; 256]).unwrap_err().errno,
            kochab_proto::Errno::ENAMETOOLONG
        );
        assert!(validate_name(&[b'x'; 255]).is_ok());
        assert_eq!(
            validate_name(b"a/b").unwrap_err().errno,
            kochab_proto::Errno::EINVAL
        );
        assert_eq!(
            validate_name(b"a\0b").unwrap_err().errno,
            kochab_proto::Errno::EINVAL
        );
    }
}

//! The journal as immutable objects, for a store without positioned I/O (S3).
//!
//! Each group commit becomes one object (a few if it is large) of journal `id`:
//! `journal/<server>.<epoch>/<seq, 20 digits>.jo`, seq 1, 2, 3, ... in the order the writer
//! cut them. An object is a checksummed header (its seq, first LSN, record count, body
//! length, the journal's epoch) followed by records framed as in segments. Objects are
//! written by conditional create (`If-None-Match: *`), several at a time, and acknowledged
//! in seq order (see `uploads`): a record is durable once the PUT holding it, and every
//! earlier one, returned.
//!
//! **The chain.** From the journal's start (the newest start marker
//! `journal/<server>.<epoch>/start.<seq, 20 digits>`, or seq 1 without one), every next seq
//! up to the first that is missing or is a fence object. A reader stops there: the writer
//! acknowledges in seq order, so nothing acknowledged lies past a gap. Trimming writes a
//! start marker first and only then deletes the objects below it, in any order and
//! concurrently; so a hole in a listing below the newest marker is a trimmed object, and
//! one at or above it is a PUT that never completed. (The marker is listed after the
//! objects, so a hole seen in the listing of objects was made after a marker that the
//! second listing sees.) The newest acknowledged object is never trimmed.
//!
//! **Fencing, with no round trip per commit.** Whoever takes over the incarnation lists its
//! objects and creates a fence object under the first missing seq of the chain: the very
//! name the writer would use next (SlateDB fences its writers the same way). The writer's
//! conditional PUT of that name fails, so it acknowledges nothing from there on, and every
//! record it acknowledged is in the chain below the fence, which can no longer change. If
//! the writer's PUT of that name wins the race, the create is refused and the fencer tries
//! the next gap.

use crate::segment::{JournalId, LSN_MAX};
use kochab_store::ObjectStore;
use std::io;

/// Bytes of an object's header.
pub const OBJECT_HEADER_BYTES: usize = 48;
const MAGIC: &[u8; 8] = b"KOCHABO1";
/// Header kinds.
const KIND_RECORDS: u32 = 1;
const KIND_FENCE: u32 = 2;
/// Largest body of one journal object: a group commit larger than this is cut into
/// several objects (whole records each), so that one PUT stays a few MiB, well inside what
/// an engine takes in a single request (never multipart: see `kochab-s3store`) and what a
/// slow link moves within the store's request timeout. A record is at most 4 MiB, so it
/// always fits.
pub const OBJECT_BODY_BYTES_MAX: usize = 8 << 20;
/// Names a fencer tries at once, from the chain's first gap on. A running writer always
/// has PUTs in flight for the next few names (at most `uploads::PUTS_IN_FLIGHT_MAX`), sent
/// before the fencer's and so mostly winning; trying them one after another the fencer
/// would never catch up with it (measured on RGW: 64 tries in a row lost). Of this many at
/// once, those past the writer's window win.
const FENCE_BURST: u64 = 16;
/// Bursts a fencer tries, listing again before each; more mean something is wrong.
const FENCE_TRIES_MAX: usize = 8;
/// Objects recovery fetches at once (concurrently, on a store over a network).
pub const READ_AHEAD: usize = 32;

/// The object of journal `id` with sequence number `seq`.
pub fn object_name(id: JournalId, seq: u64) -> String {
    format!("{}/{seq:020}.jo", id.dir())
}

/// The sequence number of a journal object's name, if it is one of journal `id`'s.
pub fn parse_object_name(id: JournalId, name: &str) -> Option<u64> {
    parse_numbered(id, name, "", ".jo")
}

/// The start marker saying that the chain of journal `id` starts at `seq` (objects below
/// it may be gone).
pub fn start_name(id: JournalId, seq: u64) -> String {
    format!("{}/start.{seq:020}", id.dir())
}

fn parse_start_name(id: JournalId, name: &str) -> Option<u64> {
    parse_numbered(id, name, "start.", "")
}

fn parse_numbered(id: JournalId, name: &str, before: &str, after: &str) -> Option<u64> {
    let file = name.strip_prefix(&id.dir())?.strip_prefix('/')?;
    let digits = file.strip_prefix(before)?.strip_suffix(after)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn header(kind: u32, seq: u64, epoch: u64, first_lsn: u64, records: u32, body: u64) -> [u8; 48] {
    let mut h = [0u8; OBJECT_HEADER_BYTES];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&kind.to_le_bytes());
    h[12..16].copy_from_slice(&records.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    h[24..32].copy_from_slice(&first_lsn.to_le_bytes());
    h[32..40].copy_from_slice(&body.to_le_bytes());
    h[40..48].copy_from_slice(&epoch.to_le_bytes());
    h
}

/// Appends journal object `seq` of an incarnation at `epoch` to `out`: a header whose
/// checksum covers the header and `body` (whole records, `records` of them, the first with
/// LSN `first_lsn`), then `body`.
pub fn encode_records(
    out: &mut Vec<u8>,
    seq: u64,
    epoch: u64,
    first_lsn: u64,
    records: u32,
    body: &[u8],
) {
    let h = header(
        KIND_RECORDS,
        seq,
        epoch,
        first_lsn,
        records,
        body.len() as u64,
    );
    out.extend_from_slice(&h);
    out.extend_from_slice(&crc(&h, body).to_le_bytes());
    out.extend_from_slice(body);
}

/// The fence object at `seq` of an incarnation at `epoch`.
pub fn fence_bytes(seq: u64, epoch: u64) -> Vec<u8> {
    let h = header(KIND_FENCE, seq, epoch, 0, 0, 0);
    let mut out = h.to_vec();
    out.extend_from_slice(&crc(&h, &[]).to_le_bytes());
    out
}

fn crc(h: &[u8; OBJECT_HEADER_BYTES], body: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(h), body)
}

/// Bytes before an object's body: the header and its checksum.
const PREAMBLE_BYTES: usize = OBJECT_HEADER_BYTES + 4;

/// What a journal object holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Content<'a> {
    Records {
        first_lsn: u64,
        records: u32,
        /// The records, framed as in segments.
        body: &'a [u8],
    },
    /// Written by a fencer: the chain ends before it.
    Fence,
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Reads object `seq` of a journal at `epoch`. Objects are written whole, so anything that
/// does not check out is damage, never a torn write.
pub fn decode(seq: u64, epoch: u64, data: &[u8]) -> Result<Content<'_>, String> {
    if data.len() < PREAMBLE_BYTES {
        return Err(format!(
            "{} bytes, shorter than an object header",
            data.len()
        ));
    }
    let (h, rest) = data.split_at(OBJECT_HEADER_BYTES);
    let (stored, body) = rest.split_at(4);
    if &h[..8] != MAGIC {
        return Err("bad magic".into());
    }
    let mut hh = [0u8; OBJECT_HEADER_BYTES];
    hh.copy_from_slice(h);
    if crc(&hh, body) != le_u32(stored) {
        return Err("checksum mismatch".into());
    }
    let (kind, records) = (le_u32(&h[8..]), le_u32(&h[12..]));
    let (own_seq, first_lsn, body_bytes, own_epoch) = (
        le_u64(&h[16..]),
        le_u64(&h[24..]),
        le_u64(&h[32..]),
        le_u64(&h[40..]),
    );
    if own_seq != seq {
        return Err(format!("its header says it is object {own_seq}"));
    }
    if own_epoch != epoch {
        return Err(format!(
            "it carries epoch {own_epoch}, not the journal's {epoch}"
        ));
    }
    if body_bytes != body.len() as u64 {
        return Err(format!(
            "its header says {body_bytes} bytes of records, it holds {}",
            body.len()
        ));
    }
    match kind {
        KIND_FENCE => Ok(Content::Fence),
        KIND_RECORDS if records == 0 => Err("a journal object without records".into()),
        KIND_RECORDS if !(1..=LSN_MAX).contains(&first_lsn) => {
            Err(format!("first LSN {first_lsn} out of range"))
        }
        KIND_RECORDS => Ok(Content::Records {
            first_lsn,
            records,
            body,
        }),
        k => Err(format!("unknown object kind {k}")),
    }
}

/// A journal's objects and start markers as listed.
#[derive(Debug, Default, Clone)]
pub struct Listing {
    /// Journal objects, by seq.
    pub objects: Vec<(u64, String)>,
    /// Start markers, by seq (listed after the objects).
    pub starts: Vec<(u64, String)>,
}

impl Listing {
    /// Lists journal `id`: its objects, then (a second listing, see the module) its start
    /// markers.
    pub fn read(store: &dyn ObjectStore, id: JournalId) -> io::Result<Listing> {
        let mut objects: Vec<(u64, String)> = store
            .list(&id.dir())?
            .into_iter()
            .filter_map(|n| parse_object_name(id, &n).map(|s| (s, n)))
            .collect();
        objects.sort();
        let mut starts: Vec<(u64, String)> = store
            .list(&id.dir())?
            .into_iter()
            .filter_map(|n| parse_start_name(id, &n).map(|s| (s, n)))
            .collect();
        starts.sort();
        Ok(Listing { objects, starts })
    }

    /// The seq the chain starts at.
    pub fn start(&self) -> u64 {
        self.starts.last().map_or(1, |(s, _)| *s)
    }

    /// The objects of the chain as listed: from the start, each next seq while present
    /// (a fence among them ends the chain where it is read).
    pub fn chain(&self) -> &[(u64, String)] {
        let start = self.start();
        let from = self.objects.partition_point(|(s, _)| *s < start);
        let run = self.objects[from..]
            .iter()
            .zip(start..)
            .take_while(|((s, _), want)| s == want)
            .count();
        &self.objects[from..from + run]
    }

    /// The first seq of the chain that is missing: where a fence goes.
    pub fn first_gap(&self) -> u64 {
        self.start() + self.chain().len() as u64
    }

    /// Objects past the first gap (never acknowledged: junk of a writer that was fenced or
    /// crashed with PUTs in flight).
    pub fn beyond(&self) -> &[(u64, String)] {
        let gap = self.first_gap();
        &self.objects[self.objects.partition_point(|(s, _)| *s <= gap)..]
    }
}

/// Fences journal `id`: creates a fence object under the first missing seq of its chain, so
/// that its writer acknowledges nothing more and its chain can no longer grow. Returns that
/// seq.
pub fn fence(store: &dyn ObjectStore, id: JournalId) -> io::Result<u64> {
    for _ in 0..FENCE_TRIES_MAX {
        let gap = Listing::read(store, id)?.first_gap();
        let results: Vec<io::Result<()>> = std::thread::scope(|s| {
            let tries: Vec<_> = (gap..gap + FENCE_BURST)
                .map(|q| {
                    s.spawn(move || {
                        store.create_if_absent(&object_name(id, q), &fence_bytes(q, id.epoch))
                    })
                })
                .collect();
            tries
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err(io::Error::other("a fencing thread panicked")))
                })
                .collect()
        });
        // The chain now ends at the lowest fence that won, if every name before it exists
        // (the writer's objects, or another fencer's fence). A name whose create failed
        // otherwise may still be empty, so the writer could fill it and go on: no fence
        // counts past it.
        let mut fenced = None;
        let mut extra = Vec::new();
        for (q, r) in (gap..).zip(results) {
            match (fenced, r) {
                (None, Ok(())) => fenced = Some(q),
                (None, Err(e)) if e.kind() == io::ErrorKind::AlreadyExists => {}
                (None, Err(e)) => return Err(e),
                // Past the end for good: no need to keep them.
                (Some(_), Ok(())) => extra.push(object_name(id, q)),
                (Some(_), Err(_)) => {}
            }
        }
        let Some(q) = fenced else { continue };
        // A name is also free if the writer filled it and trimmed it since the listing (its
        // PUT completed, then a checkpoint let it go): then a start marker past it was
        // written before, and the fence lies below the chain, where it stops nothing. Look
        // again (the fences of this burst stay: past the new start they do count).
        if Listing::read(store, id)?.start() > q {
            continue;
        }
        store.delete_many(&extra)?;
        return Ok(q);
    }
    Err(io::Error::other(format!(
        "cannot fence {id}: its writer kept ahead of {FENCE_TRIES_MAX} bursts of \
         {FENCE_BURST} fences"
    )))
}

/// The LSN of the record at the start of `rec` (a whole record the journal encoded).
pub(crate) fn record_lsn(rec: &[u8]) -> u64 {
    le_u64(&rec[8..16])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::encode_record;
    use kochab_store::MemStore;

    const ID: JournalId = JournalId {
        server: 3,
        epoch: 9,
    };

    #[test]
    fn names_and_objects_round_trip_and_damage_is_caught() {
        assert_eq!(object_name(ID, 7), "journal/3.9/00000000000000000007.jo");
        assert_eq!(parse_object_name(ID, &object_name(ID, 7)), Some(7));
        assert_eq!(parse_object_name(ID, &start_name(ID, 7)), None);
        assert_eq!(parse_start_name(ID, &start_name(ID, 7)), Some(7));
        assert_eq!(parse_object_name(ID, &ID.seal_name()), None);
        let mut body = Vec::new();
        encode_record(&mut body, 5, 9, b"one").unwrap();
        encode_record(&mut body, 6, 9, b"two").unwrap();
        let mut obj = Vec::new();
        encode_records(&mut obj, 7, 9, 5, 2, &body);
        assert_eq!(
            decode(7, 9, &obj),
            Ok(Content::Records {
                first_lsn: 5,
                records: 2,
                body: &body
            })
        );
        assert_eq!(record_lsn(&body), 5);
        assert!(decode(8, 9, &obj).is_err(), "another seq");
        assert!(decode(7, 10, &obj).is_err(), "another epoch");
        assert!(decode(7, 9, &obj[..obj.len() - 1]).is_err(), "short");
        for bit in 0..obj.len() * 8 {
            let mut bad = obj.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(7, 9, &bad).is_err(), "bit {bit}");
        }
        assert_eq!(decode(4, 9, &fence_bytes(4, 9)), Ok(Content::Fence));
        assert!(decode(4, 9, &fence_bytes(5, 9)).is_err());
    }

    /// A store that, at the first conditional create, first does what a running writer
    /// might between a fencer's listing and its creates: completes objects 4, 5 and 6,
    /// then trims below 6 (a start marker, then the deletions).
    struct TrimsMeanwhile {
        inner: MemStore,
        done: std::sync::Once,
    }

    impl ObjectStore for TrimsMeanwhile {
        fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
            self.inner.put(name, data)
        }
        fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
            self.inner.get(name)
        }
        fn delete(&self, name: &str) -> io::Result<()> {
            self.inner.delete(name)
        }
        fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
            self.inner.list(prefix)
        }
        fn rename(&self, from: &str, to: &str) -> io::Result<()> {
            self.inner.rename(from, to)
        }
        fn open(
            &self,
            name: &str,
            c: bool,
        ) -> io::Result<std::sync::Arc<dyn kochab_store::Object>> {
            self.inner.open(name, c)
        }
        fn open_sync_direct(
            &self,
            name: &str,
        ) -> io::Result<Option<std::sync::Arc<dyn kochab_store::Object>>> {
            self.inner.open_sync_direct(name)
        }
        fn open_direct(
            &self,
            name: &str,
            c: bool,
        ) -> io::Result<Option<std::sync::Arc<dyn kochab_store::Object>>> {
            self.inner.open_direct(name, c)
        }
        fn sync_dir(&self, prefix: &str) -> io::Result<()> {
            self.inner.sync_dir(prefix)
        }
        fn capacity(&self) -> io::Result<kochab_store::Capacity> {
            self.inner.capacity()
        }
        fn positioned_io(&self) -> bool {
            false
        }
        fn create_if_absent(&self, name: &str, data: &[u8]) -> io::Result<()> {
            self.done.call_once(|| {
                for seq in 4..=6 {
                    self.inner.put(&object_name(ID, seq), b"x").unwrap();
                }
                self.inner.put(&start_name(ID, 6), b"").unwrap();
                for seq in 1..6 {
                    self.inner.delete(&object_name(ID, seq)).unwrap();
                }
            });
            self.inner.create_if_absent(name, data)
        }
    }

    #[test]
    fn a_fence_in_a_name_the_writer_trimmed_meanwhile_does_not_count() {
        let s = TrimsMeanwhile {
            inner: MemStore::objects_only(),
            done: std::sync::Once::new(),
        };
        for seq in 1..=3 {
            s.put(&object_name(ID, seq), b"x").unwrap();
        }
        // The listing says 4; by the creates, 4 and 5 were written and trimmed, 6 is the
        // chain's start: the fence must end the chain at or after 7.
        let q = fence(&s, ID).unwrap();
        let l = Listing::read(&s, ID).unwrap();
        assert_eq!(l.start(), 6);
        let first_fence = (6..64)
            .find(|&q| {
                s.get(&object_name(ID, q))
                    .unwrap()
                    .is_some_and(|d| decode(q, ID.epoch, &d) == Ok(Content::Fence))
            })
            .unwrap();
        assert_eq!(
            first_fence, 7,
            "the chain ends right after the writer's last object"
        );
        assert!(q >= 7, "{q}");
        let e = s
            .create_if_absent(&object_name(ID, 7), b"late")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
    }

    #[test]
    fn the_chain_starts_at_the_newest_marker_and_stops_at_the_first_gap() {
        let s = MemStore::objects_only();
        let l = Listing::read(&s, ID).unwrap();
        assert_eq!((l.start(), l.chain().len(), l.first_gap()), (1, 0, 1));
        for seq in [1, 2, 3, 5, 6] {
            s.put(&object_name(ID, seq), b"x").unwrap();
        }
        let l = Listing::read(&s, ID).unwrap();
        assert_eq!(l.chain().len(), 3);
        assert_eq!(l.first_gap(), 4);
        assert_eq!(
            l.beyond().iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            [5, 6]
        );
        // Trimmed below 3, in any order: a hole below the marker is no gap.
        s.put(&start_name(ID, 3), b"").unwrap();
        s.delete(&object_name(ID, 2)).unwrap();
        let l = Listing::read(&s, ID).unwrap();
        assert_eq!((l.start(), l.chain().len(), l.first_gap()), (3, 1, 4));
        // A fence goes into the first gap; then the writer's PUT of that name is refused.
        assert_eq!(fence(&s, ID).unwrap(), 4);
        let e = s
            .create_if_absent(&object_name(ID, 4), b"late")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        // A journal with no object yet is fenced at seq 1.
        let other = JournalId {
            server: 3,
            epoch: 10,
        };
        assert_eq!(fence(&s, other).unwrap(), 1);
    }
}

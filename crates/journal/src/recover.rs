//! Recovery: read the segments in LSN order, hand every record after the checkpoints to the
//! caller, and cut a torn tail (report it, zero it out, never replay it). A journal as
//! objects (a store without positioned I/O) is read along its chain (see `objects`); its
//! objects are written whole, so it has no torn tail: any damage in the chain is refused.
//!
//! A torn tail is the one kind of damage a crash makes: the last write of the last segment
//! in use, cut short, which nothing was acknowledged from. Everything else that breaks the
//! chain of records (a corrupt record with more records after it, a segment shorter than it
//! was created, an LSN gap) may have eaten acknowledged operations, so recovery refuses.
//! [`inspect`] says where such damage is and what follows it, without changing anything;
//! [`repair_accept_loss`] drops it, for an operator who accepts the loss.

use crate::objects::{self, Content, Listing, READ_AHEAD};
use crate::record::{Scan, scan};
use crate::segment::{self, BLOCK, Header, JournalId, SEGMENT_DATA_START, decode_header};
use kochab_store::ObjectStore;
use std::fmt;

/// A tail that was cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    pub segment: String,
    pub offset: u64,
    pub bytes: u64,
    pub reason: String,
}

/// What recovery found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// LSN of the last valid record (0 if the journal is empty).
    pub last_lsn: u64,
    /// Records handed to the caller (those after `replay_after`).
    pub replayed: u64,
    /// Valid records skipped because checkpoints already hold them.
    pub skipped: u64,
    pub segments: u64,
    pub cut: Option<Cut>,
}

/// Why the caller refused a record it was given to replay (its own error type, boxed).
pub type ReplayRefused = Box<dyn std::error::Error + Send + Sync>;

/// Recovery could not produce a consistent state.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error("journal I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// Records the checkpoints need are gone or damaged before the tail.
    #[error("journal damaged: {0}")]
    Damaged(String),
    /// The caller refused a record.
    #[error("cannot replay journal record {lsn}: {error}")]
    Apply { lsn: u64, error: ReplayRefused },
}

/// Where the journal stops being one valid chain of records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    pub segment: String,
    /// Offset in `segment` where its valid records end.
    pub offset: u64,
    pub reason: String,
    /// A record or header torn by a crash during its write, at the very end of the journal:
    /// nothing after it was acknowledged, so recovery cuts it by itself.
    pub torn_tail: bool,
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} at offset {}: {}",
            self.segment, self.offset, self.reason
        )
    }
}

/// One segment as found in the store, before its records are read.
struct Facts {
    name: String,
    name_lsn: u64,
    len: u64,
    header: Header,
    /// The header block is zeros and so is everything after it: never used.
    unused: bool,
}

fn gather(store: &dyn ObjectStore, id: JournalId) -> std::io::Result<Vec<Facts>> {
    let mut out = Vec::new();
    for (name_lsn, name) in segment::list_segments(store, id)? {
        let obj = store.open(&name, false)?;
        let len = obj.len()?;
        let mut head = vec![0u8; BLOCK.min(len as usize)];
        let n = obj.read_at(&mut head, 0)?;
        head.truncate(n);
        let header = decode_header(&head);
        // A zero header whose segment holds records after it is damage, not an unused
        // segment; reading it whole is rare (a crash between rename and header write).
        let unused = len >= SEGMENT_DATA_START
            && header == Header::Empty
            && store.get(&name)?.is_some_and(|d| d.iter().all(|&b| b == 0));
        out.push(Facts {
            name,
            name_lsn,
            len,
            header,
            unused,
        });
    }
    Ok(out)
}

/// The valid chain of records and where it ends.
struct Walked {
    report: RecoveryReport,
    /// First LSN of the first segment in use.
    first_lsn: Option<u64>,
    /// The LSN the chain's next record would have.
    next_lsn: Option<u64>,
    damage: Option<Damage>,
}

/// What recovery hands each record to: `(lsn, payload)`, or why the record is refused.
type Apply<'a> = dyn FnMut(u64, &[u8]) -> Result<(), ReplayRefused> + 'a;

impl Walked {
    fn new(segments: u64) -> Walked {
        Walked {
            report: RecoveryReport {
                segments,
                ..Default::default()
            },
            first_lsn: None,
            next_lsn: None,
            damage: None,
        }
    }

    /// Counts valid record `l` of the chain and hands it to `apply` if it is past
    /// `replay_after`. The chain is gap-free, so only its first handed-out record can miss
    /// the checkpoints' end; one that does (what came before it is gone) is never handed
    /// out, nor anything after it.
    fn take(
        &mut self,
        l: u64,
        payload: &[u8],
        replay_after: u64,
        apply: &mut Apply<'_>,
    ) -> Result<(), RecoveryError> {
        if l > replay_after {
            if self.report.replayed == 0 && l != replay_after + 1 {
                return Err(gap_error(l, replay_after));
            }
            apply(l, payload).map_err(|error| RecoveryError::Apply { lsn: l, error })?;
            self.report.replayed += 1;
        } else {
            self.report.skipped += 1;
        }
        self.report.last_lsn = l;
        Ok(())
    }
}

/// [`walk`] for a journal as objects: along its chain, from its start to the first missing
/// object or fence.
fn walk_objects(
    store: &dyn ObjectStore,
    id: JournalId,
    replay_after: u64,
    until: Option<u64>,
    apply: &mut Apply<'_>,
) -> Result<Walked, RecoveryError> {
    let listing = Listing::read(store, id)?;
    let chain = listing.chain();
    let mut w = Walked::new(chain.len() as u64);
    let past_until = |lsn: u64| until.is_some_and(|u| lsn > u);
    'chain: for window in chain.chunks(READ_AHEAD) {
        if w.next_lsn.is_some_and(past_until) {
            break;
        }
        let names: Vec<String> = window.iter().map(|(_, n)| n.clone()).collect();
        for ((seq, name), data) in window.iter().zip(store.get_many(&names)?) {
            let damage = |reason: String| Damage {
                segment: name.clone(),
                offset: 0,
                reason,
                torn_tail: false,
            };
            let Some(data) = data else {
                w.damage = Some(damage(
                    "listed in the chain, then gone when read (trimmed by a writer that                      still runs?)"
                        .into(),
                ));
                break 'chain;
            };
            let (first, count, body) = match objects::decode(*seq, id.epoch, &data) {
                Ok(Content::Records {
                    first_lsn,
                    records,
                    body,
                }) => (first_lsn, records, body),
                // The chain ends before a fence.
                Ok(Content::Fence) => break 'chain,
                Err(why) => {
                    w.damage = Some(damage(why));
                    break 'chain;
                }
            };
            if let Some(e) = w.next_lsn
                && e != first
            {
                w.damage = Some(damage(format!("it starts at LSN {first}, expected {e}")));
                break 'chain;
            }
            w.first_lsn.get_or_insert(first);
            let (mut lsn, mut off) = (first, 0usize);
            for _ in 0..count {
                if past_until(lsn) {
                    w.next_lsn = Some(lsn);
                    break 'chain;
                }
                match scan(&body[off..], lsn) {
                    Scan::Record {
                        lsn: l,
                        epoch,
                        payload,
                        len,
                    } if epoch == id.epoch => {
                        w.take(l, payload, replay_after, apply)?;
                        lsn += 1;
                        off += len;
                    }
                    Scan::Record { epoch, .. } => {
                        w.damage = Some(Damage {
                            offset: (objects::OBJECT_HEADER_BYTES + 4 + off) as u64,
                            ..damage(format!(
                                "record {lsn} carries epoch {epoch}, not the journal's {}",
                                id.epoch
                            ))
                        });
                        break 'chain;
                    }
                    other => {
                        w.damage = Some(Damage {
                            offset: (objects::OBJECT_HEADER_BYTES + 4 + off) as u64,
                            ..damage(format!("record {lsn}: {other:?}"))
                        });
                        break 'chain;
                    }
                }
            }
            w.next_lsn = Some(lsn);
            if off != body.len() {
                w.damage = Some(damage(format!(
                    "{} bytes after its {count} records",
                    body.len() - off
                )));
                break 'chain;
            }
        }
    }
    Ok(w)
}

/// Reads the segments in order and calls `apply` for every valid record above
/// `replay_after` (and up to `until`, where the walk stops), stopping at the first damage
/// (reported, never acted on here).
fn walk(
    store: &dyn ObjectStore,
    id: JournalId,
    replay_after: u64,
    until: Option<u64>,
    apply: &mut Apply<'_>,
) -> Result<Walked, RecoveryError> {
    if !store.positioned_io() {
        return walk_objects(store, id, replay_after, until, apply);
    }
    let facts = gather(store, id)?;
    let last_used = facts.iter().rposition(|f| !f.unused);
    let mut w = Walked::new(facts.len() as u64);
    for (idx, f) in facts.iter().enumerate() {
        if until.is_some_and(|u| w.next_lsn.is_some_and(|n| n > u)) {
            break;
        }
        let is_last = Some(idx) == last_used;
        let damage = |offset: u64, reason: String, torn_tail: bool| {
            Some(Damage {
                segment: f.name.clone(),
                offset,
                reason,
                torn_tail,
            })
        };
        if f.unused {
            continue;
        }
        if f.len < SEGMENT_DATA_START {
            w.damage = damage(
                0,
                format!(
                    "the segment is {} bytes, shorter than its header block: truncated",
                    f.len
                ),
                false,
            );
            break;
        }
        let (first, created_bytes) = match &f.header {
            Header::Valid {
                first_lsn,
                segment_bytes,
            } if *first_lsn == f.name_lsn => (*first_lsn, *segment_bytes),
            Header::Valid { first_lsn, .. } => {
                w.damage = damage(
                    0,
                    format!("its header says it starts at LSN {first_lsn}"),
                    false,
                );
                break;
            }
            Header::Empty => {
                w.damage = damage(0, "its header is zeros but records follow".into(), false);
                break;
            }
            Header::Corrupt(why) => {
                w.damage = damage(0, format!("header: {why}"), is_last);
                break;
            }
        };
        if let Some(e) = w.next_lsn
            && e != first
        {
            w.damage = damage(0, format!("it starts at LSN {first}, expected {e}"), false);
            break;
        }
        w.first_lsn.get_or_insert(first);
        let data = store.get(&f.name)?.unwrap_or_default();
        let mut lsn = first;
        let mut off = (SEGMENT_DATA_START as usize).min(data.len());
        let stopped = loop {
            if until.is_some_and(|u| lsn > u) {
                break None;
            }
            match scan(&data[off..], lsn) {
                Scan::Record { epoch, .. } if epoch != id.epoch => {
                    break Some(format!(
                        "record {lsn} carries epoch {epoch}, not the journal's {}",
                        id.epoch
                    ));
                }
                Scan::Record {
                    lsn: l,
                    payload,
                    len,
                    ..
                } => {
                    w.take(l, payload, replay_after, apply)?;
                    lsn += 1;
                    off += len;
                }
                Scan::End | Scan::Stale { .. } => break None,
                Scan::Corrupt { reason } => break Some(reason),
            }
        };
        w.next_lsn = Some(lsn);
        if let Some(created) = created_bytes
            && f.len < created
        {
            // Whatever the records up to here say, the bytes after the end are gone.
            w.damage = damage(
                off as u64,
                format!(
                    "the segment is {} bytes but was created with {created}: truncated, \
                     records after LSN {} may be lost",
                    f.len,
                    lsn - 1
                ),
                false,
            );
            break;
        }
        if let Some(reason) = stopped {
            w.damage = damage(off as u64, reason, is_last);
            break;
        }
    }
    Ok(w)
}

/// Reads the whole journal and calls `apply(lsn, payload)` for every record with an LSN
/// above `replay_after`, in order. A torn tail (see the module) is zeroed and reported in
/// `cut`. Any other damage, or a gap in the LSNs the caller needs, is an error (acknowledged
/// operations would be lost, so the server must not start silently); the records handed
/// out before such an error are a gap-free run from `replay_after + 1`, never one after it.
pub fn recover(
    store: &dyn ObjectStore,
    id: JournalId,
    replay_after: u64,
    apply: impl FnMut(u64, &[u8]) -> Result<(), ReplayRefused>,
) -> Result<RecoveryReport, RecoveryError> {
    recover_range(store, id, replay_after, None, apply)
}

/// [`recover`] of the records in `(replay_after, until]` only (all after `replay_after` if
/// `until` is `None`). A sealed journal is read with the end its first reader found, so
/// that a writer that kept writing after the seal (never acknowledged) changes nothing.
pub fn recover_range(
    store: &dyn ObjectStore,
    id: JournalId,
    replay_after: u64,
    until: Option<u64>,
    mut apply: impl FnMut(u64, &[u8]) -> Result<(), ReplayRefused>,
) -> Result<RecoveryReport, RecoveryError> {
    let w = walk(store, id, replay_after, until, &mut apply)?;
    if let Some(first) = w.first_lsn
        && first > replay_after + 1
    {
        return Err(gap_error(first, replay_after));
    }
    let mut report = w.report;
    match w.damage {
        Some(d) if d.torn_tail => cut_tail(store, &d, &mut report)?,
        Some(d) => return Err(RecoveryError::Damaged(d.to_string())),
        None => {}
    }
    if report.last_lsn == 0 && replay_after > 0 {
        // Everything is in checkpoints and the journal was trimmed to nothing: continue after them.
        report.last_lsn = replay_after;
    }
    if report.last_lsn < replay_after {
        return Err(RecoveryError::Damaged(format!(
            "journal ends at LSN {} but checkpoints cover up to {replay_after}",
            report.last_lsn
        )));
    }
    Ok(report)
}

/// The journal's records start at `first`, after a gap behind the checkpoints' end.
fn gap_error(first: u64, replay_after: u64) -> RecoveryError {
    RecoveryError::Damaged(format!(
        "oldest segment starts at LSN {first} but records after {replay_after} are needed"
    ))
}

/// Zeroes segment `d.segment` from `d.offset` to its end, durably, and records the cut.
fn cut_tail(
    store: &dyn ObjectStore,
    d: &Damage,
    report: &mut RecoveryReport,
) -> Result<(), RecoveryError> {
    let obj = store.open(&d.segment, false)?;
    let bytes = obj.len()?.saturating_sub(d.offset);
    tracing::warn!(
        "journal {}: cutting {bytes} bytes at offset {}: {}",
        d.segment,
        d.offset,
        d.reason
    );
    zero_from(obj.as_ref(), d.offset, bytes)?;
    report.cut = Some(Cut {
        segment: d.segment.clone(),
        offset: d.offset,
        bytes,
        reason: d.reason.clone(),
    });
    Ok(())
}

fn zero_from(obj: &dyn kochab_store::Object, offset: u64, bytes: u64) -> std::io::Result<()> {
    let zeros = vec![0u8; 1 << 20];
    let mut done = 0;
    while done < bytes {
        let n = (bytes - done).min(zeros.len() as u64) as usize;
        obj.write_at(&zeros[..n], offset + done)?;
        done += n as u64;
    }
    obj.sync_data()
}

/// One segment as a read-only pass sees it on its own (not as part of the chain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSummary {
    pub name: String,
    /// Length of the object.
    pub bytes: u64,
    /// Valid records from the segment's start, and the LSNs of the first and last.
    pub records: u64,
    pub lsns: Option<(u64, u64)>,
}

fn summarize(store: &dyn ObjectStore, name: &str) -> std::io::Result<SegmentSummary> {
    let data = store.get(name)?.unwrap_or_default();
    let mut s = SegmentSummary {
        name: name.to_string(),
        bytes: data.len() as u64,
        records: 0,
        lsns: None,
    };
    if let Header::Valid { first_lsn, .. } = decode_header(&data) {
        let mut off = (SEGMENT_DATA_START as usize).min(data.len());
        let mut lsn = first_lsn;
        while let Scan::Record { len, .. } = scan(&data[off..], lsn) {
            s.records += 1;
            s.lsns = Some((first_lsn, lsn));
            off += len;
            lsn += 1;
        }
    }
    Ok(s)
}

/// Every object of a journal as objects (a fence holds no records), each read on its own.
fn summarize_objects(
    store: &dyn ObjectStore,
    id: JournalId,
) -> std::io::Result<Vec<SegmentSummary>> {
    let listing = Listing::read(store, id)?;
    let mut out = Vec::new();
    for window in listing.objects.chunks(READ_AHEAD) {
        let names: Vec<String> = window.iter().map(|(_, n)| n.clone()).collect();
        for ((seq, name), data) in window.iter().zip(store.get_many(&names)?) {
            let data = data.unwrap_or_default();
            let mut s = SegmentSummary {
                name: name.clone(),
                bytes: data.len() as u64,
                records: 0,
                lsns: None,
            };
            if let Ok(Content::Records {
                first_lsn,
                records,
                body,
            }) = objects::decode(*seq, id.epoch, &data)
            {
                let (mut off, mut lsn) = (0, first_lsn);
                while s.records < records as u64
                    && let Scan::Record { len, .. } = scan(&body[off..], lsn)
                {
                    s.records += 1;
                    s.lsns = Some((first_lsn, lsn));
                    off += len;
                    lsn += 1;
                }
            }
            out.push(s);
        }
    }
    Ok(out)
}

/// What a read-only pass over the journal found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// Every segment, each read on its own.
    pub segments: Vec<SegmentSummary>,
    /// The last LSN of the valid chain (0 if there is none).
    pub chain_end: u64,
    /// Where the chain breaks, if it does.
    pub damage: Option<Damage>,
}

/// Reads the journal without changing it: where its valid chain of records ends and what
/// damage, if any, stops it.
pub fn inspect(store: &dyn ObjectStore, id: JournalId) -> Result<Inspection, RecoveryError> {
    let w = walk(store, id, u64::MAX, None, &mut |_, _| Ok(()))?;
    let mut segments = Vec::new();
    if store.positioned_io() {
        for (_, name) in segment::list_segments(store, id)? {
            segments.push(summarize(store, &name)?);
        }
    } else {
        segments = summarize_objects(store, id)?;
    }
    let chain_end = match (&w.next_lsn, &w.damage) {
        (Some(next), _) => next - 1,
        // Broken before any segment in use: the chain ends before the damaged one.
        (None, Some(d)) => segment::parse_segment_name(id, &d.segment)
            .map_or(w.report.last_lsn, |l| l.saturating_sub(1)),
        (None, None) => 0,
    };
    Ok(Inspection {
        segments,
        chain_end,
        damage: w.damage,
    })
}

/// What [`repair_accept_loss`] dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repair {
    /// The damage that was found (none: nothing was changed).
    pub damage: Option<Damage>,
    /// The journal now ends after this LSN; records after it are gone.
    pub kept_through: u64,
    /// Bytes zeroed at the end of the damaged segment, if it kept any records.
    pub cut: Option<Cut>,
    /// Segments deleted whole (the damaged one if it kept no records, and every later one).
    pub deleted: Vec<SegmentSummary>,
}

/// Drops everything from the first damage on: the rest of the damaged segment is zeroed
/// (or the segment deleted, if none of its records are kept), every later segment is
/// deleted, so that the journal is again one valid chain that ends at the last record before
/// the damage. For an operator who accepts losing those records; the returned report lists
/// exactly what went. A torn tail is cut the same way.
pub fn repair_accept_loss(store: &dyn ObjectStore, id: JournalId) -> Result<Repair, RecoveryError> {
    let ins = inspect(store, id)?;
    let Some(d) = ins.damage.clone() else {
        return Ok(Repair {
            damage: None,
            kept_through: ins.chain_end,
            cut: None,
            deleted: Vec::new(),
        });
    };
    if !store.positioned_io() {
        return repair_objects(store, id, ins, d);
    }
    let mut repair = Repair {
        damage: Some(d.clone()),
        kept_through: ins.chain_end,
        cut: None,
        deleted: Vec::new(),
    };
    let mut later = false;
    for s in &ins.segments {
        if s.name == d.segment {
            later = true;
            if d.offset <= SEGMENT_DATA_START {
                store.delete(&s.name)?;
                repair.deleted.push(s.clone());
            } else {
                let obj = store.open(&s.name, false)?;
                let bytes = s.bytes.saturating_sub(d.offset);
                zero_from(obj.as_ref(), d.offset, bytes)?;
                // A truncated segment gets its length back (as zeros), so it is whole again.
                if let Header::Valid {
                    segment_bytes: Some(created),
                    ..
                } = decode_header(&store.get(&s.name)?.unwrap_or_default())
                    && s.bytes < created
                {
                    obj.set_len(created)?;
                    obj.sync_data()?;
                }
                repair.cut = Some(Cut {
                    segment: s.name.clone(),
                    offset: d.offset,
                    bytes,
                    reason: d.reason.clone(),
                });
            }
        } else if later {
            store.delete(&s.name)?;
            repair.deleted.push(s.clone());
        }
    }
    store.sync_dir(&id.dir())?;
    Ok(repair)
}

/// [`repair_accept_loss`] of a journal as objects: the damaged object and every later one
/// are deleted, and a fence takes the damaged one's place, so the chain ends before it for
/// good (a writer of that incarnation, if one still ran, could not extend it).
fn repair_objects(
    store: &dyn ObjectStore,
    id: JournalId,
    ins: Inspection,
    d: Damage,
) -> Result<Repair, RecoveryError> {
    let damaged = objects::parse_object_name(id, &d.segment).unwrap_or(0);
    let deleted: Vec<SegmentSummary> = ins
        .segments
        .into_iter()
        .filter(|s| objects::parse_object_name(id, &s.name).is_some_and(|q| q >= damaged))
        .collect();
    let names: Vec<String> = deleted.iter().map(|s| s.name.clone()).collect();
    store.delete_many(&names)?;
    objects::fence(store, id)?;
    Ok(Repair {
        damage: Some(d),
        kept_through: ins.chain_end,
        cut: None,
        deleted,
    })
}

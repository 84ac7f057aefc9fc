//! Recovery: read the segments in LSN order, hand every record after the checkpoints to the
//! caller, and cut a torn or corrupt tail (report it, zero it out, never replay it).

use crate::record::{Scan, scan};
use crate::segment::{self, Header, SEGMENT_DATA_START, SEGMENT_HEADER_BYTES, decode_header};
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

/// Recovery could not produce a consistent state.
#[derive(Debug)]
pub enum RecoveryError {
    Io(std::io::Error),
    /// Records the checkpoints need are gone or damaged before the tail.
    Damaged(String),
    /// The caller refused a record.
    Apply {
        lsn: u64,
        error: String,
    },
}

impl fmt::Display for RecoveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecoveryError::Io(e) => write!(f, "journal I/O error: {e}"),
            RecoveryError::Damaged(s) => write!(f, "journal damaged: {s}"),
            RecoveryError::Apply { lsn, error } => {
                write!(f, "cannot replay journal record {lsn}: {error}")
            }
        }
    }
}

impl std::error::Error for RecoveryError {}

impl From<std::io::Error> for RecoveryError {
    fn from(e: std::io::Error) -> Self {
        RecoveryError::Io(e)
    }
}

/// Reads the whole journal and calls `apply(lsn, payload)` for every record with an LSN
/// above `replay_after`, in order. A damaged record in the last non-empty segment is a torn
/// tail: it and everything after it are zeroed and reported in `cut`. Damage anywhere else,
/// or a gap in the LSNs the caller needs, is an error (acknowledged operations would be
/// lost, so the server must not start silently).
pub fn recover(
    store: &dyn ObjectStore,
    replay_after: u64,
    mut apply: impl FnMut(u64, &[u8]) -> Result<(), String>,
) -> Result<RecoveryReport, RecoveryError> {
    let segs = segment::list_segments(store)?;
    let mut report = RecoveryReport {
        segments: segs.len() as u64,
        ..Default::default()
    };
    let mut expect: Option<u64> = None;
    for (idx, (name_lsn, name)) in segs.iter().enumerate() {
        let data = store.get(name)?.unwrap_or_default();
        let is_last = segs[idx + 1..]
            .iter()
            .all(|(_, later)| segment_is_empty(store, later));
        let first = match decode_header(&data) {
            Header::Valid { first_lsn } if first_lsn == *name_lsn => first_lsn,
            Header::Valid { first_lsn } => {
                return Err(RecoveryError::Damaged(format!(
                    "{name} says it starts at LSN {first_lsn}"
                )));
            }
            Header::Empty => continue,
            Header::Corrupt(why) if is_last => {
                cut_tail(store, name, 0, data.len() as u64, &why, &mut report)?;
                break;
            }
            Header::Corrupt(why) => return Err(RecoveryError::Damaged(format!("{name}: {why}"))),
        };
        match expect {
            Some(e) if e != first => {
                return Err(RecoveryError::Damaged(format!(
                    "{name} starts at LSN {first}, expected {e}"
                )));
            }
            None if first > replay_after + 1 => {
                return Err(RecoveryError::Damaged(format!(
                    "oldest segment starts at LSN {first} but records after {replay_after} are needed"
                )));
            }
            _ => {}
        }
        let mut lsn = first;
        let mut off = (SEGMENT_DATA_START as usize).min(data.len());
        loop {
            match scan(&data[off..], lsn) {
                Scan::Record {
                    lsn: l,
                    payload,
                    len,
                } => {
                    if l > replay_after {
                        apply(l, payload)
                            .map_err(|error| RecoveryError::Apply { lsn: l, error })?;
                        report.replayed += 1;
                    } else {
                        report.skipped += 1;
                    }
                    report.last_lsn = l;
                    lsn += 1;
                    off += len;
                }
                Scan::End | Scan::Stale { .. } => break,
                Scan::Corrupt { reason } if is_last => {
                    cut_tail(
                        store,
                        name,
                        off as u64,
                        data.len() as u64 - off as u64,
                        &reason,
                        &mut report,
                    )?;
                    break;
                }
                Scan::Corrupt { reason } => {
                    return Err(RecoveryError::Damaged(format!(
                        "{name} at offset {off}: {reason}"
                    )));
                }
            }
        }
        expect = Some(lsn);
        if report.cut.is_some() {
            break;
        }
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

fn segment_is_empty(store: &dyn ObjectStore, name: &str) -> bool {
    let Ok(obj) = store.open(name, false) else {
        return true;
    };
    let mut h = [0u8; SEGMENT_HEADER_BYTES];
    matches!(obj.read_at(&mut h, 0), Ok(n) if n < SEGMENT_HEADER_BYTES || h.iter().all(|&b| b == 0))
}

/// Zeroes `bytes` bytes of segment `name` from `offset`, durably, and records the cut.
fn cut_tail(
    store: &dyn ObjectStore,
    name: &str,
    offset: u64,
    bytes: u64,
    reason: &str,
    report: &mut RecoveryReport,
) -> Result<(), RecoveryError> {
    tracing::warn!("journal {name}: cutting {bytes} bytes at offset {offset}: {reason}");
    let obj = store.open(name, false)?;
    let zeros = vec![0u8; 1 << 20];
    let mut done = 0;
    while done < bytes {
        let n = (bytes - done).min(zeros.len() as u64) as usize;
        obj.write_at(&zeros[..n], offset + done)?;
        done += n as u64;
    }
    obj.sync_data()?;
    report.cut = Some(Cut {
        segment: name.to_string(),
        offset,
        bytes,
        reason: reason.to_string(),
    });
    Ok(())
}

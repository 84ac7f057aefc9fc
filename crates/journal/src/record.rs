//! Record framing, pure functions over bytes. A record is
//!
//! ```text
//! u32 payload_len | u32 crc32c | u64 lsn | u64 epoch | payload
//! ```
//!
//! with the CRC over the length, the LSN, the epoch and the payload. The epoch is that of
//! the server incarnation that wrote the record (journal records; checkpoint images write
//! the epoch of their writer too), so a record can never be taken for another
//! incarnation's. A header of zeros marks the clean
//! end of a segment (segments are pre-zeroed); anything else that does not check out is a
//! torn or corrupt record.

/// Bytes before the payload.
pub const RECORD_HEADER_BYTES: usize = 24;

/// Largest payload of one record. One operation is one record; the largest operations
/// (a 64 KiB xattr value plus inode images) stay far below this, and a server splits its
/// own multi-item work (closing a session's handles, removing orphans) into bounded
/// records. Recovery treats a longer length field as damage.
pub const MAX_RECORD_BYTES: usize = 4 << 20;

/// A record whose payload exceeds the limit it was encoded against. Never written: the
/// caller's bytes are left as they were before the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordTooLarge {
    pub payload_bytes: usize,
    pub limit: usize,
}

impl std::fmt::Display for RecordTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "journal record of {} bytes exceeds the limit of {} bytes",
            self.payload_bytes, self.limit
        )
    }
}

impl std::error::Error for RecordTooLarge {}

/// CRC of a record: over its length field, LSN and epoch (`lsn_epoch`) and payload.
fn record_crc(len_bytes: &[u8], lsn_epoch: &[u8], payload: &[u8]) -> u32 {
    let c = crc32c::crc32c(len_bytes);
    let c = crc32c::crc32c_append(c, lsn_epoch);
    crc32c::crc32c_append(c, payload)
}

/// Appends a record whose payload `write_payload` appends to `out`, if the payload is at
/// most `limit` bytes (the journal's is at most [`MAX_RECORD_BYTES`]; readers must accept
/// the same limit, see [`scan_limited`]); otherwise `out` is restored and the size is
/// reported. Returns the record's total length.
pub fn encode_record_with(
    out: &mut Vec<u8>,
    lsn: u64,
    epoch: u64,
    limit: usize,
    write_payload: impl FnOnce(&mut Vec<u8>),
) -> Result<usize, RecordTooLarge> {
    let start = out.len();
    out.extend_from_slice(&[0u8; RECORD_HEADER_BYTES]);
    write_payload(out);
    let payload_len = out.len() - start - RECORD_HEADER_BYTES;
    if payload_len > limit {
        out.truncate(start);
        return Err(RecordTooLarge {
            payload_bytes: payload_len,
            limit,
        });
    }
    let len_bytes = (payload_len as u32).to_le_bytes();
    let mut lsn_epoch = [0u8; 16];
    lsn_epoch[..8].copy_from_slice(&lsn.to_le_bytes());
    lsn_epoch[8..].copy_from_slice(&epoch.to_le_bytes());
    let crc = record_crc(&len_bytes, &lsn_epoch, &out[start + RECORD_HEADER_BYTES..]);
    out[start..start + 4].copy_from_slice(&len_bytes);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    out[start + 8..start + 24].copy_from_slice(&lsn_epoch);
    Ok(out.len() - start)
}

/// Appends a record carrying `payload` (at most [`MAX_RECORD_BYTES`]).
pub fn encode_record(
    out: &mut Vec<u8>,
    lsn: u64,
    epoch: u64,
    payload: &[u8],
) -> Result<usize, RecordTooLarge> {
    encode_record_with(out, lsn, epoch, MAX_RECORD_BYTES, |o| {
        o.extend_from_slice(payload)
    })
}

/// Total length of the record starting at `buf[0]`, from its header (no checks).
pub fn record_len(buf: &[u8]) -> usize {
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    RECORD_HEADER_BYTES + len
}

/// What the reader found at one position.
#[derive(Debug, PartialEq, Eq)]
pub enum Scan<'a> {
    Record {
        lsn: u64,
        /// The epoch of the incarnation that wrote it.
        epoch: u64,
        payload: &'a [u8],
        len: usize,
    },
    /// A zero header, or no room for a header: nothing more was ever written here.
    End,
    /// A valid record with a lower LSN than expected (not written by this journal's
    /// current pass over the bytes): the end.
    Stale { lsn: u64 },

    /// Bytes that are not a valid record: a torn write or corruption.
    Corrupt { reason: String },
}

/// Reads the record at the start of `buf`, expecting `expect_lsn` (a journal record: at
/// most [`MAX_RECORD_BYTES`]).
pub fn scan(buf: &[u8], expect_lsn: u64) -> Scan<'_> {
    scan_limited(buf, expect_lsn, MAX_RECORD_BYTES)
}

/// [`scan`] for records written with a payload limit of `limit` bytes; a longer length
/// field is damage.
pub fn scan_limited(buf: &[u8], expect_lsn: u64, limit: usize) -> Scan<'_> {
    if buf.len() < RECORD_HEADER_BYTES {
        return if buf.iter().all(|&b| b == 0) {
            Scan::End
        } else {
            Scan::Corrupt {
                reason: format!("{} trailing bytes too short for a header", buf.len()),
            }
        };
    }
    let header = &buf[..RECORD_HEADER_BYTES];
    if header.iter().all(|&b| b == 0) {
        return Scan::End;
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    let crc = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    let mut lsn_bytes = [0u8; 8];
    lsn_bytes.copy_from_slice(&buf[8..16]);
    let lsn = u64::from_le_bytes(lsn_bytes);
    lsn_bytes.copy_from_slice(&buf[16..24]);
    let epoch = u64::from_le_bytes(lsn_bytes);
    if len > limit {
        return Scan::Corrupt {
            reason: format!("record length {len} exceeds {limit}"),
        };
    }
    if buf.len() < RECORD_HEADER_BYTES + len {
        return Scan::Corrupt {
            reason: format!("record of {len} bytes runs past the end of the segment"),
        };
    }
    let payload = &buf[RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + len];
    if record_crc(&buf[0..4], &buf[8..24], payload) != crc {
        return Scan::Corrupt {
            reason: format!("checksum mismatch in the record expected as LSN {expect_lsn}"),
        };
    }
    if lsn < expect_lsn {
        return Scan::Stale { lsn };
    }
    if lsn != expect_lsn {
        return Scan::Corrupt {
            reason: format!("LSN {lsn} where {expect_lsn} was expected"),
        };
    }
    Scan::Record {
        lsn,
        epoch,
        payload,
        len: RECORD_HEADER_BYTES + len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_torn_prefix_is_detected() {
        let mut buf = Vec::new();
        encode_record(&mut buf, 7, 3, b"hello world").unwrap();
        let n = buf.len();
        encode_record(&mut buf, 8, 3, b"second").unwrap();
        match scan(&buf, 7) {
            Scan::Record {
                lsn,
                epoch,
                payload,
                len,
            } => {
                assert_eq!((lsn, epoch, payload, len), (7, 3, &b"hello world"[..], n));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(scan(&buf[n..], 8), Scan::Record { lsn: 8, .. }));
        // A record cut anywhere (and padded with zeros, as a pre-zeroed segment is) is torn.
        for cut in 1..n {
            let mut torn = buf[..cut].to_vec();
            torn.resize(n + 32, 0);
            assert!(
                matches!(scan(&torn, 7), Scan::Corrupt { .. }),
                "cut at {cut}"
            );
        }
        // Every single-bit flip is caught.
        for bit in 0..n * 8 {
            let mut bad = buf[..n].to_vec();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(!matches!(scan(&bad, 7), Scan::Record { .. }), "bit {bit}");
        }
        assert_eq!(scan(&[0u8; 40], 1), Scan::End);
        assert!(
            matches!(scan(&buf, 6), Scan::Corrupt { .. }),
            "LSN from the future"
        );
        assert_eq!(
            scan(&buf, 9),
            Scan::Stale { lsn: 7 },
            "left over in a recycled segment"
        );
    }

    #[test]
    fn an_oversized_record_is_refused_and_leaves_the_buffer_as_it_was() {
        // The old code asserted here, which with panic=abort took the whole server down.
        let mut buf = Vec::new();
        encode_record(&mut buf, 1, 1, b"kept").unwrap();
        let before = buf.clone();
        let big = vec![1u8; MAX_RECORD_BYTES + 1];
        assert_eq!(
            encode_record(&mut buf, 2, 1, &big),
            Err(RecordTooLarge {
                payload_bytes: MAX_RECORD_BYTES + 1,
                limit: MAX_RECORD_BYTES
            })
        );
        assert_eq!(buf, before);
        // A caller's smaller limit applies too.
        assert!(encode_record_with(&mut buf, 2, 1, 3, |o| o.extend_from_slice(b"four")).is_err());
        assert_eq!(buf, before);
        assert_eq!(
            encode_record_with(&mut buf, 2, 1, 4, |o| o.extend_from_slice(b"four")),
            Ok(RECORD_HEADER_BYTES + 4)
        );
    }
}

//! Transaction records in the journal and messages between members (issue 33), as bytes.
//!
//! A transaction record is an ordinary journal record (CRC'd by the journal like every
//! other): a [`JournalEntryRef`] followed by [`TRAILER_MAGIC`] and the encoded
//! `txn::Record`. Readers of the journal that know nothing of transactions (replay into
//! the tables, the reply cache, offline fsck) decode the entry and ignore the trailer: a
//! participant's commit record carries its engine mutations in the entry, so replay
//! rebuilds the tables as for any operation; an initiator's commit decision carries the
//! client and sequence number, so the reply cache answers a retry after a restart.

use crate::core::{JournalEntry, JournalEntryRef};
use kochab_cluster::txn::{Msg, Record};
use kochab_meta::Mutation;

/// Marks a journal entry followed by a transaction record ("Kochab TXn, version 1").
pub const TRAILER_MAGIC: [u8; 4] = *b"KTX1";

/// Largest encoded message between members: a prepare of the largest part (16 keys with
/// names of up to 255 bytes and changes carrying credentials with 64 groups) is under
/// 16 KiB; anything bigger is refused before it is decoded.
pub const MSG_BYTES_MAX: usize = 64 << 10;

/// Appends a journal payload: the entry (its mutations and reply-cache fields), then the
/// record.
pub fn encode_entry(
    buf: Vec<u8>,
    client: u64,
    seq: u64,
    outcome: Option<kochab_proto::InodeId>,
    muts: &[Mutation],
    record: &Record,
) -> Vec<u8> {
    let entry = JournalEntryRef {
        client,
        seq,
        seq_floor: 0,
        outcome,
        muts,
    };
    // Our own in-memory types into a Vec cannot fail; if they did, the journal would
    // diverge from memory, so stop loudly (as `core::journal_entry` does).
    let mut buf = postcard::to_extend(&entry, buf)
        .unwrap_or_else(|e| panic!("journal entry does not serialize: {e}"));
    buf.extend_from_slice(&TRAILER_MAGIC);
    postcard::to_extend(record, buf)
        .unwrap_or_else(|e| panic!("transaction record does not serialize: {e}"))
}

/// The transaction record a journal payload carries, if any, with what its entry keeps
/// for the reply cache (a committed link's inode). Damage (a trailer that is not one, or
/// does not decode whole) is an error, never skipped.
pub fn decode_entry(
    payload: &[u8],
) -> Result<Option<(Record, Option<kochab_proto::InodeId>)>, String> {
    let (entry, rest) = postcard::take_from_bytes::<JournalEntry>(payload)
        .map_err(|e| format!("undecodable journal entry: {e}"))?;
    if rest.is_empty() {
        return Ok(None);
    }
    let Some(body) = rest.strip_prefix(&TRAILER_MAGIC) else {
        return Err(format!(
            "{} unknown bytes after a journal entry",
            rest.len()
        ));
    };
    kochab_proto::frame::decode_payload::<Record>(body)
        .map(|r| Some((r, entry.outcome)))
        .map_err(|e| format!("undecodable transaction record: {e}"))
}

/// A message for another member.
pub fn encode_msg(msg: &Msg) -> Vec<u8> {
    kochab_proto::frame::encode_value(Vec::new(), msg)
        .unwrap_or_else(|e| panic!("a transaction message does not serialize: {e}"))
}

/// A message from another member: bounded, decoded whole.
pub fn decode_msg(bytes: &[u8]) -> Result<Msg, String> {
    if bytes.len() > MSG_BYTES_MAX {
        return Err(format!("a transaction message of {} bytes", bytes.len()));
    }
    kochab_proto::frame::decode_payload(bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kochab_cluster::txn::{Decision, TxnId};
    use kochab_proto::cluster::ServerId;

    fn txn() -> TxnId {
        TxnId {
            origin: ServerId(2),
            epoch: 7,
            seq: 1,
        }
    }

    #[test]
    fn records_round_trip_and_plain_entries_have_none() {
        let r = Record::Decided {
            txn: txn(),
            client: 5,
            seq: 9,
            decision: Decision::Commit,
            participants: vec![ServerId(2), ServerId(3)],
        };
        let bytes = encode_entry(Vec::new(), 5, 9, Some(77), &[], &r);
        // What the reply cache keeps (a link's inode) comes back with it.
        assert_eq!(decode_entry(&bytes), Ok(Some((r, Some(77)))));
        // Readers that know nothing of the trailer still read the entry.
        let e: JournalEntry = postcard::from_bytes(&bytes).expect("entry");
        assert_eq!((e.client, e.seq, e.muts.len()), (5, 9, 0));
        let plain = postcard::to_allocvec(&JournalEntryRef {
            client: 1,
            seq: 2,
            seq_floor: 0,
            outcome: None,
            muts: &[],
        })
        .expect("plain");
        assert_eq!(decode_entry(&plain), Ok(None));
    }

    #[test]
    fn damaged_trailers_are_errors() {
        let r = Record::Forgotten { txn: txn() };
        let mut bytes = encode_entry(Vec::new(), 0, 0, None, &[], &r);
        bytes.push(0);
        assert!(decode_entry(&bytes).is_err(), "trailing byte");
        bytes.pop();
        bytes.pop();
        assert!(decode_entry(&bytes).is_err(), "short record");
        let mut other = encode_entry(Vec::new(), 0, 0, None, &[], &r);
        let at = other
            .windows(4)
            .rposition(|w| w == TRAILER_MAGIC)
            .expect("magic");
        other[at] ^= 0xff;
        assert!(decode_entry(&other).is_err(), "bad magic");
        assert!(decode_msg(&vec![0u8; MSG_BYTES_MAX + 1]).is_err());
        assert!(decode_msg(&[0xff, 0xff]).is_err());
    }
}

//! The journal of a metadata server: one per server, in object-store segments.
//!
//! - [`record`]: CRC32C-framed records (pure).
//! - [`segment`]: segment naming, headers, zero-filled preparation.
//! - [`writer`]: group commit with double buffering; durability published by LSN.
//! - [`recover`]: replay in order; a torn tail is reported and cut, other damage refused;
//!   a read-only inspection and an explicit repair that drops what follows damage.

pub mod record;
pub mod recover;
pub mod segment;
pub mod writer;

pub use recover::{
    Cut, Damage, Inspection, RecoveryError, RecoveryReport, Repair, SegmentSummary, inspect,
    recover, repair_accept_loss,
};
pub use writer::{Journal, JournalObserver, JournalOptions};

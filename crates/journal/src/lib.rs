//! The journal of a metadata server incarnation (server id and epoch), in object-store
//! segments (a store with positioned I/O: the local directory) or as immutable objects (a
//! store of whole objects: S3); sealed by whoever takes over from that incarnation.
//!
//! - [`record`]: CRC32C-framed records (pure).
//! - [`segment`]: segment naming, headers, zero-filled preparation, the seal object.
//! - `seal`: sealing a journal in either form.
//! - [`objects`]: journal objects, their chain, and fencing by creating the next one.
//! - [`writer`]: group commit with double buffering; durability published by LSN.
//! - `uploads`: journal objects in flight, several PUTs at once, acknowledged in order.
//! - `observer`: what the writer reports, for metrics.
//! - [`recover`]: replay in order; a torn tail is reported and cut, other damage refused;
//!   a read-only inspection and an explicit repair that drops what follows damage.

pub mod objects;
mod observer;
pub mod record;
pub mod recover;
mod seal;
pub mod segment;
mod uploads;
pub mod writer;

pub use observer::JournalObserver;
pub use recover::{
    Cut, Damage, Inspection, RecoveryError, RecoveryReport, Repair, ReplayRefused, SegmentSummary,
    inspect, recover, recover_range, repair_accept_loss,
};
pub use seal::seal;
pub use segment::JournalId;
pub use writer::{Journal, JournalOptions};

//! The journal of a metadata server: one per server, in object-store segments.
//!
//! - [`record`]: CRC32C-framed records (pure).
//! - [`segment`]: segment naming, headers, zero-filled preparation.
//! - [`writer`]: group commit with double buffering; durability published by LSN.
//! - [`recover`]: replay in order; a torn or corrupt tail is reported and cut.

pub mod record;
pub mod recover;
pub mod segment;
pub mod writer;

pub use recover::{Cut, RecoveryError, RecoveryReport, recover};
pub use writer::{Journal, JournalObserver, JournalOptions};

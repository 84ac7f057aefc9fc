//! A member server's bookkeeping around its [`Participant`](crate::participant::Participant),
//! as pure code that the real server (`kochab-server`'s cluster host) and the
//! [simulation](crate::sim) both run: the caller owns the clock, the journal, the store
//! and the channels, and passes in what happened and when.
//!
//! - [`borrows`]: operations that need tables held elsewhere wait for a borrow, or join
//!   one this incarnation already asked for or was just granted; the last one out returns
//!   it.
//! - [`ends`]: an admitted operation ends (and may complete a drain) only once the journal
//!   is durable up to its record.
//! - [`ranges`]: which table an inode id belongs to, as splits cut the ranges finer.
//! - [`load`]: what ADD or recovery does with each table by the owner its manifest names
//!   (fresh, an earlier try, a fenced journal to seal and replay, or refused), and the
//!   per-table load reported to the coordinator.

pub mod borrows;
pub mod ends;
pub mod load;
pub mod ranges;

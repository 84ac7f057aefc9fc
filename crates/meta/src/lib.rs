//! The Kochab metadata engine: the in-memory tables of one metadata server and every
//! namespace operation on them, with no I/O of its own.
//!
//! - [`idpolicy`]: the child-closest id policy (id arithmetic); [`alloc`]: who gets which id.
//! - [`table`]: one id range's inodes, entries and xattrs, in checkpoint boxes.
//! - [`dir`]: a directory's entries in hash order, with stable readdir cookies.
//! - [`layout`]: files' chunk layouts (slice refs) and their commits and truncations.
//! - [`ops`]: the POSIX operations; [`perm`]: permission rules.
//! - [`mutation`]: redo records, applied the same way live and on replay.
//! - [`error`]: what applying, replaying, loading or re-cutting tables can refuse.

pub mod alloc;
pub mod dir;
pub mod engine;
pub mod error;
pub mod files;
pub mod idpolicy;
pub mod inode;
pub mod layout;
pub mod links;
pub mod mutation;
pub mod name;
pub mod ops;
pub mod perm;
pub mod table;

pub use engine::{Engine, EngineConfig, Fail, initial_table_ranges, not_in_any_table};
pub use error::{ApplyError, ConfigError, ImageError, TableError};
pub use idpolicy::{IdPolicy, IdPolicyConfig, Region};
pub use inode::Inode;
pub use kochab_proto::layout::SliceRef;
pub use mutation::Mutation;
pub use name::Name;
pub use table::{BoxImage, BoxSet, FileLayout, Reclaim, Table};

//! The Kochab wire protocol: message types, errno mapping and the frame codec.
//!
//! Everything here is pure data and pure functions so that servers, clients and tests share
//! one definition of what travels between them.

pub mod auth;
pub mod cluster;
pub mod codec;
pub mod errno;
pub mod frame;
pub mod layout;
pub mod links;
pub mod msg;
pub mod net;
pub mod types;

pub use errno::{Errno, FsError, FsResult};
pub use frame::{FrameError, FrameHeader, FrameKind};
pub use msg::*;
pub use types::*;

//! Errors that cross the wire. Every failure a server reports is an errno (Linux numbering,
//! so the FUSE adapter passes it through unchanged) plus a human-readable message.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A Linux errno value. The table below is the wire protocol's, not the host's: values are
/// Linux numbers on every platform, which is why it is not taken from nix/rustix (they
/// give the host's numbering); a test checks it against libc on Linux.
/// Kept as a newtype so it travels as one varint and maps one-to-one
/// onto what the kernel expects from a FUSE reply.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Errno(pub i32);

macro_rules! errnos {
    ($($name:ident = $val:expr, $text:expr;)*) => {
        impl Errno {
            $(#[doc = $text] pub const $name: Errno = Errno($val);)*

            /// The symbolic name, e.g. "ENOENT".
            pub fn name(self) -> &'static str {
                match self.0 {
                    $($val => stringify!($name),)*
                    _ => "E?",
                }
            }

            /// The C library's description of the errno.
            pub fn description(self) -> &'static str {
                match self.0 {
                    $($val => $text,)*
                    _ => "unknown error",
                }
            }
        }
    };
}

errnos! {
    EPERM = 1, "operation not permitted";
    ENOENT = 2, "no such file or directory";
    EIO = 5, "input/output error";
    ENXIO = 6, "no such device or address";
    E2BIG = 7, "argument list too long";
    EBADF = 9, "bad file descriptor";
    EAGAIN = 11, "resource temporarily unavailable";
    ENOMEM = 12, "cannot allocate memory";
    EACCES = 13, "permission denied";
    EBUSY = 16, "device or resource busy";
    EEXIST = 17, "file exists";
    EXDEV = 18, "invalid cross-device link";
    ENOTDIR = 20, "not a directory";
    EISDIR = 21, "is a directory";
    EINVAL = 22, "invalid argument";
    EMFILE = 24, "too many open files";
    EFBIG = 27, "file too large";
    ENOSPC = 28, "no space left on device";
    EROFS = 30, "read-only file system";
    EMLINK = 31, "too many links";
    ERANGE = 34, "numerical result out of range";
    EDEADLK = 35, "resource deadlock avoided";
    ENAMETOOLONG = 36, "file name too long";
    ENOLCK = 37, "no locks available";
    ENOSYS = 38, "function not implemented";
    ENOTEMPTY = 39, "directory not empty";
    ELOOP = 40, "too many levels of symbolic links";
    ENODATA = 61, "no data available";
    EPROTO = 71, "protocol error";
    EOVERFLOW = 75, "value too large for defined data type";
    EOPNOTSUPP = 95, "operation not supported";
    ENOTCONN = 107, "transport endpoint is not connected";
    ETIMEDOUT = 110, "connection timed out";
    ECONNREFUSED = 111, "connection refused";
    ESTALE = 116, "stale file handle";
    EDQUOT = 122, "disk quota exceeded";
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.name(), self.description())
    }
}

/// A failed request: the errno the caller acts on and a message a person reads.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsError {
    pub errno: Errno,
    pub message: String,
}

impl FsError {
    pub fn new(errno: Errno, message: impl Into<String>) -> Self {
        FsError {
            errno,
            message: message.into(),
        }
    }
}

impl Errno {
    /// The errno a storage error reaches clients as. The one place where I/O errors of
    /// the store become client errors: a full store is ENOSPC, a quota EDQUOT, an object
    /// too large EFBIG, something the store cannot do EOPNOTSUPP, and every other failure
    /// EIO (the caller cannot act on more detail).
    pub fn of_io(e: &std::io::Error) -> Errno {
        use std::io::ErrorKind;
        match e.kind() {
            ErrorKind::StorageFull => Errno::ENOSPC,
            ErrorKind::QuotaExceeded => Errno::EDQUOT,
            ErrorKind::FileTooLarge => Errno::EFBIG,
            ErrorKind::Unsupported => Errno::EOPNOTSUPP,
            _ => Errno::EIO,
        }
    }
}

impl FsError {
    /// A storage error as a client error (see [`Errno::of_io`]), with `what` failed.
    pub fn from_io(what: &str, e: &std::io::Error) -> FsError {
        FsError::new(Errno::of_io(e), format!("{what}: {e}"))
    }
}

impl fmt::Debug for FsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.errno, self.message)
    }
}

impl fmt::Display for FsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.errno.name())
    }
}

impl std::error::Error for FsError {}

/// Shorthand for results of file-system operations.
pub type FsResult<T> = Result<T, FsError>;

/// Builds an `FsError` with a formatted message: `fs_err!(ENOENT, "no entry {name:?}")`.
#[macro_export]
macro_rules! fs_err {
    ($errno:ident, $($arg:tt)*) => {
        $crate::FsError::new($crate::Errno::$errno, format!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    #[test]
    fn storage_errors_map_faithfully() {
        let of = |raw| Errno::of_io(&io::Error::from_raw_os_error(raw));
        assert_eq!(of(libc::ENOSPC), Errno::ENOSPC);
        assert_eq!(of(libc::EDQUOT), Errno::EDQUOT);
        assert_eq!(of(libc::EFBIG), Errno::EFBIG);
        assert_eq!(of(libc::EIO), Errno::EIO);
        assert_eq!(of(libc::EOPNOTSUPP), Errno::EOPNOTSUPP);
        assert_eq!(of(libc::EACCES), Errno::EIO);
        assert_eq!(Errno::of_io(&io::Error::other("x")), Errno::EIO);
        let e = FsError::from_io("write", &io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(e.errno, Errno::ENOSPC);
        assert!(e.message.starts_with("write: "));
    }
}

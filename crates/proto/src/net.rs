//! Socket settings and read-buffer sizing shared by servers and clients.

use crate::frame::MAX_FRAME_BYTES;

/// Socket buffers for bulk transfers: a 1 MiB write should not wait for the reader to
/// drain a 16 KiB default buffer many times over.
pub const SOCKET_BUFFER_BYTES: i32 = 4 << 20;
/// Free buffer space kept before a read when no large frame is expected.
pub const READ_CHUNK: usize = 64 << 10;

/// Sets a socket's send and receive buffers (best effort: the kernel may cap them).
pub fn size_socket_buffers(fd: std::os::fd::RawFd) {
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt with a caller-supplied fd and a pointer to an i32 of the given
        // size; a bad fd only makes the call fail.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                &SOCKET_BUFFER_BYTES as *const i32 as *const libc::c_void,
                std::mem::size_of::<i32>() as libc::socklen_t,
            );
        }
    }
}

/// Makes room in `buf` for the rest of the frame starting at `buf[0]`, so that a large frame
/// is read in one go instead of 64 KiB at a time.
pub fn reserve_for_frame(buf: &mut Vec<u8>) {
    let want = match buf.get(..4) {
        Some(h) => 4 + u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize,
        None => 0,
    };
    let missing = want.saturating_sub(buf.len());
    buf.reserve(missing.clamp(READ_CHUNK, MAX_FRAME_BYTES + 16));
}

//! Socket settings and read-buffer sizing shared by servers and clients.

use crate::frame::MAX_FRAME_BYTES;

/// Socket buffers for bulk transfers: a 1 MiB write should not wait for the reader to
/// drain a 16 KiB default buffer many times over.
pub const SOCKET_BUFFER_BYTES: i32 = 4 << 20;
/// Free buffer space kept before a read when no large frame is expected.
pub const READ_CHUNK: usize = 64 << 10;

/// Sets a socket's send and receive buffers (best effort: the kernel may cap them).
pub fn size_socket_buffers(sock: &impl std::os::fd::AsFd) {
    let sock = socket2::SockRef::from(sock);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES as usize);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES as usize);
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

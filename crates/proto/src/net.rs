//! Socket settings and read-buffer sizing shared by servers and clients.

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

//! The mount answers the root with generation 0. The kernel makes its root inode with
//! generation 0 and, told another for the root (a LOOKUP of ".." in a directory of the
//! root, or of "." in the root, as a file-handle decode sends them), logs "fuse: root
//! generation should be zero" and uses 0 anyway (xfstests generic/467 showed it). The
//! kernel hides the value, and warns once per boot only, so this test plays the kernel's
//! side of the protocol itself: the mount's file system serves a socket pair instead of
//! /dev/fuse, and the test reads the generation in its replies.

mod common;

use common::{ServerProc, runtime};
use kochab_fuse::{KochabFs, MountConfig};
use kochab_proto::Credentials;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

const FUSE_LOOKUP: u32 = 1;
const FUSE_INIT: u32 = 26;
const FUSE_ROOT_ID: u64 = 1;
/// `struct fuse_in_header` and `struct fuse_out_header`.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
/// How long the test waits for one reply (a lookup is one round trip to the server).
const REPLY_MAX: Duration = Duration::from_secs(30);

/// The kernel's end of a FUSE connection: requests out, replies in, one message each.
struct Kernel {
    sock: UnixStream,
    unique: u64,
}

impl Kernel {
    /// Sends one request (an in header, then `args`) and returns its unique id.
    fn send(&mut self, opcode: u32, nodeid: u64, args: &[u8]) -> u64 {
        self.unique += 2;
        let mut m = Vec::with_capacity(IN_HEADER + args.len());
        m.extend_from_slice(&((IN_HEADER + args.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&opcode.to_ne_bytes());
        m.extend_from_slice(&self.unique.to_ne_bytes());
        m.extend_from_slice(&nodeid.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes()); // uid
        m.extend_from_slice(&0u32.to_ne_bytes()); // gid
        m.extend_from_slice(&std::process::id().to_ne_bytes());
        m.extend_from_slice(&[0u8; 4]); // total_extlen, padding
        m.extend_from_slice(args);
        self.sock.write_all(&m).expect("send a request");
        self.unique
    }

    /// Reads the reply to `unique`: its error (0 or a negative errno) and arguments.
    fn reply(&mut self, unique: u64) -> (i32, Vec<u8>) {
        let mut buf = vec![0u8; 1 << 16];
        let n = self.sock.read(&mut buf).expect("a reply within REPLY_MAX");
        assert!(n >= OUT_HEADER, "short reply: {n} bytes");
        let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
        let error = i32::from_ne_bytes(buf[4..8].try_into().unwrap());
        let got = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
        assert_eq!(len, n, "the reply's length is the message's");
        assert_eq!(
            got, unique,
            "replies come in order here (one request at a time)"
        );
        (error, buf[OUT_HEADER..n].to_vec())
    }

    /// LOOKUP of `name` in `nodeid`: the reply's node id and generation
    /// (`struct fuse_entry_out` starts with them).
    fn lookup(&mut self, nodeid: u64, name: &str) -> (u64, u64) {
        let mut arg = name.as_bytes().to_vec();
        arg.push(0);
        let unique = self.send(FUSE_LOOKUP, nodeid, &arg);
        let (error, out) = self.reply(unique);
        assert_eq!(error, 0, "LOOKUP of {name:?} in {nodeid}");
        let word = |at: usize| u64::from_ne_bytes(out[at..at + 8].try_into().unwrap());
        (word(0), word(8))
    }
}

#[test]
fn the_root_is_answered_with_generation_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("data"), &[]);
    let rt = runtime();
    let client = rt.block_on(server.client(3));
    let root = client.root();
    let made = rt
        .block_on(client.mkdir(&Credentials::root(), root, b"d", 0o755))
        .expect("mkdir d");
    let server_root = rt
        .block_on(client.getattr(&Credentials::root(), root))
        .expect("getattr /");
    // What makes the test mean something: the servers keep a generation for the root
    // (its inode's birth time) that is not 0.
    assert_ne!(
        server_root.generation, 0,
        "the root's generation at the servers"
    );

    let mut fds = [0; 2];
    // SAFETY: socketpair(2) writes two descriptors into `fds`.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and owned here alone.
    let (ours, theirs) = unsafe {
        (
            UnixStream::from_raw_fd(fds[0]),
            OwnedFd::from_raw_fd(fds[1]),
        )
    };
    ours.set_read_timeout(Some(REPLY_MAX)).unwrap();
    let mut kernel = Kernel {
        sock: ours,
        unique: 0,
    };

    // FUSE_INIT (protocol 7.40; `struct fuse_init_in` is 64 bytes since 7.36), sent before
    // the session reads it: the session's handshake is its first read.
    let mut init = Vec::new();
    for word in [7u32, 40, 1 << 20, 0, 0] {
        init.extend_from_slice(&word.to_ne_bytes());
    }
    init.extend_from_slice(&[0u8; 44]);
    let init_unique = kernel.send(FUSE_INIT, 0, &init);
    let fs = KochabFs::new(client, rt.handle().clone(), MountConfig::default());
    // fuser's own request loop (no loop runner, so no io_uring queues on a socket).
    let mut config = fuser::Config::default();
    config.acl = fuser::SessionACL::All;
    let session = fuser::Session::from_fd(fs, theirs, fuser::SessionACL::All, config)
        .expect("the session's handshake");
    let (error, _) = kernel.reply(init_unique);
    assert_eq!(error, 0, "INIT");
    let session = session.spawn().expect("the session's thread");

    let (d, d_generation) = kernel.lookup(FUSE_ROOT_ID, "d");
    assert_ne!(d, FUSE_ROOT_ID);
    assert_eq!(
        d_generation, made.generation,
        "any other inode keeps its generation"
    );
    // A file-handle decode of a directory of the root: its parent, by "..".
    assert_eq!(kernel.lookup(d, ".."), (FUSE_ROOT_ID, 0), "\"..\" of /d");
    // A file-handle decode of the root itself: ".", in the root.
    assert_eq!(
        kernel.lookup(FUSE_ROOT_ID, "."),
        (FUSE_ROOT_ID, 0),
        "\".\" of /"
    );

    // The end of the connection ends the session (which ends its session at the server);
    // it is waited for while the runtime it uses is still there.
    drop(kernel);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = session.join();
        let _ = done_tx.send(());
    });
    let _ = done_rx.recv_timeout(Duration::from_secs(60));
}

//! Bad input against a real server process: garbage, truncated and oversized frames,
//! unauthenticated requests, and well-formed requests with absurd contents. Every answer
//! must be an errno (or the one connection closed), the server must stay up for everyone
//! else, and the namespace must stay consistent.

mod common;

use common::{Rng, ServerProc, runtime, seed};
use kochab_proto::frame::{
    FRAME_HEADER_BYTES, MAX_FRAME_BYTES, decode_payload, encode_frame, parse_header,
};
use kochab_proto::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

struct Raw {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    fn connect(addr: SocketAddr) -> Raw {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw { s, buf: Vec::new() }
    }

    /// Reads one frame; None when the server closed the connection (or it failed).
    fn frame(&mut self) -> Option<(FrameKind, u64, Vec<u8>)> {
        self.next().ok().flatten()
    }

    /// Reads one frame: `Ok(None)` when the server closed the connection, `Err` when the
    /// read failed (a timeout: the server neither answered nor closed).
    fn next(&mut self) -> std::io::Result<Option<(FrameKind, u64, Vec<u8>)>> {
        loop {
            if let Some(h) = parse_header(&self.buf).expect("server frames are valid") {
                let payload = self.buf[FRAME_HEADER_BYTES..h.total_len].to_vec();
                self.buf.drain(..h.total_len);
                return Ok(Some((h.kind, h.request_id, payload)));
            }
            let mut chunk = [0u8; 65536];
            match self.s.read(&mut chunk)? {
                0 => return Ok(None),
                n => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn send(&mut self, bytes: &[u8]) -> bool {
        self.s.write_all(bytes).is_ok()
    }

    /// Connects and authenticates.
    fn authed(addr: SocketAddr, key: &auth::ClusterKey) -> Raw {
        let mut r = Raw::connect(addr);
        let (kind, _, payload) = r.frame().expect("challenge");
        assert_eq!(kind, FrameKind::Challenge);
        let ch: Challenge = decode_payload(&payload).unwrap();
        let mut out = Vec::new();
        encode_frame(
            &mut out,
            FrameKind::Auth,
            0,
            &Auth::prove(&auth::ClientKey::admin(*key), ch.nonce, [7; 32], 99).0,
        )
        .unwrap();
        assert!(r.send(&out));
        let (kind, _, _) = r.frame().expect("welcome");
        assert_eq!(kind, FrameKind::Welcome);
        r
    }

    fn call(&mut self, id: u64, cred: Credentials, op: Op) -> Reply {
        let mut out = Vec::new();
        encode_frame(
            &mut out,
            FrameKind::Request,
            id,
            &Request {
                cred,
                seq: id,
                seq_floor: 0,
                map_version: 0,
                mode: Default::default(),
                op,
            },
        )
        .unwrap();
        assert!(self.send(&out), "send");
        let (kind, rid, payload) = self.frame().expect("reply");
        assert_eq!((kind, rid), (FrameKind::Reply, id));
        decode_payload::<Reply>(&payload)
            .expect("decodable reply")
            .without_dirs()
    }
}

fn errno_of(r: &Reply) -> Option<Errno> {
    match r {
        Reply::Error(e) => Some(e.errno),
        _ => None,
    }
}

/// The server answers a fresh, well-behaved client.
fn assert_serving(server: &mut ServerProc) {
    assert!(server.alive(), "server died; log:\n{}", server.log_text());
    let root = runtime().block_on(async {
        let c = server.client(1).await;
        c.getattr(&Credentials::root(), c.root())
            .await
            .expect("getattr root")
    });
    assert_eq!(root.kind(), Some(FileKind::Dir));
}

#[test]
fn unauthenticated_connections_get_an_error_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = ServerProc::start(&tmp.path().join("d"), &[]);
    let root_req = Request {
        cred: Credentials::root(),
        seq: 0,
        seq_floor: 0,
        map_version: 0,
        mode: Default::default(),
        op: Op::GetAttr { id: 1 << 62 },
    };

    // A request instead of the proof: a goodbye with EACCES, then the connection closes.
    let mut r = Raw::connect(server.addr);
    r.frame().expect("challenge");
    let mut out = Vec::new();
    encode_frame(&mut out, FrameKind::Request, 1, &root_req).unwrap();
    r.send(&out);
    let (kind, _, payload) = r.frame().expect("goodbye");
    assert_eq!(kind, FrameKind::Goodbye);
    assert_eq!(
        decode_payload::<FsError>(&payload).unwrap().errno,
        Errno::EACCES
    );
    assert!(r.frame().is_none(), "closed after the error");

    // A wrong key.
    let mut r = Raw::connect(server.addr);
    let (_, _, payload) = r.frame().unwrap();
    let ch: Challenge = decode_payload(&payload).unwrap();
    let mut out = Vec::new();
    encode_frame(
        &mut out,
        FrameKind::Auth,
        0,
        &Auth::prove(&auth::ClientKey::admin([0u8; 32]), ch.nonce, [7; 32], 1).0,
    )
    .unwrap();
    r.send(&out);
    let (kind, _, payload) = r.frame().expect("goodbye");
    assert_eq!(kind, FrameKind::Goodbye);
    assert_eq!(
        decode_payload::<FsError>(&payload).unwrap().errno,
        Errno::EACCES
    );
    assert!(r.frame().is_none());

    // The client library reports the refusal as EACCES.
    let err = runtime().block_on(async {
        let cfg = kochab_client::ClientConfig::new(server.addr, [1u8; 32]);
        kochab_client::Client::connect(cfg)
            .await
            .err()
            .expect("refused")
    });
    assert_eq!(err.errno, Errno::EACCES);

    // Garbage instead of a handshake.
    let mut r = Raw::connect(server.addr);
    r.frame().unwrap();
    r.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    while let Some((kind, _, _)) = r.frame() {
        assert_eq!(kind, FrameKind::Goodbye);
    }
    assert_serving(&mut server);
}

#[test]
fn malformed_frames_close_only_their_connection() {
    let seed = seed("malformed_frames_close_only_their_connection");
    let mut rng = Rng::new(seed);
    let tmp = tempfile::tempdir().unwrap();
    let mut server = ServerProc::start(&tmp.path().join("d"), &[]);
    // A bystander connection must keep working throughout.
    let mut bystander = Raw::authed(server.addr, &server.key);
    let root = 1u64 << 62;

    let mut cases: Vec<Vec<u8>> = Vec::new();
    // Oversized length.
    let mut big = ((MAX_FRAME_BYTES + 1) as u32).to_le_bytes().to_vec();
    big.extend_from_slice(&[4; 9]);
    cases.push(big);
    // Length smaller than a header.
    cases.push(vec![2, 0, 0, 0, 4, 0]);
    // Unknown kind.
    cases.push(vec![9, 0, 0, 0, 200, 1, 0, 0, 0, 0, 0, 0, 0]);
    // A reply frame sent to the server.
    let mut out = Vec::new();
    encode_frame(&mut out, FrameKind::Reply, 1, &Reply::Empty).unwrap();
    cases.push(out);
    // A request whose payload is cut short, with a consistent length.
    let mut out = Vec::new();
    encode_frame(
        &mut out,
        FrameKind::Request,
        1,
        &Request {
            cred: Credentials::root(),
            seq: 0,
            seq_floor: 0,
            map_version: 0,
            mode: Default::default(),
            op: Op::Lookup {
                parent: root,
                name: b"abc".to_vec(),
            },
        },
    )
    .unwrap();
    let cut = out.len() - 3;
    let mut short = out[..cut].to_vec();
    short[..4].copy_from_slice(&((cut - 4) as u32).to_le_bytes());
    cases.push(short);
    // Random payloads behind valid headers, and random bytes altogether.
    for _ in 0..150 {
        let len = rng.below(200) as usize;
        let mut f = ((len + 9) as u32).to_le_bytes().to_vec();
        f.push(FrameKind::Request as u8);
        f.extend_from_slice(&rng.next().to_le_bytes());
        f.extend(rng.bytes(len));
        cases.push(f);
        let mut junk = rng.bytes_below(300);
        junk.push(rng.next() as u8);
        cases.push(junk);
    }
    // How each connection ended: refused by the server (a Goodbye saying EPROTO, then
    // closed), or closed by the server only after the client's own half-close (input that
    // was a frame cut short, or whole frames answered).
    let mut refused = 0;
    let mut after_client_close = 0;
    let mut answered = 0;
    for (i, case) in cases.iter().enumerate() {
        let mut r = Raw::authed(server.addr, &server.key);
        r.send(case);
        // Then a truncated frame and a clean half-close.
        let _ = r.s.shutdown(std::net::Shutdown::Write);
        let mut goodbye = false;
        loop {
            match r.next() {
                Ok(None) if goodbye => {
                    refused += 1;
                    break;
                }
                Ok(None) => {
                    after_client_close += 1;
                    break;
                }
                Err(e) => panic!("case {i}: the server neither answered nor closed: {e}"),
                Ok(Some((FrameKind::Goodbye, _, p))) => {
                    assert_eq!(
                        decode_payload::<FsError>(&p).unwrap().errno,
                        Errno::EPROTO,
                        "case {i}"
                    );
                    goodbye = true;
                }
                Ok(Some((FrameKind::Reply, _, p))) => {
                    // Random bytes that happen to decode as a request get a real answer.
                    let _: Reply = decode_payload(&p).expect("decodable reply");
                    answered += 1;
                }
                Ok(Some(other)) => panic!("case {i}: unexpected {other:?}"),
            }
        }
        if i % 50 == 0 {
            assert!(matches!(
                bystander.call(
                    i as u64 + 1000,
                    Credentials::root(),
                    Op::GetAttr { id: root }
                ),
                Reply::Attr(_)
            ));
        }
    }
    eprintln!(
        "{} malformed inputs: {refused} refused by the server, {after_client_close} closed \
         after the client's half-close, {answered} accidental requests answered",
        cases.len()
    );
    // Most inputs are malformed frames (random payloads behind valid headers, random
    // bytes): the server itself must have refused them, not merely seen the client go.
    assert!(
        refused >= cases.len() / 2,
        "only {refused} of {} malformed inputs refused by the server",
        cases.len()
    );
    assert_serving(&mut server);
    assert!(matches!(
        bystander.call(1, Credentials::root(), Op::GetAttr { id: root }),
        Reply::Attr(_)
    ));
}

#[test]
fn absurd_requests_get_errnos() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = ServerProc::start(&tmp.path().join("d"), &[]);
    let mut r = Raw::authed(server.addr, &server.key);
    let root = 1u64 << 62;
    let cred = Credentials::root;
    let dir = match r.call(
        1,
        cred(),
        Op::Mkdir {
            parent: root,
            name: b"d".to_vec(),
            mode: 0o755,
        },
    ) {
        Reply::Entry(a) => a.id,
        other => panic!("{other:?}"),
    };
    let sub = match r.call(
        2,
        cred(),
        Op::Mkdir {
            parent: dir,
            name: b"sub".to_vec(),
            mode: 0o755,
        },
    ) {
        Reply::Entry(a) => a.id,
        other => panic!("{other:?}"),
    };
    let file = match r.call(
        3,
        cred(),
        Op::Mknod {
            parent: dir,
            name: b"f".to_vec(),
            mode: 0o100644,
            rdev: 0,
            exclusive: true,
        },
    ) {
        Reply::Entry(a) => a.id,
        other => panic!("{other:?}"),
    };
    let long = vec![b'x'; 256];
    let huge = vec![b'y'; 100_000];
    let mknod = |parent: u64, name: &[u8], mode: u32| Op::Mknod {
        parent,
        name: name.to_vec(),
        mode,
        rdev: 0,
        exclusive: true,
    };
    let cases: Vec<(Op, Credentials, Errno)> = vec![
        (mknod(dir, &long, 0o100644), cred(), Errno::ENAMETOOLONG),
        (mknod(dir, &huge, 0o100644), cred(), Errno::ENAMETOOLONG),
        (mknod(dir, b"a\0b", 0o100644), cred(), Errno::EINVAL),
        (mknod(dir, b"a/b", 0o100644), cred(), Errno::EINVAL),
        (mknod(dir, b"", 0o100644), cred(), Errno::ENOENT),
        (mknod(dir, b"bad", 0o170000), cred(), Errno::EINVAL),
        (
            mknod(dir, b"dev", 0o020644),
            Credentials::user(1000, 1000),
            Errno::EACCES,
        ),
        (mknod(0xdead_beef, b"x", 0o100644), cred(), Errno::ENOENT),
        (mknod(u64::MAX - 1, b"x", 0o100644), cred(), Errno::ENOENT),
        (mknod(file, b"x", 0o100644), cred(), Errno::ENOTDIR),
        (Op::GetAttr { id: 0 }, cred(), Errno::ENOENT),
        (Op::GetAttr { id: 12345 }, cred(), Errno::ENOENT),
        (
            Op::Lookup {
                parent: dir,
                name: long.clone(),
            },
            cred(),
            Errno::ENAMETOOLONG,
        ),
        (
            Op::Lookup {
                parent: dir,
                name: b"missing".to_vec(),
            },
            cred(),
            Errno::ENOENT,
        ),
        (
            Op::Rename {
                parent: root,
                name: b"d".to_vec(),
                new_parent: sub,
                new_name: b"d".to_vec(),
                flags: 0,
            },
            cred(),
            Errno::EINVAL,
        ),
        (
            Op::Rename {
                parent: root,
                name: b"d".to_vec(),
                new_parent: dir,
                new_name: b"inside".to_vec(),
                flags: 0,
            },
            cred(),
            Errno::EINVAL,
        ),
        (
            Op::Rename {
                parent: dir,
                name: b"f".to_vec(),
                new_parent: dir,
                new_name: b"g".to_vec(),
                flags: 3,
            },
            cred(),
            Errno::EINVAL,
        ),
        (
            Op::Rename {
                parent: dir,
                name: b"f".to_vec(),
                new_parent: dir,
                new_name: b"g".to_vec(),
                flags: 0xff00,
            },
            cred(),
            Errno::EINVAL,
        ),
        (
            Op::Rmdir {
                parent: root,
                name: b"d".to_vec(),
            },
            cred(),
            Errno::ENOTEMPTY,
        ),
        (
            Op::Rmdir {
                parent: dir,
                name: b"f".to_vec(),
            },
            cred(),
            Errno::ENOTDIR,
        ),
        (
            Op::Unlink {
                parent: root,
                name: b"d".to_vec(),
            },
            cred(),
            Errno::EISDIR,
        ),
        (
            Op::Link {
                id: dir,
                new_parent: root,
                new_name: b"l".to_vec(),
            },
            cred(),
            Errno::EPERM,
        ),
        (
            Op::Symlink {
                parent: dir,
                name: b"s".to_vec(),
                target: vec![b'z'; 5000],
            },
            cred(),
            Errno::ENAMETOOLONG,
        ),
        (
            Op::Symlink {
                parent: dir,
                name: b"s".to_vec(),
                target: Vec::new(),
            },
            cred(),
            Errno::ENOENT,
        ),
        (Op::Readlink { id: file }, cred(), Errno::EINVAL),
        (
            Op::Readdir {
                id: file,
                cookie: 0,
                max_entries: 10,
                plus: false,
            },
            cred(),
            Errno::ENOTDIR,
        ),
        (
            Op::SetXattr {
                id: file,
                name: b"user.big".to_vec(),
                value: huge.clone(),
                flags: 0,
            },
            cred(),
            Errno::E2BIG,
        ),
        (
            Op::SetXattr {
                id: file,
                name: long.clone(),
                value: b"v".to_vec(),
                flags: 0,
            },
            cred(),
            Errno::ERANGE,
        ),
        (
            Op::SetXattr {
                id: file,
                name: b"user.x".to_vec(),
                value: b"v".to_vec(),
                flags: 77,
            },
            cred(),
            Errno::EINVAL,
        ),
        (
            Op::GetXattr {
                id: file,
                name: b"user.none".to_vec(),
            },
            cred(),
            Errno::ENODATA,
        ),
        (
            Op::SetAttr {
                id: dir,
                set: SetAttrs {
                    size: Some(1),
                    ..Default::default()
                },
            },
            cred(),
            Errno::EISDIR,
        ),
        (
            Op::SetAttr {
                id: file,
                set: SetAttrs {
                    size: Some(u64::MAX),
                    ..Default::default()
                },
            },
            cred(),
            Errno::EFBIG,
        ),
        (
            Op::Access {
                id: file,
                mask: 0x1000,
            },
            cred(),
            Errno::EINVAL,
        ),
        (
            Op::GetAttr { id: root },
            Credentials {
                uid: 5,
                gid: 5,
                groups: vec![1; 10_000],
            },
            Errno::EINVAL,
        ),
        (Op::Fsck, Credentials::user(1000, 1000), Errno::EPERM),
        (
            Op::FsckLinks {
                after: kochab_proto::links::LinksCursor::Start,
            },
            Credentials::user(1000, 1000),
            Errno::EPERM,
        ),
        (
            Op::FsckInodes { ids: vec![root] },
            Credentials::user(1000, 1000),
            Errno::EPERM,
        ),
        (
            Op::FsckInodes {
                ids: vec![root; kochab_proto::links::FSCK_IDS_MAX + 1],
            },
            Credentials::root(),
            Errno::EINVAL,
        ),
    ];
    for (i, (op, c, want)) in cases.into_iter().enumerate() {
        let reply = r.call(100 + i as u64, c, op.clone());
        assert_eq!(errno_of(&reply), Some(want), "{op:?} -> {reply:?}");
    }
    // Readdir with silly bounds still answers.
    for max in [0u32, 1, u32::MAX] {
        match r.call(
            500 + max as u64 % 7,
            cred(),
            Op::Readdir {
                id: dir,
                cookie: u64::MAX,
                max_entries: max,
                plus: true,
            },
        ) {
            Reply::Dir { .. } => {}
            other => panic!("readdir max {max}: {other:?}"),
        }
    }
    assert_serving(&mut server);
    let problems = runtime().block_on(async { server.client(1).await.fsck().await.expect("fsck") });
    assert!(problems.is_empty(), "{problems:?}");
}

#[test]
fn random_requests_never_hurt_the_server() {
    let seed = seed("random_requests_never_hurt_the_server");
    let mut rng = Rng::new(seed);
    let tmp = tempfile::tempdir().unwrap();
    let mut server = ServerProc::start(&tmp.path().join("d"), &[]);
    let mut r = Raw::authed(server.addr, &server.key);
    let root = 1u64 << 62;
    let mut ids = vec![root, 0, 1, u64::MAX, 1 << 63];
    let names: Vec<Vec<u8>> = vec![
        b"a".to_vec(),
        b"b".to_vec(),
        b".".to_vec(),
        b"..".to_vec(),
        vec![b'n'; 255],
        vec![b'n'; 256],
        b"x/y".to_vec(),
        vec![0, 1, 2],
        Vec::new(),
    ];
    for i in 0..3000u64 {
        let id = ids[rng.below(ids.len() as u64) as usize];
        let id2 = ids[rng.below(ids.len() as u64) as usize];
        let name = if rng.below(4) == 0 {
            rng.bytes_below(300)
        } else {
            names[rng.below(names.len() as u64) as usize].clone()
        };
        let name2 = names[rng.below(names.len() as u64) as usize].clone();
        let mode = [
            0o100644u32,
            0o040755,
            0o010600,
            0o140600,
            0o020600,
            0,
            rng.next() as u32,
        ][rng.below(7) as usize];
        let op = match rng.below(16) {
            0 => Op::Lookup { parent: id, name },
            1 => Op::GetAttr { id },
            2 => Op::SetAttr {
                id,
                set: SetAttrs {
                    mode: Some(rng.next() as u32),
                    size: (rng.below(2) == 0).then(|| rng.below(1 << 40)),
                    atime: Some(TimeSet::At(rng.next() as i64)),
                    ..Default::default()
                },
            },
            3 => Op::Mknod {
                parent: id,
                name,
                mode,
                rdev: rng.next() as u32,
                exclusive: rng.below(2) == 0,
            },
            4 => Op::Mkdir {
                parent: id,
                name,
                mode: rng.next() as u32,
            },
            5 => Op::Symlink {
                parent: id,
                name,
                target: rng.bytes_below(100),
            },
            6 => Op::Link {
                id,
                new_parent: id2,
                new_name: name,
            },
            7 => Op::Unlink { parent: id, name },
            8 => Op::Rmdir { parent: id, name },
            9 => Op::Rename {
                parent: id,
                name,
                new_parent: id2,
                new_name: name2,
                flags: [0, 1, 2, 3, 4][rng.below(5) as usize],
            },
            10 => Op::Readlink { id },
            11 => Op::Readdir {
                id,
                cookie: rng.next(),
                max_entries: rng.next() as u32,
                plus: rng.below(2) == 0,
            },
            12 => Op::SetXattr {
                id,
                name: [b"user.".to_vec(), name].concat(),
                value: rng.bytes_below(70_000),
                flags: rng.below(4) as u32,
            },
            13 => Op::GetXattr { id, name },
            14 => Op::RemoveXattr { id, name },
            _ => Op::Access {
                id,
                mask: rng.below(16) as u32,
            },
        };
        let cred = if rng.below(3) == 0 {
            Credentials::user(rng.below(3) as u32 + 1000, 1000)
        } else {
            Credentials::root()
        };
        match r.call(i + 1, cred, op) {
            Reply::Entry(a) => ids.push(a.id),
            Reply::Error(e) => assert!(
                e.errno.0 > 0 && e.errno.name() != "E?",
                "unnamed errno {:?}",
                e
            ),
            _ => {}
        }
    }
    assert_serving(&mut server);
    let problems = runtime().block_on(async { server.client(1).await.fsck().await.expect("fsck") });
    assert!(problems.is_empty(), "seed {seed}: {problems:?}");
}

/// As fcntl(2) on Linux: a record write lock needs a handle open for writing and a read
/// lock one open for reading (EBADF); flock locks any handle. The kernel checks this for
/// the mount; the server checks it for every client.
#[test]
fn record_locks_need_a_handle_open_for_their_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let server = ServerProc::start(&tmp.path().join("d"), &[]);
    runtime().block_on(async {
        let c = server.client(3).await;
        let cred = Credentials::root();
        let (a, w) = c
            .create_open(&cred, c.root(), b"f", 0o644, libc::O_WRONLY as u32)
            .await
            .unwrap();
        let (_, r) = c.open(&cred, a.id, libc::O_RDONLY as u32).await.unwrap();
        let lock = |owner, kind, flock| LockSpec {
            owner,
            start: 0,
            end: u64::MAX,
            kind,
            pid: 1,
            flock,
        };
        let errno = |r: FsResult<()>| r.err().map(|e| e.errno);
        assert_eq!(
            errno(c.setlk(&cred, r, lock(1, LockKind::Write, false)).await),
            Some(Errno::EBADF),
            "write lock through a read-only handle"
        );
        assert_eq!(
            errno(c.setlk(&cred, w, lock(2, LockKind::Read, false)).await),
            Some(Errno::EBADF),
            "read lock through a write-only handle"
        );
        assert_eq!(
            errno(c.setlk(&cred, r, lock(1, LockKind::Read, false)).await),
            None
        );
        assert_eq!(
            errno(c.setlk(&cred, w, lock(2, LockKind::Unlock, false)).await),
            None
        );
        assert_eq!(
            errno(c.setlk(&cred, r, lock(3, LockKind::Write, true)).await),
            None,
            "flock locks any handle"
        );
    });
}

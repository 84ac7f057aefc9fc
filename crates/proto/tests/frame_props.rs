//! Property tests of the frame codec and the message decoders: whatever bytes a peer sends,
//! decoding never panics and either yields a frame/message or an error; every message a
//! peer can build survives encode/decode unchanged, whole or fed in arbitrary pieces.
//!
//! Case counts are set per test (see `cases`) so the file runs in a few seconds in CI;
//! `PROPTEST_CASES=N` runs N cases of every test instead (docs/TESTING.md).

use bytes::BytesMut;
use kochab_proto::cluster::*;
use kochab_proto::codec::FrameCodec;
use kochab_proto::frame::{
    FRAME_HEADER_BYTES, MAX_FRAME_BYTES, decode_payload, encode_frame, parse_header,
};
use kochab_proto::layout::*;
use kochab_proto::*;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use tokio_util::codec::Decoder;

/// `default` cases, or what PROPTEST_CASES says.
fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases: n,
        ..ProptestConfig::default()
    }
}

// ---- strategies for every message type ---------------------------------------------------

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..=max)
}

fn cred() -> impl Strategy<Value = Credentials> {
    (any::<u32>(), any::<u32>(), vec(any::<u32>(), 0..4))
        .prop_map(|(uid, gid, groups)| Credentials { uid, gid, groups })
}

fn time_set() -> impl Strategy<Value = TimeSet> {
    prop_oneof![Just(TimeSet::Now), any::<i64>().prop_map(TimeSet::At)]
}

fn set_attrs() -> impl Strategy<Value = SetAttrs> {
    (
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u64>()),
        proptest::option::of(time_set()),
        proptest::option::of(time_set()),
        proptest::option::of(any::<i64>()),
    )
        .prop_map(|(mode, uid, gid, size, atime, mtime, ctime)| SetAttrs {
            mode,
            uid,
            gid,
            size,
            atime,
            mtime,
            ctime,
        })
}

fn lock_spec() -> impl Strategy<Value = LockSpec> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        prop_oneof![
            Just(LockKind::Read),
            Just(LockKind::Write),
            Just(LockKind::Unlock)
        ],
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(|(owner, start, end, kind, pid, flock)| LockSpec {
            owner,
            start,
            end,
            kind,
            pid,
            flock,
        })
}

fn atime_rule() -> impl Strategy<Value = AtimeRule> {
    prop_oneof![
        Just(AtimeRule::Never),
        Just(AtimeRule::Relative),
        Just(AtimeRule::Always)
    ]
}

fn id_range() -> impl Strategy<Value = IdRange> {
    (any::<u32>(), any::<u32>()).prop_map(|(lo, hi)| IdRange { lo, hi })
}

fn key_policy() -> impl Strategy<Value = KeyPolicy> {
    (
        prop_oneof![Just(Squash::None), Just(Squash::Root), Just(Squash::All)],
        any::<u32>(),
        any::<u32>(),
        proptest::option::of(id_range()),
        proptest::option::of(id_range()),
    )
        .prop_map(|(squash, anon_uid, anon_gid, uids, gids)| KeyPolicy {
            squash,
            anon_uid,
            anon_gid,
            uids,
            gids,
        })
}

fn key_info() -> impl Strategy<Value = KeyInfo> {
    (any::<u32>(), key_policy(), any::<bool>(), ".{0,40}").prop_map(
        |(id, policy, revoked, note)| KeyInfo {
            id,
            policy,
            revoked,
            note,
        },
    )
}

/// Every `Op` variant, with field values over their whole ranges.
fn op() -> impl Strategy<Value = Op> {
    let id = any::<u64>;
    let name = || bytes(300);
    prop_oneof![
        (id(), name()).prop_map(|(parent, name)| Op::Lookup { parent, name }),
        id().prop_map(|id| Op::GetAttr { id }),
        (id(), set_attrs()).prop_map(|(id, set)| Op::SetAttr { id, set }),
        (id(), name(), any::<u32>(), any::<u32>(), any::<bool>()).prop_map(
            |(parent, name, mode, rdev, exclusive)| Op::Mknod {
                parent,
                name,
                mode,
                rdev,
                exclusive
            }
        ),
        (id(), name(), any::<u32>()).prop_map(|(parent, name, mode)| Op::Mkdir {
            parent,
            name,
            mode
        }),
        (id(), name(), bytes(100)).prop_map(|(parent, name, target)| Op::Symlink {
            parent,
            name,
            target
        }),
        (id(), id(), name()).prop_map(|(id, new_parent, new_name)| Op::Link {
            id,
            new_parent,
            new_name
        }),
        (id(), name()).prop_map(|(parent, name)| Op::Unlink { parent, name }),
        (id(), name()).prop_map(|(parent, name)| Op::Rmdir { parent, name }),
        (id(), name(), id(), name(), any::<u32>()).prop_map(
            |(parent, name, new_parent, new_name, flags)| Op::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags
            }
        ),
        id().prop_map(|id| Op::Readlink { id }),
        (id(), any::<u64>(), any::<u32>(), any::<bool>()).prop_map(
            |(id, cookie, max_entries, plus)| Op::Readdir {
                id,
                cookie,
                max_entries,
                plus
            }
        ),
        (id(), name(), bytes(200), any::<u32>()).prop_map(|(id, name, value, flags)| {
            Op::SetXattr {
                id,
                name,
                value,
                flags,
            }
        }),
        (id(), name()).prop_map(|(id, name)| Op::GetXattr { id, name }),
        id().prop_map(|id| Op::ListXattr { id }),
        (id(), name()).prop_map(|(id, name)| Op::RemoveXattr { id, name }),
        (id(), any::<u32>()).prop_map(|(id, mask)| Op::Access { id, mask }),
        Just(Op::StatFs),
        Just(Op::Status),
        Just(Op::Fsck),
        (id(), any::<u32>(), any::<u64>()).prop_map(|(id, flags, handle)| Op::Open {
            id,
            flags,
            handle
        }),
        (id(), name(), any::<u32>(), any::<u32>(), any::<u64>()).prop_map(
            |(parent, name, mode, flags, handle)| Op::Create {
                parent,
                name,
                mode,
                flags,
                handle
            }
        ),
        any::<u64>().prop_map(|handle| Op::Close { handle }),
        (any::<u64>(), any::<u64>(), any::<u32>(), atime_rule()).prop_map(
            |(handle, offset, len, atime)| Op::Read {
                handle,
                offset,
                len,
                atime
            }
        ),
        (any::<u64>(), any::<u64>(), bytes(600)).prop_map(|(handle, offset, data)| {
            Op::Write {
                handle,
                offset,
                data,
            }
        }),
        (any::<u64>(), any::<bool>()).prop_map(|(handle, datasync)| Op::Fsync { handle, datasync }),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>()).prop_map(
            |(handle, offset, len, mode)| Op::Fallocate {
                handle,
                offset,
                len,
                mode
            }
        ),
        (any::<u64>(), lock_spec()).prop_map(|(handle, lock)| Op::GetLk { handle, lock }),
        (any::<u64>(), lock_spec()).prop_map(|(handle, lock)| Op::SetLk { handle, lock }),
        (any::<u64>(), any::<u64>()).prop_map(|(handle, owner)| Op::ReleaseLocks { handle, owner }),
        Just(Op::EndSession),
        (key_policy(), ".{0,40}").prop_map(|(policy, note)| Op::KeyAdd { policy, note }),
        Just(Op::KeyList),
        any::<u32>().prop_map(|id| Op::KeyRevoke { id }),
        Just(Op::GetMap),
        control().prop_map(|control| Op::Control { control }),
        proptest::collection::vec(any::<u64>(), 0..40)
            .prop_map(|handles| Op::CloseMany { handles }),
        (any::<u64>(), any::<u32>())
            .prop_map(|(handle, objects)| Op::DataGrant { handle, objects }),
        (any::<u64>(), vec(committed_slice(), 0..4), any::<u64>()).prop_map(
            |(handle, slices, end)| Op::CommitSlices {
                handle,
                slices,
                end
            }
        ),
        (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(handle, first_chunk, chunks)| {
            Op::Layout {
                handle,
                first_chunk,
                chunks,
            }
        }),
        links_cursor().prop_map(|after| Op::FsckLinks { after }),
        vec(any::<u64>(), 0..8).prop_map(|ids| Op::FsckInodes { ids }),
    ]
}

fn links_cursor() -> impl Strategy<Value = kochab_proto::links::LinksCursor> {
    use kochab_proto::links::LinksCursor;
    prop_oneof![
        Just(LinksCursor::Start),
        (any::<u64>(), any::<u64>()).prop_map(|(dir, cookie)| LinksCursor::Entries { dir, cookie }),
        any::<u64>().prop_map(|from| LinksCursor::Inodes { from }),
    ]
}

fn inode_links() -> impl Strategy<Value = kochab_proto::links::InodeLinks> {
    (
        any::<u64>(),
        file_kind(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
    )
        .prop_map(
            |(id, kind, nlink, names, parent)| kochab_proto::links::InodeLinks {
                id,
                kind,
                nlink,
                names,
                parent,
            },
        )
}

fn links_page() -> impl Strategy<Value = kochab_proto::links::LinksPage> {
    use kochab_proto::links::{CrossEntry, LinksPage, Up};
    let up = prop_oneof![
        Just(Up::Root),
        any::<u64>().prop_map(Up::Via),
        Just(Up::Broken),
    ];
    let entry = (
        any::<u64>(),
        any::<u64>(),
        bytes(255),
        any::<u64>(),
        file_kind(),
        proptest::option::of(up),
    )
        .prop_map(|(dir, cookie, name, child, kind, up)| CrossEntry {
            dir,
            cookie,
            name,
            child,
            kind,
            up,
        });
    (
        vec(entry, 0..4),
        vec(inode_links(), 0..4),
        proptest::option::of(links_cursor()),
    )
        .prop_map(|(entries, inodes, next)| LinksPage {
            entries,
            inodes,
            next,
        })
}

fn slice_ref() -> impl Strategy<Value = SliceRef> {
    (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(object, pos, len)| SliceRef {
        object,
        pos,
        len,
    })
}

fn committed_slice() -> impl Strategy<Value = CommittedSlice> {
    (any::<u64>(), slice_ref(), bytes(20), any::<u64>()).prop_map(|(chunk, r, token, expires)| {
        CommittedSlice {
            chunk,
            r,
            token,
            expires,
        }
    })
}

fn grant() -> impl Strategy<Value = Grant> {
    let object =
        (any::<u64>(), ".{0,40}", bytes(20)).prop_map(|(object, put_url, token)| GrantedObject {
            object,
            put_url,
            token,
        });
    (any::<u64>(), any::<u64>(), vec(object, 0..3), any::<u64>()).prop_map(
        |(id, generation, objects, expires)| Grant {
            id,
            generation,
            objects,
            expires,
        },
    )
}

fn layout() -> impl Strategy<Value = Layout> {
    let chunk = (any::<u64>(), vec(slice_ref(), 0..3), vec(".{0,30}", 0..3)).prop_map(
        |(chunk, refs, get_urls)| ChunkLayout {
            chunk,
            refs,
            get_urls,
        },
    );
    (
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        vec(chunk, 0..3),
        any::<u64>(),
    )
        .prop_map(|(id, generation, size, chunks, expires)| Layout {
            id,
            generation,
            size,
            chunks,
            expires,
        })
}

fn incarnation() -> impl Strategy<Value = Incarnation> {
    (any::<u32>(), any::<u64>()).prop_map(|(s, e)| Incarnation {
        server: ServerId(s),
        epoch: Epoch(e),
    })
}

fn control() -> impl Strategy<Value = Control> {
    let body = prop_oneof![
        (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(t, v, to)| ControlBody::Drop {
            table: TableId(t),
            map_version: MapVersion(v),
            to: ServerId(to),
        }),
        (
            vec(any::<u64>(), 0..4),
            any::<u64>(),
            vec(incarnation(), 0..3)
        )
            .prop_map(|(tables, v, epochs)| ControlBody::Add {
                tables: tables.into_iter().map(TableId).collect(),
                map_version: MapVersion(v),
                epochs,
            }),
        (incarnation(), any::<u64>()).prop_map(|(i, seq)| ControlBody::Grant {
            id: BorrowId {
                server: i.server,
                epoch: i.epoch,
                seq,
            },
        }),
        (any::<u32>(), vec(any::<u8>(), 0..64)).prop_map(|(from, msg)| ControlBody::Txn {
            from: ServerId(from),
            msg,
        }),
    ];
    (incarnation(), body).prop_map(|(to, body)| Control { to, body })
}

fn control_reply() -> impl Strategy<Value = ControlReply> {
    prop_oneof![
        (any::<u64>(), incarnation(), any::<u64>()).prop_map(|(t, by, v)| {
            ControlReply::Dropped {
                table: TableId(t),
                by,
                map_version: MapVersion(v),
            }
        }),
        (vec(any::<u64>(), 0..4), incarnation(), ".{0,20}").prop_map(|(t, by, reason)| {
            ControlReply::AddFailed {
                tables: t.into_iter().map(TableId).collect(),
                by,
                reason,
            }
        }),
    ]
}

fn delegation_map() -> impl Strategy<Value = DelegationMap> {
    (
        any::<u64>(),
        vec(
            (any::<u64>(), any::<u64>(), any::<u32>(), any::<u64>()),
            0..5,
        ),
        vec((any::<u32>(), "[a-z0-9.:]{0,20}"), 0..4),
    )
        .prop_map(|(v, tables, servers)| DelegationMap {
            version: MapVersion(v),
            tables: tables
                .into_iter()
                .map(|(lo, hi, o, e)| {
                    (
                        TableId(lo),
                        Placement {
                            hi,
                            owner: ServerId(o),
                            epoch: Epoch(e),
                        },
                    )
                })
                .collect(),
            servers: servers.into_iter().map(|(s, a)| (ServerId(s), a)).collect(),
        })
}

fn reply_mode() -> impl Strategy<Value = ReplyMode> {
    prop_oneof![
        Just(ReplyMode::Durable),
        Just(ReplyMode::Early),
        (any::<u64>(), any::<[u8; 16]>())
            .prop_map(|(want_id, tag)| ReplyMode::Replay { want_id, tag }),
    ]
}

fn request() -> impl Strategy<Value = Request> {
    (
        cred(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        reply_mode(),
        op(),
    )
        .prop_map(|(cred, seq, seq_floor, map_version, mode, op)| Request {
            cred,
            seq,
            seq_floor,
            map_version,
            mode,
            op,
        })
}

fn attr() -> impl Strategy<Value = Attr> {
    (
        (any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>()),
        (any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>()),
        (any::<i64>(), any::<i64>(), any::<i64>(), any::<i64>()),
        (any::<u32>(), any::<u32>()),
    )
        .prop_map(
            |(
                (id, generation, mode, nlink),
                (uid, gid, size, blocks),
                (atime, mtime, ctime, btime),
                (rdev, blksize),
            )| Attr {
                id,
                generation,
                mode,
                nlink,
                uid,
                gid,
                size,
                blocks,
                atime,
                mtime,
                ctime,
                btime,
                rdev,
                blksize,
            },
        )
}

fn file_kind() -> impl Strategy<Value = FileKind> {
    (1u8..=7).prop_map(|c| FileKind::from_code(c).unwrap_or(FileKind::File))
}

fn dir_entry() -> impl Strategy<Value = DirEntry> {
    (
        any::<u64>(),
        bytes(40),
        any::<u64>(),
        file_kind(),
        proptest::option::of(attr()),
    )
        .prop_map(|(cookie, name, id, kind, attr)| DirEntry {
            cookie,
            name,
            id,
            kind,
            attr,
        })
}

fn fs_error() -> impl Strategy<Value = FsError> {
    (any::<i32>(), ".{0,40}").prop_map(|(e, message)| FsError {
        errno: Errno(e),
        message,
    })
}

fn stat_fs() -> impl Strategy<Value = StatFs> {
    (
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
        (any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>()),
    )
        .prop_map(
            |((blocks, bfree, bavail, files), (ffree, bsize, namelen, frsize))| StatFs {
                blocks,
                bfree,
                bavail,
                files,
                ffree,
                bsize,
                namelen,
                frsize,
            },
        )
}

fn table_status() -> impl Strategy<Value = TableStatus> {
    (
        any::<u64>(),
        any::<u64>(),
        ".{0,20}",
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(lo, hi, region, inodes, dentries, checkpoint_lsn)| TableStatus {
                lo,
                hi,
                region,
                inodes,
                dentries,
                checkpoint_lsn,
            },
        )
}

fn status_report() -> impl Strategy<Value = StatusReport> {
    (
        (any::<u64>(), any::<u64>(), vec(table_status(), 0..3)),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
        (
            any::<bool>(),
            any::<u32>(),
            any::<u64>(),
            vec("[a-z0-9.:]{0,20}", 0..3),
        ),
    )
        .prop_map(
            |(
                (server_id, uptime_ms, tables),
                (inodes, dentries, journal_bytes, journal_segments),
                (applied_lsn, durable_lsn, rss_bytes, connections),
                (durable_mode, pid, epoch, coordinators),
            )| StatusReport {
                server_id,
                pid,
                epoch,
                coordinators,
                uptime_ms,
                tables,
                inodes,
                dentries,
                journal_bytes,
                journal_segments,
                applied_lsn,
                durable_lsn,
                rss_bytes,
                connections,
                durable_mode,
                store: format!("s3://b/p{epoch}"),
                slices: SliceCounters {
                    freed_deleted: rss_bytes,
                    orphans_deleted: connections,
                    chunks_compacted: journal_bytes,
                    gc_passes: uptime_ms,
                },
            },
        )
}

/// Every `Reply` variant, nested replies included.
fn reply() -> impl Strategy<Value = Reply> {
    let leaf = prop_oneof![
        attr().prop_map(Reply::Entry),
        attr().prop_map(Reply::Attr),
        Just(Reply::Empty),
        bytes(600).prop_map(Reply::Bytes),
        (vec(dir_entry(), 0..6), any::<bool>())
            .prop_map(|(entries, eof)| Reply::Dir { entries, eof }),
        vec(".{0,20}", 0..4).prop_map(Reply::Problems),
        lock_spec().prop_map(Reply::Lock),
        fs_error().prop_map(Reply::Error),
        (
            any::<u64>(),
            proptest::option::of(any::<u32>()),
            proptest::option::of("[a-z0-9.:]{0,20}")
        )
            .prop_map(|(map_version, owner, addr)| Reply::WrongServer {
                map_version,
                owner: owner.map(ServerId),
                addr
            }),
        bytes(100).prop_map(Reply::ReadAtime),
        (any::<u32>(), any::<[u8; 32]>()).prop_map(|(id, key)| Reply::KeyAdded { id, key }),
        vec(key_info(), 0..4).prop_map(Reply::Keys),
        stat_fs().prop_map(Reply::StatFs),
        status_report().prop_map(Reply::Status),
        any::<u64>().prop_map(|id| Reply::Child { id }),
        delegation_map().prop_map(Reply::Map),
        proptest::option::of(control_reply()).prop_map(Reply::Control),
        grant().prop_map(Reply::Grant),
        layout().prop_map(Reply::Layout),
        links_page().prop_map(Reply::Links),
        vec(inode_links(), 0..4).prop_map(Reply::InodeLinks),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        (inner, vec(attr(), 0..3)).prop_map(|(r, dirs)| Reply::WithDirs {
            reply: Box::new(r),
            dirs,
        })
    })
}

fn kind() -> impl Strategy<Value = FrameKind> {
    prop_oneof![
        Just(FrameKind::Challenge),
        Just(FrameKind::Auth),
        Just(FrameKind::Welcome),
        Just(FrameKind::Request),
        Just(FrameKind::Reply),
        Just(FrameKind::Goodbye),
        Just(FrameKind::Unsafe),
        Just(FrameKind::Durable),
        Just(FrameKind::Callback),
        Just(FrameKind::CallbackDone),
    ]
}

// ---- helpers -------------------------------------------------------------------------------

/// What a reader does with the payload of a frame of each kind: decode it as the message
/// that kind carries. Only whether it decodes matters here; it must never panic.
fn decode_any(kind: FrameKind, payload: &[u8]) -> bool {
    match kind {
        FrameKind::Challenge => decode_payload::<Challenge>(payload).is_ok(),
        FrameKind::Auth => decode_payload::<Auth>(payload).is_ok(),
        FrameKind::Welcome => decode_payload::<Welcome>(payload).is_ok(),
        FrameKind::Request => decode_payload::<Request>(payload).is_ok(),
        FrameKind::Reply => decode_payload::<Reply>(payload).is_ok(),
        FrameKind::Goodbye => decode_payload::<FsError>(payload).is_ok(),
        FrameKind::Unsafe => {
            decode_payload::<(u64, kochab_proto::auth::ReplayTag, Reply)>(payload).is_ok()
        }
        FrameKind::Durable => decode_payload::<u64>(payload).is_ok(),
        FrameKind::Callback => decode_payload::<Vec<Invalidation>>(payload).is_ok(),
        FrameKind::CallbackDone => decode_payload::<()>(payload).is_ok(),
    }
}

/// Splits a byte stream into frames the way a connection's reader does (the codec over a
/// buffer that grows as bytes arrive), with the stream delivered in pieces of the given
/// sizes. Returns the frames found and whether a frame was refused.
fn read_stream(stream: &[u8], pieces: &[usize]) -> (Vec<(FrameKind, u64, Vec<u8>)>, bool) {
    let mut codec = FrameCodec::authenticated(MAX_FRAME_BYTES);
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut at = 0;
    let mut sizes = pieces.iter().copied().cycle();
    while at < stream.len() {
        let n = sizes.next().unwrap_or(1).max(1).min(stream.len() - at);
        buf.extend_from_slice(&stream[at..at + n]);
        at += n;
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(f)) => frames.push((f.kind, f.request_id, f.payload.to_vec())),
                Ok(None) => break,
                Err(_) => return (frames, true),
            }
        }
    }
    (frames, false)
}

// ---- properties ------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cases(2000))]

    /// Any bytes: the header parser answers without panicking, and an answer of a
    /// complete frame is consistent with the buffer; the payload decoders never panic.
    #[test]
    fn arbitrary_bytes_never_panic(buf in bytes(64)) {
        match parse_header(&buf) {
            Ok(Some(h)) => {
                prop_assert!(h.total_len >= FRAME_HEADER_BYTES);
                prop_assert!(h.total_len <= buf.len());
                prop_assert!(h.total_len - 4 <= MAX_FRAME_BYTES);
                decode_any(h.kind, &buf[FRAME_HEADER_BYTES..h.total_len]);
            }
            Ok(None) => prop_assert!(buf.len() < FRAME_HEADER_BYTES
                || buf.len() < 4 + u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize),
            Err(_) => {}
        }
        for k in [FrameKind::Challenge, FrameKind::Auth, FrameKind::Welcome,
                  FrameKind::Request, FrameKind::Reply, FrameKind::Goodbye,
                  FrameKind::Unsafe, FrameKind::Durable] {
            decode_any(k, &buf);
        }
    }

    /// Any length field and kind byte: too large and too short are errors, an unknown kind
    /// is an error, and otherwise the parser waits for exactly the announced length.
    #[test]
    fn length_fields_are_checked(len in any::<u32>(), k in any::<u8>(), id in any::<u64>(),
                                 have in 0usize..64) {
        let mut buf = len.to_le_bytes().to_vec();
        buf.push(k);
        buf.extend_from_slice(&id.to_le_bytes());
        buf.resize(buf.len() + have, 0xa5);
        let len = len as usize;
        match parse_header(&buf) {
            Err(FrameError::TooLarge(n)) => prop_assert!(n == len && len > MAX_FRAME_BYTES),
            Err(FrameError::TooShort(n)) => prop_assert!(n == len && len < FRAME_HEADER_BYTES - 4),
            Err(FrameError::UnknownKind(b)) => prop_assert!(b == k && !(1..=8).contains(&k)),
            Err(FrameError::Payload(_)) => prop_assert!(false, "the header parser decodes no payload"),
            Ok(None) => prop_assert!(buf.len() < 4 + len && len <= MAX_FRAME_BYTES),
            Ok(Some(h)) => {
                prop_assert_eq!(h.total_len, 4 + len);
                prop_assert_eq!(h.request_id, id);
                prop_assert_eq!(h.kind as u8, k);
            }
        }
    }

    /// Every request round-trips through a frame, and every prefix of the frame asks for
    /// more bytes (never an error, never a frame).
    #[test]
    fn requests_round_trip(req in request(), id in any::<u64>()) {
        let mut buf = Vec::new();
        encode_frame(&mut buf, FrameKind::Request, id, &req).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let h = parse_header(&buf).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let h = h.ok_or_else(|| TestCaseError::fail("complete frame not found"))?;
        prop_assert_eq!(h.total_len, buf.len());
        prop_assert_eq!(h.request_id, id);
        prop_assert_eq!(h.kind, FrameKind::Request);
        let back: Request = decode_payload(&buf[FRAME_HEADER_BYTES..])
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&back, &req);
        for cut in 0..buf.len() {
            prop_assert_eq!(parse_header(&buf[..cut]), Ok(None), "cut at {}", cut);
        }
        // A payload with a byte more or less is refused (trailing bytes, or cut short).
        let mut longer = buf[FRAME_HEADER_BYTES..].to_vec();
        longer.push(0);
        prop_assert!(decode_payload::<Request>(&longer).is_err());
        prop_assert!(decode_payload::<Request>(&buf[FRAME_HEADER_BYTES..buf.len() - 1]).is_err());
    }

    /// Every reply round-trips through a frame.
    #[test]
    fn replies_round_trip(rep in reply(), id in any::<u64>()) {
        let mut buf = Vec::new();
        encode_frame(&mut buf, FrameKind::Reply, id, &rep).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let h = parse_header(&buf).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let h = h.ok_or_else(|| TestCaseError::fail("complete frame not found"))?;
        prop_assert_eq!(h.total_len, buf.len());
        let back: Reply = decode_payload(&buf[FRAME_HEADER_BYTES..])
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(back, rep);
    }

    /// Arbitrary bytes that decode as a request are a request: encoding it again and
    /// decoding gives the same value.
    #[test]
    fn decoded_requests_are_stable(buf in bytes(80)) {
        if let Ok(r) = decode_payload::<Request>(&buf) {
            let mut out = Vec::new();
            encode_frame(&mut out, FrameKind::Request, 1, &r).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let again: Request = decode_payload(&out[FRAME_HEADER_BYTES..])
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(again, r);
        }
    }

    /// Damaged encodings of real requests and replies (bytes flipped, inserted, removed,
    /// the tail cut) decode to something or to an error, never a panic.
    #[test]
    fn damaged_messages_never_panic(req in request(), rep in reply(),
                                    edits in vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..6)) {
        for payload in [
            kochab_proto::frame::encode_value(Vec::new(), &req).map_err(|e| TestCaseError::fail(e.to_string()))?,
            kochab_proto::frame::encode_value(Vec::new(), &rep).map_err(|e| TestCaseError::fail(e.to_string()))?,
        ] {
            let mut p = payload;
            for (at, b, what) in &edits {
                if p.is_empty() {
                    p.push(*b);
                    continue;
                }
                let i = at.index(p.len());
                match what {
                    0 => p[i] ^= b | 1,
                    1 => p.insert(i, *b),
                    2 => { p.remove(i); }
                    _ => p.truncate(i),
                }
            }
            let _ = decode_payload::<Request>(&p);
            let _ = decode_payload::<Reply>(&p);
        }
    }
}

proptest! {
    #![proptest_config(cases(1000))]

    /// A stream of frames delivered in arbitrary pieces yields the same frames, in order,
    /// through the connections' codec, and a garbage tail after them is an error (or an
    /// incomplete frame), never a panic.
    #[test]
    fn frame_streams_split_anywhere(reqs in vec((kind(), any::<u64>(), request()), 1..6),
                                    pieces in vec(1usize..200, 1..8),
                                    tail in bytes(20)) {
        let mut stream = Vec::new();
        for (k, id, r) in &reqs {
            encode_frame(&mut stream, *k, *id, r).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let (frames, failed) = read_stream(&stream, &pieces);
        prop_assert!(!failed);
        prop_assert_eq!(frames.len(), reqs.len());
        for ((k, id, r), (fk, fid, payload)) in reqs.iter().zip(&frames) {
            prop_assert_eq!(k, fk);
            prop_assert_eq!(id, fid);
            let back: Request = decode_payload(payload).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&back, r);
        }
        stream.extend_from_slice(&tail);
        let (with_tail, _) = read_stream(&stream, &pieces);
        prop_assert!(with_tail.len() >= frames.len());
        prop_assert_eq!(&with_tail[..frames.len()], &frames[..]);
    }
}

/// The largest frame is accepted and one byte more is refused, leaving the buffer as it was.
#[test]
fn frame_size_limit_is_exact() {
    for extra in 0..3 {
        // A byte string of n bytes encodes as a 4-byte varint length (n >= 2^21) then n bytes.
        let body = MAX_FRAME_BYTES - (FRAME_HEADER_BYTES - 4) - 4 + extra;
        let msg = serde_bytes::ByteBuf::from(vec![7u8; body]);
        let mut buf = Vec::new();
        let r = encode_frame(&mut buf, FrameKind::Reply, 9, &msg);
        if extra == 0 {
            assert!(r.is_ok());
            let h = parse_header(&buf).unwrap().unwrap();
            assert_eq!(h.total_len - 4, MAX_FRAME_BYTES);
        } else {
            assert!(matches!(r, Err(FrameError::TooLarge(_))), "{r:?}");
            assert!(
                buf.is_empty(),
                "a refused frame leaves the buffer as it was"
            );
        }
    }
}

/// The strategies above make every `Op` variant: a new operation must be added to `op()`.
#[test]
fn every_op_variant_is_generated() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = op();
    let mut seen = [false; OP_NAMES.len()];
    for _ in 0..5000 {
        let tree = strategy.new_tree(&mut runner).unwrap();
        seen[tree.current().index()] = true;
    }
    let missing: Vec<&str> = OP_NAMES
        .iter()
        .zip(seen)
        .filter(|(_, s)| !s)
        .map(|(n, _)| *n)
        .collect();
    assert!(missing.is_empty(), "op() never makes {missing:?}");
}

/// Position of a reply's variant. No wildcard arm: a new variant fails to compile here
/// until it is listed, and then the test below fails until `reply()` makes it.
fn reply_variant(r: &Reply) -> usize {
    match r {
        Reply::Entry(_) => 0,
        Reply::Attr(_) => 1,
        Reply::Empty => 2,
        Reply::Bytes(_) => 3,
        Reply::Dir { .. } => 4,
        Reply::StatFs(_) => 5,
        Reply::Status(_) => 6,
        Reply::Problems(_) => 7,
        Reply::Lock(_) => 8,
        Reply::Error(_) => 9,
        Reply::WrongServer { .. } => 10,
        Reply::WithDirs { .. } => 11,
        Reply::ReadAtime(_) => 12,
        Reply::KeyAdded { .. } => 13,
        Reply::Keys(_) => 14,
        Reply::Map(_) => 15,
        Reply::Control(_) => 16,
        Reply::Child { .. } => 17,
        Reply::Grant(_) => 18,
        Reply::Layout(_) => 19,
        Reply::Links(_) => 20,
        Reply::InodeLinks(_) => 21,
    }
}

#[test]
fn every_reply_variant_is_generated() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = reply();
    let mut seen = [false; 22];
    for _ in 0..5000 {
        let tree = strategy.new_tree(&mut runner).unwrap();
        seen[reply_variant(&tree.current())] = true;
    }
    let missing: Vec<usize> = (0..seen.len()).filter(|&i| !seen[i]).collect();
    assert!(
        missing.is_empty(),
        "reply() never makes variants {missing:?}"
    );
}

//! Property tests of what a server reads back at start: checkpoint images and manifests,
//! and the journal entries replayed on top. Whatever the bytes are (damaged images,
//! arbitrary bytes behind a valid checksum, arbitrary box images and mutations), loading
//! and replay answer with a value or an error and never panic, and the engine they leave
//! still answers its invariant check and read-only operations. Undamaged images load back
//! exactly what was written, chunk layouts (slice commits and a truncation) included.
//!
//! Case counts are set per test (see `cases`); `PROPTEST_CASES=N` runs N cases of each
//! instead (docs/TESTING.md). The store is in memory (`kochab_store::MemStore`).

use kochab_journal::record::encode_record_with;
use kochab_meta::inode::{DirMeta, InodeExtra};
use kochab_meta::name::Name;
use kochab_meta::table::{DentryImage, InodeImage};
use kochab_meta::{
    BoxImage, Engine, EngineConfig, FileLayout, Inode, Mutation, Reclaim, Region, SliceRef, Table,
};
use kochab_proto::{Credentials, FileKind, InodeId, Op, Reply, mode};
use kochab_server::checkpoint::{
    BOX_IMAGE_BYTES_MAX, ImageRef, Manifest, load_table, read_manifest, swap_manifest,
};
use kochab_server::core::JournalEntry;
use kochab_store::{MemStore, ObjectStore};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;

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

// ---- a real engine and its checkpoint -------------------------------------------------------

fn fail<E: std::fmt::Display>(e: E) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// An engine with some of everything: directories, files, links, symlinks, a fifo,
/// xattrs, a removed file's reclaim entry.
fn sample_engine() -> Engine {
    let mut e =
        Engine::new_cluster(EngineConfig::with_key([3, 4])).unwrap_or_else(|e| panic!("{e}"));
    for m in e.bootstrap(1) {
        e.apply(&m).unwrap_or_else(|err| panic!("{err}"));
    }
    let root = e.root();
    let c = Credentials::root();
    let mut out = Vec::new();
    let mut run = |e: &mut Engine, op: Op| -> Option<InodeId> {
        match e.execute(&c, &op, 2, &mut out) {
            Reply::Entry(a) => Some(a.id),
            Reply::Error(err) => panic!("{op:?}: {err:?}"),
            _ => None,
        }
    };
    let mut dirs = vec![root];
    for i in 0..6u32 {
        let parent = dirs[i as usize / 2];
        let d = run(
            &mut e,
            Op::Mkdir {
                parent,
                name: format!("d{i}").into_bytes(),
                mode: 0o755,
            },
        );
        dirs.extend(d);
        for j in 0..5u32 {
            let f = run(
                &mut e,
                Op::Mknod {
                    parent,
                    name: format!("f{i}-{j}").into_bytes(),
                    mode: mode::S_IFREG | 0o644,
                    rdev: 0,
                    exclusive: true,
                },
            );
            if let Some(f) = f.filter(|_| j == 1) {
                // A layout: slices committed over three chunks, the second overwritten,
                // then a truncation inside the last (zeros from the cut).
                let slices: Vec<(u64, SliceRef)> = (0..4u64)
                    .map(|k| {
                        let r = SliceRef {
                            object: k + 1,
                            pos: (k as u32) * 100,
                            len: 1000 + i,
                        };
                        (k.min(2), r)
                    })
                    .collect();
                e.commit_slices(&c, f, &slices, 0, 3)
                    .unwrap_or_else(|err| panic!("{err:?}"));
                run(
                    &mut e,
                    Op::SetAttr {
                        id: f,
                        set: kochab_proto::SetAttrs {
                            size: Some(2 * kochab_proto::CHUNK_BYTES + 350),
                            ..Default::default()
                        },
                    },
                );
            }
            if let Some(f) = f.filter(|_| j == 0) {
                run(
                    &mut e,
                    Op::SetXattr {
                        id: f,
                        name: b"user.k".to_vec(),
                        value: vec![b'v'; 40],
                        flags: 0,
                    },
                );
                run(
                    &mut e,
                    Op::Link {
                        id: f,
                        new_parent: root,
                        new_name: format!("l{i}").into_bytes(),
                    },
                );
            }
        }
        run(
            &mut e,
            Op::Symlink {
                parent,
                name: format!("s{i}").into_bytes(),
                target: b"../t".to_vec(),
            },
        );
    }
    run(
        &mut e,
        Op::Mknod {
            parent: root,
            name: b"fifo".to_vec(),
            mode: mode::S_IFIFO | 0o600,
            rdev: 0,
            exclusive: true,
        },
    );
    let gone = run(
        &mut e,
        Op::Mknod {
            parent: root,
            name: b"gone".to_vec(),
            mode: mode::S_IFREG | 0o600,
            rdev: 0,
            exclusive: true,
        },
    );
    if let Some(g) = gone {
        let marked = e.mark_data(g).unwrap_or_else(|err| panic!("{err:?}"));
        drop(marked);
        run(
            &mut e,
            Op::Unlink {
                parent: root,
                name: b"gone".to_vec(),
            },
        );
    }
    assert!(e.check_invariants().is_empty());
    e
}

/// The table holding the root, as a checkpoint writes it: every box's image.
fn full_images(e: &mut Engine) -> (usize, Vec<BoxImage>) {
    let i = e.table_index(e.root()).unwrap_or(0);
    let t = &e.tables()[i];
    let set = t.all_boxes();
    let mut imgs: Vec<BoxImage> = set
        .inode_boxes
        .iter()
        .map(|&b| t.image_inode_box(b))
        .collect();
    imgs.extend(
        set.dentry_boxes
            .iter()
            .map(|&(d, b)| t.image_dentry_box(d, b)),
    );
    imgs.extend(
        set.layout_groups
            .iter()
            .flat_map(|&(id, g)| t.image_layout_group(id, g)),
    );
    imgs.push(t.image_reclaims());
    (i, imgs)
}

/// An image object's bytes: box images framed as checksummed records numbered from 1.
fn frame(payloads: &[Vec<u8>]) -> Vec<u8> {
    let mut buf = Vec::new();
    for (k, p) in payloads.iter().enumerate() {
        encode_record_with(&mut buf, k as u64 + 1, 1, BOX_IMAGE_BYTES_MAX, |o| {
            o.extend_from_slice(p)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    }
    buf
}

fn encode(imgs: &[BoxImage]) -> Vec<Vec<u8>> {
    imgs.iter()
        .map(|i| postcard::to_allocvec(i).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// A store holding one table's manifest and one image with `bytes`.
fn store_with_image(lo: u64, hi: u64, bytes: &[u8]) -> (MemStore, Manifest) {
    let s = MemStore::new();
    let mut m = Manifest {
        lo,
        hi,
        images: vec![ImageRef {
            seq: 1,
            bytes: bytes.len() as u64,
            full: true,
            server: 1,
            epoch: 1,
            parts: 0,
        }],
        next_seq: 2,
        ..Manifest::default()
    };
    s.put(&format!("tables/{lo:016x}/{:010}.1.1.img", 1), bytes)
        .unwrap_or_else(|e| panic!("{e}"));
    swap_manifest(&s, &mut m).unwrap_or_else(|e| panic!("{e}"));
    (s, m)
}

/// Everything a table holds, comparable: inodes, entries (directory, cookie, name, child)
/// and reclaims.
type Contents = (
    Vec<(InodeId, Inode)>,
    Vec<(InodeId, u64, Vec<u8>, InodeId)>,
    Vec<Reclaim>,
    Vec<(InodeId, FileLayout)>,
);

fn contents(t: &Table) -> Contents {
    let inodes = t.iter_inodes().map(|(id, i)| (id, i.clone())).collect();
    let mut entries: Vec<_> = t
        .iter_dirs()
        .flat_map(|(d, es)| {
            es.iter()
                .map(move |(c, e)| (d, c, e.name.as_bytes().to_vec(), e.child))
        })
        .collect();
    entries.sort();
    let mut layouts: Vec<_> = t.iter_layouts().map(|(id, l)| (id, l.clone())).collect();
    layouts.sort_by_key(|l| l.0);
    (inodes, entries, t.reclaims().copied().collect(), layouts)
}

/// Loads `bytes` as table `idx`'s only image into a fresh engine like `template`; then the
/// engine must still answer: invariant check, getattr/readdir/lookup of what it holds.
fn load_into_engine(template: &Engine, idx: usize, bytes: &[u8]) -> Result<(), TestCaseError> {
    let (lo, hi) = (template.tables()[idx].lo, template.tables()[idx].hi);
    let (store, m) = store_with_image(lo, hi, bytes);
    let read = read_manifest(&store, lo, hi).map_err(fail)?;
    prop_assert_eq!(&read, &m);
    let mut e = Engine::new_cluster(template.config().clone()).map_err(fail)?;
    let loaded = load_table(&store, &mut e.tables_mut()[idx], &m);
    if loaded.is_err() {
        return Ok(());
    }
    let _ = e.rehash_legacy_dentries();
    e.fill_region_next();
    let _ = e.check_invariants();
    let ids: Vec<InodeId> = e.tables()[idx]
        .iter_inodes()
        .map(|(id, _)| id)
        .take(200)
        .collect();
    let c = Credentials::root();
    for id in ids {
        let mut out = Vec::new();
        for op in [
            Op::GetAttr { id },
            Op::Readdir {
                id,
                cookie: 0,
                max_entries: 50,
                plus: true,
            },
            Op::Lookup {
                parent: id,
                name: b"..".to_vec(),
            },
            Op::Readlink { id },
            Op::ListXattr { id },
        ] {
            let _ = e.execute(&c, &op, 10, &mut out);
            prop_assert!(out.is_empty(), "read-only {:?} emitted mutations", op);
        }
    }
    Ok(())
}

// ---- strategies for arbitrary images and mutations ------------------------------------------

/// Ids near the root's table and elsewhere, so that images and mutations collide with what
/// exists, fall outside the table, or name no table.
fn some_id(root: InodeId) -> impl Strategy<Value = InodeId> {
    prop_oneof![
        4 => (0u64..200).prop_map(move |k| root + k),
        1 => any::<u64>(),
        1 => prop_oneof![Just(0u64), Just(u64::MAX), Just(root - 1)],
    ]
}

fn inode(root: InodeId) -> impl Strategy<Value = Inode> {
    let kinds = prop_oneof![
        Just(mode::S_IFREG),
        Just(mode::S_IFDIR),
        Just(mode::S_IFLNK),
        Just(mode::S_IFIFO),
        Just(0u32),
        any::<u32>()
    ];
    let extra = proptest::option::of(
        (
            proptest::option::of(vec(any::<u8>(), 0..8)),
            proptest::option::of((some_id(root), any::<u64>(), any::<u64>(), any::<u64>())),
        )
            .prop_map(|(symlink, dir)| {
                Box::new(InodeExtra {
                    symlink,
                    dir: dir.map(|(parent, file_next, file_end, subdir_next)| DirMeta {
                        parent,
                        file_next,
                        file_end,
                        subdir_next,
                    }),
                })
            }),
    );
    (
        kinds,
        0u32..0o7777,
        prop_oneof![0u32..4, any::<u32>()],
        any::<u64>(),
        any::<i64>(),
        any::<bool>(),
        extra,
    )
        .prop_map(|(kind, perm, nlink, size, t, may_have_data, extra)| Inode {
            mode: kind | perm,
            uid: 0,
            gid: 0,
            nlink,
            size,
            atime: t,
            mtime: t,
            ctime: t,
            btime: t,
            rdev: 0,
            may_have_data,
            extra,
        })
}

fn name() -> impl Strategy<Value = Name> {
    prop_oneof![
        prop_oneof![
            Just(b"a".to_vec()),
            Just(b"b".to_vec()),
            Just(b".".to_vec()),
            Just(Vec::new())
        ],
        vec(any::<u8>(), 0..300),
    ]
    .prop_map(|b| Name::new(&b))
}

fn kind() -> impl Strategy<Value = FileKind> {
    (1u8..=7).prop_map(|c| FileKind::from_code(c).unwrap_or(FileKind::File))
}

fn dentry_image(root: InodeId) -> impl Strategy<Value = DentryImage> {
    (any::<u64>(), name(), some_id(root), kind()).prop_map(|(cookie, name, child, kind)| {
        DentryImage {
            cookie,
            name,
            child,
            kind,
        }
    })
}

/// Chunk numbers: the first few, near the largest file's last chunk, or anything.
fn chunk_no() -> impl Strategy<Value = u64> {
    let last = kochab_proto::FILE_BYTES_MAX / kochab_proto::CHUNK_BYTES;
    prop_oneof![4 => 0u64..4, 1 => last - 1..last + 2, 1 => any::<u64>()]
}

/// Slice refs, valid or not (empty, or leaving their chunk).
fn slice_refs() -> impl Strategy<Value = Vec<SliceRef>> {
    vec(
        (
            0u64..8,
            any::<u32>(),
            prop_oneof![0u32..5000, Just(u32::MAX)],
        )
            .prop_map(|(object, pos, len)| SliceRef {
                object,
                pos: pos % (5 << 20),
                len,
            }),
        0..4,
    )
}

fn box_image(root: InodeId) -> impl Strategy<Value = BoxImage> {
    let xattrs = vec(
        (vec(any::<u8>(), 0..8), vec(any::<u8>(), 0..8))
            .prop_map(|(k, v)| (serde_bytes::ByteBuf::from(k), serde_bytes::ByteBuf::from(v))),
        0..3,
    );
    let boxno = prop_oneof![4 => (0u64..4).prop_map(move |k| (root >> 6) + k), 1 => any::<u64>()];
    prop_oneof![
        (boxno, vec((0u8..70, inode(root), xattrs), 0..6)).prop_map(|(boxno, v)| {
            BoxImage::Inodes {
                boxno,
                inodes: v
                    .into_iter()
                    .map(|(slot, inode, xattrs)| InodeImage {
                        slot,
                        inode,
                        xattrs,
                    })
                    .collect(),
            }
        }),
        (some_id(root), any::<u16>(), vec(dentry_image(root), 0..6)).prop_map(
            |(dir, boxno, entries)| BoxImage::Dentries {
                dir,
                boxno,
                entries
            }
        ),
        (some_id(root), any::<u16>(), vec(dentry_image(root), 0..6)).prop_map(
            |(dir, boxno, entries)| BoxImage::DentriesV1 {
                dir,
                boxno,
                entries
            }
        ),
        any::<u64>().prop_map(|next| BoxImage::RegionNext { next }),
        (
            some_id(root),
            chunk_no(),
            chunk_no(),
            vec((chunk_no(), slice_refs()), 0..4)
        )
            .prop_map(|(id, from, to, chunks)| BoxImage::Layout {
                id,
                from,
                to,
                chunks
            }),
        vec((some_id(root), any::<u64>(), any::<u64>()), 0..4).prop_map(|v| BoxImage::Reclaims {
            entries: v
                .into_iter()
                .map(|(id, generation, from)| Reclaim {
                    id,
                    generation,
                    from
                })
                .collect(),
        }),
    ]
}

/// Dentry images placed in the box their cookie says (so they pass the box check and
/// reach the directory code).
fn consistent_dentries(root: InodeId) -> impl Strategy<Value = BoxImage> {
    (some_id(root), vec(dentry_image(root), 1..20)).prop_map(|(dir, mut entries)| {
        let boxno = (entries[0].cookie >> kochab_meta::dir::DENTRY_BOX_SHIFT) as u16;
        for e in &mut entries {
            e.cookie = (e.cookie & ((1 << kochab_meta::dir::DENTRY_BOX_SHIFT) - 1))
                | ((boxno as u64) << kochab_meta::dir::DENTRY_BOX_SHIFT);
        }
        BoxImage::Dentries {
            dir,
            boxno,
            entries,
        }
    })
}

fn mutation(root: InodeId) -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (some_id(root), inode(root)).prop_map(|(id, inode)| Mutation::PutInode { id, inode }),
        some_id(root).prop_map(|id| Mutation::DropInode { id }),
        (some_id(root), name(), some_id(root), kind()).prop_map(|(parent, name, child, kind)| {
            Mutation::PutDentry {
                parent,
                name,
                child,
                kind,
            }
        }),
        (some_id(root), name()).prop_map(|(parent, name)| Mutation::DropDentry { parent, name }),
        (
            some_id(root),
            vec(any::<u8>(), 0..8),
            vec(any::<u8>(), 0..8)
        )
            .prop_map(|(id, name, value)| Mutation::SetXattr { id, name, value }),
        (some_id(root), vec(any::<u8>(), 0..8))
            .prop_map(|(id, name)| Mutation::DropXattr { id, name }),
        (some_id(root), any::<u64>(), any::<u64>()).prop_map(|(id, generation, from)| {
            Mutation::PutReclaim {
                id,
                generation,
                from,
            }
        }),
        (some_id(root), any::<u64>())
            .prop_map(|(id, generation)| Mutation::DropReclaim { id, generation }),
        (
            prop_oneof![
                Just(Region::CatchAll),
                Just(Region::Primary),
                Just(Region::TooDeep),
                Just(Region::TooWide)
            ],
            any::<u64>()
        )
            .prop_map(|(region, next)| Mutation::SetRegionNext { region, next }),
        (some_id(root), chunk_no(), slice_refs())
            .prop_map(|(id, chunk, refs)| Mutation::PutChunk { id, chunk, refs }),
        (some_id(root), chunk_no()).prop_map(|(id, from)| Mutation::DropChunks { id, from }),
    ]
}

/// The engine must still answer after replaying whatever it was given.
fn still_answers(e: &mut Engine) -> Result<(), TestCaseError> {
    let _ = e.check_invariants();
    e.fill_region_next();
    let ids: Vec<InodeId> = e
        .tables()
        .iter()
        .flat_map(|t| t.iter_inodes().map(|(id, _)| id))
        .take(300)
        .collect();
    let c = Credentials::root();
    for id in ids {
        let mut out = Vec::new();
        for op in [
            Op::GetAttr { id },
            Op::Readdir {
                id,
                cookie: 0,
                max_entries: 50,
                plus: true,
            },
            Op::Lookup {
                parent: id,
                name: b"a".to_vec(),
            },
            Op::Readlink { id },
            Op::ListXattr { id },
            Op::Access { id, mask: 7 },
        ] {
            let _ = e.execute(&c, &op, 10, &mut out);
            prop_assert!(out.is_empty(), "read-only {:?} emitted mutations", op);
        }
    }
    Ok(())
}

// ---- properties ------------------------------------------------------------------------------

#[test]
fn undamaged_images_load_back_exactly() {
    let mut e = sample_engine();
    let (idx, imgs) = full_images(&mut e);
    let bytes = frame(&encode(&imgs));
    let (lo, hi) = (e.tables()[idx].lo, e.tables()[idx].hi);
    assert!(
        e.tables()[idx].iter_layouts().count() >= 1,
        "the sample has layouts"
    );
    let (store, m) = store_with_image(lo, hi, &bytes);
    let mut t = Table::new(lo, hi);
    let boxes = load_table(&store, &mut t, &m).unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(boxes as usize, imgs.len());
    assert_eq!(contents(&t), contents(&e.tables()[idx]));
    assert_eq!(t.inode_count(), e.tables()[idx].inode_count());
    assert_eq!(t.dentry_count(), e.tables()[idx].dentry_count());
}

proptest! {
    #![proptest_config(cases(300))]

    /// A real table's image with bytes flipped, inserted, removed or cut.
    #[test]
    fn damaged_images_never_panic(edits in vec((any::<Index>(), any::<u8>(), 0u8..4), 1..8)) {
        let mut e = sample_engine();
        let (idx, imgs) = full_images(&mut e);
        let mut bytes = frame(&encode(&imgs));
        for (at, b, what) in &edits {
            if bytes.is_empty() {
                bytes.push(*b);
                continue;
            }
            let i = at.index(bytes.len());
            match what {
                0 => bytes[i] ^= b | 1,
                1 => bytes.insert(i, *b),
                2 => { bytes.remove(i); }
                _ => bytes.truncate(i),
            }
        }
        load_into_engine(&e, idx, &bytes)?;
    }

    /// A real table's box images with their payload bytes damaged but checksummed again
    /// (what a bug or a hostile writer, not a torn disk, would leave): the decoder and the
    /// table's loader see the damage.
    #[test]
    fn damaged_payloads_behind_valid_checksums_never_panic(
        edits in vec((any::<Index>(), any::<Index>(), any::<u8>(), 0u8..3), 1..8)
    ) {
        let mut e = sample_engine();
        let (idx, imgs) = full_images(&mut e);
        let mut payloads = encode(&imgs);
        for (which, at, b, what) in &edits {
            let k = which.index(payloads.len());
            let p = &mut payloads[k];
            if p.is_empty() {
                p.push(*b);
                continue;
            }
            let i = at.index(p.len());
            match what {
                0 => p[i] ^= b | 1,
                1 => p.insert(i, *b),
                _ => { p.remove(i); }
            }
        }
        load_into_engine(&e, idx, &frame(&payloads))?;
    }

    /// Arbitrary bytes as an image, raw or as checksummed records.
    #[test]
    fn arbitrary_image_bytes_never_panic(raw in vec(any::<u8>(), 0..300),
                                         framed in vec(vec(any::<u8>(), 0..80), 0..5)) {
        let e = sample_engine();
        let idx = e.table_index(e.root()).unwrap_or(0);
        load_into_engine(&e, idx, &raw)?;
        load_into_engine(&e, idx, &frame(&framed))?;
    }

    /// Arbitrary box images (ids in and out of the table, slots out of range, typeless
    /// modes, cookies outside their box, colliding entries), checksummed.
    #[test]
    fn arbitrary_box_images_never_panic(
        imgs in vec(box_image(ROOT), 1..6),
        dentries in vec(consistent_dentries(ROOT), 0..4),
    ) {
        let e = sample_engine();
        prop_assert_eq!(e.root(), ROOT);
        let idx = e.table_index(e.root()).unwrap_or(0);
        let mut all = imgs;
        all.extend(dentries);
        load_into_engine(&e, idx, &frame(&encode(&all)))?;
    }

    /// Manifests: arbitrary bytes, and real manifests with bytes changed, are read or
    /// refused.
    #[test]
    fn arbitrary_manifests_never_panic(raw in vec(any::<u8>(), 0..120), at in any::<Index>(), b in any::<u8>()) {
        let s = MemStore::new();
        let name = kochab_store::versioned_name("tables/0000000000000000/manifest", 1);
        s.put(&name, &raw).map_err(fail)?;
        let _ = read_manifest(&s, 0, 1 << 40);
        let s = MemStore::new();
        let mut m = Manifest { lo: 0, hi: 1 << 40, images: vec![ImageRef { seq: 1, bytes: 10, full: true, server: 1, epoch: 1, parts: 0 }], next_seq: 2, ..Manifest::default() };
        swap_manifest(&s, &mut m).map_err(fail)?;
        let mut json = s.get(&name).map_err(fail)?.unwrap_or_default();
        let i = at.index(json.len().max(1)).min(json.len().saturating_sub(1));
        if let Some(x) = json.get_mut(i) {
            *x = b;
        }
        s.put(&name, &json).map_err(fail)?;
        if let Ok(m) = read_manifest(&s, 0, 1 << 40) {
            let mut t = Table::new(0, 1 << 40);
            let _ = load_table(&s, &mut t, &m);
        }
    }

    /// Journal entries: arbitrary payload bytes are decoded or refused; arbitrary
    /// mutations (checksummed, so recovery hands them over) are replayed or refused; the
    /// engine then still answers.
    #[test]
    fn arbitrary_journal_entries_never_panic(raw in vec(any::<u8>(), 0..200),
                                             muts in vec(mutation(ROOT), 0..12), lsn in 1u64..5) {
        let mut e = sample_engine();
        if let Ok(entry) = postcard::from_bytes::<JournalEntry>(&raw) {
            let _ = e.replay(lsn, &entry.muts);
        }
        let payload = postcard::to_allocvec(&(7u64, 1u64, 0u64, Option::<u64>::None, &muts)).map_err(fail)?;
        let entry: JournalEntry = postcard::from_bytes(&payload).map_err(fail)?;
        prop_assert_eq!(&entry.muts, &muts);
        for m in &entry.muts {
            let _ = e.replay(lsn, std::slice::from_ref(m));
        }
        still_answers(&mut e)?;
    }
}

/// The root of `EngineConfig::with_key`'s default id policy.
const ROOT: InodeId = 0x4000_0000_0000_0000;

//! Ownership over time, in process: tables leave one server and join another over one
//! object store, a failed incarnation's journal is sealed before its tables are taken, and
//! a fenced owner's late writes are refused by the store.

use kochab_journal::JournalId;
use kochab_proto::{Credentials, LockKind, LockSpec, Op, Reply, Request, mode};
use kochab_server::checkpoint::read_manifest_by_id;
use kochab_server::shared::Shared;
use kochab_server::{RunningServer, ServerConfig, start, start_member};
use kochab_store::{LocalStore, ObjectStore};
use std::path::Path;
use std::sync::Arc;

fn config(dir: &Path) -> ServerConfig {
    let mut c = ServerConfig::new(dir, "127.0.0.1:0".parse().unwrap());
    // Checkpoints only when a test asks for them.
    c.checkpoint_records = u64::MAX;
    c.checkpoint_interval = std::time::Duration::from_secs(3600);
    c
}

/// Runs one request as client `client` and waits until its reply may be sent (durable).
/// `None` if it never may (the journal failed).
fn run(shared: &Shared, client: u64, seq: u64, op: Op) -> Option<Reply> {
    let req = Request {
        seq,
        ..Request::plain(&Credentials::root(), op)
    };
    let mut replies = Vec::new();
    shared.execute_batch(client, &[(1, req)], &mut replies);
    let answer = replies.pop()?;
    let needed = answer.lsn;
    let reply = match answer.reply {
        Reply::WithDirs { reply, .. } => *reply,
        other => other,
    };
    shared.journal().wait_durable(needed).then_some(reply)
}

fn create(shared: &Shared, parent: u64, name: &str, seq: u64) -> Option<Reply> {
    run(
        shared,
        7,
        seq,
        Op::Mknod {
            parent,
            name: name.as_bytes().to_vec(),
            mode: mode::S_IFREG | 0o644,
            rdev: 0,
            exclusive: true,
        },
    )
}

fn lookup(shared: &Shared, parent: u64, name: &str) -> Reply {
    run(
        shared,
        8,
        0,
        Op::Lookup {
            parent,
            name: name.as_bytes().to_vec(),
        },
    )
    .expect("a read is answered")
}

/// The id of the table that holds the root (files created in the root land there).
fn root_table(s: &RunningServer) -> u64 {
    let core = s.shared().core();
    let i = core.engine.table_index(s.root).unwrap();
    core.engine.tables()[i].lo
}

async fn member(dir: &Path, a: &RunningServer, server: u64, epoch: u64) -> RunningServer {
    let store: Arc<dyn ObjectStore> = Arc::new(LocalStore::open(a.data_dir.join("store")).unwrap());
    let engine = a.shared().engine_config();
    start_member(
        config(dir),
        store,
        a.key,
        engine,
        JournalId { server, epoch },
        Vec::new(),
    )
    .await
    .unwrap()
}

/// Server A of a test, started under `dir/a`: the server, its root, the root's table and
/// its shared state.
async fn server_a(dir: &Path) -> (RunningServer, u64, u64, Arc<Shared>) {
    let a = start(config(&dir.join("a"))).await.unwrap();
    let (root, lo, sa) = (a.root, root_table(&a), a.shared().clone());
    (a, root, lo, sa)
}

/// Moves table `lo` from `a` to a new member (server 2) under `dir`, as a migration does:
/// `a` lets it go (which checkpoints it), the member takes it.
async fn move_to_member(dir: &Path, a: &RunningServer, lo: u64) -> RunningServer {
    let s = a.shared().clone();
    blocking(move || s.drop_table(lo)).unwrap();
    let b = member(dir, a, 2, 1).await;
    let s = b.shared().clone();
    blocking(move || s.add_table(lo)).unwrap();
    b
}

/// Opens file `id` read-write through `handle` (client 7).
fn open_rw(id: u64, handle: u64) -> Op {
    Op::Open {
        id,
        flags: libc::O_RDWR as u32,
        handle,
    }
}

/// Unlinks "open" from `root` at `s` (client 7, sequence 2).
fn unlink_open(s: &Shared, root: u64) -> Option<Reply> {
    let unlink = Op::Unlink {
        parent: root,
        name: b"open".to_vec(),
    };
    run(s, 7, 2, unlink)
}

/// Asserts that file `id`, unlinked, ended with its last close at `s`, with the engine's
/// invariants holding.
fn assert_ended_at_last_close(s: &Shared, id: u64) {
    let stat = run(s, 8, 0, Op::GetAttr { id });
    assert!(
        matches!(stat, Some(Reply::Error(_))),
        "the last close ends it: {stat:?}"
    );
    assert!(s.check_invariants().is_empty());
}

fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_table_is_served_by_the_server_that_adds_it_with_every_acknowledged_op() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, lo, sa) = server_a(tmp.path()).await;
    for i in 0..200 {
        let r = create(&sa, root, &format!("f{i}"), i + 1);
        assert!(matches!(r, Some(Reply::Entry(_))), "{r:?}");
    }
    // A table that is not checkpointed yet moves: the drop makes the checkpoint.
    let s = sa.clone();
    blocking(move || s.drop_table(lo)).unwrap();
    assert!(
        matches!(lookup(&sa, root, "f0"), Reply::WrongServer { .. }),
        "the old owner refuses"
    );
    let m = read_manifest_by_id(&LocalStore::open(a.data_dir.join("store")).unwrap(), lo)
        .unwrap()
        .unwrap();
    assert_eq!(m.owner, None, "released");
    assert!(m.journals.is_empty(), "the image holds everything");

    let b = member(&tmp.path().join("b"), &a, 2, 1).await;
    let sb = b.shared().clone();
    assert!(
        matches!(lookup(&sb, root, "f0"), Reply::Error(_)),
        "not hosted before the add"
    );
    let s = sb.clone();
    blocking(move || s.add_table(lo)).unwrap();
    for i in 0..200 {
        assert!(
            matches!(lookup(&sb, root, &format!("f{i}")), Reply::Entry(_)),
            "acknowledged f{i} is served by the new owner"
        );
    }
    // A retry of an acknowledged create whose reply was lost reaches the new owner: the
    // outcome came along with the table, so it is answered once, not run again (EEXIST).
    let again = create(&sb, root, "f199", 200);
    let first = lookup(&sb, root, "f199");
    match (&again, &first) {
        (Some(Reply::Entry(x)), Reply::Entry(y)) => assert_eq!(x.id, y.id),
        other => panic!("retry after the move: {other:?}"),
    }
    let r = create(&sb, root, "on-b", 201);
    assert!(matches!(r, Some(Reply::Entry(_))), "{r:?}");
    assert!(matches!(
        lookup(&sa, root, "on-b"),
        Reply::WrongServer { .. }
    ));
    let m = read_manifest_by_id(&LocalStore::open(a.data_dir.join("store")).unwrap(), lo)
        .unwrap()
        .unwrap();
    assert_eq!(m.owner.map(|o| (o.server, o.epoch)), Some((2, 1)));
    assert_eq!(m.journals.len(), 1);
    assert_eq!(
        m.journals[0].id(),
        JournalId {
            server: 2,
            epoch: 1
        }
    );

    // B stops without a checkpoint of the new file (as a crash would leave it); its next
    // incarnation recovers the table from the manifest's journal, B's first.
    let sb_journal = sb.journal().id();
    b.shared().journal().shutdown();
    drop(sb);
    let b2 = {
        let store: Arc<dyn ObjectStore> =
            Arc::new(LocalStore::open(a.data_dir.join("store")).unwrap());
        let engine = a.shared().engine_config();
        let hi = m.hi;
        start_member(
            config(&tmp.path().join("b2")),
            store,
            a.key,
            engine,
            JournalId {
                server: 2,
                epoch: 2,
            },
            vec![(lo, hi)],
        )
        .await
        .unwrap()
    };
    let sb2 = b2.shared().clone();
    assert!(matches!(lookup(&sb2, root, "on-b"), Reply::Entry(_)));
    assert!(matches!(lookup(&sb2, root, "f199"), Reply::Entry(_)));
    assert!(
        kochab_journal::segment::is_sealed(sb2.store().as_ref(), sb_journal).unwrap(),
        "the predecessor's journal was sealed before it was read"
    );
    assert!(sb2.check_invariants().is_empty());
    b2.shutdown().await;
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_when_its_table_moves_holds_at_the_new_owner_until_its_close() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, lo, sa) = server_a(tmp.path()).await;
    let Some(Reply::Entry(f)) = create(&sa, root, "locked", 1) else {
        panic!("create");
    };
    let lock = |owner, kind| Op::SetLk {
        handle: if owner == 1 { 100 } else { 200 },
        lock: LockSpec {
            owner,
            start: 0,
            end: 99,
            kind,
            pid: 1,
            flock: false,
        },
    };
    let open = |handle| Op::Open {
        id: f.id,
        flags: libc::O_RDWR as u32,
        handle,
    };
    assert!(matches!(run(&sa, 7, 0, open(100)), Some(Reply::Entry(_))));
    assert_eq!(run(&sa, 7, 0, lock(1, LockKind::Write)), Some(Reply::Empty));

    let b = move_to_member(&tmp.path().join("b"), &a, lo).await;
    let sb = b.shared().clone();

    // Another client at the new owner: the lock taken at the old one still holds.
    assert!(matches!(run(&sb, 9, 0, open(200)), Some(Reply::Entry(_))));
    match run(&sb, 9, 0, lock(2, LockKind::Write)) {
        Some(Reply::Error(e)) => assert_eq!(e.errno, kochab_proto::Errno::EAGAIN, "{e}"),
        other => panic!("a conflicting lock after the move: {other:?}"),
    }
    // The holder's close reaches the new owner, which never saw the handle opened: the
    // lock that came with the table ends with it.
    assert_eq!(
        run(&sb, 7, 0, Op::Close { handle: 100 }),
        Some(Reply::Empty)
    );
    assert_eq!(run(&sb, 9, 0, lock(2, LockKind::Write)), Some(Reply::Empty));
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_open_when_their_table_moves_are_closed_at_the_new_owner() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, lo, sa) = server_a(tmp.path()).await;
    let Some(Reply::Entry(f)) = create(&sa, root, "open", 1) else {
        panic!("create");
    };
    let open = |handle| open_rw(f.id, handle);
    assert!(matches!(run(&sa, 7, 0, open(100)), Some(Reply::Entry(_))));
    assert!(matches!(run(&sa, 7, 0, open(101)), Some(Reply::Entry(_))));

    let b = move_to_member(&tmp.path().join("b"), &a, lo).await;
    let sb = b.shared().clone();
    let stat = |s: &Shared| run(s, 8, 0, Op::GetAttr { id: f.id });

    // Handle 101 is reopened at the new owner (as a client does after EBADF), 100 is not.
    assert!(matches!(run(&sb, 7, 0, open(101)), Some(Reply::Entry(_))));
    assert_eq!(unlink_open(&sb, root), Some(Reply::Empty));
    assert!(
        matches!(stat(&sb), Some(Reply::Attr(a)) if a.nlink == 0),
        "open elsewhere: unlinked but kept"
    );
    assert_eq!(
        run(&sb, 7, 0, Op::Close { handle: 100 }),
        Some(Reply::Empty)
    );
    assert!(
        matches!(stat(&sb), Some(Reply::Attr(_))),
        "handle 101 still holds it"
    );
    assert_eq!(
        run(&sb, 7, 0, Op::Close { handle: 101 }),
        Some(Reply::Empty)
    );
    assert_ended_at_last_close(&sb, f.id);
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gathered_closes_close_each_handle_as_a_close_does_before_and_after_a_move() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, lo, sa) = server_a(tmp.path()).await;
    let Some(Reply::Entry(f)) = create(&sa, root, "open", 1) else {
        panic!("create");
    };
    for handle in [100, 101, 102] {
        assert!(matches!(
            run(&sa, 7, 0, open_rw(f.id, handle)),
            Some(Reply::Entry(_))
        ));
    }
    assert_eq!(unlink_open(&sa, root), Some(Reply::Empty));
    let stat = |s: &Shared| run(s, 8, 0, Op::GetAttr { id: f.id });
    let close_many = |handles: &[u64]| Op::CloseMany {
        handles: handles.to_vec(),
    };
    assert_eq!(run(&sa, 7, 0, close_many(&[100, 101])), Some(Reply::Empty));
    assert!(
        matches!(stat(&sa), Some(Reply::Attr(a)) if a.nlink == 0),
        "handle 102 still holds it: {:?}",
        stat(&sa)
    );

    // The table moves: the new owner never saw handle 102 opened, yet closes it, and the
    // last close ends the file; with a handle it does not know, it closes none.
    let b = move_to_member(&tmp.path().join("b"), &a, lo).await;
    let sb = b.shared().clone();
    assert!(matches!(stat(&sb), Some(Reply::Attr(_))));
    match run(&sb, 7, 0, close_many(&[102, 999])) {
        Some(Reply::Error(e)) => assert_eq!(e.errno, kochab_proto::Errno::EBADF, "{e}"),
        other => panic!("an unknown handle among them: {other:?}"),
    }
    assert!(matches!(stat(&sb), Some(Reply::Attr(_))), "none closed");
    assert_eq!(run(&sb, 7, 0, close_many(&[102])), Some(Reply::Empty));
    assert_ended_at_last_close(&sb, f.id);
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_many_with_copies_or_too_many_handles_is_refused_before_any_lookup() {
    // Issue 29, item 6: on 77a0d33 a CloseMany of N copies of an open handle followed by
    // an unknown one looked all N up under the core lock and closed nothing (EBADF), as
    // often as a client sent it, for N up to a frame's worth (a million).
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, _, sa) = server_a(tmp.path()).await;
    let Some(Reply::Entry(f)) = create(&sa, root, "open", 1) else {
        panic!("create");
    };
    assert!(matches!(
        run(&sa, 7, 0, open_rw(f.id, 100)),
        Some(Reply::Entry(_))
    ));
    let refused = |handles: Vec<u64>| match run(&sa, 7, 0, Op::CloseMany { handles }) {
        Some(Reply::Error(e)) => {
            assert_eq!(e.errno, kochab_proto::Errno::EINVAL, "{e}");
            e.message
        }
        other => panic!("refused: {other:?}"),
    };
    let mut copies = vec![100; 100_000];
    copies.push(999);
    assert!(refused(copies).contains("at most 64"));
    assert!(refused(vec![100, 100]).contains("twice"));
    // 64 distinct handles (`CLOSE_MANY_HANDLES_MAX`) and one more.
    let mut many: Vec<u64> = (1000..1064).collect();
    many.push(100);
    assert!(refused(many).contains("at most 64"));
    // Nothing was closed; the handle closes as it should.
    let lock = LockSpec {
        owner: 1,
        start: 0,
        end: 0,
        kind: LockKind::Write,
        pid: 1,
        flock: false,
    };
    let held = |s: &Shared| run(s, 7, 0, Op::GetLk { handle: 100, lock });
    assert!(matches!(held(&sa), Some(Reply::Lock(_))), "{:?}", held(&sa));
    assert_eq!(
        run(&sa, 7, 0, Op::CloseMany { handles: vec![100] }),
        Some(Reply::Empty)
    );
    assert!(matches!(held(&sa), Some(Reply::Error(_))));
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_journal_stops_acknowledging_and_its_tables_are_recovered_elsewhere() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, lo, sa) = server_a(tmp.path()).await;
    let mut acked = Vec::new();
    for i in 0..100 {
        if let Some(Reply::Entry(_)) = create(&sa, root, &format!("f{i}"), i + 1) {
            acked.push(i);
        }
    }
    assert_eq!(acked.len(), 100);
    // Another server takes A's tables over as if A had failed: it seals A's journal first.
    let b = member(&tmp.path().join("b"), &a, 2, 1).await;
    let sb = b.shared().clone();
    let journal = sa.journal().id();
    let s = sb.clone();
    blocking(move || s.recover_tables(&[lo], journal)).unwrap();
    // A, not knowing, goes on: nothing more is acknowledged, and it stops.
    assert_eq!(create(&sa, root, "late", 1000), None, "never acknowledged");
    assert!(sa.journal().failed());
    assert!(sa.journal().failure().unwrap().contains("sealed"));
    for i in acked {
        assert!(
            matches!(lookup(&sb, root, &format!("f{i}")), Reply::Entry(_)),
            "acknowledged f{i} survives the takeover"
        );
    }
    assert!(matches!(lookup(&sb, root, "late"), Reply::Error(_)));
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_owners_late_checkpoint_is_refused_by_the_store() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, lo, sa) = server_a(tmp.path()).await;
    assert!(matches!(create(&sa, root, "x", 1), Some(Reply::Entry(_))));
    // A fencer replaces the manifest (here without sealing A's journal, so that only the
    // store's conditional write stands between A and the table).
    let store = sa.store().clone();
    let m = read_manifest_by_id(store.as_ref(), lo).unwrap().unwrap();
    let before = m.version;
    let fencer = JournalId {
        server: 9,
        epoch: 1,
    };
    kochab_server::recovery::claim(store.as_ref(), m, fencer, 0, &Default::default()).unwrap();
    // A's checkpoint of the changed table is refused, and A stops.
    let s = sa.clone();
    let err = blocking(move || s.checkpointer().round(&s).map(|_| ())).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
    assert!(sa.journal().failed(), "a fenced server stops");
    let m = read_manifest_by_id(store.as_ref(), lo).unwrap().unwrap();
    assert_eq!(m.version, before + 1, "the fencer's manifest stands");
    assert_eq!(m.owner.map(|o| o.server), Some(9));
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_start_new_incarnations_and_old_journals_are_collected() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a");
    let journals = |dir: &Path| -> Vec<JournalId> {
        let store = LocalStore::open(dir.join("store")).unwrap();
        kochab_journal::segment::list_journals(&store).unwrap()
    };
    let mut names: Vec<String> = Vec::new();
    for epoch in 1..=4u64 {
        let a = start(config(&dir)).await.unwrap();
        assert_eq!(
            a.shared().journal().id(),
            JournalId { server: 1, epoch },
            "every start is a new incarnation"
        );
        let sa = a.shared().clone();
        let root = a.root;
        for n in &names {
            assert!(
                matches!(lookup(&sa, root, n), Reply::Entry(_)),
                "{n} survives restart {epoch}"
            );
        }
        let name = format!("e{epoch}");
        // A new sequence number each time: the reply cache survives restarts, and would
        // answer a reused one as a retry.
        assert!(matches!(
            create(&sa, root, &name, epoch),
            Some(Reply::Entry(_))
        ));
        names.push(name);
        if epoch == 2 {
            // Without a clean stop (no final checkpoint; the directory lock goes with the
            // server): the next start seals and replays this journal.
            sa.journal().shutdown();
            drop(sa);
            drop(a);
            continue;
        }
        a.shutdown().await;
        // The final round let every older journal go.
        assert_eq!(journals(&dir), vec![JournalId { server: 1, epoch }]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_takeover_is_answered_from_the_moved_reply_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, lo, sa) = server_a(tmp.path()).await;
    let Some(Reply::Entry(first)) = create(&sa, root, "once", 42) else {
        panic!("create");
    };
    let b = member(&tmp.path().join("b"), &a, 2, 1).await;
    let sb = b.shared().clone();
    let journal = sa.journal().id();
    let s = sb.clone();
    blocking(move || s.recover_tables(&[lo], journal)).unwrap();
    // The client lost the reply and retries the same request at the new owner.
    match create(&sb, root, "once", 42) {
        Some(Reply::Entry(again)) => assert_eq!(again.id, first.id, "answered, not rerun"),
        other => panic!("retry answered with {other:?}"),
    }
    b.shutdown().await;
    a.shutdown().await;
}

/// A takeover's reply-cache entries outlive a crash of the server that took the table
/// over before its first checkpoint: its claim stopped naming the old journal (nothing
/// left to replay there after the old owner's checkpoint), whose reply snapshot held
/// them, so the table's manifest carries them. Found by the cluster simulation (seed 16:
/// a hard link retried after two failovers answered EEXIST, its own name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_two_takeovers_is_answered_from_the_reply_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, root, lo, sa) = server_a(tmp.path()).await;
    let Some(Reply::Entry(first)) = create(&sa, root, "once", 42) else {
        panic!("create");
    };
    let s = sa.clone();
    blocking(move || s.checkpointer().round(&s).map(|_| ())).unwrap();
    let b = member(&tmp.path().join("b"), &a, 2, 1).await;
    let sb = b.shared().clone();
    let (journal, s) = (sa.journal().id(), sb.clone());
    blocking(move || s.recover_tables(&[lo], journal)).unwrap();
    // B dies before any checkpoint of its own; C takes the table from B's journal.
    sb.journal().fail_stop("killed".into());
    let c = member(&tmp.path().join("c"), &a, 3, 1).await;
    let sc = c.shared().clone();
    let (journal, s) = (sb.journal().id(), sc.clone());
    blocking(move || s.recover_tables(&[lo], journal)).unwrap();
    match create(&sc, root, "once", 42) {
        Some(Reply::Entry(again)) => assert_eq!(again.id, first.id, "answered, not rerun"),
        other => panic!("retry answered with {other:?}"),
    }
    c.shutdown().await;
    b.shutdown().await;
    a.shutdown().await;
}

/// A table leaves a server in its replay window only once the window is over: its next
/// owner would run changes at once, while a lease the failed server granted may still be
/// cached (found by the cluster simulation, seed 71).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_leaves_a_server_in_its_replay_window_only_after_the_window() {
    let tmp = tempfile::tempdir().unwrap();
    let (_a, root, lo, sa) = server_a(tmp.path()).await;
    assert!(matches!(create(&sa, root, "f", 1), Some(Reply::Entry(_))));
    sa.replay_window().open();
    let s = sa.clone();
    let waits = blocking(move || {
        let mut waits = Vec::new();
        s.drop_table_waiting(lo, |ready| {
            let served = s.core().engine.table_index(lo).is_some();
            waits.push((ready(), served));
            if !ready() {
                // The window's time passes (a simulation's clock would move on).
                s.replay_window().close();
            }
        })
        .unwrap();
        waits
    });
    assert_eq!(
        waits,
        vec![(false, true), (true, false)],
        "the drop waits for the window with the table still served, then for its \
         revocations (none) with the table gone"
    );
    let s = sa.clone();
    sa.replay_window().open();
    let started = std::time::Instant::now();
    let lo2 = {
        let core = s.core();
        core.engine.tables().iter().map(|t| t.lo).find(|&t| t != lo)
    };
    if let Some(lo2) = lo2 {
        blocking(move || s.drop_table(lo2)).unwrap();
        assert!(
            started.elapsed()
                >= kochab_server::shared::REPLAY_WINDOW - std::time::Duration::from_millis(50),
            "a served core's drop waits the window out"
        );
    }
}

//! Durability under power loss: a create/rename/link/unlink load runs against a real server
//! process that loses power at random moments (at least 20 times) and is restarted: it is
//! stopped, what its object store had not synced is taken away (the store's crash
//! simulation, `kochab_store::crashsim`: every other time dropped whole, else torn block by
//! block), and it is killed. A plain SIGKILL would keep the page cache, so a missing fsync
//! would go unseen. After every restart, every acknowledged operation must be there, and
//! the one operation each worker had in flight must be either wholly there or wholly
//! absent; the server's invariant check (fsck) must find nothing.
//!
//! Each worker owns two directories: one in the primary region and one nested ten levels
//! deep, which the id policy places in the too-deep region, i.e. in another table. Renames
//! and links between them are multi-table operations, which must be atomic too.

mod common;

use common::{CRASH_SIM, LossReport, Rng, ServerProc, loss_for, runtime, seed};
use kochab_client::Client;
use kochab_proto::{Credentials, Errno, InodeId};
use std::collections::BTreeMap;
use std::time::Duration;

const WORKERS: usize = 8;
const KILLS: usize = 24;

/// What a worker believes its two directories hold: name -> inode id.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
struct Model {
    dirs: [BTreeMap<String, InodeId>; 2],
}

#[derive(Clone, Debug)]
enum Step {
    Create {
        dir: usize,
        name: String,
    },
    Rename {
        from: (usize, String),
        to: (usize, String),
    },
    Link {
        from: (usize, String),
        to: (usize, String),
    },
    Unlink {
        dir: usize,
        name: String,
    },
}

impl Model {
    /// The model after `step`; `created` is the id a create produced (unknown for an
    /// unacknowledged create, so any new id is accepted there).
    fn apply(&self, step: &Step, created: Option<InodeId>) -> Model {
        let mut m = self.clone();
        match step {
            Step::Create { dir, name } => {
                m.dirs[*dir].insert(name.clone(), created.unwrap_or(0));
            }
            Step::Rename { from, to } => {
                let same_inode = m.dirs[to.0]
                    .get(&to.1)
                    .is_some_and(|t| m.dirs[from.0].get(&from.1) == Some(t));
                if same_inode {
                    // Two names of one inode: POSIX rename does nothing.
                } else if let Some(id) = m.dirs[from.0].remove(&from.1) {
                    m.dirs[to.0].insert(to.1.clone(), id);
                }
            }
            Step::Link { from, to } => {
                if let Some(&id) = m.dirs[from.0].get(&from.1) {
                    m.dirs[to.0].insert(to.1.clone(), id);
                }
            }
            Step::Unlink { dir, name } => {
                m.dirs[*dir].remove(name);
            }
        }
        m
    }

    /// Equal, treating id 0 (an unacknowledged create) as matching any id.
    fn matches(&self, actual: &Model) -> bool {
        (0..2).all(|d| {
            self.dirs[d].len() == actual.dirs[d].len()
                && self.dirs[d]
                    .iter()
                    .zip(actual.dirs[d].iter())
                    .all(|((n1, i1), (n2, i2))| n1 == n2 && (*i1 == 0 || i1 == i2))
        })
    }
}

struct Worker {
    dirs: [InodeId; 2],
    model: Model,
    counter: u64,
    rng: Rng,
}

fn pick(rng: &mut Rng, m: &BTreeMap<String, InodeId>) -> Option<String> {
    if m.is_empty() {
        return None;
    }
    m.keys().nth(rng.below(m.len() as u64) as usize).cloned()
}

impl Worker {
    fn next_step(&mut self) -> Step {
        let dir = self.rng.below(2) as usize;
        let other = self.rng.below(2) as usize;
        let existing = pick(&mut self.rng, &self.model.dirs[dir]);
        self.counter += 1;
        let fresh = format!("f{}", self.counter);
        match (self.rng.below(10), existing) {
            (0..=3, _) | (_, None) => Step::Create { dir, name: fresh },
            (4..=5, Some(name)) => {
                // Sometimes onto an existing name: rename replaces it atomically.
                let to = match pick(&mut self.rng, &self.model.dirs[other]) {
                    Some(t) if self.rng.below(3) == 0 && t != name => t,
                    _ => fresh,
                };
                Step::Rename {
                    from: (dir, name),
                    to: (other, to),
                }
            }
            (6, Some(name)) => Step::Link {
                from: (dir, name),
                to: (other, fresh),
            },
            (_, Some(name)) => Step::Unlink { dir, name },
        }
    }

    /// Runs steps until one fails to get an answer; returns the step left in flight.
    async fn run(&mut self, client: &Client) -> Step {
        let cred = Credentials::root();
        loop {
            let step = self.next_step();
            let result = match &step {
                Step::Create { dir, name } => client
                    .create(&cred, self.dirs[*dir], name.as_bytes(), 0o644)
                    .await
                    .map(|a| Some(a.id)),
                Step::Rename { from, to } => client
                    .rename(
                        &cred,
                        self.dirs[from.0],
                        from.1.as_bytes(),
                        self.dirs[to.0],
                        to.1.as_bytes(),
                        0,
                    )
                    .await
                    .map(|_| None),
                Step::Link { from, to } => {
                    let id = self.model.dirs[from.0][&from.1];
                    client
                        .link(&cred, id, self.dirs[to.0], to.1.as_bytes())
                        .await
                        .map(|_| None)
                }
                Step::Unlink { dir, name } => client
                    .unlink(&cred, self.dirs[*dir], name.as_bytes())
                    .await
                    .map(|_| None),
            };
            match result {
                Ok(created) => self.model = self.model.apply(&step, created),
                Err(e) if matches!(e.errno, Errno::ENOTCONN | Errno::ETIMEDOUT) => return step,
                Err(e) => panic!("{step:?} failed unexpectedly: {e}"),
            }
        }
    }
}

async fn actual(client: &Client, dirs: [InodeId; 2]) -> Model {
    let cred = Credentials::root();
    let mut m = Model::default();
    for (d, &dir) in dirs.iter().enumerate() {
        let entries = client
            .readdir_all(&cred, dir, false)
            .await
            .expect("readdir after restart");
        // The primary directory also holds the path down to the deep one.
        for e in entries
            .into_iter()
            .filter(|e| e.kind != kochab_proto::FileKind::Dir)
        {
            m.dirs[d].insert(String::from_utf8(e.name).expect("utf8"), e.id);
        }
    }
    m
}

async fn make_dirs(client: &Client, w: usize) -> [InodeId; 2] {
    let cred = Credentials::root();
    let root = client.root();
    let base = match client.mkdir(&cred, root, b"dur", 0o755).await {
        Ok(a) => a.id,
        Err(_) => {
            client
                .lookup(&cred, root, b"dur")
                .await
                .expect("lookup dur")
                .id
        }
    };
    let a = client
        .mkdir(&cred, base, format!("w{w}").as_bytes(), 0o755)
        .await
        .expect("mkdir worker")
        .id;
    let mut deep = a;
    for level in 1..=8 {
        deep = client
            .mkdir(&cred, deep, format!("d{level}").as_bytes(), 0o755)
            .await
            .expect("mkdir deep")
            .id;
    }
    [a, deep]
}

#[test]
fn acknowledged_operations_survive_power_loss() {
    let seed = seed("acknowledged_operations_survive_power_loss");
    let mut rng = Rng::new(seed);
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    // Small segments and frequent checkpoints so that kills also land in rollovers,
    // checkpoint writes and journal trims.
    let flags = ["--checkpoint-records", "50", "--segment-bytes", "262144"];
    let rt = runtime();
    let start = || ServerProc::start_env(&data, "0", &flags, &CRASH_SIM);
    let mut server = start();
    let mut workers: Vec<Worker> = rt.block_on(async {
        let client = server.client(1).await;
        let mut ws = Vec::new();
        for w in 0..WORKERS {
            let dirs = make_dirs(&client, w).await;
            assert_ne!(
                kochab_meta_region(dirs[0]),
                kochab_meta_region(dirs[1]),
                "the deep directory overflowed into another region"
            );
            ws.push(Worker {
                dirs,
                model: Model::default(),
                counter: 0,
                rng: Rng::new(seed ^ ((w as u64 + 1) * 7919)),
            });
        }
        ws
    });
    let mut ambiguous_applied = 0usize;
    let mut lost = LossReport::default();
    for kill in 0..KILLS {
        let delay = Duration::from_millis(100 + rng.below(400));
        let pending: Vec<Step> = rt.block_on(async {
            let client = server.client(1).await;
            let mut handles = Vec::new();
            for mut w in workers.drain(..) {
                let client = client.clone();
                handles.push(tokio::spawn(async move {
                    let step = w.run(&client).await;
                    (w, step)
                }));
            }
            tokio::time::sleep(delay).await;
            lost += server.power_loss(loss_for(seed, kill as u64));
            let mut pending = Vec::new();
            for h in handles {
                let (w, step) = h.await.expect("worker task");
                workers.push(w);
                pending.push(step);
            }
            pending
        });
        server = start();
        rt.block_on(async {
            let client = server.client(1).await;
            for (w, step) in workers.iter_mut().zip(pending) {
                let got = actual(&client, w.dirs).await;
                let after = w.model.apply(&step, None);
                if w.model.matches(&got) {
                    // The step in flight never became durable.
                } else if after.matches(&got) {
                    ambiguous_applied += 1;
                    w.model = got;
                } else {
                    panic!(
                        "kill {kill}, seed {seed}: state matches neither before nor after {step:?}\nexpected {:?}\nor {:?}\ngot {:?}\nserver log:\n{}",
                        w.model,
                        after,
                        got,
                        server.log_text()
                    );
                }
            }
            let problems = client.fsck().await.expect("fsck");
            assert!(problems.is_empty(), "kill {kill}: invariants broken: {problems:?}");
        });
    }
    let total_steps: u64 = workers.iter().map(|w| w.counter).sum();
    let files: usize = workers
        .iter()
        .map(|w| w.model.dirs.iter().map(|d| d.len()).sum::<usize>())
        .sum();
    eprintln!(
        "{KILLS} power losses ({lost:?}), {total_steps} steps issued, {ambiguous_applied} in-flight steps found applied, {files} names at the end"
    );
    assert!(files > 0);
    // Each cut finds something unsynced (a spare segment's name, a checkpoint being
    // written): a run that took nothing away would not have tested the syncs.
    assert!(
        lost.writes_undone + lost.names_undone > 0,
        "the crash simulation took nothing away"
    );
    assert_eq!(server.stop(), Some(0), "clean shutdown");
}

fn kochab_meta_region(id: InodeId) -> u64 {
    id >> 62
}

#[test]
fn retried_create_after_a_crash_is_answered_from_the_reply_cache() {
    use kochab_proto::frame::{FRAME_HEADER_BYTES, decode_payload, encode_frame, parse_header};
    use kochab_proto::*;
    use std::io::{Read, Write};

    fn handshake(
        addr: std::net::SocketAddr,
        key: &auth::ClusterKey,
        client_id: u64,
    ) -> std::net::TcpStream {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        let (_, payload) = read_frame(&mut s);
        let ch: Challenge = decode_payload(&payload).expect("challenge");
        let mut out = Vec::new();
        encode_frame(
            &mut out,
            FrameKind::Auth,
            0,
            &Auth::prove(&auth::ClientKey::admin(*key), ch.nonce, [7; 32], client_id).0,
        )
        .unwrap();
        s.write_all(&out).unwrap();
        let (kind, _) = read_frame(&mut s);
        assert_eq!(kind, FrameKind::Welcome);
        s
    }
    fn read_frame(s: &mut std::net::TcpStream) -> (FrameKind, Vec<u8>) {
        let mut buf = Vec::new();
        loop {
            if let Some(h) = parse_header(&buf).expect("frame") {
                return (h.kind, buf[FRAME_HEADER_BYTES..h.total_len].to_vec());
            }
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).expect("read");
            assert!(n > 0, "closed");
            buf.extend_from_slice(&chunk[..n]);
        }
    }
    fn call(s: &mut std::net::TcpStream, req: &Request) -> Reply {
        let mut out = Vec::new();
        encode_frame(&mut out, FrameKind::Request, 1, req).unwrap();
        s.write_all(&out).unwrap();
        let (_, payload) = read_frame(s);
        decode_payload::<Reply>(&payload)
            .expect("reply")
            .without_dirs()
    }

    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut server = ServerProc::start_env(&data, "0", &[], &CRASH_SIM);
    let root = server_root(&server);
    let create = Request {
        cred: Credentials::root(),
        seq: 77,
        seq_floor: 77,
        map_version: 0,
        mode: Default::default(),
        op: Op::Mknod {
            parent: root,
            name: b"once".to_vec(),
            mode: 0o100644,
            rdev: 0,
            exclusive: true,
        },
    };
    let mut s = handshake(server.addr, &server.key, 4242);
    let first = call(&mut s, &create);
    let Reply::Entry(attr) = first else {
        panic!("create failed: {first:?}")
    };
    // The same request again (a retry): the same answer, not EEXIST.
    assert_eq!(call(&mut s, &create), Reply::Entry(attr.clone()));
    // After a power loss and restart the cache is rebuilt from the journal.
    server.power_loss(common::Loss::Drop);
    let server = ServerProc::start_env(&data, "0", &[], &CRASH_SIM);
    let mut s = handshake(server.addr, &server.key, 4242);
    match call(&mut s, &create) {
        Reply::Entry(a) => assert_eq!(a.id, attr.id),
        other => panic!("retry after restart: {other:?}"),
    }
    // A new sequence number is a new request: now the name exists.
    let again = Request {
        seq: 78,
        seq_floor: 78,
        map_version: 0,
        ..create.clone()
    };
    match call(&mut s, &again) {
        Reply::Error(e) => assert_eq!(e.errno, Errno::EEXIST),
        other => panic!("expected EEXIST, got {other:?}"),
    }
}

fn server_root(server: &ServerProc) -> InodeId {
    runtime().block_on(async { server.client(1).await.root() })
}

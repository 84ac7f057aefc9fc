//! File data moved by clients straight to and from the store on S3 (Ceph RGW), with the
//! capabilities a server hands out (issue 31): a grant's presigned PUT URL and commit
//! token, a layout's presigned GET URLs; what a token may commit; that an object put and
//! never committed is never visible and is collected; that objects freed by overwrites,
//! truncations and compaction are deleted; and that a SIGKILL of the server between a PUT
//! and its commit, or during a compaction, loses and doubles nothing.
//!
//! Needs a running RGW: `KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up)` names its env file.
//! Without it these tests fail, unless KOCHAB_S3_TESTS=0 says to skip them. The HTTP
//! requests to the presigned URLs are plain HTTP/1.1 over a loopback socket (RGW here
//! speaks http://), as any client without the store's credentials would make them.

mod common;

use common::s3::rgw_location;
use common::{Rng, ServerProc};
use kochab_client::{Client, ClientConfig};
use kochab_proto::auth::ClientKey;
use kochab_proto::layout::*;
use kochab_proto::*;
use kochab_s3store::{S3Location, S3Settings, S3Store};
use kochab_store::ObjectStore;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Grants of 2 s and a GC pass every second: expiry and collection within a test's time.
const TEST_ENV: &[(&str, &str)] = &[("KOCHAB_GRANT_SECS", "2"), ("KOCHAB_SLICE_GC_SECS", "1")];

/// How long the collector may take for an orphan: grant life (2 s) + margin (10 s) + two
/// passes, with room.
const GC_WAIT: Duration = Duration::from_secs(60);

struct Setup {
    env_file: PathBuf,
    location: S3Location,
    s3: S3Store,
    _dir: tempfile::TempDir,
    data: PathBuf,
}

fn setup(test: &str) -> Option<Setup> {
    let (env_file, location) = rgw_location(test)?;
    let vars = kochab_s3store::read_settings_file(&env_file).unwrap();
    let s3 = S3Store::open(&location, &S3Settings::from_vars(&vars).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    Some(Setup {
        env_file,
        location,
        s3,
        _dir: dir,
        data,
    })
}

impl Setup {
    fn up(&self) -> ServerProc {
        let url = self.location.to_string();
        let args = [
            "--store",
            url.as_str(),
            "--store-env",
            self.env_file.to_str().unwrap(),
        ];
        ServerProc::start_env(&self.data, "0", &args, TEST_ENV)
    }

    /// Objects in a file generation's folder.
    fn objects(&self, id: InodeId, generation: u64) -> Vec<String> {
        self.s3.list(&slice_folder(id, generation)).unwrap()
    }

    /// Waits until the folder holds `n` objects (panics after `GC_WAIT`).
    fn wait_objects(&self, id: InodeId, generation: u64, n: usize, what: &str) {
        let deadline = Instant::now() + GC_WAIT;
        loop {
            let got = self.objects(id, generation).len();
            if got == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {got} objects in the folder, {n} expected"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

async fn client(addr: std::net::SocketAddr, key: ClientKey) -> Client {
    let mut cfg = ClientConfig::new(addr, key);
    cfg.request_timeout = Duration::from_secs(20);
    Client::connect(cfg).await.expect("connect")
}

const O_RDONLY: u32 = libc::O_RDONLY as u32;
const O_RDWR: u32 = libc::O_RDWR as u32;

fn root() -> Credentials {
    Credentials::root()
}

/// One HTTP/1.1 request to a URL (`http://host:port/path?query`): status and body.
fn http(method: &str, url: &str, headers: &[(&str, String)], body: &[u8]) -> (u16, Vec<u8>) {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (host, target) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut s = TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut req = format!(
        "{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut len = None;
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let lower = l.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = Some(v.trim().parse::<usize>().unwrap());
        }
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
    }
    let mut out = Vec::new();
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            let n = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut b = vec![0u8; n + 2];
            r.read_exact(&mut b).unwrap();
            out.extend_from_slice(&b[..n]);
        }
    } else if let Some(n) = len {
        out.resize(n, 0);
        r.read_exact(&mut out).unwrap();
    } else {
        r.read_to_end(&mut out).unwrap();
    }
    (status, out)
}

/// A PUT with the headers a create-only URL signs (`If-None-Match: *` among them).
fn put_create(url: &str, body: &[u8]) -> u16 {
    let headers: Vec<(&str, String)> = kochab_store::Presign::PutCreate
        .headers()
        .iter()
        .map(|(k, v)| (*k, v.to_string()))
        .collect();
    http("PUT", url, &headers, body).0
}

async fn grant(c: &Client, handle: u64, objects: u32) -> Grant {
    match c
        .call(&root(), Op::DataGrant { handle, objects })
        .await
        .expect("grant")
    {
        Reply::Grant(g) => g,
        other => panic!("grant: {other:?}"),
    }
}

async fn commit(c: &Client, handle: u64, slices: Vec<CommittedSlice>, end: u64) -> FsResult<Attr> {
    match c
        .call(
            &root(),
            Op::CommitSlices {
                handle,
                slices,
                end,
            },
        )
        .await?
    {
        Reply::Attr(a) => Ok(a),
        other => panic!("commit: {other:?}"),
    }
}

async fn layout(c: &Client, handle: u64) -> Layout {
    match c
        .call(
            &root(),
            Op::Layout {
                handle,
                first_chunk: 0,
                chunks: 16,
            },
        )
        .await
        .expect("layout")
    {
        Reply::Layout(l) => l,
        other => panic!("layout: {other:?}"),
    }
}

/// Puts `data` at `pos` of `chunk` under granted object `g`; returns the slice to commit.
fn put_slice(g: &Grant, i: usize, chunk: u64, pos: u32, data: &[u8]) -> CommittedSlice {
    let o = &g.objects[i];
    let r = SliceRef {
        object: o.object,
        pos,
        len: data.len() as u32,
    };
    let status = put_create(&o.put_url, &encode_slice(chunk, &r, data));
    assert_eq!(status, 200, "PUT of a granted object");
    CommittedSlice {
        chunk,
        r,
        token: o.token.clone(),
        expires: g.expires,
    }
}

/// What a file reads as through its layout's URLs (chunk 0 only, `size` bytes).
fn read_by_layout(l: &Layout, size: u64) -> Vec<u8> {
    let mut out = vec![0u8; size as usize];
    for cl in &l.chunks {
        assert_eq!(cl.chunk, 0);
        for p in resolve_slices(&cl.refs, 0..size as u32) {
            let Some(r) = p.from else { continue };
            let i = cl.refs.iter().position(|x| *x == r).unwrap();
            let (start, end) = slice_fetch_range(&r, p.range);
            let (status, got) = http(
                "GET",
                &cl.get_urls[i],
                &[("Range", format!("bytes={start}-{}", end - 1))],
                &[],
            );
            assert!(status == 200 || status == 206, "GET: {status}");
            let bytes = decode_slice_range(0, &r, p.range, &got).unwrap();
            out[p.range.0 as usize..p.range.1 as usize].copy_from_slice(&bytes);
        }
    }
    out
}

async fn create(c: &Client, name: &str) -> (Attr, u64) {
    c.create_open(&root(), c.root(), name.as_bytes(), 0o644, O_RDWR)
        .await
        .expect("create")
}

fn errno<T: std::fmt::Debug>(r: FsResult<T>) -> Errno {
    r.expect_err("must fail").errno
}

#[test]
fn clients_put_commit_and_read_slices_by_capability() {
    let Some(st) = setup("direct") else { return };
    let server = st.up();
    common::runtime().block_on(async {
        let a = client(server.addr, ClientKey::admin(server.key)).await;
        let b = client(server.addr, ClientKey::admin(server.key)).await;
        let mut rng = Rng::new(common::seed("s3_direct"));

        // (a) A grant, a PUT straight to the store, a commit; another client reads the
        // bytes through its layout's URLs and through Read.
        let (f, fh) = create(&a, "f").await;
        let g = grant(&a, fh, 3).await;
        assert_eq!((g.id, g.generation), (f.id, f.generation));
        let data = rng.bytes(200_000);
        let s = put_slice(&g, 0, 0, 100, &data);
        let attr = commit(&a, fh, vec![s], 200_100).await.expect("commit");
        assert_eq!(attr.size, 200_100);
        let mut want = vec![0u8; 100];
        want.extend_from_slice(&data);
        let (_, bh) = b
            .create_open(&root(), b.root(), b"f", 0o644, O_RDONLY)
            .await
            .unwrap();
        let l = layout(&b, bh).await;
        assert_eq!(l.size, 200_100);
        assert_eq!(
            read_by_layout(&l, l.size),
            want,
            "read through the layout's URLs"
        );
        assert_eq!(
            b.read(&root(), bh, 0, 300_000).await.unwrap(),
            want,
            "through Read"
        );
        // A handle open for reading gets no grant.
        assert_eq!(
            errno(
                b.call(
                    &root(),
                    Op::DataGrant {
                        handle: bh,
                        objects: 1
                    }
                )
                .await
            ),
            Errno::EBADF
        );

        // (b) A granted URL creates its object once; without the header the signature
        // fails.
        let o = &g.objects[1];
        let r1 = SliceRef {
            object: o.object,
            pos: 0,
            len: 10,
        };
        assert_ne!(
            http("PUT", &o.put_url, &[], &encode_slice(0, &r1, &[1; 10])).0,
            200
        );
        assert_eq!(put_create(&o.put_url, &encode_slice(0, &r1, &[1; 10])), 200);
        assert_eq!(
            put_create(&o.put_url, &encode_slice(0, &r1, &[2; 10])),
            412,
            "a second PUT"
        );
        // A token of another file is refused.
        let (_, f2h) = create(&a, "f2").await;
        let stolen = CommittedSlice {
            chunk: 0,
            r: r1,
            token: o.token.clone(),
            expires: g.expires,
        };
        assert_eq!(
            errno(commit(&a, f2h, vec![stolen.clone()], 10).await),
            Errno::EACCES
        );
        // So is a token granted to another client key.
        let (id, key) = match a
            .call(
                &root(),
                Op::KeyAdd {
                    policy: KeyPolicy::TRUSTED,
                    note: "other".into(),
                },
            )
            .await
            .unwrap()
        {
            Reply::KeyAdded { id, key } => (id, key),
            other => panic!("key add: {other:?}"),
        };
        let other = client(server.addr, ClientKey { id, key }).await;
        let (_, oh) = other
            .create_open(&root(), other.root(), b"f", 0o644, O_RDWR)
            .await
            .unwrap();
        assert_eq!(
            errno(commit(&other, oh, vec![stolen.clone()], 10).await),
            Errno::EACCES
        );
        // And an expired one (grants live 2 s here).
        tokio::time::sleep(Duration::from_millis(3200)).await;
        assert_eq!(
            errno(commit(&a, fh, vec![stolen.clone()], 10).await),
            Errno::ETIMEDOUT
        );

        // (c) Neither object put and not committed is visible, and the collector deletes
        // them (the committed one stays).
        let l = layout(&b, bh).await;
        assert_eq!(l.chunks.len(), 1);
        assert_eq!(l.chunks[0].refs.len(), 1, "only the committed ref");
        assert_eq!(b.read(&root(), bh, 0, 300_000).await.unwrap(), want);
        let g2 = grant(&a, fh, 1).await;
        let _never = put_slice(&g2, 0, 0, 0, &[9u8; 50]);
        assert_eq!(st.objects(f.id, f.generation).len(), 3);
        st.wait_objects(f.id, f.generation, 1, "orphans collected");
        assert_eq!(
            b.read(&root(), bh, 0, 300_000).await.unwrap(),
            want,
            "the committed data stays"
        );
        let counters = a.status().await.unwrap().slices;
        assert!(counters.orphans_deleted >= 2, "{counters:?}");

        // (f) An overwrite that hides an object frees it; a truncation frees the rest.
        let g3 = grant(&a, fh, 2).await;
        let whole = rng.bytes(300_000);
        let s = put_slice(&g3, 0, 0, 0, &whole);
        commit(&a, fh, vec![s], 0).await.unwrap();
        st.wait_objects(f.id, f.generation, 1, "the hidden object freed");
        let mut want = whole.clone();
        assert_eq!(b.read(&root(), bh, 0, 300_000).await.unwrap(), want);
        let s = put_slice(&g3, 1, 0, 1000, &[5u8; 1000]);
        commit(&a, fh, vec![s], 0).await.unwrap();
        want[1000..2000].fill(5);
        assert_eq!(st.objects(f.id, f.generation).len(), 2);
        a.setattr(
            &root(),
            f.id,
            SetAttrs {
                size: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        st.wait_objects(
            f.id,
            f.generation,
            0,
            "a truncation to 0 frees every object",
        );
        assert!(b.read(&root(), bh, 0, 10).await.unwrap().is_empty());
        let counters = a.status().await.unwrap().slices;
        assert!(counters.freed_deleted >= 3, "{counters:?}");
    });
    drop(server);
}

#[test]
fn a_slice_put_before_a_server_sigkill_is_never_visible_and_is_collected() {
    let Some(st) = setup("kill-commit") else {
        return;
    };
    let mut server = st.up();
    let (f, committed) = common::runtime().block_on(async {
        let a = client(server.addr, ClientKey::admin(server.key)).await;
        let (f, fh) = create(&a, "f").await;
        let g = grant(&a, fh, 2).await;
        let s = put_slice(&g, 0, 0, 0, b"committed");
        commit(&a, fh, vec![s], 9).await.unwrap();
        a.fsync(&root(), fh, false).await.unwrap();
        // Put, and the server dies before the commit.
        let _lost = put_slice(&g, 1, 0, 0, b"NEVER SEEN");
        (f, b"committed".to_vec())
    });
    server.kill9();
    assert_eq!(st.objects(f.id, f.generation).len(), 2);
    let server = st.up();
    common::runtime().block_on(async {
        let a = client(server.addr, ClientKey::admin(server.key)).await;
        let h = open_for_reading(&a, b"f").await;
        let l = layout(&a, h).await;
        assert_eq!(l.chunks[0].refs.len(), 1);
        assert_eq!(a.read(&root(), h, 0, 100).await.unwrap(), committed);
        st.wait_objects(
            f.id,
            f.generation,
            1,
            "the uncommitted object collected after restart",
        );
        assert_eq!(a.read(&root(), h, 0, 100).await.unwrap(), committed);
    });
    drop(server);
}

fn model_write(m: &mut Vec<u8>, offset: usize, data: &[u8]) {
    if m.len() < offset + data.len() {
        m.resize(offset + data.len(), 0);
    }
    m[offset..offset + data.len()].copy_from_slice(data);
}

#[test]
fn compaction_bounds_refs_and_a_sigkill_during_it_loses_and_doubles_nothing() {
    let Some(st) = setup("compact") else { return };
    let mut server = st.up();
    let mut rng = Rng::new(common::seed("s3_direct_compact"));
    let mut model = Vec::new();
    let mut id = (0, 0);
    // Round 0 runs to quiescence; the others SIGKILL the server right after the writes
    // (and their fsync), when the compaction they queued is reading, putting or swapping.
    for round in 0..4u64 {
        let (f, done) = common::runtime().block_on(async {
            let a = client(server.addr, ClientKey::admin(server.key)).await;
            let (f, h) = if round == 0 {
                create(&a, "c").await
            } else {
                a.create_open(&root(), a.root(), b"c", 0o644, O_RDWR)
                    .await
                    .unwrap()
            };
            for _ in 0..40 {
                let off = rng.below(200_000) as usize;
                let n = 1 + rng.below(20_000) as usize;
                let d = rng.bytes(n);
                a.write(&root(), h, off as u64, d.clone()).await.unwrap();
                model_write(&mut model, off, &d);
            }
            a.fsync(&root(), h, false).await.unwrap();
            if round > 0 {
                tokio::time::sleep(Duration::from_millis(20 * round)).await;
                return (f, false);
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let l = layout(&a, h).await;
                let refs = l.chunks[0].refs.len();
                if refs <= 17 {
                    break;
                }
                assert!(Instant::now() < deadline, "{refs} refs stay in the chunk");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let got = a
                .read(&root(), h, 0, model.len() as u32 + 10)
                .await
                .unwrap();
            assert_eq!(got, model, "after compaction");
            let c = a.status().await.unwrap().slices;
            assert!(c.chunks_compacted >= 1, "{c:?}");
            (f, true)
        });
        id = (f.id, f.generation);
        if !done {
            server.kill9();
            server = st.up();
            common::runtime().block_on(async {
                let a = client(server.addr, ClientKey::admin(server.key)).await;
                let h = open_for_reading(&a, b"c").await;
                let got = a
                    .read(&root(), h, 0, model.len() as u32 + 10)
                    .await
                    .unwrap();
                assert_eq!(got, model, "after a SIGKILL in round {round}");
            });
        }
    }
    // What the kills left unreferenced (a compaction's new object, old ones whose deletion
    // never ran) is collected: the folder ends with the objects the refs name.
    common::runtime().block_on(async {
        let a = client(server.addr, ClientKey::admin(server.key)).await;
        let h = open_for_reading(&a, b"c").await;
        let refs = layout(&a, h).await.chunks[0].refs.len();
        st.wait_objects(id.0, id.1, refs, "only referenced objects left");
        assert_eq!(
            a.read(&root(), h, 0, model.len() as u32 + 10)
                .await
                .unwrap(),
            model
        );
    });
    drop(server);
}

/// A handle for reading the file `name` under the root, which exists.
async fn open_for_reading(a: &Client, name: &[u8]) -> u64 {
    let (_, h) = a
        .create_open(&root(), a.root(), name, 0o644, O_RDONLY)
        .await
        .unwrap();
    h
}

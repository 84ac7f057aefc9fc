//! The store over object_store's in-memory store, and over wrappers of it that behave as
//! engines do when they misbehave (or as Ceph RGW 16.2.15 does). The same checks against
//! a real Ceph RGW are in crates/cli/tests/s3_store.rs.

use super::*;
use futures_core::stream::BoxStream;
use kochab_store::newest_version;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta,
    PutMultipartOptions, PutResult,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

fn over(inner: Arc<dyn object_store::ObjectStore>) -> S3Store {
    S3Store::over(inner, "cluster-a", "memory").unwrap()
}

fn store() -> (S3Store, Arc<InMemory>) {
    let mem = Arc::new(InMemory::new());
    (over(mem.clone()), mem)
}

#[test]
fn put_get_list_delete() {
    let (s, mem) = store();
    s.put("a/x", b"one").unwrap();
    s.put("a/y", b"two").unwrap();
    s.put("a/x", b"three").unwrap();
    s.put("a/sub/z", b"deeper").unwrap();
    s.put("b/w", b"elsewhere").unwrap();
    assert_eq!(s.get("a/x").unwrap().unwrap(), b"three");
    // Folders are listed as a local directory lists its subdirectories.
    assert_eq!(s.list("a").unwrap(), vec!["a/sub", "a/x", "a/y"]);
    assert!(s.exists("a/y").unwrap());
    s.delete("a/x").unwrap();
    s.delete("a/x").unwrap();
    assert_eq!(s.get("a/x").unwrap(), None);
    assert!(!s.exists("a/x").unwrap());
    assert!(s.list("missing").unwrap().is_empty());
    assert_eq!(s.capacity().unwrap().free_bytes, REPORTED_CAPACITY);
    s.sync_dir("a").unwrap();
    s.delete_folder("a").unwrap();
    // Everything is under the prefix: another prefix over the same bucket sees none of it.
    let raw = Path::from("cluster-a/a/y");
    assert!(tokio_block(mem.head(&raw)).is_ok());
    let other = S3Store::over(mem, "cluster-b", "memory").unwrap();
    assert!(other.list("a").unwrap().is_empty());
    assert_eq!(other.get("a/y").unwrap(), None);
    for bad in ["", "../x", "a//b", "/abs", "sp ace"] {
        let e = s.put(bad, b"x").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{bad:?}");
    }
}

fn tokio_block<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn create_if_absent_refuses_an_existing_name() {
    let (s, _) = store();
    s.create_if_absent("a/seal", b"one").unwrap();
    let e = s.create_if_absent("a/seal", b"two").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    assert_eq!(s.get("a/seal").unwrap().unwrap(), b"one");
    // Same bytes from another writer: still refused (the token tells them apart).
    let e = s.create_if_absent("a/seal", b"one").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
}

/// 8 creators x 20 rounds on one name each: exactly one wins, and the object is its write.
fn race(s: &Arc<S3Store>, rounds: usize) {
    for round in 0..rounds {
        let name = format!("race/r{round}");
        let barrier = Arc::new(std::sync::Barrier::new(8));
        let handles: Vec<_> = (0..8u8)
            .map(|k| {
                let (s, name, barrier) = (s.clone(), name.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    s.create_if_absent(&name, &[k; 4096]).map(|()| k)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let winners: Vec<u8> = results
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .copied()
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        for r in &results {
            if let Err(e) = r {
                assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
            }
        }
        assert_eq!(s.get(&name).unwrap().unwrap(), vec![winners[0]; 4096]);
    }
}

#[test]
fn of_racing_creators_exactly_one_wins() {
    race(&Arc::new(store().0), 20);
}

#[test]
fn a_stale_version_cannot_be_swapped_in() {
    let s = store().0;
    assert_eq!(newest_version(&s, "t/manifest").unwrap(), None);
    assert_eq!(s.swap_version("t/manifest", 0, b"v1").unwrap(), 1);
    assert_eq!(s.swap_version("t/manifest", 1, b"v2").unwrap(), 2);
    let e = s.swap_version("t/manifest", 1, b"late").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    assert_eq!(
        newest_version(&s, "t/manifest").unwrap(),
        Some((2, b"v2".to_vec()))
    );
}

#[test]
fn positioned_io_is_refused() {
    let s = store().0;
    let msg = |e: io::Error| {
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("no positioned I/O"), "{e}");
    };
    msg(s.open("journal/1.1/0001.seg", true).err().unwrap());
    msg(s.open_direct("x/y", true).err().unwrap());
    msg(s.open_sync_direct("x/y").err().unwrap());
    msg(s.rename("x/y", "x/z").unwrap_err());
}

#[test]
fn usable_and_droppable_inside_a_runtime() {
    // Server code calls the store from tasks of its runtime: neither a call nor the drop
    // may panic there (a nested block_on or a runtime dropped in async context would).
    for rt in [
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap(),
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap(),
    ] {
        rt.block_on(async {
            let s = store().0;
            s.put("a/b", b"x").unwrap();
            assert_eq!(s.get("a/b").unwrap().unwrap(), b"x");
            s.create_if_absent("a/c", b"y").unwrap();
            drop(s);
        });
    }
}

/// How a wrapped in-memory store misbehaves.
#[derive(Debug, Clone, Copy)]
enum Quirk {
    /// Ignores If-None-Match: a conditional create overwrites.
    IgnoresConditions,
    /// Applies the first conditional create but answers it 412, as a client sees it whose
    /// first try succeeded, whose answer was lost, and whose retry was refused.
    RetryAfterSuccess,
    /// Applies the first conditional create but its answer never arrives (a transport
    /// error the client does not retry).
    LostAnswer,
    /// Answers a losing conditional create with 500 instead of 412 (Ceph RGW 16.2.15).
    FiveHundredOnLoss,
}

#[derive(Debug)]
struct Quirky {
    inner: InMemory,
    quirk: Quirk,
    creates: AtomicUsize,
}

impl Quirky {
    fn new(quirk: Quirk) -> Arc<Quirky> {
        Arc::new(Quirky {
            inner: InMemory::new(),
            quirk,
            creates: AtomicUsize::new(0),
        })
    }
}

impl std::fmt::Display for Quirky {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Quirky({:?})", self.quirk)
    }
}

fn generic(msg: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "quirky",
        source: msg.to_string().into(),
    }
}

#[async_trait::async_trait]
impl object_store::ObjectStore for Quirky {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        mut opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        if !matches!(opts.mode, PutMode::Create) {
            return self.inner.put_opts(location, payload, opts).await;
        }
        let first = self.creates.fetch_add(1, Ordering::SeqCst) == 0;
        match self.quirk {
            Quirk::IgnoresConditions => {
                opts.mode = PutMode::Overwrite;
                self.inner.put_opts(location, payload, opts).await
            }
            Quirk::RetryAfterSuccess if first => {
                self.inner.put_opts(location, payload, opts).await?;
                Err(object_store::Error::AlreadyExists {
                    path: location.to_string(),
                    source: "Server returned non-2xx status code: 412 Precondition Failed".into(),
                })
            }
            Quirk::LostAnswer if first => {
                self.inner.put_opts(location, payload, opts).await?;
                Err(generic("connection reset before the answer"))
            }
            Quirk::FiveHundredOnLoss => match self.inner.put_opts(location, payload, opts).await {
                Err(object_store::Error::AlreadyExists { .. }) => Err(generic(
                    "Server returned non-2xx status code: 500 Internal Server Error: ",
                )),
                r => r,
            },
            _ => self.inner.put_opts(location, payload, opts).await,
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[test]
fn a_retried_create_whose_first_try_succeeded_is_a_success() {
    for quirk in [Quirk::RetryAfterSuccess, Quirk::LostAnswer] {
        let s = over(Quirky::new(quirk));
        // The first try was applied; its answer says otherwise; the token read back says
        // it is this writer's.
        s.create_if_absent("m/x", b"mine").unwrap();
        assert_eq!(s.get("m/x").unwrap().unwrap(), b"mine");
        // A later writer of the same bytes did not win.
        let e = s.create_if_absent("m/x", b"mine").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{quirk:?}: {e}");
        // A retry of the winner's own create (same token) still is a success.
        let s = over(Quirky::new(quirk));
        s.create_if_absent_as("m/y", b"v", "token-1").unwrap();
        s.create_if_absent_as("m/y", b"v", "token-1").unwrap();
        let e = s.create_if_absent_as("m/y", b"v", "token-2").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    }
}

#[test]
fn an_object_without_a_token_is_told_by_its_bytes() {
    let (s, _) = store();
    // Written by something else (no writer token): the same bytes count as ours, others
    // do not.
    s.put("m/plain", b"same").unwrap();
    s.create_if_absent("m/plain", b"same").unwrap();
    let e = s.create_if_absent("m/plain", b"different").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
}

#[test]
fn a_lost_race_answered_500_is_already_exists() {
    let s = Arc::new(over(Quirky::new(Quirk::FiveHundredOnLoss)));
    s.create_if_absent("m/x", b"first").unwrap();
    let e = s.create_if_absent("m/x", b"second").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    assert!(e.to_string().contains("500"), "{e}");
    race(&s, 5);
    let t = s.self_test().unwrap();
    assert!(t.to_string().contains("500"), "{t}");
}

#[test]
fn the_self_test_passes_an_engine_with_conditional_create() {
    let (s, mem) = store();
    let t = s.self_test().unwrap();
    assert_eq!(t.lines.len(), 2, "{t}");
    assert!(t.lines[1].contains("exactly one won"), "{t}");
    // The probes are gone.
    let probes = Path::from("cluster-a/kochab-selftest");
    let left = tokio_block(object_store::ObjectStore::list_with_delimiter(
        mem.as_ref(),
        Some(&probes),
    ))
    .unwrap();
    assert!(left.objects.is_empty(), "{left:?}");
}

#[test]
fn the_self_test_refuses_an_engine_that_ignores_if_none_match() {
    let s = over(Quirky::new(Quirk::IgnoresConditions));
    let e = s.self_test().unwrap_err();
    assert!(e.contains("does not honour conditional create"), "{e}");
    assert!(e.contains("2xx"), "{e}");
}

#[test]
fn ranged_gets_return_just_the_range() {
    let (s, _mem) = store();
    s.put("d/x", b"0123456789").unwrap();
    assert_eq!(s.get_range("d/x", 2, 3).unwrap().unwrap(), b"234");
    assert_eq!(
        s.get_range("d/x", 7, 100).unwrap().unwrap(),
        b"789",
        "short at the end"
    );
    assert_eq!(s.get_range("d/x", 4, 0).unwrap().unwrap(), b"");
    assert_eq!(s.get_range("d/none", 0, 4).unwrap(), None);
    assert_eq!(s.get_range("d/none", 0, 0).unwrap(), None);
}

#[test]
fn stores_not_over_http_hand_out_no_urls() {
    let (s, _) = store();
    assert_eq!(
        s.presign("d/x", Presign::Get, Duration::from_secs(60)),
        None
    );
    let mem = kochab_store::MemStore::objects_only();
    assert_eq!(
        mem.presign("d/x", Presign::PutCreate, Duration::from_secs(60)),
        None
    );
    let dir = tempfile::tempdir().unwrap();
    let local = kochab_store::LocalStore::open(dir.path()).unwrap();
    assert_eq!(
        local.presign("d/x", Presign::Get, Duration::from_secs(60)),
        None
    );
}

/// The store on the Ceph RGW that KOCHAB_S3_ENV names (`scripts/ceph-rgw.sh up`), under a
/// prefix of its own; `None` (the test is skipped, with a message) without it, or with
/// KOCHAB_S3_TESTS=0.
fn rgw_store(test: &str) -> Option<S3Store> {
    let env_file = match std::env::var_os("KOCHAB_S3_ENV") {
        Some(f) if std::env::var("KOCHAB_S3_TESTS").as_deref() != Ok("0") => f,
        _ => {
            eprintln!(
                "KOCHAB_S3_ENV is not set: skipping {test} against Ceph RGW \
                 (run with KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up))"
            );
            return None;
        }
    };
    let text = std::fs::read_to_string(&env_file).unwrap();
    let bucket = text
        .lines()
        .find_map(|l| l.strip_prefix("export KOCHAB_S3_BUCKET="))
        .expect("KOCHAB_S3_BUCKET in the env file");
    let vars = read_settings_file(std::path::Path::new(&env_file)).unwrap();
    let settings = S3Settings::from_vars(&vars).unwrap();
    let tag = new_token().unwrap();
    let location = S3Location::parse(&format!("s3://{bucket}/t/{test}-{tag}")).unwrap();
    Some(S3Store::open(&location, &settings).unwrap())
}

/// One request to a presigned URL: status and body.
fn send(
    method: reqwest::Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Vec<u8>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut req = reqwest::Client::new()
            .request(method, url)
            .timeout(Duration::from_secs(30));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.body(body.to_vec()).send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.bytes().await.unwrap().to_vec())
    })
}

/// What a create sends: `If-None-Match: *` and the private ACL.
fn create() -> &'static [(&'static str, &'static str)] {
    Presign::PutCreate.headers()
}

#[test]
fn a_presigned_put_creates_once_and_never_overwrites() {
    let Some(s) = rgw_store("presign-put") else {
        return;
    };
    let minute = Duration::from_secs(60);
    let url = s.presign("d/x", Presign::PutCreate, minute).unwrap();
    assert!(
        url.contains("X-Amz-SignedHeaders=host%3Bif-none-match%3Bx-amz-acl"),
        "{url}"
    );
    let acl = ("x-amz-acl", "bucket-owner-full-control");

    // Without If-None-Match, with another value, or without the ACL: refused, nothing
    // written.
    for (what, headers) in [
        ("no header", vec![]),
        ("no If-None-Match", vec![acl]),
        (
            "another If-None-Match",
            vec![("If-None-Match", "\"abc\""), acl],
        ),
        ("no ACL", vec![("If-None-Match", "*")]),
        (
            "a public ACL",
            vec![("If-None-Match", "*"), ("x-amz-acl", "public-read")],
        ),
    ] {
        let (status, _) = send(reqwest::Method::PUT, &url, &headers, what.as_bytes());
        assert_eq!(status, 403, "a PUT with {what}");
    }
    assert_eq!(s.get("d/x").unwrap(), None);

    let (status, body) = send(reqwest::Method::PUT, &url, create(), b"first bytes");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(s.get("d/x").unwrap().unwrap(), b"first bytes");
    // Only the store's owner reads it: not a request without a signature.
    let unsigned = url.split_once('?').unwrap().0;
    assert_eq!(send(reqwest::Method::GET, unsigned, &[], b"").0, 403);

    // The same URL again: the object exists, the precondition fails.
    let (status, _) = send(reqwest::Method::PUT, &url, create(), b"second");
    assert_eq!(status, 412, "a second create through the same URL");
    let (status, _) = send(reqwest::Method::PUT, &url, &[acl], b"third");
    assert_eq!(status, 403, "an overwrite without If-None-Match");
    assert_eq!(s.get("d/x").unwrap().unwrap(), b"first bytes");

    // The URL names its object and its method: not another object, not a read.
    let other = url.replacen("/d/x?", "/d/y?", 1);
    let (status, _) = send(reqwest::Method::PUT, &other, create(), b"elsewhere");
    assert_eq!(status, 403, "the URL of d/x used for d/y");
    assert_eq!(s.get("d/y").unwrap(), None);
    let (status, _) = send(reqwest::Method::GET, &url, &[], b"");
    assert_eq!(status, 403, "a PUT URL used to read");
    s.delete("d/x").unwrap();
}

#[test]
fn a_presigned_get_reads_a_range() {
    let Some(s) = rgw_store("presign-get") else {
        return;
    };
    s.put("d/r", b"0123456789").unwrap();
    let url = s
        .presign("d/r", Presign::Get, Duration::from_secs(60))
        .unwrap();
    let (status, body) = send(reqwest::Method::GET, &url, &[("Range", "bytes=2-4")], b"");
    assert_eq!((status, body.as_slice()), (206, &b"234"[..]));
    let (status, body) = send(reqwest::Method::GET, &url, &[], b"");
    assert_eq!((status, body.as_slice()), (200, &b"0123456789"[..]));
    // Reading grants no write.
    let (status, _) = send(reqwest::Method::PUT, &url, create(), b"over");
    assert_eq!(status, 403, "a GET URL used to write");
    assert_eq!(s.get("d/r").unwrap().unwrap(), b"0123456789");
    // A missing object: 404, as to its owner.
    let url = s
        .presign("d/none", Presign::Get, Duration::from_secs(60))
        .unwrap();
    assert_eq!(send(reqwest::Method::GET, &url, &[], b"").0, 404);
    s.delete("d/r").unwrap();
}

#[test]
fn an_expired_url_is_refused() {
    let Some(s) = rgw_store("presign-expired") else {
        return;
    };
    s.put("d/e", b"old").unwrap();
    let get = s
        .presign("d/e", Presign::Get, Duration::from_secs(1))
        .unwrap();
    let put = s
        .presign("d/n", Presign::PutCreate, Duration::from_secs(1))
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(send(reqwest::Method::GET, &get, &[], b"").0, 403);
    assert_eq!(send(reqwest::Method::PUT, &put, create(), b"late").0, 403);
    assert_eq!(s.get("d/n").unwrap(), None);
    s.delete("d/e").unwrap();
}

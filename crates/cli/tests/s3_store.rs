//! The store on S3 against a real Ceph RGW, and the engine self-test (of the store and of
//! `kochab up/mds/fsck --store`) against a proxy in front of it that strips
//! `If-None-Match` from requests: an engine that does not honour conditional create.
//!
//! Needs a running RGW: `KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up)` names its env file
//! (endpoint, keys, bucket). Without it these tests fail, unless KOCHAB_S3_TESTS=0 says
//! to skip them.

mod common;

use common::{ServerProc, kochab_bin};
use kochab_s3store::{S3Location, S3Settings, S3Store};
use kochab_store::{ObjectStore, newest_version};
use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// The RGW the tests run against.
struct Rgw {
    env_file: PathBuf,
    vars: BTreeMap<String, String>,
    bucket: String,
    endpoint: SocketAddr,
}

impl Rgw {
    /// `None` (the test is skipped) only if KOCHAB_S3_TESTS=0.
    fn get() -> Option<Rgw> {
        if std::env::var("KOCHAB_S3_TESTS").as_deref() == Ok("0") {
            eprintln!("KOCHAB_S3_TESTS=0: skipping the tests against Ceph RGW");
            return None;
        }
        let env_file = PathBuf::from(std::env::var("KOCHAB_S3_ENV").unwrap_or_else(|_| {
            panic!(
                "these tests need a Ceph RGW: run them with \
                 KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up), or skip them with KOCHAB_S3_TESTS=0"
            )
        }));
        let text = std::fs::read_to_string(&env_file).unwrap();
        let bucket = text
            .lines()
            .find_map(|l| l.strip_prefix("export KOCHAB_S3_BUCKET="))
            .expect("KOCHAB_S3_BUCKET in the env file")
            .to_string();
        let vars = kochab_s3store::read_settings_file(&env_file).unwrap();
        let endpoint = vars["AWS_ENDPOINT_URL"]
            .strip_prefix("http://")
            .unwrap()
            .parse()
            .unwrap();
        Some(Rgw {
            env_file,
            vars,
            bucket,
            endpoint,
        })
    }

    /// A prefix of its own for one test, so tests and runs never see each other's objects.
    fn location(&self, test: &str) -> S3Location {
        let mut b = [0u8; 6];
        getrandom::fill(&mut b).unwrap();
        let tag: String = b.iter().map(|x| format!("{x:02x}")).collect();
        S3Location::parse(&format!("s3://{}/t/{test}-{tag}", self.bucket)).unwrap()
    }

    /// Its variables with the endpoint replaced (to go through a proxy).
    fn vars_via(&self, endpoint: SocketAddr) -> BTreeMap<String, String> {
        let mut v = self.vars.clone();
        v.insert("AWS_ENDPOINT_URL".into(), format!("http://{endpoint}"));
        v
    }

    fn store(&self, test: &str) -> S3Store {
        let settings = S3Settings::from_vars(&self.vars).unwrap();
        S3Store::open(&self.location(test), &settings).unwrap()
    }

    /// A store at a location made by [`Rgw::location`].
    fn store_at(&self, location: &S3Location) -> S3Store {
        let settings = S3Settings::from_vars(&self.vars).unwrap();
        S3Store::open(location, &settings).unwrap()
    }

    fn store_via(&self, test: &str, endpoint: SocketAddr) -> S3Store {
        let settings = S3Settings::from_vars(&self.vars_via(endpoint)).unwrap();
        S3Store::open(&self.location(test), &settings).unwrap()
    }
}

#[test]
fn put_get_list_delete_on_rgw() {
    let Some(rgw) = Rgw::get() else { return };
    let s = rgw.store("basic");
    s.put("a/x", b"one").unwrap();
    s.put("a/y", b"two").unwrap();
    s.put("a/x", b"three").unwrap();
    s.put("a/sub/z", &vec![7u8; 3 << 20]).unwrap();
    assert_eq!(s.get("a/x").unwrap().unwrap(), b"three");
    assert_eq!(s.get("a/sub/z").unwrap().unwrap(), vec![7u8; 3 << 20]);
    assert_eq!(s.list("a").unwrap(), vec!["a/sub", "a/x", "a/y"]);
    assert!(s.exists("a/y").unwrap());
    for n in ["a/x", "a/x", "a/y", "a/sub/z"] {
        s.delete(n).unwrap();
    }
    assert_eq!(s.get("a/x").unwrap(), None);
    assert!(!s.exists("a/y").unwrap());
    assert!(s.list("a").unwrap().is_empty());
    let e = s.open("journal/1.1/x", true).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[test]
fn conditional_create_on_rgw_has_one_winner() {
    let Some(rgw) = Rgw::get() else { return };
    let s = Arc::new(rgw.store("race"));
    s.create_if_absent("m/seal", b"").unwrap();
    let e = s.create_if_absent("m/seal", b"").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    // 8 creators x 20 rounds on one name each: exactly one wins, the object is its write,
    // and every loser is told AlreadyExists (RGW's 500s for losers included).
    let mut answers = BTreeMap::<String, usize>::new();
    for round in 0..20 {
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
                let msg = e.to_string();
                let said = msg.split("answered ").nth(1).unwrap_or(&msg);
                let said = said.trim_end_matches(')').to_string();
                *answers.entry(said).or_default() += 1;
            }
        }
        assert_eq!(s.get(&name).unwrap().unwrap(), vec![winners[0]; 4096]);
    }
    eprintln!("losers were answered: {answers:?}");
    // Versions: a writer with a stale version is refused.
    assert_eq!(s.swap_version("t/manifest", 0, b"v1").unwrap(), 1);
    assert_eq!(s.swap_version("t/manifest", 1, b"v2").unwrap(), 2);
    let e = s.swap_version("t/manifest", 1, b"late").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    assert_eq!(
        newest_version(s.as_ref(), "t/manifest").unwrap(),
        Some((2, b"v2".to_vec()))
    );
}

#[test]
fn a_retried_create_whose_first_try_succeeded_succeeds_on_rgw() {
    let Some(rgw) = Rgw::get() else { return };
    // The retry of one writer (same token) is told from another writer of the same bytes.
    let s = rgw.store("retry");
    s.create_if_absent_as("m/x", b"v", "token-a").unwrap();
    s.create_if_absent_as("m/x", b"v", "token-a").unwrap();
    let e = s.create_if_absent_as("m/x", b"v", "token-b").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    // For real: the proxy lets the first conditional PUT reach RGW but answers 500 in its
    // place; the client retries, RGW refuses the retry with 412, and the object read back
    // is this writer's.
    let proxy = Proxy::start(rgw.endpoint, Mode::LoseFirstCreateAnswer, &rgw.vars);
    let s = rgw.store_via("retry-proxy", proxy.addr);
    s.create_if_absent("m/y", b"mine").unwrap();
    assert_eq!(proxy.swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(s.get("m/y").unwrap().unwrap(), b"mine");
    let e = s.create_if_absent("m/y", b"mine").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
}

/// PUT latency through the store: printed, not asserted.
#[test]
fn put_latency_printout() {
    let Some(rgw) = Rgw::get() else { return };
    let s = rgw.store("latency");
    let data = vec![0x5au8; 4096];
    let mut put = Vec::new();
    let mut create = Vec::new();
    for i in 0..200 {
        let t = Instant::now();
        s.put(&format!("p/{i}"), &data).unwrap();
        put.push(t.elapsed());
        let t = Instant::now();
        s.create_if_absent(&format!("c/{i}"), &data).unwrap();
        create.push(t.elapsed());
    }
    let pct = |v: &mut Vec<Duration>, p: usize| {
        v.sort();
        v[(v.len() * p / 100).min(v.len() - 1)].as_secs_f64() * 1000.0
    };
    let (mut get, mut list) = (Vec::new(), Vec::new());
    for i in 0..200 {
        let t = Instant::now();
        assert_eq!(s.get(&format!("p/{i}")).unwrap().unwrap(), data);
        get.push(t.elapsed());
        if i % 10 == 0 {
            let t = Instant::now();
            assert_eq!(s.list("c").unwrap().len(), 200);
            list.push(t.elapsed());
        }
    }
    let mut delete = Vec::new();
    for i in 0..200 {
        let t = Instant::now();
        s.delete(&format!("p/{i}")).unwrap();
        delete.push(t.elapsed());
        s.delete(&format!("c/{i}")).unwrap();
    }
    eprintln!(
        "4 KiB through the store on RGW, 200 each: put p50 {:.2} ms p99 {:.2} ms; \
         conditional create p50 {:.2} ms p99 {:.2} ms; get p50 {:.2} ms; list of 200 p50 {:.2} ms; delete p50 {:.2} ms p99 {:.2} ms",
        pct(&mut put, 50),
        pct(&mut put, 99),
        pct(&mut create, 50),
        pct(&mut create, 99),
        pct(&mut get, 50),
        pct(&mut list, 50),
        pct(&mut delete, 50),
        pct(&mut delete, 99)
    );
}

#[test]
fn the_self_test_passes_rgw_and_refuses_it_without_if_none_match() {
    let Some(rgw) = Rgw::get() else { return };
    let s = rgw.store("selftest");
    let report = s.self_test().unwrap();
    eprintln!("self-test against RGW: {report}");
    assert!(report.to_string().contains("exactly one won"), "{report}");
    assert!(s.list("kochab-selftest").unwrap().is_empty(), "probes left");

    let proxy = Proxy::start(rgw.endpoint, Mode::StripIfNoneMatch, &rgw.vars);
    let e = rgw
        .store_via("selftest-proxy", proxy.addr)
        .self_test()
        .unwrap_err();
    eprintln!("self-test through the stripping proxy: {e}");
    assert!(e.contains("does not honour conditional create"), "{e}");
    assert!(proxy.stripped.load(Ordering::SeqCst) >= 2);
}

fn kochab(args: &[&str], env: &BTreeMap<String, String>) -> Output {
    let mut c = Command::new(kochab_bin());
    c.args(args);
    for k in kochab_s3store::VARIABLES {
        c.env_remove(k);
    }
    c.env_remove("KOCHAB_STORE_ENV");
    c.envs(env);
    let out = c.output().unwrap();
    eprintln!(
        "kochab {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn store_bench_measures_and_leaves_nothing_behind() {
    let Some(rgw) = Rgw::get() else { return };
    let location = rgw.location("store-bench");
    let url = location.to_string();
    let out = kochab(
        &[
            "store",
            "bench",
            "--store",
            &url,
            "--parallel",
            "4",
            "--size",
            "256KiB",
            "--total",
            "2MiB",
            "--json",
        ],
        &rgw.vars,
    );
    assert!(out.status.success());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for phase in ["put", "get"] {
        assert_eq!(r[phase]["objects"], 8, "{r}");
        assert_eq!(r[phase]["bytes"], 2 << 20, "{r}");
        assert!(r[phase]["mb_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert_eq!(r["parallel"], 4);
    assert!(r["client"].as_str().unwrap().contains("ObjectStore"), "{r}");
    // Its objects are gone, the self-test's probes too.
    let s = rgw.store_at(&location);
    assert!(s.list("store-bench").unwrap().is_empty());
    assert!(s.list("kochab-selftest").unwrap().is_empty());
    // Without a store, or with a size past its limit: refused before any request.
    let out = kochab(&["store", "bench", "--total", "1MiB"], &rgw.vars);
    assert!(!out.status.success());
    let out = kochab(
        &["store", "bench", "--store", &url, "--size", "1GiB"],
        &rgw.vars,
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--size"));
}

#[test]
fn kochab_commands_self_test_the_store_and_refuse_a_bad_engine() {
    let Some(rgw) = Rgw::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(rgw.endpoint, Mode::StripIfNoneMatch, &rgw.vars);
    let url = rgw.location("cli").to_string();
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let key = dir.path().join("no.key");
    let mds = [
        "mds",
        "--id",
        "2",
        "--listen",
        &listen,
        "--coord",
        "127.0.0.1:9",
        "--key-file",
        key.to_str().unwrap(),
        "--store",
        &url,
    ];

    // Through the proxy (settings from the standard variables): refused, with what the
    // engine answered.
    let out = kochab(&mds, &rgw.vars_via(proxy.addr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("refusing the store"), "{err}");
    assert!(err.contains("does not honour conditional create"), "{err}");
    assert!(err.contains("2xx"), "{err}");

    // `kochab up` the same, its settings from a file.
    let proxied = dir.path().join("proxied.env");
    let text: String = rgw
        .vars_via(proxy.addr)
        .iter()
        .map(|(k, v)| format!("export {k}={v}\n"))
        .collect();
    std::fs::write(&proxied, text).unwrap();
    let private = std::os::unix::fs::PermissionsExt::from_mode(0o600);
    std::fs::set_permissions(&proxied, private).unwrap();
    let data = dir.path().join("data");
    let up = |env_file: &Path| {
        kochab(
            &[
                "up",
                "--data",
                data.to_str().unwrap(),
                "--port",
                "0",
                "--store",
                &url,
                "--store-env",
                env_file.to_str().unwrap(),
            ],
            &BTreeMap::new(),
        )
    };
    let out = up(&proxied);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("does not honour conditional create"), "{err}");

    assert!(!data.exists(), "nothing was started on the local directory");

    // Straight to RGW: the engine passes, and `kochab mds` goes on to read its key (a
    // cluster of servers on RGW runs: see tests/cluster_s3.rs).
    let out = kochab(&mds, &rgw.vars);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("honours conditional create"), "{err}");
    assert!(err.contains("no.key"), "{err}");
    let out = kochab(&["fsck", "--store", &url], &rgw.vars);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("holds no Kochab cluster"), "{err}");

    // A malformed location or missing keys are refused before any request.
    let out = kochab(&["fsck", "--store", "s3://No_Such"], &rgw.vars);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a bucket name"));
    let out = kochab(&["fsck", "--store", &url], &BTreeMap::new());
    assert!(String::from_utf8_lossy(&out.stderr).contains("AWS_ACCESS_KEY_ID"));
}

/// The journal as objects over the S3 store itself (on object_store's in-memory store, no
/// RGW needed): its conditional create with writer tokens, `get_many` and `delete_many`
/// under the journal's writer, trimming, fencing and recovery.
#[test]
fn the_journal_runs_over_the_s3_store_in_memory() {
    use kochab_journal::{Journal, JournalId, JournalOptions};
    let s: Arc<dyn ObjectStore> = Arc::new(S3Store::in_memory("j").unwrap());
    let old = JournalId {
        server: 1,
        epoch: 1,
    };
    let opts = JournalOptions {
        segment_bytes: 1 << 20,
        fsync: true,
        ..Default::default()
    };
    let j = Arc::new(Journal::start(s.clone(), old, 1, opts.clone(), None).unwrap());
    assert!(j.as_objects());
    let writer = {
        let j = j.clone();
        std::thread::spawn(move || {
            let mut acked = Vec::new();
            for i in 1..=4000u64 {
                let lsn = j.append(format!("record {i}").as_bytes());
                if i % 4 == 0 {
                    if !j.wait_durable(lsn) {
                        break;
                    }
                    acked.push(lsn);
                    if i == 1000 {
                        j.trim(900).unwrap();
                    }
                }
            }
            acked
        })
    };
    // Fenced mid-stream: every record acknowledged is in what the sealer reads.
    let deadline = Instant::now() + Duration::from_secs(30);
    while j.durable_lsn() < 1200 {
        assert!(Instant::now() < deadline, "writes go on");
        std::thread::sleep(Duration::from_millis(1));
    }
    kochab_journal::seal(s.as_ref(), old).unwrap();
    let mut seen = Vec::new();
    kochab_journal::recover(s.as_ref(), old, 899, |l, p| {
        assert_eq!(p, format!("record {l}").as_bytes());
        seen.push(l);
        Ok(())
    })
    .unwrap();
    let acked = writer.join().unwrap();
    let next = j.append(b"after the fence");
    assert!(
        !j.wait_durable(next),
        "the fenced writer's next commit is refused"
    );
    assert!(j.failure().unwrap().contains("sealed"));
    assert_eq!(
        seen.first(),
        Some(&900),
        "trimmed below 900, read from there"
    );
    for l in acked.iter().filter(|l| **l >= 900) {
        assert!(seen.contains(l), "acknowledged {l} not read");
    }
    // A trimmed record is asked for in vain, never silently skipped.
    assert!(kochab_journal::recover(s.as_ref(), old, 10, |_, _| Ok(())).is_err());
}

/// `kochab fsck --store URL` of a stopped server's store: asserts it is clean.
fn fsck_store_clean(rgw: &Rgw, url: &str, what: &str) -> String {
    let out = kochab(&["fsck", "--store", url], &rgw.vars);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what}: fsck failed:\n{text}");
    assert!(
        text.contains("server namespace") && text.contains(": clean"),
        "{what}: {text}"
    );
    text
}

/// Creates files `<prefix>-w<writer>-<i>` in directory `d` from `writers` concurrent tasks
/// (durable replies: the native client's default) until one fails; counts each answer in
/// `count` as it comes. Returns the names that were acknowledged.
async fn create_until_failure(
    c: Arc<kochab_client::Client>,
    d: u64,
    prefix: String,
    writers: usize,
    count: Arc<AtomicUsize>,
) -> Vec<String> {
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let (c, prefix, count) = (c.clone(), prefix.clone(), count.clone());
            tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0.. {
                    let name = format!("{prefix}-w{w}-{i}");
                    let cred = kochab_proto::Credentials::root();
                    if c.create(&cred, d, name.as_bytes(), 0o644).await.is_err() {
                        break;
                    }
                    acked.push(name);
                    count.fetch_add(1, Ordering::SeqCst);
                }
                acked
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Waits (bounded) until `count` reaches `n`.
async fn wait_count(count: &AtomicUsize, n: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while count.load(Ordering::SeqCst) < n {
        assert!(Instant::now() < deadline, "{what}: only {count:?} of {n}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The directory `d` under the root, made if missing.
async fn dir_d(c: &kochab_client::Client) -> u64 {
    let cred = kochab_proto::Credentials::root();
    match c.lookup(&cred, c.root(), b"d").await {
        Ok(a) => a.id,
        Err(_) => c.mkdir(&cred, c.root(), b"d", 0o755).await.unwrap().id,
    }
}

/// Asserts that every name in `names` is in directory `d`.
async fn all_there(c: &kochab_client::Client, d: u64, names: &[String], what: &str) {
    let cred = kochab_proto::Credentials::root();
    let listed: std::collections::BTreeSet<Vec<u8>> = c
        .readdir_all(&cred, d, false)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    let lost: Vec<&String> = names
        .iter()
        .filter(|n| !listed.contains(n.as_bytes()))
        .collect();
    assert!(
        lost.is_empty(),
        "{what}: {} of {} acknowledged creates lost, e.g. {:?}",
        lost.len(),
        names.len(),
        &lost[..lost.len().min(5)]
    );
}

/// `kochab up --store` on Ceph RGW: the journal is objects there, checkpoints are written
/// (images in parts) and the journal trimmed while creates run; the server is SIGKILLed
/// three times in the middle of a stream of creates with durable replies, and after each
/// restart every acknowledged create is there; after a clean stop `kochab fsck --store`
/// finds the store clean. Nothing of the journal or checkpoints is in the local directory.
#[test]
fn a_server_on_rgw_keeps_every_acknowledged_create_across_sigkills() {
    let Some(rgw) = Rgw::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let location = rgw.location("server");
    let url = location.to_string();
    let env_file = rgw.env_file.to_str().unwrap().to_string();
    let extra = [
        "--store",
        url.as_str(),
        "--store-env",
        env_file.as_str(),
        "--checkpoint-records",
        "400",
    ];
    let rt = common::runtime();
    let mut acked: Vec<String> = Vec::new();
    for round in 0..3 {
        let mut server = ServerProc::start_env(&data, "0", &extra, &[]);
        let got = rt.block_on(async {
            let c = Arc::new(server.client(1).await);
            let d = dir_d(&c).await;
            all_there(&c, d, &acked, &format!("after restart {round}")).await;
            let count = Arc::new(AtomicUsize::new(0));
            let writers = tokio::spawn(create_until_failure(
                c.clone(),
                d,
                format!("r{round}"),
                16,
                count.clone(),
            ));
            // Past a checkpoint round (every 400 records), then the kill, mid-stream.
            wait_count(&count, 900, "creates before the kill").await;
            server.kill9();
            writers.await.unwrap()
        });
        assert!(got.len() >= 900);
        acked.extend(got);
    }
    let mut server = ServerProc::start_env(&data, "0", &extra, &[]);
    rt.block_on(async {
        let c = server.client(1).await;
        let d = dir_d(&c).await;
        all_there(&c, d, &acked, "after the last restart").await;
        let cred = kochab_proto::Credentials::root();
        c.create(&cred, d, b"last", 0o644).await.unwrap();
    });
    assert_eq!(server.stop(), Some(0), "{}", server.log_text());
    let text = fsck_store_clean(&rgw, &url, "after a clean stop");
    assert!(text.contains("objects"), "{text}");

    // What is where: journals as objects and checkpoint images on S3, none of it local.
    let s = rgw.store_at(&location);
    let journals = s.list("journal").unwrap();
    assert_eq!(
        journals,
        ["journal/1.4"],
        "one incarnation per start, and the sealed ones no table needs are deleted"
    );
    let newest = journals.last().unwrap();
    let names = s.list(newest).unwrap();
    assert!(names.iter().any(|n| n.ends_with(".jo")), "{names:?}");
    assert!(!names.iter().any(|n| n.ends_with(".seg")), "{names:?}");
    let tables = s.list("tables").unwrap();
    let images: usize = tables
        .iter()
        .map(|t| {
            s.list(t)
                .unwrap()
                .iter()
                .filter(|n| n.contains(".img"))
                .count()
        })
        .sum();
    assert!(images > 0, "checkpoint images on S3");
    assert!(s.get("cluster.json").unwrap().is_some());
    assert!(newest_version(&s, "servers/1/epoch").unwrap().unwrap().0 >= 4);
    assert!(!data.join("store/journal").exists());
    assert!(!data.join("store/tables").exists());
}

/// Two `kochab up --store` over one bucket on RGW, on two local directories (two hosts):
/// the second takes the first's tables over by sealing its journal (a fence object under
/// the name the first writes next) and claiming its manifests. The first's next commit is
/// refused by RGW itself, so it acknowledges nothing more and stops; everything it
/// acknowledged is served by the second.
#[test]
fn a_second_server_on_the_same_store_fences_the_first() {
    let Some(rgw) = Rgw::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let url = rgw.location("fence").to_string();
    let env_file = rgw.env_file.to_str().unwrap().to_string();
    let extra = ["--store", url.as_str(), "--store-env", env_file.as_str()];
    let rt = common::runtime();
    let mut a = ServerProc::start_env(&dir.path().join("a"), "0", &extra, &[]);
    let (c, d, count, writers) = rt.block_on(async {
        let c = Arc::new(a.client(1).await);
        let d = dir_d(&c).await;
        let count = Arc::new(AtomicUsize::new(0));
        let writers = tokio::spawn(create_until_failure(
            c.clone(),
            d,
            "a".into(),
            8,
            count.clone(),
        ));
        wait_count(&count, 300, "creates on the first server").await;
        (c, d, count, writers)
    });
    // The second start seals the first's journal while its writers run. Its host holds a
    // copy of the cluster key: the store records which key is the cluster's, and a start
    // with another is refused.
    let b_dir = dir.path().join("b");
    let mut args = vec!["up", "--data", b_dir.to_str().unwrap(), "--port", "0"];
    args.extend(extra);
    let out = kochab(&args, &BTreeMap::new());
    let stranger = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stranger.contains("not the key of the cluster"),
        "{stranger}"
    );
    std::fs::copy(a.data.join("cluster.key"), b_dir.join("cluster.key")).unwrap();
    let mut b = ServerProc::start_env(&b_dir, "0", &extra, &[]);
    let acked = rt.block_on(async {
        let acked = tokio::time::timeout(Duration::from_secs(60), writers)
            .await
            .expect("the fenced server stops acknowledging")
            .unwrap();
        let cred = kochab_proto::Credentials::root();
        assert!(
            c.create(&cred, d, b"after-the-fence", 0o644).await.is_err(),
            "the fenced server acknowledges nothing more"
        );
        acked
    });
    assert!(acked.len() >= 300 && count.load(Ordering::SeqCst) == acked.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.alive() {
        assert!(Instant::now() < deadline, "the fenced server exits");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = a.log_text();
    assert!(log.contains("sealed"), "{log}");
    rt.block_on(async {
        let c = b.client(1).await;
        let d = dir_d(&c).await;
        all_there(&c, d, &acked, "on the server that took over").await;
        let cred = kochab_proto::Credentials::root();
        assert!(c.lookup(&cred, d, b"after-the-fence").await.is_err());
    });
    assert_eq!(b.stop(), Some(0), "{}", b.log_text());
    fsck_store_clean(&rgw, &url, "after the takeover");
}

/// What the proxy does to conditional creates (requests with `If-None-Match`).
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Strips the header and signs the request again without it: RGW sees a plain PUT,
    /// as an engine that ignores the condition would treat it.
    StripIfNoneMatch,
    /// Forwards the first one, drops RGW's answer and answers 500 instead.
    LoseFirstCreateAnswer,
}

/// A TCP proxy on loopback in front of RGW, one request per connection (it asks RGW to
/// close after each answer, so it sees every request's head).
struct Proxy {
    addr: SocketAddr,
    stripped: Arc<AtomicUsize>,
    swallowed: Arc<AtomicUsize>,
    _rt: tokio::runtime::Runtime,
}

/// Longest request head the proxy reads.
const HEAD_MAX: usize = 64 << 10;

impl Proxy {
    fn start(upstream: SocketAddr, mode: Mode, vars: &BTreeMap<String, String>) -> Proxy {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let stripped = Arc::new(AtomicUsize::new(0));
        let swallowed = Arc::new(AtomicUsize::new(0));
        let secret: Arc<str> = vars["AWS_SECRET_ACCESS_KEY"].as_str().into();
        let (st, sw) = (stripped.clone(), swallowed.clone());
        rt.spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (st, sw, secret) = (st.clone(), sw.clone(), secret.clone());
                tokio::spawn(async move {
                    let _ = relay(conn, upstream, mode, &secret, &st, &sw).await;
                });
            }
        });
        Proxy {
            addr,
            stripped,
            swallowed,
            _rt: rt,
        }
    }
}

async fn relay(
    conn: TcpStream,
    upstream: SocketAddr,
    mode: Mode,
    secret: &str,
    stripped: &AtomicUsize,
    swallowed: &AtomicUsize,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn);
    let mut lines: Vec<String> = Vec::new();
    let mut size = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 {
            return Ok(());
        }
        size += line.len();
        if size > HEAD_MAX {
            return Ok(());
        }
        if line == "\r\n" {
            break;
        }
        lines.push(line.trim_end_matches(['\r', '\n']).to_string());
    }
    let header = |name: &str| {
        lines[1..].iter().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let conditional = header("if-none-match").is_some();
    let length: u64 = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let lose = matches!(mode, Mode::LoseFirstCreateAnswer)
        && conditional
        && swallowed
            .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
    if conditional && matches!(mode, Mode::StripIfNoneMatch) {
        lines = resign_without_if_none_match(&lines, secret);
        stripped.fetch_add(1, Ordering::SeqCst);
    }
    lines.retain(|l| !l.to_ascii_lowercase().starts_with("connection:"));
    lines.push("Connection: close".to_string());
    let mut head = lines.join("\r\n");
    head.push_str("\r\n\r\n");
    let mut up = TcpStream::connect(upstream).await?;
    up.write_all(head.as_bytes()).await?;
    let buffered = reader.buffer().to_vec();
    let mut conn = reader.into_inner();
    up.write_all(&buffered).await?;
    if !lose {
        tokio::io::copy_bidirectional(&mut conn, &mut up).await?;
        return Ok(());
    }
    let rest = length.saturating_sub(buffered.len() as u64);
    tokio::io::copy(&mut (&mut conn).take(rest), &mut up).await?;
    let mut answer = Vec::new();
    up.read_to_end(&mut answer).await?;
    conn.write_all(
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await?;
    conn.shutdown().await
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    use hmac::{Hmac, KeyInit, Mac};
    let mut m = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key).unwrap();
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// The request head `lines` (request line, then headers) without `If-None-Match`, signed
/// again (AWS Signature V4) with the same key, date and scope over the remaining headers.
fn resign_without_if_none_match(lines: &[String], secret: &str) -> Vec<String> {
    use sha2::Digest;
    let mut headers: Vec<(String, String)> = lines[1..]
        .iter()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.trim().to_ascii_lowercase(), v.trim().to_string()))
        })
        .filter(|(k, _)| k != "if-none-match")
        .collect();
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {name} header in {lines:?}"))
    };
    let auth = get("authorization");
    let field = |name: &str| {
        auth.split([' ', ','])
            .find_map(|p| p.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {auth}"))
            .to_string()
    };
    let credential = field("Credential=");
    let (access, scope) = credential.split_once('/').unwrap();
    let signed: Vec<String> = field("SignedHeaders=")
        .split(';')
        .filter(|h| *h != "if-none-match")
        .map(str::to_string)
        .collect();
    let mut parts = lines[0].split(' ');
    let (method, target) = (parts.next().unwrap(), parts.next().unwrap());
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut query: Vec<&str> = query.split('&').filter(|q| !q.is_empty()).collect();
    query.sort_unstable();
    let canonical_headers: String = signed.iter().map(|h| format!("{h}:{}\n", get(h))).collect();
    let canonical = format!(
        "{method}\n{path}\n{}\n{canonical_headers}\n{}\n{}",
        query.join("&"),
        signed.join(";"),
        get("x-amz-content-sha256")
    );
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{}\n{scope}\n{}",
        get("x-amz-date"),
        hex(&sha2::Sha256::digest(canonical.as_bytes()))
    );
    let mut key = format!("AWS4{secret}").into_bytes();
    for part in scope.split('/') {
        key = hmac(&key, part.as_bytes());
    }
    let signature = hex(&hmac(&key, to_sign.as_bytes()));
    headers.retain(|(k, _)| k != "authorization");
    headers.push((
        "authorization".to_string(),
        format!(
            "AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={}, \
             Signature={signature}",
            signed.join(";")
        ),
    ));
    std::iter::once(lines[0].clone())
        .chain(headers.into_iter().map(|(k, v)| format!("{k}: {v}")))
        .collect()
}

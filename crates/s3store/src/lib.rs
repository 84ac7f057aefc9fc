//! The object store over the S3 API: an existing distributed object store (Ceph RGW, AWS S3)
//! holds the objects, through the `object_store` crate.
//!
//! What fencing rests on, conditional create, is a single PUT with `If-None-Match: *`
//! (`PutMode::Create`). Engines differ in how they answer it, and a PUT whose reply is lost
//! may be retried after it succeeded, so every create carries a writer token (user
//! metadata, `x-amz-meta-kochab-writer`): whenever the answer is not a plain success the
//! object is read back, and it is ours if it carries our token (or, for an object without
//! one, our bytes). That covers what Ceph RGW 16.2.15 does:
//! - a losing conditional PUT may get 500 instead of 412 (the client retries it and gets
//!   412, or exhausts its retries; either way the object read back is another's);
//! - a retried create whose first try succeeded gets 412 (the object read back is ours).
//!
//! Nothing here writes by multipart upload (RGW's CompleteMultipartUpload ignores
//! If-None-Match): every object is one PUT. Nothing uses If-Match either (RGW honours it
//! only with the etag unquoted); versions are new objects made by conditional create
//! ([`ObjectStore::swap_version`]).
//!
//! At start, [`S3Store::self_test`] refuses an engine that does not honour conditional
//! create. There is no positioned I/O (`open` and its kin, `rename` return `Unsupported`,
//! and [`ObjectStore::positioned_io`] is false): the journal on this store is a sequence of
//! immutable objects and checkpoint images are written in whole parts (`kochab-journal`,
//! `kochab-server`); file data is immutable slice objects written by the server
//! (`kochab-server`'s `data::slices`), read back by ranged GETs ([`ObjectStore::get_range`]).
//!
//! [`ObjectStore::presign`] hands out SigV4 presigned URLs of single objects (a GET, or a
//! PUT that can only create: its signature covers `If-None-Match: *`), through which a
//! client without the store's keys reads or writes file data itself (module `presign`).
//!
//! The store's trait is synchronous and is called from server code, some of it on tokio
//! runtimes. Requests run on a small runtime owned by the store; a caller waits for the
//! answer on a plain channel, which never enters a runtime (so no `block_on` inside one).

mod config;
mod presign;
mod selftest;

pub use config::{S3Location, S3Settings, VARIABLES, read_settings_file};
pub use presign::PRESIGN_EXPIRY_MAX;
pub use selftest::SelfTest;

use bytes::Bytes;
use kochab_store::{Capacity, Object, ObjectStore, Presign, validate_object_name};
use object_store::aws::{AmazonS3Builder, S3ConditionalPut};
use object_store::path::Path as Key;
use object_store::{
    Attribute, Attributes, BackoffConfig, ClientOptions, GetOptions, ObjectStoreExt, PutMode,
    PutOptions, PutPayload, RetryConfig,
};
use std::future::Future;
use std::io::{self, ErrorKind};
use std::sync::Arc;
use std::time::Duration;

/// Threads of the store's runtime. Requests are waits on the network: two threads drive
/// hundreds in flight, and more would only compete with the server's own threads.
const RUNTIME_THREADS: usize = 2;
/// Longest wait for one HTTP request: an object is at most a few MiB, which even a slow
/// link moves well within this, while a wedged engine is noticed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a connection to the engine (on one network, a few milliseconds).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries of a request the engine failed with 5xx, 429 or a connection error. Ceph RGW
/// answers a lost conditional-create race with 500 now and then: one retry settles it.
const MAX_RETRIES: usize = 5;
/// Time within which retries are made: a start against an engine that is down fails in
/// about this long instead of object_store's default three minutes.
const RETRY_TIMEOUT: Duration = Duration::from_secs(20);
/// GETs `get_many` keeps in flight (recovery reading a journal of many small objects):
/// enough to hide a few milliseconds of engine latency per object.
pub const REQUESTS_IN_FLIGHT_MAX: usize = 16;
/// DELETEs `delete_many` keeps in flight. Trimming runs beside the journal's own PUTs, which
/// wait on the same engine: four keep up with a journal's objects (at 5 ms each, 800/s
/// against the 200-300 objects/s a journal makes on RGW here) without crowding them out.
pub const DELETES_IN_FLIGHT_MAX: usize = 4;
/// User-metadata key of the writer token (`x-amz-meta-kochab-writer`).
const WRITER_KEY: &str = "kochab-writer";
/// Bytes of a writer token: 128 random bits, so two writers never share one.
const TOKEN_BYTES: usize = 16;
/// What `capacity` reports: an object store has no fixed size, and statfs must show
/// something; 1 PiB reads as "plenty" without overflowing a client's arithmetic.
pub const REPORTED_CAPACITY: u64 = 1 << 50;

/// The objects of one bucket under one prefix, over the S3 API.
pub struct S3Store {
    remote: Remote,
    /// Signs presigned URLs; `None` over a store that is not reached by HTTP (tests).
    presigner: Option<presign::Presigner>,
    handle: tokio::runtime::Handle,
    /// Dropped with `shutdown_background`: a store dropped on a runtime's thread must not
    /// block it (dropping a runtime there would panic).
    runtime: Option<tokio::runtime::Runtime>,
}

/// The asynchronous half: what runs on the store's runtime.
#[derive(Clone)]
struct Remote {
    inner: Arc<dyn object_store::ObjectStore>,
    /// "" or "PREFIX/".
    prefix: String,
    /// `s3://BUCKET/PREFIX at ENDPOINT`, for messages.
    name: Arc<str>,
}

/// The answer to one conditional create: the result the caller gets, and what the engine
/// said (for the self-test's report).
struct CreateAttempt {
    result: io::Result<()>,
    answer: String,
}

/// Who wrote an object, as read back after an unclear answer to a conditional create.
enum Writer {
    Us,
    Other,
    Nobody,
}

impl S3Store {
    /// A store over the bucket and prefix of `location`, reached with `settings`. Nothing
    /// is sent yet: [`S3Store::self_test`] is the first request.
    pub fn open(location: &S3Location, settings: &S3Settings) -> io::Result<S3Store> {
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&location.bucket)
            .with_region(&settings.region)
            .with_access_key_id(&settings.access_key_id)
            .with_secret_access_key(&settings.secret_access_key)
            .with_allow_http(settings.allow_http)
            .with_conditional_put(S3ConditionalPut::ETagMatch)
            .with_retry(RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: MAX_RETRIES,
                retry_timeout: RETRY_TIMEOUT,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(settings.allow_http)
                    .with_timeout(REQUEST_TIMEOUT)
                    .with_connect_timeout(CONNECT_TIMEOUT),
            );
        if let Some(endpoint) = &settings.endpoint {
            // Path-style requests (the builder's default), as engines on an address take.
            builder = builder.with_endpoint(endpoint);
        }
        if let Some(token) = &settings.session_token {
            builder = builder.with_token(token);
        }
        let s3 = builder.build().map_err(|e| {
            io::Error::new(
                ErrorKind::InvalidInput,
                format!("{location}: cannot set up the S3 client: {e}"),
            )
        })?;
        let mut store = S3Store::over(
            Arc::new(s3),
            &location.prefix,
            &format!("{location} at {}", settings.endpoint_name()),
        )?;
        store.presigner = Some(presign::Presigner::open(location, settings)?);
        Ok(store)
    }

    /// A store over any `object_store` implementation (tests use its in-memory one), with
    /// object names under `prefix` ("" for none); `name` appears in messages.
    pub fn over(
        inner: Arc<dyn object_store::ObjectStore>,
        prefix: &str,
        name: &str,
    ) -> io::Result<S3Store> {
        let prefix = prefix.trim_matches('/');
        if !prefix.is_empty() {
            validate_object_name(prefix)?;
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("kochab-s3")
            .enable_all()
            .build()?;
        Ok(S3Store {
            remote: Remote {
                inner,
                prefix: if prefix.is_empty() {
                    String::new()
                } else {
                    format!("{prefix}/")
                },
                name: name.into(),
            },
            presigner: None,
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
        })
    }

    /// A store over `object_store`'s in-memory store, for tests of code above the store
    /// (the journal as objects, through this crate's conditional create).
    pub fn in_memory(prefix: &str) -> io::Result<S3Store> {
        S3Store::over(
            Arc::new(object_store::memory::InMemory::new()),
            prefix,
            "memory",
        )
    }

    /// `s3://BUCKET/PREFIX at ENDPOINT`.
    pub fn name(&self) -> &str {
        &self.remote.name
    }

    /// Runs `f` on the store's runtime and waits for it on a channel: safe from any thread,
    /// a runtime's included (it blocks that thread, as any synchronous store call does).
    fn run<T: Send + 'static>(
        &self,
        f: impl Future<Output = io::Result<T>> + Send + 'static,
    ) -> io::Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(f.await);
        });
        rx.recv().unwrap_or_else(|_| {
            Err(io::Error::other(format!(
                "{}: the store's runtime stopped",
                self.remote.name
            )))
        })
    }

    /// Checks that the engine honours conditional create, as fencing needs: a second
    /// create of a probe object must be refused, and of several racing creates exactly one
    /// may succeed. `Err` says what the engine answered; the probes are deleted after.
    pub fn self_test(&self) -> Result<SelfTest, String> {
        let remote = self.remote.clone();
        self.run(async move { Ok(selftest::run(&remote).await) })
            .unwrap_or_else(|e| Err(e.to_string()))
    }

    /// A conditional create with a given writer token: what a retry of an earlier attempt
    /// with that token looks like. For tests of the retry-after-success case.
    #[doc(hidden)]
    pub fn create_if_absent_as(&self, name: &str, data: &[u8], token: &str) -> io::Result<()> {
        let (remote, name, data, token) = (
            self.remote.clone(),
            name.to_string(),
            Bytes::copy_from_slice(data),
            token.to_string(),
        );
        self.run(async move { remote.create(&name, data, &token).await.result })
    }
}

impl Drop for S3Store {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// A fresh writer token.
fn new_token() -> io::Result<String> {
    let mut b = [0u8; TOKEN_BYTES];
    getrandom::fill(&mut b).map_err(|e| io::Error::other(format!("no randomness: {e}")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// The I/O error kind of an object_store error.
fn kind_of(e: &object_store::Error) -> ErrorKind {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => ErrorKind::NotFound,
        E::AlreadyExists { .. } | E::Precondition { .. } => ErrorKind::AlreadyExists,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => ErrorKind::PermissionDenied,
        E::NotImplemented { .. } | E::NotSupported { .. } => ErrorKind::Unsupported,
        _ => ErrorKind::Other,
    }
}

/// Longest engine answer quoted in a message.
const ANSWER_MAX: usize = 300;

/// What the engine answered, briefly: the HTTP status object_store quotes in its messages
/// ("status code: 412 Precondition Failed") and its retries, or else the message itself.
pub(crate) fn answer(e: &object_store::Error) -> String {
    let text = e.to_string();
    let status = text.find("status code: ").map(|i| {
        let rest = &text[i + "status code: ".len()..];
        rest.split(':').next().unwrap_or(rest).trim().to_string()
    });
    let retries = text
        .find("after ")
        .and_then(|i| text[i..].split(',').next())
        .filter(|s| s.ends_with("retries"));
    match (status, retries) {
        (Some(s), Some(r)) => format!("{s} ({r})"),
        (Some(s), None) => s,
        (None, _) => {
            let mut t = text;
            if t.len() > ANSWER_MAX {
                let mut end = ANSWER_MAX;
                while !t.is_char_boundary(end) {
                    end -= 1;
                }
                t.truncate(end);
                t.push_str("...");
            }
            t
        }
    }
}

impl Remote {
    fn key(&self, name: &str) -> io::Result<Key> {
        validate_object_name(name)?;
        Key::parse(format!("{}{name}", self.prefix))
            .map_err(|e| io::Error::new(ErrorKind::InvalidInput, format!("{name:?}: {e}")))
    }

    fn error(&self, op: &str, name: &str, e: object_store::Error) -> io::Error {
        io::Error::new(kind_of(&e), format!("{}: {op} {name}: {e}", self.name))
    }

    /// A plain conditional create: the engine's answer, nothing read back.
    async fn create_raw(&self, name: &str, data: Bytes, token: &str) -> object_store::Result<()> {
        let key = self.key(name).map_err(|e| object_store::Error::Generic {
            store: "S3",
            source: Box::new(e),
        })?;
        let mut attributes = Attributes::new();
        attributes.insert(
            Attribute::Metadata(WRITER_KEY.into()),
            token.to_string().into(),
        );
        let opts = PutOptions {
            mode: PutMode::Create,
            attributes,
            ..PutOptions::default()
        };
        self.inner
            .put_opts(&key, PutPayload::from(data), opts)
            .await
            .map(|_| ())
    }

    /// A conditional create whose unclear answers are settled by reading the object back
    /// (see the crate's documentation).
    async fn create(&self, name: &str, data: Bytes, token: &str) -> CreateAttempt {
        let e = match self.create_raw(name, data.clone(), token).await {
            Ok(()) => {
                return CreateAttempt {
                    result: Ok(()),
                    answer: "created".to_string(),
                };
            }
            Err(e) => e,
        };
        let said = answer(&e);
        let result = match self.writer_of(name, &data, token).await {
            Ok(Writer::Us) => {
                return CreateAttempt {
                    result: Ok(()),
                    answer: format!("{said}, yet the object is this writer's"),
                };
            }
            Ok(Writer::Other) => Err(io::Error::new(
                ErrorKind::AlreadyExists,
                format!(
                    "{}: object {name} exists (the engine answered {said})",
                    self.name
                ),
            )),
            // Refused, then deleted by its writer: it did exist.
            Ok(Writer::Nobody) if kind_of(&e) == ErrorKind::AlreadyExists => Err(io::Error::new(
                ErrorKind::AlreadyExists,
                format!(
                    "{}: object {name} existed (the engine answered {said})",
                    self.name
                ),
            )),
            Ok(Writer::Nobody) => Err(self.error("conditional create of", name, e)),
            Err(read) => Err(io::Error::new(
                kind_of(&e),
                format!(
                    "{}: conditional create of {name}: {said}; reading it back to see whose it \
                     is failed: {read}",
                    self.name
                ),
            )),
        };
        CreateAttempt {
            result,
            answer: said,
        }
    }

    /// Whose object `name` is: ours if it carries our token, or, lacking any token, our
    /// bytes (content alone cannot tell two writers of the same bytes apart; seals, for
    /// one, are all empty).
    async fn writer_of(&self, name: &str, data: &[u8], token: &str) -> io::Result<Writer> {
        let key = self.key(name)?;
        let got = match self.inner.get(&key).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => return Ok(Writer::Nobody),
            Err(e) => return Err(self.error("get", name, e)),
        };
        let theirs = got
            .attributes
            .get(&Attribute::Metadata(WRITER_KEY.into()))
            .map(|v| v.as_ref().to_string());
        let bytes = got.bytes().await.map_err(|e| self.error("get", name, e))?;
        let ours = match theirs {
            Some(t) => t == token,
            None => bytes.as_ref() == data,
        };
        Ok(if ours { Writer::Us } else { Writer::Other })
    }

    async fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        let key = self.key(name)?;
        match self.inner.get(&key).await {
            Ok(g) => Ok(Some(
                g.bytes()
                    .await
                    .map_err(|e| self.error("get", name, e))?
                    .to_vec(),
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("get", name, e)),
        }
    }

    async fn delete(&self, name: &str) -> io::Result<()> {
        let key = self.key(name)?;
        match self.inner.delete(&key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error("delete", name, e)),
        }
    }
}

/// Why positioned I/O is refused.
fn no_positioned_io(name: &str) -> io::Error {
    io::Error::new(
        ErrorKind::Unsupported,
        format!(
            "{name}: the store on S3 has no positioned I/O (objects are written whole, once); \
             file data on it is immutable slice objects"
        ),
    )
}

impl ObjectStore for S3Store {
    /// One PUT (never multipart): S3 replaces an object atomically and acknowledges it
    /// once it is durable.
    fn put(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let r = self.remote.clone();
        let (key, name, payload) = (
            r.key(name)?,
            name.to_string(),
            PutPayload::from(Bytes::copy_from_slice(data)),
        );
        self.run(async move {
            r.inner
                .put_opts(&key, payload, PutOptions::default())
                .await
                .map(|_| ())
                .map_err(|e| r.error("put", &name, e))
        })
    }

    fn get(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        let (r, name) = (self.remote.clone(), name.to_string());
        self.run(async move { r.get(&name).await })
    }

    /// One ranged GET (`Range: bytes=...`): file data reads only the part of a slice it
    /// needs. A range starting at or past the end is refused by S3 (416): callers read
    /// only what they know is written, so that is an error here too.
    fn get_range(&self, name: &str, offset: u64, len: u64) -> io::Result<Option<Vec<u8>>> {
        if len == 0 {
            return Ok(self.exists(name)?.then(Vec::new));
        }
        let r = self.remote.clone();
        let (key, name) = (r.key(name)?, name.to_string());
        let range = offset..offset.saturating_add(len);
        self.run(async move {
            let opts = GetOptions {
                range: Some(range.into()),
                ..GetOptions::default()
            };
            match r.inner.get_opts(&key, opts).await {
                Ok(g) => Ok(Some(
                    g.bytes()
                        .await
                        .map_err(|e| r.error("ranged get", &name, e))?
                        .to_vec(),
                )),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(r.error("ranged get", &name, e)),
            }
        })
    }

    fn delete(&self, name: &str) -> io::Result<()> {
        let (r, name) = (self.remote.clone(), name.to_string());
        self.run(async move { r.delete(&name).await })
    }

    /// The objects and the "folders" (common prefixes) directly under `prefix`, as a local
    /// directory lists its files and subdirectories.
    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        let r = self.remote.clone();
        let (key, prefix) = (r.key(prefix)?, prefix.to_string());
        self.run(async move {
            let listed = r
                .inner
                .list_with_delimiter(Some(&key))
                .await
                .map_err(|e| r.error("list", &prefix, e))?;
            let mut names: Vec<String> = listed
                .objects
                .iter()
                .map(|m| &m.location)
                .chain(listed.common_prefixes.iter())
                .filter_map(|k| k.as_ref().strip_prefix(r.prefix.as_str()))
                .filter(|n| validate_object_name(n).is_ok())
                .map(str::to_string)
                .collect();
            names.sort();
            names.dedup();
            Ok(names)
        })
    }

    /// S3 has no atomic rename; only the journal's segment files are renamed, and on this
    /// store the journal is objects instead.
    fn rename(&self, from: &str, _to: &str) -> io::Result<()> {
        Err(no_positioned_io(from))
    }

    fn open(&self, name: &str, _create: bool) -> io::Result<Arc<dyn Object>> {
        Err(no_positioned_io(name))
    }

    fn open_sync_direct(&self, name: &str) -> io::Result<Option<Arc<dyn Object>>> {
        Err(no_positioned_io(name))
    }

    fn open_direct(&self, name: &str, _create: bool) -> io::Result<Option<Arc<dyn Object>>> {
        Err(no_positioned_io(name))
    }

    /// A PUT or DELETE that returned is durable, its name included: nothing to do.
    fn sync_dir(&self, _prefix: &str) -> io::Result<()> {
        Ok(())
    }

    fn capacity(&self) -> io::Result<Capacity> {
        Ok(Capacity {
            total_bytes: REPORTED_CAPACITY,
            free_bytes: REPORTED_CAPACITY,
        })
    }

    fn create_if_absent(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let token = new_token()?;
        self.create_if_absent_as(name, data, &token)
    }

    /// Whole objects only: the journal is written as immutable objects and checkpoint
    /// images in whole parts.
    fn positioned_io(&self) -> bool {
        false
    }

    /// Up to [`REQUESTS_IN_FLIGHT_MAX`] GETs at a time.
    fn get_many(&self, names: &[String]) -> io::Result<Vec<Option<Vec<u8>>>> {
        let (r, names) = (self.remote.clone(), names.to_vec());
        self.run(async move {
            let mut out = Vec::with_capacity(names.len());
            for window in names.chunks(REQUESTS_IN_FLIGHT_MAX) {
                let tasks: Vec<_> = window
                    .iter()
                    .map(|n| {
                        let (r, n) = (r.clone(), n.clone());
                        tokio::spawn(async move { r.get(&n).await })
                    })
                    .collect();
                for t in tasks {
                    out.push(t.await.map_err(io::Error::other)??);
                }
            }
            Ok(out)
        })
    }

    /// Up to [`DELETES_IN_FLIGHT_MAX`] DELETEs at a time (one request per object: RGW and
    /// AWS both take single DELETEs, and the bulk form needs a checksum header that not
    /// every engine version accepts).
    fn delete_many(&self, names: &[String]) -> io::Result<()> {
        let (r, names) = (self.remote.clone(), names.to_vec());
        self.run(async move {
            for window in names.chunks(DELETES_IN_FLIGHT_MAX) {
                let tasks: Vec<_> = window
                    .iter()
                    .map(|n| {
                        let (r, n) = (r.clone(), n.clone());
                        tokio::spawn(async move { r.delete(&n).await })
                    })
                    .collect();
                for t in tasks {
                    t.await.map_err(io::Error::other)??;
                }
            }
            Ok(())
        })
    }

    /// A SigV4 presigned URL (query-string authentication) of the object, path style on
    /// the store's endpoint, for at most [`PRESIGN_EXPIRY_MAX`]. A create-only PUT signs
    /// [`Presign::headers`] (`If-None-Match: *`, a private ACL), which its sender must send
    /// as they are.
    fn presign(&self, name: &str, how: Presign, expires_in: Duration) -> Option<String> {
        validate_object_name(name).ok()?;
        Some(self.presigner.as_ref()?.url(name, how, expires_in))
    }

    fn exists(&self, name: &str) -> io::Result<bool> {
        let r = self.remote.clone();
        let (key, name) = (r.key(name)?, name.to_string());
        self.run(async move {
            match r.inner.head(&key).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(r.error("head", &name, e)),
            }
        })
    }
}

#[cfg(test)]
mod tests;

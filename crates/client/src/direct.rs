//! Slice objects moved straight between a client and the object store, through the
//! presigned URLs the servers hand out (see `kochab_proto::layout`): the servers then see
//! only the grants, commits and layouts, never the bytes.
//!
//! One [`DirectIo`] per mount holds one HTTP client, whose connection pool every PUT and
//! GET shares. A request that fails in a way a retry may cure (a connection error, a
//! timeout, a 5xx or a 429 "slow down") is tried again a few times with backoff; the rest
//! is answered at once, with what the caller must do next: a name that exists already
//! ([`DirectError::Exists`]: ask for a new grant), a URL the store no longer takes
//! ([`DirectError::Stale`]: expired, revoked, or the object is gone; ask the servers
//! again), or an error for the application ([`DirectError::Failed`], EIO).

use kochab_proto::{FsError, fs_err};
use std::time::Duration;

/// Longest one PUT or GET may take, transfer included: a 4 MiB slice over a slow link
/// (1 MiB/s) still fits, a hung store is given up on well before a grant expires.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest a new connection to the store may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Tries of a request after its first failure that a retry may cure: with the backoff
/// below they span about 3 s, long enough for a gateway restart's blip, short enough that
/// the application hears of a store that is down.
const RETRIES: u32 = 4;
/// Wait before the first retry; doubled for each next one.
const BACKOFF: Duration = Duration::from_millis(200);
/// Idle connections kept per store host: as many as PUTs and GETs a mount runs at once.
const IDLE_PER_HOST: usize = 64;
/// The headers a create URL's signature covers, which its PUT must send as they are (see
/// `kochab_store::Presign::headers`; a test checks they agree): the conditional create,
/// and the ACL that keeps the object the store owner's.
pub const CREATE_HEADERS: &[(&str, &str)] = &[
    ("if-none-match", "*"),
    ("x-amz-acl", "bucket-owner-full-control"),
];

/// Why a direct PUT or GET did not succeed.
#[derive(Debug)]
pub enum DirectError {
    /// A conditional create found the name taken (HTTP 412 or 409).
    Exists,
    /// The store refused the URL or has no such object (HTTP 403 or 404): the URL
    /// expired or its key was revoked, or the object was freed since the layout was
    /// taken. Ask the servers again.
    Stale(u16),
    /// Anything else (after the retries): for the application, EIO.
    Failed(FsError),
}

impl DirectError {
    /// The error the application is given if the caller cannot cure this one.
    pub fn into_fs(self, what: &str) -> FsError {
        match self {
            DirectError::Exists => fs_err!(EIO, "{what}: the object store says it exists"),
            DirectError::Stale(s) => fs_err!(EIO, "{what}: the object store refused (HTTP {s})"),
            DirectError::Failed(e) => e,
        }
    }
}

/// The mount's HTTP client for direct slice I/O.
#[derive(Clone)]
pub struct DirectIo {
    http: reqwest::Client,
}

impl DirectIo {
    pub fn new() -> Result<DirectIo, FsError> {
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(CONNECT_TIMEOUT)
            .pool_max_idle_per_host(IDLE_PER_HOST)
            .build()
            .map_err(|e| fs_err!(EIO, "cannot make an HTTP client for the object store: {e}"))?;
        Ok(DirectIo { http })
    }

    /// Creates the object of `url` (a presigned PUT) with `body`, only if no object has
    /// that name (`If-None-Match: *`, which the URL's signature covers, as it does the
    /// rest of [`CREATE_HEADERS`]).
    pub async fn put_new(&self, url: &str, body: bytes::Bytes) -> Result<(), DirectError> {
        self.run("PUT of a slice", || {
            let mut put = self.http.put(url);
            for (name, value) in CREATE_HEADERS {
                put = put.header(*name, *value);
            }
            put.body(body.clone())
        })
        .await
        .map(drop)
    }

    /// Bytes `[start, end)` of the object of `url` (a presigned GET).
    pub async fn get_range(&self, url: &str, start: u64, end: u64) -> Result<Vec<u8>, DirectError> {
        if end <= start {
            return Ok(Vec::new());
        }
        let range = format!("bytes={start}-{}", end - 1);
        let got = self
            .run("GET of a slice", || {
                self.http
                    .get(url)
                    .header(reqwest::header::RANGE, range.as_str())
            })
            .await?;
        if got.len() as u64 != end - start {
            return Err(DirectError::Failed(fs_err!(
                EIO,
                "GET of a slice: {} bytes where {} were asked for",
                got.len(),
                end - start
            )));
        }
        Ok(got)
    }

    /// Sends the request `make` builds, again where a retry may cure the failure; the
    /// body of the success.
    async fn run(
        &self,
        what: &str,
        make: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<Vec<u8>, DirectError> {
        let mut wait = BACKOFF;
        let mut tries = 0;
        loop {
            let failure = match make().send().await {
                Ok(resp) => {
                    let status = resp.status();
                    if status.is_success() {
                        match resp.bytes().await {
                            Ok(b) => return Ok(b.to_vec()),
                            Err(e) => format!("its body was cut off: {e}"),
                        }
                    } else {
                        match status.as_u16() {
                            409 | 412 => return Err(DirectError::Exists),
                            s @ (403 | 404) => return Err(DirectError::Stale(s)),
                            s if s >= 500 || s == 429 || s == 408 => format!("HTTP {s}"),
                            s => {
                                return Err(DirectError::Failed(fs_err!(
                                    EIO,
                                    "{what}: the object store answered HTTP {s}"
                                )));
                            }
                        }
                    }
                }
                Err(e) => format!("{e}"),
            };
            if tries >= RETRIES {
                return Err(DirectError::Failed(fs_err!(
                    EIO,
                    "{what} failed {} times, last: {failure}",
                    tries + 1
                )));
            }
            tracing::debug!("{what} failed ({failure}); trying again in {wait:?}");
            tokio::time::sleep(wait).await;
            wait *= 2;
            tries += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_create_sends_the_headers_its_url_signs() {
        assert_eq!(
            super::CREATE_HEADERS,
            kochab_store::Presign::PutCreate.headers()
        );
    }
}

//! Server metrics in the Prometheus (OpenMetrics) text format, served over HTTP. Hot-path
//! metrics are created up front per operation kind, so recording is an atomic add or an
//! uncontended lock, never a label lookup.

use kochab_proto::OP_NAMES;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use tokio::net::TcpListener;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpResultLabel {
    op: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabel {
    pub table: String,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    ops_ok: Vec<Counter>,
    ops_err: Vec<Counter>,
    latency: Vec<Histogram>,
    pub fsync_seconds: Histogram,
    pub journal_wait_seconds: Histogram,
    pub records_per_fsync: Histogram,
    pub bytes_per_fsync: Histogram,
    pub checkpoint_seconds: Histogram,
    pub checkpoint_bytes: Counter,
    pub table_inodes: Family<TableLabel, Gauge>,
    pub table_dentries: Family<TableLabel, Gauge>,
    pub rss_bytes: Gauge,
    pub journal_bytes: Gauge,
    pub connections: Gauge,
    pub replay_records: Gauge<u64, AtomicU64>,
    pub data_reclaims_pending: Gauge,
    /// Operations that waited for a borrow of other servers' tables (multi-server).
    pub borrowed_ops: Counter,
    pub borrow_wait_seconds: Histogram,
    /// Multi-server operations started as transactions (issue 33, `--multi-server txn`)...
    pub txn_ops: Counter,
    /// ... and those of them that borrowed after all (a precondition failed somewhere).
    pub txn_fallbacks: Counter,
    pub flush_wait_seconds: Histogram,
    /// Callbacks whose holder did not answer by their deadline.
    pub callbacks_missed: Counter,
    /// Holders that went into default (a missed callback or a slow answer).
    pub callback_defaults: Counter,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kochab");
        let ops: Family<OpResultLabel, Counter> = Family::default();
        let lat: Family<OpLabel, Histogram> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(10e-6, 2.0, 18)));
        let ops_ok = OP_NAMES
            .iter()
            .map(|&op| {
                ops.get_or_create(&OpResultLabel { op, result: "ok" })
                    .clone()
            })
            .collect();
        let ops_err = OP_NAMES
            .iter()
            .map(|&op| {
                ops.get_or_create(&OpResultLabel {
                    op,
                    result: "error",
                })
                .clone()
            })
            .collect();
        let latency = OP_NAMES
            .iter()
            .map(|&op| lat.get_or_create(&OpLabel { op }).clone())
            .collect();
        registry.register("operations", "Operations served, by type and result", ops);
        registry.register(
            "operation_latency_seconds",
            "Time from request arrival to durable reply",
            lat,
        );
        let fsync_seconds = Histogram::new(exponential_buckets(25e-6, 2.0, 16));
        registry.register(
            "journal_fsync_seconds",
            "Duration of one journal group commit (write + fdatasync)",
            fsync_seconds.clone(),
        );
        let journal_wait_seconds = Histogram::new(exponential_buckets(25e-6, 2.0, 16));
        registry.register(
            "journal_wait_seconds",
            "How long the first record of a group commit waited for it to start: with \
             early replies, the window in which acknowledged operations are not durable \
             (at most the lazy-flush interval when nobody waits for them)",
            journal_wait_seconds.clone(),
        );
        let records_per_fsync = Histogram::new(exponential_buckets(1.0, 2.0, 14));
        registry.register(
            "journal_records_per_fsync",
            "Records made durable by one group commit",
            records_per_fsync.clone(),
        );
        let bytes_per_fsync = Histogram::new(exponential_buckets(64.0, 4.0, 12));
        registry.register(
            "journal_bytes_per_fsync",
            "Bytes made durable by one group commit",
            bytes_per_fsync.clone(),
        );
        let checkpoint_seconds = Histogram::new(exponential_buckets(1e-3, 2.0, 16));
        registry.register(
            "checkpoint_seconds",
            "Duration of one table checkpoint",
            checkpoint_seconds.clone(),
        );
        let checkpoint_bytes = Counter::default();
        registry.register(
            "checkpoint_bytes",
            "Bytes of checkpoint images written",
            checkpoint_bytes.clone(),
        );
        let borrowed_ops = Counter::default();
        registry.register(
            "borrowed_operations",
            "Operations that needed tables other servers held (run by BORROW/RETURN)",
            borrowed_ops.clone(),
        );
        let txn_ops = Counter::default();
        registry.register(
            "transaction_operations",
            "Multi-server operations started as transactions between servers",
            txn_ops.clone(),
        );
        let txn_fallbacks = Counter::default();
        registry.register(
            "transaction_fallbacks",
            "Transactions refused by a participant's check, then run by BORROW/RETURN",
            txn_fallbacks.clone(),
        );
        let borrow_wait_seconds = Histogram::new(exponential_buckets(1e-3, 2.0, 16));
        registry.register(
            "borrow_wait_seconds",
            "Time an operation waited until every table it needed was here",
            borrow_wait_seconds.clone(),
        );
        let flush_wait_seconds = Histogram::new(exponential_buckets(1e-4, 2.0, 18));
        registry.register(
            "flush_wait_seconds",
            "Time a request waited for other clients to send writes they held back of a file \
             it reads or stats (flush callbacks)",
            flush_wait_seconds.clone(),
        );
        let callbacks_missed = Counter::default();
        registry.register(
            "callbacks_missed",
            "Callbacks whose holder did not answer by their deadline (each such holder \
             loses its leases and gets none until it answers)",
            callbacks_missed.clone(),
        );
        let callback_defaults = Counter::default();
        registry.register(
            "callback_defaults",
            "Times a lease holder went into default: it missed a callback's deadline, or \
             answered one that only drops cached names or attributes later than 1 s",
            callback_defaults.clone(),
        );
        let table_inodes = Family::<TableLabel, Gauge>::default();
        registry.register("table_inodes", "Inodes per table", table_inodes.clone());
        let table_dentries = Family::<TableLabel, Gauge>::default();
        registry.register(
            "table_dentries",
            "Directory entries per table",
            table_dentries.clone(),
        );
        let rss_bytes = Gauge::default();
        registry.register(
            "memory_rss_bytes",
            "Resident memory of the server process",
            rss_bytes.clone(),
        );
        let journal_bytes = Gauge::default();
        registry.register(
            "journal_bytes",
            "Bytes of journal kept in the object store",
            journal_bytes.clone(),
        );
        let connections = Gauge::default();
        registry.register(
            "connections",
            "Open client connections",
            connections.clone(),
        );
        let replay_records = Gauge::<u64, AtomicU64>::default();
        registry.register(
            "recovery_replayed_records",
            "Journal records replayed at the last start",
            replay_records.clone(),
        );
        let data_reclaims_pending = Gauge::default();
        registry.register(
            "data_reclaims_pending",
            "Data reclaims not yet done (removed files' data, trims of truncated files)",
            data_reclaims_pending.clone(),
        );
        Metrics {
            registry,
            ops_ok,
            ops_err,
            latency,
            fsync_seconds,
            journal_wait_seconds,
            records_per_fsync,
            bytes_per_fsync,
            checkpoint_seconds,
            checkpoint_bytes,
            table_inodes,
            table_dentries,
            rss_bytes,
            journal_bytes,
            connections,
            replay_records,
            data_reclaims_pending,
            borrowed_ops,
            borrow_wait_seconds,
            txn_ops,
            txn_fallbacks,
            flush_wait_seconds,
            callbacks_missed,
            callback_defaults,
        }
    }

    /// Counts one operation of kind `op_index` and its latency.
    pub fn record_op(&self, op_index: usize, ok: bool, seconds: f64) {
        if ok {
            &self.ops_ok[op_index]
        } else {
            &self.ops_err[op_index]
        }
        .inc();
        self.latency[op_index].observe(seconds);
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!("cannot encode metrics: {e}");
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Resident set size of this process, from /proc/self/statm.
pub fn rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    pages * page
}

/// The pause after a failed accept (EMFILE and the like) before the next: a listener that
/// cannot accept must not spin a core.
const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(50);

/// A scraper that has not sent its request head within this long is dropped (a slow or
/// idle peer must not hold a task and a socket for ever).
const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Longest a whole metrics connection may last.
const CONNECTION_MAX: std::time::Duration = std::time::Duration::from_secs(60);

/// What a request gets: 200 with the metrics for `GET /metrics` (any query string), 405
/// for another method on that path, 404 for any other path.
fn route(method: &hyper::Method, path: &str) -> hyper::StatusCode {
    if path != "/metrics" {
        hyper::StatusCode::NOT_FOUND
    } else if method != hyper::Method::GET {
        hyper::StatusCode::METHOD_NOT_ALLOWED
    } else {
        hyper::StatusCode::OK
    }
}

fn answer(
    req: &hyper::Request<hyper::body::Incoming>,
    metrics: &Metrics,
    refresh: &(dyn Fn() + Send + Sync),
) -> hyper::Response<http_body_util::Full<hyper::body::Bytes>> {
    use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
    let status = route(req.method(), req.uri().path());
    let mut resp = hyper::Response::new(http_body_util::Full::default());
    *resp.status_mut() = status;
    match status {
        hyper::StatusCode::OK => {
            refresh();
            *resp.body_mut() = http_body_util::Full::new(metrics.encode().into());
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
        }
        hyper::StatusCode::METHOD_NOT_ALLOWED => {
            resp.headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET"));
        }
        _ => {}
    }
    resp
}

/// Serves `GET /metrics` on `listener` with hyper (HTTP/1.1) until the task is dropped;
/// any other method or path gets 405 or 404, and what is no HTTP request gets hyper's 400.
pub async fn serve_http(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    refresh: Arc<dyn Fn() + Send + Sync>,
) {
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                tracing::warn!("metrics: accept failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        let refresh = refresh.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let resp = answer(&req, &metrics, refresh.as_ref());
                async move { Ok::<_, std::convert::Infallible>(resp) }
            });
            // One request per connection, as a scraper's interval is seconds long: nothing
            // stays open between scrapes.
            let conn = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(sock), service);
            let _ = tokio::time::timeout(CONNECTION_MAX, conn).await;
        });
    }
}

/// Binds the metrics listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

#[cfg(test)]
mod route_tests {
    use super::route;

    use hyper::{Method, StatusCode};

    #[test]
    fn only_get_metrics_is_served() {
        assert_eq!(route(&Method::GET, "/metrics"), StatusCode::OK);
        assert_eq!(route(&Method::GET, "/"), StatusCode::NOT_FOUND);
        assert_eq!(route(&Method::GET, "/metricsx"), StatusCode::NOT_FOUND);
        assert_eq!(
            route(&Method::POST, "/metrics"),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(route(&Method::DELETE, "/x"), StatusCode::NOT_FOUND);
    }
}

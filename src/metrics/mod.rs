//! Prometheus metrics, served at `/metrics` on the admin port.
//!
//! Two sources, one page, one renderer:
//! - what happens to requests — counts by outcome and status class, durations, time to first byte,
//!   queue waits, retries, reloads — is recorded as it happens into this process's [`Metrics`] and the
//!   request path's [`ProxyStats`] (atomics; not a global recorder, so two proxies in one process, as in
//!   tests, keep their own figures);
//! - the state of things — endpoints, the queue, discovery — is read at scrape time into a plain
//!   [`Scrape`] by whoever owns those things (the admin port). Per-endpoint series therefore exist exactly
//!   for the endpoints in the set: one that leaves disappears from the next scrape, and cardinality stays
//!   bounded by the fleet.
//!
//! Every series is written by [`render`]'s exposition-format writer. An exporter crate rendered three of
//! them once; its histograms kept every sample until drained, which under loopback load cost tongs about
//! half its CPU per request again, so the histograms were hand-written first and the rest followed, to
//! keep one path from the counters to the page.
//!
//! Every metric name is defined once, in [`CATALOG`]; the table in `docs/metrics.md` is checked against it.

mod catalog;
mod histogram;
mod render;
mod stats;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

pub use catalog::*;
pub use histogram::BUCKETS;
use histogram::Buckets;
pub use render::{DiscoveryFigures, Front, Scrape};
pub use stats::{Continuation, ContinuationStats, ProxyStats, RetryStats};

/// The tokio runtimes this proxy runs on, for [`RUNTIME_TASKS`]: the one `App::run` is called on and
/// each worker thread's own. Read at scrape time, so the figure is current and costs nothing between
/// scrapes; a runtime leaves the list when the code that runs on it ends.
#[derive(Default)]
struct Runtimes {
    next_id: AtomicU64,
    handles: Mutex<Vec<(u64, tokio::runtime::Handle)>>,
}

impl Runtimes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, tokio::runtime::Handle)>> {
        self.handles
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn alive_tasks(&self) -> usize {
        self.lock()
            .iter()
            .map(|(_, handle)| handle.metrics().num_alive_tasks())
            .sum()
    }
}

/// Keeps a runtime counted in [`RUNTIME_TASKS`] until dropped.
pub struct RuntimeWatch {
    runtimes: Arc<Runtimes>,
    id: u64,
}

impl Drop for RuntimeWatch {
    fn drop(&mut self) {
        self.runtimes.lock().retain(|(id, _)| *id != self.id);
    }
}

/// How a request ended, for [`REQUESTS`] and [`REQUEST_DURATION`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// An endpoint's answer was committed to the client.
    Proxied,
    /// Every attempt failed; the client got the last failure.
    Failed,
    /// tongs refused the request (queue full or timed out, shed, no endpoint).
    Refused,
    /// The client's request was unusable (bad deadline, body too large or too slow).
    Invalid,
}

impl Outcome {
    const ALL: [Outcome; 4] = [
        Outcome::Proxied,
        Outcome::Failed,
        Outcome::Refused,
        Outcome::Invalid,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Proxied => "proxied",
            Outcome::Failed => "failed",
            Outcome::Refused => "refused",
            Outcome::Invalid => "invalid",
        }
    }
}

/// Status classes, as [`REQUESTS`] labels them.
const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// What the request path and the reloader record into (atomics: no lock and no lookup per request).
pub struct Metrics {
    /// Requests by outcome, then status class.
    requests: [[AtomicU64; 5]; 4],
    durations: [Buckets; 4],
    first_byte: Buckets,
    queue_wait: Buckets,
    /// Reloads applied and rejected.
    reloads: [AtomicU64; 2],
    started: Instant,
    runtimes: Arc<Runtimes>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics {
            requests: Default::default(),
            durations: Default::default(),
            first_byte: Buckets::default(),
            queue_wait: Buckets::default(),
            reloads: Default::default(),
            started: Instant::now(),
            runtimes: Arc::default(),
        }
    }

    /// Counts the tasks of the runtime behind `handle` in [`RUNTIME_TASKS`] while the watch lives.
    pub fn watch_runtime(&self, handle: tokio::runtime::Handle) -> RuntimeWatch {
        let id = self.runtimes.next_id.fetch_add(1, Ordering::Relaxed);
        self.runtimes.lock().push((id, handle));
        RuntimeWatch {
            runtimes: Arc::clone(&self.runtimes),
            id,
        }
    }

    /// Tasks alive on the watched runtimes now.
    pub fn runtime_tasks(&self) -> usize {
        self.runtimes.alive_tasks()
    }

    /// A request ended with `status` after `took`.
    pub fn request_done(&self, outcome: Outcome, status: u16, took: Duration) {
        let class = usize::from((status / 100).clamp(1, 5)) - 1;
        self.requests[outcome as usize][class].fetch_add(1, Ordering::Relaxed);
        self.durations[outcome as usize].record(took);
    }

    pub fn first_byte(&self, took: Duration) {
        self.first_byte.record(took);
    }

    pub fn queue_wait(&self, took: Duration) {
        self.queue_wait.record(took);
    }

    pub fn reload(&self, applied: bool) {
        self.reloads[usize::from(!applied)].fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prometheus_shaped() {
        let mut names: Vec<_> = CATALOG.iter().map(|s| s.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len(), "a metric name is defined twice");
        for spec in CATALOG {
            assert!(spec.name.starts_with("tongs_"), "{}", spec.name);
            assert!(
                spec.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{}",
                spec.name
            );
            if spec.kind == "counter" {
                assert!(spec.name.ends_with("_total"), "{}", spec.name);
            }
        }
    }

    #[test]
    fn runtime_tasks_count_watched_runtimes_while_watched() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let metrics = Metrics::new();
        let watch = metrics.watch_runtime(runtime.handle().clone());
        assert_eq!(metrics.runtime_tasks(), 0);
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        let task = runtime.spawn(async move {
            let _ = finished.await;
        });
        let _pending = runtime.spawn(std::future::pending::<()>());
        assert_eq!(metrics.runtime_tasks(), 2);
        let _ = done.send(());
        runtime.block_on(task).unwrap();
        assert_eq!(metrics.runtime_tasks(), 1);
        drop(watch);
        assert_eq!(
            metrics.runtime_tasks(),
            0,
            "an unwatched runtime counts nothing"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let mut out = String::new();
        render::sample(&mut out, "m", &[("endpoint", "a\"b\\c\nd")], 1.0);
        assert_eq!(out, "m{endpoint=\"a\\\"b\\\\c\\nd\"} 1\n");
    }

    #[test]
    fn recorded_requests_render() {
        let front = Metrics::new();
        front.request_done(Outcome::Invalid, 404, Duration::from_millis(1));
        let pool = Metrics::new();
        pool.request_done(Outcome::Proxied, 200, Duration::from_millis(30));
        pool.request_done(Outcome::Refused, 503, Duration::from_millis(2));
        let stats = ProxyStats::default();
        let scrape = |name| Scrape {
            pool: name,
            recorded: &pool,
            queued: 0,
            demand: 3,
            capacity: None,
            rejections: Vec::new(),
            stats: &stats,
            endpoints: &[],
            discovery: DiscoveryFigures::default(),
        };
        let fallbacks = [(Arc::from("a"), Arc::from("b"), 2)];
        let front_figures = render::Front {
            stats: &stats,
            fallbacks: &fallbacks,
            replicas: 3,
            tenants: &[],
            auth_failures: (4, 5),
        };
        let text = front.render(&front_figures, &[scrape("a"), scrape("b")]);
        for want in [
            r#"tongs_requests_total{outcome="invalid",code="4xx"} 1"#,
            r#"tongs_requests_total{pool="a",outcome="proxied",code="2xx"} 1"#,
            r#"tongs_requests_total{pool="b",outcome="refused",code="5xx"} 1"#,
            r#"tongs_request_duration_seconds_bucket{pool="a",outcome="proxied",le="0.05"} 1"#,
            r#"tongs_demand{pool="b"} 3"#,
            "tongs_replicas 3",
            r#"tongs_auth_failures_total{reason="unknown"} 5"#,
            r#"tongs_pool_fallbacks_total{from="a",to="b"} 2"#,
            "tongs_build_info{version=",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
        // Each family is written once, its samples together.
        let helps = text
            .lines()
            .filter(|l| l.starts_with("# HELP tongs_demand "))
            .count();
        assert_eq!(helps, 1, "{text}");
    }
}

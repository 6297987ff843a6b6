//! Prometheus metrics, served at `/metrics` on the admin port.
//!
//! Two sources, one page:
//! - what happens to requests — counts by outcome, durations, time to first byte, queue waits — is
//!   recorded as it happens into a `metrics-exporter-prometheus` recorder owned by this process's
//!   [`Metrics`] (not a global one, so two proxies in one process, as in tests, keep their own figures);
//! - the state of things — endpoints, the queue, retry and refusal counters the request path already
//!   keeps in atomics — is read at scrape time. Per-endpoint series therefore exist exactly for the
//!   endpoints in the set: one that leaves disappears from the next scrape, and cardinality stays bounded
//!   by the fleet.
//!
//! Every metric name is defined once, in [`CATALOG`]; the README's table is checked against it.

use std::fmt::Write as _;
use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use metrics::{Counter, Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use tokio::time::Instant;

use crate::admission::Reason;
use crate::endpoint::{EndpointView, STATES};
use crate::proxy::Proxy;

/// One metric: name, Prometheus type, help text.
pub struct Spec {
    pub name: &'static str,
    pub kind: &'static str,
    pub help: &'static str,
}

const fn spec(name: &'static str, kind: &'static str, help: &'static str) -> Spec {
    Spec { name, kind, help }
}

pub const REQUESTS: Spec = spec(
    "tongs_requests_total",
    "counter",
    "Requests answered, by outcome (proxied, failed, refused, invalid) and status class.",
);
pub const REQUEST_DURATION: Spec = spec(
    "tongs_request_duration_seconds",
    "histogram",
    "Time from a request's arrival to the end of its answer (streams included), by outcome.",
);
pub const FIRST_BYTE: Spec = spec(
    "tongs_time_to_first_byte_seconds",
    "histogram",
    "Time from a request's arrival to the commit of an endpoint's answer (headers and first bytes).",
);
pub const QUEUE_WAIT: Spec = spec(
    "tongs_queue_wait_seconds",
    "histogram",
    "Time requests that got an endpoint spent in the queue.",
);
pub const QUEUE_DEPTH: Spec = spec(
    "tongs_queue_depth",
    "gauge",
    "Requests waiting in the queue for an endpoint.",
);
pub const DEMAND: Spec = spec(
    "tongs_demand",
    "gauge",
    "Requests queued plus outstanding on endpoints: the signal to scale GPU nodes on.",
);
pub const CAPACITY: Spec = spec(
    "tongs_capacity",
    "gauge",
    "Sum of the endpoints' concurrency limits (absent while any endpoint is unlimited).",
);
pub const REJECTIONS: Spec = spec(
    "tongs_rejections_total",
    "counter",
    "Requests tongs refused itself, by reason.",
);
pub const RETRIES: Spec = spec(
    "tongs_retries_total",
    "counter",
    "Retries on another endpoint, by the failure that caused them.",
);
pub const RETRY_BUDGET_EXHAUSTED: Spec = spec(
    "tongs_retry_budget_exhausted_total",
    "counter",
    "Retries the retry budget refused.",
);
pub const ATTEMPTS: Spec = spec(
    "tongs_attempts_total",
    "counter",
    "Attempts sent to endpoints (requests plus retries).",
);
pub const ENDPOINTS: Spec = spec(
    "tongs_endpoints",
    "gauge",
    "Endpoints in the set, by discovery source and state.",
);
pub const ENDPOINT_STATE: Spec = spec(
    "tongs_endpoint_state",
    "gauge",
    "1 for the state each endpoint is in, 0 for the others.",
);
pub const ENDPOINT_OUTSTANDING: Spec = spec(
    "tongs_endpoint_outstanding",
    "gauge",
    "Requests on the endpoint whose answer has not ended.",
);
pub const ENDPOINT_LIMIT: Spec = spec(
    "tongs_endpoint_limit",
    "gauge",
    "The endpoint's concurrency limit (absent when unlimited).",
);
pub const ENDPOINT_REQUESTS: Spec = spec(
    "tongs_endpoint_requests_total",
    "counter",
    "Attempts sent to the endpoint.",
);
pub const ENDPOINT_FAILURES: Spec = spec(
    "tongs_endpoint_failures_total",
    "counter",
    "Attempts that failed at the endpoint (connect, reset, timeout, gateway error).",
);
pub const ENDPOINT_EJECTIONS: Spec = spec(
    "tongs_endpoint_ejections_total",
    "counter",
    "Times the endpoint's circuit breaker opened.",
);
pub const ENDPOINT_COOLDOWNS: Spec = spec(
    "tongs_endpoint_cooldowns_total",
    "counter",
    "Times the endpoint asked for back-off (429, or 503 with Retry-After).",
);
pub const ENDPOINT_LATENCY: Spec = spec(
    "tongs_endpoint_latency_seconds",
    "gauge",
    "The balancer's latency estimate for the endpoint (time to first byte, peak EWMA).",
);
pub const ENDPOINT_HEARTBEAT: Spec = spec(
    "tongs_endpoint_heartbeat_seconds",
    "gauge",
    "Duration of the endpoint's last heartbeat.",
);
pub const ENDPOINT_HEARTBEAT_OK: Spec = spec(
    "tongs_endpoint_heartbeat_ok",
    "gauge",
    "1 if the endpoint's last heartbeat passed, 0 if it failed.",
);
pub const CONFIG_RELOADS: Spec = spec(
    "tongs_config_reloads_total",
    "counter",
    "Configuration reloads, by result (applied, invalid).",
);
pub const BUILD_INFO: Spec = spec(
    "tongs_build_info",
    "gauge",
    "Always 1; the version in a label.",
);

pub const DISCOVERY_SYNCED: Spec = spec(
    "tongs_discovery_synced",
    "gauge",
    "1 once Kubernetes discovery applied its first complete list of pods (always 1 when it is off).",
);
pub const DISCOVERY_PODS: Spec = spec(
    "tongs_discovery_pods",
    "gauge",
    "Pods watched, by state (serving, ineligible, no-address).",
);
pub const DISCOVERY_REJECTIONS: Spec = spec(
    "tongs_discovery_rejections_total",
    "counter",
    "Pod annotations (or podIPs) refused, by reason; each pod's problem counted once.",
);
pub const DISCOVERY_WATCH_ERRORS: Spec = spec(
    "tongs_discovery_watch_errors_total",
    "counter",
    "Errors of the pod watch (each followed by a retry with backoff).",
);
pub const DISCOVERY_LISTS: Spec = spec(
    "tongs_discovery_lists_total",
    "counter",
    "Complete pod lists applied: the first sync, then one per re-list after a lost watch.",
);
pub const SALAD_LOOKUPS: Spec = spec(
    "tongs_salad_api_lookups_total",
    "counter",
    "SaladCloud API container group lookups, by result (found, not-yet, error).",
);
pub const REGISTRATIONS: Spec = spec(
    "tongs_node_registrations_total",
    "counter",
    "Node self-registrations, by result.",
);
pub const RUNTIME_TASKS: Spec = spec(
    "tongs_runtime_tasks",
    "gauge",
    "Tokio tasks alive, summed over tongs' runtimes (the main one and each worker's); one that only grows is a task leak.",
);

/// Every metric tongs exports.
pub const CATALOG: [&Spec; 33] = [
    &REQUESTS,
    &REQUEST_DURATION,
    &FIRST_BYTE,
    &QUEUE_WAIT,
    &QUEUE_DEPTH,
    &DEMAND,
    &CAPACITY,
    &REJECTIONS,
    &RETRIES,
    &RETRY_BUDGET_EXHAUSTED,
    &ATTEMPTS,
    &ENDPOINTS,
    &ENDPOINT_STATE,
    &ENDPOINT_OUTSTANDING,
    &ENDPOINT_LIMIT,
    &ENDPOINT_REQUESTS,
    &ENDPOINT_FAILURES,
    &ENDPOINT_EJECTIONS,
    &ENDPOINT_COOLDOWNS,
    &ENDPOINT_LATENCY,
    &ENDPOINT_HEARTBEAT,
    &ENDPOINT_HEARTBEAT_OK,
    &CONFIG_RELOADS,
    &BUILD_INFO,
    &UPTIME,
    &DISCOVERY_SYNCED,
    &DISCOVERY_PODS,
    &DISCOVERY_REJECTIONS,
    &DISCOVERY_WATCH_ERRORS,
    &DISCOVERY_LISTS,
    &SALAD_LOOKUPS,
    &REGISTRATIONS,
    &RUNTIME_TASKS,
];

pub const UPTIME: Spec = spec(
    "tongs_uptime_seconds",
    "gauge",
    "Seconds since this process started serving.",
);

/// Histogram buckets for inference: 5 ms to 120 s.
pub const BUCKETS: [f64; 18] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0, 30.0, 45.0,
    60.0, 120.0,
];

/// A histogram with fixed buckets: recording is two atomic additions, with no allocation and no
/// lock, because it happens on every request (the exporter's own histograms keep every sample until
/// they are drained, which under loopback load cost tongs about half its CPU per request again).
struct Buckets {
    /// Per bucket of [`BUCKETS`], then the overflow: not cumulative until rendered.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Default for Buckets {
    fn default() -> Self {
        Buckets {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Buckets {
    fn record(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        let index = BUCKETS.partition_point(|&bound| bound < seconds);
        self.counts[index].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Appends the `_bucket`, `_sum` and `_count` samples, with `label` first when it has a name.
    fn render(&self, out: &mut String, name: &str, label: (&str, &str)) {
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = BUCKETS
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            let labels: Vec<(&str, &str)> = [label, ("le", le.as_str())]
                .into_iter()
                .filter(|(k, _)| !k.is_empty())
                .collect();
            sample(out, &bucket, &labels, cumulative as f64);
        }
        let labels: Vec<(&str, &str)> =
            [label].into_iter().filter(|(k, _)| !k.is_empty()).collect();
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        sample(out, &format!("{name}_sum"), &labels, sum);
        sample(out, &format!("{name}_count"), &labels, cumulative as f64);
    }
}

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

const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// The recorder and the handles the request path records through (no key lookups per request).
pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    requests: [[Counter; 5]; 4],
    durations: [Buckets; 4],
    first_byte: Buckets,
    queue_wait: Buckets,
    reloads_applied: Counter,
    reloads_invalid: Counter,
    started: Instant,
    runtimes: Arc<Runtimes>,
}

static METADATA: Metadata<'static> = Metadata::new("tongs", Level::INFO, Some("tongs::metrics"));

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        for spec in [&REQUESTS, &CONFIG_RELOADS] {
            recorder.describe_counter(spec.name.into(), None, spec.help.into());
        }
        recorder.describe_gauge(BUILD_INFO.name.into(), None, BUILD_INFO.help.into());
        let counter = |name: &'static str, labels: Vec<Label>| {
            recorder.register_counter(&Key::from_parts(name, labels), &METADATA)
        };
        let requests = Outcome::ALL.map(|outcome| {
            CLASSES.map(|class| {
                counter(
                    REQUESTS.name,
                    vec![
                        Label::new("outcome", outcome.as_str()),
                        Label::new("code", class),
                    ],
                )
            })
        });
        recorder
            .register_gauge(
                &Key::from_parts(
                    BUILD_INFO.name,
                    vec![Label::new("version", env!("CARGO_PKG_VERSION"))],
                ),
                &METADATA,
            )
            .set(1.0);
        Metrics {
            first_byte: Buckets::default(),
            queue_wait: Buckets::default(),
            reloads_applied: counter(CONFIG_RELOADS.name, vec![Label::new("result", "applied")]),
            reloads_invalid: counter(CONFIG_RELOADS.name, vec![Label::new("result", "invalid")]),
            requests,
            durations: Default::default(),
            handle,
            recorder,
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
        self.requests[outcome as usize][class].increment(1);
        self.durations[outcome as usize].record(took);
    }

    pub fn first_byte(&self, took: Duration) {
        self.first_byte.record(took);
    }

    pub fn queue_wait(&self, took: Duration) {
        self.queue_wait.record(took);
    }

    pub fn reload(&self, applied: bool) {
        if applied {
            self.reloads_applied.increment(1);
        } else {
            self.reloads_invalid.increment(1);
        }
    }

    /// Drains the histograms' atomic buckets (called every few seconds so they cannot grow unbounded
    /// between scrapes).
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }

    /// The whole `/metrics` page.
    pub fn render(&self, proxy: &Proxy) -> String {
        let _ = &self.recorder;
        let mut out = self.handle.render();
        header(&mut out, &REQUEST_DURATION);
        for outcome in Outcome::ALL {
            self.durations[outcome as usize].render(
                &mut out,
                REQUEST_DURATION.name,
                ("outcome", outcome.as_str()),
            );
        }
        header(&mut out, &FIRST_BYTE);
        self.first_byte.render(&mut out, FIRST_BYTE.name, ("", ""));
        header(&mut out, &QUEUE_WAIT);
        self.queue_wait.render(&mut out, QUEUE_WAIT.name, ("", ""));
        render_state(&mut out, proxy, self.started);
        header(&mut out, &RUNTIME_TASKS);
        sample(
            &mut out,
            RUNTIME_TASKS.name,
            &[],
            self.runtime_tasks() as f64,
        );
        out
    }
}

/// Appends discovery's state.
fn render_discovery(out: &mut String, status: &crate::discovery::Status) {
    header(out, &DISCOVERY_SYNCED);
    let synced = status.synced() || !status.enabled();
    sample(out, DISCOVERY_SYNCED.name, &[], f64::from(u8::from(synced)));
    header(out, &DISCOVERY_PODS);
    for (state, count) in status.pods() {
        sample(
            out,
            DISCOVERY_PODS.name,
            &[("state", state.as_str())],
            count as f64,
        );
    }
    header(out, &DISCOVERY_REJECTIONS);
    for (reason, count) in status.rejections() {
        sample(
            out,
            DISCOVERY_REJECTIONS.name,
            &[("reason", reason.as_str())],
            count as f64,
        );
    }
    header(out, &DISCOVERY_WATCH_ERRORS);
    sample(
        out,
        DISCOVERY_WATCH_ERRORS.name,
        &[],
        status.watch_errors() as f64,
    );
    header(out, &DISCOVERY_LISTS);
    sample(out, DISCOVERY_LISTS.name, &[], status.lists() as f64);
    header(out, &SALAD_LOOKUPS);
    for (result, count) in status.lookups() {
        sample(out, SALAD_LOOKUPS.name, &[("result", result)], count as f64);
    }
    header(out, &REGISTRATIONS);
    for (result, count) in status.registrations() {
        sample(out, REGISTRATIONS.name, &[("result", result)], count as f64);
    }
}

/// Appends what is read at scrape time.
fn render_state(out: &mut String, proxy: &Proxy, started: Instant) {
    let now = Instant::now();
    let registry = proxy.registry();
    let queue = registry.queue();
    let stats = proxy.stats();
    let demand = registry.demand();

    header(out, &UPTIME);
    sample(out, UPTIME.name, &[], started.elapsed().as_secs_f64());

    header(out, &QUEUE_DEPTH);
    sample(out, QUEUE_DEPTH.name, &[], demand.queued as f64);
    header(out, &DEMAND);
    sample(out, DEMAND.name, &[], demand.demand as f64);
    if let Some(capacity) = demand.capacity {
        header(out, &CAPACITY);
        sample(out, CAPACITY.name, &[], capacity as f64);
    }

    header(out, &REJECTIONS);
    for reason in Reason::ALL {
        let value = queue.stats().rejected(reason) as f64;
        sample(out, REJECTIONS.name, &[("reason", reason.as_str())], value);
    }
    header(out, &RETRIES);
    for (reason, count) in stats.retries.by_reason() {
        sample(out, RETRIES.name, &[("reason", reason)], count as f64);
    }
    header(out, &RETRY_BUDGET_EXHAUSTED);
    let exhausted = stats.retries.budget_exhausted.load(Ordering::Relaxed);
    sample(out, RETRY_BUDGET_EXHAUSTED.name, &[], exhausted as f64);
    header(out, &ATTEMPTS);
    let attempts = stats.attempts.load(Ordering::Relaxed);
    sample(out, ATTEMPTS.name, &[], attempts as f64);

    let slow_start = proxy.settings().slow_start;
    let views: Vec<_> = registry
        .snapshot()
        .iter()
        .map(|endpoint| endpoint.view(now, slow_start))
        .collect();

    render_discovery(out, registry.discovery());

    header(out, &ENDPOINTS);
    let mut sources: Vec<&str> = views.iter().map(|v| v.source).collect();
    sources.sort_unstable();
    sources.dedup();
    for source in sources {
        for state in STATES {
            let count = views
                .iter()
                .filter(|v| v.source == source && v.state == state)
                .count();
            sample(
                out,
                ENDPOINTS.name,
                &[("source", source), ("state", state)],
                count as f64,
            );
        }
    }
    if views.is_empty() {
        return;
    }
    header(out, &ENDPOINT_STATE);
    for view in &views {
        for state in STATES {
            let value = f64::from(u8::from(view.state == state));
            sample(
                out,
                ENDPOINT_STATE.name,
                &[("endpoint", &view.url), ("state", state)],
                value,
            );
        }
    }
    let per_endpoint: [(&Spec, ReadView); 9] = [
        (&ENDPOINT_OUTSTANDING, |v| Some(v.outstanding as f64)),
        (&ENDPOINT_LIMIT, |v| v.limit.map(|l| l as f64)),
        (&ENDPOINT_REQUESTS, |v| Some(v.requests as f64)),
        (&ENDPOINT_FAILURES, |v| Some(v.failures as f64)),
        (&ENDPOINT_EJECTIONS, |v| Some(v.ejections as f64)),
        (&ENDPOINT_COOLDOWNS, |v| Some(v.cooldowns as f64)),
        (&ENDPOINT_LATENCY, |v| v.latency_ms.map(|ms| ms / 1000.0)),
        (&ENDPOINT_HEARTBEAT, |v| {
            v.last_heartbeat_ms.map(|ms| ms / 1000.0)
        }),
        (&ENDPOINT_HEARTBEAT_OK, |v| {
            v.last_heartbeat_ok.map(|ok| f64::from(u8::from(ok)))
        }),
    ];
    for (spec, read) in per_endpoint {
        let values: Vec<_> = views
            .iter()
            .filter_map(|view| read(view).map(|value| (view, value)))
            .collect();
        if values.is_empty() {
            continue;
        }
        header(out, spec);
        for (view, value) in values {
            sample(out, spec.name, &[("endpoint", &view.url)], value);
        }
    }
}

/// Reads one figure of an endpoint (`None`: no sample for it).
type ReadView = fn(&EndpointView) -> Option<f64>;

fn header(out: &mut String, spec: &Spec) {
    let _ = writeln!(out, "# HELP {} {}", spec.name, spec.help);
    let _ = writeln!(out, "# TYPE {} {}", spec.name, spec.kind);
}

fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (key, value)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(key);
            out.push_str("=\"");
            escape_label(out, value);
            out.push('"');
        }
        out.push('}');
    }
    let _ = writeln!(out, " {value}");
}

/// Label values escape backslash, double quote and newline (the exposition format's rule).
fn escape_label(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
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
        sample(&mut out, "m", &[("endpoint", "a\"b\\c\nd")], 1.0);
        assert_eq!(out, "m{endpoint=\"a\\\"b\\\\c\\nd\"} 1\n");
    }

    #[test]
    fn recorded_requests_render() {
        let metrics = Metrics::new();
        metrics.request_done(Outcome::Proxied, 200, Duration::from_millis(30));
        metrics.request_done(Outcome::Refused, 503, Duration::from_millis(2));
        let mut text = metrics.handle.render();
        metrics.durations[0].render(&mut text, REQUEST_DURATION.name, ("outcome", "proxied"));
        assert!(
            text.contains(r#"tongs_requests_total{outcome="proxied",code="2xx"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"tongs_request_duration_seconds_bucket{outcome="proxied",le="0.05"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains("tongs_build_info{version="), "{text}");
    }
}

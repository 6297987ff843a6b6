//! The `/metrics` page in Prometheus' text exposition format, from recorded figures and a [`Scrape`].

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use super::{
    ATTEMPTS, AUTH_FAILURES, BUILD_INFO, CAPACITY, CLASSES, CONFIG_RELOADS, CONTINUATIONS,
    CONTINUED_BY_TEXT, Continuation, DEMAND, DISCOVERY_LISTS, DISCOVERY_PODS, DISCOVERY_REJECTIONS,
    DISCOVERY_SYNCED, DISCOVERY_WATCH_ERRORS, ENDPOINT_COOLDOWNS, ENDPOINT_EJECTIONS,
    ENDPOINT_ENGINE_IN_NODE, ENDPOINT_ENGINE_KV_CACHE, ENDPOINT_ENGINE_WAITING, ENDPOINT_FAILURES,
    ENDPOINT_HEARTBEAT, ENDPOINT_HEARTBEAT_OK, ENDPOINT_LATENCY, ENDPOINT_LIMIT,
    ENDPOINT_OUTSTANDING, ENDPOINT_REQUESTS, ENDPOINT_SIGNALS_AGE, ENDPOINT_STALLS, ENDPOINT_STATE,
    ENDPOINTS, FIRST_BYTE, HEDGES, HEDGES_WON, MetricSpec, Metrics, Outcome, POOL_FALLBACKS,
    ProxyStats, QUEUE_DEPTH, QUEUE_WAIT, REGISTRATIONS, REJECTIONS, REPLAY_BYTES,
    REPLAY_OVER_BUDGET, REPLICAS, REQUEST_DURATION, REQUESTS, RETRIES, RETRY_BUDGET_EXHAUSTED,
    RUNTIME_TASKS, SALAD_LOOKUPS, STREAM_PAUSES, STREAMS_CUT, STREAMS_MOVED, TENANT_IN_FLIGHT,
    TENANT_QUEUED, TENANT_REFUSALS, TENANT_REQUESTS, UPTIME,
};
use crate::admission::{Refusal, TENANT_CLASSES, Tenant};
use crate::endpoint::{EndpointState, EndpointView};

/// The state of things at scrape time, read by whoever owns them (the admin port) as plain figures.
pub struct Scrape<'a> {
    /// The pool's name, the `pool` label of its series.
    pub pool: &'a str,
    /// What the pool's requests were recorded into.
    pub recorded: &'a Metrics,
    /// Requests waiting in the queue.
    pub queued: u64,
    /// Queued plus outstanding requests.
    pub demand: u64,
    /// Sum of the endpoints' limits (`None` while any endpoint is unlimited).
    pub capacity: Option<u64>,
    /// Requests tongs refused, by reason.
    pub rejections: Vec<(&'static str, u64)>,
    pub stats: &'a ProxyStats,
    pub endpoints: &'a [EndpointView],
    pub discovery: DiscoveryFigures,
}

/// What discovery is doing, as counted.
#[derive(Clone, Debug, Default)]
pub struct DiscoveryFigures {
    /// The first complete list is applied (or discovery is off).
    pub synced: bool,
    /// Pods watched, by state.
    pub pods: Vec<(&'static str, u64)>,
    /// Annotations and pods refused, by reason.
    pub rejections: Vec<(&'static str, u64)>,
    pub watch_errors: u64,
    pub lists: u64,
    /// SaladCloud API lookups, by result.
    pub lookups: Vec<(&'static str, u64)>,
    /// Node registrations, by result.
    pub registrations: Vec<(&'static str, u64)>,
}

/// What is counted outside any pool.
pub struct Front<'a> {
    /// Replay memory and requests refused before a pool was chosen.
    pub stats: &'a ProxyStats,
    /// Requests a pool handed on, by (from, to) pool.
    pub fallbacks: &'a [(std::sync::Arc<str>, std::sync::Arc<str>, u64)],
    /// tongs replicas sharing the fixed limits.
    pub replicas: u32,
    /// The tenants inbound API keys name (none while keys are off).
    pub tenants: &'a [std::sync::Arc<crate::admission::Tenant>],
    /// Requests refused for want of a key: (missing, unknown).
    pub auth_failures: (u64, u64),
}

impl Metrics {
    /// The whole `/metrics` page: this process's figures (and the requests that reached no pool, with
    /// no `pool` label), then each pool's, every series of a pool labelled with its name. Each family
    /// is written once, its samples together, as the exposition format requires.
    pub fn render(&self, front: &Front, pools: &[Scrape]) -> String {
        let mut out = String::with_capacity(4096 + 2048 * pools.len());
        // The requests no pool took first (no label), then each pool's.
        let recorded: Vec<(&str, &Metrics)> = std::iter::once(("", self))
            .chain(pools.iter().map(|p| (p.pool, p.recorded)))
            .collect();
        header(&mut out, &REQUESTS);
        for (pool, metrics) in &recorded {
            for &outcome in outcomes(pool) {
                for (class, count) in CLASSES.iter().zip(&metrics.requests[outcome as usize]) {
                    let labels = [
                        ("pool", *pool),
                        ("outcome", outcome.as_str()),
                        ("code", *class),
                    ];
                    sample(&mut out, REQUESTS.name, &labels, load(count));
                }
            }
        }
        header(&mut out, &CONFIG_RELOADS);
        for (result, count) in ["applied", "invalid"].iter().zip(&self.reloads) {
            sample(
                &mut out,
                CONFIG_RELOADS.name,
                &[("result", result)],
                load(count),
            );
        }
        header(&mut out, &BUILD_INFO);
        let version = [("version", env!("CARGO_PKG_VERSION"))];
        sample(&mut out, BUILD_INFO.name, &version, 1.0);
        header(&mut out, &REPLICAS);
        sample(&mut out, REPLICAS.name, &[], f64::from(front.replicas));
        render_tenants(&mut out, front);
        header(&mut out, &REQUEST_DURATION);
        for (pool, metrics) in &recorded {
            for &outcome in outcomes(pool) {
                metrics.durations[outcome as usize].render(
                    &mut out,
                    REQUEST_DURATION.name,
                    &[("pool", pool), ("outcome", outcome.as_str())],
                );
            }
        }
        header(&mut out, &FIRST_BYTE);
        for scrape in pools {
            let labels = [("pool", scrape.pool)];
            scrape
                .recorded
                .first_byte
                .render(&mut out, FIRST_BYTE.name, &labels);
        }
        header(&mut out, &QUEUE_WAIT);
        for scrape in pools {
            let labels = [("pool", scrape.pool)];
            scrape
                .recorded
                .queue_wait
                .render(&mut out, QUEUE_WAIT.name, &labels);
        }
        header(&mut out, &UPTIME);
        let uptime = self.started.elapsed().as_secs_f64();
        sample(&mut out, UPTIME.name, &[], uptime);
        for (spec, counter) in [
            (&REPLAY_BYTES, &front.stats.replay_bytes),
            (&REPLAY_OVER_BUDGET, &front.stats.replay_over_budget),
        ] {
            header(&mut out, spec);
            sample(&mut out, spec.name, &[], load(counter));
        }
        header(&mut out, &POOL_FALLBACKS);
        for (from, to, count) in front.fallbacks {
            sample(
                &mut out,
                POOL_FALLBACKS.name,
                &[("from", from), ("to", to)],
                *count as f64,
            );
        }
        render_state(&mut out, pools);
        header(&mut out, &RUNTIME_TASKS);
        let tasks = self.runtime_tasks() as f64;
        sample(&mut out, RUNTIME_TASKS.name, &[], tasks);
        out
    }
}

/// The tenants' families (each tenant a series, so the label is bounded by the keys file), and the
/// requests refused for want of a key.
fn render_tenants(out: &mut String, front: &Front) {
    header(out, &AUTH_FAILURES);
    let (missing, unknown) = front.auth_failures;
    sample(
        out,
        AUTH_FAILURES.name,
        &[("reason", "missing")],
        missing as f64,
    );
    sample(
        out,
        AUTH_FAILURES.name,
        &[("reason", "unknown")],
        unknown as f64,
    );
    header(out, &TENANT_REQUESTS);
    for tenant in front.tenants {
        for (class, count) in TENANT_CLASSES.iter().zip(tenant.answers()) {
            let labels = [("tenant", &**tenant.name()), ("code", *class)];
            sample(out, TENANT_REQUESTS.name, &labels, count as f64);
        }
    }
    for (spec, value) in [
        (&TENANT_IN_FLIGHT, Tenant::in_flight as fn(&Tenant) -> u64),
        (&TENANT_QUEUED, Tenant::queued),
    ] {
        header(out, spec);
        for tenant in front.tenants {
            let labels = [("tenant", &**tenant.name())];
            sample(out, spec.name, &labels, value(tenant) as f64);
        }
    }
    header(out, &TENANT_REFUSALS);
    for tenant in front.tenants {
        let (queued, in_flight) = tenant.refusals();
        for (reason, count) in [
            (Refusal::TenantQueueFull, queued),
            (Refusal::TenantInFlight, in_flight),
        ] {
            let labels = [("tenant", &**tenant.name()), ("reason", reason.as_str())];
            sample(out, TENANT_REFUSALS.name, &labels, count as f64);
        }
    }
}

/// The outcomes a pool's requests have; one that reached no pool was invalid (unreadable, without a
/// valid API key, or for a model no pool serves) or refused (its tenant at its cap).
fn outcomes(pool: &str) -> &'static [Outcome] {
    if pool.is_empty() {
        &[Outcome::Refused, Outcome::Invalid]
    } else {
        &Outcome::ALL
    }
}

fn load(counter: &std::sync::atomic::AtomicU64) -> f64 {
    counter.load(Ordering::Relaxed) as f64
}

/// Appends discovery's state, pool by pool.
fn render_discovery(out: &mut String, pools: &[Scrape]) {
    header(out, &DISCOVERY_SYNCED);
    for p in pools {
        let synced = f64::from(u8::from(p.discovery.synced));
        sample(out, DISCOVERY_SYNCED.name, &[("pool", p.pool)], synced);
    }
    header(out, &DISCOVERY_PODS);
    for p in pools {
        for (value, count) in &p.discovery.pods {
            let labels = [("pool", p.pool), ("state", *value)];
            sample(out, DISCOVERY_PODS.name, &labels, *count as f64);
        }
    }
    header(out, &DISCOVERY_REJECTIONS);
    for p in pools {
        for (value, count) in &p.discovery.rejections {
            let labels = [("pool", p.pool), ("reason", *value)];
            sample(out, DISCOVERY_REJECTIONS.name, &labels, *count as f64);
        }
    }
    header(out, &DISCOVERY_WATCH_ERRORS);
    for p in pools {
        let errors = p.discovery.watch_errors as f64;
        sample(
            out,
            DISCOVERY_WATCH_ERRORS.name,
            &[("pool", p.pool)],
            errors,
        );
    }
    header(out, &DISCOVERY_LISTS);
    for p in pools {
        let lists = p.discovery.lists as f64;
        sample(out, DISCOVERY_LISTS.name, &[("pool", p.pool)], lists);
    }
    header(out, &SALAD_LOOKUPS);
    for p in pools {
        for (result, count) in &p.discovery.lookups {
            let labels = [("pool", p.pool), ("result", *result)];
            sample(out, SALAD_LOOKUPS.name, &labels, *count as f64);
        }
    }
    header(out, &REGISTRATIONS);
    for p in pools {
        for (result, count) in &p.discovery.registrations {
            let labels = [("pool", p.pool), ("result", *result)];
            sample(out, REGISTRATIONS.name, &labels, *count as f64);
        }
    }
}

/// Appends what is read at scrape time, pool by pool within each family.
fn render_state(out: &mut String, pools: &[Scrape]) {
    header(out, &QUEUE_DEPTH);
    for p in pools {
        sample(out, QUEUE_DEPTH.name, &[("pool", p.pool)], p.queued as f64);
    }
    header(out, &DEMAND);
    for p in pools {
        sample(out, DEMAND.name, &[("pool", p.pool)], p.demand as f64);
    }
    let capacities: Vec<_> = pools
        .iter()
        .filter_map(|p| p.capacity.map(|c| (p.pool, c)))
        .collect();
    if !capacities.is_empty() {
        header(out, &CAPACITY);
        for (pool, capacity) in capacities {
            sample(out, CAPACITY.name, &[("pool", pool)], capacity as f64);
        }
    }
    header(out, &REJECTIONS);
    for p in pools {
        for (reason, count) in &p.rejections {
            let labels = [("pool", p.pool), ("reason", *reason)];
            sample(out, REJECTIONS.name, &labels, *count as f64);
        }
    }
    header(out, &RETRIES);
    for p in pools {
        for (reason, count) in p.stats.retries.by_reason() {
            let labels = [("pool", p.pool), ("reason", reason)];
            sample(out, RETRIES.name, &labels, count as f64);
        }
    }
    header(out, &RETRY_BUDGET_EXHAUSTED);
    for p in pools {
        let exhausted = load(&p.stats.retries.budget_exhausted);
        sample(
            out,
            RETRY_BUDGET_EXHAUSTED.name,
            &[("pool", p.pool)],
            exhausted,
        );
    }
    type Counter = fn(&ProxyStats) -> &std::sync::atomic::AtomicU64;
    let counters: [(&MetricSpec, Counter); 7] = [
        (&ATTEMPTS, |s| &s.attempts),
        (&HEDGES, |s| &s.hedges),
        (&HEDGES_WON, |s| &s.hedges_won),
        (&STREAMS_CUT, |s| &s.streams_cut),
        (&STREAMS_MOVED, |s| &s.streams_moved),
        (&STREAM_PAUSES, |s| &s.stream_pauses),
        (&CONTINUED_BY_TEXT, |s| &s.continued_by_text),
    ];
    for (spec, counter) in counters {
        header(out, spec);
        for p in pools {
            sample(out, spec.name, &[("pool", p.pool)], load(counter(p.stats)));
        }
    }
    header(out, &CONTINUATIONS);
    for p in pools {
        for outcome in Continuation::ALL {
            let count = p.stats.continuations.get(outcome);
            let labels = [("pool", p.pool), ("outcome", outcome.as_str())];
            sample(out, CONTINUATIONS.name, &labels, count as f64);
        }
    }

    render_discovery(out, pools);

    header(out, &ENDPOINTS);
    for p in pools {
        let views = p.endpoints;
        let mut sources: Vec<&str> = views.iter().map(|v| v.source).collect();
        sources.sort_unstable();
        sources.dedup();
        for source in sources {
            for state in EndpointState::ALL {
                let count = views
                    .iter()
                    .filter(|v| v.source == source && v.state == state)
                    .count();
                let labels = [
                    ("pool", p.pool),
                    ("source", source),
                    ("state", state.as_str()),
                ];
                sample(out, ENDPOINTS.name, &labels, count as f64);
            }
        }
    }
    if pools.iter().all(|p| p.endpoints.is_empty()) {
        return;
    }
    header(out, &ENDPOINT_STATE);
    for p in pools {
        for view in p.endpoints {
            for state in EndpointState::ALL {
                let value = f64::from(u8::from(view.state == state));
                let labels = [
                    ("pool", p.pool),
                    ("endpoint", view.url.as_str()),
                    ("state", state.as_str()),
                ];
                sample(out, ENDPOINT_STATE.name, &labels, value);
            }
        }
    }
    let per_endpoint: [(&MetricSpec, ReadView); 14] = [
        (&ENDPOINT_OUTSTANDING, |v| Some(v.outstanding as f64)),
        (&ENDPOINT_LIMIT, |v| v.limit.map(|l| l as f64)),
        (&ENDPOINT_REQUESTS, |v| Some(v.counts.requests as f64)),
        (&ENDPOINT_FAILURES, |v| Some(v.counts.failures as f64)),
        (&ENDPOINT_EJECTIONS, |v| Some(v.counts.ejections as f64)),
        (&ENDPOINT_STALLS, |v| Some(v.counts.stalls as f64)),
        (&ENDPOINT_COOLDOWNS, |v| Some(v.counts.cooldowns as f64)),
        (&ENDPOINT_LATENCY, |v| {
            v.timing.latency_ms.map(|ms| ms / 1000.0)
        }),
        (&ENDPOINT_HEARTBEAT, |v| {
            v.heartbeat.last_heartbeat_ms.map(|ms| ms / 1000.0)
        }),
        (&ENDPOINT_HEARTBEAT_OK, |v| {
            v.heartbeat
                .last_heartbeat_ok
                .map(|ok| f64::from(u8::from(ok)))
        }),
        (&ENDPOINT_ENGINE_WAITING, |v| {
            v.signals.waiting.map(|n| n as f64)
        }),
        (&ENDPOINT_ENGINE_IN_NODE, |v| {
            v.signals.in_node.map(|n| n as f64)
        }),
        (&ENDPOINT_ENGINE_KV_CACHE, |v| v.signals.kv_cache),
        (&ENDPOINT_SIGNALS_AGE, |v| v.signals.age_s),
    ];
    for (spec, read) in per_endpoint {
        let values: Vec<_> = pools
            .iter()
            .flat_map(|p| p.endpoints.iter().map(move |view| (p.pool, view)))
            .filter_map(|(pool, view)| read(view).map(|value| (pool, view, value)))
            .collect();
        // Described even with no sample (no endpoint has a reading yet), like every metric.
        header(out, spec);
        for (pool, view, value) in values {
            let labels = [("pool", pool), ("endpoint", view.url.as_str())];
            sample(out, spec.name, &labels, value);
        }
    }
}

/// Reads one figure of an endpoint (`None`: no sample for it).
type ReadView = fn(&EndpointView) -> Option<f64>;

fn header(out: &mut String, spec: &MetricSpec) {
    let _ = writeln!(out, "# HELP {} {}", spec.name, spec.help);
    let _ = writeln!(out, "# TYPE {} {}", spec.name, spec.kind);
}

/// One sample; a label with an empty value is left out (as Prometheus reads it anyway).
pub(super) fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    out.push_str(name);
    if labels.iter().any(|(_, v)| !v.is_empty()) {
        out.push('{');
        let mut first = true;
        for (key, value) in labels.iter().filter(|(_, v)| !v.is_empty()) {
            if !first {
                out.push(',');
            }
            first = false;
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

//! The `/metrics` page in Prometheus' text exposition format, from recorded figures and a [`Scrape`].

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use super::{
    ATTEMPTS, BUILD_INFO, CAPACITY, CLASSES, CONFIG_RELOADS, CONTINUATIONS, Continuation, DEMAND,
    DISCOVERY_LISTS, DISCOVERY_PODS, DISCOVERY_REJECTIONS, DISCOVERY_SYNCED,
    DISCOVERY_WATCH_ERRORS, ENDPOINT_COOLDOWNS, ENDPOINT_EJECTIONS, ENDPOINT_FAILURES,
    ENDPOINT_HEARTBEAT, ENDPOINT_HEARTBEAT_OK, ENDPOINT_LATENCY, ENDPOINT_LIMIT,
    ENDPOINT_OUTSTANDING, ENDPOINT_REQUESTS, ENDPOINT_STALLS, ENDPOINT_STATE, ENDPOINTS,
    FIRST_BYTE, HEDGES, HEDGES_WON, Metrics, Outcome, ProxyStats, QUEUE_DEPTH, QUEUE_WAIT,
    REGISTRATIONS, REJECTIONS, REPLAY_BYTES, REPLAY_OVER_BUDGET, REQUEST_DURATION, REQUESTS,
    RETRIES, RETRY_BUDGET_EXHAUSTED, RUNTIME_TASKS, SALAD_LOOKUPS, STREAMS_CUT, Spec, UPTIME,
};
use crate::endpoint::{EndpointState, EndpointView};

/// The state of things at scrape time, read by whoever owns them (the admin port) as plain figures.
pub struct Scrape<'a> {
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

impl Metrics {
    /// The whole `/metrics` page.
    pub fn render(&self, scrape: &Scrape) -> String {
        let mut out = String::with_capacity(4096);
        header(&mut out, &REQUESTS);
        for outcome in Outcome::ALL {
            for (class, count) in CLASSES.iter().zip(&self.requests[outcome as usize]) {
                let labels = [("outcome", outcome.as_str()), ("code", *class)];
                sample(&mut out, REQUESTS.name, &labels, load(count));
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
        header(&mut out, &UPTIME);
        let uptime = self.started.elapsed().as_secs_f64();
        sample(&mut out, UPTIME.name, &[], uptime);
        render_state(&mut out, scrape);
        header(&mut out, &RUNTIME_TASKS);
        let tasks = self.runtime_tasks() as f64;
        sample(&mut out, RUNTIME_TASKS.name, &[], tasks);
        out
    }
}

fn load(counter: &std::sync::atomic::AtomicU64) -> f64 {
    counter.load(Ordering::Relaxed) as f64
}

/// Appends discovery's state.
fn render_discovery(out: &mut String, figures: &DiscoveryFigures) {
    header(out, &DISCOVERY_SYNCED);
    let synced = f64::from(u8::from(figures.synced));
    sample(out, DISCOVERY_SYNCED.name, &[], synced);
    for (spec, label, counts) in [
        (&DISCOVERY_PODS, "state", &figures.pods),
        (&DISCOVERY_REJECTIONS, "reason", &figures.rejections),
    ] {
        header(out, spec);
        for (value, count) in counts {
            sample(out, spec.name, &[(label, value)], *count as f64);
        }
    }
    header(out, &DISCOVERY_WATCH_ERRORS);
    let errors = figures.watch_errors as f64;
    sample(out, DISCOVERY_WATCH_ERRORS.name, &[], errors);
    header(out, &DISCOVERY_LISTS);
    sample(out, DISCOVERY_LISTS.name, &[], figures.lists as f64);
    for (spec, counts) in [
        (&SALAD_LOOKUPS, &figures.lookups),
        (&REGISTRATIONS, &figures.registrations),
    ] {
        header(out, spec);
        for (result, count) in counts {
            sample(out, spec.name, &[("result", result)], *count as f64);
        }
    }
}

/// Appends what is read at scrape time.
fn render_state(out: &mut String, scrape: &Scrape) {
    header(out, &QUEUE_DEPTH);
    sample(out, QUEUE_DEPTH.name, &[], scrape.queued as f64);
    header(out, &DEMAND);
    sample(out, DEMAND.name, &[], scrape.demand as f64);
    if let Some(capacity) = scrape.capacity {
        header(out, &CAPACITY);
        sample(out, CAPACITY.name, &[], capacity as f64);
    }

    header(out, &REJECTIONS);
    for (reason, count) in &scrape.rejections {
        sample(out, REJECTIONS.name, &[("reason", reason)], *count as f64);
    }
    let stats = scrape.stats;
    header(out, &RETRIES);
    for (reason, count) in stats.retries.by_reason() {
        sample(out, RETRIES.name, &[("reason", reason)], count as f64);
    }
    header(out, &RETRY_BUDGET_EXHAUSTED);
    let exhausted = load(&stats.retries.budget_exhausted);
    sample(out, RETRY_BUDGET_EXHAUSTED.name, &[], exhausted);
    header(out, &ATTEMPTS);
    sample(out, ATTEMPTS.name, &[], load(&stats.attempts));
    for (spec, counter) in [
        (&HEDGES, &stats.hedges),
        (&HEDGES_WON, &stats.hedges_won),
        (&STREAMS_CUT, &stats.streams_cut),
        (&REPLAY_BYTES, &stats.replay_bytes),
        (&REPLAY_OVER_BUDGET, &stats.replay_over_budget),
    ] {
        header(out, spec);
        sample(out, spec.name, &[], load(counter));
    }

    header(out, &CONTINUATIONS);
    for outcome in Continuation::ALL {
        let count = stats.continuations.get(outcome);
        sample(
            out,
            CONTINUATIONS.name,
            &[("outcome", outcome.as_str())],
            count as f64,
        );
    }

    render_discovery(out, &scrape.discovery);

    let views = scrape.endpoints;
    header(out, &ENDPOINTS);
    let mut sources: Vec<&str> = views.iter().map(|v| v.source).collect();
    sources.sort_unstable();
    sources.dedup();
    for source in sources {
        for state in EndpointState::ALL {
            let count = views
                .iter()
                .filter(|v| v.source == source && v.state == state)
                .count();
            sample(
                out,
                ENDPOINTS.name,
                &[("source", source), ("state", state.as_str())],
                count as f64,
            );
        }
    }
    if views.is_empty() {
        return;
    }
    header(out, &ENDPOINT_STATE);
    for view in views {
        for state in EndpointState::ALL {
            let value = f64::from(u8::from(view.state == state));
            sample(
                out,
                ENDPOINT_STATE.name,
                &[("endpoint", &view.url), ("state", state.as_str())],
                value,
            );
        }
    }
    let per_endpoint: [(&Spec, ReadView); 10] = [
        (&ENDPOINT_OUTSTANDING, |v| Some(v.outstanding as f64)),
        (&ENDPOINT_LIMIT, |v| v.limit.map(|l| l as f64)),
        (&ENDPOINT_REQUESTS, |v| Some(v.requests as f64)),
        (&ENDPOINT_FAILURES, |v| Some(v.failures as f64)),
        (&ENDPOINT_EJECTIONS, |v| Some(v.ejections as f64)),
        (&ENDPOINT_STALLS, |v| Some(v.stalls as f64)),
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

pub(super) fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
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

//! What the demo shows: a live table (refreshed in place on a terminal, plain lines otherwise) and the
//! final summary, as text or as one JSON line.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;

use super::DemoOptions;
use super::load::{ClientOutcome, LoadGenerator};
use super::schedule::Shortfall;
use crate::app::Parts;
use crate::breaker::State;
use crate::metrics::Continuation;
use crate::sim::{Condition, Fleet};

/// One node's row.
struct NodeRow {
    name: String,
    condition: &'static str,
    health: &'static str,
    circuit: &'static str,
    outstanding: u64,
    limit: Option<u64>,
    /// The node's own queue and KV-cache use, as tongs reads them from its metrics (none: no reading).
    queue: Option<u64>,
    cache: Option<f64>,
    served: u64,
    errors: u64,
}

/// Everything one refresh shows.
pub struct View {
    elapsed: Duration,
    nodes: Vec<NodeRow>,
    sent: u64,
    succeeded: u64,
    failed: u64,
    rejected: u64,
    retried: u64,
    /// Streams continued on another node after theirs broke.
    continued: u64,
    queued: usize,
    interruptions: u64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Reads the fleet, the proxy and the generator at one moment.
pub fn snapshot(
    fleet: &Fleet,
    parts: &Parts,
    generator: &LoadGenerator,
    elapsed: Duration,
) -> View {
    let endpoints = parts.registry().snapshot();
    let now = tokio::time::Instant::now();
    let settings = parts.proxy().settings();
    let (slow_start, max_age) = (
        settings.balance.slow_start,
        settings.balance.signals_max_age,
    );
    let nodes = fleet
        .nodes()
        .iter()
        .map(|node| {
            let url = node.url();
            let endpoint = endpoints.iter().find(|e| e.url() == url);
            let view = endpoint.map(|e| e.view(now, slow_start, max_age));
            let signals = view.as_ref().map(|v| v.signals.clone()).filter(|s| s.fresh);
            let stats = node.stats();
            NodeRow {
                name: node.name().to_owned(),
                // A node that said it goes is still up until then: "going".
                condition: match node.leaving_in() {
                    Some(_) if node.condition() == Condition::Up => "going",
                    _ => node.condition().label(),
                },
                // The one word `/debug/endpoints` says: cooldown after a 503, probing, ejected too.
                health: view.as_ref().map_or("-", |v| v.state.as_str()),
                circuit: endpoint.map_or("-", |e| match e.circuit().state() {
                    State::Closed { .. } => "closed",
                    State::Open { .. } => "open",
                    State::HalfOpen { .. } => "half-open",
                }),
                outstanding: endpoint.map_or(0, |e| e.outstanding()),
                limit: endpoint.and_then(|e| e.load().limit()),
                queue: signals.as_ref().and_then(|s| s.waiting),
                cache: signals.as_ref().and_then(|s| s.kv_cache),
                served: stats.served,
                errors: endpoint.map_or(0, |e| e.tally().failures())
                    + stats.gateway_503
                    + stats.shed,
            }
        })
        .collect();
    let (sent, succeeded, rejected, failed, p50_ms, p99_ms) = generator.with(|r| {
        let failed: u64 = r.failures().values().sum();
        (
            r.sent(),
            r.count(ClientOutcome::Succeeded),
            r.count(ClientOutcome::Rejected),
            failed,
            r.latency_ms(0.5),
            r.latency_ms(0.99),
        )
    });
    View {
        elapsed,
        nodes,
        sent,
        succeeded,
        failed,
        rejected,
        retried: parts.proxy().stats().retries.total(),
        continued: parts
            .proxy()
            .stats()
            .continuations
            .get(Continuation::Continued),
        queued: parts.queue().len(),
        interruptions: fleet.interruptions_injected(),
        p50_ms,
        p99_ms,
    }
}

/// What the table's columns and the status line mean, under the table.
const LEGEND: &str = "\
  node state   what the simulator does to the node: up; going: up, but it said it goes soon (its
               heartbeats carry x-tongs-drain); or an interruption (refuse: gone, connections reset;
               blackhole: silent; gateway-503; slow; gray: health passes but work hangs)
  tongs sees   the node's state in tongs, as /debug/endpoints names it (healthy, unhealthy, stalled,
               ejected, probing, cooldown after a 503, suspect, slow-start, draining: it said it goes,
               so no new request and its streams move); circuit: its breaker
  outstanding  requests on the node now, against its concurrency limit; served / errors so far
  queue, KV    what the node's own /metrics says, as tongs reads it: requests waiting in its own queue,
               its KV cache in use (-: no fresh reading)
  ok           answers complete and exact; retried: sent again elsewhere; continued: streams resumed on
               another node; rejected: 503s tongs made itself; queued: waiting for a free slot now
";

fn render(view: &View) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<12} {:<12} {:<10} {:<10} {:>11} {:>5} {:>5} {:>5} {:>8} {:>7}",
        "node",
        "node state",
        "tongs sees",
        "circuit",
        "outstanding",
        "limit",
        "queue",
        "KV",
        "served",
        "errors"
    );
    for node in &view.nodes {
        let limit = node.limit.map_or_else(|| "-".to_owned(), |l| l.to_string());
        let queue = node.queue.map_or_else(|| "-".to_owned(), |q| q.to_string());
        let cache = node
            .cache
            .map_or_else(|| "-".to_owned(), |c| format!("{:.0}%", 100.0 * c));
        let _ = writeln!(
            out,
            "{:<12} {:<12} {:<10} {:<10} {:>11} {:>5} {:>5} {:>5} {:>8} {:>7}",
            node.name,
            node.condition,
            node.health,
            node.circuit,
            node.outstanding,
            limit,
            queue,
            cache,
            node.served,
            node.errors
        );
    }
    let done = view.succeeded + view.failed + view.rejected;
    let success = if done == 0 {
        100.0
    } else {
        100.0 * view.succeeded as f64 / done as f64
    };
    let _ = writeln!(
        out,
        "t={:>5.1}s sent={} ok={:.1}% failed={} retried={} continued={} rejected={} queued={} interruptions={} p50={:.0}ms p99={:.0}ms",
        view.elapsed.as_secs_f64(),
        view.sent,
        success,
        view.failed,
        view.retried,
        view.continued,
        view.rejected,
        view.queued,
        view.interruptions,
        view.p50_ms,
        view.p99_ms
    );
    out
}

/// Where the live view goes.
pub enum Sink {
    Stdout,
    Stderr,
}

/// The live view: redraws in place on a terminal, prints plain blocks otherwise.
pub struct Live {
    sink: Sink,
    terminal: bool,
    lines_drawn: usize,
    /// The legend was written (once is enough where nothing is redrawn).
    legend_shown: bool,
}

impl Live {
    pub fn new(sink: Sink) -> Live {
        let terminal = match sink {
            Sink::Stdout => std::io::stdout().is_terminal(),
            Sink::Stderr => std::io::stderr().is_terminal(),
        };
        Live {
            sink,
            terminal,
            lines_drawn: 0,
            legend_shown: false,
        }
    }

    pub fn is_terminal(&self) -> bool {
        self.terminal
    }

    pub fn show(&mut self, view: &View) {
        let text = render(view);
        let mut frame = String::new();
        if self.terminal && self.lines_drawn > 0 {
            // Cursor up to the first line of the last frame, then clear to the end of the screen.
            let _ = write!(frame, "\x1b[{}F\x1b[J", self.lines_drawn);
        }
        frame.push_str(&text);
        // Redrawn with the table on a terminal; once, under the first table, in a log.
        let legend = self.terminal || !self.legend_shown;
        if legend {
            frame.push_str(LEGEND);
            self.legend_shown = true;
        }
        if !self.terminal {
            frame.push('\n');
        }
        self.lines_drawn = text.lines().count() + if legend { LEGEND.lines().count() } else { 0 };
        self.write(&frame);
    }

    pub fn finish(&mut self) {
        self.write("\n");
    }

    fn write(&self, text: &str) {
        let _ = match self.sink {
            Sink::Stdout => std::io::stdout().lock().write_all(text.as_bytes()),
            Sink::Stderr => std::io::stderr().lock().write_all(text.as_bytes()),
        };
    }
}

/// Latency figures of succeeded requests, in milliseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// The final summary (also the `--json` line).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub duration_s: f64,
    pub nodes: usize,
    pub rps: f64,
    pub seed: u64,
    pub requests: u64,
    pub succeeded: u64,
    /// Failed requests by kind: a status code, `broken`, `client-timeout`, `unfinished`.
    pub failed: BTreeMap<String, u64>,
    pub retried: u64,
    /// Streams continued on another node after theirs broke mid-stream.
    pub continued: u64,
    /// Attempts sent to nodes per request (1.0 = no retries).
    pub attempts_per_request: f64,
    pub rejected: u64,
    pub interruptions_injected: u64,
    /// The capacity the planned interruptions left the fleet, against the load.
    pub capacity: Shortfall,
    pub latency_ms: Latency,
}

impl Summary {
    pub fn collect(
        options: &DemoOptions,
        fleet: &Fleet,
        parts: &Parts,
        generator: &LoadGenerator,
        elapsed: Duration,
        capacity: Shortfall,
    ) -> Summary {
        generator.with(|r| Summary {
            duration_s: (elapsed.as_secs_f64() * 10.0).round() / 10.0,
            nodes: fleet.nodes().len(),
            rps: options.rps,
            seed: options.seed,
            requests: r.sent(),
            succeeded: r.count(ClientOutcome::Succeeded),
            failed: r.failures(),
            retried: parts.proxy().stats().retries.total(),
            continued: parts
                .proxy()
                .stats()
                .continuations
                .get(Continuation::Continued),
            attempts_per_request: {
                let proxy = parts.proxy();
                let stats = proxy.stats();
                let requests = stats.requests.load(Ordering::Relaxed).max(1);
                let per = stats.attempts.load(Ordering::Relaxed) as f64 / requests as f64;
                (per * 1000.0).round() / 1000.0
            },
            rejected: r.count(ClientOutcome::Rejected),
            interruptions_injected: fleet.interruptions_injected(),
            capacity,
            latency_ms: Latency {
                p50: r.latency_ms(0.5),
                p90: r.latency_ms(0.9),
                p99: r.latency_ms(0.99),
                max: r.max_latency_ms(),
            },
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|err| format!(r#"{{"error":"{err}"}}"#))
    }

    pub fn to_text(&self) -> String {
        let failed: u64 = self.failed.values().sum();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "summary: {} requests in {:.1}s at {} req/s over {} nodes (seed {})",
            self.requests, self.duration_s, self.rps, self.nodes, self.seed
        );
        let percent = |n: u64| {
            if self.requests == 0 {
                0.0
            } else {
                100.0 * n as f64 / self.requests as f64
            }
        };
        let _ = writeln!(
            out,
            "  succeeded      {:>7} ({:.2}%)",
            self.succeeded,
            percent(self.succeeded)
        );
        let _ = writeln!(
            out,
            "  failed         {:>7} ({:.2}%)",
            failed,
            percent(failed)
        );
        for (kind, n) in &self.failed {
            let _ = writeln!(out, "    {kind:<12} {n:>7}");
        }
        let _ = writeln!(out, "  rejected       {:>7}", self.rejected);
        let _ = writeln!(
            out,
            "  retried        {:>7}  ({:.3} attempts per request)",
            self.retried, self.attempts_per_request
        );
        let _ = writeln!(
            out,
            "  continued      {:>7}  (streams continued on another node)",
            self.continued
        );
        let _ = writeln!(out, "  interruptions  {:>7}", self.interruptions_injected);
        let c = &self.capacity;
        if c.seconds > 0.0 {
            let _ = writeln!(
                out,
                "  short of load  {:>6.1}s  (the interruptions left less than {} req/s, down to {} of \
                 the fleet's {}: refusals there are the demo's doing)",
                c.seconds, self.rps, c.lowest_rps, c.capacity_rps
            );
        } else {
            let _ = writeln!(
                out,
                "  capacity left  {:>7}  req/s at least, of the fleet's {} (load {} req/s)",
                c.lowest_rps, c.capacity_rps, self.rps
            );
        }
        let l = &self.latency_ms;
        let _ = writeln!(
            out,
            "  latency ms     p50 {:.0}  p90 {:.0}  p99 {:.0}  max {:.0}",
            l.p50, l.p90, l.p99, l.max
        );
        out
    }
}

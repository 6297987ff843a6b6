//! tongs against nginx, HAProxy and Caddy, each in front of the same seeded simulated fleet of
//! interruptible GPU nodes, one after another in one run; prints one table and writes it to
//! `benches/RESULTS.md` (or `RESULTS`).
//!
//!     bash benches/compare/run                   # installs the peers, then runs this
//!     SCENARIOS="steady churn" PROXIES="tongs nginx" DURATION=20s cargo bench --bench compare
//!
//! Scenarios (each proxy gets a fresh fleet with the same seed, and the same load):
//! - `steady`: six nodes whose mean service times differ 5× (120 to 600 ms), no failures, open-loop
//!   load at 60 % of the fleet's capacity;
//! - `churn`: the same fleet at 50 % with every interruption kind — `refuse`, `blackhole`,
//!   `gateway-503`, `slow` — on a different node, spread over the run at the same offsets for every proxy;
//! - `overload`: the same fleet at 2× its capacity; nodes answer 503 + Retry-After beyond a small line;
//! - `streaming`: every request an SSE token stream, 60 % load; time to first byte and to the end;
//! - `gray`: the churn fleet at 50 % with gray failures — two nodes whose health passes while their
//!   requests hang, one whose health comes back before its worker does — and a partition;
//! - `stalls`: every request an SSE stream at 50 %, with a gray node that stalls its streams after their
//!   first chunk, a partition and a reset mid-stream; how long a stalled stream takes to end;
//! - `cuts`: every request a streamed completion, on six identical nodes at 50 %, cut mid-flight by
//!   resets, partitions and gray stalls spread over the run on different nodes (at most two out at
//!   once); the share of streams that end complete and exact, and what a pause cost those that
//!   survived one: their longest gap between two chunks (see `cuts.rs`, and its own table);
//! - `announced` and `unannounced`: long streamed completions (100 tokens over ~5 s) on six nodes at
//!   50 %, four of which go one after another; in `announced` each says so 10 s ahead (`x-tongs-drain`),
//!   in `unannounced` not (see `announced.rs`, and its own table);
//! - `plain`: plain (non-OpenAI) SSE streams, `POST /generate` with `Accept: text/event-stream`, which
//!   no proxy can continue on another node: four nodes of 8 streams at once, 30 events over ~0.6 s,
//!   at a fixed 25 streams/s (47 % of their capacity) for DURATION; one node goes gray (stalls its
//!   streams after their first event) for 8 s, one is partitioned for 6 s, one refuses for 4 s, at
//!   15, 45 and 75 % of the window; a success is a whole stream, every event and the end (see
//!   `plain.rs`; `SAMPLES=DIR` also writes every stream's first byte, outcome and node);
//! - `pauses`: no interruption at all, but healthy nodes that pause their streams as inference servers
//!   do: the first token 0.3 to 5 s after the role chunk, or streams preempted mid-answer for ~3 s;
//!   streams whole, and what tongs did about the pauses (see `pauses.rs`, and its own table);
//! - `chat`: six continuous-batching engines (the simulator's vLLM-like nodes: a batch of 8, an
//!   unbounded waiting line, a prefix cache, vLLM's `/metrics`), four at full speed and two at half;
//!   multi-turn conversations over 24 shared system prompts, each turn resending the whole history,
//!   streamed, at 65 % of capacity; the time to the first token and the prefix-cache hit rate the
//!   nodes counted (see `chat.rs`, and its own table);
//! - `saturate`: the same engines at 130 % of capacity, streamed completions of distinct prompts; the
//!   first byte's time and the largest waiting line a node reached (see `saturate.rs`);
//! - `throughput`: an nginx origin that answers at once, wrk at a fixed number of connections (closed
//!   loop), as many requests per second as each proxy takes; the origin alone is the baseline.
//!
//! tongs runs its release binary with its defaults (only the endpoints configured), and again as
//! `tongs-adaptive` with `concurrency.limit: adaptive`, the one setting that changes overload, and as
//! `tongs-capacity` told each node's capacity (`discovery.static[].max_outstanding`), as HAProxy's
//! `maxconn` tells it HAProxy. `chat` and `saturate` compare tongs, nginx and `tongs-own-counts`
//! (tongs told to pick by its own counts alone: `signals: {enabled: false}` and
//! `balancer: {scorers: {expected-latency: 1}}`), which runs only when PROXIES names it; `chat` also
//! `tongs-2-replicas`: two tongs processes with tongs' configuration, sharing nothing, in front of
//! the same fleet, a conversation's turns alternating between them (the first to one, the second to
//! the other, ...); it runs in `chat` only. The peers are
//! configured as well as each allows for the job: least connections; active health checks where the
//! open-source build has them; retries on connect errors, timeouts and 502/503/504, POST included, on
//! another server; 1 s connect timeout; 10 s per-try timeout; a queue where there is one. Their
//! configuration files are printed with `SHOW_CONFIGS=1`.
//! `TONGS_LOG=tongs=debug` keeps tongs' own log in `target/bench-tongs-PORT.log`.
//!
//! Environment: SCENARIOS, PROXIES (default all), DURATION (measured time of the open-loop scenarios,
//! default 30s), PAUSES_DURATION (each pauses fleet's, 10s), CHURN_DURATION (default 60s), WARMUP (unrecorded load first, default 3s), SEED (1),
//! THROUGHPUT_DURATION (10s), CONNECTIONS (wrk's, 64), RESULTS (file to write; empty: none),
//! TONGS_CONFIG (YAML added to tongs' configuration, to try a setting; the results file says so).
//! Under `cargo test --all-targets` (no `--bench` argument) it runs a smoke pass instead: every
//! proxy, two seconds of steady load, checking that each configuration starts and serves.
#![forbid(unsafe_code)]

#[path = "../support/mod.rs"]
mod support;

mod announced;
mod chat;
mod cuts;
mod load;
mod pauses;
mod peers;
mod plain;
mod saturate;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::time::Instant;
use tongs::sim::{Condition, Fleet, FleetConfig, InterruptionKind, ResponseKind};

use load::{Ask, CLIENT_TIMEOUT, offer, wrk};
use peers::{Running, Upstream, origin_config, start_proxy};
use support::stats::{self, max_ms, quantile_ms};
use support::{Process, TempDir, env_duration, env_list, env_number, find_program, fleet};

/// The fleet: name, requests served at once, mean service time in ms. Slowest / fastest = 5.
const NODES: [fleet::Node; 6] = [
    ("a100", 8, 120),
    ("l40s", 4, 200),
    ("rtx4090", 4, 250),
    ("a10", 4, 300),
    ("rtx3090", 2, 450),
    ("rtx3060", 2, 600),
];
const SPREAD: f64 = 0.3;
/// Requests a node lets wait inside it before it answers 503 + Retry-After.
const NODE_QUEUE: usize = 8;
/// In the overload scenario the nodes keep a short line, as a loaded inference server does.
const OVERLOAD_NODE_QUEUE: usize = 2;
/// The peers' per-try timeout and the longest a request may wait in a peer's queue.
const PER_TRY_TIMEOUT: Duration = Duration::from_secs(10);
const ALL_SCENARIOS: &str = "steady churn overload streaming gray stalls cuts announced unannounced plain pauses chat saturate \
     throughput";
const ALL_PROXIES: &str =
    "tongs tongs-adaptive tongs-capacity tongs-2-replicas nginx haproxy caddy";
/// Proxies PROXIES may name besides the default ones.
const OTHER_PROXIES: &str = "tongs-own-counts";

fn main() -> Result<()> {
    let smoke = !support::benchmarking();
    let settings = Settings::from_env(smoke)?;
    support::block_on(run(settings))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Steady,
    Churn,
    Overload,
    Streaming,
    Gray,
    Stalls,
    Cuts,
    Announced,
    Unannounced,
    Plain,
    Pauses,
    Chat,
    Saturate,
    Throughput,
}

impl Scenario {
    fn parse(name: &str) -> Result<Scenario> {
        Ok(match name {
            "steady" => Scenario::Steady,
            "churn" => Scenario::Churn,
            "overload" => Scenario::Overload,
            "streaming" => Scenario::Streaming,
            "gray" => Scenario::Gray,
            "stalls" => Scenario::Stalls,
            "cuts" => Scenario::Cuts,
            "announced" => Scenario::Announced,
            "unannounced" => Scenario::Unannounced,
            "plain" => Scenario::Plain,
            "pauses" => Scenario::Pauses,
            "chat" => Scenario::Chat,
            "saturate" => Scenario::Saturate,
            "throughput" => Scenario::Throughput,
            other => bail!("SCENARIOS: unknown scenario {other:?} (known: {ALL_SCENARIOS})"),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Scenario::Steady => "steady",
            Scenario::Churn => "churn",
            Scenario::Overload => "overload",
            Scenario::Streaming => "streaming",
            Scenario::Gray => "gray",
            Scenario::Stalls => "stalls",
            Scenario::Cuts => "cuts",
            Scenario::Announced => "announced",
            Scenario::Unannounced => "unannounced",
            Scenario::Plain => "plain",
            Scenario::Pauses => "pauses",
            Scenario::Chat => "chat",
            Scenario::Saturate => "saturate",
            Scenario::Throughput => "throughput",
        }
    }

    /// Offered load as a share of the fleet's capacity.
    fn load(self) -> f64 {
        match self {
            Scenario::Churn
            | Scenario::Gray
            | Scenario::Stalls
            | Scenario::Cuts
            | Scenario::Announced
            | Scenario::Unannounced => 0.5,
            Scenario::Overload => 2.0,
            _ => 0.6,
        }
    }

    /// Requests offered per second to a fleet of `capacity` requests per second.
    fn rate(self, capacity: f64) -> f64 {
        match self {
            Scenario::Plain => plain::RATE,
            _ => capacity * self.load(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proxy {
    /// tongs with its defaults.
    Tongs,
    /// tongs with one setting changed: `concurrency.limit: adaptive`.
    TongsAdaptive,
    /// tongs told each node's capacity (`discovery.static[].max_outstanding`), as HAProxy is told it
    /// (`maxconn`).
    TongsCapacity,
    /// tongs picking by its own counts alone: the nodes' metrics not read (`signals.enabled: false`),
    /// the expected latency its one scorer.
    TongsOwnCounts,
    /// Two tongs processes with `tongs`' configuration, sharing nothing, in front of the same fleet; the
    /// client alternates between them (`chat` only).
    TongsTwoReplicas,
    Nginx,
    Haproxy,
    Caddy,
}

impl Proxy {
    fn parse(name: &str) -> Result<Proxy> {
        Ok(match name {
            "tongs" => Proxy::Tongs,
            "tongs-adaptive" => Proxy::TongsAdaptive,
            "tongs-capacity" => Proxy::TongsCapacity,
            "tongs-own-counts" => Proxy::TongsOwnCounts,
            "tongs-2-replicas" => Proxy::TongsTwoReplicas,
            "nginx" => Proxy::Nginx,
            "haproxy" => Proxy::Haproxy,
            "caddy" => Proxy::Caddy,
            other => {
                bail!("PROXIES: unknown proxy {other:?} (known: {ALL_PROXIES} {OTHER_PROXIES})")
            }
        })
    }

    fn is_tongs(self) -> bool {
        matches!(
            self,
            Proxy::Tongs
                | Proxy::TongsAdaptive
                | Proxy::TongsCapacity
                | Proxy::TongsOwnCounts
                | Proxy::TongsTwoReplicas
        )
    }

    /// Whether this contender runs in `scenario`: two replicas only where a client's requests belong
    /// together (`chat`'s conversations).
    fn runs_in(self, scenario: Scenario) -> bool {
        self != Proxy::TongsTwoReplicas || scenario == Scenario::Chat
    }

    fn program(self) -> &'static str {
        match self {
            Proxy::Tongs
            | Proxy::TongsAdaptive
            | Proxy::TongsCapacity
            | Proxy::TongsOwnCounts
            | Proxy::TongsTwoReplicas => "tongs",
            Proxy::Nginx => "nginx",
            Proxy::Haproxy => "haproxy",
            Proxy::Caddy => "caddy",
        }
    }
}

struct Settings {
    smoke: bool,
    scenarios: Vec<Scenario>,
    proxies: Vec<Proxy>,
    duration: Duration,
    churn_duration: Duration,
    pauses_duration: Duration,
    warmup: Duration,
    seed: u64,
    throughput_duration: Duration,
    connections: u32,
    results: Option<PathBuf>,
    show_configs: bool,
}

impl Settings {
    fn from_env(smoke: bool) -> Result<Settings> {
        let scenarios = if smoke {
            vec![Scenario::Steady]
        } else {
            env_list("SCENARIOS", ALL_SCENARIOS, Scenario::parse)?
        };
        let proxies = env_list("PROXIES", ALL_PROXIES, Proxy::parse)?;
        let results = match std::env::var("RESULTS") {
            Ok(path) if path.trim().is_empty() => None,
            Ok(path) => Some(PathBuf::from(path)),
            Err(_) if smoke => None,
            Err(_) => Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/RESULTS.md")),
        };
        let settings = Settings {
            smoke,
            scenarios,
            proxies,
            duration: if smoke {
                Duration::from_secs(2)
            } else {
                env_duration("DURATION", Duration::from_secs(30))?
            },
            churn_duration: env_duration("CHURN_DURATION", Duration::from_secs(60))?,
            pauses_duration: env_duration("PAUSES_DURATION", Duration::from_secs(10))?,
            warmup: if smoke {
                Duration::ZERO
            } else {
                env_duration("WARMUP", Duration::from_secs(3))?
            },
            seed: env_number("SEED", 1)?,
            throughput_duration: env_duration("THROUGHPUT_DURATION", Duration::from_secs(10))?,
            connections: env_number("CONNECTIONS", 64)?,
            results,
            show_configs: std::env::var("SHOW_CONFIGS").is_ok_and(|v| v == "1"),
        };
        if settings.duration < Duration::from_secs(1)
            || settings.churn_duration < Duration::from_secs(10)
        {
            bail!("DURATION must be at least 1s and CHURN_DURATION at least 10s");
        }
        if settings.connections == 0 {
            bail!("CONNECTIONS must be at least 1");
        }
        Ok(settings)
    }
}

// ---------------------------------------------------------------------------------------------------
// The fleet.

fn fleet_config(scenario: Scenario, seed: u64) -> FleetConfig {
    let queue = if scenario == Scenario::Overload {
        OVERLOAD_NODE_QUEUE
    } else {
        NODE_QUEUE
    };
    let response = if scenario.streams() {
        ResponseKind::Sse
    } else {
        ResponseKind::Json
    };
    let nodes: &[fleet::Node] = match scenario {
        Scenario::Cuts => &cuts::NODES,
        Scenario::Announced | Scenario::Unannounced => &announced::NODES,
        Scenario::Plain => &plain::NODES,
        _ => &NODES,
    };
    let mut config = fleet::config(seed, nodes, SPREAD, queue, response);
    if matches!(scenario, Scenario::Announced | Scenario::Unannounced) {
        for node in &mut config.nodes {
            node.tokens = announced::TOKENS;
            node.first_token = Some(announced::first_token());
            node.service_time.spread = announced::SPREAD;
        }
    }
    if scenario == Scenario::Plain {
        for node in &mut config.nodes {
            node.tokens = plain::TOKENS;
            node.service_time.spread = plain::SPREAD;
        }
    }
    config
}

/// The churn schedule, as shares of the measured window: (node, kind, starts at, lasts). Each kind hits
/// a different node; the slow node serves five times slower.
const CHURN: [(&str, InterruptionKind, f64, f64); 5] = [
    ("l40s", InterruptionKind::Refuse, 0.10, 0.15),
    ("rtx4090", InterruptionKind::Blackhole, 0.30, 0.15),
    ("a10", InterruptionKind::Gateway503, 0.50, 0.15),
    ("a100", InterruptionKind::Slow, 0.70, 0.12),
    ("rtx3090", InterruptionKind::Refuse, 0.85, 0.10),
];
const SLOW_FACTOR: f64 = 5.0;

/// The gray schedule: two nodes wedge behind a live health endpoint, one node is partitioned, and one
/// comes back from a partition with its health before its worker (blackhole, then gray).
const GRAY: [(&str, InterruptionKind, f64, f64); 5] = [
    ("rtx4090", InterruptionKind::Gray, 0.10, 0.30),
    ("l40s", InterruptionKind::Blackhole, 0.25, 0.15),
    ("a10", InterruptionKind::Gray, 0.45, 0.30),
    ("rtx3090", InterruptionKind::Blackhole, 0.60, 0.10),
    ("rtx3090", InterruptionKind::Gray, 0.70, 0.15),
];

/// The stall schedule, on streams: a gray node stalls its streams after their first chunk, a partition
/// silences streams mid-flight, a reset cuts them.
const STALLS: [(&str, InterruptionKind, f64, f64); 4] = [
    ("l40s", InterruptionKind::Gray, 0.10, 0.25),
    ("rtx4090", InterruptionKind::Blackhole, 0.40, 0.15),
    ("a10", InterruptionKind::Refuse, 0.65, 0.10),
    ("a100", InterruptionKind::Gray, 0.80, 0.10),
];

impl Scenario {
    /// Every request an SSE stream.
    fn streams(self) -> bool {
        matches!(
            self,
            Scenario::Streaming
                | Scenario::Stalls
                | Scenario::Cuts
                | Scenario::Announced
                | Scenario::Unannounced
                | Scenario::Plain
        )
    }

    /// What each request asks for.
    fn ask(self) -> Ask {
        match self {
            Scenario::Plain => Ask::PlainStream {
                tokens: plain::TOKENS,
            },
            // Long generations: streams that outlast the notice, so moving them is what saves them.
            Scenario::Announced | Scenario::Unannounced => Ask::Completion {
                stream: true,
                tokens: announced::TOKENS,
            },
            _ => Ask::Completion {
                stream: self.streams(),
                tokens: tongs::demo::COMPLETION_TOKENS,
            },
        }
    }

    /// The measured window: the churn duration for the scenarios whose interruptions are given as
    /// shares of it, DURATION for the others (`plain`'s interruptions last fixed times).
    fn window(self, settings: &Settings) -> Duration {
        if !self.schedule().is_empty() {
            settings.churn_duration
        } else {
            settings.duration
        }
    }

    /// The interruptions driven during a measured window of `window`: (node, kind, from the window's
    /// start, lasts).
    fn timeline(
        self,
        window: Duration,
    ) -> Vec<(&'static str, InterruptionKind, Duration, Duration)> {
        if self == Scenario::Plain {
            return plain::timeline(window);
        }
        self.schedule()
            .iter()
            .map(|&(node, kind, at, lasts)| (node, kind, window.mul_f64(at), window.mul_f64(lasts)))
            .collect()
    }

    /// The interruptions driven during the measured window as shares of it, if any (`plain` gives its
    /// own in [`Scenario::timeline`]).
    fn schedule(self) -> &'static [(&'static str, InterruptionKind, f64, f64)] {
        match self {
            Scenario::Churn => &CHURN,
            Scenario::Gray => &GRAY,
            Scenario::Stalls => &STALLS,
            Scenario::Cuts => &cuts::SCHEDULE,
            Scenario::Announced | Scenario::Unannounced => &announced::SCHEDULE,
            _ => &[],
        }
    }
}

/// With `SAMPLES=DIR`, writes each success of a run to `DIR/SCENARIO-PROXY.tsv` as its start (ms from
/// the measured window's start) and its latency (ms): where in the run a tail sits, next to the
/// schedule of interruptions; and every request to `DIR/SCENARIO-PROXY-all.tsv` with its first byte,
/// its outcome and the node that answered, where its events name it (`plain`).
fn write_samples(scenario: Scenario, label: &str, tally: &load::Tally) {
    let Ok(dir) = std::env::var("SAMPLES") else {
        return;
    };
    let name: String = label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let path = std::path::Path::new(&dir).join(format!("{}-{name}.tsv", scenario.name()));
    let mut text = String::from("start_ms\tlatency_ms\n");
    for (start, took) in &tally.samples {
        text += &format!("{:.1}\t{:.1}\n", *start as f64 / 1e3, *took as f64 / 1e3);
    }
    let mut records = tally.records.iter().collect::<Vec<_>>();
    records.sort_by_key(|record| record.start);
    let mut all = String::from("start_ms\ttook_ms\tfirst_byte_ms\toutcome\tnode\n");
    for record in records {
        all += &format!(
            "{:.1}\t{:.1}\t{}\t{}\t{}\n",
            record.start as f64 / 1e3,
            record.took as f64 / 1e3,
            record
                .first_byte
                .map_or("-".to_owned(), |us| format!("{:.1}", us as f64 / 1e3)),
            record.outcome,
            record.node.as_deref().unwrap_or("-"),
        );
    }
    let all_path = std::path::Path::new(&dir).join(format!("{}-{name}-all.tsv", scenario.name()));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&path, text))
        .and_then(|()| std::fs::write(&all_path, all));
    if let Err(error) = written {
        eprintln!("SAMPLES: cannot write {}: {error}", path.display());
    }
}

/// What the driver does to a node at a moment of the timeline.
enum Turn {
    Set(Condition),
    /// The node says it goes in this long, then goes (`refuse`).
    Announce(Duration),
}

/// Drives `timeline` (node, kind, from `begin`, lasts) from `begin`, the start of the measured window.
/// With a `notice`, a node that goes (`refuse`) says so that long before (or from the start, when it
/// goes sooner).
async fn churn(
    fleet: Arc<Fleet>,
    timeline: Vec<(&'static str, InterruptionKind, Duration, Duration)>,
    begin: Instant,
    notice: Option<Duration>,
) {
    let mut events: Vec<(Duration, &str, Turn)> = Vec::new();
    for (node, kind, at, lasts) in timeline {
        let factor = if kind == InterruptionKind::Slow {
            SLOW_FACTOR
        } else {
            1.0
        };
        match notice {
            Some(notice) if kind == InterruptionKind::Refuse => {
                let ahead = notice.min(at);
                events.push((at - ahead, node, Turn::Announce(ahead)));
            }
            _ => events.push((at, node, Turn::Set(Condition::Interrupted { kind, factor }))),
        }
        events.push((at + lasts, node, Turn::Set(Condition::Up)));
    }
    events.sort_by_key(|(at, _, _)| *at);
    for (at, name, turn) in events {
        tokio::time::sleep_until(begin + at).await;
        if let Some(node) = fleet.nodes().iter().find(|node| node.name() == name) {
            match turn {
                Turn::Set(condition) => node.set_condition(condition),
                Turn::Announce(left) => node.announce_end(left),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// One row of the table.

struct Row {
    scenario: Scenario,
    proxy: Option<Proxy>,
    label: String,
    requests: u64,
    succeeded: u64,
    p50: Option<f64>,
    p99: Option<f64>,
    max: Option<f64>,
    first_byte_p50: Option<f64>,
    first_byte_p99: Option<f64>,
    rejected: u64,
    rejected_p50: Option<f64>,
    rejected_p99: Option<f64>,
    failures: BTreeMap<String, u64>,
    /// Broken streams: from their last chunk to their end, ms.
    stall_end_p50: Option<f64>,
    stall_end_max: Option<f64>,
    /// Requests that reached the nodes per request sent (retries and hedges add to it).
    attempts_per_request: f64,
    per_second: f64,
    cpu_per_request: Option<Duration>,
    peak_rss_kib: Option<u64>,
    /// The cuts scenario's own figures.
    cuts: Option<cuts::Figures>,
}

/// Starts a fleet of `config` and `proxy` in front of it, and lets active health checks see every
/// node once before the load.
async fn fleet_and_proxy(
    config: &FleetConfig,
    proxy: Proxy,
    settings: &Settings,
) -> Result<(Fleet, Running)> {
    let fleet = Fleet::start(config, Duration::from_secs(24 * 3600))
        .await
        .context("starting the simulated fleet")?;
    let upstreams: Vec<Upstream> = fleet
        .nodes()
        .iter()
        .map(|node| Upstream {
            addr: node.addr().to_string(),
            capacity: node.spec().capacity,
        })
        .collect();
    let running = start_proxy(proxy, &upstreams, settings).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok((fleet, running))
}

async fn open_loop_row(scenario: Scenario, proxy: Proxy, settings: &Settings) -> Result<Row> {
    let config = fleet_config(scenario, settings.seed);
    let (fleet, running) = fleet_and_proxy(&config, proxy, settings).await?;
    let fleet = Arc::new(fleet);
    let duration = scenario.window(settings);
    let rate = scenario.rate(fleet::capacity(&config));
    eprintln!(
        "compare: {} through {} ({:.0} req/s for {:?})",
        scenario.name(),
        running.label,
        rate,
        duration
    );
    let start = Instant::now();
    let received_before: u64 = fleet.requests_received();
    let timeline = scenario.timeline(duration);
    let notice = (scenario == Scenario::Announced).then_some(announced::NOTICE);
    let schedule = (!timeline.is_empty()).then(|| {
        tokio::spawn(churn(
            Arc::clone(&fleet),
            timeline,
            start + settings.warmup,
            notice,
        ))
    });
    let cpu_before = tokio::spawn({
        let pids = running.pids();
        let at = start + settings.warmup;
        async move {
            tokio::time::sleep_until(at).await;
            support::usage(&pids).cpu
        }
    });
    let tally = offer(
        &running.url,
        rate,
        settings.warmup,
        duration,
        scenario.ask(),
    )
    .await;
    let received: u64 = fleet.requests_received() - received_before;
    write_samples(scenario, &running.label, &tally);
    let usage = running.usage();
    let cpu_before = cpu_before.await.unwrap_or_default();
    if let Some(schedule) = schedule {
        schedule.abort();
    }
    let cuts = if matches!(
        scenario,
        Scenario::Cuts | Scenario::Announced | Scenario::Unannounced
    ) {
        Some(cuts::Figures::measure(&config, &tally.longest_gaps, &running).await)
    } else {
        None
    };
    if matches!(scenario, Scenario::Announced | Scenario::Unannounced) {
        // Where a continued stream's wait for its first token can come from: a node that had more
        // requests than slots queued the rest.
        for node in fleet.nodes() {
            let stats = node.stats();
            eprintln!(
                "compare: {} {}: most in flight {} (serves {} at once), most waiting {}",
                running.label,
                node.name(),
                stats.peak_in_flight,
                node.spec().capacity,
                stats.max_waiting
            );
        }
    }
    let row = Row {
        scenario,
        proxy: Some(proxy),
        label: running.label.clone(),
        requests: tally.sent,
        succeeded: tally.succeeded,
        p50: quantile_ms(&tally.latency, 0.5),
        p99: quantile_ms(&tally.latency, 0.99),
        max: max_ms(&tally.latency),
        first_byte_p50: quantile_ms(&tally.first_byte, 0.5),
        first_byte_p99: quantile_ms(&tally.first_byte, 0.99),
        rejected: tally.rejected.len(),
        rejected_p50: quantile_ms(&tally.rejected, 0.5),
        rejected_p99: quantile_ms(&tally.rejected, 0.99),
        failures: tally.failures.clone(),
        stall_end_p50: quantile_ms(&tally.stall_end, 0.5),
        stall_end_max: max_ms(&tally.stall_end),
        attempts_per_request: received as f64 / tally.offered.max(1) as f64,
        // Successes over the time they took: requests still waiting in a queue when the window ends
        // are served after it, and that time counts.
        per_second: tally.succeeded as f64 / duration.max(tally.last_success).as_secs_f64(),
        cpu_per_request: (tally.sent > 0)
            .then(|| usage.cpu.saturating_sub(cpu_before) / tally.sent as u32),
        peak_rss_kib: Some(usage.peak_rss_kib),
        cuts,
    };
    debug_assert_eq!(
        tally.sent,
        tally.succeeded + tally.rejected.len() + tally.failed()
    );
    drop(running);
    fleet::wait_idle(&fleet, Duration::from_millis(50)).await;
    Ok(row)
}

// ---------------------------------------------------------------------------------------------------
// Throughput: wrk against an origin that answers at once.

async fn throughput_rows(settings: &Settings) -> Result<Vec<Row>> {
    let need = |name: &str| {
        find_program(name).with_context(|| {
            format!("`{name}` is not installed: `bash benches/compare/run` installs it")
        })
    };
    let (nginx, wrk_path) = (need("nginx")?, need("wrk")?);
    let dir = TempDir::new("compare-origin")?;
    std::fs::create_dir_all(dir.path().join("tmp"))?;
    let ports = [support::free_addr()?.port(), support::free_addr()?.port()];
    let config_path = dir.path().join("origin.conf");
    std::fs::write(&config_path, origin_config(dir.path(), &ports))?;
    let command = support::nginx_command(&nginx, &config_path, dir.path());
    let mut origin = Process::spawn("origin nginx", command, dir.path().join("origin.log"))?;
    for port in ports {
        origin.wait_listening(([127, 0, 0, 1], port).into(), Duration::from_secs(10))?;
    }
    let upstreams: Vec<Upstream> = ports
        .iter()
        .map(|port| Upstream {
            addr: format!("127.0.0.1:{port}"),
            capacity: 1000,
        })
        .collect();
    let mut rows = Vec::new();
    let measure = |label: String, proxy: Option<Proxy>, url: String, pids: Vec<u32>| {
        let wrk_path = wrk_path.clone();
        async move {
            eprintln!("compare: throughput through {label}");
            // Warm the proxy's pools and caches, unrecorded.
            wrk(
                &wrk_path,
                &url,
                Duration::from_secs(2),
                settings.connections,
            )
            .await?;
            let before = support::usage(&pids);
            let result = wrk(
                &wrk_path,
                &url,
                settings.throughput_duration,
                settings.connections,
            )
            .await?;
            let after = support::usage(&pids);
            let mut failures = BTreeMap::new();
            if result.errors > 0 {
                failures.insert("non-2xx or socket errors".to_owned(), result.errors);
            }
            anyhow::Ok(Row {
                scenario: Scenario::Throughput,
                proxy,
                label,
                requests: result.requests,
                succeeded: result.requests.saturating_sub(result.errors),
                p50: result.p50,
                p99: result.p99,
                max: result.max,
                first_byte_p50: None,
                first_byte_p99: None,
                rejected: 0,
                rejected_p50: None,
                rejected_p99: None,
                failures,
                stall_end_p50: None,
                stall_end_max: None,
                attempts_per_request: f64::NAN,
                per_second: result.per_second,
                cpu_per_request: proxy
                    .map(|_| after.cpu.saturating_sub(before.cpu) / result.requests.max(1) as u32),
                peak_rss_kib: proxy.map(|_| after.peak_rss_kib),
                cuts: None,
            })
        }
    };
    let direct = format!("http://127.0.0.1:{}", ports[0]);
    rows.push(measure("origin alone (baseline)".into(), None, direct, Vec::new()).await?);
    // The adaptive limit and the nodes' capacities change nothing against an origin that answers at
    // once.
    for &proxy in settings.proxies.iter().filter(|&&proxy| {
        proxy.runs_in(Scenario::Throughput)
            && !matches!(
                proxy,
                Proxy::TongsAdaptive | Proxy::TongsCapacity | Proxy::TongsOwnCounts
            )
    }) {
        let running = start_proxy(proxy, &upstreams, settings).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let row = measure(
            running.label.clone(),
            Some(proxy),
            running.url.clone(),
            running.pids(),
        )
        .await?;
        rows.push(row);
    }
    drop(origin);
    Ok(rows)
}

// ---------------------------------------------------------------------------------------------------
// The run and the report.

async fn run(settings: Settings) -> Result<()> {
    let mut header = String::new();
    writeln!(header, "date: {}", support::now_utc())?;
    writeln!(header, "machine: {}", support::machine())?;
    if let Ok(commit) = std::env::var("COMMIT") {
        writeln!(header, "commit: {commit}")?;
    }
    if let Ok(extra) = std::env::var("TONGS_CONFIG") {
        writeln!(
            header,
            "tongs: NOT its defaults; TONGS_CONFIG adds: {extra}"
        )?;
    }
    let config = fleet_config(Scenario::Steady, settings.seed);
    let capacity = fleet::capacity(&config);
    writeln!(
        header,
        "fleet: {} (name capacity×mean), lognormal spread {SPREAD}, node queue {NODE_QUEUE} \
         ({OVERLOAD_NODE_QUEUE} in overload), seed {}; capacity Σ capacity ÷ mean = {capacity:.1} req/s",
        fleet::describe(&config),
        settings.seed,
    )?;
    if settings.scenarios.contains(&Scenario::Cuts) {
        writeln!(header, "{}", cuts::describe(settings.seed))?;
    }
    if settings.scenarios.contains(&Scenario::Plain) {
        writeln!(
            header,
            "{}",
            plain::describe(settings.seed, settings.duration)
        )?;
    }
    if settings.scenarios.contains(&Scenario::Pauses) {
        writeln!(header, "{}", pauses::describe())?;
    }
    if settings
        .scenarios
        .iter()
        .any(|s| matches!(s, Scenario::Chat | Scenario::Saturate))
    {
        writeln!(header, "{}", chat::describe(settings.seed))?;
    }
    writeln!(
        header,
        "load: open loop, {} s measured after {} s unrecorded (churn, gray, stalls and cuts {} s); steady and \
         streaming at 60 %, churn, gray, stalls and cuts at 50 %, overload at 200 % of capacity, plain at {} streams/s; \
         client timeout {} s; \
         throughput: wrk -t1 -c{} for {} s",
        settings.duration.as_secs_f64(),
        settings.warmup.as_secs_f64(),
        settings.churn_duration.as_secs_f64(),
        plain::RATE,
        CLIENT_TIMEOUT.as_secs(),
        settings.connections,
        settings.throughput_duration.as_secs_f64(),
    )?;
    print!("{header}");

    let mut rows = Vec::new();
    let mut pause_rows = Vec::new();
    let mut engine_rows = Vec::new();
    for &scenario in &settings.scenarios {
        if scenario == Scenario::Throughput {
            rows.extend(throughput_rows(&settings).await?);
            continue;
        }
        if scenario == Scenario::Pauses {
            pause_rows = pauses::rows(&settings).await?;
            continue;
        }
        if matches!(scenario, Scenario::Chat | Scenario::Saturate) {
            engine_rows.extend(chat::rows(scenario, &settings).await?);
            continue;
        }
        for &proxy in settings.proxies.iter().filter(|p| p.runs_in(scenario)) {
            rows.push(open_loop_row(scenario, proxy, &settings).await?);
        }
    }

    let table = table(&rows)
        + &cuts::table(&rows)
        + &announced::table(&rows)
        + &pauses::table(&pause_rows)
        + &chat::table(&engine_rows);
    let verdicts = verdicts(&rows);
    println!();
    print!("{table}");
    println!();
    print!("{verdicts}");

    if settings.smoke {
        return smoke_check(&rows);
    }
    if let Some(path) = &settings.results {
        let header: String = header.lines().map(|line| format!("- {line}\n")).collect();
        let text = format!(
            "# tongs against the peers\n\nWritten by `bash benches/compare/run` (`benches/compare/`); what the \
             figures mean and where tongs loses: `benches/README.md`.\n\n{header}\n{table}\n{verdicts}"
        );
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("\nwritten to {}", path.display());
    }
    Ok(())
}

/// The smoke pass under `cargo test`: every proxy must have started and served nearly every request.
fn smoke_check(rows: &[Row]) -> Result<()> {
    for row in rows {
        if row.requests == 0 || row.succeeded * 10 < row.requests * 9 {
            bail!(
                "smoke: {} served {} of {} requests (failures: {:?})",
                row.label,
                row.succeeded,
                row.requests,
                row.failures
            );
        }
    }
    println!("smoke: every proxy started and served at least 90 % of its requests");
    Ok(())
}

fn cell(value: Option<f64>) -> String {
    value.map_or("–".into(), |v| {
        if v >= 100.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    })
}

fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "| scenario | proxy | requests | success % | p50 ms | p99 ms | max ms | first byte p50 / p99 ms \
         | rejected | rejection p50 / p99 ms | other failures | broken stream: last chunk to end p50 / max ms \
         | attempts / req | req/s | CPU µs / req | peak RSS MiB |"
    );
    let _ = writeln!(
        out,
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    );
    for row in rows {
        let success = if row.requests > 0 {
            100.0 * row.succeeded as f64 / row.requests as f64
        } else {
            0.0
        };
        let failures = if row.failures.is_empty() {
            "0".to_owned()
        } else {
            stats::by_kind(&row.failures)
        };
        let first_byte = match (row.first_byte_p50, row.first_byte_p99) {
            (None, None) => "–".to_owned(),
            (p50, p99) => format!("{} / {}", cell(p50), cell(p99)),
        };
        let stall_end = match (row.stall_end_p50, row.stall_end_max) {
            (None, None) => "–".to_owned(),
            (p50, max) => format!("{} / {}", cell(p50), cell(max)),
        };
        let attempts = if row.attempts_per_request.is_finite() {
            format!("{:.3}", row.attempts_per_request)
        } else {
            "–".to_owned()
        };
        let rejection = if row.rejected > 0 {
            format!("{} / {}", cell(row.rejected_p50), cell(row.rejected_p99))
        } else {
            "–".to_owned()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {success:.2} | {} | {} | {} | {first_byte} | {} | {rejection} | {failures} | {stall_end} | {attempts} | {:.1} | {} | {} |",
            row.scenario.name(),
            row.label,
            row.requests,
            cell(row.p50),
            cell(row.p99),
            cell(row.max),
            row.rejected,
            row.per_second,
            row.cpu_per_request.map_or("–".into(), |cpu| format!(
                "{:.0}",
                cpu.as_secs_f64() * 1e6
            )),
            row.peak_rss_kib
                .map_or("–".into(), |kib| format!("{:.1}", kib as f64 / 1024.0)),
        );
    }
    out
}

/// The targets, judged from the rows for each tongs variant: in every open-loop scenario tongs has the
/// highest success rate and the lowest p99 of all, and a max below the peers' per-try timeout;
/// throughput ≥ 1.05× nginx's with CPU per request ≤ nginx's.
fn verdicts(rows: &[Row]) -> String {
    let mut out = String::from("Targets (tongs against the best peer):\n");
    let success = |row: &Row| row.succeeded as f64 / row.requests.max(1) as f64;
    let yes = |ok: bool| if ok { "yes" } else { "NO" };
    for scenario in [
        Scenario::Steady,
        Scenario::Churn,
        Scenario::Overload,
        Scenario::Streaming,
        Scenario::Gray,
        Scenario::Stalls,
        Scenario::Cuts,
        Scenario::Plain,
    ] {
        let of: Vec<&Row> = rows.iter().filter(|r| r.scenario == scenario).collect();
        let peers: Vec<&&Row> = of
            .iter()
            .filter(|r| r.proxy.is_some_and(|p| !p.is_tongs()))
            .collect();
        let best_success = peers.iter().map(|r| success(r)).fold(0.0, f64::max);
        let best_p99 = peers
            .iter()
            .filter_map(|r| r.p99)
            .fold(f64::INFINITY, f64::min);
        for tongs in of.iter().filter(|r| r.proxy.is_some_and(Proxy::is_tongs)) {
            let success_ok = success(tongs) >= best_success;
            let p99_ok = tongs.p99.is_some_and(|p99| p99 <= best_p99);
            let max_ok = tongs
                .max
                .is_some_and(|max| max < PER_TRY_TIMEOUT.as_secs_f64() * 1000.0);
            let _ = writeln!(
                out,
                "- {}, {}: highest success {} ({:.2} % vs {:.2} %); lowest p99 {} ({} vs {} ms); \
                 max below {} s {} ({} ms)",
                scenario.name(),
                tongs.label,
                yes(success_ok),
                100.0 * success(tongs),
                100.0 * best_success,
                yes(p99_ok),
                cell(tongs.p99),
                if best_p99.is_finite() {
                    cell(Some(best_p99))
                } else {
                    "–".into()
                },
                PER_TRY_TIMEOUT.as_secs(),
                yes(max_ok),
                cell(tongs.max),
            );
        }
    }
    // The gray-failure targets: every request served where a node survives, the slowest unstreamed
    // answer under 4 s, p99 at most 0.8 x the best peer's, at most 10 % more attempts than requests
    // (hedges and retries together); a stalled stream ended within 3 s of its last chunk.
    for tongs in rows
        .iter()
        .filter(|r| matches!(r.scenario, Scenario::Gray | Scenario::Stalls))
        .filter(|r| r.proxy.is_some_and(Proxy::is_tongs))
    {
        let best_p99 = rows
            .iter()
            .filter(|r| r.scenario == tongs.scenario && r.proxy.is_some_and(|p| !p.is_tongs()))
            .filter_map(|r| r.p99)
            .fold(f64::INFINITY, f64::min);
        let p99_ok = tongs.p99.is_some_and(|p99| p99 <= 0.8 * best_p99);
        let attempts_ok = tongs.attempts_per_request <= 1.10;
        let timing = if tongs.scenario == Scenario::Gray {
            format!(
                "max under 4 s {} ({} ms)",
                yes(tongs.max.is_some_and(|max| max < 4000.0)),
                cell(tongs.max)
            )
        } else {
            format!(
                "stalled streams ended within 3 s {} (max {} ms)",
                yes(tongs.stall_end_max.is_none_or(|max| max <= 3000.0)),
                cell(tongs.stall_end_max)
            )
        };
        let _ = writeln!(
            out,
            "- {}, {}: 100 % success {} ({:.2} %); {timing}; p99 ≤ 0.8 × best peer {} ({} vs {} ms); \
             attempts per request ≤ 1.10 {} ({:.3})",
            tongs.scenario.name(),
            tongs.label,
            yes(tongs.succeeded == tongs.requests),
            100.0 * success(tongs),
            yes(p99_ok),
            cell(tongs.p99),
            cell(best_p99.is_finite().then_some(best_p99)),
            yes(attempts_ok),
            tongs.attempts_per_request,
        );
    }
    cuts::verdicts(rows, &mut out);
    announced::verdicts(rows, &mut out);
    let throughput: Vec<&Row> = rows
        .iter()
        .filter(|r| r.scenario == Scenario::Throughput)
        .collect();
    let find = |proxy| throughput.iter().find(|r| r.proxy == Some(proxy));
    if let (Some(tongs), Some(nginx)) = (find(Proxy::Tongs), find(Proxy::Nginx)) {
        let ratio = tongs.per_second / nginx.per_second.max(f64::MIN_POSITIVE);
        let cpu = match (tongs.cpu_per_request, nginx.cpu_per_request) {
            (Some(t), Some(n)) if !n.is_zero() => t.as_secs_f64() / n.as_secs_f64(),
            _ => f64::NAN,
        };
        let _ = writeln!(
            out,
            "- throughput: tongs/nginx req/s {ratio:.2}× (target ≥ 1.05×: {}); CPU per request {cpu:.2}× nginx's (target ≤ 1: {})",
            yes(ratio >= 1.05),
            yes(cpu <= 1.0),
        );
    }
    out
}

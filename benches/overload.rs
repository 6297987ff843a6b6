//! The overload scenario of the back-pressure work: open-loop load at twice the capacity of a
//! heterogeneous simulated fleet, through tongs (adaptive limit; static limit; adaptive with a queue
//! bounded below what `queue.max_wait` drains) and through HAProxy (`balance leastconn`, `maxconn` per
//! server set to the node's capacity, `timeout queue`), each in front of a fresh fleet. Prints the
//! machine, the scenario and a markdown table of what the clients saw, then how tongs' limits moved.
//!
//!     cargo bench --bench overload                              # 60 s per contender
//!     DURATION=10s CONTENDERS="adaptive haproxy" SEED=2 cargo bench --bench overload
//!
//! `bash benches/overload.sh` installs HAProxy when it is missing; without it the HAProxy row is
//! skipped with a note. Under `cargo test --all-targets` (no `--bench` argument) nothing runs.

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tongs::demo::{COMPLETION_TOKENS, build_request};
use tongs::registry::Registry;
use tongs::sim::{Fleet, FleetConfig, NodeStats, ResponseKind};

use support::in_process::InProcessTongs;
use support::stats::{self, latency_histogram, micros, quantile_ms};
use support::{Process, TempDir, env_duration, env_list, env_number, fleet, lock};

/// The fleet: name, capacity (requests served at once), mean service time in milliseconds.
const NODES: [fleet::Node; 4] = [
    ("a100", 8, 120),
    ("l40s", 4, 250),
    ("rtx4090", 4, 350),
    ("rtx3060", 2, 600),
];
/// Lognormal spread of every node's service time.
const SPREAD: f64 = 0.3;
/// Requests a node lets wait inside it; beyond that it answers 503 + Retry-After.
const NODE_QUEUE: usize = 2;
/// Offered load as a multiple of the fleet's capacity.
const LOAD_FACTOR: f64 = 2.0;
/// `queue.max_wait` for tongs, `timeout queue` for HAProxy.
const MAX_WAIT: Duration = Duration::from_secs(5);
/// The one static limit every endpoint gets (a static limit cannot differ per endpoint).
const STATIC_LIMIT: u32 = 4;
/// The bounded queue holds this share of what the fleet drains in `MAX_WAIT`.
const BOUNDED_QUEUE_SHARE: f64 = 0.8;
/// A client gives up on a request after this long.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
/// The scenario's goals.
const GOODPUT_GOAL: f64 = 0.9;
const REFUSAL_P99_GOAL_MS: f64 = 20.0;
/// Goodput over time and tongs' limits are reported in steps of this.
const TREND_STEP: Duration = Duration::from_secs(5);
const DEFAULT_CONTENDERS: &str = "adaptive static bounded haproxy";

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it.
    if !support::benchmarking() {
        println!("overload: a load benchmark; run it with `cargo bench --bench overload`");
        return Ok(());
    }
    let duration = env_duration("DURATION", Duration::from_secs(60))?;
    if duration < Duration::from_secs(1) {
        bail!("DURATION={duration:?} is too short: at least 1s");
    }
    let contenders = env_list("CONTENDERS", DEFAULT_CONTENDERS, Contender::parse)?;
    let seed = env_number("SEED", 1)?;
    support::block_on(run(duration, contenders, seed))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contender {
    Adaptive,
    Static,
    Bounded,
    Haproxy,
}

impl Contender {
    fn parse(name: &str) -> Result<Contender> {
        Ok(match name {
            "adaptive" => Contender::Adaptive,
            "static" => Contender::Static,
            "bounded" => Contender::Bounded,
            "haproxy" => Contender::Haproxy,
            other => bail!("CONTENDERS: unknown contender {other:?} (known: {DEFAULT_CONTENDERS})"),
        })
    }

    fn label(self, bounded_length: usize) -> String {
        match self {
            Contender::Adaptive => "tongs, adaptive limit".to_owned(),
            Contender::Static => format!("tongs, static limit {STATIC_LIMIT}"),
            Contender::Bounded => {
                format!("tongs, adaptive limit, queue.max_length {bounded_length}")
            }
            Contender::Haproxy => "HAProxy, leastconn, maxconn = capacity".to_owned(),
        }
    }
}

/// What the static limit lets the fleet serve: a node above the limit is used only up to it.
fn static_capacity() -> f64 {
    NODES
        .iter()
        .map(|&(_, capacity, mean_ms)| {
            capacity.min(STATIC_LIMIT as usize) as f64 * 1000.0 / mean_ms as f64
        })
        .sum()
}

/// Slowest node's mean service time.
fn slowest_service() -> Duration {
    Duration::from_millis(NODES.iter().map(|n| n.2).max().unwrap_or(0))
}

fn fleet_config(seed: u64) -> FleetConfig {
    fleet::config(seed, &NODES, SPREAD, NODE_QUEUE, ResponseKind::Json)
}

/// One contender's run.
struct Run {
    label: String,
    tally: Tally,
    nodes: Vec<NodeStats>,
    /// tongs only: its limits and queue, sampled through the run.
    samples: Option<Samples>,
}

async fn run(duration: Duration, contenders: Vec<Contender>, seed: u64) -> Result<()> {
    let capacity = fleet::capacity(&fleet_config(seed));
    let rate = capacity * LOAD_FACTOR;
    let bounded_length = (capacity * MAX_WAIT.as_secs_f64() * BOUNDED_QUEUE_SHARE).round() as usize;
    let p99_bound = MAX_WAIT + slowest_service();

    println!("date: {}", support::now_utc());
    println!("machine: {}", support::machine());
    println!(
        "scenario: {} s open loop at {rate:.1} req/s ({LOAD_FACTOR}× the fleet's capacity of {capacity:.1} req/s); \
         fleet {} (capacity × mean service, spread {SPREAD}, node queue {NODE_QUEUE}, then 503 + Retry-After), \
         seed {seed}, no interruptions; JSON answers; queue.max_wait = timeout queue = {} s",
        duration.as_secs_f64(),
        fleet::describe(&fleet_config(seed)),
        MAX_WAIT.as_secs(),
    );
    println!(
        "goals: goodput ≥ {:.0} % of capacity ({:.1} req/s); success p99 ≤ max_wait + slowest node's mean service time = {} ms; refusal p99 < {REFUSAL_P99_GOAL_MS} ms",
        GOODPUT_GOAL * 100.0,
        GOODPUT_GOAL * capacity,
        p99_bound.as_millis(),
    );
    println!(
        "notes: goodput counts successes completed within the {} s window; a static limit of {STATIC_LIMIT} caps the fleet at {:.1} req/s ({:.0} % of capacity); \
         the bounded queue holds {:.0} % of what the fleet drains in max_wait",
        duration.as_secs_f64(),
        static_capacity(),
        100.0 * static_capacity() / capacity,
        BOUNDED_QUEUE_SHARE * 100.0,
    );
    println!();

    let mut runs = Vec::new();
    for contender in contenders {
        let label = contender.label(bounded_length);
        eprintln!("overload: running {label} for {duration:?}");
        let fleet = Fleet::start(&fleet_config(seed), duration + Duration::from_secs(120))
            .await
            .context("starting the simulated fleet")?;
        let result = match contender {
            Contender::Haproxy => match support::find_program("haproxy") {
                Some(haproxy) => run_haproxy(&haproxy, &fleet, rate, duration)
                    .await
                    .map(|tally| (tally, None))
                    .with_context(|| {
                        format!("HAProxy {}", support::program_version(&haproxy, "-v"))
                    }),
                None => {
                    println!(
                        "note: HAProxy skipped: no `haproxy` on PATH or in /usr/sbin (bash benches/overload.sh installs it)"
                    );
                    continue;
                }
            },
            _ => {
                let extra = match contender {
                    Contender::Static => format!(
                        "concurrency: {{ limit: static, max_outstanding_per_endpoint: {STATIC_LIMIT} }}\n\
                         queue: {{ max_wait: {}s }}\n",
                        MAX_WAIT.as_secs()
                    ),
                    Contender::Bounded => format!(
                        "concurrency: {{ limit: adaptive }}\nqueue: {{ max_wait: {}s, max_length: {bounded_length} }}\n",
                        MAX_WAIT.as_secs()
                    ),
                    _ => format!(
                        "concurrency: {{ limit: adaptive }}\nqueue: {{ max_wait: {}s }}\n",
                        MAX_WAIT.as_secs()
                    ),
                };
                run_tongs(&extra, &fleet, rate, duration)
                    .await
                    .map(|(tally, samples)| (tally, Some(samples)))
                    .with_context(|| label.clone())
            }
        };
        let (tally, samples) = result?;
        let nodes = fleet.nodes().iter().map(|node| node.stats()).collect();
        runs.push(Run {
            label,
            tally,
            nodes,
            samples,
        });
        drop(fleet);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    print_table(&runs, capacity, duration, p99_bound);
    print_trends(&runs);
    print_limits(&runs, duration);
    Ok(())
}

// ---------------------------------------------------------------------------------------------------
// The open-loop load generator.

/// How one request ended, from the client's side.
enum Outcome {
    Success,
    /// The proxy itself refused it (tongs: the `x-tongs-reject-reason`; HAProxy: its own 503 page).
    Refused(String),
    /// Anything else: a node's 503 passed through, another status, a broken connection, a timeout.
    Error(String),
}

/// Everything the generator saw.
struct Tally {
    sent: u64,
    /// Latency of successes, microseconds.
    success: Histogram<u64>,
    /// Latency of the proxy's refusals, microseconds.
    refusal: Histogram<u64>,
    refusals: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
    /// Successes completed within the load window.
    done_in_window: u64,
    /// Successes by the five seconds of the run they completed in.
    done_per_5s: Vec<u64>,
    window: Duration,
}

impl Tally {
    fn new(window: Duration) -> Tally {
        Tally {
            sent: 0,
            success: latency_histogram(),
            refusal: latency_histogram(),
            refusals: BTreeMap::new(),
            errors: BTreeMap::new(),
            done_in_window: 0,
            done_per_5s: Vec::new(),
            window,
        }
    }

    fn record(&mut self, outcome: Outcome, latency: Duration, done_at: Duration) {
        let micros = micros(latency);
        match outcome {
            Outcome::Success => {
                self.success.saturating_record(micros);
                if done_at < self.window {
                    self.done_in_window += 1;
                    let bucket = (done_at.as_secs() / TREND_STEP.as_secs()) as usize;
                    if self.done_per_5s.len() <= bucket {
                        self.done_per_5s.resize(bucket + 1, 0);
                    }
                    self.done_per_5s[bucket] += 1;
                }
            }
            Outcome::Refused(reason) => {
                self.refusal.saturating_record(micros);
                *self.refusals.entry(reason).or_default() += 1;
            }
            Outcome::Error(kind) => *self.errors.entry(kind).or_default() += 1,
        }
    }

    fn recorded(&self) -> u64 {
        self.success.len() + self.refusal.len() + self.errors.values().sum::<u64>()
    }

    fn goodput(&self) -> f64 {
        self.done_in_window as f64 / self.window.as_secs_f64()
    }
}

/// Sends POSTs to `target` at `rate` for `duration`, each leaving at its fixed time whatever the
/// earlier ones are doing, then waits for the last answers (each bounded by the client timeout).
async fn offer(target: &str, rate: f64, duration: Duration) -> Result<Tally> {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(usize::MAX)
        .build_http();
    let tally = Arc::new(Mutex::new(Tally::new(duration)));
    let tasks = TaskTracker::new();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let mut index: u64 = 0;
    loop {
        let due = start + interval.mul_f64(index as f64);
        if due.duration_since(start) >= duration {
            break;
        }
        tokio::time::sleep_until(due).await;
        let request = build_request(target, index, false, COMPLETION_TOKENS);
        let (client, tally_for_task) = (client.clone(), Arc::clone(&tally));
        tasks.spawn(async move {
            let began = Instant::now();
            let outcome = tokio::time::timeout(CLIENT_TIMEOUT, exchange(&client, request))
                .await
                .unwrap_or_else(|_| Outcome::Error("client timeout".to_owned()));
            let now = Instant::now();
            lock(&tally_for_task).record(
                outcome,
                now.duration_since(began),
                now.duration_since(start),
            );
        });
        index += 1;
    }
    lock(&tally).sent = index;
    tasks.close();
    // Every task ends within the client timeout; the margin covers a loaded machine.
    let _ = tokio::time::timeout(CLIENT_TIMEOUT + Duration::from_secs(10), tasks.wait()).await;
    let mut tally = lock(&tally);
    let unfinished = tally.sent.saturating_sub(tally.recorded());
    if unfinished > 0 {
        *tally.errors.entry("unfinished".to_owned()).or_default() += unfinished;
    }
    let done = std::mem::replace(&mut *tally, Tally::new(duration));
    Ok(done)
}

async fn exchange(
    client: &Client<HttpConnector, Full<Bytes>>,
    request: Request<Full<Bytes>>,
) -> Outcome {
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(_) => return Outcome::Error("connection error".to_owned()),
    };
    let status = response.status();
    let reason = response
        .headers()
        .get("x-tongs-reject-reason")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let body = match response.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return Outcome::Error("body cut".to_owned()),
    };
    if status.is_success() {
        return Outcome::Success;
    }
    if status == StatusCode::SERVICE_UNAVAILABLE {
        if let Some(reason) = reason {
            return Outcome::Refused(reason);
        }
        // A node's own 503 (it sheds beyond its capacity and waiting line), as the node sent it or
        // as tongs reports an endpoint's status it could not retry away.
        if contains(&body, b"node at capacity") || contains(&body, b"answered 503") {
            return Outcome::Error("503 from a node".to_owned());
        }
        // HAProxy's own page: no server took the request within `timeout queue`.
        if contains(&body, b"No server is available") {
            return Outcome::Refused("haproxy-503".to_owned());
        }
    }
    Outcome::Error(status.as_u16().to_string())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

// ---------------------------------------------------------------------------------------------------
// tongs in this process.

/// One endpoint as tongs saw it at one moment.
#[derive(Clone, Copy, Debug, Default)]
struct EndpointPoint {
    /// Its concurrency limit (`None`: unlimited).
    limit: Option<u64>,
    /// Whether it was cooling down after a 503 + Retry-After (taking no new requests).
    cooling: bool,
    outstanding: u64,
}

/// One sample: time since the run started, each endpoint (in fleet order), requests in the queue.
type Point = (Duration, Vec<EndpointPoint>, usize);

/// tongs' endpoints and queue over a run.
struct Samples {
    points: Vec<Point>,
    /// Each endpoint's learnt unloaded latency at the end, microseconds.
    unloaded_us: Vec<Option<u64>>,
    /// Each endpoint's back-off requests (429, 503 + Retry-After) over the run.
    cooldowns: Vec<Option<u64>>,
}

async fn run_tongs(
    extra_yaml: &str,
    fleet: &Fleet,
    rate: f64,
    duration: Duration,
) -> Result<(Tally, Samples)> {
    let tongs = InProcessTongs::start(extra_yaml, fleet.urls()).await?;
    let registry = Arc::clone(&tongs.registry);
    let queue = Arc::clone(&tongs.queue);

    let authorities: Vec<String> = fleet
        .nodes()
        .iter()
        .map(|node| node.addr().to_string())
        .collect();
    let sampling = CancellationToken::new();
    let sampler = tokio::spawn(sample(
        Arc::clone(&registry),
        queue,
        authorities.clone(),
        sampling.clone(),
    ));
    let tally = offer(&tongs.url, rate, duration).await;
    sampling.cancel();
    let points = sampler.await.context("the limit sampler")?;
    let unloaded_us = by_node(&registry, &authorities, |endpoint| {
        endpoint.limits().unloaded_latency_us()
    });
    let cooldowns = by_node(&registry, &authorities, |endpoint| {
        Some(endpoint.tally().cooldowns())
    });
    tongs.stop("overload").await;
    Ok((
        tally?,
        Samples {
            points,
            unloaded_us,
            cooldowns,
        },
    ))
}

/// `read` of each node's endpoint, in fleet order.
fn by_node<T>(
    registry: &Registry,
    authorities: &[String],
    read: impl Fn(&tongs::endpoint::Endpoint) -> Option<T>,
) -> Vec<Option<T>> {
    let snapshot = registry.snapshot();
    authorities
        .iter()
        .map(|authority| {
            snapshot
                .iter()
                .find(|endpoint| endpoint.address().authority().as_str() == authority)
                .and_then(|endpoint| read(endpoint))
        })
        .collect()
}

async fn sample(
    registry: Arc<Registry>,
    queue: Arc<tongs::admission::Queue>,
    authorities: Vec<String>,
    stop: CancellationToken,
) -> Vec<Point> {
    let start = Instant::now();
    let mut points = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            () = stop.cancelled() => return points,
            _ = tick.tick() => {}
        }
        let endpoints = by_node(&registry, &authorities, |endpoint| {
            let now = tongs::endpoint::millis(Instant::now());
            Some(EndpointPoint {
                limit: endpoint.load().limit(),
                cooling: endpoint.load().cooling_down(now),
                outstanding: endpoint.outstanding(),
            })
        })
        .into_iter()
        .map(Option::unwrap_or_default)
        .collect();
        points.push((start.elapsed(), endpoints, queue.len()));
    }
}

// ---------------------------------------------------------------------------------------------------
// HAProxy as a real process.

fn haproxy_config(port: u16, fleet: &Fleet) -> String {
    let mut text = format!(
        "global\n    maxconn 4000\n\n\
         defaults\n    mode http\n    timeout connect 2s\n    timeout client 100s\n    timeout server 100s\n    timeout queue {}s\n\n\
         frontend overload\n    bind 127.0.0.1:{port}\n    default_backend fleet\n\n\
         backend fleet\n    balance leastconn\n",
        MAX_WAIT.as_secs()
    );
    for node in fleet.nodes() {
        text.push_str(&format!(
            "    server {} {} maxconn {}\n",
            node.name(),
            node.addr(),
            node.spec().capacity
        ));
    }
    text
}

/// HAProxy in front of `fleet` as a process of its own, under the load; stopped once the load is over.
async fn run_haproxy(
    haproxy: &Path,
    fleet: &Fleet,
    rate: f64,
    duration: Duration,
) -> Result<Tally> {
    let dir = TempDir::new("overload")?;
    let addr = support::free_addr()?;
    let config_path = dir.path().join("haproxy.cfg");
    std::fs::write(&config_path, haproxy_config(addr.port(), fleet))
        .with_context(|| format!("writing {}", config_path.display()))?;
    let command = support::haproxy_command(haproxy, &config_path);
    let mut process = Process::spawn("haproxy", command, dir.path().join("haproxy.log"))?;
    process.wait_listening(addr, Duration::from_secs(10))?;
    let tally = offer(&format!("http://{addr}"), rate, duration).await;
    drop(process);
    tally
}

// ---------------------------------------------------------------------------------------------------
// Reports.

fn print_table(runs: &[Run], capacity: f64, duration: Duration, p99_bound: Duration) {
    println!(
        "| contender | offered req/s | capacity req/s | goodput req/s | goodput % of capacity | success p50 / p99 ms \
         | refusals | refusal p50 / p99 ms | other errors | peak sent to a node / its capacity | goals: goodput · p99 · refusals |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- | --- |");
    for run in runs {
        let tally = &run.tally;
        let offered = tally.sent as f64 / duration.as_secs_f64();
        let goodput = tally.goodput();
        let p50 = quantile_ms(&tally.success, 0.5);
        let p99 = quantile_ms(&tally.success, 0.99);
        let refusal_p50 = quantile_ms(&tally.refusal, 0.5);
        let refusal_p99 = quantile_ms(&tally.refusal, 0.99);
        let refusals = if tally.refusals.is_empty() {
            "0".to_owned()
        } else {
            format!(
                "{} ({})",
                tally.refusal.len(),
                stats::by_kind(&tally.refusals)
            )
        };
        let errors = if tally.errors.is_empty() {
            "0".to_owned()
        } else {
            stats::by_kind(&tally.errors)
        };
        let peaks = run
            .nodes
            .iter()
            .zip(NODES)
            .map(|(stats, (name, capacity, _))| {
                format!("{name} {}/{capacity}", stats.peak_in_flight)
            })
            .collect::<Vec<_>>()
            .join(", ");
        let yes = |ok: bool| if ok { "yes" } else { "no" };
        let goals = format!(
            "{} · {} · {}",
            yes(goodput >= GOODPUT_GOAL * capacity),
            yes(p99.is_some_and(|ms| ms <= p99_bound.as_secs_f64() * 1000.0)),
            yes(refusal_p99.is_none_or(|ms| ms < REFUSAL_P99_GOAL_MS)),
        );
        let ms = |value: Option<f64>| value.map_or("–".to_owned(), |v| format!("{v:.0}"));
        println!(
            "| {} | {offered:.1} | {capacity:.1} | {goodput:.1} | {:.1} % | {} / {} | {refusals} | {} / {} | {errors} | {peaks} | {goals} |",
            run.label,
            100.0 * goodput / capacity,
            ms(p50),
            ms(p99),
            ms(refusal_p50),
            ms(refusal_p99),
        );
    }
    println!();
}

fn print_trends(runs: &[Run]) {
    println!("goodput per {} s of the run (req/s):", TREND_STEP.as_secs());
    println!();
    for run in runs {
        let trend = run
            .tally
            .done_per_5s
            .iter()
            .map(|n| format!("{:.1}", *n as f64 / TREND_STEP.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(" ");
        println!("- {}: {trend}", run.label);
    }
    println!();
}

fn print_limits(runs: &[Run], duration: Duration) {
    let with_samples: Vec<_> = runs
        .iter()
        .filter_map(|run| run.samples.as_ref().map(|samples| (run, samples)))
        .collect();
    if with_samples.is_empty() {
        return;
    }
    println!(
        "tongs' endpoints during the load window (sampled every 100 ms; the node's own counters beside):"
    );
    println!();
    println!(
        "| contender | node | capacity | limit mean | limit min..max | limit every {} s | learnt unloaded latency ms \
         | mean outstanding | back-offs asked | time cooling down | node 503s | node served | peak served / peak sent |",
        TREND_STEP.as_secs()
    );
    println!(
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (run, samples) in &with_samples {
        let window: Vec<&Point> = samples
            .points
            .iter()
            .filter(|(at, _, _)| *at < duration)
            .collect();
        let count = window.len().max(1) as f64;
        for (i, (name, capacity, _)) in NODES.iter().enumerate() {
            let at = |point: &Point| point.1.get(i).copied().unwrap_or_default();
            let limits: Vec<u64> = window.iter().filter_map(|p| at(p).limit).collect();
            let (mean, range, steps) = if limits.is_empty() {
                ("none".to_owned(), "–".to_owned(), "–".to_owned())
            } else {
                let mean = limits.iter().sum::<u64>() as f64 / limits.len() as f64;
                let min = limits.iter().min().copied().unwrap_or(0);
                let max = limits.iter().max().copied().unwrap_or(0);
                let steps = window
                    .iter()
                    .filter(|p| p.0.as_millis() % TREND_STEP.as_millis() < 100)
                    .filter_map(|p| at(p).limit)
                    .map(|limit| limit.to_string())
                    .collect::<Vec<_>>()
                    .join(" ");
                (format!("{mean:.1}"), format!("{min}..{max}"), steps)
            };
            let outstanding = window.iter().map(|p| at(p).outstanding).sum::<u64>() as f64 / count;
            let cooling = window.iter().filter(|p| at(p).cooling).count() as f64 / count;
            let unloaded = samples
                .unloaded_us
                .get(i)
                .copied()
                .flatten()
                .map_or("–".to_owned(), |us| format!("{:.0}", us as f64 / 1000.0));
            let cooldowns = samples.cooldowns.get(i).copied().flatten().unwrap_or(0);
            let stats = run.nodes.get(i).copied().unwrap_or_default();
            println!(
                "| {} | {name} | {capacity} | {mean} | {range} | {steps} | {unloaded} | {outstanding:.1} | {cooldowns} | {:.0} % | {} | {} | {} / {} |",
                run.label,
                100.0 * cooling,
                stats.shed,
                stats.served,
                stats.peak_concurrency,
                stats.peak_in_flight
            );
        }
    }
    println!();
    for (run, samples) in &with_samples {
        let queue: Vec<usize> = samples
            .points
            .iter()
            .filter(|(at, _, _)| *at < duration)
            .map(|(_, _, queued)| *queued)
            .collect();
        let max = queue.iter().max().copied().unwrap_or(0);
        let mean = if queue.is_empty() {
            0.0
        } else {
            queue.iter().sum::<usize>() as f64 / queue.len() as f64
        };
        println!(
            "- {}: requests waiting in tongs' queue: mean {mean:.0}, max {max}",
            run.label
        );
    }
    println!();
}

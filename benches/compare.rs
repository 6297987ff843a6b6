//! tongs against nginx, HAProxy and Caddy, each in front of the same seeded simulated fleet of
//! interruptible GPU nodes, one after another in one run; prints one table and writes it to
//! `benches/RESULTS.md` (or `RESULTS`).
//!
//!     bash benches/compare                       # installs the peers, then runs this
//!     SCENARIOS="steady churn" PROXIES="tongs nginx" DURATION=20s cargo bench --bench compare
//!
//! Scenarios (each proxy gets a fresh fleet with the same seed, and the same load):
//! - `steady`: six nodes whose mean service times differ 5× (120 to 600 ms), no failures, open-loop
//!   load at 60 % of the fleet's capacity;
//! - `churn`: the same fleet at 50 % with every interruption kind — `refuse`, `blackhole`,
//!   `gateway-503`, `slow` — on a different node, spread over the run at the same offsets for every proxy;
//! - `overload`: the same fleet at 2× its capacity; nodes answer 503 + Retry-After beyond a small line;
//! - `streaming`: every request an SSE token stream, 60 % load; time to first byte and to the end;
//! - `throughput`: an nginx origin that answers at once, wrk at a fixed number of connections (closed
//!   loop), as many requests per second as each proxy takes; the origin alone is the baseline.
//!
//! tongs runs its release binary with its defaults (only the endpoints configured). The peers are
//! configured as well as each allows for the job: least connections; active health checks where the
//! open-source build has them; retries on connect errors, timeouts and 502/503/504, POST included, on
//! another server; 1 s connect timeout; 10 s per-try timeout; a queue where there is one. Their
//! configuration files are printed with `SHOW_CONFIGS=1`.
//!
//! Environment: SCENARIOS, PROXIES (default all), DURATION (measured time of the open-loop scenarios,
//! default 30s), CHURN_DURATION (default 60s), WARMUP (unrecorded load first, default 3s), SEED (1),
//! THROUGHPUT_DURATION (10s), CONNECTIONS (wrk's, 64), RESULTS (file to write; empty: none),
//! TONGS_CONFIG (YAML added to tongs' configuration, to try a setting; the results file says so).
//! Under `cargo test --all-targets` (no `--bench` argument) it runs a smoke pass instead: every
//! proxy, two seconds of steady load, checking that each configuration starts and serves.
#![forbid(unsafe_code)]

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tongs::sim::{Condition, Fleet, FleetConfig, InterruptionKind, NodeSpec, ResponseKind};

use support::{Process, TempDir, TongsProcess, Usage, env_duration, env_number, find_program};

/// The fleet: name, requests served at once, mean service time in ms. Slowest / fastest = 5.
const NODES: [(&str, usize, u64); 6] = [
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
/// A client gives up after this long.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
const ALL_SCENARIOS: &str = "steady churn overload streaming throughput";
const ALL_PROXIES: &str = "tongs tongs-adaptive nginx haproxy caddy";

fn main() -> Result<()> {
    let smoke = !std::env::args().any(|arg| arg == "--bench");
    let settings = Settings::from_env(smoke)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(run(settings))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Steady,
    Churn,
    Overload,
    Streaming,
    Throughput,
}

impl Scenario {
    fn parse(name: &str) -> Result<Scenario> {
        Ok(match name {
            "steady" => Scenario::Steady,
            "churn" => Scenario::Churn,
            "overload" => Scenario::Overload,
            "streaming" => Scenario::Streaming,
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
            Scenario::Throughput => "throughput",
        }
    }

    /// Offered load as a share of the fleet's capacity.
    fn load(self) -> f64 {
        match self {
            Scenario::Churn => 0.5,
            Scenario::Overload => 2.0,
            _ => 0.6,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proxy {
    /// tongs with its defaults.
    Tongs,
    /// tongs with one setting changed: `concurrency.limit: adaptive`.
    TongsAdaptive,
    Nginx,
    Haproxy,
    Caddy,
}

impl Proxy {
    fn parse(name: &str) -> Result<Proxy> {
        Ok(match name {
            "tongs" => Proxy::Tongs,
            "tongs-adaptive" => Proxy::TongsAdaptive,
            "nginx" => Proxy::Nginx,
            "haproxy" => Proxy::Haproxy,
            "caddy" => Proxy::Caddy,
            other => bail!("PROXIES: unknown proxy {other:?} (known: {ALL_PROXIES})"),
        })
    }

    fn is_tongs(self) -> bool {
        matches!(self, Proxy::Tongs | Proxy::TongsAdaptive)
    }

    fn program(self) -> &'static str {
        match self {
            Proxy::Tongs | Proxy::TongsAdaptive => "tongs",
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
    warmup: Duration,
    seed: u64,
    throughput_duration: Duration,
    connections: u32,
    results: Option<PathBuf>,
    show_configs: bool,
}

impl Settings {
    fn from_env(smoke: bool) -> Result<Settings> {
        let list =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        let scenarios = if smoke {
            vec![Scenario::Steady]
        } else {
            list("SCENARIOS", ALL_SCENARIOS)
                .split_whitespace()
                .map(Scenario::parse)
                .collect::<Result<Vec<_>>>()?
        };
        let proxies = list("PROXIES", ALL_PROXIES)
            .split_whitespace()
            .map(Proxy::parse)
            .collect::<Result<Vec<_>>>()?;
        if scenarios.is_empty() || proxies.is_empty() {
            bail!("SCENARIOS and PROXIES must each name at least one");
        }
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

/// Σ capacity ÷ mean service time, requests per second.
fn fleet_capacity() -> f64 {
    NODES
        .iter()
        .map(|&(_, capacity, mean_ms)| capacity as f64 * 1000.0 / mean_ms as f64)
        .sum()
}

fn fleet_config(scenario: Scenario, seed: u64) -> FleetConfig {
    FleetConfig {
        seed,
        nodes: NODES
            .iter()
            .map(|&(name, capacity, mean_ms)| {
                let mut spec = NodeSpec::new(name, Duration::from_millis(mean_ms));
                spec.service_time.spread = SPREAD;
                spec.capacity = capacity;
                spec.queue = if scenario == Scenario::Overload {
                    OVERLOAD_NODE_QUEUE
                } else {
                    NODE_QUEUE
                };
                spec.response = if scenario == Scenario::Streaming {
                    ResponseKind::Sse
                } else {
                    ResponseKind::Json
                };
                spec
            })
            .collect(),
    }
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

/// Drives the churn schedule from `begin` (the start of the measured window) over `window`.
async fn churn(fleet: Arc<Fleet>, begin: Instant, window: Duration) {
    let mut events: Vec<(Duration, &str, Condition)> = Vec::new();
    for (node, kind, at, lasts) in CHURN {
        let factor = if kind == InterruptionKind::Slow {
            SLOW_FACTOR
        } else {
            1.0
        };
        events.push((
            window.mul_f64(at),
            node,
            Condition::Interrupted { kind, factor },
        ));
        events.push((window.mul_f64(at + lasts), node, Condition::Up));
    }
    events.sort_by_key(|(at, _, _)| *at);
    for (at, name, condition) in events {
        tokio::time::sleep_until(begin + at).await;
        if let Some(node) = fleet.nodes().iter().find(|node| node.name() == name) {
            node.set_condition(condition);
        }
    }
}

/// Waits until no request is left at any node (at most a minute).
async fn wait_idle(fleet: &Fleet) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while fleet.nodes().iter().any(|node| node.stats().in_flight > 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------------------
// The open-loop load and what the clients saw.

/// Everything a client saw in one measured window.
struct Tally {
    sent: u64,
    succeeded: u64,
    /// Latency of successes to the end of the body, µs.
    latency: Histogram<u64>,
    /// Time to the first body byte of successes, µs.
    first_byte: Histogram<u64>,
    /// The proxy's own refusals (a 503 that no node sent) and how long they took, µs.
    rejected: Histogram<u64>,
    /// Every other failure, by kind.
    failures: BTreeMap<String, u64>,
    /// When the last success completed, from the start of the measured window.
    last_success: Duration,
}

impl Tally {
    fn new() -> Tally {
        let histogram =
            || Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("constant bounds are valid");
        Tally {
            sent: 0,
            succeeded: 0,
            latency: histogram(),
            first_byte: histogram(),
            rejected: histogram(),
            failures: BTreeMap::new(),
            last_success: Duration::ZERO,
        }
    }

    fn failed(&self) -> u64 {
        self.failures.values().sum()
    }
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros())
        .unwrap_or(u64::MAX)
        .max(1)
}

fn ms(histogram: &Histogram<u64>, quantile: f64) -> Option<f64> {
    (!histogram.is_empty()).then(|| histogram.value_at_quantile(quantile) as f64 / 1000.0)
}

fn max_ms(histogram: &Histogram<u64>) -> Option<f64> {
    (!histogram.is_empty()).then(|| histogram.max() as f64 / 1000.0)
}

enum Outcome {
    Succeeded { first_byte: Duration },
    Rejected,
    Failed(String),
}

type LoadClient = Client<HttpConnector, Full<Bytes>>;

/// Offers `rate` requests per second to `target` for `warmup` (not recorded) then `duration`
/// (recorded), waiting at most the client timeout for the last ones.
async fn offer(
    target: &str,
    rate: f64,
    warmup: Duration,
    duration: Duration,
    stream: bool,
) -> Tally {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    let client: LoadClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(connector);
    let tally = Arc::new(Mutex::new(Tally::new()));
    let tasks = TaskTracker::new();
    let start = Instant::now();
    let window_start = start + warmup;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut index: u64 = 0;
    loop {
        // Departures are fixed in advance: a slow answer never delays the next request.
        let due = start + interval.mul_f64(index as f64);
        let since = due.duration_since(start);
        if since >= warmup + duration {
            break;
        }
        tokio::time::sleep_until(due).await;
        let recorded = since >= warmup;
        let request = build_request(target, index, stream);
        let (client, tally) = (client.clone(), Arc::clone(&tally));
        if recorded {
            lock(&tally).sent += 1;
        }
        tasks.spawn(async move {
            let began = Instant::now();
            let outcome = tokio::time::timeout(CLIENT_TIMEOUT, exchange(&client, request, stream))
                .await
                .unwrap_or_else(|_| Outcome::Failed("client-timeout".into()));
            if !recorded {
                return;
            }
            let took = micros(began.elapsed());
            let mut tally = lock(&tally);
            match outcome {
                Outcome::Succeeded { first_byte } => {
                    tally.succeeded += 1;
                    tally.last_success = tally.last_success.max(window_start.elapsed());
                    tally.latency.saturating_record(took);
                    tally.first_byte.saturating_record(micros(first_byte));
                }
                Outcome::Rejected => tally.rejected.saturating_record(took),
                Outcome::Failed(kind) => *tally.failures.entry(kind).or_default() += 1,
            }
        });
        index += 1;
    }
    tasks.close();
    tasks.wait().await;
    std::mem::replace(&mut *lock(&tally), Tally::new())
}

fn lock(tally: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    tally
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn build_request(target: &str, index: u64, stream: bool) -> Request<Full<Bytes>> {
    let body = format!(r#"{{"prompt":"request {index}","max_tokens":16,"stream":{stream}}}"#);
    let mut builder = Request::post(format!("{target}/v1/completions"))
        .header(header::CONTENT_TYPE, "application/json");
    if stream {
        builder = builder.header(header::ACCEPT, "text/event-stream");
    }
    builder
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Request::new(Full::new(Bytes::new())))
}

/// Bodies the simulated nodes send with a 503: their own load shedding and the gateway's page. Any
/// other 503 was made by the proxy itself: a refusal.
const NODE_503_BODIES: [&str; 2] = ["node at capacity", "No instance is ready"];

async fn exchange(client: &LoadClient, request: Request<Full<Bytes>>, stream: bool) -> Outcome {
    let began = Instant::now();
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(_) => return Outcome::Failed("broken".into()),
    };
    let status = response.status();
    let mut body = response.into_body();
    let mut first_byte = None;
    let mut text = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Outcome::Failed("broken".into());
        };
        if let Ok(data) = frame.into_data() {
            if first_byte.is_none() && !data.is_empty() {
                first_byte = Some(began.elapsed());
            }
            if text.len() < 64 * 1024 {
                text.extend_from_slice(&data);
            }
        }
    }
    let text = String::from_utf8_lossy(&text);
    if status == StatusCode::OK {
        // A success is a complete answer from a node: the stream's end marker, or the node's JSON.
        let complete = if stream {
            text.ends_with("data: [DONE]\n\n")
        } else {
            text.starts_with(r#"{"node":"#) && text.ends_with('}')
        };
        return match (complete, first_byte) {
            (true, Some(first_byte)) => Outcome::Succeeded { first_byte },
            _ => Outcome::Failed("incomplete".into()),
        };
    }
    if status == StatusCode::SERVICE_UNAVAILABLE
        && !NODE_503_BODIES.iter().any(|node| text.contains(node))
    {
        return Outcome::Rejected;
    }
    Outcome::Failed(status.as_u16().to_string())
}

// ---------------------------------------------------------------------------------------------------
// The proxies.

/// A proxy running as its own process in front of the upstreams.
struct Running {
    label: String,
    url: String,
    handle: Handle,
}

enum Handle {
    Tongs(TongsProcess),
    Peer { process: Process, _dir: TempDir },
}

impl Running {
    /// The proxy's processes (a master and its workers for nginx).
    fn pids(&self) -> Vec<u32> {
        match &self.handle {
            Handle::Tongs(tongs) => tongs.process.pids(),
            Handle::Peer { process, .. } => process.pids(),
        }
    }

    fn usage(&self) -> Usage {
        support::usage(&self.pids())
    }
}

/// Each node's capacity, for the peers that must be told it (HAProxy's `maxconn`).
struct Upstream {
    addr: String,
    capacity: usize,
}

async fn start_proxy(proxy: Proxy, upstreams: &[Upstream], settings: &Settings) -> Result<Running> {
    let program = |name: &str| {
        find_program(name).with_context(|| {
            format!("`{name}` is not installed: `bash benches/compare` installs it (apt-get install {name})")
        })
    };
    if proxy.is_tongs() {
        // Defaults, unless TONGS_CONFIG adds settings (to try one against the peers).
        let mut config = std::env::var("TONGS_CONFIG").map_or(String::new(), |extra| extra + "\n");
        let mut label = format!("tongs {}", env!("CARGO_PKG_VERSION"));
        if proxy == Proxy::TongsAdaptive {
            config.push_str("concurrency: { limit: adaptive }\n");
            label.push_str(", limit: adaptive");
        }
        config.push_str("discovery:\n  static:\n");
        for upstream in upstreams {
            writeln!(config, "    - url: http://{}", upstream.addr)?;
        }
        let tongs = TongsProcess::start(&config).await?;
        if settings.show_configs {
            println!("tongs configuration:\n```yaml\n{config}```");
        }
        return Ok(Running {
            label,
            url: tongs.url(),
            handle: Handle::Tongs(tongs),
        });
    }
    let binary = program(proxy.program())?;
    let dir = TempDir::new(&format!("compare-{}", proxy.program()))?;
    let addr = support::free_addr()?;
    let (config_name, config, command, version) = match proxy {
        Proxy::Nginx => {
            std::fs::create_dir_all(dir.path().join("tmp"))?;
            let config = nginx_config(dir.path(), &addr.to_string(), upstreams);
            let mut command = Command::new(&binary);
            command
                .args(["-e", "stderr", "-c"])
                .arg(dir.path().join("nginx.conf"))
                .arg("-p")
                .arg(dir.path())
                .args(["-g", "daemon off;"]);
            ("nginx.conf", config, command, version_of(&binary, "-v"))
        }
        Proxy::Haproxy => {
            let config = haproxy_config(&addr.to_string(), upstreams);
            let mut command = Command::new(&binary);
            command
                .arg("-db")
                .arg("-f")
                .arg(dir.path().join("haproxy.cfg"));
            ("haproxy.cfg", config, command, version_of(&binary, "-v"))
        }
        Proxy::Caddy => {
            let config = caddy_config(addr.port(), upstreams);
            let mut command = Command::new(&binary);
            command
                .args(["run", "--adapter", "caddyfile", "--config"])
                .arg(dir.path().join("Caddyfile"))
                .env("XDG_DATA_HOME", dir.path())
                .env("XDG_CONFIG_HOME", dir.path())
                .env("HOME", dir.path());
            ("Caddyfile", config, command, version_of(&binary, "version"))
        }
        Proxy::Tongs | Proxy::TongsAdaptive => unreachable!("tongs is started above"),
    };
    let path = dir.path().join(config_name);
    std::fs::write(&path, &config).with_context(|| format!("writing {}", path.display()))?;
    if settings.show_configs {
        println!(
            "{} configuration ({config_name}):\n```\n{config}```",
            proxy.program()
        );
    }
    let mut process = Process::spawn(proxy.program(), command, dir.path().join("proxy.log"))?;
    process.wait_listening(addr, Duration::from_secs(15))?;
    Ok(Running {
        label: format!("{} {version}", proxy.program()),
        url: format!("http://{addr}"),
        handle: Handle::Peer { process, _dir: dir },
    })
}

/// The version a program prints ("nginx version: nginx/1.22.1", "HAProxy version 2.6.12-1...",
/// "v2.6.2 h1:..."), reduced to the number.
fn version_of(binary: &Path, flag: &str) -> String {
    let Ok(out) = Command::new(binary).arg(flag).output() else {
        return "(version unknown)".into();
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text.split(|c: char| c.is_whitespace() || c == '/')
        .map(|word| word.trim_start_matches('v'))
        .find(|word| word.starts_with(|c: char| c.is_ascii_digit()) && word.contains('.'))
        .map(|word| word.split('-').next().unwrap_or(word).to_owned())
        .unwrap_or_else(|| "(version unknown)".into())
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// nginx OSS: least_conn shared by the workers (`zone`); no active checks in the open-source build,
/// so passive ones mirroring tongs' breaker (3 failures, 5 s out); retries on errors, timeouts and
/// 502/503/504, POST included (`non_idempotent`), on another server, 3 tries; no queue in OSS.
fn nginx_config(dir: &Path, listen: &str, upstreams: &[Upstream]) -> String {
    let dir = dir.display();
    let servers: String = upstreams
        .iter()
        .map(|u| format!("        server {} max_fails=3 fail_timeout=5s;\n", u.addr))
        .collect();
    format!(
        "worker_processes {workers};
pid {dir}/nginx.pid;
error_log stderr error;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    upstream fleet {{
        least_conn;
        zone fleet 256k;
{servers}        keepalive 256;
    }}
    server {{
        listen {listen} backlog=4096;
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_connect_timeout 1s;
            proxy_send_timeout 10s;
            proxy_read_timeout 10s;
            proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;
            proxy_next_upstream_tries 3;
            proxy_buffering off;
        }}
    }}
}}
",
        workers = cpus(),
    )
}

/// HAProxy: leastconn; active checks (GET /health every 2 s, 2 to fall, 2 to rise) and passive ones
/// (`observe layer7`, 3 errors mark a server down); L7 retries on connect failures, empty responses,
/// response timeouts and 502/503/504, each on another server (`redispatch 1`), 3 tries; `maxconn` per
/// server set to the node's capacity (HAProxy must be told it) with a 10 s queue.
fn haproxy_config(listen: &str, upstreams: &[Upstream]) -> String {
    let servers: String = upstreams
        .iter()
        .enumerate()
        .map(|(i, u)| format!("    server n{i} {} maxconn {}\n", u.addr, u.capacity))
        .collect();
    let timeout = PER_TRY_TIMEOUT.as_secs();
    format!(
        "global
    maxconn 8000
    nbthread {threads}
defaults
    mode http
    timeout connect 1s
    timeout client 100s
    timeout server {timeout}s
    timeout queue {timeout}s
    timeout http-request 10s
    timeout http-keep-alive 90s
    retries 2
    option redispatch 1
    retry-on conn-failure empty-response response-timeout 502 503 504
    option http-buffer-request
frontend proxy
    bind {listen}
    default_backend fleet
backend fleet
    balance leastconn
    option httpchk GET /health
    default-server check inter 2s fastinter 250ms downinter 2s fall 2 rise 2 observe layer7 error-limit 3 on-error mark-down
{servers}",
        threads = cpus(),
    )
}

/// Caddy: least_conn; active checks (GET /health every 2 s, 1 s timeout) and passive ones (3 failures
/// or a 502/503/504 within 5 s); retries POST too (`lb_retry_match`) for up to 10 s, every 100 ms,
/// which also makes a request wait while every node is at `unhealthy_request_count` — the nearest
/// Caddy has to a queue (one count for every node: the largest node's capacity); no retry on a
/// status code (Caddy 2.6 passes a node's 503 on).
fn caddy_config(port: u16, upstreams: &[Upstream]) -> String {
    let addrs: Vec<&str> = upstreams.iter().map(|u| u.addr.as_str()).collect();
    let most = upstreams.iter().map(|u| u.capacity).max().unwrap_or(1);
    let timeout = PER_TRY_TIMEOUT.as_secs();
    format!(
        "{{
\tadmin off
\tauto_https off
}}
:{port} {{
\tbind 127.0.0.1
\treverse_proxy {addrs} {{
\t\tlb_policy least_conn
\t\tlb_try_duration {timeout}s
\t\tlb_try_interval 100ms
\t\tlb_retry_match {{
\t\t\tmethod GET POST
\t\t}}
\t\thealth_uri /health
\t\thealth_interval 2s
\t\thealth_timeout 1s
\t\tfail_duration 5s
\t\tmax_fails 3
\t\tunhealthy_status 502 503 504
\t\tunhealthy_request_count {most}
\t\tflush_interval -1
\t\ttransport http {{
\t\t\tdial_timeout 1s
\t\t\tresponse_header_timeout {timeout}s
\t\t}}
\t}}
}}
",
        addrs = addrs.join(" "),
    )
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
    per_second: f64,
    cpu_per_request: Option<Duration>,
    peak_rss_kib: Option<u64>,
}

async fn open_loop_row(scenario: Scenario, proxy: Proxy, settings: &Settings) -> Result<Row> {
    let fleet = Arc::new(
        Fleet::start(
            &fleet_config(scenario, settings.seed),
            Duration::from_secs(24 * 3600),
        )
        .await
        .context("starting the simulated fleet")?,
    );
    let upstreams: Vec<Upstream> = fleet
        .nodes()
        .iter()
        .map(|node| Upstream {
            addr: node.addr().to_string(),
            capacity: node.spec().capacity,
        })
        .collect();
    let running = start_proxy(proxy, &upstreams, settings).await?;
    // Let active health checks see every node once before the load.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let duration = if scenario == Scenario::Churn {
        settings.churn_duration
    } else {
        settings.duration
    };
    let rate = fleet_capacity() * scenario.load();
    eprintln!(
        "compare: {} through {} ({:.0} req/s for {:?})",
        scenario.name(),
        running.label,
        rate,
        duration
    );
    let start = Instant::now();
    let schedule = (scenario == Scenario::Churn)
        .then(|| tokio::spawn(churn(Arc::clone(&fleet), start + settings.warmup, duration)));
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
        scenario == Scenario::Streaming,
    )
    .await;
    let usage = running.usage();
    let cpu_before = cpu_before.await.unwrap_or_default();
    if let Some(schedule) = schedule {
        schedule.abort();
    }
    let row = Row {
        scenario,
        proxy: Some(proxy),
        label: running.label.clone(),
        requests: tally.sent,
        succeeded: tally.succeeded,
        p50: ms(&tally.latency, 0.5),
        p99: ms(&tally.latency, 0.99),
        max: max_ms(&tally.latency),
        first_byte_p50: ms(&tally.first_byte, 0.5),
        first_byte_p99: ms(&tally.first_byte, 0.99),
        rejected: tally.rejected.len(),
        rejected_p50: ms(&tally.rejected, 0.5),
        rejected_p99: ms(&tally.rejected, 0.99),
        failures: tally.failures.clone(),
        // Successes over the time they took: requests still waiting in a queue when the window ends
        // are served after it, and that time counts.
        per_second: tally.succeeded as f64 / duration.max(tally.last_success).as_secs_f64(),
        cpu_per_request: (tally.sent > 0)
            .then(|| usage.cpu.saturating_sub(cpu_before) / tally.sent as u32),
        peak_rss_kib: Some(usage.peak_rss_kib),
    };
    debug_assert_eq!(
        tally.sent,
        tally.succeeded + tally.rejected.len() + tally.failed()
    );
    drop(running);
    wait_idle(&fleet).await;
    Ok(row)
}

// ---------------------------------------------------------------------------------------------------
// Throughput: wrk against an origin that answers at once.

/// nginx as the instant origin: one worker, two ports, `200 ok` to everything (health checks too).
fn origin_config(dir: &Path, ports: &[u16]) -> String {
    let dir = dir.display();
    let servers: String = ports
        .iter()
        .map(|port| {
            format!(
                "    server {{ listen 127.0.0.1:{port} backlog=4096; keepalive_requests 1000000; \
                 location / {{ default_type text/plain; return 200 \"ok\\n\"; }} }}\n"
            )
        })
        .collect();
    format!(
        "worker_processes 1;
pid {dir}/origin.pid;
error_log stderr error;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
{servers}}}
"
    )
}

/// What wrk printed, read.
struct Wrk {
    requests: u64,
    per_second: f64,
    p50: Option<f64>,
    p99: Option<f64>,
    max: Option<f64>,
    errors: u64,
}

fn parse_wrk(text: &str) -> Result<Wrk> {
    let to_ms = |value: &str| -> Option<f64> {
        let (number, factor) = if let Some(n) = value.strip_suffix("us") {
            (n, 0.001)
        } else if let Some(n) = value.strip_suffix("ms") {
            (n, 1.0)
        } else if let Some(n) = value.strip_suffix('s') {
            (n, 1000.0)
        } else if let Some(n) = value.strip_suffix('m') {
            (n, 60_000.0)
        } else {
            return None;
        };
        number.parse::<f64>().ok().map(|n| n * factor)
    };
    let mut wrk = Wrk {
        requests: 0,
        per_second: 0.0,
        p50: None,
        p99: None,
        max: None,
        errors: 0,
    };
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Latency", _avg, _stdev, max, ..] => wrk.max = to_ms(max),
            ["50%", value] => wrk.p50 = to_ms(value),
            ["99%", value] => wrk.p99 = to_ms(value),
            [count, "requests", "in", ..] => wrk.requests = count.parse().unwrap_or(0),
            ["Requests/sec:", value] => wrk.per_second = value.parse().unwrap_or(0.0),
            ["Non-2xx", "or", "3xx", "responses:", count] => {
                wrk.errors += count.parse::<u64>().unwrap_or(0)
            }
            ["Socket", "errors:", rest @ ..] => {
                // "connect 0, read 0, write 0, timeout 0"
                wrk.errors += rest
                    .iter()
                    .filter_map(|word| word.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>();
            }
            _ => {}
        }
    }
    if wrk.requests == 0 {
        bail!("wrk reported no requests:\n{text}");
    }
    Ok(wrk)
}

async fn wrk(wrk: &Path, url: &str, duration: Duration, connections: u32) -> Result<Wrk> {
    let mut command = tokio::process::Command::new(wrk);
    command
        .arg("-t1")
        .arg(format!("-c{connections}"))
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .arg("--latency")
        .arg(format!("{url}/v1/ping"));
    let out = command.output().await.context("running wrk")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "wrk failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_wrk(&text)
}

async fn throughput_rows(settings: &Settings) -> Result<Vec<Row>> {
    let need = |name: &str| {
        find_program(name).with_context(|| {
            format!("`{name}` is not installed: `bash benches/compare` installs it")
        })
    };
    let (nginx, wrk_path) = (need("nginx")?, need("wrk")?);
    let dir = TempDir::new("compare-origin")?;
    std::fs::create_dir_all(dir.path().join("tmp"))?;
    let ports = [support::free_addr()?.port(), support::free_addr()?.port()];
    let config_path = dir.path().join("origin.conf");
    std::fs::write(&config_path, origin_config(dir.path(), &ports))?;
    let mut command = Command::new(&nginx);
    command
        .args(["-e", "stderr", "-c"])
        .arg(&config_path)
        .arg("-p")
        .arg(dir.path())
        .args(["-g", "daemon off;"]);
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
                per_second: result.per_second,
                cpu_per_request: proxy
                    .map(|_| after.cpu.saturating_sub(before.cpu) / result.requests.max(1) as u32),
                peak_rss_kib: proxy.map(|_| after.peak_rss_kib),
            })
        }
    };
    let direct = format!("http://127.0.0.1:{}", ports[0]);
    rows.push(measure("origin alone (baseline)".into(), None, direct, Vec::new()).await?);
    // The adaptive limit changes nothing against an origin that answers at once.
    for &proxy in settings
        .proxies
        .iter()
        .filter(|&&proxy| proxy != Proxy::TongsAdaptive)
    {
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
    let capacity = fleet_capacity();
    writeln!(
        header,
        "fleet: {} (name capacity×mean), lognormal spread {SPREAD}, node queue {NODE_QUEUE} \
         ({OVERLOAD_NODE_QUEUE} in overload), seed {}; capacity Σ capacity ÷ mean = {capacity:.1} req/s",
        NODES
            .iter()
            .map(|(name, capacity, mean)| format!("{name} {capacity}×{mean} ms"))
            .collect::<Vec<_>>()
            .join(", "),
        settings.seed,
    )?;
    writeln!(
        header,
        "load: open loop, {} s measured after {} s unrecorded (churn {} s); steady and streaming at 60 %, \
         churn at 50 %, overload at 200 % of capacity; client timeout {} s; throughput: wrk -t1 -c{} for {} s",
        settings.duration.as_secs_f64(),
        settings.warmup.as_secs_f64(),
        settings.churn_duration.as_secs_f64(),
        CLIENT_TIMEOUT.as_secs(),
        settings.connections,
        settings.throughput_duration.as_secs_f64(),
    )?;
    print!("{header}");

    let mut rows = Vec::new();
    for &scenario in &settings.scenarios {
        if scenario == Scenario::Throughput {
            rows.extend(throughput_rows(&settings).await?);
            continue;
        }
        for &proxy in &settings.proxies {
            rows.push(open_loop_row(scenario, proxy, &settings).await?);
        }
    }

    let table = table(&rows);
    let verdicts = verdicts(&rows);
    println!();
    print!("{table}");
    println!();
    print!("{verdicts}");

    if settings.smoke {
        return smoke_check(&rows);
    }
    if let Some(path) = &settings.results {
        let text = format!(
            "# tongs against the peers\n\nWritten by `bash benches/compare` (`benches/compare.rs`).\n\n\
             {header}\n{table}\n{verdicts}"
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
    let _ = writeln!(
        out,
        "| scenario | proxy | requests | success % | p50 ms | p99 ms | max ms | first byte p50 / p99 ms \
         | rejected | rejection p50 / p99 ms | other failures | req/s | CPU µs / req | peak RSS MiB |"
    );
    let _ = writeln!(
        out,
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"
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
            row.failures
                .iter()
                .map(|(kind, n)| format!("{kind}: {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let first_byte = match (row.first_byte_p50, row.first_byte_p99) {
            (None, None) => "–".to_owned(),
            (p50, p99) => format!("{} / {}", cell(p50), cell(p99)),
        };
        let rejection = if row.rejected > 0 {
            format!("{} / {}", cell(row.rejected_p50), cell(row.rejected_p99))
        } else {
            "–".to_owned()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {success:.2} | {} | {} | {} | {first_byte} | {} | {rejection} | {failures} | {:.1} | {} | {} |",
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

//! What routing a request to a pool by its OpenAI `model` costs end to end, against routing by path
//! alone. One instant origin, and tongs in front of it four times, all in this process and each with
//! one worker thread: `path`, one pool matched by `path_prefixes: ["/v1/"]` (no pool names a model, so
//! no body is read for routing); `model`, one pool matched by `models: ["bench-model"]` (every body is
//! read with `tongs::openai::read_model`); `path, continuation off` — with `continuation` on (the
//! default) tongs parses every OpenAI body it keeps to know whether its stream could be continued,
//! whatever the routing, so this is the only tongs that reads no body at all; and `path` again, the
//! control: two tongs configured alike do not measure exactly alike, and their difference is the
//! bench's resolution.
//!
//! POSTs of an OpenAI chat body of 4 KiB and of 1 MiB, `model` its first key, go closed-loop through
//! each over keep-alive connections, the contenders taking turns in rounds, in a shuffled order, so
//! the drift of a shared machine hits all of them; the origin alone takes its turns too, the floor
//! under tongs' own cost. Prints a markdown table per body size and connection count: p50 and p99
//! latency, requests per second, CPU per request of the whole process (its threads' time on CPU: client, origin and
//! every tongs), then what `model` adds over `path`, beside the control's difference.
//!
//!     cargo bench --bench pools
//!     REQUESTS=2000 ROUNDS=4 CONNECTIONS="4" cargo bench --bench pools
//!
//! Environment: REQUESTS (requests per contender with the 4 KiB body, default 20000; the 1 MiB body
//! gets a fortieth of it, 500), ROUNDS (default 50), CONNECTIONS (a list, default `1 4`: one alone,
//! where the figures are what a lone request pays, and four at once, where they queue for the CPUs).
//! Under `cargo test --all-targets` (no `--bench` argument) it runs a smoke pass: a few requests of
//! each size through each contender, every one of which must be answered 200.

#[path = "support/mod.rs"]
mod support;

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::config::Config;
use tongs::openai::read_model;

use support::{env_list, env_number};

/// The model every body names, and the one pool `model` matches.
const MODEL: &str = "bench-model";
const PATH: &str = "/v1/chat/completions";
/// The origin's answer to every request.
const ANSWER: &[u8] = br#"{"id":"chatcmpl-bench","object":"chat.completion","model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
/// Body sizes, and the share of REQUESTS each gets.
const SIZES: [(&str, usize, u64); 2] = [("4 KiB", 4 << 10, 1), ("1 MiB", 1 << 20, 40)];
const DEFAULT_REQUESTS: u64 = 20_000;
const DEFAULT_ROUNDS: u64 = 50;
const DEFAULT_CONNECTIONS: &str = "1 4";
/// Unrecorded requests through each contender before a body size's rounds, as a share of its requests.
const WARMUP_SHARE: u64 = 10;
/// A request not answered within this fails the bench.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Settings every tongs shares: the ports free; heartbeats off (nothing but the bench's requests); one
/// worker, so every connection lands on the same thread — with two, SO_REUSEPORT spreads connections
/// by a hash of their ports, and each round's fresh connections would split 2–2, 3–1 or 4–0 by chance.
const COMMON: &str =
    "listen: 127.0.0.1:0\nadmin: { listen: 127.0.0.1:0 }\nworkers: 1\nhealth: { enabled: false }\n";

/// Where the bench's requests go: the origin itself, or a tongs in front of it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Routing {
    Origin,
    Path,
    /// By path, with `continuation` off: tongs reads no body at all.
    PathNoContinuation,
    Model,
    /// `Path` again, in a tongs of its own: the control, whose difference from `Path` is what the
    /// bench cannot tell from nothing.
    PathAgain,
}

impl Routing {
    const ALL: [Routing; 5] = [
        Routing::Origin,
        Routing::Path,
        Routing::PathNoContinuation,
        Routing::Model,
        Routing::PathAgain,
    ];

    fn label(self) -> &'static str {
        match self {
            Routing::Origin => "none (origin alone)",
            Routing::Path => "path",
            Routing::PathNoContinuation => "path, continuation off",
            Routing::Model => "model",
            Routing::PathAgain => "path, a second tongs (control)",
        }
    }

    /// tongs' configuration beyond `COMMON` for this routing, the origin at `origin` its pool's one
    /// static endpoint; None for the origin alone.
    fn yaml(self, origin: SocketAddr) -> Option<String> {
        let (rule, extra) = match self {
            Routing::Origin => return None,
            Routing::Path | Routing::PathAgain => (r#"path_prefixes: ["/v1/"]"#.to_owned(), ""),
            Routing::PathNoContinuation => (
                r#"path_prefixes: ["/v1/"]"#.to_owned(),
                "continuation: { enabled: false }\n",
            ),
            Routing::Model => (format!(r#"models: ["{MODEL}"]"#), ""),
        };
        Some(format!(
            "{extra}pools:\n  - name: bench\n    match: {{ {rule} }}\n    discovery: {{ static: [{{ url: \"http://{origin}\" }}] }}\n"
        ))
    }
}

fn main() -> Result<()> {
    let settings = if support::benchmarking() {
        Settings::from_env()?
    } else {
        println!("pools: a smoke pass; the benchmark is `cargo bench --bench pools`");
        Settings::smoke()
    };
    support::block_on(run(settings))
}

struct Settings {
    /// Requests per contender with the 4 KiB body.
    requests: u64,
    rounds: u64,
    connections: Vec<usize>,
    smoke: bool,
}

impl Settings {
    fn from_env() -> Result<Settings> {
        let requests = env_number("REQUESTS", DEFAULT_REQUESTS)?;
        let rounds = env_number("ROUNDS", DEFAULT_ROUNDS)?;
        if rounds == 0 || requests < rounds {
            bail!(
                "REQUESTS ({requests}) must be at least ROUNDS ({rounds}), and ROUNDS at least 1"
            );
        }
        let connections = env_list("CONNECTIONS", DEFAULT_CONNECTIONS, |text| {
            text.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .with_context(|| format!("CONNECTIONS: {text:?} is not a count of connections"))
        })?;
        Ok(Settings {
            requests,
            rounds,
            connections,
            smoke: false,
        })
    }

    fn smoke() -> Settings {
        Settings {
            requests: 40,
            rounds: 2,
            connections: vec![2],
            smoke: true,
        }
    }

    /// Requests per contender, and per round, with a body of this size's share.
    fn requests_for(&self, share: u64) -> (u64, u64) {
        let per_round = (self.requests / share / self.rounds).max(1);
        (per_round * self.rounds, per_round)
    }
}

async fn run(settings: Settings) -> Result<()> {
    let origin = Origin::start().await?;
    let mut targets = Vec::new();
    let mut running = Vec::new();
    for routing in Routing::ALL {
        match routing.yaml(origin.addr) {
            None => targets.push((routing, origin.addr)),
            Some(yaml) => {
                let tongs = InProcess::start(&format!("{COMMON}{yaml}")).await?;
                targets.push((routing, tongs.addr));
                running.push(tongs);
            }
        }
    }
    if !settings.smoke {
        print_header(&settings);
    }
    let mut tables = Vec::new();
    for (name, size, share) in SIZES {
        let body = chat_body(size);
        let (requests, per_round) = settings.requests_for(share);
        for &connections in &settings.connections {
            let mut measured: Vec<Measured> = targets
                .iter()
                .map(|&(routing, _)| Measured::new(routing))
                .collect();
            for &(_, addr) in &targets {
                let warmup = (requests / WARMUP_SHARE).max(connections as u64);
                phase(addr, &body, warmup, connections).await?;
            }
            // Each round in its own order, so no contender always runs first, or after the same one.
            let mut rng = fastrand::Rng::with_seed(1);
            for _ in 0..settings.rounds {
                let mut order: Vec<usize> = (0..targets.len()).collect();
                rng.shuffle(&mut order);
                for i in order {
                    let result = phase(targets[i].1, &body, per_round, connections).await?;
                    measured[i].add(result)?;
                }
            }
            tables.push(Table {
                size: name,
                bytes: body.len(),
                connections,
                requests,
                measured,
            });
            if !settings.smoke {
                eprintln!("pools: {name}, {connections} connection(s) done");
            }
        }
    }
    for tongs in running {
        tongs.stop().await;
    }
    origin.task.abort();
    if settings.smoke {
        println!("pools: every request answered 200");
    } else {
        print_tables(&tables);
        println!();
        println!("Load average (1, 5, 15 min) at the end: {}", load_average());
    }
    Ok(())
}

fn print_header(settings: &Settings) {
    println!("# pools: routing by `model` against routing by path");
    println!();
    println!("- date: {}", support::now_utc());
    println!("- machine: {}", support::machine());
    println!("- commit: {}", commit());
    println!(
        "- load average (1, 5, 15 min) at the start: {}",
        load_average()
    );
    let sizes: Vec<String> = SIZES
        .iter()
        .map(|&(name, size, share)| {
            let (requests, per_round) = settings.requests_for(share);
            format!(
                "{name} ({} bytes): {requests} requests per contender, {per_round} a round",
                chat_body(size).len()
            )
        })
        .collect();
    println!(
        "- load: closed loop over {} keep-alive connection(s); {}; {} rounds, contenders in turn (shuffled, seed 1), after a tenth of the requests unrecorded",
        settings
            .connections
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(" or "),
        sizes.join("; "),
        settings.rounds
    );
    println!(
        "- CPU: the time on CPU of every thread of the bench process (client, origin and every tongs; /proc/self/task/*/schedstat) over the measured requests, divided by them"
    );
    println!();
}

/// "1.20 1.37 1.82": the machine's load averages, from `/proc/loadavg`.
fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let fields: Vec<&str> = text.split_whitespace().take(3).collect();
    if fields.is_empty() {
        "unknown".into()
    } else {
        fields.join(" ")
    }
}

/// The commit this runs at, and whether `src/` or `benches/` differ from it.
fn commit() -> String {
    let dir = env!("CARGO_MANIFEST_DIR");
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
    };
    let Ok(out) = git(&["rev-parse", "--short", "HEAD"]) else {
        return "unknown".into();
    };
    let hash = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if hash.is_empty() {
        return "unknown".into();
    }
    match git(&["diff", "--quiet", "HEAD", "--", "src", "benches"]) {
        Ok(out) if !out.status.success() => format!("{hash} with uncommitted changes"),
        _ => hash,
    }
}

/// A chat request of at least `size` bytes, `model` first: a conversation, then the sampling settings.
fn chat_body(size: usize) -> Bytes {
    let messages = support::chat::conversation(size);
    let body = format!(
        r#"{{"model":"{MODEL}","messages":{messages},"temperature":0.7,"top_p":0.95,"max_tokens":512}}"#
    );
    assert!(body.len() >= size);
    let found = read_model(body.as_bytes())
        .expect("one model")
        .expect("a model");
    assert_eq!(found.name, MODEL);
    Bytes::from(body)
}

// ---------------------------------------------------------------------------------------------------
// The origin and tongs.

/// An HTTP/1.1 server on loopback that reads each request's body and answers 200 with `ANSWER`.
struct Origin {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Origin {
    async fn start() -> Result<Origin> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the origin")?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    let service = service_fn(|request: Request<Incoming>| async move {
                        // The whole body, as a node reads it (and so the connection stays reusable).
                        let _ = request.into_body().collect().await;
                        let mut response = Response::new(Full::new(Bytes::from_static(ANSWER)));
                        response.headers_mut().insert(
                            header::CONTENT_TYPE,
                            header::HeaderValue::from_static("application/json"),
                        );
                        Ok::<_, Infallible>(response)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Origin { addr, task })
    }
}

/// tongs in this process on the whole configuration `yaml` (`support::in_process` adds a top-level
/// `discovery`, which would be a second pool, `default`).
struct InProcess {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl InProcess {
    async fn start(yaml: &str) -> Result<InProcess> {
        let config = Config::parse(yaml, "the bench's tongs configuration")
            .map_err(|err| anyhow!("the bench's tongs configuration is invalid: {err}\n{yaml}"))?;
        let app = App::bind(&config).await.context("starting tongs")?;
        let addr = app.proxy_addr();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(app.run(shutdown.clone()));
        Ok(InProcess {
            addr,
            shutdown,
            task,
        })
    }

    async fn stop(self) {
        self.shutdown.cancel();
        if tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .is_err()
        {
            eprintln!("pools: tongs did not finish draining within 30 s");
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The load.

/// One contender's run of `requests` requests.
struct Phase {
    /// Latencies in nanoseconds.
    latencies: Histogram<u64>,
    wall: Duration,
    cpu: Duration,
}

/// Opens `connections` keep-alive connections to `addr` (each sends one request, unrecorded), then
/// sends `requests` POSTs of `body` over them, each connection its next as soon as its last is
/// answered, until `requests` have been sent. Every answer must be a 200.
async fn phase(addr: SocketAddr, body: &Bytes, requests: u64, connections: usize) -> Result<Phase> {
    let mut senders = Vec::with_capacity(connections);
    for _ in 0..connections {
        let mut sender = connect(addr).await?;
        exchange(&mut sender, addr, body).await?;
        senders.push(sender);
    }
    let next = Arc::new(AtomicU64::new(0));
    let cpu_before = process_cpu()?;
    let started = Instant::now();
    let tasks: Vec<JoinHandle<Result<Histogram<u64>>>> = senders
        .into_iter()
        .map(|mut sender| {
            let (next, body) = (Arc::clone(&next), body.clone());
            tokio::spawn(async move {
                let mut latencies = latency_histogram();
                while next.fetch_add(1, Ordering::Relaxed) < requests {
                    let sent = Instant::now();
                    exchange(&mut sender, addr, &body).await?;
                    latencies.record(nanos(sent.elapsed()))?;
                }
                Ok(latencies)
            })
        })
        .collect();
    let mut latencies = latency_histogram();
    for task in tasks {
        latencies.add(task.await.context("a connection's task")??)?;
    }
    let wall = started.elapsed();
    let cpu = process_cpu()?.saturating_sub(cpu_before);
    Ok(Phase {
        latencies,
        wall,
        cpu,
    })
}

async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

/// POSTs `body` and reads the whole answer; anything but a 200 is an error.
async fn exchange(
    sender: &mut SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    body: &Bytes,
) -> Result<()> {
    let request = Request::post(PATH)
        .header(header::HOST, addr.to_string())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.clone()))?;
    let answer = async {
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::Ok((status, body))
    };
    let (status, answer) = tokio::time::timeout(REQUEST_TIMEOUT, answer)
        .await
        .with_context(|| format!("no answer from {addr} within {REQUEST_TIMEOUT:?}"))??;
    if status != StatusCode::OK {
        bail!(
            "{addr} answered {status}: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    Ok(())
}

/// A histogram of nanoseconds, from 1 ns to a minute, three significant digits.
fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("constant bounds are valid")
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// CPU time of this whole process so far: the time on CPU of each of its threads, in nanoseconds, from
/// `/proc/self/task/*/schedstat` (the clock-tick figures of `/proc/self/stat` are 10 ms coarse, too
/// coarse for a few microseconds per request; reading files keeps the bench free of `unsafe`). A
/// thread that ended before the reading is not counted: the bench's threads live through every round.
fn process_cpu() -> Result<Duration> {
    let mut nanos: u64 = 0;
    for task in std::fs::read_dir("/proc/self/task").context("/proc/self/task")? {
        let path = task.context("/proc/self/task")?.path().join("schedstat");
        // A thread may end between the listing and the read.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let on_cpu = text
            .split_whitespace()
            .next()
            .and_then(|field| field.parse::<u64>().ok())
            .with_context(|| format!("{}: {text:?}", path.display()))?;
        nanos = nanos.saturating_add(on_cpu);
    }
    Ok(Duration::from_nanos(nanos))
}

// ---------------------------------------------------------------------------------------------------
// The figures.

/// Everything one contender's rounds recorded, for one body size and connection count.
struct Measured {
    routing: Routing,
    latencies: Histogram<u64>,
    requests: u64,
    wall: Duration,
    cpu: Duration,
    /// Each round's p50, nanoseconds.
    round_p50: Vec<u64>,
}

impl Measured {
    fn new(routing: Routing) -> Measured {
        Measured {
            routing,
            latencies: latency_histogram(),
            requests: 0,
            wall: Duration::ZERO,
            cpu: Duration::ZERO,
            round_p50: Vec::new(),
        }
    }

    fn add(&mut self, phase: Phase) -> Result<()> {
        self.round_p50.push(phase.latencies.value_at_quantile(0.5));

        self.requests += phase.latencies.len();
        self.latencies.add(&phase.latencies)?;
        self.wall += phase.wall;
        self.cpu += phase.cpu;
        Ok(())
    }

    fn p50_us(&self) -> f64 {
        self.latencies.value_at_quantile(0.5) as f64 / 1e3
    }

    fn p99_us(&self) -> f64 {
        self.latencies.value_at_quantile(0.99) as f64 / 1e3
    }

    fn per_second(&self) -> f64 {
        self.requests as f64 / self.wall.as_secs_f64()
    }

    fn cpu_us(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.requests as f64
    }
}

struct Table {
    size: &'static str,
    bytes: usize,
    connections: usize,
    requests: u64,
    measured: Vec<Measured>,
}

impl Table {
    fn get(&self, routing: Routing) -> &Measured {
        self.measured
            .iter()
            .find(|m| m.routing == routing)
            .expect("every routing is measured")
    }
}

/// "+1.2", "−0.4": a difference with its sign.
fn signed(value: f64, decimals: usize) -> String {
    if value < 0.0 {
        format!("−{:.*}", decimals, -value)
    } else {
        format!("+{value:.decimals$}")
    }
}

/// The median of each round's p50 difference `b` − `a`, microseconds.
fn median_by_round(a: &Measured, b: &Measured) -> f64 {
    let mut rounds: Vec<f64> = a
        .round_p50
        .iter()
        .zip(&b.round_p50)
        .map(|(&a, &b)| (b as f64 - a as f64) / 1e3)
        .collect();
    rounds.sort_by(f64::total_cmp);
    support::stats::percentile(&rounds, 50.0).unwrap_or(f64::NAN)
}

fn print_tables(tables: &[Table]) {
    let mut out = String::new();
    out.push_str(
        "| body | connections | routing | requests | p50 µs | p99 µs | req/s | CPU µs / req |\n",
    );
    out.push_str("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n");
    for table in tables {
        for m in &table.measured {
            let _ = writeln!(
                out,
                "| {} ({} bytes) | {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.1} |",
                table.size,
                table.bytes,
                table.connections,
                m.routing.label(),
                table.requests,
                m.p50_us(),
                m.p99_us(),
                m.per_second(),
                m.cpu_us()
            );
        }
    }
    out.push('\n');
    out.push_str("What reading `model` adds: `model` − `path`, measured in the same rounds (p50 also as the median of each round's difference). The control is the same difference between two tongs configured alike (`path, a second tongs` − `path`): what the bench cannot tell from nothing. For scale, tongs' own CPU (`path` − origin alone) and, within it, the continuation's read of the body (`path` − `path, continuation off`).\n\n");
    out.push_str("| body | connections | added p50 µs | added p50, median of rounds µs | added p99 µs | added CPU µs / req | req/s model ÷ path | control: p50 µs | control: CPU µs / req | tongs' CPU µs / req | continuation's read CPU µs / req |\n");
    out.push_str("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for table in tables {
        let (origin, path, plain, model, again) = (
            table.get(Routing::Origin),
            table.get(Routing::Path),
            table.get(Routing::PathNoContinuation),
            table.get(Routing::Model),
            table.get(Routing::PathAgain),
        );
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {:.3} | {} | {} | {:.1} | {} |",
            table.size,
            table.connections,
            signed(model.p50_us() - path.p50_us(), 1),
            signed(median_by_round(path, model), 1),
            signed(model.p99_us() - path.p99_us(), 1),
            signed(model.cpu_us() - path.cpu_us(), 1),
            model.per_second() / path.per_second(),
            signed(again.p50_us() - path.p50_us(), 1),
            signed(again.cpu_us() - path.cpu_us(), 1),
            path.cpu_us() - origin.cpu_us(),
            signed(path.cpu_us() - plain.cpu_us(), 1),
        );
    }
    print!("{out}");
}

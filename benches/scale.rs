//! Scale: tongs in front of 10,000 endpoints, and carrying 1,000 concurrent Server-Sent Event streams.
//!
//! Part A, endpoints. One HTTP server in this process listens on `0.0.0.0:PORT`, so it answers every
//! loopback address: endpoint `i` is `http://127.1.x.y:PORT` (127.1.0.0 + i), told apart by the local
//! address its connections arrive on. It answers `GET /health` and everything else with 200 and a small
//! JSON body at once, and counts heartbeats per endpoint and per 100 ms of arrival. It closes a
//! connection left idle for `ENDPOINT_KEEPALIVE` (5 s, uvicorn's default), as an inference server does.
//! The release tongs binary runs as its own process (defaults, heartbeats on: every 2 s ±10 %) in front
//! of `BASELINE` (10) endpoints, then `ENDPOINTS` (10,000), and for each this measures:
//! - start → `/readyz` 200, RSS once ready and once every endpoint has had a heartbeat;
//! - heartbeats over `HEARTBEAT_WINDOW` (20 s) with no traffic: rate against the expected N / 2 s, their
//!   spread over 100 ms buckets, endpoints never probed, re-probes after failed heartbeats, tongs' CPU
//!   per second;
//! - the pick cost end to end: `CLIENTS` (16) closed-loop clients through tongs for `PICK_DURATION`
//!   (10 s) after `PICK_WARMUP` (5 s) not counted: req/s, latency, tongs' CPU per request, upstream
//!   connections opened per request, fds.
//!
//! tongs keeps a connection per endpoint per worker under traffic (heartbeats go through one of them):
//! if that runs it out of file descriptors at `ENDPOINTS`, the run says so and is repeated at the
//! largest round size that fits. Last, `ENDPOINTS` once more with heartbeats off, to tell the endpoints'
//! own memory from their connections'. The pick alone, in process, is `cargo bench --bench pick`.
//!
//! Part B, streams. An SSE upstream in this process sends a small event every `STREAM_GAP` (1 s),
//! `STREAM_EVENTS` (20) per stream, the first at once. `STREAMS` (1,000) concurrent streaming requests,
//! one connection each, go through tongs and then through nginx (`proxy_buffering off`, upstream
//! keepalive, `least_conn`, `zone`, a worker per CPU) when it is installed. Once the upstream holds every
//! stream open, the proxy's RSS and fds (nginx: master and workers summed) are sampled; memory per stream
//! = (RSS with streams − idle RSS) / STREAMS. Every stream must end cleanly with every event in order.
//!
//!     cargo bench --bench scale
//!     ENDPOINTS=5000 STREAMS=2000 cargo bench --bench scale
//!
//! Under `cargo test --all-targets` (no `--bench` argument) a smoke run of a few seconds checks the
//! mechanics (200 endpoints, 50 streams): every endpoint gets heartbeats, every request and stream
//! completes.

#![forbid(unsafe_code)]

#[path = "support/mod.rs"]
mod support;

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use support::stats::percentile;
use support::{NginxSse, TongsProcess, Usage, load_average, mib, seconds};

/// Endpoint `i` listens (as far as tongs can tell) on this address plus `i`. 127.0.0.1, where tongs and
/// this bench's other servers listen, is outside the range.
const FIRST_ENDPOINT: u32 = u32::from_be_bytes([127, 1, 0, 0]);
/// Addresses left in 127.0.0.0/8 from the first on.
const MAX_ENDPOINTS: usize = (u32::from_be_bytes([127, 255, 255, 255]) - FIRST_ENDPOINT) as usize;
/// Heartbeat arrivals are counted per bucket of this length ...
const BUCKET: Duration = Duration::from_millis(100);
/// ... for this many buckets after a run starts (10 minutes).
const BUCKETS: usize = 6000;
/// A heartbeat this soon after the endpoint's previous one is a re-probe after a failure: regular
/// waits are at least 1.8 s, the fast interval is 250 ms. The second heartbeat is left out: it comes
/// anywhere in the interval after the first.
const QUICK: Duration = Duration::from_millis(900);
/// What the fake endpoints answer.
const ANSWER: &[u8] = br#"{"id":"cmpl-1","choices":[{"text":"ok"}]}"#;

fn endpoint_addr(index: usize, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(FIRST_ENDPOINT + index as u32), port)
}

// ---------------------------------------------------------------------------------------------------
// Settings.

struct Settings {
    /// The full benchmark (`cargo bench`) rather than the smoke run.
    full: bool,
    endpoints: usize,
    baseline: usize,
    heartbeat_window: Duration,
    clients: usize,
    /// Untimed traffic first, so every worker has a pooled connection to the endpoints it picks.
    pick_warmup: Duration,
    pick_duration: Duration,
    /// Idle time after which a fake endpoint closes a kept-alive connection (none: never).
    endpoint_keepalive: Option<Duration>,
    streams: usize,
    stream_events: u32,
    stream_gap: Duration,
}

impl Settings {
    fn from_env(full: bool) -> Result<Settings> {
        let (endpoints, window, clients, warmup, pick, streams, events, gap) = if full {
            (10_000, 20_000, 16, 5_000, 10_000, 1000, 20, 1000)
        } else {
            (200, 1000, 4, 200, 500, 50, 3, 200)
        };
        let keepalive = support::env_duration("ENDPOINT_KEEPALIVE", Duration::from_secs(5))?;
        let settings = Settings {
            full,
            endpoints: support::env_number("ENDPOINTS", endpoints)?,
            baseline: support::env_number("BASELINE", 10)?,
            heartbeat_window: support::env_duration(
                "HEARTBEAT_WINDOW",
                Duration::from_millis(window),
            )?,
            clients: support::env_number("CLIENTS", clients)?,
            pick_warmup: support::env_duration("PICK_WARMUP", Duration::from_millis(warmup))?,
            pick_duration: support::env_duration("PICK_DURATION", Duration::from_millis(pick))?,
            endpoint_keepalive: (!keepalive.is_zero()).then_some(keepalive),
            streams: support::env_number("STREAMS", streams)?,
            stream_events: support::env_number("STREAM_EVENTS", events)?,
            stream_gap: support::env_duration("STREAM_GAP", Duration::from_millis(gap))?,
        };
        ensure!(
            (1..=MAX_ENDPOINTS).contains(&settings.endpoints)
                && (1..settings.endpoints.max(2)).contains(&settings.baseline),
            "ENDPOINTS must be 1..={MAX_ENDPOINTS} and BASELINE between 1 and ENDPOINTS - 1"
        );
        ensure!(
            settings.clients > 0 && settings.streams > 0 && settings.stream_events > 0,
            "CLIENTS, STREAMS and STREAM_EVENTS must be at least 1"
        );
        Ok(settings)
    }
}

// ---------------------------------------------------------------------------------------------------
// The fake endpoints: one server for every loopback address.

/// What the fake endpoints saw during one tongs run.
struct Tally {
    epoch: Instant,
    /// Heartbeats by [`BUCKET`] of arrival since `epoch`.
    buckets: Vec<AtomicU32>,
    /// Heartbeats per endpoint of this run.
    heartbeats: Vec<AtomicU32>,
    /// When each endpoint's last heartbeat arrived, ms since `epoch` plus one (0: none yet).
    last_heartbeat: Vec<AtomicU32>,
    /// Heartbeats (from the third on) that came within [`QUICK`] of the endpoint's previous one: tongs
    /// probing again at its fast interval because the previous heartbeat failed (too slow, say).
    quick: AtomicU64,
    /// Heartbeats from outside this run's endpoints (none expected).
    strays: AtomicU64,
    /// Other requests (proxied ones).
    requests: AtomicU64,
}

impl Tally {
    fn new(endpoints: usize) -> Tally {
        Tally {
            epoch: Instant::now(),
            buckets: (0..BUCKETS).map(|_| AtomicU32::new(0)).collect(),
            heartbeats: (0..endpoints).map(|_| AtomicU32::new(0)).collect(),
            last_heartbeat: (0..endpoints).map(|_| AtomicU32::new(0)).collect(),
            quick: AtomicU64::new(0),
            strays: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        }
    }

    fn heartbeat(&self, endpoint: Option<usize>) {
        let now_ms = u32::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u32::MAX - 1);
        if let Some(count) = self
            .buckets
            .get(now_ms as usize / BUCKET.as_millis() as usize)
        {
            count.fetch_add(1, Ordering::Relaxed);
        }
        let Some(index) = endpoint.filter(|&index| index < self.heartbeats.len()) else {
            self.strays.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let count = self.heartbeats[index].fetch_add(1, Ordering::Relaxed) + 1;
        let previous = self.last_heartbeat[index].swap(now_ms + 1, Ordering::Relaxed);
        if count > 2 && now_ms + 1 - previous < QUICK.as_millis() as u32 {
            self.quick.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn per_endpoint(&self) -> Vec<u32> {
        self.heartbeats
            .iter()
            .map(|count| count.load(Ordering::Relaxed))
            .collect()
    }

    fn bucket_index(&self, at: Instant) -> usize {
        (at.saturating_duration_since(self.epoch).as_millis() / BUCKET.as_millis()) as usize
    }
}

/// Shared state of the fake endpoints' server.
struct EndpointsShared {
    tally: ArcSwap<Tally>,
    keepalive: Option<Duration>,
    /// Connections accepted, ever.
    accepted: AtomicU64,
    /// Connections open now.
    open: AtomicU64,
    /// accept() failures (this process out of file descriptors, say).
    accept_errors: AtomicU64,
}

struct FakeEndpoints {
    port: u16,
    shared: Arc<EndpointsShared>,
    tasks: Vec<JoinHandle<()>>,
}

impl FakeEndpoints {
    /// Listens on 0.0.0.0 on a free port, one SO_REUSEPORT listener per CPU with a deep backlog: a
    /// tongs that starts probes 10,000 endpoints within a fifth of a second.
    fn start(keepalive: Option<Duration>) -> Result<FakeEndpoints> {
        let shared = Arc::new(EndpointsShared {
            tally: ArcSwap::from_pointee(Tally::new(0)),
            keepalive,
            accepted: AtomicU64::new(0),
            open: AtomicU64::new(0),
            accept_errors: AtomicU64::new(0),
        });
        let cpus = support::cpus();
        let mut addr = SocketAddr::from(([0, 0, 0, 0], 0));
        let mut tasks = Vec::new();
        for _ in 0..cpus {
            let listener = support::reuseport_listener(addr)?;
            addr = listener.local_addr()?;
            tasks.push(tokio::spawn(accept_endpoints(
                listener,
                Arc::clone(&shared),
            )));
        }
        Ok(FakeEndpoints {
            port: addr.port(),
            shared,
            tasks,
        })
    }

    /// Starts counting afresh for a run of `endpoints` endpoints.
    fn new_run(&self, endpoints: usize) -> Arc<Tally> {
        let tally = Arc::new(Tally::new(endpoints));
        self.shared.tally.store(Arc::clone(&tally));
        tally
    }

    fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for FakeEndpoints {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn accept_endpoints(listener: TcpListener, shared: Arc<EndpointsShared>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                shared.accepted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve_endpoint(stream, Arc::clone(&shared)));
            }
            Err(_) => {
                // Counted and reported: out of file descriptors here would skew every figure.
                shared.accept_errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn serve_endpoint(stream: TcpStream, shared: Arc<EndpointsShared>) {
    // Which endpoint tongs meant: the loopback address it connected to.
    let endpoint = match stream.local_addr() {
        Ok(SocketAddr::V4(local)) => u32::from(*local.ip())
            .checked_sub(FIRST_ENDPOINT)
            .map(|index| index as usize),
        _ => None,
    };
    let _ = stream.set_nodelay(true);
    shared.open.fetch_add(1, Ordering::Relaxed);
    let counters = Arc::clone(&shared);
    let service = service_fn(move |request: Request<Incoming>| {
        let tally = counters.tally.load_full();
        async move {
            if request.uri().path() == "/health" {
                tally.heartbeat(endpoint);
            } else {
                tally.requests.fetch_add(1, Ordering::Relaxed);
            }
            // Read the body, so the connection stays reusable.
            let _ = request.into_body().collect().await;
            let mut response = Response::new(Full::new(Bytes::from_static(ANSWER)));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            Ok::<_, Infallible>(response)
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).keep_alive(true);
    // hyper's header-read timer also runs while a kept-alive connection waits for its next request,
    // so it is the idle timeout.
    builder.header_read_timeout(shared.keepalive);
    let _ = builder
        .serve_connection(TokioIo::new(stream), service)
        .await;
    shared.open.fetch_sub(1, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------------------
// Part A: one tongs run in front of the fake endpoints.

struct HeartbeatStats {
    window: Duration,
    heartbeats: u64,
    /// Per 100 ms bucket over the window: mean, p99, max.
    bucket_mean: f64,
    bucket_p99: u32,
    bucket_max: u32,
    /// Heartbeats per endpoint within the window, fewest and most.
    per_endpoint_min: u32,
    per_endpoint_max: u32,
    /// Endpoints with no heartbeat at all by the end of the window.
    never_probed: usize,
    strays: u64,
    /// Re-probes after a failed heartbeat (see [`QUICK`]) before the window, and within it.
    quick_before: u64,
    quick_in_window: u64,
    cpu: Duration,
    /// Of `cpu`, the part spent in the kernel.
    system_cpu: Duration,
}

impl HeartbeatStats {
    fn per_second(&self) -> f64 {
        self.heartbeats as f64 / self.window.as_secs_f64()
    }

    fn cpu_ms_per_second(&self) -> f64 {
        self.cpu.as_secs_f64() * 1000.0 / self.window.as_secs_f64()
    }
}

struct PickStats {
    duration: Duration,
    requests: u64,
    errors: u64,
    /// Latencies of the successes, microseconds, sorted.
    latencies_us: Vec<u32>,
    cpu: Duration,
    /// Connections the fake endpoints accepted during the phase (heartbeats' included).
    connections: u64,
    /// Requests the fake endpoints received (retries included).
    upstream_requests: u64,
}

impl PickStats {
    fn per_second(&self) -> f64 {
        self.requests as f64 / self.duration.as_secs_f64()
    }

    fn cpu_us_per_request(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.requests.max(1) as f64
    }

    fn latency_ms(&self, p: f64) -> f64 {
        percentile(&self.latencies_us, p).map_or(f64::NAN, |us| f64::from(us) / 1000.0)
    }
}

struct FleetRun {
    endpoints: usize,
    heartbeats_on: bool,
    ready_after: Duration,
    ready: Usage,
    /// From ready until every endpoint had a heartbeat, and the usage then.
    all_probed: Option<(Duration, Usage)>,
    /// With heartbeats off: the usage 1 s after ready, before any traffic.
    settled: Option<Usage>,
    heartbeats: Option<HeartbeatStats>,
    pick: Option<PickStats>,
    /// The most file descriptors and RSS seen while heartbeats and traffic ran.
    max_fds: u64,
    max_rss_kib: u64,
    end: Usage,
    /// tongs' open-file limit.
    fd_limit: Option<u64>,
}

impl FleetRun {
    /// Whether tongs ran out of file descriptors (or came within a few of the limit).
    fn reached_fd_limit(&self) -> bool {
        self.fd_limit
            .is_some_and(|limit| self.max_fds + 16 >= limit)
    }
}

fn tongs_config(endpoints: usize, port: u16, heartbeats: bool) -> String {
    let mut text = String::with_capacity(endpoints * 40 + 64);
    if !heartbeats {
        text.push_str("health: { enabled: false }\n");
    }
    text.push_str(&support::static_discovery(
        (0..endpoints).map(|index| format!("http://{}", endpoint_addr(index, port))),
    ));
    text
}

/// Samples a process's usage every 250 ms while it runs, keeping the most fds and RSS seen.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: JoinHandle<(u64, u64)>,
}

impl Sampler {
    fn start(pids: Vec<u32>) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let (mut fds, mut rss) = (0, 0);
            while !flag.load(Ordering::Relaxed) {
                let now = support::usage(&pids);
                fds = fds.max(now.fds);
                rss = rss.max(now.rss_kib);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            (fds, rss)
        });
        Sampler { stop, task }
    }

    async fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or((0, 0))
    }
}

async fn fleet_run(
    settings: &Settings,
    fake: &FakeEndpoints,
    endpoints: usize,
    heartbeats_on: bool,
) -> Result<FleetRun> {
    let config = tongs_config(endpoints, fake.port, heartbeats_on);
    let tally = fake.new_run(endpoints);
    let started = Instant::now();
    let tongs = TongsProcess::start(&config)
        .await
        .with_context(|| format!("tongs with {endpoints} endpoints"))?;
    let ready_after = started.elapsed();
    let ready = tongs.process.usage();
    let fd_limit = support::open_file_limits(tongs.process.pid()).map(|(soft, _)| soft);
    let mut run = FleetRun {
        endpoints,
        heartbeats_on,
        ready_after,
        ready,
        all_probed: None,
        settled: None,
        heartbeats: None,
        pick: None,
        max_fds: ready.fds,
        max_rss_kib: ready.rss_kib,
        end: ready,
        fd_limit,
    };
    let sampler = Sampler::start(tongs.process.pids());

    if heartbeats_on {
        observe_heartbeats(settings, &tongs, &tally, &mut run).await;
    } else {
        // The endpoints' own memory, no connections yet: let start-up settle, then read it.
        tokio::time::sleep(Duration::from_secs(1)).await;
        run.settled = Some(tongs.process.usage());
    }

    // The pick cost end to end: closed-loop clients, after a warm-up that is not counted.
    let _ = closed_loop(&tongs.url(), settings.clients, settings.pick_warmup).await;
    let accepted_before = fake.accepted();
    let upstream_before = tally.requests.load(Ordering::Relaxed);
    let cpu_before = tongs.process.usage().cpu;
    let load = closed_loop(&tongs.url(), settings.clients, settings.pick_duration).await;
    let cpu = tongs.process.usage().cpu.saturating_sub(cpu_before);
    run.pick = Some(PickStats {
        duration: load.duration,
        requests: load.latencies_us.len() as u64 + load.errors,
        errors: load.errors,
        latencies_us: load.latencies_us,
        cpu,
        connections: fake.accepted() - accepted_before,
        upstream_requests: tally.requests.load(Ordering::Relaxed) - upstream_before,
    });
    (run.max_fds, run.max_rss_kib) = sampler.finish().await;
    run.end = tongs.process.usage();
    run.max_fds = run.max_fds.max(run.end.fds);
    run.max_rss_kib = run.max_rss_kib.max(run.end.rss_kib);
    Ok(run)
}

/// Waits until every endpoint has had a heartbeat, then watches heartbeats alone for the window.
async fn observe_heartbeats(
    settings: &Settings,
    tongs: &TongsProcess,
    tally: &Tally,
    run: &mut FleetRun,
) {
    // Every endpoint heartbeated once (the first round is spread over a fifth of a second).
    let ready_at = Instant::now();
    let deadline = ready_at + Duration::from_secs(30);
    while tally.per_endpoint().contains(&0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if !tally.per_endpoint().contains(&0) {
        run.all_probed = Some((ready_at.elapsed(), tongs.process.usage()));
    }

    // Heartbeats alone, no traffic.
    let window_start = Instant::now();
    let before = tally.per_endpoint();
    let quick_before = tally.quick.load(Ordering::Relaxed);
    let cpu_before = tongs.process.usage().cpu;
    let system_before = system_cpu(tongs.process.pid());
    tokio::time::sleep(settings.heartbeat_window).await;
    let cpu = tongs.process.usage().cpu.saturating_sub(cpu_before);
    let system = system_cpu(tongs.process.pid()).saturating_sub(system_before);
    let window_end = Instant::now();
    let after = tally.per_endpoint();
    let in_window: Vec<u32> = after
        .iter()
        .zip(&before)
        .map(|(after, before)| after - before)
        .collect();
    // Whole buckets inside the window only.
    let first = tally.bucket_index(window_start) + 1;
    let last = tally.bucket_index(window_end).min(BUCKETS);
    let mut buckets: Vec<u32> = tally.buckets[first.min(last)..last]
        .iter()
        .map(|count| count.load(Ordering::Relaxed))
        .collect();
    buckets.sort_unstable();
    let bucket_mean =
        buckets.iter().map(|&c| f64::from(c)).sum::<f64>() / buckets.len().max(1) as f64;
    run.heartbeats = Some(HeartbeatStats {
        window: window_end - window_start,
        heartbeats: in_window.iter().map(|&c| u64::from(c)).sum(),
        bucket_mean,
        bucket_p99: percentile(&buckets, 99.0).unwrap_or(0),
        bucket_max: buckets.last().copied().unwrap_or(0),
        per_endpoint_min: in_window.iter().copied().min().unwrap_or(0),
        per_endpoint_max: in_window.iter().copied().max().unwrap_or(0),
        never_probed: after.iter().filter(|&&count| count == 0).count(),
        strays: tally.strays.load(Ordering::Relaxed),
        quick_before,
        quick_in_window: tally.quick.load(Ordering::Relaxed) - quick_before,
        cpu,
        system_cpu: system,
    });
}

/// A process's CPU time in the kernel (stime, all threads), from /proc.
fn system_cpu(pid: u32) -> Duration {
    let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // Fields after the command name: state is the first, stime the 13th.
            let (_, rest) = stat.rsplit_once(") ")?;
            rest.split_whitespace().nth(12)?.parse::<u64>().ok()
        })
        .unwrap_or(0);
    Duration::from_secs_f64(ticks as f64 / support::clock_ticks())
}

struct Load {
    duration: Duration,
    latencies_us: Vec<u32>,
    errors: u64,
}

/// `clients` clients, each sending its next request as soon as its last one is answered, for `duration`.
async fn closed_loop(url: &str, clients: usize, duration: Duration) -> Load {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(clients)
        .build_http();
    let uri: http::Uri = format!("{url}/v1/completions")
        .parse()
        .expect("a valid URL");
    let started = Instant::now();
    let until = started + duration;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let client = client.clone();
            let uri = uri.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0u64;
                while Instant::now() < until {
                    let request = Request::post(uri.clone())
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Full::new(Bytes::from_static(
                            br#"{"prompt":"hi","max_tokens":1}"#,
                        )))
                        .expect("a valid request");
                    let sent = Instant::now();
                    let outcome = tokio::time::timeout(Duration::from_secs(30), async {
                        let response = client.request(request).await.ok()?;
                        let status = response.status();
                        response.into_body().collect().await.ok()?;
                        Some(status)
                    })
                    .await;
                    match outcome {
                        Ok(Some(StatusCode::OK)) => latencies
                            .push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX)),
                        _ => errors += 1,
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut load = Load {
        duration: Duration::ZERO,
        latencies_us: Vec::new(),
        errors: 0,
    };
    for task in tasks {
        if let Ok((latencies, errors)) = task.await {
            load.latencies_us.extend(latencies);
            load.errors += errors;
        }
    }
    load.duration = started.elapsed();
    load.latencies_us.sort_unstable();
    load
}

// ---------------------------------------------------------------------------------------------------
// Part B: the SSE upstream, the streaming clients, nginx.

type SseBody = UnsyncBoxBody<Bytes, Infallible>;

/// Shared state of the SSE upstream.
struct SseShared {
    events: u32,
    gap: Duration,
    /// Streams being sent now.
    open: AtomicU64,
    /// Streams that sent every event.
    completed: AtomicU64,
    /// Streams whose reader went away before the end.
    cut: AtomicU64,
}

struct SseUpstream {
    addr: SocketAddr,
    shared: Arc<SseShared>,
    task: JoinHandle<()>,
}

impl SseUpstream {
    async fn start(events: u32, gap: Duration) -> Result<SseUpstream> {
        let listener = support::reuseport_listener(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(SseShared {
            events,
            gap,
            open: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cut: AtomicU64::new(0),
        });
        let serving = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let shared = Arc::clone(&serving);
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    let service = service_fn(move |request: Request<Incoming>| {
                        let shared = Arc::clone(&shared);
                        async move { Ok::<_, Infallible>(sse_answer(&request, shared)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(SseUpstream { addr, shared, task })
    }

    fn open(&self) -> u64 {
        self.shared.open.load(Ordering::Relaxed)
    }
}

impl Drop for SseUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `/health` → 200; anything else → a stream of `events` events (`?events=K` overrides), `gap` apart,
/// the first at once (tongs commits a response on its first bytes).
fn sse_answer(request: &Request<Incoming>, shared: Arc<SseShared>) -> Response<SseBody> {
    if request.uri().path() == "/health" {
        return Response::new(Full::new(Bytes::from_static(b"ok")).boxed_unsync());
    }
    let events = request
        .uri()
        .query()
        .and_then(|query| query.strip_prefix("events="))
        .and_then(|count| count.parse().ok())
        .unwrap_or(shared.events);
    let (mut sender, body) = http_body_util::channel::Channel::<Bytes, Infallible>::new(4);
    shared.open.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(async move {
        let mut sent_all = true;
        for n in 0..events {
            if n > 0 {
                tokio::time::sleep(shared.gap).await;
            }
            let event = format!("data: {{\"n\":{n}}}\n\n");
            if sender.send_data(Bytes::from(event)).await.is_err() {
                sent_all = false;
                break;
            }
        }
        drop(sender);
        let outcome = if sent_all {
            &shared.completed
        } else {
            &shared.cut
        };
        outcome.fetch_add(1, Ordering::Relaxed);
        shared.open.fetch_sub(1, Ordering::Relaxed);
    });
    tongs::sim::sse_response(body.boxed_unsync())
}

/// One streaming request on its own connection: the event numbers received, in order, once the stream
/// ended cleanly. `started` counts streams whose first event arrived.
async fn one_stream(addr: SocketAddr, path: String, started: Arc<AtomicU64>) -> Result<Vec<u32>> {
    let stream = TcpStream::connect(addr).await.context("connect")?;
    stream.set_nodelay(true)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let request = Request::get(path)
        .header(header::HOST, "scale.bench")
        .header(header::ACCEPT, "text/event-stream")
        .body(Empty::<Bytes>::new())?;
    let response = sender.send_request(request).await.context("request")?;
    ensure!(
        response.status() == StatusCode::OK,
        "status {}",
        response.status()
    );
    let mut body = response.into_body();
    let mut text = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.context("stream broken")?;
        if let Ok(data) = frame.into_data() {
            if text.is_empty() {
                started.fetch_add(1, Ordering::Relaxed);
            }
            text.extend_from_slice(&data);
        }
    }
    let text = String::from_utf8(text).context("not UTF-8")?;
    text.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            event
                .strip_prefix("data: {\"n\":")
                .and_then(|rest| rest.strip_suffix('}'))
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("unexpected event {event:?}"))
        })
        .collect()
}

struct StreamRun {
    proxy: String,
    streams: usize,
    /// Streams that ended cleanly with every event in order.
    complete: usize,
    /// The first few failures, for the report.
    failures: Vec<String>,
    upstream_completed: u64,
    upstream_cut: u64,
    idle: Usage,
    /// Sampled once the upstream held every stream open (and still did after the sample).
    with_streams: Option<Usage>,
    open_after: Duration,
    peak_rss_kib: u64,
}

/// Opens `streams` streams through the proxy at `addr`, samples `pids` once all are open, and waits
/// for every stream to end.
async fn stream_run(
    proxy: &str,
    addr: SocketAddr,
    pids: &[u32],
    upstream: &SseUpstream,
    settings: &Settings,
) -> Result<StreamRun> {
    // One short stream first, so one-time set-up (the worker's pool, buffers) is in the idle figure.
    let warm = Arc::new(AtomicU64::new(0));
    for _ in 0..2 {
        one_stream(addr, "/v1/stream?events=1".into(), Arc::clone(&warm))
            .await
            .with_context(|| format!("a warm-up stream through {proxy}"))?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = support::usage(pids);
    let completed_before = upstream.shared.completed.load(Ordering::Relaxed);
    let cut_before = upstream.shared.cut.load(Ordering::Relaxed);
    let started = Arc::new(AtomicU64::new(0));
    let opened = Instant::now();
    let tasks: Vec<_> = (0..settings.streams)
        .map(|_| {
            let started = Arc::clone(&started);
            tokio::spawn(one_stream(addr, "/v1/stream".into(), started))
        })
        .collect();
    let wanted = settings.streams as u64;
    let deadline = opened + Duration::from_secs(30);
    while (upstream.open() < wanted || started.load(Ordering::Relaxed) < wanted)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let open_after = opened.elapsed();
    let mut with_streams = None;
    if upstream.open() >= wanted && started.load(Ordering::Relaxed) >= wanted {
        // Let the last streams' buffers settle (less in the smoke run, whose streams are short).
        tokio::time::sleep(settings.stream_gap.min(Duration::from_secs(1)) / 2).await;
        let sample = support::usage(pids);
        if upstream.open() >= wanted {
            with_streams = Some(sample);
        }
    }
    let mut complete = 0;
    let mut failures = Vec::new();
    let expected: Vec<u32> = (0..settings.stream_events).collect();
    for task in tasks {
        let outcome = match task.await {
            Ok(Ok(events)) if events == expected => Ok(()),
            Ok(Ok(events)) => Err(format!(
                "{} events of {} (or out of order)",
                events.len(),
                expected.len()
            )),
            Ok(Err(err)) => Err(format!("{err:#}")),
            Err(err) => Err(err.to_string()),
        };
        match outcome {
            Ok(()) => complete += 1,
            Err(why) if failures.len() < 5 => failures.push(why),
            Err(_) => {}
        }
    }
    let end = support::usage(pids);
    Ok(StreamRun {
        proxy: proxy.to_owned(),
        streams: settings.streams,
        complete,
        failures,
        upstream_completed: upstream.shared.completed.load(Ordering::Relaxed) - completed_before,
        upstream_cut: upstream.shared.cut.load(Ordering::Relaxed) - cut_before,
        idle,
        with_streams,
        open_after,
        peak_rss_kib: end.peak_rss_kib,
    })
}

async fn tongs_streams(settings: &Settings, upstream: &SseUpstream) -> Result<StreamRun> {
    let config = support::static_discovery([format!("http://{}", upstream.addr)]);
    let tongs = TongsProcess::start(&config)
        .await
        .context("tongs for streams")?;
    stream_run(
        "tongs",
        tongs.addr,
        &tongs.process.pids(),
        upstream,
        settings,
    )
    .await
}

async fn nginx_streams(
    nginx: &std::path::Path,
    settings: &Settings,
    upstream: &SseUpstream,
) -> Result<StreamRun> {
    let nginx = NginxSse::start(nginx, &[upstream.addr], settings.streams, "scale-nginx").await?;
    stream_run(
        &nginx.label,
        nginx.addr,
        &nginx.process.pids(),
        upstream,
        settings,
    )
    .await
}

// ---------------------------------------------------------------------------------------------------
// Report.

fn kib_per(delta_kib: f64, count: usize) -> String {
    format!("{:.2} KiB", delta_kib / count.max(1) as f64)
}

fn print_fleet(settings: &Settings, runs: &[FleetRun]) {
    println!("### Part A: endpoints\n");
    println!(
        "| endpoints | heartbeats | start → /readyz | RSS ready | every endpoint heartbeated after | RSS then | \
         RSS at the end | peak RSS | fds at the end | most fds seen | threads |"
    );
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for run in runs {
        let (probed_after, probed_rss) = match &run.all_probed {
            Some((after, usage)) => (seconds(*after), mib(usage.rss_kib)),
            None if run.heartbeats_on => ("not within 30 s".into(), "—".into()),
            None => ("—".into(), "—".into()),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            run.endpoints,
            if run.heartbeats_on { "on" } else { "off" },
            seconds(run.ready_after),
            mib(run.ready.rss_kib),
            probed_after,
            probed_rss,
            mib(run.end.rss_kib),
            mib(run.end.peak_rss_kib),
            run.end.fds,
            run.max_fds,
            run.end.threads,
        );
    }
    let Some((baseline, scaled)) = runs.split_first() else {
        return;
    };
    let with_heartbeats: Vec<&FleetRun> = scaled.iter().filter(|run| run.heartbeats_on).collect();
    println!(
        "\nMemory per endpoint, (RSS at N − RSS at {}) / (N − {}), and file descriptors per endpoint:\n",
        baseline.endpoints, baseline.endpoints
    );
    println!(
        "| N | once ready | once every endpoint had a heartbeat | at the end (after the traffic) | peak | \
         fds per endpoint at the end |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    for run in scaled {
        let span = run.endpoints.saturating_sub(baseline.endpoints);
        let per = |at_n: u64, base: u64| kib_per(at_n as f64 - base as f64, span);
        let probed = match (&baseline.all_probed, &run.all_probed) {
            (Some((_, base)), Some((_, at_n))) => per(at_n.rss_kib, base.rss_kib),
            _ => "—".into(),
        };
        let ready = match &run.settled {
            // Against the baseline once ready: neither had connections to speak of then.
            Some(settled) => per(settled.rss_kib, baseline.ready.rss_kib),
            None => per(run.ready.rss_kib, baseline.ready.rss_kib),
        };
        println!(
            "| {}{} | {} | {} | {} | {} | {:.2} |",
            run.endpoints,
            if run.heartbeats_on {
                ""
            } else {
                ", heartbeats off (\"once ready\": 1 s after)"
            },
            ready,
            probed,
            per(run.end.rss_kib, baseline.end.rss_kib),
            per(run.end.peak_rss_kib, baseline.end.peak_rss_kib),
            (run.end.fds as f64 - baseline.end.fds as f64) / span.max(1) as f64,
        );
    }
    for run in runs.iter().filter(|run| run.reached_fd_limit()) {
        println!(
            "\n**At {} endpoints tongs reached its open-file limit** ({} fds seen, limit {}): its figures \
             after that describe the limit, not tongs.",
            run.endpoints,
            run.max_fds,
            run.fd_limit.unwrap_or(0),
        );
    }

    println!(
        "\nHeartbeats over {} with no traffic (every 2 s ±10 % per endpoint; expected N / 2 s):\n",
        seconds(settings.heartbeat_window)
    );
    println!(
        "| endpoints | heartbeats | per second | expected per second | observed / expected | per 100 ms: mean | p99 | \
         max | max / mean | never probed | per endpoint in the window, min..max | re-probes after a failed \
         heartbeat: before the window, in it | tongs CPU | of it in the kernel |"
    );
    println!(
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"
    );
    for run in runs {
        let Some(hb) = &run.heartbeats else {
            continue;
        };
        let expected = run.endpoints as f64 / 2.0;
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.3} | {:.1} | {} | {} | {:.2} | {} | {}..{} | {}, {} | {:.1} ms/s ({:.1} % of a core) | {:.0} % |",
            run.endpoints,
            hb.heartbeats,
            hb.per_second(),
            expected,
            hb.per_second() / expected,
            hb.bucket_mean,
            hb.bucket_p99,
            hb.bucket_max,
            f64::from(hb.bucket_max) / hb.bucket_mean.max(f64::MIN_POSITIVE),
            hb.never_probed,
            hb.per_endpoint_min,
            hb.per_endpoint_max,
            hb.quick_before,
            hb.quick_in_window,
            hb.cpu_ms_per_second(),
            hb.cpu_ms_per_second() / 10.0,
            hb.system_cpu.as_secs_f64() * 100.0 / hb.cpu.as_secs_f64().max(f64::MIN_POSITIVE),
        );
        if hb.strays > 0 {
            println!(
                "(note: {} heartbeats came from addresses outside the run's endpoints)",
                hb.strays
            );
        }
    }
    if let Some(base) = &baseline.heartbeats {
        println!();
        for run in &with_heartbeats {
            let Some(at_n) = &run.heartbeats else {
                continue;
            };
            let extra_cpu = at_n.cpu_ms_per_second() - base.cpu_ms_per_second();
            let extra_rate = at_n.per_second() - base.per_second();
            println!(
                "Heartbeats' own cost at {} endpoints: {:.1} ms of CPU per second more than at {} ({:.1} % of a \
                 core), {:.1} µs per heartbeat.",
                run.endpoints,
                extra_cpu,
                baseline.endpoints,
                extra_cpu / 10.0,
                extra_cpu * 1000.0 / extra_rate.max(f64::MIN_POSITIVE),
            );
        }
    }

    println!(
        "\nPick cost end to end: {} closed-loop clients, POST /v1/completions through tongs for {} after {} \
         of the same not counted (heartbeats running):\n",
        settings.clients,
        seconds(settings.pick_duration),
        seconds(settings.pick_warmup)
    );
    println!(
        "| endpoints | requests | errors | req/s | p50 | p99 | tongs CPU per request | of it heartbeats | \
         upstream requests per request | upstream connections opened per request |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for run in runs {
        let Some(pick) = &run.pick else {
            continue;
        };
        let heartbeat_share = run.heartbeats.as_ref().map_or(0.0, |hb| {
            hb.cpu_ms_per_second() * pick.duration.as_secs_f64() * 1000.0
                / pick.requests.max(1) as f64
        });
        println!(
            "| {}{} | {} | {} | {:.0} | {:.2} ms | {:.2} ms | {:.1} µs | {:.1} µs | {:.3} | {:.3} |",
            run.endpoints,
            if run.heartbeats_on {
                ""
            } else {
                ", heartbeats off"
            },
            pick.requests,
            pick.errors,
            pick.per_second(),
            pick.latency_ms(50.0),
            pick.latency_ms(99.0),
            pick.cpu_us_per_request(),
            heartbeat_share,
            pick.upstream_requests as f64 / pick.requests.max(1) as f64,
            pick.connections as f64 / pick.requests.max(1) as f64,
        );
    }
    if let Some(base) = &baseline.pick {
        for run in scaled {
            let Some(at_n) = &run.pick else {
                continue;
            };
            println!(
                "| ratio {}{} / {} | | | {:.2}× | {:.2}× | {:.2}× | {:.2}× | | | |",
                run.endpoints,
                if run.heartbeats_on {
                    ""
                } else {
                    ", heartbeats off"
                },
                baseline.endpoints,
                at_n.per_second() / base.per_second(),
                at_n.latency_ms(50.0) / base.latency_ms(50.0),
                at_n.latency_ms(99.0) / base.latency_ms(99.0),
                at_n.cpu_us_per_request() / base.cpu_us_per_request(),
            );
        }
    }
    println!(
        "\nThe pick alone, in process, at 8, 64 and 10,000 endpoints: `cargo bench --bench pick`."
    );
}

fn print_streams(settings: &Settings, runs: &[StreamRun], nginx_note: Option<&str>) {
    println!(
        "\n### Part B: {} concurrent SSE streams, {} events each, {} apart\n",
        settings.streams,
        settings.stream_events,
        seconds(settings.stream_gap)
    );
    println!(
        "| proxy | streams | ended cleanly with every event | all open after | idle RSS | RSS with streams | \
         memory per stream | peak RSS | idle fds | fds with streams | fds per stream | threads |"
    );
    println!(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for run in runs {
        let (rss, per_stream, fds, fds_per, threads) = match &run.with_streams {
            Some(usage) => (
                mib(usage.rss_kib),
                kib_per(usage.rss_kib as f64 - run.idle.rss_kib as f64, run.streams),
                usage.fds.to_string(),
                format!(
                    "{:.2}",
                    (usage.fds as f64 - run.idle.fds as f64) / run.streams as f64
                ),
                usage.threads.to_string(),
            ),
            None => (
                "not all open".into(),
                "—".into(),
                "—".into(),
                "—".into(),
                run.idle.threads.to_string(),
            ),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            run.proxy,
            run.streams,
            run.complete,
            seconds(run.open_after),
            mib(run.idle.rss_kib),
            rss,
            per_stream,
            mib(run.peak_rss_kib),
            run.idle.fds,
            fds,
            fds_per,
            threads,
        );
    }
    for run in runs {
        println!(
            "\n{}: the upstream sent every event of {} streams, {} were cut before the end.",
            run.proxy, run.upstream_completed, run.upstream_cut
        );
        for failure in &run.failures {
            println!("  failed stream: {failure}");
        }
    }
    if let Some(note) = nginx_note {
        println!("\n{note}");
    }
    if let [tongs, nginx] = runs
        && let (Some(t), Some(n)) = (&tongs.with_streams, &nginx.with_streams)
    {
        let tongs_delta = t.rss_kib as f64 - tongs.idle.rss_kib as f64;
        let nginx_delta = n.rss_kib as f64 - nginx.idle.rss_kib as f64;
        println!(
            "\nMemory per stream, tongs / nginx: {:.2}× ({} / {}); RSS with streams, tongs / nginx (master and \
             workers summed, shared pages counted in each): {:.2}×.",
            tongs_delta / nginx_delta,
            kib_per(tongs_delta, tongs.streams),
            kib_per(nginx_delta, nginx.streams),
            t.rss_kib as f64 / n.rss_kib as f64,
        );
    }
}

// ---------------------------------------------------------------------------------------------------

async fn run(settings: Settings) -> Result<()> {
    let started = Instant::now();
    println!("date: {}", support::now_utc());
    println!("machine: {}", support::machine());
    println!("load average (1 min) at the start: {}", load_average());
    println!(
        "scenario: tongs ({} binary, own process, defaults: heartbeats every 2 s ±10 %, one worker per CPU) \
         in front of {} and {} fake endpoints on 127.1.0.0+ (one server in the bench process, idle connections \
         closed after {}); {} closed-loop clients for {} after {} of warm-up; heartbeats observed for {}; then {} SSE streams through \
         tongs and nginx. The bench's clients and servers share the CPUs with the proxy.",
        if settings.full { "release" } else { "debug" },
        settings.baseline,
        settings.endpoints,
        settings
            .endpoint_keepalive
            .map_or_else(|| "never".into(), seconds),
        settings.clients,
        seconds(settings.pick_duration),
        seconds(settings.pick_warmup),
        seconds(settings.heartbeat_window),
        settings.streams,
    );
    println!();

    let fake = FakeEndpoints::start(settings.endpoint_keepalive)?;
    let mut runs = vec![
        fleet_run(&settings, &fake, settings.baseline, true).await?,
        fleet_run(&settings, &fake, settings.endpoints, true).await?,
    ];
    // Out of file descriptors, the figures at N describe the limit rather than tongs: measure again at
    // the largest round size whose connections fit (one per worker each; heartbeats share them).
    if let Some(limit) = runs[1].fd_limit
        && runs[1].reached_fd_limit()
    {
        let cpus = support::cpus() as u64;
        let fits = (limit.saturating_sub(500) / cpus / 1000 * 1000) as usize;
        if fits > settings.baseline && fits < settings.endpoints {
            runs.push(fleet_run(&settings, &fake, fits, true).await?);
        }
    }
    // Heartbeats off: the endpoints' own memory, and the pick cost without heartbeats' CPU (at the
    // size that fits, if N did not).
    let largest_fitting = runs.last().map_or(settings.endpoints, |run| run.endpoints);
    runs.push(fleet_run(&settings, &fake, largest_fitting, false).await?);
    print_fleet(&settings, &runs);
    let accept_errors = fake.shared.accept_errors.load(Ordering::Relaxed);
    if accept_errors > 0 {
        println!(
            "\n**The fake endpoints failed to accept {accept_errors} times** (the bench process out of file \
             descriptors?): heartbeats and requests may have failed for the bench's sake, not tongs'."
        );
    }
    drop(fake);

    let upstream = SseUpstream::start(settings.stream_events, settings.stream_gap).await?;
    let mut streams = vec![tongs_streams(&settings, &upstream).await?];
    let nginx_note = match support::find_program("nginx") {
        Some(nginx) => {
            streams.push(nginx_streams(&nginx, &settings, &upstream).await?);
            None
        }
        None => Some(
            "The nginx baseline was NOT measured: no `nginx` on PATH or in /usr/sbin (install the Debian \
             package nginx, or run `bash benches/mixed.sh` once, which installs it).",
        ),
    };
    print_streams(&settings, &streams, nginx_note);
    println!(
        "\nload average (1 min) at the end: {}; the whole run took {}.",
        load_average(),
        seconds(started.elapsed())
    );

    if !settings.full {
        check_smoke(&runs, &streams)?;
        println!("\nscale smoke run: mechanics OK");
    }
    Ok(())
}

/// The smoke run's checks: correctness of the mechanics only, never timing.
fn check_smoke(runs: &[FleetRun], streams: &[StreamRun]) -> Result<()> {
    for run in runs.iter().filter(|run| run.heartbeats_on) {
        let Some(hb) = &run.heartbeats else {
            bail!("{} endpoints: no heartbeat figures", run.endpoints);
        };
        ensure!(
            run.all_probed.is_some() && hb.never_probed == 0,
            "{} endpoints: {} never got a heartbeat",
            run.endpoints,
            hb.never_probed
        );
        ensure!(
            hb.strays == 0,
            "{} heartbeats from unknown addresses",
            hb.strays
        );
    }
    for run in runs {
        let Some(pick) = &run.pick else {
            bail!("{} endpoints: no pick figures", run.endpoints);
        };
        ensure!(
            pick.requests > 0 && pick.errors == 0,
            "{} endpoints: {} of {} requests failed",
            run.endpoints,
            pick.errors,
            pick.requests
        );
    }
    for run in streams {
        ensure!(
            run.complete == run.streams && run.upstream_cut == 0,
            "{}: {} of {} streams ended cleanly with every event ({} cut): {:?}",
            run.proxy,
            run.complete,
            run.streams,
            run.upstream_cut,
            run.failures
        );
        ensure!(
            run.with_streams.is_some(),
            "{}: the upstream never held every stream open at once",
            run.proxy
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it, and then
    // gets the smoke run.
    let full = support::benchmarking();
    let settings = Settings::from_env(full)?;
    if !full {
        println!(
            "scale: smoke run ({} endpoints, {} streams); the benchmark is `cargo bench --bench scale`",
            settings.endpoints, settings.streams
        );
    }
    support::block_on(run(settings))
}

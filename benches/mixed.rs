//! The mixed-fleet scenario of the balancing work: one simulated fleet of six nodes whose mean service
//! times range from 20 ms to 600 ms, under open-loop load at a share of its capacity, through tongs with
//! `balancer.policy: expected-latency`, through tongs with `least-outstanding`, and through nginx
//! (`least_conn`), one after the other against the same fleet. Prints the machine, the scenario and a
//! markdown table of what the clients saw, then each node's share of the requests.
//!
//!     cargo bench --bench mixed                      # 60 s per contender
//!     DURATION=10s LOAD=0.6 cargo bench --bench mixed
//!
//! Environment: DURATION (default 60s), LOAD (offered load as a share of the fleet's capacity, default
//! 0.6), WARMUP (unrecorded load before each measurement, default 5s), CONTENDERS (any of
//! `expected-latency least-outstanding nginx`, default all three). `bash benches/mixed.sh` installs
//! nginx when it is missing; without it the nginx row is skipped with a note. Under
//! `cargo test --all-targets` (no `--bench` argument) nothing runs.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::config::Config;
use tongs::demo::{LoadGenerator, LoadPlan, Outcome};
use tongs::sim::{Fleet, FleetConfig, NodeSpec, ResponseKind};

/// The fleet, fastest first: name and mean service time in milliseconds.
const NODES: [(&str, u64); 6] = [
    ("n20", 20),
    ("n40", 40),
    ("n80", 80),
    ("n150", 150),
    ("n300", 300),
    ("n600", 600),
];
/// Requests each node serves at once.
const CAPACITY: usize = 4;
/// Requests each node lets wait for capacity before it answers 503: generous, so nodes queue.
const NODE_QUEUE: usize = 64;
/// Lognormal spread of every node's service time.
const SPREAD: f64 = 0.3;
const SEED: u64 = 1;
/// A client gives up on a request after this long.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Between two contenders: the fleet is idle, then rests this long.
const REST: Duration = Duration::from_secs(3);
/// The scenario's goal: expected-latency's p99 at most this share of least-outstanding's.
const TARGET_RATIO: f64 = 0.5;
const DEFAULT_CONTENDERS: &str = "expected-latency least-outstanding nginx";

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it.
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("mixed: a load benchmark; run it with `cargo bench --bench mixed`");
        return Ok(());
    }
    let settings = Settings::from_env()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(run(settings))
}

struct Settings {
    duration: Duration,
    warmup: Duration,
    load: f64,
    contenders: Vec<Contender>,
}

impl Settings {
    fn from_env() -> Result<Settings> {
        let duration = duration_from_env("DURATION", Duration::from_secs(60))?;
        if duration < Duration::from_secs(1) {
            bail!("DURATION is too short: at least 1s");
        }
        let warmup = duration_from_env("WARMUP", Duration::from_secs(5))?;
        let load = match std::env::var("LOAD") {
            Ok(text) => {
                let load: f64 = text
                    .trim()
                    .parse()
                    .with_context(|| format!("LOAD={text:?} is not a number such as 0.6"))?;
                if !(load > 0.0 && load <= 2.0) {
                    bail!("LOAD={text:?} must be above 0 and at most 2 (a share of capacity)");
                }
                load
            }
            Err(_) => 0.6,
        };
        let text = std::env::var("CONTENDERS").unwrap_or_else(|_| DEFAULT_CONTENDERS.to_owned());
        let contenders = text
            .split_whitespace()
            .map(Contender::parse)
            .collect::<Result<Vec<_>>>()?;
        if contenders.is_empty() {
            bail!("CONTENDERS is empty (known: {DEFAULT_CONTENDERS})");
        }
        Ok(Settings {
            duration,
            warmup,
            load,
            contenders,
        })
    }
}

fn duration_from_env(name: &str, default: Duration) -> Result<Duration> {
    let Ok(text) = std::env::var(name) else {
        return Ok(default);
    };
    let text = text.trim();
    match text.parse::<u64>() {
        Ok(seconds) => Ok(Duration::from_secs(seconds)),
        Err(_) => humantime::parse_duration(text)
            .with_context(|| format!("{name}={text:?} is not a duration such as 60s")),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contender {
    ExpectedLatency,
    LeastOutstanding,
    Nginx,
}

impl Contender {
    fn parse(name: &str) -> Result<Contender> {
        Ok(match name {
            "expected-latency" => Contender::ExpectedLatency,
            "least-outstanding" => Contender::LeastOutstanding,
            "nginx" => Contender::Nginx,
            other => bail!("CONTENDERS: unknown contender {other:?} (known: {DEFAULT_CONTENDERS})"),
        })
    }
}

/// The fleet's capacity: Σ capacity ÷ mean service time, in requests per second.
fn fleet_capacity() -> f64 {
    NODES
        .iter()
        .map(|&(_, mean_ms)| CAPACITY as f64 * 1000.0 / mean_ms as f64)
        .sum()
}

fn fleet_config() -> FleetConfig {
    FleetConfig {
        seed: SEED,
        nodes: NODES
            .iter()
            .map(|&(name, mean_ms)| {
                let mut spec = NodeSpec::new(name, Duration::from_millis(mean_ms));
                spec.service_time.spread = SPREAD;
                spec.capacity = CAPACITY;
                spec.queue = NODE_QUEUE;
                spec.response = ResponseKind::Json;
                spec
            })
            .collect(),
    }
}

/// What one contender's measured window showed.
struct Run {
    label: String,
    contender: Contender,
    sent: u64,
    succeeded: u64,
    /// Everything but successes, by kind (tongs' own refusals included).
    errors: BTreeMap<String, u64>,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    /// Requests each node completed during the window, in fleet order.
    served: Vec<u64>,
}

async fn run(settings: Settings) -> Result<()> {
    let capacity = fleet_capacity();
    let rate = capacity * settings.load;
    println!(
        "date: {}",
        humantime::format_rfc3339_seconds(SystemTime::now())
    );
    println!("machine: {}", machine());
    println!(
        "scenario: 6 nodes, mean service {} ms (lognormal spread {SPREAD}), capacity {CAPACITY} each, \
         node queue {NODE_QUEUE}, no interruptions, JSON answers; fleet capacity {capacity:.1} req/s; \
         open loop at {rate:.1} req/s ({:.0} % of capacity) for {} s per contender after {} s of warm-up; \
         same fleet for every contender; target: expected-latency p99 ≤ {TARGET_RATIO}× least-outstanding p99",
        NODES
            .iter()
            .map(|(_, mean)| mean.to_string())
            .collect::<Vec<_>>()
            .join("/"),
        settings.load * 100.0,
        settings.duration.as_secs_f64(),
        settings.warmup.as_secs_f64(),
    );

    let fleet = Fleet::start(&fleet_config(), Duration::from_secs(24 * 3600))
        .await
        .context("starting the simulated fleet")?;
    let mut runs = Vec::new();
    for &contender in &settings.contenders {
        rest(&fleet).await;
        let run = match contender {
            Contender::ExpectedLatency | Contender::LeastOutstanding => {
                run_tongs(contender, &fleet, rate, &settings).await
            }
            Contender::Nginx => match find_nginx() {
                Some(nginx) => run_nginx(&nginx, &fleet, rate, &settings).await,
                None => {
                    println!(
                        "note: nginx skipped: no `nginx` on PATH or in /usr/sbin (bash benches/mixed.sh installs it)"
                    );
                    continue;
                }
            },
        };
        runs.push(run?);
    }
    println!();
    print_table(&runs);
    println!();
    print_shares(&runs);
    Ok(())
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, model)| model.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    format!("{cpus} CPUs, {model}")
}

/// Waits until no request is left at any node (at most a minute), then lets the fleet rest.
async fn rest(fleet: &Fleet) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while fleet.nodes().iter().any(|node| node.stats().in_flight > 0)
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(REST).await;
}

fn served(fleet: &Fleet) -> Vec<u64> {
    fleet
        .nodes()
        .iter()
        .map(|node| node.stats().served)
        .collect()
}

/// Offers the open loop to `target`: `warmup` unrecorded, then `duration` recorded, with no gap
/// between the two. A node's share counts what it completed from the start of the recorded window
/// until the last recorded request ended (warm-up requests still running at the switch land in it:
/// a fraction of a second's worth).
async fn measure(
    label: String,
    contender: Contender,
    target: &str,
    fleet: &Fleet,
    rate: f64,
    settings: &Settings,
) -> Run {
    eprintln!("mixed: running {label} for {:?}", settings.duration);
    let plan = |duration| LoadPlan {
        target: target.to_owned(),
        rps: rate,
        duration,
        stream_every: 0,
        client_timeout: CLIENT_TIMEOUT,
        settle: CLIENT_TIMEOUT + Duration::from_secs(5),
    };
    let (warmup_plan, measured_plan) = (plan(settings.warmup), plan(settings.duration));
    let (warmup, measured) = (LoadGenerator::default(), LoadGenerator::default());
    let stop = CancellationToken::new();
    let warm = async {
        if !settings.warmup.is_zero() {
            warmup.run(&warmup_plan, stop.clone()).await;
        }
    };
    let recorded = async {
        tokio::time::sleep(settings.warmup).await;
        let before = served(fleet);
        measured.run(&measured_plan, stop.clone()).await;
        let after = served(fleet);
        after
            .iter()
            .zip(&before)
            .map(|(after, before)| after.saturating_sub(*before))
            .collect::<Vec<_>>()
    };
    let ((), served) = tokio::join!(warm, recorded);
    measured.with(|recorder| {
        let succeeded = recorder.count(Outcome::Succeeded);
        let mut errors = recorder.failures();
        let rejected = recorder.count(Outcome::Rejected);
        if rejected > 0 {
            errors.insert("rejected".to_owned(), rejected);
        }
        Run {
            label,
            contender,
            sent: recorder.sent(),
            succeeded,
            errors,
            p50: recorder.latency_ms(0.50),
            p90: recorder.latency_ms(0.90),
            p99: recorder.latency_ms(0.99),
            max: recorder.max_latency_ms(),
            served,
        }
    })
}

// ---------------------------------------------------------------------------------------------------
// tongs in this process.

async fn run_tongs(
    contender: Contender,
    fleet: &Fleet,
    rate: f64,
    settings: &Settings,
) -> Result<Run> {
    let policy = match contender {
        Contender::LeastOutstanding => "least-outstanding",
        _ => "expected-latency",
    };
    let mut text = format!(
        "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\n\
         balancer: {{ policy: {policy} }}\nconcurrency: {{ limit: none }}\n\
         discovery:\n  static:\n"
    );
    for url in fleet.urls() {
        text.push_str(&format!("    - url: {url}\n"));
    }
    let config = Config::parse(&text, "mixed bench").context("the tongs configuration")?;
    let app = App::bind(&config).await.context("starting tongs")?;
    let target = format!("http://{}", app.proxy_addr());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(app.run(shutdown.clone()));
    let label = format!("tongs, {policy}");
    let run = measure(label, contender, &target, fleet, rate, settings).await;
    shutdown.cancel();
    if tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .is_err()
    {
        eprintln!("mixed: tongs did not finish draining within 30 s");
    }
    Ok(run)
}

// ---------------------------------------------------------------------------------------------------
// nginx, a real process.

fn find_nginx() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join("nginx"))
        .find(|candidate| candidate.is_file())
}

fn nginx_version(nginx: &Path) -> String {
    // `nginx -v` writes "nginx version: nginx/1.22.1" to stderr.
    Command::new(nginx)
        .arg("-v")
        .output()
        .ok()
        .and_then(|out| {
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .rsplit_once('/')
                .map(|(_, version)| version.to_owned())
        })
        .unwrap_or_else(|| "unknown version".to_owned())
}

/// A running nginx with its temporary prefix directory; dropping it stops nginx (master and workers)
/// and removes the directory.
struct Nginx {
    child: Option<Child>,
    dir: PathBuf,
    addr: SocketAddr,
}

impl Nginx {
    fn start(nginx: &Path, fleet: &Fleet) -> Result<Nginx> {
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos());
        let dir = std::env::temp_dir().join(format!("tongs-mixed-{}-{stamp}", std::process::id()));
        std::fs::create_dir_all(dir.join("tmp"))
            .with_context(|| format!("creating {}", dir.display()))?;
        // From here on the guard owns the directory, so an early return removes it.
        let mut guard = Nginx {
            child: None,
            dir,
            addr: free_port()?,
        };
        let workers = std::thread::available_parallelism().map_or(1, usize::from);
        let dir = guard.dir.display().to_string();
        let servers: String = fleet
            .nodes()
            .iter()
            .map(|node| format!("        server {};\n", node.addr()))
            .collect();
        // `zone` shares the upstream's state between the workers, so least_conn counts every
        // worker's connections, as tongs' shared counters do.
        let conf = format!(
            "worker_processes {workers};\n\
             pid {dir}/nginx.pid;\n\
             error_log stderr warn;\n\
             events {{ worker_connections 8192; }}\n\
             http {{\n    \
                 access_log off;\n    \
                 client_body_temp_path {dir}/tmp/body;\n    \
                 proxy_temp_path {dir}/tmp/proxy;\n    \
                 fastcgi_temp_path {dir}/tmp/fastcgi;\n    \
                 uwsgi_temp_path {dir}/tmp/uwsgi;\n    \
                 scgi_temp_path {dir}/tmp/scgi;\n    \
                 upstream fleet {{\n        \
                     least_conn;\n        \
                     zone fleet 64k;\n\
             {servers}        \
                     keepalive 64;\n    \
                 }}\n    \
                 server {{\n        \
                     listen {addr};\n        \
                     location / {{\n            \
                         proxy_pass http://fleet;\n            \
                         proxy_http_version 1.1;\n            \
                         proxy_set_header Connection \"\";\n            \
                         proxy_read_timeout 100s;\n        \
                     }}\n    \
                 }}\n\
             }}\n",
            addr = guard.addr,
        );
        let conf_path = guard.dir.join("nginx.conf");
        std::fs::write(&conf_path, conf)
            .with_context(|| format!("writing {}", conf_path.display()))?;
        let stderr_path = guard.dir.join("stderr.log");
        let stderr = File::create(&stderr_path)
            .with_context(|| format!("creating {}", stderr_path.display()))?;
        let child = Command::new(nginx)
            .arg("-e")
            .arg("stderr")
            .arg("-c")
            .arg(&conf_path)
            .arg("-p")
            .arg(&guard.dir)
            .arg("-g")
            .arg("daemon off;")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {}", nginx.display()))?;
        guard.child = Some(child);
        guard.wait_ready(&stderr_path)?;
        Ok(guard)
    }

    /// Waits (at most 10 s) until nginx accepts connections.
    fn wait_ready(&mut self, stderr_path: &Path) -> Result<()> {
        let log = || std::fs::read_to_string(stderr_path).unwrap_or_default();
        for _ in 0..200 {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                bail!("nginx exited at startup ({status}):\n{}", log());
            }
            if TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "nginx did not listen on {} within 10 s:\n{}",
            self.addr,
            log()
        )
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let master = child.id();
            let workers = children_of(master);
            // SIGTERM: the master stops its workers, then exits.
            let _ = Command::new("kill")
                .args(["-TERM", &master.to_string()])
                .stderr(Stdio::null())
                .status();
            let mut exited = false;
            for _ in 0..100 {
                if !matches!(child.try_wait(), Ok(None)) {
                    exited = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if !exited {
                let _ = child.kill();
                let _ = child.wait();
            }
            // Workers outlive a master that had to be killed; stop any still there.
            for worker in workers {
                if is_nginx(worker) {
                    let _ = Command::new("kill")
                        .args(["-KILL", &worker.to_string()])
                        .stderr(Stdio::null())
                        .status();
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free port on 127.0.0.1 (bound, then released for nginx to take).
fn free_port() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    listener.local_addr().context("finding a free port")
}

/// Processes whose parent is `pid`, from /proc.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&candidate| {
            std::fs::read_to_string(format!("/proc/{candidate}/stat"))
                .ok()
                // Fields after the command name (which may hold spaces): state, then the parent.
                .and_then(|stat| {
                    let (_, rest) = stat.rsplit_once(") ")?;
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

fn is_nginx(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| cmdline.starts_with(b"nginx"))
}

async fn run_nginx(nginx: &Path, fleet: &Fleet, rate: f64, settings: &Settings) -> Result<Run> {
    let version = nginx_version(nginx);
    let server = Nginx::start(nginx, fleet).context("nginx")?;
    let label = format!("nginx {version}, least_conn");
    let run = measure(
        label,
        Contender::Nginx,
        &server.url(),
        fleet,
        rate,
        settings,
    )
    .await;
    drop(server);
    Ok(run)
}

// ---------------------------------------------------------------------------------------------------
// The report.

fn print_table(runs: &[Run]) {
    let baseline = runs
        .iter()
        .find(|run| run.contender == Contender::LeastOutstanding)
        .map(|run| run.p99)
        .filter(|p99| *p99 > 0.0);
    println!(
        "| contender | requests | success % | p50 ms | p90 ms | p99 ms | max ms | share of the two fastest nodes | p99 vs least-outstanding |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for run in runs {
        let success = if run.sent > 0 {
            100.0 * run.succeeded as f64 / run.sent as f64
        } else {
            0.0
        };
        let total: u64 = run.served.iter().sum();
        let fastest: u64 = run.served.iter().take(2).sum();
        let share = if total > 0 {
            format!("{:.1} %", 100.0 * fastest as f64 / total as f64)
        } else {
            "–".to_owned()
        };
        let ratio = baseline.map_or("–".to_owned(), |base| format!("{:.2}×", run.p99 / base));
        println!(
            "| {} | {} | {success:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {share} | {ratio} |",
            run.label, run.sent, run.p50, run.p90, run.p99, run.max
        );
    }
    for run in runs.iter().filter(|run| !run.errors.is_empty()) {
        let errors = run
            .errors
            .iter()
            .map(|(kind, count)| format!("{kind}: {count}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!("errors, {}: {errors}", run.label);
    }
    let expected = runs
        .iter()
        .find(|run| run.contender == Contender::ExpectedLatency);
    if let (Some(expected), Some(base)) = (expected, baseline) {
        let ratio = expected.p99 / base;
        let verdict = if ratio <= TARGET_RATIO {
            "met"
        } else {
            "missed"
        };
        println!(
            "target p99 ≤ {TARGET_RATIO}× least-outstanding: {verdict} ({ratio:.2}×: {:.0} ms against {:.0} ms)",
            expected.p99, base
        );
    }
}

fn print_shares(runs: &[Run]) {
    let header: Vec<String> = NODES
        .iter()
        .map(|(name, mean)| format!("{name} ({mean} ms)"))
        .collect();
    println!("| contender | {} |", header.join(" | "));
    println!("| --- |{}", " ---: |".repeat(NODES.len()));
    for run in runs {
        let total: u64 = run.served.iter().sum();
        let shares: Vec<String> = run
            .served
            .iter()
            .map(|&count| {
                if total > 0 {
                    format!("{:.1} %", 100.0 * count as f64 / total as f64)
                } else {
                    "–".to_owned()
                }
            })
            .collect();
        println!("| {} | {} |", run.label, shares.join(" | "));
    }
}

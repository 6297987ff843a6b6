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

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio_util::sync::CancellationToken;
use tongs::demo::{ClientOutcome, LoadGenerator, LoadPlan};
use tongs::sim::{Fleet, FleetConfig, ResponseKind};

use support::in_process::InProcessTongs;
use support::{Process, TempDir, env_duration, env_list, fleet, stats};

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
    if !support::benchmarking() {
        println!("mixed: a load benchmark; run it with `cargo bench --bench mixed`");
        return Ok(());
    }
    let settings = Settings::from_env()?;
    support::block_on(run(settings))
}

struct Settings {
    duration: Duration,
    warmup: Duration,
    load: f64,
    contenders: Vec<Contender>,
}

impl Settings {
    fn from_env() -> Result<Settings> {
        let duration = env_duration("DURATION", Duration::from_secs(60))?;
        if duration < Duration::from_secs(1) {
            bail!("DURATION is too short: at least 1s");
        }
        let warmup = env_duration("WARMUP", Duration::from_secs(5))?;
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
        let contenders = env_list("CONTENDERS", DEFAULT_CONTENDERS, Contender::parse)?;
        Ok(Settings {
            duration,
            warmup,
            load,
            contenders,
        })
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

fn fleet_config() -> FleetConfig {
    let nodes = NODES.map(|(name, mean_ms)| (name, CAPACITY, mean_ms));
    fleet::config(SEED, &nodes, SPREAD, NODE_QUEUE, ResponseKind::Json)
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
    let config = fleet_config();
    let capacity = fleet::capacity(&config);
    let rate = capacity * settings.load;
    println!("date: {}", support::now_utc());
    println!("machine: {}", support::machine());
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

    let fleet = Fleet::start(&config, Duration::from_secs(24 * 3600))
        .await
        .context("starting the simulated fleet")?;
    let mut runs = Vec::new();
    for &contender in &settings.contenders {
        rest(&fleet).await;
        let run = match contender {
            Contender::ExpectedLatency | Contender::LeastOutstanding => {
                run_tongs(contender, &fleet, rate, &settings).await
            }
            Contender::Nginx => match support::find_program("nginx") {
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

/// Waits until no request is left at any node (at most a minute), then lets the fleet rest.
async fn rest(fleet: &Fleet) {
    fleet::wait_idle(fleet, Duration::from_millis(100)).await;
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
        let succeeded = recorder.count(ClientOutcome::Succeeded);
        let mut errors = recorder.failures();
        let rejected = recorder.count(ClientOutcome::Rejected);
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
    let yaml = format!("balancer: {{ policy: {policy} }}\nconcurrency: {{ limit: none }}\n");
    let tongs = InProcessTongs::start(&yaml, fleet.urls()).await?;
    let label = format!("tongs, {policy}");
    let run = measure(label, contender, &tongs.url, fleet, rate, settings).await;
    tongs.stop("mixed").await;
    Ok(run)
}

// ---------------------------------------------------------------------------------------------------
// nginx, a real process.

/// nginx as the contender: `least_conn` with `zone` (so the workers share their counts, as tongs'
/// counters are shared), one worker per CPU, upstream keepalive, HTTP/1.1 upstream.
fn nginx_config(dir: &Path, listen: SocketAddr, fleet: &Fleet) -> String {
    let servers: String = fleet
        .nodes()
        .iter()
        .map(|node| format!("        server {};\n", node.addr()))
        .collect();
    format!(
        "{head}
    upstream fleet {{
        least_conn;
        zone fleet 64k;
{servers}        keepalive 64;
    }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_read_timeout 100s;
        }}
    }}
}}
",
        head = support::nginx_head(dir, support::cpus(), 8192, "nginx"),
    )
}

/// Starts nginx in front of the fleet; dropping the result stops it (master and workers).
fn start_nginx(nginx: &Path, fleet: &Fleet) -> Result<(Process, TempDir, SocketAddr)> {
    let dir = TempDir::new("mixed-nginx")?;
    std::fs::create_dir_all(dir.path().join("tmp"))?;
    let addr = support::free_addr()?;
    let conf_path = dir.path().join("nginx.conf");
    std::fs::write(&conf_path, nginx_config(dir.path(), addr, fleet))
        .with_context(|| format!("writing {}", conf_path.display()))?;
    let command = support::nginx_command(nginx, &conf_path, dir.path());
    let mut process = Process::spawn("nginx", command, dir.path().join("stderr.log"))?;
    process.wait_listening(addr, Duration::from_secs(10))?;
    Ok((process, dir, addr))
}

async fn run_nginx(nginx: &Path, fleet: &Fleet, rate: f64, settings: &Settings) -> Result<Run> {
    let version = support::program_version(nginx, "-v");
    let (server, _dir, addr) = start_nginx(nginx, fleet).context("nginx")?;
    let label = format!("nginx {version}, least_conn");
    let run = measure(
        label,
        Contender::Nginx,
        &format!("http://{addr}"),
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
        println!("errors, {}: {}", run.label, stats::by_kind(&run.errors));
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

//! The soak: tongs' release binary, with its defaults, in front of the demo's heterogeneous simulated
//! fleet under random interruptions of every kind, at a fixed share of the fleet's capacity for a long
//! time, watched for leaks. Every `SAMPLE_EVERY` it prints one row of a markdown table — requests sent
//! and success so far, tongs' RSS, open file descriptors, threads and live tokio tasks (its
//! `tongs_runtime_tasks` gauge), requests in flight at the fleet — and at the end the growth of each
//! figure between the first sample after warm-up and the last, and its least-squares slope per hour
//! over the second half of the run. Flat means no leak; the figures are printed, not asserted.
//!
//! RSS rises at an outage surge (requests and their connections pile up while nodes are out) and should
//! fall back within a few MiB of "before the load" once the pooled connections have idled out: tongs runs
//! on jemalloc, which returns freed pages to the OS. With glibc's malloc it stayed at the surge's peak
//! (freed buffers kept in its arenas; benches/RESULTS.md, "soak"). To tell live heap from what the
//! allocator keeps, build tongs with `--features dhat-heap`: it logs its live heap every 10 s (set
//! `TONGS_LOG=warn` to keep tongs' log in target/) and writes dhat-heap.json when it exits.
//!
//!     cargo bench --bench soak                   # 10 minutes of load, then 200 s idle
//!     DURATION=90s cargo bench --bench soak
//!
//! While the load runs, tongs' configuration is rewritten every `RELOAD_EVERY` (60s): the fleet, and
//! a pool of `CHURN` (500) endpoints that exist nowhere (loopback addresses nobody listens on, refused
//! at once), a new batch each time, which no request is sent to. So the soak also shows that reloads
//! and endpoints churned through discovery (`discovery.static`; 15,000 of them in 30 minutes) leave
//! nothing behind. `CHURN=0` turns it off.
//!
//! Environment: DURATION (load time, default 10m), SAMPLE_EVERY (10s), WARMUP (samples before it are
//! left out of the verdict; default a fifth of DURATION, at most 60s), COOLDOWN (sampling after the
//! load has ended and its last requests have settled, default 200s: an idle pooled upstream connection
//! is closed 90 to 180 s after its last use — `timeouts.idle`, checked every `timeouts.idle` — so by
//! the end tongs should be back where it was before the load), LOAD (share of the fleet's capacity,
//! 0.5), SEED (1).
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it runs a smoke pass of a few seconds
//! instead, which fails if tongs does not start, serve or export the gauge.
#![forbid(unsafe_code)]

#[path = "support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tongs::config::HumanDuration;
use tongs::demo::{ClientOutcome, DemoOptions, LoadGenerator, LoadPlan, demo_fleet};
use tongs::metrics::{CONFIG_RELOADS, RUNTIME_TASKS};
use tongs::sim::{Fleet, FleetConfig, InterruptionKind, RandomInterruptions};

use support::{TongsProcess, env_duration, env_number, fleet, stats};

/// Mean time between two random interruptions of one node, and how long one lasts on average.
const INTERRUPTION_INTERVAL: Duration = Duration::from_secs(60);
const INTERRUPTION_DURATION: Duration = Duration::from_secs(6);
/// Service-time multiplier of a `slow` node.
const SLOW_FACTOR: f64 = 6.0;
/// Every n-th request asks for an SSE token stream.
const STREAM_EVERY: u64 = 3;
/// A client gives up after this long: above tongs' `timeouts.total` (100 s), so what clients see is
/// tongs' doing.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(110);

struct Settings {
    smoke: bool,
    /// Random interruptions on (off in the smoke pass, where a stream cut by a silent node could hold
    /// the run up to tongs' `timeouts.total`).
    interruptions: bool,
    /// How long tongs runs idle before the first sample: its first heartbeats open a connection to
    /// each node (2 s apart at most), which is part of its resting state, not of the load.
    idle_settle: Duration,
    duration: Duration,
    sample_every: Duration,
    warmup: Duration,
    cooldown: Duration,
    load: f64,
    seed: u64,
    /// Endpoints that exist nowhere added at each reload (0: no reloads).
    churn: usize,
    reload_every: Duration,
}

impl Settings {
    fn from_env(smoke: bool) -> Result<Settings> {
        if smoke {
            // A few seconds that still start every part and take samples.
            return Ok(Settings {
                smoke,
                interruptions: false,
                idle_settle: Duration::from_millis(500),
                duration: Duration::from_secs(3),
                sample_every: Duration::from_secs(1),
                warmup: Duration::from_secs(1),
                cooldown: Duration::ZERO,
                load: 0.1,
                seed: 1,
                churn: 5,
                reload_every: Duration::from_secs(1),
            });
        }
        let duration = env_duration("DURATION", Duration::from_secs(600))?;
        if duration.is_zero() {
            bail!("DURATION must be above zero");
        }
        let sample_every = env_duration("SAMPLE_EVERY", Duration::from_secs(10))?;
        if sample_every.is_zero() {
            bail!("SAMPLE_EVERY must be above zero");
        }
        let warmup = env_duration("WARMUP", (duration / 5).min(Duration::from_secs(60)))?;
        let load: f64 = env_number("LOAD", 0.5)?;
        if !(load > 0.0 && load <= 10.0) {
            bail!("LOAD={load} must be above 0 and at most 10 (a share of the fleet's capacity)");
        }
        Ok(Settings {
            smoke,
            interruptions: true,
            idle_settle: Duration::from_secs(3),
            duration,
            sample_every,
            warmup,
            cooldown: env_duration("COOLDOWN", Duration::from_secs(200))?,
            load,
            seed: env_number("SEED", 1)?,
            churn: env_number("CHURN", 500)?,
            reload_every: env_duration("RELOAD_EVERY", Duration::from_secs(60))?
                .max(Duration::from_secs(1)),
        })
    }
}

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it.
    let smoke = !support::benchmarking();
    let settings = Settings::from_env(smoke)?;
    support::block_on(run(settings))
}

/// The demo's six GPU classes, calm, then random interruptions of every kind on every node.
fn fleet_config(settings: &Settings) -> FleetConfig {
    let mut config = demo_fleet(&DemoOptions {
        nodes: 6,
        seed: settings.seed,
        interruptions: false,
        ..DemoOptions::default()
    });
    if !settings.interruptions {
        return config;
    }
    for node in &mut config.nodes {
        node.random_interruptions = Some(RandomInterruptions {
            mean_interval: HumanDuration(INTERRUPTION_INTERVAL),
            mean_duration: HumanDuration(INTERRUPTION_DURATION),
            kinds: InterruptionKind::ALL.to_vec(),
            slow_factor: SLOW_FACTOR,
        });
    }
    config
}

/// When a sample was taken.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Before,
    /// While the load was being sent.
    Load,
    /// After the last departure: the last requests settling, then the cooldown.
    After,
}

/// One row of the table.
#[derive(Clone, Copy)]
struct Sample {
    elapsed: Duration,
    phase: Phase,
    sent: u64,
    succeeded: u64,
    completed: u64,
    rss_mib: f64,
    fds: f64,
    threads: f64,
    /// None when the scrape failed.
    tasks: Option<f64>,
    fleet_in_flight: f64,
}

async fn sample(
    tongs: &TongsProcess,
    fleet: &Fleet,
    generator: &LoadGenerator,
    elapsed: Duration,
    phase: Phase,
) -> Sample {
    let tasks = tongs.metric(RUNTIME_TASKS.name).await;
    let usage = tongs.process.usage();
    let (sent, succeeded, completed) =
        generator.with(|r| (r.sent(), r.count(ClientOutcome::Succeeded), r.completed()));
    Sample {
        elapsed,
        phase,
        sent,
        succeeded,
        completed,
        rss_mib: usage.rss_kib as f64 / 1024.0,
        fds: usage.fds as f64,
        threads: usage.threads as f64,
        tasks,
        fleet_in_flight: fleet
            .nodes()
            .iter()
            .map(|n| n.stats().in_flight)
            .sum::<usize>() as f64,
    }
}

fn print_header() {
    println!(
        "| elapsed s | phase | requests sent | success % so far | RSS MiB | open fds | threads | tokio tasks | in flight at the fleet |"
    );
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
}

fn print_row(sample: &Sample, warmup: Duration) {
    let phase = match sample.phase {
        Phase::Before => "before the load",
        Phase::Load if sample.elapsed < warmup => "warm-up",
        Phase::Load => "load",
        Phase::After => "after the load",
    };
    let success = if sample.completed == 0 {
        "—".to_owned()
    } else {
        format!(
            "{:.2}",
            100.0 * sample.succeeded as f64 / sample.completed as f64
        )
    };
    let tasks = sample
        .tasks
        .map_or_else(|| "scrape failed".to_owned(), |t| format!("{t:.0}"));
    println!(
        "| {} | {phase} | {} | {success} | {:.1} | {:.0} | {:.0} | {tasks} | {:.0} |",
        sample.elapsed.as_secs(),
        sample.sent,
        sample.rss_mib,
        sample.fds,
        sample.threads,
        sample.fleet_in_flight,
    );
}

async fn run(settings: Settings) -> Result<()> {
    let fleet_config = fleet_config(&settings);
    let capacity = fleet::capacity(&fleet_config);
    let rps = capacity * settings.load;
    println!("# tongs soak");
    println!();
    println!("date: {}", support::now_utc());
    println!("machine: {}", support::machine());
    let interruptions = if settings.interruptions {
        format!(
            "random interruptions on every node (refuse, blackhole, gateway-503, slow ×{SLOW_FACTOR}; \
             one every {} s per node on average, lasting {} s on average)",
            INTERRUPTION_INTERVAL.as_secs(),
            INTERRUPTION_DURATION.as_secs(),
        )
    } else {
        "no interruptions".to_owned()
    };
    let spread = fleet_config
        .nodes
        .first()
        .map_or(0.0, |n| n.service_time.spread);
    println!(
        "scenario: {} simulated nodes, capacity × mean service time {} (lognormal spread {spread}; up to \
         4× capacity waiting inside a node, then 503 + Retry-After); {interruptions}; seed {}. tongs: `tongs \
         run` as its own process (the release binary under `cargo bench`), defaults, the nodes as \
         static endpoints. Load: open loop at {:.0} % of the \
         fleet's capacity ({capacity:.1} req/s) = {rps:.1} req/s, one request in {STREAM_EVERY} an SSE \
         stream, client timeout {} s. {} s of load, a sample every {} s, warm-up {} s, then {} s after \
         the load has settled.",
        fleet_config.nodes.len(),
        fleet::describe(&fleet_config),
        settings.seed,
        settings.load * 100.0,
        CLIENT_TIMEOUT.as_secs(),
        settings.duration.as_secs(),
        settings.sample_every.as_secs_f64(),
        settings.warmup.as_secs(),
        settings.cooldown.as_secs(),
    );
    if settings.smoke {
        println!(
            "(smoke pass under `cargo test`; the soak is `cargo bench --bench soak`, DURATION=90s for a short one)"
        );
    }
    println!();

    // Interruptions are planned past the end of the load, through its settling and the cooldown.
    let horizon = settings.duration + CLIENT_TIMEOUT + settings.cooldown + Duration::from_secs(60);
    let fleet = Fleet::start(&fleet_config, horizon)
        .await
        .context("starting the simulated fleet")?;
    let tongs = TongsProcess::start(&support::static_discovery(fleet.urls()))
        .await
        .context("starting tongs")?;

    let generator = Arc::new(LoadGenerator::default());
    let plan = LoadPlan {
        target: tongs.url(),
        rps,
        duration: settings.duration,
        stream_every: STREAM_EVERY,
        client_timeout: CLIENT_TIMEOUT,
        // In the smoke pass nothing can hang (no interruptions); a slow machine gets a few seconds.
        settle: if settings.smoke {
            Duration::from_secs(5)
        } else {
            CLIENT_TIMEOUT
        },
    };
    let mut samples = Vec::new();
    tokio::time::sleep(settings.idle_settle).await;
    print_header();
    let before = sample(&tongs, &fleet, &generator, Duration::ZERO, Phase::Before).await;
    print_row(&before, settings.warmup);

    let started = Instant::now();
    // The load runs in a task of its own, so a slow scrape never delays a departure.
    let mut load = {
        let generator = Arc::clone(&generator);
        tokio::spawn(async move { generator.run(&plan, CancellationToken::new()).await })
    };
    let stop_churn = CancellationToken::new();
    let fleet_urls = fleet.urls();
    let churn = churn(&tongs, &fleet_urls, &settings, stop_churn.clone());
    tokio::pin!(churn);
    let mut churned = None;
    let mut ticker =
        tokio::time::interval_at(started + settings.sample_every, settings.sample_every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut load_over: Option<Instant> = None;
    loop {
        let tick = tokio::select! {
            finished = &mut load, if load_over.is_none() => {
                load_over = Some(Instant::now());
                stop_churn.cancel();
                if finished.is_err() {
                    bail!("the load generator panicked");
                }
                continue;
            }
            done = &mut churn, if churned.is_none() => {
                churned = Some(done?);
                continue;
            }
            tick = ticker.tick() => tick,
        };
        let elapsed = tick.duration_since(started);
        // The generator stops sending at `duration`; what follows (settling, cooldown) is "after".
        let phase = if elapsed <= settings.duration {
            Phase::Load
        } else {
            Phase::After
        };
        let now = sample(&tongs, &fleet, &generator, elapsed, phase).await;
        print_row(&now, settings.warmup);
        samples.push(now);
        if let Some(over) = load_over
            && over.elapsed() >= settings.cooldown
        {
            break;
        }
    }
    let after = samples.last().copied().unwrap_or(before);
    let churned = match churned {
        Some(churned) => churned,
        None => churn.await?,
    };
    let applied = tongs
        .metric(&format!("{}{{result=\"applied\"}}", CONFIG_RELOADS.name))
        .await
        .unwrap_or(0.0);

    println!();
    let (sent, succeeded, rejected, failures) = generator.with(|r| {
        (
            r.sent(),
            r.count(ClientOutcome::Succeeded),
            r.count(ClientOutcome::Rejected),
            r.failures(),
        )
    });
    println!(
        "requests: {sent} sent, {succeeded} succeeded ({:.2} %), {rejected} refused by tongs, failures: {}; \
         interruptions injected: {}; tongs' CPU time: {:.1} s",
        100.0 * succeeded as f64 / sent.max(1) as f64,
        if failures.is_empty() {
            "none".to_owned()
        } else {
            stats::by_kind(&failures)
        },
        fleet.interruptions_injected(),
        tongs.process.usage().cpu.as_secs_f64(),
    );
    println!(
        "reloads: {} written, {applied:.0} applied by tongs (`{}`); {} endpoints churned through them",
        churned.reloads, CONFIG_RELOADS.name, churned.endpoints,
    );
    println!();
    verdict(&settings, &before, &samples, &after);

    if settings.smoke {
        // The smoke pass checks the parts work; figures over 3 s say nothing about leaks.
        if succeeded == 0 {
            bail!("smoke pass: no request succeeded through tongs");
        }
        if samples.iter().any(|s| s.tasks.is_none()) || before.tasks.is_none() {
            bail!("smoke pass: {} missing from /metrics", RUNTIME_TASKS.name);
        }
        if churned.reloads == 0 || applied < 1.0 {
            bail!(
                "smoke pass: {} reloads written, {applied} applied",
                churned.reloads
            );
        }
    }
    Ok(())
}

/// What the churn did.
#[derive(Clone, Copy, Default)]
struct Churned {
    reloads: u64,
    endpoints: u64,
}

/// Until `stop`, every `reload_every`: tongs' configuration rewritten with the fleet and a pool of
/// `churn` endpoints of a new batch, each at a loopback address of its own on a port nobody listens
/// on (heartbeats refused at once). The pool matches a header the load never sends: its endpoints
/// are discovered, heartbeated and dropped, but never sent a request (a listed endpoint takes
/// requests before its first heartbeat, which would fail the load's). The configuration tongs
/// started with comes back at the end, the pool gone.
async fn churn(
    tongs: &TongsProcess,
    fleet: &[String],
    settings: &Settings,
    stop: CancellationToken,
) -> Result<Churned> {
    let mut done = Churned::default();
    if settings.churn == 0 {
        return Ok(done);
    }
    let mut ticker = tokio::time::interval_at(
        Instant::now() + settings.reload_every,
        settings.reload_every,
    );
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = ticker.tick() => {}
        }
        let batch = (0..settings.churn as u64).map(|i| {
            let n = done.endpoints + i;
            format!(
                "http://127.{}.{}.{}:9",
                1 + (n / 62_500) % 250,
                (n / 250) % 250,
                1 + n % 250
            )
        });
        let mut config = support::static_discovery(fleet);
        config.push_str(
            "pools:\n  - name: churn\n    match: { headers: { x-pool: churn } }\n    \
             discovery:\n      static:\n",
        );
        for url in batch {
            config.push_str(&format!("        - url: {url}\n"));
        }
        tongs.reconfigure(&config)?;
        done.reloads += 1;
        done.endpoints += settings.churn as u64;
    }
    tongs.reconfigure(&support::static_discovery(fleet))?;
    done.reloads += 1;
    Ok(done)
}

/// Least-squares slope of `points` (minutes, value): change per minute. None below two distinct times.
fn slope_per_minute(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    Some(sxy / sxx)
}

fn verdict(settings: &Settings, before: &Sample, samples: &[Sample], after: &Sample) {
    let loaded: Vec<&Sample> = samples.iter().filter(|s| s.phase == Phase::Load).collect();
    let Some(first) = loaded
        .iter()
        .find(|s| s.elapsed >= settings.warmup)
        .copied()
    else {
        println!(
            "verdict: no sample after the warm-up; run longer (DURATION) or sample more often"
        );
        return;
    };
    let Some(last) = loaded.last().copied() else {
        return;
    };
    let half = settings.duration / 2;
    let second_half: Vec<&Sample> = loaded
        .iter()
        .filter(|s| s.elapsed >= half)
        .copied()
        .collect();
    println!(
        "verdict (flat means no leak): from the first sample after warm-up ({} s) to the last under load \
         ({} s); slope by least squares over the {} samples of the second half ({} s on); \"after\" is \
         the last sample, {} s after the load ended, against the one before the load",
        first.elapsed.as_secs(),
        last.elapsed.as_secs(),
        second_half.len(),
        half.as_secs(),
        settings.cooldown.as_secs(),
    );
    println!();
    println!(
        "| figure | before the load | after warm-up | last under load | growth | slope per hour, second half | after the load |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    type Read = fn(&Sample) -> Option<f64>;
    // Name, how to read it from a sample, decimals of its values (slopes get two more).
    let figures: [(&str, Read, usize); 5] = [
        ("RSS MiB", |s| Some(s.rss_mib), 1),
        ("open fds", |s| Some(s.fds), 0),
        ("threads", |s| Some(s.threads), 0),
        ("tokio tasks", |s| s.tasks, 0),
        (
            "in flight at the fleet (the load, for reference)",
            |s| Some(s.fleet_in_flight),
            0,
        ),
    ];
    let show = |value: Option<f64>, decimals: usize| {
        value.map_or_else(|| "—".to_owned(), |v| format!("{v:.decimals$}"))
    };
    let signed = |value: Option<f64>, decimals: usize| {
        value.map_or_else(|| "—".to_owned(), |v| format!("{v:+.decimals$}"))
    };
    for (name, read, decimals) in figures {
        let growth = read(last).zip(read(first)).map(|(l, f)| l - f);
        let points: Vec<(f64, f64)> = second_half
            .iter()
            .filter_map(|s| Some((s.elapsed.as_secs_f64() / 60.0, read(s)?)))
            .collect();
        let slope = slope_per_minute(&points).map(|per_minute| per_minute * 60.0);
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} |",
            show(read(before), decimals),
            show(read(first), decimals),
            show(read(last), decimals),
            signed(growth, decimals),
            signed(slope, decimals + 2),
            show(read(after), decimals),
        );
    }
}

//! The `tongs` command: CLI, logging, signals and exit codes.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::balance::config_problems;
use tongs::config::{BalancePolicy, Config, ConfigError, LimitMode};
use tongs::demo::DemoOptions;
use tongs::sim::{Fleet, FleetConfig};
use tracing_subscriber::EnvFilter;

/// Exit code for a configuration that cannot be used (EX_USAGE-like, as sysexits' EX_USAGE is 64).
const EXIT_BAD_CONFIG: u8 = 64;

/// jemalloc, not glibc's malloc: after a surge (hundreds of connections held while nodes are out, each
/// with hyper's read and write buffers) glibc keeps the freed memory in its arenas' free lists — only
/// `malloc_trim` gives it back — so RSS stayed at the surge's high-water mark for good (the soak: 14.5 →
/// 30.2 MiB, still 29.5 MiB 200 s later while dhat counted 0.45 MB live). jemalloc returns unused pages
/// to the OS after `dirty_decay_ms` (10 s): 14.9 → 32.6 → 17.3 MiB in the same run (benches/RESULTS.md,
/// "soak"). See [`return_memory_when_idle`].
#[cfg(not(feature = "dhat-heap"))]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc purges its unused pages as its arenas allocate; an idle proxy hardly allocates, so one
/// background thread (not jemalloc's default of one per CPU) does it on time instead.
#[cfg(not(feature = "dhat-heap"))]
fn return_memory_when_idle() -> Result<(), tikv_jemalloc_ctl::Error> {
    tikv_jemalloc_ctl::max_background_threads::write(1)?;
    tikv_jemalloc_ctl::background_thread::write(true)
}

/// With `--features dhat-heap`, every allocation goes through dhat's profiler (see [`heap_profile`]).
#[cfg(feature = "dhat-heap")]
#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

#[derive(Parser)]
#[command(
    name = "tongs",
    version,
    about = "Reverse proxy for remote, interruptible GPU inference nodes"
)]
struct Cli {
    /// Log line format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "TONGS_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum PolicyArg {
    ExpectedLatency,
    LeastOutstanding,
}

#[derive(Clone, Copy, ValueEnum)]
enum LimitArg {
    None,
    Static,
    Adaptive,
    Learned,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Run {
        /// The configuration file (YAML).
        #[arg(long, short, env = "TONGS_CONFIG")]
        config: PathBuf,
    },
    /// Validate a configuration file and print the effective configuration, defaults filled in.
    CheckConfig {
        /// The configuration file (YAML).
        file: PathBuf,
    },
    /// Show tongs at work: a simulated interruptible GPU fleet, tongs in front of it, and steady load.
    Demo {
        /// How long the load runs (e.g. 30s, 2m).
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        duration: Duration,
        /// Simulated nodes (GPU classes from A100 down to RTX 3060, repeating).
        #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u16).range(1..=1000))]
        nodes: u16,
        /// Requests per second, sent at a fixed rate whatever the fleet does (open loop).
        #[arg(long, default_value_t = 40.0, value_parser = parse_rps)]
        rps: f64,
        /// Seed for service times and interruptions; the same seed replays the same fleet.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print the final summary as one JSON line on stdout (the live table goes to stderr).
        #[arg(long)]
        json: bool,
        /// Run the same fleet without interruptions (a baseline to compare against).
        #[arg(long)]
        no_interruptions: bool,
        /// How tongs ranks the nodes (balancer.policy).
        #[arg(long, value_enum, default_value_t = PolicyArg::ExpectedLatency)]
        policy: PolicyArg,
        /// Per-node concurrency limit (concurrency.limit); the excess waits in tongs' queue.
        #[arg(long, value_enum, default_value_t = LimitArg::Learned)]
        limit: LimitArg,
    },
    /// Serve a simulated fleet described by a YAML file until stopped (point a tongs config at it).
    Sim {
        /// The fleet file (YAML).
        #[arg(long, short)]
        config: PathBuf,
    },
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration =
        humantime::parse_duration(text).map_err(|err| format!("{err} (write e.g. 30s or 2m)"))?;
    if duration.is_zero() || duration > Duration::from_secs(24 * 3600) {
        return Err("must be greater than zero and at most 24h".into());
    }
    Ok(duration)
}

fn parse_rps(text: &str) -> Result<f64, String> {
    let rps: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    if !(rps > 0.0 && rps <= 100_000.0) {
        return Err("must be above 0 and at most 100000".into());
    }
    Ok(rps)
}

fn main() -> ExitCode {
    #[cfg(feature = "dhat-heap")]
    let _profile = heap_profile::start();
    #[cfg(not(feature = "dhat-heap"))]
    if let Err(err) = return_memory_when_idle() {
        eprintln!(
            "tongs: jemalloc's background thread did not start ({err}); memory is returned on allocation only"
        );
    }
    let cli = Cli::parse();
    // The demo draws a table on the terminal: only errors may interrupt it unless RUST_LOG says otherwise.
    let default_level = match cli.command {
        Command::Demo { .. } => "error",
        _ => "info",
    };
    init_logging(cli.log_format, default_level);
    match cli.command {
        Command::Demo {
            duration,
            nodes,
            rps,
            seed,
            json,
            no_interruptions,
            policy,
            limit,
        } => {
            let options = DemoOptions {
                duration,
                nodes: usize::from(nodes),
                rps,
                seed,
                json,
                interruptions: !no_interruptions,
                policy: match policy {
                    PolicyArg::ExpectedLatency => BalancePolicy::ExpectedLatency,
                    PolicyArg::LeastOutstanding => BalancePolicy::LeastOutstanding,
                },
                limit: match limit {
                    LimitArg::None => LimitMode::None,
                    LimitArg::Static => LimitMode::Static,
                    LimitArg::Adaptive => LimitMode::Adaptive,
                    LimitArg::Learned => LimitMode::Learned,
                },
            };
            exit_on_error(demo(options))
        }
        Command::Sim { config } => match FleetConfig::load(&config) {
            Ok(fleet) => exit_on_error(sim(fleet)),
            Err(err) => bad_config(&err),
        },
        Command::CheckConfig { file } => match Config::load_with(&file, config_problems) {
            Ok(config) => {
                // A value left as an example's placeholder is a deployment mistake, not a setting.
                let placeholders = config.placeholders();
                if !placeholders.is_empty() {
                    let err = ConfigError::Invalid {
                        origin: file.display().to_string(),
                        problems: placeholders,
                    };
                    return bad_config(&err);
                }
                print!("{}", config.to_yaml());
                ExitCode::SUCCESS
            }
            Err(err) => bad_config(&err),
        },
        Command::Run { config: path } => match Config::load_with(&path, config_problems) {
            Ok(config) => exit_on_error(run(config, path)),
            Err(err) => bad_config(&err),
        },
    }
}

fn exit_on_error(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            eprintln!("tongs: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn bad_config(err: &ConfigError) -> ExitCode {
    eprintln!("tongs: {err}");
    ExitCode::from(EXIT_BAD_CONFIG)
}

fn init_logging(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colours only for a person at a terminal: a file or a log collector gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tongs")
        .build()
        .context("cannot start the async runtime")
}

fn demo(options: DemoOptions) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let interrupt = CancellationToken::new();
        tokio::spawn(stop_on_signal(interrupt.clone()));
        let json = options.json;
        let summary = tongs::demo::run(options, interrupt).await?;
        if json {
            println!("{}", summary.to_json());
        } else {
            print!("{}", summary.to_text());
        }
        Ok(())
    })
}

fn sim(fleet: FleetConfig) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        // Random interruptions are planned a day ahead; a longer run simply has none after that.
        let running = Fleet::start(&fleet, Duration::from_secs(24 * 3600))
            .await
            .context("cannot start the simulated fleet")?;
        println!(
            "simulated fleet (seed {}); endpoints for a tongs config:",
            fleet.seed
        );
        println!("discovery:\n  static:");
        for node in running.nodes() {
            println!("    - url: {}   # {}", node.url(), node.name());
        }
        let stop = CancellationToken::new();
        tokio::spawn(stop_on_signal(stop.clone()));
        stop.cancelled().await;
        Ok(())
    })
}

fn run(config: Config, path: PathBuf) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let app = App::bind(&config).await?.watch_config(path);
        let shutdown = CancellationToken::new();
        tokio::spawn(stop_on_signal(shutdown.clone()));
        app.run(shutdown).await;
        Ok(())
    })
}

/// Cancels `shutdown` on SIGTERM (Kubernetes) or SIGINT (Ctrl-C).
async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(err), _) | (_, Err(err)) => {
            tracing::error!(error = %err, "cannot listen for signals; stop tongs with SIGKILL");
            return;
        }
    };
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(signal = name, "shutting down");
    shutdown.cancel();
}

/// The heap profile of a `--features dhat-heap` build: dhat's live heap (bytes and blocks, and the peak so
/// far) on stderr every 10 s, and `dhat-heap.json` in the working directory when the process exits
/// normally (`tongs run` does on SIGTERM), with the allocation sites live at the peak and at the end.
#[cfg(feature = "dhat-heap")]
mod heap_profile {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    pub struct Profile {
        stop: Arc<AtomicBool>,
        _profiler: dhat::Profiler,
    }

    pub fn start() -> Profile {
        let profiler = dhat::Profiler::new_heap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let started = Instant::now();
        std::thread::spawn(move || {
            while !flag.load(Ordering::Acquire) {
                let stats = dhat::HeapStats::get();
                eprintln!(
                    "dhat: {:.0} s live {} bytes in {} blocks, peak {} bytes",
                    started.elapsed().as_secs_f64(),
                    stats.curr_bytes,
                    stats.curr_blocks,
                    stats.max_bytes,
                );
                std::thread::sleep(Duration::from_secs(10));
            }
        });
        Profile {
            stop,
            _profiler: profiler,
        }
    }

    impl Drop for Profile {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Release);
        }
    }
}

#[cfg(all(test, not(feature = "dhat-heap")))]
mod tests {
    #[test]
    fn jemalloc_returns_memory_from_one_background_thread() {
        super::return_memory_when_idle().unwrap();
        assert!(tikv_jemalloc_ctl::background_thread::read().unwrap());
        assert_eq!(
            tikv_jemalloc_ctl::max_background_threads::read().unwrap(),
            1
        );
    }
}

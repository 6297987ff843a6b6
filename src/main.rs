//! The `tongs` command: CLI, logging, signals and exit codes.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::config::{Config, ConfigError};
use tracing_subscriber::EnvFilter;

/// Exit code for a configuration that cannot be used (EX_USAGE-like, as sysexits' EX_USAGE is 64).
const EXIT_BAD_CONFIG: u8 = 64;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::CheckConfig { file } => match Config::load(&file) {
            Ok(config) => {
                print!("{}", config.to_yaml());
                ExitCode::SUCCESS
            }
            Err(err) => bad_config(&err),
        },
        Command::Run { config } => match Config::load(&config) {
            Ok(config) => match run(config) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    tracing::error!("{err:#}");
                    eprintln!("tongs: {err:#}");
                    ExitCode::FAILURE
                }
            },
            Err(err) => bad_config(&err),
        },
    }
}

fn bad_config(err: &ConfigError) -> ExitCode {
    eprintln!("tongs: {err}");
    ExitCode::from(EXIT_BAD_CONFIG)
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn run(config: Config) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tongs")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let app = App::bind(&config).await?;
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

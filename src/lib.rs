//! tongs: an in-cluster reverse proxy that makes a fleet of remote, interruptible GPU inference nodes
//! look like one reliable service.
//!
//! [`App::bind`] opens the listeners for a validated [`config::Config`]; [`App::run`] serves until the
//! shutdown token is cancelled, then drains in-flight requests within the grace period.

#![forbid(unsafe_code)]

pub mod admin;
pub mod admission;
pub mod balance;
pub mod breaker;
pub mod config;
pub mod demo;
pub mod discovery;
pub mod endpoint;
pub mod health;
pub mod http;
pub mod limit;
pub mod metrics;
pub mod proxy;
pub mod readiness;
pub mod registry;
pub mod reload;
pub mod retry;
pub mod server;
pub mod sim;
pub mod upstream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, HealthConfig};
use crate::proxy::{Proxy, ProxySettings};
use crate::readiness::Readiness;
use crate::registry::{EndpointSpec, Registry};
use crate::server::ServerSettings;
use crate::upstream::GatewayKey;

/// Why tongs could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Bind(#[from] server::BindError),
    #[error(transparent)]
    Upstream(#[from] upstream::UpstreamError),
    #[error(transparent)]
    SaladKey(#[from] config::KeyError),
    #[error("cannot read discovery.kubernetes.registration.token_file: {0}")]
    RegistrationToken(std::io::Error),
    #[error("cannot read admin.bearer_token_file {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Worker threads for client traffic: `workers` from the config, or one per available CPU.
fn worker_count(config: &Config) -> usize {
    match config.workers {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    }
}

/// One worker thread: its own single-threaded runtime, listener and upstream connection pool.
///
/// Thread per core, like nginx's worker processes: a request, its upstream connection and the tasks
/// that drive them stay on one thread, so handing a response from the connection task to the request
/// task costs no cross-thread wake-up. Endpoint state is shared (atomics in the registry's endpoints).
struct Worker {
    listener: std::net::TcpListener,
    proxy: Arc<Proxy>,
    settings: ServerSettings,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
    config: Config,
    gateway_key: Arc<GatewayKey>,
    /// How many workers there are (each takes a share of the retry budget's floor).
    workers: usize,
}

impl Worker {
    fn run(self) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(err) => {
                tracing::error!(error = %err, "cannot start a worker runtime");
                return;
            }
        };
        // Counted until the worker has drained; declared after the runtime, so dropped before it.
        let _watch = self.proxy.metrics().watch_runtime(runtime.handle().clone());
        runtime.block_on(async move {
            let listener = match TcpListener::from_std(self.listener) {
                Ok(listener) => listener,
                Err(err) => {
                    tracing::error!(error = %err, "cannot register a worker listener");
                    return;
                }
            };
            let upstream = match upstream::build_client(&self.config, self.gateway_key) {
                Ok(client) => client,
                Err(err) => {
                    tracing::error!(error = %err, "cannot build the upstream client");
                    return;
                }
            };
            let worker = self.proxy.worker_path(upstream, self.workers);
            server::serve(
                listener,
                self.proxy,
                worker,
                self.settings,
                self.readiness,
                self.shutdown,
            )
            .await;
        });
    }
}

/// A proxy with its listeners bound, ready to run.
pub struct App {
    /// One listening socket per worker thread (SO_REUSEPORT).
    proxy_listeners: Vec<std::net::TcpListener>,
    admin_listener: TcpListener,
    proxy_addr: SocketAddr,
    admin_addr: SocketAddr,
    proxy: Arc<Proxy>,
    registry: Arc<Registry>,
    readiness: Arc<Readiness>,
    server_settings: ServerSettings,
    config: Config,
    /// Heartbeat settings, replaced by a reload.
    health: Arc<ArcSwap<HealthConfig>>,
    /// Bearer token the admin port requires (none: open).
    admin_token: Option<Arc<str>>,
    /// The file to watch for reloads (none: the configuration was built in code).
    config_path: Option<PathBuf>,
    /// `Salad-Api-Key` for gateways, shared by every client and replaced by reloads.
    gateway_key: Arc<GatewayKey>,
    /// The SaladCloud API key as read at start (the API client's; reloads do not change it).
    salad_key: Option<String>,
}

impl App {
    /// Builds the proxy for `config` and binds its listeners (port 0 picks a free port).
    pub async fn bind(config: &Config) -> Result<App, AppError> {
        // Fail on a bad key, CA file or proxy now, before listening, rather than in each worker.
        let salad_key = config.salad.api_key()?;
        let gateway_key = Arc::new(GatewayKey::default());
        gateway_key.set(&config.salad, salad_key.as_deref());
        upstream::build_client(config, Arc::clone(&gateway_key))?;
        let registry = Arc::new(Registry::new());
        registry.set_limits(limit::LimitSettings::from_config(&config.concurrency));
        registry
            .queue()
            .set_settings(admission::QueueSettings::from_config(&config.queue));
        registry.replace(EndpointSpec::from_config(config));
        registry
            .discovery()
            .configure(&config.discovery.kubernetes)
            .map_err(AppError::RegistrationToken)?;
        let readiness = Arc::new(Readiness::default());
        // Static discovery is synced the moment it is applied; pod discovery once its first list is in.
        if !config.discovery.kubernetes.enabled {
            readiness.set_synced();
        }
        let proxy = Arc::new(Proxy::new(
            Arc::clone(&registry),
            ProxySettings::from_config(config),
        ));
        let proxy_listeners = server::bind_workers(
            config.listen,
            worker_count(config),
            "client traffic (listen)",
        )?;
        let proxy_addr = proxy_listeners
            .first()
            .and_then(|l| l.local_addr().ok())
            .unwrap_or(config.listen);
        let admin_token = match &config.admin.bearer_token_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .map(|token| Arc::<str>::from(token.trim()))
                    .map_err(|source| AppError::Token {
                        path: path.clone(),
                        source,
                    })?,
            ),
            None => None,
        };
        let admin_listener = server::bind(config.admin.listen, "admin (admin.listen)").await?;
        Ok(App {
            proxy_addr,
            admin_addr: server::local_addr(&admin_listener, config.admin.listen),
            proxy_listeners,
            admin_listener,
            proxy,
            registry,
            readiness,
            server_settings: ServerSettings::from_config(config),
            config: config.clone(),
            health: Arc::new(ArcSwap::from_pointee(config.health.clone())),
            admin_token,
            config_path: None,
            gateway_key,
            salad_key,
        })
    }

    /// Reloads the configuration from `path` when it changes (a ConfigMap update included) and on
    /// SIGHUP, while serving.
    pub fn watch_config(mut self, path: PathBuf) -> App {
        self.config_path = Some(path);
        self
    }

    /// Where clients connect.
    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy_addr
    }

    /// Where probes and operators connect.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The request path's shared state (its counters, its registry).
    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    /// The endpoint registry (tests and discovery write to it).
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The SaladCloud API client for gateway lookups, when `salad.api` and a key are configured.
    fn salad_api(&self) -> Option<discovery::salad::SaladApi> {
        let salad = &self.config.salad;
        if !salad.api_enabled() {
            return None;
        }
        // A key that reads is a valid header value (`SaladConfig::api_key` checks).
        let key = ::http::HeaderValue::from_str(self.salad_key.as_deref()?).ok()?;
        // The API client sends the key to the API itself; the gateway key handling is not involved.
        let client = upstream::build_client(&self.config, Arc::new(GatewayKey::default()))
            .map_err(|err| tracing::error!(error = %err, "SaladCloud API lookups are off"))
            .ok()?;
        Some(discovery::salad::SaladApi::new(
            &salad.api.url,
            &salad.api.organization,
            &salad.api.project,
            key,
            client,
        ))
    }

    /// Serves until `shutdown` is cancelled, then drains and returns.
    pub async fn run(self, shutdown: CancellationToken) {
        // The runtime this runs on holds the admin port, heartbeats, discovery and reloads; each worker
        // adds its own below.
        let _watch = self
            .proxy
            .metrics()
            .watch_runtime(tokio::runtime::Handle::current());
        tracing::info!(
            listen = %self.proxy_addr(),
            admin = %self.admin_addr(),
            endpoints = self.registry.snapshot().len(),
            "tongs serving"
        );
        let salad = self.salad_api();
        let admin_stop = CancellationToken::new();
        let admin = tokio::spawn(admin::serve(
            self.admin_listener,
            Arc::clone(&self.readiness),
            Arc::clone(&self.proxy),
            self.admin_token.clone(),
            admin_stop.clone(),
        ));
        // Heartbeats run on this runtime with their own client, until the workers have drained.
        let heartbeats_stop = CancellationToken::new();
        let heartbeats = match upstream::build_client(&self.config, Arc::clone(&self.gateway_key)) {
            Ok(client) => Some(tokio::spawn(health::run(
                Arc::clone(&self.registry),
                Arc::clone(&self.health),
                client,
                heartbeats_stop.clone(),
            ))),
            Err(err) => {
                tracing::error!(error = %err, "cannot build the heartbeat client; heartbeats are off");
                None
            }
        };
        let discovery_stop = CancellationToken::new();
        let discovery = tokio::spawn(
            discovery::kube::Discovery {
                registry: Arc::clone(&self.registry),
                readiness: Arc::clone(&self.readiness),
                salad,
            }
            .run(discovery_stop.clone()),
        );
        let reload_stop = CancellationToken::new();
        let reloads = self.config_path.clone().map(|path| {
            let live = Arc::new(reload::Live::new(
                Arc::clone(&self.proxy),
                Arc::clone(&self.registry),
                Arc::clone(&self.health),
                Arc::clone(&self.gateway_key),
                self.config.clone(),
            ));
            tokio::spawn(reload::watch(path, live, reload_stop.clone()))
        });
        let mut workers = Vec::new();
        let count = self.proxy_listeners.len();
        for (index, listener) in self.proxy_listeners.into_iter().enumerate() {
            let (done, finished) = tokio::sync::oneshot::channel::<()>();
            let worker = Worker {
                listener,
                proxy: Arc::clone(&self.proxy),
                settings: self.server_settings.clone(),
                readiness: Arc::clone(&self.readiness),
                shutdown: shutdown.clone(),
                config: self.config.clone(),
                gateway_key: Arc::clone(&self.gateway_key),
                workers: count,
            };
            let spawned = std::thread::Builder::new()
                .name(format!("tongs-worker-{index}"))
                .spawn(move || {
                    worker.run();
                    let _ = done.send(());
                });
            match spawned {
                Ok(_) => workers.push(finished),
                Err(err) => tracing::error!(error = %err, "cannot start a worker thread"),
            }
        }
        for finished in workers {
            let _ = finished.await;
        }
        reload_stop.cancel();
        if let Some(reloads) = reloads {
            let _ = reloads.await;
        }
        heartbeats_stop.cancel();
        if let Some(heartbeats) = heartbeats {
            let _ = heartbeats.await;
        }
        discovery_stop.cancel();
        let _ = discovery.await;
        admin_stop.cancel();
        let _ = admin.await;
        tracing::info!("tongs stopped");
    }
}

//! Building and running tongs: the shared parts, the listeners, the worker threads, the background
//! tasks (admin port, heartbeats, discovery, reloads), and [`Parts::apply`], the one place a
//! configuration takes effect — at start and on every reload alike.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, ArcSwapOption};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::{Queue, QueueSettings};
use crate::config::{Config, HealthConfig, KeyError};
use crate::endpoint::SlotFreed;
use crate::limit::LimitSettings;
use crate::metrics::Metrics;
use crate::proxy::{Proxy, ProxySettings};
use crate::readiness::Readiness;
use crate::registry::{EndpointSpec, Registry};
use crate::server::{BindError, ServerSettings};
use crate::upstream::{GatewayKey, UpstreamError};
use crate::{admin, discovery, health, reload, server, upstream};

/// Why tongs could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error(transparent)]
    SaladKey(#[from] KeyError),
    #[error("cannot read discovery.kubernetes.registration.token_file: {0}")]
    RegistrationToken(std::io::Error),
    #[error("cannot read admin.bearer_token_file {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The long-lived parts of a running tongs, shared by the request path, the admin port, heartbeats,
/// discovery and reloads. Each of those is handed the parts it needs, and nothing else.
#[derive(Clone)]
pub struct Parts {
    pub proxy: Arc<Proxy>,
    pub registry: Arc<Registry>,
    /// Where requests wait for a slot; the registry's endpoints wake it when one comes free.
    pub queue: Arc<Queue>,
    pub discovery: Arc<discovery::Status>,
    pub readiness: Arc<Readiness>,
    pub metrics: Arc<Metrics>,
    /// Heartbeat settings, replaced by a reload.
    pub health: Arc<ArcSwap<HealthConfig>>,
    /// `Salad-Api-Key` for gateways, shared by every client and replaced by reloads.
    pub gateway_key: Arc<GatewayKey>,
    /// The bearer token the admin port requires (none: open), read again by every reload so a rotated
    /// Secret takes effect without a restart.
    pub admin_token: Arc<ArcSwapOption<String>>,
}

impl Parts {
    /// Parts with nothing configured yet; [`Parts::apply`] gives them a configuration.
    fn new() -> Parts {
        let queue = Arc::new(Queue::default());
        let woken = Arc::clone(&queue);
        let registry = Arc::new(Registry::new(SlotFreed::new(move || woken.wake_one())));
        let metrics = Arc::new(Metrics::new());
        let proxy = Arc::new(Proxy::new(
            Arc::clone(&registry),
            Arc::clone(&queue),
            Arc::clone(&metrics),
            ProxySettings::from_config(&Config::default()),
        ));
        Parts {
            proxy,
            registry,
            queue,
            discovery: Arc::default(),
            readiness: Arc::default(),
            metrics,
            health: Arc::new(ArcSwap::from_pointee(HealthConfig::default())),
            gateway_key: Arc::default(),
            admin_token: Arc::default(),
        }
    }

    /// Applies `config` to every part that can change while serving: request-path settings, limits,
    /// the queue, heartbeats, the gateway key, static endpoints and discovery. Requests under way finish
    /// with what they started with; endpoints that stay keep their state.
    ///
    /// The secrets read from files are the only part that can fail: each one that cannot be read keeps
    /// the value in force, and is returned so the caller decides (fatal at start, logged on reload).
    pub fn apply(&self, config: &Config) -> Vec<AppError> {
        let mut errors = Vec::new();
        self.proxy.apply(ProxySettings::from_config(config));
        self.registry
            .set_limits(LimitSettings::from_config(&config.concurrency));
        self.queue
            .set_settings(QueueSettings::from_config(&config.queue));
        self.health.store(Arc::new(config.health.clone()));
        // The key file is read again, so a rotated Secret takes effect with the next reload.
        match config.salad.api_key() {
            Ok(key) => self.gateway_key.set(config, key.as_deref()),
            Err(err) => errors.push(AppError::SaladKey(err)),
        }
        self.registry.replace(EndpointSpec::from_config(config));
        if let Err(err) = self.discovery.configure(&config.discovery.kubernetes) {
            errors.push(AppError::RegistrationToken(err));
        }
        match &config.admin.bearer_token_file {
            None => self.admin_token.store(None),
            Some(path) => match read_token(path) {
                Ok(token) => self.admin_token.store(Some(Arc::new(token))),
                Err(source) => errors.push(AppError::Token {
                    path: path.clone(),
                    source,
                }),
            },
        }
        errors
    }

    /// What the admin port serves from.
    fn admin(&self) -> admin::State {
        admin::State {
            readiness: Arc::clone(&self.readiness),
            proxy: Arc::clone(&self.proxy),
            registry: Arc::clone(&self.registry),
            queue: Arc::clone(&self.queue),
            discovery: Arc::clone(&self.discovery),
            metrics: Arc::clone(&self.metrics),
        }
    }
}

/// A token file's token, trimmed; an empty one is refused, since it would let `Bearer ` through.
fn read_token(path: &std::path::Path) -> std::io::Result<String> {
    let token = std::fs::read_to_string(path)?.trim().to_owned();
    if token.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the file is empty",
        ));
    }
    Ok(token)
}

/// Reloads apply through the same [`Parts::apply`] as the start did.
impl reload::Apply for Parts {
    fn apply(&self, config: &Config) {
        for err in self.apply(config) {
            tracing::error!(error = %err, "a secret could not be read on reload; keeping the one in force");
        }
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
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
    metrics: Arc<Metrics>,
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
        let _watch = self.metrics.watch_runtime(runtime.handle().clone());
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
    parts: Parts,
    server_settings: ServerSettings,
    config: Config,
    /// The file to watch for reloads (none: the configuration was built in code).
    config_path: Option<PathBuf>,
    /// The SaladCloud API key as read at start (the API client's; reloads do not change it).
    salad_key: Option<String>,
}

impl App {
    /// Builds the proxy for `config` and binds its listeners (port 0 picks a free port).
    pub async fn bind(config: &Config) -> Result<App, AppError> {
        // Fail on a bad key, CA file or proxy now, before listening, rather than in each worker.
        let salad_key = config.salad.api_key()?;
        let parts = Parts::new();
        if let Some(err) = parts.apply(config).into_iter().next() {
            return Err(err);
        }
        upstream::build_client(config, Arc::clone(&parts.gateway_key))?;
        // Static discovery is synced the moment it is applied; pod discovery once its first list is in.
        if !config.discovery.kubernetes.enabled {
            parts.readiness.set_synced();
        }
        let proxy_listeners = server::bind_workers(
            config.listen,
            worker_count(config),
            "client traffic (listen)",
        )?;
        let proxy_addr = proxy_listeners
            .first()
            .and_then(|l| l.local_addr().ok())
            .unwrap_or(config.listen);
        let admin_listener = server::bind(config.admin.listen, "admin (admin.listen)").await?;
        Ok(App {
            proxy_addr,
            admin_addr: server::local_addr(&admin_listener, config.admin.listen),
            proxy_listeners,
            admin_listener,
            parts,
            server_settings: ServerSettings::from_config(config),
            config: config.clone(),
            config_path: None,
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

    /// The running parts (tests, the demo and benchmarks read them).
    pub fn parts(&self) -> &Parts {
        &self.parts
    }

    /// The endpoint registry (tests and discovery write to it).
    pub fn registry(&self) -> &Arc<Registry> {
        &self.parts.registry
    }

    /// The queue of requests waiting for an endpoint.
    pub fn queue(&self) -> &Arc<Queue> {
        &self.parts.queue
    }

    /// The SaladCloud API client for gateway lookups, when `salad.api` and a key are configured.
    fn salad_api(&self) -> Option<discovery::salad::SaladApi> {
        let salad = &self.config.salad;
        if !salad.api_enabled() {
            return None;
        }
        // A key that reads is a valid header value (`SaladConfig::api_key` checks).
        let key = http::HeaderValue::from_str(self.salad_key.as_deref()?).ok()?;
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
        let parts = &self.parts;
        // The runtime this runs on holds the admin port, heartbeats, discovery and reloads; each worker
        // adds its own below.
        let _watch = parts
            .metrics
            .watch_runtime(tokio::runtime::Handle::current());
        // SIGHUP handled before tongs says it serves (see `reload::hangups`).
        let hangups = self.config_path.as_ref().and_then(|_| reload::hangups());
        tracing::info!(
            listen = %self.proxy_addr(),
            admin = %self.admin_addr(),
            endpoints = parts.registry.snapshot().len(),
            "tongs serving"
        );
        let salad = self.salad_api();
        let admin_stop = CancellationToken::new();
        let admin = tokio::spawn(admin::serve(
            self.admin_listener,
            parts.admin(),
            Arc::clone(&parts.admin_token),
            admin::Limits::from_config(&self.config),
            admin_stop.clone(),
        ));
        // Heartbeats run on this runtime with their own client, until the workers have drained.
        let heartbeats_stop = CancellationToken::new();
        let heartbeats = match upstream::build_client(&self.config, Arc::clone(&parts.gateway_key))
        {
            Ok(client) => Some(tokio::spawn(health::run(
                Arc::clone(&parts.registry),
                Arc::clone(&parts.health),
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
                registry: Arc::clone(&parts.registry),
                status: Arc::clone(&parts.discovery),
                readiness: Arc::clone(&parts.readiness),
                salad,
                gateway_key: Arc::clone(&parts.gateway_key),
            }
            .run(discovery_stop.clone()),
        );
        let reload_stop = CancellationToken::new();
        let reloads = self.config_path.clone().map(|path| {
            let target: Arc<dyn reload::Apply> = Arc::new(parts.clone());
            let current = Mutex::new(self.config.clone());
            tokio::spawn(reload::watch(
                path,
                current,
                target,
                hangups,
                reload_stop.clone(),
            ))
        });
        let mut workers = Vec::new();
        let count = self.proxy_listeners.len();
        for (index, listener) in self.proxy_listeners.into_iter().enumerate() {
            let (done, finished) = tokio::sync::oneshot::channel::<()>();
            let worker = Worker {
                listener,
                proxy: Arc::clone(&parts.proxy),
                metrics: Arc::clone(&parts.metrics),
                settings: self.server_settings.clone(),
                readiness: Arc::clone(&parts.readiness),
                shutdown: shutdown.clone(),
                config: self.config.clone(),
                gateway_key: Arc::clone(&parts.gateway_key),
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

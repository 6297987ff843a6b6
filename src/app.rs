//! Building and running tongs: the shared parts, the listeners, the worker threads, the background
//! tasks (admin port, heartbeats, discovery, reloads), and [`Parts::apply`], the one place a
//! configuration takes effect — at start and on every reload alike.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::Queue;
use crate::config::{Config, KeyError};
use crate::health::signals;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::readiness::Readiness;
use crate::registry::Registry;
use crate::route::{Pool, PoolError, Router};
use crate::server::{BindError, ServerSettings};
use crate::upstream::{GatewayKey, UpstreamClient, UpstreamError};
use crate::{admin, health, reload, server, source, upstream};

/// Why tongs could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error(transparent)]
    SaladKey(#[from] KeyError),
    #[error(transparent)]
    Pool(#[from] PoolError),
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
    /// The pools (each its fleet, queue and request path) and the way to them.
    pub router: Arc<Router>,
    pub readiness: Arc<Readiness>,
    /// What is recorded outside any pool (reloads, runtimes, requests no pool took).
    pub metrics: Arc<Metrics>,
    /// `Salad-Api-Key` for gateways, shared by every client and replaced by reloads.
    pub gateway_key: Arc<GatewayKey>,
    /// The bearer token the admin port requires (none: open), read again by every reload so a rotated
    /// Secret takes effect without a restart.
    pub admin_token: Arc<ArcSwapOption<String>>,
    /// The pod watches, one per group of pools that can share it.
    pub watches: Arc<source::kubernetes::hub::Hubs>,
    /// How many tongs replicas share the fleets (`replicas`), for the pools' fixed limits.
    pub replicas: Arc<source::kubernetes::replicas::Replicas>,
}

impl Parts {
    /// Parts with nothing configured yet; [`Parts::apply`] gives them a configuration.
    fn new() -> Parts {
        let metrics = Arc::new(Metrics::new());
        Parts {
            router: Arc::new(Router::new(Arc::clone(&metrics))),
            readiness: Arc::default(),
            metrics,
            gateway_key: Arc::default(),
            admin_token: Arc::default(),
            watches: Arc::default(),
            replicas: Arc::default(),
        }
    }

    /// The pool requests go to when nothing else says: `default`, or the first listed.
    pub fn main_pool(&self) -> Arc<Pool> {
        let pools = self.router.pools();
        pools
            .iter()
            .find(|p| &**p.name() == crate::config::DEFAULT_POOL)
            .or(pools.first())
            .cloned()
            .unwrap_or_else(|| Pool::new(crate::config::DEFAULT_POOL, self.router.intake()))
    }

    /// The main pool's request path (tests, the demo and benchmarks read it).
    pub fn proxy(&self) -> Arc<Proxy> {
        Arc::clone(self.main_pool().proxy())
    }

    /// The main pool's endpoints.
    pub fn registry(&self) -> Arc<Registry> {
        Arc::clone(self.main_pool().registry())
    }

    /// The main pool's queue.
    pub fn queue(&self) -> Arc<Queue> {
        Arc::clone(self.main_pool().queue())
    }

    /// Applies `config` to every part that can change while serving: request-path settings, the pools
    /// (limits, queues, heartbeats, static endpoints, discovery), the gateway key. Requests under way
    /// finish with what they started with; endpoints that stay keep their state.
    ///
    /// The secrets read from files are the only part that can fail: each one that cannot be read keeps
    /// the value in force, and is returned so the caller decides (fatal at start, logged on reload).
    pub fn apply(&self, config: &Config) -> Vec<AppError> {
        let mut errors = Vec::new();
        // The key file is read again, so a rotated Secret takes effect with the next reload.
        match config.salad.api_key() {
            Ok(key) => self.gateway_key.set(config, key.as_deref()),
            Err(err) => errors.push(AppError::SaladKey(err)),
        }
        errors.extend(self.router.apply(config).into_iter().map(AppError::Pool));
        self.replicas.configure(&config.replicas);
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
    fn admin(&self) -> admin::AdminState {
        admin::AdminState {
            readiness: Arc::clone(&self.readiness),
            router: Arc::clone(&self.router),
            metrics: Arc::clone(&self.metrics),
            replicas: Arc::clone(&self.replicas),
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
/// The runtime and pool are made before the thread starts, so heartbeats can be sent through them
/// (see [`health::Senders`]).
struct Worker {
    listener: std::net::TcpListener,
    runtime: WorkerRuntime,
    upstream: Arc<UpstreamClient>,
    router: Arc<Router>,
    metrics: Arc<Metrics>,
    settings: ServerSettings,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
    /// How many workers there are (each takes a share of the retry budget's floor).
    workers: usize,
}

/// A worker's runtime, made on the main thread and run on the worker's.
///
/// Dropping a runtime blocks until its tasks are gone, which tokio refuses within an async context: a
/// worker whose thread never started is dropped where it was made, so it is shut down in the
/// background then.
struct WorkerRuntime(Option<tokio::runtime::Runtime>);

impl WorkerRuntime {
    fn new() -> std::io::Result<WorkerRuntime> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(WorkerRuntime(Some(runtime)))
    }

    fn handle(&self) -> Option<&tokio::runtime::Handle> {
        self.0.as_ref().map(tokio::runtime::Runtime::handle)
    }
}

impl Drop for WorkerRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl Worker {
    /// Runs on the worker's thread until it has drained; the runtime goes with it.
    fn run(mut self) {
        let Some(runtime) = self.runtime.0.take() else {
            return;
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
            let worker = self.router.worker_path(self.upstream, self.workers);
            server::serve(
                listener,
                self.router,
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

    /// The main pool's endpoint registry (tests and discovery write to it).
    pub fn registry(&self) -> Arc<Registry> {
        self.parts.registry()
    }

    /// The main pool's queue of requests waiting for an endpoint.
    pub fn queue(&self) -> Arc<Queue> {
        self.parts.queue()
    }

    /// The SaladCloud API client for gateway lookups, when `salad.api` and a key are configured.
    fn salad_api(&self) -> Option<source::kubernetes::salad::SaladApi> {
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
        Some(source::kubernetes::salad::SaladApi::new(
            &salad.api.url,
            &salad.api.organization,
            &salad.api.project,
            key,
            Arc::new(client),
        ))
    }

    /// One of `count` workers, serving `listener`: its runtime and upstream pool made here, its thread
    /// started by [`App::run`]. `None` (logged) when either cannot be made.
    fn worker(
        &self,
        listener: std::net::TcpListener,
        count: usize,
        shutdown: &CancellationToken,
    ) -> Option<Worker> {
        let runtime = WorkerRuntime::new()
            .map_err(|err| tracing::error!(error = %err, "cannot start a worker runtime"))
            .ok()?;
        let upstream = upstream::build_client(&self.config, Arc::clone(&self.parts.gateway_key))
            .map_err(|err| tracing::error!(error = %err, "cannot build the upstream client"))
            .ok()?;
        Some(Worker {
            listener,
            runtime,
            upstream: Arc::new(upstream),
            router: Arc::clone(&self.parts.router),
            metrics: Arc::clone(&self.parts.metrics),
            settings: self.server_settings.clone(),
            readiness: Arc::clone(&self.parts.readiness),
            shutdown: shutdown.clone(),
            workers: count,
        })
    }

    /// Serves until `shutdown` is cancelled, then drains and returns.
    pub async fn run(mut self, shutdown: CancellationToken) {
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
            pools = parts.router.pools().len(),
            "tongs serving"
        );
        let salad = self.salad_api();
        let count = self.proxy_listeners.len();
        let workers: Vec<Worker> = std::mem::take(&mut self.proxy_listeners)
            .into_iter()
            .filter_map(|listener| self.worker(listener, count, &shutdown))
            .collect();
        // Started before the pools' heartbeats, which go to the workers that did start.
        let mut senders = Vec::new();
        let mut finishing = Vec::new();
        for (index, worker) in workers.into_iter().enumerate() {
            let sender = worker
                .runtime
                .handle()
                .map(|runtime| (runtime.clone(), Arc::clone(&worker.upstream)));
            let (done, finished) = tokio::sync::oneshot::channel::<()>();
            let spawned = std::thread::Builder::new()
                .name(format!("tongs-worker-{index}"))
                .spawn(move || {
                    worker.run();
                    let _ = done.send(());
                });
            match spawned {
                Ok(_) => {
                    finishing.push(finished);
                    senders.extend(sender);
                }
                Err(err) => tracing::error!(error = %err, "cannot start a worker thread"),
            }
        }
        let admin_stop = CancellationToken::new();
        let admin = tokio::spawn(admin::serve(
            self.admin_listener,
            parts.admin(),
            Arc::clone(&parts.admin_token),
            admin::AdminLimits::from_config(&self.config),
            admin_stop.clone(),
        ));
        // Each pool's heartbeats (their loops on the workers, see `health::Senders`) and pod watch run
        // until the workers have drained; pools a reload adds get theirs then.
        match upstream::build_client(&self.config, Arc::clone(&parts.gateway_key)) {
            Ok(client) => {
                let senders = health::Senders::new(client, senders);
                // What every pool's sources share: one pod watch serves every pool that can share it
                // (see `source::kubernetes::hub`).
                let shared = source::Shared {
                    watches: Arc::clone(&parts.watches),
                    salad: salad.clone(),
                    gateway_key: Arc::clone(&parts.gateway_key),
                };
                parts.router.start_pools(Box::new(move |pool: &Arc<Pool>| {
                    let stop = CancellationToken::new();
                    tokio::spawn(health::run(
                        Arc::clone(pool.registry()),
                        Arc::clone(pool.health()),
                        senders.clone(),
                        stop.clone(),
                    ));
                    tokio::spawn(signals::run(
                        Arc::clone(pool.registry()),
                        Arc::clone(pool.signals()),
                        senders.clone(),
                        stop.clone(),
                    ));
                    pool.sources().run(pool.name(), &shared, &stop);
                    pool.set_tasks(stop);
                }));
            }
            Err(err) => {
                tracing::error!(error = %err, "cannot build the heartbeat client; heartbeats and discovery are off");
            }
        }
        // The replica count follows tongs' own Service; each change reaches every pool's limits.
        let replicas_stop = CancellationToken::new();
        let replicas = {
            let (replicas, router, stop) = (
                Arc::clone(&parts.replicas),
                Arc::clone(&parts.router),
                replicas_stop.clone(),
            );
            tokio::spawn(async move {
                let mut counts = replicas.subscribe();
                let follow = async {
                    loop {
                        let count = *counts.borrow_and_update();
                        router.set_replicas(count);
                        if counts.changed().await.is_err() {
                            return;
                        }
                    }
                };
                // `run` returns once stopped; `follow` only if the count's sender is gone.
                tokio::select! {
                    () = replicas.run(stop) => {}
                    () = follow => {}
                }
            })
        };
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
        for finished in finishing {
            let _ = finished.await;
        }
        reload_stop.cancel();
        if let Some(reloads) = reloads {
            let _ = reloads.await;
        }
        parts.router.stop_pools();
        // The spans of the last requests, exported before tongs exits.
        parts.router.flush_traces().await;
        replicas_stop.cancel();
        let _ = replicas.await;
        admin_stop.cancel();
        let _ = admin.await;
        tracing::info!("tongs stopped");
    }
}

//! The admin listener, on its own port so probes and scrapes never queue behind client traffic.
//!
//! `/healthz`: the process is alive and serving. `/readyz`: the configuration is loaded and the first
//! discovery sync is done, and the process is not draining. Readiness deliberately ignores endpoint
//! health: an unready proxy is removed from its Service, which turns a clear 503 from tongs into
//! "connection refused" for every client. `/demand`: JSON with requests queued and outstanding, the
//! signal to scale the GPU fleet on (KEDA's `metrics-api` scaler reads `demand` from it).
//!
//! Connections get the client port's guard against silence (`timeouts.header_read`, see
//! [`server::sniff`]) and are capped at `admin.max_connections`, so idle ones cannot starve the probes.
//!
//! [`routes`] answers the read-only paths, [`auth`] guards them with the bearer token, and
//! [`register`] takes node registrations (which present their own token).

mod auth;
mod drain;
mod explain;
mod register;
mod routes;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use http::{Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower_http::compression::CompressionLayer;
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;
use tower_http::trace::{DefaultMakeSpan, DefaultOnResponse, TraceLayer};

use crate::admission::Refusal;
use crate::config::Config;
use crate::endpoint::EndpointView;
use crate::http::ProxyBody;
use crate::metrics::{Front, Metrics, Scrape};
use crate::readiness::Readiness;
use crate::route::{Pool, Router};
use crate::server;
use crate::source::kubernetes;

pub use register::{DRAIN_PATH, REGISTER_PATH};

/// What the admin port reads (and, for registrations, writes).
#[derive(Clone)]
pub struct AdminState {
    pub readiness: Arc<Readiness>,
    /// The pools: each one's request path, endpoints, queue and discovery.
    pub router: Arc<Router>,
    pub metrics: Arc<Metrics>,
    /// How many tongs replicas share the fleets' fixed limits.
    pub replicas: Arc<crate::source::kubernetes::replicas::Replicas>,
}

impl AdminState {
    /// Every endpoint of `pool` as operators see it now.
    pub(super) fn views(pool: &Pool) -> Vec<EndpointView> {
        let now = tokio::time::Instant::now();
        let settings = pool.proxy().settings();
        let (slow_start, max_age) = (
            settings.balance.slow_start,
            settings.balance.signals_max_age,
        );
        let registry = pool.registry();
        // The set, then those that left it with requests still on them (shown draining).
        let set = registry.snapshot();
        set.iter()
            .chain(registry.departing(&set).iter())
            .map(|endpoint| endpoint.view(now, slow_start, max_age))
            .collect()
    }

    /// Ready: not draining, and every pool's every source has its first list in.
    pub(super) fn ready(&self) -> bool {
        self.readiness.is_ready()
            && self
                .router
                .pools()
                .iter()
                .all(|pool| pool.sources().synced())
    }

    /// The `/metrics` page: recorded figures plus the state of things now.
    pub(super) fn metrics_page(&self) -> String {
        let pools = self.router.pools();
        let views: Vec<Vec<EndpointView>> = pools.iter().map(|p| AdminState::views(p)).collect();
        let scrapes: Vec<Scrape> = pools
            .iter()
            .zip(&views)
            .map(|(pool, endpoints)| {
                let queue = pool.queue();
                let demand = pool.registry().demand(queue.len());
                let stats = queue.stats();
                Scrape {
                    pool: pool.name(),
                    recorded: pool.metrics(),
                    queued: demand.queued,
                    demand: demand.demand,
                    capacity: demand.capacity,
                    rejections: Refusal::ALL
                        .into_iter()
                        .map(|reason| (reason.as_str(), stats.rejected(reason)))
                        .collect(),
                    stats: pool.proxy().stats(),
                    endpoints,
                    discovery: pool
                        .sources()
                        .get::<kubernetes::Pods>()
                        .map(|pods| pods.state().figures())
                        .unwrap_or_default(),
                }
            })
            .collect();
        let fallbacks = self.router.fallbacks();
        let tenants = self.router.tenants().all();
        let front = Front {
            stats: self.router.intake().stats(),
            fallbacks: &fallbacks,
            replicas: self.router.replicas(),
            tenants: &tenants,
            auth_failures: self.router.tenants().failures(),
        };
        self.metrics.render(&front, &scrapes)
    }
}

/// A response with `body` of `content_type`.
pub(super) fn typed(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<bytes::Bytes>,
) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

/// Marks an answer as live state: never cached, by browsers or by anything in between.
pub(super) fn no_store(mut response: Response<ProxyBody>) -> Response<ProxyBody> {
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    response
}

pub(super) fn answer(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    typed(status, "text/plain", text)
}

/// Connection-level limits of the admin port.
#[derive(Clone, Copy, Debug)]
pub struct AdminLimits {
    /// A connection must send its first request's head within this (`timeouts.header_read`, as on the
    /// client port).
    pub header_read_timeout: Duration,
    /// Most connections open at once (`admin.max_connections`).
    pub max_connections: usize,
}

impl AdminLimits {
    pub fn from_config(config: &Config) -> Self {
        AdminLimits {
            header_read_timeout: config.timeouts.header_read.get(),
            max_connections: config.admin.max_connections,
        }
    }
}

/// Serves the admin endpoints until `shutdown` is cancelled.
///
/// The port is guarded like the client one: a connection that sends no request within
/// `header_read_timeout` (nothing at all, half an HTTP/2 preface, half a head) is closed, and beyond
/// `max_connections` new connections are closed as they arrive, so idle connections cannot keep the
/// kubelet's probes out for longer than the header-read limit.
pub async fn serve(
    listener: TcpListener,
    state: AdminState,
    token: Arc<ArcSwapOption<String>>,
    limits: AdminLimits,
    shutdown: CancellationToken,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    // The answers behind tower-http's layers: the `Authorization` header marked sensitive (never shown
    // by the trace layer or any log), each request traced at debug level (probes come every few
    // seconds), answers gzipped for clients that ask (Prometheus does: `/metrics` is the one large
    // answer), and the bearer token checked ([`auth::AdminToken`]).
    let routes = tower::service_fn(move |request: Request<Incoming>| {
        let state = state.clone();
        async move {
            let path = request.uri().path().to_owned();
            let response = if path == REGISTER_PATH || path == DRAIN_PATH {
                // Nodes present their own token, not the admin one.
                register::node_call(&path, request, &state.router).await
            } else if path == drain::DRAIN_ENDPOINT_PATH || path == drain::UNDRAIN_ENDPOINT_PATH {
                let draining = path == drain::DRAIN_ENDPOINT_PATH;
                drain::drain(request, &state.router, draining).await
            } else if path == explain::PICK_PATH {
                explain::pick(request, &state.router).await
            } else {
                routes::route(&request, &state)
            };
            Ok::<_, Infallible>(response)
        }
    });
    let stack = tower::ServiceBuilder::new()
        .layer(SetSensitiveRequestHeadersLayer::new([
            header::AUTHORIZATION,
        ]))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(DefaultMakeSpan::new().level(tracing::Level::DEBUG))
                .on_response(DefaultOnResponse::new().level(tracing::Level::DEBUG)),
        )
        .layer(CompressionLayer::new().gzip(true))
        .layer(auth::AdminToken(token).layer())
        .service(routes);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Whether the last connection found the port full: the warning is logged once per episode.
    let mut full = false;
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, client)) = accepted else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            if !std::mem::replace(&mut full, true) {
                tracing::warn!(
                    client = %client,
                    max_connections = limits.max_connections,
                    "admin port full (admin.max_connections); closing new connections until some end"
                );
            }
            drop(stream);
            continue;
        };
        full = false;
        let service = TowerToHyperService::new(stack.clone());
        let builder = builder.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let stream = match server::sniff(stream, limits.header_read_timeout).await {
                Ok(stream) => stream,
                Err(why) => {
                    tracing::debug!(client = %client, why, "admin connection closed before its first request");
                    return;
                }
            };
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

//! The admin listener, on its own port so probes and scrapes never queue behind client traffic.
//!
//! `/healthz`: the process is alive and serving. `/readyz`: the configuration is loaded and the first
//! discovery sync is done, and the process is not draining. Readiness deliberately ignores endpoint
//! health: an unready proxy is removed from its Service, which turns a clear 503 from tongs into
//! "connection refused" for every client. `/demand`: JSON with requests queued and outstanding, the
//! signal to scale the GPU fleet on (KEDA's `metrics-api` scaler reads `demand` from it).
//!
//! [`routes`] answers the read-only paths, [`auth`] guards them with the bearer token, and
//! [`register`] takes node registrations (which present their own token).

mod auth;
mod register;
mod routes;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::{Queue, Refusal};
use crate::discovery;
use crate::endpoint::EndpointView;
use crate::http::ProxyBody;
use crate::metrics::{Metrics, Scrape};
use crate::proxy::Proxy;
use crate::readiness::Readiness;
use crate::registry::Registry;

pub use register::REGISTER_PATH;

/// What the admin port reads (and, for registrations, writes).
#[derive(Clone)]
pub struct State {
    pub readiness: Arc<Readiness>,
    /// The request path's settings, counters and fleet latency.
    pub proxy: Arc<Proxy>,
    pub registry: Arc<Registry>,
    pub queue: Arc<Queue>,
    pub discovery: Arc<discovery::Status>,
    pub metrics: Arc<Metrics>,
}

impl State {
    /// Every endpoint as operators see it now.
    pub(super) fn views(&self) -> Vec<EndpointView> {
        let now = tokio::time::Instant::now();
        let slow_start = self.proxy.settings().slow_start;
        self.registry
            .snapshot()
            .iter()
            .map(|endpoint| endpoint.view(now, slow_start))
            .collect()
    }

    /// The `/metrics` page: recorded figures plus the state of things now.
    pub(super) fn metrics_page(&self) -> String {
        let endpoints = self.views();
        let demand = self.registry.demand(self.queue.len());
        let stats = self.queue.stats();
        self.metrics.render(&Scrape {
            queued: demand.queued,
            demand: demand.demand,
            capacity: demand.capacity,
            rejections: Refusal::ALL
                .into_iter()
                .map(|reason| (reason.as_str(), stats.rejected(reason)))
                .collect(),
            stats: self.proxy.stats(),
            endpoints: &endpoints,
            discovery: self.discovery.figures(),
        })
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

/// Serves the admin endpoints until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    state: State,
    token: Option<Arc<str>>,
    shutdown: CancellationToken,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10));
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (state, token) = (state.clone(), token.clone());
        let service = service_fn(move |request: Request<Incoming>| {
            let (state, token) = (state.clone(), token.clone());
            async move {
                let response = if request.uri().path() == REGISTER_PATH {
                    // Nodes present their own token, not the admin one.
                    register::register(request, &state.discovery).await
                } else {
                    match &token {
                        Some(token) if !auth::authorized(&request, token) => auth::unauthorized(),
                        _ => routes::route(&request, &state),
                    }
                };
                Ok::<_, Infallible>(response)
            }
        });
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
}

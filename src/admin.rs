//! The admin listener, on its own port so probes and scrapes never queue behind client traffic.
//!
//! `/healthz`: the process is alive and serving. `/readyz`: the configuration is loaded and the first
//! discovery sync is done, and the process is not draining. Readiness deliberately ignores endpoint
//! health: an unready proxy is removed from its Service, which turns a clear 503 from tongs into
//! "connection refused" for every client. `/demand`: JSON with requests queued and outstanding, the
//! signal to scale the GPU fleet on (KEDA's `metrics-api` scaler reads `demand` from it).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::{Queue, Reason};
use crate::discovery;
use crate::http::ProxyBody;
use crate::metrics::{Metrics, Scrape};
use crate::proxy::Proxy;
use crate::readiness::Readiness;
use crate::registry::Registry;

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
    /// The `/metrics` page: recorded figures plus the state of things now.
    fn metrics_page(&self) -> String {
        let now = tokio::time::Instant::now();
        let slow_start = self.proxy.settings().slow_start;
        let endpoints: Vec<_> = self
            .registry
            .snapshot()
            .iter()
            .map(|endpoint| endpoint.view(now, slow_start))
            .collect();
        let demand = self.registry.demand(self.queue.len());
        let stats = self.queue.stats();
        self.metrics.render(&Scrape {
            queued: demand.queued,
            demand: demand.demand,
            capacity: demand.capacity,
            rejections: Reason::ALL
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
fn typed(
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

fn answer(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    typed(status, "text/plain", text)
}

/// Whether `request` may see the admin port: the kubelet's probes and the (data-free) status page always
/// may; everything else needs the bearer token.
fn authorized(request: &Request<Incoming>, token: &str) -> bool {
    if matches!(request.uri().path(), "/healthz" | "/readyz" | "/") {
        return true;
    }
    let Some(given) = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    // Compared in time independent of where the first difference is.
    let (a, b) = (given.trim().as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn unauthorized() -> Response<ProxyBody> {
    let mut response = answer(
        StatusCode::UNAUTHORIZED,
        "this admin path needs Authorization: Bearer <token> (admin.bearer_token_file)\n",
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    response
}

/// The status page: one self-contained HTML file (no external assets) that polls /debug/endpoints.
const STATUS_PAGE: &str = include_str!("status.html");

fn json(value: &impl serde::Serialize) -> Response<ProxyBody> {
    let body = serde_json::to_string(value).unwrap_or_default();
    typed(StatusCode::OK, "application/json", body)
}

fn route(request: &Request<Incoming>, state: &State) -> Response<ProxyBody> {
    let (registry, proxy, queue) = (&state.registry, &state.proxy, &state.queue);
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return answer(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
    }
    let mut response = match request.uri().path() {
        "/" => typed(StatusCode::OK, "text/html; charset=utf-8", STATUS_PAGE),
        "/healthz" => answer(StatusCode::OK, "ok\n"),
        "/readyz" if state.readiness.is_ready() => answer(StatusCode::OK, "ready\n"),
        "/readyz" => answer(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        "/demand" => json(&registry.demand(queue.len())),
        "/debug/endpoints" => {
            let now = tokio::time::Instant::now();
            let slow_start = proxy.settings().slow_start;
            let endpoints: Vec<_> = registry
                .snapshot()
                .iter()
                .map(|e| e.view(now, slow_start))
                .collect();
            json(&serde_json::json!({
                "endpoints": endpoints,
                "demand": registry.demand(queue.len()),
                "queue": {
                    "waiting": queue.len(),
                    "retry_after_seconds": queue.retry_after(),
                },
                "balancer": {
                    "policy": proxy.settings().policy,
                    "fleet_latency_ms": proxy.fleet_latency_us() as f64 / 1000.0,
                },
            }))
        }
        "/metrics" => typed(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            state.metrics_page(),
        ),
        _ => answer(
            StatusCode::NOT_FOUND,
            "not found: try /healthz, /readyz, /metrics, /demand or /debug/endpoints\n",
        ),
    };
    // Everything here is live state: never cached, by browsers or by anything in between.
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    response
}

/// Where nodes register their address.
pub const REGISTER_PATH: &str = "/v1/nodes/register";

/// `POST /v1/nodes/register`: see [`crate::discovery::register`].
async fn register(request: Request<Incoming>, status: &discovery::Status) -> Response<ProxyBody> {
    use http_body_util::BodyExt;
    if request.method() != Method::POST {
        return answer(StatusCode::METHOD_NOT_ALLOWED, "POST a registration here\n");
    }
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let limit = crate::discovery::register::MAX_BODY_BYTES;
    let body = match tokio::time::timeout(
        Duration::from_secs(10),
        http_body_util::Limited::new(request.into_body(), limit).collect(),
    )
    .await
    {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(_)) => {
            return answer(
                StatusCode::PAYLOAD_TOO_LARGE,
                "registration body too large or broken\n",
            );
        }
        Err(_) => return answer(StatusCode::REQUEST_TIMEOUT, "registration body too slow\n"),
    };
    let token = status.registration_token();
    let outcome = crate::discovery::register::register(
        status,
        token.as_deref().map(String::as_str),
        authorization.as_deref(),
        &body,
    )
    .await;
    let mut response = typed(outcome.status, "application/json", outcome.body.to_string());
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    response
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
                    register(request, &state.discovery).await
                } else {
                    match &token {
                        Some(token) if !authorized(&request, token) => unauthorized(),
                        _ => route(&request, &state),
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

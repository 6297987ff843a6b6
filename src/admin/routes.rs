//! The admin port's read-only paths: probes, the status page, demand, endpoints and metrics.

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use super::{State, answer, no_store, typed};
use crate::http::ProxyBody;

/// The status page: one self-contained HTML file (no external assets) that polls /debug/endpoints.
const STATUS_PAGE: &str = include_str!("status.html");

fn json(value: &impl serde::Serialize) -> Response<ProxyBody> {
    let body = serde_json::to_string(value).unwrap_or_default();
    typed(StatusCode::OK, "application/json", body)
}

pub(super) fn route(request: &Request<Incoming>, state: &State) -> Response<ProxyBody> {
    let (registry, proxy, queue) = (&state.registry, &state.proxy, &state.queue);
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return answer(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
    }
    let response = match request.uri().path() {
        "/" => typed(StatusCode::OK, "text/html; charset=utf-8", STATUS_PAGE),
        "/healthz" => answer(StatusCode::OK, "ok\n"),
        "/readyz" if state.readiness.is_ready() => answer(StatusCode::OK, "ready\n"),
        "/readyz" => answer(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        "/demand" => json(&registry.demand(queue.len())),
        "/debug/endpoints" => {
            let endpoints = state.views();
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
    no_store(response)
}

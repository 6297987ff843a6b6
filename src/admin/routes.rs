//! The admin port's read-only paths: probes, the status page, demand, endpoints and metrics.

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use super::{AdminState, answer, no_store, typed};
use crate::http::ProxyBody;

/// The status page: one self-contained HTML file (no external assets) that polls /debug/endpoints.
const STATUS_PAGE: &str = include_str!("status.html");

fn json(value: &impl serde::Serialize) -> Response<ProxyBody> {
    let body = serde_json::to_string(value).unwrap_or_default();
    typed(StatusCode::OK, "application/json", body)
}

pub(super) fn route(request: &Request<Incoming>, state: &AdminState) -> Response<ProxyBody> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return answer(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
    }
    let pools = state.router.pools();
    let response = match request.uri().path() {
        "/" => typed(StatusCode::OK, "text/html; charset=utf-8", STATUS_PAGE),
        "/healthz" => answer(StatusCode::OK, "ok\n"),
        "/readyz" if state.ready() => answer(StatusCode::OK, "ready\n"),
        "/readyz" => answer(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        "/demand" => json(&demand(&pools)),
        "/debug/endpoints" => {
            let mut endpoints = Vec::new();
            let mut by_pool = Vec::new();
            for pool in pools.iter() {
                let views = AdminState::views(pool);
                let queue = pool.queue();
                let proxy = pool.proxy();
                for view in &views {
                    let mut value = serde_json::to_value(view).unwrap_or_default();
                    value["pool"] = (**pool.name()).into();
                    endpoints.push(value);
                }
                by_pool.push(serde_json::json!({
                    "name": &**pool.name(),
                    "endpoints": views.len(),
                    "demand": pool.registry().demand(queue.len()),
                    "queue": {
                        "waiting": queue.len(),
                        "retry_after_seconds": queue.retry_after(),
                    },
                    "balancer": balancer(proxy),
                    "sources": pool.sources().statuses(),
                }));
            }
            // The top level keeps the shape it had before pools: the main pool's figures.
            let main = by_pool
                .iter()
                .find(|p| p["name"] == crate::config::DEFAULT_POOL)
                .or(by_pool.first())
                .cloned()
                .unwrap_or_default();
            json(&serde_json::json!({
                "endpoints": endpoints,
                "demand": demand(&pools),
                "queue": main["queue"],
                "balancer": main["balancer"],
                "sources": main["sources"],
                "pools": by_pool,
                "replicas": state.replicas.view(),
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

/// A pool's pick as configured and what it keeps: its scorers with their weights, its filters, its
/// prefix index.
fn balancer(proxy: &crate::proxy::Proxy) -> serde_json::Value {
    let settings = proxy.settings();
    let pipeline = &settings.balance.pipeline;
    let weights: serde_json::Map<String, serde_json::Value> = pipeline
        .weights()
        .map(|(name, weight)| (name.to_owned(), weight.into()))
        .collect();
    let index = proxy.prefix_index();
    serde_json::json!({
        "policy": settings.balance.policy,
        "scorers": pipeline.scorer_names().collect::<Vec<_>>(),
        "weights": weights,
        "filters": pipeline.filter_names().collect::<Vec<_>>(),
        "fleet_latency_ms": proxy.fleet_latency_us() as f64 / 1000.0,
        "prefix_index": {"blocks": index.len(), "capacity": index.capacity()},
    })
}

/// Demand over every pool, and each pool's (what KEDA scales on, per pool or in total).
fn demand(pools: &[std::sync::Arc<crate::route::Pool>]) -> serde_json::Value {
    let mut total =
        serde_json::json!({"queued": 0u64, "outstanding": 0u64, "demand": 0u64, "endpoints": 0u64});
    let mut capacity = Some(0u64);
    let mut by_pool = serde_json::Map::new();
    for pool in pools {
        let demand = pool.registry().demand(pool.queue().len());
        for (key, value) in [
            ("queued", demand.queued),
            ("outstanding", demand.outstanding),
            ("demand", demand.demand),
            ("endpoints", demand.endpoints),
        ] {
            total[key] = (total[key].as_u64().unwrap_or(0) + value).into();
        }
        capacity = capacity.zip(demand.capacity).map(|(a, b)| a + b);
        by_pool.insert(
            pool.name().to_string(),
            serde_json::to_value(&demand).unwrap_or_default(),
        );
    }
    total["capacity"] = capacity.into();
    total["pools"] = by_pool.into();
    total
}

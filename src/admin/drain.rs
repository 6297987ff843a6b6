//! `POST /endpoints/drain` and `POST /endpoints/undrain`, body `{"url": URL}`: an operator drains an
//! endpoint by its URL, in every pool that has it, and undoes it. Behind the admin token like the rest
//! of the admin port. Draining: no new request, those in flight finish, nothing counts against it;
//! its streams are left to finish (nothing says the node goes, so none is moved). Meant for static
//! endpoints above all: a pod's endpoint drains by its node's own word or its deletion (see
//! `docs/operations.md`, "Nodes that announce their end").

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::{answer, no_store, typed};
use crate::endpoint::Announcer;
use crate::http::ProxyBody;
use crate::route::Router;

/// Where an operator drains an endpoint.
pub const DRAIN_ENDPOINT_PATH: &str = "/endpoints/drain";

/// Where an operator undoes it.
pub const UNDRAIN_ENDPOINT_PATH: &str = "/endpoints/undrain";

/// Largest body read: a URL.
const MAX_BODY: usize = 16 * 1024;

/// What the operator sends.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Named {
    url: String,
}

/// Drains (`drain`) or undrains the endpoint the body names.
pub(super) async fn drain(
    request: Request<Incoming>,
    router: &Router,
    drain: bool,
) -> Response<ProxyBody> {
    if request.method() != Method::POST {
        return answer(StatusCode::METHOD_NOT_ALLOWED, "POST {\"url\": ...} here\n");
    }
    let body = match tokio::time::timeout(
        Duration::from_secs(10),
        http_body_util::Limited::new(request.into_body(), MAX_BODY).collect(),
    )
    .await
    {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(_)) => return answer(StatusCode::PAYLOAD_TOO_LARGE, "body too large or broken\n"),
        Err(_) => return answer(StatusCode::REQUEST_TIMEOUT, "body too slow\n"),
    };
    let named: Named = match serde_json::from_slice(&body) {
        Ok(named) => named,
        Err(err) => {
            return typed(
                StatusCode::BAD_REQUEST,
                "text/plain",
                format!("body must be JSON {{\"url\": \"http://host:port\"}}: {err}\n"),
            );
        }
    };
    let now = Instant::now();
    let notice = drain.then_some(None);
    let pools: Vec<String> = router
        .pools()
        .iter()
        .filter_map(|pool| {
            let endpoint = pool.registry().endpoint_at(&named.url)?;
            endpoint.set_announced(Announcer::Operator, notice, now);
            Some(pool.name().to_string())
        })
        .collect();
    if pools.is_empty() {
        return typed(
            StatusCode::NOT_FOUND,
            "text/plain",
            format!("no pool has an endpoint at {}\n", named.url),
        );
    }
    tracing::info!(url = %named.url, ?pools, drain, "an operator drained or undrained an endpoint");
    let body = serde_json::json!({ "url": named.url, "draining": drain, "pools": pools });
    no_store(typed(StatusCode::OK, "application/json", body.to_string()))
}

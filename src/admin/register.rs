//! `POST /v1/nodes/register`: a node tells tongs its address (see [`crate::discovery::register`]).

use std::time::Duration;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;

use super::{answer, no_store, typed};
use crate::discovery;
use crate::http::ProxyBody;
use crate::route::Router;

/// Where nodes register their address.
pub const REGISTER_PATH: &str = "/v1/nodes/register";

/// `POST /v1/nodes/register`: see [`crate::discovery::register`].
pub(super) async fn register(request: Request<Incoming>, router: &Router) -> Response<ProxyBody> {
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
    let status = &*pool_of(router, &body);
    let token = status.registration_token();
    let outcome = crate::discovery::register::register(
        status,
        token.as_deref().map(String::as_str),
        authorization.as_deref(),
        &body,
    )
    .await;
    no_store(typed(
        outcome.status,
        "application/json",
        outcome.body.to_string(),
    ))
}

/// The discovery of the pool whose pod watch holds the pod `body` names; else the first that takes
/// registrations (its answer says the pod is unknown), else the first pool's (registration is off).
fn pool_of(router: &Router, body: &[u8]) -> std::sync::Arc<discovery::Status> {
    let pools = router.pools();
    let key = serde_json::from_slice::<discovery::register::Registration>(body)
        .ok()
        .map(|r| format!("{}/{}", r.namespace, r.pod));
    let watching = |pool: &&std::sync::Arc<crate::route::Pool>| {
        let (Some(key), Some(watched)) = (&key, pool.discovery().watched()) else {
            return false;
        };
        watched.tracker().pod(key).is_some()
    };
    pools
        .iter()
        .find(watching)
        .or_else(|| {
            pools
                .iter()
                .find(|pool| pool.discovery().registration_token().is_some())
        })
        .or(pools.first())
        .map(|pool| std::sync::Arc::clone(pool.discovery()))
        .unwrap_or_default()
}

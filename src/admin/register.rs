//! `POST /v1/nodes/register`: a node tells tongs its address; `POST /v1/nodes/drain`: a node tells
//! tongs it is going (see [`crate::source::kubernetes::register`]).

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;

use super::{answer, no_store, typed};
use crate::http::ProxyBody;
use crate::route::Router;
use crate::source::kubernetes;

/// Where nodes register their address.
pub const REGISTER_PATH: &str = "/v1/nodes/register";

/// Where nodes say they are going.
pub const DRAIN_PATH: &str = "/v1/nodes/drain";

/// `POST /v1/nodes/register` or `POST /v1/nodes/drain` (`path`): see
/// [`crate::source::kubernetes::register`].
pub(super) async fn node_call(
    path: &str,
    request: Request<Incoming>,
    router: &Router,
) -> Response<ProxyBody> {
    use http_body_util::BodyExt;
    if request.method() != Method::POST {
        return answer(StatusCode::METHOD_NOT_ALLOWED, "POST a node's call here\n");
    }
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let limit = crate::source::kubernetes::register::MAX_BODY_BYTES;
    let body = match tokio::time::timeout(
        Duration::from_secs(10),
        http_body_util::Limited::new(request.into_body(), limit).collect(),
    )
    .await
    {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(_)) => {
            return answer(StatusCode::PAYLOAD_TOO_LARGE, "body too large or broken\n");
        }
        Err(_) => return answer(StatusCode::REQUEST_TIMEOUT, "body too slow\n"),
    };
    let status = &*pool_of(router, &body);
    let token = status.registration_token();
    let (token, authorization) = (
        token.as_deref().map(String::as_str),
        authorization.as_deref(),
    );
    let outcome = if path == DRAIN_PATH {
        kubernetes::register::drain(status, token, authorization, &body).await
    } else {
        kubernetes::register::register(status, token, authorization, &body).await
    };
    no_store(typed(
        outcome.status,
        "application/json",
        outcome.body.to_string(),
    ))
}

/// The discovery of the pool whose pod watch holds the pod `body` names; else the first that takes
/// node calls (its answer says the pod is unknown), else the first pool's (node calls are off).
fn pool_of(router: &Router, body: &[u8]) -> Arc<kubernetes::Status> {
    /// The pod a node's call names, whichever call it is.
    #[derive(serde::Deserialize)]
    struct Named {
        namespace: String,
        pod: String,
    }
    let pools = router.pools();
    let key = serde_json::from_slice::<Named>(body)
        .ok()
        .map(|r| format!("{}/{}", r.namespace, r.pod));
    let statuses: Vec<&Arc<kubernetes::Status>> = pools
        .iter()
        .filter_map(|pool| pool.sources().get::<kubernetes::Pods>())
        .map(kubernetes::Pods::state)
        .collect();
    let watching = |status: &&&Arc<kubernetes::Status>| {
        let (Some(key), Some(watched)) = (&key, status.watched()) else {
            return false;
        };
        watched.tracker().pod(key).is_some()
    };
    statuses
        .iter()
        .find(watching)
        .or_else(|| {
            statuses
                .iter()
                .find(|status| status.registration_token().is_some())
        })
        .or(statuses.first())
        .map(|status| Arc::clone(status))
        .unwrap_or_default()
}

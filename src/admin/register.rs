//! `POST /v1/nodes/register`: a node tells tongs its address (see [`crate::discovery::register`]).

use std::time::Duration;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;

use super::{answer, no_store, typed};
use crate::discovery;
use crate::http::ProxyBody;

/// Where nodes register their address.
pub const REGISTER_PATH: &str = "/v1/nodes/register";

/// `POST /v1/nodes/register`: see [`crate::discovery::register`].
pub(super) async fn register(
    request: Request<Incoming>,
    status: &discovery::Status,
) -> Response<ProxyBody> {
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
    no_store(typed(
        outcome.status,
        "application/json",
        outcome.body.to_string(),
    ))
}

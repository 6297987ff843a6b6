//! `POST /debug/pick?pool=NAME&path=PATH`: what this replica's pick would do for the request in the
//! body (an OpenAI completion or chat body, the session header as a client would send it), and why:
//! its prefix matches, its conversation's and session's rendezvous homes, the endpoints saturation keeps
//! out, and the endpoint it would choose. Nothing is sent. Operators ask each replica the same question
//! to check that they place a conversation alike.

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::{answer, typed};
use crate::http::ProxyBody;
use crate::route::Router;

/// The path.
pub const PICK_PATH: &str = "/debug/pick";

/// Largest body read (a long prompt fits).
const MAX_BODY: usize = 4 << 20;

pub(super) async fn pick(request: Request<Incoming>, router: &Router) -> Response<ProxyBody> {
    if request.method() != Method::POST {
        return answer(
            StatusCode::METHOD_NOT_ALLOWED,
            "POST an OpenAI request body here\n",
        );
    }
    let query = request.uri().query().unwrap_or("").to_owned();
    let param = |name: &str| {
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(key, _)| *key == name)
            .map(|(_, value)| value.to_owned())
    };
    let path = param("path").unwrap_or_else(|| "/v1/chat/completions".to_owned());
    let pool = match param("pool") {
        Some(name) => router.pool(&name),
        None => router
            .pool(crate::config::DEFAULT_POOL)
            .or_else(|| router.pools().first().cloned()),
    };
    let Some(pool) = pool else {
        return answer(StatusCode::NOT_FOUND, "no such pool\n");
    };
    let (head, body) = request.into_parts();
    let body = match tokio::time::timeout(
        Duration::from_secs(10),
        http_body_util::Limited::new(body, MAX_BODY).collect(),
    )
    .await
    {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(_)) => return answer(StatusCode::PAYLOAD_TOO_LARGE, "body too large or broken\n"),
        Err(_) => return answer(StatusCode::REQUEST_TIMEOUT, "body too slow\n"),
    };
    let explanation = pool.proxy().explain(&path, &body, &head.headers);
    typed(
        StatusCode::OK,
        "application/json",
        serde_json::to_string(&explanation).unwrap_or_default(),
    )
}

//! The admin port's bearer token: every path but the kubelet's probes and the status page needs it.

use http::{Request, Response, StatusCode, header};
use hyper::body::Incoming;

use super::answer;
use crate::http::ProxyBody;

/// Whether `request` may see the admin port: the kubelet's probes and the (data-free) status page always
/// may; everything else needs the bearer token.
pub(super) fn authorized(request: &Request<Incoming>, token: &str) -> bool {
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

pub(super) fn unauthorized() -> Response<ProxyBody> {
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

//! The admin port's bearer token: every path but the kubelet's probes, the status page and node
//! registration (which presents its own token) needs it.
//!
//! It is tower-http's request validation layer ([`ValidateRequestHeaderLayer::custom`]) with a check of
//! tongs' own: the token is the one in force now (a reload rotates it), some paths are open, and the
//! comparison takes the same time wherever the first difference is, which tower-http's own bearer check
//! does not promise.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use http::{Request, Response, StatusCode, header};
use tower_http::validate_request::{ValidateRequest, ValidateRequestHeaderLayer};

use super::answer;
use super::register::{DRAIN_PATH, REGISTER_PATH};
use crate::http::ProxyBody;

/// The admin token in force, as a validation layer.
#[derive(Clone)]
pub(super) struct AdminToken(pub Arc<ArcSwapOption<String>>);

impl AdminToken {
    pub(super) fn layer(self) -> ValidateRequestHeaderLayer<AdminToken> {
        ValidateRequestHeaderLayer::custom(self)
    }
}

impl<B> ValidateRequest<B> for AdminToken {
    type ResponseBody = ProxyBody;

    fn validate(&mut self, request: &mut Request<B>) -> Result<(), Response<ProxyBody>> {
        match &*self.0.load() {
            Some(token) if !authorized(request, token) => Err(unauthorized()),
            _ => Ok(()),
        }
    }
}

/// Whether `request` may see the admin port: the kubelet's probes and the (data-free) status page always
/// may; everything else needs the bearer token.
pub(super) fn authorized<B>(request: &Request<B>, token: &str) -> bool {
    if matches!(
        request.uri().path(),
        "/healthz" | "/readyz" | "/" | REGISTER_PATH | DRAIN_PATH
    ) {
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
    // Compared in time independent of where the first difference is, as registration compares its
    // fleet token (one comparison, `subtle`'s, for every secret tongs checks).
    crate::source::kubernetes::register::secret_matches(given, token)
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

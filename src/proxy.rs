//! The request handler: pick an endpoint, rewrite the request, send it, stream the answer back.
//!
//! One attempt per request for now; the attempt is shaped so that the resilience work can wrap it in a
//! loop (pick with an exclusion set → send → classify → maybe retry elsewhere). The handler never panics
//! on input and never waits without a deadline: every await here is bounded by a configured timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::balance;
use crate::body::ProxyBody;
use crate::config::Config;
use crate::endpoint::{Endpoint, Outstanding};
use crate::error::{ProxyError, describe};
use crate::headers::{self, X_REQUEST_ID};
use crate::registry::Registry;
use crate::upstream::{UpstreamBody, UpstreamClient};

/// The settings the request path reads on every request.
#[derive(Clone, Debug)]
pub struct ProxySettings {
    pub response_headers_timeout: Duration,
    pub total_timeout: Duration,
    pub max_body_bytes: Option<u64>,
}

impl ProxySettings {
    pub fn from_config(config: &Config) -> Self {
        ProxySettings {
            response_headers_timeout: config.timeouts.response_headers.get(),
            total_timeout: config.timeouts.total.get(),
            max_body_bytes: config.limits.max_body_bytes,
        }
    }
}

/// Counters of the request path as a whole (per-endpoint counters live on the endpoint).
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Requests received.
    pub requests: AtomicU64,
    /// Requests answered by tongs itself because no endpoint was available.
    pub rejected: AtomicU64,
    /// Requests that failed at an endpoint (502/504 from tongs).
    pub failed: AtomicU64,
    /// Extra attempts sent to another endpoint after a failed one.
    pub retries: AtomicU64,
}

/// Shared state of the request path.
///
/// Shared by every worker thread; each worker passes its own pooled [`UpstreamClient`] so connections
/// stay on the thread that uses them.
pub struct Proxy {
    registry: Arc<Registry>,
    settings: ProxySettings,
    stats: ProxyStats,
    /// Upgraded (WebSocket) connections, tracked so graceful shutdown can wait for them.
    upgrades: TaskTracker,
}

impl Proxy {
    pub fn new(registry: Arc<Registry>, settings: ProxySettings) -> Self {
        Proxy {
            registry,
            settings,
            stats: ProxyStats::default(),
            upgrades: TaskTracker::new(),
        }
    }

    pub fn stats(&self) -> &ProxyStats {
        &self.stats
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    pub fn upgrades(&self) -> &TaskTracker {
        &self.upgrades
    }

    /// Handles one client request; always produces a response.
    pub async fn handle(
        &self,
        upstream: &UpstreamClient,
        mut request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let request_id = headers::request_id(request.headers());

        if let Some(limit) = self.settings.max_body_bytes
            && content_length(&request).is_some_and(|length| length > limit)
        {
            return self.reject(ProxyError::BodyTooLarge { limit }, &request_id, None);
        }

        let endpoint = {
            let snapshot = self.registry.snapshot();
            match balance::pick(&snapshot, &[]) {
                Some(endpoint) => Arc::clone(endpoint),
                None => return self.reject(ProxyError::NoEndpoint, &request_id, None),
            }
        };
        let outstanding = endpoint.start_request();

        // Only an HTTP/1.1 client can switch protocols; its half of the upgrade must be claimed before the
        // request is taken apart.
        let upgrade =
            request.version() == Version::HTTP_11 && headers::is_upgrade_request(request.headers());
        let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut request));

        let upstream_request =
            self.upstream_request(request, &endpoint, &request_id, client, upgrade);
        let headers_timeout = self
            .settings
            .response_headers_timeout
            .min(self.settings.total_timeout);
        let sent =
            tokio::time::timeout(headers_timeout, upstream.request(upstream_request)).await;
        let mut response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => {
                let error = self.classify(&endpoint, &err);
                return self.reject(error, &request_id, Some(&endpoint));
            }
            Err(_elapsed) => {
                let error = ProxyError::ResponseTimeout {
                    endpoint: endpoint.url().to_owned(),
                    after: headers_timeout,
                };
                return self.reject(error, &request_id, Some(&endpoint));
            }
        };

        tracing::debug!(
            request_id = request_id.to_str().unwrap_or_default(),
            endpoint = endpoint.url(),
            status = response.status().as_u16(),
            "response headers"
        );

        if response.status() == StatusCode::SWITCHING_PROTOCOLS
            && let Some(client_upgrade) = client_upgrade
        {
            let upstream_upgrade = hyper::upgrade::on(&mut response);
            self.bridge_upgrade(client_upgrade, upstream_upgrade, outstanding, &request_id);
            let (mut parts, _) = response.into_parts();
            headers::strip_hop_by_hop(&mut parts.headers, true);
            parts.headers.insert(&X_REQUEST_ID, request_id);
            return Response::from_parts(parts, ProxyBody::empty());
        }

        let (mut parts, body) = response.into_parts();
        headers::strip_hop_by_hop(&mut parts.headers, false);
        parts.headers.insert(&X_REQUEST_ID, request_id);
        let deadline = tokio::time::sleep_until(started + self.settings.total_timeout);
        let body = ProxyBody::upstream(body, outstanding, deadline, self.settings.total_timeout);
        Response::from_parts(parts, body)
    }

    /// The client's request rewritten for the endpoint.
    fn upstream_request(
        &self,
        request: Request<Incoming>,
        endpoint: &Endpoint,
        request_id: &HeaderValue,
        client: SocketAddr,
        upgrade: bool,
    ) -> Request<UpstreamBody> {
        let (mut parts, body) = request.into_parts();
        let original_host = original_host(&parts);
        parts.uri = upstream_uri(endpoint, &parts.uri);
        // The endpoint speaks whatever version its connection negotiated; hyper wants 1.1 here and
        // switches to HTTP/2 by itself when ALPN chose it.
        parts.version = Version::HTTP_11;
        let headers = &mut parts.headers;
        headers::strip_hop_by_hop(headers, upgrade);
        headers::add_forwarded(headers, client.ip(), original_host);
        headers.insert(header::HOST, endpoint.host_header().clone());
        headers.insert(&X_REQUEST_ID, request_id.clone());

        let body: UpstreamBody = match self.settings.max_body_bytes {
            // usize::MAX on 32-bit is still larger than any sane limit.
            Some(limit) => {
                Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX)).boxed_unsync()
            }
            None => body.map_err(Into::into).boxed_unsync(),
        };
        Request::from_parts(parts, body)
    }

    fn classify(&self, endpoint: &Endpoint, err: &hyper_util::client::legacy::Error) -> ProxyError {
        if let Some(limit) = self.settings.max_body_bytes
            && is_length_limit(err)
        {
            return ProxyError::BodyTooLarge { limit };
        }
        let detail = describe(err);
        if err.is_connect() {
            ProxyError::Connect {
                endpoint: endpoint.url().to_owned(),
                detail,
            }
        } else {
            ProxyError::Upstream {
                endpoint: endpoint.url().to_owned(),
                detail,
            }
        }
    }

    fn reject(
        &self,
        error: ProxyError,
        request_id: &HeaderValue,
        endpoint: Option<&Endpoint>,
    ) -> Response<ProxyBody> {
        match &error {
            ProxyError::NoEndpoint => {
                self.stats.rejected.fetch_add(1, Ordering::Relaxed);
            }
            ProxyError::Connect { .. }
            | ProxyError::Upstream { .. }
            | ProxyError::ResponseTimeout { .. } => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                if let Some(endpoint) = endpoint {
                    endpoint.record_failure();
                }
            }
            ProxyError::BodyTooLarge { .. } => {}
        }
        tracing::warn!(
            request_id = request_id.to_str().unwrap_or_default(),
            endpoint = endpoint.map(Endpoint::url),
            status = error.status().as_u16(),
            error = %error,
            "request failed"
        );
        error.into_response(request_id)
    }

    /// Copies bytes both ways between the client and the endpoint once both sides switched protocols.
    fn bridge_upgrade(
        &self,
        client: hyper::upgrade::OnUpgrade,
        upstream: hyper::upgrade::OnUpgrade,
        outstanding: Outstanding,
        request_id: &HeaderValue,
    ) {
        let request_id = request_id.to_str().unwrap_or_default().to_owned();
        self.upgrades.spawn(async move {
            let (client, upstream) = match tokio::try_join!(client, upstream) {
                Ok(both) => both,
                Err(err) => {
                    tracing::warn!(request_id, error = %err, "protocol upgrade failed");
                    return;
                }
            };
            let mut client = TokioIo::new(client);
            let mut upstream = TokioIo::new(upstream);
            match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                Ok((sent, received)) => {
                    tracing::debug!(request_id, sent, received, "upgraded connection closed");
                }
                Err(err) => tracing::debug!(request_id, error = %err, "upgraded connection ended"),
            }
            drop(outstanding);
        });
    }
}

fn content_length<B>(request: &Request<B>) -> Option<u64> {
    request
        .headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The host the client addressed: `Host` for HTTP/1, the `:authority` for HTTP/2.
fn original_host(parts: &Parts) -> Option<HeaderValue> {
    parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    })
}

/// The endpoint's scheme and authority, its path prefix, then the client's path and query.
fn upstream_uri(endpoint: &Endpoint, client_uri: &Uri) -> Uri {
    let path_and_query = client_uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let path_and_query = if endpoint.path_prefix().is_empty() {
        path_and_query
    } else {
        let joined = format!("{}{}", endpoint.path_prefix(), path_and_query.as_str());
        joined.parse().unwrap_or(path_and_query)
    };
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(endpoint.scheme().clone());
    parts.authority = Some(endpoint.authority().clone());
    parts.path_and_query = Some(path_and_query);
    // Scheme, authority and path were each valid on their own, so the whole is valid.
    Uri::from_parts(parts).unwrap_or_else(|_| Uri::from_static("/"))
}

fn is_length_limit(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(cause) = source {
        if cause.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = cause.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EndpointUrl;

    fn endpoint(url: &str) -> Endpoint {
        Endpoint::new(1, url, EndpointUrl::parse(url).unwrap(), 1)
    }

    #[test]
    fn upstream_uri_joins_prefix_path_and_query() {
        let uri: Uri = "/v1/chat?stream=true".parse().unwrap();
        assert_eq!(
            upstream_uri(&endpoint("http://10.0.0.7:8000"), &uri),
            "http://10.0.0.7:8000/v1/chat?stream=true"
        );
        assert_eq!(
            upstream_uri(&endpoint("https://abc.salad.cloud/api/"), &uri),
            "https://abc.salad.cloud/api/v1/chat?stream=true"
        );
        let absolute: Uri = "http://client-side-host/x".parse().unwrap();
        assert_eq!(
            upstream_uri(&endpoint("http://[::1]:9"), &absolute),
            "http://[::1]:9/x"
        );
    }
}

//! What tongs reads from a client's request, once, before any attempt: its id, deadline, priority,
//! whether it may be retried and wants an upgrade, and the rewritten request every attempt is made from.

use std::net::SocketAddr;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Uri, Version};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::ProxySettings;
use super::attempt::Slot;
use std::sync::Arc;

use crate::admission::{Place, Priority, Tenant};
use crate::balance::RequestKeys;
use crate::endpoint::Endpoint;
use crate::http::ProxyError;
use crate::http::headers::{self, X_REQUEST_ID, X_TONGS_RETRY};
use crate::openai::{Api, prefix};
use crate::trace::{AttemptKind, RequestTrace};
use crate::upstream::UpstreamBody;

/// What the request carries for affinity (its prompt's blocks and conversation, its session), when
/// the pool's pipeline reads affinity: from an OpenAI completion's buffered body, and the session
/// header (or, with `user_field`, the body's `user`). `None` when there is nothing to place it by.
pub(super) fn affinity_keys(
    settings: &ProxySettings,
    api: Option<Api>,
    body: Option<&bytes::Bytes>,
    headers: &HeaderMap,
) -> Option<Box<RequestKeys>> {
    if !settings.balance.pipeline.uses_affinity() {
        return None;
    }
    let affinity = &settings.balance.affinity;
    let prompt = match (api, body) {
        (Some(api), Some(body)) => prefix::prompt_keys(api, body, affinity.block_bytes),
        _ => None,
    }
    .unwrap_or_default();
    let header = affinity
        .session_header
        .as_ref()
        .and_then(|name| headers.get(name))
        .map(|value| prefix::session_key(value.as_bytes()));
    let session = header.or(if affinity.user_field {
        prompt.user
    } else {
        None
    });
    let keys = RequestKeys { prompt, session };
    (!keys.is_empty()).then(|| Box::new(keys))
}

/// The client's request, read once.
pub(super) struct ClientRequest {
    pub request_id: HeaderValue,
    /// The request's overall deadline: `timeouts.total`, or the client's own if sooner.
    pub deadline: Instant,
    /// Its priority, and the tenant its API key named (see [`Place`]).
    pub place: Place,
    /// The client did not opt out of retries (whether they are on is the pool's setting).
    pub retries_wanted: bool,
    /// The client's half of a protocol upgrade, claimed before the request was taken apart.
    pub upgrade: Option<hyper::upgrade::OnUpgrade>,
    /// The request every attempt is built from.
    pub template: Template,
}

impl ClientRequest {
    /// Reads `request` under `settings`; its body is handed back to be prepared for replay. A request
    /// tongs cannot take (a `CONNECT`, a malformed deadline header) is an error, with the request id to
    /// answer it.
    pub fn read(
        settings: &ProxySettings,
        mut request: Request<Incoming>,
        client: SocketAddr,
        started: Instant,
    ) -> Result<(ClientRequest, Incoming), (ProxyError, HeaderValue)> {
        let request_id = headers::request_id(request.headers());
        // CONNECT asks for a tunnel to wherever its target names: tongs only forwards requests to its
        // endpoints, so it answers 405 itself rather than pass the request to a node.
        if request.method() == Method::CONNECT {
            let error = ProxyError::MethodNotAllowed {
                method: Method::CONNECT,
            };
            return Err((error, request_id));
        }
        let deadline = match client_deadline(settings, request.headers()) {
            Ok(Some(wanted)) => started + wanted.min(settings.total_timeout),
            Ok(None) => started + settings.total_timeout,
            Err(error) => return Err((error, request_id)),
        };
        // A tenant the client's key named (the router put it there) may fix the priority.
        let tenant = request.extensions().get::<Arc<Tenant>>().cloned();
        let priority = match tenant.as_ref().and_then(|t| t.settings().priority) {
            Some(fixed) => fixed,
            None => Priority::from_header(request.headers().get(&settings.priority_header)),
        };
        let place = Place { priority, tenant };
        // The request's span, when tracing is on (the router put it there).
        let trace = request.extensions().get::<Arc<RequestTrace>>().cloned();

        // Only an HTTP/1.1 client can switch protocols; its half of the upgrade must be claimed before the
        // request is taken apart.
        let upgrade =
            request.version() == Version::HTTP_11 && headers::is_upgrade_request(request.headers());
        let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut request));
        let retries_wanted = !opted_out(request.headers());

        let (parts, body) = request.into_parts();
        let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        let mut template_headers = parts.headers;
        headers::strip_hop_by_hop(&mut template_headers, upgrade);
        headers::add_forwarded(&mut template_headers, client.ip(), original_host);
        template_headers.insert(&X_REQUEST_ID, request_id.clone());
        template_headers.remove(&X_TONGS_RETRY);
        let template = Template {
            method: parts.method,
            path_and_query: parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
            headers: template_headers,
            trace,
        };
        let read = ClientRequest {
            request_id,
            deadline,
            place,
            retries_wanted,
            upgrade: client_upgrade,
            template,
        };
        Ok((read, body))
    }
}

/// The client's request, rewritten once, from which each attempt's request is made.
#[derive(Clone)]
pub(super) struct Template {
    method: Method,
    path_and_query: PathAndQuery,
    headers: HeaderMap,
    /// What each attempt's span is a child of (`None`: tracing is off, and the client's
    /// `traceparent` goes on untouched).
    trace: Option<Arc<RequestTrace>>,
}

impl Template {
    pub fn method(&self) -> &Method {
        &self.method
    }

    pub fn path(&self) -> &str {
        self.path_and_query.path()
    }

    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    pub fn headers_mut(&mut self) -> &mut HeaderMap {
        &mut self.headers
    }

    /// The OpenAI API whose stream this request may be, if it is one tongs can continue.
    pub fn openai_api(&self) -> Option<Api> {
        if self.method != Method::POST {
            return None;
        }
        Api::of_path(self.path_and_query.path())
    }

    /// The same request for a body of another length (a continuation's): hyper sets the length from
    /// the body.
    pub fn for_new_body(&self) -> Template {
        let mut template = self.clone();
        template.headers.remove(header::CONTENT_LENGTH);
        template
    }

    /// The same request to another path of the node's API (a continuation by token ids goes to
    /// `/v1/completions` whatever the client called), its query kept, for a body of another length.
    pub fn for_path(&self, path: &'static str) -> Template {
        let mut template = self.for_new_body();
        let joined = match self.path_and_query.query() {
            Some(query) => format!("{path}?{query}"),
            None => path.to_owned(),
        };
        if let Ok(path_and_query) = joined.parse() {
            template.path_and_query = path_and_query;
        }
        template
    }

    /// The request of an attempt on `slot`'s endpoint; with tracing on, the attempt's span starts
    /// (the slot carries it) and the request's `traceparent` names it.
    pub fn build(
        &self,
        slot: &mut Slot,
        body: UpstreamBody,
        kind: AttemptKind,
    ) -> Request<UpstreamBody> {
        let mut request = self.request_to(slot.outstanding.endpoint(), body);
        if let Some(trace) = &self.trace {
            let endpoint = slot.outstanding.endpoint();
            slot.span = Some(trace.attempt(
                kind,
                endpoint.url(),
                endpoint.address().authority(),
                request.headers_mut(),
            ));
        }
        request
    }

    fn request_to(&self, endpoint: &Endpoint, body: UpstreamBody) -> Request<UpstreamBody> {
        let mut request = Request::new(body);
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = upstream_uri(endpoint, &self.path_and_query);
        // The endpoint speaks whatever version its connection negotiated; hyper wants 1.1 here and
        // switches to HTTP/2 by itself when ALPN chose it.
        *request.version_mut() = Version::HTTP_11;
        let mut headers = self.headers.clone();
        headers.insert(header::HOST, endpoint.address().host_header().clone());
        *request.headers_mut() = headers;
        request
    }
}

/// The client's own deadline from the deadline header, if it sent one.
fn client_deadline(
    settings: &ProxySettings,
    headers: &HeaderMap,
) -> Result<Option<Duration>, ProxyError> {
    let Some(value) = headers.get(&settings.deadline_header) else {
        return Ok(None);
    };
    match value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        Some(ms) if ms > 0 => Ok(Some(Duration::from_millis(ms))),
        _ => Err(ProxyError::BadDeadline {
            header: settings.deadline_header.to_string(),
            value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
        }),
    }
}

/// Whether the request asked not to be retried (`x-tongs-retry: off`, `false` or `0`).
fn opted_out(headers: &HeaderMap) -> bool {
    headers
        .get(&X_TONGS_RETRY)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "off" | "false" | "0" | "no"
            )
        })
}

/// The endpoint's scheme and authority, its path prefix, then the client's path and query.
fn upstream_uri(endpoint: &Endpoint, path_and_query: &PathAndQuery) -> Uri {
    let path_and_query = path_and_query.clone();
    let path_and_query = if endpoint.address().path_prefix().is_empty() {
        path_and_query
    } else {
        let joined = format!(
            "{}{}",
            endpoint.address().path_prefix(),
            path_and_query.as_str()
        );
        joined.parse().unwrap_or(path_and_query)
    };
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(endpoint.address().scheme().clone());
    parts.authority = Some(endpoint.address().authority().clone());
    parts.path_and_query = Some(path_and_query);
    // Scheme, authority and path were each valid on their own, so the whole is valid.
    Uri::from_parts(parts).unwrap_or_else(|_| Uri::from_static("/"))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::config::{Config, EndpointUrl};

    proptest! {
        /// Whatever a client writes in `x-tongs-timeout-ms`: a positive whole number of milliseconds is
        /// its deadline, anything else a 400 naming the header; never a panic.
        #[test]
        fn any_deadline_header_is_a_deadline_or_a_clear_error(value in proptest::collection::vec(any::<u8>(), 0..24)) {
            let settings = ProxySettings::from_config(&Config::default());
            let Ok(value) = HeaderValue::from_bytes(&value) else {
                return Ok(());
            };
            let mut headers = HeaderMap::new();
            headers.insert(settings.deadline_header.clone(), value.clone());
            let number = std::str::from_utf8(value.as_bytes())
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|&ms| ms > 0);
            match (client_deadline(&settings, &headers), number) {
                (Ok(Some(wanted)), Some(ms)) => prop_assert_eq!(wanted, Duration::from_millis(ms)),
                (Err(ProxyError::BadDeadline { header, .. }), None) => {
                    prop_assert_eq!(header, settings.deadline_header.to_string());
                }
                (other, number) => prop_assert!(false, "{other:?} for {number:?}"),
            }
        }
    }

    fn endpoint(url: &str) -> Endpoint {
        Endpoint::new(1, url, EndpointUrl::parse(url).unwrap(), 1)
    }

    #[test]
    fn upstream_uri_joins_prefix_path_and_query() {
        let uri = PathAndQuery::from_static("/v1/chat?stream=true");
        assert_eq!(
            upstream_uri(&endpoint("http://10.0.0.7:8000"), &uri),
            "http://10.0.0.7:8000/v1/chat?stream=true"
        );
        assert_eq!(
            upstream_uri(&endpoint("https://abc.salad.cloud/api/"), &uri),
            "https://abc.salad.cloud/api/v1/chat?stream=true"
        );
        let root = PathAndQuery::from_static("/x");
        assert_eq!(
            upstream_uri(&endpoint("http://[::1]:9"), &root),
            "http://[::1]:9/x"
        );
    }
}

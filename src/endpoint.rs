//! An endpoint (one remote inference node) and its live state.
//!
//! Identity and address never change once built; when discovery reports a different URL or weight the
//! registry builds a new `Endpoint`. Live state is a handful of atomics updated by the request path
//! without locks. This module never decides anything: balancing and health live elsewhere.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use http::HeaderValue;
use http::uri::{Authority, Scheme};

use crate::config::EndpointUrl;

/// Stable identity of an endpoint for the life of the process (used in exclusion sets).
pub type EndpointId = u64;

/// One endpoint: where it is, and how loaded it is right now.
#[derive(Debug)]
pub struct Endpoint {
    id: EndpointId,
    /// The URL as configured or discovered, for logs and debug output.
    url: String,
    scheme: Scheme,
    authority: Authority,
    path_prefix: String,
    /// `Host` sent upstream: the endpoint's own authority (a gateway routes by it).
    host_header: HeaderValue,
    weight: u32,
    /// Requests picked for this endpoint whose response body has not ended yet.
    outstanding: AtomicU64,
    /// Requests ever sent here (for tests, debug and, later, metrics).
    requests: AtomicU64,
    /// Requests here that failed at the endpoint (connect error, broken connection, timeout).
    failures: AtomicU64,
    /// A draining endpoint takes no new requests; in-flight ones finish.
    draining: AtomicBool,
}

impl Endpoint {
    /// Builds an endpoint from a parsed URL.
    pub fn new(id: EndpointId, url: &str, parsed: EndpointUrl, weight: u32) -> Endpoint {
        // An Authority is always a valid header value (it was parsed from visible ASCII).
        let host_header = HeaderValue::from_str(parsed.authority.as_str())
            .unwrap_or_else(|_| HeaderValue::from_static("invalid"));
        Endpoint {
            id,
            url: url.to_owned(),
            scheme: parsed.scheme,
            authority: parsed.authority,
            path_prefix: parsed.path_prefix,
            host_header,
            weight: weight.max(1),
            outstanding: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            draining: AtomicBool::new(false),
        }
    }

    pub fn id(&self) -> EndpointId {
        self.id
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }

    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    pub fn path_prefix(&self) -> &str {
        &self.path_prefix
    }

    pub fn host_header(&self) -> &HeaderValue {
        &self.host_header
    }

    pub fn weight(&self) -> u32 {
        self.weight
    }

    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Counts a request that failed at this endpoint.
    pub fn record_failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the balancer may pick this endpoint for a new request.
    pub fn is_available(&self) -> bool {
        !self.draining.load(Ordering::Relaxed)
    }

    pub fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::Relaxed);
    }

    /// Counts a request as outstanding here until the returned guard is dropped.
    pub fn start_request(self: &Arc<Self>) -> Outstanding {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
        Outstanding {
            endpoint: Arc::clone(self),
        }
    }
}

/// RAII count of one in-flight request on an endpoint.
///
/// The proxy moves it into the response body (or the upgraded-connection task), so a request stays
/// outstanding until its body has ended or the client went away — not just until headers arrived, which
/// would undercount streamed token responses that last seconds.
#[derive(Debug)]
pub struct Outstanding {
    endpoint: Arc<Endpoint>,
}

impl Outstanding {
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.endpoint.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(url: &str) -> Arc<Endpoint> {
        Arc::new(Endpoint::new(1, url, EndpointUrl::parse(url).unwrap(), 1))
    }

    #[test]
    fn outstanding_follows_guards() {
        let ep = endpoint("http://127.0.0.1:1");
        let a = ep.start_request();
        let b = ep.start_request();
        assert_eq!(ep.outstanding(), 2);
        drop(a);
        assert_eq!(ep.outstanding(), 1);
        drop(b);
        assert_eq!(ep.outstanding(), 0);
        assert_eq!(ep.requests(), 2);
    }

    #[test]
    fn host_header_is_the_endpoint_authority() {
        let ep = endpoint("https://tamarind-navybean.salad.cloud");
        assert_eq!(ep.host_header(), "tamarind-navybean.salad.cloud");
        let ep = endpoint("http://[::1]:8000/v1");
        assert_eq!(ep.host_header(), "[::1]:8000");
        assert_eq!(ep.path_prefix(), "/v1");
    }
}

//! Where an endpoint is: its URL as configured or discovered, and what requests to it are built from.

use http::HeaderValue;
use http::uri::{Authority, Scheme};

use crate::config::EndpointUrl;

/// Where an endpoint is, parsed once.
#[derive(Debug)]
pub struct Address {
    /// The URL as configured or discovered, for logs and debug output.
    url: String,
    scheme: Scheme,
    authority: Authority,
    path_prefix: String,
    /// `Host` sent upstream: the endpoint's own authority (a gateway routes by it).
    host_header: HeaderValue,
    /// A hash of the URL, the same in every tongs replica: the node's name in rendezvous hashing.
    identity: u64,
}

impl Address {
    pub fn new(url: &str, parsed: EndpointUrl) -> Address {
        // An Authority is always a valid header value (it was parsed from visible ASCII).
        let host_header = HeaderValue::from_str(parsed.authority.as_str())
            .unwrap_or_else(|_| HeaderValue::from_static("invalid"));
        Address {
            url: url.to_owned(),
            scheme: parsed.scheme,
            authority: parsed.authority,
            path_prefix: parsed.path_prefix,
            host_header,
            identity: crate::openai::prefix::session_key(url.as_bytes()),
        }
    }

    /// A hash of the URL, the same in every tongs replica (see `balance::affinity`).
    pub fn identity(&self) -> u64 {
        self.identity
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
}

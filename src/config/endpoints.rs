//! Endpoints given in the file: the static list, and the URL form every endpoint takes.

use http::Uri;
use serde::{Deserialize, Serialize};

use super::{KubernetesConfig, Problem};

/// Where endpoints come from.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// A fixed list of endpoints.
    #[serde(rename = "static")]
    pub static_endpoints: Vec<StaticEndpoint>,
    /// Pods watched through the Kubernetes API.
    pub kubernetes: KubernetesConfig,
}

/// One endpoint given by URL.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticEndpoint {
    /// `http://HOST:PORT`, `https://NAME.salad.cloud`, optionally with a path prefix.
    pub url: String,
    /// Share of concurrent load relative to the other endpoints (1 ..= 10000).
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    1
}

/// An endpoint URL split into what the request path needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointUrl {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// Path prefix without a trailing slash; empty when the URL has none.
    pub path_prefix: String,
}

impl EndpointUrl {
    /// Parses `http(s)://HOST[:PORT][/prefix]`; the error says what is wrong in words.
    pub fn parse(url: &str) -> Result<EndpointUrl, String> {
        let uri: Uri = url
            .parse()
            .map_err(|err| format!("{url:?} is not a URL: {err}"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| format!("{url:?} has no scheme: write http://{url} or https://{url}"))?;
        if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
            return Err(format!(
                "{url:?} has scheme {scheme}; only http and https are supported"
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("{url:?} has no host"))?;
        if authority.host().is_empty() {
            return Err(format!("{url:?} has no host"));
        }
        if authority.as_str().contains('@') {
            return Err(format!(
                "{url:?} carries credentials; put them in headers instead"
            ));
        }
        if uri.query().is_some() {
            return Err(format!("{url:?} has a query string; endpoints take none"));
        }
        let path_prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(EndpointUrl {
            scheme,
            authority,
            path_prefix,
        })
    }
}

impl DiscoveryConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        for (index, endpoint) in self.static_endpoints.iter().enumerate() {
            if let Err(message) = EndpointUrl::parse(&endpoint.url) {
                problem(format!("discovery.static[{index}].url"), message);
            }
            if !(1..=10_000).contains(&endpoint.weight) {
                problem(
                    format!("discovery.static[{index}].weight"),
                    format!("must be between 1 and 10000, got {}", endpoint.weight),
                );
            }
        }
        self.kubernetes.validate(problems);
    }
}

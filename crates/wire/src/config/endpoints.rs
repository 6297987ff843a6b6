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
    /// The most requests the endpoint takes at once (its batch size, HAProxy's `maxconn`), as a pod's
    /// `tongs.dev/max-outstanding` gives it: beyond it, requests wait in tongs' queue for the first
    /// slot free anywhere rather than in this endpoint's own queue. Unset: no cap of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_outstanding: Option<u64>,
    /// The model server it runs, for the names of its metrics. Unset: `signals.engine`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<crate::engine::Engine>,
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
    /// Parses `http(s)://HOST[:PORT][/prefix]`; the error says what is wrong in words. A written port
    /// is 1 to 65535, and a host name has no empty label (one trailing dot, an absolute name, is fine).
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
        check_port(url, &authority)?;
        check_labels(url, authority.host())?;
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

/// The port, when the URL writes one, is 1 to 65535. The URI parser takes any digits there, and a port
/// that does not fit reads as none: the scheme's default (443 for `https`) would be dialled instead.
fn check_port(url: &str, authority: &http::uri::Authority) -> Result<(), String> {
    // No credentials here (refused before), so what follows the host is `:PORT` or nothing.
    let text = authority.as_str();
    let after_host = match text.rfind(']') {
        Some(end) => &text[end + 1..],
        None => text.find(':').map_or("", |colon| &text[colon..]),
    };
    if after_host.is_empty() {
        return Ok(());
    }
    // The URI parser lets text follow a bracketed host (`[::1]5:0`): a port only comes after a colon.
    let Some(port) = after_host.strip_prefix(':') else {
        return Err(format!(
            "{url:?} has {after_host:?} after its host; write [IPv6]:PORT"
        ));
    };
    if port.is_empty() {
        return Err(format!(
            "{url:?} has an empty port: write one from 1 to 65535, or no colon for the scheme's default"
        ));
    }
    match port.parse::<u16>() {
        Ok(1..) => Ok(()),
        _ => Err(format!("{url:?} has port {port}; a port is 1 to 65535")),
    }
}

/// A host name's labels are not empty (`a..salad.cloud`, `.salad.cloud`): DNS has no such name, and
/// the allowlist's patterns would compare text no resolver agrees with. An IPv6 literal has no labels.
fn check_labels(url: &str, host: &str) -> Result<(), String> {
    if let Some(literal) = host.strip_prefix('[') {
        // A bracketed host is an IPv6 address, nothing else (`[]` is accepted by the URI parser).
        let address = literal.strip_suffix(']').unwrap_or(literal);
        return match address.parse::<std::net::Ipv6Addr>() {
            Ok(_) => Ok(()),
            Err(_) => Err(format!(
                "{url:?} has {host:?} for a host, not an IPv6 address"
            )),
        };
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    if name.split('.').any(str::is_empty) {
        return Err(format!(
            "{url:?} has an empty label in host {host:?}: no dot may start the name or follow another"
        ));
    }
    Ok(())
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
            if endpoint.max_outstanding == Some(0) {
                problem(
                    format!("discovery.static[{index}].max_outstanding"),
                    "must be at least 1 (leave it out for no cap)".into(),
                );
            }
        }
        self.kubernetes.validate(problems);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_1_to_65535_and_host_labels_are_not_empty() {
        for (url, says) in [
            ("http://10.0.0.7:0", "1 to 65535"),
            ("http://10.0.0.7:99999", "1 to 65535"),
            ("https://a.salad.cloud:65536", "1 to 65535"),
            ("http://[::1]:0", "1 to 65535"),
            ("http://[::1]:70000", "1 to 65535"),
            ("http://10.0.0.7:", "1 to 65535"),
            ("https://a..salad.cloud", "empty label"),
            ("https://.salad.cloud", "empty label"),
            ("https://a.salad.cloud..", "empty label"),
            ("http://10..0.7:8000", "empty label"),
            // Found by the fuzz target `addresses`: text after a bracketed host hid a port 0.
            ("Http://[]5:0", "after its host"),
            ("http://[::1]x", "after its host"),
            ("http://[]:80", "not an IPv6 address"),
            ("http://[zz]:80", "not an IPv6 address"),
        ] {
            let err = EndpointUrl::parse(url).expect_err(url);
            assert!(err.contains(says), "{url}: {err}");
            assert!(err.contains(&format!("{url:?}")), "{url}: {err}");
        }
        for url in [
            "http://10.0.0.7:1",
            "http://10.0.0.7:65535",
            "http://svc.ns.svc.cluster.local.:8000",
            "http://[::1]",
            "https://a-b.salad.cloud/v1",
        ] {
            assert!(EndpointUrl::parse(url).is_ok(), "{url}");
        }
    }

    #[test]
    fn bad_static_urls_are_named_by_field() {
        let endpoint = |url: &str| StaticEndpoint {
            url: url.into(),
            weight: 1,
            max_outstanding: None,
            engine: None,
        };
        let config = DiscoveryConfig {
            static_endpoints: vec![
                endpoint("http://10.0.0.7:0"),
                endpoint("http://10.0.0.8:8000"),
                endpoint("http://10.0.0.9:99999"),
                endpoint("https://a..salad.cloud"),
            ],
            ..DiscoveryConfig::default()
        };
        let mut problems = Vec::new();
        config.validate(&mut problems);
        let fields: Vec<_> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "discovery.static[0].url",
                "discovery.static[2].url",
                "discovery.static[3].url"
            ]
        );
    }
}

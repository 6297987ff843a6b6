//! How tongs reaches endpoints: pooling, TLS roots, and the Tailscale proxy for tailnet addresses.

use std::path::PathBuf;

use http::Uri;
use serde::{Deserialize, Serialize};

use super::Problem;

/// How tongs talks to endpoints.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// A PEM file of extra CA certificates trusted for `https://` endpoints, besides the webpki roots.
    pub extra_ca_file: Option<PathBuf>,
    /// Idle pooled connections kept per endpoint.
    pub pool_max_idle_per_endpoint: usize,
    pub tailscale: TailscaleConfig,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            extra_ca_file: None,
            pool_max_idle_per_endpoint: 256,
            tailscale: TailscaleConfig::default(),
        }
    }
}

/// How tongs reaches Tailscale addresses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TailscaleConfig {
    /// tailscaled's outbound proxy in a userspace-networking sidecar: `socks5://127.0.0.1:1055`
    /// (`--socks5-server`) or `http://127.0.0.1:1055` (`--outbound-http-proxy-listen`, CONNECT).
    /// Empty: connect to Tailscale addresses directly (tongs' pod routes to the tailnet itself).
    pub proxy: String,
    /// Destination addresses that go through the proxy (IP ranges).
    pub ranges: Vec<String>,
    /// Destination host names that go through the proxy, resolved by tailscaled: MagicDNS names
    /// (`*.ts.net`) resolve only inside the tailnet, never in the cluster's DNS. An exact name, or `*.`
    /// and a suffix.
    pub domains: Vec<String>,
}

impl Default for TailscaleConfig {
    fn default() -> Self {
        Self {
            proxy: String::new(),
            // Whole, Tailscale's own 100.100.100.100 and fd7a:115c:a1e0::53 and its reserved
            // 100.115.92.0/23 included, on purpose: these ranges only route, they admit nothing. What
            // may become an endpoint is decided before (`discovery.kubernetes.allow` leaves those
            // addresses out unless a rule names them; static endpoints are the operator's). An endpoint
            // there was named on purpose, and from a pod in userspace networking only tailscaled
            // reaches it: left out of these ranges it would be dialled directly, where it leads nowhere.
            ranges: vec!["100.64.0.0/10".into(), "fd7a:115c:a1e0::/48".into()],
            // MagicDNS names: `machine.tailnet-name.ts.net`. A tailnet with a custom DNS name (or
            // split DNS to names only the tailnet resolves) lists those here too.
            domains: vec!["*.ts.net".into()],
        }
    }
}

impl TailscaleConfig {
    /// The ranges, parsed; entries that do not parse are left out (validation reports them).
    pub fn parsed_ranges(&self) -> Vec<ipnet::IpNet> {
        self.ranges
            .iter()
            .filter_map(|range| range.trim().parse::<ipnet::IpNet>().ok())
            .map(|range| range.trunc())
            .collect()
    }

    /// The domain patterns, parsed; entries that do not parse are left out (validation reports them).
    pub fn parsed_domains(&self) -> Vec<DomainPattern> {
        self.domains
            .iter()
            .filter_map(|pattern| DomainPattern::parse(pattern).ok())
            .collect()
    }

    fn validate(&self, problems: &mut Vec<Problem>) {
        for (index, pattern) in self.domains.iter().enumerate() {
            if let Err(message) = DomainPattern::parse(pattern) {
                problems.push(Problem {
                    field: format!("upstream.tailscale.domains[{index}]"),
                    message,
                });
            }
        }
        if !self.proxy.is_empty()
            && let Err(message) = parse_proxy(&self.proxy)
        {
            problems.push(Problem {
                field: "upstream.tailscale.proxy".into(),
                message,
            });
        }
        for (index, range) in self.ranges.iter().enumerate() {
            if range.trim().parse::<ipnet::IpNet>().is_err() {
                problems.push(Problem {
                    field: format!("upstream.tailscale.ranges[{index}]"),
                    message: format!("{range:?} is not a CIDR range like 100.64.0.0/10"),
                });
            }
        }
    }
}

/// A host name pattern of `upstream.tailscale.domains`, lower-cased, without a trailing dot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DomainPattern {
    /// This name only.
    Exact(String),
    /// Any name ending in this suffix (kept with its leading dot), not the suffix itself: `*.ts.net`
    /// matches `gpu-1.tailnet-name.ts.net`, whatever the depth, and not `ts.net`.
    Suffix(String),
}

impl DomainPattern {
    /// An exact name (`tongs.tailnet-name.ts.net`) or `*.` and a suffix (`*.ts.net`). IP literals
    /// are refused: they belong in `ranges`, where a CIDR says what a pattern cannot.
    pub fn parse(text: &str) -> Result<DomainPattern, String> {
        let name = text.trim().trim_end_matches('.').to_ascii_lowercase();
        let (suffix, body) = match name.strip_prefix("*.") {
            Some(body) => (true, body),
            None => (false, name.as_str()),
        };
        let label_ok = |label: &str| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                && !label.starts_with('-')
                && !label.ends_with('-')
        };
        if body.is_empty() || body.len() > 253 || !body.split('.').all(label_ok) {
            return Err(format!(
                "{text:?} is not a host name pattern: a name (tongs.tailnet-name.ts.net) or `*.` and a \
                 suffix (*.ts.net)"
            ));
        }
        if body.parse::<std::net::IpAddr>().is_ok()
            || body
                .split('.')
                .all(|label| label.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(format!(
                "{text:?} is an IP address: list it in upstream.tailscale.ranges"
            ));
        }
        Ok(if suffix {
            DomainPattern::Suffix(format!(".{body}"))
        } else {
            DomainPattern::Exact(body.to_owned())
        })
    }

    /// Whether `host` (any case, a trailing dot allowed) matches.
    pub fn matches(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.');
        match self {
            DomainPattern::Exact(name) => host.eq_ignore_ascii_case(name),
            DomainPattern::Suffix(suffix) => {
                host.len() > suffix.len()
                    && host
                        .get(host.len() - suffix.len()..)
                        .is_some_and(|end| end.eq_ignore_ascii_case(suffix))
            }
        }
    }
}

/// tailscaled's proxy, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProxyKind {
    /// `socks5://host:port`.
    Socks5,
    /// `http://host:port`: HTTP CONNECT.
    Connect,
}

/// Parses `upstream.tailscale.proxy`: `socks5://HOST:PORT` or `http://HOST:PORT`.
pub fn parse_proxy(text: &str) -> Result<(ProxyKind, Uri), String> {
    let uri: Uri = text
        .parse()
        .map_err(|err| format!("{text:?} is not a URL: {err}"))?;
    let kind = match uri.scheme_str() {
        Some("socks5") | Some("socks5h") => ProxyKind::Socks5,
        Some("http") => ProxyKind::Connect,
        _ => {
            return Err(format!(
                "{text:?}: use socks5://127.0.0.1:1055 (tailscaled --socks5-server) or \
                 http://127.0.0.1:1055 (--outbound-http-proxy-listen)"
            ));
        }
    };
    let authority = uri
        .authority()
        .ok_or_else(|| format!("{text:?} has no host"))?;
    if authority.port_u16().is_none() {
        return Err(format!(
            "{text:?} has no port (tailscaled has no default; 1055 is usual)"
        ));
    }
    if authority.as_str().contains('@') {
        return Err(format!("{text:?}: tailscaled's proxy takes no credentials"));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(format!("{text:?}: a proxy URL has no path"));
    }
    // The inner connector dials the proxy itself: it needs a plain http URI for that.
    let dial: Uri = format!("http://{authority}")
        .parse()
        .map_err(|err| format!("{text:?}: {err}"))?;
    Ok((kind, dial))
}

impl UpstreamConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if let Some(path) = &self.extra_ca_file
            && !path.is_file()
        {
            problem(
                "upstream.extra_ca_file".into(),
                format!("{} is not a readable file", path.display()),
            );
        }

        self.tailscale.validate(problems);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_ranges_route_tailscales_own_addresses_too() {
        // Routing admits nothing (see the default): an endpoint there was named on purpose.
        let ranges = TailscaleConfig::default().parsed_ranges();
        for ip in ["100.100.100.100", "100.115.92.1", "fd7a:115c:a1e0::53"] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            assert!(ranges.iter().any(|range| range.contains(&ip)), "{ip}");
        }
    }

    #[test]
    fn domain_patterns_match_names_and_suffixes() {
        let suffix = DomainPattern::parse("*.ts.net").unwrap();
        assert!(suffix.matches("gpu-1.tailnet-name.ts.net"));
        assert!(suffix.matches("GPU-1.Tailnet-Name.TS.NET."));
        assert!(!suffix.matches("ts.net"));
        assert!(!suffix.matches("gpu-1.tailnet-name.ts.net.evil.example"));
        assert!(!suffix.matches("notts.net"));
        let exact = DomainPattern::parse("Tongs.Tailnet-Name.ts.net.").unwrap();
        assert!(exact.matches("tongs.tailnet-name.ts.net"));
        assert!(!exact.matches("x.tongs.tailnet-name.ts.net"));
    }

    #[test]
    fn bad_domain_patterns_are_refused_with_their_field() {
        for bad in [
            "",
            "*",
            "*.",
            "a.*.ts.net",
            "*ts.net",
            "**.ts.net",
            "https://x.ts.net",
            "x.ts.net:443",
            "-x.ts.net",
            "100.64.0.1",
            "*.100.64",
            "fd7a::1",
        ] {
            assert!(DomainPattern::parse(bad).is_err(), "{bad:?} parsed");
        }
        let config = TailscaleConfig {
            domains: vec!["*.ts.net".into(), "a.*.ts.net".into()],
            ..TailscaleConfig::default()
        };
        let mut problems = Vec::new();
        config.validate(&mut problems);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].field, "upstream.tailscale.domains[1]");
        assert_eq!(config.parsed_domains().len(), 1);
    }

    #[test]
    fn proxy_urls_are_checked() {
        assert_eq!(
            parse_proxy("socks5://127.0.0.1:1055").unwrap(),
            (ProxyKind::Socks5, "http://127.0.0.1:1055".parse().unwrap())
        );
        assert_eq!(
            parse_proxy("http://localhost:1055/").unwrap().0,
            ProxyKind::Connect
        );
        for bad in [
            "127.0.0.1:1055",
            "socks5://127.0.0.1",
            "https://127.0.0.1:1055",
            "socks5://u:p@127.0.0.1:1055",
            "http://127.0.0.1:1055/x",
        ] {
            assert!(parse_proxy(bad).is_err(), "{bad} parsed");
        }
    }
}

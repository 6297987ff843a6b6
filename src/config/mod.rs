//! The configuration file: serde types with defaults, and validation that names every problem's field.
//!
//! Parsing is strict (`deny_unknown_fields`): a misspelt key is an error, never silently ignored, because
//! an ignored `timeouts.conect` would leave a production proxy on a default nobody chose.
//! Every key is documented in `config/tongs.yaml` and in the README's table.

mod duration;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use http::Uri;
use serde::{Deserialize, Serialize};

pub use duration::HumanDuration;

/// The whole configuration file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address the proxy listens on for client traffic (HTTP/1.1 and h2c on the same port).
    pub listen: SocketAddr,
    /// Worker threads serving client traffic; 0 means one per available CPU.
    pub workers: usize,
    pub admin: AdminConfig,
    pub discovery: DiscoveryConfig,
    pub timeouts: Timeouts,
    pub limits: Limits,
    pub upstream: UpstreamConfig,
    pub shutdown: ShutdownConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            workers: 0,
            admin: AdminConfig::default(),
            discovery: DiscoveryConfig::default(),
            timeouts: Timeouts::default(),
            limits: Limits::default(),
            upstream: UpstreamConfig::default(),
            shutdown: ShutdownConfig::default(),
        }
    }
}

/// The admin listener (health probes now; metrics and debug pages later).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 9090)),
        }
    }
}

/// Where endpoints come from.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// A fixed list of endpoints.
    #[serde(rename = "static")]
    pub static_endpoints: Vec<StaticEndpoint>,
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

/// Timeouts. `total` is the SaladCloud gateway's own limit by default (100 s).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// TCP (and TLS) connect to an endpoint.
    pub connect: HumanDuration,
    /// From sending the request until the endpoint's response headers arrive.
    pub response_headers: HumanDuration,
    /// The whole exchange, response body included (WebSocket upgrades excepted).
    pub total: HumanDuration,
    /// An unused pooled connection to an endpoint is closed after this long.
    pub idle: HumanDuration,
    /// A client must send its complete request headers within this time of connecting (slowloris).
    pub header_read: HumanDuration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: HumanDuration::from_secs(2),
            response_headers: HumanDuration::from_secs(100),
            total: HumanDuration::from_secs(100),
            idle: HumanDuration::from_secs(90),
            header_read: HumanDuration::from_secs(10),
        }
    }
}

/// Limits on what a client may send.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request head (request line plus headers) in bytes; larger gets 431. At least 8192.
    pub max_header_bytes: usize,
    /// Largest request body in bytes; larger gets 413. Unset means no limit.
    pub max_body_bytes: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header_bytes: 64 * 1024,
            max_body_bytes: None,
        }
    }
}

/// How tongs talks to endpoints.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// A PEM file of extra CA certificates trusted for `https://` endpoints, besides the webpki roots.
    pub extra_ca_file: Option<PathBuf>,
    /// Idle pooled connections kept per endpoint.
    pub pool_max_idle_per_endpoint: usize,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            extra_ca_file: None,
            pool_max_idle_per_endpoint: 256,
        }
    }
}

/// Graceful shutdown.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// After SIGTERM/SIGINT, in-flight requests (streams included) get this long to finish.
    /// Keep it below the pod's terminationGracePeriodSeconds (30 s by default in Kubernetes).
    pub grace: HumanDuration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace: HumanDuration::from_secs(25),
        }
    }
}

/// One thing wrong with a configuration, with the field it concerns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Dotted path of the field, e.g. `discovery.static[2].url`; empty for the file as a whole.
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {origin} is invalid:\n{}", list(.problems))]
    Invalid {
        origin: String,
        problems: Vec<Problem>,
    },
}

impl ConfigError {
    /// Every problem found; empty for an unreadable file.
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Read { .. } => &[],
            ConfigError::Invalid { problems, .. } => problems,
        }
    }
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::parse(&read_file(path)?, &path.display().to_string())
    }

    /// Parses and validates config text; `origin` names it in errors (a file path, usually).
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let config: Config = parse_yaml(text, origin)?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid {
                origin: origin.to_owned(),
                problems,
            })
        }
    }

    /// Checks what the types alone cannot; returns every problem, not just the first.
    pub fn validate(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });

        if self.workers > 1024 {
            problem(
                "workers".into(),
                format!("must be at most 1024 (0 = one per CPU), got {}", self.workers),
            );
        }
        if self.listen == self.admin.listen && self.listen.port() != 0 {
            problem(
                "admin.listen".into(),
                format!("must differ from listen ({})", self.listen),
            );
        }
        for (index, endpoint) in self.discovery.static_endpoints.iter().enumerate() {
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
        let timeouts = [
            ("timeouts.connect", self.timeouts.connect),
            ("timeouts.response_headers", self.timeouts.response_headers),
            ("timeouts.total", self.timeouts.total),
            ("timeouts.idle", self.timeouts.idle),
            ("timeouts.header_read", self.timeouts.header_read),
            ("shutdown.grace", self.shutdown.grace),
        ];
        for (field, value) in timeouts {
            if value.get().is_zero() {
                problem(field.into(), "must be greater than zero".into());
            }
        }
        if self.timeouts.response_headers > self.timeouts.total {
            problem(
                "timeouts.response_headers".into(),
                format!(
                    "({}) cannot exceed timeouts.total ({})",
                    self.timeouts.response_headers, self.timeouts.total
                ),
            );
        }
        if self.limits.max_header_bytes < 8192 {
            problem(
                "limits.max_header_bytes".into(),
                format!(
                    "must be at least 8192, got {}",
                    self.limits.max_header_bytes
                ),
            );
        }
        if self.limits.max_body_bytes == Some(0) {
            problem(
                "limits.max_body_bytes".into(),
                "must be greater than zero (leave it out for no limit)".into(),
            );
        }
        if let Some(path) = &self.upstream.extra_ca_file
            && !path.is_file()
        {
            problem(
                "upstream.extra_ca_file".into(),
                format!("{} is not a readable file", path.display()),
            );
        }
        problems
    }

    /// The effective configuration as YAML, defaults filled in.
    pub fn to_yaml(&self) -> String {
        serde_saphyr::to_string(self)
            .unwrap_or_else(|err| format!("# cannot render config: {err}\n"))
    }
}

/// Parses YAML into `T` strictly, naming the field a failure happened in. An empty document (or one
/// holding only comments) means `T::default()`.
pub fn parse_yaml<T: serde::de::DeserializeOwned + Default>(
    text: &str,
    origin: &str,
) -> Result<T, ConfigError> {
    let only_comments = text.lines().all(|l| {
        let l = l.trim();
        l.is_empty() || l.starts_with('#') || l == "---"
    });
    if only_comments {
        return Ok(T::default());
    }
    // serde_path_to_error tracks which field the parser was in when it failed; the parser's own message
    // adds the line and column.
    let mut failed_at = String::new();
    serde_saphyr::with_deserializer_from_str(text, |deserializer| {
        serde_path_to_error::deserialize(deserializer).map_err(|err| {
            failed_at = err.path().to_string();
            err.into_inner()
        })
    })
    .map_err(|err| ConfigError::Invalid {
        origin: origin.to_owned(),
        problems: vec![Problem {
            field: if failed_at == "." {
                String::new()
            } else {
                failed_at
            },
            message: err.to_string(),
        }],
    })
}

/// Reads a file for [`parse_yaml`]-style loaders.
pub fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_means_defaults() {
        let config = Config::parse("# nothing\n", "test").unwrap();
        assert_eq!(config.listen, SocketAddr::from(([0, 0, 0, 0], 8080)));
        assert_eq!(config.timeouts.total.get().as_secs(), 100);
    }

    #[test]
    fn example_from_the_issue_parses() {
        let text = r#"
listen: 0.0.0.0:8080
admin: { listen: 0.0.0.0:9090 }
discovery:
  static:
    - url: http://10.0.0.7:8000
      weight: 1
    - url: https://tamarind-navybean.salad.cloud
timeouts: { connect: 2s, response_headers: 100s, total: 100s, idle: 90s }
"#;
        let config = Config::parse(text, "test").unwrap();
        assert_eq!(config.discovery.static_endpoints.len(), 2);
        assert_eq!(config.discovery.static_endpoints[1].weight, 1);
        assert_eq!(config.timeouts.connect.get().as_secs(), 2);
    }

    #[test]
    fn unknown_key_is_named_with_its_path() {
        let err = Config::parse("timeouts:\n  conect: 2s\n", "test").unwrap_err();
        let problems = err.problems();
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].field, "timeouts.conect");
        assert!(
            problems[0].message.contains("conect"),
            "{}",
            problems[0].message
        );
    }

    #[test]
    fn bad_duration_names_its_field() {
        let err = Config::parse("timeouts:\n  connect: 2\n", "test").unwrap_err();
        assert_eq!(err.problems()[0].field, "timeouts.connect");
    }

    #[test]
    fn every_semantic_problem_is_reported() {
        let text = r#"
discovery:
  static:
    - url: ftp://x
    - url: http://ok:80
      weight: 0
timeouts: { connect: 0s, response_headers: 200s, total: 100s }
limits: { max_header_bytes: 10 }
"#;
        let err = Config::parse(text, "test").unwrap_err();
        let fields: Vec<_> = err.problems().iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "discovery.static[0].url",
                "discovery.static[1].weight",
                "timeouts.connect",
                "timeouts.response_headers",
                "limits.max_header_bytes",
            ]
        );
    }

    #[test]
    fn endpoint_url_parts() {
        let url = EndpointUrl::parse("https://abc.salad.cloud/v1/").unwrap();
        assert_eq!(url.scheme, http::uri::Scheme::HTTPS);
        assert_eq!(url.authority.as_str(), "abc.salad.cloud");
        assert_eq!(url.path_prefix, "/v1");
        let url = EndpointUrl::parse("http://[::1]:8000").unwrap();
        assert_eq!(url.authority.as_str(), "[::1]:8000");
        assert_eq!(url.path_prefix, "");
        assert!(EndpointUrl::parse("10.0.0.7:8000").is_err());
        assert!(EndpointUrl::parse("http://u:p@host").is_err());
        assert!(EndpointUrl::parse("http://host/?q=1").is_err());
    }

    #[test]
    fn effective_config_round_trips() {
        let config = Config::default();
        let yaml = config.to_yaml();
        let again = Config::parse(&yaml, "rendered").unwrap();
        assert_eq!(again.to_yaml(), yaml);
    }
}

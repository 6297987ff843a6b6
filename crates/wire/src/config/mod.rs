//! The configuration file: serde types with defaults, and validation that names every problem's field.
//!
//! Parsing is strict (`deny_unknown_fields`): a misspelt key is an error, never silently ignored, because
//! an ignored `timeouts.conect` would leave a production proxy on a default nobody chose.
//! Every key is documented in `config/tongs.yaml` and in the table of `docs/configuration.md`.

mod address;
mod auth;
mod balance;
mod duration;
mod endpoints;
mod header;
mod hedge;
mod kubernetes;
mod otlp;
mod pools;
mod replicas;
mod resilience;
mod salad;
mod selector;
mod server;
mod signals;
mod upstream;
mod yaml;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use address::{AddressGuard, guard, parse_address};
pub use auth::{AuthConfig, TenantConfig, TenantPriority, parse_keys, tenant_name};
pub use balance::{
    AffinityConfig, BalancePolicy, BalancerConfig, ConcurrencyConfig, LimitMode, QueueConfig,
    default_scorers,
};
pub use duration::HumanDuration;
pub use endpoints::{DiscoveryConfig, EndpointUrl, StaticEndpoint};
pub use header::Header;
pub use hedge::{ContinuationConfig, HedgeConfig, StreamConfig, TokenIds};
pub use kubernetes::{
    AllowRule, AnnotationKeys, KubernetesConfig, RegistrationConfig, Rule, annotation_key,
    is_qualified_name,
};
pub use otlp::{OtlpConfig, TracingConfig};
pub use pools::{DEFAULT_POOL, PoolConfig, PoolDiscovery, PoolMatch, PoolSpec, model_matches};
pub use replicas::ReplicasConfig;
pub use resilience::{BreakerConfig, HealthConfig, HealthRequest, RetryConfig, RetryOn};
pub use salad::{KeyError, SaladApiConfig, SaladConfig};
pub use selector::{LabelSelector, Requirement, is_label_value, parse_label_selector};
pub use server::{AdminConfig, Limits, ShutdownConfig, Timeouts};
pub use signals::{Saturation, SignalsConfig};
pub use upstream::{DomainPattern, ProxyKind, TailscaleConfig, UpstreamConfig, parse_proxy};
pub use yaml::{load_validated, parse_validated, parse_yaml};

/// What the examples in `deploy/` write where a user's own value goes.
pub const PLACEHOLDER: &str = "replace-with-";

/// Longest duration any key accepts (one day).
pub const MAX_DURATION: HumanDuration = HumanDuration::from_secs(24 * 3600);

/// Shortest non-zero duration any key accepts: tongs keeps time in milliseconds, and a timeout of
/// microseconds is a unit mistake (`1us` for `1s`) that would fail every request.
pub const MIN_DURATION: HumanDuration = HumanDuration::from_millis(1);

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
    pub salad: SaladConfig,
    pub health: HealthConfig,
    pub breaker: BreakerConfig,
    pub retry: RetryConfig,
    pub hedge: HedgeConfig,
    pub stream: StreamConfig,
    pub continuation: ContinuationConfig,
    pub balancer: BalancerConfig,
    pub concurrency: ConcurrencyConfig,
    pub queue: QueueConfig,
    /// The model servers' own load, read from their metrics.
    pub signals: SignalsConfig,
    pub shutdown: ShutdownConfig,
    /// Inbound API keys and the tenants they name.
    pub auth: AuthConfig,
    /// The tongs replicas that share the fleet, so fixed per-node limits hold for all of them together.
    pub replicas: ReplicasConfig,
    /// Traces over OTLP (off unless `tracing.otlp.endpoint` is set).
    pub tracing: TracingConfig,
    /// Several fleets behind one tongs, chosen per request (see [`PoolConfig`]).
    pub pools: Vec<PoolConfig>,
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
            salad: SaladConfig::default(),
            health: HealthConfig::default(),
            breaker: BreakerConfig::default(),
            retry: RetryConfig::default(),
            hedge: HedgeConfig::default(),
            stream: StreamConfig::default(),
            continuation: ContinuationConfig::default(),
            balancer: BalancerConfig::default(),
            concurrency: ConcurrencyConfig::default(),
            queue: QueueConfig::default(),
            signals: SignalsConfig::default(),
            shutdown: ShutdownConfig::default(),
            auth: AuthConfig::default(),
            replicas: ReplicasConfig::default(),
            tracing: TracingConfig::default(),
            pools: Vec::new(),
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

/// What the proxy checks of a configuration beyond what this crate knows (the names of its scorers,
/// which it registers itself), as problems named by field like the rest; run on the whole
/// configuration and on each pool's.
pub type Checks = fn(&Config) -> Vec<Problem>;

/// No checks beyond this crate's own.
fn no_checks(_: &Config) -> Vec<Problem> {
    Vec::new()
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with(path, no_checks)
    }

    /// [`Config::load`], with the proxy's own `checks` besides.
    pub fn load_with(path: &Path, checks: Checks) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse_with(&text, &path.display().to_string(), checks)
    }

    /// Parses and validates config text; `origin` names it in errors (a file path, usually).
    ///
    /// A text with no key at all (empty, or only comments) is refused: it is far more often a
    /// ConfigMap caught half-written, or mounted before it was filled, than a wish for every default,
    /// and on a reload it would drop every configured endpoint. `{}` asks for every default.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Config::parse_with(text, origin, no_checks)
    }

    /// [`Config::parse`], with the proxy's own `checks` besides.
    pub fn parse_with(text: &str, origin: &str, checks: Checks) -> Result<Config, ConfigError> {
        let blank = text.lines().all(|line| {
            let line = line.trim();
            line.is_empty() || line.starts_with('#') || line == "---" || line == "..."
        });
        if blank {
            return Err(ConfigError::Invalid {
                origin: origin.to_owned(),
                problems: vec![Problem {
                    field: "(the file)".into(),
                    message: "is empty (no key, only blanks or comments); write {} to run on \
                              every default"
                        .into(),
                }],
            });
        }
        parse_validated(text, origin, |config: &Config| config.validate_with(checks))
    }

    /// Checks what the types alone cannot; returns every problem, not just the first.
    pub fn validate(&self) -> Vec<Problem> {
        self.validate_with(no_checks)
    }

    /// [`Config::validate`], with the proxy's own `checks` besides.
    pub fn validate_with(&self, checks: Checks) -> Vec<Problem> {
        let mut problems = Vec::new();
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });

        if self.workers > 1024 {
            problem(
                "workers".into(),
                format!(
                    "must be at most 1024 (0 = one per CPU), got {}",
                    self.workers
                ),
            );
        }
        if self.listen == self.admin.listen && self.listen.port() != 0 {
            problem(
                "admin.listen".into(),
                format!("must differ from listen ({})", self.listen),
            );
        }
        self.discovery.validate(&mut problems);
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        // Every duration key: whether zero makes sense, and a ceiling, since deadlines are computed as
        // now + duration and an absurd duration would overflow the clock.
        let durations = [
            ("timeouts.connect", self.timeouts.connect, false),
            (
                "timeouts.response_headers",
                self.timeouts.response_headers,
                false,
            ),
            ("timeouts.total", self.timeouts.total, false),
            ("timeouts.idle", self.timeouts.idle, false),
            ("timeouts.header_read", self.timeouts.header_read, false),
            ("timeouts.body_read", self.timeouts.body_read, false),
            ("shutdown.grace", self.shutdown.grace, false),
            ("health.interval", self.health.interval, false),
            ("health.fast_interval", self.health.fast_interval, false),
            ("health.timeout", self.health.timeout, false),
            ("health.models_interval", self.health.models_interval, true),
            ("breaker.base_ejection", self.breaker.base_ejection, false),
            ("breaker.max_ejection", self.breaker.max_ejection, false),
            ("retry.backoff_base", self.retry.backoff_base, true),
            ("retry.backoff_max", self.retry.backoff_max, true),
            ("hedge.min_delay", self.hedge.min_delay, true),
            ("stream.idle_min", self.stream.idle_min, false),
            (
                "stream.first_token_idle",
                self.stream.first_token_idle,
                false,
            ),
            ("stream.pause_max", self.stream.pause_max, false),
            ("continuation.idle_min", self.continuation.idle_min, false),
            ("balancer.slow_start", self.balancer.slow_start, true),
            ("balancer.latency_decay", self.balancer.latency_decay, false),
            (
                "concurrency.probe_interval",
                self.concurrency.probe_interval,
                false,
            ),
            ("queue.max_wait", self.queue.max_wait, false),
            ("signals.interval", self.signals.interval, false),
            ("signals.timeout", self.signals.timeout, false),
            ("signals.max_age", self.signals.max_age, false),
            ("signals.absent_retry", self.signals.absent_retry, false),
            (
                "queue.max_wait_no_endpoints",
                self.queue.max_wait_no_endpoints.unwrap_or_default(),
                true,
            ),
            (
                "queue.shed_low_priority_after",
                self.queue.shed_low_priority_after,
                false,
            ),
            ("queue.target_wait", self.queue.target_wait, true),
            ("queue.overload_after", self.queue.overload_after, true),
        ];
        for (field, value, zero_allowed) in durations {
            if value.get().is_zero() && !zero_allowed {
                problem(field.into(), "must be greater than zero".into());
            } else if !value.get().is_zero() && value < MIN_DURATION {
                problem(
                    field.into(),
                    format!("must be at least {MIN_DURATION}, got {value}"),
                );
            }
            if value > MAX_DURATION {
                problem(
                    field.into(),
                    format!("must be at most {MAX_DURATION}, got {value}"),
                );
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
        self.health.validate(&mut problems);
        self.breaker.validate(&mut problems);
        self.retry.validate(&mut problems);
        self.hedge.validate(&mut problems);
        self.stream.validate(&mut problems);
        self.continuation.validate(&mut problems);
        self.concurrency.validate(&mut problems);
        self.queue.validate(&mut problems);
        self.signals.validate(&mut problems);
        self.balancer.validate(&mut problems);
        self.limits.validate(&mut problems);
        self.admin.validate(&mut problems);
        self.upstream.validate(&mut problems);
        self.salad.validate(&mut problems);
        self.auth.validate(&mut problems);
        self.replicas.validate(&mut problems);
        self.tracing.validate(&mut problems);
        self.validate_pools(&mut problems, checks);
        problems.extend(checks(self));
        problems
    }

    /// Every value still holding an example's placeholder (`replace-with-…`), by field.
    pub fn placeholders(&self) -> Vec<Problem> {
        fn walk(value: &serde_json::Value, at: &str, out: &mut Vec<Problem>) {
            match value {
                serde_json::Value::String(text) if text.contains(PLACEHOLDER) => {
                    out.push(Problem {
                        field: at.to_owned(),
                        message: format!(
                            "{text:?} is an example's placeholder: put your own value here"
                        ),
                    })
                }
                serde_json::Value::Object(map) => {
                    for (key, child) in map {
                        let field = if at.is_empty() {
                            key.clone()
                        } else {
                            format!("{at}.{key}")
                        };
                        walk(child, &field, out);
                    }
                }
                serde_json::Value::Array(items) => {
                    for (i, item) in items.iter().enumerate() {
                        walk(item, &format!("{at}[{i}]"), out);
                    }
                }
                _ => {}
            }
        }
        let mut out = Vec::new();
        if let Ok(value) = serde_json::to_value(self) {
            walk(&value, "", &mut out);
        }
        out
    }

    /// The effective configuration as YAML, defaults filled in.
    pub fn to_yaml(&self) -> String {
        serde_saphyr::to_string(self)
            .unwrap_or_else(|err| format!("# cannot render config: {err}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_refused_and_braces_mean_defaults() {
        for blank in ["", "\n  \n", "# nothing\n", "---\n# only a comment\n..."] {
            let err = Config::parse(blank, "test").unwrap_err();
            assert_eq!(err.problems().len(), 1, "{blank:?}");
            assert!(err.to_string().contains("is empty"), "{err}");
        }
        let config = Config::parse("{}\n", "test").unwrap();
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
    fn durations_below_a_millisecond_are_refused_with_their_field() {
        let text = "timeouts: { connect: 1ns, idle: 500us }\nretry: { backoff_base: 0s }\n";
        let err = Config::parse(text, "test").unwrap_err();
        let fields: Vec<&str> = err.problems().iter().map(|p| p.field.as_str()).collect();
        assert_eq!(fields, ["timeouts.connect", "timeouts.idle"], "{err}");
        assert!(err.problems()[0].message.contains("at least 1ms"), "{err}");
        assert!(Config::parse("timeouts: { connect: 1ms }\n", "test").is_ok());
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
    fn admin_connection_cap_is_bounded() {
        assert_eq!(Config::default().admin.max_connections, 256);
        for bad in ["0", "1000000"] {
            let text = format!("admin: {{ max_connections: {bad} }}\n");
            let err = Config::parse(&text, "test").unwrap_err();
            assert_eq!(err.problems()[0].field, "admin.max_connections");
        }
    }

    #[test]
    fn absurd_durations_are_refused() {
        let err = Config::parse(
            "timeouts: { total: 100000000000s, response_headers: 1s }\n",
            "test",
        )
        .unwrap_err();
        assert_eq!(err.problems()[0].field, "timeouts.total");
        assert!(
            err.problems()[0].message.contains("86400s"),
            "{}",
            err.problems()[0].message
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

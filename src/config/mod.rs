//! The configuration file: serde types with defaults, and validation that names every problem's field.
//!
//! Parsing is strict (`deny_unknown_fields`): a misspelt key is an error, never silently ignored, because
//! an ignored `timeouts.conect` would leave a production proxy on a default nobody chose.
//! Every key is documented in `config/tongs.yaml` and in the README's table.

mod duration;
mod kubernetes;
mod salad;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use http::Uri;
use serde::{Deserialize, Serialize};

pub use duration::HumanDuration;
pub use kubernetes::{
    AllowRule, AnnotationKeys, KubernetesConfig, RegistrationConfig, Rule, annotation_key,
    is_qualified_name,
};
pub use salad::{KeyError, SaladApiConfig, SaladConfig};

/// Longest duration any key accepts (one day).
pub const MAX_DURATION: HumanDuration = HumanDuration::from_secs(24 * 3600);

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
    pub balancer: BalancerConfig,
    pub concurrency: ConcurrencyConfig,
    pub queue: QueueConfig,
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
            salad: SaladConfig::default(),
            health: HealthConfig::default(),
            breaker: BreakerConfig::default(),
            retry: RetryConfig::default(),
            balancer: BalancerConfig::default(),
            concurrency: ConcurrencyConfig::default(),
            queue: QueueConfig::default(),
            shutdown: ShutdownConfig::default(),
        }
    }
}

/// The admin listener (health probes now; metrics and debug pages later).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// A file holding a bearer token (a mounted Secret). When set, every admin path but `/healthz` and
    /// `/readyz` (the kubelet's probes) requires `Authorization: Bearer <token>`.
    pub bearer_token_file: Option<PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 9090)),
            bearer_token_file: None,
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
}

impl Default for TailscaleConfig {
    fn default() -> Self {
        Self {
            proxy: String::new(),
            ranges: vec!["100.64.0.0/10".into(), "fd7a:115c:a1e0::/48".into()],
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

    fn validate(&self, problems: &mut Vec<Problem>) {
        if !self.proxy.is_empty()
            && let Err(message) = crate::upstream::parse_proxy(&self.proxy)
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

/// Active health checks (heartbeats), one loop per endpoint through the endpoint's own transport.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Heartbeats on (default) or off.
    pub enabled: bool,
    /// Path requested with GET; any 2xx passes.
    pub path: String,
    /// Time between heartbeats of one endpoint, jittered by ±`jitter`.
    pub interval: HumanDuration,
    /// Time between heartbeats while an endpoint is changing state (after a failed heartbeat of a healthy
    /// endpoint, or a passing one of an unhealthy endpoint), so a verdict comes quickly.
    pub fast_interval: HumanDuration,
    /// A heartbeat with no answer within this time fails.
    pub timeout: HumanDuration,
    /// Consecutive failed heartbeats that mark an endpoint unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive passing heartbeats that mark an unhealthy endpoint healthy again.
    pub healthy_threshold: u32,
    /// Share of the interval by which each wait is randomly lengthened or shortened (0 ..= 0.5).
    pub jitter: f64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            path: "/health".into(),
            interval: HumanDuration::from_secs(2),
            fast_interval: HumanDuration::from_millis(250),
            timeout: HumanDuration::from_secs(1),
            unhealthy_threshold: 2,
            healthy_threshold: 2,
            jitter: 0.1,
        }
    }
}

/// Per-endpoint circuit breakers fed by every request's outcome.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failed requests that eject an endpoint.
    pub consecutive_failures: u32,
    /// First ejection time; doubles with each ejection that follows soon after the last.
    pub base_ejection: HumanDuration,
    /// Longest ejection time.
    pub max_ejection: HumanDuration,
    /// Largest share of the endpoints (percent) that may be ejected at once; beyond it failures are counted
    /// but endpoints stay in service, so a blip that hits everything cannot eject the whole fleet.
    pub max_ejected_percent: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 3,
            base_ejection: HumanDuration::from_secs(5),
            max_ejection: HumanDuration::from_secs(60),
            max_ejected_percent: 50,
        }
    }
}

/// When a failed attempt is retried on another endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Retries on (default). A request can opt out with the header `x-tongs-retry: off`.
    pub enabled: bool,
    /// Attempts per request, the first included (1 ..= 8).
    pub max_attempts: u32,
    /// What is retried: `connect-failure`, `reset` (connection broken before the response started),
    /// `timeout` (no response headers within `timeouts.response_headers`), `unhealthy` (heartbeats
    /// declared the endpoint gone while the attempt waited), `back-pressure` (429, or 503 with
    /// `Retry-After`), and status codes.
    pub on: Vec<RetryOn>,
    /// Backoff before a retry: random between zero and base × 2^(retry − 1), at most `backoff_max`.
    pub backoff_base: HumanDuration,
    pub backoff_max: HumanDuration,
    /// Request bodies up to this size are kept for replay; a larger body streams, and its request is
    /// retried only if the endpoint received none of it (a connect failure).
    pub replay_limit_bytes: u64,
    /// Retries may add at most this share of the request rate (percent) ...
    pub budget_percent: u32,
    /// ... plus this many retries per second, so a quiet proxy can still retry.
    pub budget_min_per_second: u32,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_attempts: 3,
            on: RetryOn::defaults(),
            backoff_base: HumanDuration::from_millis(10),
            backoff_max: HumanDuration::from_millis(200),
            replay_limit_bytes: 4 * 1024 * 1024,
            budget_percent: 20,
            budget_min_per_second: 10,
        }
    }
}

/// One retryable condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetryOn {
    ConnectFailure,
    Reset,
    Timeout,
    Unhealthy,
    BackPressure,
    Status(u16),
}

impl RetryOn {
    pub fn defaults() -> Vec<RetryOn> {
        vec![
            RetryOn::ConnectFailure,
            RetryOn::Reset,
            RetryOn::Timeout,
            RetryOn::Unhealthy,
            RetryOn::BackPressure,
            RetryOn::Status(502),
            RetryOn::Status(503),
            RetryOn::Status(504),
            RetryOn::Status(524),
        ]
    }
}

impl Serialize for RetryOn {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            RetryOn::ConnectFailure => serializer.serialize_str("connect-failure"),
            RetryOn::Reset => serializer.serialize_str("reset"),
            RetryOn::Timeout => serializer.serialize_str("timeout"),
            RetryOn::Unhealthy => serializer.serialize_str("unhealthy"),
            RetryOn::BackPressure => serializer.serialize_str("back-pressure"),
            RetryOn::Status(code) => serializer.serialize_u16(*code),
        }
    }
}

impl<'de> Deserialize<'de> for RetryOn {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = RetryOn;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "connect-failure, reset, timeout, unhealthy, back-pressure, or a status code 500..=599",
                )
            }
            fn visit_u64<E: serde::de::Error>(self, code: u64) -> Result<RetryOn, E> {
                match u16::try_from(code) {
                    Ok(code @ 500..=599) => Ok(RetryOn::Status(code)),
                    _ => Err(E::custom(format!(
                        "status {code} is not retryable: use 500..=599"
                    ))),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, code: i64) -> Result<RetryOn, E> {
                self.visit_u64(u64::try_from(code).unwrap_or(0))
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<RetryOn, E> {
                match text {
                    "connect-failure" => Ok(RetryOn::ConnectFailure),
                    "reset" => Ok(RetryOn::Reset),
                    "timeout" => Ok(RetryOn::Timeout),
                    "unhealthy" => Ok(RetryOn::Unhealthy),
                    "back-pressure" => Ok(RetryOn::BackPressure),
                    other => match other.parse::<u64>() {
                        Ok(code) => self.visit_u64(code),
                        Err(_) => Err(E::custom(format!(
                            "unknown retry condition {other:?}: use connect-failure, reset, timeout, \
                             unhealthy, back-pressure or a status code"
                        ))),
                    },
                }
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

/// How the balancer ramps endpoints in.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BalancerConfig {
    /// `expected-latency`: least (outstanding + 1) × latency estimate ÷ weight; `least-outstanding`: least
    /// (outstanding + 1) ÷ weight.
    pub policy: BalancePolicy,
    /// Time constant of the latency estimate: how fast it forgets a fast answer, and how long an idle
    /// endpoint's estimate takes to return to the fleet's (so a node slow once is tried again).
    pub latency_decay: HumanDuration,
    /// A new or recovered endpoint's share of traffic ramps from 10 % to 100 % over this window; 0s
    /// turns slow start off.
    pub slow_start: HumanDuration,
}

impl Default for BalancerConfig {
    fn default() -> Self {
        Self {
            policy: BalancePolicy::ExpectedLatency,
            latency_decay: HumanDuration::from_secs(10),
            slow_start: HumanDuration::from_secs(5),
        }
    }
}

/// How the balancer ranks eligible endpoints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BalancePolicy {
    #[default]
    ExpectedLatency,
    LeastOutstanding,
}

/// How many requests each endpoint is given at once.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConcurrencyConfig {
    /// `none` (no per-endpoint limit), `static` (`max_outstanding_per_endpoint` each), or `adaptive`
    /// (learned per endpoint from its latency and its own 429/503 answers).
    pub limit: LimitMode,
    /// The static limit, and the adaptive limit's starting value.
    pub max_outstanding_per_endpoint: u32,
    /// Bounds of the adaptive limit.
    pub min_limit: u32,
    pub max_limit: u32,
    /// How often the adaptive limiter re-measures an endpoint's unloaded latency (at half its limit).
    pub probe_interval: HumanDuration,
    /// The adaptive limit is multiplied by this when the endpoint answers 429, or 503 with Retry-After.
    pub backoff_ratio: f64,
}

impl Default for ConcurrencyConfig {
    fn default() -> Self {
        Self {
            limit: LimitMode::None,
            max_outstanding_per_endpoint: 8,
            min_limit: 1,
            max_limit: 256,
            probe_interval: HumanDuration::from_secs(60),
            backoff_ratio: 0.75,
        }
    }
}

/// Kind of per-endpoint concurrency limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LimitMode {
    #[default]
    None,
    Static,
    Adaptive,
}

/// Where requests wait when no endpoint can take them.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Requests that may wait at once; 0 turns the queue off (such requests are refused at once).
    pub max_length: usize,
    /// Longest wait in the queue; the request's own deadline may cut it shorter.
    pub max_wait: HumanDuration,
    /// Request header giving the priority: `high`, `normal` (the default) or `low`.
    pub priority_header: String,
    /// Request header with the client's own deadline in milliseconds (like Envoy's
    /// `x-envoy-upstream-rq-timeout-ms`); it can only shorten `timeouts.total`.
    pub deadline_header: String,
    /// Congestion: while the oldest waiter has waited longer than this, low-priority arrivals are refused
    /// at once (`shed-low-priority`).
    pub shed_low_priority_after: HumanDuration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_length: 1000,
            max_wait: HumanDuration::from_secs(30),
            priority_header: "x-priority".into(),
            deadline_header: "x-tongs-timeout-ms".into(),
            shed_low_priority_after: HumanDuration::from_secs(5),
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
        load_validated(path, Config::validate)
    }

    /// Parses and validates config text; `origin` names it in errors (a file path, usually).
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        parse_validated(text, origin, Config::validate)
    }

    /// Checks what the types alone cannot; returns every problem, not just the first.
    pub fn validate(&self) -> Vec<Problem> {
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
            ("shutdown.grace", self.shutdown.grace, false),
            ("health.interval", self.health.interval, false),
            ("health.fast_interval", self.health.fast_interval, false),
            ("health.timeout", self.health.timeout, false),
            ("breaker.base_ejection", self.breaker.base_ejection, false),
            ("breaker.max_ejection", self.breaker.max_ejection, false),
            ("retry.backoff_base", self.retry.backoff_base, true),
            ("retry.backoff_max", self.retry.backoff_max, true),
            ("balancer.slow_start", self.balancer.slow_start, true),
            ("balancer.latency_decay", self.balancer.latency_decay, false),
            (
                "concurrency.probe_interval",
                self.concurrency.probe_interval,
                false,
            ),
            ("queue.max_wait", self.queue.max_wait, false),
            (
                "queue.shed_low_priority_after",
                self.queue.shed_low_priority_after,
                false,
            ),
        ];
        for (field, value, zero_allowed) in durations {
            if value.get().is_zero() && !zero_allowed {
                problem(field.into(), "must be greater than zero".into());
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
        if self.health.path.is_empty() || !self.health.path.starts_with('/') {
            problem(
                "health.path".into(),
                format!("must start with /, got {:?}", self.health.path),
            );
        }
        for (field, value) in [
            (
                "health.unhealthy_threshold",
                self.health.unhealthy_threshold,
            ),
            ("health.healthy_threshold", self.health.healthy_threshold),
            (
                "breaker.consecutive_failures",
                self.breaker.consecutive_failures,
            ),
        ] {
            if value == 0 {
                problem(field.into(), "must be at least 1".into());
            }
        }
        if !(0.0..=0.5).contains(&self.health.jitter) {
            problem(
                "health.jitter".into(),
                format!("must be between 0 and 0.5, got {}", self.health.jitter),
            );
        }
        if self.breaker.max_ejection < self.breaker.base_ejection {
            problem(
                "breaker.max_ejection".into(),
                format!(
                    "({}) must be at least breaker.base_ejection ({})",
                    self.breaker.max_ejection, self.breaker.base_ejection
                ),
            );
        }
        if self.breaker.max_ejected_percent > 100 {
            problem(
                "breaker.max_ejected_percent".into(),
                format!(
                    "must be at most 100, got {}",
                    self.breaker.max_ejected_percent
                ),
            );
        }
        if !(1..=8).contains(&self.retry.max_attempts) {
            problem(
                "retry.max_attempts".into(),
                format!("must be between 1 and 8, got {}", self.retry.max_attempts),
            );
        }
        if self.retry.backoff_max < self.retry.backoff_base {
            problem(
                "retry.backoff_max".into(),
                "must be at least retry.backoff_base".into(),
            );
        }
        if self.retry.budget_percent > 1000 {
            problem(
                "retry.budget_percent".into(),
                format!("must be at most 1000, got {}", self.retry.budget_percent),
            );
        }
        if self.retry.budget_min_per_second > 100_000 {
            problem(
                "retry.budget_min_per_second".into(),
                "must be at most 100000".into(),
            );
        }
        let concurrency = &self.concurrency;
        for (field, value) in [
            (
                "concurrency.max_outstanding_per_endpoint",
                concurrency.max_outstanding_per_endpoint,
            ),
            ("concurrency.min_limit", concurrency.min_limit),
        ] {
            if !(1..=100_000).contains(&value) {
                problem(
                    field.into(),
                    format!("must be between 1 and 100000, got {value}"),
                );
            }
        }
        if concurrency.max_limit < concurrency.min_limit || concurrency.max_limit > 100_000 {
            problem(
                "concurrency.max_limit".into(),
                format!(
                    "must be between concurrency.min_limit ({}) and 100000, got {}",
                    concurrency.min_limit, concurrency.max_limit
                ),
            );
        }
        if !(0.1..1.0).contains(&concurrency.backoff_ratio) {
            problem(
                "concurrency.backoff_ratio".into(),
                format!(
                    "must be at least 0.1 and below 1, got {}",
                    concurrency.backoff_ratio
                ),
            );
        }
        if self.queue.max_length > 1_000_000 {
            problem(
                "queue.max_length".into(),
                format!("must be at most 1000000, got {}", self.queue.max_length),
            );
        }
        for (field, name) in [
            ("queue.priority_header", &self.queue.priority_header),
            ("queue.deadline_header", &self.queue.deadline_header),
        ] {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                problem(field.into(), format!("{name:?} is not a valid header name"));
            }
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
        if let Some(path) = &self.admin.bearer_token_file {
            match std::fs::read_to_string(path) {
                Ok(token) if token.trim().is_empty() => problem(
                    "admin.bearer_token_file".into(),
                    format!("{} is empty", path.display()),
                ),
                Ok(_) => {}
                Err(err) => problem(
                    "admin.bearer_token_file".into(),
                    format!("cannot read {}: {err}", path.display()),
                ),
            }
        }
        if let Some(path) = &self.upstream.extra_ca_file
            && !path.is_file()
        {
            problem(
                "upstream.extra_ca_file".into(),
                format!("{} is not a readable file", path.display()),
            );
        }
        self.upstream.tailscale.validate(&mut problems);
        self.salad.validate(&mut problems);
        self.discovery.kubernetes.validate(&mut problems);
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

/// [`parse_yaml`], then `validate`, which returns every problem the types alone cannot catch.
pub fn parse_validated<T: serde::de::DeserializeOwned + Default>(
    text: &str,
    origin: &str,
    validate: impl FnOnce(&T) -> Vec<Problem>,
) -> Result<T, ConfigError> {
    let value: T = parse_yaml(text, origin)?;
    let problems = validate(&value);
    if problems.is_empty() {
        Ok(value)
    } else {
        Err(ConfigError::Invalid {
            origin: origin.to_owned(),
            problems,
        })
    }
}

/// Reads a YAML file and [`parse_validated`]s it, naming the file in errors.
pub fn load_validated<T: serde::de::DeserializeOwned + Default>(
    path: &Path,
    validate: impl FnOnce(&T) -> Vec<Problem>,
) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_validated(&text, &path.display().to_string(), validate)
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

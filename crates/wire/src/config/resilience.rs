//! Noticing and surviving failing endpoints: heartbeats, circuit breakers and retries.

use serde::{Deserialize, Serialize};

use super::{HumanDuration, Problem};

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
    /// A deep heartbeat: this request instead of `GET path` (e.g. a one-token completion), so a node
    /// whose health endpoint answers while its model cannot fails its heartbeats. Off by default.
    pub request: Option<HealthRequest>,
    /// How often a passing heartbeat is followed by `GET /v1/models` on the endpoint, so that
    /// tongs' own `/v1/models` lists what the pools' nodes say they serve (0: never).
    pub models_interval: HumanDuration,
}

/// The request a deep heartbeat sends, and the status that passes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthRequest {
    #[serde(default = "default_method")]
    pub method: String,
    pub path: String,
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub body: String,
    /// The status that passes (any 2xx when left out).
    #[serde(default)]
    pub expected_status: Option<u16>,
}

fn default_method() -> String {
    "GET".into()
}

impl HealthRequest {
    fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem = |field: &str, message: String| {
            problems.push(Problem {
                field: format!("health.request.{field}"),
                message,
            })
        };
        if http::Method::from_bytes(self.method.as_bytes()).is_err() {
            problem("method", format!("{:?} is not an HTTP method", self.method));
        }
        if !self.path.starts_with('/') || self.path.parse::<http::uri::PathAndQuery>().is_err() {
            problem(
                "path",
                format!("must be a path starting with /, got {:?}", self.path),
            );
        }
        for (name, value) in &self.headers {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                problem("headers", format!("{name:?} is not a valid header name"));
            }
            if http::HeaderValue::from_str(value).is_err() {
                problem(
                    &format!("headers.{name}"),
                    "is not a valid header value".into(),
                );
            }
        }
        if let Some(status) = self.expected_status
            && !(100..=599).contains(&status)
        {
            problem(
                "expected_status",
                format!("must be an HTTP status 100..=599, got {status}"),
            );
        }
    }
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
            request: None,
            models_interval: HumanDuration::from_secs(30),
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
    /// Gray failures: attempts in a row that stall — still without an answer at their stall point while
    /// other endpoints answer and heartbeats pass — which mark the endpoint stalled: ejected, its
    /// waiting requests moved at once, and closed again only by a real request.
    pub consecutive_stalls: u32,
    /// An attempt still without an answer after this many times its endpoint's expected time to first
    /// byte (2 ..= 1000), and twice the hedge delay, counts as stalled, and gets a second attempt
    /// elsewhere beside it when no hedge runs yet.
    pub stall_multiplier: f64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 3,
            base_ejection: HumanDuration::from_secs(5),
            max_ejection: HumanDuration::from_secs(60),
            max_ejected_percent: 50,
            consecutive_stalls: 2,
            stall_multiplier: 6.0,
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
    /// Memory all bodies kept for replay share, process-wide; over it a body streams (and is retried
    /// only as a streamed body is).
    pub replay_budget_bytes: u64,
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
            replay_budget_bytes: 128 * 1024 * 1024,
            budget_percent: 20,
            budget_min_per_second: 10,
        }
    }
}

/// One retryable condition: the name of every way an attempt can fail, in `retry.on`, in logs and in
/// metric labels.
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
    /// Whether the endpoint is at fault (feeds the breaker); back-pressure is not a fault.
    pub fn is_endpoint_fault(self) -> bool {
        self != RetryOn::BackPressure
    }

    /// One of each kind (every status code counts as `status`).
    pub const KINDS: [RetryOn; 6] = [
        RetryOn::ConnectFailure,
        RetryOn::Reset,
        RetryOn::Timeout,
        RetryOn::Unhealthy,
        RetryOn::BackPressure,
        RetryOn::Status(0),
    ];

    /// The condition's name; `status` for any status code.
    pub fn as_str(self) -> &'static str {
        match self {
            RetryOn::ConnectFailure => "connect-failure",
            RetryOn::Reset => "reset",
            RetryOn::Timeout => "timeout",
            RetryOn::Unhealthy => "unhealthy",
            RetryOn::BackPressure => "back-pressure",
            RetryOn::Status(_) => "status",
        }
    }

    /// The condition's place in [`RetryOn::KINDS`].
    pub fn index(self) -> usize {
        match self {
            RetryOn::ConnectFailure => 0,
            RetryOn::Reset => 1,
            RetryOn::Timeout => 2,
            RetryOn::Unhealthy => 3,
            RetryOn::BackPressure => 4,
            RetryOn::Status(_) => 5,
        }
    }

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
            RetryOn::Status(code) => serializer.serialize_u16(*code),
            named => serializer.serialize_str(named.as_str()),
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
                let named = RetryOn::KINDS[..5]
                    .iter()
                    .find(|kind| kind.as_str() == text);
                match named {
                    Some(kind) => Ok(*kind),
                    None => match text.parse::<u64>() {
                        Ok(code) => self.visit_u64(code),
                        Err(_) => Err(E::custom(format!(
                            "unknown retry condition {text:?}: use connect-failure, reset, timeout, \
                             unhealthy, back-pressure or a status code"
                        ))),
                    },
                }
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

impl HealthConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if self.path.is_empty() || !self.path.starts_with('/') {
            problem(
                "health.path".into(),
                format!("must start with /, got {:?}", self.path),
            );
        }
        for (field, value) in [
            ("health.unhealthy_threshold", self.unhealthy_threshold),
            ("health.healthy_threshold", self.healthy_threshold),
        ] {
            if value == 0 {
                problem(field.into(), "must be at least 1".into());
            }
        }
        if !(0.0..=0.5).contains(&self.jitter) {
            problem(
                "health.jitter".into(),
                format!("must be between 0 and 0.5, got {}", self.jitter),
            );
        }
        if let Some(request) = &self.request {
            request.validate(problems);
        }
    }
}

impl BreakerConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if self.consecutive_failures == 0 {
            problem(
                "breaker.consecutive_failures".into(),
                "must be at least 1".into(),
            );
        }
        if self.max_ejection < self.base_ejection {
            problem(
                "breaker.max_ejection".into(),
                format!(
                    "({}) must be at least breaker.base_ejection ({})",
                    self.max_ejection, self.base_ejection
                ),
            );
        }
        if self.max_ejected_percent > 100 {
            problem(
                "breaker.max_ejected_percent".into(),
                format!("must be at most 100, got {}", self.max_ejected_percent),
            );
        }
        if self.consecutive_stalls == 0 {
            problem(
                "breaker.consecutive_stalls".into(),
                "must be at least 1".into(),
            );
        }
        if !(2.0..=1000.0).contains(&self.stall_multiplier) {
            problem(
                "breaker.stall_multiplier".into(),
                format!("must be between 2 and 1000, got {}", self.stall_multiplier),
            );
        }
    }
}

impl RetryConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if !(1..=8).contains(&self.max_attempts) {
            problem(
                "retry.max_attempts".into(),
                format!("must be between 1 and 8, got {}", self.max_attempts),
            );
        }
        if self.backoff_max < self.backoff_base {
            problem(
                "retry.backoff_max".into(),
                "must be at least retry.backoff_base".into(),
            );
        }
        if self.budget_percent > 1000 {
            problem(
                "retry.budget_percent".into(),
                format!("must be at most 1000, got {}", self.budget_percent),
            );
        }
        if self.budget_min_per_second > 100_000 {
            problem(
                "retry.budget_min_per_second".into(),
                "must be at most 100000".into(),
            );
        }
    }
}

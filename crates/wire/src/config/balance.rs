//! Spreading load: the balancer's policy, per-endpoint concurrency limits, and the queue.

use serde::{Deserialize, Serialize};

use super::{Header, HumanDuration, Problem};

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
    pub priority_header: Header,
    /// Request header with the client's own deadline in milliseconds (like Envoy's
    /// `x-envoy-upstream-rq-timeout-ms`); it can only shorten `timeouts.total`.
    pub deadline_header: Header,
    /// Congestion: while the oldest waiter has waited longer than this, low-priority arrivals are refused
    /// at once (`shed-low-priority`).
    pub shed_low_priority_after: HumanDuration,
    /// Longest wait while the pool has no endpoint at all (none discovered yet: a fleet scaling from
    /// zero, whose first node takes minutes), after which the request goes to a fallback pool or is
    /// refused; 0s falls back or refuses at once; unset, `max_wait`. Queued requests count in
    /// `tongs_demand`, which is what lets an autoscaler see them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_wait_no_endpoints: Option<HumanDuration>,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_length: 1000,
            max_wait: HumanDuration::from_secs(30),
            priority_header: Header::from_static("x-priority"),
            deadline_header: Header::from_static("x-tongs-timeout-ms"),
            shed_low_priority_after: HumanDuration::from_secs(5),
            max_wait_no_endpoints: None,
        }
    }
}

impl ConcurrencyConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        for (field, value) in [
            (
                "self.max_outstanding_per_endpoint",
                self.max_outstanding_per_endpoint,
            ),
            ("self.min_limit", self.min_limit),
        ] {
            if !(1..=100_000).contains(&value) {
                problem(
                    field.into(),
                    format!("must be between 1 and 100000, got {value}"),
                );
            }
        }
        if self.max_limit < self.min_limit || self.max_limit > 100_000 {
            problem(
                "self.max_limit".into(),
                format!(
                    "must be between self.min_limit ({}) and 100000, got {}",
                    self.min_limit, self.max_limit
                ),
            );
        }
        if !(0.1..1.0).contains(&self.backoff_ratio) {
            problem(
                "self.backoff_ratio".into(),
                format!(
                    "must be at least 0.1 and below 1, got {}",
                    self.backoff_ratio
                ),
            );
        }
    }
}

impl QueueConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if self.max_length > 1_000_000 {
            problem(
                "queue.max_length".into(),
                format!("must be at most 1000000, got {}", self.max_length),
            );
        }
    }
}

//! Spreading load: the balancer's policy, per-endpoint concurrency limits, and the queue.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Header, HumanDuration, Problem};
use crate::openai::prefix::{BLOCK_BYTES_MAX, BLOCK_BYTES_MIN};

/// What `balancer.scorers` is when the file leaves it out: `policy`'s scorer, then the model
/// servers' own load and the affinities, each with the weight that works untuned on a fleet that serves
/// metrics and on one that does not (a scorer without its signal scores every node alike).
pub fn default_scorers(policy: BalancePolicy) -> Vec<(&'static str, f64)> {
    let load = match policy {
        BalancePolicy::ExpectedLatency => "expected-latency",
        BalancePolicy::LeastOutstanding => "least-outstanding",
    };
    vec![
        (load, 1.0),
        ("queue", 1.0),
        ("kv-cache", 1.0),
        ("prefix", 2.0),
        ("session", 3.0),
    ]
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
    /// The pick's scorers by name, each with its weight. Each scorer gives a node a cost factor; a
    /// node's cost is the product of its factors, each raised to its weight (so weights compare across
    /// scorers whatever their units). Unset: `policy`'s scorer 1, `queue` 1, `kv-cache` 1, `prefix` 2,
    /// `session` 3. A scorer left out is not asked; a weight of 0 is the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scorers: Option<BTreeMap<String, f64>>,
    /// Keeping a conversation where its prompt is cached.
    pub affinity: AffinityConfig,
}

/// How requests are kept where their prompt's prefix is cached, or on their session's node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AffinityConfig {
    /// A request header naming the request's session: its requests stay on one node while that node
    /// is healthy and not saturated. Empty: none.
    pub session_header: String,
    /// The OpenAI `user` field is the session when no header names one.
    pub user_field: bool,
    /// Prompt bytes per hashed block (llm-d's 16 tokens are about 64 bytes).
    pub block_bytes: usize,
    /// Most block hashes the pool's prefix index keeps, least recently used first out (about 100
    /// bytes each, so the default is about 20 MB at most).
    pub index_blocks: usize,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            session_header: "x-session-id".into(),
            user_field: true,
            block_bytes: 64,
            index_blocks: 200_000,
        }
    }
}

impl AffinityConfig {
    /// The session header's name, when there is one.
    pub fn session_header(&self) -> Option<Header> {
        if self.session_header.is_empty() {
            return None;
        }
        http::HeaderName::from_bytes(self.session_header.as_bytes())
            .ok()
            .map(Header)
    }
}

impl BalancerConfig {
    /// The scorers and weights the pick uses, in a fixed order (the file's map is sorted by name).
    pub fn scorer_weights(&self) -> Vec<(String, f64)> {
        match &self.scorers {
            Some(given) => given
                .iter()
                .filter(|(_, weight)| **weight > 0.0)
                .map(|(name, weight)| (name.clone(), *weight))
                .collect(),
            None => default_scorers(self.policy)
                .into_iter()
                .map(|(name, weight)| (name.to_owned(), weight))
                .collect(),
        }
    }

    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if let Some(scorers) = &self.scorers {
            for (name, weight) in scorers {
                // Whether `name` is a scorer, tongs checks: it registers them ([`super::Checks`]).
                if !(0.0..=100.0).contains(weight) {
                    problem(
                        format!("balancer.scorers.{name}"),
                        format!("must be a weight from 0 to 100, got {weight}"),
                    );
                }
            }
            if !scorers.values().any(|weight| *weight > 0.0) {
                problem(
                    "balancer.scorers".into(),
                    "must give at least one scorer a weight above 0".into(),
                );
            }
        }
        let affinity = &self.affinity;
        if !affinity.session_header.is_empty() && affinity.session_header().is_none() {
            problem(
                "balancer.affinity.session_header".into(),
                format!("{:?} is not a valid header name", affinity.session_header),
            );
        }
        if !(BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&affinity.block_bytes) {
            problem(
                "balancer.affinity.block_bytes".into(),
                format!(
                    "must be between {BLOCK_BYTES_MIN} and {BLOCK_BYTES_MAX}, got {}",
                    affinity.block_bytes
                ),
            );
        }
        if affinity.index_blocks > 100_000_000 {
            problem(
                "balancer.affinity.index_blocks".into(),
                format!("must be at most 100000000, got {}", affinity.index_blocks),
            );
        }
    }
}

impl Default for BalancerConfig {
    fn default() -> Self {
        Self {
            policy: BalancePolicy::ExpectedLatency,
            latency_decay: HumanDuration::from_secs(10),
            slow_start: HumanDuration::from_secs(5),
            scorers: None,
            affinity: AffinityConfig::default(),
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
    /// `none` (no per-endpoint limit; the default), `static` (`max_outstanding_per_endpoint` each),
    /// `adaptive` (a gradient against the endpoint's unloaded latency), or `learned` (each endpoint's
    /// capacity read off what its answers took at each load, and its own 429/503 answers).
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
    Learned,
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
    /// The wait tongs keeps the queue to under sustained overload. Once arrivals have expected (from
    /// how fast the queue drains) to wait longer than this for `overload_after` on end, an arrival
    /// expected to wait longer is refused at once, with a `Retry-After` from the drain rate, until the
    /// queue next empties. A burst the fleet drains sooner still queues, up to `max_wait` (which also
    /// caps this). `0s` turns the control off (requests wait up to `max_wait`).
    pub target_wait: HumanDuration,
    /// How long expected waits must stay above `target_wait` before arrivals are refused for it.
    pub overload_after: HumanDuration,
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
            target_wait: HumanDuration::from_millis(500),
            overload_after: HumanDuration::from_secs(1),
        }
    }
}

impl ConcurrencyConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        for (field, value) in [
            (
                "concurrency.max_outstanding_per_endpoint",
                self.max_outstanding_per_endpoint,
            ),
            ("concurrency.min_limit", self.min_limit),
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
                "concurrency.max_limit".into(),
                format!(
                    "must be between concurrency.min_limit ({}) and 100000, got {}",
                    self.min_limit, self.max_limit
                ),
            );
        }
        if !(0.1..1.0).contains(&self.backoff_ratio) {
            problem(
                "concurrency.backoff_ratio".into(),
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

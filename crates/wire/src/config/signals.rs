//! `signals`: reading each model server's own load (its batch, its queue, its KV cache) from its
//! Prometheus metrics, and when that load counts as saturated.

use serde::{Deserialize, Serialize};

use super::{HumanDuration, Problem};
use crate::engine::Engine;

/// How tongs reads the model servers' own metrics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SignalsConfig {
    /// Read them (on by default: a node that serves none just has no signals).
    pub enabled: bool,
    /// The metric names to read when the pod or the static endpoint names no engine of its own:
    /// `vllm`, `sglang` or `tgi`.
    pub engine: Engine,
    /// The path of the metrics page on each endpoint (after the endpoint's own path prefix).
    pub path: String,
    /// How often each endpoint is read.
    pub interval: HumanDuration,
    /// How long one read may take.
    pub timeout: HumanDuration,
    /// Signals older than this are not used: the pick falls back to tongs' own counts for the node.
    pub max_age: HumanDuration,
    /// A node whose page is missing (404, or no such metrics) is asked again after this.
    pub absent_retry: HumanDuration,
    /// When a node counts as saturated: it takes no new request while another has room.
    pub saturation: Saturation,
}

/// The thresholds past which a node takes no new request while another node has room; when every
/// node is past them, requests wait in tongs' queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Saturation {
    /// Requests waiting in the node's own queue (tongs' estimate: the last reading, plus what tongs
    /// sent since, less what ended since). 0 turns this test off.
    pub waiting: u32,
    /// Share of its KV cache in use, 0 to 1. 1 turns this test off.
    pub kv_cache: f64,
}

impl Default for Saturation {
    fn default() -> Self {
        Saturation {
            waiting: 5,
            kv_cache: 0.9,
        }
    }
}

impl Default for SignalsConfig {
    fn default() -> Self {
        SignalsConfig {
            enabled: true,
            engine: Engine::Vllm,
            path: "/metrics".into(),
            interval: HumanDuration::from_secs(1),
            timeout: HumanDuration::from_secs(2),
            max_age: HumanDuration::from_secs(3),
            absent_retry: HumanDuration::from_secs(60),
            saturation: Saturation::default(),
        }
    }
}

impl SignalsConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem = |field: &str, message: String| {
            problems.push(Problem {
                field: field.into(),
                message,
            })
        };
        if !self.path.starts_with('/') || self.path.parse::<http::uri::PathAndQuery>().is_err() {
            problem(
                "signals.path",
                format!("must be a path starting with /, got {:?}", self.path),
            );
        }
        if self.max_age < self.interval {
            problem(
                "signals.max_age",
                format!(
                    "({}) must be at least signals.interval ({}): every reading would be stale",
                    self.max_age, self.interval
                ),
            );
        }
        if !(0.0..=1.0).contains(&self.saturation.kv_cache) {
            problem(
                "signals.saturation.kv_cache",
                format!("must be between 0 and 1, got {}", self.saturation.kv_cache),
            );
        }
        if self.saturation.waiting > 100_000 {
            problem(
                "signals.saturation.waiting",
                format!("must be at most 100000, got {}", self.saturation.waiting),
            );
        }
    }
}

//! Noticing attempts and streams that stopped, and what then: hedged attempts, the idle limit of a
//! stream, and continuing a broken OpenAI stream on another endpoint.

use serde::{Deserialize, Serialize};

use super::{HumanDuration, Problem};

/// Hedged attempts: an attempt with no answer in time gets a second one on another endpoint, and the
/// first to answer wins (the other is cancelled, its connection closed).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HedgeConfig {
    /// Hedging on (default). Only requests that can be retried are hedged (a body within
    /// `retry.replay_limit_bytes`, no `x-tongs-retry: off`).
    pub enabled: bool,
    /// An attempt is hedged once it has waited this many times its endpoint's expected time to first
    /// byte (1 ..= 100) ...
    pub after_multiplier: f64,
    /// ... and at least this long.
    pub min_delay: HumanDuration,
    /// Hedges add at most this share of the request rate (percent, 0 ..= 100); they also draw on the
    /// retry budget.
    pub max_extra_percent: u32,
}

impl Default for HedgeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            after_multiplier: 3.0,
            min_delay: HumanDuration::from_millis(250),
            max_extra_percent: 10,
        }
    }
}

impl HedgeConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        if !(1.0..=100.0).contains(&self.after_multiplier) {
            problems.push(Problem {
                field: "hedge.after_multiplier".into(),
                message: format!("must be between 1 and 100, got {}", self.after_multiplier),
            });
        }
        if self.max_extra_percent > 100 {
            problems.push(Problem {
                field: "hedge.max_extra_percent".into(),
                message: format!("must be at most 100, got {}", self.max_extra_percent),
            });
        }
    }
}

/// A response body that streams, after tongs committed it to the client.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamConfig {
    /// A stream that sends nothing for this many times what its node's streams typically take at that
    /// point, the wait for the first tokens or a gap between tokens (1 ..= 1000) ...
    pub idle_multiplier: f64,
    /// ... and at least this long, while the node sends nothing on any of its streams either, is taken
    /// for a stalled node: the stream is cut (continued elsewhere when it can be) and the endpoint
    /// counts a stall. The gaps are the node's own, by phase: the wait for a stream's first tokens
    /// (its first two gaps after the first chunk: the prompt's prefill behind a role chunk or a
    /// comment) and the gaps between tokens are learnt apart.
    pub idle_min: HumanDuration,
    /// The idle limit of a stream waiting for its first tokens on a node whose first tokens tongs has
    /// not timed yet (afterwards: `idle_multiplier` × what they take there, or more when they vary).
    pub first_token_idle: HumanDuration,
    /// How long one stream may stay silent while its node keeps sending on its other streams (a
    /// preemption, a slow prefill under load): the node is not stalled, so the
    /// stream is left alone this long, and then cut without counting against the node. (A pause is
    /// only judged once past the stream's idle limit: a `pause_max` below it cuts at that limit.)
    pub pause_max: HumanDuration,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            idle_multiplier: 10.0,
            idle_min: HumanDuration::from_secs(2),
            first_token_idle: HumanDuration::from_secs(10),
            pause_max: HumanDuration::from_secs(30),
        }
    }
}

impl StreamConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        if !(1.0..=1000.0).contains(&self.idle_multiplier) {
            problems.push(Problem {
                field: "stream.idle_multiplier".into(),
                message: format!("must be between 1 and 1000, got {}", self.idle_multiplier),
            });
        }
    }
}

/// Continuing a streamed OpenAI completion whose node broke after it started, on another endpoint,
/// spliced into the same client stream.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ContinuationConfig {
    /// On (default): a continued stream is what every client of an interruptible fleet wants.
    pub enabled: bool,
    /// Continuations one request may take (0 ..= 10); each also draws on the retry budget.
    pub max_continuations: u32,
    /// The floor of the idle limit of a stream that can be continued, in place of `stream.idle_min`:
    /// lower, since cutting such a stream costs the client a short pause (and a node a new prefill),
    /// not its answer.
    pub idle_min: HumanDuration,
    /// Whether the nodes are asked for token ids, so that a continuation is exact (see
    /// [`TokenIds`]).
    pub token_ids: TokenIds,
}

/// `continuation.token_ids`: whether a continuable stream's node is asked for its token ids
/// (`"return_token_ids": true`), so that a cut stream is continued by them, exactly, rather than by
/// its text, which the next node may tokenize otherwise. The client sees ids only if it asked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TokenIds {
    /// Asked where the pool's engine (`signals.engine`) is vLLM, which returns them (0.10.2 and
    /// later; an older one ignores the field, and its streams are continued by text).
    #[default]
    Auto,
    /// Always asked: servers that take `return_token_ids` whatever their metrics' names.
    Always,
    /// Never asked: every continuation is by text.
    Never,
}

impl Default for ContinuationConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_continuations: 2,
            idle_min: HumanDuration::from_secs(1),
            token_ids: TokenIds::Auto,
        }
    }
}

impl ContinuationConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        if self.max_continuations > 10 {
            problems.push(Problem {
                field: "continuation.max_continuations".into(),
                message: format!("must be at most 10, got {}", self.max_continuations),
            });
        }
    }
}

//! Counters the request path keeps as it goes (per-endpoint counters live on the endpoint).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::RetryOn as FailureKind;

/// Counters of the request path as a whole (per-endpoint counters live on the endpoint).
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Requests received.
    pub requests: AtomicU64,
    /// Attempts sent to endpoints (requests plus retries).
    pub attempts: AtomicU64,
    /// Requests tongs refused itself (queue full or timed out, shed, no endpoints); by reason in the
    /// queue's stats.
    pub rejected: AtomicU64,
    /// Requests whose every attempt failed.
    pub failed: AtomicU64,
    /// Retries, by reason, and retries the budget refused.
    pub retries: RetryStats,
    /// Hedged attempts sent, and those that answered first.
    pub hedges: AtomicU64,
    pub hedges_won: AtomicU64,
    /// Committed streams ended because they stalled or their endpoint was declared gone.
    pub streams_cut: AtomicU64,
    /// Continuable streams moved off a node that said it is going, before it went.
    pub streams_moved: AtomicU64,
    /// Silences of committed streams past their idle limit while their node went on sending tokens on
    /// its other streams: paused, not stalled, so left alone (cut only past `stream.pause_max`).
    pub stream_pauses: AtomicU64,
    /// Broken streams and what became of them.
    pub continuations: ContinuationStats,
    /// Of the streams continued, those continued from their text (their node gave no token ids):
    /// the rest may differ from the answer the first node would have given.
    pub continued_by_text: AtomicU64,
    /// Bytes of request bodies kept for replay now (a gauge).
    pub replay_bytes: AtomicU64,
    /// Request bodies streamed without replay because the replay budget was spent.
    pub replay_over_budget: AtomicU64,
}

/// Counters of retries, by reason.
#[derive(Debug, Default)]
pub struct RetryStats {
    by_reason: [AtomicU64; 6],
    /// Retries refused because the budget was spent.
    pub budget_exhausted: AtomicU64,
}

impl RetryStats {
    pub fn count(&self, kind: FailureKind) {
        self.by_reason[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn total(&self) -> u64 {
        self.by_reason
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// `(reason, retries)` for every reason.
    pub fn by_reason(&self) -> Vec<(&'static str, u64)> {
        FailureKind::KINDS
            .into_iter()
            .map(|k| {
                (
                    k.as_str(),
                    self.by_reason[k.index()].load(Ordering::Relaxed),
                )
            })
            .collect()
    }
}

/// What became of a continuable stream whose node broke after it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuation {
    /// Continued on another endpoint, spliced into the client's stream.
    Continued,
    /// It broke after its last token: tongs wrote its end.
    Completed,
    /// No endpoint continued it in time (attempts failed, a node refused the continuation, the
    /// request's deadline).
    Failed,
    /// `continuation.max_continuations` already taken.
    Limit,
    /// The retry budget was spent.
    Budget,
    /// Something in the stream made a continuation unsafe (tool calls, several choices, an error).
    Unsupported,
}

impl Continuation {
    pub const ALL: [Continuation; 6] = [
        Continuation::Continued,
        Continuation::Completed,
        Continuation::Failed,
        Continuation::Limit,
        Continuation::Budget,
        Continuation::Unsupported,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Continuation::Continued => "continued",
            Continuation::Completed => "completed",
            Continuation::Failed => "failed",
            Continuation::Limit => "limit",
            Continuation::Budget => "budget",
            Continuation::Unsupported => "unsupported",
        }
    }
}

/// Counters of [`Continuation`] outcomes.
#[derive(Debug, Default)]
pub struct ContinuationStats([AtomicU64; 6]);

impl ContinuationStats {
    pub fn count(&self, outcome: Continuation) {
        self.0[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, outcome: Continuation) -> u64 {
        self.0[outcome as usize].load(Ordering::Relaxed)
    }
}

//! Retrying elsewhere: what is retryable, the retry budget, backoff, and request bodies kept for replay.
//!
//! The budget is tower's `TpsBudget` (Finagle's design): every request deposits, every retry withdraws,
//! so retries add at most `budget_percent` of the request rate plus a small per-second floor. When the
//! whole fleet fails, the budget runs dry and tongs answers at once instead of multiplying the load.
//! Each worker thread keeps its own budget (a share of the floor, the same percentage), because a
//! `TpsBudget` takes a lock on every deposit and one shared budget would be a lock every request of
//! every thread contends for.

mod classify;
mod replay;

use std::time::Duration;

use tower::retry::budget::{Budget, TpsBudget};

use crate::config::RetryConfig;

pub use classify::{FailureKind, classify_status};
pub use replay::{BodyError, BodyIdle, BodyRules, BodyTooLarge, ReplayBody, ReplayBudget};
pub use tongs_wire::header::retry_after;

/// The retry rules of one configuration.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    config: RetryConfig,
}

/// One worker's retry budget.
pub struct RetryBudget(TpsBudget);

impl RetryBudget {
    /// Every request deposits into the budget.
    pub fn deposit(&self) {
        self.0.deposit();
    }

    /// Takes one retry from the budget.
    pub fn withdraw(&self) -> bool {
        self.0.withdraw()
    }
}

impl RetryPolicy {
    pub fn new(config: &RetryConfig) -> RetryPolicy {
        RetryPolicy {
            config: config.clone(),
        }
    }

    /// A budget for one of `workers` worker threads: the same percentage, a share of the floor.
    pub fn budget(&self, workers: usize) -> RetryBudget {
        let workers = u32::try_from(workers.max(1)).unwrap_or(u32::MAX);
        // Validation keeps these within TpsBudget's own bounds (percent ≤ 1000 %, floor < i32::MAX).
        RetryBudget(TpsBudget::new(
            Duration::from_secs(10),
            self.config.budget_min_per_second.div_ceil(workers),
            self.config.budget_percent as f32 / 100.0,
        ))
    }

    pub fn enabled(&self) -> bool {
        self.config.enabled && self.config.max_attempts > 1
    }

    pub fn max_attempts(&self) -> u32 {
        self.config.max_attempts
    }

    pub fn replay_limit(&self) -> u64 {
        self.config.replay_limit_bytes
    }

    /// Whether attempt number `attempt`, failed with `kind`, is tried again elsewhere: `retry.on` lists
    /// the failure, an attempt is left, the body can be sent again, and the deadline has not passed.
    /// (The budget is asked separately, last, so a retry that is not wanted spends nothing.)
    pub fn should_retry(
        &self,
        attempt: u32,
        kind: FailureKind,
        replayable: bool,
        before_deadline: bool,
    ) -> bool {
        attempt < self.max_attempts() && self.retries_on(kind) && replayable && before_deadline
    }

    /// Whether `retry.on` lists this failure.
    pub fn retries_on(&self, kind: FailureKind) -> bool {
        self.config.on.contains(&kind)
    }

    /// Backoff before retry number `retry` (1 for the first retry): full jitter up to base × 2^(retry−1).
    pub fn backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .config
            .backoff_base
            .get()
            .saturating_mul(1u32 << retry.saturating_sub(1).min(16))
            .min(self.config.backoff_max.get());
        ceiling.mul_f64(fastrand::f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_jittered_and_capped() {
        let policy = RetryPolicy::new(&RetryConfig::default());
        for retry in 1..10 {
            let backoff = policy.backoff(retry);
            assert!(backoff <= Duration::from_millis(200), "{backoff:?}");
        }
        let samples: Vec<_> = (0..20).map(|_| policy.backoff(3)).collect();
        assert!(samples.iter().any(|b| *b != samples[0]), "jittered");
    }

    #[tokio::test(start_paused = true)]
    async fn budget_caps_retries_at_a_share_of_requests() {
        let config = RetryConfig {
            budget_percent: 20,
            budget_min_per_second: 0,
            ..RetryConfig::default()
        };
        let budget = RetryPolicy::new(&config).budget(1);
        for _ in 0..100 {
            budget.deposit();
        }
        let granted = (0..100).filter(|_| budget.withdraw()).count();
        assert_eq!(granted, 20);
    }

    #[test]
    fn retry_on_follows_the_config() {
        let config = RetryConfig {
            on: vec![FailureKind::ConnectFailure, FailureKind::Status(503)],
            ..RetryConfig::default()
        };
        let policy = RetryPolicy::new(&config);
        assert!(policy.retries_on(FailureKind::ConnectFailure));
        assert!(policy.retries_on(FailureKind::Status(503)));
        assert!(!policy.retries_on(FailureKind::Status(502)));
        assert!(!policy.retries_on(FailureKind::Timeout));
    }
}

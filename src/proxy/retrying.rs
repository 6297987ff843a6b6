//! One request's attempts as a type of their own: how many were made, the busy nodes' refusals taken on
//! top of them, the time spent queued, and the last failure (the answer unless a later attempt gives
//! a better one); after each failure, whether to try again and after what back-off.
//!
//! A request's attempts ([`Attempts::for_request`]) and a broken stream's continuation attempts
//! ([`Attempts::for_continuation`]) both count here; the request path around them only sends.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::acquire::Tried;
use super::attempt::Failure;
use crate::admission::Queue;
use crate::metrics::RetryStats;
use crate::retry::{FailureKind, ReplayBody, RetryBudget, RetryPolicy};

/// Refusals from busy endpoints one request may take on top of `retry.max_attempts`.
const MAX_BOUNCES: u32 = 4;

/// The attempts of one request, or of one continuation.
pub(super) struct Attempts {
    /// Attempts begun that count against `retry.max_attempts`.
    made: u32,
    /// `retry.max_attempts`, at least one.
    max: u32,
    /// Busy endpoints' refusals still allowed on top of them (see [`Attempts::failed`]).
    bounces_left: u32,
    /// The client allows retries and the pool has them on.
    retries: bool,
    /// Retries draw on the worker's budget and are counted in its statistics (a request's do; a
    /// continuation's, which saves a stream already paid for, do not).
    budgeted: bool,
    /// Time spent in the queue so far: `queue.max_wait` bounds it over all attempts together.
    pub queued: Duration,
    /// The last attempt's failure, with the endpoint's own answer if it gave one.
    last_failure: Option<Failure>,
}

/// What follows a failed attempt.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// Another attempt, after this back-off (zero: at once).
    Retry(Duration),
    /// No more attempts: the last failure is the answer.
    Stop,
}

/// What the decision after a failure reads besides the attempts themselves.
pub(super) struct Retrying<'a> {
    pub policy: &'a RetryPolicy,
    /// The request body: whether it can be sent again is read at each failure (a streamed body
    /// cannot once an attempt started sending it).
    pub body: &'a ReplayBody,
    /// The request's overall deadline.
    pub deadline: Instant,
    pub queue: &'a Queue,
    /// The worker's retry budget and the pool's retry statistics (used when the attempts are
    /// budgeted).
    pub budget: &'a RetryBudget,
    pub stats: &'a RetryStats,
}

impl Attempts {
    /// A client request's attempts: retried when the client and the pool allow it, within the worker's
    /// budget; a busy node's refusal sends it to the queue, not to a back-off.
    pub fn for_request(policy: &RetryPolicy, retries: bool) -> Attempts {
        Attempts {
            made: 0,
            max: policy.max_attempts().max(1),
            bounces_left: MAX_BOUNCES,
            retries,
            budgeted: true,
            queued: Duration::ZERO,
            last_failure: None,
        }
    }

    /// A broken stream's continuation attempts: always retried up to `retry.max_attempts` (the stream
    /// is the client's already), outside the budget, every failure counting as one.
    pub fn for_continuation(policy: &RetryPolicy) -> Attempts {
        Attempts {
            bounces_left: 0,
            retries: true,
            budgeted: false,
            ..Attempts::for_request(policy, true)
        }
    }

    /// Begins the next attempt, if `retry.max_attempts` allows one: its number, from 1.
    pub fn next(&mut self) -> Option<u32> {
        (self.made < self.max).then(|| {
            self.made += 1;
            self.made
        })
    }

    /// An attempt is really under way: the failure it retries is dropped now (its connection
    /// released); until then it was the answer.
    pub fn under_way(&mut self) {
        drop(self.last_failure.take());
    }

    /// While the request waits in the queue, a failed attempt's answer must not hold its endpoint's
    /// slot from others: only the error is kept.
    pub fn release_answer(&mut self) {
        if let Some(failure) = self.last_failure.as_mut() {
            failure.response = None;
        }
    }

    /// No attempt has failed (nothing was sent, or nothing is left of it).
    pub fn none_failed(&self) -> bool {
        self.last_failure.is_none()
    }

    /// The last failure, which is the answer when no attempt commits.
    pub fn into_last_failure(self) -> Option<Failure> {
        self.last_failure
    }

    /// Records a failed attempt and decides what follows it.
    ///
    /// A busy endpoint's refusal says "later", not "broken": it does not use up one of
    /// `retry.max_attempts`, it is no failure to back off from, and once every endpoint turned the
    /// request away the request waits in the queue for the next free slot (see `acquire`); under
    /// sustained overload (the queue standing), at once rather than after a round of refusals from
    /// nodes that are full too. Bounded, so a fleet refusing for good still gets its answer passed on.
    pub fn failed(&mut self, failure: Failure, on: &Retrying<'_>, tried: &mut Tried) -> Next {
        let kind = failure.kind;
        let bounce = kind == FailureKind::BackPressure && self.bounces_left > 0;
        if bounce {
            self.made -= 1;
        }
        let retry = self.retries
            && on.policy.should_retry(
                self.made,
                kind,
                on.body.replayable(),
                Instant::now() < on.deadline,
            );
        if bounce && retry {
            self.bounces_left -= 1;
            // Its answer still holds this request's slot there.
            let holding = failure.endpoint.outstanding().saturating_sub(1);
            tried.mark_busy(&failure.endpoint, holding);
            if on.queue.is_standing() {
                tried.wait_first();
            }
        }
        self.last_failure = Some(failure);
        if !retry {
            return Next::Stop;
        }
        if self.budgeted {
            // The budget keeps retries from multiplying the load on a failing fleet. A request a
            // busy endpoint turned away adds none by waiting in the queue for a slot to free, as
            // any new arrival would; it just may not go straight to another endpoint.
            if !on.budget.withdraw() {
                if !bounce {
                    on.stats.budget_exhausted.fetch_add(1, Ordering::Relaxed);
                    return Next::Stop;
                }
                tried.wait_first();
            }
            on.stats.count(kind);
        }
        if bounce {
            Next::Retry(Duration::ZERO)
        } else {
            Next::Retry(on.policy.backoff(self.made))
        }
    }
}

/// Waits out a back-off, never past `deadline`.
pub(super) async fn back_off(backoff: Duration, deadline: Instant) {
    if !backoff.is_zero() {
        tokio::time::sleep_until((Instant::now() + backoff).min(deadline)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::admission::QueueSettings;
    use crate::config::{EndpointUrl, RetryConfig};
    use crate::endpoint::Endpoint;
    use crate::http::ProxyError;
    use crate::metrics::ProxyStats;
    use crate::retry::ReplayBudget;

    /// What a failure's decision reads, built from a retry configuration.
    struct Fixture {
        policy: RetryPolicy,
        budget: RetryBudget,
        stats: Arc<ProxyStats>,
        queue: Queue,
        body: ReplayBody,
        endpoint: Arc<Endpoint>,
    }

    impl Fixture {
        fn new(config: RetryConfig) -> Fixture {
            let policy = RetryPolicy::new(&config);
            let stats = Arc::new(ProxyStats::default());
            let replay = ReplayBudget::new(1 << 20, Arc::clone(&stats));
            let url = "http://10.0.0.1:8000";
            Fixture {
                budget: policy.budget(1),
                policy,
                queue: Queue::new(QueueSettings::default()),
                body: ReplayBody::made(Bytes::from_static(b"{}"), &replay).unwrap(),
                endpoint: Arc::new(Endpoint::new(1, url, EndpointUrl::parse(url).unwrap(), 1)),
                stats,
            }
        }

        fn retrying(&self) -> Retrying<'_> {
            Retrying {
                policy: &self.policy,
                body: &self.body,
                deadline: Instant::now() + Duration::from_secs(60),
                queue: &self.queue,
                budget: &self.budget,
                stats: &self.stats.retries,
            }
        }

        fn failure(&self, kind: FailureKind) -> Failure {
            Failure {
                kind,
                error: ProxyError::Status {
                    endpoint: self.endpoint.url().to_owned(),
                    status: 503,
                },
                response: None,
                endpoint: Arc::clone(&self.endpoint),
            }
        }
    }

    /// Runs attempts that all fail with `kind` until the attempts stop; returns how many began.
    fn fail_until_stopped(fixture: &Fixture, attempts: &mut Attempts, kind: FailureKind) -> u32 {
        let mut tried = Tried::default();
        let mut began = 0;
        while attempts.next().is_some() {
            began += 1;
            attempts.under_way();
            let failure = fixture.failure(kind);
            if attempts.failed(failure, &fixture.retrying(), &mut tried) == Next::Stop {
                break;
            }
        }
        began
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_retried_up_to_max_attempts_and_the_last_is_kept() {
        let fixture = Fixture::new(RetryConfig::default());
        let mut attempts = Attempts::for_request(&fixture.policy, true);
        let began = fail_until_stopped(&fixture, &mut attempts, FailureKind::ConnectFailure);
        assert_eq!(began, 3, "retry.max_attempts");
        assert_eq!(fixture.stats.retries.total(), 2, "two retries counted");
        let last = attempts
            .into_last_failure()
            .expect("the last failure is the answer");
        assert_eq!(last.kind, FailureKind::ConnectFailure);
    }

    #[tokio::test(start_paused = true)]
    async fn without_retries_the_first_failure_is_the_answer() {
        let fixture = Fixture::new(RetryConfig::default());
        let mut attempts = Attempts::for_request(&fixture.policy, false);
        let began = fail_until_stopped(&fixture, &mut attempts, FailureKind::ConnectFailure);
        assert_eq!(began, 1);
        assert!(!attempts.none_failed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_nodes_refusals_do_not_use_up_attempts_and_need_no_back_off() {
        let fixture = Fixture::new(RetryConfig::default());
        let mut attempts = Attempts::for_request(&fixture.policy, true);
        let mut tried = Tried::default();
        for _ in 0..MAX_BOUNCES {
            assert_eq!(attempts.next(), Some(1), "a bounce gives its attempt back");
            attempts.under_way();
            let next = attempts.failed(
                fixture.failure(FailureKind::BackPressure),
                &fixture.retrying(),
                &mut tried,
            );
            assert_eq!(next, Next::Retry(Duration::ZERO));
        }
        // Past the bounces allowed, a refusal counts as an attempt like any failure.
        let began = fail_until_stopped(&fixture, &mut attempts, FailureKind::BackPressure);
        assert_eq!(began, 3);
        let last = attempts.into_last_failure().unwrap();
        assert_eq!(
            last.kind,
            FailureKind::BackPressure,
            "passed on to the client"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_spent_budget_ends_retries_but_a_bounce_waits_in_the_queue_instead() {
        let config = RetryConfig {
            budget_percent: 0,
            budget_min_per_second: 0,
            ..RetryConfig::default()
        };
        let fixture = Fixture::new(config);
        let mut attempts = Attempts::for_request(&fixture.policy, true);
        let mut tried = Tried::default();
        attempts.next();
        let next = attempts.failed(
            fixture.failure(FailureKind::BackPressure),
            &fixture.retrying(),
            &mut tried,
        );
        assert_eq!(next, Next::Retry(Duration::ZERO));
        assert!(tried.waits_first(), "the bounce waits for a slot to free");
        attempts.next();
        let next = attempts.failed(
            fixture.failure(FailureKind::Reset),
            &fixture.retrying(),
            &mut tried,
        );
        assert_eq!(next, Next::Stop);
        let exhausted = fixture
            .stats
            .retries
            .budget_exhausted
            .load(Ordering::Relaxed);
        assert_eq!(exhausted, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_continuation_retries_outside_the_budget_and_counts_every_refusal() {
        let config = RetryConfig {
            budget_percent: 0,
            budget_min_per_second: 0,
            ..RetryConfig::default()
        };
        let fixture = Fixture::new(config);
        let mut attempts = Attempts::for_continuation(&fixture.policy);
        let began = fail_until_stopped(&fixture, &mut attempts, FailureKind::BackPressure);
        assert_eq!(began, 3, "every refusal is one of retry.max_attempts");
        assert_eq!(
            fixture.stats.retries.total(),
            0,
            "not counted as a request's retries"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_releases_the_failed_answer_but_keeps_the_failure() {
        let fixture = Fixture::new(RetryConfig::default());
        let mut attempts = Attempts::for_request(&fixture.policy, true);
        attempts.next();
        let mut tried = Tried::default();
        let failure = fixture.failure(FailureKind::Reset);
        attempts.failed(failure, &fixture.retrying(), &mut tried);
        attempts.release_answer();
        assert!(!attempts.none_failed());
        attempts.under_way();
        assert!(
            attempts.none_failed(),
            "dropped once a new attempt is under way"
        );
    }
}

//! The request handler: pick an endpoint, rewrite the request, send it, stream the answer back, and
//! retry elsewhere when an endpoint fails before anything reached the client.
//!
//! The attempt loop (pingora's shape, not tower's: the pick must see what was already tried):
//! pick an eligible endpoint excluding those tried → send with a per-try deadline → classify → commit
//! or retry. A response is committed to the client only once the endpoint has sent its headers *and*
//! its first body bytes (or ended the body): a node preempted between the two costs a retry, not an
//! error. While an attempt waits, heartbeats declaring its endpoint gone fail it over at once.
//! After commit, a dying stream is ended as an error the client can see, never as a clean end.
//!
//! - [`request`]: what is read from the client's request, once;
//! - [`acquire`]: the pick among untried endpoints, and the queue while none has room;
//! - [`attempt`]: one attempt and what its outcome teaches the endpoint;
//! - [`respond`]: the commit, the last failure, refusals, upgrades.
//!
//! A request reads one [`ProxySettings`] snapshot at its start and only that one, so a reload never
//! mixes old and new settings in one request. The handler never panics on input and never waits
//! without a deadline.

mod acquire;
mod attempt;
mod continuation;
mod hedge;
mod receive;
mod request;
mod respond;
mod retrying;
mod stream;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::Response;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

pub use self::acquire::PickExplanation;
use self::acquire::{Stop, Tried};
use self::attempt::{Attempt, Committed, Failure, Sending};
use self::continuation::Committing;
use self::hedge::{HedgeBudget, Hedging, Race};
pub use self::receive::{Intake, Received};
use self::request::ClientRequest;
use self::retrying::{Attempts, Next, Retrying};
pub use self::stream::StreamSettings;
use crate::admission::{Queue, Refusal};
use crate::balance::{Pipeline, PrefixIndex, Saturation, Unsaturated};
use crate::breaker::BreakerSettings;
use crate::config::{BalancePolicy, Config, TokenIds};
use crate::http::ProxyBody;
use crate::metrics::{Metrics, Outcome, ProxyStats};
use crate::openai::Continuable;
use crate::registry::Registry;
use crate::retry::{FailureKind, ReplayBody, ReplayBudget, RetryBudget, RetryPolicy};
use crate::trace::AttemptKind;
use crate::upstream::UpstreamClient;

/// Everything the request path reads from the configuration, replaced whole by a reload.
#[derive(Clone, Debug)]
pub struct ProxySettings {
    pub response_headers_timeout: Duration,
    pub total_timeout: Duration,
    pub max_body_bytes: Option<u64>,
    /// Longest pause in a request body (`timeouts.body_read`).
    pub body_read_timeout: Duration,
    /// Memory all bodies kept for replay share (`retry.replay_budget_bytes`).
    pub replay_budget_bytes: u64,
    pub breaker: BreakerSettings,
    pub max_ejected_percent: u32,
    pub retry: RetryPolicy,
    /// How long an attempt may wait on an endpoint whose last heartbeat failed before it moves on.
    pub suspect_grace: Duration,
    /// `balancer.*`: how the pick ranks endpoints.
    pub balance: BalanceSettings,
    /// `hedge.*`: second attempts beside a slow first one.
    pub hedge: HedgeSettings,
    /// An attempt waiting this many times its endpoint's expected latency counts as stalled.
    pub stall_multiplier: f64,
    /// When a committed stream's silence is a stall, a pause, or nothing yet (`stream.*`).
    pub stream: StreamSettings,
    /// `continuation.*`: a broken OpenAI stream continued on another endpoint.
    pub continuation: ContinuationSettings,
    /// Header carrying a request's priority.
    pub priority_header: http::HeaderName,
    /// Header carrying a client's own deadline in milliseconds.
    pub deadline_header: http::HeaderName,
}

/// `balancer.*`: how the pick ranks endpoints.
#[derive(Clone, Debug)]
pub struct BalanceSettings {
    /// `balancer.policy`.
    pub policy: BalancePolicy,
    /// The pick's filters and scorers (`balancer.scorers`, saturation when `signals` are on).
    pub pipeline: Arc<Pipeline>,
    pub latency_decay: Duration,
    pub slow_start: Duration,
    /// How old the nodes' own metrics may be and still count (zero: `signals` are off).
    pub signals_max_age: Duration,
    /// `balancer.affinity`: what a request's affinity is read from.
    pub affinity: AffinitySettings,
}

/// `balancer.affinity`: what a request's affinity is read from.
#[derive(Clone, Debug)]
pub struct AffinitySettings {
    pub session_header: Option<http::HeaderName>,
    pub user_field: bool,
    pub block_bytes: usize,
    pub index_blocks: usize,
}

impl BalanceSettings {
    /// The pipeline `config` names: its scorers by weight, and the saturation filter when the nodes'
    /// own metrics are read.
    pub fn pipeline_of(config: &Config) -> Pipeline {
        let weights = config.balancer.scorer_weights();
        let named: Vec<(&str, f64)> = weights.iter().map(|(n, w)| (n.as_str(), *w)).collect();
        // Names were validated with the configuration; an unknown one cannot reach here, but if it
        // did the policy's scorer alone is the safe pick.
        let pipeline =
            Pipeline::of(&named).unwrap_or_else(|_| Pipeline::for_policy(config.balancer.policy));
        let pipeline = pipeline.with_filter(Box::new(crate::balance::Unlined));
        if config.signals.enabled {
            pipeline.with_filter(Box::new(Unsaturated(Saturation::from_config(
                &config.signals.saturation,
            ))))
        } else {
            pipeline
        }
    }
}

/// `hedge.*`: second attempts beside a slow first one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HedgeSettings {
    pub enabled: bool,
    pub after_multiplier: f64,
    pub min_delay: Duration,
    pub max_extra_percent: u32,
}

/// `continuation.*`: a broken OpenAI stream continued on another endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContinuationSettings {
    pub enabled: bool,
    /// At most this many times per request (`continuation.max_continuations`).
    pub max: u32,
    /// The idle floor of a stream that can be continued.
    pub idle_min: Duration,
    /// The nodes are asked for token ids, so that a continuation is exact
    /// (`continuation.token_ids`, resolved against the pool's engine).
    pub ask_token_ids: bool,
}

impl ProxySettings {
    pub fn from_config(config: &Config) -> Self {
        ProxySettings {
            response_headers_timeout: config.timeouts.response_headers.get(),
            total_timeout: config.timeouts.total.get(),
            max_body_bytes: config.limits.max_body_bytes,
            body_read_timeout: config.timeouts.body_read.get(),
            replay_budget_bytes: config.retry.replay_budget_bytes,
            breaker: BreakerSettings {
                consecutive_failures: config.breaker.consecutive_failures,
                base_ejection: config.breaker.base_ejection.get(),
                max_ejection: config.breaker.max_ejection.get(),
                consecutive_stalls: config.breaker.consecutive_stalls,
            },
            max_ejected_percent: config.breaker.max_ejected_percent,
            retry: RetryPolicy::new(&config.retry),
            suspect_grace: config.health.timeout.get(),
            balance: BalanceSettings {
                policy: config.balancer.policy,
                pipeline: Arc::new(BalanceSettings::pipeline_of(config)),
                latency_decay: config.balancer.latency_decay.get(),
                slow_start: config.balancer.slow_start.get(),
                signals_max_age: if config.signals.enabled {
                    config.signals.max_age.get()
                } else {
                    Duration::ZERO
                },
                affinity: AffinitySettings {
                    session_header: config
                        .balancer
                        .affinity
                        .session_header()
                        .map(|h| h.name().clone()),
                    user_field: config.balancer.affinity.user_field,
                    block_bytes: config.balancer.affinity.block_bytes,
                    index_blocks: config.balancer.affinity.index_blocks,
                },
            },
            hedge: HedgeSettings {
                enabled: config.hedge.enabled,
                after_multiplier: config.hedge.after_multiplier,
                min_delay: config.hedge.min_delay.get(),
                max_extra_percent: config.hedge.max_extra_percent,
            },
            stall_multiplier: config.breaker.stall_multiplier,
            stream: StreamSettings {
                idle_multiplier: config.stream.idle_multiplier,
                idle_min: config.stream.idle_min.get(),
                first_token_idle: config.stream.first_token_idle.get(),
                pause_max: config.stream.pause_max.get(),
            },
            continuation: ContinuationSettings {
                enabled: config.continuation.enabled,
                max: config.continuation.max_continuations,
                idle_min: config.continuation.idle_min.get(),
                ask_token_ids: match config.continuation.token_ids {
                    TokenIds::Auto => config.signals.engine == crate::engine::Engine::Vllm,
                    TokenIds::Always => true,
                    TokenIds::Never => false,
                },
            },
            priority_header: config.queue.priority_header.name().clone(),
            deadline_header: config.queue.deadline_header.name().clone(),
        }
    }
}

/// Shared state of the request path.
///
/// Shared by every worker thread; each worker passes its own pooled [`UpstreamClient`] so connections
/// stay on the thread that uses them.
pub struct Proxy {
    registry: Arc<Registry>,
    /// Where requests wait while no endpoint has a slot for them.
    queue: Arc<Queue>,
    /// Replaced whole by a configuration reload; a request takes the current one at its start.
    settings: ArcSwap<ProxySettings>,
    /// The fleet's latency: an EWMA over every endpoint's samples (microseconds, f64 bits), the
    /// estimate of endpoints that have none of their own yet.
    fleet_latency: AtomicU64,
    /// When any endpoint last answered (ms on the endpoints' clock): the fleet is making progress.
    last_answer: AtomicU64,
    stats: Arc<ProxyStats>,
    /// The memory request bodies kept for replay share (every pool's, one budget).
    replay_budget: Arc<ReplayBudget>,
    /// Upgraded (WebSocket) connections, tracked so graceful shutdown can wait for them.
    upgrades: TaskTracker,
    metrics: Arc<Metrics>,
    /// Which prompt blocks went to which endpoints (see `balance::affinity`).
    prefix_index: PrefixIndex,
}

/// What one worker thread owns on the request path: its pooled connections, its retry budget and its
/// hedge budget.
pub struct WorkerPath {
    // Shared by the worker's requests (and their hedges, which own what they send with): a clone is
    // one reference count, where a client's clone is several.
    upstream: Arc<UpstreamClient>,
    budget: RetryBudget,
    hedges: HedgeBudget,
}

/// What the client's answer is made of besides the committed attempt and the request itself.
struct Answered<'a> {
    worker: &'a Arc<WorkerPath>,
    settings: &'a Arc<ProxySettings>,
    continuable: Option<Continuable>,
    /// The node was asked for token ids (by the client or by tongs).
    ids_asked: bool,
    tried: Tried,
    body: &'a ReplayBody,
}

/// Counts a request in the metrics when dropped: with its answer's body, so a stream counts when it
/// ends.
struct Finish {
    metrics: Arc<Metrics>,
    outcome: Outcome,
    status: u16,
    started: Instant,
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.metrics
            .request_done(self.outcome, self.status, self.started.elapsed());
    }
}

impl Proxy {
    /// One pool's request path, sharing `intake`'s replay budget and upgrade tracker.
    pub fn new(
        registry: Arc<Registry>,
        queue: Arc<Queue>,
        metrics: Arc<Metrics>,
        settings: ProxySettings,
        intake: &Intake,
    ) -> Self {
        Proxy {
            prefix_index: PrefixIndex::new(settings.balance.affinity.index_blocks),
            registry,
            queue,
            fleet_latency: AtomicU64::new(0),
            last_answer: AtomicU64::new(0),
            replay_budget: Arc::clone(&intake.replay_budget),
            settings: ArcSwap::from_pointee(settings),
            stats: Arc::default(),
            upgrades: intake.upgrades.clone(),
            metrics,
        }
    }

    /// The settings in force (a reload may replace them for later requests).
    pub fn settings(&self) -> Arc<ProxySettings> {
        self.settings.load_full()
    }

    /// Applies reloaded settings: requests from now on use them; requests under way keep what they
    /// read.
    pub fn apply(&self, settings: ProxySettings) {
        self.prefix_index
            .resize(settings.balance.affinity.index_blocks);
        self.settings.store(Arc::new(settings));
    }

    /// Which prompt blocks went to which endpoints.
    pub fn prefix_index(&self) -> &PrefixIndex {
        &self.prefix_index
    }

    /// What this pool records requests into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    pub fn queue(&self) -> &Arc<Queue> {
        &self.queue
    }

    pub fn stats(&self) -> &ProxyStats {
        &self.stats
    }

    /// The fleet's latency estimate in microseconds (1 ms before anything was observed).
    pub fn fleet_latency_us(&self) -> u64 {
        let estimate = f64::from_bits(self.fleet_latency.load(Ordering::Relaxed));
        if estimate > 0.0 {
            estimate as u64
        } else {
            1000
        }
    }

    /// Sends `received` to this pool's endpoints. With `handing_on`, a request this pool can serve
    /// nobody for (no endpoint, or its queue refused it before any attempt) is handed back untouched,
    /// for a fallback pool; otherwise every outcome is an answer.
    pub async fn forward(
        self: &Arc<Self>,
        worker: &Arc<WorkerPath>,
        received: Received,
        handing_on: bool,
    ) -> Result<Response<ProxyBody>, Received> {
        let settings = self.settings();
        let started = received.started;
        match self.answer(&settings, worker, received, handing_on).await {
            Ok((response, outcome)) => {
                Ok(receive::finish(response, &self.metrics, outcome, started))
            }
            Err(received) => Err(received),
        }
    }

    /// The request's steps: read what it carries, then attempts (a slot from the pick or the queue, a
    /// race against a hedge, the decision after a failure) until one commits or none is left.
    async fn answer(
        self: &Arc<Self>,
        settings: &Arc<ProxySettings>,
        worker: &Arc<WorkerPath>,
        received: Received,
        handing_on: bool,
    ) -> Result<(Response<ProxyBody>, Outcome), Received> {
        if handing_on && !self.may_serve() {
            return Err(received);
        }
        let Received {
            mut request,
            body,
            started,
        } = received;
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let retries_wanted = request.retries_wanted && settings.retry.enabled();
        // A streamed OpenAI completion that can be continued elsewhere if its node breaks mid-stream.
        let continuable = match (request.template.openai_api(), body.bytes()) {
            (Some(api), Some(bytes)) if settings.continuation.enabled && retries_wanted => {
                Continuable::read(api, bytes).ok()
            }
            _ => None,
        };
        let (body, ids_asked, replaced) = self.ask_ids(settings, continuable.as_ref(), body);
        if replaced {
            request.template = request.template.for_new_body();
        }
        let mut tried = Tried::default();
        tried.keys = request::affinity_keys(
            settings,
            request.template.openai_api(),
            body.bytes(),
            request.template.headers(),
        );
        let sending = Sending {
            settings: Arc::clone(settings),
            upstream: worker.upstream.clone(),
            deadline: request.deadline,
            body,
        };
        let retrying = Retrying {
            policy: &settings.retry,
            body: &sending.body,
            deadline: request.deadline,
            queue: &self.queue,
            budget: &worker.budget,
            stats: &self.stats.retries,
        };
        let mut attempts = Attempts::for_request(&settings.retry, retries_wanted);
        while let Some(number) = attempts.next() {
            let acquired = self
                .acquire(
                    settings,
                    &mut tried,
                    &request.place,
                    request.deadline,
                    &mut attempts,
                )
                .await;
            let slot = match acquired {
                Ok(slot) => slot,
                Err(_) if handing_on && tried.len() == 0 && attempts.none_failed() => {
                    // Nothing was sent: the next pool gets the request as it came.
                    let body = sending.body;
                    return Err(Received {
                        request,
                        body,
                        started,
                    });
                }
                Err(Stop::Nowhere) => break,
                Err(Stop::Refused(reason)) => {
                    let last = attempts.into_last_failure();
                    return Ok(self.unanswered(settings, last, Some(reason), &request));
                }
            };
            let Some(attempt_body) = sending.body.for_attempt() else {
                break;
            };
            tried.push(slot.outstanding.endpoint().id());
            attempts.under_way();
            self.stats.attempts.fetch_add(1, Ordering::Relaxed);
            let mut slot = slot;
            let race = Race {
                request: request
                    .template
                    .build(&mut slot, attempt_body, AttemptKind::Next),
                slot,
                template: &request.template,
                hedging: if retries_wanted {
                    Hedging::WhenLate
                } else {
                    Hedging::Never
                },
            };
            let failure = match self.race(&sending, worker, &mut tried, race).await {
                Attempt::Committed(committed) => {
                    self.metrics.first_byte(started.elapsed());
                    let answered = Answered {
                        worker,
                        settings,
                        continuable,
                        ids_asked,
                        tried,
                        body: &sending.body,
                    };
                    return Ok((
                        self.answered(committed, &mut request, answered),
                        Outcome::Proxied,
                    ));
                }
                Attempt::Failed(failure) => failure,
            };
            failure.trace(&request.request_id, number);
            match attempts.failed(failure, &retrying, &mut tried) {
                Next::Retry(backoff) => retrying::back_off(backoff, request.deadline).await,
                Next::Stop => break,
            }
        }
        let last = attempts.into_last_failure();
        Ok(self.unanswered(settings, last, None, &request))
    }

    /// The client's answer from a committed attempt: the endpoint's response, and for a continuable
    /// stream the relay that continues it elsewhere if its node breaks.
    fn answered(
        self: &Arc<Self>,
        committed: Committed,
        request: &mut ClientRequest,
        answered: Answered<'_>,
    ) -> Response<ProxyBody> {
        let Answered {
            worker,
            settings,
            continuable,
            ids_asked,
            tried,
            body,
        } = answered;
        let streaming: Arc<str> = committed.outstanding.endpoint().url().into();
        let at = (
            &request.request_id,
            request.deadline,
            continuable.is_some(),
            body.kept_len(),
        );
        let response = self.commit(settings, committed, request.upgrade.take(), at);
        let Some(continuable) = continuable else {
            return response;
        };
        let at = Committing {
            worker,
            settings,
            template: &request.template,
            tried,
            request_id: &request.request_id,
            place: &request.place,
            deadline: request.deadline,
            body,
            ids_asked,
        };
        self.relay(response, continuable, &streaming, at)
    }

    /// The client's answer when no attempt committed: the last endpoint's failure, or the queue's
    /// refusal (`refused`), or no endpoint at all. After a refusal, a failure that was only a busy
    /// node's refusal gives way to the queue's own, which says more (why, and a `Retry-After` from how
    /// fast the fleet drains).
    fn unanswered(
        &self,
        settings: &ProxySettings,
        last: Option<Failure>,
        refused: Option<Refusal>,
        request: &ClientRequest,
    ) -> (Response<ProxyBody>, Outcome) {
        let (request_id, deadline) = (&request.request_id, request.deadline);
        match (last, refused) {
            (Some(failure), Some(_)) if failure.kind != FailureKind::BackPressure => (
                self.fail(settings, failure, request_id, deadline),
                Outcome::Failed,
            ),
            (Some(failure), None) => (
                self.fail(settings, failure, request_id, deadline),
                Outcome::Failed,
            ),
            (_, Some(reason)) => (self.refuse(reason, request_id), Outcome::Refused),
            (None, None) => (
                self.refuse(Refusal::NoEndpoints, request_id),
                Outcome::Refused,
            ),
        }
    }

    /// Whether this pool may serve a request now, or should hand it to a fallback: it has an endpoint
    /// up (healthy, not ejected) and a queue with room; or none discovered yet and a wait for the
    /// first (`queue.max_wait_no_endpoints`).
    pub fn may_serve(&self) -> bool {
        let queue = self.queue.settings();
        if self.registry.snapshot().is_empty() {
            return !queue.max_wait_no_endpoints.is_zero();
        }
        self.registry.counts().up() > 0 && self.queue.len() < queue.max_length.max(1)
    }
}

/// Whether one more endpoint of `registry` may be ejected without exceeding `max_ejected_percent`.
fn may_eject(registry: &Registry, max_ejected_percent: u32) -> bool {
    let ejected = registry.counts().ejected();
    let endpoints = registry.snapshot().len();
    (ejected + 1) * 100 <= endpoints * max_ejected_percent as usize
}

/// Whether an endpoint whose requests stalled may be ejected: as any other within
/// `max_ejected_percent`, and past it while another endpoint is up (a node that takes requests and
/// answers none costs each its whole wait; only the last one up stays).
fn may_eject_stalled(registry: &Registry, max_ejected_percent: u32) -> bool {
    may_eject(registry, max_ejected_percent) || registry.counts().up() > 1
}

fn millis_of(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

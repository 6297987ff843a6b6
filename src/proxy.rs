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
//! The handler never panics on input and never waits without a deadline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::admission::{Priority, Queue, Reason, Waited};
use crate::balance::{self, PickContext};
use crate::breaker::{Admission, BreakerSettings};
use crate::config::{BalancePolicy, Config, RetryConfig};
use crate::endpoint::{Eligibility, Endpoint, EndpointId, Outstanding};
use crate::http::ProxyBody;
use crate::http::headers::{self, X_REQUEST_ID, X_TONGS_RETRY};
use crate::http::{ProxyError, describe};
use crate::metrics::{Metrics, Outcome, ProxyStats};
use crate::registry::Registry;
use crate::retry::{
    BodyError, FailureKind, ReplayBody, RetryBudget, RetryPolicy, classify_status, retry_after,
};
use crate::upstream::{UpstreamBody, UpstreamClient};

/// Longest back-off an endpoint's `Retry-After` can impose on it.
const MAX_COOLDOWN: Duration = Duration::from_secs(30);

/// The settings the request path reads on every request.
#[derive(Clone, Debug)]
pub struct ProxySettings {
    pub response_headers_timeout: Duration,
    pub total_timeout: Duration,
    pub max_body_bytes: Option<u64>,
    pub breaker: BreakerSettings,
    pub max_ejected_percent: u32,
    pub slow_start: Duration,
    pub retry: RetryConfig,
    /// How long an attempt may wait on an endpoint whose last heartbeat failed before it moves on.
    pub suspect_grace: Duration,
    pub policy: BalancePolicy,
    pub latency_decay: Duration,
    /// Header carrying a request's priority.
    pub priority_header: http::HeaderName,
    /// Header carrying a client's own deadline in milliseconds.
    pub deadline_header: http::HeaderName,
}

impl ProxySettings {
    pub fn from_config(config: &Config) -> Self {
        ProxySettings {
            response_headers_timeout: config.timeouts.response_headers.get(),
            total_timeout: config.timeouts.total.get(),
            max_body_bytes: config.limits.max_body_bytes,
            breaker: BreakerSettings {
                consecutive_failures: config.breaker.consecutive_failures,
                base_ejection: config.breaker.base_ejection.get(),
                max_ejection: config.breaker.max_ejection.get(),
            },
            max_ejected_percent: config.breaker.max_ejected_percent,
            slow_start: config.balancer.slow_start.get(),
            retry: config.retry.clone(),
            suspect_grace: config.health.timeout.get(),
            policy: config.balancer.policy,
            latency_decay: config.balancer.latency_decay.get(),
            // Validated by Config::validate; the fallbacks only serve configs built in code.
            priority_header: http::HeaderName::from_bytes(config.queue.priority_header.as_bytes())
                .unwrap_or_else(|_| http::HeaderName::from_static("x-priority")),
            deadline_header: http::HeaderName::from_bytes(config.queue.deadline_header.as_bytes())
                .unwrap_or_else(|_| http::HeaderName::from_static("x-tongs-timeout-ms")),
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
    /// Replaced whole by a configuration reload; each read takes the current one.
    settings: ArcSwap<ProxySettings>,
    /// The fleet's latency: an EWMA over every endpoint's samples (microseconds, f64 bits), the
    /// estimate of endpoints that have none of their own yet.
    fleet_latency: AtomicU64,
    retry: ArcSwap<RetryPolicy>,
    stats: ProxyStats,
    /// Upgraded (WebSocket) connections, tracked so graceful shutdown can wait for them.
    upgrades: TaskTracker,
    metrics: Arc<Metrics>,
}

/// What one worker thread owns on the request path: its pooled connections and its retry budget.
pub struct WorkerPath {
    upstream: UpstreamClient,
    budget: RetryBudget,
}

/// Endpoint ids already tried by one request (no allocation; more than fit are not excluded).
#[derive(Clone, Copy, Default)]
struct Tried {
    ids: [EndpointId; 16],
    len: usize,
}

impl Tried {
    fn push(&mut self, id: EndpointId) {
        if self.len < self.ids.len() {
            self.ids[self.len] = id;
            self.len += 1;
        }
    }

    fn as_slice(&self) -> &[EndpointId] {
        &self.ids[..self.len]
    }
}

/// The client's request, rewritten once, from which each attempt's request is made.
struct Template {
    method: Method,
    path_and_query: PathAndQuery,
    headers: HeaderMap,
}

impl Template {
    fn build(&self, endpoint: &Endpoint, body: UpstreamBody) -> Request<UpstreamBody> {
        let mut request = Request::new(body);
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = upstream_uri(endpoint, &self.path_and_query);
        // The endpoint speaks whatever version its connection negotiated; hyper wants 1.1 here and
        // switches to HTTP/2 by itself when ALPN chose it.
        *request.version_mut() = Version::HTTP_11;
        let mut headers = self.headers.clone();
        headers.insert(header::HOST, endpoint.host_header().clone());
        *request.headers_mut() = headers;
        request
    }
}

/// A failed attempt: why, what the client would be told, and the endpoint's own answer if it gave one.
struct Failure {
    kind: FailureKind,
    error: ProxyError,
    response: Option<(Response<Incoming>, Outstanding)>,
    endpoint: Arc<Endpoint>,
}

/// Counts a request in the metrics when dropped: with its answer's body, so a stream counts when it
/// ends.
pub struct Finish {
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

/// A slot taken on an endpoint for one attempt, and whether the attempt is its breaker's probe.
struct Slot {
    outstanding: Outstanding,
    probe: bool,
}

/// What a pick found.
enum Picked {
    Slot(Slot),
    /// Nothing now; capacity may come free.
    Wait,
    /// Nothing left to try for this request.
    Nowhere,
}

/// Why a request stops looking for an endpoint.
enum Stop {
    Nowhere,
    Refused(Reason),
}

/// What one attempt came to.
enum Attempt {
    Committed {
        response: Response<Incoming>,
        first: Option<Frame<Bytes>>,
        outstanding: Outstanding,
    },
    Failed(Failure),
}

/// Releases a half-open probe when its attempt ends, so one cancelled without a verdict (its client
/// left) frees the slot. After a verdict the breaker is no longer probing and releasing changes nothing.
struct ProbeGuard<'a> {
    endpoint: &'a Endpoint,
    pending: bool,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if self.pending {
            self.endpoint.release_probe(Instant::now());
        }
    }
}

impl Proxy {
    pub fn new(
        registry: Arc<Registry>,
        queue: Arc<Queue>,
        metrics: Arc<Metrics>,
        settings: ProxySettings,
    ) -> Self {
        Proxy {
            registry,
            queue,
            fleet_latency: AtomicU64::new(0),
            retry: ArcSwap::from_pointee(RetryPolicy::new(&settings.retry)),
            settings: ArcSwap::from_pointee(settings),
            stats: ProxyStats::default(),
            upgrades: TaskTracker::new(),
            metrics,
        }
    }

    /// The settings in force (a reload may replace them for later requests).
    pub fn settings(&self) -> arc_swap::Guard<Arc<ProxySettings>> {
        self.settings.load()
    }

    /// Applies reloaded settings: requests from now on use them; requests under way keep what they
    /// read.
    pub fn apply(&self, settings: ProxySettings) {
        self.retry
            .store(Arc::new(RetryPolicy::new(&settings.retry)));
        self.settings.store(Arc::new(settings));
    }

    fn retry(&self) -> arc_swap::Guard<Arc<RetryPolicy>> {
        self.retry.load()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn stats(&self) -> &ProxyStats {
        &self.stats
    }

    pub fn upgrades(&self) -> &TaskTracker {
        &self.upgrades
    }

    /// The request path of one of `workers` worker threads, sending through `upstream`.
    pub fn worker_path(&self, upstream: UpstreamClient, workers: usize) -> WorkerPath {
        WorkerPath {
            upstream,
            budget: self.retry().budget(workers),
        }
    }

    /// Handles one client request; always produces a response.
    pub async fn handle(
        &self,
        worker: &WorkerPath,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let (mut response, outcome) = self.answer(worker, request, client, started).await;
        let status = response.status().as_u16();
        // A streamed answer is counted when it ends; anything else now.
        if let Err(finish) = response.body_mut().on_end(Box::new(Finish {
            metrics: Arc::clone(&self.metrics),
            outcome,
            status,
            started,
        })) {
            drop(finish);
        }
        response
    }

    async fn answer(
        &self,
        worker: &WorkerPath,
        mut request: Request<Incoming>,
        client: SocketAddr,
        started: Instant,
    ) -> (Response<ProxyBody>, Outcome) {
        let upstream = &worker.upstream;
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        worker.budget.deposit();
        let request_id = headers::request_id(request.headers());
        let deadline = match self.client_deadline(request.headers()) {
            Ok(Some(wanted)) => started + wanted.min(self.settings().total_timeout),
            Ok(None) => started + self.settings().total_timeout,
            Err(error) => return (self.reject(error, &request_id), Outcome::Invalid),
        };
        let priority =
            Priority::from_header(request.headers().get(&self.settings().priority_header));

        // Only an HTTP/1.1 client can switch protocols; its half of the upgrade must be claimed before the
        // request is taken apart.
        let upgrade =
            request.version() == Version::HTTP_11 && headers::is_upgrade_request(request.headers());
        let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut request));
        let retries_wanted = self.retry().enabled() && !opted_out(request.headers());

        let (parts, body) = request.into_parts();
        let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        let mut template_headers = parts.headers;
        headers::strip_hop_by_hop(&mut template_headers, upgrade);
        headers::add_forwarded(&mut template_headers, client.ip(), original_host);
        template_headers.insert(&X_REQUEST_ID, request_id.clone());
        template_headers.remove(&X_TONGS_RETRY);
        let template = Template {
            method: parts.method,
            path_and_query: parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
            headers: template_headers,
        };

        let replay_limit = if retries_wanted {
            self.retry().replay_limit()
        } else {
            0
        };
        let prepared = tokio::time::timeout_at(
            deadline,
            ReplayBody::prepare(body, replay_limit, self.settings().max_body_bytes),
        )
        .await;
        let body = match prepared {
            Ok(Ok(body)) => body,
            Ok(Err(BodyError::TooLarge)) => {
                let limit = self.settings().max_body_bytes.unwrap_or_default();
                let error = ProxyError::BodyTooLarge { limit };
                return (self.reject(error, &request_id), Outcome::Invalid);
            }
            Ok(Err(BodyError::Broken(err))) => {
                let error = ProxyError::ClientBody {
                    detail: describe(err.as_ref()),
                };
                return (self.reject(error, &request_id), Outcome::Invalid);
            }
            Err(_elapsed) => {
                let error = ProxyError::ClientTooSlow;
                return (self.reject(error, &request_id), Outcome::Invalid);
            }
        };

        let mut tried = Tried::default();
        let mut last_failure: Option<Failure> = None;
        // Time spent in the queue so far: `queue.max_wait` bounds it over all attempts together.
        let mut queued = Duration::ZERO;
        for attempt in 1..=self.retry().max_attempts().max(1) {
            let slot = match self
                .acquire(&tried, priority, deadline, &mut queued, &mut last_failure)
                .await
            {
                Ok(slot) => slot,
                Err(Stop::Nowhere) => break,
                Err(Stop::Refused(reason)) => match last_failure {
                    // A retry that found no room: the endpoint's failure is the better answer.
                    Some(failure) => {
                        return (self.fail(failure, &request_id, deadline), Outcome::Failed);
                    }
                    None => return (self.refuse(reason, &request_id), Outcome::Refused),
                },
            };
            let Some(attempt_body) = body.for_attempt() else {
                break;
            };
            let endpoint = Arc::clone(slot.outstanding.endpoint());
            tried.push(endpoint.id());
            // The failure being retried is dropped (its connection released) only once a new attempt is
            // really under way; until then it is the answer.
            drop(last_failure.take());
            self.stats.attempts.fetch_add(1, Ordering::Relaxed);
            let request = template.build(&endpoint, attempt_body);
            let failure = match self.attempt(upstream, request, slot, deadline, &body).await {
                Attempt::Committed {
                    response,
                    first,
                    outstanding,
                } => {
                    self.metrics.first_byte(started.elapsed());
                    let response = self.commit(
                        response,
                        first,
                        outstanding,
                        client_upgrade,
                        &request_id,
                        deadline,
                    );
                    return (response, Outcome::Proxied);
                }
                Attempt::Failed(failure) => failure,
            };
            tracing::debug!(
                request_id = request_id.to_str().unwrap_or_default(),
                endpoint = endpoint.url(),
                attempt,
                reason = failure.kind.as_str(),
                error = %failure.error,
                "attempt failed"
            );
            let retry = retries_wanted
                && attempt < self.retry().max_attempts()
                && self.retry().retries_on(failure.kind)
                && body.replayable()
                && Instant::now() < deadline;
            last_failure = Some(failure);
            if !retry {
                break;
            }
            if !worker.budget.withdraw() {
                self.stats
                    .retries
                    .budget_exhausted
                    .fetch_add(1, Ordering::Relaxed);
                break;
            }
            if let Some(failure) = &last_failure {
                self.stats.retries.count(failure.kind);
            }
            let backoff = self.retry().backoff(attempt);
            if !backoff.is_zero() {
                tokio::time::sleep_until((Instant::now() + backoff).min(deadline)).await;
            }
        }
        match last_failure {
            Some(failure) => (self.fail(failure, &request_id, deadline), Outcome::Failed),
            None => (
                self.refuse(Reason::NoEndpoints, &request_id),
                Outcome::Refused,
            ),
        }
    }

    /// The client's own deadline from the deadline header, if it sent one.
    fn client_deadline(&self, headers: &HeaderMap) -> Result<Option<Duration>, ProxyError> {
        let Some(value) = headers.get(&self.settings().deadline_header) else {
            return Ok(None);
        };
        match value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            Some(ms) if ms > 0 => Ok(Some(Duration::from_millis(ms))),
            _ => Err(ProxyError::BadDeadline {
                header: self.settings().deadline_header.to_string(),
                value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
            }),
        }
    }

    /// A slot on an endpoint not yet tried, waiting in the queue while none has one.
    ///
    /// A first attempt waits whenever nothing can take it (every endpoint full, cooling down, down, or
    /// none discovered yet). A retry waits only if some untried endpoint is up and merely full or cooling
    /// down; otherwise there is nowhere left to go. While others wait, a new request joins behind them
    /// rather than taking a slot that came free for the first in line.
    async fn acquire(
        &self,
        tried: &Tried,
        priority: Priority,
        deadline: Instant,
        queued: &mut Duration,
        last_failure: &mut Option<Failure>,
    ) -> Result<Slot, Stop> {
        let queue = &self.queue;
        if queue.is_empty() {
            match self.pick(tried) {
                Picked::Slot(slot) => return Ok(slot),
                Picked::Nowhere => return Err(Stop::Nowhere),
                Picked::Wait => {}
            }
        }
        // A failed attempt's answer holds its endpoint's slot; waiting must not keep it from others.
        if let Some(failure) = last_failure.as_mut() {
            failure.response = None;
        }
        // A request the queue will not reach in time is told so now, not when its wait runs out.
        let joined = Instant::now();
        let allowed = queue.settings().max_wait.saturating_sub(*queued);
        let until = deadline.min(joined + allowed);
        if let Some(wait) = queue.expected_wait(priority)
            && Instant::now() + wait > until
        {
            return Err(Stop::Refused(self.refusal(Reason::QueueFull)));
        }
        let mut ticket = match queue.join(priority) {
            Ok(ticket) => ticket,
            Err(reason) => return Err(Stop::Refused(self.refusal(reason))),
        };
        let mut look = ticket.is_head();
        let result = loop {
            if look {
                match self.pick(tried) {
                    Picked::Slot(slot) => {
                        self.metrics.queue_wait(ticket.since().elapsed());
                        ticket.admitted();
                        break Ok(slot);
                    }
                    Picked::Nowhere => break Err(Stop::Nowhere),
                    Picked::Wait => {
                        let woken = ticket.woken_by_release();
                        ticket.requeue();
                        // A retry may have been woken by a slot on an endpoint it already tried: that
                        // slot is someone else's, so the wake goes down the line.
                        if woken && tried.len > 0 {
                            ticket.pass_on();
                        }
                    }
                }
            }
            match ticket.wait(until).await {
                Waited::Go => look = true,
                Waited::TimedOut => break Err(Stop::Refused(self.refusal(Reason::QueueTimeout))),
                Waited::Shed => break Err(Stop::Refused(Reason::ShedLowPriority)),
            }
        };
        *queued += joined.elapsed();
        result
    }

    /// A queue refusal, named `no-endpoints` when the real cause is that no endpoint is up at all.
    fn refusal(&self, reason: Reason) -> Reason {
        let none_up = !self
            .registry
            .snapshot()
            .iter()
            .any(|e| e.is_available() && e.is_healthy() && !e.is_ejected());
        match reason {
            Reason::QueueFull | Reason::QueueTimeout if none_up => Reason::NoEndpoints,
            other => other,
        }
    }

    /// A slot on an eligible endpoint not yet tried, or whether waiting may give one.
    fn pick(&self, tried: &Tried) -> Picked {
        let now = Instant::now();
        let snapshot = self.registry.snapshot();
        let mut ctx = PickContext {
            now,
            slow_start_ms: millis_of(self.settings().slow_start),
            ignore_health: false,
            ignore_cooldown: false,
            neutral_latency_us: match self.settings().policy {
                BalancePolicy::ExpectedLatency => Some(self.fleet_latency_us()),
                BalancePolicy::LeastOutstanding => None,
            },
            latency_decay_ms: millis_of(self.settings().latency_decay),
        };
        let mut exclude = *tried;
        for _ in 0..6 {
            let Some((endpoint, eligibility)) = balance::pick(&snapshot, exclude.as_slice(), &ctx)
            else {
                // Panic mode: when no endpoint passes its heartbeats, more likely tongs' own network or
                // the health path is broken than every node died at once, so heartbeats are ignored
                // (breakers still apply). Requests still fail fast if the nodes really are gone.
                if !ctx.ignore_health
                    && !snapshot.iter().any(|e| e.is_available() && e.is_healthy())
                {
                    ctx.ignore_health = true;
                    continue;
                }
                break;
            };
            let probe = match eligibility {
                Eligibility::Yes => false,
                _ => match endpoint.admit(now) {
                    Admission::Admit => false,
                    Admission::Probe => true,
                    Admission::Reject => {
                        exclude.push(endpoint.id());
                        continue;
                    }
                },
            };
            // The pick saw room; another worker may have taken the last slot since.
            match endpoint.try_start_request() {
                Some(outstanding) => return Picked::Slot(Slot { outstanding, probe }),
                None => {
                    if probe {
                        endpoint.release_probe(now);
                    }
                    exclude.push(endpoint.id());
                }
            }
        }
        // Nothing now. A first attempt waits for anything; a retry only for an endpoint that is up and
        // merely full or cooling down.
        if tried.len == 0 {
            return Picked::Wait;
        }
        let now_ms = crate::endpoint::millis(now);
        let worth_waiting = snapshot.iter().any(|e| {
            !tried.as_slice().contains(&e.id())
                && e.is_available()
                && e.is_healthy()
                && !e.is_ejected()
                && (e.limit().is_some_and(|l| e.outstanding() >= l) || e.cooling_down(now_ms))
        });
        if worth_waiting {
            Picked::Wait
        } else {
            Picked::Nowhere
        }
    }

    /// Sends one attempt and waits for the endpoint's headers and first body bytes.
    async fn attempt(
        &self,
        upstream: &UpstreamClient,
        request: Request<UpstreamBody>,
        slot: Slot,
        deadline: Instant,
        body: &ReplayBody,
    ) -> Attempt {
        let Slot { outstanding, probe } = slot;
        let endpoint = &Arc::clone(outstanding.endpoint());
        // Cancelled mid-attempt (the client left), a half-open probe would hold the probe slot forever.
        let _probe_guard = ProbeGuard {
            endpoint,
            pending: probe,
        };
        let attempt_started = Instant::now();
        let mut gone = endpoint.gone_signal();
        let grace = self.settings().suspect_grace;
        let per_try = (Instant::now() + self.settings().response_headers_timeout).min(deadline);
        let failed = |kind: FailureKind, error: ProxyError| Failure {
            kind,
            error,
            response: None,
            endpoint: Arc::clone(endpoint),
        };
        let timed_out = || ProxyError::ResponseTimeout {
            endpoint: endpoint.url().to_owned(),
            after: per_try.saturating_duration_since(Instant::now()),
        };

        // Headers, within the per-try deadline, unless heartbeats declare the endpoint gone first.
        let sent = tokio::select! {
            sent = tokio::time::timeout_at(per_try, upstream.request(request)) => Some(sent),
            () = wait_gone(&mut gone, endpoint, attempt_started, grace) => None,
        };
        let mut response = match sent {
            Some(Ok(Ok(response))) => response,
            Some(Ok(Err(err))) => {
                let (kind, error) = self.classify(endpoint, &err, body);
                return Attempt::Failed(self.record(failed(kind, error)));
            }
            Some(Err(_elapsed)) => {
                return Attempt::Failed(self.record(failed(FailureKind::Timeout, timed_out())));
            }
            None => {
                return Attempt::Failed(self.record(self.gone(endpoint)));
            }
        };

        if let Some(kind) = classify_status(response.status(), response.headers()) {
            if kind == FailureKind::BackPressure {
                // A node that refuses while still serving others of ours is saying "fewer at once":
                // with an adaptive limit the cut answers it; without one the node fills up again and
                // refuses again, each refusal cheap and retried elsewhere. Pausing it for Retry-After
                // would idle a node that is busy: under standing overload every node would sit paused
                // for most of each second while requests waited. A node refusing with nothing else of
                // ours in flight is paused as it asked.
                let busy = endpoint.outstanding() > 1;
                if busy {
                    endpoint.pushed_back_while_busy();
                    endpoint.limit_back_pressure(Instant::now());
                } else {
                    endpoint.cool_down(
                        retry_after(response.headers(), MAX_COOLDOWN),
                        Instant::now(),
                    );
                }
            }
            let error = ProxyError::Status {
                endpoint: endpoint.url().to_owned(),
                status: response.status().as_u16(),
            };
            let mut failure = failed(kind, error);
            failure.response = Some((response, outstanding));
            return Attempt::Failed(self.record(failure));
        }

        // Commit on first byte: wait for the first body frame (or the end of the body) before the client
        // sees anything, so an endpoint dying in between costs a retry instead of a broken response.
        let first = if response.status() == StatusCode::SWITCHING_PROTOCOLS
            || response.body().is_end_stream()
        {
            None
        } else {
            let frame = tokio::select! {
                frame = tokio::time::timeout_at(per_try, response.body_mut().frame()) => Some(frame),
                () = wait_gone(&mut gone, endpoint, attempt_started, grace) => None,
            };
            match frame {
                Some(Ok(Some(Ok(frame)))) => Some(frame),
                Some(Ok(None)) => None,
                Some(Ok(Some(Err(err)))) => {
                    let error = ProxyError::Upstream {
                        endpoint: endpoint.url().to_owned(),
                        detail: format!(
                            "response body broke before its first byte: {}",
                            describe(&err)
                        ),
                    };
                    return Attempt::Failed(self.record(failed(FailureKind::Reset, error)));
                }
                Some(Err(_elapsed)) => {
                    return Attempt::Failed(self.record(failed(FailureKind::Timeout, timed_out())));
                }
                None => {
                    return Attempt::Failed(self.record(self.gone(endpoint)));
                }
            }
        };
        let now = Instant::now();
        endpoint.record_success(now);
        let first_byte = now.saturating_duration_since(attempt_started);
        self.observe_latency(endpoint, first_byte, now);
        endpoint.observe_limit_sample(first_byte, outstanding.in_flight_at_start(), now);
        Attempt::Committed {
            response,
            first,
            outstanding,
        }
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

    /// Feeds a committed attempt's time to first byte to its endpoint's estimate and the fleet's.
    ///
    /// Time to first byte — headers plus the first body bytes, which is when tongs commits — and not
    /// time to the end of the body: a streamed answer is long because it streams, not because its node is
    /// slow, and every endpoint serves the same mix of streamed and whole answers, so the first byte
    /// compares them fairly. For a whole (non-streamed) answer it is the full service time anyway.
    fn observe_latency(&self, endpoint: &Endpoint, sample: Duration, now: Instant) {
        endpoint.observe_latency(
            sample,
            crate::endpoint::millis(now),
            millis_of(self.settings().latency_decay),
        );
        // The fleet's estimate only stands in for endpoints without one of their own, so one sample in
        // eight is plenty, and spares every worker writing one shared cache line on every request.
        let fleet = f64::from_bits(self.fleet_latency.load(Ordering::Relaxed));
        if fleet > 0.0 && fastrand::u8(..8) != 0 {
            return;
        }
        let sample_us = (sample.as_secs_f64() * 1e6).max(1.0);
        let next = if fleet <= 0.0 {
            sample_us
        } else {
            fleet + (sample_us - fleet) * 0.1
        };
        self.fleet_latency.store(next.to_bits(), Ordering::Relaxed);
    }

    /// The failure of an attempt whose endpoint heartbeats declared gone while it waited.
    fn gone(&self, endpoint: &Arc<Endpoint>) -> Failure {
        Failure {
            kind: FailureKind::Unhealthy,
            error: ProxyError::Upstream {
                endpoint: endpoint.url().to_owned(),
                detail: "endpoint stopped answering heartbeats while the request waited".into(),
            },
            response: None,
            endpoint: Arc::clone(endpoint),
        }
    }

    /// Feeds a failed attempt to its endpoint's breaker (back-pressure is not the endpoint's fault).
    fn record(&self, failure: Failure) -> Failure {
        let endpoint = &failure.endpoint;
        if failure.kind.is_endpoint_fault() {
            endpoint.record_failure(&self.settings().breaker, Instant::now(), self.may_eject());
        } else {
            // A probe turned away by back-pressure tells nothing about health: let another request probe.
            endpoint.release_probe(Instant::now());
        }
        failure
    }

    /// Whether one more endpoint may be ejected without exceeding `breaker.max_ejected_percent`.
    fn may_eject(&self) -> bool {
        let snapshot = self.registry.snapshot();
        let ejected = snapshot.iter().filter(|e| e.is_ejected()).count();
        (ejected + 1) * 100 <= snapshot.len() * self.settings().max_ejected_percent as usize
    }

    fn classify(
        &self,
        endpoint: &Endpoint,
        err: &hyper_util::client::legacy::Error,
        body: &ReplayBody,
    ) -> (FailureKind, ProxyError) {
        if body.exceeded_limit() {
            let limit = self.settings().max_body_bytes.unwrap_or_default();
            return (FailureKind::Reset, ProxyError::BodyTooLarge { limit });
        }
        let detail = describe(err);
        if err.is_connect() {
            (
                FailureKind::ConnectFailure,
                ProxyError::Connect {
                    endpoint: endpoint.url().to_owned(),
                    detail,
                },
            )
        } else {
            (
                FailureKind::Reset,
                ProxyError::Upstream {
                    endpoint: endpoint.url().to_owned(),
                    detail,
                },
            )
        }
    }

    /// Hands a committed response to the client: its first frame, then the rest as it streams.
    fn commit(
        &self,
        mut response: Response<Incoming>,
        first: Option<Frame<Bytes>>,
        outstanding: Outstanding,
        client_upgrade: Option<hyper::upgrade::OnUpgrade>,
        request_id: &HeaderValue,
        deadline: Instant,
    ) -> Response<ProxyBody> {
        if response.status() == StatusCode::SWITCHING_PROTOCOLS
            && let Some(client_upgrade) = client_upgrade
        {
            let upstream_upgrade = hyper::upgrade::on(&mut response);
            self.bridge_upgrade(client_upgrade, upstream_upgrade, outstanding, request_id);
            let (mut parts, _) = response.into_parts();
            headers::strip_hop_by_hop(&mut parts.headers, true);
            parts.headers.insert(&X_REQUEST_ID, request_id.clone());
            return Response::from_parts(parts, ProxyBody::empty());
        }
        let (mut parts, body) = response.into_parts();
        headers::strip_hop_by_hop(&mut parts.headers, false);
        parts.headers.insert(&X_REQUEST_ID, request_id.clone());
        let deadline_timer = tokio::time::sleep_until(deadline);
        let body = ProxyBody::upstream(
            first,
            body,
            Box::new(outstanding),
            deadline_timer,
            self.settings().total_timeout,
        );
        Response::from_parts(parts, body)
    }

    /// Answers with the last failure: the endpoint's own response when it gave one, else tongs' error.
    fn fail(
        &self,
        failure: Failure,
        request_id: &HeaderValue,
        deadline: Instant,
    ) -> Response<ProxyBody> {
        self.stats.failed.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            request_id = request_id.to_str().unwrap_or_default(),
            endpoint = failure.endpoint.url(),
            reason = failure.kind.as_str(),
            error = %failure.error,
            "request failed"
        );
        match failure.response {
            Some((response, outstanding)) => {
                self.commit(response, None, outstanding, None, request_id, deadline)
            }
            None => failure.error.into_response(request_id),
        }
    }

    /// Refuses a request tongs could not place: 503 with the reason and a `Retry-After` from how fast
    /// the queue drains.
    fn refuse(&self, reason: Reason, request_id: &HeaderValue) -> Response<ProxyBody> {
        let queue = &self.queue;
        queue.count_rejection(reason);
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        let settings = queue.settings();
        let detail = match reason {
            Reason::QueueFull => format!(
                "every endpoint is busy and the queue is full ({} waiting), or would not reach this \
                 request within the wait allowed at the rate it drains",
                queue.len()
            ),
            Reason::QueueTimeout => format!(
                "no endpoint freed up within the wait allowed (queue.max_wait {}, or the request's deadline)",
                humantime::format_duration(settings.max_wait)
            ),
            Reason::NoEndpoints => "no endpoint is available".to_owned(),
            Reason::ShedLowPriority => {
                "low-priority request shed while the queue is congested".to_owned()
            }
        };
        let error = ProxyError::Refused {
            reason,
            detail,
            retry_after: queue.retry_after(),
        };
        self.reject(error, request_id)
    }

    /// Answers a request tongs could not send anywhere.
    fn reject(&self, error: ProxyError, request_id: &HeaderValue) -> Response<ProxyBody> {
        tracing::warn!(
            request_id = request_id.to_str().unwrap_or_default(),
            status = error.status().as_u16(),
            error = %error,
            "request refused"
        );
        error.into_response(request_id)
    }

    /// Copies bytes both ways between the client and the endpoint once both sides switched protocols.
    fn bridge_upgrade(
        &self,
        client: hyper::upgrade::OnUpgrade,
        upstream: hyper::upgrade::OnUpgrade,
        outstanding: Outstanding,
        request_id: &HeaderValue,
    ) {
        let request_id = request_id.to_str().unwrap_or_default().to_owned();
        self.upgrades.spawn(async move {
            let (client, upstream) = match tokio::try_join!(client, upstream) {
                Ok(both) => both,
                Err(err) => {
                    tracing::warn!(request_id, error = %err, "protocol upgrade failed");
                    return;
                }
            };
            let mut client = TokioIo::new(client);
            let mut upstream = TokioIo::new(upstream);
            match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                Ok((sent, received)) => {
                    tracing::debug!(request_id, sent, received, "upgraded connection closed");
                }
                Err(err) => tracing::debug!(request_id, error = %err, "upgraded connection ended"),
            }
            drop(outstanding);
        });
    }
}

/// Resolves when heartbeats say an attempt should move elsewhere: its endpoint was declared unhealthy,
/// or went suspect (a heartbeat failed) while the attempt had already waited longer than `grace` (a
/// heartbeat timeout) — silent to heartbeats and to this request alike.
async fn wait_gone(
    gone: &mut tokio::sync::watch::Receiver<u64>,
    endpoint: &Endpoint,
    started: Instant,
    grace: Duration,
) {
    let mut signalled = false;
    loop {
        if signalled {
            if !endpoint.is_healthy() {
                return;
            }
            if endpoint.is_suspect() {
                let waited = started.elapsed();
                if waited >= grace {
                    return;
                }
                tokio::select! {
                    () = tokio::time::sleep(grace - waited) => continue,
                    changed = gone.changed() => if changed.is_err() { return std::future::pending().await },
                }
                continue;
            }
        }
        if gone.changed().await.is_err() {
            // The endpoint is gone from memory; nothing will signal any more.
            return std::future::pending().await;
        }
        signalled = true;
    }
}

fn millis_of(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Whether the request asked not to be retried (`x-tongs-retry: off`, `false` or `0`).
fn opted_out(headers: &HeaderMap) -> bool {
    headers
        .get(&X_TONGS_RETRY)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "off" | "false" | "0" | "no"
            )
        })
}

/// The endpoint's scheme and authority, its path prefix, then the client's path and query.
fn upstream_uri(endpoint: &Endpoint, path_and_query: &PathAndQuery) -> Uri {
    let path_and_query = path_and_query.clone();
    let path_and_query = if endpoint.path_prefix().is_empty() {
        path_and_query
    } else {
        let joined = format!("{}{}", endpoint.path_prefix(), path_and_query.as_str());
        joined.parse().unwrap_or(path_and_query)
    };
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(endpoint.scheme().clone());
    parts.authority = Some(endpoint.authority().clone());
    parts.path_and_query = Some(path_and_query);
    // Scheme, authority and path were each valid on their own, so the whole is valid.
    Uri::from_parts(parts).unwrap_or_else(|_| Uri::from_static("/"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EndpointUrl;

    fn endpoint(url: &str) -> Endpoint {
        Endpoint::new(1, url, EndpointUrl::parse(url).unwrap(), 1)
    }

    #[test]
    fn upstream_uri_joins_prefix_path_and_query() {
        let uri = PathAndQuery::from_static("/v1/chat?stream=true");
        assert_eq!(
            upstream_uri(&endpoint("http://10.0.0.7:8000"), &uri),
            "http://10.0.0.7:8000/v1/chat?stream=true"
        );
        assert_eq!(
            upstream_uri(&endpoint("https://abc.salad.cloud/api/"), &uri),
            "https://abc.salad.cloud/api/v1/chat?stream=true"
        );
        let root = PathAndQuery::from_static("/x");
        assert_eq!(
            upstream_uri(&endpoint("http://[::1]:9"), &root),
            "http://[::1]:9/x"
        );
    }
}

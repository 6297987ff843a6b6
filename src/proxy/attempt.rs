//! One attempt on one endpoint: send, wait for the headers and the first body bytes (or for
//! heartbeats to declare the endpoint gone), classify, and feed the outcome to the endpoint's breaker,
//! latency estimate and limit.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::{Proxy, ProxySettings, millis_of};
use crate::endpoint::{Endpoint, Outstanding};
use crate::http::headers::is_upgrade_request;
use crate::http::{ProxyError, describe};
use crate::retry::{BodyError, FailureKind, ReplayBody, classify_status, retry_after};
use crate::trace::AttemptSpan;
use crate::upstream::{ResponseBody, SendError, UpstreamBody, UpstreamClient, connect_cause};

/// Longest back-off an endpoint's `Retry-After` can impose on it.
const MAX_COOLDOWN: Duration = Duration::from_secs(30);

/// What every attempt of a request is sent with, owned (cheap to clone: `Arc`s and `Bytes`).
#[derive(Clone)]
pub(super) struct Sending {
    /// The request's settings snapshot.
    pub settings: Arc<ProxySettings>,
    /// The worker's pooled client.
    pub upstream: Arc<UpstreamClient>,
    /// The request's overall deadline.
    pub deadline: Instant,
    /// The request body (a handle on it: attempts take their own copy to send).
    pub body: ReplayBody,
}

/// A slot taken on an endpoint for one attempt, and whether the attempt is its breaker's probe.
pub(super) struct Slot {
    pub outstanding: Outstanding,
    pub probe: bool,
    /// The attempt's span, when tracing is on (see [`super::request::Template::build`]).
    pub span: Option<AttemptSpan>,
}

/// A failed attempt: why, what the client would be told, and the endpoint's own answer if it gave one.
pub(super) struct Failure {
    pub kind: FailureKind,
    pub error: ProxyError,
    pub response: Option<(Response<ResponseBody>, Outstanding)>,
    pub endpoint: Arc<Endpoint>,
}

impl Failure {
    /// Says in the debug log that attempt `number` of `request_id` failed, and why.
    pub fn trace(&self, request_id: &HeaderValue, number: u32) {
        tracing::debug!(
            request_id = request_id.to_str().unwrap_or_default(),
            endpoint = self.endpoint.url(),
            attempt = number,
            reason = self.kind.as_str(),
            error = %self.error,
            "attempt failed"
        );
    }
}

/// An endpoint's answer, ready for the client: its headers, the first body frame read before commit
/// (none when the body ended or the protocol switched), and the slot it holds until its body ends.
pub(super) struct Committed {
    pub response: Response<ResponseBody>,
    pub first: Option<Frame<Bytes>>,
    pub outstanding: Outstanding,
    /// How long the answer took to start (headers and first bytes).
    pub first_byte: Option<Duration>,
    /// The attempt's span, ended with the answer's body.
    pub span: Option<AttemptSpan>,
    /// The breaker's half-open probe, when this attempt is it and its answer still streams: judged
    /// by the stream, not by its headers (see [`Probe`]).
    pub probe: Option<Probe>,
}

/// What one attempt came to.
pub(super) enum Attempt {
    Committed(Committed),
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
            self.endpoint.breaker().release_probe(Instant::now());
        }
    }
}

/// A stalled endpoint's half-open probe, whose verdict waits for its answer's body. A gray node's
/// headers and first chunk come back while what follows hangs, so a probe that closed the breaker on its
/// headers would let the next requests onto a node that still stalls them. The probe succeeds when its body ends
/// whole or has streamed past its idle limit without stalling (a stall would have shown by then),
/// fails when it breaks, and, dropped without a verdict (its client left, its deadline passed), frees
/// the probe slot for another request.
pub struct Probe {
    endpoint: Option<Arc<Endpoint>>,
}

impl Probe {
    pub(super) fn new(endpoint: Arc<Endpoint>) -> Probe {
        Probe {
            endpoint: Some(endpoint),
        }
    }

    /// The probe's answer came through: the breaker closes.
    pub fn succeeded(mut self, now: Instant) {
        if let Some(endpoint) = self.endpoint.take() {
            endpoint.breaker().record_success(now);
        }
    }

    /// The probe's answer broke after its headers: the breaker opens again.
    pub fn failed(mut self, settings: &crate::breaker::BreakerSettings, now: Instant) {
        if let Some(endpoint) = self.endpoint.take() {
            // A half-open breaker reopens whatever the rest of the fleet looks like.
            endpoint.breaker().record_failure(settings, now, true);
        }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        if let Some(endpoint) = self.endpoint.take() {
            endpoint.breaker().release_probe(Instant::now());
        }
    }
}

impl Proxy {
    /// Sends one attempt and waits for the endpoint's headers and first body bytes.
    ///
    /// The future owns all it needs, so an attempt beaten by a hedge can go on by itself (see `hedge`).
    /// Its span (tracing on) learns the outcome; dropped before one, it is `cancelled`.
    pub(super) async fn attempt(
        self: Arc<Self>,
        sending: Sending,
        request: Request<UpstreamBody>,
        mut slot: Slot,
    ) -> Attempt {
        let span = slot.span.take();
        let mut outcome = self.send(sending, request, slot).await;
        if let Some(mut span) = span {
            match &mut outcome {
                Attempt::Committed(committed) => {
                    span.committed(committed.response.status().as_u16());
                    committed.span = Some(span);
                }
                Attempt::Failed(failure) => span.failed(
                    // `retry.on`'s name of the cause, and an endpoint's status as its code.
                    match failure.kind {
                        FailureKind::Status(code) => code.to_string(),
                        kind => kind.as_str().to_owned(),
                    },
                    failure.response.as_ref().map(|(r, _)| r.status().as_u16()),
                    failure.error.to_string(),
                ),
            }
        }
        outcome
    }

    async fn send(
        self: Arc<Self>,
        sending: Sending,
        request: Request<UpstreamBody>,
        slot: Slot,
    ) -> Attempt {
        let Sending {
            settings,
            upstream,
            deadline,
            body,
        } = sending;
        let settings = &*settings;
        let body = &body;
        let Slot {
            mut outstanding,
            probe,
            ..
        } = slot;
        let endpoint = &Arc::clone(outstanding.endpoint());
        // Cancelled mid-attempt (the client left), a half-open probe would hold the probe slot forever.
        let mut probe_guard = ProbeGuard {
            endpoint,
            pending: probe,
        };
        let attempt_started = Instant::now();
        // Until this attempt answers or fails, it counts towards the endpoint's silence (see `balance`).
        let _waiting = endpoint.latency().start_waiting(attempt_started);
        let mut gone = endpoint.gone_signal();
        let grace = settings.suspect_grace;
        let per_try = (attempt_started + settings.response_headers_timeout).min(deadline);
        let failed = |kind: FailureKind, error: ProxyError| Failure {
            kind,
            error,
            response: None,
            endpoint: Arc::clone(endpoint),
        };
        // A timeout reports the time the attempt was given, not what is left of it (nothing).
        let timed_out = || ProxyError::ResponseTimeout {
            endpoint: endpoint.url().to_owned(),
            after: per_try.saturating_duration_since(attempt_started),
        };
        // Only a request that asked to switch protocols (its `Upgrade` kept for this hop) may get a 101.
        let asked_upgrade = is_upgrade_request(request.headers());

        // Headers, within the per-try deadline, unless heartbeats declare the endpoint gone first.
        let sent = tokio::select! {
            sent = tokio::time::timeout_at(per_try, upstream.request(request)) => Some(sent),
            () = wait_gone(&mut gone, endpoint, attempt_started, grace) => None,
        };
        let mut response = match sent {
            Some(Ok(Ok(response))) => response,
            Some(Ok(Err(err))) => {
                // The client's streamed body broke the attempt (too large, or paused too long): the
                // client's fault, not the endpoint's, so its breaker is not told.
                if let Some(error) = body.client_fault() {
                    let error = match error {
                        BodyError::TooLarge => ProxyError::BodyTooLarge {
                            limit: settings.max_body_bytes.unwrap_or_default(),
                        },
                        _ => ProxyError::ClientTooSlow,
                    };
                    return Attempt::Failed(failed(FailureKind::Reset, error));
                }
                let (kind, error) = self.classify(endpoint, &err);
                return Attempt::Failed(self.record(settings, failed(kind, error)));
            }
            Some(Err(_elapsed)) => {
                return Attempt::Failed(
                    self.record(settings, failed(FailureKind::Timeout, timed_out())),
                );
            }
            None => {
                return Attempt::Failed(self.record(settings, self.gone(endpoint)));
            }
        };

        if response.status() == StatusCode::SWITCHING_PROTOCOLS && !asked_upgrade {
            // The endpoint switched protocols nobody asked for: what follows on that connection is
            // not HTTP, and relaying the 101 would hand the client a connection in an unknown state.
            // tongs takes it for the 502 it answers instead: a failure of the endpoint, retried where
            // `retry.on` lists 502. Dropping the response closes the connection.
            let error = ProxyError::Upstream {
                endpoint: endpoint.url().to_owned(),
                detail: "answered 101 Switching Protocols to a request that asked for no upgrade"
                    .into(),
                summary: "the endpoint answered 101 Switching Protocols to a request that asked \
                          for no upgrade",
            };
            return Attempt::Failed(self.record(settings, failed(FailureKind::Status(502), error)));
        }

        if let Some(kind) = classify_status(response.status(), response.headers()) {
            if kind == FailureKind::BackPressure {
                // A node that refuses while still serving others of ours is saying "fewer at once":
                // its limit drops to what it held (see `LoadControl::limit_back_pressure`). Pausing it
                // for Retry-After would idle a node that is busy: under standing overload every node
                // would sit paused for most of each second while requests waited. A node refusing
                // with nothing else of ours in flight is paused as it asked.
                let busy = endpoint.outstanding() > 1;
                if busy {
                    endpoint.load().pushed_back_while_busy();
                    endpoint.load().limit_back_pressure(Instant::now());
                } else {
                    endpoint.load().cool_down(
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
            return Attempt::Failed(self.record(settings, failure));
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
                        summary: "the endpoint's response broke before its first byte",
                    };
                    return Attempt::Failed(
                        self.record(settings, failed(FailureKind::Reset, error)),
                    );
                }
                Some(Err(_elapsed)) => {
                    return Attempt::Failed(
                        self.record(settings, failed(FailureKind::Timeout, timed_out())),
                    );
                }
                None => {
                    return Attempt::Failed(self.record(settings, self.gone(endpoint)));
                }
            }
        };
        let now = Instant::now();
        // The probe of a stalled endpoint, whose answer still streams, is judged by its body; any other
        // answer by its start. An endpoint ejected for failures failed before its answers started, and
        // holding it out for a whole stream longer would only cost the fleet its capacity.
        let streams_on = first.is_some() && !response.body().is_end_stream();
        let probe = (probe && streams_on && endpoint.circuit().is_stalled()).then(|| {
            probe_guard.pending = false;
            Probe::new(Arc::clone(endpoint))
        });
        if probe.is_none() {
            endpoint.breaker().record_success(now);
        }
        self.last_answer
            .fetch_max(crate::endpoint::millis(now), Ordering::Relaxed);
        let first_byte = now.saturating_duration_since(attempt_started);
        endpoint.latency().observe_at_load(
            first_byte,
            outstanding.in_flight_at_start(),
            crate::endpoint::millis(now),
            millis_of(settings.balance.latency_decay),
        );
        let opened = streams_on
            && endpoint.latency().observe_stream_start(
                first_byte,
                outstanding.in_flight_at_start(),
                crate::endpoint::millis(now),
            );
        self.observe_latency(settings, endpoint, first_byte, now);
        endpoint
            .load()
            .observe_limit_sample(first_byte, outstanding.in_flight_at_start(), now);
        outstanding.first_byte_at(now);
        if opened {
            // A load probed (`balance::line`): requests held for its answer go now, not at the
            // queue's next recheck. The first byte of a stream comes in milliseconds, and a node
            // many streams reach at once opens level by level at that pace.
            endpoint.wake_waiters();
        }
        Attempt::Committed(Committed {
            response,
            first,
            outstanding,
            first_byte: Some(first_byte),
            span: None,
            probe,
        })
    }

    /// Feeds a committed attempt's time to first byte to its endpoint's estimate and the fleet's.
    ///
    /// Time to first byte — headers plus the first body bytes, which is when tongs commits — and not
    /// time to the end of the body: a streamed answer is long because it streams, not because its node is
    /// slow, and every endpoint serves the same mix of streamed and whole answers, so the first byte
    /// compares them fairly. For a whole (non-streamed) answer it is the full service time anyway.
    fn observe_latency(
        &self,
        settings: &ProxySettings,
        endpoint: &Endpoint,
        sample: Duration,
        now: Instant,
    ) {
        endpoint.latency().observe(
            sample,
            crate::endpoint::millis(now),
            millis_of(settings.balance.latency_decay),
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

    /// The failure of an attempt whose endpoint was declared gone (by heartbeats) or stalled while it
    /// waited.
    pub(super) fn gone(&self, endpoint: &Arc<Endpoint>) -> Failure {
        let stalled = endpoint.circuit().is_stalled();
        Failure {
            kind: FailureKind::Unhealthy,
            error: ProxyError::Upstream {
                endpoint: endpoint.url().to_owned(),
                detail: if stalled {
                    "endpoint stalled (its requests hang while its heartbeats pass) while the request \
                     waited"
                        .into()
                } else {
                    "endpoint stopped answering heartbeats while the request waited".into()
                },
                summary: if stalled {
                    "the endpoint stalled while the request waited"
                } else {
                    "the endpoint stopped answering heartbeats while the request waited"
                },
            },
            response: None,
            endpoint: Arc::clone(endpoint),
        }
    }

    /// Feeds a failed attempt to its endpoint's breaker (back-pressure is not the endpoint's fault).
    fn record(&self, settings: &ProxySettings, failure: Failure) -> Failure {
        let endpoint = &failure.endpoint;
        if failure.kind.is_endpoint_fault() {
            endpoint.breaker().record_failure(
                &settings.breaker,
                Instant::now(),
                self.may_eject(settings),
            );
        } else {
            // A probe turned away by back-pressure tells nothing about health: let another request probe.
            endpoint.breaker().release_probe(Instant::now());
        }
        failure
    }

    /// Whether one more endpoint may be ejected without exceeding `breaker.max_ejected_percent`.
    pub(super) fn may_eject(&self, settings: &ProxySettings) -> bool {
        super::may_eject(&self.registry, settings.max_ejected_percent)
    }

    fn classify(&self, endpoint: &Endpoint, err: &SendError) -> (FailureKind, ProxyError) {
        let detail = describe(err);
        if err.is_connect() {
            (
                FailureKind::ConnectFailure,
                ProxyError::Connect {
                    endpoint: endpoint.url().to_owned(),
                    detail,
                    cause: connect_cause(err),
                },
            )
        } else {
            (
                FailureKind::Reset,
                ProxyError::Upstream {
                    endpoint: endpoint.url().to_owned(),
                    detail,
                    summary: "the connection to the endpoint broke before its response",
                },
            )
        }
    }
}

/// Resolves when an attempt should move elsewhere: its endpoint was declared unhealthy or stalled,
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
            if !endpoint.liveness().is_healthy() || endpoint.circuit().is_stalled() {
                return;
            }
            if endpoint.liveness().is_suspect() {
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

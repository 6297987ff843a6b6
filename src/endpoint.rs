//! An endpoint (one remote inference node) and its live state.
//!
//! Identity and address never change once built; when discovery reports a different URL or weight the
//! registry builds a new `Endpoint`. Live state is atomics the request path reads without locks, plus
//! the circuit breaker: one state machine behind one small lock, mirrored into a single atomic "gate"
//! so a pick can skip ejected endpoints without locking. Heartbeats (health.rs) set `healthy` and fire
//! the `gone` signal that in-flight attempts listen to.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use http::HeaderValue;
use http::uri::{Authority, Scheme};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::breaker::{Admission, Breaker, BreakerSettings, State, Transition};
use crate::config::{EndpointUrl, LimitMode};
use crate::limit::{LimitSettings, Limiter};

/// `gate` value of a closed breaker.
const GATE_CLOSED: u64 = 0;
/// `gate` value of a half-open breaker whose one probe is in flight.
const GATE_PROBING: u64 = u64::MAX;

/// Stable identity of an endpoint for the life of the process (used in exclusion sets).
pub type EndpointId = u64;

/// What an endpoint calls when one of its slots comes free or its limit rises: the owner of the queue
/// that waits for slots wakes its next request. A callback, so endpoints know nothing of queues.
#[derive(Clone)]
pub struct SlotFreed(Arc<dyn Fn() + Send + Sync>);

impl SlotFreed {
    pub fn new(call: impl Fn() + Send + Sync + 'static) -> SlotFreed {
        SlotFreed(Arc::new(call))
    }

    /// Nobody waits for slots (an endpoint built on its own, in tests or benchmarks).
    pub fn nobody() -> SlotFreed {
        SlotFreed::new(|| {})
    }

    pub fn call(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for SlotFreed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SlotFreed")
    }
}

/// One endpoint: where it is, and how loaded it is right now.
///
/// `repr(C, align(64))` with the fields a pick reads first: they share one cache line, so looking at a
/// random endpoint among 10,000 costs one cache miss, not several.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Endpoint {
    id: EndpointId,
    /// Requests picked for this endpoint whose response body has not ended yet.
    outstanding: AtomicU64,
    /// Most requests allowed outstanding at once (`u64::MAX`: no limit).
    limit: AtomicU64,
    /// The breaker's state for the pick: [`GATE_CLOSED`], [`GATE_PROBING`], or the millisecond at which
    /// an ejection ends.
    gate: AtomicU64,
    /// Back-pressure: no new requests before this millisecond (429 / 503 with Retry-After).
    cooldown_until: AtomicU64,
    /// Slow start began at this millisecond (0: not ramping).
    ramp_start: AtomicU64,
    weight: u32,
    /// A draining endpoint takes no new requests; in-flight ones finish.
    draining: AtomicBool,
    /// Heartbeats' verdict (true until heartbeats say otherwise).
    healthy: AtomicBool,
    /// The last heartbeat of a healthy endpoint failed: no new requests until the verdict.
    suspect: AtomicBool,
    /// Peak-EWMA latency estimate, microseconds as f64 bits (0.0: nothing observed yet) ...
    latency: AtomicU64,
    /// ... and the millisecond of its last observation.
    latency_at: AtomicU64,
    // Everything below is read off the pick's path.
    /// The URL as configured or discovered, for logs and debug output.
    url: String,
    scheme: Scheme,
    authority: Authority,
    path_prefix: String,
    /// `Host` sent upstream: the endpoint's own authority (a gateway routes by it).
    host_header: HeaderValue,
    /// Requests ever sent here (for tests, debug and, later, metrics).
    requests: AtomicU64,
    /// Requests here that failed at the endpoint (connect error, broken connection, timeout).
    failures: AtomicU64,
    breaker: Mutex<Breaker>,
    /// The closed breaker's failure streak, mirrored so a success needs no lock when it is zero.
    streak: AtomicU32,
    /// Bumped when heartbeats declare the endpoint gone; waiting attempts fail over at once.
    gone: watch::Sender<u64>,
    ejections: AtomicU64,
    /// Times heartbeats marked the endpoint unhealthy.
    unhealthy_marks: AtomicU64,
    /// Times the endpoint asked for back-off.
    cooldowns: AtomicU64,
    /// The adaptive limit's state (only with `concurrency.limit: adaptive`).
    limiter: Mutex<Option<Limiter>>,
    /// Called when a slot here comes free (wakes whoever waits for one).
    slot_freed: OnceLock<SlotFreed>,
    /// The last heartbeat: when it ended (ms, 0: none yet), how long it took (µs), and whether it passed.
    heartbeat_at: AtomicU64,
    heartbeat_rtt_us: AtomicU64,
    heartbeat_ok: AtomicBool,
    /// Where the endpoint came from (`static` or `kubernetes`, and the pod).
    origin: Origin,
    /// A cap on the concurrency limit, whatever the mode says (a pod's own annotation).
    limit_cap: u64,
}

/// Where an endpoint came from, and what its source says about it beyond the address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Origin {
    /// `static` or `kubernetes`.
    pub source: &'static str,
    /// `namespace/name` of the pod.
    pub pod: Option<Arc<str>>,
    /// The pod's own cap on concurrent requests (its max-outstanding annotation).
    pub max_outstanding: Option<u64>,
}

impl Default for Origin {
    fn default() -> Self {
        Origin {
            source: "static",
            pod: None,
            max_outstanding: None,
        }
    }
}

/// What an endpoint is doing, for /debug/endpoints, metrics and the status page.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EndpointView {
    pub url: String,
    pub source: &'static str,
    /// `namespace/name` of the pod behind the endpoint (discovered endpoints only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    pub weight: u32,
    /// The one word an operator needs first.
    pub state: EndpointState,
    pub healthy: bool,
    pub suspect: bool,
    pub draining: bool,
    pub cooling_down: bool,
    pub slow_start: bool,
    /// `closed`, `open` or `half-open`.
    pub breaker: &'static str,
    pub outstanding: u64,
    /// Concurrency limit (null: none).
    pub limit: Option<u64>,
    pub requests: u64,
    pub failures: u64,
    pub ejections: u64,
    pub cooldowns: u64,
    /// Expected-latency estimate (time to first byte), ms; null before the first answer.
    pub latency_ms: Option<f64>,
    /// The adaptive limiter's unloaded latency, ms.
    pub unloaded_latency_ms: Option<f64>,
    /// Seconds since the last heartbeat ended (null: none yet), its duration and verdict.
    pub last_heartbeat_age_s: Option<f64>,
    pub last_heartbeat_ms: Option<f64>,
    pub last_heartbeat_ok: Option<bool>,
}

/// What an endpoint is doing, in the one word an operator needs first. When several hold, the first
/// that applies in this order names it: draining, unhealthy, ejected, probing, cooldown, suspect,
/// slow-start, healthy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EndpointState {
    Healthy,
    SlowStart,
    Suspect,
    Cooldown,
    Probing,
    Ejected,
    Unhealthy,
    Draining,
}

impl EndpointState {
    /// Every state, in the order metrics list them.
    pub const ALL: [EndpointState; 8] = [
        EndpointState::Healthy,
        EndpointState::SlowStart,
        EndpointState::Suspect,
        EndpointState::Cooldown,
        EndpointState::Probing,
        EndpointState::Ejected,
        EndpointState::Unhealthy,
        EndpointState::Draining,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EndpointState::Healthy => "healthy",
            EndpointState::SlowStart => "slow-start",
            EndpointState::Suspect => "suspect",
            EndpointState::Cooldown => "cooldown",
            EndpointState::Probing => "probing",
            EndpointState::Ejected => "ejected",
            EndpointState::Unhealthy => "unhealthy",
            EndpointState::Draining => "draining",
        }
    }
}

/// Milliseconds from a process-wide epoch to `now`: the form instants take in the endpoints' atomics.
/// One epoch for all endpoints lets a pick convert the time once, not once per endpoint it looks at.
pub fn millis(now: Instant) -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(now.saturating_duration_since(epoch).as_millis()).unwrap_or(u64::MAX)
}

/// Whether, and how, a pick may use an endpoint right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eligibility {
    No,
    Yes,
    /// Only as the breaker's half-open probe, which must be claimed.
    Probe,
}

impl Endpoint {
    /// Builds an endpoint from a parsed URL.
    pub fn new(id: EndpointId, url: &str, parsed: EndpointUrl, weight: u32) -> Endpoint {
        // An Authority is always a valid header value (it was parsed from visible ASCII).
        let host_header = HeaderValue::from_str(parsed.authority.as_str())
            .unwrap_or_else(|_| HeaderValue::from_static("invalid"));
        Endpoint {
            id,
            url: url.to_owned(),
            scheme: parsed.scheme,
            authority: parsed.authority,
            path_prefix: parsed.path_prefix,
            host_header,
            weight: weight.max(1),
            outstanding: AtomicU64::new(0),
            limit: AtomicU64::new(u64::MAX),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            suspect: AtomicBool::new(false),
            latency: AtomicU64::new(0),
            latency_at: AtomicU64::new(0),
            gate: AtomicU64::new(GATE_CLOSED),
            breaker: Mutex::new(Breaker::default()),
            streak: AtomicU32::new(0),
            cooldown_until: AtomicU64::new(0),
            ramp_start: AtomicU64::new(0),
            gone: watch::channel(0).0,
            ejections: AtomicU64::new(0),
            unhealthy_marks: AtomicU64::new(0),
            cooldowns: AtomicU64::new(0),
            limiter: Mutex::new(None),
            slot_freed: OnceLock::new(),
            heartbeat_at: AtomicU64::new(0),
            heartbeat_rtt_us: AtomicU64::new(0),
            heartbeat_ok: AtomicBool::new(false),
            origin: Origin::default(),
            limit_cap: u64::MAX,
        }
    }

    /// Sets where the endpoint came from and its own concurrency cap (before it serves).
    pub fn with_origin(mut self, origin: &Origin) -> Endpoint {
        self.origin = origin.clone();
        self.limit_cap = origin.max_outstanding.unwrap_or(u64::MAX).max(1);
        self
    }

    /// `namespace/name` of the pod behind the endpoint, if it came from one.
    pub fn pod(&self) -> Option<&str> {
        self.origin.pod.as_deref()
    }

    /// Where the endpoint came from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Ramps the endpoint's share in from 10 % over the slow-start window, from `now`.
    pub fn start_slow_start(&self, now: Instant) {
        self.ramp_start
            .store(self.millis(now).max(1), Ordering::Relaxed);
    }

    /// Records a heartbeat's outcome and duration.
    pub fn record_heartbeat(&self, passed: bool, took: Duration, now: Instant) {
        self.heartbeat_rtt_us.store(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.heartbeat_ok.store(passed, Ordering::Relaxed);
        self.heartbeat_at
            .store(self.millis(now).max(1), Ordering::Relaxed);
    }

    /// The last heartbeat: its end (ms on the [`millis`] clock), duration and verdict.
    pub fn last_heartbeat(&self) -> Option<(u64, Duration, bool)> {
        match self.heartbeat_at.load(Ordering::Relaxed) {
            0 => None,
            at => Some((
                at,
                Duration::from_micros(self.heartbeat_rtt_us.load(Ordering::Relaxed)),
                self.heartbeat_ok.load(Ordering::Relaxed),
            )),
        }
    }

    pub fn source(&self) -> &'static str {
        self.origin.source
    }

    /// A consistent-enough picture of the endpoint at `now` (each field read once, without locks but the
    /// breaker's and the limiter's).
    pub fn view(&self, now: Instant, slow_start: Duration) -> EndpointView {
        let now_ms = self.millis(now);
        let breaker_state = self.breaker_state();
        let breaker = match breaker_state {
            State::Closed { .. } => "closed",
            State::Open { .. } => "open",
            State::HalfOpen { .. } => "half-open",
        };
        let healthy = self.is_healthy();
        let suspect = self.is_suspect();
        let draining = !self.is_available();
        let cooling_down = self.cooling_down(now_ms);
        let window = u64::try_from(slow_start.as_millis()).unwrap_or(u64::MAX);
        let slow =
            window > 0 && self.effective_weight(now_ms, window) < u64::from(self.weight) * 1000;
        let state = if draining {
            EndpointState::Draining
        } else if !healthy {
            EndpointState::Unhealthy
        } else if let State::Open { .. } = breaker_state {
            EndpointState::Ejected
        } else if let State::HalfOpen { .. } = breaker_state {
            EndpointState::Probing
        } else if cooling_down {
            EndpointState::Cooldown
        } else if suspect {
            EndpointState::Suspect
        } else if slow {
            EndpointState::SlowStart
        } else {
            EndpointState::Healthy
        };
        let ms = |us: u64| (us > 0).then(|| us as f64 / 1000.0);
        let heartbeat = self.last_heartbeat();
        EndpointView {
            url: self.url.clone(),
            source: self.origin.source,
            pod: self.origin.pod.as_deref().map(str::to_owned),
            weight: self.weight,
            state,
            healthy,
            suspect,
            draining,
            cooling_down,
            slow_start: slow,
            breaker,
            outstanding: self.outstanding(),
            limit: self.limit(),
            requests: self.requests(),
            failures: self.failures(),
            ejections: self.ejections(),
            cooldowns: self.cooldowns(),
            latency_ms: ms(self.latency_us()),
            unloaded_latency_ms: self.unloaded_latency_us().and_then(ms),
            last_heartbeat_age_s: heartbeat
                .map(|(at, _, _)| now_ms.saturating_sub(at) as f64 / 1000.0),
            last_heartbeat_ms: heartbeat.map(|(_, took, _)| took.as_secs_f64() * 1000.0),
            last_heartbeat_ok: heartbeat.map(|(_, _, ok)| ok),
        }
    }

    /// Milliseconds from the process's epoch to `now` (see [`millis`]).
    pub fn millis(&self, now: Instant) -> u64 {
        millis(now)
    }

    /// Whether a new request may go here at `now_ms` (see [`millis`]).
    pub fn eligibility(
        &self,
        now_ms: u64,
        ignore_health: bool,
        ignore_cooldown: bool,
    ) -> Eligibility {
        let unwell = !self.healthy.load(Ordering::Relaxed) || self.suspect.load(Ordering::Relaxed);
        if self.outstanding.load(Ordering::Relaxed) >= self.limit.load(Ordering::Relaxed)
            || self.draining.load(Ordering::Relaxed)
            || (!ignore_health && unwell)
            || (!ignore_cooldown && self.cooldown_until.load(Ordering::Relaxed) > now_ms)
        {
            return Eligibility::No;
        }
        match self.gate.load(Ordering::Relaxed) {
            GATE_CLOSED => Eligibility::Yes,
            GATE_PROBING => Eligibility::No,
            until if until > now_ms => Eligibility::No,
            _ => Eligibility::Probe,
        }
    }

    /// Weight after slow start: in thousandths, ramping from 10 % to 100 % over `window`.
    pub fn effective_weight(&self, now_ms: u64, window_ms: u64) -> u64 {
        let full = u64::from(self.weight) * 1000;
        if window_ms == 0 {
            return full;
        }
        let start = self.ramp_start.load(Ordering::Relaxed);
        if start == 0 {
            return full;
        }
        let elapsed = now_ms.saturating_sub(start);
        if elapsed >= window_ms {
            return full;
        }
        let permille = 100 + 900 * elapsed / window_ms;
        u64::from(self.weight) * permille
    }

    /// Records how long the endpoint took to start answering (see `proxy.rs` for what is measured).
    ///
    /// Peak EWMA (Finagle, linkerd): a sample above the estimate replaces it at once, so a node that slows
    /// down loses its share on its first slow answer; lower samples pull the estimate down with a weight
    /// that grows with the time since the last one (time constant `decay_ms`). Two threads observing at
    /// once may lose one sample; the next corrects it.
    pub fn observe_latency(&self, sample: Duration, now_ms: u64, decay_ms: u64) {
        let sample = (sample.as_secs_f64() * 1e6).max(1.0);
        let estimate = f64::from_bits(self.latency.load(Ordering::Relaxed));
        let elapsed = now_ms.saturating_sub(self.latency_at.load(Ordering::Relaxed)) as f64;
        let next = if estimate <= 0.0 || sample >= estimate {
            sample
        } else {
            let x = elapsed / decay_ms.max(1) as f64;
            // 1 − e^(−x), with its first-order form for the frequent tiny steps of a busy endpoint.
            let weight = if x < 0.01 { x } else { 1.0 - (-x).exp() };
            estimate + (sample - estimate) * weight
        };
        self.latency.store(next.to_bits(), Ordering::Relaxed);
        self.latency_at.store(now_ms, Ordering::Relaxed);
    }

    /// The latency estimate to rank this endpoint by, in microseconds: the fleet's (`neutral_us`) until
    /// the endpoint has answered, and drifting back to it linearly over `decay_ms` while the endpoint
    /// gets no traffic, so a node that was slow once is tried again.
    pub fn latency_estimate(&self, now_ms: u64, neutral_us: u64, decay_ms: u64) -> u64 {
        let estimate = f64::from_bits(self.latency.load(Ordering::Relaxed));
        if estimate <= 0.0 {
            return neutral_us.max(1);
        }
        let idle = now_ms.saturating_sub(self.latency_at.load(Ordering::Relaxed));
        if idle >= decay_ms {
            return neutral_us.max(1);
        }
        let drift = idle as f64 / decay_ms.max(1) as f64;
        (estimate + (neutral_us as f64 - estimate) * drift).max(1.0) as u64
    }

    /// The raw estimate in microseconds (0 before the first observation), for debug output.
    pub fn latency_us(&self) -> u64 {
        f64::from_bits(self.latency.load(Ordering::Relaxed)) as u64
    }

    /// Asks the breaker for a request now (claims the half-open probe when that is what is left).
    pub fn admit(&self, now: Instant) -> Admission {
        let mut breaker = self.lock_breaker();
        let (admission, transition) = breaker.admit(now);
        self.publish(&breaker, now, transition);
        admission
    }

    /// The endpoint answered a request well.
    pub fn record_success(&self, now: Instant) {
        // The common case, a closed breaker with no failure streak, takes no lock.
        if self.gate.load(Ordering::Relaxed) == GATE_CLOSED
            && self.streak.load(Ordering::Relaxed) == 0
        {
            return;
        }
        let mut breaker = self.lock_breaker();
        let transition = breaker.on_success(now);
        self.publish(&breaker, now, transition);
    }

    /// A request failed at this endpoint. `may_eject`: the fleet can afford one more ejection.
    pub fn record_failure(&self, settings: &BreakerSettings, now: Instant, may_eject: bool) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let mut breaker = self.lock_breaker();
        let transition = breaker.on_failure(settings, now, may_eject, fastrand::f64());
        self.publish(&breaker, now, transition);
    }

    /// A half-open probe ended without a verdict (its client left): let another request probe.
    pub fn release_probe(&self, now: Instant) {
        let mut breaker = self.lock_breaker();
        breaker.release_probe();
        self.publish(&breaker, now, None);
    }

    /// A heartbeat passed: it counts as the breaker's probe once the ejection time is over.
    pub fn heartbeat_passed(&self, now: Instant) {
        if self.gate.load(Ordering::Relaxed) == GATE_CLOSED {
            return;
        }
        let mut breaker = self.lock_breaker();
        let transition = breaker.on_heartbeat_success(now);
        self.publish(&breaker, now, transition);
    }

    /// Heartbeats' verdict on health. Marking an endpoint unhealthy fails its waiting attempts over.
    pub fn set_healthy(&self, healthy: bool, now: Instant) -> bool {
        let was = self.healthy.swap(healthy, Ordering::Relaxed);
        if was == healthy {
            return false;
        }
        if healthy {
            self.start_slow_start(now);
            tracing::info!(endpoint = self.url(), "endpoint healthy");
            let mut breaker = self.lock_breaker();
            let transition = breaker.on_recovery(now);
            self.publish(&breaker, now, transition);
        } else {
            self.unhealthy_marks.fetch_add(1, Ordering::Relaxed);
            self.gone.send_modify(|generation| *generation += 1);
            tracing::warn!(
                endpoint = self.url(),
                outstanding = self.outstanding(),
                "endpoint unhealthy; failing its waiting requests over"
            );
        }
        true
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// A heartbeat of this healthy endpoint just failed (`true`) or passed (`false`). Going suspect takes
    /// it out of the pick and wakes its waiting attempts: those that have waited longer than a heartbeat
    /// timeout fail over at once (the endpoint is silent to both), the rest wait for the verdict.
    pub fn set_suspect(&self, suspect: bool) {
        if self.suspect.swap(suspect, Ordering::Relaxed) != suspect && suspect {
            self.gone.send_modify(|generation| *generation += 1);
            tracing::debug!(endpoint = self.url(), "heartbeat failed; endpoint suspect");
        }
    }

    pub fn is_suspect(&self) -> bool {
        self.suspect.load(Ordering::Relaxed)
    }

    /// Whether the breaker currently keeps this endpoint out (open or probing).
    pub fn is_ejected(&self) -> bool {
        self.gate.load(Ordering::Relaxed) != GATE_CLOSED
    }

    /// The breaker's state, for debug output and tests.
    pub fn breaker_state(&self) -> State {
        self.lock_breaker().state()
    }

    /// Times the breaker opened.
    pub fn ejections(&self) -> u64 {
        self.ejections.load(Ordering::Relaxed)
    }

    /// Times heartbeats marked the endpoint unhealthy.
    pub fn unhealthy_marks(&self) -> u64 {
        self.unhealthy_marks.load(Ordering::Relaxed)
    }

    /// Times the endpoint asked for back-off (429, 503 with Retry-After), paused or not.
    pub fn cooldowns(&self) -> u64 {
        self.cooldowns.load(Ordering::Relaxed)
    }

    /// Back-pressure from the endpoint: no new requests for `pause` (it is not a failure).
    pub fn cool_down(&self, pause: Duration, now: Instant) {
        let until = self.millis(now + pause);
        self.cooldown_until.fetch_max(until, Ordering::Relaxed);
        self.cooldowns.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            endpoint = self.url(),
            pause_ms = pause.as_millis() as u64,
            "endpoint asked for back-off"
        );
    }

    /// Back-pressure from an endpoint still serving others of ours: counted, not paused (the caller
    /// cuts an adaptive limit instead). Logged at debug: under standing overload it happens many times
    /// a second.
    pub fn pushed_back_while_busy(&self) {
        self.cooldowns.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(endpoint = self.url(), "busy endpoint refused a request");
    }

    /// Whether the endpoint asked for back-off that has not ended at `now_ms`.
    pub fn cooling_down(&self, now_ms: u64) -> bool {
        self.cooldown_until.load(Ordering::Relaxed) > now_ms
    }

    /// Changes when heartbeats find the endpoint suspect or declare it gone, after this call.
    pub fn gone_signal(&self) -> watch::Receiver<u64> {
        self.gone.subscribe()
    }

    fn lock_breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.breaker
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Mirrors the breaker into the gate and logs a transition once.
    fn publish(&self, breaker: &Breaker, now: Instant, transition: Option<Transition>) {
        let streak = match breaker.state() {
            State::Closed { failures } => failures,
            _ => 0,
        };
        self.streak.store(streak, Ordering::Relaxed);
        let gate = match breaker.state() {
            State::Closed { .. } => GATE_CLOSED,
            State::HalfOpen {
                probe_in_flight: true,
            } => GATE_PROBING,
            // Half-open with the probe slot free: eligible as a probe from now on.
            State::HalfOpen {
                probe_in_flight: false,
            } => self.millis(now).max(1),
            State::Open { until } => self.millis(until).max(1),
        };
        self.gate.store(gate, Ordering::Relaxed);
        match transition {
            Some(Transition::Opened { for_ }) => {
                self.ejections.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    endpoint = self.url(),
                    ejected_ms = for_.as_millis() as u64,
                    "circuit opened"
                );
            }
            Some(Transition::HalfOpened) => {
                tracing::info!(
                    endpoint = self.url(),
                    "circuit half-open: one probe request admitted"
                );
            }
            Some(Transition::Closed) => {
                self.start_slow_start(now);
                tracing::info!(endpoint = self.url(), "circuit closed");
            }
            None => {}
        }
    }

    pub fn id(&self) -> EndpointId {
        self.id
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }

    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    pub fn path_prefix(&self) -> &str {
        &self.path_prefix
    }

    pub fn host_header(&self) -> &HeaderValue {
        &self.host_header
    }

    pub fn weight(&self) -> u32 {
        self.weight
    }

    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Whether the endpoint is in the set at all (not draining).
    pub fn is_available(&self) -> bool {
        !self.draining.load(Ordering::Relaxed)
    }

    pub fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::Relaxed);
    }

    /// Counts a request as outstanding here until the returned guard is dropped, regardless of the
    /// limit (upgrades and tests; the request path uses [`Endpoint::try_start_request`]).
    pub fn start_request(self: &Arc<Self>) -> Outstanding {
        let in_flight = self.outstanding.fetch_add(1, Ordering::Relaxed) + 1;
        self.requests.fetch_add(1, Ordering::Relaxed);
        Outstanding {
            endpoint: Arc::clone(self),
            in_flight,
        }
    }

    /// Takes one of the endpoint's slots if it is below its concurrency limit. Exact under races: two
    /// workers cannot both take the last slot.
    pub fn try_start_request(self: &Arc<Self>) -> Option<Outstanding> {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut current = self.outstanding.load(Ordering::SeqCst);
        loop {
            if current >= limit {
                return None;
            }
            match self.outstanding.compare_exchange_weak(
                current,
                current + 1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(actual) => current = actual,
            }
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        Some(Outstanding {
            endpoint: Arc::clone(self),
            in_flight: current + 1,
        })
    }

    /// The concurrency limit in force (`None`: unlimited).
    pub fn limit(&self) -> Option<u64> {
        match self.limit.load(Ordering::Relaxed) {
            u64::MAX => None,
            limit => Some(limit),
        }
    }

    /// The adaptive limiter's unloaded latency in microseconds, if it measured one.
    pub fn unloaded_latency_us(&self) -> Option<u64> {
        self.lock_limiter()
            .as_ref()
            .map(Limiter::unloaded_us)
            .filter(|&us| us > 0)
    }

    /// What to call when a slot comes free (set once, by the registry).
    pub fn set_slot_freed(&self, slot_freed: SlotFreed) {
        let _ = self.slot_freed.set(slot_freed);
    }

    /// Applies the limit settings (on creation and on reload). An adaptive limiter keeps what it learnt
    /// when only other settings changed.
    pub fn apply_limit(&self, settings: &LimitSettings, now: Instant) {
        let mut limiter = self.lock_limiter();
        let limit = match settings.mode {
            LimitMode::None => {
                *limiter = None;
                u64::MAX
            }
            LimitMode::Static => {
                *limiter = None;
                u64::from(settings.initial)
            }
            LimitMode::Adaptive => {
                let state = match limiter.take() {
                    Some(mut kept) => {
                        kept.set_settings(*settings);
                        kept
                    }
                    None => Limiter::new(*settings, self.millis(now)),
                };
                let limit = u64::from(state.limit());
                *limiter = Some(state);
                limit
            }
        };
        self.store_limit(limit);
    }

    /// Feeds the adaptive limiter a committed request's time to first byte.
    pub fn observe_limit_sample(&self, sample: Duration, in_flight: u64, now: Instant) {
        let mut limiter = self.lock_limiter();
        if let Some(state) = limiter.as_mut() {
            let limit = state.on_sample(sample, in_flight, self.millis(now));
            drop(limiter);
            self.store_limit(u64::from(limit));
        }
    }

    /// The endpoint pushed back: the adaptive limit drops at once. False when it has no adaptive limit.
    pub fn limit_back_pressure(&self, now: Instant) -> bool {
        let mut limiter = self.lock_limiter();
        match limiter.as_mut() {
            Some(state) => {
                // The refused request still counts as outstanding here; the node holds the others.
                let holding = self.outstanding().saturating_sub(1);
                let limit = state.on_back_pressure(self.millis(now), holding);
                drop(limiter);
                self.store_limit(u64::from(limit));
                true
            }
            None => false,
        }
    }

    fn store_limit(&self, limit: u64) {
        let limit = limit.min(self.limit_cap);
        let old = self.limit.swap(limit, Ordering::Relaxed);
        if limit > old
            && let Some(slot_freed) = self.slot_freed.get()
        {
            slot_freed.call();
        }
    }

    fn lock_limiter(&self) -> std::sync::MutexGuard<'_, Option<Limiter>> {
        self.limiter
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// RAII count of one in-flight request on an endpoint.
///
/// The proxy moves it into the response body (or the upgraded-connection task), so a request stays
/// outstanding until its body has ended or the client went away — not just until headers arrived, which
/// would undercount streamed token responses that last seconds.
#[derive(Debug)]
pub struct Outstanding {
    endpoint: Arc<Endpoint>,
    /// Requests outstanding on the endpoint when this one started, itself included.
    in_flight: u64,
}

impl Outstanding {
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    pub fn in_flight_at_start(&self) -> u64 {
        self.in_flight
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        // SeqCst on both sides of the hand-off (this decrement then the queue's waiting count; a joiner's
        // increment of that count then its look at this one): one of the two always sees the other.
        self.endpoint.outstanding.fetch_sub(1, Ordering::SeqCst);
        if let Some(slot_freed) = self.endpoint.slot_freed.get() {
            slot_freed.call();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(url: &str) -> Arc<Endpoint> {
        Arc::new(Endpoint::new(1, url, EndpointUrl::parse(url).unwrap(), 1))
    }

    #[test]
    fn outstanding_follows_guards() {
        let ep = endpoint("http://127.0.0.1:1");
        let a = ep.start_request();
        let b = ep.start_request();
        assert_eq!(ep.outstanding(), 2);
        drop(a);
        assert_eq!(ep.outstanding(), 1);
        drop(b);
        assert_eq!(ep.outstanding(), 0);
        assert_eq!(ep.requests(), 2);
    }

    #[test]
    fn host_header_is_the_endpoint_authority() {
        let ep = endpoint("https://tamarind-navybean.salad.cloud");
        assert_eq!(ep.host_header(), "tamarind-navybean.salad.cloud");
        let ep = endpoint("http://[::1]:8000/v1");
        assert_eq!(ep.host_header(), "[::1]:8000");
        assert_eq!(ep.path_prefix(), "/v1");
    }
}

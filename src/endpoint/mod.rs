//! An endpoint (one remote inference node) and its live state.
//!
//! Identity and address never change once built; when discovery reports a different URL or weight the
//! registry builds a new `Endpoint`. Live state is atomics the request path reads without locks, plus
//! the circuit breaker: one state machine behind one small lock, mirrored into a single atomic "gate"
//! so a pick can skip ejected endpoints without locking. Heartbeats (health.rs) set `healthy` and fire
//! the `gone` signal that in-flight attempts listen to.
//!
//! One file per concern: [`load`] (outstanding requests, limits, back-off), [`gate`] (the breaker and
//! its lock-free gate), [`latency`] (the expected-latency estimate), [`pace`] (what its streams'
//! silences normally are, by phase, and when it was last heard from), [`liveness`] (heartbeats'
//! verdicts), [`models`] (what it says it serves) and [`view`] (what operators see); [`counts`] keeps the registry's fleet-wide counts as they change.

mod counts;
mod gate;
mod latency;
mod liveness;
mod load;
mod models;
mod pace;
mod view;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use http::HeaderValue;
use http::uri::{Authority, Scheme};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::breaker::Breaker;
use crate::config::EndpointUrl;
use crate::limit::Limiter;

use self::counts::Counted;
pub use self::counts::FleetCounts;
use self::gate::{GATE_CLOSED, GATE_PROBING};
pub use self::latency::LOAD_BUCKETS;
pub use self::load::Outstanding;
pub use self::pace::{OPENING_GAPS, Pace, Typical};
pub use self::view::{EndpointState, EndpointView};

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
    /// Without an adaptive limit, a node that refused while busy is held to what it held until this
    /// millisecond (0: not held).
    held_until: AtomicU64,
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
    /// Time to first byte by the requests in flight when an attempt started (see `latency`): an EWMA
    /// in microseconds per load bucket (0: none seen at that load).
    by_load: [AtomicU64; LOAD_BUCKETS],
    /// Attempts here waiting for their first byte ...
    waiting: AtomicU64,
    /// ... and the millisecond the endpoint last went from none waiting to some ...
    waiting_since: AtomicU64,
    /// ... and the millisecond an attempt last started here (0: never).
    tried_at: AtomicU64,
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
    /// Bumped when heartbeats declare the endpoint gone or it stalls; waiting attempts fail over at once.
    gone: watch::Sender<u64>,
    /// The breaker is open because requests stalled while heartbeats passed (mirrored from it).
    stalled: AtomicBool,
    /// Attempts that stalled here.
    stall_events: AtomicU64,
    /// A beaten attempt goes on in the background to tell slow from hung.
    investigating: AtomicBool,
    /// What its streams' silences normally are, by phase, and when it was last heard from.
    pace: Pace,
    /// The model ids its own `/v1/models` gave when last asked.
    served_models: Mutex<Arc<[String]>>,
    ejections: AtomicU64,
    /// Times heartbeats marked the endpoint unhealthy.
    unhealthy_marks: AtomicU64,
    /// Times the endpoint asked for back-off.
    cooldowns: AtomicU64,
    /// The adaptive limit's state (only with `concurrency.limit: adaptive`).
    limiter: Mutex<Option<Limiter>>,
    /// The limit the configuration sets without an adaptive limiter (`u64::MAX`: none).
    configured_limit: AtomicU64,
    /// Called when a slot here comes free (wakes whoever waits for one).
    slot_freed: OnceLock<SlotFreed>,
    /// The registry's counts this endpoint is counted in, and what it adds to them now.
    counts: OnceLock<Arc<FleetCounts>>,
    counted: Counted,
    /// The last heartbeat: when it ended (ms, 0: none yet), how long it took (µs), and whether it passed.
    heartbeat_at: AtomicU64,
    heartbeat_rtt_us: AtomicU64,
    heartbeat_ok: AtomicBool,
    /// Where the endpoint came from (`static` or `kubernetes`, and the pod).
    origin: Origin,
    /// A cap on the concurrency limit, whatever the mode says: this replica's share of a pod's own
    /// annotation (see [`crate::limit::LimitSettings::share`]).
    limit_cap: AtomicU64,
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
            by_load: Default::default(),
            waiting: AtomicU64::new(0),
            waiting_since: AtomicU64::new(0),
            tried_at: AtomicU64::new(0),
            gate: AtomicU64::new(GATE_CLOSED),
            breaker: Mutex::new(Breaker::default()),
            streak: AtomicU32::new(0),
            cooldown_until: AtomicU64::new(0),
            ramp_start: AtomicU64::new(0),
            held_until: AtomicU64::new(0),
            gone: watch::channel(0).0,
            stalled: AtomicBool::new(false),
            stall_events: AtomicU64::new(0),
            investigating: AtomicBool::new(false),
            pace: Pace::default(),
            served_models: Mutex::new(Arc::from(Vec::new())),
            ejections: AtomicU64::new(0),
            unhealthy_marks: AtomicU64::new(0),
            cooldowns: AtomicU64::new(0),
            limiter: Mutex::new(None),
            slot_freed: OnceLock::new(),
            counts: OnceLock::new(),
            counted: Counted::default(),
            heartbeat_at: AtomicU64::new(0),
            heartbeat_rtt_us: AtomicU64::new(0),
            heartbeat_ok: AtomicBool::new(false),
            origin: Origin::default(),
            limit_cap: AtomicU64::new(u64::MAX),
            configured_limit: AtomicU64::new(u64::MAX),
        }
    }

    /// Sets where the endpoint came from and its own concurrency cap (before it serves).
    pub fn with_origin(mut self, origin: &Origin) -> Endpoint {
        self.origin = origin.clone();
        self.limit_cap = AtomicU64::new(origin.max_outstanding.unwrap_or(u64::MAX).max(1));
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

    pub fn source(&self) -> &'static str {
        self.origin.source
    }

    /// Milliseconds from the process's epoch to `now` (see [`millis`]).
    pub fn millis(&self, now: Instant) -> u64 {
        millis(now)
    }

    /// Whether a new request may go here at `now_ms` (see [`millis`]).
    pub fn eligibility(&self, now_ms: u64, ignore_health: bool) -> Eligibility {
        self.lift_hold(now_ms);
        let unwell = !self.healthy.load(Ordering::Relaxed) || self.suspect.load(Ordering::Relaxed);
        if self.outstanding.load(Ordering::Relaxed) >= self.limit.load(Ordering::Relaxed)
            || self.draining.load(Ordering::Relaxed)
            || (!ignore_health && unwell)
            || self.cooldown_until.load(Ordering::Relaxed) > now_ms
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

    /// Ramps the endpoint's share in from 10 % over the slow-start window, from `now`.
    pub fn start_slow_start(&self, now: Instant) {
        self.ramp_start
            .store(self.millis(now).max(1), Ordering::Relaxed);
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

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
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

    #[tokio::test(start_paused = true)]
    async fn a_node_that_refuses_while_busy_is_held_to_what_it_held_for_a_while() {
        let ep = endpoint("http://127.0.0.1:1");
        let settings = crate::limit::LimitSettings::from_config(&Default::default());
        ep.apply_limit(&settings, Instant::now());
        assert_eq!(ep.limit(), None, "no limit by default");
        let held: Vec<_> = (0..3).map(|_| ep.start_request()).collect();
        // The third request was refused while the node held the other two.
        ep.limit_back_pressure(Instant::now());
        assert_eq!(ep.limit(), Some(2));
        let now_ms = millis(Instant::now());
        assert_eq!(ep.eligibility(now_ms, false), Eligibility::No, "full");
        tokio::time::advance(load::HOLD).await;
        let now_ms = millis(Instant::now());
        assert_eq!(
            ep.eligibility(now_ms, false),
            Eligibility::Yes,
            "the hold lifted"
        );
        assert_eq!(ep.limit(), None);

        // A static limit is never raised by a hold, and a refusal holding nothing keeps one slot.
        let settings = crate::limit::LimitSettings {
            mode: crate::config::LimitMode::Static,
            initial: 1,
            ..settings
        };
        ep.apply_limit(&settings, Instant::now());
        ep.limit_back_pressure(Instant::now());
        assert_eq!(ep.limit(), Some(1));
        drop(held);
        let lone = ep.start_request();
        ep.limit_back_pressure(Instant::now());
        assert_eq!(ep.limit(), Some(1), "at least one");
        drop(lone);
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

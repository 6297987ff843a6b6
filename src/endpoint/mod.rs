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
//! verdicts), [`models`] (what it says it serves), [`signals`] (what its own metrics say of its load)
//! and [`view`] (what operators see); [`counts`] keeps the registry's fleet-wide counts as they change.
//! What the pick reads sits on `Endpoint` itself; the load and breaker concerns' other operations are
//! reached through borrowed views of their own, [`Endpoint::load`] and [`Endpoint::breaker`].

mod address;
mod counts;
mod gate;
mod latency;
mod liveness;
mod load;
mod models;
mod pace;
mod signals;
mod tally;
mod view;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::EndpointUrl;

pub use self::address::Address;
use self::counts::Counted;
pub use self::counts::FleetCounts;
pub use self::gate::{BreakerControl, Circuit};
use self::gate::{GATE_CLOSED, GATE_PROBING};
pub use self::latency::{
    AtLoad, LOAD_BUCKETS, LOAD_FRESH_MS, LatencyModel, Waiting, bucket_floor, load_bucket,
};
pub use self::liveness::{Announcer, LastHeartbeat, Liveness, Notices};
pub use self::load::{LimitState, LoadControl, Outstanding};
pub use self::models::ServedModels;
pub use self::pace::{OPENING_GAPS, Pace, Typical};
pub use self::signals::{EngineNow, EngineSignals, ReadStatus};
pub use self::tally::Tally;
pub use self::view::{
    EndpointState, EndpointView, HeartbeatView, SignalsView, TallyView, TimingView,
};

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
    /// Draining, healthy, suspect.
    liveness: Liveness,
    /// What its answers took, and the attempts waiting for one now.
    latency: LatencyModel,
    // Everything below is read off the pick's path.
    address: Address,
    tally: Tally,
    heartbeat: LastHeartbeat,
    /// The breaker behind the gate.
    circuit: Circuit,
    /// Bumped when heartbeats declare the endpoint gone or it stalls; waiting attempts fail over at once.
    gone: watch::Sender<u64>,
    /// What its streams' silences normally are, by phase, and when it was last heard from.
    pace: Pace,
    /// The model ids its own `/v1/models` gave when last asked.
    served_models: ServedModels,
    /// What its own metrics last said of its load.
    signals: EngineSignals,
    /// The limit as the configuration, the pod and the adaptive limiter set it.
    limits: LimitState,
    /// The registry's counts this endpoint is counted in, and what it adds to them now.
    counted: Counted,
    /// What its node or its source said of its end.
    notices: Notices,
    /// Where the endpoint came from (`static` or `kubernetes`, and the pod).
    origin: Origin,
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
    /// The model server it runs, when its pod or its entry says (else `signals.engine`).
    pub engine: Option<crate::engine::Engine>,
}

impl Default for Origin {
    fn default() -> Self {
        Origin {
            source: "static",
            pod: None,
            max_outstanding: None,
            engine: None,
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
        Endpoint {
            id,
            address: Address::new(url, parsed),
            tally: Tally::default(),
            heartbeat: LastHeartbeat::default(),
            weight: weight.max(1),
            outstanding: AtomicU64::new(0),
            limit: AtomicU64::new(u64::MAX),
            liveness: Liveness::default(),
            latency: LatencyModel::default(),
            gate: AtomicU64::new(GATE_CLOSED),
            circuit: Circuit::default(),
            cooldown_until: AtomicU64::new(0),
            ramp_start: AtomicU64::new(0),
            held_until: AtomicU64::new(0),
            gone: watch::channel(0).0,
            pace: Pace::default(),
            served_models: ServedModels::default(),
            signals: EngineSignals::default(),
            limits: LimitState::new(u64::MAX),
            counted: Counted::default(),
            notices: Notices::default(),
            origin: Origin::default(),
        }
    }

    /// Sets where the endpoint came from and its own concurrency cap (before it serves).
    pub fn with_origin(mut self, origin: &Origin) -> Endpoint {
        self.origin = origin.clone();
        self.limits = LimitState::new(origin.max_outstanding.unwrap_or(u64::MAX).max(1));
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

    /// Whether a new request may go here at `now_ms` (see [`millis`]).
    pub fn eligibility(&self, now_ms: u64, ignore_health: bool) -> Eligibility {
        self.lift_hold(now_ms);
        let unwell = !self.liveness.healthy.load(Ordering::Relaxed)
            || self.liveness.suspect.load(Ordering::Relaxed);
        if self.outstanding.load(Ordering::Relaxed) >= self.limit.load(Ordering::Relaxed)
            || !self.liveness.is_available()
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
        self.ramp_start.store(millis(now).max(1), Ordering::Relaxed);
    }

    /// What its answers took, and the attempts waiting for one now.
    pub fn latency(&self) -> &LatencyModel {
        &self.latency
    }

    pub fn id(&self) -> EndpointId {
        self.id
    }

    pub fn url(&self) -> &str {
        self.address.url()
    }

    /// Where it is, parsed.
    pub fn address(&self) -> &Address {
        &self.address
    }

    /// What its streams' silences normally are, and when it was last heard from.
    pub fn pace(&self) -> &Pace {
        &self.pace
    }

    /// The limit as the configuration, the pod and the adaptive limiter set it.
    pub fn limits(&self) -> &LimitState {
        &self.limits
    }

    /// The breaker behind the gate.
    pub fn circuit(&self) -> &Circuit {
        &self.circuit
    }

    /// Draining, healthy, suspect.
    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// The model ids its own `/v1/models` gave when last asked.
    pub fn served_models(&self) -> &ServedModels {
        &self.served_models
    }

    /// The generation of its GPU's cache as tongs can know it: the count of its unhealthy verdicts (a
    /// node declared down is taken to have lost what it cached).
    pub fn cache_epoch(&self) -> u64 {
        self.tally.unhealthy_marks()
    }

    /// Wakes whoever waits for a slot here (the pool's queue): the node may take a request it would
    /// not take before, for a reason other than a slot freed (its own metrics say it has room again).
    pub fn wake_waiters(&self) {
        if let Some(slot_freed) = self.limits.slot_freed.get() {
            slot_freed.call();
        }
    }

    /// What its own metrics last said of its load, and the estimate from it.
    pub fn signals(&self) -> &EngineSignals {
        &self.signals
    }

    /// What happened here, counted.
    pub fn tally(&self) -> &Tally {
        &self.tally
    }

    /// Its last heartbeat.
    pub fn heartbeat(&self) -> &LastHeartbeat {
        &self.heartbeat
    }

    pub fn weight(&self) -> u32 {
        self.weight
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
        assert_eq!(ep.tally().requests(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_that_refuses_while_busy_is_held_to_what_it_held_for_a_while() {
        let ep = endpoint("http://127.0.0.1:1");
        let settings = crate::limit::LimitSettings::from_config(&Default::default());
        ep.load().apply_limit(&settings, Instant::now());
        assert_eq!(ep.load().limit(), None, "no limit by default");
        let held: Vec<_> = (0..3).map(|_| ep.start_request()).collect();
        // The third request was refused while the node held the other two: held to two, and from
        // then on the node keeps a profile.
        ep.load().limit_back_pressure(Instant::now());
        assert_eq!(ep.load().limit(), Some(2));
        let now_ms = millis(Instant::now());
        assert_eq!(ep.eligibility(now_ms, false), Eligibility::No, "full");
        let answer = std::time::Duration::from_millis(100);
        tokio::time::advance(load::HOLD).await;
        ep.load().observe_limit_sample(answer, 2, Instant::now());
        let now_ms = millis(Instant::now());
        assert_eq!(
            ep.eligibility(now_ms, false),
            Eligibility::Yes,
            "the hold lifted"
        );
        assert_eq!(ep.load().limit(), None, "no knee seen: not held");
        // Refused again once that lapsed: full for more than a moment, so held at half what it held
        // for the answers it takes to measure a level within its batch, then to what it held.
        ep.load().limit_back_pressure(Instant::now());
        assert_eq!(ep.load().limit(), Some(1), "half of what it held");
        for _ in 0..crate::limit::learned::MIN_SAMPLES {
            ep.load().observe_limit_sample(answer, 1, Instant::now());
        }
        assert_eq!(ep.load().limit(), Some(2), "then what it held");

        // A static limit is never raised by a hold, and a refusal holding nothing keeps one slot.
        let settings = crate::limit::LimitSettings {
            mode: crate::config::LimitMode::Static,
            initial: 1,
            ..settings
        };
        ep.load().apply_limit(&settings, Instant::now());
        ep.load().limit_back_pressure(Instant::now());
        assert_eq!(ep.load().limit(), Some(1));
        drop(held);
        let lone = ep.start_request();
        ep.load().limit_back_pressure(Instant::now());
        assert_eq!(ep.load().limit(), Some(1), "at least one");
        drop(lone);
    }

    #[test]
    fn host_header_is_the_endpoint_authority() {
        let ep = endpoint("https://tamarind-navybean.salad.cloud");
        assert_eq!(ep.address().host_header(), "tamarind-navybean.salad.cloud");
        let ep = endpoint("http://[::1]:8000/v1");
        assert_eq!(ep.address().host_header(), "[::1]:8000");
        assert_eq!(ep.address().path_prefix(), "/v1");
    }
}

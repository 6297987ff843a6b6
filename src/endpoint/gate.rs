//! The circuit breaker's state machine behind one small lock, mirrored into a single atomic "gate" so a
//! pick can skip ejected endpoints without locking.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::time::Instant;

use super::{Endpoint, millis};
use crate::breaker::{Admission, Breaker, BreakerSettings, State, Transition};

/// `gate` value of a closed breaker.
pub(super) const GATE_CLOSED: u64 = 0;
/// `gate` value of a half-open breaker whose one probe is in flight.
pub(super) const GATE_PROBING: u64 = u64::MAX;

impl Endpoint {
    /// What its requests' outcomes and its heartbeats tell the breaker (see [`BreakerControl`]).
    pub fn breaker(&self) -> BreakerControl<'_> {
        BreakerControl { endpoint: self }
    }
}

/// The breaker concern of one endpoint, borrowed: requests' outcomes, stalls and passing heartbeats fed
/// to its breaker, the half-open probe claimed and released, and the breaker mirrored into the
/// lock-free gate the pick reads (through [`Endpoint::eligibility`]).
#[derive(Clone, Copy, Debug)]
pub struct BreakerControl<'a> {
    endpoint: &'a Endpoint,
}

impl BreakerControl<'_> {
    /// Asks the breaker for a request now (claims the half-open probe when that is what is left).
    pub fn admit(&self, now: Instant) -> Admission {
        let mut breaker = self.endpoint.circuit.lock();
        let (admission, transition) = breaker.admit(now);
        self.publish(&breaker, now, transition);
        admission
    }

    /// The endpoint answered a request well.
    pub fn record_success(&self, now: Instant) {
        // The common case, a closed breaker with no failure streak, takes no lock.
        if self.endpoint.gate.load(Ordering::Relaxed) == GATE_CLOSED
            && self.endpoint.circuit.streak.load(Ordering::Relaxed) == 0
        {
            return;
        }
        let mut breaker = self.endpoint.circuit.lock();
        let transition = breaker.on_success(now);
        self.publish(&breaker, now, transition);
    }

    /// A request failed at this endpoint. `may_eject`: the fleet can afford one more ejection.
    pub fn record_failure(&self, settings: &BreakerSettings, now: Instant, may_eject: bool) {
        if self.endpoint.liveness().is_announced() {
            // A node that said it is going fails as it goes: nothing counts against it.
            return;
        }
        self.endpoint.tally.failures.fetch_add(1, Ordering::Relaxed);
        let mut breaker = self.endpoint.circuit.lock();
        let transition = breaker.on_failure(settings, now, may_eject, fastrand::f64());
        self.publish(&breaker, now, transition);
    }

    /// A committed stream here went silent past its idle limit. While heartbeats pass, that is a gray
    /// failure's sign like any other attempt that hangs: counted as a stall (with
    /// `breaker.consecutive_stalls` in a row the endpoint is stalled, and its other streams are cut at
    /// once rather than each waiting out its own limit). Otherwise a plain failure. Counted in the
    /// endpoint's failures either way.
    pub fn record_stream_stall(&self, settings: &BreakerSettings, now: Instant, may_eject: bool) {
        if self.endpoint.liveness().is_announced() {
            return;
        }
        if self.endpoint.liveness().is_healthy() {
            self.endpoint.tally.failures.fetch_add(1, Ordering::Relaxed);
            self.record_stall(settings, now, may_eject);
        } else {
            self.record_failure(settings, now, may_eject);
        }
    }

    /// An attempt here stalled (lost to a hedge, or waited far past the expected latency). Counted only
    /// while heartbeats pass and the node has not said it is going: a node they declared gone is theirs
    /// to judge, and one going is draining already. Returns true when this made
    /// the endpoint stalled: ejected, with its waiting attempts told to move at once.
    pub fn record_stall(&self, settings: &BreakerSettings, now: Instant, may_eject: bool) -> bool {
        if !self.endpoint.liveness().is_healthy() || self.endpoint.liveness().is_announced() {
            return false;
        }
        self.endpoint.tally.stalls.fetch_add(1, Ordering::Relaxed);
        let mut breaker = self.endpoint.circuit.lock();
        let transition = breaker.on_stall(settings, now, may_eject, fastrand::f64());
        self.publish(&breaker, now, transition);
        drop(breaker);
        let stalled = matches!(transition, Some(Transition::Opened { .. }));
        if stalled {
            self.endpoint
                .gone
                .send_modify(|generation| *generation += 1);
            tracing::warn!(
                endpoint = self.endpoint.url(),
                outstanding = self.endpoint.outstanding(),
                "endpoint stalled: heartbeats pass but requests hang; ejected until a real request succeeds"
            );
        }
        stalled
    }

    /// A half-open probe ended without a verdict (its client left): let another request probe.
    pub fn release_probe(&self, now: Instant) {
        let mut breaker = self.endpoint.circuit.lock();
        breaker.release_probe();
        self.publish(&breaker, now, None);
    }

    /// A heartbeat passed: it counts as the breaker's probe once the ejection time is over.
    pub fn heartbeat_passed(&self, now: Instant) {
        if self.endpoint.gate.load(Ordering::Relaxed) == GATE_CLOSED {
            return;
        }
        let mut breaker = self.endpoint.circuit.lock();
        let transition = breaker.on_heartbeat_success(now);
        self.publish(&breaker, now, transition);
    }

    /// Whether the breaker currently keeps this endpoint out (open or probing).
    pub fn is_ejected(&self) -> bool {
        self.endpoint.gate.load(Ordering::Relaxed) != GATE_CLOSED
    }

    /// Mirrors the breaker into the gate and logs a transition once.
    pub(super) fn publish(&self, breaker: &Breaker, now: Instant, transition: Option<Transition>) {
        let streak = match breaker.state() {
            State::Closed { failures } => failures,
            _ => 0,
        };
        self.endpoint
            .circuit
            .streak
            .store(streak, Ordering::Relaxed);
        let gate = match breaker.state() {
            State::Closed { .. } => GATE_CLOSED,
            State::HalfOpen {
                probe_in_flight: true,
            } => GATE_PROBING,
            // Half-open with the probe slot free: eligible as a probe from now on.
            State::HalfOpen {
                probe_in_flight: false,
            } => millis(now).max(1),
            State::Open { until } => millis(until).max(1),
        };
        self.endpoint.gate.store(gate, Ordering::Relaxed);
        self.endpoint
            .circuit
            .stalled
            .store(breaker.is_stalled(), Ordering::Relaxed);
        self.endpoint.recount();
        match transition {
            Some(Transition::Opened { for_ }) => {
                self.endpoint
                    .tally
                    .ejections
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    endpoint = self.endpoint.url(),
                    ejected_ms = for_.as_millis() as u64,
                    "circuit opened"
                );
            }
            Some(Transition::HalfOpened) => {
                tracing::info!(
                    endpoint = self.endpoint.url(),
                    "circuit half-open: one probe request admitted"
                );
            }
            Some(Transition::Closed) => {
                self.endpoint.start_slow_start(now);
                tracing::info!(endpoint = self.endpoint.url(), "circuit closed");
            }
            None => {}
        }
    }
}

/// The breaker behind the gate, and what goes with it off the pick's path.
#[derive(Debug, Default)]
pub struct Circuit {
    pub(super) breaker: Mutex<Breaker>,
    /// The closed breaker's failure streak, mirrored so a success needs no lock when it is zero.
    pub(super) streak: AtomicU32,
    /// The breaker is open because requests stalled while heartbeats passed (mirrored from it).
    pub(super) stalled: AtomicBool,
    /// A beaten attempt goes on in the background to tell slow from hung.
    pub(super) investigating: AtomicBool,
}

impl Circuit {
    /// Claims the one background look at whether the endpoint is slow or hung (false: one runs).
    pub fn begin_investigation(&self) -> bool {
        !self.investigating.swap(true, Ordering::Relaxed)
    }

    pub fn end_investigation(&self) {
        self.investigating.store(false, Ordering::Relaxed);
    }

    /// Whether the breaker keeps the endpoint out because its requests stalled (a gray failure).
    pub fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }

    pub fn state(&self) -> State {
        self.lock().state()
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Breaker> {
        self.breaker
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

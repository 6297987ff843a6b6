//! How many of a registry's endpoints are ejected, healthy, and up, kept as endpoints change state, so
//! the request path never scans the fleet to know (a refusal, a failure that may eject, panic mode).

use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use super::{Endpoint, GATE_CLOSED};

/// Counts over the endpoints in one registry's set (draining ones count for nothing).
#[derive(Debug, Default)]
pub struct FleetCounts {
    ejected: AtomicUsize,
    healthy: AtomicUsize,
    up: AtomicUsize,
    /// When any endpoint's own metrics were last read (the endpoints' milliseconds; 0: never): while
    /// that is older than `signals.max_age`, no endpoint has a reading the pick may use, and the pick
    /// skips the scorers that read them.
    last_reading_ms: AtomicU64,
    /// When an endpoint last said itself that it is full (0: never): it refused a request while
    /// serving others of ours, or its own metrics showed it saturated. Only then may the queue refuse
    /// arrivals for standing (see `admission::standing`): a fleet tongs merely holds back (a limit
    /// still learning, nodes coming back from an interruption) has not said it cannot take more.
    last_full_ms: AtomicU64,
}

impl FleetCounts {
    /// Endpoints whose breaker keeps them out (open or probing).
    pub fn ejected(&self) -> usize {
        self.ejected.load(Ordering::Relaxed)
    }

    /// Endpoints heartbeats call healthy.
    pub fn healthy(&self) -> usize {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Endpoints healthy and not ejected: those that could serve if they had room.
    pub fn up(&self) -> usize {
        self.up.load(Ordering::Relaxed)
    }

    /// When any endpoint's own metrics were last read (0: never).
    pub fn last_reading_ms(&self) -> u64 {
        self.last_reading_ms.load(Ordering::Relaxed)
    }

    /// When an endpoint last said it is full (0: never).
    pub fn last_full_ms(&self) -> u64 {
        self.last_full_ms.load(Ordering::Relaxed)
    }

    fn counters(&self) -> [&AtomicUsize; 3] {
        [&self.ejected, &self.healthy, &self.up]
    }
}

/// The registry's counts one endpoint is counted in (set once, by the registry), and what it adds to
/// them now: a bit per counter of [`FleetCounts::counters`].
#[derive(Debug, Default)]
pub(super) struct Counted {
    counts: OnceLock<Arc<FleetCounts>>,
    bits: AtomicU8,
}

impl Endpoint {
    /// Its own metrics were read at `now_ms`: the registry's counts say a reading is about.
    pub fn note_reading(&self, now_ms: u64) {
        if let Some(counts) = self.counted.counts.get() {
            counts.last_reading_ms.fetch_max(now_ms, Ordering::Relaxed);
        }
    }

    /// It said at `now_ms` that it is full (see [`FleetCounts::last_full_ms`]).
    pub fn note_full(&self, now_ms: u64) {
        if let Some(counts) = self.counted.counts.get() {
            counts.last_full_ms.fetch_max(now_ms, Ordering::Relaxed);
        }
    }

    /// Counts this endpoint in `counts` from now on (set once, by the registry, as it joins the set).
    pub fn count_in(&self, counts: Arc<FleetCounts>) {
        let _breaker = self.circuit.lock();
        if self.counted.counts.set(counts).is_ok() {
            self.recount();
        }
    }

    /// Brings this endpoint's share of the counts up to date. Called with the breaker's lock held after
    /// every change of the breaker's gate, of health or of draining, so changes to one endpoint are
    /// counted in order and the counts are exact once they settle.
    pub(super) fn recount(&self) {
        let Some(counts) = self.counted.counts.get() else {
            return;
        };
        let in_set = self.liveness.is_available();
        let closed = self.gate.load(Ordering::Relaxed) == GATE_CLOSED;
        let healthy = in_set && self.liveness.healthy.load(Ordering::Relaxed);
        let now = [in_set && !closed, healthy, healthy && closed]
            .iter()
            .enumerate()
            .fold(0u8, |mask, (bit, on)| mask | (u8::from(*on) << bit));
        let was = self.counted.bits.swap(now, Ordering::Relaxed);
        for (bit, counter) in counts.counters().into_iter().enumerate() {
            match ((was >> bit) & 1, (now >> bit) & 1) {
                (0, 1) => {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                (1, 0) => {
                    counter.fetch_sub(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
    }
}

//! Heartbeats' verdicts: healthy or not, suspect after a failed heartbeat, draining once discovery
//! removed the endpoint, and the signal waiting attempts listen to.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::Endpoint;

impl Endpoint {
    /// Heartbeats' verdict on health. Marking an endpoint unhealthy fails its waiting attempts over.
    pub fn set_healthy(&self, healthy: bool, now: Instant) -> bool {
        let was = self.liveness.healthy.swap(healthy, Ordering::Relaxed);
        if was == healthy {
            return false;
        }
        if healthy {
            self.start_slow_start(now);
            tracing::info!(endpoint = self.url(), "endpoint healthy");
            let mut breaker = self.circuit.lock();
            let transition = breaker.on_recovery(now);
            self.breaker().publish(&breaker, now, transition);
        } else {
            {
                let _counting = self.circuit.lock();
                self.recount();
            }
            self.tally.unhealthy_marks.fetch_add(1, Ordering::Relaxed);
            self.gone.send_modify(|generation| *generation += 1);
            tracing::warn!(
                endpoint = self.url(),
                outstanding = self.outstanding(),
                "endpoint unhealthy; failing its waiting requests over"
            );
        }
        true
    }

    /// A heartbeat of this healthy endpoint just failed (`true`) or passed (`false`). Going suspect takes
    /// it out of the pick and wakes its waiting attempts: those that have waited longer than a heartbeat
    /// timeout fail over at once (the endpoint is silent to both), the rest wait for the verdict.
    pub fn set_suspect(&self, suspect: bool) {
        if self.liveness.suspect.swap(suspect, Ordering::Relaxed) != suspect && suspect {
            self.gone.send_modify(|generation| *generation += 1);
            tracing::debug!(endpoint = self.url(), "heartbeat failed; endpoint suspect");
        }
    }

    /// Changes when heartbeats find the endpoint suspect or declare it gone, after this call.
    pub fn gone_signal(&self) -> watch::Receiver<u64> {
        self.gone.subscribe()
    }

    pub fn set_draining(&self, draining: bool) {
        let _breaker = self.circuit.lock();
        self.liveness.draining.store(draining, Ordering::Relaxed);
        self.recount();
    }
}

/// Whether an endpoint takes new requests, as heartbeats and its source say. Read by every pick.
#[derive(Debug)]
pub struct Liveness {
    /// A draining endpoint takes no new requests; in-flight ones finish.
    pub(super) draining: AtomicBool,
    /// Heartbeats' verdict (true until heartbeats say otherwise).
    pub(super) healthy: AtomicBool,
    /// The last heartbeat of a healthy endpoint failed: no new requests until the verdict.
    pub(super) suspect: AtomicBool,
}

impl Default for Liveness {
    fn default() -> Liveness {
        Liveness {
            draining: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            suspect: AtomicBool::new(false),
        }
    }
}

impl Liveness {
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// The last heartbeat failed and the verdict is not in yet.
    pub fn is_suspect(&self) -> bool {
        self.suspect.load(Ordering::Relaxed)
    }

    /// Whether the endpoint is in the set at all (not draining).
    pub fn is_available(&self) -> bool {
        !self.draining.load(Ordering::Relaxed)
    }
}

/// An endpoint's last heartbeat: when it ended, how long it took, and whether it passed.
#[derive(Debug, Default)]
pub struct LastHeartbeat {
    /// Its end, ms on the [`super::millis`] clock (0: none yet).
    at: AtomicU64,
    rtt_us: AtomicU64,
    ok: AtomicBool,
}

impl LastHeartbeat {
    /// Records a heartbeat's outcome and duration.
    pub fn record(&self, passed: bool, took: Duration, now: Instant) {
        self.rtt_us.store(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.ok.store(passed, Ordering::Relaxed);
        self.at.store(super::millis(now).max(1), Ordering::Relaxed);
    }

    /// The last heartbeat: its end (ms on the [`super::millis`] clock), duration and verdict.
    pub fn get(&self) -> Option<(u64, Duration, bool)> {
        match self.at.load(Ordering::Relaxed) {
            0 => None,
            at => Some((
                at,
                Duration::from_micros(self.rtt_us.load(Ordering::Relaxed)),
                self.ok.load(Ordering::Relaxed),
            )),
        }
    }
}

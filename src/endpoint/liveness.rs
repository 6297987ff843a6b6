//! Heartbeats' verdicts: healthy or not, suspect after a failed heartbeat, draining once discovery
//! removed the endpoint, and the signal waiting attempts listen to.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::Endpoint;

impl Endpoint {
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
            {
                let _counting = self.lock_breaker();
                self.recount();
            }
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

    /// Times heartbeats marked the endpoint unhealthy.
    pub fn unhealthy_marks(&self) -> u64 {
        self.unhealthy_marks.load(Ordering::Relaxed)
    }

    /// Changes when heartbeats find the endpoint suspect or declare it gone, after this call.
    pub fn gone_signal(&self) -> watch::Receiver<u64> {
        self.gone.subscribe()
    }

    /// Whether the endpoint is in the set at all (not draining).
    pub fn is_available(&self) -> bool {
        !self.draining.load(Ordering::Relaxed)
    }

    pub fn set_draining(&self, draining: bool) {
        let _breaker = self.lock_breaker();
        self.draining.store(draining, Ordering::Relaxed);
        self.recount();
    }
}

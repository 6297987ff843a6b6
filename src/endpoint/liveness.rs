//! Heartbeats' verdicts: healthy or not, suspect after a failed heartbeat, draining once discovery
//! removed the endpoint or once the node announced its end, and the signal waiting attempts listen to.

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

    /// What `by` says of the node's end now: `Some` while it says the node is going, with the time it
    /// has left when it says; `None` once it no longer says so (a heartbeat answer without
    /// `x-tongs-drain`). While anyone says so the endpoint drains: no new request, those in flight
    /// finish, its failures count against nothing (see [`super::BreakerControl`]), and its streams
    /// that can be continued elsewhere move before it goes (see `proxy::stream`). Returns whether
    /// draining changed.
    pub fn set_announced(
        &self,
        by: Announcer,
        notice: Option<Option<Duration>>,
        now: Instant,
    ) -> bool {
        let leaving_at = match notice {
            Some(Some(left)) => super::millis(now + left).max(1),
            _ => 0,
        };
        let was_leaving_at =
            self.notices.leaving_at_ms[by as usize].swap(leaving_at, Ordering::Relaxed);
        let changed = {
            let _breaker = self.circuit.lock();
            self.notices.going[by as usize].store(notice.is_some(), Ordering::Relaxed);
            let announced = self.notices.is_going();
            let changed = self.liveness.announced.swap(announced, Ordering::Relaxed) != announced;
            if changed {
                self.recount();
            }
            changed
        };
        // Streams that can move read when again (see `proxy::stream`); a time said again, a little
        // later and that much shorter, is the same time.
        if changed || was_leaving_at.abs_diff(leaving_at) > 1000 {
            self.gone.send_modify(|generation| *generation += 1);
        }
        if !changed {
            return false;
        }
        if self.liveness.is_announced() {
            tracing::info!(
                endpoint = self.url(),
                by = by.as_str(),
                left_s = notice.flatten().map(|left| left.as_secs_f64()),
                outstanding = self.outstanding(),
                "the node's end was announced; draining"
            );
        } else {
            tracing::info!(
                endpoint = self.url(),
                "the node's drain notice was withdrawn"
            );
        }
        true
    }

    /// What was said of the node's end.
    pub fn notices(&self) -> &Notices {
        &self.notices
    }

    /// Discovery removed the endpoint (`true`): it drains.
    pub fn set_draining(&self, draining: bool) {
        let _breaker = self.circuit.lock();
        self.liveness.draining.store(draining, Ordering::Relaxed);
        self.recount();
    }
}

/// Whether an endpoint takes new requests, as heartbeats and its source say. Read by every pick.
#[derive(Debug)]
pub struct Liveness {
    /// A draining endpoint takes no new requests; in-flight ones finish. Set when discovery removed it.
    pub(super) draining: AtomicBool,
    /// Someone said the node is going (see [`Endpoint::set_announced`]): it drains too.
    pub(super) announced: AtomicBool,
    /// Heartbeats' verdict (true until heartbeats say otherwise).
    pub(super) healthy: AtomicBool,
    /// The last heartbeat of a healthy endpoint failed: no new requests until the verdict.
    pub(super) suspect: AtomicBool,
}

impl Default for Liveness {
    fn default() -> Liveness {
        Liveness {
            draining: AtomicBool::new(false),
            announced: AtomicBool::new(false),
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

    /// Discovery removed it from the set: only what is still on it keeps it.
    pub fn is_removed(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether the endpoint takes new requests at all: not draining, neither removed by discovery nor
    /// announced by its node.
    pub fn is_available(&self) -> bool {
        !self.draining.load(Ordering::Relaxed) && !self.announced.load(Ordering::Relaxed)
    }

    /// The node said it is going (its failures count against nothing while it does).
    pub fn is_announced(&self) -> bool {
        self.announced.load(Ordering::Relaxed)
    }
}

/// Who may say that an endpoint's node is going.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Announcer {
    /// The node itself, on its heartbeat answers (`x-tongs-drain`).
    Heartbeat = 0,
    /// The endpoint's source: a pod being deleted (its `deletionTimestamp`), or whose node called
    /// `POST /v1/nodes/drain`.
    Source = 1,
    /// An operator, through the admin port (`POST /endpoints/drain`): nothing says the node goes, so
    /// its streams are left to finish rather than moved.
    Operator = 2,
}

impl Announcer {
    pub fn as_str(self) -> &'static str {
        match self {
            Announcer::Heartbeat => "heartbeat",
            Announcer::Source => "source",
            Announcer::Operator => "operator",
        }
    }
}

/// What was said of an endpoint's node's end, by each [`Announcer`]: whether it is going, and when it
/// goes (ms on the [`super::millis`] clock; 0: not said).
#[derive(Debug, Default)]
pub struct Notices {
    going: [AtomicBool; 3],
    leaving_at_ms: [AtomicU64; 3],
}

impl Notices {
    /// Someone says the node is going.
    pub fn is_going(&self) -> bool {
        self.going.iter().any(|going| going.load(Ordering::Relaxed))
    }

    /// When the node goes, ms on the [`super::millis`] clock: the soonest time said by those who say
    /// it is going (`None`: nobody said when, or it is not going).
    pub fn leaving_at_ms(&self) -> Option<u64> {
        self.going
            .iter()
            .zip(&self.leaving_at_ms)
            .filter(|(going, _)| going.load(Ordering::Relaxed))
            .map(|(_, at)| at.load(Ordering::Relaxed))
            .filter(|&at| at != 0)
            .min()
    }

    /// Whether the node itself or its source said it goes (`Some`), and when (as
    /// [`Notices::leaving_at_ms`]): its streams that can be continued move before then. An operator's
    /// drain alone moves none.
    pub fn goes(&self) -> Option<Option<u64>> {
        let said = [Announcer::Heartbeat, Announcer::Source]
            .iter()
            .any(|&by| self.going[by as usize].load(Ordering::Relaxed));
        said.then(|| self.leaving_at_ms())
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

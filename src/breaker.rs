//! The per-endpoint circuit breaker: a pure state machine driven by request outcomes and heartbeats.
//!
//! closed ──N consecutive failures──► open (for base × 2^k, capped, jittered; k = recent ejections)
//! open ──ejection time over──► half-open: exactly one probe request is admitted
//! half-open ──probe succeeds (or a heartbeat passes)──► closed
//! half-open ──probe fails──► open again, for longer
//!
//! A gray failure — the node passes its heartbeats but its requests stall — opens it too:
//! closed ──M consecutive stalled attempts──► open, *stalled*: only a real request, the half-open probe,
//! can close it again (heartbeats pass on such a node, so neither they nor a recovery they see count).
//!
//! It never reads a clock: every call takes `now`, so tests drive it with made-up instants and the
//! endpoint drives it with tokio time. It never decides whether ejecting is allowed fleet-wide; the caller
//! asks [`Breaker::on_failure`] with `may_eject` (see `max_ejected_percent`).

use std::time::Duration;

use tokio::time::Instant;

/// Breaker settings.
#[derive(Clone, Debug, PartialEq)]
pub struct BreakerSettings {
    /// Consecutive failures that open the breaker.
    pub consecutive_failures: u32,
    /// First ejection time; doubles with each ejection that follows soon after the last.
    pub base_ejection: Duration,
    /// Longest ejection time.
    pub max_ejection: Duration,
    /// Consecutive stalled attempts (lost hedges, attempts far past the expected latency) that open
    /// the breaker as stalled.
    pub consecutive_stalls: u32,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        BreakerSettings {
            consecutive_failures: 3,
            base_ejection: Duration::from_secs(5),
            max_ejection: Duration::from_secs(60),
            consecutive_stalls: 2,
        }
    }
}

/// Where the breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probe_in_flight: bool },
}

/// What the breaker says to a request that wants this endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Go ahead.
    Admit,
    /// Go ahead as the one half-open probe; its outcome decides.
    Probe,
    /// Not now.
    Reject,
}

/// What changed, for logs and counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    Opened { for_: Duration },
    HalfOpened,
    Closed,
}

/// One endpoint's breaker.
#[derive(Clone, Debug)]
pub struct Breaker {
    state: State,
    /// Ejections in a row (k in base × 2^k); reset once the endpoint stays closed long enough.
    ejections: u32,
    closed_at: Option<Instant>,
    /// Stalled attempts in a row since the last success.
    stalls: u32,
    /// Opened for stalling: only a real probe request closes it.
    stalled: bool,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: State::Closed { failures: 0 },
            ejections: 0,
            closed_at: None,
            stalls: 0,
            stalled: false,
        }
    }
}

impl Breaker {
    pub fn state(&self) -> State {
        self.state
    }

    /// Whether the breaker is open (or half-open) because attempts stalled while heartbeats passed.
    pub fn is_stalled(&self) -> bool {
        self.stalled
    }

    /// Asks to send a request now. Opens the half-open window when the ejection time is over.
    pub fn admit(&mut self, now: Instant) -> (Admission, Option<Transition>) {
        match self.state {
            State::Closed { .. } => (Admission::Admit, None),
            State::Open { until } if now < until => (Admission::Reject, None),
            State::Open { .. } => {
                self.state = State::HalfOpen {
                    probe_in_flight: true,
                };
                (Admission::Probe, Some(Transition::HalfOpened))
            }
            State::HalfOpen {
                probe_in_flight: true,
            } => (Admission::Reject, None),
            State::HalfOpen {
                probe_in_flight: false,
            } => {
                self.state = State::HalfOpen {
                    probe_in_flight: true,
                };
                (Admission::Probe, None)
            }
        }
    }

    /// Whether a request would be admitted now, without claiming anything.
    pub fn would_admit(&self, now: Instant) -> bool {
        match self.state {
            State::Closed { .. } => true,
            State::Open { until } => now >= until,
            State::HalfOpen { probe_in_flight } => !probe_in_flight,
        }
    }

    /// A request (or the half-open probe) succeeded.
    pub fn on_success(&mut self, now: Instant) -> Option<Transition> {
        self.stalls = 0;
        match self.state {
            State::Closed { .. } => {
                self.state = State::Closed { failures: 0 };
                None
            }
            State::HalfOpen { .. } => self.close(now),
            // A straggler from before the ejection: the endpoint answered, but the ejection stands.
            State::Open { .. } => None,
        }
    }

    /// A passing heartbeat: closes a breaker whose ejection time is over (it counts as the probe).
    pub fn on_heartbeat_success(&mut self, now: Instant) -> Option<Transition> {
        if self.stalled {
            return None;
        }
        match self.state {
            State::HalfOpen { .. } => self.close(now),
            State::Open { until } if now >= until => self.close(now),
            _ => None,
        }
    }

    /// Heartbeats saw the endpoint come back from an outage they had seen too: the failures that opened
    /// the breaker are explained and over, so it closes without waiting out the ejection time. (A node
    /// that fails requests while its health checks pass gets no such shortcut.)
    pub fn on_recovery(&mut self, now: Instant) -> Option<Transition> {
        if self.stalled {
            return None;
        }
        match self.state {
            State::Closed { .. } => None,
            State::Open { .. } | State::HalfOpen { .. } => self.close(now),
        }
    }

    /// A request failed at this endpoint. `may_eject` is false when too much of the fleet is already
    /// ejected: the failure is counted, but the breaker stays closed. `jitter` in [0, 1) spreads
    /// ejection times so endpoints that failed together do not return together.
    pub fn on_failure(
        &mut self,
        settings: &BreakerSettings,
        now: Instant,
        may_eject: bool,
        jitter: f64,
    ) -> Option<Transition> {
        match self.state {
            State::Closed { failures } => {
                let failures = failures.saturating_add(1);
                if failures >= settings.consecutive_failures && may_eject {
                    Some(self.open(settings, now, jitter))
                } else {
                    self.state = State::Closed { failures };
                    None
                }
            }
            State::HalfOpen { .. } => Some(self.open(settings, now, jitter)),
            State::Open { .. } => None,
        }
    }

    /// An attempt here stalled: it lost to a hedge, or waited far past the endpoint's expected latency,
    /// while heartbeats pass. `consecutive_stalls` in a row open the breaker as stalled; a stalled
    /// probe opens it again, for longer.
    pub fn on_stall(
        &mut self,
        settings: &BreakerSettings,
        now: Instant,
        may_eject: bool,
        jitter: f64,
    ) -> Option<Transition> {
        self.stalls = self.stalls.saturating_add(1);
        let open = match self.state {
            State::Closed { .. } => self.stalls >= settings.consecutive_stalls.max(1) && may_eject,
            State::HalfOpen { .. } => true,
            State::Open { .. } => false,
        };
        if !open {
            return None;
        }
        self.stalled = true;
        Some(self.open(settings, now, jitter))
    }

    /// The half-open probe was abandoned (e.g. the client went away): let another request probe.
    pub fn release_probe(&mut self) {
        if let State::HalfOpen {
            probe_in_flight: true,
        } = self.state
        {
            self.state = State::HalfOpen {
                probe_in_flight: false,
            };
        }
    }

    fn open(&mut self, settings: &BreakerSettings, now: Instant, jitter: f64) -> Transition {
        // Ejections close together escalate; after a quiet spell as long as the longest ejection, the
        // next one starts from the base again.
        if let Some(closed_at) = self.closed_at
            && now.saturating_duration_since(closed_at) > settings.max_ejection
        {
            self.ejections = 0;
        }
        let doubled = settings
            .base_ejection
            .saturating_mul(1u32 << self.ejections.min(16));
        let capped = doubled.min(settings.max_ejection);
        // Up to 10 % longer, never beyond the cap by more than that.
        let for_ = capped.mul_f64(1.0 + 0.1 * jitter.clamp(0.0, 1.0));
        self.ejections = self.ejections.saturating_add(1);
        self.state = State::Open { until: now + for_ };
        Transition::Opened { for_ }
    }

    fn close(&mut self, now: Instant) -> Option<Transition> {
        self.state = State::Closed { failures: 0 };
        self.stalled = false;
        self.stalls = 0;
        self.closed_at = Some(now);
        Some(Transition::Closed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> BreakerSettings {
        BreakerSettings {
            consecutive_failures: 3,
            base_ejection: Duration::from_secs(5),
            max_ejection: Duration::from_secs(30),
            consecutive_stalls: 2,
        }
    }

    fn fail(breaker: &mut Breaker, now: Instant, times: u32) -> Option<Transition> {
        let mut last = None;
        for _ in 0..times {
            last = breaker.on_failure(&settings(), now, true, 0.0);
        }
        last
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        fail(&mut breaker, now, 2);
        breaker.on_success(now); // a success in between resets the count
        assert_eq!(fail(&mut breaker, now, 2), None);
        assert_eq!(breaker.admit(now).0, Admission::Admit);
        assert_eq!(
            fail(&mut breaker, now, 1),
            Some(Transition::Opened {
                for_: Duration::from_secs(5)
            })
        );
        assert_eq!(breaker.admit(now).0, Admission::Reject);
    }

    #[test]
    fn half_open_admits_exactly_one_probe() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        fail(&mut breaker, now, 3);
        let later = now + Duration::from_secs(5);
        assert!(breaker.would_admit(later));
        assert_eq!(
            breaker.admit(later),
            (Admission::Probe, Some(Transition::HalfOpened))
        );
        assert!(!breaker.would_admit(later));
        for _ in 0..10 {
            assert_eq!(breaker.admit(later).0, Admission::Reject);
        }
        // The probe's client went away: the next request may probe instead.
        breaker.release_probe();
        assert_eq!(breaker.admit(later).0, Admission::Probe);
        assert_eq!(breaker.on_success(later), Some(Transition::Closed));
        assert_eq!(breaker.admit(later).0, Admission::Admit);
    }

    #[test]
    fn failed_probe_reopens_for_twice_as_long_up_to_the_cap() {
        let mut now = Instant::now();
        let mut breaker = Breaker::default();
        fail(&mut breaker, now, 3);
        let mut expected = Duration::from_secs(5);
        for _ in 0..5 {
            let State::Open { until } = breaker.state() else {
                panic!("not open")
            };
            assert_eq!(until - now, expected);
            now = until;
            assert_eq!(breaker.admit(now).0, Admission::Probe);
            breaker.on_failure(&settings(), now, true, 0.0);
            expected = (expected * 2).min(Duration::from_secs(30));
        }
    }

    #[test]
    fn a_quiet_spell_resets_the_escalation() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        fail(&mut breaker, now, 3);
        let t1 = now + Duration::from_secs(5);
        breaker.admit(t1);
        breaker.on_success(t1);
        // Fails again soon: escalated to 10 s.
        fail(&mut breaker, t1, 3);
        assert_eq!(
            breaker.state(),
            State::Open {
                until: t1 + Duration::from_secs(10)
            }
        );
        let t2 = t1 + Duration::from_secs(10);
        breaker.admit(t2);
        breaker.on_success(t2);
        // Fails again long after: back to the base.
        let t3 = t2 + Duration::from_secs(31);
        fail(&mut breaker, t3, 3);
        assert_eq!(
            breaker.state(),
            State::Open {
                until: t3 + Duration::from_secs(5)
            }
        );
    }

    #[test]
    fn heartbeat_closes_only_after_the_ejection_time() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        fail(&mut breaker, now, 3);
        assert_eq!(
            breaker.on_heartbeat_success(now + Duration::from_secs(1)),
            None
        );
        assert_eq!(
            breaker.on_heartbeat_success(now + Duration::from_secs(5)),
            Some(Transition::Closed)
        );
    }

    #[test]
    fn recovery_seen_by_heartbeats_closes_at_once() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        assert_eq!(breaker.on_recovery(now), None);
        fail(&mut breaker, now, 3);
        assert_eq!(
            breaker.on_recovery(now + Duration::from_secs(1)),
            Some(Transition::Closed)
        );
        assert_eq!(breaker.admit(now).0, Admission::Admit);
    }

    #[test]
    fn eject_refused_keeps_the_breaker_closed_and_jitter_lengthens() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        for _ in 0..10 {
            assert_eq!(breaker.on_failure(&settings(), now, false, 0.0), None);
        }
        assert_eq!(breaker.admit(now).0, Admission::Admit);
        let opened = breaker.on_failure(&settings(), now, true, 0.5);
        assert_eq!(
            opened,
            Some(Transition::Opened {
                for_: Duration::from_millis(5250)
            })
        );
    }

    #[test]
    fn stalls_open_it_and_only_a_real_probe_closes_it() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        assert_eq!(breaker.on_stall(&settings(), now, true, 0.0), None);
        breaker.on_success(now); // an answer in between: the node is not wedged
        assert_eq!(breaker.on_stall(&settings(), now, true, 0.0), None);
        assert_eq!(
            breaker.on_stall(&settings(), now, false, 0.0),
            None,
            "fleet cap"
        );
        assert!(matches!(
            breaker.on_stall(&settings(), now, true, 0.0),
            Some(Transition::Opened { .. })
        ));
        assert!(breaker.is_stalled());
        let later = now + Duration::from_secs(60);
        // Heartbeats pass on a stalled node: neither they nor a recovery they see close it.
        assert_eq!(breaker.on_heartbeat_success(later), None);
        assert_eq!(breaker.on_recovery(later), None);
        assert_eq!(breaker.admit(later).0, Admission::Probe);
        // A probe that stalls too opens it again, for longer.
        let Some(Transition::Opened { for_ }) = breaker.on_stall(&settings(), later, true, 0.0)
        else {
            panic!("a stalled probe reopens");
        };
        assert_eq!(for_, Duration::from_secs(10));
        let again = later + for_;
        assert_eq!(breaker.admit(again).0, Admission::Probe);
        assert_eq!(breaker.on_success(again), Some(Transition::Closed));
        assert!(!breaker.is_stalled());
    }
}

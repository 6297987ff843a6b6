//! How fast a queue hands requests to endpoints: the basis of `Retry-After` and of expected waits.

use std::time::Duration;

use tokio::time::Instant;

/// How fast the queue hands requests to endpoints while requests wait in it: an EWMA of handoffs per
/// second over buckets of one second *of waiting*, the basis of `Retry-After` and of the expected wait.
///
/// Only the time the queue holds someone counts. A queue used now and then (a few requests waiting a
/// few milliseconds while a node frees a slot) hands off a few requests a second of wall time, but
/// dozens a second of its busy time: measured over wall time, the rate would say a request joining
/// behind seven others waits half a minute, and refuse it, where it waits a fraction of a second.
/// A queue that holds requests and hands none off still counts its time: its rate falls.
#[derive(Debug)]
pub(super) struct DrainMeter {
    /// Waiting time of the current bucket before `busy_since`.
    pub(super) busy: Duration,
    /// Since when the queue holds someone (`None` while it is empty).
    pub(super) busy_since: Option<Instant>,
    pub(super) count: u32,
    pub(super) per_second: f64,
}

impl DrainMeter {
    pub(super) fn new() -> DrainMeter {
        DrainMeter {
            busy: Duration::ZERO,
            busy_since: None,
            count: 0,
            per_second: 0.0,
        }
    }

    /// The queue holds someone from `now` (again).
    pub(super) fn occupied(&mut self, now: Instant) {
        self.busy_since.get_or_insert(now);
    }

    /// The queue is empty from `now`.
    pub(super) fn emptied(&mut self, now: Instant) {
        if let Some(since) = self.busy_since.take() {
            self.busy += now.saturating_duration_since(since);
        }
    }

    /// The current bucket's waiting time up to `now`.
    fn busy_time(&self, now: Instant) -> Duration {
        self.busy
            + self
                .busy_since
                .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    fn roll(&mut self, now: Instant) {
        let elapsed = self.busy_time(now).as_secs_f64();
        if elapsed >= 1.0 {
            let rate = f64::from(self.count) / elapsed;
            // Long waits without handoffs count as several empty buckets.
            let weight = 0.5f64.powf(elapsed.min(30.0));
            self.per_second = self.per_second * weight + rate * (1.0 - weight);
            self.count = 0;
            self.busy = Duration::ZERO;
            if self.busy_since.is_some() {
                self.busy_since = Some(now);
            }
        }
    }

    pub(super) fn record(&mut self, now: Instant) {
        self.roll(now);
        self.count = self.count.saturating_add(1);
    }

    pub(super) fn rate(&mut self, now: Instant) -> f64 {
        self.roll(now);
        let partial = self.busy_time(now).as_secs_f64();
        let current = if partial > 0.2 {
            f64::from(self.count) / partial
        } else {
            0.0
        };
        self.per_second.max(current)
    }
}

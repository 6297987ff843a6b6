//! How fast a queue hands requests to endpoints: the basis of `Retry-After` and of expected waits.

use tokio::time::Instant;

/// How fast the queue hands requests to endpoints: an EWMA of handoffs per second over one-second
/// buckets, the basis of `Retry-After`.
#[derive(Debug)]
pub(super) struct DrainMeter {
    pub(super) bucket_start: Instant,
    pub(super) count: u32,
    pub(super) per_second: f64,
}

impl DrainMeter {
    fn roll(&mut self, now: Instant) {
        let elapsed = now
            .saturating_duration_since(self.bucket_start)
            .as_secs_f64();
        if elapsed >= 1.0 {
            let rate = f64::from(self.count) / elapsed;
            // Long silences count as several empty buckets.
            let weight = 0.5f64.powf(elapsed.min(30.0));
            self.per_second = self.per_second * weight + rate * (1.0 - weight);
            self.count = 0;
            self.bucket_start = now;
        }
    }

    pub(super) fn record(&mut self, now: Instant) {
        self.roll(now);
        self.count = self.count.saturating_add(1);
    }

    pub(super) fn rate(&mut self, now: Instant) -> f64 {
        self.roll(now);
        let partial = now
            .saturating_duration_since(self.bucket_start)
            .as_secs_f64();
        let current = if partial > 0.2 {
            f64::from(self.count) / partial
        } else {
            0.0
        };
        self.per_second.max(current)
    }
}

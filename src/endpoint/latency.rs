//! The endpoint's expected latency (time to first byte): a peak EWMA the balancer ranks endpoints by.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Endpoint;

impl Endpoint {
    /// Records how long the endpoint took to start answering (see `proxy::attempt` for what is measured).
    ///
    /// Peak EWMA (Finagle, linkerd): a sample above the estimate replaces it at once, so a node that slows
    /// down loses its share on its first slow answer; lower samples pull the estimate down with a weight
    /// that grows with the time since the last one (time constant `decay_ms`). Two threads observing at
    /// once may lose one sample; the next corrects it.
    pub fn observe_latency(&self, sample: Duration, now_ms: u64, decay_ms: u64) {
        let sample = (sample.as_secs_f64() * 1e6).max(1.0);
        let estimate = f64::from_bits(self.latency.load(Ordering::Relaxed));
        let elapsed = now_ms.saturating_sub(self.latency_at.load(Ordering::Relaxed)) as f64;
        let next = if estimate <= 0.0 || sample >= estimate {
            sample
        } else {
            let x = elapsed / decay_ms.max(1) as f64;
            // 1 − e^(−x), with its first-order form for the frequent tiny steps of a busy endpoint.
            let weight = if x < 0.01 { x } else { 1.0 - (-x).exp() };
            estimate + (sample - estimate) * weight
        };
        self.latency.store(next.to_bits(), Ordering::Relaxed);
        self.latency_at.store(now_ms, Ordering::Relaxed);
    }

    /// The latency estimate to rank this endpoint by, in microseconds: the fleet's (`neutral_us`) until
    /// the endpoint has answered, and drifting back to it linearly over `decay_ms` while the endpoint
    /// gets no traffic, so a node that was slow once is tried again.
    pub fn latency_estimate(&self, now_ms: u64, neutral_us: u64, decay_ms: u64) -> u64 {
        let estimate = f64::from_bits(self.latency.load(Ordering::Relaxed));
        if estimate <= 0.0 {
            return neutral_us.max(1);
        }
        let idle = now_ms.saturating_sub(self.latency_at.load(Ordering::Relaxed));
        if idle >= decay_ms {
            return neutral_us.max(1);
        }
        let drift = idle as f64 / decay_ms.max(1) as f64;
        (estimate + (neutral_us as f64 - estimate) * drift).max(1.0) as u64
    }

    /// A streamed answer from here sent a chunk `gap` after the one before: feeds the typical gap that
    /// sets a stream's idle limit. An EWMA with weight 1/16: steady enough that one slow chunk does not
    /// move it much, quick enough to follow a node that changes pace.
    pub fn observe_chunk_gap(&self, gap: Duration) {
        let sample = u64::try_from(gap.as_micros()).unwrap_or(u64::MAX).max(1);
        let old = self.chunk_gap_us.load(Ordering::Relaxed);
        let next = if old == 0 {
            sample
        } else {
            old - old / 16 + sample / 16
        };
        self.chunk_gap_us.store(next, Ordering::Relaxed);
    }

    /// The typical gap between chunks of a streamed answer from here (`None` before any was seen).
    pub fn chunk_gap(&self) -> Option<Duration> {
        match self.chunk_gap_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// When the endpoint last answered a request (ms on the [`super::millis`] clock; 0: never).
    pub fn last_answer_ms(&self) -> u64 {
        self.latency_at.load(Ordering::Relaxed)
    }

    /// The raw estimate in microseconds (0 before the first observation), for debug output.
    pub fn latency_us(&self) -> u64 {
        f64::from_bits(self.latency.load(Ordering::Relaxed)) as u64
    }
}

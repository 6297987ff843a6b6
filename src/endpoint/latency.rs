//! The endpoint's latency model (time to first byte): a peak EWMA, what answers took by the load they
//! started at, and the attempts waiting for a first byte now. The balancer ranks endpoints by it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// What an endpoint's answers took, and who waits for one now. Read by every pick, so an endpoint keeps
/// it among the fields a pick reads first.
#[derive(Debug, Default)]
pub struct LatencyModel {
    /// Peak-EWMA latency estimate, microseconds as f64 bits (0.0: nothing observed yet) ...
    latency: AtomicU64,
    /// ... and the millisecond of its last observation.
    latency_at: AtomicU64,
    /// Time to first byte by the requests in flight when an attempt started (see `latency`): an EWMA
    /// in microseconds per load bucket (0: none seen at that load).
    by_load: [AtomicU64; LOAD_BUCKETS],
    /// The same for the first bytes of streamed answers alone (see [`LatencyModel::observe_stream_start`]) ...
    streams: [AtomicU64; LOAD_BUCKETS],
    /// ... and the millisecond of each bucket's last sample ...
    streams_at: [AtomicU64; LOAD_BUCKETS],
    /// ... and whether its value is one sample's, the first there lately (see [`AtLoad::alone`]).
    streams_alone: [AtomicBool; LOAD_BUCKETS],
    /// Attempts here waiting for their first byte ...
    waiting: AtomicU64,
    /// ... and the millisecond the endpoint last went from none waiting to some ...
    waiting_since: AtomicU64,
    /// ... and the millisecond an attempt last started here (0: never).
    tried_at: AtomicU64,
}

impl LatencyModel {
    /// Records how long the endpoint took to start answering (see `proxy::attempt` for what is measured).
    ///
    /// Peak EWMA (Finagle, linkerd): a sample above the estimate replaces it at once, so a node that slows
    /// down loses its share on its first slow answer; lower samples pull the estimate down with a weight
    /// that grows with the time since the last one (time constant `decay_ms`). Two threads observing at
    /// once may lose one sample; the next corrects it.
    pub fn observe(&self, sample: Duration, now_ms: u64, decay_ms: u64) {
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
    pub fn estimate(&self, now_ms: u64, neutral_us: u64, decay_ms: u64) -> u64 {
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

    /// Records an answer's time to first byte under the load it started at: `in_flight` requests here,
    /// itself included. An EWMA per load bucket, weight 1/4: the buckets the endpoint works in follow
    /// it within a few answers. What was learnt before a spell of `decay_ms` without answers is
    /// forgotten (streamed answers' first bytes too), so a node that comes back is judged by what it
    /// does now. Call before [`LatencyModel::observe`], which marks the answer.
    pub fn observe_at_load(&self, sample: Duration, in_flight: u64, now_ms: u64, decay_ms: u64) {
        if now_ms.saturating_sub(self.latency_at.load(Ordering::Relaxed)) >= decay_ms {
            for slot in self.by_load.iter().chain(&self.streams) {
                slot.store(0, Ordering::Relaxed);
            }
        }
        let sample = micros(sample);
        let slot = &self.by_load[load_bucket(in_flight)];
        let old = slot.load(Ordering::Relaxed);
        let next = if old == 0 { sample } else { blend(old, sample) };
        slot.store(next, Ordering::Relaxed);
    }

    /// Records a streamed answer's first byte under the load it started at, as
    /// [`LatencyModel::observe_at_load`] does for every answer (call it after that one). A stream's
    /// first byte is its wait for a slot and its prompt, whatever it generates after; a whole answer's
    /// is its whole generation, and a long one says nothing of a line. This is what `balance::line`
    /// judges a node's line by.
    ///
    /// What was learnt at one load stands for [`LOAD_FRESH_MS`] without a sample there: a node kept
    /// away from a load (it was slow there once, or full) is judged there by its next answer, alone.
    /// A load's first sample lately is taken as it is, but stands only for as long as it took
    /// ([`AtLoad::held`]): one first byte late for reasons of its own (a delayed ACK, the path) keeps
    /// the node from that load for no longer than it was late. The next one there then says which it
    /// was: under half of it, and the first is forgotten (the line, if it was one, is gone); else the
    /// two are blended (weight 1/4, as every later one) and stand the whole [`LOAD_FRESH_MS`].
    ///
    /// True when the sample may let the node take more than before: the first at its load lately, or
    /// quicker there than what stood. Whoever waits for a node to take them then looks again at once
    /// rather than at the queue's next recheck.
    pub fn observe_stream_start(&self, sample: Duration, in_flight: u64, now_ms: u64) -> bool {
        let sample = micros(sample);
        let bucket = load_bucket(in_flight);
        let old = self.streams[bucket].load(Ordering::Relaxed);
        let stale =
            now_ms.saturating_sub(self.streams_at[bucket].load(Ordering::Relaxed)) >= LOAD_FRESH_MS;
        let opened = old == 0 || stale;
        let undone =
            !opened && self.streams_alone[bucket].load(Ordering::Relaxed) && sample < old / 2;
        let next = if opened || undone {
            sample
        } else {
            blend(old, sample)
        };
        self.streams[bucket].store(next, Ordering::Relaxed);
        self.streams_at[bucket].store(now_ms, Ordering::Relaxed);
        self.streams_alone[bucket].store(opened || undone, Ordering::Relaxed);
        opened || next < old
    }

    /// The time to first byte a new request here should expect (µs), with `outstanding` requests
    /// already in flight: what answers took at that load. A GPU server answers several requests at once
    /// (a batch, or a few workers), so its latency stays flat until it is full and grows beyond; a
    /// single worker's grows with every request queued. Which one a node is shows in what its answers
    /// took at each load. At a load not yet seen, the nearest lower one is extrapolated as if every
    /// request beyond queued (`× n ÷ that load`), which a node then disproves or confirms by answering;
    /// with nothing seen (or nothing for `decay_ms`), the estimate × n, the same assumption. An idle
    /// endpoint nobody tried for `decay_ms` (a new one, or one slow once and avoided since) ranks at 0:
    /// the next request finds out what it is like now.
    ///
    /// Never below the endpoint's silence: while it keeps attempts waiting and has answered none of
    /// them for longer, a node that went quiet (a wedged worker behind a live health check) ranks worse
    /// with every moment, before any hedge or stall timer judges it; its first answer ends it.
    pub fn rank_us(&self, now_ms: u64, outstanding: u64, neutral_us: u64, decay_ms: u64) -> u64 {
        let n = outstanding.saturating_add(1);
        let tried_at = self.tried_at.load(Ordering::Relaxed);
        if outstanding == 0 && (tried_at == 0 || now_ms.saturating_sub(tried_at) >= decay_ms) {
            return 0;
        }
        let fresh = now_ms.saturating_sub(self.latency_at.load(Ordering::Relaxed)) < decay_ms;
        let bucket = load_bucket(n);
        let seen = if fresh {
            (0..=bucket).rev().find_map(|b| {
                let latency = self.by_load[b].load(Ordering::Relaxed);
                (latency > 0).then(|| {
                    if b == bucket {
                        latency
                    } else {
                        latency.saturating_mul(n) / bucket_load(b)
                    }
                })
            })
        } else {
            None
        };
        let expected = seen.unwrap_or_else(|| {
            self.estimate(now_ms, neutral_us, decay_ms)
                .saturating_mul(n)
        });
        expected.max(self.silence_ms(now_ms).saturating_mul(1000))
    }

    /// Its quickest streamed first byte by load (µs; 0: none seen): what a stream's start takes when
    /// the request finds a free slot. Of the loads seen in the last [`LOAD_FRESH_MS`], and of the loads below
    /// the lowest of them however old: a node busy past its batch for a while answers at no low
    /// load, and its quick answers there still say what a free slot takes, while a node that slowed
    /// down all over shows it at its lowest load first.
    pub fn quickest_us(&self, now_ms: u64) -> u64 {
        let mut quickest = u64::MAX;
        let mut fresh_below = false;
        for bucket in 0..LOAD_BUCKETS {
            if let Some(seen) = self.at_bucket(bucket, now_ms)
                && (seen.fresh || !fresh_below)
            {
                quickest = quickest.min(seen.us);
                fresh_below |= seen.fresh;
            }
        }
        if quickest == u64::MAX { 0 } else { quickest }
    }

    /// What its streams' first bytes took when they started at `bucket`'s loads (see
    /// [`load_bucket`]); `None` when none did since the model last forgot.
    pub fn at_bucket(&self, bucket: usize, now_ms: u64) -> Option<AtLoad> {
        let us = self.streams.get(bucket)?.load(Ordering::Relaxed);
        if us == 0 {
            return None;
        }
        let since = now_ms.saturating_sub(self.streams_at[bucket].load(Ordering::Relaxed));
        let alone = self.streams_alone[bucket].load(Ordering::Relaxed);
        let stands = if alone {
            (us / 1000).min(LOAD_FRESH_MS)
        } else {
            LOAD_FRESH_MS
        };
        Some(AtLoad {
            us,
            fresh: since < LOAD_FRESH_MS,
            held: since < stands,
            alone,
        })
    }

    /// When the endpoint last answered a request (ms on the [`super::millis`] clock; 0: never).
    pub fn last_answer_ms(&self) -> u64 {
        self.latency_at.load(Ordering::Relaxed)
    }

    /// The raw estimate in microseconds (0 before the first observation), for debug output.
    pub fn estimate_us(&self) -> u64 {
        f64::from_bits(self.latency.load(Ordering::Relaxed)) as u64
    }

    /// Counts an attempt as waiting for its first byte here until the guard is dropped.
    pub fn start_waiting(&self, now: Instant) -> Waiting<'_> {
        let now_ms = super::millis(now).max(1);
        self.tried_at.store(now_ms, Ordering::Relaxed);
        if self.waiting.fetch_add(1, Ordering::Relaxed) == 0 {
            self.waiting_since.store(now_ms, Ordering::Relaxed);
        }
        Waiting { model: self }
    }

    /// Attempts here waiting for their first byte now.
    pub fn waiting_attempts(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// How long the endpoint has kept attempts waiting without answering any, in milliseconds at
    /// `now_ms` (0 while none waits): since its last answer or since attempts began to wait, whichever
    /// is later. A stream that is flowing does not count; only attempts still without a first byte do.
    pub fn silence_ms(&self, now_ms: u64) -> u64 {
        if self.waiting.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let since = self
            .waiting_since
            .load(Ordering::Relaxed)
            .max(self.last_answer_ms());
        now_ms.saturating_sub(since)
    }
}

/// An attempt waiting for its endpoint's first byte, from its start until it answered or failed.
#[derive(Debug)]
pub struct Waiting<'a> {
    model: &'a LatencyModel,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.model.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A load bucket's EWMA after one more sample: weight 1/4.
fn blend(old: u64, sample: u64) -> u64 {
    old - old / 4 + sample / 4
}

fn micros(sample: Duration) -> u64 {
    u64::try_from(sample.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// Load buckets of [`LatencyModel::observe_at_load`]: requests in flight 1, 2, 3–4, 5–8, 9–16, 17+.
pub const LOAD_BUCKETS: usize = 6;

/// How long what a node's answers took at one load stands without another sample there (ms): long
/// enough to span a few generations, short enough that a node kept from a load by a spell that
/// passed (a slow minute, a full batch) is tried there again within seconds.
pub const LOAD_FRESH_MS: u64 = 2_000;

/// What streams' first bytes took at one load bucket of a [`LatencyModel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtLoad {
    /// Their time to first byte, an EWMA in microseconds.
    pub us: u64,
    /// Whether one came in the last [`LOAD_FRESH_MS`].
    pub fresh: bool,
    /// Whether it still stands as what a request there would meet: for [`LOAD_FRESH_MS`] after the
    /// last sample, or, while it is one sample's (the first there lately), for as long as that one
    /// took.
    pub held: bool,
    /// Whether it is one sample's, the first there lately: not yet confirmed by another.
    pub alone: bool,
}

/// The load bucket of `in_flight` requests (itself included): 1, 2, 3–4, 5–8, 9–16, 17+.
pub fn load_bucket(in_flight: u64) -> usize {
    let bits = 64 - in_flight.max(1).saturating_sub(1).leading_zeros() as usize;
    bits.min(LOAD_BUCKETS - 1)
}

/// The load a bucket stands for when it is extrapolated from: its highest.
fn bucket_load(bucket: usize) -> u64 {
    1 << bucket
}

/// A bucket's lowest load: the first request that finds the endpoint holding more than the bucket
/// below.
pub fn bucket_floor(bucket: usize) -> u64 {
    if bucket == 0 {
        1
    } else {
        (1 << (bucket - 1)) + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_fall_in_power_of_two_buckets() {
        let buckets: Vec<usize> = [0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 1000]
            .into_iter()
            .map(load_bucket)
            .collect();
        assert_eq!(buckets, [0, 0, 1, 2, 2, 3, 3, 4, 4, 5, 5]);
    }
}

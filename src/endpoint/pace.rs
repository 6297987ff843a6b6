//! What a node's streams normally do, by phase, and when the node was last heard from: what tells a
//! stalled node from a stream that pauses.
//!
//! A streamed answer has two phases whose silences differ by orders of magnitude. Its *opening*, the
//! first [`OPENING_GAPS`] gaps after the first chunk, holds the wait for the first tokens when the
//! server sends something at once (a role chunk, an SSE comment) and then reads the prompt: a prefill
//! that grows with the prompt and with the node's queue. After it, the gaps between tokens. Each phase
//! is learnt apart, as a mean and a mean deviation (Jacobson's estimator, as TCP times its
//! retransmissions), so a node whose first tokens take 2 s is not judged by its 40 ms token gaps.
//!
//! A prefill grows with the prompt, so the opening is learnt with the size of the requests it was
//! timed on: a request whose body is several times the node's typical one (a long conversation, or a
//! continuation, which resends the text so far) may wait that many times longer.
//!
//! `heard_ms` is the node's pulse: the last time any of its streams sent a chunk past the one that
//! started it (not an answer's start, nor a keep-alive comment: a wedged worker behind a live HTTP
//! layer still sends those). A stream silent past its limit on a node heard from meanwhile is paused (the node
//! is serving others), not stalled.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The gaps after a stream's first chunk that make up its opening.
pub const OPENING_GAPS: u32 = 2;

/// Bytes added to both sides of a prompt-size ratio (see [`Endpoint::prompt_factor`]).
pub const PROMPT_SMOOTHING: u64 = 4096;

/// The most a long prompt stretches a node's opening limit.
pub const MAX_PROMPT_FACTOR: f64 = 16.0;

/// A learnt distribution of durations: an EWMA of the samples and of their distance from it, in
/// microseconds (0: no sample yet). Two threads observing at once may lose a sample; the next corrects
/// it.
#[derive(Debug, Default)]
struct Spread {
    mean_us: AtomicU64,
    dev_us: AtomicU64,
}

impl Spread {
    /// Adds a sample: the mean moves by 1/`mean_weight` of the difference, the deviation by 1/4.
    fn observe(&self, sample: Duration, mean_weight: u64) {
        let sample = u64::try_from(sample.as_micros()).unwrap_or(u64::MAX).max(1);
        let mean = self.mean_us.load(Ordering::Relaxed);
        if mean == 0 {
            self.mean_us.store(sample, Ordering::Relaxed);
            self.dev_us.store(sample / 2, Ordering::Relaxed);
            return;
        }
        let dev = self.dev_us.load(Ordering::Relaxed);
        let distance = sample.abs_diff(mean);
        self.mean_us.store(
            mean - mean / mean_weight + sample / mean_weight,
            Ordering::Relaxed,
        );
        self.dev_us
            .store(dev - dev / 4 + distance / 4, Ordering::Relaxed);
    }

    /// The mean and the mean deviation (`None` before any sample).
    fn get(&self) -> Option<(Duration, Duration)> {
        match self.mean_us.load(Ordering::Relaxed) {
            0 => None,
            mean => Some((
                Duration::from_micros(mean),
                Duration::from_micros(self.dev_us.load(Ordering::Relaxed)),
            )),
        }
    }
}

/// A node's pace: its streams' opening waits and token gaps, and its pulse.
#[derive(Debug, Default)]
pub struct Pace {
    /// Each stream's longest gap in its opening.
    opening: Spread,
    /// Gaps between chunks after the opening.
    gap: Spread,
    /// The request bodies the openings were timed on, bytes: an EWMA with weight 1/8 (0: none yet).
    prompt_bytes: AtomicU64,
    /// When the node last showed progress (ms on the [`super::millis`] clock; 0: never).
    heard_ms: AtomicU64,
    /// The longest gap after its opening that a stream here resumed from (µs), and when it was seen
    /// (ms): a real server pauses every stream at once now and then (0.5–0.75 s for vLLM on a busy
    /// machine), and such a pause is the node's own, not a stall. It halves every
    /// [`LONGEST_GAP_HALF_LIFE_MS`].
    longest_gap_us: AtomicU64,
    longest_gap_at_ms: AtomicU64,
}

/// How fast the longest gap a node's streams resumed from is forgotten: halved every 5 minutes.
pub const LONGEST_GAP_HALF_LIFE_MS: u64 = 5 * 60 * 1000;

/// What is learnt of one phase: how long its silences typically are, and how much they vary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Typical {
    pub mean: Duration,
    pub deviation: Duration,
}

impl Typical {
    /// How long a silence in this phase may last before it is far outside what the node does:
    /// `multiplier` × the mean, or the mean plus four deviations when the phase varies more than
    /// that covers.
    pub fn far(&self, multiplier: f64) -> Duration {
        self.mean
            .mul_f64(multiplier)
            .max(self.mean + self.deviation * 4)
    }
}

impl Pace {
    /// A stream here sent a chunk after tongs had waited `gap` for it, at place `place` (1: the first
    /// chunk after the one that started the answer). Opening gaps are kept by the stream until its
    /// opening is over (see [`Pace::observe_opening`]); later ones feed the token gap, an EWMA
    /// with weight 1/16: steady enough that one slow chunk does not move it much, quick enough to
    /// follow a node that changes pace.
    pub fn observe_chunk_gap(&self, place: u32, gap: Duration) {
        if place > OPENING_GAPS {
            self.gap.observe(gap, 16);
        }
    }

    /// A stream here, asked with a body of `prompt_bytes`, finished its opening (or ended within it)
    /// whose longest gap was `longest`: one sample of the wait for the first tokens, weight 1/8.
    pub fn observe_opening(&self, longest: Duration, prompt_bytes: u64) {
        self.opening.observe(longest, 8);
        let old = self.prompt_bytes.load(Ordering::Relaxed);
        let next = if old == 0 {
            prompt_bytes.max(1)
        } else {
            (old - old / 8 + prompt_bytes / 8).max(1)
        };
        self.prompt_bytes.store(next, Ordering::Relaxed);
    }

    /// How many times longer than the node's typical opening a request with a body of `prompt_bytes`
    /// may take to its first tokens: the ratio of the sizes (smoothed by [`PROMPT_SMOOTHING`] bytes,
    /// so small prompts all count as alike), from 1 to [`MAX_PROMPT_FACTOR`]. Before any opening was
    /// timed, against a body of [`PROMPT_SMOOTHING`].
    pub fn prompt_factor(&self, prompt_bytes: u64) -> f64 {
        let typical = match self.prompt_bytes.load(Ordering::Relaxed) {
            0 => PROMPT_SMOOTHING,
            typical => typical,
        };
        ((prompt_bytes.saturating_add(PROMPT_SMOOTHING)) as f64
            / (typical.saturating_add(PROMPT_SMOOTHING)) as f64)
            .clamp(1.0, MAX_PROMPT_FACTOR)
    }

    /// A stream here resumed after a gap of `gap` past its opening, at `now_ms`.
    pub fn observe_resumed_gap(&self, gap: Duration, now_ms: u64) {
        let gap_us = u64::try_from(gap.as_micros()).unwrap_or(u64::MAX);
        if gap_us >= u64::try_from(self.longest_gap(now_ms).as_micros()).unwrap_or(u64::MAX) {
            self.longest_gap_us.store(gap_us, Ordering::Relaxed);
            self.longest_gap_at_ms.store(now_ms, Ordering::Relaxed);
        }
    }

    /// The longest gap a stream here resumed from, as remembered at `now_ms` (halved every
    /// [`LONGEST_GAP_HALF_LIFE_MS`] since it was seen).
    pub fn longest_gap(&self, now_ms: u64) -> Duration {
        let us = self.longest_gap_us.load(Ordering::Relaxed);
        let since = now_ms.saturating_sub(self.longest_gap_at_ms.load(Ordering::Relaxed));
        let halvings = since as f64 / LONGEST_GAP_HALF_LIFE_MS as f64;
        Duration::from_micros((us as f64 * 0.5f64.powf(halvings)) as u64)
    }

    /// The node showed progress at `now_ms`: a chunk of one of its streams, past the first.
    pub fn heard(&self, now_ms: u64) {
        if self.heard_ms.load(Ordering::Relaxed) < now_ms {
            self.heard_ms.fetch_max(now_ms, Ordering::Relaxed);
        }
    }

    /// When the node last showed progress (ms on the [`super::millis`] clock; 0: never).
    pub fn heard_ms(&self) -> u64 {
        self.heard_ms.load(Ordering::Relaxed)
    }

    /// The typical gap between chunks after a stream's opening (`None` before any was seen).
    pub fn chunk_gap(&self) -> Option<Duration> {
        self.token_gap().map(|typical| typical.mean)
    }

    /// What gaps between tokens typically are here, and how much they vary.
    pub fn token_gap(&self) -> Option<Typical> {
        self.gap
            .get()
            .map(|(mean, deviation)| Typical { mean, deviation })
    }

    /// What this node's streams' openings typically take (`None` before any opening was timed).
    pub fn opening(&self) -> Option<Typical> {
        self.opening
            .get()
            .map(|(mean, deviation)| Typical { mean, deviation })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_first_sample_is_the_mean_and_later_ones_move_it_by_their_weight() {
        let spread = Spread::default();
        assert_eq!(spread.get(), None);
        spread.observe(ms(800), 8);
        assert_eq!(spread.get(), Some((ms(800), ms(400))));
        spread.observe(ms(400), 8);
        let (mean, dev) = spread.get().unwrap();
        assert_eq!(mean, ms(750), "800 - 800/8 + 400/8");
        assert_eq!(dev, ms(400), "400 - 400/4 + 400/4");
    }

    #[test]
    fn a_steady_phase_is_judged_by_its_mean_and_a_varied_one_by_its_spread() {
        let steady = Typical {
            mean: ms(600),
            deviation: ms(60),
        };
        assert_eq!(steady.far(10.0), ms(6000));
        let varied = Typical {
            mean: ms(300),
            deviation: ms(900),
        };
        assert_eq!(varied.far(3.0), ms(3900));
    }

    #[test]
    fn opening_gaps_do_not_feed_the_token_gap() {
        let endpoint = Pace::default();
        endpoint.observe_chunk_gap(1, ms(2000));
        endpoint.observe_chunk_gap(2, ms(5));
        assert_eq!(endpoint.chunk_gap(), None);
        endpoint.observe_chunk_gap(3, ms(40));
        assert_eq!(endpoint.chunk_gap(), Some(ms(40)));
        endpoint.observe_opening(ms(2000), 1000);
        assert_eq!(endpoint.opening().unwrap().mean, ms(2000));
        // A body like the ones timed waits alike; one 10 times larger and more, longer.
        assert_eq!(endpoint.prompt_factor(500), 1.0);
        let long = endpoint.prompt_factor(10 * 1000 + 4096 * 9);
        assert!((long - 10.0).abs() < 1e-9, "{long}");
        assert_eq!(endpoint.prompt_factor(u64::MAX), MAX_PROMPT_FACTOR);
        endpoint.heard(7);
        endpoint.heard(5);
        assert_eq!(endpoint.heard_ms(), 7, "the pulse never goes back");
    }

    #[test]
    fn the_longest_gap_resumed_from_is_kept_and_slowly_forgotten() {
        let pace = Pace::default();
        assert_eq!(pace.longest_gap(1000), Duration::ZERO);
        pace.observe_resumed_gap(ms(700), 1000);
        pace.observe_resumed_gap(ms(300), 2000);
        assert_eq!(pace.longest_gap(1000), ms(700));
        let later = 1000 + LONGEST_GAP_HALF_LIFE_MS;
        assert_eq!(
            pace.longest_gap(later),
            ms(350),
            "halved after its half-life"
        );
        pace.observe_resumed_gap(ms(400), later);
        assert_eq!(pace.longest_gap(later), ms(400));
    }
}

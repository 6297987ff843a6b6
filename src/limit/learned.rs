//! A node's capacity learned from what its answers took at each load, without being told
//! (`concurrency.limit: learned`).
//!
//! A GPU server answers the requests of its batch about as fast as one alone; past its batch, the
//! rest wait inside it and their time to first byte grows with the line. So the limit is read off the
//! node's own profile: what answers took, by the number of requests tongs had there when each was sent.
//!
//! - **Profile.** Per load level (1 to [`LEVELS`]), a running mean of the time to first byte, exact
//!   for the first samples, then an EWMA of weight 1/32. The first byte, not the whole answer: a long
//!   generation is not congestion. A level is judged once it has [`MIN_SAMPLES`]; one without a
//!   sample for [`FORGET_MS`] is forgotten, so a node that changed (another model, a smaller card behind
//!   the same address) is followed both ways.
//! - **Baseline.** The pooled mean of the lowest judged levels (see [`baseline`]): the node's answers
//!   within its batch.
//! - **Service.** What a request holds its slot for: the baseline plus the mean time from its first
//!   byte to its end (a running mean of weight 1/32, fed as each committed request ends). For a whole
//!   answer that is the baseline itself; for a stream it is the whole generation, which is what a
//!   request past the batch waits for, while its own first byte (the baseline) is quick.
//! - **Capacity.** At a load past the node's batch, a request waits for `load − capacity` slots to
//!   free, one every `service ÷ capacity` (Little's law, as TCP Vegas and Netflix's Vegas limit estimate
//!   a queue): its first byte comes `(load − capacity) × service ÷ capacity` after the baseline, so
//!   `load × service ÷ (service + mean − baseline)` at that level is the capacity itself, even a level
//!   or two past a large batch where the slowdown is still small; within the batch, it is the load. The
//!   estimate is what the highest level in use (sampled in the last [`FRESH_MS`]) gives: the node is
//!   most loaded there, and its answers are the latest. (Reading the wait against the baseline alone
//!   takes a stream's quick first byte for the time a slot frees in, and finds a node of 4 slots full
//!   at 1.)
//! - **Limit.** When the highest level in use is past the estimate by more than a tenth of it (and
//!   three quarters of a request: one level's noise does not make a node look full), the estimate, or
//!   one more while the level just past it has too few samples to say (an estimate a little low
//!   corrects itself); never below a level in use whose answers show no wait (within [`TOLERANCE`]
//!   of the baseline), which the node serves at once. A node's refusal (429, or 503 with
//!   Retry-After) while it held `n` of ours caps it at `n` for [`FORGET_MS`]. Otherwise one above the
//!   highest level in use, so a node that grew is tried one level further; and before any knee was
//!   ever seen, none (a node nobody loaded past its batch says nothing of it).
//! - **A level to compare with.** A node always held full shows only its slow levels, which would pass
//!   for its baseline. Unless some level at or below half the highest in use is judged, the node is
//!   held to that half for the few answers it takes to measure it.
//! - **Kept from a refusal** ([`Learned::refusals_kept`]). With no limit configured, a node that
//!   refused while busy keeps this profile from then on, to be held to its batch rather than its batch
//!   and its line: its refusal stands for tongs' hold (2 s), the profile holds it (and measures the
//!   level to compare with, half of what it held when it refused) only once the node refuses again
//!   after a refusal lapsed, and until a knee is seen a lapsed refusal leaves it unlimited.
//!
//! Pure: times come in as milliseconds, and each call returns the limit to enforce from now on.

use std::time::Duration;

/// Load levels profiled; a load beyond counts at the last.
pub const LEVELS: usize = 64;
/// Samples a level needs before it is judged.
pub const MIN_SAMPLES: u32 = 12;
/// A level without a sample for this long is forgotten.
pub const FORGET_MS: u64 = 30_000;
/// Levels sampled this recently are the ones in use.
pub const FRESH_MS: u64 = 10_000;
/// How much slower than the levels below it a level may be and still count in the baseline.
const TOLERANCE: f64 = 0.15;
/// Samples the baseline pools at most.
const BASELINE_SAMPLES: f64 = 64.0;
/// The EWMA's weight once a level has this many samples.
const SETTLED: u32 = 32;

#[derive(Clone, Copy, Debug, Default)]
struct Level {
    mean_us: f64,
    samples: u32,
    last_ms: u64,
}

/// What a profile kept because the node refused keeps of its refusals.
#[derive(Clone, Copy, Debug)]
struct Kept {
    /// How long a refusal caps the limit.
    refusal_ms: u64,
    /// What the node held when it last refused, for the level to compare with (0: none yet).
    held: u32,
    /// Spells of refusals (refusals after the last had lapsed) the node has had, counted up to 2.
    spells: u8,
}

/// The profile and what it says (see the module's doc).
#[derive(Clone, Debug)]
pub struct Learned {
    /// Empty until the first sample: an endpoint never used costs no profile.
    levels: Vec<Level>,
    /// The baseline the last judgement used (µs; 0: none yet).
    baseline_us: f64,
    /// Mean time from a request's first byte to its end (µs), and how many ends it was drawn from.
    after_first_us: f64,
    ends: u32,
    /// The capacity found last (0: no knee seen yet).
    capacity: u32,
    /// The node refused while it held this many of ours, at this time, which caps the limit for
    /// [`FORGET_MS`] (or less, when kept from a refusal).
    refused: Option<(u32, u64)>,
    /// A profile kept because the node refused (see [`Learned::refusals_kept`]); `None`: the
    /// learned limit's own.
    kept: Option<Kept>,
    /// A knee has been seen in this profile.
    knee_seen: bool,
    /// The limit in force (`None`: none).
    limit: Option<u32>,
    /// The limit is the capacity found (a knee, or a refusal), not a level explored or a probe.
    full: bool,
    min: u32,
    max: u32,
}

impl Learned {
    /// An empty profile, with the limit bounded by `min ..= max` once there is one.
    pub fn new(min: u32, max: u32) -> Learned {
        Learned {
            levels: Vec::new(),
            baseline_us: 0.0,
            after_first_us: 0.0,
            ends: 0,
            capacity: 0,
            refused: None,
            kept: None,
            knee_seen: false,
            limit: None,
            full: false,
            min: min.max(1),
            max: max.max(min.max(1)),
        }
    }

    /// A profile kept because the node refused (no limit configured, see `endpoint::load`): a
    /// refusal caps the limit for `ms` instead of [`FORGET_MS`] (what the node held stands only as
    /// long as tongs' hold would; its batch is what the profile shows), and the level to compare
    /// with is half of what the node held when it last refused, not half the limit. What it held is
    /// its batch and its line, so that half is within its batch while its line is no longer than its
    /// batch, and a node held at its batch is not held lower every [`FORGET_MS`] to measure a level
    /// it no longer works at (a node of 2 held at 1 for twelve answers loses half its throughput for
    /// that long). A line longer than the batch is then only shortened, never to below the batch.
    /// The profile holds the node (and measures that half) only from its second spell of refusals:
    /// refused once, the node is held for `ms` alone, as tongs' hold did. Until a knee is seen, a
    /// lapsed refusal leaves the node unlimited.
    pub fn refusals_kept(mut self, ms: u64) -> Learned {
        self.kept = Some(Kept {
            refusal_ms: ms.min(FORGET_MS),
            held: 0,
            spells: 0,
        });
        self
    }

    /// How long a refusal caps the limit.
    fn refusal_ms(&self) -> u64 {
        self.kept.map_or(FORGET_MS, |kept| kept.refusal_ms)
    }

    /// New bounds from a reload; the profile stays.
    pub fn set_bounds(&mut self, min: u32, max: u32) {
        self.min = min.max(1);
        self.max = max.max(self.min);
        self.limit = self.limit.map(|limit| limit.clamp(self.min, self.max));
    }

    /// The limit to enforce now (`None`: none).
    pub fn limit(&self) -> Option<u32> {
        self.limit
    }

    /// Whether the node has shown where it is full: the limit is the capacity found from a knee in its
    /// profile or its own refusal.
    pub fn is_full(&self) -> bool {
        self.full
    }

    /// The capacity learned so far (0: none).
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// The node's time to first byte within its batch, in µs (0 before one is known).
    pub fn baseline_us(&self) -> u64 {
        self.baseline_us as u64
    }

    /// A request sent while `in_flight` requests of ours (itself included) were there got its first
    /// byte after `sample`.
    pub fn on_sample(&mut self, sample: Duration, in_flight: u64, now_ms: u64) -> Option<u32> {
        if self.levels.is_empty() {
            self.levels = vec![Level::default(); LEVELS];
        }
        let index = usize::try_from(in_flight.clamp(1, LEVELS as u64)).unwrap_or(LEVELS) - 1;
        let Some(level) = self.levels.get_mut(index) else {
            return self.limit;
        };
        if now_ms.saturating_sub(level.last_ms) >= FORGET_MS {
            *level = Level::default();
        }
        let sample_us = (sample.as_secs_f64() * 1e6).max(1.0);
        level.samples = (level.samples + 1).min(SETTLED);
        level.mean_us += (sample_us - level.mean_us) / f64::from(level.samples);
        level.last_ms = now_ms;
        self.judge(now_ms);
        self.limit
    }

    /// A committed request ended `after_first` after its first byte (its stream's generation; zero
    /// for a whole answer). Judged with the next sample.
    pub fn on_end(&mut self, after_first: Duration) {
        self.ends = (self.ends + 1).min(SETTLED);
        self.after_first_us +=
            (after_first.as_secs_f64() * 1e6 - self.after_first_us) / f64::from(self.ends);
    }

    /// The node refused (429, or 503 with Retry-After) while it held `holding` other requests of
    /// ours: it takes no more than that now.
    pub fn on_back_pressure(&mut self, holding: u64, now_ms: u64) -> Option<u32> {
        let held = u32::try_from(holding).unwrap_or(u32::MAX).max(1);
        let lapsed = self
            .refused
            .is_none_or(|(_, at)| now_ms.saturating_sub(at) >= self.refusal_ms());
        self.refused = Some(match self.refused {
            Some((known, at)) if known < held && now_ms.saturating_sub(at) < self.refusal_ms() => {
                (known, now_ms)
            }
            _ => (held, now_ms),
        });
        if let Some(kept) = &mut self.kept {
            kept.held = held;
            if lapsed {
                kept.spells = kept.spells.saturating_add(1).min(2);
            }
        }
        self.judge(now_ms);
        self.limit
    }

    /// The judged levels at `now_ms`, with their loads.
    fn judged(&self, now_ms: u64) -> impl Iterator<Item = (u32, &Level)> {
        (1..).zip(self.levels.iter()).filter(move |(_, level)| {
            level.samples >= MIN_SAMPLES && now_ms.saturating_sub(level.last_ms) < FORGET_MS
        })
    }

    fn judge(&mut self, now_ms: u64) {
        let baseline = baseline(self.judged(now_ms).map(|(_, level)| level));
        self.baseline_us = if baseline.is_finite() { baseline } else { 0.0 };
        let in_use = self
            .judged(now_ms)
            .filter(|(_, level)| now_ms.saturating_sub(level.last_ms) < FRESH_MS);
        // The highest level in use says the most: the node is most loaded there, and its answers are
        // the latest.
        let service = baseline + self.after_first_us;
        let (top, estimate) = in_use.last().map_or((0, 0.0), |(load, level)| {
            let load_f = f64::from(load);
            let wait = (level.mean_us - baseline).max(0.0);
            (load, (load_f * service / (service + wait)).min(load_f))
        });
        // Never below a level in use whose answers show no wait: the node serves that many at once.
        // (One level past the batch waits for the next slot to free, a fraction of a service time
        // whose mean, from slots that free in bunches, can read as half a service: alone, it put
        // a node of 4 at 3.)
        let served = self
            .judged(now_ms)
            .filter(|(_, level)| {
                now_ms.saturating_sub(level.last_ms) < FRESH_MS
                    && level.mean_us <= baseline * (1.0 + TOLERANCE)
            })
            .last()
            .map_or(0.0, |(load, _)| f64::from(load));
        let estimate = estimate.max(served.min(f64::from(top)));
        let margin = (f64::from(top) * 0.1).max(0.75);
        let full = (top > 0 && estimate < f64::from(top) - margin).then(|| {
            let full = (estimate.round() as u32).max(1);
            let next_judged = self.judged(now_ms).any(|(load, _)| load == full + 1);
            (full, if next_judged { full } else { full + 1 })
        });
        let refused = self
            .refused
            .filter(|&(_, at)| now_ms.saturating_sub(at) < self.refusal_ms())
            .map(|(held, _)| (held, held));
        self.refused = self.refused.filter(|_| refused.is_some());
        // Kept from a refusal, the profile holds the node only from its second spell of refusals:
        // one spell is a surge (a node back from an interruption, load moved off one that left), and
        // a node refused once is held for tongs' hold alone, as before it had a profile; a node that
        // refuses spell after spell is full for good.
        let settled = self.kept.is_none_or(|kept| kept.spells >= 2);
        let full = full.filter(|_| settled);
        let capped = match (full, refused) {
            (Some(full), Some(refused)) => Some(full.min(refused)),
            (full, refused) => full.or(refused),
        };
        self.full = capped.is_some();
        self.knee_seen |= full.is_some();
        let mut limit = match capped {
            Some((capacity, limit)) => {
                self.capacity = capacity;
                Some(limit)
            }
            None if self.capacity == 0 || top as usize >= LEVELS => None,
            // Kept from a refusal that lapsed, with no knee ever seen: the node refused for a reason
            // its answers do not show (another client's load, a passing spell), and is not held.
            None if self.kept.is_some() && !self.knee_seen => None,
            None => {
                self.capacity = self.capacity.max(top);
                Some(self.capacity + 1)
            }
        };
        let reference = limit
            .unwrap_or(top)
            .max(self.kept.map_or(0, |kept| kept.held));
        let below = (reference / 2).max(1);
        // Nor is it held lower to measure before then: halving what a node takes in a surge costs
        // most.
        if settled && reference > 1 && !self.judged(now_ms).any(|(load, _)| load <= below) {
            // Never above the limit: with the level taken from a refusal, half of it may be.
            limit = Some(limit.map_or(below, |limit| limit.min(below)));
        }
        self.limit = limit.map(|limit| limit.clamp(self.min, self.max));
    }
}

/// The node's time to first byte within its batch: the pooled mean of the lowest judged levels, taken
/// from the lowest up while each is within [`TOLERANCE`] of those before it (and until
/// [`BASELINE_SAMPLES`]): more samples than one level has, none from past the knee.
fn baseline<'a>(judged: impl Iterator<Item = &'a Level>) -> f64 {
    let (mut sum, mut count) = (0.0, 0.0);
    for level in judged {
        let weight = f64::from(level.samples);
        if count > 0.0 {
            let mean = sum / count;
            if level.mean_us > mean * (1.0 + TOLERANCE) || count >= BASELINE_SAMPLES {
                break;
            }
        }
        sum += level.mean_us * weight;
        count += weight;
    }
    if count > 0.0 {
        sum / count
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node as a GPU server behaves, in synthetic milliseconds: `capacity` requests served at once,
    /// the rest waiting inside it in order; each takes a lognormal time around `service_ms` (spread
    /// 0.3). Driven by `clients` clients that each send again as soon as they have an answer, through
    /// the learned limit (beyond it they wait outside, as in tongs' queue). Returns the limit every
    /// second.
    struct Sim {
        rng: fastrand::Rng,
        capacity: usize,
        service_ms: f64,
        /// When each of the node's slots is next free.
        slots: Vec<f64>,
        /// Requests at the node: (sent, first byte, answered, in flight when sent).
        at_node: Vec<(f64, f64, f64, u64)>,
        outside: usize,
        now: f64,
        /// Streams: the first byte this long after a slot is taken, the end at the service time.
        /// `None`: whole answers, whose first byte is their end.
        prefill_ms: Option<f64>,
        /// A node that sheds load: this many wait inside it at most, and one more is refused
        /// (`None`: its line is unbounded).
        line: Option<usize>,
    }

    impl Sim {
        fn new(capacity: usize, clients: usize, seed: u64) -> Sim {
            Sim {
                rng: fastrand::Rng::with_seed(seed),
                capacity,
                service_ms: 100.0,
                slots: vec![0.0; capacity],
                at_node: Vec::new(),
                outside: clients,
                now: 0.0,
                prefill_ms: None,
                line: None,
            }
        }

        fn resize(&mut self, capacity: usize) {
            self.capacity = capacity;
            self.slots.resize(capacity, self.now);
        }

        fn service(&mut self) -> f64 {
            // Box–Muller: a standard normal from two uniforms.
            let (u, v) = (self.rng.f64().max(1e-12), self.rng.f64());
            let normal = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
            self.service_ms * (0.3 * normal - 0.045).exp()
        }

        /// Runs for `seconds`; the limit at the end of each second.
        fn run(&mut self, learned: &mut Learned, seconds: u64) -> Vec<Option<u32>> {
            let mut limits = Vec::new();
            let end = self.now + seconds as f64 * 1000.0;
            while self.now < end {
                let now = self.now;
                let mut done = Vec::new();
                self.at_node.retain(|&(sent, first, answered, in_flight)| {
                    if answered <= now {
                        done.push((sent, first, answered, in_flight));
                        false
                    } else {
                        true
                    }
                });
                for (sent, first, answered, in_flight) in done {
                    let ms = |ms: f64| Duration::from_secs_f64(ms / 1000.0);
                    // A stream's first-byte sample is fed at its end, a stream's length late,
                    // which the profile does not mind.
                    learned.on_sample(ms(first - sent), in_flight, answered as u64);
                    learned.on_end(ms(answered - first));
                    self.outside += 1;
                }
                while self.outside > 0
                    && learned
                        .limit()
                        .is_none_or(|limit| self.at_node.len() < limit as usize)
                {
                    if self
                        .line
                        .is_some_and(|line| self.at_node.len() >= self.capacity + line)
                    {
                        // Refused while it holds the rest: the client tries again a moment later.
                        learned.on_back_pressure(self.at_node.len() as u64, now as u64);
                        break;
                    }
                    self.outside -= 1;
                    let in_flight = self.at_node.len() as u64 + 1;
                    let (slot, free) = self
                        .slots
                        .iter()
                        .copied()
                        .enumerate()
                        .min_by(|a, b| a.1.total_cmp(&b.1))
                        .unwrap();
                    let started = free.max(now);
                    let answered = started + self.service();
                    // A stream holds its slot to its end, its first byte a prefill after it took
                    // the slot; a whole answer's first byte is its end.
                    let first = self
                        .prefill_ms
                        .map_or(answered, |prefill| (started + prefill).min(answered));
                    self.slots[slot] = answered;
                    self.at_node.push((now, first, answered, in_flight));
                }
                self.now += 1.0;
                if (self.now as u64).is_multiple_of(1000) {
                    limits.push(learned.limit());
                }
            }
            limits
        }
    }

    /// Within an eighth below and a third above (and one request).
    fn near(capacity: u32, limit: Option<u32>) -> bool {
        limit.is_some_and(|limit| {
            (capacity - capacity / 8..=capacity + capacity / 3 + 1).contains(&limit)
        })
    }

    /// Nodes of 16, 2 and 4 slots under three times their capacity, five seeds each (whole answers,
    /// or streams with a first byte `prefill_ms` after a slot): from the 20th second on, the limit is
    /// near the capacity nine seconds in ten.
    fn settles_near_capacity(prefill_ms: Option<f64>) {
        for capacity in [16, 2, 4] {
            for seed in 1..=5 {
                let mut sim = Sim::new(capacity as usize, 3 * capacity as usize, seed);
                sim.prefill_ms = prefill_ms;
                let mut learned = Learned::new(1, 256);
                let limits = sim.run(&mut learned, 60);
                let settled = &limits[20..];
                let off: Vec<_> = settled
                    .iter()
                    .filter(|limit| !near(capacity, **limit))
                    .collect();
                assert!(
                    off.len() <= settled.len() / 10,
                    "capacity {capacity}, seed {seed}: {limits:?}"
                );
            }
        }
    }

    #[test]
    fn the_limit_settles_near_each_nodes_capacity_from_nothing() {
        settles_near_capacity(None);
    }

    /// Streams: the first byte is quick (a prefill of a twentieth of the service) once a slot is
    /// free, and a request past the batch waits for a whole generation to end. Read against the
    /// first byte alone, that wait made a node of 4 look full at 1.
    #[test]
    fn the_limit_settles_near_capacity_on_streams_whose_first_byte_is_quick() {
        settles_near_capacity(Some(5.0));
    }

    /// A node that refuses past a line as long as its batch, with a profile kept from its first
    /// refusal (no limit configured): held near its batch (off it a tenth of the seconds at most, as
    /// the learned limit's own test asks), to its batch and its line only for a moment (a twentieth
    /// of the seconds at most), and never at half its batch to measure a level below (the level to
    /// compare with is half of what it held when it refused, its batch here).
    #[test]
    fn a_node_that_refuses_past_its_line_is_held_near_its_batch() {
        for capacity in [16, 2, 4] {
            for seed in 1..=5 {
                let mut sim = Sim::new(capacity as usize, 3 * capacity as usize, seed);
                sim.line = Some(capacity as usize);
                let mut learned = Learned::new(1, 256).refusals_kept(2_000);
                let limits = sim.run(&mut learned, 60);
                let settled = &limits[20..];
                let off = settled
                    .iter()
                    .filter(|limit| !near(capacity, **limit))
                    .count();
                assert!(
                    off <= settled.len() / 10,
                    "capacity {capacity}, seed {seed}: {limits:?}"
                );
                // Exploring a level further now and then (a node may have grown) meets its line
                // and a refusal again, for a moment.
                let lined = settled
                    .iter()
                    .filter(|limit| limit.is_none_or(|limit| limit >= 2 * capacity))
                    .count();
                assert!(
                    lined <= settled.len() / 20,
                    "held to its batch and its line: capacity {capacity}, seed {seed}: {limits:?}"
                );
                let below = settled
                    .iter()
                    .filter(|limit| limit.is_some_and(|limit| limit <= capacity / 2))
                    .count();
                assert_eq!(below, 0, "capacity {capacity}, seed {seed}: {limits:?}");
            }
        }
    }

    #[test]
    fn the_limit_follows_a_node_that_shrinks_or_grows() {
        let mut sim = Sim::new(16, 48, 7);
        let mut learned = Learned::new(1, 256);
        sim.run(&mut learned, 30);
        assert!(near(16, learned.limit()), "{:?}", learned.limit());
        sim.resize(4);
        let limits = sim.run(&mut learned, 30);
        assert!(near(4, learned.limit()), "shrunk to 4: {limits:?}");
        sim.resize(8);
        let limits = sim.run(&mut learned, 90);
        assert!(near(8, learned.limit()), "grown to 8: {limits:?}");
    }

    #[test]
    fn no_limit_until_a_knee_is_seen() {
        // A node larger than the load: answers take the same at every level reached.
        let mut sim = Sim::new(64, 12, 3);
        let mut learned = Learned::new(1, 256);
        let limits = sim.run(&mut learned, 30);
        // Held to half once, for the few answers that show the levels below are no faster.
        assert!(limits[5..].iter().all(Option::is_none), "{limits:?}");
    }

    #[test]
    fn a_refusal_while_busy_caps_the_limit_at_what_the_node_held() {
        let mut learned = Learned::new(1, 256);
        let fast = Duration::from_millis(100);
        for step in 0..20 {
            learned.on_sample(fast, 1, 1_000 + step);
            learned.on_sample(fast, 3, 1_000 + step);
        }
        assert_eq!(learned.limit(), None, "no knee seen");
        assert_eq!(learned.on_back_pressure(6, 1_100), Some(6));
        // Until forgotten, and then one level further.
        let mut now = 1_100;
        while now < 1_100 + FORGET_MS {
            learned.on_sample(fast, 1, now);
            assert_eq!(learned.on_sample(fast, 3, now), Some(6), "at {now} ms");
            now += 500;
        }
        assert_eq!(learned.on_sample(fast, 3, now), Some(7));
    }
}

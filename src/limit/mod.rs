//! Per-endpoint concurrency limits: static, adaptive, or learned (see [`learned`]).
//!
//! The adaptive limiter follows Envoy's adaptive concurrency filter (a gradient against the endpoint's
//! unloaded latency), but runs per endpoint, because the nodes of one fleet differ by an order of
//! magnitude: a consumer card serves 2 requests at once, a datacenter card 30.
//!
//! - **Unloaded latency.** First of all the limit is `min_limit` for a few samples, then every
//!   `probe_interval` it drops to half; the mean time to first byte of ten requests started at that
//!   concurrency is the endpoint's latency when nothing queues inside it.
//! - **Gradient.** Samples are averaged over windows of about two rounds of the limit. With
//!   `gradient = 1.15 × unloaded ÷ window average` clamped to 0.5 ..= 1, the limit moves by
//!   `(gradient − 1) × enforced + max(0.5, √enforced ÷ 4)`, and is enforced rounded down. A node that queues internally
//!   answers slower in proportion to the excess, so the limit settles a little above the node's real
//!   capacity (capacity 4 → 5) instead of growing until requests time out.
//! - **Back-pressure.** A 429, or 503 with Retry-After, multiplies the limit by `backoff_ratio` at once.
//! - **Demand.** A window in which no request started above half the limit does not raise it: a limit
//!   nobody tested says nothing about capacity.

use std::time::Duration;

use crate::config::{ConcurrencyConfig, LimitMode};

pub mod learned;
pub use learned::Learned;

/// What a limit is made of, as the registry applies it to every endpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LimitSettings {
    pub mode: LimitMode,
    pub initial: u32,
    pub min: u32,
    pub max: u32,
    pub probe_interval: Duration,
    pub backoff_ratio: f64,
    /// tongs replicas sharing the fleet (at least 1): fixed limits (static, and a pod's own cap) are
    /// divided among them; an adaptive limit is not (each replica learns its own).
    pub replicas: u32,
}

impl LimitSettings {
    pub fn from_config(config: &ConcurrencyConfig) -> LimitSettings {
        LimitSettings {
            mode: config.limit,
            initial: config.max_outstanding_per_endpoint,
            min: config.min_limit.max(1),
            max: config.max_limit.max(config.min_limit.max(1)),
            probe_interval: config.probe_interval.get(),
            backoff_ratio: config.backoff_ratio,
            replicas: 1,
        }
    }

    /// This replica's share of a fixed limit: `limit ÷ replicas`, rounded up (so the replicas together
    /// may exceed it by less than one request each), and at least 1 (a node nobody may use is no use).
    pub fn share(&self, limit: u64) -> u64 {
        if limit == u64::MAX {
            return limit;
        }
        limit.div_ceil(u64::from(self.replicas.max(1))).max(1)
    }

    /// No limit at all (the default).
    pub fn none() -> LimitSettings {
        LimitSettings::from_config(&ConcurrencyConfig::default())
    }
}

/// Samples a probe collects before it trusts its unloaded latency.
const PROBE_SAMPLES: u32 = 10;

/// The gradient tolerates window means this much above the unloaded latency before it reads them as
/// queueing: the unloaded figure is itself a mean of ten noisy samples, and an underestimate would
/// otherwise pin the limit far below the node's capacity.
const TOLERANCE: f64 = 1.15;

/// An adaptive limit's state. Pure: times come in as milliseconds, and every method returns the limit
/// to enforce from now on.
#[derive(Clone, Debug)]
pub struct Limiter {
    settings: LimitSettings,
    limit: f64,
    /// Mean time to first byte at low concurrency (µs); 0 until the first probe ends.
    unloaded_us: f64,
    window: Window,
    probe: Option<Probe>,
    next_probe_ms: u64,
    /// When back-pressure last cut the limit.
    last_cut_ms: Option<u64>,
}

#[derive(Clone, Debug, Default)]
struct Window {
    sum_us: f64,
    count: u32,
    /// Highest concurrency (this request included) at which a sample of the window started.
    peak_in_flight: u64,
}

#[derive(Clone, Debug)]
struct Probe {
    /// The limit to return to.
    saved: f64,
    /// Only samples started at or below this concurrency count.
    at: u64,
    sum_us: f64,
    count: u32,
}

impl Limiter {
    /// A limiter that starts by measuring the endpoint's unloaded latency.
    pub fn new(settings: LimitSettings, now_ms: u64) -> Limiter {
        let start = f64::from(settings.initial.clamp(settings.min, settings.max));
        let mut limiter = Limiter {
            settings,
            limit: start,
            unloaded_us: 0.0,
            window: Window::default(),
            probe: None,
            next_probe_ms: now_ms,
            last_cut_ms: None,
        };
        limiter.start_probe(now_ms);
        limiter
    }

    /// New settings from a reload; what was learnt stays, within the new bounds.
    pub fn set_settings(&mut self, settings: LimitSettings) {
        self.settings = settings;
        self.limit = self
            .limit
            .clamp(f64::from(settings.min), f64::from(settings.max));
    }

    /// The limit to enforce now.
    pub fn limit(&self) -> u32 {
        let limit = match &self.probe {
            Some(probe) => probe.at as f64,
            None => self.limit,
        };
        // Rounded down: the limit's fixed point sits above the capacity by design, and enforcing it
        // rounded down keeps that margin small.
        (limit.floor() as u32).clamp(self.settings.min, self.settings.max)
    }

    /// The unloaded latency the gradient compares with (µs; 0 before the first probe ended).
    pub fn unloaded_us(&self) -> u64 {
        self.unloaded_us as u64
    }

    /// A request that started when `in_flight` requests (itself included) were outstanding here got its
    /// first byte after `sample`.
    pub fn on_sample(&mut self, sample: Duration, in_flight: u64, now_ms: u64) -> u32 {
        let sample_us = (sample.as_secs_f64() * 1e6).max(1.0);
        if let Some(probe) = &mut self.probe {
            if in_flight <= probe.at {
                probe.sum_us += sample_us;
                probe.count += 1;
                if probe.count >= PROBE_SAMPLES {
                    self.unloaded_us = probe.sum_us / f64::from(probe.count);
                    self.limit = probe.saved;
                    self.probe = None;
                    self.window = Window::default();
                    let jitter = 0.9 + 0.2 * fastrand::f64();
                    let interval = self.settings.probe_interval.as_millis() as f64 * jitter;
                    self.next_probe_ms = now_ms.saturating_add(interval as u64);
                }
            }
            return self.limit();
        }
        if now_ms >= self.next_probe_ms {
            self.start_probe(now_ms);
            return self.limit();
        }
        let window = &mut self.window;
        window.sum_us += sample_us;
        window.count += 1;
        window.peak_in_flight = window.peak_in_flight.max(in_flight);
        let size = (2.0 * self.limit).ceil().max(8.0) as u32;
        if window.count >= size {
            let average = window.sum_us / f64::from(window.count);
            let tested = window.peak_in_flight as f64 * 2.0 >= self.limit;
            let gradient = (TOLERANCE * self.unloaded_us / average).clamp(0.5, 1.0);
            // The gradient describes the limit that was enforced (rounded down), so it applies to that.
            let enforced = f64::from(self.limit());
            // The gradient's correction applies to the enforced limit; the headroom accumulates in the
            // fractional part until the enforced limit moves.
            let mut next =
                self.limit + (gradient - 1.0) * enforced + (enforced.sqrt() / 4.0).max(0.5);
            if !tested {
                next = next.min(self.limit);
            }
            self.limit = next.clamp(f64::from(self.settings.min), f64::from(self.settings.max));
            self.window = Window::default();
        }
        self.limit()
    }

    /// The endpoint pushed back (429, or 503 with Retry-After). The requests in flight when it first
    /// pushed back tend to be refused together; one cut per unloaded latency (100 ms before one is
    /// known) answers that one event once, not once per request.
    ///
    /// `holding` is how many other requests the endpoint held when it refused: whatever else happens, the
    /// limit drops to that at once, since the node has just said it takes no more than it has.
    pub fn on_back_pressure(&mut self, now_ms: u64, holding: u64) -> u32 {
        let ceiling = (holding as f64).max(f64::from(self.settings.min));
        match &mut self.probe {
            Some(probe) => probe.saved = probe.saved.min(ceiling),
            None => self.limit = self.limit.min(ceiling),
        }
        let quiet_ms = if self.unloaded_us > 0.0 {
            (self.unloaded_us / 1000.0).ceil() as u64
        } else {
            100
        };
        if self
            .last_cut_ms
            .is_some_and(|last| now_ms.saturating_sub(last) < quiet_ms)
        {
            return self.limit();
        }
        self.last_cut_ms = Some(now_ms);
        let reduced = (self.limit * self.settings.backoff_ratio).max(f64::from(self.settings.min));
        match &mut self.probe {
            Some(probe) => probe.saved = reduced,
            None => self.limit = reduced,
        }
        self.window = Window::default();
        self.limit()
    }

    fn start_probe(&mut self, now_ms: u64) {
        // The first probe knows nothing of the node, so it measures at the minimum; later ones at half a
        // limit that has settled just above the node's capacity, which is below that capacity.
        let at = if self.unloaded_us > 0.0 {
            (self.limit / 2.0).floor().max(f64::from(self.settings.min)) as u64
        } else {
            u64::from(self.settings.min)
        };
        self.probe = Some(Probe {
            saved: self.limit,
            at: at.max(1),
            sum_us: 0.0,
            count: 0,
        });
        self.window = Window::default();
        self.next_probe_ms = now_ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> LimitSettings {
        LimitSettings {
            mode: LimitMode::Adaptive,
            initial: 8,
            min: 1,
            max: 256,
            probe_interval: Duration::from_secs(60),
            backoff_ratio: 0.75,
            replicas: 1,
        }
    }

    #[test]
    fn a_fixed_limit_is_shared_rounded_up_and_never_below_one() {
        let share = |limit, replicas| {
            LimitSettings {
                replicas,
                ..settings()
            }
            .share(limit)
        };
        assert_eq!(share(8, 1), 8);
        assert_eq!(share(8, 2), 4);
        assert_eq!(share(8, 3), 3);
        assert_eq!(share(2, 3), 1);
        assert_eq!(share(1, 5), 1);
        assert_eq!(share(8, 0), 8, "no count is one replica");
        assert_eq!(share(u64::MAX, 4), u64::MAX, "no limit stays none");
    }

    const DRIVE_SEED: u64 = 1;

    /// A node serving `capacity` requests at once in `service` each, queueing the rest: with `limit`
    /// requests outstanding, each waits `limit ÷ capacity` services (Little's law, saturated).
    fn latency(service_ms: f64, capacity: f64, in_flight: u64) -> Duration {
        let factor = (in_flight as f64 / capacity).max(1.0);
        Duration::from_secs_f64(service_ms * factor / 1000.0)
    }

    /// Drives the limiter as a saturated client would: every request starts at the current limit.
    /// The limiter jitters its next probe from fastrand's thread-local generator, seeded here so a
    /// drive ends at the same point of the probe cycle in every run.
    fn drive(limiter: &mut Limiter, capacity: f64, samples: usize, now_ms: &mut u64) -> u32 {
        fastrand::seed(DRIVE_SEED);
        for _ in 0..samples {
            let in_flight = u64::from(limiter.limit());
            limiter.on_sample(latency(100.0, capacity, in_flight), in_flight, *now_ms);
            *now_ms += 20;
        }
        limiter.limit()
    }

    #[test]
    fn starts_with_a_probe_at_the_minimum() {
        let limiter = Limiter::new(settings(), 0);
        assert_eq!(limiter.limit(), 1);
        assert_eq!(limiter.unloaded_us(), 0);
    }

    #[test]
    fn settles_a_little_above_the_real_capacity() {
        for capacity in [1.0, 4.0, 16.0] {
            let mut limiter = Limiter::new(settings(), 0);
            let mut now = 0;
            let limit = drive(&mut limiter, capacity, 2000, &mut now);
            assert!(
                (capacity as u32..=(capacity * 1.6).ceil() as u32 + 1).contains(&limit),
                "capacity {capacity}: limit {limit}"
            );
            assert_eq!(limiter.unloaded_us(), 100_000, "capacity {capacity}");
        }
    }

    #[test]
    fn grows_from_one_when_the_node_is_large() {
        let mut limiter = Limiter::new(
            LimitSettings {
                initial: 1,
                ..settings()
            },
            0,
        );
        let mut now = 0;
        let limit = drive(&mut limiter, 40.0, 3000, &mut now);
        // The fixed point with the tolerance: 1.15 × 40 + √47 ÷ 4 ≈ 47.
        assert!((40..=52).contains(&limit), "{limit}");
    }

    #[test]
    fn back_pressure_cuts_the_limit_at_once() {
        let mut limiter = Limiter::new(settings(), 0);
        let mut now = 0;
        let before = drive(&mut limiter, 16.0, 1000, &mut now);
        let after = limiter.on_back_pressure(now, 100);
        assert!(
            f64::from(after) <= f64::from(before) * 0.75 + 1.0,
            "{before} → {after}"
        );
        assert_eq!(
            limiter.on_back_pressure(now + 10, 100),
            after,
            "the same event (within one unloaded latency, 100 ms) cuts once"
        );
        let mut floor = limiter.clone();
        for step in 1..=50 {
            floor.on_back_pressure(now + step * 200, 100);
        }
        assert_eq!(floor.limit(), 1, "never below min_limit");
    }

    #[test]
    fn a_refusal_caps_the_limit_at_what_the_node_holds() {
        let mut limiter = Limiter::new(settings(), 0);
        let mut now = 0;
        let before = drive(&mut limiter, 16.0, 1000, &mut now);
        assert!(before > 8, "{before}");
        // Capped at the 5 held, then cut by the backoff ratio.
        assert_eq!(limiter.on_back_pressure(now, 5), 3);
        assert_eq!(
            limiter.on_back_pressure(now + 1, 2),
            2,
            "within the quiet time the cap still applies (the cut does not)"
        );
    }

    #[test]
    fn an_untested_limit_does_not_grow() {
        let mut limiter = Limiter::new(settings(), 0);
        let mut now = 0;
        // Finish the probe, then feed samples that all started alone.
        for _ in 0..PROBE_SAMPLES {
            limiter.on_sample(Duration::from_millis(100), 1, now);
            now += 10;
        }
        let start = limiter.limit();
        for _ in 0..500 {
            limiter.on_sample(Duration::from_millis(100), 1, now);
            now += 10;
        }
        assert_eq!(limiter.limit(), start);
    }

    #[test]
    fn probes_again_after_the_interval_and_restores_the_limit() {
        let mut limiter = Limiter::new(settings(), 0);
        let mut now = 0;
        let settled = drive(&mut limiter, 8.0, 1000, &mut now);
        now += 70_000;
        limiter.on_sample(Duration::from_millis(100), 1, now);
        assert!(limiter.limit() < settled, "probing at half the limit");
        for _ in 0..PROBE_SAMPLES {
            limiter.on_sample(Duration::from_millis(100), 1, now);
        }
        assert_eq!(
            limiter.limit(),
            settled,
            "the limit is back after the probe"
        );
    }

    /// One request of [`closed_loop`], from the moment the limit let it go to the node.
    struct Dispatched {
        at_us: u64,
        in_flight: u64,
    }

    /// The adaptive limit every 100 ms for `seconds`, driven the way the request path drives it: `clients`
    /// closed-loop clients (each sends its next request the moment its last one is answered) behind the
    /// enforced limit, in front of a simulated node that serves `capacity` at once, each in a lognormal
    /// `service_ms` (spread `spread`, as `tongs::sim`'s nodes), and queues the rest inside where only
    /// latency shows it. Time is synthetic (µs), advanced from event to event: no clock, no sleep.
    fn closed_loop(
        settings: LimitSettings,
        node: (usize, f64, f64),
        clients: usize,
        seconds: u64,
        seed: u64,
    ) -> Vec<u32> {
        use std::cmp::Reverse;
        use std::collections::{BinaryHeap, VecDeque};

        let (capacity, service_ms, spread) = node;
        // The limiter's own jitter comes from fastrand's thread-local generator.
        fastrand::seed(seed);
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut service = || {
            let sample =
                crate::sim::lognormal(&mut rng, Duration::from_secs_f64(service_ms / 1e3), spread);
            (sample.as_secs_f64() * 1e6).round().max(1.0) as u64
        };
        let mut limiter = Limiter::new(settings, 0);
        // Requests waiting for the limit (in tongs' queue), in order of arrival.
        let mut waiting = clients;
        let mut outstanding = 0u64;
        let mut node_busy = 0;
        let mut node_queue: VecDeque<Dispatched> = VecDeque::new();
        // Service completions: (when, sequence number), and the request each completes.
        let mut completions = BinaryHeap::new();
        let mut serving = std::collections::HashMap::new();
        let mut sequence = 0u64;
        let mut limits = Vec::new();
        let mut next_sample_us = 100_000;
        let end_us = seconds * 1_000_000;
        let mut now_us = 0u64;
        loop {
            // Whatever the limit lets go now reaches the node, which starts it or queues it inside.
            while waiting > 0 && outstanding < u64::from(limiter.limit()) {
                waiting -= 1;
                outstanding += 1;
                let request = Dispatched {
                    at_us: now_us,
                    in_flight: outstanding,
                };
                if node_busy < capacity {
                    node_busy += 1;
                    sequence += 1;
                    completions.push(Reverse((now_us + service(), sequence)));
                    serving.insert(sequence, request);
                } else {
                    node_queue.push_back(request);
                }
            }
            let Some(Reverse((done_us, id))) = completions.pop() else {
                unreachable!("{clients} clients keep the node busy");
            };
            while next_sample_us <= done_us.min(end_us) {
                limits.push(limiter.limit());
                next_sample_us += 100_000;
            }
            if done_us > end_us {
                return limits;
            }
            now_us = done_us;
            let request = serving.remove(&id).expect("a request in service");
            // The answer's first byte: a sample for the limiter, a free slot, and the client's next request.
            limiter.on_sample(
                Duration::from_micros(now_us - request.at_us),
                request.in_flight,
                now_us / 1000,
            );
            outstanding -= 1;
            waiting += 1;
            match node_queue.pop_front() {
                Some(next) => {
                    sequence += 1;
                    completions.push(Reverse((now_us + service(), sequence)));
                    serving.insert(sequence, next);
                }
                None => node_busy -= 1,
            }
        }
    }

    /// Moved here from the back-pressure integration test, where it sampled a live proxy for 6 s of
    /// wall-clock time: the same node (capacity 4, 50 ms ± 0.2, a queue inside), the same 24 clients, the
    /// same configuration (`limit: adaptive, max_outstanding_per_endpoint: 16`) and the same verdict over
    /// the last 2 s, for many seeds instead of one run.
    #[test]
    fn under_closed_loop_load_the_limit_settles_near_a_nodes_capacity() {
        let settings = LimitSettings::from_config(&ConcurrencyConfig {
            limit: LimitMode::Adaptive,
            max_outstanding_per_endpoint: 16,
            ..ConcurrencyConfig::default()
        });
        for seed in 0..50 {
            let limits = closed_loop(settings, (4, 50.0, 0.2), 24, 6, seed);
            assert_eq!(limits.len(), 60, "every 100 ms for 6 s");
            // Judged over the last 2 s: the limit lives between 3 and 6 (a momentary step to 7 while a
            // noisy window is averaged is tolerated once or twice, a drift is not).
            let settled = &limits[limits.len() - 20..];
            let inside = settled.iter().filter(|l| (3..=6).contains(*l)).count();
            assert!(
                inside >= 18 && settled.iter().all(|l| (2..=7).contains(l)),
                "seed {seed}: the limit settles between 3 and 6 for a node of capacity 4: {limits:?}"
            );
        }
    }
}

//! When a simulated node fails, how, and for how long: fixed schedules and seeded random ones.
//!
//! Everything here is pure (no clock, no I/O) so a seed always yields the same interruptions, which is what
//! makes a demo run or a benchmark scenario reproducible.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::HumanDuration;

/// The ways a real remote GPU node fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InterruptionKind {
    /// Node gone: in-flight connections are reset, new connects refused.
    Refuse,
    /// Node vanished silently: connections open but nothing is ever answered; in-flight requests hang.
    Blackhole,
    /// What the SaladCloud gateway answers while no instance is ready: 503 to everything, health included.
    #[serde(rename = "gateway-503")]
    Gateway503,
    /// Degraded node: service time multiplied by a factor.
    Slow,
    /// Gray failure: the node's HTTP layer lives — health answers, connections are accepted — but its
    /// worker is wedged: requests hang, and streams stall after their first chunk, until it recovers.
    Gray,
}

impl InterruptionKind {
    pub const ALL: [InterruptionKind; 5] = [
        InterruptionKind::Refuse,
        InterruptionKind::Blackhole,
        InterruptionKind::Gateway503,
        InterruptionKind::Slow,
        InterruptionKind::Gray,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            InterruptionKind::Refuse => "refuse",
            InterruptionKind::Blackhole => "blackhole",
            InterruptionKind::Gateway503 => "gateway-503",
            InterruptionKind::Slow => "slow",
            InterruptionKind::Gray => "gray",
        }
    }
}

/// What a node is doing right now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Condition {
    Up,
    Interrupted { kind: InterruptionKind, factor: f64 },
}

impl Condition {
    pub fn kind(self) -> Option<InterruptionKind> {
        match self {
            Condition::Up => None,
            Condition::Interrupted { kind, .. } => Some(kind),
        }
    }

    pub fn label(self) -> &'static str {
        self.kind().map_or("up", InterruptionKind::as_str)
    }

    pub(super) fn is(self, kind: InterruptionKind) -> bool {
        self.kind() == Some(kind)
    }

    pub(super) fn slow_factor(self) -> f64 {
        match self {
            Condition::Interrupted {
                kind: InterruptionKind::Slow,
                factor,
            } => factor,
            _ => 1.0,
        }
    }
}

/// One interruption: from `at` (after the fleet started) for `duration`, then the node recovers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Interruption {
    pub kind: InterruptionKind,
    pub at: HumanDuration,
    pub duration: HumanDuration,
    /// Service-time multiplier while `slow` (ignored by the other kinds).
    #[serde(default = "default_slow_factor")]
    pub factor: f64,
    /// The node says it goes this long before `at` (its heartbeat answers carry `x-tongs-drain`, as a
    /// node told to stop says it), as [`Node::announce_end`](super::Node::announce_end) does. None:
    /// it goes without a word.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notice: Option<HumanDuration>,
}

pub fn default_slow_factor() -> f64 {
    5.0
}

/// Random interruptions: exponential gaps and durations around the given means, kinds drawn uniformly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomInterruptions {
    pub mean_interval: HumanDuration,
    pub mean_duration: HumanDuration,
    #[serde(default = "all_kinds")]
    pub kinds: Vec<InterruptionKind>,
    #[serde(default = "default_slow_factor")]
    pub slow_factor: f64,
}

fn all_kinds() -> Vec<InterruptionKind> {
    InterruptionKind::ALL.to_vec()
}

/// Draws an exponentially distributed duration with the given mean (at least 1 ms).
fn exponential(rng: &mut fastrand::Rng, mean: Duration) -> Duration {
    // 1 - u is in (0, 1], so the logarithm is finite.
    let u = 1.0 - rng.f64();
    Duration::from_secs_f64((-u.ln() * mean.as_secs_f64()).max(0.001))
}

/// The interruptions of one node up to `horizon`: the fixed ones, then random ones in the gaps.
/// Sorted by start; never overlapping (a random one that would overlap a fixed one is dropped).
pub fn plan(
    fixed: &[Interruption],
    random: Option<&RandomInterruptions>,
    seed: u64,
    horizon: Duration,
) -> Vec<Interruption> {
    let mut planned: Vec<Interruption> = fixed.to_vec();
    if let Some(random) = random.filter(|r| !r.kinds.is_empty() && !r.mean_interval.get().is_zero())
    {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut clock = Duration::ZERO;
        loop {
            clock += exponential(&mut rng, random.mean_interval.get());
            if clock >= horizon {
                break;
            }
            let duration = exponential(&mut rng, random.mean_duration.get());
            let kind = random.kinds[rng.usize(..random.kinds.len())];
            let candidate = Interruption {
                kind,
                at: HumanDuration(clock),
                duration: HumanDuration(duration),
                factor: random.slow_factor,
                notice: None,
            };
            if !planned.iter().any(|p| overlaps(p, &candidate)) {
                planned.push(candidate);
            }
            clock += duration;
        }
    }
    planned.sort_by_key(|i| i.at);
    planned
}

fn overlaps(a: &Interruption, b: &Interruption) -> bool {
    let (a_start, a_end) = (a.at.get(), a.at.get() + a.duration.get());
    let (b_start, b_end) = (b.at.get(), b.at.get() + b.duration.get());
    a_start < b_end && b_start < a_end
}

/// Samples a service time from a lognormal distribution with the given mean and spread (the standard
/// deviation of the underlying normal, so 0 means always exactly `mean`). Inference latency is
/// right-skewed like this: most requests near the mean, a long tail of slow ones.
pub fn lognormal(rng: &mut fastrand::Rng, mean: Duration, spread: f64) -> Duration {
    if spread <= 0.0 {
        return mean;
    }
    // Box-Muller: two uniforms to one standard normal.
    let u1 = 1.0 - rng.f64();
    let u2 = rng.f64();
    let normal = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    // mu chosen so that the lognormal's mean is `mean`.
    let mu = mean.as_secs_f64().ln() - spread * spread / 2.0;
    Duration::from_secs_f64((mu + spread * normal).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random() -> RandomInterruptions {
        RandomInterruptions {
            mean_interval: HumanDuration::from_secs(10),
            mean_duration: HumanDuration::from_secs(3),
            kinds: all_kinds(),
            slow_factor: 4.0,
        }
    }

    #[test]
    fn seeds_reproduce_and_differ() {
        let horizon = Duration::from_secs(600);
        let a = plan(&[], Some(&random()), 7, horizon);
        let b = plan(&[], Some(&random()), 7, horizon);
        let c = plan(&[], Some(&random()), 8, horizon);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(
            a.len() > 20,
            "about one every 13 s over 600 s, got {}",
            a.len()
        );
        for kind in InterruptionKind::ALL {
            assert!(a.iter().any(|i| i.kind == kind), "{kind:?} never drawn");
        }
    }

    #[test]
    fn planned_interruptions_are_sorted_and_disjoint() {
        let fixed = [Interruption {
            kind: InterruptionKind::Refuse,
            at: HumanDuration::from_secs(30),
            duration: HumanDuration::from_secs(20),
            factor: 1.0,
            notice: None,
        }];
        let planned = plan(&fixed, Some(&random()), 3, Duration::from_secs(300));
        assert!(planned.contains(&fixed[0]));
        for pair in planned.windows(2) {
            assert!(pair[0].at <= pair[1].at);
            assert!(!overlaps(&pair[0], &pair[1]), "{pair:?}");
        }
        assert!(
            planned
                .iter()
                .all(|i| i.at.get() < Duration::from_secs(300))
        );
    }

    #[test]
    fn lognormal_has_the_requested_mean_and_a_tail() {
        let mut rng = fastrand::Rng::with_seed(1);
        let mean = Duration::from_millis(200);
        let samples: Vec<f64> = (0..20_000)
            .map(|_| lognormal(&mut rng, mean, 0.5).as_secs_f64())
            .collect();
        let average = samples.iter().sum::<f64>() / samples.len() as f64;
        assert!((average - 0.2).abs() < 0.01, "mean {average}");
        let max = samples.iter().cloned().fold(0.0, f64::max);
        assert!(max > 0.5, "a right tail exists: max {max}");
        assert_eq!(lognormal(&mut rng, mean, 0.0), mean);
    }
}

//! The demo's interruptions, planned before the run so that they test tongs rather than the fleet's
//! size: every fixed one is kept (each kind once), and a seeded random one only where the capacity it
//! leaves, together with every interruption already kept at that time, still serves the load with
//! [`HEADROOM`]. What is left is written into each node's fixed schedule, so the run replays exactly
//! the plan that was checked. Where the fixed ones alone leave less than the load (a higher `--rps`, a
//! smaller fleet), the summary says for how long ([`Shortfall`]): refusals there are the demo's doing.

use std::time::Duration;

use crate::sim::{FleetConfig, Interruption, InterruptionKind, NodeSpec};

/// Capacity the fleet keeps through random interruptions, as a multiple of the load: room for the
/// spread of service times, the slow GPUs' pauses and the per-node limits tongs learns.
pub const HEADROOM: f64 = 1.3;

/// Requests a second `spec` completes when it serves as many at once as it and tongs allow
/// (`per_node_limit`: a static `concurrency.max_outstanding_per_endpoint`; an adaptive limit learns
/// the node's own capacity).
pub fn node_capacity(spec: &NodeSpec, per_node_limit: Option<usize>) -> f64 {
    let at_once = spec
        .capacity
        .min(per_node_limit.unwrap_or(usize::MAX))
        .max(1) as f64;
    at_once / spec.service_time.mean.get().as_secs_f64().max(1e-3)
}

/// Each node's capacity ([`node_capacity`]) and the fleet's.
fn capacities(fleet: &FleetConfig, per_node_limit: Option<usize>) -> (Vec<f64>, f64) {
    let each: Vec<f64> = fleet
        .nodes
        .iter()
        .map(|spec| node_capacity(spec, per_node_limit))
        .collect();
    let total = each.iter().sum();
    (each, total)
}

/// The share of its node's capacity an interruption takes: all of it, or for `slow` what the factor
/// takes off.
fn lost_share(interruption: &Interruption) -> f64 {
    match interruption.kind {
        InterruptionKind::Slow => 1.0 - 1.0 / interruption.factor.max(1.0),
        _ => 1.0,
    }
}

/// One interruption of the plan, with the capacity it takes away (requests a second).
#[derive(Clone, Debug)]
struct Out {
    node: usize,
    start: Duration,
    end: Duration,
    lost: f64,
    interruption: Interruption,
}

impl Out {
    fn new(node: usize, capacity: f64, interruption: &Interruption) -> Out {
        // A node that said it goes takes no new request from then on.
        let notice = interruption.notice.map_or(Duration::ZERO, |n| n.get());
        let start = interruption.at.get().saturating_sub(notice);
        Out {
            node,
            start,
            end: interruption.at.get() + interruption.duration.get(),
            lost: capacity * lost_share(interruption),
            interruption: interruption.clone(),
        }
    }
}

/// The most capacity `kept` takes away at once during `[start, end)`: the sum only rises where an
/// interruption starts, so looking at `start` and at each start inside the span is enough.
fn most_lost(kept: &[Out], start: Duration, end: Duration) -> f64 {
    let lost_at = |t: Duration| -> f64 {
        kept.iter()
            .filter(|o| o.start <= t && t < o.end)
            .map(|o| o.lost)
            .sum()
    };
    std::iter::once(start)
        .chain(
            kept.iter()
                .map(|o| o.start)
                .filter(|&s| start < s && s < end),
        )
        .map(lost_at)
        .fold(0.0, f64::max)
}

/// Plans every node's interruptions up to `horizon` and keeps the fixed ones and those random ones
/// that leave `HEADROOM × rps` of capacity; the kept ones become each node's fixed schedule.
pub fn keep_capacity(
    fleet: &mut FleetConfig,
    horizon: Duration,
    rps: f64,
    per_node_limit: Option<usize>,
) {
    let (capacities, total) = capacities(fleet, per_node_limit);
    let planned = fleet.planned(horizon);
    let mut kept: Vec<Out> = Vec::new();
    let mut random: Vec<Out> = Vec::new();
    for (node, (spec, planned)) in fleet.nodes.iter().zip(&planned).enumerate() {
        for interruption in planned {
            let out = Out::new(node, capacities[node], interruption);
            if spec.interruptions.contains(interruption) {
                kept.push(out);
            } else {
                random.push(out);
            }
        }
    }
    random.sort_by_key(|o| (o.start, o.node));
    let spare = total - HEADROOM * rps;
    for candidate in random {
        if most_lost(&kept, candidate.start, candidate.end) + candidate.lost <= spare {
            kept.push(candidate);
        }
    }
    for (node, spec) in fleet.nodes.iter_mut().enumerate() {
        let mut mine: Vec<Interruption> = kept
            .iter()
            .filter(|o| o.node == node)
            .map(|o| o.interruption.clone())
            .collect();
        mine.sort_by_key(|i| i.at);
        spec.interruptions = mine;
        spec.random_interruptions = None;
    }
}

/// Where the planned interruptions leave the fleet less capacity than the load.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Shortfall {
    /// Seconds during which the capacity left is below the load.
    pub seconds: f64,
    /// The least capacity left at any time, requests a second.
    pub lowest_rps: f64,
    /// The fleet's whole capacity, requests a second.
    pub capacity_rps: f64,
}

/// The capacity the fleet's fixed interruptions (after [`keep_capacity`], all of them) leave over
/// time, against `rps`.
pub fn shortfall(fleet: &FleetConfig, rps: f64, per_node_limit: Option<usize>) -> Shortfall {
    let (capacities, total) = capacities(fleet, per_node_limit);
    let outs: Vec<Out> = fleet
        .nodes
        .iter()
        .enumerate()
        .flat_map(|(node, spec)| {
            let capacity = capacities[node];
            spec.interruptions
                .iter()
                .map(move |i| Out::new(node, capacity, i))
        })
        .collect();
    // The capacity left is constant between two consecutive starts or ends.
    let mut edges: Vec<Duration> = outs.iter().flat_map(|o| [o.start, o.end]).collect();
    edges.sort();
    edges.dedup();
    let mut seconds = 0.0;
    let mut lowest = total;
    for pair in edges.windows(2) {
        let left = total
            - outs
                .iter()
                .filter(|o| o.start <= pair[0] && pair[0] < o.end)
                .map(|o| o.lost)
                .sum::<f64>();
        lowest = lowest.min(left);
        if left < rps {
            seconds += (pair[1] - pair[0]).as_secs_f64();
        }
    }
    let round = |x: f64| (x * 10.0).round() / 10.0;
    Shortfall {
        seconds: round(seconds),
        lowest_rps: round(lowest),
        capacity_rps: round(total),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HumanDuration;
    use crate::sim::RandomInterruptions;

    fn node(name: &str, capacity: usize, mean_ms: u64) -> NodeSpec {
        let mut spec = NodeSpec::new(name, Duration::from_millis(mean_ms));
        spec.capacity = capacity;
        spec
    }

    fn out(kind: InterruptionKind, at_s: u64, for_s: u64) -> Interruption {
        Interruption {
            kind,
            at: HumanDuration::from_secs(at_s),
            duration: HumanDuration::from_secs(for_s),
            factor: 6.0,
            notice: None,
        }
    }

    /// Three nodes of 10 req/s each (2 at once, 200 ms); every random interruption is kept or dropped
    /// by whether the two others still serve the load.
    fn fleet(random: bool) -> FleetConfig {
        let nodes = (0..3)
            .map(|i| {
                let mut spec = node(&format!("n{i}"), 2, 200);
                if random {
                    spec.random_interruptions = Some(RandomInterruptions {
                        mean_interval: HumanDuration::from_secs(3),
                        mean_duration: HumanDuration::from_secs(2),
                        kinds: InterruptionKind::ALL.to_vec(),
                        slow_factor: 6.0,
                    });
                }
                spec
            })
            .collect();
        FleetConfig { seed: 7, nodes }
    }

    #[test]
    fn capacity_counts_what_tongs_lets_a_node_take() {
        assert_eq!(node_capacity(&node("a", 8, 100), Some(4)), 40.0);
        assert_eq!(node_capacity(&node("a", 8, 100), None), 80.0);
        assert_eq!(node_capacity(&node("b", 2, 500), Some(4)), 4.0);
    }

    #[test]
    fn random_interruptions_are_kept_only_where_the_rest_serves_the_load() {
        // 30 req/s in all; a load of 15 with headroom 1.3 needs 19.5: one node out (20 left) fits,
        // two do not (10 left), nor one out and another slow (20 - 10 × 5/6 = 11.7).
        let mut plan = fleet(true);
        keep_capacity(&mut plan, Duration::from_secs(120), 15.0, None);
        let kept: usize = plan.nodes.iter().map(|n| n.interruptions.len()).sum();
        let drawn: usize = fleet(true)
            .planned(Duration::from_secs(120))
            .iter()
            .map(Vec::len)
            .sum();
        assert!(kept > 0, "some random interruptions fit");
        assert!(
            kept < drawn,
            "some overlapping ones were dropped: kept {kept} of {drawn}"
        );
        assert!(plan.nodes.iter().all(|n| n.random_interruptions.is_none()));
        let short = shortfall(&plan, 15.0 * HEADROOM, None);
        assert_eq!(short.seconds, 0.0, "{short:?}");
        assert!((19.5..30.0).contains(&short.lowest_rps), "{short:?}");
    }

    #[test]
    fn fixed_interruptions_stay_and_their_shortfall_is_measured() {
        let mut plan = fleet(false);
        plan.nodes[0].interruptions = vec![out(InterruptionKind::Refuse, 10, 6)];
        plan.nodes[1].interruptions = vec![
            out(InterruptionKind::Blackhole, 12, 2),
            out(InterruptionKind::Slow, 20, 4),
        ];
        keep_capacity(&mut plan, Duration::from_secs(30), 25.0, None);
        assert_eq!(plan.nodes[0].interruptions.len(), 1);
        assert_eq!(plan.nodes[1].interruptions.len(), 2);
        // 12 to 14 s: two nodes out, 10 req/s left; 10 to 12 and 14 to 16 s: 20 left; 20 to 24 s:
        // 30 - 10 × 5/6.
        let short = shortfall(&plan, 25.0, None);
        assert_eq!(short.seconds, 10.0, "{short:?}");
        assert_eq!(short.lowest_rps, 10.0);
        assert_eq!(short.capacity_rps, 30.0);
        assert_eq!(shortfall(&plan, 5.0, None).seconds, 0.0);
    }
}

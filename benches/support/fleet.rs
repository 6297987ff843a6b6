//! The simulated fleets of the load benchmarks: one built from a table of nodes, its capacity and its
//! description, and waiting until it is idle between two contenders.

use std::time::Duration;

use tokio::time::Instant;
use tongs::sim::{Fleet, FleetConfig, NodeSpec, ResponseKind};

/// One node of a benchmark's fleet: name, requests served at once, mean service time in milliseconds.
pub type Node = (&'static str, usize, u64);

/// A fleet of `nodes`, every one with the same lognormal `spread` of its service time, the same line
/// of `queue` requests waiting inside it (then 503 + Retry-After) and the same kind of answer.
pub fn config(
    seed: u64,
    nodes: &[Node],
    spread: f64,
    queue: usize,
    response: ResponseKind,
) -> FleetConfig {
    FleetConfig {
        seed,
        nodes: nodes
            .iter()
            .map(|&(name, capacity, mean_ms)| {
                let mut spec = NodeSpec::new(name, Duration::from_millis(mean_ms));
                spec.service_time.spread = spread;
                spec.capacity = capacity;
                spec.queue = queue;
                spec.response = response;
                spec
            })
            .collect(),
    }
}

/// The fleet's capacity: Σ capacity ÷ mean service time, requests per second (what it completes when
/// every node serves at its capacity).
pub fn capacity(config: &FleetConfig) -> f64 {
    config
        .nodes
        .iter()
        // capacity × 10⁹ ÷ mean in ns: both exact, so the same figure as capacity × 1000 ÷ mean in ms.
        .map(|node| node.capacity as f64 * 1e9 / node.service_time.mean.get().as_nanos() as f64)
        .sum()
}

/// "a100 8×120 ms, l40s 4×250 ms": each node's name, capacity × mean service time.
pub fn describe(config: &FleetConfig) -> String {
    config
        .nodes
        .iter()
        .map(|node| {
            format!(
                "{} {}×{} ms",
                node.name,
                node.capacity,
                node.service_time.mean.get().as_millis()
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Waits until no request is left at any node (at most a minute), looking every `poll`.
pub async fn wait_idle(fleet: &Fleet, poll: Duration) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while fleet.nodes().iter().any(|node| node.stats().in_flight > 0) && Instant::now() < deadline {
        tokio::time::sleep(poll).await;
    }
}

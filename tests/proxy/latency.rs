//! Expected-latency balancing on a simulated mixed fleet: fast nodes take most of the traffic, a node that
//! turns slow loses its share and wins it back, a new endpoint is used at once.

use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use tokio::sync::Semaphore;
use tongs::registry::EndpointSpec;
use tongs::sim::{Condition, Fleet, FleetConfig, InterruptionKind, NodeSpec};

fn node(name: &str, mean_ms: u64) -> NodeSpec {
    let mut spec = NodeSpec::new(name, Duration::from_millis(mean_ms));
    spec.service_time.spread = 0.0;
    spec.capacity = 16;
    spec.queue = 64;
    spec
}

async fn fleet(nodes: Vec<NodeSpec>) -> Fleet {
    Fleet::start(&FleetConfig { seed: 5, nodes }, Duration::from_secs(3600))
        .await
        .unwrap()
}

/// Sends `count` requests through the proxy, at most `concurrency` at a time; all must succeed.
async fn load(url: &str, count: usize, concurrency: usize) {
    let gate = Arc::new(Semaphore::new(concurrency));
    let mut tasks = Vec::new();
    for _ in 0..count {
        let permit = Arc::clone(&gate).acquire_owned().await.unwrap();
        let url = url.to_owned();
        tasks.push(tokio::spawn(async move {
            let (status, body) = get(&url).await;
            drop(permit);
            assert_eq!(status, 200, "{body}");
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

fn served(fleet: &Fleet) -> Vec<u64> {
    fleet.nodes().iter().map(|n| n.stats().served).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_nodes_take_most_traffic_and_slow_ones_still_get_some() {
    let fleet = fleet(vec![
        node("fast-a", 20),
        node("fast-b", 20),
        node("slow-a", 200),
        node("slow-b", 200),
    ])
    .await;
    let proxy = start_proxy(config_with("", &fleet.urls())).await;
    load(&proxy.url("/v1/generate"), 300, 6).await;
    let counts = served(&fleet);
    let fast = counts[0] + counts[1];
    let slow = counts[2] + counts[3];
    println!("served per node: {counts:?}");
    assert_eq!(fast + slow, 300);
    assert!(fast >= 240, "fast nodes took {fast} of 300: {counts:?}");
    assert!(slow >= 1, "slow nodes are still tried: {counts:?}");

    // The same fleet by plain count: the slow nodes take about their even share.
    let fleet = self::fleet(vec![
        node("fast-a", 20),
        node("fast-b", 20),
        node("slow-a", 200),
        node("slow-b", 200),
    ])
    .await;
    let plain = start_proxy(config_with(
        "balancer: { policy: least-outstanding }\n",
        &fleet.urls(),
    ))
    .await;
    load(&plain.url("/v1/generate"), 300, 6).await;
    let counts = served(&fleet);
    println!("least-outstanding, served per node: {counts:?}");
    assert!(counts[2] + counts[3] > slow, "{counts:?}");
    proxy.stop().await;
    plain.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_turns_slow_loses_its_share_and_wins_it_back() {
    let fleet = fleet(vec![node("a", 20), node("b", 20)]).await;
    let proxy = start_proxy(config_with(
        "balancer: { latency_decay: 2s }\n",
        &fleet.urls(),
    ))
    .await;
    let url = proxy.url("/v1/generate");

    load(&url, 100, 4).await;
    let before = served(&fleet);
    assert!(
        before[0] >= 20 && before[1] >= 20,
        "both share at first: {before:?}"
    );

    fleet.nodes()[0].set_condition(Condition::Interrupted {
        kind: InterruptionKind::Slow,
        factor: 20.0,
    });
    load(&url, 100, 4).await;
    let slow_phase = served(&fleet);
    let on_slow = slow_phase[0] - before[0];
    println!("while node a was slow it served {on_slow} of 100");
    assert!(on_slow <= 15, "a slow node keeps only a trickle: {on_slow}");

    fleet.nodes()[0].set_condition(Condition::Up);
    // Idle estimates drift back to the fleet's over latency_decay; then the node earns its share again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    load(&url, 100, 4).await;
    let after = served(&fleet);
    let back = after[0] - slow_phase[0];
    println!("after recovery node a served {back} of 100");
    // Well above the trickle it got while slow (its estimate keeps converging as it serves).
    assert!(back >= 15, "recovered node wins its share back: {back}");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_endpoint_gets_traffic_at_once() {
    let fleet = fleet(vec![node("a", 20), node("b", 20), node("new", 20)]).await;
    let urls = fleet.urls();
    let proxy = start_proxy(config_with("balancer: { slow_start: 0s }\n", &urls[..2])).await;
    let url = proxy.url("/v1/generate");
    load(&url, 60, 4).await;
    assert_eq!(fleet.nodes()[2].stats().served, 0);

    let specs = urls
        .iter()
        .map(|u| EndpointSpec {
            url: u.clone(),
            parsed: tongs::config::EndpointUrl::parse(u).unwrap(),
            weight: 1,
            origin: Default::default(),
        })
        .collect();
    proxy.app_registry.replace(specs);
    load(&url, 30, 4).await;
    let fresh = fleet.nodes()[2].stats().served;
    println!("the new endpoint served {fresh} of the next 30");
    assert!(fresh >= 5, "new endpoint used at once: {fresh}");
    proxy.stop().await;
}

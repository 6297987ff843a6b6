//! Expected-latency balancing on a simulated mixed fleet: fast nodes take most of the traffic, a node that
//! turns slow loses its share and wins it back, a new endpoint is used at once.
//!
//! The simulated nodes (`tongs::sim`) stand in for GPU nodes. The proxy keeps real time (its workers run
//! runtimes of their own, and the nodes answer over real sockets), so where a test needs time to pass
//! it polls the proxy's state for the moment it has, with a deadline, instead of sleeping.

use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use tokio::sync::Semaphore;
use tongs::registry::EndpointSpec;
use tongs::sim::{Condition, Fleet, InterruptionKind, NodeSpec};

fn node(name: &str, mean_ms: u64) -> NodeSpec {
    let mut spec = NodeSpec::new(name, Duration::from_millis(mean_ms));
    spec.service_time.spread = 0.0;
    spec.capacity = 16;
    spec.queue = 64;
    spec
}

async fn fleet(nodes: Vec<NodeSpec>) -> Fleet {
    sim_fleet(5, nodes).await
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

/// Waits until the endpoint for `url` has had no answer for `idle`: polls the proxy's own latency state (no
/// request is sent meanwhile, so nothing else changes).
///
/// An estimate ranks at the fleet's latency once idle for `latency_decay`, but the first answer after
/// that replaces only `1 − e^(−idle ÷ latency_decay)` of the old estimate: twice the decay lets a node
/// that was 20× slower come back with one answer, as a node idle that long should.
async fn idle_for(proxy: &TestProxy, url: &str, idle: Duration) {
    let endpoint = proxy
        .app_registry
        .snapshot()
        .iter()
        .find(|e| e.url() == url)
        .map(Arc::clone)
        .unwrap_or_else(|| panic!("no endpoint {url}"));
    let idle_ms = idle.as_millis() as u64;
    // `latency_estimate` answers the neutral value it is given exactly when the endpoint has been idle
    // for the decay it is given (or never answered, which a node that served in this test has).
    const NEUTRAL: u64 = 7;
    eventually(
        &format!("{} idle for {idle:?}", endpoint.url()),
        idle * 3,
        || {
            let now_ms = tongs::endpoint::millis(tokio::time::Instant::now());
            endpoint.latency().estimate_us() > 0
                && endpoint.latency().estimate(now_ms, NEUTRAL, idle_ms) == NEUTRAL
        },
    )
    .await;
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
    idle_for(&proxy, &fleet.urls()[0], 2 * Duration::from_secs(2)).await;
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
    // Untried and idle, it ranks first: the very next request goes there. (What share it keeps after
    // that depends on what it answers in, which a busy machine can make anything: not asserted here.)
    load(&url, 1, 1).await;
    let fresh = fleet.nodes()[2].stats().served;
    assert_eq!(fresh, 1, "the next request went to the new endpoint");
    load(&url, 30, 4).await;
    let fresh = fleet.nodes()[2].stats().served;
    println!("the new endpoint served {fresh} of 31");
    proxy.stop().await;
}

//! Healthy nodes that pause their streams, as inference servers do, are not stalled nodes: a first
//! token that comes seconds after the role chunk (the prompt's prefill), a stream preempted mid-answer
//! while the node's other streams flow, and a continuation's own prefill keep every stream whole, with
//! no continuation sent and no node taken for stalled.
//!
//! The nodes are the simulator's (`tongs::sim`), standing in for vLLM's OpenAI server: `first_token`
//! sends the chat role chunk at once and the first token after the wait, `preemption` pauses a stream
//! once after a random token (`per_in_flight: 1` with no `chance`: every stream started beside another
//! is preempted, the first one alone never is), and the model's text tells whether a stream came whole.

use std::time::Duration;

use serde_json::json;
use tongs::config::HumanDuration;
use tongs::sim::{FirstToken, NodeSpec, Preemption};

use super::continuation::{Seen, continuations, stream};
use crate::support::*;

fn first_token(wait_ms: u64) -> FirstToken {
    FirstToken {
        wait: HumanDuration::from_millis(wait_ms),
        per_prompt_word: HumanDuration::from_millis(1),
        per_in_flight: HumanDuration::from_millis(0),
        spread: 0.0,
    }
}

/// Nodes streaming 20 tokens over 0.9 s (45 ms apart) after their first-token wait, as `tune` sets.
fn paused_nodes(count: usize, tune: impl Fn(&mut NodeSpec)) -> Vec<NodeSpec> {
    sim_nodes(count, Duration::from_secs(1), |spec| {
        spec.service_time.spread = 0.0;
        spec.tokens = 20;
        spec.capacity = 16;
        tune(spec);
    })
}

/// A chat request for `tokens` tokens counting on from `from`.
fn chat(from: u64, tokens: u64) -> serde_json::Value {
    json!({"model": "counter", "stream": true, "max_tokens": tokens,
        "messages": [{"role": "user", "content": format!("count from {from}")}]})
}

fn expected(from: u64, tokens: u64) -> String {
    (from + 1..=from + tokens)
        .map(|n| format!(" {n}"))
        .collect()
}

/// The sum over the fleet's endpoints of a per-endpoint counter.
async fn fleet_sum(proxy: &TestProxy, urls: &[String], counter: &str) -> f64 {
    let mut sum = 0.0;
    for url in urls {
        sum += sample(proxy, &format!("{counter}{{endpoint=\"{url}\"}}")).await;
    }
    sum
}

/// Nothing was taken for a stall: no continuation, no stall or failure counted, every node healthy.
async fn assert_no_stall(proxy: &TestProxy, urls: &[String]) {
    assert_eq!(
        continuations(proxy, "continued").await,
        0.0,
        "no continuation"
    );
    assert_eq!(
        sample(proxy, "tongs_streams_cut_total").await,
        0.0,
        "no stream cut"
    );
    assert_eq!(
        fleet_sum(proxy, urls, "tongs_endpoint_stalls_total").await,
        0.0
    );
    assert_eq!(
        fleet_sum(proxy, urls, "tongs_endpoint_failures_total").await,
        0.0
    );
    assert_eq!(
        fleet_sum(proxy, urls, "tongs_endpoint_ejections_total").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_token_two_seconds_after_the_role_chunk_is_not_a_stall() {
    let fleet = sim_fleet(
        21,
        paused_nodes(2, |spec| spec.first_token = Some(first_token(2000))),
    )
    .await;
    let urls = fleet.urls();
    let proxy = start_proxy(config_with("", &urls)).await;
    // Two waves of four: the first from a cold start, the second once tongs has timed the nodes'
    // first tokens; every stream sits two seconds in its prefill with its node otherwise silent.
    for wave in 0..2u64 {
        let streams = (0..4u64).map(|i| {
            let proxy = &proxy;
            let from = 1000 * (wave * 4 + i + 1);
            async move { (from, stream(proxy, true, &chat(from, 20), "", &[]).await) }
        });
        for (from, seen) in futures::future::join_all(streams).await {
            seen.assert_whole("a slow first token");
            assert_eq!(seen.text(), expected(from, 20));
        }
    }
    assert_no_stall(&proxy, &urls).await;
    proxy.stop().await;
}

/// One node that preempts, for 3 s, every stream started while another runs there (the first,
/// alone, never), and tongs in front, allowed to eject it: a stall counted would show.
async fn preempting_node(seed: u64) -> (tongs::sim::Fleet, TestProxy) {
    let fleet = sim_fleet(
        seed,
        paused_nodes(1, |spec| {
            spec.first_token = Some(first_token(100));
            spec.preemption = Some(Preemption {
                chance: 0.0,
                per_in_flight: 1.0,
                pause: HumanDuration::from_secs(3),
                spread: 0.0,
            });
        }),
    )
    .await;
    let config = config_with("breaker: { max_ejected_percent: 100 }\n", &fleet.urls());
    (fleet, start_proxy(config).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_preempted_for_three_seconds_while_its_node_serves_others_stays_whole() {
    let (fleet, proxy) = preempting_node(22).await;
    let urls = fleet.urls();
    // The first stream starts alone, so it is never preempted, and runs 7 s; the two beside it are
    // each preempted for 3 s somewhere in their 0.9 s of tokens.
    let long_body = chat(5000, 160);
    let long = stream(&proxy, true, &long_body, "", &[]);
    let preempted = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        futures::future::join(
            stream(&proxy, true, &chat(100, 20), "", &[]),
            stream(&proxy, true, &chat(200, 20), "", &[]),
        )
        .await
    };
    let (long, (first, second)) = futures::future::join(long, preempted).await;
    let check = |seen: &Seen, from, tokens| {
        seen.assert_whole("preempted beside a flowing stream");
        assert_eq!(seen.text(), expected(from, tokens));
    };
    check(&long, 5000, 160);
    check(&first, 100, 20);
    check(&second, 200, 20);
    assert_no_stall(&proxy, &urls).await;
    assert!(
        sample(&proxy, "tongs_stream_pauses_total").await >= 2.0,
        "both preempted streams were seen to pause and left alone"
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuations_prefill_is_not_taken_for_a_stall() {
    // Every node's first token takes 1.5 s, a continuation's a little longer (its prompt holds the
    // text so far).
    let fleet = sim_fleet(
        23,
        paused_nodes(3, |spec| spec.first_token = Some(first_token(1500))),
    )
    .await;
    let urls = fleet.urls();
    let proxy = start_proxy(config_with("", &urls)).await;
    // Cut after token 1005: continued once on another node, which prefills before its first token.
    let seen = stream(&proxy, true, &chat(1000, 20), "1005:reset", &[]).await;
    seen.assert_whole("continued after a reset");
    assert_eq!(seen.text(), expected(1000, 20));
    assert_eq!(
        continuations(&proxy, "continued").await,
        1.0,
        "one continuation, not two"
    );
    assert_eq!(
        fleet_sum(&proxy, &urls, "tongs_endpoint_stalls_total").await,
        0.0
    );
    proxy.stop().await;
}

/// A node slower than the rest of the fleet that has not answered yet (a smaller GPU, a longer
/// prefill; a vLLM-like server whose first chunk comes with its first token) is not taken for a
/// stalled one: its attempts may be hedged at the fleet's pace, but no stall is counted before
/// `stream.first_token_idle`, and it is never ejected for its pace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_node_slower_than_the_fleet_is_hedged_not_stalled() {
    let mut nodes = paused_nodes(2, |_| {});
    nodes[1].first_token = Some(first_token(1500));
    let fleet = sim_fleet(24, nodes).await;
    let urls = fleet.urls();
    let proxy = start_proxy(config_with(
        "breaker: { max_ejected_percent: 100 }\n",
        &urls,
    ))
    .await;
    let completion = |from: u64| {
        json!({"model": "counter", "stream": true, "max_tokens": 20,
            "prompt": format!("count from {from}")})
    };
    // Two waves, so the slow node (idle and untried, it ranks first) gets requests from a cold start.
    for wave in 0..2u64 {
        let streams = (0..4u64).map(|i| {
            let (proxy, from) = (&proxy, 100 * (wave * 4 + i + 1));
            let body = completion(from);
            async move { (from, stream(proxy, false, &body, "", &[]).await) }
        });
        for (from, seen) in futures::future::join_all(streams).await {
            seen.assert_whole("beside a slower node");
            assert_eq!(seen.text(), expected(from, 20));
        }
    }
    let slow = &urls[1];
    let stalls = sample(
        &proxy,
        &format!("tongs_endpoint_stalls_total{{endpoint=\"{slow}\"}}"),
    )
    .await;
    assert_eq!(stalls, 0.0, "the slower node counted no stall");
    assert_eq!(
        fleet_sum(&proxy, &urls, "tongs_endpoint_ejections_total").await,
        0.0
    );
    proxy.stop().await;
}

/// A stream preempted while its node served another, whose sibling then ends: the node goes quiet
/// because its other stream is done, not because it stopped, so the preempted stream is still a
/// pause, left alone until it resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_stream_that_outlives_the_streams_beside_it_stays_whole() {
    let (fleet, proxy) = preempting_node(25).await;
    let urls = fleet.urls();
    // The first stream, alone, is never preempted and ends within about a second; the one started
    // beside it pauses 3 s and is then alone on its node for two seconds or more.
    let first_body = chat(100, 20);
    let first = stream(&proxy, true, &first_body, "", &[]);
    let preempted = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        stream(&proxy, true, &chat(200, 20), "", &[]).await
    };
    let (first, preempted) = futures::future::join(first, preempted).await;
    first.assert_whole("alone");
    assert_eq!(first.text(), expected(100, 20));
    preempted.assert_whole("preempted, then alone");
    assert_eq!(preempted.text(), expected(200, 20));
    assert_no_stall(&proxy, &urls).await;
    proxy.stop().await;
}

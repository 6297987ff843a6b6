//! Routing by the model servers' own state (`signals`, `balancer.scorers`, `balancer.affinity`): a
//! node busy with load from elsewhere, saturation, a conversation kept on its node, a restarted node's
//! affinity forgotten, and today's behaviour where nodes serve no metrics.
//!
//! The nodes are the simulator's engine nodes (`tongs::sim`, `engine:`), standing in for vLLM: a batch,
//! an unbounded waiting queue, a prefix cache, and `GET /metrics` with vLLM's names. The proxy keeps
//! real time, so the tests poll with deadlines.

use std::time::Duration;

use http::{Method, Request};

use crate::support::*;
use tongs::sim::{Condition, EngineSpec, InterruptionKind, NodeSpec};

/// Signals read often, so a test need not wait for a reading.
const SIGNALS: &str = "signals: { interval: 100ms, max_age: 1s }\n";

fn engine_nodes(count: usize, mean_ms: u64, tune: impl Fn(&mut NodeSpec)) -> Vec<NodeSpec> {
    sim_nodes(count, Duration::from_millis(mean_ms), |spec| {
        spec.service_time.spread = 0.05;
        spec.capacity = 4;
        spec.engine = Some(EngineSpec {
            prefill_per_word: tongs::config::HumanDuration::from_millis(0),
            ..EngineSpec::default()
        });
        tune(spec);
    })
}

/// A chat completion with `messages`, and the node that answered it.
async fn chat(url: &str, messages: &[(&str, String)], headers: &[(&str, &str)]) -> (u16, String) {
    let messages: Vec<_> = messages
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    let body = serde_json::json!({"model": "sim", "messages": messages, "max_tokens": 4});
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(url)
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(full(body.to_string())).unwrap();
    let (parts, _) = exchange(request).await;
    let node = parts
        .headers
        .get("x-sim-node")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (parts.status.as_u16(), node)
}

/// The `signals` of the endpoint at `url`, as /debug/endpoints gives them.
async fn signals_of(proxy: &TestProxy, url: &str) -> serde_json::Value {
    endpoint_view(proxy, url).await["signals"].clone()
}

/// A completion of `prompt` sent to `url`, in a task of its own.
fn complete(url: String, prompt: String) -> tokio::task::JoinHandle<(u16, String)> {
    tokio::spawn(async move {
        let body = serde_json::json!({"model": "sim", "prompt": prompt, "max_tokens": 2});
        let request = Request::builder()
            .method(Method::POST)
            .uri(url)
            .body(full(body.to_string()))
            .unwrap();
        send(request).await
    })
}

/// What `POST /debug/pick` says of a chat body.
async fn explain(proxy: &TestProxy, messages: &[(&str, String)]) -> serde_json::Value {
    let messages: Vec<_> = messages
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    let body = serde_json::json!({"model": "sim", "messages": messages});
    let request = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{}/debug/pick", proxy.admin))
        .body(full(body.to_string()))
        .unwrap();
    let (status, text) = send(request).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn system_prompt(n: usize) -> String {
    format!("System prompt {n}: ").repeat(20)
}

/// A conversation's history after `turns` turns.
fn history(conversation: usize, turns: usize) -> Vec<(&'static str, String)> {
    let mut messages = vec![("system", system_prompt(conversation % 3))];
    for turn in 0..turns {
        messages.push((
            "user",
            format!("conversation {conversation}, question {turn}: tell me more about it"),
        ));
        if turn + 1 < turns {
            messages.push(("assistant", format!("answer {turn} of {conversation}")));
        }
    }
    messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_own_queue_is_long_gets_no_new_request_while_another_has_room() {
    let fleet = sim_fleet(1, engine_nodes(3, 1_500, |_| {})).await;
    let urls: Vec<String> = fleet.nodes().iter().map(|n| n.url()).collect();
    let proxy = start_proxy(config_with(SIGNALS, &urls)).await;
    // Another client fills node 0: its batch of 4 and 6 waiting.
    let busy = urls[0].clone();
    let others: Vec<_> = (0..10)
        .map(|i| complete(format!("{busy}/v1/completions"), format!("elsewhere {i}")))
        .collect();
    eventually_async(
        "tongs reads node 0's queue",
        Duration::from_secs(10),
        || {
            let proxy = &proxy;
            let busy = &busy;
            async move {
                let seen = signals_of(proxy, busy).await;
                seen["engine"] == "vllm"
                    && seen["fresh"] == true
                    && seen["waiting"].as_u64().unwrap_or(0) >= 5
            }
        },
    )
    .await;
    let before = fleet.nodes()[0].stats().received;
    let mut sent = Vec::new();
    for i in 0..9 {
        sent.push(complete(
            proxy.url("/v1/completions"),
            format!("through tongs {i}"),
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for task in sent {
        assert_eq!(task.await.unwrap().0, 200);
    }
    assert_eq!(
        fleet.nodes()[0].stats().received,
        before,
        "tongs sent none of its requests to the node whose own queue is long"
    );
    for task in others {
        task.await.unwrap();
    }
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_returns_to_its_node_and_conversations_spread() {
    let fleet = sim_fleet(2, engine_nodes(4, 100, |_| {})).await;
    let urls: Vec<String> = fleet.nodes().iter().map(|n| n.url()).collect();
    let proxy = start_proxy(config_with(SIGNALS, &urls)).await;
    let mut homes = std::collections::BTreeSet::new();
    for conversation in 0..8 {
        let (status, first) = chat(
            &proxy.url("/v1/chat/completions"),
            &history(conversation, 1),
            &[],
        )
        .await;
        assert_eq!(status, 200);
        for turns in 2..=4 {
            let (status, node) = chat(
                &proxy.url("/v1/chat/completions"),
                &history(conversation, turns),
                &[],
            )
            .await;
            assert_eq!(status, 200);
            assert_eq!(node, first, "conversation {conversation}, turn {turns}");
        }
        homes.insert(first);
    }
    assert!(
        homes.len() >= 2,
        "eight conversations on one node: {homes:?}"
    );
    // The nodes' own counters: the later turns found their prefixes cached.
    let (hits, queries) = fleet.nodes().iter().fold((0, 0), |(h, q), node| {
        let stats = node.stats();
        (h + stats.prefix_hits, q + stats.prefix_queries)
    });
    assert!(hits * 2 > queries, "hit rate {hits}/{queries}");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_header_keeps_requests_on_one_node() {
    let fleet = sim_fleet(3, engine_nodes(4, 100, |_| {})).await;
    let urls: Vec<String> = fleet.nodes().iter().map(|n| n.url()).collect();
    let proxy = start_proxy(config_with(SIGNALS, &urls)).await;
    for session in ["alice", "bob", "carol"] {
        let mut nodes = std::collections::BTreeSet::new();
        for i in 0..5 {
            // Unrelated prompts: only the session ties them.
            let messages = [("user", format!("{session} asks question {i}"))];
            let (status, node) = chat(
                &proxy.url("/v1/chat/completions"),
                &messages,
                &[("x-session-id", session)],
            )
            .await;
            assert_eq!(status, 200);
            nodes.insert(node);
        }
        assert_eq!(nodes.len(), 1, "session {session}: {nodes:?}");
    }
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_forgets_its_prefixes_and_its_conversation_moves_as_a_whole() {
    let fleet = sim_fleet(4, engine_nodes(4, 100, |_| {})).await;
    let urls: Vec<String> = fleet.nodes().iter().map(|n| n.url()).collect();
    let health = "health: { path: /health, interval: 100ms, fast_interval: 50ms, timeout: 300ms, \
                  unhealthy_threshold: 2, healthy_threshold: 1 }\n";
    let config = format!("{SIGNALS}{health}balancer: {{ slow_start: 0s }}\n");
    let proxy = start_proxy(config_with(&config, &urls)).await;
    let (_, home) = chat(&proxy.url("/v1/chat/completions"), &history(7, 1), &[]).await;
    let (_, again) = chat(&proxy.url("/v1/chat/completions"), &history(7, 2), &[]).await;
    assert_eq!(again, home);
    let at = fleet.nodes().iter().position(|n| n.name() == home).unwrap();
    let home_url = urls[at].clone();
    let explained = explain(&proxy, &history(7, 3)).await;
    assert_eq!(explained["pick"], home_url.as_str(), "{explained}");
    assert!(
        explained["prefix_matches"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m[0] == home_url.as_str() && m[1].as_f64().unwrap() > 0.5),
        "{explained}"
    );
    // The node goes down: its next turns move together to one other node.
    fleet.nodes()[at].set_condition(Condition::Interrupted {
        kind: InterruptionKind::Refuse,
        factor: 1.0,
    });
    eventually_async("the node is declared down", Duration::from_secs(10), || {
        let proxy = &proxy;
        let home_url = &home_url;
        async move { explain(proxy, &history(7, 3)).await["pick"] != home_url.as_str() }
    })
    .await;
    let (status, moved) = chat(&proxy.url("/v1/chat/completions"), &history(7, 3), &[]).await;
    assert_eq!(status, 200);
    assert_ne!(moved, home);
    let (_, still) = chat(&proxy.url("/v1/chat/completions"), &history(7, 4), &[]).await;
    assert_eq!(still, moved, "the conversation moved as a whole");
    // It comes back: what it held before is forgotten (its cache went with it).
    fleet.nodes()[at].set_condition(Condition::Up);
    eventually_async("the node is back", Duration::from_secs(10), || {
        let proxy = &proxy;
        let home_url = &home_url;
        async move { endpoint_view(proxy, home_url).await["state"] == "healthy" }
    })
    .await;
    let explained = explain(&proxy, &history(7, 2)).await;
    let matches = explained["prefix_matches"].as_array().unwrap();
    assert!(
        !matches.iter().any(|m| m[0] == home_url.as_str()),
        "the restarted node still credited with its old prefixes: {explained}"
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_without_metrics_have_no_signals_and_are_balanced_as_before() {
    let fleet = sim_fleet(
        5,
        engine_nodes(3, 100, |spec| {
            if let Some(engine) = spec.engine.as_mut() {
                engine.metrics = tongs::sim::MetricsFlavour::Off;
            }
        }),
    )
    .await;
    let urls: Vec<String> = fleet.nodes().iter().map(|n| n.url()).collect();
    let proxy = start_proxy(config_with(SIGNALS, &urls)).await;
    for url in &urls {
        eventually_async("tongs finds no metrics", Duration::from_secs(10), || {
            let proxy = &proxy;
            async move { signals_of(proxy, url).await["status"] == "absent" }
        })
        .await;
    }
    let sent: Vec<_> = (0..12)
        .map(|i| complete(proxy.url("/v1/completions"), format!("no metrics {i}")))
        .collect();
    for task in sent {
        assert_eq!(task.await.unwrap().0, 200);
    }
    for node in fleet.nodes() {
        assert!(
            node.stats().received >= 2,
            "{}: {:?}",
            node.name(),
            node.stats()
        );
    }
    proxy.stop().await;
}

/// Two tongs replicas in front of one fleet share nothing; a conversation's turns alternate between
/// them, as a Service spreads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_keep_a_conversation_on_one_node_and_move_it_as_a_whole() {
    let fleet = sim_fleet(6, engine_nodes(5, 100, |_| {})).await;
    let urls: Vec<String> = fleet.nodes().iter().map(|n| n.url()).collect();
    let health = "health: { path: /health, interval: 100ms, fast_interval: 50ms, timeout: 300ms, \
                  unhealthy_threshold: 2, healthy_threshold: 1 }\n";
    let config = format!("{SIGNALS}{health}balancer: {{ slow_start: 0s }}\n");
    let replicas = [
        start_proxy(config_with(&config, &urls)).await,
        start_proxy(config_with(&config, &urls)).await,
    ];
    let turn = |conversation: usize, turns: usize| {
        let url = replicas[turns % 2].url("/v1/chat/completions");
        async move { chat(&url, &history(conversation, turns), &[]).await }
    };
    let mut homes = Vec::new();
    for conversation in 0..6 {
        let (status, first) = turn(conversation, 1).await;
        assert_eq!(status, 200);
        for turns in 2..=5 {
            let (status, node) = turn(conversation, turns).await;
            assert_eq!(status, 200);
            assert_eq!(
                node,
                first,
                "conversation {conversation}, turn {turns} (replica {})",
                turns % 2
            );
        }
        homes.push(first);
    }
    // Both replicas name the same home, and say so.
    for replica in &replicas {
        let explained = explain(replica, &history(0, 6)).await;
        let at = fleet
            .nodes()
            .iter()
            .position(|n| n.name() == homes[0])
            .unwrap();
        assert_eq!(
            explained["conversation_home"],
            urls[at].as_str(),
            "{explained}"
        );
    }
    // Conversation 0's node goes: both replicas move its next turns to one and the same node.
    let at = fleet
        .nodes()
        .iter()
        .position(|n| n.name() == homes[0])
        .unwrap();
    fleet.nodes()[at].set_condition(Condition::Interrupted {
        kind: InterruptionKind::Refuse,
        factor: 1.0,
    });
    for replica in &replicas {
        eventually_async("the node is declared down", Duration::from_secs(10), || {
            let home = urls[at].as_str();
            async move { explain(replica, &history(0, 6)).await["pick"] != home }
        })
        .await;
    }
    let mut moved = std::collections::BTreeSet::new();
    for turns in 6..=9 {
        let (status, node) = turn(0, turns).await;
        assert_eq!(status, 200);
        assert_ne!(node, homes[0]);
        moved.insert(node);
    }
    assert_eq!(moved.len(), 1, "the conversation scattered: {moved:?}");
    for replica in replicas {
        replica.stop().await;
    }
}

/// A retry whose only other node is saturated by its own metrics waits for it in tongs' queue rather
/// than failing: saturation is "later", not "nowhere".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_waits_for_a_saturated_node_rather_than_failing() {
    let fleet = sim_fleet(
        7,
        engine_nodes(2, 600, |spec| {
            spec.capacity = 1;
        }),
    )
    .await;
    let urls: Vec<String> = fleet.nodes().iter().map(|n| n.url()).collect();
    // Node 0 refuses every connection; heartbeats are off, so only an attempt finds out.
    fleet.nodes()[0].set_condition(Condition::Interrupted {
        kind: InterruptionKind::Refuse,
        factor: 1.0,
    });
    let proxy = start_proxy(config_with(SIGNALS, &urls)).await;
    // Another client saturates node 1: one running, six waiting.
    let others: Vec<_> = (0..7)
        .map(|i| {
            complete(
                format!("{}/v1/completions", urls[1]),
                format!("elsewhere {i}"),
            )
        })
        .collect();
    eventually_async(
        "tongs reads node 1's queue",
        Duration::from_secs(10),
        || {
            let proxy = &proxy;
            let url = &urls[1];
            async move {
                let seen = signals_of(proxy, url).await;
                seen["fresh"] == true && seen["waiting"].as_u64().unwrap_or(0) >= 5
            }
        },
    )
    .await;
    let (status, body) = complete(proxy.url("/v1/completions"), "through tongs".into())
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        fleet.nodes()[1].stats().received >= 8,
        "{:?}",
        fleet.nodes()[1].stats()
    );
    for task in others {
        task.await.unwrap();
    }
    proxy.stop().await;
}

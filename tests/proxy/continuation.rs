//! Streams that survive their node: a streamed OpenAI completion whose node breaks after it started is
//! continued on another endpoint and spliced into the client's stream.
//!
//! The nodes are the simulator's (`tongs::sim`), standing in for vLLM's OpenAI server: its model counts
//! on from the last number of its context, one number per token, so the test knows the exact text an
//! uninterrupted node would produce. The `x-sim-cut` header (a hook of the simulator) breaks a stream
//! right after the chunk carrying a given absolute number, whichever node streams it — reset, clean
//! close before `[DONE]`, or stall — so each case cuts exactly where it says.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::support::*;
use tongs::sim::{Condition, InterruptionKind, NodeSpec};

/// Tokens of every request (the simulator's model counts from 100: " 101" ... " 110").
const TOKENS: u64 = 10;

fn openai_nodes(count: usize) -> Vec<NodeSpec> {
    sim_nodes(count, Duration::from_millis(200), |spec| {
        spec.service_time.spread = 0.0;
        spec.tokens = TOKENS as u32;
        spec.capacity = 16;
    })
}

/// What a client saw of one stream.
#[derive(Debug)]
pub(super) struct Seen {
    /// Every chunk's JSON, in order (`[DONE]` not included).
    chunks: Vec<Value>,
    dones: usize,
    /// Data after `[DONE]`, or an event that is not `data: ...`.
    stray: Vec<String>,
    /// The body ended with an error (the connection broke).
    broken: bool,
}

impl Seen {
    pub(super) fn text(&self) -> String {
        self.chunks
            .iter()
            .filter_map(|c| {
                let choice = c["choices"].get(0)?;
                choice["text"]
                    .as_str()
                    .or(choice["delta"]["content"].as_str())
                    .map(str::to_owned)
            })
            .collect()
    }

    fn finishes(&self) -> Vec<Value> {
        self.chunks
            .iter()
            .filter_map(|c| c["choices"].get(0).map(|ch| ch["finish_reason"].clone()))
            .filter(|f| !f.is_null())
            .collect()
    }

    fn usages(&self) -> Vec<Value> {
        self.chunks
            .iter()
            .map(|c| c["usage"].clone())
            .filter(|u| !u.is_null())
            .collect()
    }

    /// One well-formed stream: constant ids, one finish, one `[DONE]` at the end, nothing stray.
    pub(super) fn assert_whole(&self, what: &str) {
        assert!(!self.broken, "{what}: the stream broke: {self:?}");
        assert_eq!(self.dones, 1, "{what}: one [DONE]: {self:?}");
        assert!(self.stray.is_empty(), "{what}: {self:?}");
        let first = &self.chunks[0];
        for chunk in &self.chunks {
            for key in ["id", "created", "model"] {
                assert_eq!(chunk[key], first[key], "{what}: {key} constant: {self:?}");
            }
        }
        assert_eq!(
            self.finishes(),
            vec![json!("length")],
            "{what}: one final chunk: {self:?}"
        );
    }
}

/// The text an uninterrupted node produces for "count from 100", `TOKENS` tokens.
fn expected_text() -> String {
    (101..=100 + TOKENS).map(|n| format!(" {n}")).collect()
}

fn body(chat: bool, usage: bool) -> Value {
    let mut body = if chat {
        json!({"model": "counter", "stream": true, "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": "count from 100"}]})
    } else {
        json!({"model": "counter", "stream": true, "max_tokens": TOKENS, "prompt": "count from 100"})
    };
    if usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// Streams `body` through the proxy with `x-sim-cut: cut` (none if empty) and `extra` headers.
pub(super) async fn stream(
    proxy: &TestProxy,
    chat: bool,
    body: &Value,
    cut: &str,
    extra: &[(&str, &str)],
) -> Seen {
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let mut request = Request::post(proxy.url(path)).header("content-type", "application/json");
    if !cut.is_empty() {
        request = request.header("x-sim-cut", cut);
    }
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let request = request.body(full(Bytes::from(body.to_string()))).unwrap();
    let read = async {
        let response = client().request(request).await.expect("an answer");
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let mut raw = Vec::new();
        let mut broken = false;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => raw.extend_from_slice(frame.data_ref().map_or(&[][..], |d| d)),
                Err(_) => {
                    broken = true;
                    break;
                }
            }
        }
        (String::from_utf8(raw).unwrap(), broken)
    };
    let (raw, broken) = tokio::time::timeout(HANG, read)
        .await
        .expect("the stream ends within the test's deadline");
    let mut seen = Seen {
        chunks: Vec::new(),
        dones: 0,
        stray: Vec::new(),
        broken,
    };
    for event in raw.split("\n\n").filter(|e| !e.is_empty()) {
        match event.strip_prefix("data: ") {
            Some("[DONE]") => seen.dones += 1,
            Some(data) if seen.dones == 0 => match serde_json::from_str(data) {
                Ok(chunk) => seen.chunks.push(chunk),
                Err(_) => seen.stray.push(event.to_owned()),
            },
            _ => seen.stray.push(event.to_owned()),
        }
    }
    seen
}

pub(super) async fn continuations(proxy: &TestProxy, outcome: &str) -> f64 {
    sample(
        proxy,
        &format!("tongs_continuations_total{{outcome=\"{outcome}\"}}"),
    )
    .await
}

#[tokio::test]
async fn a_stream_cut_anywhere_reaches_the_client_exactly_as_an_uninterrupted_node_makes_it() {
    let fleet = sim_fleet(1, openai_nodes(3)).await;
    let proxy = start_proxy(config_with("", &fleet.urls())).await;
    let mut expected_continuations = 0.0;
    for chat in [false, true] {
        for usage in [false, true] {
            // At the first token, in the middle, just before the last.
            for cut in ["101", "105", "109", "105:close"] {
                let what = format!("chat {chat}, usage {usage}, cut {cut}");
                let seen = stream(&proxy, chat, &body(chat, usage), cut, &[]).await;
                seen.assert_whole(&what);
                assert_eq!(seen.text(), expected_text(), "{what}: {seen:?}");
                let usages = seen.usages();
                if usage {
                    // The original prompt's 3 words; every token of every piece.
                    assert_eq!(
                        usages,
                        vec![json!({"prompt_tokens": 3, "completion_tokens": TOKENS,
                            "total_tokens": 3 + TOKENS})],
                        "{what}"
                    );
                } else {
                    assert!(usages.is_empty(), "{what}: {usages:?}");
                }
                expected_continuations += 1.0;
                assert_eq!(
                    continuations(&proxy, "continued").await,
                    expected_continuations,
                    "{what}"
                );
            }
        }
    }
    proxy.stop().await;
}

#[tokio::test]
async fn a_stream_cut_twice_is_continued_twice_and_max_continuations_bounds_it() {
    let fleet = sim_fleet(2, openai_nodes(3)).await;
    let proxy = start_proxy(config_with("", &fleet.urls())).await;
    let seen = stream(&proxy, true, &body(true, true), "103,107", &[]).await;
    seen.assert_whole("cut twice");
    assert_eq!(seen.text(), expected_text());
    assert_eq!(continuations(&proxy, "continued").await, 2.0);
    proxy.stop().await;

    let once = "continuation: { max_continuations: 1 }\n";
    let proxy = start_proxy(config_with(once, &fleet.urls())).await;
    let seen = stream(&proxy, false, &body(false, false), "103,107", &[]).await;
    assert!(
        seen.broken,
        "the second cut ends the stream as an error: {seen:?}"
    );
    assert_eq!(seen.dones, 0);
    assert_eq!(seen.text(), " 101 102 103 104 105 106 107");
    assert_eq!(continuations(&proxy, "continued").await, 1.0);
    assert_eq!(continuations(&proxy, "limit").await, 1.0);
    proxy.stop().await;
}

#[tokio::test]
async fn a_stalled_stream_is_continued_elsewhere() {
    let fleet = sim_fleet(3, openai_nodes(3)).await;
    // A stream that can be continued has continuation.idle_min for its floor, not stream.idle_min
    // (a minute here: the stall would outlast the test).
    let config = "stream: { idle_min: 60s, idle_multiplier: 2 }\n\
                  continuation: { idle_min: 300ms }\n";
    let proxy = start_proxy(config_with(config, &fleet.urls())).await;
    let started = std::time::Instant::now();
    let seen = stream(&proxy, true, &body(true, false), "104:stall", &[]).await;
    seen.assert_whole("stall");
    assert_eq!(seen.text(), expected_text());
    // A 200 ms answer, the idle limit, another 200 ms answer: far from the test's deadline.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(continuations(&proxy, "continued").await, 1.0);
    proxy.stop().await;
}

#[tokio::test]
async fn a_stream_whose_node_heartbeats_declare_gone_is_continued() {
    let fleet = sim_fleet(4, openai_nodes(3)).await;
    // The stall alone would take a minute to notice: only the heartbeats can end it in time.
    let config = "health: { interval: 200ms, fast_interval: 100ms, timeout: 300ms }\n\
                  stream: { idle_min: 60s }\n\
                  continuation: { idle_min: 60s }\n";
    let proxy = start_proxy(config_with(config, &fleet.urls())).await;
    eventually("every node healthy", HANG, || {
        proxy.app_registry.counts().healthy() == 3
    })
    .await;
    let fleet_ref = &fleet;
    let stalled = async {
        // The node that stalls the stream goes down (its gateway answers 503 to heartbeats too) once
        // the stream is under way on it.
        eventually("a node holds the stalled stream", HANG, || {
            fleet_ref.nodes().iter().any(|n| n.stats().in_flight == 1)
        })
        .await;
        // A fixed wait on purpose: the stream must have reached its stall (right after " 102") on
        // this node before the node goes down. Were the node declared gone first, the continuation
        // would stream " 102" elsewhere, stall there too, and wait out the 60 s idle limits. The
        // client's progress is inside `stream`, where this future cannot poll it.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let node = fleet_ref
            .nodes()
            .iter()
            .find(|n| n.stats().in_flight == 1)
            .expect("the node holding the stream");
        node.set_condition(Condition::Interrupted {
            kind: InterruptionKind::Gateway503,
            factor: 1.0,
        });
    };
    let request = body(false, true);
    let (seen, ()) = tokio::join!(stream(&proxy, false, &request, "102:stall", &[]), stalled);
    seen.assert_whole("gone");
    assert_eq!(seen.text(), expected_text());
    assert_eq!(continuations(&proxy, "continued").await, 1.0);
    proxy.stop().await;
}

#[tokio::test]
async fn streams_that_must_not_be_continued_end_as_errors_as_before() {
    let fleet = sim_fleet(5, openai_nodes(3)).await;
    let proxy = start_proxy(config_with("", &fleet.urls())).await;
    // The client opted out of retries.
    let seen = stream(
        &proxy,
        true,
        &body(true, false),
        "103",
        &[("x-tongs-retry", "off")],
    )
    .await;
    assert!(seen.broken, "{seen:?}");
    // Two choices share the stream.
    let mut two = body(false, false);
    two["n"] = json!(2);
    let seen = stream(&proxy, false, &two, "103", &[]).await;
    assert!(seen.broken, "{seen:?}");
    // Log probabilities.
    let mut logprobs = body(true, false);
    logprobs["logprobs"] = json!(true);
    let seen = stream(&proxy, true, &logprobs, "103", &[]).await;
    assert!(seen.broken, "{seen:?}");
    assert_eq!(continuations(&proxy, "continued").await, 0.0);
    proxy.stop().await;

    let off = "continuation: { enabled: false }\n";
    let proxy = start_proxy(config_with(off, &fleet.urls())).await;
    let seen = stream(&proxy, true, &body(true, false), "103", &[]).await;
    assert!(seen.broken, "{seen:?}");
    assert_eq!(seen.text(), " 101 102 103");
    assert_eq!(continuations(&proxy, "continued").await, 0.0);
    proxy.stop().await;
}

#[tokio::test]
async fn a_spent_retry_budget_ends_the_stream_as_an_error() {
    let fleet = sim_fleet(6, openai_nodes(3)).await;
    let config = "retry: { budget_percent: 0, budget_min_per_second: 0 }\n";
    let proxy = start_proxy(config_with(config, &fleet.urls())).await;
    let seen = stream(&proxy, true, &body(true, false), "103", &[]).await;
    assert!(seen.broken, "{seen:?}");
    assert_eq!(continuations(&proxy, "budget").await, 1.0);
    proxy.stop().await;
}

/// A stream with a tool call in it cannot be continued by appending text: it ends as an error, counted.
/// The endpoint is a scripted backend speaking vLLM's chunk format.
#[tokio::test]
async fn a_tool_call_in_the_stream_rules_a_continuation_out() {
    use http_body_util::channel::Channel;
    let backend = backend(|_request| async {
        let (mut sender, body) = Channel::<Bytes, BoxError>::new(4);
        tokio::spawn(async move {
            let chunk = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]},
                "finish_reason": null}]});
            let _ = sender
                .send_data(Bytes::from(format!("data: {chunk}\n\n")))
                .await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            sender.abort("the node died".into());
        });
        http::Response::builder()
            .header("content-type", "text/event-stream")
            .body(body.boxed())
            .unwrap()
    })
    .await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;
    let seen = stream(&proxy, true, &body(true, false), "", &[]).await;
    assert!(seen.broken, "{seen:?}");
    assert_eq!(continuations(&proxy, "unsupported").await, 1.0);
    proxy.stop().await;
}

/// `continuation` is set per pool: a pool whose model cannot be continued (not deterministic, or a
/// server without `continue_final_message`) turns it off while the others keep it.
#[tokio::test]
async fn a_pool_may_turn_continuation_off_while_the_others_keep_it() {
    let (kept, plain) = (
        sim_fleet(8, openai_nodes(2)).await,
        sim_fleet(9, openai_nodes(2)).await,
    );
    let plain_urls: Vec<String> = plain.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let pools = format!(
        "pools:\n\
         - name: plain\n\
         \x20 match: {{ models: [\"plain-*\"] }}\n\
         \x20 discovery: {{ static: [{{ url: {} }}, {{ url: {} }}] }}\n\
         \x20 continuation: {{ enabled: false }}\n",
        plain_urls[0], plain_urls[1]
    );
    let proxy = start_proxy(config_with(&pools, &kept.urls())).await;
    let seen = stream(&proxy, true, &body(true, false), "103", &[]).await;
    seen.assert_whole("the default pool continues");
    assert_eq!(seen.text(), expected_text());
    let mut plain_body = body(true, false);
    plain_body["model"] = json!("plain-1");
    let seen = stream(&proxy, true, &plain_body, "103", &[]).await;
    assert!(seen.broken, "the plain pool does not continue: {seen:?}");
    assert_eq!(seen.text(), " 101 102 103");
    let continued =
        |pool: &str| format!("tongs_continuations_total{{pool=\"{pool}\",outcome=\"continued\"}}");
    // (The default pool's series read without their `pool` label, see `one_pool`.)
    assert_eq!(continuations(&proxy, "continued").await, 1.0);
    assert_eq!(sample(&proxy, &continued("plain")).await, 0.0);
    proxy.stop().await;
}

/// Quick heartbeats, so that a node's drain notice is heard within 200 ms.
const QUICK_HEARTBEATS: &str =
    "health: { interval: 200ms, fast_interval: 100ms, timeout: 300ms }\n";

/// `count` nodes streaming `TOKENS` tokens over `service` each, with room for 16, behind a proxy with
/// quick heartbeats and `extra` configuration; returned once every node is healthy.
async fn fleet_of_streams(
    count: usize,
    service: Duration,
    seed: u64,
    extra: &str,
) -> (tongs::sim::Fleet, TestProxy) {
    let nodes = sim_nodes(count, service, |spec| {
        spec.service_time.spread = 0.0;
        spec.tokens = TOKENS as u32;
        spec.capacity = 16;
    });
    let fleet = sim_fleet(seed, nodes).await;
    let config = format!("{QUICK_HEARTBEATS}{extra}");
    let proxy = start_proxy(config_with(&config, &fleet.urls())).await;
    eventually("every node healthy", HANG, || {
        proxy.app_registry.counts().healthy() == count
    })
    .await;
    (fleet, proxy)
}

/// The index of the node holding the one stream, once one does.
async fn holder(fleet: &tongs::sim::Fleet) -> usize {
    eventually("a node holds the stream", HANG, || {
        fleet.nodes().iter().any(|n| n.stats().in_flight == 1)
    })
    .await;
    fleet
        .nodes()
        .iter()
        .position(|n| n.stats().in_flight == 1)
        .expect("the node holding the stream")
}

/// A node that announces its end (the simulator's `announce_end`: `x-tongs-drain` on its heartbeat
/// answers, then it goes) has its continuable stream moved before it goes: the client's stream is
/// exact and whole, continued once and moved once, and no stream was cut.
#[tokio::test]
async fn a_stream_on_a_node_that_announces_its_end_moves_before_the_node_goes() {
    let (fleet, proxy) = fleet_of_streams(2, Duration::from_secs(3), 5, "").await;
    let announce = async {
        let node = holder(&fleet).await;
        // Less time left than the stream needs, and than the least margin: it moves at once, and
        // must, since the node then goes with the stream unfinished.
        fleet.nodes()[node].announce_end(Duration::from_millis(1500));
    };
    let request = body(true, true);
    let (seen, ()) = tokio::join!(stream(&proxy, true, &request, "", &[]), announce);
    seen.assert_whole("moved");
    assert_eq!(seen.text(), expected_text());
    assert_eq!(continuations(&proxy, "continued").await, 1.0);
    assert_eq!(sample(&proxy, "tongs_streams_moved_total").await, 1.0);
    assert_eq!(sample(&proxy, "tongs_streams_cut_total").await, 0.0);
    proxy.stop().await;
}

/// A moved stream is placed by load, not at its conversation's home. Once its node drains, the home
/// is the next node in rendezvous order, which holds none of the answer so far; preferred there, the
/// continuation would wait behind that node's other requests (on a node full to its batch, in its
/// queue), and the client would see that wait as a pause. Three nodes: the stream on its home `S`; the
/// conversation's next home `X` given two long requests first (through tongs, so that tongs counts
/// them); `Y` idle. When `S` announces its end, the stream moves to `Y`. Hedging is off: the pick
/// alone decides (a moving stream otherwise races two nodes, the next test).
#[tokio::test]
async fn a_moved_stream_goes_to_the_least_loaded_node_not_to_its_conversations_next_home() {
    let config = "balancer: { policy: least-outstanding }\nhedge: { enabled: false }\n";
    let (fleet, proxy) = fleet_of_streams(3, Duration::from_secs(5), 7, config).await;
    let admin = |path: &str, body: Value| {
        let request = Request::post(format!("http://{}{path}", proxy.admin))
            .body(full(Bytes::from(body.to_string())))
            .unwrap();
        send(request)
    };
    let home = |body: Value| async move {
        let (status, text) = admin("/debug/pick", body).await;
        assert_eq!(status, 200, "{text}");
        let explained: Value = serde_json::from_str(&text).unwrap();
        explained["conversation_home"]
            .as_str()
            .expect("a conversation home")
            .trim_end_matches('/')
            .to_owned()
    };
    let node_at = |url: &str| {
        fleet
            .nodes()
            .iter()
            .position(|n| n.url().trim_end_matches('/') == url)
            .unwrap_or_else(|| panic!("{url} is none of the fleet's"))
    };

    // The stream's home, and its next home: the home while the first is drained.
    let request = body(true, false);
    let s = home(request.clone()).await;
    let drain = |path: &'static str| {
        let url = fleet.nodes()[node_at(&s)].url();
        async move {
            let (status, text) = admin(path, json!({ "url": url })).await;
            assert_eq!(status, 200, "{text}");
        }
    };
    drain("/endpoints/drain").await;
    let x = home(request.clone()).await;
    drain("/endpoints/undrain").await;
    assert_ne!(s, x);

    // Two requests whose own home is `X`, held there for the service time.
    let mut held = Vec::new();
    for k in 0..200 {
        if held.len() == 2 {
            break;
        }
        let load = json!({"model": "counter", "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": format!("count from {}", 1000 * (k + 1))}]});
        if home(load.clone()).await == x {
            let url = proxy.url("/v1/chat/completions");
            held.push(tokio::spawn(async move {
                let request = Request::post(url)
                    .header("content-type", "application/json")
                    .body(full(Bytes::from(load.to_string())))
                    .unwrap();
                send(request).await
            }));
            let want = held.len();
            eventually("X holds its load", HANG, || {
                fleet.nodes()[node_at(&x)].stats().in_flight == want
            })
            .await;
        }
    }
    assert_eq!(held.len(), 2, "two conversations whose home is X");

    let announce = async {
        let node = holder(&fleet).await;
        assert_eq!(node, node_at(&s), "the stream went to its home");
        fleet.nodes()[node].announce_end(Duration::from_millis(1500));
    };
    let (seen, ()) = tokio::join!(stream(&proxy, true, &request, "", &[]), announce);
    seen.assert_whole("moved");
    assert_eq!(seen.text(), expected_text());
    assert_eq!(sample(&proxy, "tongs_streams_moved_total").await, 1.0);
    let received = |url: &str| fleet.nodes()[node_at(url)].stats().received;
    assert_eq!(received(&x), 2, "X took only its own two requests");
    let y = fleet
        .nodes()
        .iter()
        .map(|n| n.url().trim_end_matches('/').to_owned())
        .find(|url| *url != s && *url != x)
        .unwrap();
    assert_eq!(
        received(&y),
        1,
        "Y, the least loaded, took the moved stream"
    );
    for task in held {
        assert_eq!(task.await.unwrap().0, 200);
    }
    proxy.stop().await;
}

/// A stream moving off a node that said it goes races two nodes at once: the client waits for the new
/// node's first token, and a node that holds the continuation back (here one slowed twentyfold, as a
/// node full to its batch would queue it) must cost nothing while the other answers. Three nodes: the
/// stream on `S`; `A` slowed once the stream runs; `B` as it was. When `S` announces its end, `A` and
/// `B` both get the continuation, whichever the pick chose first, and the stream goes on from `B`.
#[tokio::test]
async fn a_moving_stream_races_two_nodes_and_keeps_the_first_to_answer() {
    let (fleet, proxy) = fleet_of_streams(3, Duration::from_secs(3), 8, "").await;
    let announce = async {
        let s = holder(&fleet).await;
        let nodes = fleet.nodes();
        let (a, b) = ((s + 1) % 3, (s + 2) % 3);
        nodes[a].set_condition(Condition::Interrupted {
            kind: InterruptionKind::Slow,
            factor: 20.0,
        });
        nodes[s].announce_end(Duration::from_millis(1500));
        (a, b)
    };
    let request = body(true, true);
    let (seen, (a, b)) = tokio::join!(stream(&proxy, true, &request, "", &[]), announce);
    seen.assert_whole("moved");
    assert_eq!(seen.text(), expected_text());
    assert_eq!(sample(&proxy, "tongs_streams_moved_total").await, 1.0);
    assert_eq!(sample(&proxy, "tongs_hedges_total").await, 1.0, "one race");
    let nodes = fleet.nodes();
    assert_eq!(
        nodes[a].stats().received,
        1,
        "the slowed node got the continuation"
    );
    assert_eq!(nodes[b].stats().received, 1, "and so did the other");
    assert_eq!(
        nodes[b].stats().served,
        1,
        "the other one's answer is the stream's end"
    );
    proxy.stop().await;
}

/// Nodes whose chunks carry three tokens each, as vLLM's do under load.
fn merging_nodes(count: usize) -> Vec<NodeSpec> {
    let mut nodes = openai_nodes(count);
    for node in &mut nodes {
        node.chunk_tokens = 3;
    }
    nodes
}

#[tokio::test]
async fn a_stream_of_several_tokens_a_chunk_is_continued_by_its_token_ids_and_counted_by_them() {
    let fleet = sim_fleet(4, merging_nodes(3)).await;
    let proxy = start_proxy(config_with("", &fleet.urls())).await;
    for chat in [false, true] {
        let what = format!("chat {chat}");
        // Cut after " 105": the client has had 101-103 and 104-105, two chunks, five tokens.
        let seen = stream(&proxy, chat, &body(chat, true), "105", &[]).await;
        seen.assert_whole(&what);
        assert_eq!(seen.text(), expected_text(), "{what}: {seen:?}");
        assert_eq!(
            seen.usages(),
            vec![
                json!({"prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": 3 + TOKENS})
            ],
            "{what}: usage counts tokens, not chunks"
        );
        for chunk in &seen.chunks {
            assert!(
                chunk["choices"][0]
                    .get("token_ids")
                    .is_none_or(Value::is_null)
                    && chunk.get("prompt_token_ids").is_none_or(Value::is_null),
                "{what}: ids the client did not ask for: {chunk}"
            );
            assert_eq!(
                chunk["object"],
                if chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                },
                "{what}: the continuation in the client's own shape: {chunk}"
            );
        }
    }
    assert_eq!(continuations(&proxy, "continued").await, 2.0);
    assert_eq!(
        sample(&proxy, "tongs_continuations_by_text_total").await,
        0.0,
        "both continued by their ids"
    );

    // A client that asked for ids itself gets every token's, the continuation's too.
    let mut asked = body(true, false);
    asked["return_token_ids"] = json!(true);
    let seen = stream(&proxy, true, &asked, "104", &[]).await;
    seen.assert_whole("ids asked");
    let ids: Vec<u64> = seen
        .chunks
        .iter()
        .filter_map(|c| c["choices"][0]["token_ids"].as_array().cloned())
        .flatten()
        .filter_map(|id| id.as_u64())
        .collect();
    assert_eq!(ids, (101..=100 + TOKENS).collect::<Vec<_>>());
    proxy.stop().await;

    // Continued by text (the node asked for no ids): counted apart, and still whole.
    let never = "continuation: { token_ids: never }\n";
    let proxy = start_proxy(config_with(never, &fleet.urls())).await;
    let seen = stream(&proxy, false, &body(false, true), "105", &[]).await;
    assert!(!seen.broken, "{seen:?}");
    assert_eq!(
        sample(&proxy, "tongs_continuations_by_text_total").await,
        1.0
    );
    proxy.stop().await;
}

//! The simulated nodes answer `POST /v1/completions` and `POST /v1/chat/completions` as vLLM's OpenAI
//! server does, with a deterministic model: the exact text and usage of every answer, streamed and
//! not, a continued request producing exactly the rest, vLLM's 400s, and the `x-sim-cut` hook breaking
//! a stream after a chosen token, each seen by a client on a real socket.

use std::time::Duration;

use crate::support::*;
use http::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};
use tongs::sim::{Condition, Fleet, InterruptionKind, Node, NodeSpec};

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

/// One node `a` serving in exactly `mean_ms`, with `tokens` tokens by default.
async fn node(mean_ms: u64, tokens: u32) -> Fleet {
    let mut spec = NodeSpec::new("a", Duration::from_millis(mean_ms));
    spec.service_time.spread = 0.0;
    spec.tokens = tokens;
    sim_fleet(1, vec![spec]).await
}

fn request(node: &Node, path: &str, body: &Value, cut: Option<&str>) -> Request<TestBody> {
    let mut request =
        Request::post(format!("{}{path}", node.url())).header("content-type", "application/json");
    if let Some(cut) = cut {
        request = request.header("x-sim-cut", cut);
    }
    request.body(full(body.to_string())).unwrap()
}

/// A whole answer's status and body.
async fn ask(node: &Node, path: &str, body: &Value) -> (u16, String) {
    send(request(node, path, body, None)).await
}

/// A streamed answer's head, checked to be an event stream.
async fn open_stream(node: &Node, path: &str, body: &Value, cut: Option<&str>) -> Incoming {
    let response = tokio::time::timeout(HANG, client().request(request(node, path, body, cut)))
        .await
        .expect("an answer")
        .expect("a response");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    response.into_body()
}

/// How a stream ended.
#[derive(Debug)]
enum End {
    /// The body ended cleanly.
    Ended,
    /// The body broke with this error.
    Broke(hyper::Error),
    /// Nothing more came within the wait.
    Silent,
}

/// The events of a stream (each `data: ...` without its blank line) until it ends or stays silent for
/// `quiet`.
async fn read_events(mut body: Incoming, quiet: Duration) -> (Vec<String>, End) {
    let mut received = Vec::new();
    let end = loop {
        match tokio::time::timeout(quiet, body.frame()).await {
            Err(_) => break End::Silent,
            Ok(None) => break End::Ended,
            Ok(Some(Err(err))) => break End::Broke(err),
            Ok(Some(Ok(frame))) => {
                received.extend_from_slice(&frame.into_data().unwrap_or_default())
            }
        }
    };
    let text = String::from_utf8(received).unwrap();
    assert!(
        text.is_empty() || text.ends_with("\n\n"),
        "a partial event: {text:?}"
    );
    let events = text
        .split_terminator("\n\n")
        .map(|event| {
            assert!(event.starts_with("data: "), "{event:?}");
            event.to_owned()
        })
        .collect();
    (events, end)
}

/// The text the events carry: completions' `text` and chat's `delta.content`, in order.
fn text_of(events: &[String]) -> String {
    events
        .iter()
        .filter_map(|event| serde_json::from_str::<Value>(&event["data: ".len()..]).ok())
        .filter_map(|chunk| {
            let choice = &chunk["choices"][0];
            choice["text"]
                .as_str()
                .or(choice["delta"]["content"].as_str())
                .map(str::to_owned)
        })
        .collect()
}

/// The `created` of an answer, checked to be the Unix time of about now.
fn created_of(json: &str) -> u64 {
    let created = serde_json::from_str::<Value>(json).unwrap()["created"]
        .as_u64()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now.abs_diff(created) <= 5, "created {created}, now {now}");
    created
}

fn data(event: &str) -> &str {
    event.strip_prefix("data: ").unwrap()
}

#[tokio::test]
async fn completions_answer_the_models_text_and_usage() {
    let fleet = node(20, 16).await;
    let node = &fleet.nodes()[0];
    let body = json!({"model": "tiny", "prompt": "count: 7", "max_tokens": 5});
    let (head, answer) = exchange(request(node, COMPLETIONS, &body, None)).await;
    assert_eq!(head.status, 200);
    assert_eq!(head.headers["content-type"], "application/json");
    assert_eq!(head.headers["x-sim-node"], "a");
    let created = created_of(&answer);
    assert_eq!(
        answer,
        format!(
            r#"{{"id":"cmpl-a-1","object":"text_completion","created":{created},"model":"tiny","choices":[{{"index":0,"text":" 8 9 10 11 12","logprobs":null,"finish_reason":"length"}}],"usage":{{"prompt_tokens":2,"completion_tokens":5,"total_tokens":7}}}}"#
        )
    );
    // A prompt as an array of one string; the node's 16 tokens by default; ids count on.
    let (status, answer) = ask(node, COMPLETIONS, &json!({"prompt": ["a 1 b 2 c"]})).await;
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["id"], "cmpl-a-2");
    assert_eq!(answer["model"], "sim");
    let text: String = (3..=18).map(|n| format!(" {n}")).collect();
    assert_eq!(answer["choices"][0]["text"], text);
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21})
    );
    assert_eq!(node.stats().served, 2);
}

#[tokio::test]
async fn chat_answers_the_models_text_and_usage() {
    let fleet = node(20, 3).await;
    let node = &fleet.nodes()[0];
    let body = json!({"messages": [
        {"role": "system", "content": "you count"},
        {"role": "user", "content": "from 41"},
    ]});
    let (status, answer) = ask(node, CHAT, &body).await;
    assert_eq!(status, 200);
    let created = created_of(&answer);
    assert_eq!(
        answer,
        format!(
            r#"{{"id":"chatcmpl-a-1","object":"chat.completion","created":{created},"model":"sim","choices":[{{"index":0,"message":{{"role":"assistant","content":" 42 43 44"}},"logprobs":null,"finish_reason":"length"}}],"usage":{{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}}}"#
        )
    );
    // max_completion_tokens wins over max_tokens; max_tokens alone counts too.
    for (limits, expected) in [
        (json!({"max_completion_tokens": 1, "max_tokens": 2}), " 42"),
        (json!({"max_tokens": 2}), " 42 43"),
    ] {
        let mut body = body.clone();
        body.as_object_mut()
            .unwrap()
            .extend(limits.as_object().unwrap().clone());
        let (_, answer) = ask(node, CHAT, &body).await;
        let answer: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(answer["choices"][0]["message"]["content"], expected);
    }
}

#[tokio::test]
async fn streamed_completions_send_a_chunk_per_token_then_usage_and_done() {
    let fleet = node(20, 16).await;
    let node = &fleet.nodes()[0];
    let body = json!({"model": "tiny", "prompt": "count: 7", "max_tokens": 3, "stream": true});
    let (events, end) = read_events(
        open_stream(node, COMPLETIONS, &body, None).await,
        Duration::from_secs(5),
    )
    .await;
    assert!(matches!(end, End::Ended), "{end:?}");
    let created = created_of(data(&events[0]));
    let chunk = |text: &str, finish: &str| {
        format!(
            r#"data: {{"id":"cmpl-a-1","object":"text_completion","created":{created},"model":"tiny","choices":[{{"index":0,"text":"{text}","logprobs":null,"finish_reason":{finish}}}]}}"#
        )
    };
    assert_eq!(
        events,
        [
            chunk(" 8", "null"),
            chunk(" 9", "null"),
            chunk(" 10", r#""length""#),
            "data: [DONE]".to_owned(),
        ]
    );

    let body = json!({"prompt": "count: 7", "max_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true}});
    let (events, _) = read_events(
        open_stream(node, COMPLETIONS, &body, None).await,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(events.len(), 4, "{events:?}");
    let created = created_of(data(&events[2]));
    assert_eq!(
        events[2],
        format!(
            r#"data: {{"id":"cmpl-a-2","object":"text_completion","created":{created},"model":"sim","choices":[],"usage":{{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}}}"#
        )
    );
    assert_eq!(text_of(&events), " 8 9");
    assert_eq!(events[3], "data: [DONE]");
    assert_eq!(node.stats().served, 2);
}

#[tokio::test]
async fn streamed_chat_sends_the_role_then_a_chunk_per_token_then_usage_and_done() {
    let fleet = node(20, 16).await;
    let node = &fleet.nodes()[0];
    let body = json!({"model": "tiny", "stream": true, "max_tokens": 2,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "count: 7"}]});
    let (events, end) = read_events(
        open_stream(node, CHAT, &body, None).await,
        Duration::from_secs(5),
    )
    .await;
    assert!(matches!(end, End::Ended), "{end:?}");
    let created = created_of(data(&events[0]));
    let head = format!(
        r#"data: {{"id":"chatcmpl-a-1","object":"chat.completion.chunk","created":{created},"model":"tiny","choices":"#
    );
    assert_eq!(
        events,
        [
            format!(
                r#"{head}[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}"#
            ),
            format!(
                r#"{head}[{{"index":0,"delta":{{"content":" 8"}},"logprobs":null,"finish_reason":null}}]}}"#
            ),
            format!(
                r#"{head}[{{"index":0,"delta":{{"content":" 9"}},"logprobs":null,"finish_reason":"length"}}]}}"#
            ),
            format!(
                r#"{head}[],"usage":{{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}}}"#
            ),
            "data: [DONE]".to_owned(),
        ]
    );
}

#[tokio::test]
async fn a_continued_request_produces_exactly_the_rest() {
    let fleet = node(20, 16).await;
    let node = &fleet.nodes()[0];
    let stream = |body: Value| async move {
        let (events, _) = read_events(
            open_stream(node, COMPLETIONS, &body, None).await,
            Duration::from_secs(5),
        )
        .await;
        text_of(&events)
    };
    let whole = stream(json!({"prompt": "count: 7", "max_tokens": 5, "stream": true})).await;
    assert_eq!(whole, " 8 9 10 11 12");
    let first = " 8 9";
    let rest = stream(
        json!({"prompt": format!("count: 7{first}"), "max_tokens": 3,
        "stream": true}),
    )
    .await;
    assert_eq!(format!("{first}{rest}"), whole);

    // Chat: the assistant's part so far, continued.
    let user = json!({"role": "user", "content": "count: 7"});
    let (_, answer) = ask(node, CHAT, &json!({"messages": [user], "max_tokens": 5})).await;
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], whole);
    let body = json!({"messages": [user, {"role": "assistant", "content": first}],
        "add_generation_prompt": false, "continue_final_message": true, "max_tokens": 3,
        "stream": true, "stream_options": {"include_usage": true}});
    let (events, _) = read_events(
        open_stream(node, CHAT, &body, None).await,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(format!("{first}{}", text_of(&events)), whole);
    let usage: Value = serde_json::from_str(data(&events[events.len() - 2])).unwrap();
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7})
    );
}

#[tokio::test]
async fn malformed_requests_get_vllms_400() {
    let fleet = node(5_000, 16).await;
    let node = &fleet.nodes()[0];
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (COMPLETIONS, json!("not an object"), None),
        (COMPLETIONS, json!({"max_tokens": 3}), None),
        // A prompt of token ids is vLLM's too (see the continuation tests); one that is not all ids
        // is not.
        (COMPLETIONS, json!({"prompt": [1, "b"]}), None),
        (COMPLETIONS, json!({"prompt": ["a", "b"]}), None),
        (COMPLETIONS, json!({"prompt": []}), None),
        (COMPLETIONS, json!({"prompt": "x", "max_tokens": 0}), None),
        (COMPLETIONS, json!({"prompt": "x", "max_tokens": -1}), None),
        (COMPLETIONS, json!({"prompt": "x", "max_tokens": 1.5}), None),
        (COMPLETIONS, json!({"prompt": "x", "max_tokens": "5"}), None),
        (COMPLETIONS, json!({"prompt": "x", "stream": "yes"}), None),
        (COMPLETIONS, json!({"prompt": "x", "model": 7}), None),
        (COMPLETIONS, json!({"prompt": "x"}), Some("ten")),
        (COMPLETIONS, json!({"prompt": "x"}), Some("4:explode")),
        (CHAT, json!({"prompt": "x"}), None),
        (CHAT, json!({"messages": "hi"}), None),
        (CHAT, json!({"messages": [{"role": "user"}]}), None),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
            None,
        ),
        (
            CHAT,
            json!({"messages": user, "max_completion_tokens": 0}),
            None,
        ),
        (
            CHAT,
            json!({"messages": user, "continue_final_message": true, "add_generation_prompt": true}),
            None,
        ),
        (
            CHAT,
            json!({"messages": user, "continue_final_message": true, "add_generation_prompt": false}),
            None,
        ),
    ];
    for (path, body, cut) in cases {
        let (status, answer) = send(request(node, path, &body, cut)).await;
        assert_eq!(status, 400, "{path} {body} {cut:?}: {answer}");
        let error: Value = serde_json::from_str(&answer).unwrap();
        let message = error["message"].as_str().unwrap_or_default().to_owned();
        assert!(!message.is_empty(), "{answer}");
        let message = serde_json::to_string(&message).unwrap();
        assert_eq!(
            answer,
            format!(
                r#"{{"object":"error","message":{message},"type":"BadRequestError","param":null,"code":400}}"#
            )
        );
    }
    let request = Request::post(format!("{}{COMPLETIONS}", node.url()))
        .body(full("{not json"))
        .unwrap();
    assert_eq!(send(request).await.0, 400);
    let (_, answer) = ask(
        node,
        CHAT,
        &json!({"messages": user, "continue_final_message": true}),
    )
    .await;
    assert!(answer.contains("Cannot set both"), "{answer}");
    assert_eq!(node.stats().served, 0);
}

/// A stream of tokens 8 to 12 (`count: 7`, 5 tokens) cut by `cut`: the events received and the end.
async fn cut_stream(node: &Node, path: &str, cut: &str, quiet: Duration) -> (Vec<String>, End) {
    let mut body = json!({"prompt": "count: 7", "max_tokens": 5, "stream": true});
    if path == CHAT {
        body = json!({"messages": [{"role": "user", "content": "count: 7"}], "max_tokens": 5,
            "stream": true});
    }
    read_events(open_stream(node, path, &body, Some(cut)).await, quiet).await
}

#[tokio::test]
async fn a_reset_cut_resets_the_connection_after_the_chosen_token() {
    let fleet = node(40, 16).await;
    let node = &fleet.nodes()[0];
    for path in [COMPLETIONS, CHAT] {
        let (events, end) = cut_stream(node, path, "10", Duration::from_secs(5)).await;
        assert_eq!(text_of(&events), " 8 9 10", "{path}: {events:?}");
        let End::Broke(err) = end else {
            panic!("{path}: the stream was not broken: {end:?}");
        };
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
        let mut reset = false;
        while let Some(err) = source {
            reset |= err
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionReset);
            source = err.source();
        }
        assert!(reset, "{path}: not a connection reset: {err:?}");
    }
    assert_eq!(node.stats().served, 0);
    eventually("the cut streams let go", Duration::from_secs(5), || {
        node.stats().in_flight == 0
    })
    .await;
}

#[tokio::test]
async fn a_close_cut_ends_the_body_cleanly_without_done() {
    let fleet = node(40, 16).await;
    let node = &fleet.nodes()[0];
    for path in [COMPLETIONS, CHAT] {
        let (events, end) = cut_stream(node, path, "9:close", Duration::from_secs(5)).await;
        assert!(matches!(end, End::Ended), "{path}: {end:?}");
        assert_eq!(text_of(&events), " 8 9", "{path}: {events:?}");
        assert!(events.iter().all(|event| event != "data: [DONE]"));
    }
    assert_eq!(node.stats().served, 0);
}

#[tokio::test]
async fn a_stall_cut_sends_nothing_more_until_the_client_leaves() {
    // Tokens every 10 ms: half a second of silence is a stall.
    let fleet = node(200, 18).await;
    let node = &fleet.nodes()[0];
    let (events, end) = cut_stream(node, COMPLETIONS, "11:stall", Duration::from_millis(500)).await;
    assert!(matches!(end, End::Silent), "{end:?}");
    assert_eq!(text_of(&events), " 8 9 10 11");
    // Held until the client went away (the body was dropped with the connection), then let go.
    assert_eq!(node.stats().served, 0);
    eventually("the stalled stream lets go", Duration::from_secs(5), || {
        node.stats().in_flight == 0
    })
    .await;
}

#[tokio::test]
async fn cuts_name_token_numbers_so_a_continued_stream_is_cut_once_at_each() {
    let fleet = node(40, 16).await;
    let node = &fleet.nodes()[0];
    let cut = Some("4,9:stall");
    let stream = |prompt: String| {
        let body = json!({"prompt": prompt, "max_tokens": 12, "stream": true});
        async move { open_stream(node, COMPLETIONS, &body, cut).await }
    };
    let mut prompt = "count: 0".to_owned();
    let (events, end) = read_events(stream(prompt.clone()).await, Duration::from_secs(5)).await;
    assert!(matches!(end, End::Broke(_)), "{end:?}");
    let first = text_of(&events);
    assert_eq!(first, " 1 2 3 4");
    prompt.push_str(&first);
    let (events, end) = read_events(stream(prompt.clone()).await, Duration::from_millis(500)).await;
    assert!(matches!(end, End::Silent), "{end:?}");
    let second = text_of(&events);
    assert_eq!(second, " 5 6 7 8 9");
    prompt.push_str(&second);
    let (events, end) = read_events(stream(prompt.clone()).await, Duration::from_secs(5)).await;
    assert!(matches!(end, End::Ended), "{end:?}");
    assert_eq!(text_of(&events), " 10 11 12 13 14 15 16 17 18 19 20 21");
    assert_eq!(events.last().map(String::as_str), Some("data: [DONE]"));
}

#[tokio::test]
async fn openai_requests_share_the_nodes_admission_and_interruptions() {
    let mut spec = NodeSpec::new("a", Duration::from_millis(300));
    spec.service_time.spread = 0.0;
    spec.capacity = 1;
    spec.queue = 0;
    spec.report_load = true;
    let fleet = sim_fleet(1, vec![spec]).await;
    let node = &fleet.nodes()[0];
    let body = json!({"prompt": "count: 1", "max_tokens": 2, "stream": true});
    // A stream holds the node's one unit of capacity: the next request is shed.
    let held = open_stream(node, COMPLETIONS, &body, None).await;
    let (status, answer) = ask(node, CHAT, &json!({"messages": []})).await;
    assert_eq!(status, 503, "{answer}");
    let (events, _) = read_events(held, Duration::from_secs(5)).await;
    assert_eq!(text_of(&events), " 2 3");
    let (head, _) = exchange(request(node, CHAT, &json!({"messages": []}), None)).await;
    assert_eq!(head.status, 200);
    assert_eq!(head.headers["x-sim-capacity"], "1");

    node.set_condition(Condition::Interrupted {
        kind: InterruptionKind::Gateway503,
        factor: 1.0,
    });
    let (status, answer) = ask(node, COMPLETIONS, &body).await;
    assert_eq!(status, 503);
    assert!(answer.contains("<html>"), "{answer}");
    assert_eq!((node.stats().served, node.stats().shed), (2, 1));
}

#[tokio::test]
async fn a_gray_node_stalls_a_stream_after_its_first_token_until_it_recovers() {
    let fleet = node(40, 16).await;
    let node = &fleet.nodes()[0];
    node.set_condition(Condition::Interrupted {
        kind: InterruptionKind::Gray,
        factor: 1.0,
    });
    let body = json!({"messages": [{"role": "user", "content": "count: 7"}], "max_tokens": 3,
        "stream": true});
    let mut stream = open_stream(node, CHAT, &body, None).await;
    let mut received = Vec::new();
    while !String::from_utf8_lossy(&received).contains(r#""content":" 8""#) {
        let frame = tokio::time::timeout(HANG, stream.frame()).await.unwrap();
        received.extend_from_slice(&frame.unwrap().unwrap().into_data().unwrap());
    }
    let next = tokio::time::timeout(Duration::from_millis(300), stream.frame()).await;
    assert!(next.is_err(), "a gray node went on streaming");
    node.set_condition(Condition::Up);
    let (events, end) = read_events(stream, Duration::from_secs(5)).await;
    assert!(matches!(end, End::Ended), "{end:?}");
    assert_eq!(text_of(&events), " 9 10");
    assert_eq!(node.stats().served, 1);
}

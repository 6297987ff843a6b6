//! Healthy simulated nodes pause the way real inference servers do, when their spec asks: a first-token
//! wait that grows with the prompt and the load (the chat role chunk going out before it), keep-alive
//! comments meanwhile, and a stream preempted mid-answer while the node's other streams and heartbeats
//! go on; the text stays exactly the model's. Seen by a client on a real socket, with the time each
//! event arrived.

use std::time::Duration;

use crate::support::*;
use http::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::time::Instant;
use tongs::config::HumanDuration;
use tongs::sim::{FirstToken, Fleet, Node, NodeSpec, Preemption};

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

/// One node `a` serving in exactly `mean_ms`, paced for `tokens` tokens, as `tune` sets.
async fn node(mean_ms: u64, tokens: u32, tune: impl FnOnce(&mut NodeSpec)) -> Fleet {
    let mut spec = NodeSpec::new("a", Duration::from_millis(mean_ms));
    spec.service_time.spread = 0.0;
    spec.tokens = tokens;
    spec.capacity = 8;
    tune(&mut spec);
    sim_fleet(1, vec![spec]).await
}

fn first_token(wait_ms: u64, per_prompt_word_ms: u64, per_in_flight_ms: u64) -> FirstToken {
    FirstToken {
        wait: HumanDuration::from_millis(wait_ms),
        per_prompt_word: HumanDuration::from_millis(per_prompt_word_ms),
        per_in_flight: HumanDuration::from_millis(per_in_flight_ms),
        spread: 0.0,
    }
}

/// An event of a stream (`data: ...` or a `: comment`, without its blank line) and when it arrived.
#[derive(Debug)]
struct Event {
    /// After the request was sent.
    at: Duration,
    when: Instant,
    text: String,
}

/// A stream being read: its body and when its request was sent.
struct Stream {
    body: Incoming,
    sent: Instant,
    /// When the response's head arrived, after `sent`.
    head: Duration,
}

/// Sends `body` to `path` as a POST (or a plain GET of `/v1/generate` asking for a stream when `body`
/// is null) and returns the stream once its head has come.
async fn open(node: &Node, path: &str, body: &Value) -> Stream {
    let request = if body.is_null() {
        Request::get(format!("{}{path}", node.url()))
            .header("accept", "text/event-stream")
            .body(full(""))
    } else {
        Request::post(format!("{}{path}", node.url()))
            .header("content-type", "application/json")
            .body(full(body.to_string()))
    };
    let sent = Instant::now();
    let response = tokio::time::timeout(HANG, client().request(request.unwrap()))
        .await
        .expect("an answer")
        .expect("a response");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    Stream {
        head: sent.elapsed(),
        sent,
        body: response.into_body(),
    }
}

impl Stream {
    /// The next whole events, waiting at most `quiet` for them; None when the body ended.
    async fn next(&mut self, pending: &mut String, quiet: Duration) -> Option<Option<Vec<Event>>> {
        loop {
            if let Some(end) = pending.rfind("\n\n") {
                let when = Instant::now();
                let whole: String = pending.drain(..end + 2).collect();
                let events = whole
                    .split_terminator("\n\n")
                    .map(|text| Event {
                        at: when - self.sent,
                        when,
                        text: text.to_owned(),
                    })
                    .collect();
                return Some(Some(events));
            }
            match tokio::time::timeout(quiet, self.body.frame()).await {
                Err(_) => return Some(None),
                Ok(None) => {
                    assert!(pending.is_empty(), "a partial event: {pending:?}");
                    return None;
                }
                Ok(Some(frame)) => {
                    let frame = frame.expect("an unbroken stream");
                    let data = frame.into_data().unwrap_or_default();
                    pending.push_str(std::str::from_utf8(&data).expect("UTF-8"));
                }
            }
        }
    }

    /// Every event until the body ends, each with when it arrived.
    async fn events(mut self) -> Vec<Event> {
        let mut pending = String::new();
        let mut events = Vec::new();
        while let Some(next) = self.next(&mut pending, HANG).await {
            events.extend(next.expect("no stall as long as HANG"));
        }
        events
    }
}

/// The text of the token events: completions' `text`, chat's `delta.content`, plain streams' token
/// numbers, in order.
fn text_of(events: &[Event]) -> String {
    tokens(events).map(|(_, text)| text).collect()
}

/// The events carrying a token (not the role chunk, usage, `[DONE]` or comments), with their text.
fn tokens(events: &[Event]) -> impl Iterator<Item = (&Event, String)> {
    events.iter().filter_map(|event| {
        let chunk: Value = serde_json::from_str(event.text.strip_prefix("data: ")?).ok()?;
        let choice = &chunk["choices"][0];
        let text = match (
            &choice["text"],
            &choice["delta"]["content"],
            &chunk["token"],
        ) {
            (Value::String(text), _, _) => text.clone(),
            (_, Value::String(text), _) if !text.is_empty() => text.clone(),
            (_, _, Value::Number(token)) => format!(" {token}"),
            _ => return None,
        };
        Some((event, text))
    })
}

/// When the first token arrived.
fn first_token_at(events: &[Event]) -> Duration {
    tokens(events).next().expect("a token").0.at
}

/// The longest silence between two tokens, and when the one ending it arrived.
fn longest_gap(events: &[Event]) -> (Duration, Instant) {
    let times: Vec<Instant> = tokens(events).map(|(event, _)| event.when).collect();
    times
        .windows(2)
        .map(|pair| (pair[1] - pair[0], pair[1]))
        .max()
        .expect("two tokens at least")
}

fn counting(from: u64, count: u64) -> String {
    (from + 1..=from + count).map(|n| format!(" {n}")).collect()
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

#[tokio::test]
async fn a_first_token_wait_sends_the_role_at_once_and_the_first_token_after_it() {
    let wait = ms(600);
    let fleet = node(100, 16, |spec| {
        spec.first_token = Some(first_token(600, 0, 0))
    })
    .await;
    let node = &fleet.nodes()[0];

    let chat = json!({"messages": [{"role": "user", "content": "count: 7"}], "max_tokens": 4,
        "stream": true});
    let stream = open(node, CHAT, &chat).await;
    assert!(stream.head < wait / 2, "headers at once: {:?}", stream.head);
    let events = stream.events().await;
    let role = &events[0];
    assert!(
        role.text
            .contains(r#""delta":{"role":"assistant","content":""}"#),
        "{role:?}"
    );
    assert!(role.at < wait / 2, "the role chunk at once: {role:?}");
    let first = first_token_at(&events);
    assert!(
        first >= wait.mul_f64(0.8) && first < wait + ms(2_000),
        "first token at {first:?}"
    );
    assert_eq!(text_of(&events), counting(7, 4));
    assert_eq!(events.last().unwrap().text, "data: [DONE]");

    // Completions and a plain stream: nothing before the first token, which comes after the wait.
    let completion = json!({"prompt": "count: 7", "max_tokens": 4, "stream": true});
    for (path, body, text) in [
        (COMPLETIONS, completion, counting(7, 4)),
        // The plain stream numbers its node's 16 tokens from 0.
        (
            "/v1/generate",
            Value::Null,
            format!(" 0{}", counting(0, 15)),
        ),
    ] {
        let stream = open(node, path, &body).await;
        assert!(stream.head < wait / 2, "{path}: headers at once");
        let events = stream.events().await;
        assert_eq!(first_token_at(&events), events[0].at, "{path}: {events:?}");
        assert!(
            events[0].at >= wait.mul_f64(0.8) && events[0].at < wait + ms(2_000),
            "{path}: {:?}",
            events[0]
        );
        assert_eq!(text_of(&events), text, "{path}");
    }
    assert_eq!(node.stats().served, 3);
}

#[tokio::test]
async fn the_first_token_waits_longer_for_a_longer_prompt() {
    // 100 ms, and 20 ms a word: `count: 7` (2 words) waits 140 ms, its continuation by 30 tokens
    // (32 words) 740 ms.
    let fleet = node(100, 16, |spec| {
        spec.first_token = Some(first_token(100, 20, 0))
    })
    .await;
    let node = &fleet.nodes()[0];
    let short = json!({"prompt": "count: 7", "max_tokens": 2, "stream": true});
    let events = open(node, COMPLETIONS, &short).await.events().await;
    let short_wait = first_token_at(&events);
    assert!(
        short_wait >= ms(112) && short_wait < ms(450),
        "{short_wait:?}"
    );

    let so_far = counting(7, 30);
    let long = json!({"prompt": format!("count: 7{so_far}"), "max_tokens": 2, "stream": true});
    let events = open(node, COMPLETIONS, &long).await.events().await;
    let long_wait = first_token_at(&events);
    assert!(
        long_wait >= ms(592) && long_wait < ms(740 + 2_000),
        "{long_wait:?}"
    );
    assert_eq!(text_of(&events), counting(37, 2));

    // A chat continuation: the answer so far is part of the prompt too.
    let chat = json!({"messages": [{"role": "user", "content": "count: 7"},
        {"role": "assistant", "content": so_far}],
        "add_generation_prompt": false, "continue_final_message": true, "max_tokens": 2,
        "stream": true});
    let events = open(node, CHAT, &chat).await.events().await;
    let chat_wait = first_token_at(&events);
    assert!(events[0].at < ms(450), "the role chunk at once: {events:?}");
    assert!(
        chat_wait >= ms(592) && chat_wait < ms(740 + 2_000),
        "{chat_wait:?}"
    );
    assert_eq!(format!("{so_far}{}", text_of(&events)), counting(7, 32));
}

#[tokio::test]
async fn the_first_token_waits_longer_on_a_busy_node() {
    // 100 ms alone, 600 ms more for each other request in flight. The first stream lasts about 1 s, so
    // it is in flight when the second comes.
    let fleet = node(1_000, 16, |spec| {
        spec.first_token = Some(first_token(100, 0, 600))
    })
    .await;
    let node = &fleet.nodes()[0];
    let body = json!({"prompt": "count: 7", "max_tokens": 16, "stream": true});
    let alone = open(node, COMPLETIONS, &body).await;
    let busy = open(node, COMPLETIONS, &body).await;
    let (alone, busy) = tokio::join!(alone.events(), busy.events());
    let (alone, busy) = (first_token_at(&alone), first_token_at(&busy));
    assert!(alone >= ms(80) && alone < ms(450), "alone: {alone:?}");
    assert!(busy >= ms(560) && busy < ms(700 + 2_000), "busy: {busy:?}");
}

#[tokio::test]
async fn comments_keep_a_waiting_stream_alive_when_asked() {
    let fleet = node(100, 16, |spec| {
        spec.first_token = Some(first_token(500, 0, 0));
        spec.comment_every = Some(HumanDuration::from_millis(100));
    })
    .await;
    let node = &fleet.nodes()[0];
    let chat = json!({"messages": [{"role": "user", "content": "count: 7"}], "max_tokens": 3,
        "stream": true});
    let completion = json!({"prompt": "count: 7", "max_tokens": 3, "stream": true});
    for (path, body) in [
        (CHAT, chat),
        (COMPLETIONS, completion),
        ("/v1/generate", Value::Null),
    ] {
        let events = open(node, path, &body).await.events().await;
        let first = first_token_at(&events);
        let (before, after): (Vec<&Event>, Vec<&Event>) =
            events.iter().partition(|event| event.at < first);
        let comments: Vec<&&Event> = before
            .iter()
            .filter(|event| event.text == ": ping")
            .collect();
        // One at once, then one every 100 ms of the 500 ms wait: 5, allowing for a slow machine.
        assert!(comments.len() >= 3, "{path}: {events:?}");
        assert!(
            comments[0].at < ms(250),
            "{path}: the first at once: {events:?}"
        );
        assert!(
            after.iter().all(|event| event.text.starts_with("data: ")),
            "{path}: comments only before the first token: {events:?}"
        );
        if path == CHAT {
            assert!(
                events[0].text.contains(r#""role":"assistant""#),
                "{events:?}"
            );
        }
        if path != "/v1/generate" {
            assert_eq!(text_of(&events), counting(7, 3), "{path}");
        }
    }
}

#[tokio::test]
async fn a_preempted_stream_pauses_while_the_nodes_other_stream_flows() {
    // Preemption only with load, certain with one other request in flight: the stream alone is never
    // preempted, the one beside it always. Tokens every 9 ms.
    let pause = ms(800);
    let fleet = node(200, 20, |spec| {
        spec.preemption = Some(Preemption {
            chance: 0.0,
            per_in_flight: 1.0,
            pause: HumanDuration(pause),
            spread: 0.0,
        });
    })
    .await;
    let node = &fleet.nodes()[0];
    let long = json!({"prompt": "count: 0", "max_tokens": 100, "stream": true});
    let short = json!({"messages": [{"role": "user", "content": "count: 7"}], "max_tokens": 10,
        "stream": true});
    let flowing = open(node, COMPLETIONS, &long).await;
    let mut paused = open(node, CHAT, &short).await;
    let health = format!("{}/health", node.url());
    let watch_paused = async {
        // Read until the stream is silent for 200 ms (its pause), check the node's heartbeat answers
        // meanwhile, then read the rest.
        let mut pending = String::new();
        let mut events = Vec::new();
        let mut heartbeat = None;
        while let Some(next) = paused.next(&mut pending, ms(200)).await {
            match next {
                Some(more) => events.extend(more),
                None if heartbeat.is_none() => {
                    let (status, _) = get(&health).await;
                    heartbeat = Some(status);
                }
                None => {}
            }
        }
        (events, heartbeat)
    };
    let (flowing, (paused, heartbeat)) = tokio::join!(flowing.events(), watch_paused);
    assert_eq!(heartbeat, Some(200), "a heartbeat during the pause");

    let (gap, resumed) = longest_gap(&paused);
    assert!(
        gap >= pause.mul_f64(0.8) && gap < pause + ms(2_000),
        "{gap:?}"
    );
    assert_eq!(text_of(&paused), counting(7, 10));
    let (flowing_gap, _) = longest_gap(&flowing);
    assert!(
        flowing_gap < ms(300),
        "the stream alone flows: {flowing_gap:?}"
    );
    assert_eq!(text_of(&flowing), counting(0, 100));
    // Tokens of the other stream arrived during the pause.
    let during = tokens(&flowing)
        .filter(|(event, _)| event.when > resumed - gap && event.when < resumed)
        .count();
    assert!(
        during >= 10,
        "{during} tokens of the other stream during the pause"
    );
    eventually("both served", ms(2_000), || node.stats().served == 2).await;
}

#[tokio::test]
async fn a_certain_preemption_pauses_every_stream_once() {
    let pause = ms(500);
    let fleet = node(100, 10, |spec| {
        spec.preemption = Some(Preemption {
            chance: 1.0,
            per_in_flight: 0.0,
            pause: HumanDuration(pause),
            spread: 0.0,
        });
    })
    .await;
    let node = &fleet.nodes()[0];
    let chat = json!({"messages": [{"role": "user", "content": "count: 7"}], "max_tokens": 6,
        "stream": true});
    let completion = json!({"prompt": "count: 7", "max_tokens": 6, "stream": true});
    for (path, body) in [
        (CHAT, chat),
        (COMPLETIONS, completion),
        ("/v1/generate", Value::Null),
    ] {
        let events = open(node, path, &body).await.events().await;
        let times: Vec<Duration> = tokens(&events).map(|(event, _)| event.at).collect();
        let long: Vec<Duration> = times
            .windows(2)
            .map(|pair| pair[1] - pair[0])
            .filter(|gap| *gap >= pause.mul_f64(0.8))
            .collect();
        assert_eq!(long.len(), 1, "{path}: one pause: {times:?}");
        assert!(long[0] < pause + ms(2_000), "{path}: {long:?}");
        if path != "/v1/generate" {
            assert_eq!(text_of(&events), counting(7, 6), "{path}");
        }
    }
    // A whole answer drawn preempted comes that much later: 100 ms + 500 ms.
    let started = Instant::now();
    let (status, _) = send(
        Request::post(format!("{}{COMPLETIONS}", node.url()))
            .body(full(r#"{"prompt":"count: 7","max_tokens":6}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    assert!(started.elapsed() >= ms(480), "{:?}", started.elapsed());
}

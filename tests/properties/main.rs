//! Property tests of the parsers that take input from outside: the configuration file, endpoint URLs
//! and the discovery allowlist (from ConfigMaps and pod annotations), node addresses (registrations
//! and annotations), `Retry-After` and `x-priority` (from nodes and clients), and the SSE framing and
//! OpenAI chunks a continued stream is read from (from nodes).
//!
//! Each asserts that no input makes tongs panic, and the documented answer where there is one. The
//! number of cases is bounded (proptest's default, or `PROPTEST_CASES`), so `bash .ci/run` stays quick;
//! the coverage-guided fuzz targets in `fuzz/` search further.

#![forbid(unsafe_code)]

use std::time::Duration;

use bytes::BytesMut;
use http::header::{HeaderMap, HeaderValue, RETRY_AFTER};
use proptest::prelude::*;
use serde_json::{Value, json};

use tongs::admission::Priority;
use tongs::config::parse_address;
use tongs::config::{AllowRule, Config, EndpointUrl};
use tongs::openai::sse::{Events, data};
use tongs::openai::{AfterCut, Api, Continuable, Splicer};
use tongs::retry::retry_after;

/// Text that looks like what a user might write: printable ASCII, some Unicode, newlines, YAML
/// punctuation.
fn texty() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[ -~\n\té€𝄞]{0,200}").expect("a valid pattern")
}

/// A valid configuration to mutate: every section present.
const BASE_CONFIG: &str = "listen: 127.0.0.1:8080\nadmin: { listen: 127.0.0.1:9090 }\n\
    timeouts: { connect: 1s, total: 100s, response_headers: 60s }\n\
    retry: { max_attempts: 3, on: [reset, 502] }\nhedge: { after_multiplier: 3 }\n\
    queue: { max_wait: 30s }\ncontinuation: { max_continuations: 2 }\n\
    discovery:\n  static:\n    - url: http://10.0.0.1:8000\n      weight: 2\n";

proptest! {
    #[test]
    fn any_text_is_a_configuration_or_an_error_naming_what_is_wrong(text in texty()) {
        if let Err(err) = Config::parse(&text, "prop") {
            prop_assert!(!err.to_string().is_empty());
        }
    }

    #[test]
    fn a_mutated_configuration_never_panics(
        at in 0..BASE_CONFIG.len(),
        cut in 0usize..20,
        insert in texty(),
    ) {
        let mut text = BASE_CONFIG.as_bytes().to_vec();
        let end = (at + cut).min(text.len());
        text.splice(at..end, insert.bytes());
        if let Ok(text) = String::from_utf8(text)
            && let Err(err) = Config::parse(&text, "prop")
        {
            prop_assert!(!err.to_string().is_empty());
        }
    }

    #[test]
    fn an_endpoint_url_that_parses_is_one_tongs_can_dial(url in texty()) {
        if let Ok(parsed) = EndpointUrl::parse(&url) {
            prop_assert!(parsed.scheme == http::uri::Scheme::HTTP || parsed.scheme == http::uri::Scheme::HTTPS);
            let host = parsed.authority.host();
            prop_assert!(!host.is_empty());
            prop_assert!(!host.contains(".."), "{host}");
            if let Some(port) = parsed.authority.port_u16() {
                prop_assert!(port > 0);
            }
            prop_assert!(!parsed.path_prefix.ends_with('/'));
        }
    }

    #[test]
    fn url_like_input_never_panics(
        scheme in "(http|https|ftp|)",
        host in "[a-z0-9.\\-\\[\\]:@]{0,30}",
        port in proptest::option::of("[0-9]{0,7}"),
        path in "(/[a-z0-9%?#]{0,8}){0,3}",
    ) {
        let port = port.map(|p| format!(":{p}")).unwrap_or_default();
        let sep = if scheme.is_empty() { "" } else { "://" };
        let url = format!("{scheme}{sep}{host}{port}{path}");
        if let Ok(parsed) = EndpointUrl::parse(&url)
            && let Some(port) = parsed.authority.port_u16()
        {
            prop_assert!(port > 0);
        }
    }

    #[test]
    fn allowlist_rules_parse_or_explain(text in texty()) {
        if let Err(message) = AllowRule::parse(&text) {
            prop_assert!(!message.is_empty());
        }
    }

    #[test]
    fn a_node_address_that_parses_has_a_port(text in texty()) {
        if let Ok(address) = parse_address(&text) {
            prop_assert!(address.port() != 0);
        }
    }

    #[test]
    fn addresses_round_trip(ip in any::<std::net::IpAddr>(), port in 1u16..) {
        let address = std::net::SocketAddr::new(ip, port);
        prop_assert_eq!(parse_address(&address.to_string()), Ok(address));
    }

    #[test]
    fn retry_after_never_exceeds_its_cap(value in proptest::collection::vec(any::<u8>(), 0..40), cap in 0u64..100) {
        let cap = Duration::from_secs(cap);
        let mut headers = HeaderMap::new();
        if let Ok(value) = HeaderValue::from_bytes(&value) {
            headers.insert(RETRY_AFTER, value);
        }
        let wait = retry_after(&headers, cap);
        prop_assert!(wait <= cap);
    }

    #[test]
    fn retry_after_in_seconds_is_read_as_written(seconds in 0u64..100_000) {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        let cap = Duration::from_secs(3600);
        prop_assert_eq!(retry_after(&headers, cap), Duration::from_secs(seconds).min(cap));
    }

    #[test]
    fn any_priority_header_is_a_priority(value in proptest::collection::vec(any::<u8>(), 0..20)) {
        let value = HeaderValue::from_bytes(&value).ok();
        let priority = Priority::from_header(value.as_ref());
        let written = value.as_ref().map(|v| v.as_bytes().to_ascii_lowercase());
        let expected = match written.as_deref() {
            Some(b"high") => Priority::High,
            Some(b"low") => Priority::Low,
            _ => Priority::Normal,
        };
        prop_assert_eq!(priority, expected);
    }
}

/// One SSE event as a node might write it: fields, comments, line endings of every kind.
fn sse_event() -> impl Strategy<Value = String> {
    let line = prop_oneof![
        "data: [a-z{}\":, 0-9]{0,20}".prop_map(|l| l),
        Just("data: [DONE]".to_owned()),
        ": [a-z ]{0,10}".prop_map(|l| l),
        "(id|event|retry): [a-z0-9]{0,6}".prop_map(|l| l),
    ];
    (
        proptest::collection::vec(line, 1..4),
        prop_oneof![Just("\n"), Just("\r\n"), Just("\r")],
    )
        .prop_map(|(lines, end)| {
            let mut event = String::new();
            for line in lines {
                event.push_str(&line);
                event.push_str(end);
            }
            event.push_str(end);
            event
        })
}

proptest! {
    #[test]
    fn events_come_out_whole_and_in_order_however_the_bytes_are_cut(
        events in proptest::collection::vec(sse_event(), 0..8),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let stream: Vec<u8> = events.concat().into_bytes();
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
        points.sort_unstable();
        let mut splitter = Events::new();
        let mut got: Vec<u8> = Vec::new();
        let mut count = 0;
        let mut from = 0;
        for point in points.into_iter().chain([stream.len()]) {
            splitter.push(&stream[from..point]);
            from = point;
            while let Some(event) = splitter.next_event() {
                let _ = data(&event);
                got.extend_from_slice(&event);
                count += 1;
            }
        }
        // A stream that ends in a lone `\r` may hold its last event back (it could be `\r\n`).
        let held = splitter.take().map(|b| b.to_vec()).unwrap_or_default();
        got.extend_from_slice(&held);
        prop_assert_eq!(&got, &stream, "nothing lost, repeated or reordered");
        prop_assert!(count + usize::from(!held.is_empty()) >= events.len().saturating_sub(1));
    }

    #[test]
    fn data_of_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = data(&bytes);
    }
}

/// A chunk a node might stream: well-formed, odd, or hostile.
fn chunk() -> impl Strategy<Value = Vec<u8>> {
    let text = "[ a-z0-9]{0,6}";
    prop_oneof![
        (text, proptest::option::of("(stop|length)")).prop_map(|(t, f)| {
            json!({"id": "x", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"content": t}, "text": t, "finish_reason": f}]})
        }),
        Just(json!({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
        (0u64..50, 0u64..50).prop_map(|(p, c)| {
            json!({"id": "x", "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c}})
        }),
        Just(json!({"choices": "not a list"})),
        Just(json!({"choices": [{"index": 3}]})),
        Just(json!({"usage": {"completion_tokens": -1}})),
        Just(json!([1, 2, 3])),
    ]
    .prop_map(|v: Value| format!("data: {v}\n\n").into_bytes())
    .boxed()
    .prop_union(prop_oneof![
        Just(b"data: [DONE]\n\n".to_vec()),
        Just(b"data: {not json\n\n".to_vec()),
        Just(b": ping\n\n".to_vec()),
    ].boxed())
}

proptest! {
    #[test]
    fn any_stream_splices_without_panic_and_a_continuation_is_json(
        chat in any::<bool>(),
        usage in any::<bool>(),
        max in proptest::option::of(1u64..40),
        pieces in proptest::collection::vec(proptest::collection::vec(chunk(), 0..8), 1..4),
    ) {
        let api = if chat { Api::Chat } else { Api::Completions };
        let mut body = json!({"stream": true, "model": "m"});
        if chat {
            body["messages"] = json!([{"role": "user", "content": "go"}]);
        } else {
            body["prompt"] = json!("go");
        }
        if usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        if let Some(max) = max {
            body["max_tokens"] = json!(max);
        }
        let request = Continuable::read(api, &bytes::Bytes::from(body.to_string())).expect("a continuable request");
        let mut splicer = Splicer::new(request);
        let mut out = BytesMut::new();
        for (n, piece) in pieces.iter().enumerate() {
            if n > 0 {
                splicer.next_piece();
            }
            for event in piece {
                splicer.event(event, &mut out);
            }
            match splicer.cut(&mut out) {
                AfterCut::Continue(next) => {
                    let next: Value = serde_json::from_slice(&next.body).expect("the continuation is JSON");
                    if let Some(max) = max {
                        let left = next["max_tokens"].as_u64().expect("a limit stays a number");
                        prop_assert!((1..=max).contains(&left));
                    }
                }
                AfterCut::Complete | AfterCut::Refused(_) => break,
            }
        }
        let text = String::from_utf8_lossy(&out);
        prop_assert!(text.matches("data: [DONE]").count() <= pieces.iter().flatten().filter(|e| e.starts_with(b"data: [DONE]")).count().max(1));
    }
}

//! An OpenAI client as the tests use it: a streamed chat or completion read event by event, with what
//! a user would notice (the text, the token ids if asked, the longest pause, the first token's wait,
//! how the stream ended), and the uninterrupted greedy answer a server gives, to compare with.

use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support;

/// Which API a request speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }
}

/// One greedy request: its prompt and length.
#[derive(Clone, Debug)]
pub struct Ask {
    pub api: Api,
    pub prompt: String,
    pub max_tokens: u64,
    /// The client asks for token ids itself.
    pub ids: bool,
    pub usage: bool,
}

impl Ask {
    pub fn new(api: Api, prompt: impl Into<String>, max_tokens: u64) -> Ask {
        Ask {
            api,
            prompt: prompt.into(),
            max_tokens,
            ids: false,
            usage: true,
        }
    }

    /// The request body; `stream` or not.
    pub fn body(&self, stream: bool) -> Value {
        let mut body = match self.api {
            Api::Chat => json!({"messages": [{"role": "user", "content": self.prompt}]}),
            Api::Completions => json!({"prompt": self.prompt}),
        };
        body["model"] = json!("tiny");
        body["temperature"] = json!(0);
        body["max_tokens"] = json!(self.max_tokens);
        if stream {
            body["stream"] = json!(true);
            if self.usage {
                body["stream_options"] = json!({"include_usage": true});
            }
        }
        if self.ids || !stream {
            body["return_token_ids"] = json!(true);
        }
        body
    }
}

/// What a client saw of one streamed answer.
#[derive(Debug, Default)]
pub struct Streamed {
    pub status: u16,
    pub text: String,
    /// The token ids the chunks carried (when asked).
    pub ids: Vec<u32>,
    /// Chunks that carried `token_ids` with a value (0 unless asked).
    pub chunks_with_ids: usize,
    pub finish: Option<String>,
    pub usage: Option<Value>,
    /// `[DONE]` came, and the body ended cleanly after it.
    pub done: bool,
    /// How the body ended otherwise.
    pub error: Option<String>,
    /// Longest wait between two events after the first token.
    pub longest_pause: Duration,
    /// From the request to the first token.
    pub first_token: Option<Duration>,
    /// Every chunk's JSON.
    pub chunks: Vec<Value>,
    /// Each chunk's `id`.
    pub chunk_ids: Vec<String>,
}

impl Streamed {
    /// A whole answer: `[DONE]`, a finish reason, no error.
    pub fn whole(&self) -> bool {
        self.status == 200 && self.done && self.error.is_none() && self.finish.is_some()
    }
}

/// Streams `ask` from `base` (tongs or a node), bounded by `limit`.
pub async fn stream(base: &str, ask: &Ask, limit: Duration) -> Streamed {
    let request = http::Request::post(format!("{base}{}", ask.api.path()))
        .header("content-type", "application/json")
        .body(support::full(ask.body(true).to_string()))
        .expect("a request");
    let started = Instant::now();
    let mut seen = Streamed::default();
    let exchange = async {
        let response = match support::client().request(request).await {
            Ok(response) => response,
            Err(e) => {
                seen.error = Some(format!("request: {e}"));
                return;
            }
        };
        seen.status = response.status().as_u16();
        let mut body = response.into_body();
        let mut buffer = Vec::<u8>::new();
        let mut last = None::<Instant>;
        loop {
            match body.frame().await {
                None => break,
                Some(Err(e)) => {
                    seen.error = Some(format!("body: {e}"));
                    return;
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    buffer.extend_from_slice(&data);
                    while let Some(end) = find(&buffer, b"\n\n") {
                        let event: Vec<u8> = buffer.drain(..end + 2).collect();
                        let now = Instant::now();
                        read_event(&event, &mut seen, now, started, &mut last);
                    }
                }
            }
        }
        if !seen.done {
            seen.error.get_or_insert("ended before [DONE]".into());
        }
    };
    if tokio::time::timeout(limit, exchange).await.is_err() {
        seen.error = Some(format!("no end within {limit:?}"));
    }
    seen
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn read_event(
    event: &[u8],
    seen: &mut Streamed,
    now: Instant,
    started: Instant,
    last: &mut Option<Instant>,
) {
    let text = String::from_utf8_lossy(event);
    let Some(data) = text.trim().strip_prefix("data:").map(str::trim) else {
        return;
    };
    if data == "[DONE]" {
        seen.done = true;
        return;
    }
    let Ok(chunk) = serde_json::from_str::<Value>(data) else {
        seen.error = Some(format!("not JSON: {data}"));
        return;
    };
    if let Some(id) = chunk["id"].as_str() {
        seen.chunk_ids.push(id.to_owned());
    }
    if !chunk["usage"].is_null() {
        seen.usage = Some(chunk["usage"].clone());
    }
    let choice = &chunk["choices"][0];
    let piece = choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
        .unwrap_or_default();
    if !piece.is_empty() {
        if seen.first_token.is_none() {
            seen.first_token = Some(now - started);
        }
        if let Some(last) = *last {
            seen.longest_pause = seen.longest_pause.max(now - last);
        }
        *last = Some(now);
        seen.text.push_str(piece);
    }
    if let Some(ids) = choice["token_ids"].as_array() {
        seen.chunks_with_ids += 1;
        seen.ids
            .extend(ids.iter().filter_map(Value::as_u64).map(|id| id as u32));
    }
    if let Some(finish) = choice["finish_reason"].as_str() {
        seen.finish = Some(finish.to_owned());
    }
    seen.chunks.push(chunk);
}

/// The uninterrupted greedy answer `base` gives to `ask`: its text and token ids.
pub async fn reference(base: &str, ask: &Ask) -> (String, Vec<u32>) {
    let request = http::Request::post(format!("{base}{}", ask.api.path()))
        .header("content-type", "application/json")
        .body(support::full(ask.body(false).to_string()))
        .expect("a request");
    let (status, body) = tokio::time::timeout(Duration::from_secs(120), support::send(request))
        .await
        .expect("a reference answer within 120 s");
    assert_eq!(status, 200, "reference answer: {body}");
    let value: Value = serde_json::from_str(&body).expect("JSON");
    let choice = &value["choices"][0];
    let text = choice["text"]
        .as_str()
        .or_else(|| choice["message"]["content"].as_str())
        .expect("text")
        .to_owned();
    let ids = choice["token_ids"]
        .as_array()
        .expect("token ids")
        .iter()
        .map(|id| id.as_u64().expect("an id") as u32)
        .collect();
    (text, ids)
}

/// Sends a GET to `url` and reads the body, bounded.
pub async fn get_text(url: &str) -> (u16, String) {
    tokio::time::timeout(Duration::from_secs(10), support::get(url))
        .await
        .unwrap_or((0, String::new()))
}

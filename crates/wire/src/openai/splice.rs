//! One client stream from several pieces: what the client has been sent, and the rewriting of a
//! continuation's chunks so the client sees one well-formed stream.
//!
//! The first piece reaches the client byte for byte; the splicer only reads it. A continuation's
//! chunks are rewritten to the first chunk's `id`, `created` and `model`; its opening role chunk is
//! dropped (the client has had one); its `usage` counts the whole generation (completion tokens summed
//! over the pieces, the original prompt's tokens) and reaches the client only if it asked for usage.
//! One final chunk and one `[DONE]` end the stream, as from a node that never broke.

use bytes::{BufMut, BytesMut};
use serde_json::{Map, Value};

use super::{Api, Continuable, sse};

/// What the client stream has carried so far, and how to go on after a piece breaks.
#[derive(Debug)]
pub struct Splicer {
    request: Continuable,
    /// Pieces before the current one (0: the node first chosen is streaming).
    pieces: u32,
    /// The text streamed so far, every piece together.
    text: String,
    /// Tokens of the pieces before the current one.
    tokens_before: u64,
    /// Content chunks of the current piece (one token each when the node reports no usage).
    piece_chunks: u64,
    /// The current piece's completion tokens, when it reported usage.
    piece_usage: Option<u64>,
    /// The original prompt's tokens, once a piece's usage told.
    prompt_tokens: Option<u64>,
    /// The first chunk's `id`, `created` and `model`, which every later chunk carries.
    ids: Option<[(String, Value); 3]>,
    /// A chunk with a `finish_reason` reached the client: the generation is complete.
    finished: bool,
    usage_sent: bool,
    done_sent: bool,
    /// Something in the stream makes a continuation unsafe.
    refused: Option<&'static str>,
}

/// What to do once the current piece broke (ended before `[DONE]`, failed or stalled).
#[derive(Debug, PartialEq, Eq)]
pub enum AfterCut {
    /// The stream is complete (its end was written to `out` where it was missing).
    Complete,
    /// Continue with this request on another endpoint.
    Continue(Vec<u8>),
    /// It cannot be continued, for this reason.
    Refused(&'static str),
}

/// The keys of a chunk that every piece must show as the first piece's.
const ID_KEYS: [&str; 3] = ["id", "created", "model"];

impl Splicer {
    pub fn new(request: Continuable) -> Splicer {
        Splicer {
            request,
            pieces: 0,
            text: String::new(),
            tokens_before: 0,
            piece_chunks: 0,
            piece_usage: None,
            prompt_tokens: None,
            ids: None,
            finished: false,
            usage_sent: false,
            done_sent: false,
            refused: None,
        }
    }

    /// Whether the stream has reached its `[DONE]`.
    pub fn is_done(&self) -> bool {
        self.done_sent
    }

    /// Pieces that continued the first one.
    pub fn continuations(&self) -> u32 {
        self.pieces
    }

    /// The text the client has been sent.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Tokens streamed so far: the nodes' own count where they reported usage, else one per chunk.
    pub fn tokens(&self) -> u64 {
        self.tokens_before + self.piece_usage.unwrap_or(self.piece_chunks)
    }

    /// A continuation piece begins.
    pub fn next_piece(&mut self) {
        self.tokens_before = self.tokens();
        self.piece_chunks = 0;
        self.piece_usage = None;
        self.pieces += 1;
    }

    /// One whole event of the current piece; what the client gets of it is appended to `out`.
    pub fn event(&mut self, raw: &[u8], out: &mut BytesMut) {
        let Some(data) = sse::data(raw) else {
            // A comment or keep-alive: harmless, passed on.
            out.extend_from_slice(raw);
            return;
        };
        if data.trim() == "[DONE]" {
            if self.pieces == 0 {
                out.extend_from_slice(raw);
                self.done_sent = true;
            } else if !self.done_sent {
                self.end(out);
            }
            return;
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(&data) else {
            self.refused
                .get_or_insert("a data line that is not a JSON chunk");
            out.extend_from_slice(raw);
            return;
        };
        self.read_chunk(&chunk);
        if self.pieces == 0 {
            if self.ids.is_none() {
                self.ids = Some(ID_KEYS.map(|key| (key.to_owned(), chunk_value(&chunk, key))));
            }
            out.extend_from_slice(raw);
            return;
        }
        // A continuation's chunk.
        let choices_empty = chunk
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty);
        if self.ids.is_some() && self.is_role_chunk(&chunk) {
            return;
        }
        if let Some(usage) = chunk.get_mut("usage")
            && usage.is_object()
        {
            if !self.request.usage_wanted && choices_empty {
                return;
            }
            *usage = self.usage_value();
            if choices_empty {
                self.usage_sent = true;
            }
        }
        match &self.ids {
            Some(ids) => {
                for (key, value) in ids {
                    chunk.insert(key.clone(), value.clone());
                }
            }
            None => {
                self.ids = Some(ID_KEYS.map(|key| (key.to_owned(), chunk_value(&chunk, key))));
            }
        }
        write_chunk(&chunk, out);
    }

    /// The current piece broke before its `[DONE]`: decides what comes next, writing any end the stream
    /// still needs to `out`.
    pub fn cut(&mut self, out: &mut BytesMut) -> AfterCut {
        if self.done_sent {
            return AfterCut::Complete;
        }
        if let Some(reason) = self.refused {
            return AfterCut::Refused(reason);
        }
        let remaining = self
            .request
            .max_tokens()
            .map(|max| max.saturating_sub(self.tokens()));
        if !self.finished && remaining != Some(0) {
            let body = self.request.continuation(&self.text, self.tokens());
            return AfterCut::Continue(body);
        }
        // Complete but for its end: the final chunk (when the limit was reached without one), usage,
        // `[DONE]`.
        if self.request.usage_wanted && !self.usage_sent && self.prompt_tokens.is_none() {
            return AfterCut::Refused(
                "the stream ended before its usage, and its prompt's tokens are unknown",
            );
        }
        if !self.finished {
            let Some(ids) = &self.ids else {
                return AfterCut::Refused("nothing was streamed");
            };
            let mut chunk: Map<String, Value> = ids.iter().cloned().collect();
            let (object, delta) = match self.request.api {
                Api::Completions => ("text_completion", ("text", Value::from(""))),
                Api::Chat => (
                    "chat.completion.chunk",
                    ("delta", serde_json::json!({"content": ""})),
                ),
            };
            chunk.insert("object".into(), object.into());
            let mut choice = Map::new();
            choice.insert("index".into(), 0.into());
            choice.insert(delta.0.into(), delta.1);
            choice.insert("finish_reason".into(), "length".into());
            chunk.insert("choices".into(), Value::Array(vec![Value::Object(choice)]));
            write_chunk(&chunk, out);
            self.finished = true;
        }
        self.end(out);
        AfterCut::Complete
    }

    /// Writes what ends the stream: the usage chunk if the client wants one and has none yet, then
    /// `[DONE]`.
    fn end(&mut self, out: &mut BytesMut) {
        if self.request.usage_wanted
            && !self.usage_sent
            && self.pieces > 0
            && self.prompt_tokens.is_some()
            && let Some(ids) = &self.ids
        {
            let mut chunk: Map<String, Value> = ids.iter().cloned().collect();
            chunk.insert("choices".into(), Value::Array(Vec::new()));
            chunk.insert("usage".into(), self.usage_value());
            write_chunk(&chunk, out);
            self.usage_sent = true;
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        self.done_sent = true;
    }

    /// Learns from a chunk: its text, tokens, finish, usage, and anything that rules a continuation out.
    fn read_chunk(&mut self, chunk: &Map<String, Value>) {
        if chunk.contains_key("error") {
            self.refused
                .get_or_insert("the node reported an error in the stream");
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            let count = |key| usage.get(key).and_then(Value::as_u64);
            if let Some(completion) = count("completion_tokens") {
                self.piece_usage = Some(completion);
            }
            if self.prompt_tokens.is_none()
                && let Some(prompt) = count("prompt_tokens")
            {
                // A continuation's prompt holds the text streamed before it.
                self.prompt_tokens = Some(prompt.saturating_sub(self.tokens_before));
            }
        }
        let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
            return;
        };
        if choices.len() > 1 {
            self.refused.get_or_insert("several choices in the stream");
        }
        let Some(choice) = choices.first() else {
            return;
        };
        if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
            self.refused.get_or_insert("several choices in the stream");
        }
        if choice.get("logprobs").is_some_and(|l| !l.is_null()) {
            self.refused
                .get_or_insert("log probabilities in the stream");
        }
        let content = match self.request.api {
            Api::Completions => choice.get("text"),
            Api::Chat => {
                let delta = choice.get("delta");
                let calls = |key| {
                    delta
                        .and_then(|d| d.get(key))
                        .is_some_and(|v| !v.is_null() && v != &Value::Array(Vec::new()))
                };
                if calls("tool_calls") || calls("function_call") {
                    self.refused.get_or_insert("tool calls in the stream");
                }
                delta.and_then(|d| d.get("content"))
            }
        };
        if let Some(text) = content.and_then(Value::as_str)
            && !text.is_empty()
        {
            self.text.push_str(text);
            self.piece_chunks += 1;
        }
        if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            self.finished = true;
        }
    }

    /// A chat chunk that only opens the assistant's message.
    fn is_role_chunk(&self, chunk: &Map<String, Value>) -> bool {
        if self.request.api != Api::Chat {
            return false;
        }
        let Some(choice) = chunk
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return false;
        };
        let Some(delta) = choice.get("delta").and_then(Value::as_object) else {
            return false;
        };
        delta.contains_key("role")
            && delta
                .get("content")
                .is_none_or(|c| c.is_null() || c.as_str() == Some(""))
            && !delta.contains_key("tool_calls")
            && choice.get("finish_reason").is_none_or(Value::is_null)
    }

    /// `usage` for the whole generation so far.
    fn usage_value(&self) -> Value {
        let prompt = self.prompt_tokens.unwrap_or(0);
        let completion = self.tokens();
        serde_json::json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        })
    }
}

fn chunk_value(chunk: &Map<String, Value>, key: &str) -> Value {
    chunk.get(key).cloned().unwrap_or(Value::Null)
}

fn write_chunk(chunk: &Map<String, Value>, out: &mut BytesMut) {
    out.put_slice(b"data: ");
    // Serialising a map of JSON values cannot fail.
    let _ = serde_json::to_writer((&mut *out).writer(), chunk);
    out.put_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chat(usage: bool, max: u64) -> Splicer {
        let mut body = json!({"model": "m", "stream": true, "max_tokens": max,
            "messages": [{"role": "user", "content": "count: 7"}]});
        if usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        Splicer::new(Continuable::read(Api::Chat, &bytes::Bytes::from(body.to_string())).unwrap())
    }

    fn event(value: Value) -> Vec<u8> {
        format!("data: {value}\n\n").into_bytes()
    }

    fn role(id: &str) -> Vec<u8> {
        event(
            json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
        )
    }

    fn token(id: &str, created: u64, text: &str, finish: Option<&str>) -> Vec<u8> {
        event(
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}),
        )
    }

    fn usage(id: &str, prompt: u64, completion: u64) -> Vec<u8> {
        event(
            json!({"id": id, "object": "chat.completion.chunk", "created": 9, "model": "m",
            "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}}),
        )
    }

    /// The chunks of what the client received, as JSON (`[DONE]` as a string).
    fn chunks(out: &[u8]) -> Vec<Value> {
        std::str::from_utf8(out)
            .unwrap()
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let data = e.strip_prefix("data: ").unwrap();
                serde_json::from_str(data).unwrap_or(Value::from(data))
            })
            .collect()
    }

    #[test]
    fn the_first_piece_passes_byte_for_byte_and_a_continuation_is_rewritten_into_it() {
        let mut splicer = chat(true, 4);
        let mut out = BytesMut::new();
        let first: Vec<Vec<u8>> = vec![
            role("a"),
            token("a", 1, " 8", None),
            token("a", 1, " 9", None),
        ];
        for e in &first {
            splicer.event(e, &mut out);
        }
        assert_eq!(&out[..], &first.concat()[..]);
        assert_eq!((splicer.text(), splicer.tokens()), (" 8 9", 2));

        let mut tail = BytesMut::new();
        let AfterCut::Continue(request) = splicer.cut(&mut tail) else {
            panic!("a stream cut mid-way is continued");
        };
        assert!(tail.is_empty());
        let request: Value = serde_json::from_slice(&request).unwrap();
        assert_eq!(request["max_tokens"], 2);
        assert_eq!(
            request["messages"][1],
            json!({"role": "assistant", "content": " 8 9"})
        );

        splicer.next_piece();
        let mut out = BytesMut::new();
        for e in [
            role("b"),
            token("b", 5, " 10", None),
            token("b", 5, " 11", Some("length")),
            usage("b", 4, 2),
        ] {
            splicer.event(&e, &mut out);
        }
        splicer.event(b"data: [DONE]\n\n", &mut out);
        let got = chunks(&out);
        assert_eq!(got.len(), 4, "role chunk dropped: {got:?}");
        for chunk in &got[..3] {
            assert_eq!((&chunk["id"], &chunk["created"]), (&json!("a"), &json!(1)));
        }
        assert_eq!(got[1]["choices"][0]["finish_reason"], "length");
        // The original prompt's 2 words; 4 tokens in all.
        assert_eq!(
            got[2]["usage"],
            json!({"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6})
        );
        assert_eq!(got[3], "[DONE]");
        assert!(splicer.is_done());
        assert_eq!(splicer.cut(&mut out), AfterCut::Complete);
    }

    #[test]
    fn usage_the_client_did_not_ask_for_is_dropped() {
        let mut splicer = chat(false, 4);
        let mut out = BytesMut::new();
        splicer.event(&token("a", 1, " 8", None), &mut out);
        assert!(matches!(splicer.cut(&mut out), AfterCut::Continue(_)));
        splicer.next_piece();
        let mut out = BytesMut::new();
        splicer.event(&usage("b", 3, 3), &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn a_stream_cut_after_its_last_token_is_ended_by_tongs() {
        // The limit reached without a final chunk: tongs writes one, then [DONE].
        let mut splicer = chat(false, 2);
        let mut out = BytesMut::new();
        splicer.event(&token("a", 1, " 8", None), &mut out);
        splicer.event(&token("a", 1, " 9", None), &mut out);
        let mut end = BytesMut::new();
        assert_eq!(splicer.cut(&mut end), AfterCut::Complete);
        let got = chunks(&end);
        assert_eq!(got[0]["choices"][0]["finish_reason"], "length");
        assert_eq!(got[0]["id"], "a");
        assert_eq!(got[1], "[DONE]");

        // Finished, only [DONE] missing.
        let mut splicer = chat(false, 5);
        splicer.event(&token("a", 1, " 8", Some("stop")), &mut out);
        let mut end = BytesMut::new();
        assert_eq!(splicer.cut(&mut end), AfterCut::Complete);
        assert_eq!(&end[..], b"data: [DONE]\n\n");

        // Finished, usage wanted but unknown: not made up.
        let mut splicer = chat(true, 5);
        splicer.event(&token("a", 1, " 8", Some("stop")), &mut out);
        assert!(matches!(
            splicer.cut(&mut BytesMut::new()),
            AfterCut::Refused(_)
        ));
    }

    #[test]
    fn tool_calls_several_choices_and_errors_rule_a_continuation_out() {
        let cases = [
            json!({"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}),
            json!({"id": "a", "choices": [{"index": 1, "delta": {"content": "x"}}]}),
            json!({"id": "a", "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": {"content": []}}]}),
            json!({"error": {"message": "out of memory"}}),
        ];
        for case in cases {
            let mut splicer = chat(false, 9);
            let mut out = BytesMut::new();
            splicer.event(&event(case.clone()), &mut out);
            assert!(
                matches!(splicer.cut(&mut out), AfterCut::Refused(_)),
                "{case}"
            );
        }
        let mut splicer = chat(false, 9);
        splicer.event(b"data: not json\n\n", &mut BytesMut::new());
        assert!(matches!(
            splicer.cut(&mut BytesMut::new()),
            AfterCut::Refused(_)
        ));
    }

    #[test]
    fn tokens_count_from_usage_where_the_node_reports_it() {
        let mut splicer = chat(false, 20);
        let mut out = BytesMut::new();
        // vLLM's continuous usage: every chunk carries the running count.
        let chunk = json!({"id": "a", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": " 8 9"}, "finish_reason": null}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}});
        splicer.event(&event(chunk), &mut out);
        assert_eq!(splicer.tokens(), 2);
        let AfterCut::Continue(request) = splicer.cut(&mut out) else {
            panic!("continued");
        };
        let request: Value = serde_json::from_slice(&request).unwrap();
        assert_eq!(request["max_tokens"], 18);
    }
}

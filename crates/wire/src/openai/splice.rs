//! One client stream from several pieces: what the client has been sent, and the rewriting of a
//! continuation's chunks so the client sees one well-formed stream.
//!
//! The first piece reaches the client byte for byte, but for the token ids tongs asked for and the
//! client did not (set back to `null`, as the node sends them unasked). A continuation's chunks are
//! rewritten to the first chunk's `id`, `created` and `model`; its opening role chunk is dropped (the
//! client has had one); a continuation by token ids (a completion, whatever the client's API) is put
//! in the client's shape; its `usage` counts the whole generation (completion tokens summed over the
//! pieces, the original prompt's tokens) and reaches the client only if it asked for usage. One final
//! chunk and one `[DONE]` end the stream, as from a node that never broke.
//!
//! Tokens are counted by their ids where every chunk carried them, else by the nodes' `usage`, and
//! only where a node says neither by chunks (a lower bound: one chunk may carry several tokens).

use bytes::{BufMut, BytesMut};
use serde_json::{Map, Value};

use super::{Api, Continuable, ids, sse};

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
    /// The prompt's token ids, from the first piece's first chunk that carried them.
    prompt_ids: Option<Vec<u32>>,
    /// The token ids of every token the client has been sent.
    answer_ids: Vec<u32>,
    /// Every chunk with content so far carried its token ids.
    ids_whole: bool,
    /// The first node was asked for token ids (the client's body with `return_token_ids`).
    ids_asked_upstream: bool,
    /// The current piece is a continuation by token ids: a completion's stream.
    piece_by_ids: bool,
    /// The last continuation asked for is one by token ids.
    next_by_ids: bool,
    /// A chunk with a `finish_reason` reached the client: the generation is complete.
    finished: bool,
    usage_sent: bool,
    done_sent: bool,
    /// Something in the stream makes a continuation unsafe.
    refused: Option<&'static str>,
}

/// The request that continues a stream, and where it goes.
#[derive(Debug, PartialEq, Eq)]
pub struct Resumption {
    pub body: Vec<u8>,
    /// The path to send it to in place of the client's ([`super::COMPLETIONS_PATH`] for one by token
    /// ids), or `None` for the client's own.
    pub path: Option<&'static str>,
    /// Continued by token ids: the rest of the answer is the one the first node would have given.
    /// Otherwise by text, which the next node may tokenize otherwise.
    pub exact: bool,
}

/// What to do once the current piece broke (ended before `[DONE]`, failed or stalled).
#[derive(Debug, PartialEq, Eq)]
pub enum AfterCut {
    /// The stream is complete (its end was written to `out` where it was missing).
    Complete,
    /// Continue with this request on another endpoint.
    Continue(Resumption),
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
            prompt_ids: None,
            answer_ids: Vec::new(),
            ids_whole: true,
            ids_asked_upstream: false,
            piece_by_ids: false,
            next_by_ids: false,
            finished: false,
            usage_sent: false,
            done_sent: false,
            refused: None,
        }
    }

    /// The first node was sent [`Continuable::asking_ids`]: a stream cut before its first token is
    /// sent again asking for them too.
    pub fn asked_ids(&mut self) {
        self.ids_asked_upstream = true;
    }

    /// Whether the tokens so far are counted by their ids, and a cut would be continued by them.
    pub fn by_ids(&self) -> bool {
        self.ids_whole && self.prompt_ids.is_some()
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

    /// Tokens streamed so far: their ids where every chunk carried them, else the nodes' own count
    /// where they reported usage, else one per chunk.
    pub fn tokens(&self) -> u64 {
        if self.by_ids() {
            return self.answer_ids.len() as u64;
        }
        self.tokens_before + self.piece_usage.unwrap_or(self.piece_chunks)
    }

    /// A continuation piece begins: the answer to the request of the last [`AfterCut::Continue`].
    pub fn next_piece(&mut self) {
        self.tokens_before = self.tokens();
        self.piece_chunks = 0;
        self.piece_usage = None;
        self.pieces += 1;
        self.piece_by_ids = self.next_by_ids;
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
        if self.piece_by_ids && self.request.api == Api::Chat {
            ids::as_chat_chunk(&mut chunk);
        }
        self.read_chunk(&chunk);
        let hide_tokens = !self.request.ids_asked();
        if hide_tokens && ids::only_ids(&chunk) {
            return;
        }
        if self.pieces == 0 {
            if self.ids.is_none() {
                self.ids = Some(ID_KEYS.map(|key| (key.to_owned(), chunk_value(&chunk, key))));
            }
            if hide_tokens && ids::hide(&mut chunk, true, true) {
                write_chunk(&chunk, out);
            } else {
                out.extend_from_slice(raw);
            }
            return;
        }
        // A continuation's prompt ids are the answer so far too: never the client's.
        ids::hide(&mut chunk, hide_tokens, true);
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
            let resumption = self.resumption();
            self.next_by_ids = resumption.path.is_some();
            return AfterCut::Continue(resumption);
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

    /// The request that continues the stream: by token ids where they were all kept, else by text.
    /// Nothing streamed yet, the client's own request goes again (asking for ids as the first did).
    fn resumption(&self) -> Resumption {
        let exact = self.by_ids() || !self.ids_asked_upstream;
        if self.text.is_empty() && self.answer_ids.is_empty() {
            let asking = self.ids_asked_upstream.then(|| self.request.asking_ids());
            let body = asking
                .flatten()
                .unwrap_or_else(|| self.request.continuation("", 0));
            return Resumption {
                body,
                path: None,
                exact,
            };
        }
        match &self.prompt_ids {
            Some(prompt) if self.ids_whole => Resumption {
                body: self.request.continuation_by_ids(prompt, &self.answer_ids),
                path: Some(ids::COMPLETIONS_PATH),
                exact: true,
            },
            _ => Resumption {
                body: self.request.continuation(&self.text, self.tokens()),
                path: None,
                exact: false,
            },
        }
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
                // A reasoning model's thoughts (vLLM's `reasoning_content`, newer `reasoning`) are
                // split from its answer by the server's parser, which a continuation would restart
                // mid-thought: not continued, rather than resent or mixed into the answer.
                let reasoning = |key| {
                    delta
                        .and_then(|d| d.get(key))
                        .and_then(Value::as_str)
                        .is_some_and(|r| !r.is_empty())
                };
                if reasoning("reasoning_content") || reasoning("reasoning") {
                    self.refused.get_or_insert("reasoning in the stream");
                }
                delta.and_then(|d| d.get("content"))
            }
        };
        let chunk_ids = ids::read(chunk);
        if self.pieces == 0 && self.prompt_ids.is_none() {
            match chunk_ids.prompt {
                Some(Ok(prompt)) => {
                    self.prompt_tokens.get_or_insert(prompt.len() as u64);
                    self.prompt_ids = Some(prompt);
                }
                Some(Err(())) => self.ids_whole = false,
                None => {}
            }
        }
        let text = content.and_then(Value::as_str).filter(|t| !t.is_empty());
        match chunk_ids.tokens {
            Some(Ok(tokens)) => self.answer_ids.extend(tokens),
            // Text without its ids (or ids that are none): counted otherwise from here on.
            Some(Err(())) => self.ids_whole = false,
            None if text.is_some() => self.ids_whole = false,
            None => {}
        }
        if let Some(text) = text {
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
        let request: Value = serde_json::from_slice(&request.body).unwrap();
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
        let request: Value = serde_json::from_slice(&request.body).unwrap();
        assert_eq!(request["max_tokens"], 18);
    }

    /// A chat chunk as vLLM streams it when asked for token ids.
    fn token_ids(id: &str, text: &str, token_ids: &[u32], finish: Option<&str>) -> Vec<u8> {
        event(
            json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": null,
            "finish_reason": finish, "token_ids": token_ids}]}),
        )
    }

    #[test]
    fn a_stream_with_token_ids_is_continued_by_them_and_counted_by_them() {
        let mut splicer = chat(true, 6);
        splicer.asked_ids();
        let mut out = BytesMut::new();
        let opening = json!({"id": "a", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
            "finish_reason": null, "token_ids": null}], "prompt_token_ids": [11, 12, 13]});
        splicer.event(&event(opening), &mut out);
        // Three tokens in one chunk, as vLLM merges them under load: three tokens, not one chunk.
        splicer.event(&token_ids("a", " 8 9 10", &[8, 9, 10], None), &mut out);
        assert_eq!(splicer.tokens(), 3);
        assert!(splicer.by_ids());
        // The client did not ask for ids: it sees them as a node not asked sends them, null.
        let got = chunks(&out);
        assert_eq!(got[0]["prompt_token_ids"], Value::Null);
        assert_eq!(got[1]["choices"][0]["token_ids"], Value::Null);
        assert_eq!(got[1]["choices"][0]["delta"]["content"], " 8 9 10");

        let AfterCut::Continue(next) = splicer.cut(&mut BytesMut::new()) else {
            panic!("continued");
        };
        assert_eq!(
            (next.path, next.exact),
            (Some(crate::openai::COMPLETIONS_PATH), true)
        );
        let body: Value = serde_json::from_slice(&next.body).unwrap();
        assert_eq!(body["prompt"], json!([11, 12, 13, 8, 9, 10]));
        assert_eq!(body["max_tokens"], 3);
        assert_eq!(body["return_token_ids"], true);
        assert!(body.get("messages").is_none());

        // The completion that continues it, spliced as the client's chat stream.
        splicer.next_piece();
        let mut out = BytesMut::new();
        let first = json!({"id": "cmpl-b", "object": "text_completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "text": " 11", "logprobs": null, "finish_reason": null,
            "token_ids": [11], "prompt_token_ids": [11, 12, 13, 8, 9, 10]}]});
        splicer.event(&event(first), &mut out);
        let last = json!({"id": "cmpl-b", "object": "text_completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "text": " 12 13", "logprobs": null, "finish_reason": "length",
            "stop_reason": null, "token_ids": [12, 13]}]});
        splicer.event(&event(last), &mut out);
        let usage = json!({"id": "cmpl-b", "object": "text_completion", "created": 5, "model": "m",
            "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}});
        splicer.event(&event(usage), &mut out);
        splicer.event(b"data: [DONE]\n\n", &mut out);
        let got = chunks(&out);
        for chunk in &got[..2] {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!((&chunk["id"], &chunk["created"]), (&json!("a"), &json!(1)));
            assert_eq!(chunk["choices"][0]["token_ids"], Value::Null);
            assert!(chunk["choices"][0].get("prompt_token_ids").is_none());
            assert!(chunk["choices"][0].get("text").is_none());
        }
        assert_eq!(got[0]["choices"][0]["delta"], json!({"content": " 11"}));
        assert_eq!(got[1]["choices"][0]["finish_reason"], "length");
        assert_eq!(
            got[2]["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9})
        );
        assert_eq!(got[3], "[DONE]");
        assert_eq!(splicer.text(), " 8 9 10 11 12 13");
        assert_eq!(splicer.tokens(), 6);
    }

    #[test]
    fn a_client_that_asked_for_ids_keeps_them_and_a_continuation_says_the_new_ones() {
        let body =
            json!({"stream": true, "prompt": "go", "max_tokens": 4, "return_token_ids": true});
        let request =
            Continuable::read(Api::Completions, &bytes::Bytes::from(body.to_string())).unwrap();
        assert!(request.asking_ids().is_none(), "asked already");
        let mut splicer = Splicer::new(request);
        splicer.asked_ids();
        let first = event(
            json!({"id": "a", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": " 1", "token_ids": [1], "prompt_token_ids": [7]}]}),
        );
        let mut out = BytesMut::new();
        splicer.event(&first, &mut out);
        assert_eq!(&out[..], &first[..], "passed byte for byte");
        let AfterCut::Continue(next) = splicer.cut(&mut BytesMut::new()) else {
            panic!("continued");
        };
        let body: Value = serde_json::from_slice(&next.body).unwrap();
        assert_eq!(
            (body["prompt"].clone(), body["max_tokens"].clone()),
            (json!([7, 1]), json!(3))
        );
        splicer.next_piece();
        let mut out = BytesMut::new();
        splicer.event(
            &event(
                json!({"id": "b", "object": "text_completion", "created": 2, "model": "m",
            "choices": [{"index": 0, "text": " 2", "token_ids": [2], "prompt_token_ids": [7, 1]}]}),
            ),
            &mut out,
        );
        let got = chunks(&out);
        assert_eq!(got[0]["choices"][0]["token_ids"], json!([2]));
        assert_eq!(got[0]["choices"][0]["prompt_token_ids"], Value::Null);
        assert_eq!(got[0]["id"], "a");
    }

    #[test]
    fn a_chunk_without_its_ids_falls_back_to_text_and_says_so() {
        let mut splicer = chat(false, 9);
        splicer.asked_ids();
        let mut out = BytesMut::new();
        splicer.event(
            &event(json!({"id": "a", "prompt_token_ids": [1],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
            &mut out,
        );
        splicer.event(&token_ids("a", " 8", &[8], None), &mut out);
        splicer.event(&token("a", 1, " 9", None), &mut out);
        assert!(!splicer.by_ids());
        let AfterCut::Continue(next) = splicer.cut(&mut BytesMut::new()) else {
            panic!("continued");
        };
        assert_eq!((next.path, next.exact), (None, false));
        let body: Value = serde_json::from_slice(&next.body).unwrap();
        assert_eq!(body["messages"][1]["content"], " 8 9");
    }

    #[test]
    fn a_stream_cut_before_its_first_token_is_sent_again_asking_for_ids() {
        let mut splicer = chat(false, 9);
        splicer.asked_ids();
        let AfterCut::Continue(next) = splicer.cut(&mut BytesMut::new()) else {
            panic!("continued");
        };
        let body: Value = serde_json::from_slice(&next.body).unwrap();
        assert_eq!(
            (next.path, body["return_token_ids"].clone()),
            (None, json!(true))
        );
        assert_eq!(body["messages"][0]["content"], "count: 7");
    }

    #[test]
    fn a_chunk_of_ids_alone_is_counted_and_not_sent_to_a_client_that_did_not_ask() {
        let mut splicer = chat(false, 9);
        splicer.asked_ids();
        let mut out = BytesMut::new();
        splicer.event(
            &event(json!({"id": "a", "prompt_token_ids": [1],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
            &mut out,
        );
        let held = event(json!({"id": "a", "choices": [{"index": 0, "delta": {},
            "logprobs": null, "finish_reason": null, "token_ids": [200]}]}));
        let before = out.len();
        splicer.event(&held, &mut out);
        assert_eq!(out.len(), before, "not sent");
        splicer.event(&token_ids("a", "é", &[201], None), &mut out);
        assert_eq!(splicer.tokens(), 2);
        assert_eq!(splicer.text(), "é");
    }

    #[test]
    fn reasoning_is_not_continued() {
        for key in ["reasoning_content", "reasoning"] {
            let mut splicer = chat(false, 9);
            let chunk =
                json!({"id": "a", "choices": [{"index": 0, "delta": {key: "let me think"}}]});
            splicer.event(&event(chunk), &mut BytesMut::new());
            assert_eq!(
                splicer.cut(&mut BytesMut::new()),
                AfterCut::Refused("reasoning in the stream"),
                "{key}"
            );
        }
    }
}

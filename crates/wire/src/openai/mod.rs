//! The OpenAI protocol, as far as tongs reads it: which streamed requests can be continued on another
//! node when theirs breaks, the request that continues one, and the splice of the pieces into one
//! stream for the client.
//!
//! Pure: bytes in, bytes out, no I/O and no clock, so every rule is tested here without a socket.
//!
//! - [`Continuable`]: a `POST /v1/completions` or `/v1/chat/completions` with `"stream": true` that
//!   can be continued, read once from the buffered request body;
//! - [`Splicer`]: what the client has been sent so far, the continuation request, and the rewriting of
//!   a continuation's chunks into the first piece's stream;
//! - [`sse`]: the stream cut into whole events;
//! - [`prefix`]: the prompt's chained block hashes and conversation key, for cache affinity;
//! - [`model_of`]: the `model` a request body names, and [`with_model`] the body naming another.

mod head;
mod ids;
mod model;
pub mod prefix;
pub mod splice;
pub mod sse;

use bytes::Bytes;
use serde_json::Value;
use serde_json::value::RawValue;

use head::Head;

pub use ids::{COMPLETIONS_PATH, RETURN_TOKEN_IDS};
pub use model::{DuplicateModel, ModelField, model_of, read_model, with_model};
pub use splice::{AfterCut, Resumption, Splicer};

/// Which OpenAI API a request speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/completions`: the text is each chunk's `choices[0].text`.
    Completions,
    /// `POST /v1/chat/completions`: the text is each chunk's `choices[0].delta.content`.
    Chat,
}

impl Api {
    /// The API a request path names (the query aside), if one whose streams can be continued.
    pub fn of_path(path: &str) -> Option<Api> {
        match path {
            "/v1/completions" => Some(Api::Completions),
            "/v1/chat/completions" => Some(Api::Chat),
            _ => None,
        }
    }
}

/// A streamed generation request that tongs can continue on another node.
#[derive(Clone, Debug)]
pub struct Continuable {
    pub api: Api,
    /// The request body as the client sent it (shared with the copy kept for replay, and parsed again
    /// only when a continuation is needed, so a stream holds no second, larger copy of its prompt).
    body: Bytes,
    /// The client asked for a `usage` chunk (`stream_options.include_usage`).
    pub usage_wanted: bool,
    /// The token limit the client asked for, if any.
    max_tokens: Option<u64>,
    /// The client asked for token ids itself (`return_token_ids`): they are its to see.
    ids_asked: bool,
}

/// Why a streamed request is not continued when its node breaks (listed in `docs/design.md`, "Not continued").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotContinuable {
    /// Not one of the two paths, not a JSON object, or not `"stream": true`: nothing to continue.
    NotAStream,
    /// `n` or `best_of` above 1: several generations share the stream.
    SeveralChoices,
    /// `logprobs` or `top_logprobs`: a continuation's log probabilities would be of another context.
    Logprobs,
    /// `echo`: a continuation would echo the prompt again.
    Echo,
    /// A prompt that is not one string (token ids, a batch): the text so far cannot be appended.
    Prompt,
    /// `messages` not a list.
    Messages,
    /// A constrained output (`response_format` other than text, `guided_*`, `structured_outputs`,
    /// SGLang's `regex` and `ebnf`): the grammar would restart.
    Constrained,
    /// `max_tokens` or `max_completion_tokens` not a whole number.
    MaxTokens,
}

impl NotContinuable {
    pub fn as_str(self) -> &'static str {
        match self {
            NotContinuable::NotAStream => "not a stream",
            NotContinuable::SeveralChoices => "n or best_of above 1",
            NotContinuable::Logprobs => "logprobs",
            NotContinuable::Echo => "echo",
            NotContinuable::Prompt => "prompt not one string",
            NotContinuable::Messages => "messages not a list",
            NotContinuable::Constrained => "constrained output",
            NotContinuable::MaxTokens => "max_tokens not a whole number",
        }
    }
}

/// The token-limit fields a continuation reduces.
const MAX_TOKEN_FIELDS: [&str; 2] = ["max_tokens", "max_completion_tokens"];

impl Continuable {
    /// Reads a request whose whole body is `raw`.
    pub fn read(api: Api, raw: &Bytes) -> Result<Continuable, NotContinuable> {
        // Only the fields that decide are read (see [`head`]): the conversation is skipped, not built.
        let Ok(head) = serde_json::from_slice::<Head>(raw) else {
            return Err(NotContinuable::NotAStream);
        };
        // A small value (a flag, a number, `response_format`) as `serde_json::Value` reads it.
        let value = |raw: Option<&RawValue>| {
            raw.map_or(Value::Null, |raw| {
                serde_json::from_str(raw.get()).unwrap_or(Value::Null)
            })
        };
        if value(head.stream) != Value::Bool(true) {
            return Err(NotContinuable::NotAStream);
        }
        let above_one = |raw| value(raw).as_u64().is_some_and(|n| n > 1);
        if above_one(head.n) || above_one(head.best_of) {
            return Err(NotContinuable::SeveralChoices);
        }
        let truthy =
            |raw: Option<&RawValue>| raw.is_some_and(|v| !matches!(v.get(), "null" | "false"));
        if truthy(head.logprobs) || truthy(head.top_logprobs) {
            return Err(NotContinuable::Logprobs);
        }
        if truthy(head.echo) {
            return Err(NotContinuable::Echo);
        }
        let format = value(head.response_format);
        let text_format =
            format.is_null() || format.get("type").and_then(Value::as_str) == Some("text");
        if !text_format
            || head.guided()
            || truthy(head.structured_outputs)
            || truthy(head.regex)
            || truthy(head.ebnf)
        {
            return Err(NotContinuable::Constrained);
        }
        for key in MAX_TOKEN_FIELDS {
            let limit = value(head.max_token_field(key));
            if !limit.is_null() && !limit.is_u64() {
                return Err(NotContinuable::MaxTokens);
            }
        }
        let is_string = |raw: &RawValue| raw.get().starts_with('"');
        match api {
            Api::Completions => match head.prompt {
                Some(prompt) if is_string(prompt) => {}
                Some(prompt) if prompt.get().starts_with('[') => {
                    let items: Vec<&RawValue> =
                        serde_json::from_str(prompt.get()).unwrap_or_default();
                    if !(items.len() == 1 && is_string(items[0])) {
                        return Err(NotContinuable::Prompt);
                    }
                }
                _ => return Err(NotContinuable::Prompt),
            },
            Api::Chat => {
                if !head.messages.is_some_and(|m| m.get().starts_with('[')) {
                    return Err(NotContinuable::Messages);
                }
            }
        }
        let usage_wanted = value(head.stream_options)
            .get("include_usage")
            .is_some_and(|v| *v == Value::Bool(true));
        let max_tokens = MAX_TOKEN_FIELDS
            .iter()
            .find_map(|key| value(head.max_token_field(key)).as_u64());
        let ids_asked = value(head.return_token_ids) == Value::Bool(true);
        Ok(Continuable {
            api,
            body: raw.clone(),
            usage_wanted,
            max_tokens,
            ids_asked,
        })
    }

    /// Whether the client asked for token ids itself.
    pub fn ids_asked(&self) -> bool {
        self.ids_asked
    }

    /// The body to send the first node so that its stream carries token ids (see [`ids`]): the
    /// client's, with `"return_token_ids": true`; `None` when it asked already.
    pub fn asking_ids(&self) -> Option<Vec<u8>> {
        if self.ids_asked {
            return None;
        }
        let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(&self.body) else {
            return None;
        };
        body.insert(RETURN_TOKEN_IDS.into(), Value::Bool(true));
        serde_json::to_vec(&Value::Object(body)).ok()
    }

    /// The completion that continues the generation exactly after the answer's token ids `answer`,
    /// the prompt's being `prompt` (see [`ids`]); sent to [`COMPLETIONS_PATH`].
    pub fn continuation_by_ids(&self, prompt: &[u32], answer: &[u32]) -> Vec<u8> {
        let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(&self.body) else {
            return self.body.to_vec();
        };
        let body = ids::continuation(self.api, body, prompt, answer);
        serde_json::to_vec(&Value::Object(body)).unwrap_or_default()
    }

    /// The token limit the client asked for, if any.
    pub fn max_tokens(&self) -> Option<u64> {
        self.max_tokens
    }

    /// The request that continues the generation after `text` (`tokens` of it): the original body
    /// changed as little as possible. The text is appended to the prompt (completions) or sent as the
    /// assistant message to continue (chat: vLLM's and SGLang's `continue_final_message`), and the
    /// token limits are lowered by what was streamed.
    pub fn continuation(&self, text: &str, tokens: u64) -> Vec<u8> {
        // Read as a continuable request before, so an object.
        let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(&self.body) else {
            return self.body.to_vec();
        };
        for key in MAX_TOKEN_FIELDS {
            if let Some(max) = body.get_mut(key)
                && let Some(n) = max.as_u64()
            {
                *max = Value::from(n.saturating_sub(tokens).max(1));
            }
        }
        if !text.is_empty() {
            match self.api {
                Api::Completions => match body.get_mut("prompt") {
                    Some(Value::String(prompt)) => prompt.push_str(text),
                    Some(Value::Array(items)) => {
                        if let Some(Value::String(prompt)) = items.first_mut() {
                            prompt.push_str(text);
                        }
                    }
                    _ => {}
                },
                Api::Chat => {
                    let continuing = body.get("continue_final_message") == Some(&Value::Bool(true));
                    if let Some(Value::Array(messages)) = body.get_mut("messages") {
                        let last_assistant = messages.last_mut().filter(|m| {
                            continuing && m.get("role").and_then(Value::as_str) == Some("assistant")
                        });
                        match last_assistant.and_then(|m| m.get_mut("content")) {
                            // The client itself was continuing an assistant message: extend it.
                            Some(Value::String(content)) => content.push_str(text),
                            _ => messages.push(serde_json::json!({
                                "role": "assistant",
                                "content": text,
                            })),
                        }
                    }
                    body.insert("continue_final_message".into(), Value::Bool(true));
                    body.insert("add_generation_prompt".into(), Value::Bool(false));
                }
            }
        }
        serde_json::to_vec(&Value::Object(body)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn read(api: Api, body: Value) -> Result<Continuable, NotContinuable> {
        Continuable::read(api, &Bytes::from(body.to_string()))
    }

    #[test]
    fn only_streams_that_can_be_continued_safely_are() {
        let chat = |extra: Value| {
            let mut body = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            read(Api::Chat, body).map(|c| c.usage_wanted)
        };
        assert_eq!(chat(json!({})), Ok(false));
        assert_eq!(
            chat(json!({"stream_options": {"include_usage": true}, "n": 1, "logprobs": false})),
            Ok(true)
        );
        assert_eq!(
            chat(json!({"stream": false})),
            Err(NotContinuable::NotAStream)
        );
        assert_eq!(chat(json!({"n": 2})), Err(NotContinuable::SeveralChoices));
        assert_eq!(
            chat(json!({"logprobs": true})),
            Err(NotContinuable::Logprobs)
        );
        assert_eq!(
            chat(json!({"top_logprobs": 3})),
            Err(NotContinuable::Logprobs)
        );
        assert_eq!(
            chat(json!({"response_format": {"type": "json_object"}})),
            Err(NotContinuable::Constrained)
        );
        assert_eq!(
            chat(json!({"guided_json": {}})),
            Err(NotContinuable::Constrained)
        );
        // SGLang's grammars, beside the sampling fields.
        assert_eq!(
            chat(json!({"regex": "[0-9]+"})),
            Err(NotContinuable::Constrained)
        );
        assert_eq!(
            chat(json!({"ebnf": "root ::= \"a\""})),
            Err(NotContinuable::Constrained)
        );
        assert_eq!(chat(json!({"regex": null})), Ok(false));
        assert_eq!(
            chat(json!({"max_tokens": "ten"})),
            Err(NotContinuable::MaxTokens)
        );
        assert_eq!(
            chat(json!({"messages": "hi"})),
            Err(NotContinuable::Messages)
        );
        assert_eq!(
            Continuable::read(Api::Chat, &Bytes::from_static(b"not json")).map(|_| ()),
            Err(NotContinuable::NotAStream)
        );
        // What the quick read of `stream` cannot settle, the full read does, as before.
        for (body, continuable) in [
            (r#"{"stream":"true","messages":[]}"#, false),
            (r#"{"stream":false,"stream":true,"messages":[]}"#, true),
            (r#"{"stream":true,"stream":false,"messages":[]}"#, false),
            (r#"{"messages":[],"stream":true}"#, true),
        ] {
            let read = Continuable::read(Api::Chat, &Bytes::from(body));
            assert_eq!(read.is_ok(), continuable, "{body}: {:?}", read.map(|_| ()));
        }

        let completion = |prompt: Value, extra: Value| {
            let mut body = json!({"stream": true, "prompt": prompt});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            read(Api::Completions, body).map(|_| ())
        };
        assert_eq!(completion(json!("count"), json!({})), Ok(()));
        assert_eq!(completion(json!(["count"]), json!({})), Ok(()));
        assert_eq!(
            completion(json!([1, 2, 3]), json!({})),
            Err(NotContinuable::Prompt)
        );
        assert_eq!(
            completion(json!(["a", "b"]), json!({})),
            Err(NotContinuable::Prompt)
        );
        assert_eq!(
            completion(json!("x"), json!({"echo": true})),
            Err(NotContinuable::Echo)
        );
        assert_eq!(
            completion(json!("x"), json!({"best_of": 3})),
            Err(NotContinuable::SeveralChoices)
        );
    }

    fn continued(api: Api, body: Value, text: &str, tokens: u64) -> Value {
        let request = read(api, body).unwrap();
        serde_json::from_slice(&request.continuation(text, tokens)).unwrap()
    }

    #[test]
    fn a_completion_continues_with_the_text_appended_to_its_prompt() {
        let body = json!({"model": "m", "stream": true, "prompt": "count: 7", "max_tokens": 10, "temperature": 0});
        assert_eq!(
            continued(Api::Completions, body, " 8 9", 2),
            json!({"model": "m", "stream": true, "prompt": "count: 7 8 9", "max_tokens": 8, "temperature": 0})
        );
        let listed = json!({"stream": true, "prompt": ["count: 7"]});
        assert_eq!(
            continued(Api::Completions, listed, " 8", 1),
            json!({"stream": true, "prompt": ["count: 7 8"]})
        );
    }

    #[test]
    fn a_chat_continues_its_assistant_message() {
        let body = json!({"stream": true, "max_completion_tokens": 5,
            "messages": [{"role": "user", "content": "count: 7"}]});
        assert_eq!(
            continued(Api::Chat, body, " 8 9", 2),
            json!({"stream": true, "max_completion_tokens": 3,
                "messages": [{"role": "user", "content": "count: 7"}, {"role": "assistant", "content": " 8 9"}],
                "continue_final_message": true, "add_generation_prompt": false})
        );
        // A client already continuing its own assistant message: that message grows.
        let own = json!({"stream": true, "continue_final_message": true, "add_generation_prompt": false,
            "messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1 2"}]});
        assert_eq!(
            continued(Api::Chat, own, " 3", 1)["messages"],
            json!([{"role": "user", "content": "count"}, {"role": "assistant", "content": "1 2 3"}])
        );
    }

    #[test]
    fn nothing_streamed_yet_sends_the_request_again_and_a_limit_never_drops_below_one() {
        let body = json!({"stream": true, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4});
        assert_eq!(continued(Api::Chat, body.clone(), "", 0), body);
        assert_eq!(continued(Api::Chat, body, " a b c d e", 9)["max_tokens"], 1);
    }
}

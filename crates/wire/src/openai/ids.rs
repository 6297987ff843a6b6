//! Token ids: what makes a continuation exact.
//!
//! Continuing from the *text* so far is exact only when the next node tokenizes that text into the
//! very tokens the model produced, and a byte-level tokenizer often does not (on a small model, one
//! continuation in two changed the answer). vLLM returns the prompt's token ids and each chunk's when a
//! request asks `"return_token_ids": true`, and its `POST /v1/completions` takes a prompt of token ids;
//! so a stream whose ids tongs kept is continued by a completion whose prompt is the prompt's ids and
//! the answer's, which reproduces the rest of a greedy answer token for token. What the client did not
//! ask for it never sees: tongs asks for the ids itself and hides them again ([`hide`]).

use serde_json::{Map, Value};

use super::{Api, MAX_TOKEN_FIELDS};

/// The request field that asks vLLM for token ids.
pub const RETURN_TOKEN_IDS: &str = "return_token_ids";

/// The path a continuation by token ids is sent to, whatever the client's API.
pub const COMPLETIONS_PATH: &str = "/v1/completions";

/// The token limit of a continuation whose client asked for none: as large as a 32-bit count allows.
pub const NO_LIMIT: u64 = i32::MAX as u64;

/// The fields of a chat request that a completion continuing it by token ids keeps: the model and
/// how to sample, which both APIs share (vLLM's `ChatCompletionRequest` and `CompletionRequest`). The
/// conversation, its template and its tools are already in the prompt's ids.
const CHAT_FIELDS_KEPT: [&str; 27] = [
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "user",
    "priority",
    "stream_options",
    "cache_salt",
    "vllm_xargs",
    "kv_transfer_params",
    "truncate_prompt_tokens",
];

/// The ids one chunk carries: the prompt's (its first chunk) and its own tokens'. `None`: the field
/// is missing or null; `Some(Err(()))`: present but not a list of ids.
#[derive(Debug, Default)]
pub(super) struct ChunkIds {
    pub prompt: Option<Result<Vec<u32>, ()>>,
    pub tokens: Option<Result<Vec<u32>, ()>>,
}

fn ids_of(value: Option<&Value>) -> Option<Result<Vec<u32>, ()>> {
    let value = value.filter(|v| !v.is_null())?;
    let Some(items) = value.as_array() else {
        return Some(Err(()));
    };
    Some(
        items
            .iter()
            .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or(()))
            .collect(),
    )
}

/// The ids of `chunk`'s first choice; the prompt's are top-level in a chat chunk and in the choice in
/// a completion's (vLLM's shapes), and both places are looked at for either API.
pub(super) fn read(chunk: &Map<String, Value>) -> ChunkIds {
    let choice = chunk
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first());
    ChunkIds {
        prompt: ids_of(chunk.get("prompt_token_ids"))
            .or_else(|| ids_of(choice.and_then(|c| c.get("prompt_token_ids")))),
        tokens: ids_of(choice.and_then(|c| c.get("token_ids"))),
    }
}

/// Sets the token ids of `chunk` to `null`, as a node sends them when not asked; whether any were
/// there. `prompt` too: a continuation's prompt ids are never the client's.
pub(super) fn hide(chunk: &mut Map<String, Value>, tokens: bool, prompt: bool) -> bool {
    let mut changed = false;
    let mut null = |value: Option<&mut Value>| {
        if let Some(value) = value.filter(|v| !v.is_null()) {
            *value = Value::Null;
            changed = true;
        }
    };
    if prompt {
        null(chunk.get_mut("prompt_token_ids"));
    }
    if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            if tokens {
                null(choice.get_mut("token_ids"));
            }
            if prompt {
                null(choice.get_mut("prompt_token_ids"));
            }
        }
    }
    changed
}

/// The body of a completion that continues `body` (the client's request, of `api`) by token ids:
/// the prompt's ids then the answer's so far (`tokens` of them) as its prompt, the token limits lowered
/// by those, the ids asked for again. Without a limit the completion gets [`NO_LIMIT`]: vLLM's
/// completions stop at 16 tokens when given none (or `null`), where its chat goes to the model's
/// length, and it holds any larger limit to the model's length.
pub(super) fn continuation(
    api: Api,
    mut body: Map<String, Value>,
    prompt: &[u32],
    answer: &[u32],
) -> Map<String, Value> {
    let tokens = answer.len() as u64;
    let limit = MAX_TOKEN_FIELDS
        .iter()
        .find_map(|key| body.get(*key).and_then(Value::as_u64));
    let lowered = |n: u64| Value::from(n.saturating_sub(tokens).max(1));
    if let Some(min) = body.get_mut("min_tokens")
        && let Some(n) = min.as_u64()
    {
        *min = Value::from(n.saturating_sub(tokens));
    }
    let mut out = match api {
        Api::Completions => body,
        Api::Chat => {
            let mut kept = Map::new();
            for key in CHAT_FIELDS_KEPT {
                if let Some(value) = body.remove(key) {
                    kept.insert(key.to_owned(), value);
                }
            }
            kept
        }
    };
    for key in MAX_TOKEN_FIELDS {
        out.remove(key);
    }
    out.insert(
        "max_tokens".into(),
        limit.map_or(Value::from(NO_LIMIT), lowered),
    );
    let ids: Vec<Value> = prompt.iter().chain(answer).map(|&id| id.into()).collect();
    out.insert("prompt".into(), Value::Array(ids));
    out.insert("stream".into(), Value::Bool(true));
    out.insert(RETURN_TOKEN_IDS.into(), Value::Bool(true));
    out
}

/// A chunk that carries token ids and nothing else: no text, no finish, no usage. vLLM sends these
/// only when asked for ids (a token whose text it holds back: part of a character, or of a stop
/// string), so a client that did not ask is not sent them.
pub(super) fn only_ids(chunk: &Map<String, Value>) -> bool {
    let Some([choice]) = chunk
        .get("choices")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    else {
        return false;
    };
    let empty_text = choice
        .get("text")
        .is_none_or(|t| t.is_null() || t.as_str() == Some(""));
    let empty_delta = choice.get("delta").is_none_or(|d| {
        d.as_object()
            .is_some_and(|d| d.values().all(Value::is_null))
    });
    let has_ids = choice
        .get("token_ids")
        .and_then(Value::as_array)
        .is_some_and(|ids| !ids.is_empty());
    has_ids
        && empty_text
        && empty_delta
        && choice.get("finish_reason").is_none_or(Value::is_null)
        && choice.get("logprobs").is_none_or(Value::is_null)
        && chunk.get("usage").is_none_or(Value::is_null)
}

/// A continuation's completion chunk in the shape of the client's chat stream: its text as the
/// delta's content, everything else of the choice kept (`finish_reason`, `stop_reason`, the ids).
pub(super) fn as_chat_chunk(chunk: &mut Map<String, Value>) {
    if chunk.get("object").and_then(Value::as_str) == Some("text_completion") {
        chunk.insert("object".into(), "chat.completion.chunk".into());
    }
    let Some(Value::Array(choices)) = chunk.get_mut("choices") else {
        return;
    };
    for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
        if let Some(text) = choice.remove("text") {
            let mut delta = Map::new();
            delta.insert("content".into(), text);
            choice.insert("delta".into(), Value::Object(delta));
        }
        choice.remove("prompt_token_ids");
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn map(value: Value) -> Map<String, Value> {
        let Value::Object(map) = value else {
            panic!("an object")
        };
        map
    }

    #[test]
    fn ids_are_read_where_each_api_puts_them() {
        let chat = map(json!({"prompt_token_ids": [1, 2],
            "choices": [{"delta": {"content": "a"}, "token_ids": [7]}]}));
        let read = read(&chat);
        assert_eq!(read.prompt, Some(Ok(vec![1, 2])));
        assert_eq!(read.tokens, Some(Ok(vec![7])));
        let completion =
            map(json!({"choices": [{"text": "a", "prompt_token_ids": [3], "token_ids": [8, 9]}]}));
        let read = super::read(&completion);
        assert_eq!(read.prompt, Some(Ok(vec![3])));
        assert_eq!(read.tokens, Some(Ok(vec![8, 9])));
        let none = super::read(&map(json!({"choices": [{"text": "a", "token_ids": null}]})));
        assert_eq!((none.prompt, none.tokens), (None, None));
        let bad = super::read(&map(json!({"choices": [{"token_ids": [1, -2]}]})));
        assert_eq!(bad.tokens, Some(Err(())));
        let huge = super::read(&map(json!({"choices": [{"token_ids": [4294967296u64]}]})));
        assert_eq!(huge.tokens, Some(Err(())));
    }

    #[test]
    fn hidden_ids_read_as_a_node_not_asked_for_them_sends_them() {
        let mut chunk = map(json!({"prompt_token_ids": [1],
            "choices": [{"delta": {"content": "a"}, "token_ids": [7]}]}));
        assert!(hide(&mut chunk, true, true));
        assert_eq!(
            Value::Object(chunk.clone()),
            json!({"prompt_token_ids": null, "choices": [{"delta": {"content": "a"}, "token_ids": null}]})
        );
        assert!(!hide(&mut chunk, true, true), "nothing left to hide");
    }

    #[test]
    fn a_chat_continues_as_a_completion_of_its_ids_with_its_sampling_kept() {
        let body = map(
            json!({"model": "m", "stream": true, "max_completion_tokens": 10,
            "temperature": 0, "stop": ["\n"], "min_tokens": 4, "tools": [],
            "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}),
        );
        let out = continuation(Api::Chat, body, &[1, 2], &[7, 8, 9]);
        assert_eq!(
            Value::Object(out),
            json!({"model": "m", "temperature": 0, "stop": ["\n"], "min_tokens": 1,
                "stream_options": {"include_usage": true}, "max_tokens": 7,
                "prompt": [1, 2, 7, 8, 9], "stream": true, "return_token_ids": true})
        );
        // No limit asked: the largest (vLLM's completions would stop at 16 without one).
        let body = map(json!({"stream": true, "messages": []}));
        assert_eq!(
            continuation(Api::Chat, body, &[1], &[2])["max_tokens"],
            json!(NO_LIMIT)
        );
    }

    #[test]
    fn a_completion_keeps_its_own_body_with_the_ids_for_prompt() {
        let body = map(
            json!({"model": "m", "stream": true, "prompt": "go", "max_tokens": 3, "suffix": "x"}),
        );
        let out = continuation(Api::Completions, body, &[5], &[6, 7, 8, 9]);
        assert_eq!(
            Value::Object(out),
            json!({"model": "m", "stream": true, "prompt": [5, 6, 7, 8, 9], "max_tokens": 1,
                "suffix": "x", "return_token_ids": true})
        );
    }

    #[test]
    fn a_completion_chunk_reads_as_a_chat_chunk() {
        let mut chunk = map(json!({"id": "c", "object": "text_completion",
            "choices": [{"index": 0, "text": " b", "token_ids": [9], "prompt_token_ids": [1],
            "finish_reason": "length", "stop_reason": null}]}));
        as_chat_chunk(&mut chunk);
        assert_eq!(
            Value::Object(chunk),
            json!({"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": " b"}, "token_ids": [9],
                "finish_reason": "length", "stop_reason": null}]})
        );
    }
}

//! A fake of vLLM's OpenAI-compatible server for `POST /v1/completions` and
//! `POST /v1/chat/completions`, with a deterministic model: a test client knows the exact text every
//! request must produce, so it can check that a stream broken on one node and continued on another
//! reads as one unbroken answer.
//!
//! These requests are admitted like any other (capacity, waiting line, shedding, interruptions); only
//! the answer differs. On a node with an engine they are read first and then wait for a place in the
//! batch without bound (see `engine.rs`). Whether it is streamed depends on the request's `stream` field alone, not on
//! the node's `response` kind or the `Accept` header.
//!
//! # Requests
//! A JSON object with `model` (echoed back, default `"sim"`), `stream`, `stream_options.include_usage`
//! and `max_tokens` (for chat also `max_completion_tokens`, which wins; an integer from 1 to
//! [`MAX_TOKENS`], default the node's `tokens`). Completions take a `prompt`, a string, an array of
//! exactly one string, or an array of token ids (below); chat takes `messages`, an array of `{role, content}` with string content, and
//! `add_generation_prompt` (default true) and `continue_final_message` (default false): both true, or
//! a continued final message that is not the assistant's, is refused as vLLM refuses it. A `null`
//! field counts as absent; unknown fields are ignored. Anything else malformed gets `400` in vLLM's
//! error shape: `{"object":"error","message":"...","type":"BadRequestError","param":null,"code":400}`.
//!
//! # The model
//! The context is the prompt, or every message's content joined with one space (a final assistant
//! message being continued included). It starts counting from the context's last integer (its last
//! run of ASCII digits, saturating at `u64::MAX`; 0 if none): token `i` (from 1) is ` {start + i}`.
//! It generates `max_tokens` tokens and stops with `finish_reason: "length"`. `prompt_tokens` is the
//! context's number of whitespace-separated words, `completion_tokens` the tokens generated. So
//! `"count: 7"` with `max_tokens: 5` gives `" 8 9 10 11 12"`, and continuing it from `"count: 7 8 9"`
//! with `max_tokens: 3` gives `" 10 11 12"`: the same text.
//!
//! # Token ids
//! One token a whitespace-separated word: a number's id is its value, any other word's an id from its
//! bytes at or above 2³¹. With `"return_token_ids": true` (vLLM's field) every chunk carries its
//! `token_ids`, and the first the prompt's `prompt_token_ids` (top-level in a chat chunk, in the choice
//! of a completion's), as vLLM's do; a prompt of ids continues where its last number left off, so a
//! completion of the prompt's ids and the answer's so far gives the rest of the answer exactly. A node
//! with `chunk_tokens` above 1 puts that many tokens in each chunk, as vLLM does under load.
//!
//! # Answers
//! Ids are `cmpl-{node}-{n}` and `chatcmpl-{node}-{n}`, `n` counting the node's answers from 1;
//! `created` is the request's Unix time in seconds. A stream (`Content-Type: text/event-stream`, its
//! headers sent at once) sends each event as one body frame, `data: <compact JSON>\n\n`: for chat a
//! role chunk (`"delta":{"role":"assistant","content":""}`), then one chunk per token, the last one
//! carrying `"finish_reason":"length"`; with `include_usage` a chunk with `"choices":[]` and the usage;
//! then `data: [DONE]`, and the request counts as served. A client that goes away stops the generation.
//!
//! # Timing
//! Drawn once per request when it is admitted (see [`super::stream::TokenTiming`]):
//! - the first token: after a tenth of the service time, the chat role chunk just before it. On a node
//!   with a `first_token` wait, after that wait instead (`wait + per_prompt_word × prompt_tokens +
//!   per_in_flight × the other requests in flight`, spread, times a `slow` factor), the chat role chunk
//!   sent at once before it (as a server whose API layer answers before its engine does; vLLM sends
//!   it with the first token, so there the wait comes before the first chunk): a continued request,
//!   whose prompt holds the answer so far, waits longer than the one it continues;
//! - with `comment_every`, an SSE comment `: ping` at once (after the role chunk if it went at once)
//!   and then at that interval until the first token; vLLM sends none, some servers and gateways do;
//! - on a node with an engine, the first token comes that much later again: the prefill of the
//!   context's words not in the prefix cache, `prefill_per_word` each, times a `slow` factor;
//! - the next tokens every `service_time × 0.9 / tokens` (the node's `tokens`, so the pace does not
//!   depend on `max_tokens`);
//! - on a node with `preemption`, a stream drawn preempted pauses once, after a token drawn among all
//!   but its last, for the preemption's pause, then goes on at its pace: a healthy node, its heartbeats
//!   and other streams flowing meanwhile;
//! - a gray node stalls after the first token until it recovers.
//!
//! A whole answer comes when its stream's last token would: after the service time, or with a
//! first-token wait after that wait and nine tenths of the service time, plus the pause if drawn
//! preempted (a gray node holds it until it recovers).
//!
//! # Test hook: `x-sim-cut`
//! A request header of this fake server, not of vLLM, to break streams at a chosen point: a
//! comma-separated list of `N` or `N:how`. Right after sending the chunk of the token whose number is
//! `N` (text ` N`), the node breaks the stream:
//! - `reset` (the default): the connection is reset (SO_LINGER 0, the client sees RST);
//! - `close`: the body ends cleanly there, without `[DONE]`;
//! - `stall`: nothing more is sent, and the stream stays open until the client goes away.
//!
//! `N` is the token's number, not its place in the stream, so a stream continued elsewhere after `N`
//! is not cut there again: `4,9:stall` breaks one answer twice, whichever nodes serve its parts. Only
//! streams are cut; a malformed list gets `400`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, Method, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::engine::Sequence;
use super::node::{NodeShared, Serving, while_gray};
use super::reply::{EventFeed, SimBody, full, sse_response};
use super::stream::{TokenTiming, before_first_token, before_next_token, send};
use wire::{AnswerHead, Usage};

mod tokens;
mod wire;

use tokens::{WORD_IDS, context_of, id_prompt, token_ids};

/// Most tokens one request may ask for: a whole answer is built in memory, and this bounds it (about
/// 8 MB) as the node bounds request bodies.
const MAX_TOKENS: u64 = 1 << 20;

/// Which of the two OpenAI APIs a request speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ServedApi {
    Completions,
    Chat,
}

impl ServedApi {
    /// The API at `method` and `path`, if it is one of the two.
    pub(super) fn route(method: &Method, path: &str) -> Option<ServedApi> {
        match (method, path) {
            (&Method::POST, "/v1/completions") => Some(ServedApi::Completions),
            (&Method::POST, "/v1/chat/completions") => Some(ServedApi::Chat),
            _ => None,
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            ServedApi::Completions => "cmpl",
            ServedApi::Chat => "chatcmpl",
        }
    }

    /// The `object` of a whole answer.
    fn object(self) -> &'static str {
        match self {
            ServedApi::Completions => "text_completion",
            ServedApi::Chat => "chat.completion",
        }
    }

    /// The `object` of a streamed chunk.
    fn chunk_object(self) -> &'static str {
        match self {
            ServedApi::Completions => "text_completion",
            ServedApi::Chat => "chat.completion.chunk",
        }
    }
}

/// A request the node admitted: what answering it needs from the node.
pub(super) struct Admitted {
    pub(super) shared: Arc<NodeShared>,
    /// The unit of capacity the request holds until its answer ends.
    pub(super) serving: Serving,
    pub(super) service_time: Duration,
    /// Cancelling it resets the request's connection.
    pub(super) reset: CancellationToken,
    /// An engine's prefill before the first token (zero on a node without an engine).
    pub(super) prefill: Duration,
    /// The sequence's hold on an engine's KV cache, grown with every token streamed.
    pub(super) sequence: Option<Sequence>,
}

/// Answers an OpenAI request whose body is `body`.
pub(super) async fn answer(
    api: ServedApi,
    headers: &HeaderMap,
    body: &[u8],
    admitted: Admitted,
) -> Response<SimBody> {
    match read(api, headers, body, admitted.shared.spec.tokens) {
        Ok(parsed) => respond(parsed, admitted).await,
        Err(message) => bad_request(&message),
    }
}

/// A valid request, read.
pub(super) struct Parsed {
    api: ServedApi,
    ask: Ask,
    cuts: Vec<Cut>,
}

impl Parsed {
    /// The context the model reads: the prompt, or the messages' contents joined.
    pub(super) fn context(&self) -> &str {
        &self.ask.context
    }

    /// The context's whitespace-separated words: its prompt tokens.
    pub(super) fn prompt_words(&self) -> u64 {
        self.ask.prompt_tokens
    }
}

/// Reads a request of `api` (`default_tokens` its `max_tokens` if it names none), or says what is
/// wrong with it (to be answered with [`bad_request`]).
pub(super) fn read(
    api: ServedApi,
    headers: &HeaderMap,
    body: &[u8],
    default_tokens: u32,
) -> Result<Parsed, String> {
    let ask = parse(api, body, default_tokens)?;
    Ok(Parsed {
        api,
        ask,
        cuts: cuts(headers)?,
    })
}

/// Answers a request read and admitted.
pub(super) async fn respond(parsed: Parsed, admitted: Admitted) -> Response<SimBody> {
    let Parsed { api, ask, cuts } = parsed;
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let head = AnswerHead {
        api,
        id: format!(
            "{}-{}-{}",
            api.id_prefix(),
            admitted.shared.spec.name,
            admitted.shared.next_answer()
        ),
        created,
        model: ask.model.clone(),
    };
    let timing = admitted.shared.timing(
        admitted.service_time,
        ask.max_tokens,
        ask.prompt_tokens,
        admitted.prefill,
    );
    if ask.stream {
        let (events, body) = EventFeed::new();
        tokio::spawn(generate(ask, head, cuts, admitted, timing, events));
        sse_response(body.boxed())
    } else {
        let Admitted {
            shared, serving, ..
        } = admitted;
        tokio::time::sleep(timing.whole).await;
        while_gray(&shared).await;
        let body = head.whole(&ask.text(), ask.usage());
        serving.finish();
        full(StatusCode::OK, "application/json", body)
    }
}

/// What a valid request asks of the model.
#[derive(Debug, PartialEq, Eq)]
struct Ask {
    model: String,
    stream: bool,
    include_usage: bool,
    max_tokens: u64,
    /// The context's last integer: token `i` is `start + i`.
    start: u64,
    prompt_tokens: u64,
    /// What the model reads: the prompt, or the messages' contents joined.
    context: String,
    /// `return_token_ids`: the prompt's ids on the first chunk, each chunk's own.
    return_ids: bool,
    /// The prompt's token ids (see [`token_ids`]).
    prompt_ids: Vec<u64>,
}

impl Ask {
    /// The text of token `i` (from 1).
    fn token(&self, i: u64) -> String {
        format!(" {}", self.start.saturating_add(i))
    }

    /// The id of token `i` (from 1): its number, as [`token_ids`] reads it back.
    fn token_id(&self, i: u64) -> u64 {
        self.start.saturating_add(i).min(WORD_IDS - 1)
    }

    /// The whole answer's text.
    fn text(&self) -> String {
        let mut text = String::new();
        for i in 1..=self.max_tokens {
            let _ = write!(text, " {}", self.start.saturating_add(i));
        }
        text
    }

    /// The usage of the whole answer.
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.max_tokens,
            total_tokens: self.prompt_tokens.saturating_add(self.max_tokens),
        }
    }
}

/// Reads a request body, or says what is wrong with it.
fn parse(api: ServedApi, body: &[u8], default_tokens: u32) -> Result<Ask, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|err| format!("the body is not valid JSON: {err}"))?;
    let Value::Object(fields) = value else {
        return Err("the body must be a JSON object".into());
    };
    let model = match given(&fields, "model") {
        None => "sim".to_owned(),
        Some(Value::String(model)) => model.clone(),
        Some(_) => return Err("model must be a string".into()),
    };
    let stream = flag(&fields, "stream", false)?;
    let include_usage = match given(&fields, "stream_options") {
        None => false,
        Some(Value::Object(options)) => flag(options, "include_usage", false)
            .map_err(|message| format!("stream_options.{message}"))?,
        Some(_) => return Err("stream_options must be an object".into()),
    };
    let max_tokens = match api {
        ServedApi::Completions => count(&fields, "max_tokens")?,
        ServedApi::Chat => {
            let completion = count(&fields, "max_completion_tokens")?;
            completion.or(count(&fields, "max_tokens")?)
        }
    };
    let return_ids = flag(&fields, "return_token_ids", false)?;
    let (context, prompt_ids) = match api {
        ServedApi::Completions => match id_prompt(&fields)? {
            Some(ids) => (context_of(&ids), ids),
            None => {
                let context = prompt(&fields)?;
                let ids = token_ids(&context);
                (context, ids)
            }
        },
        ServedApi::Chat => {
            let context = conversation(&fields)?;
            let ids = token_ids(&context);
            (context, ids)
        }
    };
    Ok(Ask {
        model,
        stream,
        include_usage,
        max_tokens: max_tokens.unwrap_or(u64::from(default_tokens)),
        start: last_integer(&context),
        prompt_tokens: words(&context),
        context,
        return_ids,
        prompt_ids,
    })
}

/// The field `name`, unless absent or `null`.
pub(super) fn given<'a>(fields: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    fields.get(name).filter(|value| !value.is_null())
}

fn flag(fields: &Map<String, Value>, name: &str, default: bool) -> Result<bool, String> {
    match given(fields, name) {
        None => Ok(default),
        Some(Value::Bool(flag)) => Ok(*flag),
        Some(_) => Err(format!("{name} must be true or false")),
    }
}

/// A token count: an integer from 1 to [`MAX_TOKENS`].
fn count(fields: &Map<String, Value>, name: &str) -> Result<Option<u64>, String> {
    match given(fields, name) {
        None => Ok(None),
        Some(value) => match value.as_u64() {
            Some(count @ 1..=MAX_TOKENS) => Ok(Some(count)),
            _ => Err(format!(
                "{name} must be an integer from 1 to {MAX_TOKENS}, got {value}"
            )),
        },
    }
}

/// A completion request's context: its prompt.
fn prompt(fields: &Map<String, Value>) -> Result<String, String> {
    match given(fields, "prompt") {
        Some(Value::String(prompt)) => Ok(prompt.clone()),
        Some(Value::Array(prompts)) => match prompts.as_slice() {
            [Value::String(prompt)] => Ok(prompt.clone()),
            _ => Err("prompt must be a string or an array of exactly one string".into()),
        },
        Some(_) => Err("prompt must be a string or an array of exactly one string".into()),
        None => Err("prompt is required".into()),
    }
}

/// A chat request's context: its messages' contents joined with spaces.
fn conversation(fields: &Map<String, Value>) -> Result<String, String> {
    let Some(Value::Array(messages)) = given(fields, "messages") else {
        return Err("messages is required: an array of {role, content}".into());
    };
    let mut contents = Vec::with_capacity(messages.len());
    let mut last_role = None;
    for (i, message) in messages.iter().enumerate() {
        let role = message.get("role").and_then(Value::as_str);
        let content = message.get("content").and_then(Value::as_str);
        let (Some(role), Some(content)) = (role, content) else {
            return Err(format!(
                "messages[{i}] must have a string role and a string content"
            ));
        };
        contents.push(content);
        last_role = Some(role);
    }
    let add_generation_prompt = flag(fields, "add_generation_prompt", true)?;
    let continue_final_message = flag(fields, "continue_final_message", false)?;
    if continue_final_message && add_generation_prompt {
        // vLLM's own words.
        return Err(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.".into(),
        );
    }
    if continue_final_message && last_role != Some("assistant") {
        return Err(
            "continue_final_message is set but the final message is not the assistant's".into(),
        );
    }
    Ok(contents.join(" "))
}

/// The last integer in `text`: its last maximal run of ASCII digits, saturating at `u64::MAX`; 0 when
/// it has none.
fn last_integer(text: &str) -> u64 {
    let bytes = text.as_bytes();
    let Some(end) = bytes.iter().rposition(u8::is_ascii_digit) else {
        return 0;
    };
    let begin = bytes[..end]
        .iter()
        .rposition(|byte| !byte.is_ascii_digit())
        .map_or(0, |before| before + 1);
    bytes[begin..=end].iter().fold(0u64, |number, digit| {
        number
            .saturating_mul(10)
            .saturating_add(u64::from(digit - b'0'))
    })
}

/// The number of whitespace-separated words in `text`: the model's prompt tokens.
fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// How `x-sim-cut` breaks a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Break {
    Reset,
    Close,
    Stall,
}

/// Break the stream right after the chunk of the token numbered `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cut {
    at: u64,
    how: Break,
}

/// The cuts the `x-sim-cut` headers ask for.
fn cuts(headers: &HeaderMap) -> Result<Vec<Cut>, String> {
    let mut cuts = Vec::new();
    for value in headers.get_all("x-sim-cut") {
        let list = value
            .to_str()
            .map_err(|_| "x-sim-cut must be visible ASCII".to_owned())?;
        for entry in list.split(',') {
            cuts.push(cut(entry.trim()).ok_or_else(|| {
                format!("x-sim-cut: {entry:?} is not N, N:reset, N:close or N:stall")
            })?);
        }
    }
    Ok(cuts)
}

fn cut(entry: &str) -> Option<Cut> {
    let (at, how) = entry.split_once(':').unwrap_or((entry, "reset"));
    let how = match how.trim() {
        "reset" => Break::Reset,
        "close" => Break::Close,
        "stall" => Break::Stall,
        _ => return None,
    };
    let at = at.trim();
    // Digits only: `u64`'s parser would also take a sign.
    if at.is_empty() || !at.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    Some(Cut {
        at: at.parse().ok()?,
        how,
    })
}

/// Generates a streamed answer into `events`, token by token at the request's timing.
async fn generate(
    ask: Ask,
    head: AnswerHead,
    cuts: Vec<Cut>,
    admitted: Admitted,
    timing: TokenTiming,
    events: mpsc::Sender<Bytes>,
) {
    let Admitted {
        shared,
        serving,
        reset,
        mut sequence,
        ..
    } = admitted;
    let role_chunk = head.api == ServedApi::Chat;
    let prompt_ids = ask.return_ids.then_some(ask.prompt_ids.as_slice());
    let chat_prompt_ids = prompt_ids.filter(|_| role_chunk);
    if role_chunk && timing.role_at_once && !send(&events, head.role_chunk(chat_prompt_ids)).await {
        return;
    }
    if !before_first_token(&events, &timing).await {
        return;
    }
    // Tokens wait for their chunk: one each, or `chunk_tokens` as vLLM merges what its engine made
    // while its API server lagged.
    let per_chunk = u64::from(shared.spec.chunk_tokens.max(1));
    let (mut text, mut ids) = (String::new(), Vec::new());
    let mut first_chunk = true;
    for i in 1..=ask.max_tokens {
        if i > 1 && !before_next_token(&events, &timing, i - 1, &shared).await {
            return;
        }
        if i == 1
            && role_chunk
            && !timing.role_at_once
            && !send(&events, head.role_chunk(chat_prompt_ids)).await
        {
            return;
        }
        text.push_str(&ask.token(i));
        ids.push(ask.token_id(i));
        if let Some(sequence) = &mut sequence {
            sequence.grow(1);
        }
        let number = ask.start.saturating_add(i);
        let cut = cuts.iter().find(|cut| cut.at == number);
        let last = i == ask.max_tokens;
        if !(last || cut.is_some() || ids.len() as u64 >= per_chunk) {
            continue;
        }
        let finish = last.then_some("length");
        let chunk_ids = ask.return_ids.then(|| std::mem::take(&mut ids));
        ids.clear();
        let completion_prompt =
            (ask.return_ids && first_chunk && !role_chunk).then(|| ask.prompt_ids.clone());
        first_chunk = false;
        let chunk = head.token_chunk(&text, finish, chunk_ids, completion_prompt);
        text.clear();
        if !send(&events, chunk).await {
            return;
        }
        if let Some(cut) = cut {
            return break_stream(cut.how, events, &reset).await;
        }
    }
    if ask.include_usage && !send(&events, head.usage_chunk(ask.usage())).await {
        return;
    }
    if send(&events, Bytes::from_static(b"data: [DONE]\n\n")).await {
        serving.finish();
    }
}

/// Breaks a stream whose last chunk was just sent.
async fn break_stream(how: Break, events: mpsc::Sender<Bytes>, reset: &CancellationToken) {
    match how {
        // Dropping the sender ends the body: a proper end of the response, without `[DONE]`.
        Break::Close => drop(events),
        Break::Stall => events.closed().await,
        Break::Reset => {
            // Room in the channel means the server took the last chunk; it writes what it took before
            // it waits on the body again, so the client gets that chunk before the reset.
            if events.reserve().await.is_ok() {
                reset.cancel();
            }
            // Held until the connection is gone: a sender dropped now would end the body cleanly.
            events.closed().await;
        }
    }
}

/// A `400` in vLLM's error shape.
pub(super) fn bad_request(message: &str) -> Response<SimBody> {
    full(
        StatusCode::BAD_REQUEST,
        "application/json",
        wire::error(message),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_integer_is_the_last_run_of_digits() {
        assert_eq!(last_integer("count: 7"), 7);
        assert_eq!(last_integer("count: 7 8 9"), 9);
        assert_eq!(last_integer("12 apples and 345"), 345);
        assert_eq!(last_integer("x42y"), 42);
        assert_eq!(last_integer("1.5"), 5);
        assert_eq!(last_integer("-3 is read as 3"), 3);
        assert_eq!(last_integer("007"), 7);
        assert_eq!(last_integer("9 then ünïcödé 10é"), 10);
        assert_eq!(last_integer("no digits"), 0);
        assert_eq!(last_integer(""), 0);
        assert_eq!(last_integer("18446744073709551615"), u64::MAX);
        assert_eq!(last_integer("99999999999999999999999"), u64::MAX);
    }

    #[test]
    fn prompt_tokens_are_whitespace_separated_words() {
        assert_eq!(words("count: 7"), 2);
        assert_eq!(words("  count:\t7\n 8  "), 3);
        assert_eq!(words(""), 0);
        assert_eq!(words("   "), 0);
    }

    #[test]
    fn a_continued_request_produces_the_rest_of_the_text() {
        let ask = |body: &str| parse(ServedApi::Completions, body.as_bytes(), 16).unwrap();
        let whole = ask(r#"{"prompt":"count: 7","max_tokens":5}"#);
        assert_eq!(whole.text(), " 8 9 10 11 12");
        let rest = ask(r#"{"prompt":"count: 7 8 9","max_tokens":3}"#);
        assert_eq!((rest.start, rest.prompt_tokens), (9, 4));
        assert_eq!(rest.text(), " 10 11 12");
    }

    #[test]
    fn a_prompt_of_token_ids_continues_where_its_last_number_left_off() {
        let ask = |body: &str| parse(ServedApi::Completions, body.as_bytes(), 16).unwrap();
        let whole = ask(r#"{"prompt":"count: 7","max_tokens":5}"#);
        let ids: Vec<u64> = whole
            .prompt_ids
            .iter()
            .copied()
            .chain((1..=2).map(|i| whole.token_id(i)))
            .collect();
        assert_eq!(&ids[1..], [7, 8, 9]);
        let body = serde_json::json!({"prompt": ids, "max_tokens": 3});
        let rest = ask(&body.to_string());
        assert_eq!(
            (rest.text(), rest.prompt_tokens),
            (" 10 11 12".to_owned(), 4)
        );
    }

    #[test]
    fn chat_context_joins_every_message() {
        let body = r#"{"messages":[{"role":"user","content":"count: 7"},
            {"role":"assistant","content":" 8 9"}],
            "add_generation_prompt":false,"continue_final_message":true,"max_completion_tokens":2,
            "max_tokens":9}"#;
        let ask = parse(ServedApi::Chat, body.as_bytes(), 16).unwrap();
        assert_eq!((ask.start, ask.prompt_tokens, ask.max_tokens), (9, 4, 2));
    }

    #[test]
    fn requests_take_the_defaults() {
        let ask = parse(
            ServedApi::Completions,
            br#"{"prompt":["hi"],"stream":null}"#,
            16,
        )
        .unwrap();
        assert_eq!(
            ask,
            Ask {
                model: "sim".into(),
                stream: false,
                include_usage: false,
                max_tokens: 16,
                start: 0,
                prompt_tokens: 1,
                context: "hi".into(),
                return_ids: false,
                prompt_ids: token_ids("hi"),
            }
        );
    }

    #[test]
    fn cuts_read_numbers_and_kinds() {
        let mut headers = HeaderMap::new();
        headers.insert("x-sim-cut", "4, 9:stall,12:close ,3:reset".parse().unwrap());
        let at = |at, how| Cut { at, how };
        assert_eq!(
            cuts(&headers).unwrap(),
            [
                at(4, Break::Reset),
                at(9, Break::Stall),
                at(12, Break::Close),
                at(3, Break::Reset)
            ]
        );
        for bad in [
            "",
            "4,",
            "x",
            "+4",
            "4:melt",
            "4:",
            "99999999999999999999999",
        ] {
            headers.insert("x-sim-cut", bad.parse().unwrap());
            assert!(cuts(&headers).is_err(), "{bad:?}");
        }
    }
}

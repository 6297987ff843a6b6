//! The JSON the fake OpenAI server writes: answers, stream chunks and errors, their fields in the order
//! vLLM writes them.

use bytes::Bytes;
use serde::Serialize;

use super::ServedApi;

/// The body of a `400` in vLLM's error shape.
pub(super) fn error(message: &str) -> Vec<u8> {
    #[derive(Serialize)]
    struct Error<'a> {
        object: &'static str,
        message: &'a str,
        #[serde(rename = "type")]
        kind: &'static str,
        param: Option<()>,
        code: u16,
    }
    let error = Error {
        object: "error",
        message,
        kind: "BadRequestError",
        param: None,
        code: 400,
    };
    serde_json::to_vec(&error).expect("plain structs serialize")
}

/// Token counts of an answer.
#[derive(Clone, Copy, Serialize)]
pub(super) struct Usage {
    pub(super) prompt_tokens: u64,
    pub(super) completion_tokens: u64,
    pub(super) total_tokens: u64,
}

/// What every answer and chunk of one request starts with.
pub(super) struct AnswerHead {
    pub(super) api: ServedApi,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
}

#[derive(Serialize)]
struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [Choice<C>],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    /// A chat stream's first chunk, asked for token ids: the prompt's.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a [u64]>,
}

#[derive(Serialize)]
struct Choice<C> {
    index: u32,
    #[serde(flatten)]
    content: C,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    /// A completion stream's first chunk, asked for token ids: the prompt's.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<Vec<u64>>,
    /// Asked for token ids: the chunk's.
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<Vec<u64>>,
}

/// A completion's `text`.
#[derive(Serialize)]
struct Text<'a> {
    text: &'a str,
}

/// A whole chat answer's `message`.
#[derive(Serialize)]
struct Message<'a> {
    message: Said<'a>,
}

/// A chat chunk's `delta`.
#[derive(Serialize)]
struct Delta<'a> {
    delta: Said<'a>,
}

#[derive(Serialize)]
struct Said<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'a str,
}

impl AnswerHead {
    /// The whole answer: `text`, stopped for length, and its usage.
    pub(super) fn whole(&self, text: &str, usage: Usage) -> Vec<u8> {
        let object = self.api.object();
        match self.api {
            ServedApi::Completions => self.json(
                object,
                &[choice(Text { text }, Some("length"))],
                Some(usage),
            ),
            ServedApi::Chat => {
                let said = Said {
                    role: Some("assistant"),
                    content: text,
                };
                let message = Message { message: said };
                self.json(object, &[choice(message, Some("length"))], Some(usage))
            }
        }
    }

    /// The chat stream's first chunk, naming the speaker (and with ids asked, the prompt's ids).
    pub(super) fn role_chunk(&self, prompt_ids: Option<&[u64]>) -> Bytes {
        let said = Said {
            role: Some("assistant"),
            content: "",
        };
        self.event_with(&[choice(Delta { delta: said }, None)], None, prompt_ids)
    }

    /// The chunk of one or more tokens, `finish` on the last one; with ids asked, theirs (`ids`), and
    /// a completion's first chunk also the prompt's (`prompt_ids`).
    pub(super) fn token_chunk(
        &self,
        text: &str,
        finish: Option<&'static str>,
        ids: Option<Vec<u64>>,
        prompt_ids: Option<Vec<u64>>,
    ) -> Bytes {
        match self.api {
            ServedApi::Completions => {
                let mut choice = choice(Text { text }, finish);
                choice.token_ids = ids;
                choice.prompt_token_ids = prompt_ids;
                self.event(&[choice], None)
            }
            ServedApi::Chat => {
                let said = Said {
                    role: None,
                    content: text,
                };
                let mut choice = choice(Delta { delta: said }, finish);
                choice.token_ids = ids;
                self.event(&[choice], None)
            }
        }
    }

    /// The usage chunk after the last token.
    pub(super) fn usage_chunk(&self, usage: Usage) -> Bytes {
        self.event::<Text>(&[], Some(usage))
    }

    fn json<C: Serialize>(
        &self,
        object: &'static str,
        choices: &[Choice<C>],
        usage: Option<Usage>,
    ) -> Vec<u8> {
        self.json_with(object, choices, usage, None)
    }

    fn json_with<C: Serialize>(
        &self,
        object: &'static str,
        choices: &[Choice<C>],
        usage: Option<Usage>,
        prompt_token_ids: Option<&[u64]>,
    ) -> Vec<u8> {
        let envelope = Envelope {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            usage,
            prompt_token_ids,
        };
        serde_json::to_vec(&envelope).expect("plain structs serialize")
    }

    /// One Server-Sent Event around a chunk: `data: <json>` and a blank line.
    fn event<C: Serialize>(&self, choices: &[Choice<C>], usage: Option<Usage>) -> Bytes {
        self.event_with(choices, usage, None)
    }

    fn event_with<C: Serialize>(
        &self,
        choices: &[Choice<C>],
        usage: Option<Usage>,
        prompt_token_ids: Option<&[u64]>,
    ) -> Bytes {
        let json = self.json_with(self.api.chunk_object(), choices, usage, prompt_token_ids);
        let mut event = Vec::with_capacity(json.len() + 8);
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(&json);
        event.extend_from_slice(b"\n\n");
        Bytes::from(event)
    }
}

fn choice<C>(content: C, finish: Option<&'static str>) -> Choice<C> {
    Choice {
        index: 0,
        content,
        logprobs: None,
        finish_reason: finish,
        prompt_token_ids: None,
        token_ids: None,
    }
}

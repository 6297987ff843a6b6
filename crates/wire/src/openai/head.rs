//! The fields of a request body that decide whether its stream can be continued, read without
//! building the rest.
//!
//! A chat request is mostly its `messages` (the whole conversation, often many KiB); what decides
//! continuation is a dozen small fields beside it. serde's derive cannot say "every key starting with
//! `guided_`", and a `flatten` would buffer the whole body into serde's own tree, so the map is walked
//! by hand: each key is read borrowed, the fields that matter are kept as raw JSON slices of the body
//! (no copy), and everything else — the conversation included — is skipped without being built. As
//! in `serde_json::Value`, a key given twice counts as its last value.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

/// The keys of a request body [`super::Continuable::read`] looks at, as raw JSON.
#[derive(Default)]
pub(super) struct Head<'a> {
    pub stream: Option<&'a RawValue>,
    pub n: Option<&'a RawValue>,
    pub best_of: Option<&'a RawValue>,
    pub logprobs: Option<&'a RawValue>,
    pub top_logprobs: Option<&'a RawValue>,
    pub echo: Option<&'a RawValue>,
    pub response_format: Option<&'a RawValue>,
    pub structured_outputs: Option<&'a RawValue>,
    pub max_tokens: Option<&'a RawValue>,
    pub max_completion_tokens: Option<&'a RawValue>,
    pub prompt: Option<&'a RawValue>,
    pub messages: Option<&'a RawValue>,
    pub stream_options: Option<&'a RawValue>,
    /// vLLM's token ids, asked for by the client itself.
    pub return_token_ids: Option<&'a RawValue>,
    /// SGLang's constrained output, a grammar beside the sampling fields.
    pub regex: Option<&'a RawValue>,
    pub ebnf: Option<&'a RawValue>,
    /// `guided_*` keys by name, as given (the last of one name counts).
    pub guided: Vec<(Cow<'a, str>, &'a RawValue)>,
}

impl<'a> Head<'a> {
    /// The key of the token limit named `key` (one of `MAX_TOKEN_FIELDS`).
    pub fn max_token_field(&self, key: &str) -> Option<&'a RawValue> {
        match key {
            "max_tokens" => self.max_tokens,
            "max_completion_tokens" => self.max_completion_tokens,
            _ => None,
        }
    }

    /// Whether some `guided_*` key holds anything but `null` (its last value, as `Value` keeps).
    pub fn guided(&self) -> bool {
        self.guided.iter().enumerate().any(|(at, (key, value))| {
            let last = !self.guided[at + 1..].iter().any(|(later, _)| later == key);
            last && value.get() != "null"
        })
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Head<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(HeadVisitor(std::marker::PhantomData))
    }
}

struct HeadVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for HeadVisitor<'a> {
    type Value = Head<'a>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Head<'a>, M::Error> {
        let mut head = Head::default();
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            let slot = match &*key {
                "stream" => &mut head.stream,
                "n" => &mut head.n,
                "best_of" => &mut head.best_of,
                "logprobs" => &mut head.logprobs,
                "top_logprobs" => &mut head.top_logprobs,
                "echo" => &mut head.echo,
                "response_format" => &mut head.response_format,
                "structured_outputs" => &mut head.structured_outputs,
                "max_tokens" => &mut head.max_tokens,
                "max_completion_tokens" => &mut head.max_completion_tokens,
                "prompt" => &mut head.prompt,
                "messages" => &mut head.messages,
                "stream_options" => &mut head.stream_options,
                "return_token_ids" => &mut head.return_token_ids,
                "regex" => &mut head.regex,
                "ebnf" => &mut head.ebnf,
                guided if guided.starts_with("guided_") => {
                    let value = map.next_value::<&'de RawValue>()?;
                    head.guided.push((key, value));
                    continue;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *slot = Some(map.next_value::<&'de RawValue>()?);
        }
        Ok(head)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use proptest::prelude::*;
    use serde_json::Value;

    use super::super::{Api, Continuable, MAX_TOKEN_FIELDS, NotContinuable};

    /// The reading this module replaced: the whole body built as a `Value`, then looked at. Kept as
    /// the oracle the fast reading must agree with.
    fn read_by_value(api: Api, raw: &[u8]) -> Result<(bool, Option<u64>), NotContinuable> {
        let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(raw) else {
            return Err(NotContinuable::NotAStream);
        };
        if body.get("stream") != Some(&Value::Bool(true)) {
            return Err(NotContinuable::NotAStream);
        }
        let above_one = |key: &str| body.get(key).and_then(Value::as_u64).is_some_and(|n| n > 1);
        if above_one("n") || above_one("best_of") {
            return Err(NotContinuable::SeveralChoices);
        }
        let truthy = |key: &str| {
            body.get(key)
                .is_some_and(|v| !matches!(v, Value::Null | Value::Bool(false)))
        };
        if truthy("logprobs") || truthy("top_logprobs") {
            return Err(NotContinuable::Logprobs);
        }
        if truthy("echo") {
            return Err(NotContinuable::Echo);
        }
        let text_format = body
            .get("response_format")
            .is_none_or(|f| f.is_null() || f.get("type").and_then(Value::as_str) == Some("text"));
        let guided = body
            .iter()
            .any(|(key, value)| key.starts_with("guided_") && !value.is_null());
        if !text_format
            || guided
            || truthy("structured_outputs")
            || truthy("regex")
            || truthy("ebnf")
        {
            return Err(NotContinuable::Constrained);
        }
        for key in MAX_TOKEN_FIELDS {
            if body.get(key).is_some_and(|v| !v.is_null() && !v.is_u64()) {
                return Err(NotContinuable::MaxTokens);
            }
        }
        match api {
            Api::Completions => match body.get("prompt") {
                Some(Value::String(_)) => {}
                Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {}
                _ => return Err(NotContinuable::Prompt),
            },
            Api::Chat => {
                if !body.get("messages").is_some_and(Value::is_array) {
                    return Err(NotContinuable::Messages);
                }
            }
        }
        let usage = body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            == Some(&Value::Bool(true));
        let max = MAX_TOKEN_FIELDS
            .iter()
            .find_map(|key| body.get(*key).and_then(Value::as_u64));
        Ok((usage, max))
    }

    const KEYS: &[&str] = &[
        "stream",
        "n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "echo",
        "response_format",
        "structured_outputs",
        "max_tokens",
        "max_completion_tokens",
        "prompt",
        "messages",
        "stream_options",
        "guided_json",
        "guided_regex",
        "model",
        "temperature",
        // Escaped spellings of keys that matter, and near misses.
        "str\\u0065am",
        "max\\u005ftokens",
        "guided",
        "Stream",
    ];

    const VALUES: &[&str] = &[
        "null",
        "true",
        "false",
        "0",
        "1",
        "2",
        "2.5",
        "-1",
        "1e2",
        "\"text\"",
        "\"\"",
        "[]",
        "[\"a\"]",
        "[\"a\",\"b\"]",
        "[1]",
        "{}",
        "{\"type\":\"text\"}",
        "{\"type\":\"json_object\"}",
        "{\"include_usage\":true}",
        "{\"include_usage\":false}",
        "[{\"role\":\"user\",\"content\":\"hi \\\"there\\\"\"}]",
    ];

    proptest! {
        #[test]
        fn the_fast_reading_agrees_with_reading_the_whole_value(
            pairs in proptest::collection::vec((0..KEYS.len(), 0..VALUES.len()), 0..12),
            stream_first in any::<bool>(),
            chat in any::<bool>(),
        ) {
            let mut fields: Vec<String> = pairs
                .iter()
                .map(|&(k, v)| format!("\"{}\": {}", KEYS[k], VALUES[v]))
                .collect();
            if stream_first {
                fields.insert(0, "\"stream\": true".into());
            }
            let body = format!("{{{}}}", fields.join(", "));
            let api = if chat { Api::Chat } else { Api::Completions };
            let fast = Continuable::read(api, &Bytes::from(body.clone()))
                .map(|c| (c.usage_wanted, c.max_tokens()));
            prop_assert_eq!(fast, read_by_value(api, body.as_bytes()), "{}", body);
        }
    }

    #[test]
    fn not_an_object_or_not_json_is_not_a_stream() {
        for body in ["[]", "1", "\"stream\"", "{\"stream\": true", "", "null"] {
            assert_eq!(
                Continuable::read(Api::Chat, &Bytes::from(body)).err(),
                Some(NotContinuable::NotAStream),
                "{body}"
            );
        }
    }
}

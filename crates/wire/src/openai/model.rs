//! The model a request names: the string value of the top-level `"model"` key of its JSON body, where
//! it sits in the body, and the body with another model written in its place.
//!
//! The body is read by serde_json, every top-level key of it: values other than the model's are
//! skipped unparsed into anything (about 4 GiB/s here). Keys are compared after their escapes are undone
//! (`"mod\u0065l"` is `model`); a `model` inside a nested object or array is not the request's.
//!
//! The whole object is read, not just up to the model, because of duplicates: JSON parsers disagree on
//! which of two `model` keys counts (serde keeps the first, Python's `json`, hence vLLM, the last), so a
//! body naming two could be routed to one pool and read by its node as the other — with a pool's own
//! key and rewritten model, a way to reach a model the client was not routed to. [`read_model`] calls
//! such a body what it is; [`model_of`] finds no model in it.

use std::fmt;
use std::ops::Range;

use bytes::{BufMut, Bytes, BytesMut};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

/// The `model` of a request body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelField {
    /// The model's name, its escapes undone.
    pub name: String,
    /// Where the value's JSON string token, quotes included, sits in the body (in bytes).
    pub span: Range<usize>,
}

/// A body that names its model twice (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the body names `model` more than once")]
pub struct DuplicateModel;

/// The top-level `model` of `body` when `body` is a JSON object (after any whitespace) with exactly one
/// top-level `model` key, whose value is a string; `None` for anything else. Never panics.
pub fn model_of(body: &[u8]) -> Option<ModelField> {
    read_model(body).ok().flatten()
}

/// [`model_of`], telling a body with two top-level `model` keys apart as an error: a request that
/// must be refused rather than routed on one of them.
pub fn read_model(body: &[u8]) -> Result<Option<ModelField>, DuplicateModel> {
    let mut found = Found::default();
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    // What was found is in `found`. The error, if any, says the body is not an object with a model, or
    // that reading stopped at a second model; `found` says all of that already.
    let _ = deserializer.deserialize_map(TopLevel {
        body,
        found: &mut found,
    });
    if found.duplicate {
        return Err(DuplicateModel);
    }
    Ok(found.field)
}

/// What reading a body found.
#[derive(Default)]
struct Found {
    field: Option<ModelField>,
    /// A `model` key was seen.
    seen: bool,
    /// A second `model` key was seen.
    duplicate: bool,
}

/// `body` with the value `field` spans replaced by `model` as a JSON string; every other byte as it
/// was.
///
/// `field` must be what [`model_of`] found in this `body`: a span beyond its end panics.
pub fn with_model(body: &[u8], field: &ModelField, model: &str) -> Bytes {
    let token = serde_json::Value::from(model).to_string();
    let (before, after) = (&body[..field.span.start], &body[field.span.end..]);
    let mut out = BytesMut::with_capacity(before.len() + token.len() + after.len());
    out.put_slice(before);
    out.put_slice(token.as_bytes());
    out.put_slice(after);
    out.freeze()
}

/// Why reading stopped at a second model (never shown: `read_model` drops it).
const STOP: &str = "the body names its model twice";

/// Reads the top-level object's keys, skipping the values other than the model's unparsed into
/// anything, until its end or a second `model`.
struct TopLevel<'a> {
    body: &'a [u8],
    found: &'a mut Found,
}

impl<'de> Visitor<'de> for TopLevel<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Model if self.found.seen => {
                    self.found.duplicate = true;
                    return Err(de::Error::custom(STOP));
                }
                Key::Model => {
                    self.found.seen = true;
                    let value: &'de RawValue = map.next_value()?;
                    self.found.field = field(self.body, value);
                }
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// The model field `value` makes, if a string: its place is found from where the token lies in memory,
/// as the deserializer hands out a slice of the body itself.
fn field(body: &[u8], value: &RawValue) -> Option<ModelField> {
    let token = value.get();
    if !token.starts_with('"') {
        return None;
    }
    let start = (token.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let span = start..start.checked_add(token.len())?;
    // The slice is the body's own, so this holds; checked rather than trusted, at the cost of one
    // comparison of the model's few bytes.
    if body.get(span.clone())? != token.as_bytes() {
        return None;
    }
    let name = serde_json::from_str::<String>(token).ok()?;
    Some(ModelField { name, span })
}

/// A top-level key: `model` or another, told apart with its escapes undone and without keeping it.
enum Key {
    Model,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Key, D::Error> {
        deserializer.deserialize_str(KeyVisitor)
    }
}

struct KeyVisitor;

impl Visitor<'_> for KeyVisitor {
    type Value = Key;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("an object key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Key, E> {
        Ok(if key == "model" {
            Key::Model
        } else {
            Key::Other
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    use super::*;

    /// The model of `body`, checked against its span: the span holds the name as a JSON string.
    fn model(body: &str) -> Option<String> {
        let found = model_of(body.as_bytes())?;
        let token = &body[found.span.clone()];
        assert!(token.starts_with('"') && token.ends_with('"'), "{token}");
        assert_eq!(serde_json::from_str::<String>(token).unwrap(), found.name);
        Some(found.name)
    }

    #[test]
    fn found_at_the_start_the_middle_and_the_end() {
        let start = r#"{"model":"llama","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(model(start).as_deref(), Some("llama"));
        let found = model_of(start.as_bytes()).unwrap();
        assert_eq!(found.span, 9..16);
        let middle = r#"{"stream":true,"model":"qwen","max_tokens":5}"#;
        assert_eq!(model(middle).as_deref(), Some("qwen"));
        let end = r#"{"messages":[],"temperature":0.2,"model":"mistral"}"#;
        assert_eq!(model(end).as_deref(), Some("mistral"));
    }

    #[test]
    fn escapes_in_the_key_and_the_value_are_undone() {
        assert_eq!(
            model(r#"{"mod\u0065l":"x"}"#).as_deref(),
            Some("x"),
            "an escaped key is still `model`"
        );
        let body = r#"{"model":"org\/llama \"3\" \u00e9\ud83d\ude00"}"#;
        assert_eq!(model(body).as_deref(), Some("org/llama \"3\" é😀"));
        let found = model_of(body.as_bytes()).unwrap();
        assert_eq!(found.span, 9..body.len() - 1, "the token as written");
        assert_eq!(model(r#"{"model":"é"}"#).as_deref(), Some("é"));
        assert_eq!(model(r#"{"modél":"x"}"#), None);
    }

    #[test]
    fn whitespace_anywhere_json_allows_it() {
        let body = " \n\t{ \r\n \"model\" \n : \t \"a b\" \n , \"n\" : 1 } \n";
        assert_eq!(model(body).as_deref(), Some("a b"));
        let found = model_of(body.as_bytes()).unwrap();
        assert_eq!(&body[found.span], "\"a b\"");
    }

    #[test]
    fn a_nested_model_is_not_the_request_s() {
        assert_eq!(model(r#"{"metadata":{"model":"inner"}}"#), None);
        assert_eq!(model(r#"{"messages":[{"model":"inner"}],"n":1}"#), None);
        assert_eq!(
            model(r#"{"metadata":{"model":"inner"},"model":"outer"}"#).as_deref(),
            Some("outer")
        );
        assert_eq!(
            model(r#"{"extra":"\"model\":\"fake\"","model":"real"}"#).as_deref(),
            Some("real"),
            "a `model` inside a string is text"
        );
    }

    #[test]
    fn a_model_that_is_not_a_string_is_none() {
        for body in [
            r#"{"model":1}"#,
            r#"{"model":null}"#,
            r#"{"model":true}"#,
            r#"{"model":["a"]}"#,
            r#"{"model":{"name":"a"}}"#,
        ] {
            assert_eq!(model(body), None, "{body}");
        }
    }

    #[test]
    fn bodies_that_are_not_an_object_with_a_model_are_none() {
        for body in [
            "",
            " ",
            "[]",
            r#"["model","x"]"#,
            r#"[{"model":"x"}]"#,
            r#""model""#,
            "42",
            "null",
            "{}",
            r#"{"messages":[]}"#,
            "<html><body>502 Bad Gateway</body></html>",
            "model=x",
            r#"{"model""#,
            r#"{"model":"#,
            r#"{"model":"unterminated"#,
            r#"{"model" "x"}"#,
            r#"{model:"x"}"#,
            r#"{'model':'x'}"#,
            r#"{"a":1,,"model":"x"}"#,
            r#"{"a":,"model":"x"}"#,
            "{\"model\":\"\\u12\"}",
            "{\"model\":\"tab\there\"}",
        ] {
            assert_eq!(model(body), None, "{body:?}");
        }
        assert_eq!(model_of(b"{\"model\":\"\xff\"}"), None, "not UTF-8");
        assert_eq!(model_of(b"\xef\xbb\xbf{\"model\":\"x\"}"), None, "a BOM");
    }

    #[test]
    fn reading_stops_at_the_model() {
        // Whatever follows the model is never read: cut short, or not JSON at all.
        assert_eq!(
            model(r#"{"model":"x","messages":[{"role":"us"#).as_deref(),
            Some("x")
        );
        assert_eq!(model(r#"{"model":"x" garbage"#).as_deref(), Some("x"));
        assert_eq!(model(r#"{"model":"x"}}}]]"#).as_deref(), Some("x"));
        let mut body = br#"{"model":"x","tail":""#.to_vec();
        body.extend_from_slice(b"\xff\xfe not UTF-8");
        assert_eq!(model_of(&body).map(|m| m.name).as_deref(), Some("x"));
        // What precedes it is read: broken before the model, there is none.
        assert_eq!(model(r#"{"messages":[{"role":"us","model":"x"}"#), None);
    }

    #[test]
    fn a_body_naming_its_model_twice_is_told_apart() {
        for body in [
            r#"{"model":"first","model":"second"}"#,
            r#"{"model":"a","messages":[],"mod\u0065l":"b"}"#,
            r#"{"model":1,"model":"second"}"#,
        ] {
            assert_eq!(read_model(body.as_bytes()), Err(DuplicateModel), "{body}");
            assert_eq!(model(body), None, "{body}");
        }
        // Nested ones are not the request's.
        let nested = r#"{"model":"a","tools":[{"model":"b"}],"extra":{"model":"c"}}"#;
        assert_eq!(read_model(nested.as_bytes()).unwrap().unwrap().name, "a");
    }

    #[test]
    fn values_nested_deep_before_the_model_are_skipped_without_recursion() {
        // serde_json skips an unread value with a loop, not a recursive call per level: no stack to
        // overflow, whatever the depth.
        let deep = format!(
            r#"{{"a":{}{{"model":"inner"}}{}, "model":"x"}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(model(&deep).as_deref(), Some("x"));
        let unclosed = format!(r#"{{"a":{}"#, "[{\"model\":\"x\"},".repeat(10_000));
        assert_eq!(model(&unclosed), None);
    }

    #[test]
    fn with_model_replaces_the_value_and_nothing_else() {
        let body = r#"{ "stream": true, "model" : "small" , "messages": [{"content":"model"}] }"#;
        let field = model_of(body.as_bytes()).unwrap();
        for new in ["large", "", "org/llama \"3\"\n\\ é😀\u{1}"] {
            let rewritten = with_model(body.as_bytes(), &field, new);
            let found = model_of(&rewritten).unwrap();
            assert_eq!(found.name, new);
            assert_eq!(
                &rewritten[..found.span.start],
                &body.as_bytes()[..field.span.start]
            );
            assert_eq!(
                &rewritten[found.span.end..],
                &body.as_bytes()[field.span.end..]
            );
            let parsed: Value = serde_json::from_slice(&rewritten).unwrap();
            assert_eq!(parsed["model"], new);
            assert_eq!(parsed["messages"][0]["content"], "model");
        }
        let same = with_model(body.as_bytes(), &field, "small");
        assert_eq!(&same[..], body.as_bytes(), "the same name: the same bytes");
    }

    /// Any JSON value, nested a few levels, with keys that are sometimes `model`.
    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            any::<String>().prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
                proptest::collection::vec((key(), inner), 0..6)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    /// An object key: often `model` (so nested ones appear), else a short or any string.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![Just("model".to_owned()), "[a-z]{0,8}", any::<String>()]
    }

    proptest! {
        /// Any bytes at all: an answer or none, never a panic, and any span lies in the body.
        #[test]
        fn any_bytes_are_read_without_a_panic(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Some(found) = model_of(&body) {
                prop_assert!(found.span.end <= body.len());
                prop_assert_eq!(body[found.span.start], b'"');
            }
        }

        /// Bytes near a request body: an object with a model, cut or damaged at one place.
        #[test]
        fn damaged_bodies_are_read_without_a_panic(
            name in any::<String>(),
            cut in 0usize..64,
            byte in any::<u8>(),
        ) {
            let body = json!({"messages": [{"role": "user"}], "model": name}).to_string();
            let mut bytes = body.into_bytes();
            let at = cut.min(bytes.len() - 1);
            bytes[at] = byte;
            let _ = model_of(&bytes);
            bytes.truncate(at);
            let _ = model_of(&bytes);
        }

        /// Any object serde_json writes with a top-level `model`: that model, at the span that holds it,
        /// whatever the other keys and values (nested `model`s included), compact or pretty.
        #[test]
        fn any_object_with_a_model_yields_it(
            name in any::<String>(),
            rest in proptest::collection::vec((key(), any_json()), 0..8),
            pretty in any::<bool>(),
        ) {
            let mut object: Map<String, Value> = rest.into_iter().collect();
            object.insert("model".to_owned(), Value::from(name.clone()));
            let object = Value::Object(object);
            let body = if pretty {
                serde_json::to_string_pretty(&object).unwrap()
            } else {
                object.to_string()
            };
            let found = model_of(body.as_bytes());
            prop_assert!(found.is_some(), "{}", body);
            let found = found.unwrap();
            prop_assert_eq!(&found.name, &name);
            prop_assert_eq!(&body[found.span.clone()], Value::from(name).to_string());
            let rewritten = with_model(body.as_bytes(), &found, "other");
            prop_assert_eq!(model_of(&rewritten).map(|m| m.name), Some("other".to_owned()));
        }
    }
}

//! The fake tokenizer of the fake vLLM: one token a word, so an answer's ids read back as its words
//! and a prompt of ids continues where its last number left off.

use serde_json::{Map, Value};

use super::given;

/// The first id of a word that is not a number: every number below it is its own id.
pub(super) const WORD_IDS: u64 = 1 << 31;

/// The fake tokenizer: one token a whitespace-separated word, a number's id its value (below
/// [`WORD_IDS`]), any other word's an id from its bytes at or above it. So the ids of an answer read
/// back as the answer's words, and a prompt of ids continues where its last number left off.
pub(super) fn token_ids(text: &str) -> Vec<u64> {
    text.split_whitespace()
        .map(|word| match word.parse::<u64>() {
            Ok(n) if n < WORD_IDS && word.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => {
                let hash = word.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
                });
                WORD_IDS + hash % WORD_IDS
            }
        })
        .collect()
}

/// The text a prompt of ids stands for: numbers as themselves, other words as `_`.
pub(super) fn context_of(ids: &[u64]) -> String {
    let words: Vec<String> = ids
        .iter()
        .map(|&id| {
            if id < WORD_IDS {
                id.to_string()
            } else {
                "_".into()
            }
        })
        .collect();
    words.join(" ")
}

/// A completion's prompt of token ids, as vLLM takes one: a list of integers.
pub(super) fn id_prompt(fields: &Map<String, Value>) -> Result<Option<Vec<u64>>, String> {
    match given(fields, "prompt") {
        Some(Value::Array(items)) if items.first().is_some_and(Value::is_number) => items
            .iter()
            .map(|id| {
                id.as_u64()
                    .ok_or_else(|| format!("prompt ids must be integers, got {id}"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        _ => Ok(None),
    }
}

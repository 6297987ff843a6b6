//! What a generation request's prompt says about where it is best served: the chained hashes of its
//! fixed-size blocks (a model server's prefix cache holds a prompt's leading blocks, so two prompts
//! share cache as far as their leading block hashes agree), the key of the conversation it belongs to,
//! and the client's own `user`.
//!
//! The prompt is read as a stream of bytes: for chat each message's role, a unit separator (0x1F), its
//! text (a string `content`, or the `text` of its parts in order), a record separator (0x1E); for
//! completions the `prompt` string (or an array of exactly one). The stream is cut into blocks of
//! `block_bytes`; block `i`'s hash is XXH3-64 of its bytes seeded with block `i − 1`'s hash, the first
//! seeded with the hash of the model's name, so equal hashes mean equal prefixes of one model's
//! prompts. A last, partial block is not hashed (no server caches it whole either).
//!
//! The conversation key is the hash of the stream up to the end of the first user message (chat), so
//! every turn of one conversation, and the continuation of a broken answer, has the same key while two
//! conversations that share a system prompt do not; for completions it is the hash of the first four
//! blocks (the last of them, as blocks chain). The blocks before that point are the opening, which
//! other conversations may share (a system prompt): a node that holds only them does not hold this
//! conversation. XXH3 is specified, so every tongs replica computes the
//! same keys.
//!
//! Pure and bounded: a body that is not such a request has no keys; nothing here panics on input.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::{Xxh3, xxh3_64, xxh3_64_with_seed};

use super::Api;

/// Smallest and largest block size tongs accepts (the configuration is validated against these).
pub const BLOCK_BYTES_MIN: usize = 16;
pub const BLOCK_BYTES_MAX: usize = 4096;

/// Blocks a completion's conversation key covers.
const COMPLETION_KEY_BLOCKS: usize = 4;

/// Where a request's prompt is best served, as far as its body says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptKeys {
    /// The chained hash of each full block, in order.
    pub blocks: Vec<u64>,
    /// The conversation the request belongs to (see the module's documentation).
    pub conversation: Option<u64>,
    /// The blocks the conversation key covers (those before the end of the first user message, or a
    /// completion's first four): what other conversations may share, such as a system prompt.
    pub opening_blocks: usize,
    /// The hash of the OpenAI `user` field, when the body names one.
    pub user: Option<u64>,
}

/// The hash of a session key (a header's value, the `user` field), as every replica computes it.
pub fn session_key(value: &[u8]) -> u64 {
    xxh3_64(value)
}

/// The keys of a `POST /v1/completions` or `/v1/chat/completions` body; `None` when the body is not a
/// JSON object with a readable prompt (`messages` for chat, a string `prompt` for completions).
/// `block_bytes` is clamped to [`BLOCK_BYTES_MIN`]..=[`BLOCK_BYTES_MAX`].
pub fn prompt_keys(api: Api, body: &[u8], block_bytes: usize) -> Option<PromptKeys> {
    let request: Request<'_> = serde_json::from_slice(body).ok()?;
    let seed = xxh3_64(request.model.as_deref().unwrap_or("").as_bytes());
    let mut blocks = Blocks::new(seed, block_bytes.clamp(BLOCK_BYTES_MIN, BLOCK_BYTES_MAX));
    let opening_blocks;
    let conversation = match api {
        Api::Chat => {
            let messages = request.messages?;
            let mut conversation = Xxh3::with_seed(seed);
            let mut open = true;
            let mut opening = 0;
            for message in &messages {
                let role = message.role.as_deref().unwrap_or("");
                let pieces = message.text()?;
                let mut feed = |bytes: &[u8]| {
                    blocks.feed(bytes);
                    if open {
                        conversation.update(bytes);
                    }
                };
                feed(role.as_bytes());
                feed(&[0x1F]);
                for piece in &pieces {
                    feed(piece.as_bytes());
                }
                feed(&[0x1E]);
                if role == "user" && open {
                    open = false;
                    opening = blocks.hashes.len();
                }
            }
            if open {
                opening = blocks.hashes.len();
            }
            opening_blocks = opening;
            Some(conversation.digest())
        }
        Api::Completions => {
            blocks.feed(request.prompt?.text()?.as_bytes());
            let covered = blocks.hashes.len().min(COMPLETION_KEY_BLOCKS);
            opening_blocks = covered;
            covered
                .checked_sub(1)
                .and_then(|last| blocks.hashes.get(last))
                .copied()
        }
    };
    let user = request.user.map(|user| session_key(user.as_bytes()));
    Some(PromptKeys {
        blocks: blocks.hashes,
        conversation,
        opening_blocks,
        user,
    })
}

/// The fields read; every other one is skipped unparsed.
#[derive(Deserialize)]
struct Request<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

impl<'a> Message<'a> {
    /// The message's text in pieces: a string content, or its parts' texts (parts without text, such
    /// as images, add nothing). `None` when the content is neither.
    fn text(&self) -> Option<Vec<Cow<'a, str>>> {
        let Some(content) = self.content else {
            return Some(Vec::new());
        };
        match content.get().as_bytes().first() {
            Some(b'"') => Some(vec![serde_json::from_str(content.get()).ok()?]),
            Some(b'[') => {
                let parts: Vec<Part<'a>> = serde_json::from_str(content.get()).ok()?;
                Some(parts.into_iter().filter_map(|part| part.text).collect())
            }
            Some(b'n') => Some(Vec::new()),
            _ => None,
        }
    }
}

/// A completion's prompt text: a string, or an array of exactly one string.
trait PromptText<'a> {
    fn text(self) -> Option<Cow<'a, str>>;
}

impl<'a> PromptText<'a> for &'a RawValue {
    fn text(self) -> Option<Cow<'a, str>> {
        match self.get().as_bytes().first() {
            Some(b'"') => serde_json::from_str(self.get()).ok(),
            Some(b'[') => {
                let [one]: [Cow<'a, str>; 1] = serde_json::from_str(self.get()).ok()?;
                Some(one)
            }
            _ => None,
        }
    }
}

/// The stream being cut into blocks.
struct Blocks {
    block: Vec<u8>,
    size: usize,
    previous: u64,
    hashes: Vec<u64>,
}

impl Blocks {
    fn new(seed: u64, size: usize) -> Blocks {
        Blocks {
            block: Vec::with_capacity(size),
            size,
            previous: seed,
            hashes: Vec::new(),
        }
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = (self.size - self.block.len()).min(bytes.len());
            self.block.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.block.len() == self.size {
                self.previous = xxh3_64_with_seed(&self.block, self.previous);
                self.hashes.push(self.previous);
                self.block.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(messages: &[(&str, &str)]) -> Vec<u8> {
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
    }

    const SYSTEM: &str = "You are a careful assistant who answers in full sentences, always.";

    #[test]
    fn turns_of_one_conversation_share_their_leading_blocks_and_their_key() {
        let first = chat(&[
            ("system", SYSTEM),
            ("user", "What is the capital of France?"),
        ]);
        let second = chat(&[
            ("system", SYSTEM),
            ("user", "What is the capital of France?"),
            ("assistant", "Paris is the capital of France."),
            ("user", "And of Italy?"),
        ]);
        let a = prompt_keys(Api::Chat, &first, 16).unwrap();
        let b = prompt_keys(Api::Chat, &second, 16).unwrap();
        assert!(a.blocks.len() >= 5, "{a:?}");
        assert!(b.blocks.len() > a.blocks.len());
        assert_eq!(a.blocks[..], b.blocks[..a.blocks.len()]);
        assert_eq!(a.conversation, b.conversation);
        assert!(a.conversation.is_some());
        // The first turn is all opening; the later one has more after it.
        assert_eq!(a.opening_blocks, a.blocks.len());
        assert_eq!(b.opening_blocks, a.blocks.len());

        // Another conversation with the same system prompt shares the system prompt's blocks only.
        let other = chat(&[("system", SYSTEM), ("user", "Name a prime number.")]);
        let c = prompt_keys(Api::Chat, &other, 16).unwrap();
        assert_ne!(c.conversation, a.conversation);
        let shared = a.blocks.iter().zip(&c.blocks).take_while(|(x, y)| x == y);
        assert_eq!(shared.count(), (SYSTEM.len() + "system".len() + 2) / 16);
    }

    #[test]
    fn the_model_seeds_the_hashes() {
        let mut body: serde_json::Value =
            serde_json::from_slice(&chat(&[("user", SYSTEM)])).unwrap();
        let a = prompt_keys(Api::Chat, &serde_json::to_vec(&body).unwrap(), 16).unwrap();
        body["model"] = "other".into();
        let b = prompt_keys(Api::Chat, &serde_json::to_vec(&body).unwrap(), 16).unwrap();
        assert_ne!(a.blocks[0], b.blocks[0]);
        assert_eq!(a.blocks.len(), b.blocks.len());
    }

    #[test]
    fn parts_read_as_their_text_and_user_is_a_key() {
        let parts = serde_json::json!({"model": "m", "user": "alice", "messages": [
            {"role": "user", "content": [{"type": "text", "text": SYSTEM},
                                          {"type": "image_url", "image_url": {"url": "x"}}]}]});
        let plain =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": SYSTEM}]});
        let a = prompt_keys(Api::Chat, &serde_json::to_vec(&parts).unwrap(), 16).unwrap();
        let b = prompt_keys(Api::Chat, &serde_json::to_vec(&plain).unwrap(), 16).unwrap();
        assert_eq!(a.blocks, b.blocks);
        assert_eq!(a.user, Some(session_key(b"alice")));
        assert_eq!(b.user, None);
    }

    #[test]
    fn completions_hash_their_prompt_and_key_on_its_first_blocks() {
        let long = "word ".repeat(100);
        let one = serde_json::json!({"model": "m", "prompt": long});
        let array = serde_json::json!({"model": "m", "prompt": [long]});
        let a = prompt_keys(Api::Completions, &serde_json::to_vec(&one).unwrap(), 64).unwrap();
        let b = prompt_keys(Api::Completions, &serde_json::to_vec(&array).unwrap(), 64).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.blocks.len(), 500 / 64);
        assert_eq!(a.conversation, Some(a.blocks[3]));
        assert_eq!(a.opening_blocks, 4);
        // Shorter than a block: no blocks, no key, but still a request.
        let short = serde_json::json!({"prompt": "hi"});
        let c = prompt_keys(Api::Completions, &serde_json::to_vec(&short).unwrap(), 64).unwrap();
        assert_eq!(c, PromptKeys::default());
    }

    #[test]
    fn what_is_not_a_prompt_has_no_keys() {
        for body in [
            &b"not json"[..],
            b"[]",
            b"{\"messages\": 3}",
            b"{\"messages\": [{\"role\": \"user\", \"content\": 5}]}",
            b"{\"prompt\": [1, 2, 3]}",
            b"{\"prompt\": [\"a\", \"b\"]}",
        ] {
            let api = if body.starts_with(b"{\"prompt") {
                Api::Completions
            } else {
                Api::Chat
            };
            assert_eq!(
                prompt_keys(api, body, 64),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn any_body_is_read_without_panic(body in proptest::collection::vec(proptest::num::u8::ANY, 0..400)) {
            let _ = prompt_keys(Api::Chat, &body, 16);
            let _ = prompt_keys(Api::Completions, &body, 16);
        }
    }
}

//! A request body's prompt as the prefix index reads it (`tongs_wire::openai::prefix::prompt_keys`):
//! any bytes are read without a panic, for both APIs and any block size; equal bodies give equal keys,
//! and a body's blocks are a prefix of the blocks of the same body with more prompt after.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tongs_wire::openai::Api;
use tongs_wire::openai::prefix::prompt_keys;

/// Starts the input's first byte picks, so that the inputs reach a prompt early.
const STARTS: [&[u8]; 4] = [
    b"",
    br#"{"model":"m","messages":[{"role":"system","content":"#,
    br#"{"messages":[{"role":"user","content":[{"type":"text","text":"#,
    br#"{"model":"m","prompt":"#,
];

fuzz_target!(|input: &[u8]| {
    let Some((&pick, rest)) = input.split_first() else {
        return;
    };
    let mut body = STARTS[usize::from(pick) % STARTS.len()].to_vec();
    body.extend_from_slice(rest);
    let block = 16 + usize::from(pick % 64);
    for api in [Api::Chat, Api::Completions] {
        let keys = prompt_keys(api, &body, block);
        assert_eq!(keys, prompt_keys(api, &body, block));
    }
    // A completion's prompt, and the same prompt longer: the shorter one's blocks lead the longer's.
    let text = String::from_utf8_lossy(rest);
    let short = serde_json::json!({"prompt": text});
    let long = serde_json::json!({"prompt": format!("{text}{text}")});
    let short = prompt_keys(Api::Completions, short.to_string().as_bytes(), block).unwrap();
    let long = prompt_keys(Api::Completions, long.to_string().as_bytes(), block).unwrap();
    assert_eq!(short.blocks[..], long.blocks[..short.blocks.len()]);
});

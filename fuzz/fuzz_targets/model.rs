//! A request body's `model` as pools read it: any bytes are read without a panic; a model found lies
//! in the body as a JSON string of that name, and writing another in its place changes no other byte
//! and reads back as the new name.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tongs_wire::openai::{model_of, with_model};

/// Starts of bodies the input's first byte picks, so that the inputs reach a model's value early (a
/// fuzzer left alone takes long to spell `{"model":`): none, then ones with a key before the model, an
/// escaped key, a nested model and leading whitespace.
const STARTS: [&[u8]; 6] = [
    b"",
    br#"{"model":"#,
    br#"{"stream":true,"model":"#,
    br#"{"mod\u0065l":"#,
    br#"{"messages":[{"model":"inner"}],"model":"#,
    b" \n{ \"model\" : ",
];

fuzz_target!(|input: &[u8]| {
    let Some((&pick, rest)) = input.split_first() else {
        return;
    };
    let mut body = STARTS[usize::from(pick) % STARTS.len()].to_vec();
    body.extend_from_slice(rest);
    let Some(found) = model_of(&body) else {
        return;
    };
    let token = &body[found.span.clone()];
    assert_eq!(
        serde_json::from_slice::<String>(token).ok().as_ref(),
        Some(&found.name)
    );
    // Another name, from the input too, so that escapes and multi-byte characters get written.
    let other = String::from_utf8_lossy(&rest[..rest.len().min(12)]);
    let rewritten = with_model(&body, &found, &other);
    let again = model_of(&rewritten).expect("the rewritten body names a model");
    assert_eq!(again.name, other);
    assert_eq!(again.span.start, found.span.start);
    assert_eq!(&rewritten[..again.span.start], &body[..found.span.start]);
    assert_eq!(&rewritten[again.span.end..], &body[found.span.end..]);
});

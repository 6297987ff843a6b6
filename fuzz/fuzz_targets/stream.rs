//! A node's stream as a continued OpenAI stream reads it: any bytes, cut anywhere into pieces, go
//! through the SSE framing and the splicer without a panic, and every continuation request is JSON.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use tongs_wire::openai::sse::Events;
use tongs_wire::openai::{AfterCut, Api, Continuable, Splicer};

fuzz_target!(|input: &[u8]| {
    let Some((&flags, stream)) = input.split_first() else {
        return;
    };
    let api = if flags & 1 == 0 {
        Api::Completions
    } else {
        Api::Chat
    };
    let body = match (api, flags & 2 == 0) {
        (Api::Completions, usage) => format!(
            r#"{{"stream":true,"prompt":"go","max_tokens":{},"stream_options":{{"include_usage":{usage}}}}}"#,
            flags >> 2
        ),
        (Api::Chat, usage) => format!(
            r#"{{"stream":true,"messages":[{{"role":"user","content":"go"}}],"stream_options":{{"include_usage":{usage}}}}}"#
        ),
    };
    let Ok(request) = Continuable::read(api, &Bytes::from(body)) else {
        return;
    };
    let mut splicer = Splicer::new(request);
    let mut out = BytesMut::new();
    // Byte 0x00 ends a piece (the node broke there); the next piece is a continuation.
    for (n, piece) in stream.split(|&b| b == 0).enumerate() {
        if n > 0 {
            splicer.next_piece();
        }
        let mut events = Events::new();
        for part in piece.chunks(7) {
            events.push(part);
            while let Some(event) = events.next_event() {
                splicer.event(&event, &mut out);
            }
        }
        match splicer.cut(&mut out) {
            AfterCut::Continue(next) => {
                assert!(serde_json::from_slice::<serde_json::Value>(&next.body).is_ok());
            }
            AfterCut::Complete | AfterCut::Refused(_) => break,
        }
    }
});

//! Headers nodes and clients send: `Retry-After` never waits past its cap, a drain notice never says
//! more time than its cap, any `x-priority` is a priority.
#![no_main]

use std::time::Duration;

use http::header::{HeaderMap, HeaderValue, RETRY_AFTER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(bytes) else {
        return;
    };
    let mut headers = HeaderMap::new();
    headers.insert(RETRY_AFTER, value.clone());
    headers.insert(tongs_wire::header::DRAIN, value.clone());
    if let Some(Some(left)) = tongs_wire::header::drain_notice(&headers) {
        assert!(left <= tongs_wire::header::MAX_DRAIN_NOTICE);
    }
    let cap = Duration::from_secs(30);
    assert!(tongs_wire::header::retry_after(&headers, cap) <= cap);
    let _ = tongs_wire::header::Priority::from_header(Some(&value));
});

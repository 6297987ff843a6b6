//! What pod annotations, registrations and the allowlist carry: endpoint URLs, allowlist rules and
//! node addresses. Any text parses or is refused with a message; a URL that parses can be dialled.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tongs_wire::config::{AllowRule, EndpointUrl, parse_address};

fuzz_target!(|text: &str| {
    if let Ok(url) = EndpointUrl::parse(text) {
        assert!(!url.authority.host().is_empty());
        assert!(url.authority.port_u16() != Some(0));
    }
    if let Err(message) = AllowRule::parse(text) {
        assert!(!message.is_empty());
    }
    if let Ok(address) = parse_address(text) {
        assert!(address.port() != 0);
    }
});

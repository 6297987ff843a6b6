//! The configuration file (a ConfigMap anyone with edit rights writes): any text is a configuration
//! or an error naming what is wrong, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if let Err(err) = tongs_wire::config::Config::parse(text, "fuzz") {
        assert!(!err.to_string().is_empty());
    }
});

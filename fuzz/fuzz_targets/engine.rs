//! A model server's metrics page as tongs reads it (`tongs_wire::engine::read_load`), under every
//! engine's names: any bytes are read without a panic, and a reading is in range (the cache use from 0
//! to 1).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tongs_wire::engine::{Engine, read_load};

/// Starts the input's first byte picks, so that lines reach the wanted names early.
const STARTS: [&str; 5] = [
    "",
    "vllm:num_requests_running{model_name=\"m\"} 3\nvllm:num_requests_waiting",
    "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\",",
    "sglang:num_running_reqs 1\nsglang:num_queue_reqs",
    "tgi_batch_current_size 2\ntgi_queue_size",
];

fuzz_target!(|input: &[u8]| {
    let Some((&pick, rest)) = input.split_first() else {
        return;
    };
    let page = format!(
        "{}{}",
        STARTS[usize::from(pick) % STARTS.len()],
        String::from_utf8_lossy(rest)
    );
    for engine in Engine::ALL {
        if let Ok(load) = read_load(engine, &page) {
            assert!(load.cache.is_none_or(|c| (0.0..=1.0).contains(&c)));
        }
    }
});

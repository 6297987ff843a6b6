//! Benchmarks reading a request's `model` (`tongs::openai::model_of`), what routing a request to a pool
//! by its model costs, against routing by path (`str::starts_with` on the path): on an OpenAI chat
//! body of 4 KiB and of 1 MiB, with `model` as its first key (as clients send it) and as its last.
//! `read_model` reads every top-level key either way (a second `model` must be caught), so the two
//! time alike. Then counts the heap allocations per read: the name, and serde_json's scratch buffer.
//!
//! Beside it, what deciding whether a streamed body can be continued costs (`Continuable::read`, which
//! reads only the fields that decide), against building the whole body as a `serde_json::Value` (what
//! that check did before), on the same bodies, in the same run.
//!
//! Run with `cargo bench --bench model`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use tongs::openai::{Api, Continuable, model_of};

#[path = "support/chat.rs"]
mod chat;

/// dhat's allocator counts every heap allocation while a profiler runs.
#[global_allocator]
static GLOBAL: dhat::Alloc = dhat::Alloc;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const PATH: &str = "/v1/chat/completions";
const SIZES: [(&str, usize); 2] = [("4KiB", 4 << 10), ("1MiB", 1 << 20)];
/// Reads per body in the allocation count; `cargo test --all-targets` (no `--bench` argument) runs a
/// few, unoptimised: the count per read is the same, 10,000 reads of 1 MiB would take minutes.
const ALLOC_CHECK_READS: u64 = 10_000;
const ALLOC_CHECK_READS_IN_TESTS: u64 = 10;

/// A chat request of at least `size` bytes: a conversation, then the sampling settings; `model` first
/// or last.
fn chat_body(size: usize, model_first: bool) -> Vec<u8> {
    let messages = chat::conversation(size);
    let model = serde_json::to_string(MODEL).unwrap();
    let settings = r#""temperature":0.7,"top_p":0.95,"max_tokens":512,"stream":true,"stream_options":{"include_usage":true}"#;
    let body = if model_first {
        format!(r#"{{"model":{model},"messages":{messages},{settings}}}"#)
    } else {
        format!(r#"{{"messages":{messages},{settings},"model":{model}}}"#)
    };
    assert!(body.len() >= size);
    assert_eq!(model_of(body.as_bytes()).unwrap().name, MODEL);
    body.into_bytes()
}

fn bench_model(c: &mut Criterion) {
    c.bench_function("path_prefix", |b| {
        b.iter(|| black_box(PATH).starts_with(black_box("/v1/chat/completions")))
    });
    // Every top-level key is read wherever the model sits: the body's size matters.
    let mut group = c.benchmark_group("model_first");
    for (name, size) in SIZES {
        let body = chat_body(size, true);
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| model_of(black_box(body)).map(|found| found.span.start))
        });
    }
    group.finish();
    // The whole body is read: bytes per second.
    let mut group = c.benchmark_group("model_last");
    for (name, size) in SIZES {
        let body = chat_body(size, false);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| model_of(black_box(body)).map(|found| found.span.start))
        });
    }
    group.finish();
    // Deciding whether a streamed chat request can be continued, against the whole body built.
    let mut group = c.benchmark_group("continuable");
    for (name, size) in SIZES {
        let body = bytes::Bytes::from(chat_body(size, true));
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::new("fields_read", name), &body, |b, body| {
            b.iter(|| Continuable::read(Api::Chat, black_box(body)).is_ok())
        });
        group.bench_with_input(BenchmarkId::new("whole_value", name), &body, |b, body| {
            b.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(body)).is_ok())
        });
    }
    group.finish();
}

/// Reads each body `ALLOC_CHECK_READS` times (a few under `cargo test`) and prints the heap
/// allocations per read.
fn allocation_check() {
    let reads = if std::env::args().any(|arg| arg == "--bench") {
        ALLOC_CHECK_READS
    } else {
        ALLOC_CHECK_READS_IN_TESTS
    };
    let _profiler = dhat::Profiler::builder().testing().build();
    for (name, size) in SIZES {
        for (place, first) in [("model first", true), ("model last", false)] {
            let body = chat_body(size, first);
            let before = dhat::HeapStats::get().total_blocks;
            for _ in 0..reads {
                black_box(model_of(black_box(&body)));
            }
            let made = dhat::HeapStats::get().total_blocks - before;
            println!(
                "{name} ({} bytes), {place}: allocations per read: {} ({made} in {reads})",
                body.len(),
                made as f64 / reads as f64
            );
        }
    }
}

fn main() {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    bench_model(&mut criterion);
    criterion.final_summary();
    allocation_check();
}

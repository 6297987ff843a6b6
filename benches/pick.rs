//! Benchmarks `tongs::balance::pick` at 8, 64 and 10,000 endpoints, with uneven outstanding load, with and
//! without a small exclusion slice; then counts heap allocations over 1,000,000 picks per size.
//!
//! Then the pick as a pool makes it by default (`balancer.scorers` unset: five scorers, the line and
//! saturation filters, the nodes' own metrics read), with no affinity key, with a conversation's
//! prompt (its prefix index and homes), and with every node's streams seen at each load (the line
//! filter's whole walk), against the policy's scorer alone in the same run; and what
//! reading a prompt's keys costs: an 8,000-token chat body (about 32 KB) cut into 64-byte blocks and
//! hashed, and its match in a pool's prefix index.
//!
//! Run with `cargo bench --bench pick`.

use std::hint::black_box;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion};
use tongs::balance::{
    PickContext, Pipeline, PrefixIndex, RequestKeys, Saturation, Unlined, Unsaturated, pick,
};
use tongs::config::{self, BalancePolicy, EndpointUrl};
use tongs::endpoint::{Endpoint, EndpointId, Outstanding};
use tongs::openai::Api;
use tongs::openai::prefix::prompt_keys;

/// dhat's allocator counts every heap allocation while a profiler runs.
#[global_allocator]
static GLOBAL: dhat::Alloc = dhat::Alloc;

/// Heap allocations made so far (only while the dhat profiler runs).
fn allocations() -> u64 {
    dhat::HeapStats::get().total_blocks
}

/// What the proxy passes on every pick: the time, slow start on, heartbeats respected. The time is read
/// once outside the measured loop: the proxy reads the clock for its timeouts anyway, and in a bench
/// build tokio's clock is slower than in the binary (its test-util feature is on for the tests). It is a
/// minute after the fleet was built, so no endpoint is still in slow start (the steady state).
fn context(policy: BalancePolicy) -> PickContext<'static> {
    static NOW: OnceLock<tokio::time::Instant> = OnceLock::new();
    static PIPELINES: OnceLock<[Pipeline; 2]> = OnceLock::new();
    let now = *NOW.get_or_init(|| tokio::time::Instant::now() + Duration::from_secs(60));
    let [expected, least] = PIPELINES.get_or_init(|| {
        [
            Pipeline::for_policy(BalancePolicy::ExpectedLatency),
            Pipeline::for_policy(BalancePolicy::LeastOutstanding),
        ]
    });
    PickContext {
        slow_start_ms: 5_000,
        pipeline: match policy {
            BalancePolicy::ExpectedLatency => expected,
            BalancePolicy::LeastOutstanding => least,
        },
        fleet_latency_us: 50_000,
        ..PickContext::at(now)
    }
}

/// The two balancer policies: expected latency (the default) and plain least outstanding.
const POLICIES: [(&str, BalancePolicy); 2] = [
    ("expected_latency", BalancePolicy::ExpectedLatency),
    ("least_outstanding", BalancePolicy::LeastOutstanding),
];

const SIZES: [usize; 3] = [8, 64, 10_000];
const ALLOC_CHECK_PICKS: u64 = 1_000_000;

/// `n` endpoints with weights 1..=4, and guards that keep endpoint `i` holding `i % 5` outstanding
/// requests, so loads differ and ties are partial. Keep the guards alive while picking.
fn fleet(n: usize) -> (Vec<Arc<Endpoint>>, Vec<Outstanding>) {
    let endpoints: Vec<Arc<Endpoint>> = (0..n)
        .map(|i| {
            let url = format!(
                "http://10.{}.{}.{}:8000",
                i >> 16,
                (i >> 8) & 0xff,
                i & 0xff
            );
            let parsed = EndpointUrl::parse(&url).unwrap();
            Arc::new(Endpoint::new(i as u64, &url, parsed, (i % 4) as u32 + 1))
        })
        .collect();
    let held = endpoints
        .iter()
        .enumerate()
        .flat_map(|(i, endpoint)| (0..i % 5).map(|_| endpoint.start_request()))
        .collect();
    // Latency estimates from 20 to 200 ms, observed just before the picks, as under steady traffic.
    let now_ms = tongs::endpoint::millis(context(BalancePolicy::LeastOutstanding).now);
    for (i, endpoint) in endpoints.iter().enumerate() {
        endpoint.latency().observe(
            Duration::from_millis(20 + (i as u64 * 37) % 180),
            now_ms,
            10_000,
        );
    }
    (endpoints, held)
}

/// Three endpoint ids to skip, as a retry that already tried three endpoints would.
fn exclusions(n: usize) -> Vec<EndpointId> {
    vec![0, (n / 2) as u64, (n - 1) as u64]
}

fn bench_pick(c: &mut Criterion) {
    for (name, policy) in POLICIES {
        let mut group = c.benchmark_group(format!("pick_{name}"));
        for &n in &SIZES {
            let (endpoints, _held) = fleet(n);
            let exclude = exclusions(n);
            let ctx = context(policy);
            group.bench_with_input(BenchmarkId::new("no_exclusions", n), &n, |b, _| {
                b.iter(|| pick(black_box(&endpoints), black_box(&[]), &ctx).map(|(e, _)| e.id()))
            });
            group.bench_with_input(BenchmarkId::new("exclude_3", n), &n, |b, _| {
                b.iter(|| {
                    pick(black_box(&endpoints), black_box(&exclude), &ctx).map(|(e, _)| e.id())
                })
            });
        }
        group.finish();
    }
}

/// Runs `ALLOC_CHECK_PICKS` picks per size (half with exclusions) and prints the allocations they made.
fn allocation_check() {
    let _profiler = dhat::Profiler::builder().testing().build();
    for &n in &SIZES {
        let before_setup = allocations();
        let (endpoints, _held) = fleet(n);
        // The counter must see the fleet being built, or a zero below would prove nothing.
        assert!(
            allocations() > before_setup,
            "allocation counter is not counting"
        );
        let exclude = exclusions(n);
        // One pick first, so any lazy one-time setup (e.g. the thread-local RNG) is not counted.
        black_box(pick(
            &endpoints,
            &exclude,
            &context(BalancePolicy::ExpectedLatency),
        ));
        let before = allocations();
        let mut checksum = 0u64;
        for i in 0..ALLOC_CHECK_PICKS {
            let skip: &[EndpointId] = if i % 2 == 0 { &[] } else { &exclude };
            let (picked, _) = pick(
                black_box(&endpoints),
                black_box(skip),
                &context(BalancePolicy::ExpectedLatency),
            )
            .unwrap();
            checksum = checksum.wrapping_add(picked.id());
        }
        let made = allocations() - before;
        black_box(checksum);
        println!(
            "{n:>6} endpoints: allocations per pick: {} ({made} in {ALLOC_CHECK_PICKS} picks)",
            made as f64 / ALLOC_CHECK_PICKS as f64
        );
    }
}

/// A chat body of about `tokens` tokens (four bytes each): a system prompt and alternating turns.
fn chat_body(tokens: usize) -> Vec<u8> {
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are helpful. ".repeat(64)})];
    let mut turn = 0;
    while messages
        .iter()
        .map(|m| m["content"].as_str().unwrap().len())
        .sum::<usize>()
        < tokens * 4
    {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(
            serde_json::json!({"role": role, "content": format!("turn {turn}: ").repeat(60)}),
        );
        turn += 1;
    }
    serde_json::to_vec(&serde_json::json!({"model": "llama", "stream": true, "messages": messages}))
        .unwrap()
}

fn bench_default_pipeline(c: &mut Criterion) {
    let default = config::default_scorers(BalancePolicy::ExpectedLatency);
    // As a pool builds it (`proxy::BalanceSettings`): the line filter, then the saturation filter.
    let pipeline = Pipeline::of(&default)
        .unwrap()
        .with_filter(Box::new(Unlined))
        .with_filter(Box::new(Unsaturated(Saturation::from_config(
            &config::Saturation::default(),
        ))));
    let alone = Pipeline::for_policy(BalancePolicy::ExpectedLatency);
    let body = chat_body(8_000);
    let keys = RequestKeys {
        prompt: prompt_keys(Api::Chat, &body, 64).unwrap(),
        session: None,
    };
    let mut group = c.benchmark_group("pick_default_pipeline");
    for &n in &SIZES {
        let (endpoints, _held) = fleet(n);
        let index = PrefixIndex::new(200_000);
        index.record(&keys.prompt.blocks, &endpoints[n / 2]);
        let base = context(BalancePolicy::ExpectedLatency);
        let policy_alone = PickContext {
            pipeline: &alone,
            ..base
        };
        // No endpoint has a reading: the proxy then passes no signals window (see `signals_window`).
        let by_default = PickContext {
            pipeline: &pipeline,
            ..base
        };
        let with_prompt = PickContext {
            keys: Some((&keys, &index)),
            ..by_default
        };
        // Every endpoint read just now: 2 running, 0 to 3 waiting, its cache 0 to 90 % full.
        let read_ms = tongs::endpoint::millis(base.now);
        for (i, endpoint) in endpoints.iter().enumerate() {
            let load = tongs::engine::EngineLoad {
                running: 2,
                waiting: (i % 4) as u32,
                cache: Some((i % 10) as f64 / 10.0),
                progress: None,
            };
            endpoint.signals().record(
                tongs::engine::Engine::Vllm,
                load,
                endpoint.outstanding(),
                read_ms,
            );
        }
        let with_signals = PickContext {
            signals_max_age_ms: 3_000,
            ..by_default
        };
        let with_both = PickContext {
            keys: Some((&keys, &index)),
            ..with_signals
        };
        let mut measure = |name: &str, ctx: &PickContext<'_>| {
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| pick(black_box(&endpoints), black_box(&[]), ctx).map(|(e, _)| e.id()))
            });
        };
        for (name, ctx) in [
            ("policy_alone", &policy_alone),
            ("default", &by_default),
            ("default_8k_prompt", &with_prompt),
        ] {
            measure(name, ctx);
        }
        // Every endpoint has streamed at each load up to the one it holds now, quickly: the line
        // filter walks every level of each node it looks at, and keeps none out.
        for endpoint in &endpoints {
            for load in 1..=endpoint.outstanding() + 1 {
                endpoint
                    .latency()
                    .observe_stream_start(Duration::from_millis(15), load, read_ms);
            }
        }
        measure("default_streams", &by_default);
        for (name, ctx) in [
            ("default_signals", &with_signals),
            ("default_signals_8k_prompt", &with_both),
        ] {
            measure(name, ctx);
        }
    }
    group.finish();
    let mut group = c.benchmark_group("prompt_8k_tokens");
    group.bench_function("prompt_keys", |b| {
        b.iter(|| prompt_keys(Api::Chat, black_box(&body), 64).map(|k| k.blocks.len()))
    });
    let (endpoints, _held) = fleet(8);
    let index = PrefixIndex::new(200_000);
    index.record(&keys.prompt.blocks, &endpoints[3]);
    group.bench_function("index_match", |b| {
        b.iter(|| index.matches(black_box(&keys.prompt.blocks)).best())
    });
    group.bench_function("index_record", |b| {
        b.iter(|| index.record(black_box(&keys.prompt.blocks), &endpoints[3]))
    });
    group.finish();
    println!(
        "prompt: {} bytes, {} blocks of 64 bytes",
        body.len(),
        keys.prompt.blocks.len()
    );
}

fn main() {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    bench_pick(&mut criterion);
    bench_default_pipeline(&mut criterion);
    criterion.final_summary();
    allocation_check();
}

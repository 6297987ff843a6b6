//! Benchmarks `tongs::balance::pick` at 8, 64 and 10,000 endpoints, with uneven outstanding load, with and
//! without a small exclusion slice; then counts heap allocations over 1,000,000 picks per size.
//!
//! Run with `cargo bench --bench pick`.

use std::hint::black_box;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion};
use tongs::balance::{PickContext, Pipeline, pick};
use tongs::config::{BalancePolicy, EndpointUrl};
use tongs::endpoint::{Endpoint, EndpointId, Outstanding};

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

fn main() {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    bench_pick(&mut criterion);
    criterion.final_summary();
    allocation_check();
}

//! The pick with the model servers' own signals and the request's affinity: saturation, the
//! stale-signal rule, prefix matches against load, and homes two replicas agree on.

use std::time::Duration;

use tokio::time::Instant;

use super::tests::endpoint;
use super::*;
use crate::config::{self, BalancerConfig};
use crate::engine::{Engine, EngineLoad};
use crate::openai::prefix::PromptKeys;

/// The pipeline `balancer.scorers` gives by default, with the saturation filter at its defaults.
fn default_pipeline() -> Pipeline {
    pipeline_for(BalancerConfig::default().policy)
}

/// The default scorers and filter with `policy`'s load scorer.
fn pipeline_for(policy: config::BalancePolicy) -> Pipeline {
    let weights = config::default_scorers(policy);
    Pipeline::of(&weights)
        .unwrap()
        .with_filter(Box::new(Unsaturated(Saturation::from_config(
            &config::Saturation::default(),
        ))))
}

fn fleet(n: u64) -> Vec<Arc<Endpoint>> {
    (0..n).map(|id| Arc::new(endpoint(id))).collect()
}

fn read(endpoint: &Endpoint, running: u32, waiting: u32, cache: Option<f64>) {
    let load = EngineLoad {
        running,
        waiting,
        cache,
        progress: None,
    };
    let now_ms = crate::endpoint::millis(Instant::now());
    endpoint
        .signals()
        .record(Engine::Vllm, load, endpoint.outstanding(), now_ms);
}

fn ctx<'p>(pipeline: &'p Pipeline) -> PickContext<'p> {
    PickContext {
        pipeline,
        signals_max_age_ms: 3_000,
        ..PickContext::at(Instant::now())
    }
}

fn picks(endpoints: &[Arc<Endpoint>], ctx: &PickContext<'_>, n: usize) -> Vec<usize> {
    let mut counts = vec![0; endpoints.len()];
    for _ in 0..n {
        counts[pick(endpoints, &[], ctx).unwrap().0.id() as usize] += 1;
    }
    counts
}

#[tokio::test(start_paused = true)]
async fn a_node_whose_own_queue_is_long_gets_no_new_request_while_another_has_room() {
    let endpoints = fleet(3);
    let pipeline = default_pipeline();
    // Node 0 is busy with load tongs did not send: a full batch and 9 waiting.
    read(&endpoints[0], 8, 9, Some(0.5));
    read(&endpoints[1], 2, 0, Some(0.1));
    read(&endpoints[2], 3, 0, Some(0.2));
    let counts = picks(&endpoints, &ctx(&pipeline), 50);
    assert_eq!(counts[0], 0, "{counts:?}");
    // Its KV cache nearly full does the same, even with no queue.
    read(&endpoints[0], 2, 0, Some(0.95));
    assert_eq!(picks(&endpoints, &ctx(&pipeline), 50)[0], 0);
}

#[tokio::test(start_paused = true)]
async fn when_every_node_is_saturated_the_request_waits_for_tongs_queue() {
    let endpoints = fleet(2);
    let pipeline = default_pipeline();
    read(&endpoints[0], 8, 5, None);
    read(&endpoints[1], 8, 6, None);
    assert!(pick(&endpoints, &[], &ctx(&pipeline)).is_none());
    // What tongs sent there ends: the estimate falls below the threshold without a new reading.
    let held: Vec<_> = (0..2).map(|_| endpoints[0].start_request()).collect();
    read(&endpoints[0], 8, 5, None);
    assert!(pick(&endpoints, &[], &ctx(&pipeline)).is_none());
    drop(held);
    assert_eq!(pick(&endpoints, &[], &ctx(&pipeline)).unwrap().0.id(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_stale_reading_is_not_used_either_way() {
    let endpoints = fleet(2);
    let pipeline = default_pipeline();
    read(&endpoints[0], 8, 40, Some(1.0));
    read(&endpoints[1], 0, 0, Some(0.0));
    assert_eq!(picks(&endpoints, &ctx(&pipeline), 20)[0], 0);
    tokio::time::advance(Duration::from_millis(3_001)).await;
    // Both readings aged out: tongs' own counts alone, which are equal, so both get traffic.
    let counts = picks(&endpoints, &ctx(&pipeline), 200);
    assert!(counts[0] > 40 && counts[1] > 40, "{counts:?}");
    // A node that was idle by a stale reading is not preferred for it either: with signals, node 1
    // would look idle; aged out, tongs' own counts decide.
    read(&endpoints[1], 0, 0, None);
    tokio::time::advance(Duration::from_millis(3_001)).await;
    let _held = endpoints[1].start_request();
    assert_eq!(picks(&endpoints, &ctx(&pipeline), 20)[1], 0);
}

#[tokio::test(start_paused = true)]
async fn load_from_elsewhere_counts_when_the_metrics_are_fresh() {
    let endpoints = fleet(2);
    let pipeline = Pipeline::of(&[("least-outstanding", 1.0)]).unwrap();
    // tongs sent neither anything; node 0 runs 4 from another client.
    read(&endpoints[0], 4, 0, None);
    read(&endpoints[1], 0, 0, None);
    let counts = picks(&endpoints, &ctx(&pipeline), 20);
    assert_eq!(counts, [0, 20]);
    let off = PickContext {
        signals_max_age_ms: 0,
        ..ctx(&pipeline)
    };
    let counts = picks(&endpoints, &off, 200);
    assert!(
        counts[0] > 40,
        "signals off: tongs' own counts only, {counts:?}"
    );
}

fn keys(blocks: &[u64], conversation: Option<u64>, session: Option<u64>) -> RequestKeys {
    RequestKeys {
        prompt: PromptKeys {
            blocks: blocks.to_vec(),
            conversation,
            opening_blocks: 0,
            user: None,
        },
        session,
    }
}

#[tokio::test(start_paused = true)]
async fn a_prompt_goes_where_its_prefix_is_until_that_node_is_loaded_four_times_the_others() {
    let endpoints = fleet(4);
    // Load by outstanding requests, so the arithmetic below is plain.
    let pipeline = pipeline_for(config::BalancePolicy::LeastOutstanding);
    let index = PrefixIndex::new(1_000);
    let request = keys(&[11, 12, 13, 14], None, None);
    index.record(&request.prompt.blocks, &endpoints[2]);
    let with_keys = PickContext {
        keys: Some((&request, &index)),
        ..ctx(&pipeline)
    };
    // Equal load: the node holding the prefix wins every time.
    assert_eq!(picks(&endpoints, &with_keys, 30)[2], 30);
    // Held at 2 against 0: (2 + 1) ÷ 1 = 3 times the others' cost, under 2^2: it still wins.
    let held: Vec<_> = (0..2).map(|_| endpoints[2].start_request()).collect();
    assert_eq!(pick(&endpoints, &[], &with_keys).unwrap().0.id(), 2);
    // Held at 4: five times the others' cost, past 2^2: load wins.
    let more: Vec<_> = (0..2).map(|_| endpoints[2].start_request()).collect();
    assert_ne!(pick(&endpoints, &[], &with_keys).unwrap().0.id(), 2);
    drop((held, more));
    // Saturated by its own metrics, it takes nothing whatever it holds.
    read(&endpoints[2], 8, 7, None);
    assert_eq!(picks(&endpoints, &with_keys, 30)[2], 0);
}

#[tokio::test(start_paused = true)]
async fn two_replicas_agree_on_a_conversations_home_and_it_moves_as_a_whole() {
    // Two replicas: each its own endpoints (the same URLs) and its own empty index.
    let (a, b) = (fleet(6), fleet(6));
    let pipeline = default_pipeline();
    let (index_a, index_b) = (PrefixIndex::new(1_000), PrefixIndex::new(1_000));
    for conversation in 1..=40u64 {
        let turn = keys(&[conversation * 100], Some(conversation), None);
        let at = |endpoints: &[Arc<Endpoint>], index: &PrefixIndex, exclude: &[EndpointId]| {
            let ctx = PickContext {
                keys: Some((&turn, index)),
                ..ctx(&pipeline)
            };
            pick(endpoints, exclude, &ctx).unwrap().0.id()
        };
        let home = at(&a, &index_a, &[]);
        assert_eq!(at(&b, &index_b, &[]), home, "conversation {conversation}");
        // Its node gone (excluded here), both move it to the same next one.
        let next = at(&a, &index_a, &[home]);
        assert_ne!(next, home);
        assert_eq!(at(&b, &index_b, &[home]), next);
    }
}

#[tokio::test(start_paused = true)]
async fn a_session_stays_on_its_home_and_homes_spread_over_the_fleet() {
    let endpoints = fleet(4);
    let pipeline = default_pipeline();
    let index = PrefixIndex::new(10);
    let mut homes = [0usize; 4];
    for session in 1..=200u64 {
        let request = keys(&[], None, Some(session.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
        let with_keys = PickContext {
            keys: Some((&request, &index)),
            ..ctx(&pipeline)
        };
        let first = pick(&endpoints, &[], &with_keys).unwrap().0.id();
        for _ in 0..3 {
            assert_eq!(pick(&endpoints, &[], &with_keys).unwrap().0.id(), first);
        }
        homes[first as usize] += 1;
    }
    assert!(homes.iter().all(|&n| n > 25), "{homes:?}");
}

#[test]
fn without_keys_or_signals_the_default_pipeline_picks_as_its_policy_alone() {
    let endpoints = fleet(3);
    let pipeline = default_pipeline();
    let alone = Pipeline::for_policy(BalancerConfig::default().policy);
    let _held = [
        endpoints[0].start_request(),
        endpoints[0].start_request(),
        endpoints[2].start_request(),
    ];
    let now = Instant::now();
    for _ in 0..20 {
        let by_default = pick(&endpoints, &[], &ctx(&pipeline)).unwrap().0.id();
        let by_policy = pick(
            &endpoints,
            &[],
            &PickContext {
                pipeline: &alone,
                ..PickContext::at(now)
            },
        )
        .unwrap()
        .0
        .id();
        assert_eq!(by_default, by_policy);
        assert_eq!(by_default, 1);
    }
}

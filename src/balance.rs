//! Picking an endpoint over a registry snapshot: by expected latency (`balancer.policy:
//! expected-latency`, the default) or by outstanding requests alone (`least-outstanding`).
//!
//! The load of an endpoint is the time to first byte a new request there should expect, over its
//! weight. Under `expected-latency` that is what its answers took when it held as many requests as it
//! would with this one (`Endpoint::rank_latency_us`): a GPU server that answers eight at once in
//! 120 ms keeps its share up to eight, where the single-worker model of linkerd's and Finagle's
//! peak-EWMA cost, `(outstanding + 1) × latency`, would send the fourth request to an idle node four
//! times slower. Loads not yet seen are assumed to queue (that same product), until answers show
//! otherwise. Each request already there also adds an eighth of that, divided by the weight
//! ([`LOAD_SPREAD`]), so nodes about as fast share the load in proportion to their weights. The expected latency is never below the endpoint's silence: how long attempts there have
//! waited with none answered, so a node that stops answering loses its share as its silence grows.
//! Under `least-outstanding` the load is `(outstanding + 1) / weight`: comparing `o + 1` rather than
//! `o` makes weights matter even when every endpoint is idle, and spreads concurrent load in proportion
//! to weight (weight 3 takes three requests for every one a weight-1 endpoint takes). Ratios are
//! compared by cross-multiplication, so no floats. An endpoint without an estimate of its own is
//! ranked by the fleet's.
//!
//! Small sets (up to [`FULL_SCAN_MAX`]) are scanned fully with a random tie-break, which is exact and
//! cheap. Larger sets use the power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized
//! Load Balancing", 2001): two random eligible endpoints, keep the less loaded. That is O(1) at 10,000
//! endpoints and avoids the herd behaviour of an exact scan across many proxy replicas whose views lag.
//!
//! Only eligible endpoints are picked: below their limit, not draining, healthy and not suspect by
//! heartbeats (unless the caller is in panic mode), not cooling down after back-pressure, breaker closed
//! — or half-open with its one probe slot free, which the caller must then claim. When every endpoint is
//! cooling down the pick finds none and the request waits in the queue. Slow start scales a new or
//! recovered endpoint's weight from 10 % to 100 % over the configured window.
//!
//! A pick never allocates: the exclusion set is a caller-owned slice (the endpoints a retry already tried).

use std::cmp::Ordering;
use std::sync::Arc;

use tokio::time::Instant;

use crate::endpoint::{Eligibility, Endpoint, EndpointId};

/// What a pick needs besides the endpoints.
#[derive(Clone, Copy, Debug)]
pub struct PickContext {
    pub now: Instant,
    /// Slow-start window in milliseconds (0: off).
    pub slow_start_ms: u64,
    /// Panic mode: every endpoint failed its heartbeats, so heartbeats are ignored.
    pub ignore_health: bool,
    /// Rank by expected latency (`Some`: the fleet's estimate in microseconds, for endpoints without
    /// one) or by outstanding count alone (`None`).
    pub neutral_latency_us: Option<u64>,
    /// Time constant of the latency estimates, milliseconds.
    pub latency_decay_ms: u64,
}

impl PickContext {
    pub fn at(now: Instant) -> PickContext {
        PickContext {
            now,
            slow_start_ms: 0,
            ignore_health: false,
            neutral_latency_us: None,
            latency_decay_ms: 10_000,
        }
    }
}

/// An eligible endpoint and how it may be used.
pub type Picked<'a> = (&'a Arc<Endpoint>, Eligibility);

/// Under `expected-latency`, each request an endpoint already holds adds `1 ÷ (LOAD_SPREAD × weight)`
/// of its expected latency to its cost, even where its answers show no slowdown yet: nodes about as
/// fast share the load rather than the one measured a little faster taking all of it, a node not
/// picked for a while is tried again (what was learnt of it does not go stale), and weights (slow
/// start's included) set how many requests an endpoint takes for every one another takes. Small
/// against a real difference in speed: a node twice as fast keeps its share up to eight requests
/// ahead.
const LOAD_SPREAD: u64 = 8;

/// Largest set scanned fully; above it, power of two choices.
pub const FULL_SCAN_MAX: usize = 32;

/// Random samples a two-choice pick draws before it falls back to a scan (when most endpoints are
/// excluded or unavailable, sampling alone could miss the few eligible ones).
const MAX_SAMPLES: usize = 8;

/// Picks the eligible endpoint with the least load per unit of weight (see the module's doc), skipping
/// those in `exclude`. `None` when no endpoint is eligible.
pub fn pick<'a>(
    endpoints: &'a [Arc<Endpoint>],
    exclude: &[EndpointId],
    ctx: &PickContext,
) -> Option<Picked<'a>> {
    let now_ms = crate::endpoint::millis(ctx.now);
    if endpoints.len() <= FULL_SCAN_MAX {
        full_scan(endpoints, exclude, ctx, now_ms)
    } else {
        two_choices(endpoints, exclude, ctx, now_ms)
    }
}

/// An eligible candidate with its load as a fraction compared by cross-multiplication (see the
/// module's doc).
struct Candidate<'a> {
    endpoint: &'a Arc<Endpoint>,
    eligibility: Eligibility,
    load: (u128, u64),
}

fn candidate<'a>(
    endpoint: &'a Arc<Endpoint>,
    exclude: &[EndpointId],
    ctx: &PickContext,
    now_ms: u64,
) -> Option<Candidate<'a>> {
    if exclude.contains(&endpoint.id()) {
        return None;
    }
    let eligibility = endpoint.eligibility(now_ms, ctx.ignore_health);
    if eligibility == Eligibility::No {
        return None;
    }
    let weight = endpoint.effective_weight(now_ms, ctx.slow_start_ms);
    let outstanding = endpoint.outstanding();
    let load = match ctx.neutral_latency_us {
        // expected × (SPREAD × w + o) ÷ (SPREAD × w), with the weight in thousandths.
        Some(neutral) => {
            let expected =
                endpoint.rank_latency_us(now_ms, outstanding, neutral, ctx.latency_decay_ms);
            let share = LOAD_SPREAD.saturating_mul(weight);
            (
                u128::from(expected)
                    * u128::from(share.saturating_add(outstanding.saturating_mul(1000))),
                share,
            )
        }
        None => (u128::from(outstanding.saturating_add(1)), weight),
    };
    Some(Candidate {
        endpoint,
        eligibility,
        load,
    })
}

fn compare(a: (u128, u64), b: (u128, u64)) -> Ordering {
    // At most 2^64 × 2^64 × 10^7 on each side would overflow; saturating keeps the order sane far beyond
    // any real outstanding count and latency.
    a.0.saturating_mul(u128::from(b.1))
        .cmp(&b.0.saturating_mul(u128::from(a.1)))
}

fn full_scan<'a>(
    endpoints: &'a [Arc<Endpoint>],
    exclude: &[EndpointId],
    ctx: &PickContext,
    now_ms: u64,
) -> Option<Picked<'a>> {
    let mut best: Option<Candidate<'a>> = None;
    let mut ties = 0u32;
    for endpoint in endpoints {
        let Some(candidate) = candidate(endpoint, exclude, ctx, now_ms) else {
            continue;
        };
        match &best {
            Some(current) => match compare(candidate.load, current.load) {
                Ordering::Less => {
                    best = Some(candidate);
                    ties = 1;
                }
                Ordering::Equal => {
                    // Reservoir sampling: each of the k tied endpoints ends up chosen with probability 1/k.
                    ties += 1;
                    if fastrand::u32(..ties) == 0 {
                        best = Some(candidate);
                    }
                }
                Ordering::Greater => {}
            },
            None => {
                best = Some(candidate);
                ties = 1;
            }
        }
    }
    best.map(|c| (c.endpoint, c.eligibility))
}

fn two_choices<'a>(
    endpoints: &'a [Arc<Endpoint>],
    exclude: &[EndpointId],
    ctx: &PickContext,
    now_ms: u64,
) -> Option<Picked<'a>> {
    let mut first: Option<Candidate<'a>> = None;
    for _ in 0..MAX_SAMPLES {
        let endpoint = &endpoints[fastrand::usize(..endpoints.len())];
        let Some(second) = candidate(endpoint, exclude, ctx, now_ms) else {
            continue;
        };
        match first {
            None => first = Some(second),
            Some(ref chosen) if chosen.endpoint.id() == second.endpoint.id() => {}
            Some(chosen) => {
                let winner = match compare(chosen.load, second.load) {
                    Ordering::Less => chosen,
                    Ordering::Greater => second,
                    Ordering::Equal if fastrand::bool() => chosen,
                    Ordering::Equal => second,
                };
                return Some((winner.endpoint, winner.eligibility));
            }
        }
    }
    full_scan(endpoints, exclude, ctx, now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::config::EndpointUrl;
    use crate::endpoint::Outstanding;

    fn ctx() -> PickContext {
        PickContext::at(Instant::now())
    }

    fn fleet(weights: &[u32]) -> Vec<Arc<Endpoint>> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let url = format!("http://127.0.0.1:{}", 10_000 + i);
                let parsed = EndpointUrl::parse(&url).unwrap();
                Arc::new(Endpoint::new(i as u64, &url, parsed, w))
            })
            .collect()
    }

    /// Picks `n` requests in a row, each held open, and returns how many each endpoint got.
    fn hold(endpoints: &[Arc<Endpoint>], n: usize) -> (Vec<usize>, Vec<Outstanding>) {
        let mut counts = vec![0; endpoints.len()];
        let mut held = Vec::new();
        for _ in 0..n {
            let (chosen, _) = pick(endpoints, &[], &ctx()).unwrap();
            counts[chosen.id() as usize] += 1;
            held.push(chosen.start_request());
        }
        (counts, held)
    }

    #[test]
    fn empty_set_picks_nothing() {
        assert!(pick(&[], &[], &ctx()).is_none());
    }

    #[test]
    fn prefers_the_idle_endpoint() {
        let endpoints = fleet(&[1, 1, 1]);
        let _busy_a = endpoints[0].start_request();
        let _busy_b = endpoints[2].start_request();
        for _ in 0..50 {
            assert_eq!(pick(&endpoints, &[], &ctx()).unwrap().0.id(), 1);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_endpoint_that_stopped_answering_loses_its_share_as_its_silence_grows() {
        let endpoints = fleet(&[1, 1]);
        let now_ms = crate::endpoint::millis(Instant::now());
        for endpoint in &endpoints {
            endpoint.observe_latency(Duration::from_millis(200), now_ms, 10_000);
        }
        let latency_ctx = || PickContext {
            neutral_latency_us: Some(200_000),
            ..PickContext::at(Instant::now())
        };
        // Endpoint 0 holds one attempt that has not answered; endpoint 1 holds two that did.
        let _quiet = endpoints[0].start_request();
        let _waiting = endpoints[0].start_waiting(Instant::now());
        let _answered = [endpoints[1].start_request(), endpoints[1].start_request()];
        assert_eq!(
            pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(),
            0,
            "2 × 200 ms beats 3 × 200 ms while the wait is young"
        );
        tokio::time::advance(Duration::from_millis(700)).await;
        assert_eq!(
            pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(),
            1,
            "700 ms of silence ranks it as a 700 ms endpoint: 2 × 700 ms > 3 × 200 ms"
        );
        let later = crate::endpoint::millis(Instant::now());
        endpoints[0].observe_latency(Duration::from_millis(150), later, 10_000);
        assert_eq!(
            pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(),
            0,
            "an answer ends the silence"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_that_answers_many_at_once_keeps_its_share_until_it_slows() {
        let endpoints = fleet(&[1, 1]);
        let now_ms = crate::endpoint::millis(Instant::now());
        let ms = Duration::from_millis;
        let latency_ctx = || PickContext {
            neutral_latency_us: Some(200_000),
            ..PickContext::at(Instant::now())
        };
        // Endpoint 0 is a batching GPU server: 100 ms whether it holds 1 or 8. Endpoint 1 takes 300 ms.
        for in_flight in 1..=8 {
            endpoints[0].observe_latency(ms(100), now_ms, 10_000);
            endpoints[0].observe_load_latency(ms(100), in_flight, now_ms, 10_000);
        }
        endpoints[1].observe_latency(ms(300), now_ms, 10_000);
        endpoints[1].observe_load_latency(ms(300), 1, now_ms, 10_000);
        // Tried just now (an endpoint idle and untried for the decay time is tried at once).
        drop(endpoints[1].start_waiting(Instant::now()));
        let held: Vec<_> = (0..5).map(|_| endpoints[0].start_request()).collect();
        assert_eq!(
            pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(),
            0,
            "at 6 in flight it still answers in 100 ms: better than an idle 300 ms node \
             (a single-worker model would say 600 ms)"
        );
        // Beyond the loads it was seen at, it is assumed to queue: at 26, 100 ms × 26 ÷ 8 = 325 ms.
        let more: Vec<_> = (0..20).map(|_| endpoints[0].start_request()).collect();
        assert_eq!(pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(), 1);
        drop(more);
        // Seen slowing down at its current load (queueing inside), it loses its share.
        for _ in 0..8 {
            endpoints[0].observe_load_latency(ms(900), 6, now_ms, 10_000);
        }
        assert_eq!(pick(&endpoints, &[], &latency_ctx()).unwrap().0.id(), 1);
        drop(held);
    }

    #[test]
    fn spreads_held_requests_evenly() {
        let endpoints = fleet(&[1, 1, 1, 1]);
        let (counts, _held) = hold(&endpoints, 40);
        assert_eq!(counts, [10, 10, 10, 10]);
    }

    #[test]
    fn concurrent_load_follows_weights() {
        let endpoints = fleet(&[3, 1]);
        let (counts, _held) = hold(&endpoints, 40);
        // (o+1)/w keeps the two within one request of a 3:1 split.
        assert!((29..=31).contains(&counts[0]), "{counts:?}");
    }

    #[test]
    fn ties_are_broken_at_random() {
        let endpoints = fleet(&[1, 1, 1]);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[pick(&endpoints, &[], &ctx()).unwrap().0.id() as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 50), "{seen:?}");
    }

    #[test]
    fn exclusions_and_draining_are_skipped() {
        let endpoints = fleet(&[1, 1, 1]);
        endpoints[1].set_draining(true);
        for _ in 0..50 {
            assert_eq!(pick(&endpoints, &[0], &ctx()).unwrap().0.id(), 2);
        }
        assert!(pick(&endpoints, &[0, 2], &ctx()).is_none());
    }

    #[test]
    fn two_choices_at_scale_avoid_loaded_endpoints() {
        let endpoints = fleet(&vec![1; 1000]);
        // Load every endpoint but the first hundred: a two-choice pick lands on an idle one whenever one of
        // its two samples is idle, so far more often than the 10 % a random pick would.
        let _held: Vec<_> = endpoints[100..].iter().map(|e| e.start_request()).collect();
        let idle_hits = (0..2000)
            .filter(|_| pick(&endpoints, &[], &ctx()).unwrap().0.id() < 100)
            .count();
        assert!(idle_hits > 300, "{idle_hits}");
    }

    #[test]
    fn two_choices_find_the_last_eligible_endpoint() {
        let endpoints = fleet(&vec![1; 500]);
        let exclude: Vec<EndpointId> = (0..499).collect();
        for _ in 0..20 {
            assert_eq!(pick(&endpoints, &exclude, &ctx()).unwrap().0.id(), 499);
        }
    }

    #[test]
    fn unhealthy_suspect_and_cooling_endpoints_are_skipped_and_health_only_in_panic_mode() {
        let endpoints = fleet(&[1, 1, 1, 1]);
        let now = Instant::now();
        endpoints[0].set_healthy(false, now);
        endpoints[1].set_suspect(true);
        endpoints[2].cool_down(std::time::Duration::from_secs(10), now);
        for _ in 0..20 {
            assert_eq!(pick(&endpoints, &[], &ctx()).unwrap().0.id(), 3);
        }
        assert!(pick(&endpoints, &[3], &ctx()).is_none());
        let panic = PickContext {
            ignore_health: true,
            ..ctx()
        };
        let picked = pick(&endpoints, &[2, 3], &panic).unwrap().0.id();
        assert!(picked == 0 || picked == 1, "{picked}");
    }

    #[test]
    fn an_ejected_endpoint_is_skipped_then_offered_as_a_probe() {
        let endpoints = fleet(&[1, 1]);
        let now = Instant::now();
        let settings = crate::breaker::BreakerSettings::default();
        for _ in 0..settings.consecutive_failures {
            endpoints[0].record_failure(&settings, now, true);
        }
        assert!(endpoints[0].is_ejected());
        for _ in 0..20 {
            assert_eq!(pick(&endpoints, &[], &ctx()).unwrap().0.id(), 1);
        }
        // After the ejection time the endpoint is offered once more, as the breaker's probe.
        let later = PickContext::at(now + std::time::Duration::from_secs(10));
        let (endpoint, eligibility) = pick(&endpoints, &[1], &later).unwrap();
        assert_eq!((endpoint.id(), eligibility), (0, Eligibility::Probe));
    }

    #[test]
    fn slow_start_ramps_a_recovered_endpoint() {
        let endpoints = fleet(&[1, 1]);
        let window = 10_000;
        // Look long after creation; endpoints that start together do not ramp anyway.
        let now = Instant::now() + std::time::Duration::from_secs(60);
        endpoints[0].set_healthy(false, now);
        endpoints[0].set_healthy(true, now);
        let ramping = endpoints[0].effective_weight(endpoints[0].millis(now), window);
        let steady = endpoints[1].effective_weight(endpoints[1].millis(now), window);
        assert_eq!((ramping, steady), (100, 1000));
        let halfway = now + std::time::Duration::from_secs(5);
        assert_eq!(
            endpoints[0].effective_weight(endpoints[0].millis(halfway), window),
            550
        );
        // Holding requests open: the ramping endpoint gets about a tenth of them.
        let ctx = PickContext {
            slow_start_ms: window,
            ..PickContext::at(now)
        };
        let mut held = Vec::new();
        let mut on_ramping = 0;
        for _ in 0..22 {
            let (chosen, _) = pick(&endpoints, &[], &ctx).unwrap();
            on_ramping += usize::from(chosen.id() == 0);
            held.push(chosen.start_request());
        }
        assert!((1..=3).contains(&on_ramping), "{on_ramping}");
    }
}

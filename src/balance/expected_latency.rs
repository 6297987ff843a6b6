//! `expected-latency` (the default): an endpoint costs the time to first byte a new request there
//! should expect, over its weight.
//!
//! That is what its answers took when it held as many requests as it would with this one
//! ([`Endpoint::rank_latency_us`](crate::endpoint::Endpoint::rank_latency_us)): a GPU server that
//! answers eight at once in 120 ms keeps its share up to eight, where the single-worker model of
//! linkerd's and Finagle's peak-EWMA cost, `(outstanding + 1) × latency`, would send the fourth request
//! to an idle node four times slower. Loads not yet seen are assumed to queue (that same product), until
//! answers show otherwise. Each request already there also adds an eighth of that, divided by the
//! weight ([`LOAD_SPREAD`]), so nodes about as fast share the load in proportion to their weights. The
//! expected latency is never below the endpoint's silence: how long attempts there have waited with none
//! answered, so a node that stops answering loses its share as its silence grows. An endpoint without an
//! estimate of its own is ranked by the fleet's ([`PickContext::fleet_latency_us`]); one idle and
//! untried lately ranks at 0, so the next request tries it, unless that request is placed by affinity. The requests it
//! holds are tongs' own, or, when its own metrics are fresh and count more (load from other replicas
//! and clients), those (`Sight::load`).

use super::PickContext;
use super::score::{Cost, Scorer, Sight};

/// Each request an endpoint already holds adds `1 ÷ (LOAD_SPREAD × weight)` of its expected latency to
/// its cost, even where its answers show no slowdown yet: nodes about as fast share the load rather than
/// the one measured a little faster taking all of it, a node not picked for a while is tried again
/// (what was learnt of it does not go stale), and weights (slow start's included) set how many requests
/// an endpoint takes for every one another takes. Small against a real difference in speed: a node
/// twice as fast keeps its share up to eight requests ahead.
const LOAD_SPREAD: u64 = 8;

#[derive(Debug, Default)]
pub struct ExpectedLatency;

impl Scorer for ExpectedLatency {
    fn name(&self) -> &'static str {
        "expected-latency"
    }

    /// expected × (SPREAD × w + o) ÷ (SPREAD × w), with the weight in thousandths.
    fn cost(&self, sight: &Sight<'_>, ctx: &PickContext<'_>) -> Cost {
        let mut expected = sight.endpoint.latency().rank_us(
            sight.now_ms,
            sight.load,
            ctx.fleet_latency_us,
            ctx.latency_decay_ms,
        );
        // An idle endpoint nobody tried lately ranks at 0 so the next request finds out what it is
        // like; a request placed by affinity does not explore: such a node counts as the fleet's
        // average, and the request's home or cache decides.
        if expected == 0 && ctx.affinity.is_some() {
            expected = ctx.fleet_latency_us.max(1);
        }
        let share = LOAD_SPREAD.saturating_mul(sight.weight);
        Cost::ratio(
            u128::from(expected)
                * u128::from(share.saturating_add(sight.load.saturating_mul(1000))),
            share,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::cmp::Ordering;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;
    use crate::balance::tests::endpoint;
    use crate::endpoint::millis;

    fn cost(endpoint: &crate::endpoint::Endpoint, outstanding: u64, weight: u64) -> Cost {
        let now = Instant::now();
        let sight = Sight {
            endpoint,
            now_ms: millis(now),
            weight,
            outstanding,
            engine: None,
            load: outstanding,
        };
        let ctx = PickContext {
            fleet_latency_us: 200_000,
            ..PickContext::at(now)
        };
        ExpectedLatency.cost(&sight, &ctx)
    }

    #[tokio::test(start_paused = true)]
    async fn a_faster_node_costs_less_and_weight_discounts_the_requests_held() {
        let now_ms = millis(Instant::now());
        let (fast, slow) = (endpoint(1), endpoint(2));
        fast.latency().observe(Duration::from_millis(100), now_ms, 10_000);
        fast.latency().observe_at_load(Duration::from_millis(100), 1, now_ms, 10_000);
        slow.latency().observe(Duration::from_millis(200), now_ms, 10_000);
        slow.latency().observe_at_load(Duration::from_millis(200), 1, now_ms, 10_000);
        drop(fast.latency().start_waiting(Instant::now()));
        drop(slow.latency().start_waiting(Instant::now()));
        // Idle, the node seen answering in 100 ms costs less than the one seen at 200 ms.
        assert_eq!(
            cost(&fast, 0, 1000).cmp_exact(cost(&slow, 0, 1000)),
            Ordering::Less
        );
        // A heavier weight makes each request held count for less.
        assert_eq!(
            cost(&slow, 4, 2000).cmp_exact(cost(&slow, 4, 1000)),
            Ordering::Less
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_endpoint_idle_and_untried_for_a_while_costs_nothing() {
        let idle = endpoint(1);
        assert_eq!(cost(&idle, 0, 1000).numerator, 0);
    }
}

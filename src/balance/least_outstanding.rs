//! `least-outstanding`: an endpoint costs its outstanding requests plus this one, over its weight. Its
//! outstanding requests are tongs' own, or, when its own metrics are fresh and count more (load from
//! other replicas and clients), those (`Sight::load`).
//!
//! Comparing `o + 1` rather than `o` makes weights matter even when every endpoint is idle, and spreads
//! concurrent load in proportion to weight (weight 3 takes three requests for every one a weight-1
//! endpoint takes).

use super::PickContext;
use super::score::{Cost, Scorer, Sight};

#[derive(Debug, Default)]
pub struct LeastOutstanding;

impl Scorer for LeastOutstanding {
    fn name(&self) -> &'static str {
        "least-outstanding"
    }

    fn cost(&self, sight: &Sight<'_>, _ctx: &PickContext<'_>) -> Cost {
        Cost::ratio(
            u128::from(sight.load.saturating_add(1)),
            sight.weight,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::cmp::Ordering;

    use super::*;
    use crate::balance::tests::endpoint;

    fn cost(outstanding: u64, weight: u64) -> Cost {
        let endpoint = endpoint(1);
        let sight = Sight {
            endpoint: &endpoint,
            now_ms: 0,
            weight,
            outstanding,
            engine: None,
            load: outstanding,
        };
        LeastOutstanding.cost(&sight, &PickContext::at(tokio::time::Instant::now()))
    }

    #[test]
    fn an_endpoint_costs_its_requests_and_this_one_over_its_weight() {
        assert_eq!(cost(0, 1000).cmp_exact(cost(1, 1000)), Ordering::Less);
        // Weight 3 holding 2 (3 ÷ 3) ties weight 1 idle (1 ÷ 1).
        assert_eq!(cost(2, 3000).cmp_exact(cost(0, 1000)), Ordering::Equal);
        // Idle endpoints still differ by weight.
        assert_eq!(cost(0, 2000).cmp_exact(cost(0, 1000)), Ordering::Less);
    }
}

//! `queue`: a node costs more for each request waiting in its own queue, by its own metrics and tongs'
//! estimate since (see `endpoint::signals`): the factor is `1 + waiting ÷ batch`, the rounds of its
//! batch a new request would wait out before it runs. A node without fresh signals costs 1.

use super::PickContext;
use super::score::{Cost, FACTOR_ONE, Reads, Scorer, Sight};

#[derive(Debug, Default)]
pub struct Queue;

impl Scorer for Queue {
    fn name(&self) -> &'static str {
        "queue"
    }

    fn reads(&self) -> Reads {
        Reads::Signals
    }

    #[inline]
    fn cost(&self, sight: &Sight<'_>, _ctx: &PickContext<'_>) -> Cost {
        let Some(now) = sight.engine else {
            return Cost::ONE;
        };
        let batch = now.batch.max(now.in_node - now.waiting).max(1);
        Cost::ratio(
            u128::from(batch + now.waiting) * u128::from(FACTOR_ONE),
            batch.saturating_mul(FACTOR_ONE),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::tests::{endpoint, sight_of};
    use crate::endpoint::EngineNow;

    #[test]
    fn each_batch_of_waiting_requests_adds_one_to_the_factor() {
        let endpoint = endpoint(1);
        let ctx = PickContext::at(tokio::time::Instant::now());
        let mut sight = sight_of(&endpoint, 0);
        assert_eq!(Queue.cost(&sight, &ctx), Cost::ONE, "no signals: neutral");
        sight.engine = Some(EngineNow {
            in_node: 24,
            waiting: 16,
            batch: 8,
            cache: None,
            age_ms: 0,
        });
        assert_eq!(Queue.cost(&sight, &ctx).as_f64(), 3.0);
        sight.engine = Some(EngineNow {
            in_node: 3,
            waiting: 0,
            batch: 0,
            cache: None,
            age_ms: 0,
        });
        assert_eq!(Queue.cost(&sight, &ctx).as_f64(), 1.0);
    }
}

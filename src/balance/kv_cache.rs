//! `kv-cache`: a node costs more the fuller its KV cache, by its own metrics: the factor is `1 + use`
//! (a full cache doubles its cost), as a fuller cache means more preemption and less room for a new
//! prompt. A node without fresh signals, or whose engine does not say, costs 1.

use super::PickContext;
use super::score::{Cost, FACTOR_ONE, Reads, Scorer, Sight};

#[derive(Debug, Default)]
pub struct KvCache;

impl Scorer for KvCache {
    fn name(&self) -> &'static str {
        "kv-cache"
    }

    fn reads(&self) -> Reads {
        Reads::Signals
    }

    #[inline]
    fn cost(&self, sight: &Sight<'_>, _ctx: &PickContext<'_>) -> Cost {
        match sight.engine.and_then(|now| now.cache) {
            None => Cost::ONE,
            Some(used) => Cost::ratio(
                u128::from(FACTOR_ONE) + (used.clamp(0.0, 1.0) * FACTOR_ONE as f64) as u128,
                FACTOR_ONE,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::tests::{endpoint, sight_of};
    use crate::endpoint::EngineNow;

    #[test]
    fn a_full_cache_doubles_the_cost() {
        let endpoint = endpoint(1);
        let ctx = PickContext::at(tokio::time::Instant::now());
        let mut sight = sight_of(&endpoint, 0);
        assert_eq!(KvCache.cost(&sight, &ctx), Cost::ONE);
        let engine = |cache| EngineNow {
            in_node: 1,
            waiting: 0,
            batch: 0,
            cache,
            age_ms: 0,
        };
        sight.engine = Some(engine(None));
        assert_eq!(KvCache.cost(&sight, &ctx), Cost::ONE);
        sight.engine = Some(engine(Some(1.0)));
        assert_eq!(KvCache.cost(&sight, &ctx).as_f64(), 2.0);
        sight.engine = Some(engine(Some(0.25)));
        assert_eq!(KvCache.cost(&sight, &ctx).as_f64(), 1.25);
    }
}

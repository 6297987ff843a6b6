//! Saturation (`signals.saturation`): a node whose own queue, or KV cache, is past its threshold by its
//! own metrics takes no new request while another node has room. When every node is saturated the pick
//! finds none and the request waits in tongs' queue, where priorities and tenants' turns order it,
//! rather than in a node's queue that nobody can reorder. A node without fresh signals is never
//! saturated: a stale reading must not take a node out.

use crate::config;
use crate::endpoint::EngineNow;

use super::PickContext;
use super::score::{Filter, Sight};

/// The thresholds, as the pick applies them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Saturation {
    /// Requests waiting in the node's queue (0: not tested).
    pub waiting: u64,
    /// Share of its KV cache in use (1 or more: not tested).
    pub cache: f64,
}

impl Saturation {
    pub fn from_config(config: &config::Saturation) -> Saturation {
        Saturation {
            waiting: u64::from(config.waiting),
            cache: config.kv_cache,
        }
    }

    /// Whether a node with this load is past a threshold.
    #[inline]
    pub fn holds(&self, now: &EngineNow) -> bool {
        (self.waiting > 0 && now.waiting >= self.waiting)
            || (self.cache < 1.0 && now.cache.is_some_and(|used| used >= self.cache))
    }
}

/// The pipeline's filter: only unsaturated nodes (or those without fresh signals).
#[derive(Debug)]
pub struct Unsaturated(pub Saturation);

impl Filter for Unsaturated {
    fn name(&self) -> &'static str {
        "unsaturated"
    }

    #[inline]
    fn admits(&self, sight: &Sight<'_>, _ctx: &PickContext<'_>) -> bool {
        !sight.engine.is_some_and(|now| self.0.holds(&now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now(waiting: u64, cache: Option<f64>) -> EngineNow {
        EngineNow {
            in_node: waiting + 8,
            waiting,
            batch: 8,
            cache,
            age_ms: 0,
        }
    }

    #[test]
    fn a_node_is_saturated_past_either_threshold_and_a_zero_turns_one_off() {
        let both = Saturation {
            waiting: 5,
            cache: 0.9,
        };
        assert!(!both.holds(&now(4, Some(0.89))));
        assert!(both.holds(&now(5, None)));
        assert!(both.holds(&now(0, Some(0.9))));
        let cache_only = Saturation {
            waiting: 0,
            cache: 0.9,
        };
        assert!(!cache_only.holds(&now(500, None)));
        let waiting_only = Saturation {
            waiting: 5,
            cache: 1.0,
        };
        assert!(!waiting_only.holds(&now(0, Some(1.0))));
    }
}

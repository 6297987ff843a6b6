//! `prefix`: a node costs less the more of the request's prompt it is likely to hold in its prefix
//! cache: the factor is `2^−share`, so with weight `w` a node holding the whole prompt is preferred
//! until it is `2^w` times as loaded as the best other (load wins over affinity when the fleet is that
//! imbalanced, and saturation filters a full node out first).
//!
//! The share is the larger of what the pool's prefix index says this tongs sent the node (see
//! [`affinity`](super::affinity)) and, for the conversation's home (its rendezvous choice, which every
//! replica computes alike), [`HOME_SHARE`]: a replica that never saw the conversation still sends it
//! where the others do, and a node that really holds more of the prompt still wins over the home.

use super::PickContext;
use super::score::{Cost, FACTOR_ONE, Reads, Scorer, Sight};

/// The share the conversation's home is credited with.
pub const HOME_SHARE: f64 = 0.9;

#[derive(Debug, Default)]
pub struct Prefix;

impl Scorer for Prefix {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn reads(&self) -> Reads {
        Reads::Affinity
    }

    #[inline]
    fn cost(&self, sight: &Sight<'_>, ctx: &PickContext<'_>) -> Cost {
        let Some(affinity) = ctx.affinity else {
            return Cost::ONE;
        };
        let mut share = affinity.matches.share(sight.endpoint);
        if affinity.conversation_home == Some(sight.endpoint.id()) {
            share = share.max(HOME_SHARE);
        }
        if share <= 0.0 {
            return Cost::ONE;
        }
        Cost::ratio(
            ((-share).exp2() * FACTOR_ONE as f64) as u128,
            FACTOR_ONE,
        )
    }
}

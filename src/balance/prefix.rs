//! `prefix`: a node costs less the more of the request's prompt it is likely to hold in its prefix
//! cache: the factor is `2^−share`, so with weight `w` a node holding the whole prompt is preferred
//! until it is `2^w` times as loaded as the best other (load wins over affinity when the fleet is that
//! imbalanced, and saturation filters a full node out first).
//!
//! The conversation's home (its rendezvous choice, which every replica computes alike) is credited
//! with the whole prompt: a replica that never saw the conversation sends it where the others do.
//! Another node is credited with what the pool's prefix index says this tongs sent it (see
//! [`affinity`](super::affinity)), when that reaches past the prompt's opening (the part other
//! conversations share, such as a system prompt): after a move, the node the conversation moved to; a
//! prompt without a conversation key, wherever its prefix went.

use super::PickContext;
use super::score::{Cost, FACTOR_ONE, Reads, Scorer, Sight};

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
        let share = if affinity.conversation_home == Some(sight.endpoint.id()) {
            1.0
        } else {
            // Elsewhere, only a match past the opening is this conversation's: the opening (a system
            // prompt) may be on many nodes, and crediting it would let each replica's own history
            // pull the conversation away from the home they agree on.
            let share = affinity.matches.share(sight.endpoint);
            if share <= affinity.opening_share {
                0.0
            } else {
                share
            }
        };
        if share <= 0.0 {
            return Cost::ONE;
        }
        Cost::ratio(
            ((-share).exp2() * FACTOR_ONE as f64) as u128,
            FACTOR_ONE,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::affinity::{Affinity, PrefixIndex};
    use crate::balance::tests::{endpoint, sight_of};

    #[test]
    fn the_home_counts_whole_and_others_only_past_the_opening() {
        let (home, holder, other) = (endpoint(1), endpoint(2), endpoint(3));
        let index = PrefixIndex::new(100);
        // `holder` was sent the opening (blocks 1 and 2, a system prompt) and `other` the whole prompt.
        index.record(&[1, 2], &holder);
        index.record(&[1, 2, 3, 4], &other);
        let affinity = Affinity {
            matches: index.matches(&[1, 2, 3, 4]),
            opening_share: 0.5,
            conversation_home: Some(home.id()),
            ..Affinity::default()
        };
        let ctx = PickContext {
            affinity: Some(&affinity),
            ..PickContext::at(tokio::time::Instant::now())
        };
        let cost = |e| Prefix.cost(&sight_of(e, 0), &ctx).as_f64();
        assert_eq!(cost(&home), 0.5, "2^-1: the whole prompt");
        assert_eq!(cost(&holder), 1.0, "the opening alone is not this conversation");
        assert_eq!(cost(&other), 0.5);
        // No affinity worked out: every endpoint alike.
        let plain = PickContext::at(tokio::time::Instant::now());
        assert_eq!(Prefix.cost(&sight_of(&home, 0), &plain), Cost::ONE);
    }
}

//! `session`: the session's home (the rendezvous choice for the session key among the nodes that may
//! take the request, see [`affinity`](super::affinity)) costs half: with weight `w`, a session stays on
//! its node until that node is `2^w` times as loaded as the best other, is saturated, or goes. Every
//! replica computes the same home, so a session's requests meet on one node whichever replica they
//! reach.

use super::PickContext;
use super::score::{Cost, Reads, Scorer, Sight};

#[derive(Debug, Default)]
pub struct Session;

impl Scorer for Session {
    fn name(&self) -> &'static str {
        "session"
    }

    fn reads(&self) -> Reads {
        Reads::Affinity
    }

    #[inline]
    fn cost(&self, sight: &Sight<'_>, ctx: &PickContext<'_>) -> Cost {
        match ctx.affinity {
            Some(affinity) if affinity.session_home == Some(sight.endpoint.id()) => {
                Cost::ratio(1, 2)
            }
            _ => Cost::ONE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::affinity::Affinity;
    use crate::balance::tests::{endpoint, sight_of};

    #[test]
    fn the_sessions_home_costs_half_and_the_others_one() {
        let (home, other) = (endpoint(1), endpoint(2));
        let affinity = Affinity {
            session_home: Some(home.id()),
            ..Affinity::default()
        };
        let ctx = PickContext {
            affinity: Some(&affinity),
            ..PickContext::at(tokio::time::Instant::now())
        };
        assert_eq!(Session.cost(&sight_of(&home, 0), &ctx).as_f64(), 0.5);
        assert_eq!(Session.cost(&sight_of(&other, 0), &ctx), Cost::ONE);
    }
}

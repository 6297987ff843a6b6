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

//! A standing queue, told apart from a burst: the control that keeps waits short under sustained
//! overload (CoDel's idea, applied at arrival).
//!
//! A burst fills the queue and the fleet drains it; sustained overload fills it and it never drains,
//! so every wait beyond the fleet's pace is pure delay: no client is helped by an answer half a minute
//! late. The signal is the wait each arrival is expected to have (requests ahead of it over the rate the
//! queue hands requests to endpoints). Once every arrival for `overload_after` on end expected to
//! wait longer than `target_wait`, and the fleet itself has lately said it is full (a node refused a
//! request while serving others, its own metrics showed it saturated, its learned limit found its
//! capacity, or the limits are capacities someone told tongs) with every endpoint up, the queue is
//! *standing*:
//! from then until it next empties or the fleet stops saying so, an arrival expected to wait longer
//! than the target is refused at once (with a `Retry-After` from the drain rate) instead of joining.
//! A queue that grows because tongs holds the fleet back (a limit still learning, nodes coming back
//! from an interruption) or because a node is down is not overload: an interruption passes, and its
//! requests wait for it, up to `max_wait`; and the time the queue stood above the target meanwhile
//! does not count once the fleet is whole again, for the backlog it left drains at the whole fleet's
//! pace (a node of a third of the fleet ejected for 5 s left a queue that, counted, had the first
//! arrivals after its return refused at half load). Those already waiting keep their place: refusing
//! them now would only make their refusal late.
//!
//! Pure: the time and the expected wait come in.

use std::time::Duration;

use tokio::time::Instant;

/// The control's settings (from `queue.target_wait` and `queue.overload_after`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The wait kept to under sustained overload; zero turns the control off.
    pub wait: Duration,
    /// How long expected waits must stay above `wait` before the queue counts as standing.
    pub after: Duration,
}

/// What an arrival may expect of the queue (see [`super::Queue::outlook`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outlook {
    /// Its wait at the rate the queue drains; `None` without a basis for a guess.
    pub expected: Option<Duration>,
    /// The queue stands above `target_wait` and this arrival would wait longer: refuse it now.
    pub overloaded: bool,
}

/// What the fleet says of itself as a request arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fleet {
    /// An endpoint is down, ejected or stalled: an interruption, which passes. Its requests wait for
    /// it, and the queue's time above the target starts over once the fleet is whole.
    Short,
    /// Every endpoint up, and none has said lately that it is full: a queue that grows is tongs
    /// holding the fleet back (a limit still learning), not overload.
    Whole,
    /// Every endpoint up, and the fleet has said it is full (a node refused while busy, its own
    /// metrics showed it saturated, its learned limit found its capacity, or the limits are
    /// capacities someone told tongs).
    Full,
}

/// Whether the queue stands, and since when arrivals expected to wait past the target.
#[derive(Debug, Default)]
pub(super) struct Standing {
    /// Since when every arrival expected to wait longer than the target (`None`: the last one did not).
    above_since: Option<Instant>,
    /// The queue stands: arrivals expected past the target are refused until it empties.
    standing: bool,
}

impl Standing {
    /// An arrival at `now` expects to wait `expected` (`None`: the queue has not drained lately, no
    /// basis for a guess). Whether it is refused for the standing queue.
    pub(super) fn arrival(
        &mut self,
        now: Instant,
        expected: Option<Duration>,
        target: Target,
        fleet: Fleet,
    ) -> bool {
        if target.wait.is_zero() || fleet == Fleet::Short {
            *self = Standing::default();
            return false;
        }
        let fleet_full = fleet == Fleet::Full;
        if !fleet_full {
            self.standing = false;
        }
        let Some(expected) = expected.filter(|&wait| wait > target.wait) else {
            if !self.standing {
                self.above_since = None;
            }
            return false;
        };
        let since = *self.above_since.get_or_insert(now);
        if fleet_full && now.saturating_duration_since(since) >= target.after {
            self.standing = true;
        }
        self.standing && expected > target.wait
    }

    /// The queue emptied: whatever stood has drained.
    pub(super) fn emptied(&mut self) {
        *self = Standing::default();
    }

    pub(super) fn is_standing(&self) -> bool {
        self.standing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TARGET: Target = Target {
        wait: Duration::from_millis(500),
        after: Duration::from_millis(500),
    };

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_short_excursion_past_the_target_is_a_burst() {
        let start = Instant::now();
        let mut standing = Standing::default();
        assert!(!standing.arrival(start, Some(ms(900)), TARGET, Fleet::Full));
        assert!(!standing.arrival(start + ms(400), Some(ms(1200)), TARGET, Fleet::Full));
        // One arrival under the target: the clock starts over.
        assert!(!standing.arrival(start + ms(450), Some(ms(300)), TARGET, Fleet::Full));
        assert!(!standing.arrival(start + ms(600), Some(ms(900)), TARGET, Fleet::Full));
        assert!(!standing.arrival(start + ms(1000), Some(ms(900)), TARGET, Fleet::Full));
        assert!(!standing.is_standing());
    }

    #[test]
    fn waits_past_the_target_for_overload_after_make_it_stand_until_it_empties() {
        let start = Instant::now();
        let mut standing = Standing::default();
        assert!(!standing.arrival(start, Some(ms(600)), TARGET, Fleet::Full));
        assert!(standing.arrival(start + ms(500), Some(ms(800)), TARGET, Fleet::Full));
        // Standing: an arrival within the target joins, and the queue still stands.
        assert!(!standing.arrival(start + ms(510), Some(ms(400)), TARGET, Fleet::Full));
        assert!(standing.arrival(start + ms(520), Some(ms(501)), TARGET, Fleet::Full));
        // Not yet draining at a known pace: no basis to refuse on.
        assert!(!standing.arrival(start + ms(530), None, TARGET, Fleet::Full));
        standing.emptied();
        assert!(!standing.arrival(start + ms(600), Some(ms(5000)), TARGET, Fleet::Full));
    }

    #[test]
    fn a_fleet_that_has_not_said_it_is_full_is_not_overloaded() {
        let start = Instant::now();
        let mut standing = Standing::default();
        for step in 0..20 {
            assert!(!standing.arrival(
                start + ms(step * 100),
                Some(ms(5000)),
                TARGET,
                Fleet::Whole
            ));
        }
        // Once it says so, the time above the target already counts.
        assert!(standing.arrival(start + ms(2000), Some(ms(5000)), TARGET, Fleet::Full));
        // And when it stops saying so, arrivals wait again.
        assert!(!standing.arrival(start + ms(2100), Some(ms(5000)), TARGET, Fleet::Whole));
    }

    /// A fleet short of a node queues; back whole, the backlog it left is not overload until the
    /// queue has stood above the target for `overload_after` with the fleet whole.
    #[test]
    fn the_time_a_fleet_was_short_of_a_node_does_not_count() {
        let start = Instant::now();
        let mut standing = Standing::default();
        assert!(!standing.arrival(start, Some(ms(900)), TARGET, Fleet::Full));
        for step in 1..=20 {
            let at = start + ms(step * 100);
            assert!(!standing.arrival(at, Some(ms(3000)), TARGET, Fleet::Short));
        }
        // Whole again: the clock starts now.
        assert!(!standing.arrival(start + ms(2100), Some(ms(3000)), TARGET, Fleet::Full));
        assert!(!standing.arrival(start + ms(2500), Some(ms(2000)), TARGET, Fleet::Full));
        assert!(standing.arrival(start + ms(2600), Some(ms(1000)), TARGET, Fleet::Full));
        // Short again while it stood: it stands no more.
        assert!(!standing.arrival(start + ms(2700), Some(ms(1000)), TARGET, Fleet::Short));
        assert!(!standing.is_standing());
    }

    #[test]
    fn a_zero_target_turns_the_control_off() {
        let start = Instant::now();
        let off = Target {
            wait: Duration::ZERO,
            after: Duration::ZERO,
        };
        let mut standing = Standing::default();
        for step in 0..10 {
            assert!(!standing.arrival(start + ms(step * 100), Some(ms(60_000)), off, Fleet::Full));
        }
    }
}

//! `unlined` (always in the pipeline): a node whose requests would wait in its own line takes no new
//! request while another has room.
//!
//! A GPU server past its batch keeps the rest in its own line, where nobody can reorder them and a slot
//! freed on another node cannot reach them; tongs rarely knows the batch. But the node shows it: what
//! its streams' first bytes took by the load they started at (`LatencyModel::observe_stream_start`, by
//! powers of two). A stream's first byte is its wait for a slot and its prompt; a whole answer's is its
//! whole generation, and a long generation is no line, so whole answers count for nothing here. When
//! the streams that started at a load waited more than [`LINE_FACTOR`] times the node's quickest first
//! byte (and over [`LINE_MIN_MS`]), they waited for a slot: the node is full at that load and above,
//! and the request goes elsewhere. When every node is, it waits in tongs' queue, in order, for the
//! first slot anywhere (the queue looks again as slots free, as loads open, and every
//! `admission::HEAD_RECHECK`): the late binding a told capacity gives, without the number.
//!
//! What a node took at a load stands for `endpoint::LOAD_FRESH_MS` without another stream there; a
//! load's first stream lately stands alone only for as long as its first byte took (`AtLoad::held`),
//! so one first byte late for reasons of its own (a delayed ACK, a hiccup on the path) keeps the node
//! from that load no longer than it was late, and the next one there says whether it was a line. A
//! node kept from a load answers nothing there; once what stood is over, and at a load it has not been
//! seen at, one request finds out whether there is room (the first at that load; after one late
//! first byte there, any while no attempt on the node waits for a first byte, since streams that run
//! may hold it above that load's first), and the rest wait for its first byte, which wakes them. That
//! is slow start, level by level, at the pace of a stream's first byte; a node whose quickest first
//! byte takes longer than [`PROBE_WITHIN_MS`] is tried at loads not seen, as a node nothing is known
//! of. Left alone: a node with nothing in flight, a node that has streamed nothing (since it was last
//! idle), a node with a limit (told, or learned when asked), and a node that serves its own metrics,
//! judged by them (`saturation`), since a continuous-batching server's first token slows as its batch
//! grows without any line.
//!
//! In the stalls scenario (a gray node takes 54 % of the fleet's capacity out for 6 s), the defaults'
//! p99 is 1.09× the told capacities' on average over nine runs (1.03–1.18× run by run), from
//! 1.24–1.38× without the filter (`benches/RESULTS.md`, "Late binding: a load's first stream taken
//! whole").

use super::PickContext;
use super::score::{Filter, Sight};
use crate::endpoint::{bucket_floor, load_bucket};

/// How many times its quickest first byte an attempt may wait before the node counts as lined.
pub const LINE_FACTOR: u64 = 3;
/// The least wait that counts as a line (ms): a first byte is never that exact (a delayed ACK alone
/// is 40 ms), and a request held in tongs' queue for a line shorter than this loses more than it
/// gains.
pub const LINE_MIN_MS: u64 = 50;
/// Loads not seen are probed one request at a time only on a node whose quickest first byte comes
/// within this (ms): a fresh node then opens to 17 at once in five first bytes, half a second at most.
pub const PROBE_WITHIN_MS: u64 = 100;

/// The pipeline's filter: only nodes without a line.
#[derive(Debug)]
pub struct Unlined;

impl Filter for Unlined {
    fn name(&self) -> &'static str {
        "unlined"
    }

    #[inline]
    fn admits(&self, sight: &Sight<'_>, _ctx: &PickContext<'_>) -> bool {
        // A node's own metrics say when it is full (`saturation`), and a continuous-batching server's
        // first token slows as its batch grows without any line forming. A node with nothing in
        // flight has no line of ours to wait in, and one with a limit (told, or learned when asked)
        // is held to that.
        if sight.engine.is_some()
            || sight.outstanding == 0
            || sight.endpoint.load().limit().is_some()
        {
            return true;
        }
        let latency = sight.endpoint.latency();
        let quickest = latency.quickest_us(sight.now_ms);
        if quickest == 0 {
            return true;
        }
        let line = (quickest * LINE_FACTOR).max(LINE_MIN_MS * 1000);
        // Loads never seen are probed only where a first byte says quickly whether they are free.
        let probe_unseen = quickest <= PROBE_WITHIN_MS * 1000;
        let load = sight.outstanding + 1;
        let bucket = load_bucket(load);
        // A line at one load is a line at every load above it, seen there or not. A load of one is
        // never a line of ours: slow there is the node's speed (or a cold connection).
        for below in 1..=bucket {
            let (probe, alone) = match latency.at_bucket(below, sight.now_ms) {
                Some(seen) if seen.us > line => (!seen.held, seen.alone),
                None if probe_unseen => (true, false),
                _ => continue,
            };
            // A line that no longer stands, or a load not seen: one request finds out whether there
            // is room, and the rest wait for its first byte. The first at that load is one. After
            // one late first byte there, not yet confirmed, so is any while no attempt here waits
            // for a first byte: the streams that run hold the node above that load's first, and
            // until one of them ended, nobody would try it. A line confirmed waits for that: it
            // was one, and the node's load falling says a slot came free.
            return probe
                && below == bucket
                && (load == bucket_floor(bucket) || alone && latency.waiting_attempts() == 0);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;
    use crate::balance::tests::endpoint;
    use crate::endpoint::{Endpoint, LOAD_FRESH_MS};

    /// Some millisecond on the model's clock, the tests' "now" (the model takes its time passed in).
    const NOW: u64 = 1_000_000;

    fn admits(endpoint: &Endpoint, outstanding: u64, now_ms: u64) -> bool {
        let sight = Sight {
            endpoint,
            now_ms,
            weight: 1000,
            outstanding,
            engine: None,
            load: outstanding,
        };
        Unlined.admits(&sight, &PickContext::at(Instant::now()))
    }

    /// A stream's first byte `ms` after its start at `load`, recorded as an attempt records it.
    fn answer(node: &Endpoint, ms: u64, load: u64, now_ms: u64) {
        let took = Duration::from_millis(ms);
        node.latency().observe_at_load(took, load, now_ms, 10_000);
        node.latency().observe_stream_start(took, load, now_ms);
        node.latency().observe(took, now_ms, 10_000);
    }

    /// A whole answer's first byte `ms` after its start at `load`: not a stream's.
    fn whole_answer(node: &Endpoint, ms: u64, load: u64, now_ms: u64) {
        let took = Duration::from_millis(ms);
        node.latency().observe_at_load(took, load, now_ms, 10_000);
        node.latency().observe(took, now_ms, 10_000);
    }

    /// A whole answer's first byte is its whole generation: a long one is no line.
    #[test]
    fn whole_answers_however_long_make_no_line() {
        let node = endpoint(1);
        whole_answer(&node, 15, 1, NOW);
        for _ in 0..10 {
            whole_answer(&node, 3_000, 3, NOW);
        }
        assert!(admits(&node, 2, NOW) && admits(&node, 30, NOW));
        // A stream's first byte that long is one.
        answer(&node, 15, 1, NOW);
        answer(&node, 3_000, 3, NOW);
        assert!(!admits(&node, 2, NOW) && admits(&node, 1, NOW));
    }

    /// A batch of 4: quick first bytes up to 4, a line past it (5 to 8 share a bucket) that two
    /// streams met.
    fn batch_of_four(node: &Endpoint, now_ms: u64) {
        answer(node, 15, 1, now_ms);
        answer(node, 16, 2, now_ms);
        answer(node, 15, 4, now_ms);
        answer(node, 400, 6, now_ms);
        answer(node, 400, 5, now_ms);
    }

    #[test]
    fn a_node_takes_no_request_at_a_load_whose_answers_waited_for_a_slot() {
        let node = endpoint(1);
        // Nothing seen: every load is tried.
        assert!(admits(&node, 0, NOW) && admits(&node, 20, NOW));
        batch_of_four(&node, NOW);
        assert!(admits(&node, 3, NOW), "the fourth request finds a slot");
        assert!(
            !admits(&node, 4, NOW),
            "a fifth would wait in the node's line"
        );
        assert!(!admits(&node, 7, NOW));
        assert!(
            !admits(&node, 8, NOW) && !admits(&node, 30, NOW),
            "a line at 5 to 8 is a line beyond, unseen as it is"
        );
        // Slower, but within three times the quickest: no line (once the load's mean says so).
        for _ in 0..20 {
            answer(&node, 40, 6, NOW);
        }
        assert!(
            admits(&node, 4, NOW),
            "{:?}",
            node.latency().at_bucket(3, NOW)
        );
    }

    #[test]
    fn a_quick_node_is_not_lined_by_a_few_milliseconds() {
        let node = endpoint(1);
        answer(&node, 1, 1, NOW);
        answer(&node, 1, 2, NOW);
        answer(&node, 12, 3, NOW);
        // 12 ms is 12 times the quickest, but under the least wait that counts as a line.
        assert!(admits(&node, 2, NOW));
    }

    #[test]
    fn a_slow_answer_alone_on_a_node_is_its_speed_not_a_line() {
        let node = endpoint(1);
        // Slow at a load of one (a cold connection), quick at two.
        answer(&node, 15, 2, NOW);
        answer(&node, 900, 1, NOW);
        assert!(admits(&node, 0, NOW) && admits(&node, 1, NOW) && admits(&node, 2, NOW));
        // Lined at 3–4: still the place for a request when it holds none.
        answer(&node, 900, 3, NOW);
        assert!(admits(&node, 0, NOW) && admits(&node, 1, NOW) && !admits(&node, 2, NOW));
    }

    /// A node busy past its batch for longer than `LOAD_FRESH_MS` answers at no low load: its quick
    /// answers there, however old, still say what a free slot takes, and the line stays a line.
    #[test]
    fn a_node_busy_past_its_batch_for_a_while_stays_lined() {
        let node = endpoint(1);
        batch_of_four(&node, NOW);
        let later = NOW + 3 * LOAD_FRESH_MS;
        // Only the loads of a full node answered lately: 3–4 quick, 5–8 waited.
        answer(&node, 15, 4, later);
        answer(&node, 400, 6, later);
        assert!(!admits(&node, 4, later) && admits(&node, 3, later));
        // Even when only the line answered lately.
        let later = later + LOAD_FRESH_MS;
        answer(&node, 400, 6, later);
        assert!(!admits(&node, 4, later));
    }

    /// One first byte late for reasons of its own (a delayed ACK, a hiccup on the path) keeps a node
    /// from a load for no longer than it was late; the next one there says whether it was a line.
    #[test]
    fn one_late_first_byte_keeps_a_node_from_a_load_only_as_long_as_it_was_late() {
        let spike = |node: &Endpoint| {
            answer(node, 15, 1, NOW);
            answer(node, 16, 2, NOW);
            answer(node, 120, 3, NOW);
            assert!(!admits(node, 2, NOW) && !admits(node, 3, NOW + 119));
            assert!(admits(node, 1, NOW), "below it, the node takes requests");
            // Then the first request at that load finds out; the rest wait for its first byte.
            assert!(admits(node, 2, NOW + 120));
            let probing = node.latency().start_waiting(Instant::now());
            assert!(!admits(node, 3, NOW + 120));
            drop(probing);
        };
        // It was no line: a quick first byte there, and the load is open.
        let node = endpoint(1);
        spike(&node);
        answer(&node, 16, 3, NOW + 130);
        assert!(admits(&node, 3, NOW + 130) && admits(&node, 2, NOW + 130));
        // It was one: the next waited too, and the two stand the whole window.
        let node = endpoint(2);
        spike(&node);
        answer(&node, 110, 3, NOW + 130);
        let last = NOW + 130 + LOAD_FRESH_MS - 1;
        assert!(!admits(&node, 2, last) && admits(&node, 1, last));
        assert!(admits(&node, 2, last + 1), "then tried again");
    }

    /// Streams that run hold a node above the first of the load it was late at: one late first byte
    /// there, once it no longer stands, is tried again by the next request, whatever the load, while
    /// no attempt on the node waits for a first byte (one at a time: the rest wait for its first
    /// byte).
    #[test]
    fn a_load_is_tried_again_above_its_first_while_its_streams_run() {
        let node = endpoint(1);
        for load in [1, 2, 3, 5, 9] {
            answer(&node, 15, load, NOW);
        }
        // The first at 17 waited 120 ms; it and the 16 before it stream on.
        answer(&node, 120, 17, NOW);
        assert!(!admits(&node, 17, NOW + 119) && admits(&node, 15, NOW + 119));
        let probing = node.latency().start_waiting(Instant::now());
        assert!(
            !admits(&node, 17, NOW + 120),
            "not while another's first byte is awaited here"
        );
        drop(probing);
        assert!(admits(&node, 17, NOW + 120), "the 18th finds out");
        // It was no line: the load is open to all.
        answer(&node, 16, 18, NOW + 130);
        assert!(admits(&node, 18, NOW + 130) && admits(&node, 40, NOW + 130));
        // A line confirmed (a second stream waited too) is tried again only by the first at that
        // load, once the node's load fell below it: a slot came free.
        let node = endpoint(2);
        for load in [1, 2, 3, 5, 9] {
            answer(&node, 15, load, NOW);
        }
        answer(&node, 120, 17, NOW);
        answer(&node, 130, 17, NOW + 200);
        let after = NOW + 200 + LOAD_FRESH_MS;
        assert!(!admits(&node, 17, after) && !admits(&node, 20, after));
        assert!(!admits(&node, 16, after - 1) && admits(&node, 16, after));
    }

    /// Streams that come in a line fill the window with it, however each began.
    #[test]
    fn late_first_bytes_again_and_again_are_a_line() {
        let node = endpoint(1);
        answer(&node, 15, 1, NOW);
        answer(&node, 16, 2, NOW);
        answer(&node, 15, 3, NOW);
        answer(&node, 120, 4, NOW + 1);
        answer(&node, 120, 3, NOW + 2);
        answer(&node, 120, 4, NOW + 3);
        assert!(!admits(&node, 2, NOW + 1_000) && admits(&node, 1, NOW + 1_000));
    }

    /// A node that slowed down all over shows it at its lowest load, which is never kept from it: the
    /// slower answers there are its speed now, and its other loads are judged against them.
    #[test]
    fn a_node_that_slowed_down_is_judged_by_its_speed_now() {
        let node = endpoint(1);
        batch_of_four(&node, NOW);
        let later = NOW + LOAD_FRESH_MS;
        // Five times slower, alone and at three.
        answer(&node, 75, 1, later);
        answer(&node, 80, 3, later);
        assert!(
            admits(&node, 2, later),
            "80 ms is its free slot now, not a line"
        );
    }

    /// A node whose first byte is quick opens to a load it has not been seen at one request at a time:
    /// the first at that load finds out whether there is room, the rest wait for its first byte.
    #[test]
    fn a_quick_node_is_opened_to_loads_not_seen_one_request_at_a_time() {
        let node = endpoint(1);
        answer(&node, 15, 1, NOW);
        assert!(admits(&node, 1, NOW), "the first at a load of two");
        assert!(!admits(&node, 2, NOW) && !admits(&node, 9, NOW));
        answer(&node, 16, 2, NOW);
        assert!(admits(&node, 2, NOW));
        let probing = node.latency().start_waiting(Instant::now());
        assert!(!admits(&node, 3, NOW), "while the first at 3 waits");
        drop(probing);
        answer(&node, 15, 3, NOW);
        assert!(admits(&node, 3, NOW), "3–4 seen free");
        assert!(admits(&node, 4, NOW));
        let probing = node.latency().start_waiting(Instant::now());
        assert!(!admits(&node, 5, NOW));
        drop(probing);
    }

    /// A node whose quickest first byte is a whole answer (slower than `PROBE_WITHIN_MS`) would open
    /// level by level one answer at a time, seconds each: it is tried at loads not seen, as a node
    /// nothing is known of.
    #[test]
    fn a_node_whose_first_byte_is_a_whole_answer_is_tried_at_loads_not_seen() {
        let node = endpoint(1);
        answer(&node, PROBE_WITHIN_MS + 1, 1, NOW);
        assert!(admits(&node, 1, NOW) && admits(&node, 2, NOW) && admits(&node, 30, NOW));
        // A line it showed is still a line.
        answer(&node, 10 * PROBE_WITHIN_MS, 3, NOW);
        assert!(admits(&node, 1, NOW) && !admits(&node, 2, NOW) && !admits(&node, 30, NOW));
    }

    /// A node kept from a load takes no answers there, so nothing it does could lift the cap: what it
    /// took there is forgotten after `LOAD_FRESH_MS`, and its next answer there judges it alone.
    #[test]
    fn a_load_lined_by_a_spell_that_passed_is_tried_again_and_judged_by_its_next_answer() {
        let node = endpoint(1);
        batch_of_four(&node, NOW);
        // Answers keep coming at the loads it is allowed; none at the lined one.
        let later = NOW + LOAD_FRESH_MS - 1;
        answer(&node, 15, 1, later);
        assert!(!admits(&node, 4, later), "still lined within the window");
        let after = NOW + LOAD_FRESH_MS;
        assert!(
            admits(&node, 4, after),
            "tried again, by the first request at that load"
        );
        let probing = node.latency().start_waiting(Instant::now());
        assert!(
            !admits(&node, 5, after) && !admits(&node, 9, after),
            "the rest wait for its answer"
        );
        drop(probing);
        // One quick answer there opens it; a blend with the old 400 ms would still read as a line.
        answer(&node, 16, 6, after);
        assert!(admits(&node, 4, after + 1));
        // And one slow answer there closes it again.
        answer(&node, 400, 6, after + 2 * LOAD_FRESH_MS);
        answer(&node, 15, 1, after + 2 * LOAD_FRESH_MS);
        assert!(!admits(&node, 4, after + 2 * LOAD_FRESH_MS));
    }
}

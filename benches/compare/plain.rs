//! The `plain` scenario: plain (non-OpenAI) SSE streams through stalls, partitions and resets.
//!
//! Every request is `POST /generate` with `Accept: text/event-stream`, which the simulated nodes answer
//! with their own event stream, `data: {"node":…,"token":N}` for N = 0 … 29, then `data: [DONE]`: no
//! OpenAI answer, so no proxy can continue a stream on another node; a stream whose node resets under
//! it is lost for every proxy, one whose node stalls and then resumes (the gray node does) is whole
//! for a proxy that waits for it. What a proxy can do is send new streams elsewhere quickly, not make
//! the others wait, and not cut what it cannot repair.
//!
//! Four identical nodes serve 8 streams at once each, 30 events over about 0.6 s (the first after a
//! tenth of it); the load is a fixed 25 streams a second (47 % of the fleet's 53 a second). During the
//! measured window one node goes gray (its health answers, its streams stall after their first event)
//! for 8 s, one is partitioned (connections accepted, nothing answered) for 6 s, one refuses (resets
//! and refused connects) for 4 s, one after the other. A success is a whole stream: 200, every event
//! in order from one node, and `[DONE]` ([`super::load::check_plain`]).

use std::time::Duration;

use tongs::sim::InterruptionKind;

use super::support::fleet;
use super::{Scenario, fleet_config};

/// Four identical nodes: name, streams served at once, mean service time in ms (a stream's length).
pub const NODES: [fleet::Node; 4] = [
    ("gpu-1", 8, 600),
    ("gpu-2", 8, 600),
    ("gpu-3", 8, 600),
    ("gpu-4", 8, 600),
];

/// Events of every stream (before `[DONE]`).
pub const TOKENS: u32 = 30;

/// Lognormal spread of the service time: streams of 0.6 s, give or take a little.
pub const SPREAD: f64 = 0.1;

/// Streams started per second, whatever the fleet's capacity.
pub const RATE: f64 = 25.0;

/// The interruptions: (node, kind, starts at as a share of the measured window, lasts in seconds).
/// One node at a time; in a 30 s window gray 4.5–12.5 s, partition 13.5–19.5 s, refusal 22.5–26.5 s.
pub const SCHEDULE: [(&str, InterruptionKind, f64, u64); 3] = [
    ("gpu-2", InterruptionKind::Gray, 0.15, 8),
    ("gpu-3", InterruptionKind::Blackhole, 0.45, 6),
    ("gpu-4", InterruptionKind::Refuse, 0.75, 4),
];

/// The schedule in a measured window of `window`: (node, kind, from the window's start, lasts).
pub fn timeline(window: Duration) -> Vec<(&'static str, InterruptionKind, Duration, Duration)> {
    SCHEDULE
        .iter()
        .map(|&(node, kind, at, lasts)| {
            (node, kind, window.mul_f64(at), Duration::from_secs(lasts))
        })
        .collect()
}

/// The plain fleet, load and schedule, for the results' header.
pub fn describe(seed: u64, window: Duration) -> String {
    let config = fleet_config(Scenario::Plain, seed);
    let schedule = timeline(window)
        .iter()
        .map(|(node, kind, at, lasts)| {
            format!(
                "{node} {} {:.1}–{:.1} s",
                kind.as_str(),
                at.as_secs_f64(),
                (*at + *lasts).as_secs_f64()
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "plain: fleet {} (lognormal spread {SPREAD}), {TOKENS} events a stream, plain SSE (`POST /generate`, \
         `Accept: text/event-stream`); {RATE} streams/s against a capacity of {:.1}; in the measured window: \
         {schedule}",
        fleet::describe(&config),
        fleet::capacity(&config),
    )
}

//! The `announced` and `unannounced` scenarios: long streamed completions (400 tokens over about 20 s,
//! longer than the notice) on six nodes at 50 %, four of which go one after another (`refuse`: their
//! connections reset, new ones refused) and come back. In `announced` each of them first says so
//! [`NOTICE`] ahead (`x-tongs-drain` on its heartbeat answers: the simulator's `announce_end`, what a
//! node's SIGTERM hook does); in `unannounced` the same nodes go at the same moments without a word.
//! The nodes' first token comes as a GPU server's does after a short prefill ([`first_token`]), not
//! after a tenth of the service time: a stream continued elsewhere waits for that first token.
//!
//! A client's stream counts as a success only when it is complete and exact, as in `cuts`. The table
//! shows what clients saw (complete and exact, streams paused and their longest gap) and, for tongs,
//! what became of the streams on the nodes that went: moved before their node went
//! (`tongs_streams_moved_total`), or cut by it and continued (`tongs_continuations_total` less those
//! moved).

use std::fmt::Write as _;
use std::time::Duration;

use tongs::config::HumanDuration;
use tongs::sim::{FirstToken, InterruptionKind};

use super::support::fleet;
use super::support::stats;
use super::{Proxy, Row, Scenario, cell};

/// Six identical nodes: name, requests served at once, mean service time in ms.
pub const NODES: [fleet::Node; 6] = [
    ("a100-1", 8, 20_000),
    ("a100-2", 8, 20_000),
    ("a100-3", 8, 20_000),
    ("a100-4", 8, 20_000),
    ("a100-5", 8, 20_000),
    ("a100-6", 8, 20_000),
];

/// The lognormal spread of the service time: narrow, so that the longest streams (about 26 s) end
/// within the client's timeout.
pub const SPREAD: f64 = 0.1;

/// Tokens of every stream: one every 45 ms.
pub const TOKENS: u32 = 400;

/// Every node's first-token wait: 80 ms on an idle node, 10 ms more for each other request on it and
/// 0.1 ms for each word of the prompt (a continuation's prompt holds the text so far), lognormal.
pub fn first_token() -> FirstToken {
    FirstToken {
        wait: HumanDuration::from_millis(80),
        per_prompt_word: HumanDuration(Duration::from_micros(100)),
        per_in_flight: HumanDuration::from_millis(10),
        spread: 0.3,
    }
}

/// How long before it goes a node says so, in `announced`.
pub const NOTICE: Duration = Duration::from_secs(10);

/// The nodes that go, as shares of the measured window: (node, kind, goes at, stays away). One at a
/// time; the first only after [`NOTICE`] into a 60 s window.
pub const SCHEDULE: [(&str, InterruptionKind, f64, f64); 4] = [
    ("a100-1", InterruptionKind::Refuse, 0.25, 0.10),
    ("a100-2", InterruptionKind::Refuse, 0.45, 0.10),
    ("a100-3", InterruptionKind::Refuse, 0.65, 0.10),
    ("a100-4", InterruptionKind::Refuse, 0.85, 0.10),
];

/// The table: both scenarios, every proxy.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let of: Vec<&Row> = rows
        .iter()
        .filter(|row| matches!(row.scenario, Scenario::Announced | Scenario::Unannounced))
        .filter(|row| row.cuts.is_some())
        .collect();
    if of.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\nNodes that go (`announced`: each says so {} s ahead; `unannounced`: the same nodes at the same \
         moments, without a word). A success is a stream complete and exact; a stream *paused* had a gap \
         between two chunks over {}× the token gap.\n",
        NOTICE.as_secs(),
        super::cuts::GAP_FACTOR,
    );
    let _ = writeln!(
        out,
        "| scenario | proxy | streams | complete and exact % | failures | p50 / p99 ms | paused streams | their \
         longest gap p50 / p99 / max ms | tongs: moved / cut and continued |"
    );
    let _ = writeln!(
        out,
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |"
    );
    for row in of {
        let Some(cuts) = &row.cuts else { continue };
        let failures = if row.failures.is_empty() {
            "0".to_owned()
        } else {
            stats::by_kind(&row.failures)
        };
        let tongs = match (cuts.moved, &cuts.continuations) {
            (Some(moved), Some(continuations)) => {
                let continued = continuations.get("continued").copied().unwrap_or(0);
                format!("{moved} / {}", continued.saturating_sub(moved))
            }
            _ => "–".to_owned(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2} | {failures} | {} / {} | {} | {} / {} / {} | {tongs} |",
            row.scenario.name(),
            row.label,
            row.requests,
            100.0 * row.succeeded as f64 / row.requests.max(1) as f64,
            cell(row.p50),
            cell(row.p99),
            cuts.paused,
            cell(cuts.gap_p50),
            cell(cuts.gap_p99),
            cell(cuts.gap_max),
        );
    }
    out
}

/// The aims of announced interruptions, for tongs: no stream cut (all moved first), no failure, the
/// longest pause a client saw under 300 ms.
pub fn verdicts(rows: &[Row], out: &mut String) {
    for tongs in rows
        .iter()
        .filter(|row| row.scenario == Scenario::Announced && row.proxy.is_some_and(Proxy::is_tongs))
    {
        let Some(cuts) = &tongs.cuts else { continue };
        let continued = cuts
            .continuations
            .as_ref()
            .and_then(|c| c.get("continued").copied())
            .unwrap_or(0);
        let cut = continued.saturating_sub(cuts.moved.unwrap_or(0));
        let yes = |ok: bool| if ok { "yes" } else { "NO" };
        let longest = cuts.gap_max.unwrap_or(0.0);
        let _ = writeln!(
            out,
            "- announced, {}: no stream cut {} ({cut}); no request failed {} ({}); longest pause under \
             300 ms {} ({longest:.0} ms among paused streams)",
            tongs.label,
            yes(cut == 0),
            yes(tongs.failures.is_empty() && tongs.succeeded == tongs.requests),
            tongs.requests - tongs.succeeded,
            yes(longest < 300.0),
        );
    }
}

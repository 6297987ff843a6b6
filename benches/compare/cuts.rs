//! The `cuts` scenario: every request a streamed completion, cut mid-flight on a schedule that is the
//! same for every proxy — resets (`refuse`), partitions (`blackhole`) and gray stalls (`gray`) of nodes
//! that hold streams, spread over the run on different nodes, at most two of six out at once.
//!
//! A client's stream counts as a success only when it is complete and exact
//! ([`tongs::demo::check_completion`]): the text the simulated model writes, one `id`, one final chunk,
//! one `[DONE]`. Each success's longest gap between two consecutive chunks, as the client saw them,
//! shows what an interruption cost a stream that survived it: a stream whose longest gap exceeds
//! [`GAP_FACTOR`] × the nodes' normal token gap was paused by one (continued elsewhere by tongs, or
//! waited out when a gray node recovered in time).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use tongs::sim::{FleetConfig, InterruptionKind};

use super::peers::{Handle, Running};
use super::support::fleet;
use super::support::stats::{self, percentile};
use super::{Proxy, Row, Scenario, cell, fleet_config};

/// Six identical nodes, so one token gap is every node's: name, requests served at once, mean service
/// time in ms (a stream of 16 tokens lasts about that long).
pub const NODES: [fleet::Node; 6] = [
    ("l40s-1", 4, 300),
    ("l40s-2", 4, 300),
    ("l40s-3", 4, 300),
    ("l40s-4", 4, 300),
    ("l40s-5", 4, 300),
    ("l40s-6", 4, 300),
];

/// The interruptions, as shares of the measured window: (node, kind, starts at, lasts). Every node is
/// hit twice by different kinds; two nodes are out at once twice (l40s-5 and l40s-6 at 44 %, l40s-5
/// and l40s-6 again at 90 %), never more.
pub const SCHEDULE: [(&str, InterruptionKind, f64, f64); 12] = [
    ("l40s-1", InterruptionKind::Refuse, 0.06, 0.04),
    ("l40s-2", InterruptionKind::Blackhole, 0.12, 0.08),
    ("l40s-3", InterruptionKind::Gray, 0.22, 0.08),
    ("l40s-4", InterruptionKind::Refuse, 0.32, 0.04),
    ("l40s-5", InterruptionKind::Blackhole, 0.40, 0.08),
    ("l40s-6", InterruptionKind::Refuse, 0.44, 0.04),
    ("l40s-1", InterruptionKind::Gray, 0.52, 0.08),
    ("l40s-2", InterruptionKind::Refuse, 0.62, 0.04),
    ("l40s-3", InterruptionKind::Blackhole, 0.68, 0.08),
    ("l40s-4", InterruptionKind::Gray, 0.78, 0.08),
    ("l40s-5", InterruptionKind::Refuse, 0.88, 0.04),
    ("l40s-6", InterruptionKind::Gray, 0.90, 0.06),
];

/// A stream whose longest gap between two chunks exceeds this many normal token gaps was paused by an
/// interruption.
pub const GAP_FACTOR: f64 = 5.0;

/// The nodes' normal gap between two tokens, the simulator's pace: mean service time × 0.9 ÷ the
/// node's tokens (the slowest node's, were they to differ).
pub fn token_gap(config: &FleetConfig) -> Duration {
    config
        .nodes
        .iter()
        .map(|node| node.service_time.mean.get().mul_f64(0.9) / node.tokens.max(1))
        .max()
        .unwrap_or_default()
}

/// The cuts fleet and schedule, for the results' header.
pub fn describe(seed: u64) -> String {
    let config = fleet_config(Scenario::Cuts, seed);
    let schedule = SCHEDULE
        .iter()
        .map(|(node, kind, at, lasts)| {
            format!(
                "{node} {} {:.0}–{:.0} %",
                kind.as_str(),
                100.0 * at,
                100.0 * (at + lasts)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "cuts: fleet {}, capacity {:.1} req/s, token gap {:.1} ms; cut at: {schedule}",
        fleet::describe(&config),
        fleet::capacity(&config),
        token_gap(&config).as_secs_f64() * 1000.0,
    )
}

/// What the cuts table shows of one proxy's run besides the row's figures.
pub struct Figures {
    /// [`GAP_FACTOR`] × the token gap.
    pub threshold: Duration,
    /// Exact streams whose longest gap exceeded the threshold.
    pub paused: usize,
    /// Their longest gaps, ms.
    pub gap_p50: Option<f64>,
    pub gap_p99: Option<f64>,
    pub gap_max: Option<f64>,
    /// tongs' own count of broken streams by what became of them (`tongs_continuations_total`).
    pub continuations: Option<BTreeMap<String, u64>>,
    /// tongs' own count of streams moved off nodes that said they were going
    /// (`tongs_streams_moved_total`).
    pub moved: Option<u64>,
}

impl Figures {
    /// From the exact streams' `longest_gaps`, on the fleet `config`, through `running`.
    pub async fn measure(
        config: &FleetConfig,
        longest_gaps: &[Duration],
        running: &Running,
    ) -> Figures {
        let threshold = token_gap(config).mul_f64(GAP_FACTOR);
        let mut paused: Vec<f64> = longest_gaps
            .iter()
            .filter(|gap| **gap > threshold)
            .map(|gap| gap.as_secs_f64() * 1000.0)
            .collect();
        paused.sort_by(f64::total_cmp);
        let (continuations, moved) = match &running.handle {
            Handle::Tongs(tongs) => {
                let metrics = format!("http://{}/metrics", tongs.admin);
                (continuations(&metrics).await, moved(&metrics).await)
            }
            Handle::Replicas(_) | Handle::Peer { .. } => (None, None),
        };
        Figures {
            threshold,
            paused: paused.len(),
            gap_p50: percentile(&paused, 50.0),
            gap_p99: percentile(&paused, 99.0),
            gap_max: paused.last().copied(),
            continuations,
            moved,
        }
    }
}

/// tongs' `tongs_streams_moved_total`, summed over pools.
async fn moved(metrics: &str) -> Option<u64> {
    let (_, text) = super::support::get(metrics).await.ok()?;
    let total: f64 = text
        .lines()
        .filter(|line| line.starts_with("tongs_streams_moved_total{"))
        .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum();
    Some(total as u64)
}

/// tongs' `tongs_continuations_total` by outcome, the outcomes that happened.
async fn continuations(metrics: &str) -> Option<BTreeMap<String, u64>> {
    let (_, text) = super::support::get(metrics).await.ok()?;
    // Summed over pools: each series carries `pool` besides `outcome`, in any order.
    let mut counts = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("tongs_continuations_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let Some(outcome) = labels
            .split(',')
            .find_map(|label| label.strip_prefix("outcome=\""))
            .and_then(|quoted| quoted.strip_suffix('"'))
        else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        *counts.entry(outcome.to_owned()).or_insert(0) += value as u64;
    }
    counts.retain(|_, count| *count > 0);
    Some(counts)
}

/// The cuts table: what each proxy's clients saw of the streams cut mid-flight.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let of: Vec<&Row> = rows
        .iter()
        .filter(|row| row.scenario == Scenario::Cuts)
        .collect();
    let Some(threshold) = of
        .iter()
        .find_map(|row| row.cuts.as_ref().map(|c| c.threshold))
    else {
        return out;
    };
    let threshold_ms = threshold.as_secs_f64() * 1000.0;
    let _ = writeln!(
        out,
        "\nStreams cut mid-flight (`cuts`): a success is a stream complete and exact; a stream *paused* had a \
         gap between two chunks over {GAP_FACTOR}× the nodes' token gap ({threshold_ms:.0} ms).\n"
    );
    let _ = writeln!(
        out,
        "| proxy | streams | complete and exact % | failures | p50 / p99 ms | paused streams | their longest gap \
         p50 / p99 / max ms | tongs' continuations |"
    );
    let _ = writeln!(
        out,
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- |"
    );
    for row in of {
        let Some(cuts) = &row.cuts else { continue };
        let failures = if row.failures.is_empty() {
            "0".to_owned()
        } else {
            stats::by_kind(&row.failures)
        };
        let continuations = cuts
            .continuations
            .as_ref()
            .map_or("–".to_owned(), |counts| {
                if counts.is_empty() {
                    "0".to_owned()
                } else {
                    stats::by_kind(counts)
                }
            });
        let _ = writeln!(
            out,
            "| {} | {} | {:.2} | {failures} | {} / {} | {} | {} / {} / {} | {continuations} |",
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

/// The cuts target: every stream tongs relayed ends complete and exact (a node always survives).
pub fn verdicts(rows: &[Row], out: &mut String) {
    for tongs in rows
        .iter()
        .filter(|row| row.scenario == Scenario::Cuts && row.proxy.is_some_and(Proxy::is_tongs))
    {
        let Some(cuts) = &tongs.cuts else { continue };
        let _ = writeln!(
            out,
            "- cuts, {}: every stream complete and exact {} ({:.2} %); paused streams {}, longest gap max {} ms",
            tongs.label,
            if tongs.succeeded == tongs.requests {
                "yes"
            } else {
                "NO"
            },
            100.0 * tongs.succeeded as f64 / tongs.requests.max(1) as f64,
            cuts.paused,
            cell(cuts.gap_max),
        );
    }
}

//! The Grafana dashboard: valid JSON, unique panel ids, every panel queries only metrics tongs
//! exports, and the key metrics are all shown.

use std::collections::BTreeSet;

use serde_json::Value;
use tongs::metrics::CATALOG;

use crate::problems::Problems;

/// Every `tongs_*` name in a PromQL expression.
pub(crate) fn metric_names(expr: &str) -> Vec<&str> {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("tongs_") {
        let inside_word = rest[..start].chars().next_back().is_some_and(is_word);
        let tail = &rest[start..];
        let end = tail.find(|c: char| !is_word(c)).unwrap_or(tail.len());
        if !inside_word {
            names.push(&tail[..end]);
        }
        rest = &tail[end..];
    }
    names
}

/// Whether tongs exports `name`: a CATALOG name, or a histogram's `_bucket`, `_sum` or `_count`.
pub(crate) fn exported(name: &str) -> bool {
    CATALOG.iter().any(|spec| {
        name == spec.name
            || (spec.kind == "histogram"
                && ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suffix| name.strip_suffix(suffix) == Some(spec.name)))
    })
}

pub(crate) fn check_dashboard(at: &str, text: &str, problems: &mut Problems) {
    let dashboard: Value = match serde_json::from_str(text) {
        Ok(value) => value,
        Err(err) => return problems.fail(at, format!("is not JSON: {err}")),
    };
    let mut ids = BTreeSet::new();
    let mut used = BTreeSet::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        let title = panel["title"].as_str().unwrap_or("?");
        ensure!(
            problems,
            at,
            ids.insert(panel["id"].to_string()),
            "panel id {} is used twice",
            panel["id"]
        );
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
        ensure!(
            problems,
            at,
            !targets.is_empty(),
            "panel {title:?} has no query"
        );
        for expr in targets.iter().filter_map(|target| target["expr"].as_str()) {
            for name in metric_names(expr) {
                ensure!(
                    problems,
                    at,
                    exported(name),
                    "panel {title:?} queries {name}, which src/metrics/catalog.rs does not define"
                );
                used.insert(name.to_owned());
            }
        }
    }
    for wanted in [
        "tongs_requests_total",
        "tongs_request_duration_seconds_bucket",
        "tongs_endpoint_outstanding",
        "tongs_endpoint_limit",
        "tongs_endpoint_state",
        "tongs_retries_total",
        "tongs_rejections_total",
        "tongs_queue_depth",
        "tongs_queue_wait_seconds_bucket",
        "tongs_demand",
        "tongs_pool_fallbacks_total",
    ] {
        ensure!(
            problems,
            at,
            used.contains(wanted),
            "no panel shows {wanted}"
        );
    }
}

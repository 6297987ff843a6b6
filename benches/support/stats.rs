//! Figures from what a benchmark recorded: percentiles of sorted samples and of latency histograms,
//! and failures counted by kind.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;

/// The value at percentile `p` (0 to 100) of `sorted`, nearest rank; None when it is empty.
pub fn percentile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    Some(sorted[rank.min(sorted.len() - 1)])
}

/// A histogram of latencies in microseconds, from 1 µs to an hour, three significant digits.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("constant bounds are valid")
}

/// `duration` in whole microseconds for a latency histogram: at least 1, at most `u64::MAX`.
pub fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The `quantile` (0 to 1) of a histogram of microseconds, in milliseconds; None when it is empty.
pub fn quantile_ms(histogram: &Histogram<u64>, quantile: f64) -> Option<f64> {
    (!histogram.is_empty()).then(|| histogram.value_at_quantile(quantile) as f64 / 1000.0)
}

/// The largest value of a histogram of microseconds, in milliseconds; None when it is empty.
pub fn max_ms(histogram: &Histogram<u64>) -> Option<f64> {
    (!histogram.is_empty()).then(|| histogram.max() as f64 / 1000.0)
}

/// "broken: 3, client-timeout: 1": counts by kind, in the map's order; empty when there are none.
pub fn by_kind(counts: &BTreeMap<String, u64>) -> String {
    counts
        .iter()
        .map(|(kind, count)| format!("{kind}: {count}"))
        .collect::<Vec<_>>()
        .join(", ")
}

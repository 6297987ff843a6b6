//! Fixed-bucket histograms recorded on the request path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::render::sample;

/// Histogram buckets for inference: 5 ms to 120 s.
pub const BUCKETS: [f64; 18] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0, 30.0, 45.0,
    60.0, 120.0,
];

/// A histogram with fixed buckets: recording is two atomic additions, with no allocation and no
/// lock, because it happens on every request (the exporter's own histograms keep every sample until
/// they are drained, which under loopback load cost tongs about half its CPU per request again).
pub(super) struct Buckets {
    /// Per bucket of [`BUCKETS`], then the overflow: not cumulative until rendered.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Default for Buckets {
    fn default() -> Self {
        Buckets {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Buckets {
    pub(super) fn record(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        let index = BUCKETS.partition_point(|&bound| bound < seconds);
        self.counts[index].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Appends the `_bucket`, `_sum` and `_count` samples, with `labels` (those with a name) first.
    pub(super) fn render(&self, out: &mut String, name: &str, labels: &[(&str, &str)]) {
        let bucket = format!("{name}_bucket");
        let labels: Vec<(&str, &str)> = labels
            .iter()
            .copied()
            .filter(|(k, v)| !k.is_empty() && !v.is_empty())
            .collect();
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = BUCKETS
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            let mut with_le = labels.clone();
            with_le.push(("le", le.as_str()));
            sample(out, &bucket, &with_le, cumulative as f64);
        }
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        sample(out, &format!("{name}_sum"), &labels, sum);
        sample(out, &format!("{name}_count"), &labels, cumulative as f64);
    }
}

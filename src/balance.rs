//! Least-outstanding-requests balancing over a registry snapshot.
//!
//! The load of an endpoint is `(outstanding + 1) / weight`: the share of its capacity it would be using
//! if it got this request. Comparing `(o+1)/w` rather than `o/w` makes weights matter even when every
//! endpoint is idle, and spreads concurrent load in proportion to weight (weight 3 takes three requests
//! for every one a weight-1 endpoint takes). Ratios are compared by cross-multiplication, so no floats.
//!
//! Small sets (up to [`FULL_SCAN_MAX`]) are scanned fully with a random tie-break, which is exact and
//! cheap. Larger sets use the power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized
//! Load Balancing", 2001): two random eligible endpoints, keep the less loaded. That is O(1) at 10,000
//! endpoints and avoids the herd behaviour of an exact scan across many proxy replicas whose views lag.
//!
//! A pick never allocates: the exclusion set is a caller-owned slice (the endpoints a retry already tried).

use std::cmp::Ordering;
use std::sync::Arc;

use crate::endpoint::{Endpoint, EndpointId};

/// Largest set scanned fully; above it, power of two choices.
pub const FULL_SCAN_MAX: usize = 32;

/// Random samples a two-choice pick draws before it falls back to a scan (when most endpoints are
/// excluded or unavailable, sampling alone could miss the few eligible ones).
const MAX_SAMPLES: usize = 8;

/// Picks the endpoint with the least outstanding requests per unit of weight, skipping unavailable
/// endpoints and those in `exclude`. `None` when no endpoint is eligible.
pub fn pick<'a>(
    endpoints: &'a [Arc<Endpoint>],
    exclude: &[EndpointId],
) -> Option<&'a Arc<Endpoint>> {
    if endpoints.len() <= FULL_SCAN_MAX {
        full_scan(endpoints, exclude)
    } else {
        two_choices(endpoints, exclude)
    }
}

fn eligible(endpoint: &Endpoint, exclude: &[EndpointId]) -> bool {
    endpoint.is_available() && !exclude.contains(&endpoint.id())
}

/// `(outstanding + 1, weight)`: a fraction, compared by cross-multiplication.
fn load(endpoint: &Endpoint) -> (u64, u32) {
    (endpoint.outstanding().saturating_add(1), endpoint.weight())
}

fn compare(a: (u64, u32), b: (u64, u32)) -> Ordering {
    (u128::from(a.0) * u128::from(b.1)).cmp(&(u128::from(b.0) * u128::from(a.1)))
}

fn full_scan<'a>(
    endpoints: &'a [Arc<Endpoint>],
    exclude: &[EndpointId],
) -> Option<&'a Arc<Endpoint>> {
    let mut best: Option<(&'a Arc<Endpoint>, (u64, u32))> = None;
    let mut ties = 0u32;
    for endpoint in endpoints {
        if !eligible(endpoint, exclude) {
            continue;
        }
        let candidate = load(endpoint);
        match best {
            Some((_, best_load)) => match compare(candidate, best_load) {
                Ordering::Less => {
                    best = Some((endpoint, candidate));
                    ties = 1;
                }
                Ordering::Equal => {
                    // Reservoir sampling: each of the k tied endpoints ends up chosen with probability 1/k.
                    ties += 1;
                    if fastrand::u32(..ties) == 0 {
                        best = Some((endpoint, candidate));
                    }
                }
                Ordering::Greater => {}
            },
            None => {
                best = Some((endpoint, candidate));
                ties = 1;
            }
        }
    }
    best.map(|(endpoint, _)| endpoint)
}

fn two_choices<'a>(
    endpoints: &'a [Arc<Endpoint>],
    exclude: &[EndpointId],
) -> Option<&'a Arc<Endpoint>> {
    let mut first: Option<&'a Arc<Endpoint>> = None;
    for _ in 0..MAX_SAMPLES {
        let endpoint = &endpoints[fastrand::usize(..endpoints.len())];
        if !eligible(endpoint, exclude) {
            continue;
        }
        match first {
            None => first = Some(endpoint),
            Some(chosen) if chosen.id() == endpoint.id() => {}
            Some(chosen) => {
                return Some(match compare(load(chosen), load(endpoint)) {
                    Ordering::Less => chosen,
                    Ordering::Greater => endpoint,
                    Ordering::Equal if fastrand::bool() => chosen,
                    Ordering::Equal => endpoint,
                });
            }
        }
    }
    full_scan(endpoints, exclude)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EndpointUrl;
    use crate::endpoint::Outstanding;

    fn fleet(weights: &[u32]) -> Vec<Arc<Endpoint>> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let url = format!("http://127.0.0.1:{}", 10_000 + i);
                let parsed = EndpointUrl::parse(&url).unwrap();
                Arc::new(Endpoint::new(i as u64, &url, parsed, w))
            })
            .collect()
    }

    /// Picks `n` requests in a row, each held open, and returns how many each endpoint got.
    fn hold(endpoints: &[Arc<Endpoint>], n: usize) -> (Vec<usize>, Vec<Outstanding>) {
        let mut counts = vec![0; endpoints.len()];
        let mut held = Vec::new();
        for _ in 0..n {
            let chosen = pick(endpoints, &[]).unwrap();
            counts[chosen.id() as usize] += 1;
            held.push(chosen.start_request());
        }
        (counts, held)
    }

    #[test]
    fn empty_set_picks_nothing() {
        assert!(pick(&[], &[]).is_none());
    }

    #[test]
    fn prefers_the_idle_endpoint() {
        let endpoints = fleet(&[1, 1, 1]);
        let _busy_a = endpoints[0].start_request();
        let _busy_b = endpoints[2].start_request();
        for _ in 0..50 {
            assert_eq!(pick(&endpoints, &[]).unwrap().id(), 1);
        }
    }

    #[test]
    fn spreads_held_requests_evenly() {
        let endpoints = fleet(&[1, 1, 1, 1]);
        let (counts, _held) = hold(&endpoints, 40);
        assert_eq!(counts, [10, 10, 10, 10]);
    }

    #[test]
    fn concurrent_load_follows_weights() {
        let endpoints = fleet(&[3, 1]);
        let (counts, _held) = hold(&endpoints, 40);
        // (o+1)/w keeps the two within one request of a 3:1 split.
        assert!((29..=31).contains(&counts[0]), "{counts:?}");
    }

    #[test]
    fn ties_are_broken_at_random() {
        let endpoints = fleet(&[1, 1, 1]);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[pick(&endpoints, &[]).unwrap().id() as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 50), "{seen:?}");
    }

    #[test]
    fn exclusions_and_draining_are_skipped() {
        let endpoints = fleet(&[1, 1, 1]);
        endpoints[1].set_draining(true);
        for _ in 0..50 {
            assert_eq!(pick(&endpoints, &[0]).unwrap().id(), 2);
        }
        assert!(pick(&endpoints, &[0, 2]).is_none());
    }

    #[test]
    fn two_choices_at_scale_avoid_loaded_endpoints() {
        let endpoints = fleet(&vec![1; 1000]);
        // Load every endpoint but the first hundred: a two-choice pick lands on an idle one whenever one of
        // its two samples is idle, so far more often than the 10 % a random pick would.
        let _held: Vec<_> = endpoints[100..].iter().map(|e| e.start_request()).collect();
        let idle_hits = (0..2000)
            .filter(|_| pick(&endpoints, &[]).unwrap().id() < 100)
            .count();
        assert!(idle_hits > 300, "{idle_hits}");
    }

    #[test]
    fn two_choices_find_the_last_eligible_endpoint() {
        let endpoints = fleet(&vec![1; 500]);
        let exclude: Vec<EndpointId> = (0..499).collect();
        for _ in 0..20 {
            assert_eq!(pick(&endpoints, &exclude).unwrap().id(), 499);
        }
    }
}

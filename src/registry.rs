//! The set of endpoints requests may go to, published as an immutable snapshot.
//!
//! Discovery writes (rarely, under a small lock); the request path only loads the current snapshot
//! (`ArcSwap`, no lock, no reference-count traffic for the load itself). An update keeps the very same
//! `Endpoint` (and so its live state: outstanding count, later health and breaker) for every endpoint
//! whose URL and weight did not change. An endpoint that leaves is marked draining; requests already on it
//! hold their own reference and finish normally.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;

use crate::admission::Queue;
use crate::config::{Config, EndpointUrl};
use crate::endpoint::Endpoint;
use crate::limit::LimitSettings;

/// What discovery says an endpoint should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    pub url: String,
    pub parsed: EndpointUrl,
    pub weight: u32,
}

impl EndpointSpec {
    /// The static endpoints of a (validated) configuration.
    pub fn from_config(config: &Config) -> Vec<EndpointSpec> {
        config
            .discovery
            .static_endpoints
            .iter()
            .filter_map(|endpoint| {
                // Validation already refused bad URLs; skipping keeps this total for unvalidated input.
                let parsed = EndpointUrl::parse(&endpoint.url).ok()?;
                Some(EndpointSpec {
                    url: endpoint.url.clone(),
                    parsed,
                    weight: endpoint.weight,
                })
            })
            .collect()
    }
}

/// What the fleet is asked for right now: the signal to scale GPU nodes on.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Demand {
    /// Requests waiting in tongs' queue for a slot.
    pub queued: u64,
    /// Requests on endpoints (streams until they end).
    pub outstanding: u64,
    /// `queued + outstanding`: what KEDA should scale on.
    pub demand: u64,
    /// Sum of the endpoints' concurrency limits (null when any endpoint is unlimited).
    pub capacity: Option<u64>,
    /// Endpoints in the set (draining ones excluded).
    pub endpoints: u64,
}

/// The current endpoints, shared by every request.
pub struct Registry {
    snapshot: ArcSwap<Vec<Arc<Endpoint>>>,
    /// Bumped on every update, for the heartbeat loops that follow the set.
    changes: tokio::sync::watch::Sender<u64>,
    next_id: AtomicU64,
    /// Serialises writers so two updates cannot interleave their read-modify-publish.
    writer: Mutex<()>,
    /// Concurrency limits every endpoint gets.
    limits: Mutex<LimitSettings>,
    /// Where requests wait for an endpoint's slot; endpoints wake it when one comes free.
    queue: Arc<Queue>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl Registry {
    pub fn new() -> Registry {
        Registry {
            snapshot: ArcSwap::from_pointee(Vec::new()),
            changes: tokio::sync::watch::channel(0).0,
            next_id: AtomicU64::new(1),
            writer: Mutex::new(()),
            limits: Mutex::new(LimitSettings::none()),
            queue: Arc::new(Queue::default()),
        }
    }

    /// Queued plus outstanding requests, and the capacity the limits allow.
    pub fn demand(&self) -> Demand {
        let snapshot = self.snapshot.load();
        let mut outstanding = 0u64;
        let mut capacity = Some(0u64);
        let mut endpoints = 0u64;
        for endpoint in snapshot.iter() {
            outstanding += endpoint.outstanding();
            if endpoint.is_available() {
                endpoints += 1;
                capacity = capacity
                    .zip(endpoint.limit())
                    .map(|(sum, limit)| sum.saturating_add(limit));
            }
        }
        let queued = self.queue.len() as u64;
        Demand {
            queued,
            outstanding,
            demand: queued + outstanding,
            capacity,
            endpoints,
        }
    }

    /// The queue of requests waiting for a slot.
    pub fn queue(&self) -> &Arc<Queue> {
        &self.queue
    }

    /// The concurrency limits endpoints get.
    pub fn limits(&self) -> LimitSettings {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies new concurrency limits to every endpoint, now and to come.
    pub fn set_limits(&self, settings: LimitSettings) {
        let _writer = self
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *self.limits.lock().unwrap_or_else(|p| p.into_inner()) = settings;
        let now = tokio::time::Instant::now();
        for endpoint in self.snapshot.load().iter() {
            endpoint.apply_limit(&settings, now);
        }
        self.queue.wake_one();
    }

    /// The endpoints right now. Cheap; drop it soon (do not hold it across an await).
    pub fn snapshot(&self) -> arc_swap::Guard<Arc<Vec<Arc<Endpoint>>>> {
        self.snapshot.load()
    }

    /// The endpoints right now, as an owned handle (for holding across awaits).
    pub fn snapshot_full(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.snapshot.load_full()
    }

    /// Resolves `changed()` after every update.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Replaces the whole set, keeping the state of endpoints that did not change.
    pub fn replace(&self, desired: Vec<EndpointSpec>) {
        let _writer = self
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let current = self.snapshot.load_full();
        let mut unchanged: HashMap<(String, u32), &Arc<Endpoint>> = current
            .iter()
            .map(|endpoint| ((endpoint.url().to_owned(), endpoint.weight()), endpoint))
            .collect();
        let mut next = Vec::with_capacity(desired.len());
        for spec in desired {
            match unchanged.remove(&(spec.url.clone(), spec.weight)) {
                Some(existing) => next.push(Arc::clone(existing)),
                None => {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    let endpoint = Endpoint::new(id, &spec.url, spec.parsed, spec.weight);
                    let now = tokio::time::Instant::now();
                    endpoint.apply_limit(&self.limits(), now);
                    // The first set starts together; an endpoint joining a serving set ramps in.
                    if !current.is_empty() {
                        endpoint.start_slow_start(now);
                    }
                    endpoint.set_queue(Arc::clone(&self.queue));
                    next.push(Arc::new(endpoint));
                }
            }
        }
        for gone in unchanged.values() {
            gone.set_draining(true);
            tracing::info!(
                endpoint = gone.url(),
                outstanding = gone.outstanding(),
                "endpoint removed; draining"
            );
        }
        for added in next
            .iter()
            .filter(|e| e.requests() == 0 && e.outstanding() == 0)
        {
            tracing::debug!(
                endpoint = added.url(),
                weight = added.weight(),
                "endpoint in service"
            );
        }
        self.snapshot.store(Arc::new(next));
        self.changes.send_modify(|version| *version += 1);
        // New endpoints may have room for whoever waits.
        self.queue.wake_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str, weight: u32) -> EndpointSpec {
        EndpointSpec {
            url: url.into(),
            parsed: EndpointUrl::parse(url).unwrap(),
            weight,
        }
    }

    #[test]
    fn unchanged_endpoints_keep_their_state() {
        let registry = Registry::new();
        registry.replace(vec![spec("http://a:1", 1), spec("http://b:1", 1)]);
        let a = Arc::clone(&registry.snapshot()[0]);
        let held = a.start_request();
        registry.replace(vec![spec("http://a:1", 1), spec("http://c:1", 2)]);
        let snapshot = registry.snapshot();
        assert!(Arc::ptr_eq(&snapshot[0], &a));
        assert_eq!(snapshot[0].outstanding(), 1);
        assert_eq!(snapshot[1].url(), "http://c:1");
        drop(held);
        assert_eq!(a.outstanding(), 0);
    }

    #[test]
    fn endpoints_joining_a_serving_set_ramp_in_and_the_first_set_does_not() {
        let registry = Registry::new();
        registry.replace(vec![spec("http://a:1", 1)]);
        registry.replace(vec![spec("http://a:1", 1), spec("http://b:1", 1)]);
        let snapshot = registry.snapshot();
        let now_ms = crate::endpoint::millis(tokio::time::Instant::now());
        assert_eq!(snapshot[0].effective_weight(now_ms, 5000), 1000);
        assert!(snapshot[1].effective_weight(now_ms, 5000) < 1000);
    }

    #[test]
    fn removed_endpoints_drain_and_new_weights_make_new_endpoints() {
        let registry = Registry::new();
        registry.replace(vec![spec("http://a:1", 1)]);
        let old = Arc::clone(&registry.snapshot()[0]);
        registry.replace(vec![spec("http://a:1", 5)]);
        assert!(!old.is_available());
        let new = &registry.snapshot()[0];
        assert_eq!(new.weight(), 5);
        assert_ne!(new.id(), old.id());
    }
}

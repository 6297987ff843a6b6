//! The set of endpoints requests may go to, published as an immutable snapshot.
//!
//! Discovery writes (rarely, under a small lock); the request path only loads the current snapshot
//! (`ArcSwap`, no lock, no reference-count traffic for the load itself). An update keeps the very same
//! `Endpoint` (and so its live state: outstanding count, later health and breaker) for every endpoint
//! whose URL and weight did not change. An endpoint that leaves is marked draining; requests already on it
//! hold their own reference and finish normally.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;

use crate::config::{Config, EndpointUrl};
use crate::endpoint::{Endpoint, FleetCounts, Origin, SlotFreed};
use crate::limit::LimitSettings;

/// What discovery says an endpoint should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    pub url: String,
    pub parsed: EndpointUrl,
    pub weight: u32,
    /// Where it came from; a change here (another pod, another cap) makes a new endpoint.
    pub origin: Origin,
}

impl EndpointSpec {
    /// A static endpoint (`url` already parsed into `parsed`).
    pub fn new(url: impl Into<String>, parsed: EndpointUrl, weight: u32) -> EndpointSpec {
        EndpointSpec {
            url: url.into(),
            parsed,
            weight,
            origin: Origin::default(),
        }
    }

    /// The static endpoints of a (validated) configuration.
    pub fn from_config(config: &Config) -> Vec<EndpointSpec> {
        config
            .discovery
            .static_endpoints
            .iter()
            .filter_map(|endpoint| {
                // Validation already refused bad URLs; skipping keeps this total for unvalidated input.
                let parsed = EndpointUrl::parse(&endpoint.url).ok()?;
                let mut spec = EndpointSpec::new(endpoint.url.clone(), parsed, endpoint.weight);
                spec.origin.max_outstanding = endpoint.max_outstanding;
                Some(spec)
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
    /// What each discovery source wants, merged into the snapshot on every update. The lock also
    /// serialises writers so two updates cannot interleave their read-modify-publish.
    writer: Mutex<BTreeMap<&'static str, Vec<EndpointSpec>>>,
    /// Concurrency limits every endpoint gets.
    limits: Mutex<LimitSettings>,
    /// Handed to every endpoint: wakes whoever waits for this registry's slots.
    slot_freed: SlotFreed,
    /// Ejected, healthy and up endpoints in the set, kept by the endpoints as they change.
    counts: Arc<FleetCounts>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new(SlotFreed::nobody())
    }
}

impl Registry {
    pub fn new(slot_freed: SlotFreed) -> Registry {
        Registry {
            snapshot: ArcSwap::from_pointee(Vec::new()),
            changes: tokio::sync::watch::channel(0).0,
            next_id: AtomicU64::new(1),
            writer: Mutex::new(BTreeMap::new()),
            limits: Mutex::new(LimitSettings::none()),
            slot_freed,
            counts: Arc::default(),
        }
    }

    /// `queued` requests plus those outstanding here, and the capacity the limits allow.
    pub fn demand(&self, queued: usize) -> Demand {
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
        let queued = queued as u64;
        Demand {
            queued,
            outstanding,
            demand: queued + outstanding,
            capacity,
            endpoints,
        }
    }

    /// The concurrency limits endpoints get.
    pub fn limits(&self) -> LimitSettings {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies new concurrency limits to every endpoint, now and to come (the count of replicas
    /// sharing them stays as [`Registry::set_replicas`] last set it).
    pub fn set_limits(&self, settings: LimitSettings) {
        self.update_limits(|limits| {
            *limits = LimitSettings {
                replicas: limits.replicas,
                ..settings
            }
        });
    }

    /// How many tongs replicas share this fleet's fixed limits (see [`LimitSettings::share`]); a
    /// count that did not change touches nothing.
    pub fn set_replicas(&self, replicas: u32) {
        let replicas = replicas.max(1);
        if self.limits().replicas != replicas {
            self.update_limits(|limits| limits.replicas = replicas);
        }
    }

    fn update_limits(&self, change: impl FnOnce(&mut LimitSettings)) {
        let _writer = self
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let settings = {
            let mut limits = self.limits.lock().unwrap_or_else(|p| p.into_inner());
            change(&mut limits);
            *limits
        };
        let now = tokio::time::Instant::now();
        for endpoint in self.snapshot.load().iter() {
            endpoint.apply_limit(&settings, now);
        }
        self.slot_freed.call();
    }

    /// How many endpoints in the set are ejected, healthy and up, without a scan.
    pub fn counts(&self) -> &FleetCounts {
        &self.counts
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

    /// Replaces the static endpoints (those of the configuration file).
    pub fn replace(&self, desired: Vec<EndpointSpec>) {
        self.set_source("static", desired);
    }

    /// Replaces what one discovery source wants, keeping the state of endpoints that did not change.
    /// The snapshot is the union of every source's endpoints; one URL wanted twice (say, by the static
    /// list and by a pod) is one endpoint, the first source's in name order.
    pub fn set_source(&self, source: &'static str, desired: Vec<EndpointSpec>) {
        let mut sources = self
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        sources.insert(source, desired);
        self.rebuild(&sources);
    }

    /// Changes one source by a few endpoints: those with the `removed` URLs leave it, the `added` join
    /// it (replacing one with the same URL). For a pod event among thousands of pods: no spec is
    /// cloned or dropped but the changed ones.
    pub fn update_source(
        &self,
        source: &'static str,
        removed: &[String],
        added: Vec<EndpointSpec>,
    ) {
        let mut sources = self
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let specs = sources.entry(source).or_default();
        let leaving: HashSet<String, foldhash::fast::RandomState> = removed
            .iter()
            .cloned()
            .chain(added.iter().map(|spec| spec.url.clone()))
            .collect();
        specs.retain(|spec| !leaving.contains(&spec.url));
        specs.extend(added);
        self.rebuild(&sources);
    }

    /// Makes the snapshot the union of `sources`, keeping the endpoints that did not change.
    fn rebuild(&self, sources: &BTreeMap<&'static str, Vec<EndpointSpec>>) {
        let current = self.snapshot.load_full();
        // Keyed by URL alone, with a fast hash: with thousands of pods this runs on every pod event,
        // and hashing each endpoint's whole identity with SipHash was most of an event's cost.
        let hasher = foldhash::fast::RandomState::default();
        let mut unchanged: HashMap<&str, &Arc<Endpoint>, _> =
            HashMap::with_capacity_and_hasher(current.len(), hasher.clone());
        unchanged.extend(current.iter().map(|endpoint| (endpoint.url(), endpoint)));
        let wanted: usize = sources.values().map(Vec::len).sum();
        let mut next = Vec::with_capacity(wanted);
        let mut urls: HashSet<&str, _> = HashSet::with_capacity_and_hasher(wanted, hasher);
        for spec in sources.values().flatten() {
            if !urls.insert(&spec.url) {
                continue;
            }
            let same = unchanged.get(spec.url.as_str()).filter(|existing| {
                (existing.weight(), existing.origin()) == (spec.weight, &spec.origin)
            });
            match same {
                Some(&existing) => {
                    unchanged.remove(spec.url.as_str());
                    next.push(Arc::clone(existing));
                }
                None => {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    let endpoint = Endpoint::new(id, &spec.url, spec.parsed.clone(), spec.weight)
                        .with_origin(&spec.origin);
                    let now = tokio::time::Instant::now();
                    endpoint.apply_limit(&self.limits(), now);
                    // The first set starts together; an endpoint joining a serving set ramps in.
                    if !current.is_empty() {
                        endpoint.start_slow_start(now);
                    }
                    endpoint.set_slot_freed(self.slot_freed.clone());
                    endpoint.count_in(Arc::clone(&self.counts));
                    tracing::debug!(
                        endpoint = endpoint.url(),
                        weight = endpoint.weight(),
                        "endpoint in service"
                    );
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
        self.snapshot.store(Arc::new(next));
        self.changes.send_modify(|version| *version += 1);
        // New endpoints may have room for whoever waits.
        self.slot_freed.call();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str, weight: u32) -> EndpointSpec {
        EndpointSpec::new(url, EndpointUrl::parse(url).unwrap(), weight)
    }

    #[test]
    fn unchanged_endpoints_keep_their_state() {
        let registry = Registry::default();
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
    fn updates_change_one_source_by_a_few_endpoints() {
        let registry = Registry::default();
        registry.replace(vec![spec("http://shared:1", 1)]);
        registry.set_source("pods", vec![spec("http://a:1", 1), spec("http://b:1", 1)]);
        // Sources in name order: "pods" before "static".
        let a = Arc::clone(&registry.snapshot()[0]);
        assert_eq!(a.url(), "http://a:1");
        registry.update_source(
            "pods",
            &["http://b:1".to_owned()],
            vec![
                spec("http://c:1", 1),
                spec("http://a:1", 1),
                spec("http://shared:1", 1),
            ],
        );
        let urls: Vec<_> = registry
            .snapshot()
            .iter()
            .map(|e| e.url().to_owned())
            .collect();
        // A URL two sources want is one endpoint; a was replaced by an equal spec, so it is the same
        // endpoint with its state.
        assert_eq!(urls, ["http://c:1", "http://a:1", "http://shared:1"]);
        assert!(Arc::ptr_eq(&registry.snapshot()[1], &a));
        registry.update_source(
            "pods",
            &["http://a:1".to_owned()],
            vec![spec("http://c:1", 4)],
        );
        let snapshot = registry.snapshot();
        assert!(!a.is_available(), "a left and drains");
        assert_eq!(snapshot.len(), 2);
        assert_eq!((snapshot[1].url(), snapshot[1].weight()), ("http://c:1", 4));
    }

    #[test]
    fn endpoints_joining_a_serving_set_ramp_in_and_the_first_set_does_not() {
        let registry = Registry::default();
        registry.replace(vec![spec("http://a:1", 1)]);
        registry.replace(vec![spec("http://a:1", 1), spec("http://b:1", 1)]);
        let snapshot = registry.snapshot();
        let now_ms = crate::endpoint::millis(tokio::time::Instant::now());
        assert_eq!(snapshot[0].effective_weight(now_ms, 5000), 1000);
        assert!(snapshot[1].effective_weight(now_ms, 5000) < 1000);
    }

    #[test]
    fn removed_endpoints_drain_and_new_weights_make_new_endpoints() {
        let registry = Registry::default();
        registry.replace(vec![spec("http://a:1", 1)]);
        let old = Arc::clone(&registry.snapshot()[0]);
        registry.replace(vec![spec("http://a:1", 5)]);
        assert!(!old.is_available());
        let new = &registry.snapshot()[0];
        assert_eq!(new.weight(), 5);
        assert_ne!(new.id(), old.id());
    }

    #[test]
    fn counts_follow_breakers_health_and_removal_without_a_scan() {
        let registry = Registry::default();
        registry.replace(vec![
            spec("http://a:1", 1),
            spec("http://b:1", 1),
            spec("http://c:1", 1),
        ]);
        let counts = registry.counts();
        assert_eq!((counts.ejected(), counts.healthy(), counts.up()), (0, 3, 3));
        let now = tokio::time::Instant::now();
        let [a, b, _] = [0, 1, 2].map(|i| Arc::clone(&registry.snapshot()[i]));
        let breaker = crate::breaker::BreakerSettings::default();
        for _ in 0..breaker.consecutive_failures {
            a.record_failure(&breaker, now, true);
        }
        assert!(a.is_ejected());
        assert_eq!((counts.ejected(), counts.healthy(), counts.up()), (1, 3, 2));
        b.set_healthy(false, now);
        assert_eq!((counts.ejected(), counts.healthy(), counts.up()), (1, 2, 1));
        // Leaving the set takes an endpoint out of every count; one that stays keeps its share.
        registry.replace(vec![spec("http://b:1", 1), spec("http://c:1", 1)]);
        assert_eq!((counts.ejected(), counts.healthy(), counts.up()), (0, 1, 1));
        b.set_healthy(true, now);
        assert_eq!((counts.ejected(), counts.healthy(), counts.up()), (0, 2, 2));
        // A removed endpoint's later changes count for nothing.
        a.set_healthy(false, now);
        assert_eq!((counts.ejected(), counts.healthy(), counts.up()), (0, 2, 2));
        let scanned =
            |test: fn(&Endpoint) -> bool| registry.snapshot().iter().filter(|e| test(e)).count();
        assert_eq!(scanned(|e| e.is_ejected()), counts.ejected());
        assert_eq!(scanned(|e| e.is_healthy()), counts.healthy());
    }
}

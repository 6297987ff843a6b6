//! The set of endpoints requests may go to, published as an immutable snapshot.
//!
//! Discovery writes (rarely, under a small lock); the request path only loads the current snapshot
//! (`ArcSwap`, no lock, no reference-count traffic for the load itself). An update keeps the very same
//! `Endpoint` (and so its live state: outstanding count, later health and breaker) for every endpoint
//! whose URL and weight did not change. An endpoint that leaves is marked draining; requests already on it
//! hold their own reference and finish normally, and the registry keeps a weak reference to it so that
//! what it still holds shows (see [`Registry::departing`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Weak};

use arc_swap::ArcSwap;

use crate::config::EndpointUrl;
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
    /// What each discovery source wants and where each URL's endpoint sits in the snapshot. The lock
    /// also serialises writers so two updates cannot interleave their read-modify-publish.
    writer: Mutex<Wanted>,
    /// Concurrency limits every endpoint gets.
    limits: Mutex<LimitSettings>,
    /// Handed to every endpoint: wakes whoever waits for this registry's slots.
    slot_freed: SlotFreed,
    /// Ejected, healthy and up endpoints in the set, kept by the endpoints as they change.
    counts: Arc<FleetCounts>,
    /// Endpoints that left the set, while requests may still be on them (see [`Registry::departing`]).
    departed: Mutex<Vec<Weak<Endpoint>>>,
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
            writer: Mutex::new(Wanted::default()),
            limits: Mutex::new(LimitSettings::none()),
            slot_freed,
            counts: Arc::default(),
            departed: Mutex::default(),
        }
    }

    /// `queued` requests plus those outstanding here, and the capacity the limits allow.
    pub fn demand(&self, queued: usize) -> Demand {
        let snapshot = self.snapshot.load();
        let mut outstanding = 0u64;
        let mut capacity = Some(0u64);
        let mut endpoints = 0u64;
        for endpoint in self.departing(&snapshot) {
            outstanding += endpoint.outstanding();
        }
        for endpoint in snapshot.iter() {
            outstanding += endpoint.outstanding();
            if endpoint.liveness().is_available() {
                endpoints += 1;
                capacity = capacity
                    .zip(endpoint.load().limit())
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
            endpoint.load().apply_limit(&settings, now);
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

    /// Endpoints that left the set and still hold requests (a deleted pod's streams until they end or
    /// move), as seen beside `set`, the snapshot the caller read: those whose URL is in `set` are left
    /// out (so no endpoint counts twice, whichever snapshot the caller got), and of two with one URL
    /// only the later. What `/debug/endpoints` and the metrics show as draining besides the set. Those
    /// that hold nothing any more are forgotten here.
    pub fn departing(&self, set: &[Arc<Endpoint>]) -> Vec<Arc<Endpoint>> {
        let mut departed = self.departed.lock().unwrap_or_else(|p| p.into_inner());
        let mut holding = Vec::new();
        departed.retain(|weak| match weak.upgrade() {
            Some(endpoint) if endpoint.outstanding() > 0 => {
                holding.push(endpoint);
                true
            }
            _ => false,
        });
        drop(departed);
        if holding.is_empty() {
            return holding;
        }
        // One pass over the set, whatever its size: the departing are few.
        let mut seen: std::collections::HashSet<&str> = set.iter().map(|e| e.url()).collect();
        let mut kept: Vec<Arc<Endpoint>> = holding
            .iter()
            .rev()
            .filter(|endpoint| seen.insert(endpoint.url()))
            .cloned()
            .collect();
        kept.reverse();
        kept
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
        let mut wanted = self.lock_writer();
        let mut touched = wanted.drop_source(source);
        touched.extend(desired.iter().map(|spec| spec.url.clone()));
        for spec in desired {
            wanted.claim(source, spec);
        }
        self.publish(&mut wanted, &touched);
    }

    /// Changes one source by a few endpoints: those with the `removed` URLs leave it, then the `added`
    /// join it in order (replacing one with the same URL). Only the URLs named are looked at, so a pod
    /// event among thousands of pods costs the same as among ten.
    pub fn update_source(
        &self,
        source: &'static str,
        removed: &[String],
        added: Vec<EndpointSpec>,
    ) {
        let mut wanted = self.lock_writer();
        let mut touched: Vec<String> = removed.to_vec();
        for url in removed {
            wanted.unclaim(source, url);
        }
        touched.extend(added.iter().map(|spec| spec.url.clone()));
        for spec in added {
            wanted.claim(source, spec);
        }
        self.publish(&mut wanted, &touched);
    }

    /// The endpoint at `url` in the set now, found through the sources' index (no scan).
    pub fn endpoint_at(&self, url: &str) -> Option<Arc<Endpoint>> {
        let place = self.lock_writer().by_url.get(url)?.place?;
        self.snapshot()
            .get(place)
            .filter(|endpoint| endpoint.url() == url)
            .cloned()
    }

    /// Marks an endpoint that left the set; requests on it finish, and it shows among the
    /// [`departing`](Registry::departing) while they do.
    fn drained(&self, gone: &Arc<Endpoint>) {
        gone.set_draining(true);
        tracing::info!(
            endpoint = gone.url(),
            outstanding = gone.outstanding(),
            "endpoint removed; draining"
        );
        if gone.outstanding() > 0 {
            let mut departed = self.departed.lock().unwrap_or_else(|p| p.into_inner());
            // Those that hold nothing any more go first, so the list stays as long as what is in flight.
            departed.retain(|weak| weak.upgrade().is_some_and(|e| e.outstanding() > 0));
            departed.push(Arc::downgrade(gone));
        }
    }

    fn lock_writer(&self) -> std::sync::MutexGuard<'_, Wanted> {
        self.writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Brings the endpoints of the `touched` URLs in line with what the sources now want and publishes
    /// the result: the current snapshot with only those places changed. An endpoint that leaves gives
    /// its place to the last one, so no other endpoint moves far or is looked at.
    ///
    /// The new snapshot is built in the spare copy of the current one when there is one, so an update
    /// neither copies the set nor drops a copy of it: both touch every endpoint's reference count,
    /// which at 10,000 endpoints was most of what was left of a pod event's cost.
    fn publish(&self, wanted: &mut Wanted, touched: &[String]) {
        let current = self.snapshot.load_full();
        let mut next: Option<Vec<Arc<Endpoint>>> = None;
        let mut edits = Vec::new();
        let settings = self.limits();
        let now = tokio::time::Instant::now();
        for url in touched {
            let Some(claim) = wanted.by_url.get(url.as_str()) else {
                continue;
            };
            let place = claim.place;
            let existing = place.map(|at| &next.as_deref().unwrap_or(current.as_slice())[at]);
            let fresh = match (existing, claim.specs.first()) {
                (Some(existing), Some((_, spec)))
                    if (existing.weight(), existing.origin()) == (spec.weight, &spec.origin) =>
                {
                    continue;
                }
                (None, None) => {
                    wanted.by_url.remove(url.as_str());
                    continue;
                }
                (_, served) => {
                    served.map(|(_, spec)| self.endpoint(spec, &settings, now, !current.is_empty()))
                }
            };
            let endpoints = next.get_or_insert_with(|| {
                wanted
                    .spare
                    .take()
                    .unwrap_or_else(|| current.as_ref().clone())
            });
            match (place, fresh) {
                (Some(at), Some(fresh)) => {
                    edits.push(Edit::Set(at, Arc::clone(&fresh)));
                    let gone = std::mem::replace(&mut endpoints[at], fresh);
                    self.drained(&gone);
                }
                (None, Some(fresh)) => {
                    if let Some(claim) = wanted.by_url.get_mut(url.as_str()) {
                        claim.place = Some(endpoints.len());
                    }
                    edits.push(Edit::Push(Arc::clone(&fresh)));
                    endpoints.push(fresh);
                }
                (Some(at), None) => {
                    wanted.by_url.remove(url.as_str());
                    edits.push(Edit::SwapRemove(at));
                    self.drained(&endpoints.swap_remove(at));
                    if let Some(moved) = endpoints.get(at)
                        && let Some(claim) = wanted.by_url.get_mut(moved.url())
                    {
                        claim.place = Some(at);
                    }
                }
                (None, None) => {}
            }
        }
        let Some(next) = next else {
            return;
        };
        let published = self.snapshot.swap(Arc::new(next));
        drop(current);
        // The snapshot just replaced becomes the spare once it has caught up, unless a reader still
        // holds it (then it is theirs to drop, and the next update copies).
        wanted.spare = Arc::try_unwrap(published).ok().map(|mut spare| {
            for edit in edits {
                edit.apply(&mut spare);
            }
            spare
        });
        self.changes.send_modify(|version| *version += 1);
        // New endpoints may have room for whoever waits.
        self.slot_freed.call();
    }

    /// A new endpoint for `spec`, counted in this registry and limited as its endpoints are.
    fn endpoint(
        &self,
        spec: &EndpointSpec,
        settings: &LimitSettings,
        now: tokio::time::Instant,
        serving: bool,
    ) -> Arc<Endpoint> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let endpoint = Endpoint::new(id, &spec.url, spec.parsed.clone(), spec.weight)
            .with_origin(&spec.origin);
        endpoint.load().apply_limit(settings, now);
        // The first set starts together; an endpoint joining a serving set ramps in.
        if serving {
            endpoint.start_slow_start(now);
        }
        endpoint.load().set_slot_freed(self.slot_freed.clone());
        endpoint.count_in(Arc::clone(&self.counts));
        tracing::debug!(
            endpoint = endpoint.url(),
            weight = endpoint.weight(),
            "endpoint in service"
        );
        Arc::new(endpoint)
    }
}

/// One change made to the snapshot, made again to the spare copy.
enum Edit {
    Set(usize, Arc<Endpoint>),
    Push(Arc<Endpoint>),
    SwapRemove(usize),
}

impl Edit {
    fn apply(self, endpoints: &mut Vec<Arc<Endpoint>>) {
        match self {
            Edit::Set(at, endpoint) => endpoints[at] = endpoint,
            Edit::Push(endpoint) => endpoints.push(endpoint),
            Edit::SwapRemove(at) => {
                endpoints.swap_remove(at);
            }
        }
    }
}

/// What the sources want, indexed by URL (who wants it, where its endpoint is) so that an update finds
/// what it changes without a scan. URLs are hashed with a fast hash: with thousands of pods every pod
/// event looks a few of them up.
#[derive(Default)]
struct Wanted {
    by_url: HashMap<String, Claim, foldhash::fast::RandomState>,
    /// A copy of the published snapshot that no reader holds, to build the next one in.
    spare: Option<Vec<Arc<Endpoint>>>,
}

/// One URL: the sources that want it and where its endpoint is in the snapshot.
#[derive(Default)]
struct Claim {
    /// Each source wanting the URL with its spec, in source name order: the first one's is served.
    specs: Vec<(&'static str, EndpointSpec)>,
    /// The endpoint's index in the snapshot, once it has one.
    place: Option<usize>,
}

impl Wanted {
    /// `source` wants `spec` (in place of what it wanted at that URL); its endpoint says it came from
    /// `source`.
    fn claim(&mut self, source: &'static str, mut spec: EndpointSpec) {
        spec.origin.source = source;
        let specs = &mut self.by_url.entry(spec.url.clone()).or_default().specs;
        // Almost every URL has one source: room for one, not the four a first push makes.
        specs.reserve_exact(1);
        match specs.binary_search_by(|(name, _)| name.cmp(&source)) {
            Ok(at) => specs[at].1 = spec,
            Err(at) => specs.insert(at, (source, spec)),
        }
    }

    /// `source` no longer wants `url`. The URL's entry stays until [`Registry::publish`] has taken
    /// its endpoint out.
    fn unclaim(&mut self, source: &'static str, url: &str) {
        if let Some(claim) = self.by_url.get_mut(url) {
            claim.specs.retain(|(name, _)| *name != source);
        }
    }

    /// `source` wants nothing any more; the URLs it wanted. A scan, as replacing a source whole (a
    /// list, a reload) is one anyway.
    fn drop_source(&mut self, source: &'static str) -> Vec<String> {
        let mut urls = Vec::new();
        for (url, claim) in &mut self.by_url {
            let before = claim.specs.len();
            claim.specs.retain(|(name, _)| *name != source);
            if claim.specs.len() != before {
                urls.push(url.clone());
            }
        }
        urls
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

    /// The endpoint serving `url` now, if any.
    fn serving(registry: &Registry, url: &str) -> Option<Arc<Endpoint>> {
        registry
            .snapshot()
            .iter()
            .find(|endpoint| endpoint.url() == url)
            .cloned()
    }

    fn urls(registry: &Registry) -> Vec<String> {
        let mut urls: Vec<_> = registry
            .snapshot()
            .iter()
            .map(|e| e.url().to_owned())
            .collect();
        urls.sort();
        urls
    }

    #[test]
    fn updates_change_one_source_by_a_few_endpoints() {
        let registry = Registry::default();
        registry.replace(vec![spec("http://shared:1", 1)]);
        registry.set_source("pods", vec![spec("http://a:1", 1), spec("http://b:1", 1)]);
        let a = serving(&registry, "http://a:1").unwrap();
        let shared = serving(&registry, "http://shared:1").unwrap();
        registry.update_source(
            "pods",
            &["http://b:1".to_owned()],
            vec![
                spec("http://c:1", 1),
                spec("http://a:1", 1),
                spec("http://shared:1", 2),
            ],
        );
        // A URL two sources want is one endpoint; a was replaced by an equal spec, so it is the same
        // endpoint with its state.
        assert_eq!(
            urls(&registry),
            ["http://a:1", "http://c:1", "http://shared:1"]
        );
        assert!(Arc::ptr_eq(&serving(&registry, "http://a:1").unwrap(), &a));
        // Both sources want `shared`: the first in name order ("pods") is served.
        assert_eq!(serving(&registry, "http://shared:1").unwrap().weight(), 2);
        assert!(!shared.liveness().is_available());
        registry.update_source(
            "pods",
            &["http://a:1".to_owned(), "http://shared:1".to_owned()],
            vec![spec("http://c:1", 4)],
        );
        assert!(!a.liveness().is_available(), "a left and drains");
        assert_eq!(urls(&registry), ["http://c:1", "http://shared:1"]);
        assert_eq!(serving(&registry, "http://c:1").unwrap().weight(), 4);
        // The pods no longer want `shared`; the static list still does.
        assert_eq!(serving(&registry, "http://shared:1").unwrap().weight(), 1);
        // Each endpoint says which source it came from, whatever its spec said.
        assert_eq!(serving(&registry, "http://c:1").unwrap().source(), "pods");
        assert_eq!(
            serving(&registry, "http://shared:1").unwrap().source(),
            "static"
        );
    }

    #[test]
    fn an_update_touches_only_the_endpoints_it_names() {
        let registry = Registry::default();
        let all: Vec<String> = (0..50).map(|i| format!("http://10.0.0.{i}:8000")).collect();
        registry.set_source("pods", all.iter().map(|url| spec(url, 1)).collect());
        let before: Vec<Arc<Endpoint>> = registry.snapshot().iter().cloned().collect();
        let held: Vec<_> = before.iter().map(|e| e.start_request()).collect();
        // Leaving from the middle, the front and the back, one joining, one changing its weight.
        let leaving = [&all[0], &all[17], &all[49]].map(|url| url.to_owned());
        registry.update_source(
            "pods",
            &leaving,
            vec![spec("http://10.0.0.99:8000", 1), spec(&all[30], 2)],
        );
        let snapshot = registry.snapshot();
        assert_eq!(snapshot.len(), 48);
        for endpoint in &before {
            let now = serving(&registry, endpoint.url());
            if leaving.iter().any(|url| url == endpoint.url()) {
                assert!(
                    now.is_none() && !endpoint.liveness().is_available(),
                    "{}",
                    endpoint.url()
                );
            } else if endpoint.url() == all[30] {
                let now = now.unwrap();
                assert_eq!(now.weight(), 2);
                assert_ne!(now.id(), endpoint.id());
            } else {
                let now = now.unwrap();
                assert!(Arc::ptr_eq(&now, endpoint), "{} kept", endpoint.url());
                assert_eq!(now.outstanding(), 1);
            }
        }
        // Endpoints that moved into a leaver's place are still found by later updates.
        for url in &all[40..49] {
            registry.update_source("pods", std::slice::from_ref(url), Vec::new());
        }
        registry.update_source("pods", &[], vec![spec(&all[48], 3)]);
        assert_eq!(snapshot.len(), 48, "a snapshot once loaded never changes");
        assert_eq!(registry.snapshot().len(), 40);
        assert_eq!(serving(&registry, &all[48]).unwrap().weight(), 3);
        let counts = registry.counts();
        assert_eq!((counts.healthy(), counts.up()), (40, 40));
        // Replacing the source whole takes out what it no longer names, and only that.
        let kept = serving(&registry, &all[5]).unwrap();
        registry.set_source("pods", vec![spec(&all[5], 1)]);
        assert_eq!(urls(&registry), [all[5].clone()]);
        assert!(Arc::ptr_eq(&registry.snapshot()[0], &kept));
        assert_eq!((counts.healthy(), counts.up()), (1, 1));
        drop(held);
    }

    #[test]
    fn snapshots_built_in_the_spare_copy_match_what_the_sources_want() {
        let registry = Registry::default();
        let url = |i: usize| format!("http://10.0.1.{i}:8000");
        let mut model: HashMap<String, u32> = HashMap::new();
        let mut rng = fastrand::Rng::with_seed(21);
        let mut held = Vec::new();
        for round in 0..300 {
            let removed: Vec<String> = (0..rng.usize(0..3))
                .map(|_| url(rng.usize(0..40)))
                .collect();
            let added: Vec<EndpointSpec> = (0..rng.usize(0..3))
                .map(|_| spec(&url(rng.usize(0..40)), rng.u32(1..3)))
                .collect();
            for gone in &removed {
                model.remove(gone);
            }
            for spec in &added {
                model.insert(spec.url.clone(), spec.weight);
            }
            // Now and then a reader holds a snapshot across updates: the next one is a copy.
            if round % 7 == 0 {
                held.push(registry.snapshot_full());
            }
            if round % 11 == 0 {
                held.clear();
            }
            registry.update_source("pods", &removed, added);
            let mut now: Vec<(String, u32)> = registry
                .snapshot()
                .iter()
                .map(|e| (e.url().to_owned(), e.weight()))
                .collect();
            now.sort();
            let mut wanted: Vec<(String, u32)> = model.clone().into_iter().collect();
            wanted.sort();
            assert_eq!(now, wanted, "round {round}");
            let counts = registry.counts();
            assert_eq!(counts.up(), model.len(), "round {round}");
        }
    }

    #[test]
    fn an_endpoint_that_leaves_is_let_go_at_once_when_no_reader_holds_it() {
        let registry = Registry::default();
        registry.replace(vec![spec("http://a:1", 1), spec("http://b:1", 1)]);
        registry.update_source("static", &[], vec![spec("http://c:1", 1)]);
        let a = serving(&registry, "http://a:1").unwrap();
        registry.update_source("static", &["http://a:1".to_owned()], Vec::new());
        assert_eq!(
            Arc::strong_count(&a),
            1,
            "neither the snapshot nor its spare holds it"
        );
        assert_eq!(urls(&registry), ["http://b:1", "http://c:1"]);
    }

    #[test]
    fn an_endpoint_that_leaves_with_requests_on_it_shows_until_they_end() {
        let registry = Registry::default();
        registry.replace(vec![
            spec("http://a:1", 1),
            spec("http://b:1", 1),
            spec("http://c:1", 1),
        ]);
        let a = serving(&registry, "http://a:1").unwrap();
        let held = [a.start_request(), a.start_request()];
        let b = serving(&registry, "http://b:1").unwrap();
        let on_b = b.start_request();
        drop(b);
        registry.replace(vec![spec("http://c:1", 1)]);
        let departing = registry.departing(&registry.snapshot());
        let mut departing: Vec<&str> = departing.iter().map(|e| e.url()).collect();
        departing.sort_unstable();
        assert_eq!(departing, ["http://a:1", "http://b:1"]);
        assert_eq!(registry.demand(0).outstanding, 3, "their requests count");
        assert_eq!(registry.demand(0).endpoints, 1);
        assert!(!a.liveness().is_available());

        // b's request ends: b is forgotten, and nothing keeps it alive.
        drop(on_b);
        let departing = registry.departing(&registry.snapshot());
        assert_eq!(departing.len(), 1);
        assert!(Arc::ptr_eq(&departing[0], &a));
        drop(departing);
        // a's URL back in the set: the new endpoint shows, not the old one still finishing.
        registry.replace(vec![spec("http://a:1", 1), spec("http://c:1", 1)]);
        assert!(registry.departing(&registry.snapshot()).is_empty());
        let new_a = serving(&registry, "http://a:1").unwrap();
        let on_new_a = new_a.start_request();
        // A reader that still holds the set from before a's removal counts a once, in that set.
        let before = registry.snapshot_full();
        registry.replace(vec![spec("http://c:1", 1)]);
        assert!(registry.departing(&before).is_empty());
        // Two departed endpoints of one URL show once: the later.
        let departing = registry.departing(&registry.snapshot());
        assert_eq!(departing.len(), 1);
        assert!(Arc::ptr_eq(&departing[0], &new_a));
        drop(departing);
        drop((held, on_new_a));
        assert!(
            registry.departing(&registry.snapshot()).is_empty(),
            "nothing is left on either a"
        );
    }

    #[test]
    fn an_update_that_changes_nothing_publishes_nothing() {
        let registry = Registry::default();
        registry.replace(vec![spec("http://a:1", 1)]);
        let changes = registry.subscribe();
        let version = *changes.borrow();
        registry.update_source("static", &[], vec![spec("http://a:1", 1)]);
        registry.update_source("static", &["http://gone:1".to_owned()], Vec::new());
        assert_eq!(*changes.borrow(), version);
        registry.update_source("static", &["http://a:1".to_owned()], Vec::new());
        assert_eq!(*changes.borrow(), version + 1);
        assert!(registry.snapshot().is_empty());
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
        assert!(!old.liveness().is_available());
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
            a.breaker().record_failure(&breaker, now, true);
        }
        assert!(a.breaker().is_ejected());
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
        assert_eq!(scanned(|e| e.breaker().is_ejected()), counts.ejected());
        assert_eq!(scanned(|e| e.liveness().is_healthy()), counts.healthy());
    }
}

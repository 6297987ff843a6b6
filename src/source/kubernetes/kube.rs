//! A pool's pod discovery: keeps the pool's registry `kubernetes` source equal to the pods that
//! qualify.
//!
//! The pods come from a watch the pool shares with every pool that watches the same namespace through
//! the same API server and field selector ([`super::hub`]); each pool keeps its own [`Tracker`] (its
//! rules, counts and registry source) and sees only the pods its own label selector picks. kube-runtime's
//! watcher lists, then watches from the list's resourceVersion; on a dropped connection it resumes, and
//! on `410 Gone` (or any error) it lists again, with backoff. A list arrives as `Init`, `InitApply`…,
//! `InitDone` and is applied as one atomic reset at `InitDone`: until then the endpoints in service stay
//! (stale beats empty — a GPU node that was serving a second ago most likely still is, and heartbeats
//! catch the ones that are not). Events that arrive together are applied as one batch and published
//! once.
//!
//! SaladCloud pods need their gateway host from the SaladCloud API: lookups run in the pool's task
//! beside the watch ([`super::lookups`]), are cached by pod UID (and kept across a restart of the
//! watch), and are optionally written back into the pod's URL annotation. The hosts found are the
//! gateways the SaladCloud key may go to ([`GatewayKey::confirm`]): a gateway named only by an
//! annotation gets no key.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::runtime::watcher::Event;
use tokio_util::sync::CancellationToken;

use super::Status;
use super::hub::{Hubs, Member};
use super::lookups::{Lookups, write_back};
use super::object::WatchedPod;
use super::pods::{Derived, PodFacts, PodState, Rules};
use super::salad::SaladApi;
use crate::config::KubernetesConfig;
use crate::endpoint::Announcer;
use crate::registry::{EndpointSpec, Registry};
use crate::upstream::GatewayKey;

/// The registry source this module writes.
pub const SOURCE: &str = "kubernetes";

/// The watch in force, shared with registration.
pub struct Watched {
    pub client: kube::Client,
    pub rules: Arc<Rules>,
    pub tracker: Mutex<Tracker>,
}

impl Watched {
    pub(crate) fn tracker(&self) -> std::sync::MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Tracked {
    facts: PodFacts,
    derived: Derived,
}

/// The pods watched and what the rules made of them.
pub struct Tracker {
    rules: Arc<Rules>,
    /// By `namespace/name`, in order, so the endpoints come out in a stable order without a sort.
    pods: BTreeMap<Arc<str>, Tracked>,
    /// A list in progress (between `Init` and `InitDone`).
    relist: Option<HashMap<Arc<str>, PodFacts>>,
    /// Gateway hosts found through the SaladCloud API, by pod UID.
    gateways: HashMap<String, String>,
    /// `gateways` changed since [`Tracker::take_gateway_hosts`] last read it.
    gateways_changed: bool,
    /// What changed in the endpoints since the registry last heard.
    changes: Changes,
    /// Pods by [`PodState`], kept as pods come and go (a count over thousands on every event would
    /// cost more than the event).
    counts: [u64; 3],
}

/// Endpoint changes not yet published: after a list, the whole set; after events, only what they
/// changed, so one pod event among thousands costs the registry a few specs, not all of them.
#[derive(Debug, Default)]
pub struct Changes {
    /// A list replaced the set: publish all of it.
    pub full: bool,
    /// URLs of endpoints that left.
    pub removed: Vec<String>,
    /// Endpoints that joined or changed.
    pub added: Vec<EndpointSpec>,
    /// URLs of endpoints that left because their pod is being deleted or its node said it is going,
    /// with when it goes (Unix milliseconds; a time past: at once): their streams move before then
    /// (see [`Outlet::publish`]).
    pub leaving: Vec<(String, Option<i64>)>,
}

impl Changes {
    /// The endpoint at `url` left. The registry takes removals before additions, so one added earlier
    /// in the same batch (a pod created and deleted between two publications) is taken back here.
    fn leave(&mut self, url: String) {
        self.added.retain(|spec| spec.url != url);
        self.removed.push(url);
    }
}

impl Tracker {
    pub fn new(rules: Arc<Rules>) -> Tracker {
        Tracker::with_gateways(rules, HashMap::new())
    }

    /// A tracker that already knows these gateway hosts (by pod UID), found by an earlier watch: the
    /// SaladCloud API's answers do not depend on discovery's settings, and the first list drops those
    /// of pods that are gone.
    pub fn with_gateways(rules: Arc<Rules>, gateways: HashMap<String, String>) -> Tracker {
        Tracker {
            rules,
            pods: BTreeMap::new(),
            relist: None,
            gateways_changed: true,
            gateways,
            changes: Changes::default(),
            counts: [0; 3],
        }
    }

    /// The gateway host the SaladCloud API gave for the pod with `uid`.
    pub fn gateway(&self, uid: &str) -> Option<&str> {
        self.gateways.get(uid).map(String::as_str)
    }

    /// Every gateway host the SaladCloud API gave for a pod watched now, if they changed since the
    /// last call.
    pub fn take_gateway_hosts(&mut self) -> Option<HashSet<String>> {
        std::mem::take(&mut self.gateways_changed)
            .then(|| self.gateways.values().cloned().collect())
    }

    fn count(&mut self, state: PodState, delta: i64) {
        let index = PodState::ALL.iter().position(|s| *s == state).unwrap_or(0);
        self.counts[index] = self.counts[index].saturating_add_signed(delta);
    }

    /// The changes since the last call.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// Applies one watcher event; true when the endpoints may have changed.
    pub fn on_event(&mut self, event: &Event<WatchedPod>, status: &Status) -> bool {
        match event {
            Event::Init => {
                self.relist = Some(HashMap::new());
                false
            }
            Event::InitApply(pod) => {
                let facts = PodFacts::from_pod(pod, self.rules.config());
                self.relist
                    .get_or_insert_with(HashMap::new)
                    .insert(Arc::clone(&facts.key), facts);
                false
            }
            Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                let mut previous = std::mem::take(&mut self.pods);
                self.counts = [0; 3];
                for previous_pod in previous.keys() {
                    if !listed.contains_key(previous_pod) {
                        tracing::info!(pod = %previous_pod, "pod gone while the watch was down");
                    }
                }
                // The whole set is published; no need to note each pod's change on the way.
                self.changes = Changes {
                    full: true,
                    ..Changes::default()
                };
                for (key, facts) in listed {
                    let before = previous.remove(&key);
                    self.track(facts, before.as_ref(), status);
                }
                let uids: HashSet<&str> =
                    self.pods.values().map(|t| t.facts.uid.as_str()).collect();
                let known = self.gateways.len();
                self.gateways.retain(|uid, _| uids.contains(uid.as_str()));
                self.gateways_changed |= self.gateways.len() != known;
                status.listed();
                true
            }
            Event::Apply(pod) => {
                let facts = PodFacts::from_pod(pod, self.rules.config());
                let before = self.pods.remove(&facts.key);
                if before.as_ref().is_some_and(|b| b.facts == facts) {
                    // Nothing tongs reads changed (a status heartbeat, a label tongs ignores).
                    if let Some(before) = before {
                        self.pods.insert(Arc::clone(&before.facts.key), before);
                    }
                    return false;
                }
                if let Some(before) = &before {
                    self.count(before.derived.state, -1);
                }
                self.track(facts, before.as_ref(), status);
                true
            }
            Event::Delete(pod) => self.forget(pod, "pod deleted"),
        }
    }

    /// Drops `pod` (deleted, or no longer picked by the pool's label selector, as `why` says); true
    /// when it was tracked. Only its key is read: most pods a shared watch hands a pool that does not
    /// pick them were never tracked by it.
    pub fn forget(&mut self, pod: &WatchedPod, why: &'static str) -> bool {
        let meta = &pod.metadata;
        let key = format!(
            "{}/{}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default()
        );
        match self.pods.remove(key.as_str()) {
            Some(gone) => {
                self.count(gone.derived.state, -1);
                self.gateways_changed |= self.gateways.remove(&gone.facts.uid).is_some();
                if let Some(spec) = gone.derived.spec {
                    self.changes.leave(spec.url);
                }
                tracing::info!(pod = %gone.facts.key, "{why}");
                true
            }
            None => false,
        }
    }

    fn track(&mut self, facts: PodFacts, before: Option<&Tracked>, status: &Status) {
        let gateway = self.gateways.get(&facts.uid).map(String::as_str);
        let derived = self.rules.derive(&facts, gateway);
        let same_pod = before.filter(|b| b.facts.uid == facts.uid);
        for rejection in &derived.rejections {
            // Logged and counted once per pod, not on every event that repeats it.
            if !same_pod.is_some_and(|b| b.derived.rejections.contains(rejection)) {
                tracing::warn!(
                    pod = %facts.key,
                    reason = rejection.reason.as_str(),
                    "{}",
                    rejection.detail
                );
                status.rejected(rejection.reason);
            }
        }
        let was = same_pod.map(|b| (b.derived.state, b.derived.spec.as_ref().map(|s| &s.url)));
        let now = (derived.state, derived.spec.as_ref().map(|s| &s.url));
        if was != Some(now) {
            match &derived.spec {
                Some(spec) => tracing::info!(
                    pod = %facts.key,
                    endpoint = %spec.url,
                    rule = derived.rule.map_or("", |r| r.name()),
                    "pod serving"
                ),
                None => tracing::info!(
                    pod = %facts.key,
                    phase = %facts.phase,
                    ready = facts.ready,
                    terminating = facts.terminating,
                    state = derived.state.as_str(),
                    "pod not serving"
                ),
            }
        }
        let old_spec = before.and_then(|b| b.derived.spec.as_ref());
        if old_spec != derived.spec.as_ref() && !self.changes.full {
            if let Some(old) = old_spec {
                if derived.spec.is_none() && (facts.terminating || facts.drain_at_ms.is_some()) {
                    // A deleted pod's node may go at once (a virtual kubelet stops it then) unless its
                    // grace period is trusted: a time long past says so, and wins over any later time
                    // the node itself gave. A drain annotation is the node's own word.
                    let at = match (facts.deleting_at_ms, facts.drain_at_ms) {
                        (Some(_), _) if !self.rules.config().trust_grace_period => Some(i64::MIN),
                        (Some(deleting), Some(drain)) => Some(deleting.min(drain)),
                        (deleting, drain) => deleting.or(drain),
                    };
                    self.changes.leaving.push((old.url.clone(), at));
                }
                self.changes.leave(old.url.clone());
            }
            if let Some(new) = &derived.spec {
                self.changes.added.push(new.clone());
            }
        }
        self.count(derived.state, 1);
        self.pods
            .insert(Arc::clone(&facts.key), Tracked { facts, derived });
    }

    /// The endpoints the pods make, in pod order.
    pub fn specs(&self) -> Vec<EndpointSpec> {
        self.pods
            .values()
            .filter_map(|t| t.derived.spec.clone())
            .collect()
    }

    /// Pods by [`PodState`].
    pub fn counts(&self) -> [u64; 3] {
        self.counts
    }

    /// The facts of a watched pod.
    pub fn pod(&self, key: &str) -> Option<&PodFacts> {
        self.pods.get(key).map(|t| &t.facts)
    }

    /// Pods whose salad-api rule waits for a gateway host: key, UID and container group.
    pub(super) fn wanting_lookup(&self) -> impl Iterator<Item = (Arc<str>, String, String)> + '_ {
        self.pods
            .values()
            .filter(|t| t.derived.wants_lookup)
            .map(|t| {
                (
                    Arc::clone(&t.facts.key),
                    t.facts.uid.clone(),
                    t.facts.container_group(),
                )
            })
    }

    /// Records a gateway host found for pod `key` (if it is still the same pod); true when it changed
    /// the endpoints.
    pub(super) fn found_gateway(
        &mut self,
        key: &str,
        uid: &str,
        host: String,
        status: &Status,
    ) -> bool {
        let Some(tracked) = self.pods.remove(key) else {
            return false;
        };
        if tracked.facts.uid != uid {
            self.pods.insert(Arc::clone(&tracked.facts.key), tracked);
            return false;
        }
        self.gateways_changed |= self.gateways.get(uid) != Some(&host);
        self.gateways.insert(uid.to_owned(), host);
        self.count(tracked.derived.state, -1);
        let facts = tracked.facts.clone();
        self.track(facts, Some(&tracked), status);
        true
    }
}

/// Where a pool's tracker publishes: the pool's registry, status and gateway key.
#[derive(Clone)]
pub(super) struct Outlet {
    pub(super) pool: Arc<str>,
    pub(super) registry: Arc<Registry>,
    pub(super) status: Arc<Status>,
    pub(super) gateway_key: Arc<GatewayKey>,
}

impl Outlet {
    /// Hands what changed in `tracker` to the registry, the status and the gateway key.
    pub(super) fn publish(&self, tracker: &mut Tracker) {
        if let Some(hosts) = tracker.take_gateway_hosts() {
            self.gateway_key.confirm(&self.pool, hosts);
        }
        self.status.set_pods(tracker.counts());
        let changes = tracker.take_changes();
        // A pod being deleted announces its endpoint's end, before the endpoint leaves the set: it
        // drains, and its streams that can be continued elsewhere move before the pod goes.
        let (now, unix_now_ms) = (
            tokio::time::Instant::now(),
            k8s_openapi::jiff::Timestamp::now().as_millisecond(),
        );
        for (url, deleting_at_ms) in &changes.leaving {
            if let Some(endpoint) = self.registry.endpoint_at(url) {
                let left = deleting_at_ms.map(|at| {
                    Duration::from_millis(u64::try_from(at.saturating_sub(unix_now_ms)).unwrap_or(0))
                });
                endpoint.set_announced(Announcer::Source, Some(left), now);
            }
        }
        if changes.full {
            self.registry.set_source(SOURCE, tracker.specs());
        } else if !changes.removed.is_empty() || !changes.added.is_empty() {
            self.registry
                .update_source(SOURCE, &changes.removed, changes.added);
        }
    }
}

/// Runs a pool's pod discovery: follows `config` (leaving and joining watch groups when it changes),
/// until `stop`.
pub struct Discovery {
    /// The pool this discovery finds endpoints for.
    pub pool: Arc<str>,
    pub registry: Arc<Registry>,
    pub status: Arc<super::Status>,
    pub salad: Option<SaladApi>,
    /// Told which gateway hosts the SaladCloud API confirmed.
    pub gateway_key: Arc<GatewayKey>,
    /// The pod watches every pool shares.
    pub hubs: Arc<Hubs>,
}

impl Discovery {
    pub async fn run(self, stop: CancellationToken) {
        let status = Arc::clone(&self.status);
        let mut config = status.subscribe();
        loop {
            let current = config.borrow_and_update().clone();
            status.set_enabled(current.enabled);
            if !current.enabled {
                status.set_watched(None);
                self.registry.set_source(SOURCE, Vec::new());
                self.gateway_key.confirm(&self.pool, HashSet::new());
            }
            tokio::select! {
                () = stop.cancelled() => return,
                changed = config.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    tracing::info!(pool = %self.pool, "discovery.kubernetes changed; rejoining the pod watch");
                }
                () = self.watch(&current), if current.enabled => {}
            }
        }
    }

    fn outlet(&self) -> Outlet {
        Outlet {
            pool: Arc::clone(&self.pool),
            registry: Arc::clone(&self.registry),
            status: Arc::clone(&self.status),
            gateway_key: Arc::clone(&self.gateway_key),
        }
    }

    /// Takes the pods `config` picks from its watch group, and looks up their gateways, until
    /// dropped (which leaves the group).
    async fn watch(&self, config: &KubernetesConfig) {
        let status = Arc::clone(&self.status);
        let selector = match super::hub::selector(&config.label_selector) {
            Ok(selector) => selector,
            Err(err) => {
                // Validation refuses such a configuration; this is never reached from a valid one.
                tracing::error!(pool = %self.pool, error = %err, "discovery.kubernetes.label_selector does not parse; no pods");
                return std::future::pending().await;
            }
        };
        let client = super::client::connect(
            config.kubeconfig.as_deref(),
            "discovery.kubernetes.kubeconfig",
        )
        .await;
        let rules = Arc::new(Rules::new(config, self.salad.is_some()));
        let known = status
            .watched()
            .map(|before| before.tracker().gateways.clone())
            .unwrap_or_default();
        let watched = Arc::new(Watched {
            client: client.clone(),
            rules: Arc::clone(&rules),
            tracker: Mutex::new(Tracker::with_gateways(rules, known)),
        });
        status.set_watched(Some(Arc::clone(&watched)));
        let outlet = self.outlet();
        let member = Member::new(Arc::clone(&watched), selector, outlet.clone());
        let _membership = self.hubs.join(config, Arc::clone(&member));
        let mut lookups = Lookups::new(self.salad.clone());
        loop {
            tokio::select! {
                () = member.took_batch() => lookups.start(&watched.tracker()),
                Some(done) = lookups.finished() => {
                    let mut tracker = watched.tracker();
                    if let Some(host) = lookups.settle(&done, &status) {
                        if tracker.found_gateway(&done.key, &done.uid, host.clone(), &status) {
                            outlet.publish(&mut tracker);
                        }
                        if config.write_back {
                            write_back(&client, config, &done, &host);
                        }
                    }
                    lookups.start(&tracker);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, phase: &str) -> WatchedPod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "gpu", "name": name, "uid": format!("uid-{name}")},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap()
    }

    fn tracker() -> Tracker {
        Tracker::new(Arc::new(Rules::new(&KubernetesConfig::default(), false)))
    }

    fn urls(tracker: &Tracker) -> Vec<String> {
        tracker.specs().into_iter().map(|s| s.url).collect()
    }

    #[test]
    fn a_list_is_applied_whole_at_init_done_and_the_old_set_stays_until_then() {
        let status = Status::default();
        let mut tracker = tracker();
        assert!(tracker.on_event(&Event::Apply(pod("a", "10.0.0.1", "Running")), &status));
        assert_eq!(urls(&tracker), ["http://10.0.0.1:8000"]);
        assert!(!tracker.on_event(&Event::Init, &status));
        assert!(!tracker.on_event(&Event::InitApply(pod("b", "10.0.0.2", "Running")), &status));
        // Mid-list: still the old set.
        assert_eq!(urls(&tracker), ["http://10.0.0.1:8000"]);
        assert!(tracker.on_event(&Event::InitDone, &status));
        assert_eq!(urls(&tracker), ["http://10.0.0.2:8000"]);
        assert_eq!(status.lists(), 1);
    }

    #[test]
    fn lifecycle_events_move_pods_in_and_out() {
        let status = Status::default();
        let mut tracker = tracker();
        tracker.on_event(&Event::Apply(pod("a", "10.0.0.1", "Pending")), &status);
        assert!(urls(&tracker).is_empty());
        assert_eq!(tracker.counts(), [0, 1, 0]);
        tracker.on_event(&Event::Apply(pod("a", "10.0.0.1", "Running")), &status);
        assert_eq!(urls(&tracker), ["http://10.0.0.1:8000"]);
        // The same facts again change nothing.
        assert!(!tracker.on_event(&Event::Apply(pod("a", "10.0.0.1", "Running")), &status));
        tracker.on_event(&Event::Apply(pod("a", "10.0.0.1", "Pending")), &status);
        assert!(urls(&tracker).is_empty());
        tracker.on_event(&Event::Apply(pod("a", "10.0.0.1", "Running")), &status);
        assert!(tracker.on_event(&Event::Delete(pod("a", "10.0.0.1", "Running")), &status));
        assert!(urls(&tracker).is_empty());
        assert!(!tracker.on_event(&Event::Delete(pod("a", "10.0.0.1", "Running")), &status));
    }

    #[test]
    fn events_publish_only_what_they_changed() {
        let status = Status::default();
        let mut tracker = tracker();
        tracker.on_event(&Event::Init, &status);
        for name in ["a", "b", "c"] {
            let ip = format!("10.0.0.{}", name.as_bytes()[0] - b'a' + 1);
            tracker.on_event(&Event::InitApply(pod(name, &ip, "Running")), &status);
        }
        tracker.on_event(&Event::InitDone, &status);
        let listed = tracker.take_changes();
        assert!(listed.full && listed.added.is_empty() && listed.removed.is_empty());
        // b goes Pending: one removal.
        tracker.on_event(&Event::Apply(pod("b", "10.0.0.2", "Pending")), &status);
        let changes = tracker.take_changes();
        assert!(!changes.full);
        assert_eq!(changes.removed, ["http://10.0.0.2:8000"]);
        assert!(changes.added.is_empty());
        // c moves: its old address leaves, its new one joins; a is deleted.
        tracker.on_event(&Event::Apply(pod("c", "10.0.0.9", "Running")), &status);
        tracker.on_event(&Event::Delete(pod("a", "10.0.0.1", "Running")), &status);
        let changes = tracker.take_changes();
        assert_eq!(
            changes.removed,
            ["http://10.0.0.3:8000", "http://10.0.0.1:8000"]
        );
        let added: Vec<_> = changes.added.iter().map(|s| s.url.as_str()).collect();
        assert_eq!(added, ["http://10.0.0.9:8000"]);
        assert_eq!(urls(&tracker), ["http://10.0.0.9:8000"]);
        // The running counts agree with a count over the pods: c serving, b not.
        assert_eq!(tracker.counts(), recount(&tracker));
        assert_eq!(tracker.counts(), [1, 1, 0]);
        tracker.on_event(&Event::Init, &status);
        tracker.on_event(&Event::InitApply(pod("b", "10.0.0.2", "Running")), &status);
        tracker.on_event(&Event::InitDone, &status);
        assert_eq!(tracker.counts(), [1, 0, 0]);
        assert_eq!(tracker.counts(), recount(&tracker));
    }

    #[test]
    fn a_pod_being_deleted_or_drained_leaves_with_the_time_it_goes() {
        let status = Status::default();
        let mut tracker = tracker();
        tracker.on_event(&Event::Apply(pod("a", "10.0.0.1", "Running")), &status);
        tracker.on_event(&Event::Apply(pod("b", "10.0.0.2", "Running")), &status);
        tracker.on_event(&Event::Apply(pod("c", "10.0.0.3", "Running")), &status);
        tracker.take_changes();
        // a's deletion was asked for with a 30 s grace period: it goes at its deletionTimestamp.
        let deleting: WatchedPod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "gpu", "name": "a", "uid": "uid-a",
                "deletionTimestamp": "2027-01-15T08:00:30Z", "deletionGracePeriodSeconds": 30},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        tracker.on_event(&Event::Apply(deleting.clone()), &status);
        // b merely goes Pending: it leaves, but nobody said it goes.
        tracker.on_event(&Event::Apply(pod("b", "10.0.0.2", "Pending")), &status);
        // c's node said it goes (POST /v1/nodes/drain wrote its drain annotation).
        let draining: WatchedPod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "gpu", "name": "c", "uid": "uid-c",
                "annotations": {"tongs.dev/drain-at": "2027-01-15T08:00:10Z"}},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.3",
                "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        tracker.on_event(&Event::Apply(draining), &status);
        let changes = tracker.take_changes();
        assert_eq!(
            changes.removed,
            [
                "http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "http://10.0.0.3:8000"
            ]
        );
        assert_eq!(
            changes.leaving,
            [
                ("http://10.0.0.1:8000".to_owned(), Some(i64::MIN)),
                ("http://10.0.0.3:8000".to_owned(), Some(1_800_000_010_000))
            ],
            "a deleted pod may go at once: its grace period is not trusted by default"
        );

        // Where kubelets honour the grace period, a deleted pod goes at its deletionTimestamp.
        let config = KubernetesConfig {
            trust_grace_period: true,
            ..KubernetesConfig::default()
        };
        let mut tracker = Tracker::new(Arc::new(Rules::new(&config, false)));
        tracker.on_event(&Event::Apply(pod("a", "10.0.0.1", "Running")), &status);
        tracker.take_changes();
        tracker.on_event(&Event::Apply(deleting), &status);
        assert_eq!(
            tracker.take_changes().leaving,
            [("http://10.0.0.1:8000".to_owned(), Some(1_800_000_030_000))]
        );
    }

    fn recount(tracker: &Tracker) -> [u64; 3] {
        let mut counts = [0; 3];
        for tracked in tracker.pods.values() {
            let index = PodState::ALL
                .iter()
                .position(|s| *s == tracked.derived.state)
                .unwrap();
            counts[index] += 1;
        }
        counts
    }

    #[test]
    fn rejections_are_counted_once_per_pod() {
        let status = Status::default();
        let mut tracker = tracker();
        let mut bad: WatchedPod = pod("a", "10.0.0.1", "Running");
        bad.metadata.annotations = Some(
            [(
                "tongs.dev/url".to_owned(),
                "https://evil.example".to_owned(),
            )]
            .into(),
        );
        tracker.on_event(&Event::Apply(bad.clone()), &status);
        bad.metadata.labels = Some([("x".to_owned(), "y".to_owned())].into());
        tracker.on_event(&Event::Apply(bad.clone()), &status);
        tracker.on_event(&Event::Init, &status);
        tracker.on_event(&Event::InitApply(bad), &status);
        tracker.on_event(&Event::InitDone, &status);
        let counted: u64 = status.rejections().map(|(_, n)| n).sum();
        assert_eq!(counted, 1);
        // It still serves through its podIP.
        assert_eq!(urls(&tracker), ["http://10.0.0.1:8000"]);
    }

    #[test]
    fn the_confirmed_gateway_hosts_follow_the_pods() {
        let status = Status::default();
        let known = HashMap::from([
            ("uid-a".to_owned(), "a.salad.cloud".to_owned()),
            ("uid-gone".to_owned(), "gone.salad.cloud".to_owned()),
        ]);
        let rules = Arc::new(Rules::new(&KubernetesConfig::default(), true));
        let mut tracker = Tracker::with_gateways(rules, known);
        // What an earlier watch found is kept until the first list says which pods remain.
        tracker.on_event(&Event::Init, &status);
        tracker.on_event(&Event::InitApply(pod("a", "10.0.0.1", "Running")), &status);
        tracker.on_event(&Event::InitDone, &status);
        assert_eq!(tracker.gateway("uid-a"), Some("a.salad.cloud"));
        assert_eq!(
            tracker.take_gateway_hosts(),
            Some(HashSet::from(["a.salad.cloud".to_owned()]))
        );
        assert_eq!(tracker.take_gateway_hosts(), None, "nothing changed since");
        tracker.on_event(&Event::Apply(pod("a", "10.0.0.2", "Running")), &status);
        assert_eq!(tracker.take_gateway_hosts(), None);
        tracker.on_event(&Event::Delete(pod("a", "10.0.0.2", "Running")), &status);
        assert_eq!(tracker.take_gateway_hosts(), Some(HashSet::new()));
    }
}

//! One pod watch for every pool that can share it.
//!
//! Pools whose watches name the same `kubeconfig`, `namespace` and `field_selector` form a watch group,
//! served by one list+watch against the API server (a [`Hub`]) rather than one each: the API server's
//! cost is per watch, and several pools over one fleet's namespace are the common case. Kubernetes label
//! selectors cannot express OR, so the watch asks the API server for the requirements every member's
//! selector has (all of it when they are equal; none at all when they share nothing, which lists every
//! pod of the namespace), and each member is handed only the pods its own selector picks, matched on
//! tongs' side:
//!
//! - an `Apply` of a pod the member's selector does not pick is a `Delete` for that member (a pod
//!   relabelled away from a pool leaves it, and may join another);
//! - an `InitApply` of such a pod is skipped, so the list's `InitDone` drops it.
//!
//! Every batch of events is handed to the members' trackers in the hub's own task, one after the other,
//! so no member can lag behind the watch or miss an event. A pool joining the group restarts the watch
//! (it needs the pods listed; a relist is one atomic reset for the trackers already there, so harmless
//! to them); a pool leaving restarts it only when the others' common selector changes. The last member
//! out stops the watch.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt;
use kube::api::Api;
use kube::core::{Expression, Selector, SelectorExt};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Status;
use super::kube::{Outlet, Tracker, Watched};
use super::object::WatchedPod;
use crate::config::{KubernetesConfig, Requirement, parse_label_selector};

/// Events already waiting are applied together, up to this many.
const BATCH: usize = 1024;

/// The pod watches running, by watch group.
#[derive(Default)]
pub struct Hubs {
    groups: Mutex<HashMap<GroupKey, Arc<Hub>>>,
}

/// What pools must have in common to share a watch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct GroupKey {
    kubeconfig: Option<PathBuf>,
    namespace: String,
    field_selector: String,
}

/// One watch group: its members and the task that watches for them.
struct Hub {
    key: GroupKey,
    members: Mutex<Vec<Arc<Member>>>,
    /// A member joined or left.
    changed: Notify,
    stop: CancellationToken,
}

/// A pool in a watch group: its tracker and where it publishes.
pub(super) struct Member {
    watched: Arc<Watched>,
    selector: Selector,
    outlet: Outlet,
    /// Told after each batch the member took in (its SaladCloud lookups start from it).
    batch: Notify,
    /// Set (under the tracker's lock) when the member leaves: the hub publishes nothing for it after.
    left: AtomicBool,
}

/// A member's place in its group; dropping it leaves the group.
pub(super) struct Membership {
    hubs: Arc<Hubs>,
    hub: Arc<Hub>,
    member: Arc<Member>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Hubs {
    /// Adds `member` to the group of `config` (starting the group's watch if it is the first).
    pub(super) fn join(
        self: &Arc<Self>,
        config: &KubernetesConfig,
        member: Arc<Member>,
    ) -> Membership {
        let key = GroupKey {
            kubeconfig: config.kubeconfig.clone(),
            namespace: config.namespace.clone(),
            field_selector: config.field_selector.clone(),
        };
        let mut groups = lock(&self.groups);
        let mut started = None;
        let hub = groups
            .entry(key.clone())
            .or_insert_with(|| {
                let hub = Arc::new(Hub {
                    key,
                    members: Mutex::default(),
                    changed: Notify::new(),
                    stop: CancellationToken::new(),
                });
                started = Some(Arc::clone(&hub));
                hub
            })
            .clone();
        lock(&hub.members).push(Arc::clone(&member));
        hub.changed.notify_one();
        // Spawned once the member is in, so the watch never starts empty.
        if let Some(hub) = started {
            tokio::spawn(hub.run());
        }
        Membership {
            hubs: Arc::clone(self),
            hub,
            member,
        }
    }

    /// Pod watches running now (one per watch group).
    pub fn watches(&self) -> usize {
        lock(&self.groups).len()
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        {
            // Under the tracker's lock: a batch being handed over now finishes first, none follows.
            let _tracker = self.member.watched.tracker();
            self.member.left.store(true, Ordering::Relaxed);
        }
        let mut groups = lock(&self.hubs.groups);
        let mut members = lock(&self.hub.members);
        members.retain(|m| !Arc::ptr_eq(m, &self.member));
        if members.is_empty() {
            if groups
                .get(&self.hub.key)
                .is_some_and(|hub| Arc::ptr_eq(hub, &self.hub))
            {
                groups.remove(&self.hub.key);
            }
            self.hub.stop.cancel();
        } else {
            self.hub.changed.notify_one();
        }
    }
}

impl Member {
    pub(super) fn new(watched: Arc<Watched>, selector: Selector, outlet: Outlet) -> Arc<Member> {
        Arc::new(Member {
            watched,
            selector,
            outlet,
            batch: Notify::new(),
            left: AtomicBool::new(false),
        })
    }

    /// Resolves once the member has taken in a batch since the last call.
    pub(super) async fn took_batch(&self) {
        self.batch.notified().await;
    }

    /// Applies the events this member's selector lets through, and publishes what changed.
    fn take(&self, events: &[Event<WatchedPod>]) {
        let mut tracker = self.watched.tracker();
        if self.left.load(Ordering::Relaxed) {
            return;
        }
        // The tracker's log lines name the pool they are about (every pool of the group logs here).
        let _pool = tracing::info_span!("discovery", pool = %self.outlet.pool).entered();
        let status = &self.outlet.status;
        let (changed, listed) = take_picked(&mut tracker, &self.selector, events, status);
        if changed {
            self.outlet.publish(&mut tracker);
        }
        if listed && !status.synced() {
            status.set_synced();
            tracing::info!(
                pool = %self.outlet.pool,
                endpoints = tracker.specs().len(),
                "first pod list applied"
            );
        }
        drop(tracker);
        self.batch.notify_one();
    }
}

/// Applies to `tracker` the events as a pool with `selector` sees them: a pod the selector does not
/// pick is gone for the pool (an `Apply` of it a `Delete`; an `InitApply` of it skipped, so the list's
/// `InitDone` drops it). Returns whether the endpoints may have changed, and whether a list ended.
fn take_picked(
    tracker: &mut Tracker,
    selector: &Selector,
    events: &[Event<WatchedPod>],
    status: &Status,
) -> (bool, bool) {
    static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();
    let picks =
        |pod: &WatchedPod| selector.matches(pod.metadata.labels.as_ref().unwrap_or(&NO_LABELS));
    let (mut changed, mut listed) = (false, false);
    for event in events {
        listed |= matches!(event, Event::InitDone);
        changed |= match event {
            Event::Apply(pod) if !picks(pod) => {
                tracker.forget(pod, "pod no longer picked by the pool's label selector")
            }
            Event::InitApply(pod) if !picks(pod) => false,
            event => tracker.on_event(event, status),
        };
    }
    (changed, listed)
}

/// A pool's label selector as kube-core's matcher takes it (the parser is `config`'s: kube-core has
/// none for the string form).
pub(super) fn selector(text: &str) -> Result<Selector, String> {
    let requirements = parse_label_selector(text)?.0;
    Ok(requirements
        .into_iter()
        .map(|requirement| match requirement {
            Requirement::Equal(key, value) => Expression::Equal(key, value),
            Requirement::NotEqual(key, value) => Expression::NotEqual(key, value),
            Requirement::In(key, values) => Expression::In(key, values),
            Requirement::NotIn(key, values) => Expression::NotIn(key, values),
            Requirement::Exists(key) => Expression::Exists(key),
            Requirement::DoesNotExist(key) => Expression::DoesNotExist(key),
        })
        .collect())
}

/// The label selector the API server is asked for: the members' own when they are all equal, else the
/// requirements all of them have (empty: every pod).
fn common_selector(members: &[Arc<Member>]) -> Selector {
    common(&members.iter().map(|m| &m.selector).collect::<Vec<_>>())
}

fn common(selectors: &[&Selector]) -> Selector {
    let Some((first, rest)) = selectors.split_first() else {
        return Selector::default();
    };
    if rest.iter().all(|s| s == first) {
        return (*first).clone();
    }
    let others: Vec<Vec<Expression>> = rest
        .iter()
        .map(|s| (*s).clone().into_iter().collect())
        .collect();
    (*first)
        .clone()
        .into_iter()
        .filter(|e| others.iter().all(|o| o.contains(e)))
        .collect()
}

impl Hub {
    fn members(&self) -> Vec<Arc<Member>> {
        lock(&self.members).clone()
    }

    /// Watches for the members until the last one leaves; restarts the watch when one joins.
    async fn run(self: Arc<Self>) {
        let mut members = self.members();
        loop {
            if members.is_empty() || self.stop.is_cancelled() {
                return;
            }
            let selector = common_selector(&members);
            let client = members[0].watched.client.clone();
            let api: Api<WatchedPod> = match self.key.namespace.as_str() {
                "*" => Api::all(client),
                "" => Api::default_namespaced(client),
                namespace => Api::namespaced(client, namespace),
            };
            let mut watch_config = watcher::Config::default();
            if !selector.selects_all() {
                watch_config = watch_config.labels(&selector.to_string());
            }
            if !self.key.field_selector.is_empty() {
                watch_config = watch_config.fields(&self.key.field_selector);
            }
            let pools: Vec<&str> = members.iter().map(|m| &*m.outlet.pool).collect();
            let namespace = match self.key.namespace.as_str() {
                "" => "(own)",
                namespace => namespace,
            };
            tracing::info!(
                namespace,
                label_selector = %selector,
                field_selector = %self.key.field_selector,
                pools = ?pools,
                "watching pods"
            );
            if selector.selects_all() && members.iter().any(|m| !m.selector.selects_all()) {
                tracing::info!(
                    namespace,
                    pools = ?pools,
                    "the pools' label selectors have no requirement in common: the watch lists every \
                     pod of the namespace, and each pool takes the ones its selector picks"
                );
            }
            let events = watcher::watcher(api, watch_config)
                .default_backoff()
                .ready_chunks(BATCH);
            let mut events = std::pin::pin!(events);
            members = loop {
                tokio::select! {
                    () = self.stop.cancelled() => return,
                    () = self.changed.notified() => {
                        let now = self.members();
                        let joined = now.iter().any(|m| !members.iter().any(|o| Arc::ptr_eq(m, o)));
                        if joined || common_selector(&now) != selector {
                            tracing::info!(namespace, "pools joined or left the pod watch; restarting it");
                            break now;
                        }
                        members = now;
                    }
                    batch = events.next() => {
                        let Some(batch) = batch else { break self.members() };
                        hand_over(&members, batch);
                    }
                }
            };
        }
    }
}

/// Hands one batch of the watch's events to every member.
fn hand_over(members: &[Arc<Member>], batch: Vec<Result<Event<WatchedPod>, watcher::Error>>) {
    let mut events = Vec::with_capacity(batch.len());
    for item in batch {
        match item {
            Ok(event) => events.push(event),
            Err(err) => {
                for member in members {
                    member.outlet.status.watch_error();
                }
                tracing::warn!(
                    error = %err,
                    "pod watch failed; retrying with backoff, endpoints stay in service"
                );
            }
        }
    }
    for member in members {
        member.take(&events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common_of(texts: &[&str]) -> String {
        let selectors: Vec<Selector> = texts.iter().map(|t| selector(t).unwrap()).collect();
        common(&selectors.iter().collect::<Vec<_>>()).to_string()
    }

    fn pod(name: &str, tier: &str) -> WatchedPod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "gpu", "name": name, "uid": format!("uid-{name}"),
                         "labels": {"app": "llm", "tier": tier}},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": "Running", "podIP": format!("10.0.0.{}", name.len()),
                       "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap()
    }

    fn urls(tracker: &Tracker) -> Vec<String> {
        tracker.specs().into_iter().map(|s| s.url).collect()
    }

    #[test]
    fn a_pool_sees_only_the_pods_its_selector_picks() {
        let status = Status::default();
        let rules = Arc::new(crate::source::kubernetes::pods::Rules::new(
            &KubernetesConfig::default(),
            false,
        ));
        let mut tracker = Tracker::new(rules);
        let selector = selector("app=llm,tier=a").unwrap();
        let take = |tracker: &mut Tracker, events: Vec<Event<WatchedPod>>| {
            take_picked(tracker, &selector, &events, &status)
        };
        // A list: the pod of the other tier is skipped.
        let listed = vec![
            Event::Init,
            Event::InitApply(pod("a", "a")),
            Event::InitApply(pod("bb", "b")),
            Event::InitDone,
        ];
        assert_eq!(take(&mut tracker, listed), (true, true));
        assert_eq!(urls(&tracker), ["http://10.0.0.1:8000"]);
        // A pod of the other tier changing is nothing to this pool.
        assert_eq!(
            take(&mut tracker, vec![Event::Apply(pod("bb", "b"))]),
            (false, false)
        );
        // It is relabelled into the pool: it joins; the first is relabelled out: it leaves.
        assert_eq!(
            take(&mut tracker, vec![Event::Apply(pod("bb", "a"))]),
            (true, false)
        );
        assert_eq!(
            take(&mut tracker, vec![Event::Apply(pod("a", "b"))]),
            (true, false)
        );
        assert_eq!(urls(&tracker), ["http://10.0.0.2:8000"]);
        // A list in which the pod no longer matches drops it at InitDone.
        let relisted = vec![
            Event::Init,
            Event::InitApply(pod("bb", "c")),
            Event::InitDone,
        ];
        assert_eq!(take(&mut tracker, relisted), (true, true));
        assert!(urls(&tracker).is_empty());
    }

    #[test]
    fn a_pod_that_comes_and_goes_in_one_batch_leaves_no_endpoint() {
        let status = Status::default();
        let rules = Arc::new(crate::source::kubernetes::pods::Rules::new(
            &KubernetesConfig::default(),
            false,
        ));
        let mut tracker = Tracker::new(rules);
        let selector = selector("app=llm").unwrap();
        let listed = vec![Event::Init, Event::InitDone];
        take_picked(&mut tracker, &selector, &listed, &status);
        tracker.take_changes();
        let batch = vec![Event::Apply(pod("a", "a")), Event::Delete(pod("a", "a"))];
        take_picked(&mut tracker, &selector, &batch, &status);
        let changes = tracker.take_changes();
        assert!(changes.added.is_empty(), "{changes:?}");
        assert_eq!(changes.removed, ["http://10.0.0.1:8000"]);
        // And one that goes and comes back is served.
        let batch = vec![
            Event::Apply(pod("a", "a")),
            Event::Delete(pod("a", "a")),
            Event::Apply(pod("a", "a")),
        ];
        take_picked(&mut tracker, &selector, &batch, &status);
        let changes = tracker.take_changes();
        assert_eq!(changes.added.len(), 1);
    }

    #[test]
    fn the_watch_asks_for_what_every_pool_asks_for() {
        assert_eq!(common_of(&["app=llm,tier=a"]), "app=llm,tier=a");
        assert_eq!(
            common_of(&["app=llm,tier=a", "app=llm,tier=a"]),
            "app=llm,tier=a"
        );
        assert_eq!(common_of(&["app=llm,tier=a", "tier=b,app=llm"]), "app=llm");
        assert_eq!(
            common_of(&["app=llm,!canary", "app=llm,!canary,gpu", "!canary,app=llm"]),
            "app=llm,!canary"
        );
        assert_eq!(
            common_of(&["tier=a", "tier=b"]),
            "",
            "nothing in common: every pod"
        );
        assert_eq!(common_of(&["tier=a", ""]), "");
        assert_eq!(common_of(&[]), "");
    }

    #[test]
    fn what_parses_matches_as_the_api_server_would() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let picked = selector("app=llm,tier in (a,b),!canary").unwrap();
        assert!(picked.matches(&labels(&[("app", "llm"), ("tier", "a")])));
        assert!(!picked.matches(&labels(&[("app", "llm"), ("tier", "c")])));
        assert!(!picked.matches(&labels(&[("app", "llm"), ("tier", "a"), ("canary", "")])));
        assert!(!picked.matches(&labels(&[("tier", "a")])));
        let not = selector("tier notin (a)").unwrap();
        assert!(not.matches(&labels(&[])), "notin holds for a missing label");
    }

    #[test]
    fn the_selector_asked_of_the_api_server_is_the_one_written() {
        for text in [
            "app=llm",
            "a!=b,c in (x,y),!d,e",
            "tongs.dev/pool notin (p)",
        ] {
            let ours = parse_label_selector(text).unwrap().to_string();
            assert_eq!(selector(text).unwrap().to_string(), ours, "{text:?}");
        }
    }
}

//! How many tongs replicas share the fleet: the endpoints of tongs' own Service, from its EndpointSlices.
//!
//! Each replica balances on its own, so a fixed per-node limit held by every replica lets the
//! replicas together send a node that many times the limit. With `replicas.service` set, each replica
//! watches the EndpointSlices the API server keeps for that Service (label
//! `kubernetes.io/service-name`) and publishes the count; the router divides fixed limits by it.
//!
//! What counts as a replica: an endpoint whose `ready` condition is true or unset (the API's "nil
//! means ready"), or that is `serving` while terminating: a replica draining its streams still holds
//! its share of the nodes until it is gone. An endpoint listed in several slices (one per address
//! family in a dual-stack cluster) counts once, by the pod it points to. The count is at least 1: a
//! replica that is starting, or whose watch cannot list, counts itself alone, as without this setting.
//! A failed watch keeps the last count (the watcher retries with backoff) and says why in
//! `/debug/endpoints`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::ReplicasConfig;

/// The label the EndpointSlice controller puts on every slice of a Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The replica count and where it comes from; configured by every reload, watched by [`Replicas::run`].
pub struct Replicas {
    config: watch::Sender<ReplicasConfig>,
    count: watch::Sender<u32>,
    status: Mutex<Watching>,
}

/// The watch's state as operators see it.
#[derive(Clone, Debug, Default)]
struct Watching {
    /// The first list is in.
    listed: bool,
    /// The last error, cleared by the next list or event.
    error: Option<String>,
}

/// The replica count as `/debug/endpoints` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ReplicasView {
    /// Ready replicas (this one included once it is ready); fixed limits are divided by this.
    pub ready: u32,
    /// `namespace/name` of the Service whose EndpointSlices are counted (null: not set, counted as 1).
    pub service: Option<String>,
    /// The first list of the slices is in.
    pub listed: bool,
    /// Why the watch last failed, until it succeeds again.
    pub error: Option<String>,
}

impl Default for Replicas {
    fn default() -> Self {
        Replicas {
            config: watch::channel(ReplicasConfig::default()).0,
            count: watch::channel(1).0,
            status: Mutex::default(),
        }
    }
}

impl Replicas {
    /// Takes a (re)loaded configuration; a changed one restarts the watch.
    pub fn configure(&self, config: &ReplicasConfig) {
        self.config.send_if_modified(|current| {
            let changed = current != config;
            *current = config.clone();
            changed
        });
    }

    /// The replica count now (at least 1).
    pub fn count(&self) -> u32 {
        *self.count.borrow()
    }

    /// Changes of [`Replicas::count`].
    pub fn subscribe(&self) -> watch::Receiver<u32> {
        self.count.subscribe()
    }

    pub fn view(&self) -> ReplicasView {
        let config = self.config.borrow();
        let status = self.lock().clone();
        ReplicasView {
            ready: self.count(),
            service: (!config.service.is_empty()).then(|| {
                let namespace = if config.namespace.is_empty() {
                    "(own)"
                } else {
                    &config.namespace
                };
                format!("{namespace}/{}", config.service)
            }),
            listed: status.listed,
            error: status.error,
        }
    }

    /// Watches the configured Service's slices until `stop`, following configuration changes.
    pub async fn run(&self, stop: CancellationToken) {
        let mut configs = self.config.subscribe();
        loop {
            let config = configs.borrow_and_update().clone();
            *self.lock() = Watching::default();
            if config.service.is_empty() {
                self.publish(1);
            }
            tokio::select! {
                () = stop.cancelled() => return,
                changed = configs.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = self.watch(&config), if !config.service.is_empty() => {}
            }
        }
    }

    /// Lists and watches the slices of `config.service`; returns only if the watch stream ends.
    async fn watch(&self, config: &ReplicasConfig) {
        let client =
            super::client::connect(config.kubeconfig.as_deref(), "replicas.kubeconfig").await;
        let api: Api<EndpointSlice> = match config.namespace.as_str() {
            "" => Api::default_namespaced(client),
            namespace => Api::namespaced(client, namespace),
        };
        let selector = format!("{SERVICE_NAME_LABEL}={}", config.service);
        let events =
            watcher::watcher(api, watcher::Config::default().labels(&selector)).default_backoff();
        let mut events = std::pin::pin!(events);
        let mut slices: BTreeMap<String, EndpointSlice> = BTreeMap::new();
        let mut listing: Option<BTreeMap<String, EndpointSlice>> = None;
        while let Some(event) = events.next().await {
            match event {
                Ok(Event::Init) => listing = Some(BTreeMap::new()),
                Ok(Event::InitApply(slice)) => {
                    if let Some(listing) = listing.as_mut() {
                        listing.insert(key(&slice), slice);
                    }
                }
                Ok(Event::InitDone) => {
                    slices = listing.take().unwrap_or_default();
                    *self.lock() = Watching {
                        listed: true,
                        error: None,
                    };
                    self.publish(ready_replicas(slices.values()));
                }
                Ok(Event::Apply(slice)) => {
                    slices.insert(key(&slice), slice);
                    self.lock().error = None;
                    self.publish(ready_replicas(slices.values()));
                }
                Ok(Event::Delete(slice)) => {
                    slices.remove(&key(&slice));
                    self.lock().error = None;
                    self.publish(ready_replicas(slices.values()));
                }
                Err(err) => {
                    tracing::warn!(
                        service = %config.service,
                        error = %err,
                        "cannot watch tongs' own EndpointSlices; fixed limits stay divided by {}",
                        self.count()
                    );
                    self.lock().error = Some(err.to_string());
                }
            }
        }
    }

    fn publish(&self, count: u32) {
        let count = count.max(1);
        self.count.send_if_modified(|current| {
            let changed = *current != count;
            if changed {
                tracing::info!(replicas = count, "tongs replicas sharing the fleet");
            }
            *current = count;
            changed
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Watching> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn key(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

/// Replicas the slices list as ready or still serving, each once (at least 1).
pub fn ready_replicas<'a>(slices: impl Iterator<Item = &'a EndpointSlice>) -> u32 {
    let mut replicas = BTreeSet::new();
    for slice in slices {
        for endpoint in &slice.endpoints {
            let conditions = endpoint.conditions.as_ref();
            let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
            let serving = conditions.and_then(|c| c.serving).unwrap_or(false);
            if !(ready || serving) {
                continue;
            }
            // The pod it points to; an endpoint without one (a hand-made slice) by its first address.
            let identity = match &endpoint.target_ref {
                Some(target) if target.name.is_some() => format!(
                    "pod {}/{}",
                    target.namespace.as_deref().unwrap_or_default(),
                    target.name.as_deref().unwrap_or_default()
                ),
                _ => format!(
                    "address {}",
                    endpoint.addresses.first().map_or("", String::as_str)
                ),
            };
            replicas.insert(identity);
        }
    }
    u32::try_from(replicas.len()).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(endpoints: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "tongs-abc", "namespace": "tongs"},
            "addressType": "IPv4",
            "endpoints": endpoints,
        }))
        .expect("a valid EndpointSlice")
    }

    fn pod(name: &str, ip: &str, conditions: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "addresses": [ip],
            "conditions": conditions,
            "targetRef": {"kind": "Pod", "namespace": "tongs", "name": name},
        })
    }

    #[test]
    fn counts_ready_and_draining_replicas_once_each() {
        let v4 = slice(serde_json::json!([
            pod("a", "10.0.0.1", serde_json::json!({"ready": true})),
            pod("b", "10.0.0.2", serde_json::json!({})),
            pod(
                "c",
                "10.0.0.3",
                serde_json::json!({"ready": false, "serving": false})
            ),
            pod(
                "d",
                "10.0.0.4",
                serde_json::json!({"ready": false, "serving": true, "terminating": true})
            ),
        ]));
        let v6 = slice(serde_json::json!([
            pod("a", "fd00::1", serde_json::json!({"ready": true})),
            pod("b", "fd00::2", serde_json::json!({"ready": true})),
        ]));
        assert_eq!(
            ready_replicas([&v4].into_iter()),
            3,
            "a, b (nil is ready), d (draining)"
        );
        assert_eq!(
            ready_replicas([&v4, &v6].into_iter()),
            3,
            "each pod once across families"
        );
    }

    #[test]
    fn never_counts_fewer_than_one() {
        assert_eq!(ready_replicas(std::iter::empty()), 1);
        let none_ready = slice(serde_json::json!([pod(
            "a",
            "10.0.0.1",
            serde_json::json!({"ready": false})
        )]));
        assert_eq!(ready_replicas([&none_ready].into_iter()), 1);
    }

    #[test]
    fn endpoints_without_a_pod_count_by_address() {
        let slice = slice(serde_json::json!([
            {"addresses": ["10.0.0.7"]},
            {"addresses": ["10.0.0.8"]},
            {"addresses": ["10.0.0.7"]},
        ]));
        assert_eq!(ready_replicas([&slice].into_iter()), 2);
    }

    #[tokio::test]
    async fn counts_one_until_told_otherwise_and_names_the_service() {
        let replicas = std::sync::Arc::new(Replicas::default());
        assert_eq!(replicas.count(), 1);
        assert_eq!(replicas.view().service, None);
        replicas.configure(&ReplicasConfig {
            service: "tongs".into(),
            namespace: "infer".into(),
            kubeconfig: None,
        });
        assert_eq!(replicas.view().service.as_deref(), Some("infer/tongs"));
        replicas.publish(0);
        assert_eq!(replicas.count(), 1, "published counts are at least 1");
    }
}

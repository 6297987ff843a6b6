//! SaladCloud API lookups of the gateway hosts of a pool's pods, and their write-back into the pods'
//! URL annotation. They run in the pool's own task beside the shared pod watch (see [`super::hub`]),
//! at most [`LOOKUP_CONCURRENCY`] at once, retried with backoff while the group has no gateway yet.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;

use super::Status;
use super::kube::Tracker;
use super::object::WatchedPod;
use super::salad::{Group, LookupError, SaladApi};
use crate::config::KubernetesConfig;

/// SaladCloud API lookups at once.
pub const LOOKUP_CONCURRENCY: usize = 8;
/// Retry delays of a lookup that found no gateway yet: doubling from the first to the last.
const LOOKUP_RETRY_FIRST: Duration = Duration::from_secs(2);
const LOOKUP_RETRY_MAX: Duration = Duration::from_secs(60);

/// Writes the gateway URL into the pod's URL annotation (best effort; the next lookup is not needed
/// either way, the host is cached).
pub(super) fn write_back(
    client: &kube::Client,
    config: &KubernetesConfig,
    done: &LookupDone,
    host: &str,
) {
    let Some((namespace, name)) = done.key.split_once('/') else {
        return;
    };
    let api: Api<WatchedPod> = Api::namespaced(client.clone(), namespace);
    let name = name.to_owned();
    let patch = serde_json::json!({
        "metadata": { "annotations": { config.annotations.url.clone(): format!("https://{host}") } }
    });
    let key = Arc::clone(&done.key);
    tokio::spawn(async move {
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => tracing::info!(pod = %key, "gateway URL written to the pod's annotation"),
            Err(err) => {
                tracing::warn!(pod = %key, error = %err, "cannot write the gateway URL back")
            }
        }
    });
}

/// A finished lookup.
pub(super) struct LookupDone {
    pub(super) key: Arc<str>,
    pub(super) uid: String,
    group: String,
    result: Result<Group, LookupError>,
}

/// SaladCloud API lookups under way, and the delay before each pod's next try.
pub(super) struct Lookups {
    api: Option<SaladApi>,
    inflight: HashSet<Arc<str>>,
    retry_after: HashMap<Arc<str>, Duration>,
    tasks: JoinSet<()>,
    permits: Arc<Semaphore>,
    sender: mpsc::UnboundedSender<LookupDone>,
    receiver: mpsc::UnboundedReceiver<LookupDone>,
}

impl Lookups {
    pub(super) fn new(api: Option<SaladApi>) -> Lookups {
        let (sender, receiver) = mpsc::unbounded_channel();
        Lookups {
            api,
            inflight: HashSet::new(),
            retry_after: HashMap::new(),
            tasks: JoinSet::new(),
            permits: Arc::new(Semaphore::new(LOOKUP_CONCURRENCY)),
            sender,
            receiver,
        }
    }

    /// Starts a lookup for every pod that waits for one and has none under way.
    pub(super) fn start(&mut self, tracker: &Tracker) {
        let Some(api) = &self.api else { return };
        // Finished tasks are reaped here so the set does not grow.
        while self.tasks.try_join_next().is_some() {}
        for (key, uid, group) in tracker.wanting_lookup() {
            if !self.inflight.insert(Arc::clone(&key)) {
                continue;
            }
            let delay = self.retry_after.get(&key).copied().unwrap_or_default();
            let (api, permits, sender) =
                (api.clone(), Arc::clone(&self.permits), self.sender.clone());
            self.tasks.spawn(async move {
                tokio::time::sleep(delay).await;
                let Ok(_permit) = permits.acquire().await else {
                    return;
                };
                let result = api.lookup(&group).await;
                let _ = sender.send(LookupDone {
                    key,
                    uid,
                    group,
                    result,
                });
            });
        }
    }

    pub(super) async fn finished(&mut self) -> Option<LookupDone> {
        self.receiver.recv().await
    }

    /// Books a finished lookup: the gateway host if it found one, else the next retry's delay.
    pub(super) fn settle(&mut self, done: &LookupDone, status: &Status) -> Option<String> {
        self.inflight.remove(&done.key);
        let next = |current: Option<Duration>| {
            current.map_or(LOOKUP_RETRY_FIRST, |d| (d * 2).min(LOOKUP_RETRY_MAX))
        };
        match &done.result {
            Ok(Group::Gateway(host)) => {
                status.lookup("found");
                self.retry_after.remove(&done.key);
                tracing::info!(pod = %done.key, group = %done.group, gateway = %host, "SaladCloud gateway found");
                Some(host.clone())
            }
            Ok(missing) => {
                status.lookup("not-yet");
                let delay = next(self.retry_after.get(&done.key).copied());
                tracing::debug!(pod = %done.key, group = %done.group, answer = ?missing, retry_in = ?delay, "no SaladCloud gateway yet");
                self.retry_after.insert(Arc::clone(&done.key), delay);
                None
            }
            Err(err) => {
                status.lookup("error");
                let delay = next(self.retry_after.get(&done.key).copied());
                tracing::warn!(pod = %done.key, error = %err, retry_in = ?delay, "SaladCloud API lookup failed");
                self.retry_after.insert(Arc::clone(&done.key), delay);
                None
            }
        }
    }
}

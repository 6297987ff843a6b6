//! `discovery.kubernetes`: the pods a Virtual Kubelet runs remotely, as a source of endpoints
//! ([`Pods`]).
//!
//! - [`pods`]: a pod's facts and the rules that turn it into an endpoint (pure, unit-tested);
//! - [`kube`]: a pool's pod discovery, which keeps its registry's `kubernetes` source equal to the
//!   qualifying pods, and survives a dropped watch without emptying the set;
//! - [`hub`]: the pod watches, one per group of pools that can share it, each pool taking the pods its
//!   own label selector picks;
//! - [`lookups`]: SaladCloud gateway host lookups for a pool's pods, and their write-back;
//! - [`salad`]: the SaladCloud API client for those lookups;
//! - [`register`]: node self-registration (`POST /v1/nodes/register`), which writes a pod annotation
//!   so every replica learns the address through its own watch; tongs keeps no state of its own.
//!
//! What discovery writes: the registry's `kubernetes` source (the request path sees endpoints come and
//! go through the registry's snapshot, nothing more), its own [`Status`] (counters, the registration
//! token, the watch in force, whether the first list is in), and pod annotations through the
//! Kubernetes API (a node's registered address, a SaladCloud gateway host found by lookup). It never
//! touches the request path directly.

mod client;
pub mod hub;
pub mod kube;
mod lookups;
pub mod object;
pub mod pods;
pub mod register;
pub mod replicas;
pub mod salad;

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwapOption;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use self::kube::Watched;
use self::pods::{PodState, Reason};
use super::{Shared, Source, SourceError, SourceStatus};
use crate::config::{Config, KubernetesConfig};
use crate::metrics::DiscoveryFigures;
use crate::registry::Registry;

/// The registry source this kind writes.
pub const KIND: &str = kube::SOURCE;

/// A pool's pod discovery as a source of endpoints.
pub struct Pods {
    registry: Arc<Registry>,
    status: Arc<Status>,
}

impl Pods {
    pub fn new(registry: &Arc<Registry>) -> Pods {
        Pods {
            registry: Arc::clone(registry),
            status: Arc::default(),
        }
    }

    /// Counters, the registration token and the watch in force.
    pub fn state(&self) -> &Arc<Status> {
        &self.status
    }
}

impl Source for Pods {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn configure(&self, pool: &str, config: &Config) -> Result<(), SourceError> {
        self.status
            .configure(&config.discovery.kubernetes)
            .map_err(|source| SourceError {
                pool: pool.to_owned(),
                field: "discovery.kubernetes.registration.token_file",
                source,
            })
    }

    fn run(
        self: Arc<Self>,
        pool: Arc<str>,
        shared: Shared,
        stop: CancellationToken,
    ) -> BoxFuture<'static, ()> {
        let discovery = kube::Discovery {
            pool,
            registry: Arc::clone(&self.registry),
            status: Arc::clone(&self.status),
            salad: shared.salad,
            gateway_key: shared.gateway_key,
            hubs: shared.watches,
        };
        Box::pin(discovery.run(stop))
    }

    fn status(&self) -> SourceStatus {
        let enabled = self.status.wants_sync();
        SourceStatus {
            kind: KIND,
            enabled,
            synced: !enabled || self.status.synced(),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Outcomes of a node's call (a registration, or a drain notice), as counted.
pub const REGISTRATION_RESULTS: [&str; 10] = [
    "registered",
    "draining",
    "unchanged",
    "unauthorized",
    "bad-request",
    "unknown-pod",
    "wrong-uid",
    "not-allowed",
    "has-address",
    "failed",
];

/// Outcomes of a SaladCloud API lookup, as counted.
pub const LOOKUP_RESULTS: [&str; 3] = ["found", "not-yet", "error"];

/// What discovery is doing, read by `/metrics`, `/readyz` and registration.
#[derive(Default)]
pub struct Status {
    /// Kubernetes discovery is on.
    enabled: AtomicBool,
    /// The first complete list has been applied.
    synced: AtomicBool,
    pods: [AtomicU64; 3],
    rejections: [AtomicU64; 8],
    watch_errors: AtomicU64,
    lists: AtomicU64,
    registrations: [AtomicU64; REGISTRATION_RESULTS.len()],
    lookups: [AtomicU64; LOOKUP_RESULTS.len()],
    /// The watch in force: its client and pods (for registration).
    watched: ArcSwapOption<Watched>,
    /// The configuration discovery follows (a reload sends a new one).
    config: tokio::sync::watch::Sender<KubernetesConfig>,
    /// The fleet's token nodes present to register (besides their pod's UID).
    registration_token: ArcSwapOption<String>,
}

impl Status {
    /// Hands discovery a (new) configuration, and the registration token read from its file.
    pub fn configure(&self, config: &KubernetesConfig) -> Result<(), std::io::Error> {
        let token = match &config.registration.token_file {
            Some(path) => {
                let read = |detail: String| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("{}: {detail}", path.display()),
                    )
                };
                let text = std::fs::read_to_string(path).map_err(|err| read(err.to_string()))?;
                let token = text.trim();
                // An empty token would let any `Authorization: Bearer ` through.
                if token.is_empty() {
                    return Err(read("is empty".into()));
                }
                Some(Arc::new(token.to_owned()))
            }
            None => None,
        };
        self.registration_token.store(token);
        self.config.send_if_modified(|current| {
            let changed = current != config;
            *current = config.clone();
            changed
        });
        Ok(())
    }

    /// The configuration in force, following reloads.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<KubernetesConfig> {
        self.config.subscribe()
    }

    /// Whether the configuration in force watches pods (so readiness waits for the first list).
    pub fn wants_sync(&self) -> bool {
        self.config.borrow().enabled
    }

    pub fn registration_token(&self) -> Option<Arc<String>> {
        self.registration_token.load_full()
    }

    pub fn set_enabled(&self, enabled: bool) {
        self.enabled.store(enabled, Ordering::Relaxed);
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::Relaxed);
    }

    /// Whether the first complete list of pods is in the registry.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }

    pub(crate) fn set_pods(&self, counts: [u64; 3]) {
        for (slot, count) in self.pods.iter().zip(counts) {
            slot.store(count, Ordering::Relaxed);
        }
    }

    /// Pods watched, by [`PodState`].
    pub fn pods(&self) -> impl Iterator<Item = (PodState, u64)> + '_ {
        PodState::ALL
            .into_iter()
            .zip(&self.pods)
            .map(|(state, count)| (state, count.load(Ordering::Relaxed)))
    }

    pub(crate) fn rejected(&self, reason: Reason) {
        let index = Reason::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        self.rejections[index].fetch_add(1, Ordering::Relaxed);
    }

    /// Annotations and pods refused, by reason.
    pub fn rejections(&self) -> impl Iterator<Item = (Reason, u64)> + '_ {
        Reason::ALL
            .into_iter()
            .zip(&self.rejections)
            .map(|(reason, count)| (reason, count.load(Ordering::Relaxed)))
    }

    pub(crate) fn watch_error(&self) {
        self.watch_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn watch_errors(&self) -> u64 {
        self.watch_errors.load(Ordering::Relaxed)
    }

    pub(crate) fn listed(&self) {
        self.lists.fetch_add(1, Ordering::Relaxed);
    }

    /// Complete lists applied (the first sync, then one per re-list after a lost watch).
    pub fn lists(&self) -> u64 {
        self.lists.load(Ordering::Relaxed)
    }

    pub(crate) fn registration(&self, result: &str) {
        count(&self.registrations, &REGISTRATION_RESULTS, result);
    }

    pub fn registrations(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        pairs(&self.registrations, &REGISTRATION_RESULTS)
    }

    pub(crate) fn lookup(&self, result: &str) {
        count(&self.lookups, &LOOKUP_RESULTS, result);
    }

    pub fn lookups(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        pairs(&self.lookups, &LOOKUP_RESULTS)
    }

    pub(crate) fn set_watched(&self, watched: Option<Arc<Watched>>) {
        self.watched.store(watched);
    }

    pub(crate) fn watched(&self) -> Option<Arc<Watched>> {
        self.watched.load_full()
    }
}

impl Status {
    /// Everything counted, for `/metrics`.
    pub fn figures(&self) -> DiscoveryFigures {
        DiscoveryFigures {
            synced: self.synced() || !self.enabled(),
            pods: self.pods().map(|(state, n)| (state.as_str(), n)).collect(),
            rejections: self
                .rejections()
                .map(|(reason, n)| (reason.as_str(), n))
                .collect(),
            watch_errors: self.watch_errors(),
            lists: self.lists(),
            lookups: self.lookups().collect(),
            registrations: self.registrations().collect(),
        }
    }
}

fn count(slots: &[AtomicU64], names: &[&str], name: &str) {
    if let Some(slot) = names
        .iter()
        .position(|n| *n == name)
        .and_then(|index| slots.get(index))
    {
        slot.fetch_add(1, Ordering::Relaxed);
    }
}

fn pairs<'a>(
    slots: &'a [AtomicU64],
    names: &'static [&'static str],
) -> impl Iterator<Item = (&'static str, u64)> + 'a {
    names
        .iter()
        .zip(slots)
        .map(|(name, count)| (*name, count.load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_or_missing_registration_token_is_refused() {
        let dir = std::env::temp_dir().join(format!("tongs-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        let mut config = KubernetesConfig::default();
        config.registration.token_file = Some(file.clone());
        let status = Status::default();
        assert!(status.configure(&config).is_err(), "missing file");
        std::fs::write(&file, " \n").unwrap();
        let err = status.configure(&config).unwrap_err();
        assert!(err.to_string().contains("is empty"), "{err}");
        std::fs::write(&file, "s3cret\n").unwrap();
        status.configure(&config).unwrap();
        assert_eq!(
            status.registration_token().as_deref().map(String::as_str),
            Some("s3cret")
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

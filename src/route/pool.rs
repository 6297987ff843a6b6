//! One pool as it runs: its fleet (registry, queue, request path, heartbeat settings, endpoint
//! sources) and the rules that send requests to it.

use std::path::Path;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use http::HeaderValue;
use tokio_util::sync::CancellationToken;

use crate::admission::{Queue, QueueSettings};
use crate::config::{HealthConfig, PoolMatch, PoolSpec, SignalsConfig, model_matches};
use crate::endpoint::SlotFreed;
use crate::limit::LimitSettings;
use crate::metrics::Metrics;
use crate::proxy::{Intake, Proxy, ProxySettings};
use crate::registry::Registry;
use crate::source::{SourceError, Sources};

/// What routing knows of a pool, replaced whole by a reload.
#[derive(Debug, Default)]
pub struct PoolRules {
    pub matches: PoolMatch,
    pub fallback: Vec<String>,
    pub rewrite_model: Option<String>,
    /// `Authorization: Bearer …` for this pool's endpoints (from `api_key_file`), marked sensitive.
    pub authorization: Option<HeaderValue>,
}

/// A pool's fleet and rules.
pub struct Pool {
    name: Arc<str>,
    rules: ArcSwap<PoolRules>,
    proxy: Arc<Proxy>,
    /// Heartbeat settings, replaced by a reload.
    health: Arc<ArcSwap<HealthConfig>>,
    /// How the model servers' own metrics are read, replaced by a reload.
    signals: Arc<ArcSwap<SignalsConfig>>,
    /// Where its endpoints come from, one source of each kind.
    sources: Sources,
    /// Stops the pool's background tasks (heartbeats, sources) once it is removed.
    tasks: Mutex<Option<CancellationToken>>,
}

/// Why a pool's configuration could not be applied in full (the rest was).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// Not a pool's, but applied with them: the inbound keys (the keys in force stay).
    #[error(transparent)]
    Keys(#[from] super::auth::KeysError),
    /// Not a pool's either: the OTLP exporter (made once, at start).
    #[error(transparent)]
    Traces(#[from] crate::trace::ExporterError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("pool {pool}: cannot read api_key_file {path}: {source}")]
    ApiKey {
        pool: String,
        path: String,
        source: std::io::Error,
    },
}

impl Pool {
    /// A pool with nothing configured yet; [`Pool::apply`] configures it.
    pub fn new(name: &str, intake: &Intake) -> Arc<Pool> {
        let queue = Arc::new(Queue::default());
        let woken = Arc::clone(&queue);
        let registry = Arc::new(Registry::new(SlotFreed::new(move || woken.wake_one())));
        let sources = Sources::new(&registry);
        let proxy = Arc::new(Proxy::new(
            registry,
            queue,
            Arc::new(Metrics::new()),
            intake.settings().as_ref().clone(),
            intake,
        ));
        Arc::new(Pool {
            name: name.into(),
            rules: ArcSwap::default(),
            proxy,
            health: Arc::new(ArcSwap::from_pointee(HealthConfig::default())),
            signals: Arc::new(ArcSwap::from_pointee(SignalsConfig::default())),
            sources,
            tasks: Mutex::new(None),
        })
    }

    /// Applies `spec`: endpoints that stay keep their state, requests under way finish with the
    /// settings they started with. A secret that cannot be read keeps the value in force and is
    /// returned.
    pub fn apply(&self, spec: &PoolSpec) -> Vec<PoolError> {
        let mut errors = Vec::new();
        let config = &spec.config;
        self.proxy.apply(ProxySettings::from_config(config));
        let registry = self.proxy.registry();
        registry.set_limits(LimitSettings::from_config(&config.concurrency));
        self.proxy
            .queue()
            .set_settings(QueueSettings::from_config(&config.queue));
        // Only a pool matched by a model pattern lists its nodes' own models (see `models_list`):
        // the others' nodes are not asked.
        let mut health = config.health.clone();
        if !spec.matches.models.iter().any(|model| model.ends_with('*')) {
            health.models_interval = crate::config::HumanDuration::from_secs(0);
        }
        self.health.store(Arc::new(health));
        self.signals.store(Arc::new(config.signals.clone()));
        errors.extend(
            self.sources
                .configure(&spec.name, config)
                .into_iter()
                .map(PoolError::Source),
        );
        let old = self.rules.load();
        let authorization = match &spec.api_key_file {
            None => None,
            Some(path) => match bearer(path) {
                Ok(value) => Some(value),
                Err(source) => {
                    errors.push(PoolError::ApiKey {
                        pool: spec.name.clone(),
                        path: path.display().to_string(),
                        source,
                    });
                    old.authorization.clone()
                }
            },
        };
        self.rules.store(Arc::new(PoolRules {
            matches: spec.matches.clone(),
            fallback: spec.fallback.clone(),
            rewrite_model: spec.rewrite_model.clone(),
            authorization,
        }));
        errors
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    pub fn rules(&self) -> arc_swap::Guard<Arc<PoolRules>> {
        self.rules.load()
    }

    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    pub fn registry(&self) -> &Arc<Registry> {
        self.proxy.registry()
    }

    pub fn queue(&self) -> &Arc<Queue> {
        self.proxy.queue()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        self.proxy.metrics()
    }

    pub fn health(&self) -> &Arc<ArcSwap<HealthConfig>> {
        &self.health
    }

    pub fn signals(&self) -> &Arc<ArcSwap<SignalsConfig>> {
        &self.signals
    }

    pub fn sources(&self) -> &Sources {
        &self.sources
    }

    /// Records the token that stops this pool's background tasks.
    pub fn set_tasks(&self, stop: CancellationToken) {
        let old = self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(stop);
        if let Some(old) = old {
            old.cancel();
        }
    }

    /// Whether the pool's background tasks run.
    pub fn has_tasks(&self) -> bool {
        self.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Stops the pool's background tasks (it left the configuration).
    pub fn stop(&self) {
        if let Some(stop) = self.tasks.lock().unwrap_or_else(|p| p.into_inner()).take() {
            stop.cancel();
        }
    }

    /// Whether a request with this path, headers and model meets every condition the pool gives.
    pub fn matches(&self, path: &str, headers: &http::HeaderMap, model: Option<&str>) -> bool {
        let rules = self.rules.load();
        let m = &rules.matches;
        let models = m.models.is_empty()
            || model.is_some_and(|model| m.models.iter().any(|p| model_matches(p, model)));
        let paths = m.path_prefixes.is_empty()
            || m.path_prefixes
                .iter()
                .any(|prefix| path.starts_with(prefix.as_str()));
        let headers = m.headers.iter().all(|(name, value)| {
            headers
                .get_all(name.as_str())
                .iter()
                .any(|v| v.as_bytes() == value.as_bytes())
        });
        models && paths && headers
    }
}

/// A bearer token file's value as a sensitive `Authorization` header.
fn bearer(path: &Path) -> std::io::Result<HeaderValue> {
    let key = std::fs::read_to_string(path)?;
    let key = key.trim();
    if key.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the file is empty",
        ));
    }
    let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the key is not a valid header value",
        )
    })?;
    value.set_sensitive(true);
    Ok(value)
}

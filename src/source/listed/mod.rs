//! `discovery.static`: the endpoints the configuration lists. Written to the registry the moment a
//! configuration is applied, so there is nothing to follow and nothing readiness waits for.

use std::any::Any;
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use super::{Shared, Source, SourceError, SourceStatus};
use crate::config::{Config, EndpointUrl};
use crate::registry::{EndpointSpec, Registry};

/// The registry source this kind writes.
pub const KIND: &str = "static";

/// A pool's listed endpoints.
pub struct Listed {
    registry: Arc<Registry>,
}

impl Listed {
    pub fn new(registry: &Arc<Registry>) -> Listed {
        Listed {
            registry: Arc::clone(registry),
        }
    }
}

/// The endpoints `config` lists, as the registry takes them.
pub fn specs(config: &Config) -> Vec<EndpointSpec> {
    config
        .discovery
        .static_endpoints
        .iter()
        .filter_map(|endpoint| {
            // Validation already refused bad URLs; skipping keeps this total for unvalidated input.
            let parsed = EndpointUrl::parse(&endpoint.url).ok()?;
            let mut spec = EndpointSpec::new(endpoint.url.clone(), parsed, endpoint.weight);
            spec.origin.max_outstanding = endpoint.max_outstanding;
            spec.origin.engine = endpoint.engine;
            Some(spec)
        })
        .collect()
}

impl Source for Listed {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn configure(&self, _pool: &str, config: &Config) -> Result<(), SourceError> {
        self.registry.set_source(KIND, specs(config));
        Ok(())
    }

    fn run(
        self: Arc<Self>,
        _pool: Arc<str>,
        _shared: Shared,
        _stop: CancellationToken,
    ) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }

    fn status(&self) -> SourceStatus {
        SourceStatus {
            kind: KIND,
            enabled: true,
            synced: true,
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::SlotFreed;

    #[test]
    fn the_listed_endpoints_are_the_registrys_static_share_after_every_configure() {
        let registry = Arc::new(Registry::new(SlotFreed::nobody()));
        let listed = Listed::new(&registry);
        let mut config = Config::default();
        config.discovery.static_endpoints = serde_json::from_value(serde_json::json!([
            {"url": "http://10.0.0.1:8000", "weight": 2},
            {"url": "http://10.0.0.2:8000"}
        ]))
        .unwrap();
        listed.configure("default", &config).unwrap();
        let urls: Vec<String> = registry
            .snapshot()
            .iter()
            .map(|e| e.url().to_owned())
            .collect();
        assert_eq!(urls, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        assert!(registry.snapshot().iter().all(|e| e.source() == KIND));
        config.discovery.static_endpoints.truncate(1);
        listed.configure("default", &config).unwrap();
        assert_eq!(registry.snapshot().len(), 1);
        assert!(listed.status().synced);
    }
}

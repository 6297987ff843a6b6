//! Where a pool's endpoints come from: every kind of source behind one contract, [`Source`].
//!
//! Each pool has one source of each kind in [`SOURCES`]; each reads its own part of the pool's
//! configuration and is idle when that part is off. A source
//! - is built with the pool's registry, and writes only its own share of it, named by its kind, through
//!   [`Registry::set_source`] and [`Registry::update_source`]: endpoints that stay keep their state;
//! - takes the pool's configuration at start and at every reload ([`Source::configure`]);
//! - runs until its stop signal, if it has anything to follow ([`Source::run`], started by the app for
//!   every pool, a pool a reload adds included);
//! - says whether readiness waits for it and what it holds ([`Source::status`]), which `/readyz`,
//!   `/debug/endpoints` and the status page read without knowing its kind.
//!
//! The kinds: [`listed`] (`discovery.static`, the endpoints the configuration lists) and [`kubernetes`]
//! (`discovery.kubernetes`, the pods a Virtual Kubelet runs remotely). A new kind is a folder here with a
//! type implementing [`Source`] and a `new(&Arc<Registry>)`, and one line in the `sources!` list below,
//! which declares its module and registers it by kind.

use std::any::Any;
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::registry::Registry;
use crate::upstream::GatewayKey;

/// How a source is made for a pool, given its registry.
pub type MakeSource = fn(&Arc<Registry>) -> Arc<dyn Source>;

/// Declares each kind's module and registers it under the name its endpoints carry in the registry:
/// one line per kind.
macro_rules! sources {
    ($($kind:literal => $module:ident::$source:ident,)*) => {
        $(pub mod $module;)*

        /// Every kind of source, by the name its endpoints carry in the registry.
        pub const SOURCES: &[(&str, MakeSource)] =
            &[$(($kind, |registry| Arc::new(<$module::$source>::new(registry)))),*];
    };
}

sources! {
    "static" => listed::Listed,
    "kubernetes" => kubernetes::Pods,
}

/// What sources of every pool share, made once when tongs starts.
#[derive(Clone)]
pub struct Shared {
    /// The pod watches, one per group of pools that can share it.
    pub watches: Arc<kubernetes::hub::Hubs>,
    /// SaladCloud API lookups of gateway hosts, when configured.
    pub salad: Option<kubernetes::salad::SaladApi>,
    /// Told which gateway hosts a source confirmed.
    pub gateway_key: Arc<GatewayKey>,
}

/// A source's state, as everyone outside it reads it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SourceStatus {
    pub kind: &'static str,
    /// Its part of the configuration is on.
    pub enabled: bool,
    /// Readiness waits for it until this is true (a source with nothing to list first is synced).
    pub synced: bool,
}

/// Why a source could not take a configuration in full (the rest of it was applied).
#[derive(Debug, thiserror::Error)]
#[error("pool {pool}: cannot read {field}: {source}")]
pub struct SourceError {
    pub pool: String,
    /// The configuration key, as written.
    pub field: &'static str,
    pub source: std::io::Error,
}

/// One kind of endpoint source for one pool.
pub trait Source: Send + Sync + 'static {
    /// The name of its share of the registry (and of its kind in [`SOURCES`]).
    fn kind(&self) -> &'static str;

    /// Takes the pool's configuration, at start and at every reload. A part that cannot be read keeps
    /// the value in force, and is returned.
    fn configure(&self, pool: &str, config: &Config) -> Result<(), SourceError>;

    /// Follows the configuration of pool `pool` until `stop`.
    fn run(
        self: Arc<Self>,
        pool: Arc<str>,
        shared: Shared,
        stop: CancellationToken,
    ) -> BoxFuture<'static, ()>;

    fn status(&self) -> SourceStatus;

    /// For what only one kind offers (Kubernetes' node registration and pod figures).
    fn as_any(&self) -> &dyn Any;
}

/// A pool's sources, one of each kind.
pub struct Sources(Vec<Arc<dyn Source>>);

impl Sources {
    /// One source of each kind in [`SOURCES`], writing `registry`.
    pub fn new(registry: &Arc<Registry>) -> Sources {
        Sources(SOURCES.iter().map(|(_, build)| build(registry)).collect())
    }

    /// Hands every source the pool's configuration; what could not be read, by source.
    pub fn configure(&self, pool: &str, config: &Config) -> Vec<SourceError> {
        self.0
            .iter()
            .filter_map(|source| source.configure(pool, config).err())
            .collect()
    }

    /// Starts every source of pool `pool`, until `stop`.
    pub fn run(&self, pool: &Arc<str>, shared: &Shared, stop: &CancellationToken) {
        for source in &self.0 {
            let run = Arc::clone(source).run(Arc::clone(pool), shared.clone(), stop.clone());
            tokio::spawn(run);
        }
    }

    /// Whether every source has its first complete list in.
    pub fn synced(&self) -> bool {
        self.0.iter().all(|source| source.status().synced)
    }

    pub fn statuses(&self) -> Vec<SourceStatus> {
        self.0.iter().map(|source| source.status()).collect()
    }

    /// The source of kind `T`, for what only that kind offers.
    pub fn get<T: Source>(&self) -> Option<&T> {
        self.0
            .iter()
            .find_map(|source| source.as_any().downcast_ref::<T>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::SlotFreed;

    #[test]
    fn every_kind_is_registered_once_and_writes_its_own_share() {
        let registry = Arc::new(Registry::new(SlotFreed::nobody()));
        let sources = Sources::new(&registry);
        let kinds: Vec<&str> = sources.0.iter().map(|source| source.kind()).collect();
        let registered: Vec<&str> = SOURCES.iter().map(|(kind, _)| *kind).collect();
        assert_eq!(kinds, registered);
        assert_eq!(kinds, ["static", "kubernetes"]);
        for source in &sources.0 {
            assert_eq!(source.status().kind, source.kind());
        }
        assert!(sources.get::<listed::Listed>().is_some());
        assert!(sources.get::<kubernetes::Pods>().is_some());
    }
}

//! tongs: an in-cluster reverse proxy that makes a fleet of remote, interruptible GPU inference nodes
//! look like one reliable service.
//!
//! [`App::bind`] opens the listeners for a validated [`config::Config`]; [`App::run`] serves until the
//! shutdown token is cancelled, then drains in-flight requests within the grace period.

#![forbid(unsafe_code)]

pub mod admin;
pub mod balance;
pub mod body;
pub mod config;
pub mod demo;
pub mod endpoint;
pub mod error;
pub mod headers;
pub mod proxy;
pub mod registry;
pub mod server;
pub mod sim;
pub mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admin::Readiness;
use crate::config::Config;
use crate::proxy::{Proxy, ProxySettings};
use crate::registry::{EndpointSpec, Registry};
use crate::server::ServerSettings;

/// Why tongs could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind {
        what: String,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Upstream(#[from] upstream::UpstreamError),
}

/// A proxy with its listeners bound, ready to run.
pub struct App {
    proxy_listener: TcpListener,
    admin_listener: TcpListener,
    proxy_addr: SocketAddr,
    admin_addr: SocketAddr,
    proxy: Arc<Proxy>,
    registry: Arc<Registry>,
    readiness: Arc<Readiness>,
    server_settings: ServerSettings,
}

impl App {
    /// Builds the proxy for `config` and binds its listeners (port 0 picks a free port).
    pub async fn bind(config: &Config) -> Result<App, AppError> {
        let client = upstream::build_client(config)?;
        let registry = Arc::new(Registry::new());
        registry.replace(EndpointSpec::from_config(config));
        let readiness = Arc::new(Readiness::default());
        // Static discovery is synced the moment it is applied.
        readiness.set_synced();
        let proxy = Arc::new(Proxy::new(
            Arc::clone(&registry),
            client,
            ProxySettings::from_config(config),
        ));
        let proxy_listener = server::bind(config.listen, "client traffic (listen)").await?;
        let admin_listener = server::bind(config.admin.listen, "admin (admin.listen)").await?;
        Ok(App {
            proxy_addr: server::local_addr(&proxy_listener, config.listen),
            admin_addr: server::local_addr(&admin_listener, config.admin.listen),
            proxy_listener,
            admin_listener,
            proxy,
            registry,
            readiness,
            server_settings: ServerSettings::from_config(config),
        })
    }

    /// Where clients connect.
    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy_addr
    }

    /// Where probes and operators connect.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The request path's shared state (its counters, its registry).
    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    /// The endpoint registry (tests and discovery write to it).
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Serves until `shutdown` is cancelled, then drains and returns.
    pub async fn run(self, shutdown: CancellationToken) {
        tracing::info!(
            listen = %self.proxy_addr(),
            admin = %self.admin_addr(),
            endpoints = self.registry.snapshot().len(),
            "tongs serving"
        );
        let admin_stop = CancellationToken::new();
        let admin = tokio::spawn(admin::serve(
            self.admin_listener,
            Arc::clone(&self.readiness),
            admin_stop.clone(),
        ));
        server::serve(
            self.proxy_listener,
            self.proxy,
            self.server_settings,
            self.readiness,
            shutdown,
        )
        .await;
        admin_stop.cancel();
        let _ = admin.await;
        tracing::info!("tongs stopped");
    }
}

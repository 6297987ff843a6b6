//! The client side: pooled connections to endpoints over plain TCP or TLS (rustls), directly or
//! through tailscaled's proxy.
//!
//! One hyper-util client serves every endpoint; its pool is keyed by scheme and authority, so each
//! endpoint gets its own pool of kept-alive connections. The transport is chosen per endpoint:
//! - `https://` endpoints (the SaladCloud Container Gateway) are verified against the webpki roots plus
//!   an optional extra CA file, with SNI taken from the endpoint's host and HTTP/2 used when the server
//!   offers it by ALPN; those that match `salad.gateways` and that static config or the SaladCloud API
//!   vouch for get the `Salad-Api-Key` ([`gateway_key`]);
//! - Tailscale addresses and MagicDNS names go through tailscaled's SOCKS5 or HTTP CONNECT proxy when
//!   one is configured, names resolved by tailscaled ([`route`]);
//! - everything else (podIPs) is plain TCP.
//!
//! Why a connection failed is told to clients only in general words ([`cause`]).

pub mod cause;
pub mod gateway_key;
pub mod route;

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use http_body_util::combinators::UnsyncBoxBody;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::config::{Config, parse_proxy};
pub use cause::connect_cause;
pub use gateway_key::{GatewayKey, SALAD_API_KEY};
pub use route::Route;

use crate::http::BoxError;

/// The request body sent to an endpoint (the client's body, possibly wrapped in a size limit).
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// The pooled hyper client underneath.
pub type PooledClient = Client<HttpsConnector<Route>, UpstreamBody>;

/// The pooled client every request to an endpoint goes through, and the key it attaches.
#[derive(Clone)]
pub struct UpstreamClient {
    client: PooledClient,
    key: Arc<GatewayKey>,
}

impl UpstreamClient {
    /// Sends `request` to the endpoint its URI names, with `Salad-Api-Key` as [`GatewayKey`] decides.
    pub fn request(&self, mut request: Request<UpstreamBody>) -> ResponseFuture {
        let mut headers = std::mem::take(request.headers_mut());
        self.key.apply(request.uri(), &mut headers);
        *request.headers_mut() = headers;
        self.client.request(request)
    }

    /// The client without the key handling, for callers that authenticate themselves (the SaladCloud
    /// API client sends the key to the API, which is no gateway).
    pub fn pooled(&self) -> &PooledClient {
        &self.client
    }
}

/// Why the upstream client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream.extra_ca_file {path}: {detail}")]
    ExtraCa { path: String, detail: String },
    #[error("upstream.tailscale.proxy: {0}")]
    Proxy(String),
    #[error("TLS setup failed: {0}")]
    Tls(#[from] rustls::Error),
}

/// Builds the pooled upstream client from the configuration; `key` is shared with reloads.
pub fn build_client(
    config: &Config,
    key: Arc<GatewayKey>,
) -> Result<UpstreamClient, UpstreamError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.timeouts.connect.get()));
    http.set_keepalive(Some(std::time::Duration::from_secs(30)));

    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &config.upstream.extra_ca_file {
        add_extra_cas(&mut roots, path)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_all_versions()
        .wrap_connector(route(config, http)?);

    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(config.timeouts.idle.get())
        .pool_max_idle_per_host(config.upstream.pool_max_idle_per_endpoint)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(connector);
    Ok(UpstreamClient { client, key })
}

/// Direct, or through tailscaled's proxy for Tailscale addresses.
fn route(config: &Config, http: HttpConnector) -> Result<Route, UpstreamError> {
    let tailscale = &config.upstream.tailscale;
    if tailscale.proxy.is_empty() {
        return Ok(Route::direct(http));
    }
    let (kind, proxy) = parse_proxy(&tailscale.proxy).map_err(UpstreamError::Proxy)?;
    Ok(Route::with_proxy(
        http,
        kind,
        proxy,
        tailscale.parsed_ranges(),
        tailscale.parsed_domains(),
        config.timeouts.connect.get(),
    ))
}

fn add_extra_cas(roots: &mut RootCertStore, path: &Path) -> Result<(), UpstreamError> {
    let failed = |detail: String| UpstreamError::ExtraCa {
        path: path.display().to_string(),
        detail,
    };
    let mut added = 0;
    for cert in CertificateDer::pem_file_iter(path).map_err(|err| failed(err.to_string()))? {
        let cert = cert.map_err(|err| failed(format!("not a PEM certificate: {err}")))?;
        roots
            .add(cert)
            .map_err(|err| failed(format!("certificate refused: {err}")))?;
        added += 1;
    }
    if added == 0 {
        return Err(failed("holds no PEM certificate".into()));
    }
    Ok(())
}

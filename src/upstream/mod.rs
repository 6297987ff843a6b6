//! The client side: pooled connections to endpoints over plain TCP or TLS (rustls), directly or
//! through tailscaled's proxy.
//!
//! Each worker has its own client, and the client its own kept-alive connections to every endpoint
//! ([`pool`]). The transport is chosen per endpoint:
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

use http::{Request, Response};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::config::{Config, parse_proxy};
use crate::http::Connections;
pub use crate::http::{ResponseBody, SendError, UpstreamBody};
pub use cause::connect_cause;
pub use gateway_key::{GatewayKey, SALAD_API_KEY};
pub use route::Route;

/// The pooled client every request to an endpoint goes through, and the key it attaches.
pub struct UpstreamClient {
    pool: Connections<HttpsConnector<Route>>,
    key: Arc<GatewayKey>,
}

impl UpstreamClient {
    /// Sends `request` to the endpoint its URI names, with `Salad-Api-Key` as [`GatewayKey`] decides.
    pub async fn request(
        &self,
        mut request: Request<UpstreamBody>,
    ) -> Result<Response<ResponseBody>, SendError> {
        let mut headers = std::mem::take(request.headers_mut());
        self.key.apply(request.uri(), &mut headers);
        *request.headers_mut() = headers;
        self.pool.send(request).await
    }

    /// Sends `request` without the key handling, for callers that authenticate themselves (the
    /// SaladCloud API client sends the key to the API, which is no gateway).
    pub async fn request_as_is(
        &self,
        request: Request<UpstreamBody>,
    ) -> Result<Response<ResponseBody>, SendError> {
        self.pool.send(request).await
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

    let pool = Connections::new(
        connector,
        config.timeouts.idle.get(),
        config.upstream.pool_max_idle_per_endpoint,
    );
    Ok(UpstreamClient { pool, key })
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

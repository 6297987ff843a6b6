//! The client side: pooled connections to endpoints over plain TCP or TLS (rustls).
//!
//! One hyper-util client serves every endpoint; its pool is keyed by scheme and authority, so each
//! endpoint gets its own pool of kept-alive connections. `https://` endpoints (the SaladCloud Container
//! Gateway) are verified against the webpki roots plus an optional extra CA file, with SNI taken from the
//! endpoint's host and HTTP/2 used when the server offers it by ALPN.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::config::Config;

/// Any error a body can produce, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The request body sent to an endpoint (the client's body, possibly wrapped in a size limit).
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// The pooled client every request goes through.
pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, UpstreamBody>;

/// Why the upstream client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream.extra_ca_file {path}: {detail}")]
    ExtraCa { path: String, detail: String },
    #[error("TLS setup failed: {0}")]
    Tls(#[from] rustls::Error),
}

/// Builds the pooled upstream client from the configuration.
pub fn build_client(config: &Config) -> Result<UpstreamClient, UpstreamError> {
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
        .wrap_connector(http);

    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(config.timeouts.idle.get())
        .pool_max_idle_per_host(config.upstream.pool_max_idle_per_endpoint)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(connector))
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

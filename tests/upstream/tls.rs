//! HTTPS endpoints: tongs verifies the endpoint's certificate (webpki roots plus
//! `upstream.extra_ca_file`), sends SNI and `Host`/`:authority` for the endpoint's own name rather than
//! the client's, and speaks HTTP/2 when the endpoint offers it by ALPN, HTTP/1.1 otherwise.
//!
//! Each test makes its own CA and leaf certificate with rcgen and runs a rustls backend on loopback
//! that records what it saw of the handshake and of each request: it stands in for an HTTPS GPU node
//! and for SaladCloud's Container Gateway.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::tls::TestPki;
use crate::support::*;
use http::{Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Makes a CA and a leaf certificate for `names`, signed by that CA.
fn pki(names: &[&str]) -> TestPki {
    TestPki::new(names)
}

/// A PEM file in the temp directory, removed when dropped.
struct TempPem(PathBuf);

impl TempPem {
    fn new(pem: &str) -> TempPem {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "tongs-test-ca-{}-{}.pem",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, pem).expect("temp CA file is writable");
        TempPem(path)
    }

    /// The `upstream:` config block that trusts this file.
    fn upstream_yaml(&self) -> String {
        format!(
            "upstream: {{ extra_ca_file: {:?} }}\n",
            self.0.display().to_string()
        )
    }
}

impl Drop for TempPem {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What the TLS backend saw of one request and the connection it came on.
#[derive(Clone, Debug)]
struct Seen {
    sni: Option<String>,
    alpn: Option<Vec<u8>>,
    version: Version,
    host: Option<String>,
    authority: Option<String>,
    path_and_query: String,
    forwarded_host: Option<String>,
    forwarded_for: Option<String>,
    salad_api_key: Option<String>,
}

/// An HTTPS backend on loopback that records every request it answers.
struct TlsBackend {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// TLS handshakes completed: one per session.
    handshakes: Arc<AtomicUsize>,
    stop: CancellationToken,
}

impl TlsBackend {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }

    /// Requests seen on `path` (and query).
    fn seen_on(&self, path: &str) -> usize {
        self.seen()
            .iter()
            .filter(|seen| seen.path_and_query == path)
            .count()
    }
}

impl Drop for TlsBackend {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts an HTTPS backend presenting `pki`'s leaf and offering `alpn` (e.g. `[b"h2", b"http/1.1"]`).
///
/// It listens on 127.0.0.1 and, when it can, on the same port of [::1], so `localhost` reaches it
/// whichever address the resolver returns first. Each connection is served with the protocol ALPN chose
/// (HTTP/1.1 when none was).
async fn tls_backend(pki: &TestPki, alpn: &[&[u8]]) -> TlsBackend {
    let acceptor = pki.acceptor(alpn);

    let v4 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = v4.local_addr().unwrap().port();
    let v6 = TcpListener::bind(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)))
        .await
        .ok();

    let seen = Arc::new(Mutex::new(Vec::new()));
    let handshakes = Arc::new(AtomicUsize::new(0));
    let stop = CancellationToken::new();
    for listener in std::iter::once(v4).chain(v6) {
        let (acceptor, seen, handshakes) =
            (acceptor.clone(), Arc::clone(&seen), Arc::clone(&handshakes));
        serve_connections(listener, stop.clone(), move |stream, _peer| {
            serve_tls(
                stream,
                acceptor.clone(),
                Arc::clone(&seen),
                Arc::clone(&handshakes),
            )
        });
    }
    TlsBackend {
        port,
        seen,
        handshakes,
        stop,
    }
}

/// One connection: the TLS handshake, then HTTP/2 if ALPN chose it, HTTP/1.1 otherwise.
async fn serve_tls(
    stream: TcpStream,
    acceptor: TlsAcceptor,
    seen: Arc<Mutex<Vec<Seen>>>,
    handshakes: Arc<AtomicUsize>,
) {
    // A refused handshake (the proxy distrusting the certificate) just ends the connection.
    let Ok(tls) = acceptor.accept(stream).await else {
        return;
    };
    handshakes.fetch_add(1, Ordering::SeqCst);
    let connection = tls.get_ref().1;
    let sni = connection.server_name().map(str::to_owned);
    let alpn = connection.alpn_protocol().map(<[u8]>::to_vec);
    let http = if alpn.as_deref() == Some(b"h2".as_slice()) {
        Http::Two
    } else {
        Http::One
    };
    serve_http(tls, http, move |request: Request<Incoming>| {
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        seen.lock().unwrap().push(Seen {
            sni: sni.clone(),
            alpn: alpn.clone(),
            version: request.version(),
            host: header("host"),
            authority: request.uri().authority().map(|a| a.to_string()),
            path_and_query: request
                .uri()
                .path_and_query()
                .map_or_else(String::new, |p| p.to_string()),
            forwarded_host: header("x-forwarded-host"),
            forwarded_for: header("x-forwarded-for"),
            salad_api_key: header("salad-api-key"),
        });
        async { Response::new(full("over tls")) }
    })
    .await;
}

/// Sends `GET path` to the proxy with the client-side `Host: api.internal`; returns status and body.
async fn get_as_api_internal(proxy: &TestProxy, path: &str) -> (StatusCode, String) {
    let request = Request::builder()
        .uri(proxy.url(path))
        .header("host", "api.internal")
        .body(full(""))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), client().request(request))
        .await
        .expect("the proxy answers within 10 s")
        .expect("the proxy answers");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn https_endpoint_offering_h2_is_reached_over_http2_with_its_own_name() {
    let pki = pki(&["gpu-node.test", "localhost"]);
    let ca = TempPem::new(&pki.ca_pem);
    let backend = tls_backend(&pki, &[b"h2", b"http/1.1"]).await;
    let endpoint = format!("https://localhost:{}", backend.port);
    let proxy = start_proxy(config_with(&ca.upstream_yaml(), &[endpoint])).await;

    let (status, body) = get_as_api_internal(&proxy, "/v1/models?limit=2").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, "over tls");

    let seen = backend.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let seen = &seen[0];
    let own_name = format!("localhost:{}", backend.port);
    assert_eq!(seen.sni.as_deref(), Some("localhost"));
    assert_eq!(seen.alpn.as_deref(), Some(b"h2".as_slice()));
    assert_eq!(seen.version, Version::HTTP_2);
    assert_eq!(seen.authority.as_deref(), Some(own_name.as_str()));
    // HTTP/2 carries the name in :authority; a Host header, if one is sent too, must agree with it.
    assert!(
        seen.host.is_none() || seen.host.as_deref() == Some(own_name.as_str()),
        "host header {:?}",
        seen.host
    );
    assert_eq!(seen.path_and_query, "/v1/models?limit=2");
    assert_eq!(seen.forwarded_host.as_deref(), Some("api.internal"));
    assert_eq!(seen.forwarded_for.as_deref(), Some("127.0.0.1"));
    proxy.stop().await;
}

#[tokio::test]
async fn https_endpoint_offering_only_http1_gets_http1_with_its_own_host() {
    let pki = pki(&["gpu-node.test", "localhost"]);
    let ca = TempPem::new(&pki.ca_pem);
    let backend = tls_backend(&pki, &[b"http/1.1"]).await;
    let endpoint = format!("https://localhost:{}", backend.port);
    let proxy = start_proxy(config_with(&ca.upstream_yaml(), &[endpoint])).await;

    // Two requests: the second may reuse the pooled TLS connection and must look the same.
    for path in ["/v1/chat", "/v1/chat?again=1"] {
        let (status, body) = get_as_api_internal(&proxy, path).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body, "over tls");
    }

    let seen = backend.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let own_name = format!("localhost:{}", backend.port);
    for (seen, path) in seen.iter().zip(["/v1/chat", "/v1/chat?again=1"]) {
        assert_eq!(seen.sni.as_deref(), Some("localhost"));
        assert_eq!(seen.alpn.as_deref(), Some(b"http/1.1".as_slice()));
        assert_eq!(seen.version, Version::HTTP_11);
        assert_eq!(seen.host.as_deref(), Some(own_name.as_str()));
        assert_ne!(seen.host.as_deref(), Some("api.internal"));
        assert_eq!(seen.path_and_query, path);
        assert_eq!(seen.forwarded_host.as_deref(), Some("api.internal"));
    }
    proxy.stop().await;
}

/// An endpoint's heartbeats are sent through the connection pool its requests use (a worker's), so a
/// SaladCloud-like gateway offering HTTP/2 holds one TLS session for both: heartbeats, then requests,
/// then heartbeats again, all over the first handshake. Heartbeats through a client of their own
/// opened a second session (and a second connection) to every endpoint.
#[tokio::test]
async fn heartbeats_and_requests_share_one_tls_session() {
    let pki = pki(&["gpu-node.test", "localhost"]);
    let ca = TempPem::new(&pki.ca_pem);
    let backend = tls_backend(&pki, &[b"h2", b"http/1.1"]).await;
    let endpoint = format!("https://localhost:{}", backend.port);
    let yaml = format!(
        "{}workers: 1\nhealth: {{ interval: 200ms, timeout: 2s }}\n",
        ca.upstream_yaml()
    );
    let proxy = start_proxy(config_with(&yaml, &[endpoint])).await;

    eventually("two heartbeats", Duration::from_secs(10), || {
        backend.seen_on("/health") >= 2
    })
    .await;
    for _ in 0..3 {
        let (status, body) = get_as_api_internal(&proxy, "/v1/chat").await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let heartbeats = backend.seen_on("/health");
    eventually(
        "heartbeats go on after the requests",
        Duration::from_secs(10),
        || backend.seen_on("/health") >= heartbeats + 2,
    )
    .await;

    assert_eq!(backend.seen_on("/v1/chat"), 3);
    assert!(
        backend
            .seen()
            .iter()
            .all(|seen| seen.version == Version::HTTP_2),
        "{:?}",
        backend.seen()
    );
    assert_eq!(
        backend.handshakes(),
        1,
        "heartbeats and requests went over one TLS session"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn https_endpoint_with_an_untrusted_ca_gets_502() {
    let pki = pki(&["gpu-node.test", "localhost"]);
    let backend = tls_backend(&pki, &[b"h2", b"http/1.1"]).await;
    let endpoint = format!("https://localhost:{}", backend.port);
    // No extra CA: only the webpki roots, which never signed the test CA.
    let proxy = start_proxy(config_with("", &[endpoint])).await;

    let (status, body) = get_as_api_internal(&proxy, "/v1/models").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    let (error, _) = proxy_error(&body);
    assert!(
        error.to_lowercase().contains("certificate"),
        "the error should say the certificate was refused: {error}"
    );
    assert!(
        backend.seen().is_empty(),
        "no request may pass a failed handshake"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn https_endpoint_whose_certificate_names_another_host_gets_502() {
    // Trusted CA, but the leaf is only for gpu-node.test while the endpoint is addressed as localhost.
    let pki = pki(&["gpu-node.test"]);
    let ca = TempPem::new(&pki.ca_pem);
    let backend = tls_backend(&pki, &[b"h2", b"http/1.1"]).await;
    let endpoint = format!("https://localhost:{}", backend.port);
    let proxy = start_proxy(config_with(&ca.upstream_yaml(), &[endpoint])).await;

    let (status, body) = get_as_api_internal(&proxy, "/v1/models").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    proxy_error(&body);
    assert!(
        backend.seen().is_empty(),
        "no request may pass a failed handshake"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn gateway_endpoints_get_tongs_salad_api_key_and_never_the_clients() {
    let pki = pki(&["localhost"]);
    let ca = TempPem::new(&pki.ca_pem);
    let gateway = tls_backend(&pki, &[b"h2", b"http/1.1"]).await;
    // A node that is no gateway echoes the key it was sent, if any.
    let pod_ip_node = backend(|request: Request<Incoming>| async move {
        let key = request
            .headers()
            .get("salad-api-key")
            .map_or("none".to_owned(), |v| {
                String::from_utf8_lossy(v.as_bytes()).into_owned()
            });
        Response::new(full(key))
    })
    .await;
    let secrets = TempDir::new("tongs-salad-key");
    let key_file = secrets.0.join("api-key");
    std::fs::write(&key_file, "sk-tongs-gateway\n").unwrap();
    let yaml = format!(
        "{}salad: {{ api_key_file: {:?}, gateways: [\"https://localhost\"] }}\n\
         health: {{ interval: 100ms, timeout: 1s }}\n\
         balancer: {{ policy: least-outstanding }}\n",
        ca.upstream_yaml(),
        key_file.display().to_string()
    );
    let endpoints = [
        format!("https://localhost:{}", gateway.port),
        pod_ip_node.url(),
    ];
    let proxy = start_proxy(config_with(&yaml, &endpoints)).await;

    let mut answers = Vec::new();
    for _ in 0..20 {
        let request = Request::builder()
            .uri(proxy.url("/v1/chat"))
            .header("salad-api-key", "sk-client-own")
            .body(full(""))
            .unwrap();
        answers.push(send(request).await);
    }
    assert!(
        answers.iter().all(|(status, _)| *status == 200),
        "{answers:?}"
    );
    // The non-gateway node got neither key.
    let from_node: Vec<_> = answers
        .iter()
        .filter(|(_, body)| body != "over tls")
        .collect();
    assert!(!from_node.is_empty(), "both endpoints served");
    assert!(
        from_node.iter().all(|(_, body)| body == "none"),
        "{from_node:?}"
    );
    eventually("a heartbeat reaches the gateway", HANG, || {
        gateway.seen().iter().any(|s| s.path_and_query == "/health")
    })
    .await;
    let seen = gateway.seen();
    assert!(seen.iter().any(|s| s.path_and_query == "/v1/chat"));
    assert!(
        seen.iter()
            .all(|s| s.salad_api_key.as_deref() == Some("sk-tongs-gateway")),
        "every request and heartbeat to the gateway carried tongs' key, never the client's: {seen:?}"
    );
    proxy.stop().await;
}

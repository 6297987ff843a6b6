//! A stand-in for SaladCloud's Container Gateway: an HTTPS server on a loopback address of the test's
//! choosing, with a certificate from a CA made in the test, that records the `Salad-Api-Key` (if any)
//! of every request it answers — client traffic and heartbeats alike — so a test sees on the socket
//! who received the key.
//!
//! The certificate names IP addresses (127.0.0.x): no `*.salad.cloud` name resolves to this machine,
//! so tests stand loopback IPs in for gateway hosts, and a `salad.gateways` range for the pattern.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::{Http, full, serve_connections, serve_http};

/// The gateway's CA and certificate, for the IP addresses that stand in for gateway hosts.
pub type GatewayPki = super::tls::TestPki;

/// One request a gateway answered: its path and the `Salad-Api-Key` it carried.
#[derive(Clone, Debug)]
pub struct GatewayRequest {
    pub path: String,
    pub key: Option<String>,
}

/// A recording HTTPS gateway; stops when dropped.
pub struct FakeGateway {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<GatewayRequest>>>,
    stop: CancellationToken,
}

impl FakeGateway {
    /// Starts a gateway on `ip` (an ephemeral port) presenting `pki`'s leaf, speaking HTTP/1.1 or
    /// HTTP/2 as ALPN decides; it answers every request 200 with `name`.
    pub async fn start(pki: &GatewayPki, ip: &str, name: &'static str) -> FakeGateway {
        let acceptor = pki.acceptor(&[b"h2", b"http/1.1"]);
        let ip: IpAddr = ip.parse().expect("an IP address");
        let listener = TcpListener::bind((ip, 0)).await.expect("gateway binds");
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let recorded = Arc::clone(&seen);
        serve_connections(listener, stop.clone(), move |stream, _peer| {
            let (acceptor, seen) = (acceptor.clone(), Arc::clone(&recorded));
            async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let http = if tls.get_ref().1.alpn_protocol() == Some(b"h2".as_slice()) {
                    Http::Two
                } else {
                    Http::One
                };
                serve_http(tls, http, move |request: Request<Incoming>| {
                    seen.lock().unwrap().push(GatewayRequest {
                        path: request.uri().path().to_owned(),
                        key: request
                            .headers()
                            .get("salad-api-key")
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
                    });
                    async move { Response::new(full(name)) }
                })
                .await;
            }
        });
        FakeGateway { addr, seen, stop }
    }

    /// `https://IP:PORT`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Every request answered so far, in order.
    pub fn seen(&self) -> Vec<GatewayRequest> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for FakeGateway {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

//! The TCP half of a connection to an endpoint: direct, or through tailscaled's userspace proxy.
//!
//! A SaladCloud container runs tailscaled with `--tun=userspace-networking` (it is unprivileged), and
//! so does a tongs pod without NET_ADMIN: the pod then has no route to the tailnet, and a connection to
//! a Tailscale address (100.64.0.0/10, fd7a:115c:a1e0::/48) must be handed to tailscaled's SOCKS5
//! server (`--socks5-server`) or HTTP proxy (`--outbound-http-proxy-listen`, CONNECT). [`Route`]
//! decides per destination: an IP literal in `upstream.tailscale.ranges`, or a host name matching
//! `upstream.tailscale.domains` (MagicDNS, `*.ts.net`), goes through the proxy; every other
//! destination is dialled directly. TLS (for `https://` endpoints) runs on top, either way.
//!
//! A name is handed to the proxy as a name, never resolved here: MagicDNS answers only inside the
//! tailnet (tailscaled's resolver, 100.100.100.100), so the cluster's DNS cannot resolve it, and
//! tailscaled resolves the names it is given in a SOCKS5 request (address type 3, what curl calls
//! `socks5h`) or a CONNECT line. hyper-util sends names that way unless told `local_dns`; that is
//! set explicitly, so a change of its default cannot turn every MagicDNS endpoint into a DNS failure.
//!
//! The SOCKS5 and CONNECT handshakes are hyper-util's; this module adds what they leave out: one
//! deadline over proxy connect *and* handshake (`timeouts.connect`), so a proxy that accepts and
//! then stalls cannot hang an attempt, and the scheme's default port, which hyper-util's proxies
//! would otherwise take as 443 for `http://` too.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::proxy::{SocksV5, Tunnel};
use hyper_util::rt::TokioIo;
use ipnet::IpNet;
use tokio::net::TcpStream;
use tower::Service;

use crate::config::{DomainPattern, ProxyKind};
use crate::http::BoxError;

#[derive(Clone, Debug)]
enum Via {
    Socks5(SocksV5<HttpConnector>),
    Connect(Tunnel<HttpConnector>),
}

/// Connects to a destination directly, or through the proxy when it is a Tailscale address.
#[derive(Clone, Debug)]
pub struct Route {
    direct: HttpConnector,
    via: Option<Via>,
    ranges: Vec<IpNet>,
    domains: Vec<DomainPattern>,
    /// Proxy connect plus handshake.
    deadline: Duration,
}

impl Route {
    /// Direct connections only.
    pub fn direct(connector: HttpConnector) -> Route {
        Route {
            deadline: Duration::from_secs(2),
            direct: connector,
            via: None,
            ranges: Vec::new(),
            domains: Vec::new(),
        }
    }

    /// Destinations in `ranges` or `domains` through `proxy`, within `deadline`; the rest directly.
    pub fn with_proxy(
        connector: HttpConnector,
        kind: ProxyKind,
        proxy: Uri,
        ranges: Vec<IpNet>,
        domains: Vec<DomainPattern>,
        deadline: Duration,
    ) -> Route {
        let via = match kind {
            // Names go to tailscaled as names (see the module's doc).
            ProxyKind::Socks5 => {
                Via::Socks5(SocksV5::new(proxy, connector.clone()).local_dns(false))
            }
            ProxyKind::Connect => Via::Connect(Tunnel::new(proxy, connector.clone())),
        };
        Route {
            direct: connector,
            via: Some(via),
            ranges,
            domains,
            deadline,
        }
    }

    /// Whether a connection to `dst` goes through the proxy.
    pub fn proxied(&self, dst: &Uri) -> bool {
        let Some(host) = dst.host().filter(|_| self.via.is_some()) else {
            return false;
        };
        match host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            Ok(ip) => self.ranges.iter().any(|range| range.contains(&ip)),
            Err(_) => self.domains.iter().any(|pattern| pattern.matches(host)),
        }
    }
}

/// Why a proxied connection failed: the proxy and the destination are both named, so an operator can
/// tell a dead tailscaled from a dead node.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("through tailscaled's proxy to {dst}")]
    Proxy { dst: String, source: BoxError },
    #[error("{dst} is a Tailscale address but no upstream.tailscale.proxy is configured")]
    NoProxy { dst: String },
    #[error("through tailscaled's proxy to {dst}: no connection within {after:?}")]
    Timeout { dst: String, after: Duration },
}

/// Fills in the scheme's default port, so the proxy is asked for the right one.
fn with_port(dst: Uri) -> Uri {
    if dst.port().is_some() {
        return dst;
    }
    let port = if dst.scheme() == Some(&http::uri::Scheme::HTTPS) {
        443
    } else {
        80
    };
    let (Some(scheme), Some(host)) = (dst.scheme_str(), dst.host()) else {
        return dst;
    };
    format!("{scheme}://{host}:{port}/").parse().unwrap_or(dst)
}

impl Service<Uri> for Route {
    type Response = TokioIo<TcpStream>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Both connectors are always ready: HttpConnector is, and the proxies only wrap it.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        if !self.proxied(&dst) {
            let connecting = self.direct.call(dst);
            return Box::pin(async move { connecting.await.map_err(Into::into) });
        }
        let dst = with_port(dst);
        let name = dst
            .authority()
            .map_or_else(String::new, |a| a.as_str().to_owned());
        let deadline = self.deadline;
        let connecting: Pin<Box<dyn Future<Output = Result<_, BoxError>> + Send>> =
            match self.via.clone() {
                Some(Via::Socks5(mut socks)) => {
                    let fut = socks.call(dst);
                    Box::pin(async move { fut.await.map_err(Into::into) })
                }
                Some(Via::Connect(mut tunnel)) => {
                    let fut = tunnel.call(dst);
                    Box::pin(async move { fut.await.map_err(Into::into) })
                }
                None => {
                    let error = RouteError::NoProxy { dst: name.clone() };
                    Box::pin(async move { Err(error.into()) })
                }
            };
        Box::pin(async move {
            match tokio::time::timeout(deadline, connecting).await {
                Ok(Ok(stream)) => Ok(stream),
                Ok(Err(source)) => Err(RouteError::Proxy { dst: name, source }.into()),
                Err(_) => Err(RouteError::Timeout {
                    dst: name,
                    after: deadline,
                }
                .into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_proxy;

    fn route() -> Route {
        let (kind, proxy) = parse_proxy("socks5://127.0.0.1:1055").unwrap();
        Route::with_proxy(
            HttpConnector::new(),
            kind,
            proxy,
            vec![
                "100.64.0.0/10".parse().unwrap(),
                "fd7a:115c:a1e0::/48".parse().unwrap(),
            ],
            vec![DomainPattern::parse("*.ts.net").unwrap()],
            Duration::from_secs(1),
        )
    }

    /// A route whose proxy is `kind` on `port`, for the default ranges and domains.
    fn route_to(kind: &str, port: u16) -> Route {
        let (kind, proxy) = parse_proxy(&format!("{kind}://127.0.0.1:{port}")).unwrap();
        let defaults = crate::config::TailscaleConfig::default();
        Route::with_proxy(
            HttpConnector::new(),
            kind,
            proxy,
            defaults.parsed_ranges(),
            defaults.parsed_domains(),
            Duration::from_secs(5),
        )
    }

    /// A MagicDNS name that resolves nowhere but inside a tailnet (there is none here).
    const MAGIC: &str = "gpu-1.tailnet-name.ts.net";

    #[test]
    fn magicdns_names_go_through_the_proxy_and_other_names_do_not() {
        let route = route();
        let proxied = |uri: &str| route.proxied(&uri.parse().unwrap());
        assert!(proxied(&format!("http://{MAGIC}:8000/")));
        assert!(proxied("https://Tongs.Tailnet-Name.TS.NET/"));
        assert!(!proxied("http://ts.net/"));
        assert!(!proxied("http://gpu-1.ts.net.example.com/"));
        assert!(!proxied("http://inference.gpu.svc:8000/"));
        assert!(
            !Route::direct(HttpConnector::new())
                .proxied(&format!("http://{MAGIC}/").parse().unwrap())
        );
    }

    /// Reads one SOCKS5 CONNECT request (no authentication), answers success, and returns the
    /// address type, the address bytes and the port it asked for.
    async fn socks5_request(stream: &mut TcpStream) -> (u8, Vec<u8>, u16) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut head = [0u8; 2];
        stream.read_exact(&mut head).await.unwrap();
        let mut methods = vec![0u8; head[1] as usize];
        stream.read_exact(&mut methods).await.unwrap();
        stream.write_all(&[5, 0]).await.unwrap();
        let mut request = [0u8; 4];
        stream.read_exact(&mut request).await.unwrap();
        assert_eq!(&request[..3], &[5, 1, 0], "a SOCKS5 CONNECT");
        let address = match request[3] {
            1 => 4,
            4 => 16,
            3 => stream.read_u8().await.unwrap() as usize,
            other => panic!("address type {other}"),
        };
        let mut address_bytes = vec![0u8; address];
        stream.read_exact(&mut address_bytes).await.unwrap();
        let port = stream.read_u16().await.unwrap();
        stream
            .write_all(&[5, 0, 0, 1, 127, 0, 0, 1, 0, 80])
            .await
            .unwrap();
        (request[3], address_bytes, port)
    }

    #[tokio::test]
    async fn a_magicdns_name_reaches_socks5_as_a_name_never_resolved_here() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            socks5_request(&mut stream).await
        });
        let mut route = route_to("socks5", port);
        route
            .call(format!("http://{MAGIC}:8000/").parse().unwrap())
            .await
            .expect("the proxy's success is the connection's");
        let (atyp, address, asked_port) = server.await.unwrap();
        assert_eq!(atyp, 3, "address type 3: a domain name");
        assert_eq!(String::from_utf8(address).unwrap(), MAGIC);
        assert_eq!(asked_port, 8000);
    }

    #[tokio::test]
    async fn a_magicdns_name_reaches_http_connect_as_host_and_port() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                head.push(stream.read_u8().await.unwrap());
            }
            stream
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await
                .unwrap();
            String::from_utf8(head).unwrap()
        });
        let mut route = route_to("http", port);
        // No port: the scheme's (443) is asked for, not left to the proxy.
        route
            .call(format!("https://{MAGIC}/").parse().unwrap())
            .await
            .expect("the tunnel is the connection");
        let head = server.await.unwrap();
        assert!(
            head.starts_with(&format!("CONNECT {MAGIC}:443 HTTP/1.1\r\n")),
            "{head}"
        );
    }

    #[test]
    fn only_tailscale_ip_literals_go_through_the_proxy() {
        let route = route();
        let proxied = |uri: &str| route.proxied(&uri.parse().unwrap());
        assert!(proxied("http://100.101.102.103:8000/"));
        assert!(proxied("https://[fd7a:115c:a1e0::7]:8443/"));
        assert!(!proxied("http://10.1.2.3:8000/"));
        assert!(!proxied("https://tamarind-x.salad.cloud/"));
        assert!(!proxied("http://100.128.0.1:8000/"));
        assert!(
            !Route::direct(HttpConnector::new()).proxied(&"http://100.64.0.1:1/".parse().unwrap())
        );
    }

    #[test]
    fn default_ports_are_made_explicit() {
        assert_eq!(
            with_port("http://100.64.0.1/".parse().unwrap()).port_u16(),
            Some(80)
        );
        assert_eq!(
            with_port("https://100.64.0.1".parse().unwrap()).port_u16(),
            Some(443)
        );
        assert_eq!(
            with_port("http://[fd7a:115c:a1e0::1]:9/".parse().unwrap()).port_u16(),
            Some(9)
        );
    }
}

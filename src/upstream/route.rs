//! The TCP half of a connection to an endpoint: direct, or through tailscaled's userspace proxy.
//!
//! A SaladCloud container runs tailscaled with `--tun=userspace-networking` (it is unprivileged), and
//! so does a tongs pod without NET_ADMIN: the pod then has no route to the tailnet, and a connection to
//! a Tailscale address (100.64.0.0/10, fd7a:115c:a1e0::/48) must be handed to tailscaled's SOCKS5
//! server (`--socks5-server`) or HTTP proxy (`--outbound-http-proxy-listen`, CONNECT). [`Route`]
//! decides per destination: an IP literal in `upstream.tailscale.ranges` goes through the proxy, every
//! other destination is dialled directly. TLS (for `https://` endpoints) runs on top, either way.
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

use crate::config::ProxyKind;
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
        }
    }

    /// Destinations in `ranges` through `proxy`, within `deadline`; the rest directly.
    pub fn with_proxy(
        connector: HttpConnector,
        kind: ProxyKind,
        proxy: Uri,
        ranges: Vec<IpNet>,
        deadline: Duration,
    ) -> Route {
        let via = match kind {
            ProxyKind::Socks5 => Via::Socks5(SocksV5::new(proxy, connector.clone())),
            ProxyKind::Connect => Via::Connect(Tunnel::new(proxy, connector.clone())),
        };
        Route {
            direct: connector,
            via: Some(via),
            ranges,
            deadline,
        }
    }

    /// Whether a connection to `dst` goes through the proxy.
    pub fn proxied(&self, dst: &Uri) -> bool {
        self.via.is_some()
            && dst
                .host()
                .map(|host| host.trim_start_matches('[').trim_end_matches(']'))
                .and_then(|host| host.parse::<IpAddr>().ok())
                .is_some_and(|ip| self.ranges.iter().any(|range| range.contains(&ip)))
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
            Duration::from_secs(1),
        )
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

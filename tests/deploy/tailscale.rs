//! The Tailscale sidecar and `upstream.tailscale.proxy`: with the sidecar tongs dials through it, and
//! a proxy on the pod's loopback is one the sidecar serves.

use k8s_openapi::api::core::v1::PodSpec;
use tongs::config::Config;
use tongs::config::{ProxyKind, parse_proxy};

use crate::pods::TongsPod;
use crate::problems::Problems;

/// tailscaled's proxies in tongs' pod, from its sidecar's environment: kind and listen address.
fn tailscale_listeners(spec: &PodSpec) -> Vec<(ProxyKind, String)> {
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    let variables = containers.flat_map(|container| container.env.iter().flatten());
    variables
        .filter_map(|var| {
            let kind = match var.name.as_str() {
                "TS_SOCKS5_SERVER" => ProxyKind::Socks5,
                "TS_OUTBOUND_HTTP_PROXY_LISTEN" => ProxyKind::Connect,
                _ => return None,
            };
            let listen = var.value.as_deref().filter(|value| !value.is_empty())?;
            Some((kind, listen.to_owned()))
        })
        .collect()
}

fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A Tailscale sidecar and `upstream.tailscale.proxy` go together: with the sidecar tongs must use
/// it (a pod without a TUN device cannot dial Tailscale addresses), and a proxy on the pod's loopback
/// must be one the sidecar serves, of that kind, on that port.
pub(crate) fn check_tailscale_proxy(
    at: &str,
    tongs: &TongsPod,
    config: &Config,
    problems: &mut Problems,
) {
    let listeners = tailscale_listeners(tongs.spec);
    let proxy = &config.upstream.tailscale.proxy;
    if proxy.is_empty() {
        ensure!(
            problems,
            at,
            listeners.is_empty(),
            "tongs' pod runs tailscaled's proxy ({listeners:?}), but upstream.tailscale.proxy is empty: \
             tongs would dial Tailscale addresses directly, which its pod cannot"
        );
        return;
    }
    // A proxy that does not parse is reported by validation.
    let Ok((kind, dial)) = parse_proxy(proxy) else {
        return;
    };
    let Some(authority) = dial.authority() else {
        return;
    };
    if !is_loopback(authority.host()) {
        return;
    }
    let port = authority.port_u16();
    let served = listeners.iter().any(|(listener, listen)| {
        *listener == kind
            && listen.rsplit_once(':').is_some_and(|(host, listen_port)| {
                (host.is_empty() || is_loopback(host)) && listen_port.parse().ok() == port
            })
    });
    ensure!(
        problems,
        at,
        served,
        "upstream.tailscale.proxy {proxy} is on tongs' own pod, but no container there serves that \
         kind of proxy on that port (tailscaled's sidecar: {listeners:?})"
    );
}

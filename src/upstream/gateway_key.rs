//! `Salad-Api-Key` on the way out: the one place that decides which requests carry the key.
//!
//! Every request tongs sends to an endpoint (client traffic and heartbeats) passes through
//! [`GatewayKey::apply`]: whatever `Salad-Api-Key` the client sent is removed — a client's key must not
//! travel to whichever node the balancer picks, and tongs' own must not be overridden — and tongs'
//! key is added only to a gateway someone trusted vouches for:
//!
//! - the endpoint matches `salad.gateways` (URL patterns: the most the key may ever reach), **and**
//! - either `discovery.static` names it (scheme, host and port: the operator wrote it), or its host is
//!   one the SaladCloud API returned as the gateway (`networking.dns`) of a container group of
//!   `salad.api.organization` and `project` ([`GatewayKey::confirm`], fed by pod discovery), reached
//!   over `https://`.
//!
//! A pattern alone vouches for nothing: `https://*.salad.cloud` matches every SaladCloud customer's
//! gateway, and whoever can annotate a pod could otherwise name their own gateway in its url
//! annotation and receive the organisation's key in every heartbeat. Such a gateway still gets the
//! pod's traffic if the allowlist admits it, but no key until the API confirms the host.
//!
//! The value is marked sensitive, so hyper's HTTP/2 encoder never indexes it and `Debug` prints no key.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, ArcSwapOption};
use http::{HeaderMap, HeaderName, HeaderValue, Uri};

use crate::config::{AllowRule, Config, EndpointUrl};

/// The header SaladCloud authenticates with.
pub static SALAD_API_KEY: HeaderName = HeaderName::from_static("salad-api-key");

/// An endpoint's scheme, host (lowercase, IPv6 in brackets) and port (the scheme's default when
/// the URL has none).
type Place = (String, String, u16);

fn place(scheme: &str, authority: &http::uri::Authority) -> Place {
    let scheme = scheme.to_ascii_lowercase();
    let port = authority
        .port_u16()
        .unwrap_or(if scheme == "https" { 443 } else { 80 });
    (scheme, authority.host().to_ascii_lowercase(), port)
}

/// The key and where it may go, from the configuration.
struct Key {
    value: HeaderValue,
    /// `salad.gateways`: the most the key may reach.
    gateways: Vec<AllowRule>,
    /// The `discovery.static` endpoints: the operator named them.
    statics: HashSet<Place>,
}

/// The key in force, replaced by a reload, and the gateway hosts the SaladCloud API confirmed,
/// replaced by pod discovery.
#[derive(Default)]
pub struct GatewayKey {
    current: ArcSwapOption<Key>,
    /// Every pool's confirmed hosts together (what [`GatewayKey::apply`] reads).
    confirmed: ArcSwap<HashSet<String>>,
    /// The confirmed hosts by pool: each pool's discovery replaces its own.
    by_pool: Mutex<HashMap<String, HashSet<String>>>,
}

impl std::fmt::Debug for GatewayKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayKey")
            .field("configured", &self.current.load().is_some())
            .field("confirmed", &self.confirmed.load().len())
            .finish()
    }
}

impl GatewayKey {
    /// Holds `key` (none: no key is sent), for `config.salad.gateways` vouched for by
    /// `config.discovery.static` or the SaladCloud API.
    pub fn set(&self, config: &Config, key: Option<&str>) {
        let key = key
            .and_then(|key| HeaderValue::from_str(key).ok())
            .map(|mut value| {
                value.set_sensitive(true);
                Arc::new(Key {
                    value,
                    gateways: config.salad.gateway_rules(),
                    // Every pool's static endpoints: the operator named each.
                    statics: config
                        .discovery
                        .static_endpoints
                        .iter()
                        .chain(
                            config
                                .pools
                                .iter()
                                .flat_map(|pool| &pool.discovery.static_endpoints),
                        )
                        .filter_map(|endpoint| EndpointUrl::parse(&endpoint.url).ok())
                        .map(|url| place(url.scheme.as_str(), &url.authority))
                        .collect(),
                })
            });
        self.current.store(key);
    }

    /// Replaces the gateway hosts the SaladCloud API returned for this organisation and project, for
    /// the pods of `pool` (lowercase host names, as `networking.dns` gives them).
    pub fn confirm(&self, pool: &str, hosts: HashSet<String>) {
        let mut by_pool = self.by_pool.lock().unwrap_or_else(|p| p.into_inner());
        if by_pool.get(pool) == Some(&hosts) {
            return;
        }
        by_pool.insert(pool.to_owned(), hosts);
        let all: HashSet<String> = by_pool.values().flatten().cloned().collect();
        self.confirmed.store(Arc::new(all));
    }

    /// Whether `host` is a gateway the SaladCloud API confirmed.
    pub fn confirmed(&self, host: &str) -> bool {
        self.confirmed.load().contains(&host.to_ascii_lowercase())
    }

    /// Strips any client-sent key from `headers` and adds tongs' own when `uri` is a gateway tongs
    /// may send it to (see the module's documentation).
    pub fn apply(&self, uri: &Uri, headers: &mut HeaderMap) {
        headers.remove(&SALAD_API_KEY);
        let current = self.current.load();
        let Some(key) = current.as_ref() else {
            return;
        };
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return;
        };
        let place = place(scheme, authority);
        let (scheme, host, port) = (&place.0, &place.1, place.2);
        let within = key
            .gateways
            .iter()
            .any(|rule| rule.allows_url(scheme, host, port));
        if !within {
            return;
        }
        let vouched = key.statics.contains(&place)
            || (scheme == "https" && self.confirmed.load().contains(host.as_str()));
        if vouched {
            headers.insert(&SALAD_API_KEY, key.value.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(key: &GatewayKey, uri: &str, sent: Option<&str>) -> Option<String> {
        let mut headers = HeaderMap::new();
        if let Some(sent) = sent {
            headers.insert(&SALAD_API_KEY, HeaderValue::from_str(sent).unwrap());
        }
        key.apply(&uri.parse().unwrap(), &mut headers);
        headers
            .get(&SALAD_API_KEY)
            .map(|v| v.to_str().unwrap().to_owned())
    }

    fn config(statics: &[&str]) -> Config {
        let mut config = Config::default();
        config.discovery.static_endpoints = statics
            .iter()
            .map(|url| crate::config::StaticEndpoint {
                url: (*url).to_owned(),
                weight: 1,
                max_outstanding: None,
                engine: None,
            })
            .collect();
        config
    }

    #[test]
    fn the_key_goes_to_vouched_gateways_only_and_client_keys_never_pass() {
        let key = GatewayKey::default();
        key.set(&config(&["https://static-1.salad.cloud"]), Some("sk-tongs"));
        // Named by discovery.static.
        assert_eq!(
            applied(
                &key,
                "https://static-1.salad.cloud/v1/chat",
                Some("sk-client")
            )
            .as_deref(),
            Some("sk-tongs")
        );
        assert_eq!(
            applied(&key, "https://STATIC-1.salad.cloud:443/", None).as_deref(),
            Some("sk-tongs")
        );
        // The same host on another port is another endpoint, which static config does not name.
        assert_eq!(
            applied(&key, "https://static-1.salad.cloud:8443/", None),
            None
        );
        // Matching salad.gateways is not enough: a gateway an annotation names gets nothing...
        assert_eq!(
            applied(
                &key,
                "https://attacker-owned.salad.cloud/",
                Some("sk-client")
            ),
            None
        );
        // ... until the SaladCloud API confirms it as one of this project's gateways.
        key.confirm(
            "default",
            HashSet::from(["attacker-owned.salad.cloud".to_owned()]),
        );
        assert!(key.confirmed("Attacker-Owned.salad.cloud"));
        assert_eq!(
            applied(&key, "https://attacker-owned.salad.cloud/", None).as_deref(),
            Some("sk-tongs")
        );
        // Not over plain HTTP, and never outside salad.gateways.
        assert_eq!(
            applied(&key, "http://attacker-owned.salad.cloud/", None),
            None
        );
        key.confirm("default", HashSet::from(["gpu.example".to_owned()]));
        assert_eq!(applied(&key, "https://gpu.example/", None), None);
        assert_eq!(
            applied(&key, "https://attacker-owned.salad.cloud/", None),
            None
        );
        assert_eq!(
            applied(&key, "http://100.64.0.1:8000/", Some("sk-client")),
            None
        );
        assert_eq!(
            applied(&key, "https://salad.cloud.evil.example/", None),
            None
        );
        let none = GatewayKey::default();
        none.confirm("default", HashSet::from(["a.salad.cloud".to_owned()]));
        assert_eq!(
            applied(&none, "https://a.salad.cloud/", Some("sk-client")),
            None
        );
    }

    #[test]
    fn a_reload_keeps_the_confirmed_hosts_and_renames_the_static_ones() {
        let key = GatewayKey::default();
        key.set(&config(&["https://a.salad.cloud"]), Some("sk-1"));
        key.confirm("default", HashSet::from(["c.salad.cloud".to_owned()]));
        key.set(&config(&["https://b.salad.cloud"]), Some("sk-2"));
        assert_eq!(applied(&key, "https://a.salad.cloud/", None), None);
        assert_eq!(
            applied(&key, "https://b.salad.cloud/", None).as_deref(),
            Some("sk-2")
        );
        assert_eq!(
            applied(&key, "https://c.salad.cloud/", None).as_deref(),
            Some("sk-2")
        );
    }

    #[test]
    fn debug_shows_no_key() {
        let key = GatewayKey::default();
        key.set(&config(&["https://a.salad.cloud"]), Some("sk-secret"));
        assert!(!format!("{key:?}").contains("sk-secret"));
    }
}

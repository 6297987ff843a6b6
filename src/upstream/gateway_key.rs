//! `Salad-Api-Key` on the way out: the one place that decides which requests carry the key.
//!
//! Every request tongs sends to an endpoint (client traffic and heartbeats) passes through
//! [`GatewayKey::apply`]: whatever `Salad-Api-Key` the client sent is removed — a client's key must not
//! travel to whichever node the balancer picks, and tongs' own must not be overridden — and tongs'
//! key is added only when the endpoint matches `salad.gateways`. The value is marked sensitive, so
//! hyper's HTTP/2 encoder never indexes it and `Debug` prints no key.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use http::{HeaderMap, HeaderName, HeaderValue, Uri};

use crate::config::{AllowRule, SaladConfig};

/// The header SaladCloud authenticates with.
pub static SALAD_API_KEY: HeaderName = HeaderName::from_static("salad-api-key");

/// The key and where it may go.
struct Key {
    value: HeaderValue,
    gateways: Vec<AllowRule>,
}

/// The key in force, replaced by a reload.
#[derive(Default)]
pub struct GatewayKey {
    current: ArcSwapOption<Key>,
}

impl std::fmt::Debug for GatewayKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayKey")
            .field("configured", &self.current.load().is_some())
            .finish()
    }
}

impl GatewayKey {
    /// Holds `key` (none: no key is sent), for the endpoints `config.gateways` names.
    pub fn set(&self, config: &SaladConfig, key: Option<&str>) {
        let key = key
            .and_then(|key| HeaderValue::from_str(key).ok())
            .map(|mut value| {
                value.set_sensitive(true);
                Arc::new(Key {
                    value,
                    gateways: config.gateway_rules(),
                })
            });
        self.current.store(key);
    }

    /// Strips any client-sent key from `headers` and adds tongs' own when `uri` is a gateway's.
    pub fn apply(&self, uri: &Uri, headers: &mut HeaderMap) {
        headers.remove(&SALAD_API_KEY);
        let current = self.current.load();
        let Some(key) = current.as_ref() else {
            return;
        };
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return;
        };
        let port = authority
            .port_u16()
            .unwrap_or(if scheme == "https" { 443 } else { 80 });
        if key
            .gateways
            .iter()
            .any(|rule| rule.allows_url(scheme, authority.host(), port))
        {
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

    #[test]
    fn the_key_goes_to_gateways_only_and_client_keys_never_pass() {
        let key = GatewayKey::default();
        key.set(&SaladConfig::default(), Some("sk-tongs"));
        assert_eq!(
            applied(&key, "https://a-b.salad.cloud/v1/chat", Some("sk-client")).as_deref(),
            Some("sk-tongs")
        );
        assert_eq!(applied(&key, "http://a-b.salad.cloud/", None), None);
        assert_eq!(
            applied(&key, "http://100.64.0.1:8000/", Some("sk-client")),
            None
        );
        assert_eq!(
            applied(&key, "https://salad.cloud.evil.example/", None),
            None
        );
        let none = GatewayKey::default();
        assert_eq!(
            applied(&none, "https://a.salad.cloud/", Some("sk-client")),
            None
        );
    }

    #[test]
    fn debug_shows_no_key() {
        let key = GatewayKey::default();
        key.set(&SaladConfig::default(), Some("sk-secret"));
        assert!(!format!("{key:?}").contains("sk-secret"));
    }
}

//! Inbound API keys: which tenant a request comes from, decided from its `Authorization: Bearer` key
//! before anything else of it is read, and the tenants' counts.
//!
//! Keys are kept only as SHA-256 digests and looked up by digest: the map's hashing and comparison
//! then work on values that say nothing about a key, and no key stays in memory as text once the
//! file is read. A key never goes further than here: the header is taken off the request before it
//! reaches a pool (a pool's own `api_key_file` may put another one on), and logs and metrics name the
//! tenant, never the key.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use http::{HeaderMap, header};

use crate::admission::{Priority, Tenant, TenantSettings};
use crate::config::{AuthConfig, TenantConfig, TenantPriority, parse_keys};

/// A key's digest.
type Digest = [u8; 32];

/// Who a request is, as its key says.
pub enum Identified {
    /// No keys are configured: every request is let in, as nobody's.
    Open,
    Tenant(Arc<Tenant>),
    /// Keys are on and the request presented none (or not as a bearer token).
    Missing,
    /// Keys are on and the request presented one that is no tenant's.
    Unknown,
}

/// The keys and tenants in force, replaced whole by a reload.
#[derive(Default)]
struct Keys {
    on: bool,
    by_digest: HashMap<Digest, Arc<Tenant>>,
    /// Every tenant, by name (the metrics list them all).
    tenants: BTreeMap<String, Arc<Tenant>>,
}

/// The tenants and their keys.
#[derive(Default)]
pub struct Tenants {
    keys: ArcSwap<Keys>,
    /// Requests refused for want of a key: missing, unknown.
    missing: AtomicU64,
    unknown: AtomicU64,
}

/// Why the keys file could not be used (the keys in force stay).
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("cannot read auth.keys_file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("auth.keys_file {path} is invalid:\n  - {}", .problems.join("\n  - "))]
    Invalid { path: String, problems: Vec<String> },
}

impl Tenants {
    /// Applies `config`: reads the keys file again (a rotated Secret takes effect), keeps each tenant
    /// that stays (its counts with it) and gives every tenant its settings. A file that cannot be read
    /// or is invalid changes nothing.
    pub fn apply(&self, config: &AuthConfig) -> Result<(), KeysError> {
        let Some(path) = &config.keys_file else {
            self.keys.store(Arc::default());
            return Ok(());
        };
        let by_key = read_keys(path)?;
        let before = self.keys.load_full();
        let mut tenants: BTreeMap<String, Arc<Tenant>> = BTreeMap::new();
        let names = by_key.values().chain(config.tenants.keys());
        for name in names {
            if tenants.contains_key(name) {
                continue;
            }
            let settings = settings(config.tenants.get(name));
            let tenant = match before.tenants.get(name) {
                Some(kept) => {
                    kept.set_settings(settings);
                    Arc::clone(kept)
                }
                None => Tenant::new(name, settings),
            };
            tenants.insert(name.clone(), tenant);
        }
        let by_digest = by_key
            .iter()
            .filter_map(|(key, name)| {
                Some((digest(key.as_bytes()), Arc::clone(tenants.get(name)?)))
            })
            .collect();
        self.keys.store(Arc::new(Keys {
            on: true,
            by_digest,
            tenants,
        }));
        Ok(())
    }

    /// Whether keys are asked for.
    pub fn on(&self) -> bool {
        self.keys.load().on
    }

    /// The tenant `headers` name by their bearer key.
    pub fn identify(&self, headers: &HeaderMap) -> Identified {
        let keys = self.keys.load();
        if !keys.on {
            return Identified::Open;
        }
        let Some(key) = bearer(headers) else {
            self.missing.fetch_add(1, Ordering::Relaxed);
            return Identified::Missing;
        };
        match keys.by_digest.get(&digest(key)) {
            Some(tenant) => Identified::Tenant(Arc::clone(tenant)),
            None => {
                self.unknown.fetch_add(1, Ordering::Relaxed);
                Identified::Unknown
            }
        }
    }

    /// Every tenant now, by name.
    pub fn all(&self) -> Vec<Arc<Tenant>> {
        self.keys.load().tenants.values().cloned().collect()
    }

    /// Requests refused for want of a key so far: (missing, unknown).
    pub fn failures(&self) -> (u64, u64) {
        (
            self.missing.load(Ordering::Relaxed),
            self.unknown.load(Ordering::Relaxed),
        )
    }
}

fn read_keys(path: &Path) -> Result<HashMap<String, String>, KeysError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| KeysError::Read {
        path: shown.clone(),
        source,
    })?;
    parse_keys(&text).map_err(|problems| KeysError::Invalid {
        path: shown,
        problems,
    })
}

fn settings(config: Option<&TenantConfig>) -> TenantSettings {
    let config = config.cloned().unwrap_or_default();
    TenantSettings {
        weight: config.weight.max(1),
        priority: config.priority.map(|p| match p {
            TenantPriority::High => Priority::High,
            TenantPriority::Normal => Priority::Normal,
            TenantPriority::Low => Priority::Low,
        }),
        max_queued: config.max_queued,
        max_in_flight: config.max_in_flight,
    }
}

/// The key of `Authorization: Bearer <key>` (the scheme in any case, as RFC 7235 has it).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let key = rest.trim_ascii();
    (!key.is_empty()).then_some(key)
}

fn digest(key: &[u8]) -> Digest {
    let mut out = [0; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, key).as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(authorization: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, authorization.parse().unwrap());
        headers
    }

    #[test]
    fn bearer_keys_are_read_in_any_case_and_nothing_else_is() {
        assert_eq!(bearer(&headers("Bearer sk-abc")), Some(&b"sk-abc"[..]));
        assert_eq!(bearer(&headers("bearer  sk-abc ")), Some(&b"sk-abc"[..]));
        assert_eq!(bearer(&headers("Basic dXNlcjpwYXNz")), None);
        assert_eq!(bearer(&headers("Bearer ")), None);
        assert_eq!(bearer(&headers("Bear")), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }

    #[test]
    fn keys_name_tenants_and_a_reload_keeps_their_counts() {
        let dir = std::env::temp_dir().join(format!("tongs-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys.yaml");
        std::fs::write(&file, "team-a: [\"sk-team-a-0123456789abcdef\"]\n").unwrap();
        let tenants = Tenants::default();
        assert!(matches!(
            tenants.identify(&headers("Bearer anything")),
            Identified::Open
        ));
        let mut config = AuthConfig {
            keys_file: Some(file.clone()),
            ..AuthConfig::default()
        };
        tenants.apply(&config).expect("applies");
        let Identified::Tenant(a) = tenants.identify(&headers("Bearer sk-team-a-0123456789abcdef"))
        else {
            panic!("team-a's key names team-a");
        };
        assert_eq!(&**a.name(), "team-a");
        assert!(matches!(
            tenants.identify(&headers("Bearer sk-team-a-0123456789abcdeF")),
            Identified::Unknown
        ));
        assert!(matches!(
            tenants.identify(&HeaderMap::new()),
            Identified::Missing
        ));
        assert_eq!(tenants.failures(), (1, 1));

        let held = a.enter().expect("in flight");
        config.tenants.insert(
            "team-a".into(),
            TenantConfig {
                weight: 5,
                ..TenantConfig::default()
            },
        );
        tenants.apply(&config).expect("reloads");
        let Identified::Tenant(again) =
            tenants.identify(&headers("Bearer sk-team-a-0123456789abcdef"))
        else {
            panic!("still team-a");
        };
        assert!(Arc::ptr_eq(&a, &again), "the same tenant, its counts kept");
        assert_eq!(again.settings().weight, 5);
        assert_eq!(again.in_flight(), 1);
        drop(held);

        // A broken file keeps the keys in force.
        std::fs::write(&file, "team-a: [\"short\"]\n").unwrap();
        let error = tenants.apply(&config).expect_err("invalid").to_string();
        assert!(
            error.contains("tenant team-a, key 1: must be 16"),
            "{error}"
        );
        assert!(matches!(
            tenants.identify(&headers("Bearer sk-team-a-0123456789abcdef")),
            Identified::Tenant(_)
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

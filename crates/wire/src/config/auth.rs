//! `auth`: inbound API keys, which name the tenant a request comes from, and what each tenant may take.
//!
//! The keys live in a file of their own (`keys_file`, mounted from a Secret), read when tongs starts
//! and on every reload; the configuration names only the file and the tenants' settings, so it can sit
//! in a ConfigMap. The keys file maps each tenant to its keys (several, so a key can be rotated without
//! a gap):
//!
//! ```yaml
//! team-a: ["sk-team-a-0123456789abcdef"]
//! team-b: ["sk-team-b-0123456789abcdef", "sk-team-b-new-0123456789ab"]
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Problem;

/// Shortest key accepted: anything shorter is guessable, not a credential.
pub const MIN_KEY_LENGTH: usize = 16;
/// Longest key accepted.
pub const MAX_KEY_LENGTH: usize = 512;

/// Inbound API keys and tenants.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The keys file (tenant → keys); unset: no key is asked for, and there are no tenants.
    pub keys_file: Option<PathBuf>,
    /// Settings per tenant, by name; a tenant of the keys file not listed here gets the defaults, and
    /// one listed here with no key serves nobody.
    pub tenants: BTreeMap<String, TenantConfig>,
}

/// What one tenant may take.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantConfig {
    /// Its share of the queue against other tenants waiting at the same priority (1 to 1000).
    pub weight: u32,
    /// The priority of all its requests, in place of the priority header (so a client cannot promote
    /// itself); unset: the header decides.
    pub priority: Option<TenantPriority>,
    /// Requests it may have waiting at once; more are refused with 429 (0: no cap of its own).
    pub max_queued: u64,
    /// Requests it may have in tongs at once, waiting or at an endpoint; more are refused with 429
    /// (0: no cap of its own).
    pub max_in_flight: u64,
}

impl Default for TenantConfig {
    fn default() -> Self {
        TenantConfig {
            weight: 1,
            priority: None,
            max_queued: 0,
            max_in_flight: 0,
        }
    }
}

/// A tenant's fixed priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantPriority {
    High,
    Normal,
    Low,
}

impl AuthConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if self
            .keys_file
            .as_ref()
            .is_some_and(|path| path.as_os_str().is_empty())
        {
            problem(
                "auth.keys_file".into(),
                "must not be empty (leave it unset)".into(),
            );
        }
        for (name, tenant) in &self.tenants {
            let at = format!("auth.tenants.{name}");
            if let Err(message) = tenant_name(name) {
                problem(at.clone(), message);
            }
            if !(1..=1000).contains(&tenant.weight) {
                problem(
                    format!("{at}.weight"),
                    format!("must be 1 to 1000, got {}", tenant.weight),
                );
            }
        }
    }
}

/// A tenant name: it is a metric label value and a log field, so `[a-z0-9-]`, 1 to 63 characters.
pub fn tenant_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tenant name {name:?} must be 1 to 63 of a-z, 0-9 and '-'"
        ))
    }
}

/// The keys file, read: each key's tenant. Errors name the tenant and the key's position, never a key.
pub fn parse_keys(text: &str) -> Result<HashMap<String, String>, Vec<String>> {
    let tenants: BTreeMap<String, Vec<String>> = serde_saphyr::from_str(text).map_err(|err| {
        vec![format!(
            "not a map of tenant names to lists of keys: {}",
            // The parser's message may quote the text it stopped at, which may be a key: keep only
            // where it stopped.
            err.to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .split(':')
                .next()
                .unwrap_or_default()
        )]
    })?;
    let mut problems = Vec::new();
    let mut keys: HashMap<String, String> = HashMap::new();
    for (tenant, list) in &tenants {
        if let Err(message) = tenant_name(tenant) {
            problems.push(message);
        }
        if list.is_empty() {
            problems.push(format!("tenant {tenant} has no key"));
        }
        for (index, key) in list.iter().enumerate() {
            let at = format!("tenant {tenant}, key {}", index + 1);
            if !(MIN_KEY_LENGTH..=MAX_KEY_LENGTH).contains(&key.len()) {
                problems.push(format!(
                    "{at}: must be {MIN_KEY_LENGTH} to {MAX_KEY_LENGTH} characters, got {}",
                    key.len()
                ));
            } else if !key.bytes().all(is_token68) {
                problems.push(format!(
                    "{at}: must be a bearer token (letters, digits and - . _ ~ + / =)"
                ));
            }
            if let Some(other) = keys.insert(key.clone(), tenant.clone())
                && other != *tenant
            {
                problems.push(format!("{at}: the same key is also tenant {other}'s"));
            }
        }
    }
    if problems.is_empty() {
        Ok(keys)
    } else {
        Err(problems)
    }
}

/// A character of a bearer token (RFC 6750's b64token).
fn is_token68(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-._~+/=".contains(&byte)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_A: &str = "sk-team-a-0123456789abcdef";
    const KEY_B: &str = "sk-team-b-0123456789abcdef";

    #[test]
    fn a_keys_file_maps_every_key_to_its_tenant() {
        let keys = parse_keys(&format!(
            "team-a: [\"{KEY_A}\"]\nteam-b:\n  - {KEY_B}\n  - sk-team-b-new-0123456789ab\n"
        ))
        .expect("valid");
        assert_eq!(keys.len(), 3);
        assert_eq!(keys[KEY_A], "team-a");
        assert_eq!(keys["sk-team-b-new-0123456789ab"], "team-b");
    }

    #[test]
    fn every_problem_is_named_and_no_key_is_shown() {
        let text = format!(
            "Team_A: [\"{KEY_A}\"]\nempty: []\nshort: [\"sk-123\"]\nspaces: [\"sk has spaces in it 0123\"]\n\
             twice: [\"{KEY_A}\"]\n"
        );
        let problems = parse_keys(&text).expect_err("invalid");
        let joined = problems.join("\n");
        assert!(joined.contains("tenant name \"Team_A\""), "{joined}");
        assert!(joined.contains("tenant empty has no key"), "{joined}");
        assert!(
            joined.contains("tenant short, key 1: must be 16"),
            "{joined}"
        );
        assert!(
            joined.contains("tenant spaces, key 1: must be a bearer token"),
            "{joined}"
        );
        assert!(
            joined.contains("tenant twice, key 1: the same key is also tenant Team_A's"),
            "{joined}"
        );
        assert!(
            !joined.contains(KEY_A) && !joined.contains("sk-123"),
            "{joined}"
        );
        let garbled = parse_keys(&format!("[\"{KEY_A}\"]")).expect_err("a list");
        assert!(!garbled.join("").contains(KEY_A), "{garbled:?}");
    }

    #[test]
    fn config_problems_name_their_field() {
        let mut problems = Vec::new();
        let mut tenants = BTreeMap::new();
        tenants.insert(
            "Bad".to_owned(),
            TenantConfig {
                weight: 0,
                ..TenantConfig::default()
            },
        );
        AuthConfig {
            keys_file: None,
            tenants,
        }
        .validate(&mut problems);
        let shown: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(shown.len(), 2, "{shown:?}");
        assert!(shown[0].starts_with("auth.tenants.Bad: tenant name"));
        assert_eq!(
            shown[1],
            "auth.tenants.Bad.weight: must be 1 to 1000, got 0"
        );
    }
}

//! `pools`: several fleets behind one tongs, each serving the requests it matches (by the OpenAI
//! `model` of the body, the path, headers), with fallback to other pools when it can serve nobody.
//!
//! A pool is a fleet with its own endpoints and its own balancing, limits, queue, retries and
//! heartbeats. Each of those sections a pool sets is merged key by key over the top-level one, so a
//! pool says only what differs (`queue: {max_wait_no_endpoints: 5m}`). The merge is done on the
//! sections as data and read back through the same strict types, so a misspelt key in a pool is named
//! as precisely as at the top level.
//!
//! The top-level `discovery`, when it finds anything (static endpoints or pod discovery on), is the
//! pool named `default`, which serves what no listed pool matches. A file with no `pools` at all is
//! that one pool, as before pools existed.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Config, DiscoveryConfig, Problem, StaticEndpoint};

/// The name of the pool the top-level `discovery` makes.
pub const DEFAULT_POOL: &str = "default";

/// Most pools one tongs serves (each has its own heartbeats and watch).
pub const MAX_POOLS: usize = 64;

/// One pool as written in the file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// `[a-z0-9-]`, unique; the `pool` label of every per-pool metric.
    pub name: String,
    /// Which requests the pool serves: every condition given must hold.
    #[serde(default, rename = "match")]
    pub matches: PoolMatch,
    /// Pools tried, in order, when this one can serve nobody.
    #[serde(default)]
    pub fallback: Vec<String>,
    /// The `model` this pool's endpoints are sent instead of the client's (e.g. a hosted API's name).
    #[serde(default)]
    pub rewrite_model: Option<String>,
    /// A file holding the key sent as `Authorization: Bearer …` to this pool's endpoints, and only to
    /// them (a hosted API's key from a Secret). The client's own `Authorization` is replaced there.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    #[serde(default)]
    pub discovery: PoolDiscovery,
    /// Sections merged key by key over the top-level ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balancer: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signals: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hedge: Option<Value>,
    /// A pool of a model whose streams pause differently, or that cannot be continued (a
    /// non-deterministic model, a server without `continue_final_message`), sets its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation: Option<Value>,
}

/// A pool's conditions; an empty one matches every request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolMatch {
    /// The request's `model`: an exact name, or a prefix ending in `*`.
    pub models: Vec<String>,
    /// The request path starts with one of these.
    pub path_prefixes: Vec<String>,
    /// Each header has exactly this value.
    pub headers: BTreeMap<String, String>,
}

/// Where a pool's endpoints come from: its own static list, and pods chosen by its own selector.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolDiscovery {
    #[serde(rename = "static")]
    pub static_endpoints: Vec<StaticEndpoint>,
    /// Merged over the top-level `discovery.kubernetes`; giving it turns pod discovery on for the
    /// pool unless it says `enabled: false`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<Value>,
}

/// A pool as it runs: its rules and the whole configuration its fleet is served with.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    pub name: String,
    pub matches: PoolMatch,
    pub fallback: Vec<String>,
    pub rewrite_model: Option<String>,
    pub api_key_file: Option<PathBuf>,
    /// The top-level configuration with this pool's discovery and sections in place.
    pub config: Config,
}

impl Config {
    /// Whether the top-level `discovery` makes the `default` pool.
    pub fn has_default_pool(&self) -> bool {
        self.pools.is_empty()
            || !self.discovery.static_endpoints.is_empty()
            || self.discovery.kubernetes.enabled
    }

    /// Every pool, listed pools first in their order, then `default` when there is one. Assumes a
    /// validated configuration; a pool whose sections do not merge is left out (validation names it).
    pub fn pool_specs(&self) -> Vec<PoolSpec> {
        let mut specs: Vec<PoolSpec> = self
            .pools
            .iter()
            .filter_map(|pool| {
                let config = self.pool_config(pool).ok()?;
                Some(PoolSpec {
                    name: pool.name.clone(),
                    matches: pool.matches.clone(),
                    fallback: pool.fallback.clone(),
                    rewrite_model: pool.rewrite_model.clone(),
                    api_key_file: pool.api_key_file.clone(),
                    config,
                })
            })
            .collect();
        if self.has_default_pool() {
            specs.push(PoolSpec {
                name: DEFAULT_POOL.into(),
                matches: PoolMatch::default(),
                fallback: Vec::new(),
                rewrite_model: None,
                api_key_file: None,
                config: self.clone(),
            });
        }
        specs
    }

    /// The configuration `pool` is served with, or the problems of its sections (fields named from
    /// the pool, e.g. `pools[1].queue.max_wait`, by the caller).
    fn pool_config(&self, pool: &PoolConfig) -> Result<Config, Vec<Problem>> {
        let mut config = self.clone();
        config.pools = Vec::new();
        let mut problems = Vec::new();
        merge(
            &mut config.balancer,
            &pool.balancer,
            "balancer",
            &mut problems,
        );
        merge(
            &mut config.concurrency,
            &pool.concurrency,
            "concurrency",
            &mut problems,
        );
        merge(&mut config.queue, &pool.queue, "queue", &mut problems);
        merge(&mut config.signals, &pool.signals, "signals", &mut problems);
        merge(&mut config.retry, &pool.retry, "retry", &mut problems);
        merge(&mut config.health, &pool.health, "health", &mut problems);
        merge(&mut config.breaker, &pool.breaker, "breaker", &mut problems);
        merge(&mut config.hedge, &pool.hedge, "hedge", &mut problems);
        merge(&mut config.stream, &pool.stream, "stream", &mut problems);
        merge(
            &mut config.continuation,
            &pool.continuation,
            "continuation",
            &mut problems,
        );
        let mut discovery = DiscoveryConfig {
            static_endpoints: pool.discovery.static_endpoints.clone(),
            ..DiscoveryConfig::default()
        };
        discovery.kubernetes = self.discovery.kubernetes.clone();
        match &pool.discovery.kubernetes {
            None => discovery.kubernetes.enabled = false,
            Some(over) => {
                // Saying anything about pods means watching them, unless the pool says otherwise.
                let mut over = over.clone();
                if let Value::Object(map) = &mut over {
                    map.entry("enabled").or_insert(Value::Bool(true));
                }
                merge(
                    &mut discovery.kubernetes,
                    &Some(over),
                    "discovery.kubernetes",
                    &mut problems,
                );
            }
        }
        config.discovery = discovery;
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(problems)
        }
    }

    /// The problems of `pools`, each field named from `pools[i]`.
    pub(super) fn validate_pools(&self, problems: &mut Vec<Problem>, checks: super::Checks) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if self.pools.len() > MAX_POOLS {
            problem(
                "pools".into(),
                format!("at most {MAX_POOLS} pools, got {}", self.pools.len()),
            );
        }
        let default = self.has_default_pool();
        let mut names: HashSet<&str> = HashSet::new();
        if default && !self.pools.is_empty() {
            names.insert(DEFAULT_POOL);
        }
        for (i, pool) in self.pools.iter().enumerate() {
            let at = format!("pools[{i}]");
            if !valid_name(&pool.name) {
                problem(
                    format!("{at}.name"),
                    format!(
                        "must be 1 to 63 of a-z, 0-9 and -, starting and ending with a letter or digit, got {:?}",
                        pool.name
                    ),
                );
            } else if pool.name == DEFAULT_POOL && default {
                problem(
                    format!("{at}.name"),
                    "`default` is the pool the top-level discovery makes; name this one otherwise"
                        .into(),
                );
            } else if !names.insert(&pool.name) {
                problem(
                    format!("{at}.name"),
                    format!("{:?} names two pools", pool.name),
                );
            }
            for (j, model) in pool.matches.models.iter().enumerate() {
                if let Err(message) = check_pattern(model) {
                    problem(format!("{at}.match.models[{j}]"), message);
                }
            }
            for (j, prefix) in pool.matches.path_prefixes.iter().enumerate() {
                if !prefix.starts_with('/') {
                    problem(
                        format!("{at}.match.path_prefixes[{j}]"),
                        format!("must start with /, got {prefix:?}"),
                    );
                }
            }
            for (name, value) in &pool.matches.headers {
                if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                    problem(
                        format!("{at}.match.headers"),
                        format!("{name:?} is not a header name"),
                    );
                } else if http::HeaderValue::from_str(value).is_err() {
                    problem(
                        format!("{at}.match.headers.{name}"),
                        format!("{value:?} is not a header value"),
                    );
                }
            }
            if let Some(model) = &pool.rewrite_model
                && (model.is_empty() || model.len() > 256)
            {
                problem(
                    format!("{at}.rewrite_model"),
                    "must be a model name of 1 to 256 characters".into(),
                );
            }
            // The key goes where the configuration says, never where a pod's annotation points.
            if pool.api_key_file.is_some() && pool.discovery.kubernetes.is_some() {
                problem(
                    format!("{at}.api_key_file"),
                    "a pool with its own key takes its endpoints from discovery.static only: \
                     whoever can label or annotate a pod could otherwise receive the key"
                        .into(),
                );
            }
            match self.pool_config(pool) {
                Err(merge_problems) => problems_at(&mut problem, &at, merge_problems),
                Ok(config) => {
                    // The pool's own sections, checked as the top-level ones are; problems of what it
                    // inherits are the top level's, named there.
                    let own = config.validate_with(checks).into_iter().filter(|p| {
                        OVERRIDABLE
                            .iter()
                            .any(|section| p.field.starts_with(section))
                    });
                    problems_at(&mut problem, &at, own.collect());
                }
            }
        }
        let known: HashSet<&str> = self
            .pool_specs_names()
            .into_iter()
            .collect::<HashSet<&str>>();
        for (i, pool) in self.pools.iter().enumerate() {
            for (j, to) in pool.fallback.iter().enumerate() {
                let field = format!("pools[{i}].fallback[{j}]");
                if !known.contains(to.as_str()) {
                    problem(field, format!("no pool is named {to:?}"));
                } else if to == &pool.name {
                    problem(field, "a pool cannot fall back to itself".into());
                }
            }
        }
        if let Some(cycle) = self.fallback_cycle() {
            problem(
                "pools".into(),
                format!("fallback goes round in a circle: {}", cycle.join(" → ")),
            );
        }
    }

    fn pool_specs_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.pools.iter().map(|p| p.name.as_str()).collect();
        if self.has_default_pool() {
            names.push(DEFAULT_POOL);
        }
        names
    }

    /// A chain of fallbacks that comes back to where it started, if any.
    fn fallback_cycle(&self) -> Option<Vec<String>> {
        let edges = |name: &str| -> Vec<&str> {
            self.pools
                .iter()
                .find(|p| p.name == name)
                .map(|p| p.fallback.iter().map(String::as_str).collect())
                .unwrap_or_default()
        };
        for start in &self.pools {
            // Depth-first from `start`, by path.
            let mut stack: Vec<Vec<&str>> = vec![vec![start.name.as_str()]];
            while let Some(path) = stack.pop() {
                let Some(&last) = path.last() else { continue };
                for next in edges(last) {
                    if next == start.name && path.len() > 1 {
                        let mut cycle: Vec<String> = path.iter().map(|s| (*s).to_owned()).collect();
                        cycle.push(next.to_owned());
                        return Some(cycle);
                    }
                    if !path.contains(&next) && path.len() <= self.pools.len() {
                        let mut longer = path.clone();
                        longer.push(next);
                        stack.push(longer);
                    }
                }
            }
        }
        None
    }
}

/// The sections a pool may set, as their fields start.
const OVERRIDABLE: &[&str] = &[
    "balancer.",
    "concurrency.",
    "queue.",
    "signals.",
    "retry.",
    "health.",
    "breaker.",
    "hedge.",
    "stream.",
    "continuation.",
    "discovery.",
];

fn problems_at(problem: &mut impl FnMut(String, String), at: &str, problems: Vec<Problem>) {
    for p in problems {
        problem(format!("{at}.{}", p.field), p.message);
    }
}

/// `section` with `over`'s keys merged in (maps recursively), read back through its strict type.
fn merge<T: Serialize + serde::de::DeserializeOwned>(
    section: &mut T,
    over: &Option<Value>,
    field: &str,
    problems: &mut Vec<Problem>,
) {
    let Some(over) = over else { return };
    let Value::Object(_) = over else {
        problems.push(Problem {
            field: field.into(),
            message: "must be a mapping of the section's keys".into(),
        });
        return;
    };
    let mut base = match serde_json::to_value(&*section) {
        Ok(base) => base,
        Err(err) => {
            problems.push(Problem {
                field: field.into(),
                message: err.to_string(),
            });
            return;
        }
    };
    merge_values(&mut base, over);
    match serde_path_to_error::deserialize::<_, T>(base) {
        Ok(merged) => *section = merged,
        Err(err) => {
            let path = err.path().to_string();
            problems.push(Problem {
                field: if path == "." {
                    field.into()
                } else {
                    format!("{field}.{path}")
                },
                message: err.into_inner().to_string(),
            });
        }
    }
}

fn merge_values(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(base), Value::Object(over)) => {
            for (key, value) in over {
                match base.get_mut(key) {
                    Some(existing) if existing.is_object() && value.is_object() => {
                        merge_values(existing, value)
                    }
                    _ => {
                        base.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (base, over) => *base = over.clone(),
    }
}

/// A pool name: a DNS label, since it becomes a metric label and appears in object names.
fn valid_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first() != Some(&b'-')
        && bytes.last() != Some(&b'-')
}

/// A model pattern: a name, or a prefix ending in one `*`.
fn check_pattern(pattern: &str) -> Result<(), String> {
    if pattern.is_empty() {
        return Err("must not be empty (write * to match every model)".into());
    }
    if pattern.len() > 256 {
        return Err(format!(
            "must be at most 256 characters, got {}",
            pattern.len()
        ));
    }
    if let Some(at) = pattern.find('*')
        && at != pattern.len() - 1
    {
        return Err(format!(
            "{pattern:?}: * may only end a pattern (a prefix), as in llama-3.1-*"
        ));
    }
    Ok(())
}

/// Whether `model` matches `pattern` (exact, or a prefix ending in `*`).
pub fn model_matches(pattern: &str, model: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => model.starts_with(prefix),
        None => pattern == model,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(text: &str) -> Vec<String> {
        match Config::parse(text, "test") {
            Ok(_) => Vec::new(),
            Err(err) => err.problems().iter().map(|p| p.field.clone()).collect(),
        }
    }

    #[test]
    fn no_pools_is_the_default_pool() {
        let config = Config::parse("{}", "test").unwrap();
        let specs = config.pool_specs();
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].name, "default");
    }

    #[test]
    fn pools_inherit_key_by_key() {
        let text = r#"
queue: { max_wait: 7s, max_length: 9 }
pools:
  - name: llama
    match: { models: ["llama-3.1-*"] }
    queue: { max_wait_no_endpoints: 5m }
    discovery:
      static: [{url: "http://10.0.0.1:8000"}]
      kubernetes: { label_selector: "tongs.dev/pool=llama" }
"#;
        let config = Config::parse(text, "test").unwrap();
        let specs = config.pool_specs();
        assert_eq!(specs.len(), 1, "no top-level discovery: no default pool");
        let llama = &specs[0].config;
        assert_eq!(llama.queue.max_wait.get().as_secs(), 7);
        assert_eq!(llama.queue.max_length, 9);
        assert_eq!(
            llama.queue.max_wait_no_endpoints.map(|w| w.get().as_secs()),
            Some(300)
        );
        assert!(llama.discovery.kubernetes.enabled);
        assert_eq!(
            llama.discovery.kubernetes.label_selector,
            "tongs.dev/pool=llama"
        );
        assert_eq!(llama.discovery.static_endpoints.len(), 1);
    }

    #[test]
    fn top_level_discovery_is_the_default_pool_after_the_listed_ones() {
        let text = r#"
discovery: { static: [{url: "http://10.0.0.9:8000"}] }
pools:
  - name: a
    discovery: { static: [{url: "http://10.0.0.1:8000"}] }
"#;
        let config = Config::parse(text, "test").unwrap();
        let names: Vec<_> = config.pool_specs().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["a", "default"]);
        // The listed pool does not inherit the default pool's endpoints.
        assert_eq!(
            config.pool_specs()[0].config.discovery.static_endpoints[0].url,
            "http://10.0.0.1:8000"
        );
    }

    #[test]
    fn every_pool_problem_is_named() {
        let text = r#"
discovery: { static: [{url: "http://10.0.0.9:8000"}] }
pools:
  - name: Llama
  - name: a
    match: { models: ["x*y", ""], path_prefixes: ["v1"] }
    fallback: [nowhere, a]
    queue: { max_wiat: 3s }
  - name: a
  - name: default
  - name: b
    retry: { max_attempts: 0 }
    fallback: [c]
  - name: c
    fallback: [b]
  - name: keyed
    api_key_file: /k
    discovery: { kubernetes: { label_selector: "a=b" } }
  - name: d
    discovery: { kubernetes: { label_selector: "tier in (a" } }
"#;
        let got = fields(text);
        for want in [
            "pools[0].name",
            "pools[1].match.models[0]",
            "pools[1].match.models[1]",
            "pools[1].match.path_prefixes[0]",
            "pools[1].queue.max_wiat",
            "pools[1].fallback[0]",
            "pools[1].fallback[1]",
            "pools[2].name",
            "pools[3].name",
            "pools[4].retry.max_attempts",
            "pools[6].api_key_file",
            "pools[7].discovery.kubernetes.label_selector",
            "pools",
        ] {
            assert!(got.iter().any(|f| f == want), "{want} missing from {got:?}");
        }
    }

    #[test]
    fn patterns() {
        assert!(model_matches("llama-3.1-*", "llama-3.1-8b"));
        assert!(!model_matches("llama-3.1-*", "llama-3.2-8b"));
        assert!(model_matches("llama", "llama"));
        assert!(!model_matches("llama", "llama-3"));
        assert!(model_matches("*", "anything"));
    }
}

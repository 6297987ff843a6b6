//! tongs.yaml's pools: where each pool finds its endpoints, so that the checks across objects hold for
//! every pool. With `pools`, each pool has a `discovery` of its own (`static`, and `kubernetes`, which
//! turns pod discovery on for the pool by being there, and whose keys the pool leaves unset are the
//! top-level `discovery.kubernetes`'s); a top-level `discovery`, where written, is the pool `default`.
//! The pools are read from the file as written, with that inheritance applied here, so each check sees
//! the discovery a pool really runs.

use std::path::PathBuf;

use serde_json::{Map, Value};
use tongs::config::{Config, DiscoveryConfig};

use crate::TONGS;
use crate::alerts::selectors;
use crate::fleet::{label_selector_selects, parse_label_selector};
use crate::objects::Asks;
use crate::pods::pod_labels;
use crate::problems::Problems;

/// The pool a top-level `discovery` is, in a file with pools.
const DEFAULT_POOL: &str = "default";

/// One pool's discovery (or the whole file's, without pools).
pub(crate) struct Discovery {
    /// The pool's name; `None` in a file without pools.
    pub(crate) pool: Option<String>,
    /// Where its keys are in tongs.yaml: empty for the top-level `discovery`, `pools[NAME].` for a
    /// pool's own.
    prefix: String,
    /// The whole configuration with this pool's effective `discovery`.
    pub(crate) config: Config,
    /// `pools[].api_key_file`: the key sent to this pool's endpoints only.
    pub(crate) api_key_file: Option<PathBuf>,
}

impl Discovery {
    /// The path of `key` in tongs.yaml, e.g. `pools[llm].discovery.kubernetes.rules`.
    pub(crate) fn field(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// How problems name it: `pool llm`, or nothing in a file without pools.
    pub(crate) fn shown(&self) -> String {
        self.pool
            .as_ref()
            .map_or_else(String::new, |pool| format!(" (pool {pool})"))
    }

    /// A pool of the `pools` list (not the top-level `discovery`).
    pub(crate) fn is_listed_pool(&self) -> bool {
        !self.prefix.is_empty()
    }
}

/// Every discovery tongs runs for `text` (tongs.yaml, which parsed as `config`): the top-level one in a
/// file without pools; otherwise each pool's, and the pool `default` where the file has a top-level
/// `discovery`.
pub(crate) fn discoveries(config: &Config, text: &str) -> Result<Vec<Discovery>, String> {
    let file: Value =
        serde_saphyr::from_str(text).map_err(|err| format!("tongs.yaml is not YAML: {err}"))?;
    let top_level = |pool: Option<&str>| Discovery {
        pool: pool.map(str::to_owned),
        prefix: String::new(),
        config: config.clone(),
        api_key_file: None,
    };
    let pools = match &file["pools"] {
        Value::Null => return Ok(vec![top_level(None)]),
        Value::Array(pools) => pools,
        other => return Err(format!("pools is no list: {other}")),
    };
    let mut found = Vec::new();
    if !file["discovery"].is_null() {
        found.push(top_level(Some(DEFAULT_POOL)));
    }
    let inherited = file["discovery"]["kubernetes"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    for pool in pools {
        let Some(name) = pool["name"].as_str() else {
            return Err(format!("a pool without a name: {pool}"));
        };
        let prefix = format!("pools[{name}].");
        let discovery = &pool["discovery"];
        let mut effective = Map::new();
        effective.insert("static".into(), discovery["static"].clone());
        if let Some(own) = discovery["kubernetes"].as_object() {
            let mut kubernetes = inherited.clone();
            kubernetes.insert("enabled".into(), Value::Bool(true));
            kubernetes.extend(own.clone());
            effective.insert("kubernetes".into(), Value::Object(kubernetes));
        }
        effective.retain(|_, value| !value.is_null());
        let discovery: DiscoveryConfig = serde_json::from_value(Value::Object(effective))
            .map_err(|err| format!("{prefix}discovery: {err}"))?;
        let mut config = config.clone();
        config.discovery = discovery;
        found.push(Discovery {
            pool: Some(name.to_owned()),
            prefix,
            config,
            api_key_file: pool["api_key_file"].as_str().map(PathBuf::from),
        });
    }
    Ok(found)
}

/// In a file with pools, every ScaledObject that scales a pool's GPU workload scales it on that pool's
/// demand: its Prometheus query selects `tongs_demand{pool="NAME"}`, or it would scale one model's
/// nodes on another's load (or on the sum of all).
pub(crate) fn check_pool_scaling(asks: &Asks, problems: &mut Problems) {
    let (at, _tongs, _config, objects) = asks.parts();
    if asks.discoveries.iter().all(|d| d.pool.is_none()) {
        return;
    }
    for (name, scaled) in &objects.scaled_objects {
        let target = scaled["spec"]["scaleTargetRef"]["name"]
            .as_str()
            .unwrap_or("");
        let Some(deployment) = objects.deployments.get(target).filter(|_| target != TONGS) else {
            continue;
        };
        let labels = pod_labels(deployment);
        let pools: Vec<&str> = asks
            .discoveries
            .iter()
            .filter(|d| {
                let kubernetes = &d.config.discovery.kubernetes;
                kubernetes.enabled
                    && parse_label_selector(&kubernetes.label_selector)
                        .is_ok_and(|selector| label_selector_selects(&selector, &labels))
            })
            .filter_map(|d| d.pool.as_deref())
            .collect();
        // No pool, or several: reported with the workloads (fleet.rs).
        let [pool] = pools[..] else {
            continue;
        };
        let triggers = scaled["spec"]["triggers"].as_array().into_iter().flatten();
        let queries = triggers
            .filter(|trigger| trigger["type"] == "prometheus")
            .filter_map(|trigger| trigger["metadata"]["query"].as_str());
        for query in queries {
            let demands: Vec<_> = selectors(query)
                .unwrap_or_default()
                .into_iter()
                .filter(|selector| selector.name == tongs::metrics::DEMAND.name)
                .collect();
            let own = !demands.is_empty()
                && demands.iter().all(|selector| {
                    selector
                        .matchers
                        .iter()
                        .any(|(label, op, value)| label == "pool" && op == "=" && value == pool)
                });
            ensure!(
                problems,
                at,
                own,
                "ScaledObject/{name} scales Deployment/{target}, the GPU workload of pool {pool}, on \
                 {query:?}: scale it on that pool's demand alone, tongs_demand{{pool=\"{pool}\"}}"
            );
        }
    }
}

#[test]
fn pools_inherit_the_top_level_pod_discovery() {
    let text = r#"
discovery:
  kubernetes:
    enabled: false
    namespace: fleet
    rules: [salad-api]
pools:
  - name: a
    api_key_file: /etc/a/key
    discovery:
      kubernetes:
        label_selector: tongs.dev/pool=a
  - name: b
    discovery:
      static: [{ url: "http://b:8000" }]
"#;
    let config = Config::default();
    let found = discoveries(&config, text).unwrap_or_else(|err| panic!("{err}"));
    let names: Vec<Option<&str>> = found.iter().map(|d| d.pool.as_deref()).collect();
    assert_eq!(names, [Some("default"), Some("a"), Some("b")]);
    let a = &found[1].config.discovery.kubernetes;
    assert!(a.enabled, "a kubernetes section turns pod discovery on");
    assert_eq!(a.namespace, "fleet");
    assert_eq!(a.label_selector, "tongs.dev/pool=a");
    assert_eq!(a.rules, [tongs::config::Rule::SaladApi]);
    assert_eq!(found[1].api_key_file, Some(PathBuf::from("/etc/a/key")));
    assert_eq!(
        found[1].field("discovery.kubernetes.rules"),
        "pools[a].discovery.kubernetes.rules"
    );
    let b = &found[2].config.discovery;
    assert!(!b.kubernetes.enabled, "without the section, no pods");
    assert_eq!(b.static_endpoints[0].url, "http://b:8000");
    assert_eq!(
        found[0].field("discovery.kubernetes"),
        "discovery.kubernetes"
    );

    let unpooled = discoveries(&config, "listen: 0.0.0.0:8080\n").expect("no pools");
    assert_eq!(unpooled.len(), 1);
    assert_eq!(unpooled[0].pool, None);
    assert!(discoveries(&config, "pools: [{ match: {} }]\n").is_err());
}

/// The checks across objects hold for each pool of deploy/overlays/two-pools, and breaking what ties a
/// pool to its GPU workload, its ScaledObject or its redundancy is reported.
#[test]
fn each_pool_is_checked_against_its_workload() {
    use serde_json::json;

    use crate::objects::{name_of, problems_after};

    const POOLS: &str = "deploy/overlays/two-pools";
    let reported = |problems: &[String], wanted: &str| {
        assert!(
            problems.iter().any(|problem| problem.contains(wanted)),
            "expected a problem containing {wanted:?}, got {problems:#?}"
        );
    };
    let edit = |kind: &'static str, name: &'static str, change: &dyn Fn(&mut Value)| {
        problems_after(POOLS, |documents| {
            let doc = documents
                .iter_mut()
                .find(|doc| doc["kind"] == kind && name_of(doc) == name)
                .unwrap_or_else(|| panic!("{kind}/{name}"));
            change(doc);
        })
    };
    let edit_config = |change: &dyn Fn(&str) -> String| {
        problems_after(POOLS, |documents| {
            let config_map = documents
                .iter_mut()
                .find(|doc| doc["kind"] == "ConfigMap" && name_of(doc).starts_with("tongs-config"))
                .expect("tongs' ConfigMap");
            let text = config_map["data"]["tongs.yaml"]
                .as_str()
                .expect("tongs.yaml");
            config_map["data"]["tongs.yaml"] = Value::String(change(text));
        })
    };
    assert_eq!(problems_after(POOLS, |_| {}), Vec::<String>::new());

    // The image workload's pods labelled for the llm pool: two models behind one pool, none behind the
    // other.
    let problems = edit("Deployment", "image", &|doc| {
        doc["spec"]["template"]["metadata"]["labels"]["tongs.dev/pool"] = json!("llm");
    });
    reported(
        &problems,
        "pool image's label selector selects no GPU workload",
    );
    // A top-level discovery of the whole fleet: the pool `default` serves every pool's nodes too.
    let problems = edit_config(&|text| {
        format!(
            "discovery:\n  kubernetes:\n    enabled: true\n    label_selector: \
             app.kubernetes.io/part-of=tongs-fleet\n    rules: [url, salad-api]\n{text}"
        )
    });
    reported(&problems, "pools [\"default\", \"llm\"] all select");
    // A SaladCloud pool reached at its pods' podIPs.
    let problems =
        edit_config(&|text| text.replacen("rules: [url, salad-api]", "rules: [pod-ip]", 1));
    reported(
        &problems,
        "no rule of pools[llm].discovery.kubernetes.rules",
    );
    // A pool in another namespace than the base's (tongs' own).
    let problems = edit_config(&|text| {
        text.replacen(
            "label_selector: tongs.dev/pool=image",
            "label_selector: tongs.dev/pool=image\n        namespace: gpu",
            1,
        )
    });
    reported(
        &problems,
        "pools[image].discovery.kubernetes.namespace is \"gpu\"",
    );
    // KEDA scaling the image nodes on the language model's demand.
    let problems = edit("ScaledObject", "image", &|doc| {
        doc["spec"]["triggers"][0]["metadata"]["query"] = json!("sum(tongs_demand{pool=\"llm\"})");
    });
    reported(
        &problems,
        "ScaledObject/image scales Deployment/image, the GPU workload of pool image",
    );
    let problems = edit("ScaledObject", "llm", &|doc| {
        doc["spec"]["triggers"][0]["metadata"]["query"] = json!("sum(tongs_demand)");
    });
    reported(&problems, "ScaledObject/llm scales Deployment/llm");
    // Every pool's workload keeps the examples' redundancy, not only the one named `inference`.
    let problems = edit("Deployment", "llm-in-cluster", &|doc| {
        doc["spec"]["replicas"] = json!(1);
    });
    reported(&problems, "Deployment/llm-in-cluster: replicas Some(1)");
    let problems = edit("Deployment", "image", &|doc| {
        doc["spec"]["template"]["metadata"]["annotations"]["salad.com/country-codes"] = json!("us");
    });
    reported(
        &problems,
        "Deployment/image: salad.com/country-codes \"us\"",
    );
}

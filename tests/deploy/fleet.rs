//! The GPU fleet: the example GPU Deployment (fleet label, SaladCloud annotations and toleration), and
//! that tongs' pod discovery finds every GPU workload of a rendering and a rule gives its pods an
//! address tongs reaches; label selectors read as the API server reads them.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::Deployment;
use tongs::config::Rule;
use tongs::source::kubernetes::pods::{SALAD_PORT_ANNOTATION, SALAD_PROVIDER, SALAD_TAINT_KEY};

use crate::objects::Asks;
use crate::pods::{named_port, pod_labels, pod_meta, pod_spec};
use crate::pools::Discovery;
use crate::problems::Problems;
use crate::{FLEET_LABEL, TONGS, selectors};

/// Pod annotations the SaladCloud Virtual Kubelet reads, besides `salad.com/logging-*`.
const SALAD_ANNOTATIONS: &str = "salad.com/gpu-classes salad.com/country-codes \
    salad.com/container-group-priority salad.com/networking-protocol salad.com/networking-port \
    salad.com/networking-auth";

/// GPU replicas an example runs, so one interruption is never an outage.
pub(crate) const MIN_GPU_REPLICAS: i32 = 3;
/// Countries a SaladCloud example may be placed in, at least.
const MIN_COUNTRIES: usize = 2;

pub(crate) fn check_inference(at: &str, deployment: &Deployment, problems: &mut Problems) {
    let labels = pod_labels(deployment);
    let (key, value) = FLEET_LABEL;
    ensure!(
        problems,
        at,
        labels.get(key).is_some_and(|v| v == value),
        "pods must carry {key}: {value}"
    );
    let replicas = deployment.spec.as_ref().and_then(|spec| spec.replicas);
    ensure!(
        problems,
        at,
        replicas.unwrap_or(1) >= MIN_GPU_REPLICAS,
        "replicas {replicas:?}: run at least {MIN_GPU_REPLICAS} GPU nodes, or every interruption is \
         an outage"
    );
    let Some(spec) = pod_spec(deployment) else {
        return problems.fail(at, "has no pod spec");
    };
    let annotations = pod_meta(deployment, |meta| meta.annotations.clone()).unwrap_or_default();
    let salad: BTreeMap<&str, &str> = annotations
        .iter()
        .filter(|(key, _)| key.starts_with("salad.com/"))
        .map(|(key, value)| (key.as_str(), value.as_str()))
        .collect();
    if salad.is_empty() {
        return;
    }
    for key in salad.keys() {
        let read = SALAD_ANNOTATIONS.split_whitespace().any(|k| k == *key)
            || key.starts_with("salad.com/logging-");
        ensure!(
            problems,
            at,
            read,
            "annotation {key} is not one the SaladCloud Virtual Kubelet reads"
        );
    }
    let networking = ["protocol", "port", "auth"].map(|k| {
        salad
            .get(format!("salad.com/networking-{k}").as_str())
            .copied()
    });
    let present = networking.iter().flatten().count();
    ensure!(
        problems,
        at,
        present == 0 || present == 3,
        "the gateway needs all three salad.com/networking-* keys"
    );
    if let [Some(protocol), Some(port), Some(auth)] = networking {
        ensure!(
            problems,
            at,
            protocol == "http",
            "salad.com/networking-protocol is {protocol:?}; only http is accepted"
        );
        let mut ports = spec
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten());
        let exposed = ports.any(|p| p.container_port.to_string() == port);
        ensure!(
            problems,
            at,
            exposed,
            "salad.com/networking-port {port} is no containerPort of the pod"
        );
        ensure!(
            problems,
            at,
            matches!(auth, "true" | "false"),
            "salad.com/networking-auth is {auth:?}"
        );
    }
    check_country_codes(at, salad.get("salad.com/country-codes").copied(), problems);
    if let Some(priority) = salad.get("salad.com/container-group-priority") {
        let known = matches!(*priority, "high" | "medium" | "low" | "batch");
        ensure!(
            problems,
            at,
            known,
            "salad.com/container-group-priority {priority:?} is not high|medium|low|batch"
        );
    }
    let tolerates = spec.tolerations.iter().flatten().any(|toleration| {
        toleration.key.as_deref() == Some("virtual-kubelet.io/provider")
            && toleration.effect.as_deref() == Some("NoSchedule")
            && (toleration.operator.as_deref() == Some("Exists")
                || toleration.value.as_deref() == Some("saladcloud"))
    });
    ensure!(
        problems,
        at,
        tolerates,
        "a SaladCloud pod must tolerate virtual-kubelet.io/provider=saladcloud:NoSchedule"
    );
}

/// `salad.com/country-codes` as the Virtual Kubelet reads it (SaladTechnologies/virtual-kubelet-saladcloud,
/// internal/provider/provider.go, getCountryCodes): split on "," without trimming, each code an ISO
/// 3166-1 alpha-2 code it validates; one refused code drops the whole list (and the placement limit)
/// with only a log line. Several countries, so a shortage in one does not stop every replacement.
pub(crate) fn check_country_codes(at: &str, value: Option<&str>, problems: &mut Problems) {
    let Some(value) = value else {
        return problems.fail(
            at,
            format!(
                "set salad.com/country-codes to {MIN_COUNTRIES} or more countries, so replacements \
                 are not limited to one"
            ),
        );
    };
    let codes: Vec<&str> = value.split(',').collect();
    for code in &codes {
        let well_formed = code.len() == 2 && code.chars().all(|c| c.is_ascii_lowercase());
        ensure!(
            problems,
            at,
            well_formed,
            "salad.com/country-codes {value:?}: {code:?} is no lowercase two-letter code (no spaces: \
             the Virtual Kubelet does not trim them, and drops the whole list)"
        );
    }
    let distinct: BTreeSet<&&str> = codes.iter().collect();
    ensure!(
        problems,
        at,
        distinct.len() >= MIN_COUNTRIES && distinct.len() == codes.len(),
        "salad.com/country-codes {value:?}: name {MIN_COUNTRIES} or more distinct countries"
    );
}

/// A pod of the SaladCloud Virtual Kubelet, as tongs tells one (src/discovery/pods.rs): it carries the
/// gateway port annotation or tolerates the virtual node's taint.
pub(crate) fn is_salad(deployment: &Deployment) -> bool {
    let annotations = pod_meta(deployment, |meta| meta.annotations.clone()).unwrap_or_default();
    let tolerations = pod_spec(deployment).and_then(|spec| spec.tolerations.as_ref());
    annotations.contains_key(SALAD_PORT_ANNOTATION)
        || tolerations.into_iter().flatten().any(|toleration| {
            toleration.key.as_deref() == Some(SALAD_TAINT_KEY)
                && toleration
                    .value
                    .as_deref()
                    .is_none_or(|value| value == SALAD_PROVIDER)
        })
}

/// A SaladCloud Container Gateway host, as the SaladCloud API gives them.
const GATEWAY_HOST: &str = "tamarind-navybean-2kln8fkx9xruvxa2.salad.cloud";

/// Every GPU workload of the rendering (each Deployment but tongs) is one that pod discovery finds:
/// one label selector picks its pods (one pool's, where tongs.yaml has pools: two would send one
/// model's requests to the other's nodes) and none picks tongs' own, in the watched namespace, and a
/// rule can give each pod an address tongs can reach. Each pool's selector picks some workload.
pub(crate) fn check_discovered_workloads(asks: &Asks, problems: &mut Problems) {
    let (at, tongs, _config, objects) = asks.parts();
    let mut watching = Vec::new();
    for discovery in asks.discoveries {
        let kubernetes = &discovery.config.discovery.kubernetes;
        if !kubernetes.enabled {
            continue;
        }
        let field = discovery.field("discovery.kubernetes.label_selector");
        let text = &kubernetes.label_selector;
        match parse_label_selector(text) {
            Ok(selector) => {
                ensure!(
                    problems,
                    at,
                    !label_selector_selects(&selector, &pod_labels(tongs.deployment)),
                    "{field} {text:?} selects tongs' own pods: tongs would send requests to itself"
                );
                watching.push((discovery, field, selector));
            }
            Err(message) => problems.fail(at, format!("{field}: {message}")),
        }
    }
    if watching.is_empty() {
        return;
    }
    let workloads: Vec<(&String, &Deployment)> = objects
        .deployments
        .iter()
        .filter(|(name, _)| *name != TONGS)
        .collect();
    for (name, deployment) in &workloads {
        let at = &format!("{at} (Deployment/{name})");
        let labels = pod_labels(deployment);
        let by: Vec<_> = watching
            .iter()
            .filter(|(_, _, selector)| label_selector_selects(selector, &labels))
            .collect();
        match (&watching[..], &by[..]) {
            ([(_, field, _)], []) => problems.fail(
                at,
                format!(
                    "{field} {:?} does not select this GPU workload's pods (labels {labels:?})",
                    watching[0].0.config.discovery.kubernetes.label_selector
                ),
            ),
            (_, []) => problems.fail(
                at,
                format!(
                    "no pool's label selector selects this GPU workload's pods (labels {labels:?})"
                ),
            ),
            (_, [_]) => {}
            (_, several) => {
                let pools: Vec<&str> = several
                    .iter()
                    .map(|(discovery, _, _)| discovery.pool.as_deref().unwrap_or("?"))
                    .collect();
                problems.fail(
                    at,
                    format!(
                        "pools {pools:?} all select this GPU workload's pods: a request for one \
                         pool's model would reach a node running another; give each pool's pods a \
                         label only its selector picks"
                    ),
                );
            }
        }
        for (discovery, _, _) in by {
            let at = &format!("{at}{}", discovery.shown());
            let watched = tongs.watched_namespace(&discovery.config);
            let shown = match watched {
                Ok(namespace) => namespace.unwrap_or("(tongs' own)").to_owned(),
                Err(()) => "every namespace".to_owned(),
            };
            let namespace = deployment.metadata.namespace.as_deref();
            ensure!(
                problems,
                at,
                watched.is_err() || watched == Ok(namespace),
                "runs in namespace {namespace:?}, but {} watches {shown}",
                discovery.field("discovery.kubernetes")
            );
            check_address_rule(at, deployment, discovery, problems);
        }
    }
    // A listed pool whose selector picks no workload of a rendering that has some: its requests
    // would find no endpoint (a rendering without GPU workloads, like deploy/base, leaves them to
    // the user).
    if workloads.is_empty() {
        return;
    }
    for (discovery, field, selector) in &watching {
        let Some(pool) = discovery
            .pool
            .as_deref()
            .filter(|_| discovery.is_listed_pool())
        else {
            continue;
        };
        let picks = workloads
            .iter()
            .any(|(_, deployment)| label_selector_selects(selector, &pod_labels(deployment)));
        ensure!(
            problems,
            at,
            picks,
            "pool {pool}'s label selector selects no GPU workload of the rendering ({field} {:?}): \
             its requests would find no endpoint",
            discovery.config.discovery.kubernetes.label_selector
        );
    }
}

/// Some rule of `discovery.kubernetes.rules` gives the workload's pods an address tongs can reach, and
/// none gives a SaladCloud pod one it cannot; and a gateway that requires the SaladCloud key gets it.
fn check_address_rule(
    at: &str,
    deployment: &Deployment,
    discovery: &Discovery,
    problems: &mut Problems,
) {
    let config = &discovery.config;
    let kubernetes = &config.discovery.kubernetes;
    let salad = is_salad(deployment);
    let containers = pod_spec(deployment).map_or(&[][..], |spec| &spec.containers);
    let annotations = pod_meta(deployment, |meta| meta.annotations.clone()).unwrap_or_default();
    let has_port = annotations.contains_key(&kubernetes.annotations.port)
        || containers
            .iter()
            .any(|container| named_port(container, &kubernetes.port_name).is_some());
    let registers = kubernetes.registration.token_file.is_some();
    let proxied = !config.upstream.tailscale.proxy.is_empty();
    let rules: Vec<&str> = kubernetes.rules.iter().map(|rule| rule.name()).collect();
    let reachable = kubernetes.rules.iter().any(|rule| match rule {
        // Nothing in deploy/ writes the URL annotation but write-back, which follows a salad-api
        // lookup: url alone never gives these pods an address.
        Rule::Url => false,
        // The node registers its Tailscale address; tongs' pod reaches the tailnet through the proxy.
        Rule::Tailscale => registers && proxied,
        Rule::SaladApi => salad && config.salad.api_enabled(),
        Rule::PodIp => !salad && has_port,
    });
    ensure!(
        problems,
        at,
        reachable,
        "no rule of {} {rules:?} gives these pods an address tongs reaches: a SaladCloud pod needs \
         salad-api with salad.api set, or tailscale with registration and upstream.tailscale.proxy; \
         another pod pod-ip and a containerPort named {:?}",
        discovery.field("discovery.kubernetes.rules"),
        kubernetes.port_name
    );
    if !salad {
        return;
    }
    ensure!(
        problems,
        at,
        !kubernetes.rules.contains(&Rule::PodIp),
        "a SaladCloud pod has no cluster networking: the pod-ip rule would serve it at a podIP tongs \
         cannot reach whenever no other rule has an address for it; leave pod-ip out of {}",
        discovery.field("discovery.kubernetes.rules")
    );
    let salad_config = &config.salad;
    // The key reaches a discovered gateway only within salad.gateways and once the SaladCloud API has
    // confirmed its host (src/upstream/gateway_key.rs): the key, the pattern and salad.api.
    let sends_key = (salad_config.api_key_file.is_some() || salad_config.api_key_env.is_some())
        && salad_config.api_enabled()
        && salad_config
            .gateway_rules()
            .iter()
            .any(|rule| rule.allows_url("https", GATEWAY_HOST, 443));
    let auth = annotations
        .get("salad.com/networking-auth")
        .map(String::as_str);
    if auth == Some("true") {
        ensure!(
            problems,
            at,
            sends_key,
            "salad.com/networking-auth is \"true\", but tongs sends no Salad-Api-Key to these pods' \
             gateways (salad.api_key_file or api_key_env, salad.gateways, and salad.api to confirm \
             each gateway): its heartbeats would fail"
        );
    }
    let via_gateway = kubernetes.rules.contains(&Rule::SaladApi) && salad_config.api_enabled();
    if via_gateway && sends_key {
        ensure!(
            problems,
            at,
            auth == Some("true"),
            "tongs sends its SaladCloud key to the gateway: set salad.com/networking-auth: \"true\", \
             so nobody who learns the gateway URL calls the node past tongs"
        );
    }
}

/// Parses a label selector string (`kubectl get -l`, the watch's `labelSelector`) the way the fake
/// API server does, which reads it as the real one: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`,
/// `k notin (a,b)`, joined by commas (all must hold). Empty is refused here: every selector in
/// deploy/ must name its labels.
pub(crate) fn parse_label_selector(text: &str) -> Result<selectors::LabelSelector, String> {
    if text.trim().is_empty() {
        return Err("an empty selector selects every pod".into());
    }
    selectors::LabelSelector::parse(text)
}

/// Whether `selector` selects pods labelled `labels`.
pub(crate) fn label_selector_selects(
    selector: &selectors::LabelSelector,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector.matches_labels(|key| labels.get(key).map(String::as_str))
}

/// The redundant defaults hold in every rendering (`check_rendering`), and breaking one is reported: 3 GPU
/// replicas, KEDA keeping 2 (and falling back to no fewer), SaladCloud nodes from several countries, and
/// tongs' disruption budget keeping one of its 2 replicas up.
#[test]
fn redundant_defaults_are_checked() {
    use serde_json::{Value, json};

    use crate::objects::{name_of, problems_after};

    const FULL: &str = "deploy/overlays/salad-gateway-full";
    let reported = |problems: &[String], wanted: &str| {
        assert!(
            problems.iter().any(|problem| problem.contains(wanted)),
            "expected a problem containing {wanted:?}, got {problems:#?}"
        );
    };
    let edit = |kind: &'static str, name: &'static str, change: &dyn Fn(&mut Value)| {
        problems_after(FULL, |documents| {
            let doc = documents
                .iter_mut()
                .find(|doc| doc["kind"] == kind && name_of(doc) == name)
                .unwrap_or_else(|| panic!("{kind}/{name}"));
            change(doc);
        })
    };
    let annotate = |value: Value| {
        move |doc: &mut Value| {
            doc["spec"]["template"]["metadata"]["annotations"]["salad.com/country-codes"] =
                value.clone();
        }
    };

    let problems = edit("Deployment", "inference", &|doc| {
        doc["spec"]["replicas"] = json!(1)
    });
    reported(&problems, "run at least 3 GPU nodes");
    let problems = edit("ScaledObject", "inference", &|doc| {
        doc["spec"]["minReplicaCount"] = json!(1)
    });
    reported(&problems, "minReplicaCount 1: keep at least 2 GPU nodes");
    let problems = edit("ScaledObject", "inference", &|doc| {
        doc["spec"]["fallback"]["replicas"] = json!(1)
    });
    reported(&problems, "fallback replicas 1 is below minReplicaCount 2");
    let problems = edit("Deployment", "inference", &annotate(json!("us, ca")));
    reported(&problems, "\" ca\" is no lowercase two-letter code");
    let problems = edit("Deployment", "inference", &annotate(json!("us")));
    reported(&problems, "name 2 or more distinct countries");
    let problems = edit("Deployment", "inference", &annotate(json!("us,us")));
    reported(&problems, "name 2 or more distinct countries");
    let problems = edit("Deployment", "inference", &|doc| {
        let annotations = &mut doc["spec"]["template"]["metadata"]["annotations"];
        annotations
            .as_object_mut()
            .expect("annotations")
            .remove("salad.com/country-codes");
    });
    reported(&problems, "set salad.com/country-codes");
    let problems = edit("PodDisruptionBudget", "tongs", &|doc| {
        doc["spec"]["minAvailable"] = json!(0)
    });
    reported(&problems, "expected 1");
    let problems = edit("Deployment", "tongs", &|doc| {
        doc["spec"]["replicas"] = json!(1)
    });
    reported(&problems, "minAvailable 1 blocks every node drain");
}

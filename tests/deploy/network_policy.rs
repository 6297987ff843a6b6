//! The NetworkPolicy of deploy/components/network-policy: it selects tongs' pods and isolates them both
//! ways; clients reach port `http`, only Prometheus' namespace reaches port `admin`; tongs goes out only
//! to DNS and HTTPS (and the API server's 6443); and what tongs.yaml dials is among what it lets out.

use std::collections::BTreeSet;

use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tongs::config::Rule;

use crate::fleet::{is_salad, label_selector_selects, parse_label_selector};
use crate::objects::{Asks, Objects};
use crate::pods::{TongsPod, named_port, pod_spec, resolve_port, selector_selects};
use crate::problems::Problems;
use crate::{TONGS, pods::pod_labels};

/// What tongs may dial: DNS both ways, HTTPS, and the API server where it listens on 6443.
const EGRESS: [(&str, i32); 4] = [("UDP", 53), ("TCP", 53), ("TCP", 443), ("TCP", 6443)];
/// The namespace label the API server sets on every namespace (Kubernetes 1.22 and later).
const NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";

/// A port of a policy rule as (protocol, number), resolved on tongs' container for ingress.
fn port_of(port: &NetworkPolicyPort, tongs: Option<&TongsPod>) -> Option<(String, i32)> {
    let protocol = port.protocol.clone().unwrap_or_else(|| "TCP".into());
    let number = match port.port.as_ref()? {
        IntOrString::Int(number) => *number,
        IntOrString::String(name) => named_port(tongs?.container, name)?,
    };
    Some((protocol, number))
}

/// The namespace a peer is limited to by `kubernetes.io/metadata.name`, or a problem.
fn peer_namespace(peer: &NetworkPolicyPeer) -> Result<String, String> {
    if peer.ip_block.is_some() {
        return Err("an ipBlock".into());
    }
    let Some(selector) = &peer.namespace_selector else {
        return Err("pods of tongs' own namespace (no namespaceSelector)".into());
    };
    selector
        .match_labels
        .as_ref()
        .and_then(|labels| labels.get(NAMESPACE_NAME))
        .filter(|_| {
            selector
                .match_expressions
                .as_ref()
                .is_none_or(Vec::is_empty)
        })
        .cloned()
        .ok_or_else(|| format!("namespaces {selector:?} rather than one named by {NAMESPACE_NAME}"))
}

pub(crate) fn check_network_policy(
    at: &str,
    policy: &NetworkPolicy,
    objects: &Objects,
    problems: &mut Problems,
) {
    let Some(spec) = policy.spec.as_ref() else {
        return problems.fail(at, "has no spec");
    };
    let tongs = TongsPod::of(objects);
    let selects_tongs = objects.deployments.get(TONGS).is_some_and(|deployment| {
        selector_selects(spec.pod_selector.as_ref(), &pod_labels(deployment))
    });
    ensure!(
        problems,
        at,
        selects_tongs,
        "podSelector selects no pod of the Deployment {TONGS}"
    );
    let types: BTreeSet<&str> = spec
        .policy_types
        .iter()
        .flatten()
        .map(String::as_str)
        .collect();
    ensure!(
        problems,
        at,
        types == BTreeSet::from(["Egress", "Ingress"]),
        "policyTypes {types:?}: isolate tongs' pods both ways (Ingress and Egress)"
    );
    let Some(tongs) = tongs else {
        return;
    };
    let container_port = |name: &str| named_port(tongs.container, name);
    let (http, admin) = (container_port("http"), container_port("admin"));

    let mut clients_admitted = false;
    for rule in spec.ingress.iter().flatten() {
        let ports = rule.ports.as_deref().unwrap_or(&[]);
        let mut numbers = Vec::new();
        for port in ports {
            match port_of(port, Some(&tongs)) {
                Some((_, number)) => numbers.push(number),
                None => problems.fail(
                    at,
                    format!(
                        "ingress port {:?} is no port of tongs' container",
                        port.port
                    ),
                ),
            }
        }
        let covers =
            |port: Option<i32>| ports.is_empty() || numbers.iter().any(|n| Some(*n) == port);
        let peers = rule.from.as_deref().unwrap_or(&[]);
        if covers(http) {
            clients_admitted = true;
        }
        if !covers(admin) {
            continue;
        }
        ensure!(
            problems,
            at,
            !peers.is_empty(),
            "an ingress rule lets anyone reach the admin port (/debug/endpoints names every GPU node): \
             name Prometheus' namespace in `from`"
        );
        for peer in peers {
            if let Err(what) = peer_namespace(peer) {
                problems.fail(
                    at,
                    format!(
                        "the admin port is open to {what}; only Prometheus' namespace may reach it"
                    ),
                );
            }
        }
        // The KEDA component queries the same Prometheus.
        for scaled in objects.scaled_objects.values() {
            let triggers = scaled["spec"]["triggers"].as_array().into_iter().flatten();
            for trigger in triggers.filter(|trigger| trigger["type"] == "prometheus") {
                let address = trigger["metadata"]["serverAddress"].as_str().unwrap_or("");
                let host = address
                    .split("://")
                    .nth(1)
                    .unwrap_or("")
                    .split(['/', ':'])
                    .next();
                let namespace = host.and_then(|host| host.split('.').nth(1));
                let admitted = peers
                    .iter()
                    .any(|peer| peer_namespace(peer).ok().as_deref() == namespace);
                ensure!(
                    problems,
                    at,
                    namespace.is_none() || admitted,
                    "the ScaledObject queries Prometheus in namespace {namespace:?}, which the admin \
                     port does not admit"
                );
            }
        }
    }
    ensure!(
        problems,
        at,
        clients_admitted,
        "no ingress rule lets clients reach port http"
    );

    let allowed = egress_ports(policy);
    for (protocol, number) in &allowed {
        let known = EGRESS.iter().any(|(p, n)| p == protocol && n == number);
        ensure!(
            problems,
            at,
            known,
            "egress to {protocol} {number}: tongs needs DNS and HTTPS only ({EGRESS:?})"
        );
    }
    for rule in spec.egress.iter().flatten() {
        ensure!(
            problems,
            at,
            rule.ports.as_ref().is_some_and(|ports| !ports.is_empty()),
            "an egress rule without ports lets tongs out on every port"
        );
    }
    for (protocol, number) in [("UDP", 53), ("TCP", 53), ("TCP", 443)] {
        ensure!(
            problems,
            at,
            allowed.contains(&(protocol.to_owned(), number)),
            "egress lacks {protocol} {number}"
        );
    }
}

/// The (protocol, port) pairs a policy lets tongs' pods out on, whatever the destination.
fn egress_ports(policy: &NetworkPolicy) -> BTreeSet<(String, i32)> {
    let rules = policy
        .spec
        .iter()
        .flat_map(|spec| spec.egress.iter().flatten());
    rules
        .flat_map(|rule| rule.ports.iter().flatten())
        .filter_map(|port| port_of(port, None))
        .collect()
}

/// With a NetworkPolicy in the rendering, every address tongs.yaml makes tongs dial is on a port the
/// policy lets out: static endpoints, and GPU pods reached at podIP:containerPort.
pub(crate) fn check_policy_lets_tongs_reach(asks: &Asks, problems: &mut Problems) {
    let (at, _tongs, _config, objects) = asks.parts();
    for (name, policy) in &objects.network_policies {
        let allowed = egress_ports(policy);
        let lets_out = |port: i32| allowed.contains(&("TCP".to_owned(), port));
        for discovery in asks.discoveries {
            let at = &format!("{at}{}", discovery.shown());
            let config = &discovery.config;
            for endpoint in &config.discovery.static_endpoints {
                let port = endpoint.url.parse::<http::Uri>().ok().and_then(|uri| {
                    uri.port_u16().map(i32::from).or(match uri.scheme_str() {
                        Some("https") => Some(443),
                        Some("http") => Some(80),
                        _ => None,
                    })
                });
                ensure!(
                    problems,
                    at,
                    port.is_some_and(lets_out),
                    "discovery.static endpoint {} is on a port NetworkPolicy/{name} does not let out",
                    endpoint.url
                );
            }
            let kubernetes = &config.discovery.kubernetes;
            if !kubernetes.enabled || !kubernetes.rules.contains(&Rule::PodIp) {
                continue;
            }
            let Ok(selector) = parse_label_selector(&kubernetes.label_selector) else {
                continue;
            };
            let workloads = objects.deployments.iter().filter(|(workload, deployment)| {
                *workload != TONGS
                    && !is_salad(deployment)
                    && label_selector_selects(&selector, &pod_labels(deployment))
            });
            for (workload, deployment) in workloads {
                let containers = pod_spec(deployment).map_or(&[][..], |spec| &spec.containers);
                let port = containers.iter().find_map(|container| {
                    resolve_port(
                        container,
                        &IntOrString::String(kubernetes.port_name.clone()),
                    )
                });
                ensure!(
                    problems,
                    at,
                    port.is_none_or(lets_out),
                    "tongs reaches Deployment/{workload}'s pods at podIP:{port:?}, which \
                     NetworkPolicy/{name} does not let out"
                );
            }
        }
    }
}

#[test]
fn broken_network_policies_are_reported() {
    use serde_json::{Value, json};

    use crate::objects::{name_of, problems_after};
    use crate::render::rendered;

    const FULL: &str = "deploy/overlays/salad-gateway-full";
    let reported = |problems: &[String], wanted: &str| {
        assert!(
            problems.iter().any(|problem| problem.contains(wanted)),
            "expected a problem containing {wanted:?}, got {problems:#?}"
        );
    };
    let edit = |change: fn(&mut Value)| {
        problems_after(FULL, |documents| {
            let doc = documents
                .iter_mut()
                .find(|doc| doc["kind"] == "NetworkPolicy")
                .expect("a NetworkPolicy");
            change(&mut doc["spec"]);
        })
    };
    assert_eq!(problems_after(FULL, |_| {}), Vec::<String>::new());

    // The admin port open to anyone, or to every namespace.
    let problems = edit(|spec| spec["ingress"][1]["from"] = json!([]));
    reported(&problems, "lets anyone reach the admin port");
    let problems = edit(|spec| spec["ingress"][1]["from"] = json!([{ "namespaceSelector": {} }]));
    reported(
        &problems,
        "rather than one named by kubernetes.io/metadata.name",
    );
    // Prometheus elsewhere than where the ScaledObject queries it.
    let problems = edit(|spec| {
        spec["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"][NAMESPACE_NAME] =
            json!("observability")
    });
    reported(
        &problems,
        "queries Prometheus in namespace Some(\"monitoring\")",
    );
    // Out on every port, or on one tongs has no use for.
    let problems =
        edit(|spec| spec["egress"] = json!([{ "to": [{ "ipBlock": { "cidr": "0.0.0.0/0" } }] }]));
    reported(&problems, "without ports lets tongs out on every port");
    reported(&problems, "egress lacks UDP 53");
    let problems = edit(|spec| {
        let ports = spec["egress"][1]["ports"].as_array_mut().expect("ports");
        ports.push(json!({ "port": 8000 }));
    });
    reported(&problems, "egress to TCP 8000");
    // Not isolating tongs at all.
    let problems = edit(|spec| spec["podSelector"] = json!({ "matchLabels": { "app": "other" } }));
    reported(&problems, "selects no pod of the Deployment tongs");
    let problems = edit(|spec| spec["policyTypes"] = json!(["Ingress"]));
    reported(&problems, "isolate tongs' pods both ways");

    // A static endpoint on a port the policy does not let out.
    let problems = problems_after(FULL, |documents| {
        let config_map = documents
            .iter_mut()
            .find(|doc| doc["kind"] == "ConfigMap" && name_of(doc).starts_with("tongs-config"))
            .expect("tongs' ConfigMap");
        let text = config_map["data"]["tongs.yaml"]
            .as_str()
            .expect("tongs.yaml")
            .replace(
                "    write_back: false\n",
                "    write_back: false\n  static:\n    - url: http://10.1.2.3:8000\n",
            );
        config_map["data"]["tongs.yaml"] = Value::String(text);
    });
    reported(&problems, "endpoint http://10.1.2.3:8000 is on a port");
    // interLink's pods, reached at podIP:8000, behind the policy.
    let (_, full) = rendered()
        .iter()
        .find(|(source, _)| source == FULL)
        .expect("the full overlay renders");
    let network_policy = full
        .iter()
        .find(|doc| doc["kind"] == "NetworkPolicy")
        .expect("a NetworkPolicy")
        .clone();
    let problems = problems_after("deploy/overlays/interlink", |documents| {
        documents.push(network_policy);
    });
    reported(&problems, "pods at podIP:Some(8000)");
}

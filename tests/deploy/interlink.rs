//! The interLink overlay serves: its GPU pods land on interLink's virtual node (they tolerate its taint
//! and select its label), interLink's wstunnel tunnel gives them a podIP in the cluster's pod network,
//! and tongs' configuration, read by tongs' own code, serves a pod at such a podIP and refuses the
//! 127.0.0.1 interLink reports without a tunnel.
//!
//! What interLink does, from interlink-hq/interLink 0.6.2, pkg/virtualkubelet/virtualkubelet.go:
//! `NewProviderConfig` taints the virtual node `virtual-node.interlink/no-schedule=true:NoSchedule`
//! and labels it (`VIRTUAL_NODE_LABELS`, besides `kubernetes.io/hostname` = its name); `CreatePod`
//! sets status.podIP to 127.0.0.1, or, when `shouldCreateWstunnel` holds (`Network.EnableTunnel`, a
//! containerPort or `interlink.eu/wstunnel-extra-ports`, no `interlink.eu/pod-vpn`), to the podIP of
//! the wstunnel server pod it starts (`waitForWstunnelPodIP`), or the pod's `interlink.eu/pod-ip`
//! annotation in place of either; its default wstunnel template gives that pod containerPorts 8080
//! and 51820 of its own. The default pod CIDR of interLink's mesh configuration is 10.244.0.0/16
//! (pkg/virtualkubelet/mesh.go, `podCIDRCluster`; docs/docs/guides/13-mesh-network-configuration.mdx),
//! and 10.244.1.15 the pod address its example traffic flow shows.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Toleration;
use serde_json::{Value, json};
use tongs::balance::config_problems;
use tongs::config::{Config, Rule};
use tongs::source::kubernetes::object::WatchedPod;
use tongs::source::kubernetes::pods::{PodFacts, PodState, Reason, Rules};

use crate::objects::name_of;
use crate::pods::{named_port, pod_meta, pod_spec};
use crate::problems::Problems;
use crate::render::rendered;
use crate::{INFERENCE, read};

const OVERLAY: &str = "deploy/overlays/interlink";

/// The taint interLink's virtual kubelet puts on its node: key, value, effect.
const VIRTUAL_NODE_TAINT: (&str, &str, &str) =
    ("virtual-node.interlink/no-schedule", "true", "NoSchedule");
/// The labels interLink's virtual kubelet gives every virtual node, whatever its configuration
/// (`kubernetes.io/hostname` is the node's name, and `NodeLabels` may add more).
const VIRTUAL_NODE_LABELS: [(&str, &str); 5] = [
    (
        "alpha.service-controller.kubernetes.io/exclude-balancer",
        "true",
    ),
    ("kubernetes.io/os", "virtual-kubelet"),
    ("kubernetes.io/role", "agent"),
    (
        "node.kubernetes.io/exclude-from-external-load-balancers",
        "true",
    ),
    ("virtual-node.interlink/type", "virtual-kubelet"),
];
/// An ordinary node's labels, which the GPU pods must not select.
const ORDINARY_NODE_LABELS: [(&str, &str); 3] = [
    ("kubernetes.io/os", "linux"),
    ("kubernetes.io/hostname", "node-1"),
    (
        "node.kubernetes.io/exclude-from-external-load-balancers",
        "true",
    ),
];
/// The annotation that turns interLink's tunnel off for a pod (and asks for its pod VPN instead).
const POD_VPN: &str = "interlink.eu/pod-vpn";
/// The annotation whose address interLink reports as podIP in place of the tunnel's.
const POD_IP_ANNOTATION: &str = "interlink.eu/pod-ip";
/// The containerPorts the wstunnel server pod listens on itself (interLink's default template).
const WSTUNNEL_OWN_PORTS: [i32; 2] = [8080, 51820];
/// interLink's default pod CIDR of the cluster, and a pod address in it from interLink's docs.
const POD_CIDR: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 244, 0, 0), 16);
const POD_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 15);
/// What interLink reports as podIP without a tunnel.
const NO_TUNNEL_IP: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// Whether `toleration` tolerates the taint `(key, value, effect)`, as the scheduler decides it.
fn tolerates(toleration: &Toleration, (key, value, effect): (&str, &str, &str)) -> bool {
    let effect_ok = toleration
        .effect
        .as_deref()
        .is_none_or(|e| e.is_empty() || e == effect);
    let key_ok = match toleration.key.as_deref() {
        None | Some("") => toleration.operator.as_deref() == Some("Exists"),
        Some(k) => k == key,
    };
    let value_ok = match toleration.operator.as_deref() {
        Some("Exists") => true,
        None | Some("Equal") => toleration.value.as_deref().unwrap_or("") == value,
        Some(_) => false,
    };
    effect_ok && key_ok && value_ok
}

/// Whether a nodeSelector picks a node labelled `labels`.
fn selects_node(selector: &BTreeMap<String, String>, labels: &[(&str, &str)]) -> bool {
    selector
        .iter()
        .all(|(key, value)| labels.iter().any(|(k, v)| k == key && v == value))
}

/// The tongs.yaml the rendering's ConfigMap holds, parsed (and validated) by tongs itself.
fn tongs_config(documents: &[Value], problems: &mut Problems) -> Option<Config> {
    let text = documents
        .iter()
        .find(|doc| doc["kind"] == "ConfigMap" && name_of(doc).starts_with("tongs-config"))
        .and_then(|doc| doc["data"]["tongs.yaml"].as_str());
    let Some(text) = text else {
        problems.fail(
            OVERLAY,
            "renders no ConfigMap tongs-config with a tongs.yaml",
        );
        return None;
    };
    Config::parse_with(text, OVERLAY, config_problems)
        .map_err(|err| problems.fail(OVERLAY, format!("tongs.yaml: {err}")))
        .ok()
}

/// A Running, Ready pod of the Deployment as the virtual kubelet reports it, at `pod_ip`.
fn reported_pod(deployment: &Value, pod_ip: IpAddr) -> WatchedPod {
    let template = &deployment["spec"]["template"];
    let pod = json!({
        "metadata": {
            "namespace": "tongs",
            "name": "inference-7d9f-abcde",
            "uid": "4b1e0f6e-2c1d-4c55-9d0e-3f7a1c9b8e21",
            "labels": template["metadata"]["labels"],
            "annotations": template["metadata"]["annotations"],
        },
        "spec": template["spec"],
        "status": {
            "phase": "Running",
            "podIP": pod_ip.to_string(),
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    });
    serde_json::from_value(pod).expect("a pod tongs' watch reads")
}

/// Checks a rendering of the interLink overlay; the problems found.
fn check_interlink(documents: &[Value]) -> Vec<String> {
    let mut problems = Problems::default();
    let at = &format!("{OVERLAY} (Deployment/{INFERENCE})");
    let Some(raw) = documents
        .iter()
        .find(|doc| doc["kind"] == "Deployment" && name_of(doc) == INFERENCE)
    else {
        problems.fail(OVERLAY, format!("renders no Deployment {INFERENCE}"));
        return problems.0;
    };
    let deployment: Deployment = serde_json::from_value(raw.clone()).expect("a Deployment");
    let Some(spec) = pod_spec(&deployment) else {
        problems.fail(at, "has no pod spec");
        return problems.0;
    };

    let (key, value, effect) = VIRTUAL_NODE_TAINT;
    let tolerated = spec
        .tolerations
        .iter()
        .flatten()
        .any(|t| tolerates(t, VIRTUAL_NODE_TAINT));
    ensure!(
        problems,
        at,
        tolerated,
        "the pods must tolerate interLink's taint {key}={value}:{effect}, or no virtual node takes them"
    );
    let selector = spec.node_selector.clone().unwrap_or_default();
    let mut virtual_node = VIRTUAL_NODE_LABELS.to_vec();
    if let Some(name) = selector.get("kubernetes.io/hostname") {
        virtual_node.push(("kubernetes.io/hostname", name));
    }
    ensure!(
        problems,
        at,
        !selector.is_empty()
            && selects_node(&selector, &virtual_node)
            && !selects_node(&selector, &ORDINARY_NODE_LABELS),
        "nodeSelector {selector:?} must select interLink's virtual node (labels \
         {VIRTUAL_NODE_LABELS:?}, or its kubernetes.io/hostname) and no ordinary node"
    );
    let annotations = pod_meta(&deployment, |meta| meta.annotations.clone()).unwrap_or_default();
    ensure!(
        problems,
        at,
        !annotations.contains_key(POD_VPN),
        "the pods carry {POD_VPN}, which turns interLink's wstunnel tunnel off for them"
    );
    ensure!(
        problems,
        at,
        !annotations.contains_key(POD_IP_ANNOTATION),
        "the pods carry {POD_IP_ANNOTATION}: interLink would report that address, not the tunnel's"
    );

    let Some(config) = tongs_config(documents, &mut problems) else {
        return problems.0;
    };
    let kubernetes = &config.discovery.kubernetes;
    let port = spec
        .containers
        .iter()
        .find_map(|c| named_port(c, &kubernetes.port_name).map(|port| (c, port)));
    match port {
        Some((container, port)) => {
            let protocol = container
                .ports
                .iter()
                .flatten()
                .find(|p| p.container_port == port)
                .and_then(|p| p.protocol.clone());
            ensure!(
                problems,
                at,
                protocol.as_deref().is_none_or(|p| p == "TCP"),
                "containerPort {port} is {protocol:?}: the tunnel forwards TCP ports only"
            );
            ensure!(
                problems,
                at,
                !WSTUNNEL_OWN_PORTS.contains(&port),
                "containerPort {port}: the wstunnel server pod, whose IP the pods get, listens on \
                 {WSTUNNEL_OWN_PORTS:?} itself"
            );
        }
        None => problems.fail(
            at,
            format!(
                "no containerPort named {:?}: the pod-ip rule has no port, and the tunnel \
                 forwards only declared ports",
                kubernetes.port_name
            ),
        ),
    }

    let (network, len) = POD_CIDR;
    let last = Ipv4Addr::from(u32::from(network) | (u32::MAX >> len));
    let allow = kubernetes.allow_rules();
    let admits = |ip: Ipv4Addr| allow.iter().any(|rule| rule.allows_ip(IpAddr::V4(ip)));
    ensure!(
        problems,
        at,
        admits(network) && admits(last),
        "discovery.kubernetes.allow {:?} does not admit interLink's pod CIDR {network}/{len}",
        kubernetes.allow
    );

    let rules = Rules::new(kubernetes, config.salad.api_enabled());
    let facts = |ip: Ipv4Addr| PodFacts::from_pod(&reported_pod(raw, IpAddr::V4(ip)), kubernetes);
    let served = rules.derive(&facts(POD_IP), None);
    let wanted = port.map(|(_, port)| format!("http://{POD_IP}:{port}"));
    ensure!(
        problems,
        at,
        served.state == PodState::Serving
            && served.rule == Some(Rule::PodIp)
            && served.spec.as_ref().map(|spec| &spec.url) == wanted.as_ref(),
        "a Ready pod at podIP {POD_IP} is {:?} by rule {:?} at {:?} (rejections {:?}), not served \
         by pod-ip at {wanted:?}",
        served.state,
        served.rule,
        served.spec.as_ref().map(|spec| &spec.url),
        served.rejections
    );
    let unreachable = rules.derive(&facts(NO_TUNNEL_IP), None);
    ensure!(
        problems,
        at,
        unreachable.state != PodState::Serving
            && unreachable
                .rejections
                .iter()
                .any(|r| r.reason == Reason::LoopbackPodIp),
        "a pod at {NO_TUNNEL_IP} (interLink without its tunnel) is {:?} by rule {:?}: tongs \
         would send requests to itself",
        unreachable.state,
        unreachable.rule
    );
    problems.0
}

fn rendering() -> Vec<Value> {
    rendered()
        .iter()
        .find(|(source, _)| source == OVERLAY)
        .map(|(_, documents)| documents.clone())
        .unwrap_or_else(|| panic!("{OVERLAY} renders"))
}

fn inference(documents: &mut [Value]) -> &mut Value {
    documents
        .iter_mut()
        .find(|doc| doc["kind"] == "Deployment" && name_of(doc) == INFERENCE)
        .expect("the example workload")
}

fn with_tongs_yaml(documents: &mut [Value], text: String) {
    let config_map = documents
        .iter_mut()
        .find(|doc| doc["kind"] == "ConfigMap" && name_of(doc).starts_with("tongs-config"))
        .expect("tongs' ConfigMap");
    config_map["data"]["tongs.yaml"] = Value::String(text);
}

#[test]
fn interlink_pods_land_on_the_virtual_node_and_are_served_at_their_tunnel_ip() {
    assert_eq!(check_interlink(&rendering()), Vec::<String>::new());
}

#[test]
fn interlink_checks_catch_broken_renderings() {
    let problems_after = |change: &dyn Fn(&mut Vec<Value>)| {
        let mut documents = rendering();
        change(&mut documents);
        check_interlink(&documents)
    };
    let reported = |problems: Vec<String>, wanted: &str| {
        assert!(
            problems.iter().any(|problem| problem.contains(wanted)),
            "expected a problem containing {wanted:?}, got {problems:#?}"
        );
    };
    let edit = |change: fn(&mut Value)| {
        move |documents: &mut Vec<Value>| {
            change(&mut inference(documents)["spec"]["template"]["spec"])
        }
    };

    // The pre-fix example: no toleration, no nodeSelector.
    reported(
        problems_after(&edit(|spec| {
            spec.as_object_mut().unwrap().remove("tolerations");
        })),
        "must tolerate interLink's taint",
    );
    reported(
        problems_after(&edit(|spec| {
            spec["tolerations"][0]["key"] = json!("virtual-kubelet.io/provider");
        })),
        "must tolerate interLink's taint",
    );
    reported(
        problems_after(&edit(|spec| {
            spec.as_object_mut().unwrap().remove("nodeSelector");
        })),
        "must select interLink's virtual node",
    );
    reported(
        problems_after(&edit(|spec| {
            spec["nodeSelector"] = json!({"kubernetes.io/os": "linux"});
        })),
        "must select interLink's virtual node",
    );
    reported(
        problems_after(&|documents| {
            inference(documents)["spec"]["template"]["metadata"]["annotations"] =
                json!({ POD_VPN: "true" });
        }),
        "turns interLink's wstunnel tunnel off",
    );
    reported(
        problems_after(&|documents| {
            inference(documents)["spec"]["template"]["metadata"]["annotations"] =
                json!({ POD_IP_ANNOTATION: "10.244.1.50" });
        }),
        "not the tunnel's",
    );
    reported(
        problems_after(&edit(|spec| {
            spec["containers"][0]["ports"][0]["containerPort"] = json!(8080);
        })),
        "listens on [8080, 51820] itself",
    );
    reported(
        problems_after(&edit(|spec| {
            spec["containers"][0]["ports"][0]["name"] = json!("api");
        })),
        "no containerPort named \"http\"",
    );
    // The base's tongs.yaml: default allow list, which holds no pod CIDR.
    reported(
        problems_after(&|documents| {
            with_tongs_yaml(documents, read("deploy/base/tongs.yaml"));
        }),
        "does not admit interLink's pod CIDR 10.244.0.0/16",
    );
    // An allow list that names loopback: interLink's no-tunnel podIP would be served.
    reported(
        problems_after(&|documents| {
            let text = read("deploy/overlays/interlink/tongs.yaml").replace(
                "allow: [10.244.0.0/16]",
                "allow: [10.244.0.0/16, 127.0.0.0/8]",
            );
            with_tongs_yaml(documents, text);
        }),
        "tongs would send requests to itself",
    );
    // Without the pod-ip rule, nothing gives these pods an address.
    reported(
        problems_after(&|documents| {
            let text = read("deploy/overlays/interlink/tongs.yaml")
                .replace("rules: [pod-ip]", "rules: [url]");
            with_tongs_yaml(documents, text);
        }),
        "not served by pod-ip",
    );
}

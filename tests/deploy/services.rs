//! Services (their selectors and target ports), ConfigMaps (tongs.yaml and Grafana dashboards) and
//! the PodDisruptionBudget.

use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::TONGS;
use crate::config::parse_config;
use crate::dashboard::check_dashboard;
use crate::objects::Objects;
use crate::pods::{pod_spec, resolve_port, selected, selector_selects, selects};
use crate::problems::Problems;
use crate::secrets::SecretMount;

/// The label Grafana's dashboard sidecar loads ConfigMaps by.
const DASHBOARD_LABEL: (&str, &str) = ("grafana_dashboard", "1");

pub(crate) fn check_service(
    at: &str,
    name: &str,
    service: &Service,
    objects: &Objects,
    problems: &mut Problems,
) {
    let Some(spec) = service.spec.as_ref() else {
        return problems.fail(at, "has no spec");
    };
    let Some(target) = selected(objects, |labels| selects(spec.selector.as_ref(), labels)) else {
        return problems.fail(at, "selects the pods of no Deployment in the rendering");
    };
    let containers = pod_spec(target).map_or(&[][..], |spec| &spec.containers);
    let ports = spec.ports.as_deref().unwrap_or(&[]);
    for port in ports {
        let target_port = port
            .target_port
            .clone()
            .unwrap_or(IntOrString::Int(port.port));
        let resolved = containers
            .iter()
            .find_map(|container| resolve_port(container, &target_port));
        ensure!(
            problems,
            at,
            resolved.is_some(),
            "targetPort {target_port:?} is no container port of the selected pods"
        );
    }
    if name == TONGS {
        for (port_name, number) in [("http", 8080), ("admin", 9090)] {
            let found = ports
                .iter()
                .any(|p| p.name.as_deref() == Some(port_name) && p.port == number);
            ensure!(problems, at, found, "needs port `{port_name}` {number}");
        }
    }
}

pub(crate) fn check_config_map(
    at: &str,
    config_map: &ConfigMap,
    secrets: &[SecretMount],
    problems: &mut Problems,
) {
    let data = config_map.data.clone().unwrap_or_default();
    if let Some(text) = data.get("tongs.yaml") {
        parse_config(at, text, secrets, problems);
    }
    let labels = config_map.metadata.labels.clone().unwrap_or_default();
    let (key, value) = DASHBOARD_LABEL;
    if labels.get(key).is_some_and(|v| v == value) {
        ensure!(
            problems,
            at,
            !data.is_empty(),
            "a dashboard ConfigMap without data"
        );
        for (file, text) in &data {
            check_dashboard(&format!("{at} {file}"), text, problems);
        }
    }
}

pub(crate) fn check_disruption_budget(
    at: &str,
    budget: &PodDisruptionBudget,
    objects: &Objects,
    problems: &mut Problems,
) {
    let Some(spec) = budget.spec.as_ref() else {
        return problems.fail(at, "has no spec");
    };
    let min = &spec.min_available;
    ensure!(
        problems,
        at,
        *min == Some(IntOrString::Int(1)),
        "minAvailable is {min:?}, expected 1"
    );
    let Some(target) = selected(objects, |labels| {
        selector_selects(spec.selector.as_ref(), labels)
    }) else {
        return problems.fail(at, "selects the pods of no Deployment in the rendering");
    };
    let replicas = target
        .spec
        .as_ref()
        .and_then(|spec| spec.replicas)
        .unwrap_or(1);
    ensure!(
        problems,
        at,
        replicas > 1,
        "with {replicas} replica(s), minAvailable 1 blocks every node drain"
    );
}

//! One rendering: its objects parsed and collected by name, each checked on its own and then the
//! references between them.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde_json::Value;
use tongs::config::Config;

use crate::TONGS;
use crate::alerts::check_prometheus_rule;
use crate::config::check_keeps_base_keys;
use crate::custom_resources::{check_scaled_object, check_service_monitor};
use crate::deployment::check_tongs;
use crate::fleet::{check_discovered_workloads, check_inference};
use crate::network_policy::{check_network_policy, check_policy_lets_tongs_reach};
use crate::pods::TongsPod;
use crate::pools::{Discovery, check_pool_scaling, discoveries};
use crate::problems::{Problems, parse};
use crate::rbac::{check_access, check_role, check_role_binding};
use crate::render::rendered;
use crate::secrets::check_secret_files;
use crate::services::{check_config_map, check_disruption_budget, check_service};
use crate::tailscale::check_tailscale_proxy;

/// The objects of one rendering, by name, for the checks that span objects.
#[derive(Default)]
pub(crate) struct Objects {
    pub(crate) deployments: BTreeMap<String, Deployment>,
    pub(crate) services: BTreeMap<String, Service>,
    pub(crate) config_maps: BTreeMap<String, ConfigMap>,
    pub(crate) service_accounts: BTreeSet<String>,
    pub(crate) roles: BTreeMap<String, Role>,
    pub(crate) role_bindings: BTreeMap<String, RoleBinding>,
    pub(crate) disruption_budgets: BTreeMap<String, PodDisruptionBudget>,
    pub(crate) service_monitors: BTreeMap<String, Value>,
    pub(crate) scaled_objects: BTreeMap<String, Value>,
    pub(crate) prometheus_rules: BTreeMap<String, Value>,
    pub(crate) network_policies: BTreeMap<String, NetworkPolicy>,
}

pub(crate) fn name_of(value: &Value) -> String {
    value["metadata"]["name"].as_str().unwrap_or("").to_owned()
}

/// Parses every object of a rendering, reporting any kind this test has no checks for.
fn collect(source: &str, documents: &[Value], problems: &mut Problems) -> Objects {
    let mut objects = Objects::default();
    for value in documents {
        let kind = value["kind"].as_str().unwrap_or("");
        let name = name_of(value);
        let at = &format!("{source}: {kind}/{name}");
        ensure!(problems, at, !name.is_empty(), "has no metadata.name");
        match kind {
            "Deployment" => {
                if let Some(object) = parse(value, at, problems) {
                    objects.deployments.insert(name, object);
                }
            }
            "Service" => {
                if let Some(object) = parse(value, at, problems) {
                    objects.services.insert(name, object);
                }
            }
            "ConfigMap" => {
                if let Some(object) = parse(value, at, problems) {
                    objects.config_maps.insert(name, object);
                }
            }
            "Role" => {
                if let Some(object) = parse(value, at, problems) {
                    objects.roles.insert(name, object);
                }
            }
            "RoleBinding" => {
                if let Some(object) = parse(value, at, problems) {
                    objects.role_bindings.insert(name, object);
                }
            }
            "PodDisruptionBudget" => {
                if let Some(object) = parse(value, at, problems) {
                    objects.disruption_budgets.insert(name, object);
                }
            }
            "ServiceAccount" => {
                if parse::<ServiceAccount>(value, at, problems).is_some() {
                    objects.service_accounts.insert(name);
                }
            }
            "Namespace" => {
                parse::<Namespace>(value, at, problems);
            }
            "ServiceMonitor" => {
                objects.service_monitors.insert(name, value.clone());
            }
            "ScaledObject" => {
                objects.scaled_objects.insert(name, value.clone());
            }
            "NetworkPolicy" => {
                if let Some(object) = parse(value, at, problems) {
                    objects.network_policies.insert(name, object);
                }
            }
            "PrometheusRule" => {
                objects.prometheus_rules.insert(name, value.clone());
            }
            other => problems.fail(
                at,
                format!("tests/deploy.rs has no checks for kind {other:?}: add them"),
            ),
        }
    }
    objects
}

/// Checks one rendering: each object on its own, then the references between them.
/// What tongs.yaml asks of the rest of one rendering: where to report, tongs' pod, its configuration,
/// where each of its pools finds endpoints, and the rendering's objects.
#[derive(Clone, Copy)]
pub(crate) struct Asks<'a> {
    pub(crate) at: &'a str,
    pub(crate) tongs: &'a TongsPod<'a>,
    pub(crate) config: &'a Config,
    pub(crate) discoveries: &'a [Discovery],
    pub(crate) objects: &'a Objects,
}

impl<'a> Asks<'a> {
    /// Where to report, tongs' pod, its configuration, the objects.
    pub(crate) fn parts(&self) -> (&'a str, &'a TongsPod<'a>, &'a Config, &'a Objects) {
        (self.at, self.tongs, self.config, self.objects)
    }
}

pub(crate) fn check_rendering(source: &str, documents: &[Value], problems: &mut Problems) {
    let objects = &collect(source, documents, problems);
    let at = |kind: &str, name: &str| format!("{source}: {kind}/{name}");
    let tongs = TongsPod::of(objects);
    let secrets = tongs
        .as_ref()
        .map(TongsPod::secret_mounts)
        .unwrap_or_default();
    let mut config = None;
    for (name, deployment) in &objects.deployments {
        match name.as_str() {
            TONGS => {
                let at = at("Deployment", name);
                config = check_tongs(&at, deployment, objects, &secrets, problems);
            }
            // Every other Deployment is a GPU workload (`inference`, or a pool's).
            _ => check_inference(&at("Deployment", name), deployment, problems),
        }
    }
    for (name, service) in &objects.services {
        check_service(&at("Service", name), name, service, objects, problems);
    }
    for (name, config_map) in &objects.config_maps {
        check_config_map(&at("ConfigMap", name), config_map, &secrets, problems);
    }
    for (name, role) in &objects.roles {
        check_role(&at("Role", name), role, problems);
    }
    for (name, binding) in &objects.role_bindings {
        check_role_binding(&at("RoleBinding", name), binding, objects, problems);
    }
    for (name, budget) in &objects.disruption_budgets {
        check_disruption_budget(&at("PodDisruptionBudget", name), budget, objects, problems);
    }
    for (name, monitor) in &objects.service_monitors {
        check_service_monitor(&at("ServiceMonitor", name), monitor, objects, problems);
    }
    for (name, scaled) in &objects.scaled_objects {
        check_scaled_object(&at("ScaledObject", name), scaled, objects, problems);
    }
    for (name, rule) in &objects.prometheus_rules {
        check_prometheus_rule(&at("PrometheusRule", name), rule, problems);
    }
    for (name, policy) in &objects.network_policies {
        check_network_policy(&at("NetworkPolicy", name), policy, objects, problems);
    }
    // What tongs.yaml asks of the rest of the rendering.
    if let (Some(tongs), Some((config, text))) = (&tongs, &config) {
        let at = &format!("{source}: tongs.yaml");
        let discoveries = discoveries(config, text).unwrap_or_else(|message| {
            problems.fail(at, message);
            Vec::new()
        });
        check_keeps_base_keys(at, config, &discoveries, problems);
        let asks = Asks {
            at,
            tongs,
            config,
            discoveries: &discoveries,
            objects,
        };
        check_access(&asks, problems);
        check_discovered_workloads(&asks, problems);
        check_pool_scaling(&asks, problems);
        check_secret_files(&asks, &secrets, problems);
        check_tailscale_proxy(at, tongs, config, problems);
        check_policy_lets_tongs_reach(&asks, problems);
    }
}

/// The problems `check_rendering` finds in `overlay`'s rendering after `change`.
pub(crate) fn problems_after(overlay: &str, change: impl FnOnce(&mut Vec<Value>)) -> Vec<String> {
    let (_, documents) = rendered()
        .iter()
        .find(|(source, _)| source == overlay)
        .unwrap_or_else(|| panic!("{overlay} renders"));
    let mut documents = documents.clone();
    change(&mut documents);
    let mut problems = Problems::default();
    check_rendering(overlay, &documents, &mut problems);
    problems.0
}

pub(crate) fn tongs_pod_spec(documents: &mut [Value]) -> &mut Value {
    let tongs = documents
        .iter_mut()
        .find(|doc| doc["kind"] == "Deployment" && name_of(doc) == TONGS)
        .expect("tongs' Deployment");
    &mut tongs["spec"]["template"]["spec"]
}

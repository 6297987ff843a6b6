//! The custom resources, whose CRDs are not in the cluster here: the ServiceMonitor scrapes tongs'
//! admin port, and the KEDA ScaledObject scales a Deployment of the rendering on demand.

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscalerBehavior;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::Value;
use tongs::metrics::DEMAND;

use crate::objects::Objects;
use crate::pods::selector_selects;
use crate::problems::{Problems, known_keys, typed};
use crate::{
    ADVANCED, METRICS_API_METADATA, MIN_SCALED_REPLICAS, PROMETHEUS_METADATA, SCALE_TARGET_REF,
    SCALED_OBJECT_SPEC, SERVICE_MONITOR_ENDPOINT, SERVICE_MONITOR_SPEC, TRIGGER,
};

/// A custom resource's `spec`, once its `apiVersion` is `version` and its spec has only `spec_keys`
/// (problems otherwise).
pub(crate) fn custom_resource_spec<'a>(
    at: &str,
    resource: &'a Value,
    version: &str,
    spec_keys: &str,
    problems: &mut Problems,
) -> &'a Value {
    let found = &resource["apiVersion"];
    ensure!(
        problems,
        at,
        *found == version,
        "apiVersion {found}, expected {version}"
    );
    let spec = &resource["spec"];
    known_keys(at, "spec", spec, spec_keys, problems);
    spec
}

pub(crate) fn check_service_monitor(
    at: &str,
    monitor: &Value,
    objects: &Objects,
    problems: &mut Problems,
) {
    let spec = custom_resource_spec(
        at,
        monitor,
        "monitoring.coreos.com/v1",
        SERVICE_MONITOR_SPEC,
        problems,
    );
    let selector: Option<LabelSelector> = serde_json::from_value(spec["selector"].clone()).ok();
    let service = objects.services.iter().find(|(_, service)| {
        selector_selects(
            selector.as_ref(),
            &service.metadata.labels.clone().unwrap_or_default(),
        )
    });
    let Some((service_name, service)) = service else {
        return problems.fail(at, "spec.selector selects no Service of the rendering");
    };
    let service_ports = service
        .spec
        .as_ref()
        .and_then(|spec| spec.ports.as_deref())
        .unwrap_or(&[]);
    let endpoints = spec["endpoints"].as_array().map_or(&[][..], Vec::as_slice);
    ensure!(problems, at, !endpoints.is_empty(), "has no endpoints");
    for endpoint in endpoints {
        known_keys(
            at,
            "an endpoint",
            endpoint,
            SERVICE_MONITOR_ENDPOINT,
            problems,
        );
        let port = endpoint["port"].as_str().unwrap_or("");
        let named = service_ports
            .iter()
            .any(|p| p.name.as_deref() == Some(port));
        ensure!(
            problems,
            at,
            named,
            "endpoint port {port:?} is no named port of Service {service_name}"
        );
    }
    let scrapes_admin = endpoints.iter().any(|endpoint| {
        endpoint["port"] == "admin"
            && endpoint["path"] == "/metrics"
            && endpoint["interval"] == "15s"
    });
    ensure!(
        problems,
        at,
        scrapes_admin,
        "must scrape port `admin` at /metrics every 15s"
    );
    // The operator sets the target label `endpoint` to the port's name; tongs' own `endpoint` label
    // survives only with honorLabels.
    let keeps_endpoint = endpoints
        .iter()
        .all(|endpoint| endpoint["honorLabels"] == true);
    ensure!(
        problems,
        at,
        keeps_endpoint,
        "set honorLabels: true, or Prometheus renames tongs' `endpoint` label to exported_endpoint"
    );
}

pub(crate) fn check_scaled_object(
    at: &str,
    scaled: &Value,
    objects: &Objects,
    problems: &mut Problems,
) {
    let spec = custom_resource_spec(at, scaled, "keda.sh/v1alpha1", SCALED_OBJECT_SPEC, problems);
    let target = &spec["scaleTargetRef"];
    known_keys(at, "scaleTargetRef", target, SCALE_TARGET_REF, problems);
    let is_deployment = target["kind"].as_str().unwrap_or("Deployment") == "Deployment"
        && target["apiVersion"].as_str().unwrap_or("apps/v1") == "apps/v1"
        && objects
            .deployments
            .contains_key(target["name"].as_str().unwrap_or(""));
    ensure!(
        problems,
        at,
        is_deployment,
        "scaleTargetRef {target} is no Deployment of the rendering"
    );
    let min = spec["minReplicaCount"].as_i64().unwrap_or(0);
    let max = spec["maxReplicaCount"].as_i64().unwrap_or(100);
    ensure!(
        problems,
        at,
        min <= max,
        "minReplicaCount {min} exceeds maxReplicaCount {max}"
    );
    ensure!(
        problems,
        at,
        min >= MIN_SCALED_REPLICAS,
        "minReplicaCount {min}: keep at least {MIN_SCALED_REPLICAS} GPU nodes, or an idle fleet's \
         every interruption is an outage"
    );
    let fallback = &spec["fallback"];
    if !fallback.is_null() {
        known_keys(
            at,
            "fallback",
            fallback,
            "failureThreshold replicas",
            problems,
        );
        let complete = fallback["failureThreshold"].is_u64() && fallback["replicas"].is_u64();
        ensure!(
            problems,
            at,
            complete,
            "fallback needs failureThreshold and replicas"
        );
        let replicas = fallback["replicas"].as_i64().unwrap_or(0);
        ensure!(
            problems,
            at,
            replicas >= min,
            "fallback replicas {replicas} is below minReplicaCount {min}"
        );
    }
    known_keys(at, "advanced", &spec["advanced"], ADVANCED, problems);
    let hpa = &spec["advanced"]["horizontalPodAutoscalerConfig"];
    known_keys(
        at,
        "horizontalPodAutoscalerConfig",
        hpa,
        "name behavior",
        problems,
    );
    if !hpa["behavior"].is_null() {
        typed::<HorizontalPodAutoscalerBehavior>(
            &hpa["behavior"],
            &format!("{at} (HPA behavior)"),
            problems,
        );
    }

    let triggers = spec["triggers"].as_array().map_or(&[][..], Vec::as_slice);
    ensure!(problems, at, !triggers.is_empty(), "has no triggers");
    let mut scales_on_demand = false;
    for trigger in triggers {
        known_keys(at, "a trigger", trigger, TRIGGER, problems);
        let metadata = &trigger["metadata"];
        for (key, value) in metadata.as_object().into_iter().flatten() {
            // KEDA's trigger metadata is a map of strings: `threshold: 4` is refused.
            ensure!(
                problems,
                at,
                value.is_string(),
                "trigger metadata {key} must be a string, got {value}"
            );
        }
        let text = |key: &str| metadata[key].as_str().unwrap_or("");
        match trigger["type"].as_str().unwrap_or("") {
            "prometheus" => {
                known_keys(
                    at,
                    "prometheus metadata",
                    metadata,
                    PROMETHEUS_METADATA,
                    problems,
                );
                let server = text("serverAddress");
                ensure!(
                    problems,
                    at,
                    server.starts_with("http"),
                    "serverAddress {server:?} is no URL"
                );
                let threshold = text("threshold");
                let positive = threshold.parse::<f64>().is_ok_and(|t| t > 0.0);
                ensure!(
                    problems,
                    at,
                    positive,
                    "threshold {threshold:?} must be a positive number"
                );
                scales_on_demand |= text("query").contains(DEMAND.name);
            }
            "metrics-api" => {
                known_keys(
                    at,
                    "metrics-api metadata",
                    metadata,
                    METRICS_API_METADATA,
                    problems,
                );
                let reads_demand =
                    text("url").ends_with("/demand") && text("valueLocation") == "demand";
                ensure!(
                    problems,
                    at,
                    reads_demand,
                    "metrics-api must read `demand` from tongs' /demand"
                );
                scales_on_demand |= reads_demand;
            }
            other => problems.fail(
                at,
                format!("trigger type {other:?} has no checks in tests/deploy.rs"),
            ),
        }
    }
    ensure!(
        problems,
        at,
        scales_on_demand,
        "no trigger scales on {}",
        DEMAND.name
    );
}

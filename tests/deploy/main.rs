//! The Kubernetes manifests in `deploy/`: every kustomization renders with `kubectl kustomize`, every
//! rendered object parses as its Kubernetes type (and loses no field doing so, which catches misspelt
//! keys), and the properties tongs relies on hold — in the base and in every overlay, so a component's
//! patch cannot quietly undo them. The tongs.yaml each rendering mounts is validated by tongs itself,
//! and what it asks of the rest is checked across objects, for each of its pools: the RBAC its
//! discovery, registration and write-back need (and no more), that one label selector picks each GPU
//! workload (one pool's) and a rule can address it, that each pool's KEDA ScaledObject scales on that
//! pool's demand, that the files it reads secrets from are mounted Secret files, and that its
//! Tailscale proxy is the sidecar's. The Grafana dashboard and the Dockerfile are checked against the
//! code they describe, the alert rules with promtool and against a real /metrics page, and the READMEs
//! against what deploy/ asks of a user.
//!
//! Needs `kubectl` on the PATH (Debian's `kubernetes-client`) and `promtool` (Debian's `prometheus`);
//! `scripts/test.sh` installs both. Without them the tests fail, never skip.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ServiceAccount;
use serde_json::Value;
use tongs::balance::config_problems;
use tongs::config::Config;

use crate::dashboard::{check_dashboard, exported, metric_names};
use crate::fleet::{label_selector_selects, parse_label_selector};
use crate::objects::{check_rendering, name_of, problems_after, tongs_pod_spec};
use crate::pods::pod_spec;
use crate::problems::{Problems, parse};
use crate::render::{Kustomization, kustomizations, rendered};

// The one path: shared with the other test binaries (see `tests/support/mod.rs`).
#[path = "../support/mod.rs"]
mod support;

/// The fake API server's selector parser: one reading of label selectors for the whole test suite.
use support::kube_api::selectors;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// tongs' own Deployment, and the example GPU Deployment the KEDA component scales.
const TONGS: &str = "tongs";
const INFERENCE: &str = "inference";
/// Where the Deployment mounts the configuration, and the command line the image runs by default.
const CONFIG_DIR: &str = "/etc/tongs";
const ARGS: [&str; 3] = ["run", "--config", "/etc/tongs/tongs.yaml"];
/// tongs' selector label for its GPU fleet.
const FLEET_LABEL: (&str, &str) = ("app.kubernetes.io/part-of", "tongs-fleet");
/// The fewest GPU nodes an autoscaler may leave: one interruption must not be an outage.
const MIN_SCALED_REPLICAS: i64 = 2;

// Fields of the custom resources' schemas that deploy/ may use (the CRDs are not in the cluster here).
const SERVICE_MONITOR_SPEC: &str = "endpoints selector namespaceSelector jobLabel targetLabels \
    podTargetLabels sampleLimit targetLimit labelLimit labelNameLengthLimit labelValueLengthLimit \
    keepDroppedTargets attachMetadata scrapeProtocols scrapeClass bodySizeLimit";
const SERVICE_MONITOR_ENDPOINT: &str = "port targetPort path scheme params interval scrapeTimeout \
    tlsConfig authorization basicAuth oauth2 honorLabels honorTimestamps metricRelabelings \
    relabelings followRedirects enableHttp2 filterRunning";
const SCALED_OBJECT_SPEC: &str = "scaleTargetRef pollingInterval cooldownPeriod \
    initialCooldownPeriod idleReplicaCount minReplicaCount maxReplicaCount fallback advanced triggers";
const SCALE_TARGET_REF: &str = "apiVersion kind name envSourceContainerName";
const ADVANCED: &str =
    "restoreToOriginalReplicaCount horizontalPodAutoscalerConfig scalingModifiers";
const TRIGGER: &str = "type metadata name useCachedMetrics authenticationRef metricType";
const PROMETHEUS_METADATA: &str = "serverAddress query queryParameters threshold \
    activationThreshold namespace customHeaders ignoreNullValues unsafeSsl timeout";
const METRICS_API_METADATA: &str = "url format valueLocation targetValue activationTargetValue \
    unsafeSsl authMode method timeout aggregateFromKubeServiceEndpoints aggregationType";
const PROMETHEUS_RULE_GROUP: &str =
    "name interval rules limit query_offset labels partial_response_strategy";
const PROMETHEUS_RULE_RULE: &str = "record alert expr for keep_firing_for labels annotations";

/// Records a problem at `$at` unless `$ok` holds. Defined above the modules, which use it: a
/// `macro_rules!` is in scope only below its definition.
macro_rules! ensure {
    ($problems:expr, $at:expr, $ok:expr, $($message:tt)+) => {
        if !$ok {
            $problems.fail($at, format!($($message)+));
        }
    };
}

mod alerts;
mod config;
mod custom_resources;
mod dashboard;
mod deployment;
mod docs;
mod fleet;
mod interlink;
mod network_policy;
mod node_script;
mod objects;
mod pods;
mod pools;
mod problems;
mod rbac;
mod render;
mod secrets;
mod services;
mod tailnet;
mod tailscale;

// ---------------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------------

fn read(relative: &str) -> String {
    let path = Path::new(ROOT).join(relative);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()))
}

#[test]
fn every_kustomization_renders_and_its_objects_hold() {
    let mut problems = Problems::default();
    for (source, documents) in rendered() {
        ensure!(problems, source, !documents.is_empty(), "renders nothing");
        check_rendering(source, documents, &mut problems);
    }
    problems.assert_none("deploy/");
}

#[test]
fn base_has_every_object_tongs_needs() {
    let (_, documents) = rendered()
        .iter()
        .find(|(source, _)| source == "deploy/base")
        .expect("deploy/base renders");
    let has = |kind: &str, name: Option<&str>| {
        documents
            .iter()
            .any(|doc| doc["kind"] == kind && name.is_none_or(|name| name_of(doc) == name))
    };
    for kind in [
        "Deployment",
        "Service",
        "ServiceAccount",
        "PodDisruptionBudget",
    ] {
        assert!(has(kind, Some(TONGS)), "deploy/base lacks {kind}/{TONGS}");
    }
    for kind in ["Role", "RoleBinding", "ConfigMap"] {
        assert!(has(kind, None), "deploy/base lacks a {kind}");
    }
}

#[test]
fn every_component_is_used_by_an_overlay() {
    let all = kustomizations();
    let listed_by = |k: &Kustomization| k.components.clone();
    let mut used: BTreeSet<PathBuf> = all
        .iter()
        .filter(|k| k.kind != "Component")
        .flat_map(listed_by)
        .collect();
    // Components may list components too.
    loop {
        let more: Vec<PathBuf> = all
            .iter()
            .filter(|k| used.contains(&k.dir))
            .flat_map(listed_by)
            .filter(|dir| !used.contains(dir))
            .collect();
        if more.is_empty() {
            break;
        }
        used.extend(more);
    }
    let unused: Vec<String> = all
        .iter()
        .filter(|k| k.kind == "Component" && !used.contains(&k.dir))
        .map(Kustomization::name)
        .collect();
    assert!(
        unused.is_empty(),
        "components no overlay uses, so nothing renders them: {unused:?}"
    );
}

#[test]
fn overlays_render_the_servicemonitor_the_scaled_object_and_the_tailscale_sidecar() {
    let documents = || {
        rendered()
            .iter()
            .flat_map(|(source, documents)| documents.iter().map(move |doc| (source, doc)))
    };
    for kind in ["ServiceMonitor", "ScaledObject"] {
        assert!(
            documents().any(|(_, doc)| doc["kind"] == kind),
            "no overlay renders a {kind}"
        );
    }
    let (source, deployment) = documents()
        .find(|(_, doc)| {
            let init = &doc["spec"]["template"]["spec"]["initContainers"];
            doc["kind"] == "Deployment"
                && init
                    .as_array()
                    .is_some_and(|list| list.iter().any(|c| c["name"] == "tailscale"))
        })
        .expect("an overlay adds the tailscale sidecar to tongs");
    let deployment: Deployment = serde_json::from_value(deployment.clone()).expect("a Deployment");
    let spec = pod_spec(&deployment).expect("a pod spec");
    let sidecar = spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "tailscale")
        .expect("the sidecar");
    // A native sidecar outlives tongs' drain, so streams to Tailscale nodes keep their path.
    assert_eq!(
        sidecar.restart_policy.as_deref(),
        Some("Always"),
        "{source}: restartPolicy"
    );
    let env: BTreeMap<&str, Option<&str>> = sidecar
        .env
        .iter()
        .flatten()
        .map(|var| (var.name.as_str(), var.value.as_deref()))
        .collect();
    assert_eq!(env.get("TS_USERSPACE"), Some(&Some("true")), "{source}");
    assert_eq!(
        env.get("TS_SOCKS5_SERVER"),
        Some(&Some("localhost:1055")),
        "{source}"
    );
    assert_eq!(
        env.get("TS_OUTBOUND_HTTP_PROXY_LISTEN"),
        Some(&Some("localhost:1055")),
        "{source}"
    );
    let from_secret = sidecar.env.iter().flatten().any(|var| {
        var.name == "TS_AUTHKEY"
            && var
                .value_from
                .as_ref()
                .is_some_and(|from| from.secret_key_ref.is_some())
    });
    assert!(from_secret, "{source}: TS_AUTHKEY must come from a Secret");
    let state_dir = env.get("TS_STATE_DIR").copied().flatten();
    let state_on_volume = sidecar
        .volume_mounts
        .iter()
        .flatten()
        .any(|m| Some(m.mount_path.as_str()) == state_dir);
    let state_in_secret = env
        .get("TS_KUBE_SECRET")
        .copied()
        .flatten()
        .is_some_and(|name| !name.is_empty());
    assert!(
        state_on_volume || state_in_secret,
        "{source}: tailscaled's state needs TS_STATE_DIR on a volume, or TS_KUBE_SECRET"
    );
}

#[test]
fn base_config_is_valid_for_tongs() {
    let config = Config::parse_with(&read("deploy/base/tongs.yaml"), "deploy", config_problems)
        .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(config.validate(), Vec::new());
    assert_eq!(
        (config.listen.port(), config.admin.listen.port()),
        (8080, 9090)
    );
    assert!(
        config.discovery.static_endpoints.is_empty(),
        "deploy/base/tongs.yaml lists no placeholder endpoints: the fleet comes from pods"
    );
    let kubernetes = &config.discovery.kubernetes;
    assert!(kubernetes.enabled, "deploy/base/tongs.yaml discovers pods");
    assert_eq!(kubernetes.namespace, "", "in tongs' own namespace");
    let (key, value) = FLEET_LABEL;
    assert_eq!(kubernetes.label_selector, format!("{key}={value}"));
}

#[test]
fn label_selectors_are_read_as_the_api_server_reads_them() {
    let labels: BTreeMap<String, String> = [("app", "llm"), ("tier", "gpu")]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into();
    let holds = |text: &str| {
        let selector = parse_label_selector(text).unwrap_or_else(|err| panic!("{err}"));
        label_selector_selects(&selector, &labels)
    };
    assert!(holds("app=llm"));
    assert!(holds("app==llm, tier"));
    assert!(holds("app in (llm, chat),!spot,tier notin (cpu)"));
    assert!(holds("tier!=cpu"));
    assert!(!holds("app=chat"));
    assert!(!holds("app,spot"));
    assert!(!holds("tier in (cpu)"));
    assert!(!holds("!app"));
    for bad in ["", "app=llm,", "app in llm", "a b"] {
        assert!(parse_label_selector(bad).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn the_cross_checks_catch_broken_renderings() {
    let reported = |problems: &[String], wanted: &str| {
        assert!(
            problems.iter().any(|problem| problem.contains(wanted)),
            "expected a problem containing {wanted:?}, got {problems:#?}"
        );
    };
    let intact = problems_after("deploy/overlays/salad-tailscale", |_| {});
    assert_eq!(intact, Vec::<String>::new());

    // Registration without the Role that grants patch.
    let problems = problems_after("deploy/overlays/salad-tailscale", |documents| {
        documents.retain(|doc| !name_of(doc).contains("pod-annotator"));
    });
    reported(&problems, "grants patch on pods in namespace tongs");
    // patch where nothing writes annotations: the Role from salad-tailscale added to salad-gateway.
    let (_, tailscale) = rendered()
        .iter()
        .find(|(source, _)| source == "deploy/overlays/salad-tailscale")
        .expect("salad-tailscale renders");
    let annotator: Vec<Value> = tailscale
        .iter()
        .filter(|doc| name_of(doc).contains("pod-annotator"))
        .cloned()
        .collect();
    let problems = problems_after("deploy/overlays/salad-gateway", |documents| {
        documents.extend(annotator);
    });
    reported(&problems, "leave out components/pod-annotator");
    // A reader Role that also patches.
    let problems = problems_after("deploy/overlays/interlink", |documents| {
        let reader = documents
            .iter_mut()
            .find(|doc| doc["kind"] == "Role")
            .expect("a Role");
        reader["rules"][0]["verbs"] = serde_json::json!(["get", "list", "watch", "patch"]);
    });
    reported(&problems, "grants nothing else");
    // The fleet's pods without the label discovery selects.
    let problems = problems_after("deploy/overlays/interlink", |documents| {
        let inference = documents
            .iter_mut()
            .find(|doc| doc["kind"] == "Deployment" && name_of(doc) == INFERENCE)
            .expect("the example workload");
        let labels = &mut inference["spec"]["template"]["metadata"]["labels"];
        labels[FLEET_LABEL.0] = Value::String("other".into());
    });
    reported(&problems, "does not select this GPU workload's pods");
    // The Secret volume the API key file is on, gone.
    let problems = problems_after("deploy/overlays/salad-gateway", |documents| {
        let spec = tongs_pod_spec(documents);
        let mounts = spec["containers"][0]["volumeMounts"]
            .as_array_mut()
            .expect("mounts");
        mounts.retain(|mount| mount["mountPath"] != "/etc/tongs-salad");
    });
    reported(
        &problems,
        "salad.api_key_file is /etc/tongs-salad/api-key, but tongs' container",
    );
    // The registration token readable by root alone.
    let problems = problems_after("deploy/overlays/salad-tailscale", |documents| {
        let spec = tongs_pod_spec(documents);
        for volume in spec["volumes"].as_array_mut().expect("volumes") {
            if volume["secret"].is_object() {
                volume["secret"]["defaultMode"] = Value::from(0o400);
            }
        }
    });
    reported(&problems, "keeps tongs (not root) from reading it");
    // The Tailscale sidecar without the proxy setting (tongs.yaml of the base).
    let problems = problems_after("deploy/overlays/salad-tailscale", |documents| {
        let config_map = documents
            .iter_mut()
            .find(|doc| doc["kind"] == "ConfigMap" && name_of(doc).starts_with("tongs-config"))
            .expect("tongs' ConfigMap");
        config_map["data"]["tongs.yaml"] = Value::String(read("deploy/base/tongs.yaml"));
    });
    reported(&problems, "upstream.tailscale.proxy is empty");
    reported(&problems, "no rule of discovery.kubernetes.rules");
    // Replicas counted without the Role that lets tongs read its Service's EndpointSlices.
    let problems = problems_after("deploy/overlays/interlink", |documents| {
        documents.retain(|doc| !name_of(doc).contains("replica-counter"));
    });
    reported(&problems, "grants list on endpointslices");
    // Replicas counted from a Service that is not tongs' own; and the Role kept without the setting.
    for (from, to, wanted) in [
        (
            "replicas:\n  service: tongs",
            "replicas:\n  service: inference",
            "replicas.service \"inference\" is no Service of the rendering",
        ),
        (
            "replicas:\n  service: tongs",
            "replicas:\n  service: \"\"",
            "grants reading EndpointSlices, but tongs.yaml sets no replicas.service",
        ),
    ] {
        let problems = problems_after("deploy/overlays/interlink", |documents| {
            let config_map = documents
                .iter_mut()
                .find(|doc| doc["kind"] == "ConfigMap" && name_of(doc).starts_with("tongs-config"))
                .expect("tongs' ConfigMap");
            let text = config_map["data"]["tongs.yaml"]
                .as_str()
                .unwrap_or_default();
            assert!(text.contains(from), "the interlink overlay sets {from:?}");
            config_map["data"]["tongs.yaml"] = Value::String(text.replace(from, to));
        });
        reported(&problems, wanted);
    }
}
#[test]
fn grafana_dashboard_uses_only_exported_metrics() {
    let mut problems = Problems::default();
    let file = "deploy/grafana/tongs-dashboard.json";
    check_dashboard(file, &read(file), &mut problems);
    problems.assert_none("the Grafana dashboard");
}

#[test]
fn metric_names_are_found_in_promql() {
    let expr = "sum by (le) (rate(tongs_queue_wait_seconds_bucket{x=\"y\"}[5m])) / xtongs_a";
    assert_eq!(metric_names(expr), vec!["tongs_queue_wait_seconds_bucket"]);
    assert!(exported("tongs_request_duration_seconds_count"));
    assert!(!exported("tongs_queue_depth_bucket"));
    assert!(!exported("tongs_no_such_metric"));
}

#[test]
fn misspelt_keys_are_reported() {
    let mut problems = Problems::default();
    let value = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": { "name": "x", "lables": { "a": "b" } },
    });
    parse::<ServiceAccount>(&value, "test", &mut problems);
    assert_eq!(
        problems.0,
        vec!["test: unknown field `metadata.lables` (misspelt?)".to_owned()]
    );
}

#[test]
fn dockerfile_runs_what_the_deployment_expects() {
    let dockerfile = read("Dockerfile");
    let lines: Vec<&str> = dockerfile
        .lines()
        .map(str::trim)
        .filter(|line| !line.starts_with('#'))
        .collect();
    let has = |wanted: &str| lines.iter().any(|line| line.starts_with(wanted));
    assert!(
        has("FROM rust:1-bookworm AS build"),
        "a rust:1-bookworm builder stage"
    );
    assert!(
        dockerfile.contains("cargo build --release --locked"),
        "the build must use Cargo.lock"
    );
    assert!(has("USER 65532"), "the image runs as uid 65532");
    assert!(has(r#"ENTRYPOINT ["/tongs"]"#), "ENTRYPOINT [\"/tongs\"]");
    let cmd = format!("CMD [{}]", ARGS.map(|arg| format!("\"{arg}\"")).join(", "));
    assert!(
        has(&cmd),
        "the default command is {cmd}, as the Deployment runs it"
    );
    let exposed: BTreeSet<&str> = lines
        .iter()
        .filter_map(|line| line.strip_prefix("EXPOSE "))
        .flat_map(str::split_whitespace)
        .collect();
    assert_eq!(
        exposed,
        BTreeSet::from(["8080", "9090"]),
        "EXPOSE 8080 9090"
    );
    let ignore = read(".dockerignore");
    let ignores_target = ignore
        .lines()
        .any(|line| matches!(line.trim(), "target" | "target/" | "/target"));
    assert!(ignores_target, ".dockerignore must exclude target/");
}

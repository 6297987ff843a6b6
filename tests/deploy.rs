//! The Kubernetes manifests in `deploy/`: every kustomization renders with `kubectl kustomize`, every
//! rendered object parses as its Kubernetes type (and loses no field doing so, which catches misspelt
//! keys), and the properties tongs relies on hold — in the base and in every overlay, so a component's
//! patch cannot quietly undo them. The tongs.yaml each rendering mounts is validated by tongs itself,
//! and what it asks of the rest is checked across objects: the RBAC its discovery, registration and
//! write-back need (and no more), that its label selector picks the example GPU workloads and a rule
//! can address them, that the files it reads secrets from are mounted Secret files, and that its
//! Tailscale proxy is the sidecar's. The Grafana dashboard and the Dockerfile are checked against the
//! code they describe.
//!
//! Needs `kubectl` on the PATH (Debian's `kubernetes-client`; `scripts/test.sh` installs it). Without it
//! the tests fail, never skip.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscalerBehavior;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, Probe, SecretVolumeSource, Service, ServiceAccount,
    VolumeMount,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tongs::config::{Config, Rule, parse_yaml};
use tongs::discovery::pods::{SALAD_PORT_ANNOTATION, SALAD_PROVIDER, SALAD_TAINT_KEY};
use tongs::metrics::{CATALOG, DEMAND};
use tongs::upstream::{ProxyKind, parse_proxy};

/// The fake API server's selector parser: one reading of label selectors for the whole test suite.
#[allow(dead_code)]
#[path = "support/kube_api/selectors.rs"]
mod selectors;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// tongs' own Deployment, and the example GPU Deployment the KEDA component scales.
const TONGS: &str = "tongs";
const INFERENCE: &str = "inference";
/// Where the Deployment mounts the configuration, and the command line the image runs by default.
const CONFIG_DIR: &str = "/etc/tongs";
const ARGS: [&str; 3] = ["run", "--config", "/etc/tongs/tongs.yaml"];
/// tongs' selector label for its GPU fleet.
const FLEET_LABEL: (&str, &str) = ("app.kubernetes.io/part-of", "tongs-fleet");
/// The label Grafana's dashboard sidecar loads ConfigMaps by.
const DASHBOARD_LABEL: (&str, &str) = ("grafana_dashboard", "1");
/// Pod annotations the SaladCloud Virtual Kubelet reads, besides `salad.com/logging-*`.
const SALAD_ANNOTATIONS: &str = "salad.com/gpu-classes salad.com/country-codes \
    salad.com/container-group-priority salad.com/networking-protocol salad.com/networking-port \
    salad.com/networking-auth";

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

// ---------------------------------------------------------------------------------------------------
// Finding and rendering the kustomizations
// ---------------------------------------------------------------------------------------------------

/// The file names kustomize accepts for a kustomization.
const KUSTOMIZATION_FILES: [&str; 3] = ["kustomization.yaml", "kustomization.yml", "Kustomization"];

/// A directory under deploy/ holding a kustomization.
struct Kustomization {
    dir: PathBuf,
    /// `Kustomization` or `Component`.
    kind: String,
    /// The directories it lists under `components:`.
    components: Vec<PathBuf>,
}

impl Kustomization {
    fn name(&self) -> String {
        let root = canonical(Path::new(ROOT));
        let relative = self.dir.strip_prefix(&root).unwrap_or(&self.dir);
        relative.display().to_string()
    }
}

/// Every kustomization under deploy/, found by walking it: a new one is covered without a change here.
fn kustomizations() -> &'static [Kustomization] {
    static FOUND: OnceLock<Vec<Kustomization>> = OnceLock::new();
    FOUND.get_or_init(|| {
        let mut dirs = Vec::new();
        walk(&Path::new(ROOT).join("deploy"), &mut dirs);
        dirs.sort();
        assert!(
            !dirs.is_empty(),
            "no kustomization.yaml under {ROOT}/deploy"
        );
        dirs.iter().map(|dir| read_kustomization(dir)).collect()
    })
}

fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|err| panic!("cannot list {}: {err}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|err| panic!("{}: {err}", dir.display()))
            .path();
        if path.is_dir() {
            walk(&path, found);
        } else if path
            .file_name()
            .is_some_and(|name| KUSTOMIZATION_FILES.iter().any(|file| name == *file))
        {
            found.push(dir.to_owned());
        }
    }
}

fn read_kustomization(dir: &Path) -> Kustomization {
    let path = KUSTOMIZATION_FILES
        .iter()
        .map(|file| dir.join(file))
        .find(|path| path.is_file())
        .unwrap_or_else(|| dir.join(KUSTOMIZATION_FILES[0]));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()));
    let value: Value = serde_saphyr::from_str(&text)
        .unwrap_or_else(|err| panic!("{} is not YAML: {err}", path.display()));
    let components = value["components"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    Kustomization {
        dir: canonical(dir),
        kind: value["kind"].as_str().unwrap_or("Kustomization").to_owned(),
        components: components
            .iter()
            .filter_map(Value::as_str)
            .map(|relative| canonical(&dir.join(relative)))
            .collect(),
    }
}

fn canonical(path: &Path) -> PathBuf {
    path.canonicalize()
        .unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// `kubectl kustomize DIR`, split into its objects.
fn render(dir: &Path) -> Vec<Value> {
    let output = match Command::new("kubectl").arg("kustomize").arg(dir).output() {
        Ok(output) => output,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            panic!("kubectl is missing: install Debian's kubernetes-client (scripts/test.sh does)")
        }
        Err(err) => panic!("cannot run kubectl: {err}"),
    };
    assert!(
        output.status.success(),
        "`kubectl kustomize {}` failed ({}):\n{}",
        dir.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let documents: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap_or_else(|err| {
        panic!(
            "`kubectl kustomize {}` printed no valid YAML: {err}",
            dir.display()
        )
    });
    documents.into_iter().filter(|doc| !doc.is_null()).collect()
}

/// Every kustomization built on its own (a Component is built as part of the overlays using it), with
/// its objects.
fn rendered() -> &'static [(String, Vec<Value>)] {
    static RENDERED: OnceLock<Vec<(String, Vec<Value>)>> = OnceLock::new();
    RENDERED.get_or_init(|| {
        let built = kustomizations().iter().filter(|k| k.kind != "Component");
        built.map(|k| (k.name(), render(&k.dir))).collect()
    })
}

// ---------------------------------------------------------------------------------------------------
// Problems and typed parsing
// ---------------------------------------------------------------------------------------------------

/// Every problem found, each naming the kustomization and the object, reported together at the end.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn fail(&mut self, at: &str, message: impl Into<String>) {
        self.0.push(format!("{at}: {}", message.into()));
    }

    fn assert_none(self, what: &str) {
        let count = self.0.len();
        assert!(
            count == 0,
            "{what}: {count} problem(s):\n  - {}",
            self.0.join("\n  - ")
        );
    }
}

/// Records a problem at `$at` unless `$ok` holds.
macro_rules! ensure {
    ($problems:expr, $at:expr, $ok:expr, $($message:tt)+) => {
        if !$ok {
            $problems.fail($at, format!($($message)+));
        }
    };
}

/// Parses `value` as `T`. The Kubernetes types skip fields they do not know, so the object is also
/// written back, and every field that did not survive is reported: a misspelt key, most likely.
fn typed<T: DeserializeOwned + Serialize>(
    value: &Value,
    at: &str,
    problems: &mut Problems,
) -> Option<T> {
    let object: T = serde_json::from_value(value.clone())
        .map_err(|err| problems.fail(at, format!("does not parse as its Kubernetes type: {err}")))
        .ok()?;
    let written = serde_json::to_value(&object).unwrap_or(Value::Null);
    let mut dropped = Vec::new();
    dropped_fields(value, &written, "", &mut dropped);
    for field in dropped {
        problems.fail(at, format!("unknown field `{field}` (misspelt?)"));
    }
    Some(object)
}

/// Paths of the keys of `original` that `written` lacks (null values aside).
fn dropped_fields(original: &Value, written: &Value, path: &str, out: &mut Vec<String>) {
    match (original, written) {
        (Value::Object(original), Value::Object(written)) => {
            for (key, child) in original {
                let child_path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match written.get(key) {
                    Some(written) => dropped_fields(child, written, &child_path, out),
                    None if child.is_null() => {}
                    None => out.push(child_path),
                }
            }
        }
        (Value::Array(original), Value::Array(written)) => {
            for (index, (child, written)) in original.iter().zip(written).enumerate() {
                dropped_fields(child, written, &format!("{path}[{index}]"), out);
            }
        }
        _ => {}
    }
}

/// Parses a built-in kind, checking its apiVersion against the Rust type's.
fn parse<T>(value: &Value, at: &str, problems: &mut Problems) -> Option<T>
where
    T: k8s_openapi::Resource + DeserializeOwned + Serialize,
{
    let version = &value["apiVersion"];
    ensure!(
        problems,
        at,
        *version == T::API_VERSION,
        "apiVersion {version}, expected {}",
        T::API_VERSION
    );
    typed(value, at, problems)
}

/// Reports every key of a custom resource's object that its schema lacks (`allowed`, space-separated).
fn known_keys(at: &str, what: &str, value: &Value, allowed: &str, problems: &mut Problems) {
    for key in value.as_object().into_iter().flat_map(|map| map.keys()) {
        let known = allowed.split_whitespace().any(|field| field == key);
        ensure!(
            problems,
            at,
            known,
            "{what} has unknown field `{key}` (misspelt? else list it in tests/deploy.rs)"
        );
    }
}

// ---------------------------------------------------------------------------------------------------
// One rendering
// ---------------------------------------------------------------------------------------------------

/// The objects of one rendering, by name, for the checks that span objects.
#[derive(Default)]
struct Objects {
    deployments: BTreeMap<String, Deployment>,
    services: BTreeMap<String, Service>,
    config_maps: BTreeMap<String, ConfigMap>,
    service_accounts: BTreeSet<String>,
    roles: BTreeMap<String, Role>,
    role_bindings: BTreeMap<String, RoleBinding>,
    disruption_budgets: BTreeMap<String, PodDisruptionBudget>,
    service_monitors: BTreeMap<String, Value>,
    scaled_objects: BTreeMap<String, Value>,
}

fn name_of(value: &Value) -> String {
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
            other => problems.fail(
                at,
                format!("tests/deploy.rs has no checks for kind {other:?}: add them"),
            ),
        }
    }
    objects
}

/// Checks one rendering: each object on its own, then the references between them.
fn check_rendering(source: &str, documents: &[Value], problems: &mut Problems) {
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
            INFERENCE => check_inference(&at("Deployment", name), deployment, problems),
            _ => {}
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
    // What tongs.yaml asks of the rest of the rendering.
    if let (Some(tongs), Some(config)) = (&tongs, &config) {
        let at = &format!("{source}: tongs.yaml");
        check_keeps_base_keys(at, config, problems);
        check_access(at, tongs, config, objects, problems);
        check_discovered_workloads(at, tongs, config, objects, problems);
        check_secret_files(at, tongs, config, &secrets, problems);
        check_tailscale_proxy(at, tongs, config, problems);
    }
}

// ---------------------------------------------------------------------------------------------------
// Helpers over pods
// ---------------------------------------------------------------------------------------------------

fn pod_spec(deployment: &Deployment) -> Option<&PodSpec> {
    deployment.spec.as_ref()?.template.spec.as_ref()
}

fn pod_meta<T>(
    deployment: &Deployment,
    read: impl Fn(&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<T>,
) -> Option<T> {
    read(deployment.spec.as_ref()?.template.metadata.as_ref()?)
}

fn pod_labels(deployment: &Deployment) -> BTreeMap<String, String> {
    pod_meta(deployment, |meta| meta.labels.clone()).unwrap_or_default()
}

/// Whether `matchLabels` selects pods labelled `labels` (an empty selector counts as selecting nothing:
/// every selector in deploy/ names its labels).
fn selects(
    match_labels: Option<&BTreeMap<String, String>>,
    labels: &BTreeMap<String, String>,
) -> bool {
    match_labels.is_some_and(|wanted| {
        !wanted.is_empty()
            && wanted
                .iter()
                .all(|(key, value)| labels.get(key) == Some(value))
    })
}

fn selector_selects(selector: Option<&LabelSelector>, labels: &BTreeMap<String, String>) -> bool {
    selector.is_some_and(|selector| {
        selector
            .match_expressions
            .as_ref()
            .is_none_or(Vec::is_empty)
            && selects(selector.match_labels.as_ref(), labels)
    })
}

/// The Deployment of the rendering whose pods `matches` picks.
fn selected(
    objects: &Objects,
    matches: impl Fn(&BTreeMap<String, String>) -> bool,
) -> Option<&Deployment> {
    objects
        .deployments
        .values()
        .find(|deployment| matches(&pod_labels(deployment)))
}

fn named_port(container: &Container, name: &str) -> Option<i32> {
    let mut ports = container.ports.iter().flatten();
    ports
        .find(|port| port.name.as_deref() == Some(name))
        .map(|port| port.container_port)
}

/// The number a port reference (number or name) means on `container`.
fn resolve_port(container: &Container, port: &IntOrString) -> Option<i32> {
    match port {
        IntOrString::Int(number) => Some(*number),
        IntOrString::String(name) => named_port(container, name),
    }
}

// ---------------------------------------------------------------------------------------------------
// tongs' Deployment
// ---------------------------------------------------------------------------------------------------

/// Checks tongs' Deployment, and returns the configuration it mounts (when that parses at all).
fn check_tongs(
    at: &str,
    deployment: &Deployment,
    objects: &Objects,
    secrets: &[SecretMount],
    problems: &mut Problems,
) -> Option<Config> {
    let (Some(deployment_spec), Some(spec)) = (deployment.spec.as_ref(), pod_spec(deployment))
    else {
        problems.fail(at, "has no pod spec");
        return None;
    };
    let replicas = deployment_spec.replicas.unwrap_or(1);
    ensure!(
        problems,
        at,
        replicas >= 2,
        "replicas is {replicas}; tongs needs at least 2 to survive a node"
    );
    let labels = pod_labels(deployment);
    let matched = selector_selects(Some(&deployment_spec.selector), &labels);
    ensure!(
        problems,
        at,
        matched,
        "the selector does not match the pod template's labels"
    );

    let pod_security = spec.security_context.as_ref();
    let non_root = pod_security.and_then(|s| s.run_as_non_root) == Some(true);
    ensure!(
        problems,
        at,
        non_root,
        "the pod's securityContext must set runAsNonRoot: true"
    );
    let seccomp = pod_security
        .and_then(|s| s.seccomp_profile.as_ref())
        .map(|p| p.type_.as_str());
    ensure!(
        problems,
        at,
        seccomp == Some("RuntimeDefault"),
        "seccompProfile is {seccomp:?}, expected RuntimeDefault"
    );
    for container in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        check_hardening(
            &format!("{at} container {}", container.name),
            container,
            problems,
        );
    }

    let anti = spec
        .affinity
        .as_ref()
        .and_then(|affinity| affinity.pod_anti_affinity.as_ref());
    let spreads = anti.is_some_and(|anti| {
        let preferred = anti
            .preferred_during_scheduling_ignored_during_execution
            .iter()
            .flatten();
        let required = anti
            .required_during_scheduling_ignored_during_execution
            .iter()
            .flatten();
        let mut terms = preferred
            .map(|weighted| &weighted.pod_affinity_term)
            .chain(required);
        terms.any(|term| {
            !term.topology_key.is_empty() && selector_selects(term.label_selector.as_ref(), &labels)
        })
    });
    ensure!(
        problems,
        at,
        spreads,
        "needs a podAntiAffinity term that selects its own pods"
    );

    let account = spec.service_account_name.as_deref().unwrap_or("default");
    let known = objects.service_accounts.contains(account);
    ensure!(
        problems,
        at,
        known,
        "serviceAccountName {account:?} is no ServiceAccount of the rendering"
    );

    let Some(container) = spec.containers.iter().find(|c| c.name == TONGS) else {
        problems.fail(at, "has no container named tongs");
        return None;
    };
    let args = container.args.clone().unwrap_or_default();
    ensure!(
        problems,
        at,
        args == ARGS,
        "args are {args:?}, expected {ARGS:?}"
    );
    let resources = container.resources.as_ref();
    let requests = resources.and_then(|r| r.requests.as_ref());
    let limits = resources.and_then(|r| r.limits.as_ref());
    let sized = requests.is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory"))
        && limits.is_some_and(|l| l.contains_key("memory"));
    ensure!(
        problems,
        at,
        sized,
        "the tongs container needs cpu and memory requests and a memory limit"
    );

    let config = mounted_config(at, spec, container, objects, secrets, problems)?;
    // Ports and probes agree with the configuration the pod runs.
    let (listen, admin) = (config.listen.port(), config.admin.listen.port());
    let http_port = named_port(container, "http");
    ensure!(
        problems,
        at,
        http_port == Some(listen.into()),
        "container port `http` is {http_port:?}, listen says {listen}"
    );
    let admin_port = named_port(container, "admin");
    ensure!(
        problems,
        at,
        admin_port == Some(admin.into()),
        "container port `admin` is {admin_port:?}, admin.listen says {admin}"
    );
    check_probe(
        at,
        "livenessProbe",
        container.liveness_probe.as_ref(),
        container,
        "/healthz",
        admin,
        problems,
    );
    check_probe(
        at,
        "readinessProbe",
        container.readiness_probe.as_ref(),
        container,
        "/readyz",
        admin,
        problems,
    );

    // The kubelet must never kill tongs mid-drain: preStop pause + shutdown.grace < the grace period.
    let termination = spec.termination_grace_period_seconds.unwrap_or(30);
    let pre_stop = container
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref());
    let pause = pre_stop
        .and_then(|handler| handler.sleep.as_ref())
        .map_or(0, |sleep| sleep.seconds);
    let grace = i64::try_from(config.shutdown.grace.get().as_secs()).unwrap_or(i64::MAX);
    ensure!(
        problems,
        at,
        termination > 25 && termination > pause + grace,
        "terminationGracePeriodSeconds {termination} must exceed the preStop sleep ({pause} s) plus shutdown.grace ({grace} s)"
    );
    Some(config)
}

/// Hardening every container of tongs' pod needs, sidecars included.
fn check_hardening(at: &str, container: &Container, problems: &mut Problems) {
    let Some(security) = container.security_context.as_ref() else {
        return problems.fail(at, "has no securityContext");
    };
    let no_escalation = security.allow_privilege_escalation == Some(false);
    ensure!(
        problems,
        at,
        no_escalation,
        "allowPrivilegeEscalation must be false"
    );
    let read_only = security.read_only_root_filesystem == Some(true);
    ensure!(
        problems,
        at,
        read_only,
        "readOnlyRootFilesystem must be true"
    );
    ensure!(
        problems,
        at,
        security.privileged != Some(true),
        "must not be privileged"
    );
    ensure!(
        problems,
        at,
        security.run_as_user != Some(0),
        "must not run as root"
    );
    let capabilities = security.capabilities.as_ref();
    let drops_all = capabilities
        .and_then(|c| c.drop.as_ref())
        .is_some_and(|d| d.iter().any(|c| c == "ALL"));
    ensure!(problems, at, drops_all, "must drop ALL capabilities");
    let adds = capabilities
        .and_then(|c| c.add.as_ref())
        .is_some_and(|add| !add.is_empty());
    ensure!(problems, at, !adds, "must add no capabilities");
}

fn check_probe(
    at: &str,
    what: &str,
    probe: Option<&Probe>,
    container: &Container,
    path: &str,
    admin: u16,
    problems: &mut Problems,
) {
    let Some(http) = probe.and_then(|probe| probe.http_get.as_ref()) else {
        return problems.fail(at, format!("{what} must be an httpGet probe on {path}"));
    };
    let probed = http.path.as_deref();
    ensure!(
        problems,
        at,
        probed == Some(path),
        "{what} path is {probed:?}, expected {path}"
    );
    let port = resolve_port(container, &http.port);
    ensure!(
        problems,
        at,
        port == Some(admin.into()),
        "{what} port {:?} is not the admin port {admin}",
        http.port
    );
}

/// The configuration the Deployment mounts at /etc/tongs, parsed and validated by tongs itself.
fn mounted_config(
    at: &str,
    spec: &PodSpec,
    container: &Container,
    objects: &Objects,
    secrets: &[SecretMount],
    problems: &mut Problems,
) -> Option<Config> {
    let Some(mount) = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|mount| mount.mount_path == CONFIG_DIR)
    else {
        problems.fail(at, format!("mounts nothing at {CONFIG_DIR}"));
        return None;
    };
    ensure!(
        problems,
        at,
        mount.read_only == Some(true),
        "the mount at {CONFIG_DIR} must be readOnly"
    );
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|volume| volume.name == mount.name);
    let Some(name) = volume
        .and_then(|volume| volume.config_map.as_ref())
        .map(|source| &source.name)
    else {
        problems.fail(
            at,
            format!("volume {} is not a ConfigMap volume", mount.name),
        );
        return None;
    };
    let data = objects
        .config_maps
        .get(name)
        .and_then(|config_map| config_map.data.as_ref());
    let Some(text) = data.and_then(|data| data.get("tongs.yaml")) else {
        problems.fail(
            at,
            format!(
                "mounts ConfigMap {name}, which the rendering lacks or which has no tongs.yaml"
            ),
        );
        return None;
    };
    parse_config(at, text, secrets, problems)
}

/// Parses and validates tongs.yaml as `Config::parse` does (`parse_yaml`, then `validate`), as it
/// would in tongs' pod: validation reads some files (`admin.bearer_token_file`,
/// `discovery.kubernetes.registration.token_file`), and one that the pod gets from a Secret volume
/// (`secrets`) exists only there, so a placeholder file stands in for it. Whether the Secret really is
/// mounted at that path is `check_secret_files`' business.
fn parse_config(
    at: &str,
    text: &str,
    secrets: &[SecretMount],
    problems: &mut Problems,
) -> Option<Config> {
    let config: Config = parse_yaml(text, "deploy")
        .map_err(|err| problems.fail(at, format!("tongs.yaml is not valid for tongs: {err}")))
        .ok()?;
    let mut in_the_pod = config.clone();
    let read_by_validation = [
        &mut in_the_pod.admin.bearer_token_file,
        &mut in_the_pod.discovery.kubernetes.registration.token_file,
    ];
    for file in read_by_validation {
        if file
            .as_deref()
            .is_some_and(|path| secret_file(secrets, path).is_some())
        {
            *file = Some(placeholder_secret());
        }
    }
    let remaining = in_the_pod.validate();
    ensure!(
        problems,
        at,
        remaining.is_empty(),
        "tongs.yaml does not validate: {remaining:?}"
    );
    // Checked further even so: the checks across objects then tell what the rendering lacks.
    Some(config)
}

/// A file holding a token, standing in for a Secret's file while validating.
fn placeholder_secret() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join("deploy-placeholder-secret");
        std::fs::write(&file, "placeholder-token\n")
            .unwrap_or_else(|err| panic!("cannot write {}: {err}", file.display()));
        file
    })
    .clone()
}

// ---------------------------------------------------------------------------------------------------
// The example GPU Deployment
// ---------------------------------------------------------------------------------------------------

fn check_inference(at: &str, deployment: &Deployment, problems: &mut Problems) {
    let labels = pod_labels(deployment);
    let (key, value) = FLEET_LABEL;
    ensure!(
        problems,
        at,
        labels.get(key).is_some_and(|v| v == value),
        "pods must carry {key}: {value}"
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

// ---------------------------------------------------------------------------------------------------
// Service, ConfigMap, RBAC, disruption budget
// ---------------------------------------------------------------------------------------------------

fn check_service(
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

fn check_config_map(
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

/// A Role either reads pods (get, list, watch) or patches them, never both: `patch` lets tongs change any
/// pod of the namespace, so it lives in a narrow Role of its own (components/pod-annotator) that only the
/// renderings needing it include (`check_access`).
fn check_role(at: &str, role: &Role, problems: &mut Problems) {
    let rules = role.rules.as_deref().unwrap_or(&[]);
    ensure!(problems, at, !rules.is_empty(), "has no rules");
    let patches = rules
        .iter()
        .any(|rule| rule.verbs.iter().any(|verb| verb == "patch"));
    for rule in rules {
        let groups = rule.api_groups.as_deref();
        ensure!(
            problems,
            at,
            groups == Some(&[String::new()]),
            "apiGroups {groups:?}: only the core group"
        );
        let resources = rule.resources.as_deref();
        ensure!(
            problems,
            at,
            resources == Some(&["pods".to_owned()]),
            "resources {resources:?}: only pods"
        );
        let verbs = &rule.verbs;
        if patches {
            ensure!(
                problems,
                at,
                *verbs == ["patch"],
                "verbs {verbs:?}: a Role granting patch grants nothing else (reads stay in the reader Role)"
            );
        } else {
            let reads = !verbs.is_empty()
                && verbs
                    .iter()
                    .all(|v| matches!(v.as_str(), "get" | "list" | "watch"));
            ensure!(
                problems,
                at,
                reads,
                "verbs {verbs:?}: only get, list and watch (or patch alone, in a Role of its own)"
            );
        }
        ensure!(
            problems,
            at,
            rule.resource_names.is_none(),
            "resourceNames: not needed for a pod watch"
        );
        ensure!(
            problems,
            at,
            rule.non_resource_urls.is_none(),
            "nonResourceURLs: not allowed"
        );
    }
}

fn check_role_binding(at: &str, binding: &RoleBinding, objects: &Objects, problems: &mut Problems) {
    let role = &binding.role_ref;
    let bound = role.kind == "Role" && objects.roles.contains_key(&role.name);
    ensure!(
        problems,
        at,
        bound,
        "roleRef {} {} is no Role of the rendering (no ClusterRoles)",
        role.kind,
        role.name
    );
    let subjects = binding.subjects.as_deref().unwrap_or(&[]);
    ensure!(problems, at, !subjects.is_empty(), "has no subjects");
    for subject in subjects {
        let known =
            subject.kind == "ServiceAccount" && objects.service_accounts.contains(&subject.name);
        ensure!(
            problems,
            at,
            known,
            "subject {} {} is no ServiceAccount of the rendering",
            subject.kind,
            subject.name
        );
    }
}

fn check_disruption_budget(
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

// ---------------------------------------------------------------------------------------------------
// What tongs.yaml asks of the rest of the rendering: RBAC, the fleet's pods, Secret files, the proxy
// ---------------------------------------------------------------------------------------------------

/// tongs' Deployment, its pod spec and its `tongs` container.
struct TongsPod<'a> {
    deployment: &'a Deployment,
    spec: &'a PodSpec,
    container: &'a Container,
}

impl<'a> TongsPod<'a> {
    fn of(objects: &'a Objects) -> Option<TongsPod<'a>> {
        let deployment = objects.deployments.get(TONGS)?;
        let spec = pod_spec(deployment)?;
        let container = spec.containers.iter().find(|c| c.name == TONGS)?;
        Some(TongsPod {
            deployment,
            spec,
            container,
        })
    }

    /// The namespace tongs runs in; none means wherever the rendering is applied.
    fn namespace(&self) -> Option<&'a str> {
        self.deployment.metadata.namespace.as_deref()
    }

    fn service_account(&self) -> &'a str {
        self.spec
            .service_account_name
            .as_deref()
            .unwrap_or("default")
    }

    /// The namespace `discovery.kubernetes` watches: `Err` for all of them (`*`).
    fn watched_namespace<'c>(&self, config: &'c Config) -> Result<Option<&'c str>, ()>
    where
        'a: 'c,
    {
        match config.discovery.kubernetes.namespace.as_str() {
            "" => Ok(self.namespace()),
            "*" => Err(()),
            namespace => Ok(Some(namespace)),
        }
    }

    /// The Secret volumes the tongs container mounts.
    fn secret_mounts(&self) -> Vec<SecretMount<'a>> {
        let fs_group = self
            .spec
            .security_context
            .as_ref()
            .and_then(|security| security.fs_group);
        let volumes = self.spec.volumes.as_deref().unwrap_or(&[]);
        let mounts = self.container.volume_mounts.iter().flatten();
        mounts
            .filter_map(|mount| {
                let volume = volumes.iter().find(|volume| volume.name == mount.name)?;
                Some(SecretMount {
                    mount,
                    source: volume.secret.as_ref()?,
                    fs_group,
                })
            })
            .collect()
    }
}

/// One Secret volume mounted into tongs' container.
struct SecretMount<'a> {
    mount: &'a VolumeMount,
    source: &'a SecretVolumeSource,
    /// The pod's fsGroup, the group that owns the volume's files.
    fs_group: Option<i64>,
}

/// A file tongs' container has from a Secret.
struct SecretFile<'a> {
    secret: &'a str,
    key: String,
    mode: i32,
    read_only: bool,
    /// Whether tongs can read it. The files belong to root (which tongs never runs as) and to the
    /// fsGroup, so tongs reads by "other", or by group when the pod sets an fsGroup.
    readable: bool,
}

/// The Secret file `path` is in tongs' container, if it is one.
fn secret_file<'a>(mounts: &[SecretMount<'a>], path: &Path) -> Option<SecretFile<'a>> {
    mounts.iter().find_map(|secret| {
        let mount_path = Path::new(&secret.mount.mount_path);
        // The path inside the volume; a subPath mount is that one file.
        let sub_path = secret
            .mount
            .sub_path
            .as_deref()
            .filter(|sub| !sub.is_empty());
        let inside = match sub_path {
            Some(sub) => (path == mount_path).then(|| sub.to_owned())?,
            None => path.strip_prefix(mount_path).ok()?.to_str()?.to_owned(),
        };
        let source = secret.source;
        let (key, mode) = match &source.items {
            Some(items) => {
                let item = items.iter().find(|item| item.path == inside)?;
                (item.key.clone(), item.mode.or(source.default_mode))
            }
            // Without items, each key of the Secret is a file of that name.
            None if !inside.is_empty() && !inside.contains('/') => (inside, source.default_mode),
            None => return None,
        };
        // The API server's default for Secret volumes.
        let mode = mode.unwrap_or(0o644);
        Some(SecretFile {
            secret: source.secret_name.as_deref().unwrap_or(""),
            key,
            mode,
            read_only: secret.mount.read_only == Some(true),
            readable: mode & 0o004 != 0 || (mode & 0o040 != 0 && secret.fs_group.is_some()),
        })
    })
}

/// The settings deploy/base/tongs.yaml makes, as JSON pointers into the effective configuration, and
/// that configuration (defaults filled in).
fn base_settings() -> &'static (Vec<String>, Value) {
    static BASE: OnceLock<(Vec<String>, Value)> = OnceLock::new();
    BASE.get_or_init(|| {
        let text = read("deploy/base/tongs.yaml");
        let written: Value = serde_saphyr::from_str(&text)
            .unwrap_or_else(|err| panic!("deploy/base/tongs.yaml is not YAML: {err}"));
        let config: Config =
            parse_yaml(&text, "deploy/base/tongs.yaml").unwrap_or_else(|err| panic!("{err}"));
        let mut pointers = Vec::new();
        leaf_pointers(&written, String::new(), &mut pointers);
        let effective = serde_json::to_value(&config).expect("Config serializes");
        (pointers, effective)
    })
}

/// JSON pointers to every leaf of `value` (a list counts as one leaf).
fn leaf_pointers(value: &Value, pointer: String, out: &mut Vec<String>) {
    match value.as_object() {
        Some(map) if !map.is_empty() => {
            for (key, child) in map {
                let escaped = key.replace('~', "~0").replace('/', "~1");
                leaf_pointers(child, format!("{pointer}/{escaped}"), out);
            }
        }
        _ => out.push(pointer),
    }
}

/// An overlay's tongs.yaml replaces the base's whole (kustomize cannot merge inside a file), so every
/// setting of the base must reappear in it unchanged: a change to the base that the copies miss fails
/// here instead of drifting apart.
fn check_keeps_base_keys(at: &str, config: &Config, problems: &mut Problems) {
    let (pointers, base) = base_settings();
    let effective = serde_json::to_value(config).unwrap_or(Value::Null);
    for pointer in pointers {
        let (wanted, found) = (base.pointer(pointer), effective.pointer(pointer));
        let key = pointer.trim_start_matches('/').replace('/', ".");
        ensure!(
            problems,
            at,
            wanted == found,
            "{key} is {}, deploy/base/tongs.yaml has {}: keep every overlay's copy of tongs.yaml in step \
             with the base",
            found.map_or("unset".to_owned(), Value::to_string),
            wanted.map_or("unset".to_owned(), Value::to_string)
        );
    }
}

/// The Roles of `namespace` that grant `verb` on pods and that a RoleBinding there binds to tongs'
/// ServiceAccount.
fn granted<'a>(
    objects: &'a Objects,
    tongs: &TongsPod,
    namespace: Option<&str>,
    verb: &str,
) -> Vec<&'a str> {
    let account = tongs.service_account();
    let bound = |role: &str| {
        objects.role_bindings.values().any(|binding| {
            binding.metadata.namespace.as_deref() == namespace
                && binding.role_ref.kind == "Role"
                && binding.role_ref.name == role
                && binding.subjects.iter().flatten().any(|subject| {
                    subject.kind == "ServiceAccount"
                        && subject.name == account
                        && subject.namespace.as_deref().or(namespace) == tongs.namespace()
                })
        })
    };
    objects
        .roles
        .iter()
        .filter(|(name, role)| {
            role.metadata.namespace.as_deref() == namespace
                && grants_on_pods(role, verb)
                && bound(name)
        })
        .map(|(name, _)| name.as_str())
        .collect()
}

fn grants_on_pods(role: &Role, verb: &str) -> bool {
    role.rules.iter().flatten().any(|rule| {
        rule.api_groups
            .iter()
            .flatten()
            .any(|group| group.is_empty())
            && rule.resources.iter().flatten().any(|r| r == "pods")
            && rule.verbs.iter().any(|v| v == verb)
    })
}

/// tongs' ServiceAccount may do to pods exactly what tongs.yaml needs: get, list and watch where
/// discovery watches, and `patch` there only when node registration or write-back writes annotations.
fn check_access(
    at: &str,
    tongs: &TongsPod,
    config: &Config,
    objects: &Objects,
    problems: &mut Problems,
) {
    let kubernetes = &config.discovery.kubernetes;
    let account = tongs.service_account();
    let Ok(watched) = tongs.watched_namespace(config) else {
        return problems.fail(
            at,
            "discovery.kubernetes.namespace \"*\" needs a ClusterRole; deploy/ grants Roles only",
        );
    };
    let shown = watched.unwrap_or("(the one applied to)");
    if kubernetes.enabled {
        for verb in ["get", "list", "watch"] {
            let roles = granted(objects, tongs, watched, verb);
            ensure!(
                problems,
                at,
                !roles.is_empty(),
                "discovery.kubernetes is enabled, but no Role bound to ServiceAccount {account} \
                 grants {verb} on pods in namespace {shown}"
            );
        }
    }
    let mut writers = Vec::new();
    if kubernetes.registration.token_file.is_some() {
        writers.push("discovery.kubernetes.registration.token_file");
    }
    if kubernetes.write_back {
        writers.push("discovery.kubernetes.write_back");
    }
    if writers.is_empty() {
        let patchers: Vec<&String> = objects
            .roles
            .iter()
            .filter(|(_, role)| grants_on_pods(role, "patch"))
            .map(|(name, _)| name)
            .collect();
        ensure!(
            problems,
            at,
            patchers.is_empty(),
            "Role {patchers:?} grants patch on pods, but tongs.yaml sets neither \
             discovery.kubernetes.registration.token_file nor write_back: leave out \
             components/pod-annotator"
        );
    } else {
        let patchers = granted(objects, tongs, watched, "patch");
        ensure!(
            problems,
            at,
            !patchers.is_empty(),
            "{writers:?} write pod annotations, but no Role bound to ServiceAccount {account} grants \
             patch on pods in namespace {shown}: add components/pod-annotator"
        );
    }
}

/// A pod of the SaladCloud Virtual Kubelet, as tongs tells one (src/discovery/pods.rs): it carries the
/// gateway port annotation or tolerates the virtual node's taint.
fn is_salad(deployment: &Deployment) -> bool {
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
/// the label selector picks its pods and not tongs' own, in the watched namespace, and a rule can give
/// each pod an address tongs can reach.
fn check_discovered_workloads(
    at: &str,
    tongs: &TongsPod,
    config: &Config,
    objects: &Objects,
    problems: &mut Problems,
) {
    let kubernetes = &config.discovery.kubernetes;
    if !kubernetes.enabled {
        return;
    }
    let text = &kubernetes.label_selector;
    let selector = match parse_label_selector(text) {
        Ok(selector) => selector,
        Err(message) => {
            return problems.fail(
                at,
                format!("discovery.kubernetes.label_selector: {message}"),
            );
        }
    };
    let selects =
        |deployment: &Deployment| label_selector_selects(&selector, &pod_labels(deployment));
    ensure!(
        problems,
        at,
        !selects(tongs.deployment),
        "discovery.kubernetes.label_selector {text:?} selects tongs' own pods: tongs would send \
         requests to itself"
    );
    let watched = tongs.watched_namespace(config);
    let shown = match watched {
        Ok(namespace) => namespace.unwrap_or("(tongs' own)").to_owned(),
        Err(()) => "every namespace".to_owned(),
    };
    let workloads = objects
        .deployments
        .iter()
        .filter(|(name, _)| *name != TONGS);
    for (name, deployment) in workloads {
        let at = &format!("{at} (Deployment/{name})");
        ensure!(
            problems,
            at,
            selects(deployment),
            "discovery.kubernetes.label_selector {text:?} does not select this GPU workload's pods \
             (labels {:?})",
            pod_labels(deployment)
        );
        let namespace = deployment.metadata.namespace.as_deref();
        ensure!(
            problems,
            at,
            watched.is_err() || watched == Ok(namespace),
            "runs in namespace {namespace:?}, but discovery.kubernetes watches {shown}"
        );
        check_address_rule(at, deployment, config, problems);
    }
}

/// Some rule of `discovery.kubernetes.rules` gives the workload's pods an address tongs can reach, and
/// none gives a SaladCloud pod one it cannot; and a gateway that requires the SaladCloud key gets it.
fn check_address_rule(at: &str, deployment: &Deployment, config: &Config, problems: &mut Problems) {
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
        "no rule of discovery.kubernetes.rules {rules:?} gives these pods an address tongs reaches: \
         a SaladCloud pod needs salad-api with salad.api set, or tailscale with registration and \
         upstream.tailscale.proxy; another pod pod-ip and a containerPort named {:?}",
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
         cannot reach whenever no other rule has an address for it; leave pod-ip out of rules"
    );
    let salad_config = &config.salad;
    let sends_key = (salad_config.api_key_file.is_some() || salad_config.api_key_env.is_some())
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
            "salad.com/networking-auth is \"true\", but tongs sends no Salad-Api-Key to *.salad.cloud \
             (salad.api_key_file or api_key_env, and salad.gateways): its heartbeats would fail"
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

/// Every file tongs.yaml reads a secret from is a file of a Secret volume, mounted readOnly where it
/// says, and readable by tongs; a key from the environment comes from a Secret too.
fn check_secret_files(
    at: &str,
    tongs: &TongsPod,
    config: &Config,
    secrets: &[SecretMount],
    problems: &mut Problems,
) {
    let files = [
        ("salad.api_key_file", &config.salad.api_key_file),
        (
            "discovery.kubernetes.registration.token_file",
            &config.discovery.kubernetes.registration.token_file,
        ),
        ("admin.bearer_token_file", &config.admin.bearer_token_file),
    ];
    for (field, path) in files {
        let Some(path) = path else {
            continue;
        };
        let Some(file) = secret_file(secrets, path) else {
            problems.fail(
                at,
                format!(
                    "{field} is {}, but tongs' container mounts no Secret file there",
                    path.display()
                ),
            );
            continue;
        };
        let (secret, key) = (file.secret, &file.key);
        ensure!(
            problems,
            at,
            !secret.is_empty(),
            "{field}: the Secret volume names no secretName"
        );
        ensure!(
            problems,
            at,
            file.read_only,
            "{field}: mount Secret {secret} readOnly"
        );
        ensure!(
            problems,
            at,
            file.readable,
            "{field}: mode {:04o} of Secret {secret} key {key} keeps tongs (not root) from reading it: \
             allow others to read, or the group with the pod's fsGroup",
            file.mode
        );
    }
    if let Some(name) = &config.salad.api_key_env {
        let from_secret = tongs.container.env.iter().flatten().any(|var| {
            var.name == *name
                && var
                    .value_from
                    .as_ref()
                    .is_some_and(|from| from.secret_key_ref.is_some())
        });
        ensure!(
            problems,
            at,
            from_secret,
            "salad.api_key_env is {name}, which tongs' container does not take from a Secret \
             (env valueFrom.secretKeyRef)"
        );
    }
}

/// tailscaled's proxies in tongs' pod, from its sidecar's environment: kind and listen address.
fn tailscale_listeners(spec: &PodSpec) -> Vec<(ProxyKind, String)> {
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    let variables = containers.flat_map(|container| container.env.iter().flatten());
    variables
        .filter_map(|var| {
            let kind = match var.name.as_str() {
                "TS_SOCKS5_SERVER" => ProxyKind::Socks5,
                "TS_OUTBOUND_HTTP_PROXY_LISTEN" => ProxyKind::Connect,
                _ => return None,
            };
            let listen = var.value.as_deref().filter(|value| !value.is_empty())?;
            Some((kind, listen.to_owned()))
        })
        .collect()
}

fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A Tailscale sidecar and `upstream.tailscale.proxy` go together: with the sidecar tongs must use
/// it (a pod without a TUN device cannot dial Tailscale addresses), and a proxy on the pod's loopback
/// must be one the sidecar serves, of that kind, on that port.
fn check_tailscale_proxy(at: &str, tongs: &TongsPod, config: &Config, problems: &mut Problems) {
    let listeners = tailscale_listeners(tongs.spec);
    let proxy = &config.upstream.tailscale.proxy;
    if proxy.is_empty() {
        ensure!(
            problems,
            at,
            listeners.is_empty(),
            "tongs' pod runs tailscaled's proxy ({listeners:?}), but upstream.tailscale.proxy is empty: \
             tongs would dial Tailscale addresses directly, which its pod cannot"
        );
        return;
    }
    // A proxy that does not parse is reported by validation.
    let Ok((kind, dial)) = parse_proxy(proxy) else {
        return;
    };
    let Some(authority) = dial.authority() else {
        return;
    };
    if !is_loopback(authority.host()) {
        return;
    }
    let port = authority.port_u16();
    let served = listeners.iter().any(|(listener, listen)| {
        *listener == kind
            && listen.rsplit_once(':').is_some_and(|(host, listen_port)| {
                (host.is_empty() || is_loopback(host)) && listen_port.parse().ok() == port
            })
    });
    ensure!(
        problems,
        at,
        served,
        "upstream.tailscale.proxy {proxy} is on tongs' own pod, but no container there serves that \
         kind of proxy on that port (tailscaled's sidecar: {listeners:?})"
    );
}

/// Parses a label selector string (`kubectl get -l`, the watch's `labelSelector`) the way the fake
/// API server does, which reads it as the real one: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`,
/// `k notin (a,b)`, joined by commas (all must hold). Empty is refused here: every selector in
/// deploy/ must name its labels.
fn parse_label_selector(text: &str) -> Result<selectors::LabelSelector, String> {
    if text.trim().is_empty() {
        return Err("an empty selector selects every pod".into());
    }
    selectors::LabelSelector::parse(text)
}

/// Whether `selector` selects pods labelled `labels`.
fn label_selector_selects(
    selector: &selectors::LabelSelector,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector.matches_labels(|key| labels.get(key).map(String::as_str))
}

// ---------------------------------------------------------------------------------------------------
// Custom resources: ServiceMonitor, ScaledObject
// ---------------------------------------------------------------------------------------------------

fn check_service_monitor(at: &str, monitor: &Value, objects: &Objects, problems: &mut Problems) {
    let version = &monitor["apiVersion"];
    ensure!(
        problems,
        at,
        *version == "monitoring.coreos.com/v1",
        "apiVersion {version}, expected monitoring.coreos.com/v1"
    );
    let spec = &monitor["spec"];
    known_keys(at, "spec", spec, SERVICE_MONITOR_SPEC, problems);
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
}

fn check_scaled_object(at: &str, scaled: &Value, objects: &Objects, problems: &mut Problems) {
    let version = &scaled["apiVersion"];
    ensure!(
        problems,
        at,
        *version == "keda.sh/v1alpha1",
        "apiVersion {version}, expected keda.sh/v1alpha1"
    );
    let spec = &scaled["spec"];
    known_keys(at, "spec", spec, SCALED_OBJECT_SPEC, problems);
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

// ---------------------------------------------------------------------------------------------------
// The Grafana dashboard
// ---------------------------------------------------------------------------------------------------

/// Every `tongs_*` name in a PromQL expression.
fn metric_names(expr: &str) -> Vec<&str> {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("tongs_") {
        let inside_word = rest[..start].chars().next_back().is_some_and(is_word);
        let tail = &rest[start..];
        let end = tail.find(|c: char| !is_word(c)).unwrap_or(tail.len());
        if !inside_word {
            names.push(&tail[..end]);
        }
        rest = &tail[end..];
    }
    names
}

/// Whether tongs exports `name`: a CATALOG name, or a histogram's `_bucket`, `_sum` or `_count`.
fn exported(name: &str) -> bool {
    CATALOG.iter().any(|spec| {
        name == spec.name
            || (spec.kind == "histogram"
                && ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suffix| name.strip_suffix(suffix) == Some(spec.name)))
    })
}

fn check_dashboard(at: &str, text: &str, problems: &mut Problems) {
    let dashboard: Value = match serde_json::from_str(text) {
        Ok(value) => value,
        Err(err) => return problems.fail(at, format!("is not JSON: {err}")),
    };
    let mut ids = BTreeSet::new();
    let mut used = BTreeSet::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        let title = panel["title"].as_str().unwrap_or("?");
        ensure!(
            problems,
            at,
            ids.insert(panel["id"].to_string()),
            "panel id {} is used twice",
            panel["id"]
        );
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
        ensure!(
            problems,
            at,
            !targets.is_empty(),
            "panel {title:?} has no query"
        );
        for expr in targets.iter().filter_map(|target| target["expr"].as_str()) {
            for name in metric_names(expr) {
                ensure!(
                    problems,
                    at,
                    exported(name),
                    "panel {title:?} queries {name}, which src/metrics.rs does not export"
                );
                used.insert(name.to_owned());
            }
        }
    }
    for wanted in [
        "tongs_requests_total",
        "tongs_request_duration_seconds_bucket",
        "tongs_endpoint_outstanding",
        "tongs_endpoint_limit",
        "tongs_endpoint_state",
        "tongs_retries_total",
        "tongs_rejections_total",
        "tongs_queue_depth",
        "tongs_queue_wait_seconds_bucket",
        "tongs_demand",
    ] {
        ensure!(
            problems,
            at,
            used.contains(wanted),
            "no panel shows {wanted}"
        );
    }
}

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
    let config = Config::parse(&read("deploy/base/tongs.yaml"), "deploy")
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

/// The problems `check_rendering` finds in `overlay`'s rendering after `change`.
fn problems_after(overlay: &str, change: impl FnOnce(&mut Vec<Value>)) -> Vec<String> {
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

fn tongs_pod_spec(documents: &mut [Value]) -> &mut Value {
    let tongs = documents
        .iter_mut()
        .find(|doc| doc["kind"] == "Deployment" && name_of(doc) == TONGS)
        .expect("tongs' Deployment");
    &mut tongs["spec"]["template"]["spec"]
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
}

/// The Secrets a pod refers to and the keys it reads from them (none: the whole Secret).
fn secret_references(spec: &PodSpec) -> BTreeSet<(String, Option<String>)> {
    let mut found = BTreeSet::new();
    for volume in spec.volumes.iter().flatten() {
        let Some(secret) = &volume.secret else {
            continue;
        };
        let name = secret.secret_name.clone().unwrap_or_default();
        match &secret.items {
            Some(items) => found.extend(
                items
                    .iter()
                    .map(|item| (name.clone(), Some(item.key.clone()))),
            ),
            None => {
                found.insert((name, None));
            }
        }
    }
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    for container in containers {
        for var in container.env.iter().flatten() {
            if let Some(from) = var
                .value_from
                .as_ref()
                .and_then(|from| from.secret_key_ref.as_ref())
            {
                found.insert((from.name.clone(), Some(from.key.clone())));
            }
        }
        for from in container.env_from.iter().flatten() {
            if let Some(secret) = &from.secret_ref {
                found.insert((secret.name.clone(), None));
            }
        }
    }
    found
}

/// The operator creates every Secret a rendering refers to (deploy/ ships none): deploy/README.md says
/// how, with one `kubectl create secret generic` line per Secret naming its namespace and each key.
#[test]
fn deploy_readme_tells_how_to_create_every_secret() {
    let readme = read("deploy/README.md");
    let mut missing = BTreeSet::new();
    for (source, documents) in rendered() {
        for document in documents.iter().filter(|doc| doc["kind"] == "Deployment") {
            let Ok(deployment) = serde_json::from_value::<Deployment>(document.clone()) else {
                continue;
            };
            let Some(spec) = pod_spec(&deployment) else {
                continue;
            };
            let namespace = deployment.metadata.namespace.as_deref();
            for (secret, key) in secret_references(spec) {
                let documented = readme.lines().any(|line| {
                    line.contains(&format!("create secret generic {secret} "))
                        && namespace.is_none_or(|ns| line.contains(&format!("kubectl -n {ns} ")))
                        && key.as_deref().is_none_or(|key| {
                            line.contains(&format!("--from-file={key}="))
                                || line.contains(&format!("--from-literal={key}="))
                        })
                });
                if !documented {
                    missing.insert(format!("{source}: Secret {secret} key {key:?}"));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "deploy/README.md needs `kubectl -n NAMESPACE create secret generic NAME --from-file=KEY=FILE` \
         (or --from-literal=KEY=VALUE) for: {missing:#?}"
    );
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

//! tongs' Deployment: replicas, selector, the pod's and every container's hardening, anti-affinity,
//! ServiceAccount, args and resources, ports and probes against the configuration it mounts, and a
//! termination grace period that outlasts the drain.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, Probe};
use tongs::config::Config;

use crate::config::mounted_config;
use crate::objects::Objects;
use crate::pods::{named_port, pod_labels, pod_spec, resolve_port, selector_selects};
use crate::problems::Problems;
use crate::secrets::SecretMount;
use crate::{ARGS, TONGS};

/// Checks tongs' Deployment, and returns the configuration it mounts (when that parses at all) and its
/// text.
pub(crate) fn check_tongs(
    at: &str,
    deployment: &Deployment,
    objects: &Objects,
    secrets: &[SecretMount],
    problems: &mut Problems,
) -> Option<(Config, String)> {
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

    let (config, text) = mounted_config(at, spec, container, objects, secrets, problems)?;
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
    Some((config, text))
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

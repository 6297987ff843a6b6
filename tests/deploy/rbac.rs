//! RBAC: each Role reads pods or patches them, never both, or reads EndpointSlices; each RoleBinding
//! binds a Role to a ServiceAccount of the rendering; tongs' ServiceAccount may do to pods exactly what
//! its discovery, node registration and write-back need; and where `replicas.service` is set, it names
//! the Service in front of tongs' own pods and tongs may read that Service's EndpointSlices.

use k8s_openapi::api::rbac::v1::{Role, RoleBinding};

use crate::objects::{Asks, Objects};
use crate::pods::{TongsPod, pod_labels, selects};
use crate::problems::Problems;

/// A Role either reads pods (get, list, watch) or patches them, never both: `patch` lets tongs change any
/// pod of the namespace, so it lives in a narrow Role of its own (components/pod-annotator) that only the
/// renderings needing it include (`check_access`).
pub(crate) fn check_role(at: &str, role: &Role, problems: &mut Problems) {
    let rules = role.rules.as_deref().unwrap_or(&[]);
    ensure!(problems, at, !rules.is_empty(), "has no rules");
    let patches = rules
        .iter()
        .any(|rule| rule.verbs.iter().any(|verb| verb == "patch"));
    for rule in rules {
        let groups = rule.api_groups.as_deref();
        let resources = rule.resources.as_deref();
        let slices = groups == Some(&["discovery.k8s.io".to_owned()])
            && resources == Some(&["endpointslices".to_owned()]);
        ensure!(
            problems,
            at,
            groups == Some(&[String::new()]) || slices,
            "apiGroups {groups:?}: only the core group (or discovery.k8s.io for endpointslices)"
        );
        ensure!(
            problems,
            at,
            resources == Some(&["pods".to_owned()]) || slices,
            "resources {resources:?}: only pods (or endpointslices in discovery.k8s.io)"
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

pub(crate) fn check_role_binding(
    at: &str,
    binding: &RoleBinding,
    objects: &Objects,
    problems: &mut Problems,
) {
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

/// The Roles of `namespace` that grant `verb` on pods and that a RoleBinding there binds to tongs'
/// ServiceAccount.
fn granted<'a>(
    objects: &'a Objects,
    tongs: &TongsPod,
    namespace: Option<&str>,
    verb: &str,
) -> Vec<&'a str> {
    granted_where(objects, tongs, namespace, |role| grants_on_pods(role, verb))
}

/// The Roles of `namespace` that `grants` and that a RoleBinding there binds to tongs' ServiceAccount.
fn granted_where<'a>(
    objects: &'a Objects,
    tongs: &TongsPod,
    namespace: Option<&str>,
    grants: impl Fn(&Role) -> bool,
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
            role.metadata.namespace.as_deref() == namespace && grants(role) && bound(name)
        })
        .map(|(name, _)| name.as_str())
        .collect()
}

fn grants_on_pods(role: &Role, verb: &str) -> bool {
    grants(role, "", "pods", verb)
}

fn grants(role: &Role, group: &str, resource: &str, verb: &str) -> bool {
    role.rules.iter().flatten().any(|rule| {
        rule.api_groups.iter().flatten().any(|g| g == group)
            && rule.resources.iter().flatten().any(|r| r == resource)
            && rule.verbs.iter().any(|v| v == verb)
    })
}

/// Roles of `namespace` bound to tongs' ServiceAccount that grant `verb` on EndpointSlices.
fn granted_on_slices<'a>(
    objects: &'a Objects,
    tongs: &TongsPod,
    namespace: Option<&str>,
    verb: &str,
) -> Vec<&'a str> {
    granted_where(objects, tongs, namespace, |role| {
        grants(role, "discovery.k8s.io", "endpointslices", verb)
    })
}

/// `replicas.service` names the Service whose selector picks tongs' own pods, and tongs may read its
/// EndpointSlices where it lives; a Role granting that with no `replicas.service` is unused.
fn check_replicas(asks: &Asks, problems: &mut Problems) {
    let (at, tongs, config, objects) = asks.parts();
    let replicas = &config.replicas;
    let readers = granted_on_slices(objects, tongs, tongs.namespace(), "list");
    if replicas.service.is_empty() {
        ensure!(
            problems,
            at,
            readers.is_empty(),
            "Role {readers:?} grants reading EndpointSlices, but tongs.yaml sets no replicas.service"
        );
        return;
    }
    let namespace = match replicas.namespace.as_str() {
        "" => tongs.namespace(),
        namespace => Some(namespace),
    };
    let own = objects
        .services
        .get(&replicas.service)
        .is_some_and(|service| {
            let selector = service.spec.as_ref().and_then(|s| s.selector.as_ref());
            selects(selector, &pod_labels(tongs.deployment))
        });
    ensure!(
        problems,
        at,
        own && namespace == tongs.namespace(),
        "replicas.service {:?} is no Service of the rendering that selects tongs' own pods",
        replicas.service
    );
    for verb in ["get", "list", "watch"] {
        let roles = granted_on_slices(objects, tongs, namespace, verb);
        ensure!(
            problems,
            at,
            !roles.is_empty(),
            "replicas.service is set, but no Role bound to ServiceAccount {} grants {verb} on \
             endpointslices (discovery.k8s.io)",
            tongs.service_account()
        );
    }
}

/// tongs' ServiceAccount may do to pods exactly what tongs.yaml needs: get, list and watch where each
/// pool's discovery watches, and `patch` there only when node registration or write-back writes
/// annotations.
pub(crate) fn check_access(asks: &Asks, problems: &mut Problems) {
    check_replicas(asks, problems);
    let (at, tongs, _config, objects) = asks.parts();
    let account = tongs.service_account();
    let mut writers = Vec::new();
    for discovery in asks.discoveries {
        let kubernetes = &discovery.config.discovery.kubernetes;
        let Ok(watched) = tongs.watched_namespace(&discovery.config) else {
            problems.fail(
                at,
                format!(
                    "{} \"*\" needs a ClusterRole; deploy/ grants Roles only",
                    discovery.field("discovery.kubernetes.namespace")
                ),
            );
            continue;
        };
        let shown = watched.unwrap_or("(the one applied to)");
        if kubernetes.enabled {
            for verb in ["get", "list", "watch"] {
                let roles = granted(objects, tongs, watched, verb);
                ensure!(
                    problems,
                    at,
                    !roles.is_empty(),
                    "{} is enabled, but no Role bound to ServiceAccount {account} grants {verb} on \
                     pods in namespace {shown}",
                    discovery.field("discovery.kubernetes")
                );
            }
        }
        if kubernetes.registration.token_file.is_some() {
            let field = discovery.field("discovery.kubernetes.registration.token_file");
            writers.push((field, watched, shown));
        }
        if kubernetes.write_back {
            writers.push((
                discovery.field("discovery.kubernetes.write_back"),
                watched,
                shown,
            ));
        }
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
    }
    for (writer, watched, shown) in writers {
        let patchers = granted(objects, tongs, watched, "patch");
        ensure!(
            problems,
            at,
            !patchers.is_empty(),
            "[{writer:?}] write pod annotations, but no Role bound to ServiceAccount {account} grants \
             patch on pods in namespace {shown}: add components/pod-annotator"
        );
    }
}

//! What the READMEs promise of deploy/: the quick start applies on a bare cluster and names the
//! components that need more.

use std::path::Path;

use serde_json::Value;

use crate::read;
use crate::render::{kustomizations, rendered};

/// Whether an `apiVersion` is one a bare cluster serves: the core group, a group without a dot (apps,
/// policy, batch, autoscaling) or a `*.k8s.io` one. Everything else comes from a CRD.
pub(crate) fn built_in(api_version: &str) -> bool {
    let group = api_version.rsplit_once('/').map_or("", |(group, _)| group);
    group.is_empty() || !group.contains('.') || group.ends_with(".k8s.io")
}

/// The text of a Markdown section, from its heading to the next heading of the same level.
pub(crate) fn section<'a>(markdown: &'a str, heading: &str) -> &'a str {
    let start = markdown
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no section {heading:?}"));
    let level = heading.split(' ').next().unwrap_or("##");
    let body = &markdown[start + heading.len() + 2..];
    let end = body.find(&format!("\n{level} ")).unwrap_or(body.len());
    &body[..end]
}

/// The custom resources each component adds, by kind: (component directory, `group/version kind`).
pub(crate) fn custom_resource_components() -> Vec<(String, String)> {
    let mut found = Vec::new();
    for component in kustomizations().iter().filter(|k| k.kind == "Component") {
        let text = read(&format!("{}/kustomization.yaml", component.name()));
        let kustomization: Value = serde_saphyr::from_str(&text).expect("a kustomization");
        let files = kustomization["resources"].as_array().into_iter().flatten();
        for file in files.filter_map(Value::as_str) {
            let path = Path::new(&component.name()).join(file);
            let documents: Vec<Value> =
                serde_saphyr::from_multiple(&read(path.to_str().expect("UTF-8")))
                    .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
            for document in documents.iter().filter(|doc| !doc.is_null()) {
                let version = document["apiVersion"].as_str().unwrap_or("");
                if !built_in(version) {
                    let kind = document["kind"].as_str().unwrap_or("");
                    found.push((component.name(), format!("{version} {kind}")));
                }
            }
        }
    }
    found
}

/// The overlay the README's quick start applies holds only built-in kinds, so `kubectl apply -k`
/// succeeds on a cluster without the Prometheus Operator or KEDA; the quick start names each component
/// that needs a CRD, for those who have it.
#[test]
fn quick_start_applies_on_a_bare_cluster() {
    let readme = read("README.md");
    let quick_start = section(&readme, "## Kubernetes quick start");
    let commands = quick_start
        .split("```")
        .nth(1)
        .expect("the quick start's commands");
    let applied: Vec<&str> = commands
        .lines()
        .filter_map(|line| line.trim().strip_prefix("kubectl apply -k "))
        .collect();
    assert!(
        !applied.is_empty(),
        "the quick start's commands apply no kustomization"
    );
    for dir in applied {
        let (_, documents) = rendered()
            .iter()
            .find(|(source, _)| source == dir.trim_end_matches('/'))
            .unwrap_or_else(|| panic!("the quick start applies {dir}, which is no kustomization"));
        let custom: Vec<String> = documents
            .iter()
            .filter(|doc| !built_in(doc["apiVersion"].as_str().unwrap_or("")))
            .map(|doc| format!("{} {}", doc["apiVersion"], doc["kind"]))
            .collect();
        assert!(
            custom.is_empty(),
            "{dir}, applied by the quick start, renders custom resources, which fail on a cluster \
             without their CRDs: {custom:?}"
        );
    }
    let components = custom_resource_components();
    assert!(
        !components.is_empty(),
        "no component adds a custom resource"
    );
    for (component, resource) in components {
        assert!(
            quick_start.contains(&component),
            "README's quick start does not name {component} (which adds {resource}) as opt-in"
        );
    }
}

#[test]
fn built_in_api_groups_are_told_from_custom_ones() {
    for version in [
        "v1",
        "apps/v1",
        "policy/v1",
        "networking.k8s.io/v1",
        "rbac.authorization.k8s.io/v1",
    ] {
        assert!(built_in(version), "{version}");
    }
    for version in ["monitoring.coreos.com/v1", "keda.sh/v1alpha1"] {
        assert!(!built_in(version), "{version}");
    }
}

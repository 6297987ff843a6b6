//! What the READMEs promise of deploy/: the quick start applies on a bare cluster and names the
//! components that need more; deploy/README.md names everything a user must provide: every Secret (with
//! the command that creates it), every CRD, and every placeholder value and assumption about the
//! cluster.

use std::collections::BTreeSet;
use std::path::Path;

use k8s_openapi::api::apps::v1::Deployment;
use serde_json::Value;

use crate::pods::pod_spec;
use crate::read;
use crate::render::{kustomizations, rendered};
use crate::secrets::secret_references;

/// Text that marks a value as one to replace: the placeholders of deploy/ contain one of these
/// (compared without case).
const PLACEHOLDER_MARKS: [&str; 2] = ["replace-with", "example.com"];

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

/// Every custom resource a rendering holds needs its CRD installed first: deploy/README.md names its
/// kind, its API group and the component that adds it.
#[test]
fn deploy_readme_names_every_custom_resource_definition() {
    let readme = read("deploy/README.md");
    let mut missing = BTreeSet::new();
    for (source, documents) in rendered() {
        for document in documents {
            let version = document["apiVersion"].as_str().unwrap_or("");
            if built_in(version) {
                continue;
            }
            let kind = document["kind"].as_str().unwrap_or("");
            let group = version.split('/').next().unwrap_or("");
            for wanted in [kind, group] {
                if !readme.contains(wanted) {
                    missing.insert(format!("{wanted} ({version} {kind}, rendered by {source})"));
                }
            }
        }
    }
    for (component, resource) in custom_resource_components() {
        let short = component.trim_start_matches("deploy/");
        if !readme.contains(short) {
            missing.insert(format!("{short} (adds {resource})"));
        }
    }
    assert!(
        missing.is_empty(),
        "deploy/README.md does not name these custom resources' kinds, groups or components: {missing:#?}"
    );
}

/// Every word of `text` holding a placeholder mark, as written.
pub(crate) fn placeholders(text: &str) -> Vec<String> {
    let is_token = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '/' | ':' | '_' | '-');
    text.split(|c: char| !is_token(c))
        .map(|word| word.trim_matches(['.', ':', '/']))
        .filter(|word| {
            let lower = word.to_ascii_lowercase();
            PLACEHOLDER_MARKS.iter().any(|mark| lower.contains(mark))
        })
        .map(str::to_owned)
        .collect()
}

fn strings<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::String(text) => out.push(text),
        Value::Array(items) => items.iter().for_each(|item| strings(item, out)),
        Value::Object(map) => map.values().for_each(|item| strings(item, out)),
        _ => {}
    }
}

/// What a user must fill in before applying is named in deploy/README.md: every placeholder value a
/// rendering holds (tongs.yaml's included), every image without a registry (the command that sets it),
/// and the cluster's own addresses deploy/ assumes (Prometheus' Service for KEDA, its namespace for the
/// NetworkPolicy).
#[test]
fn deploy_readme_names_every_placeholder() {
    let readme = read("deploy/README.md");
    let mut missing = BTreeSet::new();
    let mut found = 0;
    for (source, documents) in rendered() {
        for document in documents {
            let mut texts = Vec::new();
            strings(document, &mut texts);
            for placeholder in texts.iter().flat_map(|text| placeholders(text)) {
                found += 1;
                if !readme.contains(&placeholder) {
                    missing.insert(format!("{placeholder} ({source})"));
                }
            }
            let containers = document["spec"]["template"]["spec"]["containers"].as_array();
            for container in containers.into_iter().flatten() {
                let image = container["image"].as_str().unwrap_or("");
                let name = image.split([':', '@']).next().unwrap_or("");
                if !name.contains('/') && !readme.contains(&format!("set image {name}=")) {
                    missing.insert(format!(
                        "`kustomize edit set image {name}=...` for image {image} ({source})"
                    ));
                }
            }
            let triggers = document["spec"]["triggers"]
                .as_array()
                .into_iter()
                .flatten();
            for address in
                triggers.filter_map(|trigger| trigger["metadata"]["serverAddress"].as_str())
            {
                if !readme.contains(address) {
                    missing.insert(format!("KEDA's serverAddress {address} ({source})"));
                }
            }
            let ingress = document["spec"]["ingress"].as_array().into_iter().flatten();
            let peers = ingress.flat_map(|rule| rule["from"].as_array().into_iter().flatten());
            for peer in peers {
                let labels = peer["namespaceSelector"]["matchLabels"].as_object();
                for namespace in labels.into_iter().flatten().filter_map(|(_, v)| v.as_str()) {
                    if !readme.contains(&format!("`{namespace}`")) {
                        missing.insert(format!(
                            "the namespace `{namespace}` a NetworkPolicy admits ({source})"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        found > 0,
        "no placeholder found: is PLACEHOLDER_MARKS out of date?"
    );
    assert!(
        missing.is_empty(),
        "deploy/README.md does not name what a user must fill in: {missing:#?}"
    );
}

#[test]
fn placeholders_are_found_in_text() {
    let text =
        "image: registry.example.com/gpu:1\n  organization: replace-with-org # Replace it.\n";
    assert_eq!(
        placeholders(text),
        vec!["registry.example.com/gpu:1", "replace-with-org"]
    );
    assert!(placeholders("replaces the file").is_empty());
}

/// Longest the top-level README may grow: it is a first contact (the problem, the two commands,
/// prerequisites, short sections), and reference material belongs in docs/ (#20).
const README_MAX_LINES: usize = 320;

/// The Markdown a reader moves between: the READMEs, the benchmark figures and every file of docs/.
fn markdown_files() -> Vec<String> {
    let mut files: Vec<String> = [
        "README.md",
        "deploy/README.md",
        "benches/README.md",
        "benches/RESULTS.md",
    ]
    .map(String::from)
    .to_vec();
    let mut docs: Vec<String> = std::fs::read_dir(Path::new(crate::ROOT).join("docs"))
        .expect("a docs/ directory")
        .map(|entry| {
            entry
                .expect("a docs/ entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The targets of `[text](target)` links outside fenced code blocks and code spans, web links left out.
fn relative_links(markdown: &str) -> Vec<String> {
    let mut links = Vec::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans are the odd pieces between backticks.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            let target = &rest[..end];
            if !target.contains("://") && !target.starts_with("mailto:") {
                links.push(target.to_owned());
            }
            rest = &rest[end..];
        }
    }
    links
}

/// The anchors GitHub gives a Markdown file's headings: lower case, spaces as `-`, punctuation dropped.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut found = BTreeSet::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            let title = line.trim_start_matches('#').trim().to_lowercase();
            let slug = title
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect();
            found.insert(slug);
        }
    }
    found
}

/// Every relative link of the READMEs and docs/ points at a file that exists, and every `#anchor` at a
/// heading of that file: moving a section must not leave a reader at a dead end.
#[test]
fn relative_links_in_the_docs_resolve() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let dir = Path::new(&file).parent().expect("a file in the repository");
        for link in relative_links(&read(&file)) {
            let (path, anchor) = link
                .split_once('#')
                .map_or((link.as_str(), None), |(path, anchor)| (path, Some(anchor)));
            let target = if path.is_empty() {
                Path::new(&file).to_path_buf()
            } else {
                dir.join(path)
            };
            let full = Path::new(crate::ROOT).join(&target);
            if !full.exists() {
                broken.push(format!("{file}: ({link}): no {}", target.display()));
            } else if let Some(anchor) = anchor {
                let text = std::fs::read_to_string(&full).unwrap_or_default();
                if !anchors(&text).contains(anchor) {
                    broken.push(format!(
                        "{file}: ({link}): no heading #{anchor} in {}",
                        target.display()
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The README stays a first contact: short, the two commands first, the prerequisites it states true
/// (the Rust version `Cargo.toml` declares, every Debian package `scripts/test.sh` may install), and a
/// link to every file of docs/, where the reference material lives.
#[test]
fn the_readme_is_a_first_contact() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines (at most {README_MAX_LINES}): move reference material to docs/"
    );
    let commands = section(&readme, "## Two commands");
    for command in ["cargo run --release -- demo", "bash scripts/test.sh"] {
        assert!(
            commands.contains(&format!("\n{command}\n")),
            "README's two commands lack `{command}`"
        );
    }
    assert!(
        read(".ci/run").contains("\nbash scripts/test.sh\n"),
        ".ci/run no longer runs the README's test command"
    );

    let prerequisites = section(&readme, "## Prerequisites and expected times");
    let cargo = read("Cargo.toml");
    let rust_version = cargo
        .lines()
        .find_map(|line| line.strip_prefix("rust-version = "))
        .expect("Cargo.toml declares rust-version")
        .trim_matches('"');
    assert!(
        prerequisites.contains(&format!("Rust **{rust_version} or newer**")),
        "README's prerequisites do not name Rust {rust_version}, Cargo.toml's rust-version"
    );
    let script = read("scripts/test.sh");
    let packages: Vec<&str> = script
        .split("need+=(")
        .skip(1)
        .map(|rest| rest.split(')').next().unwrap_or(""))
        .collect();
    assert!(
        packages.len() >= 10,
        "scripts/test.sh installs {packages:?}"
    );
    for package in packages {
        assert!(
            prerequisites.contains(&format!("`{package}`")),
            "README's prerequisites do not name `{package}`, which scripts/test.sh installs"
        );
    }

    let linked = relative_links(&readme);
    for file in markdown_files()
        .iter()
        .filter(|file| file.starts_with("docs/"))
    {
        assert!(
            linked
                .iter()
                .any(|link| link == file || link.starts_with(&format!("{file}#"))),
            "README.md does not link {file}"
        );
    }
}

#[test]
fn links_and_anchors_are_read_as_github_reads_them() {
    let text = "See [a](docs/a.md#b-c) and [web](https://x.y), `[code](no.md)`\n\
                ```\n[fenced](no.md)\n```\n[c](../c.md)\n";
    assert_eq!(relative_links(text), ["docs/a.md#b-c", "../c.md"]);
    let headings = anchors("# Around `src/`\n## Pools and models\n```\n# not a heading\n```\n");
    let expected: BTreeSet<String> = ["around-src", "pools-and-models"].map(String::from).into();
    assert_eq!(headings, expected);
}

//! The shape of `src/` and `crates/wire/src/`, checked: every top-level module sits in a layer, every
//! `crate::` path points to a lower layer (so there is no import cycle), no file is over 600 lines
//! before its unit tests, and the layout table of `docs/layout.md` lists the modules layer by layer, as
//! the code has them. The wire layer is a crate of its own (`tongs-wire`), re-exported by tongs: the
//! compiler already keeps it from reaching up, and this test reads it like the rest.
//!
//! It reads the source as text: a `use crate::x` or a `crate::x::…` path outside `#[cfg(test)]` is an
//! import of `x`.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first. A module may use only modules of lower layers.
const LAYERS: &[(&str, &[&str])] = &[
    ("protocols", &["engine", "header", "openai"]),
    ("configuration", &["config"]),
    ("ground", &["breaker", "readiness"]),
    ("rules", &["limit", "admission"]),
    ("vocabulary", &["http", "endpoint", "trace"]),
    (
        "fleet",
        &["registry", "balance", "metrics", "upstream", "sim"],
    ),
    ("policies", &["retry", "health", "reload"]),
    ("request path", &["proxy"]),
    ("edges", &["source"]),
    ("routing", &["route"]),
    ("serving", &["server"]),
    ("operators", &["admin"]),
    ("assembly", &["app"]),
    ("showcase", &["demo"]),
];

/// Longest a file may be before its unit tests.
const MAX_LINES: usize = 600;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The source roots read: tongs' own and the wire crate's.
fn roots() -> [PathBuf; 2] {
    [
        src(),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/wire/src"),
    ]
}

/// Every Rust file under the source roots.
fn all_rust_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for root in roots() {
        rust_files(&root, &mut files);
    }
    files
}

/// The root a file lies under.
fn root_of(path: &Path) -> PathBuf {
    roots()
        .into_iter()
        .find(|root| path.starts_with(root))
        .expect("a file under a source root")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's text before its unit tests.
fn without_tests(text: &str) -> &str {
    [
        "#[cfg(test)]\nmod tests",
        "#[cfg(test)]\npub(crate) mod tests",
    ]
    .iter()
    .filter_map(|start| text.find(start))
    .min()
    .map_or(text, |at| &text[..at])
}

/// The top-level module a file belongs to (`None` for `lib.rs` and `main.rs`).
fn module_of(path: &Path) -> Option<String> {
    let relative = path.strip_prefix(root_of(path)).unwrap();
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_owned())
}

/// Top-level modules named by `crate::` paths in `code`, grouped imports included.
fn imports(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                let name = part.trim().split("::").next().unwrap_or("").trim();
                if !name.is_empty() && name != "self" {
                    found.insert(name.to_owned());
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

fn layer_of() -> BTreeMap<&'static str, usize> {
    LAYERS
        .iter()
        .enumerate()
        .flat_map(|(index, (_, modules))| modules.iter().map(move |m| (*m, index)))
        .collect()
}

fn top_level_modules() -> BTreeSet<String> {
    all_rust_files()
        .iter()
        .filter_map(|path| module_of(path))
        .collect()
}

#[test]
fn every_module_has_a_layer_and_every_use_points_down() {
    let layers = layer_of();
    let files = all_rust_files();
    let mut defects = Vec::new();
    for module in top_level_modules() {
        if !layers.contains_key(module.as_str()) {
            defects.push(format!(
                "{module}: in no layer; add it to LAYERS and docs/layout.md"
            ));
        }
    }
    for path in &files {
        let Some(module) = module_of(path) else {
            continue;
        };
        let Some(&own) = layers.get(module.as_str()) else {
            continue;
        };
        let text = std::fs::read_to_string(path).unwrap();
        for used in imports(without_tests(&text)) {
            if used == module {
                continue;
            }
            match layers.get(used.as_str()) {
                Some(&layer) if layer < own => {}
                Some(&layer) => defects.push(format!(
                    "{}: uses crate::{used} ({}) from layer {} ({})",
                    path.strip_prefix(root_of(path)).unwrap().display(),
                    LAYERS[layer].0,
                    own,
                    LAYERS[own].0
                )),
                None => {}
            }
        }
    }
    assert!(
        defects.is_empty(),
        "layering defects:\n{}",
        defects.join("\n")
    );
}

#[test]
fn no_file_is_over_600_lines_before_its_tests() {
    let files = all_rust_files();
    let long: Vec<String> = files
        .iter()
        .filter_map(|path| {
            let text = std::fs::read_to_string(path).unwrap();
            let lines = without_tests(&text).lines().count();
            (lines > MAX_LINES).then(|| format!("{}: {lines} lines", path.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_layout_doc_lists_the_layers_as_the_code_has_them() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/layout.md"))
        .unwrap();
    let layout = doc
        .split("\n## Layers\n")
        .nth(1)
        .expect("docs/layout.md has a ## Layers section");
    let layout = layout.split("\n## ").next().unwrap_or(layout);
    let mut position = 0;
    for (name, modules) in LAYERS {
        let row = layout[position..]
            .find(&format!("| {name} |"))
            .unwrap_or_else(|| {
                panic!("docs/layout.md: no row for layer {name:?} after the layers below it")
            });
        position += row;
        let line = layout[position..].lines().next().unwrap_or("");
        for module in *modules {
            // A directory module is written `name/`, a one-file module `name`, as `src/` has them.
            let written = if roots().iter().any(|root| root.join(module).is_dir()) {
                format!("`{module}/`")
            } else {
                format!("`{module}`")
            };
            assert!(
                line.contains(&written),
                "docs/layout.md: the {name} row does not name {written}: {line}"
            );
        }
        position += line.len();
    }
}

#[test]
fn the_import_reader_sees_grouped_and_inline_paths() {
    let found = imports("use crate::{a, b::C, self};\nlet x = crate::c::d();\n// crate::e\n");
    let expected: BTreeSet<String> = ["a", "b", "c", "e"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, expected);
}

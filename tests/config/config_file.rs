//! The shipped example `config/tongs.yaml` and the table of keys in `docs/configuration.md` stay complete: every key the
//! configuration has appears in both, and the example file is valid.

use std::collections::BTreeSet;

use tongs::balance::config_problems;
use tongs::config::Config;

/// Dotted paths of every key in a YAML document that holds a value or a list (sections themselves are
/// left out); list items are written `name[]`.
fn key_paths(value: &serde_json::Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, child) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                if !child.is_object() {
                    out.insert(path.clone());
                }
                key_paths(child, &path, out);
            }
        }
        serde_json::Value::Array(items) => {
            for item in items {
                key_paths(item, &format!("{prefix}[]"), out);
            }
        }
        _ => {}
    }
}

/// Every key of the effective configuration, with a static endpoint so list keys appear too.
fn all_keys() -> BTreeSet<String> {
    let config = Config::parse(
        "discovery:\n  static:\n    - url: http://10.0.0.7:8000\n\
         queue: { max_wait_no_endpoints: 1m }\n\
         pools:\n\
         - name: a\n\
         \x20 match: { models: [m], path_prefixes: [/v1/] }\n\
         \x20 fallback: [default]\n\
         \x20 rewrite_model: b\n\
         \x20 api_key_file: /k\n\
         \x20 discovery: { static: [{ url: \"http://10.0.0.8:8000\" }] }\n",
        "test",
    )
    .unwrap();
    let value: serde_json::Value = serde_saphyr::from_str(&config.to_yaml()).unwrap();
    let mut keys = BTreeSet::new();
    key_paths(&value, "", &mut keys);
    keys
}

#[test]
fn example_config_is_valid_and_has_every_key() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/tongs.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    Config::parse_with(&text, path, config_problems).unwrap_or_else(|err| panic!("{err}"));
    let value: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let mut present = BTreeSet::new();
    key_paths(&value, "", &mut present);
    let missing: Vec<_> = all_keys().difference(&present).cloned().collect();
    assert!(missing.is_empty(), "config/tongs.yaml lacks {missing:?}");
}

#[test]
fn docs_document_every_key() {
    let table = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap();
    let missing: Vec<_> = all_keys()
        .into_iter()
        .filter(|key| !table.contains(&format!("`{key}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/configuration.md's table of keys lacks {missing:?}"
    );
}

//! tongs.yaml as each rendering mounts it: parsed and validated by tongs itself, and every setting of
//! deploy/base/tongs.yaml kept by the overlays' copies.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use k8s_openapi::api::core::v1::{Container, PodSpec};
use serde_json::Value;
use tongs::balance::config_problems;
use tongs::config::{Config, parse_yaml};

use crate::objects::Objects;
use crate::pools::Discovery;
use crate::problems::Problems;
use crate::secrets::{SecretMount, secret_file};
use crate::{CONFIG_DIR, read};

/// The configuration the Deployment mounts at /etc/tongs, parsed and validated by tongs itself, and its
/// text.
pub(crate) fn mounted_config(
    at: &str,
    spec: &PodSpec,
    container: &Container,
    objects: &Objects,
    secrets: &[SecretMount],
    problems: &mut Problems,
) -> Option<(Config, String)> {
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
    let config = parse_config(at, text, secrets, problems)?;
    Some((config, text.clone()))
}

/// Parses and validates tongs.yaml as tongs does (`parse_yaml`, then `validate_with` tongs' checks), as it
/// would in tongs' pod: validation reads some files (`admin.bearer_token_file`,
/// `discovery.kubernetes.registration.token_file`), and one that the pod gets from a Secret volume
/// (`secrets`) exists only there, so a placeholder file stands in for it. Whether the Secret really is
/// mounted at that path is `check_secret_files`' business.
pub(crate) fn parse_config(
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
    let remaining = in_the_pod.validate_with(config_problems);
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
/// here instead of drifting apart. With pools, each pool finds its own GPU nodes: the base's
/// `discovery` settings must then hold in every pool's discovery instead, all but the label selector,
/// which picks that pool's pods.
pub(crate) fn check_keeps_base_keys(
    at: &str,
    config: &Config,
    discoveries: &[Discovery],
    problems: &mut Problems,
) {
    let (pointers, base) = base_settings();
    let effective = serde_json::to_value(config).unwrap_or(Value::Null);
    let pools: Vec<(&Discovery, Value)> = discoveries
        .iter()
        .filter(|discovery| discovery.is_listed_pool())
        .map(|discovery| {
            let value = serde_json::to_value(&discovery.config).unwrap_or(Value::Null);
            (discovery, value)
        })
        .collect();
    for pointer in pointers {
        let wanted = base.pointer(pointer);
        let key = pointer.trim_start_matches('/').replace('/', ".");
        let compared: Vec<(String, Option<&Value>)> =
            if pools.is_empty() || !pointer.starts_with("/discovery/") {
                vec![(key, effective.pointer(pointer))]
            } else if pointer == "/discovery/kubernetes/label_selector" {
                Vec::new()
            } else {
                pools
                    .iter()
                    .map(|(pool, value)| (pool.field(&key), value.pointer(pointer)))
                    .collect()
            };
        for (key, found) in compared {
            ensure!(
                problems,
                at,
                wanted == found,
                "{key} is {}, deploy/base/tongs.yaml has {}: keep every overlay's copy of tongs.yaml in \
                 step with the base",
                found.map_or("unset".to_owned(), Value::to_string),
                wanted.map_or("unset".to_owned(), Value::to_string)
            );
        }
    }
}

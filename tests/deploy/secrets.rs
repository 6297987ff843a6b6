//! Secrets and the files mounted from them: every file tongs.yaml reads a secret from is a readOnly,
//! readable file of a Secret volume, and the Secrets a pod refers to.

use std::collections::BTreeSet;
use std::path::Path;

use k8s_openapi::api::core::v1::{PodSpec, SecretVolumeSource, VolumeMount};

use crate::objects::Asks;
use crate::pods::TongsPod;
use crate::problems::Problems;

/// One Secret volume mounted into tongs' container.
pub(crate) struct SecretMount<'a> {
    mount: &'a VolumeMount,
    source: &'a SecretVolumeSource,
    /// The pod's fsGroup, the group that owns the volume's files.
    fs_group: Option<i64>,
}

/// A file tongs' container has from a Secret.
pub(crate) struct SecretFile<'a> {
    secret: &'a str,
    key: String,
    mode: i32,
    read_only: bool,
    /// Whether tongs can read it. The files belong to root (which tongs never runs as) and to the
    /// fsGroup, so tongs reads by "other", or by group when the pod sets an fsGroup.
    readable: bool,
}

impl<'a> TongsPod<'a> {
    /// The Secret volumes the tongs container mounts.
    pub(crate) fn secret_mounts(&self) -> Vec<SecretMount<'a>> {
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

/// The Secret file `path` is in tongs' container, if it is one.
pub(crate) fn secret_file<'a>(mounts: &[SecretMount<'a>], path: &Path) -> Option<SecretFile<'a>> {
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

/// Every file tongs.yaml reads a secret from (each pool's too) is a file of a Secret volume, mounted
/// readOnly where it says, and readable by tongs; a key from the environment comes from a Secret too.
pub(crate) fn check_secret_files(asks: &Asks, secrets: &[SecretMount], problems: &mut Problems) {
    let (at, tongs, config, _objects) = asks.parts();
    let mut files = vec![
        ("salad.api_key_file".to_owned(), &config.salad.api_key_file),
        (
            "admin.bearer_token_file".to_owned(),
            &config.admin.bearer_token_file,
        ),
    ];
    for discovery in asks.discoveries {
        files.push((
            discovery.field("discovery.kubernetes.registration.token_file"),
            &discovery
                .config
                .discovery
                .kubernetes
                .registration
                .token_file,
        ));
        files.push((discovery.field("api_key_file"), &discovery.api_key_file));
    }
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

/// The Secrets a pod refers to and the keys it reads from them (none: the whole Secret).
pub(crate) fn secret_references(spec: &PodSpec) -> BTreeSet<(String, Option<String>)> {
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

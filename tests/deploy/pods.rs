//! Helpers over the pods of a Deployment: their spec, metadata and labels, which pods a selector picks,
//! and ports by name; and tongs' own pod.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tongs::config::Config;

use crate::TONGS;
use crate::objects::Objects;

pub(crate) fn pod_spec(deployment: &Deployment) -> Option<&PodSpec> {
    deployment.spec.as_ref()?.template.spec.as_ref()
}

pub(crate) fn pod_meta<T>(
    deployment: &Deployment,
    read: impl Fn(&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<T>,
) -> Option<T> {
    read(deployment.spec.as_ref()?.template.metadata.as_ref()?)
}

pub(crate) fn pod_labels(deployment: &Deployment) -> BTreeMap<String, String> {
    pod_meta(deployment, |meta| meta.labels.clone()).unwrap_or_default()
}

/// Whether `matchLabels` selects pods labelled `labels` (an empty selector counts as selecting nothing:
/// every selector in deploy/ names its labels).
pub(crate) fn selects(
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

pub(crate) fn selector_selects(
    selector: Option<&LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector.is_some_and(|selector| {
        selector
            .match_expressions
            .as_ref()
            .is_none_or(Vec::is_empty)
            && selects(selector.match_labels.as_ref(), labels)
    })
}

/// The Deployment of the rendering whose pods `matches` picks.
pub(crate) fn selected(
    objects: &Objects,
    matches: impl Fn(&BTreeMap<String, String>) -> bool,
) -> Option<&Deployment> {
    objects
        .deployments
        .values()
        .find(|deployment| matches(&pod_labels(deployment)))
}

pub(crate) fn named_port(container: &Container, name: &str) -> Option<i32> {
    let mut ports = container.ports.iter().flatten();
    ports
        .find(|port| port.name.as_deref() == Some(name))
        .map(|port| port.container_port)
}

/// The number a port reference (number or name) means on `container`.
pub(crate) fn resolve_port(container: &Container, port: &IntOrString) -> Option<i32> {
    match port {
        IntOrString::Int(number) => Some(*number),
        IntOrString::String(name) => named_port(container, name),
    }
}

/// tongs' Deployment, its pod spec and its `tongs` container (its Secret volumes: `secrets.rs`).
pub(crate) struct TongsPod<'a> {
    pub(crate) deployment: &'a Deployment,
    pub(crate) spec: &'a PodSpec,
    pub(crate) container: &'a Container,
}

impl<'a> TongsPod<'a> {
    pub(crate) fn of(objects: &'a Objects) -> Option<TongsPod<'a>> {
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
    pub(crate) fn namespace(&self) -> Option<&'a str> {
        self.deployment.metadata.namespace.as_deref()
    }

    pub(crate) fn service_account(&self) -> &'a str {
        self.spec
            .service_account_name
            .as_deref()
            .unwrap_or("default")
    }

    /// The namespace `discovery.kubernetes` watches: `Err` for all of them (`*`).
    pub(crate) fn watched_namespace<'c>(&self, config: &'c Config) -> Result<Option<&'c str>, ()>
    where
        'a: 'c,
    {
        match config.discovery.kubernetes.namespace.as_str() {
            "" => Ok(self.namespace()),
            "*" => Err(()),
            namespace => Ok(Some(namespace)),
        }
    }
}

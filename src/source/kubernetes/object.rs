//! The pod as tongs reads it off the wire: only the fields the rules use.
//!
//! k8s-openapi's `Pod` deserializes every field of every pod — env, resources, probes, container
//! statuses, managedFields — into owned strings, which a list of thousands of pods pays for on every
//! re-list. [`WatchedPod`] names only what [`super::pods::PodFacts`] needs; serde skips the rest
//! without allocating it. It is still a complete resource for kube-rs (`Api<WatchedPod>`, the
//! watcher), with the `ObjectMeta` fields kube reads (name, namespace, uid, resourceVersion).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Deserializer};

/// A pod, as far as tongs cares.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct WatchedPod {
    #[serde(default, deserialize_with = "metadata")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<PodSpec>,
    #[serde(default)]
    pub status: Option<PodStatus>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct PodSpec {
    #[serde(default)]
    pub containers: Option<Vec<Container>>,
    #[serde(default)]
    pub tolerations: Option<Vec<Toleration>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Container {
    #[serde(default)]
    pub ports: Option<Vec<ContainerPort>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerPort {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub container_port: i32,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Toleration {
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub value: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(default)]
    pub phase: Option<String>,
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
    #[serde(default)]
    pub conditions: Option<Vec<PodCondition>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct PodCondition {
    #[serde(default, rename = "type")]
    pub type_: String,
    #[serde(default)]
    pub status: String,
}

/// The metadata fields tongs and kube-rs read (labels for the pools' selectors, matched on tongs' side
/// when pools share a watch); owner references and managedFields are skipped.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Metadata {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
}

fn metadata<'de, D: Deserializer<'de>>(deserializer: D) -> Result<ObjectMeta, D::Error> {
    let read = Metadata::deserialize(deserializer)?;
    Ok(ObjectMeta {
        name: read.name,
        namespace: read.namespace,
        uid: read.uid,
        resource_version: read.resource_version,
        labels: read.labels,
        annotations: read.annotations,
        deletion_timestamp: read.deletion_timestamp,
        ..ObjectMeta::default()
    })
}

impl k8s_openapi::Resource for WatchedPod {
    const API_VERSION: &'static str = "v1";
    const GROUP: &'static str = "";
    const KIND: &'static str = "Pod";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "pods";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for WatchedPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_the_rules_need_and_skips_the_rest() {
        let pod: WatchedPod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "llm-0", "namespace": "gpu", "uid": "u-1", "resourceVersion": "42",
                "labels": {"a": "b"}, "annotations": {"tongs.dev/port": "8000"},
                "deletionTimestamp": "2026-12-03T10:00:00Z",
                "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}]
            },
            "spec": {
                "containers": [{"name": "c", "image": "x", "env": [{"name": "A", "value": "1"}],
                                "ports": [{"name": "http", "containerPort": 8000}]}],
                "tolerations": [{"key": "virtual-kubelet.io/provider", "value": "saladcloud"}]
            },
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True", "lastProbeTime": null}],
                       "containerStatuses": [{"name": "c", "ready": true}]}
        }))
        .unwrap();
        use kube::Resource;
        assert_eq!(pod.meta().name.as_deref(), Some("llm-0"));
        assert_eq!(pod.meta().resource_version.as_deref(), Some("42"));
        assert!(pod.meta().deletion_timestamp.is_some());
        assert_eq!(pod.meta().labels.as_ref().unwrap()["a"], "b");
        assert!(pod.meta().managed_fields.is_none());
        let spec = pod.spec.unwrap();
        assert_eq!(
            spec.containers.unwrap()[0].ports.as_ref().unwrap()[0].container_port,
            8000
        );
        let status = pod.status.unwrap();
        assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(status.conditions.unwrap()[0].type_, "Ready");
        assert_eq!(<WatchedPod as Resource>::plural(&()), "pods");
    }
}

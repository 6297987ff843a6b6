//! The resources the fake serves (pods and EndpointSlices): their paths, kinds and indexed fields, and
//! a constructor for EndpointSlices as the EndpointSlice controller writes them.

use serde_json::{Value, json};

use super::selectors::POD_FIELDS;

/// A resource the fake serves. Objects of every resource share the one resourceVersion and history, as
/// they do in etcd; lists, watches and gets are scoped to one resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// `v1` `Pod`, at `/api/v1/.../pods`.
    Pods,
    /// `discovery.k8s.io/v1` `EndpointSlice`, at `/apis/discovery.k8s.io/v1/.../endpointslices`.
    EndpointSlices,
}

/// The fields the API server indexes for EndpointSlices (the generic ones only).
pub(crate) const ENDPOINT_SLICE_FIELDS: [&str; 2] = ["metadata.name", "metadata.namespace"];

impl Resource {
    pub const ALL: [Resource; 2] = [Resource::Pods, Resource::EndpointSlices];

    /// The `apiVersion` objects of this resource carry.
    pub fn api_version(self) -> &'static str {
        match self {
            Resource::Pods => "v1",
            Resource::EndpointSlices => "discovery.k8s.io/v1",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Resource::Pods => "Pod",
            Resource::EndpointSlices => "EndpointSlice",
        }
    }

    pub fn list_kind(self) -> &'static str {
        match self {
            Resource::Pods => "PodList",
            Resource::EndpointSlices => "EndpointSliceList",
        }
    }

    /// The plural name in paths.
    pub fn plural(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::EndpointSlices => "endpointslices",
        }
    }

    /// The API group ("" for the core group).
    pub fn group(self) -> &'static str {
        match self {
            Resource::Pods => "",
            Resource::EndpointSlices => "discovery.k8s.io",
        }
    }

    /// How `Status` messages name it: `pods`, `endpointslices.discovery.k8s.io`.
    pub fn qualified(self) -> String {
        match self.group() {
            "" => self.plural().to_owned(),
            group => format!("{}.{group}", self.plural()),
        }
    }

    /// The fields a field selector may name for this resource (any other is a 400).
    pub fn fields(self) -> &'static [&'static str] {
        match self {
            Resource::Pods => &POD_FIELDS,
            Resource::EndpointSlices => &ENDPOINT_SLICE_FIELDS,
        }
    }

    /// The resource of a path's segments before the namespace (`["api", "v1"]`,
    /// `["apis", "discovery.k8s.io", "v1"]`) and its plural, if the fake serves it.
    pub(super) fn of(prefix: &[&str], plural: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|resource| {
            resource.plural() == plural
                && match resource.group() {
                    "" => prefix == ["api", "v1"],
                    group => prefix == ["apis", group, "v1"],
                }
        })
    }

    /// The resource a request path is about (`/api/v1/pods`, `/apis/discovery.k8s.io/v1/namespaces/ns/
    /// endpointslices/x`, ...), if the fake serves it.
    pub fn of_path(path: &str) -> Option<Resource> {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        split_path(&segments).map(|(resource, ..)| resource)
    }
}

/// A path's segments as (resource, namespace, name): `PREFIX/plural`, `PREFIX/namespaces/ns/plural`,
/// `PREFIX/namespaces/ns/plural/name`.
pub(super) fn split_path<'a>(
    segments: &[&'a str],
) -> Option<(Resource, Option<&'a str>, Option<&'a str>)> {
    let prefix_len = match segments.first() {
        Some(&"api") => 2,
        Some(&"apis") => 3,
        _ => return None,
    };
    let (prefix, rest) = segments.split_at_checked(prefix_len)?;
    match rest {
        [plural] => Some((Resource::of(prefix, plural)?, None, None)),
        ["namespaces", namespace, plural] => {
            Some((Resource::of(prefix, plural)?, Some(namespace), None))
        }
        ["namespaces", namespace, plural, name] => {
            Some((Resource::of(prefix, plural)?, Some(namespace), Some(name)))
        }
        _ => None,
    }
}

/// An EndpointSlice of Service `service` as the EndpointSlice controller writes it: IPv4, one endpoint
/// per entry of `ready` (address `10.0.0.N` for the N-th, from 1; `ready` and `serving` as given,
/// `terminating` false; `targetRef` the Pod `{name}-{N-1}` in `namespace`), one TCP port `http` 8080,
/// and the labels `kubernetes.io/service-name: {service}` and the controller's `managed-by`.
pub fn endpoint_slice(namespace: &str, name: &str, service: &str, ready: &[bool]) -> Value {
    let endpoints: Vec<Value> = ready
        .iter()
        .enumerate()
        .map(|(index, &ready)| {
            json!({
                "addresses": [format!("10.0.0.{}", index + 1)],
                "conditions": {"ready": ready, "serving": ready, "terminating": false},
                "targetRef": {"kind": "Pod", "name": format!("{name}-{index}"), "namespace": namespace},
            })
        })
        .collect();
    json!({
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    })
}

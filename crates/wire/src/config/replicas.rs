//! `replicas`: the tongs replicas that share one fleet.
//!
//! Each replica balances on its own, so a node's fixed limit (`concurrency.limit: static`, a pod's
//! `tongs.dev/max-outstanding`) held by each of N replicas lets N times that many requests reach the
//! node. Naming tongs' own Service here lets each replica count the replicas that are ready (the
//! Service's EndpointSlices) and take its share of every fixed limit.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Problem;

/// Where a replica learns how many replicas share the fleet.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicasConfig {
    /// The Service in front of tongs' replicas. Its EndpointSlices count the ready replicas, and fixed
    /// limits are divided by that count (rounded up, at least 1). Empty: this replica counts as the
    /// only one.
    pub service: String,
    /// The Service's namespace: empty means tongs' own (the service account's).
    pub namespace: String,
    /// A kubeconfig file; unset means the pod's service account (in cluster) or `$KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
}

impl ReplicasConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem = |field: &str, message: String| {
            problems.push(Problem {
                field: format!("replicas.{field}"),
                message,
            })
        };
        if !self.service.is_empty() && !is_dns_label(&self.service) {
            problem(
                "service",
                format!(
                    "{:?} is not a Service name (lowercase letters, digits and '-', at most 63, \
                     starting with a letter)",
                    self.service
                ),
            );
        }
        if !self.namespace.is_empty() && !is_dns_label(&self.namespace) {
            problem(
                "namespace",
                format!(
                    "{:?} is not a namespace name (lowercase letters, digits and '-', at most 63)",
                    self.namespace
                ),
            );
        }
        if self.service.is_empty() && !self.namespace.is_empty() {
            problem(
                "namespace",
                "is set but replicas.service is empty: name the Service to count".into(),
            );
        }
        if self
            .kubeconfig
            .as_ref()
            .is_some_and(|path| path.as_os_str().is_empty())
        {
            problem("kubeconfig", "must not be empty (leave it unset)".into());
        }
    }
}

/// An RFC 1035 label, as Kubernetes requires of Service names (namespaces allow a leading digit).
fn is_dns_label(name: &str) -> bool {
    name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(config: ReplicasConfig) -> Vec<String> {
        let mut problems = Vec::new();
        config.validate(&mut problems);
        problems.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn names_every_bad_field() {
        assert!(problems(ReplicasConfig::default()).is_empty());
        assert!(
            problems(ReplicasConfig {
                service: "tongs".into(),
                namespace: "inference".into(),
                kubeconfig: None,
            })
            .is_empty()
        );
        let found = problems(ReplicasConfig {
            service: "Tongs_".into(),
            namespace: "-x".into(),
            kubeconfig: Some(PathBuf::new()),
        });
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found[0].starts_with("replicas.service: \"Tongs_\""));
        assert!(found[1].starts_with("replicas.namespace: \"-x\""));
        assert!(found[2].starts_with("replicas.kubeconfig:"));
        let found = problems(ReplicasConfig {
            namespace: "tongs".into(),
            ..ReplicasConfig::default()
        });
        assert_eq!(
            found,
            ["replicas.namespace: is set but replicas.service is empty: name the Service to count"]
        );
        assert!(!is_dns_label(&"a".repeat(64)));
        assert!(is_dns_label(&"a".repeat(63)));
    }
}

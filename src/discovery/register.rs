//! Node self-registration: `POST /v1/nodes/register` on the admin port.
//!
//! A GPU node that comes online reports the address it can be reached at (its Tailscale `IP:port`):
//!
//! ```json
//! {"namespace": "gpu", "pod": "llm-7d9f-abcde", "address": "100.101.102.103:8000"}
//! ```
//!
//! with `Authorization: Bearer <token>` (the Secret in `discovery.kubernetes.registration.token_file`,
//! compared in constant time). tongs checks that the pod is one it watches (so it exists and matches
//! the namespace and selectors), that the address is in the allowlist, and writes the pod's Tailscale
//! annotation. Every tongs replica then learns the address through its own pod watch: registration
//! keeps no state in tongs, and any replica may answer it.

use super::object::WatchedPod;
use http::StatusCode;
use kube::api::{Api, Patch, PatchParams};
use serde::Deserialize;

use super::Status;
use super::pods::parse_address;

/// Largest registration body accepted.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// What a node sends.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub namespace: String,
    pub pod: String,
    pub address: String,
}

/// The answer: a status and a JSON body saying what happened.
pub struct Answer {
    pub status: StatusCode,
    pub body: serde_json::Value,
}

fn answer(status: StatusCode, result: &'static str, detail: String, counted: &Status) -> Answer {
    counted.registration(result);
    if status.is_success() {
        tracing::info!(result, "{detail}");
    } else {
        tracing::warn!(
            result,
            status = status.as_u16(),
            "node registration refused: {detail}"
        );
    }
    Answer {
        status,
        body: serde_json::json!({ "result": result, "detail": detail }),
    }
}

/// Whether `given` is the expected token, in time that does not depend on where they differ.
pub fn token_matches(given: &str, expected: &str) -> bool {
    let (a, b) = (given.trim().as_bytes(), expected.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Handles one registration. `authorization` is the request's `Authorization` header.
pub async fn register(
    status: &Status,
    token: Option<&str>,
    authorization: Option<&str>,
    body: &[u8],
) -> Answer {
    let Some(token) = token else {
        return answer(
            StatusCode::NOT_FOUND,
            "failed",
            "registration is off (discovery.kubernetes.registration.token_file is unset)".into(),
            status,
        );
    };
    let given = authorization.and_then(|v| v.strip_prefix("Bearer "));
    if !given.is_some_and(|given| token_matches(given, token)) {
        return answer(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong Authorization: Bearer token".into(),
            status,
        );
    }
    let registration: Registration = match serde_json::from_slice(body) {
        Ok(registration) => registration,
        Err(err) => {
            return answer(
                StatusCode::BAD_REQUEST,
                "bad-request",
                format!(
                    "body must be JSON {{\"namespace\", \"pod\", \"address\": \"IP:port\"}}: {err}"
                ),
                status,
            );
        }
    };
    let address = match parse_address(registration.address.trim()) {
        Ok(address) => address,
        Err(message) => {
            return answer(
                StatusCode::BAD_REQUEST,
                "bad-request",
                format!("address: {message}"),
                status,
            );
        }
    };
    let Some(watched) = status.watched() else {
        return answer(
            StatusCode::SERVICE_UNAVAILABLE,
            "failed",
            "Kubernetes discovery is not running".into(),
            status,
        );
    };
    let key = format!("{}/{}", registration.namespace, registration.pod);
    let current = {
        let tracker = watched.tracker();
        match tracker.pod(&key) {
            Some(pod) => pod
                .annotations
                .get(&watched.rules.config().annotations.tailscale_address)
                .cloned(),
            None => {
                drop(tracker);
                return answer(
                    StatusCode::NOT_FOUND,
                    "unknown-pod",
                    format!(
                        "pod {key} is not among the pods tongs watches (namespace, label and field selectors)"
                    ),
                    status,
                );
            }
        }
    };
    if !watched.rules.allows_address(address) {
        return answer(
            StatusCode::FORBIDDEN,
            "not-allowed",
            format!("pod {key}: address {address} is not in discovery.kubernetes.allow"),
            status,
        );
    }
    let value = address.to_string();
    if current.as_deref() == Some(value.as_str()) {
        return answer(
            StatusCode::OK,
            "unchanged",
            format!("pod {key} already registered at {value}"),
            status,
        );
    }
    let annotation = watched.rules.config().annotations.tailscale_address.clone();
    let api: Api<WatchedPod> = Api::namespaced(watched.client.clone(), &registration.namespace);
    let patch = serde_json::json!({ "metadata": { "annotations": { annotation: value } } });
    match api
        .patch(
            &registration.pod,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => answer(
            StatusCode::OK,
            "registered",
            format!("pod {key} registered at {address}"),
            status,
        ),
        Err(kube::Error::Api(err)) if err.code == 404 => answer(
            StatusCode::NOT_FOUND,
            "unknown-pod",
            format!("pod {key} no longer exists"),
            status,
        ),
        Err(err) => answer(
            StatusCode::BAD_GATEWAY,
            "failed",
            format!("cannot annotate pod {key}: {err}"),
            status,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_exactly() {
        assert!(token_matches("s3cret", "s3cret"));
        assert!(token_matches(" s3cret\n", "s3cret"));
        assert!(!token_matches("s3cre", "s3cret"));
        assert!(!token_matches("s3creT", "s3cret"));
        assert!(!token_matches("", "s3cret"));
    }

    #[tokio::test]
    async fn refusals_before_any_api_call() {
        let status = Status::default();
        let off = register(&status, None, Some("Bearer x"), b"{}").await;
        assert_eq!(off.status, StatusCode::NOT_FOUND);
        let wrong = register(&status, Some("t"), Some("Bearer u"), b"{}").await;
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
        let missing = register(&status, Some("t"), None, b"{}").await;
        assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
        let malformed = register(&status, Some("t"), Some("Bearer t"), b"{\"pod\":1}").await;
        assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
        let bad_address = register(
            &status,
            Some("t"),
            Some("Bearer t"),
            br#"{"namespace":"gpu","pod":"a","address":"100.64.0.1"}"#,
        )
        .await;
        assert_eq!(bad_address.status, StatusCode::BAD_REQUEST);
        assert!(
            bad_address.body["detail"]
                .as_str()
                .unwrap()
                .contains("IP:port")
        );
        let not_running = register(
            &status,
            Some("t"),
            Some("Bearer t"),
            br#"{"namespace":"gpu","pod":"a","address":"100.64.0.1:8000"}"#,
        )
        .await;
        assert_eq!(not_running.status, StatusCode::SERVICE_UNAVAILABLE);
        let counted: Vec<_> = status.registrations().filter(|(_, n)| *n > 0).collect();
        assert_eq!(
            counted,
            [("unauthorized", 2), ("bad-request", 2), ("failed", 2)]
        );
    }
}

//! Node self-registration, `POST /v1/nodes/register` on the admin port, and a node's notice that it is
//! going, `POST /v1/nodes/drain` ([`drain`]), authenticated the same way.
//!
//! A GPU node that comes online reports the address it can be reached at (its Tailscale `IP:port`):
//!
//! ```json
//! {"namespace": "gpu", "pod": "llm-7d9f-abcde", "uid": "4b1e0f6e-...", "address": "100.101.102.103:8000"}
//! ```
//!
//! with `Authorization: Bearer <token>`. tongs checks that the pod is one it watches (so it exists and
//! matches the namespace and selectors), that `uid` is that pod's, that the address is in the allowlist
//! and that no other rule gives the pod an address, and writes the pod's Tailscale annotation. Every
//! tongs replica then learns the address through its own pod watch: registration keeps no state in
//! tongs, and any replica may answer it.
//!
//! # Who may register what
//!
//! A registration is tied to its caller by two proofs, each compared in constant time:
//!
//! - **the fleet's token** (the Secret in `discovery.kubernetes.registration.token_file`): every node
//!   holds the same one. It keeps out whoever is not a node, and nothing more: alone it registers
//!   nothing.
//! - **the pod's `metadata.uid`**: the API server draws it at random (a version-4 UUID) when it creates
//!   the pod, and a node learns its own one — on SaladCloud from `POD_METADATA_YAML`, the pod's metadata
//!   as JSON that the Virtual Kubelet passes to the container; on interLink from an environment variable
//!   with `valueFrom.fieldRef.fieldPath: metadata.uid`, which interLink resolves — and never another
//!   pod's: a SaladCloud or interLink node has no credentials for the Kubernetes API, and tongs tells
//!   nodes nothing about other pods.
//!
//! So a node whose container an attacker controls can register **its own pod only** (at any address
//! the allowlist admits: traffic it would receive anyway), and only while that pod has no other address
//! (below); it cannot register another pod (its UID is unknown to the node, and guessing 122 random
//! bits is hopeless), and a pod replaced under the same name has a new UID, so the old node's
//! registrations stop working. Who *can* register a pod: whoever holds the fleet's token **and** can
//! read that pod's UID — besides the node, anyone allowed to `get` the pod or its events (and, on
//! SaladCloud, anyone who can read the container group's environment in the SaladCloud project).
//! On SaladCloud the token itself is a literal environment variable of the pod spec (the Virtual
//! Kubelet resolves no `valueFrom`), so reading pods is enough there: grant it to no one you would not
//! let annotate pods. The admin port answers in plain HTTP: reach it through the tailnet.
//!
//! Why not the alternatives the design started from. A per-pod token (an HMAC of `namespace/pod` under
//! a key only tongs holds) needs a channel that gives each pod its own token: on SaladCloud that is only
//! a literal environment variable of the pod spec, which the pod's creator must compute — impossible
//! for the replicas of a Deployment, whose names the API server picks — and anyone who can read the pod
//! reads it, exactly as they read the UID. A TokenReview of the pod's service-account token would bind
//! the pod best, but the SaladCloud Virtual Kubelet mounts no volumes (no service-account token at all),
//! and interLink projects one only with its projected volumes enabled (its installer disables them by
//! default). The UID is what every node has, on both, with no work for the operator.
//!
//! # What a registration may change
//!
//! Only the Tailscale annotation of a pod that no other rule gives an address: a pod with a podIP
//! (`pod-ip`), a gateway the SaladCloud API named (`salad-api`) or a url annotation the allowlist
//! admits (`url`) is refused with 409 `has-address`, and with registration on, `tailscale` must come
//! last in `discovery.kubernetes.rules` (config validation), so an address the API server or the
//! SaladCloud API gives later still takes precedence over a registered one. The merge patch carries
//! the UID as a precondition, so it cannot land on a pod that replaced the one tongs checked.

use std::sync::Arc;

use http::StatusCode;
use kube::api::{Api, Patch, PatchParams};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use subtle::ConstantTimeEq;

use super::Status;
use super::kube::{Tracker, Watched};
use super::object::WatchedPod;
use super::pods::PodFacts;
use crate::config::parse_address;

/// Largest registration body accepted.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// What a node sends.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub namespace: String,
    pub pod: String,
    /// The pod's `metadata.uid`: the proof that the caller runs as this pod.
    pub uid: String,
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

/// Whether `given` (surrounding whitespace ignored) is `expected`, in time that does not depend on
/// where they differ.
pub fn secret_matches(given: &str, expected: &str) -> bool {
    bool::from(given.trim().as_bytes().ct_eq(expected.as_bytes()))
}

/// The caller holds the fleet's token (`authorization` is its `Authorization` header); else the
/// refusal.
fn check_token(
    status: &Status,
    token: Option<&str>,
    authorization: Option<&str>,
) -> Result<(), Answer> {
    let Some(token) = token else {
        return Err(answer(
            StatusCode::NOT_FOUND,
            "failed",
            "node calls are off (discovery.kubernetes.registration.token_file is unset)".into(),
            status,
        ));
    };
    let given = authorization.and_then(|v| v.strip_prefix("Bearer "));
    if !given.is_some_and(|given| secret_matches(given, token)) {
        return Err(answer(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong Authorization: Bearer token".into(),
            status,
        ));
    }
    Ok(())
}

/// A node's JSON body, or the refusal saying what it must hold (`shape`).
fn parse<T: DeserializeOwned>(status: &Status, body: &[u8], shape: &str) -> Result<T, Answer> {
    serde_json::from_slice(body).map_err(|err| {
        answer(
            StatusCode::BAD_REQUEST,
            "bad-request",
            format!("body must be JSON {shape}: {err}"),
            status,
        )
    })
}

/// The pod a node's call names, once it proved it runs as that pod: its key, its UID, and what `read`
/// takes from its facts; else the refusal.
fn own_pod<R>(
    status: &Status,
    watched: &Watched,
    (namespace, pod, uid): (&str, &str, &str),
    read: impl FnOnce(&PodFacts, &Tracker) -> R,
) -> Result<(String, String, R), Answer> {
    let key = format!("{namespace}/{pod}");
    let tracker = watched.tracker();
    let Some(facts) = tracker.pod(&key) else {
        drop(tracker);
        return Err(answer(
            StatusCode::NOT_FOUND,
            "unknown-pod",
            format!(
                "pod {key} is not among the pods tongs watches (namespace, label and field selectors)"
            ),
            status,
        ));
    };
    // An empty UID (a pod object without one) matches nothing.
    if facts.uid.is_empty() || !secret_matches(uid, &facts.uid) {
        drop(tracker);
        return Err(answer(
            StatusCode::FORBIDDEN,
            "wrong-uid",
            format!(
                "uid is not pod {key}'s metadata.uid: a node speaks for its own pod only (or the \
                 pod was replaced since the node started)"
            ),
            status,
        ));
    }
    let read = read(facts, &tracker);
    let uid = facts.uid.clone();
    Ok((key, uid, read))
}

/// Writes `annotations` on the pod `namespace/pod` (`key`), only if its UID is still `uid`: the UID
/// makes the merge patch conditional, so it never lands on a pod that replaced the one the node
/// proved. `done` is the answer when it is written.
async fn annotate(
    status: &Status,
    watched: &Watched,
    (namespace, pod, key, uid): (&str, &str, &str, &str),
    annotations: serde_json::Value,
    done: (&'static str, String),
) -> Answer {
    let api: Api<WatchedPod> = Api::namespaced(watched.client.clone(), namespace);
    let patch = serde_json::json!({ "metadata": { "uid": uid, "annotations": annotations } });
    match api
        .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => answer(StatusCode::OK, done.0, done.1, status),
        Err(kube::Error::Api(err)) if err.code == 404 => answer(
            StatusCode::NOT_FOUND,
            "unknown-pod",
            format!("pod {key} no longer exists"),
            status,
        ),
        Err(kube::Error::Api(err)) if err.code == 409 => answer(
            StatusCode::FORBIDDEN,
            "wrong-uid",
            format!("pod {key} was replaced (its uid changed): {}", err.message),
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

/// Kubernetes discovery's watch, or the refusal when it is not running.
fn watching(status: &Status) -> Result<Arc<Watched>, Answer> {
    status.watched().ok_or_else(|| {
        answer(
            StatusCode::SERVICE_UNAVAILABLE,
            "failed",
            "Kubernetes discovery is not running".into(),
            status,
        )
    })
}

/// Handles one registration. `authorization` is the request's `Authorization` header.
pub async fn register(
    status: &Status,
    token: Option<&str>,
    authorization: Option<&str>,
    body: &[u8],
) -> Answer {
    if let Err(refusal) = check_token(status, token, authorization) {
        return refusal;
    }
    registered(status, body).await.unwrap_or_else(|refusal| refusal)
}

async fn registered(status: &Status, body: &[u8]) -> Result<Answer, Answer> {
    let registration: Registration = parse(
        status,
        body,
        "{\"namespace\", \"pod\", \"uid\" (the pod's metadata.uid), \"address\": \"IP:port\"}",
    )?;
    let address = parse_address(registration.address.trim()).map_err(|message| {
        answer(
            StatusCode::BAD_REQUEST,
            "bad-request",
            format!("address: {message}"),
            status,
        )
    })?;
    let watched = watching(status)?;
    let annotation = watched.rules.config().annotations.tailscale_address.clone();
    let names = (
        registration.namespace.as_str(),
        registration.pod.as_str(),
        registration.uid.as_str(),
    );
    let (key, uid, (current, other)) = own_pod(status, &watched, names, |pod, tracker| {
        (
            pod.annotations.get(&annotation).cloned(),
            watched.rules.other_source(pod, tracker.gateway(&pod.uid)),
        )
    })?;
    if !watched.rules.allows_address(address) {
        return Err(answer(
            StatusCode::FORBIDDEN,
            "not-allowed",
            format!("pod {key}: address {address} is not in discovery.kubernetes.allow"),
            status,
        ));
    }
    if let Some(rule) = other {
        return Err(answer(
            StatusCode::CONFLICT,
            "has-address",
            format!(
                "pod {key} has an address from the {} rule; a registration only fills the Tailscale \
                 address of a pod with no other",
                rule.name()
            ),
            status,
        ));
    }
    let value = address.to_string();
    if current.as_deref() == Some(value.as_str()) {
        return Ok(answer(
            StatusCode::OK,
            "unchanged",
            format!("pod {key} already registered at {value}"),
            status,
        ));
    }
    let target = (names.0, names.1, key.as_str(), uid.as_str());
    let done = ("registered", format!("pod {key} registered at {address}"));
    Ok(annotate(status, &watched, target, serde_json::json!({ annotation: value }), done).await)
}

/// What a node sends when it is going (SIGTERM, a batch job near its wall-clock limit, a spot notice).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Going {
    pub namespace: String,
    pub pod: String,
    /// The pod's `metadata.uid`, as for a registration.
    pub uid: String,
    /// How long it has left, seconds (none: it does not know; its streams move at once).
    #[serde(default)]
    pub seconds: Option<f64>,
}

/// Handles one drain notice (`POST /v1/nodes/drain`), authenticated as a registration is: the pod's
/// drain annotation (`discovery.kubernetes.annotations.drain`) is set to when it goes (now plus
/// `seconds`, RFC 3339), which every tongs replica reads through its own pod watch: the pod stops
/// serving, its endpoint drains, and its streams that can be continued move before then. A node may
/// drain its own pod only, which takes traffic away from it and sends none anywhere.
pub async fn drain(
    status: &Status,
    token: Option<&str>,
    authorization: Option<&str>,
    body: &[u8],
) -> Answer {
    if let Err(refusal) = check_token(status, token, authorization) {
        return refusal;
    }
    drained(status, body).await.unwrap_or_else(|refusal| refusal)
}

async fn drained(status: &Status, body: &[u8]) -> Result<Answer, Answer> {
    let going: Going = parse(
        status,
        body,
        "{\"namespace\", \"pod\", \"uid\" (the pod's metadata.uid), \"seconds\" (left, optional)}",
    )?;
    let seconds = going.seconds.unwrap_or(0.0);
    let max = tongs_wire::header::MAX_DRAIN_NOTICE.as_secs_f64();
    if !(0.0..=max).contains(&seconds) {
        return Err(answer(
            StatusCode::BAD_REQUEST,
            "bad-request",
            format!("seconds must be a number from 0 to {max}, got {seconds}"),
            status,
        ));
    }
    let watched = watching(status)?;
    let annotation = watched.rules.config().annotations.drain.clone();
    let names = (
        going.namespace.as_str(),
        going.pod.as_str(),
        going.uid.as_str(),
    );
    let (key, uid, ()) = own_pod(status, &watched, names, |_, _| ())?;
    use k8s_openapi::jiff::{SignedDuration, Timestamp, Unit};
    let at = Timestamp::now()
        .checked_add(SignedDuration::from_secs_f64(seconds))
        .unwrap_or(Timestamp::MAX);
    let value = at.round(Unit::Second).unwrap_or(at).to_string();
    let target = (names.0, names.1, key.as_str(), uid.as_str());
    let done = ("draining", format!("pod {key} drains; it goes at {value}"));
    Ok(annotate(status, &watched, target, serde_json::json!({ annotation: value }), done).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_exactly() {
        assert!(secret_matches("s3cret", "s3cret"));
        assert!(secret_matches(" s3cret\n", "s3cret"));
        assert!(!secret_matches("s3cre", "s3cret"));
        assert!(!secret_matches("s3creT", "s3cret"));
        assert!(!secret_matches("s3crett", "s3cret"));
        assert!(!secret_matches("", "s3cret"));
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
        // The old body, without the pod's UID, is refused and says what is missing.
        let no_uid = register(
            &status,
            Some("t"),
            Some("Bearer t"),
            br#"{"namespace":"gpu","pod":"a","address":"100.64.0.1:8000"}"#,
        )
        .await;
        assert_eq!(no_uid.status, StatusCode::BAD_REQUEST);
        let detail = no_uid.body["detail"].as_str().unwrap();
        assert!(
            detail.contains("uid") && detail.contains("metadata.uid"),
            "{detail}"
        );
        let bad_address = register(
            &status,
            Some("t"),
            Some("Bearer t"),
            br#"{"namespace":"gpu","pod":"a","uid":"u","address":"100.64.0.1"}"#,
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
            br#"{"namespace":"gpu","pod":"a","uid":"u","address":"100.64.0.1:8000"}"#,
        )
        .await;
        assert_eq!(not_running.status, StatusCode::SERVICE_UNAVAILABLE);
        let counted: Vec<_> = status.registrations().filter(|(_, n)| *n > 0).collect();
        assert_eq!(
            counted,
            [("unauthorized", 2), ("bad-request", 3), ("failed", 2)]
        );
    }
}

//! One pod: `PATCH` it with a JSON merge patch (recorded, preconditions checked, status
//! ignored, spec immutable).

use http::{HeaderMap, Response, StatusCode, header};
use serde_json::{Map, Value};

use super::cluster::{ChangeKind, Cluster, keep_server_fields, text};
use super::resource::Resource;
use super::server::{ApiBody, Query, bad_request, check_params, failure, json_response, not_found};
use super::{PatchRecord, Shared};

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(changes) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(fields) = target {
        for (key, value) in changes {
            if value.is_null() {
                fields.remove(key);
            } else {
                merge_patch(fields.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

pub(super) fn patch_pod(
    shared: &Shared,
    namespace: &str,
    name: &str,
    query: &Query,
    headers: &HeaderMap,
    body: &[u8],
) -> Response<ApiBody> {
    let mut cluster = shared.cluster();
    cluster.stats.patch_requests += 1;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let parsed: Result<Value, _> = serde_json::from_slice(body);
    let mut record = PatchRecord {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        content_type: content_type.clone(),
        field_manager: query.get("fieldManager").map(str::to_owned),
        body: parsed
            .as_ref()
            .cloned()
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned())),
        status: 0,
    };
    let response = patch_answer(&mut cluster, namespace, name, query, &content_type, parsed);
    record.status = response.status().as_u16();
    cluster.patches.push(record);
    response
}

fn patch_answer(
    cluster: &mut Cluster,
    namespace: &str,
    name: &str,
    query: &Query,
    content_type: &str,
    parsed: Result<Value, serde_json::Error>,
) -> Response<ApiBody> {
    const KNOWN: [&str; 4] = ["fieldManager", "dryRun", "fieldValidation", "pretty"];
    if let Some(refused) = check_params(cluster, "patch", query, &KNOWN) {
        return refused;
    }
    let media_type = content_type.split(';').next().unwrap_or("").trim();
    let strategic = match media_type {
        "application/merge-patch+json" => false,
        "application/strategic-merge-patch+json" => true,
        other => {
            cluster.unexpected(format!("PATCH with Content-Type {other:?}"));
            return failure(
                415,
                "UnsupportedMediaType",
                &format!("the fake does not implement {other:?} patches"),
                None,
            );
        }
    };
    let dry_run = match query.get("dryRun") {
        None => false,
        Some("All") => true,
        Some(other) => return bad_request(&format!("dryRun: unsupported value {other:?}")),
    };
    let patch = match parsed {
        Ok(patch @ Value::Object(_)) => patch,
        Ok(other) => {
            return bad_request(&format!("error decoding patch: not a JSON object: {other}"));
        }
        Err(err) => return bad_request(&format!("error decoding patch: {err}")),
    };
    if strategic
        && patch
            .as_object()
            .is_some_and(|p| p.keys().any(|k| k != "metadata"))
    {
        cluster.unexpected("strategic merge patch beyond metadata".into());
        return failure(
            415,
            "UnsupportedMediaType",
            "the fake applies strategic merge patches to metadata only",
            None,
        );
    }
    if patch.get("metadata").is_some_and(|m| !m.is_object()) {
        return bad_request("error decoding patch: metadata must be an object");
    }
    let Some(before) = cluster.pod(namespace, name) else {
        return not_found(Resource::Pods, name);
    };
    let wanted = |field: &str| patch.get("metadata").and_then(|m| m.get(field));
    for field in ["name", "namespace"] {
        if let Some(value) = wanted(field)
            && value.as_str() != Some(text(&before, &["metadata", field]))
        {
            return bad_request(&format!(
                "the {field} of the object ({value}) does not match the {field} on the URL"
            ));
        }
    }
    if let Some(version) = wanted("resourceVersion")
        && version.as_str() != Some(text(&before, &["metadata", "resourceVersion"]))
    {
        return failure(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on pods \"{name}\": the object has been modified; \
                 please apply your changes to the latest version and try again"
            ),
            Some(name),
        );
    }
    if let Some(uid) = wanted("uid")
        && uid.as_str() != Some(text(&before, &["metadata", "uid"]))
    {
        return failure(
            409,
            "Conflict",
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                text(&before, &["metadata", "uid"])
            ),
            Some(name),
        );
    }
    let mut after = before.clone();
    merge_patch(&mut after, &patch);
    // status is a subresource: the main resource ignores changes to it.
    match before.get("status") {
        Some(status) => after["status"] = status.clone(),
        None => {
            if let Some(object) = after.as_object_mut() {
                object.remove("status");
            }
        }
    }
    if after.get("spec") != before.get("spec") {
        return failure(
            422,
            "Invalid",
            &format!(
                "Pod \"{name}\" is invalid: spec: Forbidden: pod updates may not change fields other than \
                 `spec.containers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` (the fake allows none)"
            ),
            Some(name),
        );
    }
    keep_server_fields(&before, &mut after);
    if after == before || dry_run {
        return json_response(StatusCode::OK, &after);
    }
    cluster.commit(Resource::Pods, ChangeKind::Modified, Some(before), after);
    let stored = cluster.pod(namespace, name).unwrap_or(Value::Null);
    json_response(StatusCode::OK, &stored)
}

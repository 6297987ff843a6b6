//! Collections: list (selectors, pages, resourceVersion) and watch (resume from the history, 410,
//! bookmarks, timeout) of one resource.

use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::cluster::{Cluster, Scope, Snapshot, Watch, WatchFrame, event_for, event_line};
use super::resource::Resource;
use super::selectors::{FieldSelector, LabelSelector};
use super::server::{
    ApiBody, BoxError, Query, bad_request, check_params, failure, json_response, status_object,
};
use super::{DEFAULT_WATCH_TIMEOUT, KEPT_SNAPSHOTS, Shared};

/// `GET` of a collection: a list, or a watch with `watch=true`.
pub(super) fn collection(
    shared: &Shared,
    resource: Resource,
    namespace: Option<&str>,
    query: &Query,
) -> Response<ApiBody> {
    let watching = match query.get("watch") {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") => true,
        Some(other) => return bad_request(&format!("watch: invalid value {other:?}")),
    };
    let mut cluster = shared.cluster();
    if watching {
        watch(&mut cluster, resource, namespace, query)
    } else {
        list(&mut cluster, resource, namespace, query)
    }
}

fn scope(resource: Resource, namespace: Option<&str>, query: &Query) -> Result<Scope, String> {
    Ok(Scope {
        resource,
        namespace: namespace.map(str::to_owned),
        labels: LabelSelector::parse(query.get("labelSelector").unwrap_or(""))?,
        fields: FieldSelector::parse_for(
            query.get("fieldSelector").unwrap_or(""),
            resource.fields(),
        )?,
    })
}

/// A list item: list responses carry `kind` and `apiVersion` once, on the list.
fn list_item(object: &Value) -> Value {
    let mut item = object.clone();
    if let Some(object) = item.as_object_mut() {
        object.remove("kind");
        object.remove("apiVersion");
    }
    item
}

fn list(
    cluster: &mut Cluster,
    resource: Resource,
    namespace: Option<&str>,
    query: &Query,
) -> Response<ApiBody> {
    const KNOWN: [&str; 9] = [
        "watch",
        "labelSelector",
        "fieldSelector",
        "limit",
        "continue",
        "resourceVersion",
        "resourceVersionMatch",
        "timeoutSeconds",
        "pretty",
    ];
    cluster.stats.list_requests += 1;
    let token = query.get("continue").filter(|t| !t.is_empty());
    if token.is_none() {
        cluster.stats.lists_started += 1;
    }
    if let Some(refused) = check_params(cluster, "list", query, &KNOWN) {
        return refused;
    }
    if cluster.lists_to_fail > 0 {
        cluster.lists_to_fail -= 1;
        cluster.stats.lists_failed += 1;
        return failure(
            500,
            "InternalError",
            "Internal error occurred: the fake fails this list (test control)",
            None,
        );
    }
    let scope = match scope(resource, namespace, query) {
        Ok(scope) => scope,
        Err(message) => return bad_request(&message),
    };
    let limit = match query.get("limit").map(str::parse::<usize>) {
        None => 0,
        Some(Ok(limit)) => limit,
        Some(Err(_)) => return bad_request("limit: must be a non-negative integer"),
    };
    let version = query.get("resourceVersion").filter(|v| !v.is_empty());
    let version_match = query.get("resourceVersionMatch").filter(|v| !v.is_empty());
    let (resource_version, items, offset, snapshot_id) = match token {
        Some(token) => {
            if version.is_some() {
                return bad_request(
                    "specifying resource version is not allowed when using continue",
                );
            }
            let Some((id, offset)) = token.split_once(':').and_then(|(id, offset)| {
                Some((id.parse::<u64>().ok()?, offset.parse::<usize>().ok()?))
            }) else {
                return bad_request(&format!("continue key is not valid: {token:?}"));
            };
            let Some(snapshot) = cluster.snapshots.iter().find(|s| s.id == id) else {
                return failure(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. \
                     You can start a new list without the continue parameter.",
                    None,
                );
            };
            if snapshot.scope != scope {
                return bad_request(
                    "continue key was issued for a different namespace or selector",
                );
            }
            (
                snapshot.resource_version,
                Arc::clone(&snapshot.items),
                offset,
                Some(id),
            )
        }
        None => {
            if version.is_none() && version_match.is_some() {
                return bad_request(
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                );
            }
            if let Some(version) = version {
                let Ok(asked) = version.parse::<u64>() else {
                    return bad_request(&format!("resourceVersion: invalid value {version:?}"));
                };
                match version_match {
                    None | Some("NotOlderThan") if asked > cluster.resource_version => {
                        return failure(
                            504,
                            "Timeout",
                            &format!(
                                "Too large resource version: {asked}, current: {}",
                                cluster.resource_version
                            ),
                            None,
                        );
                    }
                    None | Some("NotOlderThan") => {}
                    Some("Exact") if asked == cluster.resource_version => {}
                    Some("Exact") => {
                        cluster.unexpected(format!(
                            "list at exact resourceVersion {asked} (the fake keeps the current state only)"
                        ));
                        return failure(
                            410,
                            "Expired",
                            &format!(
                                "too old resource version: {asked} ({})",
                                cluster.resource_version
                            ),
                            None,
                        );
                    }
                    Some(other) => {
                        return bad_request(&format!(
                            "resourceVersionMatch: unsupported value {other:?}"
                        ));
                    }
                }
            }
            let items: Vec<Value> = cluster
                .objects_of(resource)
                .filter(|object| scope.matches(object))
                .map(list_item)
                .collect();
            (cluster.resource_version, Arc::new(items), 0, None)
        }
    };
    let end = if limit == 0 {
        items.len()
    } else {
        offset.saturating_add(limit).min(items.len())
    };
    let page: Vec<Value> = items.get(offset.min(end)..end).unwrap_or_default().to_vec();
    let mut metadata = Map::new();
    metadata.insert(
        "resourceVersion".into(),
        json!(resource_version.to_string()),
    );
    if end < items.len() {
        let id = match snapshot_id {
            Some(id) => id,
            None => {
                let id = cluster.next_id;
                cluster.next_id += 1;
                cluster.snapshots.push_back(Snapshot {
                    id,
                    resource_version,
                    scope,
                    items: Arc::clone(&items),
                });
                while cluster.snapshots.len() > KEPT_SNAPSHOTS {
                    cluster.snapshots.pop_front();
                }
                id
            }
        };
        metadata.insert("continue".into(), json!(format!("{id}:{end}")));
        metadata.insert("remainingItemCount".into(), json!(items.len() - end));
    }
    json_response(
        StatusCode::OK,
        &json!({
            "kind": resource.list_kind(), "apiVersion": resource.api_version(),
            "metadata": metadata, "items": page,
        }),
    )
}

fn watch(
    cluster: &mut Cluster,
    resource: Resource,
    namespace: Option<&str>,
    query: &Query,
) -> Response<ApiBody> {
    const KNOWN: [&str; 8] = [
        "watch",
        "labelSelector",
        "fieldSelector",
        "resourceVersion",
        "resourceVersionMatch",
        "timeoutSeconds",
        "allowWatchBookmarks",
        "sendInitialEvents",
    ];
    cluster.stats.watch_requests += 1;
    if let Some(refused) = check_params(cluster, "watch", query, &KNOWN) {
        return refused;
    }
    if query.get("sendInitialEvents").is_some() {
        let message = "sendInitialEvents (streaming lists) is not implemented by the fake";
        cluster.unexpected(message.into());
        return bad_request(message);
    }
    if query.get("resourceVersionMatch").is_some() {
        return bad_request(
            "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        );
    }
    let scope = match scope(resource, namespace, query) {
        Ok(scope) => scope,
        Err(message) => return bad_request(&message),
    };
    let timeout = match query.get("timeoutSeconds").map(str::parse::<u64>) {
        None => DEFAULT_WATCH_TIMEOUT,
        Some(Ok(seconds)) => Duration::from_secs(seconds),
        Some(Err(_)) => return bad_request("timeoutSeconds: must be a non-negative integer"),
    };
    let bookmarks = match query.get("allowWatchBookmarks") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return bad_request(&format!("allowWatchBookmarks: invalid value {other:?}"));
        }
    };
    let (sender, receiver) = mpsc::unbounded_channel();
    let expired = |cluster: &mut Cluster, message: String| {
        cluster.stats.watches_expired += 1;
        let status = status_object(410, "Expired", &message, None);
        let (sender, receiver) = mpsc::unbounded_channel();
        let _ = sender.send(WatchFrame::Line(event_line("ERROR", &status)));
        // The sender is dropped here: the stream ends after the one event, as the server's does.
        watch_response(receiver, timeout)
    };
    if cluster.watches_to_expire > 0 {
        cluster.watches_to_expire -= 1;
        let message = format!(
            "too old resource version: {} ({})",
            query.get("resourceVersion").unwrap_or(""),
            cluster.resource_version
        );
        return expired(cluster, message);
    }
    match query
        .get("resourceVersion")
        .filter(|v| !v.is_empty() && *v != "0")
    {
        None => {
            // Start at the most recent state, with synthetic ADDED events for what exists.
            for object in cluster
                .objects_of(resource)
                .filter(|object| scope.matches(object))
            {
                let _ = sender.send(WatchFrame::Line(event_line("ADDED", object)));
            }
        }
        Some(version) => {
            let Ok(from) = version.parse::<u64>() else {
                return bad_request(&format!("resourceVersion: invalid value {version:?}"));
            };
            if from < cluster.compacted {
                let message = format!("too old resource version: {from} ({})", cluster.compacted);
                return expired(cluster, message);
            }
            if from > cluster.resource_version {
                cluster.unexpected(format!(
                    "watch from resourceVersion {from}, newer than the current {}",
                    cluster.resource_version
                ));
                let status = status_object(
                    504,
                    "Timeout",
                    &format!(
                        "Too large resource version: {from}, current: {}",
                        cluster.resource_version
                    ),
                    None,
                );
                let _ = sender.send(WatchFrame::Line(event_line("ERROR", &status)));
                return watch_response(receiver, timeout);
            }
            for change in cluster.history.iter().filter(|c| c.resource_version > from) {
                if let Some(line) = event_for(&scope, change) {
                    let _ = sender.send(WatchFrame::Line(line));
                }
            }
        }
    }
    cluster.watches.push(Watch {
        scope,
        bookmarks,
        sender,
    });
    watch_response(receiver, timeout)
}

/// A chunked stream of the watch's lines, until the sender goes (clean end), an abort (cut), or the
/// timeout (clean end).
fn watch_response(
    receiver: mpsc::UnboundedReceiver<WatchFrame>,
    timeout: Duration,
) -> Response<ApiBody> {
    let deadline = tokio::time::Instant::now() + timeout;
    let lines = futures::stream::unfold(Some(receiver), move |receiver| async move {
        let mut receiver = receiver?;
        tokio::select! {
            frame = receiver.recv() => match frame {
                Some(WatchFrame::Line(line)) => Some((Ok(Frame::data(line)), Some(receiver))),
                Some(WatchFrame::Abort) => {
                    let cut: BoxError = "watch connection cut (test control)".into();
                    Some((Err(cut), None))
                }
                None => None,
            },
            () = tokio::time::sleep_until(deadline) => None,
        }
    });
    let mut response = Response::new(BodyExt::boxed_unsync(StreamBody::new(lines)));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

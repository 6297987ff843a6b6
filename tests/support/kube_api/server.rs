//! HTTP: routing, `Status` errors, and the list, watch, get and patch operations on the cluster.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::cluster::{Cluster, Scope, Snapshot, Watch, WatchFrame, event_for, event_line};
use super::selectors::{FieldSelector, LabelSelector};
use super::{DEFAULT_WATCH_TIMEOUT, KEPT_SNAPSHOTS, MAX_BODY_BYTES, RecordedRequest, Shared};
// The test servers' one accept loop, from the support module this fake lives in.
use super::super::{Http, serve_connections, serve_http};

pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub(super) type ApiBody = UnsyncBoxBody<Bytes, BoxError>;

/// Serves the API on `listener` until `stop`, over plain HTTP/1.1 as the API server's clients speak it
/// here.
pub(super) fn serve(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    serve_connections(listener, stop, move |stream, _peer| {
        let shared = Arc::clone(&shared);
        serve_http(stream, Http::One, move |request| {
            let shared = Arc::clone(&shared);
            async move { handle(&shared, request).await }
        })
    });
}

fn full(body: impl Into<Bytes>) -> ApiBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub(super) fn json_response(status: StatusCode, value: &Value) -> Response<ApiBody> {
    let mut response = Response::new(full(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

/// A `Status` object, as the API server reports every failure.
fn status_object(code: u16, reason: &str, message: &str, name: Option<&str>) -> Value {
    let mut status = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    });
    if let Some(name) = name {
        status["details"] = json!({"name": name, "kind": "pods"});
    }
    status
}

pub(super) fn failure(
    code: u16,
    reason: &str,
    message: &str,
    name: Option<&str>,
) -> Response<ApiBody> {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, &status_object(code, reason, message, name))
}

pub(super) fn bad_request(message: &str) -> Response<ApiBody> {
    failure(400, "BadRequest", message, None)
}

pub(super) fn not_found(name: &str) -> Response<ApiBody> {
    failure(
        404,
        "NotFound",
        &format!("pods \"{name}\" not found"),
        Some(name),
    )
}

/// Decodes a query string (`+` and `%XX`); malformed escapes are an error.
fn parse_query(query: &str) -> Result<Vec<(String, String)>, String> {
    fn decode(text: &str) -> Result<String, String> {
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut index = 0;
        while index < bytes.len() {
            match bytes[index] {
                b'+' => out.push(b' '),
                b'%' => {
                    let hex = bytes
                        .get(index + 1..index + 3)
                        .and_then(|h| std::str::from_utf8(h).ok())
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                        .ok_or_else(|| format!("invalid escape in query {text:?}"))?;
                    out.push(hex);
                    index += 2;
                }
                b => out.push(b),
            }
            index += 1;
        }
        String::from_utf8(out).map_err(|_| format!("query {text:?} is not UTF-8"))
    }
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            Ok((decode(key)?, decode(value)?))
        })
        .collect()
}

pub(super) struct Query(Vec<(String, String)>);

impl Query {
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    /// The first parameter not in `known`.
    fn unknown(&self, known: &[&str]) -> Option<&str> {
        self.0
            .iter()
            .map(|(key, _)| key.as_str())
            .find(|key| !known.contains(key))
    }
}

async fn handle(shared: &Shared, request: Request<Incoming>) -> Response<ApiBody> {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let query = match parse_query(request.uri().query().unwrap_or("")) {
        Ok(query) => Query(query),
        Err(message) => {
            shared
                .cluster()
                .unexpected(format!("{method} {path}: {message}"));
            return bad_request(&message);
        }
    };
    shared.cluster().requests.push(RecordedRequest {
        method: method.clone(),
        path: path.clone(),
        query: query.0.clone(),
    });
    let authorized = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {}", shared.token));
    if !authorized {
        shared
            .cluster()
            .unexpected(format!("{method} {path}: no or wrong bearer token"));
        return failure(401, "Unauthorized", "Unauthorized", None);
    }
    if let Some(accept) = request
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        && accept.contains("protobuf")
    {
        shared
            .cluster()
            .unexpected(format!("{method} {path}: Accept: {accept}"));
        return failure(406, "NotAcceptable", "the fake speaks JSON only", None);
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (&method, segments.as_slice()) {
        (&Method::GET, ["api", "v1", "pods"]) => collection(shared, None, &query),
        (&Method::GET, ["api", "v1", "namespaces", namespace, "pods"]) => {
            collection(shared, Some(namespace), &query)
        }
        (&Method::GET, ["api", "v1", "namespaces", namespace, "pods", name]) => {
            super::pod::get_pod(shared, namespace, name, &query)
        }
        (&Method::PATCH, ["api", "v1", "namespaces", namespace, "pods", name]) => {
            let (namespace, name) = ((*namespace).to_owned(), (*name).to_owned());
            let headers = request.headers().clone();
            let body = match Limited::new(request.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
            {
                Ok(body) => body.to_bytes(),
                Err(err) => {
                    return failure(
                        413,
                        "RequestEntityTooLarge",
                        &format!("request body too large or broken: {err}"),
                        None,
                    );
                }
            };
            super::pod::patch_pod(shared, &namespace, &name, &query, &headers, &body)
        }
        (_, ["api", "v1", "pods"])
        | (_, ["api", "v1", "namespaces", _, "pods"])
        | (_, ["api", "v1", "namespaces", _, "pods", _]) => {
            shared.cluster().unexpected(format!(
                "{method} {path}: method not implemented by the fake"
            ));
            failure(
                405,
                "MethodNotAllowed",
                &format!("the fake does not implement {method} here"),
                None,
            )
        }
        _ => {
            shared
                .cluster()
                .unexpected(format!("{method} {path}: path not implemented by the fake"));
            failure(
                404,
                "NotFound",
                "the server could not find the requested resource",
                None,
            )
        }
    }
}

/// Refuses (and records) a query parameter the fake does not know.
pub(super) fn check_params(
    cluster: &mut Cluster,
    what: &str,
    query: &Query,
    known: &[&str],
) -> Option<Response<ApiBody>> {
    let unknown = query.unknown(known)?;
    let message = format!("the fake does not implement query parameter {unknown:?} for {what}");
    cluster.unexpected(message.clone());
    Some(bad_request(&message))
}

fn collection(shared: &Shared, namespace: Option<&str>, query: &Query) -> Response<ApiBody> {
    let watching = match query.get("watch") {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") => true,
        Some(other) => return bad_request(&format!("watch: invalid value {other:?}")),
    };
    let mut cluster = shared.cluster();
    if watching {
        watch(&mut cluster, namespace, query)
    } else {
        list(&mut cluster, namespace, query)
    }
}

fn scope(namespace: Option<&str>, query: &Query) -> Result<Scope, String> {
    Ok(Scope {
        namespace: namespace.map(str::to_owned),
        labels: LabelSelector::parse(query.get("labelSelector").unwrap_or(""))?,
        fields: FieldSelector::parse(query.get("fieldSelector").unwrap_or(""))?,
    })
}

/// A list item: list responses carry `kind` and `apiVersion` once, on the list.
fn list_item(pod: &Value) -> Value {
    let mut item = pod.clone();
    if let Some(object) = item.as_object_mut() {
        object.remove("kind");
        object.remove("apiVersion");
    }
    item
}

fn list(cluster: &mut Cluster, namespace: Option<&str>, query: &Query) -> Response<ApiBody> {
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
    let scope = match scope(namespace, query) {
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
                .pods
                .values()
                .filter(|pod| scope.matches(pod))
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
        &json!({"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": page}),
    )
}

fn watch(cluster: &mut Cluster, namespace: Option<&str>, query: &Query) -> Response<ApiBody> {
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
    let scope = match scope(namespace, query) {
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
            for pod in cluster.pods.values().filter(|pod| scope.matches(pod)) {
                let _ = sender.send(WatchFrame::Line(event_line("ADDED", pod)));
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

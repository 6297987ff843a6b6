//! HTTP: routing to the resources and their operations, query parsing, and `Status` errors. Lists and
//! watches are in `collection.rs`, pod patches in `pod.rs`.

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::cluster::Cluster;
use super::collection::collection;
use super::resource::{Resource, split_path};
use super::{MAX_BODY_BYTES, RecordedRequest, Shared};
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

/// A `Status` object, as the API server reports every failure (`name`: a pod's).
pub(super) fn status_object(code: u16, reason: &str, message: &str, name: Option<&str>) -> Value {
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

pub(super) fn not_found(resource: Resource, name: &str) -> Response<ApiBody> {
    let mut status = status_object(
        404,
        "NotFound",
        &format!("{} \"{name}\" not found", resource.qualified()),
        None,
    );
    status["details"] = json!({"name": name, "kind": resource.plural()});
    if !resource.group().is_empty() {
        status["details"]["group"] = json!(resource.group());
    }
    json_response(StatusCode::NOT_FOUND, &status)
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
    match (&method, split_path(&segments)) {
        (&Method::GET, Some((resource, namespace, None))) => {
            collection(shared, resource, namespace, &query)
        }
        (&Method::GET, Some((resource, Some(namespace), Some(name)))) => {
            get_object(shared, resource, namespace, name, &query)
        }
        (&Method::PATCH, Some((Resource::Pods, Some(namespace), Some(name)))) => {
            let (namespace, name) = (namespace.to_owned(), name.to_owned());
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
        (_, Some(_)) => {
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
        (_, None) => {
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

/// `GET` of one object.
fn get_object(
    shared: &Shared,
    resource: Resource,
    namespace: &str,
    name: &str,
    query: &Query,
) -> Response<ApiBody> {
    let mut cluster = shared.cluster();
    if let Some(refused) = check_params(&mut cluster, "get", query, &["resourceVersion", "pretty"])
    {
        return refused;
    }
    match cluster.object(resource, namespace, name) {
        Some(object) => json_response(StatusCode::OK, &object),
        None => not_found(resource, name),
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

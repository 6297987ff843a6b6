//! A fake of the SaladCloud public API's container group lookup, on 127.0.0.1 over plain HTTP/1.1.
//!
//! What it covers: `GET {base}/organizations/{org}/projects/{project}/containers/{name}` (base
//! `http://127.0.0.1:PORT/api/public`, as the real `https://api.salad.com/api/public`), answering the
//! container group document (`name`, `networking.dns`, `current_state.status`,
//! `current_state.instance_status_counts.running_count`, and the other top-level fields the real one
//! has, with plausible values); 404 for an unknown group, organization or project; 401 without the
//! right `Salad-Api-Key` header; errors as `application/problem+json` documents. Every request is
//! recorded (with whether its key was right), and [`FakeSaladApi::fail_next`] makes the next lookups
//! answer 500.
//!
//! What it does not cover: every other SaladCloud API operation (creating, starting or listing groups,
//! instances, quotas, webhooks), pagination, rate limiting (429), and the Container Gateway itself.
//! Anything it does not implement is answered 404 or 405, printed and kept in
//! [`FakeSaladApi::unexpected`]. Bad input never panics the server.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

use super::{Http, serve_connections, serve_http};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

type SaladBody = UnsyncBoxBody<Bytes, Infallible>;

/// Where the real API's paths start.
pub const BASE_PATH: &str = "/api/public";

/// One request as received.
#[derive(Clone, Debug)]
pub struct SaladRequest {
    pub method: Method,
    pub path: String,
    /// The `Salad-Api-Key` header matched the key.
    pub authorized: bool,
    pub status: u16,
}

struct State {
    key: String,
    organization: String,
    project: String,
    groups: BTreeMap<String, Value>,
    failures_left: u64,
    requests: Vec<SaladRequest>,
    unexpected: Vec<String>,
}

/// A fake SaladCloud API; dropping it stops it.
pub struct FakeSaladApi {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
}

/// A container group document as the SaladCloud API returns it. `dns` none: no Container Gateway.
pub fn container_group(
    organization: &str,
    project: &str,
    name: &str,
    dns: Option<&str>,
    status: &str,
    running: u32,
) -> Value {
    let mut group = json!({
        "id": format!("7c8f6a2e-0000-4000-8000-{:012x}", name.len()),
        "name": name,
        "display_name": name,
        "organization_name": organization,
        "project_name": project,
        "container": {
            "image": "ghcr.io/example/llm:1",
            "resources": {"cpu": 4, "memory": 16384, "gpu_classes": ["a5e6fa0f-0000-4000-8000-000000000001"]},
            "command": [],
            "environment_variables": {}
        },
        "autostart_policy": true,
        "restart_policy": "always",
        "replicas": 1,
        "current_state": {
            "status": status,
            "description": null,
            "start_time": "2025-01-01T00:00:00Z",
            "finish_time": null,
            "instance_status_counts": {
                "allocating_count": 0,
                "creating_count": 0,
                "running_count": running,
                "stopping_count": 0
            }
        },
        "country_codes": ["us"],
        "create_time": "2025-01-01T00:00:00Z",
        "update_time": "2025-01-01T00:00:00Z",
        "pending_change": false,
        "version": 1
    });
    if let Some(dns) = dns {
        group["networking"] = json!({
            "protocol": "http",
            "port": 8000,
            "auth": true,
            "dns": dns,
            "load_balancer": "round_robin",
            "single_connection_limit": false,
            "client_request_timeout": 100000,
            "server_response_timeout": 100000
        });
    }
    group
}

impl FakeSaladApi {
    /// Starts the API for one organization and project, accepting `key`.
    pub async fn start(organization: &str, project: &str, key: &str) -> FakeSaladApi {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("fake SaladCloud API binds");
        let addr = listener.local_addr().expect("fake SaladCloud API address");
        let state = Arc::new(Mutex::new(State {
            key: key.to_owned(),
            organization: organization.to_owned(),
            project: project.to_owned(),
            groups: BTreeMap::new(),
            failures_left: 0,
            requests: Vec::new(),
            unexpected: Vec::new(),
        }));
        let stop = CancellationToken::new();
        serve(listener, Arc::clone(&state), stop.clone());
        FakeSaladApi { addr, state, stop }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The API's base URL (what `salad.api.url` is set to).
    pub fn url(&self) -> String {
        format!("http://{}{BASE_PATH}", self.addr)
    }

    /// Creates or replaces container group `name`.
    pub fn set_group(&self, name: &str, dns: Option<&str>, status: &str, running: u32) {
        let mut state = self.state();
        let group = container_group(
            &state.organization,
            &state.project,
            name,
            dns,
            status,
            running,
        );
        state.groups.insert(name.to_owned(), group);
    }

    /// Creates or replaces container group `name` with any document.
    pub fn set_group_document(&self, name: &str, document: Value) {
        self.state().groups.insert(name.to_owned(), document);
    }

    pub fn remove_group(&self, name: &str) {
        self.state().groups.remove(name);
    }

    /// The next `count` lookups answer 500.
    pub fn fail_next(&self, count: u64) {
        self.state().failures_left = count;
    }

    pub fn requests(&self) -> Vec<SaladRequest> {
        self.state().requests.clone()
    }

    /// Lookups of group `name` received.
    pub fn lookups_of(&self, name: &str) -> usize {
        let suffix = format!("/containers/{name}");
        self.state()
            .requests
            .iter()
            .filter(|r| r.path.ends_with(&suffix))
            .count()
    }

    pub fn unexpected(&self) -> Vec<String> {
        self.state().unexpected.clone()
    }
}

impl Drop for FakeSaladApi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Serves the API on `listener` until `stop`, over plain HTTP/1.1.
fn serve(listener: TcpListener, state: Arc<Mutex<State>>, stop: CancellationToken) {
    serve_connections(listener, stop, move |stream, _peer| {
        let state = Arc::clone(&state);
        serve_http(stream, Http::One, move |request| {
            std::future::ready(handle(&state, &request))
        })
    });
}

fn problem(status: StatusCode, detail: &str) -> Response<SaladBody> {
    let body = json!({
        "type": format!("https://docs.salad.com/reference/errors#{}", status.as_u16()),
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    respond(status, "application/problem+json", body)
}

fn respond(status: StatusCode, content_type: &'static str, body: Value) -> Response<SaladBody> {
    let mut response = Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

fn handle(state: &Mutex<State>, request: &Request<Incoming>) -> Response<SaladBody> {
    let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
    let path = request.uri().path().to_owned();
    let authorized = request
        .headers()
        .get("salad-api-key")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|given| given == state.key);
    let response = answer(&mut state, request.method(), &path, authorized);
    state.requests.push(SaladRequest {
        method: request.method().clone(),
        path,
        authorized,
        status: response.status().as_u16(),
    });
    response
}

fn answer(state: &mut State, method: &Method, path: &str, authorized: bool) -> Response<SaladBody> {
    let segments: Vec<&str> = path
        .strip_prefix(BASE_PATH)
        .unwrap_or("")
        .trim_matches('/')
        .split('/')
        .collect();
    let [
        "organizations",
        organization,
        "projects",
        project,
        "containers",
        name,
    ] = segments.as_slice()
    else {
        let what = format!("{method} {path}: not implemented by the fake");
        eprintln!("fake SaladCloud API: UNEXPECTED: {what}");
        state.unexpected.push(what);
        return problem(StatusCode::NOT_FOUND, "no such API operation (fake)");
    };
    if method != Method::GET {
        let what = format!("{method} {path}: only GET is implemented by the fake");
        eprintln!("fake SaladCloud API: UNEXPECTED: {what}");
        state.unexpected.push(what);
        return problem(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET is implemented (fake)",
        );
    }
    if !authorized {
        return problem(
            StatusCode::UNAUTHORIZED,
            "missing or invalid Salad-Api-Key header",
        );
    }
    if state.failures_left > 0 {
        state.failures_left -= 1;
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the fake fails this lookup (test control)",
        );
    }
    if *organization != state.organization || *project != state.project {
        return problem(
            StatusCode::NOT_FOUND,
            &format!("organization {organization:?} or project {project:?} not found"),
        );
    }
    match state.groups.get(*name) {
        Some(group) => respond(StatusCode::OK, "application/json", group.clone()),
        None => problem(
            StatusCode::NOT_FOUND,
            &format!("container group {name:?} not found"),
        ),
    }
}

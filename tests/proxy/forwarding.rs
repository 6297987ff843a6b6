//! Forwarding: what the client sends reaches the endpoint, and what the endpoint answers reaches the
//! client, with hop-by-hop headers stripped and forwarding headers added. Real sockets on loopback.
//!
//! The endpoints are in-process backends standing in for GPU nodes.

use std::sync::{Arc, Mutex};

use crate::support::*;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};

/// What the backend saw of one request.
#[derive(Clone, Debug, Default)]
struct Seen {
    method: String,
    uri: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

async fn recording_backend() -> (Backend, Arc<Mutex<Vec<Seen>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let backend = backend(move |request: Request<hyper::body::Incoming>| {
        let log = Arc::clone(&log);
        async move {
            let (parts, body) = request.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            log.lock().unwrap().push(Seen {
                method: parts.method.to_string(),
                uri: parts.uri.to_string(),
                headers: parts
                    .headers
                    .iter()
                    .map(|(n, v)| {
                        (
                            n.to_string(),
                            String::from_utf8_lossy(v.as_bytes()).into_owned(),
                        )
                    })
                    .collect(),
                body: body.to_vec(),
            });
            let mut reversed = body.to_vec();
            reversed.reverse();
            Response::builder()
                .status(StatusCode::CREATED)
                .header("x-backend", "yes")
                .header("connection", "x-hop-secret")
                .header("x-hop-secret", "must not leak")
                .header("keep-alive", "timeout=5")
                .body(full(reversed))
                .unwrap()
        }
    })
    .await;
    (backend, seen)
}

#[tokio::test]
async fn forwards_method_path_query_headers_and_bodies_both_ways() {
    let (backend, seen) = recording_backend().await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;

    let request = Request::builder()
        .method(Method::PUT)
        .uri(proxy.url("/v1/generate?model=llama&stream=false"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer abc")
        .header("x-custom", "kept")
        .header("connection", "x-drop-me")
        .header("x-drop-me", "hop")
        .header("x-forwarded-for", "203.0.113.7")
        .body(full(r#"{"prompt":"hello"}"#))
        .unwrap();
    let response = client().request(request).await.expect("proxied");

    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()["x-backend"], "yes");
    assert!(!response.headers().contains_key("x-hop-secret"));
    assert!(!response.headers().contains_key("keep-alive"));
    let request_id = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        request_id.len(),
        32,
        "a request id is created when the client sent none"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, Bytes::from_static(br#"}"olleh":"tpmorp"{"#));

    let seen = seen.lock().unwrap()[0].clone();
    assert_eq!(seen.method, "PUT");
    assert_eq!(seen.uri, "/v1/generate?model=llama&stream=false");
    assert_eq!(seen.body, br#"{"prompt":"hello"}"#);
    assert_eq!(seen.header("content-type"), Some("application/json"));
    assert_eq!(seen.header("authorization"), Some("Bearer abc"));
    assert_eq!(seen.header("x-custom"), Some("kept"));
    assert_eq!(
        seen.header("x-drop-me"),
        None,
        "headers named by Connection are hop-by-hop"
    );
    assert_eq!(seen.header("host"), Some(backend.addr.to_string().as_str()));
    assert_eq!(
        seen.header("x-forwarded-for"),
        Some("203.0.113.7, 127.0.0.1")
    );
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    assert_eq!(
        seen.header("x-forwarded-host"),
        Some(proxy.addr.to_string().as_str())
    );
    assert_eq!(seen.header("x-request-id"), Some(request_id.as_str()));
    proxy.stop().await;
}

#[tokio::test]
async fn keeps_the_client_request_id_and_forwards_large_bodies() {
    let (backend, seen) = recording_backend().await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;
    let large: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let request = Request::builder()
        .method(Method::POST)
        .uri(proxy.url("/upload"))
        .header("x-request-id", "client-chosen-42")
        .body(
            Full::new(Bytes::from(large.clone()))
                .map_err(|e| match e {})
                .boxed(),
        )
        .unwrap();
    let response = client().request(request).await.unwrap();
    assert_eq!(response.headers()["x-request-id"], "client-chosen-42");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), large.len());
    assert_eq!(seen.lock().unwrap()[0].body, large);
    assert_eq!(
        seen.lock().unwrap()[0].header("x-request-id"),
        Some("client-chosen-42")
    );
    proxy.stop().await;
}

#[tokio::test]
async fn ipv6_endpoints_work() {
    let backend = backend_on("[::1]:0", |_request| async {
        Response::new(full("over v6"))
    })
    .await;
    let url = format!("http://[::1]:{}", backend.addr.port());
    let proxy = start_proxy(config_with("", &[url])).await;
    assert_eq!(get(&proxy.url("/")).await, (200, "over v6".to_owned()));
    proxy.stop().await;
}

#[tokio::test]
async fn endpoint_path_prefix_is_prepended() {
    let (backend, seen) = recording_backend().await;
    let proxy = start_proxy(config_with("", &[format!("{}/api/", backend.url())])).await;
    let (status, _) = get(&proxy.url("/v1/models?x=1")).await;
    assert_eq!(status, 201);
    assert_eq!(seen.lock().unwrap()[0].uri, "/api/v1/models?x=1");
    proxy.stop().await;
}

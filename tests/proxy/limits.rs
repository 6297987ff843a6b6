//! Inbound protections and client protocols: h2c with prior knowledge reaching an HTTP/1.1 endpoint,
//! 431 for oversized request heads, 413 for oversized bodies (declared or streamed), closing slowloris
//! connections after `timeouts.header_read`, and the proxy's own error statuses (503 with no endpoint,
//! 502 when the endpoint refuses, 504 when it never answers), each with its JSON body.
//!
//! Raw TCP is used wherever a well-behaved client would refuse to misbehave.
//!
//! The endpoints are in-process backends standing in for GPU nodes.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Longest any single exchange in this file may take before the test calls it hung.
const HANG: Duration = Duration::from_secs(10);

/// What the backend saw of one request it read completely.
#[derive(Clone, Debug)]
struct Seen {
    version: Version,
    method: Method,
    path_and_query: String,
    host: Option<String>,
    forwarded_host: Option<String>,
    body: Vec<u8>,
}

/// A backend that records each request whose body it read in full, and echoes `got N bytes`.
///
/// `started` counts requests whose headers arrived, complete or not.
async fn recording_backend() -> (Backend, Arc<Mutex<Vec<Seen>>>, Arc<AtomicUsize>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let started = Arc::new(AtomicUsize::new(0));
    let (log, count) = (Arc::clone(&seen), Arc::clone(&started));
    let backend = backend(move |request: Request<Incoming>| {
        let (log, count) = (Arc::clone(&log), Arc::clone(&count));
        async move {
            count.fetch_add(1, Ordering::SeqCst);
            let (parts, body) = request.into_parts();
            let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
                return Response::new(full("body broke off"));
            };
            let header = |name: &str| {
                parts
                    .headers
                    .get(name)
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            };
            log.lock().unwrap().push(Seen {
                version: parts.version,
                method: parts.method.clone(),
                path_and_query: parts
                    .uri
                    .path_and_query()
                    .map_or_else(String::new, |p| p.to_string()),
                host: header("host"),
                forwarded_host: header("x-forwarded-host"),
                body: body.to_vec(),
            });
            Response::new(full(format!("got {} bytes", body.len())))
        }
    })
    .await;
    (backend, seen, started)
}

/// A request body of the given chunks with no known length, so it goes out chunked.
struct Chunked(VecDeque<Bytes>);

impl Chunked {
    fn boxed(total: usize, chunk: usize) -> TestBody {
        let mut chunks = VecDeque::new();
        let mut left = total;
        while left > 0 {
            let n = left.min(chunk);
            chunks.push_back(Bytes::from(vec![b'x'; n]));
            left -= n;
        }
        Chunked(chunks).boxed()
    }
}

impl Body for Chunked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(self.0.pop_front().map(|chunk| Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
    // The default size hint is "unknown": no Content-Length is sent.
}

/// Sends `request` through the plain HTTP/1.1 client; returns status, `x-request-id` and body text.
async fn send(request: Request<TestBody>) -> (StatusCode, Option<String>, String) {
    let response = tokio::time::timeout(HANG, client().request(request))
        .await
        .expect("the proxy answers in time")
        .expect("the proxy answers");
    let status = response.status();
    let request_id = response
        .headers()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        request_id,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn post(proxy: &TestProxy, path: &str, body: TestBody) -> Request<TestBody> {
    Request::builder()
        .method(Method::POST)
        .uri(proxy.url(path))
        .body(body)
        .unwrap()
}

/// Asserts `body` is the proxy's JSON error whose `request_id` matches the response header.
fn assert_json_error(body: &str, header_request_id: Option<&str>) {
    let (_, request_id) = proxy_error(body);
    assert_eq!(Some(request_id.as_str()), header_request_id, "{body}");
}

/// Writes `bytes` on a fresh connection (a write the proxy cuts short is not an error), then reads
/// until the end of the response head and returns the head.
async fn raw_response_head(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let _ = stream.write_all(bytes).await;
    read_head(&mut stream).await
}

/// Reads from `stream` until a complete response head arrived; panics if none comes in time.
async fn read_head(stream: &mut TcpStream) -> String {
    let deadline = Instant::now() + HANG;
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            return String::from_utf8_lossy(&received[..end]).into_owned();
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => panic!(
                "connection ended before a response head; got {:?}",
                String::from_utf8_lossy(&received)
            ),
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
            Err(_) => panic!(
                "no response head within {HANG:?}; got {:?}",
                String::from_utf8_lossy(&received)
            ),
        }
    }
}

/// Reads until the peer closes the connection (end of stream or an error such as a reset); returns
/// what was received, or `None` when the connection is still open at the deadline.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let deadline = Instant::now() + limit;
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(received),
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
            Err(_) => return None,
        }
    }
}

fn status_of(head: &str) -> &str {
    head.split(' ').nth(1).unwrap_or_default()
}

#[tokio::test]
async fn h2c_client_reaches_an_http1_endpoint() {
    let (backend, seen, _) = recording_backend().await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;

    let h2c: Client<_, TestBody> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let request = Request::builder()
        .method(Method::POST)
        .uri(proxy.url("/v1/completions?stream=false"))
        .body(full(r#"{"prompt":"hi"}"#))
        .unwrap();
    let response = tokio::time::timeout(HANG, h2c.request(request))
        .await
        .expect("the proxy answers in time")
        .expect("the proxy speaks h2c");
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().contains_key("x-request-id"));
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "got 15 bytes");

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let seen = &seen[0];
    assert_eq!(seen.version, Version::HTTP_11);
    assert_eq!(seen.method, Method::POST);
    assert_eq!(seen.path_and_query, "/v1/completions?stream=false");
    assert_eq!(seen.body, br#"{"prompt":"hi"}"#);
    assert_eq!(
        seen.host.as_deref(),
        Some(backend.addr.to_string().as_str())
    );
    // The client's :authority is what it addressed: the proxy.
    assert_eq!(
        seen.forwarded_host.as_deref(),
        Some(proxy.addr.to_string().as_str())
    );
    proxy.stop().await;
}

#[tokio::test]
async fn oversized_request_head_gets_431_and_the_proxy_keeps_serving() {
    let (backend, _, started) = recording_backend().await;
    let proxy = start_proxy(config_with(
        "limits: { max_header_bytes: 16384 }\n",
        &[backend.url()],
    ))
    .await;

    let big = "a".repeat(40 * 1024);
    let request = format!("GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n");
    let head = raw_response_head(proxy.addr, request.as_bytes()).await;
    assert_eq!(status_of(&head), "431", "{head}");
    assert_eq!(started.load(Ordering::SeqCst), 0, "the endpoint saw it");

    // A head just under the limit still passes.
    let fits = "b".repeat(8 * 1024);
    let request = Request::builder()
        .uri(proxy.url("/v1/models"))
        .header("x-fits", fits)
        .body(full(""))
        .unwrap();
    let (status, _, body) = send(request).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "got 0 bytes"));
    assert_eq!(
        get(&proxy.url("/v1/models")).await,
        (200, "got 0 bytes".to_owned())
    );
    proxy.stop().await;
}

/// `limits.max_header_bytes` is the limit a client meets, to the byte as far as the head's size can
/// be counted, on HTTP/1 and on h2c: a head just over it gets 431 (hyper's own read buffer would let
/// it through), one just under it passes.
#[tokio::test]
async fn a_head_just_over_max_header_bytes_gets_431_on_http1_and_h2c_and_one_under_passes() {
    let (backend, _, started) = recording_backend().await;
    // The default: hyper's read buffer grows past it in steps.
    let limit = 65536;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;
    // "GET /v1/models HTTP/1.1\r\n" and "Host: x\r\n" and "X-Big: ...\r\n" and the blank line.
    let head = |total: usize| {
        let fixed = "GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: \r\n\r\n".len();
        let big = "a".repeat(total - fixed);
        format!("GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n")
    };
    for (total, expected) in [(limit + 64, "431"), (limit - 64, "200")] {
        let answer = raw_response_head(proxy.addr, head(total).as_bytes()).await;
        assert_eq!(
            status_of(&answer),
            expected,
            "HTTP/1 head of {total} bytes: {answer}"
        );
    }
    assert_eq!(
        started.load(Ordering::SeqCst),
        1,
        "only the head under the limit reached the endpoint"
    );

    let h2c: Client<_, TestBody> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    for (big, expected) in [(limit + 64, 431), (limit - 1024, 200)] {
        let request = Request::builder()
            .uri(proxy.url("/v1/models"))
            .header("x-big", "a".repeat(big))
            .body(full(""))
            .unwrap();
        let response = tokio::time::timeout(HANG, h2c.request(request))
            .await
            .expect("the proxy answers in time")
            .expect("the proxy speaks h2c");
        assert_eq!(response.version(), Version::HTTP_2);
        assert_eq!(
            response.status().as_u16(),
            expected,
            "h2c header of {big} bytes"
        );
    }
    assert_eq!(started.load(Ordering::SeqCst), 2);
    proxy.stop().await;
}

#[tokio::test]
async fn declared_body_over_the_limit_gets_413_before_it_is_sent() {
    let (backend, seen, started) = recording_backend().await;
    let proxy = start_proxy(config_with(
        "limits: { max_body_bytes: 1000 }\n",
        &[backend.url()],
    ))
    .await;

    // Only the head is sent: the answer must not wait for the 5000 bytes it announces.
    let head = raw_response_head(
        proxy.addr,
        b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&head), "413", "{head}");

    // A well-behaved client sending the whole body gets the same answer and a JSON error.
    let (status, request_id, body) = send(post(&proxy, "/v1/upload", full(vec![b'x'; 5000]))).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_json_error(&body, request_id.as_deref());

    // One byte over the limit is over; exactly the limit is not.
    let (status, _, _) = send(post(&proxy, "/v1/upload", full(vec![b'x'; 1001]))).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        started.load(Ordering::SeqCst),
        0,
        "the endpoint saw a rejected request"
    );
    let (status, _, body) = send(post(&proxy, "/v1/upload", full(vec![b'x'; 1000]))).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "got 1000 bytes"));
    assert_eq!(seen.lock().unwrap().len(), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn streamed_body_over_the_limit_gets_413() {
    let (backend, seen, _) = recording_backend().await;
    let proxy = start_proxy(config_with(
        "limits: { max_body_bytes: 1000 }\n",
        &[backend.url()],
    ))
    .await;

    let request = post(&proxy, "/v1/upload", Chunked::boxed(5000, 500));
    assert!(!request.headers().contains_key("content-length"));
    let (status, request_id, body) = send(request).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_json_error(&body, request_id.as_deref());
    assert!(
        seen.lock().unwrap().iter().all(|s| s.body.len() <= 1000),
        "the endpoint received more than the limit"
    );

    // The proxy keeps serving afterwards.
    assert_eq!(get(&proxy.url("/")).await, (200, "got 0 bytes".to_owned()));
    proxy.stop().await;
}

#[tokio::test]
async fn bodies_within_the_limit_pass_declared_or_streamed() {
    let (backend, seen, _) = recording_backend().await;
    let proxy = start_proxy(config_with(
        "limits: { max_body_bytes: 1000 }\n",
        &[backend.url()],
    ))
    .await;

    let (status, _, body) = send(post(&proxy, "/declared", full(vec![b'x'; 500]))).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "got 500 bytes"));
    let (status, _, body) = send(post(&proxy, "/streamed", Chunked::boxed(500, 100))).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "got 500 bytes"));

    let seen = seen.lock().unwrap().clone();
    let paths: Vec<_> = seen.iter().map(|s| s.path_and_query.as_str()).collect();
    assert_eq!(paths, ["/declared", "/streamed"]);
    assert!(seen.iter().all(|s| s.body == vec![b'x'; 500]));
    proxy.stop().await;
}

#[tokio::test]
async fn slowloris_connection_is_closed_after_header_read_timeout() {
    let backend = text_backend("served").await;
    let proxy = start_proxy(config_with(
        "timeouts: { header_read: 1s }\n",
        &[backend.url()],
    ))
    .await;

    let mut slow = TcpStream::connect(proxy.addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();

    // While the slow client holds its connection, others are served.
    assert_eq!(get(&proxy.url("/")).await, (200, "served".to_owned()));

    let received = read_until_closed(&mut slow, HANG)
        .await
        .unwrap_or_else(|| panic!("the proxy kept an incomplete request head open for {HANG:?}"));
    if !received.is_empty() {
        let text = String::from_utf8_lossy(&received);
        assert!(
            text.starts_with("HTTP/1.1 408"),
            "unexpected answer: {text}"
        );
    }
    assert_eq!(get(&proxy.url("/")).await, (200, "served".to_owned()));
    proxy.stop().await;
}

/// A client that connects and then sends nothing, or stops inside the HTTP/2 preface, holds its
/// connection as surely as one that stops inside an HTTP/1.1 head, and must be cut off the same way.
#[tokio::test]
async fn silent_connection_is_closed_after_header_read_timeout() {
    let backend = text_backend("served").await;
    let proxy = start_proxy(config_with(
        "timeouts: { header_read: 1s }\n",
        &[backend.url()],
    ))
    .await;

    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    let mut half_preface = TcpStream::connect(proxy.addr).await.unwrap();
    half_preface.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert_eq!(get(&proxy.url("/")).await, (200, "served".to_owned()));

    for (what, stream) in [("silent", &mut silent), ("half-preface", &mut half_preface)] {
        let received = read_until_closed(stream, HANG)
            .await
            .unwrap_or_else(|| panic!("the proxy kept the {what} connection open for {HANG:?}"));
        if !received.is_empty() {
            let text = String::from_utf8_lossy(&received);
            assert!(
                text.starts_with("HTTP/1.1 408"),
                "{what}: unexpected answer: {text}"
            );
        }
    }
    proxy.stop().await;
}

/// The drain waits for requests in flight, not for connections without one: a client that connected
/// and sent nothing, and a kept-alive connection between requests, are closed when the drain starts,
/// so shutdown ends long before `shutdown.grace` or `timeouts.header_read` (a minute each here).
#[tokio::test]
async fn silent_and_idle_connections_do_not_hold_the_drain() {
    let backend = text_backend("served").await;
    let proxy = start_proxy(config_with(
        "timeouts: { header_read: 60s }\nshutdown: { grace: 60s }\n",
        &[backend.url()],
    ))
    .await;

    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    let mut idle = TcpStream::connect(proxy.addr).await.unwrap();
    idle.write_all(b"GET / HTTP/1.1\r\nhost: tongs\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(HANG, async {
        while !answer.ends_with(b"served") {
            let mut chunk = [0u8; 1024];
            let n = idle.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before the answer: {answer:?}");
            answer.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .expect("the first request is answered");
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");

    proxy.shutdown.cancel();
    tokio::time::timeout(HANG, proxy.task)
        .await
        .expect("the drain ended without waiting for the silent and idle connections")
        .unwrap();
    for (what, stream) in [("silent", &mut silent), ("idle", &mut idle)] {
        let received = read_until_closed(stream, HANG)
            .await
            .unwrap_or_else(|| panic!("the {what} connection was left open"));
        assert!(received.is_empty(), "{what}: {received:?}");
    }
}

#[tokio::test]
async fn no_endpoint_gets_503_with_a_json_error() {
    // The queue is off, so the refusal is immediate (with the queue on, the request would first wait
    // for an endpoint to appear).
    let proxy = start_proxy(config_with("queue: { max_length: 0 }\n", &[])).await;
    let request = Request::builder()
        .uri(proxy.url("/v1/models"))
        .header("x-request-id", "rid-503")
        .body(full(""))
        .unwrap();
    let (status, request_id, body) = send(request).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(request_id.as_deref(), Some("rid-503"));
    assert_json_error(&body, Some("rid-503"));
    proxy.stop().await;
}

#[tokio::test]
async fn refused_connection_gets_502_with_a_json_error() {
    let endpoint = closed_url();
    let proxy = start_proxy(config_with("", &[endpoint])).await;

    let (status, request_id, body) = send(post(&proxy, "/v1/chat", full("hello"))).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert_json_error(&body, request_id.as_deref());
    proxy.stop().await;
}

/// tongs reads a node's HTTP/1 connection 8 KiB at a time, so that is the largest answer head a node
/// may send: one of about 7 KiB passes whole, one of about 9 KiB is a broken answer (502, JSON error),
/// and the proxy serves on.
#[tokio::test]
async fn a_node_answer_head_up_to_8_kib_passes_and_a_larger_one_gets_502() {
    let node = backend(|request: Request<Incoming>| async move {
        let size: usize = request.uri().query().unwrap_or("0").parse().unwrap();
        Response::builder()
            .header("x-padding", "p".repeat(size))
            .body(full("whole"))
            .unwrap()
    })
    .await;
    let proxy = start_proxy(config_with("", &[node.url()])).await;

    let (status, _, body) = send(post(&proxy, "/v1/chat?7000", full("hello"))).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "whole"));
    let (status, request_id, body) = send(post(&proxy, "/v1/chat?9000", full("hello"))).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert_json_error(&body, request_id.as_deref());
    let (status, _, body) = send(post(&proxy, "/v1/chat?100", full("hello"))).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "whole"));
    proxy.stop().await;
}

#[tokio::test]
async fn endpoint_that_never_answers_gets_504_with_a_json_error() {
    // Accepts connections and holds them without ever reading or writing.
    let silent = Silent::start().await;
    let endpoint = format!("http://{}", silent.addr);
    let proxy = start_proxy(config_with(
        "timeouts: { response_headers: 500ms, total: 2s }\n",
        &[endpoint],
    ))
    .await;

    let (status, request_id, body) = send(post(&proxy, "/v1/chat", full("hello"))).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    assert_json_error(&body, request_id.as_deref());
    assert!(silent.accepted() >= 1, "the endpoint was connected to");
    proxy.stop().await;
}

//! What tongs answers when it cannot or will not pass an endpoint's response on: a `CONNECT` is refused
//! with 405 and never forwarded, a node's unsolicited `101` becomes a 502 counted against that node, a
//! 504 names the time the attempt was given, a node's or gateway's error page (HTML) becomes tongs' own
//! JSON error while a JSON error passes on, and no error body tells the client an endpoint's address
//! (the logs and `/debug/endpoints` keep it).
//!
//! Real sockets on 127.0.0.1; the misbehaving endpoints are raw TCP servers standing in for GPU nodes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::support::*;
use http::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// One attempt per request, so each answer is about the one endpoint configured.
const ONE_ATTEMPT: &str = "retry: { enabled: false }\n";

/// An endpoint on raw TCP: for every connection it reads one request head, writes `reply` as is and
/// closes the connection.
struct RawEndpoint {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    stop: CancellationToken,
}

impl RawEndpoint {
    async fn start(reply: &'static [u8]) -> RawEndpoint {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&hits);
        let stop = CancellationToken::new();
        serve_connections(listener, stop.clone(), move |mut stream, _peer| {
            let count = Arc::clone(&count);
            async move {
                if read_until_blank_line(&mut stream).await.is_some() {
                    count.fetch_add(1, Ordering::SeqCst);
                    let _ = stream.write_all(reply).await;
                    let _ = stream.flush().await;
                }
            }
        });
        RawEndpoint { addr, hits, stop }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for RawEndpoint {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Reads up to the end of a message head; `None` if the peer left first or nothing came within
/// [`HANG`].
async fn read_until_blank_line(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout(HANG, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => head.extend_from_slice(&buf[..n]),
            _ => return None,
        }
    }
    Some(head)
}

/// Sends `request` as is on a new connection to `addr` and returns everything the peer sent until it
/// closed the connection (the request should say `Connection: close`).
async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(HANG, stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the connection stayed open past {HANG:?}");
    String::from_utf8_lossy(&answer).into_owned()
}

/// A GET of `path` through `proxy`, with its response head and body.
async fn get_answer(proxy: &TestProxy, path: &str) -> (http::response::Parts, String) {
    exchange(Request::get(proxy.url(path)).body(full("")).unwrap()).await
}

#[tokio::test]
async fn connect_is_answered_405_and_never_forwarded() {
    let node = RawEndpoint::start(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
    let proxy = start_proxy(config_with("", &[node.url()])).await;

    let answer = raw_exchange(
        proxy.addr,
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 405"), "answer: {answer:?}");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a whole response");
    let head = head.to_ascii_lowercase();
    let allow = head
        .lines()
        .find_map(|line| line.strip_prefix("allow: "))
        .unwrap_or_else(|| panic!("no Allow: {head}"));
    assert!(allow.starts_with("get, head, post"), "{allow}");
    assert!(!allow.contains("connect"), "{allow}");
    assert!(head.contains("content-type: application/json"), "{head}");
    let (error, _request_id) = proxy_error(body);
    assert!(error.contains("CONNECT"), "{error}");
    assert_eq!(
        node.hits.load(Ordering::SeqCst),
        0,
        "nothing reached the node"
    );

    // Any other method still goes through.
    assert_eq!(get(&proxy.url("/")).await.0, 200);
    assert_eq!(node.hits.load(Ordering::SeqCst), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn an_unsolicited_101_is_a_502_and_a_failure_of_its_endpoint() {
    let node = RawEndpoint::start(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: something-else\r\n\r\n",
    )
    .await;
    let proxy = start_proxy(config_with(ONE_ATTEMPT, &[node.url()])).await;

    let (head, body) = get_answer(&proxy, "/v1/models").await;
    assert_eq!(head.status, 502, "{body}");
    assert!(!head.headers.contains_key("upgrade"), "{head:?}");
    let (error, _) = proxy_error(&body);
    assert!(error.contains("101"), "{error}");
    let endpoint = Arc::clone(&proxy.app_registry.snapshot()[0]);
    assert_eq!(
        endpoint.tally().failures(),
        1,
        "the 101 counts against its endpoint"
    );
    assert_eq!(node.hits.load(Ordering::SeqCst), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn a_504_names_the_timeout_the_attempt_was_given() {
    let silent = Silent::start().await;
    let config = format!("{ONE_ATTEMPT}timeouts: {{ response_headers: 300ms }}\n");
    let proxy = start_proxy(config_with(&config, &[format!("http://{}", silent.addr)])).await;

    let (head, body) = get_answer(&proxy, "/v1/models").await;
    assert_eq!(head.status, 504, "{body}");
    let (error, _) = proxy_error(&body);
    assert!(error.contains("within 300ms"), "{error}");
    proxy.stop().await;
}

/// Fails if the response (head or body) names the endpoint at `addr`.
fn assert_no_endpoint(what: &str, addr: SocketAddr, head: &http::response::Parts, body: &str) {
    let mut text = body.to_owned();
    for (name, value) in &head.headers {
        text.push_str(&format!(
            "\n{name}: {}",
            String::from_utf8_lossy(value.as_bytes())
        ));
    }
    for needle in [
        addr.to_string(),
        addr.ip().to_string(),
        format!(":{}", addr.port()),
    ] {
        assert!(
            !text.contains(&needle),
            "{what}: the answer names the endpoint ({needle}):\n{text}"
        );
    }
}

#[tokio::test]
async fn failure_answers_do_not_name_the_endpoint() {
    // Connection refused: 502.
    let port = free_port();
    let refused: SocketAddr = ([127, 0, 0, 1], port).into();
    let proxy = start_proxy(config_with(ONE_ATTEMPT, &[format!("http://{refused}")])).await;
    let (head, body) = get_answer(&proxy, "/").await;
    assert_eq!(head.status, 502, "{body}");
    let (error, request_id) = proxy_error(&body);
    assert!(error.contains("connect"), "says what failed: {error}");
    assert_eq!(head.headers["x-request-id"], request_id.as_str());
    assert_no_endpoint("connection refused", refused, &head, &body);
    proxy.stop().await;

    // No response headers in time: 504.
    let silent = Silent::start().await;
    let config = format!("{ONE_ATTEMPT}timeouts: {{ response_headers: 200ms }}\n");
    let proxy = start_proxy(config_with(&config, &[format!("http://{}", silent.addr)])).await;
    let (head, body) = get_answer(&proxy, "/").await;
    assert_eq!(head.status, 504, "{body}");
    proxy_error(&body);
    assert_no_endpoint("response timeout", silent.addr, &head, &body);
    proxy.stop().await;

    // The connection broken before any response: 502 from tongs as the gateway.
    let closing = RawEndpoint::start(b"").await;
    let proxy = start_proxy(config_with(ONE_ATTEMPT, &[closing.url()])).await;
    let (head, body) = get_answer(&proxy, "/").await;
    assert_eq!(head.status, 502, "{body}");
    proxy_error(&body);
    assert_no_endpoint("connection closed", closing.addr, &head, &body);
    assert_eq!(closing.hits.load(Ordering::SeqCst), 1);
    proxy.stop().await;
}

/// A whole HTTP/1.1 response: `status`, then `headers` (each line ending in CRLF), then `body` with its
/// length.
fn reply(status: u16, headers: &str, body: &str) -> &'static [u8] {
    let text = format!(
        "HTTP/1.1 {status} Failed\r\n{headers}content-length: {}\r\n\r\n{body}",
        body.len()
    );
    Box::leak(text.into_bytes().into_boxed_slice())
}

/// The page a gateway answers with when the node behind it is gone.
const ERROR_PAGE: &str = "<html><head><title>503 Service Temporarily Unavailable</title></head>\
                          <body><center><h1>503 Service Temporarily Unavailable</h1></center></body></html>";

#[tokio::test]
async fn a_node_s_error_page_becomes_tongs_json_error() {
    for (status, headers, retry_after) in [
        (503, "content-type: text/html\r\n", None),
        (502, "content-type: text/html; charset=utf-8\r\n", None),
        (504, "", None),
        (524, "content-type: text/plain\r\n", None),
        (
            503,
            "content-type: text/html\r\nretry-after: 9\r\n",
            Some("9"),
        ),
        (
            502,
            "content-type: text/html\r\nretry-after: 4\r\n",
            Some("4"),
        ),
    ] {
        let case = format!("{status} {headers:?}");
        let node = RawEndpoint::start(reply(status, headers, ERROR_PAGE)).await;
        let proxy = start_proxy(config_with(ONE_ATTEMPT, &[node.url()])).await;

        let (head, body) = get_answer(&proxy, "/v1/models").await;
        assert_eq!(head.status, status, "{case}: {body}");
        assert_eq!(head.headers["content-type"], "application/json", "{case}");
        assert!(!body.contains("html"), "{case}: {body}");
        let (error, request_id) = proxy_error(&body);
        assert_eq!(error, format!("the endpoint answered {status}"), "{case}");
        assert_eq!(head.headers["x-request-id"], request_id.as_str(), "{case}");
        assert_eq!(
            head.headers.get("retry-after").map(|v| v.to_str().unwrap()),
            retry_after,
            "{case}: the node's Retry-After is kept"
        );
        assert_no_endpoint(&case, node.addr, &head, &body);
        assert_eq!(node.hits.load(Ordering::SeqCst), 1, "{case}");
        let endpoint = Arc::clone(&proxy.app_registry.snapshot()[0]);
        assert_eq!(
            endpoint.outstanding(),
            0,
            "{case}: the node's answer is let go"
        );
        proxy.stop().await;
    }
}

#[tokio::test]
async fn a_node_s_json_error_passes_on() {
    let body = r#"{"object":"error","message":"the engine is restarting","code":503}"#;
    for content_type in [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/problem+json",
        "application/vnd.error+json;charset=utf-8",
    ] {
        let headers = format!("content-type: {content_type}\r\nx-node: kept\r\n");
        let node = RawEndpoint::start(reply(503, &headers, body)).await;
        let proxy = start_proxy(config_with(ONE_ATTEMPT, &[node.url()])).await;

        let (head, answer) = get_answer(&proxy, "/v1/models").await;
        assert_eq!(head.status, 503, "{content_type}: {answer}");
        assert_eq!(answer, body, "{content_type}: the node's own body");
        assert_eq!(head.headers["content-type"], content_type);
        assert_eq!(head.headers["x-node"], "kept", "{content_type}");
        proxy.stop().await;
    }
}

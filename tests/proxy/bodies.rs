//! Request bodies under hostile or slow clients: the process-wide replay budget, the body idle limit,
//! and client faults kept away from the endpoints' breakers. Raw TCP clients, because a well-behaved
//! client would not stall its upload. The endpoint is an in-process backend standing in for a GPU node.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Longest any single exchange here may take before the test calls it hung.
const HANG: Duration = Duration::from_secs(10);

/// A backend that reads the whole body and answers `got N bytes`.
async fn counting_backend() -> Backend {
    backend(|request: Request<Incoming>| async move {
        match request.into_body().collect().await {
            Ok(body) => Response::new(full(format!("got {} bytes", body.to_bytes().len()))),
            Err(_) => Response::new(full("body broke off")),
        }
    })
    .await
}

/// Opens a connection and sends a POST declaring `declared` bytes of body, of which it sends `sent`;
/// the connection stays open with the rest never sent.
async fn stalled_upload(addr: SocketAddr, declared: usize, sent: usize) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/upload HTTP/1.1\r\nhost: tongs\r\ncontent-type: application/octet-stream\r\n\
         content-length: {declared}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&vec![b'x'; sent]).await.unwrap();
    stream
}

/// Reads the response's status line (the first line) within `HANG`.
async fn status_line(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + HANG;
    while !received.windows(2).any(|w| w == b"\r\n") {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => panic!("closed without an answer: {received:?}"),
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
            Err(_) => panic!("no answer within {HANG:?}"),
        }
    }
    let text = String::from_utf8_lossy(&received).into_owned();
    text.lines().next().unwrap_or_default().to_owned()
}

async fn metric_reaches(proxy: &TestProxy, series: &str, value: f64) {
    eventually_async(&format!("{series} = {value}"), HANG, || async {
        sample(proxy, series).await == value
    })
    .await;
}

#[tokio::test]
async fn stalled_uploads_hold_no_more_memory_than_the_replay_budget() {
    // A budget of 1 MB and uploads of 600 kB stalled one byte before their end: one is kept for
    // replay, the others stream (their endpoint receives them as they come) instead of each holding
    // 600 kB in tongs.
    let node = counting_backend().await;
    let config = "retry: { replay_budget_bytes: 1000000 }\n";
    let proxy = start_proxy(config_with(config, &[node.url()])).await;
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(stalled_upload(proxy.addr, 600_000, 599_999).await);
    }
    metric_reaches(&proxy, "tongs_replay_over_budget_total", 2.0).await;
    assert_eq!(sample(&proxy, "tongs_replay_bytes").await, 600_000.0);

    // A whole upload while the budget is spent streams too, and is served.
    let request = Request::post(proxy.url("/v1/upload"))
        .body(full(vec![b'x'; 600_000]))
        .unwrap();
    assert_eq!(send(request).await, (200, "got 600000 bytes".to_owned()));
    assert_eq!(sample(&proxy, "tongs_replay_over_budget_total").await, 3.0);

    // The clients leave: what they held goes back.
    drop(stalled);
    metric_reaches(&proxy, "tongs_replay_bytes", 0.0).await;
    proxy.stop().await;
}

#[tokio::test]
async fn a_client_that_pauses_its_body_gets_408() {
    let node = counting_backend().await;
    let config = "timeouts: { body_read: 300ms }\n";
    let proxy = start_proxy(config_with(config, &[node.url()])).await;
    let started = Instant::now();
    let mut upload = stalled_upload(proxy.addr, 100, 50).await;
    let status = status_line(&mut upload).await;
    println!("a paused body answered after {:?}", started.elapsed());
    assert!(status.contains(" 408 "), "{status}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    proxy.stop().await;
}

#[tokio::test]
async fn a_paused_streamed_upload_gets_408_and_is_not_held_against_the_endpoint() {
    // Larger than the replay limit, so it streams to the endpoint while the client sends it.
    let node = counting_backend().await;
    let config = "timeouts: { body_read: 300ms }\nretry: { replay_limit_bytes: 1024 }\n";
    let proxy = start_proxy(config_with(config, &[node.url()])).await;
    let endpoint = Arc::clone(&proxy.app_registry.snapshot()[0]);
    for _ in 0..3 {
        let mut upload = stalled_upload(proxy.addr, 10_000, 5_000).await;
        let status = status_line(&mut upload).await;
        assert!(status.contains(" 408 "), "{status}");
    }
    assert_eq!(
        endpoint.tally().failures(),
        0,
        "the client's pause is not the endpoint's failure"
    );
    assert_eq!(get(&proxy.url("/")).await, (200, "got 0 bytes".to_owned()));
    proxy.stop().await;
}

#[tokio::test]
async fn a_streamed_body_over_the_limit_is_not_held_against_the_endpoint() {
    let node = counting_backend().await;
    let config = "limits: { max_body_bytes: 1000 }\nretry: { replay_limit_bytes: 100 }\n";
    let proxy = start_proxy(config_with(config, &[node.url()])).await;
    let endpoint = Arc::clone(&proxy.app_registry.snapshot()[0]);
    for _ in 0..3 {
        // Chunked, so the size shows only as it streams (a declared one is refused before sending).
        let mut upload = TcpStream::connect(proxy.addr).await.unwrap();
        let head = "POST /v1/upload HTTP/1.1\r\nhost: tongs\r\ntransfer-encoding: chunked\r\n\r\n";
        upload.write_all(head.as_bytes()).await.unwrap();
        for _ in 0..10 {
            let chunk = format!("1f4\r\n{}\r\n", "x".repeat(500));
            if upload.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
        }
        let _ = upload.write_all(b"0\r\n\r\n").await;
        let status = status_line(&mut upload).await;
        assert!(status.contains(" 413 "), "{status}");
    }
    assert_eq!(
        endpoint.tally().failures(),
        0,
        "the client's oversized body is not the endpoint's failure"
    );
    proxy.stop().await;
}

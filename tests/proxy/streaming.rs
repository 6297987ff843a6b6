//! Streaming through the proxy: Server-Sent Events reach the client chunk by chunk, a client that goes
//! away cancels the endpoint's work, and HTTP/1.1 upgrades (WebSocket) pass through as a byte stream.
//!
//! The endpoints are in-process backends standing in for GPU nodes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::channel::Channel;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

#[tokio::test]
async fn sse_chunks_arrive_before_the_stream_ends() {
    let next = Arc::new(Notify::new());
    let gate = Arc::clone(&next);
    let backend = backend(move |_request| {
        let gate = Arc::clone(&gate);
        async move {
            let (mut sender, body) = Channel::<Bytes, BoxError>::new(1);
            tokio::spawn(async move {
                for token in ["Hello", ",", " world"] {
                    let event = format!("data: {token}\n\n");
                    if sender.send_data(Bytes::from(event)).await.is_err() {
                        return;
                    }
                    // The next token is only produced once the client has seen this one.
                    gate.notified().await;
                }
                let _ = sender
                    .send_data(Bytes::from_static(b"data: [DONE]\n\n"))
                    .await;
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .header("cache-control", "no-cache")
                .body(body.boxed())
                .unwrap()
        }
    })
    .await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;

    let response = client()
        .get(proxy.url("/v1/chat?stream=true").parse().unwrap())
        .await
        .unwrap();
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let mut received = Vec::new();
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("an event arrives while the endpoint is still streaming");
        let Some(frame) = frame else { break };
        let data = frame.unwrap().into_data().unwrap();
        received.push(String::from_utf8(data.to_vec()).unwrap());
        next.notify_one();
    }
    assert_eq!(
        received.concat(),
        "data: Hello\n\ndata: ,\n\ndata:  world\n\ndata: [DONE]\n\n"
    );
    // Each event was delivered on its own, before the endpoint produced the next one.
    assert!(received.len() >= 4, "{received:?}");
    proxy.stop().await;
}

/// Sets its flag when dropped: a handler future dropped early means the request was cancelled.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn client_disconnect_mid_stream_cancels_the_endpoint_stream() {
    let cancelled = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let (flag, count) = (Arc::clone(&cancelled), Arc::clone(&sent));
    let backend = backend(move |_request| {
        let (flag, count) = (Arc::clone(&flag), Arc::clone(&count));
        async move {
            let (mut sender, body) = Channel::<Bytes, BoxError>::new(1);
            tokio::spawn(async move {
                for i in 0..1000 {
                    if sender
                        .send_data(Bytes::from(format!("data: {i}\n\n")))
                        .await
                        .is_err()
                    {
                        flag.store(true, Ordering::SeqCst);
                        return;
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
            Response::new(body.boxed())
        }
    })
    .await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;

    let response = client()
        .get(proxy.url("/stream").parse().unwrap())
        .await
        .unwrap();
    let mut body = response.into_body();
    for _ in 0..2 {
        body.frame().await.unwrap().unwrap();
    }
    drop(body);

    eventually("endpoint stream cancelled", Duration::from_secs(10), || {
        cancelled.load(Ordering::SeqCst)
    })
    .await;
    assert!(
        sent.load(Ordering::SeqCst) < 1000,
        "the endpoint stopped early"
    );
    stop_once_idle(proxy, "request").await;
}

#[tokio::test]
async fn client_disconnect_before_headers_cancels_the_endpoint_request() {
    let arrived = Arc::new(AtomicBool::new(false));
    let cancelled = Arc::new(AtomicBool::new(false));
    let (seen, flag) = (Arc::clone(&arrived), Arc::clone(&cancelled));
    let backend = backend(move |_request| {
        let (seen, flag) = (Arc::clone(&seen), Arc::clone(&flag));
        async move {
            let _on_drop = DropFlag(flag);
            seen.store(true, Ordering::SeqCst);
            // A long generation that only finishes if nobody cancels it.
            tokio::time::sleep(Duration::from_secs(60)).await;
            Response::new(full("too late"))
        }
    })
    .await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;

    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(b"POST /generate HTTP/1.1\r\nHost: tongs\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    eventually(
        "request reached the endpoint",
        Duration::from_secs(5),
        || arrived.load(Ordering::SeqCst),
    )
    .await;
    drop(stream);

    eventually(
        "endpoint request cancelled",
        Duration::from_secs(10),
        || cancelled.load(Ordering::SeqCst),
    )
    .await;
    stop_once_idle(proxy, "request").await;
}

/// Waits until the only endpoint has nothing outstanding (the `what` the client left is released),
/// then stops the proxy.
async fn stop_once_idle(proxy: TestProxy, what: &str) {
    let registry = Arc::clone(&proxy.app_registry);
    eventually(
        &format!("{what} no longer outstanding"),
        Duration::from_secs(5),
        || registry.snapshot()[0].outstanding() == 0,
    )
    .await;
    proxy.stop().await;
}

/// Reads from `stream` until the end of an HTTP head; returns the head as text.
async fn read_head(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut byte))
            .await
            .expect("head arrives")
            .unwrap();
        assert_eq!(
            n,
            1,
            "connection closed inside the head: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    String::from_utf8(head).unwrap()
}

#[tokio::test]
async fn websocket_upgrade_passes_through_and_counts_as_outstanding() {
    // The endpoint switches protocols and then echoes every byte back.
    let backend = backend(|mut request: Request<hyper::body::Incoming>| async move {
        assert_eq!(request.headers()["upgrade"], "websocket");
        let on_upgrade = hyper::upgrade::on(&mut request);
        tokio::spawn(async move {
            let Ok(upgraded) = on_upgrade.await else {
                return;
            };
            let mut io = TokioIo::new(upgraded);
            let mut buf = [0u8; 1024];
            loop {
                match io.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if io.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("upgrade", "websocket")
            .header("connection", "upgrade")
            .header("sec-websocket-accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
            .body(Empty::new().map_err(|never| match never {}).boxed())
            .unwrap()
    })
    .await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;

    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(
            b"GET /ws HTTP/1.1\r\nHost: tongs\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
              Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        )
        .await
        .unwrap();
    let head = read_head(&mut stream).await.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    assert!(
        head.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );

    for message in [&b"first frame"[..], b"second frame"] {
        stream.write_all(message).await.unwrap();
        let mut echoed = vec![0u8; message.len()];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut echoed))
            .await
            .expect("echo arrives")
            .unwrap();
        assert_eq!(echoed, message);
    }
    let registry = Arc::clone(&proxy.app_registry);
    assert_eq!(
        registry.snapshot()[0].outstanding(),
        1,
        "an open upgrade is outstanding"
    );

    drop(stream);
    stop_once_idle(proxy, "upgrade").await;
}

/// Streams that reach one node at once are all open there together: however tongs finds out what a
/// node can take (`balance::line` opens a node it knows little of load by load, each load on its
/// first answer's first byte), it opens faster than streams end. Each stream here sends its first
/// event at once and ends 400 ms after it, shorter than the queue's own recheck would take to open
/// five loads one after the other. The node is an in-process backend standing in for a GPU node.
#[tokio::test]
async fn streams_that_reach_one_node_at_once_are_all_open_there_together() {
    let most = most_open_at_once(Duration::from_millis(400), None).await;
    assert_eq!(most, STREAMS, "the node held every stream open at once");
}

/// One first byte late (a hiccup on the path, the node's own) at a load the node is opened to keeps
/// the rest from that load only as long as it was late, though the streams that run hold the node
/// above that load's first: the next request there finds out, and it was no line. The 17th stream
/// at once, the first at the highest load bucket, waits `LATE` for its first event; each stream
/// ends 1.5 s after its first event, long after. The node is an in-process backend standing in for a GPU node.
#[tokio::test]
async fn one_late_first_byte_keeps_no_stream_from_a_node_for_long() {
    const LATE: Duration = Duration::from_millis(150);
    let most = most_open_at_once(Duration::from_millis(1_500), Some((17, LATE))).await;
    assert_eq!(most, STREAMS, "the node held every stream open at once");
}

/// How many streams [`most_open_at_once`] sends at once.
const STREAMS: usize = 50;

/// Sends one stream, then [`STREAMS`] at once, to one node whose streams send their first event at
/// once (or, the `late.0`th open at once, after `late.1`) and end `hold` after it; returns the most
/// it held open at once.
async fn most_open_at_once(hold: Duration, late: Option<(usize, Duration)>) -> usize {
    let open = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (o, m) = (Arc::clone(&open), Arc::clone(&most));
    let backend = backend(move |_request| {
        let (open, most) = (Arc::clone(&o), Arc::clone(&m));
        async move {
            let now = open.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            let (mut sender, body) = Channel::<Bytes, BoxError>::new(2);
            tokio::spawn(async move {
                if let Some((nth, by)) = late
                    && nth == now
                {
                    tokio::time::sleep(by).await;
                }
                let _ = sender.send_data(Bytes::from_static(b"data: 1\n\n")).await;
                tokio::time::sleep(hold).await;
                open.fetch_sub(1, Ordering::SeqCst);
                let _ = sender
                    .send_data(Bytes::from_static(b"data: [DONE]\n\n"))
                    .await;
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(body.boxed())
                .unwrap()
        }
    })
    .await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;
    let one = || {
        let request = Request::post(proxy.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(full(r#"{"stream":true}"#))
            .unwrap();
        tokio::time::timeout(Duration::from_secs(30), exchange(request))
    };
    // One stream first: tongs has seen how quickly the node answers alone, and nothing more.
    let (head, _) = one().await.expect("the first stream ends within 30 s");
    assert_eq!(head.status, StatusCode::OK);
    most.store(0, Ordering::SeqCst);

    let streams: Vec<_> = (0..STREAMS)
        .map(|_| {
            let stream = one();
            tokio::spawn(async move { stream.await.expect("a stream ends within 30 s") })
        })
        .collect();
    for stream in streams {
        let (head, body) = stream.await.unwrap();
        assert_eq!(head.status, StatusCode::OK, "{body}");
        assert_eq!(body, "data: 1\n\ndata: [DONE]\n\n");
    }
    stop_once_idle(proxy, "streams").await;
    most.load(Ordering::SeqCst)
}

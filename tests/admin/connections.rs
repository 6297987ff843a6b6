//! The admin port's own guards: a connection that sends nothing, or stops inside the HTTP/2 preface,
//! is closed after `timeouts.header_read`, and no more than `admin.max_connections` are open at once,
//! so idle connections cannot keep the kubelet's probes out for good.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tongs::config::Config;

use crate::support::*;

/// Everything the server sends until it closes the connection, or `None` if it is still open after
/// `limit`.
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

fn config(admin_extra: &str, header_read: &str) -> Config {
    let text = format!(
        "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0{admin_extra} }}\n\
         health: {{ enabled: false }}\ntimeouts: {{ header_read: {header_read} }}\n"
    );
    Config::parse(&text, "test").unwrap_or_else(|err| panic!("test config invalid: {err}\n{text}"))
}

#[tokio::test]
async fn a_silent_admin_connection_is_closed_after_header_read() {
    let proxy = start_proxy(config("", "1s")).await;
    let mut silent = TcpStream::connect(proxy.admin).await.unwrap();
    let mut half_preface = TcpStream::connect(proxy.admin).await.unwrap();
    half_preface.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert_eq!(
        get(&format!("http://{}/healthz", proxy.admin)).await,
        (200, "ok\n".to_owned())
    );
    // Eight times the configured limit, and less than any fixed limit of the admin port's own.
    let limit = Duration::from_secs(8);
    for (what, stream) in [("silent", &mut silent), ("half-preface", &mut half_preface)] {
        let received = read_until_closed(stream, limit).await.unwrap_or_else(|| {
            panic!("the admin port kept the {what} connection open for {limit:?}")
        });
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

#[tokio::test]
async fn admin_connections_beyond_the_cap_are_closed_and_probes_return_once_they_go() {
    // A header_read far beyond the test's waits: only the cap can close the extra connection.
    let proxy = start_proxy(config(", max_connections: 4", "60s")).await;
    let healthz = format!("http://{}/healthz", proxy.admin);
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(TcpStream::connect(proxy.admin).await.unwrap());
    }
    // Accepted after the four (the kernel hands connections over in order), so it finds no room.
    let mut extra = TcpStream::connect(proxy.admin).await.unwrap();
    let received = read_until_closed(&mut extra, Duration::from_secs(10))
        .await
        .expect("the connection beyond admin.max_connections is closed at once");
    assert!(
        received.is_empty(),
        "answered instead of closed: {}",
        String::from_utf8_lossy(&received)
    );
    for stream in &mut silent {
        assert!(
            read_until_closed(stream, Duration::from_millis(100))
                .await
                .is_none(),
            "a connection within the cap was closed"
        );
    }

    drop(silent);
    eventually_async(
        "/healthz answers again",
        Duration::from_secs(10),
        || async {
            match TcpStream::connect(proxy.admin).await {
                Ok(mut probe) => {
                    let request = b"GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
                    probe.write_all(request).await.is_ok()
                        && read_until_closed(&mut probe, Duration::from_secs(5))
                            .await
                            .is_some_and(|answer| answer.starts_with(b"HTTP/1.1 200"))
                }
                Err(_) => false,
            }
        },
    )
    .await;
    assert_eq!(get(&healthz).await, (200, "ok\n".to_owned()));
    proxy.stop().await;
}

//! The simulated GPU fleet behaves like the real nodes it stands for: each interruption kind shows up on
//! the socket the way it does in production, capacity limits concurrency, and seeds replay runs.

use std::time::Duration;

use crate::support::*;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tongs::config::HumanDuration;
use tongs::sim::{Condition, Fleet, Interruption, InterruptionKind, Node, NodeSpec, ResponseKind};

fn exact(name: &str, mean_ms: u64) -> NodeSpec {
    let mut spec = NodeSpec::new(name, Duration::from_millis(mean_ms));
    spec.service_time.spread = 0.0;
    spec
}

async fn fleet(nodes: Vec<NodeSpec>, seed: u64) -> Fleet {
    sim_fleet(seed, nodes).await
}

fn interrupted(kind: InterruptionKind) -> Condition {
    Condition::Interrupted { kind, factor: 20.0 }
}

async fn json(url: &str) -> (u16, serde_json::Value) {
    let (status, body) = get(url).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(serde_json::Value::Null),
    )
}

/// Sends a raw request on its own connection and returns what came back before the connection ended
/// (`Err` for a reset), or `None` when nothing happened within `wait`.
async fn raw_exchange(
    addr: std::net::SocketAddr,
    wait: Duration,
) -> Option<std::io::Result<Vec<u8>>> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    // `Connection: close` makes a healthy node end the connection after its answer.
    stream
        .write_all(b"GET /v1/generate HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut received = Vec::new();
    let read = tokio::time::timeout(wait, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => received.extend_from_slice(&buf[..n]),
                Err(err) => return Err(err),
            }
        }
    })
    .await;
    match read {
        Err(_elapsed) => None,
        Ok(Ok(())) => Some(Ok(received)),
        Ok(Err(err)) => Some(Err(err)),
    }
}

#[tokio::test]
async fn a_healthy_node_serves_json_sse_and_health() {
    let fleet = fleet(vec![exact("a", 30)], 1).await;
    let node = &fleet.nodes()[0];
    let (status, body) = json(&format!("{}/health", node.url())).await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));
    let (status, body) = json(&format!("{}/v1/generate", node.url())).await;
    assert_eq!(status, 200);
    assert_eq!(body["node"], "a");
    assert_eq!(body["service_ms"], 30);

    let request = Request::get(format!("{}/v1/chat", node.url()))
        .header("accept", "text/event-stream")
        .body(full(""))
        .unwrap();
    let response = client().request(request).await.unwrap();
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let text = String::from_utf8(
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    assert_eq!(text.matches("data: {").count(), 16, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(node.stats().served, 2);
}

/// A [`raw_exchange`] with `node` (reading for `wait`), once the node has it in flight.
async fn in_flight_at(
    node: &Node,
    wait: Duration,
) -> tokio::task::JoinHandle<Option<std::io::Result<Vec<u8>>>> {
    let in_flight = tokio::spawn(raw_exchange(node.addr(), wait));
    eventually("request in flight", Duration::from_secs(5), || {
        node.stats().in_flight == 1
    })
    .await;
    in_flight
}

#[tokio::test]
async fn refuse_resets_in_flight_connections_and_refuses_new_ones() {
    let fleet = fleet(vec![exact("a", 5_000)], 1).await;
    let node = &fleet.nodes()[0];
    let addr = node.addr();
    let in_flight = in_flight_at(node, Duration::from_secs(20)).await;

    node.set_condition(interrupted(InterruptionKind::Refuse));
    let outcome = in_flight
        .await
        .unwrap()
        .expect("the in-flight request ended at once, not after 5 s");
    let err = outcome.expect_err("in-flight connection was reset, not answered");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");

    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match TcpStream::connect(addr).await {
            Err(err) => {
                assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
                break;
            }
            Ok(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Ok(_) => panic!("new connections still accepted while refusing"),
        }
    }

    node.set_condition(Condition::Up);
    let mut recovered = None;
    for _ in 0..500 {
        if TcpStream::connect(addr).await.is_ok() {
            recovered = Some(());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        recovered.is_some(),
        "node back on the same port after recovery"
    );
    assert_eq!(node.stats().interruptions, 1);
}

#[tokio::test]
async fn blackhole_accepts_but_never_answers_then_recovers() {
    let fleet = fleet(vec![exact("a", 50)], 1).await;
    let node = &fleet.nodes()[0];
    // Control: while up, the same exchange completes with an answer.
    let answer = raw_exchange(node.addr(), Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    node.set_condition(interrupted(InterruptionKind::Blackhole));
    // Connected, request written, yet silence for far longer than the 50 ms service time.
    assert!(
        raw_exchange(node.addr(), Duration::from_secs(1))
            .await
            .is_none(),
        "a blackholed node answered"
    );
    // Health checks hang too.
    let health = tokio::time::timeout(
        Duration::from_millis(500),
        get(&format!("{}/health", node.url())),
    )
    .await;
    assert!(health.is_err(), "health answered during blackhole");

    node.set_condition(Condition::Up);
    let (status, _) = json(&format!("{}/v1/generate", node.url())).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn blackhole_freezes_requests_already_in_flight() {
    let fleet = fleet(vec![exact("a", 300)], 1).await;
    let node = &fleet.nodes()[0];
    let in_flight = in_flight_at(node, Duration::from_secs(2)).await;
    node.set_condition(interrupted(InterruptionKind::Blackhole));
    assert!(
        in_flight.await.unwrap().is_none(),
        "an in-flight request was answered after the node vanished"
    );
}

#[tokio::test]
async fn gateway_503_answers_everything_with_503_health_included() {
    let fleet = fleet(vec![exact("a", 10)], 1).await;
    let node = &fleet.nodes()[0];
    node.set_condition(interrupted(InterruptionKind::Gateway503));
    for path in ["/health", "/v1/generate"] {
        let (status, body) = get(&format!("{}{path}", node.url())).await;
        assert_eq!(status, 503, "{path}");
        assert!(body.contains("<html>"), "the gateway's HTML page: {body}");
    }
    assert_eq!(node.stats().gateway_503, 2);
    node.set_condition(Condition::Up);
    assert_eq!(get(&format!("{}/health", node.url())).await.0, 200);
}

#[tokio::test]
async fn slow_multiplies_the_service_time() {
    let fleet = fleet(vec![exact("a", 20)], 1).await;
    let node = &fleet.nodes()[0];
    node.set_condition(interrupted(InterruptionKind::Slow));
    let (_, body) = json(&format!("{}/v1/generate", node.url())).await;
    assert_eq!(body["service_ms"], 400, "20 ms × 20");
}

#[tokio::test]
async fn capacity_limits_concurrency_and_a_full_line_sheds_with_retry_after() {
    let mut spec = exact("a", 1_000);
    spec.capacity = 2;
    spec.queue = 1;
    let fleet = fleet(vec![spec], 1).await;
    let node = &fleet.nodes()[0];
    let url = format!("{}/v1/generate", node.url());
    let mut requests = Vec::new();
    for _ in 0..5 {
        let url = url.clone();
        requests.push(tokio::spawn(async move {
            let response = client().get(url.parse().unwrap()).await.unwrap();
            let retry_after = response.headers().get("retry-after").cloned();
            (response.status(), retry_after)
        }));
    }
    let mut ok = 0;
    let mut shed = 0;
    for request in requests {
        match request.await.unwrap() {
            (StatusCode::OK, _) => ok += 1,
            (StatusCode::SERVICE_UNAVAILABLE, Some(retry_after)) => {
                assert_eq!(retry_after, "1");
                shed += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // Two served at once, one waited its turn, two found the line full.
    assert_eq!((ok, shed), (3, 2));
    let stats = node.stats();
    assert_eq!(stats.peak_concurrency, 2);
    assert_eq!((stats.served, stats.shed), (3, 2));
}

#[tokio::test]
async fn seeds_reproduce_service_times() {
    async fn samples(seed: u64) -> Vec<u64> {
        let fleet = fleet(vec![NodeSpec::new("a", Duration::from_millis(5))], seed).await;
        let url = format!("{}/v1/generate", fleet.nodes()[0].url());
        let mut out = Vec::new();
        for _ in 0..8 {
            let (_, body) = json(&url).await;
            out.push(body["service_ms"].as_u64().unwrap());
        }
        out
    }
    let first = samples(11).await;
    assert_eq!(first, samples(11).await);
    assert_ne!(first, samples(12).await);
}

#[tokio::test]
async fn scheduled_interruptions_begin_and_end_on_time() {
    let mut spec = exact("a", 5);
    spec.response = ResponseKind::Json;
    spec.interruptions = vec![Interruption {
        kind: InterruptionKind::Gateway503,
        at: HumanDuration::from_millis(200),
        duration: HumanDuration::from_millis(400),
        factor: 1.0,
        notice: None,
    }];
    let fleet = fleet(vec![spec], 1).await;
    let node = &fleet.nodes()[0];
    eventually("interruption begins", Duration::from_secs(5), || {
        node.condition() == interrupted_with(InterruptionKind::Gateway503, 1.0)
    })
    .await;
    assert_eq!(get(&format!("{}/health", node.url())).await.0, 503);
    eventually("node recovers", Duration::from_secs(5), || {
        node.condition() == Condition::Up
    })
    .await;
    assert_eq!(get(&format!("{}/health", node.url())).await.0, 200);
    assert_eq!(fleet.interruptions_injected(), 1);
}

/// An interruption with notice: the node says it goes (`x-tongs-drain` on its heartbeat answers, with
/// the seconds left) from `at − notice`, then goes at `at` and no longer says so. The checks of what
/// `/health` answers are made only with half a second or more to spare before the next change.
#[tokio::test]
async fn an_interruption_with_notice_is_announced_then_happens() {
    let mut spec = exact("a", 5);
    spec.response = ResponseKind::Json;
    spec.interruptions = vec![Interruption {
        kind: InterruptionKind::Refuse,
        at: HumanDuration::from_secs(4),
        duration: HumanDuration::from_secs(30),
        factor: 1.0,
        notice: Some(HumanDuration::from_secs(3)),
    }];
    let fleet = fleet(vec![spec], 1).await;
    let node = &fleet.nodes()[0];
    let started = fleet.started();
    let health = format!("{}/health", node.url());
    let drain = || async {
        let (head, _) = exchange(Request::get(&health).body(full("")).expect("URL")).await;
        head.headers
            .get("x-tongs-drain")
            .map(|v| v.to_str().expect("text").parse::<f64>().expect("seconds"))
    };
    if started.elapsed() < Duration::from_millis(500) {
        assert_eq!(drain().await, None, "nothing said before the notice");
    }
    eventually("the node says it goes", Duration::from_secs(5), || {
        node.leaving_in().is_some()
    })
    .await;
    if started.elapsed() < Duration::from_millis(3500) {
        let left = drain().await;
        assert!(
            left.is_some_and(|left| (0.4..=3.0).contains(&left)),
            "{left:?}"
        );
    }
    eventually("the node goes", Duration::from_secs(8), || {
        node.condition() == interrupted_with(InterruptionKind::Refuse, 1.0)
    })
    .await;
    assert_eq!(node.leaving_in(), None, "gone, it no longer says it goes");
    assert_eq!(fleet.interruptions_injected(), 1);
}

fn interrupted_with(kind: InterruptionKind, factor: f64) -> Condition {
    Condition::Interrupted { kind, factor }
}

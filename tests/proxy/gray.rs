//! Gray failures and stalls: nodes whose health checks pass while their requests hang, streams that go
//! silent after their first chunk, and hedging's budget when every node is slow.
//!
//! The nodes are the simulator's (`tongs::sim`), standing in for GPU nodes: its `gray` interruption
//! answers `/health` and accepts connections while requests hang and streams stall after their first
//! chunk. The proxy keeps real time (its workers run runtimes of their own, over real sockets), so the
//! tests poll its state with deadlines; the bounds they assert are a few times the rule they check, so a
//! loaded machine does not fail them, while a proxy that waited on a hung node (seconds to minutes)
//! would.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;

use crate::support::*;
use tongs::sim::{Condition, InterruptionKind, NodeSpec, ResponseKind};

/// Heartbeats as a user would run them, but quicker, so the tests need not wait long for a verdict.
const HEALTH: &str = "health: { interval: 200ms, fast_interval: 100ms, timeout: 300ms }\n";

fn gray() -> Condition {
    Condition::Interrupted {
        kind: InterruptionKind::Gray,
        factor: 1.0,
    }
}

fn nodes(count: usize, mean_ms: u64) -> Vec<NodeSpec> {
    sim_nodes(count, Duration::from_millis(mean_ms), |spec| {
        spec.service_time.spread = 0.1;
        spec.capacity = 32;
        spec.queue = 64;
        spec.response = ResponseKind::Json;
    })
}

/// Sends `count` GETs at `rate` per second (open loop: a slow answer does not slow the sending), and
/// returns each one's status and latency.
async fn open_loop(url: &str, count: usize, rate: f64) -> Vec<(u16, Duration)> {
    let gap = Duration::from_secs_f64(1.0 / rate);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..count {
        tokio::time::sleep_until(start + gap * i as u32).await;
        let url = url.to_owned();
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let (status, _) = get(&url).await;
            (status, sent.elapsed())
        }));
    }
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    results
}

/// A per-endpoint metric's value for the endpoint at `url`.
async fn endpoint_sample(proxy: &TestProxy, metric: &str, url: &str) -> f64 {
    sample(proxy, &format!("{metric}{{endpoint=\"{url}\"}}")).await
}

/// The state /debug/endpoints gives the endpoint at `url`.
/// The endpoint's typical gap between its streams' chunks, as /debug/endpoints shows it (`None` before
/// one was seen).
async fn token_gap_ms(proxy: &TestProxy, url: &str) -> Option<f64> {
    endpoint_view(proxy, url).await["token_gap_ms"].as_f64()
}

async fn state_of(proxy: &TestProxy, url: &str) -> String {
    endpoint_view(proxy, url).await["state"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gray_node_under_steady_load_costs_no_request_and_little_time() {
    let fleet = sim_fleet(11, nodes(3, 60)).await;
    let urls = fleet.urls();
    let proxy = start_proxy(config_with(HEALTH, &urls)).await;
    let url = proxy.url("/v1/generate");
    // Warm up: every node has answered, so each has its own latency estimate.
    for (status, _) in open_loop(&url, 30, 60.0).await {
        assert_eq!(status, 200);
    }

    fleet.nodes()[1].set_condition(gray());
    let results = open_loop(&url, 240, 60.0).await;
    let failed = results.iter().filter(|(status, _)| *status != 200).count();
    let slowest = results.iter().map(|(_, took)| *took).max().unwrap();
    println!("{failed} of 240 failed; slowest {slowest:?}");
    assert_eq!(failed, 0, "a gray node cost requests");
    // A hung attempt is hedged after 250 ms (3 x 60 ms, floored) or, past the hedge budget, waits to
    // its stall point (500 ms) until the node is marked stalled; then one normal answer. A proxy that
    // waited for the hung node would take the whole response timeout.
    assert!(
        slowest < Duration::from_millis(2500),
        "slowest request took {slowest:?}"
    );
    assert_eq!(state_of(&proxy, &urls[1]).await, "stalled");
    assert!(sample(&proxy, "tongs_hedges_total").await >= 1.0);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_health_recovers_before_its_worker_is_not_trusted_until_it_answers() {
    let fleet = sim_fleet(12, nodes(2, 40)).await;
    let urls = fleet.urls();
    let proxy = start_proxy(config_with(HEALTH, &urls)).await;
    let url = proxy.url("/v1/generate");
    for (status, _) in open_loop(&url, 20, 50.0).await {
        assert_eq!(status, 200);
    }

    // The node vanishes: heartbeats declare it unhealthy.
    let node = &fleet.nodes()[0];
    node.set_condition(Condition::Interrupted {
        kind: InterruptionKind::Blackhole,
        factor: 1.0,
    });
    let (p, u) = (&proxy, &urls[0]);
    eventually_async(
        "heartbeats mark the node unhealthy",
        Duration::from_secs(10),
        move || async move { state_of(p, u).await == "unhealthy" },
    )
    .await;
    // Its health endpoint comes back before its worker does.
    node.set_condition(gray());
    eventually_async(
        "heartbeats pass again",
        Duration::from_secs(10),
        move || async move { state_of(p, u).await != "unhealthy" },
    )
    .await;
    let results = open_loop(&url, 150, 50.0).await;
    let failed = results.iter().filter(|(status, _)| *status != 200).count();
    let slowest = results.iter().map(|(_, took)| *took).max().unwrap();
    println!("{failed} of 150 failed; slowest {slowest:?}");
    assert_eq!(failed, 0);
    assert!(slowest < Duration::from_millis(2500), "slowest {slowest:?}");
    assert_eq!(state_of(&proxy, &urls[0]).await, "stalled");

    // The worker recovers: only a real request may bring the node back, and one does.
    node.set_condition(Condition::Up);
    let request = &url;
    eventually_async(
        "a probe request finds the node answering again",
        Duration::from_secs(90),
        move || async move {
            let (status, _) = get(request).await;
            assert_eq!(status, 200);
            matches!(state_of(p, u).await.as_str(), "healthy" | "slow-start")
        },
    )
    .await;
    proxy.stop().await;
}

/// A stream under way: its task, ending with [`stream_until_it_ends`]' result (or the [`HANG`] limit).
type UnderWay =
    tokio::task::JoinHandle<Result<(Duration, Result<(), String>), tokio::time::error::Elapsed>>;

/// Streams from each of `urls` at once, each until it ends (or [`HANG`]); returns once every one has
/// had its first chunk.
async fn streams_under_way(urls: Vec<String>) -> Vec<UnderWay> {
    let (first_tx, mut first_rx) = tokio::sync::mpsc::unbounded_channel();
    let streams: Vec<_> = urls
        .into_iter()
        .map(|url| {
            let first_tx = first_tx.clone();
            tokio::spawn(async move {
                let started = move |_: &[u8]| {
                    let _ = first_tx.send(());
                };
                tokio::time::timeout(HANG, stream_until_it_ends(&url, started)).await
            })
        })
        .collect();
    for _ in 0..streams.len() {
        tokio::time::timeout(HANG, first_rx.recv())
            .await
            .expect("every stream's first chunk")
            .expect("a first chunk");
    }
    streams
}

/// One streamed request: the time its first chunk arrived, and how and when the stream ended.
async fn stream_until_it_ends(
    url: &str,
    on_first_chunk: impl FnOnce(&[u8]),
) -> (Duration, Result<(), String>) {
    let request = http::Request::get(url)
        .header("accept", "text/event-stream")
        .body(full(Bytes::new()))
        .unwrap();
    let response = client().request(request).await.expect("response headers");
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut first = Some(on_first_chunk);
    let mut first_at = None;
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref()
                    && let Some(callback) = first.take()
                {
                    callback(data);
                    first_at = Some(Instant::now());
                }
            }
            Some(Err(err)) => {
                let stalled_for = first_at.map(|at| at.elapsed()).unwrap_or_default();
                return (stalled_for, Err(err.to_string()));
            }
            None => {
                let stalled_for = first_at.map(|at| at.elapsed()).unwrap_or_default();
                return (stalled_for, Ok(()));
            }
        }
    }
}

fn sse_nodes(count: usize) -> Vec<NodeSpec> {
    sim_nodes(count, Duration::from_millis(600), |spec| {
        spec.service_time.spread = 0.0;
        spec.tokens = 20;
        spec.response = ResponseKind::Sse;
    })
}

/// A plain SSE stream (one tongs cannot continue) that stalls after its first chunk on a node whose
/// heartbeats pass: its silence counts as a stall of the node at the idle limit, and the stream, which
/// a cut would lose, waits for the node until `stream.pause_max`, then ends as an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_stream_that_stalls_counts_against_its_node_and_ends_at_pause_max() {
    let fleet = sim_fleet(13, sse_nodes(1)).await;
    let extra = format!("{HEALTH}stream: {{ pause_max: 4s }}\n");
    let proxy = start_proxy(config_with(&extra, &fleet.urls())).await;
    let url = proxy.url("/v1/stream");
    // A whole stream first, so the endpoint knows its typical gap between chunks (~27 ms).
    let (_, ended) = stream_until_it_ends(&url, |_| {}).await;
    assert_eq!(ended, Ok(()));

    let node = &fleet.nodes()[0];
    let (stalled_for, ended) = stream_until_it_ends(&url, |_| node.set_condition(gray())).await;
    println!("stream ended {ended:?} {stalled_for:?} after its first chunk");
    assert!(
        ended.is_err(),
        "a stalled stream must end as an error the client sees"
    );
    // Counted as a stall at the idle limit, max(10 x 27 ms, stream.idle_min = 2 s); ended at pause_max
    // (4 s after tongs relayed the first chunk, a little less after the client read it), not at the
    // idle limit.
    assert!(
        stalled_for >= Duration::from_secs(3) && stalled_for < Duration::from_secs(10),
        "ended {stalled_for:?} after it stalled"
    );
    assert!(sample(&proxy, "tongs_streams_cut_total").await >= 1.0);
    let stalls = endpoint_sample(&proxy, "tongs_endpoint_stalls_total", &fleet.urls()[0]).await;
    assert_eq!(stalls, 1.0, "its silence counted once against the node");
    let failures = endpoint_sample(&proxy, "tongs_endpoint_failures_total", &fleet.urls()[0]).await;
    assert!(failures >= 1.0, "the stalled stream counts as a failure");
    proxy.stop().await;
}

/// A stalled node may resume (a worker back from a hang): plain SSE streams tongs cannot continue are
/// not cut for the stall, which a cut would turn into lost streams. The stalls still count, and the
/// node is marked stalled so no new request goes there; when it resumes, its streams end whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_streams_on_a_stalled_node_that_resumes_end_whole() {
    let fleet = sim_fleet(15, sse_nodes(1)).await;
    let extra = format!("{HEALTH}breaker: {{ max_ejected_percent: 100 }}\n");
    let proxy = start_proxy(config_with(&extra, &fleet.urls())).await;
    let url = proxy.url("/v1/stream");
    // A whole stream first, so the endpoint knows its typical gap between chunks.
    assert_eq!(stream_until_it_ends(&url, |_| {}).await.1, Ok(()));
    let node = &fleet.nodes()[0];
    let streams = streams_under_way(vec![url.clone(), url.clone()]).await;
    node.set_condition(gray());
    let wedged_at = Instant::now();
    // Both streams go silent with their node: two stalls mark it stalled (idle limit 2 s).
    eventually_async(
        "the node is marked stalled",
        Duration::from_secs(10),
        || {
            let (proxy, url) = (&proxy, fleet.urls()[0].clone());
            async move { state_of(proxy, &url).await == "stalled" }
        },
    )
    .await;
    // The worker comes back after 4 s, well within stream.pause_max (30 s).
    tokio::time::sleep(Duration::from_secs(4).saturating_sub(wedged_at.elapsed())).await;
    node.set_condition(Condition::Up);
    for stream in streams {
        let (_, ended) = stream.await.unwrap().expect("the stream ends");
        assert_eq!(ended, Ok(()), "whole after its node resumed");
    }
    let stalls = endpoint_sample(&proxy, "tongs_endpoint_stalls_total", &fleet.urls()[0]).await;
    assert!(stalls >= 2.0, "the stalls counted: {stalls}");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_node_heartbeats_declare_gone_ends_at_once() {
    // Two nodes: with none healthy at all, tongs takes its own network for broken (panic mode) and
    // leaves flowing streams alone.
    let fleet = sim_fleet(14, sse_nodes(2)).await;
    // An idle limit far beyond the test, so only the heartbeats' verdict can end the stream.
    let extra = format!("{HEALTH}stream: {{ idle_min: 60s }}\n");
    let proxy = start_proxy(config_with(&extra, &fleet.urls())).await;
    let url = proxy.url("/v1/stream");
    let blackhole = Condition::Interrupted {
        kind: InterruptionKind::Blackhole,
        factor: 1.0,
    };
    // The node that serves the stream names itself in every event.
    let silence = |chunk: &[u8]| {
        let text = String::from_utf8_lossy(chunk);
        let node = fleet
            .nodes()
            .iter()
            .find(|node| text.contains(&format!("\"node\":\"{}\"", node.name())))
            .expect("the first event names its node");
        node.set_condition(blackhole);
    };
    let (stalled_for, ended) = stream_until_it_ends(&url, silence).await;
    println!("stream ended {ended:?} {stalled_for:?} after its node went silent");
    assert!(ended.is_err());
    // Heartbeats every 100 ms while changing, 300 ms timeout, two failures: about a second.
    assert!(stalled_for < Duration::from_secs(10), "{stalled_for:?}");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hedging_stays_within_its_budget_when_every_node_is_slow() {
    let fleet = sim_fleet(15, nodes(3, 30)).await;
    let proxy = start_proxy(config_with("", &fleet.urls())).await;
    let url = proxy.url("/v1/generate");
    for (status, _) in open_loop(&url, 30, 60.0).await {
        assert_eq!(status, 200);
    }
    let received_before: u64 = fleet.requests_received();
    // Every node turns 20 x slower: every attempt passes its hedge delay (max(3 x 30 ms, 250 ms)).
    for node in fleet.nodes() {
        node.set_condition(Condition::Interrupted {
            kind: InterruptionKind::Slow,
            factor: 20.0,
        });
    }
    let results = open_loop(&url, 200, 40.0).await;
    let failed = results.iter().filter(|(status, _)| *status != 200).count();
    assert_eq!(failed, 0);
    let received: u64 = fleet.requests_received() - received_before;
    let hedges = sample(&proxy, "tongs_hedges_total").await;
    println!("200 requests: {received} attempts reached the nodes, {hedges} hedges");
    // 10 % of the requests plus the burst a quiet spell saves (10) per worker thread: the hedge budget,
    // counted where it costs, at the nodes.
    let workers = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    let allowed = 200.0 * 0.1 + 10.0 * workers;
    assert!(hedges <= allowed, "{hedges} hedges for 200 requests");
    assert!(
        received as f64 <= 200.0 + allowed,
        "{received} attempts reached the nodes for 200 requests"
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_heartbeat_finds_a_node_whose_health_endpoint_lies() {
    let fleet = sim_fleet(16, nodes(2, 30)).await;
    let urls = fleet.urls();
    let deep = "health:\n  interval: 200ms\n  fast_interval: 100ms\n  timeout: 300ms\n  request:\n    \
                method: POST\n    path: /v1/completions\n    headers: { content-type: application/json }\n    \
                body: '{\"prompt\": \"ping\", \"max_tokens\": 1}'\n    expected_status: 200\n";
    let proxy = start_proxy(config_with(deep, &urls)).await;
    // No client request at all: the heartbeats alone find the wedged worker behind a live /health.
    fleet.nodes()[0].set_condition(gray());
    let (p, u) = (&proxy, &urls[0]);
    eventually_async(
        "the deep heartbeat marks the gray node unhealthy",
        Duration::from_secs(10),
        move || async move { state_of(p, u).await == "unhealthy" },
    )
    .await;
    assert_ne!(state_of(&proxy, &urls[1]).await, "unhealthy");
    proxy.stop().await;
}

/// An SSE answer: `first`, then a chunk every `every` until `count` more went, or nothing more at all.
fn sse(first: &'static str, then: Option<(Duration, usize)>) -> http::Response<TestBody> {
    use http_body_util::StreamBody;
    let first = futures::stream::once(async move {
        Ok::<_, BoxError>(hyper::body::Frame::data(Bytes::from(first)))
    });
    let rest = futures::stream::unfold(0usize, move |sent| async move {
        match then {
            Some((every, count)) if sent < count => {
                tokio::time::sleep(every).await;
                Some((
                    Ok::<_, BoxError>(hyper::body::Frame::data(Bytes::from("data: more\n\n"))),
                    sent + 1,
                ))
            }
            Some(_) => None,
            // Silent for good: the node's worker is wedged.
            None => std::future::pending().await,
        }
    });
    let body = StreamBody::new(futures::StreamExt::chain(first, rest));
    http::Response::builder()
        .header("content-type", "text/event-stream")
        .body(BodyExt::boxed(body))
        .unwrap()
}

/// A stream that goes silent while its node goes on sending on its other streams is paused (vLLM
/// preempting a sequence, a slow prefill under load), not stalled: it is left alone until
/// `stream.pause_max`, then cut without counting against the node, which is never ejected for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_pause_while_their_node_serves_others_are_left_alone() {
    let node = backend(|request: http::Request<hyper::body::Incoming>| async move {
        match request.uri().path() {
            "/flow" => sse("data: first\n\n", Some((Duration::from_millis(50), 100))),
            _ => sse("data: first\n\n", None),
        }
    })
    .await;
    // One node, which the breaker may eject (a lone node is never ejected otherwise); idle limits of
    // at least 500 ms, first tokens included; a pause may last 3 s.
    let config = config_with(
        "breaker: { max_ejected_percent: 100 }\n\
         stream: { idle_min: 500ms, first_token_idle: 500ms, pause_max: 3s }\n",
        &[node.url()],
    );
    let proxy = start_proxy(config).await;
    let (flow_url, hang_url) = (proxy.url("/flow"), proxy.url("/hang"));
    let (flow_started_tx, flow_started) = tokio::sync::oneshot::channel();
    let flowing = tokio::spawn(async move {
        tokio::time::timeout(
            Duration::from_secs(20),
            stream_until_it_ends(&flow_url, move |_| {
                let _ = flow_started_tx.send(());
            }),
        )
        .await
    });
    // The paused streams start once the flowing one is under way: its first chunk has arrived.
    tokio::time::timeout(HANG, flow_started)
        .await
        .expect("the flowing stream's first chunk")
        .unwrap();
    let hanging: Vec<_> = (0..2)
        .map(|_| {
            let url = hang_url.clone();
            tokio::spawn(async move { stream_until_it_ends(&url, |_| {}).await })
        })
        .collect();
    for hung in hanging {
        let (silent_for, ended) = hung.await.unwrap();
        assert!(ended.is_err(), "a pause past pause_max ends the stream");
        assert!(
            silent_for >= Duration::from_millis(2900),
            "left alone until pause_max (3 s), not cut at its 500 ms limit: {silent_for:?}"
        );
    }
    // The flowing stream (5 s) was never touched, and the node was never taken for stalled.
    let (_, ended) = flowing.await.unwrap().expect("the flowing stream ends");
    assert_eq!(ended, Ok(()), "the flowing stream ends whole");
    assert_eq!(state_of(&proxy, &node.url()).await, "healthy");
    let of_node = |name: &str| format!("{name}{{endpoint=\"{}\"}}", node.url());
    assert_eq!(
        sample(&proxy, &of_node("tongs_endpoint_stalls_total")).await,
        0.0
    );
    assert_eq!(
        sample(&proxy, &of_node("tongs_endpoint_failures_total")).await,
        0.0
    );
    assert!(sample(&proxy, "tongs_stream_pauses_total").await >= 2.0);
    proxy.stop().await;
}

/// A node whose streams stop together while its heartbeats pass is stalled (a gray failure): its
/// streams' silences count as stalls at their idle limit, and two of them mark it stalled. These are
/// plain streams, which tongs cannot continue: they wait for the node until `stream.pause_max` (short
/// here), the one still waiting for its first tokens (a pause while the node served the others) with
/// them. What its HTTP layer still sends is no progress: keep-alive comments on the wedged streams,
/// and the first chunk of new requests (a server that sends a role chunk before its engine answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_streams_stop_together_is_stalled_and_its_other_streams_end_at_once() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let wedged = Arc::new(AtomicBool::new(false));
    let node = backend({
        let wedged = Arc::clone(&wedged);
        move |request: http::Request<hyper::body::Incoming>| {
            let wedged = Arc::clone(&wedged);
            async move {
                use http_body_util::StreamBody;
                let opening = request.uri().path() == "/opening";
                let first = futures::stream::once(async {
                    Ok::<_, BoxError>(hyper::body::Frame::data(Bytes::from("data: first\n\n")))
                });
                // Chunks every 50 ms until the worker wedges (the opening stream never gets its
                // first token); after, only a keep-alive comment every 100 ms.
                let rest = futures::stream::unfold((), move |()| {
                    let wedged = Arc::clone(&wedged);
                    async move {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        while opening && !wedged.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        let chunk = if wedged.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            Bytes::from(": ping\n\n")
                        } else {
                            Bytes::from("data: more\n\n")
                        };
                        Some((Ok::<_, BoxError>(hyper::body::Frame::data(chunk)), ()))
                    }
                });
                let body = StreamBody::new(futures::StreamExt::chain(first, rest));
                http::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(BodyExt::boxed(body))
                    .unwrap()
            }
        }
    })
    .await;
    let config = config_with(
        "breaker: { max_ejected_percent: 100 }\n\
         stream: { idle_min: 500ms, first_token_idle: 1s, pause_max: 2s }\n",
        &[node.url()],
    );
    let proxy = start_proxy(config).await;
    // Let the streams flow (each has its first chunk, and tongs has timed the flowing ones' gaps
    // between chunks), then wedge the node's worker: every stream stops at once.
    let paths = ["/flow", "/flow", "/flow", "/opening"];
    let streams = streams_under_way(paths.map(|path| proxy.url(path)).to_vec()).await;
    eventually_async("tongs knows the streams' gap between chunks", HANG, || {
        let (proxy, url) = (&proxy, node.url());
        async move { token_gap_ms(proxy, &url).await.is_some() }
    })
    .await;
    let wedged_at = Instant::now();
    wedged.store(true, Ordering::SeqCst);
    // New requests still get their first chunk, then keep-alives only (whatever becomes of them: one
    // sent after the node is ejected waits for it).
    let late: Vec<_> = (0..3)
        .map(|i| {
            let url = proxy.url("/opening");
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50 * i)).await;
                let request = http::Request::get(&url).body(full(Bytes::new())).unwrap();
                if let Ok(Ok(response)) =
                    tokio::time::timeout(HANG, client().request(request)).await
                {
                    let _ = tokio::time::timeout(HANG, response.into_body().collect()).await;
                }
            })
        })
        .collect();
    for stream in streams {
        let (_, ended) = stream.await.unwrap().expect("every stream ends");
        assert!(ended.is_err(), "cut, not finished: {ended:?}");
    }
    // The flowing streams' limit is 500 ms (10 gaps of 50 ms), the opening one's 1 s: stalls then;
    // every stream ends at pause_max, 2 s after its last chunk.
    let took = wedged_at.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "every stream ended {took:?} after the wedge"
    );
    assert_eq!(state_of(&proxy, &node.url()).await, "stalled");
    let stalls = sample(
        &proxy,
        &format!("tongs_endpoint_stalls_total{{endpoint=\"{}\"}}", node.url()),
    )
    .await;
    assert!(stalls >= 2.0, "the streams that stopped together: {stalls}");
    for request in late {
        request.abort();
    }
    proxy.stop().await;
}

/// A stalled node's half-open probe is judged by its stream, not by its headers: a gray node answers
/// headers and a first chunk while what follows hangs, so a probe that closed the breaker on its
/// headers would let the next requests onto a node that still stalls them. While the probe streams,
/// no other request goes there; its stall reopens the breaker; a probe that streams to its end closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_nodes_probe_is_judged_by_its_stream_not_its_headers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let arrived = Arc::new(AtomicUsize::new(0));
    let wedged = Arc::new(AtomicBool::new(true));
    let node = backend({
        let (arrived, wedged) = (Arc::clone(&arrived), Arc::clone(&wedged));
        move |_request: http::Request<hyper::body::Incoming>| {
            arrived.fetch_add(1, Ordering::SeqCst);
            let wedged = wedged.load(Ordering::SeqCst);
            async move {
                if wedged {
                    sse("data: first\n\n", None)
                } else {
                    sse("data: first\n\n", Some((Duration::from_millis(50), 12)))
                }
            }
        }
    })
    .await;
    // Plain streams wait for a stalled node until pause_max: short here, so the test need not wait.
    let config = config_with(
        "breaker: { max_ejected_percent: 100, base_ejection: 300ms, max_ejection: 2s }\n\
         stream: { idle_min: 500ms, first_token_idle: 500ms, pause_max: 1500ms }\n",
        &[node.url()],
    );
    let proxy = start_proxy(config).await;
    let url = proxy.url("/v1/stream");
    // Two silent streams mark the node stalled.
    let hanging: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { stream_until_it_ends(&url, |_| {}).await })
        })
        .collect();
    for hung in hanging {
        assert!(
            hung.await.unwrap().1.is_err(),
            "a silent stream ends as an error"
        );
    }
    assert_eq!(state_of(&proxy, &node.url()).await, "stalled");
    assert_eq!(arrived.load(Ordering::SeqCst), 2);

    // After the ejection, the probe: headers and a first chunk, then silence, as before. A fixed wait
    // on purpose: it outlasts base_ejection (300 ms), so the probe is sent once the node may be
    // probed; /debug/endpoints shows no end of the ejection to poll for.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (first_chunk_tx, first_chunk) = tokio::sync::oneshot::channel();
    let probe = tokio::spawn({
        let url = url.clone();
        async move {
            stream_until_it_ends(&url, move |_| {
                let _ = first_chunk_tx.send(());
            })
            .await
        }
    });
    tokio::time::timeout(Duration::from_secs(10), first_chunk)
        .await
        .expect("the probe's first chunk")
        .unwrap();
    assert_eq!(
        arrived.load(Ordering::SeqCst),
        3,
        "the probe reached the node"
    );
    // While the probe streams, another request waits rather than going to the node (its deadline
    // ends its wait with a refusal).
    let request = http::Request::get(&url)
        .header("accept", "text/event-stream")
        .header("x-tongs-timeout-ms", "200")
        .body(full(Bytes::new()))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), client().request(request))
        .await
        .expect("an answer within the request's deadline")
        .expect("response headers");
    assert_eq!(
        response.status(),
        503,
        "the probe's headers did not close the breaker"
    );
    drop(response);
    assert_eq!(
        arrived.load(Ordering::SeqCst),
        3,
        "nothing else reached the node"
    );
    let (_, ended) = tokio::time::timeout(Duration::from_secs(10), probe)
        .await
        .expect("the probe's stall ends it")
        .unwrap();
    assert!(ended.is_err(), "the probe stalled: {ended:?}");
    assert_eq!(state_of(&proxy, &node.url()).await, "stalled", "reopened");

    // The worker recovers: the next probe streams to its end, and the breaker closes.
    wedged.store(false, Ordering::SeqCst);
    eventually_async(
        "a probe that streams to its end closes the breaker",
        Duration::from_secs(15),
        || {
            let (url, proxy, node) = (url.clone(), &proxy, node.url());
            async move {
                let (_, ended) = stream_until_it_ends(&url, |_| {}).await;
                ended.is_ok()
                    && matches!(
                        state_of(proxy, &node).await.as_str(),
                        "healthy" | "slow-start"
                    )
            }
        },
    )
    .await;
    proxy.stop().await;
}

/// An attempt on a hung node is not left to wait for the node's ejection when the rest of the fleet
/// answers only after its stall point: it looks again until it waits alone and a second attempt
/// elsewhere has room. Here the other node is busy (a static limit of 1: no room for a hedge) and
/// answers after a second, long after the hung attempt's stall point; the hung node passes for healthy
/// and is never ejected (`max_ejected_percent: 0`), so only a second attempt can answer the request
/// before `timeouts.response_headers`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_on_a_hung_node_moves_once_the_rest_of_the_fleet_answers() {
    let hung = backend(
        |_request: http::Request<hyper::body::Incoming>| async move {
            std::future::pending::<()>().await;
            unreachable!()
        },
    )
    .await;
    let slow = backend(
        |_request: http::Request<hyper::body::Incoming>| async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            http::Response::new(full("ok"))
        },
    )
    .await;
    let config = config_with(
        "breaker: { max_ejected_percent: 0 }\n\
         stream: { first_token_idle: 300ms }\n\
         concurrency: { limit: static, max_outstanding_per_endpoint: 1 }\n\
         timeouts: { response_headers: 20s, total: 25s }\n",
        &[hung.url(), slow.url()],
    );
    let proxy = start_proxy(config).await;
    let url = proxy.url("/v1/work");
    let started = Instant::now();
    // Two at once: one on each node (one slot each).
    let requests: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let request = http::Request::post(&url).body(full("{}")).unwrap();
                let response = tokio::time::timeout(HANG, client().request(request))
                    .await
                    .expect("an answer")
                    .expect("response headers");
                (response.status(), started.elapsed())
            })
        })
        .collect();
    for request in requests {
        let (status, took) = request.await.unwrap();
        println!("answered {status} after {took:?}");
        assert_eq!(status, 200);
        // The slow node answers its own at 1 s, then the moved one at about 2 s.
        assert!(took < Duration::from_secs(6), "answered after {took:?}");
    }
    proxy.stop().await;
}

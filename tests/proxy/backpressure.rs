//! Back-pressure: per-endpoint concurrency limits, the queue, priorities, refusals and the adaptive
//! limit, over real sockets against the simulator's nodes (`tongs::sim`, standing in for GPU nodes) and
//! scripted in-process backends. How the adaptive limit settles near a node's capacity is checked in
//! `src/limit/`, in synthetic time; here, what the request path feeds it and how it reacts.
//!
//! Durations printed here are for reading; assertions on time only check what a wait proves (a refusal
//! came long before the wait it would otherwise have sat out), never how fast this machine is.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;

/// What a refusal (or any answer) carried.
#[derive(Debug)]
struct Answer {
    status: u16,
    reason: Option<String>,
    retry_after: Option<u64>,
    body: String,
    took: Duration,
}

/// Sends a POST with the given headers and reads the whole answer.
async fn ask(url: &str, headers: &[(&str, &str)]) -> Answer {
    let mut request = Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(full("{}")).unwrap();
    let started = Instant::now();
    let (head, body) = exchange(request).await;
    let header = |name: &str| {
        head.headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    Answer {
        status: head.status.as_u16(),
        reason: header("x-tongs-reject-reason"),
        retry_after: header("retry-after").map(|v| v.parse().expect("whole seconds")),
        body,
        took: started.elapsed(),
    }
}

/// A backend that answers only when the test adds a permit, recording each request's `x-tag` as it
/// arrives (with `+key` after it when an `Authorization` header came along).
pub(crate) async fn gated() -> (Backend, Gate, Arc<Mutex<Vec<String>>>) {
    let gate = Gate::default();
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let (g, a) = (gate.clone(), Arc::clone(&arrivals));
    let backend = backend(move |request: Request<Incoming>| {
        let (gate, arrivals) = (g.clone(), Arc::clone(&a));
        async move {
            let tag = request
                .headers()
                .get("x-tag")
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let key = if request.headers().contains_key("authorization") {
                "+key"
            } else {
                ""
            };
            arrivals.lock().unwrap().push(format!("{tag}{key}"));
            gate.pass().await;
            Response::new(full(tag))
        }
    })
    .await;
    (backend, gate, arrivals)
}

/// Waits until `n` requests wait in the proxy's queue.
pub(crate) async fn queued(proxy: &TestProxy, n: usize) {
    let queue = Arc::clone(&proxy.app_queue);
    eventually(
        &format!("{n} requests queued"),
        Duration::from_secs(10),
        || queue.len() == n,
    )
    .await;
}

/// Sends `count` requests at once to `url`; every one must be served.
async fn all_served(url: &str, count: usize) {
    let tasks: Vec<_> = (0..count)
        .map(|_| {
            let url = url.to_owned();
            tokio::spawn(async move { ask(&url, &[]).await })
        })
        .collect();
    for task in tasks {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, 200, "{answer:?}");
    }
}

#[tokio::test]
async fn a_static_limit_is_never_exceeded_at_the_node() {
    // Nodes that would take 40 requests at once (4 served, 36 waiting inside): only tongs' limit of 2
    // keeps the concurrency each node sees at 2.
    let fleet = sim_fleet(5, json_nodes(2, Duration::from_millis(40), 4, 36)).await;
    let config = "concurrency: { limit: static, max_outstanding_per_endpoint: 2 }\n";
    let proxy = start_proxy(config_with(config, &fleet.urls())).await;

    let url = proxy.url("/v1/generate");
    all_served(&url, 80).await;
    let queue = &proxy.app_queue;
    let enqueued = queue.stats().enqueued.load(Ordering::Relaxed);
    for node in fleet.nodes() {
        let stats = node.stats();
        println!(
            "{}: served {}, peak concurrency at the node {}",
            node.url(),
            stats.served,
            stats.peak_in_flight
        );
        assert!(
            stats.peak_in_flight <= 2,
            "{}: {} at once",
            node.url(),
            stats.peak_in_flight
        );
        assert!(stats.served > 0);
    }
    assert!(enqueued > 0, "80 requests for 4 slots: most waited");
    println!("{enqueued} of 80 requests waited in the queue");
    proxy.stop().await;
}

/// A static endpoint's own `max_outstanding` (its batch size, as HAProxy's `maxconn` or a pod's
/// `tongs.dev/max-outstanding` gives it) caps what it is sent even with no limit configured: the rest
/// waits in tongs' queue for the first free slot, not in one node's own queue.
#[tokio::test]
async fn a_static_endpoints_own_cap_holds_without_a_configured_limit() {
    let fleet = sim_fleet(6, json_nodes(2, Duration::from_millis(40), 4, 36)).await;
    let urls = fleet.urls();
    let text = format!(
        "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\nhealth: {{ enabled: false }}\n\
         discovery:\n  static:\n    - url: {}\n      max_outstanding: 3\n    - url: {}\n      \
         max_outstanding: 1\n",
        urls[0], urls[1]
    );
    let proxy = start_proxy(tongs::config::Config::parse(&text, "test").unwrap()).await;
    let url = proxy.url("/v1/generate");
    all_served(&url, 60).await;
    for (node, cap) in fleet.nodes().iter().zip([3, 1]) {
        let stats = node.stats();
        assert!(
            stats.peak_in_flight <= cap,
            "{}: {} at once, cap {cap}",
            node.url(),
            stats.peak_in_flight
        );
        assert!(stats.served > 0, "{}: served nothing", node.url());
    }
    assert!(
        proxy.app_queue.stats().enqueued.load(Ordering::Relaxed) > 0,
        "60 requests for 4 slots: most waited in tongs' queue"
    );
    let zero = "discovery:\n  static:\n    - url: http://127.0.0.1:9\n      max_outstanding: 0\n";
    let err = tongs::config::Config::parse(zero, "test")
        .unwrap_err()
        .to_string();
    assert!(err.contains("discovery.static[0].max_outstanding"), "{err}");
    proxy.stop().await;
}

#[tokio::test]
async fn the_queue_releases_by_priority_then_in_order_of_arrival() {
    let (backend, gate, arrivals) = gated().await;
    let config = "concurrency: { limit: static, max_outstanding_per_endpoint: 1 }\n\
                  queue: { shed_low_priority_after: 60s }\n";
    let proxy = start_proxy(config_with(config, &[backend.url()])).await;
    let url = proxy.url("/v1/generate");

    // The first request takes the only slot; the others queue in this order.
    let order = [
        ("busy", None),
        ("low-1", Some("low")),
        ("normal-1", None),
        ("high-1", Some("high")),
        ("normal-2", Some("normal")),
        ("low-2", Some("LOW")),
        ("high-2", Some("high")),
    ];
    let mut tasks = Vec::new();
    for (i, (tag, priority)) in order.iter().enumerate() {
        let url = url.clone();
        let (tag, priority) = (*tag, *priority);
        tasks.push(tokio::spawn(async move {
            let mut headers = vec![("x-tag", tag)];
            if let Some(priority) = priority {
                headers.push(("x-priority", priority));
            }
            ask(&url, &headers).await
        }));
        if i == 0 {
            eventually("the first request at the backend", HANG, || {
                arrivals.lock().unwrap().len() == 1
            })
            .await;
        } else {
            queued(&proxy, i).await;
        }
    }
    // One answer at a time: each frees the slot for the next in line, which reaches the backend before
    // the next answer is let go.
    for released in 1..=order.len() {
        gate.release(1);
        if released < order.len() {
            eventually("the next in line at the backend", HANG, || {
                arrivals.lock().unwrap().len() == released + 1
            })
            .await;
        }
    }
    for task in tasks {
        assert_eq!(task.await.unwrap().status, 200);
    }
    assert_eq!(
        *arrivals.lock().unwrap(),
        [
            "busy", "high-1", "high-2", "normal-1", "normal-2", "low-1", "low-2"
        ]
    );
    proxy.stop().await;
}

#[tokio::test]
async fn waits_end_at_max_wait_or_the_clients_deadline_with_queue_timeout() {
    let (backend, gate, _arrivals) = gated().await;
    let config = "concurrency: { limit: static, max_outstanding_per_endpoint: 1 }\n\
                  queue: { max_wait: 400ms }\n";
    let proxy = start_proxy(config_with(config, &[backend.url()])).await;
    let url = proxy.url("/v1/generate");
    let busy = tokio::spawn({
        let url = url.clone();
        async move { ask(&url, &[]).await }
    });
    eventually("the slot taken", HANG, || {
        proxy.app_registry.snapshot()[0].outstanding() == 1
    })
    .await;

    let waited = ask(&url, &[]).await;
    println!("max_wait 400ms: refused after {:?}", waited.took);
    assert_eq!(waited.status, 503, "{waited:?}");
    assert_eq!(waited.reason.as_deref(), Some("queue-timeout"));
    assert!(
        waited.body.contains(r#""reason":"queue-timeout""#),
        "{waited:?}"
    );
    assert!(waited.took >= Duration::from_millis(400), "{waited:?}");
    let retry_after = waited.retry_after.expect("Retry-After on a refusal");
    assert_eq!(
        retry_after, 1,
        "nothing drains: max_wait, rounded up to whole seconds"
    );

    // The client's own deadline is shorter than max_wait: it ends the wait.
    let deadline = ask(&url, &[("x-tongs-timeout-ms", "150")]).await;
    println!("deadline 150ms: refused after {:?}", deadline.took);
    assert_eq!(deadline.reason.as_deref(), Some("queue-timeout"));
    assert!(deadline.took >= Duration::from_millis(150));
    assert!(deadline.took < Duration::from_millis(400), "{deadline:?}");

    // A deadline that is not a number of milliseconds is the client's mistake.
    let bad = ask(&url, &[("x-tongs-timeout-ms", "soon")]).await;
    assert_eq!(bad.status, 400, "{bad:?}");
    assert!(bad.body.contains("x-tongs-timeout-ms"), "{bad:?}");

    gate.release(1);
    assert_eq!(busy.await.unwrap().status, 200);
    let stats = proxy.app_queue.stats();
    assert_eq!(stats.rejected(tongs::admission::Refusal::QueueTimeout), 2);
    proxy.stop().await;
}

#[tokio::test]
async fn a_full_queue_refuses_at_once_and_high_priority_displaces_the_newest_low() {
    let (backend, gate, _arrivals) = gated().await;
    let config = "concurrency: { limit: static, max_outstanding_per_endpoint: 1 }\n\
                  queue: { max_length: 2, max_wait: 30s, shed_low_priority_after: 60s }\n";
    let proxy = start_proxy(config_with(config, &[backend.url()])).await;
    let url = proxy.url("/v1/generate");
    let spawn = |headers: Vec<(&'static str, &'static str)>| {
        let url = url.clone();
        tokio::spawn(async move { ask(&url, &headers).await })
    };
    let busy = spawn(vec![]);
    eventually("the slot taken", HANG, || {
        proxy.app_registry.snapshot()[0].outstanding() == 1
    })
    .await;
    let normal = spawn(vec![]);
    queued(&proxy, 1).await;
    let low = spawn(vec![("x-priority", "low")]);
    queued(&proxy, 2).await;

    // Full, and a normal arrival cannot displace a normal waiter... but it can displace the low one.
    let high = spawn(vec![("x-priority", "high")]);
    let displaced = low.await.unwrap();
    println!(
        "displaced low-priority waiter answered after {:?}",
        displaced.took
    );
    assert_eq!(displaced.status, 503);
    assert_eq!(displaced.reason.as_deref(), Some("shed-low-priority"));
    queued(&proxy, 2).await;

    // The demand signal for autoscaling: one on the endpoint, two waiting, room for one.
    let (status, demand) = get(&format!("http://{}/demand", proxy.admin)).await;
    assert_eq!(status, 200);
    let demand: serde_json::Value = serde_json::from_str(&demand).unwrap();
    let figures = serde_json::json!({"queued": 2, "outstanding": 1, "demand": 3, "capacity": 1, "endpoints": 1});
    // The totals, and the one pool's own.
    let mut total = figures.clone();
    total["pools"] = serde_json::json!({ "default": figures });
    assert_eq!(demand, total);

    let refused = ask(&url, &[]).await;
    println!("full queue refused in {:?}", refused.took);
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.reason.as_deref(), Some("queue-full"));
    assert!(
        refused.took < Duration::from_secs(5),
        "a full queue answers at once, not after max_wait (30 s): {refused:?}"
    );
    let retry_after = refused.retry_after.expect("Retry-After");
    assert!((1..=30).contains(&retry_after), "{retry_after}");

    gate.release(3);
    for task in [busy, high, normal] {
        assert_eq!(task.await.unwrap().status, 200);
    }
    proxy.stop().await;
}

#[tokio::test]
async fn retry_after_follows_how_fast_the_queue_drains() {
    // One slot, 100 ms per request: the queue drains at about 10 requests a second.
    let slow = backend(|_request: Request<Incoming>| async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Response::new(full("ok"))
    })
    .await;
    let config = "concurrency: { limit: static, max_outstanding_per_endpoint: 1 }\n\
                  queue: { max_length: 10, max_wait: 60s, target_wait: 0s }\n";
    let proxy = start_proxy(config_with(config, &[slow.url()])).await;
    let url = proxy.url("/v1/generate");
    // 25 requests a second for 3 s against 10 a second of capacity.
    let mut tasks = Vec::new();
    for _ in 0..75 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move { ask(&url, &[]).await }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let mut late_refusals = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        let answer = task.await.unwrap();
        match answer.status {
            200 => {}
            503 => {
                assert_eq!(answer.reason.as_deref(), Some("queue-full"));
                if i >= 50 {
                    late_refusals.push(answer.retry_after.expect("Retry-After"));
                }
            }
            other => panic!("unexpected {other}: {answer:?}"),
        }
    }
    println!("Retry-After of refusals in the last second: {late_refusals:?}");
    assert!(
        !late_refusals.is_empty(),
        "2.5× the capacity must overflow a queue of 10"
    );
    // 10 ahead at ~10 per second: about 1–2 s, far from the 60 s a constant max_wait would say.
    for seconds in &late_refusals {
        assert!((1..=4).contains(seconds), "{late_refusals:?}");
    }
    proxy.stop().await;
}

#[tokio::test]
async fn an_endpoint_that_pushes_back_cools_down_then_takes_traffic_again() {
    // The first request gets 429 with Retry-After: 1, every later one is served.
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&hits);
    let node = backend(move |_request: Request<Incoming>| {
        let counter = Arc::clone(&counter);
        async move {
            if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                Response::builder()
                    .status(429)
                    .header("retry-after", "1")
                    .body(full("slow down"))
                    .unwrap()
            } else {
                Response::new(full("ok"))
            }
        }
    })
    .await;
    let proxy = start_proxy(config_with("", &[node.url()])).await;
    let url = proxy.url("/v1/generate");

    // Turned away by the only endpoint, the request waits in the queue for the cooldown to end
    // instead of failing, and is served then: back-pressure says "later", not "broken".
    let pushed = ask(&url, &[]).await;
    println!(
        "request refused with Retry-After: 1 answered after {:?}",
        pushed.took
    );
    assert_eq!(pushed.status, 200, "{pushed:?}");
    assert!(
        pushed.took >= Duration::from_millis(800),
        "the cooldown was respected: {pushed:?}"
    );
    let endpoint = Arc::clone(&proxy.app_registry.snapshot()[0]);
    assert_eq!(endpoint.tally().cooldowns(), 1);
    assert_eq!(
        endpoint.tally().failures(),
        0,
        "back-pressure is not a failure"
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        2,
        "the refusal, then its retry"
    );

    // A 429 again, and a second request sent during the cooldown it starts: that one waits in the
    // queue instead of hitting the node, and goes once the cooldown ends.
    hits.store(0, Ordering::SeqCst);
    let refused = tokio::spawn({
        let url = url.clone();
        async move { ask(&url, &[]).await }
    });
    eventually_async(
        "the node refused the first request",
        Duration::from_secs(10),
        || async { endpoint.tally().cooldowns() == 2 },
    )
    .await;
    let waited = ask(&url, &[]).await;
    println!(
        "request sent during a 1 s cooldown answered after {:?}",
        waited.took
    );
    assert_eq!(waited.status, 200, "{waited:?}");
    assert!(
        waited.took >= Duration::from_millis(500),
        "the cooldown was respected: {waited:?}"
    );
    assert_eq!(refused.await.unwrap().status, 200);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        3,
        "the refusal, then both requests after the cooldown"
    );
    assert_eq!(proxy.app_queue.stats().admitted.load(Ordering::Relaxed), 3);
    proxy.stop().await;
}

/// Closed-loop load: `clients` tasks sending one request after another until `stop`.
fn load(url: String, clients: usize, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<usize>> {
    (0..clients)
        .map(|_| {
            let (url, stop) = (url.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut ok = 0;
                while !stop.load(Ordering::Relaxed) {
                    if ask(&url, &[]).await.status == 200 {
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect()
}

/// How the adaptive limit settles near a node's capacity is checked in `src/limit/mod.rs`'s unit tests, on
/// a simulated node under closed-loop load in synthetic time; this checks the request path's side of it:
/// the limit learns from real answers, grows while the node takes everything, and comes down as soon
/// as the node refuses.
#[tokio::test]
async fn the_adaptive_limit_drops_when_the_node_rejects() {
    // A node that answers 429 beyond 2 requests at once (after a first phase where it took 6): the
    // limit learnt must come down.
    let rejecting = Arc::new(AtomicBool::new(false));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (r, f) = (Arc::clone(&rejecting), Arc::clone(&in_flight));
    let node = backend(move |_request: Request<Incoming>| {
        let (rejecting, in_flight) = (Arc::clone(&r), Arc::clone(&f));
        async move {
            let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            let response = if rejecting.load(Ordering::SeqCst) && now > 2 {
                Response::builder()
                    .status(429)
                    .header("retry-after", "0")
                    .body(full("busy"))
                    .unwrap()
            } else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Response::new(full("ok"))
            };
            in_flight.fetch_sub(1, Ordering::SeqCst);
            response
        }
    })
    .await;
    let config = "concurrency: { limit: adaptive, max_outstanding_per_endpoint: 8 }\n";
    let proxy = start_proxy(config_with(config, &[node.url()])).await;
    let endpoint = Arc::clone(&proxy.app_registry.snapshot()[0]);
    let stop = Arc::new(AtomicBool::new(false));
    let clients = load(proxy.url("/v1/generate"), 16, Arc::clone(&stop));
    eventually(
        "the limit grows past 4 while the node takes everything",
        Duration::from_secs(20),
        || endpoint.load().limit().is_some_and(|l| l > 4),
    )
    .await;
    let before = endpoint.load().limit().unwrap();
    rejecting.store(true, Ordering::SeqCst);
    let cut = Instant::now();
    eventually(
        "the limit comes down to what the node accepts",
        Duration::from_secs(10),
        || endpoint.load().limit().is_some_and(|l| l <= 3),
    )
    .await;
    println!(
        "limit {before} → {} within {:?} of the node starting to reject",
        endpoint.load().limit().unwrap(),
        cut.elapsed()
    );
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }
    proxy.stop().await;
}

#[tokio::test]
async fn a_retry_waits_in_the_queue_for_a_full_endpoint_it_has_not_tried() {
    // A holds its requests until the test lets them go; B pushes back on everything.
    let (a, gate, arrivals) = gated().await;
    let refusals = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&refusals);
    let b = backend(move |_request: Request<Incoming>| {
        let counter = Arc::clone(&counter);
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            Response::builder()
                .status(429)
                .header("retry-after", "0")
                .body(full("busy"))
                .unwrap()
        }
    })
    .await;
    let config = "concurrency: { limit: static, max_outstanding_per_endpoint: 1 }\n";
    let proxy = start_proxy(config_with(config, &[a.url(), b.url()])).await;
    let url = proxy.url("/v1/generate");
    let spawn = |tag: &'static str| {
        let url = url.clone();
        tokio::spawn(async move { ask(&url, &[("x-tag", tag)]).await })
    };

    // Whether it tries B first or not, the first request ends up holding A's only slot.
    let first = spawn("first");
    eventually("the first request at A", HANG, || {
        arrivals.lock().unwrap().len() == 1
    })
    .await;
    // The second finds A full, goes to B, is pushed back, and waits for A instead of failing.
    let before = refusals.load(Ordering::SeqCst);
    let second = spawn("second");
    queued(&proxy, 1).await;
    assert_eq!(
        refusals.load(Ordering::SeqCst),
        before + 1,
        "B was tried first"
    );
    gate.release(2);
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!((first.status, first.body.as_str()), (200, "first"));
    assert_eq!(
        (second.status, second.body.as_str()),
        (200, "second"),
        "{second:?}"
    );
    assert_eq!(*arrivals.lock().unwrap(), ["first", "second"]);
    proxy.stop().await;
}

/// A node that serves one request at a time, when the gate lets it, and refuses any other with 503 and
/// `Retry-After` (a model server's "busy"); counts its refusals.
async fn one_at_a_time(gate: Gate, refusals: Arc<AtomicUsize>) -> Backend {
    let busy = Arc::new(AtomicBool::new(false));
    backend(move |_request: Request<Incoming>| {
        let (gate, refusals, busy) = (gate.clone(), Arc::clone(&refusals), Arc::clone(&busy));
        async move {
            if busy.swap(true, Ordering::SeqCst) {
                refusals.fetch_add(1, Ordering::SeqCst);
                return Response::builder()
                    .status(503)
                    .header("retry-after", "1")
                    .body(full("busy"))
                    .unwrap();
            }
            gate.pass().await;
            busy.store(false, Ordering::SeqCst);
            Response::new(full("ok"))
        }
    })
    .await
}

#[tokio::test]
async fn a_request_every_busy_node_turned_away_waits_for_the_next_free_slot() {
    // Two nodes of one slot each, both serving, and a third request: each node refuses it as busy.
    // That is "later", not "broken": the request waits in tongs' queue and is served once a slot
    // frees, instead of getting a busy node's 503.
    let gate = Gate::default();
    let refusals = Arc::new(AtomicUsize::new(0));
    let a = one_at_a_time(gate.clone(), Arc::clone(&refusals)).await;
    let b = one_at_a_time(gate.clone(), Arc::clone(&refusals)).await;
    let proxy = start_proxy(config_with("", &[a.url(), b.url()])).await;
    let url = proxy.url("/v1/generate");
    let send = || {
        let url = url.clone();
        tokio::spawn(async move { ask(&url, &[]).await })
    };
    let serving = [send(), send()];
    let registry = Arc::clone(&proxy.app_registry);
    eventually(
        "both nodes serve one request",
        Duration::from_secs(10),
        || registry.snapshot().iter().all(|e| e.outstanding() == 1),
    )
    .await;
    let turned_away = send();
    eventually(
        "both nodes refused the third request",
        Duration::from_secs(10),
        || refusals.load(Ordering::SeqCst) >= 2,
    )
    .await;
    queued(&proxy, 1).await;
    assert!(!turned_away.is_finished(), "it waits rather than failing");

    gate.release(3);
    for task in serving {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, 200, "{answer:?}");
    }
    let answer = turned_away.await.unwrap();
    assert_eq!(answer.status, 200, "served once a slot freed: {answer:?}");
    assert_eq!(
        refusals.load(Ordering::SeqCst),
        2,
        "it was sent again only once"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_node_that_refused_while_busy_gets_no_more_than_it_held_until_the_hold_lifts() {
    // No limit configured. The node serves one request at a time; the second request is refused, and
    // from then on tongs holds the node to one: the third waits in tongs' queue instead of being sent
    // to find out by a refusal of its own.
    let gate = Gate::default();
    let refusals = Arc::new(AtomicUsize::new(0));
    let node = one_at_a_time(gate.clone(), Arc::clone(&refusals)).await;
    let proxy = start_proxy(config_with("", &[node.url()])).await;
    let url = proxy.url("/v1/generate");
    let send = || {
        let url = url.clone();
        tokio::spawn(async move { ask(&url, &[]).await })
    };
    let first = send();
    let registry = Arc::clone(&proxy.app_registry);
    eventually("the endpoint in service", Duration::from_secs(10), || {
        !registry.snapshot().is_empty()
    })
    .await;
    let endpoint = Arc::clone(&registry.snapshot()[0]);
    eventually(
        "the first request at the node",
        Duration::from_secs(10),
        || endpoint.outstanding() == 1,
    )
    .await;
    let second = send();
    eventually(
        "the node refused the second",
        Duration::from_secs(10),
        || refusals.load(Ordering::SeqCst) == 1,
    )
    .await;
    // The node counts its refusal before tongs has read it: the hold follows a moment later.
    eventually("held to what it held", Duration::from_secs(10), || {
        endpoint.load().limit() == Some(1)
    })
    .await;
    assert_eq!(endpoint.load().limit(), Some(1), "held to what it held");
    let third = send();
    queued(&proxy, 2).await;
    assert_eq!(refusals.load(Ordering::SeqCst), 1, "the third was not sent");

    // (The hold lasts 2 s; everything above takes milliseconds.)
    gate.release(3);
    for task in [first, second, third] {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, 200, "{answer:?}");
    }
    proxy.stop().await;
}

/// The limit tongs enforces on each of `fleet`'s nodes now, in the fleet's order.
fn limits_in_force(
    registry: &tongs::registry::Registry,
    fleet: &tongs::sim::Fleet,
) -> Vec<Option<u64>> {
    let snapshot = registry.snapshot();
    fleet
        .urls()
        .iter()
        .map(|url| {
            snapshot
                .iter()
                .find(|e| e.url() == url)
                .and_then(|e| e.load().limit())
        })
        .collect()
}

/// With no limit configured, a node that refuses past a line of its own is held to its batch, not to
/// its batch and its line: its first refusal says what it holds in all, and from then on the profile
/// of its answers by load (`Learner::Refused`) shows where its answers start to wait, so requests
/// beyond its batch wait in tongs' queue, for whichever node frees a slot first, instead of in one
/// node's line. The fleet is the simulator's nodes (standing in for GPU servers that shed load:
/// `capacity` at once, 100 ms each, `queue` more waiting inside, 503 + `Retry-After` beyond), under
/// closed-loop load of three times what they serve at once. Before, such a node was held to what it
/// held (its batch and its line) for 2 s at a time, then sent more until it refused again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_refuses_past_a_line_of_its_own_is_held_to_its_batch() {
    let node = |name: &str, capacity: usize| {
        let mut spec = tongs::sim::NodeSpec::new(name, Duration::from_millis(100));
        spec.service_time.spread = 0.1;
        spec.capacity = capacity;
        spec.queue = capacity;
        spec
    };
    let fleet = sim_fleet(12, vec![node("four", 4), node("two", 2)]).await;
    let proxy = start_proxy(config_with("", &fleet.urls())).await;
    let stop = Arc::new(AtomicBool::new(false));
    let clients = load(proxy.url("/v1/generate"), 18, Arc::clone(&stop));
    let limits = || limits_in_force(&proxy.app_registry, &fleet);
    // At its batch, or one above while the level past it is measured; never its batch and its line.
    let near = |capacity: u64, limit: Option<u64>| {
        limit.is_some_and(|l| (capacity..=capacity + capacity / 3 + 1).contains(&l))
    };
    let settled = |limits: &[Option<u64>]| near(4, limits[0]) && near(2, limits[1]);
    // Settled: both near their batch for longer than a hold (2 s) lasts, polled every 50 ms.
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut since: Option<Instant> = None;
    let mut last = Vec::new();
    while since.is_none_or(|since| since.elapsed() < Duration::from_millis(2500)) {
        assert!(
            Instant::now() < deadline,
            "each node held near its batch (4, 2) for 2.5 s on end, within 40 s; last seen {last:?}"
        );
        last = limits();
        since = if settled(&last) {
            since.or(Some(Instant::now()))
        } else {
            None
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Held at its batch, a node has nobody waiting inside it, so it refuses nobody.
    let shed = || fleet.nodes().iter().map(|n| n.stats().shed).sum::<u64>();
    let before = shed();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let refused_since = shed() - before;
    stop.store(true, Ordering::SeqCst);
    let mut served = 0;
    for client in clients {
        served += client.await.unwrap();
    }
    println!(
        "limits (4, 2): {last:?}; {served} served; refused by the nodes after settling: {refused_since}"
    );
    assert!(served > 0);
    assert_eq!(refused_since, 0, "no node refused once held to its batch");
    proxy.stop().await;
}

/// A model server as loaded inference servers behave: `slots` requests served at once, each for
/// `service`; `line` more wait inside it; beyond that it answers 503 with `Retry-After: 1`.
async fn model_server(slots: usize, line: usize, service: Duration) -> Backend {
    let serving = Arc::new(tokio::sync::Semaphore::new(slots));
    let inside = Arc::new(AtomicUsize::new(0));
    backend(move |_request: Request<Incoming>| {
        let (serving, inside) = (Arc::clone(&serving), Arc::clone(&inside));
        async move {
            if inside.fetch_add(1, Ordering::SeqCst) >= slots + line {
                inside.fetch_sub(1, Ordering::SeqCst);
                return Response::builder()
                    .status(503)
                    .header("retry-after", "1")
                    .body(full("busy"))
                    .unwrap();
            }
            let permit = serving.acquire().await.unwrap();
            tokio::time::sleep(service).await;
            drop(permit);
            inside.fetch_sub(1, Ordering::SeqCst);
            Response::new(full("ok"))
        }
    })
    .await
}

/// Open-loop load, whatever the answers: `per_second` requests a second for `seconds`, for each step
/// of `steps` in turn; each answer with the time its request was sent, from the start.
async fn open_loop(url: &str, steps: &[(u32, u32)]) -> Vec<(Duration, Answer)> {
    let start = Instant::now();
    let mut at = start;
    let mut tasks = Vec::new();
    for &(per_second, seconds) in steps {
        let gap = Duration::from_secs(1) / per_second;
        for _ in 0..per_second * seconds {
            tokio::time::sleep_until(at).await;
            at += gap;
            let url = url.to_owned();
            tasks.push(tokio::spawn(async move {
                let sent = Instant::now() - start;
                (sent, ask(&url, &[]).await)
            }));
        }
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    answers
}

/// Sustained overload (twice what two nodes serve, for 6 s, with the defaults but for a short
/// `target_wait`): once the queue stands above its target, an arrival the fleet cannot serve within it
/// is refused at once (`overloaded`, with a `Retry-After`), and those that wait are served within the
/// target and a service time or so, where before they sat out up to `queue.max_wait` (30 s) behind a
/// backlog that only grew.
#[tokio::test]
async fn sustained_overload_is_refused_at_arrival_and_keeps_waits_near_the_target() {
    let service = Duration::from_millis(100);
    let a = model_server(2, 2, service).await;
    let b = model_server(2, 2, service).await;
    // Two nodes of 2 slots at 100 ms: 40 requests a second.
    let config = "queue: { target_wait: 300ms, overload_after: 300ms }\n";
    let proxy = start_proxy(config_with(config, &[a.url(), b.url()])).await;
    let answers = open_loop(&proxy.url("/v1/generate"), &[(80, 6)]).await;
    let first_refusal = answers
        .iter()
        .filter(|(_, answer)| answer.reason.as_deref() == Some("overloaded"))
        .map(|(sent, _)| *sent)
        .min()
        .expect("twice the capacity for 6 s makes the queue stand");
    let (mut served, mut refused) = (Vec::new(), Vec::new());
    for (sent, answer) in &answers {
        match (answer.status, answer.reason.as_deref()) {
            (200, _) => served.push((*sent, answer.took)),
            (503, Some("overloaded")) => {
                assert!(answer.retry_after.is_some_and(|s| s >= 1), "{answer:?}");
                refused.push(answer.took);
            }
            _ => panic!("only answers and overload refusals: {answer:?}"),
        }
    }
    let slowest_refusal = refused.iter().max().unwrap();
    let later: Vec<Duration> = served
        .iter()
        .filter(|(sent, _)| *sent > first_refusal)
        .map(|(_, took)| *took)
        .collect();
    let slowest_later = later.iter().max().unwrap();
    println!(
        "served {}, refused {} (slowest refusal {slowest_refusal:?}); first refusal for a request \
         sent at {first_refusal:?}; slowest success sent after it {slowest_later:?}",
        served.len(),
        refused.len()
    );
    assert!(
        served.len() >= 150,
        "the fleet serves what it can: {}",
        served.len()
    );
    // Refused at arrival: far below the wait a refusal at the end of a growing backlog would take.
    assert!(
        *slowest_refusal < Duration::from_secs(1),
        "{slowest_refusal:?}"
    );
    // The target (300 ms) plus a service time (100 ms), with room for this machine's noise; a backlog
    // growing at 40 requests a second would have reached seconds by the end of the run.
    assert!(
        *slowest_later < Duration::from_millis(1500),
        "{slowest_later:?}"
    );
    proxy.stop().await;
}

/// A burst of three times the usual load for 2 s, above what the fleet serves, queues briefly and is
/// served whole: the queue stands only when arrivals keep expecting waits past the target.
#[tokio::test]
async fn a_burst_the_fleet_drains_in_time_queues_and_is_served_whole() {
    let service = Duration::from_millis(100);
    let a = model_server(2, 2, service).await;
    let b = model_server(2, 2, service).await;
    let proxy = start_proxy(config_with("", &[a.url(), b.url()])).await;
    let url = proxy.url("/v1/generate");
    // 16 a second (40 % of the 40 a second the fleet serves), then 48 a second (120 %) for 2 s, then 16.
    let answers = open_loop(&url, &[(16, 1), (48, 2), (16, 1)]).await;
    for (_, answer) in &answers {
        assert_eq!(answer.status, 200, "{answer:?}");
    }
    let stats = proxy.app_queue.stats();
    let queued = stats.enqueued.load(Ordering::Relaxed);
    println!("{} served, {queued} of them queued in tongs", answers.len());
    assert!(
        queued > 0,
        "the burst went past what the nodes take at once"
    );
    assert!(!proxy.app_queue.is_standing());
    proxy.stop().await;
}

/// With `concurrency.limit: learned`, tongs learns each node's capacity from what its answers take at
/// each load, on a fleet whose nodes differ 8× (2, 4 and 16 requests at once, 200 ms each, queueing beyond inside
/// themselves: the simulator's nodes, standing in for GPU servers): under closed-loop load of twice
/// the fleet's capacity, each node's limit settles near its capacity and the rest wait in tongs' queue.
/// How the limit follows a node that changes is checked in `src/limit/learned.rs`, in synthetic time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learned_limit_finds_each_nodes_capacity() {
    let node = |name: &str, capacity: usize| {
        let mut spec = tongs::sim::NodeSpec::new(name, Duration::from_millis(200));
        spec.service_time.spread = 0.1;
        spec.capacity = capacity;
        spec.queue = 64;
        spec
    };
    let fleet = sim_fleet(
        11,
        vec![node("two", 2), node("four", 4), node("sixteen", 16)],
    )
    .await;
    let proxy = start_proxy(config_with(
        "concurrency: { limit: learned }\n",
        &fleet.urls(),
    ))
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let clients = load(proxy.url("/v1/generate"), 44, Arc::clone(&stop));
    let limits = || limits_in_force(&proxy.app_registry, &fleet);
    let near = |capacity: u64, limit: Option<u64>| {
        limit.is_some_and(|l| (capacity - capacity / 8..=capacity + capacity / 3 + 1).contains(&l))
    };
    let mut last = Vec::new();
    eventually(
        "every node's limit near its capacity",
        Duration::from_secs(40),
        || {
            last = limits();
            near(2, last[0]) && near(4, last[1]) && near(16, last[2])
        },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut served = 0;
    for client in clients {
        served += client.await.unwrap();
    }
    println!("limits (2, 4, 16): {last:?}; {served} served");
    assert!(served > 0);
    proxy.stop().await;
}

//! Least-outstanding balancing (`balancer.policy: least-outstanding`) through the real proxy: requests held open on one endpoint (headers sent,
//! body still streaming) push new requests to the idle one; weights shape how concurrent load spreads.
//!
//! The endpoints are in-process backends standing in for GPU nodes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use http_body_util::channel::Channel;
use tokio::sync::Notify;

/// The plain count policy these tests are about (expected latency is tested in tests/latency.rs).
const LEAST_OUTSTANDING: &str = "balancer: { policy: least-outstanding }\n";

/// A backend that counts requests; `/hold` answers headers at once but keeps its body open until
/// `release` is notified.
struct HoldingBackend {
    backend: Backend,
    requests: Arc<AtomicUsize>,
    release: Arc<Notify>,
}

async fn holding_backend() -> HoldingBackend {
    let requests = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(Notify::new());
    let (count, gate) = (Arc::clone(&requests), Arc::clone(&release));
    let backend = backend(move |request: Request<hyper::body::Incoming>| {
        let (count, gate) = (Arc::clone(&count), Arc::clone(&gate));
        async move {
            count.fetch_add(1, Ordering::SeqCst);
            if request.uri().path() != "/hold" {
                return Response::new(full("quick"));
            }
            let (mut sender, body) = Channel::<Bytes, BoxError>::new(4);
            tokio::spawn(async move {
                let _ = sender.send_data(Bytes::from_static(b"first part;")).await;
                gate.notified().await;
                let _ = sender.send_data(Bytes::from_static(b"last part")).await;
            });
            Response::new(body.boxed())
        }
    })
    .await;
    HoldingBackend {
        backend,
        requests,
        release,
    }
}

#[tokio::test]
async fn a_request_streaming_on_one_endpoint_sends_the_next_ones_elsewhere() {
    let a = holding_backend().await;
    let b = holding_backend().await;
    let proxy = start_proxy(config_with(
        LEAST_OUTSTANDING,
        &[a.backend.url(), b.backend.url()],
    ))
    .await;

    // One long request: its headers arrive at once, its body stays open.
    let held = client()
        .get(proxy.url("/hold").parse().unwrap())
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let (busy, idle) = if a.requests.load(Ordering::SeqCst) == 1 {
        (&a, &b)
    } else {
        (&b, &a)
    };
    assert_eq!(busy.requests.load(Ordering::SeqCst), 1);

    // The held request still counts (its body has not ended), so every new one goes to the idle endpoint.
    for _ in 0..20 {
        assert_eq!(get(&proxy.url("/quick")).await.0, 200);
    }
    assert_eq!(
        busy.requests.load(Ordering::SeqCst),
        1,
        "busy endpoint got new requests"
    );
    assert_eq!(idle.requests.load(Ordering::SeqCst), 20);

    // Once the held body ends, the endpoint is idle again and takes its share.
    busy.release.notify_one();
    let body = held.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, Bytes::from_static(b"first part;last part"));
    let registry = Arc::clone(&proxy.app_registry);
    eventually("outstanding back to zero", Duration::from_secs(5), || {
        registry.snapshot().iter().all(|e| e.outstanding() == 0)
    })
    .await;
    for _ in 0..40 {
        assert_eq!(get(&proxy.url("/quick")).await.0, 200);
    }
    assert!(
        busy.requests.load(Ordering::SeqCst) > 5,
        "released endpoint gets traffic again"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn concurrent_requests_spread_by_weight() {
    let heavy = holding_backend().await;
    let light = holding_backend().await;
    let yaml = format!(
        "{LEAST_OUTSTANDING}discovery:\n  static:\n    - url: {}\n      weight: 3\n    - url: {}\n      weight: 1\n",
        heavy.backend.url(),
        light.backend.url()
    );
    let proxy = start_proxy(config_with(&yaml, &[])).await;

    // Hold 16 streams open; each new one goes where (outstanding + 1) / weight is least.
    let mut held = Vec::new();
    for _ in 0..16 {
        held.push(
            client()
                .get(proxy.url("/hold").parse().unwrap())
                .await
                .unwrap(),
        );
    }
    let on_heavy = heavy.requests.load(Ordering::SeqCst);
    let on_light = light.requests.load(Ordering::SeqCst);
    assert_eq!(on_heavy + on_light, 16);
    assert!(
        (11..=13).contains(&on_heavy),
        "3:1 weights gave {on_heavy}:{on_light}"
    );

    heavy.release.notify_waiters();
    light.release.notify_waiters();
    drop(held);
    proxy.stop().await;
}

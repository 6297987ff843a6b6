//! Pods joining and leaving: Pending → Running → Ready, and every exit (NotReady, Pending again,
//! terminating, deleted) with a request in flight that still completes; `/readyz` before the first
//! list.
//!
//! The Kubernetes API server is the fake of `tests/support/kube_api/` (kube-rs's real client talks to it
//! through a kubeconfig); the GPU nodes the pods stand for are in-process backends on loopback addresses.

use std::collections::BTreeSet;

use serde_json::json;
use tokio::time::Instant;

use crate::harness::*;
use crate::support::*;

/// How a serving pod stops serving.
#[derive(Clone, Copy, Debug)]
enum Exit {
    NotReady,
    /// Back to Pending: the SaladCloud node is being reallocated.
    Pending,
    /// `deletionTimestamp` set (still Running and Ready).
    Terminating,
    Deleted,
}

/// Sends requests until one is held at `gated`; returns it (the others went elsewhere and finished).
async fn hold_one_request(
    proxy: &TestProxy,
    gated: &Gated,
) -> tokio::task::JoinHandle<(u16, String)> {
    let before = gated.arrived();
    let deadline = Instant::now() + WAIT;
    loop {
        let url = proxy.url("/v1/completions");
        let request = tokio::spawn(async move { get(&url).await });
        let mut request = Some(request);
        until("the request is answered or held", || {
            let done = request.as_ref().is_some_and(|r| r.is_finished());
            let held = gated.arrived() > before;
            async move { done || held }
        })
        .await;
        if gated.arrived() > before {
            return request.take().expect("the request");
        }
        let answered = request
            .take()
            .expect("the request")
            .await
            .expect("request task");
        assert_eq!(answered, (200, "steady".into()));
        assert!(
            Instant::now() < deadline,
            "no request reached the gated pod"
        );
    }
}

#[tokio::test]
async fn pods_serve_while_running_and_ready_and_drain_on_every_exit() {
    let cluster = Cluster::start("tongs-lifecycle").await;
    let api = &cluster.api;
    let steady = named_pod(api, "127.0.0.3", "steady").await;
    let mover = gated("127.0.0.2", "mover").await;
    let mover_pod = PodBuilder::new("mover").http_port(mover.port());
    api.create(mover_pod.clone().phase("Pending").ready(false).json());
    // Without slow start: the mover joins a serving set four times, and each time it would ramp in
    // from 10 % over 5 s, during which one client sending one request at a time always finds `steady`
    // less loaded, so each `hold_one_request` waited out the whole ramp. What this test checks (who is
    // an endpoint, and that leaving drains) does not depend on the ramp.
    let proxy = start_proxy(cluster.config(
        &[LOOPBACK_PODS],
        "balancer: { policy: least-outstanding, slow_start: 0s }\n",
    ))
    .await;
    until_urls(&proxy, &[&steady.url()]).await;

    // Pending → Running but not Ready: still not an endpoint.
    api.update(NS, "mover", |pod| {
        set_phase(pod, "Running");
        pod["status"]["podIP"] = json!("127.0.0.2");
    });
    settle(api, &proxy).await;
    assert_eq!(urls(&proxy).await, BTreeSet::from([steady.url()]));
    assert_eq!(
        metric(&proxy, "tongs_discovery_pods{state=\"ineligible\"}").await,
        Some(1.0)
    );
    // Ready: an endpoint.
    api.update(NS, "mover", |pod| set_ready(pod, true));

    for exit in [
        Exit::NotReady,
        Exit::Pending,
        Exit::Terminating,
        Exit::Deleted,
    ] {
        until_urls(&proxy, &[&steady.url(), &mover.url()]).await;
        let held = hold_one_request(&proxy, &mover).await;
        let arrived = mover.arrived();
        match exit {
            Exit::NotReady => {
                api.update(NS, "mover", |pod| set_ready(pod, false));
            }
            Exit::Pending => {
                api.update(NS, "mover", |pod| {
                    set_phase(pod, "Pending");
                    set_ready(pod, false);
                });
            }
            Exit::Terminating => {
                api.begin_deletion(NS, "mover");
            }
            Exit::Deleted => {
                api.delete(NS, "mover");
            }
        }
        until_urls(&proxy, &[&steady.url()]).await;
        // Out of the set, but shown draining while the request is on it.
        let leaving = endpoint(&proxy, &mover.url()).await;
        assert_eq!(
            (
                &leaving["removed"],
                &leaving["state"],
                &leaving["outstanding"]
            ),
            (&json!(true), &json!("draining"), &json!(1)),
            "{exit:?}: {leaving}"
        );
        // New requests go elsewhere while the one under way is still held at the leaving pod.
        for _ in 0..5 {
            assert_eq!(
                get(&proxy.url("/")).await,
                (200, "steady".into()),
                "{exit:?}"
            );
        }
        assert_eq!(
            mover.arrived(),
            arrived,
            "{exit:?}: a new request reached a leaving pod"
        );
        assert!(
            !held.is_finished(),
            "{exit:?}: the held request ended early"
        );
        mover.release(1);
        let answer = tokio::time::timeout(WAIT, held)
            .await
            .expect("the held request finishes")
            .expect("request task");
        assert_eq!(
            answer,
            (200, "mover".into()),
            "{exit:?}: the request in flight"
        );
        until(
            "the left endpoint is gone once nothing is on it",
            || async {
                endpoints(&proxy)
                    .await
                    .iter()
                    .all(|e| e["url"] != mover.url().as_str())
            },
        )
        .await;
        // Back in service for the next exit.
        match exit {
            Exit::NotReady => {
                assert_eq!(
                    metric(&proxy, "tongs_discovery_pods{state=\"ineligible\"}").await,
                    Some(1.0)
                );
                api.update(NS, "mover", |pod| set_ready(pod, true));
            }
            Exit::Pending => {
                api.update(NS, "mover", |pod| {
                    set_phase(pod, "Running");
                    set_ready(pod, true);
                });
            }
            Exit::Terminating => {
                // A terminating pod never comes back: its replacement has a new UID.
                api.delete(NS, "mover");
                api.create(mover_pod.clone().ip("127.0.0.2").json());
            }
            Exit::Deleted => {}
        }
    }
    assert_eq!(pods_tracked(&proxy).await, 1.0);
    cluster.finish(proxy).await;
}

/// The main pool's sources as `/debug/endpoints` reports them.
async fn sources(proxy: &TestProxy) -> serde_json::Value {
    let (status, body) = admin_get(proxy, "/debug/endpoints").await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["sources"].clone()
}

#[tokio::test]
async fn readyz_waits_for_the_first_complete_list() {
    let cluster = Cluster::start("tongs-readyz").await;
    let api = &cluster.api;
    let node = named_pod(api, "127.0.0.2", "node").await;
    api.fail_next_lists(u64::MAX);
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS], "")).await;
    until("tongs has been refused a list twice", || async {
        api.stats().lists_failed >= 2
    })
    .await;
    assert_eq!(admin_get(&proxy, "/readyz").await.0, 503);
    assert_eq!(metric(&proxy, "tongs_discovery_synced").await, Some(0.0));
    assert_eq!(
        metric(&proxy, "tongs_discovery_lists_total").await,
        Some(0.0)
    );
    assert!(metric_or_zero(&proxy, "tongs_discovery_watch_errors_total").await >= 2.0);
    assert!(urls(&proxy).await.is_empty());
    assert_eq!(
        sources(&proxy).await,
        serde_json::json!([
            {"kind": "static", "enabled": true, "synced": true},
            {"kind": "kubernetes", "enabled": true, "synced": false}
        ]),
        "/debug/endpoints says which source readiness waits for"
    );

    api.heal_lists();
    until("/readyz answers 200", || async {
        admin_get(&proxy, "/readyz").await.0 == 200
    })
    .await;
    assert_eq!(metric(&proxy, "tongs_discovery_synced").await, Some(1.0));
    assert_eq!(
        metric(&proxy, "tongs_discovery_lists_total").await,
        Some(1.0)
    );
    assert_eq!(sources(&proxy).await[1]["synced"], true);
    assert_eq!(urls(&proxy).await, BTreeSet::from([node.url()]));
    assert_eq!(get(&proxy.url("/")).await, (200, "node".into()));
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn readyz_is_ready_with_an_empty_first_list() {
    let cluster = Cluster::start("tongs-readyz-empty").await;
    let proxy = start_proxy(cluster.config(&[], "")).await;
    until("/readyz answers 200", || async {
        admin_get(&proxy, "/readyz").await.0 == 200
    })
    .await;
    assert!(cluster.api.stats().lists_started >= 1);
    assert!(urls(&proxy).await.is_empty());
    cluster.finish(proxy).await;
}

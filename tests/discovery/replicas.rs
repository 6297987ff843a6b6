//! Replica-aware limits: each tongs replica counts the ready endpoints of its own Service from the
//! Service's EndpointSlices and enforces its share of every fixed per-node limit (a static limit, a
//! pod's `tongs.dev/max-outstanding`), so N replicas together keep a node at its limit.
//!
//! The API server is the fake of `tests/support/kube_api/` (it serves EndpointSlices as
//! `discovery.k8s.io/v1` does, and kube-rs's real watcher reads them); the slices stand for the ones the
//! EndpointSlice controller keeps for tongs' Service. The GPU nodes are in-process backends.

use serde_json::Value;

use crate::harness::*;
use crate::kube_api::endpoint_slice;
use crate::support::*;

/// `/debug/endpoints` whole.
async fn debug(proxy: &TestProxy) -> Value {
    let (status, body) = admin_get(proxy, "/debug/endpoints").await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("/debug/endpoints is JSON")
}

/// Waits until this replica counts `replicas` and the endpoints at `urls` enforce `limits`.
async fn until_shared(proxy: &TestProxy, replicas: u64, expected: &[(&str, u64)]) {
    until(
        &format!("{replicas} replicas and limits {expected:?}"),
        || async {
            let view = debug(proxy).await;
            view["replicas"]["ready"] == replicas
                && expected.iter().all(|(url, limit)| {
                    view["endpoints"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|e| e["url"] == *url && e["limit"] == *limit)
                })
        },
    )
    .await;
    assert_eq!(
        metric(proxy, "tongs_replicas").await,
        Some(replicas as f64),
        "the metric agrees"
    );
}

#[tokio::test]
async fn fixed_limits_are_divided_by_the_ready_replicas_of_tongs_own_service() {
    let cluster = Cluster::start("tongs-replicas").await;
    let api = &cluster.api;
    let pod = named("127.0.0.2", "pod").await;
    let fixed = named("127.0.0.3", "fixed").await;
    api.create(
        PodBuilder::new("capped")
            .ip("127.0.0.2")
            .http_port(pod.port())
            .annotate("tongs.dev/max-outstanding", "5")
            .json(),
    );
    // Namespace unset: the kubeconfig's, where the slices are.
    let top = format!(
        "concurrency: {{ limit: static, max_outstanding_per_endpoint: 8 }}\n\
         replicas: {{ service: tongs, kubeconfig: {} }}",
        cluster.kubeconfig.display()
    );
    let config = cluster.config_and_static(&[LOOPBACK_PODS], &top, &[fixed.url()]);
    let proxy = start_proxy(config).await;
    let (capped, fixed) = (pod.url(), fixed.url());

    // No slice yet: this replica counts itself alone.
    until_shared(&proxy, 1, &[(&capped, 5), (&fixed, 8)]).await;
    let view = debug(&proxy).await;
    assert_eq!(view["replicas"]["service"], "(own)/tongs", "{view}");
    assert_eq!(view["replicas"]["listed"], true, "{view}");
    let shown = endpoint(&proxy, &capped).await;
    assert_eq!(shown["max_outstanding"], 5, "the pod's own cap: {shown}");

    // Two ready replicas: 5 → 3 and 8 → 4 each (rounded up).
    api.create_slice(endpoint_slice(NS, "tongs-a", "tongs", &[true, true]));
    until_shared(&proxy, 2, &[(&capped, 3), (&fixed, 4)]).await;
    // A third in another slice, beside one that is not ready; another Service's slice is not counted.
    api.create_slice(endpoint_slice(NS, "tongs-b", "tongs", &[true, false]));
    api.create_slice(endpoint_slice(NS, "inference-a", "inference", &[true; 6]));
    until_shared(&proxy, 3, &[(&capped, 2), (&fixed, 3)]).await;
    // A replica going unready gives its share back.
    api.update_slice(NS, "tongs-a", |slice| {
        slice["endpoints"][1]["conditions"]["ready"] = Value::Bool(false);
        slice["endpoints"][1]["conditions"]["serving"] = Value::Bool(false);
    });
    until_shared(&proxy, 2, &[(&capped, 3), (&fixed, 4)]).await;
    // Terminating but still serving (draining its streams) still holds its share, beside one that
    // became ready in the same change: 3.
    api.update_slice(NS, "tongs-b", |slice| {
        slice["endpoints"][0]["conditions"] =
            serde_json::json!({"ready": false, "serving": true, "terminating": true});
        slice["endpoints"][1]["conditions"]["ready"] = Value::Bool(true);
    });
    until_shared(&proxy, 3, &[(&capped, 2), (&fixed, 3)]).await;
    api.delete_slice(NS, "tongs-b");
    until_shared(&proxy, 1, &[(&capped, 5), (&fixed, 8)]).await;
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn a_larger_share_lets_a_waiting_request_through_at_once() {
    let cluster = Cluster::start("tongs-replicas-share").await;
    let api = &cluster.api;
    let node = gated("127.0.0.4", "node").await;
    api.create_slice(endpoint_slice(NS, "tongs-a", "tongs", &[true, true]));
    let top = format!(
        "concurrency: {{ limit: static, max_outstanding_per_endpoint: 2 }}\n\
         replicas: {{ service: tongs, namespace: {NS}, kubeconfig: {} }}",
        cluster.kubeconfig.display()
    );
    let config = cluster.config_and_static(&[], &top, &[node.url()]);
    let proxy = start_proxy(config).await;
    until_shared(&proxy, 2, &[(&node.url(), 1)]).await;
    assert_eq!(
        debug(&proxy).await["replicas"]["service"],
        format!("{NS}/tongs")
    );

    // Two requests, a share of one: the second waits in tongs' queue, not at the node.
    let url = proxy.url("/");
    let first = tokio::spawn(get_owned(url.clone()));
    until("the first request at the node", || async {
        node.arrived() == 1
    })
    .await;
    let second = tokio::spawn(get_owned(url));
    until("the second request in the queue", || async {
        debug(&proxy).await["queue"]["waiting"] == 1
    })
    .await;
    assert_eq!(node.arrived(), 1, "the node got only this replica's share");

    // The other replica leaves: the share grows to 2 and the waiting request goes at once.
    api.update_slice(NS, "tongs-a", |slice| {
        slice["endpoints"][1]["conditions"] =
            serde_json::json!({"ready": false, "serving": false, "terminating": true});
    });
    until("the second request at the node", || async {
        node.arrived() == 2
    })
    .await;
    node.release(2);
    assert_eq!(first.await.expect("first"), (200, "node".into()));
    assert_eq!(second.await.expect("second"), (200, "node".into()));
    cluster.finish(proxy).await;
}

async fn get_owned(url: String) -> (u16, String) {
    get(&url).await
}

#[tokio::test]
async fn a_reload_that_names_no_service_counts_one_again_and_naming_it_watches_again() {
    let cluster = Cluster::start("tongs-replicas-reload").await;
    let api = &cluster.api;
    let node = named("127.0.0.5", "node").await;
    api.create_slice(endpoint_slice(
        NS,
        "tongs-a",
        "tongs",
        &[true, true, true, true],
    ));
    let with = |service: &str| {
        let top = format!(
            "concurrency: {{ limit: static, max_outstanding_per_endpoint: 8 }}\n\
             replicas: {{ service: \"{service}\", kubeconfig: {} }}",
            cluster.kubeconfig.display()
        );
        cluster.config_and_static(&[], &top, &[node.url()])
    };
    let app = tongs::App::bind(&with("tongs")).await.expect("binds");
    let parts = app.parts().clone();
    let admin = app.admin_addr();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(app.run(shutdown.clone()));
    let proxy = TestProxy {
        addr: admin,
        admin,
        app_registry: parts.registry(),
        app_queue: parts.queue(),
        shutdown,
        task,
    };
    until_shared(&proxy, 4, &[(&node.url(), 2)]).await;
    assert!(parts.apply(&with("")).is_empty());
    until_shared(&proxy, 1, &[(&node.url(), 8)]).await;
    assert_eq!(debug(&proxy).await["replicas"]["service"], Value::Null);
    assert!(parts.apply(&with("tongs")).is_empty());
    until_shared(&proxy, 4, &[(&node.url(), 2)]).await;
    cluster.finish(proxy).await;
}

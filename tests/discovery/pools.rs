//! Pools over one namespace share one pod watch: the API server is asked once, for what every pool's
//! label selector requires, and each pool serves only the pods its own selector picks. A pod relabelled
//! from one pool's selector to another's moves; a pool a reload adds gets its pods, and one it removes
//! leaves the watch to the others. A node registers through the pool that holds its pod.

use std::collections::BTreeSet;

use http::Request;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tongs::App;

use crate::harness::*;
use crate::support::*;

/// The endpoint URLs `/debug/endpoints` shows for `pool`.
async fn pool_urls(proxy: &TestProxy, pool: &str) -> BTreeSet<String> {
    endpoints(proxy)
        .await
        .iter()
        .filter(|e| e["pool"] == pool)
        .filter_map(|e| e["url"].as_str().map(str::to_owned))
        .collect()
}

/// Waits until every pool in `expected` shows exactly its URLs.
async fn until_pools(proxy: &TestProxy, expected: &[(&str, &[&str])]) {
    until(&format!("pools' endpoints to be {expected:?}"), || async {
        for (pool, urls) in expected {
            let want: BTreeSet<String> = urls.iter().map(|u| (*u).to_owned()).collect();
            if pool_urls(proxy, pool).await != want {
                return false;
            }
        }
        true
    })
    .await;
}

#[tokio::test]
async fn pools_with_different_selectors_share_one_watch_and_pods_move_between_them() {
    let cluster = Cluster::start("tongs-discovery-pools").await;
    let api = &cluster.api;
    let one = named("127.0.0.2", "one").await;
    let two = named("127.0.0.3", "two").await;
    let three = named("127.0.0.4", "three").await;
    let four = named("127.0.0.5", "four").await;
    let token_file = cluster.file("token", "s3cret-token\n");
    for (name, ip, node, tier) in [
        ("one", "127.0.0.2", &one, "a"),
        ("two", "127.0.0.3", &two, "b"),
        ("three", "127.0.0.4", &three, "c"),
    ] {
        api.create(
            PodBuilder::new(name)
                .ip(ip)
                .http_port(node.port())
                .label("tier", tier)
                .json(),
        );
    }
    // The top level says where the pods are; only the pools watch them (no default pool).
    let config = |with_c: bool| {
        let mut yaml = format!(
            "discovery:\n  kubernetes:\n    enabled: false\n    kubeconfig: {}\n    namespace: {NS}\n    \
             {LOOPBACK_PODS}\n    registration: {{ token_file: {} }}\npools:\n\
             - name: a\n  match: {{ models: [a] }}\n  \
             discovery: {{ kubernetes: {{ label_selector: \"app=llm,tier=a\" }} }}\n\
             - name: b\n  match: {{ models: [b] }}\n  \
             discovery: {{ kubernetes: {{ label_selector: \"app == llm, tier in (b)\" }} }}\n",
            cluster.kubeconfig.display(),
            token_file.display()
        );
        if with_c {
            yaml.push_str(
                "- name: c\n  match: { models: [c] }\n  \
                 discovery: { kubernetes: { label_selector: \"tier=c\" } }\n",
            );
        }
        config_with(&yaml, &[])
    };
    let app = App::bind(&config(false)).await.expect("binds");
    let parts = app.parts().clone();
    let shutdown = CancellationToken::new();
    let proxy = TestProxy {
        addr: app.proxy_addr(),
        admin: app.admin_addr(),
        app_registry: app.registry(),
        app_queue: app.queue(),
        shutdown: shutdown.clone(),
        task: tokio::spawn(app.run(shutdown)),
    };

    // Each pool serves its own pod, through one watch asking for what both selectors require.
    until_pools(&proxy, &[("a", &[&one.url()]), ("b", &[&two.url()])]).await;
    until("/readyz once both pools have their list", || async {
        admin_get(&proxy, "/readyz").await.0 == 200
    })
    .await;
    until("one watch open", || async { api.stats().open_watches == 1 }).await;
    assert_eq!(parts.watches.watches(), 1);
    assert_eq!(last_watch(api).param("labelSelector"), Some("app=llm"));
    let last_list = api.requests().into_iter().rev().find(|r| r.is_list());
    assert_eq!(
        last_list.expect("a list").param("labelSelector"),
        Some("app=llm")
    );
    let watches_before = api.stats().watch_requests;

    // Pod two is relabelled from pool b's selector to pool a's: it moves, and the watch stays.
    api.update(NS, "two", |pod| set_label(pod, "tier", "a"));
    until_pools(&proxy, &[("a", &[&one.url(), &two.url()]), ("b", &[])]).await;
    api.update(NS, "two", |pod| set_label(pod, "tier", "b"));
    until_pools(&proxy, &[("a", &[&one.url()]), ("b", &[&two.url()])]).await;
    assert_eq!(
        api.stats().watch_requests,
        watches_before,
        "the one watch followed the moves"
    );
    assert_eq!(api.stats().open_watches, 1);

    // A reload adds pool c, whose selector shares nothing with the others': it gets its pod from the
    // same watch, now over every pod of the namespace; the others keep theirs.
    assert!(parts.apply(&config(true)).is_empty());
    until_pools(
        &proxy,
        &[
            ("a", &[&one.url()]),
            ("b", &[&two.url()]),
            ("c", &[&three.url()]),
        ],
    )
    .await;
    until("one watch open", || async { api.stats().open_watches == 1 }).await;
    assert_eq!(parts.watches.watches(), 1);
    assert_eq!(last_watch(api).param("labelSelector"), None);
    assert!(logged(&["no requirement in common"]) >= 1);

    // A reload removes it: the watch asks for the others' common requirement again.
    assert!(parts.apply(&config(false)).is_empty());
    until("the watch asks for app=llm again", || async {
        last_watch(api).param("labelSelector") == Some("app=llm")
    })
    .await;
    until_pools(&proxy, &[("a", &[&one.url()]), ("b", &[&two.url()])]).await;
    assert!(pool_urls(&proxy, "c").await.is_empty());
    until("one watch open", || async { api.stats().open_watches == 1 }).await;
    assert_eq!(parts.watches.watches(), 1);

    // A node of pool b registers its address: pool b holds its pod, so pool b takes the registration
    // and serves the node; pool a never sees it.
    api.create(PodBuilder::new("four").label("tier", "b").json());
    let address = format!("127.0.0.5:{}", four.port());
    let body =
        json!({"namespace": NS, "pod": "four", "uid": uid_of(api, "four"), "address": address});
    until("pool b holds pod four", || async {
        let request = Request::post(format!("http://{}/v1/nodes/register", proxy.admin))
            .header("authorization", "Bearer s3cret-token")
            .body(full(body.to_string()))
            .expect("request");
        send(request).await.0 == 200
    })
    .await;
    let registered = format!("http://{address}");
    until_pools(
        &proxy,
        &[("a", &[&one.url()]), ("b", &[&two.url(), &registered])],
    )
    .await;
    cluster.finish(proxy).await;
}

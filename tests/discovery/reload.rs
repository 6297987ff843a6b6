//! `discovery.kubernetes` follows a configuration reload: a new selector restarts the watch, and the
//! set of endpoints becomes the pods the new selector picks, while tongs keeps serving.
//!
//! The Kubernetes API server is the fake of `tests/support/kube_api/` (kube-rs's real client talks to it
//! through a kubeconfig); the GPU nodes the pods stand for are in-process backends on loopback addresses.

use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::config::Config;

use crate::harness::*;
use crate::support::*;

#[tokio::test]
async fn a_reloaded_selector_restarts_the_watch() {
    let cluster = Cluster::start("tongs-discovery-reload").await;
    let api = &cluster.api;
    let one = named("127.0.0.2", "one").await;
    let two = named("127.0.0.3", "two").await;
    for (name, ip, node, tier) in [
        ("one", "127.0.0.2", &one, "one"),
        ("two", "127.0.0.3", &two, "two"),
    ] {
        api.create(
            PodBuilder::new(name)
                .ip(ip)
                .http_port(node.port())
                .label("tier", tier)
                .json(),
        );
    }
    let text = |tier: &str| {
        cluster
            .config(
                &[&format!("label_selector: tier={tier}"), LOOPBACK_PODS],
                COIN_TOSS,
            )
            .to_yaml()
    };
    let path = cluster.file("tongs.yaml", &text("one"));
    let app = App::bind(&Config::load(&path).expect("valid config"))
        .await
        .expect("binds")
        .watch_config(path.clone());
    let shutdown = CancellationToken::new();
    let proxy = TestProxy {
        addr: app.proxy_addr(),
        admin: app.admin_addr(),
        app_registry: app.registry(),
        app_queue: app.queue(),
        shutdown: shutdown.clone(),
        task: tokio::spawn(app.run(shutdown)),
    };
    until_urls(&proxy, &[&one.url()]).await;
    assert_eq!(get(&proxy.url("/")).await, (200, "one".into()));
    let lists_before = api.stats().lists_started;

    std::fs::write(&path, text("two")).expect("config rewritten");
    until_urls(&proxy, &[&two.url()]).await;
    assert_eq!(get(&proxy.url("/")).await, (200, "two".into()));
    assert!(
        api.stats().lists_started > lists_before,
        "the new selector was listed afresh"
    );
    let last_list = api
        .requests()
        .into_iter()
        .rev()
        .find(|r| r.is_list())
        .expect("a list request");
    assert_eq!(last_list.param("labelSelector"), Some("tier=two"));
    cluster.finish(proxy).await;
}

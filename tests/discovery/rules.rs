//! How a pod becomes an endpoint: every address rule and their order, the weight and max-outstanding
//! annotations, allowlist refusals, selectors and the namespace setting.
//!
//! The Kubernetes API server is the fake of `tests/support/kube_api/` (kube-rs's real client talks to it
//! through a kubeconfig); the GPU nodes the pods stand for are in-process backends on loopback addresses.

use std::collections::BTreeSet;

use serde_json::json;

use crate::harness::*;
use crate::support::*;

#[tokio::test]
async fn every_rule_gives_an_address_and_annotations_shape_the_endpoint() {
    let cluster = Cluster::start("tongs-rules").await;
    let api = &cluster.api;
    let by_url = named("127.0.0.2", "by-url").await;
    let by_tailscale = named("127.0.0.3", "by-tailscale").await;
    let by_port = named("127.0.0.4", "by-port-annotation").await;
    let by_name = named("127.0.0.5", "by-port-name").await;
    api.create(
        PodBuilder::new("url")
            .annotate("tongs.dev/url", &by_url.url())
            .annotate("tongs.dev/max-outstanding", "2")
            .json(),
    );
    api.create(
        PodBuilder::new("tailscale")
            .annotate(
                "tongs.dev/tailscale-address",
                &format!("127.0.0.3:{}", by_tailscale.port()),
            )
            .json(),
    );
    api.create(
        PodBuilder::new("port-annotation")
            .ip("127.0.0.4")
            .http_port(1) // the annotation wins over the named port
            .annotate("tongs.dev/port", &by_port.port().to_string())
            .annotate("tongs.dev/weight", "3")
            .json(),
    );
    serve_pod(api, "port-name", "127.0.0.5", by_name.port());
    // interLink without a tunnel reports 127.0.0.1: refused, and counted.
    serve_pod(api, "placeholder", "127.0.0.1", by_name.port());
    // The pod-ip pods' loopback addresses are named one by one, so 127.0.0.1 stays unnamed.
    let allow = format!(
        "allow: [\"http://127.0.0.2:{}\", 127.0.0.3/32, 127.0.0.4/32, 127.0.0.5/32]",
        by_url.port()
    );
    let proxy = start_proxy(cluster.config(&[&allow], COIN_TOSS)).await;

    let expected = [
        by_url.url(),
        by_tailscale.url(),
        by_port.url(),
        by_name.url(),
    ];
    until_urls(&proxy, &expected.each_ref().map(String::as_str)).await;
    let url_endpoint = endpoint(&proxy, &by_url.url()).await;
    assert_eq!(url_endpoint["source"], "kubernetes");
    assert_eq!(url_endpoint["pod"], "gpu/url");
    assert_eq!(url_endpoint["limit"], 2, "{url_endpoint}");
    assert_eq!(url_endpoint["weight"], 1);
    let weighted = endpoint(&proxy, &by_port.url()).await;
    assert_eq!(weighted["weight"], 3, "{weighted}");
    assert_eq!(weighted["pod"], "gpu/port-annotation");
    assert_eq!(
        endpoint(&proxy, &by_tailscale.url()).await["pod"],
        "gpu/tailscale"
    );
    assert_eq!(
        endpoint(&proxy, &by_name.url()).await["pod"],
        "gpu/port-name"
    );
    assert_eq!(
        metric(&proxy, "tongs_discovery_pods{state=\"serving\"}").await,
        Some(4.0)
    );
    assert_eq!(
        metric(&proxy, "tongs_discovery_pods{state=\"no-address\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(
            &proxy,
            "tongs_discovery_rejections_total{reason=\"loopback-pod-ip\"}"
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        metric(
            &proxy,
            "tongs_endpoints{source=\"kubernetes\",state=\"healthy\"}"
        )
        .await,
        Some(4.0)
    );

    // Weight 3 wins every pick among idle endpoints; without it the picks are fair coin tosses.
    for _ in 0..10 {
        assert_eq!(
            get(&proxy.url("/")).await,
            (200, "by-port-annotation".into())
        );
    }
    api.update(NS, "port-annotation", |pod| {
        pod["metadata"]["annotations"]
            .as_object_mut()
            .map(|a| a.remove("tongs.dev/weight"));
    });
    until("the weight annotation's removal shows", || async {
        endpoint(&proxy, &by_port.url()).await["weight"] == 1
    })
    .await;
    // Every one of them serves.
    let backends = [&by_url, &by_tailscale, &by_port, &by_name];
    until("every pod's endpoint answers requests", || async {
        let (status, body) = get(&proxy.url("/v1/completions")).await;
        assert_eq!(status, 200, "{body}");
        backends.iter().all(|b| b.hits() > 0)
    })
    .await;
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn local_pod_ips_serve_only_where_an_allow_range_names_them() {
    let cluster = Cluster::start("tongs-local-pod-ips").await;
    let api = &cluster.api;
    let named_node = named("127.0.0.7", "named").await;
    let unnamed = named("127.0.0.8", "unnamed").await;
    // 127.0.0.7 written as IPv4-mapped IPv6, as some API servers report dual-stack addresses.
    serve_pod(api, "mapped", "::ffff:127.0.0.7", named_node.port());
    serve_pod(api, "other-loopback", "127.0.0.8", unnamed.port());
    serve_pod(api, "metadata", "169.254.169.254", 80);
    serve_pod(api, "unspecified", "::", unnamed.port());
    // Only 127.0.0.7 is named; a catch-all range does not name local addresses.
    let proxy =
        start_proxy(cluster.config(&["allow: [127.0.0.7/32, 0.0.0.0/0, \"::/0\"]"], "")).await;
    until_urls(&proxy, &[&named_node.url()]).await;
    until("the three other pods are refused and counted", || async {
        metric_or_zero(
            &proxy,
            "tongs_discovery_rejections_total{reason=\"loopback-pod-ip\"}",
        )
        .await
            == 3.0
    })
    .await;
    assert_eq!(
        metric(&proxy, "tongs_discovery_pods{state=\"no-address\"}").await,
        Some(3.0)
    );
    for pod in ["other-loopback", "metadata", "unspecified"] {
        assert_eq!(
            logged(&[&format!("pod=gpu/{pod}"), "loopback-pod-ip"]),
            1,
            "{pod}"
        );
    }
    assert_eq!(get(&proxy.url("/")).await, (200, "named".into()));
    assert_eq!(unnamed.hits(), 0, "traffic went to a podIP no rule names");
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn the_rule_order_is_configurable() {
    let cluster = Cluster::start("tongs-rule-order").await;
    let api = &cluster.api;
    let annotated = named("127.0.0.2", "annotated").await;
    let pod_ip = named("127.0.0.3", "pod-ip").await;
    api.create(
        PodBuilder::new("both")
            .ip("127.0.0.3")
            .http_port(pod_ip.port())
            .annotate("tongs.dev/url", &annotated.url())
            .json(),
    );
    // Two replicas watching the same pods, with different rule orders.
    let allow = "allow: [127.0.0.0/8]";
    let url_first = start_proxy(cluster.config(&[allow], "")).await;
    let pod_ip_first = start_proxy(cluster.config(&[allow, "rules: [pod-ip, url]"], "")).await;
    until_urls(&url_first, &[&annotated.url()]).await;
    until_urls(&pod_ip_first, &[&pod_ip.url()]).await;
    assert_eq!(get(&url_first.url("/")).await, (200, "annotated".into()));
    assert_eq!(get(&pod_ip_first.url("/")).await, (200, "pod-ip".into()));

    // Without the URL annotation, the default order falls through to the podIP.
    api.update(NS, "both", |pod| {
        pod["metadata"]["annotations"] = json!({});
    });
    until_urls(&url_first, &[&pod_ip.url()]).await;
    assert_eq!(get(&url_first.url("/")).await, (200, "pod-ip".into()));
    cluster.assert_faithful();
    url_first.stop().await;
    pod_ip_first.stop().await;
}

#[tokio::test]
async fn annotations_outside_the_allowlist_are_refused_counted_and_logged_once() {
    let cluster = Cluster::start("tongs-allowlist").await;
    let api = &cluster.api;
    let good = named("127.0.0.2", "good").await;
    // Where a hostile annotation points: it must never see a request.
    let target = named("127.0.0.9", "target").await;
    api.create(
        PodBuilder::new("hostile")
            .ip("127.0.0.2")
            .http_port(good.port())
            .annotate("tongs.dev/url", &target.url())
            .annotate(
                "tongs.dev/tailscale-address",
                &format!("127.0.0.9:{}", target.port()),
            )
            .json(),
    );
    api.create(
        PodBuilder::new("only-url")
            .annotate(
                "tongs.dev/url",
                &format!("http://169.254.169.254:{}", target.port()),
            )
            .json(),
    );
    // Only 127.0.0.2 is allowed, by URL pattern and by range.
    let allow = format!(
        "allow: [\"http://127.0.0.2:{}\", 127.0.0.2/32]",
        good.port()
    );
    // tailscale before pod-ip (allowed with registration off), so both annotations are tried.
    let proxy =
        start_proxy(cluster.config(&[&allow, "rules: [url, tailscale, salad-api, pod-ip]"], ""))
            .await;
    // The hostile pod falls through to its podIP; the other has no address at all.
    until_urls(&proxy, &[&good.url()]).await;
    let rejections = |reason: &'static str| {
        let proxy = &proxy;
        async move {
            metric_or_zero(
                proxy,
                &format!("tongs_discovery_rejections_total{{reason=\"{reason}\"}}"),
            )
            .await
        }
    };
    until("both pods' refusals are counted", || async {
        rejections("url-not-allowed").await == 2.0
    })
    .await;
    assert_eq!(rejections("tailscale-not-allowed").await, 1.0);
    assert_eq!(
        metric(&proxy, "tongs_discovery_pods{state=\"no-address\"}").await,
        Some(1.0)
    );

    // More events for the same pods (a label, a status heartbeat, a re-list) count nothing new.
    api.update(NS, "hostile", |pod| set_label(pod, "rev", "2"));
    api.update(NS, "only-url", |pod| set_label(pod, "rev", "2"));
    api.update(NS, "hostile", |pod| {
        pod["status"]["startTime"] = json!("2025-01-01T00:00:00Z")
    });
    expire_the_watch(api, &proxy, 2.0).await;
    settle(api, &proxy).await;
    assert_eq!(rejections("url-not-allowed").await, 2.0);
    assert_eq!(rejections("tailscale-not-allowed").await, 1.0);
    assert_eq!(
        logged(&[
            "pod=gpu/hostile",
            "url-not-allowed",
            "not in discovery.kubernetes.allow"
        ]),
        1,
        "one warning per pod and problem"
    );
    assert_eq!(logged(&["pod=gpu/hostile", "tailscale-not-allowed"]), 1);
    assert_eq!(logged(&["pod=gpu/only-url", "url-not-allowed"]), 1);

    for _ in 0..20 {
        assert_eq!(get(&proxy.url("/")).await, (200, "good".into()));
    }
    assert_eq!(target.hits(), 0, "traffic went where an annotation pointed");
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn selectors_and_the_namespace_decide_which_pods_are_watched() {
    let cluster = Cluster::start("tongs-selectors").await;
    let api = &cluster.api;
    let good = named("127.0.0.2", "good").await;
    let other = named("127.0.0.3", "other").await;
    let pod = |name: &str| PodBuilder::new(name).node("vk-salad");
    api.create(pod("good").ip("127.0.0.2").http_port(good.port()).json());
    api.create(
        pod("canary")
            .label("tier", "canary")
            .ip("127.0.0.3")
            .http_port(other.port())
            .json(),
    );
    api.create(
        pod("elsewhere")
            .node("vk-interlink")
            .ip("127.0.0.3")
            .http_port(other.port())
            .json(),
    );
    api.create(
        pod("web")
            .label("app", "web")
            .ip("127.0.0.3")
            .http_port(other.port())
            .json(),
    );
    api.create(
        pod("batch")
            .namespace("batch")
            .ip("127.0.0.3")
            .http_port(other.port())
            .json(),
    );
    let config = cluster.config(
        &[
            "label_selector: app=llm,tier!=canary",
            "field_selector: spec.nodeName=vk-salad",
            LOOPBACK_PODS,
        ],
        "",
    );
    let proxy = start_proxy(config).await;
    until_urls(&proxy, &[&good.url()]).await;
    assert_eq!(
        pods_tracked(&proxy).await,
        1.0,
        "only the matching pod is watched"
    );
    for request in api.requests() {
        assert_eq!(request.path, "/api/v1/namespaces/gpu/pods");
        assert_eq!(request.param("labelSelector"), Some("app=llm,tier!=canary"));
        assert_eq!(
            request.param("fieldSelector"),
            Some("spec.nodeName=vk-salad")
        );
    }

    // A pod relabelled out of the selector leaves (the API server sends DELETED), and comes back.
    api.update(NS, "good", |pod| set_label(pod, "tier", "canary"));
    until_urls(&proxy, &[]).await;
    assert_eq!(pods_tracked(&proxy).await, 0.0);
    api.update(NS, "good", |pod| set_label(pod, "tier", "stable"));
    until_urls(&proxy, &[&good.url()]).await;
    assert_eq!(get(&proxy.url("/")).await, (200, "good".into()));
    assert_eq!(other.hits(), 0);
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn the_namespace_setting_watches_the_own_namespace_or_all() {
    let cluster = Cluster::start("tongs-namespaces").await;
    let api = &cluster.api;
    let here = named_pod(api, "127.0.0.2", "here").await;
    let there = named("127.0.0.3", "there").await;
    api.create(
        PodBuilder::new("there")
            .namespace("batch")
            .ip("127.0.0.3")
            .http_port(there.port())
            .json(),
    );
    // "": the kubeconfig context's namespace (gpu); "*": every namespace.
    let own = start_proxy(cluster.config(&["namespace: \"\"", LOOPBACK_PODS], "")).await;
    let all = start_proxy(cluster.config(&["namespace: \"*\"", LOOPBACK_PODS], COIN_TOSS)).await;
    until_urls(&own, &[&here.url()]).await;
    until_urls(&all, &[&here.url(), &there.url()]).await;
    let paths: BTreeSet<String> = api.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        BTreeSet::from([
            "/api/v1/namespaces/gpu/pods".to_owned(),
            "/api/v1/pods".to_owned()
        ])
    );
    api.delete("batch", "there");
    until_urls(&all, &[&here.url()]).await;
    cluster.assert_faithful();
    own.stop().await;
    all.stop().await;
}

#[tokio::test]
async fn static_endpoints_serve_beside_pods() {
    let cluster = Cluster::start("tongs-static-beside-pods").await;
    let api = &cluster.api;
    let pod_node = named("127.0.0.2", "pod").await;
    let fixed = named("127.0.0.4", "fixed").await;
    serve_pod(api, "llm-0", "127.0.0.2", pod_node.port());
    // Without slow start: a pod joining a serving set ramps in from 10 %, and one client sending one
    // request at a time then always finds the static endpoint less loaded for those 5 s.
    let mut config = cluster.config(
        &[LOOPBACK_PODS],
        "balancer: { policy: least-outstanding, slow_start: 0s }\n",
    );
    config
        .discovery
        .static_endpoints
        .push(tongs::config::StaticEndpoint {
            url: fixed.url(),
            weight: 1,
            max_outstanding: None,
            engine: None,
        });
    let proxy = start_proxy(config).await;
    until_urls(&proxy, &[&pod_node.url(), &fixed.url()]).await;
    assert_eq!(endpoint(&proxy, &fixed.url()).await["source"], "static");
    assert_eq!(
        endpoint(&proxy, &pod_node.url()).await["source"],
        "kubernetes"
    );
    for _ in 0..300 {
        assert_eq!(get(&proxy.url("/")).await.0, 200);
        if pod_node.hits() > 0 && fixed.hits() > 0 {
            break;
        }
    }
    assert!(
        pod_node.hits() > 0 && fixed.hits() > 0,
        "both served: pod {}, static {}",
        pod_node.hits(),
        fixed.hits()
    );
    // The pod leaving takes only its own endpoint.
    api.delete(NS, "llm-0");
    until_urls(&proxy, &[&fixed.url()]).await;
    assert_eq!(get(&proxy.url("/")).await, (200, "fixed".into()));
    cluster.finish(proxy).await;
}

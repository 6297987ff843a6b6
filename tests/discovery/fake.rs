//! The fake API server checked against kube-rs's own client and runtime watcher, so that the other
//! tests test tongs and not the fake: selectors, pages, get, merge patch, watch events, 410, and loud
//! refusal of what it does not implement; for EndpointSlices too (`slices`: list, get, watch), kept
//! apart from pods though both share one resourceVersion and history.

use std::path::Path;

use futures::{StreamExt, TryStreamExt};
use http::Request;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, WatchEvent, WatchParams};
use serde_json::json;

use crate::harness::*;
use crate::support::*;

mod slices;

async fn kube_client(kubeconfig: &Path) -> kube::Client {
    let file = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig reads");
    let config =
        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
            .await
            .expect("kubeconfig is usable");
    kube::Client::try_from(config).expect("kube client")
}

fn names(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect()
}

async fn list_names(pods: &Api<Pod>, params: &ListParams) -> Vec<String> {
    names(&pods.list(params).await.expect("list").items)
}

fn api_error(result: Result<impl std::fmt::Debug, kube::Error>) -> (u16, String) {
    match result {
        Err(kube::Error::Api(status)) => (status.code, status.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn the_fake_api_answers_kube_rs_as_the_api_server_does() {
    let cluster = Cluster::start("tongs-kube-fake").await;
    let api = &cluster.api;
    api.create(PodBuilder::new("a").label("tier", "gpu").node("n1").json());
    api.create(
        PodBuilder::new("b")
            .label("tier", "canary")
            .node("n2")
            .phase("Pending")
            .json(),
    );
    api.create(PodBuilder::new("c").label("app", "web").json());
    api.create(PodBuilder::new("d").namespace("batch").json());
    let client = kube_client(&cluster.kubeconfig).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // Selectors, as the API server reads them.
    let labels = |s: &str| ListParams::default().labels(s);
    let fields = |s: &str| ListParams::default().fields(s);
    assert_eq!(
        list_names(&pods, &ListParams::default()).await,
        ["a", "b", "c"]
    );
    assert_eq!(list_names(&pods, &labels("app=llm")).await, ["a", "b"]);
    assert_eq!(
        list_names(&pods, &labels("app==llm,tier!=canary")).await,
        ["a"]
    );
    assert_eq!(list_names(&pods, &labels("tier")).await, ["a", "b"]);
    assert_eq!(list_names(&pods, &labels("!tier")).await, ["c"]);
    assert_eq!(
        list_names(&pods, &labels("tier in (gpu, cpu)")).await,
        ["a"]
    );
    assert_eq!(
        list_names(&pods, &labels("tier notin (gpu)")).await,
        ["b", "c"]
    );
    assert_eq!(list_names(&pods, &fields("spec.nodeName=n1")).await, ["a"]);
    assert_eq!(list_names(&pods, &fields("metadata.name=b")).await, ["b"]);
    assert_eq!(
        list_names(&pods, &fields("status.phase!=Pending,spec.nodeName!=n1")).await,
        ["c"]
    );
    let everywhere: Api<Pod> = Api::all(client.clone());
    assert_eq!(
        list_names(&everywhere, &labels("app=llm")).await,
        ["d", "a", "b"],
        "all namespaces, in key order (batch/d first)"
    );
    assert_eq!(
        api_error(pods.list(&labels("app in (llm")).await),
        (400, "BadRequest".into())
    );
    assert_eq!(
        api_error(pods.list(&fields("spec.image=x")).await),
        (400, "BadRequest".into())
    );

    // Pages from one consistent snapshot; the continue token expires with compaction.
    let first = pods
        .list(&ListParams::default().limit(2))
        .await
        .expect("page 1");
    assert_eq!(names(&first.items), ["a", "b"]);
    let token = first.metadata.continue_.clone().expect("a continue token");
    assert_eq!(first.metadata.remaining_item_count, Some(1));
    api.create(PodBuilder::new("e").json());
    let second = pods
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .expect("page 2");
    assert_eq!(names(&second.items), ["c"], "the snapshot, not pod e");
    assert_eq!(
        second.metadata.resource_version,
        first.metadata.resource_version
    );
    assert_eq!(second.metadata.continue_, None);
    let again = pods
        .list(&ListParams::default().limit(1))
        .await
        .expect("page 1");
    api.create(PodBuilder::new("f").json());
    api.compact();
    let token = again.metadata.continue_.expect("a continue token");
    assert_eq!(
        api_error(
            pods.list(&ListParams::default().limit(1).continue_token(&token))
                .await
        ),
        (410, "Expired".into())
    );

    // Get and merge patch; status is a subresource, spec is immutable.
    let a = pods.get("a").await.expect("get a");
    assert_eq!(a.metadata.namespace.as_deref(), Some(NS));
    assert!(a.metadata.uid.is_some() && a.metadata.creation_timestamp.is_some());
    assert_eq!(api_error(pods.get("zz").await), (404, "NotFound".into()));
    let patched = pods
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {"tongs.dev/weight": "2"}},
                "status": {"phase": "Failed"}
            })),
        )
        .await
        .expect("patch a");
    let annotations = patched.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations.get("tongs.dev/weight").map(String::as_str),
        Some("2")
    );
    assert_eq!(
        patched.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Running"),
        "status is not patched through the main resource"
    );
    let version = |pod: &Pod| pod.metadata.resource_version.clone().unwrap_or_default();
    assert_ne!(version(&patched), version(&a));
    assert_eq!(version(&patched), api.resource_version().to_string());
    assert_eq!(
        api_error(
            pods.patch(
                "zz",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {}}))
            )
            .await
        ),
        (404, "NotFound".into())
    );
    assert_eq!(
        api_error(
            pods.patch(
                "a",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"nodeName": "elsewhere"}}))
            )
            .await
        ),
        (422, "Invalid".into())
    );
    let patches = api.patches();
    assert_eq!(patches.len(), 3);
    assert_eq!(patches[0].content_type, "application/merge-patch+json");
    assert_eq!(
        patches.iter().map(|p| p.status).collect::<Vec<_>>(),
        [200, 404, 422]
    );

    // Watch: live events, selector transitions, and 410 for a compacted version.
    let from = api.resource_version().to_string();
    let stream = pods
        .watch(&WatchParams::default().labels("app=llm"), &from)
        .await
        .expect("watch");
    let mut stream = stream.boxed();
    api.update(NS, "b", |pod| set_phase(pod, "Running"));
    api.update(NS, "a", |pod| set_label(pod, "app", "web"));
    api.update(NS, "c", |pod| set_label(pod, "app", "llm"));
    api.delete(NS, "b");
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let event = tokio::time::timeout(WAIT, stream.try_next())
            .await
            .expect("a watch event in time")
            .expect("a good watch event")
            .expect("the watch goes on");
        seen.push(match event {
            WatchEvent::Added(pod) => format!("ADDED {}", pod.metadata.name.unwrap_or_default()),
            WatchEvent::Modified(pod) => {
                format!("MODIFIED {}", pod.metadata.name.unwrap_or_default())
            }
            WatchEvent::Deleted(pod) => {
                format!("DELETED {}", pod.metadata.name.unwrap_or_default())
            }
            other => format!("{other:?}"),
        });
    }
    assert_eq!(seen, ["MODIFIED b", "DELETED a", "ADDED c", "DELETED b"]);
    api.compact();
    let mut expired = pods
        .watch(&WatchParams::default(), &from)
        .await
        .expect("watch")
        .boxed();
    match expired.try_next().await {
        Ok(Some(WatchEvent::Error(status))) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }

    // kube's runtime watcher: paged list, then the watch with the parameters the fake checks.
    let listed_before = api.stats().list_requests;
    let watcher = kube::runtime::watcher(
        pods.clone(),
        kube::runtime::watcher::Config::default()
            .labels("app=llm")
            .page_size(1),
    );
    let mut watcher = watcher.boxed();
    let mut initial = Vec::new();
    loop {
        let event = tokio::time::timeout(WAIT, watcher.try_next())
            .await
            .expect("watcher event in time")
            .expect("watcher event")
            .expect("watcher goes on");
        match event {
            kube::runtime::watcher::Event::Init => initial.push("init".to_owned()),
            kube::runtime::watcher::Event::InitApply(pod) => {
                initial.push(pod.metadata.name.unwrap_or_default())
            }
            kube::runtime::watcher::Event::InitDone => break,
            other => panic!("unexpected {other:?} before InitDone"),
        }
    }
    assert_eq!(initial, ["init", "c", "e", "f"]);
    assert_eq!(api.stats().list_requests - listed_before, 3, "pages of one");
    api.create(PodBuilder::new("g").json());
    match tokio::time::timeout(WAIT, watcher.try_next()).await {
        Ok(Ok(Some(kube::runtime::watcher::Event::Apply(pod)))) => {
            assert_eq!(pod.metadata.name.as_deref(), Some("g"))
        }
        other => panic!("expected g applied, got {other:?}"),
    }
    let watch = last_watch(api);
    assert_eq!(watch.param("labelSelector"), Some("app=llm"));
    assert_eq!(watch.param("allowWatchBookmarks"), Some("true"));
    assert_eq!(watch.param("timeoutSeconds"), Some("290"));
    cluster.assert_faithful();

    // Anything the fake does not implement is refused loudly, not ignored.
    let response = send(
        Request::get(format!("{}/api/v1/namespaces/gpu/pods?bogus=1", api.url()))
            .header(
                "authorization",
                format!("Bearer fake-token-{}", port_of(&api.url())),
            )
            .body(full(""))
            .expect("request"),
    )
    .await;
    assert_eq!(response.0, 400, "{}", response.1);
    assert!(response.1.contains("\"kind\":\"Status\""), "{}", response.1);
    assert_eq!(api.unexpected().len(), 1);
    let unauthenticated = get(&format!("{}/api/v1/pods", api.url())).await;
    assert_eq!(unauthenticated.0, 401);

    // Bad input is answered with a Status, never a panic (the server keeps answering).
    let token = format!("Bearer fake-token-{}", port_of(&api.url()));
    let pods_url = format!("{}/api/v1/namespaces/gpu/pods", api.url());
    let raw = |method: &str, url: String, content_type: &str, body: &'static str| {
        Request::builder()
            .method(method)
            .uri(url)
            .header("authorization", &token)
            .header("content-type", content_type)
            .body(full(body))
            .expect("request")
    };
    for (request, status) in [
        (
            raw("GET", format!("{pods_url}?labelSelector=%zz"), "", ""),
            400,
        ),
        (
            raw(
                "GET",
                format!("{pods_url}?labelSelector=a%3D%3D%3D"),
                "",
                "",
            ),
            400,
        ),
        (raw("GET", format!("{pods_url}?limit=-1"), "", ""), 400),
        (
            raw("GET", format!("{pods_url}?continue=garbage"), "", ""),
            400,
        ),
        (
            raw(
                "GET",
                format!("{pods_url}?watch=true&resourceVersion=abc"),
                "",
                "",
            ),
            400,
        ),
        (raw("GET", format!("{pods_url}?watch=maybe"), "", ""), 400),
        (
            raw("GET", format!("{}/api/v1/nodes", api.url()), "", ""),
            404,
        ),
        (raw("DELETE", format!("{pods_url}/c"), "", ""), 405),
        (
            raw(
                "PATCH",
                format!("{pods_url}/c"),
                "application/merge-patch+json",
                "{",
            ),
            400,
        ),
        (
            raw(
                "PATCH",
                format!("{pods_url}/c"),
                "application/merge-patch+json",
                "[1]",
            ),
            400,
        ),
        (
            raw(
                "PATCH",
                format!("{pods_url}/c"),
                "application/json-patch+json",
                "[]",
            ),
            415,
        ),
        (
            raw(
                "PATCH",
                format!("{pods_url}/c"),
                "application/merge-patch+json",
                r#"{"metadata": "x"}"#,
            ),
            400,
        ),
        (
            raw(
                "PATCH",
                format!("{pods_url}/c"),
                "application/merge-patch+json",
                r#"{"metadata": {"resourceVersion": "1"}}"#,
            ),
            409,
        ),
    ] {
        let target = format!("{} {}", request.method(), request.uri());
        let (answered, body) = send(request).await;
        assert_eq!(answered, status, "{target}: {body}");
        let parsed: serde_json::Value = serde_json::from_str(&body).expect("a JSON Status");
        assert_eq!(
            (parsed["kind"].as_str(), parsed["code"].as_u64()),
            (Some("Status"), Some(u64::from(status))),
            "{target}"
        );
    }
    let c = pods.get("c").await.expect("c is still there");
    assert_eq!(c.metadata.name.as_deref(), Some("c"));
    assert_eq!(c.metadata.namespace.as_deref(), Some(NS));
    api.clear_unexpected();
}

//! EndpointSlices through the fake, checked against kube-rs's client and runtime watcher: list (label
//! and field selectors, pages), get, watch (selector transitions, resume from the shared history, 410,
//! bookmarks), kept apart from pods, and refusal of what is not implemented for them (patch).

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, Patch, PatchParams, WatchEvent, WatchParams};
use serde_json::json;

use super::{api_error, kube_client, list_names};
use crate::harness::*;
use crate::kube_api::{Resource, endpoint_slice};

fn slice_names(slices: &[EndpointSlice]) -> Vec<String> {
    slices
        .iter()
        .filter_map(|s| s.metadata.name.clone())
        .collect()
}

/// The next event of a raw watch, as `TYPE name` (or `BOOKMARK rv`).
async fn next_event<K: kube::Resource + Clone + std::fmt::Debug>(
    stream: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin),
) -> String {
    let event = tokio::time::timeout(WAIT, stream.try_next())
        .await
        .expect("a watch event in time")
        .expect("a good watch event")
        .expect("the watch goes on");
    let name = |o: &K| o.meta().name.clone().unwrap_or_default();
    match event {
        WatchEvent::Added(o) => format!("ADDED {}", name(&o)),
        WatchEvent::Modified(o) => format!("MODIFIED {}", name(&o)),
        WatchEvent::Deleted(o) => format!("DELETED {}", name(&o)),
        WatchEvent::Bookmark(b) => format!("BOOKMARK {}", b.types.kind),
        WatchEvent::Error(e) => format!("ERROR {}", e.code),
    }
}

/// Ready endpoints in a slice, as tongs would count them.
fn ready(slice: &EndpointSlice) -> usize {
    slice
        .endpoints
        .iter()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .count()
}

#[tokio::test]
async fn the_fake_api_serves_endpoint_slices_to_kube_rs() {
    let cluster = Cluster::start("tongs-kube-slices").await;
    let api = &cluster.api;
    let own = "kubernetes.io/service-name=tongs";
    api.create_slice(endpoint_slice(NS, "tongs-a", "tongs", &[true, false]));
    api.create_slice(endpoint_slice(NS, "tongs-b", "tongs", &[true]));
    api.create_slice(endpoint_slice(NS, "web-a", "web", &[true]));
    api.create_slice(endpoint_slice("batch", "tongs-c", "tongs", &[true]));
    api.create(PodBuilder::new("p").json());
    let client = kube_client(&cluster.kubeconfig).await;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // List: selectors, namespaces, pages; pods and slices are apart.
    let params = ListParams::default().labels(own);
    let listed = slices.list(&params).await.expect("list slices").items;
    assert_eq!(slice_names(&listed), ["tongs-a", "tongs-b"]);
    assert_eq!(listed.iter().map(ready).sum::<usize>(), 2);
    assert_eq!(listed[0].address_type, "IPv4");
    let everywhere: Api<EndpointSlice> = Api::all(client.clone());
    let all = everywhere.list(&params).await;
    assert_eq!(
        slice_names(&all.expect("list all").items),
        ["tongs-c", "tongs-a", "tongs-b"]
    );
    let by_name = ListParams::default().fields("metadata.name=web-a");
    let by_name = slices.list(&by_name).await.expect("list").items;
    assert_eq!(slice_names(&by_name), ["web-a"]);
    for unsupported in [
        "addressType=IPv4",
        "spec.nodeName=n1",
        "status.phase=Running",
    ] {
        assert_eq!(
            api_error(
                slices
                    .list(&ListParams::default().fields(unsupported))
                    .await
            ),
            (400, "BadRequest".into()),
            "{unsupported}"
        );
    }
    assert_eq!(list_names(&pods, &ListParams::default()).await, ["p"]);
    let first = slices
        .list(&ListParams::default().limit(2))
        .await
        .expect("page 1");
    assert_eq!(slice_names(&first.items), ["tongs-a", "tongs-b"]);
    let token = first.metadata.continue_.expect("a continue token");
    api.create_slice(endpoint_slice(NS, "zz", "tongs", &[]));
    let next_page = ListParams::default().limit(2).continue_token(&token);
    let second = slices.list(&next_page).await.expect("page 2").items;
    assert_eq!(slice_names(&second), ["web-a"], "the snapshot, not zz");
    api.delete_slice(NS, "zz");

    // Get: what the server owns is filled in, as it returns it.
    let a = slices.get("tongs-a").await.expect("get tongs-a");
    assert!(a.metadata.uid.is_some() && a.metadata.creation_timestamp.is_some());
    assert_eq!(ready(&a), 1);
    let raw = api.slice(NS, "tongs-a").expect("stored");
    assert_eq!(raw["apiVersion"], "discovery.k8s.io/v1");
    assert_eq!(raw["kind"], "EndpointSlice");
    assert_eq!(
        a.metadata.resource_version.as_deref(),
        raw["metadata"]["resourceVersion"].as_str()
    );
    assert_eq!(api_error(slices.get("p").await), (404, "NotFound".into()));
    assert_eq!(
        api_error(pods.get("tongs-a").await),
        (404, "NotFound".into())
    );

    // The runtime watcher sees create, update and delete of the selected slices only.
    let watcher = kube::runtime::watcher(
        slices.clone(),
        kube::runtime::watcher::Config::default().labels(own),
    );
    let mut watcher = watcher.boxed();
    let mut next = async || {
        use kube::runtime::watcher::Event;
        let event = tokio::time::timeout(WAIT, watcher.try_next())
            .await
            .expect("watcher event in time")
            .expect("watcher event")
            .expect("watcher goes on");
        match event {
            Event::Init => "init".to_owned(),
            Event::InitApply(s) => format!(
                "init {} {}",
                s.metadata.name.clone().unwrap_or_default(),
                ready(&s)
            ),
            Event::InitDone => "done".to_owned(),
            Event::Apply(s) => format!(
                "apply {} {}",
                s.metadata.name.clone().unwrap_or_default(),
                ready(&s)
            ),
            Event::Delete(s) => format!("delete {}", s.metadata.name.clone().unwrap_or_default()),
        }
    };
    for expected in ["init", "init tongs-a 1", "init tongs-b 1", "done"] {
        assert_eq!(next().await, expected);
    }
    api.update(NS, "p", |pod| {
        set_label(pod, "kubernetes.io/service-name", "tongs")
    });
    api.update_slice(NS, "web-a", |s| s["endpoints"] = json!([]));
    api.update_slice(NS, "tongs-a", |s| {
        *s = endpoint_slice(NS, "tongs-a", "tongs", &[true, true])
    });
    assert_eq!(next().await, "apply tongs-a 2", "no pod, no other service");
    api.create_slice(endpoint_slice(NS, "tongs-d", "tongs", &[false]));
    assert_eq!(next().await, "apply tongs-d 0");
    api.update_slice(NS, "tongs-b", |s| {
        s["metadata"]["labels"]["kubernetes.io/service-name"] = json!("web")
    });
    assert_eq!(next().await, "delete tongs-b", "stopped matching");
    api.update_slice(NS, "web-a", |s| {
        s["metadata"]["labels"]["kubernetes.io/service-name"] = json!("tongs")
    });
    assert_eq!(next().await, "apply web-a 0", "started matching");
    api.delete_slice(NS, "tongs-a");
    assert_eq!(next().await, "delete tongs-a");
    let watch = last_watch(api);
    assert_eq!(watch.resource(), Some(Resource::EndpointSlices));
    assert_eq!(watch.param("labelSelector"), Some(own));

    // One history: a watch of either resource resumes from a version, seeing only its own changes.
    let from = api.resource_version().to_string();
    api.create(PodBuilder::new("q").json());
    api.update_slice(NS, "tongs-d", |s| s["endpoints"] = json!([]));
    api.delete(NS, "q");
    api.delete_slice(NS, "tongs-d");
    let pod_events = pods.watch(&WatchParams::default(), &from).await;
    let mut pod_events = pod_events.expect("watch pods").boxed();
    assert_eq!(next_event(&mut pod_events).await, "ADDED q");
    assert_eq!(next_event(&mut pod_events).await, "DELETED q");
    let slice_events = slices
        .watch(&WatchParams::default().labels(own), &from)
        .await;
    let mut slice_events = slice_events.expect("watch slices").boxed();
    assert_eq!(next_event(&mut slice_events).await, "MODIFIED tongs-d");
    assert_eq!(next_event(&mut slice_events).await, "DELETED tongs-d");
    api.create_slice(endpoint_slice(NS, "tongs-e", "tongs", &[true]));
    api.bookmark();
    api.update(NS, "p", |pod| set_phase(pod, "Pending"));
    assert_eq!(next_event(&mut slice_events).await, "ADDED tongs-e");
    assert_eq!(
        next_event(&mut slice_events).await,
        "BOOKMARK EndpointSlice"
    );
    assert_eq!(next_event(&mut pod_events).await, "BOOKMARK Pod");
    assert_eq!(next_event(&mut pod_events).await, "MODIFIED p");
    api.compact();
    let expired = slices.watch(&WatchParams::default(), &from).await;
    let mut expired = expired.expect("watch").boxed();
    assert_eq!(next_event(&mut expired).await, "ERROR 410");
    cluster.assert_faithful();

    // Patching a slice is not implemented: refused loudly.
    let patch = Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}}));
    let refused = slices.patch("web-a", &PatchParams::default(), &patch).await;
    assert_eq!(api_error(refused), (405, "MethodNotAllowed".into()));
    assert_eq!(api.unexpected().len(), 1);
    api.clear_unexpected();
}

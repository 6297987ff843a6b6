//! Node self-registration on the admin port: refusals, and a registration that becomes an endpoint
//! through the pod annotation it writes.
//!
//! The Kubernetes API server is the fake of `tests/support/kube_api/` (kube-rs's real client talks to it
//! through a kubeconfig); the GPU nodes the pods stand for are in-process backends on loopback addresses.

use http::Request;
use serde_json::{Value, json};

use crate::harness::*;
use crate::support::*;

async fn register(proxy: &TestProxy, token: Option<&str>, body: &str) -> (u16, Value) {
    let mut request = Request::post(format!("http://{}/v1/nodes/register", proxy.admin))
        .header("content-type", "application/json");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let (status, text) = send(request.body(full(body.to_owned())).expect("request")).await;
    let answer = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, answer)
}

#[tokio::test]
async fn nodes_register_their_address_through_a_pod_annotation() {
    let cluster = Cluster::start("tongs-register").await;
    let api = &cluster.api;
    let node = named("127.0.0.5", "registered-node").await;
    api.create(PodBuilder::new("node-0").json());
    api.create(PodBuilder::new("node-1").namespace("batch").json());
    let token_file = cluster.file("token", "s3cret-token\n");
    let token_setting = format!("registration: {{ token_file: {} }}", token_file.display());
    let proxy = start_proxy(cluster.config(&["allow: [127.0.0.0/8]", &token_setting], "")).await;
    until("/readyz answers 200", || async {
        admin_get(&proxy, "/readyz").await.0 == 200
    })
    .await;
    assert!(urls(&proxy).await.is_empty(), "node-0 has no address yet");

    let address = format!("127.0.0.5:{}", node.port());
    let good = json!({"namespace": NS, "pod": "node-0", "address": address}).to_string();
    let token = Some("s3cret-token");
    assert_eq!(register(&proxy, None, &good).await.0, 401);
    assert_eq!(register(&proxy, Some("s3cret-tokem"), &good).await.0, 401);
    assert_eq!(
        register(&proxy, token, "{\"namespace\": \"gpu\",").await.0,
        400
    );
    let no_port = json!({"namespace": NS, "pod": "node-0", "address": "127.0.0.5"});
    assert_eq!(register(&proxy, token, &no_port.to_string()).await.0, 400);
    let ghost = json!({"namespace": NS, "pod": "ghost", "address": address});
    assert_eq!(register(&proxy, token, &ghost.to_string()).await.0, 404);
    let unwatched = json!({"namespace": "batch", "pod": "node-1", "address": address});
    assert_eq!(register(&proxy, token, &unwatched.to_string()).await.0, 404);
    let outside = json!({"namespace": NS, "pod": "node-0", "address": "10.9.8.7:8000"});
    let (status, answer) = register(&proxy, token, &outside.to_string()).await;
    assert_eq!(status, 403, "{answer}");
    assert!(
        api.patches().is_empty(),
        "refused registrations patch nothing"
    );

    let (status, answer) = register(&proxy, token, &good).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "registered");
    let patches = api.patches();
    assert_eq!(patches.len(), 1);
    assert_eq!(patches[0].content_type, "application/merge-patch+json");
    assert_eq!(
        (patches[0].namespace.as_str(), patches[0].name.as_str()),
        (NS, "node-0")
    );
    assert_eq!(
        patches[0].body,
        json!({"metadata": {"annotations": {"tongs.dev/tailscale-address": address}}})
    );
    assert_eq!(patches[0].status, 200);
    let stored = api.pod(NS, "node-0").expect("node-0");
    assert_eq!(
        stored["metadata"]["annotations"]["tongs.dev/tailscale-address"],
        address
    );

    // Through its own watch, tongs serves the pod at that address.
    let expected = format!("http://{address}");
    until_urls(&proxy, &[&expected]).await;
    assert_eq!(get(&proxy.url("/")).await, (200, "registered-node".into()));
    // Registering again changes nothing and writes nothing.
    let (status, answer) = register(&proxy, token, &good).await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (200, Some("unchanged"))
    );
    assert_eq!(api.patches().len(), 1);

    // The pod is deleted while tongs cannot see it (the watch is down and lists fail): tongs still
    // knows the pod, the API server does not, and the node is told so.
    api.atomically(|c| {
        c.fail_next_lists(u64::MAX);
        c.drop_watches();
        c.delete(NS, "node-0");
        c.compact();
    });
    until("a list has failed", || async {
        api.stats().lists_failed >= 1
    })
    .await;
    let moved =
        json!({"namespace": NS, "pod": "node-0", "address": format!("127.0.0.6:{}", node.port())});
    let (status, answer) = register(&proxy, token, &moved.to_string()).await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (404, Some("unknown-pod")),
        "{answer}"
    );
    assert_eq!(api.patches().last().map(|p| p.status), Some(404));
    api.heal_lists();
    until_urls(&proxy, &[]).await;

    for (result, count) in [
        ("registered", 1.0),
        ("unchanged", 1.0),
        ("unauthorized", 2.0),
        ("bad-request", 2.0),
        ("unknown-pod", 3.0),
        ("not-allowed", 1.0),
    ] {
        assert_eq!(
            metric(
                &proxy,
                &format!("tongs_node_registrations_total{{result=\"{result}\"}}")
            )
            .await,
            Some(count),
            "{result}"
        );
    }
    cluster.finish(proxy).await;
}

//! Node self-registration on the admin port: refusals, a registration that becomes an endpoint
//! through the pod annotation it writes, a node that can register its own pod only (the fleet's token
//! and its pod's UID), and a registration that never overrides an address from the API server, the
//! SaladCloud API or a url annotation.
//!
//! The Kubernetes API server is the fake of `tests/support/kube_api/` (kube-rs's real client talks to it
//! through a kubeconfig); the GPU nodes the pods stand for are in-process backends on loopback addresses.

use std::collections::BTreeSet;
use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::harness::*;
use crate::salad_api::FakeSaladApi;
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
    let uid = uid_of(api, "node-0");
    let good =
        json!({"namespace": NS, "pod": "node-0", "uid": uid, "address": address}).to_string();
    let token = Some("s3cret-token");
    assert_eq!(register(&proxy, None, &good).await.0, 401);
    assert_eq!(register(&proxy, Some("s3cret-tokem"), &good).await.0, 401);
    assert_eq!(
        register(&proxy, token, "{\"namespace\": \"gpu\",").await.0,
        400
    );
    let no_port = json!({"namespace": NS, "pod": "node-0", "uid": uid, "address": "127.0.0.5"});
    assert_eq!(register(&proxy, token, &no_port.to_string()).await.0, 400);
    // The body of old: the token alone, without the pod's UID.
    let no_uid = json!({"namespace": NS, "pod": "node-0", "address": address});
    let (status, answer) = register(&proxy, token, &no_uid.to_string()).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer["detail"].as_str().unwrap().contains("metadata.uid"));
    let ghost = json!({"namespace": NS, "pod": "ghost", "uid": uid, "address": address});
    assert_eq!(register(&proxy, token, &ghost.to_string()).await.0, 404);
    let batch_uid = api.pod("batch", "node-1").unwrap()["metadata"]["uid"].clone();
    let unwatched =
        json!({"namespace": "batch", "pod": "node-1", "uid": batch_uid, "address": address});
    assert_eq!(register(&proxy, token, &unwatched.to_string()).await.0, 404);
    let outside = json!({"namespace": NS, "pod": "node-0", "uid": uid, "address": "10.9.8.7:8000"});
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
    // The UID makes the patch conditional on the very pod the node proved it runs as.
    assert_eq!(
        patches[0].body,
        json!({"metadata": {"uid": uid, "annotations": {"tongs.dev/tailscale-address": address}}})
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
    let moved = json!({
        "namespace": NS, "pod": "node-0", "uid": uid, "address": format!("127.0.0.6:{}", node.port())
    });
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
        ("bad-request", 3.0),
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

/// A registration with the fleet's token: `pod` (of namespace `gpu`) at `address`, proving `uid`.
async fn register_as(
    proxy: &TestProxy,
    pod: &str,
    uid: Option<&str>,
    address: &str,
) -> (u16, Value) {
    let mut body = json!({"namespace": NS, "pod": pod, "address": address});
    if let Some(uid) = uid {
        body["uid"] = json!(uid);
    }
    register(proxy, Some(FLEET_TOKEN), &body.to_string()).await
}

const FLEET_TOKEN: &str = "fleet-token-0f9e";

/// `discovery.kubernetes` lines for loopback pods with registration on (the token in the cluster's
/// directory).
fn registering(cluster: &Cluster) -> String {
    let token_file = cluster.file("fleet-token", FLEET_TOKEN);
    format!("registration: {{ token_file: {} }}", token_file.display())
}

async fn registrations(proxy: &TestProxy, result: &str) -> f64 {
    metric_or_zero(
        proxy,
        &format!("tongs_node_registrations_total{{result=\"{result}\"}}"),
    )
    .await
}

#[tokio::test]
async fn a_node_holding_the_fleet_token_registers_its_own_pod_only() {
    let cluster = Cluster::start("tongs-register-own").await;
    let api = &cluster.api;
    let node_a = named("127.0.0.5", "node-a").await;
    let node_b = named("127.0.0.6", "node-b").await;
    api.create(PodBuilder::new("node-a").json());
    api.create(PodBuilder::new("node-b").json());
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS, &registering(&cluster)], "")).await;
    until("/readyz answers 200", || async {
        admin_get(&proxy, "/readyz").await.0 == 200
    })
    .await;
    let (uid_a, uid_b) = (uid_of(api, "node-a"), uid_of(api, "node-b"));
    let at_a = format!("127.0.0.5:{}", node_a.port());
    let at_b = format!("127.0.0.6:{}", node_b.port());

    // Node A's container is compromised: it holds the fleet's token and its own pod's UID, and wants
    // node-b's traffic. None of its tries changes anything.
    for (uid, why) in [
        (None, "the token alone (the body of old)"),
        (Some(uid_a.as_str()), "its own pod's UID"),
        (Some(""), "an empty UID"),
        (
            Some("00000000-0000-4000-8000-00000000ffff"),
            "a guessed UID",
        ),
    ] {
        let (status, answer) = register_as(&proxy, "node-b", uid, &at_a).await;
        assert!(
            status == 400 || (status == 403 && answer["result"] == "wrong-uid"),
            "{why}: {status} {answer}"
        );
    }
    assert!(api.patches().is_empty(), "{:?}", api.patches());
    settle(api, &proxy).await;
    assert!(urls(&proxy).await.is_empty(), "node-b has no address");

    // node-b registers itself, with its own UID, and is served there.
    let (status, answer) = register_as(&proxy, "node-b", Some(&uid_b), &at_b).await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (200, Some("registered")),
        "{answer}"
    );
    until_urls(&proxy, &[&format!("http://{at_b}")]).await;
    // Node A tries again: still refused, node-b keeps its address.
    let (status, answer) = register_as(&proxy, "node-b", Some(&uid_a), &at_a).await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (403, Some("wrong-uid")),
        "{answer}"
    );
    // Node A may register its own pod.
    let (status, answer) = register_as(&proxy, "node-a", Some(&uid_a), &at_a).await;
    assert_eq!(status, 200, "{answer}");
    until_urls(
        &proxy,
        &[&format!("http://{at_a}"), &format!("http://{at_b}")],
    )
    .await;
    assert_eq!(api.patches().len(), 2);
    assert!(api.patches().iter().all(|p| p.status == 200));
    let stored = api.pod(NS, "node-b").unwrap();
    assert_eq!(
        stored["metadata"]["annotations"]["tongs.dev/tailscale-address"],
        at_b.as_str()
    );

    // node-b's pod is replaced under the same name (a re-created pod): the UID the old node knew no
    // longer registers it; the new pod's does.
    api.delete(NS, "node-b");
    api.create(PodBuilder::new("node-b").json());
    let new_uid_b = uid_of(api, "node-b");
    assert_ne!(new_uid_b, uid_b);
    until_urls(&proxy, &[&format!("http://{at_a}")]).await;
    let (status, answer) = register_as(&proxy, "node-b", Some(&uid_b), &at_b).await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (403, Some("wrong-uid")),
        "{answer}"
    );
    let (status, answer) = register_as(&proxy, "node-b", Some(&new_uid_b), &at_b).await;
    assert_eq!(status, 200, "{answer}");
    until_urls(
        &proxy,
        &[&format!("http://{at_a}"), &format!("http://{at_b}")],
    )
    .await;

    assert_eq!(registrations(&proxy, "wrong-uid").await, 5.0);
    assert_eq!(registrations(&proxy, "bad-request").await, 1.0);
    assert_eq!(registrations(&proxy, "registered").await, 3.0);
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn a_registration_never_overrides_an_address_from_the_api_server_the_salad_api_or_a_url() {
    let cluster = Cluster::start("tongs-register-precedence").await;
    let api = &cluster.api;
    let salad_key = "sk-test-5d1c";
    let salad = FakeSaladApi::start("acme", "llm", salad_key).await;
    let key_file = cluster.file("salad-key", salad_key);
    let by_ip = named("127.0.0.2", "by-pod-ip").await;
    let by_url = named("127.0.0.3", "by-url").await;
    let late = named("127.0.0.4", "late-pod-ip").await;
    // Where the registrations point: the node's own Tailscale address, standing in for an attacker's.
    let tailnet = named("127.0.0.9", "registered").await;
    let tailnet_2 = named("127.0.0.10", "registered-2").await;
    api.create(
        PodBuilder::new("with-ip")
            .ip("127.0.0.2")
            .http_port(by_ip.port())
            .json(),
    );
    api.create(
        PodBuilder::new("with-url")
            .annotate("tongs.dev/url", &by_url.url())
            .json(),
    );
    salad.set_group("gpu-with-gateway", Some("plum-9.salad.cloud"), "running", 1);
    api.create(PodBuilder::new("with-gateway").salad().json());
    // No address yet: the API server gives it a podIP later, the SaladCloud API a gateway later.
    api.create(PodBuilder::new("late-ip").http_port(late.port()).json());
    salad.set_group("gpu-late-gateway", None, "deploying", 0);
    api.create(PodBuilder::new("late-gateway").salad().json());
    let top = format!(
        "salad:\n  api_key_file: {}\n  api: {{ url: \"{}\", organization: acme, project: llm }}\n",
        key_file.display(),
        salad.url()
    );
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS, &registering(&cluster)], &top)).await;
    let gateway = "https://plum-9.salad.cloud";
    until_urls(&proxy, &[&by_ip.url(), &by_url.url(), gateway]).await;
    until("late-gateway's group is looked up", || async {
        salad.lookups_of("gpu-late-gateway") >= 1
    })
    .await;

    // Each pod's own node (or whoever holds the token and can read the pod) registers a Tailscale
    // address: refused, with or without the UID, and nothing is written.
    let at_tailnet = format!("127.0.0.9:{}", tailnet.port());
    let pods = [
        ("with-ip", "pod-ip"),
        ("with-url", "url"),
        ("with-gateway", "salad-api"),
    ];
    let mut answers = Vec::new();
    for (pod, _) in pods {
        answers.push(register_as(&proxy, pod, None, &at_tailnet).await);
    }
    for (pod, _) in pods {
        let uid = uid_of(api, pod);
        answers.push(register_as(&proxy, pod, Some(&uid), &at_tailnet).await);
    }
    // The endpoints stay where the API server, the SaladCloud API and the url annotation put them.
    settle(api, &proxy).await;
    assert_eq!(
        urls(&proxy).await,
        BTreeSet::from([by_ip.url(), by_url.url(), gateway.to_owned()]),
        "{answers:?}"
    );
    assert!(api.patches().is_empty(), "{:?}", api.patches());
    for ((pod, _), (status, answer)) in pods.iter().zip(&answers) {
        assert_eq!(*status, 400, "{pod} without its UID: {answer}");
    }
    for ((pod, rule), (status, answer)) in pods.iter().zip(&answers[pods.len()..]) {
        assert_eq!(
            (*status, answer["result"].as_str()),
            (409, Some("has-address")),
            "{pod}: {answer}"
        );
        let detail = answer["detail"].as_str().unwrap();
        assert!(detail.contains(&format!("the {rule} rule")), "{detail}");
    }

    // A pod with no other address may be registered; an address the API server gives it later takes
    // precedence (pod-ip comes before tailscale), and so does a gateway the SaladCloud API names later.
    let (status, answer) = register_as(
        &proxy,
        "late-ip",
        Some(&uid_of(api, "late-ip")),
        &at_tailnet,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let at_tailnet_2 = format!("127.0.0.10:{}", tailnet_2.port());
    let (status, answer) = register_as(
        &proxy,
        "late-gateway",
        Some(&uid_of(api, "late-gateway")),
        &at_tailnet_2,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    until_urls(
        &proxy,
        &[
            &by_ip.url(),
            &by_url.url(),
            gateway,
            &tailnet.url(),
            &tailnet_2.url(),
        ],
    )
    .await;
    api.update(NS, "late-ip", |pod| {
        pod["status"]["podIP"] = json!("127.0.0.4");
        pod["status"]["podIPs"] = json!([{"ip": "127.0.0.4"}]);
    });
    salad.set_group("gpu-late-gateway", Some("fig-3.salad.cloud"), "running", 1);
    until_urls(
        &proxy,
        &[
            &by_ip.url(),
            &by_url.url(),
            gateway,
            &late.url(),
            "https://fig-3.salad.cloud",
        ],
    )
    .await;
    // And a registration now is refused.
    let (status, _) = register_as(
        &proxy,
        "late-ip",
        Some(&uid_of(api, "late-ip")),
        &at_tailnet,
    )
    .await;
    assert_eq!(status, 409);

    assert_eq!(
        tailnet.hits() + tailnet_2.hits(),
        0,
        "no client request was sent"
    );
    assert_eq!(registrations(&proxy, "has-address").await, 4.0);
    assert!(salad.unexpected().is_empty(), "{:?}", salad.unexpected());
    cluster.finish(proxy).await;
}

async fn drain(proxy: &TestProxy, token: Option<&str>, body: &Value) -> (u16, Value) {
    let mut request = Request::post(format!("http://{}/v1/nodes/drain", proxy.admin))
        .header("content-type", "application/json");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let (status, text) = send(request.body(full(body.to_string())).expect("request")).await;
    let answer = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, answer)
}

/// A node says it is going (`POST /v1/nodes/drain`, with the fleet's token and its pod's UID, as a
/// registration): the pod's drain annotation gets the time it goes, conditional on the UID, and through
/// its own watch tongs stops serving the pod. A call without the token, or with another pod's UID, or
/// with a time out of range, is refused and writes nothing.
#[tokio::test]
async fn a_node_that_says_it_is_going_drains_through_its_pod_annotation() {
    let cluster = Cluster::start("tongs-drain").await;
    let api = &cluster.api;
    let going = named_pod(api, "127.0.0.6", "going").await;
    let staying = named_pod(api, "127.0.0.7", "staying").await;
    let token_file = cluster.file("token", "s3cret-token\n");
    let token_setting = format!("registration: {{ token_file: {} }}", token_file.display());
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS, &token_setting], "")).await;
    let (going_url, staying_url) = (going.url(), staying.url());
    until_urls(&proxy, &[&going_url, &staying_url]).await;

    let uid = uid_of(api, "going");
    let other_uid = uid_of(api, "staying");
    let token = Some("s3cret-token");
    let notice = json!({"namespace": NS, "pod": "going", "uid": uid, "seconds": 20});
    assert_eq!(drain(&proxy, None, &notice).await.0, 401);
    assert_eq!(drain(&proxy, Some("s3cret-tokem"), &notice).await.0, 401);
    let stolen = json!({"namespace": NS, "pod": "going", "uid": other_uid, "seconds": 20});
    assert_eq!(drain(&proxy, token, &stolen).await.0, 403);
    let forever = json!({"namespace": NS, "pod": "going", "uid": uid, "seconds": 1e9});
    assert_eq!(drain(&proxy, token, &forever).await.0, 400);
    let stray = json!({"namespace": NS, "pod": "going", "uid": uid, "address": "127.0.0.6:1"});
    assert_eq!(drain(&proxy, token, &stray).await.0, 400);
    assert!(api.patches().is_empty(), "refused calls patch nothing");
    assert_eq!(urls(&proxy).await.len(), 2, "and change nothing");

    let before = std::time::SystemTime::now();
    let (status, answer) = drain(&proxy, token, &notice).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "draining");
    let patches = api.patches();
    assert_eq!(patches.len(), 1);
    assert_eq!(patches[0].body["metadata"]["uid"], uid.as_str());
    let at = patches[0].body["metadata"]["annotations"]["tongs.dev/drain-at"]
        .as_str()
        .expect("the time it goes")
        .to_owned();
    // RFC 3339, about 20 s from now (to the second).
    let at: std::time::SystemTime = at
        .parse::<k8s_openapi::jiff::Timestamp>()
        .expect(&at)
        .into();
    let left = at
        .duration_since(before)
        .expect("in the future")
        .as_secs_f64();
    assert!((18.0..=22.0).contains(&left), "{left}");

    // Through its own watch, tongs serves only the pod that stays.
    until_urls(&proxy, &[&staying_url]).await;
    for _ in 0..5 {
        assert_eq!(get(&proxy.url("/")).await, (200, "staying".into()));
    }
    let drained = metric_or_zero(
        &proxy,
        "tongs_node_registrations_total{result=\"draining\"}",
    )
    .await;
    assert_eq!(drained, 1.0);
    cluster.finish(proxy).await;
}

/// A node that says it goes in 5 s (`POST /v1/nodes/drain`) while it holds a stream with 8 s to go:
/// through its pod's annotation tongs moves the stream to the other pod before then, and the client
/// reads one whole stream, exactly what one node would have written. The nodes are the simulator's
/// (they answer `/v1/completions` as vLLM does), on their own loopback addresses.
#[tokio::test]
async fn a_node_that_says_it_goes_in_5_s_has_its_stream_moved_whole() {
    const TOKENS: u32 = 160;
    let cluster = Cluster::start("tongs-drain-move").await;
    let api = &cluster.api;
    let mut specs = sim_nodes(2, Duration::from_secs(8), |spec| {
        spec.service_time.spread = 0.0;
        spec.tokens = TOKENS;
    });
    for (i, spec) in specs.iter_mut().enumerate() {
        spec.listen = format!("127.0.0.{}:0", 8 + i).parse().expect("an address");
    }
    let fleet = sim_fleet(3, specs).await;
    let names = ["node-0", "node-1"];
    for (node, name) in fleet.nodes().iter().zip(names) {
        serve_pod(api, name, &node.addr().ip().to_string(), node.addr().port());
    }
    let token_file = cluster.file("token", "s3cret-token\n");
    let token_setting = format!("registration: {{ token_file: {} }}", token_file.display());
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS, &token_setting], "")).await;
    let urls_wanted: Vec<String> = fleet.urls();
    until_urls(&proxy, &[&urls_wanted[0], &urls_wanted[1]]).await;

    let request = tongs::demo::build_request(&proxy.url(""), 40, true, TOKENS)
        .map(|body| body.map_err(|never| match never {}).boxed());
    let read = tokio::spawn(exchange(request));
    let fleet_ref = &fleet;
    eventually("a node holds the stream", HANG, || {
        fleet_ref.nodes().iter().any(|n| n.stats().in_flight == 1)
    })
    .await;
    let holder = fleet
        .nodes()
        .iter()
        .position(|n| n.stats().in_flight == 1)
        .expect("the node holding the stream");
    let notice = json!({"namespace": NS, "pod": names[holder], "uid": uid_of(api, names[holder]),
        "seconds": 5});
    let (status, answer) = drain(&proxy, Some("s3cret-token"), &notice).await;
    assert_eq!(status, 200, "{answer}");

    let (head, body) = tokio::time::timeout(HANG, read)
        .await
        .expect("the stream ends")
        .expect("the reading task");
    assert_eq!(head.status, 200);
    assert_eq!(
        tongs::demo::check_completion(40, true, TOKENS, body.as_bytes()),
        Ok(()),
        "{body}"
    );
    assert_eq!(sample(&proxy, "tongs_streams_moved_total").await, 1.0);
    assert_eq!(sample(&proxy, "tongs_streams_cut_total").await, 0.0);
    assert_eq!(
        fleet.nodes()[1 - holder].stats().received,
        1,
        "continued on the other node"
    );
    assert_eq!(
        urls(&proxy).await,
        BTreeSet::from([urls_wanted[1 - holder].clone()])
    );
    cluster.finish(proxy).await;
}

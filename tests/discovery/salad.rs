//! The salad-api rule against a fake SaladCloud API: lookups with the key, retries, write-back, the
//! rule order with a podIP, and which gateways the key goes to.
//!
//! Fakes: the SaladCloud API (`tests/support/salad_api.rs`) and the Kubernetes API server
//! (`tests/support/kube_api/`); the Container Gateway and the GPU nodes behind it are in-process
//! backends on loopback addresses.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::json;

use crate::harness::*;
use crate::salad_api::FakeSaladApi;
use crate::support::gateway::{FakeGateway, GatewayPki};
use crate::support::*;

const SALAD_KEY: &str = "sk-test-7f3a";

/// Top-level config for SaladCloud API lookups against `salad` with the key in `key_file`.
fn salad_config(salad: &FakeSaladApi, key_file: &Path) -> String {
    format!(
        "salad:\n  api_key_file: {}\n  api: {{ url: \"{}\", organization: acme, project: llm }}\n",
        key_file.display(),
        salad.url()
    )
}

async fn lookups(proxy: &TestProxy, result: &str) -> f64 {
    metric_or_zero(
        proxy,
        &format!("tongs_salad_api_lookups_total{{result=\"{result}\"}}"),
    )
    .await
}

#[tokio::test]
async fn salad_pods_get_their_gateway_host_from_the_salad_api_and_write_it_back() {
    let cluster = Cluster::start("tongs-salad").await;
    let api = &cluster.api;
    let salad = FakeSaladApi::start("acme", "llm", SALAD_KEY).await;
    let key_file = cluster.file("salad-key", &format!("{SALAD_KEY}\n"));
    // The Virtual Kubelet has made the group; its gateway is not configured yet.
    salad.set_group("gpu-llm-0", None, "deploying", 0);
    api.create(PodBuilder::new("llm-0").salad().json());
    // Not a SaladCloud pod: never looked up.
    api.create(PodBuilder::new("plain").json());
    let proxy =
        start_proxy(cluster.config(&["write_back: true"], &salad_config(&salad, &key_file))).await;
    until("the group is looked up and has no gateway yet", || async {
        lookups(&proxy, "not-yet").await >= 1.0
    })
    .await;
    assert!(urls(&proxy).await.is_empty());
    assert_eq!(
        metric(&proxy, "tongs_discovery_pods{state=\"no-address\"}").await,
        Some(2.0)
    );

    // The gateway comes up: the next lookup (with backoff) finds it.
    salad.set_group(
        "gpu-llm-0",
        Some("Tamarind-Navybean-2kln8fkx9xruvxa2.salad.cloud"),
        "running",
        1,
    );
    let gateway = "https://tamarind-navybean-2kln8fkx9xruvxa2.salad.cloud";
    until_urls(&proxy, &[gateway]).await;
    let view = endpoint(&proxy, gateway).await;
    assert_eq!(
        (view["pod"].as_str(), view["source"].as_str()),
        (Some("gpu/llm-0"), Some("kubernetes"))
    );
    assert_eq!(lookups(&proxy, "found").await, 1.0);

    // Written back into the pod, where every replica and kubectl see it.
    until("the gateway URL is written back", || async {
        !api.patches().is_empty()
    })
    .await;
    let patches = api.patches();
    assert_eq!(patches.len(), 1);
    assert_eq!(
        (patches[0].name.as_str(), patches[0].status),
        ("llm-0", 200)
    );
    assert_eq!(patches[0].content_type, "application/merge-patch+json");
    assert_eq!(
        patches[0].body,
        json!({"metadata": {"annotations": {"tongs.dev/url": gateway}}})
    );
    let stored = api.pod(NS, "llm-0").expect("llm-0");
    assert_eq!(stored["metadata"]["annotations"]["tongs.dev/url"], gateway);
    // A replica that starts now takes the URL from the annotation, with no lookup of its own.
    let asked = salad.requests().len();
    let replica = start_proxy(cluster.config(&[], "")).await;
    until_urls(&replica, &[gateway]).await;
    settle(api, &proxy).await;
    assert_eq!(urls(&proxy).await, BTreeSet::from([gateway.to_owned()]));
    assert_eq!(
        salad.requests().len(),
        asked,
        "no more lookups once the URL is annotated"
    );

    for request in salad.requests() {
        assert_eq!(request.method, http::Method::GET);
        assert_eq!(
            request.path,
            "/api/public/organizations/acme/projects/llm/containers/gpu-llm-0"
        );
        assert!(request.authorized, "the lookup carries the Salad-Api-Key");
    }
    assert_eq!(salad.lookups_of("gpu-plain"), 0);
    assert!(salad.unexpected().is_empty(), "{:?}", salad.unexpected());
    cluster.finish(proxy).await;
    replica.stop().await;
}

#[tokio::test]
async fn salad_api_failures_are_retried_and_never_guess_an_address() {
    let cluster = Cluster::start("tongs-salad-failures").await;
    let api = &cluster.api;
    let salad = FakeSaladApi::start("acme", "llm", SALAD_KEY).await;
    salad.set_group("gpu-llm-1", Some("pear-1.salad.cloud"), "running", 1);
    // The first lookup fails with 500 (whichever pod's it is); ghost's group does not exist (404).
    salad.fail_next(1);
    api.create(PodBuilder::new("llm-1").salad().json());
    api.create(PodBuilder::new("ghost").salad().json());
    let good_key = cluster.file("salad-key", SALAD_KEY);
    let wrong_key = cluster.file("wrong-key", "sk-wrong");
    let proxy = start_proxy(cluster.config(&[], &salad_config(&salad, &good_key))).await;
    let locked_out = start_proxy(cluster.config(&[], &salad_config(&salad, &wrong_key))).await;

    until_urls(&proxy, &["https://pear-1.salad.cloud"]).await;
    until("ghost's missing group is asked for again", || async {
        salad.lookups_of("gpu-ghost") >= 2 && lookups(&proxy, "not-yet").await >= 2.0
    })
    .await;
    // The replica with the wrong key is refused (401), keeps retrying, and serves nothing.
    until("the wrong key's lookups are retried", || async {
        lookups(&locked_out, "error").await >= 3.0
    })
    .await;
    assert!(urls(&locked_out).await.is_empty());
    assert_eq!(lookups(&locked_out, "found").await, 0.0);
    assert_eq!(lookups(&proxy, "found").await, 1.0);
    let refused = salad.requests().iter().filter(|r| r.status == 401).count();
    assert!(refused >= 3, "{:?}", salad.requests());
    assert!(
        salad
            .requests()
            .iter()
            .all(|r| (r.status == 401) != r.authorized)
    );
    assert_eq!(
        salad.requests().iter().filter(|r| r.status == 500).count(),
        1,
        "the injected failure"
    );
    assert_eq!(
        urls(&proxy).await,
        BTreeSet::from(["https://pear-1.salad.cloud".to_owned()])
    );
    assert!(api.patches().is_empty(), "write_back is off");
    assert!(salad.unexpected().is_empty(), "{:?}", salad.unexpected());
    cluster.finish(proxy).await;
    locked_out.stop().await;
}

#[tokio::test]
async fn a_salad_pod_with_a_pod_ip_serves_there_until_its_gateway_is_known() {
    let cluster = Cluster::start("tongs-salad-pod-ip").await;
    let api = &cluster.api;
    let salad = FakeSaladApi::start("acme", "llm", SALAD_KEY).await;
    let key_file = cluster.file("salad-key", SALAD_KEY);
    let direct = named("127.0.0.6", "direct").await;
    salad.set_group("gpu-llm-2", None, "deploying", 0);
    api.create(
        PodBuilder::new("llm-2")
            .salad()
            .ip("127.0.0.6")
            .http_port(direct.port())
            .json(),
    );
    let proxy =
        start_proxy(cluster.config(&[LOOPBACK_PODS], &salad_config(&salad, &key_file))).await;
    // salad-api comes before pod-ip: while it has no answer the podIP serves, and the lookup goes on.
    until_urls(&proxy, &[&direct.url()]).await;
    assert_eq!(get(&proxy.url("/")).await, (200, "direct".into()));
    until("the group is looked up", || async {
        salad.lookups_of("gpu-llm-2") >= 1
    })
    .await;
    salad.set_group("gpu-llm-2", Some("plum-2.salad.cloud"), "running", 1);
    until_urls(&proxy, &["https://plum-2.salad.cloud"]).await;
    cluster.finish(proxy).await;
}

/// The SaladCloud key on the socket: a gateway the SaladCloud API confirmed for this project, and one
/// `discovery.static` names, receive it on every request and heartbeat; a gateway that only an
/// annotation names — whoever wrote it, for whatever host under `salad.gateways` — never does.
///
/// No `*.salad.cloud` name resolves to this machine, so loopback IPs stand in for gateway hosts (the
/// fake API answers `networking.dns: 127.0.0.7`) and the range `127.0.0.0/8` for `salad.gateways`'
/// `https://*.salad.cloud`.
#[tokio::test]
async fn the_salad_key_goes_only_to_gateways_the_salad_api_or_static_config_vouches_for() {
    let cluster = Cluster::start("tongs-salad-key").await;
    let api = &cluster.api;
    let salad = FakeSaladApi::start("acme", "llm", SALAD_KEY).await;
    let key_file = cluster.file("salad-key", SALAD_KEY);
    let pki = GatewayPki::new(&["127.0.0.7", "127.0.0.8", "127.0.0.9"]);
    let ca_file = cluster.file("gateway-ca.pem", &pki.ca_pem);
    let confirmed = FakeGateway::start(&pki, "127.0.0.7", "confirmed").await;
    // A gateway of someone else's SaladCloud organisation, named in pods' url annotations.
    let foreign = FakeGateway::start(&pki, "127.0.0.8", "foreign").await;
    let fixed = FakeGateway::start(&pki, "127.0.0.9", "static").await;
    // llm-ok's group has the gateway its annotation names (written back by a replica, say);
    // llm-foreign's group has its own gateway, not the one someone wrote into its pod.
    salad.set_group("gpu-llm-ok", Some("127.0.0.7"), "running", 1);
    salad.set_group(
        "gpu-llm-foreign",
        Some("tamarind-x.salad.cloud"),
        "running",
        1,
    );
    api.create(
        PodBuilder::new("llm-ok")
            .salad()
            .annotate("tongs.dev/url", &confirmed.url())
            .json(),
    );
    api.create(
        PodBuilder::new("llm-foreign")
            .salad()
            .annotate("tongs.dev/url", &foreign.url())
            .json(),
    );
    // Not a SaladCloud pod: no group the API could confirm.
    let plain_url = format!("{}/plain", foreign.url());
    api.create(
        PodBuilder::new("plain")
            .annotate("tongs.dev/url", &plain_url)
            .json(),
    );
    let top = format!(
        "salad:\n  api_key_file: {}\n  gateways: [127.0.0.0/8]\n  api: {{ url: \"{}\", organization: acme, project: llm }}\n\
         upstream: {{ extra_ca_file: {} }}\n\
         health: {{ interval: 100ms, timeout: 2s }}\n\
         balancer: {{ policy: least-outstanding, slow_start: 0s }}\n",
        key_file.display(),
        salad.url(),
        ca_file.display()
    );
    let proxy =
        start_proxy(cluster.config_and_static(&[LOOPBACK_PODS], &top, &[fixed.url()])).await;
    until_urls(
        &proxy,
        &[&confirmed.url(), &foreign.url(), &plain_url, &fixed.url()],
    )
    .await;

    // Heartbeats and client traffic (with a key of the client's own) reach every gateway; requests go
    // on until each has had some. Without slow start (the config above): endpoints joining the static
    // one would ramp in from 10 % over 5 s, and these requests would wait out the ramp.
    let request = || {
        http::Request::get(proxy.url("/v1/models"))
            .header("salad-api-key", "sk-client-own")
            .body(full(""))
            .unwrap()
    };
    until("every gateway has had heartbeats and requests", || async {
        assert_eq!(send(request()).await.0, 200);
        [&foreign, &confirmed, &fixed].iter().all(|gateway| {
            let seen = gateway.seen();
            seen.iter().filter(|r| r.path == "/health").count() >= 10
                && seen.iter().any(|r| r.path == "/v1/models")
        })
    })
    .await;
    // A gateway only an annotation names never gets the key, before the lookups or after.
    let no_key_leaked = || {
        let leaked: Vec<_> = foreign
            .seen()
            .into_iter()
            .filter(|r| r.key.is_some())
            .collect();
        assert!(
            leaked.is_empty(),
            "a gateway only an annotation names got a key: {leaked:?}"
        );
    };
    no_key_leaked();
    until("both SaladCloud pods are looked up", || async {
        lookups(&proxy, "found").await >= 2.0
    })
    .await;

    // The confirmed gateway gets the key from its confirmation on, and keeps it.
    until("the confirmed gateway is sent tongs' key", || async {
        confirmed
            .seen()
            .iter()
            .any(|r| r.key.as_deref() == Some(SALAD_KEY))
    })
    .await;
    let from = foreign.seen().len();
    until("more heartbeats after the lookups", || async {
        foreign.seen().len() >= from + 10
    })
    .await;
    let seen = confirmed.seen();
    let first = seen
        .iter()
        .position(|r| r.key.is_some())
        .expect("a keyed request");
    assert!(
        seen[first..]
            .iter()
            .all(|r| r.key.as_deref() == Some(SALAD_KEY)),
        "{seen:?}"
    );
    // The static one from the first request on; the client's own key never passes.
    let seen = fixed.seen();
    assert!(seen.iter().any(|r| r.path == "/v1/models"));
    assert!(
        seen.iter().all(|r| r.key.as_deref() == Some(SALAD_KEY)),
        "{seen:?}"
    );
    no_key_leaked();
    assert_eq!(salad.lookups_of("gpu-plain"), 0);
    assert!(salad.unexpected().is_empty(), "{:?}", salad.unexpected());
    cluster.finish(proxy).await;
}

//! Losing the watch: a cut connection resumes from its resourceVersion; a compacted history or a
//! server-expired watch (410) makes tongs list again, with the endpoints in service while lists fail;
//! bookmarks; and lists of thousands of pods in pages.
//!
//! The Kubernetes API server is the fake of `tests/support/kube_api/` (kube-rs's real client talks to it
//! through a kubeconfig); the GPU nodes the pods stand for are `tongs::sim` nodes and in-process
//! backends on loopback addresses.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;
use tongs::sim::{Fleet, NodeSpec};

use crate::harness::*;
use crate::kube_api::RecordedRequest;
use crate::support::*;

/// Two simulated GPU nodes on 127.0.0.2 and 127.0.0.3, fast enough for steady background load.
async fn two_sim_nodes() -> Fleet {
    let node = |name: &str, ip: [u8; 4]| NodeSpec {
        listen: std::net::SocketAddr::from((ip, 0)),
        capacity: 8,
        ..NodeSpec::new(name, Duration::from_millis(5))
    };
    let nodes = vec![node("sim-a", [127, 0, 0, 2]), node("sim-b", [127, 0, 0, 3])];
    sim_fleet(9, nodes).await
}

/// [`two_sim_nodes`] as pods `a` and `b`, a proxy serving both (their URLs), and its watch open.
async fn two_sim_pods_watched(cluster: &Cluster) -> (Fleet, TestProxy, [String; 2]) {
    let api = &cluster.api;
    let fleet = two_sim_nodes().await;
    api.create(sim_pod(&fleet, 0, "a"));
    api.create(sim_pod(&fleet, 1, "b"));
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS], COIN_TOSS)).await;
    let [a, b] = [0, 1].map(|i| fleet.nodes()[i].url());
    until_urls(&proxy, &[&a, &b]).await;
    until("the watch is open", || async {
        api.stats().open_watches == 1
    })
    .await;
    (fleet, proxy, [a, b])
}

fn sim_pod(fleet: &Fleet, index: usize, name: &str) -> Value {
    let addr = fleet.nodes()[index].addr();
    PodBuilder::new(name)
        .ip(&addr.ip().to_string())
        .http_port(addr.port())
        .json()
}

#[tokio::test]
async fn a_dropped_watch_resumes_from_its_resource_version_and_misses_nothing() {
    let cluster = Cluster::start("tongs-watch-drop").await;
    let api = &cluster.api;
    let (_fleet, proxy, [_a, b]) = two_sim_pods_watched(&cluster).await;
    let third = named("127.0.0.4", "third").await;
    let resume_from = api.resource_version();
    let before = api.stats();
    let load = Load::start(proxy.url("/v1/completions"));

    // The connection is cut; while it is down, a pod goes and another comes.
    api.atomically(|c| {
        assert_eq!(c.drop_watches(), 1);
        c.delete(NS, "a");
        c.create(
            PodBuilder::new("c")
                .ip("127.0.0.4")
                .http_port(third.port())
                .json(),
        );
    });
    until_urls(&proxy, &[&b, &third.url()]).await;
    let statuses = load.finish().await;
    assert!(!statuses.is_empty());
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    let after = api.stats();
    assert_eq!(
        after.lists_started, before.lists_started,
        "resumed, not re-listed"
    );
    assert_eq!(after.watches_expired, 0);
    let resumed = &watches(api)[before.watch_requests as usize];
    assert_eq!(
        resumed.param("resourceVersion"),
        Some(resume_from.to_string().as_str()),
        "the watch resumes where it was"
    );
    assert_eq!(
        metric(&proxy, "tongs_discovery_lists_total").await,
        Some(1.0)
    );
    assert_eq!(get(&proxy.url("/")).await.0, 200);
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn a_compacted_history_relists_and_the_endpoints_stay_in_service_while_lists_fail() {
    let cluster = Cluster::start("tongs-watch-gone").await;
    let api = &cluster.api;
    let (fleet, proxy, [a, b]) = two_sim_pods_watched(&cluster).await;
    let load = Load::start(proxy.url("/v1/completions"));

    // The API server restarts: watches cut, pod a deleted meanwhile, history compacted (so the
    // watch cannot resume: 410), and lists fail for a while.
    api.atomically(|c| {
        c.fail_next_lists(u64::MAX);
        assert_eq!(c.drop_watches(), 1);
        c.delete(NS, "a");
        c.compact();
    });
    until(
        "the watch is refused with 410 and lists fail twice",
        || async {
            let stats = api.stats();
            stats.watches_expired >= 1 && stats.lists_failed >= 2
        },
    )
    .await;
    // Stale beats empty: both endpoints still serve, the deleted pod's included.
    assert_eq!(urls(&proxy).await, BTreeSet::from([a.clone(), b.clone()]));
    for _ in 0..10 {
        assert_eq!(get(&proxy.url("/v1/completions")).await.0, 200);
    }
    assert!(metric_or_zero(&proxy, "tongs_discovery_watch_errors_total").await >= 3.0);
    assert_eq!(admin_get(&proxy, "/readyz").await.0, 200, "still ready");

    api.heal_lists();
    until_urls(&proxy, &[&b]).await;
    let statuses = load.finish().await;
    assert!(!statuses.is_empty());
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(
        metric(&proxy, "tongs_discovery_lists_total").await,
        Some(2.0)
    );
    assert_eq!(
        fleet.nodes()[1].stats().served + fleet.nodes()[0].stats().served,
        statuses.len() as u64 + 10,
        "every request was served by a node"
    );
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn a_watch_the_server_expires_relists_without_disturbing_the_endpoints() {
    let cluster = Cluster::start("tongs-watch-expired").await;
    let api = &cluster.api;
    let a = named_pod(api, "127.0.0.2", "a").await;
    let b = named_pod(api, "127.0.0.3", "b").await;
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS], COIN_TOSS)).await;
    until_urls(&proxy, &[&a.url(), &b.url()]).await;
    until("the watch is open", || async {
        api.stats().open_watches == 1
    })
    .await;
    until("both endpoints have served", || async {
        get(&proxy.url("/")).await;
        a.hits() > 0 && b.hits() > 0
    })
    .await;
    let served = |view: &Value| view["requests"].as_u64().unwrap_or(0);
    let before_a = served(&endpoint(&proxy, &a.url()).await);
    let before_b = served(&endpoint(&proxy, &b.url()).await);

    expire_the_watch(api, &proxy, 2.0).await;
    let stats = api.stats();
    assert_eq!(stats.watches_expired, 1);
    assert_eq!(stats.lists_started, 2);
    // The same endpoints, with their counters: a re-list that changes nothing churns nothing.
    assert_eq!(urls(&proxy).await, BTreeSet::from([a.url(), b.url()]));
    assert!(served(&endpoint(&proxy, &a.url()).await) >= before_a.max(1));
    assert!(served(&endpoint(&proxy, &b.url()).await) >= before_b.max(1));
    assert!(metric_or_zero(&proxy, "tongs_discovery_watch_errors_total").await >= 1.0);
    // And it follows changes again.
    api.delete(NS, "a");
    until_urls(&proxy, &[&b.url()]).await;
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn a_bookmark_lets_the_watch_resume_past_a_compaction() {
    let cluster = Cluster::start("tongs-bookmarks").await;
    let api = &cluster.api;
    let a = named_pod(api, "127.0.0.2", "a").await;
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS], "")).await;
    until_urls(&proxy, &[&a.url()]).await;
    until("the watch is open", || async {
        api.stats().open_watches == 1
    })
    .await;
    let noise = |c: &mut crate::kube_api::Cluster, round: usize| {
        for index in 0..5 {
            c.create(
                PodBuilder::new(&format!("web-{round}-{index}"))
                    .label("app", "web")
                    .json(),
            );
        }
    };

    // Changes tongs does not watch move the resourceVersion on; a bookmark tells the watch, so the
    // watch resumes past the compaction without a re-list when the server ends it.
    let before = api.stats();
    let bookmarked = api.atomically(|c| {
        noise(c, 0);
        assert_eq!(c.bookmark(), 1, "the watch asked for bookmarks");
        c.compact();
        assert_eq!(c.end_watches(), 1);
        c.resource_version()
    });
    until("the watch resumes", || async {
        api.stats().watch_requests > before.watch_requests
    })
    .await;
    let resumed = &watches(api)[before.watch_requests as usize];
    assert_eq!(
        resumed.param("resourceVersion"),
        Some(bookmarked.to_string().as_str())
    );
    until("the watch is open again", || async {
        api.stats().open_watches == 1
    })
    .await;
    let stats = api.stats();
    assert_eq!(stats.lists_started, before.lists_started);
    assert_eq!(stats.watches_expired, 0);

    // The same without a bookmark: the watch's version is compacted away, so it must re-list.
    api.atomically(|c| {
        noise(c, 1);
        c.compact();
        c.end_watches();
    });
    until("the re-list is applied", || async {
        metric_or_zero(&proxy, "tongs_discovery_lists_total").await == 2.0
    })
    .await;
    assert_eq!(api.stats().watches_expired, 1);
    assert_eq!(urls(&proxy).await, BTreeSet::from([a.url()]));
    cluster.finish(proxy).await;
}

#[tokio::test]
async fn thousands_of_pods_are_listed_in_pages_of_500() {
    let cluster = Cluster::start("tongs-many-pods").await;
    let api = &cluster.api;
    const PODS: usize = 2_000;
    api.atomically(|c| {
        for index in 0..PODS {
            let ip = format!("127.1.{}.{}", index / 250, index % 250 + 1);
            c.create(
                PodBuilder::new(&format!("llm-{index:04}"))
                    .ip(&ip)
                    .annotate("tongs.dev/port", "8000")
                    .json(),
            );
        }
    });
    let proxy = start_proxy(cluster.config(&[LOOPBACK_PODS], "")).await;
    until("/readyz answers 200", || async {
        admin_get(&proxy, "/readyz").await.0 == 200
    })
    .await;
    assert_eq!(endpoints(&proxy).await.len(), PODS);
    assert_eq!(
        metric(&proxy, "tongs_discovery_pods{state=\"serving\"}").await,
        Some(PODS as f64)
    );
    let lists: Vec<RecordedRequest> = api
        .requests()
        .into_iter()
        .filter(RecordedRequest::is_list)
        .collect();
    assert_eq!(lists.len(), 4, "2,000 pods in pages of 500");
    assert!(lists.iter().all(|l| l.param("limit") == Some("500")));
    assert_eq!(lists[0].param("continue"), None);
    assert!(lists[1..].iter().all(|l| l.param("continue").is_some()));

    // One pod out, one re-list later all pods still there.
    api.update(NS, "llm-0007", |pod| set_ready(pod, false));
    until("the NotReady pod leaves", || async {
        endpoints(&proxy).await.len() == PODS - 1
    })
    .await;
    expire_the_watch(api, &proxy, 2.0).await;
    assert_eq!(endpoints(&proxy).await.len(), PODS - 1);
    assert_eq!(api.stats().list_requests, 8);
    cluster.finish(proxy).await;
}

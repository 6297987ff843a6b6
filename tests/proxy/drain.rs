//! Nodes that announce their end: a heartbeat answer carrying `x-tongs-drain: <seconds left>` drains
//! the endpoint (no new request, those in flight finish, nothing counts against it) until an answer
//! no longer carries it. The nodes are scripted backends on real sockets.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use http::{Response, StatusCode};

use tokio::task::JoinHandle;

use crate::support::*;

/// Quick heartbeats; least-outstanding, so that once it serves again the node that held a slow request
/// is not ranked down for how long that request took.
const CONFIG: &str = "health: { interval: 200ms, timeout: 300ms, fast_interval: 100ms }\n\
                      balancer: { policy: least-outstanding }\n";

/// A node whose heartbeat answers carry a drain notice while `going` is set (with a 503, as a node
/// shutting down may send), and whose `/slow` waits for `gate`. Every answer names the node.
async fn node(name: &'static str, going: Arc<AtomicBool>, gate: Gate) -> Backend {
    backend(move |request| {
        let (going, gate) = (Arc::clone(&going), gate.clone());
        async move {
            match request.uri().path() {
                "/health" if going.load(Ordering::SeqCst) => Response::builder()
                    .status(StatusCode::SERVICE_UNAVAILABLE)
                    .header("x-tongs-drain", "30")
                    .body(full("going"))
                    .unwrap(),
                "/health" => Response::new(full("ok")),
                "/slow" => {
                    gate.pass().await;
                    Response::new(full(name))
                }
                _ => Response::new(full(name)),
            }
        }
    })
    .await
}

/// One `/slow` request held on each of the proxy's two nodes: the second is sent once the first is
/// held, so the node with the fewest outstanding, the other one, takes it. (Sent at once, both picks
/// could see two idle nodes and choose the same.)
async fn one_slow_request_on_each(proxy: &TestProxy) -> [JoinHandle<(u16, String)>; 2] {
    let slow = |url: String| tokio::spawn(async move { get(&url).await });
    let held = |count: u64| {
        let snapshot = proxy.app_registry.snapshot();
        snapshot.iter().map(|e| e.outstanding()).sum::<u64>() == count
            && snapshot.iter().all(|e| e.outstanding() <= 1)
    };
    let first = slow(proxy.url("/slow"));
    eventually("the first is held", Duration::from_secs(10), || held(1)).await;
    let second = slow(proxy.url("/slow"));
    eventually("each node holds one", Duration::from_secs(10), || held(2)).await;
    [first, second]
}

#[tokio::test]
async fn a_node_that_announces_its_end_drains_and_serves_again_once_it_stops_saying_so() {
    let going = Arc::new(AtomicBool::new(false));
    let (leaving_gate, staying_gate) = (Gate::default(), Gate::default());
    let leaving = node("leaving", Arc::clone(&going), leaving_gate.clone()).await;
    let staying = node(
        "staying",
        Arc::new(AtomicBool::new(false)),
        staying_gate.clone(),
    )
    .await;
    let proxy = start_proxy(config_with(CONFIG, &[leaving.url(), staying.url()])).await;

    let [first, second] = one_slow_request_on_each(&proxy).await;
    let view = |url: String| {
        let proxy = &proxy;
        async move { endpoint_view(proxy, &url).await }
    };

    // The node says it is going: it drains, and says how long it has left.
    going.store(true, Ordering::SeqCst);
    eventually_async(
        "the announcing node drains",
        Duration::from_secs(10),
        || {
            let leaving = view(leaving.url());
            async move { leaving.await["state"] == "draining" }
        },
    )
    .await;
    let drained = view(leaving.url()).await;
    assert_eq!(drained["announced_drain"], true, "{drained}");
    let left = drained["leaving_in_s"].as_f64().expect("it said how long");
    assert!(left > 0.0 && left <= 30.0, "{left}");
    assert_eq!(
        drained["healthy"], true,
        "a node that says it goes is not failing: {drained}"
    );

    // No new request goes there, while it still holds its slow one.
    for _ in 0..10 {
        let (status, body) = get(&proxy.url("/quick")).await;
        assert_eq!((status, body.as_str()), (200, "staying"));
    }
    // Its request in flight finishes, and nothing counts against it.
    leaving_gate.release(1);
    staying_gate.release(1);
    let answers = [first.await.unwrap(), second.await.unwrap()];
    let mut names: Vec<_> = answers.iter().map(|(_, body)| body.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["leaving", "staying"], "{answers:?}");
    let drained = view(leaving.url()).await;
    assert_eq!(drained["failures"], 0, "{drained}");
    assert_eq!(drained["breaker"], "closed", "{drained}");

    // Once its answers no longer carry the notice, it serves again.
    going.store(false, Ordering::SeqCst);
    eventually_async("the node serves again", Duration::from_secs(10), || {
        let leaving = view(leaving.url());
        async move { leaving.await["draining"] == false }
    })
    .await;
    let reached = AtomicUsize::new(0);
    for _ in 0..20 {
        if get(&proxy.url("/quick")).await.1 == "leaving" {
            reached.fetch_add(1, Ordering::Relaxed);
        }
    }
    assert!(
        reached.load(Ordering::Relaxed) > 0,
        "no request reached it again"
    );
    proxy.stop().await;
}

/// An operator drains a static endpoint by its URL (`POST /endpoints/drain`, behind the admin token):
/// it gets no new request while the one it holds finishes; `POST /endpoints/undrain` undoes it. Without
/// the token, or for a URL no pool has, nothing changes.
#[tokio::test]
async fn an_operator_drains_a_static_endpoint_and_undoes_it() {
    let dir = TempDir::new("operator-drain");
    let token_file = dir.0.join("token");
    std::fs::write(&token_file, "admin-s3cret\n").unwrap();
    let (drained_gate, kept_gate) = (Gate::default(), Gate::default());
    let drained = node(
        "drained",
        Arc::new(AtomicBool::new(false)),
        drained_gate.clone(),
    )
    .await;
    let kept = node("kept", Arc::new(AtomicBool::new(false)), kept_gate.clone()).await;
    let mut config = config_with(CONFIG, &[drained.url(), kept.url()]);
    config.admin.bearer_token_file = Some(token_file);
    let proxy = start_proxy(config).await;
    let call = |path: &'static str, url: String, token: Option<&'static str>| {
        let mut request = http::Request::post(format!("http://{}{path}", proxy.admin));
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let body = serde_json::json!({ "url": url }).to_string();
        send(request.body(full(body)).unwrap())
    };
    let token = Some("admin-s3cret");
    let state = || async {
        let view = endpoint_view_as(&proxy, &drained.url(), token).await;
        view["state"].as_str().unwrap_or_default().to_owned()
    };

    // A slow request on each node; then the drain.
    let [first, second] = one_slow_request_on_each(&proxy).await;
    assert_eq!(call("/endpoints/drain", drained.url(), None).await.0, 401);
    let unknown = "http://127.0.0.1:1".to_owned();
    assert_eq!(call("/endpoints/drain", unknown, token).await.0, 404);
    assert_eq!(state().await, "healthy", "refused calls change nothing");
    let (status, body) = call("/endpoints/drain", drained.url(), token).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(state().await, "draining");
    for _ in 0..10 {
        assert_eq!(get(&proxy.url("/quick")).await, (200, "kept".into()));
    }
    // The request it holds finishes.
    drained_gate.release(1);
    kept_gate.release(1);
    let mut names = [first.await.unwrap().1, second.await.unwrap().1];
    names.sort_unstable();
    assert_eq!(names, ["drained", "kept"]);

    let (status, body) = call("/endpoints/undrain", drained.url(), token).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(state().await, "healthy");
    let mut reached = 0;
    for _ in 0..20 {
        if get(&proxy.url("/quick")).await.1 == "drained" {
            reached += 1;
        }
    }
    assert!(reached > 0, "no request reached it again");
    proxy.stop().await;
}

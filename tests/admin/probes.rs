//! The admin listener: liveness and readiness probes on their own port.
//!
//! The endpoint behind the proxy, where there is one, is an in-process backend standing in for a GPU node.

use crate::support::*;

#[tokio::test]
async fn probes_answer_on_the_admin_port() {
    let backend = text_backend("ok").await;
    let proxy = start_proxy(config_with("", &[backend.url()])).await;
    let admin = |path: &str| format!("http://{}{}", proxy.admin, path);
    assert_eq!(get(&admin("/healthz")).await, (200, "ok\n".to_owned()));
    assert_eq!(get(&admin("/readyz")).await, (200, "ready\n".to_owned()));
    assert_eq!(get(&admin("/nope")).await.0, 404);
    // The admin port is not a proxy: client paths are not forwarded from it.
    assert_eq!(get(&admin("/v1/chat")).await.0, 404);
    proxy.stop().await;
}

#[tokio::test]
async fn readiness_does_not_depend_on_endpoints() {
    // No endpoint at all: requests wait in the queue for one (scale from zero), then get a clear 503,
    // and the proxy stays ready so they keep reaching it.
    let proxy = start_proxy(config_with("queue: { max_wait: 300ms }\n", &[])).await;
    assert_eq!(get(&format!("http://{}/readyz", proxy.admin)).await.0, 200);
    let (status, body) = get(&proxy.url("/v1/chat")).await;
    assert_eq!(status, 503);
    assert!(body.contains("no endpoint"), "{body}");
    assert!(body.contains(r#""reason":"no-endpoints""#), "{body}");
    proxy.stop().await;
}

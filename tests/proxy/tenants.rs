//! Tenants: inbound API keys name the tenant a request comes from (`auth.keys_file`); a request without
//! a valid key is answered 401 and reaches no node; the key never goes past tongs; waiting requests
//! leave the queue tenant by tenant, weighted; a tenant's fixed priority overrides the header; and a
//! tenant at its own caps is refused with 429 and a computed `Retry-After`, while others are not.
//!
//! Endpoints are scripted in-process backends over loopback sockets.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Request;
use serde_json::Value;

use crate::backpressure::{gated, queued};
use crate::support::*;

const KEY_A: &str = "sk-team-a-0123456789abcdef";
const KEY_B: &str = "sk-team-b-0123456789abcdef";
const KEY_LOW: &str = "sk-batch-0123456789abcdef0";

/// What an answer carried.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: http::HeaderMap,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|_| panic!("JSON: {}", self.body))
    }
}

/// POSTs a chat completion with `key` (if any) and `headers`.
async fn ask(proxy: &TestProxy, key: Option<&str>, headers: &[(&str, &str)]) -> Answer {
    let mut request =
        Request::post(proxy.url("/v1/chat/completions")).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (head, body) = exchange(request.body(full("{}")).unwrap()).await;
    Answer {
        status: head.status.as_u16(),
        headers: head.headers,
        body,
    }
}

/// A keys file for team-a, team-b and batch, in `dir`.
fn keys_file(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.0.join("keys.yaml");
    std::fs::write(
        &path,
        format!("team-a: [\"{KEY_A}\"]\nteam-b: [\"{KEY_B}\"]\nbatch: [\"{KEY_LOW}\"]\n"),
    )
    .unwrap();
    path
}

async fn arrived(arrivals: &Arc<Mutex<Vec<String>>>, n: usize) {
    eventually(
        &format!("{n} requests at the node"),
        Duration::from_secs(10),
        || arrivals.lock().unwrap().len() == n,
    )
    .await;
}

#[tokio::test]
async fn a_request_without_a_valid_key_is_refused_and_a_key_never_reaches_a_node() {
    let dir = TempDir::new("tongs-tenants-keys");
    let (node, gate, arrivals) = gated().await;
    gate.release(100);
    let config = config_with(
        &format!("auth: {{ keys_file: {} }}\n", keys_file(&dir).display()),
        &[node.url()],
    );
    let proxy = start_proxy(config).await;

    let missing = ask(&proxy, None, &[]).await;
    assert_eq!(missing.status, 401, "{missing:?}");
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    let error = &missing.json()["error"];
    assert_eq!(error["code"], "invalid_api_key", "OpenAI's shape: {error}");
    assert_eq!(error["type"], "invalid_request_error");
    let unknown = ask(&proxy, Some("sk-not-a-tenant-0123456789"), &[]).await;
    assert_eq!(unknown.status, 401);
    assert!(
        unknown.body.contains("the API key is not valid"),
        "{}",
        unknown.body
    );
    let not_bearer = send(
        Request::get(proxy.url("/"))
            .header("authorization", format!("Basic {KEY_A}"))
            .body(full(""))
            .unwrap(),
    )
    .await;
    assert_eq!(not_bearer.0, 401, "outside /v1/ too: {}", not_bearer.1);
    assert!(arrivals.lock().unwrap().is_empty(), "no node saw them");

    let served = ask(&proxy, Some(KEY_A), &[("x-tag", "a")]).await;
    assert_eq!((served.status, served.body.as_str()), (200, "a"));
    assert_eq!(
        *arrivals.lock().unwrap(),
        ["a"],
        "the node got the request without the key"
    );

    let metrics = get(&format!("http://{}/metrics", proxy.admin)).await.1;
    for series in [
        r#"tongs_auth_failures_total{reason="missing"} 2"#,
        r#"tongs_auth_failures_total{reason="unknown"} 1"#,
        r#"tongs_tenant_requests_total{tenant="team-a",code="2xx"} 1"#,
        r#"tongs_tenant_requests_total{tenant="team-b",code="2xx"} 0"#,
        r#"tongs_tenant_in_flight{tenant="team-a"} 0"#,
        r#"tongs_requests_total{outcome="invalid",code="4xx"} 3"#,
    ] {
        assert!(metrics.contains(series), "{series} in:\n{metrics}");
    }
    assert!(!metrics.contains(KEY_A), "no key in the metrics");
    proxy.stop().await;
}

#[tokio::test]
async fn a_flooding_tenant_waits_behind_its_own_requests() {
    let dir = TempDir::new("tongs-tenants-fair");
    let (node, gate, arrivals) = gated().await;
    let config = config_with(
        &format!(
            "auth: {{ keys_file: {} }}\n\
             concurrency: {{ limit: static, max_outstanding_per_endpoint: 1 }}\n",
            keys_file(&dir).display()
        ),
        &[node.url()],
    );
    let proxy = Arc::new(start_proxy(config).await);
    let send_as = |key: &'static str, tag: String| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move { ask(&proxy, Some(key), &[("x-tag", tag.as_str())]).await })
    };
    let mut answers = vec![send_as(KEY_A, "a0".into())];
    arrived(&arrivals, 1).await;
    // team-a floods the queue, then team-b asks once.
    for i in 1..=4 {
        answers.push(send_as(KEY_A, format!("a{i}")));
        queued(&proxy, i).await;
    }
    answers.push(send_as(KEY_B, "b1".into()));
    queued(&proxy, 5).await;
    gate.release(6);
    for answer in answers {
        assert_eq!(answer.await.unwrap().status, 200);
    }
    assert_eq!(
        *arrivals.lock().unwrap(),
        ["a0", "a1", "b1", "a2", "a3", "a4"],
        "team-b's request went after one of team-a's, not after all of them"
    );
    Arc::try_unwrap(proxy).ok().unwrap().stop().await;
}

#[tokio::test]
async fn a_tenants_fixed_priority_overrides_the_header() {
    let dir = TempDir::new("tongs-tenants-priority");
    let (node, gate, arrivals) = gated().await;
    let config = config_with(
        &format!(
            "auth:\n  keys_file: {}\n  tenants:\n    batch: {{ priority: low }}\n\
             concurrency: {{ limit: static, max_outstanding_per_endpoint: 1 }}\n",
            keys_file(&dir).display()
        ),
        &[node.url()],
    );
    let proxy = Arc::new(start_proxy(config).await);
    let send_as = |key: &'static str, tag: &'static str| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            ask(&proxy, Some(key), &[("x-tag", tag), ("x-priority", "high")]).await
        })
    };
    let first = send_as(KEY_A, "first");
    arrived(&arrivals, 1).await;
    // batch claims high priority first; team-a's high comes after it and still goes first.
    let batch = send_as(KEY_LOW, "batch");
    queued(&proxy, 1).await;
    let team = send_as(KEY_A, "team");
    queued(&proxy, 2).await;
    gate.release(3);
    for answer in [first, batch, team] {
        assert_eq!(answer.await.unwrap().status, 200);
    }
    assert_eq!(*arrivals.lock().unwrap(), ["first", "team", "batch"]);
    Arc::try_unwrap(proxy).ok().unwrap().stop().await;
}

#[tokio::test]
async fn a_tenant_at_its_caps_gets_429_and_others_are_served() {
    let dir = TempDir::new("tongs-tenants-caps");
    let (node, gate, arrivals) = gated().await;
    let config = config_with(
        &format!(
            "auth:\n  keys_file: {}\n  tenants:\n    team-a: {{ max_in_flight: 2 }}\n    \
             team-b: {{ max_queued: 1 }}\n\
             concurrency: {{ limit: static, max_outstanding_per_endpoint: 2 }}\n",
            keys_file(&dir).display()
        ),
        &[node.url()],
    );
    let proxy = Arc::new(start_proxy(config).await);
    let send_as = |key: &'static str, tag: &'static str| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move { ask(&proxy, Some(key), &[("x-tag", tag)]).await })
    };
    // team-a: two in flight, the third refused before it is read.
    let a = [send_as(KEY_A, "a1"), send_as(KEY_A, "a2")];
    arrived(&arrivals, 2).await;
    let refused = ask(&proxy, Some(KEY_A), &[("x-tag", "a3")]).await;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(
        refused.header("x-tongs-reject-reason"),
        Some("tenant-in-flight")
    );
    let retry_after: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    let json = refused.json();
    assert_eq!(json["error"]["code"], "rate_limit_exceeded", "{json}");
    assert_eq!(json["error"]["type"], "rate_limit_error");
    assert_eq!(json["reason"], "tenant-in-flight");

    // team-b: the node is full, so its first waits and its second is over its queue cap.
    let b1 = send_as(KEY_B, "b1");
    queued(&proxy, 1).await;
    let over = ask(&proxy, Some(KEY_B), &[("x-tag", "b2")]).await;
    assert_eq!(over.status, 429, "{over:?}");
    assert_eq!(
        over.header("x-tongs-reject-reason"),
        Some("tenant-queue-full")
    );
    assert!(over.header("retry-after").is_some());
    // Another tenant still queues.
    let other = send_as(KEY_LOW, "batch");
    queued(&proxy, 2).await;

    gate.release(10);
    for answer in a.into_iter().chain([b1, other]) {
        assert_eq!(answer.await.unwrap().status, 200);
    }
    let metrics = get(&format!("http://{}/metrics", proxy.admin)).await.1;
    for series in [
        r#"tongs_tenant_refusals_total{tenant="team-a",reason="tenant-in-flight"} 1"#,
        r#"tongs_tenant_refusals_total{tenant="team-b",reason="tenant-queue-full"} 1"#,
        r#"tongs_tenant_refusals_total{tenant="batch",reason="tenant-queue-full"} 0"#,
        r#"tongs_tenant_requests_total{tenant="team-a",code="4xx"} 1"#,
        r#"tongs_tenant_requests_total{tenant="team-a",code="2xx"} 2"#,
    ] {
        assert!(metrics.contains(series), "{series} in:\n{metrics}");
    }
    // Counted in flight until each answer ended, queued until each left the queue.
    let admin = proxy.admin;
    eventually_async(
        "every tenant's count back to 0",
        Duration::from_secs(10),
        || async move {
            let metrics = get(&format!("http://{admin}/metrics")).await.1;
            metrics.contains(r#"tongs_tenant_in_flight{tenant="team-a"} 0"#)
                && metrics.contains(r#"tongs_tenant_in_flight{tenant="team-b"} 0"#)
                && metrics.contains(r#"tongs_tenant_queued{tenant="team-b"} 0"#)
        },
    )
    .await;
    Arc::try_unwrap(proxy).ok().unwrap().stop().await;
}

#[tokio::test]
async fn a_reload_reads_the_keys_again() {
    let dir = TempDir::new("tongs-tenants-reload");
    let path = keys_file(&dir);
    let node = text_backend("ok").await;
    let config = config_with(
        &format!("auth: {{ keys_file: {} }}\n", path.display()),
        &[node.url()],
    );
    let app = tongs::App::bind(&config).await.expect("binds");
    let parts = app.parts().clone();
    let addr = app.proxy_addr();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(app.run(shutdown.clone()));
    let proxy = TestProxy {
        addr,
        admin: addr,
        app_registry: parts.registry(),
        app_queue: parts.queue(),
        shutdown,
        task,
    };
    assert_eq!(ask(&proxy, Some(KEY_A), &[]).await.status, 200);
    let rotated = "sk-team-a-rotated-0123456789";
    std::fs::write(&path, format!("team-a: [\"{rotated}\"]\n")).unwrap();
    assert!(parts.apply(&config).is_empty());
    assert_eq!(ask(&proxy, Some(rotated), &[]).await.status, 200);
    assert_eq!(
        ask(&proxy, Some(KEY_A), &[]).await.status,
        401,
        "the old key is gone"
    );
    assert_eq!(
        ask(&proxy, Some(KEY_B), &[]).await.status,
        401,
        "so is team-b"
    );
    // A broken file keeps the keys in force, and says why.
    std::fs::write(&path, "team-a: [\"short\"]\n").unwrap();
    let errors = parts.apply(&config);
    assert_eq!(errors.len(), 1);
    let error = errors[0].to_string();
    assert!(
        error.contains("tenant team-a, key 1: must be 16"),
        "{error}"
    );
    assert!(!error.contains("short\""), "no key in the error: {error}");
    assert_eq!(ask(&proxy, Some(rotated), &[]).await.status, 200);
    proxy.stop().await;
}

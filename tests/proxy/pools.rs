//! Pools: several fleets behind one tongs, a request routed by its OpenAI `model`, its path and
//! headers; fallback between pools; a pool's own model name and key; pools added and removed by a
//! reload; the per-pool demand gauge; the OpenAI edge (`/v1/models`, errors in OpenAI's shape).
//!
//! The nodes are in-process backends on real sockets that record what reached them; the reload goes
//! through `Parts::apply`, the one path a start and every reload take.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use tokio_util::sync::CancellationToken;
use tongs::app::{App, Parts};
use tongs::config::Config;

use crate::support::{
    Backend, Gate, HANG, TempDir, backend, closed_url, eventually, eventually_async, exchange,
    full, get,
};

/// What one request brought to a node.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    body: Bytes,
    authorization: Option<String>,
}

/// A node that answers `{"node": name}` and records every request (heartbeats aside).
struct Node {
    backend: Backend,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Node {
    fn url(&self) -> String {
        self.backend.url()
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// A node whose requests wait for `gate` (none: answer at once) and whose `/health` passes while
/// `healthy` holds.
async fn node_with(name: &'static str, gate: Option<Gate>, healthy: Arc<AtomicBool>) -> Node {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let backend = backend(move |request: Request<hyper::body::Incoming>| {
        let (record, gate, healthy) = (Arc::clone(&record), gate.clone(), Arc::clone(&healthy));
        async move {
            // A node without metrics, as most are: tongs' signals loop asks for them once a minute,
            // and that is no request of the test's.
            if request.uri().path() == "/metrics" {
                let mut response = Response::new(full("no metrics"));
                *response.status_mut() = http::StatusCode::NOT_FOUND;
                return response;
            }
            if request.uri().path() == "/health" {
                let mut response = Response::new(full("ok"));
                if !healthy.load(Ordering::SeqCst) {
                    *response.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                }
                return response;
            }
            let path = request.uri().path().to_owned();
            let authorization = request
                .headers()
                .get(http::header::AUTHORIZATION)
                .map(|v| v.to_str().unwrap_or_default().to_owned());
            let body = request.into_body().collect().await.unwrap().to_bytes();
            record.lock().unwrap().push(Seen {
                path,
                body,
                authorization,
            });
            if let Some(gate) = gate {
                gate.pass().await;
            }
            Response::new(full(format!("{{\"node\":\"{name}\"}}")))
        }
    })
    .await;
    Node { backend, seen }
}

async fn node(name: &'static str) -> Node {
    node_with(name, None, Arc::new(AtomicBool::new(true))).await
}

/// A running tongs with its parts, so a test can apply a new configuration as a reload does.
struct Running {
    addr: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    parts: Parts,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(HANG, self.task).await;
    }

    /// The value of `series` (name and labels as printed) on `/metrics`.
    async fn metric(&self, series: &str) -> Option<f64> {
        let (_, text) = get(&format!("http://{}/metrics", self.admin)).await;
        text.lines().find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
    }
}

fn config(yaml: &str) -> Config {
    let text = format!("listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\n{yaml}");
    Config::parse(&text, "test").unwrap_or_else(|err| panic!("test config invalid: {err}\n{text}"))
}

async fn start(config: &Config) -> Running {
    let app = App::bind(config).await.expect("tongs binds");
    let (addr, admin, parts) = (app.proxy_addr(), app.admin_addr(), app.parts().clone());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(app.run(shutdown.clone()));
    Running {
        addr,
        admin,
        parts,
        shutdown,
        task,
    }
}

/// POSTs `body` to `path` with `headers`; the status, and the body as JSON (or the text as a JSON
/// string when it is not JSON).
async fn post(
    tongs: &Running,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, serde_json::Value) {
    let mut request = Request::post(tongs.url(path)).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (head, text) = exchange(request.body(full(body.to_owned())).unwrap()).await;
    let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (head.status.as_u16(), json)
}

/// A request (path, headers, body) and the node that should serve it.
type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str, &'a str);

fn served_by(answer: &(u16, serde_json::Value)) -> String {
    assert_eq!(answer.0, 200, "{answer:?}");
    answer.1["node"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn requests_go_to_the_pool_their_model_path_or_headers_name_and_bodies_arrive_unchanged() {
    let (llama, image, tagged, fallback) = (
        node("llama").await,
        node("image").await,
        node("tagged").await,
        node("default").await,
    );
    let yaml = format!(
        "health: {{ enabled: false }}\n\
         discovery: {{ static: [{{ url: \"{}\" }}] }}\n\
         pools:\n\
         - name: llama\n\
         \x20 match: {{ models: [\"llama-3.1-*\", \"llama-70b\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n\
         - name: image\n\
         \x20 match: {{ path_prefixes: [\"/v1/images/\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n\
         - name: tagged\n\
         \x20 match: {{ headers: {{ x-pool: special }}, models: [\"llama-70b\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n",
        fallback.url(),
        llama.url(),
        image.url(),
        tagged.url()
    );
    let tongs = start(&config(&yaml)).await;
    let chat = "/v1/chat/completions";
    // Spacing, key order and an escaped model as a client may send them: the node gets these bytes.
    let odd = "{ \"messages\" : [ {\"role\":\"user\",\"content\":\"hi\"} ],\n  \"model\":\"llama-3.1-\\u0038b\" }";
    let cases: [Case; 7] = [
        (chat, &[], odd, "llama"),
        (chat, &[], r#"{"model":"llama-70b"}"#, "llama"),
        // Every condition of a pool must hold: the header alone is not enough for `tagged`.
        (
            chat,
            &[("x-pool", "special")],
            r#"{"model":"sdxl"}"#,
            "default",
        ),
        (
            "/v1/images/generations",
            &[],
            r#"{"model":"sdxl"}"#,
            "image",
        ),
        (chat, &[], r#"{"model":"mistral-7b"}"#, "default"),
        // No model (not JSON, or no such key): matched on path and headers alone.
        (chat, &[], "not json at all", "default"),
        ("/v1/images/edits", &[], r#"{"prompt":"a cat"}"#, "image"),
    ];
    for (path, headers, body, pool) in cases {
        let answer = post(&tongs, path, headers, body).await;
        assert_eq!(served_by(&answer), pool, "{path} {headers:?} {body}");
    }
    assert_eq!(
        llama.seen()[0].body,
        Bytes::from(odd),
        "the body byte for byte"
    );
    assert_eq!(image.seen().len(), 2);
    assert!(tagged.seen().is_empty());
    assert_eq!(fallback.seen().len(), 3);
    // Each pool's figures carry its name.
    let proxied = |pool: &str| {
        format!("tongs_requests_total{{pool=\"{pool}\",outcome=\"proxied\",code=\"2xx\"}}")
    };
    assert_eq!(tongs.metric(&proxied("llama")).await, Some(2.0));
    assert_eq!(tongs.metric(&proxied("image")).await, Some(2.0));
    assert_eq!(tongs.metric(&proxied("default")).await, Some(3.0));
    tongs.stop().await;
}

#[tokio::test]
async fn without_a_default_pool_an_unknown_model_is_a_404_in_openais_shape_and_v1_models_lists_the_pools()
 {
    let llama = node("llama").await;
    let yaml = format!(
        "health: {{ enabled: false }}\n\
         pools:\n\
         - name: llama\n\
         \x20 match: {{ models: [\"llama-3.1-8b\", \"llama-3.2-*\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n\
         - name: image\n\
         \x20 match: {{ models: [\"sdxl\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n",
        llama.url(),
        closed_url()
    );
    let tongs = start(&config(&yaml)).await;
    let (status, body) = post(&tongs, "/v1/chat/completions", &[], r#"{"model":"gpt-5"}"#).await;
    assert_eq!(status, 404, "{body}");
    let error = &body["error"];
    assert_eq!(error["code"], "model_not_found", "{body}");
    assert_eq!(error["param"], "model", "{body}");
    assert!(
        error["message"].as_str().unwrap().contains("gpt-5"),
        "{body}"
    );
    assert!(body["request_id"].is_string(), "{body}");
    // No pool for a request without a model either.
    let (status, _) = post(&tongs, "/v1/chat/completions", &[], "{}").await;
    assert_eq!(status, 404);
    // A body naming two models is refused: routed on one, its node might read the other.
    let twice = r#"{"model":"llama-3.1-8b","prompt":"x","model":"sdxl"}"#;
    let (status, body) = post(&tongs, "/v1/completions", &[], twice).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("more than once"),
        "{body}"
    );
    assert!(llama.seen().is_empty(), "nothing reached a node");
    assert_eq!(
        tongs
            .metric(r#"tongs_requests_total{outcome="invalid",code="4xx"}"#)
            .await,
        Some(3.0)
    );

    // The models the pools name exactly (a prefix pattern names no model), with their pool.
    let (status, list) = get(&tongs.url("/v1/models")).await;
    assert_eq!(status, 200, "{list}");
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list["object"], "list");
    let ids: Vec<(&str, &str)> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["object"], "model");
            (m["id"].as_str().unwrap(), m["owned_by"].as_str().unwrap())
        })
        .collect();
    assert_eq!(ids, [("llama-3.1-8b", "llama"), ("sdxl", "image")]);
    tongs.stop().await;
}

#[tokio::test]
async fn a_pool_that_can_serve_nobody_hands_on_to_its_fallback_and_gets_requests_back_once_it_recovers()
 {
    let healthy = Arc::new(AtomicBool::new(true));
    let gate = Gate::default();
    let primary = node_with("primary", Some(gate.clone()), Arc::clone(&healthy)).await;
    let backup = node("backup").await;
    let yaml = format!(
        "health: {{ interval: 100ms, fast_interval: 100ms, timeout: 1s, unhealthy_threshold: 1, healthy_threshold: 1 }}\n\
         pools:\n\
         - name: primary\n\
         \x20 match: {{ models: [\"m\"] }}\n\
         \x20 fallback: [backup]\n\
         \x20 concurrency: {{ limit: static, max_outstanding_per_endpoint: 1 }}\n\
         \x20 queue: {{ max_length: 0 }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n\
         - name: backup\n\
         \x20 match: {{ models: [\"never-asked-for\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n",
        primary.url(),
        backup.url()
    );
    let tongs = Arc::new(start(&config(&yaml)).await);
    let body = r#"{"model":"m"}"#;
    let fallbacks = r#"tongs_pool_fallbacks_total{from="primary",to="backup"}"#;
    assert_eq!(tongs.metric(fallbacks).await, Some(0.0), "configured: 0");

    // Its only slot taken and no queue: the next request goes to the backup at once.
    let held = {
        let tongs = Arc::clone(&tongs);
        tokio::spawn(async move { post(&tongs, "/v1/chat/completions", &[], body).await })
    };
    eventually("the first request at the primary", HANG, || {
        primary.seen().len() == 1
    })
    .await;
    let answer = post(&tongs, "/v1/chat/completions", &[], body).await;
    assert_eq!(served_by(&answer), "backup");
    gate.release(1);
    assert_eq!(served_by(&held.await.unwrap()), "primary");

    // Its node down (heartbeats fail): the backup serves, without a failed attempt on the way.
    healthy.store(false, Ordering::SeqCst);
    eventually_async("the primary's node down", HANG, || async {
        tongs
            .metric(r#"tongs_endpoints{pool="primary",source="static",state="unhealthy"}"#)
            .await
            == Some(1.0)
    })
    .await;
    let before = primary.seen().len();
    for _ in 0..3 {
        let answer = post(&tongs, "/v1/chat/completions", &[], body).await;
        assert_eq!(served_by(&answer), "backup");
    }
    assert_eq!(
        primary.seen().len(),
        before,
        "nothing sent to the down node"
    );
    assert_eq!(tongs.metric(fallbacks).await, Some(4.0));

    // Back up: the primary serves its model again.
    healthy.store(true, Ordering::SeqCst);
    gate.release(100);
    eventually_async("the primary serving again", HANG, || async {
        served_by(&post(&tongs, "/v1/chat/completions", &[], body).await) == "primary"
    })
    .await;
    match Arc::try_unwrap(tongs) {
        Ok(tongs) => tongs.stop().await,
        Err(_) => panic!("the proxy is still shared"),
    }
}

#[tokio::test]
async fn an_empty_pool_holds_requests_for_its_first_node_and_its_demand_says_so() {
    let late = node("late").await;
    let backup = node("backup").await;
    let pools = |endpoints: &str| {
        config(&format!(
            "health: {{ enabled: false }}\n\
             pools:\n\
             - name: cold\n\
             \x20 match: {{ models: [\"cold\"] }}\n\
             \x20 queue: {{ max_wait_no_endpoints: 20s }}\n\
             \x20 discovery: {{ static: [{endpoints}] }}\n\
             - name: empty\n\
             \x20 match: {{ models: [\"empty\"] }}\n\
             \x20 fallback: [backup]\n\
             \x20 queue: {{ max_wait_no_endpoints: 0s }}\n\
             - name: backup\n\
             \x20 match: {{ models: [\"backup\"] }}\n\
             \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n",
            backup.url()
        ))
    };
    let tongs = Arc::new(start(&pools("")).await);
    // No wait allowed for the empty pool: straight to its fallback.
    let answer = post(&tongs, "/v1/completions", &[], r#"{"model":"empty"}"#).await;
    assert_eq!(served_by(&answer), "backup");

    // The cold pool holds its request, and KEDA sees the demand on that pool alone.
    let waiting = {
        let tongs = Arc::clone(&tongs);
        tokio::spawn(
            async move { post(&tongs, "/v1/completions", &[], r#"{"model":"cold"}"#).await },
        )
    };
    eventually_async("the cold pool's demand", HANG, || async {
        tongs.metric(r#"tongs_demand{pool="cold"}"#).await == Some(1.0)
    })
    .await;
    assert_eq!(
        tongs.metric(r#"tongs_demand{pool="backup"}"#).await,
        Some(0.0)
    );
    let (status, demand) = get(&format!("http://{}/demand", tongs.admin)).await;
    assert_eq!(status, 200);
    let demand: serde_json::Value = serde_json::from_str(&demand).unwrap();
    assert_eq!(demand["pools"]["cold"]["queued"], 1, "{demand}");
    assert_eq!(demand["queued"], 1, "{demand}");

    // Its first node arrives (a reload here; pod discovery in a cluster): the request is served.
    let endpoint = format!("{{ url: \"{}\" }}", late.url());
    assert!(tongs.parts.apply(&pools(&endpoint)).is_empty());
    assert_eq!(served_by(&waiting.await.unwrap()), "late");
    match Arc::try_unwrap(tongs) {
        Ok(tongs) => tongs.stop().await,
        Err(_) => panic!("the proxy is still shared"),
    }
}

#[tokio::test]
async fn a_pool_sends_its_own_model_name_and_key_to_its_endpoints_only() {
    let dir = TempDir::new("pool-key");
    let key_file = dir.0.join("key");
    std::fs::write(&key_file, "sk-hosted\n").unwrap();
    let local = node("local").await;
    let hosted = node("hosted").await;
    let yaml = format!(
        "health: {{ enabled: false }}\n\
         pools:\n\
         - name: local\n\
         \x20 match: {{ models: [\"llama\"] }}\n\
         \x20 fallback: [hosted]\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n\
         - name: hosted\n\
         \x20 match: {{ models: [\"hosted-only\"] }}\n\
         \x20 rewrite_model: meta-llama/Llama-3.1-8B-Instruct\n\
         \x20 api_key_file: {}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n",
        local.url(),
        key_file.display(),
        hosted.url()
    );
    let tongs = start(&config(&yaml)).await;
    let client_key = [("authorization", "Bearer client-key")];
    let body = r#"{"model":"llama","prompt":"hi","max_tokens":3}"#;
    let answer = post(&tongs, "/v1/completions", &client_key, body).await;
    assert_eq!(served_by(&answer), "local");
    let seen = &local.seen()[0];
    assert_eq!(
        seen.body,
        Bytes::from(body),
        "the local pool gets the request as sent"
    );
    assert_eq!(seen.authorization.as_deref(), Some("Bearer client-key"));

    // The local pool empties (its endpoint leaves): the hosted pool gets the request, named its way,
    // with its key and not the client's; every other byte as sent.
    let without_local = yaml.replace(&format!("{{ url: \"{}\" }}", local.url()), "");
    let mut emptied = config(&without_local);
    emptied.pools[0].queue = Some(serde_json::json!({"max_wait_no_endpoints": "0s"}));
    assert!(tongs.parts.apply(&emptied).is_empty());
    let answer = post(&tongs, "/v1/completions", &client_key, body).await;
    assert_eq!(served_by(&answer), "hosted");
    let seen = &hosted.seen()[0];
    assert_eq!(
        seen.body,
        Bytes::from(r#"{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"hi","max_tokens":3}"#)
    );
    assert_eq!(seen.authorization.as_deref(), Some("Bearer sk-hosted"));
    assert_eq!(seen.path, "/v1/completions");
    tongs.stop().await;
}

#[tokio::test]
async fn a_reload_adds_and_removes_pools_while_requests_run() {
    let gate = Gate::default();
    let old = node_with("old", Some(gate.clone()), Arc::new(AtomicBool::new(true))).await;
    let new = node("new").await;
    let one = |name: &str, model: &str, url: &str| {
        format!(
            "- name: {name}\n\
             \x20 match: {{ models: [\"{model}\"] }}\n\
             \x20 discovery: {{ static: [{{ url: \"{url}\" }}] }}\n"
        )
    };
    let before = config(&format!(
        "health: {{ enabled: false }}\npools:\n{}",
        one("old", "old-model", &old.url())
    ));
    let after = config(&format!(
        "health: {{ enabled: false }}\npools:\n{}",
        one("new", "new-model", &new.url())
    ));
    let tongs = Arc::new(start(&before).await);
    let running = {
        let tongs = Arc::clone(&tongs);
        tokio::spawn(async move {
            post(&tongs, "/v1/completions", &[], r#"{"model":"old-model"}"#).await
        })
    };
    eventually("the request at the old pool's node", HANG, || {
        old.seen().len() == 1
    })
    .await;
    assert!(tongs.parts.apply(&after).is_empty());
    // The new pool serves at once; the old one's model has nowhere to go now.
    let answer = post(&tongs, "/v1/completions", &[], r#"{"model":"new-model"}"#).await;
    assert_eq!(served_by(&answer), "new");
    let (status, _) = post(&tongs, "/v1/completions", &[], r#"{"model":"old-model"}"#).await;
    assert_eq!(status, 404);
    // The request under way on the removed pool finishes.
    gate.release(1);
    let answer = tokio::time::timeout(HANG, running).await.unwrap().unwrap();
    assert_eq!(served_by(&answer), "old");
    let (_, text) = get(&format!("http://{}/metrics", tongs.admin)).await;
    assert!(text.contains(r#"tongs_demand{pool="new"} 0"#), "{text}");
    assert!(
        !text.contains(r#"pool="old""#),
        "the removed pool's series are gone:\n{text}"
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    match Arc::try_unwrap(tongs) {
        Ok(tongs) => tongs.stop().await,
        Err(_) => panic!("the proxy is still shared"),
    }
}

/// A node that says it serves `models` (its own `GET /v1/models`, as vLLM answers it) and passes its
/// heartbeats.
async fn serving(models: &'static [&'static str]) -> Backend {
    backend(move |request: Request<hyper::body::Incoming>| async move {
        if request.uri().path() == "/v1/models" {
            let data: Vec<_> = models
                .iter()
                .map(|id| serde_json::json!({"id": id, "object": "model", "owned_by": "vllm"}))
                .collect();
            return Response::new(full(
                serde_json::json!({"object": "list", "data": data}).to_string(),
            ));
        }
        Response::new(full("ok"))
    })
    .await
}

/// `/v1/models` lists what the pools' nodes say they serve, where a request naming the model would be
/// routed to that pool: a pool matched by `beta-*` lists its nodes' `beta-1` and `beta-2`, once each
/// though two nodes serve `beta-1`; what no pool would route (`other`) is not listed.
#[tokio::test]
async fn v1_models_lists_what_the_pools_nodes_serve_under_their_patterns_each_once() {
    let (one, two, alpha) = (
        serving(&["beta-1", "other"]).await,
        serving(&["beta-1", "beta-2"]).await,
        serving(&["alpha"]).await,
    );
    let yaml = format!(
        "health: {{ interval: 100ms, models_interval: 100ms }}\n\
         pools:\n\
         - name: alpha\n\
         \x20 match: {{ models: [\"alpha\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n\
         - name: beta\n\
         \x20 match: {{ models: [\"beta-*\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}, {{ url: \"{}\" }}] }}\n",
        alpha.url(),
        one.url(),
        two.url(),
    );
    let tongs = start(&config(&yaml)).await;
    let listed = || async {
        let (status, list) = get(&tongs.url("/v1/models")).await;
        assert_eq!(status, 200, "{list}");
        let list: serde_json::Value = serde_json::from_str(&list).unwrap();
        let mut ids: Vec<(String, String)> = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let field = |key: &str| m[key].as_str().unwrap().to_owned();
                (field("id"), field("owned_by"))
            })
            .collect();
        ids.sort();
        ids
    };
    let want = |ids: &[(&str, &str)]| -> Vec<(String, String)> {
        ids.iter()
            .map(|(id, pool)| ((*id).to_owned(), (*pool).to_owned()))
            .collect()
    };
    let expected = want(&[("alpha", "alpha"), ("beta-1", "beta"), ("beta-2", "beta")]);
    eventually_async("the nodes' models are read and listed", HANG, || {
        let (listed, expected) = (listed, expected.clone());
        async move { listed().await == expected }
    })
    .await;
    tongs.stop().await;
}

//! What operators read: `/metrics` (every name in the catalog, bounded cardinality as endpoints come
//! and go) and `/debug/endpoints`, from a proxy serving real requests over loopback.
//!
//! The endpoints are in-process backends standing in for GPU nodes.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http::Response;
use http_body_util::{BodyExt, StreamBody};
use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::config::{Config, EndpointUrl};
use tongs::metrics::{CATALOG, RUNTIME_TASKS};
use tongs::registry::EndpointSpec;

fn specs(urls: &[String]) -> Vec<EndpointSpec> {
    urls.iter()
        .map(|url| EndpointSpec {
            url: url.clone(),
            parsed: EndpointUrl::parse(url).unwrap(),
            weight: 1,
            origin: Default::default(),
        })
        .collect()
}

/// The value of the sample whose name-and-labels text is exactly `series`.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
}

#[tokio::test]
async fn metrics_count_requests_by_outcome_and_show_each_endpoint() {
    let ok = text_backend("ok").await;
    let config = "health: { interval: 200ms }\n\
                  concurrency: { limit: static, max_outstanding_per_endpoint: 3 }\n\
                  queue: { max_wait: 200ms }\n";
    let proxy = start_proxy(config_with(config, &[ok.url()])).await;
    for _ in 0..3 {
        assert_eq!(get(&proxy.url("/v1/models")).await.0, 200);
    }
    // A malformed deadline is the client's mistake: counted as invalid.
    let bad = http::Request::get(proxy.url("/v1/models"))
        .header("x-tongs-timeout-ms", "soon")
        .body(full(""))
        .unwrap();
    assert_eq!(send(bad).await.0, 400);
    let metrics_url = format!("http://{}/metrics", proxy.admin);
    eventually("a heartbeat", Duration::from_secs(5), || {
        proxy.app_registry.snapshot()[0].heartbeat().get().is_some()
    })
    .await;
    let (status, text) = get(&metrics_url).await;
    assert_eq!(status, 200);

    let endpoint = ok.url();
    for (series, expected) in [
        (
            r#"tongs_requests_total{pool="default",outcome="proxied",code="2xx"}"#.to_owned(),
            3.0,
        ),
        (
            r#"tongs_requests_total{outcome="invalid",code="4xx"}"#.to_owned(),
            1.0,
        ),
        (
            r#"tongs_request_duration_seconds_count{pool="default",outcome="proxied"}"#.to_owned(),
            3.0,
        ),
        (
            r#"tongs_time_to_first_byte_seconds_count{pool="default"}"#.to_owned(),
            3.0,
        ),
        (
            format!(r#"tongs_endpoint_requests_total{{pool="default",endpoint="{endpoint}"}}"#),
            3.0,
        ),
        (
            format!(r#"tongs_endpoint_limit{{pool="default",endpoint="{endpoint}"}}"#),
            3.0,
        ),
        (
            format!(
                r#"tongs_endpoint_state{{pool="default",endpoint="{endpoint}",state="healthy"}}"#
            ),
            1.0,
        ),
        (
            format!(
                r#"tongs_endpoint_state{{pool="default",endpoint="{endpoint}",state="ejected"}}"#
            ),
            0.0,
        ),
        (
            format!(r#"tongs_endpoint_heartbeat_ok{{pool="default",endpoint="{endpoint}"}}"#),
            1.0,
        ),
        (
            r#"tongs_endpoints{pool="default",source="static",state="healthy"}"#.to_owned(),
            1.0,
        ),
        (r#"tongs_demand{pool="default"}"#.to_owned(), 0.0),
        (r#"tongs_capacity{pool="default"}"#.to_owned(), 3.0),
        (
            r#"tongs_rejections_total{pool="default",reason="queue-full"}"#.to_owned(),
            0.0,
        ),
        (
            r#"tongs_retries_total{pool="default",reason="reset"}"#.to_owned(),
            0.0,
        ),
    ] {
        assert_eq!(value(&text, &series), Some(expected), "{series}\n{text}");
    }
    // Every metric of the catalog is on the page, with its HELP and TYPE once.
    for spec in CATALOG {
        let help = format!("# HELP {} ", spec.name);
        assert_eq!(
            text.matches(&help).count(),
            1,
            "{} described once\n{text}",
            spec.name
        );
        let kind = format!("# TYPE {} {}", spec.name, spec.kind);
        assert!(text.contains(&kind), "{kind}\n{text}");
    }
    assert!(text.contains(r#"tongs_build_info{version=""#));
    proxy.stop().await;
}

#[tokio::test]
async fn endpoint_series_leave_with_their_endpoints() {
    let ok = text_backend("ok").await;
    let proxy = start_proxy(config_with("", &[ok.url()])).await;
    let metrics_url = format!("http://{}/metrics", proxy.admin);
    // 50 generations of 4 endpoints each pass through the set (closed ports: nothing is sent to them).
    for generation in 0..50u16 {
        let urls: Vec<String> = (0..4)
            .map(|i| format!("http://127.0.0.1:{}", 20_000 + generation * 4 + i))
            .collect();
        proxy.app_registry.replace(specs(&urls));
    }
    let (_, text) = get(&metrics_url).await;
    let series = text
        .lines()
        .filter(|line| !line.starts_with('#') && line.contains("endpoint=\""))
        .count();
    let endpoints: std::collections::HashSet<&str> = text
        .lines()
        .filter_map(|line| line.split("endpoint=\"").nth(1)?.split('"').next())
        .collect();
    println!(
        "{series} per-endpoint series for {} endpoints",
        endpoints.len()
    );
    assert_eq!(
        endpoints.len(),
        4,
        "only the current generation: {endpoints:?}"
    );
    assert!(
        endpoints.contains("http://127.0.0.1:20199"),
        "{endpoints:?}"
    );
    assert!(!endpoints.contains(ok.url().as_str()));
    proxy.stop().await;
}

#[tokio::test]
async fn debug_endpoints_shows_state_limit_and_heartbeats() {
    let ok = text_backend("ok").await;
    let refused = closed_url();
    let config = "health: { interval: 200ms, fast_interval: 50ms }\n\
                  concurrency: { limit: adaptive }\n";
    let proxy = start_proxy(config_with(config, &[ok.url(), refused.clone()])).await;
    let url = format!("http://{}/debug/endpoints", proxy.admin);
    eventually(
        "the closed port seen unhealthy",
        Duration::from_secs(5),
        || {
            let snapshot = proxy.app_registry.snapshot();
            snapshot.iter().any(|e| !e.liveness().is_healthy())
        },
    )
    .await;
    let (status, body) = get(&url).await;
    assert_eq!(status, 200);
    let last: serde_json::Value = serde_json::from_str(&body).unwrap();
    let endpoints = last["endpoints"].as_array().expect("an endpoints array");
    let find = |u: &str| {
        endpoints
            .iter()
            .find(|e| e["url"] == u)
            .unwrap_or_else(|| panic!("{u} in {last}"))
    };
    let good = find(&ok.url());
    assert_eq!(good["source"], "static");
    assert_eq!(good["breaker"], "closed");
    assert_eq!(good["last_heartbeat_ok"], true);
    assert!(good["limit"].as_u64().is_some(), "{good}");
    let bad = find(&refused);
    assert_eq!(bad["state"], "unhealthy", "{bad}");
    assert_eq!(bad["last_heartbeat_ok"], false);
    assert_eq!(last["balancer"]["policy"], "expected-latency");
    assert_eq!(last["demand"]["endpoints"], 2);
    proxy.stop().await;
}

#[test]
fn docs_list_every_metric() {
    let table =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md")).unwrap();
    let missing: Vec<_> = CATALOG
        .iter()
        .map(|spec| spec.name)
        .filter(|name| !table.contains(&format!("| `{name}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/metrics.md's table lacks {missing:?}"
    );
}

#[tokio::test]
async fn a_bearer_token_guards_the_admin_port_but_not_the_probes() {
    let dir = std::env::temp_dir().join(format!("tongs-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, "s3cret\n").unwrap();
    let mut config = config_with("", &[]);
    config.admin.bearer_token_file = Some(token_file.clone());
    assert!(config.validate().is_empty());
    let proxy = start_proxy(config).await;
    let admin = |path: &str, token: Option<&str>| {
        let mut request = http::Request::get(format!("http://{}{path}", proxy.admin));
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        send(request.body(full("")).unwrap())
    };
    assert_eq!(admin("/healthz", None).await.0, 200);
    assert_eq!(admin("/readyz", None).await.0, 200);
    assert_eq!(
        admin("/", None).await.0,
        200,
        "the page itself holds no data"
    );
    for path in ["/metrics", "/debug/endpoints", "/demand"] {
        let (status, body) = admin(path, None).await;
        assert_eq!(status, 401, "{path}: {body}");
        assert!(body.contains("Bearer"), "{body}");
        assert_eq!(admin(path, Some("wrong")).await.0, 401, "{path}");
        assert_eq!(admin(path, Some("s3cret")).await.0, 200, "{path}");
    }
    proxy.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn metrics_are_gzipped_for_a_scraper_that_asks() {
    use std::io::Read as _;
    let proxy = start_proxy(config_with("", &[])).await;
    let scrape = |encoding: Option<&'static str>| {
        let mut request = http::Request::get(format!("http://{}/metrics", proxy.admin));
        if let Some(encoding) = encoding {
            request = request.header("accept-encoding", encoding);
        }
        exchange(request.body(full("")).unwrap())
    };
    let (plain_head, plain) = scrape(None).await;
    assert_eq!(plain_head.headers.get("content-encoding"), None);
    assert!(plain.starts_with("# HELP"), "{plain}");
    // Prometheus asks for gzip; the page is the same text, compressed.
    let request = http::Request::get(format!("http://{}/metrics", proxy.admin))
        .header("accept-encoding", "gzip")
        .body(full(""))
        .unwrap();
    let response = client().request(request).await.expect("scrape");
    assert_eq!(
        response
            .headers()
            .get("content-encoding")
            .map(|v| v.to_str().unwrap()),
        Some("gzip")
    );
    let compressed = http_body_util::BodyExt::collect(response.into_body())
        .await
        .expect("body")
        .to_bytes();
    let mut text = String::new();
    flate2::read::GzDecoder::new(&compressed[..])
        .read_to_string(&mut text)
        .expect("valid gzip");
    assert!(
        compressed.len() < text.len() / 3,
        "{} of {}",
        compressed.len(),
        text.len()
    );
    let families = |page: &str| -> Vec<String> {
        page.lines()
            .filter(|l| l.starts_with("# TYPE"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(families(&text), families(&plain), "the same families");
    let (identity, _) = scrape(Some("identity")).await;
    assert_eq!(identity.headers.get("content-encoding"), None);
    proxy.stop().await;
}

/// A proxy on a runtime of its own, in its own thread, as `tongs run` has one: so the runtime gauge
/// counts tongs' tasks and not this test's clients and backends.
struct OwnRuntimeProxy {
    addr: SocketAddr,
    admin: SocketAddr,
    shutdown: CancellationToken,
    thread: std::thread::JoinHandle<()>,
    /// Every scrape goes over this client's one kept-alive connection, so scrapes add one task, always
    /// the same, rather than one per scrape that lingers while it closes.
    scraper: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        TestBody,
    >,
}

impl OwnRuntimeProxy {
    async fn start(config: Config) -> OwnRuntimeProxy {
        let (bound, addrs) = tokio::sync::oneshot::channel();
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let app = App::bind(&config).await.expect("proxy binds");
                let _ = bound.send((app.proxy_addr(), app.admin_addr()));
                app.run(stop).await;
            });
        });
        let (addr, admin) = addrs.await.expect("the proxy thread started");
        OwnRuntimeProxy {
            addr,
            admin,
            shutdown,
            thread,
            scraper: client(),
        }
    }

    async fn tasks(&self) -> f64 {
        let url = format!("http://{}/metrics", self.admin);
        let response = tokio::time::timeout(HANG, self.scraper.get(url.parse().unwrap()))
            .await
            .expect("a scrape within HANG")
            .expect("a scrape");
        assert_eq!(response.status(), 200);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&body);
        value(&text, RUNTIME_TASKS.name).unwrap_or_else(|| panic!("no gauge in\n{text}"))
    }

    /// The gauge once it has read the same three times in a row, 100 ms apart (`run` spawns its
    /// background tasks while the admin port already answers).
    async fn settled_tasks(&self) -> f64 {
        let mut last = self.tasks().await;
        let mut same = 1;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = self.tasks().await;
            same = if now == last { same + 1 } else { 1 };
            last = now;
            if same == 3 {
                break;
            }
        }
        last
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join())
            .await
            .unwrap()
            .expect("the proxy thread ends cleanly");
    }
}

#[tokio::test]
async fn runtime_tasks_rise_with_open_streams_and_fall_back() {
    // Each stream sends one event, then stays open until the client goes away.
    let backend = backend(|_request| async {
        let first = futures::stream::once(async {
            Ok::<_, BoxError>(http_body::Frame::data(Bytes::from_static(b"data: 1\n\n")))
        });
        let body = StreamBody::new(futures::StreamExt::chain(first, futures::stream::pending()));
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(BodyExt::boxed(body))
            .unwrap()
    })
    .await;
    let config = config_with("workers: 2\n", &[backend.url()]);
    let proxy = OwnRuntimeProxy::start(config).await;
    let idle = proxy.settled_tasks().await;
    // The admin port's accept loop, discovery, and the connection of the scrape itself at least.
    assert!(idle >= 3.0, "tasks while idle: {idle}");

    const STREAMS: usize = 16;
    let mut open = Vec::new();
    for _ in 0..STREAMS {
        let client = client();
        let response = client
            .get(
                format!("http://{}/v1/completions", proxy.addr)
                    .parse()
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        tokio::time::timeout(HANG, body.frame())
            .await
            .expect("the first event arrives")
            .expect("a frame")
            .expect("data");
        open.push((client, body));
    }
    let busy = proxy.tasks().await;
    // Per stream, at least the client connection's task in a worker (and the endpoint connection's).
    assert!(
        busy >= idle + STREAMS as f64,
        "{STREAMS} streams open: {busy} tasks, idle {idle}"
    );

    // Clients leaving cancel their streams: both connections of each close, and their tasks end.
    drop(open);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut now = proxy.tasks().await;
    while now > idle {
        assert!(
            tokio::time::Instant::now() < deadline,
            "tasks still {now} (idle {idle}, busy {busy}) 10 s after the streams closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        now = proxy.tasks().await;
    }
    println!("tasks: idle {idle}, {STREAMS} streams open {busy}, after they closed {now}");
    proxy.stop().await;
}

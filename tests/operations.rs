//! What operators read: `/metrics` (every name in the catalog, bounded cardinality as endpoints come
//! and go) and `/debug/endpoints`, from a proxy serving real requests over loopback.

mod support;

use std::time::Duration;

use support::*;
use tongs::config::EndpointUrl;
use tongs::metrics::CATALOG;
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
        proxy.app_registry.snapshot()[0].last_heartbeat().is_some()
    })
    .await;
    let (status, text) = get(&metrics_url).await;
    assert_eq!(status, 200);

    let endpoint = ok.url();
    for (series, expected) in [
        (
            r#"tongs_requests_total{outcome="proxied",code="2xx"}"#.to_owned(),
            3.0,
        ),
        (
            r#"tongs_requests_total{outcome="invalid",code="4xx"}"#.to_owned(),
            1.0,
        ),
        (
            r#"tongs_request_duration_seconds_count{outcome="proxied"}"#.to_owned(),
            3.0,
        ),
        ("tongs_time_to_first_byte_seconds_count".to_owned(), 3.0),
        (
            format!(r#"tongs_endpoint_requests_total{{endpoint="{endpoint}"}}"#),
            3.0,
        ),
        (
            format!(r#"tongs_endpoint_limit{{endpoint="{endpoint}"}}"#),
            3.0,
        ),
        (
            format!(r#"tongs_endpoint_state{{endpoint="{endpoint}",state="healthy"}}"#),
            1.0,
        ),
        (
            format!(r#"tongs_endpoint_state{{endpoint="{endpoint}",state="ejected"}}"#),
            0.0,
        ),
        (
            format!(r#"tongs_endpoint_heartbeat_ok{{endpoint="{endpoint}"}}"#),
            1.0,
        ),
        (
            r#"tongs_endpoints{source="static",state="healthy"}"#.to_owned(),
            1.0,
        ),
        ("tongs_demand".to_owned(), 0.0),
        ("tongs_capacity".to_owned(), 3.0),
        (
            r#"tongs_rejections_total{reason="queue-full"}"#.to_owned(),
            0.0,
        ),
        (r#"tongs_retries_total{reason="reset"}"#.to_owned(), 0.0),
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
    let refused = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let config = "health: { interval: 200ms, fast_interval: 50ms }\n\
                  concurrency: { limit: adaptive }\n";
    let proxy = start_proxy(config_with(config, &[ok.url(), refused.clone()])).await;
    let url = format!("http://{}/debug/endpoints", proxy.admin);
    eventually(
        "the closed port seen unhealthy",
        Duration::from_secs(5),
        || {
            let snapshot = proxy.app_registry.snapshot();
            snapshot.iter().any(|e| !e.is_healthy())
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
fn readme_lists_every_metric() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let missing: Vec<_> = CATALOG
        .iter()
        .map(|spec| spec.name)
        .filter(|name| !readme.contains(&format!("| `{name}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "README's metrics table lacks {missing:?}"
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

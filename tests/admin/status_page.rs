//! The admin status page (`/`, `src/admin/status.html`) rendered by a real headless Chromium.
//!
//! Real: Debian's `chromium` binary loading the page from tongs' admin port over loopback, running its
//! JavaScript, polling `/debug/endpoints` and laying the page out; tongs itself with real heartbeats
//! against a real backend and a closed port. Not real: the backend is a small in-process HTTP server, and
//! Chromium's virtual time budget stands in for a person watching the page for a few seconds.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::*;

/// Longest one Chromium run may take before it is killed and the test fails.
const CHROMIUM_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs headless Chromium on `url` with `action` (e.g. `--dump-dom`) and returns its stdout. A failed run
/// fails the test with Chromium's stderr; one longer than [`CHROMIUM_TIMEOUT`] is killed and fails it.
async fn chromium(binary: &Path, profile: &Path, url: &str, action: &[&str]) -> String {
    let started = Instant::now();
    let mut command = tokio::process::Command::new(binary);
    command
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(action)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = command.spawn().expect("chromium starts");
    let output = tokio::time::timeout(CHROMIUM_TIMEOUT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("chromium {action:?} still running after {CHROMIUM_TIMEOUT:?}"))
        .expect("chromium runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "chromium {action:?} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    println!("chromium {action:?}: {:?}", started.elapsed());
    stdout
}

/// The attributes of every `<tag ...>` start tag in serialized HTML (values unescaped for `&amp;` and
/// `&quot;`, which is all Chromium's serializer escapes in attributes besides `&nbsp;`).
fn start_tags(html: &str, tag: &str) -> Vec<HashMap<String, String>> {
    let open = format!("<{tag}");
    let mut tags = Vec::new();
    let mut rest = html;
    while let Some(at) = rest.find(&open) {
        rest = &rest[at + open.len()..];
        if !rest.starts_with([' ', '>', '/']) {
            continue;
        }
        let end = rest.find('>').unwrap_or(rest.len());
        let mut inside = &rest[..end];
        let mut attributes = HashMap::new();
        loop {
            inside = inside.trim_start();
            let name_end = inside
                .find(|c: char| c == '=' || c.is_whitespace())
                .unwrap_or(inside.len());
            let name = &inside[..name_end];
            if name.is_empty() || name == "/" {
                break;
            }
            inside = &inside[name_end..];
            let value = if let Some(quoted) = inside.strip_prefix("=\"") {
                let close = quoted.find('"').expect("a closing quote");
                inside = &quoted[close + 1..];
                quoted[..close]
                    .replace("&quot;", "\"")
                    .replace("&amp;", "&")
            } else {
                String::new()
            };
            attributes.insert(name.to_owned(), value);
        }
        tags.push(attributes);
    }
    tags
}

/// A proxy with two endpoints, once its heartbeats have seen the first (a real backend) healthy and the
/// second (a closed port) unhealthy.
async fn proxy_with_a_good_and_a_dead_endpoint() -> (TestProxy, Backend, String) {
    let ok = text_backend("ok").await;
    let refused = closed_url();
    let config = "health: { interval: 200ms, fast_interval: 50ms }\n\
                  concurrency: { limit: static, max_outstanding_per_endpoint: 4 }\n";
    let proxy = start_proxy(config_with(config, &[ok.url(), refused.clone()])).await;
    eventually(
        "the closed port seen unhealthy and the backend healthy",
        Duration::from_secs(10),
        || {
            let snapshot = proxy.app_registry.snapshot();
            snapshot.iter().any(|e| !e.liveness().is_healthy())
                && snapshot.iter().any(|e| {
                    e.liveness().is_healthy() && e.heartbeat().get().is_some_and(|(_, _, ok)| ok)
                })
        },
    )
    .await;
    (proxy, ok, refused)
}

/// The `data-endpoint` → `data-state` of every table row in `dom`.
fn rows(dom: &str) -> HashMap<String, String> {
    start_tags(dom, "tr")
        .into_iter()
        .filter_map(|tr| {
            Some((
                tr.get("data-endpoint")?.clone(),
                tr.get("data-state")?.clone(),
            ))
        })
        .collect()
}

/// The attributes of `<body>` and of the error banner, and the banner's text.
fn body_and_banner(dom: &str) -> (HashMap<String, String>, HashMap<String, String>, String) {
    let body = start_tags(dom, "body").swap_remove(0);
    let banner = start_tags(dom, "div")
        .into_iter()
        .find(|tag| tag.get("id").is_some_and(|v| v == "error"))
        .unwrap_or_else(|| panic!("#error in\n{dom}"));
    let at = dom.find("id=\"error\"").expect("#error");
    let text = dom[at..].split_once('>').expect("a start tag").1;
    let text = text.split_once("</div>").expect("an end tag").0.to_owned();
    (body, banner, text)
}

#[tokio::test]
async fn chromium_shows_each_endpoint_with_its_state() {
    let binary = require("chromium");
    let (proxy, ok, refused) = proxy_with_a_good_and_a_dead_endpoint().await;
    for _ in 0..3 {
        assert_eq!(get(&proxy.url("/v1/models")).await.0, 200);
    }

    // The page as served: small, and nothing in it points outside the admin port, nor writes markup.
    let page_url = format!("http://{}/", proxy.admin);
    let (status, page) = get(&page_url).await;
    assert_eq!(status, 200);
    assert!(page.len() < 15 * 1024, "{} bytes", page.len());
    for outside in ["http://", "https://", "src=\"//", "href=\"//", "@import"] {
        assert!(!page.contains(outside), "the page refers to {outside}");
    }
    assert!(!page.contains("innerHTML"), "data must go in as text");

    let dir = TempDir::new("tongs-status-page");
    let dom = chromium(
        &binary,
        &dir.0.join("profile-dom"),
        &page_url,
        &["--dump-dom"],
    )
    .await;

    let expected = HashMap::from([
        (ok.url(), "healthy".to_owned()),
        (refused.clone(), "unhealthy".to_owned()),
    ]);
    assert_eq!(rows(&dom), expected, "one row per endpoint:\n{dom}");
    let (body, banner, _) = body_and_banner(&dom);
    assert!(banner.contains_key("hidden"), "no error banner:\n{dom}");
    assert_eq!(body["data-failures"], "0", "{dom}");
    let polls: u32 = body["data-polls"].parse().expect("a poll count");
    assert!(polls >= 1, "the page polled /debug/endpoints:\n{dom}");
    let totals: HashMap<String, String> = start_tags(&dom, "span")
        .into_iter()
        .filter_map(|s| Some((s.get("data-total")?.clone(), s.get("data-count")?.clone())))
        .collect();
    assert_eq!(
        totals,
        HashMap::from([
            ("healthy".to_owned(), "1".to_owned()),
            ("unhealthy".to_owned(), "1".to_owned()),
        ]),
        "{dom}"
    );
    assert!(
        dom.contains(">expected-latency</b>"),
        "the policy shown:\n{dom}"
    );
    assert!(
        dom.contains("id=\"sources\">static</b>"),
        "the sources shown:\n{dom}"
    );

    let screenshot = dir.0.join("status.png");
    chromium(
        &binary,
        &dir.0.join("profile-screenshot"),
        &page_url,
        &[
            &format!("--screenshot={}", screenshot.display()),
            "--window-size=1200,800",
        ],
    )
    .await;
    let png = std::fs::read(&screenshot).expect("chromium wrote the screenshot");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
    println!("screenshot: {width}x{height}, {} bytes", png.len());
    assert_eq!((width, height), (1200, 800));
    assert!(png.len() > 8 * 1024, "a blank page? {} bytes", png.len());
    proxy.stop().await;
}

/// What the stand-in for an ingress serves under `/admin/`: tongs' page and a copy of its
/// `/debug/endpoints`, failing the polls it is told to.
#[derive(Clone)]
struct Mount {
    page: Arc<str>,
    json: Arc<str>,
    polls: Arc<AtomicUsize>,
    /// Fail the first poll and answer the rest (or the other way round).
    fail_first: Arc<AtomicBool>,
}

impl Mount {
    fn answer(&self, path: &str) -> http::Response<TestBody> {
        let (status, kind, body) = match path {
            "/admin/" => (200, "text/html; charset=utf-8", self.page.to_string()),
            "/admin/debug/endpoints" => {
                let first = self.polls.fetch_add(1, Ordering::SeqCst) == 0;
                if first == self.fail_first.load(Ordering::SeqCst) {
                    (503, "text/plain", "tongs is away\n".to_owned())
                } else {
                    (200, "application/json", self.json.to_string())
                }
            }
            _ => (404, "text/plain", format!("not here: {path}\n")),
        };
        http::Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, kind)
            .body(full(body))
            .unwrap()
    }
}

/// A failed poll shows the error banner over the last data received, and the next good poll clears it;
/// the page works mounted under a path prefix. Real: Chromium, and the page and `/debug/endpoints` JSON
/// as tongs serves them. Not real: the prefix mount and the failures, from an in-process server standing
/// in for an ingress in front of the admin port.
#[tokio::test]
async fn chromium_shows_the_error_banner_while_polls_fail_and_clears_it() {
    let binary = require("chromium");
    let (proxy, ok, refused) = proxy_with_a_good_and_a_dead_endpoint().await;
    let (_, page) = get(&format!("http://{}/", proxy.admin)).await;
    let (_, json) = get(&format!("http://{}/debug/endpoints", proxy.admin)).await;
    let mount = Mount {
        page: page.into(),
        json: json.into(),
        polls: Arc::default(),
        fail_first: Arc::new(AtomicBool::new(true)),
    };
    let server = backend({
        let mount = mount.clone();
        move |request| {
            let response = mount.answer(request.uri().path());
            async move { response }
        }
    })
    .await;
    let url = format!("{}/admin/", server.url());
    let dir = TempDir::new("tongs-status-page-errors");
    let expected = HashMap::from([
        (ok.url(), "healthy".to_owned()),
        (refused, "unhealthy".to_owned()),
    ]);

    // The first poll fails, the next ones succeed: the banner was shown once and is gone.
    let dom = chromium(&binary, &dir.0.join("recovers"), &url, &["--dump-dom"]).await;
    let (body, banner, _) = body_and_banner(&dom);
    assert_eq!(body["data-failures"], "1", "{dom}");
    assert_ne!(body["data-polls"], "0", "{dom}");
    assert!(banner.contains_key("hidden"), "banner cleared:\n{dom}");
    assert!(!body.get("class").is_some_and(|c| c.contains("stale")));
    assert_eq!(rows(&dom), expected, "{dom}");

    // The first poll succeeds, the next ones fail: the banner is up over the last rows received.
    mount.polls.store(0, Ordering::SeqCst);
    mount.fail_first.store(false, Ordering::SeqCst);
    let dom = chromium(&binary, &dir.0.join("fails"), &url, &["--dump-dom"]).await;
    let (body, banner, text) = body_and_banner(&dom);
    assert_eq!(body["data-polls"], "1", "{dom}");
    assert_ne!(body["data-failures"], "0", "{dom}");
    assert!(!banner.contains_key("hidden"), "banner shown:\n{dom}");
    assert!(
        text.contains("unreachable") && text.contains("503"),
        "{text}"
    );
    assert!(body.get("class").is_some_and(|c| c.contains("stale")));
    assert_eq!(rows(&dom), expected, "the last rows stay:\n{dom}");
    proxy.stop().await;
}

/// With several pools, each row names its endpoint's pool and each pool gets a line of its own figures.
#[tokio::test]
async fn chromium_groups_the_endpoints_by_pool() {
    let binary = require("chromium");
    let (llm, image) = (text_backend("llm").await, text_backend("image").await);
    let pools = format!(
        "pools:\n\
         - name: image\n\
         \x20 match: {{ path_prefixes: [\"/v1/images/\"] }}\n\
         \x20 discovery: {{ static: [{{ url: \"{}\" }}] }}\n",
        image.url()
    );
    let proxy = start_proxy(config_with(&pools, &[llm.url()])).await;
    let dir = TempDir::new("tongs-status-pools");
    let page_url = format!("http://{}/", proxy.admin);
    let dom = chromium(&binary, &dir.0.join("profile"), &page_url, &["--dump-dom"]).await;
    let by_pool: HashMap<String, String> = start_tags(&dom, "tr")
        .into_iter()
        .filter_map(|tr| {
            Some((
                tr.get("data-endpoint")?.clone(),
                tr.get("data-pool")?.clone(),
            ))
        })
        .collect();
    assert_eq!(
        by_pool,
        HashMap::from([
            (llm.url(), "default".to_owned()),
            (image.url(), "image".to_owned()),
        ]),
        "{dom}"
    );
    let lines: Vec<String> = start_tags(&dom, "div")
        .into_iter()
        .filter_map(|div| div.get("data-pool").cloned())
        .collect();
    assert_eq!(lines, ["image", "default"], "one line per pool:\n{dom}");
    proxy.stop().await;
}

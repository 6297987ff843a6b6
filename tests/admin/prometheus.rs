//! A real Prometheus scrapes tongs' `/metrics` and answers queries about it.
//!
//! Real: Debian's `prometheus` binary, scraping the admin port of a tongs proxy every second over
//! loopback with its own exposition-format parser, storing the samples in its TSDB, and answering PromQL
//! over its HTTP API; tongs proxying real requests to a backend. Not real: the backend is a small
//! in-process HTTP server, and Prometheus runs from a throwaway directory instead of a cluster.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;
use http_body_util::BodyExt;

/// How long Prometheus gets to start, scrape and answer with the expected values.
const PATIENCE: Duration = Duration::from_secs(60);

/// A Prometheus process, killed (and its directory removed) when this is dropped, so a failing
/// assertion does not leave it running.
struct Prometheus {
    child: Child,
    port: u16,
    /// Declared after `child`: removed once the process is gone.
    dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `target` (host:port) every second, on a free loopback port.
    fn start(binary: &std::path::Path, target: &str) -> Prometheus {
        let dir = TempDir::new("tongs-prometheus");
        let config = dir.0.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: tongs\n    metrics_path: /metrics\n    \
                 static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )
        .expect("prometheus.yml written");
        let port = free_port();
        let log = |name: &str| std::fs::File::create(dir.0.join(name)).expect("log file");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.0.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log("stdout.log"))
            .stderr(log("stderr.log"))
            .spawn()
            .expect("prometheus starts");
        Prometheus { child, port, dir }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("stderr.log")).unwrap_or_default()
    }

    /// GET on Prometheus' HTTP API, as JSON; an error while it is still starting.
    async fn api(&self, path_and_query: &str) -> Result<serde_json::Value, String> {
        let uri = format!("http://127.0.0.1:{}{path_and_query}", self.port);
        let request = http::Request::get(&uri)
            .body(full(""))
            .expect("a valid URI");
        let exchange = async {
            let response = client().request(request).await.map_err(|e| e.to_string())?;
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            serde_json::from_slice(&body)
                .map_err(|e| format!("{e}: {}", String::from_utf8_lossy(&body)))
        };
        tokio::time::timeout(Duration::from_secs(5), exchange)
            .await
            .unwrap_or_else(|_| Err(format!("{uri}: no answer within 5 s")))
    }

    /// The value of the single series `promql` selects now (`None` while there is none).
    async fn value(&self, promql: &str) -> Result<Option<f64>, String> {
        let answer = self
            .api(&format!("/api/v1/query?query={}", encode(promql)))
            .await?;
        if answer["status"] != "success" {
            return Err(format!("{promql}: {answer}"));
        }
        let result = answer["data"]["result"]
            .as_array()
            .ok_or_else(|| format!("{promql}: {answer}"))?;
        match result.as_slice() {
            [] => Ok(None),
            [series] => series["value"][1]
                .as_str()
                .and_then(|v| v.parse().ok())
                .map(Some)
                .ok_or_else(|| format!("{promql}: {answer}")),
            _ => Err(format!("{promql} selects several series: {answer}")),
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters, for a query string.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test]
async fn prometheus_scrapes_request_counts_from_tongs() {
    const REQUESTS: u32 = 5;
    let binary = require("prometheus");
    let ok = text_backend("ok").await;
    let proxy = start_proxy(config_with("", &[ok.url()])).await;
    for _ in 0..REQUESTS {
        assert_eq!(get(&proxy.url("/v1/models")).await.0, 200);
    }

    let started = Instant::now();
    let mut prometheus = Prometheus::start(&binary, &proxy.admin.to_string());
    let queries = [
        (
            r#"tongs_requests_total{outcome="proxied",code="2xx"}"#.to_owned(),
            f64::from(REQUESTS),
        ),
        (r#"up{job="tongs"}"#.to_owned(), 1.0),
        (
            format!(
                r#"tongs_endpoint_requests_total{{endpoint="{}"}}"#,
                ok.url()
            ),
            f64::from(REQUESTS),
        ),
    ];
    let mut last = Vec::new();
    loop {
        last.clear();
        for (promql, _) in &queries {
            last.push(prometheus.value(promql).await);
        }
        let arrived = queries
            .iter()
            .zip(&last)
            .all(|((_, want), got)| got.as_ref().is_ok_and(|v| *v == Some(*want)));
        if arrived {
            break;
        }
        if let Ok(Some(status)) = prometheus.child.try_wait() {
            panic!("prometheus exited ({status}):\n{}", prometheus.stderr());
        }
        if started.elapsed() > PATIENCE {
            let targets = prometheus.api("/api/v1/targets").await;
            panic!(
                "after {PATIENCE:?}, wanted {:?}\ngot {last:?}\ntargets: {targets:?}\n\
                 prometheus stderr:\n{}",
                queries,
                prometheus.stderr()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!(
        "prometheus scraped tongs and answered after {:?}: {last:?}",
        started.elapsed()
    );
    drop(prometheus);
    proxy.stop().await;
}

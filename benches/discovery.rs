//! Pod discovery at scale: how long 5,000 pods take to become endpoints, what they cost in memory,
//! and how soon one watch event reaches the balancer.
//!
//! The Kubernetes API server cannot run here: tongs (the release binary, a process of its own) watches
//! the fake API server of `tests/support/kube_api/`, which speaks the real wire protocol (paginated
//! lists, chunked watch streams) to kube-rs' own client through a kubeconfig. Each pod is a realistic
//! object (labels, annotations, two containers with env and resources, status with conditions), so
//! the list is as heavy on the wire and in kube's deserializer as a real one.
//!
//! Printed, for a baseline of 0 pods and for `PODS` pods (default 5,000), in the same run:
//! - start → `/readyz` 200 (first complete list applied) and the endpoint count then;
//! - RSS (VmRSS) once ready and the peak (VmHWM), and the difference to the baseline;
//! - for `EVENTS` changes (default 200: a pod added, then deleted, alternately), the time from the
//!   change at the API server to `/demand` showing the new endpoint count (p50, p99, max), polled
//!   as fast as the admin port answers.
//!
//! Targets (issue #6): usable in < 1 s, < 50 MiB extra memory, an event visible in < 50 ms.
//!
//!     cargo bench --bench discovery
//!     PODS=10000 EVENTS=500 cargo bench --bench discovery

#[path = "support/mod.rs"]
mod support;
// The tests' support module, for its fake Kubernetes API server (and the accept loop that serves it).
#[path = "../tests/support/mod.rs"]
mod test_support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::stats::percentile;
use test_support::kube_api::FakeKubeApi;

const TONGS: &str = env!("CARGO_BIN_EXE_tongs");
const NAMESPACE: &str = "gpu";

/// A pod as the SaladCloud Virtual Kubelet's pods look to the API server, Running and Ready.
fn pod(index: usize) -> Value {
    let name = format!("llm-{index:05}");
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {
                "app.kubernetes.io/name": "llm",
                "app.kubernetes.io/part-of": "tongs-fleet",
                "pod-template-hash": "7d9f6c8b5",
            },
            "annotations": {
                "salad.com/gpu-classes": "a5e4e2cc-4d2b-4c5a-9b7e-2f0c1e6d8a11,ed563892-aacd-40f5-80b7-90c9be6c759b",
                "salad.com/country-codes": "us,ca",
                "salad.com/container-group-priority": "high",
                "tongs.dev/weight": "1",
            },
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llm-7d9f6c8b5",
                "uid": "0b3c8f5e-3d0a-4f0c-8f1e-5a2b6c7d8e9f", "controller": true,
            }],
        },
        "spec": {
            "nodeName": "saladcloud-node",
            "containers": [
                {
                    "name": "inference",
                    "image": "ghcr.io/example/llm-server:1.4.2",
                    "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                    "env": [
                        {"name": "MODEL", "value": "meta-llama/Llama-3.1-8B-Instruct"},
                        {"name": "MAX_BATCH", "value": "16"},
                        {"name": "PORT", "value": "8000"},
                    ],
                    "resources": {
                        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
                        "limits": {"cpu": "8", "memory": "30Gi", "nvidia.com/gpu": "1"},
                    },
                    "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5},
                },
                {
                    "name": "tailscale",
                    "image": "ghcr.io/tailscale/tailscale:v1.76.1",
                    "env": [{"name": "TS_USERSPACE", "value": "true"}],
                }
            ],
            "tolerations": [{
                "key": "virtual-kubelet.io/provider", "operator": "Equal",
                "value": "saladcloud", "effect": "NoSchedule",
            }],
        },
        "status": {
            "phase": "Running",
            "podIP": format!("10.{}.{}.{}", 1 + index / 65536, (index / 256) % 256, index % 256),
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
                {"type": "PodScheduled", "status": "True"},
            ],
            "containerStatuses": [
                {"name": "inference", "ready": true, "restartCount": 0, "image": "ghcr.io/example/llm-server:1.4.2",
                 "state": {"running": {"startedAt": "2026-12-03T10:00:00Z"}}},
                {"name": "tailscale", "ready": true, "restartCount": 0, "image": "ghcr.io/tailscale/tailscale:v1.76.1",
                 "state": {"running": {"startedAt": "2026-12-03T10:00:00Z"}}},
            ],
        },
    })
}

/// The tongs binary watching `api`, with its admin address once it logged it.
struct Tongs {
    child: Child,
    admin: String,
    started: Instant,
}

impl Drop for Tongs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_tongs(dir: &std::path::Path, kubeconfig: &std::path::Path) -> Tongs {
    let config = dir.join("tongs.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\nworkers: 1\nhealth: {{ enabled: false }}\n\
             discovery:\n  kubernetes:\n    enabled: true\n    kubeconfig: {:?}\n    namespace: {NAMESPACE}\n\
             \x20   label_selector: app.kubernetes.io/part-of=tongs-fleet\n",
            kubeconfig.display().to_string()
        ),
    )
    .expect("config written");
    let started = Instant::now();
    let mut child = Command::new(TONGS)
        .args(["--log-format", "json", "run", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn,tongs=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tongs starts");
    let stderr = child.stderr.take().expect("stderr");
    let (send, receive) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(value) = serde_json::from_str::<Value>(&line)
                && value["message"] == "tongs serving"
            {
                let _ = send.send(value["admin"].as_str().unwrap_or_default().to_owned());
            }
        }
    });
    let admin = receive
        .recv_timeout(Duration::from_secs(30))
        .expect("tongs logs its admin address within 30 s");
    Tongs {
        child,
        admin,
        started,
    }
}

/// One GET on the admin port; status and body.
fn admin_get(admin: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(admin) else {
        return (0, String::new());
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

fn endpoints(admin: &str) -> Option<u64> {
    let (status, body) = admin_get(admin, "/demand");
    if status != 200 {
        return None;
    }
    serde_json::from_str::<Value>(&body).ok()?["endpoints"].as_u64()
}

/// CPU time (user + system) `pid` has used, from /proc.
fn cpu_time(pid: u32) -> Duration {
    support::usage(&[pid]).cpu
}

/// Lists every pod the way the watcher does (pages of 500), reading only the continue tokens: how long
/// the API server alone takes to serve the list, the floor under tongs' start → ready.
async fn raw_list(api: &FakeKubeApi) -> Duration {
    use http_body_util::{BodyExt, Empty};
    #[derive(serde::Deserialize)]
    struct Page {
        metadata: PageMeta,
    }
    #[derive(serde::Deserialize)]
    struct PageMeta {
        #[serde(rename = "continue", default)]
        next: Option<String>,
    }
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let started = Instant::now();
    let mut next: Option<String> = None;
    loop {
        let mut uri = format!(
            "{}/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=app.kubernetes.io%2Fpart-of%3Dtongs-fleet&limit=500",
            api.url()
        );
        if let Some(token) = &next {
            uri.push_str("&continue=");
            uri.push_str(token);
        }
        let request = http::Request::get(uri)
            .header("authorization", format!("Bearer {}", api.token()))
            .body(Empty::new())
            .expect("request");
        let response = client.request(request).await.expect("list answered");
        assert_eq!(response.status(), 200, "raw list");
        let body = response
            .into_body()
            .collect()
            .await
            .expect("list body")
            .to_bytes();
        let page: Page = serde_json::from_slice(&body).expect("a PodList");
        match page.metadata.next.filter(|t| !t.is_empty()) {
            Some(token) => next = Some(token),
            None => return started.elapsed(),
        }
    }
}

struct Run {
    pods: usize,
    /// The API server alone serving the whole list.
    raw_list: Duration,
    ready_after: Duration,
    /// tongs' CPU time until ready.
    cpu_to_ready: Duration,
    /// tongs' CPU time per event (and the polls that waited for it).
    cpu_per_event: Duration,
    endpoints: u64,
    rss_kib: u64,
    peak_kib: u64,
    event_ms: Vec<f64>,
}

async fn run(pods: usize, events: usize) -> Run {
    let api = FakeKubeApi::start().await;
    api.atomically(|cluster| {
        for index in 0..pods {
            cluster.create(pod(index));
        }
    });
    let dir = std::env::temp_dir().join(format!(
        "tongs-bench-discovery-{}-{pods}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let kubeconfig = api.write_kubeconfig(&dir, NAMESPACE);
    let raw_list = raw_list(&api).await;
    let tongs = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || start_tongs(&dir, &kubeconfig)
    })
    .await
    .expect("start");
    let admin = tongs.admin.clone();
    let ready_after = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if admin_get(&admin, "/readyz").0 == 200 {
                return Instant::now();
            }
            assert!(Instant::now() < deadline, "tongs not ready within 60 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    })
    .await
    .expect("ready")
        - tongs.started;
    let cpu_to_ready = cpu_time(tongs.child.id());
    let count = endpoints(&tongs.admin).unwrap_or(0);
    assert_eq!(count, pods as u64, "every pod is an endpoint once ready");
    let memory = support::usage(&[tongs.child.id()]);
    let (rss_kib, peak_kib) = (memory.rss_kib, memory.peak_rss_kib);

    let cpu_before_events = cpu_time(tongs.child.id());
    let mut event_ms = Vec::with_capacity(events);
    for event in 0..events {
        let index = pods + 1_000_000;
        let expected = pods as u64 + u64::from(event % 2 == 0);
        let changed = Instant::now();
        if event % 2 == 0 {
            api.create(pod(index));
        } else {
            api.delete(NAMESPACE, &format!("llm-{index:05}"));
        }
        let admin = tongs.admin.clone();
        let seen = tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if endpoints(&admin) == Some(expected) {
                    return Instant::now();
                }
                assert!(Instant::now() < deadline, "event not visible within 10 s");
            }
        })
        .await
        .expect("event");
        event_ms.push((seen - changed).as_secs_f64() * 1000.0);
    }
    // Includes answering the /demand polls, which the baseline run pays as well.
    let cpu_per_event =
        cpu_time(tongs.child.id()).saturating_sub(cpu_before_events) / events.max(1) as u32;
    let _ = std::fs::remove_dir_all(&dir);
    drop(tongs);
    let stats = api.stats();
    let unexpected = api.unexpected();
    assert!(
        unexpected.is_empty(),
        "the fake API server was asked what it does not serve: {unexpected:?}"
    );
    println!(
        "{pods} pods: the API server saw {} list requests ({} lists), {} watch requests, {} expired",
        stats.list_requests, stats.lists_started, stats.watch_requests, stats.watches_expired
    );
    Run {
        pods,
        raw_list,
        ready_after,
        cpu_to_ready,
        cpu_per_event,
        endpoints: count,
        rss_kib,
        peak_kib,
        event_ms,
    }
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it, and then
    // gets a small smoke run (the same checks: every pod an endpoint, nothing unexpected asked).
    let benchmarking = support::benchmarking();
    let pods = support::env_number("PODS", if benchmarking { 5000 } else { 200 })?;
    let events = support::env_number("EVENTS", if benchmarking { 200 } else { 10 })?;
    if !benchmarking {
        println!(
            "discovery: smoke run with {pods} pods; the benchmark is `cargo bench --bench discovery`"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let runs = runtime.block_on(async {
        let baseline = run(0, events).await;
        let loaded = run(pods, events).await;
        [baseline, loaded]
    });
    println!(
        "machine: {} CPUs",
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    println!();
    println!(
        "| pods | API server alone: list | start → ready | tongs CPU to ready | endpoints | RSS ready | peak RSS | \
         event → visible p50 | p99 | max | tongs CPU per event |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for run in &runs {
        let mut sorted = run.event_ms.clone();
        sorted.sort_by(f64::total_cmp);
        println!(
            "| {} | {:.0} ms | {:.0} ms | {:.0} ms | {} | {:.1} MiB | {:.1} MiB | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms |",
            run.pods,
            run.raw_list.as_secs_f64() * 1000.0,
            run.ready_after.as_secs_f64() * 1000.0,
            run.cpu_to_ready.as_secs_f64() * 1000.0,
            run.endpoints,
            run.rss_kib as f64 / 1024.0,
            run.peak_kib as f64 / 1024.0,
            percentile(&sorted, 50.0).unwrap_or(f64::NAN),
            percentile(&sorted, 99.0).unwrap_or(f64::NAN),
            sorted.last().copied().unwrap_or(f64::NAN),
            run.cpu_per_event.as_secs_f64() * 1000.0,
        );
    }
    let [baseline, loaded] = &runs;
    println!();
    println!(
        "{} pods cost {:.0} ms more to become ready than none (target: usable < 1 s), of which the API \
         server alone takes {:.0} ms to serve the list; {:.1} MiB more RSS once ready and {:.1} MiB \
         more at peak (target < 50 MiB)",
        loaded.pods,
        (loaded.ready_after.as_secs_f64() - baseline.ready_after.as_secs_f64()) * 1000.0,
        loaded.raw_list.as_secs_f64() * 1000.0,
        (loaded.rss_kib as f64 - baseline.rss_kib as f64) / 1024.0,
        (loaded.peak_kib as f64 - baseline.peak_kib as f64) / 1024.0,
    );
    Ok(())
}
